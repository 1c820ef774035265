/* The CUDA emulator's own C interface: what the fake cuBLASLt and cuDNN (and the runtime) share.
   The emulator runs dlua's CUDA backend on the CPU: device memory is host memory that is readable only while
   queued device work runs, and every stream is a queue that runs when the host waits on it. */
#ifndef DLUA_CUEMU_H
#define DLUA_CUEMU_H
#include <stddef.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Queues fn(arg) on stream s (0: the legacy default stream) as device work: it runs later, in stream order,
   with device memory accessible. arg (size bytes) is copied at the call, so the caller may free its own. */
void cuemu_enqueue(cudaStream_t s, void (*fn)(void *arg), const void *arg, size_t size);

/* Whether p .. p+n-1 lies in one device allocation (1), in pinned host memory (2), or neither (0). */
int cuemu_memory_kind(const void *p, size_t n);

/* Reports an error found while device work ran (bad access, deadlock): it becomes the sticky error that the
   next cudaGetLastError / synchronize returns, and its text is printed once on stderr. */
void cuemu_fail(const char *fmt, ...);

#ifdef __cplusplus
}
#endif
#endif

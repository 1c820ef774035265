/* The CUDA device layer: devices, streams, events, the caching allocators (device and pinned host)
   over cudaMalloc/cudaHostAlloc, copies, and the run-time versions for `dlua -v`. */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/alloc.h"
#include "core/api.h"
#include "core/error.h"
#include "cuda/caching_alloc.h"
#include "cuda/stream_handle.h"
#include "cuda/kernels.h"

enum { MAX_DEVICES = DLUA_ALLOC_MAX_DEVICES };

struct dlua_cuda_stream {
  cudaStream_t s;
  int device;
  struct dlua_cuda_stream *next_free;
  int active;        /* threads whose current stream it is (atomic) */
  uint64_t released; /* the allocator's clock when it last stopped being current (atomic) */
  int listed;        /* in side[device] (under stream_lock) */
};

struct dlua_cuda_event {
  cudaEvent_t e;
  int device;
  int timing;
};

/* ---- discovery ---------------------------------------------------------------------------------- */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int ndevices;
static char reason[256];
static dlua_caching_alloc_t *dev_alloc, *host_alloc;

static dlua_status_t raw_device_alloc(void *ctx, int device, size_t bytes, void **ptr);
static void raw_device_free(void *ctx, int device, void *ptr);
static dlua_status_t raw_host_alloc(void *ctx, int device, size_t bytes, void **ptr);
static void raw_host_free(void *ctx, int device, void *ptr);
static dlua_status_t raw_record(void *ctx, int device, void *stream, void **event);
static int raw_query(void *ctx, int device, void *event);
static void raw_sync(void *ctx, int device, void *event);
static void raw_destroy(void *ctx, int device, void *event);

static void init(void) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // No driver, an old driver (error 35 on machines without a GPU), no device: all mean zero devices.
    snprintf(reason, sizeof reason, "%s (CUDA error %d)", cudaGetErrorString(err), (int)err);
    cudaGetLastError();
    n = 0;
  } else if (n == 0) {
    snprintf(reason, sizeof reason, "the driver reports no devices");
  }
  if (n > MAX_DEVICES) n = MAX_DEVICES;
  if (n > 0) {
    dlua_raw_source_t d = {NULL, "cuda:%d", raw_device_alloc, raw_device_free, raw_record, raw_query, raw_sync, raw_destroy};
    dlua_raw_source_t h = {NULL, "pinned host memory", raw_host_alloc, raw_host_free, raw_record, raw_query, raw_sync, raw_destroy};
    if (dlua_caching_alloc_create(&dev_alloc, &d, n) != DLUA_OK || dlua_caching_alloc_create(&host_alloc, &h, 1) != DLUA_OK) {
      snprintf(reason, sizeof reason, "out of host memory creating the allocators");
      n = 0;
    }
  }
  ndevices = n;
}

int dlua_cuda_device_count(void) {
  pthread_once(&init_once, init);
  return ndevices;
}

const char *dlua_cuda_unavailable_reason(void) {
  pthread_once(&init_once, init);
  return ndevices > 0 ? "" : reason;
}

static dlua_status_t cuda_fail(const char *op, cudaError_t err, int device) {
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  return DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d, cuda:%d)", op, cudaGetErrorString(err), (int)err, device);
}
#define CUDA_TRY(op, call, device)                         \
  do {                                                     \
    cudaError_t e_ = (call);                               \
    if (e_ != cudaSuccess) return cuda_fail(op, e_, device); \
  } while (0)

/* Resolves device -1 to the current one and checks it exists. */
static dlua_status_t need_device(const char *op, int *device) {
  pthread_once(&init_once, init);
  if (ndevices == 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: no CUDA device available (%s)", op, reason);
  if (*device < 0) {
    int cur = 0;
    CUDA_TRY(op, cudaGetDevice(&cur), -1);
    *device = cur;
  }
  if (*device >= ndevices)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: no device cuda:%d (%d CUDA device%s)", op, *device, ndevices, ndevices == 1 ? "" : "s");
  return DLUA_OK;
}

dlua_status_t dlua_cuda_get_device_capability(int device, int *major, int *minor) {
  *major = *minor = 0;
  DLUA_TRY(need_device("get_device_capability", &device));
  struct cudaDeviceProp p;
  CUDA_TRY("get_device_capability", cudaGetDeviceProperties(&p, device), device);
  *major = p.major;
  *minor = p.minor;
  return DLUA_OK;
}

/* Makes `device` current for a call and restores the previous one after. */
typedef struct {
  int prev, device;
} guard_t;
static guard_t guard_enter(int device) {
  guard_t g = {device, device};
  if (cudaGetDevice(&g.prev) != cudaSuccess) g.prev = device;
  if (g.prev != device) cudaSetDevice(device);
  return g;
}
static void guard_exit(guard_t g) {
  if (g.prev != g.device) cudaSetDevice(g.prev);
}

dlua_status_t dlua_cuda_set_device(int device) {
  if (device < 0) return DLUA_ERR(DLUA_ERR_ARG, "set_device: invalid device %d", device);
  DLUA_TRY(need_device("set_device", &device));
  CUDA_TRY("set_device", cudaSetDevice(device), device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_get_device(int *device) {
  *device = -1;
  DLUA_TRY(need_device("current_device", device));
  return DLUA_OK;
}

dlua_status_t dlua_cuda_synchronize(int device) {
  DLUA_TRY(need_device("synchronize", &device));
  guard_t g = guard_enter(device);
  cudaError_t e = cudaDeviceSynchronize();
  guard_exit(g);
  if (e != cudaSuccess) return cuda_fail("synchronize", e, device);
  return DLUA_OK;
}

/* ---- run-time versions --------------------------------------------------------------------------- */

/* The version a shared library reports, loaded the way the backend will load it (dlopen). */
static void lib_version(char *out, size_t len, const char *label, const char *const *names, const char *sym, int style) {
  for (int i = 0; names[i]; i++) {
    void *h = dlopen(names[i], RTLD_LAZY | RTLD_LOCAL);
    if (!h) continue;
    void *f = dlsym(h, sym);
    if (style == 0 && f) {  // size_t fn(void): cudnnGetVersion, cublasLtGetVersion
      size_t v = ((size_t(*)(void))f)();
      if (strcmp(label, "cuDNN") == 0)
        snprintf(out, len, "%s %zu.%zu.%zu (%s)", label, v / 10000, (v % 10000) / 100, v % 100, names[i]);
      else
        snprintf(out, len, "%s %zu.%zu.%zu (%s)", label, v / 10000, (v % 10000) / 100, v % 100, names[i]);
    } else if (style == 1 && f) {  // ncclResult_t ncclGetVersion(int *)
      int v = 0;
      ((int (*)(int *))f)(&v);
      snprintf(out, len, "%s %d.%d.%d (%s)", label, v / 10000, (v % 10000) / 100, v % 100, names[i]);
    } else {
      snprintf(out, len, "%s (%s, no version symbol)", label, names[i]);
    }
    return;  // the handle stays open: the backend uses the library later
  }
  snprintf(out, len, "%s not found", label);
}

const char *dlua_cuda_runtime_info(void) {
  static char info[2048];
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_once(&init_once, init);
  if (ndevices == 0) {
    pthread_mutex_lock(&lock);
    snprintf(info, sizeof info, "no CUDA device available (%s)", reason);
    pthread_mutex_unlock(&lock);
    return info;
  }
  pthread_mutex_lock(&lock);
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  size_t off = (size_t)snprintf(info, sizeof info, "driver CUDA %d.%d, runtime %d.%d", drv / 1000, (drv % 1000) / 10,
                                rt / 1000, (rt % 1000) / 10);
  for (int d = 0; d < ndevices && off < sizeof info; d++) {
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    off += (size_t)snprintf(info + off, sizeof info - off, "\ncuda:%d %s, %.1f GiB, sm_%d%d", d, p.name,
                            (double)p.totalGlobalMem / (1 << 30), p.major, p.minor);
  }
#ifdef DLUA_CUDA_EMU  // the emulator's own libraries (host/cuemu), and no NCCL
  static const char *const cudnn[] = {DLUA_CUEMU_CUDNN, NULL};
  static const char *const cublas[] = {DLUA_CUEMU_CUBLASLT, NULL};
  static const char *const nccl[] = {NULL};
#else
  static const char *const cudnn[] = {"libcudnn.so.9", "libcudnn.so", NULL};
  static const char *const cublas[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so", NULL};
  static const char *const nccl[] = {"libnccl.so.2", "libnccl.so", NULL};
#endif
  char a[256], b[256], c[256];
  lib_version(a, sizeof a, "cuDNN", cudnn, "cudnnGetVersion", 0);
  lib_version(b, sizeof b, "cuBLASLt", cublas, "cublasLtGetVersion", 0);
  lib_version(c, sizeof c, "NCCL", nccl, "ncclGetVersion", 1);
  if (off < sizeof info) snprintf(info + off, sizeof info - off, "\nloaded: %s, %s, %s", a, b, c);
  pthread_mutex_unlock(&lock);
  return info;
}

/* ---- streams and events -------------------------------------------------------------------------
   Stream objects are never freed: destroy synchronizes and keeps the object for the next create on
   that device, so a pointer the allocator keys blocks by (or recorded as a use) stays valid. */

static pthread_mutex_t stream_lock = PTHREAD_MUTEX_INITIALIZER;
static dlua_cuda_stream_t *free_streams[MAX_DEVICES];
static dlua_cuda_stream_t default_streams[MAX_DEVICES];  // s = 0 (the legacy default stream)
static __thread dlua_cuda_stream_t *current[MAX_DEVICES];

/* Automatic record_stream. Work queued on a stream other than a block's own may use the block; freeing it must
   then not hand its memory out again before that work ran. A block may have been used by every stream that was
   current (on any thread) at some time since the block was handed out: dlua_cuda_free records those streams
   on it, so the allocator waits for their work (events) before reuse. The streams ever made current are listed
   per device; a program that never leaves the default stream pays nothing. (PyTorch leaves this to the user:
   t.record_stream(s), or memory reused under running work.) */
enum { MAX_SIDE = 256 };
static dlua_cuda_stream_t *side[MAX_DEVICES][MAX_SIDE];
static int nside[MAX_DEVICES];

static void stream_enter(dlua_cuda_stream_t *s) {
  __atomic_add_fetch(&s->active, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&stream_lock);
  if (!s->listed && nside[s->device] < MAX_SIDE) {
    side[s->device][nside[s->device]++] = s;
    s->listed = 1;
  }
  pthread_mutex_unlock(&stream_lock);
}

static void stream_leave(dlua_cuda_stream_t *s) {
  __atomic_store_n(&s->released, dlua_caching_alloc_clock(dev_alloc, s->device), __ATOMIC_SEQ_CST);
  __atomic_sub_fetch(&s->active, 1, __ATOMIC_SEQ_CST);
}

dlua_status_t dlua_cuda_stream_create(dlua_cuda_stream_t **out, int device) {
  *out = NULL;
  DLUA_TRY(need_device("Stream", &device));
  pthread_mutex_lock(&stream_lock);
  dlua_cuda_stream_t *s = free_streams[device];
  if (s) free_streams[device] = s->next_free;
  pthread_mutex_unlock(&stream_lock);
  if (!s) {
    s = calloc(1, sizeof *s);
    if (!s) return DLUA_ERR(DLUA_ERR_OOM, "Stream: out of host memory");
    guard_t g = guard_enter(device);
    cudaError_t e = cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking);
    guard_exit(g);
    if (e != cudaSuccess) {
      free(s);
      return cuda_fail("Stream", e, device);
    }
    s->device = device;
  }
  s->next_free = NULL;
  *out = s;
  return DLUA_OK;
}

void dlua_cuda_stream_destroy(dlua_cuda_stream_t *s) {
  if (!s || s->s == 0) return;
  cudaStreamSynchronize(s->s);
  for (int d = 0; d < MAX_DEVICES; d++)
    if (current[d] == s) {
      stream_leave(s);
      current[d] = NULL;
    }
  pthread_mutex_lock(&stream_lock);
  s->next_free = free_streams[s->device];
  free_streams[s->device] = s;
  pthread_mutex_unlock(&stream_lock);
}

int dlua_cuda_stream_device(const dlua_cuda_stream_t *s) { return s ? s->device : -1; }

dlua_cuda_stream_t *dlua_cuda_current_stream(int device) {
  if (need_device("current_stream", &device) != DLUA_OK) {
    dlua_clear_error();
    return NULL;
  }
  if (current[device]) return current[device];
  default_streams[device].device = device;
  return &default_streams[device];
}

dlua_status_t dlua_cuda_set_current_stream(int device, dlua_cuda_stream_t *s) {
  if (s) device = s->device;
  DLUA_TRY(need_device("set_stream", &device));
  dlua_cuda_stream_t *now = s && s->s ? s : NULL, *old = current[device];
  if (now == old) return DLUA_OK;
  if (now) stream_enter(now);
  if (old) stream_leave(old);
  current[device] = now;
  return DLUA_OK;
}

static cudaStream_t stream_of(dlua_cuda_stream_t *s, int device) {
  if (!s) s = dlua_cuda_current_stream(device);
  return s ? s->s : 0;
}

/* For the kernels (host/cuda/kernels.h): they queue on the device's current stream. */
void *dlua_cuda_raw_stream(int device) { return (void *)stream_of(NULL, device); }

dlua_status_t dlua_cuda_stream_synchronize(dlua_cuda_stream_t *s) {
  int device = s ? s->device : -1;
  DLUA_TRY(need_device("Stream:synchronize", &device));
  CUDA_TRY("Stream:synchronize", cudaStreamSynchronize(stream_of(s, device)), device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_stream_query(dlua_cuda_stream_t *s, int *done) {
  *done = 0;
  int device = s ? s->device : -1;
  DLUA_TRY(need_device("Stream:query", &device));
  cudaError_t e = cudaStreamQuery(stream_of(s, device));
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return DLUA_OK;
  }
  if (e != cudaSuccess) return cuda_fail("Stream:query", e, device);
  *done = 1;
  return DLUA_OK;
}

dlua_status_t dlua_cuda_stream_wait_event(dlua_cuda_stream_t *s, dlua_cuda_event_t *e) {
  if (!e) return DLUA_ERR(DLUA_ERR_ARG, "Stream:wait: expected an event");
  int device = s ? s->device : e->device;
  DLUA_TRY(need_device("Stream:wait", &device));
  CUDA_TRY("Stream:wait", cudaStreamWaitEvent(stream_of(s, device), e->e, 0), device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_event_create(dlua_cuda_event_t **out, int device, int enable_timing) {
  *out = NULL;
  DLUA_TRY(need_device("Event", &device));
  dlua_cuda_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return DLUA_ERR(DLUA_ERR_OOM, "Event: out of host memory");
  guard_t g = guard_enter(device);
  cudaError_t e = cudaEventCreateWithFlags(&ev->e, enable_timing ? cudaEventDefault : cudaEventDisableTiming);
  guard_exit(g);
  if (e != cudaSuccess) {
    free(ev);
    return cuda_fail("Event", e, device);
  }
  ev->device = device;
  ev->timing = enable_timing != 0;
  *out = ev;
  return DLUA_OK;
}

void dlua_cuda_event_destroy(dlua_cuda_event_t *e) {
  if (!e) return;
  cudaEventDestroy(e->e);
  free(e);
}

dlua_status_t dlua_cuda_event_record(dlua_cuda_event_t *e, dlua_cuda_stream_t *s) {
  if (!e) return DLUA_ERR(DLUA_ERR_ARG, "Event:record: expected an event");
  if (s && s->device != e->device)
    return DLUA_ERR(DLUA_ERR_ARG, "Event:record: event on cuda:%d, stream on cuda:%d", e->device, s->device);
  guard_t g = guard_enter(e->device);
  cudaError_t err = cudaEventRecord(e->e, stream_of(s, e->device));
  guard_exit(g);
  if (err != cudaSuccess) return cuda_fail("Event:record", err, e->device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_event_query(dlua_cuda_event_t *e, int *done) {
  *done = 0;
  if (!e) return DLUA_ERR(DLUA_ERR_ARG, "Event:query: expected an event");
  cudaError_t err = cudaEventQuery(e->e);
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return DLUA_OK;
  }
  if (err != cudaSuccess) return cuda_fail("Event:query", err, e->device);
  *done = 1;
  return DLUA_OK;
}

dlua_status_t dlua_cuda_event_synchronize(dlua_cuda_event_t *e) {
  if (!e) return DLUA_ERR(DLUA_ERR_ARG, "Event:synchronize: expected an event");
  CUDA_TRY("Event:synchronize", cudaEventSynchronize(e->e), e->device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_event_elapsed(const dlua_cuda_event_t *start, const dlua_cuda_event_t *end, double *ms) {
  *ms = 0;
  if (!start || !end) return DLUA_ERR(DLUA_ERR_ARG, "Event:elapsed_time: expected two events");
  if (!start->timing || !end->timing)
    return DLUA_ERR(DLUA_ERR_ARG, "Event:elapsed_time: both events need enable_timing = true");
  float f = 0;
  CUDA_TRY("Event:elapsed_time", cudaEventElapsedTime(&f, start->e, end->e), start->device);
  *ms = f;
  return DLUA_OK;
}

/* ---- raw sources for the caching allocators ------------------------------------------------------
   Allocator streams are dlua_cuda_stream_t pointers (stable, see above); NULL is the default stream. */

static dlua_status_t raw_device_alloc(void *ctx, int device, size_t bytes, void **ptr) {
  guard_t g = guard_enter(device);
  cudaError_t e = cudaMalloc(ptr, bytes);
  guard_exit(g);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return DLUA_ERR_OOM;
  }
  if (e != cudaSuccess) return cuda_fail("cudaMalloc", e, device);
  return DLUA_OK;
}

static void raw_device_free(void *ctx, int device, void *ptr) {
  guard_t g = guard_enter(device);
  cudaFree(ptr);  // synchronizes the device: no queued kernel still reads the segment
  guard_exit(g);
}

static dlua_status_t raw_host_alloc(void *ctx, int device, size_t bytes, void **ptr) {
  cudaError_t e = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return DLUA_ERR_OOM;
  }
  if (e != cudaSuccess) return cuda_fail("cudaHostAlloc", e, -1);
  return DLUA_OK;
}

static void raw_host_free(void *ctx, int device, void *ptr) { cudaFreeHost(ptr); }

/* Events for blocks used on other streams. The stream's own device owns the event (the pinned
   allocator's "device" 0 says nothing about which GPU used the memory). */
static dlua_status_t raw_record(void *ctx, int device, void *stream, void **event) {
  dlua_cuda_stream_t *s = stream;
  int dev = s ? s->device : device;
  guard_t g = guard_enter(dev);
  cudaEvent_t e;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err == cudaSuccess) {
    err = cudaEventRecord(e, s ? s->s : 0);
    if (err != cudaSuccess) cudaEventDestroy(e);
  }
  guard_exit(g);
  if (err != cudaSuccess) return cuda_fail("record_stream", err, dev);
  *event = (void *)e;
  return DLUA_OK;
}

static int raw_query(void *ctx, int device, void *event) {
  cudaError_t e = cudaEventQuery((cudaEvent_t)event);
  if (e == cudaSuccess) return 1;
  cudaGetLastError();
  return e == cudaErrorNotReady ? 0 : -1;
}

static void raw_sync(void *ctx, int device, void *event) { cudaEventSynchronize((cudaEvent_t)event); }
static void raw_destroy(void *ctx, int device, void *event) { cudaEventDestroy((cudaEvent_t)event); }

/* ---- memory ---------------------------------------------------------------------------------------- */

dlua_status_t dlua_cuda_memory_stats(int device, dlua_memory_stats_t *out) {
  *out = (dlua_memory_stats_t){0};
  if (device == DLUA_CPU) {
    int d = 0;
    DLUA_TRY(need_device("memory_stats", &d));
    dlua_caching_alloc_stats(host_alloc, 0, out);
    return DLUA_OK;
  }
  DLUA_TRY(need_device("memory_stats", &device));
  dlua_caching_alloc_stats(dev_alloc, device, out);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_reset_peak_memory_stats(int device) {
  DLUA_TRY(need_device("reset_peak_memory_stats", &device));
  dlua_caching_alloc_reset_peak(dev_alloc, device);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_empty_cache(int device) {
  DLUA_TRY(need_device("empty_cache", &device));
  dlua_caching_alloc_empty_cache(dev_alloc, device);
  dlua_caching_alloc_empty_cache(host_alloc, 0);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_malloc(void **ptr, int device, size_t bytes, dlua_cuda_stream_t *stream) {
  *ptr = NULL;
  if (stream) device = stream->device;
  DLUA_TRY(need_device("cuda alloc", &device));
  if (!stream) stream = dlua_cuda_current_stream(device);
  if (stream == &default_streams[device]) stream = NULL;  // one key for the default stream
  dlua_status_t st = dlua_caching_alloc_malloc(dev_alloc, device, stream, bytes, ptr);
  if (st == DLUA_ERR_OOM) {  // the allocator's account, then what the device has (other processes use it too)
    char why[900];
    snprintf(why, sizeof why, "%s", dlua_last_error());
    char *at = strrchr(why, '(');
    if (at && at > why && at[-1] == ' ' && strchr(at, ':')) at[-1] = 0;  // its "(file:line)": ours follows
    size_t free_b = 0, total = 0;
    guard_t g = guard_enter(device);
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) cudaGetLastError();
    guard_exit(g);
    char t[40], f[40];
    return DLUA_ERR(DLUA_ERR_OOM, "%s; cuda:%d has %s in all, %s of it free", why, device,
                    dlua_caching_alloc_human(t, sizeof t, (int64_t)total),
                    dlua_caching_alloc_human(f, sizeof f, (int64_t)free_b));
  }
  if (st != DLUA_OK) return st;
  dlua_memory_note_alloc(device, bytes);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_free(int device, void *ptr) {
  if (!ptr) return DLUA_OK;
  DLUA_TRY(need_device("cuda free", &device));
  size_t bytes = 0;
  void *own = NULL;
  uint64_t born = 0;
  DLUA_TRY(dlua_caching_alloc_block_info(dev_alloc, device, ptr, &bytes, &own, &born));
  // A block of a side stream (made while it was current) is used on the default stream once that is current
  // again, as a prefetched batch is: the default stream's work must end before the side stream reuses it.
  if (own) DLUA_TRY(dlua_caching_alloc_record_stream(dev_alloc, device, ptr, NULL));
  if (__atomic_load_n(&nside[device], __ATOMIC_ACQUIRE) > 0) {  // the streams that may have used it (above)
    dlua_cuda_stream_t *users[MAX_SIDE];
    int n = 0;
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < nside[device]; i++) {
      dlua_cuda_stream_t *s = side[device][i];
      if (__atomic_load_n(&s->active, __ATOMIC_SEQ_CST) > 0 || __atomic_load_n(&s->released, __ATOMIC_SEQ_CST) >= born)
        users[n++] = s;
    }
    pthread_mutex_unlock(&stream_lock);
    for (int i = 0; i < n; i++) DLUA_TRY(dlua_caching_alloc_record_stream(dev_alloc, device, ptr, users[i]));
  }
  DLUA_TRY(dlua_caching_alloc_free(dev_alloc, device, ptr));
  dlua_memory_note_free(device, bytes);
  return DLUA_OK;
}

dlua_status_t dlua_cuda_record_stream(int device, void *ptr, dlua_cuda_stream_t *stream) {
  int pinned = device == DLUA_CPU;
  if (stream) device = stream->device;
  else if (pinned) device = -1;
  DLUA_TRY(need_device("record_stream", &device));
  if (!stream) stream = dlua_cuda_current_stream(device);
  // Pinned blocks have no stream of their own: every use counts, the default stream's included.
  if (pinned) return dlua_caching_alloc_record_stream(host_alloc, 0, ptr, stream);
  if (stream == &default_streams[device]) stream = NULL;
  return dlua_caching_alloc_record_stream(dev_alloc, device, ptr, stream);
}

dlua_status_t dlua_cuda_host_alloc(void **ptr, size_t bytes) {
  *ptr = NULL;
  int d = -1;
  DLUA_TRY(need_device("pin_memory", &d));
  return dlua_caching_alloc_malloc(host_alloc, 0, NULL, bytes, ptr);
}

dlua_status_t dlua_cuda_host_free(void *ptr) {
  if (!ptr) return DLUA_OK;
  int d = -1;
  DLUA_TRY(need_device("pinned free", &d));
  return dlua_caching_alloc_free(host_alloc, 0, ptr);
}

dlua_status_t dlua_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int async, dlua_cuda_stream_t *stream) {
  static const enum cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice};
  if (kind < 0 || kind > 2) return DLUA_ERR(DLUA_ERR_ARG, "cuda memcpy: kind %d (expected 0, 1 or 2)", kind);
  int device = stream ? stream->device : -1;
  DLUA_TRY(need_device("cuda memcpy", &device));
  if (bytes == 0) return DLUA_OK;
  guard_t g = guard_enter(device);
  cudaError_t e = async ? cudaMemcpyAsync(dst, src, bytes, kinds[kind], stream_of(stream, device))
                        : cudaMemcpy(dst, src, bytes, kinds[kind]);
  guard_exit(g);
  if (e != cudaSuccess) return cuda_fail("cuda memcpy", e, device);
  return DLUA_OK;
}

/* ---- for other CUDA-aware C files (cuda/stream_handle.h) ------------------------------------------ */

void *dlua_cuda_stream_handle(dlua_cuda_stream_t *s, int device) { return (void *)stream_of(s, device); }

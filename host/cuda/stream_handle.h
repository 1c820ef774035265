/* The raw cudaStream_t behind a dlua stream, for CUDA builds' C files that call libraries taking one (NCCL). */
#ifndef DLUA_CUDA_STREAM_HANDLE_H
#define DLUA_CUDA_STREAM_HANDLE_H
#include "core/api.h"

/* s's cudaStream_t (s NULL: the calling thread's current stream on `device`), as a void pointer so that
   this header needs no CUDA headers. Only in CUDA builds (device.c). */
void *dlua_cuda_stream_handle(dlua_cuda_stream_t *s, int device);

#endif

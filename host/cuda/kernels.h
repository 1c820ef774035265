/* What the CUDA backend's files share among themselves (the ops reach them through the backend table,
   host/ops/backend.h): the stream kernels queue on. */
#ifndef DLUA_CUDA_KERNELS_H
#define DLUA_CUDA_KERNELS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The raw cudaStream_t (as void *) that kernels for `device` queue on: its current stream. */
void *dlua_cuda_raw_stream(int device);


#ifdef __cplusplus
}
#endif
#endif

/* What the CUDA kernels of the index family share (host/cuda/index.cu, sort.cu): the sort slots of
   dlua_cuda_index_ops, and the stable radix sorts. The family's descriptors: host/kernels/index.h. */
#ifndef DLUA_CUDA_INDEX_CUDA_H
#define DLUA_CUDA_INDEX_CUDA_H
#include <stdint.h>
#include "core/api.h"
#include "kernels/index.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The sort and topk slots of dlua_cuda_index_ops (sort.cu). */
dlua_status_t dlua_cuda_sort(const char *op, const dlua_sort_t *s);
dlua_status_t dlua_cuda_topk(const char *op, const dlua_sort_t *s);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#include <cuda_runtime_api.h>
#include "cuda/device_guard.cuh"
namespace dlua_cu {
/* Stable radix sorts of n (key, value) pairs on bits [0, end_bit) of the keys, on stream s of `device`
   (host/cuda/index.cu; CUB's DeviceRadixSort, scratch from the caching allocator). */
dlua_status_t sort_pairs(const char *op, const uint64_t *kin, uint64_t *kout, const uint32_t *vin, uint32_t *vout,
                         int64_t n, int end_bit, int device, cudaStream_t s);
dlua_status_t sort_pairs(const char *op, const uint32_t *kin, uint32_t *kout, const uint32_t *vin, uint32_t *vout,
                         int64_t n, int end_bit, int device, cudaStream_t s);
/* Bits needed to write the values 0..max. */
inline int bits_for(uint64_t max) {
  int b = 0;
  while (max) {
    b++;
    max >>= 1;
  }
  return b;
}
}  // namespace dlua_cu
#endif
#endif

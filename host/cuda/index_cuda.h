/* The interface between the C indexing, sorting and reduction entry points (host/cpu/index.c, sort.c,
   reduce.c) and their CUDA kernels (host/cuda/index.cu, sort.cu, reduce.cu). */
#ifndef DLUA_CUDA_INDEX_CUDA_H
#define DLUA_CUDA_INDEX_CUDA_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor's layout as kernels address it: up to DLUA_MAX_DIMS dims, strides in elements. */
typedef struct {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t strides[DLUA_MAX_DIMS];
} dlua_cuda_layout_t;

/* Position of the first value of a contiguous int32/int64 (is64) buffer of n values outside
   [base, base + size) into *first (-1 when all are in range) and that value into *value. Waits for the
   answer (one 16-byte copy back). */
dlua_status_t dlua_cuda_index_first_bad(const char *op, const void *index, int is64, int64_t n, int64_t size,
                                        int64_t base, int64_t *first, int64_t *value, int device);

/* index_select (mode 0) and gather (mode 1): out (contiguous, `lay`'s sizes) element e at coordinates c
   copies src at sum_d c[d] * lay.strides[d], where coordinate `dim` is replaced by index[c[dim]] - base
   (mode 0) or index[e] - base (mode 1). elsize: bytes per element (bits are copied). */
dlua_status_t dlua_cuda_index_gather(const char *op, int mode, int elsize, void *out, const void *src,
                                     const dlua_cuda_layout_t *lay, int dim, const void *index, int is64,
                                     int64_t base, int device);

/* t[fiber][index[l] - base] += src[fiber][l] along dim, for every fiber (all coordinates of `index` but
   dim) and l in order, with the CPU's arithmetic (storage rounding after every add; integers wrap).
   idx_sizes: index's sizes (contiguous); t_strides / s_strides: t's and src's element strides; t_dim_size:
   t's size at dim. src has t's dtype. Deterministic: each t element adds its terms in increasing l. */
dlua_status_t dlua_cuda_scatter_add(const char *op, int dtype, void *t, const int64_t *t_strides, int64_t t_dim_size,
                                    const void *src, const int64_t *s_strides, int ndim, const int64_t *idx_sizes,
                                    int dim, const void *index, int is64, int64_t base, int device);

/* one_hot: out (n, classes) of elsize bytes is 0 except out[i][labels[i] - base] = the bits `one`. */
dlua_status_t dlua_cuda_one_hot(const char *op, int elsize, uint64_t one, void *out, const void *labels, int is64,
                                int64_t n, int64_t classes, int64_t base, int device);

/* Sort (topk = 0) or top-k (topk = 1) of every row of `a` (layout `lay`, dtype) along dim, with
   host/kernels/sort_keys.h's keys: values (a's dtype) and int64 indices (position + base), contiguous with
   the shape of `a` where dim has `len` entries; either output may be NULL. Sort: len = n, ascending or
   (descending) descending, stable. Top-k: len = k, the k largest (or smallest) keys by value or
   magnitude, ties to the lower position; sorted by key (ties by position) or, unsorted, by position. */
dlua_status_t dlua_cuda_sort(const char *op, int topk, int dtype, const void *a, const dlua_cuda_layout_t *lay,
                             int dim, int64_t len, int descending_or_largest, int by_magnitude, int sorted,
                             void *values, int64_t *indices, int64_t index_base, int device);

/* dlua_cuda_reduce (host/cuda/kernels.h) with a parameter: the order of a norm (kind 9), the correction of
   var/std (kinds 10, 11); ignored by the other kinds. */
dlua_status_t dlua_cuda_reduce_p(const char *op, int kind, int dtype, int out_dtype, const void *x, void *y,
                                 int64_t *idx, int64_t outer, int64_t n, int64_t index_base, double p, int device);

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

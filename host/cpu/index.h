/* Internal helpers shared by the CPU indexing, sorting, GEMM and compression kernels (index.c, sort.c, linalg.c, compress.c). */
#ifndef DLUA_CPU_INDEX_H
#define DLUA_CPU_INDEX_H
#include "core/tensor.h"
#include "ops/common.h"

/* Element offset of row-major linear position `lin` in a tensor of (sizes, strides). */
static inline int64_t dlua_cpu_unravel(int ndim, const int64_t *sizes, const int64_t *strides, int64_t lin) {
  int64_t off = 0;
  for (int d = ndim - 1; d >= 0 && lin; d--) {
    int64_t q = lin / sizes[d];
    off += (lin - q * sizes[d]) * strides[d];
    lin = q;
  }
  return off;
}

/* Reads element i of a contiguous int32 or int64 index buffer. */
static inline int64_t dlua_cpu_index_at(const void *p, int is64, int64_t i) {
  return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* DLUA_ERR_ARG for the first value of a contiguous index buffer outside [base, base + size),
   naming the op, the value as the caller wrote it and the valid range. The buffer may live on a
   CUDA device (the search runs there; the answer is waited for). */
dlua_status_t dlua_cpu_check_indices(const char *op, const dlua_tensor_t *index, int64_t size, int64_t base,
                                     const char *what);

/* Positions (increasing) of the k largest |x| of n contiguous f32: the radix select of topk (sort.c). */
dlua_status_t dlua_cpu_topk_abs_f32(const float *x, int64_t n, int64_t k, int64_t *pos);

#endif

/* Internal helpers shared by the CPU indexing, sorting, GEMM and compression kernels (index.c, sort.c, linalg.c,
   compress.c), and the sort kernels that index.c's table holds. */
#ifndef DLUA_CPU_INDEX_H
#define DLUA_CPU_INDEX_H
#include "core/tensor.h"
#include "kernels/blas.h"
#include "kernels/index.h"

/* Element offset of row-major linear position `lin` in a tensor of (sizes, strides): dlua_unravel (kernels/blas.h). */

/* Reads element i of a contiguous int32 or int64 index buffer. */
static inline int64_t dlua_cpu_index_at(const void *p, int is64, int64_t i) {
  return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* The sort and topk slots of dlua_cpu_index_ops (sort.c). */
dlua_status_t dlua_cpu_sort(const char *op, const dlua_sort_t *s);
dlua_status_t dlua_cpu_topk(const char *op, const dlua_sort_t *s);

/* Positions (increasing) of the k largest |x| of n contiguous f32: the radix select of topk (sort.c). */
dlua_status_t dlua_cpu_topk_abs_f32(const float *x, int64_t n, int64_t k, int64_t *pos);

#endif

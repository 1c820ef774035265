/* Internal helpers shared by the CPU indexing, sorting, GEMM and compression kernels (index.c, sort.c, linalg.c, compress.c). */
#ifndef DLUA_CPU_INDEX_H
#define DLUA_CPU_INDEX_H
#include "core/tensor.h"

/* Where a kernel that writes contiguous `dtype` elements puts its result: *out itself when
   that is already a contiguous tensor of `dtype` sharing no storage with the inputs, else a
   temporary that dlua_cpu_out_finish copies (and casts) into *out. */
typedef struct {
  dlua_tensor_t *dst;  // what the kernel writes
  int allocated;       // *out was NULL and was allocated here
} dlua_cpu_out_t;

dlua_status_t dlua_cpu_out_begin(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                 dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs,
                                 dlua_cpu_out_t *plan);
/* The same for a result on `device` (DLUA_CPU or a CUDA ordinal): *out must live there. */
dlua_status_t dlua_cpu_out_begin_on(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                    dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs, int device,
                                    dlua_cpu_out_t *plan);
/* Given the kernel's status: on success copies a temporary into *out; on failure releases what
   dlua_cpu_out_begin allocated (and resets *out if it was allocated there). */
dlua_status_t dlua_cpu_out_finish(dlua_tensor_t **out, dlua_cpu_out_t *plan, dlua_status_t status);

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

/* Checks that `index` is a CPU int32/int64 tensor and returns a contiguous handle on it
   (the same storage when it already is contiguous). */
dlua_status_t dlua_cpu_index_contiguous(const char *op, const char *what, const dlua_tensor_t *index,
                                        dlua_tensor_t **contig);
/* The same for an index that must live on `device` (DLUA_CPU or a CUDA ordinal). */
dlua_status_t dlua_index_contiguous_on(const char *op, const char *what, const dlua_tensor_t *index, int device,
                                       dlua_tensor_t **contig);
/* DLUA_ERR_ARG for the first value of a contiguous index buffer outside [base, base + size),
   naming the op, the value as the caller wrote it and the valid range. The buffer may live on a
   CUDA device (the search runs there; the answer is waited for). */
dlua_status_t dlua_cpu_check_indices(const char *op, const dlua_tensor_t *index, int64_t size, int64_t base,
                                     const char *what);

/* Positions (increasing) of the k largest |x| of n contiguous f32: the radix select of topk (sort.c). */
dlua_status_t dlua_cpu_topk_abs_f32(const float *x, int64_t n, int64_t k, int64_t *pos);

#endif

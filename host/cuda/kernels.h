/* The internal interface between the C dispatchers (host/cpu, host/core) and the CUDA kernels. */
#ifndef DLUA_CUDA_KERNELS_H
#define DLUA_CUDA_KERNELS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What an element-wise launch does. Positions (`op`) are those of the X-macro lists in
   host/kernels/elementwise_ops.h, so the CPU and CUDA number ops alike. */
enum {
  DLUA_CUDA_EW_UNARY,   /* o = f(a, p1, p2);                 ops: o, a */
  DLUA_CUDA_EW_BINARY,  /* o = f(a, b, alpha) (mode 0), f(a, s) (1), f(s, a) (2); ops: o, a[, b] */
  DLUA_CUDA_EW_TERNARY, /* x = f(x, a, b, value);            ops: x, a, b */
  DLUA_CUDA_EW_WHERE,   /* o = c ? a : b, bits of `elsize`;  ops: o, c (uint8), a, b */
  DLUA_CUDA_EW_MFILL,   /* if m: o = bits i[0];              ops: o, m (uint8) */
  DLUA_CUDA_EW_FILL,    /* o = bits i[0];                    ops: o */
  DLUA_CUDA_EW_COPY,    /* o = convert(a) from src_dtype to dtype, copy_'s rules; ops: o, a */
};

/* One launch: operand 0 is the output; every operand is viewed at the iteration shape (dims
   ordered outer to inner, broadcast dims with stride 0), as host/cpu/elementwise.c's iterator
   builds it. Pointers are device addresses on `device`. */
typedef struct {
  int family, op;
  int dtype;     /* unary/binary/ternary: the compute storage dtype of the inputs (and of the output
                    unless the op is a predicate, whose output is bool); copy: the destination's */
  int src_dtype; /* copy: the source's dtype */
  int elsize;    /* where/mfill/fill: bytes per element (1, 2, 4, 8) */
  int nops, ndim;
  int64_t numel;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t strides[4][DLUA_MAX_DIMS]; /* bytes */
  char *base[4];
  double d[2];   /* float scalars: unary p1, p2; binary alpha, s; ternary value */
  int64_t i[2];  /* the same as integers (bounds that do not survive double), or fill bits */
  int mode;      /* binary: 0 tensor-tensor, 1 a op s, 2 s op a */
  int device;
} dlua_cuda_ew_t;

/* Queues the launch on the current stream of e->device. `op` names the user's op in errors. */
dlua_status_t dlua_cuda_ew_run(const char *op, const dlua_cuda_ew_t *e);

/* The raw cudaStream_t (as void *) that kernels for `device` queue on: its current stream. */
void *dlua_cuda_raw_stream(int device);

/* Row-major C (m, n) = alpha * op(A) (m, k) x op(B) (k, n) + beta * C through cuBLASLt, `batch` times with
   element strides sa, sb, sc between the matrices (host/cuda/blaslt.c). ta/tb and lda/ldb as BLAS on the
   row-major view (see host/cpu/linalg.c's blas_form). dtype f32, f64, f16 or bf16 for A, B and C alike. */
dlua_status_t dlua_cuda_gemm(const char *op, int dtype, int ta, int tb, int64_t m, int64_t n, int64_t k, double alpha,
                             const void *a, int64_t lda, int64_t sa, const void *b, int64_t ldb, int64_t sb, double beta,
                             void *c, int64_t ldc, int64_t sc, int64_t batch, int device);

#ifdef __cplusplus
}
#endif
#endif

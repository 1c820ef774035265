/* The blas family of the backend table (ops/backend.h): matrix products. host/ops/linalg.c (mm, bmm, addmm,
   matmul) settles shapes, dtypes, broadcast batch dims, the operands' BLAS form and `out`, fills one
   descriptor and calls `gemm`; host/cpu/linalg.c (oneDNN sgemm and bf16 GEMM, tiled f64/integer GEMM) and
   host/cuda/blaslt.c (cuBLASLt) run it. */
#ifndef DLUA_KERNELS_BLAS_H
#define DLUA_KERNELS_BLAS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* C[b] (m, n) = alpha * A[b] (m, k) x B[b] (k, n) + beta * C[b], for every b of the broadcast batch dims. */
typedef struct {
  int dtype;                   /* A, B and C alike: the compute dtype the backend's `compute` slot chose */
  int ab_bf16;                 /* 1: A and B hold bfloat16 instead (dtype float32, where caps.bf16_ab said so) */
  int64_t m, n, k;             /* k may be 0: C = beta * C (only on a backend whose `compute` takes it) */
  int64_t ars, acs, brs, bcs;  /* row and column strides of A's and B's matrices, in elements */
  int bnd;                     /* batch dims (0: one product) */
  int64_t bsz[DLUA_MAX_DIMS];  /* their sizes */
  int64_t ast[DLUA_MAX_DIMS], bst[DLUA_MAX_DIMS], cst[DLUA_MAX_DIMS]; /* their strides in elements, 0 broadcast */
  const void *a, *b;           /* addresses on `device` */
  void *c;                     /* contiguous (m, n) matrices (ldc = n); not read when beta == 0 */
  double alpha, beta;
  int device;
} dlua_gemm_desc_t;

/* What a backend computes a product of result dtype `dtype` in. */
typedef struct {
  int dtype;      /* the compute dtype, or -1: the backend does not multiply `dtype` tensors */
  int blas_form;  /* every operand must have one unit stride (else only float32 ones need it) */
  int empty_sum;  /* 1: gemm takes k = 0; 0: the front door makes C = beta * C itself */
  int bf16_ab;    /* 1: when dtype is float32 and A and B both are bfloat16, gemm takes them as they are (ab_bf16) */
} dlua_gemm_caps_t;

struct dlua_blas_ops {
  /* *caps for a product whose result has dtype `dtype` (DLUA_DTYPE_BOOL already refused). */
  dlua_status_t (*caps)(const char *op, int dtype, dlua_gemm_caps_t *caps);
  /* One (batched) product as the descriptor says; m, n and the batch may be empty. */
  dlua_status_t (*gemm)(const char *op, const dlua_gemm_desc_t *d);
};

extern const struct dlua_blas_ops dlua_cpu_blas_ops, dlua_cuda_blas_ops;

/* The BLAS form of an (r, c) matrix with strides (rs, cs): not transposed with ld = rs, or transposed with
   ld = cs. 0 when neither fits (e.g. an expanded or sliced-by-step operand). Shared by the front door (which
   copies operands that have none) and the backends (which pass ta/tb and lda/ldb on). */
static inline int dlua_blas_form(int64_t r, int64_t c, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
  int64_t minc = c > 1 ? c : 1, minr = r > 1 ? r : 1;
  if ((cs == 1 || c <= 1) && (r <= 1 || rs >= minc)) {
    *trans = 0;
    *ld = r <= 1 ? minc : rs;
    return 1;
  }
  if ((rs == 1 || r <= 1) && (c <= 1 || cs >= minr)) {
    *trans = 1;
    *ld = c <= 1 ? minr : cs;
    return 1;
  }
  return 0;
}

/* The element offset of row-major linear position `lin` in a tensor of (sizes, strides): batch `bi`'s matrix. */
static inline int64_t dlua_unravel(int ndim, const int64_t *sizes, const int64_t *strides, int64_t lin) {
  int64_t off = 0;
  for (int d = ndim - 1; d >= 0 && lin; d--) {
    int64_t q = lin / sizes[d];
    off += (lin - q * sizes[d]) * strides[d];
    lin = q;
  }
  return off;
}

#ifdef __cplusplus
}
#endif
#endif

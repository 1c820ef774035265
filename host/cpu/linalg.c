/* CPU matrix products: sgemm through oneDNN, our own f64/integer GEMM, and mm/bmm/addmm/matmul. */
#include <inttypes.h>
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "core/error.h"
#include "core/tensor.h"
#include "cpu/index.h"
#include "cuda/kernels.h" /* plain C: only CUDA builds call into it */

/* ---- deterministic matrix-vector products ----------------------------------------------------
   oneDNN's sgemm switches to a GEMV kernel that splits k across threads when m or n is 1, so
   its result would depend on the thread count. Those shapes come here instead: every output
   is summed over fixed k blocks in a fixed order, whatever thread computes which block. */

enum { GEMV_KB = 4096, GEMV_IB = 256, GEMV_LANES = 16 };

// y: (R) strided ys ; M: (R, K) strides (mrs, mcs) ; x: (K) strided xs
static dlua_status_t sgemv_det(int64_t R, int64_t K, float alpha, const float *M, int64_t mrs, int64_t mcs,
                               const float *x, int64_t xs, float beta, float *y, int64_t ys) {
  int64_t nb = (K + GEMV_KB - 1) / GEMV_KB;
  int axpy = mrs == 1 && mcs != 1;  // columns contiguous: stream down columns instead of rows
  int64_t nib = axpy ? (R + GEMV_IB - 1) / GEMV_IB : R;
  float *part = malloc(sizeof(float) * (size_t)(R * nb));
  if (!part) return DLUA_ERR(DLUA_ERR_OOM, "sgemm: out of memory allocating %zu bytes of scratch", sizeof(float) * (size_t)(R * nb));
  int64_t tasks = nib * nb;
#pragma omp parallel for schedule(static) if (R * K > 65536)
  for (int64_t t = 0; t < tasks; t++) {
    int64_t ib = t / nb, b = t - ib * nb;
    int64_t p0 = b * GEMV_KB, p1 = p0 + GEMV_KB < K ? p0 + GEMV_KB : K;
    if (axpy) {
      int64_t i0 = ib * GEMV_IB, i1 = i0 + GEMV_IB < R ? i0 + GEMV_IB : R;
      float *acc = part + b * R;
      for (int64_t i = i0; i < i1; i++) acc[i] = 0.0f;
      for (int64_t p = p0; p < p1; p++) {
        float xp = x[p * xs];
        const float *col = M + p * mcs;
        for (int64_t i = i0; i < i1; i++) acc[i] += col[i] * xp;
      }
    } else {
      const float *row = M + ib * mrs;
      float lane[GEMV_LANES] = {0};
      int64_t p = p0;
      if (mcs == 1 && xs == 1) {
        for (; p + GEMV_LANES <= p1; p += GEMV_LANES)
          for (int l = 0; l < GEMV_LANES; l++) lane[l] += row[p + l] * x[p + l];
      } else {
        for (; p + GEMV_LANES <= p1; p += GEMV_LANES)
          for (int l = 0; l < GEMV_LANES; l++) lane[l] += row[(p + l) * mcs] * x[(p + l) * xs];
      }
      for (int l = 0; p < p1; p++, l++) lane[l] += row[p * mcs] * x[p * xs];
      for (int w = GEMV_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
      part[b * R + ib] = lane[0];
    }
  }
#pragma omp parallel for schedule(static) if (R > 4096)
  for (int64_t i = 0; i < R; i++) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) s += part[b * R + i];
    float *yi = y + i * ys;
    *yi = beta == 0.0f ? alpha * s : alpha * s + beta * *yi;
  }
  free(part);
  return DLUA_OK;
}

/* C (m, n) <- beta * C, where beta == 0 clears C even if it held NaN (as BLAS does). */
static void scale_rows_f32(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
}

dlua_status_t dlua_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m < 0 || n < 0 || k < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "sgemm: negative size m=%" PRId64 " n=%" PRId64 " k=%" PRId64, m, n, k);
  int64_t acols = trans_a ? m : k, bcols = trans_b ? k : n;
  if (lda < (acols > 1 ? acols : 1) || ldb < (bcols > 1 ? bcols : 1) || ldc < (n > 1 ? n : 1))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "sgemm: leading dimensions lda=%" PRId64 " ldb=%" PRId64 " ldc=%" PRId64
                    " are too small for m=%" PRId64 " n=%" PRId64 " k=%" PRId64 " (trans_a=%d, trans_b=%d)",
                    lda, ldb, ldc, m, n, k, trans_a != 0, trans_b != 0);
  if (m == 0 || n == 0) return DLUA_OK;
  if (!a || !b || !c) return DLUA_ERR(DLUA_ERR_ARG, "sgemm: NULL matrix pointer");
  if (k == 0 || alpha == 0.0f) {
    scale_rows_f32(m, n, beta, c, ldc);
    return DLUA_OK;
  }
  if (n == 1)  // c (m, 1) = op(a) (m, k) x op(b) (k, 1)
    return sgemv_det(m, k, alpha, a, trans_a ? 1 : lda, trans_a ? lda : 1, b, trans_b ? 1 : ldb, beta, c, ldc);
  if (m == 1)  // c (1, n)^T = op(b)^T (n, k) x op(a)^T (k, 1)
    return sgemv_det(n, k, alpha, b, trans_b ? ldb : 1, trans_b ? 1 : ldb, a, trans_a ? lda : 1, beta, c, 1);
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (st != dnnl_success)
    return DLUA_ERR(DLUA_ERR_BACKEND, "sgemm: oneDNN dnnl_sgemm failed with status %d (m=%" PRId64 " n=%" PRId64
                    " k=%" PRId64 ")", (int)st, m, n, k);
  return DLUA_OK;
}

/* ---- our own GEMM for f64 and integers ------------------------------------------------------
   oneDNN has no dgemm, and Debian's OpenBLAS (a second thread pool, and a generic kernel on
   CPUs it does not recognise) is not worth linking for f64. A packed, tiled GEMM: tiles of C
   are independent, each summed over k in a fixed order, so results do not depend on threads.
   Operands are read through arbitrary strides (packing absorbs transposes). */

/* 4x8 is what GCC keeps in registers (measured: 8x8 and 4x16 spill and run 3-6x slower). */
enum { GEMM_MR = 4, GEMM_NR = 8, GEMM_MC = 64, GEMM_NC = 128, GEMM_KC = 256 };
_Static_assert(GEMM_MC % GEMM_MR == 0 && GEMM_NC % GEMM_NR == 0, "tiles must hold whole register blocks");

#define DEFINE_TILED_GEMM(NAME, T, CLONES)                                                         \
  CLONES static void NAME##_micro(int64_t kc, const T *ap, const T *bp, T *acc, int64_t ldacc) {   \
    T r[GEMM_MR][GEMM_NR];                                                                         \
    for (int i = 0; i < GEMM_MR; i++)                                                              \
      for (int j = 0; j < GEMM_NR; j++) r[i][j] = acc[i * ldacc + j];                              \
    for (int64_t p = 0; p < kc; p++)                                                               \
      for (int i = 0; i < GEMM_MR; i++)                                                            \
        for (int j = 0; j < GEMM_NR; j++) r[i][j] += ap[p * GEMM_MR + i] * bp[p * GEMM_NR + j];    \
    for (int i = 0; i < GEMM_MR; i++)                                                              \
      for (int j = 0; j < GEMM_NR; j++) acc[i * ldacc + j] = r[i][j];                              \
  }                                                                                                \
  /* c (m, n) row-major ldc = alpha * A (m, k) x B (k, n) + beta * c */                            \
  static void NAME(int64_t m, int64_t n, int64_t k, T alpha, const T *a, int64_t ars, int64_t acs, \
                   const T *b, int64_t brs, int64_t bcs, T beta, T *c, int64_t ldc, T *scratch) {  \
    int64_t mt = (m + GEMM_MC - 1) / GEMM_MC, nt = (n + GEMM_NC - 1) / GEMM_NC;                    \
    _Pragma("omp parallel for schedule(static) if (m * n * k > 32768)") for (int64_t t = 0;        \
                                                                              t < mt * nt; t++) { \
      T *ap = scratch + (size_t)omp_get_thread_num() * (GEMM_MC * GEMM_KC + GEMM_KC * GEMM_NC +   \
                                                        GEMM_MC * GEMM_NC);                        \
      T *bp = ap + GEMM_MC * GEMM_KC, *acc = bp + GEMM_KC * GEMM_NC;                               \
      int64_t m0 = (t / nt) * GEMM_MC, n0 = (t % nt) * GEMM_NC;                                    \
      int64_t mc = m - m0 < GEMM_MC ? m - m0 : GEMM_MC, nc = n - n0 < GEMM_NC ? n - n0 : GEMM_NC;  \
      int64_t mp = (mc + GEMM_MR - 1) / GEMM_MR, np = (nc + GEMM_NR - 1) / GEMM_NR;                \
      memset(acc, 0, sizeof(T) * GEMM_MC * GEMM_NC);                                               \
      for (int64_t p0 = 0; p0 < k; p0 += GEMM_KC) {                                                \
        int64_t kc = k - p0 < GEMM_KC ? k - p0 : GEMM_KC;                                          \
        for (int64_t ip = 0; ip < mp; ip++)                                                        \
          for (int64_t p = 0; p < kc; p++)                                                         \
            for (int i = 0; i < GEMM_MR; i++) {                                                    \
              int64_t row = ip * GEMM_MR + i;                                                      \
              ap[(ip * kc + p) * GEMM_MR + i] = row < mc ? a[(m0 + row) * ars + (p0 + p) * acs] : (T)0; \
            }                                                                                      \
        for (int64_t jp = 0; jp < np; jp++)                                                        \
          for (int64_t p = 0; p < kc; p++)                                                         \
            for (int j = 0; j < GEMM_NR; j++) {                                                    \
              int64_t col = jp * GEMM_NR + j;                                                      \
              bp[(jp * kc + p) * GEMM_NR + j] = col < nc ? b[(p0 + p) * brs + (n0 + col) * bcs] : (T)0; \
            }                                                                                      \
        for (int64_t ip = 0; ip < mp; ip++)                                                        \
          for (int64_t jp = 0; jp < np; jp++)                                                      \
            NAME##_micro(kc, ap + ip * kc * GEMM_MR, bp + jp * kc * GEMM_NR,                       \
                         acc + ip * GEMM_MR * GEMM_NC + jp * GEMM_NR, GEMM_NC);                    \
      }                                                                                            \
      for (int64_t i = 0; i < mc; i++)                                                             \
        for (int64_t j = 0; j < nc; j++) {                                                         \
          T *ci = c + (m0 + i) * ldc + n0 + j;                                                     \
          *ci = beta == (T)0 ? alpha * acc[i * GEMM_NC + j] : alpha * acc[i * GEMM_NC + j] + beta * *ci; \
        }                                                                                          \
    }                                                                                              \
  }

#define GEMM_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
DEFINE_TILED_GEMM(dgemm_tiled, double, GEMM_CLONES)
// Unsigned: integer products wrap modulo 2^64 as in PyTorch, without signed-overflow UB.
DEFINE_TILED_GEMM(igemm_tiled, uint64_t, )

static size_t tiled_scratch_elems(void) {
  return (size_t)omp_get_max_threads() * (GEMM_MC * GEMM_KC + GEMM_KC * GEMM_NC + GEMM_MC * GEMM_NC);
}

/* ---- batched products on tensors -------------------------------------------------------------- */

/* C[b] (m, n) = alpha * A[b] (m, k) x B[b] (k, n) + beta * C[b] over broadcast batch dims. */
typedef struct {
  int64_t m, n, k;
  int64_t ars, acs, brs, bcs;  // matrix strides of A and B, in elements
  int bnd;                     // batch dims
  int64_t bsz[DLUA_MAX_DIMS], ast[DLUA_MAX_DIMS], bst[DLUA_MAX_DIMS], cst[DLUA_MAX_DIMS];
} mm_plan_t;

/* The BLAS form of an (r, c) matrix with strides (rs, cs): not transposed with ld = rs, or
   transposed with ld = cs. 0 when neither fits (e.g. an expanded or sliced-by-step operand). */
static int blas_form(int64_t r, int64_t c, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
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

/* Makes the (rows, cols) matrix view *v usable by BLAS (one unit stride): when it is not, *v
   becomes a contiguous copy, held through *owned (which frees what it held before). */
static dlua_status_t to_blas_form(dlua_tensor_t *v, dlua_tensor_t **owned, int64_t rows, int64_t cols, int64_t rs,
                                  int64_t cs) {
  int tr;
  int64_t ld;
  if (blas_form(rows, cols, rs, cs, &tr, &ld)) return DLUA_OK;
  dlua_tensor_t *copy = NULL;
  DLUA_TRY(dlua_tensor_contiguous(&copy, v));
  dlua_tensor_free(*owned);
  *owned = copy;
  *v = *copy;
  return DLUA_OK;
}

static dlua_status_t run_plan(const char *op, const mm_plan_t *pl, dlua_dtype_t ct, const char *ap, const char *bp,
                              char *cp, double alpha, double beta) {
  int64_t nbatch = dlua_shape_numel(pl->bnd, pl->bsz);
  int64_t m = pl->m, n = pl->n, k = pl->k;
  if (nbatch == 0 || m == 0 || n == 0) return DLUA_OK;
  size_t es = dlua_dtype_size(ct);
  if (ct == DLUA_DTYPE_F32) {
    int ta, tb;
    int64_t lda, ldb;
    if (!blas_form(m, k, pl->ars, pl->acs, &ta, &lda) || !blas_form(k, n, pl->brs, pl->bcs, &tb, &ldb))
      return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: operand layout not expressible for sgemm", op);
    // Many small products: one per thread. Otherwise one after another, each threaded.
    int across = nbatch > 1 && m * n * k < (1 << 18);
    dlua_status_t status = DLUA_OK;
#pragma omp parallel for schedule(static) if (across)
    for (int64_t bi = 0; bi < nbatch; bi++) {
      const float *a = (const float *)(ap + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->ast, bi) * (int64_t)es);
      const float *b = (const float *)(bp + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->bst, bi) * (int64_t)es);
      float *c = (float *)(cp + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->cst, bi) * (int64_t)es);
      dlua_status_t s = dlua_sgemm(ta, tb, m, n, k, (float)alpha, a, lda, b, ldb, (float)beta, c, n);
      if (s != DLUA_OK) {
#pragma omp atomic write
        status = s;
      }
    }
    // The worker's message stayed in its own thread: record one here.
    if (status != DLUA_OK) return DLUA_ERR(status, "%s: sgemm failed on a (%" PRId64 ", %" PRId64 ") x (%" PRId64
                                           ", %" PRId64 ") product of the batch", op, m, k, k, n);
    return status;
  }
  size_t ns = tiled_scratch_elems();
  void *scratch = malloc(ns * 8);
  if (!scratch) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of scratch", op, ns * 8);
  for (int64_t bi = 0; bi < nbatch; bi++) {
    const char *a = ap + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->ast, bi) * (int64_t)es;
    const char *b = bp + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->bst, bi) * (int64_t)es;
    char *c = cp + dlua_cpu_unravel(pl->bnd, pl->bsz, pl->cst, bi) * (int64_t)es;
    if (ct == DLUA_DTYPE_F64)
      dgemm_tiled(m, n, k, alpha, (const double *)a, pl->ars, pl->acs, (const double *)b, pl->brs, pl->bcs, beta,
                  (double *)c, n, scratch);
    else
      igemm_tiled(m, n, k, (uint64_t)(int64_t)alpha, (const uint64_t *)a, pl->ars, pl->acs, (const uint64_t *)b,
                  pl->brs, pl->bcs, (uint64_t)(int64_t)beta, (uint64_t *)c, n, scratch);
  }
  free(scratch);
  return DLUA_OK;
}

/* The dtype the product is computed in: f16/bf16 accumulate in f32, integers in int64. */
static dlua_dtype_t compute_dtype(dlua_dtype_t d) {
  switch (d) {
    case DLUA_DTYPE_F64: return DLUA_DTYPE_F64;
    case DLUA_DTYPE_F32:
    case DLUA_DTYPE_F16:
    case DLUA_DTYPE_BF16: return DLUA_DTYPE_F32;
    default: return DLUA_DTYPE_I64;
  }
}

/* Builds the plan for local views av (..., m, k) and bv (..., k, n), both with >= 2 dims. */
static dlua_status_t make_plan(const char *op, const struct dlua_tensor *av, const struct dlua_tensor *bv,
                               const dlua_tensor_t *a0, const dlua_tensor_t *b0, mm_plan_t *pl) {
  int na = av->ndim, nb = bv->ndim;
  pl->m = av->sizes[na - 2];
  pl->k = av->sizes[na - 1];
  pl->n = bv->sizes[nb - 1];
  char b1[200], b2[200];
  if (bv->sizes[nb - 2] != pl->k)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s and %s cannot be multiplied (%" PRId64 " columns vs %" PRId64 " rows)", op,
                    dlua_tensor_describe(a0, b1, sizeof b1), dlua_tensor_describe(b0, b2, sizeof b2), pl->k,
                    bv->sizes[nb - 2]);
  pl->ars = av->strides[na - 2];
  pl->acs = av->strides[na - 1];
  pl->brs = bv->strides[nb - 2];
  pl->bcs = bv->strides[nb - 1];
  DLUA_TRY(dlua_broadcast_shapes(op, na - 2, av->sizes, nb - 2, bv->sizes, &pl->bnd, pl->bsz));
  for (int d = 0; d < pl->bnd; d++) {
    int da = d - (pl->bnd - (na - 2)), db = d - (pl->bnd - (nb - 2));
    pl->ast[d] = da >= 0 && av->sizes[da] != 1 ? av->strides[da] : 0;
    pl->bst[d] = db >= 0 && bv->sizes[db] != 1 ? bv->strides[db] : 0;
  }
  dlua_contiguous_strides(pl->bnd, pl->bsz, pl->cst);
  for (int d = 0; d < pl->bnd; d++) pl->cst[d] *= pl->m * pl->n;
  return DLUA_OK;
}

/* A batch of products with a shared 2-D B and a batched A whose batch and row dims walk memory
   with one stride becomes a single taller product: (B*m, k) x (k, n). */
static void fold_batch(mm_plan_t *pl, const struct dlua_tensor *av, const struct dlua_tensor *bv, dlua_dtype_t ct) {
  if (pl->bnd == 0 || bv->ndim != 2 || av->ndim < 3) return;
  int na = av->ndim;
  int64_t stride = pl->ars, need = pl->m;  // walking up from the row dim
  for (int d = na - 3; d >= 0; d--) {
    if (av->sizes[d] == 1) continue;
    if (av->strides[d] != stride * need) return;
    stride = av->strides[d];
    need = av->sizes[d];
  }
  int64_t tall = pl->m * dlua_shape_numel(pl->bnd, pl->bsz);
  int tr;
  int64_t ld;
  // sgemm must still see the taller matrix in BLAS form (a transposed A stacks badly).
  if (ct == DLUA_DTYPE_F32 && !blas_form(tall, pl->k, pl->ars, pl->acs, &tr, &ld)) return;
  pl->m = tall;
  pl->bnd = 0;
}

/* Moves t into the compute dtype (a copy) when it is not there already. */
static dlua_status_t to_compute(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_tensor_t **tmp, struct dlua_tensor *v) {
  *tmp = NULL;
  if (t->dtype != ct) {
    DLUA_TRY(dlua_tensor_to_dtype(tmp, t, ct));
    *v = **tmp;
  } else {
    *v = *t;
  }
  return DLUA_OK;
}

/* Appends/prepends size-1 dims so a local view has ndim >= 2 (matmul's 1-D promotion). */
static void promote_1d(struct dlua_tensor *v, int as_row) {
  if (v->ndim != 1) return;
  if (as_row) {  // (k) -> (1, k)
    v->sizes[1] = v->sizes[0];
    v->strides[1] = v->strides[0];
    v->sizes[0] = 1;
    v->strides[0] = v->sizes[1] * v->strides[1];
  } else {  // (k) -> (k, 1)
    v->sizes[1] = 1;
    v->strides[1] = 1;
  }
  v->ndim = 2;
}

/* The CUDA driver, the same steps as product() below: products in the result dtype through cuBLASLt
   (f16/bf16 accumulate in f32 there), operands in BLAS form (else contiguous copies), one strided-batched
   call when the batch allows, else one call per matrix. */
static dlua_status_t cuda_product(const char *op, dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b,
                                  int a_as_row, int b_as_col, const dlua_tensor_t *c, double beta, double alpha) {
  char b1[200], b2[200];
  const dlua_tensor_t *other = b->device != a->device ? b : (c && c->device != a->device ? c : NULL);
  if (other)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got %s and %s", op,
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(other, b2, sizeof b2));
#ifndef DLUA_HAVE_CUDA
  (void)out, (void)a_as_row, (void)b_as_col, (void)beta, (void)alpha;
  return dlua_require_cpu(op, a);
#else
  const int dev = a->device;
  dlua_dtype_t rdt = dlua_dtype_promote(a->dtype, b->dtype);
  if (c) rdt = dlua_dtype_promote(rdt, c->dtype);
  if (rdt != DLUA_DTYPE_F32 && rdt != DLUA_DTYPE_F64 && rdt != DLUA_DTYPE_F16 && rdt != DLUA_DTYPE_BF16)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d yet for %s tensors (got %s and %s)", op, dev,
                    dlua_dtype_name(rdt), dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  struct dlua_tensor av = *a, bv = *b;
  promote_1d(&av, a_as_row);
  promote_1d(&bv, b_as_col ? 0 : 1);
  mm_plan_t pl;
  DLUA_TRY(make_plan(op, &av, &bv, a, b, &pl));
  int64_t osizes[DLUA_MAX_DIMS];
  int ond = 0;
  for (int d = 0; d < pl.bnd; d++) osizes[ond++] = pl.bsz[d];
  if (!(a->ndim == 1 && a_as_row)) osizes[ond++] = pl.m;
  if (!(b->ndim == 1 && b_as_col)) osizes[ond++] = pl.n;
  if (c) {
    int64_t csizes[DLUA_MAX_DIMS];
    int cnd = 0;
    DLUA_TRY(dlua_broadcast_shapes(op, c->ndim, c->sizes, ond, osizes, &cnd, csizes));
    if (cnd != ond || memcmp(csizes, osizes, sizeof(int64_t) * (size_t)ond) != 0) {
      char b3[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: input %s does not broadcast to the product's shape %s", op,
                      dlua_tensor_describe(c, b1, sizeof b1), dlua_shape_str(ond, osizes, b3, sizeof b3));
    }
  }

  int allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, out, ond, osizes, rdt, dev, &allocated));
  dlua_tensor_t *ta = NULL, *tb = NULL, *tc = NULL, *tmp = NULL, *dst = *out;
  dlua_status_t s = DLUA_OK;
  if (!allocated && (dst->dtype != rdt || !dlua_tensor_is_contiguous(dst))) {
    s = dlua_tensor_empty(&tmp, ond, osizes, rdt, dev);
    dst = tmp;
  }
  if (s == DLUA_OK) s = to_compute(a, rdt, &ta, &av);
  if (s == DLUA_OK) s = to_compute(b, rdt, &tb, &bv);
  if (s == DLUA_OK) {
    promote_1d(&av, a_as_row);
    promote_1d(&bv, b_as_col ? 0 : 1);
    s = make_plan(op, &av, &bv, a, b, &pl);
  }
  int tra = 0, trb = 0;
  int64_t lda = 0, ldb = 0;
  if (s == DLUA_OK) s = to_blas_form(&av, &ta, pl.m, pl.k, pl.ars, pl.acs);
  if (s == DLUA_OK) s = to_blas_form(&bv, &tb, pl.k, pl.n, pl.brs, pl.bcs);
  if (s == DLUA_OK) s = make_plan(op, &av, &bv, a, b, &pl);
  if (s == DLUA_OK) fold_batch(&pl, &av, &bv, DLUA_DTYPE_F32);  // F32: keep A in BLAS form
  if (s == DLUA_OK && (!blas_form(pl.m, pl.k, pl.ars, pl.acs, &tra, &lda) || !blas_form(pl.k, pl.n, pl.brs, pl.bcs, &trb, &ldb)))
    s = DLUA_ERR(DLUA_ERR_INTERNAL, "%s: operand layout not expressible for cuBLASLt", op);
  double kbeta = 0.0;
  if (s == DLUA_OK && c && beta != 0.0) {
    int same = dst == *out && dlua_tensor_same_storage(dst, c) && c->offset == dst->offset && c->ndim == dst->ndim &&
               memcmp(c->sizes, dst->sizes, sizeof(int64_t) * (size_t)c->ndim) == 0 &&
               memcmp(c->strides, dst->strides, sizeof(int64_t) * (size_t)c->ndim) == 0 && c->dtype == dst->dtype;
    if (!same) {
      const dlua_tensor_t *src = c;
      if (dlua_tensor_same_storage(dst, c)) {
        s = dlua_tensor_clone(&tc, c);
        src = tc;
      }
      if (s == DLUA_OK) s = dlua_tensor_copy_(dst, src);
    }
    kbeta = beta;
  }
  if (s == DLUA_OK) {
    const int64_t nbatch = dlua_shape_numel(pl.bnd, pl.bsz), es = (int64_t)dlua_dtype_size(rdt);
    const char *ap = dlua_tensor_ptr(&av), *bp = dlua_tensor_ptr(&bv);
    char *cp = dlua_tensor_ptr(dst);
    if (nbatch == 0 || pl.m == 0 || pl.n == 0) {
      // nothing to compute
    } else if (pl.k == 0) {  // an empty sum: C = beta * C
      if (kbeta == 0.0) s = dlua_tensor_fill_(dst, 0.0);
      else if (kbeta != 1.0) s = dlua_tensor_binary_scalar(&dst, dst, kbeta, DLUA_BINARY_MUL, 0);
    } else if (pl.bnd == 0) {
      s = dlua_cuda_gemm(op, (int)rdt, tra, trb, pl.m, pl.n, pl.k, alpha, ap, lda, 0, bp, ldb, 0, kbeta, cp, pl.n, 0, 1,
                         dev);
    } else if (pl.bnd == 1 && pl.ast[0] != 0 && pl.bst[0] != 0) {
      s = dlua_cuda_gemm(op, (int)rdt, tra, trb, pl.m, pl.n, pl.k, alpha, ap, lda, pl.ast[0], bp, ldb, pl.bst[0], kbeta,
                         cp, pl.n, pl.cst[0], nbatch, dev);
    } else {
      for (int64_t bi = 0; bi < nbatch && s == DLUA_OK; bi++)
        s = dlua_cuda_gemm(op, (int)rdt, tra, trb, pl.m, pl.n, pl.k, alpha,
                           ap + dlua_cpu_unravel(pl.bnd, pl.bsz, pl.ast, bi) * es, lda, 0,
                           bp + dlua_cpu_unravel(pl.bnd, pl.bsz, pl.bst, bi) * es, ldb, 0, kbeta,
                           cp + dlua_cpu_unravel(pl.bnd, pl.bsz, pl.cst, bi) * es, pl.n, 0, 1, dev);
    }
  }
  if (s == DLUA_OK && tmp) s = dlua_tensor_copy_(*out, tmp);
  dlua_tensor_free(ta);
  dlua_tensor_free(tb);
  dlua_tensor_free(tc);
  dlua_tensor_free(tmp);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
#endif
}

/* The shared driver: out (out_nd, out_sizes) holds the batch of (m, n) products contiguously.
   c (may be NULL) is addmm's term, broadcast to out and scaled by beta. */
static dlua_status_t product(const char *op, dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b,
                             int a_as_row, int b_as_col, const dlua_tensor_t *c, double beta, double alpha) {
  char b1[200], b2[200];
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (!a || !b) return DLUA_ERR(DLUA_ERR_ARG, "%s: operand is NULL", op);
  if (!a->storage || !b->storage || (c && !c->storage)) DLUA_TRY(dlua_require_cpu(op, !a->storage ? a : !b->storage ? b : c));
  if (a->device != DLUA_CPU || b->device != DLUA_CPU || (c && c->device != DLUA_CPU))
    return cuda_product(op, out, a, b, a_as_row, b_as_col, c, beta, alpha);
  dlua_dtype_t rdt = dlua_dtype_promote(a->dtype, b->dtype);
  if (c) rdt = dlua_dtype_promote(rdt, c->dtype);
  if (rdt == DLUA_DTYPE_BOOL)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot multiply bool tensors %s and %s", op,
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  dlua_dtype_t ct = compute_dtype(rdt);

  // Shape first (on the caller's tensors), so errors name them before any copy is made.
  struct dlua_tensor av = *a, bv = *b;
  promote_1d(&av, a_as_row);
  promote_1d(&bv, b_as_col ? 0 : 1);
  mm_plan_t pl;
  DLUA_TRY(make_plan(op, &av, &bv, a, b, &pl));
  int64_t osizes[DLUA_MAX_DIMS];
  int ond = 0;
  for (int d = 0; d < pl.bnd; d++) osizes[ond++] = pl.bsz[d];
  if (!(a->ndim == 1 && a_as_row)) osizes[ond++] = pl.m;
  if (!(b->ndim == 1 && b_as_col)) osizes[ond++] = pl.n;

  int64_t csizes[DLUA_MAX_DIMS];
  int cnd = 0;
  if (c) {  // addmm's c broadcasts to the result
    DLUA_TRY(dlua_broadcast_shapes(op, c->ndim, c->sizes, ond, osizes, &cnd, csizes));
    if (cnd != ond || memcmp(csizes, osizes, sizeof(int64_t) * (size_t)ond) != 0) {
      char b3[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: input %s does not broadcast to the product's shape %s", op,
                      dlua_tensor_describe(c, b1, sizeof b1), dlua_shape_str(ond, osizes, b3, sizeof b3));
    }
  }

  // Result tensor: *out in the result dtype; the kernel writes ct (a temporary if they differ).
  int allocated = 0;
  if (!*out && rdt != ct) {
    DLUA_TRY(dlua_tensor_empty(out, ond, osizes, rdt, DLUA_CPU));
    allocated = 1;
  }
  dlua_tensor_t *ta = NULL, *tb = NULL, *tc = NULL;
  dlua_ops_out_t plan = {0};
  const dlua_tensor_t *ins[2] = {a, b};
  dlua_status_t s = dlua_ops_out_begin(op, out, ond, osizes, ct, ins, 2, &plan);
  if (s == DLUA_OK) s = to_compute(a, ct, &ta, &av);
  if (s == DLUA_OK) s = to_compute(b, ct, &tb, &bv);
  if (s == DLUA_OK) {
    promote_1d(&av, a_as_row);
    promote_1d(&bv, b_as_col ? 0 : 1);
    s = make_plan(op, &av, &bv, a, b, &pl);
  }
  if (s == DLUA_OK && ct == DLUA_DTYPE_F32) {
    // sgemm needs each matrix with one unit stride; otherwise work on a contiguous copy.
    s = to_blas_form(&av, &ta, pl.m, pl.k, pl.ars, pl.acs);
    if (s == DLUA_OK) s = to_blas_form(&bv, &tb, pl.k, pl.n, pl.brs, pl.bcs);
    if (s == DLUA_OK) s = make_plan(op, &av, &bv, a, b, &pl);
  }
  if (s == DLUA_OK) fold_batch(&pl, &av, &bv, ct);
  double kbeta = 0.0;
  if (s == DLUA_OK && c && beta != 0.0) {
    // dst <- c, unless dst already is c (in-place addmm_); a c overlapping dst otherwise is
    // copied aside first so the broadcast copy does not read what it wrote.
    struct dlua_tensor dv = *plan.dst;
    int same = dlua_tensor_same_storage(plan.dst, c) && c->offset == dv.offset && c->ndim == dv.ndim &&
               memcmp(c->sizes, dv.sizes, sizeof(int64_t) * (size_t)c->ndim) == 0 &&
               memcmp(c->strides, dv.strides, sizeof(int64_t) * (size_t)c->ndim) == 0 && c->dtype == dv.dtype;
    if (!same) {
      const dlua_tensor_t *src = c;
      if (dlua_tensor_same_storage(plan.dst, c)) {
        s = dlua_tensor_clone(&tc, c);
        src = tc;
      }
      if (s == DLUA_OK) s = dlua_tensor_copy_(plan.dst, src);
    }
    kbeta = beta;
  }
  if (s == DLUA_OK) {
    s = run_plan(op, &pl, ct, dlua_tensor_ptr(&av), dlua_tensor_ptr(&bv), dlua_tensor_ptr(plan.dst), alpha, kbeta);
  }
  dlua_tensor_free(ta);
  dlua_tensor_free(tb);
  dlua_tensor_free(tc);
  s = dlua_ops_out_finish(out, &plan, s);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

// a: (n, k), b: (k, m)  ->  out: (n, m)
dlua_status_t dlua_tensor_mm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim != 2 || b->ndim != 2))
    return DLUA_ERR(DLUA_ERR_ARG, "mm: expected 2-D matrices, got %s and %s", dlua_tensor_describe(a, b1, sizeof b1),
                    dlua_tensor_describe(b, b2, sizeof b2));
  return product("mm", out, a, b, 0, 0, NULL, 0.0, 1.0);
}

// a: (B, n, k), b: (B, k, m)  ->  out: (B, n, m)
dlua_status_t dlua_tensor_bmm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim != 3 || b->ndim != 3 || a->sizes[0] != b->sizes[0]))
    return DLUA_ERR(DLUA_ERR_ARG, "bmm: expected 3-D batches of the same size, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("bmm", out, a, b, 0, 0, NULL, 0.0, 1.0);
}

// c: broadcasts to (n, m) ; a: (n, k) ; b: (k, m)  ->  out: (n, m) = beta * c + alpha * a @ b
dlua_status_t dlua_tensor_addmm(dlua_tensor_t **out, const dlua_tensor_t *c, const dlua_tensor_t *a,
                                const dlua_tensor_t *b, double beta, double alpha) {
  char b1[200], b2[200];
  if (!c) return DLUA_ERR(DLUA_ERR_ARG, "addmm: input is NULL");
  if (a && b && (a->ndim != 2 || b->ndim != 2))
    return DLUA_ERR(DLUA_ERR_ARG, "addmm: expected 2-D matrices, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("addmm", out, a, b, 0, 0, c, beta, alpha);
}

// torch.matmul: (k)·(k) -> () ; (n, k)·(k) -> (n) ; (k)·(k, m) -> (m) ; (..., n, k)·(..., k, m) -> (..., n, m)
dlua_status_t dlua_tensor_matmul(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim == 0 || b->ndim == 0))
    return DLUA_ERR(DLUA_ERR_ARG, "matmul: both operands need at least one dimension, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("matmul", out, a, b, 1, 1, NULL, 0.0, 1.0);
}

/* CPU matrix products: sgemm and bf16 GEMM through oneDNN, our own f64/integer GEMM, and the blas table's
   slots that run the products of host/ops/linalg.c (mm/bmm/addmm/matmul). */
#include <inttypes.h>
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cpu/index.h"
#include "kernels/blas.h"

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

/* ---- bfloat16 products through oneDNN -----------------------------------------------------------
   oneDNN 2.6 exports dnnl_gemm_bf16bf16f32 (row-major like dnnl_sgemm: bf16 A and B, float32
   accumulation and C) without declaring it in its public header (its own tests declare it so);
   bfloat16_t there is a struct of one uint16_t. It needs AVX-512 (else it answers unimplemented):
   bf16_gemm_available() probes it once. The bf16 x bf16 products are exact in float32, so the
   result is sgemm's on the widened operands up to the summation order. */
extern dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                           float alpha, const uint16_t *A, dnnl_dim_t lda, const uint16_t *B,
                                           dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);

static _Atomic int bf16_gemm_state = -1;  // -1 not probed, 0 unavailable, 1 available

static int bf16_gemm_available(void) {
  int st = bf16_gemm_state;
  if (st < 0) {
    // (2, 2) x (2, 2) of 1, 2, 3, 4 (exact in bf16): [[7, 10], [15, 22]]
    const uint16_t a[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    float c[4] = {0};
    st = dnnl_gemm_bf16bf16f32('N', 'N', 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) == dnnl_success && c[0] == 7.0f &&
         c[1] == 10.0f && c[2] == 15.0f && c[3] == 22.0f;
    bf16_gemm_state = st;
  }
  return st;
}

/* (rows, cols) bf16 with leading dimension ld -> a compact float32 copy (ld = cols). */
static float *widen_bf16(const uint16_t *src, int64_t rows, int64_t cols, int64_t ld) {
  float *dst = malloc(sizeof(float) * (size_t)(rows * cols > 0 ? rows * cols : 1));
  if (dst)
    for (int64_t r = 0; r < rows; r++) dlua_convert_half_to_f32(dst + r * cols, src + r * ld, cols, 1);
  return dst;
}

/* dlua_sgemm's contract on bf16 A and B (float32 C, ldc = n). The matrix-vector shapes (m or n of 1)
   take sgemm's thread-count-independent GEMV on widened copies: oneDNN splits k across threads there. */
static dlua_status_t gemm_bf16(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                               const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float beta, float *c) {
  if (m == 0 || n == 0) return DLUA_OK;
  if (k == 0 || alpha == 0.0f) {
    scale_rows_f32(m, n, beta, c, n);
    return DLUA_OK;
  }
  if (m == 1 || n == 1) {
    int64_t ar = trans_a ? k : m, ac = trans_a ? m : k, br = trans_b ? n : k, bc = trans_b ? k : n;
    float *wa = widen_bf16(a, ar, ac, lda), *wb = wa ? widen_bf16(b, br, bc, ldb) : NULL;
    dlua_status_t s = wa && wb ? dlua_sgemm(trans_a, trans_b, m, n, k, alpha, wa, ac, wb, bc, beta, c, n)
                               : DLUA_ERR(DLUA_ERR_OOM, "bf16 gemm: out of memory widening a (%" PRId64 ", %" PRId64
                                          ") x (%" PRId64 ", %" PRId64 ") product", m, k, k, n);
    free(wa);
    free(wb);
    return s;
  }
  dnnl_status_t st = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb,
                                           beta, c, n);
  if (st != dnnl_success)
    return DLUA_ERR(DLUA_ERR_BACKEND, "bf16 gemm: oneDNN dnnl_gemm_bf16bf16f32 failed with status %d (m=%" PRId64
                    " n=%" PRId64 " k=%" PRId64 ")", (int)st, m, n, k);
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

/* ---- the blas table's slots (kernels/blas.h) ---------------------------------------------------- */

static dlua_status_t cpu_gemm(const char *op, const dlua_gemm_desc_t *pl) {
  const dlua_dtype_t ct = (dlua_dtype_t)pl->dtype;
  const char *ap = pl->a, *bp = pl->b;
  char *cp = pl->c;
  const double alpha = pl->alpha, beta = pl->beta;
  int64_t nbatch = dlua_shape_numel(pl->bnd, pl->bsz);
  int64_t m = pl->m, n = pl->n, k = pl->k;
  if (nbatch == 0 || m == 0 || n == 0) return DLUA_OK;
  size_t es = dlua_dtype_size(ct);
  if (ct == DLUA_DTYPE_F32) {
    const int bf16 = pl->ab_bf16 != 0;  // A and B hold bfloat16 (caps.bf16_ab), C float32
    const size_t abs = bf16 ? 2 : es;
    int ta, tb;
    int64_t lda, ldb;
    if (!dlua_blas_form(m, k, pl->ars, pl->acs, &ta, &lda) || !dlua_blas_form(k, n, pl->brs, pl->bcs, &tb, &ldb))
      return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: operand layout not expressible for %s", op, bf16 ? "bf16 gemm" : "sgemm");
    // Many small products: one per thread. Otherwise one after another, each threaded.
    int across = nbatch > 1 && m * n * k < (1 << 18);
    dlua_status_t status = DLUA_OK;
#pragma omp parallel for schedule(static) if (across)
    for (int64_t bi = 0; bi < nbatch; bi++) {
      const char *a = ap + dlua_unravel(pl->bnd, pl->bsz, pl->ast, bi) * (int64_t)abs;
      const char *b = bp + dlua_unravel(pl->bnd, pl->bsz, pl->bst, bi) * (int64_t)abs;
      float *c = (float *)(cp + dlua_unravel(pl->bnd, pl->bsz, pl->cst, bi) * (int64_t)es);
      dlua_status_t s = bf16 ? gemm_bf16(ta, tb, m, n, k, (float)alpha, (const uint16_t *)a, lda, (const uint16_t *)b,
                                         ldb, (float)beta, c)
                             : dlua_sgemm(ta, tb, m, n, k, (float)alpha, (const float *)a, lda, (const float *)b, ldb,
                                          (float)beta, c, n);
      if (s != DLUA_OK) {
#pragma omp atomic write
        status = s;
      }
    }
    // The worker's message stayed in its own thread: record one here.
    if (status != DLUA_OK) return DLUA_ERR(status, "%s: %s failed on a (%" PRId64 ", %" PRId64 ") x (%" PRId64
                                           ", %" PRId64 ") product of the batch", op, bf16 ? "bf16 gemm" : "sgemm",
                                           m, k, k, n);
    return status;
  }
  size_t ns = tiled_scratch_elems();
  void *scratch = malloc(ns * 8);
  if (!scratch) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of scratch", op, ns * 8);
  for (int64_t bi = 0; bi < nbatch; bi++) {
    const char *a = ap + dlua_unravel(pl->bnd, pl->bsz, pl->ast, bi) * (int64_t)es;
    const char *b = bp + dlua_unravel(pl->bnd, pl->bsz, pl->bst, bi) * (int64_t)es;
    char *c = cp + dlua_unravel(pl->bnd, pl->bsz, pl->cst, bi) * (int64_t)es;
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

static dlua_status_t cpu_caps(const char *op, int dtype, dlua_gemm_caps_t *caps) {
  (void)op;
  dlua_dtype_t ct = compute_dtype((dlua_dtype_t)dtype);
  // bf16 x bf16 in a float32 product (a bf16 result, or a bf16 product added into float32) runs on
  // oneDNN's bf16 GEMM without float32 copies of the operands; f16 has no oneDNN GEMM: staged.
  *caps = (dlua_gemm_caps_t){.dtype = (int)ct, .blas_form = 0, .empty_sum = 1,
                             .bf16_ab = ct == DLUA_DTYPE_F32 && bf16_gemm_available()};
  return DLUA_OK;
}

const struct dlua_blas_ops dlua_cpu_blas_ops = {
    .caps = cpu_caps,
    .gemm = cpu_gemm,
};

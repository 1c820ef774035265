/* The CPU batch-norm kernels (kernels/norm.h): statistics, normalisation fused with ReLU and a residual add,
   backward reduce and apply, and all their per-channel arithmetic (this file is built with -ffp-contract=off).
   Activations are float32, float64, or float16/bfloat16 read and written here (computing in float32).
   The front doors (checks, layouts, staging, `out`) are host/ops/batchnorm.c. */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/clones.h"
#include "kernels/norm.h"

/* Below this many elements a pass runs on one thread: waking the pool costs more. */
enum { BN_PAR_MIN = 32768 };
/* Channels-last partial sums cover blocks of about this many elements (whole rows of C). The
   block depends only on the shape, so the sums do not depend on the thread count. */
enum { BN_BLOCK_ELEMS = 8192 };

/* x seen as N planes of C channels of S positions (planar: (N, C, S) memory) or as N * S rows
   of C channels (rows: channels-last memory, or S == 1 where both are the same bytes). */
typedef struct {
  int64_t N, C, S;
  int rows;
  int64_t block_rows;
} bn_geom_t;

/* 16-bit activations for the float kernels (batchnorm_impl.h's unit_in/unit_out): bfloat16 when bf, else
   float16; each thread's k buffers of wl floats in work. NULL: the activations are of the kernel's type. */
typedef struct {
  int bf;
  float *work;
  int64_t wl;
} bn_half_t;

/* Per-channel totals of `rows` partial rows (rows, C), added in row order: the one fixed
   order that makes batch-norm's sums independent of the thread count. Shared by the f32 and
   f64 kernels, forward and backward. */
static void bn_combine(const double *ps, const double *pq, int64_t rows, int64_t C, double *s, double *q) {
  for (int64_t c = 0; c < C; c++) s[c] = q[c] = 0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < C; c++) {
      s[c] += ps[r * C + c];
      q[c] += pq[r * C + c];
    }
}

#define BN_CAT2(a, b) a##b
#define BN_CAT(a, b) BN_CAT2(a, b)
#define FN(name) BN_CAT(name, BN_SFX)

/* The block kernels pass 64-byte vectors between always-inline helpers, never across a call. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The ReLU mask of the backward passes: none, read from the forward's output y (y > 0), or
   recomputed from x as the forward computed it ((x - m) * fa + fb > 0, no skip): one stream
   less to read. */
enum { BN_NO_MASK, BN_MASK_Y, BN_MASK_X };
/* The mask kind of a pass given the output y (read when there) and the forward's scale fa (when
   the test is redone from x). */
static inline int bn_mask_kind(const void *y, const void *fa) { return y ? BN_MASK_Y : fa ? BN_MASK_X : BN_NO_MASK; }

/* T: the arithmetic's type; AT: the activations' (bfloat16 bits for the channels-last blocks the
   float kernels call on 16-bit activations, BN_HALF). */
#define T float
#define UT uint32_t
#define AT uint16_t
#define BN_SFX _bf16
#define BN_BF16
#define BN_ROWS_ONLY
#include "cpu/batchnorm_impl.h"
#undef BN_ROWS_ONLY
#undef BN_BF16
#undef AT
#undef BN_SFX

#define AT float
#define BN_SFX _f32
#define BN_HALF
#include "cpu/batchnorm_impl.h"
#undef BN_HALF
#undef T
#undef UT
#undef AT
#undef BN_SFX

#define T double
#define UT uint64_t
#define AT double
#define BN_SFX _f64
#include "cpu/batchnorm_impl.h"
#undef T
#undef UT
#undef AT
#undef BN_SFX


/* ---- per-channel vectors ((C), any floating dtype and stride) ---------------------------------- */

static double vec_get(const dlua_bn_vec_t *t, int64_t i) {
  const char *p = (const char *)t->p + i * t->stride * (int64_t)dlua_dtype_size((dlua_dtype_t)t->dtype);
  switch (t->dtype) {
    case DLUA_DTYPE_F32: return *(const float *)p;
    case DLUA_DTYPE_F64: return *(const double *)p;
    case DLUA_DTYPE_F16: return dlua_f16_to_f32_inl(*(const uint16_t *)p);
    default: return dlua_bf16_to_f32_inl(*(const uint16_t *)p);
  }
}

static void vec_set(const dlua_bn_vec_t *t, int64_t i, double v) {
  char *p = (char *)t->p + i * t->stride * (int64_t)dlua_dtype_size((dlua_dtype_t)t->dtype);
  switch (t->dtype) {
    case DLUA_DTYPE_F32: *(float *)p = (float)v; break;
    case DLUA_DTYPE_F64: *(double *)p = v; break;
    case DLUA_DTYPE_F16: *(uint16_t *)p = dlua_f32_to_f16_inl((float)v); break;
    default: *(uint16_t *)p = dlua_f32_to_bf16_inl((float)v); break;
  }
}

static void vec_read(const dlua_bn_vec_t *t, int64_t C, double *dst, double dflt) {
  for (int64_t c = 0; c < C; c++) dst[c] = t->p ? vec_get(t, c) : dflt;
}

/* A (C) statistics output when wanted (its tensor prepared by the front door). */
static void vec_write(const dlua_bn_vec_t *t, int64_t C, const double *v) {
  if (!t->p) return;
  for (int64_t c = 0; c < C; c++) vec_set(t, c, v[c]);
}

/* n doubles into an array of the compute dtype (float or double). */
static void put_t(dlua_dtype_t ct, void *dst, const double *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (ct == DLUA_DTYPE_F64) ((double *)dst)[i] = src[i];
    else ((float *)dst)[i] = (float)src[i];
  }
}

/* The kernels' geometry from the descriptor's. */
static void geom_of(const dlua_bn_geom_t *d, bn_geom_t *g) {
  g->N = d->N;
  g->C = d->C;
  g->S = d->S;
  g->rows = d->rows;
  g->block_rows = g->C > 0 && g->C < BN_BLOCK_ELEMS ? BN_BLOCK_ELEMS / g->C : 1;
}

/* Doubles of scratch the reductions need. */
static int64_t scratch_len(const bn_geom_t *g) {
  if (!g->rows) return 2 * g->N * g->C;
  int64_t M = g->N * g->S;
  return 2 * ((M + g->block_rows - 1) / g->block_rows) * g->C;
}

static void *xmalloc(size_t n, dlua_status_t *s, const char *op) {
  void *p = malloc(n ? n : 1);
  if (!p) *s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, n);
  return p;
}

/* The CPU computes in float32 or float64, and reads and writes float16 / bfloat16 activations itself
   (native_16bit 1), computing in float32. */
static dlua_status_t check_dtype(const char *op, int dtype) {
  if (dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_F64 || dtype == DLUA_DTYPE_F16 || dtype == DLUA_DTYPE_BF16)
    return DLUA_OK;
  return DLUA_ERR(DLUA_ERR_ARG,
                  "%s: the CPU batch-norm kernels take float16, bfloat16, float32 or float64 activations, got dtype %d",
                  op, dtype);
}

static int is_half(dlua_dtype_t dt) { return dt == DLUA_DTYPE_F16 || dt == DLUA_DTYPE_BF16; }

/* The dtype the arithmetic runs in: float64 for float64 activations, else float32. */
static dlua_dtype_t compute_type(dlua_dtype_t dt) { return dt == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32; }

/* Element i of activations of dtype dt, widened (exactly). */
static double act_at(dlua_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case DLUA_DTYPE_F64: return ((const double *)p)[i];
    case DLUA_DTYPE_F32: return ((const float *)p)[i];
    case DLUA_DTYPE_F16: return dlua_f16_to_f32_inl(((const uint16_t *)p)[i]);
    default: return dlua_bf16_to_f32_inl(((const uint16_t *)p)[i]);
  }
}

/* Floats per buffer of the 16-bit passes' per-thread work (the largest unit: a plane, or a block
   of rows), and the allocation of k buffers for every thread (NULL where no driver needs one: 32/64-bit
   activations, and bfloat16 channels-last blocks, which the _bf16 block functions read directly). */
static int64_t unit_len(const bn_geom_t *g) {
  if (!g->rows) return g->S;
  const int64_t M = g->N * g->S;
  return (g->block_rows < M ? g->block_rows : M) * g->C;
}

/* The 16-bit view the float kernels take (h's storage: the caller's stack, for one pass), NULL for 32/64-bit
   activations. */
#define half_of(dt, bf, work, g) (is_half(dt) ? &(bn_half_t){(bf), (work), unit_len(g)} : NULL)

static float *half_work(dlua_dtype_t dt, const bn_geom_t *g, int k, dlua_status_t *s, const char *op) {
  if (!is_half(dt) || (dt == DLUA_DTYPE_BF16 && g->rows)) return NULL;
  return xmalloc((size_t)omp_get_max_threads() * (size_t)k * (size_t)unit_len(g) * sizeof(float), s, op);
}

/* ---- statistics (batch_norm_stats) ---------------------------------------------------------------- */

/* Sums of x and x^2 per channel, and the count, of this batch into a->stats_out. */
static dlua_status_t cpu_bn_stats(const char *op, const dlua_bn_fwd_t *a) {
  bn_geom_t g;
  geom_of(&a->g, &g);
  const int64_t C = g.C, M = a->M;
  const dlua_dtype_t at = (dlua_dtype_t)a->g.dtype, ct = compute_type(at);
  const int bf = at == DLUA_DTYPE_BF16;
  dlua_status_t s = DLUA_OK;
  double *dbl = NULL, *scratch = NULL;
  float *work = NULL;
  dbl = xmalloc((size_t)(3 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK && M > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s == DLUA_OK && M > 0) work = half_work(at, &g, 1, &s, op);
  if (s != DLUA_OK) goto done;
  double *out = a->stats_out, *sh = dbl, *sum = dbl + C, *sq = dbl + 2 * C;
  for (int64_t c = 0; c < 2 * C; c++) out[c] = 0;
  if (M > 0) {
    // As forward: sums of x - shift (a value of the channel), then the shift put back, in double.
    const void *xp = a->x;
    for (int64_t c = 0; c < C; c++) sh[c] = act_at(at, xp, g.rows ? c : c * g.S);
    if (ct == DLUA_DTYPE_F64) bn_stats_f64(&g, xp, NULL, sh, scratch, sum, sq);
    else bn_stats_f32(&g, xp, half_of(at, bf, work, &g), sh, scratch, sum, sq);
    for (int64_t c = 0; c < C; c++) {
      out[c] = sum[c] + (double)M * sh[c];
      out[C + c] = sq[c] + sh[c] * (2.0 * sum[c] + (double)M * sh[c]);
    }
  }
  out[2 * C] = (double)M;
done:
  free(dbl);
  free(scratch);
  free(work);
  return s;
}

/* ---- forward ------------------------------------------------------------------------------------- */

/* Forward in training from the batch (stats NULL) or from sums of several batches (stats: (2C+1)
   [sum x, sum x^2, count], SyncBatchNorm's second half), or in evaluation from the running ones. */
static dlua_status_t cpu_bn_forward(const char *op, const dlua_bn_fwd_t *a) {
  DLUA_TRY(check_dtype(op, a->g.dtype));
  if (a->stats_out) return cpu_bn_stats(op, a);
  bn_geom_t g;
  geom_of(&a->g, &g);
  const int64_t C = g.C, M = a->M;
  const int train = a->train, relu = a->relu;
  const double momentum = a->momentum, eps = a->eps;
  const double *stats = a->stats;
  const dlua_dtype_t at = (dlua_dtype_t)a->g.dtype, ct = compute_type(at);
  const int bf = at == DLUA_DTYPE_BF16;
  const size_t es = dlua_dtype_size(ct);

  dlua_status_t s = DLUA_OK;
  double *dbl = NULL, *scratch = NULL;
  void *tv = NULL;
  float *work = NULL;  // 16-bit activations: per-thread float copies of x and skip, one unit at a time
  // mean, invstd, gamma, beta, sum, sumsq, running values: 7 doubles per channel.
  dbl = xmalloc((size_t)(7 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK) tv = xmalloc((size_t)(3 * C) * es, &s, op);
  if (s == DLUA_OK && train && !stats && M > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s == DLUA_OK) work = half_work(at, &g, 2, &s, op);
  if (s != DLUA_OK) goto done;
  double *mean = dbl, *invstd = dbl + C, *gm = dbl + 2 * C, *bt = dbl + 3 * C, *sum = dbl + 4 * C, *sq = dbl + 5 * C,
         *run = dbl + 6 * C;
  vec_read(&a->gamma, C, gm, 1.0);
  vec_read(&a->beta, C, bt, 0.0);
  const void *xp = a->x;
  if (train && stats) {
    // Unshifted sums in double: var = E[x^2] - mean^2 loses about |mean|^2 / var * 1e-16 of var.
    const double *st = stats;
    for (int64_t c = 0; c < C; c++) {
      double m = M > 0 ? st[c] / (double)M : 0.0;
      double var = M > 0 ? st[C + c] / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean[c] = m;
      invstd[c] = 1.0 / sqrt(var + eps);
      sq[c] = var;
    }
  } else if (train) {
    if (M > 0) {
      // Shift by the channel's first element (the first plane, or the first row).
      for (int64_t c = 0; c < C; c++) run[c] = act_at(at, xp, g.rows ? c : c * g.S);
      if (ct == DLUA_DTYPE_F64) bn_stats_f64(&g, xp, NULL, run, scratch, sum, sq);
      else bn_stats_f32(&g, xp, half_of(at, bf, work, &g), run, scratch, sum, sq);
    }
    for (int64_t c = 0; c < C; c++) {
      double m = M > 0 ? sum[c] / (double)M : 0.0;
      double var = M > 0 ? sq[c] / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean[c] = M > 0 ? run[c] + m : 0.0;
      invstd[c] = 1.0 / sqrt(var + eps);
      sq[c] = var;  // the biased variance, for the running update below
    }
  }
  if (train) {
    if (M > 1) {
      const double unbias = (double)M / (double)(M - 1);
      if (a->running_mean.p) {
        vec_read(&a->running_mean, C, run, 0.0);
        for (int64_t c = 0; c < C; c++) vec_set(&a->running_mean, c, (1 - momentum) * run[c] + momentum * mean[c]);
      }
      if (a->running_var.p) {
        vec_read(&a->running_var, C, run, 0.0);
        for (int64_t c = 0; c < C; c++) vec_set(&a->running_var, c, (1 - momentum) * run[c] + momentum * sq[c] * unbias);
      }
    }
  } else {
    vec_read(&a->running_mean, C, mean, 0.0);
    vec_read(&a->running_var, C, run, 0.0);
    for (int64_t c = 0; c < C; c++) invstd[c] = 1.0 / sqrt(run[c] + eps);
  }
  // Normalise with the invstd that is saved (in ct), so that the backward, from the saved values,
  // recomputes this pass's ReLU mask exactly (dlua_nn_batch_norm_backward's beta).
  if (ct == DLUA_DTYPE_F32)
    for (int64_t c = 0; c < C; c++) invstd[c] = (double)(float)invstd[c];
  const void *sp = a->skip;
  void *yp = a->y;
  void *tm = tv, *ta = (char *)tv + C * es, *tb = (char *)tv + 2 * C * es;
  put_t(ct, tm, mean, C);
  for (int64_t c = 0; c < C; c++) gm[c] *= invstd[c];
  put_t(ct, ta, gm, C);
  put_t(ct, tb, bt, C);
  if (ct == DLUA_DTYPE_F64) bn_apply_f64(&g, xp, sp, yp, NULL, tm, ta, tb, relu);
  else bn_apply_f32(&g, xp, sp, yp, half_of(at, bf, work, &g), tm, ta, tb, relu);
  vec_write(&a->save_mean, C, mean);
  vec_write(&a->save_invstd, C, invstd);
done:
  free(dbl);
  free(tv);
  free(scratch);
  free(work);
  return s;
}

/* ---- backward ------------------------------------------------------------------------------------ */

/* Backward whole (sums_out and sums_in NULL), or its halves for SyncBatchNorm: with sums_out, the
   per-channel reductions only ([sum d, sum d (x - mean), count] into sums_out, and the local
   grad_gamma/grad_beta); with sums_in, the elementwise pass only, from reductions summed over
   every rank (their count normalises). */
static dlua_status_t cpu_bn_backward(const char *op, const dlua_bn_bwd_t *a) {
  DLUA_TRY(check_dtype(op, a->g.dtype));
  bn_geom_t g;
  geom_of(&a->g, &g);
  const int64_t C = g.C, M = a->M;
  const int train = a->train, reduce = a->reduce, accumulate = a->accumulate;
  const dlua_dtype_t at = (dlua_dtype_t)a->g.dtype, ct = compute_type(at);
  const int bf = at == DLUA_DTYPE_BF16;
  const size_t es = dlua_dtype_size(ct);
  const int want_dx = a->dx != NULL, want_skip = a->dskip != NULL;
  const double *sums_in = a->sums_in;
  double *sums_out = a->sums_out;
  const dlua_bn_vec_t *grad_gamma = a->grad_gamma.p ? &a->grad_gamma : NULL, *grad_beta = a->grad_beta.p ? &a->grad_beta : NULL;

  dlua_status_t s = DLUA_OK;
  double *dbl = NULL, *scratch = NULL;
  void *tv = NULL;
  float *work = NULL;  // 16-bit activations: per-thread float copies of x, dy, y, dx, dskip, one unit at a time
  // With beta, the ReLU mask is the forward's own test redone from x, one stream less than reading
  // the output; an output in a narrower dtype than ct (16-bit activations included: y_exact then
  // means y is the forward's 16-bit output, rounded from ct) may have rounded a tiny value to 0, so
  // then the output decides as before.
  const int mask_x = a->y && a->beta.p && a->y_exact && at == ct;
  // mean, invstd, gamma, sum dy, sum dy (x - mean), and a scratch row: 6 doubles per channel.
  dbl = xmalloc((size_t)(6 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK) tv = xmalloc((size_t)(6 * C) * es, &s, op);
  if (s == DLUA_OK && reduce && g.N * g.S > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s == DLUA_OK) work = half_work(at, &g, 5, &s, op);
  if (s != DLUA_OK) goto done;
  double *mean = dbl, *invstd = dbl + C, *gm = dbl + 2 * C, *sdy = dbl + 3 * C, *sdx = dbl + 4 * C;
  vec_read(&a->save_mean, C, mean, 0.0);
  vec_read(&a->save_invstd, C, invstd, 1.0);
  vec_read(&a->gamma, C, gm, 1.0);
  const void *xp = a->x, *dp = a->dy, *yp = mask_x ? NULL : a->y;
  // Per-channel coefficients in the compute type: mean, then A, B, D of the elementwise pass, then
  // the forward's scale gamma * invstd and shift beta when the mask is recomputed.
  void *tm = tv, *ta = (char *)tv + C * es, *tb = (char *)tv + 2 * C * es, *td = (char *)tv + 3 * C * es;
  void *fa = NULL, *fb = NULL;
  put_t(ct, tm, mean, C);
  if (mask_x) {
    double *row = dbl + 5 * C;
    fa = (char *)tv + 4 * C * es;
    fb = (char *)tv + 5 * C * es;
    for (int64_t c = 0; c < C; c++) row[c] = gm[c] * invstd[c];
    put_t(ct, fa, row, C);
    vec_read(&a->beta, C, row, 0.0);
    put_t(ct, fb, row, C);
  }
  for (int64_t c = 0; c < C; c++) sdy[c] = sdx[c] = 0;
  if (reduce && g.N * g.S > 0) {
    if (ct == DLUA_DTYPE_F64) bn_bwd_reduce_f64(&g, xp, dp, yp, NULL, tm, fa, fb, scratch, sdy, sdx);
    else bn_bwd_reduce_f32(&g, xp, dp, yp, half_of(at, bf, work, &g), tm, fa, fb, scratch, sdy, sdx);
  }
  if (sums_in) {
    const double *si = sums_in;
    for (int64_t c = 0; c < C; c++) sdy[c] = si[c], sdx[c] = si[C + c];
  }
  if (sums_out) {
    double *so = sums_out;
    for (int64_t c = 0; c < C; c++) so[c] = sdy[c], so[C + c] = sdx[c];
    so[2 * C] = (double)M;
  }
  for (int64_t c = 0; c < C; c++) {
    if (grad_gamma) vec_set(grad_gamma, c, (accumulate ? vec_get(grad_gamma, c) : 0.0) + sdx[c] * invstd[c]);
    if (grad_beta) vec_set(grad_beta, c, (accumulate ? vec_get(grad_beta, c) : 0.0) + sdy[c]);
  }
  if (want_dx || want_skip) {
    void *gxp = a->dx, *gsp = a->dskip;
    // dx = gamma invstd (d - sum(d) / M - xhat sum(d xhat) / M) with the batch's statistics;
    // gamma invstd d with fixed ones. A, B, D overwrite sdy, sdx, gamma channel by channel.
    double *A = sdy, *B = sdx, *D = gm;
    for (int64_t c = 0; c < C; c++) {
      double a = gm[c] * invstd[c];
      double bb = train && M > 0 ? -a * invstd[c] * invstd[c] * sdx[c] / (double)M : 0.0;
      double dd = train && M > 0 ? -a * sdy[c] / (double)M : 0.0;
      A[c] = a;
      B[c] = bb;
      D[c] = dd;
    }
    put_t(ct, ta, A, C);
    put_t(ct, tb, B, C);
    put_t(ct, td, D, C);
    if (ct == DLUA_DTYPE_F64) bn_bwd_apply_f64(&g, xp, dp, yp, gxp, gsp, NULL, tm, fa, fb, ta, tb, td);
    else bn_bwd_apply_f32(&g, xp, dp, yp, gxp, gsp, half_of(at, bf, work, &g), tm, fa, fb, ta, tb, td);
  }
done:
  free(dbl);
  free(tv);
  free(scratch);
  free(work);
  return s;
}

const struct dlua_norm_ops dlua_cpu_norm_ops = {
    .native_16bit = 1,
    .forward = cpu_bn_forward,
    .backward = cpu_bn_backward,
};

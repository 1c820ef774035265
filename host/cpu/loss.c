/* The CPU's loss family (kernels/loss.h): softmax/log-softmax, threshold/ReLU, dropout's mask-scale, MSE and
   cross-entropy kernels over the contiguous buffers of the compute type that host/ops/loss.c and
   host/ops/activation.c stage, OpenMP-parallel above PAR_MIN elements of work. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/loss.h"

/* Below this many elements of work a loop runs on one thread: waking the pool costs more. */
enum { PAR_MIN = 32768 };
/* Losses are summed per block of this many targets (cross-entropy) or elements (MSE), and
   the block sums are added in block order, so a reduced loss does not depend on threads. */
enum { CE_BLOCK = 64, MSE_BLOCK = 16384 };

/* ---- kernels, once per compute type (T, suffix, exp, log) ----------------------------------- */

/* Lines of a softmax run along the class dim, which has stride `inner`: line l is position
   (l / inner, :, l % inner) of the (outer, K, inner) view. Sums accumulate in double. */
#define LOSS_KERNELS(T, S, EXP, LOG)                                                                         \
  static void softmax_fwd_##S(const T *x, T *y, int64_t outer, int64_t K, int64_t inner, int use_log) {      \
    int64_t lines = outer * inner;                                                                           \
    _Pragma("omp parallel for schedule(static) if (lines * K > PAR_MIN)")                                    \
    for (int64_t l = 0; l < lines; l++) {                                                                    \
      int64_t base = (l / inner) * K * inner + l % inner;                                                    \
      const T *xr = x + base;                                                                                \
      T *yr = y + base;                                                                                      \
      T mx = -INFINITY;                                                                                      \
      for (int64_t k = 0; k < K; k++)                                                                        \
        if (xr[k * inner] > mx) mx = xr[k * inner];                                                          \
      double sum = 0;                                                                                        \
      if (use_log) {                                                                                         \
        for (int64_t k = 0; k < K; k++) sum += EXP(xr[k * inner] - mx);                                      \
        T lsum = (T)LOG(sum);                                                                                \
        for (int64_t k = 0; k < K; k++) yr[k * inner] = (xr[k * inner] - mx) - lsum;                         \
      } else {                                                                                               \
        for (int64_t k = 0; k < K; k++) {                                                                    \
          T e = EXP(xr[k * inner] - mx);                                                                     \
          yr[k * inner] = e;                                                                                 \
          sum += e;                                                                                          \
        }                                                                                                    \
        T inv = (T)(1.0 / sum);                                                                              \
        for (int64_t k = 0; k < K; k++) yr[k * inner] *= inv;                                                \
      }                                                                                                      \
    }                                                                                                        \
  }                                                                                                          \
                                                                                                             \
  /* softmax: gx = y (gy - sum(gy y)); log-softmax: gx = gy - exp(y) sum(gy). */                             \
  static void softmax_bwd_##S(const T *gy, const T *y, T *gx, int64_t outer, int64_t K, int64_t inner,       \
                              int use_log) {                                                                 \
    int64_t lines = outer * inner;                                                                           \
    _Pragma("omp parallel for schedule(static) if (lines * K > PAR_MIN)")                                    \
    for (int64_t l = 0; l < lines; l++) {                                                                    \
      int64_t base = (l / inner) * K * inner + l % inner;                                                    \
      const T *g = gy + base, *yr = y + base;                                                                \
      T *o = gx + base;                                                                                      \
      double acc = 0;                                                                                        \
      if (use_log) {                                                                                         \
        for (int64_t k = 0; k < K; k++) acc += g[k * inner];                                                 \
        T a = (T)acc;                                                                                        \
        for (int64_t k = 0; k < K; k++) o[k * inner] = g[k * inner] - EXP(yr[k * inner]) * a;                \
      } else {                                                                                               \
        for (int64_t k = 0; k < K; k++) acc += (double)g[k * inner] * yr[k * inner];                         \
        T a = (T)acc;                                                                                        \
        for (int64_t k = 0; k < K; k++) o[k * inner] = yr[k * inner] * (g[k * inner] - a);                   \
      }                                                                                                      \
    }                                                                                                        \
  }                                                                                                          \
                                                                                                             \
  static void threshold_##S(const T *x, T *y, int64_t n, T th, T value) {                                    \
    _Pragma("omp parallel for simd schedule(static) if (n > PAR_MIN)")                                       \
    for (int64_t i = 0; i < n; i++) y[i] = x[i] <= th ? value : x[i];                                        \
  }                                                                                                          \
                                                                                                             \
  static void threshold_bwd_##S(const T *gy, const T *x, T *gx, int64_t n, T th) {                           \
    _Pragma("omp parallel for simd schedule(static) if (n > PAR_MIN)")                                       \
    for (int64_t i = 0; i < n; i++) gx[i] = x[i] <= th ? (T)0 : gy[i];                                       \
  }                                                                                                          \
                                                                                                             \
  /* A multiply rather than a select, so a dropped NaN stays NaN as in PyTorch's x * mask. */                \
  static void mask_scale_##S(const T *x, const uint8_t *m, T *y, int64_t n, T scale) {                       \
    _Pragma("omp parallel for simd schedule(static) if (n > PAR_MIN)")                                       \
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * (m[i] ? scale : (T)0);                                     \
  }                                                                                                          \
                                                                                                             \
  /* (x - t)^2 per element (none), or its sum in fixed blocks. */                                            \
  static void mse_fwd_##S(const T *x, const T *t, T *out, double *blocks, int64_t n) {                       \
    if (out) {                                                                                               \
      _Pragma("omp parallel for simd schedule(static) if (n > PAR_MIN)")                                     \
      for (int64_t i = 0; i < n; i++) {                                                                      \
        T d = x[i] - t[i];                                                                                   \
        out[i] = d * d;                                                                                      \
      }                                                                                                      \
      return;                                                                                                \
    }                                                                                                        \
    int64_t nb = (n + MSE_BLOCK - 1) / MSE_BLOCK;                                                            \
    _Pragma("omp parallel for schedule(static) if (nb > 1)")                                                 \
    for (int64_t b = 0; b < nb; b++) {                                                                       \
      int64_t lo = b * MSE_BLOCK, hi = lo + MSE_BLOCK < n ? lo + MSE_BLOCK : n;                              \
      double s = 0;                                                                                          \
      for (int64_t i = lo; i < hi; i++) {                                                                    \
        T d = x[i] - t[i];                                                                                   \
        s += d * d;                                                                                          \
      }                                                                                                      \
      blocks[b] = s;                                                                                         \
    }                                                                                                        \
  }                                                                                                          \
                                                                                                             \
  /* gx = norm (x - t) g, norm = 2 (2 / n for mean); g per element (gy) or one value. */                    \
  static void mse_bwd_##S(const T *x, const T *t, const T *gy, T g, T norm, T *gx, int64_t n) {              \
    _Pragma("omp parallel for simd schedule(static) if (n > PAR_MIN)")                                       \
    for (int64_t i = 0; i < n; i++) gx[i] = norm * (x[i] - t[i]) * (gy ? gy[i] : g);                         \
  }

LOSS_KERNELS(float, f, expf, log)
LOSS_KERNELS(double, d, exp, log)

/* ---- cross-entropy ------------------------------------------------------------------------------ */

/* One target's loss from its logits row (stride `inner`), writing log-probabilities to lp
   when given. Computes in double whatever the storage type. */
#define CE_KERNELS(T, S)                                                                                     \
  static void ce_fwd_##S(const dlua_loss_ce_t *pl, const T *x, T *lp, T *loss_none, double *blocks) {             \
    int64_t K = pl->K, inner = pl->inner, nb = (pl->P + CE_BLOCK - 1) / CE_BLOCK;                            \
    double e_k = pl->K ? pl->eps / (double)pl->K : 0.0;                                                      \
    _Pragma("omp parallel for schedule(static) if (pl->P * K > PAR_MIN)")                                    \
    for (int64_t b = 0; b < nb; b++) {                                                                       \
      int64_t hi = (b + 1) * CE_BLOCK < pl->P ? (b + 1) * CE_BLOCK : pl->P;                                  \
      double bsum = 0;                                                                                       \
      for (int64_t i = b * CE_BLOCK; i < hi; i++) {                                                          \
        int64_t off = (i / inner) * K * inner + i % inner;                                                   \
        const T *xr = x + off;                                                                               \
        double mx = -INFINITY, sum = 0;                                                                      \
        for (int64_t k = 0; k < K; k++)                                                                      \
          if (xr[k * inner] > mx) mx = xr[k * inner];                                                        \
        for (int64_t k = 0; k < K; k++) sum += exp((double)xr[k * inner] - mx);                              \
        double lse = mx + log(sum);                                                                          \
        if (lp)                                                                                              \
          for (int64_t k = 0; k < K; k++) lp[off + k * inner] = (T)(((double)xr[k * inner] - mx) - log(sum)); \
        double l = 0;                                                                                        \
        int64_t v = pl->labels[i];                                                                           \
        if (v != pl->ignore) {                                                                               \
          int64_t c = v - pl->base;                                                                          \
          double wy = pl->w ? pl->w[c] : 1.0;                                                                \
          l = -(1.0 - pl->eps) * wy * ((double)xr[c * inner] - lse);                                         \
          if (pl->eps > 0) {                                                                                 \
            double sm = 0;                                                                                   \
            for (int64_t k = 0; k < K; k++) sm += (pl->w ? pl->w[k] : 1.0) * ((double)xr[k * inner] - lse);  \
            l -= e_k * sm;                                                                                   \
          }                                                                                                  \
        }                                                                                                    \
        if (loss_none) loss_none[i] = (T)l;                                                                  \
        bsum += l;                                                                                           \
      }                                                                                                      \
      if (blocks) blocks[b] = bsum;                                                                          \
    }                                                                                                        \
  }                                                                                                          \
                                                                                                             \
  /* g: per-target upstream gradient (gy) or one scale for every target. */                                 \
  static void ce_bwd_##S(const dlua_loss_ce_t *pl, const T *lp, const T *gy, double g, T *gx) {                  \
    int64_t K = pl->K, inner = pl->inner;                                                                    \
    double e_k = pl->K ? pl->eps / (double)pl->K : 0.0;                                                      \
    _Pragma("omp parallel for schedule(static) if (pl->P * K > PAR_MIN)")                                    \
    for (int64_t i = 0; i < pl->P; i++) {                                                                    \
      int64_t off = (i / inner) * K * inner + i % inner;                                                     \
      const T *lr = lp + off;                                                                                \
      T *o = gx + off;                                                                                       \
      int64_t v = pl->labels[i];                                                                             \
      if (v == pl->ignore) {                                                                                 \
        for (int64_t k = 0; k < K; k++) o[k * inner] = 0;                                                    \
        continue;                                                                                            \
      }                                                                                                      \
      int64_t c = v - pl->base;                                                                              \
      double wy = pl->w ? pl->w[c] : 1.0, gi = gy ? (double)gy[i] : g;                                       \
      double hot = (1.0 - pl->eps) * wy, S = hot + e_k * pl->wsum;                                           \
      for (int64_t k = 0; k < K; k++) {                                                                      \
        double q = e_k * (pl->w ? pl->w[k] : 1.0) + (k == c ? hot : 0.0);                                    \
        o[k * inner] = (T)(gi * (exp((double)lr[k * inner]) * S - q));                                       \
      }                                                                                                      \
    }                                                                                                        \
  }

CE_KERNELS(float, f)
CE_KERNELS(double, d)

/* ---- the table's entries ---------------------------------------------------------------------------- */

static dlua_status_t cpu_softmax(const char *op, const dlua_loss_softmax_t *d) {
  (void)op;
  if (d->ct == DLUA_DTYPE_F64)
    softmax_fwd_d(d->x, d->y, d->outer, d->K, d->inner, d->log);
  else
    softmax_fwd_f(d->x, d->y, d->outer, d->K, d->inner, d->log);
  return DLUA_OK;
}

static dlua_status_t cpu_softmax_backward(const char *op, const dlua_loss_softmax_bwd_t *d) {
  (void)op;
  if (d->ct == DLUA_DTYPE_F64)
    softmax_bwd_d(d->gy, d->y, d->gx, d->outer, d->K, d->inner, d->log);
  else
    softmax_bwd_f(d->gy, d->y, d->gx, d->outer, d->K, d->inner, d->log);
  return DLUA_OK;
}

static dlua_status_t cpu_threshold(const char *op, const dlua_loss_threshold_t *d) {
  (void)op;
  if (d->ct == DLUA_DTYPE_F64)
    threshold_d(d->x, d->y, d->n, d->th, d->value);
  else
    threshold_f(d->x, d->y, d->n, (float)d->th, (float)d->value);
  return DLUA_OK;
}

static dlua_status_t cpu_threshold_backward(const char *op, const dlua_loss_threshold_bwd_t *d) {
  (void)op;
  if (d->ct == DLUA_DTYPE_F64)
    threshold_bwd_d(d->gy, d->x, d->gx, d->n, d->th);
  else
    threshold_bwd_f(d->gy, d->x, d->gx, d->n, (float)d->th);
  return DLUA_OK;
}

static dlua_status_t cpu_mask_scale(const char *op, const dlua_loss_mask_scale_t *d) {
  (void)op;
  if (d->ct == DLUA_DTYPE_F64)
    mask_scale_d(d->x, d->m, d->y, d->n, d->scale);
  else
    mask_scale_f(d->x, d->m, d->y, d->n, (float)d->scale);
  return DLUA_OK;
}

static dlua_status_t cpu_mse(const char *op, const dlua_loss_mse_t *d) {
  int64_t n = d->n, nb = (n + MSE_BLOCK - 1) / MSE_BLOCK;
  double *blocks = NULL;
  if (d->sum) {
    blocks = malloc((size_t)(nb ? nb : 1) * sizeof(double));
    if (!blocks) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, (size_t)nb * sizeof(double));
  }
  if (d->ct == DLUA_DTYPE_F64)
    mse_fwd_d(d->x, d->t, d->out_none, blocks, n);
  else
    mse_fwd_f(d->x, d->t, d->out_none, blocks, n);
  if (blocks) {
    double total = 0;
    for (int64_t b = 0; b < nb; b++) total += blocks[b];
    *d->sum = total / d->div;  // mean of nothing: NaN
  }
  free(blocks);
  return DLUA_OK;
}

static dlua_status_t cpu_mse_backward(const char *op, const dlua_loss_mse_bwd_t *d) {
  (void)op;
  double g = d->gscalar ? *d->gscalar : 1;
  if (d->ct == DLUA_DTYPE_F64)
    mse_bwd_d(d->x, d->t, d->gy, g, d->norm, d->gx, d->n);
  else
    mse_bwd_f(d->x, d->t, d->gy, (float)g, (float)d->norm, d->gx, d->n);
  return DLUA_OK;
}

static dlua_status_t cpu_cross_entropy(const char *op, const dlua_loss_ce_fwd_t *d) {
  int64_t nb = (d->pl.P + CE_BLOCK - 1) / CE_BLOCK;
  double *blocks = NULL;
  if (d->sum) {
    blocks = malloc((size_t)(nb ? nb : 1) * sizeof(double));
    if (!blocks) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, (size_t)nb * sizeof(double));
  }
  if (d->ct == DLUA_DTYPE_F64)
    ce_fwd_d(&d->pl, d->x, d->lp, d->loss_none, blocks);
  else
    ce_fwd_f(&d->pl, d->x, d->lp, d->loss_none, blocks);
  if (blocks) {
    double total = 0;
    for (int64_t b = 0; b < nb; b++) total += blocks[b];
    // Mean over no kept target is 0 / 0 = NaN, as in PyTorch.
    *d->sum = total / d->div;
  }
  free(blocks);
  return DLUA_OK;
}

static dlua_status_t cpu_cross_entropy_backward(const char *op, const dlua_loss_ce_bwd_t *d) {
  (void)op;
  double g = (d->gscalar ? *d->gscalar : 1.0) / d->div;
  if (d->ct == DLUA_DTYPE_F64)
    ce_bwd_d(&d->pl, d->lp, d->gy, g, d->gx);
  else
    ce_bwd_f(&d->pl, d->lp, d->gy, g, d->gx);
  return DLUA_OK;
}

const struct dlua_loss_ops dlua_cpu_loss_ops = {
    .softmax = cpu_softmax,
    .softmax_backward = cpu_softmax_backward,
    .threshold = cpu_threshold,
    .threshold_backward = cpu_threshold_backward,
    .mask_scale = cpu_mask_scale,
    .mse = cpu_mse,
    .mse_backward = cpu_mse_backward,
    .cross_entropy = cpu_cross_entropy,
    .cross_entropy_backward = cpu_cross_entropy_backward,
};

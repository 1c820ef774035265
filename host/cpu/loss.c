/* CPU losses and activation gradients: softmax/log-softmax, cross-entropy, MSE, threshold/ReLU backward, dropout. */
/* Over 900 lines on purpose for now: the staging section (to the compute dtype, contiguous) and the per-type kernel
   macros serve every loss below; threshold and dropout leave this file with #19's host/ops move, which makes
   staging an ops-layer service. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda/loss_cuda.h" /* plain C: only CUDA builds call into it */

/* Below this many elements of work a loop runs on one thread: waking the pool costs more. */
enum { PAR_MIN = 32768 };
/* Losses are summed per block of this many targets (cross-entropy) or elements (MSE), and
   the block sums are added in block order, so a reduced loss does not depend on threads. */
enum { CE_BLOCK = 64, MSE_BLOCK = 16384 };

/* A CUDA launch (host/cuda/loss.cu) where the operands are on a device. Without CUDA in the build no
   tensor is, and the call is compiled out (sizeof keeps its arguments used without calling it). */
#ifdef DLUA_HAVE_CUDA
#define CUDA_CALL(call) (call)
#else
#define CUDA_CALL(call) ((void)sizeof(call), DLUA_ERR(DLUA_ERR_INTERNAL, "loss: a CUDA tensor in a build without CUDA"))
#endif

/* ---- staging: kernels see contiguous buffers of their compute dtype ------------------------- */

/* f64 computes in double; f32, f16 and bf16 in float. */
static dlua_dtype_t compute_dtype(dlua_dtype_t d) { return d == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32; }

static dlua_status_t check_tensor(const char *op, const char *what, const dlua_tensor_t *t, int floating) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
#ifndef DLUA_HAVE_CUDA
  DLUA_TRY(dlua_require_cpu(op, t));
#endif
  if (floating && !dlua_dtype_is_floating(t->dtype)) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a floating-point tensor, got %s", op, what,
                    dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

static int same_shape(const dlua_tensor_t *a, const dlua_tensor_t *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->sizes[d] != b->sizes[d]) return 0;
  return 1;
}

static dlua_status_t check_same_shape(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                      const dlua_tensor_t *b) {
  if (same_shape(a, b)) return DLUA_OK;
  char b1[200], b2[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s and %s %s must have the same shape", op, wa,
                  dlua_tensor_describe(a, b1, sizeof b1), wb, dlua_tensor_describe(b, b2, sizeof b2));
}

/* An input as a contiguous buffer of dtype ct: the tensor's own memory when it already is
   one, else a converted copy (tmp). */
typedef struct {
  const void *p;
  int64_t n;
  dlua_tensor_t *tmp;
} in_buf_t;

static dlua_status_t in_stage(const dlua_tensor_t *t, dlua_dtype_t ct, in_buf_t *b) {
  b->tmp = NULL;
  b->n = dlua_tensor_numel(t);
  if (t->dtype == ct && dlua_tensor_is_contiguous(t)) {
    b->p = dlua_tensor_ptr(t);
    return DLUA_OK;
  }
  DLUA_TRY(dlua_tensor_to_dtype(&b->tmp, t, ct));
  b->p = dlua_tensor_ptr(b->tmp);
  return DLUA_OK;
}

static void in_release(in_buf_t *b, int n) {
  for (int i = 0; i < n; i++) {
    dlua_tensor_free(b[i].tmp);
    b[i].tmp = NULL;
  }
}

/* The result buffer behind the `out` convention: *out itself when it is contiguous of dtype ct
   and meets no input's memory except by being exactly that input (every kernel here reads an
   element before writing it, so exact in-place use is safe); else a temporary copied into
   *out (converting) at the end. */
typedef struct {
  dlua_tensor_t **out;
  dlua_tensor_t *tmp;
  void *p;
  int allocated;
} out_buf_t;

static dlua_status_t out_stage(const char *op, dlua_tensor_t **out, int nd, const int64_t *sizes, dlua_dtype_t dt,
                               dlua_dtype_t ct, const in_buf_t *ins, int nin, int device, out_buf_t *o) {
  o->out = out;
  o->tmp = NULL;
  o->allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, out, nd, sizes, dt, device, &o->allocated));
  dlua_tensor_t *t = *out;
  int direct = t->dtype == ct && dlua_tensor_is_contiguous(t);
  if (!o->allocated) {
    for (int d = 0; d < t->ndim; d++)
      if (t->sizes[d] > 1 && t->strides[d] == 0) {
        char b[200];
        return DLUA_ERR(DLUA_ERR_ARG,
                        "%s: cannot write into %s: it is an expanded view whose elements share memory (clone it first)",
                        op, dlua_tensor_describe(t, b, sizeof b));
      }
    int64_t n = dlua_tensor_numel(t);
    size_t es = dlua_dtype_size(ct);
    uintptr_t lo = (uintptr_t)dlua_tensor_ptr(t), hi = lo + (uintptr_t)n * es;
    for (int i = 0; direct && i < nin; i++) {
      if (ins[i].tmp || ins[i].n == 0 || n == 0) continue;
      uintptr_t ilo = (uintptr_t)ins[i].p, ihi = ilo + (uintptr_t)ins[i].n * es;
      if (ilo < hi && lo < ihi && !(ilo == lo && ins[i].n == n)) direct = 0;
    }
  }
  if (direct) {
    o->p = dlua_tensor_ptr(t);
    return DLUA_OK;
  }
  dlua_status_t s = dlua_tensor_empty(&o->tmp, nd, sizes, ct, device);
  if (s != DLUA_OK) {
    if (o->allocated) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
    return s;
  }
  o->p = dlua_tensor_ptr(o->tmp);
  return DLUA_OK;
}

/* Copies a staged result over (when s is OK) and releases the temporary. */
static dlua_status_t out_copy(out_buf_t *o, dlua_status_t s) {
  if (s == DLUA_OK && o->tmp) s = dlua_tensor_copy_(*o->out, o->tmp);
  dlua_tensor_free(o->tmp);
  o->tmp = NULL;
  return s;
}

/* After a failure: frees an output allocated here, so the caller's *out is NULL again. */
static void out_abort(out_buf_t *o) {
  if (o->allocated) {
    dlua_tensor_free(*o->out);
    *o->out = NULL;
    o->allocated = 0;
  }
}

static dlua_status_t out_finish(out_buf_t *o, dlua_status_t s) {
  s = out_copy(o, s);
  if (s != DLUA_OK) out_abort(o);
  return s;
}

/* The element of a one-element float tensor (an upstream gradient of a reduced loss). */
static double only_value(const dlua_tensor_t *t) {
  const void *p = dlua_tensor_ptr(t);
  switch (t->dtype) {
    case DLUA_DTYPE_F32: return *(const float *)p;
    case DLUA_DTYPE_F64: return *(const double *)p;
    case DLUA_DTYPE_F16: return dlua_f16_to_f32_inl(*(const uint16_t *)p);
    default: return dlua_bf16_to_f32_inl(*(const uint16_t *)p);
  }
}

static dlua_status_t check_reduction(const char *op, dlua_loss_reduction_t r) {
  if ((int)r < 0 || r >= DLUA_LOSS_REDUCTION_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid reduction %d (expected none 0, mean 1 or sum 2)", op, (int)r);
  return DLUA_OK;
}

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

/* ---- softmax ----------------------------------------------------------------------------------- */

static dlua_status_t softmax_dims(const char *op, const dlua_tensor_t *t, int dim, int64_t *outer, int64_t *K,
                                  int64_t *inner) {
  int nd = t->ndim ? t->ndim : 1;  // a 0-dim tensor is one row of one element, as in torch
  if (dim < 0 || dim >= nd) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: dimension %d out of range for %s (0-based, expected 0..%d)", op, dim,
                    dlua_tensor_describe(t, b, sizeof b), nd - 1);
  }
  *outer = 1, *inner = 1, *K = t->ndim ? t->sizes[dim] : 1;
  for (int d = 0; d < t->ndim; d++) {
    if (d < dim) *outer *= t->sizes[d];
    if (d > dim) *inner *= t->sizes[d];
  }
  return DLUA_OK;
}

dlua_status_t dlua_nn_softmax(dlua_tensor_t **out, const dlua_tensor_t *x, int dim, int log) {
  const char *op = log ? "log_softmax" : "softmax";
  DLUA_TRY(check_tensor(op, "x", x, 1));
  int64_t outer = 0, K = 0, inner = 0;
  DLUA_TRY(softmax_dims(op, x, dim, &outer, &K, &inner));
  dlua_dtype_t ct = compute_dtype(x->dtype);
  in_buf_t in;
  DLUA_TRY(in_stage(x, ct, &in));
  out_buf_t o;
  dlua_status_t s = out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, &in, 1, x->device, &o);
  if (s == DLUA_OK) {
    if (x->device != DLUA_CPU)
      s = CUDA_CALL(dlua_cuda_softmax_fwd(op, (int)ct, in.p, o.p, outer, K, inner, log, x->device));
    else if (ct == DLUA_DTYPE_F64)
      softmax_fwd_d(in.p, o.p, outer, K, inner, log);
    else
      softmax_fwd_f(in.p, o.p, outer, K, inner, log);
    s = out_finish(&o, s);
  }
  in_release(&in, 1);
  return s;
}

dlua_status_t dlua_nn_softmax_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                       const dlua_tensor_t *output, int dim, int log) {
  const char *op = log ? "log_softmax_backward" : "softmax_backward";
  DLUA_TRY(check_tensor(op, "grad_output", grad_output, 1));
  DLUA_TRY(check_tensor(op, "output", output, 1));
  DLUA_TRY(dlua_same_device(op, grad_output, output));
  DLUA_TRY(check_same_shape(op, "grad_output", grad_output, "output", output));
  int64_t outer = 0, K = 0, inner = 0;
  DLUA_TRY(softmax_dims(op, output, dim, &outer, &K, &inner));
  dlua_dtype_t rt = dlua_dtype_promote(grad_output->dtype, output->dtype), ct = compute_dtype(rt);
  in_buf_t in[2];
  DLUA_TRY(in_stage(grad_output, ct, &in[0]));
  dlua_status_t s = in_stage(output, ct, &in[1]);
  if (s != DLUA_OK) {
    in_release(in, 1);
    return s;
  }
  out_buf_t o;
  s = out_stage(op, grad_input, output->ndim, output->sizes, rt, ct, in, 2, output->device, &o);
  if (s == DLUA_OK) {
    if (output->device != DLUA_CPU)
      s = CUDA_CALL(dlua_cuda_softmax_bwd(op, (int)ct, in[0].p, in[1].p, o.p, outer, K, inner, log, output->device));
    else if (ct == DLUA_DTYPE_F64)
      softmax_bwd_d(in[0].p, in[1].p, o.p, outer, K, inner, log);
    else
      softmax_bwd_f(in[0].p, in[1].p, o.p, outer, K, inner, log);
    s = out_finish(&o, s);
  }
  in_release(in, 2);
  return s;
}

/* ---- cross-entropy ------------------------------------------------------------------------------ */

/* Per target i with class y (not ignored), PyTorch's loss with smoothing e over K classes is
     l_i = -(1 - e) w_y logp_y - (e / K) sum_c w_c logp_c,
   mean divides the summed l_i by sum_i w_y over kept targets. Its gradient wrt the logits is
     dl_i/dx_c = p_c S_i - q_ic,  q_ic = (1 - e) w_y [c == y] + (e / K) w_c,  S_i = sum_c q_ic. */
typedef struct {
  int64_t N, K, inner, P;   /* P = N * inner targets */
  const int64_t *labels;    /* (P) as given, integers from base */
  int64_t base, ignore;
  const double *w;          /* (K) or NULL */
  double wsum;              /* sum_c w_c (K without weights) */
  double eps;               /* label smoothing */
  /* CUDA: labels and w above are host copies (owned) for the checks and sums, these the device buffers. */
  int64_t *host_labels;
  double *host_w;
  const int64_t *dev_labels;
  const double *dev_w;
} ce_plan_t;

/* Logits (N, K, d...) or (K); labels (N, d...) or (). */
static dlua_status_t ce_shapes(const char *op, const dlua_tensor_t *logits, const dlua_tensor_t *labels,
                               const char *what, ce_plan_t *pl) {
  char b1[200], b2[200];
  int ok = logits->ndim >= 1 && labels->ndim == logits->ndim - 1;
  if (ok && logits->ndim >= 2) {
    ok = labels->sizes[0] == logits->sizes[0];
    for (int d = 2; ok && d < logits->ndim; d++) ok = labels->sizes[d - 1] == logits->sizes[d];
  }
  if (!ok)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: %s %s and labels %s do not match: expected %s (N, K, d...) with labels (N, d...), or (K) "
                    "with a 0-dim label",
                    op, what, dlua_tensor_describe(logits, b1, sizeof b1), dlua_tensor_describe(labels, b2, sizeof b2),
                    what);
  pl->N = logits->ndim >= 2 ? logits->sizes[0] : 1;
  pl->K = logits->ndim >= 2 ? logits->sizes[1] : logits->sizes[0];
  pl->inner = 1;
  for (int d = 2; d < logits->ndim; d++) pl->inner *= logits->sizes[d];
  pl->P = pl->N * pl->inner;
  return DLUA_OK;
}

/* Checks every label (sequentially: the report names the first bad one) and sums the weights
   of the kept targets in target order, the mean's denominator; forward and backward share it
   so their denominators are bit-identical. */
static dlua_status_t ce_labels(const char *op, const ce_plan_t *pl, double *total_weight) {
  double tw = 0;
  for (int64_t i = 0; i < pl->P; i++) {
    int64_t v = pl->labels[i];
    if (v == pl->ignore) continue;
    // Unsigned compare also catches v - base wrapping around.
    if ((uint64_t)v - (uint64_t)pl->base >= (uint64_t)pl->K)
      return DLUA_ERR(DLUA_ERR_ARG,
                      "%s: label %" PRId64 " at target %" PRId64 " is out of range for %" PRId64
                      " classes: expected %" PRId64 "..%" PRId64 " (or ignore_index %" PRId64 ")",
                      op, v, i + pl->base, pl->K, pl->base, pl->base + pl->K - 1, pl->ignore);
    tw += pl->w ? pl->w[v - pl->base] : 1.0;
  }
  *total_weight = tw;
  return DLUA_OK;
}

/* Frees what ce_prepare made: staged labels and weight, and their host copies. */
static void ce_release(ce_plan_t *pl, in_buf_t *lab, in_buf_t *wbuf) {
  free(pl->host_labels);
  free(pl->host_w);
  pl->host_labels = NULL;
  pl->host_w = NULL;
  in_release(lab, 1);
  in_release(wbuf, 1);
}

/* The plan as host/cuda/loss.cu takes it. */
static inline dlua_cuda_ce_t ce_cuda_plan(const ce_plan_t *pl) {
  dlua_cuda_ce_t c = {.N = pl->N, .K = pl->K, .inner = pl->inner, .P = pl->P, .labels = pl->dev_labels,
                      .base = pl->base, .ignore = pl->ignore, .w = pl->dev_w, .wsum = pl->wsum, .eps = pl->eps};
  return c;
}

/* Labels as int64 (any integer dtype), the weight as double, and the plan's options. */
static dlua_status_t ce_prepare(const char *op, const dlua_tensor_t *labels, const dlua_tensor_t *weight,
                                double eps, int64_t ignore, int64_t base, ce_plan_t *pl, in_buf_t *lab,
                                in_buf_t *wbuf) {
  lab->tmp = wbuf->tmp = NULL;
  pl->host_labels = NULL;
  pl->host_w = NULL;
  if (!(eps >= 0 && eps <= 1))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: label_smoothing must be in [0, 1], got %g", op, eps);
  if (dlua_dtype_is_floating(labels->dtype) || labels->dtype == DLUA_DTYPE_BOOL) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: labels must be an integer tensor of class numbers, got %s", op,
                    dlua_tensor_describe(labels, b, sizeof b));
  }
  if (weight) {
    DLUA_TRY(check_tensor(op, "weight", weight, 1));
    DLUA_TRY(dlua_same_device(op, labels, weight));
    if (weight->ndim != 1 || weight->sizes[0] != pl->K) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: weight %s must be one value per class: (%" PRId64 ")", op,
                      dlua_tensor_describe(weight, b, sizeof b), pl->K);
    }
    DLUA_TRY(in_stage(weight, DLUA_DTYPE_F64, wbuf));
  }
  dlua_status_t s = in_stage(labels, DLUA_DTYPE_I64, lab);
  if (s != DLUA_OK) {
    in_release(wbuf, 1);
    return s;
  }
  pl->labels = lab->p;
  pl->dev_labels = NULL;
  pl->dev_w = NULL;
  if (labels->device != DLUA_CPU) {
    // Labels are checked (and the mean's weights summed) on the host, as on the CPU: one copy back and a
    // wait for the stream, in exchange for the same error message naming the first bad label.
    size_t lb = (size_t)pl->P * sizeof(int64_t), wb = (size_t)pl->K * sizeof(double);
    pl->host_labels = malloc(lb ? lb : 1);
    pl->host_w = weight ? malloc(wb ? wb : 1) : NULL;
    if (!pl->host_labels || (weight && !pl->host_w)) {
      s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, lb + wb);
    } else {
      s = dlua_tensor_to_data(lab->tmp ? lab->tmp : labels, pl->host_labels, lb);
      if (s == DLUA_OK && weight) s = dlua_tensor_to_data(wbuf->tmp ? wbuf->tmp : weight, pl->host_w, wb);
    }
    if (s != DLUA_OK) {
      ce_release(pl, lab, wbuf);
      return s;
    }
    pl->dev_labels = lab->p;
    pl->dev_w = weight ? wbuf->p : NULL;
    pl->labels = pl->host_labels;
  }
  pl->base = base;
  pl->ignore = ignore;
  pl->eps = eps;
  pl->w = weight ? (pl->host_w ? pl->host_w : wbuf->p) : NULL;
  pl->wsum = (double)pl->K;
  if (pl->w) {
    pl->wsum = 0;
    for (int64_t c = 0; c < pl->K; c++) pl->wsum += pl->w[c];
  }
  return DLUA_OK;
}

/* One target's loss from its logits row (stride `inner`), writing log-probabilities to lp
   when given. Computes in double whatever the storage type. */
#define CE_KERNELS(T, S)                                                                                     \
  static void ce_fwd_##S(const ce_plan_t *pl, const T *x, T *lp, T *loss_none, double *blocks) {             \
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
  static void ce_bwd_##S(const ce_plan_t *pl, const T *lp, const T *gy, double g, T *gx) {                  \
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

dlua_status_t dlua_nn_cross_entropy(dlua_tensor_t **out, dlua_tensor_t **log_probs, const dlua_tensor_t *logits,
                                    const dlua_tensor_t *labels, const dlua_tensor_t *weight,
                                    dlua_loss_reduction_t reduction, double label_smoothing, int64_t ignore_index,
                                    int64_t index_base) {
  const char *op = "cross_entropy";
  DLUA_TRY(check_tensor(op, "logits", logits, 1));
  DLUA_TRY(check_tensor(op, "labels", labels, 0));
  DLUA_TRY(dlua_same_device(op, logits, labels));
  DLUA_TRY(check_reduction(op, reduction));
  ce_plan_t pl;
  DLUA_TRY(ce_shapes(op, logits, labels, "logits", &pl));
  in_buf_t aux[2], x;  // labels, weight
  DLUA_TRY(ce_prepare(op, labels, weight, label_smoothing, ignore_index, index_base, &pl, &aux[0], &aux[1]));
  double tw = 0;
  dlua_status_t s = ce_labels(op, &pl, &tw);
  dlua_dtype_t ct = compute_dtype(logits->dtype);
  x.tmp = NULL;
  if (s == DLUA_OK) s = in_stage(logits, ct, &x);
  double *blocks = NULL;
  int64_t nb = (pl.P + CE_BLOCK - 1) / CE_BLOCK;
  const int dev = logits->device;
  if (s == DLUA_OK && reduction != DLUA_LOSS_NONE && dev == DLUA_CPU) {
    blocks = malloc((size_t)(nb ? nb : 1) * sizeof(double));
    if (!blocks) s = DLUA_ERR(DLUA_ERR_OOM, "cross_entropy: out of memory allocating %zu bytes", (size_t)nb * sizeof(double));
  }
  out_buf_t lo = {0}, lossb = {0};
  int have_lp = 0, have_loss = 0;
  if (s == DLUA_OK && log_probs) {
    s = out_stage(op, log_probs, logits->ndim, logits->sizes, logits->dtype, ct, &x, 1, dev, &lo);
    have_lp = s == DLUA_OK;
  }
  if (s == DLUA_OK) {
    if (reduction == DLUA_LOSS_NONE)
      s = out_stage(op, out, labels->ndim, labels->sizes, logits->dtype, ct, &x, 1, dev, &lossb);
    else
      s = out_stage(op, out, 0, NULL, logits->dtype, DLUA_DTYPE_F64, NULL, 0, dev, &lossb);
    have_loss = s == DLUA_OK;
  }
  if (s == DLUA_OK && dev != DLUA_CPU) {
    dlua_cuda_ce_t cp = ce_cuda_plan(&pl);
    int reduced = reduction != DLUA_LOSS_NONE;
    s = CUDA_CALL(dlua_cuda_ce_fwd(op, (int)ct, &cp, x.p, have_lp ? lo.p : NULL, reduced ? NULL : lossb.p,
                                   reduced ? lossb.p : NULL, reduction == DLUA_LOSS_MEAN ? tw : 1.0, dev));
  } else if (s == DLUA_OK) {
    void *none = reduction == DLUA_LOSS_NONE ? lossb.p : NULL;
    if (ct == DLUA_DTYPE_F64)
      ce_fwd_d(&pl, x.p, have_lp ? lo.p : NULL, none, blocks);
    else
      ce_fwd_f(&pl, x.p, have_lp ? lo.p : NULL, none, blocks);
    if (blocks) {
      double total = 0;
      for (int64_t b = 0; b < nb; b++) total += blocks[b];
      // Mean over no kept target is 0 / 0 = NaN, as in PyTorch.
      *(double *)lossb.p = reduction == DLUA_LOSS_MEAN ? total / tw : total;
    }
  }
  if (have_loss) s = out_copy(&lossb, s);
  if (have_lp) s = out_copy(&lo, s);
  if (s != DLUA_OK) {
    if (have_loss) out_abort(&lossb);
    if (have_lp) out_abort(&lo);
  }
  free(blocks);
  in_release(&x, 1);
  ce_release(&pl, &aux[0], &aux[1]);
  return s;
}

dlua_status_t dlua_nn_cross_entropy_backward(dlua_tensor_t **grad_logits, const dlua_tensor_t *grad_output,
                                             const dlua_tensor_t *log_probs, const dlua_tensor_t *labels,
                                             const dlua_tensor_t *weight, dlua_loss_reduction_t reduction,
                                             double label_smoothing, int64_t ignore_index, int64_t index_base) {
  const char *op = "cross_entropy_backward";
  DLUA_TRY(check_tensor(op, "log_probs", log_probs, 1));
  DLUA_TRY(check_tensor(op, "labels", labels, 0));
  DLUA_TRY(dlua_same_device(op, log_probs, labels));
  DLUA_TRY(check_reduction(op, reduction));
  ce_plan_t pl;
  DLUA_TRY(ce_shapes(op, log_probs, labels, "log_probs", &pl));
  if (grad_output) {
    DLUA_TRY(check_tensor(op, "grad_output", grad_output, 1));
    DLUA_TRY(dlua_same_device(op, log_probs, grad_output));
    if (reduction == DLUA_LOSS_NONE) {
      DLUA_TRY(check_same_shape(op, "grad_output", grad_output, "labels", labels));
    } else if (dlua_tensor_numel(grad_output) != 1) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s of a reduced loss must hold one value", op,
                      dlua_tensor_describe(grad_output, b, sizeof b));
    }
  }
  in_buf_t aux[2], in[2] = {{0}, {0}};  // labels, weight; log_probs, grad_output
  DLUA_TRY(ce_prepare(op, labels, weight, label_smoothing, ignore_index, index_base, &pl, &aux[0], &aux[1]));
  double tw = 0, g = 1;
  dlua_status_t s = ce_labels(op, &pl, &tw);
  dlua_dtype_t rt = log_probs->dtype;
  if (grad_output && reduction == DLUA_LOSS_NONE) rt = dlua_dtype_promote(rt, grad_output->dtype);
  dlua_dtype_t ct = compute_dtype(rt);
  const int dev = log_probs->device;
  if (s == DLUA_OK) s = in_stage(log_probs, ct, &in[0]);
  if (s == DLUA_OK && grad_output) {
    if (reduction == DLUA_LOSS_NONE) {
      s = in_stage(grad_output, ct, &in[1]);
    } else if (dev != DLUA_CPU) {  // the kernel reads the value: a private f64 copy, as only_value reads it
      s = dlua_tensor_to_dtype(&in[1].tmp, grad_output, DLUA_DTYPE_F64);
      if (s == DLUA_OK) in[1].p = dlua_tensor_ptr(in[1].tmp), in[1].n = 1;
    } else {
      g = only_value(grad_output);
    }
  }
  if (reduction == DLUA_LOSS_MEAN) g /= tw;
  out_buf_t o;
  if (s == DLUA_OK) {
    int per_target = grad_output && reduction == DLUA_LOSS_NONE;
    s = out_stage(op, grad_logits, log_probs->ndim, log_probs->sizes, rt, ct, in, per_target ? 2 : 1, dev, &o);
    if (s == DLUA_OK) {
      const void *gy = per_target ? in[1].p : NULL;
      if (dev != DLUA_CPU) {
        dlua_cuda_ce_t cp = ce_cuda_plan(&pl);
        s = CUDA_CALL(dlua_cuda_ce_bwd(op, (int)ct, &cp, in[0].p, gy, grad_output && !per_target ? in[1].p : NULL,
                                       reduction == DLUA_LOSS_MEAN ? tw : 1.0, o.p, dev));
      } else if (ct == DLUA_DTYPE_F64) {
        ce_bwd_d(&pl, in[0].p, gy, g, o.p);
      } else {
        ce_bwd_f(&pl, in[0].p, gy, g, o.p);
      }
      s = out_finish(&o, s);
    }
  }
  in_release(in, 2);
  ce_release(&pl, &aux[0], &aux[1]);
  return s;
}

/* ---- MSE ------------------------------------------------------------------------------------------- */

dlua_status_t dlua_nn_mse_loss(dlua_tensor_t **out, const dlua_tensor_t *input, const dlua_tensor_t *target,
                               dlua_loss_reduction_t reduction) {
  const char *op = "mse_loss";
  DLUA_TRY(check_tensor(op, "input", input, 1));
  DLUA_TRY(check_tensor(op, "target", target, 1));
  DLUA_TRY(dlua_same_device(op, input, target));
  DLUA_TRY(check_reduction(op, reduction));
  DLUA_TRY(check_same_shape(op, "input", input, "target", target));
  dlua_dtype_t rt = dlua_dtype_promote(input->dtype, target->dtype), ct = compute_dtype(rt);
  int64_t n = dlua_tensor_numel(input), nb = (n + MSE_BLOCK - 1) / MSE_BLOCK;
  in_buf_t in[2] = {{0}, {0}};
  dlua_status_t s = in_stage(input, ct, &in[0]);
  if (s == DLUA_OK) s = in_stage(target, ct, &in[1]);
  double *blocks = NULL;
  const int dev = input->device;
  if (s == DLUA_OK && reduction != DLUA_LOSS_NONE && dev == DLUA_CPU) {
    blocks = malloc((size_t)(nb ? nb : 1) * sizeof(double));
    if (!blocks) s = DLUA_ERR(DLUA_ERR_OOM, "mse_loss: out of memory allocating %zu bytes", (size_t)nb * sizeof(double));
  }
  out_buf_t o;
  if (s == DLUA_OK) {
    if (reduction == DLUA_LOSS_NONE)
      s = out_stage(op, out, input->ndim, input->sizes, rt, ct, in, 2, dev, &o);
    else
      s = out_stage(op, out, 0, NULL, rt, DLUA_DTYPE_F64, NULL, 0, dev, &o);
    if (s == DLUA_OK && dev != DLUA_CPU) {
      int reduced = reduction != DLUA_LOSS_NONE;
      s = CUDA_CALL(dlua_cuda_mse_fwd(op, (int)ct, in[0].p, in[1].p, reduced ? NULL : o.p, reduced ? o.p : NULL,
                                      reduction == DLUA_LOSS_MEAN ? (double)n : 1.0, n, dev));
      s = out_finish(&o, s);
    } else if (s == DLUA_OK) {
      void *none = reduction == DLUA_LOSS_NONE ? o.p : NULL;
      if (ct == DLUA_DTYPE_F64)
        mse_fwd_d(in[0].p, in[1].p, none, blocks, n);
      else
        mse_fwd_f(in[0].p, in[1].p, none, blocks, n);
      if (blocks) {
        double total = 0;
        for (int64_t b = 0; b < nb; b++) total += blocks[b];
        *(double *)o.p = reduction == DLUA_LOSS_MEAN ? total / (double)n : total;  // mean of nothing: NaN
      }
      s = out_finish(&o, DLUA_OK);
    }
  }
  free(blocks);
  in_release(in, 2);
  return s;
}

dlua_status_t dlua_nn_mse_loss_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                        const dlua_tensor_t *input, const dlua_tensor_t *target,
                                        dlua_loss_reduction_t reduction) {
  const char *op = "mse_loss_backward";
  DLUA_TRY(check_tensor(op, "input", input, 1));
  DLUA_TRY(check_tensor(op, "target", target, 1));
  DLUA_TRY(dlua_same_device(op, input, target));
  DLUA_TRY(check_reduction(op, reduction));
  DLUA_TRY(check_same_shape(op, "input", input, "target", target));
  dlua_dtype_t rt = dlua_dtype_promote(input->dtype, target->dtype);
  if (grad_output) {
    DLUA_TRY(check_tensor(op, "grad_output", grad_output, 1));
    DLUA_TRY(dlua_same_device(op, input, grad_output));
    if (reduction == DLUA_LOSS_NONE) {
      DLUA_TRY(check_same_shape(op, "grad_output", grad_output, "input", input));
      rt = dlua_dtype_promote(rt, grad_output->dtype);
    } else if (dlua_tensor_numel(grad_output) != 1) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s of a reduced loss must hold one value", op,
                      dlua_tensor_describe(grad_output, b, sizeof b));
    }
  }
  dlua_dtype_t ct = compute_dtype(rt);
  int64_t n = dlua_tensor_numel(input);
  in_buf_t in[3] = {{0}, {0}, {0}};
  int per_element = grad_output && reduction == DLUA_LOSS_NONE;
  double g = 1;
  dlua_status_t s = in_stage(input, ct, &in[0]);
  if (s == DLUA_OK) s = in_stage(target, ct, &in[1]);
  const int dev = input->device;
  if (s == DLUA_OK && grad_output) {
    if (per_element) {
      s = in_stage(grad_output, ct, &in[2]);
    } else if (dev != DLUA_CPU) {  // the kernel reads the value: a private f64 copy, as only_value reads it
      s = dlua_tensor_to_dtype(&in[2].tmp, grad_output, DLUA_DTYPE_F64);
      if (s == DLUA_OK) in[2].p = dlua_tensor_ptr(in[2].tmp), in[2].n = 1;
    } else {
      g = only_value(grad_output);
    }
  }
  double norm = reduction == DLUA_LOSS_MEAN ? 2.0 / (double)n : 2.0;
  out_buf_t o;
  if (s == DLUA_OK) {
    s = out_stage(op, grad_input, input->ndim, input->sizes, rt, ct, in, per_element ? 3 : 2, dev, &o);
    if (s == DLUA_OK && dev != DLUA_CPU) {
      s = CUDA_CALL(dlua_cuda_mse_bwd(op, (int)ct, in[0].p, in[1].p, per_element ? in[2].p : NULL,
                                      grad_output && !per_element ? in[2].p : NULL, norm, o.p, n, dev));
      s = out_finish(&o, s);
    } else if (s == DLUA_OK) {
      if (ct == DLUA_DTYPE_F64)
        mse_bwd_d(in[0].p, in[1].p, per_element ? in[2].p : NULL, g, norm, o.p, n);
      else
        mse_bwd_f(in[0].p, in[1].p, per_element ? in[2].p : NULL, (float)g, (float)norm, o.p, n);
      s = out_finish(&o, DLUA_OK);
    }
  }
  in_release(in, 3);
  return s;
}

/* ---- threshold / ReLU ----------------------------------------------------------------------------- */

dlua_status_t dlua_nn_threshold(dlua_tensor_t **out, const dlua_tensor_t *x, double threshold, double value) {
  const char *op = "threshold";
  DLUA_TRY(check_tensor(op, "x", x, 1));
  dlua_dtype_t ct = compute_dtype(x->dtype);
  in_buf_t in;
  DLUA_TRY(in_stage(x, ct, &in));
  out_buf_t o;
  dlua_status_t s = out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, &in, 1, x->device, &o);
  if (s == DLUA_OK) {
    if (x->device != DLUA_CPU)
      s = CUDA_CALL(dlua_cuda_threshold(op, (int)ct, in.p, o.p, in.n, threshold, value, x->device));
    else if (ct == DLUA_DTYPE_F64)
      threshold_d(in.p, o.p, in.n, threshold, value);
    else
      threshold_f(in.p, o.p, in.n, (float)threshold, (float)value);
    s = out_finish(&o, s);
  }
  in_release(&in, 1);
  return s;
}

static dlua_status_t threshold_backward(const char *op, dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                        const dlua_tensor_t *x, const char *xname, double threshold) {
  DLUA_TRY(check_tensor(op, "grad_output", grad_output, 1));
  DLUA_TRY(check_tensor(op, xname, x, 1));
  DLUA_TRY(dlua_same_device(op, grad_output, x));
  DLUA_TRY(check_same_shape(op, "grad_output", grad_output, xname, x));
  dlua_dtype_t rt = grad_output->dtype, ct = compute_dtype(dlua_dtype_promote(rt, x->dtype));
  in_buf_t in[2] = {{0}, {0}};
  dlua_status_t s = in_stage(grad_output, ct, &in[0]);
  if (s == DLUA_OK) s = in_stage(x, ct, &in[1]);
  out_buf_t o;
  if (s == DLUA_OK) {
    s = out_stage(op, grad_input, x->ndim, x->sizes, rt, ct, in, 2, x->device, &o);
    if (s == DLUA_OK) {
      if (x->device != DLUA_CPU)
        s = CUDA_CALL(dlua_cuda_threshold_bwd(op, (int)ct, in[0].p, in[1].p, o.p, in[0].n, threshold, x->device));
      else if (ct == DLUA_DTYPE_F64)
        threshold_bwd_d(in[0].p, in[1].p, o.p, in[0].n, threshold);
      else
        threshold_bwd_f(in[0].p, in[1].p, o.p, in[0].n, (float)threshold);
      s = out_finish(&o, s);
    }
  }
  in_release(in, 2);
  return s;
}

dlua_status_t dlua_nn_threshold_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                         const dlua_tensor_t *x, double threshold) {
  return threshold_backward("threshold_backward", grad_input, grad_output, x, "x", threshold);
}

dlua_status_t dlua_nn_relu_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                    const dlua_tensor_t *output) {
  return threshold_backward("relu_backward", grad_input, grad_output, output, "output", 0.0);
}

/* ---- dropout ------------------------------------------------------------------------------------- */

/* y = x * (mask != 0) * scale, the mask read as bytes (converted to bool when it is neither
   bool nor uint8, or not contiguous). */
static dlua_status_t apply_mask(const char *op, dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *mask,
                                double scale) {
  dlua_dtype_t ct = compute_dtype(x->dtype);
  in_buf_t in[2] = {{0}, {0}};
  dlua_status_t s = in_stage(x, ct, &in[0]);
  // The mask's bytes are read in place unless they need converting or could be overwritten
  // by the output (same storage): then through a bool copy, which to_dtype always makes.
  int direct = (mask->dtype == DLUA_DTYPE_BOOL || mask->dtype == DLUA_DTYPE_U8) && dlua_tensor_is_contiguous(mask) &&
               !(out && *out && (*out)->storage == mask->storage);
  if (s == DLUA_OK && direct) {
    in[1].p = dlua_tensor_ptr(mask);
  } else if (s == DLUA_OK) {
    s = dlua_tensor_to_dtype(&in[1].tmp, mask, DLUA_DTYPE_BOOL);
    if (s == DLUA_OK) in[1].p = dlua_tensor_ptr(in[1].tmp);
  }
  out_buf_t o;
  if (s == DLUA_OK) {
    s = out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, in, 1, x->device, &o);
    if (s == DLUA_OK) {
      if (x->device != DLUA_CPU)
        s = CUDA_CALL(dlua_cuda_mask_scale(op, (int)ct, in[0].p, in[1].p, o.p, in[0].n, scale, x->device));
      else if (ct == DLUA_DTYPE_F64)
        mask_scale_d(in[0].p, in[1].p, o.p, in[0].n, scale);
      else
        mask_scale_f(in[0].p, in[1].p, o.p, in[0].n, (float)scale);
      s = out_finish(&o, s);
    }
  }
  in_release(in, 2);
  return s;
}

dlua_status_t dlua_nn_dropout(dlua_tensor_t **out, dlua_tensor_t **mask, const dlua_tensor_t *x, double p, int train,
                              dlua_generator_t *g) {
  const char *op = "dropout";
  DLUA_TRY(check_tensor(op, "x", x, 1));
  if (!(p >= 0 && p <= 1)) return DLUA_ERR(DLUA_ERR_ARG, "dropout: p must be in [0, 1], got %g", p);
  if (!train) {
    int allocated = 0;
    DLUA_TRY(dlua_prepare_out_on(op, out, x->ndim, x->sizes, x->dtype, x->device, &allocated));
    if (*out == x) return DLUA_OK;
    dlua_status_t s = dlua_tensor_copy_(*out, x);
    if (s != DLUA_OK && allocated) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
    return s;
  }
  if (!mask) return DLUA_ERR(DLUA_ERR_ARG, "dropout: training needs a mask for backward (mask is NULL)");
  int mask_allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, mask, x->ndim, x->sizes, DLUA_DTYPE_BOOL, x->device, &mask_allocated));
  dlua_status_t s;
  if (p == 0 || p == 1)  // as torch: no draw, so the generator's offset does not move
    s = dlua_tensor_fill_(*mask, p == 0 ? 1.0 : 0.0);
  else
    s = dlua_tensor_bernoulli_(*mask, 1.0 - p, g);
  if (s == DLUA_OK) s = apply_mask(op, out, x, *mask, p < 1 ? 1.0 / (1.0 - p) : 0.0);
  if (s != DLUA_OK && mask_allocated) {
    dlua_tensor_free(*mask);
    *mask = NULL;
  }
  return s;
}

dlua_status_t dlua_nn_dropout_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                       const dlua_tensor_t *mask, double p) {
  const char *op = "dropout_backward";
  DLUA_TRY(check_tensor(op, "grad_output", grad_output, 1));
  DLUA_TRY(check_tensor(op, "mask", mask, 0));
  DLUA_TRY(dlua_same_device(op, grad_output, mask));
  DLUA_TRY(check_same_shape(op, "grad_output", grad_output, "mask", mask));
  if (!(p >= 0 && p <= 1)) return DLUA_ERR(DLUA_ERR_ARG, "dropout_backward: p must be in [0, 1], got %g", p);
  return apply_mask(op, grad_input, grad_output, mask, p < 1 ? 1.0 / (1.0 - p) : 0.0);
}

/* Fused optimizer steps over ranges of the flat parameter/gradient/state arenas: SGD, Adam, AdamW, LARS, LAMB; AMP unscaling; clip_grad_norm_'s partial norms and scaling. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/copy.h"
#include "kernels/elementwise_ops.h"
#include "cpu/optim_lowp.h"
#include "kernels/optim_ops.h"
#include "cuda/kernels.h" /* plain C: only CUDA builds call into it */
#include "cuda/loss_cuda.h"

/* Element-wise steps run in chunks of OPT_CHUNK elements (one thread each; a range smaller
   than that stays on the calling thread). LARS norms are summed per LARS_BLOCK elements and
   the blocks of a parameter added in order, so the trust ratios do not depend on threads. */
enum { OPT_CHUNK = 16384, LARS_BLOCK = 8192 };

/* ---- argument checks ------------------------------------------------------------------------------ */

/* Every step has a CUDA kernel (host/cuda/optim.cu); a build without CUDA has no CUDA tensors to step. */
static dlua_status_t check_param(const char *op, const dlua_tensor_t *p) {
  char b[200];
  if (!p || !p->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: param is NULL (freed, or never created)", op);
#ifndef DLUA_HAVE_CUDA
  DLUA_TRY(dlua_require_cpu(op, p));
#endif
  if (p->dtype != DLUA_DTYPE_F32 && p->dtype != DLUA_DTYPE_F64)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: param must be float32 or float64, got %s", op, dlua_tensor_describe(p, b, sizeof b));
  if (!dlua_tensor_is_contiguous(p))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: param %s must be contiguous (a flat arena, or a narrowed view of one)", op,
                    dlua_tensor_describe(p, b, sizeof b));
  return DLUA_OK;
}

/* grad and state buffers: contiguous, param's dtype and element count, and no memory shared
   with param (one loop reads and writes them all; overlap would be a layout bug). */
static dlua_status_t check_buffer(const char *op, const char *what, const dlua_tensor_t *t, const dlua_tensor_t *p) {
  char b1[200], b2[200];
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  if (t->device != p->device)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got param %s and %s %s", op,
                    dlua_tensor_describe(p, b2, sizeof b2), what, dlua_tensor_describe(t, b1, sizeof b1));
  if (t->dtype != p->dtype || dlua_tensor_numel(t) != dlua_tensor_numel(p))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s must have param's dtype and element count (param %s)", op, what,
                    dlua_tensor_describe(t, b1, sizeof b1), dlua_tensor_describe(p, b2, sizeof b2));
  if (!dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s must be contiguous (a flat arena, or a narrowed view of one)", op, what,
                    dlua_tensor_describe(t, b1, sizeof b1));
  size_t bytes = (size_t)dlua_tensor_numel(p) * dlua_dtype_size(p->dtype);
  uintptr_t a = (uintptr_t)dlua_tensor_ptr(p), c = (uintptr_t)dlua_tensor_ptr(t);
  if (bytes && t->storage == p->storage && a < c + bytes && c < a + bytes)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s and param share memory", op, what);
  return DLUA_OK;
}

/* Two state buffers must not share memory either. */
static dlua_status_t check_apart(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                 const dlua_tensor_t *b) {
  size_t bytes = (size_t)dlua_tensor_numel(a) * dlua_dtype_size(a->dtype);
  uintptr_t x = (uintptr_t)dlua_tensor_ptr(a), y = (uintptr_t)dlua_tensor_ptr(b);
  if (bytes && a->storage == b->storage && x < y + bytes && y < x + bytes)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s and %s share memory", op, wa, wb);
  return DLUA_OK;
}

static dlua_status_t check_range(const char *op, const dlua_tensor_t *p, int64_t offset, int64_t length) {
  int64_t n = dlua_tensor_numel(p);
  if (offset < 0 || length < 0 || offset > n || length > n - offset)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: range offset %" PRId64 ", length %" PRId64 " is outside the arena of %" PRId64 " elements",
                    op, offset, length, n);
  return DLUA_OK;
}

/* A hyper-parameter in [lo, hi] (hi_open: [lo, hi)), and finite. */
static dlua_status_t check_hyper(const char *op, const char *name, double v, double lo, double hi, int hi_open) {
  if (!isfinite(v) || v < lo || v > hi || (hi_open && v == hi))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a finite number in [%g, %g%s, got %g", op, name, lo, hi,
                    hi_open ? ")" : "]", v);
  return DLUA_OK;
}

static dlua_status_t check_grad_scale(const char *op, double s) {
  if (!isfinite(s)) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_scale must be finite, got %g", op, s);
  return DLUA_OK;
}

/* ---- kernels ------------------------------------------------------------------------------------------ */

typedef dlua_opt_args_t step_args_t; /* host/kernels/optim_ops.h */

typedef void (*chunk_fn)(const step_args_t *a, int64_t lo, int64_t hi);

/* Each scalar is rounded to T once, as PyTorch passes Python floats to its T kernels, and each
   line mirrors one torch op of _single_tensor_sgd / _single_tensor_adam(w) (torch 1.13). */
#define OPT_KERNELS(T, S, SQRT)                                                                                 \
  static DLUA_CPU_CLONES void sgd_##S(const step_args_t *a, int64_t lo, int64_t hi) {                           \
    T *p = a->p, *buf = a->s1;                                                                                  \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, wd = (T)a->weight_decay, mom = (T)a->momentum;                               \
    const T damp1 = (T)(1.0 - a->dampening), lr = (T)a->lr;                                                     \
    const int nesterov = a->nesterov, maximize = a->maximize, first = a->first;                                 \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_sgd_##S(p + i, g[i], buf ? buf + i : NULL, gs, wd, mom, damp1, lr, nesterov, maximize, first);   \
  }                                                                                                             \
                                                                                                                \
  /* Adam and AdamW: AdamW decays the weight (decay = 1 - lr wd), Adam adds wd * p to the gradient. */        \
  static DLUA_CPU_CLONES void adam_##S(const step_args_t *a, int64_t lo, int64_t hi) {                          \
    T *p = a->p, *m = a->s1, *v = a->s2, *vmax = a->s3;                                                         \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, decay = (T)(a->decoupled ? 1.0 - a->lr * a->weight_decay : 1.0);             \
    const T l2 = (T)(a->decoupled ? 0.0 : a->weight_decay);                                                     \
    const T b1 = (T)a->beta1, omb1 = (T)(1.0 - a->beta1), b2 = (T)a->beta2, omb2 = (T)(1.0 - a->beta2);         \
    const T neg_step = (T)(-(a->lr / a->bc1)), bc2_sqrt = (T)sqrt(a->bc2), eps = (T)a->eps;                     \
    const int maximize = a->maximize, amsgrad = a->amsgrad;                                                     \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_adam_##S(p + i, g[i], m + i, v + i, vmax ? vmax + i : NULL, gs, decay, l2, b1, omb1, b2, omb2,   \
                        neg_step, bc2_sqrt, eps, maximize, amsgrad);                                            \
  }                                                                                                             \
                                                                                                                \
  /* host/kernels/optim_ops.h's LARC step with this parameter's trust ratio. */                                    \
  static DLUA_CPU_CLONES void lars_##S(const step_args_t *a, int64_t lo, int64_t hi) {                          \
    T *p = a->p, *buf = a->s1;                                                                                  \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, wd = (T)a->weight_decay, trust = (T)a->trust, mom = (T)a->momentum;          \
    const T lr = (T)a->lr;                                                                                      \
    const int first = a->first;                                                                                 \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_lars_##S(p + i, g[i], buf ? buf + i : NULL, gs, wd, trust, mom, lr, first);                      \
  }                                                                                                             \
                                                                                                                \
  /* Sums of p^2 and (g * grad_scale)^2 over [lo, hi), in double. */                                         \
  static void sq_norms_##S(const step_args_t *a, int64_t lo, int64_t hi, double *pp, double *gg) {            \
    const T *p = a->p, *g = a->g;                                                                               \
    const T gs = (T)a->grad_scale;                                                                              \
    double sp = 0, sg = 0;                                                                                      \
    for (int64_t i = lo; i < hi; i++) {                                                                         \
      double x = p[i], y = g[i] * gs;                                                                           \
      sp += x * x;                                                                                              \
      sg += y * y;                                                                                              \
    }                                                                                                           \
    *pp = sp;                                                                                                   \
    *gg = sg;                                                                                                   \
  }                                                                                                             \
                                                                                                                \
  /* LAMB pass 1: the moments, and the sums of p^2 and u^2 (u: the update direction) over [lo, hi). */         \
  static DLUA_CPU_CLONES void lamb_norms_##S(const step_args_t *a, int64_t lo, int64_t hi, double *pp,          \
                                             double *uu) {                                                      \
    const T *p = a->p, *g = a->g;                                                                               \
    T *m = a->s1, *v = a->s2;                                                                                   \
    const T gs = (T)a->grad_scale, b1 = (T)a->beta1, omb1 = (T)(1.0 - a->beta1), b2 = (T)a->beta2;             \
    const T omb2 = (T)(1.0 - a->beta2), bc1 = (T)a->bc1, bc2 = (T)a->bc2, eps = (T)a->eps;                     \
    const T wd = (T)a->weight_decay;                                                                            \
    double sp = 0, su = 0;                                                                                      \
    for (int64_t i = lo; i < hi; i++) {                                                                         \
      const double x = p[i];                                                                                    \
      const double u = dlua_opt_lamb_moments_##S(p[i], g[i], m + i, v + i, gs, b1, omb1, b2, omb2, bc1, bc2,    \
                                                 eps, wd);                                                      \
      sp += x * x;                                                                                              \
      su += u * u;                                                                                              \
    }                                                                                                           \
    *pp = sp;                                                                                                   \
    *uu = su;                                                                                                   \
  }                                                                                                             \
                                                                                                                \
  /* LAMB pass 2: p -= lr * trust * u, u recomputed from the moments pass 1 stored. */                         \
  static DLUA_CPU_CLONES void lamb_apply_##S(const step_args_t *a, int64_t lo, int64_t hi) {                    \
    T *p = a->p;                                                                                                \
    const T *m = a->s1, *v = a->s2;                                                                             \
    const T neg = (T)(-(a->lr * a->trust)), bc1 = (T)a->bc1, bc2 = (T)a->bc2, eps = (T)a->eps;                  \
    const T wd = (T)a->weight_decay;                                                                            \
    for (int64_t i = lo; i < hi; i++) dlua_opt_lamb_apply_##S(p + i, m[i], v[i], neg, bc1, bc2, eps, wd);       \
  }

OPT_KERNELS(float, f, sqrtf)
OPT_KERNELS(double, d, sqrt)

/* Runs fn over [0, length) of the (pre-offset) arguments in OPT_CHUNK pieces. */
static void run_chunks(chunk_fn fn, const step_args_t *a, int64_t length) {
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK;
#pragma omp parallel for schedule(static) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    fn(a, lo, hi);
  }
}

/* The same step on CUDA: one grid-stride kernel over the range (host/cuda/optim.cu). kind 0 SGD, 1 Adam/AdamW. */
static dlua_status_t cuda_step(const char *op, int kind, const dlua_tensor_t *param, const step_args_t *a,
                               int64_t length) {
#ifdef DLUA_HAVE_CUDA
  return dlua_cuda_optim_step(op, kind, (int)param->dtype, a, length, param->device);
#else
  (void)kind, (void)a, (void)length;
  return dlua_require_cpu(op, param);
#endif
}

/* Mixed precision's master weights: the 16-bit copy of the parameters a layer computes with, written
   chunk by chunk right after the chunk's update, while it is in cache (no pass of its own). lowp:
   NULL, or a contiguous float16/bfloat16 tensor of param's element count on the CPU. */
static dlua_status_t check_lowp(const char *op, const dlua_tensor_t *lowp, const dlua_tensor_t *p) {
  char b1[200], b2[200];
  if (!lowp) return DLUA_OK;
  if (!lowp->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: lowp copy is freed", op);
  if (lowp->device != DLUA_CPU || p->device != DLUA_CPU)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: a 16-bit copy is written on the CPU only, got param %s and copy %s", op,
                    dlua_tensor_describe(p, b2, sizeof b2), dlua_tensor_describe(lowp, b1, sizeof b1));
  if ((lowp->dtype != DLUA_DTYPE_BF16 && lowp->dtype != DLUA_DTYPE_F16) || p->dtype != DLUA_DTYPE_F32 ||
      dlua_tensor_numel(lowp) != dlua_tensor_numel(p) || !dlua_tensor_is_contiguous(lowp))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the 16-bit copy %s must be a contiguous bfloat16 or float16 tensor of param's "
                    "element count, param float32 (param %s)", op, dlua_tensor_describe(lowp, b1, sizeof b1),
                    dlua_tensor_describe(p, b2, sizeof b2));
  return DLUA_OK;
}

/* run_chunks, then each chunk's parameters converted into lp (pre-offset, dtype lpdt) while in cache. */
static void run_chunks_lowp(chunk_fn fn, const step_args_t *a, int64_t length, char *lp, dlua_dtype_t lpdt) {
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK;
#pragma omp parallel for schedule(static) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    fn(a, lo, hi);
    dlua_convert(lp + lo * 2, lpdt, (const float *)a->p + lo, DLUA_DTYPE_F32, hi - lo);
  }
}

static void *at(const dlua_tensor_t *t, int64_t offset) {
  return t ? dlua_tensor_ptr(t) + offset * (int64_t)dlua_dtype_size(t->dtype) : NULL;
}

/* ---- SGD ------------------------------------------------------------------------------------------------ */

static dlua_status_t sgd_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf,
                              int64_t offset, int64_t length, double lr, double momentum, double dampening,
                              double weight_decay, int nesterov, int maximize, int first_step, double grad_scale,
                              dlua_tensor_t *lowp) {
  const char *op = "sgd_step";
  DLUA_TRY(check_param(op, param));
  DLUA_TRY(check_lowp(op, lowp, param));
  DLUA_TRY(check_buffer(op, "grad", grad, param));
  DLUA_TRY(check_range(op, param, offset, length));
  DLUA_TRY(check_hyper(op, "lr", lr, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "momentum", momentum, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "dampening", dampening, -INFINITY, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "weight_decay", weight_decay, 0, INFINITY, 0));
  DLUA_TRY(check_grad_scale(op, grad_scale));
  if (nesterov && (momentum <= 0 || dampening != 0))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: Nesterov momentum needs momentum > 0 and dampening 0, got momentum %g, dampening %g",
                    op, momentum, dampening);
  if (momentum != 0) {
    if (!momentum_buf) return DLUA_ERR(DLUA_ERR_ARG, "%s: momentum %g needs a momentum buffer (it is NULL)", op, momentum);
    DLUA_TRY(check_buffer(op, "momentum_buf", momentum_buf, param));
    DLUA_TRY(check_apart(op, "momentum_buf", momentum_buf, "grad", grad));
  }
  step_args_t a = {.p = at(param, offset), .g = at(grad, offset), .s1 = momentum != 0 ? at(momentum_buf, offset) : NULL,
                   .lr = lr, .momentum = momentum, .dampening = dampening, .weight_decay = weight_decay,
                   .grad_scale = grad_scale, .nesterov = nesterov != 0, .maximize = maximize != 0,
                   .first = first_step != 0};
  if (param->device != DLUA_CPU) return cuda_step(op, 0, param, &a, length);
  if (lowp)
    run_chunks_lowp(sgd_f, &a, length, at(lowp, offset), lowp->dtype);
  else
    run_chunks(param->dtype == DLUA_DTYPE_F64 ? sgd_d : sgd_f, &a, length);
  return DLUA_OK;
}

dlua_status_t dlua_optim_sgd_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf,
                                  int64_t offset, int64_t length, double lr, double momentum, double dampening,
                                  double weight_decay, int nesterov, int maximize, int first_step,
                                  double grad_scale) {
  return sgd_step(param, grad, momentum_buf, offset, length, lr, momentum, dampening, weight_decay, nesterov, maximize,
                  first_step, grad_scale, NULL);
}

dlua_status_t dlua_optim_sgd_step_lowp(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf,
                                       int64_t offset, int64_t length, double lr, double momentum, double dampening,
                                       double weight_decay, int nesterov, int maximize, int first_step,
                                       double grad_scale, dlua_tensor_t *lowp) {
  return sgd_step(param, grad, momentum_buf, offset, length, lr, momentum, dampening, weight_decay, nesterov, maximize,
                  first_step, grad_scale, lowp);
}

/* ---- Adam, AdamW ----------------------------------------------------------------------------------- */

/* One implementation: decoupled 1 is AdamW (param *= 1 - lr wd), 0 is Adam (grad += wd param). */
static dlua_status_t adam_step(const char *op, int decoupled, dlua_tensor_t *param, const dlua_tensor_t *grad,
                               dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq,
                               int64_t offset, int64_t length, double lr, double beta1, double beta2, double eps,
                               double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale,
                               dlua_tensor_t *lowp) {
  DLUA_TRY(check_param(op, param));
  DLUA_TRY(check_lowp(op, lowp, param));
  DLUA_TRY(check_buffer(op, "grad", grad, param));
  DLUA_TRY(check_buffer(op, "exp_avg", exp_avg, param));
  DLUA_TRY(check_buffer(op, "exp_avg_sq", exp_avg_sq, param));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg_sq", exp_avg_sq, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "exp_avg_sq", exp_avg_sq));
  if (amsgrad) {
    if (!max_exp_avg_sq) return DLUA_ERR(DLUA_ERR_ARG, "%s: amsgrad needs max_exp_avg_sq (it is NULL)", op);
    DLUA_TRY(check_buffer(op, "max_exp_avg_sq", max_exp_avg_sq, param));
    DLUA_TRY(check_apart(op, "max_exp_avg_sq", max_exp_avg_sq, "grad", grad));
    DLUA_TRY(check_apart(op, "max_exp_avg_sq", max_exp_avg_sq, "exp_avg", exp_avg));
    DLUA_TRY(check_apart(op, "max_exp_avg_sq", max_exp_avg_sq, "exp_avg_sq", exp_avg_sq));
  }
  DLUA_TRY(check_range(op, param, offset, length));
  DLUA_TRY(check_hyper(op, "lr", lr, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "beta1", beta1, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "beta2", beta2, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "eps", eps, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "weight_decay", weight_decay, 0, INFINITY, 0));
  DLUA_TRY(check_grad_scale(op, grad_scale));
  if (step < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: step counts this step from 1, got %" PRId64, op, step);
  step_args_t a = {.p = at(param, offset), .g = at(grad, offset), .s1 = at(exp_avg, offset),
                   .s2 = at(exp_avg_sq, offset), .s3 = amsgrad ? at(max_exp_avg_sq, offset) : NULL, .lr = lr,
                   .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                   .grad_scale = grad_scale, .amsgrad = amsgrad != 0, .maximize = maximize != 0,
                   .decoupled = decoupled, .bc1 = 1.0 - pow(beta1, (double)step),
                   .bc2 = 1.0 - pow(beta2, (double)step)};
  if (param->device != DLUA_CPU) return cuda_step(op, 1, param, &a, length);
  if (lowp)
    run_chunks_lowp(adam_f, &a, length, at(lowp, offset), lowp->dtype);
  else
    run_chunks(param->dtype == DLUA_DTYPE_F64 ? adam_d : adam_f, &a, length);
  return DLUA_OK;
}

dlua_status_t dlua_optim_adamw_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg,
                                    dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset,
                                    int64_t length, double lr, double beta1, double beta2, double eps,
                                    double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale) {
  return adam_step("adamw_step", 1, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, offset, length, lr, beta1,
                   beta2, eps, weight_decay, step, amsgrad, maximize, grad_scale, NULL);
}

dlua_status_t dlua_optim_adam_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg,
                                   dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset,
                                   int64_t length, double lr, double beta1, double beta2, double eps,
                                   double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale) {
  return adam_step("adam_step", 0, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, offset, length, lr, beta1,
                   beta2, eps, weight_decay, step, amsgrad, maximize, grad_scale, NULL);
}

/* Adam and AdamW writing the 16-bit copy in the same pass (decoupled 1: AdamW). */
dlua_status_t dlua_optim_adam_step_lowp(int decoupled, dlua_tensor_t *param, const dlua_tensor_t *grad,
                                        dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq,
                                        dlua_tensor_t *max_exp_avg_sq, int64_t offset, int64_t length, double lr,
                                        double beta1, double beta2, double eps, double weight_decay, int64_t step,
                                        int amsgrad, int maximize, double grad_scale, dlua_tensor_t *lowp) {
  return adam_step(decoupled ? "adamw_step" : "adam_step", decoupled != 0, param, grad, exp_avg, exp_avg_sq,
                   max_exp_avg_sq, offset, length, lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize,
                   grad_scale, lowp);
}

/* ---- per-parameter blocks (LARS, LAMB) ------------------------------------------------------------------ */

typedef struct {
  int64_t lo, hi; /* element range in the arena */
  int r;          /* parameter */
} param_block_t;

/* A step's parameters cut into blocks of LARS_BLOCK elements, parameter by parameter, with room for
   two partial sums per block and a trust ratio per parameter. One allocation (mem). */
typedef struct {
  char *mem;
  int64_t nb;
  param_block_t *blocks;
  double *part;  /* (nb, 2) */
  double *trust; /* (n_ranges) */
} param_blocks_t;

static int cmp_range(const void *x, const void *y) {
  const int64_t *a = x, *b = y;
  return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* Checks the ranges (inside the arena, pairwise disjoint: one loop writes them all) and plans the blocks. */
static dlua_status_t plan_blocks(const char *op, const dlua_tensor_t *param, int n_ranges, const int64_t *offsets,
                                 const int64_t *lengths, param_blocks_t *pb) {
  memset(pb, 0, sizeof *pb);
  if (n_ranges < 0 || (n_ranges > 0 && (!offsets || !lengths)))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected n_ranges >= 0 with offsets and lengths, got %d ranges%s", op, n_ranges,
                    n_ranges > 0 ? " and a NULL array" : "");
  int64_t nb = 0;
  for (int r = 0; r < n_ranges; r++) {
    dlua_status_t s = check_range(op, param, offsets[r], lengths[r]);
    if (s != DLUA_OK)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: parameter %d: range offset %" PRId64 ", length %" PRId64
                      " is outside the arena of %" PRId64 " elements", op, r, offsets[r], lengths[r],
                      dlua_tensor_numel(param));
    nb += (lengths[r] + LARS_BLOCK - 1) / LARS_BLOCK;
  }
  size_t bytes = (size_t)n_ranges * (2 * sizeof(int64_t) + sizeof(double)) +
                 (size_t)nb * (sizeof(param_block_t) + 2 * sizeof(double)) + 1;
  char *mem = malloc(bytes);
  if (!mem) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, bytes);
  int64_t *sorted = (int64_t *)mem;
  pb->mem = mem;
  pb->nb = nb;
  pb->trust = (double *)(sorted + 2 * n_ranges);
  pb->part = pb->trust + n_ranges;
  pb->blocks = (param_block_t *)(pb->part + 2 * nb);

  int m = 0;  // empty ranges cannot overlap anything, and would hide a neighbour's overlap
  for (int r = 0; r < n_ranges; r++)
    if (lengths[r] > 0) sorted[2 * m] = offsets[r], sorted[2 * m + 1] = lengths[r], m++;
  qsort(sorted, (size_t)m, 2 * sizeof(int64_t), cmp_range);
  for (int r = 1; r < m; r++)
    if (sorted[2 * r - 2] + sorted[2 * r - 1] > sorted[2 * r]) {
      dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG,
                                 "%s: parameter ranges overlap: [%" PRId64 ", %" PRId64 ") and [%" PRId64 ", %" PRId64 ")",
                                 op, sorted[2 * r - 2], sorted[2 * r - 2] + sorted[2 * r - 1], sorted[2 * r],
                                 sorted[2 * r] + sorted[2 * r + 1]);
      free(mem);
      pb->mem = NULL;
      return s;
    }
  int64_t k = 0;
  for (int r = 0; r < n_ranges; r++)
    for (int64_t lo = offsets[r]; lo < offsets[r] + lengths[r]; lo += LARS_BLOCK) {
      int64_t end = offsets[r] + lengths[r];
      pb->blocks[k++] = (param_block_t){lo, lo + LARS_BLOCK < end ? lo + LARS_BLOCK : end, r};
    }
  return DLUA_OK;
}

/* Blocks are laid out parameter by parameter, so one in-order walk folds each parameter's two sums:
   the same bits whatever the number of threads. */
static void fold_blocks(const param_blocks_t *pb, int r, int64_t *b, double *s1, double *s2) {
  double x = 0, y = 0;
  for (; *b < pb->nb && pb->blocks[*b].r == r; (*b)++) x += pb->part[2 * *b], y += pb->part[2 * *b + 1];
  *s1 = x;
  *s2 = y;
}

/* ---- LARS ------------------------------------------------------------------------------------------------ */

dlua_status_t dlua_optim_lars_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf,
                                   int n_ranges, const int64_t *offsets, const int64_t *lengths,
                                   const int32_t *exclude, double lr, double momentum, double weight_decay,
                                   double trust_coefficient, double eps, int first_step, double grad_scale) {
  const char *op = "lars_step";
  DLUA_TRY(check_param(op, param));
  DLUA_TRY(check_buffer(op, "grad", grad, param));
  DLUA_TRY(check_hyper(op, "lr", lr, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "momentum", momentum, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "weight_decay", weight_decay, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "trust_coefficient", trust_coefficient, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "eps", eps, 0, INFINITY, 0));
  DLUA_TRY(check_grad_scale(op, grad_scale));
  if (momentum != 0) {
    if (!momentum_buf) return DLUA_ERR(DLUA_ERR_ARG, "%s: momentum %g needs a momentum buffer (it is NULL)", op, momentum);
    DLUA_TRY(check_buffer(op, "momentum_buf", momentum_buf, param));
    DLUA_TRY(check_apart(op, "momentum_buf", momentum_buf, "grad", grad));
  }
  param_blocks_t pb;
  DLUA_TRY(plan_blocks(op, param, n_ranges, offsets, lengths, &pb));
  step_args_t base = {.p = dlua_tensor_ptr(param), .g = dlua_tensor_ptr(grad),
                      .s1 = momentum != 0 ? dlua_tensor_ptr(momentum_buf) : NULL, .lr = lr, .momentum = momentum,
                      .weight_decay = weight_decay, .grad_scale = grad_scale, .first = first_step != 0};
  if (n_ranges == 0 || param->device != DLUA_CPU) {  // the same step on CUDA (host/cuda/optim.cu), after the same checks
    free(pb.mem);
    if (n_ranges == 0) return DLUA_OK;
#ifdef DLUA_HAVE_CUDA
    return dlua_cuda_lars_step(op, (int)param->dtype, &base, n_ranges, offsets, lengths, exclude, trust_coefficient,
                               eps, param->device);
#else
    return dlua_require_cpu(op, param);
#endif
  }

  const int64_t nb = pb.nb;
  int f64 = param->dtype == DLUA_DTYPE_F64;
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    pb.part[2 * b] = pb.part[2 * b + 1] = 0;
    if (exclude && exclude[k->r]) continue;
    if (f64)
      sq_norms_d(&base, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
    else
      sq_norms_f(&base, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
  }
  for (int64_t r = 0, b = 0; r < n_ranges; r++) {
    double sp, sg;
    fold_blocks(&pb, (int)r, &b, &sp, &sg);
    double pn = sqrt(sp), gn = sqrt(sg);
    // -1 marks plain momentum SGD: excluded, or a zero norm (LARC then leaves the gradient
    // alone, decay included). A real ratio is never negative.
    int excluded = exclude && exclude[r];
    pb.trust[r] = !excluded && pn > 0 && gn > 0 ? trust_coefficient * pn / (gn + weight_decay * pn + eps) : -1.0;
  }
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    int r = pb.blocks[b].r;
    step_args_t a = base;
    a.trust = pb.trust[r] < 0 ? 1.0 : pb.trust[r];
    if (pb.trust[r] < 0) a.weight_decay = 0;
    if (f64)
      lars_d(&a, pb.blocks[b].lo, pb.blocks[b].hi);
    else
      lars_f(&a, pb.blocks[b].lo, pb.blocks[b].hi);
  }
  free(pb.mem);
  return DLUA_OK;
}

/* ---- LAMB ------------------------------------------------------------------------------------------------ */

dlua_status_t dlua_optim_lamb_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg,
                                   dlua_tensor_t *exp_avg_sq, int n_ranges, const int64_t *offsets,
                                   const int64_t *lengths, const int32_t *exclude, double lr, double beta1,
                                   double beta2, double eps, double weight_decay, int64_t step, int bias_correction,
                                   double grad_scale) {
  const char *op = "lamb_step";
  DLUA_TRY(check_param(op, param));
  DLUA_TRY(check_buffer(op, "grad", grad, param));
  DLUA_TRY(check_buffer(op, "exp_avg", exp_avg, param));
  DLUA_TRY(check_buffer(op, "exp_avg_sq", exp_avg_sq, param));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg_sq", exp_avg_sq, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "exp_avg_sq", exp_avg_sq));
  DLUA_TRY(check_hyper(op, "lr", lr, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "beta1", beta1, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "beta2", beta2, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "eps", eps, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "weight_decay", weight_decay, 0, INFINITY, 0));
  DLUA_TRY(check_grad_scale(op, grad_scale));
  if (step < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: step counts this step from 1, got %" PRId64, op, step);
  param_blocks_t pb;
  DLUA_TRY(plan_blocks(op, param, n_ranges, offsets, lengths, &pb));
  step_args_t base = {.p = dlua_tensor_ptr(param), .g = dlua_tensor_ptr(grad), .s1 = dlua_tensor_ptr(exp_avg),
                      .s2 = dlua_tensor_ptr(exp_avg_sq), .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                      .weight_decay = weight_decay, .grad_scale = grad_scale,
                      .bc1 = bias_correction ? 1.0 - pow(beta1, (double)step) : 1.0,
                      .bc2 = bias_correction ? 1.0 - pow(beta2, (double)step) : 1.0};
  if (n_ranges == 0 || param->device != DLUA_CPU) {
    free(pb.mem);
    if (n_ranges == 0) return DLUA_OK;
#ifdef DLUA_HAVE_CUDA
    return dlua_cuda_lamb_step(op, (int)param->dtype, &base, n_ranges, offsets, lengths, exclude, param->device);
#else
    return dlua_require_cpu(op, param);
#endif
  }

  const int64_t nb = pb.nb;
  int f64 = param->dtype == DLUA_DTYPE_F64;
  // Pass 1: moments and the two sums per block; an excluded parameter has no decay (its sums go unused).
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    step_args_t a = base;
    if (exclude && exclude[k->r]) a.weight_decay = 0;
    if (f64)
      lamb_norms_d(&a, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
    else
      lamb_norms_f(&a, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
  }
  for (int64_t r = 0, b = 0; r < n_ranges; r++) {
    double sp, su;
    fold_blocks(&pb, (int)r, &b, &sp, &su);
    double pn = sqrt(sp), un = sqrt(su);
    pb.trust[r] = (exclude && exclude[r]) || !(pn > 0 && un > 0) ? 1.0 : pn / un;
  }
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    step_args_t a = base;
    a.trust = pb.trust[k->r];
    if (exclude && exclude[k->r]) a.weight_decay = 0;
    if (f64)
      lamb_apply_d(&a, k->lo, k->hi);
    else
      lamb_apply_f(&a, k->lo, k->hi);
  }
  free(pb.mem);
  return DLUA_OK;
}

/* ---- AMP unscaling, clip_grad_norm_ ---------------------------------------------------------------------- */

/* (suffix, storage type, compute type, load, store) */
#define UNSCALE_KERNEL(S, ST, CT, LOAD, STORE)                                            \
  static DLUA_CPU_CLONES int64_t unscale_##S(ST *x, int64_t lo, int64_t hi, double inv) { \
    int64_t bad = 0;                                                                      \
    const CT s = (CT)inv;                                                                 \
    for (int64_t i = lo; i < hi; i++) {                                                   \
      CT v = LOAD(x[i]);                                                                  \
      bad += !isfinite(v);                                                                \
      x[i] = STORE(v * s);                                                                \
    }                                                                                     \
    return bad;                                                                           \
  }                                                                                       \
  /* sum of |x|^p (p finite) or max |x| (p = inf) over [lo, hi) */                        \
  static DLUA_CPU_CLONES double norm_##S(const ST *x, int64_t lo, int64_t hi, double p) { \
    double acc = 0;                                                                       \
    if (isinf(p))                                                                         \
      for (int64_t i = lo; i < hi; i++) acc = dlua_opt_norm_max(acc, (double)LOAD(x[i])); \
    else if (p == 2)                                                                      \
      for (int64_t i = lo; i < hi; i++) acc += dlua_opt_norm_term((double)LOAD(x[i]), 2); \
    else                                                                                  \
      for (int64_t i = lo; i < hi; i++) acc += dlua_opt_norm_term((double)LOAD(x[i]), p); \
    return acc;                                                                           \
  }

#define SAME(v) (v)
UNSCALE_KERNEL(f32, float, float, SAME, SAME)
UNSCALE_KERNEL(f64, double, double, SAME, SAME)
UNSCALE_KERNEL(f16, uint16_t, float, dlua_f16_to_f32_inl, dlua_f32_to_f16_inl)
UNSCALE_KERNEL(bf16, uint16_t, float, dlua_bf16_to_f32_inl, dlua_f32_to_bf16_inl)
#undef SAME

/* A gradient range to scale or measure: any floating dtype, contiguous; returns its first byte. */
static dlua_status_t check_grad_range(const char *op, const dlua_tensor_t *grad, int64_t offset, int64_t length,
                                      char **base) {
  char b[200];
  if (!grad || !grad->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad is NULL (freed, or never created)", op);
#ifndef DLUA_HAVE_CUDA
  DLUA_TRY(dlua_require_cpu(op, grad));
#endif
  if (!dlua_dtype_is_floating(grad->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad must be a floating-point tensor, got %s", op,
                    dlua_tensor_describe(grad, b, sizeof b));
  if (!dlua_tensor_is_contiguous(grad))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad %s must be contiguous (a flat arena, or a narrowed view of one)", op,
                    dlua_tensor_describe(grad, b, sizeof b));
  DLUA_TRY(check_range(op, grad, offset, length));
  *base = dlua_tensor_ptr(grad) + offset * (int64_t)dlua_dtype_size(grad->dtype);
  return DLUA_OK;
}

/* x *= s over a range; counts the non-finite inputs when nonfinite is not NULL. */
static dlua_status_t scale_range(const char *op, dlua_tensor_t *grad, int64_t offset, int64_t length, double s,
                                 int64_t *nonfinite) {
  if (nonfinite) *nonfinite = 0;
  char *base;
  DLUA_TRY(check_grad_range(op, grad, offset, length, &base));
  if (!isfinite(s)) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be finite, got %g", op, nonfinite ? "inv_scale" : "scale", s);
  dlua_dtype_t dt = grad->dtype;
#ifdef DLUA_HAVE_CUDA
  if (grad->device != DLUA_CPU)
    return nonfinite ? dlua_cuda_unscale(op, (int)dt, base, length, s, nonfinite, grad->device)
                     : dlua_cuda_grad_scale(op, (int)dt, base, length, s, grad->device);
#endif
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK, bad = 0;
  // An integer count: the sum is the same in any order, so a plain reduction is deterministic.
#pragma omp parallel for schedule(static) reduction(+ : bad) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    switch (dt) {
      case DLUA_DTYPE_F32: bad += unscale_f32((float *)base, lo, hi, s); break;
      case DLUA_DTYPE_F64: bad += unscale_f64((double *)base, lo, hi, s); break;
      case DLUA_DTYPE_F16: bad += unscale_f16((uint16_t *)base, lo, hi, s); break;
      default: bad += unscale_bf16((uint16_t *)base, lo, hi, s); break;
    }
  }
  if (nonfinite) *nonfinite = bad;
  return DLUA_OK;
}

dlua_status_t dlua_optim_unscale(dlua_tensor_t *grad, int64_t offset, int64_t length, double inv_scale,
                                 int64_t *nonfinite) {
  int64_t dummy;
  return scale_range("unscale", grad, offset, length, inv_scale, nonfinite ? nonfinite : &dummy);
}

dlua_status_t dlua_optim_grad_scale(dlua_tensor_t *grad, int64_t offset, int64_t length, double scale) {
  return scale_range("grad_scale", grad, offset, length, scale, NULL);
}

dlua_status_t dlua_optim_grad_norm_partial(const dlua_tensor_t *grad, int64_t offset, int64_t length,
                                           double norm_type, double *out) {
  const char *op = "grad_norm_partial";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  *out = 0;
  char *base;
  DLUA_TRY(check_grad_range(op, grad, offset, length, &base));
  if (!(norm_type > 0))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: norm_type must be a number > 0 or inf, got %g", op, norm_type);
  dlua_dtype_t dt = grad->dtype;
  if (length == 0) return DLUA_OK;
#ifdef DLUA_HAVE_CUDA
  if (grad->device != DLUA_CPU) return dlua_cuda_grad_norm_partial(op, (int)dt, base, length, norm_type, out, grad->device);
#endif
  // Fixed blocks folded in order: the same bits whatever the number of threads.
  int64_t nb = (length + LARS_BLOCK - 1) / LARS_BLOCK;
  double one, *part = nb > 1 ? malloc((size_t)nb * sizeof(double)) : &one;
  if (!part) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, (size_t)nb * sizeof(double));
#pragma omp parallel for schedule(static) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    int64_t lo = b * LARS_BLOCK, hi = lo + LARS_BLOCK < length ? lo + LARS_BLOCK : length;
    switch (dt) {
      case DLUA_DTYPE_F32: part[b] = norm_f32((const float *)base, lo, hi, norm_type); break;
      case DLUA_DTYPE_F64: part[b] = norm_f64((const double *)base, lo, hi, norm_type); break;
      case DLUA_DTYPE_F16: part[b] = norm_f16((const uint16_t *)base, lo, hi, norm_type); break;
      default: part[b] = norm_bf16((const uint16_t *)base, lo, hi, norm_type); break;
    }
  }
  double acc = 0;
  for (int64_t b = 0; b < nb; b++) acc = isinf(norm_type) ? dlua_opt_norm_max(acc, part[b]) : acc + part[b];
  if (part != &one) free(part);
  *out = acc;
  return DLUA_OK;
}

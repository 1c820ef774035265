/* The front doors of the fused optimizer steps over ranges of the flat parameter/gradient/state arenas (SGD,
   Adam, AdamW, LARS, LAMB, and mixed precision's master-weight variants), AMP unscaling and clip_grad_norm_'s
   partial norms and scaling: checks, the descriptor, then the optim family of the tensor's backend table
   (host/kernels/optim.h; host/cpu/optim.c, host/cuda/optim.cu). */
#include "ops/optim.h"
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/optim.h"
#include "ops/backend.h"
#include "ops/common.h"

/* ---- argument checks ------------------------------------------------------------------------------ */

/* The first tensor of a step: live, then its device's optim table holds the step's slot. */
#define PARAM_BACKEND(op, p, slot, k)                                                                     \
  do {                                                                                                    \
    if (!(p) || !(p)->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: param is NULL (freed, or never created)", op); \
    DLUA_TRY(DLUA_BACKEND(op, (p)->device, optim, slot, k));                                              \
  } while (0)

static dlua_status_t check_param(const char *op, const dlua_tensor_t *p) {
  char b[200];
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

/* Adam's, AdamW's and LAMB's scalars: lr, eps, weight_decay >= 0, betas in [0, 1), a finite grad_scale, step >= 1. */
static dlua_status_t check_adam_hypers(const char *op, double lr, double beta1, double beta2, double eps,
                                       double weight_decay, double grad_scale, int64_t step) {
  DLUA_TRY(check_hyper(op, "lr", lr, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "beta1", beta1, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "beta2", beta2, 0, 1, 1));
  DLUA_TRY(check_hyper(op, "eps", eps, 0, INFINITY, 0));
  DLUA_TRY(check_hyper(op, "weight_decay", weight_decay, 0, INFINITY, 0));
  DLUA_TRY(check_grad_scale(op, grad_scale));
  if (step < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: step counts this step from 1, got %" PRId64, op, step);
  return DLUA_OK;
}

/* Mixed precision's master weights: the 16-bit copy of the parameters a layer computes with, written
   chunk by chunk right after the chunk's update, while it is in cache (no pass of its own). lowp:
   NULL, or a contiguous float16/bfloat16 tensor of param's element count on param's device (the CPU's chunks,
   CUDA's grid-stride kernel). */
static dlua_status_t check_lowp(const char *op, const dlua_tensor_t *lowp, const dlua_tensor_t *p) {
  char b1[200], b2[200];
  if (!lowp) return DLUA_OK;
  if (!lowp->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: lowp copy is freed", op);
  if (lowp->device != p->device)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the 16-bit copy must be on param's device, got param %s and copy %s", op,
                    dlua_tensor_describe(p, b2, sizeof b2), dlua_tensor_describe(lowp, b1, sizeof b1));
  if ((lowp->dtype != DLUA_DTYPE_BF16 && lowp->dtype != DLUA_DTYPE_F16) || p->dtype != DLUA_DTYPE_F32 ||
      dlua_tensor_numel(lowp) != dlua_tensor_numel(p) || !dlua_tensor_is_contiguous(lowp))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the 16-bit copy %s must be a contiguous bfloat16 or float16 tensor of param's "
                    "element count, param float32 (param %s)", op, dlua_tensor_describe(lowp, b1, sizeof b1),
                    dlua_tensor_describe(p, b2, sizeof b2));
  return DLUA_OK;
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
  const struct dlua_optim_ops *k;
  PARAM_BACKEND(op, param, sgd_step, &k);
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
  dlua_optim_step_desc_t d = {
      .dtype = (int)param->dtype, .length = length, .lowp = lowp ? at(lowp, offset) : NULL,
      .lowp_dtype = lowp ? (int)lowp->dtype : 0, .device = param->device,
      .args = {.p = at(param, offset), .g = at(grad, offset), .s1 = momentum != 0 ? at(momentum_buf, offset) : NULL,
               .lr = lr, .momentum = momentum, .dampening = dampening, .weight_decay = weight_decay,
               .grad_scale = grad_scale, .nesterov = nesterov != 0, .maximize = maximize != 0,
               .first = first_step != 0}};
  return k->sgd_step(op, &d);
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
  const struct dlua_optim_ops *k;
  PARAM_BACKEND(op, param, adam_step, &k);
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
  DLUA_TRY(check_adam_hypers(op, lr, beta1, beta2, eps, weight_decay, grad_scale, step));
  dlua_optim_step_desc_t d = {
      .dtype = (int)param->dtype, .length = length, .lowp = lowp ? at(lowp, offset) : NULL,
      .lowp_dtype = lowp ? (int)lowp->dtype : 0, .device = param->device,
      .args = {.p = at(param, offset), .g = at(grad, offset), .s1 = at(exp_avg, offset),
               .s2 = at(exp_avg_sq, offset), .s3 = amsgrad ? at(max_exp_avg_sq, offset) : NULL, .lr = lr,
               .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
               .grad_scale = grad_scale, .amsgrad = amsgrad != 0, .maximize = maximize != 0,
               .decoupled = decoupled, .bc1 = 1.0 - pow(beta1, (double)step),
               .bc2 = 1.0 - pow(beta2, (double)step)}};
  return k->adam_step(op, &d);
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

/* ---- per-parameter ranges (LARS, LAMB) ------------------------------------------------------------------ */

static int cmp_range(const void *x, const void *y) {
  const int64_t *a = x, *b = y;
  return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* The ranges are inside the arena and pairwise disjoint (one loop writes them all). */
static dlua_status_t check_ranges(const char *op, const dlua_tensor_t *param, int n_ranges, const int64_t *offsets,
                                  const int64_t *lengths) {
  if (n_ranges < 0 || (n_ranges > 0 && (!offsets || !lengths)))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected n_ranges >= 0 with offsets and lengths, got %d ranges%s", op, n_ranges,
                    n_ranges > 0 ? " and a NULL array" : "");
  for (int r = 0; r < n_ranges; r++) {
    dlua_status_t s = check_range(op, param, offsets[r], lengths[r]);
    if (s != DLUA_OK)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: parameter %d: range offset %" PRId64 ", length %" PRId64
                      " is outside the arena of %" PRId64 " elements", op, r, offsets[r], lengths[r],
                      dlua_tensor_numel(param));
  }
  size_t bytes = (size_t)n_ranges * 2 * sizeof(int64_t) + 1;
  int64_t *sorted = malloc(bytes);
  if (!sorted) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, bytes);
  int m = 0;  // empty ranges cannot overlap anything, and would hide a neighbour's overlap
  for (int r = 0; r < n_ranges; r++)
    if (lengths[r] > 0) sorted[2 * m] = offsets[r], sorted[2 * m + 1] = lengths[r], m++;
  qsort(sorted, (size_t)m, 2 * sizeof(int64_t), cmp_range);
  dlua_status_t s = DLUA_OK;
  for (int r = 1; r < m && s == DLUA_OK; r++)
    if (sorted[2 * r - 2] + sorted[2 * r - 1] > sorted[2 * r])
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: parameter ranges overlap: [%" PRId64 ", %" PRId64 ") and [%" PRId64 ", %" PRId64 ")",
                   op, sorted[2 * r - 2], sorted[2 * r - 2] + sorted[2 * r - 1], sorted[2 * r],
                   sorted[2 * r] + sorted[2 * r + 1]);
  free(sorted);
  return s;
}

/* ---- LARS ------------------------------------------------------------------------------------------------ */

dlua_status_t dlua_optim_lars_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf,
                                   int n_ranges, const int64_t *offsets, const int64_t *lengths,
                                   const int32_t *exclude, double lr, double momentum, double weight_decay,
                                   double trust_coefficient, double eps, int first_step, double grad_scale) {
  const char *op = "lars_step";
  const struct dlua_optim_ops *k;
  PARAM_BACKEND(op, param, lars_step, &k);
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
  DLUA_TRY(check_ranges(op, param, n_ranges, offsets, lengths));
  if (n_ranges == 0) return DLUA_OK;
  dlua_optim_ranges_desc_t d = {
      .dtype = (int)param->dtype, .n_ranges = n_ranges, .offsets = offsets, .lengths = lengths, .exclude = exclude,
      .trust_coefficient = trust_coefficient, .eps = eps, .device = param->device,
      .args = {.p = dlua_tensor_ptr(param), .g = dlua_tensor_ptr(grad),
               .s1 = momentum != 0 ? dlua_tensor_ptr(momentum_buf) : NULL, .lr = lr, .momentum = momentum,
               .weight_decay = weight_decay, .grad_scale = grad_scale, .first = first_step != 0}};
  return k->lars_step(op, &d);
}

/* ---- LAMB ------------------------------------------------------------------------------------------------ */

dlua_status_t dlua_optim_lamb_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg,
                                   dlua_tensor_t *exp_avg_sq, int n_ranges, const int64_t *offsets,
                                   const int64_t *lengths, const int32_t *exclude, double lr, double beta1,
                                   double beta2, double eps, double weight_decay, int64_t step, int bias_correction,
                                   double grad_scale) {
  const char *op = "lamb_step";
  const struct dlua_optim_ops *k;
  PARAM_BACKEND(op, param, lamb_step, &k);
  DLUA_TRY(check_param(op, param));
  DLUA_TRY(check_buffer(op, "grad", grad, param));
  DLUA_TRY(check_buffer(op, "exp_avg", exp_avg, param));
  DLUA_TRY(check_buffer(op, "exp_avg_sq", exp_avg_sq, param));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg_sq", exp_avg_sq, "grad", grad));
  DLUA_TRY(check_apart(op, "exp_avg", exp_avg, "exp_avg_sq", exp_avg_sq));
  DLUA_TRY(check_adam_hypers(op, lr, beta1, beta2, eps, weight_decay, grad_scale, step));
  DLUA_TRY(check_ranges(op, param, n_ranges, offsets, lengths));
  if (n_ranges == 0) return DLUA_OK;
  dlua_optim_ranges_desc_t d = {
      .dtype = (int)param->dtype, .n_ranges = n_ranges, .offsets = offsets, .lengths = lengths, .exclude = exclude,
      .device = param->device,
      .args = {.p = dlua_tensor_ptr(param), .g = dlua_tensor_ptr(grad), .s1 = dlua_tensor_ptr(exp_avg),
               .s2 = dlua_tensor_ptr(exp_avg_sq), .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
               .weight_decay = weight_decay, .grad_scale = grad_scale,
               .bc1 = bias_correction ? 1.0 - pow(beta1, (double)step) : 1.0,
               .bc2 = bias_correction ? 1.0 - pow(beta2, (double)step) : 1.0}};
  return k->lamb_step(op, &d);
}

/* ---- AMP unscaling, clip_grad_norm_ ---------------------------------------------------------------------- */

/* A gradient range to scale or measure: any floating dtype, contiguous; fills d's dtype, x, n and device. The
   backend lookup comes right after the NULL check, as the device check did. */
#define GRAD_BACKEND(op, grad, slot, k)                                                                   \
  do {                                                                                                    \
    if (!(grad) || !(grad)->storage)                                                                      \
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad is NULL (freed, or never created)", op);                    \
    DLUA_TRY(DLUA_BACKEND(op, (grad)->device, optim, slot, k));                                           \
  } while (0)

static dlua_status_t check_grad_range(const char *op, const dlua_tensor_t *grad, int64_t offset, int64_t length,
                                      dlua_optim_grad_desc_t *d) {
  char b[200];
  if (!dlua_dtype_is_floating(grad->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad must be a floating-point tensor, got %s", op,
                    dlua_tensor_describe(grad, b, sizeof b));
  if (!dlua_tensor_is_contiguous(grad))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad %s must be contiguous (a flat arena, or a narrowed view of one)", op,
                    dlua_tensor_describe(grad, b, sizeof b));
  DLUA_TRY(check_range(op, grad, offset, length));
  memset(d, 0, sizeof *d);
  d->dtype = (int)grad->dtype;
  d->x = dlua_tensor_ptr(grad) + offset * (int64_t)dlua_dtype_size(grad->dtype);
  d->n = length;
  d->device = grad->device;
  return DLUA_OK;
}

dlua_status_t dlua_optim_unscale(dlua_tensor_t *grad, int64_t offset, int64_t length, double inv_scale,
                                 int64_t *nonfinite) {
  const char *op = "unscale";
  int64_t dummy;
  if (!nonfinite) nonfinite = &dummy;
  *nonfinite = 0;
  const struct dlua_optim_ops *k;
  GRAD_BACKEND(op, grad, unscale, &k);
  dlua_optim_grad_desc_t d;
  DLUA_TRY(check_grad_range(op, grad, offset, length, &d));
  if (!isfinite(inv_scale)) return DLUA_ERR(DLUA_ERR_ARG, "%s: inv_scale must be finite, got %g", op, inv_scale);
  d.s = inv_scale;
  d.nonfinite = nonfinite;
  return k->unscale(op, &d);
}

dlua_status_t dlua_optim_grad_scale(dlua_tensor_t *grad, int64_t offset, int64_t length, double scale) {
  const char *op = "grad_scale";
  const struct dlua_optim_ops *k;
  GRAD_BACKEND(op, grad, grad_scale, &k);
  dlua_optim_grad_desc_t d;
  DLUA_TRY(check_grad_range(op, grad, offset, length, &d));
  if (!isfinite(scale)) return DLUA_ERR(DLUA_ERR_ARG, "%s: scale must be finite, got %g", op, scale);
  d.s = scale;
  return k->grad_scale(op, &d);
}

dlua_status_t dlua_optim_grad_norm_partial(const dlua_tensor_t *grad, int64_t offset, int64_t length,
                                           double norm_type, double *out) {
  const char *op = "grad_norm_partial";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  *out = 0;
  const struct dlua_optim_ops *k;
  GRAD_BACKEND(op, grad, grad_norm_partial, &k);
  dlua_optim_grad_desc_t d;
  DLUA_TRY(check_grad_range(op, grad, offset, length, &d));
  if (!(norm_type > 0))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: norm_type must be a number > 0 or inf, got %g", op, norm_type);
  if (length == 0) return DLUA_OK;
  d.s = norm_type;
  d.out = out;
  return k->grad_norm_partial(op, &d);
}

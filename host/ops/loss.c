/* The losses' front doors: softmax/log-softmax, cross-entropy and MSE, forward and backward (argument checks,
   shapes, staging to the compute dtype, the `out` convention), each then one call through the loss family of
   the tensors' backend (kernels/loss.h). Threshold/ReLU and dropout are in host/ops/activation.c. */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/loss.h"
#include "ops/backend.h"
#include "ops/common.h"
#include "ops/loss_stage.h"


static dlua_status_t check_reduction(const char *op, dlua_loss_reduction_t r) {
  if ((int)r < 0 || r >= DLUA_LOSS_REDUCTION_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid reduction %d (expected none 0, mean 1 or sum 2)", op, (int)r);
  return DLUA_OK;
}

/* ---- softmax ----------------------------------------------------------------------------------- */

/* The upstream gradient of a reduced (mean or sum) loss: one value. */
static dlua_status_t reduced_grad(const char *op, const dlua_tensor_t *grad_output) {
  if (dlua_tensor_numel(grad_output) == 1) return DLUA_OK;
  char b[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s of a reduced loss must hold one value", op,
                  dlua_tensor_describe(grad_output, b, sizeof b));
}

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
  DLUA_TRY(dlua_loss_check(op, "x", x, 1));
  int64_t outer = 0, K = 0, inner = 0;
  DLUA_TRY(softmax_dims(op, x, dim, &outer, &K, &inner));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, loss, softmax, &k));
  dlua_dtype_t ct = dlua_loss_compute_dtype(x->dtype);
  dlua_loss_in_t in;
  DLUA_TRY(dlua_loss_in_stage(x, ct, &in));
  dlua_loss_out_t o;
  dlua_status_t s = dlua_loss_out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, &in, 1, x->device, &o);
  if (s == DLUA_OK) {
    dlua_loss_softmax_t d = {.ct = (int)ct, .x = in.p, .y = o.p, .outer = outer, .K = K, .inner = inner,
                             .log = log, .device = x->device};
    s = dlua_loss_out_finish(&o, k->softmax(op, &d));
  }
  dlua_loss_in_release(&in, 1);
  return s;
}

dlua_status_t dlua_nn_softmax_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                       const dlua_tensor_t *output, int dim, int log) {
  const char *op = log ? "log_softmax_backward" : "softmax_backward";
  DLUA_TRY(dlua_loss_check(op, "grad_output", grad_output, 1));
  DLUA_TRY(dlua_loss_check(op, "output", output, 1));
  DLUA_TRY(dlua_ops_check_input(op, output, grad_output));
  DLUA_TRY(dlua_loss_check_same_shape(op, "grad_output", grad_output, "output", output));
  int64_t outer = 0, K = 0, inner = 0;
  DLUA_TRY(softmax_dims(op, output, dim, &outer, &K, &inner));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, output->device, loss, softmax_backward, &k));
  dlua_dtype_t rt = dlua_dtype_promote(grad_output->dtype, output->dtype), ct = dlua_loss_compute_dtype(rt);
  dlua_loss_in_t in[2];
  DLUA_TRY(dlua_loss_in_stage(grad_output, ct, &in[0]));
  dlua_status_t s = dlua_loss_in_stage(output, ct, &in[1]);
  if (s != DLUA_OK) {
    dlua_loss_in_release(in, 1);
    return s;
  }
  dlua_loss_out_t o;
  s = dlua_loss_out_stage(op, grad_input, output->ndim, output->sizes, rt, ct, in, 2, output->device, &o);
  if (s == DLUA_OK) {
    dlua_loss_softmax_bwd_t d = {.ct = (int)ct, .gy = in[0].p, .y = in[1].p, .gx = o.p, .outer = outer, .K = K,
                                 .inner = inner, .log = log, .device = output->device};
    s = dlua_loss_out_finish(&o, k->softmax_backward(op, &d));
  }
  dlua_loss_in_release(in, 2);
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
  /* On a device, labels and w above are host copies (owned) for the checks and sums; these are the buffers the
     kernel reads (on the CPU the same as labels and w). */
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
static void ce_release(ce_plan_t *pl, dlua_loss_in_t *lab, dlua_loss_in_t *wbuf) {
  free(pl->host_labels);
  free(pl->host_w);
  pl->host_labels = NULL;
  pl->host_w = NULL;
  dlua_loss_in_release(lab, 1);
  dlua_loss_in_release(wbuf, 1);
}

/* The plan as the kernels take it (kernels/loss.h). */
static inline dlua_loss_ce_t ce_kernel_plan(const ce_plan_t *pl) {
  dlua_loss_ce_t c = {.N = pl->N, .K = pl->K, .inner = pl->inner, .P = pl->P, .labels = pl->dev_labels,
                      .base = pl->base, .ignore = pl->ignore, .w = pl->dev_w, .wsum = pl->wsum, .eps = pl->eps};
  return c;
}

/* Labels as int64 (any integer dtype), the weight as double, and the plan's options. */
static dlua_status_t ce_prepare(const char *op, const dlua_tensor_t *labels, const dlua_tensor_t *weight,
                                double eps, int64_t ignore, int64_t base, ce_plan_t *pl, dlua_loss_in_t *lab,
                                dlua_loss_in_t *wbuf) {
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
    DLUA_TRY(dlua_loss_check(op, "weight", weight, 1));
    DLUA_TRY(dlua_ops_check_input(op, weight, labels));
    if (weight->ndim != 1 || weight->sizes[0] != pl->K) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: weight %s must be one value per class: (%" PRId64 ")", op,
                      dlua_tensor_describe(weight, b, sizeof b), pl->K);
    }
    DLUA_TRY(dlua_loss_in_stage(weight, DLUA_DTYPE_F64, wbuf));
  }
  dlua_status_t s = dlua_loss_in_stage(labels, DLUA_DTYPE_I64, lab);
  if (s != DLUA_OK) {
    dlua_loss_in_release(wbuf, 1);
    return s;
  }
  pl->labels = pl->dev_labels = lab->p;
  pl->dev_w = weight ? wbuf->p : NULL;
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

dlua_status_t dlua_nn_cross_entropy(dlua_tensor_t **out, dlua_tensor_t **log_probs, const dlua_tensor_t *logits,
                                    const dlua_tensor_t *labels, const dlua_tensor_t *weight,
                                    dlua_loss_reduction_t reduction, double label_smoothing, int64_t ignore_index,
                                    int64_t index_base) {
  const char *op = "cross_entropy";
  DLUA_TRY(dlua_loss_check(op, "logits", logits, 1));
  DLUA_TRY(dlua_loss_check(op, "labels", labels, 0));
  DLUA_TRY(dlua_ops_check_input(op, labels, logits));
  DLUA_TRY(check_reduction(op, reduction));
  ce_plan_t pl;
  DLUA_TRY(ce_shapes(op, logits, labels, "logits", &pl));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, logits->device, loss, cross_entropy, &k));
  dlua_loss_in_t aux[2], x;  // labels, weight
  DLUA_TRY(ce_prepare(op, labels, weight, label_smoothing, ignore_index, index_base, &pl, &aux[0], &aux[1]));
  double tw = 0;
  dlua_status_t s = ce_labels(op, &pl, &tw);
  dlua_dtype_t ct = dlua_loss_compute_dtype(logits->dtype);
  x.tmp = NULL;
  if (s == DLUA_OK) s = dlua_loss_in_stage(logits, ct, &x);
  const int dev = logits->device;
  dlua_loss_out_t lo = {0}, lossb = {0};
  int have_lp = 0, have_loss = 0;
  if (s == DLUA_OK && log_probs) {
    s = dlua_loss_out_stage(op, log_probs, logits->ndim, logits->sizes, logits->dtype, ct, &x, 1, dev, &lo);
    have_lp = s == DLUA_OK;
  }
  if (s == DLUA_OK) {
    if (reduction == DLUA_LOSS_NONE)
      s = dlua_loss_out_stage(op, out, labels->ndim, labels->sizes, logits->dtype, ct, &x, 1, dev, &lossb);
    else
      s = dlua_loss_out_stage(op, out, 0, NULL, logits->dtype, DLUA_DTYPE_F64, NULL, 0, dev, &lossb);
    have_loss = s == DLUA_OK;
  }
  if (s == DLUA_OK) {
    int reduced = reduction != DLUA_LOSS_NONE;
    // Mean over no kept target is 0 / 0 = NaN, as in PyTorch.
    dlua_loss_ce_fwd_t d = {.ct = (int)ct, .pl = ce_kernel_plan(&pl), .x = x.p, .lp = have_lp ? lo.p : NULL,
                            .loss_none = reduced ? NULL : lossb.p, .sum = reduced ? lossb.p : NULL,
                            .div = reduction == DLUA_LOSS_MEAN ? tw : 1.0, .device = dev};
    s = k->cross_entropy(op, &d);
  }
  if (have_loss) s = dlua_loss_out_copy(&lossb, s);
  if (have_lp) s = dlua_loss_out_copy(&lo, s);
  if (s != DLUA_OK) {
    if (have_loss) dlua_loss_out_abort(&lossb);
    if (have_lp) dlua_loss_out_abort(&lo);
  }
  dlua_loss_in_release(&x, 1);
  ce_release(&pl, &aux[0], &aux[1]);
  return s;
}

dlua_status_t dlua_nn_cross_entropy_backward(dlua_tensor_t **grad_logits, const dlua_tensor_t *grad_output,
                                             const dlua_tensor_t *log_probs, const dlua_tensor_t *labels,
                                             const dlua_tensor_t *weight, dlua_loss_reduction_t reduction,
                                             double label_smoothing, int64_t ignore_index, int64_t index_base) {
  const char *op = "cross_entropy_backward";
  DLUA_TRY(dlua_loss_check(op, "log_probs", log_probs, 1));
  DLUA_TRY(dlua_loss_check(op, "labels", labels, 0));
  DLUA_TRY(dlua_ops_check_input(op, labels, log_probs));
  DLUA_TRY(check_reduction(op, reduction));
  ce_plan_t pl;
  DLUA_TRY(ce_shapes(op, log_probs, labels, "log_probs", &pl));
  if (grad_output) {
    DLUA_TRY(dlua_loss_check(op, "grad_output", grad_output, 1));
    DLUA_TRY(dlua_ops_check_input(op, grad_output, log_probs));
    if (reduction == DLUA_LOSS_NONE) {
      DLUA_TRY(dlua_loss_check_same_shape(op, "grad_output", grad_output, "labels", labels));
    } else {
      DLUA_TRY(reduced_grad(op, grad_output));
    }
  }
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, log_probs->device, loss, cross_entropy_backward, &k));
  dlua_loss_in_t aux[2], in[2] = {{0}, {0}};  // labels, weight; log_probs, grad_output
  DLUA_TRY(ce_prepare(op, labels, weight, label_smoothing, ignore_index, index_base, &pl, &aux[0], &aux[1]));
  double tw = 0;
  dlua_status_t s = ce_labels(op, &pl, &tw);
  dlua_dtype_t rt = log_probs->dtype;
  if (grad_output && reduction == DLUA_LOSS_NONE) rt = dlua_dtype_promote(rt, grad_output->dtype);
  dlua_dtype_t ct = dlua_loss_compute_dtype(rt);
  const int dev = log_probs->device;
  if (s == DLUA_OK) s = dlua_loss_in_stage(log_probs, ct, &in[0]);
  if (s == DLUA_OK && grad_output) {
    if (reduction == DLUA_LOSS_NONE) {
      s = dlua_loss_in_stage(grad_output, ct, &in[1]);
    } else {
      s = dlua_loss_scalar_stage(grad_output, &in[1]);
    }
  }
  dlua_loss_out_t o;
  if (s == DLUA_OK) {
    int per_target = grad_output && reduction == DLUA_LOSS_NONE;
    s = dlua_loss_out_stage(op, grad_logits, log_probs->ndim, log_probs->sizes, rt, ct, in, per_target ? 2 : 1, dev, &o);
    if (s == DLUA_OK) {
      dlua_loss_ce_bwd_t d = {.ct = (int)ct, .pl = ce_kernel_plan(&pl), .lp = in[0].p,
                              .gy = per_target ? in[1].p : NULL,
                              .gscalar = grad_output && !per_target ? in[1].p : NULL,
                              .div = reduction == DLUA_LOSS_MEAN ? tw : 1.0, .gx = o.p, .device = dev};
      s = dlua_loss_out_finish(&o, k->cross_entropy_backward(op, &d));
    }
  }
  dlua_loss_in_release(in, 2);
  ce_release(&pl, &aux[0], &aux[1]);
  return s;
}

/* ---- MSE ------------------------------------------------------------------------------------------- */

dlua_status_t dlua_nn_mse_loss(dlua_tensor_t **out, const dlua_tensor_t *input, const dlua_tensor_t *target,
                               dlua_loss_reduction_t reduction) {
  const char *op = "mse_loss";
  DLUA_TRY(dlua_loss_check(op, "input", input, 1));
  DLUA_TRY(dlua_loss_check(op, "target", target, 1));
  DLUA_TRY(dlua_ops_check_input(op, target, input));
  DLUA_TRY(check_reduction(op, reduction));
  DLUA_TRY(dlua_loss_check_same_shape(op, "input", input, "target", target));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, input->device, loss, mse, &k));
  dlua_dtype_t rt = dlua_dtype_promote(input->dtype, target->dtype), ct = dlua_loss_compute_dtype(rt);
  int64_t n = dlua_tensor_numel(input);
  dlua_loss_in_t in[2] = {{0}, {0}};
  dlua_status_t s = dlua_loss_in_stage(input, ct, &in[0]);
  if (s == DLUA_OK) s = dlua_loss_in_stage(target, ct, &in[1]);
  const int dev = input->device;
  dlua_loss_out_t o;
  if (s == DLUA_OK) {
    if (reduction == DLUA_LOSS_NONE)
      s = dlua_loss_out_stage(op, out, input->ndim, input->sizes, rt, ct, in, 2, dev, &o);
    else
      s = dlua_loss_out_stage(op, out, 0, NULL, rt, DLUA_DTYPE_F64, NULL, 0, dev, &o);
    if (s == DLUA_OK) {
      int reduced = reduction != DLUA_LOSS_NONE;
      dlua_loss_mse_t d = {.ct = (int)ct, .x = in[0].p, .t = in[1].p, .out_none = reduced ? NULL : o.p,
                           .sum = reduced ? o.p : NULL, .div = reduction == DLUA_LOSS_MEAN ? (double)n : 1.0, .n = n,
                           .device = dev};  // mean of nothing: NaN
      s = dlua_loss_out_finish(&o, k->mse(op, &d));
    }
  }
  dlua_loss_in_release(in, 2);
  return s;
}

dlua_status_t dlua_nn_mse_loss_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                        const dlua_tensor_t *input, const dlua_tensor_t *target,
                                        dlua_loss_reduction_t reduction) {
  const char *op = "mse_loss_backward";
  DLUA_TRY(dlua_loss_check(op, "input", input, 1));
  DLUA_TRY(dlua_loss_check(op, "target", target, 1));
  DLUA_TRY(dlua_ops_check_input(op, target, input));
  DLUA_TRY(check_reduction(op, reduction));
  DLUA_TRY(dlua_loss_check_same_shape(op, "input", input, "target", target));
  dlua_dtype_t rt = dlua_dtype_promote(input->dtype, target->dtype);
  if (grad_output) {
    DLUA_TRY(dlua_loss_check(op, "grad_output", grad_output, 1));
    DLUA_TRY(dlua_ops_check_input(op, grad_output, input));
    if (reduction == DLUA_LOSS_NONE) {
      DLUA_TRY(dlua_loss_check_same_shape(op, "grad_output", grad_output, "input", input));
      rt = dlua_dtype_promote(rt, grad_output->dtype);
    } else {
      DLUA_TRY(reduced_grad(op, grad_output));
    }
  }
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, input->device, loss, mse_backward, &k));
  dlua_dtype_t ct = dlua_loss_compute_dtype(rt);
  int64_t n = dlua_tensor_numel(input);
  dlua_loss_in_t in[3] = {{0}, {0}, {0}};
  int per_element = grad_output && reduction == DLUA_LOSS_NONE;
  dlua_status_t s = dlua_loss_in_stage(input, ct, &in[0]);
  if (s == DLUA_OK) s = dlua_loss_in_stage(target, ct, &in[1]);
  const int dev = input->device;
  if (s == DLUA_OK && grad_output) {
    if (per_element) {
      s = dlua_loss_in_stage(grad_output, ct, &in[2]);
    } else {
      s = dlua_loss_scalar_stage(grad_output, &in[2]);
    }
  }
  double norm = reduction == DLUA_LOSS_MEAN ? 2.0 / (double)n : 2.0;
  dlua_loss_out_t o;
  if (s == DLUA_OK) {
    s = dlua_loss_out_stage(op, grad_input, input->ndim, input->sizes, rt, ct, in, per_element ? 3 : 2, dev, &o);
    if (s == DLUA_OK) {
      dlua_loss_mse_bwd_t d = {.ct = (int)ct, .x = in[0].p, .t = in[1].p, .gy = per_element ? in[2].p : NULL,
                               .gscalar = grad_output && !per_element ? in[2].p : NULL, .norm = norm, .gx = o.p,
                               .n = n, .device = dev};
      s = dlua_loss_out_finish(&o, k->mse_backward(op, &d));
    }
  }
  dlua_loss_in_release(in, 3);
  return s;
}


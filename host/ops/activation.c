/* The activations' front doors: threshold/ReLU forward and backward, dropout (its mask drawn by
   bernoulli_, then the loss family's mask-scale), each one call through the tensors' backend (kernels/loss.h). */
#include <stdint.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/loss.h"
#include "ops/backend.h"
#include "ops/common.h"
#include "ops/loss_stage.h"

/* ---- threshold / ReLU ----------------------------------------------------------------------------- */

dlua_status_t dlua_nn_threshold(dlua_tensor_t **out, const dlua_tensor_t *x, double threshold, double value) {
  const char *op = "threshold";
  DLUA_TRY(dlua_loss_check(op, "x", x, 1));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, loss, threshold, &k));
  dlua_dtype_t ct = dlua_loss_compute_dtype(x->dtype);
  dlua_loss_in_t in;
  DLUA_TRY(dlua_loss_in_stage(x, ct, &in));
  dlua_loss_out_t o;
  dlua_status_t s = dlua_loss_out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, &in, 1, x->device, &o);
  if (s == DLUA_OK) {
    dlua_loss_threshold_t d = {.ct = (int)ct, .x = in.p, .y = o.p, .n = in.n, .th = threshold, .value = value,
                               .device = x->device};
    s = dlua_loss_out_finish(&o, k->threshold(op, &d));
  }
  dlua_loss_in_release(&in, 1);
  return s;
}

static dlua_status_t threshold_backward(const char *op, dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                        const dlua_tensor_t *x, const char *xname, double threshold) {
  DLUA_TRY(dlua_loss_check(op, "grad_output", grad_output, 1));
  DLUA_TRY(dlua_loss_check(op, xname, x, 1));
  DLUA_TRY(dlua_ops_check_input(op, x, grad_output));
  DLUA_TRY(dlua_loss_check_same_shape(op, "grad_output", grad_output, xname, x));
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, loss, threshold_backward, &k));
  dlua_dtype_t rt = grad_output->dtype, ct = dlua_loss_compute_dtype(dlua_dtype_promote(rt, x->dtype));
  dlua_loss_in_t in[2] = {{0}, {0}};
  dlua_status_t s = dlua_loss_in_stage(grad_output, ct, &in[0]);
  if (s == DLUA_OK) s = dlua_loss_in_stage(x, ct, &in[1]);
  dlua_loss_out_t o;
  if (s == DLUA_OK) {
    s = dlua_loss_out_stage(op, grad_input, x->ndim, x->sizes, rt, ct, in, 2, x->device, &o);
    if (s == DLUA_OK) {
      dlua_loss_threshold_bwd_t d = {.ct = (int)ct, .gy = in[0].p, .x = in[1].p, .gx = o.p, .n = in[0].n,
                                     .th = threshold, .device = x->device};
      s = dlua_loss_out_finish(&o, k->threshold_backward(op, &d));
    }
  }
  dlua_loss_in_release(in, 2);
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
  const struct dlua_loss_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, loss, mask_scale, &k));
  dlua_dtype_t ct = dlua_loss_compute_dtype(x->dtype);
  dlua_loss_in_t in[2] = {{0}, {0}};
  dlua_status_t s = dlua_loss_in_stage(x, ct, &in[0]);
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
  dlua_loss_out_t o;
  if (s == DLUA_OK) {
    s = dlua_loss_out_stage(op, out, x->ndim, x->sizes, x->dtype, ct, in, 1, x->device, &o);
    if (s == DLUA_OK) {
      dlua_loss_mask_scale_t d = {.ct = (int)ct, .x = in[0].p, .m = in[1].p, .y = o.p, .n = in[0].n, .scale = scale,
                                  .device = x->device};
      s = dlua_loss_out_finish(&o, k->mask_scale(op, &d));
    }
  }
  dlua_loss_in_release(in, 2);
  return s;
}

dlua_status_t dlua_nn_dropout(dlua_tensor_t **out, dlua_tensor_t **mask, const dlua_tensor_t *x, double p, int train,
                              dlua_generator_t *g) {
  const char *op = "dropout";
  DLUA_TRY(dlua_loss_check(op, "x", x, 1));
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
  const struct dlua_loss_ops *k;  // before the mask is drawn: a backend without mask_scale says so first
  DLUA_TRY(DLUA_BACKEND(op, x->device, loss, mask_scale, &k));
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
  DLUA_TRY(dlua_loss_check(op, "grad_output", grad_output, 1));
  DLUA_TRY(dlua_loss_check(op, "mask", mask, 0));
  DLUA_TRY(dlua_ops_check_input(op, mask, grad_output));
  DLUA_TRY(dlua_loss_check_same_shape(op, "grad_output", grad_output, "mask", mask));
  if (!(p >= 0 && p <= 1)) return DLUA_ERR(DLUA_ERR_ARG, "dropout_backward: p must be in [0, 1], got %g", p);
  return apply_mask(op, grad_input, grad_output, mask, p < 1 ? 1.0 / (1.0 - p) : 0.0);
}

/* 2-D pooling's front doors (max, average, adaptive average; forward and backward): argument checks,
   output sizes, layouts and the `out` convention, then one call through the device's pool table
   (kernels/pool.h; the kernels are host/cpu/pool.c and host/cuda/pool.cu). */
#include <inttypes.h>
#include <stdint.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "kernels/pool.h"
#include "ops/backend.h"
#include "ops/common.h"

int64_t dlua_pool2d_output_size(int64_t in, int64_t kernel, int stride, int pad, int dil, int ceil_mode) {
  if (in < 0 || kernel < 1 || stride < 1 || pad < 0 || dil < 1) return -1;
  int64_t num = in + 2 * (int64_t)pad - (int64_t)dil * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  if (num < 0) return 0;
  int64_t out = num / stride + 1;
  // The last window must start inside the input or its left padding.
  if (ceil_mode && (out - 1) * stride >= in + pad) out--;
  return out;
}

/* ---- argument checks ---------------------------------------------------------------------------- */

static dlua_status_t check_act(const char *op, const char *what, const dlua_tensor_t *t) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  char b[200];
  if (t->ndim != 4)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must have 4 dimensions (N, C, H, W), got %s", op, what,
                    dlua_tensor_describe(t, b, sizeof b));
  if (!dlua_dtype_is_floating(t->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a floating-point tensor, got %s", op, what,
                    dlua_tensor_describe(t, b, sizeof b));
  return DLUA_OK;
}


static dlua_status_t check_x_sizes(const char *op, const int64_t *xs) {
  if (!xs) return DLUA_ERR(DLUA_ERR_ARG, "%s: x_sizes is NULL", op);
  for (int d = 0; d < 4; d++)
    if (xs[d] < 0) {
      char b[160];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: input sizes %s must be non-negative", op, dlua_shape_str(4, xs, b, sizeof b));
    }
  return DLUA_OK;
}

/* Fills g's window parameters and output size from the input sizes xs (N, C, H, W). */
static dlua_status_t pool_geometry(const char *op, const int64_t *xs, int kh, int kw, int sh, int sw, int ph, int pw,
                                   int dh, int dw, int ceil_mode, dlua_pool_geom_t *g) {
  char b[160];
  if (kh < 1 || kw < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: kernel (%d, %d) must be positive", op, kh, kw);
  if (sh < 1 || sw < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: stride (%d, %d) must be positive", op, sh, sw);
  if (dh < 1 || dw < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: dilation (%d, %d) must be positive", op, dh, dw);
  if (ph < 0 || pw < 0 || ph > kh / 2 || pw > kw / 2)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: padding (%d, %d) must be between 0 and half the kernel (%d, %d)", op, ph, pw, kh,
                    kw);
  g->N = xs[0];
  g->C = xs[1];
  g->H = xs[2];
  g->W = xs[3];
  g->kh = kh, g->kw = kw, g->sh = sh, g->sw = sw, g->ph = ph, g->pw = pw, g->dh = dh, g->dw = dw;
  g->OH = dlua_pool2d_output_size(g->H, kh, sh, ph, dh, ceil_mode);
  g->OW = dlua_pool2d_output_size(g->W, kw, sw, pw, dw, ceil_mode);
  if (g->OH < 1 || g->OW < 1)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: kernel (%d, %d) with dilation (%d, %d) is larger than input %s padded by (%d, %d): output "
                    "would be %" PRId64 " x %" PRId64,
                    op, kh, kw, dh, dw, dlua_shape_str(4, xs, b, sizeof b), ph, pw, g->OH, g->OW);
  return DLUA_OK;
}

static dlua_status_t check_grad_shape(const char *op, const dlua_tensor_t *gy, const dlua_pool_geom_t *g) {
  if (gy->sizes[0] == g->N && gy->sizes[1] == g->C && gy->sizes[2] == g->OH && gy->sizes[3] == g->OW) return DLUA_OK;
  char b[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s must have shape (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ")",
                  op, dlua_tensor_describe(gy, b, sizeof b), g->N, g->C, g->OH, g->OW);
}

/* The dtype the kernels read and write: the activations' own where the backend takes 16-bit ones,
   else the compute dtype (double for f64, float otherwise). */
static dlua_dtype_t kernel_dtype(const struct dlua_pool_ops *k, dlua_dtype_t d) {
  if (k->native_16bit || d == DLUA_DTYPE_F64) return d;
  return DLUA_DTYPE_F32;
}

static int fmt_of(const dlua_tensor_t *t) {
  int f = act_format(t);
  return f == ACT_OTHER ? ACT_CONTIG : f;
}

/* A backward's layout: that of the caller's grad_input when one is given in NCHW or
   channels-last memory (the bindings pass one shaped like the forward input), else grad_output's. */
static int grad_fmt(dlua_tensor_t *const *grad_input, const dlua_tensor_t *grad_output) {
  const dlua_tensor_t *given = grad_input && *grad_input && (*grad_input)->ndim == 4 ? *grad_input : NULL;
  return act_format_pref(given, grad_output);
}

/* ---- one path for every kind ---------------------------------------------------------------------- */

/* Forward of any kind (indices: max pooling's positions, may be NULL): x staged in the kernel dtype
   and its own layout, out (and indices) under the `out` convention, one call through the table. */
static dlua_status_t pool_forward(const char *op, dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *x,
                                  dlua_pool_geom_t *g) {
  const struct dlua_pool_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, pool, forward, &k));
  const int fmt = fmt_of(x);
  const dlua_dtype_t kt = kernel_dtype(k, x->dtype);
  g->cl = fmt == ACT_CL;
  g->dtype = (int)kt;
  g->device = x->device;
  const int64_t osz[4] = {g->N, g->C, g->OH, g->OW};
  dlua_tensor_t *xs = NULL;
  act_out_t oy = {0}, oi = {0};
  dlua_status_t s = act_stage(x, kt, fmt, &xs);
  if (s == DLUA_OK) s = act_out_begin_on(op, &oy, out, 4, osz, x->dtype, kt, fmt, &x, 1, 0, x->device);
  if (s == DLUA_OK && indices)
    s = act_out_begin_on(op, &oi, indices, 4, osz, DLUA_DTYPE_I64, DLUA_DTYPE_I64, fmt, &x, 1, 0, x->device);
  if (s == DLUA_OK && indices && (*indices)->dtype != DLUA_DTYPE_I64 && (*indices)->dtype != DLUA_DTYPE_I32) {
    char b[200];
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s must be int64 or int32", op, dlua_tensor_describe(*indices, b, sizeof b));
  }
  if (s == DLUA_OK) {
    const dlua_pool_fwd_t a = {.p = *g,
                               .x = dlua_tensor_ptr(xs),
                               .y = dlua_tensor_ptr(oy.work),
                               .ind = indices ? (int64_t *)dlua_tensor_ptr(oi.work) : NULL};
    s = k->forward(op, &a);
  }
  s = act_out_end(&oy, s);
  s = act_out_end(&oi, s);
  dlua_tensor_free(xs);
  return s;
}

/* Backward of any kind into grad_input (x_sizes), laid out as grad_fmt says. */
static dlua_status_t pool_backward(const char *op, dlua_tensor_t **grad_input, const dlua_tensor_t *gy,
                                   const dlua_tensor_t *indices, const int64_t *x_sizes, dlua_pool_geom_t *g) {
  const struct dlua_pool_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, gy->device, pool, backward, &k));
  const int fmt = grad_fmt(grad_input, gy);
  const dlua_dtype_t kt = kernel_dtype(k, gy->dtype);
  g->cl = fmt == ACT_CL;
  g->dtype = (int)kt;
  g->device = gy->device;
  dlua_tensor_t *gs = NULL, *is = NULL;
  act_out_t ox = {0};
  const dlua_tensor_t *ins[2] = {gy, indices};
  dlua_status_t s = act_stage(gy, kt, fmt, &gs);
  if (s == DLUA_OK && indices) s = act_stage(indices, DLUA_DTYPE_I64, fmt, &is);
  if (s == DLUA_OK) s = act_out_begin_on(op, &ox, grad_input, 4, x_sizes, gy->dtype, kt, fmt, ins, 2, 0, gy->device);
  if (s == DLUA_OK) {
    int bad = 0;
    const dlua_pool_bwd_t a = {.p = *g,
                               .gy = dlua_tensor_ptr(gs),
                               .ind = is ? (const int64_t *)dlua_tensor_ptr(is) : NULL,
                               .gx = dlua_tensor_ptr(ox.work),
                               .bad = &bad};
    s = k->backward(op, &a);
    if (s == DLUA_OK && bad) {
      char b1[200];
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s hold a position outside the %" PRId64 " x %" PRId64 " input plane", op,
                   dlua_tensor_describe(indices, b1, sizeof b1), g->H, g->W);
    }
  }
  s = act_out_end(&ox, s);
  dlua_tensor_free(gs);
  dlua_tensor_free(is);
  return s;
}

/* ---- max pooling ---------------------------------------------------------------------------------- */

dlua_status_t dlua_nn_max_pool2d_forward(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *x,
                                         int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w,
                                         int dil_h, int dil_w, int ceil_mode) {
  const char *op = "max_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  dlua_pool_geom_t g = {.kind = DLUA_POOL_MAX};
  DLUA_TRY(pool_geometry(op, x->sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, ceil_mode, &g));
  return pool_forward(op, out, indices, x, &g);
}

dlua_status_t dlua_nn_max_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                          const dlua_tensor_t *indices, const int64_t *x_sizes) {
  const char *op = "max_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  char b1[200], b2[200];
  if (!indices || !indices->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: indices is NULL", op);
  DLUA_TRY(dlua_ops_check_peers(op, grad_output, &indices, 1));
  if (indices->dtype != DLUA_DTYPE_I64 && indices->dtype != DLUA_DTYPE_I32)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s must be int64 or int32", op, dlua_tensor_describe(indices, b1, sizeof b1));
  int same = indices->ndim == 4;
  for (int d = 0; same && d < 4; d++) same = indices->sizes[d] == grad_output->sizes[d];
  if (!same)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s and grad_output %s must have one shape", op,
                    dlua_tensor_describe(indices, b1, sizeof b1), dlua_tensor_describe(grad_output, b2, sizeof b2));
  if (grad_output->sizes[0] != x_sizes[0] || grad_output->sizes[1] != x_sizes[1])
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s does not match input sizes %s in N and C", op,
                    dlua_tensor_describe(grad_output, b1, sizeof b1), dlua_shape_str(4, x_sizes, b2, sizeof b2));
  dlua_pool_geom_t g = {.kind = DLUA_POOL_MAX, .N = x_sizes[0], .C = x_sizes[1], .H = x_sizes[2], .W = x_sizes[3],
                        .OH = grad_output->sizes[2], .OW = grad_output->sizes[3]};
  return pool_backward(op, grad_input, grad_output, indices, x_sizes, &g);
}

/* ---- average pooling ------------------------------------------------------------------------------ */

static dlua_status_t avg_setup(const char *op, const int64_t *xs, int kh, int kw, int sh, int sw, int ph, int pw,
                               int ceil_mode, int count_include_pad, int divisor_override, dlua_pool_geom_t *g) {
  if (divisor_override < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: divisor_override must be positive (or 0: none), got %d", op, divisor_override);
  *g = (dlua_pool_geom_t){.kind = DLUA_POOL_AVG};
  DLUA_TRY(pool_geometry(op, xs, kh, kw, sh, sw, ph, pw, 1, 1, ceil_mode, g));
  g->include_pad = count_include_pad;
  g->div_override = divisor_override;
  return DLUA_OK;
}

dlua_status_t dlua_nn_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int kernel_h, int kernel_w,
                                         int stride_h, int stride_w, int pad_h, int pad_w, int ceil_mode,
                                         int count_include_pad, int divisor_override) {
  const char *op = "avg_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  dlua_pool_geom_t g = {0};
  DLUA_TRY(avg_setup(op, x->sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, ceil_mode, count_include_pad,
                     divisor_override, &g));
  return pool_forward(op, out, NULL, x, &g);
}

dlua_status_t dlua_nn_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                          const int64_t *x_sizes, int kernel_h, int kernel_w, int stride_h,
                                          int stride_w, int pad_h, int pad_w, int ceil_mode, int count_include_pad,
                                          int divisor_override) {
  const char *op = "avg_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  dlua_pool_geom_t g = {0};
  DLUA_TRY(avg_setup(op, x_sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, ceil_mode, count_include_pad,
                     divisor_override, &g));
  DLUA_TRY(check_grad_shape(op, grad_output, &g));
  return pool_backward(op, grad_input, grad_output, NULL, x_sizes, &g);
}

/* ---- adaptive average pooling ----------------------------------------------------------------------- */

static dlua_status_t adaptive_setup(const char *op, const int64_t *xs, int64_t oh, int64_t ow, dlua_pool_geom_t *g) {
  char b[160];
  if (oh < 1 || ow < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: output size (%" PRId64 ", %" PRId64 ") must be positive", op, oh, ow);
  if (xs[2] < 1 || xs[3] < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: input %s must have a non-empty plane", op, dlua_shape_str(4, xs, b, sizeof b));
  *g = (dlua_pool_geom_t){.kind = DLUA_POOL_ADAPTIVE, .N = xs[0], .C = xs[1], .H = xs[2], .W = xs[3], .OH = oh, .OW = ow};
  return DLUA_OK;
}

dlua_status_t dlua_nn_adaptive_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int64_t out_h,
                                                  int64_t out_w) {
  const char *op = "adaptive_avg_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  dlua_pool_geom_t g = {0};
  DLUA_TRY(adaptive_setup(op, x->sizes, out_h, out_w, &g));
  return pool_forward(op, out, NULL, x, &g);
}

dlua_status_t dlua_nn_adaptive_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                                   const int64_t *x_sizes) {
  const char *op = "adaptive_avg_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  dlua_pool_geom_t g = {0};
  DLUA_TRY(adaptive_setup(op, x_sizes, grad_output->sizes[2], grad_output->sizes[3], &g));
  DLUA_TRY(check_grad_shape(op, grad_output, &g));
  return pool_backward(op, grad_input, grad_output, NULL, x_sizes, &g);
}

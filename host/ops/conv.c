/* The front doors of 2-D convolution (dlua.h: dlua_conv2d_forward, _backward_data, _backward_weights): argument
   checks, the output's shape and memory format, `out` and accumulation, the staging of each operand in the dtype
   and format the backend asks for (its conv table's `caps`, kernels/conv.h), fold-back of temporaries, the bias
   where the backend leaves it to us; then one call through the conv table of the tensors' device. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "kernels/conv.h"
#include "ops/backend.h"
#include "ops/common.h"

/* ---- geometry and memory formats ------------------------------------------------------------ */

typedef dlua_conv_geom_t geom_t; /* kernels/conv.h */

enum { DIR_FWD = 0, DIR_BWD_DATA = 1, DIR_BWD_WEIGHTS = 2 };

/* t as a tensor of dtype ct in NCHW or NHWC memory: a new handle on t when it already is one,
   otherwise a converted copy that keeps t's format (NCHW when t has neither). */
static dlua_status_t operand4(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_tensor_t **v) {
  int f = act_format(t);
  if (t->dtype == ct && f != FMT_OTHER) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  DLUA_TRY(act_alloc_on(v, 4, t->sizes, ct, f == FMT_OTHER ? FMT_NCHW : f, t->device));
  dlua_status_t s = dlua_tensor_copy_(*v, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*v);
    *v = NULL;
  }
  return s;
}

/* A 1-D operand (bias) as a dense vector of dtype ct. */
static dlua_status_t operand1(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_tensor_t **v) {
  if (t->dtype == ct && (t->sizes[0] <= 1 || t->strides[0] == 1)) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  return dlua_tensor_to_dtype(v, t, ct);
}

int64_t dlua_conv2d_output_size(int64_t in, int64_t kernel, int stride, int pad, int dil) {
  if (in < 0 || kernel < 1 || stride < 1 || pad < 0 || dil < 1) return -1;
  int64_t span = in + 2 * (int64_t)pad - (int64_t)dil * (kernel - 1) - 1;
  if (span < 0) return 0;
  return span / stride + 1;
}

static dlua_status_t check_params(const char *op, int sh, int sw, int ph, int pw, int dh, int dw, int groups) {
  if (sh < 1 || sw < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: stride (%d, %d) must be positive", op, sh, sw);
  if (ph < 0 || pw < 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: padding (%d, %d) must be non-negative", op, ph, pw);
  if (dh < 1 || dw < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: dilation (%d, %d) must be positive", op, dh, dw);
  if (groups < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: groups must be positive, got %d", op, groups);
  return DLUA_OK;
}

/* t must be a live floating-point tensor of ndim dimensions; `what` names it, `dims` spells its layout. The
   entry points check devices after. */
static dlua_status_t check_rank(const char *op, const char *what, const char *dims, const dlua_tensor_t *t, int ndim) {
  char b[200];
  DLUA_TRY(dlua_ops_check_input(op, t, NULL));  // "the tensor is NULL (freed, or never created)"
  if (t->ndim != ndim)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must have %d dimensions %s, got %s", op, what, ndim, dims,
                    dlua_tensor_describe(t, b, sizeof b));
  if (!dlua_dtype_is_floating(t->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be floating point, got %s", op, what, dlua_tensor_describe(t, b, sizeof b));
  return DLUA_OK;
}

/* Fills g from the input sizes xs (N, C, H, W) and the weight sizes ws (O, C/groups, kH, kW);
   xdesc/wdesc name them in errors. */
static dlua_status_t geometry(const char *op, const int64_t *xs, const char *xdesc, const int64_t *ws, const char *wdesc,
                              int sh, int sw, int ph, int pw, int dh, int dw, int groups, geom_t *g) {
  DLUA_TRY(check_params(op, sh, sw, ph, pw, dh, dw, groups));
  if (ws[2] < 1 || ws[3] < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: weight %s has an empty kernel", op, wdesc);
  if (ws[0] % groups != 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: weight %s has %" PRId64 " output channels, not divisible by groups = %d", op,
                    wdesc, ws[0], groups);
  if (xs[1] != ws[1] * groups)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: input %s has %" PRId64 " channels but weight %s expects %" PRId64 " (%" PRId64
                    " per group x groups = %d)",
                    op, xdesc, xs[1], wdesc, ws[1] * groups, ws[1], groups);
  *g = (geom_t){.n = xs[0], .c = xs[1], .h = xs[2], .w = xs[3], .o = ws[0], .kh = ws[2], .kw = ws[3],
                .sh = sh, .sw = sw, .ph = ph, .pw = pw, .dh = dh, .dw = dw, .g = groups};
  g->oh = dlua_conv2d_output_size(g->h, g->kh, sh, ph, dh);
  g->ow = dlua_conv2d_output_size(g->w, g->kw, sw, pw, dw);
  if (g->oh < 1 || g->ow < 1)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: input %s padded by (%d, %d) is smaller than weight %s's kernel dilated by (%d, %d): "
                    "output size would be (%" PRId64 ", %" PRId64 ")",
                    op, xdesc, ph, pw, wdesc, dh, dw, g->oh, g->ow);
  return DLUA_OK;
}

/* Checks that grad_y has the convolution's output shape. */
static dlua_status_t check_grad_y(const char *op, const dlua_tensor_t *gy, const geom_t *g) {
  int64_t ys[4] = {g->n, g->o, g->oh, g->ow};
  for (int d = 0; d < 4; d++)
    if (gy->sizes[d] != ys[d]) {
      char b1[200], b2[120];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s does not have the convolution's output shape %s", op,
                      dlua_tensor_describe(gy, b1, sizeof b1), dlua_shape_str(4, ys, b2, sizeof b2));
    }
  return DLUA_OK;
}

/* Folds a gradient computed into a temporary back into the caller's tensor. */
static dlua_status_t fold_back(dlua_tensor_t *dst, const dlua_tensor_t *tmp, int accumulate) {
  if (!accumulate) return dlua_tensor_copy_(dst, tmp);
  dlua_tensor_t *d = dst;
  return dlua_tensor_binary(&d, dst, tmp, DLUA_BINARY_ADD, 1.0);
}

/* The descriptor of geometry g in dtype dt: sizes and parameters; the caller sets operands. */
static dlua_conv_desc_t desc_of(const geom_t *g, int dt, int device, const char *ctx) {
  dlua_conv_desc_t d;
  memset(&d, 0, sizeof d);
  d.dtype = d.param_dtype = dt;
  d.n = g->n, d.c = g->c, d.h = g->h, d.w = g->w, d.o = g->o, d.kh = g->kh, d.kw = g->kw, d.oh = g->oh, d.ow = g->ow;
  d.sh = (int)g->sh, d.sw = (int)g->sw, d.ph = (int)g->ph, d.pw = (int)g->pw, d.dh = (int)g->dh, d.dw = (int)g->dw;
  d.groups = (int)g->g;
  d.device = device;
  d.ctx = ctx;
  return d;
}

/* Sets one 4-d operand of d: *p, strides st[4] and *fmt from t (NULL: none). */
static void set4(const dlua_tensor_t *t, void **p, int64_t *st, int *fmt) {
  *p = dlua_tensor_ptr(t);
  memcpy(st, t->strides, 4 * sizeof *st);
  *fmt = act_format(t);
}

static dlua_status_t caps_of(const struct dlua_conv_ops *k, const char *op, const geom_t *g, int dt, int device,
                             dlua_conv_caps_t *caps) {
  dlua_conv_desc_t d = desc_of(g, dt, device, NULL);
  return k->caps(op, &d, caps);
}

/* ---- one packed format (caps.one_format) ------------------------------------------------------------------------
   Each call computes in one format (its input's, as PyTorch does) and copies any operand that is not in it, 16-byte
   aligned (fresh buffers are 512-byte aligned; views of them usually are too). */

static int aligned16(const dlua_tensor_t *t) { return ((uintptr_t)dlua_tensor_ptr(t) & 15) == 0; }

/* t as an aligned fmt tensor of dtype dt: a new handle on t when it is one, else a converted copy. */
static dlua_status_t operand_packed(const dlua_tensor_t *t, dlua_dtype_t dt, int fmt, dlua_tensor_t **v) {
  if (t->dtype == dt && act_is_format(t, fmt) && aligned16(t)) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  DLUA_TRY(act_alloc_on(v, 4, t->sizes, dt, fmt, t->device));
  dlua_status_t s = dlua_tensor_copy_(*v, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*v);
    *v = NULL;
  }
  return s;
}

/* Where a result is computed: the caller's tensor when it has the dtype, format and alignment, else a temporary. */
static dlua_status_t target_packed(dlua_tensor_t *t, dlua_dtype_t dt, int fmt, dlua_tensor_t **v, int *direct) {
  *direct = t->dtype == dt && act_is_format(t, fmt) && aligned16(t);
  if (*direct) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  return act_alloc_on(v, 4, t->sizes, dt, fmt, t->device);
}

/* One direction computed in format cf, in the dtype of input a: res (the caller's tensor: y, grad_x or grad_w)
   receives it, added to what it holds when accumulate. Inputs: x and w (forward), grad_y and w (backward-data),
   x and grad_y (backward-weights). *unsupported: the backend has nothing in cf (res untouched). */
static dlua_status_t convolve(const struct dlua_conv_ops *k, const char *op, const char *ctx, int dir, int cf,
                              const geom_t *g, const dlua_tensor_t *a, const dlua_tensor_t *b, dlua_tensor_t *res,
                              int accumulate, int *unsupported) {
  const dlua_dtype_t dt = a->dtype;
  dlua_tensor_t *av = NULL, *bv = NULL, *rv = NULL;
  int direct = 0;
  *unsupported = 0;
  dlua_status_t s = target_packed(res, dt, cf, &rv, &direct);
  if (s == DLUA_OK) s = operand_packed(a, dt, cf, &av);
  if (s == DLUA_OK) s = operand_packed(b, dt, cf, &bv);
  if (s == DLUA_OK) {
    const dlua_tensor_t *x = dir == DIR_BWD_DATA ? rv : av;
    const dlua_tensor_t *w = dir == DIR_BWD_WEIGHTS ? rv : bv;
    const dlua_tensor_t *y = dir == DIR_FWD ? rv : dir == DIR_BWD_DATA ? av : bv;
    dlua_conv_desc_t d = desc_of(g, (int)dt, a->device, ctx);
    set4(x, &d.x, d.xs, &d.xfmt);
    set4(w, &d.wt, d.ws, &d.wfmt);
    set4(y, &d.y, d.ys, &d.yfmt);
    d.xfmt = d.wfmt = d.yfmt = cf;
    d.acc = direct && accumulate;
    s = dir == DIR_FWD ? k->forward(op, &d) : dir == DIR_BWD_DATA ? k->backward_data(op, &d) : k->backward_weights(op, &d);
    *unsupported = d.unsupported;
  }
  if (s == DLUA_OK && !*unsupported && !direct) s = fold_back(res, rv, accumulate);
  dlua_tensor_free(av);
  dlua_tensor_free(bv);
  dlua_tensor_free(rv);
  return s;
}

/* convolve in the operands' format, or in the other one where the backend has nothing for it (exact float32 in
   channels-last, say). float64 starts with NCHW: cuDNN's double kernels are NCHW ones (PyTorch never gives it
   channels-last doubles either). */
static dlua_status_t convolve_any(const struct dlua_conv_ops *k, const char *op, const char *ctx, int dir, int fmt,
                                  const geom_t *g, const dlua_tensor_t *a, const dlua_tensor_t *b, dlua_tensor_t *res,
                                  int accumulate) {
  int cf = a->dtype == DLUA_DTYPE_F64 ? FMT_NCHW : fmt, unsupported = 0;
  DLUA_TRY(convolve(k, op, ctx, dir, cf, g, a, b, res, accumulate, &unsupported));
  if (unsupported) {
    cf = cf == FMT_NHWC ? FMT_NCHW : FMT_NHWC;
    DLUA_TRY(convolve(k, op, ctx, dir, cf, g, a, b, res, accumulate, &unsupported));
  }
  if (unsupported)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cuDNN has no algorithm for this convolution (%s)", op, ctx);
  return DLUA_OK;
}

/* "input (8, 3, 224, 224) bfloat16 cuda:0, weight (...), stride (1, 1), padding (0, 0), dilation (1, 1), groups 1" */
static const char *context(char *buf, size_t n, const char *an, const dlua_tensor_t *a, const char *bn,
                           const dlua_tensor_t *b, const geom_t *g) {
  char da[200], db[200];
  snprintf(buf, n, "%s %s, %s %s, stride (%d, %d), padding (%d, %d), dilation (%d, %d), groups %d", an,
           dlua_tensor_describe(a, da, sizeof da), bn, dlua_tensor_describe(b, db, sizeof db), (int)g->sh, (int)g->sw,
           (int)g->ph, (int)g->pw, (int)g->dh, (int)g->dw, (int)g->g);
  return buf;
}

/* The format results are allocated in and computed in: the tensor's own, NCHW when it has neither. */
static int compute_format(const dlua_tensor_t *t) {
  int f = act_format(t);
  return f == FMT_OTHER ? FMT_NCHW : f;
}

static dlua_status_t check_same_dtype(const char *op, const dlua_tensor_t *a, const char *an, const dlua_tensor_t *b,
                                      const char *bn) {
  if (!b || a->dtype == b->dtype) return DLUA_OK;
  char b1[200], b2[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: mixed dtypes: %s %s and %s %s", op, an, dlua_tensor_describe(a, b1, sizeof b1), bn,
                  dlua_tensor_describe(b, b2, sizeof b2));
}

/* ---- front doors ------------------------------------------------------------------------------- */

/* The empty-weight-channel bias is only added where the output has elements: out += bias viewed as (1, O, 1, 1)
   (the element-wise kernels broadcast it in either format). */
static dlua_status_t add_bias(dlua_tensor_t **out, const dlua_tensor_t *bias) {
  dlua_tensor_t *b1 = NULL, *b2 = NULL, *b3 = NULL;
  dlua_status_t s = dlua_tensor_unsqueeze(&b1, bias, 0);
  if (s == DLUA_OK) s = dlua_tensor_unsqueeze(&b2, b1, 2);
  if (s == DLUA_OK) s = dlua_tensor_unsqueeze(&b3, b2, 3);
  if (s == DLUA_OK) s = dlua_tensor_binary(out, *out, b3, DLUA_BINARY_ADD, 1.0);
  dlua_tensor_free(b1);
  dlua_tensor_free(b2);
  dlua_tensor_free(b3);
  return s;
}

dlua_status_t dlua_conv2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *w,
                                  const dlua_tensor_t *bias, int stride_h, int stride_w, int pad_h, int pad_w,
                                  int dil_h, int dil_w, int groups) {
  const char *op = "conv2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (!x || !w) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL", op, x ? "weight" : "input");
  DLUA_TRY(check_rank(op, "input", "(N, C, H, W)", x, 4));
  DLUA_TRY(check_rank(op, "weight", "(O, C/groups, kH, kW)", w, 4));
  DLUA_TRY(dlua_ops_check_input(op, w, x));
  DLUA_TRY(check_same_dtype(op, x, "input", w, "weight"));
  char bx[200], bw[200];
  dlua_tensor_describe(x, bx, sizeof bx);
  dlua_tensor_describe(w, bw, sizeof bw);
  if (bias) {
    DLUA_TRY(check_rank(op, "bias", "(O)", bias, 1));
    DLUA_TRY(dlua_ops_check_input(op, bias, x));
    DLUA_TRY(check_same_dtype(op, x, "input", bias, "bias"));
    if (bias->sizes[0] != w->sizes[0]) {
      char bb[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: bias %s does not have one entry per output channel of weight %s", op,
                      dlua_tensor_describe(bias, bb, sizeof bb), bw);
    }
  }
  geom_t g;
  DLUA_TRY(geometry(op, x->sizes, bx, w->sizes, bw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, &g));
  const struct dlua_conv_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, conv, forward, &k));
  dlua_conv_caps_t caps;
  DLUA_TRY(caps_of(k, op, &g, (int)x->dtype, x->device, &caps));
  int64_t ys[4] = {g.n, g.o, g.oh, g.ow};
  int xf = act_format(x);
  int allocated = 0;
  if (!*out) {
    DLUA_TRY(act_alloc_on(out, 4, ys, x->dtype, xf == FMT_OTHER ? FMT_NCHW : xf, x->device));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out_on(op, out, 4, ys, x->dtype, x->device, NULL));
  }
  dlua_status_t s = DLUA_OK;
  if (caps.one_format) {
    if (dlua_shape_numel(4, ys) > 0) {
      if (!caps.empty && (g.c == 0 || g.h == 0 || g.w == 0)) {
        s = dlua_tensor_fill_(*out, 0.0);  // only padding under the kernel (or no input channel): the bias alone
      } else {
        char ctx[600];
        s = convolve_any(k, op, context(ctx, sizeof ctx, "input", x, "weight", w, &g), DIR_FWD, compute_format(x), &g,
                         x, w, *out, 0);
      }
      if (s == DLUA_OK && bias && !caps.bias) s = add_bias(out, bias);
    }
  } else {
    const dlua_dtype_t ct = (dlua_dtype_t)caps.dtype;
    dlua_tensor_t *xv = NULL, *wv = NULL, *bv = NULL, *yv = NULL;
    int of = act_format(*out);
    int direct = (*out)->dtype == ct && of != FMT_OTHER;
    s = operand4(x, ct, &xv);
    if (s == DLUA_OK) s = operand4(w, ct, &wv);
    if (s == DLUA_OK && bias) s = operand1(bias, (dlua_dtype_t)caps.param_dtype, &bv);  // a bf16 convolution takes an f32 bias
    if (s == DLUA_OK) {
      if (direct) {
        yv = dlua_tensor_alias(*out);
        if (!yv) s = dlua_last_status();
      } else {
        s = act_alloc_on(&yv, 4, ys, ct, of == FMT_OTHER ? (xf == FMT_OTHER ? FMT_NCHW : xf) : of, x->device);
      }
    }
    if (s == DLUA_OK && dlua_shape_numel(4, ys) > 0) {
      dlua_conv_desc_t d = desc_of(&g, (int)ct, x->device, NULL);
      d.param_dtype = caps.param_dtype;
      set4(xv, &d.x, d.xs, &d.xfmt);
      set4(wv, &d.wt, d.ws, &d.wfmt);
      set4(yv, &d.y, d.ys, &d.yfmt);
      if (bv) d.bias = dlua_tensor_ptr(bv), d.bs = bv->strides[0];
      s = k->forward(op, &d);
    }
    if (s == DLUA_OK && !direct) s = dlua_tensor_copy_(*out, yv);
    dlua_tensor_free(xv);
    dlua_tensor_free(wv);
    dlua_tensor_free(bv);
    dlua_tensor_free(yv);
    if (s == DLUA_OK && bias && !caps.bias && dlua_shape_numel(4, ys) > 0) s = add_bias(out, bias);
  }
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

dlua_status_t dlua_conv2d_backward_data(dlua_tensor_t **grad_x, const dlua_tensor_t *grad_y, const dlua_tensor_t *w,
                                        const int64_t *x_sizes, int stride_h, int stride_w, int pad_h, int pad_w,
                                        int dil_h, int dil_w, int groups, int accumulate) {
  const char *op = "conv2d_backward_data";
  if (!grad_x) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  if (accumulate && !*grad_x)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: accumulate needs a grad_input to add to, got none", op);
  if (!grad_y || !w || !x_sizes)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL", op, !grad_y ? "grad_output" : !w ? "weight" : "input size");
  DLUA_TRY(check_rank(op, "grad_output", "(N, O, OH, OW)", grad_y, 4));
  DLUA_TRY(check_rank(op, "weight", "(O, C/groups, kH, kW)", w, 4));
  DLUA_TRY(dlua_ops_check_input(op, w, grad_y));
  DLUA_TRY(check_same_dtype(op, grad_y, "grad_output", w, "weight"));
  char bx[200], bw[200];
  for (int d = 0; d < 4; d++)
    if (x_sizes[d] < 0)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: input size %s has a negative entry", op, dlua_shape_str(4, x_sizes, bx, sizeof bx));
  dlua_shape_str(4, x_sizes, bx, sizeof bx);
  dlua_tensor_describe(w, bw, sizeof bw);
  geom_t g;
  DLUA_TRY(geometry(op, x_sizes, bx, w->sizes, bw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, &g));
  DLUA_TRY(check_grad_y(op, grad_y, &g));
  const struct dlua_conv_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, grad_y->device, conv, backward_data, &k));
  dlua_conv_caps_t caps;
  DLUA_TRY(caps_of(k, op, &g, (int)grad_y->dtype, grad_y->device, &caps));
  accumulate = accumulate != 0;
  int yf = act_format(grad_y);
  int allocated = 0;
  if (!*grad_x) {
    DLUA_TRY(act_alloc_on(grad_x, 4, x_sizes, grad_y->dtype, yf == FMT_OTHER ? FMT_NCHW : yf, grad_y->device));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out_on(op, grad_x, 4, x_sizes, grad_y->dtype, grad_y->device, NULL));
  }
  dlua_status_t s = DLUA_OK;
  if (caps.one_format) {
    if (dlua_shape_numel(4, x_sizes) > 0) {
      if (!caps.empty && g.o == 0) {
        if (!accumulate) s = dlua_tensor_fill_(*grad_x, 0.0);  // no output channel: nothing flows back
      } else {
        char ctx[600];
        s = convolve_any(k, op, context(ctx, sizeof ctx, "grad_output", grad_y, "weight", w, &g), DIR_BWD_DATA,
                         compute_format(grad_y), &g, grad_y, w, *grad_x, accumulate);
      }
    }
  } else {
    const dlua_dtype_t ct = (dlua_dtype_t)caps.dtype;
    dlua_tensor_t *yv = NULL, *wv = NULL, *xv = NULL;
    int of = act_format(*grad_x);
    int direct = (*grad_x)->dtype == ct && of != FMT_OTHER;
    s = operand4(grad_y, ct, &yv);
    if (s == DLUA_OK) s = operand4(w, ct, &wv);
    dlua_conv_desc_t d = desc_of(&g, (int)ct, grad_y->device, NULL);
    d.param_dtype = caps.param_dtype;
    // Accumulating, only a kernel that adds in place keeps grad_input itself; otherwise the result goes to a
    // temporary that is then added.
    if (s == DLUA_OK && accumulate && direct) {
      int yes = 0;
      set4(yv, &d.y, d.ys, &d.yfmt);
      set4(wv, &d.wt, d.ws, &d.wfmt);
      set4(*grad_x, &d.x, d.xs, &d.xfmt);
      s = k->bwd_data_accumulates(op, &d, &yes);
      if (!yes) direct = 0;
    }
    if (s == DLUA_OK) {
      if (direct) {
        xv = dlua_tensor_alias(*grad_x);
        if (!xv) s = dlua_last_status();
      } else {
        s = act_alloc_on(&xv, 4, x_sizes, ct, of == FMT_OTHER ? (yf == FMT_OTHER ? FMT_NCHW : yf) : of, grad_y->device);
      }
    }
    if (s == DLUA_OK && dlua_shape_numel(4, x_sizes) > 0) {
      set4(yv, &d.y, d.ys, &d.yfmt);
      set4(wv, &d.wt, d.ws, &d.wfmt);
      set4(xv, &d.x, d.xs, &d.xfmt);
      d.acc = accumulate && direct;
      s = k->backward_data(op, &d);
    }
    if (s == DLUA_OK && !direct) s = fold_back(*grad_x, xv, accumulate);
    dlua_tensor_free(yv);
    dlua_tensor_free(wv);
    dlua_tensor_free(xv);
  }
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*grad_x);
    *grad_x = NULL;
  }
  return s;
}

/* grad_bias (+)= the sum of grad_y over (N, OH, OW): the reduction kernels (fixed order, double sums). */
static dlua_status_t bias_grad_by_sum(dlua_tensor_t *grad_bias, const dlua_tensor_t *grad_y, int accumulate) {
  static const int dims[3] = {0, 2, 3};
  if (!accumulate) return dlua_tensor_reduce(&grad_bias, NULL, grad_y, DLUA_REDUCE_SUM, 3, dims, 0, 0.0, 0);
  // Added to what grad_bias holds: the sum of a 16-bit grad_y is kept in float32 until that addition, so
  // the result is rounded once, as on the CPU (a float16 sum first would cost up to half its own ulp).
  dlua_tensor_t *sum = NULL, *wide = NULL;
  dlua_status_t s = DLUA_OK;
  const int narrow = grad_y->dtype == DLUA_DTYPE_F16 || grad_y->dtype == DLUA_DTYPE_BF16;
  if (narrow) s = dlua_tensor_to_dtype(&wide, grad_y, DLUA_DTYPE_F32);
  if (s == DLUA_OK) s = dlua_tensor_reduce(&sum, NULL, narrow ? wide : grad_y, DLUA_REDUCE_SUM, 3, dims, 0, 0.0, 0);
  if (s == DLUA_OK) s = fold_back(grad_bias, sum, 1);
  dlua_tensor_free(sum);
  dlua_tensor_free(wide);
  return s;
}

dlua_status_t dlua_conv2d_backward_weights(dlua_tensor_t *grad_w, dlua_tensor_t *grad_bias, const dlua_tensor_t *x,
                                           const dlua_tensor_t *grad_y, int stride_h, int stride_w, int pad_h,
                                           int pad_w, int dil_h, int dil_w, int groups, int accumulate) {
  const char *op = "conv2d_backward_weights";
  if (!grad_w || !x || !grad_y)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL", op, !grad_w ? "grad_weight" : !x ? "input" : "grad_output");
  DLUA_TRY(check_rank(op, "input", "(N, C, H, W)", x, 4));
  DLUA_TRY(check_rank(op, "grad_output", "(N, O, OH, OW)", grad_y, 4));
  DLUA_TRY(check_rank(op, "grad_weight", "(O, C/groups, kH, kW)", grad_w, 4));
  DLUA_TRY(dlua_ops_check_input(op, grad_y, x));
  DLUA_TRY(dlua_ops_check_input(op, grad_w, x));
  DLUA_TRY(check_same_dtype(op, x, "input", grad_y, "grad_output"));
  char bx[200], bw[200];
  dlua_tensor_describe(x, bx, sizeof bx);
  dlua_tensor_describe(grad_w, bw, sizeof bw);
  if (grad_bias) {
    DLUA_TRY(check_rank(op, "grad_bias", "(O)", grad_bias, 1));
    DLUA_TRY(dlua_ops_check_input(op, grad_bias, x));
    if (grad_bias->sizes[0] != grad_w->sizes[0]) {
      char bb[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_bias %s does not have one entry per output channel of grad_weight %s",
                      op, dlua_tensor_describe(grad_bias, bb, sizeof bb), bw);
    }
  }
  geom_t g;
  DLUA_TRY(geometry(op, x->sizes, bx, grad_w->sizes, bw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, &g));
  DLUA_TRY(check_grad_y(op, grad_y, &g));
  const struct dlua_conv_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, conv, backward_weights, &k));
  dlua_conv_caps_t caps;
  DLUA_TRY(caps_of(k, op, &g, (int)x->dtype, x->device, &caps));
  accumulate = accumulate != 0;
  dlua_status_t s = DLUA_OK;
  if (caps.one_format) {
    if (dlua_tensor_numel(grad_w) > 0) {
      if (!caps.empty && (g.n == 0 || g.h == 0 || g.w == 0)) {
        if (!accumulate) s = dlua_tensor_fill_(grad_w, 0.0);  // no input under any kernel position: zero
      } else {
        // grad_w may have another dtype (a float32 gradient arena behind 16-bit activations) or format (OIHW
        // weights behind NHWC activations): convolve then computes into a temporary and adds (or copies) it in.
        char ctx[600];
        s = convolve_any(k, op, context(ctx, sizeof ctx, "input", x, "grad_output", grad_y, &g), DIR_BWD_WEIGHTS,
                         compute_format(x), &g, x, grad_y, grad_w, accumulate);
      }
    }
    if (s == DLUA_OK && grad_bias && !caps.bias && dlua_tensor_numel(grad_bias) > 0)
      s = bias_grad_by_sum(grad_bias, grad_y, accumulate);
    return s;
  }
  const dlua_dtype_t ct = (dlua_dtype_t)caps.dtype;

  // The gradients land in the caller's tensors when they have the compute dtype and a layout
  // the kernels take; otherwise in fresh temporaries that are then added (or copied) in.
  const dlua_dtype_t gct = (dlua_dtype_t)caps.param_dtype;
  int wf = act_format(grad_w);
  int w_direct = grad_w->dtype == gct && wf != FMT_OTHER;
  int b_direct = grad_bias && grad_bias->dtype == gct && (grad_bias->sizes[0] <= 1 || grad_bias->strides[0] == 1);
  dlua_tensor_t *xv = NULL, *yv = NULL, *gwv = NULL, *gbv = NULL;
  s = operand4(x, ct, &xv);
  if (s == DLUA_OK) s = operand4(grad_y, ct, &yv);
  if (s == DLUA_OK) {
    if (w_direct) {
      gwv = dlua_tensor_alias(grad_w);
      if (!gwv) s = dlua_last_status();
    } else {
      s = act_alloc_on(&gwv, 4, grad_w->sizes, gct, wf == FMT_OTHER ? FMT_NCHW : wf, x->device);
    }
  }
  if (s == DLUA_OK && grad_bias) {
    if (b_direct) {
      gbv = dlua_tensor_alias(grad_bias);
      if (!gbv) s = dlua_last_status();
    } else {
      s = dlua_tensor_empty(&gbv, 1, grad_bias->sizes, gct, x->device);
    }
  }
  if (s == DLUA_OK && dlua_tensor_numel(gwv) + (gbv ? dlua_tensor_numel(gbv) : 0) > 0) {
    dlua_conv_desc_t d = desc_of(&g, (int)ct, x->device, NULL);
    d.param_dtype = (int)gct;
    set4(xv, &d.x, d.xs, &d.xfmt);
    set4(yv, &d.y, d.ys, &d.yfmt);
    set4(gwv, &d.wt, d.ws, &d.wfmt);
    if (gbv) d.bias = dlua_tensor_ptr(gbv), d.bs = gbv->strides[0];
    d.acc = w_direct && accumulate;
    d.acc_bias = b_direct && accumulate;
    s = k->backward_weights(op, &d);
  }
  if (s == DLUA_OK && !w_direct) s = fold_back(grad_w, gwv, accumulate);
  if (s == DLUA_OK && grad_bias && !b_direct) s = fold_back(grad_bias, gbv, accumulate);
  dlua_tensor_free(xv);
  dlua_tensor_free(yv);
  dlua_tensor_free(gwv);
  dlua_tensor_free(gbv);
  return s;
}

/* 2-D convolution on the CPU, forward and backward: oneDNN for float32 and bfloat16 (float16 via float32), direct loops for float64. */
#include <inttypes.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "cpu/conv.h"
#include "cpu/conv_impl.h"
#ifdef DLUA_HAVE_CUDA
#include "cuda/conv_cuda.h" /* plain C: the cuDNN side of the entry points below */
#endif

/* ---- geometry and memory formats ------------------------------------------------------------ */

/* t as a tensor of dtype ct in NCHW or NHWC memory: a new handle on t when it already is one,
   otherwise a converted copy that keeps t's format (NCHW when t has neither). */
static dlua_status_t operand4(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_tensor_t **v) {
  int f = act_format(t);
  if (t->dtype == ct && f != FMT_OTHER) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  DLUA_TRY(act_alloc(v, 4, t->sizes, ct, f == FMT_OTHER ? FMT_NCHW : f));
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
   entry points check devices (same_device) and send CUDA calls to host/cuda/conv_cudnn.c. */
static dlua_status_t check_rank(const char *op, const char *what, const char *dims, const dlua_tensor_t *t, int ndim) {
  char b[200];
  if (!t->storage) return dlua_require_cpu(op, t);  // "the tensor is NULL (freed, or never created)"
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

/* Empty dimensions have nothing for oneDNN to do and some of its kernels reject them: those
   problems (and float64) take the direct loops. */
static dlua_dtype_t compute_dtype(dlua_dtype_t dt, const geom_t *g) {
  if (dt == DLUA_DTYPE_F64 || g->n == 0 || g->c == 0 || g->h == 0 || g->w == 0 || g->o == 0) return DLUA_DTYPE_F64;
  return dt == DLUA_DTYPE_BF16 ? DLUA_DTYPE_BF16 : DLUA_DTYPE_F32;
}

/* The dtype oneDNN writes weight and bias gradients in: float32 for bfloat16 convolutions too, so they
   land in the float32 gradient arena without a pass of their own. */
static dlua_dtype_t grad_param_dtype(dlua_dtype_t ct) { return ct == DLUA_DTYPE_BF16 ? DLUA_DTYPE_F32 : ct; }

/* ---- direct float64 loops (any strides) ----------------------------------------------------- */

/* Output positions [*lo, *hi) along one dim whose input position q * stride + off lies in [0, in). */
static void span(int64_t off, int64_t stride, int64_t in, int64_t out, int64_t *lo, int64_t *hi) {
  int64_t l = off >= 0 ? 0 : (-off + stride - 1) / stride;
  int64_t h = in - 1 - off < 0 ? 0 : (in - 1 - off) / stride + 1;
  if (h > out) h = out;
  if (l > h) l = h;
  *lo = l;
  *hi = h;
}

/* Multiply-adds of one direction: below PAR_MIN_MACS a parallel region costs more than it saves. */
enum { PAR_MIN_MACS = 1 << 16 };
static int64_t macs(const geom_t *g) { return g->n * g->o * g->oh * g->ow * (g->c / g->g) * g->kh * g->kw; }

/* Each output element sums its terms in one fixed order (channel, kernel row, kernel column),
   so the result does not depend on the thread count. */
static void ref_forward(const geom_t *g, const double *x, const int64_t *xs, const double *w, const int64_t *ws,
                        const double *b, int64_t bs, double *y, const int64_t *ys) {
  int64_t cg = g->c / g->g, og = g->o / g->g;
  int par = macs(g) > PAR_MIN_MACS;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t o = 0; o < g->o; o++) {
      double *yp = y + n * ys[0] + o * ys[1];
      double b0 = b ? b[o * bs] : 0.0;
      for (int64_t oh = 0; oh < g->oh; oh++)
        for (int64_t ow = 0; ow < g->ow; ow++) yp[oh * ys[2] + ow * ys[3]] = b0;
      const double *xg = x + n * xs[0] + (o / og) * cg * xs[1];
      for (int64_t c = 0; c < cg; c++)
        for (int64_t i = 0; i < g->kh; i++) {
          int64_t oh0, oh1;
          span(i * g->dh - g->ph, g->sh, g->h, g->oh, &oh0, &oh1);
          for (int64_t j = 0; j < g->kw; j++) {
            double wv = w[o * ws[0] + c * ws[1] + i * ws[2] + j * ws[3]];
            int64_t ow0, ow1;
            span(j * g->dw - g->pw, g->sw, g->w, g->ow, &ow0, &ow1);
            for (int64_t oh = oh0; oh < oh1; oh++) {
              const double *xr = xg + c * xs[1] + (oh * g->sh + i * g->dh - g->ph) * xs[2];
              double *yr = yp + oh * ys[2];
              for (int64_t ow = ow0; ow < ow1; ow++) yr[ow * ys[3]] += wv * xr[(ow * g->sw + j * g->dw - g->pw) * xs[3]];
            }
          }
        }
    }
}

/* One thread owns each (n, c) plane of grad_x, so the scatter needs no atomics. */
static void ref_backward_data(const geom_t *g, const double *gy, const int64_t *gys, const double *w, const int64_t *ws,
                              double *gx, const int64_t *gxs) {
  int64_t cg = g->c / g->g, og = g->o / g->g;
  int par = macs(g) > PAR_MIN_MACS;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t c = 0; c < g->c; c++) {
      double *xp = gx + n * gxs[0] + c * gxs[1];
      for (int64_t h = 0; h < g->h; h++)
        for (int64_t q = 0; q < g->w; q++) xp[h * gxs[2] + q * gxs[3]] = 0.0;
      int64_t grp = c / cg, cc = c % cg;
      for (int64_t o = grp * og; o < (grp + 1) * og; o++) {
        const double *yp = gy + n * gys[0] + o * gys[1];
        for (int64_t i = 0; i < g->kh; i++) {
          int64_t oh0, oh1;
          span(i * g->dh - g->ph, g->sh, g->h, g->oh, &oh0, &oh1);
          for (int64_t j = 0; j < g->kw; j++) {
            double wv = w[o * ws[0] + cc * ws[1] + i * ws[2] + j * ws[3]];
            int64_t ow0, ow1;
            span(j * g->dw - g->pw, g->sw, g->w, g->ow, &ow0, &ow1);
            for (int64_t oh = oh0; oh < oh1; oh++) {
              double *xr = xp + (oh * g->sh + i * g->dh - g->ph) * gxs[2];
              const double *yr = yp + oh * gys[2];
              for (int64_t ow = ow0; ow < ow1; ow++) xr[(ow * g->sw + j * g->dw - g->pw) * gxs[3]] += wv * yr[ow * gys[3]];
            }
          }
        }
      }
    }
}

/* grad_w (and grad_b, may be NULL) = the sums, added to what they hold when acc_w / acc_b;
   one thread per weight row. */
static void ref_backward_weights(const geom_t *g, const double *x, const int64_t *xs, const double *gy,
                                 const int64_t *gys, double *gw, const int64_t *gws, double *gb, int64_t gbs,
                                 int acc_w, int acc_b) {
  int64_t cg = g->c / g->g, og = g->o / g->g;
  int par = macs(g) > PAR_MIN_MACS;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t o = 0; o < g->o; o++)
    for (int64_t cc = 0; cc < cg; cc++) {
      int64_t c = (o / og) * cg + cc;
      for (int64_t i = 0; i < g->kh; i++) {
        int64_t oh0, oh1;
        span(i * g->dh - g->ph, g->sh, g->h, g->oh, &oh0, &oh1);
        for (int64_t j = 0; j < g->kw; j++) {
          int64_t ow0, ow1;
          span(j * g->dw - g->pw, g->sw, g->w, g->ow, &ow0, &ow1);
          double acc = 0.0;
          for (int64_t n = 0; n < g->n; n++)
            for (int64_t oh = oh0; oh < oh1; oh++) {
              const double *xr = x + n * xs[0] + c * xs[1] + (oh * g->sh + i * g->dh - g->ph) * xs[2];
              const double *yr = gy + n * gys[0] + o * gys[1] + oh * gys[2];
              for (int64_t ow = ow0; ow < ow1; ow++) acc += xr[(ow * g->sw + j * g->dw - g->pw) * xs[3]] * yr[ow * gys[3]];
            }
          double *p = gw + o * gws[0] + cc * gws[1] + i * gws[2] + j * gws[3];
          *p = (acc_w ? *p : 0.0) + acc;
        }
      }
    }
  if (!gb) return;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t o = 0; o < g->o; o++) {
    double acc = 0.0;
    for (int64_t n = 0; n < g->n; n++)
      for (int64_t oh = 0; oh < g->oh; oh++)
        for (int64_t ow = 0; ow < g->ow; ow++) acc += gy[n * gys[0] + o * gys[1] + oh * gys[2] + ow * gys[3]];
    double *p = gb + o * gbs;
    *p = (acc_b ? *p : 0.0) + acc;
  }
}

/* ---- public entry points --------------------------------------------------------------------- */

static dlua_status_t check_same_dtype(const char *op, const dlua_tensor_t *a, const char *an, const dlua_tensor_t *b,
                                      const char *bn) {
  if (!b || a->dtype == b->dtype) return DLUA_OK;
  char b1[200], b2[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: mixed dtypes: %s %s and %s %s", op, an, dlua_tensor_describe(a, b1, sizeof b1), bn,
                  dlua_tensor_describe(b, b2, sizeof b2));
}

dlua_status_t dlua_conv2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *w,
                                  const dlua_tensor_t *bias, int stride_h, int stride_w, int pad_h, int pad_w,
                                  int dil_h, int dil_w, int groups) {
  const char *op = "conv2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (!x || !w) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL", op, x ? "weight" : "input");
  DLUA_TRY(check_rank(op, "input", "(N, C, H, W)", x, 4));
  DLUA_TRY(check_rank(op, "weight", "(O, C/groups, kH, kW)", w, 4));
  DLUA_TRY(dlua_same_device(op, x, w));
  DLUA_TRY(check_same_dtype(op, x, "input", w, "weight"));
  char bx[200], bw[200];
  dlua_tensor_describe(x, bx, sizeof bx);
  dlua_tensor_describe(w, bw, sizeof bw);
  if (bias) {
    DLUA_TRY(check_rank(op, "bias", "(O)", bias, 1));
    DLUA_TRY(dlua_same_device(op, x, bias));
    DLUA_TRY(check_same_dtype(op, x, "input", bias, "bias"));
    if (bias->sizes[0] != w->sizes[0]) {
      char bb[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: bias %s does not have one entry per output channel of weight %s", op,
                      dlua_tensor_describe(bias, bb, sizeof bb), bw);
    }
  }
  geom_t g;
  DLUA_TRY(geometry(op, x->sizes, bx, w->sizes, bw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, &g));
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return dlua_cuda_conv2d_forward(out, x, w, bias, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups);
#else
    return dlua_require_cpu(op, x);
#endif
  }
  int64_t ys[4] = {g.n, g.o, g.oh, g.ow};
  int xf = act_format(x);
  int allocated = 0;
  if (!*out) {
    DLUA_TRY(act_alloc(out, 4, ys, x->dtype, xf == FMT_OTHER ? FMT_NCHW : xf));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out(op, out, 4, ys, x->dtype, NULL));
  }
  dlua_dtype_t ct = compute_dtype(x->dtype, &g);
  dlua_tensor_t *xv = NULL, *wv = NULL, *bv = NULL, *yv = NULL;
  int of = act_format(*out);
  int direct = (*out)->dtype == ct && of != FMT_OTHER;
  dlua_status_t s = operand4(x, ct, &xv);
  if (s == DLUA_OK) s = operand4(w, ct, &wv);
  if (s == DLUA_OK && bias) s = operand1(bias, grad_param_dtype(ct), &bv);  // a bf16 convolution takes an f32 bias
  if (s == DLUA_OK) {
    if (direct) {
      yv = dlua_tensor_alias(*out);
      if (!yv) s = dlua_last_status();
    } else {
      s = act_alloc(&yv, 4, ys, ct, of == FMT_OTHER ? (xf == FMT_OTHER ? FMT_NCHW : xf) : of);
    }
  }
  if (s == DLUA_OK && dlua_shape_numel(4, ys) > 0) {
    if (ct == DLUA_DTYPE_F64) {
      ref_forward(&g, (const double *)dlua_tensor_ptr(xv), xv->strides, (const double *)dlua_tensor_ptr(wv), wv->strides,
                  bv ? (const double *)dlua_tensor_ptr(bv) : NULL, bv ? bv->strides[0] : 0, (double *)dlua_tensor_ptr(yv),
                  yv->strides);
    } else {
      conv_key_t k = dlua_conv_dnnl_key(DIR_FWD, &g, act_format(xv), act_format(yv), act_format(wv), bv != NULL);
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[4] = {dlua_tensor_ptr(xv), dlua_tensor_ptr(wv), dlua_tensor_ptr(yv), bv ? dlua_tensor_ptr(bv) : NULL};
      s = dlua_conv_dnnl_run(op, &k, ptrs);
    }
  }
  if (s == DLUA_OK && !direct) s = dlua_tensor_copy_(*out, yv);
  dlua_tensor_free(xv);
  dlua_tensor_free(wv);
  dlua_tensor_free(bv);
  dlua_tensor_free(yv);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

/* With stride 1, no dilation and one group, the input gradient is a forward convolution of the
   output gradient with the weights' channels swapped and kernels turned 180 degrees, padded by
   k - 1 - pad. oneDNN 2.6's forward kernels for channels-last activations (brgconv) are faster than
   its backward-data ones: measured at ResNet-20's shapes on AVX-512, 1 thread, batch 64: 2.1 vs 2.5 ms
   (32 channels, 14x14) and 1.7 vs 2.2 ms (64 channels, 7x7). Channels-last only, where it was measured. */
static int bwd_data_as_forward(const geom_t *g, const dlua_tensor_t *gy, const dlua_tensor_t *gx) {
  return g->sh == 1 && g->sw == 1 && g->dh == 1 && g->dw == 1 && g->g == 1 && g->ph <= g->kh - 1 &&
         g->pw <= g->kw - 1 && act_format(gy) == FMT_NHWC && act_format(gx) == FMT_NHWC &&
         (gy->dtype == DLUA_DTYPE_F32 || gy->dtype == DLUA_DTYPE_BF16);
}

static dlua_status_t backward_data_by_forward(const char *op, const geom_t *g, const dlua_tensor_t *gy,
                                              const dlua_tensor_t *w, dlua_tensor_t *gx, int accumulate) {
  int64_t ts[4] = {g->c, g->o, g->kh, g->kw};
  dlua_tensor_t *wt = NULL;
  const int lowp = w->dtype == DLUA_DTYPE_BF16;
  DLUA_TRY(dlua_tensor_empty(&wt, 4, ts, w->dtype, DLUA_CPU));
  const size_t es = lowp ? 2 : 4;  // bytes per element: the weights are only moved, never computed on
  const char *src = dlua_tensor_ptr(w);
  char *dst = dlua_tensor_ptr(wt);
  const int64_t *ws = w->strides;  // elements
  for (int64_t c = 0; c < g->c; c++)
    for (int64_t o = 0; o < g->o; o++)
      for (int64_t i = 0; i < g->kh; i++)
        for (int64_t j = 0; j < g->kw; j++)
          memcpy(dst + (((c * g->o + o) * g->kh + i) * g->kw + j) * es,
                 src + (o * ws[0] + c * ws[1] + (g->kh - 1 - i) * ws[2] + (g->kw - 1 - j) * ws[3]) * es, es);
  geom_t f = {.n = g->n, .c = g->o, .h = g->oh, .w = g->ow, .o = g->c, .kh = g->kh, .kw = g->kw, .sh = 1, .sw = 1,
              .ph = g->kh - 1 - g->ph, .pw = g->kw - 1 - g->pw, .dh = 1, .dw = 1, .g = 1, .oh = g->h, .ow = g->w};
  conv_key_t k = dlua_conv_dnnl_key(DIR_FWD, &f, FMT_NHWC, FMT_NHWC, FMT_NCHW, 0);
  k.acc_y = accumulate != 0;
  k.lowp = lowp;
  void *ptrs[4] = {dlua_tensor_ptr(gy), dlua_tensor_ptr(wt), dlua_tensor_ptr(gx), NULL};
  dlua_status_t s = dlua_conv_dnnl_run(op, &k, ptrs);
  dlua_tensor_free(wt);
  return s;
}

/* Folds a gradient computed into a temporary back into the caller's tensor. */
static dlua_status_t fold_back(dlua_tensor_t *dst, const dlua_tensor_t *tmp, int accumulate) {
  if (!accumulate) return dlua_tensor_copy_(dst, tmp);
  dlua_tensor_t *d = dst;
  return dlua_tensor_binary(&d, dst, tmp, DLUA_BINARY_ADD, 1.0);
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
  DLUA_TRY(dlua_same_device(op, grad_y, w));
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
  if (grad_y->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return dlua_cuda_conv2d_backward_data(grad_x, grad_y, w, x_sizes, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                                          groups, accumulate);
#else
    return dlua_require_cpu(op, grad_y);
#endif
  }
  int yf = act_format(grad_y);
  int allocated = 0;
  if (!*grad_x) {
    DLUA_TRY(act_alloc(grad_x, 4, x_sizes, grad_y->dtype, yf == FMT_OTHER ? FMT_NCHW : yf));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out(op, grad_x, 4, x_sizes, grad_y->dtype, NULL));
  }
  dlua_dtype_t ct = compute_dtype(grad_y->dtype, &g);
  dlua_tensor_t *yv = NULL, *wv = NULL, *xv = NULL;
  int of = act_format(*grad_x);
  int direct = (*grad_x)->dtype == ct && of != FMT_OTHER;
  dlua_status_t s = operand4(grad_y, ct, &yv);
  if (s == DLUA_OK) s = operand4(w, ct, &wv);
  // Accumulating, only the forward-convolution route adds in place (a sum post-op); the others
  // compute into a temporary and add it.
  if (s == DLUA_OK && accumulate && !(direct && ct != DLUA_DTYPE_F64 && bwd_data_as_forward(&g, yv, *grad_x)))
    direct = 0;
  if (s == DLUA_OK) {
    if (direct) {
      xv = dlua_tensor_alias(*grad_x);
      if (!xv) s = dlua_last_status();
    } else {
      s = act_alloc(&xv, 4, x_sizes, ct, of == FMT_OTHER ? (yf == FMT_OTHER ? FMT_NCHW : yf) : of);
    }
  }
  if (s == DLUA_OK && dlua_shape_numel(4, x_sizes) > 0) {
    if (ct == DLUA_DTYPE_F64) {
      ref_backward_data(&g, (const double *)dlua_tensor_ptr(yv), yv->strides, (const double *)dlua_tensor_ptr(wv),
                        wv->strides, (double *)dlua_tensor_ptr(xv), xv->strides);
    } else if (bwd_data_as_forward(&g, yv, xv)) {
      s = backward_data_by_forward(op, &g, yv, wv, xv, accumulate && direct);
    } else {
      conv_key_t k = dlua_conv_dnnl_key(DIR_BWD_DATA, &g, act_format(xv), act_format(yv), act_format(wv), 0);
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[3] = {dlua_tensor_ptr(yv), dlua_tensor_ptr(wv), dlua_tensor_ptr(xv)};
      s = dlua_conv_dnnl_run(op, &k, ptrs);
    }
  }
  if (s == DLUA_OK && !direct) s = fold_back(*grad_x, xv, accumulate);
  dlua_tensor_free(yv);
  dlua_tensor_free(wv);
  dlua_tensor_free(xv);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*grad_x);
    *grad_x = NULL;
  }
  return s;
}

/* oneDNN 2.6's 1x1 weight gradient on strided channels-last input (jit_1x1, which first gathers the
   strided pixels into its own "reduce to unit stride" buffer) is wrong when the input channels per
   group do not fill its channel block: relative errors 0.2-1.2 measured here at 2 threads and odd
   batch with 1-12 channels (oneDNN issue #6035: that buffer is overrun when IC < ic_block). So those
   pixels are gathered here, zeros where the padding is, and the stride-1 unpadded 1x1 convolution of
   the gathered input gives the same gradient. Only the affected case: other channel counts keep
   oneDNN's own path (ResNets' 16/32/64/256... channels). */
static int bwd_weights_gather(const geom_t *g, const dlua_tensor_t *x) {
  return g->kh == 1 && g->kw == 1 && (g->sh > 1 || g->sw > 1) && (g->c / g->g) % 16 != 0 && act_format(x) == FMT_NHWC;
}

/* x (N, C, H, W) channels-last float32 or bfloat16 -> *out (N, C, OH, OW) channels-last, x's dtype: the
   pixels a 1x1 convolution of geometry g reads; *f: the stride-1 unpadded geometry over them. */
static dlua_status_t gather_strided(const geom_t *g, const dlua_tensor_t *x, dlua_tensor_t **out, geom_t *f) {
  int64_t sizes[4] = {g->n, g->c, g->oh, g->ow};
  DLUA_TRY(act_alloc(out, 4, sizes, x->dtype, FMT_NHWC));
  const size_t es = dlua_dtype_size(x->dtype);  // the pixels are only moved
  const char *src = dlua_tensor_ptr(x);
  char *dst = dlua_tensor_ptr(*out);
  const int64_t *xs = x->strides;  // elements; xs[1] == 1
  int64_t c = g->c;
  int par = g->n * g->oh * g->ow * c > 32768;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t i = 0; i < g->oh; i++) {
      int64_t ih = i * g->sh - g->ph;
      char *row = dst + (n * g->oh + i) * g->ow * c * (int64_t)es;
      for (int64_t j = 0; j < g->ow; j++) {
        int64_t iw = j * g->sw - g->pw;
        if (ih < 0 || ih >= g->h || iw < 0 || iw >= g->w)
          memset(row + j * c * (int64_t)es, 0, (size_t)c * es);  // +0.0 in float32 and bfloat16
        else
          memcpy(row + j * c * (int64_t)es, src + (n * xs[0] + ih * xs[2] + iw * xs[3]) * (int64_t)es, (size_t)c * es);
      }
    }
  *f = *g;
  f->h = g->oh;
  f->w = g->ow;
  f->sh = f->sw = 1;
  f->ph = f->pw = 0;
  return DLUA_OK;
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
  DLUA_TRY(dlua_same_device(op, x, grad_y));
  DLUA_TRY(dlua_same_device(op, x, grad_w));
  DLUA_TRY(check_same_dtype(op, x, "input", grad_y, "grad_output"));
  char bx[200], bw[200];
  dlua_tensor_describe(x, bx, sizeof bx);
  dlua_tensor_describe(grad_w, bw, sizeof bw);
  if (grad_bias) {
    DLUA_TRY(check_rank(op, "grad_bias", "(O)", grad_bias, 1));
    DLUA_TRY(dlua_same_device(op, x, grad_bias));
    if (grad_bias->sizes[0] != grad_w->sizes[0]) {
      char bb[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_bias %s does not have one entry per output channel of grad_weight %s",
                      op, dlua_tensor_describe(grad_bias, bb, sizeof bb), bw);
    }
  }
  geom_t g;
  DLUA_TRY(geometry(op, x->sizes, bx, grad_w->sizes, bw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, &g));
  DLUA_TRY(check_grad_y(op, grad_y, &g));
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return dlua_cuda_conv2d_backward_weights(grad_w, grad_bias, x, grad_y, stride_h, stride_w, pad_h, pad_w, dil_h,
                                             dil_w, groups, accumulate);
#else
    return dlua_require_cpu(op, x);
#endif
  }
  dlua_dtype_t ct = compute_dtype(x->dtype, &g);
  accumulate = accumulate != 0;

  // The gradients land in the caller's tensors when they have the compute dtype and a layout
  // the kernels take; otherwise in fresh temporaries that are then added (or copied) in.
  const dlua_dtype_t gct = grad_param_dtype(ct);
  int wf = act_format(grad_w);
  int w_direct = grad_w->dtype == gct && wf != FMT_OTHER;
  int b_direct = grad_bias && grad_bias->dtype == gct && (grad_bias->sizes[0] <= 1 || grad_bias->strides[0] == 1);
  dlua_tensor_t *xv = NULL, *yv = NULL, *gwv = NULL, *gbv = NULL;
  dlua_status_t s = operand4(x, ct, &xv);
  if (s == DLUA_OK) s = operand4(grad_y, ct, &yv);
  if (s == DLUA_OK) {
    if (w_direct) {
      gwv = dlua_tensor_alias(grad_w);
      if (!gwv) s = dlua_last_status();
    } else {
      s = act_alloc(&gwv, 4, grad_w->sizes, gct, wf == FMT_OTHER ? FMT_NCHW : wf);
    }
  }
  if (s == DLUA_OK && grad_bias) {
    if (b_direct) {
      gbv = dlua_tensor_alias(grad_bias);
      if (!gbv) s = dlua_last_status();
    } else {
      s = dlua_tensor_empty(&gbv, 1, grad_bias->sizes, gct, DLUA_CPU);
    }
  }
  if (s == DLUA_OK && dlua_tensor_numel(gwv) + (gbv ? dlua_tensor_numel(gbv) : 0) > 0) {
    if (ct == DLUA_DTYPE_F64) {
      ref_backward_weights(&g, (const double *)dlua_tensor_ptr(xv), xv->strides, (const double *)dlua_tensor_ptr(yv),
                           yv->strides, (double *)dlua_tensor_ptr(gwv), gwv->strides,
                           gbv ? (double *)dlua_tensor_ptr(gbv) : NULL, gbv ? gbv->strides[0] : 0,
                           w_direct && accumulate, b_direct && accumulate);
    } else {
      geom_t f = g;
      dlua_tensor_t *xg = NULL;
      if (bwd_weights_gather(&g, xv)) s = gather_strided(&g, xv, &xg, &f);
      const dlua_tensor_t *xin = xg ? xg : xv;
      conv_key_t k = dlua_conv_dnnl_key(DIR_BWD_WEIGHTS, &f, act_format(xin), act_format(yv), act_format(gwv), gbv != NULL);
      k.acc_w = w_direct && accumulate;
      k.acc_b = b_direct && accumulate;
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[4] = {dlua_tensor_ptr(xin), dlua_tensor_ptr(yv), dlua_tensor_ptr(gwv), gbv ? dlua_tensor_ptr(gbv) : NULL};
      if (s == DLUA_OK) s = dlua_conv_dnnl_run(op, &k, ptrs);
      dlua_tensor_free(xg);
    }
  }
  if (s == DLUA_OK && !w_direct) s = fold_back(grad_w, gwv, accumulate);
  if (s == DLUA_OK && grad_bias && !b_direct) s = fold_back(grad_bias, gbv, accumulate);
  dlua_tensor_free(xv);
  dlua_tensor_free(yv);
  dlua_tensor_free(gwv);
  dlua_tensor_free(gbv);
  return s;
}

/* 2-D convolution on the CPU, forward and backward, the conv table's kernels (kernels/conv.h): oneDNN for float32
   and bfloat16 (float16 via float32), direct loops for float64. host/ops/conv.c stages the operands. */
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
#include "kernels/conv.h"
#include "cpu/conv.h"
#include "cpu/conv_impl.h"

/* The geometry of a descriptor. */
static geom_t geom_of(const dlua_conv_desc_t *d) {
  return (geom_t){.n = d->n, .c = d->c, .h = d->h, .w = d->w, .o = d->o, .kh = d->kh, .kw = d->kw, .oh = d->oh,
                  .ow = d->ow, .sh = d->sh, .sw = d->sw, .ph = d->ph, .pw = d->pw, .dh = d->dh, .dw = d->dw,
                  .g = d->groups};
}

/* A buffer for elems elements of es bytes, aligned as the tensor allocator's (NULL with the error recorded). */
static void *scratch_alloc(const char *op, int64_t elems, size_t es) {
  size_t bytes = (size_t)(elems > 0 ? elems : 1) * es;
  bytes = (bytes + 63) / 64 * 64;
  void *p = aligned_alloc(64, bytes);
  if (!p) DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, bytes);
  return p;
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

/* With stride 1, no dilation and one group, the input gradient is a forward convolution of the
   output gradient with the weights' channels swapped and kernels turned 180 degrees, padded by
   k - 1 - pad. oneDNN 2.6's forward kernels for channels-last activations (brgconv) are faster than
   its backward-data ones: measured at ResNet-20's shapes on AVX-512, 1 thread, batch 64: 2.1 vs 2.5 ms
   (32 channels, 14x14) and 1.7 vs 2.2 ms (64 channels, 7x7). Channels-last only, where it was measured. */
static int bwd_data_as_forward(const geom_t *g, int gy_fmt, int gx_fmt, int dtype) {
  return g->sh == 1 && g->sw == 1 && g->dh == 1 && g->dw == 1 && g->g == 1 && g->ph <= g->kh - 1 &&
         g->pw <= g->kw - 1 && gy_fmt == FMT_NHWC && gx_fmt == FMT_NHWC &&
         (dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_BF16);
}

static dlua_status_t backward_data_by_forward(const char *op, const geom_t *g, const void *gy, const void *w,
                                              const int64_t *ws, int dtype, void *gx, int accumulate) {
  const int lowp = dtype == DLUA_DTYPE_BF16;
  const size_t es = lowp ? 2 : 4;  // bytes per element: the weights are only moved, never computed on
  char *dst = scratch_alloc(op, g->c * g->o * g->kh * g->kw, es);  // (C, O, kH, kW), contiguous
  if (!dst) return dlua_last_status();
  const char *src = w;
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
  void *ptrs[4] = {(void *)gy, dst, gx, NULL};
  dlua_status_t s = dlua_conv_dnnl_run(op, &k, ptrs);
  free(dst);
  return s;
}

/* oneDNN 2.6's 1x1 weight gradient on strided channels-last input (jit_1x1, which first gathers the
   strided pixels into its own "reduce to unit stride" buffer) is wrong when the input channels per
   group do not fill its channel block: relative errors 0.2-1.2 measured here at 2 threads and odd
   batch with 1-12 channels (oneDNN issue #6035: that buffer is overrun when IC < ic_block). So those
   pixels are gathered here, zeros where the padding is, and the stride-1 unpadded 1x1 convolution of
   the gathered input gives the same gradient. Only the affected case: other channel counts keep
   oneDNN's own path (ResNets' 16/32/64/256... channels). */
static int bwd_weights_gather(const geom_t *g, int x_fmt) {
  return g->kh == 1 && g->kw == 1 && (g->sh > 1 || g->sw > 1) && (g->c / g->g) % 16 != 0 && x_fmt == FMT_NHWC;
}

/* x (N, C, H, W) channels-last float32 or bfloat16 (element strides xs, elements of es bytes) -> *out (N, C, OH, OW)
   channels-last, x's dtype: the pixels a 1x1 convolution of geometry g reads; *f: the stride-1 unpadded geometry
   over them. The caller frees *out. */
static dlua_status_t gather_strided(const char *op, const geom_t *g, const void *x, const int64_t *xs, size_t es,
                                    void **out, geom_t *f) {
  char *dst = scratch_alloc(op, g->n * g->c * g->oh * g->ow, es);  // the pixels are only moved
  if (!dst) return dlua_last_status();
  *out = dst;
  const char *src = x;  // xs in elements; xs[1] == 1
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

/* ---- the conv table's slots (kernels/conv.h) --------------------------------------------------- */

static dlua_status_t cpu_caps(const char *op, const dlua_conv_desc_t *d, dlua_conv_caps_t *caps) {
  (void)op;
  geom_t g = geom_of(d);
  dlua_dtype_t ct = compute_dtype((dlua_dtype_t)d->dtype, &g);
  *caps = (dlua_conv_caps_t){.dtype = (int)ct, .param_dtype = (int)grad_param_dtype(ct), .one_format = 0, .bias = 1,
                             .empty = 1};
  return DLUA_OK;
}

static dlua_status_t cpu_forward(const char *op, dlua_conv_desc_t *d) {
  geom_t g = geom_of(d);
  if (d->dtype == DLUA_DTYPE_F64) {
    ref_forward(&g, (const double *)d->x, d->xs, (const double *)d->wt, d->ws, (const double *)d->bias, d->bs,
                (double *)d->y, d->ys);
    return DLUA_OK;
  }
  conv_key_t k = dlua_conv_dnnl_key(DIR_FWD, &g, d->xfmt, d->yfmt, d->wfmt, d->bias != NULL);
  k.lowp = d->dtype == DLUA_DTYPE_BF16;
  void *ptrs[4] = {d->x, d->wt, d->y, d->bias};
  return dlua_conv_dnnl_run(op, &k, ptrs);
}

static dlua_status_t cpu_bwd_data_accumulates(const char *op, const dlua_conv_desc_t *d, int *yes) {
  (void)op;
  geom_t g = geom_of(d);
  *yes = d->dtype != DLUA_DTYPE_F64 && bwd_data_as_forward(&g, d->yfmt, d->xfmt, d->dtype);
  return DLUA_OK;
}

static dlua_status_t cpu_backward_data(const char *op, dlua_conv_desc_t *d) {
  geom_t g = geom_of(d);
  if (d->dtype == DLUA_DTYPE_F64) {
    ref_backward_data(&g, (const double *)d->y, d->ys, (const double *)d->wt, d->ws, (double *)d->x, d->xs);
    return DLUA_OK;
  }
  if (bwd_data_as_forward(&g, d->yfmt, d->xfmt, d->dtype))
    return backward_data_by_forward(op, &g, d->y, d->wt, d->ws, d->dtype, d->x, d->acc);
  conv_key_t k = dlua_conv_dnnl_key(DIR_BWD_DATA, &g, d->xfmt, d->yfmt, d->wfmt, 0);
  k.lowp = d->dtype == DLUA_DTYPE_BF16;
  void *ptrs[3] = {d->y, d->wt, d->x};
  return dlua_conv_dnnl_run(op, &k, ptrs);
}

static dlua_status_t cpu_backward_weights(const char *op, dlua_conv_desc_t *d) {
  geom_t g = geom_of(d);
  if (d->dtype == DLUA_DTYPE_F64) {
    ref_backward_weights(&g, (const double *)d->x, d->xs, (const double *)d->y, d->ys, (double *)d->wt, d->ws,
                         (double *)d->bias, d->bs, d->acc, d->acc_bias);
    return DLUA_OK;
  }
  dlua_status_t s = DLUA_OK;
  geom_t f = g;
  void *xg = NULL;
  if (bwd_weights_gather(&g, d->xfmt))
    s = gather_strided(op, &g, d->x, d->xs, dlua_dtype_size((dlua_dtype_t)d->dtype), &xg, &f);
  conv_key_t k = dlua_conv_dnnl_key(DIR_BWD_WEIGHTS, &f, xg ? FMT_NHWC : d->xfmt, d->yfmt, d->wfmt, d->bias != NULL);
  k.acc_w = d->acc;
  k.acc_b = d->acc_bias;
  k.lowp = d->dtype == DLUA_DTYPE_BF16;
  void *ptrs[4] = {xg ? xg : d->x, d->y, d->wt, d->bias};
  if (s == DLUA_OK) s = dlua_conv_dnnl_run(op, &k, ptrs);
  free(xg);
  return s;
}

const struct dlua_conv_ops dlua_cpu_conv_ops = {
    .caps = cpu_caps,
    .bwd_data_accumulates = cpu_bwd_data_accumulates,
    .forward = cpu_forward,
    .backward_data = cpu_backward_data,
    .backward_weights = cpu_backward_weights,
};

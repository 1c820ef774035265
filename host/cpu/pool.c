/* CPU 2-D pooling (max, average, adaptive average), forward and backward, in NCHW or channels-last memory. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "cuda/nn_cuda.h" /* plain C: only CUDA builds call into it */

/* Below this much work a loop runs on one thread: waking the pool costs more. */
enum { POOL_PAR_MIN = 32768 };

/* One call's geometry; cl: channels-last memory. */
typedef struct {
  int64_t N, C, H, W, OH, OW;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int cl;
} pool_geom_t;

/* Average-pool windows, separable: output row oh covers input rows [hs, he) and contributes
   the factor hd to the divisor, likewise for columns. */
typedef struct {
  int64_t *hs, *he, *hd, *ws, *we, *wd;
  int64_t div_override;
} pool_win_t;

#define POOL_CAT2(a, b) a##b
#define POOL_CAT(a, b) POOL_CAT2(a, b)
#define FN(name) POOL_CAT(name, POOL_SFX)

#define T float
#define POOL_SFX _f32
#include "cpu/pool_impl.h"
#undef T
#undef POOL_SFX

#define T double
#define POOL_SFX _f64
#include "cpu/pool_impl.h"
#undef T
#undef POOL_SFX

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
                                   int dh, int dw, int ceil_mode, pool_geom_t *g) {
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

static dlua_status_t check_grad_shape(const char *op, const dlua_tensor_t *gy, const pool_geom_t *g) {
  if (gy->sizes[0] == g->N && gy->sizes[1] == g->C && gy->sizes[2] == g->OH && gy->sizes[3] == g->OW) return DLUA_OK;
  char b[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_output %s must have shape (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ")",
                  op, dlua_tensor_describe(gy, b, sizeof b), g->N, g->C, g->OH, g->OW);
}

static dlua_dtype_t compute_dtype(dlua_dtype_t d) { return d == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32; }

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

/* ---- CUDA ----------------------------------------------------------------------------------------- */

/* The entry points check their arguments as for the CPU, then hand CUDA inputs to these drivers, which
   stage other layouts as contiguous copies (as the CPU) and launch host/cuda/pool.cu. The kernels read
   and write the activations' own dtype (16-bit ones computed in float, as the CPU's compute dtype). */
#ifdef DLUA_HAVE_CUDA
static dlua_cuda_pool_t cuda_pool(const pool_geom_t *g, int kind, dlua_dtype_t dt, int cl, int device,
                                  int include_pad, int div_override) {
  dlua_cuda_pool_t p = {.kind = kind, .dtype = (int)dt, .cl = cl, .device = device, .N = g->N, .C = g->C, .H = g->H,
                        .W = g->W, .OH = g->OH, .OW = g->OW, .kh = g->kh, .kw = g->kw, .sh = g->sh, .sw = g->sw,
                        .ph = g->ph, .pw = g->pw, .dh = g->dh, .dw = g->dw, .include_pad = include_pad,
                        .div_override = div_override};
  return p;
}

/* Forward of any kind (indices: max pooling's positions, may be NULL). */
static dlua_status_t cuda_forward(const char *op, dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *x,
                                  const pool_geom_t *g, int kind, int include_pad, int div_override) {
  const int fmt = fmt_of(x);
  const int64_t osz[4] = {g->N, g->C, g->OH, g->OW};
  dlua_tensor_t *xs = NULL;
  act_out_t oy = {0}, oi = {0};
  dlua_status_t s = act_stage(x, x->dtype, fmt, &xs);
  if (s == DLUA_OK) s = act_out_begin_on(op, &oy, out, 4, osz, x->dtype, x->dtype, fmt, &x, 1, 0, x->device);
  if (s == DLUA_OK && indices)
    s = act_out_begin_on(op, &oi, indices, 4, osz, DLUA_DTYPE_I64, DLUA_DTYPE_I64, fmt, &x, 1, 0, x->device);
  if (s == DLUA_OK && indices && (*indices)->dtype != DLUA_DTYPE_I64 && (*indices)->dtype != DLUA_DTYPE_I32) {
    char b[200];
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s must be int64 or int32", op, dlua_tensor_describe(*indices, b, sizeof b));
  }
  if (s == DLUA_OK) {
    const dlua_cuda_pool_t p = cuda_pool(g, kind, x->dtype, fmt == ACT_CL, x->device, include_pad, div_override);
    s = dlua_cuda_pool_forward(op, &p, dlua_tensor_ptr(xs), dlua_tensor_ptr(oy.work),
                               indices ? (int64_t *)dlua_tensor_ptr(oi.work) : NULL);
  }
  s = act_out_end(&oy, s);
  s = act_out_end(&oi, s);
  dlua_tensor_free(xs);
  return s;
}

/* Backward of any kind into grad_input (x_sizes), laid out as grad_fmt says. */
static dlua_status_t cuda_backward(const char *op, dlua_tensor_t **grad_input, const dlua_tensor_t *gy,
                                   const dlua_tensor_t *indices, const int64_t *x_sizes, const pool_geom_t *g, int kind,
                                   int include_pad, int div_override) {
  const int fmt = grad_fmt(grad_input, gy);
  dlua_tensor_t *gs = NULL, *is = NULL;
  act_out_t ox = {0};
  const dlua_tensor_t *ins[2] = {gy, indices};
  dlua_status_t s = act_stage(gy, gy->dtype, fmt, &gs);
  if (s == DLUA_OK && indices) s = act_stage(indices, DLUA_DTYPE_I64, fmt, &is);
  if (s == DLUA_OK) s = act_out_begin_on(op, &ox, grad_input, 4, x_sizes, gy->dtype, gy->dtype, fmt, ins, 2, 0, gy->device);
  if (s == DLUA_OK) {
    const dlua_cuda_pool_t p = cuda_pool(g, kind, gy->dtype, fmt == ACT_CL, gy->device, include_pad, div_override);
    int bad = 0;
    s = dlua_cuda_pool_backward(op, &p, dlua_tensor_ptr(gs), is ? (const int64_t *)dlua_tensor_ptr(is) : NULL,
                                dlua_tensor_ptr(ox.work), &bad);
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
#endif

/* ---- max pooling ---------------------------------------------------------------------------------- */

dlua_status_t dlua_nn_max_pool2d_forward(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *x,
                                         int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w,
                                         int dil_h, int dil_w, int ceil_mode) {
  const char *op = "max_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  pool_geom_t g;
  DLUA_TRY(pool_geometry(op, x->sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, ceil_mode, &g));
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return cuda_forward(op, out, indices, x, &g, 0, 0, 0);
#else
    return dlua_require_cpu(op, x);
#endif
  }
  const int fmt = fmt_of(x);
  g.cl = fmt == ACT_CL;
  const dlua_dtype_t ct = compute_dtype(x->dtype);
  const int64_t osz[4] = {g.N, g.C, g.OH, g.OW};
  dlua_tensor_t *xs = NULL;
  act_out_t oy = {0}, oi = {0};
  dlua_status_t s = act_stage(x, ct, fmt, &xs);
  if (s == DLUA_OK) s = act_out_begin(op, &oy, out, 4, osz, x->dtype, ct, fmt, &x, 1, 0);
  if (s == DLUA_OK && indices) s = act_out_begin(op, &oi, indices, 4, osz, DLUA_DTYPE_I64, DLUA_DTYPE_I64, fmt, &x, 1, 0);
  if (s == DLUA_OK && indices && (*indices)->dtype != DLUA_DTYPE_I64 && (*indices)->dtype != DLUA_DTYPE_I32) {
    char b[200];
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s must be int64 or int32", op, dlua_tensor_describe(*indices, b, sizeof b));
  }
  if (s == DLUA_OK) {
    int64_t *ip = indices ? (int64_t *)dlua_tensor_ptr(oi.work) : NULL;
    if (ct == DLUA_DTYPE_F64) maxpool_fwd_f64(&g, (const double *)dlua_tensor_ptr(xs), (double *)dlua_tensor_ptr(oy.work), ip);
    else maxpool_fwd_f32(&g, (const float *)dlua_tensor_ptr(xs), (float *)dlua_tensor_ptr(oy.work), ip);
  }
  s = act_out_end(&oy, s);
  s = act_out_end(&oi, s);
  dlua_tensor_free(xs);
  return s;
}

dlua_status_t dlua_nn_max_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                          const dlua_tensor_t *indices, const int64_t *x_sizes) {
  const char *op = "max_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  char b1[200], b2[200];
  if (!indices || !indices->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: indices is NULL", op);
  DLUA_TRY(act_same_device(op, grad_output, &indices, 1));
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
  pool_geom_t g = {.N = x_sizes[0], .C = x_sizes[1], .H = x_sizes[2], .W = x_sizes[3],
                   .OH = grad_output->sizes[2], .OW = grad_output->sizes[3]};
  if (grad_output->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return cuda_backward(op, grad_input, grad_output, indices, x_sizes, &g, 0, 0, 0);
#else
    return dlua_require_cpu(op, grad_output);
#endif
  }
  const int fmt = grad_fmt(grad_input, grad_output);
  g.cl = fmt == ACT_CL;
  const dlua_dtype_t ct = compute_dtype(grad_output->dtype);
  dlua_tensor_t *gs = NULL, *is = NULL;
  act_out_t ox = {0};
  const dlua_tensor_t *ins[2] = {grad_output, indices};
  dlua_status_t s = act_stage(grad_output, ct, fmt, &gs);
  if (s == DLUA_OK) s = act_stage(indices, DLUA_DTYPE_I64, fmt, &is);
  if (s == DLUA_OK) s = act_out_begin(op, &ox, grad_input, 4, x_sizes, grad_output->dtype, ct, fmt, ins, 2, 0);
  if (s == DLUA_OK) {
    const int64_t *ip = (const int64_t *)dlua_tensor_ptr(is);
    int bad = ct == DLUA_DTYPE_F64
                  ? maxpool_bwd_f64(&g, (const double *)dlua_tensor_ptr(gs), ip, (double *)dlua_tensor_ptr(ox.work))
                  : maxpool_bwd_f32(&g, (const float *)dlua_tensor_ptr(gs), ip, (float *)dlua_tensor_ptr(ox.work));
    if (bad)
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: indices %s hold a position outside the %" PRId64 " x %" PRId64 " input plane", op,
                   dlua_tensor_describe(indices, b1, sizeof b1), g.H, g.W);
  }
  s = act_out_end(&ox, s);
  dlua_tensor_free(gs);
  dlua_tensor_free(is);
  return s;
}

/* ---- average pooling ------------------------------------------------------------------------------ */

static dlua_status_t win_alloc(const char *op, pool_win_t *w, int64_t OH, int64_t OW) {
  size_t n = (size_t)(3 * (OH + OW)) * sizeof(int64_t);
  int64_t *p = malloc(n ? n : 1);
  if (!p) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, n);
  w->hs = p, w->he = p + OH, w->hd = p + 2 * OH;
  w->ws = p + 3 * OH, w->we = w->ws + OW, w->wd = w->we + OW;
  w->div_override = 0;
  return DLUA_OK;
}

/* PyTorch's avg_pool2d windows along one axis: [o*s - p, min(o*s - p + k, in + p)) clipped to
   the input; the divisor factor counts the padded extent or only the clipped one. */
static void avg_axis(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, int include_pad, int64_t *st, int64_t *en,
                     int64_t *dv) {
  for (int64_t o = 0; o < out; o++) {
    int64_t a = o * s - p, e = a + k < in + p ? a + k : in + p;
    int64_t padded = e - a;
    if (a < 0) a = 0;
    if (e > in) e = in;
    st[o] = a;
    en[o] = e;
    dv[o] = include_pad ? padded : e - a;
  }
}

/* Adaptive windows: [floor(o * in / out), ceil((o + 1) * in / out)). */
static void adaptive_axis(int64_t in, int64_t out, int64_t *st, int64_t *en, int64_t *dv) {
  for (int64_t o = 0; o < out; o++) {
    st[o] = o * in / out;
    en[o] = ((o + 1) * in + out - 1) / out;
    dv[o] = en[o] - st[o];
  }
}

static dlua_status_t avg_forward(const char *op, dlua_tensor_t **out, const dlua_tensor_t *x, pool_geom_t *g,
                                 pool_win_t *w) {
  const int fmt = fmt_of(x);
  g->cl = fmt == ACT_CL;
  const dlua_dtype_t ct = compute_dtype(x->dtype);
  const int64_t osz[4] = {g->N, g->C, g->OH, g->OW};
  dlua_tensor_t *xs = NULL;
  act_out_t oy = {0};
  dlua_status_t s = act_stage(x, ct, fmt, &xs);
  if (s == DLUA_OK) s = act_out_begin(op, &oy, out, 4, osz, x->dtype, ct, fmt, &x, 1, 0);
  if (s == DLUA_OK) {
    if (ct == DLUA_DTYPE_F64) avgpool_fwd_f64(g, w, (const double *)dlua_tensor_ptr(xs), (double *)dlua_tensor_ptr(oy.work));
    else avgpool_fwd_f32(g, w, (const float *)dlua_tensor_ptr(xs), (float *)dlua_tensor_ptr(oy.work));
  }
  s = act_out_end(&oy, s);
  dlua_tensor_free(xs);
  return s;
}

static dlua_status_t avg_backward(const char *op, dlua_tensor_t **grad_input, const dlua_tensor_t *gy,
                                  const int64_t *x_sizes, pool_geom_t *g, pool_win_t *w) {
  const int fmt = grad_fmt(grad_input, gy);
  g->cl = fmt == ACT_CL;
  const dlua_dtype_t ct = compute_dtype(gy->dtype);
  dlua_tensor_t *gs = NULL;
  act_out_t ox = {0};
  dlua_status_t s = act_stage(gy, ct, fmt, &gs);
  if (s == DLUA_OK) s = act_out_begin(op, &ox, grad_input, 4, x_sizes, gy->dtype, ct, fmt, &gy, 1, 0);
  if (s == DLUA_OK) {
    if (ct == DLUA_DTYPE_F64) avgpool_bwd_f64(g, w, (const double *)dlua_tensor_ptr(gs), (double *)dlua_tensor_ptr(ox.work));
    else avgpool_bwd_f32(g, w, (const float *)dlua_tensor_ptr(gs), (float *)dlua_tensor_ptr(ox.work));
  }
  s = act_out_end(&ox, s);
  dlua_tensor_free(gs);
  return s;
}

static dlua_status_t avg_setup(const char *op, const int64_t *xs, int kh, int kw, int sh, int sw, int ph, int pw,
                               int ceil_mode, int count_include_pad, int divisor_override, pool_geom_t *g,
                               pool_win_t *w) {
  if (divisor_override < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: divisor_override must be positive (or 0: none), got %d", op, divisor_override);
  DLUA_TRY(pool_geometry(op, xs, kh, kw, sh, sw, ph, pw, 1, 1, ceil_mode, g));
  DLUA_TRY(win_alloc(op, w, g->OH, g->OW));
  avg_axis(g->H, g->OH, kh, sh, ph, count_include_pad, w->hs, w->he, w->hd);
  avg_axis(g->W, g->OW, kw, sw, pw, count_include_pad, w->ws, w->we, w->wd);
  w->div_override = divisor_override;
  return DLUA_OK;
}

dlua_status_t dlua_nn_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int kernel_h, int kernel_w,
                                         int stride_h, int stride_w, int pad_h, int pad_w, int ceil_mode,
                                         int count_include_pad, int divisor_override) {
  const char *op = "avg_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  pool_geom_t g;
  pool_win_t w;
  DLUA_TRY(avg_setup(op, x->sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, ceil_mode, count_include_pad,
                     divisor_override, &g, &w));
  dlua_status_t s;
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    s = cuda_forward(op, out, NULL, x, &g, 1, count_include_pad, divisor_override);
#else
    s = dlua_require_cpu(op, x);
#endif
  } else {
    s = avg_forward(op, out, x, &g, &w);
  }
  free(w.hs);
  return s;
}

dlua_status_t dlua_nn_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                          const int64_t *x_sizes, int kernel_h, int kernel_w, int stride_h,
                                          int stride_w, int pad_h, int pad_w, int ceil_mode, int count_include_pad,
                                          int divisor_override) {
  const char *op = "avg_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  pool_geom_t g;
  pool_win_t w;
  DLUA_TRY(avg_setup(op, x_sizes, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, ceil_mode, count_include_pad,
                     divisor_override, &g, &w));
  dlua_status_t s = check_grad_shape(op, grad_output, &g);
  if (s == DLUA_OK && grad_output->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    s = cuda_backward(op, grad_input, grad_output, NULL, x_sizes, &g, 1, count_include_pad, divisor_override);
#else
    s = dlua_require_cpu(op, grad_output);
#endif
  } else if (s == DLUA_OK) {
    s = avg_backward(op, grad_input, grad_output, x_sizes, &g, &w);
  }
  free(w.hs);
  return s;
}

/* ---- adaptive average pooling ----------------------------------------------------------------------- */

static dlua_status_t adaptive_setup(const char *op, const int64_t *xs, int64_t oh, int64_t ow, pool_geom_t *g,
                                    pool_win_t *w) {
  char b[160];
  if (oh < 1 || ow < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: output size (%" PRId64 ", %" PRId64 ") must be positive", op, oh, ow);
  if (xs[2] < 1 || xs[3] < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: input %s must have a non-empty plane", op, dlua_shape_str(4, xs, b, sizeof b));
  *g = (pool_geom_t){.N = xs[0], .C = xs[1], .H = xs[2], .W = xs[3], .OH = oh, .OW = ow};
  DLUA_TRY(win_alloc(op, w, oh, ow));
  adaptive_axis(g->H, oh, w->hs, w->he, w->hd);
  adaptive_axis(g->W, ow, w->ws, w->we, w->wd);
  return DLUA_OK;
}

dlua_status_t dlua_nn_adaptive_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int64_t out_h,
                                                  int64_t out_w) {
  const char *op = "adaptive_avg_pool2d";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  pool_geom_t g;
  pool_win_t w;
  DLUA_TRY(adaptive_setup(op, x->sizes, out_h, out_w, &g, &w));
  dlua_status_t s;
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    s = cuda_forward(op, out, NULL, x, &g, 2, 0, 0);
#else
    s = dlua_require_cpu(op, x);
#endif
  } else {
    s = avg_forward(op, out, x, &g, &w);
  }
  free(w.hs);
  return s;
}

dlua_status_t dlua_nn_adaptive_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output,
                                                   const int64_t *x_sizes) {
  const char *op = "adaptive_avg_pool2d_backward";
  if (!grad_input) return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input is NULL", op);
  DLUA_TRY(check_act(op, "grad_output", grad_output));
  DLUA_TRY(check_x_sizes(op, x_sizes));
  pool_geom_t g;
  pool_win_t w;
  DLUA_TRY(adaptive_setup(op, x_sizes, grad_output->sizes[2], grad_output->sizes[3], &g, &w));
  dlua_status_t s = check_grad_shape(op, grad_output, &g);
  if (s == DLUA_OK && grad_output->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    s = cuda_backward(op, grad_input, grad_output, NULL, x_sizes, &g, 2, 0, 0);
#else
    s = dlua_require_cpu(op, grad_output);
#endif
  } else if (s == DLUA_OK) {
    s = avg_backward(op, grad_input, grad_output, x_sizes, &g, &w);
  }
  free(w.hs);
  return s;
}

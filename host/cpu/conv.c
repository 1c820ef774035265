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
#include "cpu/act_layout.h"
#include "cpu/conv.h"
#ifdef DLUA_HAVE_CUDA
#include "cuda/conv_cuda.h" /* plain C: the cuDNN side of the entry points below */
#endif

/* ---- geometry and memory formats ------------------------------------------------------------ */

typedef struct {
  int64_t n, c, h, w;  /* input (N, C, H, W) */
  int64_t o, kh, kw;   /* weight (O, C/groups, kH, kW) */
  int64_t oh, ow;      /* output spatial size */
  int64_t sh, sw, ph, pw, dh, dw, g;
} geom_t;

/* Memory formats of a logically (N, C, H, W) tensor: act_layout.h's, named for images; weights
   (O, C/g, kH, kW) use the same two: OIHW is the NCHW pattern, OHWI the NHWC one. */
enum { FMT_NCHW = ACT_CONTIG, FMT_NHWC = ACT_CL, FMT_OTHER = ACT_OTHER };

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

/* ---- oneDNN: engine, per-thread stream and workspace ----------------------------------------- */

static pthread_once_t dnnl_once = PTHREAD_ONCE_INIT;
static dnnl_engine_t dnnl_eng;
static dnnl_status_t dnnl_eng_status;
static pthread_key_t tls_key;

/* Per thread: a stream (oneDNN streams are not meant to be shared across threads) and a
   workspace that outlives calls, so the scratchpad and reorder buffers are not faulted in
   afresh on every convolution. */
typedef struct {
  dnnl_stream_t stream;
  void *ws;
  size_t ws_cap;
} conv_tls_t;

/* Workspaces above this are released after each call: NCHW reorders of big activations
   would otherwise pin hundreds of megabytes between steps. */
enum { WS_KEEP_BYTES = 64 << 20 };

static void tls_free(void *p) {
  conv_tls_t *t = p;
  if (t->stream) dnnl_stream_destroy(t->stream);
  free(t->ws);
  free(t);
}

static void dnnl_init(void) {
  dnnl_eng_status = dnnl_engine_create(&dnnl_eng, dnnl_cpu, 0);
  if (pthread_key_create(&tls_key, tls_free) != 0 && dnnl_eng_status == dnnl_success)
    dnnl_eng_status = dnnl_out_of_memory;
}

static dlua_status_t get_tls(const char *op, conv_tls_t **out) {
  pthread_once(&dnnl_once, dnnl_init);
  if (dnnl_eng_status != dnnl_success)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN CPU engine creation failed (status %d)", op, (int)dnnl_eng_status);
  conv_tls_t *t = pthread_getspecific(tls_key);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, sizeof *t);
    dnnl_status_t st = dnnl_stream_create(&t->stream, dnnl_eng, dnnl_stream_default_flags);
    if (st != dnnl_success) {
      free(t);
      return DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN stream creation failed (status %d)", op, (int)st);
    }
    pthread_setspecific(tls_key, t);
  }
  *out = t;
  return DLUA_OK;
}

static dlua_status_t tls_workspace(const char *op, conv_tls_t *t, size_t bytes, char **ws) {
  if (bytes > t->ws_cap) {
    free(t->ws);
    t->ws = NULL;
    t->ws_cap = 0;
    size_t ask = (bytes + 4095) & ~(size_t)4095;
    if (posix_memalign(&t->ws, 4096, ask) != 0 || !t->ws) {
      t->ws = NULL;
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating a %zu-byte oneDNN workspace", op, ask);
    }
    t->ws_cap = ask;
  }
  *ws = t->ws;
  return DLUA_OK;
}

static void tls_trim(conv_tls_t *t) {
  if (t->ws_cap > WS_KEEP_BYTES) {
    free(t->ws);
    t->ws = NULL;
    t->ws_cap = 0;
  }
}

/* ---- oneDNN: primitive cache ------------------------------------------------------------------ */

typedef enum { DIR_FWD = 0, DIR_BWD_DATA = 1, DIR_BWD_WEIGHTS = 2 } conv_dir_t;

/* Everything a primitive depends on. Built on a zeroed struct so memcmp/hash see no padding junk. */
typedef struct {
  int32_t dir, threads;
  int32_t src_fmt, dst_fmt, w_fmt; /* x / grad_x, y / grad_y, weight / grad_weight */
  int32_t has_bias;
  int32_t acc_w, acc_b;            /* backward weights: += into grad_weight / grad_bias */
  int32_t acc_y;                   /* forward: += into y (a sum post-op on the convolution itself) */
  int32_t lowp;                    /* bfloat16 activations and weights (weight and bias gradients stay float32) */
  geom_t g;
} conv_key_t;

/* One argument of the convolution: where the caller's memory is and how it is laid out, and the
   layout the primitive wants. Inputs reorder user -> inner before the convolution, outputs
   inner -> user after it (with a sum post-op when accumulating). */
typedef struct {
  int arg;
  int output;
  dnnl_memory_desc_t user, inner;
  dnnl_primitive_t reorder; /* NULL: the primitive works on the caller's memory directly */
  size_t off;               /* of the inner buffer in the workspace */
} conv_slot_t;

typedef struct conv_entry {
  conv_key_t key;
  uint64_t hash, last_use;
  int refs, evicted;
  dnnl_primitive_t conv;
  int nslots;
  conv_slot_t slot[4];
  size_t scratch_bytes, ws_bytes;
  char impl[64];
} conv_entry_t;

enum { CACHE_MAX = 4096 };
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static conv_entry_t *cache_tab[CACHE_MAX];
static int cache_n, cache_cap = 256;
static uint64_t cache_clock;
static int64_t cache_hits, cache_misses;

static uint64_t key_hash(const conv_key_t *k) {
  const unsigned char *p = (const unsigned char *)k;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void entry_destroy(conv_entry_t *e) {
  if (!e) return;
  if (e->conv) dnnl_primitive_destroy(e->conv);
  for (int i = 0; i < e->nslots; i++)
    if (e->slot[i].reorder) dnnl_primitive_destroy(e->slot[i].reorder);
  free(e);
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

#define DNNL_CHECK(call, what)                                                                               \
  do {                                                                                                       \
    dnnl_status_t st_ = (call);                                                                              \
    if (st_ != dnnl_success) {                                                                               \
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN %s failed (status %d) for input (%" PRId64 ", %" PRId64    \
                   ", %" PRId64 ", %" PRId64 ") and weight (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 \
                   ") with groups %" PRId64,                                                                 \
                   op, what, (int)st_, g->n, g->c, g->h, g->w, g->o, g->c / g->g, g->kh, g->kw, g->g);       \
      goto done;                                                                                             \
    }                                                                                                        \
  } while (0)

/* The weights' layout as oneDNN sees it: (G, O/G, C/G, kH, kW) when grouped. */
static dnnl_status_t weights_md(dnnl_memory_desc_t *md, const geom_t *g, int fmt, int any, dnnl_data_type_t dt) {
  int64_t ws4[4] = {g->o, g->c / g->g, g->kh, g->kw}, st[4];
  act_strides(4, ws4, fmt, st);
  if (g->g == 1) {
    dnnl_dims_t d = {ws4[0], ws4[1], ws4[2], ws4[3]}, s = {st[0], st[1], st[2], st[3]};
    return any ? dnnl_memory_desc_init_by_tag(md, 4, d, dt, dnnl_format_tag_any)
               : dnnl_memory_desc_init_by_strides(md, 4, d, dt, s);
  }
  int64_t og = g->o / g->g;
  dnnl_dims_t d = {g->g, og, ws4[1], ws4[2], ws4[3]}, s = {og * st[0], st[0], st[1], st[2], st[3]};
  return any ? dnnl_memory_desc_init_by_tag(md, 5, d, dt, dnnl_format_tag_any)
             : dnnl_memory_desc_init_by_strides(md, 5, d, dt, s);
}

static dnnl_status_t act_md(dnnl_memory_desc_t *md, const int64_t *sizes, int fmt, dnnl_data_type_t dt) {
  int64_t st[4];
  act_strides(4, sizes, fmt, st);
  dnnl_dims_t d = {sizes[0], sizes[1], sizes[2], sizes[3]}, s = {st[0], st[1], st[2], st[3]};
  return dnnl_memory_desc_init_by_strides(md, 4, d, dt, s);
}

/* What entry_build needs to know of one slot: its argument, direction, the caller's layout and
   where to ask the primitive for its own. */
typedef struct {
  int arg, output, accumulate;
  const dnnl_memory_desc_t *user;
  dnnl_query_t q;
  int qi;
} slot_spec_t;

static dlua_status_t entry_build(const char *op, const conv_key_t *k, conv_entry_t **out) {
  const geom_t *g = &k->g;
  dlua_status_t s = DLUA_OK;
  dnnl_primitive_attr_t attr = NULL, racc = NULL, afwd = NULL;
  dnnl_post_ops_t sum = NULL;
  dnnl_primitive_desc_t fpd = NULL, pd = NULL;
  conv_entry_t *e = calloc(1, sizeof *e);
  if (!e) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, sizeof *e);
  e->key = *k;

  int64_t xs[4] = {g->n, g->c, g->h, g->w}, ys[4] = {g->n, g->o, g->oh, g->ow};
  dnnl_memory_desc_t x_user, y_user, w_user, b_md, x_any, y_any, w_any, wf_any;
  // bfloat16 (lowp): activations and weights in bf16, accumulation in f32 inside oneDNN; the weight
  // gradient (and bias) are written in f32, straight into the float32 gradient arena.
  const dnnl_data_type_t adt = k->lowp ? dnnl_bf16 : dnnl_f32;
  const dnnl_data_type_t wdt = k->lowp && k->dir == DIR_BWD_WEIGHTS ? dnnl_f32 : adt;
  DNNL_CHECK(act_md(&x_user, xs, k->src_fmt, adt), "memory descriptor");
  DNNL_CHECK(act_md(&y_user, ys, k->dst_fmt, adt), "memory descriptor");
  DNNL_CHECK(weights_md(&w_user, g, k->w_fmt, 0, wdt), "memory descriptor");
  DNNL_CHECK(weights_md(&w_any, g, k->w_fmt, 1, wdt), "memory descriptor");
  DNNL_CHECK(weights_md(&wf_any, g, k->w_fmt, 1, adt), "memory descriptor");  // the forward's (hint for backward)
  dnnl_dims_t bd = {g->o};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&b_md, 1, bd, dnnl_f32, dnnl_a), "memory descriptor");
  // Measured on AVX-512 (ResNet-20 shapes, 2 threads): with plain NCHW activations oneDNN 2.6
  // falls back to im2col + GEMM, about 10x slower than its direct kernels, while its NCHW <->
  // blocked reorders cost ~0.3 ms per 6 MB. So NCHW activations go through the layout the
  // primitive picks; NHWC ones it runs on directly. Weights always take the primitive's
  // layout: reordering them costs microseconds, plain weights push NHWC to a reference kernel.
  int nhwc = k->src_fmt == FMT_NHWC || k->dst_fmt == FMT_NHWC;
  dnnl_dims_t xd = {xs[0], xs[1], xs[2], xs[3]}, yd = {ys[0], ys[1], ys[2], ys[3]};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&x_any, 4, xd, adt, nhwc ? dnnl_nhwc : dnnl_format_tag_any),
             "memory descriptor");
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&y_any, 4, yd, adt, nhwc ? dnnl_nhwc : dnnl_format_tag_any),
             "memory descriptor");
  // With 16 channels, NHWC memory is byte for byte oneDNN's nChw16c (aBcd16b). Naming it so when
  // input and output both have 16 channels gets the blocked direct kernel instead of the NHWC
  // brgconv one: forward 3.5 instead of 4.6 ms for ResNet-20's 16x28x28 convolutions at batch
  // 128 on AVX-512 (backward-data, run as a forward, likewise). The weight gradient keeps the
  // NHWC names: there oneDNN's direct kernel takes 1.76 instead of 2.25 ms (batch 64, 1 thread).
  // (Mixed formats fall to oneDNN's reference kernels.)
  if (k->dir != DIR_BWD_WEIGHTS && k->src_fmt == FMT_NHWC && k->dst_fmt == FMT_NHWC && xs[1] == 16 && ys[1] == 16) {
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&x_any, 4, xd, adt, dnnl_aBcd16b), "memory descriptor");
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&y_any, 4, yd, adt, dnnl_aBcd16b), "memory descriptor");
    x_user = x_any;
    y_user = y_any;
  }

  dnnl_dims_t strides = {g->sh, g->sw}, dil = {g->dh - 1, g->dw - 1}, pad = {g->ph, g->pw};
  // Symmetric padding: with the output size rounded down, oneDNN's consistency check
  // (H + pad_l + pad_r - extent) / stride + 1 == OH holds for pad_r = pad_l, as in PyTorch.
  DNNL_CHECK(dnnl_primitive_attr_create(&attr), "attribute creation");
  DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "scratchpad mode");
  dnnl_convolution_desc_t fd, bd_;
  DNNL_CHECK(dnnl_dilated_convolution_forward_desc_init(&fd, dnnl_forward_training, dnnl_convolution_direct, &x_any,
                                                        &wf_any, k->has_bias ? &b_md : NULL, &y_any, strides, dil,
                                                        pad, pad),
             "convolution descriptor");
  DNNL_CHECK(dnnl_post_ops_create(&sum), "post-op creation");
  DNNL_CHECK(dnnl_post_ops_append_sum(sum, 1.0f), "sum post-op");
  // A forward accumulating into y adds in the convolution (a sum post-op: y is read where it is
  // written) when the primitive works on the caller's y directly; otherwise in y's reorder.
  int fused_sum = 0;
  if (k->dir == DIR_FWD && k->acc_y) {
    DNNL_CHECK(dnnl_primitive_attr_create(&afwd), "attribute creation");
    DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(afwd, dnnl_scratchpad_mode_user), "scratchpad mode");
    DNNL_CHECK(dnnl_primitive_attr_set_post_ops(afwd, sum), "sum post-op");
    DNNL_CHECK(dnnl_primitive_desc_create(&fpd, &fd, afwd, dnnl_eng, NULL), "forward convolution");
    const dnnl_memory_desc_t *dmd = dnnl_primitive_desc_query_md(fpd, dnnl_query_dst_md, 0);
    fused_sum = dmd && dnnl_memory_desc_equal(dmd, &y_user);
    if (!fused_sum) {
      dnnl_primitive_desc_destroy(fpd);
      fpd = NULL;
    }
  }
  if (!fpd) DNNL_CHECK(dnnl_primitive_desc_create(&fpd, &fd, attr, dnnl_eng, NULL), "forward convolution");
  if (k->dir == DIR_FWD) {
    pd = fpd;
    fpd = NULL;
  } else if (k->dir == DIR_BWD_DATA) {
    DNNL_CHECK(dnnl_dilated_convolution_backward_data_desc_init(&bd_, dnnl_convolution_direct, &x_any, &w_any, &y_any,
                                                                strides, dil, pad, pad),
               "convolution descriptor");
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &bd_, attr, dnnl_eng, fpd), "backward-data convolution");
  } else {
    DNNL_CHECK(dnnl_dilated_convolution_backward_weights_desc_init(&bd_, dnnl_convolution_direct, &x_any, &w_any,
                                                                   k->has_bias ? &b_md : NULL, &y_any, strides, dil,
                                                                   pad, pad),
               "convolution descriptor");
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &bd_, attr, dnnl_eng, fpd), "backward-weights convolution");
  }
  const char *impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl)
    snprintf(e->impl, sizeof e->impl, "%s", impl);

  // Slots in the order the callers pass pointers.
  slot_spec_t spec[4];
  int ns = 0;
  if (k->dir == DIR_FWD) {
    spec[ns++] = (slot_spec_t){DNNL_ARG_SRC, 0, 0, &x_user, dnnl_query_src_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_WEIGHTS, 0, 0, &w_user, dnnl_query_weights_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DST, 1, k->acc_y && !fused_sum, &y_user, dnnl_query_dst_md, 0};
    if (k->has_bias) spec[ns++] = (slot_spec_t){DNNL_ARG_BIAS, 0, 0, &b_md, dnnl_query_weights_md, 1};
  } else if (k->dir == DIR_BWD_DATA) {
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_DST, 0, 0, &y_user, dnnl_query_diff_dst_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_WEIGHTS, 0, 0, &w_user, dnnl_query_weights_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_SRC, 1, 0, &x_user, dnnl_query_diff_src_md, 0};
  } else {
    spec[ns++] = (slot_spec_t){DNNL_ARG_SRC, 0, 0, &x_user, dnnl_query_src_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_DST, 0, 0, &y_user, dnnl_query_diff_dst_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_WEIGHTS, 1, k->acc_w, &w_user, dnnl_query_diff_weights_md, 0};
    if (k->has_bias)
      spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_BIAS, 1, k->acc_b, &b_md, dnnl_query_diff_weights_md, 1};
  }

  const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  e->scratch_bytes = smd ? dnnl_memory_desc_get_size(smd) : 0;
  DNNL_CHECK(dnnl_primitive_attr_create(&racc), "attribute creation");
  DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(racc, dnnl_scratchpad_mode_user), "scratchpad mode");
  DNNL_CHECK(dnnl_primitive_attr_set_post_ops(racc, sum), "sum post-op");
  e->nslots = ns;
  for (int i = 0; i < ns; i++) {
    conv_slot_t *sl = &e->slot[i];
    sl->arg = spec[i].arg;
    sl->output = spec[i].output;
    sl->user = *spec[i].user;
    const dnnl_memory_desc_t *in = dnnl_primitive_desc_query_md(pd, spec[i].q, spec[i].qi);
    if (!in) {
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN convolution has no memory descriptor for argument %d", op, sl->arg);
      goto done;
    }
    sl->inner = *in;
    // Accumulating outputs always go through a buffer: the sum happens in the reorder.
    if (dnnl_memory_desc_equal(&sl->user, &sl->inner) && !spec[i].accumulate) continue;
    dnnl_primitive_desc_t rpd = NULL;
    const dnnl_memory_desc_t *from = sl->output ? &sl->inner : &sl->user, *to = sl->output ? &sl->user : &sl->inner;
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, from, dnnl_eng, to, dnnl_eng, spec[i].accumulate ? racc : attr),
               "reorder");
    const dnnl_memory_desc_t *rs = dnnl_primitive_desc_query_md(rpd, dnnl_query_scratchpad_md, 0);
    size_t rb = rs ? dnnl_memory_desc_get_size(rs) : 0;
    if (rb > e->scratch_bytes) e->scratch_bytes = rb;
    dnnl_status_t st = dnnl_primitive_create(&sl->reorder, rpd);
    dnnl_primitive_desc_destroy(rpd);
    DNNL_CHECK(st, "reorder creation");
  }
  size_t off = align64(e->scratch_bytes);
  for (int i = 0; i < ns; i++)
    if (e->slot[i].reorder) {
      e->slot[i].off = off;
      off += align64(dnnl_memory_desc_get_size(&e->slot[i].inner));
    }
  e->ws_bytes = off;
  DNNL_CHECK(dnnl_primitive_create(&e->conv, pd), "convolution creation");

done:
  if (sum) dnnl_post_ops_destroy(sum);
  if (racc) dnnl_primitive_attr_destroy(racc);
  if (afwd) dnnl_primitive_attr_destroy(afwd);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (fpd) dnnl_primitive_desc_destroy(fpd);
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (s != DLUA_OK) {
    entry_destroy(e);
    return s;
  }
  *out = e;
  return DLUA_OK;
}

static conv_entry_t *cache_find(const conv_key_t *k, uint64_t h) {
  for (int i = 0; i < cache_n; i++)
    if (cache_tab[i]->hash == h && memcmp(&cache_tab[i]->key, k, sizeof *k) == 0) return cache_tab[i];
  return NULL;
}

/* Removes table slot i; the entry goes now, or when its last user releases it. */
static void cache_drop(int i) {
  conv_entry_t *e = cache_tab[i];
  cache_tab[i] = cache_tab[--cache_n];
  if (e->refs == 0)
    entry_destroy(e);
  else
    e->evicted = 1;
}

/* A referenced entry for k (released with cache_release). Building (JIT compilation) runs
   outside the lock; if two threads race on one key the later copy is dropped. */
static dlua_status_t cache_get(const char *op, const conv_key_t *k, conv_entry_t **out) {
  uint64_t h = key_hash(k);
  pthread_mutex_lock(&cache_mu);
  conv_entry_t *e = cache_find(k, h);
  if (e) {
    e->refs++;
    e->last_use = ++cache_clock;
    cache_hits++;
    pthread_mutex_unlock(&cache_mu);
    *out = e;
    return DLUA_OK;
  }
  cache_misses++;
  pthread_mutex_unlock(&cache_mu);

  conv_entry_t *fresh = NULL;
  DLUA_TRY(entry_build(op, k, &fresh));
  fresh->hash = h;
  pthread_mutex_lock(&cache_mu);
  e = cache_find(k, h);
  if (e) {
    entry_destroy(fresh);
  } else {
    while (cache_n >= cache_cap) {
      int lru = 0;
      for (int i = 1; i < cache_n; i++)
        if (cache_tab[i]->last_use < cache_tab[lru]->last_use) lru = i;
      cache_drop(lru);
    }
    e = fresh;
    cache_tab[cache_n++] = e;
  }
  e->refs++;
  e->last_use = ++cache_clock;
  pthread_mutex_unlock(&cache_mu);
  *out = e;
  return DLUA_OK;
}

static void cache_release(conv_entry_t *e) {
  pthread_mutex_lock(&cache_mu);
  if (--e->refs == 0 && e->evicted) entry_destroy(e);
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_clear(void) {
  pthread_mutex_lock(&cache_mu);
  while (cache_n > 0) cache_drop(cache_n - 1);
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_set_capacity(int capacity) {
  if (capacity < 1) capacity = 1;
  if (capacity > CACHE_MAX) capacity = CACHE_MAX;
  pthread_mutex_lock(&cache_mu);
  cache_cap = capacity;
  while (cache_n > cache_cap) {
    int lru = 0;
    for (int i = 1; i < cache_n; i++)
      if (cache_tab[i]->last_use < cache_tab[lru]->last_use) lru = i;
    cache_drop(lru);
  }
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_stats(int *entries, int64_t *hits, int64_t *misses) {
  pthread_mutex_lock(&cache_mu);
  if (entries) *entries = cache_n;
  if (hits) *hits = cache_hits;
  if (misses) *misses = cache_misses;
  pthread_mutex_unlock(&cache_mu);
}

/* Runs one float32 or bfloat16 convolution; ptrs are the caller's buffers in the entry's slot order. */
static dlua_status_t onednn_run(const char *op, const conv_key_t *k, void *const *ptrs) {
  const geom_t *g = &k->g;
  conv_tls_t *t = NULL;
  DLUA_TRY(get_tls(op, &t));
  conv_entry_t *e = NULL;
  DLUA_TRY(cache_get(op, k, &e));
  dlua_status_t s = DLUA_OK;
  dnnl_memory_t user[4] = {0}, inner[4] = {0}, scratch = NULL;
  char *ws = NULL;
  s = tls_workspace(op, t, e->ws_bytes ? e->ws_bytes : 64, &ws);
  if (s != DLUA_OK) goto done;
  if (e->scratch_bytes) {
    dnnl_memory_desc_t smd;
    dnnl_dims_t sd = {(int64_t)e->scratch_bytes};
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&smd, 1, sd, dnnl_u8, dnnl_a), "memory descriptor");
    DNNL_CHECK(dnnl_memory_create(&scratch, &smd, dnnl_eng, ws), "memory creation");
  }
  dnnl_exec_arg_t cargs[5];
  int nc = 0;
  for (int i = 0; i < e->nslots; i++) {
    conv_slot_t *sl = &e->slot[i];
    DNNL_CHECK(dnnl_memory_create(&user[i], &sl->user, dnnl_eng, ptrs[i]), "memory creation");
    if (sl->reorder) DNNL_CHECK(dnnl_memory_create(&inner[i], &sl->inner, dnnl_eng, ws + sl->off), "memory creation");
    cargs[nc++] = (dnnl_exec_arg_t){sl->arg, sl->reorder ? inner[i] : user[i]};
  }
  if (scratch) cargs[nc++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, scratch};
  for (int i = 0; i < e->nslots; i++) {
    if (!e->slot[i].reorder || e->slot[i].output) continue;
    dnnl_exec_arg_t ra[3] = {{DNNL_ARG_FROM, user[i]}, {DNNL_ARG_TO, inner[i]}, {DNNL_ARG_SCRATCHPAD, scratch}};
    DNNL_CHECK(dnnl_primitive_execute(e->slot[i].reorder, t->stream, scratch ? 3 : 2, ra), "reorder");
  }
  DNNL_CHECK(dnnl_primitive_execute(e->conv, t->stream, nc, cargs), "convolution");
  for (int i = 0; i < e->nslots; i++) {
    if (!e->slot[i].reorder || !e->slot[i].output) continue;
    dnnl_exec_arg_t ra[3] = {{DNNL_ARG_FROM, inner[i]}, {DNNL_ARG_TO, user[i]}, {DNNL_ARG_SCRATCHPAD, scratch}};
    DNNL_CHECK(dnnl_primitive_execute(e->slot[i].reorder, t->stream, scratch ? 3 : 2, ra), "reorder");
  }
  DNNL_CHECK(dnnl_stream_wait(t->stream), "stream wait");

done:
  for (int i = 0; i < 4; i++) {
    if (user[i]) dnnl_memory_destroy(user[i]);
    if (inner[i]) dnnl_memory_destroy(inner[i]);
  }
  if (scratch) dnnl_memory_destroy(scratch);
  cache_release(e);
  tls_trim(t);
  return s;
}

static conv_key_t make_key(conv_dir_t dir, const geom_t *g, int src_fmt, int dst_fmt, int w_fmt, int has_bias) {
  conv_key_t k;
  memset(&k, 0, sizeof k);
  k.dir = dir;
  k.threads = omp_get_max_threads();  // oneDNN splits work for the thread count it was built for
  k.src_fmt = src_fmt;
  k.dst_fmt = dst_fmt;
  k.w_fmt = w_fmt;
  k.has_bias = has_bias;
  k.g = *g;
  return k;
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
      conv_key_t k = make_key(DIR_FWD, &g, act_format(xv), act_format(yv), act_format(wv), bv != NULL);
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[4] = {dlua_tensor_ptr(xv), dlua_tensor_ptr(wv), dlua_tensor_ptr(yv), bv ? dlua_tensor_ptr(bv) : NULL};
      s = onednn_run(op, &k, ptrs);
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
  conv_key_t k = make_key(DIR_FWD, &f, FMT_NHWC, FMT_NHWC, FMT_NCHW, 0);
  k.acc_y = accumulate != 0;
  k.lowp = lowp;
  void *ptrs[4] = {dlua_tensor_ptr(gy), dlua_tensor_ptr(wt), dlua_tensor_ptr(gx), NULL};
  dlua_status_t s = onednn_run(op, &k, ptrs);
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
      conv_key_t k = make_key(DIR_BWD_DATA, &g, act_format(xv), act_format(yv), act_format(wv), 0);
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[3] = {dlua_tensor_ptr(yv), dlua_tensor_ptr(wv), dlua_tensor_ptr(xv)};
      s = onednn_run(op, &k, ptrs);
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
      conv_key_t k = make_key(DIR_BWD_WEIGHTS, &f, act_format(xin), act_format(yv), act_format(gwv), gbv != NULL);
      k.acc_w = w_direct && accumulate;
      k.acc_b = b_direct && accumulate;
      k.lowp = ct == DLUA_DTYPE_BF16;
      void *ptrs[4] = {dlua_tensor_ptr(xin), dlua_tensor_ptr(yv), dlua_tensor_ptr(gwv), gbv ? dlua_tensor_ptr(gbv) : NULL};
      if (s == DLUA_OK) s = onednn_run(op, &k, ptrs);
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

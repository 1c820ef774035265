/* Tests of the emulator's fake cuDNN (fake_cudnn.c), linked in directly:
     gcc -std=c11 -O1 -Wall -Wextra -I/usr/local/cuda/include -Ihost/cuemu tests/emu/test_fake_cudnn.c host/cuemu/fake_cudnn.c \
         -lm -o /tmp/t_dnn && /tmp/t_dnn
   The emulator's hooks are stand-ins here: cuemu_enqueue queues a copy of the work, which runs only at drain()
   (after the test has destroyed the call's descriptors and spoiled its alpha and beta), so the tests also show
   that a call computes nothing by itself and keeps nothing it was lent; cuemu_memory_kind knows the buffers the
   test allocates as "device memory"; cuemu_fail records.

   Results are checked against a naive reference written here (one loop over every (output, filter tap) pair that
   scatters into y, dx and dw at once), element by element, in float, double, half and bfloat16, for odd shapes,
   groups, depthwise, padding / stride / dilation, four memory layouts, beta 0 over a NaN-filled output, beta 1
   accumulation and general alpha / beta; then, in float and double, against the adjoint identities
   <conv(x, w), dy> = <x, dgrad(dy, w)> = <w, wgrad(x, dy)> and central finite differences; then the rounding of
   half and bfloat16 results bit for bit; then the refusals.
   Over 900 lines on purpose: the one reference and its three checks serve all three directions of the fake; split,
   each file would need the reference and the emulator's stand-in hooks again. */
#include <cudnn.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuemu.h"

static int failures, checks;

#define CHECK(cond, ...)                                      \
  do {                                                        \
    checks++;                                                 \
    if (!(cond)) {                                            \
      failures++;                                             \
      if (failures <= 40) {                                   \
        printf("FAIL %s:%d: ", __FILE__, __LINE__);           \
        printf(__VA_ARGS__);                                  \
        printf("\n");                                         \
      }                                                       \
    }                                                         \
  } while (0)

/* ---- the emulator's hooks -------------------------------------------------------------------------------------- */

enum { QMAX = 64 };
static struct {
  void (*fn)(void *);
  void *arg;
  cudaStream_t stream;
} queue[QMAX];
static int queued, enqueued_total;

void cuemu_enqueue(cudaStream_t s, void (*fn)(void *), const void *arg, size_t size) {
  if (queued == QMAX) {
    printf("test queue overflow\n");
    exit(2);
  }
  void *copy = malloc(size);
  memcpy(copy, arg, size);
  queue[queued].fn = fn, queue[queued].arg = copy, queue[queued].stream = s;
  queued++, enqueued_total++;
}

static void drain(void) {
  for (int i = 0; i < queued; i++) {
    queue[i].fn(queue[i].arg);
    memset(queue[i].arg, 0xab, 1);  // nothing may keep using it
    free(queue[i].arg);
  }
  queued = 0;
}

enum { RMAX = 64 };
static struct {
  const unsigned char *p;
  size_t n;
} regions[RMAX];

static void region_add(const void *p, size_t n) {
  for (int i = 0; i < RMAX; i++)
    if (!regions[i].p) {
      regions[i].p = p, regions[i].n = n;
      return;
    }
  printf("test region overflow\n");
  exit(2);
}

static void region_remove(const void *p) {
  for (int i = 0; i < RMAX; i++)
    if (regions[i].p == p) regions[i].p = NULL;
}

int cuemu_memory_kind(const void *p, size_t n) {
  const unsigned char *q = p;
  for (int i = 0; i < RMAX; i++)
    if (regions[i].p && q >= regions[i].p && q + n <= regions[i].p + regions[i].n) return 1;
  return 0;
}

static int emu_fails;
static char emu_fail_text[512];

void cuemu_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(emu_fail_text, sizeof emu_fail_text, fmt, ap);
  va_end(ap);
  emu_fails++;
}

/* ---- the test's own number formats (rounded straight from double, to nearest, ties to even) -------------------- */

static uint16_t dbl_to_half(double v) {
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isnan(v)) return 0x7e00;
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < ldexp(1.0, -14)) return sign | (uint16_t)nearbyint(a * ldexp(1.0, 24));  // 1024 is the least normal
  int ex;
  double q = nearbyint(frexp(a, &ex) * 2048.0);  // 11 significant bits, in [1024, 2048]
  if (q == 2048.0) q = 1024.0, ex++;
  int field = ex - 1 + 15;
  if (field >= 31) return sign | 0x7c00;
  return sign | (uint16_t)(field << 10) | (uint16_t)(q - 1024.0);
}

static double half_to_dbl(uint16_t b) {
  int e = (b >> 10) & 31, m = b & 1023;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
  return (b & 0x8000) ? -v : v;
}

static uint16_t dbl_to_bf16(double v) {
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isnan(v)) return 0x7fc0;
  if (a < ldexp(1.0, -126)) return sign | (uint16_t)nearbyint(a * ldexp(1.0, 133));
  int ex;
  double q = nearbyint(frexp(a, &ex) * 256.0);  // 8 significant bits
  if (q == 256.0) q = 128.0, ex++;
  int field = ex - 1 + 127;
  if (field >= 255) return sign | 0x7f80;
  return sign | (uint16_t)(field << 7) | (uint16_t)(q - 128.0);
}

static double bf16_to_dbl(uint16_t b) {
  int e = (b >> 7) & 255, m = b & 127;
  double v = e == 0 ? ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : ldexp(128 + m, e - 134);
  return (b & 0x8000) ? -v : v;
}

static const cudnnDataType_t dtypes[4] = {CUDNN_DATA_FLOAT, CUDNN_DATA_DOUBLE, CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16};
static const char *dtype_str(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT ? "f32" : t == CUDNN_DATA_DOUBLE ? "f64" : t == CUDNN_DATA_HALF ? "f16" : "bf16";
}
static size_t esize(cudnnDataType_t t) { return t == CUDNN_DATA_DOUBLE ? 8 : t == CUDNN_DATA_FLOAT ? 4 : 2; }

/* Relative rounding of one result (a little over half an ulp at the top of a binade, so ~1 ulp) and the smallest
   step (subnormal) of each format. */
static double ulp_rel(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT ? ldexp(1, -23) : t == CUDNN_DATA_DOUBLE ? ldexp(1, -51) : t == CUDNN_DATA_HALF ? ldexp(1, -10) : ldexp(1, -7);
}
static double tiny(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT ? ldexp(1, -149) : t == CUDNN_DATA_DOUBLE ? 0 : t == CUDNN_DATA_HALF ? ldexp(1, -24) : ldexp(1, -133);
}

/* ---- arrays in "device memory" ----------------------------------------------------------------------------------- */

enum { GAP = 0xa5 };  // the bytes between elements, which nothing may write

typedef struct {
  cudnnDataType_t t;
  int64_t size[4], stride[4];
  unsigned char *buf;
  size_t bytes;
} arr_t;

static int64_t arr_numel(const arr_t *a) { return a->size[0] * a->size[1] * a->size[2] * a->size[3]; }

static int64_t arr_off(const arr_t *a, int64_t i) {  // i: the logical (row-major) index
  int64_t off = 0;
  for (int d = 3; d >= 0; d--) {
    off += (i % a->size[d]) * a->stride[d];
    i /= a->size[d];
  }
  return off;
}

static void arr_make(arr_t *a, cudnnDataType_t t, const int64_t size[4], const int64_t stride[4]) {
  a->t = t;
  int64_t last = 0;
  for (int d = 0; d < 4; d++) a->size[d] = size[d], a->stride[d] = stride[d], last += (size[d] - 1) * stride[d];
  a->bytes = (size_t)(last + 1) * esize(t);
  a->buf = malloc(a->bytes + 64);  // a little slack: an overrun past the extent is seen as well
  memset(a->buf, GAP, a->bytes + 64);
  region_add(a->buf, a->bytes);
}

static void arr_free(arr_t *a) {
  region_remove(a->buf);
  free(a->buf);
  a->buf = NULL;
}

static double arr_get(const arr_t *a, int64_t i) {
  const unsigned char *p = a->buf + (size_t)arr_off(a, i) * esize(a->t);
  switch (a->t) {
    case CUDNN_DATA_DOUBLE: {
      double v;
      memcpy(&v, p, 8);
      return v;
    }
    case CUDNN_DATA_FLOAT: {
      float v;
      memcpy(&v, p, 4);
      return v;
    }
    default: {
      uint16_t b;
      memcpy(&b, p, 2);
      return a->t == CUDNN_DATA_HALF ? half_to_dbl(b) : bf16_to_dbl(b);
    }
  }
}

static uint16_t arr_bits16(const arr_t *a, int64_t i) {
  uint16_t b;
  memcpy(&b, a->buf + (size_t)arr_off(a, i) * 2, 2);
  return b;
}

/* Stores v rounded to the array's type; returns the stored value. */
static double arr_set(arr_t *a, int64_t i, double v) {
  unsigned char *p = a->buf + (size_t)arr_off(a, i) * esize(a->t);
  switch (a->t) {
    case CUDNN_DATA_DOUBLE: memcpy(p, &v, 8); break;
    case CUDNN_DATA_FLOAT: {
      float f = (float)v;
      memcpy(p, &f, 4);
      break;
    }
    default: {
      uint16_t b = a->t == CUDNN_DATA_HALF ? dbl_to_half(v) : dbl_to_bf16(v);
      memcpy(p, &b, 2);
      break;
    }
  }
  return arr_get(a, i);
}

static void arr_fill_nan(arr_t *a) {
  for (int64_t i = 0; i < arr_numel(a); i++) memset(a->buf + (size_t)arr_off(a, i) * esize(a->t), 0xff, esize(a->t));
}

/* Whether every byte that is no element's (gaps, slack) still holds GAP. */
static int arr_gaps_intact(const arr_t *a) {
  size_t total = a->bytes + 64, es = esize(a->t);
  unsigned char *mine = calloc(total, 1);
  for (int64_t i = 0; i < arr_numel(a); i++) memset(mine + (size_t)arr_off(a, i) * es, 1, es);
  int ok = 1;
  for (size_t b = 0; b < total && ok; b++)
    if (!mine[b] && a->buf[b] != GAP) ok = 0;
  free(mine);
  return ok;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) {  // in [-1, 1)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) * ldexp(1, -52) - 1.0;
}

static void arr_random(arr_t *a, double *vals) {  // vals: what was stored, packed
  for (int64_t i = 0; i < arr_numel(a); i++) vals[i] = arr_set(a, i, urand());
}

/* ---- problems and layouts ------------------------------------------------------------------------------------------ */

typedef struct {
  const char *name;
  int n, c, h, w, k, r, s, ph, pw, sh, sw, dh, dw, g;
} conv_t;

static const conv_t cases[] = {
    {"odd 3x3 pad1 stride2 dil2", 2, 3, 7, 5, 4, 3, 3, 1, 1, 2, 2, 2, 2, 1},
    {"groups=2 3x2 mixed", 2, 4, 6, 7, 6, 3, 2, 2, 1, 2, 1, 1, 2, 2},
    {"depthwise 3x3", 3, 5, 5, 6, 5, 3, 3, 1, 1, 1, 1, 1, 1, 5},
    {"depthwise x2 2x3 stride2", 2, 3, 6, 5, 6, 2, 3, 0, 1, 2, 2, 1, 1, 3},
    {"stride3 > kernel (gaps)", 1, 2, 8, 8, 3, 2, 2, 0, 0, 3, 3, 1, 1, 1},
    {"1x1 pad2 (padding-only outputs)", 2, 3, 4, 3, 2, 1, 1, 2, 2, 2, 2, 1, 1, 1},
};
enum { NCASES = sizeof cases / sizeof cases[0] };

static int out_size(int in, int k, int pad, int stride, int dil) { return (in + 2 * pad - dil * (k - 1) - 1) / stride + 1; }

enum { L_NCHW, L_NHWC, L_PADDED, L_NFIRST, NLAYOUTS };
static const char *const layout_names[NLAYOUTS] = {"NCHW", "NHWC", "padded", "N-innermost"};

/* Strides of an activation (N, C, H, W) in layout l. */
static void act_strides(int l, const int64_t z[4], int64_t st[4]) {
  const int64_t N = z[0], C = z[1], H = z[2], W = z[3];
  switch (l) {
    case L_NCHW: st[3] = 1, st[2] = W, st[1] = H * W, st[0] = C * H * W; break;
    case L_NHWC: st[1] = 1, st[3] = C, st[2] = W * C, st[0] = H * W * C; break;
    case L_PADDED: st[3] = 1, st[2] = W + 3, st[1] = (W + 3) * H + 2, st[0] = st[1] * C + 7; break;
    default: st[0] = 1, st[3] = N, st[2] = N * W, st[1] = N * W * H; break;
  }
}

/* The filter's packed strides in a cuDNN format. */
static void filter_strides(cudnnTensorFormat_t f, const int64_t z[4], int64_t st[4]) {
  if (f == CUDNN_TENSOR_NCHW) {
    st[3] = 1, st[2] = z[3], st[1] = z[2] * z[3], st[0] = z[1] * z[2] * z[3];
  } else {
    st[1] = 1, st[3] = z[1], st[2] = z[3] * z[1], st[0] = z[2] * z[3] * z[1];
  }
}

/* The reference, by scattering every product x * w of the forward sum: into y, and (weighted by dy) into dx and
   dw. The *a arrays receive the sums of absolute values (the scale of each result's rounding error). */
static void reference(const conv_t *cv, const double *x, const double *w, const double *dy, double *y, double *ya,
                      double *dx, double *dxa, double *dw, double *dwa) {
  const int oh_n = out_size(cv->h, cv->r, cv->ph, cv->sh, cv->dh), ow_n = out_size(cv->w, cv->s, cv->pw, cv->sw, cv->dw);
  const int cg = cv->c / cv->g, kg = cv->k / cv->g;
  memset(y, 0, sizeof(double) * cv->n * cv->k * oh_n * ow_n);
  memset(ya, 0, sizeof(double) * cv->n * cv->k * oh_n * ow_n);
  memset(dx, 0, sizeof(double) * cv->n * cv->c * cv->h * cv->w);
  memset(dxa, 0, sizeof(double) * cv->n * cv->c * cv->h * cv->w);
  memset(dw, 0, sizeof(double) * cv->k * cg * cv->r * cv->s);
  memset(dwa, 0, sizeof(double) * cv->k * cg * cv->r * cv->s);
  for (int n = 0; n < cv->n; n++)
    for (int g = 0; g < cv->g; g++)
      for (int kk = 0; kk < kg; kk++)
        for (int oh = 0; oh < oh_n; oh++)
          for (int ow = 0; ow < ow_n; ow++)
            for (int cc = 0; cc < cg; cc++)
              for (int r = 0; r < cv->r; r++)
                for (int s = 0; s < cv->s; s++) {
                  int k = g * kg + kk, c = g * cg + cc;
                  int ih = oh * cv->sh + r * cv->dh - cv->ph, iw = ow * cv->sw + s * cv->dw - cv->pw;
                  if (ih < 0 || iw < 0 || ih >= cv->h || iw >= cv->w) continue;
                  int yi = ((n * cv->k + k) * oh_n + oh) * ow_n + ow;
                  int xi = ((n * cv->c + c) * cv->h + ih) * cv->w + iw;
                  int wi = ((k * cg + cc) * cv->r + r) * cv->s + s;
                  y[yi] += x[xi] * w[wi], ya[yi] += fabs(x[xi] * w[wi]);
                  dx[xi] += dy[yi] * w[wi], dxa[xi] += fabs(dy[yi] * w[wi]);
                  dw[wi] += dy[yi] * x[xi], dwa[wi] += fabs(dy[yi] * x[xi]);
                }
}

/* ---- calling the fake ---------------------------------------------------------------------------------------------- */

static cudnnHandle_t handle;
static const cudaStream_t STREAM = (cudaStream_t)(uintptr_t)0x5eed;

typedef enum { FWD, BWD_DATA, BWD_FILTER } dir_t;
static const char *const dir_names[3] = {"forward", "backward-data", "backward-filter"};

/* One problem's descriptors. */
typedef struct {
  cudnnTensorDescriptor_t xd, yd;
  cudnnFilterDescriptor_t wd;
  cudnnConvolutionDescriptor_t cd;
} descs_t;

static cudnnStatus_t make_descs(descs_t *d, const conv_t *cv, const arr_t *x, const arr_t *w, const arr_t *y,
                                cudnnTensorFormat_t wf, cudnnDataType_t compute) {
  cudnnStatus_t st;
  memset(d, 0, sizeof *d);
  if ((st = cudnnCreateTensorDescriptor(&d->xd)) || (st = cudnnCreateTensorDescriptor(&d->yd)) ||
      (st = cudnnCreateFilterDescriptor(&d->wd)) || (st = cudnnCreateConvolutionDescriptor(&d->cd)))
    return st;
  if ((st = cudnnSetTensor4dDescriptorEx(d->xd, x->t, (int)x->size[0], (int)x->size[1], (int)x->size[2],
                                         (int)x->size[3], (int)x->stride[0], (int)x->stride[1], (int)x->stride[2],
                                         (int)x->stride[3])))
    return st;
  if ((st = cudnnSetTensor4dDescriptorEx(d->yd, y->t, (int)y->size[0], (int)y->size[1], (int)y->size[2],
                                         (int)y->size[3], (int)y->stride[0], (int)y->stride[1], (int)y->stride[2],
                                         (int)y->stride[3])))
    return st;
  if ((st = cudnnSetFilter4dDescriptor(d->wd, w->t, wf, (int)w->size[0], (int)w->size[1], (int)w->size[2],
                                       (int)w->size[3])))
    return st;
  if ((st = cudnnSetConvolution2dDescriptor(d->cd, cv->ph, cv->pw, cv->sh, cv->sw, cv->dh, cv->dw,
                                            CUDNN_CROSS_CORRELATION, compute)))
    return st;
  if ((st = cudnnSetConvolutionGroupCount(d->cd, cv->g))) return st;
  return cudnnSetConvolutionMathType(d->cd, x->t == CUDNN_DATA_FLOAT ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH);
}

static void destroy_descs(descs_t *d) {
  CHECK(cudnnDestroyConvolutionDescriptor(d->cd) == CUDNN_STATUS_SUCCESS, "destroy conv");
  CHECK(cudnnDestroyFilterDescriptor(d->wd) == CUDNN_STATUS_SUCCESS, "destroy filter");
  CHECK(cudnnDestroyTensorDescriptor(d->yd) == CUDNN_STATUS_SUCCESS, "destroy y");
  CHECK(cudnnDestroyTensorDescriptor(d->xd) == CUDNN_STATUS_SUCCESS, "destroy x");
}

static cudnnDataType_t compute_of(cudnnDataType_t t) { return t == CUDNN_DATA_DOUBLE ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT; }

/* Scaling factors as cuDNN reads them: double for double data, float otherwise. */
typedef union {
  float f;
  double d;
} scale_t;

static void set_scale(scale_t *s, cudnnDataType_t t, double v) {
  if (t == CUDNN_DATA_DOUBLE)
    s->d = v;
  else
    s->f = (float)v;
}

/* Runs one direction with the given descriptors, as conv_cudnn.c does (the heuristic's algorithm, no workspace). */
static cudnnStatus_t call_dir(dir_t dir, const descs_t *d, const arr_t *x, const arr_t *w, const arr_t *y,
                              const scale_t *alpha, const scale_t *beta, int which_algo) {
  switch (dir) {
    case FWD: {
      cudnnConvolutionFwdAlgoPerf_t perf[4];
      int n = 0;
      cudnnStatus_t st = cudnnGetConvolutionForwardAlgorithm_v7(handle, d->xd, d->wd, d->cd, d->yd, 4, &n, perf);
      if (st) return st;
      return cudnnConvolutionForward(handle, alpha, d->xd, x->buf, d->wd, w->buf, d->cd, perf[which_algo % n].algo,
                                     NULL, 0, beta, d->yd, y->buf);
    }
    case BWD_DATA: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[4];
      int n = 0;
      cudnnStatus_t st = cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, d->wd, d->yd, d->cd, d->xd, 4, &n, perf);
      if (st) return st;
      return cudnnConvolutionBackwardData(handle, alpha, d->wd, w->buf, d->yd, y->buf, d->cd,
                                          perf[which_algo % n].algo, NULL, 0, beta, d->xd, x->buf);
    }
    default: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[4];
      int n = 0;
      cudnnStatus_t st = cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, d->xd, d->yd, d->cd, d->wd, 4, &n, perf);
      if (st) return st;
      return cudnnConvolutionBackwardFilter(handle, alpha, d->xd, x->buf, d->yd, y->buf, d->cd,
                                            perf[which_algo % n].algo, NULL, 0, beta, d->wd, w->buf);
    }
  }
}

/* A problem's three arrays in one dtype and layout, with random contents (packed copies in xv, wv, yv). */
typedef struct {
  const conv_t *cv;
  int layout;
  cudnnTensorFormat_t wf;
  arr_t x, w, y;
  double *xv, *wv, *yv;
} prob_t;

static void prob_make(prob_t *p, const conv_t *cv, int layout, cudnnDataType_t t) {
  p->cv = cv;
  p->layout = layout;
  p->wf = layout == L_NHWC ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  int64_t xs[4] = {cv->n, cv->c, cv->h, cv->w}, ws[4] = {cv->k, cv->c / cv->g, cv->r, cv->s},
          ys[4] = {cv->n, cv->k, out_size(cv->h, cv->r, cv->ph, cv->sh, cv->dh),
                   out_size(cv->w, cv->s, cv->pw, cv->sw, cv->dw)},
          st[4];
  act_strides(layout, xs, st);
  arr_make(&p->x, t, xs, st);
  filter_strides(p->wf, ws, st);
  arr_make(&p->w, t, ws, st);
  act_strides(layout, ys, st);
  arr_make(&p->y, t, ys, st);
  p->xv = malloc(sizeof(double) * arr_numel(&p->x));
  p->wv = malloc(sizeof(double) * arr_numel(&p->w));
  p->yv = malloc(sizeof(double) * arr_numel(&p->y));
  arr_random(&p->x, p->xv);
  arr_random(&p->w, p->wv);
  arr_random(&p->y, p->yv);
}

static void prob_free(prob_t *p) {
  arr_free(&p->x), arr_free(&p->w), arr_free(&p->y);
  free(p->xv), free(p->wv), free(p->yv);
}

/* ---- element-wise checks against the reference ----------------------------------------------------------------- */

enum { M_BETA0_NAN, M_BETA1, M_GENERAL, NMODES };
static const char *const mode_names[NMODES] = {"beta 0 over NaN", "beta 1", "alpha -1.5 beta 0.25"};

static long element_checks;

static void check_one(const conv_t *cv, int layout, cudnnDataType_t t, dir_t dir, int mode, int algo_pick) {
  prob_t p;
  prob_make(&p, cv, layout, t);
  arr_t *out = dir == FWD ? &p.y : dir == BWD_DATA ? &p.x : &p.w;
  double *outv = dir == FWD ? p.yv : dir == BWD_DATA ? p.xv : p.wv;
  const int64_t nout = arr_numel(out);
  // The reference from the inputs (the output's own contents are the prior value instead).
  const int64_t ny = arr_numel(&p.y), nx = arr_numel(&p.x), nw = arr_numel(&p.w);
  double *ry = malloc(sizeof(double) * ny), *rya = malloc(sizeof(double) * ny), *rx = malloc(sizeof(double) * nx),
         *rxa = malloc(sizeof(double) * nx), *rw = malloc(sizeof(double) * nw), *rwa = malloc(sizeof(double) * nw);
  reference(cv, p.xv, p.wv, p.yv, ry, rya, rx, rxa, rw, rwa);
  const double *ref = dir == FWD ? ry : dir == BWD_DATA ? rx : rw, *refa = dir == FWD ? rya : dir == BWD_DATA ? rxa : rwa;
  double alpha_v = 1, beta_v = 0;
  if (mode == M_BETA0_NAN) {
    arr_fill_nan(out);
  } else if (mode == M_BETA1) {
    beta_v = 1;
  } else {
    alpha_v = -1.5, beta_v = 0.25;
  }
  // Inputs' bytes, to see they are not written; the output's, to see the call itself computes nothing.
  const arr_t *ins[2] = {dir == FWD ? &p.x : dir == BWD_DATA ? &p.y : &p.x, dir == BWD_FILTER ? &p.y : &p.w};
  unsigned char *in0 = malloc(ins[0]->bytes + 64), *in1 = malloc(ins[1]->bytes + 64), *outb = malloc(out->bytes + 64);
  memcpy(in0, ins[0]->buf, ins[0]->bytes + 64);
  memcpy(in1, ins[1]->buf, ins[1]->bytes + 64);
  memcpy(outb, out->buf, out->bytes + 64);

  descs_t d;
  cudnnStatus_t st = make_descs(&d, cv, &p.x, &p.w, &p.y, p.wf, compute_of(t));
  CHECK(st == CUDNN_STATUS_SUCCESS, "%s %s %s: descriptors: %s", cv->name, layout_names[layout], dtype_str(t),
        cudnnGetErrorString(st));
  scale_t alpha, beta;
  set_scale(&alpha, t, alpha_v);
  set_scale(&beta, t, beta_v);
  const int before = enqueued_total;
  st = call_dir(dir, &d, &p.x, &p.w, &p.y, &alpha, &beta, algo_pick);
  char what[256];
  snprintf(what, sizeof what, "%s [%s, %s, %s, %s]", dir_names[dir], cv->name, layout_names[layout], dtype_str(t),
           mode_names[mode]);
  CHECK(st == CUDNN_STATUS_SUCCESS, "%s: %s", what, cudnnGetErrorString(st));
  CHECK(enqueued_total == before + 1 && queued == 1 && queue[0].stream == STREAM, "%s: not queued once on the stream",
        what);
  CHECK(memcmp(outb, out->buf, out->bytes + 64) == 0, "%s: the output changed at the call", what);
  // The call must have copied what it needs: the descriptors go and alpha / beta are spoiled before it runs.
  destroy_descs(&d);
  set_scale(&alpha, t, NAN);
  set_scale(&beta, t, NAN);
  drain();
  CHECK(emu_fails == 0, "%s: cuemu_fail: %s", what, emu_fail_text);
  int bad = 0;
  for (int64_t i = 0; i < nout; i++) {
    double prior = mode == M_BETA0_NAN ? 0.0 : outv[i];
    double want = alpha_v * ref[i] + beta_v * prior;
    double scale = fabs(alpha_v) * refa[i] + fabs(beta_v * prior);
    double tol = fabs(want) * ulp_rel(t) + tiny(t) + scale * 1e-14;
    double got = arr_get(out, i);
    element_checks++;
    if (!(fabs(got - want) <= tol)) {
      if (bad++ < 3) CHECK(0, "%s: element %lld: got %.17g, want %.17g (tol %.3g)", what, (long long)i, got, want, tol);
    }
  }
  if (bad) printf("  (%s: %d of %lld elements wrong)\n", what, bad, (long long)nout);
  CHECK(arr_gaps_intact(out), "%s: bytes outside the output's elements were written", what);
  CHECK(memcmp(in0, ins[0]->buf, ins[0]->bytes + 64) == 0 && memcmp(in1, ins[1]->buf, ins[1]->bytes + 64) == 0,
        "%s: an input was written", what);
  free(in0), free(in1), free(outb);
  free(ry), free(rya), free(rx), free(rxa), free(rw), free(rwa);
  prob_free(&p);
}

/* ---- adjoint identities and finite differences (float, double) ------------------------------------------------- */

/* Runs dir on p with alpha 1, beta 0, and returns the output's values packed (malloc'd). */
static double *run_packed(prob_t *p, dir_t dir) {
  descs_t d;
  cudnnStatus_t st = make_descs(&d, p->cv, &p->x, &p->w, &p->y, p->wf, compute_of(p->x.t));
  scale_t a, b;
  set_scale(&a, p->x.t, 1.0);
  set_scale(&b, p->x.t, 0.0);
  if (st == CUDNN_STATUS_SUCCESS) st = call_dir(dir, &d, &p->x, &p->w, &p->y, &a, &b, 0);
  CHECK(st == CUDNN_STATUS_SUCCESS, "run_packed %s: %s", dir_names[dir], cudnnGetErrorString(st));
  destroy_descs(&d);
  drain();
  arr_t *out = dir == FWD ? &p->y : dir == BWD_DATA ? &p->x : &p->w;
  double *v = malloc(sizeof(double) * arr_numel(out));
  for (int64_t i = 0; i < arr_numel(out); i++) v[i] = arr_get(out, i);
  return v;
}

static double dot(const double *a, const double *b, int64_t n, double *norm) {
  double s = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  *norm = sqrt(aa * bb);
  return s;
}

static void restore(arr_t *a, const double *v) {
  for (int64_t i = 0; i < arr_numel(a); i++) arr_set(a, i, v[i]);
}

static void check_adjoint(const conv_t *cv, int layout, cudnnDataType_t t) {
  prob_t p;
  prob_make(&p, cv, layout, t);  // x, w and dy (in y) random
  const int64_t nx = arr_numel(&p.x), nw = arr_numel(&p.w), ny = arr_numel(&p.y);
  double *dyv = malloc(sizeof(double) * ny);
  memcpy(dyv, p.yv, sizeof(double) * ny);
  double *dx = run_packed(&p, BWD_DATA);  // x's buffer now holds dx: put x back
  restore(&p.x, p.xv);
  double *dw = run_packed(&p, BWD_FILTER);
  restore(&p.w, p.wv);
  double *y = run_packed(&p, FWD);  // y's buffer now holds y
  double n1, n2, n3;
  double a = dot(y, dyv, ny, &n1), b = dot(p.xv, dx, nx, &n2), c = dot(p.wv, dw, nw, &n3);
  double tol = (t == CUDNN_DATA_DOUBLE ? 1e-13 : 3e-6) * (n1 + n2 + n3);
  CHECK(fabs(a - b) <= tol && fabs(a - c) <= tol, "adjoint [%s, %s, %s]: <y,dy> %.17g <x,dx> %.17g <w,dw> %.17g",
        cv->name, layout_names[layout], dtype_str(t), a, b, c);
  if (t == CUDNN_DATA_DOUBLE) {
    // d<conv(x, w), dy>/dx_i = dx_i and /dw_j = dw_j, by central differences at a few points.
    const double h = 1e-3;
    for (int which = 0; which < 2; which++) {
      arr_t *arr = which ? &p.w : &p.x;
      const double *base = which ? p.wv : p.xv, *grad = which ? dw : dx;
      const int64_t n = which ? nw : nx;
      const int64_t pts[4] = {0, n / 3, (2 * n) / 3, n - 1};
      for (int q = 0; q < 4; q++) {
        const int64_t i = pts[q];
        double f[2];
        for (int sgn = 0; sgn < 2; sgn++) {
          arr_set(arr, i, base[i] + (sgn ? -h : h));
          double *yy = run_packed(&p, FWD), nn;
          f[sgn] = dot(yy, dyv, ny, &nn);
          free(yy);
        }
        arr_set(arr, i, base[i]);
        double fd = (f[0] - f[1]) / (2 * h);
        CHECK(fabs(fd - grad[i]) <= 1e-9 * (1 + fabs(grad[i])), "finite difference [%s, %s] d/d%s[%lld]: %.17g vs %.17g",
              cv->name, layout_names[layout], which ? "w" : "x", (long long)i, fd, grad[i]);
      }
    }
  }
  free(dyv), free(dx), free(dw), free(y);
  prob_free(&p);
}

/* ---- rounding of half and bfloat16 results ----------------------------------------------------------------------
   y[n] = wa * a[n] + wb * b[n] (a 1x1 convolution over 2 channels), with sums chosen to be ties, subnormals,
   overflows and NaN; each result's bits must be the test's own rounding of the exact sum. */

static void check_rounding(cudnnDataType_t t) {
  const int half = t == CUDNN_DATA_HALF;
  // {a, b, wa, wb}: the sum wa a + wb b is exact in double and float.
  const double hmax = 65504, bmax = ldexp(255, 120);  // (2 - 2^-7) 2^127
  const double rows_h[][4] = {
      {1, ldexp(1, -11), 1, 1},                   // tie at 1: stays 1 (even)
      {1 + ldexp(1, -10), ldexp(1, -11), 1, 1},   // tie above an odd mantissa: up
      {1 + ldexp(1, -10), ldexp(1, -12), 1, 1},   // below the tie: down
      {ldexp(1, -24), 0, 0.5, 1},                 // half the least subnormal: 0 (even)
      {ldexp(3, -24), 0, 0.5, 1},                 // 1.5 subnormal units: 2
      {ldexp(5, -24), 0, 0.5, 1},                 // 2.5 units: 2
      {ldexp(3, -24), 0, 0.25, 1},                // 0.75 units: 1
      {ldexp(1023, -24), ldexp(1, -24), 1, 0.5},  // largest subnormal + half a unit: the least normal
      {hmax, 16, 1, 1},                           // 65520: inf
      {hmax, 8, 1, 1},                            // 65512: 65504
      {-hmax, -16, 1, 1},                         // -inf
      {NAN, 1, 1, 1},                             // NaN
      {-2.5, 0.75, 1, 1},                         // exact
  };
  const double rows_b[][4] = {
      {1, ldexp(1, -8), 1, 1},
      {1 + ldexp(1, -7), ldexp(1, -8), 1, 1},
      {1 + ldexp(1, -7), ldexp(1, -9), 1, 1},
      {ldexp(1, -133), 0, 0.5, 1},
      {ldexp(3, -133), 0, 0.5, 1},
      {ldexp(5, -133), 0, 0.5, 1},
      {ldexp(3, -133), 0, 0.25, 1},
      {ldexp(127, -133), ldexp(1, -133), 1, 0.5},
      {bmax, ldexp(1, 119), 1, 1},  // tie past the largest: inf
      {bmax, ldexp(1, 118), 1, 1},  // below: the largest
      {-bmax, -ldexp(1, 119), 1, 1},
      {NAN, 1, 1, 1},
      {-2.5, 0.75, 1, 1},
  };
  const double(*rows)[4] = half ? rows_h : rows_b;
  const int nr = (int)(sizeof rows_h / sizeof rows_h[0]);
  _Static_assert(sizeof rows_h == sizeof rows_b, "as many rows");
  // One problem per weight pair: N = nr rows, C = 2, 1x1.
  for (int i = 0; i < nr; i++) {
    conv_t cv = {"rounding", 1, 2, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1};
    int64_t xs[4] = {1, 2, 1, 1}, ws[4] = {1, 2, 1, 1}, ys[4] = {1, 1, 1, 1}, st[4];
    arr_t x, w, y;
    act_strides(L_NCHW, xs, st);
    arr_make(&x, t, xs, st);
    filter_strides(CUDNN_TENSOR_NCHW, ws, st);
    arr_make(&w, t, ws, st);
    act_strides(L_NCHW, ys, st);
    arr_make(&y, t, ys, st);
    double a = arr_set(&x, 0, rows[i][0]), b = arr_set(&x, 1, rows[i][1]);
    double wa = arr_set(&w, 0, rows[i][2]), wb = arr_set(&w, 1, rows[i][3]);
    CHECK((a == rows[i][0] || isnan(a)) && b == rows[i][1] && wa == rows[i][2] && wb == rows[i][3],
          "rounding %s row %d: inputs not representable", dtype_str(t), i);
    arr_fill_nan(&y);
    descs_t d;
    cudnnStatus_t s = make_descs(&d, &cv, &x, &w, &y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT);
    scale_t al, be;
    set_scale(&al, t, 1.0);
    set_scale(&be, t, 0.0);
    if (s == CUDNN_STATUS_SUCCESS) s = call_dir(FWD, &d, &x, &w, &y, &al, &be, 0);
    CHECK(s == CUDNN_STATUS_SUCCESS, "rounding: %s", cudnnGetErrorString(s));
    destroy_descs(&d);
    drain();
    double exact = wa * a + wb * b;
    uint16_t want = half ? dbl_to_half(exact) : dbl_to_bf16(exact), got = arr_bits16(&y, 0);
    if (isnan(exact))
      CHECK(isnan(arr_get(&y, 0)), "rounding %s row %d: NaN expected, got 0x%04x", dtype_str(t), i, got);
    else
      CHECK(got == want, "rounding %s row %d: %.17g gave 0x%04x, want 0x%04x", dtype_str(t), i, exact, got, want);
    arr_free(&x), arr_free(&w), arr_free(&y);
  }
}

/* ---- the rest of the API, and refusals ---------------------------------------------------------------------------- */

static int refused(cudnnStatus_t st) { return st == CUDNN_STATUS_BAD_PARAM || st == CUDNN_STATUS_NOT_SUPPORTED; }

static int last_error_nonempty_then_cleared(void) {
  char buf[512], buf2[512];
  cudnnGetLastErrorString(buf, sizeof buf);
  cudnnGetLastErrorString(buf2, sizeof buf2);
  printf("  refusal message: %s\n", buf);
  return buf[0] != 0 && buf2[0] == 0;
}

static void check_api(void) {
  size_t v = cudnnGetVersion();
  CHECK(v >= 90000 && v < 100000, "version %zu", v);
  CHECK(strcmp(cudnnGetErrorString(CUDNN_STATUS_SUCCESS), "CUDNN_STATUS_SUCCESS") == 0, "error string");
  CHECK(strcmp(cudnnGetErrorString(CUDNN_STATUS_NOT_SUPPORTED), "CUDNN_STATUS_NOT_SUPPORTED") == 0, "error string");
  CHECK(cudnnGetErrorString((cudnnStatus_t)12345) != NULL, "error string of an unknown status");
  CHECK(cudnnDestroyTensorDescriptor(NULL) == CUDNN_STATUS_SUCCESS, "destroying NULL");
  int n = 0;
  CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &n) == CUDNN_STATUS_SUCCESS && n >= 1, "fwd max count");
  CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &n) == CUDNN_STATUS_SUCCESS && n >= 1, "bwd-data max");
  CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &n) == CUDNN_STATUS_SUCCESS && n >= 1,
        "bwd-filter max");

  // A default-stream handle queues on stream 0.
  {
    cudnnHandle_t h0;
    CHECK(cudnnCreate(&h0) == CUDNN_STATUS_SUCCESS, "create");
    prob_t p;
    prob_make(&p, &cases[0], L_NCHW, CUDNN_DATA_FLOAT);
    descs_t d;
    make_descs(&d, p.cv, &p.x, &p.w, &p.y, p.wf, CUDNN_DATA_FLOAT);
    float one = 1, zero = 0;
    CHECK(cudnnConvolutionForward(h0, &one, d.xd, p.x.buf, d.wd, p.w.buf, d.cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
                                  NULL, 0, &zero, d.yd, p.y.buf) == CUDNN_STATUS_SUCCESS &&
              queued == 1 && queue[0].stream == NULL,
          "default stream");
    drain();
    destroy_descs(&d);
    prob_free(&p);
    CHECK(cudnnDestroy(h0) == CUDNN_STATUS_SUCCESS, "destroy");
  }

  // Find*Ex: algorithms that succeed with no workspace, and the output (only its elements) left NaN.
  for (int dir = 0; dir < 3; dir++) {
    prob_t p;
    prob_make(&p, &cases[1], L_PADDED, CUDNN_DATA_HALF);
    descs_t d;
    make_descs(&d, p.cv, &p.x, &p.w, &p.y, p.wf, CUDNN_DATA_FLOAT);
    int got = 0, ok = 1;
    cudnnStatus_t st;
    if (dir == FWD) {
      cudnnConvolutionFwdAlgoPerf_t r[8];
      st = cudnnFindConvolutionForwardAlgorithmEx(handle, d.xd, p.x.buf, d.wd, p.w.buf, d.cd, d.yd, p.y.buf, 8, &got, r,
                                                  NULL, 0);
      for (int i = 0; i < got; i++) ok &= r[i].status == CUDNN_STATUS_SUCCESS && r[i].memory == 0;
    } else if (dir == BWD_DATA) {
      cudnnConvolutionBwdDataAlgoPerf_t r[8];
      st = cudnnFindConvolutionBackwardDataAlgorithmEx(handle, d.wd, p.w.buf, d.yd, p.y.buf, d.cd, d.xd, p.x.buf, 8,
                                                       &got, r, NULL, 0);
      for (int i = 0; i < got; i++) ok &= r[i].status == CUDNN_STATUS_SUCCESS && r[i].memory == 0;
    } else {
      cudnnConvolutionBwdFilterAlgoPerf_t r[8];
      st = cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, d.xd, p.x.buf, d.yd, p.y.buf, d.cd, d.wd, p.w.buf, 8,
                                                         &got, r, NULL, 0);
      for (int i = 0; i < got; i++) ok &= r[i].status == CUDNN_STATUS_SUCCESS && r[i].memory == 0;
    }
    CHECK(st == CUDNN_STATUS_SUCCESS && got >= 1 && got <= 2 && ok, "find %s", dir_names[dir]);
    destroy_descs(&d);
    drain();
    arr_t *out = dir == FWD ? &p.y : dir == BWD_DATA ? &p.x : &p.w;
    int all_nan = 1;
    for (int64_t i = 0; i < arr_numel(out); i++) all_nan &= isnan(arr_get(out, i));
    CHECK(all_nan && arr_gaps_intact(out), "find %s: output not NaN-filled (or gaps written)", dir_names[dir]);
    prob_free(&p);
  }

  // Refusals: each CUDNN_STATUS_BAD_PARAM or CUDNN_STATUS_NOT_SUPPORTED (with a message), and nothing queued.
  const int before = enqueued_total;
  prob_t p;
  prob_make(&p, &cases[0], L_NCHW, CUDNN_DATA_FLOAT);
  descs_t d;
  CHECK(make_descs(&d, p.cv, &p.x, &p.w, &p.y, p.wf, CUDNN_DATA_FLOAT) == CUDNN_STATUS_SUCCESS, "descriptors");
  float one = 1, zero = 0;
#define FWD_CALL(xd_, x_, wd_, cd_, algo_, alpha_, yd_, y_)                                                         \
  cudnnConvolutionForward(handle, alpha_, xd_, x_, wd_, p.w.buf, cd_, algo_, NULL, 0, &zero, yd_, y_)
  const cudnnConvolutionFwdAlgo_t A0 = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  cudnnStatus_t st;

  cudnnConvolutionDescriptor_t cd2;
  cudnnCreateConvolutionDescriptor(&cd2);
  st = cudnnSetConvolution2dDescriptor(cd2, 1, 1, 2, 2, 2, 2, CUDNN_CONVOLUTION, CUDNN_DATA_FLOAT);
  CHECK(refused(st) && last_error_nonempty_then_cleared(), "CUDNN_CONVOLUTION accepted");
  st = cudnnSetConvolution2dDescriptor(cd2, -1, 1, 2, 2, 2, 2, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
  CHECK(refused(st), "negative padding accepted");
  st = cudnnSetConvolution2dDescriptor(cd2, 1, 1, 0, 2, 2, 2, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
  CHECK(refused(st), "stride 0 accepted");
  st = FWD_CALL(d.xd, p.x.buf, d.wd, cd2, A0, &one, d.yd, p.y.buf);
  CHECK(refused(st), "a never-set convolution descriptor accepted");
  CHECK(refused(cudnnSetConvolutionGroupCount(cd2, 0)), "0 groups accepted");
  CHECK(refused(cudnnSetConvolutionMathType(cd2, (cudnnMathType_t)17)), "bad math type accepted");

  // groups that do not divide C (3 channels, 2 groups): the filter's C/g cannot match
  cudnnSetConvolution2dDescriptor(cd2, 1, 1, 2, 2, 2, 2, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT);
  cudnnSetConvolutionGroupCount(cd2, 2);
  st = FWD_CALL(d.xd, p.x.buf, d.wd, cd2, A0, &one, d.yd, p.y.buf);
  CHECK(refused(st) && last_error_nonempty_then_cleared(), "mismatched groups accepted");
  // compute double for float data, compute half (true half) for half data
  cudnnSetConvolutionGroupCount(cd2, 1);
  cudnnSetConvolution2dDescriptor(cd2, 1, 1, 2, 2, 2, 2, CUDNN_CROSS_CORRELATION, CUDNN_DATA_DOUBLE);
  st = FWD_CALL(d.xd, p.x.buf, d.wd, cd2, A0, &one, d.yd, p.y.buf);
  CHECK(refused(st), "float data with double compute accepted");
  {
    prob_t q;
    prob_make(&q, &cases[0], L_NCHW, CUDNN_DATA_HALF);
    descs_t e;
    st = make_descs(&e, q.cv, &q.x, &q.w, &q.y, q.wf, CUDNN_DATA_HALF);
    CHECK(st == CUDNN_STATUS_SUCCESS, "true-half descriptors");
    cudnnConvolutionFwdAlgoPerf_t r[2];
    int got = -1;
    st = cudnnGetConvolutionForwardAlgorithm_v7(handle, e.xd, e.wd, e.cd, e.yd, 2, &got, r);
    CHECK(st == CUDNN_STATUS_NOT_SUPPORTED, "true half listed: %s",
          cudnnGetErrorString(st));
    st = cudnnConvolutionForward(handle, &one, e.xd, q.x.buf, e.wd, q.w.buf, e.cd, A0, NULL, 0, &zero, e.yd, q.y.buf);
    CHECK(refused(st), "true half accepted");
    destroy_descs(&e);
    prob_free(&q);
  }
  cudnnDestroyConvolutionDescriptor(cd2);

  // y of the wrong shape (one row too many)
  cudnnTensorDescriptor_t yd2;
  cudnnCreateTensorDescriptor(&yd2);
  cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_FLOAT, 2, 4, 4, 2, 32, 8, 2, 1);
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, yd2, p.y.buf);
  CHECK(refused(st) && last_error_nonempty_then_cleared(), "wrong output shape accepted");
  // y overlapping itself (H and W strides both 1)
  cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_FLOAT, 2, 4, 3, 2, 24, 6, 1, 1);
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, yd2, p.y.buf);
  CHECK(refused(st), "self-overlapping output accepted");
  // y of another type
  cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_HALF, 2, 4, 3, 2, 24, 6, 2, 1);
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, yd2, p.y.buf);
  CHECK(refused(st), "mixed data types accepted");
  CHECK(refused(cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_FLOAT, 2, 0, 3, 2, 24, 6, 2, 1)),
        "a zero size accepted");
  CHECK(refused(cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_FLOAT, 2, 4, 3, 2, 24, 6, -2, 1)),
        "a negative stride accepted");
  CHECK(refused(cudnnSetTensor4dDescriptorEx(yd2, CUDNN_DATA_INT8, 2, 4, 3, 2, 24, 6, 2, 1)),
        "int8 accepted");
  cudnnDestroyTensorDescriptor(yd2);
  // filter formats
  cudnnFilterDescriptor_t wd2;
  cudnnCreateFilterDescriptor(&wd2);
  CHECK(refused(cudnnSetFilter4dDescriptor(wd2, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW_VECT_C, 4, 3, 3, 3)),
        "NCHW_VECT_C accepted");
  cudnnDestroyFilterDescriptor(wd2);
  // in place: the output over an input
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, d.yd, p.x.buf + 8);
  CHECK(refused(st), "an output overlapping an input accepted");
  // an algorithm not listed, NULL pointers
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, CUDNN_CONVOLUTION_FWD_ALGO_FFT, &one, d.yd, p.y.buf);
  CHECK(refused(st), "an unlisted algorithm accepted");
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, NULL, d.yd, p.y.buf);
  CHECK(refused(st), "NULL alpha accepted");
  st = FWD_CALL(d.xd, NULL, d.wd, d.cd, A0, &one, d.yd, p.y.buf);
  CHECK(refused(st), "NULL x accepted");
  st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, NULL, p.y.buf);
  CHECK(refused(st), "NULL descriptor accepted");
  CHECK(enqueued_total == before && queued == 0, "a refused call queued work");

  // Memory that is not the device's: accepted at the call (as cuDNN would), reported when the work runs, unwritten.
  {
    unsigned char *host = malloc(p.y.bytes);
    memset(host, GAP, p.y.bytes);
    st = FWD_CALL(d.xd, p.x.buf, d.wd, d.cd, A0, &one, d.yd, host);
    CHECK(st == CUDNN_STATUS_SUCCESS, "host output at the call: %s", cudnnGetErrorString(st));
    drain();
    int untouched = 1;
    for (size_t i = 0; i < p.y.bytes; i++) untouched &= host[i] == GAP;
    CHECK(emu_fails == 1 && untouched, "host output: %d reports (%s)", emu_fails, emu_fail_text);
    emu_fails = 0;
    free(host);
  }
#undef FWD_CALL
  destroy_descs(&d);
  prob_free(&p);
}

int main(void) {
  CHECK(cudnnCreate(&handle) == CUDNN_STATUS_SUCCESS, "cudnnCreate");
  CHECK(cudnnSetStream(handle, STREAM) == CUDNN_STATUS_SUCCESS, "cudnnSetStream");

  int runs = 0, algo_pick = 0;
  for (int c = 0; c < NCASES; c++)
    for (int l = 0; l < NLAYOUTS; l++)
      for (int t = 0; t < 4; t++)
        for (int dir = 0; dir < 3; dir++)
          for (int m = 0; m < NMODES; m++, runs++) check_one(&cases[c], l, dtypes[t], (dir_t)dir, m, algo_pick++);
  printf("element-wise: %d runs (%d shapes x %d layouts x 4 dtypes x 3 directions x %d alpha/beta modes), %ld "
         "elements\n",
         runs, NCASES, NLAYOUTS, NMODES, element_checks);

  int adj = 0;
  for (int c = 0; c < NCASES; c++)
    for (int l = 0; l < NLAYOUTS; l++)
      for (int t = 0; t < 2; t++, adj++) check_adjoint(&cases[c], l, dtypes[t]);
  printf("adjoint identities: %d (f32, f64), finite differences on the f64 ones\n", adj);

  check_rounding(CUDNN_DATA_HALF);
  check_rounding(CUDNN_DATA_BFLOAT16);
  printf("rounding: half and bfloat16 ties, subnormals, overflow, NaN\n");

  check_api();
  printf("API and refusals\n");

  CHECK(cudnnDestroy(handle) == CUDNN_STATUS_SUCCESS, "cudnnDestroy");
  printf("%s: %d checks, %d failures\n", failures ? "FAIL" : "OK", checks, failures);
  return failures != 0;
}

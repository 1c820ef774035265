/* 2-D convolution on CUDA through cuDNN, the conv table's kernels (kernels/conv.h): forward, backward-data,
   backward-weights on operands host/ops/conv.c staged in one packed format (the bias is left to it); each
   problem's algorithm benchmarked once (cudnnFind*Ex) and cached. */
#include <cuda_runtime_api.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "kernels/conv.h"
#include "cuda/cudnn_api.h"

/* Memory formats (FMT_*, kernels/conv.h): cuDNN's filter descriptors only take the packed NCHW/NHWC layouts, and
   its fast kernels want activations and weights in the same one: the caps below ask the front door for one
   format per call. */

/* ---- one cuDNN call -----------------------------------------------------------------------------------------------
   A problem is everything cuDNN's choice of algorithm depends on. Built on a zeroed struct, so memcmp and the hash
   see no padding junk. */

typedef enum { DIR_FWD = 0, DIR_BWD_DATA = 1, DIR_BWD_FILTER = 2 } dir_t;

typedef struct {
  int32_t dir, device, dtype, fmt, math, align;
  int32_t n, c, h, w, o, kh, kw, oh, ow;
  int32_t sh, sw, ph, pw, dh, dw, g;
} problem_t;

typedef struct {
  problem_t p;
  uint64_t hash;
  int algo; /* -1: cuDNN has none for this problem (the caller may try the other format) */
  cudnnMathType_t math;
  size_t ws;
} choice_t;

/* Enough for every convolution of a few large models in each direction; past it the oldest choices go. */
enum { CACHE_MAX = 2048 };
static choice_t cache[CACHE_MAX];
static int cache_n, cache_next;
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t problem_hash(const problem_t *p) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < sizeof *p; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static int cache_get(const problem_t *p, uint64_t h, choice_t *out) {
  int found = 0;
  pthread_mutex_lock(&cache_mu);
  for (int i = 0; i < cache_n && !found; i++)
    if (cache[i].hash == h && memcmp(&cache[i].p, p, sizeof *p) == 0) {
      *out = cache[i];
      found = 1;
    }
  pthread_mutex_unlock(&cache_mu);
  return found;
}

static void cache_put(const choice_t *c) {
  pthread_mutex_lock(&cache_mu);
  int slot = -1;
  for (int i = 0; i < cache_n && slot < 0; i++)
    if (cache[i].hash == c->hash && memcmp(&cache[i].p, &c->p, sizeof c->p) == 0) slot = i;  // another thread's
  if (slot < 0 && cache_n < CACHE_MAX) slot = cache_n++;
  if (slot < 0) {
    slot = cache_next;
    cache_next = (cache_next + 1) % CACHE_MAX;
  }
  cache[slot] = *c;
  pthread_mutex_unlock(&cache_mu);
}

/* The descriptors and buffers of one call. Pointers: x (N, C, H, W), w (O, C/g, kH, kW), y (N, O, OH, OW), each
   the input or the output depending on the direction. */
typedef struct {
  const char *op;
  const char *ctx; /* the operands, for error messages */
  const dlua_cudnn_api_t *api;
  cudnnHandle_t h;
  cudnnTensorDescriptor_t xd, yd;
  cudnnFilterDescriptor_t wd;
  cudnnConvolutionDescriptor_t cd;
  problem_t p;
  void *x, *w, *y;
} call_t;

#define CUDNN_TRY(call, what)                                         \
  do {                                                                \
    cudnnStatus_t st_ = (call);                                       \
    if (st_ != CUDNN_STATUS_SUCCESS) {                                \
      s = dlua_cudnn_fail(c->op, st_, what, c->ctx);                  \
      goto done;                                                      \
    }                                                                 \
  } while (0)

static cudnnDataType_t cudnn_dtype(int dtype) {
  switch (dtype) {
    case DLUA_DTYPE_F64: return CUDNN_DATA_DOUBLE;
    case DLUA_DTYPE_F16: return CUDNN_DATA_HALF;
    case DLUA_DTYPE_BF16: return CUDNN_DATA_BFLOAT16;
    default: return CUDNN_DATA_FLOAT;
  }
}

static size_t elsize(int dtype) { return dlua_dtype_size((dlua_dtype_t)dtype); }

static dlua_status_t set_tensor(call_t *c, cudnnTensorDescriptor_t d, int32_t n, int32_t ch, int32_t hh, int32_t ww) {
  dlua_status_t s = DLUA_OK;
  int64_t sz[4] = {n, ch, hh, ww}, st[4];
  act_strides(4, sz, c->p.fmt, st);
  CUDNN_TRY(c->api->cudnnSetTensor4dDescriptorEx(d, cudnn_dtype(c->p.dtype), n, ch, hh, ww, (int)st[0], (int)st[1],
                                                 (int)st[2], (int)st[3]),
            "cudnnSetTensor4dDescriptorEx");
done:
  return s;
}

static dlua_status_t make_descriptors(call_t *c) {
  dlua_status_t s = DLUA_OK;
  const problem_t *p = &c->p;
  CUDNN_TRY(c->api->cudnnCreateTensorDescriptor(&c->xd), "cudnnCreateTensorDescriptor");
  CUDNN_TRY(c->api->cudnnCreateTensorDescriptor(&c->yd), "cudnnCreateTensorDescriptor");
  CUDNN_TRY(c->api->cudnnCreateFilterDescriptor(&c->wd), "cudnnCreateFilterDescriptor");
  CUDNN_TRY(c->api->cudnnCreateConvolutionDescriptor(&c->cd), "cudnnCreateConvolutionDescriptor");
  DLUA_TRY(set_tensor(c, c->xd, p->n, p->c, p->h, p->w));
  DLUA_TRY(set_tensor(c, c->yd, p->n, p->o, p->oh, p->ow));
  CUDNN_TRY(c->api->cudnnSetFilter4dDescriptor(c->wd, cudnn_dtype(p->dtype),
                                               p->fmt == FMT_NHWC ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, p->o,
                                               p->c / p->g, p->kh, p->kw),
            "cudnnSetFilter4dDescriptor");
  // f16/bf16 accumulate in f32 (cuDNN's "pseudo-half" configuration), f64 in f64.
  CUDNN_TRY(c->api->cudnnSetConvolution2dDescriptor(c->cd, p->ph, p->pw, p->sh, p->sw, p->dh, p->dw,
                                                    CUDNN_CROSS_CORRELATION,
                                                    p->dtype == DLUA_DTYPE_F64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT),
            "cudnnSetConvolution2dDescriptor");
  CUDNN_TRY(c->api->cudnnSetConvolutionGroupCount(c->cd, p->g), "cudnnSetConvolutionGroupCount");
  CUDNN_TRY(c->api->cudnnSetConvolutionMathType(c->cd, (cudnnMathType_t)p->math), "cudnnSetConvolutionMathType");
done:
  return s;
}

static void destroy_descriptors(call_t *c) {
  if (!c->api) return;
  if (c->cd) c->api->cudnnDestroyConvolutionDescriptor(c->cd);
  if (c->wd) c->api->cudnnDestroyFilterDescriptor(c->wd);
  if (c->yd) c->api->cudnnDestroyTensorDescriptor(c->yd);
  if (c->xd) c->api->cudnnDestroyTensorDescriptor(c->xd);
}

/* What cuDNN says of one algorithm; the three directions' perf structs have these fields alike. */
typedef struct {
  int algo;
  cudnnStatus_t status;
  size_t memory;
  cudnnMathType_t math;
} perf_t;

enum { MAX_ALGOS = 16 };
/* Workspace offered to the benchmark: the most any listed algorithm wants, at most this, less if memory is short. */
static const size_t WS_CAP = (size_t)1 << 30;

/* A listing call: CUDNN_STATUS_NOT_SUPPORTED means an empty list (the caller may try the other format). */
#define CUDNN_LIST(call, what)                                        \
  do {                                                                \
    cudnnStatus_t st_ = (call);                                       \
    if (st_ == CUDNN_STATUS_NOT_SUPPORTED) goto done;                 \
    if (st_ != CUDNN_STATUS_SUCCESS) {                                \
      s = dlua_cudnn_fail(c->op, st_, what, c->ctx);                  \
      goto done;                                                      \
    }                                                                 \
  } while (0)

#define COPY_PERF(src, n, dst)                                                  \
  for (int i_ = 0; i_ < (n); i_++) {                                            \
    (dst)[i_] = (perf_t){(int)(src)[i_].algo, (src)[i_].status, (src)[i_].memory, \
                         (src)[i_].mathType};                                   \
  }

/* cuDNN's heuristic ranking (nothing runs): every algorithm it knows with its workspace. */
static dlua_status_t heuristic(call_t *c, perf_t *out, int *n) {
  dlua_status_t s = DLUA_OK;
  int max = 0, got = 0;
  *n = 0;
  switch (c->p.dir) {
    case DIR_FWD: {
      cudnnConvolutionFwdAlgoPerf_t r[MAX_ALGOS];
      CUDNN_TRY(c->api->cudnnGetConvolutionForwardAlgorithmMaxCount(c->h, &max),
                "cudnnGetConvolutionForwardAlgorithmMaxCount");
      if (max > MAX_ALGOS) max = MAX_ALGOS;
      CUDNN_LIST(c->api->cudnnGetConvolutionForwardAlgorithm_v7(c->h, c->xd, c->wd, c->cd, c->yd, max, &got, r),
                "cudnnGetConvolutionForwardAlgorithm_v7");
      COPY_PERF(r, got, out);
      break;
    }
    case DIR_BWD_DATA: {
      cudnnConvolutionBwdDataAlgoPerf_t r[MAX_ALGOS];
      CUDNN_TRY(c->api->cudnnGetConvolutionBackwardDataAlgorithmMaxCount(c->h, &max),
                "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
      if (max > MAX_ALGOS) max = MAX_ALGOS;
      CUDNN_LIST(c->api->cudnnGetConvolutionBackwardDataAlgorithm_v7(c->h, c->wd, c->yd, c->cd, c->xd, max, &got, r),
                "cudnnGetConvolutionBackwardDataAlgorithm_v7");
      COPY_PERF(r, got, out);
      break;
    }
    default: {
      cudnnConvolutionBwdFilterAlgoPerf_t r[MAX_ALGOS];
      CUDNN_TRY(c->api->cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(c->h, &max),
                "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
      if (max > MAX_ALGOS) max = MAX_ALGOS;
      CUDNN_LIST(c->api->cudnnGetConvolutionBackwardFilterAlgorithm_v7(c->h, c->xd, c->yd, c->cd, c->wd, max, &got, r),
                "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
      COPY_PERF(r, got, out);
      break;
    }
  }
  *n = got;
done:
  return s;
}

/* cuDNN's benchmark: runs each algorithm that fits in ws_bytes on the call's buffers, fastest first. out_scratch
   (may be NULL) stands in for the output, whose contents the runs destroy. */
static dlua_status_t benchmark(call_t *c, void *out_scratch, void *ws, size_t ws_bytes, perf_t *out, int *n) {
  dlua_status_t s = DLUA_OK;
  int got = 0;
  *n = 0;
  switch (c->p.dir) {
    case DIR_FWD: {
      cudnnConvolutionFwdAlgoPerf_t r[MAX_ALGOS];
      CUDNN_LIST(c->api->cudnnFindConvolutionForwardAlgorithmEx(c->h, c->xd, c->x, c->wd, c->w, c->cd, c->yd,
                                                               out_scratch ? out_scratch : c->y, MAX_ALGOS, &got, r,
                                                               ws, ws_bytes),
                "cudnnFindConvolutionForwardAlgorithmEx");
      COPY_PERF(r, got, out);
      break;
    }
    case DIR_BWD_DATA: {
      cudnnConvolutionBwdDataAlgoPerf_t r[MAX_ALGOS];
      CUDNN_LIST(c->api->cudnnFindConvolutionBackwardDataAlgorithmEx(c->h, c->wd, c->w, c->yd, c->y, c->cd, c->xd,
                                                                    out_scratch ? out_scratch : c->x, MAX_ALGOS, &got,
                                                                    r, ws, ws_bytes),
                "cudnnFindConvolutionBackwardDataAlgorithmEx");
      COPY_PERF(r, got, out);
      break;
    }
    default: {
      cudnnConvolutionBwdFilterAlgoPerf_t r[MAX_ALGOS];
      CUDNN_LIST(c->api->cudnnFindConvolutionBackwardFilterAlgorithmEx(c->h, c->xd, c->x, c->yd, c->y, c->cd, c->wd,
                                                                      out_scratch ? out_scratch : c->w, MAX_ALGOS,
                                                                      &got, r, ws, ws_bytes),
                "cudnnFindConvolutionBackwardFilterAlgorithmEx");
      COPY_PERF(r, got, out);
      break;
    }
  }
  *n = got;
done:
  return s;
}

/* Bytes of the direction's output. */
static size_t output_bytes(const problem_t *p) {
  size_t e = elsize(p->dtype);
  switch (p->dir) {
    case DIR_FWD: return (size_t)p->n * p->o * p->oh * p->ow * e;
    case DIR_BWD_DATA: return (size_t)p->n * p->c * p->h * p->w * e;
    default: return (size_t)p->o * (p->c / p->g) * p->kh * p->kw * e;
  }
}

/* Picks the fastest algorithm whose workspace the device can give, by benchmark (once per problem); algo -1 when
   none runs. */
static dlua_status_t choose(call_t *c, int output_live, choice_t *ch) {
  const int device = c->p.device;
  perf_t hp[MAX_ALGOS], bp[MAX_ALGOS];
  int nh = 0, nb = 0;
  DLUA_TRY(heuristic(c, hp, &nh));
  size_t want = 0;
  for (int i = 0; i < nh; i++)
    if (hp[i].status == CUDNN_STATUS_SUCCESS && hp[i].memory > want) want = hp[i].memory;
  if (want > WS_CAP) want = WS_CAP;
  // As much of it as the allocator gives: halve on out-of-memory, down to no workspace at all.
  void *ws = NULL;
  size_t ws_bytes = want;
  while (ws_bytes > 0) {
    if (dlua_cuda_malloc(&ws, device, ws_bytes, NULL) == DLUA_OK) break;
    dlua_clear_error();
    ws = NULL;
    ws_bytes = ws_bytes > ((size_t)1 << 20) ? ws_bytes / 2 : 0;
  }
  // When the output must survive (accumulation into it), the benchmark writes a scratch copy instead.
  void *scratch = NULL;
  dlua_status_t s = DLUA_OK;
  if (output_live) s = dlua_cuda_malloc(&scratch, device, output_bytes(&c->p), NULL);
  if (s == DLUA_OK) s = benchmark(c, scratch, ws, ws_bytes, bp, &nb);
  dlua_cuda_free(device, scratch);
  dlua_cuda_free(device, ws);
  DLUA_TRY(s);
  if (c->api->cudnnGetLastErrorString) {  // drop what rejected candidates logged: a later failure reports its own
    char sink[256];
    c->api->cudnnGetLastErrorString(sink, sizeof sink);
  }
  const perf_t *pick = NULL;
  for (int i = 0; i < nb && !pick; i++)
    if (bp[i].status == CUDNN_STATUS_SUCCESS && bp[i].memory <= ws_bytes) pick = &bp[i];
  for (int i = 0; i < nh && !pick; i++)  // nothing ran: the heuristic's best that fits, unmeasured
    if (hp[i].status == CUDNN_STATUS_SUCCESS && hp[i].memory <= ws_bytes) pick = &hp[i];
  ch->p = c->p;
  if (!pick) {
    ch->algo = -1, ch->ws = 0, ch->math = (cudnnMathType_t)c->p.math;
    return DLUA_OK;
  }
  ch->algo = pick->algo;
  ch->ws = pick->memory;
  // cuDNN reports which math each algorithm used; exact float32 stays on FMA kernels whatever it says, since
  // CUDNN_DEFAULT_MATH would allow TF32 on Ampere and later.
  ch->math = c->p.math == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : pick->math;
  return DLUA_OK;
}

/* The largest power of two up to 256 dividing every address: cuDNN's kernels may depend on it. */
static int32_t align_class(const void *a, const void *b, const void *d) {
  uintptr_t u = (uintptr_t)a | (uintptr_t)b | (uintptr_t)d;
  int32_t al = 256;
  while (al > 1 && (u & (uintptr_t)(al - 1))) al /= 2;
  return al;
}

/* Runs one direction: the output (y for DIR_FWD, x for DIR_BWD_DATA, w for DIR_BWD_FILTER) becomes
   alpha * result + beta * output, beta 0 or 1. *unsupported: cuDNN has no algorithm for it (nothing ran). */
static dlua_status_t run(call_t *c, double beta, int *unsupported) {
  dlua_status_t s = DLUA_OK;
  const int device = c->p.device;
  void *ws = NULL;
  int prev = -1;
  *unsupported = 0;
  cudaError_t ce = cudaGetDevice(&prev);
  if (ce == cudaSuccess && prev != device) ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s", c->op, device, cudaGetErrorString(ce));
  }
  c->api = dlua_cudnn_api(c->op);
  if (!c->api) {
    s = DLUA_ERR_BACKEND;
    goto done;
  }
  s = dlua_cudnn_handle(c->op, device, &c->h);
  if (s != DLUA_OK) goto done;
  s = make_descriptors(c);
  if (s != DLUA_OK) goto done;

  choice_t ch;
  uint64_t hash = problem_hash(&c->p);
  if (!cache_get(&c->p, hash, &ch)) {
    s = choose(c, beta != 0.0, &ch);
    if (s != DLUA_OK) goto done;
    ch.hash = hash;
    cache_put(&ch);
  }
  if (ch.algo < 0) {
    *unsupported = 1;
    goto done;
  }
  if (ch.math != (cudnnMathType_t)c->p.math)
    CUDNN_TRY(c->api->cudnnSetConvolutionMathType(c->cd, ch.math), "cudnnSetConvolutionMathType");
  // Workspace from the caching allocator on the stream the convolution runs on: reused only in stream order.
  if (ch.ws > 0) {
    s = dlua_cuda_malloc(&ws, device, ch.ws, NULL);
    if (s != DLUA_OK) goto done;
  }
  {
    const float af = 1.0f, bf = (float)beta;
    const double ad = 1.0, bd = beta;
    const int dbl = c->p.dtype == DLUA_DTYPE_F64;  // scaling factors are double for double data, float otherwise
    const void *pa = dbl ? (const void *)&ad : (const void *)&af, *pb = dbl ? (const void *)&bd : (const void *)&bf;
    switch (c->p.dir) {
      case DIR_FWD:
        CUDNN_TRY(c->api->cudnnConvolutionForward(c->h, pa, c->xd, c->x, c->wd, c->w, c->cd,
                                                  (cudnnConvolutionFwdAlgo_t)ch.algo, ws, ch.ws, pb, c->yd, c->y),
                  "cudnnConvolutionForward");
        break;
      case DIR_BWD_DATA:
        CUDNN_TRY(c->api->cudnnConvolutionBackwardData(c->h, pa, c->wd, c->w, c->yd, c->y, c->cd,
                                                       (cudnnConvolutionBwdDataAlgo_t)ch.algo, ws, ch.ws, pb, c->xd,
                                                       c->x),
                  "cudnnConvolutionBackwardData");
        break;
      default:
        CUDNN_TRY(c->api->cudnnConvolutionBackwardFilter(c->h, pa, c->xd, c->x, c->yd, c->y, c->cd,
                                                         (cudnnConvolutionBwdFilterAlgo_t)ch.algo, ws, ch.ws, pb,
                                                         c->wd, c->w),
                  "cudnnConvolutionBackwardFilter");
        break;
    }
  }
done:
  if (ws && dlua_cuda_free(device, ws) != DLUA_OK && s == DLUA_OK) s = dlua_last_status();
  destroy_descriptors(c);
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
  return s;
}

/* Sets up the problem of a call from its descriptor (operands x, w, y in d->xfmt). */
static dlua_status_t setup(call_t *c, const char *op, dir_t dir, const dlua_conv_desc_t *d) {
  memset(c, 0, sizeof *c);
  c->op = op;
  c->ctx = d->ctx ? d->ctx : "";
  // cuDNN's 4-D descriptors take int sizes and strides.
  const int64_t numel[3] = {d->n * d->c * d->h * d->w, d->o * (d->groups > 0 ? d->c / d->groups : 0) * d->kh * d->kw,
                            d->n * d->o * d->oh * d->ow};
  for (int i = 0; i < 3; i++)
    if (numel[i] > INT_MAX)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda for tensors of 2^31 elements or more (%s)", op, c->ctx);
  problem_t *p = &c->p;
  p->dir = dir;
  p->device = d->device;
  p->dtype = d->dtype;
  p->fmt = d->xfmt;
  switch (d->dtype) {
    case DLUA_DTYPE_F32: p->math = dlua_cuda_get_allow_tf32() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH; break;
    case DLUA_DTYPE_F64: p->math = CUDNN_DEFAULT_MATH; break;
    default: p->math = CUDNN_TENSOR_OP_MATH; break;
  }
  p->n = (int32_t)d->n, p->c = (int32_t)d->c, p->h = (int32_t)d->h, p->w = (int32_t)d->w;
  p->o = (int32_t)d->o, p->kh = (int32_t)d->kh, p->kw = (int32_t)d->kw;
  p->oh = (int32_t)d->oh, p->ow = (int32_t)d->ow;
  p->sh = d->sh, p->sw = d->sw, p->ph = d->ph, p->pw = d->pw, p->dh = d->dh, p->dw = d->dw, p->g = d->groups;
  c->x = d->x;
  c->w = d->wt;
  c->y = d->y;
  p->align = align_class(c->x, c->w, c->y);
  return DLUA_OK;
}

/* ---- the conv table's slots (kernels/conv.h) ------------------------------------------------------------------- */

/* The input's dtype throughout (f16/bf16 accumulate in f32 inside cuDNN), one packed aligned format per call, the
   bias and empty problems left to the front door. */
static dlua_status_t cuda_caps(const char *op, const dlua_conv_desc_t *d, dlua_conv_caps_t *caps) {
  (void)op;
  *caps = (dlua_conv_caps_t){.dtype = d->dtype, .param_dtype = d->dtype, .one_format = 1, .bias = 0, .empty = 0};
  return DLUA_OK;
}

/* cuDNN adds into the output (beta = 1) whenever asked. */
static dlua_status_t cuda_bwd_data_accumulates(const char *op, const dlua_conv_desc_t *d, int *yes) {
  (void)op, (void)d;
  *yes = 1;
  return DLUA_OK;
}

/* One direction; d->unsupported when cuDNN has no algorithm in d's format (nothing ran). */
static dlua_status_t cuda_run(const char *op, dir_t dir, dlua_conv_desc_t *d) {
  call_t c;
  int unsupported = 0;
  d->unsupported = 0;
  DLUA_TRY(setup(&c, op, dir, d));
  DLUA_TRY(run(&c, d->acc ? 1.0 : 0.0, &unsupported));
  d->unsupported = unsupported;
  return DLUA_OK;
}

static dlua_status_t cuda_forward(const char *op, dlua_conv_desc_t *d) { return cuda_run(op, DIR_FWD, d); }
static dlua_status_t cuda_backward_data(const char *op, dlua_conv_desc_t *d) { return cuda_run(op, DIR_BWD_DATA, d); }
static dlua_status_t cuda_backward_weights(const char *op, dlua_conv_desc_t *d) {
  return cuda_run(op, DIR_BWD_FILTER, d);
}

const struct dlua_conv_ops dlua_cuda_conv_ops = {
    .caps = cuda_caps,
    .bwd_data_accumulates = cuda_bwd_data_accumulates,
    .forward = cuda_forward,
    .backward_data = cuda_backward_data,
    .backward_weights = cuda_backward_weights,
};

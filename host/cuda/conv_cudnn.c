/* 2-D convolution on CUDA through cuDNN: forward, backward-data, backward-weights (the bias by reduction); each
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
#include "cuda/conv_cuda.h"
#include "cuda/cudnn_api.h"

/* ---- memory formats ---------------------------------------------------------------------------------------------
   The CPU's two (host/kernels/act_layout.h, as host/cpu/conv.c names them): NCHW, and channels-last NHWC for a logically (N, C, H, W) tensor; weights
   (O, C/groups, kH, kW) use the same patterns (OIHW, OHWI). cuDNN's filter descriptors only take those packed
   layouts, and its fast kernels want activations and weights in the same one, so each call computes in one format
   (its input's, as PyTorch does) and copies any operand that is not in it. */

enum { FMT_NCHW = ACT_CONTIG, FMT_NHWC = ACT_CL, FMT_OTHER = ACT_OTHER };

/* cuDNN gets 16-byte aligned buffers only (fresh ones are 512-byte aligned; views of them usually are too). */
static int aligned16(const dlua_tensor_t *t) { return ((uintptr_t)dlua_tensor_ptr(t) & 15) == 0; }

/* t as an aligned fmt tensor of dtype dt: a new handle on t when it is one, else a converted copy. */
static dlua_status_t operand(const dlua_tensor_t *t, dlua_dtype_t dt, int fmt, dlua_tensor_t **v) {
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
static dlua_status_t target(dlua_tensor_t *t, dlua_dtype_t dt, int fmt, dlua_tensor_t **v, int *direct) {
  *direct = t->dtype == dt && act_is_format(t, fmt) && aligned16(t);
  if (*direct) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  return act_alloc_on(v, 4, t->sizes, dt, fmt, t->device);
}

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

/* Sets up the problem of a call whose operands are x (N, C, H, W), w (O, C/g, kH, kW), y (N, O, OH, OW) in fmt. */
static dlua_status_t setup(call_t *c, const char *op, const char *ctx, dir_t dir, const dlua_tensor_t *x,
                           const dlua_tensor_t *w, const dlua_tensor_t *y, int fmt, int sh, int sw, int ph, int pw,
                           int dh, int dw, int groups) {
  memset(c, 0, sizeof *c);
  c->op = op;
  c->ctx = ctx;
  // cuDNN's 4-D descriptors take int sizes and strides.
  const dlua_tensor_t *ts[3] = {x, w, y};
  for (int i = 0; i < 3; i++)
    if (dlua_tensor_numel(ts[i]) > INT_MAX)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda for tensors of 2^31 elements or more (%s)", op, ctx);
  problem_t *p = &c->p;
  p->dir = dir;
  p->device = x->device;
  p->dtype = x->dtype;
  p->fmt = fmt;
  switch (x->dtype) {
    case DLUA_DTYPE_F32: p->math = dlua_cuda_get_allow_tf32() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH; break;
    case DLUA_DTYPE_F64: p->math = CUDNN_DEFAULT_MATH; break;
    default: p->math = CUDNN_TENSOR_OP_MATH; break;
  }
  p->n = (int32_t)x->sizes[0], p->c = (int32_t)x->sizes[1], p->h = (int32_t)x->sizes[2], p->w = (int32_t)x->sizes[3];
  p->o = (int32_t)w->sizes[0], p->kh = (int32_t)w->sizes[2], p->kw = (int32_t)w->sizes[3];
  p->oh = (int32_t)y->sizes[2], p->ow = (int32_t)y->sizes[3];
  p->sh = sh, p->sw = sw, p->ph = ph, p->pw = pw, p->dh = dh, p->dw = dw, p->g = groups;
  c->x = dlua_tensor_ptr(x);
  c->w = dlua_tensor_ptr(w);
  c->y = dlua_tensor_ptr(y);
  p->align = align_class(c->x, c->w, c->y);
  return DLUA_OK;
}

/* Folds a result computed into a temporary back into the caller's tensor. */
static dlua_status_t fold_back(dlua_tensor_t *dst, const dlua_tensor_t *tmp, int accumulate) {
  if (!accumulate) return dlua_tensor_copy_(dst, tmp);
  dlua_tensor_t *d = dst;
  return dlua_tensor_binary(&d, dst, tmp, DLUA_BINARY_ADD, 1.0);
}

typedef struct {
  int sh, sw, ph, pw, dh, dw, g;
} params_t;

/* One direction computed in format cf, in the dtype of input a: res (the caller's tensor: y, grad_x or grad_w)
   receives it, added to what it holds when accumulate. Inputs: x and w (forward), grad_y and w (backward-data),
   x and grad_y (backward-weights). *unsupported: cuDNN has no algorithm in cf (res untouched). */
static dlua_status_t convolve(const char *op, const char *ctx, dir_t dir, int cf, const dlua_tensor_t *a,
                              const dlua_tensor_t *b, dlua_tensor_t *res, int accumulate, const params_t *pp,
                              int *unsupported) {
  const dlua_dtype_t dt = a->dtype;
  dlua_tensor_t *av = NULL, *bv = NULL, *rv = NULL;
  int direct = 0;
  *unsupported = 0;
  dlua_status_t s = target(res, dt, cf, &rv, &direct);
  if (s == DLUA_OK) s = operand(a, dt, cf, &av);
  if (s == DLUA_OK) s = operand(b, dt, cf, &bv);
  if (s == DLUA_OK) {
    const dlua_tensor_t *x = dir == DIR_BWD_DATA ? rv : av;
    const dlua_tensor_t *w = dir == DIR_BWD_FILTER ? rv : bv;
    const dlua_tensor_t *y = dir == DIR_FWD ? rv : dir == DIR_BWD_DATA ? av : bv;
    call_t c;
    s = setup(&c, op, ctx, dir, x, w, y, cf, pp->sh, pp->sw, pp->ph, pp->pw, pp->dh, pp->dw, pp->g);
    if (s == DLUA_OK) s = run(&c, direct && accumulate ? 1.0 : 0.0, unsupported);
  }
  if (s == DLUA_OK && !*unsupported && !direct) s = fold_back(res, rv, accumulate);
  dlua_tensor_free(av);
  dlua_tensor_free(bv);
  dlua_tensor_free(rv);
  return s;
}

/* convolve in the operands' format, or in the other one where cuDNN has nothing for it (exact float32 in
   channels-last, say). float64 starts with NCHW: cuDNN's double kernels are NCHW ones (PyTorch never gives it
   channels-last doubles either). */
static dlua_status_t convolve_any(const char *op, const char *ctx, dir_t dir, int fmt, const dlua_tensor_t *a,
                                  const dlua_tensor_t *b, dlua_tensor_t *res, int accumulate, const params_t *pp) {
  int cf = a->dtype == DLUA_DTYPE_F64 ? FMT_NCHW : fmt, unsupported = 0;
  DLUA_TRY(convolve(op, ctx, dir, cf, a, b, res, accumulate, pp, &unsupported));
  if (unsupported) {
    cf = cf == FMT_NHWC ? FMT_NCHW : FMT_NHWC;
    DLUA_TRY(convolve(op, ctx, dir, cf, a, b, res, accumulate, pp, &unsupported));
  }
  if (unsupported)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cuDNN has no algorithm for this convolution (%s)", op, ctx);
  return DLUA_OK;
}

/* "input (8, 3, 224, 224) bfloat16 cuda:0, weight (...), stride (1, 1), padding (0, 0), dilation (1, 1), groups 1" */
static const char *context(char *buf, size_t n, const char *an, const dlua_tensor_t *a, const char *bn,
                           const dlua_tensor_t *b, const params_t *pp) {
  char da[200], db[200];
  snprintf(buf, n, "%s %s, %s %s, stride (%d, %d), padding (%d, %d), dilation (%d, %d), groups %d", an,
           dlua_tensor_describe(a, da, sizeof da), bn, dlua_tensor_describe(b, db, sizeof db), pp->sh, pp->sw, pp->ph,
           pp->pw, pp->dh, pp->dw, pp->g);
  return buf;
}

/* The format results are allocated in and computed in: the tensor's own, NCHW when it has neither. */
static int compute_format(const dlua_tensor_t *t) {
  int f = act_format(t);
  return f == FMT_OTHER ? FMT_NCHW : f;
}

/* ---- entry points ---------------------------------------------------------------------------------------------- */

dlua_status_t dlua_cuda_conv2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *w,
                                       const dlua_tensor_t *bias, int stride_h, int stride_w, int pad_h, int pad_w,
                                       int dil_h, int dil_w, int groups) {
  const char *op = "conv2d";
  const params_t pp = {stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups};
  int64_t ys[4] = {x->sizes[0], w->sizes[0], dlua_conv2d_output_size(x->sizes[2], w->sizes[2], stride_h, pad_h, dil_h),
                   dlua_conv2d_output_size(x->sizes[3], w->sizes[3], stride_w, pad_w, dil_w)};
  const int fmt = compute_format(x);
  int allocated = 0;
  if (!*out) {
    DLUA_TRY(act_alloc_on(out, 4, ys, x->dtype, fmt, x->device));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out_on(op, out, 4, ys, x->dtype, x->device, NULL));
  }
  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *b1 = NULL, *b2 = NULL, *b3 = NULL;
  if (dlua_shape_numel(4, ys) > 0) {
    if (x->sizes[1] == 0 || x->sizes[2] == 0 || x->sizes[3] == 0) {
      s = dlua_tensor_fill_(*out, 0.0);  // only padding under the kernel (or no input channel): the bias alone
    } else {
      char ctx[600];
      s = convolve_any(op, context(ctx, sizeof ctx, "input", x, "weight", w, &pp), DIR_FWD, fmt, x, w, *out, 0, &pp);
    }
    // out += bias viewed as (1, O, 1, 1): the element-wise kernels broadcast it in either format.
    if (s == DLUA_OK && bias) s = dlua_tensor_unsqueeze(&b1, bias, 0);
    if (s == DLUA_OK && bias) s = dlua_tensor_unsqueeze(&b2, b1, 2);
    if (s == DLUA_OK && bias) s = dlua_tensor_unsqueeze(&b3, b2, 3);
    if (s == DLUA_OK && bias) s = dlua_tensor_binary(out, *out, b3, DLUA_BINARY_ADD, 1.0);
  }
  dlua_tensor_free(b1);
  dlua_tensor_free(b2);
  dlua_tensor_free(b3);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

dlua_status_t dlua_cuda_conv2d_backward_data(dlua_tensor_t **grad_x, const dlua_tensor_t *grad_y,
                                             const dlua_tensor_t *w, const int64_t *x_sizes, int stride_h,
                                             int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups,
                                             int accumulate) {
  const char *op = "conv2d_backward_data";
  accumulate = accumulate != 0;
  const params_t pp = {stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups};
  const int fmt = compute_format(grad_y);
  int allocated = 0;
  if (!*grad_x) {
    DLUA_TRY(act_alloc_on(grad_x, 4, x_sizes, grad_y->dtype, fmt, grad_y->device));
    allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out_on(op, grad_x, 4, x_sizes, grad_y->dtype, grad_y->device, NULL));
  }
  dlua_status_t s = DLUA_OK;
  if (dlua_shape_numel(4, x_sizes) > 0) {
    if (w->sizes[0] == 0) {
      if (!accumulate) s = dlua_tensor_fill_(*grad_x, 0.0);  // no output channel: nothing flows back
    } else {
      char ctx[600];
      s = convolve_any(op, context(ctx, sizeof ctx, "grad_output", grad_y, "weight", w, &pp), DIR_BWD_DATA, fmt,
                       grad_y, w, *grad_x, accumulate, &pp);
    }
  }
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*grad_x);
    *grad_x = NULL;
  }
  return s;
}

dlua_status_t dlua_cuda_conv2d_backward_weights(dlua_tensor_t *grad_w, dlua_tensor_t *grad_bias,
                                                const dlua_tensor_t *x, const dlua_tensor_t *grad_y, int stride_h,
                                                int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups,
                                                int accumulate) {
  const char *op = "conv2d_backward_weights";
  const params_t pp = {stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups};
  accumulate = accumulate != 0;
  dlua_status_t s = DLUA_OK;
  if (dlua_tensor_numel(grad_w) > 0) {
    if (x->sizes[0] == 0 || x->sizes[2] == 0 || x->sizes[3] == 0) {
      if (!accumulate) s = dlua_tensor_fill_(grad_w, 0.0);  // no input under any kernel position: zero
    } else {
      // grad_w may have another dtype (a float32 gradient arena behind 16-bit activations) or format (OIHW
      // weights behind NHWC activations): convolve then computes into a temporary and adds (or copies) it in.
      char ctx[600];
      s = convolve_any(op, context(ctx, sizeof ctx, "input", x, "grad_output", grad_y, &pp), DIR_BWD_FILTER,
                       compute_format(x), x, grad_y, grad_w, accumulate, &pp);
    }
  }
  // grad_bias = the sum of grad_y over (N, OH, OW): the reduction kernels (fixed order, double sums).
  if (s == DLUA_OK && grad_bias && dlua_tensor_numel(grad_bias) > 0) {
    static const int dims[3] = {0, 2, 3};
    if (!accumulate) {
      s = dlua_tensor_reduce(&grad_bias, NULL, grad_y, DLUA_REDUCE_SUM, 3, dims, 0, 0.0, 0);
    } else {
      // Added to what grad_bias holds: the sum of a 16-bit grad_y is kept in float32 until that addition, so
      // the result is rounded once, as on the CPU (a float16 sum first would cost up to half its own ulp).
      dlua_tensor_t *sum = NULL, *wide = NULL;
      const int narrow = grad_y->dtype == DLUA_DTYPE_F16 || grad_y->dtype == DLUA_DTYPE_BF16;
      if (narrow) s = dlua_tensor_to_dtype(&wide, grad_y, DLUA_DTYPE_F32);
      if (s == DLUA_OK) s = dlua_tensor_reduce(&sum, NULL, narrow ? wide : grad_y, DLUA_REDUCE_SUM, 3, dims, 0, 0.0, 0);
      if (s == DLUA_OK) s = fold_back(grad_bias, sum, 1);
      dlua_tensor_free(sum);
      dlua_tensor_free(wide);
    }
  }
  return s;
}

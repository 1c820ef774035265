/* The CUDA backend's loss family (kernels/loss.h): softmax/log-softmax, cross-entropy, MSE, threshold/ReLU backward
   and dropout's mask, over the contiguous buffers of the compute type (float or double) that host/ops stages, with
   the arithmetic of the CPU kernels. Row reductions run in one group per row (a thread, a warp or a block, chosen
   by the shape) and loss sums in two fixed passes: no atomics, so a result depends on the shape only. */
#include "cuda/ew_common.cuh"
#include "cuda/device_guard.cuh"
#include "kernels/loss.h"

namespace dlua_cu {
namespace {

/* The CPU kernels' exponential: expf for float, exp for double. */
__device__ __forceinline__ float ex(float v) { return expf(v); }
__device__ __forceinline__ double ex(double v) { return exp(v); }

/* ---- groups: G threads fold one row (G = 1: a thread per row, 32: a warp, kThreads: the block) ----------------
   Butterfly shuffles leave every lane with the same bits (a + b == b + a); a block combines its warps' results
   in warp order. */

template <int G> struct Sched {
  static __device__ __forceinline__ int64_t first() {
    return G == 1 ? (int64_t)blockIdx.x * blockDim.x + threadIdx.x : (int64_t)blockIdx.x * (kThreads / G) + threadIdx.x / G;
  }
  static __device__ __forceinline__ int64_t step() {
    return G == 1 ? (int64_t)gridDim.x * blockDim.x : (int64_t)gridDim.x * (kThreads / G);
  }
  static __device__ __forceinline__ int lane() { return G == 1 ? 0 : (int)(threadIdx.x % G); }
  /* Blocks to launch for `rows` rows. */
  static unsigned grid(int64_t rows) { return grid_for(rows * G); }
};

template <int G> __device__ __forceinline__ double gsum(double v) {
  if constexpr (G == 1) {
    return v;
  } else {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if constexpr (G == 32) {
      return v;
    } else {
      __shared__ double sh[G / 32];
      __syncthreads();  // an earlier call's readers are done with sh
      if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
      __syncthreads();
      double t = 0;
      for (int k = 0; k < G / 32; k++) t += sh[k];
      return t;
    }
  }
}

/* Max of partial maxima that are never NaN (a fold starts at -inf and takes only larger values). */
template <int G, typename T> __device__ __forceinline__ T gmax(T v) {
  if constexpr (G == 1) {
    return v;
  } else {
    for (int o = 16; o > 0; o >>= 1) {
      const T u = __shfl_xor_sync(0xffffffffu, v, o);
      v = u > v ? u : v;
    }
    if constexpr (G == 32) {
      return v;
    } else {
      __shared__ T sh[G / 32];
      __syncthreads();
      if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
      __syncthreads();
      T t = sh[0];
      for (int k = 1; k < G / 32; k++) t = sh[k] > t ? sh[k] : t;
      return t;
    }
  }
}

/* Rows of K elements along stride `inner`: row l starts at (l / inner) K inner + l % inner. Contiguous rows
   (inner 1) of more than a few elements get a warp (K <= 1024) or a block each; other layouts a thread per row,
   whose neighbours read neighbouring addresses. */
template <typename L> dlua_status_t by_rows(const char *op, int64_t rows, int64_t K, int64_t inner, L launch) {
  if (rows <= 0) return DLUA_OK;
  if (inner == 1 && K > 16) {
    if (K <= 1024) launch(std::integral_constant<int, 32>(), Sched<32>::grid(rows));
    else launch(std::integral_constant<int, kThreads>(), Sched<kThreads>::grid(rows));
  } else {
    launch(std::integral_constant<int, 1>(), Sched<1>::grid(rows));
  }
  return launched(op);
}

__device__ __forceinline__ int64_t row_base(int64_t l, int64_t K, int64_t inner) {
  return inner == 1 ? l * K : (l / inner) * K * inner + l % inner;
}

/* ---- softmax ------------------------------------------------------------------------------------------------ */

template <typename T, int G>
__global__ void k_softmax_fwd(const T *x, T *y, int64_t rows, int64_t K, int64_t inner, int use_log) {
  const int lane = Sched<G>::lane();
  for (int64_t l = Sched<G>::first(); l < rows; l += Sched<G>::step()) {  // uniform across a group
    const int64_t base = row_base(l, K, inner);
    const T *xr = x + base;
    T *yr = y + base;
    T mx = -INFINITY;
    for (int64_t k = lane; k < K; k += G)
      if (xr[k * inner] > mx) mx = xr[k * inner];
    mx = gmax<G>(mx);
    double sum = 0;
    if (use_log) {
      for (int64_t k = lane; k < K; k += G) sum += ex(xr[k * inner] - mx);
      const T lsum = (T)log(gsum<G>(sum));
      for (int64_t k = lane; k < K; k += G) yr[k * inner] = (xr[k * inner] - mx) - lsum;
    } else {
      for (int64_t k = lane; k < K; k += G) {
        const T e = ex(xr[k * inner] - mx);
        yr[k * inner] = e;
        sum += e;
      }
      const T inv = (T)(1.0 / gsum<G>(sum));
      for (int64_t k = lane; k < K; k += G) yr[k * inner] *= inv;
    }
  }
}

/* softmax: gx = y (gy - sum(gy y)); log-softmax: gx = gy - exp(y) sum(gy). */
template <typename T, int G>
__global__ void k_softmax_bwd(const T *gy, const T *y, T *gx, int64_t rows, int64_t K, int64_t inner, int use_log) {
  const int lane = Sched<G>::lane();
  for (int64_t l = Sched<G>::first(); l < rows; l += Sched<G>::step()) {
    const int64_t base = row_base(l, K, inner);
    const T *g = gy + base, *yr = y + base;
    T *o = gx + base;
    double acc = 0;
    if (use_log) {
      for (int64_t k = lane; k < K; k += G) acc += g[k * inner];
      const T a = (T)gsum<G>(acc);
      for (int64_t k = lane; k < K; k += G) o[k * inner] = g[k * inner] - ex(yr[k * inner]) * a;
    } else {
      for (int64_t k = lane; k < K; k += G) acc += (double)g[k * inner] * yr[k * inner];
      const T a = (T)gsum<G>(acc);
      for (int64_t k = lane; k < K; k += G) o[k * inner] = yr[k * inner] * (g[k * inner] - a);
    }
  }
}

/* ---- cross-entropy -------------------------------------------------------------------------------------------
   Per target i with class y (not ignored), smoothing e over K classes:
     l_i = -(1 - e) w_y logp_y - (e / K) sum_c w_c logp_c,
   computed in double from the logits row; part[i] gets l_i for a reduced loss. */

template <typename T, int G>
__global__ void k_ce_fwd(dlua_loss_ce_t pl, const T *x, T *lp, T *loss_none, double *part) {
  const int lane = Sched<G>::lane();
  const int64_t K = pl.K, inner = pl.inner;
  const double e_k = K ? pl.eps / (double)K : 0.0;
  for (int64_t i = Sched<G>::first(); i < pl.P; i += Sched<G>::step()) {
    const int64_t off = row_base(i, K, inner);
    const T *xr = x + off;
    double mx = -INFINITY, sum = 0;
    for (int64_t k = lane; k < K; k += G)
      if (xr[k * inner] > mx) mx = xr[k * inner];
    mx = gmax<G>(mx);
    for (int64_t k = lane; k < K; k += G) sum += exp((double)xr[k * inner] - mx);
    const double ls = log(gsum<G>(sum)), lse = mx + ls;
    if (lp)
      for (int64_t k = lane; k < K; k += G) lp[off + k * inner] = (T)(((double)xr[k * inner] - mx) - ls);
    double l = 0;
    const int64_t v = pl.labels[i];
    if (v != pl.ignore) {  // uniform across a group: one target
      const int64_t c = v - pl.base;
      const double wy = pl.w ? pl.w[c] : 1.0;
      l = -(1.0 - pl.eps) * wy * ((double)xr[c * inner] - lse);
      if (pl.eps > 0) {
        double sm = 0;
        for (int64_t k = lane; k < K; k += G) sm += (pl.w ? pl.w[k] : 1.0) * ((double)xr[k * inner] - lse);
        l -= e_k * gsum<G>(sm);
      }
    }
    if (lane == 0) {
      if (loss_none) loss_none[i] = (T)l;
      if (part) part[i] = l;
    }
  }
}

/* dl_i/dx_c = g_i (p_c S_i - q_ic), q_ic = (1 - e) w_y [c == y] + (e / K) w_c, S_i = sum_c q_ic; one thread per
   element of the (N, K, inner) gradient. g_i = gy[i], else (*gs or 1) / div. */
template <typename T>
__global__ void k_ce_bwd(dlua_loss_ce_t pl, const T *lp, const T *gy, const double *gs, double div, T *gx,
                         int64_t total) {
  const int64_t K = pl.K, inner = pl.inner;
  const double e_k = K ? pl.eps / (double)K : 0.0;
  const double g = (gs ? *gs : 1.0) / div;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += stride) {
    int64_t i, k;
    if (inner == 1) {
      i = j / K;
      k = j - i * K;
    } else {
      const int64_t q = j / inner;
      k = q % K;
      i = (q / K) * inner + (j - q * inner);
    }
    const int64_t v = pl.labels[i];
    if (v == pl.ignore) {
      gx[j] = (T)0;
      continue;
    }
    const int64_t c = v - pl.base;
    const double wy = pl.w ? pl.w[c] : 1.0, gi = gy ? (double)gy[i] : g;
    const double hot = (1.0 - pl.eps) * wy, S = hot + e_k * pl.wsum;
    const double q = e_k * (pl.w ? pl.w[k] : 1.0) + (k == c ? hot : 0.0);
    gx[j] = (T)(gi * (exp((double)lp[j]) * S - q));
  }
}

/* ---- sums: pass 1 folds fixed chunks (one block each), pass 2 folds the chunk sums in one block ------------- */

constexpr int64_t kSumChunk = 8192, kSumMaxChunks = 4096;

template <typename F> __global__ void k_sum1(F f, int64_t n, int64_t chunk, double *part) {
  __shared__ double sh[kThreads];
  const int t = threadIdx.x;
  const int64_t lo = (int64_t)blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
  double a = 0;
  for (int64_t i = lo + t; i < hi; i += kThreads) a += f(i);
  sh[t] = a;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (t < w) sh[t] += sh[t + w];
    __syncthreads();
  }
  if (t == 0) part[blockIdx.x] = sh[0];
}

__global__ void k_sum2(const double *part, int64_t nb, double div, double *out) {
  __shared__ double sh[kThreads];
  const int t = threadIdx.x;
  double a = 0;
  for (int64_t j = t; j < nb; j += kThreads) a += part[j];
  sh[t] = a;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (t < w) sh[t] += sh[t + w];
    __syncthreads();
  }
  if (t == 0) *out = sh[0] / div;  // an empty mean is 0 / 0 = NaN, as on the CPU
}

/* The chunk length for n terms: fixed by n alone. */
int64_t sum_chunk(int64_t n) {
  int64_t c = (n + kSumMaxChunks - 1) / kSumMaxChunks;
  c = (c + kThreads - 1) / kThreads * kThreads;
  return c > kSumChunk ? c : kSumChunk;
}
int64_t sum_blocks(int64_t n) { return n > 0 ? (n + sum_chunk(n) - 1) / sum_chunk(n) : 0; }

/* *out = (sum of f(i), i < n) / div; part holds sum_blocks(n) doubles. */
template <typename F> dlua_status_t sum_terms(const char *op, F f, int64_t n, double *part, double div, double *out,
                                              cudaStream_t s) {
  const int64_t nb = sum_blocks(n);
  if (nb > 0) {
    k_sum1<F><<<(unsigned)nb, kThreads, 0, s>>>(f, n, sum_chunk(n), part);
    DLUA_TRY(launched(op));
  }
  k_sum2<<<1, kThreads, 0, s>>>(part, nb, div, out);
  return launched(op);
}

struct TermArray {
  const double *v;
  __device__ __forceinline__ double operator()(int64_t i) const { return v[i]; }
};

/* The CPU kernels' mse_fwd: the square in T, summed in double. */
template <typename T> struct TermMse {
  const T *x, *t;
  __device__ __forceinline__ double operator()(int64_t i) const {
    const T d = x[i] - t[i];
    return (double)(d * d);
  }
};

/* ---- element-wise ------------------------------------------------------------------------------------------ */

template <typename T> __global__ void k_mse_none(const T *x, const T *t, T *out, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T d = x[i] - t[i];
    out[i] = d * d;
  }
}

template <typename T>
__global__ void k_mse_bwd(const T *x, const T *t, const T *gy, const double *gs, T norm, T *gx, int64_t n) {
  const T g = gs ? (T)*gs : (T)1;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    gx[i] = norm * (x[i] - t[i]) * (gy ? gy[i] : g);
}

template <typename T> __global__ void k_threshold(const T *x, T *y, int64_t n, T th, T value) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = x[i] <= th ? value : x[i];
}

template <typename T> __global__ void k_threshold_bwd(const T *gy, const T *x, T *gx, int64_t n, T th) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    gx[i] = x[i] <= th ? (T)0 : gy[i];
}

/* A multiply rather than a select, so a dropped NaN stays NaN as in PyTorch's x * mask. */
template <typename T> __global__ void k_mask_scale(const T *x, const uint8_t *m, T *y, int64_t n, T scale) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = x[i] * (m[i] ? scale : (T)0);
}

/* ---- launchers ---------------------------------------------------------------------------------------------- */

template <typename T> dlua_status_t softmax_fwd(const char *op, const void *x, void *y, int64_t outer, int64_t K,
                                                int64_t inner, int log, cudaStream_t s) {
  return by_rows(op, outer * inner, K, inner, [&](auto g, unsigned grid) {
    k_softmax_fwd<T, decltype(g)::value><<<grid, kThreads, 0, s>>>((const T *)x, (T *)y, outer * inner, K, inner, log);
  });
}

template <typename T> dlua_status_t softmax_bwd(const char *op, const void *gy, const void *y, void *gx, int64_t outer,
                                                int64_t K, int64_t inner, int log, cudaStream_t s) {
  return by_rows(op, outer * inner, K, inner, [&](auto g, unsigned grid) {
    k_softmax_bwd<T, decltype(g)::value><<<grid, kThreads, 0, s>>>((const T *)gy, (const T *)y, (T *)gx, outer * inner,
                                                                    K, inner, log);
  });
}

/* Scratch from the caching allocator on the current stream: reused only in stream order, so it can be freed as
   soon as the kernels that use it are queued. */
struct Scratch {
  void *p = nullptr;
  int device;
  explicit Scratch(int d) : device(d) {}
  dlua_status_t get(size_t bytes) { return dlua_cuda_malloc(&p, device, bytes ? bytes : 1, NULL); }
  ~Scratch() {
    if (p) dlua_cuda_free(device, p);
  }
};

template <typename T>
dlua_status_t ce_fwd(const char *op, const dlua_loss_ce_t &pl, const void *x, void *lp, void *loss_none, double *sum,
                     double div, int device, cudaStream_t s) {
  Scratch scratch(device);
  double *per_target = nullptr, *part = nullptr;
  if (sum) {
    DLUA_TRY(scratch.get((size_t)(pl.P + sum_blocks(pl.P)) * sizeof(double)));
    per_target = (double *)scratch.p;
    part = per_target + pl.P;
  }
  DLUA_TRY(by_rows(op, pl.P, pl.K, pl.inner, [&](auto g, unsigned grid) {
    k_ce_fwd<T, decltype(g)::value><<<grid, kThreads, 0, s>>>(pl, (const T *)x, (T *)lp, (T *)loss_none, per_target);
  }));
  if (sum) return sum_terms(op, TermArray{per_target}, pl.P, part, div, sum, s);
  return DLUA_OK;
}

template <typename T>
dlua_status_t ce_bwd(const char *op, const dlua_loss_ce_t &pl, const void *lp, const void *gy, const double *gs,
                     double div, void *gx, cudaStream_t s) {
  const int64_t total = pl.P * pl.K;
  if (total <= 0) return DLUA_OK;
  k_ce_bwd<T><<<grid_for(total), kThreads, 0, s>>>(pl, (const T *)lp, (const T *)gy, gs, div, (T *)gx, total);
  return launched(op);
}

template <typename T>
dlua_status_t mse_fwd(const char *op, const void *x, const void *t, void *out_none, double *sum, double div, int64_t n,
                      int device, cudaStream_t s) {
  if (out_none) {
    if (n <= 0) return DLUA_OK;
    k_mse_none<T><<<grid_for(n), kThreads, 0, s>>>((const T *)x, (const T *)t, (T *)out_none, n);
    return launched(op);
  }
  Scratch scratch(device);
  DLUA_TRY(scratch.get((size_t)sum_blocks(n) * sizeof(double)));
  return sum_terms(op, TermMse<T>{(const T *)x, (const T *)t}, n, (double *)scratch.p, div, sum, s);
}

/* Runs body(T()) for the compute type: float or double. */
template <typename B> dlua_status_t by_type(const char *op, int ct, B body) {
  if (ct == DLUA_DTYPE_F64) return body(double());
  if (ct == DLUA_DTYPE_F32) return body(float());
  return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: CUDA loss kernels compute in float32 or float64, not dtype %d", op, ct);
}

}  // namespace
}  // namespace dlua_cu

using namespace dlua_cu;

#define LOSS_PROLOGUE(op, device)       \
  DLUA_CU_SELECT(guard, op, device);    \
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device)

static dlua_status_t cuda_softmax(const char *op, const dlua_loss_softmax_t *d) {
  if (d->outer * d->K * d->inner == 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    return softmax_fwd<decltype(v)>(op, d->x, d->y, d->outer, d->K, d->inner, d->log, s);
  });
}

static dlua_status_t cuda_softmax_backward(const char *op, const dlua_loss_softmax_bwd_t *d) {
  if (d->outer * d->K * d->inner == 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    return softmax_bwd<decltype(v)>(op, d->gy, d->y, d->gx, d->outer, d->K, d->inner, d->log, s);
  });
}

static dlua_status_t cuda_threshold(const char *op, const dlua_loss_threshold_t *d) {
  const int64_t n = d->n;
  if (n <= 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    typedef decltype(v) T;
    k_threshold<T><<<grid_for(n), kThreads, 0, s>>>((const T *)d->x, (T *)d->y, n, (T)d->th, (T)d->value);
    return launched(op);
  });
}

static dlua_status_t cuda_threshold_backward(const char *op, const dlua_loss_threshold_bwd_t *d) {
  const int64_t n = d->n;
  if (n <= 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    typedef decltype(v) T;
    k_threshold_bwd<T><<<grid_for(n), kThreads, 0, s>>>((const T *)d->gy, (const T *)d->x, (T *)d->gx, n, (T)d->th);
    return launched(op);
  });
}

static dlua_status_t cuda_mask_scale(const char *op, const dlua_loss_mask_scale_t *d) {
  const int64_t n = d->n;
  if (n <= 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    typedef decltype(v) T;
    k_mask_scale<T><<<grid_for(n), kThreads, 0, s>>>((const T *)d->x, d->m, (T *)d->y, n, (T)d->scale);
    return launched(op);
  });
}

static dlua_status_t cuda_mse(const char *op, const dlua_loss_mse_t *d) {
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    return mse_fwd<decltype(v)>(op, d->x, d->t, d->out_none, d->sum, d->div, d->n, d->device, s);
  });
}

static dlua_status_t cuda_mse_backward(const char *op, const dlua_loss_mse_bwd_t *d) {
  const int64_t n = d->n;
  if (n <= 0) return DLUA_OK;
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    typedef decltype(v) T;
    k_mse_bwd<T><<<grid_for(n), kThreads, 0, s>>>((const T *)d->x, (const T *)d->t, (const T *)d->gy, d->gscalar,
                                                  (T)d->norm, (T *)d->gx, n);
    return launched(op);
  });
}

static dlua_status_t cuda_cross_entropy(const char *op, const dlua_loss_ce_fwd_t *d) {
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    return ce_fwd<decltype(v)>(op, d->pl, d->x, d->lp, d->loss_none, d->sum, d->div, d->device, s);
  });
}

static dlua_status_t cuda_cross_entropy_backward(const char *op, const dlua_loss_ce_bwd_t *d) {
  LOSS_PROLOGUE(op, d->device);
  return by_type(op, d->ct, [&](auto v) {
    return ce_bwd<decltype(v)>(op, d->pl, d->lp, d->gy, d->gscalar, d->div, d->gx, s);
  });
}

/* In kernels/loss.h's slot order. */
const struct dlua_loss_ops dlua_cuda_loss_ops = {
    /* softmax */ cuda_softmax,
    /* softmax_backward */ cuda_softmax_backward,
    /* threshold */ cuda_threshold,
    /* threshold_backward */ cuda_threshold_backward,
    /* mask_scale */ cuda_mask_scale,
    /* mse */ cuda_mse,
    /* mse_backward */ cuda_mse_backward,
    /* cross_entropy */ cuda_cross_entropy,
    /* cross_entropy_backward */ cuda_cross_entropy_backward,
};

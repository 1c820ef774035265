/* The CUDA pool kernels (kernels/pool.h; front doors in host/ops/pool.c): max (with positions), average and adaptive average, forward and backward, NCHW or channels-last. */
/* Each output (forward) and each input gradient (backward) is computed by one thread alone, in the CPU's order
   (the CPU backend's pool_impl.h), so results are deterministic and agree with the CPU: the backward passes gather
   over the outputs whose windows hold the position, ascending, instead of scattering with atomics.

   Max-pooling's backward gets only the positions, not the window geometry; a first pass bounds how far
   any position lies from its output's centre (oh * H / OH, ow * W / OW), and the gather visits the outputs
   within that distance (the window's own extent for positions that came from a forward). */
#include "cuda/ew_common.cuh"
#include "cuda/device_guard.cuh"
#include "kernels/pool.h"

namespace dlua_cu {
namespace {

typedef dlua_pool_geom_t Pool;

/* Output or input element i (its offset in memory) as (n, c, h, w), for a (N, C, Hh, Ww) tensor. */
__device__ __forceinline__ void unravel(int64_t i, const Pool &p, int64_t Hh, int64_t Ww, int64_t &n, int64_t &c,
                                        int64_t &h, int64_t &w) {
  if (p.cl) {
    c = i % p.C;
    i /= p.C;
    w = i % Ww;
    i /= Ww;
    h = i % Hh;
    n = i / Hh;
  } else {
    w = i % Ww;
    i /= Ww;
    h = i % Hh;
    i /= Hh;
    c = i % p.C;
    n = i / p.C;
  }
}

__device__ __forceinline__ int64_t offset(const Pool &p, int64_t Hh, int64_t Ww, int64_t n, int64_t c, int64_t h,
                                          int64_t w) {
  return p.cl ? ((n * Hh + h) * Ww + w) * p.C + c : ((n * p.C + c) * Hh + h) * Ww + w;
}

/* Window of output o along one axis, as pool.c's avg_axis / adaptive_axis: [st, en) and the divisor factor. */
__device__ __forceinline__ void window(int kind, int64_t in, int64_t out, int64_t k, int64_t s, int64_t pad,
                                       int include_pad, int64_t o, int64_t &st, int64_t &en, int64_t &dv) {
  if (kind == 2) {
    st = o * in / out;
    en = ((o + 1) * in + out - 1) / out;
    dv = en - st;
    return;
  }
  int64_t a = o * s - pad, e = a + k < in + pad ? a + k : in + pad;
  const int64_t padded = e - a;
  if (a < 0) a = 0;
  if (e > in) e = in;
  st = a;
  en = e;
  dv = include_pad ? padded : e - a;
}

/* Outputs along one axis whose windows may hold input position i (a superset; callers test membership). */
__device__ __forceinline__ void candidates(int kind, int64_t in, int64_t out, int64_t k, int64_t s, int64_t pad,
                                           int64_t i, int64_t &lo, int64_t &hi) {
  if (kind == 2) {
    lo = i * out / in - 1;
    hi = ((i + 1) * out - 1) / in + 1;
  } else {
    lo = (i + pad - k) / s;  // truncation rounds negative values up: clamped below
    hi = (i + pad) / s;
  }
  if (lo < 0) lo = 0;
  if (hi > out - 1) hi = out - 1;
}

template <int DT> __global__ void k_max_fwd(Pool p, const void *x_, void *y_, int64_t *ind, int64_t total) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C Cc;
  const S *x = (const S *)x_;
  S *y = (S *)y_;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, oh, ow;
    unravel(i, p, p.OH, p.OW, n, c, oh, ow);
    int64_t h0 = oh * p.sh - p.ph;
    while (h0 < 0) h0 += p.dh;
    const int64_t h1 = oh * p.sh - p.ph + (p.kh - 1) * p.dh + 1;
    int64_t w0 = ow * p.sw - p.pw;
    while (w0 < 0) w0 += p.dw;
    const int64_t w1 = ow * p.sw - p.pw + (p.kw - 1) * p.dw + 1;
    // Padding never wins, NaN does (the last one), an all -Inf window reports its first position.
    Cc best = -(Cc)INFINITY;
    int64_t bi = h0 * p.W + w0;
    for (int64_t ih = h0; ih < h1 && ih < p.H; ih += p.dh)
      for (int64_t iw = w0; iw < w1 && iw < p.W; iw += p.dw) {
        const Cc v = Tr<DT>::ld(x[offset(p, p.H, p.W, n, c, ih, iw)]);
        const bool take = v > best || v != v;
        best = take ? v : best;
        bi = take ? ih * p.W + iw : bi;
      }
    y[i] = Tr<DT>::st(best);
    if (ind) ind[i] = bi;
  }
}

/* bound[0], bound[1]: the largest |ih - oh * H / OH| and |iw - ow * W / OW| over every position; bound[2]: 1 when
   a position lies outside its plane. Integer maxima: the same whatever order the atomics land in. */
__global__ void k_max_bound(Pool p, const int64_t *ind, int64_t total, unsigned *bound) {
  const int64_t HW = p.H * p.W;
  unsigned bh = 0, bw = 0, bad = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t k = ind[i];
    if (k < 0 || k >= HW) {
      bad = 1;
      continue;
    }
    int64_t n, c, oh, ow;
    unravel(i, p, p.OH, p.OW, n, c, oh, ow);
    const int64_t dh = k / p.W - oh * p.H / p.OH, dw = k % p.W - ow * p.W / p.OW;
    const unsigned ah = (unsigned)(dh < 0 ? -dh : dh), aw = (unsigned)(dw < 0 ? -dw : dw);
    bh = ah > bh ? ah : bh;
    bw = aw > bw ? aw : bw;
  }
  bh = __reduce_max_sync(0xffffffffu, bh);
  bw = __reduce_max_sync(0xffffffffu, bw);
  bad = __reduce_max_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0) {
    if (bh) atomicMax(&bound[0], bh);
    if (bw) atomicMax(&bound[1], bw);
    if (bad) atomicMax(&bound[2], bad);
  }
}

/* gx at each input position: the sum, over outputs o in ascending order whose position is this one, of gy[o]. */
template <int DT>
__global__ void k_max_bwd(Pool p, const void *gy_, const int64_t *ind, void *gx_, int64_t total, int64_t bh, int64_t bw) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C Cc;
  const S *gy = (const S *)gy_;
  S *gx = (S *)gx_;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, ih, iw;
    unravel(i, p, p.H, p.W, n, c, ih, iw);
    // Outputs o with |ih - o * H / OH| <= bh: o from ceil((ih - bh) OH / H) to floor(((ih + bh + 1) OH - 1) / H).
    const int64_t ah = ih - bh, aw = iw - bw;
    const int64_t oh0 = ah <= 0 ? 0 : (ah * p.OH + p.H - 1) / p.H, ow0 = aw <= 0 ? 0 : (aw * p.OW + p.W - 1) / p.W;
    int64_t oh1 = ((ih + bh + 1) * p.OH - 1) / p.H, ow1 = ((iw + bw + 1) * p.OW - 1) / p.W;
    if (oh1 > p.OH - 1) oh1 = p.OH - 1;
    if (ow1 > p.OW - 1) ow1 = p.OW - 1;
    const int64_t pos = ih * p.W + iw;
    Cc acc = 0;
    for (int64_t oh = oh0; oh <= oh1; oh++)
      for (int64_t ow = ow0; ow <= ow1; ow++) {
        const int64_t o = offset(p, p.OH, p.OW, n, c, oh, ow);
        if (ind[o] == pos) acc += Tr<DT>::ld(gy[o]);
      }
    gx[i] = Tr<DT>::st(acc);
  }
}

template <int DT> __global__ void k_avg_fwd(Pool p, const void *x_, void *y_, int64_t total) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C Cc;
  const S *x = (const S *)x_;
  S *y = (S *)y_;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, oh, ow, hs, he, hd, ws, we, wd;
    unravel(i, p, p.OH, p.OW, n, c, oh, ow);
    window(p.kind, p.H, p.OH, p.kh, p.sh, p.ph, p.include_pad, oh, hs, he, hd);
    window(p.kind, p.W, p.OW, p.kw, p.sw, p.pw, p.include_pad, ow, ws, we, wd);
    Cc s = 0;
    for (int64_t ih = hs; ih < he; ih++)
      for (int64_t iw = ws; iw < we; iw++) s += Tr<DT>::ld(x[offset(p, p.H, p.W, n, c, ih, iw)]);
    const int64_t div = p.div_override > 0 ? p.div_override : hd * wd;
    y[i] = Tr<DT>::st(hs < he && ws < we ? s / (Cc)div : (Cc)0);
  }
}

/* gx at each input position: gy[o] / divisor added over the outputs o whose windows hold it, ascending. */
template <int DT> __global__ void k_avg_bwd(Pool p, const void *gy_, void *gx_, int64_t total) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C Cc;
  const S *gy = (const S *)gy_;
  S *gx = (S *)gx_;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, ih, iw, oh0, oh1, ow0, ow1;
    unravel(i, p, p.H, p.W, n, c, ih, iw);
    candidates(p.kind, p.H, p.OH, p.kh, p.sh, p.ph, ih, oh0, oh1);
    candidates(p.kind, p.W, p.OW, p.kw, p.sw, p.pw, iw, ow0, ow1);
    Cc acc = 0;
    for (int64_t oh = oh0; oh <= oh1; oh++) {
      int64_t hs, he, hd;
      window(p.kind, p.H, p.OH, p.kh, p.sh, p.ph, p.include_pad, oh, hs, he, hd);
      if (ih < hs || ih >= he) continue;
      for (int64_t ow = ow0; ow <= ow1; ow++) {
        int64_t ws, we, wd;
        window(p.kind, p.W, p.OW, p.kw, p.sw, p.pw, p.include_pad, ow, ws, we, wd);
        if (iw < ws || iw >= we) continue;
        const int64_t div = p.div_override > 0 ? p.div_override : hd * wd;
        acc += Tr<DT>::ld(gy[offset(p, p.OH, p.OW, n, c, oh, ow)]) / (Cc)div;
      }
    }
    gx[i] = Tr<DT>::st(acc);
  }
}

template <int DT> dlua_status_t forward(const char *op, const Pool &p, const void *x, void *y, int64_t *ind, cudaStream_t st) {
  const int64_t total = p.N * p.C * p.OH * p.OW;
  if (total <= 0) return DLUA_OK;
  if (p.kind == 0) k_max_fwd<DT><<<grid_for(total), kThreads, 0, st>>>(p, x, y, ind, total);
  else k_avg_fwd<DT><<<grid_for(total), kThreads, 0, st>>>(p, x, y, total);
  return launched(op);
}

dlua_status_t cuda_fail(const char *op, cudaError_t e) {
  cudaGetLastError();
  return DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
}

template <int DT> dlua_status_t backward(const char *op, const Pool &p, const void *gy, const int64_t *ind, void *gx,
                                         int *bad, cudaStream_t st) {
  const int64_t total = p.N * p.C * p.H * p.W, nout = p.N * p.C * p.OH * p.OW;
  if (p.kind != 0) {
    if (total <= 0) return DLUA_OK;
    k_avg_bwd<DT><<<grid_for(total), kThreads, 0, st>>>(p, gy, gx, total);
    return launched(op);
  }
  unsigned host[3] = {0, 0, 0};
  if (nout > 0) {
    void *mem = NULL;
    DLUA_TRY(dlua_cuda_malloc(&mem, p.device, sizeof host, NULL));
    unsigned *bound = (unsigned *)mem;
    dlua_status_t s = DLUA_OK;
    cudaError_t e = cudaMemsetAsync(bound, 0, sizeof host, st);
    if (e != cudaSuccess) s = cuda_fail(op, e);
    if (s == DLUA_OK) {
      k_max_bound<<<grid_for(nout), kThreads, 0, st>>>(p, ind, nout, bound);
      s = launched(op);
    }
    // The bounds size the gather, and a bad position is an error the caller reports: wait for them.
    if (s == DLUA_OK) e = cudaMemcpyAsync(host, bound, sizeof host, cudaMemcpyDeviceToHost, st);
    if (s == DLUA_OK && e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (s == DLUA_OK && e != cudaSuccess) s = cuda_fail(op, e);
    if (dlua_cuda_free(p.device, mem) != DLUA_OK && s == DLUA_OK) s = DLUA_ERR_BACKEND;
    DLUA_TRY(s);
  }
  if (host[2]) {
    *bad = 1;
    return DLUA_OK;
  }
  if (total <= 0) return DLUA_OK;
  if (nout <= 0) {  // nothing pooled: a zero gradient
    cudaError_t e = cudaMemsetAsync(gx, 0, (size_t)total * sizeof(typename Tr<DT>::S), st);
    return e == cudaSuccess ? DLUA_OK : cuda_fail(op, e);
  }
  k_max_bwd<DT><<<grid_for(total), kThreads, 0, st>>>(p, gy, ind, gx, total, (int64_t)host[0], (int64_t)host[1]);
  return launched(op);
}

}  // namespace
}  // namespace dlua_cu

namespace {

dlua_status_t cuda_pool_forward(const char *op, const dlua_pool_fwd_t *a) {
  using namespace dlua_cu;
  const dlua_pool_geom_t *p = &a->p;
  DLUA_CU_SELECT(g, op, p->device);
  cudaStream_t st = (cudaStream_t)dlua_cuda_raw_stream(p->device);
#define POOL_FWD(DT) forward<DT>(op, *p, a->x, a->y, a->ind, st)
  DLUA_CU_FLOAT_DISPATCH(p->dtype, POOL_FWD, op, "pooling")
#undef POOL_FWD
}

dlua_status_t cuda_pool_backward(const char *op, const dlua_pool_bwd_t *a) {
  using namespace dlua_cu;
  const dlua_pool_geom_t *p = &a->p;
  int *bad = a->bad;
  *bad = 0;
  DLUA_CU_SELECT(g, op, p->device);
  cudaStream_t st = (cudaStream_t)dlua_cuda_raw_stream(p->device);
#define POOL_BWD(DT) backward<DT>(op, *p, a->gy, a->ind, a->gx, bad, st)
  DLUA_CU_FLOAT_DISPATCH(p->dtype, POOL_BWD, op, "pooling")
#undef POOL_BWD
}

}  // namespace

/* The kernels read and write the activations' own dtype (16-bit ones computed in float). */
extern "C" const struct dlua_pool_ops dlua_cuda_pool_ops = {1, cuda_pool_forward, cuda_pool_backward};

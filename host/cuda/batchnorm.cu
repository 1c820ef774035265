/* The CUDA batch-norm kernels (kernels/norm.h; front doors in host/ops/batchnorm.c): statistics, normalisation fused with a residual add and ReLU, backward reduce and apply, NCHW or channels-last. */
/* Our own kernels rather than cuDNN's: the C API splits statistics from normalisation (SyncBatchNorm
   all-reduces between the halves, forward and backward), fuses the residual add and the ReLU forward and
   the residual gradient backward, and must be deterministic (a result depends on the shape only: fixed
   partitions, fixed trees, no atomics); PyTorch also runs its own kernels for channels-last batch-norm.

   The arithmetic is the CPU backend's (its batchnorm.c, batchnorm_impl.h): sums of (x - shift) and its
   square in double, shift = the channel's first value; the backward's sum d and sum d (x - mean) in
   double with the product in the compute type; per-channel coefficients computed in double and rounded
   to the compute type (float for f32/f16/bf16, double for f64), elementwise passes in that type.

   Two memory shapes. Rows ((M, C), channels-last or S == 1): a block is TX x TY threads, each thread
   owns V adjacent channels (one 16-byte vector) and walks rows TY apart, so loads are coalesced along C
   and the channel's coefficients stay in registers. Planes ((N, C, S), NCHW): one warp per (n, c)
   plane. Reductions write per-block (rows) or per-plane partials to a workspace; a second kernel adds
   each channel's partials in a fixed tree and computes the statistics. */
#include "cuda/ew_common.cuh"
#include "cuda/device_guard.cuh"
#include "kernels/norm.h"

namespace dlua_cu {
namespace {

constexpr int kBlk = 256;

template <int DT> struct Ty {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C C;
  static constexpr int V = 16 / (int)sizeof(S);  // channels (rows) or positions (planes) per 16-byte vector
};

/* ---- per-channel vectors of any floating dtype and stride -------------------------------------------------- */

__device__ __forceinline__ double vget(const dlua_bn_vec_t &v, int64_t i, double dflt) {
  if (!v.p) return dflt;
  const int64_t k = i * v.stride;
  switch (v.dtype) {
    case DLUA_DTYPE_F32: return ((const float *)v.p)[k];
    case DLUA_DTYPE_F64: return ((const double *)v.p)[k];
    case DLUA_DTYPE_F16: return dlua_f16_to_f32_inl(((const uint16_t *)v.p)[k]);
    default: return dlua_bf16_to_f32_inl(((const uint16_t *)v.p)[k]);
  }
}

__device__ __forceinline__ void vset(const dlua_bn_vec_t &v, int64_t i, double x) {
  if (!v.p) return;
  const int64_t k = i * v.stride;
  switch (v.dtype) {
    case DLUA_DTYPE_F32: ((float *)v.p)[k] = (float)x; break;
    case DLUA_DTYPE_F64: ((double *)v.p)[k] = x; break;
    case DLUA_DTYPE_F16: ((uint16_t *)v.p)[k] = dlua_f32_to_f16_inl((float)x); break;
    default: ((uint16_t *)v.p)[k] = dlua_f32_to_bf16_inl((float)x); break;
  }
}

/* W values at p into compute-type registers: one 16-byte load (VEC, W == V), else the first nv one by one. */
template <int DT, bool VEC, int W>
__device__ __forceinline__ void loadv(const typename Ty<DT>::S *p, int nv, typename Ty<DT>::C *v) {
  typedef typename Ty<DT>::S S;
  if constexpr (VEC) {
    const Vec<S, W> t = *reinterpret_cast<const Vec<S, W> *>(p);
#pragma unroll
    for (int j = 0; j < W; j++) v[j] = Tr<DT>::ld(t.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < W; j++) v[j] = j < nv ? Tr<DT>::ld(p[j]) : (typename Ty<DT>::C)0;
  }
}

template <int DT, bool VEC, int W>
__device__ __forceinline__ void storev(typename Ty<DT>::S *p, int nv, const typename Ty<DT>::C *v) {
  typedef typename Ty<DT>::S S;
  if constexpr (VEC) {
    Vec<S, W> t;
#pragma unroll
    for (int j = 0; j < W; j++) t.v[j] = Tr<DT>::st(v[j]);
    *reinterpret_cast<Vec<S, W> *>(p) = t;
  } else {
#pragma unroll
    for (int j = 0; j < W; j++)
      if (j < nv) p[j] = Tr<DT>::st(v[j]);
  }
}

/* ---- per-element operations ---------------------------------------------------------------------------------- */

/* Reductions: MODE 0 sums (x - shift) and its square; 1 sums d = dy and d (x - mean); 2 the same with
   d masked by y > 0 (the forward fused a ReLU). */
template <int DT, int MODE> struct RedOp {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  static constexpr int V = Ty<DT>::V;
  const S *x, *dy, *y;
  dlua_bn_vec_t mean;
  int64_t C, S_;
  int rows;
  struct Ch {
    double k;
    Cc m;
  };
  __device__ __forceinline__ Ch chan(int64_t c) const {
    Ch h;
    h.k = MODE == 0 ? (double)Tr<DT>::ld(x[rows ? c : c * S_]) : 0.0;
    h.m = MODE == 0 ? (Cc)0 : (Cc)vget(mean, c, 0.0);
    return h;
  }
  template <bool VEC, int W>
  __device__ __forceinline__ void acc(int64_t off, int nv, const Ch *h, double *s, double *q) const {
    Cc xv[W], dv[W], yv[W];
    loadv<DT, VEC, W>(x + off, nv, xv);
    if (MODE > 0) loadv<DT, VEC, W>(dy + off, nv, dv);
    if (MODE == 2) loadv<DT, VEC, W>(y + off, nv, yv);
#pragma unroll
    for (int j = 0; j < W; j++) {
      if (!VEC && j >= nv) continue;
      if (MODE == 0) {
        const double d = (double)xv[j] - h[j].k;
        s[j] += d;
        q[j] += d * d;
      } else {
        Cc d = dv[j];
        if (MODE == 2) d = yv[j] > (Cc)0 ? d : (Cc)0;
        s[j] += (double)d;
        q[j] += (double)(d * (xv[j] - h[j].m));
      }
    }
  }
};

/* y = act((x - m) a + b (+ skip)); y may be x. */
template <int DT, bool SKIP, bool RELU> struct ApplyOp {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  static constexpr int V = Ty<DT>::V;
  const S *x, *sk;
  S *y;
  const Cc *coef;  // (3, C): m, a, b
  int64_t C;
  struct Ch {
    Cc m, a, b;
  };
  __device__ __forceinline__ Ch chan(int64_t c) const {
    Ch h;
    h.m = coef[c];
    h.a = coef[C + c];
    h.b = coef[2 * C + c];
    return h;
  }
  template <bool VEC, int W> __device__ __forceinline__ void run(int64_t off, int nv, const Ch *h) const {
    Cc xv[W], sv[W], o[W];
    loadv<DT, VEC, W>(x + off, nv, xv);
    if (SKIP) loadv<DT, VEC, W>(sk + off, nv, sv);
#pragma unroll
    for (int j = 0; j < W; j++) {
      Cc v = (xv[j] - h[j].m) * h[j].a + h[j].b;
      if (SKIP) v += sv[j];
      if (RELU) v = v < (Cc)0 ? (Cc)0 : v;
      o[j] = v;
    }
    storev<DT, VEC, W>(y + off, nv, o);
  }
};

/* dx = d A + (x - m) B + D, dskip = d (d = dy, masked by y > 0 when MASK). Every value is read before
   either output is written, so dx or dskip may be dy itself. */
template <int DT, bool MASK, bool WDX, bool WDS> struct BwdOp {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  static constexpr int V = Ty<DT>::V;
  const S *x, *dy, *y;
  S *dx, *ds;
  const Cc *coef;  // (4, C): m, A, B, D
  int64_t C;
  struct Ch {
    Cc m, A, B, D;
  };
  __device__ __forceinline__ Ch chan(int64_t c) const {
    Ch h;
    h.m = coef[c];
    h.A = coef[C + c];
    h.B = coef[2 * C + c];
    h.D = coef[3 * C + c];
    return h;
  }
  template <bool VEC, int W> __device__ __forceinline__ void run(int64_t off, int nv, const Ch *h) const {
    Cc dv[W], xv[W], yv[W], o[W];
    loadv<DT, VEC, W>(dy + off, nv, dv);
    if (WDX) loadv<DT, VEC, W>(x + off, nv, xv);
    if (MASK) loadv<DT, VEC, W>(y + off, nv, yv);
#pragma unroll
    for (int j = 0; j < W; j++) {
      if (MASK) dv[j] = yv[j] > (Cc)0 ? dv[j] : (Cc)0;
      if (WDX) o[j] = dv[j] * h[j].A + (xv[j] - h[j].m) * h[j].B + h[j].D;
    }
    if (WDS) storev<DT, VEC, W>(ds + off, nv, dv);
    if (WDX) storev<DT, VEC, W>(dx + off, nv, o);
  }
};

/* ---- drivers -------------------------------------------------------------------------------------------------- */

/* Rows (M, C): block (TX, TY) over channel chunk blockIdx.y (TX * V channels) and rows blockIdx.x * TY + ty,
   grid-strided. */
template <typename Op, bool VEC>
__global__ void __launch_bounds__(kBlk) k_rows(Op op, int64_t M, int64_t C, int TX, int64_t CC) {
  constexpr int V = Op::V;
  const int TY = kBlk / TX, tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  for (int64_t cc = blockIdx.y; cc < CC; cc += gridDim.y) {
    const int64_t c0 = (cc * TX + tx) * V;
    if (c0 >= C) continue;
    const int nv = C - c0 < V ? (int)(C - c0) : V;
    typename Op::Ch h[V];
#pragma unroll
    for (int j = 0; j < V; j++) h[j] = op.chan(j < nv ? c0 + j : c0);
    // Unrolled so that several rows' loads are in flight per thread.
#pragma unroll 4
    for (int64_t r = (int64_t)blockIdx.x * TY + ty; r < M; r += (int64_t)gridDim.x * TY)
      op.template run<VEC, V>(r * C + c0, nv, h);
  }
}

/* Planes (P = N * C planes of S): one warp per plane, grid-strided. */
template <typename Op, bool VEC> __global__ void __launch_bounds__(kBlk) k_planes(Op op, int64_t P, int64_t C, int64_t S) {
  constexpr int V = Op::V;
  const int lane = threadIdx.x & 31;
  const int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t p = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < P; p += nw) {
    const typename Op::Ch h0 = op.chan(p % C);
    typename Op::Ch h[V];
#pragma unroll
    for (int j = 0; j < V; j++) h[j] = h0;
    const int64_t base = p * S;
    if (VEC) {
      for (int64_t i = (int64_t)lane * V; i < S; i += 32 * V) op.template run<true, V>(base + i, V, h);
    } else {
      for (int64_t i = lane; i < S; i += 32) op.template run<false, 1>(base + i, 1, h);
    }
  }
}

/* Rows reduction: block (blockIdx.x, cc) sums rows [blockIdx.x * R, + R) of its channels, thread ty taking
   rows ty, ty + TY, ..., then a fixed tree over ty; partials (gridDim.x, C). */
template <typename Op, bool VEC>
__global__ void __launch_bounds__(kBlk) k_red_rows(Op op, int64_t M, int64_t C, int TX, int64_t CC, int64_t R,
                                                   double *ps, double *pq) {
  constexpr int V = Op::V;
  __shared__ double shs[kBlk * V], shq[kBlk * V];
  const int TY = kBlk / TX, tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int64_t rc = blockIdx.x, r0 = rc * R, r1 = r0 + R < M ? r0 + R : M;
  for (int64_t cc = blockIdx.y; cc < CC; cc += gridDim.y) {
    const int64_t c0 = (cc * TX + tx) * V;
    const int nv = c0 >= C ? 0 : C - c0 < V ? (int)(C - c0) : V;
    double s[V], q[V];
#pragma unroll
    for (int j = 0; j < V; j++) s[j] = q[j] = 0;
    if (nv > 0) {
      typename Op::Ch h[V];
#pragma unroll
      for (int j = 0; j < V; j++) h[j] = op.chan(j < nv ? c0 + j : c0);
#pragma unroll 4
      for (int64_t r = r0 + ty; r < r1; r += TY) op.template acc<VEC, V>(r * C + c0, nv, h, s, q);
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
      shs[threadIdx.x * V + j] = s[j];
      shq[threadIdx.x * V + j] = q[j];
    }
    __syncthreads();
    for (int w = TY / 2; w > 0; w >>= 1) {
      if (ty < w)
#pragma unroll
        for (int j = 0; j < V; j++) {
          shs[threadIdx.x * V + j] += shs[(threadIdx.x + w * TX) * V + j];
          shq[threadIdx.x * V + j] += shq[(threadIdx.x + w * TX) * V + j];
        }
      __syncthreads();
    }
    if (ty == 0)
      for (int j = 0; j < nv; j++) {
        ps[rc * C + c0 + j] = shs[tx * V + j];
        pq[rc * C + c0 + j] = shq[tx * V + j];
      }
    __syncthreads();
  }
}

/* Planes reduction: a warp per plane p = n * C + c, positions in chunks of V per lane (the same order
   whether or not the loads are vectors), then the V lanes and a fixed shuffle tree; partials (N, C). */
template <typename Op, bool VEC>
__global__ void __launch_bounds__(kBlk) k_red_planes(Op op, int64_t P, int64_t C, int64_t S, double *ps, double *pq) {
  constexpr int V = Op::V;
  const int lane = threadIdx.x & 31;
  const int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t p = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < P; p += nw) {
    const typename Op::Ch h0 = op.chan(p % C);
    typename Op::Ch h[V];
    double s[V], q[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
      h[j] = h0;
      s[j] = q[j] = 0;
    }
    const int64_t base = p * S;
    for (int64_t i = (int64_t)lane * V; i < S; i += 32 * V)
      op.template acc<VEC, V>(base + i, S - i < V ? (int)(S - i) : V, h, s, q);
    double ts = 0, tq = 0;
#pragma unroll
    for (int j = 0; j < V; j++) {
      ts += s[j];
      tq += q[j];
    }
    for (int o = 16; o > 0; o >>= 1) {
      ts += __shfl_down_sync(0xffffffffu, ts, o);
      tq += __shfl_down_sync(0xffffffffu, tq, o);
    }
    if (lane == 0) {
      ps[p] = ts;
      pq[p] = tq;
    }
  }
}

/* Each channel's partials (nparts, C) added by one warp (lane l takes parts l, l + 32, ...) and a fixed
   shuffle tree, then the per-channel epilogue on lane 0. ps NULL: nothing was reduced (sums 0). */
template <typename Fin>
__global__ void __launch_bounds__(kBlk) k_final(Fin f, int64_t C, const double *ps, const double *pq, int64_t nparts) {
  const int lane = threadIdx.x & 31;
  if (blockIdx.x == 0 && threadIdx.x == 0) f.once();
  const int64_t nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < C; c += nw) {
    double s = 0, q = 0;
    if (ps) {
#pragma unroll 8
      for (int64_t p = lane; p < nparts; p += 32) {
        s += ps[p * C + c];
        q += pq[p * C + c];
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_down_sync(0xffffffffu, s, o);
      q += __shfl_down_sync(0xffffffffu, q, o);
    }
    if (lane == 0) f.channel(c, s, q);
  }
}

/* Forward statistics -> running update, saves, coefficients (m, gamma invstd, beta) in the compute type;
   or, with stats_out, the batch's packed sums (batch_norm_stats). As bn_forward / batch_norm_stats. */
template <int DT> struct FwdFin {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  dlua_bn_fwd_t a;
  Cc *coef;
  __device__ void once() const {
    if (a.stats_out) a.stats_out[2 * a.g.C] = (double)a.M;
  }
  __device__ void channel(int64_t c, double sum, double sq) const {
    const int64_t C = a.g.C, M = a.M;
    double mean = 0, invstd = 0, var = 0;
    if (a.stats_out || (a.train && !a.stats)) {
      // Sums of x - shift (a value of the channel), then the shift put back, in double.
      const double sh = M > 0 ? (double)Tr<DT>::ld(((const S *)a.x)[a.g.rows ? c : c * a.g.S]) : 0.0;
      if (a.stats_out) {
        a.stats_out[c] = M > 0 ? sum + (double)M * sh : 0.0;
        a.stats_out[C + c] = M > 0 ? sq + sh * (2.0 * sum + (double)M * sh) : 0.0;
        return;
      }
      const double m = M > 0 ? sum / (double)M : 0.0;
      var = M > 0 ? sq / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean = M > 0 ? sh + m : 0.0;
      invstd = 1.0 / sqrt(var + a.eps);
    } else if (a.train) {
      // Unshifted sums of every rank in double, as the CPU.
      const double m = M > 0 ? a.stats[c] / (double)M : 0.0;
      var = M > 0 ? a.stats[C + c] / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean = m;
      invstd = 1.0 / sqrt(var + a.eps);
    }
    if (a.train) {
      if (M > 1) {
        const double unbias = (double)M / (double)(M - 1);
        if (a.running_mean.p)
          vset(a.running_mean, c, (1 - a.momentum) * vget(a.running_mean, c, 0.0) + a.momentum * mean);
        if (a.running_var.p)
          vset(a.running_var, c, (1 - a.momentum) * vget(a.running_var, c, 0.0) + a.momentum * var * unbias);
      }
    } else {
      mean = vget(a.running_mean, c, 0.0);
      invstd = 1.0 / sqrt(vget(a.running_var, c, 0.0) + a.eps);
    }
    coef[c] = (Cc)mean;
    coef[C + c] = (Cc)(vget(a.gamma, c, 1.0) * invstd);
    coef[2 * C + c] = (Cc)vget(a.beta, c, 0.0);
    vset(a.save_mean, c, mean);
    vset(a.save_invstd, c, invstd);
  }
};

/* Backward sums -> sums_out, grad_gamma/grad_beta, coefficients (m, A, B, D). As bn_backward. */
template <int DT> struct BwdFin {
  typedef typename Ty<DT>::C Cc;
  dlua_bn_bwd_t a;
  Cc *coef;
  __device__ void once() const {
    if (a.sums_out) a.sums_out[2 * a.g.C] = (double)a.M;
  }
  __device__ void channel(int64_t c, double sdy, double sdx) const {
    const int64_t C = a.g.C, M = a.M;
    const double mean = vget(a.save_mean, c, 0.0), invstd = vget(a.save_invstd, c, 1.0), gm = vget(a.gamma, c, 1.0);
    if (a.sums_in) {
      sdy = a.sums_in[c];
      sdx = a.sums_in[C + c];
    }
    if (a.sums_out) {
      a.sums_out[c] = sdy;
      a.sums_out[C + c] = sdx;
    }
    if (a.grad_gamma.p) vset(a.grad_gamma, c, (a.accumulate ? vget(a.grad_gamma, c, 0.0) : 0.0) + sdx * invstd);
    if (a.grad_beta.p) vset(a.grad_beta, c, (a.accumulate ? vget(a.grad_beta, c, 0.0) : 0.0) + sdy);
    // dx = gamma invstd (d - sum(d) / M - xhat sum(d xhat) / M) with the batch's statistics; gamma invstd d with fixed ones.
    const double A = gm * invstd;
    const double B = a.train && M > 0 ? -A * invstd * invstd * sdx / (double)M : 0.0;
    const double D = a.train && M > 0 ? -A * sdy / (double)M : 0.0;
    coef[c] = (Cc)mean;
    coef[C + c] = (Cc)A;
    coef[2 * C + c] = (Cc)B;
    coef[3 * C + c] = (Cc)D;
  }
};

/* ---- launch geometry -------------------------------------------------------------------------------------------- */

/* Rows: TX threads across the channel vectors (a power of two up to 32), TY = 256 / TX down the rows;
   CC channel chunks. The reduction cuts the rows into RC chunks of R: about 1024 blocks in all, at least
   64 rows each, fixed by the shape (never by the GPU), so the sums are too. */
struct RowsGeom {
  int TX;
  int64_t CC, RC, R;
};

RowsGeom rows_geom(int64_t M, int64_t C, int V) {
  RowsGeom g;
  const int64_t nvec = (C + V - 1) / V;
  g.TX = 1;
  while (g.TX < nvec && g.TX < 32) g.TX *= 2;
  g.CC = (nvec + g.TX - 1) / g.TX;
  int64_t rc = (M + 63) / 64, cap = (1024 + g.CC - 1) / g.CC;
  if (rc > cap) rc = cap;
  if (rc < 1) rc = 1;
  g.R = M > 0 ? (M + rc - 1) / rc : 1;
  g.RC = M > 0 ? (M + g.R - 1) / g.R : 1;
  return g;
}

inline unsigned cap_y(int64_t n) { return (unsigned)(n < 1 ? 1 : n > 65535 ? 65535 : n); }

/* Blocks for a grid-strided pass over `work` 16-byte vectors (a few per SM; grid_for caps it). */
inline unsigned blocks_for(int64_t work) { return grid_for(work); }

inline bool al16(const void *p) { return p == nullptr || ((uintptr_t)p & 15) == 0; }

template <typename Op> dlua_status_t elementwise(const char *op, const Op &o, const dlua_bn_geom_t &g, bool vec_ok,
                                                 cudaStream_t st) {
  constexpr int V = Op::V;
  if (g.rows) {
    const int64_t M = g.N * g.S;
    const RowsGeom rg = rows_geom(M, g.C, V);
    const int TY = kBlk / rg.TX;
    const unsigned gy = cap_y(rg.CC);
    int64_t gx = (int64_t)blocks_for(M * ((g.C + V - 1) / V)) / gy;
    const int64_t need = (M + TY - 1) / TY;
    if (gx > need) gx = need;
    if (gx < 1) gx = 1;
    const dim3 grid((unsigned)gx, gy);
    if (vec_ok && g.C % V == 0) k_rows<Op, true><<<grid, kBlk, 0, st>>>(o, M, g.C, rg.TX, rg.CC);
    else k_rows<Op, false><<<grid, kBlk, 0, st>>>(o, M, g.C, rg.TX, rg.CC);
  } else {
    const int64_t P = g.N * g.C;
    const unsigned grid = blocks_for(P * 32);
    if (vec_ok && g.S % V == 0) k_planes<Op, true><<<grid, kBlk, 0, st>>>(o, P, g.C, g.S);
    else k_planes<Op, false><<<grid, kBlk, 0, st>>>(o, P, g.C, g.S);
  }
  return launched(op);
}

/* Partials of op over the whole input into ps/pq ((nparts, C) each); nparts as reduce_parts. */
template <typename Op> dlua_status_t reduce(const char *op, const Op &o, const dlua_bn_geom_t &g, bool vec_ok,
                                            double *ps, double *pq, cudaStream_t st) {
  constexpr int V = Op::V;
  if (g.rows) {
    const int64_t M = g.N * g.S;
    const RowsGeom rg = rows_geom(M, g.C, V);
    const dim3 grid((unsigned)rg.RC, cap_y(rg.CC));
    if (vec_ok && g.C % V == 0) k_red_rows<Op, true><<<grid, kBlk, 0, st>>>(o, M, g.C, rg.TX, rg.CC, rg.R, ps, pq);
    else k_red_rows<Op, false><<<grid, kBlk, 0, st>>>(o, M, g.C, rg.TX, rg.CC, rg.R, ps, pq);
  } else {
    const int64_t P = g.N * g.C;
    const unsigned grid = blocks_for(P * 32);
    if (vec_ok && g.S % V == 0) k_red_planes<Op, true><<<grid, kBlk, 0, st>>>(o, P, g.C, g.S, ps, pq);
    else k_red_planes<Op, false><<<grid, kBlk, 0, st>>>(o, P, g.C, g.S, ps, pq);
  }
  return launched(op);
}

int64_t reduce_parts(const dlua_bn_geom_t &g, int V) { return g.rows ? rows_geom(g.N * g.S, g.C, V).RC : g.N; }

template <typename Fin> dlua_status_t finalize(const char *op, const Fin &f, int64_t C, const double *ps,
                                               const double *pq, int64_t nparts, cudaStream_t st) {
  int64_t blocks = (C + 7) / 8;  // a warp per channel
  if (blocks > 65535) blocks = 65535;
  if (blocks < 1) blocks = 1;
  k_final<Fin><<<(unsigned)blocks, kBlk, 0, st>>>(f, C, ps, pq, nparts);
  return launched(op);
}

/* Workspace from the caching allocator on the current stream: partial sums (2 nparts C doubles) and the
   per-channel coefficients (4 C of the compute type). */
struct Scratch {
  void *mem = nullptr;
  int device = 0;
  double *ps = nullptr, *pq = nullptr;
  void *coef = nullptr;
  dlua_status_t get(int dev, int64_t nparts, int64_t C, size_t csize) {
    device = dev;
    const size_t pbytes = (size_t)(2 * nparts * C) * sizeof(double);
    DLUA_TRY(dlua_cuda_malloc(&mem, dev, pbytes + (size_t)(4 * C) * csize, NULL));
    ps = (double *)mem;
    pq = ps + nparts * C;
    coef = (char *)mem + pbytes;
    return DLUA_OK;
  }
  dlua_status_t put(dlua_status_t s) {
    if (mem && dlua_cuda_free(device, mem) != DLUA_OK && s == DLUA_OK) s = DLUA_ERR_BACKEND;
    mem = nullptr;
    return s;
  }
};

/* ---- forward and backward per dtype ------------------------------------------------------------------------------ */

template <int DT> dlua_status_t forward(const char *op, const dlua_bn_fwd_t &a, cudaStream_t st) {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  constexpr int V = Ty<DT>::V;
  const dlua_bn_geom_t &g = a.g;
  const int64_t C = g.C, numel = g.N * g.C * g.S;
  const bool local = a.stats_out || (a.train && !a.stats);
  const bool red = local && numel > 0;
  const bool vec_ok = al16(a.x) && al16(a.skip) && al16(a.y);
  const int64_t nparts = red ? reduce_parts(g, V) : 0;
  Scratch sc;
  DLUA_TRY(sc.get(g.device, nparts, C, sizeof(Cc)));
  dlua_status_t s = DLUA_OK;
  if (red) {
    RedOp<DT, 0> r{(const S *)a.x, nullptr, nullptr, dlua_bn_vec_t{}, C, g.S, g.rows};
    s = reduce(op, r, g, vec_ok, sc.ps, sc.pq, st);
  }
  if (s == DLUA_OK) s = finalize(op, FwdFin<DT>{a, (Cc *)sc.coef}, C, red ? sc.ps : nullptr, sc.pq, nparts, st);
  if (s == DLUA_OK && a.y && numel > 0) {
    const S *x = (const S *)a.x, *sk = (const S *)a.skip;
    S *y = (S *)a.y;
    const Cc *cf = (const Cc *)sc.coef;
#define BN_APPLY(SK, RL) s = elementwise(op, ApplyOp<DT, SK, RL>{x, sk, y, cf, C}, g, vec_ok, st)
    if (a.skip) {
      if (a.relu) BN_APPLY(true, true);
      else BN_APPLY(true, false);
    } else {
      if (a.relu) BN_APPLY(false, true);
      else BN_APPLY(false, false);
    }
#undef BN_APPLY
  }
  return sc.put(s);
}

template <int DT> dlua_status_t backward(const char *op, const dlua_bn_bwd_t &a, cudaStream_t st) {
  typedef typename Ty<DT>::S S;
  typedef typename Ty<DT>::C Cc;
  constexpr int V = Ty<DT>::V;
  const dlua_bn_geom_t &g = a.g;
  const int64_t C = g.C, numel = g.N * g.C * g.S;
  const bool red = a.reduce && numel > 0;
  const bool vec_ok = al16(a.x) && al16(a.dy) && al16(a.y) && al16(a.dx) && al16(a.dskip);
  const int64_t nparts = red ? reduce_parts(g, V) : 0;
  Scratch sc;
  DLUA_TRY(sc.get(g.device, nparts, C, sizeof(Cc)));
  dlua_status_t s = DLUA_OK;
  const S *x = (const S *)a.x, *dy = (const S *)a.dy, *y = (const S *)a.y;
  if (red) {
    if (y) s = reduce(op, RedOp<DT, 2>{x, dy, y, a.save_mean, C, g.S, g.rows}, g, vec_ok, sc.ps, sc.pq, st);
    else s = reduce(op, RedOp<DT, 1>{x, dy, y, a.save_mean, C, g.S, g.rows}, g, vec_ok, sc.ps, sc.pq, st);
  }
  if (s == DLUA_OK) s = finalize(op, BwdFin<DT>{a, (Cc *)sc.coef}, C, red ? sc.ps : nullptr, sc.pq, nparts, st);
  if (s == DLUA_OK && (a.dx || a.dskip) && numel > 0) {
    S *dx = (S *)a.dx, *ds = (S *)a.dskip;
    const Cc *cf = (const Cc *)sc.coef;
#define BN_BWD(MK, WX, WS) s = elementwise(op, BwdOp<DT, MK, WX, WS>{x, dy, y, dx, ds, cf, C}, g, vec_ok, st)
    if (y) {
      if (dx && ds) BN_BWD(true, true, true);
      else if (dx) BN_BWD(true, true, false);
      else BN_BWD(true, false, true);
    } else {
      if (dx && ds) BN_BWD(false, true, true);
      else if (dx) BN_BWD(false, true, false);
      else BN_BWD(false, false, true);
    }
#undef BN_BWD
  }
  return sc.put(s);
}

}  // namespace
}  // namespace dlua_cu

#define BN_SELECT(op, dev)     \
  DLUA_CU_SELECT(guard, op, dev); \
  cudaStream_t st = (cudaStream_t)dlua_cuda_raw_stream(dev)

namespace {

dlua_status_t cuda_bn_forward(const char *op, const dlua_bn_fwd_t *a) {
  using namespace dlua_cu;
  BN_SELECT(op, a->g.device);
#define BN_FWD_DT(DT) forward<DT>(op, *a, st)
  DLUA_CU_FLOAT_DISPATCH(a->g.dtype, BN_FWD_DT, op, "batch-norm")
#undef BN_FWD_DT
}

dlua_status_t cuda_bn_backward(const char *op, const dlua_bn_bwd_t *a) {
  using namespace dlua_cu;
  BN_SELECT(op, a->g.device);
#define BN_BWD_DT(DT) backward<DT>(op, *a, st)
  DLUA_CU_FLOAT_DISPATCH(a->g.dtype, BN_BWD_DT, op, "batch-norm")
#undef BN_BWD_DT
}

}  // namespace

/* The kernels read and write the activations' own dtype when they agree (16-bit ones converted in
   registers); they always read the forward's output for a fused ReLU's mask (y_exact unused). */
extern "C" const struct dlua_norm_ops dlua_cuda_norm_ops = {1, cuda_bn_forward, cuda_bn_backward};

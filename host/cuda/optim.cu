/* Fused optimizer steps (SGD and Adam/AdamW, which write mixed precision's 16-bit copy in the same pass, LARS and
   LAMB with deterministic per-parameter norms), AMP unscaling and clip_grad_norm_'s partial norms on CUDA: kernels
   over flat arena ranges whose per-element code is the CPU's (host/kernels/optim_ops.h). They fill the CUDA table's
   optim family (host/kernels/optim.h); compression's slots stay NULL (the CPU only). */
#include "cuda/ew_common.cuh"
#include "kernels/optim_ops.h"
#include "cuda/device_guard.cuh"
#include "cuda/kernels.h"

namespace dlua_cu {
namespace {

template <typename T> struct Step;
template <> struct Step<float> {
  static __device__ __forceinline__ void sgd(float *p, float g, float *b, float gs, float wd, float mom, float d1,
                                             float lr, int nes, int mx, int first) {
    dlua_opt_sgd_f(p, g, b, gs, wd, mom, d1, lr, nes, mx, first);
  }
  static __device__ __forceinline__ void adam(float *p, float g, float *m, float *v, float *vm, float gs, float dec,
                                              float l2, float b1, float o1, float b2, float o2, float ns, float bc2s,
                                              float eps, int mx, int ams) {
    dlua_opt_adam_f(p, g, m, v, vm, gs, dec, l2, b1, o1, b2, o2, ns, bc2s, eps, mx, ams);
  }
  static __device__ __forceinline__ float lamb_moments(float p, float g, float *m, float *v, float gs, float b1,
                                                       float o1, float b2, float o2, float bc1, float bc2, float eps,
                                                       float wd) {
    return dlua_opt_lamb_moments_f(p, g, m, v, gs, b1, o1, b2, o2, bc1, bc2, eps, wd);
  }
  static __device__ __forceinline__ void lamb_apply(float *p, float m, float v, float neg, float bc1, float bc2,
                                                    float eps, float wd) {
    dlua_opt_lamb_apply_f(p, m, v, neg, bc1, bc2, eps, wd);
  }
  static __device__ __forceinline__ void lars(float *p, float g, float *b, float gs, float wd, float tr, float mom,
                                              float lr, int first) {
    dlua_opt_lars_f(p, g, b, gs, wd, tr, mom, lr, first);
  }
};
template <> struct Step<double> {
  static __device__ __forceinline__ void sgd(double *p, double g, double *b, double gs, double wd, double mom,
                                             double d1, double lr, int nes, int mx, int first) {
    dlua_opt_sgd_d(p, g, b, gs, wd, mom, d1, lr, nes, mx, first);
  }
  static __device__ __forceinline__ void adam(double *p, double g, double *m, double *v, double *vm, double gs,
                                              double dec, double l2, double b1, double o1, double b2, double o2,
                                              double ns, double bc2s, double eps, int mx, int ams) {
    dlua_opt_adam_d(p, g, m, v, vm, gs, dec, l2, b1, o1, b2, o2, ns, bc2s, eps, mx, ams);
  }
  static __device__ __forceinline__ double lamb_moments(double p, double g, double *m, double *v, double gs, double b1,
                                                        double o1, double b2, double o2, double bc1, double bc2,
                                                        double eps, double wd) {
    return dlua_opt_lamb_moments_d(p, g, m, v, gs, b1, o1, b2, o2, bc1, bc2, eps, wd);
  }
  static __device__ __forceinline__ void lamb_apply(double *p, double m, double v, double neg, double bc1, double bc2,
                                                    double eps, double wd) {
    dlua_opt_lamb_apply_d(p, m, v, neg, bc1, bc2, eps, wd);
  }
  static __device__ __forceinline__ void lars(double *p, double g, double *b, double gs, double wd, double tr,
                                              double mom, double lr, int first) {
    dlua_opt_lars_d(p, g, b, gs, wd, tr, mom, lr, first);
  }
};

/* Scalars rounded to T on the host exactly as the CPU backend's optim.c's loops round them. lp: mixed precision's
   16-bit copy of the range (float32 params only), NULL when the step writes none. */
template <typename T> struct SgdK {
  T *p, *buf;
  const T *g;
  uint16_t *lp;
  T gs, wd, mom, damp1, lr;
  int nesterov, maximize, first;
};
template <typename T> struct AdamK {
  T *p, *m, *v, *vmax;
  const T *g;
  uint16_t *lp;
  T gs, decay, l2, b1, omb1, b2, omb2, neg_step, bc2_sqrt, eps;
  int maximize, amsgrad;
};

/* Master weights: element i of the 16-bit copy (LP DLUA_DTYPE_F16 or BF16) = the parameter just updated, in the same
   pass (no pass of its own over the arena), converted as the CPU's dlua_convert and copy_ convert (core/dtype.h's
   round to nearest even), so the bits are param:to(dtype)'s. kNoLowp: no copy, nothing compiled in. */
constexpr int kNoLowp = -1;
template <int LP> struct Lowp {
  static __device__ __forceinline__ void put(uint16_t *lp, int64_t i, float v) { lp[i] = Tr<LP>::st(v); }
};
template <> struct Lowp<kNoLowp> {
  template <typename T> static __device__ __forceinline__ void put(uint16_t *, int64_t, T) {}
};

template <typename T, int LP> __global__ void k_sgd(SgdK<T> k, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    Step<T>::sgd(k.p + i, k.g[i], k.buf ? k.buf + i : nullptr, k.gs, k.wd, k.mom, k.damp1, k.lr, k.nesterov,
                 k.maximize, k.first);
    Lowp<LP>::put(k.lp, i, k.p[i]);
  }
}

template <typename T, int LP> __global__ void k_adam(AdamK<T> k, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    Step<T>::adam(k.p + i, k.g[i], k.m + i, k.v + i, k.vmax ? k.vmax + i : nullptr, k.gs, k.decay, k.l2, k.b1,
                  k.omb1, k.b2, k.omb2, k.neg_step, k.bc2_sqrt, k.eps, k.maximize, k.amsgrad);
    Lowp<LP>::put(k.lp, i, k.p[i]);
  }
}

template <typename T, int LP>
dlua_status_t step(const char *op, int kind, const dlua_opt_args_t *a, int64_t n, void *lp, cudaStream_t s) {
  if (kind == 0) {
    SgdK<T> k;
    k.p = (T *)a->p;
    k.buf = (T *)a->s1;
    k.g = (const T *)a->g;
    k.lp = (uint16_t *)lp;
    k.gs = (T)a->grad_scale;
    k.wd = (T)a->weight_decay;
    k.mom = (T)a->momentum;
    k.damp1 = (T)(1.0 - a->dampening);
    k.lr = (T)a->lr;
    k.nesterov = a->nesterov;
    k.maximize = a->maximize;
    k.first = a->first;
    k_sgd<T, LP><<<grid_for(n), kThreads, 0, s>>>(k, n);
  } else {
    AdamK<T> k;
    k.p = (T *)a->p;
    k.m = (T *)a->s1;
    k.v = (T *)a->s2;
    k.vmax = (T *)a->s3;
    k.g = (const T *)a->g;
    k.lp = (uint16_t *)lp;
    k.gs = (T)a->grad_scale;
    k.decay = (T)(a->decoupled ? 1.0 - a->lr * a->weight_decay : 1.0);  // AdamW; Adam: L2 below
    k.l2 = (T)(a->decoupled ? 0.0 : a->weight_decay);
    k.b1 = (T)a->beta1;
    k.omb1 = (T)(1.0 - a->beta1);
    k.b2 = (T)a->beta2;
    k.omb2 = (T)(1.0 - a->beta2);
    k.neg_step = (T)(-(a->lr / a->bc1));
    k.bc2_sqrt = (T)sqrt(a->bc2);
    k.eps = (T)a->eps;
    k.maximize = a->maximize;
    k.amsgrad = a->amsgrad;
    k_adam<T, LP><<<grid_for(n), kThreads, 0, s>>>(k, n);
  }
  return launched(op);
}

/* x *= s; counts non-finite inputs (bad: NULL for none): a block sum in shared memory, one atomic add of an
   integer per block. */
template <int DT> __global__ void k_unscale(void *x_, int64_t n, typename Tr<DT>::C s, unsigned long long *bad) {
  typedef typename Tr<DT>::S S;
  S *x = (S *)x_;
  __shared__ unsigned int cnt[kThreads];
  unsigned int mine = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    typename Tr<DT>::C v = Tr<DT>::ld(x[i]);
    mine += !isfinite(v);
    x[i] = Tr<DT>::st(v * s);
  }
  cnt[threadIdx.x] = mine;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) cnt[threadIdx.x] += cnt[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0 && cnt[0] && bad) atomicAdd(bad, (unsigned long long)cnt[0]);
}

template <int DT> void unscale(void *x, int64_t n, double inv, unsigned long long *bad, cudaStream_t s) {
  k_unscale<DT><<<grid_for(n), kThreads, 0, s>>>(x, n, (typename Tr<DT>::C)inv, bad);
}

/* ---- LARS -------------------------------------------------------------------------------------------------
   Parameters are cut into chunks of kLarsChunk elements (the CPU backend's optim.c's LARS_BLOCK); chunk c belongs to the
   parameter r with pstart[r] <= c < pstart[r + 1]. Pass 1 folds each chunk's sums of squares in one block (fixed
   tree), pass 2 folds each parameter's chunks in order and computes its trust ratio, pass 3 updates. No atomics:
   the ratios depend on the shapes only. The per-parameter table reaches the device as kernel arguments (no host
   buffer to keep alive, no synchronising copy). */

constexpr int kLarsChunk = 8192;
constexpr int kLarsBatch = 64;  // parameters per table-writing launch (about 1.8 KB of arguments)

struct LarsTable {  // device arrays, n_ranges entries each (pstart: n_ranges + 1)
  int64_t *off, *len, *pstart;
  int32_t *excl;
  double *part;   // (nchunks, 2): sum p^2, sum (g gs)^2
  double *trust;  // per parameter; -1: plain momentum SGD (excluded or a zero norm)
};

struct LarsBatch {
  int64_t off[kLarsBatch], len[kLarsBatch], pstart[kLarsBatch];
  int32_t excl[kLarsBatch];
  int first, count;
};

__global__ void k_lars_table(LarsTable t, LarsBatch b, int64_t nchunks, int n_ranges) {
  const int k = threadIdx.x;
  if (k < b.count) {
    const int r = b.first + k;
    t.off[r] = b.off[k];
    t.len[r] = b.len[k];
    t.pstart[r] = b.pstart[k];
    t.excl[r] = b.excl[k];
  }
  if (k == 0 && b.first + b.count == n_ranges) t.pstart[n_ranges] = nchunks;
}

/* The parameter of chunk c: the last r with pstart[r] <= c (never an empty one: its successor starts at c too). */
__device__ __forceinline__ int lars_param(const int64_t *pstart, int n_ranges, int64_t c) {
  int lo = 0, hi = n_ranges;  // pstart[lo] <= c < pstart[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (pstart[mid] <= c) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ void lars_chunk(const LarsTable &t, int n_ranges, int64_t c, int *r, int64_t *lo,
                                           int64_t *hi) {
  *r = lars_param(t.pstart, n_ranges, c);
  const int64_t end = t.off[*r] + t.len[*r];
  *lo = t.off[*r] + (c - t.pstart[*r]) * kLarsChunk;
  *hi = *lo + kLarsChunk < end ? *lo + kLarsChunk : end;
}

template <typename T>
__global__ void k_lars_norms(LarsTable t, const T *p, const T *g, T gs, int64_t nchunks, int n_ranges) {
  __shared__ double sp[kThreads], sg[kThreads];
  const int tid = threadIdx.x;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // block-uniform
    int r;
    int64_t lo, hi;
    lars_chunk(t, n_ranges, c, &r, &lo, &hi);
    double a = 0, b = 0;
    if (!t.excl[r])
      for (int64_t i = lo + tid; i < hi; i += kThreads) {
        const double x = p[i], y = g[i] * gs;
        a += x * x;
        b += y * y;
      }
    sp[tid] = a;
    sg[tid] = b;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (tid < w) {
        sp[tid] += sp[tid + w];
        sg[tid] += sg[tid + w];
      }
      __syncthreads();
    }
    if (tid == 0) {
      t.part[2 * c] = sp[0];
      t.part[2 * c + 1] = sg[0];
    }
    __syncthreads();  // sp/sg are reused by the next chunk
  }
}

/* the CPU backend's optim.c's ratio: trust * |w| / (|g| + wd |w| + eps), or -1. */
__global__ void k_lars_trust(LarsTable t, int n_ranges, double tc, double wd, double eps) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n_ranges) return;
  double sp = 0, sg = 0;
  for (int64_t c = t.pstart[r]; c < t.pstart[r + 1]; c++) sp += t.part[2 * c], sg += t.part[2 * c + 1];
  const double pn = sqrt(sp), gn = sqrt(sg);
  // Rounded step by step as the CPU's expression (no fused multiply-adds).
  t.trust[r] = !t.excl[r] && pn > 0 && gn > 0
                   ? __ddiv_rn(__dmul_rn(tc, pn), __dadd_rn(__dadd_rn(gn, __dmul_rn(wd, pn)), eps))
                   : -1.0;
}

template <typename T> struct LarsK {
  T *p, *buf;
  const T *g;
  T gs, wd, mom, lr;
  int first;
};

template <typename T> __global__ void k_lars_update(LarsTable t, LarsK<T> k, int64_t nchunks, int n_ranges) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int r;
    int64_t lo, hi;
    lars_chunk(t, n_ranges, c, &r, &lo, &hi);
    const double tr = t.trust[r];
    const T trust = (T)(tr < 0 ? 1.0 : tr), wd = tr < 0 ? (T)0 : k.wd;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
      Step<T>::lars(k.p + i, k.g[i], k.buf ? k.buf + i : nullptr, k.gs, wd, trust, k.mom, k.lr, k.first);
  }
}

template <typename T>
dlua_status_t lars(const char *op, const LarsTable &t, const dlua_opt_args_t *a, int64_t nchunks, int n_ranges,
                   double tc, double eps, cudaStream_t s) {
  const unsigned grid = grid_for(nchunks * kThreads);
  k_lars_norms<T><<<grid, kThreads, 0, s>>>(t, (const T *)a->p, (const T *)a->g, (T)a->grad_scale, nchunks, n_ranges);
  DLUA_TRY(launched(op));
  k_lars_trust<<<(unsigned)((n_ranges + kThreads - 1) / kThreads), kThreads, 0, s>>>(t, n_ranges, tc, a->weight_decay,
                                                                                     eps);
  DLUA_TRY(launched(op));
  LarsK<T> k;
  k.p = (T *)a->p;
  k.buf = (T *)a->s1;
  k.g = (const T *)a->g;
  k.gs = (T)a->grad_scale;
  k.wd = (T)a->weight_decay;
  k.mom = (T)a->momentum;
  k.lr = (T)a->lr;
  k.first = a->first;
  k_lars_update<T><<<grid, kThreads, 0, s>>>(t, k, nchunks, n_ranges);
  return launched(op);
}

/* ---- LAMB on the LARS chunk table: the CPU backend's optim.c's two passes, the ratios folded in order ----------------- */

template <typename T> struct LambK {
  T *p, *m, *v;
  const T *g;
  T gs, b1, omb1, b2, omb2, bc1, bc2, eps, wd;
  double lr;
};

template <typename T> __global__ void k_lamb_norms(LarsTable t, LambK<T> k, int64_t nchunks, int n_ranges) {
  __shared__ double sp[kThreads], su[kThreads];
  const int tid = threadIdx.x;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {  // block-uniform
    int r;
    int64_t lo, hi;
    lars_chunk(t, n_ranges, c, &r, &lo, &hi);
    const T wd = t.excl[r] ? (T)0 : k.wd;  // excluded: no decay (and trust 1)
    double a = 0, b = 0;
    for (int64_t i = lo + tid; i < hi; i += kThreads) {
      const double x = k.p[i];
      const double u = Step<T>::lamb_moments(k.p[i], k.g[i], k.m + i, k.v + i, k.gs, k.b1, k.omb1, k.b2, k.omb2,
                                             k.bc1, k.bc2, k.eps, wd);
      a += x * x;
      b += u * u;
    }
    sp[tid] = a;
    su[tid] = b;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (tid < w) {
        sp[tid] += sp[tid + w];
        su[tid] += su[tid + w];
      }
      __syncthreads();
    }
    if (tid == 0) {
      t.part[2 * c] = sp[0];
      t.part[2 * c + 1] = su[0];
    }
    __syncthreads();
  }
}

/* the CPU backend's optim.c's ratio: |p| / |u|, 1 when excluded or either norm is 0 (or NaN). */
__global__ void k_lamb_trust(LarsTable t, int n_ranges) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n_ranges) return;
  double sp = 0, su = 0;
  for (int64_t c = t.pstart[r]; c < t.pstart[r + 1]; c++) sp += t.part[2 * c], su += t.part[2 * c + 1];
  const double pn = sqrt(sp), un = sqrt(su);
  t.trust[r] = t.excl[r] || !(pn > 0 && un > 0) ? 1.0 : pn / un;
}

template <typename T> __global__ void k_lamb_update(LarsTable t, LambK<T> k, int64_t nchunks, int n_ranges) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int r;
    int64_t lo, hi;
    lars_chunk(t, n_ranges, c, &r, &lo, &hi);
    const T neg = (T)(-__dmul_rn(k.lr, t.trust[r])), wd = t.excl[r] ? (T)0 : k.wd;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
      Step<T>::lamb_apply(k.p + i, k.m[i], k.v[i], neg, k.bc1, k.bc2, k.eps, wd);
  }
}

template <typename T>
dlua_status_t lamb(const char *op, const LarsTable &t, const dlua_opt_args_t *a, int64_t nchunks, int n_ranges,
                   cudaStream_t s) {
  LambK<T> k;
  k.p = (T *)a->p;
  k.m = (T *)a->s1;
  k.v = (T *)a->s2;
  k.g = (const T *)a->g;
  k.gs = (T)a->grad_scale;
  k.b1 = (T)a->beta1;
  k.omb1 = (T)(1.0 - a->beta1);
  k.b2 = (T)a->beta2;
  k.omb2 = (T)(1.0 - a->beta2);
  k.bc1 = (T)a->bc1;
  k.bc2 = (T)a->bc2;
  k.eps = (T)a->eps;
  k.wd = (T)a->weight_decay;
  k.lr = a->lr;
  const unsigned grid = grid_for(nchunks * kThreads);
  k_lamb_norms<T><<<grid, kThreads, 0, s>>>(t, k, nchunks, n_ranges);
  DLUA_TRY(launched(op));
  k_lamb_trust<<<(unsigned)((n_ranges + kThreads - 1) / kThreads), kThreads, 0, s>>>(t, n_ranges);
  DLUA_TRY(launched(op));
  k_lamb_update<T><<<grid, kThreads, 0, s>>>(t, k, nchunks, n_ranges);
  return launched(op);
}

/* ---- clip_grad_norm_'s partial norm: chunk c's sum of |x|^p (or max |x|) in a fixed tree, then one thread folds
   the chunks in order (the CPU backend's optim.c's blocks of the same size; the sums differ from the CPU's in the last
   bits only through the order inside a chunk). */

template <int DT, bool MAX>
__global__ void k_norm_chunks(const void *x_, int64_t n, double p, double *part, int64_t nchunks) {
  typedef typename Tr<DT>::S S;
  const S *x = (const S *)x_;
  __shared__ double acc[kThreads];
  const int tid = threadIdx.x;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t lo = c * kLarsChunk, hi = lo + kLarsChunk < n ? lo + kLarsChunk : n;
    double a = 0;
    for (int64_t i = lo + tid; i < hi; i += kThreads) {
      const double v = (double)Tr<DT>::ld(x[i]);
      a = MAX ? dlua_opt_norm_max(a, v) : a + dlua_opt_norm_term(v, p);
    }
    acc[tid] = a;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (tid < w) acc[tid] = MAX ? dlua_opt_norm_max(acc[tid], acc[tid + w]) : acc[tid] + acc[tid + w];
      __syncthreads();
    }
    if (tid == 0) part[c] = acc[0];
    __syncthreads();
  }
}

template <bool MAX> __global__ void k_norm_fold(const double *part, int64_t nchunks, double *out) {
  double a = 0;
  for (int64_t c = 0; c < nchunks; c++) a = MAX ? dlua_opt_norm_max(a, part[c]) : a + part[c];
  *out = a;
}

template <int DT> void norm_chunks(const void *x, int64_t n, double p, double *part, int64_t nchunks, cudaStream_t s) {
  const unsigned grid = grid_for(nchunks * kThreads);
  if (isinf(p))
    k_norm_chunks<DT, true><<<grid, kThreads, 0, s>>>(x, n, p, part, nchunks);
  else
    k_norm_chunks<DT, false><<<grid, kThreads, 0, s>>>(x, n, p, part, nchunks);
}

}  // namespace
}  // namespace dlua_cu

/* SGD (kind 0) and Adam/AdamW (kind 1): one grid-stride kernel over the range, which also writes the 16-bit copy
   when the descriptor brings one (float32 params; the front door checked it). */
static dlua_status_t cuda_step(const char *op, int kind, const dlua_optim_step_desc_t *d) {
  using namespace dlua_cu;
  const int64_t length = d->length;
  const int device = d->device, dtype = d->dtype;
  void *lp = d->lowp;
  if (lp && (dtype != DLUA_DTYPE_F32 || (d->lowp_dtype != DLUA_DTYPE_BF16 && d->lowp_dtype != DLUA_DTYPE_F16)))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: a 16-bit copy needs float32 params and a bfloat16 or float16 copy "
                    "(dtypes %d, %d)", op, dtype, d->lowp_dtype);
  if (length <= 0) return DLUA_OK;
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  const dlua_opt_args_t *a = &d->args;
  if (dtype == DLUA_DTYPE_F32) {
    if (!lp) return step<float, kNoLowp>(op, kind, a, length, NULL, s);
    if (d->lowp_dtype == DLUA_DTYPE_BF16) return step<float, DLUA_DTYPE_BF16>(op, kind, a, length, lp, s);
    return step<float, DLUA_DTYPE_F16>(op, kind, a, length, lp, s);
  }
  if (dtype == DLUA_DTYPE_F64) return step<double, kNoLowp>(op, kind, a, length, NULL, s);
  return DLUA_ERR(DLUA_ERR_ARG, "%s: param must be float32 or float64 (dtype %d)", op, dtype);
}

static dlua_status_t cuda_sgd_step(const char *op, const dlua_optim_step_desc_t *d) { return cuda_step(op, 0, d); }
static dlua_status_t cuda_adam_step(const char *op, const dlua_optim_step_desc_t *d) { return cuda_step(op, 1, d); }

/* x *= inv_scale over n elements (f32, f64, f16, bf16), *nonfinite = how many were Inf/NaN before (an integer
   count: the same whatever order blocks finish). Waits for the count. */
static dlua_status_t cuda_unscale(const char *op, const dlua_optim_grad_desc_t *d) {
  using namespace dlua_cu;
  const int dtype = d->dtype, device = d->device;
  void *x = d->x;
  const int64_t n = d->n;
  const double inv_scale = d->s;
  int64_t *nonfinite = d->nonfinite;
  if (nonfinite) *nonfinite = 0;
  if (n <= 0) return DLUA_OK;
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  void *mem = NULL;
  DLUA_TRY(dlua_cuda_malloc(&mem, device, sizeof(unsigned long long), NULL));
  unsigned long long *bad = (unsigned long long *)mem, host = 0;
  dlua_status_t st = DLUA_OK;
  cudaError_t e = cudaMemsetAsync(bad, 0, sizeof *bad, s);
  if (e == cudaSuccess) {
    switch (dtype) {
      case DLUA_DTYPE_F32: unscale<DLUA_DTYPE_F32>(x, n, inv_scale, bad, s); break;
      case DLUA_DTYPE_F64: unscale<DLUA_DTYPE_F64>(x, n, inv_scale, bad, s); break;
      case DLUA_DTYPE_F16: unscale<DLUA_DTYPE_F16>(x, n, inv_scale, bad, s); break;
      default: unscale<DLUA_DTYPE_BF16>(x, n, inv_scale, bad, s); break;
    }
    st = launched(op);
    if (st == DLUA_OK) e = cudaMemcpyAsync(&host, bad, sizeof host, cudaMemcpyDeviceToHost, s);
    if (st == DLUA_OK && e == cudaSuccess) e = cudaStreamSynchronize(s);
  }
  if (st == DLUA_OK && e != cudaSuccess) {
    cudaGetLastError();
    st = DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
  }
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  if (st == DLUA_OK && nonfinite) *nonfinite = (int64_t)host;
  return st;
}

/* The per-parameter chunk table of LARS and LAMB in one scratch block from the caching allocator (stream-ordered
   reuse: doubles first, then int64, then int32). *mem is NULL when there is nothing to step (no chunks). */
static dlua_status_t lars_table(const char *op, int n_ranges, const int64_t *offsets, const int64_t *lengths,
                                const int32_t *exclude, int device, cudaStream_t s, dlua_cu::LarsTable *t,
                                int64_t *nchunks_out, void **mem_out) {
  using namespace dlua_cu;
  *mem_out = NULL;
  int64_t nchunks = 0;
  for (int r = 0; r < n_ranges; r++) nchunks += (lengths[r] + kLarsChunk - 1) / kLarsChunk;
  *nchunks_out = nchunks;
  if (nchunks == 0) return DLUA_OK;
  const size_t n = (size_t)n_ranges;
  const size_t bytes = (2 * (size_t)nchunks + n) * sizeof(double) + (3 * n + 1) * sizeof(int64_t) + n * sizeof(int32_t);
  void *mem = NULL;
  DLUA_TRY(dlua_cuda_malloc(&mem, device, bytes, NULL));
  t->part = (double *)mem;
  t->trust = t->part + 2 * nchunks;
  t->off = (int64_t *)(t->trust + n);
  t->len = t->off + n;
  t->pstart = t->len + n;
  t->excl = (int32_t *)(t->pstart + n + 1);
  dlua_status_t st = DLUA_OK;
  int64_t start = 0;
  for (int first = 0; first < n_ranges && st == DLUA_OK; first += kLarsBatch) {
    LarsBatch b;
    memset(&b, 0, sizeof b);
    b.first = first;
    b.count = n_ranges - first < kLarsBatch ? n_ranges - first : kLarsBatch;
    for (int k = 0; k < b.count; k++) {
      const int r = first + k;
      b.off[k] = offsets[r];
      b.len[k] = lengths[r];
      b.pstart[k] = start;
      b.excl[k] = exclude && exclude[r] ? 1 : 0;
      start += (lengths[r] + kLarsChunk - 1) / kLarsChunk;
    }
    k_lars_table<<<1, kLarsBatch, 0, s>>>(*t, b, nchunks, n_ranges);
    st = launched(op);
  }
  if (st != DLUA_OK) {
    dlua_cuda_free(device, mem);
    return st;
  }
  *mem_out = mem;
  return DLUA_OK;
}

/* LARS: n_ranges parameters of the f32/f64 arena (device), host arrays offsets/lengths/exclude. Norms are summed
   per parameter in a fixed tree (no atomics), trust ratios computed on the device as the CPU does, then one fused
   update. */
static dlua_status_t cuda_lars_step(const char *op, const dlua_optim_ranges_desc_t *d) {
  using namespace dlua_cu;
  const int dtype = d->dtype, n_ranges = d->n_ranges, device = d->device;
  const int64_t *offsets = d->offsets, *lengths = d->lengths;
  const int32_t *exclude = d->exclude;
  const double trust_coefficient = d->trust_coefficient, eps = d->eps;
  if (n_ranges <= 0) return DLUA_OK;
  if (dtype != DLUA_DTYPE_F32 && dtype != DLUA_DTYPE_F64)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: param must be float32 or float64 (dtype %d)", op, dtype);
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  LarsTable t;
  int64_t nchunks;
  void *mem;
  DLUA_TRY(lars_table(op, n_ranges, offsets, lengths, exclude, device, s, &t, &nchunks, &mem));
  if (!mem) return DLUA_OK;
  const dlua_opt_args_t *a = &d->args;
  dlua_status_t st = dtype == DLUA_DTYPE_F64 ? lars<double>(op, t, a, nchunks, n_ranges, trust_coefficient, eps, s)
                                             : lars<float>(op, t, a, nchunks, n_ranges, trust_coefficient, eps, s);
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  return st;
}

/* LAMB on the same per-parameter chunk table: pass 1 updates the moments and sums |p|^2 and |u|^2 per chunk, the
   ratios |p| / |u| come from an in-order fold, pass 2 applies them. */
static dlua_status_t cuda_lamb_step(const char *op, const dlua_optim_ranges_desc_t *d) {
  using namespace dlua_cu;
  const int dtype = d->dtype, n_ranges = d->n_ranges, device = d->device;
  const int64_t *offsets = d->offsets, *lengths = d->lengths;
  const int32_t *exclude = d->exclude;
  if (n_ranges <= 0) return DLUA_OK;
  if (dtype != DLUA_DTYPE_F32 && dtype != DLUA_DTYPE_F64)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: param must be float32 or float64 (dtype %d)", op, dtype);
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  LarsTable t;
  int64_t nchunks;
  void *mem;
  DLUA_TRY(lars_table(op, n_ranges, offsets, lengths, exclude, device, s, &t, &nchunks, &mem));
  if (!mem) return DLUA_OK;
  const dlua_opt_args_t *a = &d->args;
  dlua_status_t st = dtype == DLUA_DTYPE_F64 ? lamb<double>(op, t, a, nchunks, n_ranges, s)
                                             : lamb<float>(op, t, a, nchunks, n_ranges, s);
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  return st;
}

/* x *= scale over n elements (f32, f64, f16, bf16), queued on the current stream (no wait). */
static dlua_status_t cuda_grad_scale(const char *op, const dlua_optim_grad_desc_t *d) {
  using namespace dlua_cu;
  const int dtype = d->dtype, device = d->device;
  void *x = d->x;
  const int64_t n = d->n;
  const double scale = d->s;
  if (n <= 0) return DLUA_OK;
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  switch (dtype) {
    case DLUA_DTYPE_F32: unscale<DLUA_DTYPE_F32>(x, n, scale, nullptr, s); break;
    case DLUA_DTYPE_F64: unscale<DLUA_DTYPE_F64>(x, n, scale, nullptr, s); break;
    case DLUA_DTYPE_F16: unscale<DLUA_DTYPE_F16>(x, n, scale, nullptr, s); break;
    default: unscale<DLUA_DTYPE_BF16>(x, n, scale, nullptr, s); break;
  }
  return launched(op);
}

/* *out = sum of |x|^p (or max |x| for p = inf) over n elements, in double, as the CPU kernel: fixed chunks folded
   in order, no atomics. Waits for the value. */
static dlua_status_t cuda_grad_norm_partial(const char *op, const dlua_optim_grad_desc_t *d) {
  using namespace dlua_cu;
  const int dtype = d->dtype, device = d->device;
  const void *x = d->x;
  const int64_t n = d->n;
  const double p = d->s;
  double *out = d->out;
  *out = 0;
  if (n <= 0) return DLUA_OK;
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  const int64_t nchunks = (n + kLarsChunk - 1) / kLarsChunk;
  void *mem = NULL;
  DLUA_TRY(dlua_cuda_malloc(&mem, device, (size_t)(nchunks + 1) * sizeof(double), NULL));
  double *part = (double *)mem, host = 0;
  switch (dtype) {
    case DLUA_DTYPE_F32: norm_chunks<DLUA_DTYPE_F32>(x, n, p, part, nchunks, s); break;
    case DLUA_DTYPE_F64: norm_chunks<DLUA_DTYPE_F64>(x, n, p, part, nchunks, s); break;
    case DLUA_DTYPE_F16: norm_chunks<DLUA_DTYPE_F16>(x, n, p, part, nchunks, s); break;
    default: norm_chunks<DLUA_DTYPE_BF16>(x, n, p, part, nchunks, s); break;
  }
  dlua_status_t st = launched(op);
  if (st == DLUA_OK) {
    if (isinf(p))
      k_norm_fold<true><<<1, 1, 0, s>>>(part, nchunks, part + nchunks);
    else
      k_norm_fold<false><<<1, 1, 0, s>>>(part, nchunks, part + nchunks);
    st = launched(op);
  }
  if (st == DLUA_OK) {
    cudaError_t e = cudaMemcpyAsync(&host, part + nchunks, sizeof host, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
      cudaGetLastError();
      st = DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
    }
  }
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  if (st == DLUA_OK) *out = host;
  return st;
}

extern "C" const struct dlua_optim_ops dlua_cuda_optim_ops = {
    cuda_sgd_step,          /* sgd_step */
    cuda_adam_step,         /* adam_step */
    cuda_lars_step,         /* lars_step */
    cuda_lamb_step,         /* lamb_step */
    cuda_unscale,           /* unscale */
    cuda_grad_scale,        /* grad_scale */
    cuda_grad_norm_partial, /* grad_norm_partial */
    NULL,                   /* compress_to_half: the CPU only */
    NULL,                   /* compress_from_half */
    NULL,                   /* compress_topk */
    NULL,                   /* compress_topk_unpack */
    NULL,                   /* compress_orthogonalize */
};

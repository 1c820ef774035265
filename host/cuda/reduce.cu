/* Deterministic CUDA reductions over the last axis of a contiguous (outer, n) view: sum, mean, max, min, argmax,
   argmin, any, all, prod, norm, var, std, count_nonfinite. Each output row is folded by a fixed group of threads in
   a fixed order and combined by a fixed tree, so a result depends on the shape only: no atomics. */
#include "cuda/ew_common.cuh"
#include "kernels/reduce.h" /* after ew_common.cuh: core/api.h is already in as C */

namespace dlua_cu {
namespace {

/* The kinds of the kernels (0..12), then the folds that norm, var and std are made of. */
enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_ARGMAX, R_ARGMIN, R_ANY, R_ALL, R_PROD, R_NORM, R_VAR, R_STD, R_NONFINITE,
       R_NORM0, R_NORM1, R_NORM2, R_NORMP, R_NORMINF, R_SQDEV };

/* A running value: v for float inputs (double, as the CPU folds), iv for integers and flags; idx is the
   position of a max/min (-1: nothing folded yet). */
struct Acc {
  double v;
  int64_t iv;
  int64_t idx;
};

template <int K> __device__ __forceinline__ Acc identity() {
  Acc a;
  a.v = K == R_PROD ? 1 : 0;
  a.iv = K == R_ALL || K == R_PROD ? 1 : 0;
  a.idx = -1;
  return a;
}

/* Whether b should replace a in a max (MAXK) or min: NaN beats everything, then the larger (smaller) value,
   then the lower position. That is the CPU's sequential rule (first NaN, else first extreme) in a form that
   does not depend on the order partial results meet. */
template <bool MAXK, bool FL> __device__ __forceinline__ bool better(const Acc &b, const Acc &a) {
  if (b.idx < 0) return false;
  if (a.idx < 0) return true;
  if (FL) {
    const bool an = a.v != a.v, bn = b.v != b.v;
    if (an || bn) return an && bn ? b.idx < a.idx : bn;
    if (b.v != a.v) return MAXK ? b.v > a.v : b.v < a.v;
  } else {
    if (b.iv != a.iv) return MAXK ? b.iv > a.iv : b.iv < a.iv;
  }
  return b.idx < a.idx;
}

/* Whether fold K sums its per-element terms (in double for float inputs, as the CPU). */
template <int K> struct Sums {
  static const bool value = K == R_SUM || K == R_MEAN || K == R_NORM0 || K == R_NORM1 || K == R_NORM2 ||
                            K == R_NORMP || K == R_SQDEV;
};

template <int K, bool FL> __device__ __forceinline__ void combine(Acc &a, const Acc &b) {
  if (Sums<K>::value) {
    if (FL) a.v += b.v;
    else a.iv = (int64_t)((uint64_t)a.iv + (uint64_t)b.iv);
  } else if (K == R_PROD) {
    if (FL) a.v *= b.v;
    else a.iv = (int64_t)((uint64_t)a.iv * (uint64_t)b.iv);
  } else if (K == R_NONFINITE) {
    a.iv += b.iv;
  } else if (K == R_NORMINF) {
    a.v = dlua_red_absmax_d(a.v, b.v);  // NaN sticks, in any order
  } else if (K == R_ANY) {
    a.iv = a.iv | b.iv;
  } else if (K == R_ALL) {
    a.iv = a.iv & b.iv;
  } else {
    const bool mx = K == R_MAX || K == R_ARGMAX;
    if (mx ? better<true, FL>(b, a) : better<false, FL>(b, a)) a = b;
  }
}

/* One element x (compute type C) at position r; p: a norm's order; mu: the row's mean (squared deviations).
   The per-element terms are the CPU's (the CPU backend's reduce.c, its STEP_ macros). */
template <int K, bool FL, typename C> __device__ __forceinline__ void fold(Acc &a, C x, int64_t r, double p, double mu) {
  Acc b;
  b.idx = r;
  if (FL) {
    const double d = (double)x;
    b.v = d;
    b.iv = x != (C)0;
    if (K == R_NORM0) b.v = d != 0 ? 1.0 : 0.0;  // NaN counts: it is not zero
    if (K == R_NORM1 || K == R_NORMINF) b.v = fabs(d);
    if (K == R_NORM2) b.v = d * d;
    if (K == R_NORMP) b.v = pow(fabs(d), p);
    if (K == R_SQDEV) b.v = (d - mu) * (d - mu);
    if (K == R_NONFINITE) b.iv = !isfinite(d);
  } else {
    b.v = 0;
    b.iv = K == R_NONFINITE ? 0 : (int64_t)x;  // integers are always finite
  }
  if (K == R_ANY || K == R_ALL) b.iv = x != (C)0;
  combine<K, FL>(a, b);
}

/* Rows of G threads; each thread folds positions t, t + G, ... of its row's [lo, hi), then a tree in shared
   memory. Pass 1 reads the input (DT); pass 2 (PARTIAL) reads Acc partials written by pass 1. */
constexpr int kBlock = 256;

template <int K, bool FL>
__device__ __forceinline__ Acc tree(Acc mine, int G) {
  __shared__ Acc sh[kBlock];
  const int t = threadIdx.x;
  sh[t] = mine;
  __syncthreads();
  const int lane = t % G, row0 = t - lane;
  for (int w = G / 2; w > 0; w /= 2) {
    if (lane < w) {
      Acc a = sh[row0 + lane];
      combine<K, FL>(a, sh[row0 + lane + w]);
      sh[row0 + lane] = a;
    }
    __syncthreads();
  }
  return sh[row0];
}

/* x: (outer, n) of DT; out: (outer, nchunks) Acc when chunk < n, else the final results (see finish).
   mean (may be NULL): each row's sum, for the squared deviations from sum / n. */
template <int DT, int K>
__global__ void k_pass1(const void *x_, Acc *part, int64_t outer, int64_t n, int64_t chunk, int64_t nchunks, int G,
                        double p, const Acc *mean) {
  typedef typename Tr<DT>::S S;
  constexpr bool FL = std::is_floating_point<typename Tr<DT>::C>::value;
  const S *x = (const S *)x_;
  const int rows_per_block = kBlock / G;
  const int lane = threadIdx.x % G;
  const int64_t work = outer * nchunks;
  // Every thread of the block runs the same number of iterations (tree() synchronises the block).
  for (int64_t base = (int64_t)blockIdx.x * rows_per_block; base < work; base += (int64_t)gridDim.x * rows_per_block) {
    const int64_t w = base + threadIdx.x / G;
    Acc a = identity<K>();
    if (w < work) {
      const int64_t o = w / nchunks, c = w % nchunks;
      const int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
      const S *row = x + o * n;
      const double mu = mean ? mean[o].v / (double)n : 0.0;
      for (int64_t r = lo + lane; r < hi; r += G) fold<K, FL>(a, Tr<DT>::ld(row[r]), r, p, mu);
    }
    Acc res = tree<K, FL>(a, G);
    if (w < work && lane == 0) part[w] = res;
    __syncthreads();  // sh is reused by the next iteration
  }
}

/* Combines each row's nchunks partials (in a fixed tree) into one. */
template <int K, bool FL> __global__ void k_pass2(const Acc *part, Acc *res, int64_t outer, int64_t nchunks, int G) {
  const int rows_per_block = kBlock / G;
  const int lane = threadIdx.x % G;
  for (int64_t base = (int64_t)blockIdx.x * rows_per_block; base < outer; base += (int64_t)gridDim.x * rows_per_block) {
    const int64_t o = base + threadIdx.x / G;
    Acc a = identity<K>();
    if (o < outer)
      for (int64_t c = lane; c < nchunks; c += G) combine<K, FL>(a, part[o * nchunks + c]);
    Acc r = tree<K, FL>(a, G);
    if (o < outer && lane == 0) res[o] = r;
    __syncthreads();
  }
}

/* Final values into the output dtype, as the CPU's entry point ends (mean, norm's root, var's division) and
   store_values / deliver. p: the norm's order or var's correction. */
template <int ODT, bool FL> __global__ void k_finish(const Acc *res, void *y_, int64_t *idx, int64_t outer, int64_t n,
                                                      int kind, int64_t base, double p) {
  typedef typename Tr<ODT>::S S;
  S *y = (S *)y_;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < outer; o += stride) {
    const Acc a = res[o];
    if (idx) idx[o] = a.idx + base;
    if (!y) continue;
    if (kind == R_ANY || kind == R_ALL) {
      y[o] = (S)(a.iv != 0);
    } else if (FL && kind != R_NONFINITE) {
      double v = a.v;
      if (kind == R_MEAN) v = v / (double)n;  // 0 / 0: NaN for an empty mean
      if (kind == R_NORM && p == 2) v = sqrt(v);
      if (kind == R_NORM && p != 0 && p != 1 && p != 2 && !isinf(p)) v = pow(v, 1.0 / p);
      if (kind == R_VAR || kind == R_STD) {
        const double denom = (double)n - p;
        v = v / (denom < 0 ? 0.0 : denom);
        if (kind == R_STD) v = sqrt(v);
      }
      if constexpr (std::is_same<typename Tr<ODT>::C, int64_t>::value) y[o] = Tr<ODT>::st((int64_t)v);
      else y[o] = Tr<ODT>::st((typename Tr<ODT>::C)v);
    } else {
      if constexpr (std::is_same<typename Tr<ODT>::C, int64_t>::value) y[o] = Tr<ODT>::st(a.iv);
      else y[o] = Tr<ODT>::st((typename Tr<ODT>::C)a.iv);
    }
  }
}

template <int ODT> dlua_status_t finish(const char *op, bool fl, const Acc *res, void *y, int64_t *idx, int64_t outer,
                                        int64_t n, int kind, int64_t base, double p, cudaStream_t s) {
  if (fl) k_finish<ODT, true><<<grid_for(outer), kThreads, 0, s>>>(res, y, idx, outer, n, kind, base, p);
  else k_finish<ODT, false><<<grid_for(outer), kThreads, 0, s>>>(res, y, idx, outer, n, kind, base, p);
  return launched(op);
}

template <int K, bool FL> void pass2(const Acc *part, Acc *res, int64_t outer, int64_t nchunks, int G, cudaStream_t s) {
  k_pass2<K, FL><<<grid_for(outer * G), kBlock, 0, s>>>(part, res, outer, nchunks, G);
}

/* The arguments of one fold. */
struct Fold {
  const void *x;
  Acc *part, *res;
  int64_t outer, n, chunk, nchunks;
  int G;
  double p;
  const Acc *mean;
};

template <int DT, int K> dlua_status_t run(const char *op, const Fold &f, cudaStream_t s) {
  constexpr bool FL = std::is_floating_point<typename Tr<DT>::C>::value;
  const int64_t outer = f.outer, nchunks = f.nchunks, work = outer * nchunks;
  Acc *part = f.part, *res = f.res;
  const int G = f.G;
  k_pass1<DT, K><<<grid_for(work * G), kBlock, 0, s>>>(f.x, nchunks > 1 ? part : res, outer, f.n, f.chunk, nchunks,
                                                       G, f.p, f.mean);
  DLUA_TRY(launched(op));
  if (nchunks > 1) {
    pass2<K, FL>(part, res, outer, nchunks, nchunks >= 256 ? 256 : 32, s);
    DLUA_TRY(launched(op));
  }
  return DLUA_OK;
}

/* One fold K (an internal fold: norms and squared deviations are only instantiated for float inputs). */
template <int DT> dlua_status_t by_kind(const char *op, int kind, const Fold &f, cudaStream_t s) {
  switch (kind) {
    case R_SUM: return run<DT, R_SUM>(op, f, s);
    case R_MEAN: return run<DT, R_MEAN>(op, f, s);
    case R_MAX: return run<DT, R_MAX>(op, f, s);
    case R_MIN: return run<DT, R_MIN>(op, f, s);
    case R_ARGMAX: return run<DT, R_ARGMAX>(op, f, s);
    case R_ARGMIN: return run<DT, R_ARGMIN>(op, f, s);
    case R_ANY: return run<DT, R_ANY>(op, f, s);
    case R_ALL: return run<DT, R_ALL>(op, f, s);
    case R_PROD: return run<DT, R_PROD>(op, f, s);
    case R_NONFINITE: return run<DT, R_NONFINITE>(op, f, s);
    default: break;
  }
  if constexpr (std::is_floating_point<typename Tr<DT>::C>::value) {
    switch (kind) {
      case R_NORM0: return run<DT, R_NORM0>(op, f, s);
      case R_NORM1: return run<DT, R_NORM1>(op, f, s);
      case R_NORM2: return run<DT, R_NORM2>(op, f, s);
      case R_NORMP: return run<DT, R_NORMP>(op, f, s);
      case R_NORMINF: return run<DT, R_NORMINF>(op, f, s);
      case R_SQDEV: return run<DT, R_SQDEV>(op, f, s);
      default: break;
    }
  }
  return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CUDA reduction %d for dtype %d", op, kind, DT);
}

dlua_status_t fold_all(const char *op, int kind, int dt, const Fold &f, cudaStream_t s) {
#define RCASE(DT) \
  case DLUA_DTYPE_##DT: return by_kind<DLUA_DTYPE_##DT>(op, kind, f, s);
  switch (dt) {
    RCASE(F32) RCASE(F64) RCASE(F16) RCASE(BF16) RCASE(I32) RCASE(I64) RCASE(U8) RCASE(BOOL)
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: invalid dtype %d", op, dt);
  }
}

dlua_status_t finish_all(const char *op, int odt, bool fl, const Acc *res, void *y, int64_t *idx, int64_t outer,
                         int64_t n, int kind, int64_t base, double p, cudaStream_t s) {
#define FCASE(DT) \
  case DLUA_DTYPE_##DT: return finish<DLUA_DTYPE_##DT>(op, fl, res, y, idx, outer, n, kind, base, p, s);
  switch (odt) {
    FCASE(F32) FCASE(F64) FCASE(F16) FCASE(BF16) FCASE(I32) FCASE(I64) FCASE(U8) FCASE(BOOL)
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: invalid output dtype %d", op, odt);
  }
}

}  // namespace
}  // namespace dlua_cu

namespace {

/* Reductions of a contiguous (outer, n) x of `dtype` along n: y (outer) of out_dtype (NULL for argmax/argmin),
   idx (outer) int64 positions + index_base (max/min/argmax/argmin; may be NULL). Float inputs fold in double, as
   the CPU does. Deterministic: a fixed tree per shape, no atomics. */
dlua_status_t reduce_rows(const char *op, int kind, int dtype, int out_dtype, const void *x, void *y, int64_t *idx,
                          int64_t outer, int64_t n, int64_t index_base, double p, int device) {
  using namespace dlua_cu;
  if (outer <= 0) return DLUA_OK;
  if (n < 0 || kind < R_SUM || kind > R_NONFINITE) return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: malformed CUDA reduction", op);
  // Long rows are cut into fixed chunks folded in parallel, then combined: both fixed by the shape.
  const int64_t chunk = outer >= 1024 || n <= 65536 ? (n > 0 ? n : 1) : 32768;
  const int64_t nchunks = n > 0 ? (n + chunk - 1) / chunk : 1;
  const int G = chunk >= 4096 ? kBlock : 32;
  const bool fl = dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_F64 || dtype == DLUA_DTYPE_F16 || dtype == DLUA_DTYPE_BF16;
  // The fold behind the kind: a norm's depends on its order; var/std fold the squared deviations from a sum.
  int fk = kind;
  if (kind == R_NORM) fk = p == 0 ? R_NORM0 : p == 1 ? R_NORM1 : p == 2 ? R_NORM2 : isinf(p) ? R_NORMINF : R_NORMP;
  const bool two_pass = kind == R_VAR || kind == R_STD;
  if (two_pass) fk = R_SQDEV;

  int prev = 0;
  cudaError_t err = cudaGetDevice(&prev);
  if (err == cudaSuccess && prev != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s (CUDA error %d)", op, device, cudaGetErrorString(err),
                    (int)err);
  }
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  // Scratch from the caching allocator on the current stream: freed blocks are reused only in stream order.
  void *scratch = NULL;
  const int64_t nres = two_pass ? 2 * outer : outer;
  size_t bytes = (size_t)(nres + (nchunks > 1 ? outer * nchunks : 0)) * sizeof(Acc);
  dlua_status_t st = dlua_cuda_malloc(&scratch, device, bytes, NULL);
  if (st == DLUA_OK) {
    Acc *res = (Acc *)scratch, *sums = two_pass ? res + outer : NULL, *part = nchunks > 1 ? res + nres : NULL;
    Fold f = {x, part, res, outer, n, chunk, nchunks, G, p, NULL};
    if (two_pass) {  // the sums first, for the means: two passes rather than sums of squares (no cancellation)
      Fold f1 = f;
      f1.res = sums;
      st = fold_all(op, R_SUM, dtype, f1, s);
      f.mean = sums;
    }
    if (st == DLUA_OK) st = fold_all(op, fk, dtype, f, s);
    if (st == DLUA_OK) st = finish_all(op, out_dtype, fl, res, y, idx, outer, n, kind, index_base, p, s);
    if (dlua_cuda_free(device, scratch) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  }
  if (prev != device) cudaSetDevice(prev);
  return st;
}

/* The kinds above from dlua_reduce_op_t. */
int kind_of(int op) {
  switch (op) {
    case DLUA_REDUCE_SUM: return dlua_cu::R_SUM;
    case DLUA_REDUCE_MEAN: return dlua_cu::R_MEAN;
    case DLUA_REDUCE_MAX: return dlua_cu::R_MAX;
    case DLUA_REDUCE_MIN: return dlua_cu::R_MIN;
    case DLUA_REDUCE_ARGMAX: return dlua_cu::R_ARGMAX;
    case DLUA_REDUCE_ARGMIN: return dlua_cu::R_ARGMIN;
    case DLUA_REDUCE_ANY: return dlua_cu::R_ANY;
    case DLUA_REDUCE_ALL: return dlua_cu::R_ALL;
    case DLUA_REDUCE_PROD: return dlua_cu::R_PROD;
    case DLUA_REDUCE_NORM: return dlua_cu::R_NORM;
    case DLUA_REDUCE_VAR: return dlua_cu::R_VAR;
    case DLUA_REDUCE_STD: return dlua_cu::R_STD;
    case DLUA_REDUCE_COUNT_NONFINITE: return dlua_cu::R_NONFINITE;
    default: return -1;
  }
}

/* The reduce_rows slot: r->x is the contiguous (outer, n) rows. */
dlua_status_t cuda_reduce_rows(const char *op, const dlua_reduce_desc_t *r) {
  return reduce_rows(op, kind_of(r->kind), r->dtype, r->out_dtype, r->x, r->y, r->idx, r->outer, r->n, r->index_base,
                     r->p, r->device);
}

}  // namespace

extern "C" const struct dlua_reduce_ops dlua_cuda_reduce_ops = {
    NULL,             /* reduce: strided inputs are staged as contiguous rows by the front door */
    cuda_reduce_rows, /* reduce_rows */
};

/* Binary element-wise CUDA kernels (DLUA_EW_BINARY_OPS: arithmetic, comparisons, logic, lerp), tensor-tensor
   with broadcasting and tensor-scalar in either order. */
#include "cuda/ew_common.cuh"

namespace dlua_cu {
namespace {

#define BF_FDI(ENUM, name)                                                                               \
  struct B_##ENUM {                                                                                      \
    __device__ __forceinline__ auto operator()(float x, float a, float b) const { return dlua_ew_##name##_f(x, a, b); } \
    __device__ __forceinline__ auto operator()(double x, double a, double b) const { return dlua_ew_##name##_d(x, a, b); } \
    __device__ __forceinline__ auto operator()(int64_t x, int64_t a, int64_t b) const { return dlua_ew_##name##_i(x, a, b); } \
  };
#define BF_FD(ENUM, name)                                                                                \
  struct B_##ENUM {                                                                                      \
    __device__ __forceinline__ auto operator()(float x, float a, float b) const { return dlua_ew_##name##_f(x, a, b); } \
    __device__ __forceinline__ auto operator()(double x, double a, double b) const { return dlua_ew_##name##_d(x, a, b); } \
  };
#define BF_ARITH(ENUM, name) BF_FDI(ENUM, name)
#define BF_PRED(ENUM, name) BF_FDI(ENUM, name)
#define BF_FLOAT(ENUM, name) BF_FD(ENUM, name)
#define BF(ENUM, name, kind) BF_##kind(ENUM, name)
DLUA_EW_BINARY_OPS(BF)

#define BENUM(ENUM, name, kind) BOP_##ENUM,
enum { DLUA_EW_BINARY_OPS(BENUM) BOP_COUNT };

template <int DT, bool PRED, typename R> __device__ __forceinline__ auto store(R r) {
  if constexpr (PRED) return (uint8_t)r;
  else return Tr<DT>::st(r);
}

/* One element: mode 0 f(a, b), 1 f(a, s), 2 f(s, a); alpha is the body's third argument. */
template <typename F, typename C>
__device__ __forceinline__ auto apply(F f, int mode, C a, C b, C s, C al) {
  return mode == 0 ? f(a, b, al) : (mode == 1 ? f(a, s, al) : f(s, a, al));
}

/* Contiguous operands; b is read only in mode 0. */
template <typename F, int DT, bool PRED>
__global__ void k_contig(void *y_, const void *a_, const void *b_, int64_t n, int mode, typename Tr<DT>::C s,
                         typename Tr<DT>::C al, int vec) {
  typedef typename Tr<DT>::S S;
  typedef typename std::conditional<PRED, uint8_t, S>::type O;
  O *y = (O *)y_;
  const S *a = (const S *)a_, *b = (const S *)b_;
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (VecOk<DT>::value) {
    if (vec) {
      constexpr int V = 16 / sizeof(S);
      const int64_t nv = n / V;
      for (int64_t g = tid; g < nv; g += stride) {
        Vec<S, V> va = reinterpret_cast<const Vec<S, V> *>(a)[g], vb;
        if (mode == 0) vb = reinterpret_cast<const Vec<S, V> *>(b)[g];
        Vec<O, V> out;
#pragma unroll
        for (int j = 0; j < V; j++) {
          const auto bj = mode == 0 ? Tr<DT>::ld(vb.v[j]) : s;
          out.v[j] = store<DT, PRED>(apply(f, mode, Tr<DT>::ld(va.v[j]), bj, s, al));
        }
        reinterpret_cast<Vec<O, V> *>(y)[g] = out;
      }
      done = nv * V;
    }
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const auto bi = mode == 0 ? Tr<DT>::ld(b[i]) : s;
    y[i] = store<DT, PRED>(apply(f, mode, Tr<DT>::ld(a[i]), bi, s, al));
  }
}

template <typename F, int DT, bool PRED>
__global__ void k_strided(Ix ix, int64_t n, int mode, typename Tr<DT>::C s, typename Tr<DT>::C al) {
  typedef typename Tr<DT>::S S;
  typedef typename std::conditional<PRED, uint8_t, S>::type O;
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (mode == 0) {
      char *p[3];
      locate<3>(ix, i, p);
      *(O *)p[0] = store<DT, PRED>(f(Tr<DT>::ld(*(const S *)p[1]), Tr<DT>::ld(*(const S *)p[2]), al));
    } else {
      char *p[2];
      locate<2>(ix, i, p);
      *(O *)p[0] = store<DT, PRED>(apply(f, mode, Tr<DT>::ld(*(const S *)p[1]), s, s, al));
    }
  }
}

template <typename F, int DT, bool PRED> dlua_status_t launch(const char *op, const Ew &e, cudaStream_t s) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C C;
  const C al = param<C>(e, 0), sc = param<C>(e, 1);
  const int nin = e.mode == 0 ? 3 : 2;
  const int es[3] = {PRED ? 1 : (int)sizeof(S), (int)sizeof(S), (int)sizeof(S)};
  if (contiguous(e, nin, es)) {
    const int V = 16 / (int)sizeof(S);
    const int vec = VecOk<DT>::value && e.numel >= V && aligned(e.base[1], 16) &&
                    (e.mode != 0 || aligned(e.base[2], 16)) && aligned(e.base[0], (size_t)V * es[0]);
    k_contig<F, DT, PRED><<<grid_for(vec ? e.numel / V : e.numel), kThreads, 0, s>>>(
        e.base[0], e.base[1], e.mode == 0 ? e.base[2] : e.base[1], e.numel, e.mode, sc, al, vec);
  } else {
    k_strided<F, DT, PRED><<<grid_for(e.numel), kThreads, 0, s>>>(make_ix(e), e.numel, e.mode, sc, al);
  }
  return launched(op);
}

template <typename F, bool PRED> struct Launch {
  template <int DT> static dlua_status_t run(const char *op, const Ew &e, cudaStream_t s) { return launch<F, DT, PRED>(op, e, s); }
};


}  // namespace

dlua_status_t run_binary(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.op) {
#define BCASE_ARITH(ENUM) return dispatch_dtype<Launch<B_##ENUM, false>, false>(op, e, s);
#define BCASE_PRED(ENUM) return dispatch_dtype<Launch<B_##ENUM, true>, false>(op, e, s);
#define BCASE_FLOAT(ENUM) return dispatch_dtype<Launch<B_##ENUM, false>, true>(op, e, s);
#define BCASE(ENUM, name, kind) \
  case BOP_##ENUM: BCASE_##kind(ENUM)
    DLUA_EW_BINARY_OPS(BCASE)
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: unknown CUDA binary op %d", op, e.op);
  }
}

}  // namespace dlua_cu

/* Unary element-wise CUDA kernels (every op of DLUA_EW_UNARY_OPS, every dtype the CPU has a loop for). */
#include "cuda/ew_common.cuh"

namespace dlua_cu {
namespace {

// One functor per op, overloaded on the compute type, so each kernel inlines the shared body.
#define UF_FDI(ENUM, name)                                                                               \
  struct U_##ENUM {                                                                                      \
    __device__ __forceinline__ auto operator()(float x, float a, float b) const { return dlua_ew_##name##_f(x, a, b); } \
    __device__ __forceinline__ auto operator()(double x, double a, double b) const { return dlua_ew_##name##_d(x, a, b); } \
    __device__ __forceinline__ auto operator()(int64_t x, int64_t a, int64_t b) const { return dlua_ew_##name##_i(x, a, b); } \
  };
#define UF_FD(ENUM, name)                                                                                \
  struct U_##ENUM {                                                                                      \
    __device__ __forceinline__ auto operator()(float x, float a, float b) const { return dlua_ew_##name##_f(x, a, b); } \
    __device__ __forceinline__ auto operator()(double x, double a, double b) const { return dlua_ew_##name##_d(x, a, b); } \
  };
#define UF_ARITH(ENUM, name) UF_FDI(ENUM, name)
#define UF_PRED(ENUM, name) UF_FDI(ENUM, name)
#define UF_FLOAT(ENUM, name) UF_FD(ENUM, name)
#define UF(ENUM, name, kind) UF_##kind(ENUM, name)
DLUA_EW_UNARY_OPS(UF)

#define UENUM(ENUM, name, kind) UOP_##ENUM,
enum { DLUA_EW_UNARY_OPS(UENUM) UOP_COUNT };

template <int DT, bool PRED, typename R> __device__ __forceinline__ auto store(R r) {
  if constexpr (PRED) return (uint8_t)r;
  else return Tr<DT>::st(r);
}

template <typename F, int DT, bool PRED>
__global__ void k_contig(void *y_, const void *x_, int64_t n, typename Tr<DT>::C p1, typename Tr<DT>::C p2, int vec) {
  typedef typename Tr<DT>::S S;
  typedef typename std::conditional<PRED, uint8_t, S>::type O;
  O *y = (O *)y_;
  const S *x = (const S *)x_;
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (VecOk<DT>::value) {
    if (vec) {
      constexpr int V = 16 / sizeof(S);
      const int64_t nv = n / V;
      for (int64_t g = tid; g < nv; g += stride) {
        Vec<S, V> in = reinterpret_cast<const Vec<S, V> *>(x)[g];
        Vec<O, V> out;
#pragma unroll
        for (int j = 0; j < V; j++) out.v[j] = store<DT, PRED>(f(Tr<DT>::ld(in.v[j]), p1, p2));
        reinterpret_cast<Vec<O, V> *>(y)[g] = out;
      }
      done = nv * V;
    }
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = store<DT, PRED>(f(Tr<DT>::ld(x[i]), p1, p2));  // tail
}

template <typename F, int DT, bool PRED>
__global__ void k_strided(Ix ix, int64_t n, typename Tr<DT>::C p1, typename Tr<DT>::C p2) {
  typedef typename Tr<DT>::S S;
  typedef typename std::conditional<PRED, uint8_t, S>::type O;
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    char *p[2];
    locate<2>(ix, i, p);
    *(O *)p[0] = store<DT, PRED>(f(Tr<DT>::ld(*(const S *)p[1]), p1, p2));
  }
}

template <typename F, int DT, bool PRED> dlua_status_t launch(const char *op, const Ew &e, cudaStream_t s) {
  typedef typename Tr<DT>::S S;
  typedef typename Tr<DT>::C C;
  const C p1 = param<C>(e, 0), p2 = param<C>(e, 1);
  const int es[2] = {PRED ? 1 : (int)sizeof(S), (int)sizeof(S)};
  if (contiguous(e, 2, es)) {
    const int V = 16 / (int)sizeof(S);
    const int vec = VecOk<DT>::value && e.numel >= V && aligned(e.base[1], 16) && aligned(e.base[0], (size_t)V * es[0]);
    k_contig<F, DT, PRED><<<grid_for(vec ? e.numel / V : e.numel), kThreads, 0, s>>>(e.base[0], e.base[1], e.numel, p1,
                                                                                        p2, vec);
  } else {
    k_strided<F, DT, PRED><<<grid_for(e.numel), kThreads, 0, s>>>(make_ix(e), e.numel, p1, p2);
  }
  return launched(op);
}

template <typename F, bool PRED> struct Launch {
  template <int DT> static dlua_status_t run(const char *op, const Ew &e, cudaStream_t s) { return launch<F, DT, PRED>(op, e, s); }
};


}  // namespace

dlua_status_t run_unary(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.op) {
#define UCASE_ARITH(ENUM) return dispatch_dtype<Launch<U_##ENUM, false>, false>(op, e, s);
#define UCASE_PRED(ENUM) return dispatch_dtype<Launch<U_##ENUM, true>, false>(op, e, s);
#define UCASE_FLOAT(ENUM) return dispatch_dtype<Launch<U_##ENUM, false>, true>(op, e, s);
#define UCASE(ENUM, name, kind) \
  case UOP_##ENUM: UCASE_##kind(ENUM)
    DLUA_EW_UNARY_OPS(UCASE)
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: unknown CUDA unary op %d", op, e.op);
  }
}

}  // namespace dlua_cu

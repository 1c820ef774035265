/* Force-included (-include) into every .cu file of the backend when it is built for the CUDA emulator
   (DLUA_CUDA=EMU): CUDA's device-side language on the host. Kernels are plain C++ functions; a launch (which
   tools/cuemu/rewrite.c turns into ::cuemu::launch) queues one call per thread on the stream, and the runtime
   (runtime.cc) runs each block's threads as fibers so that __syncthreads and warp shuffles wait for the others.
   __shared__ variables are static (blocks run one at a time), poisoned before each block. */
#ifndef DLUA_CUEMU_KERNEL_H
#define DLUA_CUEMU_KERNEL_H
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
/* Every __shared__ variable lands in one section, which the runtime fills with 0xff bytes (NaN, -1) before each
   block: a kernel that reads shared memory it has not written sees garbage, as on a GPU, not the last block's. */
#define __shared__ static __attribute__((section("cuemu_shared")))
#define __constant__ static
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)

extern "C" {
extern uint3 cuemu_threadIdx, cuemu_blockIdx;
extern dim3 cuemu_blockDim, cuemu_gridDim;
void cuemu_syncthreads(void);
}
#define threadIdx cuemu_threadIdx
#define blockIdx cuemu_blockIdx
#define blockDim cuemu_blockDim
#define gridDim cuemu_gridDim
constexpr int warpSize = 32;

namespace cuemu {

/* Warp operations: every live lane of the warp deposits (value, argument) and waits; the last to arrive
   computes each lane's result. */
enum WarpOp { W_SYNC, W_SHFL, W_SHFL_DOWN, W_SHFL_UP, W_SHFL_XOR, W_BALLOT, W_ANY, W_ALL, W_RMAX_U, W_RMIN_U,
              W_RADD_U, W_RMAX_I, W_RMIN_I };
uint64_t warp_op(int op, unsigned mask, uint64_t value, int arg, int width);

template <typename T> inline uint64_t bits(T v) {
  static_assert(sizeof(T) <= 8, "warp value larger than 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof v);
  return b;
}
template <typename T> inline T unbits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof v);
  return v;
}

struct Cfg {
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
  Cfg(dim3 g, dim3 b, size_t sh = 0, cudaStream_t s = 0) : grid(g), block(b), shmem(sh), stream(s) {}
};

/* Queues body() to run once per thread of the grid; checks the configuration as the runtime does. */
void launch_raw(const Cfg &c, const char *name, std::function<void()> body);

template <typename... P, typename... A> void launch(const Cfg &c, const char *name, void (*k)(P...), A &&...a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
  launch_raw(c, name, [k, args]() { std::apply(k, args); });
}

}  // namespace cuemu

inline void __syncthreads() { cuemu_syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::warp_op(cuemu::W_SYNC, mask, 0, 0, 32); }
template <typename T> inline T __shfl_sync(unsigned m, T v, int lane, int w = 32) {
  return cuemu::unbits<T>(cuemu::warp_op(cuemu::W_SHFL, m, cuemu::bits(v), lane, w));
}
template <typename T> inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
  return cuemu::unbits<T>(cuemu::warp_op(cuemu::W_SHFL_DOWN, m, cuemu::bits(v), (int)d, w));
}
template <typename T> inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
  return cuemu::unbits<T>(cuemu::warp_op(cuemu::W_SHFL_UP, m, cuemu::bits(v), (int)d, w));
}
template <typename T> inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) {
  return cuemu::unbits<T>(cuemu::warp_op(cuemu::W_SHFL_XOR, m, cuemu::bits(v), x, w));
}
inline unsigned __ballot_sync(unsigned m, int p) { return (unsigned)cuemu::warp_op(cuemu::W_BALLOT, m, p != 0, 0, 32); }
inline int __any_sync(unsigned m, int p) { return (int)cuemu::warp_op(cuemu::W_ANY, m, p != 0, 0, 32); }
inline int __all_sync(unsigned m, int p) { return (int)cuemu::warp_op(cuemu::W_ALL, m, p != 0, 0, 32); }
inline unsigned __reduce_max_sync(unsigned m, unsigned v) { return (unsigned)cuemu::warp_op(cuemu::W_RMAX_U, m, v, 0, 32); }
inline unsigned __reduce_min_sync(unsigned m, unsigned v) { return (unsigned)cuemu::warp_op(cuemu::W_RMIN_U, m, v, 0, 32); }
inline unsigned __reduce_add_sync(unsigned m, unsigned v) { return (unsigned)cuemu::warp_op(cuemu::W_RADD_U, m, v, 0, 32); }
inline int __reduce_max_sync(unsigned m, int v) { return (int)cuemu::warp_op(cuemu::W_RMAX_I, m, (uint64_t)(int64_t)v, 0, 32); }
inline int __reduce_min_sync(unsigned m, int v) { return (int)cuemu::warp_op(cuemu::W_RMIN_I, m, (uint64_t)(int64_t)v, 0, 32); }

/* Atomics: the threads of a grid run one at a time and never between the read and the write. */
template <typename T> inline T __cuemu_atomic_rmw(T *p, T v, int kind) {
  T old = *p;
  *p = kind == 0 ? (T)(old + v) : kind == 1 ? (old > v ? old : v) : kind == 2 ? (old < v ? old : v) : v;
  return old;
}
template <typename T> inline T atomicAdd(T *p, T v) { return __cuemu_atomic_rmw(p, v, 0); }
template <typename T> inline T atomicMax(T *p, T v) { return __cuemu_atomic_rmw(p, v, 1); }
template <typename T> inline T atomicMin(T *p, T v) { return __cuemu_atomic_rmw(p, v, 2); }
template <typename T> inline T atomicExch(T *p, T v) { return __cuemu_atomic_rmw(p, v, 3); }
template <typename T> inline T atomicCAS(T *p, T cmp, T v) {
  T old = *p;
  if (old == cmp) *p = v;
  return old;
}

/* Correctly rounded arithmetic: the host's IEEE operations under the default rounding mode. */
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return sqrt(a); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline double rsqrt(double a) { return 1.0 / sqrt(a); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : a > 1.0f ? 1.0f : a; }
inline unsigned __float_as_uint(float v) { return cuemu::unbits<unsigned>(cuemu::bits(v)); }
inline int __float_as_int(float v) { return cuemu::unbits<int>(cuemu::bits(v)); }
inline float __uint_as_float(unsigned v) { return cuemu::unbits<float>(cuemu::bits(v)); }
inline float __int_as_float(int v) { return cuemu::unbits<float>(cuemu::bits(v)); }
inline long long __double_as_longlong(double v) { return cuemu::unbits<long long>(cuemu::bits(v)); }
inline double __longlong_as_double(long long v) { return cuemu::unbits<double>(cuemu::bits(v)); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
template <typename T> inline T __ldg(const T *p) { return *p; }

/* From here on the sources see a CUDA compiler compiling device code (the runtime's headers are already in). */
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900

#endif

/* Element-wise CUDA kernels built from the CPU's single-source bodies (host/cpu/elementwise_ops.h):
   grid-stride loops, 16-byte vector loads when aligned, a scalar tail. Contiguous float32 for now. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <type_traits>
#include "cpu/elementwise_ops.h"
extern "C" {  // the runtime's headers are C (no guards of their own)
#include "core/error.h"
#include "cuda/elementwise.h"
}

namespace {

// One functor per op, so each kernel instance inlines its body.
#define DLUA_CU_UNARY_FUNCTOR(ENUM, name, kind)                                          \
  struct U_##ENUM {                                                                      \
    __device__ __forceinline__ auto operator()(float x, float p1, float p2) const {      \
      return dlua_ew_##name##_f(x, p1, p2);                                              \
    }                                                                                    \
  };
DLUA_EW_UNARY_OPS(DLUA_CU_UNARY_FUNCTOR)
#define DLUA_CU_BINARY_FUNCTOR(ENUM, name, kind)                                         \
  struct B_##ENUM {                                                                      \
    __device__ __forceinline__ auto operator()(float a, float b, float al) const {       \
      return dlua_ew_##name##_f(a, b, al);                                               \
    }                                                                                    \
  };
DLUA_EW_BINARY_OPS(DLUA_CU_BINARY_FUNCTOR)

// Positions in the op lists, as the CPU numbers them.
#define DLUA_CU_ENUM_U(ENUM, name, kind) CU_U_##ENUM,
#define DLUA_CU_ENUM_B(ENUM, name, kind) CU_B_##ENUM,
enum { DLUA_EW_UNARY_OPS(DLUA_CU_ENUM_U) CU_U_COUNT };
enum { DLUA_EW_BINARY_OPS(DLUA_CU_ENUM_B) CU_B_COUNT };

// Predicates (bodies returning int) store bool bytes; the rest store float.
template <typename R> using out_t = typename std::conditional<std::is_same<R, int>::value, uint8_t, float>::type;

template <typename T> struct alignas(4 * sizeof(T)) vec4 { T v[4]; };

// O is explicit (not deduced through out_t): nvcc's launch stubs cannot name alias templates.
template <typename F, typename O, bool VEC>
__global__ void unary_kernel(O *__restrict__ y, const float *__restrict__ x, int64_t n, float p1, float p2) {
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    for (int64_t g = tid; g < n4; g += stride) {
      float4 in = reinterpret_cast<const float4 *>(x)[g];
      vec4<O> out;
      out.v[0] = (O)f(in.x, p1, p2);
      out.v[1] = (O)f(in.y, p1, p2);
      out.v[2] = (O)f(in.z, p1, p2);
      out.v[3] = (O)f(in.w, p1, p2);
      reinterpret_cast<vec4<O> *>(y)[g] = out;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = (O)f(x[i], p1, p2);  // the tail (or all)
}

template <typename F, typename O, bool VEC>
__global__ void binary_kernel(O *__restrict__ y, const float *__restrict__ a, const float *__restrict__ b, int64_t n,
                              float al) {
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (VEC) {
    const int64_t n4 = n / 4;
    for (int64_t g = tid; g < n4; g += stride) {
      float4 u = reinterpret_cast<const float4 *>(a)[g];
      float4 w = reinterpret_cast<const float4 *>(b)[g];
      vec4<O> out;
      out.v[0] = (O)f(u.x, w.x, al);
      out.v[1] = (O)f(u.y, w.y, al);
      out.v[2] = (O)f(u.z, w.z, al);
      out.v[3] = (O)f(u.w, w.w, al);
      reinterpret_cast<vec4<O> *>(y)[g] = out;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = (O)f(a[i], b[i], al);
}

constexpr int kThreads = 256;

// Enough blocks to fill the GPU a few times over; the grid-stride loop covers the rest.
unsigned grid_for(int64_t work) {
  static int sms = 0;
  if (!sms) {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    sms = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0 ? v : 132;
  }
  int64_t blocks = (work + kThreads - 1) / kThreads;
  int64_t cap = (int64_t)sms * 8;
  if (blocks > cap) blocks = cap;
  return (unsigned)(blocks < 1 ? 1 : blocks);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

dlua_status_t launched(const char *op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: kernel launch failed: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
  return DLUA_OK;
}

template <typename F>
dlua_status_t run_unary(const char *name, void *y, const float *x, int64_t n, float p1, float p2, cudaStream_t s) {
  using O = out_t<decltype(F()(0.f, 0.f, 0.f))>;
  bool vec = aligned16(x) && ((uintptr_t)y % (4 * sizeof(O))) == 0 && n >= 4;
  if (vec) unary_kernel<F, O, true><<<grid_for(n / 4), kThreads, 0, s>>>((O *)y, x, n, p1, p2);
  else unary_kernel<F, O, false><<<grid_for(n), kThreads, 0, s>>>((O *)y, x, n, p1, p2);
  return launched(name);
}

template <typename F>
dlua_status_t run_binary(const char *name, void *y, const float *a, const float *b, int64_t n, float al, cudaStream_t s) {
  using O = out_t<decltype(F()(0.f, 0.f, 0.f))>;
  bool vec = aligned16(a) && aligned16(b) && ((uintptr_t)y % (4 * sizeof(O))) == 0 && n >= 4;
  if (vec) binary_kernel<F, O, true><<<grid_for(n / 4), kThreads, 0, s>>>((O *)y, a, b, n, al);
  else binary_kernel<F, O, false><<<grid_for(n), kThreads, 0, s>>>((O *)y, a, b, n, al);
  return launched(name);
}

}  // namespace

extern "C" dlua_status_t dlua_cuda_ew_unary_f32(int op, void *y, const float *x, int64_t n, float p1, float p2, void *stream) {
  if (n < 0) return DLUA_ERR(DLUA_ERR_ARG, "cuda unary: negative length %lld", (long long)n);
  if (n == 0) return DLUA_OK;
  cudaStream_t s = (cudaStream_t)stream;
  switch (op) {
#define DLUA_CU_CASE_U(ENUM, name, kind) \
  case CU_U_##ENUM: return run_unary<U_##ENUM>(#name, y, x, n, p1, p2, s);
    DLUA_EW_UNARY_OPS(DLUA_CU_CASE_U)
    default: return DLUA_ERR(DLUA_ERR_ARG, "cuda unary: unknown op %d", op);
  }
}

extern "C" dlua_status_t dlua_cuda_ew_binary_f32(int op, void *y, const float *a, const float *b, int64_t n, float alpha, void *stream) {
  if (n < 0) return DLUA_ERR(DLUA_ERR_ARG, "cuda binary: negative length %lld", (long long)n);
  if (n == 0) return DLUA_OK;
  cudaStream_t s = (cudaStream_t)stream;
  switch (op) {
#define DLUA_CU_CASE_B(ENUM, name, kind) \
  case CU_B_##ENUM: return run_binary<B_##ENUM>(#name, y, a, b, n, alpha, s);
    DLUA_EW_BINARY_OPS(DLUA_CU_CASE_B)
    default: return DLUA_ERR(DLUA_ERR_ARG, "cuda binary: unknown op %d", op);
  }
}

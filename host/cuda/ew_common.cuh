/* Shared by the element-wise .cu files: dtype traits, operand addressing, grid sizing, launch checks. */
#ifndef DLUA_CUDA_EW_COMMON_CUH
#define DLUA_CUDA_EW_COMMON_CUH
// System headers first and outside extern "C": math.h must keep its C++ overloads.
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>
extern "C" {  // the runtime's headers are C without guards of their own
#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda/kernels.h"
}
#include "kernels/ew.h"
#include "kernels/elementwise_ops.h"

namespace dlua_cu {

typedef dlua_ew_desc_t Ew; /* one launch (kernels/ew.h), as host/ops builds it */

/* Storage type S, compute type C (the CPU's: float for f32/f16/bf16, double, int64 for the
   integers and bool), and the conversions, exactly as the CPU backend's LD_/ST_ macros (elementwise.c). */
template <int DT> struct Tr;
template <> struct Tr<DLUA_DTYPE_F32> {
  typedef float S;
  typedef float C;
  static __device__ __forceinline__ C ld(S v) { return v; }
  static __device__ __forceinline__ S st(C v) { return v; }
};
template <> struct Tr<DLUA_DTYPE_F64> {
  typedef double S;
  typedef double C;
  static __device__ __forceinline__ C ld(S v) { return v; }
  static __device__ __forceinline__ S st(C v) { return v; }
};
template <> struct Tr<DLUA_DTYPE_F16> {
  typedef uint16_t S;
  typedef float C;
  static __device__ __forceinline__ C ld(S v) { return dlua_f16_to_f32_inl(v); }
  static __device__ __forceinline__ S st(C v) { return dlua_f32_to_f16_inl(v); }
};
template <> struct Tr<DLUA_DTYPE_BF16> {
  typedef uint16_t S;
  typedef float C;
  static __device__ __forceinline__ C ld(S v) { return dlua_bf16_to_f32_inl(v); }
  static __device__ __forceinline__ S st(C v) { return dlua_f32_to_bf16_inl(v); }
};
template <> struct Tr<DLUA_DTYPE_I32> {
  typedef int32_t S;
  typedef int64_t C;
  static __device__ __forceinline__ C ld(S v) { return (int64_t)v; }
  static __device__ __forceinline__ S st(C v) { return (int32_t)v; }
};
template <> struct Tr<DLUA_DTYPE_I64> {
  typedef int64_t S;
  typedef int64_t C;
  static __device__ __forceinline__ C ld(S v) { return v; }
  static __device__ __forceinline__ S st(C v) { return v; }
};
template <> struct Tr<DLUA_DTYPE_U8> {
  typedef uint8_t S;
  typedef int64_t C;
  static __device__ __forceinline__ C ld(S v) { return (int64_t)v; }
  static __device__ __forceinline__ S st(C v) { return (uint8_t)v; }
};
template <> struct Tr<DLUA_DTYPE_BOOL> {
  typedef uint8_t S;
  typedef int64_t C;
  static __device__ __forceinline__ C ld(S v) { return (int64_t)v; }
  static __device__ __forceinline__ S st(C v) { return (uint8_t)(v != 0); }
};

/* 16-byte loads for the float dtypes stored in 4 or 2 bytes (f32, f16, bf16). */
template <int DT> struct VecOk {
  static const bool value = DT == DLUA_DTYPE_F32 || DT == DLUA_DTYPE_F16 || DT == DLUA_DTYPE_BF16;
};
template <typename T, int V> struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

/* A kernel's scalar in its compute type, as the CPU's EW_PARAM_ macros read it. */
template <typename C> __host__ __forceinline__ C param(const Ew &e, int k) {
  if constexpr (std::is_same<C, int64_t>::value) return e.i[k];
  else return (C)e.d[k];
}

/* The operands' layout, passed to kernels by value (a few hundred bytes of parameters). */
struct Ix {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t st[4][DLUA_MAX_DIMS];
  char *base[4];
};

inline Ix make_ix(const Ew &e) {
  Ix ix;
  memset(&ix, 0, sizeof ix);
  ix.ndim = e.ndim;
  for (int d = 0; d < e.ndim; d++) {
    ix.sizes[d] = e.sizes[d];
    for (int k = 0; k < e.nops; k++) ix.st[k][d] = e.strides[k][d];
  }
  for (int k = 0; k < e.nops; k++) ix.base[k] = e.base[k];
  return ix;
}

/* Addresses of linear element `pos` (row-major over the sizes) in the first N operands. */
template <int N> __device__ __forceinline__ void locate(const Ix &ix, int64_t pos, char *(&p)[N]) {
#pragma unroll
  for (int k = 0; k < N; k++) p[k] = ix.base[k];
  for (int d = ix.ndim - 1; d >= 0; d--) {
    const int64_t sz = ix.sizes[d];
    const int64_t i = pos % sz;
    pos /= sz;
#pragma unroll
    for (int k = 0; k < N; k++) p[k] += i * ix.st[k][d];
  }
}

/* Whether operands [0, n) are one unit-stride run each (the iterator merged the layout to one dim). */
inline bool contiguous(const Ew &e, int n, const int *elsizes) {
  if (e.ndim != 1) return false;
  for (int k = 0; k < n; k++)
    if (e.strides[k][0] != elsizes[k]) return false;
  return true;
}

inline bool aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

constexpr int kThreads = 256;

/* Enough blocks to fill the GPU a few times over; grid-stride loops cover the rest. */
unsigned grid_for(int64_t work);

/* Checks the launch just made; names the op. */
dlua_status_t launched(const char *op);

/* Calls L::template run<DT>(op, e, s) with e.dtype as a compile-time DT: the one dtype switch of
   every element-wise family. FLOAT_ONLY leaves the integer and bool kernels out. */
template <typename L, bool FLOAT_ONLY> dlua_status_t dispatch_dtype(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.dtype) {
    case DLUA_DTYPE_F32: return L::template run<DLUA_DTYPE_F32>(op, e, s);
    case DLUA_DTYPE_F64: return L::template run<DLUA_DTYPE_F64>(op, e, s);
    case DLUA_DTYPE_F16: return L::template run<DLUA_DTYPE_F16>(op, e, s);
    case DLUA_DTYPE_BF16: return L::template run<DLUA_DTYPE_BF16>(op, e, s);
    default: break;
  }
  if constexpr (!FLOAT_ONLY) {
    switch (e.dtype) {
      case DLUA_DTYPE_I32: return L::template run<DLUA_DTYPE_I32>(op, e, s);
      case DLUA_DTYPE_I64: return L::template run<DLUA_DTYPE_I64>(op, e, s);
      case DLUA_DTYPE_U8: return L::template run<DLUA_DTYPE_U8>(op, e, s);
      case DLUA_DTYPE_BOOL: return L::template run<DLUA_DTYPE_BOOL>(op, e, s);
      default: break;
    }
  }
  return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CUDA kernel for dtype %d", op, e.dtype);
}

/* Per-family entry points (one .cu file each, for parallel compiles). */
dlua_status_t run_unary(const char *op, const Ew &e, cudaStream_t s);
dlua_status_t run_binary(const char *op, const Ew &e, cudaStream_t s);

}  // namespace dlua_cu

/* In a launcher: `return CALL(DT);` for the floating dtype dt (a run-time value), else an internal
   error naming the kernel family. */
#define DLUA_CU_FLOAT_DISPATCH(dt, CALL, op, family)                                                         \
  switch (dt) {                                                                                             \
    case DLUA_DTYPE_F32: return CALL(DLUA_DTYPE_F32);                                                       \
    case DLUA_DTYPE_F64: return CALL(DLUA_DTYPE_F64);                                                       \
    case DLUA_DTYPE_F16: return CALL(DLUA_DTYPE_F16);                                                       \
    case DLUA_DTYPE_BF16: return CALL(DLUA_DTYPE_BF16);                                                     \
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CUDA " family " kernel for dtype %d", op, (int)(dt)); \
  }

#endif

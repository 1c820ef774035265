/* Random fills on CUDA (kernels/random.h's random family): one thread per 4-element Philox block, with the CPU's
   per-element rules (kernels/philox.h), so a fill gives the same bits on both backends for the same generator
   state. randperm stays NULL: its front door shuffles on the CPU. */
#include "cuda/ew_common.cuh"
#include "cuda/device_guard.cuh"
#include "kernels/philox.h"
#include "kernels/random.h"

namespace dlua_cu {
namespace {

/* host/core/copy.c's conversions from f64 and from i64 into storage type DT (STORE_ of LOAD_f64 / LOAD_i64). */
__device__ __forceinline__ int64_t f64_to_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

template <int DT> __device__ __forceinline__ typename Tr<DT>::S from_f64(double v) {
  typedef typename Tr<DT>::S S;
  if constexpr (DT == DLUA_DTYPE_F32) return (float)v;
  else if constexpr (DT == DLUA_DTYPE_F64) return v;
  else if constexpr (DT == DLUA_DTYPE_F16) return dlua_f32_to_f16_inl((float)v);
  else if constexpr (DT == DLUA_DTYPE_BF16) return dlua_f32_to_bf16_inl((float)v);
  else if constexpr (DT == DLUA_DTYPE_BOOL) return (S)(v != 0);
  else if constexpr (DT == DLUA_DTYPE_I32) return (int32_t)(uint32_t)(uint64_t)f64_to_i64(v);
  else if constexpr (DT == DLUA_DTYPE_U8) return (uint8_t)(uint64_t)f64_to_i64(v);
  else return f64_to_i64(v);
}

template <int DT> __device__ __forceinline__ typename Tr<DT>::S from_i64(int64_t v) {
  typedef typename Tr<DT>::S S;
  if constexpr (DT == DLUA_DTYPE_F32) return (float)v;
  else if constexpr (DT == DLUA_DTYPE_F64) return (double)v;
  else if constexpr (DT == DLUA_DTYPE_F16) return dlua_f32_to_f16_inl((float)v);
  else if constexpr (DT == DLUA_DTYPE_BF16) return dlua_f32_to_bf16_inl((float)v);
  else if constexpr (DT == DLUA_DTYPE_BOOL) return (S)(v != 0);
  else if constexpr (DT == DLUA_DTYPE_I32) return (int32_t)(uint32_t)(uint64_t)v;
  else if constexpr (DT == DLUA_DTYPE_U8) return (uint8_t)(uint64_t)v;
  else return v;
}

/* Block b covers elements 4b .. 4b+3 (the last one may be short). */
template <int DT, int KIND> __global__ void k_fill(dlua_random_fill_t f, void *dst_, int64_t n) {
  typedef typename Tr<DT>::S S;
  S *dst = (S *)dst_;
  const dlua_rng_stream_t s = {{f.key[0], f.key[1]}, f.base};
  const int64_t nblocks = (n + 3) / 4, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
    uint32_t w[4];
    dlua_rng_block(&s, (uint64_t)b, 0, w);
    const int64_t i0 = 4 * b;
    const int m = n - i0 < 4 ? (int)(n - i0) : 4;
    if constexpr (KIND == DLUA_RANDOM_NORMAL) {
      double z[4];
      dlua_rng_normal4(w, f.a, f.b, z);
      for (int k = 0; k < m; k++) dst[i0 + k] = from_f64<DT>(z[k]);
    } else {
      for (int k = 0; k < m; k++) {
        if constexpr (KIND == DLUA_RANDOM_UNIFORM)
          dst[i0 + k] = from_f64<DT>(dlua_rng_uniform(w[k], f.wide, f.a, f.b));
        else if constexpr (KIND == DLUA_RANDOM_BERNOULLI)
          dst[i0 + k] = from_f64<DT>(dlua_rng_bernoulli(w[k], f.a));
        else
          dst[i0 + k] = from_i64<DT>(f.low + (int64_t)dlua_rng_bounded(&s, i0 + k, w[k], f.range));
      }
    }
  }
}

template <int DT> dlua_status_t fill(const char *op, const dlua_random_fill_t &f, void *dst, int64_t n, cudaStream_t s) {
  const unsigned grid = grid_for((n + 3) / 4);
  switch (f.kind) {
    case DLUA_RANDOM_UNIFORM: k_fill<DT, DLUA_RANDOM_UNIFORM><<<grid, kThreads, 0, s>>>(f, dst, n); break;
    case DLUA_RANDOM_NORMAL: k_fill<DT, DLUA_RANDOM_NORMAL><<<grid, kThreads, 0, s>>>(f, dst, n); break;
    case DLUA_RANDOM_RANDINT: k_fill<DT, DLUA_RANDOM_RANDINT><<<grid, kThreads, 0, s>>>(f, dst, n); break;
    case DLUA_RANDOM_BERNOULLI: k_fill<DT, DLUA_RANDOM_BERNOULLI><<<grid, kThreads, 0, s>>>(f, dst, n); break;
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: unknown CUDA fill %d", op, f.kind);
  }
  return launched(op);
}

}  // namespace
}  // namespace dlua_cu

static dlua_status_t cuda_fill(const char *op, const dlua_random_fill_t *f) {
  using namespace dlua_cu;
  void *dst = f->dst;
  const int64_t n = f->n;
  const int dtype = f->dtype, device = f->device;
  if (n <= 0) return DLUA_OK;
  DLUA_CU_SELECT(guard, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  switch (dtype) {
    case DLUA_DTYPE_F32: return fill<DLUA_DTYPE_F32>(op, *f, dst, n, s);
    case DLUA_DTYPE_F64: return fill<DLUA_DTYPE_F64>(op, *f, dst, n, s);
    case DLUA_DTYPE_F16: return fill<DLUA_DTYPE_F16>(op, *f, dst, n, s);
    case DLUA_DTYPE_BF16: return fill<DLUA_DTYPE_BF16>(op, *f, dst, n, s);
    case DLUA_DTYPE_I32: return fill<DLUA_DTYPE_I32>(op, *f, dst, n, s);
    case DLUA_DTYPE_I64: return fill<DLUA_DTYPE_I64>(op, *f, dst, n, s);
    case DLUA_DTYPE_U8: return fill<DLUA_DTYPE_U8>(op, *f, dst, n, s);
    case DLUA_DTYPE_BOOL: return fill<DLUA_DTYPE_BOOL>(op, *f, dst, n, s);
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: invalid dtype %d", op, dtype);
  }
}

const struct dlua_random_ops dlua_cuda_random_ops = {
    /* fill */ cuda_fill,
    /* randperm */ NULL,
};

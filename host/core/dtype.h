/* Inline f16/bf16 <-> f32 conversions for kernels; plain C so a CUDA build can compile them too. */
#ifndef DLUA_CORE_DTYPE_H
#define DLUA_CORE_DTYPE_H
#include <stdint.h>
#include <string.h>
#include "core/api.h"

/* nvcc compiles these for the device too (host/cuda kernels), so both sides round alike. */
#ifdef __CUDACC__
#define DLUA_DT_HD __host__ __device__
#else
#define DLUA_DT_HD
#endif

static inline DLUA_DT_HD uint32_t dlua_f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

static inline DLUA_DT_HD float dlua_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* Round to nearest, ties to even, in integer arithmetic so the result does not depend on
   the FPU's rounding mode or on flush-to-zero settings. */
static inline DLUA_DT_HD uint16_t dlua_f32_to_f16_inl(float f) {
  uint32_t x = dlua_f32_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {
    if (x == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    // NaN: keep the top payload bits and force the quiet bit so it can never become Inf.
    return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // 65520 and up round to Inf
  if (x >= 0x38800000u) {                                    // normal half (>= 2^-14)
    uint32_t r = x - 0x38000000u;                            // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  // Half subnormal: the value in units of 2^-24, rounded to nearest even.
  uint32_t e = x >> 23;
  if (e < 102u) return sign;  // below 2^-25: rounds to zero (float subnormals included)
  uint32_t mant = (x & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;  // 14..24
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)(sign | q);  // q == 0x400 is the smallest normal: still the right bits
}

static inline DLUA_DT_HD float dlua_f16_to_f32_inl(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) return dlua_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {
    if (m == 0) return dlua_bits_f32(sign);
    // Subnormal half: normalise the mantissa; every one is a normal float.
    e = 113;
    while (!(m & 0x400u)) {
      m <<= 1;
      e--;
    }
    m &= 0x3ffu;
    return dlua_bits_f32(sign | (e << 23) | (m << 13));
  }
  return dlua_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline DLUA_DT_HD uint16_t dlua_f32_to_bf16_inl(float f) {
  uint32_t x = dlua_f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // ties to even; overflow carries into Inf as it should
  return (uint16_t)(x >> 16);
}

static inline DLUA_DT_HD float dlua_bf16_to_f32_inl(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  if ((x & 0x7fffffffu) > 0x7f800000u) x |= 0x400000u;  // signalling NaN comes back quiet
  return dlua_bits_f32(x);
}

#endif

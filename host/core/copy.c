/* Element conversions between dtypes over host memory, with copy_'s rules: the strided converters that the CPU
   backend's copy kernels (host/cpu/copy.c) run, and the contiguous conversions that fills, gradient compression and
   the optimizers call. Knows no tensor and no backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/dtype.h"

/* ---- element conversions ------------------------------------------------------------------- */

/* Float -> int: truncate toward zero (as PyTorch); out of range saturates to int64 and NaN
   gives 0 so the result is defined; narrower ints then wrap, as PyTorch's int64 -> uint8. */
static inline int64_t f64_to_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}
static inline int64_t f32_to_i64(float v) { return f64_to_i64((double)v); }
static inline int64_t same_i64(int64_t v) { return v; }
#define TO_I64(v) _Generic((v), float: f32_to_i64, double: f64_to_i64, default: same_i64)(v)

/* Loads give float (f32/f16/bf16), double (f64) or int64 (integers, bool). */
#define LOAD_f32(x) (x)
#define LOAD_f64(x) (x)
#define LOAD_f16(x) dlua_f16_to_f32_inl(x)
#define LOAD_bf16(x) dlua_bf16_to_f32_inl(x)
#define LOAD_i32(x) ((int64_t)(x))
#define LOAD_i64(x) ((int64_t)(x))
#define LOAD_u8(x) ((int64_t)(x))
#define LOAD_b8(x) ((int64_t)((x) != 0))

#define STORE_f32(v) ((float)(v))
#define STORE_f64(v) ((double)(v))
#define STORE_f16(v) dlua_f32_to_f16_inl((float)(v))
#define STORE_bf16(v) dlua_f32_to_bf16_inl((float)(v))
#define STORE_i32(v) ((int32_t)(uint32_t)(uint64_t)TO_I64(v))
#define STORE_i64(v) TO_I64(v)
#define STORE_u8(v) ((uint8_t)(uint64_t)TO_I64(v))
#define STORE_b8(v) ((uint8_t)((v) != 0))

/* n elements from src (step ss bytes) to dst (step ds bytes); ss == 0 broadcasts one value. */
typedef dlua_convert_fn cvt_fn;

#define CVT_FN(SN, ST, DN, DT)                                                         \
  static void cvt_##SN##_##DN(char *d, int64_t ds, const char *s, int64_t ss, int64_t n) { \
    if (ss == 0) {                                                                     \
      const DT v = STORE_##DN(LOAD_##SN(*(const ST *)s));                              \
      if (ds == (int64_t)sizeof(DT)) {                                                 \
        DT *dp = (DT *)d;                                                              \
        for (int64_t i = 0; i < n; i++) dp[i] = v;                                     \
      } else {                                                                         \
        for (int64_t i = 0; i < n; i++) *(DT *)(d + i * ds) = v;                       \
      }                                                                                \
    } else if (ds == (int64_t)sizeof(DT) && ss == (int64_t)sizeof(ST)) {               \
      DT *dp = (DT *)d;                                                                \
      const ST *sp = (const ST *)s;                                                    \
      for (int64_t i = 0; i < n; i++) dp[i] = STORE_##DN(LOAD_##SN(sp[i]));            \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++)                                                  \
        *(DT *)(d + i * ds) = STORE_##DN(LOAD_##SN(*(const ST *)(s + i * ss)));        \
    }                                                                                  \
  }

/* Both lists follow dlua_dtype_t's order, so the table below is indexed [src * COUNT + dst]. */
#define FOR_DST(X, SN, ST) \
  X(SN, ST, f32, float) X(SN, ST, f64, double) X(SN, ST, f16, uint16_t) X(SN, ST, bf16, uint16_t) \
  X(SN, ST, i32, int32_t) X(SN, ST, i64, int64_t) X(SN, ST, u8, uint8_t) X(SN, ST, b8, uint8_t)
#define FOR_SRC(X) \
  FOR_DST(X, f32, float) FOR_DST(X, f64, double) FOR_DST(X, f16, uint16_t) FOR_DST(X, bf16, uint16_t) \
  FOR_DST(X, i32, int32_t) FOR_DST(X, i64, int64_t) FOR_DST(X, u8, uint8_t) FOR_DST(X, b8, uint8_t)

FOR_SRC(CVT_FN)

/* ---- f32 <-> f16/bf16 with SIMD (gradient compression casts whole buckets) ----------------- */

/* The same bits as the scalar conversions above (checked over every half value and the f32
   edge cases in tests/host/test_copy.c): F16C rounds to nearest even and quiets NaNs the same
   way; bf16 is integer arithmetic on 16 lanes. x86-64's baseline has neither, so the vector
   paths are chosen at run time. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DLUA_X86_SIMD 1
static int cpu_f16c(void) {
  static int v = -1;
  if (v < 0) v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return v;
}
static int cpu_avx512bw(void) {
  static int v = -1;
  if (v < 0) v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return v;
}
__attribute__((target("avx2,f16c"))) static int64_t f32_to_f16_f16c(uint16_t *d, const float *s, int64_t n, float scale) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(s + i);
    if (scale != 1.0f) v = _mm256_mul_ps(v, sc);
    _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}
__attribute__((target("avx2,f16c"))) static int64_t f16_to_f32_f16c(float *d, const uint16_t *s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
  return i;
}
__attribute__((target("avx512f"))) static int64_t f32_to_f16_512(uint16_t *d, const float *s, int64_t n, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(s + i);
    if (scale != 1.0f) v = _mm512_mul_ps(v, sc);
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}
__attribute__((target("avx512f"))) static int64_t f16_to_f32_512(float *d, const uint16_t *s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
  return i;
}
__attribute__((target("avx512f,avx512bw"))) static int64_t f32_to_bf16_512(uint16_t *d, const float *s, int64_t n,
                                                                          float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 f = _mm512_loadu_ps(s + i);
    if (scale != 1.0f) f = _mm512_mul_ps(f, sc);
    __m512i x = _mm512_castps_si512(f);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(bias, _mm512_and_si512(hi, one))), 16);
    r = _mm512_mask_or_epi32(r, nan, hi, quiet);
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(r));
  }
  return i;
}
__attribute__((target("avx512f,avx512bw"))) static int64_t bf16_to_f32_512(float *d, const uint16_t *s, int64_t n) {
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i x = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
    _mm512_storeu_ps(d + i, _mm512_castsi512_ps(_mm512_mask_or_epi32(x, nan, x, quiet)));
  }
  return i;
}
#endif

void dlua_convert_f32_to_half(uint16_t *d, const float *s, int64_t n, float scale, int bf16) {
  int64_t i = 0;
#ifdef DLUA_X86_SIMD
  if (bf16 && cpu_avx512bw()) i = f32_to_bf16_512(d, s, n, scale);
  if (!bf16 && cpu_avx512bw()) i = f32_to_f16_512(d, s, n, scale);
  if (!bf16 && cpu_f16c()) i += f32_to_f16_f16c(d + i, s + i, n - i, scale);
#endif
  if (bf16) {
    for (; i < n; i++) d[i] = dlua_f32_to_bf16_inl(scale != 1.0f ? s[i] * scale : s[i]);
  } else {
    for (; i < n; i++) d[i] = dlua_f32_to_f16_inl(scale != 1.0f ? s[i] * scale : s[i]);
  }
}

void dlua_convert_half_to_f32(float *d, const uint16_t *s, int64_t n, int bf16) {
  int64_t i = 0;
#ifdef DLUA_X86_SIMD
  if (bf16 && cpu_avx512bw()) i = bf16_to_f32_512(d, s, n);
  if (!bf16 && cpu_avx512bw()) i = f16_to_f32_512(d, s, n);
  if (!bf16 && cpu_f16c()) i += f16_to_f32_f16c(d + i, s + i, n - i);
#endif
  if (bf16) {
    for (; i < n; i++) d[i] = dlua_bf16_to_f32_inl(s[i]);
  } else {
    for (; i < n; i++) d[i] = dlua_f16_to_f32_inl(s[i]);
  }
}

/* Contiguous runs take the vector paths; strided ones the scalar loops of CVT_FN. */
#define FAST_CVT(NAME, SLOW, DT, ST, CALL)                                           \
  static void NAME(char *d, int64_t ds, const char *s, int64_t ss, int64_t n) {      \
    if (ds == (int64_t)sizeof(DT) && ss == (int64_t)sizeof(ST)) {                    \
      CALL;                                                                          \
    } else {                                                                         \
      SLOW(d, ds, s, ss, n);                                                         \
    }                                                                                \
  }
FAST_CVT(fast_f32_f16, cvt_f32_f16, uint16_t, float, dlua_convert_f32_to_half((uint16_t *)d, (const float *)s, n, 1.0f, 0))
FAST_CVT(fast_f32_bf16, cvt_f32_bf16, uint16_t, float, dlua_convert_f32_to_half((uint16_t *)d, (const float *)s, n, 1.0f, 1))
FAST_CVT(fast_f16_f32, cvt_f16_f32, float, uint16_t, dlua_convert_half_to_f32((float *)d, (const uint16_t *)s, n, 0))
FAST_CVT(fast_bf16_f32, cvt_bf16_f32, float, uint16_t, dlua_convert_half_to_f32((float *)d, (const uint16_t *)s, n, 1))

#define CVT_ENTRY(SN, ST, DN, DT) cvt_##SN##_##DN,
static const cvt_fn cvt_table[DLUA_DTYPE_COUNT * DLUA_DTYPE_COUNT] = {FOR_SRC(CVT_ENTRY)};

/* Same dtype: move the bits (f16 -> f32 -> f16 would quiet signalling NaNs). */
#define RAW_FN(NAME, T)                                                                 \
  static void NAME(char *d, int64_t ds, const char *s, int64_t ss, int64_t n) {        \
    if (ss == 0) {                                                                      \
      const T v = *(const T *)s;                                                        \
      for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = v;                           \
    } else if (ds == (int64_t)sizeof(T) && ss == (int64_t)sizeof(T)) {                  \
      memcpy(d, s, (size_t)n * sizeof(T));                                              \
    } else {                                                                            \
      for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = *(const T *)(s + i * ss);    \
    }                                                                                   \
  }
RAW_FN(raw_copy1, uint8_t)
RAW_FN(raw_copy2, uint16_t)
RAW_FN(raw_copy4, uint32_t)
RAW_FN(raw_copy8, uint64_t)

dlua_convert_fn dlua_converter(dlua_dtype_t src, dlua_dtype_t dst) {
  if (src == dst && src != DLUA_DTYPE_BOOL) {  // bool goes through != 0 so stray bytes become 1
    switch (dlua_dtype_size(src)) {
      case 1: return raw_copy1;
      case 2: return raw_copy2;
      case 4: return raw_copy4;
      default: return raw_copy8;
    }
  }
  if (src == DLUA_DTYPE_F32 && dst == DLUA_DTYPE_F16) return fast_f32_f16;
  if (src == DLUA_DTYPE_F32 && dst == DLUA_DTYPE_BF16) return fast_f32_bf16;
  if (src == DLUA_DTYPE_F16 && dst == DLUA_DTYPE_F32) return fast_f16_f32;
  if (src == DLUA_DTYPE_BF16 && dst == DLUA_DTYPE_F32) return fast_bf16_f32;
  return cvt_table[src * DLUA_DTYPE_COUNT + dst];
}

void dlua_convert(void *dst, dlua_dtype_t dst_dtype, const void *src, dlua_dtype_t src_dtype, int64_t n) {
  dlua_converter(src_dtype, dst_dtype)((char *)dst, (int64_t)dlua_dtype_size(dst_dtype), (const char *)src,
                                  (int64_t)dlua_dtype_size(src_dtype), n);
}

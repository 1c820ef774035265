/* Check suite for host/core/dtype.c: names, promotion, f16/bf16 rounding, edge values, copy_ casts. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Reference decoders written from the IEEE formulas, independent of the bit tricks. */
static double ref_f16(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
  if (e == 31) v = m ? NAN : INFINITY;
  return s ? -v : v;
}
static double ref_bf16(uint16_t h) {
  int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v = e == 0 ? ldexp(m, -133) : ldexp(128 + m, e - 134);
  if (e == 255) v = m ? NAN : INFINITY;
  return s ? -v : v;
}

START_TEST(test_names_sizes) {
  const char *names[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool"};
  const size_t sizes[] = {4, 8, 2, 2, 4, 8, 1, 1};
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
    ck_assert_str_eq(dlua_dtype_name((dlua_dtype_t)d), names[d]);
    ck_assert_uint_eq(dlua_dtype_size((dlua_dtype_t)d), sizes[d]);
    ck_assert_int_eq(dlua_dtype_from_name(names[d]), d);
    ck_assert_int_eq(dlua_dtype_is_floating((dlua_dtype_t)d), d <= DLUA_DTYPE_BF16);
  }
  ck_assert_int_eq(dlua_dtype_from_name("f32"), DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_dtype_from_name("float"), DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_dtype_from_name("half"), DLUA_DTYPE_F16);
  ck_assert_int_eq(dlua_dtype_from_name("bf16"), DLUA_DTYPE_BF16);
  ck_assert_int_eq(dlua_dtype_from_name("double"), DLUA_DTYPE_F64);
  ck_assert_int_eq(dlua_dtype_from_name("long"), DLUA_DTYPE_I64);
  ck_assert_int_eq(dlua_dtype_from_name("u8"), DLUA_DTYPE_U8);
  ck_assert_int_eq(dlua_dtype_from_name("torch.bfloat16"), DLUA_DTYPE_BF16);
  ck_assert_int_eq(dlua_dtype_from_name("float17"), -1);
  ck_assert_int_eq(dlua_dtype_from_name(""), -1);
  ck_assert_int_eq(dlua_dtype_from_name(NULL), -1);
  ck_assert_str_eq(dlua_dtype_name(DLUA_DTYPE_COUNT), "invalid dtype");
  ck_assert_uint_eq(dlua_dtype_size(DLUA_DTYPE_COUNT), 0);
}
END_TEST

START_TEST(test_promotion) {
  enum { F32 = DLUA_DTYPE_F32, F64 = DLUA_DTYPE_F64, F16 = DLUA_DTYPE_F16, BF = DLUA_DTYPE_BF16,
         I32 = DLUA_DTYPE_I32, I64 = DLUA_DTYPE_I64, U8 = DLUA_DTYPE_U8, B = DLUA_DTYPE_BOOL };
  // PyTorch's torch.promote_types for these pairs.
  const int cases[][3] = {
      {B, B, B},       {B, U8, U8},     {U8, I32, I32},  {I32, I64, I64}, {U8, I64, I64},
      {I64, F16, F16}, {I64, BF, BF},   {B, F16, F16},   {F16, BF, F32},  {F16, F32, F32},
      {BF, F32, F32},  {F32, F64, F64}, {I64, F32, F32}, {F16, F64, F64}, {I32, I32, I32},
      {U8, U8, U8},    {B, F64, F64},   {BF, BF, BF},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_int_eq(dlua_dtype_promote((dlua_dtype_t)cases[i][0], (dlua_dtype_t)cases[i][1]), cases[i][2]);
    ck_assert_int_eq(dlua_dtype_promote((dlua_dtype_t)cases[i][1], (dlua_dtype_t)cases[i][0]), cases[i][2]);
  }
}
END_TEST

START_TEST(test_f16_decode_all) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = dlua_f16_to_f32((uint16_t)h);
    double r = ref_f16((uint16_t)h);
    if (isnan(r)) {
      ck_assert_msg(isnan(f), "f16 %04x should decode to NaN", h);
      ck_assert_msg(fbits(f) & 0x400000u, "f16 NaN %04x must come back quiet", h);
      ck_assert_int_eq(fbits(f) >> 31, h >> 15);
    } else {
      ck_assert_msg((double)f == r && !signbit(f) == !signbit(r), "f16 %04x decoded to %a, expected %a", h, f, r);
      // Every non-NaN half survives the round trip bit for bit (signed zeros included).
      ck_assert_uint_eq(dlua_f32_to_f16(f), h);
    }
  }
}
END_TEST

START_TEST(test_bf16_decode_all) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = dlua_bf16_to_f32((uint16_t)h);
    double r = ref_bf16((uint16_t)h);
    if (isnan(r)) {
      ck_assert(isnan(f));
      ck_assert_uint_eq(dlua_f32_to_bf16(f) & 0x7f80u, 0x7f80u);
      ck_assert_uint_ne(dlua_f32_to_bf16(f) & 0x7fu, 0);
    } else {
      ck_assert_msg((double)f == r && !signbit(f) == !signbit(r), "bf16 %04x decoded to %a, expected %a", h, f, r);
      ck_assert_uint_eq(dlua_f32_to_bf16(f), h);
    }
  }
}
END_TEST

/* Between neighbours a < b the midpoint goes to the one with an even mantissa; a hair
   either side goes to the nearer. Covers subnormals, the normal range and the top. */
START_TEST(test_f16_ties_to_even) {
  for (uint32_t h = 0; h < 0x7bff; h++) {
    double a = ref_f16((uint16_t)h), b = ref_f16((uint16_t)(h + 1));
    float mid = (float)((a + b) / 2);
    ck_assert((double)mid == (a + b) / 2);  // exact: at most 12 significant bits
    uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
    ck_assert_msg(dlua_f32_to_f16(mid) == even, "tie between %04x and %04x", h, h + 1);
    ck_assert_uint_eq(dlua_f32_to_f16(nextafterf(mid, 0.0f)), h);
    ck_assert_uint_eq(dlua_f32_to_f16(nextafterf(mid, INFINITY)), h + 1);
    ck_assert_uint_eq(dlua_f32_to_f16(-mid), 0x8000u | even);
  }
}
END_TEST

START_TEST(test_bf16_ties_to_even) {
  for (uint32_t h = 0; h < 0x7f7f; h++) {
    double a = ref_bf16((uint16_t)h), b = ref_bf16((uint16_t)(h + 1));
    float mid = (float)((a + b) / 2);
    ck_assert((double)mid == (a + b) / 2);
    uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
    ck_assert_msg(dlua_f32_to_bf16(mid) == even, "tie between %04x and %04x", h, h + 1);
    if (h > 0) ck_assert_uint_eq(dlua_f32_to_bf16(nextafterf(mid, 0.0f)), h);
    ck_assert_uint_eq(dlua_f32_to_bf16(nextafterf(mid, INFINITY)), h + 1);
  }
}
END_TEST

START_TEST(test_f16_edges) {
  ck_assert_uint_eq(dlua_f32_to_f16(0.0f), 0x0000);
  ck_assert_uint_eq(dlua_f32_to_f16(-0.0f), 0x8000);
  ck_assert_uint_eq(dlua_f32_to_f16(INFINITY), 0x7c00);
  ck_assert_uint_eq(dlua_f32_to_f16(-INFINITY), 0xfc00);
  ck_assert_uint_eq(dlua_f32_to_f16(65504.0f), 0x7bff);  // max finite
  ck_assert_uint_eq(dlua_f32_to_f16(65519.0f), 0x7bff);
  ck_assert_uint_eq(dlua_f32_to_f16(65520.0f), 0x7c00);  // the tie above max rounds to Inf (odd mantissa)
  ck_assert_uint_eq(dlua_f32_to_f16(1e10f), 0x7c00);
  ck_assert_uint_eq(dlua_f32_to_f16(-1e10f), 0xfc00);
  ck_assert_uint_eq(dlua_f32_to_f16(ldexpf(1, -24)), 0x0001);  // smallest subnormal
  ck_assert_uint_eq(dlua_f32_to_f16(ldexpf(1, -25)), 0x0000);  // tie to even: zero
  ck_assert_uint_eq(dlua_f32_to_f16(nextafterf(ldexpf(1, -25), 1)), 0x0001);
  ck_assert_uint_eq(dlua_f32_to_f16(ldexpf(3, -25)), 0x0002);  // 1.5 units: tie to 2
  ck_assert_uint_eq(dlua_f32_to_f16(ldexpf(1, -14)), 0x0400);  // smallest normal
  ck_assert_uint_eq(dlua_f32_to_f16(ldexpf(1023, -24)), 0x03ff);
  ck_assert_uint_eq(dlua_f32_to_f16(1e-40f), 0x0000);  // f32 subnormal
  ck_assert_uint_eq(dlua_f32_to_f16(-1e-40f), 0x8000);
  ck_assert_uint_eq(dlua_f32_to_f16(1.0f), 0x3c00);
  ck_assert_uint_eq(dlua_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00);  // tie, even is 1.0
  ck_assert_uint_eq(dlua_f32_to_f16(1.0f + ldexpf(3, -11)), 0x3c02);  // tie, even is up
  // NaNs stay NaN whatever their payload, quiet, sign kept; a signalling NaN must not become Inf.
  uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f802000u};
  for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
    uint16_t h = dlua_f32_to_f16(bitsf(nans[i]));
    ck_assert_uint_eq(h & 0x7c00u, 0x7c00u);
    ck_assert_uint_ne(h & 0x3ffu, 0);
    ck_assert_uint_ne(h & 0x200u, 0);
    ck_assert_uint_eq(h >> 15, nans[i] >> 31);
    ck_assert(isnan(dlua_f16_to_f32(h)));
  }
}
END_TEST

START_TEST(test_bf16_edges) {
  ck_assert_uint_eq(dlua_f32_to_bf16(0.0f), 0x0000);
  ck_assert_uint_eq(dlua_f32_to_bf16(-0.0f), 0x8000);
  ck_assert_uint_eq(dlua_f32_to_bf16(INFINITY), 0x7f80);
  ck_assert_uint_eq(dlua_f32_to_bf16(-INFINITY), 0xff80);
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x7f7f0000u)), 0x7f7f);  // max finite
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x7f7f7fffu)), 0x7f7f);
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x7f7f8000u)), 0x7f80);  // tie above max: Inf
  ck_assert_uint_eq(dlua_f32_to_bf16(3.4028235e38f), 0x7f80);       // FLT_MAX rounds up to Inf
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x00010000u)), 0x0001);  // smallest subnormal
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x00008000u)), 0x0000);  // tie to even
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x00018000u)), 0x0002);
  ck_assert_uint_eq(dlua_f32_to_bf16(1.0f), 0x3f80);
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x3f808000u)), 0x3f80);
  ck_assert_uint_eq(dlua_f32_to_bf16(bitsf(0x3f818000u)), 0x3f82);
  uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7fbfffffu};
  for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
    uint16_t h = dlua_f32_to_bf16(bitsf(nans[i]));
    ck_assert_uint_eq(h & 0x7f80u, 0x7f80u);
    ck_assert_uint_ne(h & 0x40u, 0);
    ck_assert_uint_eq(h >> 15, nans[i] >> 31);
  }
  // A signalling bf16 NaN decodes to a quiet f32 NaN.
  ck_assert_uint_ne(fbits(dlua_bf16_to_f32(0x7f81)) & 0x400000u, 0);
}
END_TEST

/* Random floats: the result is a nearest neighbour (checked against both neighbours). */
START_TEST(test_f16_random_nearest) {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 200000; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    float x = ldexpf((float)((s >> 40) & 0xffffff) / 16777216.0f, (int)((s >> 20) % 44) - 28);
    if (s & 1) x = -x;
    uint16_t h = dlua_f32_to_f16(x);
    double v = ref_f16(h);
    ck_assert(!isnan(v));
    uint16_t mag = h & 0x7fff;
    if (mag == 0x7c00) {
      ck_assert(fabs(x) >= 65520.0);
      continue;
    }
    double err = fabs((double)x - v);
    if (mag > 0) ck_assert(err <= fabs((double)x - ref_f16((uint16_t)(h - 1))));
    if (mag < 0x7bff) ck_assert(err <= fabs((double)x - ref_f16((uint16_t)(h + 1))));
  }
}
END_TEST

static dlua_tensor_t *from_f64(int n, const double *v, dlua_dtype_t dtype) {
  dlua_tensor_t *t = NULL, *c = NULL;
  int64_t sz = n;
  ck_assert_int_eq(dlua_tensor_from_data(&t, 1, &sz, DLUA_DTYPE_F64, v), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_to_dtype(&c, t, dtype), DLUA_OK);
  dlua_tensor_free(t);
  return c;
}

/* Casts through copy_, with PyTorch's rules: truncation toward zero, != 0 for bool. */
START_TEST(test_casts) {
  const double v[] = {2.7, -2.7, 0.5, -0.0, 0.0, 300.0, -1.0, 2049.0, 2051.0, NAN, INFINITY};
  enum { N = 11 };
  dlua_tensor_t *t;
  t = from_f64(N, v, DLUA_DTYPE_I32);
  const int32_t *i32 = dlua_tensor_data(t);
  ck_assert_int_eq(i32[0], 2);
  ck_assert_int_eq(i32[1], -2);
  ck_assert_int_eq(i32[2], 0);
  ck_assert_int_eq(i32[5], 300);
  ck_assert_int_eq(i32[6], -1);
  dlua_tensor_free(t);
  t = from_f64(N, v, DLUA_DTYPE_U8);
  const uint8_t *u8 = dlua_tensor_data(t);
  ck_assert_uint_eq(u8[0], 2);
  ck_assert_uint_eq(u8[5], 300 % 256);  // wraps, as PyTorch's uint8 cast
  ck_assert_uint_eq(u8[6], 255);
  dlua_tensor_free(t);
  t = from_f64(N, v, DLUA_DTYPE_BOOL);
  const uint8_t *b = dlua_tensor_data(t);
  const uint8_t expect_b[N] = {1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1};
  for (int i = 0; i < N; i++) ck_assert_uint_eq(b[i], expect_b[i]);
  // bool -> float is 0/1.
  dlua_tensor_t *bf = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&bf, t, DLUA_DTYPE_F32), DLUA_OK);
  for (int i = 0; i < N; i++) ck_assert_float_eq(((float *)dlua_tensor_data(bf))[i], expect_b[i]);
  dlua_tensor_free(bf);
  dlua_tensor_free(t);
  t = from_f64(N, v, DLUA_DTYPE_F16);
  const uint16_t *h = dlua_tensor_data(t);
  ck_assert_uint_eq(h[7], dlua_f32_to_f16(2048.0f));  // 2049 ties to even 2048
  ck_assert_uint_eq(h[8], dlua_f32_to_f16(2052.0f));
  ck_assert_uint_eq(h[3], 0x8000);
  ck_assert(isnan(dlua_f16_to_f32(h[9])));
  ck_assert_uint_eq(h[10], 0x7c00);
  dlua_tensor_free(t);
  // int64 values beyond 2^53 survive int64 -> int64 and int64 -> i32 wraps modulo 2^32.
  const int64_t big[] = {INT64_MAX, INT64_MIN, (1ll << 53) + 1, 0x100000005ll};
  dlua_tensor_t *i64 = NULL, *c = NULL;
  int64_t four = 4;
  ck_assert_int_eq(dlua_tensor_from_data(&i64, 1, &four, DLUA_DTYPE_I64, big), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_clone(&c, i64), DLUA_OK);
  ck_assert_mem_eq(dlua_tensor_data(c), big, sizeof big);
  dlua_tensor_free(c);
  c = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&c, i64, DLUA_DTYPE_I32), DLUA_OK);
  ck_assert_int_eq(((int32_t *)dlua_tensor_data(c))[3], 5);
  dlua_tensor_free(c);
  dlua_tensor_free(i64);
}
END_TEST

/* Every (src, dst) pair on values that every dtype holds exactly. */
START_TEST(test_cast_matrix) {
  const double v[] = {0, 1, 3, 0, 100, 1, 7};
  enum { N = 7 };
  for (int s = 0; s < DLUA_DTYPE_COUNT; s++) {
    dlua_tensor_t *src = from_f64(N, v, (dlua_dtype_t)s);
    for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
      dlua_tensor_t *dst = NULL, *back = NULL;
      ck_assert_int_eq(dlua_tensor_to_dtype(&dst, src, (dlua_dtype_t)d), DLUA_OK);
      ck_assert_int_eq(dlua_tensor_to_dtype(&back, dst, DLUA_DTYPE_F64), DLUA_OK);
      const double *r = dlua_tensor_data(back);
      for (int i = 0; i < N; i++) {
        double e = v[i];
        if (s == DLUA_DTYPE_BOOL || d == DLUA_DTYPE_BOOL) e = e != 0;
        ck_assert_msg(r[i] == e, "%s -> %s: element %d is %g, expected %g", dlua_dtype_name((dlua_dtype_t)s),
                      dlua_dtype_name((dlua_dtype_t)d), i, r[i], e);
      }
      dlua_tensor_free(dst);
      dlua_tensor_free(back);
    }
    dlua_tensor_free(src);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("dtype");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, test_names_sizes);
  tcase_add_test(tc, test_promotion);
  tcase_add_test(tc, test_f16_decode_all);
  tcase_add_test(tc, test_bf16_decode_all);
  tcase_add_test(tc, test_f16_ties_to_even);
  tcase_add_test(tc, test_bf16_ties_to_even);
  tcase_add_test(tc, test_f16_edges);
  tcase_add_test(tc, test_bf16_edges);
  tcase_add_test(tc, test_f16_random_nearest);
  tcase_add_test(tc, test_casts);
  tcase_add_test(tc, test_cast_matrix);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for the compression ops (host/ops/compress.c, kernels in host/cpu/compress.c) and the SIMD casts of host/core/copy.c: bits against the scalar conversions, top-k pack/unpack and residuals, orthogonalisation. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "core/dtype.h"
#include "core/tensor.h"

#include "testutil.h"

static float bits_f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Every half and bf16 value back to f32, vector paths against the scalar conversion (NaN payloads included). */
START_TEST(test_half_to_f32_all) {
  enum { N = 65536 };
  uint16_t *h = malloc(N * 2);
  float *got = malloc(N * 4);
  for (int i = 0; i < N; i++) h[i] = (uint16_t)i;
  for (int bf = 0; bf < 2; bf++) {
    dlua_convert_half_to_f32(got, h, N, bf);
    int bad = -1;  // (one assertion at the end: Check's per-assertion bookkeeping is slow)
    for (int i = 0; i < N && bad < 0; i++) {
      float want = bf ? dlua_bf16_to_f32_inl(h[i]) : dlua_f16_to_f32_inl(h[i]);
      if (memcmp(&got[i], &want, 4) != 0) bad = i;
    }
    ck_assert_msg(bad < 0, "%s 0x%04x converts differently", bf ? "bf16" : "f16", bad);
  }
  free(h);
  free(got);
}
END_TEST

/* f32 -> f16/bf16 over a sweep of bit patterns (every sign, exponent, rounding case, subnormals, Inf, NaN),
   with scale 1 and 0.5, against the scalar conversion. */
START_TEST(test_f32_to_half_sweep) {
  enum { N = 1 << 20 };
  float *f = malloc(N * 4);
  uint16_t *got = malloc(N * 2);
  uint64_t st = 7;
  for (int pass = 0; pass < 5; pass++) {
    for (int i = 0; i < N; i++) {
      uint32_t u = pass == 0 ? (uint32_t)i * 4099u : (uint32_t)(tu_splitmix(&st) * 2147483648.0) * 2u + (uint32_t)(i & 1);
      if (pass == 1) u = (u & 0x807fffffu) | ((uint32_t)(100 + i % 60) << 23);  // around the f16 range
      if (pass == 2) u = (u & 0xffff0000u) | (i & 1 ? 0x8000u : 0x7fffu);     // bf16 ties and near-ties
      if (pass == 3) u = (u & 0x80001fffu) | 0x38000000u | ((uint32_t)(i % 64) << 13);  // f16 subnormal edges
      f[i] = bits_f(u);
    }
    f[0] = INFINITY, f[1] = -INFINITY, f[2] = NAN, f[3] = bits_f(0x7f800001u), f[4] = 65520.0f, f[5] = 65519.0f;
    for (int bf = 0; bf < 2; bf++) {
      for (int sc = 0; sc < 2; sc++) {
        float scale = sc ? 0.5f : 1.0f;
        dlua_convert_f32_to_half(got, f, N, scale, bf);
        int64_t bad = -1;
        uint16_t want = 0;
        for (int i = 0; i < N && bad < 0; i++) {
          float v = sc ? f[i] * scale : f[i];
          want = bf ? dlua_f32_to_bf16_inl(v) : dlua_f32_to_f16_inl(v);
          if (got[i] != want) bad = i;
        }
        uint32_t u = 0;
        if (bad >= 0) memcpy(&u, &f[bad], 4);
        ck_assert_msg(bad < 0, "%s of 0x%08x (scale %g): got 0x%04x, want 0x%04x", bf ? "bf16" : "f16", u, scale,
                      bad >= 0 ? got[bad] : 0, want);
      }
    }
  }
  free(f);
  free(got);
}
END_TEST

static dlua_tensor_t *f32(int64_t n, const float *v) {
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, 1, &n, DLUA_DTYPE_F32, v), DLUA_OK);
  return t;
}

/* By hand: grad + residual, the 2 largest |.| sent (indices increasing), the rest kept exactly; unpack of two rows. */
START_TEST(test_topk_known) {
  float g[6] = {0.5f, -3.0f, 1.0f, 0.25f, 2.0f, -0.125f}, r[6] = {0.5f, 0, 0, 0, 1.5f, 0};
  dlua_tensor_t *grad = f32(6, g), *acc = f32(6, r), *packed = NULL;
  int64_t four = 4;
  ck_assert_int_eq(dlua_tensor_empty(&packed, 1, &four, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_compress_topk(packed, grad, acc, NULL, 0, 2), DLUA_OK);
  const int32_t *p = dlua_tensor_data(packed);
  float v0, v1;
  memcpy(&v0, p, 4);
  memcpy(&v1, p + 1, 4);
  ck_assert_int_eq(p[2], 1);  // -3
  ck_assert_int_eq(p[3], 4);  // 2 + 1.5
  ck_assert(v0 == -3.0f && v1 == 3.5f);
  const float *a = dlua_tensor_data(acc);
  float want[6] = {1.0f, 0, 1.0f, 0.25f, 0, -0.125f};
  ck_assert(memcmp(a, want, sizeof want) == 0);
  // two ranks' rows: the second sends index 1 again and index 0
  int32_t rows[8];
  memcpy(rows, p, 16);
  float w0 = 1.0f, w1 = 4.0f;
  memcpy(rows + 4, &w0, 4);
  memcpy(rows + 5, &w1, 4);
  rows[6] = 1, rows[7] = 0;
  int64_t gs[2] = {2, 4};
  dlua_tensor_t *gath = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&gath, 2, gs, DLUA_DTYPE_I32, rows), DLUA_OK);
  ck_assert_int_eq(dlua_compress_topk_unpack(grad, gath, 2, 2), DLUA_OK);
  const float *d = dlua_tensor_data(grad);
  float dense[6] = {2.0f, -1.0f, 0, 0, 1.75f, 0};
  ck_assert(memcmp(d, dense, sizeof dense) == 0);
  // an index outside the bucket is refused before anything is written
  rows[7] = 6;
  dlua_tensor_t *bad = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&bad, 2, gs, DLUA_DTYPE_I32, rows), DLUA_OK);
  tu_expect_error(dlua_compress_topk_unpack(grad, bad, 2, 2), "index 6, outside the bucket of 6");
  ck_assert(memcmp(d, dense, sizeof dense) == 0);
  tu_expect_error(dlua_compress_topk(packed, grad, acc, NULL, 0, 3), "expected 2k = 6");
  dlua_tensor_t *ts[] = {grad, acc, packed, gath, bad};
  for (int i = 0; i < 5; i++) dlua_tensor_free(ts[i]);
}
END_TEST

/* A rank-2 (6, 4) matrix: two orthonormal columns, the dependent ones exactly zero (not noise). */
START_TEST(test_orthogonalize_rank_deficient) {
  float m[24];
  for (int i = 0; i < 6; i++) {
    float a = (float)(i + 1), b = (float)((i * 7) % 5) - 2.0f;
    m[i * 4 + 0] = a, m[i * 4 + 1] = b, m[i * 4 + 2] = a + b, m[i * 4 + 3] = 2 * a - b;
  }
  int64_t sz[2] = {6, 4};
  dlua_tensor_t *p = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&p, 2, sz, DLUA_DTYPE_F32, m), DLUA_OK);
  ck_assert_int_eq(dlua_compress_orthogonalize(p, 0), DLUA_OK);
  const float *q = dlua_tensor_data(p);
  for (int j = 0; j < 4; j++)
    for (int l = 0; l < 4; l++) {
      double dot = 0;
      for (int i = 0; i < 6; i++) dot += (double)q[i * 4 + j] * q[i * 4 + l];
      double want = j == l && j < 2 ? 1.0 : 0.0;
      ck_assert_msg(fabs(dot - want) < 1e-6, "column %d . column %d = %g", j, l, dot);
    }
  dlua_tensor_free(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("compress");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_half_to_f32_all);
  tcase_add_test(tc, test_f32_to_half_sweep);
  tcase_add_test(tc, test_topk_known);
  tcase_add_test(tc, test_orthogonalize_rank_deficient);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/data/augment.c: crops and flips against explicitly padded images, the Philox draw rule, thread independence, normalisation. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "data/augment.h"

#include "testutil.h"

/* Images (N, C, H, W) whose element (n, c, y, x) is v(n, c, y, x) = 1 + (31 n + 17 c + 5 y + x) mod 250:
   never 0, so a padded (zero) pixel cannot pass for an image pixel. */
static int pix(int64_t n, int64_t c, int64_t y, int64_t x) { return 1 + (int)((31 * n + 17 * c + 5 * y + x) % 250); }

static dlua_tensor_t *images(int64_t N, int64_t C, int64_t H, int64_t W, dlua_dtype_t dtype) {
  int64_t s[4] = {N, C, H, W};
  dlua_tensor_t *t = tu_new_t(4, s, dtype);
  void *p = dlua_tensor_data(t);
  int64_t i = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++)
      for (int64_t y = 0; y < H; y++)
        for (int64_t x = 0; x < W; x++, i++) {
          if (dtype == DLUA_DTYPE_U8)
            ((uint8_t *)p)[i] = (uint8_t)pix(n, c, y, x);
          else
            ((float *)p)[i] = (float)pix(n, c, y, x) + 0.25f;
        }
  return t;
}

/* The documented draw rule, recomputed through the public Philox block. */
static void spec_draw(uint64_t seed, uint64_t epoch, int64_t sample, int64_t pad, double flip_p, int64_t *dy,
                      int64_t *dx, int *flip) {
  uint32_t ctr[4] = {(uint32_t)sample, (uint32_t)((uint64_t)sample >> 32), (uint32_t)epoch,
                     (uint32_t)(epoch >> 32) ^ 0x41554731u};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, r[4];
  dlua_philox4x32_10(ctr, key, r);
  *dy = (int64_t)((r[0] * (uint64_t)(2 * pad + 1)) >> 32);
  *dx = (int64_t)((r[1] * (uint64_t)(2 * pad + 1)) >> 32);
  *flip = ldexp((double)r[2], -32) < flip_p;
}

/* Expected image i of the batch: build the zero-padded source explicitly, cut the window,
   mirror it; compare every element of out (B, C, H, W), read as float. */
static void check_batch(const dlua_tensor_t *out, int64_t C, int64_t H, int64_t W, const int64_t *samples, int64_t B,
                        int64_t pad, double flip_p, uint64_t seed, uint64_t epoch, float add) {
  ck_assert_int_eq(dlua_tensor_sizes(out)[0], B);
  dlua_tensor_t *f = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&f, out, DLUA_DTYPE_F32), DLUA_OK);
  const float *o = dlua_tensor_data(f);
  int64_t PH = H + 2 * pad, PW = W + 2 * pad;
  float *padded = calloc((size_t)(PH * PW), sizeof(float));
  for (int64_t b = 0; b < B; b++) {
    int64_t dy, dx;
    int flip;
    spec_draw(seed, epoch, samples[b], pad, flip_p, &dy, &dx, &flip);
    ck_assert(dy >= 0 && dy <= 2 * pad && dx >= 0 && dx <= 2 * pad);
    for (int64_t c = 0; c < C; c++) {
      memset(padded, 0, (size_t)(PH * PW) * sizeof(float));
      for (int64_t y = 0; y < H; y++)
        for (int64_t x = 0; x < W; x++) padded[(y + pad) * PW + x + pad] = (float)pix(samples[b], c, y, x) + add;
      for (int64_t y = 0; y < H; y++)
        for (int64_t x = 0; x < W; x++) {
          float want = padded[(dy + y) * PW + dx + (flip ? W - 1 - x : x)];
          float got = o[((b * C + c) * H + y) * W + x];
          ck_assert_msg(got == want, "b %lld c %lld y %lld x %lld (dy %lld dx %lld flip %d): got %g, want %g",
                        (long long)b, (long long)c, (long long)y, (long long)x, (long long)dy, (long long)dx, flip,
                        got, want);
        }
    }
  }
  free(padded);
  dlua_tensor_free(f);
}

START_TEST(test_draw_follows_documented_rule) {
  for (int64_t s = 0; s < 200; s++) {
    int64_t a, b, c, d;
    int f, g;
    dlua_augment_draw(42, 3, s * 7919, 4, 0.5, &a, &b, &f);
    spec_draw(42, 3, s * 7919, 4, 0.5, &c, &d, &g);
    ck_assert(a == c && b == d && f == g);
  }
  // Every offset in [0, 2 pad] occurs, with roughly equal frequency; flips at the asked rate.
  int64_t hist[9] = {0}, flips = 0, n = 9000;
  for (int64_t s = 0; s < n; s++) {
    int64_t dy, dx;
    int flip;
    dlua_augment_draw(7, 1, s, 4, 0.3, &dy, &dx, &flip);
    hist[dy]++;
    hist[dx]++;
    flips += flip;
  }
  for (int k = 0; k < 9; k++) ck_assert_msg(hist[k] > 1700 && hist[k] < 2300, "offset %d drawn %lld times", k, (long long)hist[k]);
  ck_assert_msg(flips > 2500 && flips < 2900, "%lld flips of %lld at p = 0.3", (long long)flips, (long long)n);
  // Different epochs and seeds give different draws for the same sample.
  int differ = 0;
  for (int64_t s = 0; s < 50; s++) {
    int64_t a, b, c, d;
    int f, g;
    dlua_augment_draw(7, 1, s, 4, 0.5, &a, &b, &f);
    dlua_augment_draw(7, 2, s, 4, 0.5, &c, &d, &g);
    differ += a != c || b != d || f != g;
  }
  ck_assert_int_gt(differ, 40);
}
END_TEST

START_TEST(test_crop_flip_against_padded_images) {
  // Prime sizes; pad larger than the image (7 > 5) so whole rows fall outside.
  const int64_t N = 7, C = 3, H = 5, W = 11;
  const int64_t pads[4] = {0, 1, 4, 7};
  const double flips[3] = {0.0, 0.5, 1.0};
  for (int d = 0; d < 2; d++) {
    dlua_dtype_t dt = d ? DLUA_DTYPE_F32 : DLUA_DTYPE_U8;
    dlua_tensor_t *x = images(N, C, H, W, dt);
    for (int p = 0; p < 4; p++)
      for (int f = 0; f < 3; f++) {
        dlua_tensor_t *out = NULL;
        ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, pads[p], flips[f], 1234, 5), DLUA_OK);
        ck_assert_int_eq(dlua_tensor_dtype(out), dt);
        int64_t all[7] = {0, 1, 2, 3, 4, 5, 6};
        check_batch(out, C, H, W, all, N, pads[p], flips[f], 1234, 5, d ? 0.25f : 0.0f);
        dlua_tensor_free(out);
      }
    dlua_tensor_free(x);
  }
}
END_TEST

START_TEST(test_hand_computed_flip_and_shift) {
  // flip_p = 1, pad = 0: exactly the mirror image, by hand for a 1 x 1 x 2 x 3 image.
  int64_t s[4] = {1, 1, 2, 3};
  const uint8_t v[6] = {1, 2, 3, 4, 5, 6};
  dlua_tensor_t *x = NULL, *out = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&x, 4, s, DLUA_DTYPE_U8, v), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, 0, 1.0, 9, 9), DLUA_OK);
  const uint8_t mirror[6] = {3, 2, 1, 6, 5, 4};
  ck_assert(memcmp(dlua_tensor_data(out), mirror, 6) == 0);
  dlua_tensor_free(out);
  out = NULL;
  // pad = 1 without flip: find a seed whose draw is (dy, dx) = (0, 2), i.e. the window starts one
  // row above and one column right of the image: row 0 is padding, row 1 is image row 0 shifted left.
  uint64_t seed = 0;
  for (;; seed++) {
    int64_t dy, dx;
    int fl;
    spec_draw(seed, 0, 0, 1, 0.0, &dy, &dx, &fl);
    if (dy == 0 && dx == 2) break;
  }
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, 1, 0.0, seed, 0), DLUA_OK);
  const uint8_t shifted[6] = {0, 0, 0, 2, 3, 0};
  ck_assert(memcmp(dlua_tensor_data(out), shifted, 6) == 0);
  dlua_tensor_free(out);
  dlua_tensor_free(x);
}
END_TEST

START_TEST(test_gather_by_index_and_views) {
  const int64_t N = 13, C = 2, H = 7, W = 5;
  dlua_tensor_t *x = images(N, C, H, W, DLUA_DTYPE_U8);
  // int32 indices counted from 1 (as Lua passes them), repeats allowed.
  int64_t B = 4, samples[4] = {12, 0, 5, 12};
  int32_t idx1[4] = {13, 1, 6, 13};
  dlua_tensor_t *index = NULL, *out = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&index, 1, &B, DLUA_DTYPE_I32, idx1), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&out, x, index, 1, 2, 0.5, 77, 3), DLUA_OK);
  check_batch(out, C, H, W, samples, B, 2, 0.5, 77, 3, 0);
  // A sample's augmentation depends on its index, not its position in the batch.
  ck_assert(memcmp(dlua_tensor_data(out), (uint8_t *)dlua_tensor_data(out) + 3 * C * H * W, (size_t)(C * H * W)) == 0);
  dlua_tensor_free(out);
  out = NULL;

  // Into a given float32 out: uint8 converts in the same pass.
  int64_t os[4] = {B, C, H, W};
  out = tu_new_t(4, os, DLUA_DTYPE_F32);
  dlua_tensor_t *given = out;
  ck_assert_int_eq(dlua_data_augment(&out, x, index, 1, 2, 0.5, 77, 3), DLUA_OK);
  ck_assert_ptr_eq(out, given);
  check_batch(out, C, H, W, samples, B, 2, 0.5, 77, 3, 0);
  dlua_tensor_free(out);
  out = NULL;

  // A non-contiguous source: x's H and W swapped by a transposed view of a (N, C, W, H) copy.
  dlua_tensor_t *xt = NULL, *xtc = NULL, *back = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&xt, x, 2, 3), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_contiguous(&xtc, xt), DLUA_OK);  // (N, C, W, H) contiguous
  ck_assert_int_eq(dlua_tensor_transpose(&back, xtc, 2, 3), DLUA_OK);  // (N, C, H, W), strided
  ck_assert(!dlua_tensor_is_contiguous(back));
  ck_assert_int_eq(dlua_data_augment(&out, back, index, 1, 3, 0.5, 5, 8), DLUA_OK);
  check_batch(out, C, H, W, samples, B, 3, 0.5, 5, 8, 0);
  dlua_tensor_free(out);
  out = NULL;

  // Empty batch; a single 1 x 1 image.
  int64_t zero = 0;
  dlua_tensor_t *none = NULL, *x1 = images(1, 1, 1, 1, DLUA_DTYPE_U8);
  ck_assert_int_eq(dlua_tensor_empty(&none, 1, &zero, DLUA_DTYPE_I64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&out, x, none, 1, 2, 0.5, 1, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(out), 0);
  ck_assert_int_eq(dlua_tensor_sizes(out)[1], C);
  dlua_tensor_free(out);
  out = NULL;
  ck_assert_int_eq(dlua_data_augment(&out, x1, NULL, 0, 1, 0.5, 3, 3), DLUA_OK);
  int64_t only = 0;
  check_batch(out, 1, 1, 1, &only, 1, 1, 0.5, 3, 3, 0);
  dlua_tensor_free(out);
  dlua_tensor_free(none);
  dlua_tensor_free(x1);
  dlua_tensor_free(xt);
  dlua_tensor_free(xtc);
  dlua_tensor_free(back);
  dlua_tensor_free(index);
  dlua_tensor_free(x);
}
END_TEST

START_TEST(test_thread_count_does_not_change_results) {
  const int64_t N = 911, C = 3, H = 17, W = 19;  // past augment.c's threshold for the parallel loop
  dlua_tensor_t *x = images(N, C, H, W, DLUA_DTYPE_U8), *a = NULL, *b = NULL;
  int before = dlua_get_num_threads();
  ck_assert_int_eq(dlua_set_num_threads(1), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&a, x, NULL, 0, 4, 0.5, 2024, 11), DLUA_OK);
  ck_assert_int_eq(dlua_set_num_threads(4), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&b, x, NULL, 0, 4, 0.5, 2024, 11), DLUA_OK);
  ck_assert_int_eq(dlua_set_num_threads(before), DLUA_OK);
  ck_assert(memcmp(dlua_tensor_data(a), dlua_tensor_data(b), (size_t)(N * C * H * W)) == 0);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(x);
}
END_TEST

START_TEST(test_augment_errors) {
  int64_t s3[3] = {2, 5, 5}, s4[4] = {2, 1, 5, 5};
  dlua_tensor_t *x3 = tu_new_t(3, s3, DLUA_DTYPE_U8), *xi = tu_new_t(4, s4, DLUA_DTYPE_I64), *x = tu_new_t(4, s4, DLUA_DTYPE_U8);
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_data_augment(&out, x3, NULL, 0, 1, 0.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "augment: expected images (N, C, H, W)") &&
                    strstr(dlua_last_error(), "(2, 5, 5) uint8"),
                "%s", dlua_last_error());
  ck_assert_int_eq(dlua_data_augment(&out, xi, NULL, 0, 1, 0.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "int64"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, -1, 0.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "augment: padding must be >= 0, got -1"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, 1, 1.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, 1, NAN, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "flip probability"), "%s", dlua_last_error());
  int64_t two = 2;
  int64_t bad[2] = {1, 3};
  dlua_tensor_t *index = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&index, 1, &two, DLUA_DTYPE_I64, bad), DLUA_OK);
  ck_assert_int_eq(dlua_data_augment(&out, x, index, 1, 1, 0.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "augment: index 3 is out of range") && strstr(dlua_last_error(), "1..2"),
                "%s", dlua_last_error());
  ck_assert_ptr_null(out);
  // A given out of the wrong shape.
  int64_t wrong[4] = {3, 1, 5, 5};
  out = tu_new_t(4, wrong, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_data_augment(&out, x, NULL, 0, 1, 0.5, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "augment: output (3, 1, 5, 5) float32"), "%s", dlua_last_error());
  dlua_tensor_free(out);
  dlua_tensor_free(index);
  dlua_tensor_free(x3);
  dlua_tensor_free(xi);
  dlua_tensor_free(x);
  dlua_clear_error();
}
END_TEST

/* (x * scale - mean[c]) / std[c] in double, against the float32 result. */
static void check_normalized(const dlua_tensor_t *out, const double *ref_in, int64_t N, int64_t C, int64_t inner,
                             double scale, int nstats, const double *mean, const double *std) {
  ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_F32);
  dlua_tensor_t *oc = NULL;
  ck_assert_int_eq(dlua_tensor_contiguous(&oc, out), DLUA_OK);
  const float *o = dlua_tensor_data(oc);
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++)
      for (int64_t j = 0; j < inner; j++) {
        int64_t i = (n * C + c) * inner + j;
        int k = nstats == 1 ? 0 : (int)c;
        double want = (ref_in[i] * scale - mean[k]) / std[k];
        ck_assert_msg(fabs(o[i] - want) <= 1e-6 * (1 + fabs(want)), "element %lld: %g vs %g", (long long)i, o[i], want);
      }
  dlua_tensor_free(oc);
}

START_TEST(test_normalize) {
  const int64_t N = 3, C = 3, H = 5, W = 7, numel = N * C * H * W;
  dlua_tensor_t *x = images(N, C, H, W, DLUA_DTYPE_U8), *out = NULL;
  double *ref = malloc((size_t)numel * sizeof(double));
  for (int64_t i = 0; i < numel; i++) ref[i] = ((const uint8_t *)dlua_tensor_data(x))[i];
  const double mean[3] = {0.485, 0.456, 0.406}, std[3] = {0.229, 0.224, 0.225};
  ck_assert_int_eq(dlua_data_normalize(&out, x, 1.0 / 255, 3, mean, std), DLUA_OK);
  check_normalized(out, ref, N, C, H * W, 1.0 / 255, 3, mean, std);
  // In place on float32: out is x.
  dlua_tensor_t *f = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&f, x, DLUA_DTYPE_F32), DLUA_OK);
  dlua_tensor_t *same = f;
  const double m1 = 0.5, s1 = 2.0;
  ck_assert_int_eq(dlua_data_normalize(&f, f, 1.0, 1, &m1, &s1), DLUA_OK);
  ck_assert_ptr_eq(f, same);
  check_normalized(f, ref, N, C, H * W, 1.0, 1, &m1, &s1);
  dlua_tensor_free(f);
  dlua_tensor_free(out);
  out = NULL;
  // A transposed int64 input (converted first): the view is (N, C, W, H), so the reference is
  // read through the same transposition.
  dlua_tensor_t *xl = NULL, *xt = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&xl, x, DLUA_DTYPE_I64), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&xt, xl, 2, 3), DLUA_OK);
  double *reft = malloc((size_t)numel * sizeof(double));
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++)
      for (int64_t a = 0; a < W; a++)
        for (int64_t b = 0; b < H; b++) reft[((n * C + c) * W + a) * H + b] = ref[((n * C + c) * H + b) * W + a];
  ck_assert_int_eq(dlua_data_normalize(&out, xt, 0.5, 3, mean, std), DLUA_OK);
  check_normalized(out, reft, N, C, H * W, 0.5, 3, mean, std);
  dlua_tensor_free(out);
  out = NULL;
  // Empty batch.
  int64_t es[4] = {0, 3, 2, 2};
  dlua_tensor_t *e = tu_new_t(4, es, DLUA_DTYPE_U8);
  ck_assert_int_eq(dlua_data_normalize(&out, e, 1.0, 3, mean, std), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(out), 0);
  dlua_tensor_free(out);
  out = NULL;
  // Errors: stats count, zero std, 1-D input.
  ck_assert_int_eq(dlua_data_normalize(&out, x, 1.0, 2, mean, std), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "normalize: 2 means/stds for 3 channels of (3, 3, 5, 7) uint8"), "%s",
                dlua_last_error());
  const double zs[3] = {1, 0, 1};
  ck_assert_int_eq(dlua_data_normalize(&out, x, 1.0, 3, mean, zs), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "channel 1"), "%s", dlua_last_error());
  int64_t n5 = 5;
  dlua_tensor_t *v = tu_new_t(1, &n5, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_data_normalize(&out, v, 1.0, 1, mean, std), DLUA_ERR_ARG);
  ck_assert_ptr_null(out);
  dlua_tensor_free(v);
  dlua_tensor_free(e);
  dlua_tensor_free(xl);
  dlua_tensor_free(xt);
  dlua_tensor_free(x);
  free(ref);
  free(reft);
  dlua_clear_error();
}
END_TEST

int main(void) {
  Suite *s = suite_create("augment");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_draw_follows_documented_rule);
  tcase_add_test(tc, test_crop_flip_against_padded_images);
  tcase_add_test(tc, test_hand_computed_flip_and_shift);
  tcase_add_test(tc, test_gather_by_index_and_views);
  tcase_add_test(tc, test_thread_count_does_not_change_results);
  tcase_add_test(tc, test_augment_errors);
  tcase_add_test(tc, test_normalize);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

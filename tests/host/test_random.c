/* Check suite for host/ops/random.c and host/cpu/random.c: Philox known answers, the element-to-counter rule, thread independence, distributions. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/random.h"
#include "ops/backend.h"

#include "testutil.h"

/* The word element i reads for draw d, per the documented rule (kernels/philox.h). */
static uint32_t word(uint64_t seed, uint64_t offset, int64_t i, uint32_t d) {
  uint64_t c = offset + (uint64_t)i / 4;
  uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), d, 0}, key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, out[4];
  dlua_philox4x32_10(ctr, key, out);
  return out[i % 4];
}

/* Random123's kat_vectors for philox4x32 10: counter, key, expected output. */
START_TEST(test_philox_known_answers) {
  const uint32_t kat[3][10] = {
      {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
      {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
       0x6d5451fd},
      {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
       0x24126ea1},
  };
  for (int v = 0; v < 3; v++) {
    uint32_t out[4];
    dlua_philox4x32_10(kat[v], kat[v] + 4, out);
    for (int k = 0; k < 4; k++) ck_assert_msg(out[k] == kat[v][6 + k], "vector %d word %d: %08x", v, k, out[k]);
  }
}
END_TEST

START_TEST(test_generator_state) {
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 1234), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_seed(g), 1234);
  ck_assert_uint_eq(dlua_generator_offset(g), 0);
  int64_t n = 10;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_uniform_(t, 0, 1, g), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_offset(g), 3);  // ceil(10 / 4) blocks
  ck_assert_int_eq(dlua_tensor_normal_(t, 0, 1, g), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_offset(g), 6);
  dlua_generator_set_offset(g, 100);
  ck_assert_uint_eq(dlua_generator_offset(g), 100);
  dlua_generator_manual_seed(g, 99);
  ck_assert_uint_eq(dlua_generator_seed(g), 99);
  ck_assert_uint_eq(dlua_generator_offset(g), 0);
  // The default generator is one object, and NULL means it.
  dlua_generator_t *d = dlua_generator_default();
  ck_assert_ptr_eq(d, dlua_generator_default());
  dlua_generator_manual_seed(d, 7);
  ck_assert_int_eq(dlua_tensor_uniform_(t, 0, 1, NULL), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_offset(d), 3);
  dlua_generator_free(d);  // ignored: the default is not the caller's to free
  ck_assert_uint_eq(dlua_generator_seed(dlua_generator_default()), 7);
  dlua_generator_free(NULL);
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

/* Element i is lane i % 4 of block offset + i / 4: checked against the raw Philox. */
START_TEST(test_counter_rule_uniform) {
  const uint64_t seed = 0x0123456789abcdefull;
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, seed), DLUA_OK);
  dlua_generator_set_offset(g, 0xfffffffeull);  // crosses into the counter's high word
  int64_t n = 23;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F64);
  ck_assert_int_eq(dlua_tensor_uniform_(t, -3, 5, g), DLUA_OK);
  const double *v = dlua_tensor_data(t);
  for (int64_t i = 0; i < n; i++)
    ck_assert_double_eq(v[i], -3 + 8 * (word(seed, 0xfffffffeull, i, 0) / 4294967296.0));
  // float32 uses the top 24 bits.
  dlua_tensor_t *f = tu_new_t(1, &n, DLUA_DTYPE_F32);
  dlua_generator_set_offset(g, 40);
  ck_assert_int_eq(dlua_tensor_uniform_(f, 0, 1, g), DLUA_OK);
  for (int64_t i = 0; i < n; i++)
    ck_assert_float_eq(((float *)dlua_tensor_data(f))[i], (float)((word(seed, 40, i, 0) >> 8) / 16777216.0));
  dlua_tensor_free(f);
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

/* Normal pairing: lanes (0, 1) and (2, 3) of a block are one Box-Muller pair each. */
START_TEST(test_counter_rule_normal) {
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 42), DLUA_OK);
  int64_t n = 9;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F64);
  ck_assert_int_eq(dlua_tensor_normal_(t, 1, 2, g), DLUA_OK);
  const double *v = dlua_tensor_data(t);
  for (int64_t i = 0; i < n; i++) {
    int64_t first = i - i % 2;
    double u1 = (word(42, 0, first, 0) + 1.0) / 4294967296.0, u2 = word(42, 0, first + 1, 0) / 4294967296.0;
    double r = sqrt(-2 * log(u1)), th = 2 * M_PI * u2;
    double z = i % 2 == 0 ? r * cos(th) : r * sin(th);
    ck_assert_double_eq_tol(v[i], 1 + 2 * z, 1e-12);
  }
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

/* A checkpoint restores the offset: the continuation equals the tail of one long fill. */
START_TEST(test_offset_resume) {
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 5), DLUA_OK);
  int64_t n = 100, m = 80;
  dlua_tensor_t *all = tu_new_t(1, &n, DLUA_DTYPE_F32), *tail = tu_new_t(1, &m, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_normal_(all, 0, 1, g), DLUA_OK);
  dlua_generator_set_offset(g, 5);
  ck_assert_int_eq(dlua_tensor_normal_(tail, 0, 1, g), DLUA_OK);
  ck_assert_mem_eq((float *)dlua_tensor_data(all) + 20, dlua_tensor_data(tail), 80 * sizeof(float));
  // Two generators with one seed agree; another seed differs.
  dlua_generator_t *h = NULL;
  ck_assert_int_eq(dlua_generator_new(&h, 5), DLUA_OK);
  dlua_tensor_t *again = tu_new_t(1, &n, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_normal_(again, 0, 1, h), DLUA_OK);
  ck_assert_mem_eq(dlua_tensor_data(all), dlua_tensor_data(again), 100 * sizeof(float));
  dlua_generator_manual_seed(h, 6);
  ck_assert_int_eq(dlua_tensor_normal_(again, 0, 1, h), DLUA_OK);
  ck_assert(memcmp(dlua_tensor_data(all), dlua_tensor_data(again), 100 * sizeof(float)) != 0);
  dlua_tensor_free(again);
  dlua_tensor_free(all);
  dlua_tensor_free(tail);
  dlua_generator_free(h);
  dlua_generator_free(g);
}
END_TEST

typedef dlua_status_t (*fill_fn)(dlua_tensor_t *t, dlua_generator_t *g);
static dlua_status_t f_uniform(dlua_tensor_t *t, dlua_generator_t *g) { return dlua_tensor_uniform_(t, -1, 2, g); }
static dlua_status_t f_normal(dlua_tensor_t *t, dlua_generator_t *g) { return dlua_tensor_normal_(t, 0.5, 3, g); }
static dlua_status_t f_randint(dlua_tensor_t *t, dlua_generator_t *g) { return dlua_tensor_randint_(t, 0, 100, g); }
static dlua_status_t f_bernoulli(dlua_tensor_t *t, dlua_generator_t *g) { return dlua_tensor_bernoulli_(t, 0.3, g); }

/* Same bits with 1 and 4 threads, for every fill, dtype and a non-contiguous target. */
START_TEST(test_thread_count_independent) {
  fill_fn fills[] = {f_uniform, f_normal, f_randint, f_bernoulli};
  const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                              DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8,  DLUA_DTYPE_BOOL};
  int64_t sizes[] = {211, 97};  // 20467 elements: several work chunks, not a multiple of 4
  for (int fi = 0; fi < 4; fi++) {
    for (int di = 0; di < 8; di++) {
      if (fi < 2 && !dlua_dtype_is_floating(dts[di])) continue;
      if (fi == 2 && dts[di] == DLUA_DTYPE_BOOL) continue;
      dlua_tensor_t *r[2];
      for (int k = 0; k < 2; k++) {
        omp_set_num_threads(k == 0 ? 1 : 4);
        dlua_generator_t *g = NULL;
        ck_assert_int_eq(dlua_generator_new(&g, 2024), DLUA_OK);
        r[k] = tu_new_t(2, sizes, dts[di]);
        ck_assert_int_eq(fills[fi](r[k], g), DLUA_OK);
        dlua_generator_free(g);
      }
      ck_assert_msg(!memcmp(dlua_tensor_data(r[0]), dlua_tensor_data(r[1]), 211 * 97 * dlua_dtype_size(dts[di])),
                    "fill %d dtype %s differs between 1 and 4 threads", fi, dlua_dtype_name(dts[di]));
      // The same fill into a transposed view gives the same row-major sequence.
      int64_t ts[] = {97, 211};
      dlua_tensor_t *base = tu_new_t(2, ts, dts[di]), *tr = NULL, *c = NULL;
      ck_assert_int_eq(dlua_tensor_transpose(&tr, base, 0, 1), DLUA_OK);
      dlua_generator_t *g = NULL;
      ck_assert_int_eq(dlua_generator_new(&g, 2024), DLUA_OK);
      ck_assert_int_eq(fills[fi](tr, g), DLUA_OK);
      ck_assert_int_eq(dlua_tensor_contiguous(&c, tr), DLUA_OK);
      ck_assert(!memcmp(dlua_tensor_data(c), dlua_tensor_data(r[0]), 211 * 97 * dlua_dtype_size(dts[di])));
      dlua_generator_free(g);
      dlua_tensor_free(c);
      dlua_tensor_free(tr);
      dlua_tensor_free(base);
      dlua_tensor_free(r[0]);
      dlua_tensor_free(r[1]);
    }
  }
  omp_set_num_threads(2);
}
END_TEST

static void moments(const double *v, int64_t n, double *mean, double *var) {
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < n; i++) s += v[i];
  *mean = s / (double)n;
  for (int64_t i = 0; i < n; i++) s2 += (v[i] - *mean) * (v[i] - *mean);
  *var = s2 / (double)(n - 1);
}

START_TEST(test_uniform_distribution) {
  int64_t n = 200003;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F32);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 11), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_uniform_(t, 2, 5, g), DLUA_OK);
  double *v = tu_values(t), mean, var;
  for (int64_t i = 0; i < n; i++) ck_assert(v[i] >= 2 && v[i] < 5);
  moments(v, n, &mean, &var);
  // Mean 3.5, variance 9/12; five standard errors.
  ck_assert_double_le(fabs(mean - 3.5), 5 * sqrt(0.75 / (double)n));
  ck_assert_double_le(fabs(var - 0.75), 5 * 0.75 * sqrt(0.8 / (double)n));
  // Ten equal bins, each near n/10.
  int64_t bins[10] = {0};
  for (int64_t i = 0; i < n; i++) bins[(int)((v[i] - 2) / 0.3)]++;
  for (int b = 0; b < 10; b++) ck_assert_int_le(llabs(bins[b] - n / 10), 5 * (int64_t)sqrt(n * 0.09));
  free(v);
  // bf16 and f16 fills stay in range too (through float32).
  ck_assert_int_eq(dlua_tensor_uniform_(t, 0, 0, g), DLUA_OK);  // empty range: all low
  ck_assert_float_eq(((float *)dlua_tensor_data(t))[17], 0);
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

START_TEST(test_normal_distribution) {
  int64_t n = 200000;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F64);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 12), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_normal_(t, -2, 0.5, g), DLUA_OK);
  double *v = tu_values(t), mean, var;
  moments(v, n, &mean, &var);
  ck_assert_double_le(fabs(mean + 2), 5 * 0.5 / sqrt((double)n));
  ck_assert_double_le(fabs(var - 0.25), 5 * 0.25 * sqrt(2.0 / (double)n));
  int64_t within1 = 0, within2 = 0;
  for (int64_t i = 0; i < n; i++) {
    within1 += fabs(v[i] + 2) < 0.5;
    within2 += fabs(v[i] + 2) < 1.0;
  }
  ck_assert_double_le(fabs((double)within1 / (double)n - 0.682689), 0.005);
  ck_assert_double_le(fabs((double)within2 / (double)n - 0.954500), 0.003);
  free(v);
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

START_TEST(test_randint) {
  int64_t n = 70001;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_I32);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 13), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_randint_(t, -3, 4, g), DLUA_OK);  // 7 values
  const int32_t *p = dlua_tensor_data(t);
  int64_t bins[7] = {0};
  for (int64_t i = 0; i < n; i++) {
    ck_assert(p[i] >= -3 && p[i] < 4);
    bins[p[i] + 3]++;
  }
  for (int b = 0; b < 7; b++) ck_assert_int_le(llabs(bins[b] - n / 7), 5 * (int64_t)sqrt(n / 7.0));
  dlua_tensor_free(t);

  // A range of 3 * 2^30 rejects every word below 2^30 (a quarter); check each element
  // against the documented redraw rule computed here from the raw Philox.
  int64_t m = 1001;
  dlua_tensor_t *w = tu_new_t(1, &m, DLUA_DTYPE_I64);
  const uint64_t range = 3ull << 30;
  dlua_generator_manual_seed(g, 77);
  ck_assert_int_eq(dlua_tensor_randint_(w, 10, 10 + (int64_t)range, g), DLUA_OK);
  int redraws = 0;
  for (int64_t i = 0; i < m; i++) {
    uint32_t x = word(77, 0, i, 0);
    for (uint32_t d = 1; x < (1u << 30); d++, redraws++) x = word(77, 0, i, d);
    ck_assert_int_eq(((int64_t *)dlua_tensor_data(w))[i], 10 + (int64_t)(x % range));
  }
  ck_assert_int_gt(redraws, 150);  // about 250 expected: the rule really was exercised
  // Above 2^32: 64-bit candidates from two words.
  const uint64_t big = 1000000000007ull;
  dlua_generator_manual_seed(g, 78);
  ck_assert_int_eq(dlua_tensor_randint_(w, 0, (int64_t)big, g), DLUA_OK);
  for (int64_t i = 0; i < m; i++) {
    uint64_t x = ((uint64_t)word(78, 0, i, 0) << 32) | word(78, 0, i, 1);
    for (uint32_t d = 2; x < (0 - big) % big; d += 2) x = ((uint64_t)word(78, 0, i, d) << 32) | word(78, 0, i, d + 1);
    ck_assert_int_eq(((int64_t *)dlua_tensor_data(w))[i], (int64_t)(x % big));
  }
  dlua_tensor_free(w);

  int64_t five = 5;
  dlua_tensor_t *u = tu_new_t(1, &five, DLUA_DTYPE_U8);
  ck_assert_int_eq(dlua_tensor_randint_(u, 0, 256, g), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_randint_(u, 0, 257, g), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "randint_: [0, 257) does not fit uint8"));
  ck_assert_int_eq(dlua_tensor_randint_(u, 3, 3, g), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "randint_: expected low < high"));
  dlua_tensor_free(u);
  dlua_generator_free(g);
}
END_TEST

START_TEST(test_bernoulli) {
  int64_t n = 100000;
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_BOOL);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 14), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_bernoulli_(t, 0.3, g), DLUA_OK);
  int64_t ones = 0;
  for (int64_t i = 0; i < n; i++) {
    uint8_t b = ((uint8_t *)dlua_tensor_data(t))[i];
    ck_assert(b <= 1);
    ones += b;
  }
  ck_assert_int_le(llabs(ones - 30000), 5 * (int64_t)sqrt(n * 0.21));
  ck_assert_int_eq(dlua_tensor_bernoulli_(t, 0, g), DLUA_OK);
  for (int64_t i = 0; i < n; i++) ck_assert_uint_eq(((uint8_t *)dlua_tensor_data(t))[i], 0);
  ck_assert_int_eq(dlua_tensor_bernoulli_(t, 1, g), DLUA_OK);
  for (int64_t i = 0; i < n; i++) ck_assert_uint_eq(((uint8_t *)dlua_tensor_data(t))[i], 1);
  ck_assert_int_eq(dlua_tensor_bernoulli_(t, 1.5, g), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_tensor_bernoulli_(t, NAN, g), DLUA_ERR_ARG);
  dlua_tensor_free(t);
  dlua_generator_free(g);
}
END_TEST

static void assert_permutation(const dlua_tensor_t *t, int64_t n, int64_t base) {
  ck_assert_int_eq(dlua_tensor_numel(t), n);
  double *v = tu_values(t);
  char *seen = calloc((size_t)(n ? n : 1), 1);
  for (int64_t i = 0; i < n; i++) {
    int64_t k = (int64_t)v[i] - base;
    ck_assert(k >= 0 && k < n && !seen[k]);
    seen[k] = 1;
  }
  free(seen);
  free(v);
}

START_TEST(test_randperm) {
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 15), DLUA_OK);
  const int64_t ns[] = {0, 1, 2, 17, 100003};
  for (int k = 0; k < 5; k++) {
    dlua_tensor_t *t = NULL;
    uint64_t before = dlua_generator_offset(g);
    ck_assert_int_eq(dlua_tensor_randperm(&t, ns[k], 1, DLUA_DTYPE_I64, g), DLUA_OK);
    ck_assert_uint_eq(dlua_generator_offset(g) - before, (uint64_t)(ns[k] + 3) / 4);
    assert_permutation(t, ns[k], 1);
    dlua_tensor_free(t);
  }
  dlua_tensor_t *a = NULL, *b = NULL;
  ck_assert_int_eq(dlua_tensor_randperm(&a, 1000, 0, DLUA_DTYPE_I32, g), DLUA_OK);
  assert_permutation(a, 1000, 0);
  ck_assert_int_eq(dlua_tensor_randperm(&b, 1000, 0, DLUA_DTYPE_I32, g), DLUA_OK);
  ck_assert(memcmp(dlua_tensor_data(a), dlua_tensor_data(b), 4000) != 0);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  // Every permutation of 3 about equally often.
  int64_t counts[6] = {0};
  const int trials = 6000;
  for (int i = 0; i < trials; i++) {
    dlua_tensor_t *t = NULL;
    ck_assert_int_eq(dlua_tensor_randperm(&t, 3, 0, DLUA_DTYPE_U8, g), DLUA_OK);
    const uint8_t *p = dlua_tensor_data(t);
    counts[p[0] * 2 + (p[1] > p[2])]++;
    dlua_tensor_free(t);
  }
  for (int k = 0; k < 6; k++) ck_assert_int_le(llabs(counts[k] - trials / 6), 5 * 29);
  ck_assert_int_eq(dlua_tensor_randperm(&a, 300, 0, DLUA_DTYPE_U8, g), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "randperm: 0..299 cannot be held exactly by uint8"));
  ck_assert_int_eq(dlua_tensor_randperm(&a, -1, 0, DLUA_DTYPE_I64, g), DLUA_ERR_ARG);
  dlua_generator_free(g);
}
END_TEST

START_TEST(test_bad_fills) {
  int64_t n = 4;
  dlua_tensor_t *i = tu_new_t(1, &n, DLUA_DTYPE_I32), *f = tu_new_t(1, &n, DLUA_DTYPE_F16);
  ck_assert_int_eq(dlua_tensor_uniform_(i, 0, 1, NULL), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "uniform_: expected a floating-point tensor, got (4) int32 cpu"));
  ck_assert_int_eq(dlua_tensor_normal_(i, 0, 1, NULL), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_tensor_uniform_(f, 2, 1, NULL), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "uniform_: expected finite low <= high"));
  ck_assert_int_eq(dlua_tensor_normal_(f, 0, -1, NULL), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_tensor_uniform_(NULL, 0, 1, NULL), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "uniform_: the tensor is NULL"));
  // Zero elements: fine, and no blocks consumed.
  int64_t z = 0;
  dlua_tensor_t *e = tu_new_t(1, &z, DLUA_DTYPE_F32);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_normal_(e, 0, 1, g), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_offset(g), 0);
  dlua_generator_free(g);
  dlua_tensor_free(e);
  dlua_tensor_free(i);
  dlua_tensor_free(f);
}
END_TEST

/* The fills reach their kernels through the backend table: the CPU's random family is dlua_cpu_random_ops, its
   fill slot called with the generator's (seed, offset) gives uniform_'s bits, and a fill on device 0 without a
   CUDA device gets the registry's one message. */
START_TEST(test_random_table) {
  const struct dlua_random_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("uniform_", DLUA_CPU, random, fill, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_random_ops);
  ck_assert(k->fill && k->randperm);
  int64_t n = 4099;  // not a multiple of 4: the last block is short
  dlua_tensor_t *t = tu_new_t(1, &n, DLUA_DTYPE_F64);
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 0x1234567890abcdefull), DLUA_OK);
  dlua_generator_set_offset(g, 77);
  ck_assert_int_eq(dlua_tensor_uniform_(t, -1, 2, g), DLUA_OK);
  double *direct = malloc((size_t)n * sizeof(double));
  dlua_random_fill_t f = {.kind = DLUA_RANDOM_UNIFORM, .a = -1, .b = 2, .wide = 1,
                          .key = {0x90abcdefu, 0x12345678u}, .base = 77, .dtype = DLUA_DTYPE_F64, .dst = direct,
                          .n = n, .device = DLUA_CPU};
  ck_assert_int_eq(k->fill("uniform_", &f), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), direct, (size_t)n * sizeof(double)), 0);
  free(direct);

  const struct dlua_random_ops *kc = NULL;
  dlua_status_t st = DLUA_BACKEND("normal_", 0, random, fill, &kc);
  if (dlua_cuda_device_count() > 0) {
    ck_assert_int_eq(st, DLUA_OK);
    ck_assert(kc != &dlua_cpu_random_ops && kc->fill);
  } else {
    ck_assert_int_eq(st, DLUA_ERR_ARG);
    ck_assert_ptr_null(kc);
    // The fill asks the table before it reserves blocks or stages anything: a CPU tensor relabelled as device 0
    // (never written) is enough to see the message, and the generator does not move.
    uint64_t before = dlua_generator_offset(g);
    t->device = 0;
    tu_expect_error(dlua_tensor_normal_(t, 0, 1, g), "normal_: no CUDA device available (");
    t->device = DLUA_CPU;
    ck_assert_uint_eq(dlua_generator_offset(g), before);
  }
  dlua_generator_free(g);
  dlua_tensor_free(t);
}
END_TEST

int main(void) {
  Suite *s = suite_create("random");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_philox_known_answers);
  tcase_add_test(tc, test_generator_state);
  tcase_add_test(tc, test_counter_rule_uniform);
  tcase_add_test(tc, test_counter_rule_normal);
  tcase_add_test(tc, test_offset_resume);
  tcase_add_test(tc, test_thread_count_independent);
  tcase_add_test(tc, test_uniform_distribution);
  tcase_add_test(tc, test_normal_distribution);
  tcase_add_test(tc, test_randint);
  tcase_add_test(tc, test_bernoulli);
  tcase_add_test(tc, test_randperm);
  tcase_add_test(tc, test_bad_fills);
  tcase_add_test(tc, test_random_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/ops/index.c and host/cpu/index.c: index_select, gather, scatter_add_, cat, stack, one_hot, the index table. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/index.h"
#include "ops/backend.h"
#include "ops/index.h"

#include "testutil.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static int64_t irand(int64_t n) { return (int64_t)((tu_xorshift(&rng_state) + 1.0) / 2.0 * (double)n) % (n ? n : 1); }

/* Small integers stored exactly in every dtype (bool: 0/1). */
static dlua_tensor_t *make_rand(int nd, const int64_t *sizes, dlua_dtype_t dtype) {
  int64_t n = dlua_shape_numel(nd, sizes);
  double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) v[i] = dtype == DLUA_DTYPE_BOOL ? (double)irand(2) : (double)irand(200) - (dtype == DLUA_DTYPE_U8 ? 0 : 100);
  dlua_tensor_t *t = tu_make(nd, sizes, dtype, v);
  free(v);
  return t;
}

static dlua_tensor_t *make_index(int nd, const int64_t *sizes, dlua_dtype_t dtype, int64_t lo, int64_t span) {
  int64_t n = dlua_shape_numel(nd, sizes);
  double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) v[i] = (double)(lo + irand(span));
  dlua_tensor_t *t = tu_make(nd, sizes, dtype, v);
  free(v);
  return t;
}

static void expect_values(const dlua_tensor_t *t, const double *want, int64_t n, const char *what) {
  ck_assert_int_eq(dlua_tensor_numel(t), n);
  double *got = tu_values(t);
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(got[i] == want[i], "%s: element %lld is %g, expected %g", what, (long long)i, got[i], want[i]);
  free(got);
}

static const dlua_dtype_t all_dtypes[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                          DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8, DLUA_DTYPE_BOOL};

/* ---- index_select ------------------------------------------------------------------------------ */

/* index_select of a 3-D tensor against a loop over its values. */
static void check_index_select(const dlua_tensor_t *a, int dim, const dlua_tensor_t *index, int64_t base,
                               const char *what) {
  const int64_t *s = dlua_tensor_sizes(a);
  int64_t n = dlua_tensor_numel(index);
  double *av = tu_values(a), *iv = tu_values(index);
  int64_t os[3] = {s[0], s[1], s[2]};
  os[dim] = n;
  double *want = malloc(sizeof(double) * (size_t)(os[0] * os[1] * os[2] + 1));
  for (int64_t i = 0; i < os[0]; i++)
    for (int64_t j = 0; j < os[1]; j++)
      for (int64_t k = 0; k < os[2]; k++) {
        int64_t c[3] = {i, j, k};
        c[dim] = (int64_t)iv[c[dim]] - base;
        want[(i * os[1] + j) * os[2] + k] = av[(c[0] * s[1] + c[1]) * s[2] + c[2]];
      }
  dlua_tensor_t *out = NULL;
  ck_assert_msg(dlua_tensor_index_select(&out, a, dim, index, base) == DLUA_OK, "%s: %s", what, dlua_last_error());
  ck_assert_int_eq(dlua_tensor_dtype(out), dlua_tensor_dtype(a));
  for (int d = 0; d < 3; d++) ck_assert_int_eq(dlua_tensor_sizes(out)[d], os[d]);
  expect_values(out, want, os[0] * os[1] * os[2], what);
  free(av);
  free(iv);
  free(want);
  dlua_tensor_free(out);
}

START_TEST(test_index_select) {
  int64_t s[3] = {5, 7, 3}, sn[1] = {11};
  for (size_t d = 0; d < sizeof all_dtypes / sizeof all_dtypes[0]; d++) {
    dlua_tensor_t *a = make_rand(3, s, all_dtypes[d]);
    const char *nm = dlua_dtype_name(all_dtypes[d]);
    for (int dim = 0; dim < 3; dim++) {
      dlua_tensor_t *i64 = make_index(1, sn, DLUA_DTYPE_I64, 0, s[dim]);
      dlua_tensor_t *i32 = make_index(1, sn, DLUA_DTYPE_I32, 1, s[dim]);
      check_index_select(a, dim, i64, 0, nm);
      check_index_select(a, dim, i32, 1, nm);
      dlua_tensor_free(i64);
      dlua_tensor_free(i32);
    }
    dlua_tensor_free(a);
  }
  // Non-contiguous input (permuted) and index (every other element of a longer one).
  int64_t s0[3] = {3, 5, 7}, sl[1] = {22};
  int perm[3] = {1, 2, 0};
  dlua_tensor_t *a0 = make_rand(3, s0, DLUA_DTYPE_F32), *ap = NULL;
  ck_assert_int_eq(dlua_tensor_permute(&ap, a0, perm), DLUA_OK);  // (5, 7, 3), strided
  dlua_tensor_t *il = make_index(1, sl, DLUA_DTYPE_I32, 0, 3), *is = NULL;
  ck_assert_int_eq(dlua_tensor_slice(&is, il, 0, 0, 22, 2), DLUA_OK);
  check_index_select(ap, 2, is, 0, "permuted input, strided index");
  check_index_select(ap, 0, is, 0, "permuted input, dim 0");
  // Empty index, size-1 index.
  int64_t s00[1] = {0}, s1[1] = {1};
  dlua_tensor_t *ie = make_index(1, s00, DLUA_DTYPE_I64, 0, 1), *i1 = make_index(1, s1, DLUA_DTYPE_I64, 4, 1);
  check_index_select(ap, 1, ie, 0, "empty index");
  check_index_select(ap, 0, i1, 0, "one index");
  // Three inner dims that do not merge: a reversed 4-D tensor selected along dim 0.
  int rev[4] = {3, 2, 1, 0};
  dlua_tensor_t *q0 = make_rand(4, (int64_t[]){2, 3, 4, 5}, DLUA_DTYPE_I64), *q = NULL;
  ck_assert_int_eq(dlua_tensor_permute(&q, q0, rev), DLUA_OK);  // (5, 4, 3, 2)
  double qi[3] = {4, 0, 2}, *qv = tu_values(q), want[3 * 24];
  dlua_tensor_t *qix = tu_make(1, (int64_t[]){3}, DLUA_DTYPE_I64, qi), *qo = NULL;
  for (int r = 0; r < 3; r++) memcpy(want + r * 24, qv + (int64_t)qi[r] * 24, sizeof(double) * 24);
  ck_assert_int_eq(dlua_tensor_index_select(&qo, q, 0, qix, 0), DLUA_OK);
  expect_values(qo, want, 72, "reversed 4-D");
  free(qv);
  dlua_tensor_t *ts[] = {a0, ap, il, is, ie, i1, q0, q, qix, qo};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_index_select_errors) {
  int64_t s[2] = {5, 3}, si[1] = {3};
  dlua_tensor_t *a = make_rand(2, s, DLUA_DTYPE_F32), *out = NULL;
  double bad0[3] = {0, 5, 1}, bad1[3] = {1, 0, 2}, neg[3] = {-1, 0, 0};
  dlua_tensor_t *b0 = tu_make(1, si, DLUA_DTYPE_I64, bad0), *b1 = tu_make(1, si, DLUA_DTYPE_I32, bad1);
  dlua_tensor_t *bn = tu_make(1, si, DLUA_DTYPE_I64, neg), *fi = tu_make(1, si, DLUA_DTYPE_F32, bad1);
  tu_expect_error(dlua_tensor_index_select(&out, a, 0, b0, 0), "index_select: index 5 is out of range for dimension 0 of size 5 (valid: 0..4)");
  ck_assert_ptr_null(out);
  tu_expect_error(dlua_tensor_index_select(&out, a, 0, b1, 1), "index_select: index 0 is out of range for dimension 1 of size 5 (valid: 1..5)");
  tu_expect_error(dlua_tensor_index_select(&out, a, 1, bn, 0), "index -1 is out of range");
  tu_expect_error(dlua_tensor_index_select(&out, a, 0, fi, 0), "index_select: index must be int32 or int64");
  tu_expect_error(dlua_tensor_index_select(&out, a, 2, b0, 0), "index_select: dimension 2 is out of range");
  dlua_tensor_t *ts[] = {a, b0, b1, bn, fi};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

/* ---- gather and scatter_add_ ---------------------------------------------------------------------- */

START_TEST(test_gather) {
  int64_t s[3] = {3, 5, 7};
  for (size_t d = 0; d < sizeof all_dtypes / sizeof all_dtypes[0]; d++) {
    dlua_tensor_t *a = make_rand(3, s, all_dtypes[d]);
    double *av = tu_values(a);
    for (int dim = 0; dim < 3; dim++) {
      // Index smaller than a in the other dims, any size along dim.
      int64_t is[3] = {2, 4, 6};
      is[dim] = 9;
      for (int b = 0; b < 2; b++) {
        dlua_tensor_t *idx = make_index(3, is, b ? DLUA_DTYPE_I32 : DLUA_DTYPE_I64, b, s[dim]);
        double *iv = tu_values(idx);
        int64_t n = is[0] * is[1] * is[2];
        double *want = malloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < is[0]; i++)
          for (int64_t j = 0; j < is[1]; j++)
            for (int64_t k = 0; k < is[2]; k++) {
              int64_t e = (i * is[1] + j) * is[2] + k, c[3] = {i, j, k};
              c[dim] = (int64_t)iv[e] - b;
              want[e] = av[(c[0] * s[1] + c[1]) * s[2] + c[2]];
            }
        dlua_tensor_t *out = NULL;
        ck_assert_int_eq(dlua_tensor_gather(&out, a, dim, idx, b), DLUA_OK);
        for (int q = 0; q < 3; q++) ck_assert_int_eq(dlua_tensor_sizes(out)[q], is[q]);
        expect_values(out, want, n, dlua_dtype_name(all_dtypes[d]));
        free(iv);
        free(want);
        dlua_tensor_free(out);
        dlua_tensor_free(idx);
      }
    }
    free(av);
    dlua_tensor_free(a);
  }
}
END_TEST

START_TEST(test_gather_strided_and_errors) {
  // (4, 6) gathered along dim 1 with a transposed (4, 3) index; cross-entropy's pattern.
  int64_t s[2] = {4, 6}, st[2] = {3, 4};
  dlua_tensor_t *a0 = make_rand(2, (int64_t[]){6, 4}, DLUA_DTYPE_F32), *a = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&a, a0, 0, 1), DLUA_OK);  // (4, 6) strided
  dlua_tensor_t *i0 = make_index(2, st, DLUA_DTYPE_I64, 1, 6), *it = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&it, i0, 0, 1), DLUA_OK);  // (4, 3) strided
  double *av = tu_values(a), *iv = tu_values(it), want[12];
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) want[i * 3 + j] = av[i * 6 + (int64_t)iv[i * 3 + j] - 1];
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_tensor_gather(&out, a, 1, it, 1), DLUA_OK);
  expect_values(out, want, 12, "strided gather");
  dlua_tensor_free(out);
  out = NULL;
  // Errors: out of range (named as the caller counts), wrong ndim, index larger than input.
  double bad[3] = {1, 7, 2};
  dlua_tensor_t *b = tu_make(2, (int64_t[]){1, 3}, DLUA_DTYPE_I64, bad);
  tu_expect_error(dlua_tensor_gather(&out, a, 1, b, 1), "gather: index 7 is out of range for dimension 2 of size 6 (valid: 1..6)");
  dlua_tensor_t *b1 = tu_make(1, (int64_t[]){3}, DLUA_DTYPE_I64, bad);
  tu_expect_error(dlua_tensor_gather(&out, a, 1, b1, 1), "same number of dimensions");
  dlua_tensor_t *big = make_index(2, (int64_t[]){5, 2}, DLUA_DTYPE_I64, 0, 6);
  tu_expect_error(dlua_tensor_gather(&out, a, 1, big, 0), "larger than input");
  ck_assert_ptr_null(out);
  (void)s;
  free(av);
  free(iv);
  dlua_tensor_t *ts[] = {a0, a, i0, it, b, b1, big};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_scatter_add_known) {
  // Repeated indices accumulate: t[idx[i]] += src[i].
  double idx[6] = {1, 3, 1, 5, 1, 3}, src[6] = {1, 2, 3, 4, 5, 6}, want[5] = {9, 0, 8, 0, 4};
  int64_t s6[1] = {6}, s5[1] = {5};
  static const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                     DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8};
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    dlua_tensor_t *t = tu_make(1, s5, dts[d], NULL), *i = tu_make(1, s6, DLUA_DTYPE_I32, idx), *sr = tu_make(1, s6, dts[d], src);
    ck_assert_int_eq(dlua_tensor_fill_(t, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_scatter_add_(t, 0, i, sr, 1), DLUA_OK);
    expect_values(t, want, 5, dlua_dtype_name(dts[d]));
    dlua_tensor_free(t);
    dlua_tensor_free(i);
    dlua_tensor_free(sr);
  }
  // Bool cannot be added into; out of range; src smaller than index.
  dlua_tensor_t *tb = tu_make(1, s5, DLUA_DTYPE_BOOL, NULL), *i = tu_make(1, s6, DLUA_DTYPE_I64, idx), *sr = tu_make(1, s6, DLUA_DTYPE_F32, src);
  tu_expect_error(dlua_tensor_scatter_add_(tb, 0, i, sr, 1), "scatter_add_: cannot add into");
  dlua_tensor_t *t = tu_make(1, s5, DLUA_DTYPE_F32, NULL);
  tu_expect_error(dlua_tensor_scatter_add_(t, 0, i, sr, 0), "scatter_add_: index 5 is out of range for dimension 0 of size 5 (valid: 0..4)");
  dlua_tensor_t *small = tu_make(1, s5, DLUA_DTYPE_F32, src);
  tu_expect_error(dlua_tensor_scatter_add_(t, 0, i, small, 1), "scatter_add_: index (6) int64 cpu is larger than src");
  dlua_tensor_t *ts[] = {tb, i, sr, t, small};
  for (size_t q = 0; q < sizeof ts / sizeof ts[0]; q++) dlua_tensor_free(ts[q]);
}
END_TEST

/* scatter_add_ into 3-D t along dim, against a double loop; t may be a non-contiguous view. */
static void check_scatter(dlua_tensor_t *t, int dim, const int64_t *is, const dlua_tensor_t *src, int64_t base,
                          const char *what) {
  const int64_t *ts = dlua_tensor_sizes(t), *ss = dlua_tensor_sizes(src);
  dlua_tensor_t *idx = make_index(3, is, DLUA_DTYPE_I64, base, ts[dim]);
  double *tv = tu_values(t), *iv = tu_values(idx), *sv = tu_values(src);
  for (int64_t i = 0; i < is[0]; i++)
    for (int64_t j = 0; j < is[1]; j++)
      for (int64_t k = 0; k < is[2]; k++) {
        int64_t c[3] = {i, j, k};
        c[dim] = (int64_t)iv[(i * is[1] + j) * is[2] + k] - base;
        tv[(c[0] * ts[1] + c[1]) * ts[2] + c[2]] += sv[(i * ss[1] + j) * ss[2] + k];
      }
  ck_assert_msg(dlua_tensor_scatter_add_(t, dim, idx, src, base) == DLUA_OK, "%s: %s", what, dlua_last_error());
  expect_values(t, tv, ts[0] * ts[1] * ts[2], what);
  free(tv);
  free(iv);
  free(sv);
  dlua_tensor_free(idx);
}

START_TEST(test_scatter_add_3d) {
  int64_t s[3] = {3, 5, 7}, ss[3] = {4, 6, 8};
  for (int dim = 0; dim < 3; dim++) {
    int64_t is[3] = {2, 4, 6};
    is[dim] = 11;  // more updates than slots: collisions
    int64_t srcs[3] = {ss[0], ss[1], ss[2]};
    srcs[dim] = 12;
    dlua_tensor_t *t = make_rand(3, s, DLUA_DTYPE_F64), *src = make_rand(3, srcs, DLUA_DTYPE_F64);
    check_scatter(t, dim, is, src, dim & 1, "f64");
    dlua_tensor_t *ti = make_rand(3, s, DLUA_DTYPE_I32), *srci = make_rand(3, srcs, DLUA_DTYPE_I32);
    check_scatter(ti, dim, is, srci, 0, "i32");
    // Into a permuted (non-contiguous) view: the update lands in the base tensor.
    int perm[3] = {2, 0, 1};
    dlua_tensor_t *base = make_rand(3, (int64_t[]){5, 7, 3}, DLUA_DTYPE_F32), *view = NULL;
    ck_assert_int_eq(dlua_tensor_permute(&view, base, perm), DLUA_OK);  // (3, 5, 7)
    dlua_tensor_t *srcf = make_rand(3, srcs, DLUA_DTYPE_F32);
    check_scatter(view, dim, is, srcf, 1, "f32 into permuted view");
    dlua_tensor_t *all[] = {t, src, ti, srci, base, view, srcf};
    for (size_t q = 0; q < sizeof all / sizeof all[0]; q++) dlua_tensor_free(all[q]);
  }
}
END_TEST

START_TEST(test_scatter_add_threads) {
  // Floating sums with heavy collisions must not depend on the thread count.
  int64_t n = 300007, st[2] = {64, 3}, si[2] = {n, 3};
  dlua_tensor_t *idx = make_index(2, si, DLUA_DTYPE_I64, 0, 64), *src = NULL;
  int64_t ss[2] = {n, 3};
  double *v = malloc(sizeof(double) * (size_t)(n * 3));
  for (int64_t i = 0; i < n * 3; i++) v[i] = tu_xorshift(&rng_state) * 1e4;
  src = tu_make(2, ss, DLUA_DTYPE_F32, v);
  dlua_tensor_t *t1 = NULL, *t2 = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&t1, 2, st, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&t2, 2, st, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  int saved = dlua_get_num_threads();
  dlua_set_num_threads(1);
  ck_assert_int_eq(dlua_tensor_scatter_add_(t1, 0, idx, src, 0), DLUA_OK);
  dlua_set_num_threads(2);
  ck_assert_int_eq(dlua_tensor_scatter_add_(t2, 0, idx, src, 0), DLUA_OK);
  dlua_set_num_threads(saved);
  ck_assert(memcmp(dlua_tensor_data(t1), dlua_tensor_data(t2), 64 * 3 * 4) == 0);
  // And it is close to the exact sum.
  double *iv = tu_values(idx), want[192] = {0};
  for (int64_t i = 0; i < n; i++)
    for (int j = 0; j < 3; j++) want[(int64_t)iv[i * 3 + j] * 3 + j] += (float)v[i * 3 + j];
  double *got = tu_values(t1);
  for (int i = 0; i < 192; i++) ck_assert_msg(fabs(got[i] - want[i]) < 1e-3 * (1 + fabs(want[i])) + 1.0, "slot %d", i);
  free(v);
  free(iv);
  free(got);
  dlua_tensor_free(idx);
  dlua_tensor_free(src);
  dlua_tensor_free(t1);
  dlua_tensor_free(t2);
}
END_TEST

/* ---- cat, stack ----------------------------------------------------------------------------------- */

START_TEST(test_cat) {
  // (2, 3), (2, 1), transposed (2, 4) along dim 1.
  dlua_tensor_t *a = make_rand(2, (int64_t[]){2, 3}, DLUA_DTYPE_F32), *b = make_rand(2, (int64_t[]){2, 1}, DLUA_DTYPE_F32);
  dlua_tensor_t *c0 = make_rand(2, (int64_t[]){4, 2}, DLUA_DTYPE_F32), *c = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&c, c0, 0, 1), DLUA_OK);
  double *av = tu_values(a), *bv = tu_values(b), *cv = tu_values(c), want[16];
  for (int i = 0; i < 2; i++) {
    for (int j = 0; j < 3; j++) want[i * 8 + j] = av[i * 3 + j];
    want[i * 8 + 3] = bv[i];
    for (int j = 0; j < 4; j++) want[i * 8 + 4 + j] = cv[i * 4 + j];
  }
  dlua_tensor_t *parts[3] = {a, b, c}, *out = NULL;
  ck_assert_int_eq(dlua_tensor_cat(&out, 3, parts, 1), DLUA_OK);
  ck_assert(dlua_tensor_sizes(out)[0] == 2 && dlua_tensor_sizes(out)[1] == 8);
  expect_values(out, want, 16, "cat dim 1");
  dlua_tensor_free(out);
  // Along dim 0 with dtype promotion (int32 + float32 -> float32) and a skipped (0,) tensor.
  dlua_tensor_t *ai = make_rand(2, (int64_t[]){3, 2}, DLUA_DTYPE_I32), *e = tu_make(1, (int64_t[]){0}, DLUA_DTYPE_F64, NULL);
  dlua_tensor_t *bt = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&bt, a, 0, 1), DLUA_OK);  // (3, 2) float32 strided
  double *aiv = tu_values(ai), *btv = tu_values(bt), w2[12];
  memcpy(w2, aiv, sizeof(double) * 6);
  memcpy(w2 + 6, btv, sizeof(double) * 6);
  dlua_tensor_t *p2[3] = {ai, e, bt};
  out = NULL;
  ck_assert_int_eq(dlua_tensor_cat(&out, 3, p2, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_F64);  // promotion includes the skipped float64
  ck_assert(dlua_tensor_sizes(out)[0] == 6 && dlua_tensor_sizes(out)[1] == 2);
  expect_values(out, w2, 12, "cat dim 0 promoted");
  dlua_tensor_free(out);
  // Into a preallocated int64 out: cast on the way.
  dlua_tensor_t *p3[2] = {ai, ai}, *o64 = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&o64, 2, (int64_t[]){6, 2}, DLUA_DTYPE_I64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_cat(&o64, 2, p3, 0), DLUA_OK);
  memcpy(w2 + 6, aiv, sizeof(double) * 6);
  expect_values(o64, w2, 12, "cat into int64");
  // Mismatch and bad dim.
  out = NULL;
  tu_expect_error(dlua_tensor_cat(&out, 2, (dlua_tensor_t *[]){a, ai}, 1), "cat: tensor 2 (3, 2) int32 cpu does not match");
  tu_expect_error(dlua_tensor_cat(&out, 1, (dlua_tensor_t *[]){a}, 2), "cat: dimension 2 is out of range");
  tu_expect_error(dlua_tensor_cat(&out, 0, parts, 0), "cat: expected at least one tensor");
  ck_assert_ptr_null(out);
  free(av);
  free(bv);
  free(cv);
  free(aiv);
  free(btv);
  dlua_tensor_t *ts[] = {a, b, c0, c, ai, e, bt, o64};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_stack) {
  dlua_tensor_t *x[3];
  double *xv[3];
  for (int i = 0; i < 3; i++) {
    x[i] = make_rand(2, (int64_t[]){2, 5}, i == 1 ? DLUA_DTYPE_I64 : DLUA_DTYPE_F32);
    xv[i] = tu_values(x[i]);
  }
  for (int dim = 0; dim <= 2; dim++) {
    dlua_tensor_t *out = NULL;
    ck_assert_int_eq(dlua_tensor_stack(&out, 3, x, dim), DLUA_OK);
    int64_t os[3] = {2, 5, 0};
    // Insert 3 at dim.
    int64_t shape[3];
    for (int d = 0, q = 0; d < 3; d++) shape[d] = d == dim ? 3 : os[q++];
    for (int d = 0; d < 3; d++) ck_assert_int_eq(dlua_tensor_sizes(out)[d], shape[d]);
    ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_F32);
    double want[30];
    for (int t = 0; t < 3; t++)
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 5; j++) {
          int64_t c[3];
          for (int d = 0, q = 0; d < 3; d++) c[d] = d == dim ? t : (q++ == 0 ? i : j);
          want[(c[0] * shape[1] + c[1]) * shape[2] + c[2]] = xv[t][i * 5 + j];
        }
    expect_values(out, want, 30, "stack");
    dlua_tensor_free(out);
  }
  dlua_tensor_t *odd = make_rand(2, (int64_t[]){5, 2}, DLUA_DTYPE_F32), *out = NULL;
  tu_expect_error(dlua_tensor_stack(&out, 2, (dlua_tensor_t *[]){x[0], odd}, 0), "stack: tensor 2 (5, 2) float32 cpu does not have the shape");
  tu_expect_error(dlua_tensor_stack(&out, 1, x, 3), "stack: dimension 3 is out of range");
  dlua_tensor_free(odd);
  for (int i = 0; i < 3; i++) {
    dlua_tensor_free(x[i]);
    free(xv[i]);
  }
}
END_TEST

/* ---- one_hot ---------------------------------------------------------------------------------- */

START_TEST(test_one_hot) {
  double lab[6] = {3, 1, 2, 3, 1, 1};
  dlua_tensor_t *l = tu_make(2, (int64_t[]){2, 3}, DLUA_DTYPE_I64, lab), *out = NULL;
  ck_assert_int_eq(dlua_tensor_one_hot(&out, l, 4, 1, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert(dlua_tensor_ndim(out) == 3 && dlua_tensor_sizes(out)[2] == 4);
  double want[24] = {0};
  for (int i = 0; i < 6; i++) want[i * 4 + (int)lab[i] - 1] = 1;
  expect_values(out, want, 24, "one_hot f32");
  dlua_tensor_free(out);
  // Inferred class count (largest label) with 0-based int32 labels, bool and f16 outputs.
  dlua_tensor_t *l0 = tu_make(1, (int64_t[]){6}, DLUA_DTYPE_I32, lab);
  static const dlua_dtype_t dts[] = {DLUA_DTYPE_BOOL, DLUA_DTYPE_F16, DLUA_DTYPE_BF16, DLUA_DTYPE_I64, DLUA_DTYPE_F64};
  double w4[24] = {0};
  for (int i = 0; i < 6; i++) w4[i * 4 + (int)lab[i]] = 1;
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    out = NULL;
    ck_assert_int_eq(dlua_tensor_one_hot(&out, l0, -1, 0, dts[d]), DLUA_OK);
    ck_assert(dlua_tensor_sizes(out)[1] == 4 && dlua_tensor_dtype(out) == dts[d]);
    expect_values(out, w4, 24, dlua_dtype_name(dts[d]));
    dlua_tensor_free(out);
  }
  out = NULL;
  tu_expect_error(dlua_tensor_one_hot(&out, l, 2, 1, DLUA_DTYPE_F32), "one_hot: index 3 is out of range for the classes of size 2 (valid: 1..2)");
  tu_expect_error(dlua_tensor_one_hot(&out, l, 3, 0, DLUA_DTYPE_F32), "one_hot: index 3 is out of range");
  dlua_tensor_t *e = tu_make(1, (int64_t[]){0}, DLUA_DTYPE_I64, NULL);
  tu_expect_error(dlua_tensor_one_hot(&out, e, -1, 0, DLUA_DTYPE_F32), "one_hot: cannot infer");
  ck_assert_ptr_null(out);
  ck_assert_int_eq(dlua_tensor_one_hot(&out, e, 5, 0, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert(dlua_tensor_sizes(out)[0] == 0 && dlua_tensor_sizes(out)[1] == 5);
  dlua_tensor_free(out);
  dlua_tensor_free(e);
  dlua_tensor_free(l);
  dlua_tensor_free(l0);
}
END_TEST

/* The front doors reach the kernels through the backend table: the CPU's index family answers the range check
   itself; ops on device 0 get the registry's one message when no CUDA device exists. */
START_TEST(test_through_the_table) {
  const struct dlua_index_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("gather", DLUA_CPU, index, gather, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_index_ops);
  ck_assert(k->first_bad && k->index_select && k->scatter_add && k->one_hot && k->copy_rows && k->sort && k->topk);

  int64_t iv[5] = {0, 2, 1, 3, 1}, first = 7, value = 7;
  dlua_index_check_t c = {iv, 1, 5, 3, 0, DLUA_CPU};
  ck_assert_int_eq(k->first_bad("probe", &c, &first, &value), DLUA_OK);
  ck_assert(first == 3 && value == 3);
  c.size = 4;
  ck_assert_int_eq(k->first_bad("probe", &c, &first, &value), DLUA_OK);
  ck_assert(first == -1);

  int64_t n5 = 5;
  double v[5] = {0, 2, 1, 3, 1};
  dlua_tensor_t *idx = tu_make(1, &n5, DLUA_DTYPE_I64, v);
  ck_assert_int_eq(dlua_ops_check_indices("probe", idx, 4, 0, "dimension 0"), DLUA_OK);
  tu_expect_error_at(dlua_ops_check_indices("probe", idx, 3, 0, "dimension 0"), "probe",
                     "index 3 is out of range for dimension 0 of size 3 (valid: 0..2)");

  struct dlua_tensor on0 = *idx;  // the same header claiming device 0: never read unless a device exists
  on0.device = 0;
  if (dlua_cuda_device_count() == 0) {
    dlua_tensor_t *out = NULL;
    tu_expect_error_at(dlua_tensor_one_hot(&out, &on0, 4, 0, DLUA_DTYPE_F32), "one_hot", "no CUDA device available");
    ck_assert_ptr_null(out);
    tu_expect_error_at(dlua_tensor_sort(&out, NULL, &on0, 0, 0, 0), "sort", "sort: no CUDA device available");
    tu_expect_error_at(dlua_tensor_index_select(&out, &on0, 0, &on0, 0), "index_select", "no CUDA device available");
    ck_assert_ptr_null(out);
  } else {
    const struct dlua_index_ops *kc = NULL;
    ck_assert_int_eq(DLUA_BACKEND("sort", 0, index, sort, &kc), DLUA_OK);
    ck_assert_ptr_ne(kc, &dlua_cpu_index_ops);
  }
  dlua_tensor_free(idx);
}
END_TEST

int main(void) {
  Suite *s = suite_create("index");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_index_select);
  tcase_add_test(tc, test_index_select_errors);
  tcase_add_test(tc, test_gather);
  tcase_add_test(tc, test_gather_strided_and_errors);
  tcase_add_test(tc, test_scatter_add_known);
  tcase_add_test(tc, test_scatter_add_3d);
  tcase_add_test(tc, test_scatter_add_threads);
  tcase_add_test(tc, test_cat);
  tcase_add_test(tc, test_stack);
  tcase_add_test(tc, test_one_hot);
  tcase_add_test(tc, test_through_the_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/ops/sort.c and host/cpu/sort.c: stable sort and top-k (by value and magnitude) against reference loops. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static int64_t *indices_of(const dlua_tensor_t *t) {
  ck_assert_int_eq(dlua_tensor_dtype(t), DLUA_DTYPE_I64);
  int64_t n = dlua_tensor_numel(t);
  int64_t *v = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
  ck_assert_int_eq(dlua_tensor_to_data(t, v, sizeof(int64_t) * (size_t)n), DLUA_OK);
  return v;
}

/* The reference order: NaN above everything, then by value (or |value|); ties by position. */
typedef struct {
  double v;
  int64_t i;
} item_t;
static int ref_desc, ref_mag;
static int before(const item_t *x, const item_t *y) {  // strictly before in the wanted order
  double a = ref_mag ? fabs(x->v) : x->v, b = ref_mag ? fabs(y->v) : y->v;
  int an = isnan(a), bn = isnan(b);
  int cmp = an && bn ? 0 : an ? 1 : bn ? -1 : (a > b) - (a < b);
  if (ref_desc) cmp = -cmp;
  return cmp < 0 || (cmp == 0 && x->i < y->i);
}
static int ref_cmp(const void *p, const void *q) {
  const item_t *x = p, *y = q;
  return before(x, y) ? -1 : before(y, x) ? 1 : 0;
}

static int same_value(double a, double b) { return (isnan(a) && isnan(b)) || a == b; }

/* Sorts each row of a 2-D tensor along dim and compares values and 1-based indices. */
static void check_sort_2d(const dlua_tensor_t *a, int dim, int descending, const char *what) {
  int64_t r = dlua_tensor_sizes(a)[0], c = dlua_tensor_sizes(a)[1];
  double *av = tu_values(a);
  dlua_tensor_t *vals = NULL, *idx = NULL;
  ck_assert_msg(dlua_tensor_sort(&vals, &idx, a, dim, descending, 1) == DLUA_OK, "%s: %s", what, dlua_last_error());
  ck_assert_int_eq(dlua_tensor_dtype(vals), dlua_tensor_dtype(a));
  double *gv = tu_values(vals);
  int64_t *gi = indices_of(idx);
  int64_t rows = dim == 0 ? c : r, len = dim == 0 ? r : c;
  item_t *it = malloc(sizeof(item_t) * (size_t)(len ? len : 1));
  ref_desc = descending;
  ref_mag = 0;
  for (int64_t row = 0; row < rows; row++) {
    for (int64_t j = 0; j < len; j++) {
      it[j].v = dim == 0 ? av[j * c + row] : av[row * c + j];
      it[j].i = j;
    }
    qsort(it, (size_t)len, sizeof *it, ref_cmp);
    for (int64_t j = 0; j < len; j++) {
      int64_t e = dim == 0 ? j * c + row : row * c + j;
      ck_assert_msg(same_value(gv[e], it[j].v) && gi[e] == it[j].i + 1,
                    "%s: row %lld position %lld: got %g at %lld, expected %g at %lld", what, (long long)row,
                    (long long)j, gv[e], (long long)gi[e], it[j].v, (long long)it[j].i + 1);
    }
  }
  free(av);
  free(gv);
  free(gi);
  free(it);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
}

START_TEST(test_sort_known) {
  // Ties, NaN, signed zeros: stable, NaN largest, -0 and +0 equal.
  double v[9] = {3, NAN, -1, 3, 0.0, -0.0, -INFINITY, 2, NAN};
  int64_t s[1] = {9};
  dlua_tensor_t *a = tu_make(1, s, DLUA_DTYPE_F32, v), *vals = NULL, *idx = NULL;
  ck_assert_int_eq(dlua_tensor_sort(&vals, &idx, a, 0, 0, 0), DLUA_OK);
  int64_t want_up[9] = {6, 2, 4, 5, 7, 0, 3, 1, 8};
  int64_t *gi = indices_of(idx);
  for (int i = 0; i < 9; i++) ck_assert_int_eq(gi[i], want_up[i]);
  free(gi);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_sort(&vals, &idx, a, 0, 1, 1), DLUA_OK);  // descending, 1-based
  int64_t want_down[9] = {2, 9, 1, 4, 8, 5, 6, 3, 7};
  gi = indices_of(idx);
  for (int i = 0; i < 9; i++) ck_assert_int_eq(gi[i], want_down[i]);
  double *gv = tu_values(vals);
  ck_assert(isnan(gv[0]) && isnan(gv[1]) && gv[2] == 3 && gv[8] == -INFINITY);
  ck_assert(signbit(gv[5]) == 0 && signbit(gv[6]) != 0);  // +0 (position 5) before -0 (position 6)
  free(gi);
  free(gv);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  dlua_tensor_free(a);
}
END_TEST

START_TEST(test_sort_dtypes_and_layouts) {
  static const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                     DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8};
  int64_t s[2] = {13, 37};
  double *v = malloc(sizeof(double) * 13 * 37);
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    for (int i = 0; i < 13 * 37; i++) {
      double x = floor(tu_xorshift(&rng_state) * 40);  // many ties
      v[i] = dts[d] == DLUA_DTYPE_U8 ? fabs(x) : dts[d] >= DLUA_DTYPE_I32 ? x * 1e6 : x / 8;
    }
    if (dts[d] <= DLUA_DTYPE_BF16) v[5] = v[77] = NAN;
    dlua_tensor_t *a = tu_make(2, s, dts[d], v), *at = NULL;
    for (int desc = 0; desc < 2; desc++) {
      check_sort_2d(a, 1, desc, dlua_dtype_name(dts[d]));
      check_sort_2d(a, 0, desc, dlua_dtype_name(dts[d]));
    }
    ck_assert_int_eq(dlua_tensor_transpose(&at, a, 0, 1), DLUA_OK);  // (37, 13), strided rows
    check_sort_2d(at, 1, 0, "transposed");
    dlua_tensor_free(a);
    dlua_tensor_free(at);
  }
  free(v);
}
END_TEST

START_TEST(test_sort_edges) {
  // Empty and size-1 rows; a 0-d tensor; one output only; bad dim.
  int64_t s0[2] = {3, 0}, s1[2] = {1, 1};
  double one = 4.5;
  dlua_tensor_t *e = tu_make(2, s0, DLUA_DTYPE_F32, &one), *o = tu_make(2, s1, DLUA_DTYPE_F32, &one);
  dlua_tensor_t *vals = NULL, *idx = NULL;
  ck_assert_int_eq(dlua_tensor_sort(&vals, &idx, e, 1, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(vals), 0);
  ck_assert_int_eq(dlua_tensor_sizes(idx)[0], 3);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_sort(NULL, &idx, o, 0, 0, 1), DLUA_OK);
  int64_t *gi = indices_of(idx);
  ck_assert_int_eq(gi[0], 1);
  free(gi);
  dlua_tensor_free(idx);
  ck_assert_int_eq(dlua_tensor_sort(&vals, &idx, o, 2, 0, 1), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "sort: dimension 2 is out of range"));
  dlua_tensor_free(e);
  dlua_tensor_free(o);
}
END_TEST

START_TEST(test_sort_long) {
  int64_t n = 100003;  // prime, and long enough for the radix passes
  int64_t s[2] = {1, n};
  double *v = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) v[i] = i % 1000 == 7 ? NAN : tu_xorshift(&rng_state) * 1e3;
  dlua_tensor_t *a = tu_make(2, s, DLUA_DTYPE_F32, v);
  check_sort_2d(a, 1, 0, "long ascending");
  check_sort_2d(a, 1, 1, "long descending");
  dlua_tensor_free(a);
  free(v);
}
END_TEST

static int cmp_i64(const void *p, const void *q) {
  int64_t a = *(const int64_t *)p, b = *(const int64_t *)q;
  return (a > b) - (a < b);
}

/* Top-k of each row of a 2-D tensor along dim against a fully sorted reference. */
static void check_topk_2d(const dlua_tensor_t *a, int64_t k, int dim, int largest, int mag, int sorted,
                          const char *what) {
  int64_t r = dlua_tensor_sizes(a)[0], c = dlua_tensor_sizes(a)[1];
  double *av = tu_values(a);
  dlua_tensor_t *vals = NULL, *idx = NULL;
  ck_assert_msg(dlua_tensor_topk(&vals, &idx, a, k, dim, largest, mag, sorted, 1) == DLUA_OK, "%s: %s", what,
                dlua_last_error());
  ck_assert_int_eq(dlua_tensor_sizes(vals)[dim], k);
  double *gv = tu_values(vals);
  int64_t *gi = indices_of(idx);
  int64_t rows = dim == 0 ? c : r, len = dim == 0 ? r : c;
  item_t *it = malloc(sizeof(item_t) * (size_t)len);
  int64_t *want = malloc(sizeof(int64_t) * (size_t)(k ? k : 1));
  ref_desc = largest;
  ref_mag = mag;
  for (int64_t row = 0; row < rows; row++) {
    for (int64_t j = 0; j < len; j++) {
      it[j].v = dim == 0 ? av[j * c + row] : av[row * c + j];
      it[j].i = j;
    }
    qsort(it, (size_t)len, sizeof *it, ref_cmp);
    // The chosen set: the first k of the order (ties go to the lower position).
    for (int64_t j = 0; j < k; j++) want[j] = it[j].i;
    // Unsorted output lists the chosen positions in increasing order.
    if (!sorted) qsort(want, (size_t)k, sizeof *want, cmp_i64);
    for (int64_t j = 0; j < k; j++) {
      int64_t e = dim == 0 ? j * c + row : row * k + j;
      double expect = dim == 0 ? av[want[j] * c + row] : av[row * c + want[j]];
      ck_assert_msg(gi[e] == want[j] + 1 && same_value(gv[e], expect),
                    "%s: row %lld slot %lld: got %g at %lld, expected %g at %lld", what, (long long)row, (long long)j,
                    gv[e], (long long)gi[e], expect, (long long)want[j] + 1);
    }
  }
  free(av);
  free(gv);
  free(gi);
  free(it);
  free(want);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
}

START_TEST(test_topk_known) {
  double v[8] = {1, -5, 3, 5, -5, NAN, 0, 2};
  int64_t s[1] = {8};
  dlua_tensor_t *a = tu_make(1, s, DLUA_DTYPE_F32, v), *vals = NULL, *idx = NULL;
  // Largest 3 by value, sorted: NaN, 5, 3.
  ck_assert_int_eq(dlua_tensor_topk(&vals, &idx, a, 3, 0, 1, 0, 1, 1), DLUA_OK);
  int64_t *gi = indices_of(idx);
  ck_assert(gi[0] == 6 && gi[1] == 4 && gi[2] == 3);
  free(gi);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  // Largest 3 by magnitude, sorted: NaN, then the three of magnitude 5 tie -> positions 2, 4 (1-based).
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_topk(&vals, &idx, a, 3, 0, 1, 1, 1, 1), DLUA_OK);
  gi = indices_of(idx);
  double *gv = tu_values(vals);
  ck_assert(gi[0] == 6 && gi[1] == 2 && gi[2] == 4);
  ck_assert(isnan(gv[0]) && gv[1] == -5 && gv[2] == 5);  // values keep their sign
  free(gi);
  free(gv);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  // Smallest 2 by value: -5 (position 2) and -5 (position 5); NaN never counts as small.
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_topk(&vals, &idx, a, 2, 0, 0, 0, 1, 1), DLUA_OK);
  gi = indices_of(idx);
  ck_assert(gi[0] == 2 && gi[1] == 5);
  free(gi);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  // k = 0, k = n, and k out of range.
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_topk(&vals, &idx, a, 0, 0, 1, 0, 1, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(vals), 0);
  dlua_tensor_free(vals);
  dlua_tensor_free(idx);
  vals = idx = NULL;
  ck_assert_int_eq(dlua_tensor_topk(&vals, &idx, a, 9, 0, 1, 0, 1, 1), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "topk: k = 9 is out of range"));
  ck_assert_ptr_null(vals);
  dlua_tensor_free(a);
}
END_TEST

START_TEST(test_topk_rows) {
  static const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                     DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8};
  int64_t s[2] = {11, 5003};  // rows longer than 4096 use 16-bit digits
  double *v = malloc(sizeof(double) * 11 * 5003);
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    for (int i = 0; i < 11 * 5003; i++) {
      double x = floor(tu_xorshift(&rng_state) * 300);
      v[i] = dts[d] == DLUA_DTYPE_U8 ? fabs(x) / 2 : dts[d] >= DLUA_DTYPE_I32 ? x * 1000 : x / 16;
    }
    if (dts[d] <= DLUA_DTYPE_BF16) v[3] = v[5003 + 9] = NAN;
    dlua_tensor_t *a = tu_make(2, s, dts[d], v);
    const char *nm = dlua_dtype_name(dts[d]);
    for (int mode = 0; mode < 8; mode++) check_topk_2d(a, 1 + mode * 97, 1, mode & 1, (mode >> 1) & 1, (mode >> 2) & 1, nm);
    check_topk_2d(a, 5003, 1, 1, 0, 1, nm);
    check_topk_2d(a, 7, 0, 1, 1, 1, nm);  // along dim 0: strided rows of 11
    check_topk_2d(a, 11, 0, 0, 0, 0, nm);
    dlua_tensor_free(a);
  }
  free(v);
}
END_TEST

START_TEST(test_topk_long_magnitude) {
  // One long row (the gradient-compression case): split among threads in chunks.
  int64_t n = 400009;
  int64_t s[2] = {1, n};
  double *v = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) v[i] = i % 3 == 0 ? 0.0 : tu_xorshift(&rng_state) * 1e-3;  // a third zeros: ties
  v[1234] = -1.0;
  v[n - 1] = 1.0;
  dlua_tensor_t *a = tu_make(2, s, DLUA_DTYPE_F32, v);
  int saved = dlua_get_num_threads();
  dlua_set_num_threads(2);
  check_topk_2d(a, 4000, 1, 1, 1, 0, "1% by magnitude");
  check_topk_2d(a, 4000, 1, 1, 1, 1, "1% by magnitude, sorted");
  check_topk_2d(a, 300000, 1, 1, 1, 0, "k reaching into the zeros");
  check_topk_2d(a, 2, 1, 1, 1, 1, "k = 2");
  check_topk_2d(a, 1000, 1, 0, 0, 1, "smallest 1000");
  // Same answer with one thread, bit for bit.
  dlua_tensor_t *v1 = NULL, *i1 = NULL, *v2 = NULL, *i2 = NULL;
  ck_assert_int_eq(dlua_tensor_topk(&v2, &i2, a, 5000, 1, 1, 1, 0, 0), DLUA_OK);
  dlua_set_num_threads(1);
  ck_assert_int_eq(dlua_tensor_topk(&v1, &i1, a, 5000, 1, 1, 1, 0, 0), DLUA_OK);
  dlua_set_num_threads(saved);
  ck_assert(memcmp(dlua_tensor_data(v1), dlua_tensor_data(v2), 5000 * 4) == 0);
  ck_assert(memcmp(dlua_tensor_data(i1), dlua_tensor_data(i2), 5000 * 8) == 0);
  // Preallocated outputs are written in place (no allocation on the hot path).
  int64_t os[2] = {1, 5000};
  dlua_tensor_t *pv = NULL, *pi = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&pv, 2, os, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_empty(&pi, 2, os, DLUA_DTYPE_I64, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *kv = pv, *ki = pi;
  ck_assert_int_eq(dlua_tensor_topk(&pv, &pi, a, 5000, 1, 1, 1, 0, 0), DLUA_OK);
  ck_assert(pv == kv && pi == ki);
  ck_assert(memcmp(dlua_tensor_data(pi), dlua_tensor_data(i1), 5000 * 8) == 0);
  dlua_tensor_t *ts[] = {a, v1, i1, v2, i2, pv, pi};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
  free(v);
}
END_TEST

int main(void) {
  Suite *s = suite_create("sort");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_sort_known);
  tcase_add_test(tc, test_sort_dtypes_and_layouts);
  tcase_add_test(tc, test_sort_edges);
  tcase_add_test(tc, test_sort_long);
  tcase_add_test(tc, test_topk_known);
  tcase_add_test(tc, test_topk_rows);
  tcase_add_test(tc, test_topk_long_magnitude);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

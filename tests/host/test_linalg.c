/* Check suite for host/ops/linalg.c (the front doors of mm, bmm, addmm, matmul) and host/cpu/linalg.c (sgemm and the
   blas table's kernels) against double-precision loops. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/blas.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t rng_state = 88172645463325252ull;

static dlua_tensor_t *make_rand(int nd, const int64_t *sizes, dlua_dtype_t dtype) {
  int64_t n = dlua_shape_numel(nd, sizes);
  double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) v[i] = dtype == DLUA_DTYPE_I32 || dtype == DLUA_DTYPE_I64 ? floor(tu_xorshift(&rng_state) * 10) : tu_xorshift(&rng_state);
  dlua_tensor_t *t = tu_make(nd, sizes, dtype, v);
  free(v);
  return t;
}

/* Reference product of row-major (m, k) and (k, n) double arrays, optionally batched. */
static void ref_mm(int64_t m, int64_t n, int64_t k, const double *a, const double *b, double *c) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++) s += a[i * k + p] * b[p * n + j];
      c[i * n + j] = s;
    }
}

static void expect_shape(const dlua_tensor_t *t, int nd, const int64_t *sizes) {
  ck_assert_int_eq(dlua_tensor_ndim(t), nd);
  for (int d = 0; d < nd; d++) ck_assert_int_eq(dlua_tensor_sizes(t)[d], sizes[d]);
}

/* ---- raw sgemm ------------------------------------------------------------------------------ */

static void check_sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, float beta, int64_t pad) {
  int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
  int64_t lda = ac + pad, ldb = bc + pad, ldc = n + pad;
  float *a = malloc(sizeof(float) * (size_t)(ar * lda + 1)), *b = malloc(sizeof(float) * (size_t)(br * ldb + 1));
  float *c = malloc(sizeof(float) * (size_t)(m * ldc + 1));
  double *want = malloc(sizeof(double) * (size_t)(m * n + 1));
  for (int64_t i = 0; i < ar * lda; i++) a[i] = (float)tu_xorshift(&rng_state);
  for (int64_t i = 0; i < br * ldb; i++) b[i] = (float)tu_xorshift(&rng_state);
  for (int64_t i = 0; i < m * ldc; i++) c[i] = (float)tu_xorshift(&rng_state);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++)
        s += (double)(ta ? a[p * lda + i] : a[i * lda + p]) * (double)(tb ? b[j * ldb + p] : b[p * ldb + j]);
      want[i * n + j] = alpha * s + (beta == 0 ? 0.0 : beta * (double)c[i * ldc + j]);
    }
  float sentinel = c[m * ldc - 1 < 0 ? 0 : m * ldc - 1];
  ck_assert_int_eq(dlua_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), DLUA_OK);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double err = fabs(c[i * ldc + j] - want[i * n + j]);
      if (!(err <= 1e-5 * (double)(k + 1) * (1 + fabs(want[i * n + j]))))
        ck_abort_msg("sgemm ta=%d tb=%d m=%lld n=%lld k=%lld: c[%lld,%lld] = %g, expected %g", ta, tb, (long long)m,
                     (long long)n, (long long)k, (long long)i, (long long)j, c[i * ldc + j], want[i * n + j]);
    }
  // Padding columns of c are not written.
  if (pad > 0 && m > 0 && n > 0) ck_assert(c[m * ldc - 1] == sentinel);
  free(a);
  free(b);
  free(c);
  free(want);
}

START_TEST(test_sgemm_shapes) {
  static const int64_t shapes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 13, 31}, {64, 1, 100}, {1, 64, 100}, {1, 1, 5000},
                                      {2, 3, 1}, {31, 37, 2}, {128, 96, 70}, {5, 1, 9000}, {1, 7, 9000}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int t = 0; t < 4; t++) {
      check_sgemm(t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 0.0f, 0);
      check_sgemm(t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], 0.5f, -2.0f, 3);
    }
}
END_TEST

START_TEST(test_sgemm_degenerate) {
  // k = 0 and beta = 0: C becomes zeros even where it held NaN.
  float c[6] = {NAN, NAN, NAN, 1, 2, 3}, a[1] = {0}, b[1] = {0};
  ck_assert_int_eq(dlua_sgemm(0, 0, 2, 3, 0, 1.0f, a, 1, b, 3, 0.0f, c, 3), DLUA_OK);
  for (int i = 0; i < 6; i++) ck_assert(c[i] == 0.0f);
  float d[4] = {1, 2, 3, 4};
  ck_assert_int_eq(dlua_sgemm(0, 0, 2, 2, 0, 1.0f, a, 1, b, 2, 3.0f, d, 2), DLUA_OK);
  ck_assert(d[0] == 3 && d[3] == 12);
  // beta = 0 ignores NaN in C for a real product too.
  float x[4] = {1, 2, 3, 4}, y[4] = {5, 6, 7, 8}, z[4] = {NAN, NAN, NAN, NAN};
  ck_assert_int_eq(dlua_sgemm(0, 0, 2, 2, 2, 1.0f, x, 2, y, 2, 0.0f, z, 2), DLUA_OK);
  ck_assert(z[0] == 19 && z[1] == 22 && z[2] == 43 && z[3] == 50);
  // m = 0 or n = 0: nothing to do, nothing read.
  ck_assert_int_eq(dlua_sgemm(0, 0, 0, 3, 4, 1.0f, NULL, 4, NULL, 3, 0.0f, NULL, 3), DLUA_OK);
  // A too-small leading dimension is an argument error naming sgemm.
  ck_assert_int_eq(dlua_sgemm(0, 0, 2, 3, 4, 1.0f, x, 3, y, 3, 0.0f, z, 3), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "sgemm: leading dimensions"));
  ck_assert_int_eq(dlua_sgemm(0, 0, -1, 3, 4, 1.0f, x, 4, y, 3, 0.0f, z, 3), DLUA_ERR_ARG);
}
END_TEST

/* ---- mm and friends ------------------------------------------------------------------------- */

/* out = a @ b for 2-D tensors of any layout, checked against ref_mm on their values. */
static void check_mm_tensors(const dlua_tensor_t *a, const dlua_tensor_t *b, double tol, const char *what) {
  int64_t m = dlua_tensor_sizes(a)[0], k = dlua_tensor_sizes(a)[1], n = dlua_tensor_sizes(b)[1];
  double *av = tu_values(a), *bv = tu_values(b), *want = malloc(sizeof(double) * (size_t)(m * n + 1));
  ref_mm(m, n, k, av, bv, want);
  dlua_tensor_t *out = NULL;
  ck_assert_msg(dlua_tensor_mm(&out, a, b) == DLUA_OK, "%s: %s", what, dlua_last_error());
  int64_t os[2] = {m, n};
  expect_shape(out, 2, os);
  ck_assert_int_eq(dlua_tensor_dtype(out), dlua_dtype_promote(dlua_tensor_dtype(a), dlua_tensor_dtype(b)));
  double *got = tu_values(out);
  tu_expect_close(got, want, m * n, tol, what);
  free(av);
  free(bv);
  free(want);
  free(got);
  dlua_tensor_free(out);
}

START_TEST(test_mm_layouts) {
  int64_t sa[2] = {7, 5}, sb[2] = {5, 3};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F32), *b = make_rand(2, sb, DLUA_DTYPE_F32);
  check_mm_tensors(a, b, 1e-5, "mm contiguous");
  // Transposed operands: (5, 7)^T and (3, 5)^T, read in place through trans flags.
  int64_t ta_s[2] = {5, 7}, tb_s[2] = {3, 5};
  dlua_tensor_t *at0 = make_rand(2, ta_s, DLUA_DTYPE_F32), *bt0 = make_rand(2, tb_s, DLUA_DTYPE_F32);
  dlua_tensor_t *at = NULL, *bt = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&at, at0, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&bt, bt0, 0, 1), DLUA_OK);
  check_mm_tensors(at, b, 1e-5, "mm a transposed");
  check_mm_tensors(a, bt, 1e-5, "mm b transposed");
  check_mm_tensors(at, bt, 1e-5, "mm both transposed");
  // Sliced with a step (no unit stride: copied first) and expanded (stride 0).
  int64_t big[2] = {7, 11};
  dlua_tensor_t *g = make_rand(2, big, DLUA_DTYPE_F32), *gs = NULL;
  ck_assert_int_eq(dlua_tensor_slice(&gs, g, 1, 0, 10, 2), DLUA_OK);  // (7, 5) stride (11, 2)
  check_mm_tensors(gs, b, 1e-5, "mm stepped slice");
  int64_t one[2] = {1, 3}, ex[2] = {5, 3};
  dlua_tensor_t *r = make_rand(2, one, DLUA_DTYPE_F32), *re = NULL;
  ck_assert_int_eq(dlua_tensor_expand(&re, r, 2, ex), DLUA_OK);
  check_mm_tensors(a, re, 1e-5, "mm expanded");
  // Narrowed rows: a leading dimension larger than the width.
  dlua_tensor_t *gn = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&gn, g, 1, 3, 5), DLUA_OK);
  check_mm_tensors(gn, b, 1e-5, "mm narrowed");
  dlua_tensor_t *ts[] = {a, b, at0, bt0, at, bt, g, gs, r, re, gn};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_mm_sizes_and_dtypes) {
  static const int64_t shapes[][3] = {{1, 1, 1}, {13, 1, 17}, {1, 29, 31}, {37, 41, 43}, {64, 65, 66}, {3, 1, 1}};
  static const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                     DLUA_DTYPE_I32, DLUA_DTYPE_I64};
  static const double tols[] = {1e-5, 1e-12, 2e-3, 1.6e-2, 0, 0};
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
      int64_t sa[2] = {shapes[s][0], shapes[s][2]}, sb[2] = {shapes[s][2], shapes[s][1]};
      dlua_tensor_t *a = make_rand(2, sa, dts[d]), *b = make_rand(2, sb, dts[d]);
      // Reduced precisions: the reference uses the rounded inputs; the tolerance covers the
      // rounding of the result to the output dtype (k-sized sums of values up to 1).
      check_mm_tensors(a, b, tols[d] * (d >= 2 && d <= 3 ? (double)sa[1] : 1.0), dlua_dtype_name(dts[d]));
      dlua_tensor_free(a);
      dlua_tensor_free(b);
    }
  // Mixed dtypes promote: int32 @ float32 is float32.
  int64_t sa[2] = {3, 4}, sb[2] = {4, 2};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_I32), *b = make_rand(2, sb, DLUA_DTYPE_F32);
  check_mm_tensors(a, b, 1e-5, "int32 @ float32");
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}
END_TEST

START_TEST(test_mm_empty) {
  int64_t sa[2] = {0, 5}, sb[2] = {5, 3};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F32), *b = make_rand(2, sb, DLUA_DTYPE_F32), *out = NULL;
  ck_assert_int_eq(dlua_tensor_mm(&out, a, b), DLUA_OK);
  int64_t os[2] = {0, 3};
  expect_shape(out, 2, os);
  dlua_tensor_free(out);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  // k = 0: the product of (3, 0) and (0, 4) is zeros.
  int64_t sc[2] = {3, 0}, sd[2] = {0, 4};
  for (int f64 = 0; f64 < 2; f64++) {
    dlua_dtype_t dt = f64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
    a = make_rand(2, sc, dt);
    b = make_rand(2, sd, dt);
    out = NULL;
    ck_assert_int_eq(dlua_tensor_mm(&out, a, b), DLUA_OK);
    double *v = tu_values(out);
    for (int i = 0; i < 12; i++) ck_assert(v[i] == 0.0);
    free(v);
    dlua_tensor_free(out);
    dlua_tensor_free(a);
    dlua_tensor_free(b);
  }
}
END_TEST

START_TEST(test_mm_errors) {
  int64_t sa[2] = {2, 3}, sb[2] = {4, 5}, s1[1] = {3};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F32), *b = make_rand(2, sb, DLUA_DTYPE_F32), *v = make_rand(1, s1, DLUA_DTYPE_F32);
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_tensor_mm(&out, a, b), DLUA_ERR_ARG);
  ck_assert_ptr_null(out);
  const char *e = dlua_last_error();
  ck_assert_msg(strstr(e, "mm: (2, 3) float32 cpu and (4, 5) float32 cpu cannot be multiplied") != NULL, "%s", e);
  ck_assert_int_eq(dlua_tensor_mm(&out, a, v), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "mm: expected 2-D"));
  ck_assert_int_eq(dlua_tensor_bmm(&out, a, a), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "bmm:"));
  // A wrongly shaped out is refused and left alone.
  dlua_tensor_t *w = make_rand(2, sb, DLUA_DTYPE_F32), *bb = NULL;
  int64_t sbb[2] = {3, 2};
  bb = make_rand(2, sbb, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_mm(&w, a, bb), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(w);
  // Bool is refused.
  dlua_tensor_t *ab = make_rand(2, sa, DLUA_DTYPE_BOOL), *bbool = make_rand(2, sbb, DLUA_DTYPE_BOOL);
  out = NULL;
  ck_assert_int_eq(dlua_tensor_mm(&out, ab, bbool), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "bool"));
  dlua_tensor_t *ts[] = {a, b, v, w, bb, ab, bbool};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_mm_into_out) {
  int64_t sa[2] = {4, 3}, sb[2] = {3, 5}, so[2] = {4, 5}, sot[2] = {5, 4};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F32), *b = make_rand(2, sb, DLUA_DTYPE_F32);
  double *av = tu_values(a), *bv = tu_values(b), want[20];
  ref_mm(4, 5, 3, av, bv, want);
  // A contiguous out of the same dtype is written in place (same handle back).
  dlua_tensor_t *o = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&o, 2, so, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *keep = o;
  ck_assert_int_eq(dlua_tensor_mm(&o, a, b), DLUA_OK);
  ck_assert_ptr_eq(o, keep);
  double *got = tu_values(o);
  tu_expect_close(got, want, 20, 1e-5, "mm into out");
  free(got);
  // A transposed float64 out: cast and strided write.
  dlua_tensor_t *base = NULL, *ot = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&base, 2, sot, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&ot, base, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_mm(&ot, a, b), DLUA_OK);
  got = tu_values(ot);
  tu_expect_close(got, want, 20, 1e-5, "mm into transposed f64 out");
  free(got);
  free(av);
  free(bv);
  dlua_tensor_t *ts[] = {a, b, o, base, ot};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

START_TEST(test_bmm) {
  int64_t sa[3] = {4, 3, 5}, sb[3] = {4, 5, 2};
  dlua_tensor_t *a = make_rand(3, sa, DLUA_DTYPE_F32), *b = make_rand(3, sb, DLUA_DTYPE_F32);
  // b seen transposed per batch: (4, 2, 5) permuted to (4, 5, 2).
  int64_t sbt[3] = {4, 2, 5};
  int perm[3] = {0, 2, 1};
  dlua_tensor_t *bt0 = make_rand(3, sbt, DLUA_DTYPE_F32), *bt = NULL;
  ck_assert_int_eq(dlua_tensor_permute(&bt, bt0, perm), DLUA_OK);
  const dlua_tensor_t *bs[2] = {b, bt};
  for (int v = 0; v < 2; v++) {
    double *av = tu_values(a), *bv = tu_values(bs[v]), want[4 * 3 * 2];
    for (int i = 0; i < 4; i++) ref_mm(3, 2, 5, av + i * 15, bv + i * 10, want + i * 6);
    dlua_tensor_t *out = NULL;
    ck_assert_int_eq(dlua_tensor_bmm(&out, a, bs[v]), DLUA_OK);
    int64_t os[3] = {4, 3, 2};
    expect_shape(out, 3, os);
    double *got = tu_values(out);
    tu_expect_close(got, want, 24, 1e-5, v ? "bmm transposed b" : "bmm");
    free(av);
    free(bv);
    free(got);
    dlua_tensor_free(out);
  }
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(bt0);
  dlua_tensor_free(bt);
}
END_TEST

/* ---- matmul ----------------------------------------------------------------------------------- */

START_TEST(test_matmul_vectors) {
  int64_t s7[1] = {7}, s37[2] = {3, 7}, s73[2] = {7, 3};
  dlua_tensor_t *x = make_rand(1, s7, DLUA_DTYPE_F32), *y = make_rand(1, s7, DLUA_DTYPE_F32);
  dlua_tensor_t *m = make_rand(2, s37, DLUA_DTYPE_F32), *mt = make_rand(2, s73, DLUA_DTYPE_F32);
  double *xv = tu_values(x), *yv = tu_values(y), *mv = tu_values(m), *mtv = tu_values(mt);
  // dot -> 0-d
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_tensor_matmul(&out, x, y), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(out), 0);
  double dot = 0;
  for (int i = 0; i < 7; i++) dot += xv[i] * yv[i];
  double *g = tu_values(out);
  tu_expect_close(g, &dot, 1, 1e-5, "dot");
  free(g);
  dlua_tensor_free(out);
  // (3, 7) @ (7) -> (3)
  out = NULL;
  ck_assert_int_eq(dlua_tensor_matmul(&out, m, x), DLUA_OK);
  int64_t s3[1] = {3};
  expect_shape(out, 1, s3);
  double want[3];
  ref_mm(3, 1, 7, mv, xv, want);
  g = tu_values(out);
  tu_expect_close(g, want, 3, 1e-5, "matrix @ vector");
  free(g);
  dlua_tensor_free(out);
  // (7) @ (7, 3) -> (3)
  out = NULL;
  ck_assert_int_eq(dlua_tensor_matmul(&out, x, mt), DLUA_OK);
  expect_shape(out, 1, s3);
  ref_mm(1, 3, 7, xv, mtv, want);
  g = tu_values(out);
  tu_expect_close(g, want, 3, 1e-5, "vector @ matrix");
  free(g);
  dlua_tensor_free(out);
  // Size mismatch names matmul.
  out = NULL;
  ck_assert_int_eq(dlua_tensor_matmul(&out, mt, x), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "matmul:"));
  free(xv);
  free(yv);
  free(mv);
  free(mtv);
  dlua_tensor_t *ts[] = {x, y, m, mt};
  for (size_t i = 0; i < 4; i++) dlua_tensor_free(ts[i]);
}
END_TEST

/* Reference broadcast matmul of (B..., m, k) and (C..., k, n) in row-major double arrays. */
static void ref_matmul(int na, const int64_t *sa, const double *a, int nb, const int64_t *sb, const double *b,
                       int no, const int64_t *so, double *c) {
  int64_t m = sa[na - 2], k = sa[na - 1], n = sb[nb - 1];
  int bnd = no - 2;
  int64_t nbatch = dlua_shape_numel(bnd, so);
  for (int64_t bi = 0; bi < nbatch; bi++) {
    int64_t coord[8], rem = bi;
    for (int d = bnd - 1; d >= 0; d--) {
      coord[d] = rem % so[d];
      rem /= so[d];
    }
    int64_t ao = 0, bo = 0;
    for (int d = 0, da = d - (bnd - (na - 2)); d < bnd; d++, da++)
      if (da >= 0) ao = ao * sa[da] + (sa[da] == 1 ? 0 : coord[d]);
    for (int d = 0, db = d - (bnd - (nb - 2)); d < bnd; d++, db++)
      if (db >= 0) bo = bo * sb[db] + (sb[db] == 1 ? 0 : coord[d]);
    ref_mm(m, n, k, a + ao * m * k, b + bo * k * n, c + bi * m * n);
  }
}

static void check_matmul(int na, const int64_t *sa, int nb, const int64_t *sb, int no, const int64_t *so,
                         int layout_a, const char *what) {
  dlua_tensor_t *a = NULL, *b = make_rand(nb, sb, DLUA_DTYPE_F32);
  if (layout_a == 1) {  // build a as the transpose of a (..., k, m) tensor
    int64_t st[8];
    memcpy(st, sa, sizeof(int64_t) * (size_t)na);
    st[na - 2] = sa[na - 1];
    st[na - 1] = sa[na - 2];
    dlua_tensor_t *a0 = make_rand(na, st, DLUA_DTYPE_F32);
    ck_assert_int_eq(dlua_tensor_transpose(&a, a0, na - 2, na - 1), DLUA_OK);
    dlua_tensor_free(a0);
  } else if (layout_a == 2) {  // a narrowed from (..., m + 1, k): batches do not stack
    int64_t st[8];
    memcpy(st, sa, sizeof(int64_t) * (size_t)na);
    st[na - 2] += 1;
    dlua_tensor_t *a0 = make_rand(na, st, DLUA_DTYPE_F32);
    ck_assert_int_eq(dlua_tensor_narrow(&a, a0, na - 2, 1, sa[na - 2]), DLUA_OK);
    dlua_tensor_free(a0);
  } else {
    a = make_rand(na, sa, DLUA_DTYPE_F32);
  }
  double *av = tu_values(a), *bv = tu_values(b);
  int64_t total = dlua_shape_numel(no, so);
  double *want = malloc(sizeof(double) * (size_t)total);
  ref_matmul(na, sa, av, nb, sb, bv, no, so, want);
  dlua_tensor_t *out = NULL;
  ck_assert_msg(dlua_tensor_matmul(&out, a, b) == DLUA_OK, "%s: %s", what, dlua_last_error());
  expect_shape(out, no, so);
  double *got = tu_values(out);
  tu_expect_close(got, want, total, 1e-5, what);
  free(av);
  free(bv);
  free(want);
  free(got);
  dlua_tensor_free(out);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}

START_TEST(test_matmul_batched) {
  {  // batch broadcast: (2, 1, 3, 4) @ (5, 4, 2) -> (2, 5, 3, 2)
    int64_t sa[4] = {2, 1, 3, 4}, sb[3] = {5, 4, 2}, so[4] = {2, 5, 3, 2};
    check_matmul(4, sa, 3, sb, 4, so, 0, "broadcast batch");
    check_matmul(4, sa, 3, sb, 4, so, 1, "broadcast batch, a transposed");
  }
  {  // (3, 5, 7) @ (7, 2): folds into one (15, 7) x (7, 2) product
    int64_t sa[3] = {3, 5, 7}, sb[2] = {7, 2}, so[3] = {3, 5, 2};
    check_matmul(3, sa, 2, sb, 3, so, 0, "3-D @ 2-D");
    check_matmul(3, sa, 2, sb, 3, so, 1, "3-D transposed @ 2-D");
    check_matmul(3, sa, 2, sb, 3, so, 2, "3-D narrowed @ 2-D");
  }
  {  // (5, 7) @ (3, 7, 2): a broadcast over b's batch
    int64_t sa[2] = {5, 7}, sb[3] = {3, 7, 2}, so[3] = {3, 5, 2};
    check_matmul(2, sa, 3, sb, 3, so, 0, "2-D @ 3-D");
  }
  {  // many tiny products: parallel over the batch
    int64_t sa[3] = {64, 2, 3}, sb[3] = {64, 3, 1}, so[3] = {64, 2, 1};
    check_matmul(3, sa, 3, sb, 3, so, 0, "64 tiny products");
  }
  {  // (7) @ (2, 7, 3) -> (2, 3) and (2, 3, 7) @ (7) -> (2, 3)
    int64_t s7[1] = {7}, sb[3] = {2, 7, 3}, sa[3] = {2, 3, 7}, so[2] = {2, 3};
    dlua_tensor_t *v = make_rand(1, s7, DLUA_DTYPE_F32), *b = make_rand(3, sb, DLUA_DTYPE_F32), *a = make_rand(3, sa, DLUA_DTYPE_F32);
    double *vv = tu_values(v), *bv = tu_values(b), *av = tu_values(a), want[6];
    for (int i = 0; i < 2; i++) ref_mm(1, 3, 7, vv, bv + i * 21, want + i * 3);
    dlua_tensor_t *out = NULL;
    ck_assert_int_eq(dlua_tensor_matmul(&out, v, b), DLUA_OK);
    expect_shape(out, 2, so);
    double *g = tu_values(out);
    tu_expect_close(g, want, 6, 1e-5, "vector @ batch");
    free(g);
    dlua_tensor_free(out);
    for (int i = 0; i < 2; i++) ref_mm(3, 1, 7, av + i * 21, vv, want + i * 3);
    out = NULL;
    ck_assert_int_eq(dlua_tensor_matmul(&out, a, v), DLUA_OK);
    expect_shape(out, 2, so);
    g = tu_values(out);
    tu_expect_close(g, want, 6, 1e-5, "batch @ vector");
    free(g);
    dlua_tensor_free(out);
    free(vv);
    free(bv);
    free(av);
    dlua_tensor_free(v);
    dlua_tensor_free(a);
    dlua_tensor_free(b);
  }
  {  // non-broadcastable batches
    int64_t sa[3] = {2, 3, 4}, sb[3] = {3, 4, 5};
    dlua_tensor_t *a = make_rand(3, sa, DLUA_DTYPE_F32), *b = make_rand(3, sb, DLUA_DTYPE_F32), *out = NULL;
    ck_assert_int_eq(dlua_tensor_matmul(&out, a, b), DLUA_ERR_ARG);
    ck_assert_ptr_nonnull(strstr(dlua_last_error(), "matmul:"));
    dlua_tensor_free(a);
    dlua_tensor_free(b);
  }
}
END_TEST

/* ---- addmm ------------------------------------------------------------------------------------ */

START_TEST(test_addmm) {
  int64_t sa[2] = {5, 3}, sb[2] = {3, 4}, sc[1] = {4}, so[2] = {5, 4};
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F32), *b = make_rand(2, sb, DLUA_DTYPE_F32);
  dlua_tensor_t *bias = make_rand(1, sc, DLUA_DTYPE_F32);
  double *av = tu_values(a), *bv = tu_values(b), *cv = tu_values(bias), p[20], want[20];
  ref_mm(5, 4, 3, av, bv, p);
  for (int i = 0; i < 20; i++) want[i] = 0.5 * cv[i % 4] + 2.0 * p[i];
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_tensor_addmm(&out, bias, a, b, 0.5, 2.0), DLUA_OK);
  expect_shape(out, 2, so);
  double *g = tu_values(out);
  tu_expect_close(g, want, 20, 1e-5, "addmm broadcast bias");
  free(g);
  dlua_tensor_free(out);
  // beta = 0: c is not read, so NaN in it does not leak.
  double nanv[4] = {NAN, NAN, NAN, NAN};
  dlua_tensor_t *cn = tu_make(1, sc, DLUA_DTYPE_F32, nanv);
  out = NULL;
  ck_assert_int_eq(dlua_tensor_addmm(&out, cn, a, b, 0.0, 1.0), DLUA_OK);
  g = tu_values(out);
  tu_expect_close(g, p, 20, 1e-5, "addmm beta 0");
  free(g);
  dlua_tensor_free(out);
  // In place: out is c itself (addmm_).
  dlua_tensor_t *c2 = make_rand(2, so, DLUA_DTYPE_F32), *keep = c2;
  double *c2v = tu_values(c2);
  for (int i = 0; i < 20; i++) want[i] = c2v[i] + p[i];
  ck_assert_int_eq(dlua_tensor_addmm(&c2, c2, a, b, 1.0, 1.0), DLUA_OK);
  ck_assert_ptr_eq(c2, keep);
  g = tu_values(c2);
  tu_expect_close(g, want, 20, 1e-5, "addmm in place");
  free(g);
  // float64 with a transposed a.
  int64_t sat[2] = {3, 5};
  dlua_tensor_t *a64 = make_rand(2, sat, DLUA_DTYPE_F64), *a64t = NULL, *b64 = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&a64t, a64, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_to_dtype(&b64, b, DLUA_DTYPE_F64), DLUA_OK);
  double *a64v = tu_values(a64t);
  ref_mm(5, 4, 3, a64v, bv, p);
  for (int i = 0; i < 20; i++) want[i] = -1.0 * cv[i % 4] + 3.0 * p[i];
  out = NULL;
  ck_assert_int_eq(dlua_tensor_addmm(&out, bias, a64t, b64, -1.0, 3.0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_F64);
  g = tu_values(out);
  tu_expect_close(g, want, 20, 1e-6, "addmm float64");  // bias is float32, exact in float64
  free(g);
  dlua_tensor_free(out);
  // A c that does not broadcast.
  int64_t bad[1] = {3};
  dlua_tensor_t *cb = make_rand(1, bad, DLUA_DTYPE_F32);
  out = NULL;
  ck_assert_int_eq(dlua_tensor_addmm(&out, cb, a, b, 1.0, 1.0), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "addmm:"));
  free(av);
  free(bv);
  free(cv);
  free(c2v);
  free(a64v);
  dlua_tensor_t *ts[] = {a, b, bias, cn, c2, a64, a64t, b64, cb};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dlua_tensor_free(ts[i]);
}
END_TEST

/* ---- f64 GEMM accuracy and thread independence ------------------------------------------------ */

START_TEST(test_f64_large) {
  int64_t sa[2] = {131, 257}, sb[2] = {257, 139};  // several tiles and a partial k block
  dlua_tensor_t *a = make_rand(2, sa, DLUA_DTYPE_F64), *b = make_rand(2, sb, DLUA_DTYPE_F64);
  check_mm_tensors(a, b, 1e-12, "f64 131x257x139");
  dlua_tensor_t *bt = NULL;
  int64_t sbt[2] = {139, 257};
  dlua_tensor_t *b0 = make_rand(2, sbt, DLUA_DTYPE_F64);
  ck_assert_int_eq(dlua_tensor_transpose(&bt, b0, 0, 1), DLUA_OK);
  check_mm_tensors(a, bt, 1e-12, "f64 transposed b");
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(b0);
  dlua_tensor_free(bt);
}
END_TEST

/* ---- bfloat16 products (oneDNN's bf16 GEMM, float32 accumulation) ------------------------------------
   The reference is the product of the same bf16 values in float64, rounded once to bf16 here (round to
   nearest even, written without the library's casts). Two kinds of operands:
   - small integers (-8..8): every product and partial sum (|sum| <= 64 k < 2^24) is exact in float32,
     so whatever the summation order the result must be the reference rounded once, bit for bit;
   - uniform values rounded to bf16: the float32 accumulation may differ from the exact sum by
     e32 = (k + 2) 2^-24 sum|a b| (Higham's bound for k products summed in float32, plus the beta term),
     and rounding that to bf16 moves it by at most half the bf16 spacing at the float32 value, which is
     at most one spacing (ulp) at |exact| + e32 (a value just below a power of two may round up to it,
     where the spacing doubles): |got - exact| <= e32 + ulp_bf16(|exact| + e32). */

/* x rounded to bfloat16's 8 significant bits, ties to even (normal range). */
static double bf16_rne(double x) {
  if (x == 0 || !isfinite(x)) return x;
  int e;
  frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  double ulp = ldexp(1.0, e - 8);
  return nearbyint(x / ulp) * ulp;  // the default rounding mode: to nearest, ties to even
}

/* bf16's spacing at |x| > 0: 2^(e-8) for |x| in [2^(e-1), 2^e). */
static double bf16_ulp(double x) {
  if (x == 0) return 0;
  int e;
  frexp(x, &e);
  return ldexp(1.0, e - 8);
}

static double *bf16_vals(int64_t n, int ints) {
  double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double u = tu_xorshift(&rng_state);
    v[i] = ints ? floor((u + 1) * 8.5) - 8 : bf16_rne(u);
  }
  return v;
}

/* The (r, c) bf16 matrix of row-major values v (exact in bf16); transposed: a view of an (c, r) tensor. */
static dlua_tensor_t *bf16_matrix(int64_t r, int64_t c, const double *v, int transposed) {
  if (!transposed) return tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){r, c}, v);
  double *vt = malloc(sizeof(double) * (size_t)(r * c > 0 ? r * c : 1));
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < c; j++) vt[j * r + i] = v[i * c + j];
  dlua_tensor_t *t0 = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){c, r}, vt), *t = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&t, t0, 0, 1), DLUA_OK);
  dlua_tensor_free(t0);
  free(vt);
  return t;
}

/* out (dtype want_dt) against exact values p with magnitudes s (sums of |terms|), as the block above says. */
static void expect_bf16_result(const dlua_tensor_t *out, dlua_dtype_t want_dt, const double *p, const double *s,
                               int64_t total, int64_t k, int exact, const char *what) {
  ck_assert_msg(dlua_tensor_dtype(out) == want_dt, "%s: dtype %s", what, dlua_dtype_name(dlua_tensor_dtype(out)));
  double *got = tu_values(out);
  for (int64_t i = 0; i < total; i++) {
    double want = want_dt == DLUA_DTYPE_BF16 ? bf16_rne(p[i]) : p[i];
    double e32 = (double)(k + 2) * ldexp(1.0, -24) * s[i];
    double bound = e32 + (want_dt == DLUA_DTYPE_BF16 ? bf16_ulp(fabs(p[i]) + e32) : 0.0);
    int ok = exact ? got[i] == want : fabs(got[i] - p[i]) <= bound;
    if (!ok)
      ck_abort_msg("%s: [%lld] = %.9g, exact %.9g (rounded %.9g, bound %.3g)", what, (long long)i, got[i], p[i], want,
                   exact ? 0.0 : bound);
  }
  free(got);
}

static void abs_vals(double *v, int64_t n) {
  for (int64_t i = 0; i < n; i++) v[i] = fabs(v[i]);
}

/* op(A) (m, k) @ op(B) (k, n), both bf16 (ta/tb: transposed views), through mm; and addmm with a bf16
   bias (beta 0.5, alpha 2) and into a float32 accumulator (the linear layer's weight gradient). */
static void check_bf16_mm(int64_t m, int64_t k, int64_t n, int ta, int tb, int ints) {
  char what[160];
  snprintf(what, sizeof what, "bf16 mm (%lld, %lld) x (%lld, %lld) ta=%d tb=%d %s", (long long)m, (long long)k,
           (long long)k, (long long)n, ta, tb, ints ? "integers" : "uniform");
  double *av = bf16_vals(m * k, ints), *bv = bf16_vals(k * n, ints), *cv = bf16_vals(n, ints);
  double *p = malloc(sizeof(double) * (size_t)(m * n + 1)), *sm = malloc(sizeof(double) * (size_t)(m * n + 1));
  double *q = malloc(sizeof(double) * (size_t)(m * n + 1)), *sq = malloc(sizeof(double) * (size_t)(m * n + 1));
  ref_mm(m, n, k, av, bv, p);
  dlua_tensor_t *a = bf16_matrix(m, k, av, ta), *b = bf16_matrix(k, n, bv, tb), *bias = tu_mk(DLUA_DTYPE_BF16, 1, &n, cv);
  abs_vals(av, m * k);
  abs_vals(bv, k * n);
  ref_mm(m, n, k, av, bv, sm);
  dlua_tensor_t *out = NULL;
  ck_assert_msg(dlua_tensor_mm(&out, a, b) == DLUA_OK, "%s: %s", what, dlua_last_error());
  expect_shape(out, 2, (int64_t[2]){m, n});
  expect_bf16_result(out, DLUA_DTYPE_BF16, p, sm, m * n, k, ints, what);
  dlua_tensor_free(out);
  out = NULL;
  for (int64_t i = 0; i < m * n; i++) {
    q[i] = 0.5 * cv[i % n] + 2.0 * p[i];
    sq[i] = 0.5 * fabs(cv[i % n]) + 2.0 * sm[i];
  }
  ck_assert_msg(dlua_tensor_addmm(&out, bias, a, b, 0.5, 2.0) == DLUA_OK, "%s addmm: %s", what, dlua_last_error());
  expect_bf16_result(out, DLUA_DTYPE_BF16, q, sq, m * n, k, ints, what);
  dlua_tensor_free(out);
  // acc (float32) += A B, in place: the float32 result, not rounded to bf16
  double *accv = bf16_vals(m * n, 1);
  dlua_tensor_t *acc = tu_mk(DLUA_DTYPE_F32, 2, (int64_t[2]){m, n}, accv), *keep = acc;
  for (int64_t i = 0; i < m * n; i++) {
    q[i] = accv[i] + p[i];
    sq[i] = fabs(accv[i]) + sm[i];
  }
  ck_assert_msg(dlua_tensor_addmm(&acc, acc, a, b, 1.0, 1.0) == DLUA_OK, "%s into f32: %s", what, dlua_last_error());
  ck_assert_ptr_eq(acc, keep);
  expect_bf16_result(acc, DLUA_DTYPE_F32, q, sq, m * n, k, ints, what);
  dlua_tensor_t *ts[] = {a, b, bias, acc};
  for (size_t i = 0; i < 4; i++) dlua_tensor_free(ts[i]);
  free(av);
  free(bv);
  free(cv);
  free(accv);
  free(p);
  free(sm);
  free(q);
  free(sq);
}

START_TEST(test_bf16_products) {
  // k not a multiple of 16 (oneDNN's bf16 kernels work on pairs and blocks of k), tall and wide, a
  // float32 accumulation past bf16's 8 bits (k = 1000 of integers: sums to 64000, ties included)
  static const int64_t shapes[][3] = {{37, 53, 29}, {5, 17, 3}, {128, 64, 10}, {64, 1000, 48}, {2, 7, 300}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int t = 0; t < 4; t++)
      for (int ints = 0; ints < 2; ints++) check_bf16_mm(shapes[s][0], shapes[s][1], shapes[s][2], t & 1, t >> 1, ints);
  // matrix-vector shapes (the thread-independent GEMV on float32 copies)
  check_bf16_mm(1, 300, 40, 0, 1, 0);
  check_bf16_mm(40, 300, 1, 1, 0, 1);
  // batched matmul: (3, 20, 37) @ (3, 37, 24), and (3, 20, 37) @ (37, 24) (one taller product)
  for (int shared = 0; shared < 2; shared++) {
    int64_t m = 20, k = 37, n = 24, nb = 3;
    double *av = bf16_vals(nb * m * k, 0), *bv = bf16_vals((shared ? 1 : nb) * k * n, 0);
    double *p = malloc(sizeof(double) * (size_t)(nb * m * n)), *sm = malloc(sizeof(double) * (size_t)(nb * m * n));
    for (int64_t i = 0; i < nb; i++) ref_mm(m, n, k, av + i * m * k, bv + (shared ? 0 : i * k * n), p + i * m * n);
    dlua_tensor_t *a = tu_mk(DLUA_DTYPE_BF16, 3, (int64_t[3]){nb, m, k}, av);
    dlua_tensor_t *b = shared ? tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){k, n}, bv)
                              : tu_mk(DLUA_DTYPE_BF16, 3, (int64_t[3]){nb, k, n}, bv);
    abs_vals(av, nb * m * k);
    abs_vals(bv, (shared ? 1 : nb) * k * n);
    for (int64_t i = 0; i < nb; i++) ref_mm(m, n, k, av + i * m * k, bv + (shared ? 0 : i * k * n), sm + i * m * n);
    dlua_tensor_t *out = NULL;
    ck_assert_msg(dlua_tensor_matmul(&out, a, b) == DLUA_OK, "bf16 matmul: %s", dlua_last_error());
    expect_shape(out, 3, (int64_t[3]){nb, m, n});
    expect_bf16_result(out, DLUA_DTYPE_BF16, p, sm, nb * m * n, k, 0, shared ? "bf16 matmul 3-D @ 2-D" : "bf16 matmul batched");
    dlua_tensor_free(out);
    dlua_tensor_free(a);
    dlua_tensor_free(b);
    free(av);
    free(bv);
    free(p);
    free(sm);
  }
  // empty dims: (0, 5) x (5, 3) is (0, 3); (3, 0) x (0, 4) is zeros, and addmm's beta * c
  double five[15] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  dlua_tensor_t *e0 = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){0, 5}, five), *e1 = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){5, 3}, five);
  dlua_tensor_t *out = NULL;
  ck_assert_int_eq(dlua_tensor_mm(&out, e0, e1), DLUA_OK);
  expect_shape(out, 2, (int64_t[2]){0, 3});
  ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_BF16);
  dlua_tensor_free(out);
  dlua_tensor_t *k0a = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){3, 0}, five), *k0b = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){0, 4}, five);
  dlua_tensor_t *c12 = tu_mk(DLUA_DTYPE_BF16, 2, (int64_t[2]){3, 4}, five);
  out = NULL;
  ck_assert_int_eq(dlua_tensor_mm(&out, k0a, k0b), DLUA_OK);
  double zeros[12] = {0}, half[12], absum[12];
  for (int i = 0; i < 12; i++) {
    half[i] = 0.5 * five[i];
    absum[i] = half[i];
  }
  expect_bf16_result(out, DLUA_DTYPE_BF16, zeros, zeros, 12, 0, 1, "bf16 mm k = 0");
  dlua_tensor_free(out);
  out = NULL;
  ck_assert_int_eq(dlua_tensor_addmm(&out, c12, k0a, k0b, 0.5, 1.0), DLUA_OK);
  expect_bf16_result(out, DLUA_DTYPE_BF16, half, absum, 12, 0, 1, "bf16 addmm k = 0");
  dlua_tensor_free(out);
  dlua_tensor_t *ts[] = {e0, e1, k0a, k0b, c12};
  for (size_t i = 0; i < 5; i++) dlua_tensor_free(ts[i]);
}
END_TEST

/* The same product computed with 1 and 2 threads must agree bit for bit. */
static void same_with_threads(int64_t m, int64_t k, int64_t n, dlua_dtype_t dt) {
  int64_t sa[2] = {m, k}, sb[2] = {k, n};
  dlua_tensor_t *a = make_rand(2, sa, dt), *b = make_rand(2, sb, dt), *o1 = NULL, *o2 = NULL;
  int saved = dlua_get_num_threads();
  dlua_set_num_threads(1);
  ck_assert_int_eq(dlua_tensor_mm(&o1, a, b), DLUA_OK);
  dlua_set_num_threads(2);
  ck_assert_int_eq(dlua_tensor_mm(&o2, a, b), DLUA_OK);
  dlua_set_num_threads(saved);
  size_t bytes = (size_t)(m * n) * dlua_dtype_size(dt);
  ck_assert_msg(memcmp(dlua_tensor_data(o1), dlua_tensor_data(o2), bytes) == 0,
                "mm (%lld, %lld) x (%lld, %lld) %s differs between 1 and 2 threads", (long long)m, (long long)k,
                (long long)k, (long long)n, dlua_dtype_name(dt));
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(o1);
  dlua_tensor_free(o2);
}

START_TEST(test_thread_independent) {
  same_with_threads(1, 100000, 1, DLUA_DTYPE_F32);
  same_with_threads(1, 20000, 7, DLUA_DTYPE_F32);
  same_with_threads(9, 20000, 1, DLUA_DTYPE_F32);
  same_with_threads(16, 50000, 16, DLUA_DTYPE_F32);
  same_with_threads(200, 300, 100, DLUA_DTYPE_F32);
  same_with_threads(100, 300, 150, DLUA_DTYPE_F64);
  same_with_threads(200, 300, 100, DLUA_DTYPE_BF16);
  same_with_threads(16, 50000, 16, DLUA_DTYPE_BF16);
  same_with_threads(1, 20000, 7, DLUA_DTYPE_BF16);
}
END_TEST

/* The front doors reach the kernels through the blas table (kernels/blas.h): the CPU's is dlua_cpu_blas_ops, its
   gemm runs on a descriptor alone, and a tensor on device 0 without a CUDA device gets the registry's one message. */
START_TEST(test_backend_table) {
  const struct dlua_blas_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("mm", DLUA_CPU, blas, gemm, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_blas_ops);
  dlua_gemm_caps_t caps;
  ck_assert_int_eq(k->caps("mm", DLUA_DTYPE_BF16, &caps), DLUA_OK);
  ck_assert_int_eq(caps.dtype, DLUA_DTYPE_F32);  // 16-bit products accumulate in float32 on the CPU
  ck_assert_int_eq(k->caps("mm", DLUA_DTYPE_I32, &caps), DLUA_OK);
  ck_assert_int_eq(caps.dtype, DLUA_DTYPE_I64);
  // The gemm slot on a descriptor: a batch of two (2, 2) x (2, 1) float64 products with a shared B, C = 2 AB + C.
  const double av[8] = {1, 2, 3, 4, 5, 6, 7, 8}, bv[2] = {1, -1};
  double cv[4] = {10, 20, 30, 40};
  dlua_gemm_desc_t d = {.dtype = DLUA_DTYPE_F64, .m = 2, .n = 1, .k = 2, .ars = 2, .acs = 1, .brs = 1, .bcs = 1,
                        .bnd = 1, .bsz = {2}, .ast = {4}, .bst = {0}, .cst = {2}, .a = av, .b = bv, .c = cv,
                        .alpha = 2.0, .beta = 1.0, .device = DLUA_CPU};
  ck_assert_int_eq(k->gemm("mm", &d), DLUA_OK);
  ck_assert(cv[0] == 8 && cv[1] == 18 && cv[2] == 28 && cv[3] == 38);
  // bf16 operands stay bf16 (caps.bf16_ab) where oneDNN has its bf16 GEMM (AVX-512), for a bf16 result and
  // for a float32 one (a bf16 product added into float32); f16 operands are staged (a->dtype decides).
  __builtin_cpu_init();
  int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  for (int rd = 0; rd < 3; rd++) {
    const dlua_dtype_t rdt[3] = {DLUA_DTYPE_BF16, DLUA_DTYPE_F32, DLUA_DTYPE_F16};
    ck_assert_int_eq(k->caps("mm", rdt[rd], &caps), DLUA_OK);
    ck_assert_int_eq(caps.dtype, DLUA_DTYPE_F32);
    if (avx512) ck_assert_int_eq(caps.bf16_ab, 1);
  }
  ck_assert_int_eq(k->caps("mm", DLUA_DTYPE_F64, &caps), DLUA_OK);
  ck_assert_int_eq(caps.bf16_ab, 0);
  if (!avx512) printf("test_backend_table: no AVX-512 on this CPU, so no bf16 GEMM in oneDNN: bf16_ab not checked\n");
  if (caps.bf16_ab || (k->caps("mm", DLUA_DTYPE_BF16, &caps) == DLUA_OK && caps.bf16_ab)) {
    // C (2, 2) f32 = 2 A B + C for bf16 A (2, 3) and B (3, 2) on a descriptor, and the (2, 3) x (3, 1) GEMV
    const float af[6] = {1, 2, 3, 4, 5, 6}, bf[6] = {1, -1, 0.5f, 2, -3, 0.25f};
    uint16_t ah[6], bh[6];
    for (int i = 0; i < 6; i++) {
      ah[i] = dlua_f32_to_bf16(af[i]);
      bh[i] = dlua_f32_to_bf16(bf[i]);
    }
    float cf[4] = {10, 20, 30, 40};
    dlua_gemm_desc_t h = {.dtype = DLUA_DTYPE_F32, .ab_bf16 = 1, .m = 2, .n = 2, .k = 3, .ars = 3, .acs = 1,
                          .brs = 2, .bcs = 1, .a = ah, .b = bh, .c = cf, .alpha = 2.0, .beta = 1.0, .device = DLUA_CPU};
    ck_assert_int_eq(k->gemm("mm", &h), DLUA_OK);
    // A B = [[1 + 1 - 9, -1 + 4 + 0.75], [4 + 2.5 - 18, -4 + 10 + 1.5]] = [[-7, 3.75], [-11.5, 7.5]]
    ck_assert_msg(cf[0] == -4 && cf[1] == 27.5f && cf[2] == 7 && cf[3] == 55, "%g %g %g %g", cf[0], cf[1], cf[2], cf[3]);
    float cv1[2] = {0, 0};
    h.n = 1;
    h.brs = 2;  // B's first column, (3, 1) with row stride 2
    h.c = cv1;
    h.beta = 0.0;
    ck_assert_int_eq(k->gemm("mm", &h), DLUA_OK);
    ck_assert_msg(cv1[0] == -14 && cv1[1] == -23, "%g %g", cv1[0], cv1[1]);
  }

  const int64_t sz[2] = {2, 2};
  dlua_tensor_t *a = make_rand(2, sz, DLUA_DTYPE_F32), *out = NULL;
  if (dlua_cuda_device_count() > 0) {
    const dlua_backend_t *be = NULL;
    ck_assert_int_eq(dlua_backend_for("mm", 0, &be), DLUA_OK);
    ck_assert_int_eq(DLUA_BACKEND("mm", 0, blas, gemm, &k), DLUA_OK);
    ck_assert_ptr_eq(k, be->blas);
    ck_assert_int_eq(k->caps("mm", DLUA_DTYPE_BF16, &caps), DLUA_OK);
    ck_assert_int_eq(caps.dtype, DLUA_DTYPE_BF16);
  } else {
    // A handle claiming device 0 (never dereferenced: the registry answers before any kernel runs).
    dlua_tensor_t on0 = *a;
    on0.device = 0;
    ck_assert_int_eq(dlua_tensor_mm(&out, &on0, &on0), DLUA_ERR_ARG);
    const char *e = dlua_last_error();
    ck_assert_msg(strstr(e, "mm: no CUDA device available (") != NULL, "%s", e);
    ck_assert_int_eq(dlua_tensor_matmul(&out, &on0, &on0), DLUA_ERR_ARG);
    e = dlua_last_error();
    ck_assert_msg(strstr(e, "matmul: no CUDA device available (") != NULL, "%s", e);
    ck_assert_ptr_null(out);
  }
  dlua_tensor_free(a);
}
END_TEST

int main(void) {
  Suite *s = suite_create("linalg");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_sgemm_shapes);
  tcase_add_test(tc, test_sgemm_degenerate);
  tcase_add_test(tc, test_mm_layouts);
  tcase_add_test(tc, test_mm_sizes_and_dtypes);
  tcase_add_test(tc, test_mm_empty);
  tcase_add_test(tc, test_mm_errors);
  tcase_add_test(tc, test_mm_into_out);
  tcase_add_test(tc, test_bmm);
  tcase_add_test(tc, test_matmul_vectors);
  tcase_add_test(tc, test_matmul_batched);
  tcase_add_test(tc, test_addmm);
  tcase_add_test(tc, test_f64_large);
  tcase_add_test(tc, test_bf16_products);
  tcase_add_test(tc, test_thread_independent);
  tcase_add_test(tc, test_backend_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

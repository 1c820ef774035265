/* Check suite for host/ops/reduce.c and host/cpu/reduce.c: every reduction against a double-precision reference. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/reduce.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static const dlua_dtype_t ALL_DT[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                      DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8,  DLUA_DTYPE_BOOL};

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

/* ---- the reference: plain loops in double over the logical (row-major) values ---------------- */

/* For each output (kept dims row-major) the reduced elements in logical row-major order. */
static int64_t ref_reduce(dlua_reduce_op_t op, const double *x, int nd, const int64_t *sz, const int *mask, double p,
                          double *outv, int64_t *outi, double *abs_sum) {
  int kd[8], rdm[8], nk = 0, nr = 0;
  int64_t O = 1, R = 1;
  for (int d = 0; d < nd; d++) {
    if (mask[d]) rdm[nr++] = d, R *= sz[d];
    else kd[nk++] = d, O *= sz[d];
  }
  double *vals = malloc((size_t)(R > 0 ? R : 1) * sizeof(double));
  for (int64_t o = 0; o < O; o++) {
    int64_t idx[8] = {0}, q = o;
    for (int i = nk - 1; i >= 0; i--) idx[kd[i]] = q % sz[kd[i]], q /= sz[kd[i]];
    for (int64_t r = 0; r < R; r++) {
      int64_t q2 = r;
      for (int i = nr - 1; i >= 0; i--) idx[rdm[i]] = q2 % sz[rdm[i]], q2 /= sz[rdm[i]];
      int64_t lin = 0;
      for (int d = 0; d < nd; d++) lin = lin * sz[d] + idx[d];
      vals[r] = x[lin];
    }
    double acc = 0, asum = 0;
    int64_t best = -1;
    for (int64_t r = 0; r < R; r++) asum += fabs(vals[r]);
    switch (op) {
      case DLUA_REDUCE_SUM:
      case DLUA_REDUCE_MEAN:
        for (int64_t r = 0; r < R; r++) acc += vals[r];
        if (op == DLUA_REDUCE_MEAN) acc /= (double)R;
        break;
      case DLUA_REDUCE_PROD:
        acc = 1;
        for (int64_t r = 0; r < R; r++) acc *= vals[r];
        break;
      case DLUA_REDUCE_MAX:
      case DLUA_REDUCE_MIN:
      case DLUA_REDUCE_ARGMAX:
      case DLUA_REDUCE_ARGMIN: {
        int is_max = op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_ARGMAX;
        for (int64_t r = 0; r < R; r++) {
          if (isnan(vals[r])) {  // the first NaN is the answer
            best = r;
            break;
          }
          if (best < 0 || (is_max ? vals[r] > vals[best] : vals[r] < vals[best])) best = r;
        }
        acc = vals[best];
        break;
      }
      case DLUA_REDUCE_NORM:
        if (isinf(p)) {
          for (int64_t r = 0; r < R; r++) acc = (isnan(vals[r]) || isnan(acc)) ? NAN : fmax(acc, fabs(vals[r]));
        } else if (p == 0) {
          for (int64_t r = 0; r < R; r++) acc += vals[r] != 0;
        } else {
          for (int64_t r = 0; r < R; r++) acc += pow(fabs(vals[r]), p);
          acc = pow(acc, 1 / p);
        }
        break;
      case DLUA_REDUCE_VAR:
      case DLUA_REDUCE_STD: {
        double m = 0;
        for (int64_t r = 0; r < R; r++) m += vals[r];
        m /= (double)R;
        for (int64_t r = 0; r < R; r++) acc += (vals[r] - m) * (vals[r] - m);
        acc /= fmax(0.0, (double)R - p);
        if (op == DLUA_REDUCE_STD) acc = sqrt(acc);
        break;
      }
      case DLUA_REDUCE_ANY:
        for (int64_t r = 0; r < R; r++) acc = acc || vals[r] != 0;
        break;
      case DLUA_REDUCE_ALL:
        acc = 1;
        for (int64_t r = 0; r < R; r++) acc = acc && vals[r] != 0;
        break;
      default:
        for (int64_t r = 0; r < R; r++) acc += !isfinite(vals[r]);
        break;
    }
    outv[o] = acc;
    if (outi) outi[o] = best;
    if (abs_sum) abs_sum[o] = asum;
  }
  free(vals);
  return O;
}

static dlua_dtype_t result_dtype(dlua_reduce_op_t op, dlua_dtype_t dt) {
  int fl = dlua_dtype_is_floating(dt);
  switch (op) {
    case DLUA_REDUCE_SUM:
    case DLUA_REDUCE_PROD: return fl ? dt : DLUA_DTYPE_I64;
    case DLUA_REDUCE_ARGMAX:
    case DLUA_REDUCE_ARGMIN:
    case DLUA_REDUCE_COUNT_NONFINITE: return DLUA_DTYPE_I64;
    case DLUA_REDUCE_ANY:
    case DLUA_REDUCE_ALL: return DLUA_DTYPE_BOOL;
    default: return dt;
  }
}

/* Runs op over every subset of dims of t (logical values x), keepdim both ways, and compares. */
static void check_all_dim_sets(dlua_reduce_op_t op, const dlua_tensor_t *t, const double *x, double p,
                               const char *what) {
  int nd = dlua_tensor_ndim(t);
  const int64_t *sz = dlua_tensor_sizes(t);
  dlua_dtype_t dt = dlua_tensor_dtype(t);
  int64_t n = dlua_tensor_numel(t);
  double *wv = malloc((size_t)(n + 1) * sizeof(double)), *asum = malloc((size_t)(n + 1) * sizeof(double));
  int64_t *wi = malloc((size_t)(n + 1) * sizeof(int64_t));
  for (int set = 0; set < (1 << nd); set++) {
    int mask[8] = {0}, dims[8], ndims = 0;
    for (int d = 0; d < nd; d++)
      if (set & (1 << d)) mask[d] = 1, dims[ndims++] = d;
    if (ndims == 0)
      for (int d = 0; d < nd; d++) mask[d] = 1;  // ndims == 0 means every dim
    int64_t O = ref_reduce(op, x, nd, sz, mask, p, wv, wi, asum);
    for (int keep = 0; keep < 2; keep++) {
      dlua_tensor_t *o = NULL, *ix = NULL;
      int want_idx = op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN;
      ck_assert_msg(dlua_tensor_reduce(&o, want_idx ? &ix : NULL, t, op, ndims, dims, keep, p, 1) == DLUA_OK,
                    "%s: %s", what, dlua_last_error());
      ck_assert_int_eq(dlua_tensor_dtype(o), result_dtype(op, dt));
      ck_assert_int_eq(dlua_tensor_numel(o), O);
      ck_assert_int_eq(dlua_tensor_ndim(o), keep ? nd : (ndims == 0 ? 0 : nd - ndims));
      double *g = tu_rd(o);
      for (int64_t i = 0; i < O; i++) {
        double want = wv[i];
        if (op == DLUA_REDUCE_ARGMAX || op == DLUA_REDUCE_ARGMIN) want = (double)(wi[i] + 1);
        double tol = 0;
        if (dlua_dtype_is_floating(dlua_tensor_dtype(o))) {
          dlua_dtype_t od = dlua_tensor_dtype(o);
          double e = od == DLUA_DTYPE_F64 ? 1e-13 : od == DLUA_DTYPE_F32 ? 1e-6 : od == DLUA_DTYPE_F16 ? 0x1p-10 : 0x1p-7;
          double scale = (op == DLUA_REDUCE_SUM || op == DLUA_REDUCE_MEAN) ? asum[i] : fabs(want);
          tol = e * (scale + fabs(want));
          if (op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD) tol = e * (fabs(want) + 1e-12);
          want = tu_as_dtype(od, want);
        }
        ck_assert_msg(tu_close_to(g[i], want, tol), "%s set %d keep %d [%lld]: got %.17g want %.17g", what, set, keep,
                      (long long)i, g[i], want);
      }
      free(g);
      if (ix) {
        ck_assert_int_eq(dlua_tensor_dtype(ix), DLUA_DTYPE_I64);
        double *gi = tu_rd(ix);
        for (int64_t i = 0; i < O; i++)
          ck_assert_msg(gi[i] == (double)(wi[i] + 1), "%s indices set %d [%lld]: got %g want %lld", what, set,
                        (long long)i, gi[i], (long long)(wi[i] + 1));
        free(gi);
      }
      dlua_tensor_free(o);
      dlua_tensor_free(ix);
    }
  }
  free(wv), free(asum), free(wi);
}

/* ---- tests ------------------------------------------------------------------------------------ */

/* Every op over every dim set of a (3, 5, 7) tensor, contiguous, permuted and narrowed. */
START_TEST(test_ops_dims_layouts) {
  static const dlua_reduce_op_t float_ops[] = {
      DLUA_REDUCE_SUM, DLUA_REDUCE_MEAN, DLUA_REDUCE_PROD, DLUA_REDUCE_MAX, DLUA_REDUCE_MIN, DLUA_REDUCE_ARGMAX,
      DLUA_REDUCE_ARGMIN, DLUA_REDUCE_NORM, DLUA_REDUCE_VAR, DLUA_REDUCE_STD, DLUA_REDUCE_ANY, DLUA_REDUCE_ALL,
      DLUA_REDUCE_COUNT_NONFINITE};
  int64_t sz[3] = {3, 5, 7}, big[3] = {4, 9, 7};
  for (int di = 0; di < 4; di++) {
    dlua_dtype_t dt = ALL_DT[di];
    double v[252];
    for (int i = 0; i < 252; i++) v[i] = tu_as_dtype(dt, tu_lcg(&rng_state) * 2);
    v[5] = 0;
    dlua_tensor_t *c = tu_mk(dt, 3, sz, v), *bigt = tu_mk(dt, 3, big, v), *perm = NULL, *nar = NULL;
    int pd[3] = {2, 0, 1};
    ck_assert_int_eq(dlua_tensor_permute(&perm, c, pd), DLUA_OK);  // (7, 3, 5)
    ck_assert_int_eq(dlua_tensor_narrow(&nar, bigt, 1, 2, 5), DLUA_OK);  // (4, 5, 7), strided
    dlua_tensor_t *layouts[3] = {c, perm, nar};
    for (int l = 0; l < 3; l++) {
      double *x = tu_rd(layouts[l]);
      for (size_t k = 0; k < sizeof float_ops / sizeof float_ops[0]; k++) {
        dlua_reduce_op_t op = float_ops[k];
        char what[96];
        snprintf(what, sizeof what, "op %d %s layout %d", op, dlua_dtype_name(dt), l);
        if (op == DLUA_REDUCE_NORM) {
          static const double ps[] = {1, 2, INFINITY, 3, 0};
          for (int pi = 0; pi < 5; pi++) check_all_dim_sets(op, layouts[l], x, ps[pi], what);
        } else if (op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD) {
          check_all_dim_sets(op, layouts[l], x, 1, what);
          check_all_dim_sets(op, layouts[l], x, 0, what);
        } else {
          check_all_dim_sets(op, layouts[l], x, 0, what);
        }
      }
      free(x);
    }
    dlua_tensor_free(perm), dlua_tensor_free(nar), dlua_tensor_free(c), dlua_tensor_free(bigt);
  }
}
END_TEST

/* Integer and bool inputs: sums/products widen to int64, max/min keep the dtype. */
START_TEST(test_integer_ops) {
  static const dlua_reduce_op_t ops[] = {DLUA_REDUCE_SUM, DLUA_REDUCE_PROD, DLUA_REDUCE_MAX,  DLUA_REDUCE_MIN,
                                         DLUA_REDUCE_ARGMAX, DLUA_REDUCE_ARGMIN, DLUA_REDUCE_ANY, DLUA_REDUCE_ALL,
                                         DLUA_REDUCE_COUNT_NONFINITE};
  int64_t sz[3] = {2, 3, 5};
  for (int di = 4; di < 8; di++) {
    dlua_dtype_t dt = ALL_DT[di];
    double v[30];
    for (int i = 0; i < 30; i++) v[i] = tu_as_dtype(dt, (double)((i * 7) % 5 - (dt == DLUA_DTYPE_U8 ? 0 : 2)));
    dlua_tensor_t *t = tu_mk(dt, 3, sz, v), *tt = NULL;
    ck_assert_int_eq(dlua_tensor_transpose(&tt, t, 0, 2), DLUA_OK);
    dlua_tensor_t *layouts[2] = {t, tt};
    for (int l = 0; l < 2; l++) {
      double *x = tu_rd(layouts[l]);
      for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
        char what[96];
        snprintf(what, sizeof what, "op %d %s layout %d", ops[k], dlua_dtype_name(dt), l);
        check_all_dim_sets(ops[k], layouts[l], x, 0, what);
      }
      free(x);
    }
    dlua_tensor_t *o = NULL;
    ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_MEAN, 0, NULL, 0, 0, 0), DLUA_ERR_ARG);
    ck_assert(tu_err_has("mean: expected a floating-point tensor"));
    ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_NORM, 0, NULL, 0, 2, 0), DLUA_ERR_ARG);
    ck_assert(tu_err_has("norm:"));
    dlua_tensor_free(tt), dlua_tensor_free(t);
  }
  // int32 sums do not overflow in int32: they count in int64.
  int64_t n = 3;
  int32_t big[3] = {2000000000, 2000000000, 2000000000};
  dlua_tensor_t *t = NULL, *o = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, 1, &n, DLUA_DTYPE_I32, big), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I64);
  ck_assert(*(int64_t *)dlua_tensor_data(o) == 6000000000ll);
  dlua_tensor_free(o), dlua_tensor_free(t);
}
END_TEST

/* f16/bf16 sums accumulate in (at least) f32: naive 16-bit accumulation stalls at 2048 / 256. */
START_TEST(test_half_accumulation) {
  int64_t n = 3000;
  double *ones = malloc(3000 * sizeof(double));
  for (int i = 0; i < 3000; i++) ones[i] = 1;
  dlua_tensor_t *h = tu_mk(DLUA_DTYPE_F16, 1, &n, ones), *o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, h, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F16);
  double *g = tu_rd(o);
  ck_assert(g[0] == 3000);
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, h, DLUA_REDUCE_MEAN, 0, NULL, 0, 0, 0), DLUA_OK);
  g = tu_rd(o);
  ck_assert(g[0] == 1);
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(h);
  int64_t nb = 1000;
  dlua_tensor_t *b = tu_mk(DLUA_DTYPE_BF16, 1, &nb, ones);
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, b, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_BF16);
  g = tu_rd(o);
  ck_assert(g[0] == 1000);
  free(g), dlua_tensor_free(o), dlua_tensor_free(b), free(ones);
}
END_TEST

/* 10^7 f32 values: relative error below 1e-6, and the same bits with 1 and 4 threads. */
START_TEST(test_sum_1e7_accuracy_threads) {
  int64_t n = 10000000;
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&t, 1, &n, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  float *p = dlua_tensor_data(t);
  double ref = 0;
  for (int64_t i = 0; i < n; i++) {
    // All positive and of mixed magnitude: the case where naive float sums drift most.
    p[i] = (float)((tu_lcg(&rng_state) + 1.0) * (i % 3 == 0 ? 100.0 : 0.01));
    ref += p[i];
  }
  int saved = omp_get_max_threads();
  float r[2], m[2];
  for (int k = 0; k < 2; k++) {
    omp_set_num_threads(k == 0 ? 1 : 4);
    dlua_tensor_t *o = NULL, *mo = NULL;
    ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_reduce(&mo, NULL, t, DLUA_REDUCE_MEAN, 0, NULL, 0, 0, 0), DLUA_OK);
    r[k] = *(float *)dlua_tensor_data(o);
    m[k] = *(float *)dlua_tensor_data(mo);
    dlua_tensor_free(o), dlua_tensor_free(mo);
  }
  omp_set_num_threads(saved);
  ck_assert_msg(fabs(r[0] - ref) <= 1e-6 * ref, "sum %.9g vs %.9g", r[0], ref);
  ck_assert_msg(fabs(m[0] - ref / n) <= 1e-6 * ref / n, "mean %.9g vs %.9g", m[0], ref / n);
  ck_assert(memcmp(&r[0], &r[1], sizeof(float)) == 0);
  ck_assert(memcmp(&m[0], &m[1], sizeof(float)) == 0);
  dlua_tensor_free(t);
}
END_TEST

/* Shapes whose schedule depends on the thread count (many outputs vs. few, column sums over
   many blocks): same bits with 1, 2 and 4 threads, and right against the reference. */
START_TEST(test_schedules_thread_independent) {
  struct {
    int64_t sz[3];
    int nd, ndims, dims[2];
  } cases[] = {
      {{8, 40000, 1}, 2, 1, {1}},      // few outputs, several blocks each
      {{40000, 8, 1}, 2, 1, {0}},      // column sum over several blocks
      {{3, 20001, 2}, 3, 2, {0, 2}},   // outer and inner reduced dims
      {{300, 1000, 1}, 2, 1, {1}},     // many outputs
      {{70001, 1, 1}, 1, 0, {0}},      // everything
  };
  static const dlua_reduce_op_t ops[] = {DLUA_REDUCE_SUM, DLUA_REDUCE_NORM, DLUA_REDUCE_VAR, DLUA_REDUCE_ARGMAX};
  int saved = omp_get_max_threads();
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int64_t n = dlua_shape_numel(cases[c].nd, cases[c].sz);
    double *v = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) v[i] = tu_as_dtype(DLUA_DTYPE_F32, tu_lcg(&rng_state) + 0.25);
    dlua_tensor_t *t = tu_mk(DLUA_DTYPE_F32, cases[c].nd, cases[c].sz, v);
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
      double p = ops[k] == DLUA_REDUCE_NORM ? 2 : 1;
      void *first = NULL;
      size_t bytes = 0;
      for (int th = 1; th <= 4; th *= 2) {
        omp_set_num_threads(th);
        dlua_tensor_t *o = NULL;
        ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, ops[k], cases[c].ndims, cases[c].dims, 0, p, 0), DLUA_OK);
        bytes = (size_t)dlua_tensor_numel(o) * dlua_dtype_size(dlua_tensor_dtype(o));
        if (!first) {
          first = malloc(bytes);
          memcpy(first, dlua_tensor_data(o), bytes);
          int mask[3] = {0, 0, 0};
          for (int d = 0; d < cases[c].ndims; d++) mask[cases[c].dims[d]] = 1;
          if (cases[c].ndims == 0) mask[0] = mask[1] = mask[2] = 1;
          double *wv = malloc((size_t)n * sizeof(double)), *as = malloc((size_t)n * sizeof(double));
          int64_t *wi = malloc((size_t)n * sizeof(int64_t));
          int64_t O = ref_reduce(ops[k], v, cases[c].nd, cases[c].sz, mask, p, wv, wi, as);
          double *g = tu_rd(o);
          for (int64_t i = 0; i < O; i++) {
            double want = ops[k] == DLUA_REDUCE_ARGMAX ? (double)wi[i] : wv[i];
            double tol = ops[k] == DLUA_REDUCE_ARGMAX ? 0 : 1e-6 * (as[i] + fabs(wv[i]));
            if (ops[k] == DLUA_REDUCE_VAR) tol = 1e-6 * fabs(wv[i]);
            ck_assert_msg(tu_close_to(g[i], want, tol), "case %zu op %d [%lld]: %.9g vs %.9g", c, ops[k], (long long)i,
                          g[i], want);
          }
          free(g), free(wv), free(as), free(wi);
        } else {
          ck_assert_msg(memcmp(first, dlua_tensor_data(o), bytes) == 0, "case %zu op %d differs with %d threads", c,
                        ops[k], th);
        }
        dlua_tensor_free(o);
      }
      free(first);
    }
    dlua_tensor_free(t);
    free(v);
  }
  omp_set_num_threads(saved);
}
END_TEST

START_TEST(test_empty_inputs) {
  int64_t z = 0, s03[2] = {0, 3};
  dlua_tensor_t *e = NULL, *e2 = NULL, *o = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&e, 1, &z, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_empty(&e2, 2, s03, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  struct {
    dlua_reduce_op_t op;
    double p, want;
  } ok[] = {{DLUA_REDUCE_SUM, 0, 0},   {DLUA_REDUCE_PROD, 0, 1}, {DLUA_REDUCE_MEAN, 0, NAN},
            {DLUA_REDUCE_ANY, 0, 0},   {DLUA_REDUCE_ALL, 0, 1},  {DLUA_REDUCE_COUNT_NONFINITE, 0, 0},
            {DLUA_REDUCE_NORM, 2, 0},  {DLUA_REDUCE_VAR, 1, NAN}};
  for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
    ck_assert_msg(dlua_tensor_reduce(&o, NULL, e, ok[k].op, 0, NULL, 0, ok[k].p, 0) == DLUA_OK, "%s", dlua_last_error());
    ck_assert_int_eq(dlua_tensor_ndim(o), 0);
    double *g = tu_rd(o);
    ck_assert_msg(tu_close_to(g[0], ok[k].want, 0), "empty op %d: %g", ok[k].op, g[0]);
    free(g), dlua_tensor_free(o), o = NULL;
  }
  // max/min/arg* and the inf-norm have no identity.
  static const dlua_reduce_op_t bad[] = {DLUA_REDUCE_MAX, DLUA_REDUCE_MIN, DLUA_REDUCE_ARGMAX, DLUA_REDUCE_ARGMIN};
  for (size_t k = 0; k < 4; k++) {
    ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, e, bad[k], 0, NULL, 0, 0, 0), DLUA_ERR_ARG);
    ck_assert_ptr_null(o);
  }
  ck_assert(tu_err_has("argmin: cannot reduce"));
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, e, DLUA_REDUCE_NORM, 0, NULL, 0, INFINITY, 0), DLUA_ERR_ARG);
  // (0, 3): over dim 0 nothing to take a max of; over dim 1 the result is simply empty.
  int d0 = 0, d1 = 1;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, e2, DLUA_REDUCE_MAX, 1, &d0, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("max:"));
  dlua_tensor_t *ix = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, &ix, e2, DLUA_REDUCE_MAX, 1, &d1, 0, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(o), 0);
  ck_assert_int_eq(dlua_tensor_numel(ix), 0);
  dlua_tensor_free(o), dlua_tensor_free(ix), o = NULL;
  // Sum over dim 0 of (0, 3): three zeros.
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, e2, DLUA_REDUCE_SUM, 1, &d0, 1, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(o), 2);
  ck_assert_int_eq(dlua_tensor_sizes(o)[0], 1);
  ck_assert_int_eq(dlua_tensor_sizes(o)[1], 3);
  double *g = tu_rd(o);
  for (int i = 0; i < 3; i++) ck_assert(g[i] == 0);
  free(g), dlua_tensor_free(o);
  dlua_tensor_free(e), dlua_tensor_free(e2);
}
END_TEST

START_TEST(test_max_min_ties_nan_base) {
  int64_t n = 7;
  double v[7] = {1, 5, 5, -2, -2, 0, 5};
  dlua_tensor_t *t = tu_mk(DLUA_DTYPE_F32, 1, &n, v), *o = NULL, *ix = NULL;
  // First occurrence wins ties; indices count from index_base.
  ck_assert_int_eq(dlua_tensor_reduce(&o, &ix, t, DLUA_REDUCE_MAX, 0, NULL, 0, 0, 1), DLUA_OK);
  ck_assert(*(float *)dlua_tensor_data(o) == 5);
  ck_assert(*(int64_t *)dlua_tensor_data(ix) == 2);
  dlua_tensor_free(o), dlua_tensor_free(ix), o = ix = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_ARGMIN, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert(*(int64_t *)dlua_tensor_data(o) == 3);
  dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(t);
  // The first NaN wins for max and min alike.
  double w[6] = {1, NAN, 3, NAN, -INFINITY, INFINITY};
  int64_t m = 6;
  t = tu_mk(DLUA_DTYPE_F64, 1, &m, w);
  ck_assert_int_eq(dlua_tensor_reduce(&o, &ix, t, DLUA_REDUCE_MIN, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert(isnan(*(double *)dlua_tensor_data(o)));
  ck_assert(*(int64_t *)dlua_tensor_data(ix) == 1);
  dlua_tensor_free(o), dlua_tensor_free(ix), o = ix = NULL;
  dlua_tensor_free(t);
  // Indices along a dim of a transposed tensor count logical positions, not memory order.
  int64_t s[2] = {3, 4};
  double u[12] = {0, 9, 2, 3, 8, 1, 7, 4, 5, 6, 1, 11};
  dlua_tensor_t *b = tu_mk(DLUA_DTYPE_I64, 2, s, u), *bt = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&bt, b, 0, 1), DLUA_OK);  // (4, 3): bt[i][j] = u[j*4+i]
  int d = 1;
  ck_assert_int_eq(dlua_tensor_reduce(&o, &ix, bt, DLUA_REDUCE_MAX, 1, &d, 1, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(ix), 2);
  int64_t *pi = dlua_tensor_data(ix);
  int64_t *pv = dlua_tensor_data(o);
  int64_t wantv[4] = {8, 9, 7, 11}, wanti[4] = {2, 1, 2, 3};
  for (int i = 0; i < 4; i++) ck_assert(pv[i] == wantv[i] && pi[i] == wanti[i]);
  dlua_tensor_free(o), dlua_tensor_free(ix), dlua_tensor_free(bt), dlua_tensor_free(b);
}
END_TEST

START_TEST(test_out_and_errors) {
  int64_t s[2] = {4, 6};
  double v[24];
  for (int i = 0; i < 24; i++) v[i] = i * 0.5;
  dlua_tensor_t *t = tu_mk(DLUA_DTYPE_F32, 2, s, v), *o = NULL;
  // A caller-provided out of another dtype and layout receives the cast result.
  int64_t os[2] = {6, 1};
  dlua_tensor_t *base = NULL, *ot = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&base, 2, os, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&ot, base, 0, 1), DLUA_OK);  // (1, 6), f64
  int d0 = 0;
  dlua_tensor_t *ot2 = ot;
  ck_assert_msg(dlua_tensor_reduce(&ot2, NULL, t, DLUA_REDUCE_SUM, 1, &d0, 1, 0, 0) == DLUA_OK, "%s",
                dlua_last_error());
  ck_assert_ptr_eq(ot2, ot);
  double *g = tu_rd(base);
  for (int j = 0; j < 6; j++) ck_assert(g[j] == 0.5 * (j + (j + 6) + (j + 12) + (j + 18)));
  free(g);
  // Wrong out shape, bad dims, NULL tensor.
  ck_assert_int_eq(dlua_tensor_reduce(&ot2, NULL, t, DLUA_REDUCE_SUM, 1, &d0, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("sum:"));
  int bad[2] = {2, 0}, dup[2] = {1, 1};
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_SUM, 1, bad, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert_msg(tu_err_has("sum: dim 2 out of range"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_PROD, 2, dup, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("prod: dim 1 appears twice"));
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, NULL, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("sum:"));
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_NORM, 0, NULL, 0, -1, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("norm: p"));
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_COUNT, 0, NULL, 0, 0, 0), DLUA_ERR_ARG);
  ck_assert_ptr_null(o);
  // A 0-d tensor reduces to itself; dim 0 is accepted for it.
  dlua_tensor_t *sc = NULL;
  double one = 2.5;
  ck_assert_int_eq(dlua_tensor_from_data(&sc, 0, NULL, DLUA_DTYPE_F64, &one), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, sc, DLUA_REDUCE_MAX, 1, &d0, 0, 0, 0), DLUA_OK);
  ck_assert(*(double *)dlua_tensor_data(o) == 2.5);
  dlua_tensor_free(o), dlua_tensor_free(sc);
  dlua_tensor_free(ot), dlua_tensor_free(base), dlua_tensor_free(t);
}
END_TEST

/* any/all/count on specials; var of one element with correction 1 is NaN. */
START_TEST(test_specials) {
  int64_t n = 5;
  double v[5] = {0, NAN, INFINITY, -INFINITY, 2};
  dlua_tensor_t *t = tu_mk(DLUA_DTYPE_BF16, 1, &n, v), *o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_COUNT_NONFINITE, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I64);
  ck_assert(*(int64_t *)dlua_tensor_data(o) == 3);
  dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_ALL, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert(*(uint8_t *)dlua_tensor_data(o) == 0);
  dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_SUM, 0, NULL, 0, 0, 0), DLUA_OK);
  double *g = tu_rd(o);
  ck_assert(isnan(g[0]));
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_NORM, 0, NULL, 0, INFINITY, 0), DLUA_OK);
  g = tu_rd(o);
  ck_assert(isnan(g[0]));
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(t);
  int64_t one = 1;
  double x = 4;
  t = tu_mk(DLUA_DTYPE_F32, 1, &one, &x);
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_VAR, 0, NULL, 0, 1, 0), DLUA_OK);
  ck_assert(isnan(*(float *)dlua_tensor_data(o)));
  dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_STD, 0, NULL, 0, 0, 0), DLUA_OK);
  ck_assert(*(float *)dlua_tensor_data(o) == 0);
  dlua_tensor_free(o), dlua_tensor_free(t), o = NULL;
  // Large mean, small spread: two-pass variance does not cancel.
  int64_t m = 1001;
  double *w = malloc(1001 * sizeof(double));
  double mean = 0, ss = 0;
  for (int i = 0; i < 1001; i++) w[i] = tu_as_dtype(DLUA_DTYPE_F32, 10000.0 + (i % 7) * 0.01), mean += w[i];
  mean /= 1001;
  for (int i = 0; i < 1001; i++) ss += (w[i] - mean) * (w[i] - mean);
  t = tu_mk(DLUA_DTYPE_F32, 1, &m, w);
  ck_assert_int_eq(dlua_tensor_reduce(&o, NULL, t, DLUA_REDUCE_VAR, 0, NULL, 0, 1, 0), DLUA_OK);
  ck_assert_msg(fabs(*(float *)dlua_tensor_data(o) - ss / 1000) <= 1e-5 * ss / 1000, "var %.9g vs %.9g",
                *(float *)dlua_tensor_data(o), ss / 1000);
  dlua_tensor_free(o), dlua_tensor_free(t), free(w);
}
END_TEST

/* The front door reaches the kernels through the backend table: the CPU's reduce family runs a strided
   descriptor itself; a tensor on device 0 gets the registry's one message when no CUDA device exists, and the
   CUDA table (strided inputs staged as contiguous rows) otherwise. */
START_TEST(test_through_the_table) {
  const struct dlua_reduce_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("sum", DLUA_CPU, reduce, reduce, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_reduce_ops);
  ck_assert_ptr_null(k->reduce_rows);

  // sum over dim 0 of a (2, 3) f64 view of x with strides (1, 2): column j is x[2j], x[2j + 1]
  double x[6] = {1, 2, 3, 4, 5, 6}, y[3] = {0, 0, 0};
  dlua_reduce_desc_t r;
  memset(&r, 0, sizeof r);
  r.kind = DLUA_REDUCE_SUM;
  r.dtype = r.out_dtype = DLUA_DTYPE_F64;
  r.x = x;
  r.ndim = 2;
  r.sizes[0] = 2, r.sizes[1] = 3;
  r.strides[0] = 1, r.strides[1] = 2;
  r.reduced[0] = 1;
  r.outer = 3, r.n = 2;
  r.y = y;
  r.device = DLUA_CPU;
  ck_assert_int_eq(k->reduce("sum", &r), DLUA_OK);
  ck_assert(y[0] == 3 && y[1] == 7 && y[2] == 11);

  int64_t sz[2] = {2, 3};
  dlua_tensor_t *a = tu_make(2, sz, DLUA_DTYPE_F64, x), *out = NULL;
  struct dlua_tensor on0 = *a;  // the same header claiming device 0: never read unless a device exists
  on0.device = 0;
  if (dlua_cuda_device_count() == 0) {
    tu_expect_error_at(dlua_tensor_reduce(&out, NULL, &on0, DLUA_REDUCE_SUM, 0, NULL, 0, 0.0, 0), "sum",
                       "sum: no CUDA device available");
    ck_assert_ptr_null(out);
    tu_expect_error_at(dlua_tensor_reduce(&out, NULL, &on0, DLUA_REDUCE_ARGMAX, 0, NULL, 0, 0.0, 0), "argmax",
                       "no CUDA device available");
  } else {
    const struct dlua_reduce_ops *kc = NULL;
    ck_assert_int_eq(DLUA_BACKEND("sum", 0, reduce, reduce_rows, &kc), DLUA_OK);
    ck_assert_ptr_ne(kc, &dlua_cpu_reduce_ops);
    tu_expect_error_at(DLUA_BACKEND("sum", 0, reduce, reduce, &kc), "sum", "sum: not supported on cuda");
  }
  dlua_tensor_free(a);
}
END_TEST

int main(void) {
  Suite *s = suite_create("reduce");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_ops_dims_layouts);
  tcase_add_test(tc, test_integer_ops);
  tcase_add_test(tc, test_half_accumulation);
  tcase_add_test(tc, test_sum_1e7_accuracy_threads);
  tcase_add_test(tc, test_schedules_thread_independent);
  tcase_add_test(tc, test_empty_inputs);
  tcase_add_test(tc, test_max_min_ties_nan_base);
  tcase_add_test(tc, test_out_and_errors);
  tcase_add_test(tc, test_specials);
  tcase_add_test(tc, test_through_the_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

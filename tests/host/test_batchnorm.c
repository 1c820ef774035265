/* Check suite for host/ops/batchnorm.c and host/cpu/batchnorm.c: batch-norm (+ReLU, +residual) forward/backward against double references, finite differences and hand-computed running statistics. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/norm.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

/* Not tu_rand_vals: only this suite offsets its draws. */
static double *rand_vals(int64_t n, double scale, double offset) {
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = offset + scale * tu_splitmix(&rng_state);
  return v;
}

/* A tensor of dtype dt holding v (row-major logical order); cl: channels-last memory. */
static dlua_tensor_t *mk(dlua_dtype_t dt, int nd, const int64_t *sz, const double *v, int cl) {
  dlua_tensor_t *d = NULL, *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&d, nd, sz, DLUA_DTYPE_F64, v), DLUA_OK);
  if (!cl) {
    ck_assert_int_eq(dlua_tensor_to_dtype(&t, d, dt), DLUA_OK);
  } else {
    // Physical (N, S..., C), viewed back as (N, C, S...).
    int64_t phys[4];
    int perm[4];
    phys[0] = sz[0];
    for (int k = 2; k < nd; k++) phys[k - 1] = sz[k];
    phys[nd - 1] = sz[1];
    perm[0] = 0;
    perm[1] = nd - 1;
    for (int k = 2; k < nd; k++) perm[k] = k - 1;
    dlua_tensor_t *p = NULL;
    ck_assert_int_eq(dlua_tensor_empty(&p, nd, phys, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_permute(&t, p, perm), DLUA_OK);
    dlua_tensor_free(p);
    ck_assert_int_eq(dlua_tensor_copy_(t, d), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_strides(t)[1], 1);
  }
  dlua_tensor_free(d);
  return t;
}

static dlua_tensor_t *vec(dlua_dtype_t dt, int64_t n, const double *v) { return mk(dt, 1, &n, v, 0); }

static void expect_tensor(const dlua_tensor_t *t, const double *want, double tol, const char *what) {
  double *g = tu_values(t);
  tu_expect_close(g, want, dlua_tensor_numel(t), tol, what);
  free(g);
}

static int is_channels_last(const dlua_tensor_t *t) { return dlua_tensor_strides(t)[1] == 1 && dlua_tensor_sizes(t)[1] > 1; }

/* ---- the reference, from the definition, in double --------------------------------------------------- */

typedef struct {
  int nd;
  int64_t sz[4];
  int64_t N, C, S;
} shape_t;

static shape_t shape(int nd, int64_t a, int64_t b, int64_t c, int64_t d) {
  shape_t s = {nd, {a, b, c, d}, a, b, 1};
  for (int k = 2; k < nd; k++) s.S *= s.sz[k];
  return s;
}

static int64_t numel(const shape_t *s) { return s->N * s->C * s->S; }
/* Logical row-major position of (n, c, spatial i). */
static int64_t at(const shape_t *s, int64_t n, int64_t c, int64_t i) { return (n * s->C + c) * s->S + i; }

/* mean/invstd: the batch's (train) or from rm/rv (eval); y = act(gamma xhat + beta + skip). */
static void ref_forward(const shape_t *s, const double *x, const double *gamma, const double *beta, const double *skip,
                        const double *rm, const double *rv, int train, double eps, int relu, double *y, double *mean,
                        double *invstd) {
  for (int64_t c = 0; c < s->C; c++) {
    double m = 0, v = 0, M = (double)(s->N * s->S);
    if (train) {
      for (int64_t n = 0; n < s->N; n++)
        for (int64_t i = 0; i < s->S; i++) m += x[at(s, n, c, i)];
      m /= M;
      for (int64_t n = 0; n < s->N; n++)
        for (int64_t i = 0; i < s->S; i++) v += (x[at(s, n, c, i)] - m) * (x[at(s, n, c, i)] - m);
      v /= M;
    } else {
      m = rm[c];
      v = rv[c];
    }
    mean[c] = m;
    invstd[c] = 1 / sqrt(v + eps);
    for (int64_t n = 0; n < s->N; n++)
      for (int64_t i = 0; i < s->S; i++) {
        int64_t k = at(s, n, c, i);
        double o = (x[k] - m) * invstd[c] * (gamma ? gamma[c] : 1) + (beta ? beta[c] : 0) + (skip ? skip[k] : 0);
        y[k] = relu && o < 0 ? 0 : o;
      }
  }
}

/* ---- forward ---------------------------------------------------------------------------------------- */

START_TEST(test_forward_reference) {
  const shape_t shapes[] = {shape(4, 4, 3, 5, 7), shape(4, 2, 5, 3, 3), shape(3, 3, 4, 7, 0), shape(2, 7, 5, 0, 0),
                            shape(4, 1, 2, 1, 2), shape(4, 3, 1, 2, 2), shape(4, 2, 13, 1, 1), shape(4, 1, 3, 11, 13)};
  const dlua_dtype_t dts[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int di = 0; di < 2; di++)
      for (int cl = 0; cl < 2; cl++)
        for (int variant = 0; variant < 4; variant++) {  // plain, relu, skip+relu, no affine
          const shape_t *s = &shapes[si];
          if (cl && s->nd == 2) continue;  // (N, C) has one layout
          dlua_dtype_t dt = dts[di];
          int64_t n = numel(s);
          int relu = variant == 1 || variant == 2, affine = variant != 3;
          double *x = rand_vals(n, 2.0, 3.0), *sk = rand_vals(n, 1.0, 0.0), *gm = rand_vals(s->C, 1.0, 0.5),
                 *bt = rand_vals(s->C, 1.0, 0.0), *y = malloc(n * sizeof(double)), *mean = malloc(s->C * sizeof(double)),
                 *inv = malloc(s->C * sizeof(double));
          // The reference sees exactly the values the kernel sees.
          dlua_tensor_t *tx = mk(dt, s->nd, s->sz, x, cl), *tsk = variant == 2 ? mk(dt, s->nd, s->sz, sk, cl) : NULL;
          free(x);
          x = tu_values(tx);
          if (tsk) {
            free(sk);
            sk = tu_values(tsk);
          }
          dlua_tensor_t *tg = affine ? vec(DLUA_DTYPE_F32, s->C, gm) : NULL, *tb = affine ? vec(DLUA_DTYPE_F32, s->C, bt) : NULL;
          if (tg) {
            free(gm);
            gm = tu_values(tg);
            free(bt);
            bt = tu_values(tb);
          }
          ref_forward(s, x, affine ? gm : NULL, affine ? bt : NULL, tsk ? sk : NULL, NULL, NULL, 1, 1e-5, relu, y, mean, inv);
          dlua_tensor_t *out = NULL, *sm = NULL, *si_ = NULL;
          ck_assert_int_eq(dlua_nn_batch_norm_forward(&out, &sm, &si_, tx, tg, tb, tsk, NULL, NULL, 1, 0.1, 1e-5, relu),
                           DLUA_OK);
          ck_assert_int_eq(dlua_tensor_dtype(out), dt);
          ck_assert_int_eq(is_channels_last(out), is_channels_last(tx));
          ck_assert_int_eq(dlua_tensor_dtype(sm), dt == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32);
          double tol = dt == DLUA_DTYPE_F64 ? 1e-12 : 3e-6;
          expect_tensor(out, y, tol, "forward y");
          expect_tensor(sm, mean, tol, "save_mean");
          expect_tensor(si_, inv, tol, "save_invstd");
          dlua_tensor_free(out);
          dlua_tensor_free(sm);
          dlua_tensor_free(si_);
          dlua_tensor_free(tx);
          dlua_tensor_free(tsk);
          dlua_tensor_free(tg);
          dlua_tensor_free(tb);
          free(x), free(sk), free(gm), free(bt), free(y), free(mean), free(inv);
        }
}
END_TEST

/* Running statistics over two steps, with every number worked out by hand. */
START_TEST(test_running_stats_by_hand) {
  const int64_t sz[2] = {2, 2};
  // Step 1: channel 0 holds 1, 3 (mean 2, biased var 1, unbiased 2); channel 1 holds 10, 20
  // (mean 15, var 25, unbiased 50).
  const double x1[4] = {1, 10, 3, 20};
  // Step 2: channel 0 holds 5, 9 (mean 7, unbiased 8); channel 1 holds 0, 4 (mean 2, unbiased 8).
  const double x2[4] = {5, 0, 9, 4};
  const double zero2[2] = {0, 0}, one2[2] = {1, 1};
  for (int dti = 0; dti < 2; dti++) {
    dlua_dtype_t pdt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
    dlua_tensor_t *rm = vec(pdt, 2, zero2), *rv = vec(pdt, 2, one2), *tx = mk(DLUA_DTYPE_F64, 2, sz, x1, 0), *y = NULL;
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, NULL, NULL, tx, NULL, NULL, NULL, rm, rv, 1, 0.1, 0.0, 0), DLUA_OK);
    const double y1[4] = {-1, -1, 1, 1};
    expect_tensor(y, y1, 1e-15, "step 1 output");
    const double rm1[2] = {0.2, 1.5}, rv1[2] = {0.9 + 0.2, 0.9 + 5.0};
    expect_tensor(rm, rm1, 1e-7, "running_mean after step 1");
    expect_tensor(rv, rv1, 1e-7, "running_var after step 1");
    dlua_tensor_free(tx);
    tx = mk(DLUA_DTYPE_F64, 2, sz, x2, 0);
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, NULL, NULL, tx, NULL, NULL, NULL, rm, rv, 1, 0.1, 0.0, 0), DLUA_OK);
    const double rm2[2] = {0.9 * 0.2 + 0.7, 0.9 * 1.5 + 0.2}, rv2[2] = {0.9 * 1.1 + 0.8, 0.9 * 5.9 + 0.8};
    expect_tensor(rm, rm2, 1e-7, "running_mean after step 2");
    expect_tensor(rv, rv2, 1e-7, "running_var after step 2");
    // Evaluation normalises with them and leaves them alone: (5 - 0.88) / sqrt(1.79 + 0.5) ...
    dlua_tensor_t *sm = NULL, *si = NULL;
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &si, tx, NULL, NULL, NULL, rm, rv, 0, 0.1, 0.5, 0), DLUA_OK);
    const double ye[4] = {(5 - 0.88) / sqrt(2.29), (0 - 1.55) / sqrt(6.61), (9 - 0.88) / sqrt(2.29),
                          (4 - 1.55) / sqrt(6.61)};
    expect_tensor(y, ye, 1e-6, "eval output");
    expect_tensor(rm, rm2, 1e-7, "running_mean after eval");
    expect_tensor(sm, rm2, 1e-7, "eval save_mean");
    const double ie[2] = {1 / sqrt(2.29), 1 / sqrt(6.61)};
    expect_tensor(si, ie, 1e-6, "eval save_invstd");
    dlua_tensor_free(sm), dlua_tensor_free(si), dlua_tensor_free(rm), dlua_tensor_free(rv), dlua_tensor_free(tx),
        dlua_tensor_free(y);
  }
}
END_TEST

START_TEST(test_eval_reference_and_train_differs) {
  shape_t s = shape(4, 3, 4, 5, 5);
  int64_t n = numel(&s);
  for (int cl = 0; cl < 2; cl++) {
    double *x = rand_vals(n, 1.0, 0.0), *rmv = rand_vals(4, 0.5, 0.0), *rvv = rand_vals(4, 0.5, 1.0),
           *gm = rand_vals(4, 1.0, 1.0), *bt = rand_vals(4, 1.0, 0.0), *y = malloc(n * sizeof(double)), m[4], iv[4];
    dlua_tensor_t *tx = mk(DLUA_DTYPE_F64, 4, s.sz, x, cl), *rm = vec(DLUA_DTYPE_F64, 4, rmv), *rv = vec(DLUA_DTYPE_F64, 4, rvv),
                  *tg = vec(DLUA_DTYPE_F64, 4, gm), *tb = vec(DLUA_DTYPE_F64, 4, bt), *out = NULL, *out2 = NULL;
    ref_forward(&s, x, gm, bt, NULL, rmv, rvv, 0, 1e-3, 0, y, m, iv);
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&out, NULL, NULL, tx, tg, tb, NULL, rm, rv, 0, 0.1, 1e-3, 0), DLUA_OK);
    expect_tensor(out, y, 1e-12, "eval forward");
    expect_tensor(rm, rmv, 0, "running_mean untouched by eval");
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&out2, NULL, NULL, tx, tg, tb, NULL, NULL, NULL, 1, 0.1, 1e-3, 0), DLUA_OK);
    double *a = tu_values(out), *b = tu_values(out2);
    ck_assert(fabs(a[0] - b[0]) > 1e-3);
    free(a), free(b), free(x), free(rmv), free(rvv), free(gm), free(bt), free(y);
    dlua_tensor_free(tx), dlua_tensor_free(rm), dlua_tensor_free(rv), dlua_tensor_free(tg), dlua_tensor_free(tb),
        dlua_tensor_free(out), dlua_tensor_free(out2);
  }
}
END_TEST

/* ---- backward against central finite differences (f64) --------------------------------------------------- */

/* L = sum(w * forward(x, gamma, beta, skip)). */
static double loss(const shape_t *s, const double *x, const double *gm, const double *bt, const double *sk,
                   const double *rmv, const double *rvv, int train, int relu, int cl, const double *w) {
  dlua_tensor_t *tx = mk(DLUA_DTYPE_F64, s->nd, s->sz, x, cl), *tg = vec(DLUA_DTYPE_F64, s->C, gm),
                *tb = vec(DLUA_DTYPE_F64, s->C, bt), *ts = sk ? mk(DLUA_DTYPE_F64, s->nd, s->sz, sk, cl) : NULL,
                *rm = vec(DLUA_DTYPE_F64, s->C, rmv), *rv = vec(DLUA_DTYPE_F64, s->C, rvv), *y = NULL;
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, NULL, NULL, tx, tg, tb, ts, train ? NULL : rm, train ? NULL : rv, train,
                                              0.1, 1e-5, relu),
                   DLUA_OK);
  double *v = tu_values(y), L = 0;
  for (int64_t i = 0; i < numel(s); i++) L += w[i] * v[i];
  free(v);
  dlua_tensor_free(tx), dlua_tensor_free(tg), dlua_tensor_free(tb), dlua_tensor_free(ts), dlua_tensor_free(rm),
      dlua_tensor_free(rv), dlua_tensor_free(y);
  return L;
}

static void fd_check(double *p, int64_t count, const double *analytic, const char *what, const shape_t *s, double *x,
                     double *gm, double *bt, double *sk, const double *rmv, const double *rvv, int train, int relu, int cl,
                     const double *w) {
  const double h = 1e-6;
  for (int64_t i = 0; i < count; i++) {
    double keep = p[i];
    p[i] = keep + h;
    double lp = loss(s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
    p[i] = keep - h;
    double lm = loss(s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
    p[i] = keep;
    double fd = (lp - lm) / (2 * h);
    ck_assert_msg(fabs(fd - analytic[i]) <= 1e-6 * (1 + fabs(fd)), "%s[%lld]: analytic %.12g, finite difference %.12g",
                  what, (long long)i, analytic[i], fd);
  }
}

START_TEST(test_backward_finite_differences) {
  const shape_t shapes[] = {shape(4, 2, 3, 3, 2), shape(3, 3, 2, 5, 0), shape(2, 5, 3, 0, 0), shape(4, 1, 2, 1, 3)};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int cl = 0; cl < 2; cl++)
      for (int mode = 0; mode < 5; mode++) {  // train plain, train relu+skip, eval plain, eval relu, train relu
        const shape_t *s = &shapes[si];
        if (cl && s->nd == 2) continue;
        int train = mode < 2 || mode == 4, relu = mode == 1 || mode >= 3, useskip = mode == 1;
        int64_t n = numel(s), C = s->C;
        double *x = rand_vals(n, 1.0, 0.5), *gm = rand_vals(C, 0.5, 1.0), *bt = rand_vals(C, 0.5, 0.0),
               *sk = useskip ? rand_vals(n, 0.5, 0.0) : NULL, *w = rand_vals(n, 1.0, 0.0), *rmv = rand_vals(C, 0.3, 0.0),
               *rvv = rand_vals(C, 0.3, 1.0);
        dlua_tensor_t *tx = mk(DLUA_DTYPE_F64, s->nd, s->sz, x, cl), *tg = vec(DLUA_DTYPE_F64, C, gm),
                      *tb = vec(DLUA_DTYPE_F64, C, bt), *ts = sk ? mk(DLUA_DTYPE_F64, s->nd, s->sz, sk, cl) : NULL,
                      *rm = vec(DLUA_DTYPE_F64, C, rmv), *rv = vec(DLUA_DTYPE_F64, C, rvv),
                      *dy = mk(DLUA_DTYPE_F64, s->nd, s->sz, w, cl), *y = NULL, *sm = NULL, *sv = NULL;
        ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &sv, tx, tg, tb, ts, train ? NULL : rm, train ? NULL : rv,
                                                    train, 0.1, 1e-5, relu),
                         DLUA_OK);
        dlua_tensor_t *gx = NULL, *gs = NULL, *gg = NULL, *gb = NULL;
        ck_assert_int_eq(dlua_tensor_zeros(&gg, 1, &C, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
        ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, &C, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
        // without a skip, beta has the ReLU mask recomputed from x (test_relu_mask_from_input
        // compares that with reading the output)
        ck_assert_int_eq(dlua_nn_batch_norm_backward(&gx, useskip ? &gs : NULL, gg, gb, dy, tx, relu ? y : NULL, tg,
                                                     relu && !useskip ? tb : NULL, sm, sv, train, relu, 1),
                         DLUA_OK);
        ck_assert_int_eq(is_channels_last(gx), is_channels_last(dy));
        double *agx = tu_values(gx), *agg = tu_values(gg), *agb = tu_values(gb);
        fd_check(x, n, agx, "grad_input", s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
        fd_check(gm, C, agg, "grad_gamma", s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
        fd_check(bt, C, agb, "grad_beta", s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
        if (useskip) {
          double *ags = tu_values(gs);
          fd_check(sk, n, ags, "grad_skip", s, x, gm, bt, sk, rmv, rvv, train, relu, cl, w);
          free(ags);
        }
        free(agx), free(agg), free(agb), free(x), free(gm), free(bt), free(sk), free(w), free(rmv), free(rvv);
        dlua_tensor_t *all[] = {tx, tg, tb, ts, rm, rv, dy, y, sm, sv, gx, gs, gg, gb};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) dlua_tensor_free(all[k]);
      }
}
END_TEST

/* Parameter gradients accumulate (Torch7): two backwards double them; accumulate = 0 overwrites. */
START_TEST(test_gradient_accumulation) {
  shape_t s = shape(4, 3, 5, 4, 3);
  int64_t n = numel(&s), C = 5;
  double *x = rand_vals(n, 1.0, 0.0), *w = rand_vals(n, 1.0, 0.0), *gm = rand_vals(C, 1.0, 1.0);
  dlua_tensor_t *tx = mk(DLUA_DTYPE_F32, 4, s.sz, x, 1), *dy = mk(DLUA_DTYPE_F32, 4, s.sz, w, 1), *tg = vec(DLUA_DTYPE_F32, C, gm),
                *y = NULL, *sm = NULL, *sv = NULL, *gg = NULL, *gb = NULL, *gx = NULL;
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &sv, tx, tg, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
  // A flat float64 arena standing in for the model's gradients: parameters are strided views into it.
  int64_t an = 2 * C;
  dlua_tensor_t *arena = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&arena, 1, &an, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_slice(&gg, arena, 0, 0, an, 2), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_slice(&gb, arena, 0, 1, an, 2), DLUA_OK);
  ck_assert_int_eq(dlua_nn_batch_norm_backward(NULL, NULL, gg, gb, dy, tx, y, tg, NULL, sm, sv, 1, 1, 1), DLUA_OK);
  double *g1 = tu_values(gg), *b1 = tu_values(gb);
  int nonzero = 0;
  for (int64_t c = 0; c < C; c++) nonzero += g1[c] != 0 && b1[c] != 0;
  ck_assert_int_eq(nonzero, C);
  ck_assert_int_eq(dlua_nn_batch_norm_backward(&gx, NULL, gg, gb, dy, tx, y, tg, NULL, sm, sv, 1, 1, 1), DLUA_OK);
  double *g2 = tu_values(gg), *b2 = tu_values(gb);
  for (int64_t c = 0; c < C; c++) {
    ck_assert_double_eq_tol(g2[c], 2 * g1[c], 1e-12 * (1 + fabs(g1[c])));
    ck_assert_double_eq_tol(b2[c], 2 * b1[c], 1e-12 * (1 + fabs(b1[c])));
  }
  ck_assert_int_eq(dlua_nn_batch_norm_backward(&gx, NULL, gg, gb, dy, tx, y, tg, NULL, sm, sv, 1, 1, 0), DLUA_OK);
  double *g3 = tu_values(gg);
  tu_expect_close(g3, g1, C, 1e-12, "accumulate = 0 overwrites");
  free(x), free(w), free(gm), free(g1), free(b1), free(g2), free(b2), free(g3);
  dlua_tensor_t *all[] = {tx, dy, tg, y, sm, sv, gg, gb, gx, arena};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) dlua_tensor_free(all[k]);
}
END_TEST

/* Results are bit-identical with 1 and 2 threads, on shapes large enough to run in parallel. */
START_TEST(test_thread_count_independence) {
  shape_t s = shape(4, 8, 16, 17, 19);
  int64_t n = numel(&s), C = 16;
  int saved = dlua_get_num_threads();
  for (int cl = 0; cl < 2; cl++) {
    double *x = rand_vals(n, 3.0, 5.0), *w = rand_vals(n, 1.0, 0.0), *sk = rand_vals(n, 1.0, 0.0), *gm = rand_vals(C, 1.0, 1.0);
    dlua_tensor_t *tx = mk(DLUA_DTYPE_F32, 4, s.sz, x, cl), *dy = mk(DLUA_DTYPE_F32, 4, s.sz, w, cl),
                  *ts = mk(DLUA_DTYPE_F32, 4, s.sz, sk, cl), *tg = vec(DLUA_DTYPE_F32, C, gm);
    float *res[2][5];
    for (int th = 0; th < 2; th++) {
      ck_assert_int_eq(dlua_set_num_threads(th + 1), DLUA_OK);
      dlua_tensor_t *y = NULL, *sm = NULL, *sv = NULL, *gx = NULL, *gg = NULL;
      ck_assert_int_eq(dlua_tensor_zeros(&gg, 1, &C, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
      ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &sv, tx, tg, NULL, ts, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
      ck_assert_int_eq(dlua_nn_batch_norm_backward(&gx, NULL, gg, NULL, dy, tx, y, tg, NULL, sm, sv, 1, 1, 1), DLUA_OK);
      dlua_tensor_t *outs[5] = {y, sm, sv, gx, gg};
      for (int k = 0; k < 5; k++) {
        int64_t m = dlua_tensor_numel(outs[k]);
        res[th][k] = malloc(m * sizeof(float));
        ck_assert_int_eq(dlua_tensor_to_data(outs[k], res[th][k], m * sizeof(float)), DLUA_OK);
      }
      for (int k = 0; k < 5; k++) dlua_tensor_free(outs[k]);
    }
    const int64_t lens[5] = {n, C, C, n, C};
    for (int k = 0; k < 5; k++) {
      ck_assert_msg(memcmp(res[0][k], res[1][k], lens[k] * sizeof(float)) == 0, "output %d differs across threads (cl %d)",
                    k, cl);
      free(res[0][k]), free(res[1][k]);
    }
    free(x), free(w), free(sk), free(gm);
    dlua_tensor_free(tx), dlua_tensor_free(dy), dlua_tensor_free(ts), dlua_tensor_free(tg);
  }
  dlua_set_num_threads(saved);
}
END_TEST

/* Half types stage through float; views are copied; given outputs and in-place use work. */
START_TEST(test_dtypes_views_and_outputs) {
  shape_t s = shape(4, 3, 4, 6, 5);
  int64_t n = numel(&s);
  double *x = rand_vals(n, 1.0, 0.0), *y = malloc(n * sizeof(double)), m[4], iv[4];
  const dlua_dtype_t half[2] = {DLUA_DTYPE_F16, DLUA_DTYPE_BF16};
  for (int h = 0; h < 2; h++) {
    dlua_tensor_t *tx = mk(half[h], 4, s.sz, x, 1), *out = NULL, *sm = NULL;
    double *xv = tu_values(tx);
    ref_forward(&s, xv, NULL, NULL, NULL, NULL, NULL, 1, 1e-5, 0, y, m, iv);
    ck_assert_int_eq(dlua_nn_batch_norm_forward(&out, &sm, NULL, tx, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_dtype(out), half[h]);
    ck_assert(is_channels_last(out));
    expect_tensor(out, y, h ? 1.6e-2 : 2e-3, "half forward");
    expect_tensor(sm, m, 1e-6, "half save_mean");
    free(xv);
    dlua_tensor_free(tx), dlua_tensor_free(out), dlua_tensor_free(sm);
  }
  // A transposed (N, H, C, W) buffer viewed as (N, C, H, W): neither format, so it is copied.
  int64_t psz[4] = {3, 6, 4, 5};
  double *xp = malloc(n * sizeof(double));
  for (int64_t a = 0; a < 3; a++)
    for (int64_t c = 0; c < 4; c++)
      for (int64_t hh = 0; hh < 6; hh++)
        for (int64_t ww = 0; ww < 5; ww++) xp[((a * 6 + hh) * 4 + c) * 5 + ww] = x[((a * 4 + c) * 6 + hh) * 5 + ww];
  dlua_tensor_t *tp = NULL, *tv = NULL, *out = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&tp, 4, psz, DLUA_DTYPE_F64, xp), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&tv, tp, 1, 2), DLUA_OK);
  ref_forward(&s, x, NULL, NULL, NULL, NULL, NULL, 1, 1e-5, 1, y, m, iv);
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&out, NULL, NULL, tv, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
  expect_tensor(out, y, 1e-12, "transposed input");
  // A given float32 output gets the float64 result converted; in place on x works too.
  dlua_tensor_t *o32 = NULL, *xin = mk(DLUA_DTYPE_F64, 4, s.sz, x, 0), *alias = xin;
  ck_assert_int_eq(dlua_tensor_empty(&o32, 4, s.sz, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&o32, NULL, NULL, xin, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
  expect_tensor(o32, y, 3e-6, "given float32 output");
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&alias, NULL, NULL, xin, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
  ck_assert_ptr_eq(alias, xin);
  expect_tensor(xin, y, 1e-12, "in place");
  // Evaluation on an empty batch and on N = 1, H = W = 1.
  int64_t ez[4] = {0, 4, 3, 3}, oz[4] = {1, 4, 1, 1};
  const double zero4[4] = {0, 0, 0, 0}, one4[4] = {1, 1, 1, 1};
  dlua_tensor_t *rm = vec(DLUA_DTYPE_F32, 4, zero4), *rv = vec(DLUA_DTYPE_F32, 4, one4), *te = NULL, *to = NULL, *oe = NULL,
                *oo = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&te, 4, ez, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&oe, NULL, NULL, te, NULL, NULL, NULL, rm, rv, 0, 0.1, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(oe), 0);
  to = mk(DLUA_DTYPE_F32, 4, oz, one4, 0);
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&oo, NULL, NULL, to, NULL, NULL, NULL, rm, rv, 0, 0.1, 0, 0), DLUA_OK);
  expect_tensor(oo, one4, 0, "eval with one value per channel");
  free(x), free(y), free(xp);
  dlua_tensor_t *all[] = {tp, tv, out, o32, xin, rm, rv, te, to, oe, oo};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) dlua_tensor_free(all[k]);
}
END_TEST

/* With beta (no skip), the backward recomputes the ReLU mask from x: the gradients are the same
   bits as when it reads the forward's output, whole and in SyncBatchNorm's halves, for both float
   types, both layouts, training and evaluation, and a channel count with a vector tail. */
START_TEST(test_relu_mask_from_input) {
  shape_t s = shape(4, 3, 19, 5, 7);
  const int64_t n = numel(&s), C = s.C;
  const dlua_dtype_t dts[2] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64};
  for (int d = 0; d < 2; d++)
    for (int cl = 0; cl < 2; cl++)
      for (int train = 0; train < 2; train++) {
        double *x = rand_vals(n, 1.0, 0.3), *w = rand_vals(n, 1.0, 0.0), *gm = rand_vals(C, 1.0, 0.2),
               *bt = rand_vals(C, 1.0, 0.0), *rmv = rand_vals(C, 0.3, 0.0), *rvv = rand_vals(C, 0.3, 1.0);
        dlua_tensor_t *tx = mk(dts[d], 4, s.sz, x, cl), *dy = mk(dts[d], 4, s.sz, w, cl), *tg = vec(dts[d], C, gm),
                      *tb = vec(dts[d], C, bt), *rm = vec(dts[d], C, rmv), *rv = vec(dts[d], C, rvv), *y = NULL,
                      *sm = NULL, *sv = NULL;
        ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &sv, tx, tg, tb, NULL, rm, rv, train, 0.1, 1e-5, 1), DLUA_OK);
        double *res[2][5];
        for (int k = 0; k < 2; k++) {
          const dlua_tensor_t *beta = k ? tb : NULL;
          dlua_tensor_t *gx = NULL, *gg = NULL, *gb = NULL, *sums = NULL, *gx2 = NULL;
          ck_assert_int_eq(dlua_tensor_zeros(&gg, 1, &C, dts[d], DLUA_CPU), DLUA_OK);
          ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, &C, dts[d], DLUA_CPU), DLUA_OK);
          ck_assert_int_eq(dlua_nn_batch_norm_backward(&gx, NULL, gg, gb, dy, tx, y, tg, beta, sm, sv, train, 1, 1), DLUA_OK);
          ck_assert_int_eq(dlua_nn_batch_norm_backward_reduce(&sums, NULL, NULL, dy, tx, y, tg, beta, sm, sv, 1, 1), DLUA_OK);
          ck_assert_int_eq(dlua_nn_batch_norm_backward_apply(&gx2, NULL, dy, tx, y, tg, beta, sm, sv, sums, 1), DLUA_OK);
          dlua_tensor_t *outs[5] = {gx, gg, gb, sums, gx2};
          for (int o = 0; o < 5; o++) res[k][o] = tu_values(outs[o]), dlua_tensor_free(outs[o]);
        }
        const int64_t lens[5] = {n, C, C, 2 * C + 1, n};
        const char *names[5] = {"grad_input", "grad_gamma", "grad_beta", "reduce sums", "apply grad_input"};
        for (int o = 0; o < 5; o++) {
          for (int64_t i = 0; i < lens[o]; i++)
            ck_assert_msg(res[0][o][i] == res[1][o][i], "%s[%lld] (dtype %d, cl %d, train %d): %.17g from the output, %.17g from x",
                          names[o], (long long)i, d, cl, train, res[0][o][i], res[1][o][i]);
          free(res[0][o]), free(res[1][o]);
        }
        // The mask did something: some outputs are 0 and some are not.
        double *yv = tu_values(y);
        int64_t zeros = 0;
        for (int64_t i = 0; i < n; i++) zeros += yv[i] == 0;
        ck_assert_msg(zeros > n / 10 && zeros < n - n / 10, "%lld of %lld outputs are 0", (long long)zeros, (long long)n);
        free(yv), free(x), free(w), free(gm), free(bt), free(rmv), free(rvv);
        dlua_tensor_t *all[] = {tx, dy, tg, tb, rm, rv, y, sm, sv};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) dlua_tensor_free(all[k]);
      }
}
END_TEST

START_TEST(test_errors) {
  const double v[64] = {0};
  int64_t s1[1] = {3}, s4[4] = {2, 3, 2, 2}, one[4] = {1, 3, 1, 1}, s5[5] = {1, 2, 1, 1, 1}, c4 = 4;
  dlua_tensor_t *x1 = mk(DLUA_DTYPE_F32, 1, s1, v, 0), *x4 = mk(DLUA_DTYPE_F32, 4, s4, v, 0), *xo = mk(DLUA_DTYPE_F32, 4, one, v, 0),
                *x5 = NULL, *g4 = mk(DLUA_DTYPE_F32, 1, &c4, v, 0), *xi = NULL, *y = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&x5, 5, s5, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&xi, 4, s4, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x1, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "(3) float32");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x5, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "2 to 4 dimensions");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x4, g4, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "gamma (4) float32 cpu must have shape (3)");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, xo, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "more than 1 value per channel when training, got input (1, 3, 1, 1)");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x4, NULL, NULL, NULL, NULL, NULL, 0, 0.1, 1e-5, 0), "batch_norm:",
                     "running_mean and running_var");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x4, NULL, NULL, xo, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "skip (1, 3, 1, 1) float32 cpu must have the shape of input (2, 3, 2, 2)");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, xi, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0), "batch_norm:",
                     "floating-point");
  tu_expect_error_at(dlua_nn_batch_norm_forward(&y, NULL, NULL, x4, NULL, NULL, NULL, NULL, NULL, 1, 0.1, -1, 0), "batch_norm:",
                     "eps");
  ck_assert_ptr_null(y);
  dlua_tensor_t *sm = NULL, *sv = NULL, *gx = NULL;
  ck_assert_int_eq(dlua_nn_batch_norm_forward(&y, &sm, &sv, x4, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 1), DLUA_OK);
  tu_expect_error_at(dlua_nn_batch_norm_backward(&gx, NULL, NULL, NULL, x4, x4, NULL, NULL, NULL, sm, sv, 1, 1, 1),
                     "batch_norm_backward:", "relu needs the forward's output");
  tu_expect_error_at(dlua_nn_batch_norm_backward(&gx, NULL, NULL, NULL, xo, x4, NULL, NULL, NULL, sm, sv, 1, 0, 1),
                     "batch_norm_backward:", "grad_output (1, 3, 1, 1)");
  tu_expect_error_at(dlua_nn_batch_norm_backward(&gx, NULL, g4, NULL, x4, x4, NULL, NULL, NULL, sm, sv, 1, 0, 1),
                     "batch_norm_backward:", "grad_gamma (4)");
  tu_expect_error_at(dlua_nn_batch_norm_backward(&gx, NULL, NULL, NULL, x4, x4, NULL, NULL, NULL, NULL, sv, 1, 0, 1),
                     "batch_norm_backward:", "save_mean");
  tu_expect_error_at(dlua_nn_batch_norm_backward(&gx, NULL, NULL, NULL, x4, x4, y, NULL, g4, sm, sv, 1, 1, 1),
                     "batch_norm_backward:", "beta (4)");
  ck_assert_ptr_null(gx);
  dlua_tensor_t *all[] = {x1, x4, xo, x5, g4, xi, y, sm, sv};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) dlua_tensor_free(all[k]);
}
END_TEST

/* The front doors reach the kernels through the norm table (kernels/norm.h): the CPU's is dlua_cpu_norm_ops,
   its forward slot runs on a descriptor alone, and a tensor on device 0 without a CUDA device gets the
   registry's one message from every front door of the family. */
START_TEST(test_backend_table) {
  const struct dlua_norm_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("batch_norm", DLUA_CPU, norm, forward, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_norm_ops);
  ck_assert_ptr_nonnull(k->backward);
  ck_assert_int_eq(k->native_16bit, 1);
  // batch_norm_stats through the slot: (2, 1) input {1, 3}, sums [4, 10, 2].
  const double xv[2] = {1, 3};
  double st[3] = {-1, -1, -1};
  const dlua_bn_fwd_t a = {.g = {.dtype = DLUA_DTYPE_F64, .rows = 1, .device = DLUA_CPU, .N = 2, .C = 1, .S = 1},
                           .x = xv, .stats_out = st, .M = 2, .train = 1};
  ck_assert_int_eq(k->forward("batch_norm_stats", &a), DLUA_OK);
  ck_assert(st[0] == 4 && st[1] == 10 && st[2] == 2);
  // The slot reads bfloat16 activations itself (native_16bit): {1, 3} as bf16 bits 0x3f80, 0x4040.
  const uint16_t xb[2] = {0x3f80, 0x4040};
  double sb[3] = {-1, -1, -1};
  dlua_bn_fwd_t ab = a;
  ab.g.dtype = DLUA_DTYPE_BF16;
  ab.x = xb;
  ab.stats_out = sb;
  ck_assert_int_eq(k->forward("batch_norm_stats", &ab), DLUA_OK);
  ck_assert(sb[0] == 4 && sb[1] == 10 && sb[2] == 2);

  const int64_t sz[2] = {2, 1};
  dlua_tensor_t *x = mk(DLUA_DTYPE_F32, 2, sz, xv, 0), *out = NULL, *m = NULL, *is = NULL, *sums = NULL;
  if (dlua_cuda_device_count() > 0) {
    const dlua_backend_t *be = NULL;
    ck_assert_int_eq(dlua_backend_for("batch_norm", 0, &be), DLUA_OK);
    ck_assert_int_eq(DLUA_BACKEND("batch_norm", 0, norm, backward, &k), DLUA_OK);
    ck_assert_ptr_eq(k, be->norm);
    ck_assert_int_eq(k->native_16bit, 1);
  } else {
    // A handle claiming device 0 (never dereferenced: the registry answers before any kernel runs).
    dlua_tensor_t on0 = *x, v0 = *x;
    on0.device = 0;
    v0.device = 0;
    v0.ndim = 1;  // (1): one entry for the one channel, as save_mean and save_invstd
    v0.sizes[0] = 1;
    tu_expect_error_at(dlua_nn_batch_norm_forward(&out, &m, &is, &on0, NULL, NULL, NULL, NULL, NULL, 1, 0.1, 1e-5, 0),
                       "batch_norm:", "no CUDA device available (");
    tu_expect_error_at(dlua_nn_batch_norm_stats(&sums, &on0), "batch_norm_stats:", "no CUDA device available (");
    tu_expect_error_at(dlua_nn_batch_norm_backward(&out, NULL, NULL, NULL, &on0, &on0, NULL, NULL, NULL, &v0, &v0, 1, 0,
                                                   0),
                       "batch_norm_backward:", "no CUDA device available (");
    ck_assert_ptr_null(out);
    ck_assert_ptr_null(m);
    ck_assert_ptr_null(sums);
  }
  dlua_tensor_free(x);
}
END_TEST

int main(void) {
  Suite *s = suite_create("batchnorm");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_forward_reference);
  tcase_add_test(tc, test_running_stats_by_hand);
  tcase_add_test(tc, test_eval_reference_and_train_differs);
  tcase_add_test(tc, test_backward_finite_differences);
  tcase_add_test(tc, test_gradient_accumulation);
  tcase_add_test(tc, test_thread_count_independence);
  tcase_add_test(tc, test_dtypes_views_and_outputs);
  tcase_add_test(tc, test_relu_mask_from_input);
  tcase_add_test(tc, test_errors);
  tcase_add_test(tc, test_backend_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/ops/pool.c and host/cpu/pool.c: max, average and adaptive average 2-D pooling against naive double loops and finite differences, in both memory formats. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/pool.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* (N, C, H, W) of dtype dt holding v in logical order; cl: channels-last memory. */
static dlua_tensor_t *mk(dlua_dtype_t dt, const int64_t *sz, const double *v, int cl) {
  dlua_tensor_t *d = NULL, *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&d, 4, sz, DLUA_DTYPE_F64, v), DLUA_OK);
  if (!cl) {
    ck_assert_int_eq(dlua_tensor_to_dtype(&t, d, dt), DLUA_OK);
  } else {
    int64_t phys[4] = {sz[0], sz[2], sz[3], sz[1]};
    const int perm[4] = {0, 3, 1, 2};
    dlua_tensor_t *p = NULL;
    ck_assert_int_eq(dlua_tensor_empty(&p, 4, phys, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_permute(&t, p, perm), DLUA_OK);
    dlua_tensor_free(p);
    ck_assert_int_eq(dlua_tensor_copy_(t, d), DLUA_OK);
  }
  dlua_tensor_free(d);
  return t;
}

/* Not tu_expect_close: NaN may match NaN and equal infinities pass. */
static void expect_close(const double *got, const double *want, int64_t n, double tol, const char *what) {
  for (int64_t i = 0; i < n; i++) {
    double err = fabs(got[i] - want[i]), lim = tol * (1 + fabs(want[i]));
    ck_assert_msg(err <= lim || (isnan(got[i]) && isnan(want[i])) || got[i] == want[i],
                  "%s: element %lld got %.17g want %.17g", what, (long long)i, got[i], want[i]);
  }
}

static void expect_tensor(const dlua_tensor_t *t, const double *want, double tol, const char *what) {
  double *g = tu_values(t);
  expect_close(g, want, dlua_tensor_numel(t), tol, what);
  free(g);
}

static int is_cl(const dlua_tensor_t *t) { return dlua_tensor_strides(t)[1] == 1; }

typedef struct {
  int64_t sz[4];
  int kh, kw, sh, sw, ph, pw, dh, dw, ceil;
} pcase_t;

/* PyTorch's output size, written out with floating floor/ceil. */
static int64_t ref_out(int64_t in, int k, int s, int p, int d, int ceil_mode) {
  double span = (double)(in + 2 * p - d * (k - 1) - 1) / s;
  int64_t o = (int64_t)(ceil_mode ? ceil(span) : floor(span)) + 1;
  if (ceil_mode && (o - 1) * s >= in + p) o--;
  return o;
}

/* ---- max pooling ---------------------------------------------------------------------------------------- */

static void ref_max(const pcase_t *c, const double *x, double *y, int64_t *ind, int64_t OH, int64_t OW) {
  int64_t H = c->sz[2], W = c->sz[3];
  for (int64_t p = 0; p < c->sz[0] * c->sz[1]; p++)
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        double best = -INFINITY;
        int64_t bi = -1;
        for (int a = 0; a < c->kh; a++)
          for (int b = 0; b < c->kw; b++) {
            int64_t ih = oh * c->sh - c->ph + a * c->dh, iw = ow * c->sw - c->pw + b * c->dw;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            double v = x[p * H * W + ih * W + iw];
            if (bi < 0) bi = ih * W + iw;  // the first position inside the input
            if (v > best || isnan(v)) {
              best = v;
              bi = ih * W + iw;
            }
          }
        y[p * OH * OW + oh * OW + ow] = best;
        ind[p * OH * OW + oh * OW + ow] = bi;
      }
}

static const pcase_t MAX_CASES[] = {
    {{2, 3, 7, 5}, 3, 3, 2, 2, 1, 1, 1, 1, 0}, {{2, 3, 7, 5}, 2, 2, 2, 2, 0, 0, 1, 1, 1},
    {{1, 2, 11, 13}, 3, 3, 2, 2, 1, 1, 2, 2, 1}, {{2, 5, 6, 9}, 2, 3, 1, 2, 1, 0, 1, 2, 0},
    {{1, 1, 1, 1}, 1, 1, 1, 1, 0, 0, 1, 1, 0},   {{3, 5, 11, 13}, 3, 3, 3, 3, 1, 1, 1, 1, 1},
    {{2, 17, 5, 5}, 5, 5, 1, 1, 2, 2, 1, 1, 0},  {{0, 3, 4, 4}, 2, 2, 2, 2, 0, 0, 1, 1, 0}};

START_TEST(test_max_forward_reference) {
  for (size_t ci = 0; ci < sizeof MAX_CASES / sizeof MAX_CASES[0]; ci++)
    for (int dti = 0; dti < 2; dti++)
      for (int cl = 0; cl < 2; cl++) {
        const pcase_t *c = &MAX_CASES[ci];
        dlua_dtype_t dt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
        int64_t n = c->sz[0] * c->sz[1] * c->sz[2] * c->sz[3];
        int64_t OH = ref_out(c->sz[2], c->kh, c->sh, c->ph, c->dh, c->ceil),
                OW = ref_out(c->sz[3], c->kw, c->sw, c->pw, c->dw, c->ceil), on = c->sz[0] * c->sz[1] * OH * OW;
        ck_assert_int_eq(dlua_pool2d_output_size(c->sz[2], c->kh, c->sh, c->ph, c->dh, c->ceil), OH);
        double *x = tu_rand_vals(tu_splitmix, &rng_state, n, 1.0), *y = malloc((on + 1) * sizeof(double));
        int64_t *ind = malloc((on + 1) * sizeof(int64_t));
        dlua_tensor_t *tx = mk(dt, c->sz, x, cl), *out = NULL, *ti = NULL;
        free(x);
        x = tu_values(tx);
        ref_max(c, x, y, ind, OH, OW);
        ck_assert_int_eq(dlua_nn_max_pool2d_forward(&out, &ti, tx, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw, c->dh, c->dw,
                                                    c->ceil),
                         DLUA_OK);
        ck_assert_int_eq(dlua_tensor_sizes(out)[2], OH);
        ck_assert_int_eq(dlua_tensor_sizes(out)[3], OW);
        ck_assert_int_eq(dlua_tensor_dtype(ti), DLUA_DTYPE_I64);
        if (c->sz[1] > 1 && on > 0) ck_assert_int_eq(is_cl(out), cl);
        expect_tensor(out, y, 0, "max_pool2d output");
        double *gi = tu_values(ti);
        for (int64_t i = 0; i < on; i++) ck_assert_int_eq((int64_t)gi[i], ind[i]);
        free(gi), free(x), free(y), free(ind);
        dlua_tensor_free(tx), dlua_tensor_free(out), dlua_tensor_free(ti);
      }
}
END_TEST

/* NaN wins (the last one, as PyTorch), -Inf windows report their first in-bounds position,
   int32 indices are accepted, and inference needs no indices. */
START_TEST(test_max_nan_inf_int32) {
  const int64_t sz[4] = {1, 1, 2, 4};
  const double x[8] = {1, NAN, 3, NAN, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  for (int cl = 0; cl < 2; cl++) {
    dlua_tensor_t *tx = mk(DLUA_DTYPE_F32, sz, x, cl), *out = NULL, *ti = NULL, *out2 = NULL;
    const int64_t isz[4] = {1, 1, 1, 2};
    ck_assert_int_eq(dlua_tensor_zeros(&ti, 4, isz, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
    // Windows of 2 x 2 at columns 0-1 and 2-3: {1, NaN, -inf, -inf} and {3, NaN, -inf, -inf}.
    ck_assert_int_eq(dlua_nn_max_pool2d_forward(&out, &ti, tx, 2, 2, 2, 2, 0, 0, 1, 1, 0), DLUA_OK);
    double *y = tu_values(out), *iv = tu_values(ti);
    ck_assert(isnan(y[0]) && isnan(y[1]));
    ck_assert_int_eq((int)iv[0], 1);
    ck_assert_int_eq((int)iv[1], 3);
    free(y), free(iv);
    // A window of -Inf alone (row 1 only, 1 x 2 kernel) reports its first position.
    dlua_tensor_t *ti2 = NULL;
    ck_assert_int_eq(dlua_nn_max_pool2d_forward(&out2, &ti2, tx, 1, 2, 1, 2, 0, 0, 1, 1, 0), DLUA_OK);
    y = tu_values(out2), iv = tu_values(ti2);
    ck_assert(isinf(y[2]) && y[2] < 0);
    ck_assert_int_eq((int)iv[2], 4);
    ck_assert_int_eq((int)iv[3], 6);
    free(y), free(iv);
    dlua_tensor_t *out3 = NULL;
    ck_assert_int_eq(dlua_nn_max_pool2d_forward(&out3, NULL, tx, 2, 2, 2, 2, 0, 0, 1, 1, 0), DLUA_OK);
    y = tu_values(out3);
    ck_assert(isnan(y[0]) && isnan(y[1]));
    free(y);
    dlua_tensor_free(tx), dlua_tensor_free(out), dlua_tensor_free(ti), dlua_tensor_free(out2), dlua_tensor_free(ti2),
        dlua_tensor_free(out3);
  }
}
END_TEST

/* sum(w * pool(x)) for finite differences. */
typedef dlua_status_t (*fwd_fn)(dlua_tensor_t **out, const dlua_tensor_t *x, const void *ctx);

static double pool_loss(fwd_fn f, const void *ctx, const int64_t *sz, const double *x, const double *w, int cl) {
  dlua_tensor_t *tx = mk(DLUA_DTYPE_F64, sz, x, cl), *y = NULL;
  ck_assert_int_eq(f(&y, tx, ctx), DLUA_OK);
  double *v = tu_values(y), L = 0;
  for (int64_t i = 0; i < dlua_tensor_numel(y); i++) L += w[i] * v[i];
  free(v);
  dlua_tensor_free(tx), dlua_tensor_free(y);
  return L;
}

static void fd_check(fwd_fn f, const void *ctx, const int64_t *sz, double *x, const double *w, int cl,
                     const double *analytic, const char *what) {
  int64_t n = sz[0] * sz[1] * sz[2] * sz[3];
  const double h = 1e-6;
  for (int64_t i = 0; i < n; i++) {
    double keep = x[i];
    x[i] = keep + h;
    double lp = pool_loss(f, ctx, sz, x, w, cl);
    x[i] = keep - h;
    double lm = pool_loss(f, ctx, sz, x, w, cl);
    x[i] = keep;
    double fd = (lp - lm) / (2 * h);
    ck_assert_msg(fabs(fd - analytic[i]) <= 1e-7 * (1 + fabs(fd)), "%s[%lld]: analytic %.12g, finite difference %.12g",
                  what, (long long)i, analytic[i], fd);
  }
}

static dlua_status_t max_fwd(dlua_tensor_t **out, const dlua_tensor_t *x, const void *ctx) {
  const pcase_t *c = ctx;
  return dlua_nn_max_pool2d_forward(out, NULL, x, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw, c->dh, c->dw, c->ceil);
}

START_TEST(test_max_backward) {
  for (size_t ci = 0; ci < sizeof MAX_CASES / sizeof MAX_CASES[0]; ci++)
    for (int cl = 0; cl < 2; cl++) {
      const pcase_t *c = &MAX_CASES[ci];
      int64_t n = c->sz[0] * c->sz[1] * c->sz[2] * c->sz[3];
      if (n > 400) continue;  // finite differences on the small cases
      int64_t OH = ref_out(c->sz[2], c->kh, c->sh, c->ph, c->dh, c->ceil),
              OW = ref_out(c->sz[3], c->kw, c->sw, c->pw, c->dw, c->ceil), osz[4] = {c->sz[0], c->sz[1], OH, OW};
      // Distinct values 1/n apart (a shuffled ramp), so no perturbation of 1e-6 changes a maximum.
      double *x = malloc((n + 1) * sizeof(double)), *w = tu_rand_vals(tu_splitmix, &rng_state, osz[0] * osz[1] * OH * OW, 1.0);
      for (int64_t i = 0; i < n; i++) x[i] = (double)i / (double)n;
      for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)((tu_splitmix(&rng_state) + 1) * 0.5 * (double)(i + 1));
        double t = x[i];
        x[i] = x[j];
        x[j] = t;
      }
      dlua_tensor_t *tx = mk(DLUA_DTYPE_F64, c->sz, x, cl), *out = NULL, *ti = NULL, *gy = mk(DLUA_DTYPE_F64, osz, w, cl),
                    *gx = NULL;
      ck_assert_int_eq(dlua_nn_max_pool2d_forward(&out, &ti, tx, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw, c->dh, c->dw,
                                                  c->ceil),
                       DLUA_OK);
      ck_assert_int_eq(dlua_nn_max_pool2d_backward(&gx, gy, ti, c->sz), DLUA_OK);
      if (c->sz[1] > 1 && n > 0) ck_assert_int_eq(is_cl(gx), cl);
      double *g = tu_values(gx);
      fd_check(max_fwd, c, c->sz, x, w, cl, g, "max_pool2d grad_input");
      free(g), free(x), free(w);
      dlua_tensor_free(tx), dlua_tensor_free(out), dlua_tensor_free(ti), dlua_tensor_free(gy), dlua_tensor_free(gx);
    }
}
END_TEST

/* ---- average pooling ------------------------------------------------------------------------------------- */

typedef struct {
  pcase_t p;
  int include_pad, divisor;
} acase_t;

static void ref_avg(const acase_t *a, const double *x, double *y, int64_t OH, int64_t OW) {
  const pcase_t *c = &a->p;
  int64_t H = c->sz[2], W = c->sz[3];
  for (int64_t p = 0; p < c->sz[0] * c->sz[1]; p++)
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        // The window over the padded input, which ceil_mode may run past on the right.
        double s = 0;
        int64_t inside = 0, padded = 0;
        for (int i = 0; i < c->kh; i++)
          for (int j = 0; j < c->kw; j++) {
            int64_t ih = oh * c->sh - c->ph + i, iw = ow * c->sw - c->pw + j;
            if (ih < H + c->ph && iw < W + c->pw) padded++;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            s += x[p * H * W + ih * W + iw];
            inside++;
          }
        double div = a->divisor ? a->divisor : a->include_pad ? padded : inside;
        y[p * OH * OW + oh * OW + ow] = inside ? s / div : 0;
      }
}

static const acase_t AVG_CASES[] = {
    {{{2, 3, 7, 5}, 3, 3, 2, 2, 1, 1, 1, 1, 0}, 1, 0}, {{{2, 3, 7, 5}, 3, 3, 2, 2, 1, 1, 1, 1, 1}, 0, 0},
    {{{2, 3, 7, 5}, 3, 3, 2, 2, 1, 1, 1, 1, 1}, 1, 0}, {{{1, 4, 6, 9}, 2, 3, 1, 2, 1, 0, 1, 1, 0}, 0, 0},
    {{{2, 2, 5, 5}, 2, 2, 2, 2, 1, 1, 1, 1, 1}, 1, 0}, {{{2, 2, 5, 5}, 2, 2, 2, 2, 0, 0, 1, 1, 0}, 1, 3},
    {{{1, 1, 1, 1}, 1, 1, 1, 1, 0, 0, 1, 1, 0}, 1, 0}, {{{3, 5, 11, 13}, 3, 3, 3, 3, 1, 1, 1, 1, 1}, 0, 0}};

static dlua_status_t avg_fwd(dlua_tensor_t **out, const dlua_tensor_t *x, const void *ctx) {
  const acase_t *a = ctx;
  const pcase_t *c = &a->p;
  return dlua_nn_avg_pool2d_forward(out, x, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw, c->ceil, a->include_pad, a->divisor);
}

START_TEST(test_avg_forward_backward) {
  for (size_t ci = 0; ci < sizeof AVG_CASES / sizeof AVG_CASES[0]; ci++)
    for (int dti = 0; dti < 2; dti++)
      for (int cl = 0; cl < 2; cl++) {
        const acase_t *a = &AVG_CASES[ci];
        const pcase_t *c = &a->p;
        dlua_dtype_t dt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
        int64_t n = c->sz[0] * c->sz[1] * c->sz[2] * c->sz[3];
        int64_t OH = ref_out(c->sz[2], c->kh, c->sh, c->ph, 1, c->ceil), OW = ref_out(c->sz[3], c->kw, c->sw, c->pw, 1, c->ceil),
                osz[4] = {c->sz[0], c->sz[1], OH, OW}, on = osz[0] * osz[1] * OH * OW;
        double *x = tu_rand_vals(tu_splitmix, &rng_state, n, 1.0), *w = tu_rand_vals(tu_splitmix, &rng_state, on, 1.0), *y = malloc(on * sizeof(double));
        dlua_tensor_t *tx = mk(dt, c->sz, x, cl), *out = NULL;
        free(x);
        x = tu_values(tx);
        ref_avg(a, x, y, OH, OW);
        ck_assert_int_eq(avg_fwd(&out, tx, a), DLUA_OK);
        ck_assert_int_eq(dlua_tensor_sizes(out)[2], OH);
        ck_assert_int_eq(dlua_tensor_sizes(out)[3], OW);
        if (c->sz[1] > 1) ck_assert_int_eq(is_cl(out), cl);
        expect_tensor(out, y, dti ? 1e-14 : 1e-6, "avg_pool2d output");
        if (dti && n <= 400) {
          dlua_tensor_t *gy = mk(DLUA_DTYPE_F64, osz, w, cl), *gx = NULL;
          ck_assert_int_eq(dlua_nn_avg_pool2d_backward(&gx, gy, c->sz, c->kh, c->kw, c->sh, c->sw, c->ph, c->pw, c->ceil,
                                                       a->include_pad, a->divisor),
                           DLUA_OK);
          if (c->sz[1] > 1) ck_assert_int_eq(is_cl(gx), cl);
          double *g = tu_values(gx);
          fd_check(avg_fwd, a, c->sz, x, w, cl, g, "avg_pool2d grad_input");
          free(g);
          dlua_tensor_free(gy), dlua_tensor_free(gx);
        }
        free(x), free(w), free(y);
        dlua_tensor_free(tx), dlua_tensor_free(out);
      }
}
END_TEST

/* ---- adaptive average pooling ---------------------------------------------------------------------------- */

static void ref_adaptive(const int64_t *sz, int64_t OH, int64_t OW, const double *x, double *y) {
  int64_t H = sz[2], W = sz[3];
  for (int64_t p = 0; p < sz[0] * sz[1]; p++)
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        int64_t h0 = (int64_t)floor((double)oh * H / OH), h1 = (int64_t)ceil((double)(oh + 1) * H / OH);
        int64_t w0 = (int64_t)floor((double)ow * W / OW), w1 = (int64_t)ceil((double)(ow + 1) * W / OW);
        double s = 0;
        for (int64_t i = h0; i < h1; i++)
          for (int64_t j = w0; j < w1; j++) s += x[p * H * W + i * W + j];
        y[p * OH * OW + oh * OW + ow] = s / (double)((h1 - h0) * (w1 - w0));
      }
}

typedef struct {
  int64_t sz[4], oh, ow;
} adcase_t;

static dlua_status_t ad_fwd(dlua_tensor_t **out, const dlua_tensor_t *x, const void *ctx) {
  const adcase_t *a = ctx;
  return dlua_nn_adaptive_avg_pool2d_forward(out, x, a->oh, a->ow);
}

START_TEST(test_adaptive) {
  const adcase_t cases[] = {{{2, 3, 7, 5}, 3, 2}, {{1, 2, 5, 7}, 7, 5}, {{2, 3, 7, 7}, 1, 1},
                            {{1, 1, 1, 1}, 1, 1}, {{2, 2, 13, 11}, 5, 4}, {{2, 64, 7, 7}, 1, 1}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
    for (int dti = 0; dti < 2; dti++)
      for (int cl = 0; cl < 2; cl++) {
        const adcase_t *a = &cases[ci];
        dlua_dtype_t dt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
        int64_t n = a->sz[0] * a->sz[1] * a->sz[2] * a->sz[3], osz[4] = {a->sz[0], a->sz[1], a->oh, a->ow},
                on = osz[0] * osz[1] * a->oh * a->ow;
        double *x = tu_rand_vals(tu_splitmix, &rng_state, n, 1.0), *w = tu_rand_vals(tu_splitmix, &rng_state, on, 1.0), *y = malloc(on * sizeof(double));
        dlua_tensor_t *tx = mk(dt, a->sz, x, cl), *out = NULL;
        free(x);
        x = tu_values(tx);
        ref_adaptive(a->sz, a->oh, a->ow, x, y);
        ck_assert_int_eq(ad_fwd(&out, tx, a), DLUA_OK);
        expect_tensor(out, y, dti ? 1e-14 : 1e-6, "adaptive_avg_pool2d output");
        if (dti && n <= 400) {
          dlua_tensor_t *gy = mk(DLUA_DTYPE_F64, osz, w, cl), *gx = NULL;
          ck_assert_int_eq(dlua_nn_adaptive_avg_pool2d_backward(&gx, gy, a->sz), DLUA_OK);
          double *g = tu_values(gx);
          fd_check(ad_fwd, a, a->sz, x, w, cl, g, "adaptive_avg_pool2d grad_input");
          free(g);
          dlua_tensor_free(gy), dlua_tensor_free(gx);
        }
        free(x), free(w), free(y);
        dlua_tensor_free(tx), dlua_tensor_free(out);
      }
}
END_TEST

/* ---- threads, dtypes, views, errors ------------------------------------------------------------------------ */

START_TEST(test_threads_dtypes_views) {
  const int64_t sz[4] = {8, 16, 28, 28}, osz[4] = {8, 16, 14, 14};
  int64_t n = 8 * 16 * 28 * 28, on = 8 * 16 * 14 * 14;
  double *x = tu_rand_vals(tu_splitmix, &rng_state, n, 1.0), *w = tu_rand_vals(tu_splitmix, &rng_state, on, 1.0);
  int saved = dlua_get_num_threads();
  for (int cl = 0; cl < 2; cl++) {
    dlua_tensor_t *tx = mk(DLUA_DTYPE_F32, sz, x, cl), *gy = mk(DLUA_DTYPE_F32, osz, w, cl);
    float *res[2][4];
    for (int th = 0; th < 2; th++) {
      dlua_set_num_threads(th + 1);
      dlua_tensor_t *ym = NULL, *ti = NULL, *gm = NULL, *ya = NULL, *ga = NULL;
      ck_assert_int_eq(dlua_nn_max_pool2d_forward(&ym, &ti, tx, 3, 3, 2, 2, 1, 1, 1, 1, 0), DLUA_OK);
      ck_assert_int_eq(dlua_nn_max_pool2d_backward(&gm, gy, ti, sz), DLUA_OK);
      ck_assert_int_eq(dlua_nn_avg_pool2d_forward(&ya, tx, 3, 3, 2, 2, 1, 1, 0, 0, 0), DLUA_OK);
      ck_assert_int_eq(dlua_nn_avg_pool2d_backward(&ga, gy, sz, 3, 3, 2, 2, 1, 1, 0, 0, 0), DLUA_OK);
      dlua_tensor_t *o[4] = {ym, gm, ya, ga};
      for (int k = 0; k < 4; k++) {
        int64_t m = dlua_tensor_numel(o[k]);
        res[th][k] = malloc(m * sizeof(float));
        ck_assert_int_eq(dlua_tensor_to_data(o[k], res[th][k], m * sizeof(float)), DLUA_OK);
        dlua_tensor_free(o[k]);
      }
      dlua_tensor_free(ti);
    }
    const int64_t len[4] = {on, n, on, n};
    for (int k = 0; k < 4; k++) {
      ck_assert_msg(memcmp(res[0][k], res[1][k], len[k] * sizeof(float)) == 0, "result %d differs across threads", k);
      free(res[0][k]), free(res[1][k]);
    }
    dlua_tensor_free(tx), dlua_tensor_free(gy);
  }
  dlua_set_num_threads(saved);
  free(x), free(w);
  // bfloat16 in, bfloat16 out; a narrowed (non-contiguous) input is copied first.
  const int64_t s2[4] = {2, 3, 6, 6};
  double *x2 = tu_rand_vals(tu_splitmix, &rng_state, 2 * 3 * 6 * 6, 1.0), y2[2 * 3 * 3 * 3];
  dlua_tensor_t *tb = mk(DLUA_DTYPE_BF16, s2, x2, 1), *ob = NULL;
  double *xb = tu_values(tb);
  adcase_t ad = {{2, 3, 6, 6}, 3, 3};
  ref_adaptive(ad.sz, 3, 3, xb, y2);
  ck_assert_int_eq(dlua_nn_adaptive_avg_pool2d_forward(&ob, tb, 3, 3), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(ob), DLUA_DTYPE_BF16);
  expect_tensor(ob, y2, 8e-3, "bfloat16 adaptive pool");
  const int64_t wide[4] = {2, 3, 6, 9};
  double *x3 = tu_rand_vals(tu_splitmix, &rng_state, 2 * 3 * 6 * 9, 1.0), *ref3 = malloc(2 * 3 * 6 * 6 * sizeof(double)), y3[2 * 3 * 3 * 3];
  for (int64_t p = 0; p < 6; p++)
    for (int64_t i = 0; i < 6; i++)
      for (int64_t j = 0; j < 6; j++) ref3[(p * 6 + i) * 6 + j] = x3[(p * 6 + i) * 9 + j + 2];
  dlua_tensor_t *tw = mk(DLUA_DTYPE_F64, wide, x3, 0), *tn = NULL, *on2 = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&tn, tw, 3, 2, 6), DLUA_OK);
  pcase_t pc = {{2, 3, 6, 6}, 2, 2, 2, 2, 0, 0, 1, 1, 0};
  acase_t ac = {pc, 1, 0};
  ref_avg(&ac, ref3, y3, 3, 3);
  ck_assert_int_eq(dlua_nn_avg_pool2d_forward(&on2, tn, 2, 2, 2, 2, 0, 0, 0, 1, 0), DLUA_OK);
  expect_tensor(on2, y3, 1e-14, "narrowed input");
  free(x2), free(xb), free(x3), free(ref3);
  dlua_tensor_free(tb), dlua_tensor_free(ob), dlua_tensor_free(tw), dlua_tensor_free(tn), dlua_tensor_free(on2);
}
END_TEST

START_TEST(test_output_size_and_errors) {
  ck_assert_int_eq(dlua_pool2d_output_size(5, 2, 2, 0, 1, 0), 2);
  ck_assert_int_eq(dlua_pool2d_output_size(5, 2, 2, 0, 1, 1), 3);
  // ceil_mode would start a 4th window at 6 = in + pad, inside the right padding only: dropped.
  ck_assert_int_eq(dlua_pool2d_output_size(5, 2, 2, 1, 1, 1), 3);
  ck_assert_int_eq(dlua_pool2d_output_size(28, 3, 2, 1, 1, 0), 14);
  ck_assert_int_eq(dlua_pool2d_output_size(5, 3, 0, 0, 1, 0), -1);
  const double v[64] = {0};
  const int64_t s4[4] = {1, 1, 2, 2}, s3[3] = {1, 2, 2};
  dlua_tensor_t *x = mk(DLUA_DTYPE_F32, s4, v, 0), *x3 = NULL, *y = NULL, *ti = NULL, *xi = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&x3, 3, s3, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&xi, 4, s4, DLUA_DTYPE_I64, DLUA_CPU), DLUA_OK);
  tu_expect_error_at(dlua_nn_max_pool2d_forward(&y, NULL, x3, 2, 2, 2, 2, 0, 0, 1, 1, 0), "max_pool2d:", "4 dimensions (N, C, H, W), got (1, 2, 2)");
  tu_expect_error_at(dlua_nn_max_pool2d_forward(&y, NULL, x, 3, 3, 1, 1, 0, 0, 1, 1, 0), "max_pool2d:",
                     "larger than input (1, 1, 2, 2)");
  tu_expect_error_at(dlua_nn_max_pool2d_forward(&y, NULL, x, 2, 2, 1, 1, 2, 0, 1, 1, 0), "max_pool2d:", "half the kernel");
  tu_expect_error_at(dlua_nn_max_pool2d_forward(&y, NULL, x, 2, 2, 0, 1, 0, 0, 1, 1, 0), "max_pool2d:", "stride (0, 1)");
  tu_expect_error_at(dlua_nn_avg_pool2d_forward(&y, xi, 2, 2, 2, 2, 0, 0, 0, 1, 0), "avg_pool2d:", "floating-point");
  tu_expect_error_at(dlua_nn_adaptive_avg_pool2d_forward(&y, x, 0, 1), "adaptive_avg_pool2d:", "output size (0, 1)");
  ck_assert_ptr_null(y);
  // Backward: indices outside the plane, and a grad_output of the wrong shape.
  const int64_t o1[4] = {1, 1, 1, 1};
  const double bad = 7, one = 1;
  dlua_tensor_t *gy = mk(DLUA_DTYPE_F32, o1, &one, 0), *gx = NULL;
  ti = mk(DLUA_DTYPE_I64, o1, &bad, 0);
  tu_expect_error_at(dlua_nn_max_pool2d_backward(&gx, gy, ti, s4), "max_pool2d_backward:", "outside the 2 x 2 input plane");
  ck_assert_ptr_null(gx);
  tu_expect_error_at(dlua_nn_avg_pool2d_backward(&gx, gy, s4, 1, 1, 1, 1, 0, 0, 0, 1, 0), "avg_pool2d_backward:",
                     "must have shape (1, 1, 2, 2)");
  dlua_tensor_free(x), dlua_tensor_free(x3), dlua_tensor_free(xi), dlua_tensor_free(ti), dlua_tensor_free(gy);
}
END_TEST

/* The front doors reach the kernels through the pool table (kernels/pool.h): the CPU's is dlua_cpu_pool_ops,
   its slots run on a descriptor alone, and a tensor on device 0 without a CUDA device gets the registry's one message. */
START_TEST(test_backend_table) {
  const struct dlua_pool_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("max_pool2d", DLUA_CPU, pool, forward, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_pool_ops);
  ck_assert_ptr_nonnull(k->backward);
  ck_assert_int_eq(k->native_16bit, 0);
  // The forward slot on a descriptor: one 2 x 2 window over a 1 x 1 x 2 x 2 plane.
  const double xv[4] = {1, 4, -2, 3};
  double y = 0;
  int64_t ind = -1;
  const dlua_pool_fwd_t a = {.p = {.kind = DLUA_POOL_MAX, .dtype = DLUA_DTYPE_F64, .device = DLUA_CPU, .N = 1, .C = 1,
                                   .H = 2, .W = 2, .OH = 1, .OW = 1, .kh = 2, .kw = 2, .sh = 2, .sw = 2, .dh = 1, .dw = 1},
                             .x = xv, .y = &y, .ind = &ind};
  ck_assert_int_eq(k->forward("max_pool2d", &a), DLUA_OK);
  ck_assert(y == 4 && ind == 1);
  // The backward slot reports a position outside the plane through *bad.
  const double gy = 1;
  double gx[4] = {0};
  int64_t far = 9;
  int bad = 0;
  const dlua_pool_bwd_t b = {.p = a.p, .gy = &gy, .ind = &far, .gx = gx, .bad = &bad};
  ck_assert_int_eq(k->backward("max_pool2d_backward", &b), DLUA_OK);
  ck_assert_int_eq(bad, 1);

  const int64_t sz[4] = {1, 1, 2, 2};
  dlua_tensor_t *x = mk(DLUA_DTYPE_F32, sz, xv, 0), *out = NULL;
  if (dlua_cuda_device_count() > 0) {
    const dlua_backend_t *be = NULL;
    ck_assert_int_eq(dlua_backend_for("max_pool2d", 0, &be), DLUA_OK);
    ck_assert_int_eq(DLUA_BACKEND("max_pool2d", 0, pool, forward, &k), DLUA_OK);
    ck_assert_ptr_eq(k, be->pool);
    ck_assert_int_eq(k->native_16bit, 1);
  } else {
    // A handle claiming device 0 (never dereferenced: the registry answers before any kernel runs).
    dlua_tensor_t on0 = *x;
    on0.device = 0;
    tu_expect_error_at(dlua_nn_max_pool2d_forward(&out, NULL, &on0, 2, 2, 2, 2, 0, 0, 1, 1, 0), "max_pool2d:",
                       "no CUDA device available (");
    tu_expect_error_at(dlua_nn_adaptive_avg_pool2d_backward(&out, &on0, sz), "adaptive_avg_pool2d_backward:",
                       "no CUDA device available (");
    ck_assert_ptr_null(out);
  }
  dlua_tensor_free(x);
}
END_TEST

int main(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_max_forward_reference);
  tcase_add_test(tc, test_max_nan_inf_int32);
  tcase_add_test(tc, test_max_backward);
  tcase_add_test(tc, test_avg_forward_backward);
  tcase_add_test(tc, test_adaptive);
  tcase_add_test(tc, test_threads_dtypes_views);
  tcase_add_test(tc, test_output_size_and_errors);
  tcase_add_test(tc, test_backend_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

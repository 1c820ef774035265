/* Check suite for host/ops/loss.c, host/ops/activation.c and host/cpu/loss.c: softmax, cross-entropy, MSE, threshold/ReLU backward and dropout against double references and finite differences.
   Over 900 lines on purpose: one suite for the one backend family these three files make (kernels/loss.h), sharing
   its raw-cast helpers (put/mk below); split per op it would copy them into each file. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/loss.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* Not tu_put: casts straight to int32/uint8 (bool is not x != 0), and the masks and labels below were
   written against that; so mk stays local too. */
static void put(dlua_dtype_t dt, void *buf, int64_t i, double x) {
  switch (dt) {
    case DLUA_DTYPE_F32: ((float *)buf)[i] = (float)x; break;
    case DLUA_DTYPE_F64: ((double *)buf)[i] = x; break;
    case DLUA_DTYPE_F16: ((uint16_t *)buf)[i] = dlua_f32_to_f16((float)x); break;
    case DLUA_DTYPE_BF16: ((uint16_t *)buf)[i] = dlua_f32_to_bf16((float)x); break;
    case DLUA_DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)x; break;
    case DLUA_DTYPE_I64: ((int64_t *)buf)[i] = (int64_t)x; break;
    default: ((uint8_t *)buf)[i] = (uint8_t)x; break;
  }
}

static dlua_tensor_t *mk(dlua_dtype_t dt, int nd, const int64_t *sz, const double *v) {
  int64_t n = dlua_shape_numel(nd, sz);
  void *buf = malloc((size_t)(n > 0 ? n : 1) * 8);
  for (int64_t i = 0; i < n; i++) put(dt, buf, i, v[i]);
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, nd, sz, dt, buf), DLUA_OK);
  free(buf);
  return t;
}

static double scalar(const dlua_tensor_t *t) {
  ck_assert_int_eq(dlua_tensor_numel(t), 1);
  double *v = tu_rd(t), x = v[0];
  free(v);
  return x;
}

/* Values as the dtype stores them, so references see exactly the kernel's inputs. */
static void round_to(dlua_dtype_t dt, double *v, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint8_t buf[8];
    put(dt, buf, 0, v[i]);
    v[i] = tu_get(dt, buf, 0);
  }
}

/* Not tu_expect_close: here NaN may match NaN. */
static void expect_close(const double *got, const double *want, int64_t n, double tol, const char *what) {
  for (int64_t i = 0; i < n; i++) {
    double err = fabs(got[i] - want[i]), lim = tol * (1 + fabs(want[i]));
    ck_assert_msg(err <= lim || (isnan(got[i]) && isnan(want[i])), "%s: element %lld got %.17g want %.17g", what,
                  (long long)i, got[i], want[i]);
  }
}

static double tol_for(dlua_dtype_t dt) {
  switch (dt) {
    case DLUA_DTYPE_F64: return 1e-13;
    case DLUA_DTYPE_F32: return 2e-6;
    case DLUA_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
  }
}

static const dlua_dtype_t FLOAT_DT[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16};

/* ---- softmax ------------------------------------------------------------------------------------- */

/* Reference along dim of a row-major (outer, K, inner) array, written from the definition. */
static void ref_softmax(const double *x, double *y, int64_t outer, int64_t K, int64_t inner, int log_) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t s = 0; s < inner; s++) {
      const double *xr = x + o * K * inner + s;
      double *yr = y + o * K * inner + s;
      double mx = -INFINITY, z = 0;
      for (int64_t k = 0; k < K; k++) mx = fmax(mx, xr[k * inner]);
      for (int64_t k = 0; k < K; k++) z += exp(xr[k * inner] - mx);
      for (int64_t k = 0; k < K; k++) yr[k * inner] = log_ ? xr[k * inner] - mx - log(z) : exp(xr[k * inner] - mx) / z;
    }
}

START_TEST(test_softmax_forward) {
  struct {
    int nd;
    int64_t sz[3];
    int dim;
  } cases[] = {{2, {3, 5}, 1}, {2, {3, 5}, 0}, {3, {2, 3, 4}, 1}, {3, {2, 3, 4}, 2}, {2, {1, 1}, 1},
               {2, {7, 13}, 1}, {2, {0, 5}, 1}, {2, {4, 0}, 1}, {1, {11}, 0}, {0, {0}, 0}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (size_t di = 0; di < 4; di++)
      for (int lg = 0; lg < 2; lg++) {
        dlua_dtype_t dt = FLOAT_DT[di];
        int nd = cases[c].nd, dim = cases[c].dim;
        int64_t n = dlua_shape_numel(nd, cases[c].sz), outer = 1, K = nd ? cases[c].sz[dim] : 1, inner = 1;
        for (int d = 0; d < nd; d++) {
          if (d < dim) outer *= cases[c].sz[d];
          if (d > dim) inner *= cases[c].sz[d];
        }
        double *x = tu_rand_vals(tu_lcg, &rng_state, n, 8.0), *want = malloc((size_t)(n + 1) * sizeof(double));
        round_to(dt, x, n);
        ref_softmax(x, want, outer, K, inner, lg);
        dlua_tensor_t *t = mk(dt, nd, cases[c].sz, x), *y = NULL;
        ck_assert_int_eq(dlua_nn_softmax(&y, t, dim, lg), DLUA_OK);
        ck_assert_int_eq(dlua_tensor_dtype(y), dt);
        ck_assert_int_eq(dlua_tensor_ndim(y), nd);
        double *got = tu_rd(y);
        char what[64];
        snprintf(what, sizeof what, "softmax case %zu %s log %d", c, dlua_dtype_name(dt), lg);
        // f16/bf16 results are rounded to the dtype: compare relative to that rounding.
        expect_close(got, want, n, tol_for(dt), what);
        free(got);
        free(x);
        free(want);
        dlua_tensor_free(y);
        dlua_tensor_free(t);
      }
}
END_TEST

/* Non-contiguous input, an output of another dtype, in place, and large extremes. */
START_TEST(test_softmax_views) {
  int64_t sz[2] = {6, 9};
  double *x = tu_rand_vals(tu_lcg, &rng_state, 54, 5.0), want[54], xt[54];
  dlua_tensor_t *base = mk(DLUA_DTYPE_F64, 2, sz, x), *t = NULL, *y = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&t, base, 0, 1), DLUA_OK);  // (9, 6): t[i][j] = x[j*9+i]
  for (int i = 0; i < 9; i++)
    for (int j = 0; j < 6; j++) xt[i * 6 + j] = x[j * 9 + i];
  ref_softmax(xt, want, 9, 6, 1, 0);
  // Into a given float32 output: cast on the way out.
  int64_t szt[2] = {9, 6};
  ck_assert_int_eq(dlua_tensor_empty(&y, 2, szt, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_nn_softmax(&y, t, 1, 0), DLUA_OK);
  double *got = tu_rd(y);
  expect_close(got, want, 54, 1e-6, "transposed into f32");
  free(got);
  // In place over the transposed view: base changes through the strides.
  ck_assert_int_eq(dlua_nn_softmax(&t, t, 1, 1), DLUA_OK);
  ref_softmax(xt, want, 9, 6, 1, 1);
  got = tu_rd(t);
  expect_close(got, want, 54, 1e-13, "in place, transposed");
  free(got);
  // Huge logits: max subtraction keeps it finite.
  int64_t s3 = 3;
  double big[3] = {1000, 1001, -1000}, e1 = exp(-1.0), w3[3] = {e1 / (1 + e1), 1 / (1 + e1), 0};
  dlua_tensor_t *b = mk(DLUA_DTYPE_F32, 1, &s3, big), *yb = NULL;
  ck_assert_int_eq(dlua_nn_softmax(&yb, b, 0, 0), DLUA_OK);
  got = tu_rd(yb);
  expect_close(got, w3, 3, 1e-6, "large logits");
  free(got);
  // Bad dims.
  tu_expect_error(dlua_nn_softmax(&yb, b, 1, 0), "softmax: dimension 1 out of range for (3) float32 cpu");
  tu_expect_error(dlua_nn_softmax(&yb, NULL, 0, 1), "log_softmax: x is NULL");
  dlua_tensor_free(yb);
  dlua_tensor_free(b);
  dlua_tensor_free(y);
  dlua_tensor_free(t);
  dlua_tensor_free(base);
  free(x);
}
END_TEST

/* backward against central differences of L(x) = sum(w * f(x)), f64, inner > 1. */
START_TEST(test_softmax_backward_fd) {
  int64_t sz[3] = {2, 5, 3}, n = 30;
  for (int lg = 0; lg < 2; lg++)
    for (int dim = 0; dim < 3; dim++) {
      int64_t outer = 1, K = sz[dim], inner = 1;
      for (int d = 0; d < 3; d++) {
        if (d < dim) outer *= sz[d];
        if (d > dim) inner *= sz[d];
      }
      double *x = tu_rand_vals(tu_lcg, &rng_state, n, 3.0), *w = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), y[30], num[30];
      const double h = 1e-6;
      for (int64_t i = 0; i < n; i++) {
        double keep = x[i], lp = 0, lm = 0;
        x[i] = keep + h;
        ref_softmax(x, y, outer, K, inner, lg);
        for (int64_t j = 0; j < n; j++) lp += w[j] * y[j];
        x[i] = keep - h;
        ref_softmax(x, y, outer, K, inner, lg);
        for (int64_t j = 0; j < n; j++) lm += w[j] * y[j];
        x[i] = keep;
        num[i] = (lp - lm) / (2 * h);
      }
      dlua_tensor_t *xt = mk(DLUA_DTYPE_F64, 3, sz, x), *wt = mk(DLUA_DTYPE_F64, 3, sz, w), *yt = NULL, *gx = NULL;
      ck_assert_int_eq(dlua_nn_softmax(&yt, xt, dim, lg), DLUA_OK);
      ck_assert_int_eq(dlua_nn_softmax_backward(&gx, wt, yt, dim, lg), DLUA_OK);
      double *got = tu_rd(gx);
      expect_close(got, num, n, 1e-7, lg ? "log_softmax backward" : "softmax backward");
      // f32 agrees with the f64 gradient to float rounding.
      dlua_tensor_t *x32 = NULL, *w32 = NULL, *y32 = NULL, *g32 = NULL;
      ck_assert_int_eq(dlua_tensor_to_dtype(&x32, xt, DLUA_DTYPE_F32), DLUA_OK);
      ck_assert_int_eq(dlua_tensor_to_dtype(&w32, wt, DLUA_DTYPE_F32), DLUA_OK);
      ck_assert_int_eq(dlua_nn_softmax(&y32, x32, dim, lg), DLUA_OK);
      ck_assert_int_eq(dlua_nn_softmax_backward(&g32, w32, y32, dim, lg), DLUA_OK);
      double *got32 = tu_rd(g32);
      expect_close(got32, got, n, 1e-5, "f32 softmax backward");
      free(got32);
      free(got);
      free(x);
      free(w);
      dlua_tensor_free(x32);
      dlua_tensor_free(w32);
      dlua_tensor_free(y32);
      dlua_tensor_free(g32);
      dlua_tensor_free(xt);
      dlua_tensor_free(wt);
      dlua_tensor_free(yt);
      dlua_tensor_free(gx);
    }
  // Shape mismatch between grad_output and output.
  int64_t a[2] = {2, 3}, b[2] = {3, 2};
  double z[6] = {0};
  dlua_tensor_t *ta = mk(DLUA_DTYPE_F32, 2, a, z), *tb = mk(DLUA_DTYPE_F32, 2, b, z), *g = NULL;
  tu_expect_error(dlua_nn_softmax_backward(&g, ta, tb, 1, 0), "softmax_backward: grad_output (2, 3) float32 cpu and output (3, 2)");
  ck_assert_ptr_null(g);
  dlua_tensor_free(ta);
  dlua_tensor_free(tb);
}
END_TEST

/* ---- cross-entropy ------------------------------------------------------------------------------------ */

/* PyTorch's definition for logits (N, K, inner) row-major and 0-based class labels (ignored
   targets carry `ign`). Returns the reduced loss, or fills none[] per target. */
static double ref_ce(const double *x, const int64_t *lab, int64_t N, int64_t K, int64_t inner, const double *w,
                     double eps, int64_t ign, int reduction, double *none) {
  double total = 0, wsum = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t s = 0; s < inner; s++) {
      int64_t i = n * inner + s;
      double l = 0;
      if (lab[i] != ign) {
        double mx = -INFINITY, z = 0;
        for (int64_t k = 0; k < K; k++) mx = fmax(mx, x[(n * K + k) * inner + s]);
        for (int64_t k = 0; k < K; k++) z += exp(x[(n * K + k) * inner + s] - mx);
        double nll = 0, smooth = 0;
        for (int64_t k = 0; k < K; k++) {
          double lp = x[(n * K + k) * inner + s] - mx - log(z), wk = w ? w[k] : 1;
          if (k == lab[i]) nll = -wk * lp;
          smooth -= wk * lp;
        }
        l = (1 - eps) * nll + eps / (double)K * smooth;
        wsum += w ? w[lab[i]] : 1;
      }
      if (none) none[i] = l;
      total += l;
    }
  return reduction == DLUA_LOSS_MEAN ? total / wsum : total;
}

/* The hand-worked example. logits (3, 4) = log of
     row 1: [1, 1, 1, 1]  -> p = [1/4, 1/4, 1/4, 1/4], label 2
     row 2: [1, 2, 3, 2]  -> p = [1/8, 2/8, 3/8, 2/8], label 3
     row 3: [4, 2, 1, 1]  -> p = [4/8, 2/8, 1/8, 1/8], label 0 = ignore_index
   labels count from 1 (Lua), weight w = [1, 2, 1, 0.5], smoothing e = 0.2, so e/K = 0.05 and
   sum(w) = 4.5. Per kept target, l = -(1-e) w_y log p_y - (e/K) sum_c w_c log p_c:
     row 1: log p_c = -ln 4 = -2 ln 2 for all c; w_y = 2:
            l1 = 0.8 * 2 * 2 ln2 + 0.05 * 4.5 * 2 ln2 = (3.2 + 0.45) ln2 = 3.65 ln2
     row 2: log p = [-3 ln2, -2 ln2, ln3 - 3 ln2, -2 ln2]; w_y = 1:
            nll = 3 ln2 - ln3; sum_c w_c log p_c = -3 ln2 - 4 ln2 + ln3 - 3 ln2 - ln2 = ln3 - 11 ln2
            l2 = 0.8 (3 ln2 - ln3) + 0.05 (11 ln2 - ln3) = 2.95 ln2 - 0.85 ln3
     row 3: ignored, 0.
   sum = 6.6 ln2 - 0.85 ln3; mean divides by the kept targets' weights w_2 + w_3 = 2 + 1 = 3.
   Gradient (mean, upstream 1): (p_c S - q_c) / 3 with q_c = 0.05 w_c + 0.8 w_y [c = y] and
   S = sum_c q_c = 0.8 w_y + 0.225:
     row 1: S = 1.825, p S = 0.45625, q = [0.05, 1.7, 0.05, 0.025]
            -> [0.40625, -1.24375, 0.40625, 0.43125] / 3
     row 2: S = 1.025, p S = [0.128125, 0.25625, 0.384375, 0.25625], q = [0.05, 0.1, 0.85, 0.025]
            -> [0.078125, 0.15625, -0.465625, 0.23125] / 3
     row 3: 0. (Each row sums to 0, as sum_c p_c S = S = sum_c q_c.) */
START_TEST(test_cross_entropy_by_hand) {
  const double L2 = log(2.0), L3 = log(3.0);
  double logits[12] = {0, 0, 0, 0, 0, L2, log(3.0), L2, log(4.0), L2, 0, 0};
  double labels[3] = {2, 3, 0}, w[4] = {1, 2, 1, 0.5};
  double none_want[3] = {3.65 * L2, 2.95 * L2 - 0.85 * L3, 0};
  double sum_want = 6.6 * L2 - 0.85 * L3, mean_want = sum_want / 3;
  double g_want[12] = {0.40625 / 3, -1.24375 / 3, 0.40625 / 3,  0.43125 / 3, 0.078125 / 3, 0.15625 / 3,
                       -0.465625 / 3, 0.23125 / 3, 0, 0, 0, 0};
  int64_t sz[2] = {3, 4}, n3 = 3, n4 = 4;
  dlua_dtype_t dts[2] = {DLUA_DTYPE_F64, DLUA_DTYPE_F32}, ldts[2] = {DLUA_DTYPE_I64, DLUA_DTYPE_I32};
  for (int v = 0; v < 2; v++) {
    double tol = v == 0 ? 1e-14 : 3e-7;
    dlua_tensor_t *x = mk(dts[v], 2, sz, logits), *lab = mk(ldts[v], 1, &n3, labels), *wt = mk(dts[v], 1, &n4, w);
    dlua_tensor_t *loss = NULL, *lp = NULL, *g = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy(&loss, &lp, x, lab, wt, DLUA_LOSS_MEAN, 0.2, 0, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_ndim(loss), 0);
    ck_assert_int_eq(dlua_tensor_dtype(loss), dts[v]);
    ck_assert_msg(fabs(scalar(loss) - mean_want) < tol, "mean %.17g want %.17g", scalar(loss), mean_want);
    double lp_want[12] = {-2 * L2, -2 * L2, -2 * L2, -2 * L2, -3 * L2, -2 * L2, L3 - 3 * L2, -2 * L2,
                          -L2, -2 * L2, -3 * L2, -3 * L2};
    double *got = tu_rd(lp);
    expect_close(got, lp_want, 12, tol, "hand log_probs");
    free(got);
    ck_assert_int_eq(dlua_nn_cross_entropy_backward(&g, NULL, lp, lab, wt, DLUA_LOSS_MEAN, 0.2, 0, 1), DLUA_OK);
    got = tu_rd(g);
    expect_close(got, g_want, 12, tol, "hand gradient");
    free(got);
    dlua_tensor_free(loss);
    loss = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy(&loss, NULL, x, lab, wt, DLUA_LOSS_SUM, 0.2, 0, 1), DLUA_OK);
    ck_assert_msg(fabs(scalar(loss) - sum_want) < tol * 4, "sum %.17g want %.17g", scalar(loss), sum_want);
    dlua_tensor_free(loss);
    loss = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy(&loss, NULL, x, lab, wt, DLUA_LOSS_NONE, 0.2, 0, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_ndim(loss), 1);
    got = tu_rd(loss);
    expect_close(got, none_want, 3, tol, "hand none");
    free(got);
    // Upstream gradient 2 for sum: twice the mean's gradient times 3.
    double two = 2;
    dlua_tensor_t *g2 = mk(dts[v], 0, NULL, &two), *gs = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy_backward(&gs, g2, lp, lab, wt, DLUA_LOSS_SUM, 0.2, 0, 1), DLUA_OK);
    got = tu_rd(gs);
    for (int i = 0; i < 12; i++) ck_assert_msg(fabs(got[i] - 6 * g_want[i]) < 8 * tol, "sum grad %d", i);
    free(got);
    dlua_tensor_free(g2);
    dlua_tensor_free(gs);
    dlua_tensor_free(loss);
    dlua_tensor_free(lp);
    dlua_tensor_free(g);
    dlua_tensor_free(x);
    dlua_tensor_free(lab);
    dlua_tensor_free(wt);
  }
}
END_TEST

/* Against the reference over shapes, options, label dtypes and index bases. */
START_TEST(test_cross_entropy_reference) {
  struct {
    int nd;
    int64_t sz[4];
  } shapes[] = {{2, {5, 7}}, {2, {1, 1}}, {3, {3, 4, 5}}, {4, {2, 3, 2, 3}}, {2, {13, 2}}, {1, {6}}, {2, {0, 4}}};
  for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
    for (int opt = 0; opt < 4; opt++)
      for (int red = 0; red < 3; red++) {
        int nd = shapes[c].nd;
        int64_t N = nd >= 2 ? shapes[c].sz[0] : 1, K = nd >= 2 ? shapes[c].sz[1] : shapes[c].sz[0], inner = 1;
        for (int d = 2; d < nd; d++) inner *= shapes[c].sz[d];
        int64_t P = N * inner, lsz[3];
        int lnd = nd - 1;
        if (nd >= 2) lsz[0] = N;
        for (int d = 2; d < nd; d++) lsz[d - 1] = shapes[c].sz[d];
        int base = opt & 1 ? 1 : 0, weighted = opt >= 2;
        double eps = opt == 1 || opt == 3 ? 0.15 : 0;
        int64_t ignore = base ? 0 : -100;  // class 0 from Lua; -100 from C
        double *x = tu_rand_vals(tu_lcg, &rng_state, N * K * inner, 4.0), *w = tu_rand_vals(tu_lcg, &rng_state, K, 1.0), *labd = malloc((size_t)(P + 1) * 8);
        int64_t *lab0 = malloc((size_t)(P + 1) * 8);
        for (int64_t k = 0; k < K; k++) w[k] = 1.5 + w[k];
        for (int64_t i = 0; i < P; i++) {
          lab0[i] = (int64_t)((tu_lcg(&rng_state) + 1) * 0.5 * (double)K) % K;
          if (P > 2 && i % 3 == 1) lab0[i] = -1;  // ignored
          labd[i] = lab0[i] < 0 ? (double)ignore : (double)(lab0[i] + base);
        }
        double none_want[64];
        double want = ref_ce(x, lab0, N, K, inner, weighted ? w : NULL, eps, -1, red, none_want);
        dlua_tensor_t *xt = mk(DLUA_DTYPE_F64, nd, shapes[c].sz, x), *lt = mk(opt & 1 ? DLUA_DTYPE_I32 : DLUA_DTYPE_I64, lnd, lsz, labd);
        dlua_tensor_t *wt = weighted ? mk(DLUA_DTYPE_F64, 1, &K, w) : NULL, *loss = NULL;
        ck_assert_int_eq(dlua_nn_cross_entropy(&loss, NULL, xt, lt, wt, (dlua_loss_reduction_t)red, eps, ignore, base), DLUA_OK);
        char what[96];
        snprintf(what, sizeof what, "ce shape %zu opt %d reduction %d", c, opt, red);
        double *got = tu_rd(loss);
        if (red == DLUA_LOSS_NONE) {
          ck_assert_int_eq(dlua_tensor_ndim(loss), lnd);
          expect_close(got, none_want, P, 1e-13, what);
        } else {
          expect_close(got, &want, 1, 1e-13, what);  // (0, 4) mean: 0 / 0 = NaN on both sides
        }
        free(got);
        dlua_tensor_free(loss);
        dlua_tensor_free(xt);
        dlua_tensor_free(lt);
        dlua_tensor_free(wt);
        free(x);
        free(w);
        free(labd);
        free(lab0);
      }
}
END_TEST

/* backward against central differences of the reference, with upstream gradients, f64. */
START_TEST(test_cross_entropy_backward_fd) {
  int64_t sz[3] = {4, 5, 3}, N = 4, K = 5, inner = 3, P = 12, n = 60, lsz[2] = {4, 3};
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 2.0), w[5] = {0.5, 1, 2, 1.5, 0.25}, labd[12], gnone[12], num[60];
  int64_t lab0[12];
  for (int64_t i = 0; i < P; i++) {
    lab0[i] = i % 5 == 2 ? -1 : (i * 7) % K;
    labd[i] = lab0[i] < 0 ? 0 : (double)(lab0[i] + 1);
    gnone[i] = tu_lcg(&rng_state);
  }
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F64, 3, sz, x), *lt = mk(DLUA_DTYPE_I64, 2, lsz, labd), *wt = mk(DLUA_DTYPE_F64, 1, &K, w);
  dlua_tensor_t *gn = mk(DLUA_DTYPE_F64, 2, lsz, gnone);
  for (int red = 0; red < 3; red++)
    for (int sm = 0; sm < 2; sm++)
      for (int wtd = 0; wtd < 2; wtd++) {
        double eps = sm ? 0.3 : 0, h = 1e-6, none[12];
        const double *wp = wtd ? w : NULL;
        double g0 = red == DLUA_LOSS_NONE ? 0 : 1.75;
        for (int64_t i = 0; i < n; i++) {
          double keep = x[i], lp, lm;
          x[i] = keep + h;
          lp = ref_ce(x, lab0, N, K, inner, wp, eps, -1, red, none);
          if (red == DLUA_LOSS_NONE) {
            lp = 0;
            for (int j = 0; j < 12; j++) lp += gnone[j] * none[j];
          }
          x[i] = keep - h;
          lm = ref_ce(x, lab0, N, K, inner, wp, eps, -1, red, none);
          if (red == DLUA_LOSS_NONE) {
            lm = 0;
            for (int j = 0; j < 12; j++) lm += gnone[j] * none[j];
          }
          x[i] = keep;
          num[i] = (lp - lm) / (2 * h) * (red == DLUA_LOSS_NONE ? 1 : g0);
        }
        dlua_tensor_t *lp = NULL, *loss = NULL, *g = NULL, *gs = mk(DLUA_DTYPE_F64, 0, NULL, &g0);
        ck_assert_int_eq(dlua_nn_cross_entropy(&loss, &lp, xt, lt, wtd ? wt : NULL, (dlua_loss_reduction_t)red, eps, 0, 1), DLUA_OK);
        ck_assert_int_eq(dlua_nn_cross_entropy_backward(&g, red == DLUA_LOSS_NONE ? gn : gs, lp, lt, wtd ? wt : NULL,
                                                        (dlua_loss_reduction_t)red, eps, 0, 1), DLUA_OK);
        double *got = tu_rd(g);
        char what[64];
        snprintf(what, sizeof what, "ce backward red %d smooth %d weight %d", red, sm, wtd);
        expect_close(got, num, n, 1e-7, what);
        free(got);
        // In place over the saved log-probabilities (the fused path a criterion may take).
        if (red != DLUA_LOSS_NONE) {
          ck_assert_int_eq(dlua_nn_cross_entropy_backward(&lp, gs, lp, lt, wtd ? wt : NULL, (dlua_loss_reduction_t)red,
                                                          eps, 0, 1), DLUA_OK);
          got = tu_rd(lp);
          expect_close(got, num, n, 1e-7, what);
          free(got);
        }
        dlua_tensor_free(lp);
        dlua_tensor_free(loss);
        dlua_tensor_free(g);
        dlua_tensor_free(gs);
      }
  // Without weights or smoothing the gradient is softmax - one_hot (to rounding).
  dlua_tensor_t *lp = NULL, *loss = NULL, *g = NULL, *sm = NULL;
  ck_assert_int_eq(dlua_nn_cross_entropy(&loss, &lp, xt, lt, NULL, DLUA_LOSS_SUM, 0, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_nn_cross_entropy_backward(&g, NULL, lp, lt, NULL, DLUA_LOSS_SUM, 0, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_nn_softmax(&sm, xt, 1, 0), DLUA_OK);
  double *gv = tu_rd(g), *sv = tu_rd(sm);
  for (int64_t nn = 0; nn < N; nn++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t s = 0; s < inner; s++) {
        int64_t i = (nn * K + k) * inner + s, t = nn * inner + s;
        double want = lab0[t] < 0 ? 0 : sv[i] - (k == lab0[t]);
        ck_assert_msg(fabs(gv[i] - want) < 1e-14, "softmax - one_hot at %lld", (long long)i);
      }
  free(gv);
  free(sv);
  dlua_tensor_free(sm);
  dlua_tensor_free(lp);
  dlua_tensor_free(loss);
  dlua_tensor_free(g);
  dlua_tensor_free(xt);
  dlua_tensor_free(lt);
  dlua_tensor_free(wt);
  dlua_tensor_free(gn);
  free(x);
}
END_TEST

/* Non-contiguous logits and labels, f16/bf16 logits, and bad input. */
START_TEST(test_cross_entropy_views_and_errors) {
  // logits given as the transpose of a (K, N) tensor; labels a strided slice.
  int64_t kn[2] = {6, 9}, N = 9, K = 6, l18 = 18;
  double *raw = tu_rand_vals(tu_lcg, &rng_state, 54, 3.0), x[54], labraw[18];
  for (int i = 0; i < 18; i++) labraw[i] = (i * 5) % 6;  // 0-based
  for (int n = 0; n < 9; n++)
    for (int k = 0; k < 6; k++) x[n * 6 + k] = raw[k * 9 + n];
  int64_t lab0[9];
  for (int n = 0; n < 9; n++) lab0[n] = (int64_t)labraw[2 * n];
  double want = ref_ce(x, lab0, N, K, 1, NULL, 0.1, -100, DLUA_LOSS_MEAN, NULL);
  dlua_tensor_t *base = mk(DLUA_DTYPE_F64, 2, kn, raw), *xt = NULL, *lb = mk(DLUA_DTYPE_I64, 1, &l18, labraw), *lt = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&xt, base, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_slice(&lt, lb, 0, 0, 18, 2), DLUA_OK);
  dlua_tensor_t *loss = NULL;
  ck_assert_int_eq(dlua_nn_cross_entropy(&loss, NULL, xt, lt, NULL, DLUA_LOSS_MEAN, 0.1, -100, 0), DLUA_OK);
  ck_assert_msg(fabs(scalar(loss) - want) < 1e-13, "strided ce %.17g want %.17g", scalar(loss), want);
  dlua_tensor_free(loss);
  // f16 and bf16 logits compute in float32 on the rounded values.
  for (int v = 0; v < 2; v++) {
    dlua_dtype_t dt = v ? DLUA_DTYPE_BF16 : DLUA_DTYPE_F16;
    double xr[54];
    memcpy(xr, x, sizeof xr);
    round_to(dt, xr, 54);
    double wr = ref_ce(xr, lab0, N, K, 1, NULL, 0.1, -100, DLUA_LOSS_SUM, NULL);
    int64_t nk[2] = {9, 6};
    dlua_tensor_t *xh = mk(dt, 2, nk, x), *l = NULL, *lp = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy(&l, &lp, xh, lt, NULL, DLUA_LOSS_SUM, 0.1, -100, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_dtype(l), dt);
    ck_assert_int_eq(dlua_tensor_dtype(lp), dt);
    ck_assert_msg(fabs(scalar(l) - wr) < tol_for(dt) * (1 + fabs(wr)), "%s ce %g want %g", dlua_dtype_name(dt), scalar(l), wr);
    dlua_tensor_free(l);
    dlua_tensor_free(lp);
    dlua_tensor_free(xh);
  }
  // Labels out of range name the label as the caller numbers it, and the valid range.
  int64_t n3 = 3, s34[2] = {3, 4};
  double z12[12] = {0}, bad1[3] = {1, 5, 2}, bad0[3] = {0, 4, 1}, badneg[3] = {1, -3, 2};
  dlua_tensor_t *x34 = mk(DLUA_DTYPE_F32, 2, s34, z12), *l1 = mk(DLUA_DTYPE_I64, 1, &n3, bad1);
  dlua_tensor_t *l0 = mk(DLUA_DTYPE_I32, 1, &n3, bad0), *ln = mk(DLUA_DTYPE_I64, 1, &n3, badneg), *out = NULL;
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l1, NULL, DLUA_LOSS_MEAN, 0, -100, 1),
                  "cross_entropy: label 5 at target 2 is out of range for 4 classes: expected 1..4");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l0, NULL, DLUA_LOSS_MEAN, 0, -100, 1), "label 0 at target 1");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l0, NULL, DLUA_LOSS_MEAN, 0, -100, 0), "label 4 at target 1 is out of range for 4 classes: expected 0..3");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, ln, NULL, DLUA_LOSS_MEAN, 0, -100, 1), "label -3");
  // ... but a label equal to ignore_index is fine, even out of range.
  ck_assert_int_eq(dlua_nn_cross_entropy(&out, NULL, x34, l1, NULL, DLUA_LOSS_MEAN, 0, 5, 1), DLUA_OK);
  ck_assert_msg(fabs(scalar(out) - log(4.0)) < 1e-6, "uniform logits give ln 4");
  dlua_tensor_free(out);
  out = NULL;
  // Every target ignored: mean is NaN (0 / 0), as in PyTorch; sum is 0.
  double allign[3] = {7, 7, 7};
  dlua_tensor_t *la = mk(DLUA_DTYPE_I64, 1, &n3, allign);
  ck_assert_int_eq(dlua_nn_cross_entropy(&out, NULL, x34, la, NULL, DLUA_LOSS_MEAN, 0, 7, 1), DLUA_OK);
  ck_assert(isnan(scalar(out)));
  dlua_tensor_free(out);
  out = NULL;
  // Shapes, dtypes, options.
  int64_t n2 = 2, n5 = 5;
  double d5[5] = {1, 1, 1, 1, 1};
  dlua_tensor_t *l2 = mk(DLUA_DTYPE_I64, 1, &n2, bad1), *w5 = mk(DLUA_DTYPE_F32, 1, &n5, d5), *lf = mk(DLUA_DTYPE_F32, 1, &n3, bad1);
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l2, NULL, DLUA_LOSS_MEAN, 0, -100, 1),
                  "cross_entropy: logits (3, 4) float32 cpu and labels (2) int64 cpu do not match");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l1, w5, DLUA_LOSS_MEAN, 0, 5, 1),
                  "cross_entropy: weight (5) float32 cpu must be one value per class: (4)");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, lf, NULL, DLUA_LOSS_MEAN, 0, -100, 1), "labels must be an integer tensor");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l1, NULL, DLUA_LOSS_MEAN, 1.5, 5, 1), "label_smoothing must be in [0, 1], got 1.5");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, x34, l1, NULL, (dlua_loss_reduction_t)3, 0, 5, 1), "invalid reduction 3");
  tu_expect_error(dlua_nn_cross_entropy(&out, NULL, l1, l1, NULL, DLUA_LOSS_MEAN, 0, 5, 1), "logits must be a floating-point tensor");
  ck_assert_ptr_null(out);
  dlua_tensor_t *g = NULL, *gbad = mk(DLUA_DTYPE_F32, 1, &n2, d5);
  tu_expect_error(dlua_nn_cross_entropy_backward(&g, gbad, x34, l0, NULL, DLUA_LOSS_MEAN, 0, -100, 0),
                  "cross_entropy_backward: grad_output (2) float32 cpu of a reduced loss must hold one value");
  tu_expect_error(dlua_nn_cross_entropy_backward(&g, gbad, x34, l0, NULL, DLUA_LOSS_NONE, 0, -100, 0),
                  "grad_output (2) float32 cpu and labels (3) int32 cpu must have the same shape");
  tu_expect_error(dlua_nn_cross_entropy_backward(&g, NULL, x34, l1, NULL, DLUA_LOSS_MEAN, 0, -100, 1), "label 5 at target 2");
  ck_assert_ptr_null(g);
  dlua_tensor_free(gbad);
  dlua_tensor_free(l2);
  dlua_tensor_free(w5);
  dlua_tensor_free(lf);
  dlua_tensor_free(la);
  dlua_tensor_free(x34);
  dlua_tensor_free(l1);
  dlua_tensor_free(l0);
  dlua_tensor_free(ln);
  dlua_tensor_free(base);
  dlua_tensor_free(xt);
  dlua_tensor_free(lb);
  dlua_tensor_free(lt);
  free(raw);
}
END_TEST

/* A reduced loss over many targets is the same for any thread count. */
START_TEST(test_cross_entropy_threads) {
  int64_t sz[2] = {3001, 37}, n = 3001 * 37, N = 3001;
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 3.0), *labd = malloc((size_t)N * 8);
  for (int64_t i = 0; i < N; i++) labd[i] = (double)((i * 13) % 37);
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F32, 2, sz, x), *lt = mk(DLUA_DTYPE_I64, 1, &N, labd);
  double r[2];
  int saved = omp_get_max_threads();
  for (int t = 0; t < 2; t++) {
    omp_set_num_threads(t ? 3 : 1);
    dlua_tensor_t *loss = NULL;
    ck_assert_int_eq(dlua_nn_cross_entropy(&loss, NULL, xt, lt, NULL, DLUA_LOSS_MEAN, 0.1, -100, 0), DLUA_OK);
    r[t] = scalar(loss);
    dlua_tensor_free(loss);
  }
  omp_set_num_threads(saved);
  ck_assert_msg(r[0] == r[1], "1 thread %.17g, 3 threads %.17g", r[0], r[1]);
  // Many blocks of targets, folded right.
  int64_t *lab0 = malloc((size_t)N * sizeof(int64_t));
  for (int64_t i = 0; i < N; i++) lab0[i] = (int64_t)labd[i];
  round_to(DLUA_DTYPE_F32, x, n);
  double want = ref_ce(x, lab0, N, 37, 1, NULL, 0.1, -1, DLUA_LOSS_MEAN, NULL);
  ck_assert_msg(fabs(r[0] - want) < 1e-6 * want, "mean over 3001 targets %.9g want %.9g", r[0], want);
  free(lab0);
  dlua_tensor_free(xt);
  dlua_tensor_free(lt);
  free(x);
  free(labd);
}
END_TEST

/* ---- MSE ------------------------------------------------------------------------------------------------ */

START_TEST(test_mse) {
  int64_t sz[2] = {7, 5}, n = 35, one = 5;
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 2.0), *t = tu_rand_vals(tu_lcg, &rng_state, n, 2.0), row[5];
  for (int j = 0; j < 5; j++) row[j] = tu_lcg(&rng_state);
  for (int i = 0; i < 7; i++)
    for (int j = 0; j < 5; j++) t[i * 5 + j] = row[j];  // the target is an expanded row below
  double sum = 0, none[35];
  for (int i = 0; i < n; i++) none[i] = (x[i] - t[i]) * (x[i] - t[i]), sum += none[i];
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F64, 2, sz, x), *rt = mk(DLUA_DTYPE_F64, 1, &one, row), *tt = NULL;
  ck_assert_int_eq(dlua_tensor_expand(&tt, rt, 2, sz), DLUA_OK);
  dlua_tensor_t *l = NULL;
  ck_assert_int_eq(dlua_nn_mse_loss(&l, xt, tt, DLUA_LOSS_MEAN), DLUA_OK);
  ck_assert_msg(fabs(scalar(l) - sum / 35) < 1e-14, "mse mean");
  dlua_tensor_free(l);
  l = NULL;
  ck_assert_int_eq(dlua_nn_mse_loss(&l, xt, tt, DLUA_LOSS_SUM), DLUA_OK);
  ck_assert_msg(fabs(scalar(l) - sum) < 1e-13, "mse sum");
  dlua_tensor_free(l);
  l = NULL;
  ck_assert_int_eq(dlua_nn_mse_loss(&l, xt, tt, DLUA_LOSS_NONE), DLUA_OK);
  double *got = tu_rd(l);
  expect_close(got, none, n, 1e-15, "mse none");
  free(got);
  dlua_tensor_free(l);
  // backward vs central differences, each reduction; upstream per element for none.
  double *gy = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), g0 = 0.625, num[35];
  dlua_tensor_t *gyt = mk(DLUA_DTYPE_F64, 2, sz, gy), *g0t = mk(DLUA_DTYPE_F64, 0, NULL, &g0);
  for (int red = 0; red < 3; red++) {
    for (int i = 0; i < n; i++) {
      // L is quadratic in x_i: the central difference is exact up to rounding.
      double h = 1e-3, lp = 0, lm = 0;
      for (int j = 0; j < n; j++) {
        double xp = x[j] + (j == i ? h : 0), xm = x[j] - (j == i ? h : 0);
        double wj = red == DLUA_LOSS_NONE ? gy[j] : g0 / (red == DLUA_LOSS_MEAN ? 35.0 : 1.0);
        lp += wj * (xp - t[j]) * (xp - t[j]);
        lm += wj * (xm - t[j]) * (xm - t[j]);
      }
      num[i] = (lp - lm) / (2 * h);
    }
    dlua_tensor_t *g = NULL;
    ck_assert_int_eq(dlua_nn_mse_loss_backward(&g, red == DLUA_LOSS_NONE ? gyt : g0t, xt, tt, (dlua_loss_reduction_t)red), DLUA_OK);
    got = tu_rd(g);
    expect_close(got, num, n, 1e-9, "mse backward");
    free(got);
    dlua_tensor_free(g);
  }
  // f32, and grad_output NULL means 1.
  dlua_tensor_t *x32 = NULL, *g = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&x32, xt, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert_int_eq(dlua_nn_mse_loss_backward(&g, NULL, x32, tt, DLUA_LOSS_SUM), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(g), DLUA_DTYPE_F64);  // promoted with the f64 target
  got = tu_rd(g);
  for (int i = 0; i < n; i++) ck_assert(fabs(got[i] - 2 * ((float)x[i] - t[i])) < 1e-6);
  free(got);
  dlua_tensor_free(g);
  // Empty: mean is NaN, sum 0.
  int64_t z = 0;
  dlua_tensor_t *e = mk(DLUA_DTYPE_F32, 1, &z, NULL), *le = NULL;
  ck_assert_int_eq(dlua_nn_mse_loss(&le, e, e, DLUA_LOSS_MEAN), DLUA_OK);
  ck_assert(isnan(scalar(le)));
  dlua_tensor_free(le);
  le = NULL;
  ck_assert_int_eq(dlua_nn_mse_loss(&le, e, e, DLUA_LOSS_SUM), DLUA_OK);
  ck_assert(scalar(le) == 0);
  dlua_tensor_free(le);
  le = NULL;
  tu_expect_error(dlua_nn_mse_loss(&le, xt, rt, DLUA_LOSS_SUM), "mse_loss: input (7, 5) float64 cpu and target (5) float64 cpu must have the same shape");
  ck_assert_ptr_null(le);
  dlua_tensor_free(e);
  dlua_tensor_free(x32);
  dlua_tensor_free(gyt);
  dlua_tensor_free(g0t);
  dlua_tensor_free(xt);
  dlua_tensor_free(rt);
  dlua_tensor_free(tt);
  free(x);
  free(t);
  free(gy);
}
END_TEST

/* Sums over several blocks: right, and the same for any thread count. */
START_TEST(test_mse_large) {
  const int64_t n = 50021;
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *t = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), want = 0, r[2];
  round_to(DLUA_DTYPE_F32, x, n);
  round_to(DLUA_DTYPE_F32, t, n);
  for (int64_t i = 0; i < n; i++) want += (x[i] - t[i]) * (x[i] - t[i]);
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F32, 1, &n, x), *tt = mk(DLUA_DTYPE_F32, 1, &n, t);
  int saved = omp_get_max_threads();
  for (int k = 0; k < 2; k++) {
    omp_set_num_threads(k ? 3 : 1);
    dlua_tensor_t *l = NULL;
    ck_assert_int_eq(dlua_nn_mse_loss(&l, xt, tt, DLUA_LOSS_SUM), DLUA_OK);
    r[k] = scalar(l);
    dlua_tensor_free(l);
  }
  omp_set_num_threads(saved);
  ck_assert_msg(fabs(r[0] - want) < 1e-6 * want, "mse sum %.9g want %.9g", r[0], want);
  ck_assert_msg(r[0] == r[1], "mse sum depends on threads");
  dlua_tensor_free(xt);
  dlua_tensor_free(tt);
  free(x);
  free(t);
}
END_TEST

/* ---- threshold / ReLU --------------------------------------------------------------------------------- */

START_TEST(test_threshold_relu) {
  int64_t n = 41;  // prime; long runs go past the parallel threshold below
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 3.0), *gy = tu_rand_vals(tu_lcg, &rng_state, n, 1.0);
  x[3] = 0;
  x[5] = NAN;
  x[7] = 0.5;  // exactly the threshold used below
  for (size_t di = 0; di < 4; di++) {
    dlua_dtype_t dt = FLOAT_DT[di];
    double xr[41], gr[41];
    memcpy(xr, x, sizeof xr);
    memcpy(gr, gy, sizeof gr);
    round_to(dt, xr, n);
    round_to(dt, gr, n);
    dlua_tensor_t *xt = mk(dt, 1, &n, xr), *gt = mk(dt, 1, &n, gr), *y = NULL, *gx = NULL, *gx2 = NULL;
    ck_assert_int_eq(dlua_nn_threshold(&y, xt, 0.5, -2), DLUA_OK);
    ck_assert_int_eq(dlua_nn_threshold_backward(&gx, gt, xt, 0.5), DLUA_OK);
    double *yv = tu_rd(y), *gv = tu_rd(gx);
    for (int i = 0; i < n; i++) {
      double wy = xr[i] <= 0.5 ? -2 : xr[i], wg = xr[i] <= 0.5 ? 0 : gr[i];
      ck_assert_msg(yv[i] == wy || (isnan(yv[i]) && isnan(wy)), "threshold %s at %d", dlua_dtype_name(dt), i);
      ck_assert_msg(gv[i] == wg, "threshold_backward %s at %d: %g want %g", dlua_dtype_name(dt), i, gv[i], wg);
    }
    ck_assert(isnan(yv[5]));   // NaN passes the forward
    ck_assert(gv[5] == gr[5]); // and its gradient, as torch's threshold_backward
    free(yv);
    free(gv);
    // ReLU backward from its output: zero where the output is 0.
    dlua_tensor_t *r = NULL;
    ck_assert_int_eq(dlua_nn_threshold(&r, xt, 0, 0), DLUA_OK);
    ck_assert_int_eq(dlua_nn_relu_backward(&gx2, gt, r), DLUA_OK);
    gv = tu_rd(gx2);
    for (int i = 0; i < n; i++) ck_assert(gv[i] == (xr[i] > 0 || isnan(xr[i]) ? gr[i] : 0));
    free(gv);
    // In place: the gradient buffer is overwritten.
    ck_assert_int_eq(dlua_nn_relu_backward(&gt, gt, r), DLUA_OK);
    gv = tu_rd(gt);
    for (int i = 0; i < n; i++) ck_assert(gv[i] == (xr[i] > 0 || isnan(xr[i]) ? gr[i] : 0));
    free(gv);
    dlua_tensor_free(r);
    dlua_tensor_free(xt);
    dlua_tensor_free(gt);
    dlua_tensor_free(y);
    dlua_tensor_free(gx);
    dlua_tensor_free(gx2);
  }
  // Non-contiguous grad (transposed) against a contiguous x of the transposed shape.
  int64_t s2[2] = {6, 7}, s2t[2] = {7, 6};
  double *a = tu_rand_vals(tu_lcg, &rng_state, 42, 1.0), *b = tu_rand_vals(tu_lcg, &rng_state, 42, 1.0);
  dlua_tensor_t *ga = mk(DLUA_DTYPE_F32, 2, s2, a), *gT = NULL, *xb = mk(DLUA_DTYPE_F32, 2, s2t, b), *o = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&gT, ga, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_nn_relu_backward(&o, gT, xb), DLUA_OK);
  double *ov = tu_rd(o);
  for (int i = 0; i < 7; i++)
    for (int j = 0; j < 6; j++)
      ck_assert(ov[i * 6 + j] == (b[i * 6 + j] > 0 ? (double)(float)a[j * 7 + i] : 0));
  free(ov);
  tu_expect_error(dlua_nn_relu_backward(&o, ga, xb), "relu_backward: grad_output (6, 7) float32 cpu and output (7, 6) float32 cpu must have the same shape");
  // Writing into an expanded view is refused.
  int64_t one = 1, s7[2] = {7, 6};
  dlua_tensor_t *sc = mk(DLUA_DTYPE_F32, 1, &one, a), *ex = NULL;
  ck_assert_int_eq(dlua_tensor_expand(&ex, sc, 2, s7), DLUA_OK);
  tu_expect_error(dlua_nn_relu_backward(&ex, gT, xb), "cannot write into (7, 6) float32 cpu");
  dlua_tensor_free(sc);
  dlua_tensor_free(ex);
  dlua_tensor_free(ga);
  dlua_tensor_free(gT);
  dlua_tensor_free(xb);
  dlua_tensor_free(o);
  free(a);
  free(b);
  free(x);
  free(gy);
}
END_TEST

/* ---- dropout ---------------------------------------------------------------------------------------------- */

START_TEST(test_dropout) {
  const int64_t n = 100003;  // several parallel chunks, odd tail
  double *x = tu_rand_vals(tu_lcg, &rng_state, n, 1.0);
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F32, 1, &n, x);
  const double p = 0.3;
  dlua_generator_t *g = NULL, *g2 = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 1234), DLUA_OK);
  ck_assert_int_eq(dlua_generator_new(&g2, 1234), DLUA_OK);
  dlua_generator_set_offset(g, 40);
  dlua_generator_set_offset(g2, 40);
  // The mask is bernoulli_(1 - p) from the same (seed, offset): reproduced independently.
  dlua_tensor_t *ref = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&ref, 1, &n, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_bernoulli_(ref, 1 - p, g2), DLUA_OK);
  double *rv = tu_rd(ref);
  dlua_tensor_t *y[2] = {NULL, NULL}, *m[2] = {NULL, NULL};
  int saved = omp_get_max_threads();
  for (int t = 0; t < 2; t++) {
    omp_set_num_threads(t ? 2 : 1);
    dlua_generator_set_offset(g, 40);
    ck_assert_int_eq(dlua_nn_dropout(&y[t], &m[t], xt, p, 1, g), DLUA_OK);
  }
  omp_set_num_threads(saved);
  ck_assert_uint_eq(dlua_generator_offset(g), dlua_generator_offset(g2));
  ck_assert_int_eq(dlua_tensor_dtype(m[0]), DLUA_DTYPE_BOOL);
  double *y0 = tu_rd(y[0]), *y1 = tu_rd(y[1]), *m0 = tu_rd(m[0]);
  int64_t kept = 0;
  float scale = (float)(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; i++) {
    ck_assert_msg(m0[i] == rv[i], "mask %lld differs from bernoulli_", (long long)i);
    ck_assert_msg(y0[i] == (m0[i] ? (double)((float)x[i] * scale) : 0.0), "dropout value %lld", (long long)i);
    ck_assert_msg(y0[i] == y1[i], "thread-count dependent at %lld", (long long)i);
    kept += m0[i] != 0;
  }
  // Binomial(n, 0.7): sd ~ 145; 6 sd.
  ck_assert_msg(llabs(kept - (int64_t)(0.7 * n)) < 900, "kept %lld of %lld", (long long)kept, (long long)n);
  // Backward: grad * mask / (1 - p), from a u8 mask too.
  double *gy = tu_rand_vals(tu_lcg, &rng_state, n, 1.0);
  dlua_tensor_t *gt = mk(DLUA_DTYPE_F64, 1, &n, gy), *gx = NULL, *m8 = NULL, *gx8 = NULL;
  ck_assert_int_eq(dlua_nn_dropout_backward(&gx, gt, m[0], p), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_to_dtype(&m8, m[0], DLUA_DTYPE_U8), DLUA_OK);
  ck_assert_int_eq(dlua_nn_dropout_backward(&gx8, gt, m8, p), DLUA_OK);
  double *gv = tu_rd(gx), *gv8 = tu_rd(gx8);
  for (int64_t i = 0; i < n; i++) {
    ck_assert(gv[i] == (m0[i] ? gy[i] * (1.0 / (1.0 - p)) : 0.0));
    ck_assert(gv8[i] == gv[i]);
  }
  free(gv);
  free(gv8);
  free(y0);
  free(y1);
  free(m0);
  // Evaluation: identity, no draw, mask untouched (may be NULL).
  uint64_t off = dlua_generator_offset(g);
  dlua_tensor_t *ye = NULL;
  ck_assert_int_eq(dlua_nn_dropout(&ye, NULL, xt, p, 0, g), DLUA_OK);
  double *yev = tu_rd(ye);
  for (int64_t i = 0; i < n; i++) ck_assert(yev[i] == (double)(float)x[i]);
  free(yev);
  // p = 0 keeps all, p = 1 drops all; neither draws.
  dlua_tensor_t *y0t = NULL, *m0t = NULL, *y1t = NULL, *m1t = NULL;
  ck_assert_int_eq(dlua_nn_dropout(&y0t, &m0t, xt, 0, 1, g), DLUA_OK);
  ck_assert_int_eq(dlua_nn_dropout(&y1t, &m1t, xt, 1, 1, g), DLUA_OK);
  ck_assert_uint_eq(dlua_generator_offset(g), off);
  double *a = tu_rd(y0t), *b = tu_rd(y1t), *ma = tu_rd(m0t), *mb = tu_rd(m1t);
  for (int64_t i = 0; i < n; i++) ck_assert(a[i] == (double)(float)x[i] && b[i] == 0 && ma[i] == 1 && mb[i] == 0);
  free(a);
  free(b);
  free(ma);
  free(mb);
  // Errors.
  dlua_tensor_t *bad = NULL;
  tu_expect_error(dlua_nn_dropout(&bad, NULL, xt, p, 1, g), "dropout: training needs a mask");
  tu_expect_error(dlua_nn_dropout(&bad, &bad, xt, 1.5, 1, g), "dropout: p must be in [0, 1], got 1.5");
  int64_t small = 3;
  dlua_tensor_t *ms = mk(DLUA_DTYPE_BOOL, 1, &small, rv);
  tu_expect_error(dlua_nn_dropout_backward(&bad, gt, ms, p), "dropout_backward: grad_output (100003) float64 cpu and mask (3) bool cpu");
  ck_assert_ptr_null(bad);
  dlua_tensor_free(ms);
  dlua_tensor_free(y0t);
  dlua_tensor_free(m0t);
  dlua_tensor_free(y1t);
  dlua_tensor_free(m1t);
  dlua_tensor_free(ye);
  dlua_tensor_free(gt);
  dlua_tensor_free(gx);
  dlua_tensor_free(m8);
  dlua_tensor_free(gx8);
  for (int t = 0; t < 2; t++) {
    dlua_tensor_free(y[t]);
    dlua_tensor_free(m[t]);
  }
  dlua_tensor_free(ref);
  dlua_tensor_free(xt);
  dlua_generator_free(g);
  dlua_generator_free(g2);
  free(rv);
  free(gy);
  free(x);
}
END_TEST

/* Dropout on a transposed f64 view writes its mask in row-major order of the view. */
START_TEST(test_dropout_views) {
  int64_t s[2] = {5, 8};
  double *x = tu_rand_vals(tu_lcg, &rng_state, 40, 1.0);
  dlua_tensor_t *base = mk(DLUA_DTYPE_F64, 2, s, x), *xt = NULL, *y = NULL, *m = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&xt, base, 0, 1), DLUA_OK);  // (8, 5)
  dlua_generator_t *g = NULL;
  ck_assert_int_eq(dlua_generator_new(&g, 99), DLUA_OK);
  ck_assert_int_eq(dlua_nn_dropout(&y, &m, xt, 0.5, 1, g), DLUA_OK);
  double *yv = tu_rd(y), *mv = tu_rd(m);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 5; j++) ck_assert(yv[i * 5 + j] == (mv[i * 5 + j] ? 2 * x[j * 8 + i] : 0));
  free(yv);
  free(mv);
  dlua_tensor_free(y);
  dlua_tensor_free(m);
  dlua_tensor_free(xt);
  dlua_tensor_free(base);
  dlua_generator_free(g);
  free(x);
}
END_TEST

/* The front doors reach their kernels through the backend table: the CPU's loss family is dlua_cpu_loss_ops with
   every slot filled, a kernel called through it gives the front door's bits, and an op on device 0 without a
   CUDA device gets the registry's one message. */
START_TEST(test_loss_table) {
  const struct dlua_loss_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("threshold", DLUA_CPU, loss, threshold, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_loss_ops);
  ck_assert(k->softmax && k->softmax_backward && k->threshold && k->threshold_backward && k->mask_scale && k->mse &&
            k->mse_backward && k->cross_entropy && k->cross_entropy_backward);
  int64_t s[1] = {6};
  double x[6] = {-2, -0.5, 0, 0.25, 1, 3}, y[6];
  dlua_tensor_t *xt = mk(DLUA_DTYPE_F64, 1, s, x), *yt = NULL;
  ck_assert_int_eq(dlua_nn_threshold(&yt, xt, 0.1, -7), DLUA_OK);
  dlua_loss_threshold_t d = {.ct = DLUA_DTYPE_F64, .x = x, .y = y, .n = 6, .th = 0.1, .value = -7, .device = DLUA_CPU};
  ck_assert_int_eq(k->threshold("threshold", &d), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_ptr(yt), y, sizeof y), 0);
  dlua_tensor_free(yt);
  yt = NULL;

  const struct dlua_loss_ops *kc = NULL;
  dlua_status_t st = DLUA_BACKEND("softmax", 0, loss, softmax, &kc);
  if (dlua_cuda_device_count() > 0) {
    ck_assert_int_eq(st, DLUA_OK);
    ck_assert(kc != &dlua_cpu_loss_ops && kc->softmax);
  } else {
    ck_assert_int_eq(st, DLUA_ERR_ARG);
    ck_assert_ptr_null(kc);
    // A front door asks the table of its tensor's device before it stages anything: a CPU tensor relabelled
    // as device 0 (never read) is enough to see the message.
    xt->device = 0;
    tu_expect_error(dlua_nn_softmax(&yt, xt, 0, 0), "softmax: no CUDA device available (");
    tu_expect_error(dlua_nn_relu_backward(&yt, xt, xt), "relu_backward: no CUDA device available (");
    xt->device = DLUA_CPU;
    ck_assert_ptr_null(yt);
  }
  dlua_tensor_free(xt);
}
END_TEST

int main(void) {
  Suite *s = suite_create("loss");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_softmax_forward);
  tcase_add_test(tc, test_softmax_views);
  tcase_add_test(tc, test_softmax_backward_fd);
  tcase_add_test(tc, test_cross_entropy_by_hand);
  tcase_add_test(tc, test_cross_entropy_reference);
  tcase_add_test(tc, test_cross_entropy_backward_fd);
  tcase_add_test(tc, test_cross_entropy_views_and_errors);
  tcase_add_test(tc, test_cross_entropy_threads);
  tcase_add_test(tc, test_mse);
  tcase_add_test(tc, test_mse_large);
  tcase_add_test(tc, test_threshold_relu);
  tcase_add_test(tc, test_dropout);
  tcase_add_test(tc, test_dropout_views);
  tcase_add_test(tc, test_loss_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

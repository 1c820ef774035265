/* Check suite for host/ops/optim.c and host/cpu/optim.c (the optim family of the backend table): SGD, Adam, AdamW, LARS and LAMB steps against double references written from torch.optim's (and the LAMB paper's) algorithms; AMP unscaling; clip_grad_norm_'s pieces; bad input. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/optim.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static uint64_t rng_state = 0xD1B54A32D192ED03ull;

/* A flat arena of n elements of dt holding v (rounded to dt; v is updated to the stored values). */
static dlua_tensor_t *arena(dlua_dtype_t dt, int64_t n, double *v) {
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&t, 1, &n, dt, DLUA_CPU), DLUA_OK);
  for (int64_t i = 0; i < n; i++) {
    if (dt == DLUA_DTYPE_F32) {
      ((float *)dlua_tensor_data(t))[i] = (float)v[i];
      v[i] = (float)v[i];
    } else {
      ((double *)dlua_tensor_data(t))[i] = v[i];
    }
  }
  return t;
}

static double at(const dlua_tensor_t *t, int64_t i) {
  return dlua_tensor_dtype(t) == DLUA_DTYPE_F32 ? ((const float *)dlua_tensor_data(t))[i]
                                                : ((const double *)dlua_tensor_data(t))[i];
}

/* Inside [lo, hi) the tensor matches want to tol (relative to 1 + |want|); outside, it still
   holds `orig` exactly. */
static void expect_arena(const dlua_tensor_t *t, const double *want, const double *orig, int64_t lo, int64_t hi,
                         double tol, const char *what) {
  int64_t n = dlua_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) {
    double got = at(t, i);
    if (i >= lo && i < hi)
      ck_assert_msg(fabs(got - want[i]) <= tol * (1 + fabs(want[i])), "%s: element %lld got %.17g want %.17g", what,
                    (long long)i, got, want[i]);
    else
      ck_assert_msg(got == orig[i], "%s: element %lld outside the range changed: %.17g, was %.17g", what,
                    (long long)i, got, orig[i]);
  }
}

/* ---- SGD ---------------------------------------------------------------------------------------- */

typedef struct {
  double lr, momentum, dampening, wd, grad_scale;
  int nesterov, maximize;
} sgd_cfg_t;

/* torch.optim.SGD, from its documented algorithm. The documentation applies `maximize` as the
   sign of the final update; torch's code (and dlua) negate the gradient first, which differs
   only with weight decay, so the reference follows the code. */
static void ref_sgd(double *p, const double *grad, double *buf, int64_t lo, int64_t hi, const sgd_cfg_t *c, int t) {
  for (int64_t i = lo; i < hi; i++) {
    double g = grad[i] * c->grad_scale;
    if (c->maximize) g = -g;
    if (c->wd != 0) g += c->wd * p[i];
    if (c->momentum != 0) {
      buf[i] = t > 1 ? c->momentum * buf[i] + (1 - c->dampening) * g : g;
      g = c->nesterov ? g + c->momentum * buf[i] : buf[i];
    }
    p[i] -= c->lr * g;
  }
}

START_TEST(test_sgd_reference) {
  const sgd_cfg_t cfgs[] = {
      {0.1, 0, 0, 0, 1, 0, 0},          {0.05, 0.9, 0.1, 1e-2, 1, 0, 0}, {0.1, 0.9, 0, 5e-4, 1, 1, 0},
      {0.02, 0.5, 0.25, 0.1, 1, 0, 1},  {0.1, 0.8, 0, 0, 1.0 / 128, 1, 0}, {0.3, 0.9, 0, 0.05, 0.5, 1, 1},
  };
  const int64_t n = 37, lo = 5, len = 23;
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++)
    for (int v = 0; v < 2; v++) {
      dlua_dtype_t dt = v ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
      double *p0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *b0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *g0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0);
      dlua_tensor_t *p = arena(dt, n, p0), *b = arena(dt, n, b0), *g = arena(dt, n, g0);
      double pr[37], br[37];
      memcpy(pr, p0, sizeof pr);
      memcpy(br, b0, sizeof br);  // garbage before the first step: first_step must ignore it
      for (int t = 1; t <= 3; t++) {
        double gv[37];
        for (int64_t i = 0; i < n; i++) gv[i] = (t == 1 ? g0[i] : tu_lcg(&rng_state));
        dlua_tensor_free(g);
        g = arena(dt, n, gv);
        ref_sgd(pr, gv, br, lo, lo + len, &cfgs[c], t);
        ck_assert_int_eq(dlua_optim_sgd_step(p, g, cfgs[c].momentum != 0 ? b : NULL, lo, len, cfgs[c].lr,
                                             cfgs[c].momentum, cfgs[c].dampening, cfgs[c].wd, cfgs[c].nesterov,
                                             cfgs[c].maximize, t == 1, cfgs[c].grad_scale),
                         DLUA_OK);
        char what[64];
        snprintf(what, sizeof what, "sgd cfg %zu %s step %d", c, dlua_dtype_name(dt), t);
        double tol = v ? 2e-6 : 1e-14;
        expect_arena(p, pr, p0, lo, lo + len, tol, what);
        expect_arena(b, cfgs[c].momentum != 0 ? br : b0, b0, lo, lo + len, tol, what);
        for (int64_t i = 0; i < n; i++) ck_assert(at(g, i) == gv[i]);  // the gradient is left as it was
      }
      dlua_tensor_free(p);
      dlua_tensor_free(b);
      dlua_tensor_free(g);
      free(p0);
      free(b0);
      free(g0);
    }
}
END_TEST

/* ---- AdamW ---------------------------------------------------------------------------------------- */

typedef struct {
  double lr, beta1, beta2, eps, wd, grad_scale;
  int amsgrad, maximize;
} adamw_cfg_t;

/* torch.optim.AdamW's algorithm. With amsgrad the documentation takes the running max of the
   bias-corrected v; torch's code (and dlua) keep the max of the raw v and divide by the
   correction afterwards, so the reference follows the code. */
static void ref_adam_any(double *p, const double *grad, double *m, double *v, double *vmax, int64_t lo, int64_t hi,
                         const adamw_cfg_t *c, int64_t t, int decoupled) {
  double bc1 = 1 - pow(c->beta1, (double)t), bc2 = 1 - pow(c->beta2, (double)t);
  for (int64_t i = lo; i < hi; i++) {
    double g = grad[i] * c->grad_scale;
    if (c->maximize) g = -g;
    if (decoupled)
      p[i] *= 1 - c->lr * c->wd;
    else
      g += c->wd * p[i];  // torch.optim.Adam: L2, after maximize's negation
    m[i] = c->beta1 * m[i] + (1 - c->beta1) * g;
    v[i] = c->beta2 * v[i] + (1 - c->beta2) * g * g;
    double vv = v[i];
    if (c->amsgrad) vv = vmax[i] = fmax(vmax[i], v[i]);
    double mhat = m[i] / bc1, vhat = vv / bc2;
    p[i] -= c->lr * mhat / (sqrt(vhat) + c->eps);
  }
}

static void ref_adamw(double *p, const double *grad, double *m, double *v, double *vmax, int64_t lo, int64_t hi,
                      const adamw_cfg_t *c, int64_t t) {
  ref_adam_any(p, grad, m, v, vmax, lo, hi, c, t, 1);
}

static void adam_reference(int decoupled) {
  const adamw_cfg_t cfgs[] = {
      {1e-2, 0.9, 0.999, 1e-8, 1e-2, 1, 0, 0},
      {1e-2, 0.9, 0.999, 1e-8, 0.1, 1, 1, 0},
      {5e-3, 0.8, 0.99, 1e-6, 0, 0.25, 0, 1},
      {1e-1, 0.5, 0.9, 1e-3, 0.05, 1, 1, 1},
  };
  const int64_t n = 37, lo = 11, len = 19;
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++)
    for (int v = 0; v < 2; v++)
      for (int64_t t0 = 1; t0 <= 7; t0 += 6) {  // first step 1, and a resumed run at step 7
        dlua_dtype_t dt = v ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
        double *p0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *m0 = tu_rand_vals(tu_lcg, &rng_state, n, 0.1), *s0 = tu_rand_vals(tu_lcg, &rng_state, n, 0.1), *x0 = tu_rand_vals(tu_lcg, &rng_state, n, 0.1);
        for (int64_t i = 0; i < n; i++) s0[i] = fabs(s0[i]) * 0.1, x0[i] = s0[i] * 1.5;  // v >= 0; vmax > v
        if (t0 == 1)
          for (int64_t i = 0; i < n; i++) m0[i] = s0[i] = x0[i] = 0;  // fresh state, as torch starts
        dlua_tensor_t *p = arena(dt, n, p0), *m = arena(dt, n, m0), *s = arena(dt, n, s0), *x = arena(dt, n, x0);
        double pr[37], mr[37], sr[37], xr[37];
        memcpy(pr, p0, sizeof pr);
        memcpy(mr, m0, sizeof mr);
        memcpy(sr, s0, sizeof sr);
        memcpy(xr, x0, sizeof xr);
        for (int64_t t = t0; t < t0 + 3; t++) {
          // Shrinking gradients make v fall, so the amsgrad max matters.
          double gv[37], shrink = pow(0.1, (double)(t - t0));
          for (int64_t i = 0; i < n; i++) gv[i] = tu_lcg(&rng_state) * shrink;
          dlua_tensor_t *g = arena(dt, n, gv);
          ref_adam_any(pr, gv, mr, sr, xr, lo, lo + len, &cfgs[c], t, decoupled);
          dlua_status_t (*stepf)(dlua_tensor_t *, const dlua_tensor_t *, dlua_tensor_t *, dlua_tensor_t *,
                                 dlua_tensor_t *, int64_t, int64_t, double, double, double, double, double, int64_t,
                                 int, int, double) = decoupled ? dlua_optim_adamw_step : dlua_optim_adam_step;
          ck_assert_int_eq(stepf(p, g, m, s, cfgs[c].amsgrad ? x : NULL, lo, len, cfgs[c].lr, cfgs[c].beta1,
                                 cfgs[c].beta2, cfgs[c].eps, cfgs[c].wd, t, cfgs[c].amsgrad, cfgs[c].maximize,
                                 cfgs[c].grad_scale),
                           DLUA_OK);
          char what[80];
          snprintf(what, sizeof what, "%s cfg %zu %s step %lld", decoupled ? "adamw" : "adam", c, dlua_dtype_name(dt),
                   (long long)t);
          double tol = v ? 1e-5 : 1e-13;
          expect_arena(p, pr, p0, lo, lo + len, tol, what);
          expect_arena(m, mr, m0, lo, lo + len, tol, what);
          expect_arena(s, sr, s0, lo, lo + len, tol, what);
          expect_arena(x, cfgs[c].amsgrad ? xr : x0, x0, lo, lo + len, tol, what);
          dlua_tensor_free(g);
        }
        dlua_tensor_free(p);
        dlua_tensor_free(m);
        dlua_tensor_free(s);
        dlua_tensor_free(x);
        free(p0);
        free(m0);
        free(s0);
        free(x0);
      }
}

START_TEST(test_adamw_reference) { adam_reference(1); }
END_TEST

/* torch.optim.Adam: the same configurations (decay, amsgrad, maximize with decay, grad scale), with
   the decay as L2 in the gradient, so the moments carry it. */
START_TEST(test_adam_reference) { adam_reference(0); }
END_TEST

/* Adam's decay reaches the moments; AdamW's does not. With a zero gradient one step tells them apart:
   AdamW only shrinks p by lr * wd * p; Adam's gradient is wd * p, so (bias correction at work) p moves
   by about lr against its sign. */
START_TEST(test_adam_vs_adamw_decay) {
  double p0[2] = {2, -3}, z[2] = {0};
  for (int decoupled = 0; decoupled < 2; decoupled++) {
    dlua_tensor_t *p = arena(DLUA_DTYPE_F64, 2, p0), *g = arena(DLUA_DTYPE_F64, 2, z), *m = arena(DLUA_DTYPE_F64, 2, z),
                  *v = arena(DLUA_DTYPE_F64, 2, z);
    ck_assert_int_eq((decoupled ? dlua_optim_adamw_step : dlua_optim_adam_step)(p, g, m, v, NULL, 0, 2, 0.01, 0.9, 0.999,
                                                                                1e-12, 0.1, 1, 0, 0, 1),
                     DLUA_OK);
    for (int i = 0; i < 2; i++) {
      double want = decoupled ? p0[i] * (1 - 0.01 * 0.1) : p0[i] - 0.01 * (p0[i] > 0 ? 1 : -1);
      ck_assert_msg(fabs(at(p, i) - want) < 1e-10, "%s: element %d got %.17g want %.17g", decoupled ? "adamw" : "adam",
                    i, at(p, i), want);
      double want_m = decoupled ? 0 : (1 - 0.9) * 0.1 * p0[i];  // (1 - beta1) * wd * p
      ck_assert_msg(fabs(at(m, i) - want_m) < 1e-15, "exp_avg %d: %.17g want %.17g", i, at(m, i), want_m);
    }
    dlua_tensor_free(p);
    dlua_tensor_free(g);
    dlua_tensor_free(m);
    dlua_tensor_free(v);
  }
}
END_TEST

/* The first AdamW step moves every weight by about lr * sign(g) (bias correction at work):
   m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps). */
START_TEST(test_adamw_first_step_magnitude) {
  const int64_t n = 8;
  double p0[8] = {0}, gv[8] = {3, -2, 1e-3, -1e-3, 100, -100, 0.5, 7}, z[8] = {0};
  dlua_tensor_t *p = arena(DLUA_DTYPE_F64, n, p0), *g = arena(DLUA_DTYPE_F64, n, gv), *m = arena(DLUA_DTYPE_F64, n, z),
                *s = arena(DLUA_DTYPE_F64, n, z);
  ck_assert_int_eq(dlua_optim_adamw_step(p, g, m, s, NULL, 0, n, 0.01, 0.9, 0.999, 1e-12, 0, 1, 0, 0, 1), DLUA_OK);
  for (int i = 0; i < n; i++) ck_assert_msg(fabs(at(p, i) + 0.01 * (gv[i] > 0 ? 1 : -1)) < 1e-10, "element %d: %g", i, at(p, i));
  dlua_tensor_free(p);
  dlua_tensor_free(g);
  dlua_tensor_free(m);
  dlua_tensor_free(s);
}
END_TEST

/* ---- LARS ------------------------------------------------------------------------------------------- */

/* NVIDIA apex's LARC around SGD (momentum, no dampening), per parameter range. */
static void ref_lars(double *p, const double *grad, double *buf, int nr, const int64_t *off, const int64_t *len,
                     const int32_t *excl, double lr, double mom, double wd, double eta, double eps, int first,
                     double gs) {
  for (int r = 0; r < nr; r++) {
    double pn = 0, gn = 0;
    for (int64_t i = off[r]; i < off[r] + len[r]; i++) pn += p[i] * p[i], gn += grad[i] * gs * grad[i] * gs;
    pn = sqrt(pn), gn = sqrt(gn);
    int adapt = !(excl && excl[r]) && pn != 0 && gn != 0;
    double trust = adapt ? eta * pn / (gn + wd * pn + eps) : 1;
    for (int64_t i = off[r]; i < off[r] + len[r]; i++) {
      double d = grad[i] * gs;
      if (adapt) d = (d + wd * p[i]) * trust;
      buf[i] = first ? d : mom * buf[i] + d;
      p[i] -= lr * buf[i];
    }
  }
}

START_TEST(test_lars_reference) {
  const int64_t n = 61;
  // Out of order on purpose; [25, 30), [45, 50) and [60, 61) belong to no parameter.
  const int64_t off[5] = {30, 0, 20, 50, 45}, len[5] = {15, 20, 5, 10, 0};
  const int32_t excl[5] = {0, 0, 1, 0, 0};  // [20, 25) is a bias
  for (int v = 0; v < 2; v++)
    for (int use_excl = 0; use_excl < 2; use_excl++) {
      dlua_dtype_t dt = v ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
      double *p0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *b0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0);
      dlua_tensor_t *p = arena(dt, n, p0), *b = arena(dt, n, b0);
      double pr[61], br[61];
      memcpy(pr, p0, sizeof pr);
      memcpy(br, b0, sizeof br);
      for (int t = 1; t <= 3; t++) {
        double gv[61];
        for (int64_t i = 0; i < n; i++) gv[i] = tu_lcg(&rng_state) * (i >= 50 && i < 60 ? 0 : 1);  // [50, 60): zero gradient
        dlua_tensor_t *g = arena(dt, n, gv);
        ref_lars(pr, gv, br, 5, off, len, use_excl ? excl : NULL, 0.5, 0.9, 0.01, 0.02, 1e-9, t == 1, 0.5);
        ck_assert_int_eq(dlua_optim_lars_step(p, g, b, 5, off, len, use_excl ? excl : NULL, 0.5, 0.9, 0.01, 0.02,
                                              1e-9, t == 1, 0.5),
                         DLUA_OK);
        double tol = v ? 1e-5 : 1e-13;
        char what[64];
        snprintf(what, sizeof what, "lars %s exclude %d step %d", dlua_dtype_name(dt), use_excl, t);
        for (int64_t i = 0; i < n; i++) {
          int covered = i < 25 || (i >= 30 && i < 45) || (i >= 50 && i < 60);
          double gp = at(p, i), gb = at(b, i);
          if (covered) {
            ck_assert_msg(fabs(gp - pr[i]) <= tol * (1 + fabs(pr[i])), "%s: param %lld got %.17g want %.17g", what,
                          (long long)i, gp, pr[i]);
            ck_assert_msg(fabs(gb - br[i]) <= tol * (1 + fabs(br[i])), "%s: buf %lld", what, (long long)i);
          } else {
            ck_assert_msg(gp == p0[i] && gb == b0[i], "%s: element %lld of no parameter changed", what, (long long)i);
          }
        }
        dlua_tensor_free(g);
      }
      dlua_tensor_free(p);
      dlua_tensor_free(b);
      free(p0);
      free(b0);
    }
}
END_TEST

/* The trust ratio scales an adapted parameter's step: with momentum 0, one step moves a
   parameter by exactly lr * eta * |p| / (|g| + wd |p| + eps) * (g + wd p). */
START_TEST(test_lars_trust_ratio) {
  double p0[4] = {3, 4, 1, 1}, gv[4] = {0.6, 0.8, 1, 1};  // |p| = 5, |g| = 1 on the first range
  int64_t off[2] = {0, 2}, len[2] = {2, 2};
  int32_t excl[2] = {0, 1};
  dlua_tensor_t *p = arena(DLUA_DTYPE_F64, 4, p0), *g = arena(DLUA_DTYPE_F64, 4, gv);
  ck_assert_int_eq(dlua_optim_lars_step(p, g, NULL, 2, off, len, excl, 1.0, 0, 0.1, 0.01, 0, 1, 1), DLUA_OK);
  double trust = 0.01 * 5 / (1 + 0.1 * 5);  // 1/30
  ck_assert(fabs(at(p, 0) - (3 - trust * (0.6 + 0.3))) < 1e-15);
  ck_assert(fabs(at(p, 1) - (4 - trust * (0.8 + 0.4))) < 1e-15);
  ck_assert(at(p, 2) == 0 && at(p, 3) == 0);  // excluded: p - lr * g, no decay
  dlua_tensor_free(p);
  dlua_tensor_free(g);
}
END_TEST

/* ---- LAMB ------------------------------------------------------------------------------------------------ */

/* You et al. 2019, Algorithm 2 with the variant dlua.h documents: per parameter range, Adam's moments
   and (optionally bias-corrected) direction plus wd * p, scaled by |p| / |u| (1 when a norm is 0);
   excluded ranges: no decay, ratio 1. */
static void ref_lamb(double *p, const double *grad, double *m, double *v, int nr, const int64_t *off,
                     const int64_t *len, const int32_t *excl, double lr, double b1, double b2, double eps, double wd,
                     int64_t t, int bias_correction, double gs) {
  double bc1 = bias_correction ? 1 - pow(b1, (double)t) : 1, bc2 = bias_correction ? 1 - pow(b2, (double)t) : 1;
  for (int r = 0; r < nr; r++) {
    int ex = excl && excl[r];
    double w = ex ? 0 : wd, pn = 0, un = 0;
    double *u = malloc((size_t)(len[r] > 0 ? len[r] : 1) * sizeof(double));
    for (int64_t i = off[r]; i < off[r] + len[r]; i++) {
      double g = grad[i] * gs;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      double ui = (m[i] / bc1) / (sqrt(v[i] / bc2) + eps) + w * p[i];
      u[i - off[r]] = ui;
      pn += p[i] * p[i];
      un += ui * ui;
    }
    pn = sqrt(pn), un = sqrt(un);
    double trust = !ex && pn > 0 && un > 0 ? pn / un : 1;
    for (int64_t i = off[r]; i < off[r] + len[r]; i++) p[i] -= lr * trust * u[i - off[r]];
    free(u);
  }
}

START_TEST(test_lamb_reference) {
  const int64_t n = 61;
  // As the LARS test: out of order, gaps, an empty range; [50, 60) has a zero gradient and
  // [0, 20) starts at p = 0 (|p| = 0: ratio 1).
  const int64_t off[5] = {30, 0, 20, 50, 45}, len[5] = {15, 20, 5, 10, 0};
  const int32_t excl[5] = {0, 0, 1, 0, 0};
  for (int v = 0; v < 2; v++)
    for (int cfg = 0; cfg < 3; cfg++) {
      dlua_dtype_t dt = v ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
      const int use_excl = cfg != 1, bias_correction = cfg != 2;
      const double wd = cfg == 1 ? 0 : 0.05, gs = cfg == 2 ? 0.25 : 1;
      double *p0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *z = calloc((size_t)n, sizeof(double));
      for (int64_t i = 0; i < 20; i++) p0[i] = 0;
      dlua_tensor_t *p = arena(dt, n, p0), *m = arena(dt, n, z), *s2 = arena(dt, n, z);
      double pr[61], mr[61], vr[61];
      memcpy(pr, p0, sizeof pr);
      memset(mr, 0, sizeof mr);
      memset(vr, 0, sizeof vr);
      for (int64_t t = 1; t <= 4; t++) {
        double gv[61];
        for (int64_t i = 0; i < n; i++) gv[i] = tu_lcg(&rng_state) * (i >= 50 && i < 60 ? 0 : 1);
        dlua_tensor_t *g = arena(dt, n, gv);
        ref_lamb(pr, gv, mr, vr, 5, off, len, use_excl ? excl : NULL, 0.02, 0.9, 0.99, 1e-6, wd, t, bias_correction, gs);
        ck_assert_int_eq(dlua_optim_lamb_step(p, g, m, s2, 5, off, len, use_excl ? excl : NULL, 0.02, 0.9, 0.99, 1e-6,
                                              wd, t, bias_correction, gs),
                         DLUA_OK);
        double tol = v ? 1e-5 : 1e-13;
        char what[80];
        snprintf(what, sizeof what, "lamb %s cfg %d step %lld", dlua_dtype_name(dt), cfg, (long long)t);
        for (int64_t i = 0; i < n; i++) {
          int covered = i < 25 || (i >= 30 && i < 45) || (i >= 50 && i < 60);
          double gp = at(p, i), gm = at(m, i), gv2 = at(s2, i);
          if (covered) {
            ck_assert_msg(fabs(gp - pr[i]) <= tol * (1 + fabs(pr[i])), "%s: param %lld got %.17g want %.17g", what,
                          (long long)i, gp, pr[i]);
            ck_assert_msg(fabs(gm - mr[i]) <= tol * (1 + fabs(mr[i])) && fabs(gv2 - vr[i]) <= tol * (1 + fabs(vr[i])),
                          "%s: moments %lld", what, (long long)i);
          } else {
            ck_assert_msg(gp == p0[i] && gm == 0 && gv2 == 0, "%s: element %lld of no parameter changed", what,
                          (long long)i);
          }
        }
        dlua_tensor_free(g);
      }
      dlua_tensor_free(p);
      dlua_tensor_free(m);
      dlua_tensor_free(s2);
      free(p0);
      free(z);
    }
}
END_TEST

/* The ratio by hand: first step with bias correction, eps 0, so m_hat / sqrt(v_hat) = sign(g).
   p = (3, 4), g = (0.6, -0.8), wd 0.1: u = (1 + 0.3, -1 + 0.4), |p| = 5, so p -= lr * 5 / |u| * u.
   The second range is excluded: u = sign(g), no decay, ratio 1. */
START_TEST(test_lamb_trust_ratio) {
  double p0[4] = {3, 4, 1, 1}, gv[4] = {0.6, -0.8, 2, -2}, z[4] = {0};
  int64_t off[2] = {0, 2}, len[2] = {2, 2};
  int32_t excl[2] = {0, 1};
  dlua_tensor_t *p = arena(DLUA_DTYPE_F64, 4, p0), *g = arena(DLUA_DTYPE_F64, 4, gv), *m = arena(DLUA_DTYPE_F64, 4, z),
                *v = arena(DLUA_DTYPE_F64, 4, z);
  ck_assert_int_eq(dlua_optim_lamb_step(p, g, m, v, 2, off, len, excl, 0.5, 0.9, 0.999, 0, 0.1, 1, 1, 1), DLUA_OK);
  double u0 = 1.3, u1 = -0.6, trust = 5 / sqrt(u0 * u0 + u1 * u1);
  ck_assert_msg(fabs(at(p, 0) - (3 - 0.5 * trust * u0)) < 1e-14, "p0 %.17g", at(p, 0));
  ck_assert_msg(fabs(at(p, 1) - (4 - 0.5 * trust * u1)) < 1e-14, "p1 %.17g", at(p, 1));
  ck_assert_msg(fabs(at(p, 2) - 0.5) < 1e-14 && fabs(at(p, 3) - 1.5) < 1e-14, "excluded: %.17g %.17g", at(p, 2),
                at(p, 3));
  dlua_tensor_free(p);
  dlua_tensor_free(g);
  dlua_tensor_free(m);
  dlua_tensor_free(v);
}
END_TEST

/* ---- clip_grad_norm_'s pieces -------------------------------------------------------------------------------- */

START_TEST(test_grad_norm_partial) {
  const int64_t n = 20011, lo = 3, len = 20000;  // several blocks; elements outside the range are huge
  double *g0 = tu_rand_vals(tu_lcg, &rng_state, n, 2.0);
  g0[0] = g0[1] = g0[2] = 1e30;
  for (int d = 0; d < 4; d++) {
    dlua_dtype_t dt = d == 0 ? DLUA_DTYPE_F64 : d == 1 ? DLUA_DTYPE_F32 : d == 2 ? DLUA_DTYPE_BF16 : DLUA_DTYPE_F16;
    double *gv = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) gv[i] = tu_as_dtype(dt, g0[i]);
    dlua_tensor_t *t = NULL, *src = NULL;
    ck_assert_int_eq(dlua_tensor_from_data(&src, 1, &n, DLUA_DTYPE_F64, gv), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_to_dtype(&t, src, dt), DLUA_OK);
    const double ps[4] = {2, 1, 3.5, INFINITY};
    for (int k = 0; k < 4; k++) {
      double want = 0;
      for (int64_t i = lo; i < lo + len; i++)
        want = isinf(ps[k]) ? fmax(want, fabs(gv[i])) : want + pow(fabs(gv[i]), ps[k]);
      double got = -1;
      ck_assert_int_eq(dlua_optim_grad_norm_partial(t, lo, len, ps[k], &got), DLUA_OK);
      ck_assert_msg(fabs(got - want) <= 1e-12 * want, "%s p %g: got %.17g want %.17g", dlua_dtype_name(dt), ps[k], got,
                    want);
    }
    double zero = -1;
    ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 5, 0, 2, &zero), DLUA_OK);
    ck_assert(zero == 0);
    // the scale: inside the range only, as x * (T)s
    ck_assert_int_eq(dlua_optim_grad_scale(t, lo, len, 0.375), DLUA_OK);
    dlua_tensor_t *back = NULL;
    ck_assert_int_eq(dlua_tensor_to_dtype(&back, t, DLUA_DTYPE_F64), DLUA_OK);
    const double *b = dlua_tensor_data(back);
    for (int64_t i = 0; i < n; i++) {
      double w = i >= lo && i < lo + len ? tu_as_dtype(dt, gv[i] * 0.375) : gv[i];
      ck_assert_msg(b[i] == w, "%s grad_scale element %lld: %.17g want %.17g", dlua_dtype_name(dt), (long long)i, b[i], w);
    }
    dlua_tensor_free(back);
    dlua_tensor_free(t);
    dlua_tensor_free(src);
    free(gv);
  }
  // Non-finite gradients: Inf gives Inf, NaN wins over everything (sum and max alike).
  double sp[5] = {1, -INFINITY, 2, 3, NAN};
  dlua_tensor_t *t = arena(DLUA_DTYPE_F64, 5, sp);
  double out = 0;
  ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 0, 4, 2, &out), DLUA_OK);
  ck_assert(isinf(out));
  ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 0, 4, INFINITY, &out), DLUA_OK);
  ck_assert(isinf(out));
  ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 0, 5, 2, &out), DLUA_OK);
  ck_assert(isnan(out));
  ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 0, 5, INFINITY, &out), DLUA_OK);
  ck_assert(isnan(out));
  ck_assert_int_eq(dlua_optim_grad_norm_partial(t, 2, 2, INFINITY, &out), DLUA_OK);
  ck_assert(out == 3);
  dlua_tensor_free(t);
  free(g0);
}
END_TEST

/* ---- thread-count independence over large arenas ---------------------------------------------------- */

START_TEST(test_threads) {
  const int64_t n = 300007;
  double *p0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *g0 = tu_rand_vals(tu_lcg, &rng_state, n, 1.0), *z = calloc((size_t)n, sizeof(double));
  int64_t off[3] = {0, 100000, 100100}, len[3] = {100000, 100, 199907};
  float *res[2][5];
  int saved = omp_get_max_threads();
  for (int t = 0; t < 2; t++) {
    omp_set_num_threads(t ? 3 : 1);
    dlua_tensor_t *g = arena(DLUA_DTYPE_F32, n, g0);
    for (int k = 0; k < 5; k++) {
      dlua_tensor_t *p = arena(DLUA_DTYPE_F32, n, p0), *b = arena(DLUA_DTYPE_F32, n, z), *s = arena(DLUA_DTYPE_F32, n, z);
      for (int step = 1; step <= 2; step++) {
        if (k == 0) ck_assert_int_eq(dlua_optim_sgd_step(p, g, b, 3, n - 3, 0.1, 0.9, 0, 1e-4, 1, 0, step == 1, 1), DLUA_OK);
        if (k == 1) ck_assert_int_eq(dlua_optim_adamw_step(p, g, b, s, NULL, 0, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, 0, 0, 1), DLUA_OK);
        if (k == 2) ck_assert_int_eq(dlua_optim_lars_step(p, g, b, 3, off, len, NULL, 0.1, 0.9, 1e-4, 0.001, 0, step == 1, 1), DLUA_OK);
        if (k == 3) ck_assert_int_eq(dlua_optim_adam_step(p, g, b, s, NULL, 0, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, 0, 0, 1), DLUA_OK);
        if (k == 4) ck_assert_int_eq(dlua_optim_lamb_step(p, g, b, s, 3, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0.01, step, 1, 1), DLUA_OK);
      }
      res[t][k] = malloc((size_t)n * sizeof(float));
      memcpy(res[t][k], dlua_tensor_data(p), (size_t)n * sizeof(float));
      dlua_tensor_free(p);
      dlua_tensor_free(b);
      dlua_tensor_free(s);
    }
    dlua_tensor_free(g);
  }
  omp_set_num_threads(saved);
  // And the many-chunk results are right: references in double on the same (rounded) inputs.
  double *pr[5], *b = calloc((size_t)n, sizeof(double)), *m = calloc((size_t)n, sizeof(double)),
                 *v = calloc((size_t)n, sizeof(double));
  const sgd_cfg_t sc = {0.1, 0.9, 0, 1e-4, 1, 1, 0};
  const adamw_cfg_t ac = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0, 0};
  for (int k = 0; k < 5; k++) {
    pr[k] = malloc((size_t)n * sizeof(double));
    memcpy(pr[k], p0, (size_t)n * sizeof(double));
    memset(b, 0, (size_t)n * sizeof(double));
    memset(m, 0, (size_t)n * sizeof(double));
    memset(v, 0, (size_t)n * sizeof(double));
    for (int step = 1; step <= 2; step++) {
      if (k == 0) ref_sgd(pr[k], g0, b, 3, n, &sc, step);
      if (k == 1) ref_adamw(pr[k], g0, b, m, v, 0, n, &ac, step);
      if (k == 2) ref_lars(pr[k], g0, b, 3, off, len, NULL, 0.1, 0.9, 1e-4, 0.001, 0, step == 1, 1);
      if (k == 3) ref_adam_any(pr[k], g0, b, m, v, 0, n, &ac, step, 0);
      if (k == 4) ref_lamb(pr[k], g0, b, m, 3, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0.01, step, 1, 1);
    }
    for (int64_t i = 0; i < n; i++)
      ck_assert_msg(fabs(res[0][k][i] - pr[k][i]) <= 1e-5 * (1 + fabs(pr[k][i])), "optimizer %d element %lld: %.9g want %.9g",
                    k, (long long)i, res[0][k][i], pr[k][i]);
    free(pr[k]);
  }
  free(b);
  free(m);
  free(v);
  for (int k = 0; k < 5; k++) {
    ck_assert_msg(memcmp(res[0][k], res[1][k], (size_t)n * sizeof(float)) == 0, "optimizer %d depends on threads", k);
    free(res[0][k]);
    free(res[1][k]);
  }
  // clip_grad_norm_'s partial sums: the same bits on 1 and 3 threads
  double norms[2][2];
  dlua_tensor_t *gn = arena(DLUA_DTYPE_F32, n, g0);
  for (int t = 0; t < 2; t++) {
    omp_set_num_threads(t ? 3 : 1);
    ck_assert_int_eq(dlua_optim_grad_norm_partial(gn, 1, n - 1, 2, &norms[t][0]), DLUA_OK);
    ck_assert_int_eq(dlua_optim_grad_norm_partial(gn, 1, n - 1, 1.5, &norms[t][1]), DLUA_OK);
  }
  omp_set_num_threads(saved);
  ck_assert(memcmp(norms[0], norms[1], sizeof norms[0]) == 0);
  dlua_tensor_free(gn);
  free(p0);
  free(g0);
  free(z);
}
END_TEST

/* ---- unscale -------------------------------------------------------------------------------------------- */

START_TEST(test_unscale) {
  const int64_t n = 50, lo = 7, len = 31;
  double *g0 = tu_rand_vals(tu_lcg, &rng_state, n, 100.0);
  g0[3] = INFINITY;   // outside: not counted, untouched
  g0[10] = INFINITY;  // inside
  g0[20] = -INFINITY;
  g0[30] = NAN;
  for (int v = 0; v < 2; v++) {
    dlua_dtype_t dt = v ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
    double gv[50], want[50];
    memcpy(gv, g0, sizeof gv);
    dlua_tensor_t *g = arena(dt, n, gv);
    for (int64_t i = 0; i < n; i++) want[i] = gv[i] / 1024;
    int64_t bad = -1;
    ck_assert_int_eq(dlua_optim_unscale(g, lo, len, 1.0 / 1024, &bad), DLUA_OK);
    ck_assert_int_eq(bad, 3);
    for (int64_t i = 0; i < n; i++) {
      double got = at(g, i), w = i >= lo && i < lo + len ? want[i] : gv[i];
      ck_assert_msg(got == w || (isnan(got) && isnan(w)), "unscale %s element %lld", dlua_dtype_name(dt), (long long)i);
    }
    dlua_tensor_free(g);
  }
  // f16 and bf16: values move by a power of two, exactly.
  double h[5] = {1, -2, 65504, INFINITY, 0.5};
  for (int v = 0; v < 2; v++) {
    dlua_dtype_t dt = v ? DLUA_DTYPE_BF16 : DLUA_DTYPE_F16;
    int64_t five = 5;
    dlua_tensor_t *t0 = NULL, *t = NULL;
    ck_assert_int_eq(dlua_tensor_from_data(&t0, 1, &five, DLUA_DTYPE_F64, h), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_to_dtype(&t, t0, dt), DLUA_OK);
    int64_t bad = 0;
    ck_assert_int_eq(dlua_optim_unscale(t, 0, 5, 0.25, &bad), DLUA_OK);
    ck_assert_int_eq(bad, 1);
    double out[5];
    dlua_tensor_t *back = NULL;
    ck_assert_int_eq(dlua_tensor_to_dtype(&back, t, DLUA_DTYPE_F64), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_to_data(back, out, sizeof out), DLUA_OK);
    double w5[5] = {0.25, -0.5, v ? 65536.0 / 4 : 16376, INFINITY, 0.125};  // bf16 rounds 65504 to 65536
    for (int i = 0; i < 5; i++) ck_assert_msg(out[i] == w5[i], "%s unscale %d: %g", dlua_dtype_name(dt), i, out[i]);
    dlua_tensor_free(t0);
    dlua_tensor_free(t);
    dlua_tensor_free(back);
  }
  free(g0);
}
END_TEST

/* ---- bad input ------------------------------------------------------------------------------------------- */

START_TEST(test_bad_input) {
  double v[37] = {0};
  for (int i = 0; i < 37; i++) v[i] = i;
  dlua_tensor_t *p = arena(DLUA_DTYPE_F32, 37, v), *g = arena(DLUA_DTYPE_F32, 37, v), *b = arena(DLUA_DTYPE_F32, 37, v);
  dlua_tensor_t *g36 = arena(DLUA_DTYPE_F32, 36, v), *g64 = arena(DLUA_DTYPE_F64, 37, v), *pi = NULL, *pt = NULL, *view = NULL;
  int64_t n37 = 37, sq[2] = {6, 6};
  ck_assert_int_eq(dlua_tensor_zeros(&pi, 1, &n37, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *sqt = arena(DLUA_DTYPE_F32, 36, v), *sq2 = NULL;
  ck_assert_int_eq(dlua_tensor_view(&sq2, sqt, 2, sq), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&pt, sq2, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_narrow(&view, p, 0, 0, 37), DLUA_OK);

  tu_expect_error(dlua_optim_sgd_step(p, g36, NULL, 0, 36, 0.1, 0, 0, 0, 0, 0, 1, 1),
                  "sgd_step: grad (36) float32 cpu must have param's dtype and element count (param (37) float32 cpu)");
  tu_expect_error(dlua_optim_sgd_step(p, g64, NULL, 0, 37, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: grad (37) float64 cpu");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 30, 10, 0.1, 0, 0, 0, 0, 0, 1, 1),
                  "sgd_step: range offset 30, length 10 is outside the arena of 37 elements");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, -1, 3, 0.1, 0, 0, 0, 0, 0, 1, 1), "range offset -1, length 3");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 0, 37, -0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: lr must be a finite number in [0, inf], got -0.1");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 0, 37, NAN, 0, 0, 0, 0, 0, 1, 1), "sgd_step: lr must be");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 0, 37, 0.1, 0, 0, -1e-4, 0, 0, 1, 1), "weight_decay must be");
  tu_expect_error(dlua_optim_sgd_step(p, g, b, 0, 37, 0.1, 0.9, 0.1, 0, 1, 0, 1, 1),
                  "sgd_step: Nesterov momentum needs momentum > 0 and dampening 0, got momentum 0.9, dampening 0.1");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 0, 37, 0.1, 0.9, 0, 0, 0, 0, 1, 1), "sgd_step: momentum 0.9 needs a momentum buffer");
  tu_expect_error(dlua_optim_sgd_step(p, g, NULL, 0, 37, 0.1, 0, 0, 0, 0, 0, 1, INFINITY), "grad_scale must be finite");
  tu_expect_error(dlua_optim_sgd_step(pi, g, NULL, 0, 37, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: param must be float32 or float64, got (37) int32 cpu");
  tu_expect_error(dlua_optim_sgd_step(pt, g36, NULL, 0, 36, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: param (6, 6) float32 cpu must be contiguous");
  tu_expect_error(dlua_optim_sgd_step(p, view, NULL, 0, 37, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: grad and param share memory");
  tu_expect_error(dlua_optim_sgd_step(p, g, g, 0, 37, 0.1, 0.9, 0, 0, 0, 0, 1, 1), "sgd_step: momentum_buf and grad share memory");
  tu_expect_error(dlua_optim_sgd_step(NULL, g, NULL, 0, 37, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step: param is NULL");
  // Nothing was written by the failed calls.
  for (int i = 0; i < 37; i++) ck_assert(at(p, i) == i && at(g, i) == i && at(b, i) == i);
  // An empty range is a valid no-op; a range ending exactly at the arena's end is fine.
  ck_assert_int_eq(dlua_optim_sgd_step(p, g, NULL, 37, 0, 0.1, 0, 0, 0, 0, 0, 1, 1), DLUA_OK);
  ck_assert_int_eq(dlua_optim_sgd_step(p, g, NULL, 36, 1, 1, 0, 0, 0, 0, 0, 1, 1), DLUA_OK);
  ck_assert(at(p, 36) == 0 && at(p, 35) == 35);

  dlua_tensor_t *s = arena(DLUA_DTYPE_F32, 37, v);
  tu_expect_error(dlua_optim_adamw_step(p, g, b, s, NULL, 0, 37, 1e-3, 1.0, 0.999, 1e-8, 0, 1, 0, 0, 1),
                  "adamw_step: beta1 must be a finite number in [0, 1), got 1");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, -0.1, 1e-8, 0, 1, 0, 0, 1), "beta2 must be");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, 0.999, -1, 0, 1, 0, 0, 1), "eps must be");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, 0, 0, 0, 0, 1),
                  "adamw_step: step counts this step from 1, got 0");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 1, 0, 1),
                  "adamw_step: amsgrad needs max_exp_avg_sq");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, b, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 0, 0, 1),
                  "adamw_step: exp_avg and exp_avg_sq share memory");
  tu_expect_error(dlua_optim_adamw_step(p, g, b, g36, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 0, 0, 1),
                  "adamw_step: exp_avg_sq (36) float32 cpu must have param's dtype");

  int64_t off[2] = {0, 10}, len[2] = {12, 5}, far[1] = {40}, one[1] = {1};
  tu_expect_error(dlua_optim_lars_step(p, g, b, 2, off, len, NULL, 0.1, 0.9, 0, 0.001, 0, 1, 1),
                  "lars_step: parameter ranges overlap: [0, 12) and [10, 15)");
  tu_expect_error(dlua_optim_lars_step(p, g, b, 1, far, one, NULL, 0.1, 0.9, 0, 0.001, 0, 1, 1),
                  "lars_step: parameter 0: range offset 40, length 1 is outside the arena of 37 elements");
  tu_expect_error(dlua_optim_lars_step(p, g, b, 2, NULL, len, NULL, 0.1, 0.9, 0, 0.001, 0, 1, 1), "lars_step: expected n_ranges >= 0");
  tu_expect_error(dlua_optim_lars_step(p, g, b, 1, off, len, NULL, 0.1, 0.9, 0, -1, 0, 1, 1), "trust_coefficient must be");
  ck_assert_int_eq(dlua_optim_lars_step(p, g, b, 0, NULL, NULL, NULL, 0.1, 0.9, 0, 0.001, 0, 1, 1), DLUA_OK);

  tu_expect_error(dlua_optim_adam_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 1, 0, 1),
                  "adam_step: amsgrad needs max_exp_avg_sq");
  tu_expect_error(dlua_optim_adam_step(p, g, b, s, NULL, 0, 37, 1e-3, 0.9, 0.999, 1e-8, -0.1, 1, 0, 0, 1),
                  "adam_step: weight_decay must be");
  tu_expect_error(dlua_optim_lamb_step(p, g, b, s, 2, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 1, 1),
                  "lamb_step: parameter ranges overlap: [0, 12) and [10, 15)");
  tu_expect_error(dlua_optim_lamb_step(p, g, b, s, 1, far, one, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 1, 1),
                  "lamb_step: parameter 0: range offset 40, length 1 is outside the arena of 37 elements");
  tu_expect_error(dlua_optim_lamb_step(p, g, b, s, 1, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 0, 1, 1),
                  "lamb_step: step counts this step from 1, got 0");
  tu_expect_error(dlua_optim_lamb_step(p, g, b, s, 1, off, len, NULL, 1e-3, 1.0, 0.999, 1e-6, 0, 1, 1, 1),
                  "lamb_step: beta1 must be a finite number in [0, 1), got 1");
  tu_expect_error(dlua_optim_lamb_step(p, g, b, b, 1, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 1, 1),
                  "lamb_step: exp_avg and exp_avg_sq share memory");
  tu_expect_error(dlua_optim_lamb_step(p, g, g36, s, 1, off, len, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 1, 1),
                  "lamb_step: exp_avg (36) float32 cpu must have param's dtype");
  ck_assert_int_eq(dlua_optim_lamb_step(p, g, b, s, 0, NULL, NULL, NULL, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 1, 1), DLUA_OK);
  for (int i = 0; i < 37; i++) ck_assert(at(p, i) == (i == 36 ? 0 : i) && at(b, i) == i && at(s, i) == i);

  double nrm = 7;
  tu_expect_error(dlua_optim_grad_norm_partial(g, 0, 37, 0, &nrm), "grad_norm_partial: norm_type must be a number > 0 or inf, got 0");
  ck_assert(nrm == 0);
  tu_expect_error(dlua_optim_grad_norm_partial(g, 0, 37, -INFINITY, &nrm), "norm_type must be a number > 0 or inf, got -inf");
  tu_expect_error(dlua_optim_grad_norm_partial(g, 0, 37, NAN, &nrm), "norm_type must be a number > 0 or inf");
  tu_expect_error(dlua_optim_grad_norm_partial(g, 0, 37, 2, NULL), "grad_norm_partial: out is NULL");
  tu_expect_error(dlua_optim_grad_norm_partial(g, 30, 8, 2, &nrm),
                  "grad_norm_partial: range offset 30, length 8 is outside the arena of 37 elements");
  tu_expect_error(dlua_optim_grad_norm_partial(pi, 0, 37, 2, &nrm), "grad_norm_partial: grad must be a floating-point tensor, got (37) int32 cpu");
  tu_expect_error(dlua_optim_grad_norm_partial(pt, 0, 36, 2, &nrm), "grad_norm_partial: grad (6, 6) float32 cpu must be contiguous");
  tu_expect_error(dlua_optim_grad_norm_partial(NULL, 0, 36, 2, &nrm), "grad_norm_partial: grad is NULL");
  tu_expect_error(dlua_optim_grad_scale(g, 0, 37, INFINITY), "grad_scale: scale must be finite, got inf");
  tu_expect_error(dlua_optim_grad_scale(g, 1, 37, 0.5), "grad_scale: range offset 1, length 37 is outside the arena of 37 elements");
  for (int i = 0; i < 37; i++) ck_assert(at(g, i) == i);

  int64_t cnt = 5;
  tu_expect_error(dlua_optim_unscale(p, 0, 38, 0.5, &cnt), "unscale: range offset 0, length 38 is outside the arena of 37 elements");
  ck_assert_int_eq(cnt, 0);
  tu_expect_error(dlua_optim_unscale(p, 0, 37, INFINITY, NULL), "unscale: inv_scale must be finite");
  tu_expect_error(dlua_optim_unscale(pi, 0, 37, 0.5, NULL), "unscale: grad must be a floating-point tensor, got (37) int32 cpu");
  tu_expect_error(dlua_optim_unscale(pt, 0, 36, 0.5, NULL), "unscale: grad (6, 6) float32 cpu must be contiguous");

  dlua_tensor_free(s);
  dlua_tensor_free(p);
  dlua_tensor_free(g);
  dlua_tensor_free(b);
  dlua_tensor_free(g36);
  dlua_tensor_free(g64);
  dlua_tensor_free(pi);
  dlua_tensor_free(pt);
  dlua_tensor_free(view);
  dlua_tensor_free(sqt);
  dlua_tensor_free(sq2);
}
END_TEST

/* The front doors reach the kernels through the backend table: the CPU's optim family fills every slot and runs
   a descriptor itself; a tensor on device 0 gets the registry's one message when no CUDA device exists, and
   otherwise the CUDA family, which runs the steps and the gradient slots but not compression. */
START_TEST(test_through_the_table) {
  const struct dlua_optim_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("sgd_step", DLUA_CPU, optim, sgd_step, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_optim_ops);
  ck_assert(k->sgd_step && k->adam_step && k->lars_step && k->lamb_step && k->unscale && k->grad_scale &&
            k->grad_norm_partial && k->compress_to_half && k->compress_from_half && k->compress_topk &&
            k->compress_topk_unpack && k->compress_orthogonalize);

  // SGD without momentum on a descriptor: p -= lr * (g * grad_scale), each scalar rounded to float first
  float p[3] = {1.0f, -2.0f, 0.5f}, g[3] = {0.25f, 1.0f, -4.0f};
  dlua_optim_step_desc_t d;
  memset(&d, 0, sizeof d);
  d.dtype = DLUA_DTYPE_F32;
  d.length = 3;
  d.device = DLUA_CPU;
  d.args.p = p;
  d.args.g = g;
  d.args.lr = 0.1;
  d.args.grad_scale = 0.5;
  ck_assert_int_eq(k->sgd_step("sgd_step", &d), DLUA_OK);
  const float want[3] = {1.0f - 0.1f * (0.25f * 0.5f), -2.0f - 0.1f * (1.0f * 0.5f), 0.5f - 0.1f * (-4.0f * 0.5f)};
  for (int i = 0; i < 3; i++) ck_assert_msg(p[i] == want[i], "p[%d] = %.9g, expected %.9g", i, p[i], want[i]);

  // unscale on a descriptor: x *= 0.5, one non-finite counted
  double x[3] = {2.0, INFINITY, -6.0};
  int64_t bad = -1;
  dlua_optim_grad_desc_t u = {.dtype = DLUA_DTYPE_F64, .x = x, .n = 3, .s = 0.5, .nonfinite = &bad, .device = DLUA_CPU};
  ck_assert_int_eq(k->unscale("unscale", &u), DLUA_OK);
  ck_assert_int_eq(bad, 1);
  ck_assert(x[0] == 1.0 && isinf(x[1]) && x[2] == -3.0);

  int64_t n = 4;
  double v[4] = {1, 2, 3, 4};
  dlua_tensor_t *a = tu_make(1, &n, DLUA_DTYPE_F32, v), *b = tu_make(1, &n, DLUA_DTYPE_F32, v);
  struct dlua_tensor pa = *a, ga = *b;  // the same headers claiming device 0: never read unless a device exists
  pa.device = ga.device = 0;
  if (dlua_cuda_device_count() == 0) {
    tu_expect_error_at(dlua_optim_sgd_step(&pa, &ga, NULL, 0, 4, 0.1, 0, 0, 0, 0, 0, 1, 1), "sgd_step",
                       "sgd_step: no CUDA device available");
    tu_expect_error_at(dlua_optim_adamw_step(&pa, &ga, &ga, &ga, NULL, 0, 4, 0.1, 0.9, 0.999, 1e-8, 0, 1, 0, 0, 1),
                       "adamw_step", "adamw_step: no CUDA device available");
    int64_t nf = -1;
    tu_expect_error_at(dlua_optim_unscale(&ga, 0, 4, 0.5, &nf), "unscale", "unscale: no CUDA device available");
    ck_assert_int_eq(nf, 0);
    double out = -1;
    tu_expect_error_at(dlua_optim_grad_norm_partial(&ga, 0, 4, 2, &out), "grad_norm_partial",
                       "grad_norm_partial: no CUDA device available");
    tu_expect_error_at(dlua_compress_orthogonalize(&pa, 1e-8), "compress_orthogonalize",
                       "compress_orthogonalize: no CUDA device available");
  } else {
    const struct dlua_optim_ops *kc = NULL;
    ck_assert_int_eq(DLUA_BACKEND("lamb_step", 0, optim, lamb_step, &kc), DLUA_OK);
    ck_assert_ptr_ne(kc, &dlua_cpu_optim_ops);
    ck_assert(kc->sgd_step && kc->adam_step && kc->lars_step && kc->unscale && kc->grad_scale && kc->grad_norm_partial);
    tu_expect_error_at(DLUA_BACKEND("compress_topk", 0, optim, compress_topk, &kc), "compress_topk",
                       "compress_topk: not supported on cuda");
  }
  dlua_tensor_free(a), dlua_tensor_free(b);
}
END_TEST

int main(void) {
  Suite *s = suite_create("optim");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_sgd_reference);
  tcase_add_test(tc, test_adamw_reference);
  tcase_add_test(tc, test_adam_reference);
  tcase_add_test(tc, test_adam_vs_adamw_decay);
  tcase_add_test(tc, test_adamw_first_step_magnitude);
  tcase_add_test(tc, test_lars_reference);
  tcase_add_test(tc, test_lars_trust_ratio);
  tcase_add_test(tc, test_lamb_reference);
  tcase_add_test(tc, test_lamb_trust_ratio);
  tcase_add_test(tc, test_grad_norm_partial);
  tcase_add_test(tc, test_threads);
  tcase_add_test(tc, test_unscale);
  tcase_add_test(tc, test_bad_input);
  tcase_add_test(tc, test_through_the_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

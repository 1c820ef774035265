/* Check suite for host/ops/conv.c (the conv2d front doors) and host/cpu/conv.c (the conv table's CPU kernels): conv2d
   forward/backward against naive double loops and finite differences. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "cpu/conv.h"
#include "kernels/act_layout.h"
#include "kernels/conv.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t rng_state = 88172645463325252ull;

/* A channels-last copy of a 4-D tensor: (N, H, W, C) memory, logically (N, C, H, W). */
static dlua_tensor_t *to_channels_last(const dlua_tensor_t *t) {
  const int64_t *s = dlua_tensor_sizes(t);
  int64_t phys[4] = {s[0], s[2], s[3], s[1]};
  static const int perm[4] = {0, 3, 1, 2};
  dlua_tensor_t *p = NULL, *v = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&p, 4, phys, dlua_tensor_dtype(t), DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_permute(&v, p, perm), DLUA_OK);
  dlua_tensor_free(p);
  ck_assert_int_eq(dlua_tensor_copy_(v, t), DLUA_OK);
  return v;
}

static int is_channels_last(const dlua_tensor_t *t) {
  const int64_t *s = dlua_tensor_sizes(t), *st = dlua_tensor_strides(t);
  return st[1] == 1 && st[3] == s[1] && st[2] == s[3] * s[1] && st[0] == s[2] * s[3] * s[1];
}

static void expect_error(dlua_status_t s, const char *prefix, const char *needle1, const char *needle2) {
  ck_assert_int_eq(s, DLUA_ERR_ARG);
  const char *m = dlua_last_error();
  if (strncmp(m, prefix, strlen(prefix)) != 0) ck_abort_msg("error does not start with '%s': %s", prefix, m);
  if (needle1 && !strstr(m, needle1)) ck_abort_msg("error lacks '%s': %s", needle1, m);
  if (needle2 && !strstr(m, needle2)) ck_abort_msg("error lacks '%s': %s", needle2, m);
}

/* ---- the naive reference, written out from the definition ------------------------------------- */

typedef struct {
  int64_t n, c, h, w, o, kh, kw;
  int sh, sw, ph, pw, dh, dw, g, bias;
} cfg_t;

static int64_t out_h(const cfg_t *k) { return (k->h + 2 * k->ph - k->dh * (k->kh - 1) - 1) / k->sh + 1; }
static int64_t out_w(const cfg_t *k) { return (k->w + 2 * k->pw - k->dw * (k->kw - 1) - 1) / k->sw + 1; }

#define X4(a, b, c, d, S1, S2, S3) ((((a) * (S1) + (b)) * (S2) + (c)) * (S3) + (d))

/* y[n,o,p,q] = b[o] + sum over (ci, i, j) of x[n, g*Cg+ci, p*sh-ph+i*dh, q*sw-pw+j*dw] * w[o,ci,i,j]. */
static void naive_forward(const cfg_t *k, const double *x, const double *w, const double *b, double *y) {
  int64_t OH = out_h(k), OW = out_w(k), cg = k->c / k->g, og = k->o / k->g;
  for (int64_t n = 0; n < k->n; n++)
    for (int64_t o = 0; o < k->o; o++)
      for (int64_t p = 0; p < OH; p++)
        for (int64_t q = 0; q < OW; q++) {
          double s = b ? b[o] : 0.0;
          for (int64_t ci = 0; ci < cg; ci++)
            for (int64_t i = 0; i < k->kh; i++)
              for (int64_t j = 0; j < k->kw; j++) {
                int64_t ih = p * k->sh - k->ph + i * k->dh, iw = q * k->sw - k->pw + j * k->dw;
                if (ih < 0 || ih >= k->h || iw < 0 || iw >= k->w) continue;
                s += x[X4(n, (o / og) * cg + ci, ih, iw, k->c, k->h, k->w)] * w[X4(o, ci, i, j, cg, k->kh, k->kw)];
              }
          y[X4(n, o, p, q, k->o, OH, OW)] = s;
        }
}

/* The same sum read the other way: every (output, tap) pair scatters into grad_x and grad_w. */
static void naive_backward(const cfg_t *k, const double *x, const double *w, const double *gy, double *gx, double *gw,
                           double *gb) {
  int64_t OH = out_h(k), OW = out_w(k), cg = k->c / k->g, og = k->o / k->g;
  memset(gx, 0, sizeof(double) * (size_t)(k->n * k->c * k->h * k->w));
  memset(gw, 0, sizeof(double) * (size_t)(k->o * cg * k->kh * k->kw));
  memset(gb, 0, sizeof(double) * (size_t)k->o);
  for (int64_t n = 0; n < k->n; n++)
    for (int64_t o = 0; o < k->o; o++)
      for (int64_t p = 0; p < OH; p++)
        for (int64_t q = 0; q < OW; q++) {
          double d = gy[X4(n, o, p, q, k->o, OH, OW)];
          gb[o] += d;
          for (int64_t ci = 0; ci < cg; ci++)
            for (int64_t i = 0; i < k->kh; i++)
              for (int64_t j = 0; j < k->kw; j++) {
                int64_t ih = p * k->sh - k->ph + i * k->dh, iw = q * k->sw - k->pw + j * k->dw;
                if (ih < 0 || ih >= k->h || iw < 0 || iw >= k->w) continue;
                int64_t xi = X4(n, (o / og) * cg + ci, ih, iw, k->c, k->h, k->w), wi = X4(o, ci, i, j, cg, k->kh, k->kw);
                gx[xi] += d * w[wi];
                gw[wi] += d * x[xi];
              }
        }
}

/* ---- configurations --------------------------------------------------------------------------- */

static const cfg_t cfgs[] = {
    /*  n  c   h   w   o kh kw sh sw ph pw dh dw  g bias */
    {2, 3, 7, 5, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1},     // plain 3x3, padded
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0},     // everything 1
    {1, 4, 1, 1, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2, 1},     // 1x1 image seen through padding, 2 groups
    {3, 5, 11, 13, 7, 5, 3, 2, 3, 2, 1, 1, 1, 1, 1},   // prime sizes, 5x3 kernel, stride (2, 3)
    {2, 6, 9, 8, 6, 3, 3, 1, 1, 2, 2, 2, 2, 6, 0},     // depthwise, dilation 2
    {2, 4, 10, 10, 8, 3, 3, 2, 2, 1, 1, 1, 1, 2, 1},   // grouped, stride 2
    {1, 2, 5, 7, 3, 2, 4, 3, 1, 0, 3, 1, 2, 1, 0},     // stride above kernel, dilated columns
    {2, 16, 8, 8, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1},   // 16 channels: oneDNN's blocked kernels
    {2, 3, 6, 6, 5, 1, 1, 2, 2, 0, 0, 1, 1, 1, 1},     // 1x1 stride 2 leaving a column unread
    {1, 3, 4, 4, 2, 3, 3, 1, 1, 3, 3, 1, 1, 1, 1},     // padding as large as the kernel
};
enum { NCFG = sizeof cfgs / sizeof cfgs[0] };

typedef struct {
  double *x, *w, *b, *gy;  // random inputs (logical order)
  double *y, *gx, *gw, *gb;  // naive results
  int64_t xn, wn, yn;
  int64_t xs[4], ws[4], ys[4], bs[1];
} problem_t;

static void problem_init(problem_t *p, const cfg_t *k) {
  int64_t xs[4] = {k->n, k->c, k->h, k->w}, ws[4] = {k->o, k->c / k->g, k->kh, k->kw}, ys[4] = {k->n, k->o, out_h(k), out_w(k)};
  memcpy(p->xs, xs, sizeof xs);
  memcpy(p->ws, ws, sizeof ws);
  memcpy(p->ys, ys, sizeof ys);
  p->bs[0] = k->o;
  p->xn = dlua_shape_numel(4, xs);
  p->wn = dlua_shape_numel(4, ws);
  p->yn = dlua_shape_numel(4, ys);
  p->x = tu_rand_vals(tu_xorshift, &rng_state, p->xn, 1.0);
  p->w = tu_rand_vals(tu_xorshift, &rng_state, p->wn, 1.0);
  p->b = tu_rand_vals(tu_xorshift, &rng_state, k->o, 1.0);
  p->gy = tu_rand_vals(tu_xorshift, &rng_state, p->yn, 1.0);
  p->y = malloc(sizeof(double) * (size_t)(p->yn ? p->yn : 1));
  p->gx = malloc(sizeof(double) * (size_t)(p->xn ? p->xn : 1));
  p->gw = malloc(sizeof(double) * (size_t)(p->wn ? p->wn : 1));
  p->gb = malloc(sizeof(double) * (size_t)(k->o ? k->o : 1));
  naive_forward(k, p->x, p->w, k->bias ? p->b : NULL, p->y);
  naive_backward(k, p->x, p->w, p->gy, p->gx, p->gw, p->gb);
}

static void problem_free(problem_t *p) {
  free(p->x), free(p->w), free(p->b), free(p->gy), free(p->y), free(p->gx), free(p->gw), free(p->gb);
}

/* One configuration in one dtype and memory format (bit 0: x/grad_y channels-last, bit 1: weights OHWI). */
static void check_cfg(const cfg_t *k, dlua_dtype_t dt, int layout, double tol) {
  char what[160];
  problem_t p;
  problem_init(&p, k);
  dlua_tensor_t *x = tu_make(4, p.xs, dt, p.x), *w = tu_make(4, p.ws, dt, p.w), *gy = tu_make(4, p.ys, dt, p.gy);
  dlua_tensor_t *b = k->bias ? tu_make(1, p.bs, dt, p.b) : NULL;
  if (layout & 1) {
    dlua_tensor_t *t = to_channels_last(x);
    dlua_tensor_free(x), x = t;
    t = to_channels_last(gy);
    dlua_tensor_free(gy), gy = t;
  }
  if (layout & 2) {
    dlua_tensor_t *t = to_channels_last(w);
    dlua_tensor_free(w), w = t;
  }
  snprintf(what, sizeof what, "cfg (n%lld c%lld %lldx%lld o%lld k%lldx%lld g%d) %s layout %d", (long long)k->n,
           (long long)k->c, (long long)k->h, (long long)k->w, (long long)k->o, (long long)k->kh, (long long)k->kw, k->g,
           dlua_dtype_name(dt), layout);

  dlua_tensor_t *y = NULL;
  dlua_status_t s = dlua_conv2d_forward(&y, x, w, b, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g);
  if (s != DLUA_OK) ck_abort_msg("%s: forward failed: %s", what, dlua_last_error());
  ck_assert_int_eq(dlua_tensor_dtype(y), dt);
  for (int d = 0; d < 4; d++) ck_assert_int_eq(dlua_tensor_sizes(y)[d], p.ys[d]);
  if ((layout & 1) && k->o > 1) ck_assert_msg(is_channels_last(y), "%s: output is not channels-last", what);
  if (!(layout & 1)) ck_assert_msg(dlua_tensor_is_contiguous(y), "%s: output is not contiguous", what);
  double *v = tu_values(y);
  char w2[200];
  snprintf(w2, sizeof w2, "%s forward", what);
  tu_expect_close(v, p.y, p.yn, tol, w2);
  free(v);

  dlua_tensor_t *gx = NULL;
  s = dlua_conv2d_backward_data(&gx, gy, w, p.xs, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 0);
  if (s != DLUA_OK) ck_abort_msg("%s: backward data failed: %s", what, dlua_last_error());
  if ((layout & 1) && k->c > 1) ck_assert_msg(is_channels_last(gx), "%s: grad_input is not channels-last", what);
  v = tu_values(gx);
  snprintf(w2, sizeof w2, "%s backward data", what);
  tu_expect_close(v, p.gx, p.xn, tol, w2);
  free(v);

  // accumulate = 1 adds the input gradient to what the given tensor holds (in gx's layout: the
  // channels-last float32 stride-1 case adds inside the convolution, the others through a temporary)
  double *junk_x = tu_rand_vals(tu_xorshift, &rng_state, p.xn, 1.0);
  dlua_tensor_t *acc = tu_make(4, p.xs, dt, junk_x);
  if (layout & 1) {
    dlua_tensor_t *t = to_channels_last(acc);
    dlua_tensor_free(acc), acc = t;
  }
  dlua_tensor_t *acc_in = acc;
  s = dlua_conv2d_backward_data(&acc, gy, w, p.xs, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 1);
  if (s != DLUA_OK) ck_abort_msg("%s: accumulating backward data failed: %s", what, dlua_last_error());
  ck_assert_ptr_eq(acc, acc_in);
  v = tu_values(acc);
  double *want = malloc((size_t)p.xn * sizeof(double));
  for (int64_t i = 0; i < p.xn; i++) want[i] = junk_x[i] + p.gx[i];
  snprintf(w2, sizeof w2, "%s backward data, accumulated", what);
  tu_expect_close(v, want, p.xn, tol, w2);
  free(v), free(want), free(junk_x);
  dlua_tensor_free(acc);

  // Parameter gradients accumulate onto what the tensors hold: start from known junk.
  double *junk_w = tu_rand_vals(tu_xorshift, &rng_state, p.wn, 1.0), *junk_b = tu_rand_vals(tu_xorshift, &rng_state, k->o, 1.0);
  dlua_tensor_t *gw = tu_make(4, p.ws, dt, junk_w), *gb = tu_make(1, p.bs, dt, junk_b);
  if (layout & 2) {
    dlua_tensor_t *t = to_channels_last(gw);
    dlua_tensor_free(gw), gw = t;
  }
  s = dlua_conv2d_backward_weights(gw, k->bias ? gb : NULL, x, gy, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 1);
  if (s != DLUA_OK) ck_abort_msg("%s: backward weights failed: %s", what, dlua_last_error());
  for (int64_t i = 0; i < p.wn; i++) junk_w[i] += p.gw[i];
  for (int64_t i = 0; i < k->o; i++) junk_b[i] += p.gb[i];
  v = tu_values(gw);
  snprintf(w2, sizeof w2, "%s backward weights (accumulated)", what);
  tu_expect_close(v, junk_w, p.wn, tol, w2);
  free(v);
  if (k->bias) {
    v = tu_values(gb);
    snprintf(w2, sizeof w2, "%s backward bias (accumulated)", what);
    tu_expect_close(v, junk_b, k->o, tol, w2);
    free(v);
  }
  // accumulate = 0 overwrites.
  s = dlua_conv2d_backward_weights(gw, k->bias ? gb : NULL, x, gy, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 0);
  ck_assert_int_eq(s, DLUA_OK);
  v = tu_values(gw);
  snprintf(w2, sizeof w2, "%s backward weights (overwritten)", what);
  tu_expect_close(v, p.gw, p.wn, tol, w2);
  free(v);
  if (k->bias) {
    v = tu_values(gb);
    tu_expect_close(v, p.gb, k->o, tol, what);
    free(v);
  }
  free(junk_w), free(junk_b);
  dlua_tensor_free(x), dlua_tensor_free(w), dlua_tensor_free(b), dlua_tensor_free(gy), dlua_tensor_free(y);
  dlua_tensor_free(gx), dlua_tensor_free(gw), dlua_tensor_free(gb);
  problem_free(&p);
}

START_TEST(test_against_naive_f32) {
  for (int i = 0; i < NCFG; i++)
    for (int layout = 0; layout < 4; layout++) check_cfg(&cfgs[i], DLUA_DTYPE_F32, layout, 2e-5);
}
END_TEST

START_TEST(test_against_naive_f64) {
  for (int i = 0; i < NCFG; i++)
    for (int layout = 0; layout < 4; layout++) check_cfg(&cfgs[i], DLUA_DTYPE_F64, layout, 1e-12);
}
END_TEST

START_TEST(test_against_naive_half) {
  // float16/bfloat16 compute in float32; the tolerance is the storage rounding of the result.
  for (int i = 0; i < NCFG; i += 3) {
    check_cfg(&cfgs[i], DLUA_DTYPE_F16, 1, 4e-3);
    check_cfg(&cfgs[i], DLUA_DTYPE_BF16, 0, 3e-2);
  }
}
END_TEST

/* ---- finite differences (float64) ----------------------------------------------------------- */

/* L = sum(conv(x, w, b) * r); dL/dx, dL/dw, dL/db from the backward calls vs central differences. */
static void check_fd(const cfg_t *k, int layout) {
  problem_t p;
  problem_init(&p, k);
  dlua_tensor_t *x = tu_make(4, p.xs, DLUA_DTYPE_F64, p.x), *w = tu_make(4, p.ws, DLUA_DTYPE_F64, p.w);
  dlua_tensor_t *b = tu_make(1, p.bs, DLUA_DTYPE_F64, p.b), *r = tu_make(4, p.ys, DLUA_DTYPE_F64, p.gy);
  if (layout) {
    dlua_tensor_t *t = to_channels_last(x);
    dlua_tensor_free(x), x = t;
    t = to_channels_last(r);
    dlua_tensor_free(r), r = t;
  }
  dlua_tensor_t *gx = NULL, *gw = NULL, *gb = NULL;
  ck_assert_int_eq(dlua_conv2d_backward_data(&gx, r, w, p.xs, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&gw, 4, p.ws, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, p.bs, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_conv2d_backward_weights(gw, gb, x, r, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g, 1), DLUA_OK);
  double *ax = tu_values(gx), *aw = tu_values(gw), *ab = tu_values(gb);

  const double eps = 1e-6;
  double *pv[3] = {p.x, p.w, p.b}, *an[3] = {ax, aw, ab};
  int64_t pn[3] = {p.xn, p.wn, k->o};
  for (int which = 0; which < 3; which++)
    for (int64_t i = 0; i < pn[which]; i++) {
      double loss[2];
      for (int side = 0; side < 2; side++) {
        double keep = pv[which][i];
        pv[which][i] = keep + (side ? -eps : eps);
        dlua_tensor_t *xt = tu_make(4, p.xs, DLUA_DTYPE_F64, p.x), *wt = tu_make(4, p.ws, DLUA_DTYPE_F64, p.w);
        dlua_tensor_t *bt = tu_make(1, p.bs, DLUA_DTYPE_F64, p.b), *y = NULL;
        ck_assert_int_eq(dlua_conv2d_forward(&y, xt, wt, bt, k->sh, k->sw, k->ph, k->pw, k->dh, k->dw, k->g), DLUA_OK);
        double *yv = tu_values(y);
        loss[side] = 0;
        for (int64_t j = 0; j < p.yn; j++) loss[side] += yv[j] * p.gy[j];
        free(yv);
        dlua_tensor_free(xt), dlua_tensor_free(wt), dlua_tensor_free(bt), dlua_tensor_free(y);
        pv[which][i] = keep;
      }
      double fd = (loss[0] - loss[1]) / (2 * eps);
      if (!(fabs(fd - an[which][i]) <= 1e-6 * (1 + fabs(fd))))
        ck_abort_msg("finite differences: %s[%lld] analytic %.12g vs numeric %.12g (layout %d)",
                     which == 0 ? "x" : which == 1 ? "w" : "b", (long long)i, an[which][i], fd, layout);
    }
  free(ax), free(aw), free(ab);
  dlua_tensor_free(x), dlua_tensor_free(w), dlua_tensor_free(b), dlua_tensor_free(r);
  dlua_tensor_free(gx), dlua_tensor_free(gw), dlua_tensor_free(gb);
  problem_free(&p);
}

START_TEST(test_finite_differences) {
  static const cfg_t small[] = {
      {2, 2, 4, 5, 3, 3, 2, 1, 2, 1, 1, 1, 1, 1, 1},  // stride, asymmetric kernel
      {1, 4, 5, 5, 4, 3, 3, 2, 1, 1, 0, 2, 1, 2, 1},  // groups, dilation
      {1, 3, 3, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 3, 1},  // depthwise
  };
  for (int i = 0; i < 3; i++)
    for (int layout = 0; layout < 2; layout++) check_fd(&small[i], layout);
}
END_TEST

/* ---- accumulation, odd strides, given outputs ----------------------------------------------- */

START_TEST(test_accumulate_doubles) {
  const cfg_t k = {2, 16, 6, 6, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1};
  for (int dti = 0; dti < 2; dti++) {
    dlua_dtype_t dt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
    problem_t p;
    problem_init(&p, &k);
    dlua_tensor_t *x = tu_make(4, p.xs, dt, p.x), *gy = tu_make(4, p.ys, dt, p.gy), *gw = NULL, *gb = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&gw, 4, p.ws, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, p.bs, dt, DLUA_CPU), DLUA_OK);
    for (int rep = 0; rep < 2; rep++)
      ck_assert_int_eq(dlua_conv2d_backward_weights(gw, gb, x, gy, 1, 1, 1, 1, 1, 1, 1, 1), DLUA_OK);
    for (int64_t i = 0; i < p.wn; i++) p.gw[i] *= 2;
    for (int64_t i = 0; i < k.o; i++) p.gb[i] *= 2;
    double *v = tu_values(gw);
    tu_expect_close(v, p.gw, p.wn, dti ? 1e-12 : 2e-5, "twice-accumulated weights");
    free(v);
    v = tu_values(gb);
    tu_expect_close(v, p.gb, k.o, dti ? 1e-12 : 2e-5, "twice-accumulated bias");
    free(v);
    dlua_tensor_free(x), dlua_tensor_free(gy), dlua_tensor_free(gw), dlua_tensor_free(gb);
    problem_free(&p);
  }
}
END_TEST

START_TEST(test_noncontiguous_operands) {
  // x narrowed out of a wider tensor, weights transposed twice into odd strides, bias expanded
  // from one value, gradients of another dtype and layout than the inputs.
  const cfg_t k = {2, 3, 5, 6, 4, 3, 2, 1, 1, 1, 0, 1, 1, 1, 1};
  problem_t p;
  problem_init(&p, &k);
  for (int64_t i = 0; i < k.o; i++) p.b[i] = p.b[0];
  naive_forward(&k, p.x, p.w, p.b, p.y);

  int64_t wide[4] = {2, 3, 5, 9};
  double *wv = tu_rand_vals(tu_xorshift, &rng_state, 2 * 3 * 5 * 9, 1.0);
  for (int64_t n = 0; n < 2; n++)
    for (int64_t c = 0; c < 3; c++)
      for (int64_t h = 0; h < 5; h++)
        for (int64_t q = 0; q < 6; q++) wv[X4(n, c, h, q + 2, 3, 5, 9)] = p.x[X4(n, c, h, q, 3, 5, 6)];
  dlua_tensor_t *xw = tu_make(4, wide, DLUA_DTYPE_F32, wv), *x = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&x, xw, 3, 2, 6), DLUA_OK);
  // w stored as (kW, C, kH, O) and permuted back to (O, C, kH, kW).
  int64_t wphys[4] = {k.kw, k.c, k.kh, k.o};
  double *wp = malloc(sizeof(double) * (size_t)p.wn);
  for (int64_t o = 0; o < k.o; o++)
    for (int64_t c = 0; c < k.c; c++)
      for (int64_t i = 0; i < k.kh; i++)
        for (int64_t j = 0; j < k.kw; j++) wp[X4(j, c, i, o, k.c, k.kh, k.o)] = p.w[X4(o, c, i, j, k.c, k.kh, k.kw)];
  dlua_tensor_t *wt = tu_make(4, wphys, DLUA_DTYPE_F32, wp), *w = NULL;
  static const int perm[4] = {3, 1, 2, 0};
  ck_assert_int_eq(dlua_tensor_permute(&w, wt, perm), DLUA_OK);
  int64_t one = 1, bo = k.o;
  dlua_tensor_t *b1 = tu_make(1, &one, DLUA_DTYPE_F32, p.b), *b = NULL;
  ck_assert_int_eq(dlua_tensor_expand(&b, b1, 1, &bo), DLUA_OK);

  // The output given as a float64 tensor viewed through a transpose (not NCHW nor NHWC).
  int64_t yt_sizes[4] = {p.ys[0], p.ys[1], p.ys[3], p.ys[2]};
  dlua_tensor_t *yt = NULL, *y = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&yt, 4, yt_sizes, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_transpose(&y, yt, 2, 3), DLUA_OK);
  dlua_tensor_t *yo = y;
  ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, b, 1, 1, 1, 0, 1, 1, 1), DLUA_OK);
  ck_assert_ptr_eq(y, yo);
  double *v = tu_values(y);
  tu_expect_close(v, p.y, p.yn, 2e-5, "forward into a transposed float64 output");
  free(v);

  // Weight gradient accumulated into a float64 OHWI tensor, from a float32 problem.
  dlua_tensor_t *gy = tu_make(4, p.ys, DLUA_DTYPE_F32, p.gy), *gw0 = NULL, *gw = NULL, *gb = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&gw0, 4, p.ws, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  gw = to_channels_last(gw0);
  ck_assert_int_eq(dlua_tensor_fill_(gw, 0.5), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, p.bs, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_conv2d_backward_weights(gw, gb, x, gy, 1, 1, 1, 0, 1, 1, 1, 1), DLUA_OK);
  for (int64_t i = 0; i < p.wn; i++) p.gw[i] += 0.5;
  v = tu_values(gw);
  tu_expect_close(v, p.gw, p.wn, 2e-5, "weight gradient accumulated into float64 OHWI");
  free(v);
  v = tu_values(gb);
  tu_expect_close(v, p.gb, k.o, 2e-5, "bias gradient into float64");
  free(v);

  free(wv), free(wp);
  dlua_tensor_free(xw), dlua_tensor_free(x), dlua_tensor_free(wt), dlua_tensor_free(w), dlua_tensor_free(b1);
  dlua_tensor_free(b), dlua_tensor_free(yt), dlua_tensor_free(y), dlua_tensor_free(gy), dlua_tensor_free(gw0);
  dlua_tensor_free(gw), dlua_tensor_free(gb);
  problem_free(&p);
}
END_TEST

/* ---- empty and degenerate problems ---------------------------------------------------------- */

START_TEST(test_empty) {
  for (int dti = 0; dti < 2; dti++) {
    dlua_dtype_t dt = dti ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
    // An empty batch: empty output, parameter gradients untouched (accumulate) or zeroed.
    int64_t xs[4] = {0, 3, 5, 5}, ws[4] = {4, 3, 3, 3}, bs = 4;
    dlua_tensor_t *x = NULL, *w = NULL, *b = NULL, *y = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&x, 4, xs, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_zeros(&w, 4, ws, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_zeros(&b, 1, &bs, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_fill_(b, 3.0), DLUA_OK);
    ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, b, 2, 2, 1, 1, 1, 1, 1), DLUA_OK);
    int64_t want[4] = {0, 4, 3, 3};
    for (int d = 0; d < 4; d++) ck_assert_int_eq(dlua_tensor_sizes(y)[d], want[d]);
    dlua_tensor_t *gx = NULL;
    ck_assert_int_eq(dlua_conv2d_backward_data(&gx, y, w, xs, 2, 2, 1, 1, 1, 1, 1, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_numel(gx), 0);
    dlua_tensor_t *gw = NULL, *gb = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&gw, 4, ws, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_zeros(&gb, 1, &bs, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_fill_(gw, 7.0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_fill_(gb, 7.0), DLUA_OK);
    ck_assert_int_eq(dlua_conv2d_backward_weights(gw, gb, x, y, 2, 2, 1, 1, 1, 1, 1, 1), DLUA_OK);
    double *v = tu_values(gw);
    for (int i = 0; i < 108; i++) ck_assert(v[i] == 7.0);
    free(v);
    ck_assert_int_eq(dlua_conv2d_backward_weights(gw, gb, x, y, 2, 2, 1, 1, 1, 1, 1, 0), DLUA_OK);
    v = tu_values(gw);
    for (int i = 0; i < 108; i++) ck_assert(v[i] == 0.0);
    free(v);
    v = tu_values(gb);
    for (int i = 0; i < 4; i++) ck_assert(v[i] == 0.0);
    free(v);
    dlua_tensor_free(y), dlua_tensor_free(gx);

    // A zero-height image that padding still gives an output: the bias alone.
    int64_t xs2[4] = {2, 3, 0, 4};
    dlua_tensor_t *x2 = NULL;
    y = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&x2, 4, xs2, dt, DLUA_CPU), DLUA_OK);
    int64_t ws2[4] = {4, 3, 1, 1};
    dlua_tensor_t *w2 = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&w2, 4, ws2, dt, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_conv2d_forward(&y, x2, w2, b, 1, 1, 1, 0, 1, 1, 1), DLUA_OK);
    int64_t want2[4] = {2, 4, 2, 4};
    for (int d = 0; d < 4; d++) ck_assert_int_eq(dlua_tensor_sizes(y)[d], want2[d]);
    v = tu_values(y);
    for (int i = 0; i < 64; i++) ck_assert(v[i] == 3.0);
    free(v);
    dlua_tensor_free(x), dlua_tensor_free(w), dlua_tensor_free(b), dlua_tensor_free(y);
    dlua_tensor_free(gw), dlua_tensor_free(gb), dlua_tensor_free(x2), dlua_tensor_free(w2);
  }
}
END_TEST

START_TEST(test_output_size) {
  ck_assert_int_eq(dlua_conv2d_output_size(28, 3, 1, 1, 1), 28);
  ck_assert_int_eq(dlua_conv2d_output_size(28, 3, 2, 1, 1), 14);
  ck_assert_int_eq(dlua_conv2d_output_size(7, 3, 2, 0, 2), 2);   // extent 5: positions 0 and 2
  ck_assert_int_eq(dlua_conv2d_output_size(2, 3, 1, 0, 1), 0);
  ck_assert_int_eq(dlua_conv2d_output_size(5, 3, 0, 0, 1), -1);
}
END_TEST

/* oneDNN 2.6's 1x1 weight gradient on strided channels-last input with fewer input channels (per
   group) than its block of 16 is wrong at 2 threads and odd batch (relative error ~0.2-1.2): conv.c
   gathers the strided pixels itself there. Batches 3 and 5, with padding, groups and 16 channels
   (oneDNN's own path) too. */
START_TEST(test_strided_1x1_channels_last_threads) {
  static const cfg_t ks[] = {
      {3, 8, 9, 9, 16, 1, 1, 2, 2, 0, 0, 1, 1, 1, 1},  {5, 12, 6, 20, 4, 1, 1, 2, 2, 0, 0, 1, 1, 1, 0},
      {3, 4, 7, 8, 8, 1, 1, 3, 2, 1, 0, 1, 1, 1, 1},   {5, 6, 9, 7, 4, 1, 1, 2, 2, 0, 0, 1, 1, 2, 0},
      {3, 16, 9, 9, 8, 1, 1, 2, 2, 0, 0, 1, 1, 1, 0},
  };
  int saved = dlua_get_num_threads();
  ck_assert_int_eq(dlua_set_num_threads(2), DLUA_OK);
  for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
    check_cfg(&ks[i], DLUA_DTYPE_F32, 1, 2e-5);
    check_cfg(&ks[i], DLUA_DTYPE_F32, 3, 2e-5);
  }
  ck_assert_int_eq(dlua_set_num_threads(saved), DLUA_OK);
}
END_TEST

/* ---- determinism and the cache -------------------------------------------------------------- */

START_TEST(test_f64_thread_independent) {
  // Large enough (~150k multiply-adds per direction) for the float64 loops to go parallel.
  const cfg_t k = {4, 8, 16, 15, 8, 3, 3, 1, 2, 1, 1, 1, 1, 2, 1};
  problem_t p;
  problem_init(&p, &k);
  dlua_tensor_t *x = tu_make(4, p.xs, DLUA_DTYPE_F64, p.x), *w = tu_make(4, p.ws, DLUA_DTYPE_F64, p.w);
  dlua_tensor_t *b = tu_make(1, p.bs, DLUA_DTYPE_F64, p.b), *gy = tu_make(4, p.ys, DLUA_DTYPE_F64, p.gy);
  double *res[2][3];
  int saved = dlua_get_num_threads();
  for (int t = 0; t < 2; t++) {
    ck_assert_int_eq(dlua_set_num_threads(t ? 2 : 1), DLUA_OK);
    dlua_tensor_t *y = NULL, *gx = NULL, *gw = NULL;
    ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, b, 1, 2, 1, 1, 1, 1, 2), DLUA_OK);
    ck_assert_int_eq(dlua_conv2d_backward_data(&gx, gy, w, p.xs, 1, 2, 1, 1, 1, 1, 2, 0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_zeros(&gw, 4, p.ws, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_conv2d_backward_weights(gw, NULL, x, gy, 1, 2, 1, 1, 1, 1, 2, 1), DLUA_OK);
    res[t][0] = tu_values(y), res[t][1] = tu_values(gx), res[t][2] = tu_values(gw);
    dlua_tensor_free(y), dlua_tensor_free(gx), dlua_tensor_free(gw);
  }
  ck_assert_int_eq(dlua_set_num_threads(saved), DLUA_OK);
  ck_assert(memcmp(res[0][0], res[1][0], sizeof(double) * (size_t)p.yn) == 0);
  ck_assert(memcmp(res[0][1], res[1][1], sizeof(double) * (size_t)p.xn) == 0);
  ck_assert(memcmp(res[0][2], res[1][2], sizeof(double) * (size_t)p.wn) == 0);
  tu_expect_close(res[0][0], p.y, p.yn, 1e-12, "f64 forward");
  for (int t = 0; t < 2; t++)
    for (int i = 0; i < 3; i++) free(res[t][i]);
  dlua_tensor_free(x), dlua_tensor_free(w), dlua_tensor_free(b), dlua_tensor_free(gy);
  problem_free(&p);
}
END_TEST

START_TEST(test_primitive_cache) {
  dlua_conv_cache_clear();
  int n0;
  int64_t h0, m0, h1, m1;
  dlua_conv_cache_stats(&n0, &h0, &m0);
  ck_assert_int_eq(n0, 0);
  int64_t xs[4] = {1, 2, 6, 6}, ws[4] = {3, 2, 3, 3};
  double *xv = tu_rand_vals(tu_xorshift, &rng_state, 72, 1.0), *wv = tu_rand_vals(tu_xorshift, &rng_state, 54, 1.0);
  dlua_tensor_t *x = tu_make(4, xs, DLUA_DTYPE_F32, xv), *w = tu_make(4, ws, DLUA_DTYPE_F32, wv);
  for (int rep = 0; rep < 3; rep++) {
    dlua_tensor_t *y = NULL;
    ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 1, 1, 1, 1, 1), DLUA_OK);
    dlua_tensor_free(y);
  }
  dlua_conv_cache_stats(&n0, &h1, &m1);
  ck_assert_int_eq(n0, 1);
  ck_assert_int_eq(m1 - m0, 1);
  ck_assert_int_eq(h1 - h0, 2);
  // A bound of 2 keeps the two most recent problems (here: paddings 0..3).
  dlua_conv_cache_set_capacity(2);
  for (int pad = 0; pad < 4; pad++) {
    dlua_tensor_t *y = NULL;
    ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, pad, pad, 1, 1, 1), DLUA_OK);
    dlua_tensor_free(y);
  }
  dlua_conv_cache_stats(&n0, &h0, &m0);
  ck_assert_int_eq(n0, 2);
  dlua_tensor_t *y = NULL;
  ck_assert_int_eq(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 3, 3, 1, 1, 1), DLUA_OK);  // still cached
  dlua_conv_cache_stats(&n0, &h1, &m1);
  ck_assert_int_eq(h1 - h0, 1);
  ck_assert_int_eq(m1 - m0, 0);
  dlua_tensor_free(y);
  dlua_conv_cache_set_capacity(256);
  dlua_conv_cache_clear();
  dlua_conv_cache_stats(&n0, NULL, NULL);
  ck_assert_int_eq(n0, 0);
  free(xv), free(wv);
  dlua_tensor_free(x), dlua_tensor_free(w);
}
END_TEST

/* ---- errors ----------------------------------------------------------------------------------- */

START_TEST(test_errors) {
  int64_t xs[4] = {2, 4, 5, 5}, ws[4] = {6, 2, 3, 3}, x3[3] = {4, 5, 5}, bs = 5, ys_bad[4] = {2, 6, 4, 5};
  dlua_tensor_t *x = NULL, *w = NULL, *xr = NULL, *wd = NULL, *b = NULL, *xi = NULL, *y = NULL, *gy = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&x, 4, xs, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&w, 4, ws, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&xr, 3, x3, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&wd, 4, ws, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&b, 1, &bs, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&xi, 4, xs, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&gy, 4, ys_bad, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);

  expect_error(dlua_conv2d_forward(&y, xr, w, NULL, 1, 1, 0, 0, 1, 1, 2), "conv2d:", "(4, 5, 5)", "4 dimensions");
  // groups 1: the weight wants 2 channels, the input has 4.
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 0, 0, 1, 1, 1), "conv2d:", "(2, 4, 5, 5)", "(6, 2, 3, 3)");
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "groups = 1"));
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 0, 0, 1, 1, 4), "conv2d:", "not divisible by groups = 4", NULL);
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 0, 0, 3, 3, 2), "conv2d:", "output size", "(2, 4, 5, 5)");
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 0, 1, 0, 0, 1, 1, 2), "conv2d:", "stride (0, 1)", NULL);
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, -1, 0, 1, 1, 2), "conv2d:", "padding", NULL);
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 0, 0, 1, 0, 2), "conv2d:", "dilation (1, 0)", NULL);
  expect_error(dlua_conv2d_forward(&y, x, w, NULL, 1, 1, 0, 0, 1, 1, 0), "conv2d:", "groups", NULL);
  expect_error(dlua_conv2d_forward(&y, x, wd, NULL, 1, 1, 0, 0, 1, 1, 2), "conv2d:", "float32", "float64");
  expect_error(dlua_conv2d_forward(&y, x, w, b, 1, 1, 0, 0, 1, 1, 2), "conv2d:", "bias (5)", "(6, 2, 3, 3)");
  expect_error(dlua_conv2d_forward(&y, xi, w, NULL, 1, 1, 0, 0, 1, 1, 2), "conv2d:", "floating point", "int32");
  ck_assert_ptr_null(y);
  // A given output of the wrong shape.
  dlua_tensor_t *bad_out = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&bad_out, 4, xs, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  expect_error(dlua_conv2d_forward(&bad_out, x, w, NULL, 1, 1, 0, 0, 1, 1, 2), "conv2d:", "(2, 6, 3, 3)", NULL);

  dlua_tensor_t *gx = NULL;
  expect_error(dlua_conv2d_backward_data(&gx, gy, w, xs, 1, 1, 0, 0, 1, 1, 1, 1), "conv2d_backward_data:",
               "accumulate needs a grad_input", NULL);
  expect_error(dlua_conv2d_backward_data(&gx, gy, w, xs, 1, 1, 0, 0, 1, 1, 2, 0), "conv2d_backward_data:", "(2, 6, 4, 5)",
               "(2, 6, 3, 3)");
  int64_t xs_bad[4] = {2, 3, 5, 5};
  expect_error(dlua_conv2d_backward_data(&gx, gy, w, xs_bad, 1, 1, 0, 0, 1, 1, 2, 0), "conv2d_backward_data:",
               "(2, 3, 5, 5)", "(6, 2, 3, 3)");
  expect_error(dlua_conv2d_backward_weights(w, NULL, x, gy, 1, 1, 0, 0, 1, 1, 2, 1), "conv2d_backward_weights:",
               "(2, 6, 4, 5)", NULL);
  expect_error(dlua_conv2d_backward_weights(w, b, x, gy, 1, 1, 0, 0, 1, 1, 2, 1), "conv2d_backward_weights:", "(5)",
               NULL);
  ck_assert_int_eq(dlua_conv2d_backward_weights(NULL, NULL, x, gy, 1, 1, 0, 0, 1, 1, 2, 1), DLUA_ERR_ARG);
  ck_assert_ptr_null(gx);

  dlua_tensor_free(x), dlua_tensor_free(w), dlua_tensor_free(xr), dlua_tensor_free(wd), dlua_tensor_free(b);
  dlua_tensor_free(xi), dlua_tensor_free(gy), dlua_tensor_free(bad_out);
}
END_TEST

/* The front doors reach the kernels through the conv table (kernels/conv.h): the CPU's is dlua_cpu_conv_ops, its
   slots run on a descriptor alone, and a tensor on device 0 without a CUDA device gets the registry's one message. */
START_TEST(test_backend_table) {
  const struct dlua_conv_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("conv2d", DLUA_CPU, conv, forward, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_conv_ops);
  ck_assert_ptr_nonnull(k->backward_data);
  ck_assert_ptr_nonnull(k->backward_weights);
  // A 1 x 1 x 2 x 2 float64 input, one 2 x 2 kernel, bias 0.5: y = 1*1 + 2*0 + 3*(-1) + 4*2 + 0.5 = 6.5.
  const double xv[4] = {1, 2, 3, 4}, wv[4] = {1, 0, -1, 2}, bv[1] = {0.5};
  double y = 0;
  dlua_conv_desc_t d = {.dtype = DLUA_DTYPE_F64, .param_dtype = DLUA_DTYPE_F64, .n = 1, .c = 1, .h = 2, .w = 2,
                        .o = 1, .kh = 2, .kw = 2, .oh = 1, .ow = 1, .sh = 1, .sw = 1, .dh = 1, .dw = 1, .groups = 1,
                        .x = (void *)xv, .wt = (void *)wv, .y = &y, .bias = (void *)bv, .xs = {4, 4, 2, 1},
                        .ws = {4, 4, 2, 1}, .ys = {1, 1, 1, 1}, .bs = 1, .xfmt = ACT_CONTIG, .wfmt = ACT_CONTIG,
                        .yfmt = ACT_CONTIG, .device = DLUA_CPU};
  dlua_conv_caps_t caps;
  ck_assert_int_eq(k->caps("conv2d", &d, &caps), DLUA_OK);
  ck_assert_int_eq(caps.dtype, DLUA_DTYPE_F64);
  ck_assert_int_eq(caps.one_format, 0);
  ck_assert_int_eq(caps.bias, 1);
  ck_assert_int_eq(k->forward("conv2d", &d), DLUA_OK);
  ck_assert(y == 6.5);
  // The weight gradient of that y for grad_y = 1 is x itself, the bias gradient 1; accumulated into 10s.
  double gw[4] = {10, 10, 10, 10}, gb[1] = {10}, gy[1] = {1};
  dlua_conv_desc_t e = d;
  e.y = gy, e.wt = gw, e.bias = gb, e.acc = 1, e.acc_bias = 1;
  ck_assert_int_eq(k->backward_weights("conv2d_backward_weights", &e), DLUA_OK);
  ck_assert(gw[0] == 11 && gw[1] == 12 && gw[2] == 13 && gw[3] == 14 && gb[0] == 11);

  const int64_t xs[4] = {1, 1, 2, 2};
  const int64_t ys1[4] = {1, 1, 1, 1};
  dlua_tensor_t *x = NULL, *y1 = NULL, *out = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&x, 4, xs, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&y1, 4, ys1, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  if (dlua_cuda_device_count() > 0) {
    const dlua_backend_t *be = NULL;
    ck_assert_int_eq(dlua_backend_for("conv2d", 0, &be), DLUA_OK);
    ck_assert_int_eq(DLUA_BACKEND("conv2d", 0, conv, forward, &k), DLUA_OK);
    ck_assert_ptr_eq(k, be->conv);
    ck_assert_int_eq(k->caps("conv2d", &d, &caps), DLUA_OK);
    ck_assert_int_eq(caps.one_format, 1);
  } else {
    // A handle claiming device 0 (never dereferenced: the registry answers before any kernel runs).
    dlua_tensor_t on0 = *x, y0 = *y1;
    on0.device = y0.device = 0;
    expect_error(dlua_conv2d_forward(&out, &on0, &on0, NULL, 1, 1, 0, 0, 1, 1, 1), "conv2d:",
                 "no CUDA device available (", NULL);
    expect_error(dlua_conv2d_backward_data(&out, &y0, &on0, xs, 1, 1, 0, 0, 1, 1, 1, 0), "conv2d_backward_data:",
                 "no CUDA device available (", NULL);
    expect_error(dlua_conv2d_backward_weights(&on0, NULL, &on0, &y0, 1, 1, 0, 0, 1, 1, 1, 0),
                 "conv2d_backward_weights:", "no CUDA device available (", NULL);
    ck_assert_ptr_null(out);
  }
  dlua_tensor_free(x);
  dlua_tensor_free(y1);
}
END_TEST

static Suite *conv_suite(void) {
  Suite *s = suite_create("conv");
  TCase *tc = tcase_create("conv");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_against_naive_f32);
  tcase_add_test(tc, test_against_naive_f64);
  tcase_add_test(tc, test_against_naive_half);
  tcase_add_test(tc, test_finite_differences);
  tcase_add_test(tc, test_accumulate_doubles);
  tcase_add_test(tc, test_noncontiguous_operands);
  tcase_add_test(tc, test_empty);
  tcase_add_test(tc, test_output_size);
  tcase_add_test(tc, test_strided_1x1_channels_last_threads);
  tcase_add_test(tc, test_f64_thread_independent);
  tcase_add_test(tc, test_primitive_cache);
  tcase_add_test(tc, test_errors);
  tcase_add_test(tc, test_backend_table);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  return tu_run(conv_suite());
}

/* Batch-norm kernels for one scalar type: batchnorm.c includes this once per T (float, double) with FN naming the copies. */
/* No include guard on purpose: each inclusion instantiates the kernels for another T.

   Inner loops live in always-inline helpers taking their options (ReLU mask, skip, which
   outputs) as arguments; callers pass literal constants, so each combination compiles to a
   branch-free loop the vectoriser takes. Every value is loaded unconditionally for the same
   reason: a load under a condition keeps a loop scalar. */

/* ---- statistics ---------------------------------------------------------------------------------- */

/* Per-channel sums of (x - shift) and (x - shift)^2 in double. Shifting by a sample of the
   channel keeps the one-pass variance accurate when |mean| >> std. Partial sums are taken per
   (n, c) plane (planar) or per fixed block of rows (channels-last) and added in a fixed order,
   so the result does not depend on the thread count. */
static void FN(bn_stats)(const bn_geom_t *g, const T *x, const double *shift, double *scratch, double *sum,
                         double *sumsq) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
    double *ps = scratch, *pq = scratch + P;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const T *xp = x + p * S;
      const double k = shift[p % C];
      double s = 0, q = 0;
#pragma omp simd reduction(+ : s, q)
      for (int64_t i = 0; i < S; i++) {
        double d = (double)xp[i] - k;
        s += d;
        q += d * d;
      }
      ps[p] = s;
      pq[p] = q;
    }
    bn_combine(ps, pq, g->N, C, sum, sumsq);
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
  double *ps = scratch, *pq = scratch + nb * C;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    double *bs = ps + b * C, *bq = pq + b * C;
    for (int64_t c = 0; c < C; c++) bs[c] = bq[c] = 0;
    const int64_t r1 = b * R + R < M ? b * R + R : M;
    for (int64_t r = b * R; r < r1; r++) {
      const T *xr = x + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; c++) {
        double d = (double)xr[c] - shift[c];
        bs[c] += d;
        bq[c] += d * d;
      }
    }
  }
  bn_combine(ps, pq, nb, C, sum, sumsq);
}

/* ---- normalise ------------------------------------------------------------------------------------ */

/* One run of n values of one channel: y = act((x - m) * a + b (+ s)). */
static inline __attribute__((always_inline)) void FN(apply_run)(int64_t n, const T *x, const T *s, T *y, T m, T a, T b,
                                                                int has_skip, int relu) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    T v = (x[i] - m) * a + b;
    if (has_skip) v += s[i];
    if (relu) v = v < 0 ? (T)0 : v;
    y[i] = v;
  }
}

/* One row of C channels. */
static inline __attribute__((always_inline)) void FN(apply_row)(int64_t C, const T *x, const T *s, T *y, const T *m,
                                                                const T *a, const T *b, int has_skip, int relu) {
#pragma omp simd
  for (int64_t c = 0; c < C; c++) {
    T v = (x[c] - m[c]) * a[c] + b[c];
    if (has_skip) v += s[c];
    if (relu) v = v < 0 ? (T)0 : v;
    y[c] = v;
  }
}

#define BN_APPLY_DISPATCH(call, skip, relu) \
  do {                                      \
    if (skip) {                             \
      if (relu) call(1, 1);                 \
      else call(1, 0);                      \
    } else {                                \
      if (relu) call(0, 1);                 \
      else call(0, 0);                      \
    }                                       \
  } while (0)

/* y = act((x - mean) * a + beta + skip): a = gamma * invstd; skip may be NULL. y may be x. */
static void FN(bn_apply)(const bn_geom_t *g, const T *x, const T *skip, T *y, const T *mean, const T *a,
                         const T *beta, int relu) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const int64_t c = p % C;
      const T *xp = x + p * S, *sp = skip ? skip + p * S : NULL;
      T *yp = y + p * S;
#define BN_CALL(k, r) FN(apply_run)(S, xp, sp, yp, mean[c], a[c], beta[c], k, r)
      BN_APPLY_DISPATCH(BN_CALL, sp, relu);
#undef BN_CALL
    }
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M;
    for (int64_t r = b * R; r < r1; r++) {
      const T *xr = x + r * C, *sr = skip ? skip + r * C : NULL;
      T *yr = y + r * C;
#define BN_CALL(k, rl) FN(apply_row)(C, xr, sr, yr, mean, a, beta, k, rl)
      BN_APPLY_DISPATCH(BN_CALL, sr, relu);
#undef BN_CALL
    }
  }
}

/* ---- backward ------------------------------------------------------------------------------------- */

/* d where y > 0, else +0, by masking the bits: a select here leaves GCC's if-conversion
   unable to vectorise the float reductions below. */
static inline __attribute__((always_inline)) T FN(relu_mask)(T y, T d) {
  UT bits;
  memcpy(&bits, &d, sizeof bits);
  bits &= (UT)0 - (UT)(y > 0);
  memcpy(&d, &bits, sizeof d);
  return d;
}

/* Sums of d and d * (x - m) over a run of one channel, d = dy masked by y > 0 when mask. */
static inline __attribute__((always_inline)) void FN(reduce_run)(int64_t n, const T *x, const T *dy, const T *y, T m,
                                                                 double *s_out, double *q_out, int mask) {
  double s = 0, q = 0;
#pragma omp simd reduction(+ : s, q)
  for (int64_t i = 0; i < n; i++) {
    T d = dy[i];
    if (mask) d = FN(relu_mask)(y[i], d);
    // The product in T, the sums in double: GCC keeps a float select feeding double
    // arithmetic scalar (it may trap), and one rounding per term is harmless here.
    s += d;
    q += d * (x[i] - m);
  }
  *s_out = s;
  *q_out = q;
}

static inline __attribute__((always_inline)) void FN(reduce_row)(int64_t C, const T *x, const T *dy, const T *y,
                                                                 const T *m, double *bs, double *bq, int mask) {
#pragma omp simd
  for (int64_t c = 0; c < C; c++) {
    T d = dy[c];
    if (mask) d = FN(relu_mask)(y[c], d);
    bs[c] += d;
    bq[c] += d * (x[c] - m[c]);
  }
}

/* Per-channel sum(d) and sum(d * (x - mean)) in double, d = masked dy; blocked like bn_stats. */
static void FN(bn_bwd_reduce)(const bn_geom_t *g, const T *x, const T *dy, const T *y, const T *mean,
                              double *scratch, double *sdy, double *sdx) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
    double *ps = scratch, *pq = scratch + P;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const T *xp = x + p * S, *dp = dy + p * S, *yp = y ? y + p * S : NULL;
      if (yp) FN(reduce_run)(S, xp, dp, yp, mean[p % C], &ps[p], &pq[p], 1);
      else FN(reduce_run)(S, xp, dp, yp, mean[p % C], &ps[p], &pq[p], 0);
    }
    bn_combine(ps, pq, g->N, C, sdy, sdx);
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
  double *ps = scratch, *pq = scratch + nb * C;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    double *bs = ps + b * C, *bq = pq + b * C;
    for (int64_t c = 0; c < C; c++) bs[c] = bq[c] = 0;
    const int64_t r1 = b * R + R < M ? b * R + R : M;
    for (int64_t r = b * R; r < r1; r++) {
      const T *xr = x + r * C, *dr = dy + r * C, *yr = y ? y + r * C : NULL;
      if (yr) FN(reduce_row)(C, xr, dr, yr, mean, bs, bq, 1);
      else FN(reduce_row)(C, xr, dr, yr, mean, bs, bq, 0);
    }
  }
  bn_combine(ps, pq, nb, C, sdy, sdx);
}

/* dx = d * A + (x - m) * B + D and ds = d over a run of one channel (d = masked dy). Each
   element is read before either output is written, so dx or ds may be dy itself. */
static inline __attribute__((always_inline)) void FN(bwd_run)(int64_t n, const T *x, const T *dy, const T *y, T *dx,
                                                              T *ds, T m, T A, T B, T D, int mask, int want_dx,
                                                              int want_ds) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    T d = dy[i];
    if (mask) d = FN(relu_mask)(y[i], d);
    T v = d * A + (x[i] - m) * B + D;
    if (want_ds) ds[i] = d;
    if (want_dx) dx[i] = v;
  }
}

static inline __attribute__((always_inline)) void FN(bwd_row)(int64_t C, const T *x, const T *dy, const T *y, T *dx,
                                                              T *ds, const T *m, const T *A, const T *B, const T *D,
                                                              int mask, int want_dx, int want_ds) {
#pragma omp simd
  for (int64_t c = 0; c < C; c++) {
    T d = dy[c];
    if (mask) d = FN(relu_mask)(y[c], d);
    T v = d * A[c] + (x[c] - m[c]) * B[c] + D[c];
    if (want_ds) ds[c] = d;
    if (want_dx) dx[c] = v;
  }
}

#define BN_BWD_DISPATCH(call, mask, gx, gs) \
  do {                                      \
    if (mask) {                             \
      if (gx && gs) call(1, 1, 1);          \
      else if (gx) call(1, 1, 0);           \
      else call(1, 0, 1);                   \
    } else {                                \
      if (gx && gs) call(0, 1, 1);          \
      else if (gx) call(0, 1, 0);           \
      else call(0, 0, 1);                   \
    }                                       \
  } while (0)

/* dx = d * A + (x - mean) * B + D and dskip = d, d = masked dy; one of dx, dskip may be NULL. */
static void FN(bn_bwd_apply)(const bn_geom_t *g, const T *x, const T *dy, const T *y, T *dx, T *dskip,
                             const T *mean, const T *A, const T *B, const T *D) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const int64_t c = p % C;
      const T *xp = x + p * S, *dp = dy + p * S, *yp = y ? y + p * S : NULL;
      T *gp = dx ? dx + p * S : NULL, *sp = dskip ? dskip + p * S : NULL;
#define BN_CALL(mk, wx, ws) FN(bwd_run)(S, xp, dp, yp, gp, sp, mean[c], A[c], B[c], D[c], mk, wx, ws)
      BN_BWD_DISPATCH(BN_CALL, yp, gp, sp);
#undef BN_CALL
    }
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M;
    for (int64_t r = b * R; r < r1; r++) {
      const T *xr = x + r * C, *dr = dy + r * C, *yr = y ? y + r * C : NULL;
      T *gr = dx ? dx + r * C : NULL, *sr = dskip ? dskip + r * C : NULL;
#define BN_CALL(mk, wx, ws) FN(bwd_row)(C, xr, dr, yr, gr, sr, mean, A, B, D, mk, wx, ws)
      BN_BWD_DISPATCH(BN_CALL, yr, gr, sr);
#undef BN_CALL
    }
  }
}

#undef BN_APPLY_DISPATCH
#undef BN_BWD_DISPATCH

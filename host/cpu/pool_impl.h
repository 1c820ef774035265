/* Pooling kernels for one scalar type: pool.c includes this once per T (float, double) with FN naming the copies. */
/* No include guard on purpose: each inclusion instantiates the kernels for another T. */

/* Max pooling. Windows start at o * stride - pad and step by dil; padding never wins, NaN
   does (the last one, as PyTorch), and an all -Inf window reports its first in-bounds position. Every output
   is computed by one thread alone, so results do not depend on the thread count. */
static void FN(maxpool_fwd)(const pool_geom_t *g, const T *x, T *y, int64_t *ind) {
  const int64_t C = g->C, H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  if (!g->cl) {
#pragma omp parallel for schedule(static) if (g->N * C * OH * OW * g->kh * g->kw > POOL_PAR_MIN)
    for (int64_t p = 0; p < g->N * C; p++) {
      const T *xp = x + p * H * W;
      T *yp = y + p * OH * OW;
      int64_t *ip = ind ? ind + p * OH * OW : NULL;
      for (int64_t oh = 0; oh < OH; oh++) {
        int64_t h0 = oh * g->sh - g->ph;
        while (h0 < 0) h0 += g->dh;
        const int64_t h1 = oh * g->sh - g->ph + (g->kh - 1) * g->dh + 1;
        for (int64_t ow = 0; ow < OW; ow++) {
          int64_t w0 = ow * g->sw - g->pw;
          while (w0 < 0) w0 += g->dw;
          const int64_t w1 = ow * g->sw - g->pw + (g->kw - 1) * g->dw + 1;
          T best = -(T)INFINITY;
          int64_t bi = h0 * W + w0;
          for (int64_t ih = h0; ih < h1 && ih < H; ih += g->dh)
            for (int64_t iw = w0; iw < w1 && iw < W; iw += g->dw) {
              // Selects, not a branch: which element wins is data-dependent and unpredictable.
              T v = xp[ih * W + iw];
              int take = v > best || v != v;
              best = take ? v : best;
              bi = take ? ih * W + iw : bi;
            }
          yp[oh * OW + ow] = best;
          if (ip) ip[oh * OW + ow] = bi;
        }
      }
    }
    return;
  }
#pragma omp parallel for schedule(static) if (g->N * C * OH * OW * g->kh * g->kw > POOL_PAR_MIN)
  for (int64_t r = 0; r < g->N * OH; r++) {
    const int64_t n = r / OH, oh = r % OH;
    int64_t h0 = oh * g->sh - g->ph;
    while (h0 < 0) h0 += g->dh;
    const int64_t h1 = oh * g->sh - g->ph + (g->kh - 1) * g->dh + 1;
    for (int64_t ow = 0; ow < OW; ow++) {
      int64_t w0 = ow * g->sw - g->pw;
      while (w0 < 0) w0 += g->dw;
      const int64_t w1 = ow * g->sw - g->pw + (g->kw - 1) * g->dw + 1;
      T *yr = y + (r * OW + ow) * C;
      int64_t *ir = ind ? ind + (r * OW + ow) * C : NULL;
      const int64_t first = h0 * W + w0;
      for (int64_t c = 0; c < C; c++) yr[c] = -(T)INFINITY;
      if (ir)
        for (int64_t c = 0; c < C; c++) ir[c] = first;
      for (int64_t ih = h0; ih < h1 && ih < H; ih += g->dh)
        for (int64_t iw = w0; iw < w1 && iw < W; iw += g->dw) {
          const T *xr = x + ((n * H + ih) * W + iw) * C;
          const int64_t pos = ih * W + iw;
          if (ir) {
            for (int64_t c = 0; c < C; c++) {
              T v = xr[c];
              int take = v > yr[c] || v != v;
              yr[c] = take ? v : yr[c];
              ir[c] = take ? pos : ir[c];
            }
          } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) {
              T v = xr[c], b = yr[c];
              yr[c] = v > b || v != v ? v : b;
            }
          }
        }
    }
  }
}

/* grad_x (zeroed here) += grad_y at the saved positions; returns 0, or 1 for an index outside
   its plane (grad_x is then incomplete). */
static int FN(maxpool_bwd)(const pool_geom_t *g, const T *gy, const int64_t *ind, T *gx) {
  const int64_t C = g->C, HW = g->H * g->W, OHW = g->OH * g->OW;
  int bad = 0;
  if (!g->cl) {
#pragma omp parallel for schedule(static) if (g->N * C * (HW + OHW) > POOL_PAR_MIN) reduction(| : bad)
    for (int64_t p = 0; p < g->N * C; p++) {
      T *gp = gx + p * HW;
      const T *dp = gy + p * OHW;
      const int64_t *ip = ind + p * OHW;
      for (int64_t i = 0; i < HW; i++) gp[i] = 0;
      for (int64_t i = 0; i < OHW; i++) {
        if (ip[i] < 0 || ip[i] >= HW) {
          bad = 1;
          continue;
        }
        gp[ip[i]] += dp[i];
      }
    }
    return bad;
  }
#pragma omp parallel for schedule(static) if (g->N * C * (HW + OHW) > POOL_PAR_MIN) reduction(| : bad)
  for (int64_t n = 0; n < g->N; n++) {
    T *gp = gx + n * HW * C;
    const T *dp = gy + n * OHW * C;
    const int64_t *ip = ind + n * OHW * C;
    for (int64_t i = 0; i < HW * C; i++) gp[i] = 0;
    for (int64_t o = 0; o < OHW; o++)
      for (int64_t c = 0; c < C; c++) {
        const int64_t k = ip[o * C + c];
        if (k < 0 || k >= HW) {
          bad = 1;
          continue;
        }
        gp[k * C + c] += dp[o * C + c];
      }
  }
  return bad;
}

/* Average pooling over windows [hs, he) x [ws, we) given per output row/column; the divisor
   is div_override, or hd[oh] * wd[ow]. An empty window gives 0. */
static void FN(avgpool_fwd)(const pool_geom_t *g, const pool_win_t *win, const T *x, T *y) {
  const int64_t C = g->C, H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  if (!g->cl) {
#pragma omp parallel for schedule(static) if (g->N * C * H * W > POOL_PAR_MIN)
    for (int64_t p = 0; p < g->N * C; p++) {
      const T *xp = x + p * H * W;
      T *yp = y + p * OH * OW;
      for (int64_t oh = 0; oh < OH; oh++)
        for (int64_t ow = 0; ow < OW; ow++) {
          T s = 0;
          for (int64_t ih = win->hs[oh]; ih < win->he[oh]; ih++) {
            const T *row = xp + ih * W;
#pragma omp simd reduction(+ : s)
            for (int64_t iw = win->ws[ow]; iw < win->we[ow]; iw++) s += row[iw];
          }
          const int64_t div = win->div_override > 0 ? win->div_override : win->hd[oh] * win->wd[ow];
          yp[oh * OW + ow] = win->hs[oh] < win->he[oh] && win->ws[ow] < win->we[ow] ? s / (T)div : (T)0;
        }
    }
    return;
  }
#pragma omp parallel for schedule(static) if (g->N * C * H * W > POOL_PAR_MIN)
  for (int64_t r = 0; r < g->N * OH; r++) {
    const int64_t n = r / OH, oh = r % OH;
    for (int64_t ow = 0; ow < OW; ow++) {
      T *yr = y + (r * OW + ow) * C;
      for (int64_t c = 0; c < C; c++) yr[c] = 0;
      for (int64_t ih = win->hs[oh]; ih < win->he[oh]; ih++)
        for (int64_t iw = win->ws[ow]; iw < win->we[ow]; iw++) {
          const T *xr = x + ((n * H + ih) * W + iw) * C;
#pragma omp simd
          for (int64_t c = 0; c < C; c++) yr[c] += xr[c];
        }
      if (win->hs[oh] < win->he[oh] && win->ws[ow] < win->we[ow]) {
        const T div = (T)(win->div_override > 0 ? win->div_override : win->hd[oh] * win->wd[ow]);
#pragma omp simd
        for (int64_t c = 0; c < C; c++) yr[c] /= div;
      }
    }
  }
}

/* grad_x (zeroed here) += grad_y / divisor over each window. */
static void FN(avgpool_bwd)(const pool_geom_t *g, const pool_win_t *win, const T *gy, T *gx) {
  const int64_t C = g->C, H = g->H, W = g->W, OH = g->OH, OW = g->OW;
  if (!g->cl) {
#pragma omp parallel for schedule(static) if (g->N * C * H * W > POOL_PAR_MIN)
    for (int64_t p = 0; p < g->N * C; p++) {
      T *gp = gx + p * H * W;
      const T *dp = gy + p * OH * OW;
      for (int64_t i = 0; i < H * W; i++) gp[i] = 0;
      for (int64_t oh = 0; oh < OH; oh++)
        for (int64_t ow = 0; ow < OW; ow++) {
          const int64_t div = win->div_override > 0 ? win->div_override : win->hd[oh] * win->wd[ow];
          const T v = dp[oh * OW + ow] / (T)div;
          for (int64_t ih = win->hs[oh]; ih < win->he[oh]; ih++)
            for (int64_t iw = win->ws[ow]; iw < win->we[ow]; iw++) gp[ih * W + iw] += v;
        }
    }
    return;
  }
#pragma omp parallel for schedule(static) if (g->N * C * H * W > POOL_PAR_MIN)
  for (int64_t n = 0; n < g->N; n++) {
    T *gp = gx + n * H * W * C;
    const T *dp = gy + n * OH * OW * C;
    for (int64_t i = 0; i < H * W * C; i++) gp[i] = 0;
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        const T div = (T)(win->div_override > 0 ? win->div_override : win->hd[oh] * win->wd[ow]);
        const T *dr = dp + (oh * OW + ow) * C;
        for (int64_t ih = win->hs[oh]; ih < win->he[oh]; ih++)
          for (int64_t iw = win->ws[ow]; iw < win->we[ow]; iw++) {
            T *gr = gp + (ih * W + iw) * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) gr[c] += dr[c] / div;
          }
      }
  }
}

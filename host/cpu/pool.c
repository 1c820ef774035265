/* The CPU pool kernels (kernels/pool.h): 2-D max, average and adaptive average pooling, forward and backward,
   in NCHW or channels-last memory. The front doors are host/ops/pool.c. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/pool.h"

/* Below this much work a loop runs on one thread: waking the pool costs more. */
enum { POOL_PAR_MIN = 32768 };

/* One call's geometry; cl: channels-last memory. */
typedef struct {
  int64_t N, C, H, W, OH, OW;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int cl;
} pool_geom_t;

/* Average-pool windows, separable: output row oh covers input rows [hs, he) and contributes
   the factor hd to the divisor, likewise for columns. */
typedef struct {
  int64_t *hs, *he, *hd, *ws, *we, *wd;
  int64_t div_override;
} pool_win_t;

#define POOL_CAT2(a, b) a##b
#define POOL_CAT(a, b) POOL_CAT2(a, b)
#define FN(name) POOL_CAT(name, POOL_SFX)

#define T float
#define POOL_SFX _f32
#include "cpu/pool_impl.h"
#undef T
#undef POOL_SFX

#define T double
#define POOL_SFX _f64
#include "cpu/pool_impl.h"
#undef T
#undef POOL_SFX

/* The kernels' geometry from the descriptor's. */
static pool_geom_t geom_of(const dlua_pool_geom_t *p) {
  pool_geom_t g = {.N = p->N, .C = p->C, .H = p->H, .W = p->W, .OH = p->OH, .OW = p->OW, .kh = p->kh, .kw = p->kw,
                   .sh = p->sh, .sw = p->sw, .ph = p->ph, .pw = p->pw, .dh = p->dh, .dw = p->dw, .cl = p->cl};
  return g;
}

/* ---- average windows ------------------------------------------------------------------------------ */

static dlua_status_t win_alloc(const char *op, pool_win_t *w, int64_t OH, int64_t OW) {
  size_t n = (size_t)(3 * (OH + OW)) * sizeof(int64_t);
  int64_t *p = malloc(n ? n : 1);
  if (!p) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, n);
  w->hs = p, w->he = p + OH, w->hd = p + 2 * OH;
  w->ws = p + 3 * OH, w->we = w->ws + OW, w->wd = w->we + OW;
  w->div_override = 0;
  return DLUA_OK;
}

/* PyTorch's avg_pool2d windows along one axis: [o*s - p, min(o*s - p + k, in + p)) clipped to
   the input; the divisor factor counts the padded extent or only the clipped one. */
static void avg_axis(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, int include_pad, int64_t *st, int64_t *en,
                     int64_t *dv) {
  for (int64_t o = 0; o < out; o++) {
    int64_t a = o * s - p, e = a + k < in + p ? a + k : in + p;
    int64_t padded = e - a;
    if (a < 0) a = 0;
    if (e > in) e = in;
    st[o] = a;
    en[o] = e;
    dv[o] = include_pad ? padded : e - a;
  }
}

/* Adaptive windows: [floor(o * in / out), ceil((o + 1) * in / out)). */
static void adaptive_axis(int64_t in, int64_t out, int64_t *st, int64_t *en, int64_t *dv) {
  for (int64_t o = 0; o < out; o++) {
    st[o] = o * in / out;
    en[o] = ((o + 1) * in + out - 1) / out;
    dv[o] = en[o] - st[o];
  }
}

/* The windows of an average (or adaptive) pooling p; w->hs owns them. */
static dlua_status_t win_of(const char *op, const dlua_pool_geom_t *p, pool_win_t *w) {
  DLUA_TRY(win_alloc(op, w, p->OH, p->OW));
  if (p->kind == DLUA_POOL_ADAPTIVE) {
    adaptive_axis(p->H, p->OH, w->hs, w->he, w->hd);
    adaptive_axis(p->W, p->OW, w->ws, w->we, w->wd);
  } else {
    avg_axis(p->H, p->OH, p->kh, p->sh, p->ph, p->include_pad, w->hs, w->he, w->hd);
    avg_axis(p->W, p->OW, p->kw, p->sw, p->pw, p->include_pad, w->ws, w->we, w->wd);
    w->div_override = p->div_override;
  }
  return DLUA_OK;
}

static dlua_status_t check_dtype(const char *op, int dtype) {
  if (dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_F64) return DLUA_OK;
  return DLUA_ERR(DLUA_ERR_ARG, "%s: the CPU pool kernels take float32 or float64 activations, got dtype %d", op, dtype);
}

/* ---- the slots ------------------------------------------------------------------------------------ */

static dlua_status_t cpu_pool_forward(const char *op, const dlua_pool_fwd_t *a) {
  DLUA_TRY(check_dtype(op, a->p.dtype));
  pool_geom_t g = geom_of(&a->p);
  const int f64 = a->p.dtype == DLUA_DTYPE_F64;
  if (a->p.kind == DLUA_POOL_MAX) {
    if (f64) maxpool_fwd_f64(&g, (const double *)a->x, (double *)a->y, a->ind);
    else maxpool_fwd_f32(&g, (const float *)a->x, (float *)a->y, a->ind);
    return DLUA_OK;
  }
  pool_win_t w;
  DLUA_TRY(win_of(op, &a->p, &w));
  if (f64) avgpool_fwd_f64(&g, &w, (const double *)a->x, (double *)a->y);
  else avgpool_fwd_f32(&g, &w, (const float *)a->x, (float *)a->y);
  free(w.hs);
  return DLUA_OK;
}

static dlua_status_t cpu_pool_backward(const char *op, const dlua_pool_bwd_t *a) {
  DLUA_TRY(check_dtype(op, a->p.dtype));
  pool_geom_t g = geom_of(&a->p);
  const int f64 = a->p.dtype == DLUA_DTYPE_F64;
  *a->bad = 0;
  if (a->p.kind == DLUA_POOL_MAX) {
    *a->bad = f64 ? maxpool_bwd_f64(&g, (const double *)a->gy, a->ind, (double *)a->gx)
                  : maxpool_bwd_f32(&g, (const float *)a->gy, a->ind, (float *)a->gx);
    return DLUA_OK;
  }
  pool_win_t w;
  DLUA_TRY(win_of(op, &a->p, &w));
  if (f64) avgpool_bwd_f64(&g, &w, (const double *)a->gy, (double *)a->gx);
  else avgpool_bwd_f32(&g, &w, (const float *)a->gy, (float *)a->gx);
  free(w.hs);
  return DLUA_OK;
}

const struct dlua_pool_ops dlua_cpu_pool_ops = {
    .native_16bit = 0,
    .forward = cpu_pool_forward,
    .backward = cpu_pool_backward,
};

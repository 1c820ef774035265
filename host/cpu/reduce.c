/* The CPU kernel of the reduce family (host/kernels/reduce.h): sum, mean, prod, max/min, arg*, norm, var/std,
   any/all, non-finite count over any set of dims of a strided input. The front door is host/ops/reduce.c. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/elementwise_ops.h"
#include "kernels/reduce.h"

/* Reduced elements are folded in blocks of RED_BLOCK (positions in the reduced index space,
   fixed by the shape alone) and block results are combined in block order, so a result is the
   same whichever thread folded which block. */
enum { RED_BLOCK = 16384, RED_LANES = 16, RED_CHAIN = 16, RED_COL_TILE = 64, RED_OUT_CHUNK = 256 };

/* One running value: double for float inputs, int64 for integer/bool inputs; idx for max/min. */
typedef struct {
  union {
    double d;
    int64_t i;
  } v;
  int64_t idx;
} acc_t;

/* The input seen as (kept dims) x (reduced dims), each coalesced; strides in elements. */
typedef struct {
  const char *base; /* element 0 of the input */
  int nk, nr;
  int64_t ksize[DLUA_MAX_DIMS], kstride[DLUA_MAX_DIMS]; /* kept dims, in output order */
  int64_t rsize[DLUA_MAX_DIMS], rstride[DLUA_MAX_DIMS]; /* reduced dims; nr >= 1 */
  int64_t O, R;
  double p;           /* norm order */
  const double *mean; /* (O) per-output mean, for the second pass of var/std */
} red_plan_t;

typedef void (*fold_fn)(const red_plan_t *pl, int64_t o_lo, int64_t o_hi, int64_t r_lo, int64_t r_hi, acc_t *dst);

static inline int64_t kept_offset(const red_plan_t *pl, int64_t o) {
  int64_t off = 0;
  for (int d = pl->nk - 1; d >= 0; d--) {
    off += (o % pl->ksize[d]) * pl->kstride[d];
    o /= pl->ksize[d];
  }
  return off;
}

/* Walks reduced positions [lo, hi) (lo < hi) as runs along the innermost reduced dim: the body
   sees red_off (element offset of the run's start), red_s (its stride), red_n, red_pos. */
#define RED_RUNS_BEGIN(pl, lo, hi)                                       \
  {                                                                      \
    int64_t rr_idx[DLUA_MAX_DIMS], red_off = 0;                          \
    const int rr_nd = (pl)->nr;                                          \
    {                                                                    \
      int64_t rr_q = (lo);                                               \
      for (int d = rr_nd - 1; d >= 0; d--) {                             \
        rr_idx[d] = rr_q % (pl)->rsize[d];                               \
        rr_q /= (pl)->rsize[d];                                          \
        red_off += rr_idx[d] * (pl)->rstride[d];                         \
      }                                                                  \
    }                                                                    \
    const int64_t red_s = (pl)->rstride[rr_nd - 1];                      \
    const int64_t rr_last = (pl)->rsize[rr_nd - 1];                      \
    for (int64_t red_pos = (lo); red_pos < (hi);) {                      \
      int64_t red_n = rr_last - rr_idx[rr_nd - 1];                       \
      if (red_n > (hi)-red_pos) red_n = (hi)-red_pos;
#define RED_RUNS_END(pl)                                                         \
  red_pos += red_n;                                                              \
  {                                                                              \
    int d = rr_nd - 1;                                                           \
    rr_idx[d] += red_n;                                                          \
    red_off += red_n * (pl)->rstride[d];                                         \
    while (d > 0 && rr_idx[d] >= (pl)->rsize[d]) {                               \
      red_off += (pl)->rstride[d - 1] - rr_idx[d] * (pl)->rstride[d];            \
      rr_idx[d] = 0;                                                             \
      d--;                                                                       \
      rr_idx[d]++;                                                               \
    }                                                                            \
  }                                                                              \
  }                                                                              \
  }

/* ---- loads and per-dtype lists ------------------------------------------------------------ */

#define RED_DT_FLOAT(X, ...) \
  X(F32, float, d, __VA_ARGS__) X(F64, double, d, __VA_ARGS__) X(F16, uint16_t, d, __VA_ARGS__) X(BF16, uint16_t, d, __VA_ARGS__)
#define RED_DT_INT(X, ...) \
  X(I32, int32_t, i, __VA_ARGS__) X(I64, int64_t, i, __VA_ARGS__) X(U8, uint8_t, i, __VA_ARGS__) X(BOOL, uint8_t, i, __VA_ARGS__)
#define RED_DT_ALL(X, ...) RED_DT_FLOAT(X, __VA_ARGS__) RED_DT_INT(X, __VA_ARGS__)

#define LDR_F32(v) ((double)(v))
#define LDR_F64(v) (v)
#define LDR_F16(v) ((double)dlua_f16_to_f32_inl(v))
#define LDR_BF16(v) ((double)dlua_bf16_to_f32_inl(v))
#define LDR_I32(v) ((int64_t)(v))
#define LDR_I64(v) (v)
#define LDR_U8(v) ((int64_t)(v))
#define LDR_BOOL(v) ((int64_t)(v))

/* Which input dtypes get per-ISA clones of their folds (see DLUA_CPU_CLONES). */
#define RED_CLONES_F32 DLUA_CPU_CLONES
#define RED_CLONES_BF16 DLUA_CPU_CLONES
#define RED_CLONES_F64
#define RED_CLONES_F16
#define RED_CLONES_I32
#define RED_CLONES_I64
#define RED_CLONES_U8
#define RED_CLONES_BOOL

#define ACC_d double
#define ACC_i int64_t

/* Contiguous runs summed in RED_LANES independent double accumulators, so the adds vectorise
   and do not wait on one another; lanes are combined as a fixed tree (f64 input, and squared
   deviations of any float input). */
#define GEN_LANES(DT, ST, CS, what, EXPR)                                             \
  static inline double lanes_##what##_##DT(const ST *x, int64_t n, double mu) {       \
    double l[RED_LANES] = {0};                                                        \
    int64_t i = 0;                                                                    \
    for (; i + RED_LANES <= n; i += RED_LANES)                                        \
      for (int j = 0; j < RED_LANES; j++) {                                           \
        double v = LDR_##DT(x[i + j]);                                                \
        l[j] += EXPR;                                                                 \
      }                                                                               \
    double t = 0;                                                                     \
    for (; i < n; i++) {                                                              \
      double v = LDR_##DT(x[i]);                                                      \
      t += EXPR;                                                                      \
    }                                                                                 \
    for (int w = RED_LANES / 2; w > 0; w /= 2)                                        \
      for (int j = 0; j < w; j++) l[j] += l[j + w];                                   \
    return l[0] + t;                                                                  \
  }
/* Float inputs up to 32 bits: RED_LANES float lanes take RED_CHAIN steps each, then flush into
   double lanes. Float adds keep the loop as fast as memory (double conversion of every element
   halves the bandwidth); chains of RED_CHAIN adds bound the float rounding error to about
   RED_CHAIN * 2^-24 of the chunk's magnitude before double takes over. */
#define LDF_F32(v) (v)
#define LDF_F16(v) dlua_f16_to_f32_inl(v)
#define LDF_BF16(v) dlua_bf16_to_f32_inl(v)
#define GEN_LANES_F(DT, ST, CS, what, EXPR)                                           \
  static inline double lanes_##what##_##DT(const ST *x, int64_t n, double mu) {       \
    double l[RED_LANES] = {0};                                                        \
    int64_t i = 0;                                                                    \
    for (; i + RED_LANES * RED_CHAIN <= n; i += RED_LANES * RED_CHAIN) {              \
      float f[RED_LANES] = {0};                                                       \
      for (int k = 0; k < RED_CHAIN; k++)                                             \
        for (int j = 0; j < RED_LANES; j++) {                                         \
          float v = LDF_##DT(x[i + k * RED_LANES + j]);                               \
          f[j] += EXPR;                                                               \
        }                                                                             \
      for (int j = 0; j < RED_LANES; j++) l[j] += f[j];                               \
    }                                                                                 \
    double t = 0;                                                                     \
    for (; i < n; i++) {                                                              \
      float v = LDF_##DT(x[i]);                                                       \
      t += EXPR;                                                                      \
    }                                                                                 \
    for (int w = RED_LANES / 2; w > 0; w /= 2)                                        \
      for (int j = 0; j < w; j++) l[j] += l[j + w];                                   \
    return l[0] + t;                                                                  \
  }
#define RED_DT_F32ISH(X, ...) X(F32, float, d, __VA_ARGS__) X(F16, uint16_t, d, __VA_ARGS__) X(BF16, uint16_t, d, __VA_ARGS__)
RED_DT_F32ISH(GEN_LANES_F, sum, v)
RED_DT_F32ISH(GEN_LANES_F, abs, fabsf(v))
RED_DT_F32ISH(GEN_LANES_F, sq, v * v)
GEN_LANES(F64, double, d, sum, v)
GEN_LANES(F64, double, d, abs, fabs(v))
GEN_LANES(F64, double, d, sq, v * v)
/* Squared deviations stay in double: a float mean would shift every deviation by its rounding. */
RED_DT_FLOAT(GEN_LANES, dev, (v - mu) * (v - mu))

/* ---- fold ops: init value, per-element step (acc, x, position), contiguous-run shortcut --- */

#define RUN_GENERIC(DT, name, CS)                                   \
  for (int64_t i = 0; i < red_n; i++) {                             \
    STEP_##name##_##CS(acc, LDR_##DT(x[i * red_s]), red_pos + i);   \
  }
#define RUN_LANES(DT, name, CS, what)                               \
  if (red_s == 1) acc += lanes_##what##_##DT(x, red_n, mu);         \
  else RUN_GENERIC(DT, name, CS)

#define INIT_sum 0
#define STEP_sum_d(acc, x, r) acc += (x)
#define STEP_sum_i(acc, x, r) acc = (int64_t)((uint64_t)acc + (uint64_t)(x))
#define RUN_sum_d(DT) RUN_LANES(DT, sum, d, sum)
#define RUN_sum_i(DT) RUN_GENERIC(DT, sum, i)

#define INIT_prod 1
#define STEP_prod_d(acc, x, r) acc *= (x)
#define STEP_prod_i(acc, x, r) acc = (int64_t)((uint64_t)acc * (uint64_t)(x))
#define RUN_prod_d(DT) RUN_GENERIC(DT, prod, d)
#define RUN_prod_i(DT) RUN_GENERIC(DT, prod, i)

/* max/min keep the first best position; aidx < 0 means nothing seen yet. */
#define INIT_max 0
#define STEP_max_d(acc, x, r)                                        \
  {                                                                  \
    double v_ = (x);                                                 \
    if (aidx < 0 || dlua_red_max_better_d(v_, acc)) acc = v_, aidx = (r); \
  }
#define STEP_max_i(acc, x, r)                                        \
  {                                                                  \
    int64_t v_ = (x);                                                \
    if (aidx < 0 || v_ > acc) acc = v_, aidx = (r);                  \
  }
#define RUN_max_d(DT) RUN_GENERIC(DT, max, d)
#define RUN_max_i(DT) RUN_GENERIC(DT, max, i)
#define INIT_min 0
#define STEP_min_d(acc, x, r)                                        \
  {                                                                  \
    double v_ = (x);                                                 \
    if (aidx < 0 || dlua_red_min_better_d(v_, acc)) acc = v_, aidx = (r); \
  }
#define STEP_min_i(acc, x, r)                                        \
  {                                                                  \
    int64_t v_ = (x);                                                \
    if (aidx < 0 || v_ < acc) acc = v_, aidx = (r);                  \
  }
#define RUN_min_d(DT) RUN_GENERIC(DT, min, d)
#define RUN_min_i(DT) RUN_GENERIC(DT, min, i)

/* NaN counts as true, as in PyTorch (it is not zero). */
#define INIT_any 0
#define STEP_any_d(acc, x, r) acc |= ((x) != 0)
#define STEP_any_i(acc, x, r) acc |= ((x) != 0)
#define RUN_any_d(DT) RUN_GENERIC(DT, any, d)
#define RUN_any_i(DT) RUN_GENERIC(DT, any, i)
#define INIT_all 1
#define STEP_all_d(acc, x, r) acc &= ((x) != 0)
#define STEP_all_i(acc, x, r) acc &= ((x) != 0)
#define RUN_all_d(DT) RUN_GENERIC(DT, all, d)
#define RUN_all_i(DT) RUN_GENERIC(DT, all, i)

/* any/all keep an integer flag even for float inputs. */
#define ACCT_sum_d double
#define ACCT_sum_i int64_t
#define ACCT_prod_d double
#define ACCT_prod_i int64_t
#define ACCT_max_d double
#define ACCT_max_i int64_t
#define ACCT_min_d double
#define ACCT_min_i int64_t
#define ACCT_any_d int64_t
#define ACCT_any_i int64_t
#define ACCT_all_d int64_t
#define ACCT_all_i int64_t
#define ACCT_norm0_d double
#define ACCT_norm1_d double
#define ACCT_norm2_d double
#define ACCT_normp_d double
#define ACCT_norminf_d double
#define ACCT_sqdev_d double
#define ACCT_nonfinite_d int64_t
#define SLOT_double d
#define SLOT_int64_t i
#define SLOT_(T) SLOT_##T
#define SLOT(T) SLOT_(T)

#define INIT_norm0 0
#define STEP_norm0_d(acc, x, r) acc += ((x) != 0)
#define RUN_norm0_d(DT) RUN_GENERIC(DT, norm0, d)
#define INIT_norm1 0
#define STEP_norm1_d(acc, x, r) acc += fabs(x)
#define RUN_norm1_d(DT) RUN_LANES(DT, norm1, d, abs)
#define INIT_norm2 0
#define STEP_norm2_d(acc, x, r) \
  {                             \
    double v_ = (x);            \
    acc += v_ * v_;             \
  }
#define RUN_norm2_d(DT) RUN_LANES(DT, norm2, d, sq)
#define INIT_normp 0
#define STEP_normp_d(acc, x, r) acc += pow(fabs(x), pw)
#define RUN_normp_d(DT) RUN_GENERIC(DT, normp, d)
#define INIT_norminf 0
#define STEP_norminf_d(acc, x, r) acc = dlua_red_absmax_d(acc, (x))
#define RUN_norminf_d(DT) RUN_GENERIC(DT, norminf, d)
#define INIT_sqdev 0
#define STEP_sqdev_d(acc, x, r) \
  {                             \
    double v_ = (x) - mu;       \
    acc += v_ * v_;             \
  }
#define RUN_sqdev_d(DT) RUN_LANES(DT, sqdev, d, dev)
#define INIT_nonfinite 0
#define STEP_nonfinite_d(acc, x, r) acc += !isfinite(x)
#define RUN_nonfinite_d(DT) RUN_GENERIC(DT, nonfinite, d)

#define GEN_FOLD(DT, ST, CS, name)                                                                      \
  RED_CLONES_##DT static void fold_##name##_##DT(const red_plan_t *pl, int64_t o_lo, int64_t o_hi, int64_t r_lo,        \
                                 int64_t r_hi, acc_t *dst) {                                            \
    const double pw = pl->p;                                                                            \
    (void)pw;                                                                                           \
    for (int64_t o = o_lo; o < o_hi; o++) {                                                             \
      const ST *xb = (const ST *)pl->base + kept_offset(pl, o);                                         \
      const double mu = pl->mean ? pl->mean[o] : 0;                                                     \
      (void)mu;                                                                                         \
      ACCT_##name##_##CS acc = INIT_##name;                                                             \
      int64_t aidx = -1;                                                                                \
      if (r_lo < r_hi) {                                                                                \
        RED_RUNS_BEGIN(pl, r_lo, r_hi)                                                                  \
        const ST *x = xb + red_off;                                                                     \
        RUN_##name##_##CS(DT)                                                                           \
        RED_RUNS_END(pl)                                                                                \
      }                                                                                                 \
      dst[o - o_lo].v.SLOT(ACCT_##name##_##CS) = acc;                                                   \
      dst[o - o_lo].idx = aidx;                                                                         \
    }                                                                                                   \
  }

/* Sums whose reduced dims are outer to a contiguous kept dim (a column sum): a tile of adjacent
   outputs is accumulated together, so every load is used and the inner loop vectorises. Each
   output still adds its elements in reduced-position order, as the general fold would. */
#define GEN_COLSUM(DT, ST, CS, unused)                                                                   \
  RED_CLONES_##DT static void colsum_##DT(const red_plan_t *pl, int64_t o_lo, int64_t o_hi, int64_t r_lo, int64_t r_hi,  \
                          acc_t *dst) {                                                                  \
    const int64_t kin = pl->ksize[pl->nk - 1];                                                           \
    for (int64_t o = o_lo; o < o_hi;) {                                                                  \
      int64_t t = o_hi - o;                                                                              \
      if (t > RED_COL_TILE) t = RED_COL_TILE;                                                            \
      if (t > kin - o % kin) t = kin - o % kin;                                                          \
      const ST *xb = (const ST *)pl->base + kept_offset(pl, o);                                          \
      ACC_##CS acc[RED_COL_TILE];                                                                        \
      for (int64_t j = 0; j < t; j++) acc[j] = 0;                                                        \
      if (r_lo < r_hi) {                                                                                 \
        RED_RUNS_BEGIN(pl, r_lo, r_hi)                                                                   \
        for (int64_t i = 0; i < red_n; i++) {                                                            \
          const ST *x = xb + red_off + i * red_s;                                                        \
          _Pragma("omp simd") for (int64_t j = 0; j < t; j++) STEP_sum_##CS(acc[j], LDR_##DT(x[j]), 0);  \
        }                                                                                                \
        RED_RUNS_END(pl)                                                                                 \
      }                                                                                                  \
      for (int64_t j = 0; j < t; j++) {                                                                  \
        dst[o - o_lo + j].v.CS = acc[j];                                                                 \
        dst[o - o_lo + j].idx = -1;                                                                      \
      }                                                                                                  \
      o += t;                                                                                            \
    }                                                                                                    \
  }

RED_DT_ALL(GEN_FOLD, sum)
RED_DT_ALL(GEN_FOLD, prod)
RED_DT_ALL(GEN_FOLD, max)
RED_DT_ALL(GEN_FOLD, min)
RED_DT_ALL(GEN_FOLD, any)
RED_DT_ALL(GEN_FOLD, all)
RED_DT_FLOAT(GEN_FOLD, norm0)
RED_DT_FLOAT(GEN_FOLD, norm1)
RED_DT_FLOAT(GEN_FOLD, norm2)
RED_DT_FLOAT(GEN_FOLD, normp)
RED_DT_FLOAT(GEN_FOLD, norminf)
RED_DT_FLOAT(GEN_FOLD, sqdev)
RED_DT_FLOAT(GEN_FOLD, nonfinite)
RED_DT_ALL(GEN_COLSUM, x)

enum {
  F_SUM, F_PROD, F_MAX, F_MIN, F_ANY, F_ALL,
  F_NORM0, F_NORM1, F_NORM2, F_NORMP, F_NORMINF, F_SQDEV, F_NONFINITE, F_COLSUM,
  F_COUNT
};
#define FOLD_ENTRY(DT, ST, CS, name) [DLUA_DTYPE_##DT] = fold_##name##_##DT,
#define COLSUM_ENTRY(DT, ST, CS, unused) [DLUA_DTYPE_##DT] = colsum_##DT,
static const fold_fn fold_table[F_COUNT][DLUA_DTYPE_COUNT] = {
    [F_SUM] = {RED_DT_ALL(FOLD_ENTRY, sum)},
    [F_PROD] = {RED_DT_ALL(FOLD_ENTRY, prod)},
    [F_MAX] = {RED_DT_ALL(FOLD_ENTRY, max)},
    [F_MIN] = {RED_DT_ALL(FOLD_ENTRY, min)},
    [F_ANY] = {RED_DT_ALL(FOLD_ENTRY, any)},
    [F_ALL] = {RED_DT_ALL(FOLD_ENTRY, all)},
    [F_NORM0] = {RED_DT_FLOAT(FOLD_ENTRY, norm0)},
    [F_NORM1] = {RED_DT_FLOAT(FOLD_ENTRY, norm1)},
    [F_NORM2] = {RED_DT_FLOAT(FOLD_ENTRY, norm2)},
    [F_NORMP] = {RED_DT_FLOAT(FOLD_ENTRY, normp)},
    [F_NORMINF] = {RED_DT_FLOAT(FOLD_ENTRY, norminf)},
    [F_SQDEV] = {RED_DT_FLOAT(FOLD_ENTRY, sqdev)},
    [F_NONFINITE] = {RED_DT_FLOAT(FOLD_ENTRY, nonfinite)},
    [F_COLSUM] = {RED_DT_ALL(COLSUM_ENTRY, x)},
};

/* Folds block results: acc <- acc (+) b, for the fold `f` of a float (fl) or integer input. */
static void combine(int f, int fl, acc_t *acc, const acc_t *b) {
  switch (f) {
    case F_PROD:
      if (fl) acc->v.d *= b->v.d;
      else acc->v.i = (int64_t)((uint64_t)acc->v.i * (uint64_t)b->v.i);
      break;
    case F_MAX:
    case F_MIN:
      if (b->idx < 0) break;
      if (acc->idx < 0) {
        *acc = *b;
      } else if (fl) {
        if (f == F_MAX ? dlua_red_max_better_d(b->v.d, acc->v.d) : dlua_red_min_better_d(b->v.d, acc->v.d)) *acc = *b;
      } else if (f == F_MAX ? b->v.i > acc->v.i : b->v.i < acc->v.i) {
        *acc = *b;
      }
      break;
    case F_ANY: acc->v.i |= b->v.i; break;
    case F_ALL: acc->v.i &= b->v.i; break;
    case F_NORMINF: acc->v.d = dlua_red_absmax_d(acc->v.d, b->v.d); break;
    case F_NONFINITE: acc->v.i += b->v.i; break;
    default:  // sums
      if (fl) acc->v.d += b->v.d;
      else acc->v.i = (int64_t)((uint64_t)acc->v.i + (uint64_t)b->v.i);
      break;
  }
}

/* Runs fold `f` for every output into res (O). Two schedules, chosen for speed only: parallel
   over outputs (each walks its blocks in order), or, when outputs are few, parallel over
   (output, block) pairs into a table combined afterwards. Both combine blocks in block order,
   so they give identical bits. */
static dlua_status_t run_fold(const char *op, const red_plan_t *pl, fold_fn fn, int f, int fl, acc_t *res) {
  const int64_t O = pl->O, R = pl->R;
  if (O == 0) return DLUA_OK;
  const int64_t nb = R == 0 ? 1 : (R + RED_BLOCK - 1) / RED_BLOCK;
  const int nt = omp_get_max_threads();
  if (nb == 1) {
    // One block per output: chunks of outputs big enough to be worth a thread.
    int64_t chunk = R > 0 ? 32768 / R : 32768;
    if (chunk < 1) chunk = 1;
    int64_t nchunks = (O + chunk - 1) / chunk;
    if (nchunks == 1 || nt == 1) {
      fn(pl, 0, O, 0, R, res);
      return DLUA_OK;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
      int64_t lo = c * chunk, hi = lo + chunk < O ? lo + chunk : O;
      fn(pl, lo, hi, 0, R, res + lo);
    }
    return DLUA_OK;
  }
  if (O >= 4 * (int64_t)nt) {
    int64_t nchunks = (O + RED_OUT_CHUNK - 1) / RED_OUT_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
      int64_t lo = c * RED_OUT_CHUNK, hi = lo + RED_OUT_CHUNK < O ? lo + RED_OUT_CHUNK : O;
      acc_t part[RED_OUT_CHUNK];
      fn(pl, lo, hi, 0, RED_BLOCK, res + lo);
      for (int64_t b = 1; b < nb; b++) {
        int64_t r_hi = (b + 1) * RED_BLOCK < R ? (b + 1) * RED_BLOCK : R;
        fn(pl, lo, hi, b * RED_BLOCK, r_hi, part);
        for (int64_t o = lo; o < hi; o++) combine(f, fl, &res[o], &part[o - lo]);
      }
    }
    return DLUA_OK;
  }
  size_t bytes = (size_t)(O * nb) * sizeof(acc_t);
  acc_t *parts = malloc(bytes);
  if (!parts) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of partial results", op, bytes);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < O * nb; t++) {
    int64_t o = t / nb, b = t % nb;
    int64_t r_hi = (b + 1) * RED_BLOCK < R ? (b + 1) * RED_BLOCK : R;
    fn(pl, o, o + 1, b * RED_BLOCK, r_hi, &parts[t]);
  }
  for (int64_t o = 0; o < O; o++) {
    res[o] = parts[o * nb];
    for (int64_t b = 1; b < nb; b++) combine(f, fl, &res[o], &parts[o * nb + b]);
  }
  free(parts);
  return DLUA_OK;
}

/* ---- planning ------------------------------------------------------------------------------- */

/* Appends dims (given order, outer first) to a size/stride list, dropping size-1 dims and
   merging neighbours that are contiguous with each other. */
static int coalesce(int n, const int64_t *sizes, const int64_t *strides, int64_t *osz, int64_t *ost) {
  int m = 0;
  for (int i = 0; i < n; i++) {
    if (sizes[i] == 1) continue;
    if (m > 0 && ost[m - 1] == strides[i] * sizes[i]) {
      osz[m - 1] *= sizes[i];
      ost[m - 1] = strides[i];
      continue;
    }
    osz[m] = sizes[i];
    ost[m] = strides[i];
    m++;
  }
  return m;
}

static void plan_build(red_plan_t *pl, const dlua_reduce_desc_t *a, int memory_order) {
  const int *reduced = a->reduced;
  memset(pl, 0, sizeof *pl);
  pl->base = a->x;
  int64_t ks[DLUA_MAX_DIMS], kt[DLUA_MAX_DIMS], rs[DLUA_MAX_DIMS], rt[DLUA_MAX_DIMS];
  int nk = 0, nr = 0;
  pl->O = 1;
  pl->R = 1;
  for (int d = 0; d < a->ndim; d++) {
    if (reduced[d]) {
      rs[nr] = a->sizes[d];
      rt[nr++] = a->strides[d];
      pl->R *= a->sizes[d];
    } else {
      ks[nk] = a->sizes[d];
      kt[nk++] = a->strides[d];
      pl->O *= a->sizes[d];
    }
  }
  // Order-insensitive folds walk memory in address order (a transposed input stays fast);
  // max/min keep the logical order, since the first occurrence and the index depend on it.
  if (memory_order)
    for (int i = 1; i < nr; i++)
      for (int j = i; j > 0 && llabs(rt[j - 1]) < llabs(rt[j]); j--) {
        int64_t t = rt[j]; rt[j] = rt[j - 1]; rt[j - 1] = t;
        t = rs[j]; rs[j] = rs[j - 1]; rs[j - 1] = t;
      }
  pl->nk = coalesce(nk, ks, kt, pl->ksize, pl->kstride);
  pl->nr = coalesce(nr, rs, rt, pl->rsize, pl->rstride);
  if (pl->nr == 0) {  // one element per output (or nothing reduced): a dim of size 1
    pl->rsize[0] = 1;
    pl->rstride[0] = 0;
    pl->nr = 1;
  }
}

/* ---- the entry point ------------------------------------------------------------------------ */

/* Writes res (O values: .d when dtype is floating, else .i) into contiguous dst. */
static void store_values(void *dst, dlua_dtype_t dt, const acc_t *res, int64_t O) {
  switch (dt) {
    case DLUA_DTYPE_F32: for (int64_t o = 0; o < O; o++) ((float *)dst)[o] = (float)res[o].v.d; break;
    case DLUA_DTYPE_F64: for (int64_t o = 0; o < O; o++) ((double *)dst)[o] = res[o].v.d; break;
    case DLUA_DTYPE_F16:
      for (int64_t o = 0; o < O; o++) ((uint16_t *)dst)[o] = dlua_f32_to_f16_inl((float)res[o].v.d);
      break;
    case DLUA_DTYPE_BF16:
      for (int64_t o = 0; o < O; o++) ((uint16_t *)dst)[o] = dlua_f32_to_bf16_inl((float)res[o].v.d);
      break;
    case DLUA_DTYPE_I32: for (int64_t o = 0; o < O; o++) ((int32_t *)dst)[o] = (int32_t)res[o].v.i; break;
    case DLUA_DTYPE_I64: for (int64_t o = 0; o < O; o++) ((int64_t *)dst)[o] = res[o].v.i; break;
    case DLUA_DTYPE_U8: for (int64_t o = 0; o < O; o++) ((uint8_t *)dst)[o] = (uint8_t)res[o].v.i; break;
    default: for (int64_t o = 0; o < O; o++) ((uint8_t *)dst)[o] = res[o].v.i != 0; break;
  }
}

/* The reduce slot: r->kind over the dims r->reduced of the strided r->x, into r->y / r->idx. */
static dlua_status_t cpu_reduce(const char *name, const dlua_reduce_desc_t *r) {
  const dlua_reduce_op_t op = (dlua_reduce_op_t)r->kind;
  const dlua_dtype_t dt = (dlua_dtype_t)r->dtype;
  const int fl = dlua_dtype_is_floating(dt);
  const double p = r->p;
  int is_index = op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN || op == DLUA_REDUCE_ARGMAX || op == DLUA_REDUCE_ARGMIN;
  red_plan_t pl;
  plan_build(&pl, r, !is_index);
  pl.p = p;

  int f;
  switch (op) {
    case DLUA_REDUCE_SUM:
    case DLUA_REDUCE_MEAN:
    case DLUA_REDUCE_VAR:
    case DLUA_REDUCE_STD: f = F_SUM; break;
    case DLUA_REDUCE_PROD: f = F_PROD; break;
    case DLUA_REDUCE_MAX:
    case DLUA_REDUCE_ARGMAX: f = F_MAX; break;
    case DLUA_REDUCE_MIN:
    case DLUA_REDUCE_ARGMIN: f = F_MIN; break;
    case DLUA_REDUCE_NORM: f = p == 0 ? F_NORM0 : p == 1 ? F_NORM1 : p == 2 ? F_NORM2 : isinf(p) ? F_NORMINF : F_NORMP; break;
    case DLUA_REDUCE_ANY: f = F_ANY; break;
    case DLUA_REDUCE_ALL: f = F_ALL; break;
    default: f = F_NONFINITE; break;
  }
  size_t bytes = (size_t)(pl.O > 0 ? pl.O : 1) * sizeof(acc_t);
  acc_t *res = malloc(bytes);
  if (!res) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of results", name, bytes);
  double *mean = NULL;
  dlua_status_t s = DLUA_OK;

  if (f == F_NONFINITE && !fl) {
    for (int64_t o = 0; o < pl.O; o++) res[o].v.i = 0;  // integers are always finite
  } else {
    fold_fn fn = fold_table[f][dt];
    int as_any = f == F_ANY || f == F_ALL || f == F_NONFINITE;  // integer flags even for float input
    if (f == F_SUM && pl.nk > 0 && pl.kstride[pl.nk - 1] == 1 && pl.ksize[pl.nk - 1] >= 8 && pl.rstride[pl.nr - 1] != 1)
      fn = fold_table[F_COLSUM][dt];
    s = run_fold(name, &pl, fn, f, fl && !as_any, res);
  }

  if (s == DLUA_OK && (op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD)) {
    // Two passes (mean, then squared deviations) rather than sum of squares: no cancellation.
    mean = malloc((size_t)(pl.O > 0 ? pl.O : 1) * sizeof(double));
    if (!mean) s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of means", name, (size_t)pl.O * 8);
    for (int64_t o = 0; s == DLUA_OK && o < pl.O; o++) mean[o] = res[o].v.d / (double)pl.R;
    if (s == DLUA_OK) {
      pl.mean = mean;
      s = run_fold(name, &pl, fold_table[F_SQDEV][dt], F_SQDEV, 1, res);
    }
    double denom = (double)pl.R - p;
    if (denom < 0) denom = 0;
    for (int64_t o = 0; s == DLUA_OK && o < pl.O; o++) {
      double v = res[o].v.d / denom;
      res[o].v.d = op == DLUA_REDUCE_STD ? sqrt(v) : v;
    }
  }

  if (s == DLUA_OK) {
    for (int64_t o = 0; o < pl.O; o++) {
      if (op == DLUA_REDUCE_MEAN) res[o].v.d /= (double)pl.R;  // 0 / 0: NaN for an empty mean
      else if (f == F_NORM2) res[o].v.d = sqrt(res[o].v.d);
      else if (f == F_NORMP) res[o].v.d = pow(res[o].v.d, 1.0 / p);
    }
    if (r->y) store_values(r->y, (dlua_dtype_t)r->out_dtype, res, pl.O);
    if (r->idx)
      for (int64_t o = 0; o < pl.O; o++) r->idx[o] = res[o].idx + r->index_base;
  }
  free(mean);
  free(res);
  return s;
}

const struct dlua_reduce_ops dlua_cpu_reduce_ops = {
    .reduce = cpu_reduce,
};

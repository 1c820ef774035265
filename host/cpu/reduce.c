/* CPU reductions (sum, mean, prod, max/min, arg*, norm, var/std, any/all, non-finite count) over any set of dims. */
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
#include "cuda/index_cuda.h" /* plain C: only CUDA builds call into it */
#include "cuda/kernels.h"

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

static void plan_build(red_plan_t *pl, const dlua_tensor_t *a, const int *reduced, int memory_order) {
  memset(pl, 0, sizeof *pl);
  pl->base = dlua_tensor_ptr(a);
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

static const char *const red_names[DLUA_REDUCE_COUNT] = {
    "sum", "mean", "prod", "max", "min", "argmax", "argmin", "norm", "var", "std", "any", "all", "count_nonfinite"};

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

/* Delivers the O results to *dst under the `out` convention (a temporary when the caller's
   tensor has another dtype or is not contiguous). */
static dlua_status_t deliver(const char *op, dlua_tensor_t **dst, int nd, const int64_t *shape, dlua_dtype_t dt,
                             const acc_t *res, int64_t O, int as_index, int64_t base) {
  int allocated = 0;
  DLUA_TRY(dlua_prepare_out(op, dst, nd, shape, dt, &allocated));
  dlua_tensor_t *t = *dst, *tmp = NULL;
  dlua_status_t s = DLUA_OK;
  if (!allocated && (t->dtype != dt || !dlua_tensor_is_contiguous(t))) {
    s = dlua_tensor_empty(&tmp, nd, shape, dt, DLUA_CPU);
    t = tmp;
  }
  if (s == DLUA_OK) {
    if (as_index) {
      int64_t *p = (int64_t *)dlua_tensor_ptr(t);
      for (int64_t o = 0; o < O; o++) p[o] = res[o].idx + base;
    } else {
      store_values(dlua_tensor_ptr(t), dt, res, O);
    }
    if (tmp) s = dlua_tensor_copy_(*dst, tmp);
  }
  dlua_tensor_free(tmp);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*dst);
    *dst = NULL;
  }
  return s;
}

#ifdef DLUA_HAVE_CUDA
/* One result of a CUDA reduction into *dst (the `out` convention): written in place when the tensor is
   new or already contiguous with the result's dtype, else through a temporary copied over at the end. */
typedef struct {
  dlua_tensor_t **dst, *tmp;
  int allocated;
} cuda_target_t;

static dlua_status_t cuda_target_open(const char *op, cuda_target_t *tg, dlua_tensor_t **dst, int nd,
                                      const int64_t *shape, dlua_dtype_t dt, int device, void **ptr) {
  tg->dst = dst;
  tg->tmp = NULL;
  tg->allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, dst, nd, shape, dt, device, &tg->allocated));
  dlua_tensor_t *t = *dst;
  if (!tg->allocated && (t->dtype != dt || !dlua_tensor_is_contiguous(t))) {
    DLUA_TRY(dlua_tensor_empty(&tg->tmp, nd, shape, dt, device));
    t = tg->tmp;
  }
  *ptr = dlua_tensor_ptr(t);
  return DLUA_OK;
}

static dlua_status_t cuda_target_close(cuda_target_t *tg, dlua_status_t s) {
  if (!tg->dst) return s;
  if (s == DLUA_OK && tg->tmp) s = dlua_tensor_copy_(*tg->dst, tg->tmp);
  dlua_tensor_free(tg->tmp);
  if (s != DLUA_OK && tg->allocated) {
    dlua_tensor_free(*tg->dst);
    *tg->dst = NULL;
  }
  return s;
}
#endif

/* The CUDA path: kept dims first and reduced dims last in a permuted view, made contiguous (the copy
   kernel; a no-op when already so), is (outer, n) for host/cuda/reduce.cu. */
static dlua_status_t cuda_reduce(const char *name, dlua_reduce_op_t op, dlua_tensor_t **out, dlua_tensor_t **indices,
                                 const dlua_tensor_t *a, const int *reduced, int nd, const int64_t *shape,
                                 dlua_dtype_t rdt, double p, int64_t index_base) {
  char desc[200];
  int kind;
  switch (op) {
    case DLUA_REDUCE_SUM: kind = 0; break;
    case DLUA_REDUCE_MEAN: kind = 1; break;
    case DLUA_REDUCE_MAX: kind = 2; break;
    case DLUA_REDUCE_MIN: kind = 3; break;
    case DLUA_REDUCE_ARGMAX: kind = 4; break;
    case DLUA_REDUCE_ARGMIN: kind = 5; break;
    case DLUA_REDUCE_ANY: kind = 6; break;
    case DLUA_REDUCE_ALL: kind = 7; break;
    case DLUA_REDUCE_PROD: kind = 8; break;
    case DLUA_REDUCE_NORM: kind = 9; break;
    case DLUA_REDUCE_VAR: kind = 10; break;
    case DLUA_REDUCE_STD: kind = 11; break;
    case DLUA_REDUCE_COUNT_NONFINITE: kind = 12; break;
    default:
      return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d yet (got %s)", name, a->device,
                      dlua_tensor_describe(a, desc, sizeof desc));
  }
#ifdef DLUA_HAVE_CUDA
  dlua_tensor_t v = *a;  // a view header on the stack: same storage, permuted dims
  int k = 0;
  int64_t outer = 1, n = 1;
  for (int pass = 0; pass < 2; pass++)
    for (int d = 0; d < a->ndim; d++) {
      if (reduced[d] != pass) continue;
      v.sizes[k] = a->sizes[d];
      v.strides[k] = a->strides[d];
      if (pass) n *= a->sizes[d];
      else outer *= a->sizes[d];
      k++;
    }
  dlua_tensor_t *c = NULL;
  DLUA_TRY(dlua_tensor_contiguous(&c, &v));
  const int is_arg = kind == 4 || kind == 5;
  const int with_idx = is_arg || (indices && (kind == 2 || kind == 3));
  cuda_target_t t1 = {NULL, NULL, 0}, t2 = {NULL, NULL, 0};
  void *p1 = NULL, *p2 = NULL;
  dlua_status_t s = cuda_target_open(name, &t1, out, nd, shape, is_arg ? DLUA_DTYPE_I64 : rdt, a->device, &p1);
  if (s == DLUA_OK && with_idx && !is_arg)
    s = cuda_target_open(name, &t2, indices, nd, shape, DLUA_DTYPE_I64, a->device, &p2);
  if (s == DLUA_OK)
    s = dlua_cuda_reduce_p(name, kind, (int)a->dtype, (int)rdt, dlua_tensor_ptr(c), is_arg ? NULL : p1,
                           (int64_t *)(is_arg ? p1 : p2), outer, n, index_base, p, a->device);
  s = cuda_target_close(&t2, s);
  s = cuda_target_close(&t1, s);
  dlua_tensor_free(c);
  return s;
#else
  (void)out, (void)indices, (void)reduced, (void)nd, (void)shape, (void)rdt, (void)p, (void)index_base, (void)kind;
  return dlua_require_cpu(name, a);
#endif
}

dlua_status_t dlua_tensor_reduce(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *a,
                                 dlua_reduce_op_t op, int ndims, const int *dims, int keepdim, double p,
                                 int64_t index_base) {
  if ((int)op < 0 || op >= DLUA_REDUCE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "reduce: unknown op %d", (int)op);
  const char *name = red_names[op];
  if (!a || !a->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", name);
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", name);
  char desc[200];
  const dlua_dtype_t dt = a->dtype;
  const int fl = dlua_dtype_is_floating(dt);
  int needs_float = op == DLUA_REDUCE_MEAN || op == DLUA_REDUCE_NORM || op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD;
  if (needs_float && !fl)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a floating-point tensor, got %s (convert it first)", name,
                    dlua_tensor_describe(a, desc, sizeof desc));
  if (op == DLUA_REDUCE_NORM && !(p >= 0))
    return DLUA_ERR(DLUA_ERR_ARG, "norm: p must be >= 0 (or inf), got %g", p);
  if ((op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD) && !isfinite(p))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: correction must be finite, got %g", name, p);

  // Which dims are reduced; a 0-d tensor accepts dim 0 as PyTorch does.
  int reduced[DLUA_MAX_DIMS] = {0};
  if (ndims < 0 || ndims > DLUA_MAX_DIMS || (ndims > 0 && !dims))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid list of %d dims", name, ndims);
  for (int i = 0; i < ndims; i++) {
    int d = dims[i];
    if (a->ndim == 0 && d == 0) continue;
    if (d < 0 || d >= a->ndim)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: dim %d out of range for %s (0-based, expected 0..%d)", name, d,
                      dlua_tensor_describe(a, desc, sizeof desc), a->ndim - 1);
    if (reduced[d])
      return DLUA_ERR(DLUA_ERR_ARG, "%s: dim %d appears twice in the list of dims", name, d);
    reduced[d] = 1;
  }
  if (ndims == 0)
    for (int d = 0; d < a->ndim; d++) reduced[d] = 1;

  int nd = 0;
  int64_t shape[DLUA_MAX_DIMS];
  for (int d = 0; d < a->ndim; d++) {
    if (!reduced[d]) shape[nd++] = a->sizes[d];
    else if (keepdim) shape[nd++] = 1;
  }

  // Result dtype, PyTorch's: integer sums and products widen to int64.
  dlua_dtype_t rdt = dt;
  switch (op) {
    case DLUA_REDUCE_SUM:
    case DLUA_REDUCE_PROD: rdt = fl ? dt : DLUA_DTYPE_I64; break;
    case DLUA_REDUCE_ARGMAX:
    case DLUA_REDUCE_ARGMIN:
    case DLUA_REDUCE_COUNT_NONFINITE: rdt = DLUA_DTYPE_I64; break;
    case DLUA_REDUCE_ANY:
    case DLUA_REDUCE_ALL: rdt = DLUA_DTYPE_BOOL; break;
    default: break;
  }

  int is_index = op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN || op == DLUA_REDUCE_ARGMAX || op == DLUA_REDUCE_ARGMIN;
  red_plan_t pl;
  plan_build(&pl, a, reduced, !is_index);
  pl.p = p;
  int no_identity = is_index || (op == DLUA_REDUCE_NORM && isinf(p));
  if (no_identity && pl.R == 0 && pl.O > 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot reduce %s over dims with no elements (the op has no identity)", name,
                    dlua_tensor_describe(a, desc, sizeof desc));
  if (a->device != DLUA_CPU) return cuda_reduce(name, op, out, indices, a, reduced, nd, shape, rdt, p, index_base);

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
    if (op == DLUA_REDUCE_ARGMAX || op == DLUA_REDUCE_ARGMIN) {
      s = deliver(name, out, nd, shape, DLUA_DTYPE_I64, res, pl.O, 1, index_base);
    } else {
      s = deliver(name, out, nd, shape, rdt, res, pl.O, 0, 0);
      if (s == DLUA_OK && indices && (op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN)) {
        s = deliver(name, indices, nd, shape, DLUA_DTYPE_I64, res, pl.O, 1, index_base);
      }
    }
  }
  free(mean);
  free(res);
  return s;
}

/* The CPU kernels of the optim family (host/kernels/optim.h): fused optimizer steps over ranges of the flat
   parameter/gradient/state arenas (SGD, Adam, AdamW, LARS, LAMB, with mixed precision's 16-bit copy), AMP
   unscaling, clip_grad_norm_'s partial norms and scaling. host/ops/optim.c checked every argument. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/copy.h"
#include "kernels/elementwise_ops.h"
#include "kernels/optim.h"
#include "kernels/optim_ops.h"
#include "cpu/compress.h"

/* Element-wise steps run in chunks of OPT_CHUNK elements (one thread each; a range smaller
   than that stays on the calling thread). LARS norms are summed per LARS_BLOCK elements and
   the blocks of a parameter added in order, so the trust ratios do not depend on threads. */
enum { OPT_CHUNK = 16384, LARS_BLOCK = 8192 };

/* ---- kernels ------------------------------------------------------------------------------------------ */

typedef dlua_opt_args_t step_args_t; /* host/kernels/optim.h */

typedef void (*chunk_fn)(const step_args_t *a, int64_t lo, int64_t hi);

/* Each scalar is rounded to T once, as PyTorch passes Python floats to its T kernels, and each
   line mirrors one torch op of _single_tensor_sgd / _single_tensor_adam(w) (torch 1.13). */
#define OPT_KERNELS(T, S, SQRT)                                                                                 \
  static DLUA_CPU_CLONES void sgd_##S(const step_args_t *a, int64_t lo, int64_t hi) {                           \
    T *p = a->p, *buf = a->s1;                                                                                  \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, wd = (T)a->weight_decay, mom = (T)a->momentum;                               \
    const T damp1 = (T)(1.0 - a->dampening), lr = (T)a->lr;                                                     \
    const int nesterov = a->nesterov, maximize = a->maximize, first = a->first;                                 \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_sgd_##S(p + i, g[i], buf ? buf + i : NULL, gs, wd, mom, damp1, lr, nesterov, maximize, first);   \
  }                                                                                                             \
                                                                                                                \
  /* Adam and AdamW: AdamW decays the weight (decay = 1 - lr wd), Adam adds wd * p to the gradient. */        \
  static DLUA_CPU_CLONES void adam_##S(const step_args_t *a, int64_t lo, int64_t hi) {                          \
    T *p = a->p, *m = a->s1, *v = a->s2, *vmax = a->s3;                                                         \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, decay = (T)(a->decoupled ? 1.0 - a->lr * a->weight_decay : 1.0);             \
    const T l2 = (T)(a->decoupled ? 0.0 : a->weight_decay);                                                     \
    const T b1 = (T)a->beta1, omb1 = (T)(1.0 - a->beta1), b2 = (T)a->beta2, omb2 = (T)(1.0 - a->beta2);         \
    const T neg_step = (T)(-(a->lr / a->bc1)), bc2_sqrt = (T)sqrt(a->bc2), eps = (T)a->eps;                     \
    const int maximize = a->maximize, amsgrad = a->amsgrad;                                                     \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_adam_##S(p + i, g[i], m + i, v + i, vmax ? vmax + i : NULL, gs, decay, l2, b1, omb1, b2, omb2,   \
                        neg_step, bc2_sqrt, eps, maximize, amsgrad);                                            \
  }                                                                                                             \
                                                                                                                \
  /* host/kernels/optim_ops.h's LARC step with this parameter's trust ratio. */                                    \
  static DLUA_CPU_CLONES void lars_##S(const step_args_t *a, int64_t lo, int64_t hi) {                          \
    T *p = a->p, *buf = a->s1;                                                                                  \
    const T *g = a->g;                                                                                          \
    const T gs = (T)a->grad_scale, wd = (T)a->weight_decay, trust = (T)a->trust, mom = (T)a->momentum;          \
    const T lr = (T)a->lr;                                                                                      \
    const int first = a->first;                                                                                 \
    for (int64_t i = lo; i < hi; i++)                                                                           \
      dlua_opt_lars_##S(p + i, g[i], buf ? buf + i : NULL, gs, wd, trust, mom, lr, first);                      \
  }                                                                                                             \
                                                                                                                \
  /* Sums of p^2 and (g * grad_scale)^2 over [lo, hi), in double. */                                         \
  static void sq_norms_##S(const step_args_t *a, int64_t lo, int64_t hi, double *pp, double *gg) {            \
    const T *p = a->p, *g = a->g;                                                                               \
    const T gs = (T)a->grad_scale;                                                                              \
    double sp = 0, sg = 0;                                                                                      \
    for (int64_t i = lo; i < hi; i++) {                                                                         \
      double x = p[i], y = g[i] * gs;                                                                           \
      sp += x * x;                                                                                              \
      sg += y * y;                                                                                              \
    }                                                                                                           \
    *pp = sp;                                                                                                   \
    *gg = sg;                                                                                                   \
  }                                                                                                             \
                                                                                                                \
  /* LAMB pass 1: the moments, and the sums of p^2 and u^2 (u: the update direction) over [lo, hi). */         \
  static DLUA_CPU_CLONES void lamb_norms_##S(const step_args_t *a, int64_t lo, int64_t hi, double *pp,          \
                                             double *uu) {                                                      \
    const T *p = a->p, *g = a->g;                                                                               \
    T *m = a->s1, *v = a->s2;                                                                                   \
    const T gs = (T)a->grad_scale, b1 = (T)a->beta1, omb1 = (T)(1.0 - a->beta1), b2 = (T)a->beta2;             \
    const T omb2 = (T)(1.0 - a->beta2), bc1 = (T)a->bc1, bc2 = (T)a->bc2, eps = (T)a->eps;                     \
    const T wd = (T)a->weight_decay;                                                                            \
    double sp = 0, su = 0;                                                                                      \
    for (int64_t i = lo; i < hi; i++) {                                                                         \
      const double x = p[i];                                                                                    \
      const double u = dlua_opt_lamb_moments_##S(p[i], g[i], m + i, v + i, gs, b1, omb1, b2, omb2, bc1, bc2,    \
                                                 eps, wd);                                                      \
      sp += x * x;                                                                                              \
      su += u * u;                                                                                              \
    }                                                                                                           \
    *pp = sp;                                                                                                   \
    *uu = su;                                                                                                   \
  }                                                                                                             \
                                                                                                                \
  /* LAMB pass 2: p -= lr * trust * u, u recomputed from the moments pass 1 stored. */                         \
  static DLUA_CPU_CLONES void lamb_apply_##S(const step_args_t *a, int64_t lo, int64_t hi) {                    \
    T *p = a->p;                                                                                                \
    const T *m = a->s1, *v = a->s2;                                                                             \
    const T neg = (T)(-(a->lr * a->trust)), bc1 = (T)a->bc1, bc2 = (T)a->bc2, eps = (T)a->eps;                  \
    const T wd = (T)a->weight_decay;                                                                            \
    for (int64_t i = lo; i < hi; i++) dlua_opt_lamb_apply_##S(p + i, m[i], v[i], neg, bc1, bc2, eps, wd);       \
  }

OPT_KERNELS(float, f, sqrtf)
OPT_KERNELS(double, d, sqrt)

/* Runs fn over [0, length) of the (pre-offset) arguments in OPT_CHUNK pieces. */
static void run_chunks(chunk_fn fn, const step_args_t *a, int64_t length) {
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK;
#pragma omp parallel for schedule(static) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    fn(a, lo, hi);
  }
}

/* Mixed precision's master weights: run_chunks, then each chunk's parameters converted into lp (pre-offset,
   dtype lpdt) right after the chunk's update, while it is in cache (no pass of its own). */
static void run_chunks_lowp(chunk_fn fn, const step_args_t *a, int64_t length, char *lp, dlua_dtype_t lpdt) {
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK;
#pragma omp parallel for schedule(static) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    fn(a, lo, hi);
    dlua_convert(lp + lo * 2, lpdt, (const float *)a->p + lo, DLUA_DTYPE_F32, hi - lo);
  }
}

/* ---- SGD, Adam, AdamW ---------------------------------------------------------------------------------- */

static dlua_status_t cpu_sgd_step(const char *op, const dlua_optim_step_desc_t *d) {
  (void)op;
  if (d->lowp)
    run_chunks_lowp(sgd_f, &d->args, d->length, d->lowp, (dlua_dtype_t)d->lowp_dtype);
  else
    run_chunks(d->dtype == DLUA_DTYPE_F64 ? sgd_d : sgd_f, &d->args, d->length);
  return DLUA_OK;
}

/* Adam and AdamW: args.decoupled 1 is AdamW (param *= 1 - lr wd), 0 is Adam (grad += wd param). */
static dlua_status_t cpu_adam_step(const char *op, const dlua_optim_step_desc_t *d) {
  (void)op;
  if (d->lowp)
    run_chunks_lowp(adam_f, &d->args, d->length, d->lowp, (dlua_dtype_t)d->lowp_dtype);
  else
    run_chunks(d->dtype == DLUA_DTYPE_F64 ? adam_d : adam_f, &d->args, d->length);
  return DLUA_OK;
}

/* ---- per-parameter blocks (LARS, LAMB) ------------------------------------------------------------------ */

typedef struct {
  int64_t lo, hi; /* element range in the arena */
  int r;          /* parameter */
} param_block_t;

/* A step's parameters cut into blocks of LARS_BLOCK elements, parameter by parameter, with room for
   two partial sums per block and a trust ratio per parameter. One allocation (mem). */
typedef struct {
  char *mem;
  int64_t nb;
  param_block_t *blocks;
  double *part;  /* (nb, 2) */
  double *trust; /* (n_ranges) */
} param_blocks_t;

/* Plans the blocks of the (checked) ranges: inside the arena, pairwise disjoint, n_ranges > 0. */
static dlua_status_t plan_blocks(const char *op, const dlua_optim_ranges_desc_t *d, param_blocks_t *pb) {
  const int n_ranges = d->n_ranges;
  const int64_t *offsets = d->offsets, *lengths = d->lengths;
  memset(pb, 0, sizeof *pb);
  int64_t nb = 0;
  for (int r = 0; r < n_ranges; r++) nb += (lengths[r] + LARS_BLOCK - 1) / LARS_BLOCK;
  size_t bytes = (size_t)n_ranges * sizeof(double) + (size_t)nb * (sizeof(param_block_t) + 2 * sizeof(double)) + 1;
  char *mem = malloc(bytes);
  if (!mem) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, bytes);
  pb->mem = mem;
  pb->nb = nb;
  pb->trust = (double *)mem;
  pb->part = pb->trust + n_ranges;
  pb->blocks = (param_block_t *)(pb->part + 2 * nb);
  int64_t k = 0;
  for (int r = 0; r < n_ranges; r++)
    for (int64_t lo = offsets[r]; lo < offsets[r] + lengths[r]; lo += LARS_BLOCK) {
      int64_t end = offsets[r] + lengths[r];
      pb->blocks[k++] = (param_block_t){lo, lo + LARS_BLOCK < end ? lo + LARS_BLOCK : end, r};
    }
  return DLUA_OK;
}

/* Blocks are laid out parameter by parameter, so one in-order walk folds each parameter's two sums:
   the same bits whatever the number of threads. */
static void fold_blocks(const param_blocks_t *pb, int r, int64_t *b, double *s1, double *s2) {
  double x = 0, y = 0;
  for (; *b < pb->nb && pb->blocks[*b].r == r; (*b)++) x += pb->part[2 * *b], y += pb->part[2 * *b + 1];
  *s1 = x;
  *s2 = y;
}

/* ---- LARS ------------------------------------------------------------------------------------------------ */

static dlua_status_t cpu_lars_step(const char *op, const dlua_optim_ranges_desc_t *d) {
  param_blocks_t pb;
  DLUA_TRY(plan_blocks(op, d, &pb));
  const step_args_t base = d->args;
  const int n_ranges = d->n_ranges;
  const int32_t *exclude = d->exclude;
  const double trust_coefficient = d->trust_coefficient, eps = d->eps, weight_decay = base.weight_decay;

  const int64_t nb = pb.nb;
  int f64 = d->dtype == DLUA_DTYPE_F64;
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    pb.part[2 * b] = pb.part[2 * b + 1] = 0;
    if (exclude && exclude[k->r]) continue;
    if (f64)
      sq_norms_d(&base, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
    else
      sq_norms_f(&base, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
  }
  for (int64_t r = 0, b = 0; r < n_ranges; r++) {
    double sp, sg;
    fold_blocks(&pb, (int)r, &b, &sp, &sg);
    double pn = sqrt(sp), gn = sqrt(sg);
    // -1 marks plain momentum SGD: excluded, or a zero norm (LARC then leaves the gradient
    // alone, decay included). A real ratio is never negative.
    int excluded = exclude && exclude[r];
    pb.trust[r] = !excluded && pn > 0 && gn > 0 ? trust_coefficient * pn / (gn + weight_decay * pn + eps) : -1.0;
  }
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    int r = pb.blocks[b].r;
    step_args_t a = base;
    a.trust = pb.trust[r] < 0 ? 1.0 : pb.trust[r];
    if (pb.trust[r] < 0) a.weight_decay = 0;
    if (f64)
      lars_d(&a, pb.blocks[b].lo, pb.blocks[b].hi);
    else
      lars_f(&a, pb.blocks[b].lo, pb.blocks[b].hi);
  }
  free(pb.mem);
  return DLUA_OK;
}

/* ---- LAMB ------------------------------------------------------------------------------------------------ */

static dlua_status_t cpu_lamb_step(const char *op, const dlua_optim_ranges_desc_t *d) {
  param_blocks_t pb;
  DLUA_TRY(plan_blocks(op, d, &pb));
  const step_args_t base = d->args;
  const int n_ranges = d->n_ranges;
  const int32_t *exclude = d->exclude;

  const int64_t nb = pb.nb;
  int f64 = d->dtype == DLUA_DTYPE_F64;
  // Pass 1: moments and the two sums per block; an excluded parameter has no decay (its sums go unused).
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    step_args_t a = base;
    if (exclude && exclude[k->r]) a.weight_decay = 0;
    if (f64)
      lamb_norms_d(&a, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
    else
      lamb_norms_f(&a, k->lo, k->hi, &pb.part[2 * b], &pb.part[2 * b + 1]);
  }
  for (int64_t r = 0, b = 0; r < n_ranges; r++) {
    double sp, su;
    fold_blocks(&pb, (int)r, &b, &sp, &su);
    double pn = sqrt(sp), un = sqrt(su);
    pb.trust[r] = (exclude && exclude[r]) || !(pn > 0 && un > 0) ? 1.0 : pn / un;
  }
#pragma omp parallel for schedule(dynamic, 4) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    const param_block_t *k = &pb.blocks[b];
    step_args_t a = base;
    a.trust = pb.trust[k->r];
    if (exclude && exclude[k->r]) a.weight_decay = 0;
    if (f64)
      lamb_apply_d(&a, k->lo, k->hi);
    else
      lamb_apply_f(&a, k->lo, k->hi);
  }
  free(pb.mem);
  return DLUA_OK;
}

/* ---- AMP unscaling, clip_grad_norm_ ---------------------------------------------------------------------- */

/* (suffix, storage type, compute type, load, store) */
#define UNSCALE_KERNEL(S, ST, CT, LOAD, STORE)                                            \
  static DLUA_CPU_CLONES int64_t unscale_##S(ST *x, int64_t lo, int64_t hi, double inv) { \
    int64_t bad = 0;                                                                      \
    const CT s = (CT)inv;                                                                 \
    for (int64_t i = lo; i < hi; i++) {                                                   \
      CT v = LOAD(x[i]);                                                                  \
      bad += !isfinite(v);                                                                \
      x[i] = STORE(v * s);                                                                \
    }                                                                                     \
    return bad;                                                                           \
  }                                                                                       \
  /* sum of |x|^p (p finite) or max |x| (p = inf) over [lo, hi) */                        \
  static DLUA_CPU_CLONES double norm_##S(const ST *x, int64_t lo, int64_t hi, double p) { \
    double acc = 0;                                                                       \
    if (isinf(p))                                                                         \
      for (int64_t i = lo; i < hi; i++) acc = dlua_opt_norm_max(acc, (double)LOAD(x[i])); \
    else if (p == 2)                                                                      \
      for (int64_t i = lo; i < hi; i++) acc += dlua_opt_norm_term((double)LOAD(x[i]), 2); \
    else                                                                                  \
      for (int64_t i = lo; i < hi; i++) acc += dlua_opt_norm_term((double)LOAD(x[i]), p); \
    return acc;                                                                           \
  }

#define SAME(v) (v)
UNSCALE_KERNEL(f32, float, float, SAME, SAME)
UNSCALE_KERNEL(f64, double, double, SAME, SAME)
UNSCALE_KERNEL(f16, uint16_t, float, dlua_f16_to_f32_inl, dlua_f32_to_f16_inl)
UNSCALE_KERNEL(bf16, uint16_t, float, dlua_bf16_to_f32_inl, dlua_f32_to_bf16_inl)
#undef SAME

/* x *= s over n elements; counts the non-finite inputs into *nonfinite when it is not NULL. */
static void scale_range(const dlua_optim_grad_desc_t *d, int64_t *nonfinite) {
  char *base = d->x;
  const int64_t length = d->n;
  const double s = d->s;
  const dlua_dtype_t dt = (dlua_dtype_t)d->dtype;
  int64_t nc = (length + OPT_CHUNK - 1) / OPT_CHUNK, bad = 0;
  // An integer count: the sum is the same in any order, so a plain reduction is deterministic.
#pragma omp parallel for schedule(static) reduction(+ : bad) if (nc > 1)
  for (int64_t c = 0; c < nc; c++) {
    int64_t lo = c * OPT_CHUNK, hi = lo + OPT_CHUNK < length ? lo + OPT_CHUNK : length;
    switch (dt) {
      case DLUA_DTYPE_F32: bad += unscale_f32((float *)base, lo, hi, s); break;
      case DLUA_DTYPE_F64: bad += unscale_f64((double *)base, lo, hi, s); break;
      case DLUA_DTYPE_F16: bad += unscale_f16((uint16_t *)base, lo, hi, s); break;
      default: bad += unscale_bf16((uint16_t *)base, lo, hi, s); break;
    }
  }
  if (nonfinite) *nonfinite = bad;
}

static dlua_status_t cpu_unscale(const char *op, const dlua_optim_grad_desc_t *d) {
  (void)op;
  scale_range(d, d->nonfinite);
  return DLUA_OK;
}

static dlua_status_t cpu_grad_scale(const char *op, const dlua_optim_grad_desc_t *d) {
  (void)op;
  scale_range(d, NULL);
  return DLUA_OK;
}

static dlua_status_t cpu_grad_norm_partial(const char *op, const dlua_optim_grad_desc_t *d) {
  const char *base = d->x;
  const int64_t length = d->n;
  const double norm_type = d->s;
  const dlua_dtype_t dt = (dlua_dtype_t)d->dtype;
  // Fixed blocks folded in order: the same bits whatever the number of threads.
  int64_t nb = (length + LARS_BLOCK - 1) / LARS_BLOCK;
  double one, *part = nb > 1 ? malloc((size_t)nb * sizeof(double)) : &one;
  if (!part) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, (size_t)nb * sizeof(double));
#pragma omp parallel for schedule(static) if (nb > 1)
  for (int64_t b = 0; b < nb; b++) {
    int64_t lo = b * LARS_BLOCK, hi = lo + LARS_BLOCK < length ? lo + LARS_BLOCK : length;
    switch (dt) {
      case DLUA_DTYPE_F32: part[b] = norm_f32((const float *)base, lo, hi, norm_type); break;
      case DLUA_DTYPE_F64: part[b] = norm_f64((const double *)base, lo, hi, norm_type); break;
      case DLUA_DTYPE_F16: part[b] = norm_f16((const uint16_t *)base, lo, hi, norm_type); break;
      default: part[b] = norm_bf16((const uint16_t *)base, lo, hi, norm_type); break;
    }
  }
  double acc = 0;
  for (int64_t b = 0; b < nb; b++) acc = isinf(norm_type) ? dlua_opt_norm_max(acc, part[b]) : acc + part[b];
  if (part != &one) free(part);
  *d->out = acc;
  return DLUA_OK;
}

/* ---- the table ---------------------------------------------------------------------------------------------- */

/* The compression slots are host/cpu/compress.c's. */
const struct dlua_optim_ops dlua_cpu_optim_ops = {
    .sgd_step = cpu_sgd_step,
    .adam_step = cpu_adam_step,
    .lars_step = cpu_lars_step,
    .lamb_step = cpu_lamb_step,
    .unscale = cpu_unscale,
    .grad_scale = cpu_grad_scale,
    .grad_norm_partial = cpu_grad_norm_partial,
    .compress_to_half = dlua_cpu_compress_to_half,
    .compress_from_half = dlua_cpu_compress_from_half,
    .compress_topk = dlua_cpu_compress_topk,
    .compress_topk_unpack = dlua_cpu_compress_topk_unpack,
    .compress_orthogonalize = dlua_cpu_compress_orthogonalize,
};

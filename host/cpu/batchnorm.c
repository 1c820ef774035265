/* CPU batch normalisation (PyTorch's BatchNorm1d/2d), fused with ReLU and a residual add, forward and backward. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "kernels/clones.h"
#include "cuda/nn_cuda.h"  /* plain C: only CUDA builds call into it */

/* Below this many elements a pass runs on one thread: waking the pool costs more. */
enum { BN_PAR_MIN = 32768 };
/* Channels-last partial sums cover blocks of about this many elements (whole rows of C). The
   block depends only on the shape, so the sums do not depend on the thread count. */
enum { BN_BLOCK_ELEMS = 8192 };

/* x seen as N planes of C channels of S positions (planar: (N, C, S) memory) or as N * S rows
   of C channels (rows: channels-last memory, or S == 1 where both are the same bytes). */
typedef struct {
  int64_t N, C, S;
  int rows;
  int64_t block_rows;
} bn_geom_t;

/* Per-channel totals of `rows` partial rows (rows, C), added in row order: the one fixed
   order that makes batch-norm's sums independent of the thread count. Shared by the f32 and
   f64 kernels, forward and backward. */
static void bn_combine(const double *ps, const double *pq, int64_t rows, int64_t C, double *s, double *q) {
  for (int64_t c = 0; c < C; c++) s[c] = q[c] = 0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < C; c++) {
      s[c] += ps[r * C + c];
      q[c] += pq[r * C + c];
    }
}

#define BN_CAT2(a, b) a##b
#define BN_CAT(a, b) BN_CAT2(a, b)
#define FN(name) BN_CAT(name, BN_SFX)

/* The block kernels pass 64-byte vectors between always-inline helpers, never across a call. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The ReLU mask of the backward passes: none, read from the forward's output y (y > 0), or
   recomputed from x as the forward computed it ((x - m) * fa + fb > 0, no skip): one stream
   less to read. */
enum { BN_NO_MASK, BN_MASK_Y, BN_MASK_X };
/* The mask kind of a pass given the output y (read when there) and the forward's scale fa (when
   the test is redone from x). */
static inline int bn_mask_kind(const void *y, const void *fa) { return y ? BN_MASK_Y : fa ? BN_MASK_X : BN_NO_MASK; }

#define T float
#define UT uint32_t
#define BN_SFX _f32
#include "cpu/batchnorm_impl.h"
#undef T
#undef UT
#undef BN_SFX

#define T double
#define UT uint64_t
#define BN_SFX _f64
#include "cpu/batchnorm_impl.h"
#undef T
#undef UT
#undef BN_SFX

/* ---- per-channel vectors ((C), any floating dtype and stride) ---------------------------------- */

static double vec_get(const dlua_tensor_t *t, int64_t i) {
  const char *p = dlua_tensor_ptr(t) + i * t->strides[0] * (int64_t)dlua_dtype_size(t->dtype);
  switch (t->dtype) {
    case DLUA_DTYPE_F32: return *(const float *)p;
    case DLUA_DTYPE_F64: return *(const double *)p;
    case DLUA_DTYPE_F16: return dlua_f16_to_f32_inl(*(const uint16_t *)p);
    default: return dlua_bf16_to_f32_inl(*(const uint16_t *)p);
  }
}

static void vec_set(dlua_tensor_t *t, int64_t i, double v) {
  char *p = dlua_tensor_ptr(t) + i * t->strides[0] * (int64_t)dlua_dtype_size(t->dtype);
  switch (t->dtype) {
    case DLUA_DTYPE_F32: *(float *)p = (float)v; break;
    case DLUA_DTYPE_F64: *(double *)p = v; break;
    case DLUA_DTYPE_F16: *(uint16_t *)p = dlua_f32_to_f16_inl((float)v); break;
    default: *(uint16_t *)p = dlua_f32_to_bf16_inl((float)v); break;
  }
}

static void vec_read(const dlua_tensor_t *t, int64_t C, double *dst, double dflt) {
  for (int64_t c = 0; c < C; c++) dst[c] = t ? vec_get(t, c) : dflt;
}

/* n doubles into an array of the compute dtype (float or double). */
static void put_t(dlua_dtype_t ct, void *dst, const double *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (ct == DLUA_DTYPE_F64) ((double *)dst)[i] = src[i];
    else ((float *)dst)[i] = (float)src[i];
  }
}

/* ---- argument checks ---------------------------------------------------------------------------- */

static dlua_status_t check_float(const char *op, const char *what, const dlua_tensor_t *t) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  if (!dlua_dtype_is_floating(t->dtype)) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a floating-point tensor, got %s", op, what,
                    dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

static dlua_status_t check_input(const char *op, const char *what, const dlua_tensor_t *x) {
  DLUA_TRY(check_float(op, what, x));
  if (x->ndim < 2 || x->ndim > 4) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must have 2 to 4 dimensions ((N, C), (N, C, L) or (N, C, H, W)), got %s", op,
                    what, dlua_tensor_describe(x, b, sizeof b));
  }
  return DLUA_OK;
}

/* A per-channel vector (may be NULL when optional): 1-D with C entries. */
static dlua_status_t check_vec(const char *op, const char *what, const dlua_tensor_t *t, const dlua_tensor_t *x) {
  if (!t) return DLUA_OK;
  DLUA_TRY(check_float(op, what, t));
  if (t->ndim != 1 || t->sizes[0] != x->sizes[1]) {
    char b1[200], b2[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s must have shape (%" PRId64 "), one entry per channel of input %s", op, what,
                    dlua_tensor_describe(t, b1, sizeof b1), x->sizes[1], dlua_tensor_describe(x, b2, sizeof b2));
  }
  return DLUA_OK;
}

static dlua_status_t check_like(const char *op, const char *what, const dlua_tensor_t *t, const char *wx,
                                const dlua_tensor_t *x) {
  DLUA_TRY(check_float(op, what, t));
  int same = t->ndim == x->ndim;
  for (int d = 0; same && d < x->ndim; d++) same = t->sizes[d] == x->sizes[d];
  if (!same) {
    char b1[200], b2[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s must have the shape of %s %s", op, what, dlua_tensor_describe(t, b1, sizeof b1),
                    wx, dlua_tensor_describe(x, b2, sizeof b2));
  }
  return DLUA_OK;
}

static void geom_of(const dlua_tensor_t *x, int fmt, bn_geom_t *g) {
  g->N = x->sizes[0];
  g->C = x->sizes[1];
  g->S = 1;
  for (int d = 2; d < x->ndim; d++) g->S *= x->sizes[d];
  g->rows = fmt == ACT_CL || g->S == 1;
  g->block_rows = g->C > 0 && g->C < BN_BLOCK_ELEMS ? BN_BLOCK_ELEMS / g->C : 1;
}

/* Doubles of scratch the reductions need. */
static int64_t scratch_len(const bn_geom_t *g) {
  if (!g->rows) return 2 * g->N * g->C;
  int64_t M = g->N * g->S;
  return 2 * ((M + g->block_rows - 1) / g->block_rows) * g->C;
}

static void *xmalloc(size_t n, dlua_status_t *s, const char *op) {
  void *p = malloc(n ? n : 1);
  if (!p) *s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, n);
  return p;
}

/* A (C) statistics output under the `out` convention; NULL pointer: not wanted. */
static dlua_status_t save_vec(const char *op, dlua_tensor_t **out, int64_t C, dlua_dtype_t ct, const double *v) {
  if (!out) return DLUA_OK;
  int allocated = 0;
  DLUA_TRY(dlua_prepare_out(op, out, 1, &C, ct, &allocated));
  if (!dlua_dtype_is_floating((*out)->dtype)) {
    char b[200];
    dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG, "%s: saved statistics %s must be floating point", op,
                               dlua_tensor_describe(*out, b, sizeof b));
    if (allocated) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
    return s;
  }
  for (int64_t c = 0; c < C; c++) vec_set(*out, c, v[c]);
  return DLUA_OK;
}

/* ---- SyncBatchNorm's packed per-channel sums ------------------------------------------------------ */

/* A (2C+1) float64 contiguous vector: what the ranks all-reduce between the halves of forward
   ([sum x, sum x^2, count]) and of backward ([sum d, sum d (x - mean), count]). */
static dlua_status_t check_sums(const char *op, const char *what, const dlua_tensor_t *t, int64_t C) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  if (t->dtype != DLUA_DTYPE_F64 || t->ndim != 1 || t->sizes[0] != 2 * C + 1 || !dlua_tensor_is_contiguous(t)) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a contiguous float64 tensor of shape (%" PRId64 ") (2C+1, C = %" PRId64
                    "), got %s", op, what, 2 * C + 1, C, dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

/* The count (element 2C) of checked sums t, wherever t lives (a CUDA tensor's after its stream's work). */
static dlua_status_t sums_count(const char *op, const dlua_tensor_t *t, int64_t C, double *cnt) {
  const double *p = (const double *)dlua_tensor_ptr(t) + 2 * C;
  if (t->device == DLUA_CPU) {
    *cnt = *p;
    return DLUA_OK;
  }
#ifdef DLUA_HAVE_CUDA
  return dlua_cuda_nn_read(op, cnt, p, sizeof *cnt, t->device);
#else
  return dlua_require_cpu(op, t);
#endif
}

/* Undoes prepare_sums's allocation after a failure. */
static void drop_sums(dlua_tensor_t **sums, int *allocated) {
  if (*allocated) {
    dlua_tensor_free(*sums);
    *sums = NULL;
    *allocated = 0;
  }
}

/* *sums on `device` under the `out` convention, checked as above; *allocated says whether it was made here. */
static dlua_status_t prepare_sums(const char *op, dlua_tensor_t **sums, int64_t C, int device, int *allocated) {
  int64_t n = 2 * C + 1;
  *allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, sums, 1, &n, DLUA_DTYPE_F64, device, allocated));
  dlua_status_t s = check_sums(op, "sums", *sums, C);
  if (s != DLUA_OK) drop_sums(sums, allocated);
  return s;
}

/* ---- CUDA ---------------------------------------------------------------------------------------- */

/* The entry points check their arguments as for the CPU, then hand CUDA inputs to these drivers: they
   stage what the kernels cannot read in place (other layouts: contiguous copies, as the CPU) and launch
   host/cuda/batchnorm.cu. The kernels read and write one storage dtype, that of the activations when
   they agree (16-bit ones are converted in registers), else the CPU's compute dtype for all of them. */
#ifdef DLUA_HAVE_CUDA
static dlua_cuda_vec_t cuda_vec(const dlua_tensor_t *t) {
  dlua_cuda_vec_t v = {0};
  if (t) {
    v.p = dlua_tensor_ptr(t);
    v.dtype = (int)t->dtype;
    v.stride = t->strides[0];
  }
  return v;
}

static dlua_cuda_bn_geom_t cuda_geom(const bn_geom_t *g, dlua_dtype_t kt, int device) {
  dlua_cuda_bn_geom_t cg = {.dtype = (int)kt, .rows = g->rows, .device = device, .N = g->N, .C = g->C, .S = g->S};
  return cg;
}

/* A (C) statistics output on `device` under the `out` convention (save_vec's checks; the kernels write it). */
static dlua_status_t cuda_save(const char *op, dlua_tensor_t **out, int64_t C, dlua_dtype_t ct, int device,
                               int *allocated) {
  *allocated = 0;
  if (!out) return DLUA_OK;
  DLUA_TRY(dlua_prepare_out_on(op, out, 1, &C, ct, device, allocated));
  if (dlua_dtype_is_floating((*out)->dtype)) return DLUA_OK;
  char b[200];
  dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG, "%s: saved statistics %s must be floating point", op,
                             dlua_tensor_describe(*out, b, sizeof b));
  if (*allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
    *allocated = 0;
  }
  return s;
}

static void cuda_unsave(dlua_tensor_t **out, int allocated) {
  if (out && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
}

/* bn_forward's work on a CUDA device (stats_out: batch_norm_stats's instead, no output). */
static dlua_status_t cuda_bn_forward(const char *op, dlua_tensor_t **out, dlua_tensor_t **save_mean,
                                     dlua_tensor_t **save_invstd, const dlua_tensor_t *x, const dlua_tensor_t *gamma,
                                     const dlua_tensor_t *beta, const dlua_tensor_t *skip, const dlua_tensor_t *stats,
                                     dlua_tensor_t *running_mean, dlua_tensor_t *running_var, int train,
                                     double momentum, double eps, int relu, int fmt, const bn_geom_t *g, int64_t M,
                                     dlua_tensor_t *stats_out) {
  const int dev = x->device;
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  const dlua_dtype_t kt = !skip || skip->dtype == x->dtype ? x->dtype : ct;
  dlua_tensor_t *xs = NULL, *ss = NULL;
  act_out_t o = {0};
  int am = 0, ai = 0;
  const dlua_tensor_t *ins[2] = {x, skip};
  dlua_status_t s = act_stage(x, kt, fmt, &xs);
  if (s == DLUA_OK && skip) s = act_stage(skip, kt, fmt, &ss);
  if (s == DLUA_OK && out) s = act_out_begin_on(op, &o, out, x->ndim, x->sizes, x->dtype, kt, fmt, ins, 2, 1, dev);
  if (s == DLUA_OK) s = cuda_save(op, save_mean, g->C, ct, dev, &am);
  if (s == DLUA_OK) s = cuda_save(op, save_invstd, g->C, ct, dev, &ai);
  if (s == DLUA_OK) {
    dlua_cuda_bn_fwd_t a = {.g = cuda_geom(g, kt, dev),
                            .x = dlua_tensor_ptr(xs),
                            .skip = ss ? dlua_tensor_ptr(ss) : NULL,
                            .y = out ? dlua_tensor_ptr(o.work) : NULL,
                            .gamma = cuda_vec(gamma),
                            .beta = cuda_vec(beta),
                            .running_mean = cuda_vec(running_mean),
                            .running_var = cuda_vec(running_var),
                            .save_mean = cuda_vec(save_mean ? *save_mean : NULL),
                            .save_invstd = cuda_vec(save_invstd ? *save_invstd : NULL),
                            .stats = stats ? (const double *)dlua_tensor_ptr(stats) : NULL,
                            .stats_out = stats_out ? (double *)dlua_tensor_ptr(stats_out) : NULL,
                            .M = M,
                            .train = train,
                            .relu = relu,
                            .momentum = momentum,
                            .eps = eps};
    s = dlua_cuda_bn_forward(op, &a);
  }
  s = act_out_end(&o, s);
  if (s != DLUA_OK) {
    cuda_unsave(save_mean, am);
    cuda_unsave(save_invstd, ai);
  }
  dlua_tensor_free(xs);
  dlua_tensor_free(ss);
  return s;
}

/* bn_backward's work on a CUDA device. */
static dlua_status_t cuda_bn_backward(const char *op, dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip,
                                      dlua_tensor_t *grad_gamma, dlua_tensor_t *grad_beta,
                                      const dlua_tensor_t *grad_output, const dlua_tensor_t *x,
                                      const dlua_tensor_t *output, const dlua_tensor_t *gamma,
                                      const dlua_tensor_t *save_mean, const dlua_tensor_t *save_invstd, int train,
                                      int relu, int accumulate, dlua_tensor_t *sums_out, const dlua_tensor_t *sums_in,
                                      int fmt, const bn_geom_t *g, int64_t M, int reduce, dlua_dtype_t ct) {
  const int dev = x->device;
  const int same = grad_output->dtype == x->dtype && (!relu || output->dtype == x->dtype);
  const dlua_dtype_t kt = same ? x->dtype : ct;
  dlua_tensor_t *xs = NULL, *ds = NULL, *ys = NULL;
  act_out_t odx = {0}, osk = {0};
  const dlua_tensor_t *ins[3] = {grad_output, x, relu ? output : NULL};
  dlua_status_t s = act_stage(x, kt, fmt, &xs);
  if (s == DLUA_OK) s = act_stage(grad_output, kt, fmt, &ds);
  if (s == DLUA_OK && relu) s = act_stage(output, kt, fmt, &ys);
  if (s == DLUA_OK)
    s = act_out_begin_on(op, &odx, grad_input, x->ndim, x->sizes, grad_output->dtype, kt, fmt, ins, 3, 1, dev);
  if (s == DLUA_OK)
    s = act_out_begin_on(op, &osk, grad_skip, x->ndim, x->sizes, grad_output->dtype, kt, fmt, ins, 3, 1, dev);
  if (s == DLUA_OK) {
    dlua_cuda_bn_bwd_t a = {.g = cuda_geom(g, kt, dev),
                            .x = dlua_tensor_ptr(xs),
                            .dy = dlua_tensor_ptr(ds),
                            .y = ys ? dlua_tensor_ptr(ys) : NULL,
                            .dx = grad_input ? dlua_tensor_ptr(odx.work) : NULL,
                            .dskip = grad_skip ? dlua_tensor_ptr(osk.work) : NULL,
                            .gamma = cuda_vec(gamma),
                            .save_mean = cuda_vec(save_mean),
                            .save_invstd = cuda_vec(save_invstd),
                            .grad_gamma = cuda_vec(grad_gamma),
                            .grad_beta = cuda_vec(grad_beta),
                            .sums_in = sums_in ? (const double *)dlua_tensor_ptr(sums_in) : NULL,
                            .sums_out = sums_out ? (double *)dlua_tensor_ptr(sums_out) : NULL,
                            .M = M,
                            .train = train,
                            .reduce = reduce,
                            .accumulate = accumulate};
    s = dlua_cuda_bn_backward(op, &a);
  }
  s = act_out_end(&odx, s);
  s = act_out_end(&osk, s);
  dlua_tensor_free(xs);
  dlua_tensor_free(ds);
  dlua_tensor_free(ys);
  return s;
}
#endif

/* ---- forward ------------------------------------------------------------------------------------- */

/* Forward in training from the batch (stats NULL) or from sums of several batches (stats: (2C+1)
   [sum x, sum x^2, count], SyncBatchNorm's second half), or in evaluation from the running ones. */
static dlua_status_t bn_forward(const char *op, dlua_tensor_t **out, dlua_tensor_t **save_mean,
                                dlua_tensor_t **save_invstd, const dlua_tensor_t *x, const dlua_tensor_t *gamma,
                                const dlua_tensor_t *beta, const dlua_tensor_t *skip, const dlua_tensor_t *stats,
                                dlua_tensor_t *running_mean, dlua_tensor_t *running_var, int train, double momentum,
                                double eps, int relu) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_input(op, "input", x));
  DLUA_TRY(check_vec(op, "gamma", gamma, x));
  DLUA_TRY(check_vec(op, "beta", beta, x));
  DLUA_TRY(check_vec(op, "running_mean", running_mean, x));
  DLUA_TRY(check_vec(op, "running_var", running_var, x));
  if (skip) DLUA_TRY(check_like(op, "skip", skip, "input", x));
  const dlua_tensor_t *peers[6] = {gamma, beta, running_mean, running_var, skip, stats};
  DLUA_TRY(act_same_device(op, x, peers, 6));
  if (!(eps >= 0) || !isfinite(eps)) return DLUA_ERR(DLUA_ERR_ARG, "%s: eps must be finite and >= 0, got %g", op, eps);
  char b[200];
  if (!train && (!running_mean || !running_var))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: evaluation of input %s needs running_mean and running_var", op,
                    dlua_tensor_describe(x, b, sizeof b));
  int fmt = act_format(x);
  if (fmt == ACT_OTHER) fmt = ACT_CONTIG;
  bn_geom_t g;
  geom_of(x, fmt, &g);
  const int64_t C = g.C;
  int64_t M = g.N * g.S;  // the values per channel the statistics cover (every rank's, with stats)
  if (stats) {
    DLUA_TRY(check_sums(op, "stats", stats, C));
    double cnt = 0;
    DLUA_TRY(sums_count(op, stats, C, &cnt));
    if (!(cnt >= 0) || cnt != floor(cnt) || cnt > 9e15)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: stats hold a count of %g values per channel, expected a whole number >= 0", op,
                      cnt);
    M = (int64_t)cnt;
  }
  if (train && M == 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected more than 1 value per channel when training, got input %s%s", op,
                    dlua_tensor_describe(x, b, sizeof b), stats ? " (over every rank)" : "");
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    return cuda_bn_forward(op, out, save_mean, save_invstd, x, gamma, beta, skip, stats, running_mean, running_var,
                           train, momentum, eps, relu, fmt, &g, M, NULL);
#else
    return dlua_require_cpu(op, x);
#endif
  }
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  const size_t es = dlua_dtype_size(ct);

  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *xs = NULL, *ss = NULL;
  double *dbl = NULL, *scratch = NULL;
  void *tv = NULL;
  act_out_t o = {0};
  const dlua_tensor_t *ins[2] = {x, skip};
  s = act_stage(x, ct, fmt, &xs);
  if (s == DLUA_OK && skip) s = act_stage(skip, ct, fmt, &ss);
  if (s == DLUA_OK) s = act_out_begin(op, &o, out, x->ndim, x->sizes, x->dtype, ct, fmt, ins, 2, 1);
  // mean, invstd, gamma, beta, sum, sumsq, running values: 7 doubles per channel.
  if (s == DLUA_OK) dbl = xmalloc((size_t)(7 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK) tv = xmalloc((size_t)(3 * C) * es, &s, op);
  if (s == DLUA_OK && train && !stats && M > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s != DLUA_OK) goto done;
  double *mean = dbl, *invstd = dbl + C, *gm = dbl + 2 * C, *bt = dbl + 3 * C, *sum = dbl + 4 * C, *sq = dbl + 5 * C,
         *run = dbl + 6 * C;
  vec_read(gamma, C, gm, 1.0);
  vec_read(beta, C, bt, 0.0);
  const void *xp = dlua_tensor_ptr(xs);
  if (train && stats) {
    // Unshifted sums in double: var = E[x^2] - mean^2 loses about |mean|^2 / var * 1e-16 of var.
    const double *st = (const double *)dlua_tensor_ptr(stats);
    for (int64_t c = 0; c < C; c++) {
      double m = M > 0 ? st[c] / (double)M : 0.0;
      double var = M > 0 ? st[C + c] / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean[c] = m;
      invstd[c] = 1.0 / sqrt(var + eps);
      sq[c] = var;
    }
  } else if (train) {
    if (M > 0) {
      // Shift by the channel's first element (the first plane, or the first row).
      for (int64_t c = 0; c < C; c++)
        run[c] = ct == DLUA_DTYPE_F64 ? ((const double *)xp)[g.rows ? c : c * g.S] : ((const float *)xp)[g.rows ? c : c * g.S];
      if (ct == DLUA_DTYPE_F64) bn_stats_f64(&g, xp, run, scratch, sum, sq);
      else bn_stats_f32(&g, xp, run, scratch, sum, sq);
    }
    for (int64_t c = 0; c < C; c++) {
      double m = M > 0 ? sum[c] / (double)M : 0.0;
      double var = M > 0 ? sq[c] / (double)M - m * m : 0.0;
      if (var < 0) var = 0;
      mean[c] = M > 0 ? run[c] + m : 0.0;
      invstd[c] = 1.0 / sqrt(var + eps);
      sq[c] = var;  // the biased variance, for the running update below
    }
  }
  if (train) {
    if (M > 1) {
      const double unbias = (double)M / (double)(M - 1);
      if (running_mean) {
        vec_read(running_mean, C, run, 0.0);
        for (int64_t c = 0; c < C; c++) vec_set(running_mean, c, (1 - momentum) * run[c] + momentum * mean[c]);
      }
      if (running_var) {
        vec_read(running_var, C, run, 0.0);
        for (int64_t c = 0; c < C; c++) vec_set(running_var, c, (1 - momentum) * run[c] + momentum * sq[c] * unbias);
      }
    }
  } else {
    vec_read(running_mean, C, mean, 0.0);
    vec_read(running_var, C, run, 0.0);
    for (int64_t c = 0; c < C; c++) invstd[c] = 1.0 / sqrt(run[c] + eps);
  }
  // Normalise with the invstd that is saved (in ct), so that the backward, from the saved values,
  // recomputes this pass's ReLU mask exactly (dlua_nn_batch_norm_backward's beta).
  if (ct == DLUA_DTYPE_F32)
    for (int64_t c = 0; c < C; c++) invstd[c] = (double)(float)invstd[c];
  const void *sp = ss ? dlua_tensor_ptr(ss) : NULL;
  void *yp = dlua_tensor_ptr(o.work);
  void *tm = tv, *ta = (char *)tv + C * es, *tb = (char *)tv + 2 * C * es;
  put_t(ct, tm, mean, C);
  for (int64_t c = 0; c < C; c++) gm[c] *= invstd[c];
  put_t(ct, ta, gm, C);
  put_t(ct, tb, bt, C);
  if (ct == DLUA_DTYPE_F64) bn_apply_f64(&g, xp, sp, yp, tm, ta, tb, relu);
  else bn_apply_f32(&g, xp, sp, yp, tm, ta, tb, relu);
  s = save_vec(op, save_mean, C, ct, mean);
  if (s == DLUA_OK) s = save_vec(op, save_invstd, C, ct, invstd);
done:
  s = act_out_end(&o, s);
  free(dbl);
  free(tv);
  free(scratch);
  dlua_tensor_free(xs);
  dlua_tensor_free(ss);
  return s;
}

dlua_status_t dlua_nn_batch_norm_forward(dlua_tensor_t **out, dlua_tensor_t **save_mean, dlua_tensor_t **save_invstd,
                                         const dlua_tensor_t *x, const dlua_tensor_t *gamma, const dlua_tensor_t *beta,
                                         const dlua_tensor_t *skip, dlua_tensor_t *running_mean,
                                         dlua_tensor_t *running_var, int train, double momentum, double eps, int relu) {
  return bn_forward("batch_norm", out, save_mean, save_invstd, x, gamma, beta, skip, NULL, running_mean, running_var,
                    train, momentum, eps, relu);
}

dlua_status_t dlua_nn_batch_norm_apply(dlua_tensor_t **out, dlua_tensor_t **save_mean, dlua_tensor_t **save_invstd,
                                       const dlua_tensor_t *x, const dlua_tensor_t *gamma, const dlua_tensor_t *beta,
                                       const dlua_tensor_t *skip, const dlua_tensor_t *stats,
                                       dlua_tensor_t *running_mean, dlua_tensor_t *running_var, double momentum,
                                       double eps, int relu) {
  const char *op = "batch_norm_apply";
  if (!stats) return DLUA_ERR(DLUA_ERR_ARG, "%s: stats is NULL", op);
  return bn_forward(op, out, save_mean, save_invstd, x, gamma, beta, skip, stats, running_mean, running_var, 1,
                    momentum, eps, relu);
}

/* Sums of x and x^2 per channel, and the count, of this batch: SyncBatchNorm's first half. */
dlua_status_t dlua_nn_batch_norm_stats(dlua_tensor_t **stats, const dlua_tensor_t *x) {
  const char *op = "batch_norm_stats";
  DLUA_TRY(check_input(op, "input", x));
  int fmt = act_format(x);
  if (fmt == ACT_OTHER) fmt = ACT_CONTIG;
  bn_geom_t g;
  geom_of(x, fmt, &g);
  const int64_t C = g.C, M = g.N * g.S;
  if (!stats) return DLUA_ERR(DLUA_ERR_ARG, "%s: stats is NULL", op);
  int allocated = 0;
  DLUA_TRY(prepare_sums(op, stats, C, x->device, &allocated));
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    dlua_status_t cs = cuda_bn_forward(op, NULL, NULL, NULL, x, NULL, NULL, NULL, NULL, NULL, NULL, 1, 0.0, 0.0, 0, fmt,
                                       &g, M, *stats);
#else
    dlua_status_t cs = dlua_require_cpu(op, x);
#endif
    if (cs != DLUA_OK) drop_sums(stats, &allocated);
    return cs;
  }
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *xs = NULL;
  double *dbl = NULL, *scratch = NULL;
  s = act_stage(x, ct, fmt, &xs);
  if (s == DLUA_OK) dbl = xmalloc((size_t)(3 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK && M > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s != DLUA_OK) goto done;
  double *out = (double *)dlua_tensor_ptr(*stats), *sh = dbl, *sum = dbl + C, *sq = dbl + 2 * C;
  for (int64_t c = 0; c < 2 * C; c++) out[c] = 0;
  if (M > 0) {
    // As forward: sums of x - shift (a value of the channel), then the shift put back, in double.
    const void *xp = dlua_tensor_ptr(xs);
    for (int64_t c = 0; c < C; c++)
      sh[c] = ct == DLUA_DTYPE_F64 ? ((const double *)xp)[g.rows ? c : c * g.S] : ((const float *)xp)[g.rows ? c : c * g.S];
    if (ct == DLUA_DTYPE_F64) bn_stats_f64(&g, xp, sh, scratch, sum, sq);
    else bn_stats_f32(&g, xp, sh, scratch, sum, sq);
    for (int64_t c = 0; c < C; c++) {
      out[c] = sum[c] + (double)M * sh[c];
      out[C + c] = sq[c] + sh[c] * (2.0 * sum[c] + (double)M * sh[c]);
    }
  }
  out[2 * C] = (double)M;
done:
  if (s != DLUA_OK) drop_sums(stats, &allocated);
  free(dbl);
  free(scratch);
  dlua_tensor_free(xs);
  return s;
}

/* ---- backward ------------------------------------------------------------------------------------ */

static dlua_status_t param_grad(const char *op, const char *what, dlua_tensor_t *t, const dlua_tensor_t *x) {
  if (!t) return DLUA_OK;
  return check_vec(op, what, t, x);
}

/* Backward whole (sums_out and sums_in NULL), or its halves for SyncBatchNorm: with sums_out, the
   per-channel reductions only ([sum d, sum d (x - mean), count] into *sums_out, and the local
   grad_gamma/grad_beta); with sums_in, the elementwise pass only, from reductions summed over
   every rank (their count normalises). */
static dlua_status_t bn_backward(const char *op, dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip,
                                 dlua_tensor_t *grad_gamma, dlua_tensor_t *grad_beta, const dlua_tensor_t *grad_output,
                                 const dlua_tensor_t *x, const dlua_tensor_t *output, const dlua_tensor_t *gamma,
                                 const dlua_tensor_t *beta, const dlua_tensor_t *save_mean,
                                 const dlua_tensor_t *save_invstd, int train, int relu, int accumulate,
                                 dlua_tensor_t **sums_out, const dlua_tensor_t *sums_in) {
  DLUA_TRY(check_input(op, "input", x));
  DLUA_TRY(check_like(op, "grad_output", grad_output, "input", x));
  if (relu) {
    if (!output) return DLUA_ERR(DLUA_ERR_ARG, "%s: relu needs the forward's output, got NULL", op);
    DLUA_TRY(check_like(op, "output", output, "input", x));
  }
  DLUA_TRY(check_vec(op, "gamma", gamma, x));
  DLUA_TRY(check_vec(op, "beta", beta, x));
  if (!save_mean || !save_invstd) return DLUA_ERR(DLUA_ERR_ARG, "%s: save_mean and save_invstd are required", op);
  DLUA_TRY(check_vec(op, "save_mean", save_mean, x));
  DLUA_TRY(check_vec(op, "save_invstd", save_invstd, x));
  DLUA_TRY(param_grad(op, "grad_gamma", grad_gamma, x));
  DLUA_TRY(param_grad(op, "grad_beta", grad_beta, x));
  const dlua_tensor_t *peers[9] = {grad_output, relu ? output : NULL, gamma, beta, save_mean, save_invstd,
                                   grad_gamma, grad_beta, sums_in};
  DLUA_TRY(act_same_device(op, x, peers, 9));
  if (grad_input && grad_skip && *grad_input && *grad_input == *grad_skip)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input and grad_skip must be different tensors", op);

  // Gradients take the forward input's layout (as in PyTorch), so a channels-last network's
  // backward stays channels-last whatever layout the incoming gradient has.
  const int fmt = act_format_pref(x, grad_output);
  bn_geom_t g;
  geom_of(x, fmt, &g);
  const int64_t C = g.C;
  int64_t M = g.N * g.S;
  int sums_allocated = 0;
  if (sums_out) DLUA_TRY(prepare_sums(op, sums_out, C, x->device, &sums_allocated));
  if (sums_in) {
    DLUA_TRY(check_sums(op, "sums", sums_in, C));
    double cnt = 0;
    DLUA_TRY(sums_count(op, sums_in, C, &cnt));
    if (!(cnt >= 0) || cnt != floor(cnt) || cnt > 9e15)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: sums hold a count of %g values per channel, expected a whole number >= 0", op,
                      cnt);
    M = (int64_t)cnt;
  }
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 || grad_output->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  const size_t es = dlua_dtype_size(ct);
  const int want_dx = grad_input != NULL, want_skip = grad_skip != NULL;
  const int reduce = !sums_in && (sums_out || (want_dx && train) || grad_gamma || grad_beta);
  if (x->device != DLUA_CPU) {
#ifdef DLUA_HAVE_CUDA
    dlua_status_t cs = cuda_bn_backward(op, grad_input, grad_skip, grad_gamma, grad_beta, grad_output, x, output, gamma,
                                        save_mean, save_invstd, train, relu, accumulate, sums_out ? *sums_out : NULL,
                                        sums_in, fmt, &g, M, reduce, ct);
#else
    dlua_status_t cs = dlua_require_cpu(op, x);
#endif
    if (cs != DLUA_OK && sums_out) drop_sums(sums_out, &sums_allocated);
    return cs;
  }

  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *xs = NULL, *ds = NULL, *ys = NULL;
  double *dbl = NULL, *scratch = NULL;
  void *tv = NULL;
  act_out_t odx = {0}, osk = {0};
  const dlua_tensor_t *ins[3] = {grad_output, x, relu ? output : NULL};
  // With beta, the ReLU mask is the forward's own test redone from x, one stream less than reading
  // the output; an output in a narrower dtype than ct may have rounded a tiny value to 0, so then
  // the output decides as before.
  const int mask_x = relu && beta && output->dtype == ct;
  s = act_stage(x, ct, fmt, &xs);
  if (s == DLUA_OK) s = act_stage(grad_output, ct, fmt, &ds);
  if (s == DLUA_OK && relu && !mask_x) s = act_stage(output, ct, fmt, &ys);
  if (s == DLUA_OK)
    s = act_out_begin(op, &odx, grad_input, x->ndim, x->sizes, grad_output->dtype, ct, fmt, ins, 3, 1);
  if (s == DLUA_OK) s = act_out_begin(op, &osk, grad_skip, x->ndim, x->sizes, grad_output->dtype, ct, fmt, ins, 3, 1);
  // mean, invstd, gamma, sum dy, sum dy (x - mean), and a scratch row: 6 doubles per channel.
  if (s == DLUA_OK) dbl = xmalloc((size_t)(6 * C) * sizeof(double), &s, op);
  if (s == DLUA_OK) tv = xmalloc((size_t)(6 * C) * es, &s, op);
  if (s == DLUA_OK && reduce && g.N * g.S > 0) scratch = xmalloc((size_t)scratch_len(&g) * sizeof(double), &s, op);
  if (s != DLUA_OK) goto done;
  double *mean = dbl, *invstd = dbl + C, *gm = dbl + 2 * C, *sdy = dbl + 3 * C, *sdx = dbl + 4 * C;
  vec_read(save_mean, C, mean, 0.0);
  vec_read(save_invstd, C, invstd, 1.0);
  vec_read(gamma, C, gm, 1.0);
  const void *xp = dlua_tensor_ptr(xs), *dp = dlua_tensor_ptr(ds), *yp = ys ? dlua_tensor_ptr(ys) : NULL;
  // Per-channel coefficients in the compute type: mean, then A, B, D of the elementwise pass, then
  // the forward's scale gamma * invstd and shift beta when the mask is recomputed.
  void *tm = tv, *ta = (char *)tv + C * es, *tb = (char *)tv + 2 * C * es, *td = (char *)tv + 3 * C * es;
  void *fa = NULL, *fb = NULL;
  put_t(ct, tm, mean, C);
  if (mask_x) {
    double *row = dbl + 5 * C;
    fa = (char *)tv + 4 * C * es;
    fb = (char *)tv + 5 * C * es;
    for (int64_t c = 0; c < C; c++) row[c] = gm[c] * invstd[c];
    put_t(ct, fa, row, C);
    vec_read(beta, C, row, 0.0);
    put_t(ct, fb, row, C);
  }
  for (int64_t c = 0; c < C; c++) sdy[c] = sdx[c] = 0;
  if (reduce && g.N * g.S > 0) {
    if (ct == DLUA_DTYPE_F64) bn_bwd_reduce_f64(&g, xp, dp, yp, tm, fa, fb, scratch, sdy, sdx);
    else bn_bwd_reduce_f32(&g, xp, dp, yp, tm, fa, fb, scratch, sdy, sdx);
  }
  if (sums_in) {
    const double *si = (const double *)dlua_tensor_ptr(sums_in);
    for (int64_t c = 0; c < C; c++) sdy[c] = si[c], sdx[c] = si[C + c];
  }
  if (sums_out) {
    double *so = (double *)dlua_tensor_ptr(*sums_out);
    for (int64_t c = 0; c < C; c++) so[c] = sdy[c], so[C + c] = sdx[c];
    so[2 * C] = (double)M;
  }
  for (int64_t c = 0; c < C; c++) {
    if (grad_gamma) vec_set(grad_gamma, c, (accumulate ? vec_get(grad_gamma, c) : 0.0) + sdx[c] * invstd[c]);
    if (grad_beta) vec_set(grad_beta, c, (accumulate ? vec_get(grad_beta, c) : 0.0) + sdy[c]);
  }
  if (want_dx || want_skip) {
    void *gxp = want_dx ? dlua_tensor_ptr(odx.work) : NULL, *gsp = want_skip ? dlua_tensor_ptr(osk.work) : NULL;
    // dx = gamma invstd (d - sum(d) / M - xhat sum(d xhat) / M) with the batch's statistics;
    // gamma invstd d with fixed ones. A, B, D overwrite sdy, sdx, gamma channel by channel.
    double *A = sdy, *B = sdx, *D = gm;
    for (int64_t c = 0; c < C; c++) {
      double a = gm[c] * invstd[c];
      double bb = train && M > 0 ? -a * invstd[c] * invstd[c] * sdx[c] / (double)M : 0.0;
      double dd = train && M > 0 ? -a * sdy[c] / (double)M : 0.0;
      A[c] = a;
      B[c] = bb;
      D[c] = dd;
    }
    put_t(ct, ta, A, C);
    put_t(ct, tb, B, C);
    put_t(ct, td, D, C);
    if (ct == DLUA_DTYPE_F64) bn_bwd_apply_f64(&g, xp, dp, yp, gxp, gsp, tm, fa, fb, ta, tb, td);
    else bn_bwd_apply_f32(&g, xp, dp, yp, gxp, gsp, tm, fa, fb, ta, tb, td);
  }
done:
  s = act_out_end(&odx, s);
  s = act_out_end(&osk, s);
  if (s != DLUA_OK && sums_out) drop_sums(sums_out, &sums_allocated);
  free(dbl);
  free(tv);
  free(scratch);
  dlua_tensor_free(xs);
  dlua_tensor_free(ds);
  dlua_tensor_free(ys);
  return s;
}

dlua_status_t dlua_nn_batch_norm_backward(dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip,
                                          dlua_tensor_t *grad_gamma, dlua_tensor_t *grad_beta,
                                          const dlua_tensor_t *grad_output, const dlua_tensor_t *x,
                                          const dlua_tensor_t *output, const dlua_tensor_t *gamma,
                                          const dlua_tensor_t *beta, const dlua_tensor_t *save_mean,
                                          const dlua_tensor_t *save_invstd, int train, int relu, int accumulate) {
  return bn_backward("batch_norm_backward", grad_input, grad_skip, grad_gamma, grad_beta, grad_output, x, output, gamma,
                     beta, save_mean, save_invstd, train, relu, accumulate, NULL, NULL);
}

dlua_status_t dlua_nn_batch_norm_backward_reduce(dlua_tensor_t **sums, dlua_tensor_t *grad_gamma,
                                                 dlua_tensor_t *grad_beta, const dlua_tensor_t *grad_output,
                                                 const dlua_tensor_t *x, const dlua_tensor_t *output,
                                                 const dlua_tensor_t *gamma, const dlua_tensor_t *beta,
                                                 const dlua_tensor_t *save_mean, const dlua_tensor_t *save_invstd,
                                                 int relu, int accumulate) {
  const char *op = "batch_norm_backward_reduce";
  if (!sums) return DLUA_ERR(DLUA_ERR_ARG, "%s: sums is NULL", op);
  return bn_backward(op, NULL, NULL, grad_gamma, grad_beta, grad_output, x, output, gamma, beta, save_mean, save_invstd,
                     1, relu, accumulate, sums, NULL);
}

dlua_status_t dlua_nn_batch_norm_backward_apply(dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip,
                                                const dlua_tensor_t *grad_output, const dlua_tensor_t *x,
                                                const dlua_tensor_t *output, const dlua_tensor_t *gamma,
                                                const dlua_tensor_t *beta, const dlua_tensor_t *save_mean,
                                                const dlua_tensor_t *save_invstd, const dlua_tensor_t *sums, int relu) {
  const char *op = "batch_norm_backward_apply";
  if (!sums) return DLUA_ERR(DLUA_ERR_ARG, "%s: sums is NULL", op);
  return bn_backward(op, grad_input, grad_skip, NULL, NULL, grad_output, x, output, gamma, beta, save_mean, save_invstd,
                     1, relu, 0, NULL, sums);
}

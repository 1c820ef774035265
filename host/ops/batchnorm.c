/* Batch normalisation's front doors (PyTorch's BatchNorm1d/2d, fused with ReLU and a residual add;
   SyncBatchNorm's halves): argument checks, layouts and staging, the `out` convention, then one call
   through the device's norm table (kernels/norm.h; the kernels are host/cpu/batchnorm.c, which holds
   all the per-channel arithmetic, and host/cuda/batchnorm.cu). This file does no floating-point
   arithmetic: the CPU's bits come from host/cpu/batchnorm.c alone (built with -ffp-contract=off). */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "kernels/norm.h"
#include "ops/backend.h"
#include "ops/common.h"

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

/* The activations: floating point, (N, C), (N, C, L) or (N, C, H, W). */
static dlua_status_t check_act(const char *op, const char *what, const dlua_tensor_t *x) {
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

/* x seen as N planes of C channels of S positions (planar) or as N * S rows of C channels (rows:
   channels-last memory, or S == 1 where both are the same bytes), its kernels' dtype kt, on x's device. */
static dlua_bn_geom_t geom_of(const dlua_tensor_t *x, int fmt, dlua_dtype_t kt) {
  dlua_bn_geom_t g = {.dtype = (int)kt, .device = x->device, .N = x->sizes[0], .C = x->sizes[1], .S = 1};
  for (int d = 2; d < x->ndim; d++) g.S *= x->sizes[d];
  g.rows = fmt == ACT_CL || g.S == 1;
  return g;
}

/* The dtype the kernels read and write: the activations' own where the backend takes 16-bit ones and
   the tensors agree, else the compute dtype ct. */
static dlua_dtype_t kernel_dtype(const struct dlua_norm_ops *k, dlua_dtype_t act, int agree, dlua_dtype_t ct) {
  return k->native_16bit && agree ? act : ct;
}

static dlua_bn_vec_t vec_of(const dlua_tensor_t *t) {
  dlua_bn_vec_t v = {0};
  if (t) {
    v.p = dlua_tensor_ptr(t);
    v.dtype = (int)t->dtype;
    v.stride = t->strides[0];
  }
  return v;
}

/* A (C) statistics output on `device` under the `out` convention (floating point, any stride; the kernels write it). */
static dlua_status_t save_begin(const char *op, dlua_tensor_t **out, int64_t C, dlua_dtype_t ct, int device,
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

static void save_drop(dlua_tensor_t **out, int allocated) {
  if (out && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
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

/* The count (element 2C) of checked sums t, as a whole number of values per channel, wherever t lives
   (a device tensor's after its stream's work: dlua_tensor_to_data waits). */
static dlua_status_t sums_count(const char *op, const char *what, const dlua_tensor_t *t, int64_t C, int64_t *M) {
  const int64_t one = 1, unit = 1;
  dlua_tensor_t *v = NULL;
  double cnt = 0;
  DLUA_TRY(dlua_tensor_as_strided(&v, t, 1, &one, &unit, t->offset + 2 * C));
  dlua_status_t s = dlua_tensor_to_data(v, &cnt, sizeof cnt);
  dlua_tensor_free(v);
  DLUA_TRY(s);
  if (!(cnt >= 0) || cnt != floor(cnt) || cnt > 9e15)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s hold a count of %g values per channel, expected a whole number >= 0", op, what,
                    cnt);
  *M = (int64_t)cnt;
  return DLUA_OK;
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

/* ---- forward ------------------------------------------------------------------------------------- */

/* The staged call of a forward (x checked, M settled): x and skip in the kernels' dtype and x's
   layout, out and the saved statistics under the `out` convention; stats_out: batch_norm_stats's
   sums instead of a normalisation (out NULL). */
static dlua_status_t fwd_run(const char *op, const struct dlua_norm_ops *k, dlua_tensor_t **out,
                             dlua_tensor_t **save_mean, dlua_tensor_t **save_invstd, const dlua_tensor_t *x,
                             const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *skip,
                             const dlua_tensor_t *stats, dlua_tensor_t *running_mean, dlua_tensor_t *running_var,
                             int train, double momentum, double eps, int relu, int fmt, int64_t M,
                             dlua_tensor_t *stats_out) {
  const int dev = x->device;
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  const dlua_dtype_t kt = kernel_dtype(k, x->dtype, !skip || skip->dtype == x->dtype, ct);
  const dlua_bn_geom_t g = geom_of(x, fmt, kt);
  dlua_tensor_t *xs = NULL, *ss = NULL;
  act_out_t o = {0};
  int am = 0, ai = 0;
  const dlua_tensor_t *ins[2] = {x, skip};
  dlua_status_t s = act_stage(x, kt, fmt, &xs);
  if (s == DLUA_OK && skip) s = act_stage(skip, kt, fmt, &ss);
  if (s == DLUA_OK && out) s = act_out_begin_on(op, &o, out, x->ndim, x->sizes, x->dtype, kt, fmt, ins, 2, 1, dev);
  if (s == DLUA_OK) s = save_begin(op, save_mean, g.C, ct, dev, &am);
  if (s == DLUA_OK) s = save_begin(op, save_invstd, g.C, ct, dev, &ai);
  if (s == DLUA_OK) {
    const dlua_bn_fwd_t a = {.g = g,
                             .x = dlua_tensor_ptr(xs),
                             .skip = ss ? dlua_tensor_ptr(ss) : NULL,
                             .y = out ? dlua_tensor_ptr(o.work) : NULL,
                             .gamma = vec_of(gamma),
                             .beta = vec_of(beta),
                             .running_mean = vec_of(running_mean),
                             .running_var = vec_of(running_var),
                             .save_mean = vec_of(save_mean ? *save_mean : NULL),
                             .save_invstd = vec_of(save_invstd ? *save_invstd : NULL),
                             .stats = stats ? (const double *)dlua_tensor_ptr(stats) : NULL,
                             .stats_out = stats_out ? (double *)dlua_tensor_ptr(stats_out) : NULL,
                             .M = M,
                             .train = train,
                             .relu = relu,
                             .momentum = momentum,
                             .eps = eps};
    s = k->forward(op, &a);
  }
  s = act_out_end(&o, s);
  if (s != DLUA_OK) {
    save_drop(save_mean, am);
    save_drop(save_invstd, ai);
  }
  dlua_tensor_free(xs);
  dlua_tensor_free(ss);
  return s;
}

/* Forward in training from the batch (stats NULL) or from sums of several batches (stats: (2C+1)
   [sum x, sum x^2, count], SyncBatchNorm's second half), or in evaluation from the running ones. */
static dlua_status_t bn_forward(const char *op, dlua_tensor_t **out, dlua_tensor_t **save_mean,
                                dlua_tensor_t **save_invstd, const dlua_tensor_t *x, const dlua_tensor_t *gamma,
                                const dlua_tensor_t *beta, const dlua_tensor_t *skip, const dlua_tensor_t *stats,
                                dlua_tensor_t *running_mean, dlua_tensor_t *running_var, int train, double momentum,
                                double eps, int relu) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  DLUA_TRY(check_act(op, "input", x));
  DLUA_TRY(check_vec(op, "gamma", gamma, x));
  DLUA_TRY(check_vec(op, "beta", beta, x));
  DLUA_TRY(check_vec(op, "running_mean", running_mean, x));
  DLUA_TRY(check_vec(op, "running_var", running_var, x));
  if (skip) DLUA_TRY(check_like(op, "skip", skip, "input", x));
  const dlua_tensor_t *peers[6] = {gamma, beta, running_mean, running_var, skip, stats};
  DLUA_TRY(dlua_ops_check_peers(op, x, peers, 6));
  if (!(eps >= 0) || !isfinite(eps)) return DLUA_ERR(DLUA_ERR_ARG, "%s: eps must be finite and >= 0, got %g", op, eps);
  char b[200];
  if (!train && (!running_mean || !running_var))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: evaluation of input %s needs running_mean and running_var", op,
                    dlua_tensor_describe(x, b, sizeof b));
  const struct dlua_norm_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, norm, forward, &k));
  int fmt = act_format(x);
  if (fmt == ACT_OTHER) fmt = ACT_CONTIG;
  const int64_t C = x->sizes[1];
  int64_t M = x->sizes[0];  // the values per channel the statistics cover (every rank's, with stats)
  for (int d = 2; d < x->ndim; d++) M *= x->sizes[d];
  if (stats) {
    DLUA_TRY(check_sums(op, "stats", stats, C));
    DLUA_TRY(sums_count(op, "stats", stats, C, &M));
  }
  if (train && M == 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected more than 1 value per channel when training, got input %s%s", op,
                    dlua_tensor_describe(x, b, sizeof b), stats ? " (over every rank)" : "");
  return fwd_run(op, k, out, save_mean, save_invstd, x, gamma, beta, skip, stats, running_mean, running_var, train,
                 momentum, eps, relu, fmt, M, NULL);
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
  DLUA_TRY(check_act(op, "input", x));
  int fmt = act_format(x);
  if (fmt == ACT_OTHER) fmt = ACT_CONTIG;
  const int64_t C = x->sizes[1];
  int64_t M = x->sizes[0];
  for (int d = 2; d < x->ndim; d++) M *= x->sizes[d];
  if (!stats) return DLUA_ERR(DLUA_ERR_ARG, "%s: stats is NULL", op);
  const struct dlua_norm_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, norm, forward, &k));
  int allocated = 0;
  DLUA_TRY(prepare_sums(op, stats, C, x->device, &allocated));
  dlua_status_t s = fwd_run(op, k, NULL, NULL, NULL, x, NULL, NULL, NULL, NULL, NULL, NULL, 1, 0.0, 0.0, 0, fmt, M,
                            *stats);
  if (s != DLUA_OK) drop_sums(stats, &allocated);
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
  DLUA_TRY(check_act(op, "input", x));
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
  DLUA_TRY(dlua_ops_check_peers(op, x, peers, 9));
  if (grad_input && grad_skip && *grad_input && *grad_input == *grad_skip)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: grad_input and grad_skip must be different tensors", op);
  const struct dlua_norm_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, x->device, norm, backward, &k));

  // Gradients take the forward input's layout (as in PyTorch), so a channels-last network's
  // backward stays channels-last whatever layout the incoming gradient has.
  const int fmt = act_format_pref(x, grad_output);
  const int dev = x->device;
  const dlua_dtype_t ct = x->dtype == DLUA_DTYPE_F64 || grad_output->dtype == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32;
  const int same = grad_output->dtype == x->dtype && (!relu || output->dtype == x->dtype);
  const dlua_dtype_t kt = kernel_dtype(k, x->dtype, same, ct);
  const dlua_bn_geom_t g = geom_of(x, fmt, kt);
  const int64_t C = g.C;
  int64_t M = g.N * g.S;
  int sums_allocated = 0;
  if (sums_out) DLUA_TRY(prepare_sums(op, sums_out, C, dev, &sums_allocated));
  if (sums_in) {
    DLUA_TRY(check_sums(op, "sums", sums_in, C));
    DLUA_TRY(sums_count(op, "sums", sums_in, C, &M));
  }
  const int reduce = !sums_in && (sums_out || (grad_input && train) || grad_gamma || grad_beta);

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
    const dlua_bn_bwd_t a = {.g = g,
                             .x = dlua_tensor_ptr(xs),
                             .dy = dlua_tensor_ptr(ds),
                             .y = ys ? dlua_tensor_ptr(ys) : NULL,
                             .y_exact = relu && output->dtype == kt,
                             .dx = grad_input ? dlua_tensor_ptr(odx.work) : NULL,
                             .dskip = grad_skip ? dlua_tensor_ptr(osk.work) : NULL,
                             .gamma = vec_of(gamma),
                             .beta = vec_of(beta),
                             .save_mean = vec_of(save_mean),
                             .save_invstd = vec_of(save_invstd),
                             .grad_gamma = vec_of(grad_gamma),
                             .grad_beta = vec_of(grad_beta),
                             .sums_in = sums_in ? (const double *)dlua_tensor_ptr(sums_in) : NULL,
                             .sums_out = sums_out ? (double *)dlua_tensor_ptr(*sums_out) : NULL,
                             .M = M,
                             .train = train,
                             .reduce = reduce,
                             .accumulate = accumulate};
    s = k->backward(op, &a);
  }
  s = act_out_end(&odx, s);
  s = act_out_end(&osk, s);
  if (s != DLUA_OK && sums_out) drop_sums(sums_out, &sums_allocated);
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

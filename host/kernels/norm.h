/* Batch normalisation's family (ops/backend.h): the descriptors host/ops/batchnorm.c fills and the
   slots host/cpu/batchnorm.c and host/cuda/batchnorm.cu provide. Plain C, read by C++ too. */
#ifndef DLUA_KERNELS_NORM_H
#define DLUA_KERNELS_NORM_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A per-channel vector (C) on the descriptor's device: any floating dtype, any stride (elements); p NULL: absent. */
typedef struct {
  void *p;
  int dtype;
  int64_t stride;
} dlua_bn_vec_t;

/* Activations of `dtype` (x, skip, y, dy, dx, dskip alike), seen as N planes of C channels of S positions
   (rows 0: (N, C, S) memory) or as N * S rows of C channels (rows 1: channels-last memory, or S == 1).
   Statistics are computed in double and applied in the compute type (double for f64, else float).
   Pointers are addresses on `device`. */
typedef struct {
  int dtype, rows, device;
  int64_t N, C, S;
} dlua_bn_geom_t;

/* Forward: in training from the batch (stats NULL) or from stats, the (2C+1) [sum x, sum x^2, count]
   of every rank (count M given here too); in evaluation from the running statistics. y may be x.
   save_mean / save_invstd (when wanted) are written in the compute type's precision.
   stats_out (with y NULL): batch_norm_stats, the batch's (2C+1) sums instead of a normalisation. */
typedef struct {
  dlua_bn_geom_t g;
  const void *x;    /* (N, C, S) or (M, C) */
  const void *skip; /* like x, or NULL */
  void *y;          /* like x, or NULL */
  dlua_bn_vec_t gamma, beta, running_mean, running_var, save_mean, save_invstd;
  const double *stats; /* (2C+1) or NULL */
  double *stats_out;   /* (2C+1) or NULL */
  int64_t M;           /* values per channel the statistics cover */
  int train, relu;
  double momentum, eps;
} dlua_bn_fwd_t;

/* Backward whole, or SyncBatchNorm's halves: reduce (sum d and sum d (x - mean) per channel, d = dy
   masked by the forward's ReLU when y) into sums_out / grad_gamma / grad_beta, or take them from
   sums_in; then dx and dskip (either may be NULL; either may be dy itself). A backend may redo the
   ReLU test from x, gamma, beta and the saved statistics instead of reading y, when y_exact says y
   was the forward's output in g.dtype (no rounding staged it). */
typedef struct {
  dlua_bn_geom_t g;
  const void *x, *dy;
  const void *y; /* the forward's output when it fused a ReLU, else NULL */
  int y_exact;
  void *dx, *dskip;
  dlua_bn_vec_t gamma, beta, save_mean, save_invstd, grad_gamma, grad_beta;
  const double *sums_in; /* (2C+1) or NULL */
  double *sums_out;      /* (2C+1) or NULL */
  int64_t M;
  int train, reduce, accumulate;
} dlua_bn_bwd_t;

struct dlua_norm_ops {
  /* 1: the kernels read and write f16/bf16 activations themselves (computing in float); 0: the front
     door stages them in the compute type. */
  int native_16bit;
  dlua_status_t (*forward)(const char *op, const dlua_bn_fwd_t *a);
  dlua_status_t (*backward)(const char *op, const dlua_bn_bwd_t *a);
};

extern const struct dlua_norm_ops dlua_cpu_norm_ops, dlua_cuda_norm_ops;

#ifdef __cplusplus
}
#endif
#endif

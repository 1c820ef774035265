/* The interface between the batch-norm dispatcher (host/cpu/batchnorm.c) and its CUDA kernels. */
#ifndef DLUA_CUDA_NN_CUDA_H
#define DLUA_CUDA_NN_CUDA_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A per-channel vector (C) in device memory: any floating dtype, any stride (elements); p NULL: absent. */
typedef struct {
  void *p;
  int dtype;
  int64_t stride;
} dlua_cuda_vec_t;

/* Activations of `dtype` (x, skip, y, dy, dx, dskip alike; f32, f64, f16 or bf16), seen as N planes of
   C channels of S positions (rows 0: (N, C, S) memory) or as N * S rows of C channels (rows 1:
   channels-last memory, or S == 1). Statistics are computed in double and applied in the CPU's compute
   type (double for f64, else float). Pointers are device addresses on `device`. */
typedef struct {
  int dtype, rows, device;
  int64_t N, C, S;
} dlua_cuda_bn_geom_t;

/* Forward: in training from the batch (stats NULL) or from stats, the (2C+1) [sum x, sum x^2, count]
   of every rank (count M given here too); in evaluation from the running statistics. y may be x.
   stats_out (with y NULL): batch_norm_stats, the batch's (2C+1) sums instead of a normalisation. */
typedef struct {
  dlua_cuda_bn_geom_t g;
  const void *x;    /* (N, C, S) or (M, C) */
  const void *skip; /* like x, or NULL */
  void *y;          /* like x, or NULL */
  dlua_cuda_vec_t gamma, beta, running_mean, running_var, save_mean, save_invstd;
  const double *stats; /* (2C+1) or NULL */
  double *stats_out;   /* (2C+1) or NULL */
  int64_t M;           /* values per channel the statistics cover */
  int train, relu;
  double momentum, eps;
} dlua_cuda_bn_fwd_t;

/* Backward whole, or SyncBatchNorm's halves: reduce (sum d and sum d (x - mean) per channel, d = dy
   masked by y > 0 when y) into sums_out / grad_gamma / grad_beta, or take them from sums_in; then
   dx and dskip (either may be NULL; either may be dy itself). */
typedef struct {
  dlua_cuda_bn_geom_t g;
  const void *x, *dy;
  const void *y; /* the forward's output when it fused a ReLU, else NULL */
  void *dx, *dskip;
  dlua_cuda_vec_t gamma, save_mean, save_invstd, grad_gamma, grad_beta;
  const double *sums_in; /* (2C+1) or NULL */
  double *sums_out;      /* (2C+1) or NULL */
  int64_t M;
  int train, reduce, accumulate;
} dlua_cuda_bn_bwd_t;

dlua_status_t dlua_cuda_bn_forward(const char *op, const dlua_cuda_bn_fwd_t *a);
dlua_status_t dlua_cuda_bn_backward(const char *op, const dlua_cuda_bn_bwd_t *a);

/* Copies `bytes` of device memory to the host after the current stream's queued work (waits). */
dlua_status_t dlua_cuda_nn_read(const char *op, void *host, const void *src, size_t bytes, int device);

#ifdef __cplusplus
}
#endif
#endif

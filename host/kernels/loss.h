/* The loss family's descriptors and slots (ops/backend.h): softmax/log-softmax, threshold/ReLU and their
   gradients, dropout's mask-scale, MSE and cross-entropy, forward and backward. host/ops/loss.c and
   host/ops/activation.c fill them; host/cpu/loss.c and host/cuda/loss.cu run them.

   Every buffer is contiguous, of the compute dtype `ct` (DLUA_DTYPE_F32 for f32/f16/bf16 tensors,
   DLUA_DTYPE_F64), staged by the front door, and lives on `device` (DLUA_CPU or a CUDA ordinal; the CUDA
   kernels queue on its current stream). A one-value scalar given as `const double *` (gscalar, sum) lives
   there too. */
#ifndef DLUA_KERNELS_LOSS_H
#define DLUA_KERNELS_LOSS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lines along the class dim of the (outer, K, inner) view; log selects log-softmax. */
typedef struct {
  int ct;
  const void *x;
  void *y;
  int64_t outer, K, inner;
  int log;
  int device;
} dlua_loss_softmax_t;

/* softmax: gx = y (gy - sum(gy y)); log-softmax: gx = gy - exp(y) sum(gy). */
typedef struct {
  int ct;
  const void *gy, *y;
  void *gx;
  int64_t outer, K, inner;
  int log;
  int device;
} dlua_loss_softmax_bwd_t;

/* y = x <= th ? value : x */
typedef struct {
  int ct;
  const void *x;
  void *y;
  int64_t n;
  double th, value;
  int device;
} dlua_loss_threshold_t;

/* gx = x <= th ? 0 : gy */
typedef struct {
  int ct;
  const void *gy, *x;
  void *gx;
  int64_t n;
  double th;
  int device;
} dlua_loss_threshold_bwd_t;

/* y = x * (m ? scale : 0), m bytes */
typedef struct {
  int ct;
  const void *x;
  const uint8_t *m;
  void *y;
  int64_t n;
  double scale;
  int device;
} dlua_loss_mask_scale_t;

/* (x - t)^2 per element into out_none (n), or into *sum (one double) their sum divided by `div` (1 for sum,
   n for mean). */
typedef struct {
  int ct;
  const void *x, *t;
  void *out_none;
  double *sum;
  double div;
  int64_t n;
  int device;
} dlua_loss_mse_t;

/* gx = norm (x - t) g: g = gy[i] (gy given), else *gscalar (NULL: 1). */
typedef struct {
  int ct;
  const void *x, *t, *gy;
  const double *gscalar;
  double norm;
  void *gx;
  int64_t n;
  int device;
} dlua_loss_mse_bwd_t;

/* A cross-entropy's targets and options. Per target i with class y (not ignored), PyTorch's loss with smoothing
   e over K classes is  l_i = -(1 - e) w_y logp_y - (e / K) sum_c w_c logp_c. */
typedef struct {
  int64_t N, K, inner, P;  /* P = N * inner targets */
  const int64_t *labels;   /* (P) on the device, integers from base, already checked */
  int64_t base, ignore;
  const double *w;         /* (K) on the device, or NULL */
  double wsum, eps;        /* sum_c w_c (K without weights); label smoothing */
} dlua_loss_ce_t;

/* Log-probabilities into lp (optional), per-target losses into loss_none (reduction none), or into *sum their
   sum divided by `div` (total weight for mean, 1 for sum). */
typedef struct {
  int ct;
  dlua_loss_ce_t pl;
  const void *x;
  void *lp, *loss_none;
  double *sum;
  double div;
  int device;
} dlua_loss_ce_fwd_t;

/* gx from the log-probabilities; g per target (gy) or *gscalar (NULL: 1), divided by `div`. */
typedef struct {
  int ct;
  dlua_loss_ce_t pl;
  const void *lp, *gy;
  const double *gscalar;
  double div;
  void *gx;
  int device;
} dlua_loss_ce_bwd_t;

struct dlua_loss_ops {
  dlua_status_t (*softmax)(const char *op, const dlua_loss_softmax_t *d);
  dlua_status_t (*softmax_backward)(const char *op, const dlua_loss_softmax_bwd_t *d);
  dlua_status_t (*threshold)(const char *op, const dlua_loss_threshold_t *d);
  dlua_status_t (*threshold_backward)(const char *op, const dlua_loss_threshold_bwd_t *d);
  dlua_status_t (*mask_scale)(const char *op, const dlua_loss_mask_scale_t *d);
  dlua_status_t (*mse)(const char *op, const dlua_loss_mse_t *d);
  dlua_status_t (*mse_backward)(const char *op, const dlua_loss_mse_bwd_t *d);
  dlua_status_t (*cross_entropy)(const char *op, const dlua_loss_ce_fwd_t *d);
  dlua_status_t (*cross_entropy_backward)(const char *op, const dlua_loss_ce_bwd_t *d);
};

extern const struct dlua_loss_ops dlua_cpu_loss_ops, dlua_cuda_loss_ops;

#ifdef __cplusplus
}
#endif
#endif

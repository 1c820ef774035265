/* The C dispatchers' interface to the CUDA losses and activation gradients (loss.cu), random fills (random.cu) and
   the LARS and LAMB steps (optim.cu). Plain C; only CUDA builds call it. Pointers are device addresses on
   `device`; buffers are contiguous, of the compute dtype `ct` (DLUA_DTYPE_F32 for f32/f16/bf16 tensors,
   DLUA_DTYPE_F64), staged by host/cpu/loss.c exactly as for its CPU kernels. Every launch queues on the current
   stream of `device`. */
#ifndef DLUA_CUDA_LOSS_CUDA_H
#define DLUA_CUDA_LOSS_CUDA_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- softmax, threshold, dropout's mask, MSE (host/cpu/loss.c's kernels, same arguments) ---------------- */

/* Lines along the class dim of the (outer, K, inner) view; log selects log-softmax. */
dlua_status_t dlua_cuda_softmax_fwd(const char *op, int ct, const void *x, void *y, int64_t outer, int64_t K,
                                    int64_t inner, int log, int device);
dlua_status_t dlua_cuda_softmax_bwd(const char *op, int ct, const void *gy, const void *y, void *gx, int64_t outer,
                                    int64_t K, int64_t inner, int log, int device);
/* y = x <= th ? value : x */
dlua_status_t dlua_cuda_threshold(const char *op, int ct, const void *x, void *y, int64_t n, double th, double value,
                                  int device);
/* gx = x <= th ? 0 : gy */
dlua_status_t dlua_cuda_threshold_bwd(const char *op, int ct, const void *gy, const void *x, void *gx, int64_t n,
                                      double th, int device);
/* y = x * (m ? scale : 0), m bytes */
dlua_status_t dlua_cuda_mask_scale(const char *op, int ct, const void *x, const uint8_t *m, void *y, int64_t n,
                                   double scale, int device);
/* (x - t)^2 per element into out_none (n), or into *sum (one double) their sum divided by `div` (1 for sum,
   n for mean). */
dlua_status_t dlua_cuda_mse_fwd(const char *op, int ct, const void *x, const void *t, void *out_none, double *sum,
                                double div, int64_t n, int device);
/* gx = norm (x - t) g: g = gy[i] (gy given), else *gscalar (a double on the device; NULL: 1). */
dlua_status_t dlua_cuda_mse_bwd(const char *op, int ct, const void *x, const void *t, const void *gy,
                                const double *gscalar, double norm, void *gx, int64_t n, int device);

/* ---- cross-entropy (host/cpu/loss.c's ce_plan_t, with device pointers) ------------------------------------ */

typedef struct {
  int64_t N, K, inner, P;  /* P = N * inner targets */
  const int64_t *labels;   /* (P) device, already checked on the host */
  int64_t base, ignore;
  const double *w;         /* (K) device, or NULL */
  double wsum, eps;
} dlua_cuda_ce_t;

/* Log-probabilities into lp (optional), per-target losses into loss_none (reduction none), or into *sum their
   sum divided by `div` (total weight for mean, 1 for sum). */
dlua_status_t dlua_cuda_ce_fwd(const char *op, int ct, const dlua_cuda_ce_t *pl, const void *x, void *lp,
                               void *loss_none, double *sum, double div, int device);
/* gx from the log-probabilities; g per target (gy) or *gscalar (device double; NULL: 1), divided by `div`. */
dlua_status_t dlua_cuda_ce_bwd(const char *op, int ct, const dlua_cuda_ce_t *pl, const void *lp, const void *gy,
                               const double *gscalar, double div, void *gx, int device);

/* ---- random fills (host/core/random.c; per-element rules in core/random.h) -------------------------------- */

enum { DLUA_CUDA_FILL_UNIFORM, DLUA_CUDA_FILL_NORMAL, DLUA_CUDA_FILL_RANDINT, DLUA_CUDA_FILL_BERNOULLI };

typedef struct {
  int kind;
  double a, b;        /* uniform: low, high; normal: mean, std; bernoulli: p */
  int64_t low;        /* randint */
  uint64_t range;     /* randint: high - low */
  int wide;           /* uniform: 32 random bits (float64) instead of 24 */
  uint32_t key[2];    /* the generator's seed */
  uint64_t base;      /* its offset (in 4-element blocks) reserved for this fill */
} dlua_cuda_fill_t;

/* Element i of contiguous dst (n elements of dtype) = the fill's value i, converted as dlua_convert does. */
dlua_status_t dlua_cuda_random_fill(const char *op, const dlua_cuda_fill_t *f, int dtype, void *dst, int64_t n,
                                    int device);

#ifdef __cplusplus
}
#endif
#endif

/* The optim family of the backend table (ops/backend.h): what an optimizer step, a gradient unscale/scale/norm
   and a gradient-compression kernel get, and the slots a backend fills. host/ops/optim.c and host/ops/compress.c
   fill the descriptors after every check; host/cpu/optim.c, host/cpu/compress.c and host/cuda/optim.cu run them.
   The per-element arithmetic of the steps is host/kernels/optim_ops.h, compiled by both backends. */
#ifndef DLUA_KERNELS_OPTIM_H
#define DLUA_KERNELS_OPTIM_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Arguments of one step over a range; the pointers already point at the range's first element (LARS, LAMB:
   at the arena's first element, the ranges say where each parameter lies). */
typedef struct {
  void *p;
  const void *g;
  void *s1, *s2, *s3; /* SGD/LARS: momentum; Adam(W)/LAMB: exp_avg, exp_avg_sq, max_exp_avg_sq */
  double lr, momentum, dampening, weight_decay, grad_scale, beta1, beta2, eps, bc1, bc2;
  double trust; /* LARS, LAMB: this parameter's ratio */
  int nesterov, maximize, first, amsgrad;
  int decoupled; /* 1: AdamW's decay (param *= 1 - lr wd), 0: Adam's L2 in the gradient */
} dlua_opt_args_t;

/* SGD or Adam/AdamW over `length` elements of param's dtype (DLUA_DTYPE_F32 or F64), pointers on `device`.
   lowp: NULL, or mixed precision's 16-bit copy of the same range (lowp_dtype F16 or BF16, param float32), written
   in the same pass as the update (the CPU: chunk by chunk right after the chunk's update; CUDA: by the thread that
   updated the element), on `device` too. */
typedef struct {
  int dtype;
  int64_t length;
  dlua_opt_args_t args;
  void *lowp;
  int lowp_dtype;
  int device;
} dlua_optim_step_desc_t;

/* LARS or LAMB over n_ranges parameters of the arena (f32/f64, pointers on `device`); offsets, lengths and
   exclude (NULL: none excluded) are host arrays, checked: inside the arena and pairwise disjoint, n_ranges > 0.
   trust_coefficient and eps are LARS's (LAMB's eps is args.eps). */
typedef struct {
  int dtype;
  dlua_opt_args_t args;
  int n_ranges;
  const int64_t *offsets, *lengths;
  const int32_t *exclude;
  double trust_coefficient, eps;
  int device;
} dlua_optim_ranges_desc_t;

/* n contiguous gradients x of `dtype` (f32, f64, f16, bf16) on `device`, at the range's first element.
   unscale: x *= s, *nonfinite = how many were Inf/NaN before; grad_scale: x *= s; grad_norm_partial: *out = the
   sum of |x|^s (or max |x| for s = inf) in double over fixed blocks folded in order. */
typedef struct {
  int dtype;
  void *x;
  int64_t n;
  double s;
  int64_t *nonfinite;
  double *out;
  int device;
} dlua_optim_grad_desc_t;

/* Gradient compression (DDP's communication hooks). Casts: n elements, f32 src * scale -> 16 bits dst
   (to_half), or 16 bits src -> f32 dst (from_half, scale 1); half_dtype DLUA_DTYPE_F16 or BF16. */
typedef struct {
  void *dst;
  const void *src;
  int64_t n;
  double scale;
  int half_dtype;
  int device;
} dlua_compress_cast_desc_t;

/* Top-k of one bucket: grad (n) f32, acc/mom (n) f32 or NULL, packed (2k) int32; 0 <= k <= n <= INT32_MAX. */
typedef struct {
  int32_t *packed;
  const float *grad;
  float *acc, *mom;
  double momentum;
  int64_t n, k;
  int device;
} dlua_compress_topk_desc_t;

/* grad (n) f32 = the sum of gathered's rows (rows, 2k) int32 at their indices, divided by divisor. The kernel
   checks the indices (it reads them) before it writes anything. */
typedef struct {
  float *grad;
  const int32_t *gathered;
  int64_t n, rows, k;
  double divisor;
  int device;
} dlua_compress_unpack_desc_t;

/* PowerSGD: p (n, r) f32 row-major, n, r > 0, gets orthonormal columns. */
typedef struct {
  float *p;
  int64_t n, r;
  double eps;
  int device;
} dlua_compress_orth_desc_t;

/* NULL slot: the op is not supported on that backend. The CUDA backend fills the steps and the gradient
   slots; compression runs on the CPU only. */
struct dlua_optim_ops {
  dlua_status_t (*sgd_step)(const char *op, const dlua_optim_step_desc_t *d);
  dlua_status_t (*adam_step)(const char *op, const dlua_optim_step_desc_t *d); /* Adam and AdamW (args.decoupled) */
  dlua_status_t (*lars_step)(const char *op, const dlua_optim_ranges_desc_t *d);
  dlua_status_t (*lamb_step)(const char *op, const dlua_optim_ranges_desc_t *d);
  dlua_status_t (*unscale)(const char *op, const dlua_optim_grad_desc_t *d);
  dlua_status_t (*grad_scale)(const char *op, const dlua_optim_grad_desc_t *d);
  dlua_status_t (*grad_norm_partial)(const char *op, const dlua_optim_grad_desc_t *d);
  dlua_status_t (*compress_to_half)(const char *op, const dlua_compress_cast_desc_t *d);
  dlua_status_t (*compress_from_half)(const char *op, const dlua_compress_cast_desc_t *d);
  dlua_status_t (*compress_topk)(const char *op, const dlua_compress_topk_desc_t *d);
  dlua_status_t (*compress_topk_unpack)(const char *op, const dlua_compress_unpack_desc_t *d);
  dlua_status_t (*compress_orthogonalize)(const char *op, const dlua_compress_orth_desc_t *d);
};

extern const struct dlua_optim_ops dlua_cpu_optim_ops, dlua_cuda_optim_ops;

#ifdef __cplusplus
}
#endif
#endif

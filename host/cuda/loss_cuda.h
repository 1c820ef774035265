/* The C dispatchers' interface to the LARS and LAMB steps (optim.cu). Plain C; only CUDA builds call it. Pointers
   are device addresses on `device`. Every launch queues on the current stream of `device`. (The losses and random
   fills are the backend table's loss and random families: kernels/loss.h, kernels/random.h.) */
#ifndef DLUA_CUDA_LOSS_CUDA_H
#define DLUA_CUDA_LOSS_CUDA_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- LARS, LAMB (host/cpu/optim.c's dlua_optim_lars_step / _lamb_step after their checks) ------------------ */

/* n_ranges parameters of the f32/f64 arena at p/g/buf (device), host arrays offsets/lengths/exclude. Norms are
   summed per parameter in a fixed tree (no atomics), trust ratios computed on the device as the CPU does, then
   one fused update; args carries lr, momentum, weight_decay, grad_scale, first (host/kernels/optim_ops.h). */
dlua_status_t dlua_cuda_lars_step(const char *op, int dtype, const void *args, int n_ranges, const int64_t *offsets,
                                  const int64_t *lengths, const int32_t *exclude, double trust_coefficient, double eps,
                                  int device);

/* LAMB (host/cpu/optim.c's dlua_optim_lamb_step after its checks), on the same per-parameter chunk table: pass 1
   updates the moments and sums |p|^2 and |u|^2 per chunk, the ratios |p| / |u| come from an in-order fold, pass 2
   applies them; args carries lr, betas, eps, weight_decay, grad_scale, bc1, bc2 and exp_avg/exp_avg_sq (s1, s2). */
dlua_status_t dlua_cuda_lamb_step(const char *op, int dtype, const void *args, int n_ranges, const int64_t *offsets,
                                  const int64_t *lengths, const int32_t *exclude, int device);

#ifdef __cplusplus
}
#endif
#endif

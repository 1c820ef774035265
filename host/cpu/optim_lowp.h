/* Mixed precision's master-weight steps (host/cpu/optim.c): SGD and Adam/AdamW also writing the arena's 16-bit twin. */
#ifndef DLUA_CPU_OPTIM_LOWP_H
#define DLUA_CPU_OPTIM_LOWP_H
#include "core/api.h"

/* The same steps as dlua_optim_sgd_step and dlua_optim_adam(w)_step (decoupled 0: Adam, 1: AdamW), also
   writing lowp[i] = param[i] rounded to lowp's dtype for every element stepped, chunk by chunk in the same
   pass over the arena. lowp: a contiguous bfloat16 or float16 tensor of param's element count (the arena's
   16-bit twin), param float32, both on the CPU. bindings/nn.lua declares these two for the FFI (to be
   moved into dlua.h, whose every change recompiles the CUDA sources). */
dlua_status_t dlua_optim_sgd_step_lowp(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf, int64_t offset, int64_t length, double lr, double momentum, double dampening, double weight_decay, int nesterov, int maximize, int first_step, double grad_scale, dlua_tensor_t *lowp);
dlua_status_t dlua_optim_adam_step_lowp(int decoupled, dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset, int64_t length, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale, dlua_tensor_t *lowp);

#endif

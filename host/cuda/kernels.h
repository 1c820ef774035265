/* The internal interface between the C dispatchers (host/cpu, host/core) and the CUDA kernels. */
#ifndef DLUA_CUDA_KERNELS_H
#define DLUA_CUDA_KERNELS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The raw cudaStream_t (as void *) that kernels for `device` queue on: its current stream. */
void *dlua_cuda_raw_stream(int device);

/* Row-major C (m, n) = alpha * op(A) (m, k) x op(B) (k, n) + beta * C through cuBLASLt, `batch` times with
   element strides sa, sb, sc between the matrices (host/cuda/blaslt.c). ta/tb and lda/ldb as BLAS on the
   row-major view (see host/cpu/linalg.c's blas_form). dtype f32, f64, f16 or bf16 for A, B and C alike. */
dlua_status_t dlua_cuda_gemm(const char *op, int dtype, int ta, int tb, int64_t m, int64_t n, int64_t k, double alpha,
                             const void *a, int64_t lda, int64_t sa, const void *b, int64_t ldb, int64_t sb, double beta,
                             void *c, int64_t ldc, int64_t sc, int64_t batch, int device);

/* Fused optimizer steps on CUDA over `length` elements of f32/f64 arenas (args as host/kernels/optim_ops.h's
   dlua_opt_args_t, device pointers): kind 0 SGD, 1 Adam/AdamW (args->decoupled); the per-element code is
   the CPU's. */
dlua_status_t dlua_cuda_optim_step(const char *op, int kind, int dtype, const void *args, int64_t length, int device);
/* x *= inv_scale over n elements (f32, f64, f16, bf16), *nonfinite = how many were Inf/NaN before (an integer
   count: the same whatever order blocks finish). Waits for the count. */
dlua_status_t dlua_cuda_unscale(const char *op, int dtype, void *x, int64_t n, double inv_scale, int64_t *nonfinite,
                                int device);
/* x *= scale over n elements (f32, f64, f16, bf16), queued on the current stream (no wait). */
dlua_status_t dlua_cuda_grad_scale(const char *op, int dtype, void *x, int64_t n, double scale, int device);
/* *out = sum of |x|^p (or max |x| for p = inf) over n elements, in double, as host/cpu/optim.c's
   dlua_optim_grad_norm_partial: fixed chunks folded in order, no atomics. Waits for the value. */
dlua_status_t dlua_cuda_grad_norm_partial(const char *op, int dtype, const void *x, int64_t n, double p, double *out,
                                          int device);

#ifdef __cplusplus
}
#endif
#endif

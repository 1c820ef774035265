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

#ifdef __cplusplus
}
#endif
#endif

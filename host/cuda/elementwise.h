/* CUDA element-wise kernels over contiguous float32 data, compiled from host/cpu/elementwise_ops.h. */
#ifndef DLUA_CUDA_ELEMENTWISE_H
#define DLUA_CUDA_ELEMENTWISE_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[i] = op(x[i], p1, p2) for i < n, op a position in DLUA_EW_UNARY_OPS (the CPU's numbering).
   y (n) is float32, or uint8 (bool) for predicate ops; x (n) float32. Queued on `stream` (a
   cudaStream_t; NULL is the default stream) of the current device. */
dlua_status_t dlua_cuda_ew_unary_f32(int op, void *y, const float *x, int64_t n, float p1, float p2, void *stream);
/* y[i] = op(a[i], b[i], alpha), op a position in DLUA_EW_BINARY_OPS; a, b, y (n) as above. */
dlua_status_t dlua_cuda_ew_binary_f32(int op, void *y, const float *a, const float *b, int64_t n, float alpha, void *stream);

#ifdef __cplusplus
}
#endif
#endif

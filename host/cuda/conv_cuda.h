/* 2-D convolution on CUDA through cuDNN (host/cuda/conv_cudnn.c): the device side of host/cpu/conv.c's entry points. */
#ifndef DLUA_CUDA_CONV_CUDA_H
#define DLUA_CUDA_CONV_CUDA_H
#include <stdint.h>
#include "core/api.h"

/* The same signatures and semantics as dlua_conv2d_forward, _backward_data and _backward_weights (dlua.h),
   called by them after their argument checks: shapes, dtypes and parameters are valid and every tensor lives
   on one CUDA device. Plain C: no CUDA or cuDNN types, so host/cpu/conv.c compiles without their headers. */
dlua_status_t dlua_cuda_conv2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *w,
                                       const dlua_tensor_t *bias, int stride_h, int stride_w, int pad_h, int pad_w,
                                       int dil_h, int dil_w, int groups);
dlua_status_t dlua_cuda_conv2d_backward_data(dlua_tensor_t **grad_x, const dlua_tensor_t *grad_y,
                                             const dlua_tensor_t *w, const int64_t *x_sizes, int stride_h,
                                             int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups,
                                             int accumulate);
dlua_status_t dlua_cuda_conv2d_backward_weights(dlua_tensor_t *grad_w, dlua_tensor_t *grad_bias,
                                                const dlua_tensor_t *x, const dlua_tensor_t *grad_y, int stride_h,
                                                int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups,
                                                int accumulate);

#endif

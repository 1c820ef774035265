/* cuDNN for the CUDA backend's C files: the library loaded with dlopen, one handle per (device, stream), errors. */
#ifndef DLUA_CUDA_CUDNN_API_H
#define DLUA_CUDA_CUDNN_API_H
#include <cudnn.h>
#include "core/api.h"

/* The legacy-style (cudnn_ops.h / cudnn_cnn.h) functions we call. Each table field has the function's own
   name and type, so calls read `api->cudnnConvolutionForward(...)` and the header checks every signature. */
#define DLUA_CUDNN_FUNCS(F)                                                                                     \
  F(cudnnGetVersion) F(cudnnGetErrorString) F(cudnnCreate) F(cudnnDestroy) F(cudnnSetStream)                    \
  F(cudnnCreateTensorDescriptor) F(cudnnDestroyTensorDescriptor) F(cudnnSetTensor4dDescriptorEx)                \
  F(cudnnCreateFilterDescriptor) F(cudnnDestroyFilterDescriptor) F(cudnnSetFilter4dDescriptor)                  \
  F(cudnnCreateConvolutionDescriptor) F(cudnnDestroyConvolutionDescriptor) F(cudnnSetConvolution2dDescriptor)   \
  F(cudnnSetConvolutionGroupCount) F(cudnnSetConvolutionMathType)                                               \
  F(cudnnGetConvolutionForwardAlgorithmMaxCount) F(cudnnGetConvolutionBackwardDataAlgorithmMaxCount)            \
  F(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount)                                                         \
  F(cudnnGetConvolutionForwardAlgorithm_v7) F(cudnnGetConvolutionBackwardDataAlgorithm_v7)                      \
  F(cudnnGetConvolutionBackwardFilterAlgorithm_v7)                                                              \
  F(cudnnFindConvolutionForwardAlgorithmEx) F(cudnnFindConvolutionBackwardDataAlgorithmEx)                      \
  F(cudnnFindConvolutionBackwardFilterAlgorithmEx)                                                              \
  F(cudnnConvolutionForward) F(cudnnConvolutionBackwardData) F(cudnnConvolutionBackwardFilter)

typedef struct {
#define DLUA_CUDNN_FIELD_(f) __typeof__(f) *f;
  DLUA_CUDNN_FUNCS(DLUA_CUDNN_FIELD_)
#undef DLUA_CUDNN_FIELD_
  /* cuDNN 9's detail for the last failure on this thread; NULL where the library lacks it. */
  __typeof__(cudnnGetLastErrorString) *cudnnGetLastErrorString;
  size_t version; /* cudnnGetVersion(): 91900 for 9.19.0 */
  char path[512]; /* what dlopen found */
} dlua_cudnn_api_t;

/* The library, loaded on the first call (DLUA_CUDNN_LIBRARY, libcudnn.so.9 on the loader's path, the CUDA
   toolkit's lib64, Python's nvidia/cudnn/lib). NULL when it cannot be loaded, with "op: cannot load cuDNN
   (...): <why>" recorded as DLUA_ERR_BACKEND. */
const dlua_cudnn_api_t *dlua_cudnn_api(const char *op);

/* The handle of (device, the device's current stream), created on first use and set on that stream. The
   caller has selected `device` (cudaSetDevice). A handle serves one host thread at a time, as a stream does. */
dlua_status_t dlua_cudnn_handle(const char *op, int device, cudnnHandle_t *handle);

/* Records "op: cuDNN <status> in <call> (<context>)", plus cuDNN's own detail when it gives one, and returns
   DLUA_ERR_BACKEND (DLUA_ERR_OOM for CUDNN_STATUS_ALLOC_FAILED). */
dlua_status_t dlua_cudnn_fail(const char *op, cudnnStatus_t status, const char *call, const char *context);

#endif

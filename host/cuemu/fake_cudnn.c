/* A fake cuDNN 9 for the CUDA emulator: the entry points host/cuda/cudnn.c loads (DLUA_CUDNN_FUNCS, and
   cudnnGetLastErrorString), computing 2-D convolutions on the CPU. Built as a shared library that cudnn.c dlopens
   in place of libcudnn.so.9 (DLUA_CUDNN_LIBRARY=path); cuemu_enqueue, cuemu_memory_kind and cuemu_fail come from
   the executable that loads it.

   What it takes (what host/cuda/conv_cudnn.c asks for, checked as cuDNN would; anything else is refused with
   CUDNN_STATUS_BAD_PARAM or CUDNN_STATUS_NOT_SUPPORTED and a message for cudnnGetLastErrorString):
   - tensors: 4-D (N, C, H, W) through cudnnSetTensor4dDescriptorEx, any positive strides (packed NCHW,
     channels-last NHWC, padded rows ...); an output's elements must not overlap;
   - filters: (K, C/groups, R, S), packed, CUDNN_TENSOR_NCHW (KCRS) or CUDNN_TENSOR_NHWC (KRSC);
   - convolutions: CUDNN_CROSS_CORRELATION only, padding >= 0, stride and dilation >= 1, any group count that
     divides C and K, any math type; data float (compute float), double (compute double), half or bfloat16
     (compute float: cuDNN's "pseudo" configurations; the true-half one is refused);
   - x, w and y of one data type, y exactly (N, K, OH, OW) with OH = (H + 2 pad - dil (R - 1) - 1) / stride + 1;
     no data pointer NULL, the output apart from the inputs (nothing in place).
   Refusals use the codes the legacy API documents: CUDNN_STATUS_BAD_PARAM and CUDNN_STATUS_NOT_SUPPORTED (which
   conv_cudnn.c's listing calls take as "nothing in this format"), never cuDNN 9's finer sub-codes.

   Algorithms: two per direction (forward IMPLICIT_PRECOMP_GEMM and IMPLICIT_GEMM, backward ALGO_1 and ALGO_0),
   listed by the heuristic and the "benchmark" alike with status success, no workspace and made-up times; the
   convolution calls take those two and refuse the others. The Find*Ex calls run nothing, but like the real
   ones they leave the output's contents destroyed: they queue a fill of it with NaN.

   The three convolution calls compute nothing at the call: they check the arguments, copy what the computation
   needs by value (pointers, alpha and beta, the descriptors' contents) and queue it on the handle's stream
   (cudnnSetStream; 0 by default). Arithmetic: elements are converted to double (f16 and bf16 exactly, through
   float), the products summed in double in a fixed order, alpha * sum + beta * prior formed in double and rounded
   once to the output type (through float, round-to-nearest-even, for f16 and bf16). Scaling factors are host
   doubles for double data, host floats otherwise. beta == 0 does not read the output and alpha == 0 does not read
   the inputs, so NaNs there do not reach the result. When the work runs, an array that is not in device (or
   pinned) memory is reported through cuemu_fail, as a GPU would fault, and nothing is written. */
#include <cudnn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuemu.h"
#include "fake_common.h"

/* ---- errors -------------------------------------------------------------------------------------------------- */

static _Thread_local char last_error[512];

/* Records "fn: why" for cudnnGetLastErrorString and returns st. */
static cudnnStatus_t fail(cudnnStatus_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return st;
}

size_t cudnnGetVersion(void) { return CUDNN_VERSION; }

void cudnnGetLastErrorString(char *message, size_t max_size) {
  if (message && max_size > 0) {
    snprintf(message, max_size, "%s", last_error);
  }
  last_error[0] = 0;  // read once, as cuDNN's: a later failure reports only its own
}

const char *cudnnGetErrorString(cudnnStatus_t status) {
  switch (status) {
#define NAME_(s) \
  case s: return #s;
    NAME_(CUDNN_STATUS_SUCCESS)
    NAME_(CUDNN_STATUS_NOT_INITIALIZED)
    NAME_(CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH)
    NAME_(CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH)
    NAME_(CUDNN_STATUS_DEPRECATED)
    NAME_(CUDNN_STATUS_LICENSE_ERROR)
    NAME_(CUDNN_STATUS_RUNTIME_IN_PROGRESS)
    NAME_(CUDNN_STATUS_RUNTIME_FP_OVERFLOW)
    NAME_(CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED)
    NAME_(CUDNN_STATUS_BAD_PARAM)
    NAME_(CUDNN_STATUS_BAD_PARAM_NULL_POINTER)
    NAME_(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER)
    NAME_(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED)
    NAME_(CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND)
    NAME_(CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT)
    NAME_(CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH)
    NAME_(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH)
    NAME_(CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES)
    NAME_(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE)
    NAME_(CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH)
    NAME_(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_SHAPE)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_LAYOUT)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_PADDING)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API)
    NAME_(CUDNN_STATUS_NOT_SUPPORTED_INVALID_DYNAMIC_SHAPE)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM)
    NAME_(CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED)
    NAME_(CUDNN_STATUS_EXECUTION_FAILED)
    NAME_(CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER)
    NAME_(CUDNN_STATUS_EXECUTION_FAILED_CUBLAS)
    NAME_(CUDNN_STATUS_EXECUTION_FAILED_CUDART)
    NAME_(CUDNN_STATUS_EXECUTION_FAILED_CURAND)
#undef NAME_
    default: return "CUDNN_STATUS_UNKNOWN";
  }
}

/* ---- f16 / bf16 ---------------------------------------------------------------------------------------------- */

/* ---- element access ------------------------------------------------------------------------------------------ */

/* The element type of a descriptor (FK_NONE: not supported). */
static fk_type_t fk_of(cudnnDataType_t t) {
  switch (t) {
    case CUDNN_DATA_DOUBLE: return FK_F64;
    case CUDNN_DATA_FLOAT: return FK_F32;
    case CUDNN_DATA_HALF: return FK_F16;
    case CUDNN_DATA_BFLOAT16: return FK_BF16;
    default: return FK_NONE;
  }
}

static size_t dtype_size(cudnnDataType_t t) { return fk_size(fk_of(t)); }
static double load(cudnnDataType_t t, const void *p, int64_t i) { return fk_load(fk_of(t), p, i); }
static void store(cudnnDataType_t t, void *p, int64_t i, double v) { fk_store(fk_of(t), p, i, v); }

static const char *dtype_name(cudnnDataType_t t) {
  switch (t) {
    case CUDNN_DATA_DOUBLE: return "double";
    case CUDNN_DATA_FLOAT: return "float";
    case CUDNN_DATA_HALF: return "half";
    case CUDNN_DATA_BFLOAT16: return "bfloat16";
    default: return "unsupported";
  }
}


/* ---- handles and descriptors --------------------------------------------------------------------------------- */

enum { MAGIC_HANDLE = 0x646e6e68, MAGIC_TENSOR = 0x646e6e74, MAGIC_FILTER = 0x646e6e66, MAGIC_CONV = 0x646e6e63 };

struct cudnnContext {
  uint32_t magic;
  cudaStream_t stream;
};

/* A 4-D array: sizes and element strides in logical order ((N, C, H, W) or (K, C, R, S)). */
typedef struct {
  int64_t size[4], stride[4];
} shape4_t;

struct cudnnTensorStruct {
  uint32_t magic;
  int set;
  cudnnDataType_t type;
  shape4_t s;
};

struct cudnnFilterStruct {
  uint32_t magic;
  int set;
  cudnnDataType_t type;
  cudnnTensorFormat_t format;
  shape4_t s;  // strides follow from the format
};

struct cudnnConvolutionStruct {
  uint32_t magic;
  int set;  // cudnnSetConvolution2dDescriptor called
  int pad[2], stride[2], dil[2], groups;
  cudnnConvolutionMode_t mode;
  cudnnDataType_t compute;
  cudnnMathType_t math;
};

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle) {
  if (!handle) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnCreate: handle is NULL");
  struct cudnnContext *h = calloc(1, sizeof *h);
  if (!h) return fail(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED, "cudnnCreate: out of host memory");
  h->magic = MAGIC_HANDLE;
  *handle = h;
  return CUDNN_STATUS_SUCCESS;
}

static int handle_ok(cudnnHandle_t h) { return h && h->magic == MAGIC_HANDLE; }

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  if (!handle_ok(handle)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnDestroy: not a handle");
  handle->magic = 0;
  free(handle);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
  if (!handle_ok(handle)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetStream: not a handle");
  handle->stream = streamId;
  return CUDNN_STATUS_SUCCESS;
}

/* Creates and destroys one kind of descriptor (zeroed but for its magic; NULL destroys nothing). */
#define DESCRIPTOR_LIFE_(Kind, type_, magic_)                                                                  \
  cudnnStatus_t cudnnCreate##Kind##Descriptor(type_ *d) {                                                     \
    if (!d) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnCreate" #Kind "Descriptor: NULL pointer"); \
    type_ p = calloc(1, sizeof *p);                                                                           \
    if (!p)                                                                                                   \
      return fail(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED,                                         \
                  "cudnnCreate" #Kind "Descriptor: out of host memory");                                      \
    p->magic = magic_;                                                                                        \
    *d = p;                                                                                                   \
    return CUDNN_STATUS_SUCCESS;                                                                              \
  }                                                                                                           \
  cudnnStatus_t cudnnDestroy##Kind##Descriptor(type_ d) {                                                     \
    if (!d) return CUDNN_STATUS_SUCCESS;                                                                      \
    if (d->magic != magic_) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnDestroy" #Kind "Descriptor: not one");  \
    d->magic = 0;                                                                                             \
    free(d);                                                                                                  \
    return CUDNN_STATUS_SUCCESS;                                                                              \
  }

DESCRIPTOR_LIFE_(Tensor, cudnnTensorDescriptor_t, MAGIC_TENSOR)
DESCRIPTOR_LIFE_(Filter, cudnnFilterDescriptor_t, MAGIC_FILTER)
DESCRIPTOR_LIFE_(Convolution, cudnnConvolutionDescriptor_t, MAGIC_CONV)
#undef DESCRIPTOR_LIFE_

static cudnnStatus_t check_dtype(const char *fn, cudnnDataType_t t) {
  if (dtype_size(t)) return CUDNN_STATUS_SUCCESS;
  if ((int)t < 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: data type %d is not a cudnnDataType_t", fn, (int)t);
  return fail(CUDNN_STATUS_NOT_SUPPORTED,
              "%s: data type %d: the emulator's cuDNN takes float, double, half and bfloat16 only", fn, (int)t);
}

cudnnStatus_t cudnnSetTensor4dDescriptorEx(cudnnTensorDescriptor_t tensorDesc, cudnnDataType_t dataType, int n,
                                           int c, int h, int w, int nStride, int cStride, int hStride,
                                           int wStride) {
  const char *fn = "cudnnSetTensor4dDescriptorEx";
  if (!tensorDesc || tensorDesc->magic != MAGIC_TENSOR) return fail(CUDNN_STATUS_BAD_PARAM, "%s: not a tensor descriptor", fn);
  cudnnStatus_t st = check_dtype(fn, dataType);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: sizes (%d, %d, %d, %d) must be positive", fn, n, c, h, w);
  if (nStride <= 0 || cStride <= 0 || hStride <= 0 || wStride <= 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: strides (%d, %d, %d, %d) must be positive", fn, nStride, cStride,
                hStride, wStride);
  tensorDesc->type = dataType;
  const int sz[4] = {n, c, h, w}, sd[4] = {nStride, cStride, hStride, wStride};
  for (int i = 0; i < 4; i++) tensorDesc->s.size[i] = sz[i], tensorDesc->s.stride[i] = sd[i];
  tensorDesc->set = 1;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t filterDesc, cudnnDataType_t dataType,
                                         cudnnTensorFormat_t format, int k, int c, int h, int w) {
  const char *fn = "cudnnSetFilter4dDescriptor";
  if (!filterDesc || filterDesc->magic != MAGIC_FILTER) return fail(CUDNN_STATUS_BAD_PARAM, "%s: not a filter descriptor", fn);
  cudnnStatus_t st = check_dtype(fn, dataType);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  if (format == CUDNN_TENSOR_NCHW_VECT_C)
    return fail(CUDNN_STATUS_NOT_SUPPORTED, "%s: the emulator's cuDNN has no CUDNN_TENSOR_NCHW_VECT_C", fn);
  if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: format %d is not a cudnnTensorFormat_t", fn, (int)format);
  if (k <= 0 || c <= 0 || h <= 0 || w <= 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: sizes (%d, %d, %d, %d) must be positive", fn, k, c, h, w);
  shape4_t *s = &filterDesc->s;
  s->size[0] = k, s->size[1] = c, s->size[2] = h, s->size[3] = w;
  if (format == CUDNN_TENSOR_NCHW) {  // KCRS
    s->stride[3] = 1, s->stride[2] = w, s->stride[1] = (int64_t)h * w, s->stride[0] = (int64_t)c * h * w;
  } else {  // KRSC
    s->stride[1] = 1, s->stride[3] = c, s->stride[2] = (int64_t)w * c, s->stride[0] = (int64_t)h * w * c;
  }
  filterDesc->type = dataType;
  filterDesc->format = format;
  filterDesc->set = 1;
  return CUDNN_STATUS_SUCCESS;
}

static int conv_ok(cudnnConvolutionDescriptor_t d) { return d && d->magic == MAGIC_CONV; }

cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t convDesc, int pad_h, int pad_w, int u,
                                              int v, int dilation_h, int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t computeType) {
  const char *fn = "cudnnSetConvolution2dDescriptor";
  if (!conv_ok(convDesc)) return fail(CUDNN_STATUS_BAD_PARAM, "%s: not a convolution descriptor", fn);
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dilation_h <= 0 || dilation_w <= 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: padding (%d, %d) must be >= 0, stride (%d, %d) and dilation (%d, %d) > 0",
                fn, pad_h, pad_w, u, v, dilation_h, dilation_w);
  if (mode == CUDNN_CONVOLUTION)
    return fail(CUDNN_STATUS_NOT_SUPPORTED, "%s: the emulator's cuDNN has CUDNN_CROSS_CORRELATION only", fn);
  if (mode != CUDNN_CROSS_CORRELATION)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: mode %d is not a cudnnConvolutionMode_t", fn, (int)mode);
  cudnnStatus_t st = check_dtype(fn, computeType);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  convDesc->pad[0] = pad_h, convDesc->pad[1] = pad_w;
  convDesc->stride[0] = u, convDesc->stride[1] = v;
  convDesc->dil[0] = dilation_h, convDesc->dil[1] = dilation_w;
  convDesc->mode = mode;
  convDesc->compute = computeType;
  if (convDesc->groups < 1) convDesc->groups = 1;  // the group count and math type are set apart, kept here
  convDesc->set = 1;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t convDesc, int groupCount) {
  if (!conv_ok(convDesc)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetConvolutionGroupCount: not a convolution descriptor");
  if (groupCount < 1) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetConvolutionGroupCount: %d groups", groupCount);
  convDesc->groups = groupCount;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t convDesc, cudnnMathType_t mathType) {
  if (!conv_ok(convDesc)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetConvolutionMathType: not a convolution descriptor");
  if (mathType != CUDNN_DEFAULT_MATH && mathType != CUDNN_TENSOR_OP_MATH &&
      mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION && mathType != CUDNN_FMA_MATH)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetConvolutionMathType: %d is not a cudnnMathType_t", (int)mathType);
  convDesc->math = mathType;  // every math type computes alike here: exactly, as FMA_MATH would at best
  return CUDNN_STATUS_SUCCESS;
}

/* ---- one problem ----------------------------------------------------------------------------------------------- */

typedef enum { DIR_FWD, DIR_BWD_DATA, DIR_BWD_FILTER } dir_t;

/* Everything a computation needs from the descriptors, by value. x (N, C, H, W), w (K, C/G, R, S),
   y (N, K, OH, OW). */
typedef struct {
  cudnnDataType_t type;
  shape4_t x, w, y;
  int pad[2], stride[2], dil[2], groups;
  cudnnMathType_t math;
} problem_t;

static const char *const dir_out[3] = {"y", "dx", "dw"};

/* Whether no two elements of s share an address: with the dimensions sorted by stride, each stride must pass
   the previous dimension's whole extent (sufficient, and what every real layout satisfies). */
static int no_overlap(const shape4_t *s) {
  int idx[4], n = 0;
  for (int i = 0; i < 4; i++)
    if (s->size[i] > 1) idx[n++] = i;
  for (int i = 1; i < n; i++)  // insertion sort by stride
    for (int j = i; j > 0 && s->stride[idx[j]] < s->stride[idx[j - 1]]; j--) {
      int t = idx[j];
      idx[j] = idx[j - 1], idx[j - 1] = t;
    }
  for (int i = 1; i < n; i++)
    if (s->stride[idx[i]] < s->stride[idx[i - 1]] * s->size[idx[i - 1]]) return 0;
  return 1;
}

/* Checks the descriptors of one call as cuDNN would and fills p. */
static cudnnStatus_t make_problem(const char *fn, dir_t dir, cudnnHandle_t h, cudnnTensorDescriptor_t xd,
                                  cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd,
                                  cudnnTensorDescriptor_t yd, problem_t *p) {
  if (!handle_ok(h)) return fail(CUDNN_STATUS_BAD_PARAM, "%s: not a handle", fn);
  if (!xd || !wd || !cd || !yd) return fail(CUDNN_STATUS_BAD_PARAM, "%s: a descriptor is NULL", fn);
  if (xd->magic != MAGIC_TENSOR || yd->magic != MAGIC_TENSOR || wd->magic != MAGIC_FILTER || cd->magic != MAGIC_CONV)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: a descriptor is not of its kind (or destroyed)", fn);
  if (!xd->set || !yd->set || !wd->set || !cd->set)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: a descriptor was never set", fn);
  if (xd->type != wd->type || yd->type != wd->type)
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: data types differ (x %s, w %s, y %s)", fn, dtype_name(xd->type),
                dtype_name(wd->type), dtype_name(yd->type));
  const cudnnDataType_t t = xd->type, ct = cd->compute;
  int config_ok = t == CUDNN_DATA_DOUBLE ? ct == CUDNN_DATA_DOUBLE : ct == CUDNN_DATA_FLOAT;
  if (!config_ok)
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                "%s: %s data with %s compute is not a configuration the emulator's cuDNN has (float and double "
                "compute in their own type, half and bfloat16 compute in float)",
                fn, dtype_name(t), dtype_name(ct));
  const shape4_t *x = &xd->s, *w = &wd->s, *y = &yd->s;
  const int64_t g = cd->groups;
  if (x->size[1] != w->size[1] * g || w->size[0] % g != 0)
    return fail(CUDNN_STATUS_BAD_PARAM,
                "%s: x has %lld channels, the filter (%lld, %lld, ...) with %lld groups wants %lld and a multiple "
                "of %lld outputs",
                fn, (long long)x->size[1], (long long)w->size[0], (long long)w->size[1], (long long)g,
                (long long)(w->size[1] * g), (long long)g);
  int64_t o[2];
  for (int i = 0; i < 2; i++) {
    int64_t span = (int64_t)cd->dil[i] * (w->size[2 + i] - 1) + 1, room = x->size[2 + i] + 2 * (int64_t)cd->pad[i];
    if (room < span)
      return fail(CUDNN_STATUS_BAD_PARAM,
                  "%s: the dilated filter (%lld) is larger than the padded input (%lld) in dimension %d", fn,
                  (long long)span, (long long)room, 2 + i);
    o[i] = (room - span) / cd->stride[i] + 1;
  }
  if (y->size[0] != x->size[0] || y->size[1] != w->size[0] || y->size[2] != o[0] || y->size[3] != o[1])
    return fail(CUDNN_STATUS_BAD_PARAM, "%s: y is (%lld, %lld, %lld, %lld), expected (%lld, %lld, %lld, %lld)",
                fn, (long long)y->size[0], (long long)y->size[1], (long long)y->size[2], (long long)y->size[3],
                (long long)x->size[0], (long long)w->size[0], (long long)o[0], (long long)o[1]);
  const shape4_t *out = dir == DIR_FWD ? y : dir == DIR_BWD_DATA ? x : w;
  if (!no_overlap(out))
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                "%s: the output %s's strides (%lld, %lld, %lld, %lld) make elements overlap", fn, dir_out[dir],
                (long long)out->stride[0], (long long)out->stride[1], (long long)out->stride[2],
                (long long)out->stride[3]);
  memset(p, 0, sizeof *p);
  p->type = t;
  p->x = *x, p->w = *w, p->y = *y;
  for (int i = 0; i < 2; i++) p->pad[i] = cd->pad[i], p->stride[i] = cd->stride[i], p->dil[i] = cd->dil[i];
  p->groups = cd->groups;
  p->math = cd->math;
  return CUDNN_STATUS_SUCCESS;
}

/* Bytes from an array's first element to past its last (strides are positive). */
static size_t extent_bytes(const shape4_t *s, cudnnDataType_t t) {
  int64_t last = 0;
  for (int i = 0; i < 4; i++) last += (s->size[i] - 1) * s->stride[i];
  return (size_t)(last + 1) * dtype_size(t);
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
  uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
  return pa < pb + nb && pb < pa + na;
}

/* The pointers of a call: none NULL, the output apart from the inputs (cuDNN computes nothing in place). */
static cudnnStatus_t check_pointers(const char *fn, dir_t dir, const problem_t *p, const void *x, const void *w,
                                    const void *y) {
  if (!x || !w || !y) return fail(CUDNN_STATUS_BAD_PARAM, "%s: a data pointer is NULL", fn);
  static const char *const names[3][3] = {{"y", "x", "w"}, {"dy", "dx", "w"}, {"dy", "x", "dw"}};
  const void *ptr[3] = {y, x, w};  // indexed like dir_t's outputs: y, x, w
  const shape4_t *sh[3] = {&p->y, &p->x, &p->w};
  const void *out = ptr[dir];
  size_t nout = extent_bytes(sh[dir], p->type);
  for (int i = 0; i < 3; i++)
    if (i != (int)dir && overlaps(out, nout, ptr[i], extent_bytes(sh[i], p->type)))
      return fail(CUDNN_STATUS_BAD_PARAM, "%s: the output %s overlaps the input %s", fn, names[dir][dir],
                  names[dir][i]);
  return CUDNN_STATUS_SUCCESS;
}

/* ---- the computation (queued device work) ---------------------------------------------------------------------- */

typedef struct {
  dir_t dir;
  problem_t p;
  double alpha, beta;
  const void *x, *w, *y; /* the output among them is written through */
} job_t;

static int64_t at(const shape4_t *s, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * s->stride[0] + b * s->stride[1] + c * s->stride[2] + d * s->stride[3];
}

static int64_t numel(const shape4_t *s) { return s->size[0] * s->size[1] * s->size[2] * s->size[3]; }

/* Whether the array lies in device memory (or pinned host memory) as the emulator knows it; reports it if not. */
static int reachable(const char *fn, const char *what, const shape4_t *s, cudnnDataType_t t, const void *ptr) {
  size_t n = extent_bytes(s, t);
  if (cuemu_memory_kind(ptr, n)) return 1;
  cuemu_fail("%s: %s (%p, %zu bytes) is not in device memory", fn, what, ptr, n);
  return 0;
}

/* The array as doubles, packed in its logical order; NULL (reported) when host memory is short. */
static double *unpack(const char *fn, const shape4_t *s, cudnnDataType_t t, const void *ptr) {
  double *d = malloc(sizeof(double) * (size_t)numel(s));
  if (!d) {
    cuemu_fail("%s: out of host memory", fn);
    return NULL;
  }
  double *q = d;
  for (int64_t a = 0; a < s->size[0]; a++)
    for (int64_t b = 0; b < s->size[1]; b++)
      for (int64_t c = 0; c < s->size[2]; c++)
        for (int64_t e = 0; e < s->size[3]; e++) *q++ = load(t, ptr, at(s, a, b, c, e));
  return d;
}

/* Along one dimension of backward-data: for each input position i < n, the filter taps t < nt and output
   positions o < no with i = o stride - pad + t dil, t ascending: pair[2 (i nt + j)] = t, pair[... + 1] = o for
   j < count[i]. */
typedef struct {
  int64_t *count, *pair;
} taps_t;

static taps_t *taps(const char *fn, int64_t n, int64_t nt, int64_t no, int64_t stride, int64_t pad, int64_t dil) {
  taps_t *tp = malloc(sizeof *tp + sizeof(int64_t) * (size_t)(n + 2 * n * nt));
  if (!tp) {
    cuemu_fail("%s: out of host memory", fn);
    return NULL;
  }
  tp->count = (int64_t *)(tp + 1);
  tp->pair = tp->count + n;
  for (int64_t i = 0; i < n; i++) {
    int64_t m = 0;
    for (int64_t t = 0; t < nt; t++) {
      const int64_t q = i + pad - t * dil;  // o stride
      if (q < 0 || q % stride != 0 || q / stride >= no) continue;
      tp->pair[2 * (i * nt + m)] = t;
      tp->pair[2 * (i * nt + m) + 1] = q / stride;
      m++;
    }
    tp->count[i] = m;
  }
  return tp;
}

static const char *const dir_fn[3] = {"cudnnConvolutionForward", "cudnnConvolutionBackwardData",
                                      "cudnnConvolutionBackwardFilter"};

static void run_convolution(void *arg) {
  const job_t *j = arg;
  const problem_t *p = &j->p;
  const char *fn = dir_fn[j->dir];
  const shape4_t *sx = &p->x, *sw = &p->w, *sy = &p->y;
  // The two inputs (by direction) and the output.
  const shape4_t *in_s[2], *out_s;
  const void *in_p[2];
  const char *in_n[2];
  void *out_p;
  switch (j->dir) {
    case DIR_FWD:
      in_s[0] = sx, in_p[0] = j->x, in_n[0] = "x", in_s[1] = sw, in_p[1] = j->w, in_n[1] = "w";
      out_s = sy, out_p = (void *)j->y;
      break;
    case DIR_BWD_DATA:
      in_s[0] = sy, in_p[0] = j->y, in_n[0] = "dy", in_s[1] = sw, in_p[1] = j->w, in_n[1] = "w";
      out_s = sx, out_p = (void *)j->x;
      break;
    default:
      in_s[0] = sx, in_p[0] = j->x, in_n[0] = "x", in_s[1] = sy, in_p[1] = j->y, in_n[1] = "dy";
      out_s = sw, out_p = (void *)j->w;
      break;
  }
  const int read_in = j->alpha != 0, read_out = j->beta != 0;
  if (!reachable(fn, dir_out[j->dir], out_s, p->type, out_p)) return;
  if (read_in && (!reachable(fn, in_n[0], in_s[0], p->type, in_p[0]) ||
                  !reachable(fn, in_n[1], in_s[1], p->type, in_p[1])))
    return;
  // Sizes: x (N, C, H, W), w (K, Cg, R, S), y (N, K, OH, OW); Kg outputs per group.
  const int64_t N = sx->size[0], C = sx->size[1], H = sx->size[2], W = sx->size[3];
  const int64_t K = sw->size[0], Cg = sw->size[1], R = sw->size[2], S = sw->size[3];
  const int64_t OH = sy->size[2], OW = sy->size[3], Kg = K / p->groups;
  const int64_t ph = p->pad[0], pw = p->pad[1], sh = p->stride[0], sv = p->stride[1], dh = p->dil[0],
                dw = p->dil[1];
  double *a = NULL, *b = NULL;
  taps_t *th = NULL, *tw = NULL;
  if (read_in) {
    int ok = (a = unpack(fn, in_s[0], p->type, in_p[0])) && (b = unpack(fn, in_s[1], p->type, in_p[1]));
    if (ok && j->dir == DIR_BWD_DATA)
      ok = (th = taps(fn, H, R, OH, sh, ph, dh)) && (tw = taps(fn, W, S, OW, sv, pw, dw));
    if (!ok) {
      free(a), free(b), free(th), free(tw);
      return;
    }
  }
  // Packed (logical-order) index helpers.
#define PX(n, c, h, w) ((((n) * C + (c)) * H + (h)) * W + (w))
#define PW(k, c, r, s) ((((k) * Cg + (c)) * R + (r)) * S + (s))
#define PY(n, k, h, w) ((((n) * K + (k)) * OH + (h)) * OW + (w))
  // Each output element: its sum (when the inputs are read), then alpha * sum + beta * prior. Elements are
  // independent and each sums in a fixed order, so the loops over them run on all cores with the same bits.
#define EMIT(i0, i1, i2, i3, ...)                                    \
  do {                                                               \
    double v = 0;                                                    \
    if (read_in) {                                                   \
      double acc = 0;                                                \
      __VA_ARGS__;                                                   \
      v = j->alpha * acc;                                            \
    }                                                                \
    int64_t o_ = at(out_s, i0, i1, i2, i3);                          \
    if (read_out) v += j->beta * load(p->type, out_p, o_);           \
    store(p->type, out_p, o_, v);                                    \
  } while (0)
  switch (j->dir) {
    case DIR_FWD:  // y[n, k, oh, ow] = sum over c, r, s of x[n, g Cg + c, oh sh - ph + r dh, ...] w[k, c, r, s]
#pragma omp parallel for collapse(2) schedule(static)
      for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
          for (int64_t oh = 0; oh < OH; oh++)
            for (int64_t ow = 0; ow < OW; ow++)
              EMIT(n, k, oh, ow, {
                const int64_t c0 = k / Kg * Cg;
                for (int64_t c = 0; c < Cg; c++)
                  for (int64_t r = 0; r < R; r++) {
                    const int64_t ih = oh * sh - ph + r * dh;
                    if (ih < 0 || ih >= H) continue;
                    for (int64_t s = 0; s < S; s++) {
                      const int64_t iw = ow * sv - pw + s * dw;
                      if (iw < 0 || iw >= W) continue;
                      acc += a[PX(n, c0 + c, ih, iw)] * b[PW(k, c, r, s)];
                    }
                  }
              });
      break;
    case DIR_BWD_DATA:  // dx[n, ci, ih, iw] = sum of dy[n, k, oh, ow] w[k, c, r, s] over the k of ci's group and
                        // the taps (r, oh) of ih and (s, ow) of iw
#pragma omp parallel for collapse(2) schedule(static)
      for (int64_t n = 0; n < N; n++)
        for (int64_t ci = 0; ci < C; ci++)
          for (int64_t ih = 0; ih < H; ih++)
            for (int64_t iw = 0; iw < W; iw++)
              EMIT(n, ci, ih, iw, {
                const int64_t gi = ci / Cg, c = ci % Cg, nh = th->count[ih], nw = tw->count[iw];
                const int64_t *hl = th->pair + 2 * ih * R, *wl = tw->pair + 2 * iw * S;
                for (int64_t k = gi * Kg; k < (gi + 1) * Kg; k++)
                  for (int64_t u = 0; u < nh; u++) {
                    const double *dyrow = a + PY(n, k, hl[2 * u + 1], 0), *wrow = b + PW(k, c, hl[2 * u], 0);
                    for (int64_t v = 0; v < nw; v++) acc += dyrow[wl[2 * v + 1]] * wrow[wl[2 * v]];
                  }
              });
      break;
    default:  // dw[k, c, r, s] = sum over n, oh, ow of dy[n, k, oh, ow] x[n, g Cg + c, oh sh - ph + r dh, ...]
#pragma omp parallel for collapse(2) schedule(static)
      for (int64_t k = 0; k < K; k++)
        for (int64_t c = 0; c < Cg; c++)
          for (int64_t r = 0; r < R; r++)
            for (int64_t s = 0; s < S; s++)
              EMIT(k, c, r, s, {
                const int64_t ci = k / Kg * Cg + c;
                for (int64_t n = 0; n < N; n++)
                  for (int64_t oh = 0; oh < OH; oh++) {
                    const int64_t ih = oh * sh - ph + r * dh;
                    if (ih < 0 || ih >= H) continue;
                    for (int64_t ow = 0; ow < OW; ow++) {
                      const int64_t iw = ow * sv - pw + s * dw;
                      if (iw < 0 || iw >= W) continue;
                      acc += a[PX(n, ci, ih, iw)] * b[PY(n, k, oh, ow)];
                    }
                  }
              });
      break;
  }
#undef EMIT
#undef PX
#undef PW
#undef PY
  free(a), free(b), free(th), free(tw);
}

/* What a Find*Ex call leaves in its output: every element NaN (all bits set, a NaN in each type). */
typedef struct {
  dir_t dir;
  cudnnDataType_t type;
  shape4_t s;
  void *out;
} clobber_t;

static void run_clobber(void *arg) {
  const clobber_t *c = arg;
  static const char *const fn[3] = {"cudnnFindConvolutionForwardAlgorithmEx",
                                    "cudnnFindConvolutionBackwardDataAlgorithmEx",
                                    "cudnnFindConvolutionBackwardFilterAlgorithmEx"};
  if (!reachable(fn[c->dir], dir_out[c->dir], &c->s, c->type, c->out)) return;
  const size_t es = dtype_size(c->type);
  for (int64_t a = 0; a < c->s.size[0]; a++)
    for (int64_t b = 0; b < c->s.size[1]; b++)
      for (int64_t d = 0; d < c->s.size[2]; d++)
        for (int64_t e = 0; e < c->s.size[3]; e++)
          memset((char *)c->out + (size_t)at(&c->s, a, b, d, e) * es, 0xff, es);
}

/* ---- algorithms ------------------------------------------------------------------------------------------------ */

/* The two algorithms of each direction, faster first: {algo, determinism}. */
static const int algos[3][2][2] = {
    {{CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, CUDNN_DETERMINISTIC},
     {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_DETERMINISTIC}},
    {{CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, CUDNN_DETERMINISTIC}, {CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, CUDNN_NON_DETERMINISTIC}},
    {{CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_DETERMINISTIC},
     {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_NON_DETERMINISTIC}},
};
enum { NALGOS = 2 };

/* Fills a perf array of any direction (the three structs have the same fields). */
#define FILL_PERF_(dir, math, requested, returned, perf, algo_type)              \
  do {                                                                           \
    int n_ = (requested) < NALGOS ? (requested) : NALGOS;                        \
    for (int i_ = 0; i_ < n_; i_++) {                                            \
      memset(&(perf)[i_], 0, sizeof(perf)[i_]);                                 \
      (perf)[i_].algo = (algo_type)algos[dir][i_][0];                            \
      (perf)[i_].status = CUDNN_STATUS_SUCCESS;                                  \
      (perf)[i_].time = 0.01f * (float)(i_ + 1);                                 \
      (perf)[i_].memory = 0;                                                     \
      (perf)[i_].determinism = (cudnnDeterminism_t)algos[dir][i_][1];            \
      (perf)[i_].mathType = (math);                                              \
    }                                                                            \
    *(returned) = n_;                                                            \
  } while (0)

static cudnnStatus_t max_count(const char *fn, cudnnHandle_t handle, int *count) {
  if (!handle_ok(handle)) return fail(CUDNN_STATUS_BAD_PARAM, "%s: not a handle", fn);
  if (!count) return fail(CUDNN_STATUS_BAD_PARAM, "%s: count is NULL", fn);
  *count = NALGOS;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t handle, int *count) {
  return max_count("cudnnGetConvolutionForwardAlgorithmMaxCount", handle, count);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t handle, int *count) {
  return max_count("cudnnGetConvolutionBackwardDataAlgorithmMaxCount", handle, count);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnnHandle_t handle, int *count) {
  return max_count("cudnnGetConvolutionBackwardFilterAlgorithmMaxCount", handle, count);
}

/* The checks common to the listing calls; p is the problem. */
static cudnnStatus_t listing(const char *fn, dir_t dir, cudnnHandle_t h, cudnnTensorDescriptor_t xd,
                             cudnnFilterDescriptor_t wd, cudnnConvolutionDescriptor_t cd, cudnnTensorDescriptor_t yd,
                             int requested, const int *returned, const void *perf, problem_t *p) {
  cudnnStatus_t st = make_problem(fn, dir, h, xd, wd, cd, yd, p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  if (!returned || !perf) return fail(CUDNN_STATUS_BAD_PARAM, "%s: a result pointer is NULL", fn);
  if (requested < 1) return fail(CUDNN_STATUS_BAD_PARAM, "%s: %d algorithms requested", fn, requested);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc,
                                                     const cudnnFilterDescriptor_t filterDesc,
                                                     const cudnnConvolutionDescriptor_t convDesc,
                                                     const cudnnTensorDescriptor_t destDesc,
                                                     const int requestedAlgoCount, int *returnedAlgoCount,
                                                     cudnnConvolutionFwdAlgoPerf_t *perfResults) {
  problem_t p;
  cudnnStatus_t st = listing("cudnnGetConvolutionForwardAlgorithm_v7", DIR_FWD, handle, srcDesc, filterDesc, convDesc,
                             destDesc, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_FWD, p.math, requestedAlgoCount, returnedAlgoCount, perfResults, cudnnConvolutionFwdAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t handle,
                                                          const cudnnFilterDescriptor_t filterDesc,
                                                          const cudnnTensorDescriptor_t diffDesc,
                                                          const cudnnConvolutionDescriptor_t convDesc,
                                                          const cudnnTensorDescriptor_t gradDesc,
                                                          const int requestedAlgoCount, int *returnedAlgoCount,
                                                          cudnnConvolutionBwdDataAlgoPerf_t *perfResults) {
  problem_t p;
  cudnnStatus_t st = listing("cudnnGetConvolutionBackwardDataAlgorithm_v7", DIR_BWD_DATA, handle, gradDesc,
                             filterDesc, convDesc, diffDesc, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_BWD_DATA, p.math, requestedAlgoCount, returnedAlgoCount, perfResults, cudnnConvolutionBwdDataAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t handle,
                                                            const cudnnTensorDescriptor_t srcDesc,
                                                            const cudnnTensorDescriptor_t diffDesc,
                                                            const cudnnConvolutionDescriptor_t convDesc,
                                                            const cudnnFilterDescriptor_t gradDesc,
                                                            const int requestedAlgoCount, int *returnedAlgoCount,
                                                            cudnnConvolutionBwdFilterAlgoPerf_t *perfResults) {
  problem_t p;
  cudnnStatus_t st = listing("cudnnGetConvolutionBackwardFilterAlgorithm_v7", DIR_BWD_FILTER, handle, srcDesc,
                             gradDesc, convDesc, diffDesc, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_BWD_FILTER, p.math, requestedAlgoCount, returnedAlgoCount, perfResults,
             cudnnConvolutionBwdFilterAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

/* A Find*Ex call's checks and its clobbering of the output (queued, in stream order). */
static cudnnStatus_t find(const char *fn, dir_t dir, cudnnHandle_t h, cudnnTensorDescriptor_t xd, const void *x,
                          cudnnFilterDescriptor_t wd, const void *w, cudnnConvolutionDescriptor_t cd,
                          cudnnTensorDescriptor_t yd, const void *y, int requested, const int *returned,
                          const void *perf, problem_t *p) {
  cudnnStatus_t st = listing(fn, dir, h, xd, wd, cd, yd, requested, returned, perf, p);
  if (st == CUDNN_STATUS_SUCCESS) st = check_pointers(fn, dir, p, x, w, y);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  clobber_t c;
  memset(&c, 0, sizeof c);
  c.dir = dir;
  c.type = p->type;
  c.s = dir == DIR_FWD ? p->y : dir == DIR_BWD_DATA ? p->x : p->w;
  c.out = (void *)(dir == DIR_FWD ? y : dir == DIR_BWD_DATA ? x : w);
  cuemu_enqueue(h->stream, run_clobber, &c, sizeof c);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
                                                     const void *x, const cudnnFilterDescriptor_t wDesc,
                                                     const void *w, const cudnnConvolutionDescriptor_t convDesc,
                                                     const cudnnTensorDescriptor_t yDesc, void *y,
                                                     const int requestedAlgoCount, int *returnedAlgoCount,
                                                     cudnnConvolutionFwdAlgoPerf_t *perfResults, void *workSpace,
                                                     size_t workSpaceSizeInBytes) {
  (void)workSpace, (void)workSpaceSizeInBytes;  // no algorithm wants any
  problem_t p;
  cudnnStatus_t st = find("cudnnFindConvolutionForwardAlgorithmEx", DIR_FWD, handle, xDesc, x, wDesc, w, convDesc,
                          yDesc, y, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_FWD, p.math, requestedAlgoCount, returnedAlgoCount, perfResults, cudnnConvolutionFwdAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc,
                                                          const void *w, const cudnnTensorDescriptor_t dyDesc,
                                                          const void *dy, const cudnnConvolutionDescriptor_t convDesc,
                                                          const cudnnTensorDescriptor_t dxDesc, void *dx,
                                                          const int requestedAlgoCount, int *returnedAlgoCount,
                                                          cudnnConvolutionBwdDataAlgoPerf_t *perfResults,
                                                          void *workSpace, size_t workSpaceSizeInBytes) {
  (void)workSpace, (void)workSpaceSizeInBytes;
  problem_t p;
  cudnnStatus_t st = find("cudnnFindConvolutionBackwardDataAlgorithmEx", DIR_BWD_DATA, handle, dxDesc, dx, wDesc, w,
                          convDesc, dyDesc, dy, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_BWD_DATA, p.math, requestedAlgoCount, returnedAlgoCount, perfResults, cudnnConvolutionBwdDataAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
                                                            const void *x, const cudnnTensorDescriptor_t dyDesc,
                                                            const void *y, const cudnnConvolutionDescriptor_t convDesc,
                                                            const cudnnFilterDescriptor_t dwDesc, void *dw,
                                                            const int requestedAlgoCount, int *returnedAlgoCount,
                                                            cudnnConvolutionBwdFilterAlgoPerf_t *perfResults,
                                                            void *workSpace, size_t workSpaceSizeInBytes) {
  (void)workSpace, (void)workSpaceSizeInBytes;
  problem_t p;
  cudnnStatus_t st = find("cudnnFindConvolutionBackwardFilterAlgorithmEx", DIR_BWD_FILTER, handle, xDesc, x, dwDesc,
                          dw, convDesc, dyDesc, y, requestedAlgoCount, returnedAlgoCount, perfResults, &p);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  FILL_PERF_(DIR_BWD_FILTER, p.math, requestedAlgoCount, returnedAlgoCount, perfResults,
             cudnnConvolutionBwdFilterAlgo_t);
  return CUDNN_STATUS_SUCCESS;
}

/* ---- the convolutions ------------------------------------------------------------------------------------------ */

/* Checks a call, copies what it needs and queues it on the handle's stream. x, w, y: the call's three arrays in
   the forward problem's roles (for backward-data x is dx and y is dy; for backward-filter w is dw, y is dy). */
static cudnnStatus_t convolve(dir_t dir, cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t xd,
                              const void *x, cudnnFilterDescriptor_t wd, const void *w,
                              cudnnConvolutionDescriptor_t cd, int algo, size_t ws_bytes, const void *beta,
                              cudnnTensorDescriptor_t yd, const void *y) {
  (void)ws_bytes;  // no algorithm here wants workspace: any size (and pointer) will do
  const char *fn = dir_fn[dir];
  job_t j;
  memset(&j, 0, sizeof j);
  cudnnStatus_t st = make_problem(fn, dir, h, xd, wd, cd, yd, &j.p);
  if (st == CUDNN_STATUS_SUCCESS) st = check_pointers(fn, dir, &j.p, x, w, y);
  if (st != CUDNN_STATUS_SUCCESS) return st;
  if (!alpha || !beta) return fail(CUDNN_STATUS_BAD_PARAM, "%s: alpha or beta is NULL", fn);
  if (algo != algos[dir][0][0] && algo != algos[dir][1][0])
    return fail(CUDNN_STATUS_NOT_SUPPORTED, "%s: algorithm %d is not one the emulator's cuDNN lists (%d, %d)", fn, algo,
                algos[dir][0][0], algos[dir][1][0]);
  if (j.p.type == CUDNN_DATA_DOUBLE) {  // host scaling factors: double for double data, float otherwise
    j.alpha = *(const double *)alpha, j.beta = *(const double *)beta;
  } else {
    j.alpha = *(const float *)alpha, j.beta = *(const float *)beta;
  }
  j.dir = dir;
  j.x = x, j.w = w, j.y = y;
  cuemu_enqueue(h->stream, run_convolution, &j, sizeof j);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void *alpha, const cudnnTensorDescriptor_t xDesc,
                                      const void *x, const cudnnFilterDescriptor_t wDesc, const void *w,
                                      const cudnnConvolutionDescriptor_t convDesc, cudnnConvolutionFwdAlgo_t algo,
                                      void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
                                      const cudnnTensorDescriptor_t yDesc, void *y) {
  (void)workSpace;
  return convolve(DIR_FWD, handle, alpha, xDesc, x, wDesc, w, convDesc, (int)algo, workSpaceSizeInBytes, beta, yDesc,
                  y);
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void *alpha,
                                           const cudnnFilterDescriptor_t wDesc, const void *w,
                                           const cudnnTensorDescriptor_t dyDesc, const void *dy,
                                           const cudnnConvolutionDescriptor_t convDesc,
                                           cudnnConvolutionBwdDataAlgo_t algo, void *workSpace,
                                           size_t workSpaceSizeInBytes, const void *beta,
                                           const cudnnTensorDescriptor_t dxDesc, void *dx) {
  (void)workSpace;
  return convolve(DIR_BWD_DATA, handle, alpha, dxDesc, dx, wDesc, w, convDesc, (int)algo, workSpaceSizeInBytes, beta,
                  dyDesc, dy);
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void *alpha,
                                             const cudnnTensorDescriptor_t xDesc, const void *x,
                                             const cudnnTensorDescriptor_t dyDesc, const void *dy,
                                             const cudnnConvolutionDescriptor_t convDesc,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void *workSpace,
                                             size_t workSpaceSizeInBytes, const void *beta,
                                             const cudnnFilterDescriptor_t dwDesc, void *dw) {
  (void)workSpace;
  return convolve(DIR_BWD_FILTER, handle, alpha, xDesc, x, dwDesc, dw, convDesc, (int)algo, workSpaceSizeInBytes, beta,
                  dyDesc, dy);
}

/* Tensors between devices (t:cuda(), t:cpu(), t:to('cuda:1')) and pinned host tensors, over the
   device layer's copies; built in every configuration (without CUDA the device layer says why not). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"

/* wait 0: a host-to-device copy is only queued on the current stream (non_blocking). */
static dlua_status_t to_device(dlua_tensor_t **out, const dlua_tensor_t *t, int device, int wait) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "to: out is NULL");
  *out = NULL;
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "to: the tensor is NULL (freed, or never created)");
  if (device < DLUA_CPU) return DLUA_ERR(DLUA_ERR_ARG, "to: invalid device %d", device);
  char b[200];
  if (device != DLUA_CPU && device >= dlua_cuda_device_count())
    return DLUA_ERR(DLUA_ERR_ARG, "to: cannot move %s to cuda:%d: %s%s%s", dlua_tensor_describe(t, b, sizeof b), device,
                    dlua_cuda_device_count() ? "no such device" : "no CUDA device available (",
                    dlua_cuda_device_count() ? "" : dlua_cuda_unavailable_reason(), dlua_cuda_device_count() ? "" : ")");
  dlua_tensor_t *src = NULL;
  // A strided source becomes contiguous on its own device first (CUDA: the copy kernel).
  DLUA_TRY(dlua_tensor_contiguous(&src, t));
  dlua_status_t s = dlua_tensor_empty(out, t->ndim, t->sizes, t->dtype, device);
  if (s == DLUA_OK) {
    size_t bytes = (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype);
    int kind = t->device == DLUA_CPU ? (device == DLUA_CPU ? -1 : 0) : (device == DLUA_CPU ? 1 : 2);
    if (kind < 0) {
      memcpy(dlua_tensor_ptr(*out), dlua_tensor_ptr(src), bytes);
    } else if (bytes > 0) {
      // On the current stream of the CUDA side, so the copy follows the kernels that wrote the source
      // (and precedes those that will read the destination); then wait, so the call is synchronous as
      // PyTorch's default .to() is and the host buffer may be reused at once.
      int dev = kind == 0 ? device : t->device;
      if (kind == 2 && device != t->device) s = dlua_cuda_stream_synchronize(dlua_cuda_current_stream(device));
      dlua_cuda_stream_t *st = dlua_cuda_current_stream(dev);
      if (s == DLUA_OK && !st) s = DLUA_ERR(DLUA_ERR_BACKEND, "to: no stream for cuda:%d", dev);
      if (s == DLUA_OK) s = dlua_cuda_memcpy(dlua_tensor_ptr(*out), dlua_tensor_ptr(src), bytes, kind, 1, st);
      if (s == DLUA_OK && (wait || kind != 0 || src->storage != t->storage)) s = dlua_cuda_stream_synchronize(st);
    }
  }
  dlua_tensor_free(src);
  if (s != DLUA_OK) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

dlua_status_t dlua_tensor_to_device(dlua_tensor_t **out, const dlua_tensor_t *t, int device) {
  return to_device(out, t, device, 1);
}

dlua_status_t dlua_tensor_to_device_async(dlua_tensor_t **out, const dlua_tensor_t *t, int device) {
  return to_device(out, t, device, 0);
}

static void pinned_free(void *ctx, void *data) {
  if (dlua_cuda_host_free(data) != DLUA_OK) dlua_clear_error();
}

dlua_status_t dlua_tensor_pin_memory(dlua_tensor_t **out, const dlua_tensor_t *t) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "pin_memory: out is NULL");
  *out = NULL;
  DLUA_TRY(dlua_require_cpu("pin_memory", t));
  size_t bytes = (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype);
  void *p = NULL;
  DLUA_TRY(dlua_cuda_host_alloc(&p, bytes));
  int64_t strides[DLUA_MAX_DIMS];
  dlua_contiguous_strides(t->ndim, t->sizes, strides);
  dlua_status_t s = dlua_tensor_wrap(out, t->ndim, t->sizes, strides, t->dtype, p, pinned_free, NULL);
  if (s != DLUA_OK) {
    pinned_free(NULL, p);
    return s;
  }
  s = dlua_tensor_copy_(*out, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

/* Tensors between devices (t:cuda(), t:cpu(), t:to('cuda:1')) and pinned host tensors, over the
   device layer's copies; built in every configuration (without CUDA the device layer says why not). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"

/* Whether t's elements fill numel consecutive slots from its first one, each once (PyTorch's "non-overlapping and
   dense"): its bytes then move as they are, and the copy keeps its strides (channels-last, a transpose). */
static int is_dense(const dlua_tensor_t *t) {
  int dims[DLUA_MAX_DIMS], n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->sizes[d] == 0) return 0;
    if (t->sizes[d] > 1) dims[n++] = d;
  }
  for (int i = 1; i < n; i++)  // by stride, innermost first (insertion sort: at most DLUA_MAX_DIMS)
    for (int j = i; j > 0 && t->strides[dims[j]] < t->strides[dims[j - 1]]; j--) {
      int x = dims[j];
      dims[j] = dims[j - 1];
      dims[j - 1] = x;
    }
  int64_t expected = 1;
  for (int i = 0; i < n; i++) {
    if (t->strides[dims[i]] != expected) return 0;
    expected *= t->sizes[dims[i]];
  }
  return 1;
}

/* A strided (N, C, H, W) view whose strides run C, W, H, N from the innermost (a slice of a channels-last tensor). */
static int is_channels_last_order(const dlua_tensor_t *t) {
  static const int order[4] = {1, 3, 2, 0};
  if (t->ndim != 4 || t->sizes[1] < 2) return 0;
  int64_t prev = 0;
  for (int i = 0; i < 4; i++) {
    int d = order[i];
    if (t->sizes[d] == 1) continue;
    if (t->strides[d] <= prev) return 0;
    prev = t->strides[d];
  }
  return 1;
}

/* A dense copy of t on its own device (CUDA: the copy kernel): channels-last memory for a view in that order,
   row-major otherwise (as PyTorch's preserve_format). */
static dlua_status_t dense_copy(dlua_tensor_t **out, const dlua_tensor_t *t) {
  if (!is_channels_last_order(t)) return dlua_tensor_contiguous(out, t);
  const int64_t nhwc[4] = {t->sizes[0], t->sizes[2], t->sizes[3], t->sizes[1]};
  DLUA_TRY(dlua_tensor_empty(out, 4, nhwc, t->dtype, t->device));
  dlua_tensor_t *c = *out;  // (N, H, W, C) memory seen as (N, C, H, W)
  int64_t s[4] = {c->strides[0], c->strides[3], c->strides[1], c->strides[2]};
  memcpy(c->sizes, t->sizes, sizeof(int64_t) * 4);
  memcpy(c->strides, s, sizeof s);
  dlua_status_t st = dlua_tensor_copy_(c, t);
  if (st != DLUA_OK) {
    dlua_tensor_free(c);
    *out = NULL;
  }
  return st;
}

/* wait 0: a host-to-device copy is only queued on the current stream (non_blocking). The copy has t's strides when t
   is dense (channels-last stays channels-last, as PyTorch's .to()), else those of dense_copy. */
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
  if (is_dense(t)) {
    src = dlua_tensor_alias(t);
    if (!src) return DLUA_ERR(DLUA_ERR_OOM, "to: out of memory for a tensor handle");
  } else {
    DLUA_TRY(dense_copy(&src, t));  // a strided source becomes dense on its own device first
  }
  int64_t numel = dlua_tensor_numel(t);
  dlua_status_t s = dlua_tensor_empty(out, 1, &numel, t->dtype, device);
  if (s == DLUA_OK) {
    (*out)->ndim = t->ndim;  // src's layout over the new storage: its first element is the lowest address
    memcpy((*out)->sizes, src->sizes, sizeof(int64_t) * (size_t)t->ndim);
    memcpy((*out)->strides, src->strides, sizeof(int64_t) * (size_t)t->ndim);
    size_t bytes = (size_t)numel * dlua_dtype_size(t->dtype);
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

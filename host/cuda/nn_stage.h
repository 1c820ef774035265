/* act_layout.h's staging and `out` convention on a tensor's own device, for the batch-norm and pooling CUDA paths. */
#ifndef DLUA_CUDA_NN_STAGE_H
#define DLUA_CUDA_NN_STAGE_H
#include <stdint.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cpu/act_layout.h"

/* Errors unless every tensor of ts (entries may be NULL) lives on x's device, naming x and the first that does not. */
static inline dlua_status_t act_same_device(const char *op, const dlua_tensor_t *x, const dlua_tensor_t *const *ts,
                                            int n) {
  for (int i = 0; i < n; i++) DLUA_TRY(dlua_same_device(op, x, ts[i]));
  return DLUA_OK;
}

/* act_alloc on `device`. */
static inline dlua_status_t act_alloc_on(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dt, int fmt,
                                         int device) {
  if (fmt != ACT_CL) return dlua_tensor_empty(out, ndim, sizes, dt, device);
  int64_t n = dlua_shape_numel(ndim, sizes), st[DLUA_MAX_DIMS];
  act_strides(ndim, sizes, ACT_CL, st);
  dlua_tensor_t *flat = NULL;
  DLUA_TRY(dlua_tensor_empty(&flat, 1, &n, dt, device));
  dlua_status_t s = dlua_tensor_as_strided(out, flat, ndim, sizes, st, 0);
  dlua_tensor_free(flat);
  return s;
}

/* act_stage on t's device: a new handle on t when it already is dtype ct in format fmt, else a copy. */
static inline dlua_status_t act_stage_on(const dlua_tensor_t *t, dlua_dtype_t ct, int fmt, dlua_tensor_t **v) {
  *v = NULL;
  if (t->dtype == ct && act_is_format(t, fmt)) {
    *v = dlua_tensor_alias(t);
    return *v ? DLUA_OK : dlua_last_status();
  }
  DLUA_TRY(act_alloc_on(v, t->ndim, t->sizes, ct, fmt, t->device));
  dlua_status_t s = dlua_tensor_copy_(*v, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*v);
    *v = NULL;
  }
  return s;
}

/* act_out_begin on `device` (finish with act_out_end, which is device-agnostic). */
static inline dlua_status_t act_out_begin_on(const char *op, act_out_t *o, dlua_tensor_t **out, int ndim,
                                             const int64_t *sizes, dlua_dtype_t alloc_dt, dlua_dtype_t ct, int fmt,
                                             const dlua_tensor_t *const *inputs, int ninputs, int elementwise,
                                             int device) {
  o->out = out;
  o->work = NULL;
  o->work_owned = 0;
  o->allocated = 0;
  if (!out) return DLUA_OK;
  if (!*out) {
    DLUA_TRY(act_alloc_on(out, ndim, sizes, alloc_dt, fmt, device));
    o->allocated = 1;
  } else {
    DLUA_TRY(dlua_prepare_out_on(op, out, ndim, sizes, alloc_dt, device, NULL));
  }
  int direct = (*out)->dtype == ct && act_is_format(*out, fmt);
  for (int i = 0; direct && i < ninputs; i++)
    if (inputs[i] && dlua_tensor_same_storage(*out, inputs[i]) && !(elementwise && act_same_view(*out, inputs[i])))
      direct = 0;
  if (direct) {
    o->work = *out;
    return DLUA_OK;
  }
  dlua_status_t s = act_alloc_on(&o->work, ndim, sizes, ct, fmt, device);
  if (s != DLUA_OK) {
    if (o->allocated) {
      dlua_tensor_free(*out);
      *out = NULL;
      o->allocated = 0;
    }
    return s;
  }
  o->work_owned = 1;
  return DLUA_OK;
}

#endif

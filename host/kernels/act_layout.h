/* Memory formats of activations (N, C, spatial...) for batch-norm and pooling: detection, staging and the `out` convention. */
#ifndef DLUA_CPU_ACT_LAYOUT_H
#define DLUA_CPU_ACT_LAYOUT_H
#include <stdint.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"

/* Contiguous (N, C, S...) or channels-last (N, S..., C) memory; anything else is OTHER. */
enum { ACT_CONTIG = 0, ACT_CL = 1, ACT_OTHER = 2 };

static inline void act_strides(int ndim, const int64_t *s, int fmt, int64_t *st) {
  if (fmt == ACT_CL && ndim >= 2) {
    // as dlua_contiguous_strides: a zero size does not zero the outer strides (an empty
    // tensor allocated channels-last must not look expanded)
    int64_t acc = s[1] > 1 ? s[1] : 1;
    st[1] = 1;
    for (int d = ndim - 1; d >= 2; d--) {
      st[d] = acc;
      if (s[d] > 1) acc *= s[d];
    }
    st[0] = acc;
  } else {
    dlua_contiguous_strides(ndim, s, st);
  }
}

/* exact: every stride must match; otherwise those of size-1 dims may be anything. */
static inline int act_strides_match(const dlua_tensor_t *t, const int64_t *st, int exact) {
  for (int d = 0; d < t->ndim; d++)
    if (t->sizes[d] == 0) return 1;
  for (int d = 0; d < t->ndim; d++)
    if (t->strides[d] != st[d] && (exact || t->sizes[d] != 1)) return 0;
  return 1;
}

/* With one channel or one spatial position both formats are the same bytes; exact strides then
   say which one the caller built, so a channels-last network stays channels-last. */
static inline int act_format(const dlua_tensor_t *t) {
  int64_t a[DLUA_MAX_DIMS], b[DLUA_MAX_DIMS];
  act_strides(t->ndim, t->sizes, ACT_CONTIG, a);
  act_strides(t->ndim, t->sizes, ACT_CL, b);
  if (act_strides_match(t, a, 1)) return ACT_CONTIG;
  if (act_strides_match(t, b, 1)) return ACT_CL;
  if (act_strides_match(t, a, 0)) return ACT_CONTIG;
  if (act_strides_match(t, b, 0)) return ACT_CL;
  return ACT_OTHER;
}

/* The layout of pref when it has one (pref may be NULL), else that of fallback, else contiguous:
   a backward's gradients follow the forward input (or the caller's output), not the incoming gradient. */
static inline int act_format_pref(const dlua_tensor_t *pref, const dlua_tensor_t *fallback) {
  int f = pref ? act_format(pref) : ACT_OTHER;
  if (f == ACT_OTHER) f = act_format(fallback);
  return f == ACT_OTHER ? ACT_CONTIG : f;
}

/* Whether t's bytes are laid out as fmt (size-1 dims may carry any stride). */
static inline int act_is_format(const dlua_tensor_t *t, int fmt) {
  int64_t st[DLUA_MAX_DIMS];
  act_strides(t->ndim, t->sizes, fmt, st);
  return act_strides_match(t, st, 0);
}

/* A new tensor of sizes on `device` laid out in fmt (ACT_OTHER allocates contiguous). */
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

static inline dlua_status_t act_alloc(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dt, int fmt) {
  return act_alloc_on(out, ndim, sizes, dt, fmt, DLUA_CPU);
}

/* Errors unless every tensor of ts (entries may be NULL) lives on x's device, naming x and the first that does not. */
static inline dlua_status_t act_same_device(const char *op, const dlua_tensor_t *x, const dlua_tensor_t *const *ts,
                                            int n) {
  for (int i = 0; i < n; i++) DLUA_TRY(dlua_same_device(op, x, ts[i]));
  return DLUA_OK;
}

/* t as dtype ct laid out in fmt, on t's device: a new handle on t when it already is, else a converted copy. */
static inline dlua_status_t act_stage(const dlua_tensor_t *t, dlua_dtype_t ct, int fmt, dlua_tensor_t **v) {
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

/* A result under the `out` convention: kernels write `work` (dtype ct, format fmt), which is
   the caller's tensor itself when it qualifies, else a temporary copied into it at the end. */
typedef struct {
  dlua_tensor_t **out;
  dlua_tensor_t *work;
  int work_owned; /* work is a temporary */
  int allocated;  /* *out was allocated here (freed again on failure) */
} act_out_t;

static inline int act_same_view(const dlua_tensor_t *a, const dlua_tensor_t *b) {
  if (a->storage != b->storage || a->offset != b->offset || a->ndim != b->ndim || a->dtype != b->dtype) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->sizes[d] != b->sizes[d] || a->strides[d] != b->strides[d]) return 0;
  return 1;
}

/* alloc_dt: the dtype a NULL *out gets (on `device`). inputs (entries may be NULL) are the tensors
   the kernel reads; a caller's tensor sharing memory with one of them is written directly only when
   it is exactly that input and the kernel is elementwise (reads element i before writing it). */
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

static inline dlua_status_t act_out_begin(const char *op, act_out_t *o, dlua_tensor_t **out, int ndim,
                                          const int64_t *sizes, dlua_dtype_t alloc_dt, dlua_dtype_t ct, int fmt,
                                          const dlua_tensor_t *const *inputs, int ninputs, int elementwise) {
  return act_out_begin_on(op, o, out, ndim, sizes, alloc_dt, ct, fmt, inputs, ninputs, elementwise, DLUA_CPU);
}

/* Copies work into the caller's tensor when they differ (s == DLUA_OK) and releases the
   temporary; on failure frees what act_out_begin allocated. Returns the final status. */
static inline dlua_status_t act_out_end(act_out_t *o, dlua_status_t s) {
  if (!o->out) return s;
  if (s == DLUA_OK && o->work_owned) s = dlua_tensor_copy_(*o->out, o->work);
  if (o->work_owned) dlua_tensor_free(o->work);
  o->work = NULL;
  o->work_owned = 0;
  if (s != DLUA_OK && o->allocated) {
    dlua_tensor_free(*o->out);
    *o->out = NULL;
    o->allocated = 0;
  }
  return s;
}

#endif

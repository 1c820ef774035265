/* Staging for the loss and activation front doors (host/ops/loss.c, host/ops/activation.c): kernels of the loss
   family (kernels/loss.h) see contiguous buffers of their compute dtype, and write a result that the `out`
   convention then copies (converting) into the caller's tensor. */
#include "ops/loss_stage.h"
#include "ops/common.h"
#include <stdint.h>
#include "core/dtype.h"
#include "core/error.h"

/* f64 computes in double; f32, f16 and bf16 in float. */
dlua_dtype_t dlua_loss_compute_dtype(dlua_dtype_t d) { return d == DLUA_DTYPE_F64 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32; }

dlua_status_t dlua_loss_check(const char *op, const char *what, const dlua_tensor_t *t, int floating) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  if (floating && !dlua_dtype_is_floating(t->dtype)) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be a floating-point tensor, got %s", op, what,
                    dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

static int same_shape(const dlua_tensor_t *a, const dlua_tensor_t *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->sizes[d] != b->sizes[d]) return 0;
  return 1;
}

dlua_status_t dlua_loss_check_same_shape(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                         const dlua_tensor_t *b) {
  if (same_shape(a, b)) return DLUA_OK;
  char b1[200], b2[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %s and %s %s must have the same shape", op, wa,
                  dlua_tensor_describe(a, b1, sizeof b1), wb, dlua_tensor_describe(b, b2, sizeof b2));
}


dlua_status_t dlua_loss_in_stage(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_loss_in_t *b) {
  b->tmp = NULL;
  b->n = dlua_tensor_numel(t);
  if (t->dtype == ct && dlua_tensor_is_contiguous(t)) {
    b->p = dlua_tensor_ptr(t);
    return DLUA_OK;
  }
  DLUA_TRY(dlua_tensor_to_dtype(&b->tmp, t, ct));
  b->p = dlua_tensor_ptr(b->tmp);
  return DLUA_OK;
}

void dlua_loss_in_release(dlua_loss_in_t *b, int n) {
  for (int i = 0; i < n; i++) {
    dlua_tensor_free(b[i].tmp);
    b[i].tmp = NULL;
  }
}


dlua_status_t dlua_loss_out_stage(const char *op, dlua_tensor_t **out, int nd, const int64_t *sizes, dlua_dtype_t dt,
                                  dlua_dtype_t ct, const dlua_loss_in_t *ins, int nin, int device, dlua_loss_out_t *o) {
  o->out = out;
  o->tmp = NULL;
  o->allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, out, nd, sizes, dt, device, &o->allocated));
  dlua_tensor_t *t = *out;
  int direct = t->dtype == ct && dlua_tensor_is_contiguous(t);
  if (!o->allocated) {
    DLUA_TRY(dlua_ops_check_writable(op, t));
    int64_t n = dlua_tensor_numel(t);
    size_t es = dlua_dtype_size(ct);
    uintptr_t lo = (uintptr_t)dlua_tensor_ptr(t), hi = lo + (uintptr_t)n * es;
    for (int i = 0; direct && i < nin; i++) {
      if (ins[i].tmp || ins[i].n == 0 || n == 0) continue;
      uintptr_t ilo = (uintptr_t)ins[i].p, ihi = ilo + (uintptr_t)ins[i].n * es;
      if (ilo < hi && lo < ihi && !(ilo == lo && ins[i].n == n)) direct = 0;
    }
  }
  if (direct) {
    o->p = dlua_tensor_ptr(t);
    return DLUA_OK;
  }
  dlua_status_t s = dlua_tensor_empty(&o->tmp, nd, sizes, ct, device);
  if (s != DLUA_OK) {
    if (o->allocated) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
    return s;
  }
  o->p = dlua_tensor_ptr(o->tmp);
  return DLUA_OK;
}

dlua_status_t dlua_loss_scalar_stage(const dlua_tensor_t *t, dlua_loss_in_t *b) {
  b->tmp = NULL;
  b->n = 1;
  DLUA_TRY(dlua_tensor_to_dtype(&b->tmp, t, DLUA_DTYPE_F64));
  b->p = dlua_tensor_ptr(b->tmp);
  return DLUA_OK;
}

/* Copies a staged result over (when s is OK) and releases the temporary. */
dlua_status_t dlua_loss_out_copy(dlua_loss_out_t *o, dlua_status_t s) {
  if (s == DLUA_OK && o->tmp) s = dlua_tensor_copy_(*o->out, o->tmp);
  dlua_tensor_free(o->tmp);
  o->tmp = NULL;
  return s;
}

/* After a failure: frees an output allocated here, so the caller's *out is NULL again. */
void dlua_loss_out_abort(dlua_loss_out_t *o) {
  if (o->allocated) {
    dlua_tensor_free(*o->out);
    *o->out = NULL;
    o->allocated = 0;
  }
}

dlua_status_t dlua_loss_out_finish(dlua_loss_out_t *o, dlua_status_t s) {
  s = dlua_loss_out_copy(o, s);
  if (s != DLUA_OK) dlua_loss_out_abort(o);
  return s;
}
/* Staging shared by the loss family's front doors (host/ops/loss_stage.c). */
#ifndef DLUA_OPS_LOSS_STAGE_H
#define DLUA_OPS_LOSS_STAGE_H
#include "core/tensor.h"

/* f64 computes in double; f32, f16 and bf16 in float. */
dlua_dtype_t dlua_loss_compute_dtype(dlua_dtype_t d);

/* `t` is live ("<op>: <what> is NULL ..." else), and floating-point when `floating`. Devices are
   checked by the callers (dlua_ops_check_input), backends by the table. */
dlua_status_t dlua_loss_check(const char *op, const char *what, const dlua_tensor_t *t, int floating);
/* "<op>: <wa> A and <wb> B must have the same shape" unless they do. */
dlua_status_t dlua_loss_check_same_shape(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                         const dlua_tensor_t *b);

/* An input as a contiguous buffer of dtype ct: the tensor's own memory when it already is
   one, else a converted copy (tmp). */
typedef struct {
  const void *p;
  int64_t n;
  dlua_tensor_t *tmp;
} dlua_loss_in_t;

dlua_status_t dlua_loss_in_stage(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_loss_in_t *b);
/* A one-value upstream gradient as a private double on its device (b->tmp; the kernel reads it there, and no
   output can overwrite it). */
dlua_status_t dlua_loss_scalar_stage(const dlua_tensor_t *t, dlua_loss_in_t *b);
/* Frees the copies of b[0..n). */
void dlua_loss_in_release(dlua_loss_in_t *b, int n);

/* The result buffer behind the `out` convention: *out itself when it is contiguous of dtype ct
   and meets no input's memory except by being exactly that input (every kernel here reads an
   element before writing it, so exact in-place use is safe); else a temporary copied into
   *out (converting) at the end. */
typedef struct {
  dlua_tensor_t **out;
  dlua_tensor_t *tmp;
  void *p;
  int allocated;
} dlua_loss_out_t;

dlua_status_t dlua_loss_out_stage(const char *op, dlua_tensor_t **out, int nd, const int64_t *sizes, dlua_dtype_t dt,
                                  dlua_dtype_t ct, const dlua_loss_in_t *ins, int nin, int device, dlua_loss_out_t *o);
/* Copies a staged result over (when s is OK) and releases the temporary. */
dlua_status_t dlua_loss_out_copy(dlua_loss_out_t *o, dlua_status_t s);
/* After a failure: frees an output allocated here, so the caller's *out is NULL again. */
void dlua_loss_out_abort(dlua_loss_out_t *o);
/* out_copy, then out_abort if anything failed. */
dlua_status_t dlua_loss_out_finish(dlua_loss_out_t *o, dlua_status_t s);
#endif

/* What every op's front door shares (host/ops/common.c). */
#ifndef DLUA_OPS_COMMON_H
#define DLUA_OPS_COMMON_H
#include "core/tensor.h"

/* The one input check of every op: `t` is a live tensor, on the device of `first` (when given).
   Errors name the op and both tensors. Whether the device's backend runs the op is the backend
   table's answer (ops/backend.h), not this check's. */
dlua_status_t dlua_ops_check_input(const char *op, const dlua_tensor_t *t, const dlua_tensor_t *first);
/* Every live tensor of ts (entries may be NULL) on x's device, by dlua_ops_check_input: the message names x and the
   first that is not. A freed or absent entry is left to the check that names it. */
dlua_status_t dlua_ops_check_peers(const char *op, const dlua_tensor_t *x, const dlua_tensor_t *const *ts, int n);
/* DLUA_ERR_ARG when `t` is an expanded view (a stride-0 dim of size > 1): writing it would write one element many
   times. Names the op and the tensor. */
dlua_status_t dlua_ops_check_writable(const char *op, const dlua_tensor_t *t);

/* Where a kernel that writes contiguous `dtype` elements puts its result: *out itself when
   that is already a contiguous tensor of `dtype` sharing no storage with the inputs, else a
   temporary that dlua_ops_out_finish copies (and casts) into *out. */
typedef struct {
  dlua_tensor_t *dst;  // what the kernel writes
  int allocated;       // *out was NULL and was allocated here
} dlua_ops_out_t;

dlua_status_t dlua_ops_out_begin(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                 dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs,
                                 dlua_ops_out_t *plan);
/* The same for a result on `device` (DLUA_CPU or a CUDA ordinal): *out must live there. */
dlua_status_t dlua_ops_out_begin_on(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                    dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs, int device,
                                    dlua_ops_out_t *plan);
/* Given the kernel's status: on success copies a temporary into *out; on failure releases what
   dlua_ops_out_begin allocated (and resets *out if it was allocated there). */
dlua_status_t dlua_ops_out_finish(dlua_tensor_t **out, dlua_ops_out_t *plan, dlua_status_t status);

/* Checks that `index` is a CPU int32/int64 tensor and returns a contiguous handle on it
   (the same storage when it already is contiguous). */
dlua_status_t dlua_ops_index_contiguous(const char *op, const char *what, const dlua_tensor_t *index,
                                        dlua_tensor_t **contig);
/* The same for an index that must live on `device` (DLUA_CPU or a CUDA ordinal). */
dlua_status_t dlua_ops_index_contiguous_on(const char *op, const char *what, const dlua_tensor_t *index, int device,
                                       dlua_tensor_t **contig);
#endif

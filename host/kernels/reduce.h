/* The reduce family of the backend table (ops/backend.h): what a reduction kernel gets, and the slots a backend
   fills. host/ops/reduce.c fills the descriptor; host/cpu/reduce.c and host/cuda/reduce.cu run it. */
#ifndef DLUA_KERNELS_REDUCE_H
#define DLUA_KERNELS_REDUCE_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One reduction: `kind` (a dlua_reduce_op_t) of x (`dtype`) into O contiguous results.
   y: O values of out_dtype (NULL for argmax/argmin, and when not wanted);
   idx: O int64 positions along the reduced elements + index_base (argmax/argmin always; max/min when wanted;
   else NULL). p: a norm's order, var/std's correction (ignored by the other kinds).
   Slot `reduce`: x is the input itself, strided (ndim, sizes, strides in elements; reduced[d] = 1 for the
   dims folded; a 0-d tensor has ndim 0). Slot `reduce_rows`: x is a contiguous copy of it, kept dims first and
   reduced dims last, i.e. (outer, n) rows with outer = O and n = the reduced count. The front door fills every
   field; ndim/sizes/strides/reduced always describe the input tensor. */
typedef struct {
  int kind;
  int dtype, out_dtype;
  const void *x;
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  int reduced[DLUA_MAX_DIMS];
  int64_t outer, n;
  double p;
  int64_t index_base;
  void *y;
  int64_t *idx;
  int device;
} dlua_reduce_desc_t;

/* A backend fills one of the two (the front door prefers `reduce`; for `reduce_rows` it first makes the
   (outer, n) rows contiguous). Both fold float inputs in double and give a result that depends on the
   shape only (a fixed order of blocks, no atomics). */
struct dlua_reduce_ops {
  dlua_status_t (*reduce)(const char *op, const dlua_reduce_desc_t *r);      /* strided input */
  dlua_status_t (*reduce_rows)(const char *op, const dlua_reduce_desc_t *r); /* contiguous (outer, n) input */
};

extern const struct dlua_reduce_ops dlua_cpu_reduce_ops, dlua_cuda_reduce_ops;

#ifdef __cplusplus
}
#endif
#endif

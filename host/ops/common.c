/* What every op's front door shares: input checks, the `out` convention of kernels that write contiguous
   results, contiguous index handles. The ops of host/ops (and until they move, those of host/cpu) use these
   instead of writing their own. */
#include "ops/common.h"
#include <stdio.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

dlua_status_t dlua_ops_check_input(const char *op, const dlua_tensor_t *t, const dlua_tensor_t *first) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", op);
  if (first && first->storage && t->device != first->device) {
    char b1[200], b2[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got %s and %s", op,
                    dlua_tensor_describe(first, b1, sizeof b1), dlua_tensor_describe(t, b2, sizeof b2));
  }
  return DLUA_OK;
}

dlua_status_t dlua_ops_check_peers(const char *op, const dlua_tensor_t *x, const dlua_tensor_t *const *ts, int n) {
  for (int i = 0; i < n; i++)
    if (ts[i] && ts[i]->storage) DLUA_TRY(dlua_ops_check_input(op, ts[i], x));
  return DLUA_OK;
}

dlua_status_t dlua_ops_check_writable(const char *op, const dlua_tensor_t *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->sizes[d] > 1 && t->strides[d] == 0) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG,
                      "%s: cannot write into %s: it is an expanded view whose elements share memory (clone it first)",
                      op, dlua_tensor_describe(t, b, sizeof b));
    }
  return DLUA_OK;
}


dlua_status_t dlua_ops_out_begin(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                 dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs,
                                 dlua_ops_out_t *plan) {
  return dlua_ops_out_begin_on(op, out, ndim, sizes, dtype, inputs, ninputs, DLUA_CPU, plan);
}

dlua_status_t dlua_ops_out_begin_on(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                    dlua_dtype_t dtype, const dlua_tensor_t *const *inputs, int ninputs, int device,
                                    dlua_ops_out_t *plan) {
  plan->dst = NULL;
  plan->allocated = 0;
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (*out && device == DLUA_CPU) DLUA_TRY(dlua_require_cpu(op, *out));
  DLUA_TRY(dlua_prepare_out_on(op, out, ndim, sizes, dtype, device, &plan->allocated));
  dlua_tensor_t *o = *out;
  int direct = plan->allocated || (o->dtype == dtype && dlua_tensor_is_contiguous(o));
  for (int i = 0; direct && !plan->allocated && i < ninputs; i++)
    if (inputs[i] && dlua_tensor_same_storage(o, inputs[i])) direct = 0;
  if (direct) {
    plan->dst = o;
    return DLUA_OK;
  }
  dlua_status_t s = dlua_tensor_empty(&plan->dst, ndim, sizes, dtype, device);
  if (s != DLUA_OK) plan->dst = NULL;
  return s;
}

dlua_status_t dlua_ops_out_finish(dlua_tensor_t **out, dlua_ops_out_t *plan, dlua_status_t status) {
  if (status == DLUA_OK && plan->dst && plan->dst != *out) status = dlua_tensor_copy_(*out, plan->dst);
  if (plan->dst && plan->dst != *out) dlua_tensor_free(plan->dst);
  plan->dst = NULL;
  if (status != DLUA_OK && plan->allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return status;
}

dlua_status_t dlua_ops_index_contiguous(const char *op, const char *what, const dlua_tensor_t *index,
                                        dlua_tensor_t **contig) {
  return dlua_ops_index_contiguous_on(op, what, index, DLUA_CPU, contig);
}

dlua_status_t dlua_ops_index_contiguous_on(const char *op, const char *what, const dlua_tensor_t *index, int device,
                                       dlua_tensor_t **contig) {
  *contig = NULL;
  if (!index) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL", op, what);
  DLUA_TRY(dlua_require_device(op, index, device));
  if (index->dtype != DLUA_DTYPE_I32 && index->dtype != DLUA_DTYPE_I64) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be int32 or int64, got %s", op, what,
                    dlua_tensor_describe(index, b, sizeof b));
  }
  return dlua_tensor_contiguous(contig, index);
}


/* The front doors of sort and top-k: checks, output shapes and `out`; the kernels behind the sort and topk
   slots of the index family (host/kernels/index.h; host/cpu/sort.c, host/cuda/sort.cu). */
#include "ops/sort.h"
#include <inttypes.h>
#include <string.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/index.h"
#include "ops/backend.h"
#include "ops/common.h"

static dlua_status_t check_dim(const char *op, const dlua_tensor_t *a, int dim) {
  int nd = a->ndim > 0 ? a->ndim : 1;
  if (dim < 0 || dim >= nd) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: dimension %d is out of range for %s (valid: 0..%d)", op, dim,
                    dlua_tensor_describe(a, b, sizeof b), nd - 1);
  }
  return DLUA_OK;
}

/* The descriptor of a's rows along dim; 0-d tensors act as (1). */
static void sort_desc(dlua_sort_t *s, const dlua_tensor_t *a, int dim) {
  memset(s, 0, sizeof *s);
  s->dtype = (int)a->dtype;
  s->a = dlua_tensor_ptr(a);
  s->dim = dim;
  s->device = a->device;
  if (a->ndim == 0) {
    s->lay.ndim = 1;
    s->lay.sizes[0] = 1;
    s->lay.strides[0] = 1;
  } else {
    s->lay.ndim = a->ndim;
    memcpy(s->lay.sizes, a->sizes, sizeof(int64_t) * (size_t)a->ndim);
    memcpy(s->lay.strides, a->strides, sizeof(int64_t) * (size_t)a->ndim);
  }
}

/* Opens the values/indices outputs (either pointer may be NULL: not wanted). */
static dlua_status_t open_outputs(const char *op, dlua_tensor_t **values, dlua_tensor_t **indices,
                                  const dlua_tensor_t *a, int dim, int64_t len, dlua_ops_out_t *pv,
                                  dlua_ops_out_t *pi) {
  int64_t osizes[DLUA_MAX_DIMS];
  memcpy(osizes, a->sizes, sizeof osizes);
  if (a->ndim > 0) osizes[dim] = len;
  const dlua_tensor_t *ins[1] = {a};
  pv->dst = pi->dst = NULL;
  pv->allocated = pi->allocated = 0;
  if (values) DLUA_TRY(dlua_ops_out_begin_on(op, values, a->ndim, osizes, a->dtype, ins, 1, a->device, pv));
  if (indices) {
    dlua_status_t s = dlua_ops_out_begin_on(op, indices, a->ndim, osizes, DLUA_DTYPE_I64, ins, 1, a->device, pi);
    if (s != DLUA_OK) {
      if (values) dlua_ops_out_finish(values, pv, s);
      return s;
    }
  }
  return DLUA_OK;
}

static dlua_status_t close_outputs(dlua_tensor_t **values, dlua_tensor_t **indices, dlua_ops_out_t *pv,
                                   dlua_ops_out_t *pi, dlua_status_t s) {
  dlua_status_t sv = values ? dlua_ops_out_finish(values, pv, s) : s;
  dlua_status_t si = indices ? dlua_ops_out_finish(indices, pi, sv) : sv;
  // A failed index copy after a good value copy: leave neither output half-made.
  if (si != DLUA_OK && sv == DLUA_OK && values && pv->allocated) {
    dlua_tensor_free(*values);
    *values = NULL;
  }
  return si;
}

// a: (..., n, ...) at dim  ->  values: a's dtype, indices: int64; both (..., k, ...)
dlua_status_t dlua_tensor_topk(dlua_tensor_t **values, dlua_tensor_t **indices, const dlua_tensor_t *a, int64_t k,
                               int dim, int largest, int by_magnitude, int sorted, int64_t index_base) {
  const char *op = "topk";
  char b[200];
  if (!a) return DLUA_ERR(DLUA_ERR_ARG, "%s: input is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, a, NULL));
  const struct dlua_index_ops *kt;
  DLUA_TRY(DLUA_BACKEND(op, a->device, index, topk, &kt));
  DLUA_TRY(check_dim(op, a, dim));
  dlua_sort_t s;
  sort_desc(&s, a, dim);
  const int64_t n = s.lay.sizes[dim];
  if (k < 0 || k > n)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: k = %" PRId64 " is out of range for dimension %d of %s (valid: 0..%" PRId64 ")",
                    op, k, dim, dlua_tensor_describe(a, b, sizeof b), n);
  if (!values && !indices) return DLUA_OK;
  dlua_ops_out_t pv, pi;
  DLUA_TRY(open_outputs(op, values, indices, a, dim, k, &pv, &pi));
  s.len = k;
  s.descending_or_largest = largest;
  s.by_magnitude = by_magnitude;
  s.sorted = sorted;
  s.values = pv.dst ? dlua_tensor_ptr(pv.dst) : NULL;
  s.indices = pi.dst ? (int64_t *)dlua_tensor_ptr(pi.dst) : NULL;
  s.index_base = index_base;
  return close_outputs(values, indices, &pv, &pi, kt->topk(op, &s));
}

// a: (..., n, ...) at dim  ->  values: a's dtype, indices: int64; both a's shape
dlua_status_t dlua_tensor_sort(dlua_tensor_t **values, dlua_tensor_t **indices, const dlua_tensor_t *a, int dim,
                               int descending, int64_t index_base) {
  const char *op = "sort";
  if (!a) return DLUA_ERR(DLUA_ERR_ARG, "%s: input is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, a, NULL));
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, a->device, index, sort, &k));
  DLUA_TRY(check_dim(op, a, dim));
  dlua_sort_t s;
  sort_desc(&s, a, dim);
  if (!values && !indices) return DLUA_OK;
  dlua_ops_out_t pv, pi;
  DLUA_TRY(open_outputs(op, values, indices, a, dim, s.lay.sizes[dim], &pv, &pi));
  s.len = s.lay.sizes[dim];
  s.descending_or_largest = descending;
  s.sorted = 1;
  s.values = pv.dst ? dlua_tensor_ptr(pv.dst) : NULL;
  s.indices = pi.dst ? (int64_t *)dlua_tensor_ptr(pi.dst) : NULL;
  s.index_base = index_base;
  return close_outputs(values, indices, &pv, &pi, k->sort(op, &s));
}

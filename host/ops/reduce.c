/* The front door of the reductions (dlua_tensor_reduce: sum, mean, prod, max/min, arg*, norm, var/std, any/all,
   non-finite count over any set of dims): checks, the result's shape and dtype, `out`, then the reduce family of
   the tensor's backend table (host/kernels/reduce.h; host/cpu/reduce.c, host/cuda/reduce.cu). */
#include "ops/reduce.h"
#include <math.h>
#include <string.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/reduce.h"
#include "ops/backend.h"
#include "ops/common.h"

static const char *const red_names[DLUA_REDUCE_COUNT] = {
    "sum", "mean", "prod", "max", "min", "argmax", "argmin", "norm", "var", "std", "any", "all", "count_nonfinite"};

/* Runs r through the backend: its strided kernel when it has one, else its kernel of contiguous (outer, n) rows
   on a copy of a with the kept dims first and the reduced dims last (the copy kernel; a no-op when already so). */
static dlua_status_t run_backend(const char *name, const struct dlua_reduce_ops *k, dlua_reduce_desc_t *r,
                                 const dlua_tensor_t *a) {
  if (k->reduce) return k->reduce(name, r);
  dlua_tensor_t v = *a;  // a view header on the stack: same storage, permuted dims
  int j = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int d = 0; d < a->ndim; d++) {
      if (r->reduced[d] != pass) continue;
      v.sizes[j] = a->sizes[d];
      v.strides[j] = a->strides[d];
      j++;
    }
  dlua_tensor_t *c = NULL;
  DLUA_TRY(dlua_tensor_contiguous(&c, &v));
  r->x = dlua_tensor_ptr(c);
  dlua_status_t s = k->reduce_rows(name, r);
  dlua_tensor_free(c);
  return s;
}

dlua_status_t dlua_tensor_reduce(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *a,
                                 dlua_reduce_op_t op, int ndims, const int *dims, int keepdim, double p,
                                 int64_t index_base) {
  if ((int)op < 0 || op >= DLUA_REDUCE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "reduce: unknown op %d", (int)op);
  const char *name = red_names[op];
  DLUA_TRY(dlua_ops_check_input(name, a, NULL));
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", name);
  const dlua_backend_t *be;
  DLUA_TRY(dlua_backend_for(name, a->device, &be));
  const struct dlua_reduce_ops *k = be->reduce;
  if (!k || (!k->reduce && !k->reduce_rows)) return dlua_backend_unsupported(name, be);
  char desc[200];
  const dlua_dtype_t dt = a->dtype;
  const int fl = dlua_dtype_is_floating(dt);
  int needs_float = op == DLUA_REDUCE_MEAN || op == DLUA_REDUCE_NORM || op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD;
  if (needs_float && !fl)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a floating-point tensor, got %s (convert it first)", name,
                    dlua_tensor_describe(a, desc, sizeof desc));
  if (op == DLUA_REDUCE_NORM && !(p >= 0))
    return DLUA_ERR(DLUA_ERR_ARG, "norm: p must be >= 0 (or inf), got %g", p);
  if ((op == DLUA_REDUCE_VAR || op == DLUA_REDUCE_STD) && !isfinite(p))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: correction must be finite, got %g", name, p);

  // Which dims are reduced; a 0-d tensor accepts dim 0 as PyTorch does.
  dlua_reduce_desc_t r;
  memset(&r, 0, sizeof r);
  int *reduced = r.reduced;
  if (ndims < 0 || ndims > DLUA_MAX_DIMS || (ndims > 0 && !dims))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid list of %d dims", name, ndims);
  for (int i = 0; i < ndims; i++) {
    int d = dims[i];
    if (a->ndim == 0 && d == 0) continue;
    if (d < 0 || d >= a->ndim)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: dim %d out of range for %s (0-based, expected 0..%d)", name, d,
                      dlua_tensor_describe(a, desc, sizeof desc), a->ndim - 1);
    if (reduced[d])
      return DLUA_ERR(DLUA_ERR_ARG, "%s: dim %d appears twice in the list of dims", name, d);
    reduced[d] = 1;
  }
  if (ndims == 0)
    for (int d = 0; d < a->ndim; d++) reduced[d] = 1;

  int nd = 0;
  int64_t shape[DLUA_MAX_DIMS];
  int64_t O = 1, R = 1;
  for (int d = 0; d < a->ndim; d++) {
    if (!reduced[d]) shape[nd++] = a->sizes[d];
    else if (keepdim) shape[nd++] = 1;
    if (reduced[d]) R *= a->sizes[d];
    else O *= a->sizes[d];
  }

  // Result dtype, PyTorch's: integer sums and products widen to int64.
  dlua_dtype_t rdt = dt;
  switch (op) {
    case DLUA_REDUCE_SUM:
    case DLUA_REDUCE_PROD: rdt = fl ? dt : DLUA_DTYPE_I64; break;
    case DLUA_REDUCE_ARGMAX:
    case DLUA_REDUCE_ARGMIN:
    case DLUA_REDUCE_COUNT_NONFINITE: rdt = DLUA_DTYPE_I64; break;
    case DLUA_REDUCE_ANY:
    case DLUA_REDUCE_ALL: rdt = DLUA_DTYPE_BOOL; break;
    default: break;
  }

  const int is_arg = op == DLUA_REDUCE_ARGMAX || op == DLUA_REDUCE_ARGMIN;
  const int is_index = is_arg || op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN;
  int no_identity = is_index || (op == DLUA_REDUCE_NORM && isinf(p));
  if (no_identity && R == 0 && O > 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot reduce %s over dims with no elements (the op has no identity)", name,
                    dlua_tensor_describe(a, desc, sizeof desc));

  // The outputs: values (or, for arg*, the indices) into *out; max/min's indices into *indices when asked.
  const int with_idx = !is_arg && indices && (op == DLUA_REDUCE_MAX || op == DLUA_REDUCE_MIN);
  const dlua_tensor_t *ins[1] = {a};
  dlua_ops_out_t pv = {0}, pi = {0};
  DLUA_TRY(dlua_ops_out_begin_on(name, out, nd, shape, is_arg ? DLUA_DTYPE_I64 : rdt, ins, 1, a->device, &pv));
  if (with_idx) {
    dlua_status_t s = dlua_ops_out_begin_on(name, indices, nd, shape, DLUA_DTYPE_I64, ins, 1, a->device, &pi);
    if (s != DLUA_OK) return dlua_ops_out_finish(out, &pv, s);
  }

  r.kind = (int)op;
  r.dtype = (int)dt;
  r.out_dtype = (int)rdt;
  r.x = dlua_tensor_ptr(a);
  r.ndim = a->ndim;
  memcpy(r.sizes, a->sizes, sizeof(int64_t) * (size_t)a->ndim);
  memcpy(r.strides, a->strides, sizeof(int64_t) * (size_t)a->ndim);
  r.outer = O;
  r.n = R;
  r.p = p;
  r.index_base = index_base;
  r.y = is_arg ? NULL : dlua_tensor_ptr(pv.dst);
  r.idx = is_arg ? (int64_t *)dlua_tensor_ptr(pv.dst) : with_idx ? (int64_t *)dlua_tensor_ptr(pi.dst) : NULL;
  r.device = a->device;
  dlua_status_t s = run_backend(name, k, &r, a);
  if (with_idx) s = dlua_ops_out_finish(indices, &pi, s);  // failed: no half-made values either
  return dlua_ops_out_finish(out, &pv, s);
}

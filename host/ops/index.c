/* The front doors of the indexing ops: index_select, gather, scatter_add_, cat, stack, one_hot, and the index
   range check they share (with host/data/augment.c). Checks, shapes and `out` here; the kernels behind the
   index family of the tensor's backend table (host/kernels/index.h). */
#include "ops/index.h"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/index.h"
#include "ops/backend.h"
#include "ops/common.h"

dlua_status_t dlua_ops_check_indices(const char *op, const dlua_tensor_t *index, int64_t size, int64_t base,
                                     const char *what) {
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, index->device, index, first_bad, &k));
  dlua_index_check_t c = {dlua_tensor_ptr(index), index->dtype == DLUA_DTYPE_I64, dlua_tensor_numel(index), size,
                          base, index->device};
  int64_t first = -1, v = 0;
  DLUA_TRY(k->first_bad(op, &c, &first, &v));
  if (first < 0) return DLUA_OK;
  if (size == 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: index %" PRId64 " is out of range: %s has size 0", op, v, what);
  return DLUA_ERR(DLUA_ERR_ARG, "%s: index %" PRId64 " is out of range for %s of size %" PRId64
                  " (valid: %" PRId64 "..%" PRId64 ")", op, v, what, size, base, base + size - 1);
}

/* ---- local helpers ------------------------------------------------------------------------ */

static dlua_status_t check_dim(const char *op, const dlua_tensor_t *t, int dim, int ndim_limit) {
  if (dim < 0 || dim >= ndim_limit) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: dimension %d is out of range for %s (valid: 0..%d)", op, dim,
                    dlua_tensor_describe(t, b, sizeof b), ndim_limit - 1);
  }
  return DLUA_OK;
}

/* A local, unowned view of t (no reference taken): valid while t lives. */
static struct dlua_tensor local_view(const dlua_tensor_t *t) { return *t; }

/* The layout kernels address: ndim dims of (sizes, strides). */
static dlua_index_layout_t index_layout(int ndim, const int64_t *sizes, const int64_t *strides) {
  dlua_index_layout_t l;
  memset(&l, 0, sizeof l);
  l.ndim = ndim;
  memcpy(l.sizes, sizes, sizeof(int64_t) * (size_t)ndim);
  memcpy(l.strides, strides, sizeof(int64_t) * (size_t)ndim);
  return l;
}

/* ---- index_select ------------------------------------------------------------------------- */

// a: (..., D, ...) at dim; index: (n) or scalar  ->  out: (..., n, ...)
dlua_status_t dlua_tensor_index_select(dlua_tensor_t **out, const dlua_tensor_t *a, int dim,
                                       const dlua_tensor_t *index, int64_t index_base) {
  const char *op = "index_select";
  if (!a) return DLUA_ERR(DLUA_ERR_ARG, "%s: input is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, a, NULL));
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, a->device, index, index_select, &k));
  int nd = a->ndim;
  DLUA_TRY(check_dim(op, a, dim, nd > 0 ? nd : 1));
  DLUA_TRY(dlua_same_device(op, a, index));
  dlua_tensor_t *idx = NULL;
  DLUA_TRY(dlua_ops_index_contiguous_on(op, "index", index, a->device, &idx));
  char b1[200], b2[200];
  if (idx->ndim > 1) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG, "%s: index must be 1-D, got %s", op,
                               dlua_tensor_describe(index, b1, sizeof b1));
    dlua_tensor_free(idx);
    return s;
  }
  int64_t n = dlua_tensor_numel(idx);
  // A 0-d input acts as (1): it selects its only element.
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  int snd = nd > 0 ? nd : 1;
  if (nd == 0) {
    sizes[0] = 1;
    strides[0] = 1;
  } else {
    memcpy(sizes, a->sizes, sizeof(int64_t) * (size_t)nd);
    memcpy(strides, a->strides, sizeof(int64_t) * (size_t)nd);
  }
  if (nd == 0 && n != 1) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG, "%s: a 0-d input takes exactly one index, got %s", op,
                               dlua_tensor_describe(index, b2, sizeof b2));
    dlua_tensor_free(idx);
    return s;
  }
  snprintf(b1, sizeof b1, "dimension %" PRId64, (int64_t)dim + index_base);
  dlua_status_t s = dlua_ops_check_indices(op, idx, sizes[dim], index_base, b1);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  int64_t osizes[DLUA_MAX_DIMS];
  memcpy(osizes, sizes, sizeof osizes);
  osizes[dim] = n;
  dlua_ops_out_t plan;
  const dlua_tensor_t *ins[2] = {a, index};
  s = dlua_ops_out_begin_on(op, out, nd, osizes, a->dtype, ins, 2, a->device, &plan);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  sizes[dim] = n;  // the output's sizes over a's strides; the index supplies coordinate `dim`
  dlua_index_gather_t g = {(int)dlua_dtype_size(a->dtype), dlua_tensor_ptr(plan.dst), dlua_tensor_ptr(a),
                           index_layout(snd, sizes, strides), dim, dlua_tensor_ptr(idx),
                           idx->dtype == DLUA_DTYPE_I64, index_base, a->device};
  s = k->index_select(op, &g);
  dlua_tensor_free(idx);
  return dlua_ops_out_finish(out, &plan, s);
}

/* ---- gather ------------------------------------------------------------------------------- */

/* Index and input of a gather/scatter seen with at least one dim (0-d tensors act as (1)). */
static void as_1d_if_scalar(struct dlua_tensor *v) {
  if (v->ndim == 0) {
    v->ndim = 1;
    v->sizes[0] = 1;
    v->strides[0] = 1;
  }
}

// a: (d0, ..., dk) ; index: same ndim, index.size(d) <= a.size(d) for d != dim  ->  out: index's shape
dlua_status_t dlua_tensor_gather(dlua_tensor_t **out, const dlua_tensor_t *a, int dim, const dlua_tensor_t *index,
                                 int64_t index_base) {
  const char *op = "gather";
  if (!a) return DLUA_ERR(DLUA_ERR_ARG, "%s: input is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, a, NULL));
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, a->device, index, gather, &k));
  DLUA_TRY(check_dim(op, a, dim, a->ndim > 0 ? a->ndim : 1));
  char b1[200], b2[200];
  if (!index) return DLUA_ERR(DLUA_ERR_ARG, "%s: index is NULL", op);
  if (index->ndim != a->ndim && !(index->ndim <= 1 && a->ndim <= 1))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: index %s and input %s must have the same number of dimensions", op,
                    dlua_tensor_describe(index, b1, sizeof b1), dlua_tensor_describe(a, b2, sizeof b2));
  struct dlua_tensor av = local_view(a);
  as_1d_if_scalar(&av);
  for (int d = 0; d < index->ndim; d++)
    if (d != dim && index->sizes[d] > av.sizes[d])
      return DLUA_ERR(DLUA_ERR_ARG, "%s: index %s is larger than input %s at dimension %d", op,
                      dlua_tensor_describe(index, b1, sizeof b1), dlua_tensor_describe(a, b2, sizeof b2), d);
  DLUA_TRY(dlua_same_device(op, a, index));
  dlua_tensor_t *idx = NULL;
  DLUA_TRY(dlua_ops_index_contiguous_on(op, "index", index, a->device, &idx));
  snprintf(b1, sizeof b1, "dimension %" PRId64, (int64_t)dim + index_base);
  dlua_status_t s = dlua_ops_check_indices(op, idx, av.sizes[dim], index_base, b1);
  dlua_ops_out_t plan = {0};
  const dlua_tensor_t *ins[2] = {a, index};
  if (s == DLUA_OK) s = dlua_ops_out_begin_on(op, out, index->ndim, index->sizes, a->dtype, ins, 2, a->device, &plan);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  struct dlua_tensor iv = local_view(idx);
  as_1d_if_scalar(&iv);
  // index's sizes over a's strides; the index supplies coordinate `dim`
  dlua_index_gather_t g = {(int)dlua_dtype_size(a->dtype), dlua_tensor_ptr(plan.dst), dlua_tensor_ptr(a),
                           index_layout(iv.ndim, iv.sizes, av.strides), dim, dlua_tensor_ptr(idx),
                           idx->dtype == DLUA_DTYPE_I64, index_base, a->device};
  s = k->gather(op, &g);
  dlua_tensor_free(idx);
  return dlua_ops_out_finish(out, &plan, s);
}

/* ---- scatter_add_ ------------------------------------------------------------------------- */

// t: (d0, ..., dk) ; index: same ndim ; src: same ndim, src.size(d) >= index.size(d) everywhere
dlua_status_t dlua_tensor_scatter_add_(dlua_tensor_t *t, int dim, const dlua_tensor_t *index,
                                       const dlua_tensor_t *src, int64_t index_base) {
  const char *op = "scatter_add_";
  char b1[200], b2[200], b3[200];
  if (!t || !index || !src) return DLUA_ERR(DLUA_ERR_ARG, "%s: a tensor argument is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, t, NULL));
  DLUA_TRY(dlua_ops_check_input(op, src, NULL));
  DLUA_TRY(dlua_same_device(op, t, src));
  DLUA_TRY(dlua_same_device(op, t, index));
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, t->device, index, scatter_add, &k));
  DLUA_TRY(check_dim(op, t, dim, t->ndim > 0 ? t->ndim : 1));
  if (t->dtype == DLUA_DTYPE_BOOL)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot add into %s", op, dlua_tensor_describe(t, b1, sizeof b1));
  int nd = t->ndim > 0 ? t->ndim : 1;
  if (!((index->ndim == t->ndim && src->ndim == t->ndim) || (t->ndim <= 1 && index->ndim <= 1 && src->ndim <= 1)))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: self %s, index %s and src %s must have the same number of dimensions", op,
                    dlua_tensor_describe(t, b1, sizeof b1), dlua_tensor_describe(index, b2, sizeof b2),
                    dlua_tensor_describe(src, b3, sizeof b3));
  struct dlua_tensor tv = local_view(t), sv0 = local_view(src), iv0 = local_view(index);
  as_1d_if_scalar(&tv);
  as_1d_if_scalar(&sv0);
  as_1d_if_scalar(&iv0);
  for (int d = 0; d < nd; d++)
    if (iv0.sizes[d] > sv0.sizes[d] || (d != dim && iv0.sizes[d] > tv.sizes[d]))
      return DLUA_ERR(DLUA_ERR_ARG, "%s: index %s is larger than src %s or self %s at dimension %d", op,
                      dlua_tensor_describe(index, b1, sizeof b1), dlua_tensor_describe(src, b2, sizeof b2),
                      dlua_tensor_describe(t, b3, sizeof b3), d);
  dlua_tensor_t *idx = NULL, *stmp = NULL;
  DLUA_TRY(dlua_ops_index_contiguous_on(op, "index", index, t->device, &idx));
  snprintf(b1, sizeof b1, "dimension %" PRId64, (int64_t)dim + index_base);
  dlua_status_t s = dlua_ops_check_indices(op, idx, tv.sizes[dim], index_base, b1);
  // src in t's dtype, and never aliasing t (the adds would read what they wrote).
  if (s == DLUA_OK && (src->dtype != t->dtype || dlua_tensor_same_storage(src, t)))
    s = dlua_tensor_to_dtype(&stmp, src, t->dtype);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  struct dlua_tensor sv = stmp ? local_view(stmp) : sv0;
  as_1d_if_scalar(&sv);
  dlua_index_scatter_t sc;
  memset(&sc, 0, sizeof sc);
  sc.dtype = (int)t->dtype;
  sc.t = dlua_tensor_ptr(&tv);
  memcpy(sc.t_strides, tv.strides, sizeof(int64_t) * (size_t)nd);
  sc.t_dim_size = tv.sizes[dim];
  sc.src = dlua_tensor_ptr(&sv);
  memcpy(sc.s_strides, sv.strides, sizeof(int64_t) * (size_t)nd);
  sc.ndim = nd;
  memcpy(sc.idx_sizes, iv0.sizes, sizeof(int64_t) * (size_t)nd);
  sc.dim = dim;
  sc.index = dlua_tensor_ptr(idx);
  sc.is64 = idx->dtype == DLUA_DTYPE_I64;
  sc.base = index_base;
  sc.device = t->device;
  s = k->scatter_add(op, &sc);
  dlua_tensor_free(idx);
  dlua_tensor_free(stmp);
  return s;
}

/* ---- cat and stack ------------------------------------------------------------------------ */

/* PyTorch's legacy rule: a 1-D tensor with no elements is skipped by cat whatever its shape. */
static int cat_skipped(const dlua_tensor_t *t) { return t->ndim == 1 && t->sizes[0] == 0; }

// ts[i]: (..., n_i, ...) at dim  ->  out: (..., sum n_i, ...)
dlua_status_t dlua_tensor_cat(dlua_tensor_t **out, int n, dlua_tensor_t *const *ts, int dim) {
  const char *op = "cat";
  char b1[200], b2[200];
  if (n < 1 || !ts) return DLUA_ERR(DLUA_ERR_ARG, "%s: expected at least one tensor, got %d", op, n);
  const dlua_tensor_t *ref = NULL;
  dlua_dtype_t dtype = DLUA_DTYPE_BOOL;
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return DLUA_ERR(DLUA_ERR_ARG, "%s: tensor %d of %d is NULL", op, i + 1, n);
    DLUA_TRY(dlua_ops_check_input(op, ts[i], NULL));
    DLUA_TRY(dlua_same_device(op, ts[0], ts[i]));
    dtype = i == 0 ? ts[i]->dtype : dlua_dtype_promote(dtype, ts[i]->dtype);
    if (!ref && !cat_skipped(ts[i])) ref = ts[i];
  }
  if (!ref) ref = ts[0];
  const struct dlua_index_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, ref->device, index, copy_rows, &k));
  if (ref->ndim == 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot concatenate 0-d tensor %s", op, dlua_tensor_describe(ref, b1, sizeof b1));
  DLUA_TRY(check_dim(op, ref, dim, ref->ndim));
  int nd = ref->ndim;
  int64_t osizes[DLUA_MAX_DIMS];
  memcpy(osizes, ref->sizes, sizeof osizes);
  osizes[dim] = 0;
  for (int i = 0; i < n; i++) {
    const dlua_tensor_t *t = ts[i];
    if (cat_skipped(t) && t != ref) continue;
    int ok = t->ndim == nd;
    for (int d = 0; ok && d < nd; d++) ok = d == dim || t->sizes[d] == ref->sizes[d];
    if (!ok)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: tensor %d %s does not match tensor %s except at dimension %d from the end", op,
                      i + 1, dlua_tensor_describe(t, b1, sizeof b1), dlua_tensor_describe(ref, b2, sizeof b2), dim - nd);
    osizes[dim] += t->sizes[dim];
  }
  dlua_ops_out_t plan;
  DLUA_TRY(dlua_ops_out_begin_on(op, out, nd, osizes, dtype, (const dlua_tensor_t *const *)ts, n, ref->device, &plan));
  dlua_tensor_t *dst = plan.dst;
  size_t es = dlua_dtype_size(dtype);
  int64_t outer = dlua_shape_numel(dim, osizes), inner = dlua_shape_numel(nd - dim - 1, osizes + dim + 1);
  int64_t total = osizes[dim];
  dlua_status_t s = DLUA_OK;
  // Inputs already contiguous in the output dtype are moved by the backend's row copy, one row per part;
  // the others go through copy_ (strides, dtype conversion) into a narrowed view of dst.
  int64_t at = 0;
  for (int i = 0; i < n && s == DLUA_OK; i++) {
    const dlua_tensor_t *t = ts[i];
    if (cat_skipped(t) && t != ref) continue;
    int64_t len = t->sizes[dim];
    if (len > 0 && outer > 0 && inner > 0) {
      if (t->dtype == dtype && dlua_tensor_is_contiguous(t)) {
        dlua_index_rows_t r = {(int)es, (char *)dlua_tensor_ptr(dst) + (size_t)(at * inner) * es, dlua_tensor_ptr(t),
                               outer, len * inner, total * inner, dst->device};
        s = k->copy_rows(op, &r);
      } else {
        struct dlua_tensor v = local_view(dst);
        v.offset += at * v.strides[dim];
        v.sizes[dim] = len;
        s = dlua_tensor_copy_(&v, t);
      }
    }
    at += len;
  }
  return dlua_ops_out_finish(out, &plan, s);
}

// ts[i]: all the same shape S  ->  out: S with n inserted at dim
dlua_status_t dlua_tensor_stack(dlua_tensor_t **out, int n, dlua_tensor_t *const *ts, int dim) {
  const char *op = "stack";
  char b1[200], b2[200];
  if (n < 1 || !ts) return DLUA_ERR(DLUA_ERR_ARG, "%s: expected at least one tensor, got %d", op, n);
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return DLUA_ERR(DLUA_ERR_ARG, "%s: tensor %d of %d is NULL", op, i + 1, n);
    DLUA_TRY(dlua_ops_check_input(op, ts[i], NULL));
    DLUA_TRY(dlua_same_device(op, ts[0], ts[i]));
  }
  const dlua_tensor_t *ref = ts[0];
  if (ref->ndim >= DLUA_MAX_DIMS)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: stacking %s would exceed %d dimensions", op,
                    dlua_tensor_describe(ref, b1, sizeof b1), DLUA_MAX_DIMS);
  DLUA_TRY(check_dim(op, ref, dim, ref->ndim + 1));
  for (int i = 1; i < n; i++) {
    int ok = ts[i]->ndim == ref->ndim;
    for (int d = 0; ok && d < ref->ndim; d++) ok = ts[i]->sizes[d] == ref->sizes[d];
    if (!ok)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: tensor %d %s does not have the shape of tensor 1 %s", op, i + 1,
                      dlua_tensor_describe(ts[i], b1, sizeof b1), dlua_tensor_describe(ref, b2, sizeof b2));
  }
  // Each input seen with a size-1 dim inserted at `dim`, as unowned local views; then cat.
  struct dlua_tensor *views = malloc(sizeof *views * (size_t)n);
  dlua_tensor_t **ptrs = malloc(sizeof *ptrs * (size_t)n);
  if (!views || !ptrs) {
    free(views);
    free(ptrs);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes for %d views", op,
                    (sizeof *views + sizeof *ptrs) * (size_t)n, n);
  }
  for (int i = 0; i < n; i++) {
    struct dlua_tensor v = local_view(ts[i]);
    for (int d = v.ndim; d > dim; d--) {
      v.sizes[d] = v.sizes[d - 1];
      v.strides[d] = v.strides[d - 1];
    }
    v.sizes[dim] = 1;
    v.strides[dim] = dim < v.ndim ? v.strides[dim + 1] * v.sizes[dim + 1] : 1;
    v.ndim++;
    views[i] = v;
    ptrs[i] = &views[i];
  }
  dlua_status_t s = dlua_tensor_cat(out, n, ptrs, dim);
  free(views);
  free(ptrs);
  return s;
}

/* ---- one_hot ------------------------------------------------------------------------------ */

// labels: (...) integers from index_base  ->  out: (..., num_classes) of dtype
dlua_status_t dlua_tensor_one_hot(dlua_tensor_t **out, const dlua_tensor_t *labels, int64_t num_classes,
                                  int64_t index_base, dlua_dtype_t dtype) {
  const char *op = "one_hot";
  char b1[200];
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid dtype %d", op, (int)dtype);
  dlua_tensor_t *lab = NULL;
  const int device = labels && labels->storage ? labels->device : DLUA_CPU;
  DLUA_TRY(dlua_ops_index_contiguous_on(op, "labels", labels, device, &lab));
  const struct dlua_index_ops *k;
  dlua_status_t s = DLUA_BACKEND(op, device, index, one_hot, &k);
  if (s == DLUA_OK && lab->ndim >= DLUA_MAX_DIMS)
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: labels %s already have %d dimensions", op,
                 dlua_tensor_describe(labels, b1, sizeof b1), DLUA_MAX_DIMS);
  if (s != DLUA_OK) {
    dlua_tensor_free(lab);
    return s;
  }
  int64_t n = dlua_tensor_numel(lab);
  int is64 = lab->dtype == DLUA_DTYPE_I64;
  if (num_classes < 0) {  // as F.one_hot(num_classes=-1): one more than the largest label
    if (n == 0) {
      dlua_tensor_free(lab);
      return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot infer the number of classes from empty labels %s", op,
                      dlua_tensor_describe(labels, b1, sizeof b1));
    }
    // The largest label, reduced on the labels' device and copied back.
    dlua_tensor_t *m = NULL;
    union { int32_t i32; int64_t i64; } got = {0};
    s = dlua_tensor_reduce(&m, NULL, lab, DLUA_REDUCE_MAX, 0, NULL, 0, 0.0, 0);
    if (s == DLUA_OK) s = dlua_tensor_to_data(m, &got, is64 ? sizeof got.i64 : sizeof got.i32);
    dlua_tensor_free(m);
    if (s != DLUA_OK) {
      dlua_tensor_free(lab);
      return s;
    }
    int64_t mx = is64 ? got.i64 : got.i32;
    num_classes = mx >= index_base ? mx - index_base + 1 : 0;
  }
  s = dlua_ops_check_indices(op, lab, num_classes, index_base, "the classes");
  int64_t osizes[DLUA_MAX_DIMS];
  memcpy(osizes, lab->sizes, sizeof(int64_t) * (size_t)lab->ndim);
  osizes[lab->ndim] = num_classes;
  dlua_ops_out_t plan = {0};
  const dlua_tensor_t *ins[1] = {labels};
  if (s == DLUA_OK) s = dlua_ops_out_begin_on(op, out, lab->ndim + 1, osizes, dtype, ins, 1, device, &plan);
  if (s != DLUA_OK) {
    dlua_tensor_free(lab);
    return s;
  }
  size_t es = dlua_dtype_size(dtype);
  char one[8];
  switch (dtype) {
    case DLUA_DTYPE_F32: { float v = 1.0f; memcpy(one, &v, 4); break; }
    case DLUA_DTYPE_F64: { double v = 1.0; memcpy(one, &v, 8); break; }
    case DLUA_DTYPE_F16: { uint16_t v = 0x3c00; memcpy(one, &v, 2); break; }
    case DLUA_DTYPE_BF16: { uint16_t v = 0x3f80; memcpy(one, &v, 2); break; }
    case DLUA_DTYPE_I32: { int32_t v = 1; memcpy(one, &v, 4); break; }
    case DLUA_DTYPE_I64: { int64_t v = 1; memcpy(one, &v, 8); break; }
    default: one[0] = 1; break;
  }
  uint64_t bits = 0;
  memcpy(&bits, one, es);
  dlua_index_one_hot_t h = {(int)es, bits, dlua_tensor_ptr(plan.dst), dlua_tensor_ptr(lab), is64, n, num_classes,
                            index_base, device};
  s = k->one_hot(op, &h);
  dlua_tensor_free(lab);
  return dlua_ops_out_finish(out, &plan, s);
}

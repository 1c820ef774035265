/* The front doors of copies between tensors of any layout and dtype (copy_, to_dtype), conversion to and from raw
   memory (from_data, to_data), fills and ranges (fill_, arange, linspace, eye): checks, broadcasting, overlap, the
   merged two-operand layout, then one call through the ew family of the tensor's backend table (kernels/ew.h:
   the copy and download slots; host/cpu/copy.c, host/cuda/elementwise.cu). */
#include "ops/copy.h"
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/ew.h"
#include "ops/backend.h"
#include "ops/common.h"

enum { ITER_CHUNK = 1 << 16 };  // elements per parallel work item of the sequence fills

/* e's layout for dst <- src (src already broadcast to dst's shape, src_strides in src elements; src_dtype's
   element size): byte steps, size-1 dims dropped and mergeable dims merged so the inner loop is as long as the
   layouts allow. */
static void copy_layout(dlua_ew_desc_t *e, const dlua_tensor_t *dst, dlua_dtype_t src_dtype, const int64_t *src_strides) {
  int64_t dstep[DLUA_MAX_DIMS], sstep[DLUA_MAX_DIMS];
  int64_t des = (int64_t)dlua_dtype_size(dst->dtype), ses = (int64_t)dlua_dtype_size(src_dtype);
  int64_t sizes[DLUA_MAX_DIMS];
  for (int d = 0; d < dst->ndim; d++) {
    sizes[d] = dst->sizes[d];
    dstep[d] = dst->strides[d] * des;
    sstep[d] = src_strides[d] * ses;
  }
  // When src and dst order their dims alike by stride (channels-last to channels-last, a cast
  // under autocast), walk the dims in that order: they then merge into one run instead of an inner
  // loop of W elements C apart. Any order visits every element once; only the speed differs.
  int alike = 1;
  for (int d = 0; d + 1 < dst->ndim && alike; d++)
    for (int k = d + 1; k < dst->ndim; k++)
      if (sizes[d] > 1 && sizes[k] > 1 && (dstep[d] < dstep[k]) != (sstep[d] < sstep[k])) alike = 0;
  if (alike)
    for (int d = 1; d < dst->ndim; d++)  // insertion sort, largest dst step first
      for (int k = d; k > 0 && dstep[k - 1] < dstep[k]; k--) {
        int64_t t0 = sizes[k], t1 = dstep[k], t2 = sstep[k];
        sizes[k] = sizes[k - 1], dstep[k] = dstep[k - 1], sstep[k] = sstep[k - 1];
        sizes[k - 1] = t0, dstep[k - 1] = t1, sstep[k - 1] = t2;
      }
  int n = 0;
  for (int d = 0; d < dst->ndim; d++) {
    if (sizes[d] == 1) continue;
    if (n > 0 && e->strides[0][n - 1] == dstep[d] * sizes[d] && e->strides[1][n - 1] == sstep[d] * sizes[d]) {
      e->sizes[n - 1] *= sizes[d];
      e->strides[0][n - 1] = dstep[d];
      e->strides[1][n - 1] = sstep[d];
      continue;
    }
    e->sizes[n] = sizes[d];
    e->strides[0][n] = dstep[d];
    e->strides[1][n] = sstep[d];
    n++;
  }
  if (n == 0) {
    e->sizes[0] = 1;
    e->strides[0][0] = 0;
    e->strides[1][0] = 0;
    n = 1;
  }
  e->ndim = n;
  e->numel = dlua_tensor_numel(dst);
  e->dtype = (int)dst->dtype;
  e->src_dtype = (int)src_dtype;
  e->elsize = (int)des;
  e->inner[0] = e->strides[0][n - 1] / des;
  e->inner[1] = e->strides[1][n - 1] / ses;
  e->base[0] = dlua_tensor_ptr(dst);
  e->device = dst->device;
}

/* Byte span [lo, hi) that t's elements occupy inside its storage. */
static void byte_span(const dlua_tensor_t *t, uintptr_t *lo, uintptr_t *hi) {
  size_t es = dlua_dtype_size(t->dtype);
  uintptr_t base = (uintptr_t)dlua_tensor_ptr(t);
  uintptr_t last = base;
  for (int d = 0; d < t->ndim; d++)
    if (t->sizes[d] > 0) last += (uintptr_t)((t->sizes[d] - 1) * t->strides[d]) * es;
  *lo = base;
  *hi = last + es;
}


/* copy_ between devices: src moves to dst's device first (dense, its layout kept), then the one-device
   copy applies broadcasting and dtype conversion there. */
static dlua_status_t copy_across(dlua_tensor_t *dst, const dlua_tensor_t *src) {
  dlua_tensor_t *moved = NULL;
  DLUA_TRY(dlua_tensor_to_device(&moved, src, dst->device));
  dlua_status_t s = dlua_tensor_copy_(dst, moved);
  dlua_tensor_free(moved);
  return s;
}

dlua_status_t dlua_tensor_copy_(dlua_tensor_t *dst, const dlua_tensor_t *src) {
  if (!dst || !dst->storage || !src || !src->storage)
    return DLUA_ERR(DLUA_ERR_ARG, "copy_: the tensor is NULL (freed, or never created)");
  if (dst->device != src->device) return copy_across(dst, src);
  char b1[200], b2[200];
  // src aligns to dst's trailing dims; extra leading src dims are allowed only with size 1.
  int64_t sstrides[DLUA_MAX_DIMS];
  int lead = dst->ndim - src->ndim;
  for (int d = 0; d < src->ndim; d++) {
    int dd = d + lead;
    if (dd < 0) {
      if (src->sizes[d] != 1) goto bad_shape;
      continue;
    }
    if (src->sizes[d] == dst->sizes[dd])
      sstrides[dd] = src->sizes[d] == 1 ? 0 : src->strides[d];
    else if (src->sizes[d] == 1)
      sstrides[dd] = 0;
    else
      goto bad_shape;
  }
  for (int d = 0; d < lead; d++) sstrides[d] = 0;
  for (int d = 0; d < dst->ndim; d++)
    if (dst->strides[d] == 0 && dst->sizes[d] > 1)
      return DLUA_ERR(DLUA_ERR_ARG,
                      "copy_: destination %s is expanded (stride 0 in dimension %d): several elements share one "
                      "memory location; clone() it first",
                      dlua_tensor_describe(dst, b1, sizeof b1), d);
  if (dlua_tensor_numel(dst) == 0) return DLUA_OK;
  const struct dlua_ew_ops *k;
  DLUA_TRY(DLUA_BACKEND("copy_", dst->device, ew, copy, &k));

  // Same dtype, same shape, both contiguous: the bytes move as they are (the backend's choice how).
  int same_shape = dst->ndim == src->ndim && !memcmp(dst->sizes, src->sizes, (size_t)dst->ndim * sizeof(int64_t));
  int dense = same_shape && dst->dtype == src->dtype && dlua_tensor_is_contiguous(dst) && dlua_tensor_is_contiguous(src);
  if (dense && dlua_tensor_ptr(dst) == dlua_tensor_ptr(src)) return DLUA_OK;

  // Overlapping views of one storage: read everything before writing anything.
  if (dst->storage == src->storage) {
    uintptr_t dlo, dhi, slo, shi;
    byte_span(dst, &dlo, &dhi);
    byte_span(src, &slo, &shi);
    if (dlo < shi && slo < dhi) {
      dlua_tensor_t *tmp = NULL;
      DLUA_TRY(dlua_tensor_clone(&tmp, src));
      dlua_status_t s = dlua_tensor_copy_(dst, tmp);
      dlua_tensor_free(tmp);
      return s;
    }
  }
  dlua_ew_desc_t e;
  memset(&e, 0, sizeof e);
  e.family = DLUA_EW_COPY;
  e.nops = 2;
  e.mode = dense;
  copy_layout(&e, dst, src->dtype, sstrides);
  e.base[1] = dlua_tensor_ptr(src);
  return k->copy("copy_", &e);
bad_shape:
  return DLUA_ERR(DLUA_ERR_ARG, "copy_: source %s cannot broadcast to destination %s",
                  dlua_tensor_describe(src, b1, sizeof b1), dlua_tensor_describe(dst, b2, sizeof b2));
}

dlua_status_t dlua_tensor_to_dtype(dlua_tensor_t **out, const dlua_tensor_t *t, dlua_dtype_t dtype) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "to_dtype: out is NULL");
  *out = NULL;
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "to_dtype: the tensor is NULL (freed, or never created)");
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "to_dtype: invalid dtype %d", (int)dtype);
  DLUA_TRY(dlua_tensor_empty(out, t->ndim, t->sizes, dtype, t->device));
  dlua_status_t s = dlua_tensor_copy_(*out, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

dlua_status_t dlua_tensor_from_data(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype,
                                    const void *data) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "from_data: out is NULL");
  *out = NULL;
  DLUA_TRY(dlua_tensor_empty(out, ndim, sizes, dtype, DLUA_CPU));
  size_t n = (*out)->storage->nbytes;
  if (n && !data) {
    dlua_tensor_free(*out);
    *out = NULL;
    return DLUA_ERR(DLUA_ERR_ARG, "from_data: data is NULL for %zu bytes", n);
  }
  if (n) memcpy((*out)->storage->data, data, n);
  return DLUA_OK;
}

dlua_status_t dlua_tensor_to_data(const dlua_tensor_t *t, void *dst, size_t dst_bytes) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "to_data: the tensor is NULL (freed, or never created)");
  size_t need = (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype);
  if (dst_bytes != need) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "to_data: %s needs %zu bytes, the buffer has %zu", dlua_tensor_describe(t, b, sizeof b),
                    need, dst_bytes);
  }
  if (need == 0) return DLUA_OK;
  if (!dst) return DLUA_ERR(DLUA_ERR_ARG, "to_data: destination is NULL");
  if (!dlua_tensor_is_contiguous(t)) {
    // Through copy_ into a host view of dst: strided on the CPU, from a dense copy moved to the host otherwise.
    dlua_tensor_t *view = NULL;
    DLUA_TRY(dlua_tensor_wrap(&view, t->ndim, t->sizes, NULL, t->dtype, dst, NULL, NULL));
    dlua_status_t s = dlua_tensor_copy_(view, t);
    dlua_tensor_free(view);
    return s;
  }
  // One copy, ordered after the work queued on t's device that wrote it.
  const struct dlua_ew_ops *k;
  DLUA_TRY(DLUA_BACKEND("to_data", t->device, ew, download, &k));
  return k->download("to_data", dst, dlua_tensor_ptr(t), need, t->device);
}

dlua_status_t dlua_tensor_fill_(dlua_tensor_t *t, double value) {
  DLUA_TRY(dlua_ops_check_input("fill_", t, NULL));
  if (dlua_tensor_numel(t) == 0) return DLUA_OK;
  const struct dlua_ew_ops *k;
  DLUA_TRY(DLUA_BACKEND("fill_", t->device, ew, copy, &k));
  int64_t zero[DLUA_MAX_DIMS] = {0};
  dlua_ew_desc_t e;
  memset(&e, 0, sizeof e);
  e.family = DLUA_EW_FILL;
  e.nops = 1;
  copy_layout(&e, t, t->dtype, zero);
  // The value's bits in t's dtype, through the f64 -> dtype converter, so a fill rounds exactly as a copy from
  // f64 would.
  uint64_t bits = 0;
  dlua_convert(&bits, t->dtype, &value, DLUA_DTYPE_F64, 1);
  memcpy(&e.i[0], &bits, sizeof bits);
  return k->copy("fill_", &e);
}

/* Writes v(i) for i in [0, n) into contiguous t, converting from double in blocks. */
typedef double (*seq_fn)(int64_t i, const double *params);
static void fill_sequence(dlua_tensor_t *t, int64_t n, seq_fn f, const double *params) {
  enum { BLOCK = 256 };
  dlua_convert_fn cvt = dlua_converter(DLUA_DTYPE_F64, t->dtype);
  size_t es = dlua_dtype_size(t->dtype);
  char *base = dlua_tensor_ptr(t);
  int64_t nblocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (n > ITER_CHUNK)
  for (int64_t b = 0; b < nblocks; b++) {
    double buf[BLOCK];
    int64_t lo = b * BLOCK, cnt = n - lo < BLOCK ? n - lo : BLOCK;
    for (int64_t j = 0; j < cnt; j++) buf[j] = f(lo + j, params);
    cvt(base + lo * (int64_t)es, (int64_t)es, (const char *)buf, (int64_t)sizeof(double), cnt);
  }
}

static double arange_at(int64_t i, const double *p) { return p[0] + (double)i * p[1]; }

dlua_status_t dlua_tensor_arange(dlua_tensor_t **out, double start, double end, double step, dlua_dtype_t dtype) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "arange: out is NULL");
  *out = NULL;
  if (!isfinite(start) || !isfinite(end) || !isfinite(step))
    return DLUA_ERR(DLUA_ERR_ARG, "arange: start %g, end %g and step %g must be finite", start, end, step);
  if (step == 0) return DLUA_ERR(DLUA_ERR_ARG, "arange: step must be nonzero");
  if ((step > 0 && end < start) || (step < 0 && end > start))
    return DLUA_ERR(DLUA_ERR_ARG, "arange: step %g goes away from end %g, starting at %g", step, end, start);
  double len = ceil((end - start) / step);  // PyTorch's length rule
  if (len > 9.0e18) return DLUA_ERR(DLUA_ERR_ARG, "arange: %g elements are too many", len);
  int64_t n = (int64_t)len;
  DLUA_TRY(dlua_tensor_empty(out, 1, &n, dtype, DLUA_CPU));
  double params[2] = {start, step};
  fill_sequence(*out, n, arange_at, params);
  return DLUA_OK;
}

/* Both ends computed from their own side, so the last value is `end` exactly. */
static double linspace_at(int64_t i, const double *p) {
  int64_t steps = (int64_t)p[3];
  return i < steps / 2 || steps == 1 ? p[0] + (double)i * p[2] : p[1] - (double)(steps - 1 - i) * p[2];
}

dlua_status_t dlua_tensor_linspace(dlua_tensor_t **out, double start, double end, int64_t steps, dlua_dtype_t dtype) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "linspace: out is NULL");
  *out = NULL;
  if (steps < 0) return DLUA_ERR(DLUA_ERR_ARG, "linspace: steps must be non-negative, got %" PRId64, steps);
  if (!isfinite(start) || !isfinite(end))
    return DLUA_ERR(DLUA_ERR_ARG, "linspace: start %g and end %g must be finite", start, end);
  DLUA_TRY(dlua_tensor_empty(out, 1, &steps, dtype, DLUA_CPU));
  double params[4] = {start, end, steps > 1 ? (end - start) / (double)(steps - 1) : 0.0, (double)steps};
  fill_sequence(*out, steps, linspace_at, params);
  return DLUA_OK;
}

dlua_status_t dlua_tensor_eye(dlua_tensor_t **out, int64_t n, int64_t m, dlua_dtype_t dtype) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "eye: out is NULL");
  *out = NULL;
  if (m < 0) m = n;  // eye(n) is square
  if (n < 0) return DLUA_ERR(DLUA_ERR_ARG, "eye: n must be non-negative, got %" PRId64, n);
  int64_t sizes[2] = {n, m};
  DLUA_TRY(dlua_tensor_zeros(out, 2, sizes, dtype, DLUA_CPU));
  // The diagonal is one strided view; fill it through the same converter as everything else.
  int64_t k = n < m ? n : m;
  int64_t dstride = m + 1;
  dlua_tensor_t diag = **out;
  diag.ndim = 1;
  diag.sizes[0] = k;
  diag.strides[0] = dstride;
  return dlua_tensor_fill_(&diag, 1.0);
}

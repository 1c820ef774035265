/* Tensor handles and storages: creation, reference counting, accessors, views, shape helpers. */
#include "core/tensor.h"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/alloc.h"
#include "core/error.h"

/* ---- shape helpers ----------------------------------------------------------------------- */

/* -1 when a size is negative or the product overflows int64. */
int64_t dlua_shape_numel(int ndim, const int64_t *sizes) {
  for (int d = 0; d < ndim; d++) {
    if (sizes[d] < 0) return -1;
    if (sizes[d] == 0) return 0;  // before the product: (0, 2^40, 2^40) is empty, not an overflow
  }
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    if (n > INT64_MAX / sizes[d]) return -1;
    n *= sizes[d];
  }
  return n;
}

const char *dlua_shape_str(int ndim, const int64_t *sizes, char *buf, size_t len) {
  if (!buf || len == 0) return buf;
  size_t used = 0;
  int n = snprintf(buf, len, "(");
  used = n > 0 ? (size_t)n : 0;
  for (int d = 0; d < ndim && used < len; d++) {
    n = snprintf(buf + used, len - used, d ? ", %" PRId64 : "%" PRId64, sizes[d]);
    if (n < 0) break;
    used += (size_t)n;
  }
  if (used < len) snprintf(buf + used, len - used, ")");
  return buf;
}

void dlua_contiguous_strides(int ndim, const int64_t *sizes, int64_t *strides) {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    strides[d] = s;
    // A zero size must not zero the outer strides: they still describe a valid layout. Only
    // an empty tensor can have sizes whose product overflows; its strides are never used.
    if (sizes[d] > 1 && s <= INT64_MAX / sizes[d]) s *= sizes[d];
  }
}

dlua_status_t dlua_broadcast_shapes(const char *op, int na, const int64_t *sa, int nb, const int64_t *sb,
                                    int *nout, int64_t *out) {
  int n = na > nb ? na : nb;
  int64_t res[DLUA_MAX_DIMS];
  for (int i = 0; i < n; i++) {
    int da = na - n + i, db = nb - n + i;
    int64_t a = da >= 0 ? sa[da] : 1, b = db >= 0 ? sb[db] : 1;
    if (a == b || b == 1) {
      res[i] = a;
    } else if (a == 1) {
      res[i] = b;
    } else {
      char ba[160], bb[160];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: shapes %s and %s cannot broadcast (dimension %d from the end: %" PRId64 " vs %" PRId64 ")",
                      op, dlua_shape_str(na, sa, ba, sizeof ba), dlua_shape_str(nb, sb, bb, sizeof bb), i - n, a, b);
    }
  }
  memcpy(out, res, (size_t)n * sizeof(int64_t));
  *nout = n;
  return DLUA_OK;
}

/* ---- storages and handles ------------------------------------------------------------------ */

/* Device storages come with their allocator's deleter; a NULL deleter means dlua_cpu_alloc. */
static void storage_release(dlua_storage_t *s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (s->deleter)
    s->deleter(s->ctx, s->data);
  else if (s->device == DLUA_CPU)
    dlua_cpu_free(s->data, s->nbytes);
  free(s);
}

/* Takes a new reference on `storage` for the handle it returns. */
static dlua_tensor_t *handle_new(const char *op, dlua_storage_t *storage, int64_t offset, int ndim,
                                 const int64_t *sizes, const int64_t *strides, dlua_dtype_t dtype) {
  dlua_tensor_t *t = malloc(sizeof *t);
  if (!t) {
    DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes for a tensor handle", op, sizeof *t);
    return NULL;
  }
  memset(t, 0, sizeof *t);
  t->storage = storage;
  t->offset = offset;
  t->ndim = ndim;
  t->dtype = dtype;
  t->device = storage->device;
  if (ndim > 0) {
    memcpy(t->sizes, sizes, (size_t)ndim * sizeof(int64_t));
    memcpy(t->strides, strides, (size_t)ndim * sizeof(int64_t));
  }
  __atomic_add_fetch(&storage->refcount, 1, __ATOMIC_RELAXED);
  return t;
}

dlua_tensor_t *dlua_tensor_alias(const dlua_tensor_t *t) {
  return handle_new("alias", t->storage, t->offset, t->ndim, t->sizes, t->strides, t->dtype);
}

static dlua_status_t check_shape(const char *op, int ndim, const int64_t *sizes) {
  if (ndim < 0 || ndim > DLUA_MAX_DIMS)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %d dimensions requested, at most %d are supported", op, ndim, DLUA_MAX_DIMS);
  if (ndim > 0 && !sizes) return DLUA_ERR(DLUA_ERR_ARG, "%s: sizes is NULL for %d dimensions", op, ndim);
  for (int d = 0; d < ndim; d++)
    if (sizes[d] < 0) {
      char b[160];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: negative size %" PRId64 " at dimension %d of %s", op, sizes[d], d,
                      dlua_shape_str(ndim, sizes, b, sizeof b));
    }
  return DLUA_OK;
}

static dlua_status_t check_dtype(const char *op, dlua_dtype_t dtype) {
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid dtype %d", op, (int)dtype);
  return DLUA_OK;
}

/* Device storage from the CUDA caching allocator (host/cuda/device.c); ctx carries the ordinal. */
static void cuda_storage_free(void *ctx, void *data) {
  if (dlua_cuda_free((int)(intptr_t)ctx, data) != DLUA_OK) dlua_clear_error();
}

static dlua_status_t cuda_tensor_new(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                     dlua_dtype_t dtype, int device, size_t nbytes) {
  char b[160];
  void *data = NULL;
  if (dlua_cuda_malloc(&data, device, nbytes, NULL) != DLUA_OK) {
    // "cuda alloc: <why>" from the device layer, restated for this op and tensor
    char why[900];
    snprintf(why, sizeof why, "%s", dlua_last_error());
    const char *m = strncmp(why, "cuda alloc: ", 12) == 0 ? why + 12 : why;
    return DLUA_ERR(dlua_last_status(), "%s: cannot create %s %s on cuda:%d: %s", op, dlua_shape_str(ndim, sizes, b, sizeof b),
                    dlua_dtype_name(dtype), device, m);
  }
  dlua_storage_t *s = malloc(sizeof *s);
  if (!s) {
    cuda_storage_free((void *)(intptr_t)device, data);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of host memory for a storage", op);
  }
  *s = (dlua_storage_t){data, nbytes, device, 0, cuda_storage_free, (void *)(intptr_t)device};
  int64_t strides[DLUA_MAX_DIMS];
  dlua_contiguous_strides(ndim, sizes, strides);
  dlua_tensor_t *t = handle_new(op, s, 0, ndim, sizes, strides, dtype);
  if (!t) {
    cuda_storage_free((void *)(intptr_t)device, data);
    free(s);
    return DLUA_ERR_OOM;
  }
  *out = t;
  return DLUA_OK;
}

/* A fresh contiguous tensor; the public constructors and the copying views share it. */
static dlua_status_t tensor_new(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                dlua_dtype_t dtype, int device) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  *out = NULL;
  DLUA_TRY(check_shape(op, ndim, sizes));
  DLUA_TRY(check_dtype(op, dtype));
  char b[160];
  if (device != DLUA_CPU && device < 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid device %d", op, device);
  int64_t numel = dlua_shape_numel(ndim, sizes);
  size_t es = dlua_dtype_size(dtype);
  if (numel < 0 || (uint64_t)numel > (uint64_t)INT64_MAX / es)
    return DLUA_ERR(DLUA_ERR_OOM, "%s: %s %s is too large to address", op, dlua_shape_str(ndim, sizes, b, sizeof b),
                    dlua_dtype_name(dtype));
  size_t nbytes = (size_t)numel * es;
  if (device != DLUA_CPU) return cuda_tensor_new(op, out, ndim, sizes, dtype, device, nbytes);
  dlua_storage_t *s = malloc(sizeof *s);
  void *data = s ? dlua_cpu_alloc(nbytes) : NULL;
  if (!data) {
    free(s);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes for %s %s on the CPU (%" PRId64 " bytes in use)",
                    op, nbytes, dlua_shape_str(ndim, sizes, b, sizeof b), dlua_dtype_name(dtype),
                    dlua_memory_allocated(DLUA_CPU));
  }
  s->data = data;
  s->nbytes = nbytes;
  s->device = DLUA_CPU;
  s->refcount = 0;
  s->deleter = NULL;
  s->ctx = NULL;
  int64_t strides[DLUA_MAX_DIMS];
  dlua_contiguous_strides(ndim, sizes, strides);
  dlua_tensor_t *t = handle_new(op, s, 0, ndim, sizes, strides, dtype);
  if (!t) {
    dlua_cpu_free(data, nbytes);
    free(s);
    return DLUA_ERR_OOM;
  }
  *out = t;
  return DLUA_OK;
}

dlua_status_t dlua_tensor_empty(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, int device) {
  return tensor_new("empty", out, ndim, sizes, dtype, device);
}

dlua_status_t dlua_tensor_zeros(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, int device) {
  DLUA_TRY(tensor_new("zeros", out, ndim, sizes, dtype, device));
  if (device != DLUA_CPU) {  // device memory: a fill kernel, never a host memset
    dlua_status_t s = dlua_tensor_fill_(*out, 0.0);
    if (s != DLUA_OK) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
    return s;
  }
  char *p = (*out)->storage->data;
  size_t n = (*out)->storage->nbytes;
  // Large buffers are zeroed by every thread, so pages are touched near the threads that use them.
  if (n >= ((size_t)1 << 22)) {
    int64_t nchunks = (int64_t)((n + ((size_t)1 << 20) - 1) >> 20);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
      size_t lo = (size_t)c << 20, hi = lo + ((size_t)1 << 20);
      memset(p + lo, 0, (hi < n ? hi : n) - lo);
    }
  } else {
    memset(p, 0, n);
  }
  return DLUA_OK;
}

static void keep_caller_memory(void *ctx, void *data) {
  (void)ctx;
  (void)data;
}

/* On failure the caller still owns `data`: the deleter runs only for a wrap that succeeded. */
dlua_status_t dlua_tensor_wrap(dlua_tensor_t **out, int ndim, const int64_t *sizes, const int64_t *strides,
                               dlua_dtype_t dtype, void *data, void (*deleter)(void *ctx, void *data), void *ctx) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "wrap: out is NULL");
  *out = NULL;
  DLUA_TRY(check_shape("wrap", ndim, sizes));
  DLUA_TRY(check_dtype("wrap", dtype));
  int64_t st[DLUA_MAX_DIMS];
  if (strides) {
    memcpy(st, strides, (size_t)ndim * sizeof(int64_t));
  } else {
    dlua_contiguous_strides(ndim, sizes, st);
  }
  int64_t numel = dlua_shape_numel(ndim, sizes);
  if (numel < 0) return DLUA_ERR(DLUA_ERR_ARG, "wrap: shape overflows int64");
  // The storage spans the largest element the view can reach; that is all a wrap knows.
  int64_t extent = numel ? 1 : 0;
  for (int d = 0; d < ndim && numel; d++) {
    if (st[d] < 0) return DLUA_ERR(DLUA_ERR_ARG, "wrap: negative stride %" PRId64 " at dimension %d", st[d], d);
    extent += (sizes[d] - 1) * st[d];
  }
  if (!data && numel) return DLUA_ERR(DLUA_ERR_ARG, "wrap: data is NULL for %" PRId64 " elements", numel);
  dlua_storage_t *s = malloc(sizeof *s);
  if (!s) return DLUA_ERR(DLUA_ERR_OOM, "wrap: out of memory allocating %zu bytes for a storage", sizeof *s);
  s->data = data;
  s->nbytes = (size_t)extent * dlua_dtype_size(dtype);
  s->device = DLUA_CPU;
  s->refcount = 0;
  // Caller memory is not ours to count or free: a NULL deleter must not reach dlua_cpu_free.
  s->deleter = deleter ? deleter : keep_caller_memory;
  s->ctx = ctx;
  dlua_tensor_t *t = handle_new("wrap", s, 0, ndim, sizes, st, dtype);
  if (!t) {
    free(s);
    return DLUA_ERR_OOM;
  }
  *out = t;
  return DLUA_OK;
}

void dlua_tensor_free(dlua_tensor_t *t) {
  if (!t) return;
  storage_release(t->storage);
  free(t);
}

/* ---- accessors ----------------------------------------------------------------------------- */

int dlua_tensor_ndim(const dlua_tensor_t *t) { return t->ndim; }
const int64_t *dlua_tensor_sizes(const dlua_tensor_t *t) { return t->sizes; }
const int64_t *dlua_tensor_strides(const dlua_tensor_t *t) { return t->strides; }
int64_t dlua_tensor_offset(const dlua_tensor_t *t) { return t->offset; }
int64_t dlua_tensor_numel(const dlua_tensor_t *t) { return dlua_shape_numel(t->ndim, t->sizes); }
dlua_dtype_t dlua_tensor_dtype(const dlua_tensor_t *t) { return t->dtype; }
int dlua_tensor_device(const dlua_tensor_t *t) { return t->device; }
void *dlua_tensor_data(const dlua_tensor_t *t) { return dlua_tensor_ptr(t); }
size_t dlua_tensor_storage_bytes(const dlua_tensor_t *t) { return t->storage->nbytes; }

int dlua_tensor_same_storage(const dlua_tensor_t *a, const dlua_tensor_t *b) {
  return a && b && a->storage == b->storage;
}

int dlua_tensor_is_contiguous(const dlua_tensor_t *t) {
  int64_t expected = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->sizes[d] == 0) return 1;  // no elements: any strides describe them
    if (t->sizes[d] != 1 && t->strides[d] != expected) return 0;
    expected *= t->sizes[d];
  }
  return 1;
}

const char *dlua_tensor_describe(const dlua_tensor_t *t, char *buf, size_t len) {
  if (!buf || len == 0) return buf;
  if (!t) {
    snprintf(buf, len, "(freed or NULL tensor)");
    return buf;
  }
  char shape[160];
  dlua_shape_str(t->ndim, t->sizes, shape, sizeof shape);
  if (t->device == DLUA_CPU)
    snprintf(buf, len, "%s %s cpu", shape, dlua_dtype_name(t->dtype));
  else
    snprintf(buf, len, "%s %s cuda:%d", shape, dlua_dtype_name(t->dtype), t->device);
  return buf;
}

dlua_status_t dlua_require_cpu(const char *op, const dlua_tensor_t *t) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", op);
  if (t->device != DLUA_CPU) {
    // Ops reach CUDA one by one (docs/cuda.md lists which): the rest say so instead of misbehaving.
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d yet (got %s)", op, t->device,
                    dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

dlua_status_t dlua_require_device(const char *op, const dlua_tensor_t *t, int device) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", op);
  if (t->device != device) {
    char b[200];
    if (device == DLUA_CPU) return dlua_require_cpu(op, t);
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got %s where cuda:%d was expected", op,
                    dlua_tensor_describe(t, b, sizeof b), device);
  }
  return DLUA_OK;
}

dlua_status_t dlua_same_device(const char *op, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  if (!a || !b || !a->storage || !b->storage || a->device == b->device) return DLUA_OK;
  char b1[200], b2[200];
  return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got %s and %s", op,
                  dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
}

dlua_status_t dlua_prepare_out(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype,
                               int *allocated) {
  return dlua_prepare_out_on(op, out, ndim, sizes, dtype, DLUA_CPU, allocated);
}

dlua_status_t dlua_prepare_out_on(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes,
                                  dlua_dtype_t dtype, int device, int *allocated) {
  if (allocated) *allocated = 0;
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (!*out) {
    DLUA_TRY(tensor_new(op, out, ndim, sizes, dtype, device));
    if (allocated) *allocated = 1;
    return DLUA_OK;
  }
  if (*out && (*out)->storage && (*out)->device != device) {
    char b[200], dn[24];
    if (device == DLUA_CPU) snprintf(dn, sizeof dn, "cpu");
    else snprintf(dn, sizeof dn, "cuda:%d", device);
    return DLUA_ERR(DLUA_ERR_ARG, "%s: output %s is not on the inputs' device (%s)", op,
                    dlua_tensor_describe(*out, b, sizeof b), dn);
  }
  DLUA_TRY(dlua_require_device(op, *out, device));
  const dlua_tensor_t *o = *out;
  int same = o->ndim == ndim;
  for (int d = 0; same && d < ndim; d++) same = o->sizes[d] == sizes[d];
  if (!same) {
    char b1[200], b2[160];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: output %s does not have the result's shape %s", op,
                    dlua_tensor_describe(o, b1, sizeof b1), dlua_shape_str(ndim, sizes, b2, sizeof b2));
  }
  return DLUA_OK;
}

/* ---- views ---------------------------------------------------------------------------------- */

static dlua_status_t check_dim(const char *op, const dlua_tensor_t *t, int dim, int ndim_allowed) {
  if (dim < 0 || dim >= ndim_allowed) {
    char b[200];
    if (ndim_allowed == 0)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: dimension %d out of range for %s, which has no dimensions", op, dim,
                      dlua_tensor_describe(t, b, sizeof b));
    return DLUA_ERR(DLUA_ERR_ARG, "%s: dimension %d out of range for %s (0-based, expected 0..%d)", op, dim,
                    dlua_tensor_describe(t, b, sizeof b), ndim_allowed - 1);
  }
  return DLUA_OK;
}

/* Every view ends here: a new handle on t's storage with the given geometry. */
static dlua_status_t make_view(const char *op, dlua_tensor_t **out, const dlua_tensor_t *t, int ndim,
                               const int64_t *sizes, const int64_t *strides, int64_t offset) {
  dlua_tensor_t *v = handle_new(op, t->storage, offset, ndim, sizes, strides, t->dtype);
  if (!v) return DLUA_ERR_OOM;
  *out = v;
  return DLUA_OK;
}

#define VIEW_PROLOGUE(op, out, t)                                 \
  do {                                                            \
    if (!(out)) return DLUA_ERR(DLUA_ERR_ARG, op ": out is NULL"); \
    *(out) = NULL;                                                \
    if (!(t) || !(t)->storage)                                    \
      return DLUA_ERR(DLUA_ERR_ARG, op ": the tensor is NULL (freed, or never created)"); \
  } while (0)

/* Resolves one -1 in a requested shape against numel; the view and reshape messages share it. */
static dlua_status_t infer_shape(const char *op, const dlua_tensor_t *t, int ndim, const int64_t *sizes,
                                 int64_t *resolved) {
  if (ndim < 0 || ndim > DLUA_MAX_DIMS)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %d dimensions requested, at most %d are supported", op, ndim, DLUA_MAX_DIMS);
  if (ndim > 0 && !sizes) return DLUA_ERR(DLUA_ERR_ARG, "%s: sizes is NULL for %d dimensions", op, ndim);
  int infer = -1;
  int64_t known = 1;
  char b1[200], b2[160];
  for (int d = 0; d < ndim; d++) {
    if (sizes[d] == -1) {
      if (infer >= 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: only one dimension can be -1, got %s", op,
                                      dlua_shape_str(ndim, sizes, b2, sizeof b2));
      infer = d;
    } else if (sizes[d] < 0) {
      return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid size %" PRId64 " in %s", op, sizes[d],
                      dlua_shape_str(ndim, sizes, b2, sizeof b2));
    } else {
      if (sizes[d] && known > INT64_MAX / sizes[d])
        return DLUA_ERR(DLUA_ERR_ARG, "%s: shape %s overflows int64", op, dlua_shape_str(ndim, sizes, b2, sizeof b2));
      known *= sizes[d];
    }
    resolved[d] = sizes[d];
  }
  int64_t numel = dlua_tensor_numel(t);
  if (infer >= 0) {
    if (known == 0)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot infer the -1 in %s for %s: with a zero size it could be anything", op,
                      dlua_shape_str(ndim, sizes, b2, sizeof b2), dlua_tensor_describe(t, b1, sizeof b1));
    if (numel % known != 0)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: shape %s is invalid for %s (%" PRId64 " elements)", op,
                      dlua_shape_str(ndim, sizes, b2, sizeof b2), dlua_tensor_describe(t, b1, sizeof b1), numel);
    resolved[infer] = numel / known;
  } else if (known != numel) {
    return DLUA_ERR(DLUA_ERR_ARG, "%s: shape %s is invalid for %s (%" PRId64 " elements)", op,
                    dlua_shape_str(ndim, sizes, b2, sizeof b2), dlua_tensor_describe(t, b1, sizeof b1), numel);
  }
  return DLUA_OK;
}

/* Strides that make `sizes` walk t's elements in the same row-major order without a copy,
   or 0 if none exist. t's dims split into chunks whose elements are evenly spaced; each
   new dim must fall inside one chunk. */
static int view_strides(const dlua_tensor_t *t, int ndim, const int64_t *sizes, int64_t *strides) {
  if (dlua_tensor_numel(t) == 0) {
    dlua_contiguous_strides(ndim, sizes, strides);
    return 1;
  }
  int64_t chunk_numel[DLUA_MAX_DIMS], chunk_stride[DLUA_MAX_DIMS];
  int nchunks = 0;
  int64_t prev_stride = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->sizes[d] == 1) continue;  // size-1 dims carry no layout information
    if (nchunks > 0 && prev_stride == t->strides[d] * t->sizes[d]) {
      chunk_numel[nchunks - 1] *= t->sizes[d];
      chunk_stride[nchunks - 1] = t->strides[d];
    } else {
      chunk_numel[nchunks] = t->sizes[d];
      chunk_stride[nchunks] = t->strides[d];
      nchunks++;
    }
    prev_stride = t->strides[d];
  }
  int k = nchunks - 1;
  int64_t acc = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    if (sizes[d] == 1) {
      strides[d] = k >= 0 ? chunk_stride[k] * acc : 1;
      continue;
    }
    if (k < 0) return 0;
    strides[d] = chunk_stride[k] * acc;
    acc *= sizes[d];
    if (acc == chunk_numel[k]) {
      k--;
      acc = 1;
    } else if (acc > chunk_numel[k]) {
      return 0;
    }
  }
  return k < 0;
}

dlua_status_t dlua_tensor_view(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes) {
  VIEW_PROLOGUE("view", out, t);
  int64_t shape[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  DLUA_TRY(infer_shape("view", t, ndim, sizes, shape));
  if (!view_strides(t, ndim, shape, strides)) {
    char b1[200], b2[160], b3[160];
    return DLUA_ERR(DLUA_ERR_ARG,
                    "view: cannot view %s with strides %s as %s: its elements are not evenly spaced across "
                    "the dimensions being merged; use reshape (which copies) or contiguous() first",
                    dlua_tensor_describe(t, b1, sizeof b1), dlua_shape_str(t->ndim, t->strides, b3, sizeof b3),
                    dlua_shape_str(ndim, shape, b2, sizeof b2));
  }
  return make_view("view", out, t, ndim, shape, strides, t->offset);
}

dlua_status_t dlua_tensor_reshape(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes) {
  VIEW_PROLOGUE("reshape", out, t);
  int64_t shape[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  DLUA_TRY(infer_shape("reshape", t, ndim, sizes, shape));
  if (view_strides(t, ndim, shape, strides)) return make_view("reshape", out, t, ndim, shape, strides, t->offset);
  dlua_tensor_t *c = NULL;
  DLUA_TRY(dlua_tensor_clone(&c, t));
  dlua_contiguous_strides(ndim, shape, strides);
  dlua_status_t s = make_view("reshape", out, c, ndim, shape, strides, 0);
  dlua_tensor_free(c);
  return s;
}

dlua_status_t dlua_tensor_as_strided(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes,
                                     const int64_t *strides, int64_t offset) {
  VIEW_PROLOGUE("as_strided", out, t);
  DLUA_TRY(check_shape("as_strided", ndim, sizes));
  if (ndim > 0 && !strides) return DLUA_ERR(DLUA_ERR_ARG, "as_strided: strides is NULL for %d dimensions", ndim);
  char b1[200], b2[160], b3[160];
  if (offset < 0) return DLUA_ERR(DLUA_ERR_ARG, "as_strided: negative offset %" PRId64, offset);
  int64_t numel = dlua_shape_numel(ndim, sizes);
  if (numel < 0) return DLUA_ERR(DLUA_ERR_ARG, "as_strided: shape %s overflows int64", dlua_shape_str(ndim, sizes, b2, sizeof b2));
  // The farthest element reached, in elements of t's dtype; must lie inside the storage.
  uint64_t last = (uint64_t)offset;
  for (int d = 0; d < ndim; d++) {
    if (strides[d] < 0)
      return DLUA_ERR(DLUA_ERR_ARG, "as_strided: negative stride %" PRId64 " at dimension %d", strides[d], d);
    if (numel && sizes[d] > 1) {
      if ((uint64_t)strides[d] > (uint64_t)INT64_MAX / (uint64_t)(sizes[d] - 1))
        return DLUA_ERR(DLUA_ERR_ARG, "as_strided: strides %s overflow", dlua_shape_str(ndim, strides, b3, sizeof b3));
      last += (uint64_t)(sizes[d] - 1) * (uint64_t)strides[d];
    }
  }
  uint64_t cap = t->storage->nbytes / dlua_dtype_size(t->dtype);
  if (numel ? last >= cap : (uint64_t)offset > cap)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "as_strided: sizes %s, strides %s and offset %" PRId64 " reach element %" PRIu64
                    " of a storage holding %" PRIu64 " elements (%s)",
                    dlua_shape_str(ndim, sizes, b2, sizeof b2), dlua_shape_str(ndim, strides, b3, sizeof b3), offset,
                    last, cap, dlua_tensor_describe(t, b1, sizeof b1));
  return make_view("as_strided", out, t, ndim, sizes, strides, offset);
}

dlua_status_t dlua_tensor_narrow(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t start, int64_t length) {
  VIEW_PROLOGUE("narrow", out, t);
  DLUA_TRY(check_dim("narrow", t, dim, t->ndim));
  if (start < 0 || length < 0 || start > t->sizes[dim] || length > t->sizes[dim] - start) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG,
                    "narrow: start %" PRId64 " and length %" PRId64 " exceed dimension %d (size %" PRId64 ") of %s",
                    start, length, dim, t->sizes[dim], dlua_tensor_describe(t, b, sizeof b));
  }
  int64_t sizes[DLUA_MAX_DIMS];
  memcpy(sizes, t->sizes, sizeof sizes);
  sizes[dim] = length;
  return make_view("narrow", out, t, t->ndim, sizes, t->strides, t->offset + start * t->strides[dim]);
}

dlua_status_t dlua_tensor_slice(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t start, int64_t stop,
                                int64_t step) {
  VIEW_PROLOGUE("slice", out, t);
  DLUA_TRY(check_dim("slice", t, dim, t->ndim));
  char b[200];
  if (step <= 0) return DLUA_ERR(DLUA_ERR_ARG, "slice: step must be positive, got %" PRId64, step);
  int64_t n = t->sizes[dim];
  if (start < 0 || start > n || stop < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "slice: [%" PRId64 ", %" PRId64 ") is out of range for dimension %d (size %" PRId64 ") of %s",
                    start, stop, dim, n, dlua_tensor_describe(t, b, sizeof b));
  if (stop > n) stop = n;  // like Python slices, an end past the size means "to the end"
  int64_t len = stop > start ? (stop - start + step - 1) / step : 0;
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  memcpy(sizes, t->sizes, sizeof sizes);
  memcpy(strides, t->strides, sizeof strides);
  sizes[dim] = len;
  strides[dim] = t->strides[dim] * step;
  int64_t offset = t->offset + (len ? start * t->strides[dim] : 0);
  return make_view("slice", out, t, t->ndim, sizes, strides, offset);
}

dlua_status_t dlua_tensor_select(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t index) {
  VIEW_PROLOGUE("select", out, t);
  DLUA_TRY(check_dim("select", t, dim, t->ndim));
  if (index < 0 || index >= t->sizes[dim]) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "select: index %" PRId64 " out of range for dimension %d (size %" PRId64 ") of %s",
                    index, dim, t->sizes[dim], dlua_tensor_describe(t, b, sizeof b));
  }
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (d == dim) continue;
    sizes[n] = t->sizes[d];
    strides[n] = t->strides[d];
    n++;
  }
  return make_view("select", out, t, n, sizes, strides, t->offset + index * t->strides[dim]);
}

dlua_status_t dlua_tensor_transpose(dlua_tensor_t **out, const dlua_tensor_t *t, int dim0, int dim1) {
  VIEW_PROLOGUE("transpose", out, t);
  DLUA_TRY(check_dim("transpose", t, dim0, t->ndim));
  DLUA_TRY(check_dim("transpose", t, dim1, t->ndim));
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  memcpy(sizes, t->sizes, sizeof sizes);
  memcpy(strides, t->strides, sizeof strides);
  sizes[dim0] = t->sizes[dim1];
  sizes[dim1] = t->sizes[dim0];
  strides[dim0] = t->strides[dim1];
  strides[dim1] = t->strides[dim0];
  return make_view("transpose", out, t, t->ndim, sizes, strides, t->offset);
}

dlua_status_t dlua_tensor_permute(dlua_tensor_t **out, const dlua_tensor_t *t, const int *dims) {
  VIEW_PROLOGUE("permute", out, t);
  if (t->ndim > 0 && !dims) return DLUA_ERR(DLUA_ERR_ARG, "permute: dims is NULL");
  int seen[DLUA_MAX_DIMS] = {0};
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  for (int d = 0; d < t->ndim; d++) {
    int s = dims[d];
    if (s < 0 || s >= t->ndim || seen[s]) {
      char b[200], list[64];
      size_t used = 0;
      list[0] = '\0';
      for (int i = 0; i < t->ndim && used < sizeof list; i++) {
        int k = snprintf(list + used, sizeof list - used, i ? ", %d" : "%d", dims[i]);
        if (k < 0) break;
        used += (size_t)k;
      }
      return DLUA_ERR(DLUA_ERR_ARG, "permute: (%s) is not a permutation of the dimensions of %s", list,
                      dlua_tensor_describe(t, b, sizeof b));
    }
    seen[s] = 1;
    sizes[d] = t->sizes[s];
    strides[d] = t->strides[s];
  }
  return make_view("permute", out, t, t->ndim, sizes, strides, t->offset);
}

dlua_status_t dlua_tensor_expand(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes) {
  VIEW_PROLOGUE("expand", out, t);
  char b1[200], b2[160];
  if (ndim < t->ndim || ndim > DLUA_MAX_DIMS || (ndim > 0 && !sizes))
    return DLUA_ERR(DLUA_ERR_ARG, "expand: cannot expand %s to %d dimensions", dlua_tensor_describe(t, b1, sizeof b1), ndim);
  int64_t nsizes[DLUA_MAX_DIMS], nstrides[DLUA_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int d = 0; d < ndim; d++) {
    int od = d - lead;
    int64_t want = sizes[d];
    if (od < 0) {
      if (want < 0) goto bad;  // a new leading dim has no size to keep
      nsizes[d] = want;
      nstrides[d] = 0;
    } else if (want == -1 || want == t->sizes[od]) {
      nsizes[d] = t->sizes[od];
      nstrides[d] = t->strides[od];
    } else if (t->sizes[od] == 1 && want >= 0) {
      nsizes[d] = want;
      nstrides[d] = 0;
    } else {
      goto bad;
    }
  }
  return make_view("expand", out, t, ndim, nsizes, nstrides, t->offset);
bad:
  return DLUA_ERR(DLUA_ERR_ARG, "expand: cannot expand %s to %s (only size-1 dimensions grow; -1 keeps a size)",
                  dlua_tensor_describe(t, b1, sizeof b1), dlua_shape_str(ndim, sizes, b2, sizeof b2));
}

dlua_status_t dlua_tensor_squeeze(dlua_tensor_t **out, const dlua_tensor_t *t, int dim) {
  VIEW_PROLOGUE("squeeze", out, t);
  // A 0-d tensor has one nameable dim (as in PyTorch), so squeeze(0) on it is a no-op.
  if (dim >= 0 && !(t->ndim == 0 && dim == 0)) DLUA_TRY(check_dim("squeeze", t, dim, t->ndim));
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->sizes[d] == 1 && (dim < 0 || d == dim)) continue;
    sizes[n] = t->sizes[d];
    strides[n] = t->strides[d];
    n++;
  }
  return make_view("squeeze", out, t, n, sizes, strides, t->offset);
}

dlua_status_t dlua_tensor_unsqueeze(dlua_tensor_t **out, const dlua_tensor_t *t, int dim) {
  VIEW_PROLOGUE("unsqueeze", out, t);
  char b[200];
  if (t->ndim >= DLUA_MAX_DIMS)
    return DLUA_ERR(DLUA_ERR_ARG, "unsqueeze: %s already has the maximum of %d dimensions",
                    dlua_tensor_describe(t, b, sizeof b), DLUA_MAX_DIMS);
  DLUA_TRY(check_dim("unsqueeze", t, dim, t->ndim + 1));
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
  for (int d = 0, s = 0; d <= t->ndim; d++) {
    if (d == dim) {
      sizes[d] = 1;
      // The stride a contiguous tensor would have there, so contiguity is preserved.
      strides[d] = dim < t->ndim ? t->sizes[dim] * t->strides[dim] : 1;
    } else {
      sizes[d] = t->sizes[s];
      strides[d] = t->strides[s];
      s++;
    }
  }
  return make_view("unsqueeze", out, t, t->ndim + 1, sizes, strides, t->offset);
}

dlua_status_t dlua_tensor_flatten(dlua_tensor_t **out, const dlua_tensor_t *t, int start_dim, int end_dim) {
  VIEW_PROLOGUE("flatten", out, t);
  if (t->ndim == 0) {
    // PyTorch: flattening a 0-d tensor gives shape (1); dims 0..0 are the only valid ones.
    if (start_dim != 0 || end_dim != 0) return DLUA_ERR(DLUA_ERR_ARG, "flatten: a 0-d tensor only has dimension 0");
    int64_t one = 1;
    return dlua_tensor_reshape(out, t, 1, &one);
  }
  DLUA_TRY(check_dim("flatten", t, start_dim, t->ndim));
  DLUA_TRY(check_dim("flatten", t, end_dim, t->ndim));
  if (start_dim > end_dim) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "flatten: start_dim %d is after end_dim %d for %s", start_dim, end_dim,
                    dlua_tensor_describe(t, b, sizeof b));
  }
  int64_t sizes[DLUA_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < start_dim; d++) sizes[n++] = t->sizes[d];
  int64_t merged = 1;
  for (int d = start_dim; d <= end_dim; d++) merged *= t->sizes[d];
  sizes[n++] = merged;
  for (int d = end_dim + 1; d < t->ndim; d++) sizes[n++] = t->sizes[d];
  // As in PyTorch, flatten is a view when the merged dims allow one and a copy otherwise.
  return dlua_tensor_reshape(out, t, n, sizes);
}

dlua_status_t dlua_tensor_contiguous(dlua_tensor_t **out, const dlua_tensor_t *t) {
  VIEW_PROLOGUE("contiguous", out, t);
  if (dlua_tensor_is_contiguous(t)) return make_view("contiguous", out, t, t->ndim, t->sizes, t->strides, t->offset);
  return dlua_tensor_clone(out, t);
}

dlua_status_t dlua_tensor_clone(dlua_tensor_t **out, const dlua_tensor_t *t) {
  VIEW_PROLOGUE("clone", out, t);
  DLUA_TRY(tensor_new("clone", out, t->ndim, t->sizes, t->dtype, t->device));
  dlua_status_t s = dlua_tensor_copy_(*out, t);
  if (s != DLUA_OK) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

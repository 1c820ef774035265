/* Copies between tensors of any layout and dtype, conversion to/from raw memory, fills, ranges. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda/kernels.h" /* plain C: the launch descriptor; only CUDA builds call into it */

/* ---- element conversions ------------------------------------------------------------------- */

/* Float -> int: truncate toward zero (as PyTorch); out of range saturates to int64 and NaN
   gives 0 so the result is defined; narrower ints then wrap, as PyTorch's int64 -> uint8. */
static inline int64_t f64_to_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}
static inline int64_t f32_to_i64(float v) { return f64_to_i64((double)v); }
static inline int64_t same_i64(int64_t v) { return v; }
#define TO_I64(v) _Generic((v), float: f32_to_i64, double: f64_to_i64, default: same_i64)(v)

/* Loads give float (f32/f16/bf16), double (f64) or int64 (integers, bool). */
#define LOAD_f32(x) (x)
#define LOAD_f64(x) (x)
#define LOAD_f16(x) dlua_f16_to_f32_inl(x)
#define LOAD_bf16(x) dlua_bf16_to_f32_inl(x)
#define LOAD_i32(x) ((int64_t)(x))
#define LOAD_i64(x) ((int64_t)(x))
#define LOAD_u8(x) ((int64_t)(x))
#define LOAD_b8(x) ((int64_t)((x) != 0))

#define STORE_f32(v) ((float)(v))
#define STORE_f64(v) ((double)(v))
#define STORE_f16(v) dlua_f32_to_f16_inl((float)(v))
#define STORE_bf16(v) dlua_f32_to_bf16_inl((float)(v))
#define STORE_i32(v) ((int32_t)(uint32_t)(uint64_t)TO_I64(v))
#define STORE_i64(v) TO_I64(v)
#define STORE_u8(v) ((uint8_t)(uint64_t)TO_I64(v))
#define STORE_b8(v) ((uint8_t)((v) != 0))

/* n elements from src (step ss bytes) to dst (step ds bytes); ss == 0 broadcasts one value. */
typedef void (*cvt_fn)(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n);

#define CVT_FN(SN, ST, DN, DT)                                                         \
  static void cvt_##SN##_##DN(char *d, int64_t ds, const char *s, int64_t ss, int64_t n) { \
    if (ss == 0) {                                                                     \
      const DT v = STORE_##DN(LOAD_##SN(*(const ST *)s));                              \
      if (ds == (int64_t)sizeof(DT)) {                                                 \
        DT *dp = (DT *)d;                                                              \
        for (int64_t i = 0; i < n; i++) dp[i] = v;                                     \
      } else {                                                                         \
        for (int64_t i = 0; i < n; i++) *(DT *)(d + i * ds) = v;                       \
      }                                                                                \
    } else if (ds == (int64_t)sizeof(DT) && ss == (int64_t)sizeof(ST)) {               \
      DT *dp = (DT *)d;                                                                \
      const ST *sp = (const ST *)s;                                                    \
      for (int64_t i = 0; i < n; i++) dp[i] = STORE_##DN(LOAD_##SN(sp[i]));            \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++)                                                  \
        *(DT *)(d + i * ds) = STORE_##DN(LOAD_##SN(*(const ST *)(s + i * ss)));        \
    }                                                                                  \
  }

/* Both lists follow dlua_dtype_t's order, so the table below is indexed [src * COUNT + dst]. */
#define FOR_DST(X, SN, ST) \
  X(SN, ST, f32, float) X(SN, ST, f64, double) X(SN, ST, f16, uint16_t) X(SN, ST, bf16, uint16_t) \
  X(SN, ST, i32, int32_t) X(SN, ST, i64, int64_t) X(SN, ST, u8, uint8_t) X(SN, ST, b8, uint8_t)
#define FOR_SRC(X) \
  FOR_DST(X, f32, float) FOR_DST(X, f64, double) FOR_DST(X, f16, uint16_t) FOR_DST(X, bf16, uint16_t) \
  FOR_DST(X, i32, int32_t) FOR_DST(X, i64, int64_t) FOR_DST(X, u8, uint8_t) FOR_DST(X, b8, uint8_t)

FOR_SRC(CVT_FN)

#define CVT_ENTRY(SN, ST, DN, DT) cvt_##SN##_##DN,
static const cvt_fn cvt_table[DLUA_DTYPE_COUNT * DLUA_DTYPE_COUNT] = {FOR_SRC(CVT_ENTRY)};

/* Same dtype: move the bits (f16 -> f32 -> f16 would quiet signalling NaNs). */
#define RAW_FN(NAME, T)                                                                 \
  static void NAME(char *d, int64_t ds, const char *s, int64_t ss, int64_t n) {        \
    if (ss == 0) {                                                                      \
      const T v = *(const T *)s;                                                        \
      for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = v;                           \
    } else if (ds == (int64_t)sizeof(T) && ss == (int64_t)sizeof(T)) {                  \
      memcpy(d, s, (size_t)n * sizeof(T));                                              \
    } else {                                                                            \
      for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = *(const T *)(s + i * ss);    \
    }                                                                                   \
  }
RAW_FN(raw_copy1, uint8_t)
RAW_FN(raw_copy2, uint16_t)
RAW_FN(raw_copy4, uint32_t)
RAW_FN(raw_copy8, uint64_t)

static cvt_fn converter(dlua_dtype_t src, dlua_dtype_t dst) {
  if (src == dst && src != DLUA_DTYPE_BOOL) {  // bool goes through != 0 so stray bytes become 1
    switch (dlua_dtype_size(src)) {
      case 1: return raw_copy1;
      case 2: return raw_copy2;
      case 4: return raw_copy4;
      default: return raw_copy8;
    }
  }
  return cvt_table[src * DLUA_DTYPE_COUNT + dst];
}

void dlua_convert(void *dst, dlua_dtype_t dst_dtype, const void *src, dlua_dtype_t src_dtype, int64_t n) {
  converter(src_dtype, dst_dtype)((char *)dst, (int64_t)dlua_dtype_size(dst_dtype), (const char *)src,
                                  (int64_t)dlua_dtype_size(src_dtype), n);
}

/* ---- strided two-operand loop ------------------------------------------------------------- */

/* A shape with byte steps for dst and src, size-1 dims dropped and mergeable dims merged so
   the inner loop is as long as the layouts allow. */
typedef struct {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t dstep[DLUA_MAX_DIMS];
  int64_t sstep[DLUA_MAX_DIMS];
} iter2_t;

static void iter2_build(iter2_t *it, int ndim, const int64_t *sizes, const int64_t *dstep, const int64_t *sstep) {
  int n = 0;
  for (int d = 0; d < ndim; d++) {
    if (sizes[d] == 1) continue;
    if (n > 0 && it->dstep[n - 1] == dstep[d] * sizes[d] && it->sstep[n - 1] == sstep[d] * sizes[d]) {
      it->sizes[n - 1] *= sizes[d];
      it->dstep[n - 1] = dstep[d];
      it->sstep[n - 1] = sstep[d];
      continue;
    }
    it->sizes[n] = sizes[d];
    it->dstep[n] = dstep[d];
    it->sstep[n] = sstep[d];
    n++;
  }
  if (n == 0) {
    it->sizes[0] = 1;
    it->dstep[0] = 0;
    it->sstep[0] = 0;
    n = 1;
  }
  it->ndim = n;
}

enum { ITER_CHUNK = 1 << 16 };  // elements per parallel work item

/* Runs fn over the elements [lo, hi) in row-major order of it's shape. */
static void iter2_range(const iter2_t *it, char *dst, const char *src, cvt_fn fn, int64_t lo, int64_t hi) {
  int n = it->ndim;
  int64_t idx[DLUA_MAX_DIMS];
  int64_t rem = lo;
  char *d = dst;
  const char *s = src;
  for (int k = n - 1; k >= 0; k--) {
    idx[k] = rem % it->sizes[k];
    rem /= it->sizes[k];
    d += idx[k] * it->dstep[k];
    s += idx[k] * it->sstep[k];
  }
  int64_t pos = lo;
  const int64_t inner = it->sizes[n - 1];
  while (pos < hi) {
    int64_t len = inner - idx[n - 1];
    if (len > hi - pos) len = hi - pos;
    fn(d, it->dstep[n - 1], s, it->sstep[n - 1], len);
    pos += len;
    d += len * it->dstep[n - 1];
    s += len * it->sstep[n - 1];
    idx[n - 1] += len;
    // Carry into the outer dims, rewinding each finished dim.
    for (int k = n - 1; k > 0 && idx[k] == it->sizes[k]; k--) {
      d -= it->sizes[k] * it->dstep[k];
      s -= it->sizes[k] * it->sstep[k];
      idx[k] = 0;
      idx[k - 1]++;
      d += it->dstep[k - 1];
      s += it->sstep[k - 1];
    }
  }
}

enum { TILE = 32 };

/* Transpose-like layouts (dst contiguous along the last dim, src along the one before):
   row-by-row copying would touch a new src cache line per element, so go through
   TILE x TILE tiles whose src lines stay in L1 while a tile's rows are written. */
static int iter2_wants_tiles(const iter2_t *it, int64_t des, int64_t ses) {
  int n = it->ndim;
  return n >= 2 && it->dstep[n - 1] == des && it->sstep[n - 2] == ses && it->sstep[n - 1] != ses &&
         it->sizes[n - 1] >= TILE && it->sizes[n - 2] >= TILE;
}

static void iter2_run_tiled(const iter2_t *it, char *dst, const char *src, cvt_fn fn) {
  const int n = it->ndim;
  const int64_t rows = it->sizes[n - 2], cols = it->sizes[n - 1];
  const int64_t trows = (rows + TILE - 1) / TILE, tcols = (cols + TILE - 1) / TILE;
  int64_t outer = 1;
  for (int k = 0; k < n - 2; k++) outer *= it->sizes[k];
  const int64_t items = outer * trows * tcols;
#pragma omp parallel for schedule(static) if (items > 4)
  for (int64_t w = 0; w < items; w++) {
    int64_t tc = w % tcols, tr = (w / tcols) % trows, o = w / (tcols * trows);
    char *d = dst;
    const char *s = src;
    for (int k = n - 3; k >= 0; k--) {
      int64_t ik = o % it->sizes[k];
      o /= it->sizes[k];
      d += ik * it->dstep[k];
      s += ik * it->sstep[k];
    }
    int64_t r0 = tr * TILE, r1 = r0 + TILE < rows ? r0 + TILE : rows;
    int64_t c0 = tc * TILE, len = c0 + TILE < cols ? TILE : cols - c0;
    for (int64_t r = r0; r < r1; r++)
      fn(d + r * it->dstep[n - 2] + c0 * it->dstep[n - 1], it->dstep[n - 1],
         s + r * it->sstep[n - 2] + c0 * it->sstep[n - 1], it->sstep[n - 1], len);
  }
}

static void iter2_run(const iter2_t *it, char *dst, const char *src, cvt_fn fn) {
  int64_t total = 1;
  for (int k = 0; k < it->ndim; k++) total *= it->sizes[k];
  if (total == 0) return;
  int64_t nchunks = (total + ITER_CHUNK - 1) / ITER_CHUNK;
  if (nchunks == 1) {
    iter2_range(it, dst, src, fn, 0, total);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t lo = c * ITER_CHUNK, hi = lo + ITER_CHUNK < total ? lo + ITER_CHUNK : total;
    iter2_range(it, dst, src, fn, lo, hi);
  }
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

/* dst <- src with src already broadcast to dst's shape (src_strides in src elements). */
static void copy_strided(dlua_tensor_t *dst, const void *src_ptr, dlua_dtype_t src_dtype, const int64_t *src_strides) {
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
    for (int e = d + 1; e < dst->ndim; e++)
      if (sizes[d] > 1 && sizes[e] > 1 && (dstep[d] < dstep[e]) != (sstep[d] < sstep[e])) alike = 0;
  if (alike)
    for (int d = 1; d < dst->ndim; d++)  // insertion sort, largest dst step first
      for (int e = d; e > 0 && dstep[e - 1] < dstep[e]; e--) {
        int64_t t0 = sizes[e], t1 = dstep[e], t2 = sstep[e];
        sizes[e] = sizes[e - 1], dstep[e] = dstep[e - 1], sstep[e] = sstep[e - 1];
        sizes[e - 1] = t0, dstep[e - 1] = t1, sstep[e - 1] = t2;
      }
  iter2_t it;
  iter2_build(&it, dst->ndim, sizes, dstep, sstep);
  if (iter2_wants_tiles(&it, des, ses))
    iter2_run_tiled(&it, dlua_tensor_ptr(dst), src_ptr, converter(src_dtype, dst->dtype));
  else
    iter2_run(&it, dlua_tensor_ptr(dst), src_ptr, converter(src_dtype, dst->dtype));
}

/* The same on a CUDA device, for dst (its device) and src there: one launch of the copy kernel over the
   merged layout. `bits`: fill with the dtype bits in *src_ptr instead (src_strides all 0, src_dtype = dst's). */
static dlua_status_t cuda_copy_strided(const char *op, dlua_tensor_t *dst, const void *src_ptr, dlua_dtype_t src_dtype,
                                       const int64_t *src_strides, int bits) {
#ifdef DLUA_HAVE_CUDA
  int64_t dstep[DLUA_MAX_DIMS], sstep[DLUA_MAX_DIMS];
  int64_t des = (int64_t)dlua_dtype_size(dst->dtype), ses = (int64_t)dlua_dtype_size(src_dtype);
  for (int d = 0; d < dst->ndim; d++) {
    dstep[d] = dst->strides[d] * des;
    sstep[d] = src_strides[d] * ses;
  }
  iter2_t it;
  iter2_build(&it, dst->ndim, dst->sizes, dstep, sstep);
  dlua_cuda_ew_t e;
  memset(&e, 0, sizeof e);
  e.family = bits ? DLUA_CUDA_EW_FILL : DLUA_CUDA_EW_COPY;
  e.dtype = (int)dst->dtype;
  e.src_dtype = (int)src_dtype;
  e.elsize = (int)des;
  e.nops = bits ? 1 : 2;
  e.ndim = it.ndim;
  e.numel = dlua_tensor_numel(dst);
  for (int d = 0; d < it.ndim; d++) {
    e.sizes[d] = it.sizes[d];
    e.strides[0][d] = it.dstep[d];
    e.strides[1][d] = it.sstep[d];
  }
  e.base[0] = dlua_tensor_ptr(dst);
  if (bits) memcpy(&e.i[0], src_ptr, (size_t)des);  // little-endian: the low bytes are the element
  else e.base[1] = (char *)src_ptr;
  e.device = dst->device;
  return dlua_cuda_ew_run(op, &e);
#else
  return dlua_require_cpu(op, dst);
#endif
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
  const int on_cuda = dst->device != DLUA_CPU;
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

  // Fast path: same dtype, same shape, both contiguous.
  int same_shape = dst->ndim == src->ndim && !memcmp(dst->sizes, src->sizes, (size_t)dst->ndim * sizeof(int64_t));
  if (!on_cuda && same_shape && dst->dtype == src->dtype && dlua_tensor_is_contiguous(dst) &&
      dlua_tensor_is_contiguous(src)) {
    char *d = dlua_tensor_ptr(dst);
    const char *s = dlua_tensor_ptr(src);
    if (d == s) return DLUA_OK;
    size_t n = (size_t)dlua_tensor_numel(dst) * dlua_dtype_size(dst->dtype);
    if (dst->storage == src->storage) {
      memmove(d, s, n);
      return DLUA_OK;
    }
    if (n >= ((size_t)1 << 22)) {
      const size_t chunk = (size_t)1 << 20;
      int64_t nchunks = (int64_t)((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < nchunks; c++) {
        size_t lo = (size_t)c * chunk, len = lo + chunk < n ? chunk : n - lo;
        memcpy(d + lo, s + lo, len);
      }
    } else {
      memcpy(d, s, n);
    }
    return DLUA_OK;
  }

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
  if (on_cuda) return cuda_copy_strided("copy_", dst, dlua_tensor_ptr(src), src->dtype, sstrides, 0);
  copy_strided(dst, dlua_tensor_ptr(src), src->dtype, sstrides);
  return DLUA_OK;
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
  if (t->device != DLUA_CPU) {
    // Contiguous on the device, then one copy on its current stream (ordered after the kernels that wrote t).
    dlua_tensor_t *c = NULL;
    DLUA_TRY(dlua_tensor_contiguous(&c, t));
    dlua_cuda_stream_t *st = dlua_cuda_current_stream(t->device);
    dlua_status_t s = st ? dlua_cuda_memcpy(dst, dlua_tensor_ptr(c), need, 1, 1, st)
                         : DLUA_ERR(DLUA_ERR_BACKEND, "to_data: no stream for cuda:%d", t->device);
    if (s == DLUA_OK) s = dlua_cuda_stream_synchronize(st);
    dlua_tensor_free(c);
    return s;
  }
  if (dlua_tensor_is_contiguous(t)) {
    memcpy(dst, dlua_tensor_ptr(t), need);
    return DLUA_OK;
  }
  dlua_tensor_t *view = NULL;
  DLUA_TRY(dlua_tensor_wrap(&view, t->ndim, t->sizes, NULL, t->dtype, dst, NULL, NULL));
  dlua_status_t s = dlua_tensor_copy_(view, t);
  dlua_tensor_free(view);
  return s;
}

dlua_status_t dlua_tensor_fill_(dlua_tensor_t *t, double value) {
  int64_t zero[DLUA_MAX_DIMS] = {0};
  if (t && t->storage && t->device != DLUA_CPU) {
    if (dlua_tensor_numel(t) == 0) return DLUA_OK;
    uint64_t bits = 0;  // the value in t's dtype, converted here exactly as the CPU path converts it
    dlua_convert(&bits, t->dtype, &value, DLUA_DTYPE_F64, 1);
    return cuda_copy_strided("fill_", t, &bits, t->dtype, zero, 1);
  }
  DLUA_TRY(dlua_require_cpu("fill_", t));
  // Through the f64 -> dtype converter, so a fill rounds exactly as a copy from f64 would.
  copy_strided(t, &value, DLUA_DTYPE_F64, zero);
  return DLUA_OK;
}

/* Writes v(i) for i in [0, n) into contiguous t, converting from double in blocks. */
typedef double (*seq_fn)(int64_t i, const double *params);
static void fill_sequence(dlua_tensor_t *t, int64_t n, seq_fn f, const double *params) {
  enum { BLOCK = 256 };
  cvt_fn cvt = converter(DLUA_DTYPE_F64, t->dtype);
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

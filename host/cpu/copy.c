/* The CPU backend's copy kernels (the copy and download slots of kernels/ew.h): copy_ and fill_ over the merged
   two-operand layout that host/ops/copy.c builds, through core/copy.c's converters, split across threads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "core/api.h"
#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu/copy.h"
#include "kernels/ew.h"

typedef dlua_convert_fn cvt_fn;

/* ---- strided two-operand loop ------------------------------------------------------------- */

/* A shape with byte steps for dst and src (size-1 dims dropped and mergeable dims merged by the front door). */
typedef struct {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t dstep[DLUA_MAX_DIMS];
  int64_t sstep[DLUA_MAX_DIMS];
} iter2_t;

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


/* e: family DLUA_EW_COPY (dtype <- src_dtype; mode 1: same dtype and shape, both contiguous, no overlap: the bytes
   move as they are) or DLUA_EW_FILL (the dtype's bits in i[0]). */
dlua_status_t dlua_cpu_ew_copy(const char *op, const dlua_ew_desc_t *e) {
  if (e->numel == 0) return DLUA_OK;
  if (e->family == DLUA_EW_COPY && e->mode == 1) {
    char *d = e->base[0];
    const char *s = e->base[1];
    if (d == s) return DLUA_OK;
    size_t n = (size_t)e->numel * dlua_dtype_size((dlua_dtype_t)e->dtype);
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
  if (e->family != DLUA_EW_COPY && e->family != DLUA_EW_FILL)
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: the copy slot got element-wise family %d", op, e->family);
  const int fill = e->family == DLUA_EW_FILL;
  iter2_t it;
  it.ndim = e->ndim;
  for (int d = 0; d < e->ndim; d++) {
    it.sizes[d] = e->sizes[d];
    it.dstep[d] = e->strides[0][d];
    it.sstep[d] = fill ? 0 : e->strides[1][d];
  }
  const dlua_dtype_t sdt = (dlua_dtype_t)(fill ? e->dtype : e->src_dtype);
  const char *src = fill ? (const char *)&e->i[0] : e->base[1];  // little-endian: the low bytes are the element
  cvt_fn fn = dlua_converter(sdt, (dlua_dtype_t)e->dtype);
  if (iter2_wants_tiles(&it, (int64_t)dlua_dtype_size((dlua_dtype_t)e->dtype), (int64_t)dlua_dtype_size(sdt)))
    iter2_run_tiled(&it, e->base[0], src, fn);
  else
    iter2_run(&it, e->base[0], src, fn);
  return DLUA_OK;
}

dlua_status_t dlua_cpu_ew_download(const char *op, void *dst, const void *src, size_t bytes, int device) {
  (void)op;
  (void)device;
  if (bytes) memcpy(dst, src, bytes);
  return DLUA_OK;
}

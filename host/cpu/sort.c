/* The CPU sort and top-k kernels (the sort and topk slots of the index family, host/kernels/index.h): radix sort
   and radix selection on order-preserving integer keys (host/kernels/sort_keys.h, shared with the CUDA backend's sort.cu).
   The front doors are host/ops/sort.c. */
#include <inttypes.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "core/error.h"
#include "core/tensor.h"
#include "cpu/index.h"
#include "kernels/sort_keys.h"

/* ---- keys (host/kernels/sort_keys.h): read an element's bits, map them ------------------------- */

static inline uint64_t key_f32v(const char *p) {
  uint32_t u;
  memcpy(&u, p, 4);
  return dlua_sortkey_f32v(u);
}
static inline uint64_t key_f32m(const char *p) {
  uint32_t u;
  memcpy(&u, p, 4);
  return dlua_sortkey_f32m(u);
}
static inline uint64_t key_f64v(const char *p) {
  uint64_t u;
  memcpy(&u, p, 8);
  return dlua_sortkey_f64v(u);
}
static inline uint64_t key_f64m(const char *p) {
  uint64_t u;
  memcpy(&u, p, 8);
  return dlua_sortkey_f64m(u);
}
static inline uint64_t key_f16v(const char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return dlua_sortkey_half(h, 0x7c00u, 0);
}
static inline uint64_t key_f16m(const char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return dlua_sortkey_half(h, 0x7c00u, 1);
}
static inline uint64_t key_bf16v(const char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return dlua_sortkey_half(h, 0x7f80u, 0);
}
static inline uint64_t key_bf16m(const char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return dlua_sortkey_half(h, 0x7f80u, 1);
}
static inline uint64_t key_i32v(const char *p) {
  uint32_t u;
  memcpy(&u, p, 4);
  return dlua_sortkey_i32v(u);
}
static inline uint64_t key_i32m(const char *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return dlua_sortkey_i32m(v);
}
static inline uint64_t key_i64v(const char *p) {
  uint64_t u;
  memcpy(&u, p, 8);
  return dlua_sortkey_i64v(u);
}
static inline uint64_t key_i64m(const char *p) {
  int64_t v;
  memcpy(&v, p, 8);
  return dlua_sortkey_i64m(v);
}
static inline uint64_t key_u8(const char *p) { return (uint8_t)*p; }

/* Per key kind, the three loops that read the data, specialised so the key is inlined:
   hist: histogram of digit (key >> shift) & dmask over elements whose key matches
         `prefix` under `pmask`, for positions [lo, hi) of a row with byte stride st;
   collect: positions in [lo, hi) with key > t, then the first `ties` with key == t;
   keys: the keys of n elements. `flip` is XORed into every key. */
#define DEFINE_ROW_KERNELS(KF)                                                                     \
  static void hist_##KF(const char *p, int64_t st, int64_t lo, int64_t hi, uint64_t flip,         \
                        uint64_t pmask, uint64_t prefix, int shift, uint64_t dmask, uint32_t *h) { \
    for (int64_t i = lo; i < hi; i++) {                                                            \
      uint64_t k = KF(p + i * st) ^ flip;                                                          \
      if ((k & pmask) == prefix) h[(k >> shift) & dmask]++;                                        \
    }                                                                                              \
  }                                                                                                \
  static int64_t collect_##KF(const char *p, int64_t st, int64_t lo, int64_t hi, uint64_t flip,   \
                              uint64_t t, int64_t ties, int64_t *pos) {                           \
    int64_t m = 0;                                                                                 \
    for (int64_t i = lo; i < hi; i++) {                                                            \
      uint64_t k = KF(p + i * st) ^ flip;                                                          \
      if (k > t || (k == t && ties > 0)) {                                                         \
        ties -= k == t;                                                                            \
        pos[m++] = i;                                                                              \
      }                                                                                            \
    }                                                                                              \
    return m;                                                                                      \
  }                                                                                                \
  static void keys_##KF(const char *p, int64_t st, const int64_t *at, int64_t n, uint64_t flip,   \
                        uint64_t *keys) {                                                          \
    for (int64_t i = 0; i < n; i++) keys[i] = KF(p + (at ? at[i] : i) * st) ^ flip;                \
  }

DEFINE_ROW_KERNELS(key_f32v)
DEFINE_ROW_KERNELS(key_f32m)
DEFINE_ROW_KERNELS(key_f64v)
DEFINE_ROW_KERNELS(key_f64m)
DEFINE_ROW_KERNELS(key_f16v)
DEFINE_ROW_KERNELS(key_f16m)
DEFINE_ROW_KERNELS(key_bf16v)
DEFINE_ROW_KERNELS(key_bf16m)
DEFINE_ROW_KERNELS(key_i32v)
DEFINE_ROW_KERNELS(key_i32m)
DEFINE_ROW_KERNELS(key_i64v)
DEFINE_ROW_KERNELS(key_i64m)
DEFINE_ROW_KERNELS(key_u8)

typedef struct {
  int bits;  // key width: 8, 16, 32 or 64
  void (*hist)(const char *, int64_t, int64_t, int64_t, uint64_t, uint64_t, uint64_t, int, uint64_t, uint32_t *);
  int64_t (*collect)(const char *, int64_t, int64_t, int64_t, uint64_t, uint64_t, int64_t, int64_t *);
  void (*keys)(const char *, int64_t, const int64_t *, int64_t, uint64_t, uint64_t *);
} key_kind_t;

#define KIND(BITS, KF) {BITS, hist_##KF, collect_##KF, keys_##KF}

static key_kind_t key_kind(dlua_dtype_t dtype, int magnitude) {
  static const key_kind_t value[DLUA_DTYPE_COUNT] = {
      [DLUA_DTYPE_F32] = KIND(32, key_f32v), [DLUA_DTYPE_F64] = KIND(64, key_f64v),
      [DLUA_DTYPE_F16] = KIND(16, key_f16v), [DLUA_DTYPE_BF16] = KIND(16, key_bf16v),
      [DLUA_DTYPE_I32] = KIND(32, key_i32v), [DLUA_DTYPE_I64] = KIND(64, key_i64v),
      [DLUA_DTYPE_U8] = KIND(8, key_u8),     [DLUA_DTYPE_BOOL] = KIND(8, key_u8)};
  static const key_kind_t mag[DLUA_DTYPE_COUNT] = {
      [DLUA_DTYPE_F32] = KIND(32, key_f32m), [DLUA_DTYPE_F64] = KIND(64, key_f64m),
      [DLUA_DTYPE_F16] = KIND(16, key_f16m), [DLUA_DTYPE_BF16] = KIND(16, key_bf16m),
      [DLUA_DTYPE_I32] = KIND(32, key_i32m), [DLUA_DTYPE_I64] = KIND(64, key_i64m),
      [DLUA_DTYPE_U8] = KIND(8, key_u8),     [DLUA_DTYPE_BOOL] = KIND(8, key_u8)};
  return magnitude ? mag[dtype] : value[dtype];
}

static inline uint64_t width_mask(int bits) { return bits == 64 ? ~0ull : (1ull << bits) - 1; }

/* ---- stable radix sort of (key, position) pairs --------------------------------------------- */

/* Sorts keys ascending, carrying pos; equal keys keep their input order. tk/tp are scratch
   of n entries; the result lands back in keys/pos. */
static void radix_sort(uint64_t *keys, int64_t *pos, uint64_t *tk, int64_t *tp, int64_t n, int bits) {
  if (n <= 32) {  // insertion sort: stable, and cheaper than 8 histograms for short rows
    for (int64_t i = 1; i < n; i++) {
      uint64_t k = keys[i];
      int64_t p = pos[i], j = i - 1;
      for (; j >= 0 && keys[j] > k; j--) {
        keys[j + 1] = keys[j];
        pos[j + 1] = pos[j];
      }
      keys[j + 1] = k;
      pos[j + 1] = p;
    }
    return;
  }
  int passes = bits / 8;
  int64_t cnt[8][256];
  memset(cnt, 0, sizeof(int64_t) * 256 * (size_t)passes);
  for (int64_t i = 0; i < n; i++)
    for (int d = 0; d < passes; d++) cnt[d][(keys[i] >> (8 * d)) & 255]++;
  uint64_t *sk = keys, *dk = tk;
  int64_t *sp = pos, *dp = tp;
  for (int d = 0; d < passes; d++) {
    int trivial = 0;  // every key has the same digit here: the pass would not move anything
    for (int b = 0; b < 256 && !trivial; b++) trivial = cnt[d][b] == n;
    if (trivial) continue;
    int64_t off[256], s = 0;
    for (int b = 0; b < 256; b++) {
      off[b] = s;
      s += cnt[d][b];
    }
    for (int64_t i = 0; i < n; i++) {
      int64_t o = off[(sk[i] >> (8 * d)) & 255]++;
      dk[o] = sk[i];
      dp[o] = sp[i];
    }
    uint64_t *t1 = sk;
    sk = dk;
    dk = t1;
    int64_t *t2 = sp;
    sp = dp;
    dp = t2;
  }
  if (sk != keys) {
    memcpy(keys, sk, sizeof *keys * (size_t)n);
    memcpy(pos, sp, sizeof *pos * (size_t)n);
  }
}

/* ---- rows ----------------------------------------------------------------------------------- */

/* How an op walks its rows: row r = (o, i) over the dims before and after `dim`. */
typedef struct {
  int dim, nd;
  int64_t n;           // row length: a's size at dim
  int64_t outer, inner;
  const int64_t *sizes, *strides;
  const char *base;
  size_t es;
} rows_t;

static const char *row_ptr(const rows_t *rw, int64_t r) {
  int64_t o = r / rw->inner, i = r - o * rw->inner;
  int64_t off = dlua_unravel(rw->dim, rw->sizes, rw->strides, o) +
                dlua_unravel(rw->nd - rw->dim - 1, rw->sizes + rw->dim + 1, rw->strides + rw->dim + 1, i);
  return rw->base + off * (int64_t)rw->es;
}

/* Writes row r's output: len elements picked from the row at positions pos, into contiguous
   (outer, len, inner) value and int64 index buffers (either may be NULL). */
static void write_row(const rows_t *rw, int64_t r, const char *row, int64_t st, const int64_t *pos, int64_t len,
                      char *vals, int64_t *idx, int64_t base) {
  int64_t o = r / rw->inner, i = r - o * rw->inner;
  int64_t first = o * len * rw->inner + i;
  size_t es = rw->es;
  for (int64_t j = 0; j < len; j++) {
    int64_t e = first + j * rw->inner;
    if (vals) memcpy(vals + (size_t)e * es, row + pos[j] * st, es);
    if (idx) idx[e] = pos[j] + base;
  }
}

/* ---- top-k selection -------------------------------------------------------------------------
   Radix selection: histogram the key's top digit, find the digit value where the running
   count from the top reaches k, and repeat on the next digit among elements sharing that
   prefix. The end result is the exact k-th key t and how many elements equal to t to take
   (the lowest positions first), so the selected set does not depend on how the row was
   split among threads. A last pass writes the positions out in increasing order. */

/* Chunks of a long row hold at least TOPK_CHUNK elements (so a histogram per chunk is cheap
   next to reading it) and number at most the threads, capped. */
enum { TOPK_CHUNK = 1 << 16, TOPK_MAX_CHUNKS = 64 };

typedef struct {
  uint32_t *hist;   // (nchunks, 1 << digit bits)
  int64_t *above;   // (nchunks): elements known to be > t
  int64_t *equal;   // (nchunks): elements == t (after the last level)
} topk_scratch_t;

static void topk_row(const key_kind_t *kk, const char *p, int64_t st, int64_t n, int64_t k, uint64_t flip,
                     int nchunks, topk_scratch_t *sc, int64_t *pos) {
  if (k >= n) {
    for (int64_t i = 0; i < n; i++) pos[i] = i;
    return;
  }
  if (k == 0) return;
  int dbits = kk->bits >= 16 && n > 4096 ? 16 : 8;
  uint64_t dmask = (1ull << dbits) - 1;
  size_t nb = (size_t)1 << dbits;
  int64_t clen = (n + nchunks - 1) / nchunks;
  uint64_t prefix = 0, pmask = 0;
  int64_t need = k;
  for (int c = 0; c < nchunks; c++) sc->above[c] = 0;
  for (int shift = kk->bits - dbits; shift >= 0; shift -= dbits) {
#pragma omp parallel for schedule(static) if (nchunks > 1)
    for (int c = 0; c < nchunks; c++) {
      uint32_t *h = sc->hist + (size_t)c * nb;
      memset(h, 0, nb * sizeof *h);
      int64_t lo = c * clen, hi = lo + clen < n ? lo + clen : n;
      kk->hist(p, st, lo, hi, flip, pmask, prefix, shift, dmask, h);
    }
    // Digit value b where the count of larger digits is < need <= that count plus b's.
    int64_t cum = 0, b = (int64_t)nb - 1;
    for (; b > 0; b--) {
      int64_t cb = 0;
      for (int c = 0; c < nchunks; c++) cb += sc->hist[(size_t)c * nb + (size_t)b];
      if (cum + cb >= need) break;
      cum += cb;
    }
    for (int c = 0; c < nchunks; c++) {
      int64_t a = 0;
      for (size_t d = (size_t)b + 1; d < nb; d++) a += sc->hist[(size_t)c * nb + d];
      sc->above[c] += a;
      sc->equal[c] = sc->hist[(size_t)c * nb + (size_t)b];
    }
    need -= cum;
    prefix |= (uint64_t)b << shift;
    pmask |= dmask << shift;
  }
  // `need` elements equal to the threshold remain to take: the first ones, chunk by chunk.
  int64_t off[TOPK_MAX_CHUNKS], ties[TOPK_MAX_CHUNKS];
  int64_t at = 0;
  for (int c = 0; c < nchunks; c++) {
    ties[c] = need < sc->equal[c] ? need : sc->equal[c];
    need -= ties[c];
    off[c] = at;
    at += sc->above[c] + ties[c];
  }
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int c = 0; c < nchunks; c++) {
    int64_t lo = c * clen, hi = lo + clen < n ? lo + clen : n;
    kk->collect(p, st, lo, hi, flip, prefix, ties[c], pos + off[c]);
  }
}

static dlua_status_t oom(const char *op, size_t bytes) {
  return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes of scratch", op, bytes);
}

/* Sets up the walk over the rows of s->a along s->dim (s->lay: 0-d tensors already act as (1)). */
static void rows_init(rows_t *rw, const dlua_sort_t *s) {
  rw->dim = s->dim;
  rw->nd = s->lay.ndim;
  rw->n = s->lay.sizes[s->dim];
  rw->outer = dlua_shape_numel(s->dim, s->lay.sizes);
  rw->inner = dlua_shape_numel(rw->nd - s->dim - 1, s->lay.sizes + s->dim + 1);
  rw->sizes = s->lay.sizes;
  rw->strides = s->lay.strides;
  rw->base = s->a;
  rw->es = dlua_dtype_size((dlua_dtype_t)s->dtype);
}

/* The topk slot: the k = s->len largest (or smallest) of every row. */
dlua_status_t dlua_cpu_topk(const char *op, const dlua_sort_t *s) {
  rows_t rw;
  rows_init(&rw, s);
  const int64_t k = s->len, index_base = s->index_base;
  const int largest = s->descending_or_largest, sorted = s->sorted;
  const int64_t *strides = rw.strides;
  const int dim = rw.dim;
  char *vals = s->values;
  int64_t *idx = s->indices;
  key_kind_t kk = key_kind((dlua_dtype_t)s->dtype, s->by_magnitude);
  uint64_t mask = width_mask(kk.bits);
  uint64_t flip = largest ? 0 : mask;
  int64_t rows = rw.outer * rw.inner, n = rw.n;
  int64_t st = strides[dim] * (int64_t)rw.es;
  int threads = omp_get_max_threads();
  // Many rows: one row per thread at a time. Few long rows: each row split into chunks
  // that the threads share (the chunk count depends on the length only).
  int per_row = rows >= threads || n <= 2 * TOPK_CHUNK;
  int64_t want = per_row ? 1 : (n + TOPK_CHUNK - 1) / TOPK_CHUNK;
  int nchunks = (int)(want < threads ? want : threads);
  if (nchunks > TOPK_MAX_CHUNKS) nchunks = TOPK_MAX_CHUNKS;
  size_t nb = (size_t)1 << (kk.bits >= 16 && n > 4096 ? 16 : 8);
  dlua_status_t status = DLUA_OK;
  if (rows > 0 && k > 0) {
    int nscratch = per_row ? threads : 1;
    size_t per = (size_t)nchunks * (nb * sizeof(uint32_t) + 2 * sizeof(int64_t)) +
                 (size_t)k * (sizeof(int64_t) * 3 + sizeof(uint64_t) * 2);
    char *mem = malloc(per * (size_t)nscratch);
    if (!mem) {
      status = oom(op, per * (size_t)nscratch);
    } else {
#pragma omp parallel for schedule(static) if (per_row && rows > 1)
      for (int64_t r = 0; r < rows; r++) {
        char *m = mem + per * (size_t)(per_row ? omp_get_thread_num() : 0);
        topk_scratch_t sc;
        sc.hist = (uint32_t *)m;
        sc.above = (int64_t *)(m + (size_t)nchunks * nb * sizeof(uint32_t));
        sc.equal = sc.above + nchunks;
        int64_t *pos = sc.equal + nchunks, *tpos = pos + k;
        uint64_t *keys = (uint64_t *)(tpos + k), *tkeys = keys + k;
        const char *row = row_ptr(&rw, r);
        topk_row(&kk, row, st, n, k, flip, nchunks, &sc, pos);
        if (sorted && k > 1) {
          // Largest first; ties stay in increasing position (pos is in that order now).
          kk.keys(row, st, pos, k, flip ^ mask, keys);
          radix_sort(keys, pos, tkeys, tpos, k, kk.bits);
        }
        write_row(&rw, r, row, st, pos, k, vals, idx, index_base);
      }
      free(mem);
    }
  }
  return status;
}

/* Gradient compression (host/cpu/compress.c): the positions, in increasing order, of the k largest |x| of n
   contiguous f32 (NaN counts as the largest; ties go to the lowest positions). */
dlua_status_t dlua_cpu_topk_abs_f32(const float *x, int64_t n, int64_t k, int64_t *pos) {
  if (k >= n) {
    for (int64_t i = 0; i < n; i++) pos[i] = i;
    return DLUA_OK;
  }
  if (k <= 0) return DLUA_OK;
  key_kind_t kk = key_kind(DLUA_DTYPE_F32, 1);
  int threads = omp_get_max_threads();
  int64_t want = n <= 2 * TOPK_CHUNK ? 1 : (n + TOPK_CHUNK - 1) / TOPK_CHUNK;
  int nchunks = (int)(want < threads ? want : threads);
  if (nchunks > TOPK_MAX_CHUNKS) nchunks = TOPK_MAX_CHUNKS;
  size_t nb = (size_t)1 << (n > 4096 ? 16 : 8);
  size_t bytes = (size_t)nchunks * (nb * sizeof(uint32_t) + 2 * sizeof(int64_t));
  char *mem = malloc(bytes);
  if (!mem) return oom("topk compression", bytes);
  topk_scratch_t sc;
  sc.hist = (uint32_t *)mem;
  sc.above = (int64_t *)(mem + (size_t)nchunks * nb * sizeof(uint32_t));
  sc.equal = sc.above + nchunks;
  topk_row(&kk, (const char *)x, 4, n, k, 0, nchunks, &sc, pos);
  free(mem);
  return DLUA_OK;
}

/* The sort slot: every row, stable, ascending or (s->descending_or_largest) descending. */
dlua_status_t dlua_cpu_sort(const char *op, const dlua_sort_t *s) {
  rows_t rw;
  rows_init(&rw, s);
  const int descending = s->descending_or_largest;
  const int64_t index_base = s->index_base;
  const int64_t *strides = rw.strides;
  const int dim = rw.dim;
  char *vals = s->values;
  int64_t *idx = s->indices;
  key_kind_t kk = key_kind((dlua_dtype_t)s->dtype, 0);
  uint64_t flip = descending ? width_mask(kk.bits) : 0;
  int64_t rows = rw.outer * rw.inner, n = rw.n;
  int64_t st = strides[dim] * (int64_t)rw.es;
  int threads = omp_get_max_threads();
  dlua_status_t status = DLUA_OK;
  if (rows > 0 && n > 0) {
    size_t per = (size_t)n * 2 * (sizeof(uint64_t) + sizeof(int64_t));
    int nscratch = rows < threads ? (int)rows : threads;
    char *mem = malloc(per * (size_t)nscratch);
    if (!mem) {
      status = oom(op, per * (size_t)nscratch);
    } else {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n > 4096)
      for (int64_t r = 0; r < rows; r++) {
        char *m = mem + per * (size_t)omp_get_thread_num();
        uint64_t *keys = (uint64_t *)m, *tkeys = keys + n;
        int64_t *pos = (int64_t *)(tkeys + n), *tpos = pos + n;
        const char *row = row_ptr(&rw, r);
        kk.keys(row, st, NULL, n, flip, keys);
        for (int64_t i = 0; i < n; i++) pos[i] = i;
        radix_sort(keys, pos, tkeys, tpos, n, kk.bits);
        write_row(&rw, r, row, st, pos, n, vals, idx, index_base);
      }
      free(mem);
    }
  }
  return status;
}

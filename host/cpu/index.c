/* The CPU kernels of the index family (host/kernels/index.h): index range checks, index_select, gather,
   scatter_add_, one_hot, cat's row copies; sort and top-k come from sort.c. The front doors are host/ops/index.c
   and host/ops/sort.c. */
#include "cpu/index.h"
#include <stdint.h>
#include <string.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/index.h"

/* ---- index range check ---------------------------------------------------------------------- */

static dlua_status_t cpu_first_bad(const char *op, const dlua_index_check_t *c, int64_t *first_out, int64_t *value) {
  (void)op;
  const int64_t n = c->n, size = c->size, base = c->base;
  const void *p = c->index;
  const int is64 = c->is64;
  int64_t first = INT64_MAX;  // position of the first bad value: the error does not depend on threads
#pragma omp parallel for reduction(min : first) schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; i++) {
    int64_t x = dlua_cpu_index_at(p, is64, i);
    // Unsigned compare: also catches x - base overflowing below zero.
    if ((uint64_t)(x - base) >= (uint64_t)size && i < first) first = i;
  }
  *first_out = first == INT64_MAX ? -1 : first;
  *value = first == INT64_MAX ? 0 : dlua_cpu_index_at(p, is64, first);
  return DLUA_OK;
}

/* ---- local helpers ------------------------------------------------------------------------ */

/* Merges adjacent dims that address memory as one (and drops size-1 dims); returns the new
   ndim. Element order is unchanged, so a row-major walk of the result visits the same
   elements in the same order. */
static int collapse_dims(int ndim, int64_t *sizes, int64_t *strides) {
  int n = 0;
  for (int d = 0; d < ndim; d++) {
    if (sizes[d] == 1) continue;
    if (n > 0 && strides[n - 1] == strides[d] * sizes[d]) {
      sizes[n - 1] *= sizes[d];
      strides[n - 1] = strides[d];
    } else {
      sizes[n] = sizes[d];
      strides[n] = strides[d];
      n++;
    }
  }
  return n;
}

static inline void copy_elem(char *dst, const char *src, size_t es) {
  switch (es) {
    case 1: *dst = *src; break;
    case 2: memcpy(dst, src, 2); break;
    case 4: memcpy(dst, src, 4); break;
    default: memcpy(dst, src, 8); break;
  }
}

/* Copies `count` elements that a (ndim, sizes, strides) block starting at src addresses, in
   row-major order, to contiguous dst. */
static void copy_block(char *dst, const char *src, int ndim, const int64_t *sizes, const int64_t *strides,
                       int64_t count, size_t es) {
  if (ndim == 0) {
    copy_elem(dst, src, es);
    return;
  }
  if (ndim == 1 && strides[0] == 1) {
    memcpy(dst, src, (size_t)count * es);
    return;
  }
  int64_t last = sizes[ndim - 1], ls = strides[ndim - 1] * (int64_t)es;
  int64_t ctr[DLUA_MAX_DIMS] = {0};
  int64_t off = 0;  // bytes from src to the current row
  for (int64_t done = 0; done < count; done += last) {
    const char *s = src + off;
    for (int64_t j = 0; j < last; j++) copy_elem(dst + (size_t)(done + j) * es, s + j * ls, es);
    for (int d = ndim - 2; d >= 0; d--) {  // odometer over the outer dims
      off += strides[d] * (int64_t)es;
      if (++ctr[d] < sizes[d]) break;
      off -= ctr[d] * strides[d] * (int64_t)es;
      ctr[d] = 0;
    }
  }
}

/* ---- index_select ------------------------------------------------------------------------- */

/* g->lay: the output's sizes over the input's strides (sizes[dim] = the index count). */
static dlua_status_t cpu_index_select(const char *op, const dlua_index_gather_t *g) {
  (void)op;
  const int dim = g->dim, snd = g->lay.ndim;
  const int64_t *sizes = g->lay.sizes, *strides = g->lay.strides;
  const int64_t n = sizes[dim];
  size_t es = (size_t)g->elsize;
  int64_t outer = dlua_shape_numel(dim, sizes);
  int ind = snd - dim - 1;  // inner dims, collapsed for memcpy where memory allows
  int64_t isz[DLUA_MAX_DIMS], ist[DLUA_MAX_DIMS];
  memcpy(isz, sizes + dim + 1, sizeof(int64_t) * (size_t)ind);
  memcpy(ist, strides + dim + 1, sizeof(int64_t) * (size_t)ind);
  int64_t inner = dlua_shape_numel(ind, isz);
  ind = collapse_dims(ind, isz, ist);
  const char *src = g->src;
  char *dst = g->out;
  const void *ip = g->index;
  const int is64 = g->is64;
  const int64_t index_base = g->base;
  int64_t rows = outer * n, sd = strides[dim];
  if (inner > 0) {
#pragma omp parallel for schedule(static) if (rows * inner > 32768)
    for (int64_t r = 0; r < rows; r++) {
      int64_t o = r / n, j = r - o * n;
      int64_t off = dlua_unravel(dim, sizes, strides, o) + (dlua_cpu_index_at(ip, is64, j) - index_base) * sd;
      copy_block(dst + (size_t)(r * inner) * es, src + off * (int64_t)es, ind, isz, ist, inner, es);
    }
  }
  return DLUA_OK;
}

/* ---- gather ------------------------------------------------------------------------------- */

/* g->lay: the index's sizes over the input's strides. */
static dlua_status_t cpu_gather(const char *op, const dlua_index_gather_t *g) {
  (void)op;
  const int dim = g->dim, nd = g->lay.ndim;
  const int64_t *isizes = g->lay.sizes;
  // a's strides with the gathered dim zeroed: the index value supplies that coordinate.
  int64_t ast[DLUA_MAX_DIMS];
  memcpy(ast, g->lay.strides, sizeof ast);
  ast[dim] = 0;
  int64_t last = isizes[nd - 1], lst = ast[nd - 1], sd = g->lay.strides[dim];
  int64_t rows = dlua_shape_numel(nd - 1, isizes);
  size_t es = (size_t)g->elsize;
  const char *src = g->src;
  char *dst = g->out;
  const void *ip = g->index;
  const int is64 = g->is64;
  const int64_t index_base = g->base;
  if (last > 0) {
#pragma omp parallel for schedule(static) if (rows * last > 32768)
    for (int64_t r = 0; r < rows; r++) {
      int64_t base = dlua_unravel(nd - 1, isizes, ast, r);
      for (int64_t q = 0; q < last; q++) {
        int64_t e = r * last + q;
        int64_t off = base + q * lst + (dlua_cpu_index_at(ip, is64, e) - index_base) * sd;
        copy_elem(dst + (size_t)e * es, src + off * (int64_t)es, es);
      }
    }
  }
  return DLUA_OK;
}

/* ---- scatter_add_ ------------------------------------------------------------------------- */

/* t[fiber][index[l]] += src[fiber][l] over the fibers [f0, f1): each fiber of t (all
   coordinates but dim) is owned by one thread and summed in index order, so the result does
   not depend on the thread count even when indices repeat. */
#define SCATTER_LOOP(T, LOAD, STORE)                                                               \
  for (int64_t l = 0; l < L; l++)                                                                  \
    for (int64_t f = 0; f < nf; f++) {                                                             \
      int64_t o = (f0 + f) / inner, i = (f0 + f) - o * inner;                                      \
      int64_t v = dlua_cpu_index_at(ip, is64, (o * L + l) * inner + i) - base;                     \
      T *pt = (T *)tp + toff[f] + v * tsd;                                                         \
      const T *ps = (const T *)sp + soff[f] + l * ssd;                                             \
      STORE(pt, LOAD(pt) + LOAD(ps));                                                              \
    }

#define LOAD_PLAIN(p) (*(p))
#define STORE_PLAIN(p, v) (*(p) = (v))
#define LOAD_F16(p) dlua_f16_to_f32_inl(*(p))
#define STORE_F16(p, v) (*(p) = dlua_f32_to_f16_inl(v))
#define LOAD_BF16(p) dlua_bf16_to_f32_inl(*(p))
#define STORE_BF16(p, v) (*(p) = dlua_f32_to_bf16_inl(v))
#define STORE_U8(p, v) (*(p) = (uint8_t)(v))

enum { SCATTER_BLOCK = 256 };

static void scatter_block(dlua_dtype_t dtype, char *tp, const char *sp, const void *ip, int is64, int64_t base,
                          int64_t f0, int64_t nf, int64_t L, int64_t inner, const int64_t *toff,
                          const int64_t *soff, int64_t tsd, int64_t ssd) {
  switch (dtype) {
    case DLUA_DTYPE_F32: SCATTER_LOOP(float, LOAD_PLAIN, STORE_PLAIN) break;
    case DLUA_DTYPE_F64: SCATTER_LOOP(double, LOAD_PLAIN, STORE_PLAIN) break;
    case DLUA_DTYPE_F16: SCATTER_LOOP(uint16_t, LOAD_F16, STORE_F16) break;
    case DLUA_DTYPE_BF16: SCATTER_LOOP(uint16_t, LOAD_BF16, STORE_BF16) break;
    // Integer sums wrap as in PyTorch; computed unsigned so the wrap is defined behaviour.
    case DLUA_DTYPE_I32: SCATTER_LOOP(uint32_t, LOAD_PLAIN, STORE_PLAIN) break;
    case DLUA_DTYPE_I64: SCATTER_LOOP(uint64_t, LOAD_PLAIN, STORE_PLAIN) break;
    case DLUA_DTYPE_U8: SCATTER_LOOP(uint8_t, LOAD_PLAIN, STORE_U8) break;
    default: break;
  }
}

static dlua_status_t cpu_scatter_add(const char *op, const dlua_index_scatter_t *sc) {
  (void)op;
  const int nd = sc->ndim, dim = sc->dim;
  const int64_t *isizes = sc->idx_sizes;
  // Fibers: all coordinates of index but dim, split as (outer, inner) around it.
  int64_t L = isizes[dim];
  int64_t outer = dlua_shape_numel(dim, isizes), inner = dlua_shape_numel(nd - dim - 1, isizes + dim + 1);
  int64_t nfib = outer * inner;
  int64_t fsz[DLUA_MAX_DIMS], tst[DLUA_MAX_DIMS], sst[DLUA_MAX_DIMS];
  int fnd = 0;
  for (int d = 0; d < nd; d++)
    if (d != dim) {
      fsz[fnd] = isizes[d];
      tst[fnd] = sc->t_strides[d];
      sst[fnd] = sc->s_strides[d];
      fnd++;
    }
  char *tp = sc->t;
  const char *sp = sc->src;
  const void *ip = sc->index;
  const int is64 = sc->is64;
  const dlua_dtype_t dtype = (dlua_dtype_t)sc->dtype;
  int64_t nblocks = (nfib + SCATTER_BLOCK - 1) / SCATTER_BLOCK;
  if (L > 0) {
#pragma omp parallel for schedule(static) if (nfib * L > 32768 && nblocks > 1)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      int64_t toff[SCATTER_BLOCK], soff[SCATTER_BLOCK];
      int64_t f0 = blk * SCATTER_BLOCK, nf = nfib - f0 < SCATTER_BLOCK ? nfib - f0 : SCATTER_BLOCK;
      for (int64_t f = 0; f < nf; f++) {
        toff[f] = dlua_unravel(fnd, fsz, tst, f0 + f);
        soff[f] = dlua_unravel(fnd, fsz, sst, f0 + f);
      }
      scatter_block(dtype, tp, sp, ip, is64, sc->base, f0, nf, L, inner, toff, soff, sc->t_strides[dim],
                    sc->s_strides[dim]);
    }
  }
  return DLUA_OK;
}

/* ---- cat's row copies ----------------------------------------------------------------------- */

static dlua_status_t cpu_copy_rows(const char *op, const dlua_index_rows_t *r) {
  (void)op;
  const size_t es = (size_t)r->elsize;
  const int64_t outer = r->outer, pitch = r->pitch;
  const char *src = r->src;
  char *d0 = r->dst;
  size_t row = (size_t)r->row * es;
#pragma omp parallel for schedule(static) if (outer * r->row > 65536 && outer > 1)
  for (int64_t o = 0; o < outer; o++) memcpy(d0 + (size_t)(o * pitch) * es, src + (size_t)o * row, row);
  return DLUA_OK;
}

/* ---- one_hot ------------------------------------------------------------------------------ */

static dlua_status_t cpu_one_hot(const char *op, const dlua_index_one_hot_t *h) {
  (void)op;
  const size_t es = (size_t)h->elsize;
  char one[8];
  memcpy(one, &h->one, sizeof one);
  const int64_t n = h->n, index_base = h->base;
  const void *lp = h->labels;
  const int is64 = h->is64;
  char *dst = h->out;
  size_t row = (size_t)h->classes * es;
#pragma omp parallel for schedule(static) if ((int64_t)row * n > 65536)
  for (int64_t i = 0; i < n; i++) {
    char *r = dst + (size_t)i * row;
    memset(r, 0, row);
    copy_elem(r + (size_t)(dlua_cpu_index_at(lp, is64, i) - index_base) * es, one, es);
  }
  return DLUA_OK;
}

const struct dlua_index_ops dlua_cpu_index_ops = {
    .first_bad = cpu_first_bad,
    .index_select = cpu_index_select,
    .gather = cpu_gather,
    .scatter_add = cpu_scatter_add,
    .one_hot = cpu_one_hot,
    .copy_rows = cpu_copy_rows,
    .sort = dlua_cpu_sort,
    .topk = dlua_cpu_topk,
};

/* Indexing ops: index_select, gather, scatter_add_, cat, stack, one_hot. The CPU kernels live here; CUDA tensors
   take the same checks, then host/cuda/index.cu's kernels (cat and stack: copy_ into slices of the result). */
#include "cpu/index.h"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda/index_cuda.h" /* plain C: only CUDA builds call into it */

/* ---- helpers shared with sort.c and compress.c ---------------------------------------------- */

dlua_status_t dlua_cpu_check_indices(const char *op, const dlua_tensor_t *index, int64_t size, int64_t base,
                                     const char *what) {
  int64_t n = dlua_tensor_numel(index);
  const void *p = dlua_tensor_ptr(index);
  int is64 = index->dtype == DLUA_DTYPE_I64;
  int64_t first = INT64_MAX;  // position of the first bad value: the error does not depend on threads
  int64_t v = 0;
#ifdef DLUA_HAVE_CUDA
  if (index->device != DLUA_CPU) {  // found on the device; only the position and value come back
    DLUA_TRY(dlua_cuda_index_first_bad(op, p, is64, n, size, base, &first, &v, index->device));
    if (first < 0) return DLUA_OK;
  } else
#endif
  {
#pragma omp parallel for reduction(min : first) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
      int64_t x = dlua_cpu_index_at(p, is64, i);
      // Unsigned compare: also catches x - base overflowing below zero.
      if ((uint64_t)(x - base) >= (uint64_t)size && i < first) first = i;
    }
    if (first == INT64_MAX) return DLUA_OK;
    v = dlua_cpu_index_at(p, is64, first);
  }
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

/* A local, unowned view of t (no reference taken): valid while t lives. */
static struct dlua_tensor local_view(const dlua_tensor_t *t) { return *t; }

/* A live tensor on a device this build runs these ops on (the CPU, and CUDA devices in CUDA builds). */
static dlua_status_t require_backend(const char *op, const dlua_tensor_t *t) {
#ifdef DLUA_HAVE_CUDA
  return dlua_require_device(op, t, t ? t->device : DLUA_CPU);
#else
  return dlua_require_cpu(op, t);
#endif
}

#ifdef DLUA_HAVE_CUDA
/* The layout kernels address: ndim dims of (sizes, strides). */
static dlua_cuda_layout_t cuda_layout(int ndim, const int64_t *sizes, const int64_t *strides) {
  dlua_cuda_layout_t l;
  memset(&l, 0, sizeof l);
  l.ndim = ndim;
  memcpy(l.sizes, sizes, sizeof(int64_t) * (size_t)ndim);
  memcpy(l.strides, strides, sizeof(int64_t) * (size_t)ndim);
  return l;
}
#endif

/* ---- index_select ------------------------------------------------------------------------- */

// a: (..., D, ...) at dim; index: (n) or scalar  ->  out: (..., n, ...)
dlua_status_t dlua_tensor_index_select(dlua_tensor_t **out, const dlua_tensor_t *a, int dim,
                                       const dlua_tensor_t *index, int64_t index_base) {
  const char *op = "index_select";
  if (!a) return DLUA_ERR(DLUA_ERR_ARG, "%s: input is NULL", op);
  DLUA_TRY(require_backend(op, a));
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
  dlua_status_t s = dlua_cpu_check_indices(op, idx, sizes[dim], index_base, b1);
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
  size_t es = dlua_dtype_size(a->dtype);
#ifdef DLUA_HAVE_CUDA
  if (a->device != DLUA_CPU) {
    sizes[dim] = n;  // the output's sizes over a's strides; the index supplies coordinate `dim`
    dlua_cuda_layout_t lay = cuda_layout(snd, sizes, strides);
    s = dlua_cuda_index_gather(op, 0, (int)es, dlua_tensor_ptr(plan.dst), dlua_tensor_ptr(a), &lay, dim,
                               dlua_tensor_ptr(idx), idx->dtype == DLUA_DTYPE_I64, index_base, a->device);
    dlua_tensor_free(idx);
    return dlua_ops_out_finish(out, &plan, s);
  }
#endif
  int64_t outer = dlua_shape_numel(dim, sizes);
  int ind = snd - dim - 1;  // inner dims, collapsed for memcpy where memory allows
  int64_t isz[DLUA_MAX_DIMS], ist[DLUA_MAX_DIMS];
  memcpy(isz, sizes + dim + 1, sizeof(int64_t) * (size_t)ind);
  memcpy(ist, strides + dim + 1, sizeof(int64_t) * (size_t)ind);
  int64_t inner = dlua_shape_numel(ind, isz);
  ind = collapse_dims(ind, isz, ist);
  const char *src = dlua_tensor_ptr(a);
  char *dst = dlua_tensor_ptr(plan.dst);
  const void *ip = dlua_tensor_ptr(idx);
  int is64 = idx->dtype == DLUA_DTYPE_I64;
  int64_t rows = outer * n, sd = strides[dim];
  if (inner > 0) {
#pragma omp parallel for schedule(static) if (rows * inner > 32768)
    for (int64_t r = 0; r < rows; r++) {
      int64_t o = r / n, j = r - o * n;
      int64_t off = dlua_cpu_unravel(dim, sizes, strides, o) + (dlua_cpu_index_at(ip, is64, j) - index_base) * sd;
      copy_block(dst + (size_t)(r * inner) * es, src + off * (int64_t)es, ind, isz, ist, inner, es);
    }
  }
  dlua_tensor_free(idx);
  return dlua_ops_out_finish(out, &plan, DLUA_OK);
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
  DLUA_TRY(require_backend(op, a));
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
  dlua_status_t s = dlua_cpu_check_indices(op, idx, av.sizes[dim], index_base, b1);
  dlua_ops_out_t plan = {0};
  const dlua_tensor_t *ins[2] = {a, index};
  if (s == DLUA_OK) s = dlua_ops_out_begin_on(op, out, index->ndim, index->sizes, a->dtype, ins, 2, a->device, &plan);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  struct dlua_tensor iv = local_view(idx);
  as_1d_if_scalar(&iv);
  int nd = iv.ndim;
#ifdef DLUA_HAVE_CUDA
  if (a->device != DLUA_CPU) {  // index's sizes over a's strides; the index supplies coordinate `dim`
    dlua_cuda_layout_t lay = cuda_layout(nd, iv.sizes, av.strides);
    s = dlua_cuda_index_gather(op, 1, (int)dlua_dtype_size(a->dtype), dlua_tensor_ptr(plan.dst), dlua_tensor_ptr(a),
                               &lay, dim, dlua_tensor_ptr(idx), idx->dtype == DLUA_DTYPE_I64, index_base, a->device);
    dlua_tensor_free(idx);
    return dlua_ops_out_finish(out, &plan, s);
  }
#endif
  // a's strides with the gathered dim zeroed: the index value supplies that coordinate.
  int64_t ast[DLUA_MAX_DIMS];
  memcpy(ast, av.strides, sizeof ast);
  ast[dim] = 0;
  int64_t last = iv.sizes[nd - 1], lst = ast[nd - 1], sd = av.strides[dim];
  int64_t rows = dlua_shape_numel(nd - 1, iv.sizes);
  size_t es = dlua_dtype_size(a->dtype);
  const char *src = dlua_tensor_ptr(a);
  char *dst = dlua_tensor_ptr(plan.dst);
  const void *ip = dlua_tensor_ptr(idx);
  int is64 = idx->dtype == DLUA_DTYPE_I64;
  if (last > 0) {
#pragma omp parallel for schedule(static) if (rows * last > 32768)
    for (int64_t r = 0; r < rows; r++) {
      int64_t base = dlua_cpu_unravel(nd - 1, iv.sizes, ast, r);
      for (int64_t q = 0; q < last; q++) {
        int64_t e = r * last + q;
        int64_t off = base + q * lst + (dlua_cpu_index_at(ip, is64, e) - index_base) * sd;
        copy_elem(dst + (size_t)e * es, src + off * (int64_t)es, es);
      }
    }
  }
  dlua_tensor_free(idx);
  return dlua_ops_out_finish(out, &plan, DLUA_OK);
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

// t: (d0, ..., dk) ; index: same ndim ; src: same ndim, src.size(d) >= index.size(d) everywhere
dlua_status_t dlua_tensor_scatter_add_(dlua_tensor_t *t, int dim, const dlua_tensor_t *index,
                                       const dlua_tensor_t *src, int64_t index_base) {
  const char *op = "scatter_add_";
  char b1[200], b2[200], b3[200];
  if (!t || !index || !src) return DLUA_ERR(DLUA_ERR_ARG, "%s: a tensor argument is NULL", op);
  DLUA_TRY(require_backend(op, t));
  DLUA_TRY(require_backend(op, src));
  DLUA_TRY(dlua_same_device(op, t, src));
  DLUA_TRY(dlua_same_device(op, t, index));
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
  dlua_status_t s = dlua_cpu_check_indices(op, idx, tv.sizes[dim], index_base, b1);
  // src in t's dtype, and never aliasing t (the adds would read what they wrote).
  if (s == DLUA_OK && (src->dtype != t->dtype || dlua_tensor_same_storage(src, t)))
    s = dlua_tensor_to_dtype(&stmp, src, t->dtype);
  if (s != DLUA_OK) {
    dlua_tensor_free(idx);
    return s;
  }
  struct dlua_tensor sv = stmp ? local_view(stmp) : sv0;
  as_1d_if_scalar(&sv);
#ifdef DLUA_HAVE_CUDA
  if (t->device != DLUA_CPU) {
    s = dlua_cuda_scatter_add(op, (int)t->dtype, dlua_tensor_ptr(&tv), tv.strides, tv.sizes[dim], dlua_tensor_ptr(&sv),
                              sv.strides, nd, iv0.sizes, dim, dlua_tensor_ptr(idx), idx->dtype == DLUA_DTYPE_I64,
                              index_base, t->device);
    dlua_tensor_free(idx);
    dlua_tensor_free(stmp);
    return s;
  }
#endif
  // Fibers: all coordinates of index but dim, split as (outer, inner) around it.
  int64_t L = iv0.sizes[dim];
  int64_t outer = dlua_shape_numel(dim, iv0.sizes), inner = dlua_shape_numel(nd - dim - 1, iv0.sizes + dim + 1);
  int64_t nfib = outer * inner;
  int64_t fsz[DLUA_MAX_DIMS], tst[DLUA_MAX_DIMS], sst[DLUA_MAX_DIMS];
  int fnd = 0;
  for (int d = 0; d < nd; d++)
    if (d != dim) {
      fsz[fnd] = iv0.sizes[d];
      tst[fnd] = tv.strides[d];
      sst[fnd] = sv.strides[d];
      fnd++;
    }
  char *tp = dlua_tensor_ptr(&tv);
  const char *sp = dlua_tensor_ptr(&sv);
  const void *ip = dlua_tensor_ptr(idx);
  int is64 = idx->dtype == DLUA_DTYPE_I64;
  int64_t nblocks = (nfib + SCATTER_BLOCK - 1) / SCATTER_BLOCK;
  if (L > 0) {
#pragma omp parallel for schedule(static) if (nfib * L > 32768 && nblocks > 1)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      int64_t toff[SCATTER_BLOCK], soff[SCATTER_BLOCK];
      int64_t f0 = blk * SCATTER_BLOCK, nf = nfib - f0 < SCATTER_BLOCK ? nfib - f0 : SCATTER_BLOCK;
      for (int64_t f = 0; f < nf; f++) {
        toff[f] = dlua_cpu_unravel(fnd, fsz, tst, f0 + f);
        soff[f] = dlua_cpu_unravel(fnd, fsz, sst, f0 + f);
      }
      scatter_block(t->dtype, tp, sp, ip, is64, index_base, f0, nf, L, inner, toff, soff, tv.strides[dim],
                    sv.strides[dim]);
    }
  }
  dlua_tensor_free(idx);
  dlua_tensor_free(stmp);
  return DLUA_OK;
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
    DLUA_TRY(require_backend(op, ts[i]));
    DLUA_TRY(dlua_same_device(op, ts[0], ts[i]));
    dtype = i == 0 ? ts[i]->dtype : dlua_dtype_promote(dtype, ts[i]->dtype);
    if (!ref && !cat_skipped(ts[i])) ref = ts[i];
  }
  if (!ref) ref = ts[0];
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
  // Inputs already contiguous in the output dtype are moved with memcpy, one row per part;
  // the others, and every CUDA input, go through copy_ (strides, dtype conversion) into a narrowed view of dst.
  int64_t at = 0;
  for (int i = 0; i < n && s == DLUA_OK; i++) {
    const dlua_tensor_t *t = ts[i];
    if (cat_skipped(t) && t != ref) continue;
    int64_t len = t->sizes[dim];
    if (len > 0 && outer > 0 && inner > 0) {
      if (t->dtype == dtype && dlua_tensor_is_contiguous(t) && dst->device == DLUA_CPU) {
        const char *src = dlua_tensor_ptr(t);
        char *d0 = dlua_tensor_ptr(dst);
        size_t row = (size_t)(len * inner) * es;
#pragma omp parallel for schedule(static) if (outer * len * inner > 65536 && outer > 1)
        for (int64_t o = 0; o < outer; o++)
          memcpy(d0 + (size_t)((o * total + at) * inner) * es, src + (size_t)o * row, row);
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
    DLUA_TRY(require_backend(op, ts[i]));
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
  if (lab->ndim >= DLUA_MAX_DIMS) {
    dlua_tensor_free(lab);
    return DLUA_ERR(DLUA_ERR_ARG, "%s: labels %s already have %d dimensions", op,
                    dlua_tensor_describe(labels, b1, sizeof b1), DLUA_MAX_DIMS);
  }
  int64_t n = dlua_tensor_numel(lab);
  const void *lp = dlua_tensor_ptr(lab);
  int is64 = lab->dtype == DLUA_DTYPE_I64;
  if (num_classes < 0) {  // as F.one_hot(num_classes=-1): one more than the largest label
    if (n == 0) {
      dlua_tensor_free(lab);
      return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot infer the number of classes from empty labels %s", op,
                      dlua_tensor_describe(labels, b1, sizeof b1));
    }
    int64_t mx = INT64_MIN;
    if (device != DLUA_CPU) {  // the largest label, reduced on the device and copied back
      dlua_tensor_t *m = NULL;
      union { int32_t i32; int64_t i64; } got = {0};
      dlua_status_t s = dlua_tensor_reduce(&m, NULL, lab, DLUA_REDUCE_MAX, 0, NULL, 0, 0.0, 0);
      if (s == DLUA_OK) s = dlua_tensor_to_data(m, &got, is64 ? sizeof got.i64 : sizeof got.i32);
      dlua_tensor_free(m);
      if (s != DLUA_OK) {
        dlua_tensor_free(lab);
        return s;
      }
      mx = is64 ? got.i64 : got.i32;
    }
    for (int64_t i = 0; device == DLUA_CPU && i < n; i++) {
      int64_t v = dlua_cpu_index_at(lp, is64, i);
      if (v > mx) mx = v;
    }
    num_classes = mx >= index_base ? mx - index_base + 1 : 0;
  }
  dlua_status_t s = dlua_cpu_check_indices(op, lab, num_classes, index_base, "the classes");
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
  char *dst = dlua_tensor_ptr(plan.dst);
#ifdef DLUA_HAVE_CUDA
  if (device != DLUA_CPU) {
    uint64_t bits = 0;
    memcpy(&bits, one, es);
    s = dlua_cuda_one_hot(op, (int)es, bits, dst, lp, is64, n, num_classes, index_base, device);
    dlua_tensor_free(lab);
    return dlua_ops_out_finish(out, &plan, s);
  }
#endif
  size_t row = (size_t)num_classes * es;
#pragma omp parallel for schedule(static) if ((int64_t)row * n > 65536)
  for (int64_t i = 0; i < n; i++) {
    char *r = dst + (size_t)i * row;
    memset(r, 0, row);
    copy_elem(r + (size_t)(dlua_cpu_index_at(lp, is64, i) - index_base) * es, one, es);
  }
  dlua_tensor_free(lab);
  return dlua_ops_out_finish(out, &plan, DLUA_OK);
}

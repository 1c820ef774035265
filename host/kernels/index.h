/* The index family of the backend table (ops/backend.h): index range checks, index_select / gather,
   scatter_add_, one_hot, the row copies of cat and stack, sort and top-k. host/ops/index.c and host/ops/sort.c
   fill the descriptors; host/cpu/index.c, sort.c and host/cuda/index.cu, sort.cu run them. Pointers are
   addresses on `device`; index buffers are contiguous int32 (is64 = 0) or int64 (is64 = 1). */
#ifndef DLUA_KERNELS_INDEX_H
#define DLUA_KERNELS_INDEX_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor's layout as kernels address it: up to DLUA_MAX_DIMS dims, strides in elements. */
typedef struct {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t strides[DLUA_MAX_DIMS];
} dlua_index_layout_t;

/* The n values of `index`, each to lie in [base, base + size). */
typedef struct {
  const void *index;
  int is64;
  int64_t n, size, base;
  int device;
} dlua_index_check_t;

/* index_select and gather: out (contiguous, lay's sizes) element e at coordinates c copies src at
   sum_d c[d] * lay.strides[d], where coordinate `dim` is replaced by index[c[dim]] - base (index_select) or
   index[e] - base (gather). elsize: bytes per element (bits are copied). lay.ndim >= 1. */
typedef struct {
  int elsize;
  void *out;
  const void *src;
  dlua_index_layout_t lay;
  int dim;
  const void *index;
  int is64;
  int64_t base;
  int device;
} dlua_index_gather_t;

/* t[fiber][index[l] - base] += src[fiber][l] along dim, for every fiber (all coordinates of `index` but dim)
   and l in order, storage rounding after every add, integers wrapping. idx_sizes: index's sizes (contiguous);
   t_strides / s_strides: t's and src's element strides; t_dim_size: t's size at dim. src has t's dtype and
   does not alias t. Each t element adds its terms in increasing l, whatever the threads. ndim >= 1. */
typedef struct {
  int dtype;
  void *t;
  int64_t t_strides[DLUA_MAX_DIMS];
  int64_t t_dim_size;
  const void *src;
  int64_t s_strides[DLUA_MAX_DIMS];
  int ndim;
  int64_t idx_sizes[DLUA_MAX_DIMS];
  int dim;
  const void *index;
  int is64;
  int64_t base;
  int device;
} dlua_index_scatter_t;

/* one_hot: out (n, classes) of elsize bytes is 0 except out[i][labels[i] - base] = the bits `one`. */
typedef struct {
  int elsize;
  uint64_t one;
  void *out;
  const void *labels;
  int is64;
  int64_t n, classes, base;
  int device;
} dlua_index_one_hot_t;

/* cat's part copy: `outer` rows of `row` elements (elsize bytes), contiguous in src, to dst + o * pitch. */
typedef struct {
  int elsize;
  void *dst;
  const void *src;
  int64_t outer, row, pitch;
  int device;
} dlua_index_rows_t;

/* Sort or top-k of every row of `a` (layout lay, dtype) along dim, with host/kernels/sort_keys.h's keys:
   values (a's dtype) and int64 indices (position + index_base), contiguous with lay's sizes where dim has
   `len` entries; either output may be NULL. Sort: len = lay.sizes[dim], ascending or (descending_or_largest)
   descending, stable. Top-k: len = k, the k largest (or smallest) keys by value or magnitude, ties to the
   lower position; sorted by key (ties by position) or, unsorted, by position. lay.ndim >= 1. */
typedef struct {
  int dtype;
  const void *a;
  dlua_index_layout_t lay;
  int dim;
  int64_t len;
  int descending_or_largest, by_magnitude, sorted;
  void *values;
  int64_t *indices;
  int64_t index_base;
  int device;
} dlua_sort_t;

struct dlua_index_ops {
  /* *first <- the position of the first value out of range (-1: none), *value <- that value. */
  dlua_status_t (*first_bad)(const char *op, const dlua_index_check_t *c, int64_t *first, int64_t *value);
  dlua_status_t (*index_select)(const char *op, const dlua_index_gather_t *g);
  dlua_status_t (*gather)(const char *op, const dlua_index_gather_t *g);
  dlua_status_t (*scatter_add)(const char *op, const dlua_index_scatter_t *s);
  dlua_status_t (*one_hot)(const char *op, const dlua_index_one_hot_t *h);
  dlua_status_t (*copy_rows)(const char *op, const dlua_index_rows_t *r);
  dlua_status_t (*sort)(const char *op, const dlua_sort_t *s);
  dlua_status_t (*topk)(const char *op, const dlua_sort_t *s);
};

extern const struct dlua_index_ops dlua_cpu_index_ops, dlua_cuda_index_ops;

#ifdef __cplusplus
}
#endif
#endif

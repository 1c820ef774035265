/* Check suite for host/core/tensor.c, alloc.c and copy.c: layout, refcounts, views, copies, ranges. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

/* ---- helpers ---- */

/* 0, 1, 2, ... as float32 in the given shape (built by hand, not by arange). */
static dlua_tensor_t *iota_f32(int ndim, const int64_t *sizes) {
  dlua_tensor_t *t = tu_new_t(ndim, sizes, DLUA_DTYPE_F32);
  float *p = dlua_tensor_data(t);
  for (int64_t i = 0; i < dlua_tensor_numel(t); i++) p[i] = (float)i;
  return t;
}

/* Element at a multi-index, read through sizes/strides/offset by hand. */
static double at_f32(const dlua_tensor_t *t, const int64_t *idx) {
  const float *base = (const float *)((const char *)t->storage->data) + t->offset;
  int64_t off = 0;
  for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
  return base[off];
}

static void assert_shape(const dlua_tensor_t *t, int ndim, const int64_t *sizes) {
  ck_assert_int_eq(dlua_tensor_ndim(t), ndim);
  for (int d = 0; d < ndim; d++) ck_assert_int_eq(dlua_tensor_sizes(t)[d], sizes[d]);
}

static void assert_strides(const dlua_tensor_t *t, const int64_t *strides) {
  for (int d = 0; d < t->ndim; d++) ck_assert_int_eq(dlua_tensor_strides(t)[d], strides[d]);
}

static void assert_error(dlua_status_t s, dlua_status_t want, const char *needle) {
  ck_assert_int_eq(s, want);
  ck_assert_msg(strstr(dlua_last_error(), needle), "message \"%s\" lacks \"%s\"", dlua_last_error(), needle);
}

/* ---- creation, layout, memory ---- */

START_TEST(test_empty_layout) {
  int64_t sizes[] = {2, 3, 5};
  int64_t before = dlua_memory_allocated(DLUA_CPU);
  dlua_tensor_t *t = tu_new_t(3, sizes, DLUA_DTYPE_F64);
  assert_shape(t, 3, sizes);
  int64_t strides[] = {15, 5, 1};
  assert_strides(t, strides);
  ck_assert_int_eq(dlua_tensor_numel(t), 30);
  ck_assert_int_eq(dlua_tensor_offset(t), 0);
  ck_assert_int_eq(dlua_tensor_dtype(t), DLUA_DTYPE_F64);
  ck_assert_int_eq(dlua_tensor_device(t), DLUA_CPU);
  ck_assert(dlua_tensor_is_contiguous(t));
  ck_assert_uint_eq(dlua_tensor_storage_bytes(t), 240);
  ck_assert_uint_eq((uintptr_t)dlua_tensor_data(t) % 64, 0);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU) - before, 240);
  ck_assert_int_ge(dlua_memory_peak(DLUA_CPU), dlua_memory_allocated(DLUA_CPU));
  ck_assert_int_ge(dlua_memory_allocated_total(), 240);
  char buf[64];
  ck_assert_str_eq(dlua_tensor_describe(t, buf, sizeof buf), "(2, 3, 5) float64 cpu");
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);
  dlua_tensor_free(NULL);  // ignored

  // 0-d: one element, no dims.
  t = tu_new_t(0, NULL, DLUA_DTYPE_I32);
  ck_assert_int_eq(dlua_tensor_numel(t), 1);
  ck_assert(dlua_tensor_is_contiguous(t));
  ck_assert_str_eq(dlua_tensor_describe(t, buf, sizeof buf), "() int32 cpu");
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_zeros_and_prime_sizes) {
  int64_t sizes[] = {7, 13, 131};
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
    dlua_tensor_t *t = NULL;
    ck_assert_int_eq(dlua_tensor_zeros(&t, 3, sizes, (dlua_dtype_t)d, DLUA_CPU), DLUA_OK);
    const unsigned char *p = dlua_tensor_data(t);
    size_t n = 7 * 13 * 131 * dlua_dtype_size((dlua_dtype_t)d);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(p[i], 0);
    dlua_tensor_free(t);
  }
  // Big enough to take the parallel path.
  int64_t big = (1 << 21) + 3;
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&t, 1, &big, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  const float *f = dlua_tensor_data(t);
  for (int64_t i = 0; i < big; i++)
    if (f[i] != 0) ck_abort_msg("zeros: element %lld is %g", (long long)i, f[i]);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_zero_size_dims) {
  int64_t sizes[] = {0, 3};
  int64_t before = dlua_memory_allocated(DLUA_CPU);
  dlua_tensor_t *t = tu_new_t(2, sizes, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_numel(t), 0);
  ck_assert_ptr_nonnull(dlua_tensor_data(t));
  ck_assert(dlua_tensor_is_contiguous(t));
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);
  int64_t strides[] = {3, 1};
  assert_strides(t, strides);
  dlua_tensor_t *v = NULL, *c = NULL, *tr = NULL, *r = NULL, *e = NULL, *n = NULL;
  int64_t vs[] = {3, 0, 5};
  ck_assert_int_eq(dlua_tensor_view(&v, t, 3, vs), DLUA_OK);
  assert_shape(v, 3, vs);
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_clone(&c, tr), DLUA_OK);
  int64_t trs[] = {3, 0};
  assert_shape(c, 2, trs);
  int64_t rs[] = {-1, 0};
  assert_error(dlua_tensor_reshape(&r, t, 2, rs), DLUA_ERR_ARG, "could be anything");
  int64_t es[] = {4, 0, 3};
  ck_assert_int_eq(dlua_tensor_expand(&e, t, 3, es), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_copy_(t, e == NULL ? t : t), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_fill_(t, 3), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_narrow(&n, t, 1, 3, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(n), 0);
  ck_assert_int_eq(dlua_tensor_to_data(t, NULL, 0), DLUA_OK);
  dlua_tensor_t *z = NULL, *s1 = NULL;
  int64_t zs = 0;
  ck_assert_int_eq(dlua_tensor_zeros(&z, 1, &zs, DLUA_DTYPE_BF16, DLUA_CPU), DLUA_OK);
  int64_t big = 1ll << 40;
  int64_t ws[] = {0, big, big};  // empty, even though the other sizes multiply past int64
  ck_assert_int_eq(dlua_tensor_empty(&s1, 3, ws, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(s1), 0);
  dlua_tensor_free(s1);
  dlua_tensor_free(z);
  dlua_tensor_free(n);
  dlua_tensor_free(e);
  dlua_tensor_free(c);
  dlua_tensor_free(tr);
  dlua_tensor_free(v);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);
}
END_TEST

START_TEST(test_bad_creation) {
  dlua_tensor_t *t = (dlua_tensor_t *)1;
  int64_t neg[] = {2, -3};
  assert_error(dlua_tensor_empty(&t, 2, neg, DLUA_DTYPE_F32, DLUA_CPU), DLUA_ERR_ARG, "empty: negative size -3");
  ck_assert_ptr_null(t);
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  assert_error(dlua_tensor_zeros(&t, 9, nine, DLUA_DTYPE_F32, DLUA_CPU), DLUA_ERR_ARG, "zeros: 9 dimensions");
  assert_error(dlua_tensor_empty(&t, 1, nine, (dlua_dtype_t)42, DLUA_CPU), DLUA_ERR_ARG, "invalid dtype 42");
  // a CUDA device this machine lacks (any, without a GPU; the one past the last, with some)
  const int missing = dlua_cuda_device_count();
  char why[64];
  if (missing == 0) snprintf(why, sizeof why, "no CUDA device");
  else snprintf(why, sizeof why, "no device cuda:%d", missing);
  assert_error(dlua_tensor_empty(&t, 1, nine, DLUA_DTYPE_F32, missing), DLUA_ERR_ARG, why);
  assert_error(dlua_tensor_empty(&t, 1, nine, DLUA_DTYPE_F32, -7), DLUA_ERR_ARG, "invalid device -7");
  int64_t huge[] = {1ll << 40, 1ll << 30};
  assert_error(dlua_tensor_empty(&t, 2, huge, DLUA_DTYPE_F32, DLUA_CPU), DLUA_ERR_OOM, "too large");
  ck_assert_int_eq(dlua_require_cpu("add", NULL), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "add: the tensor is NULL"));
}
END_TEST

START_TEST(test_oom_reports_bytes) {
  int64_t sizes[] = {1ll << 45};  // 128 TiB of float32: no machine has it
  int64_t before = dlua_memory_allocated(DLUA_CPU);
  dlua_tensor_t *t = NULL;
  assert_error(dlua_tensor_empty(&t, 1, sizes, DLUA_DTYPE_F32, DLUA_CPU), DLUA_ERR_OOM, "empty: out of memory allocating 140737488355328 bytes");
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "(35184372088832) float32"));
  ck_assert_ptr_null(t);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);
  ck_assert_ptr_null(dlua_cpu_alloc((size_t)1 << 62));
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "4611686018427387904 bytes"));
  ck_assert_int_eq(dlua_last_status(), DLUA_ERR_OOM);
}
END_TEST

START_TEST(test_refcount_frees_with_last_view) {
  int64_t sizes[] = {4, 6};
  int64_t before = dlua_memory_allocated(DLUA_CPU);
  dlua_tensor_t *t = iota_f32(2, sizes);
  dlua_tensor_t *a = NULL, *b = NULL, *c = dlua_tensor_alias(t);
  ck_assert_int_eq(dlua_tensor_transpose(&a, t, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_select(&b, a, 0, 2), DLUA_OK);
  ck_assert(dlua_tensor_same_storage(t, b));
  ck_assert_int_eq(t->storage->refcount, 4);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU) - before, 96);
  dlua_tensor_free(t);
  dlua_tensor_free(a);
  dlua_tensor_free(c);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU) - before, 96);  // b still holds the storage
  const float *p = dlua_tensor_data(b);                              // still readable: column 2
  ck_assert_float_eq(p[0], 2);
  ck_assert_float_eq(p[3 * 6 / 6 * dlua_tensor_strides(b)[0]], 20);
  dlua_tensor_free(b);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);
}
END_TEST

static int deleter_calls;
static void *deleter_seen;
static void count_deleter(void *ctx, void *data) {
  deleter_calls += *(int *)ctx;
  deleter_seen = data;
}

START_TEST(test_wrap) {
  float buf[12];
  for (int i = 0; i < 12; i++) buf[i] = (float)(i * i);
  int64_t sizes[] = {3, 4};
  int one = 1;
  int64_t before = dlua_memory_allocated(DLUA_CPU);
  dlua_tensor_t *t = NULL, *v = NULL;
  deleter_calls = 0;
  ck_assert_int_eq(dlua_tensor_wrap(&t, 2, sizes, NULL, DLUA_DTYPE_F32, buf, count_deleter, &one), DLUA_OK);
  ck_assert_ptr_eq(dlua_tensor_data(t), buf);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), before);  // caller memory is not ours to count
  ck_assert_int_eq(dlua_tensor_select(&v, t, 1, 3), DLUA_OK);
  dlua_tensor_free(t);
  ck_assert_int_eq(deleter_calls, 0);
  double *vals = tu_values(v);
  ck_assert_double_eq(vals[2], 121);
  free(vals);
  dlua_tensor_free(v);
  ck_assert_int_eq(deleter_calls, 1);
  ck_assert_ptr_eq(deleter_seen, buf);

  // Strided wrap, no deleter: the storage spans exactly the reachable elements.
  int64_t st[] = {1, 3};
  ck_assert_int_eq(dlua_tensor_wrap(&t, 2, sizes, st, DLUA_DTYPE_F32, buf, NULL, NULL), DLUA_OK);
  ck_assert_uint_eq(dlua_tensor_storage_bytes(t), 12 * 4);
  ck_assert(!dlua_tensor_is_contiguous(t));
  int64_t idx[] = {2, 1};
  ck_assert_double_eq(at_f32(t, idx), 25);
  dlua_tensor_free(t);
  ck_assert_float_eq(buf[5], 25);  // untouched, not freed
}
END_TEST

/* ---- helpers from tensor.h ---- */

START_TEST(test_shape_helpers) {
  char buf[64];
  int64_t s3[] = {2, 3, 5};
  ck_assert_str_eq(dlua_shape_str(3, s3, buf, sizeof buf), "(2, 3, 5)");
  ck_assert_str_eq(dlua_shape_str(1, s3, buf, sizeof buf), "(2)");
  ck_assert_str_eq(dlua_shape_str(0, s3, buf, sizeof buf), "()");
  char tiny[4];
  dlua_shape_str(3, s3, tiny, sizeof tiny);
  ck_assert_uint_eq(strlen(tiny), 3);
  ck_assert_int_eq(dlua_shape_numel(3, s3), 30);
  ck_assert_int_eq(dlua_shape_numel(0, s3), 1);
  int64_t neg[] = {2, -1};
  ck_assert_int_eq(dlua_shape_numel(2, neg), -1);
  int64_t over[] = {1ll << 40, 1ll << 40};
  ck_assert_int_eq(dlua_shape_numel(2, over), -1);
  int64_t st[3];
  dlua_contiguous_strides(3, s3, st);
  ck_assert_int_eq(st[0], 15);
  ck_assert_int_eq(st[1], 5);
  ck_assert_int_eq(st[2], 1);

  int64_t a[] = {4, 1, 3}, b[] = {5, 1}, out[8];
  int n = 0;
  ck_assert_int_eq(dlua_broadcast_shapes("add", 3, a, 2, b, &n, out), DLUA_OK);
  ck_assert_int_eq(n, 3);
  ck_assert_int_eq(out[0], 4);
  ck_assert_int_eq(out[1], 5);
  ck_assert_int_eq(out[2], 3);
  ck_assert_int_eq(dlua_broadcast_shapes("add", 0, a, 2, b, &n, out), DLUA_OK);
  ck_assert_int_eq(n, 2);
  int64_t c[] = {2, 3}, d[] = {4};
  assert_error(dlua_broadcast_shapes("add", 2, c, 1, d, &n, out), DLUA_ERR_ARG, "add: shapes (2, 3) and (4) cannot broadcast");
  int64_t z[] = {0, 1}, z2[] = {3};
  ck_assert_int_eq(dlua_broadcast_shapes("mul", 2, z, 1, z2, &n, out), DLUA_OK);
  ck_assert_int_eq(out[0], 0);
  ck_assert_int_eq(out[1], 3);
}
END_TEST

START_TEST(test_prepare_out) {
  int64_t sizes[] = {2, 3};
  dlua_tensor_t *out = NULL;
  int allocated = -1;
  ck_assert_int_eq(dlua_prepare_out("add", &out, 2, sizes, DLUA_DTYPE_BF16, &allocated), DLUA_OK);
  ck_assert_int_eq(allocated, 1);
  assert_shape(out, 2, sizes);
  ck_assert_int_eq(dlua_tensor_dtype(out), DLUA_DTYPE_BF16);
  dlua_tensor_t *keep = out;
  ck_assert_int_eq(dlua_prepare_out("add", &out, 2, sizes, DLUA_DTYPE_F32, &allocated), DLUA_OK);
  ck_assert_int_eq(allocated, 0);
  ck_assert_ptr_eq(out, keep);
  int64_t other[] = {3, 2};
  assert_error(dlua_prepare_out("add", &out, 2, other, DLUA_DTYPE_F32, &allocated), DLUA_ERR_ARG,
               "add: output (2, 3) bfloat16 cpu does not have the result's shape (3, 2)");
  ck_assert_int_eq(dlua_prepare_out("add", &out, 2, sizes, DLUA_DTYPE_F32, NULL), DLUA_OK);
  dlua_tensor_free(out);
}
END_TEST

/* ---- views ---- */

START_TEST(test_view_contiguous) {
  int64_t sizes[] = {2, 3, 4};
  dlua_tensor_t *t = iota_f32(3, sizes), *v = NULL, *w = NULL;
  int64_t vs[] = {4, -1};
  ck_assert_int_eq(dlua_tensor_view(&v, t, 2, vs), DLUA_OK);
  int64_t want[] = {4, 6}, wst[] = {6, 1};
  assert_shape(v, 2, want);
  assert_strides(v, wst);
  ck_assert(dlua_tensor_same_storage(t, v));
  int64_t idx[] = {3, 5};
  ck_assert_double_eq(at_f32(v, idx), 23);
  // Size-1 dims anywhere, and back to 0-d through a 1-element view.
  int64_t ones[] = {1, 24, 1};
  ck_assert_int_eq(dlua_tensor_view(&w, t, 3, ones), DLUA_OK);
  dlua_tensor_free(w);
  int64_t two[] = {-1, -1};
  assert_error(dlua_tensor_view(&w, t, 2, two), DLUA_ERR_ARG, "view: only one dimension can be -1");
  int64_t bad[] = {5, 5};
  assert_error(dlua_tensor_view(&w, t, 2, bad), DLUA_ERR_ARG, "view: shape (5, 5) is invalid for (2, 3, 4) float32 cpu");
  int64_t bad2[] = {5, -1};
  assert_error(dlua_tensor_view(&w, t, 2, bad2), DLUA_ERR_ARG, "(24 elements)");
  int64_t one = 1;
  dlua_tensor_t *s = tu_new_t(1, &one, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_view(&w, s, 0, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(w), 0);
  dlua_tensor_free(w);
  dlua_tensor_free(s);
  dlua_tensor_free(v);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_view_impossible_and_reshape) {
  int64_t sizes[] = {3, 4};
  dlua_tensor_t *t = iota_f32(2, sizes), *tr = NULL, *v = NULL, *r = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  ck_assert(!dlua_tensor_is_contiguous(tr));
  int64_t flat = 12;
  assert_error(dlua_tensor_view(&v, tr, 1, &flat), DLUA_ERR_ARG, "view: cannot view (4, 3) float32 cpu with strides (1, 4) as (12)");
  ck_assert_ptr_null(v);
  ck_assert_int_eq(dlua_tensor_reshape(&r, tr, 1, &flat), DLUA_OK);
  ck_assert(!dlua_tensor_same_storage(r, t));
  double *vals = tu_values(r);
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) ck_assert_double_eq(vals[i * 3 + j], j * 4 + i);  // t[j][i]
  free(vals);
  dlua_tensor_free(r);
  // Splitting a dim of the transposed tensor is still a view.
  int64_t split[] = {2, 2, 3};
  ck_assert_int_eq(dlua_tensor_view(&v, tr, 3, split), DLUA_OK);
  int64_t sst[] = {2, 1, 4};
  assert_strides(v, sst);
  int64_t idx[] = {1, 0, 2};
  ck_assert_double_eq(at_f32(v, idx), 2 * 4 + 2);  // tr[2][2] = t[2][2]
  dlua_tensor_free(v);
  // reshape of a contiguous tensor is a view.
  int64_t r2[] = {6, 2};
  ck_assert_int_eq(dlua_tensor_reshape(&r, t, 2, r2), DLUA_OK);
  ck_assert(dlua_tensor_same_storage(r, t));
  dlua_tensor_free(r);
  // A column slice cannot merge its rows either.
  dlua_tensor_t *n = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&n, t, 1, 1, 2), DLUA_OK);
  int64_t six = 6;
  assert_error(dlua_tensor_view(&v, n, 1, &six), DLUA_ERR_ARG, "view:");
  ck_assert_int_eq(dlua_tensor_reshape(&r, n, 1, &six), DLUA_OK);
  vals = tu_values(r);
  const double want[] = {1, 2, 5, 6, 9, 10};
  for (int i = 0; i < 6; i++) ck_assert_double_eq(vals[i], want[i]);
  free(vals);
  dlua_tensor_free(r);
  dlua_tensor_free(n);
  // An expanded tensor views without a copy where the zero strides allow it.
  int64_t row = 3;
  dlua_tensor_t *base = iota_f32(1, &row), *e = NULL;
  int64_t es[] = {4, 3}, vs[] = {2, 2, 3}, vst[] = {0, 0, 1};
  ck_assert_int_eq(dlua_tensor_expand(&e, base, 2, es), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_view(&v, e, 3, vs), DLUA_OK);
  assert_strides(v, vst);
  dlua_tensor_free(v);
  int64_t twelve = 12;
  assert_error(dlua_tensor_view(&v, e, 1, &twelve), DLUA_ERR_ARG, "view:");
  dlua_tensor_free(e);
  dlua_tensor_free(base);
  dlua_tensor_free(tr);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_as_strided) {
  int64_t n = 10;
  dlua_tensor_t *t = iota_f32(1, &n), *v = NULL;
  int64_t sizes[] = {3, 3}, strides[] = {3, 1};
  ck_assert_int_eq(dlua_tensor_as_strided(&v, t, 2, sizes, strides, 1), DLUA_OK);
  int64_t idx[] = {2, 2};
  ck_assert_double_eq(at_f32(v, idx), 9);  // the very last element
  dlua_tensor_free(v);
  // Sliding windows overlap: legal for reading.
  int64_t ws[] = {4, 3}, wst[] = {2, 1};
  ck_assert_int_eq(dlua_tensor_as_strided(&v, t, 2, ws, wst, 0), DLUA_OK);
  double *vals = tu_values(v);
  ck_assert_double_eq(vals[3 * 3 + 2], 8);
  free(vals);
  dlua_tensor_free(v);
  assert_error(dlua_tensor_as_strided(&v, t, 2, sizes, strides, 2), DLUA_ERR_ARG, "reach element 10 of a storage holding 10");
  int64_t negst[] = {-1, 1};
  assert_error(dlua_tensor_as_strided(&v, t, 2, sizes, negst, 5), DLUA_ERR_ARG, "negative stride");
  int64_t zs[] = {0, 3};
  ck_assert_int_eq(dlua_tensor_as_strided(&v, t, 2, zs, strides, 10), DLUA_OK);  // empty at the end: fine
  dlua_tensor_free(v);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_narrow_slice_select) {
  int64_t sizes[] = {5, 7};
  dlua_tensor_t *t = iota_f32(2, sizes), *n = NULL, *s = NULL, *e = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&n, t, 1, 2, 3), DLUA_OK);
  int64_t ns[] = {5, 3};
  assert_shape(n, 2, ns);
  ck_assert_int_eq(dlua_tensor_offset(n), 2);
  double *vals = tu_values(n);
  for (int i = 0; i < 5; i++)
    for (int j = 0; j < 3; j++) ck_assert_double_eq(vals[i * 3 + j], i * 7 + 2 + j);
  free(vals);
  assert_error(dlua_tensor_narrow(&e, t, 1, 5, 3), DLUA_ERR_ARG, "narrow: start 5 and length 3 exceed dimension 1 (size 7)");
  assert_error(dlua_tensor_narrow(&e, t, 2, 0, 1), DLUA_ERR_ARG, "narrow: dimension 2 out of range for (5, 7) float32 cpu");
  // slice rows 1, 3 (stop 5 is past... no: [1, 5) by 2) of the narrowed view.
  ck_assert_int_eq(dlua_tensor_slice(&s, n, 0, 1, 5, 2), DLUA_OK);
  int64_t ss[] = {2, 3}, sst[] = {14, 1};
  assert_shape(s, 2, ss);
  assert_strides(s, sst);
  vals = tu_values(s);
  const double want[] = {9, 10, 11, 23, 24, 25};
  for (int i = 0; i < 6; i++) ck_assert_double_eq(vals[i], want[i]);
  free(vals);
  dlua_tensor_free(s);
  ck_assert_int_eq(dlua_tensor_slice(&s, t, 1, 0, 100, 3), DLUA_OK);  // stop clamps: columns 0, 3, 6
  ck_assert_int_eq(dlua_tensor_sizes(s)[1], 3);
  dlua_tensor_free(s);
  ck_assert_int_eq(dlua_tensor_slice(&s, t, 1, 4, 2, 1), DLUA_OK);  // empty
  ck_assert_int_eq(dlua_tensor_numel(s), 0);
  dlua_tensor_free(s);
  assert_error(dlua_tensor_slice(&s, t, 1, 0, 3, 0), DLUA_ERR_ARG, "slice: step must be positive");
  assert_error(dlua_tensor_slice(&s, t, 1, 8, 9, 1), DLUA_ERR_ARG, "slice: [8, 9) is out of range");
  ck_assert_int_eq(dlua_tensor_select(&s, n, 1, 2), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(s), 1);
  vals = tu_values(s);
  for (int i = 0; i < 5; i++) ck_assert_double_eq(vals[i], i * 7 + 4);
  free(vals);
  dlua_tensor_free(s);
  assert_error(dlua_tensor_select(&s, t, 0, 5), DLUA_ERR_ARG, "select: index 5 out of range for dimension 0 (size 5)");
  // select down to 0-d.
  dlua_tensor_t *row = NULL;
  ck_assert_int_eq(dlua_tensor_select(&row, t, 0, 4), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_select(&s, row, 0, 6), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(s), 0);
  ck_assert_float_eq(*(float *)dlua_tensor_data(s), 34);
  dlua_tensor_free(s);
  dlua_tensor_free(row);
  dlua_tensor_free(n);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_transpose_permute) {
  int64_t sizes[] = {2, 3, 5};
  dlua_tensor_t *t = iota_f32(3, sizes), *p = NULL;
  int perm[] = {2, 0, 1};
  ck_assert_int_eq(dlua_tensor_permute(&p, t, perm), DLUA_OK);
  int64_t ps[] = {5, 2, 3}, pst[] = {1, 15, 5};
  assert_shape(p, 3, ps);
  assert_strides(p, pst);
  double *vals = tu_values(p);
  for (int k = 0; k < 5; k++)
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 3; j++) ck_assert_double_eq(vals[(k * 2 + i) * 3 + j], i * 15 + j * 5 + k);
  free(vals);
  dlua_tensor_free(p);
  int dup[] = {0, 0, 1};
  assert_error(dlua_tensor_permute(&p, t, dup), DLUA_ERR_ARG, "permute: (0, 0, 1) is not a permutation");
  int oob[] = {0, 1, 3};
  assert_error(dlua_tensor_permute(&p, t, oob), DLUA_ERR_ARG, "permute:");
  ck_assert_int_eq(dlua_tensor_transpose(&p, t, 0, 2), DLUA_OK);
  int64_t ts[] = {5, 3, 2}, tst[] = {1, 5, 15};
  assert_shape(p, 3, ts);
  assert_strides(p, tst);
  dlua_tensor_free(p);
  assert_error(dlua_tensor_transpose(&p, t, 0, 3), DLUA_ERR_ARG, "transpose: dimension 3 out of range");
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_expand_squeeze_unsqueeze_flatten) {
  int64_t sizes[] = {3, 1};
  dlua_tensor_t *t = iota_f32(2, sizes), *e = NULL, *s = NULL, *u = NULL, *f = NULL;
  int64_t es[] = {2, -1, 4};
  ck_assert_int_eq(dlua_tensor_expand(&e, t, 3, es), DLUA_OK);
  int64_t want[] = {2, 3, 4}, wst[] = {0, 1, 0};
  assert_shape(e, 3, want);
  assert_strides(e, wst);
  double *vals = tu_values(e);
  for (int a = 0; a < 2; a++)
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 4; j++) ck_assert_double_eq(vals[(a * 3 + i) * 4 + j], i);
  free(vals);
  int64_t bad[] = {4, 4};
  assert_error(dlua_tensor_expand(&s, t, 2, bad), DLUA_ERR_ARG, "expand: cannot expand (3, 1) float32 cpu to (4, 4)");
  int64_t bad2[] = {-1, 3, 1};
  assert_error(dlua_tensor_expand(&s, t, 3, bad2), DLUA_ERR_ARG, "expand:");
  int64_t z[] = {3, 0};
  ck_assert_int_eq(dlua_tensor_expand(&s, t, 2, z), DLUA_OK);  // size 1 may expand to 0
  dlua_tensor_free(s);

  ck_assert_int_eq(dlua_tensor_squeeze(&s, t, -1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(s), 1);
  dlua_tensor_free(s);
  ck_assert_int_eq(dlua_tensor_squeeze(&s, t, 0), DLUA_OK);  // size 3: no-op
  ck_assert_int_eq(dlua_tensor_ndim(s), 2);
  dlua_tensor_free(s);
  assert_error(dlua_tensor_squeeze(&s, t, 2), DLUA_ERR_ARG, "squeeze: dimension 2 out of range");

  ck_assert_int_eq(dlua_tensor_unsqueeze(&u, t, 0), DLUA_OK);
  int64_t us[] = {1, 3, 1};
  assert_shape(u, 3, us);
  ck_assert(dlua_tensor_is_contiguous(u));
  dlua_tensor_free(u);
  ck_assert_int_eq(dlua_tensor_unsqueeze(&u, t, 2), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_sizes(u)[2], 1);
  ck_assert(dlua_tensor_is_contiguous(u));
  dlua_tensor_free(u);
  assert_error(dlua_tensor_unsqueeze(&u, t, 3), DLUA_ERR_ARG, "unsqueeze: dimension 3 out of range");
  int64_t eight[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  dlua_tensor_t *full = tu_new_t(8, eight, DLUA_DTYPE_U8);
  assert_error(dlua_tensor_unsqueeze(&u, full, 0), DLUA_ERR_ARG, "maximum of 8");
  dlua_tensor_free(full);

  // flatten: a view on contiguous input, a copy on an expanded one.
  ck_assert_int_eq(dlua_tensor_flatten(&f, e, 1, 2), DLUA_OK);
  int64_t fs[] = {2, 12};
  assert_shape(f, 2, fs);
  ck_assert(!dlua_tensor_same_storage(f, t));
  vals = tu_values(f);
  ck_assert_double_eq(vals[12 + 11], 2);
  free(vals);
  dlua_tensor_free(f);
  ck_assert_int_eq(dlua_tensor_flatten(&f, t, 0, 1), DLUA_OK);
  ck_assert(dlua_tensor_same_storage(f, t));
  ck_assert_int_eq(dlua_tensor_ndim(f), 1);
  dlua_tensor_free(f);
  assert_error(dlua_tensor_flatten(&f, t, 1, 0), DLUA_ERR_ARG, "flatten: start_dim 1 is after end_dim 0");
  dlua_tensor_t *scalar = tu_new_t(0, NULL, DLUA_DTYPE_F32);
  assert_error(dlua_tensor_narrow(&f, scalar, 0, 0, 1), DLUA_ERR_ARG, "narrow: dimension 0 out of range for () float32 cpu, which has no dimensions");
  ck_assert_int_eq(dlua_tensor_squeeze(&f, scalar, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(f), 0);
  dlua_tensor_free(f);
  ck_assert_int_eq(dlua_tensor_flatten(&f, scalar, 0, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(f), 1);
  dlua_tensor_free(f);
  dlua_tensor_free(scalar);
  dlua_tensor_free(e);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_contiguous_clone) {
  int64_t sizes[] = {4, 5};
  dlua_tensor_t *t = iota_f32(2, sizes), *c = NULL, *tr = NULL;
  ck_assert_int_eq(dlua_tensor_contiguous(&c, t), DLUA_OK);
  ck_assert(dlua_tensor_same_storage(c, t));
  dlua_tensor_free(c);
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_contiguous(&c, tr), DLUA_OK);
  ck_assert(!dlua_tensor_same_storage(c, t));
  ck_assert(dlua_tensor_is_contiguous(c));
  int64_t idx[] = {3, 2};
  ck_assert_double_eq(at_f32(c, idx), 2 * 5 + 3);
  dlua_tensor_free(c);
  ck_assert_int_eq(dlua_tensor_clone(&c, t), DLUA_OK);
  ck_assert(!dlua_tensor_same_storage(c, t));
  ((float *)dlua_tensor_data(c))[0] = 99;
  ck_assert_float_eq(((float *)dlua_tensor_data(t))[0], 0);
  dlua_tensor_free(c);
  dlua_tensor_free(tr);
  dlua_tensor_free(t);
}
END_TEST

/* ---- copy_ ---- */

START_TEST(test_copy_broadcast_and_errors) {
  int64_t ds[] = {3, 4}, ss[] = {4}, col[] = {3, 1};
  dlua_tensor_t *dst = tu_new_t(2, ds, DLUA_DTYPE_F64), *src = iota_f32(1, ss), *c = iota_f32(2, col);
  ck_assert_int_eq(dlua_tensor_copy_(dst, src), DLUA_OK);
  const double *d = dlua_tensor_data(dst);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++) ck_assert_double_eq(d[i * 4 + j], j);
  ck_assert_int_eq(dlua_tensor_copy_(dst, c), DLUA_OK);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++) ck_assert_double_eq(d[i * 4 + j], i);
  int64_t lead[] = {1, 1, 4};
  dlua_tensor_t *l = iota_f32(3, lead);
  ck_assert_int_eq(dlua_tensor_copy_(dst, l), DLUA_OK);  // extra leading size-1 dims are fine
  int64_t bad[] = {2, 4};
  dlua_tensor_t *b = iota_f32(2, bad);
  assert_error(dlua_tensor_copy_(dst, b), DLUA_ERR_ARG, "copy_: source (2, 4) float32 cpu cannot broadcast to destination (3, 4) float64 cpu");
  dlua_tensor_t *e = NULL;
  ck_assert_int_eq(dlua_tensor_expand(&e, src, 2, ds), DLUA_OK);
  assert_error(dlua_tensor_copy_(e, dst), DLUA_ERR_ARG, "copy_: destination (3, 4) float32 cpu is expanded");
  assert_error(dlua_tensor_copy_(NULL, dst), DLUA_ERR_ARG, "copy_: the tensor is NULL");
  dlua_tensor_free(e);
  dlua_tensor_free(b);
  dlua_tensor_free(l);
  dlua_tensor_free(c);
  dlua_tensor_free(src);
  dlua_tensor_free(dst);
}
END_TEST

START_TEST(test_copy_noncontiguous_and_overlap) {
  int64_t sizes[] = {6, 7};
  dlua_tensor_t *t = iota_f32(2, sizes), *tr = NULL, *dst = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  int64_t ds[] = {7, 6};
  ck_assert_int_eq(dlua_tensor_zeros(&dst, 2, ds, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *dtr = NULL;
  // Transposed into transposed: both non-contiguous.
  ck_assert_int_eq(dlua_tensor_transpose(&dtr, dst, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_copy_(dtr, t), DLUA_OK);
  const int32_t *p = dlua_tensor_data(dst);
  for (int i = 0; i < 7; i++)
    for (int j = 0; j < 6; j++) ck_assert_int_eq(p[i * 6 + j], j * 7 + i);
  dlua_tensor_free(dtr);
  dlua_tensor_free(dst);
  // Overlapping shift inside one storage: t[:, 1:] = t[:, :-1] must read before writing.
  dlua_tensor_t *a = NULL, *b = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&a, t, 1, 1, 6), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_narrow(&b, t, 1, 0, 6), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_copy_(a, b), DLUA_OK);
  const float *f = dlua_tensor_data(t);
  for (int i = 0; i < 6; i++) {
    ck_assert_float_eq(f[i * 7], i * 7);
    for (int j = 1; j < 7; j++) ck_assert_float_eq(f[i * 7 + j], i * 7 + j - 1);
  }
  // Contiguous overlapping shift (memmove path).
  int64_t n = 10;
  dlua_tensor_t *v = iota_f32(1, &n), *x = NULL, *y = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&x, v, 0, 0, 8), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_narrow(&y, v, 0, 2, 8), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_copy_(x, y), DLUA_OK);
  for (int i = 0; i < 8; i++) ck_assert_float_eq(((float *)dlua_tensor_data(v))[i], i + 2);
  dlua_tensor_free(x);
  dlua_tensor_free(y);
  dlua_tensor_free(v);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(tr);
  dlua_tensor_free(t);
}
END_TEST

/* Large, prime-sized, non-contiguous and converting: the parallel iterator against a loop. */
START_TEST(test_copy_large_parallel) {
  int64_t sizes[] = {401, 331};
  dlua_tensor_t *t = iota_f32(2, sizes), *tr = NULL, *out = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  int64_t os[] = {331, 401};
  for (int threads = 1; threads <= 3; threads += 2) {
    omp_set_num_threads(threads);
    ck_assert_int_eq(dlua_tensor_empty(&out, 2, os, DLUA_DTYPE_BF16, DLUA_CPU), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_copy_(out, tr), DLUA_OK);
    const uint16_t *h = dlua_tensor_data(out);
    for (int i = 0; i < 331; i++)
      for (int j = 0; j < 401; j++)
        if (h[i * 401 + j] != dlua_f32_to_bf16((float)(j * 331 + i)))
          ck_abort_msg("threads %d: element (%d, %d) wrong", threads, i, j);
    dlua_tensor_free(out);
    out = NULL;
  }
  // Batched transpose with edge tiles: (5, 37, 70) -> permuted (5, 70, 37), converting to f64.
  int64_t bs[] = {5, 37, 70}, ps[] = {5, 70, 37};
  int perm[] = {0, 2, 1};
  dlua_tensor_t *bt = iota_f32(3, bs), *bp = NULL, *bo = NULL;
  ck_assert_int_eq(dlua_tensor_permute(&bp, bt, perm), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_empty(&bo, 3, ps, DLUA_DTYPE_F64, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_copy_(bo, bp), DLUA_OK);
  const double *bv = dlua_tensor_data(bo);
  for (int b = 0; b < 5; b++)
    for (int i = 0; i < 70; i++)
      for (int j = 0; j < 37; j++) ck_assert_double_eq(bv[(b * 70 + i) * 37 + j], b * 37 * 70 + j * 70 + i);
  dlua_tensor_free(bo);
  dlua_tensor_free(bp);
  dlua_tensor_free(bt);
  // Same-dtype contiguous copy of several MiB (parallel memcpy path).
  int64_t big = (3 << 20) + 7;
  dlua_tensor_t *s = iota_f32(1, &big), *d = tu_new_t(1, &big, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_copy_(d, s), DLUA_OK);
  ck_assert_mem_eq(dlua_tensor_data(d), dlua_tensor_data(s), (size_t)big * 4);
  dlua_tensor_free(d);
  dlua_tensor_free(s);
  dlua_tensor_free(tr);
  dlua_tensor_free(t);
}
END_TEST

START_TEST(test_data_round_trip) {
  const int32_t data[6] = {5, -4, 3, -2, 1, 0};
  int64_t sizes[] = {2, 3};
  dlua_tensor_t *t = NULL, *tr = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, 2, sizes, DLUA_DTYPE_I32, data), DLUA_OK);
  int32_t back[6];
  ck_assert_int_eq(dlua_tensor_to_data(t, back, sizeof back), DLUA_OK);
  ck_assert_mem_eq(back, data, sizeof data);
  ck_assert_int_eq(dlua_tensor_transpose(&tr, t, 0, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_to_data(tr, back, sizeof back), DLUA_OK);
  const int32_t want[6] = {5, -2, -4, 1, 3, 0};
  ck_assert_mem_eq(back, want, sizeof want);
  assert_error(dlua_tensor_to_data(t, back, 5), DLUA_ERR_ARG, "to_data: (2, 3) int32 cpu needs 24 bytes, the buffer has 5");
  dlua_tensor_free(tr);
  assert_error(dlua_tensor_from_data(&tr, 2, sizes, DLUA_DTYPE_I32, NULL), DLUA_ERR_ARG, "from_data: data is NULL");
  dlua_tensor_free(t);
}
END_TEST

/* ---- fills and ranges ---- */

START_TEST(test_fill) {
  int64_t sizes[] = {3, 5};
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
    dlua_tensor_t *t = tu_new_t(2, sizes, (dlua_dtype_t)d), *n = NULL;
    ck_assert_int_eq(dlua_tensor_fill_(t, -2.75), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_narrow(&n, t, 1, 1, 3), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_fill_(n, 7), DLUA_OK);  // non-contiguous fill
    double *v = tu_values(t);
    double other = d == DLUA_DTYPE_BOOL ? 1 : d == DLUA_DTYPE_U8 ? 254 : dlua_dtype_is_floating((dlua_dtype_t)d) ? -2.75 : -2;
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 5; j++)
        ck_assert_msg(v[i * 5 + j] == ((j >= 1 && j <= 3) ? (d == DLUA_DTYPE_BOOL ? 1 : 7) : other),
                      "%s element (%d, %d) = %g", dlua_dtype_name((dlua_dtype_t)d), i, j, v[i * 5 + j]);
    free(v);
    dlua_tensor_free(n);
    dlua_tensor_free(t);
  }
}
END_TEST

START_TEST(test_arange) {
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_arange(&t, 0, 10, 3, DLUA_DTYPE_I64), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 4);  // 0 3 6 9
  ck_assert_int_eq(((int64_t *)dlua_tensor_data(t))[3], 9);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_arange(&t, 1, 2.5, 0.5, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 3);
  ck_assert_float_eq(((float *)dlua_tensor_data(t))[2], 2.0f);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_arange(&t, 5, -1, -2, DLUA_DTYPE_I32), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 3);  // 5 3 1
  ck_assert_int_eq(((int32_t *)dlua_tensor_data(t))[2], 1);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_arange(&t, 3, 3, 1, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 0);
  dlua_tensor_free(t);
  // A length computed by ceil of a quotient that is not exact: (1 - 0) / 0.1 = 10 (rounded).
  ck_assert_int_eq(dlua_tensor_arange(&t, 0, 1, 0.1, DLUA_DTYPE_F64), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), (int64_t)ceil(1.0 / 0.1));
  ck_assert_double_eq_tol(((double *)dlua_tensor_data(t))[7], 0.7, 1e-15);
  dlua_tensor_free(t);
  int64_t n = 200003;
  ck_assert_int_eq(dlua_tensor_arange(&t, 0, (double)n, 1, DLUA_DTYPE_I32), DLUA_OK);
  const int32_t *p = dlua_tensor_data(t);
  for (int64_t i = 0; i < n; i++)
    if (p[i] != i) ck_abort_msg("arange element %lld is %d", (long long)i, p[i]);
  dlua_tensor_free(t);
  assert_error(dlua_tensor_arange(&t, 0, 1, 0, DLUA_DTYPE_F32), DLUA_ERR_ARG, "arange: step must be nonzero");
  assert_error(dlua_tensor_arange(&t, 0, 5, -1, DLUA_DTYPE_F32), DLUA_ERR_ARG, "arange:");
  assert_error(dlua_tensor_arange(&t, 0, INFINITY, 1, DLUA_DTYPE_F32), DLUA_ERR_ARG, "must be finite");
}
END_TEST

START_TEST(test_linspace_eye) {
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_linspace(&t, -1, 1, 5, DLUA_DTYPE_F64), DLUA_OK);
  const double want[] = {-1, -0.5, 0, 0.5, 1};
  for (int i = 0; i < 5; i++) ck_assert_double_eq(((double *)dlua_tensor_data(t))[i], want[i]);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_linspace(&t, 0, 0.3, 7, DLUA_DTYPE_F32), DLUA_OK);
  ck_assert_float_eq(((float *)dlua_tensor_data(t))[6], 0.3f);  // last value is exactly end
  ck_assert_float_eq(((float *)dlua_tensor_data(t))[0], 0.0f);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_linspace(&t, 4, 9, 1, DLUA_DTYPE_I32), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 1);
  ck_assert_int_eq(((int32_t *)dlua_tensor_data(t))[0], 4);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_linspace(&t, 4, 9, 0, DLUA_DTYPE_I32), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 0);
  dlua_tensor_free(t);
  assert_error(dlua_tensor_linspace(&t, 0, 1, -1, DLUA_DTYPE_F32), DLUA_ERR_ARG, "linspace: steps must be non-negative");

  ck_assert_int_eq(dlua_tensor_eye(&t, 3, 5, DLUA_DTYPE_BF16), DLUA_OK);
  double *v = tu_values(t);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5; j++) ck_assert_double_eq(v[i * 5 + j], i == j);
  free(v);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_eye(&t, 4, -1, DLUA_DTYPE_BOOL), DLUA_OK);
  int64_t sq[] = {4, 4};
  assert_shape(t, 2, sq);
  ck_assert_uint_eq(((uint8_t *)dlua_tensor_data(t))[15], 1);
  ck_assert_uint_eq(((uint8_t *)dlua_tensor_data(t))[14], 0);
  dlua_tensor_free(t);
  ck_assert_int_eq(dlua_tensor_eye(&t, 0, 0, DLUA_DTYPE_F32), DLUA_OK);
  dlua_tensor_free(t);
  assert_error(dlua_tensor_eye(&t, -2, 3, DLUA_DTYPE_F32), DLUA_ERR_ARG, "eye: n must be non-negative");
}
END_TEST

int main(void) {
  Suite *s = suite_create("tensor");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_empty_layout);
  tcase_add_test(tc, test_zeros_and_prime_sizes);
  tcase_add_test(tc, test_zero_size_dims);
  tcase_add_test(tc, test_bad_creation);
  tcase_add_test(tc, test_oom_reports_bytes);
  tcase_add_test(tc, test_refcount_frees_with_last_view);
  tcase_add_test(tc, test_wrap);
  tcase_add_test(tc, test_shape_helpers);
  tcase_add_test(tc, test_prepare_out);
  tcase_add_test(tc, test_view_contiguous);
  tcase_add_test(tc, test_view_impossible_and_reshape);
  tcase_add_test(tc, test_as_strided);
  tcase_add_test(tc, test_narrow_slice_select);
  tcase_add_test(tc, test_transpose_permute);
  tcase_add_test(tc, test_expand_squeeze_unsqueeze_flatten);
  tcase_add_test(tc, test_contiguous_clone);
  tcase_add_test(tc, test_copy_broadcast_and_errors);
  tcase_add_test(tc, test_copy_noncontiguous_and_overlap);
  tcase_add_test(tc, test_copy_large_parallel);
  tcase_add_test(tc, test_data_round_trip);
  tcase_add_test(tc, test_fill);
  tcase_add_test(tc, test_arange);
  tcase_add_test(tc, test_linspace_eye);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/core/alloc.c: live/peak counters and the CPU block cache. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

START_TEST(test_large_blocks_are_reused) {
  dlua_memory_empty_cache(DLUA_CPU);
  int64_t live0 = dlua_memory_allocated(DLUA_CPU);
  size_t n = (size_t)3 << 20;  // 3 MiB: above the cache threshold
  void *a = dlua_cpu_alloc(n);
  ck_assert_ptr_nonnull(a);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU) - live0, (int64_t)n);
  ck_assert_int_eq((uintptr_t)a % 64, 0);
  dlua_cpu_free(a, n);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), live0);
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), (int64_t)n);
  void *b = dlua_cpu_alloc(n);
  ck_assert_ptr_eq(a, b);  // the same block back, no new mapping
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), 0);
  // a size within the same page reuses it too; another size does not
  dlua_cpu_free(b, n);
  void *c = dlua_cpu_alloc(n - 100);
  ck_assert_ptr_eq(a, c);
  dlua_cpu_free(c, n - 100);
  void *d = dlua_cpu_alloc(2 * n);
  ck_assert_ptr_ne(a, d);
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), (int64_t)n);
  dlua_cpu_free(d, 2 * n);
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), (int64_t)(3 * n));
  dlua_memory_empty_cache(DLUA_CPU);
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), 0);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), live0);
}
END_TEST

START_TEST(test_small_blocks_are_not_cached) {
  dlua_memory_empty_cache(DLUA_CPU);
  void *a = dlua_cpu_alloc(1000);
  ck_assert_ptr_nonnull(a);
  dlua_cpu_free(a, 1000);
  ck_assert_int_eq(dlua_memory_cached(DLUA_CPU), 0);
}
END_TEST

START_TEST(test_tensor_storage_goes_through_the_cache) {
  dlua_memory_empty_cache(DLUA_CPU);
  int64_t sizes[2] = {512, 1024};  // 2 MiB of float32
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&t, 2, sizes, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  void *p = dlua_tensor_data(t);
  dlua_tensor_free(t);
  ck_assert_int_ge(dlua_memory_cached(DLUA_CPU), 512 * 1024 * 4);
  dlua_tensor_t *u = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&u, 2, sizes, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_ptr_eq(p, dlua_tensor_data(u));
  const float *f = dlua_tensor_data(u);
  for (int i = 0; i < 512 * 1024; i += 4099) ck_assert(f[i] == 0.0f);  // zeros really zeroes a reused block
  dlua_tensor_free(u);
  dlua_memory_empty_cache(DLUA_CPU);
}
END_TEST

START_TEST(test_impossible_size_reports_bytes) {
  void *p = dlua_cpu_alloc((size_t)1 << 62);
  ck_assert_ptr_null(p);
  ck_assert_int_eq(dlua_last_status(), DLUA_ERR_OOM);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "4611686018427387904 bytes"));
}
END_TEST

int main(void) {
  Suite *s = suite_create("alloc");
  TCase *tc = tcase_create("cpu");
  tcase_add_test(tc, test_large_blocks_are_reused);
  tcase_add_test(tc, test_small_blocks_are_not_cached);
  tcase_add_test(tc, test_tensor_storage_goes_through_the_cache);
  tcase_add_test(tc, test_impossible_size_reports_bytes);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

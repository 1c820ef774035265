/* Check suite for host/ops/backend.c: which table a device gets, and the two messages every op shares. */
#include <check.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "ops/backend.h"

#include "testutil.h"

START_TEST(test_cpu_table) {
  const dlua_backend_t *be = NULL;
  ck_assert_int_eq(dlua_backend_for("probe", DLUA_CPU, &be), DLUA_OK);
  ck_assert_ptr_nonnull(be);
  ck_assert_str_eq(be->name, "cpu");
}
END_TEST

START_TEST(test_cuda_table_or_one_message) {
  const dlua_backend_t *be = NULL;
  dlua_status_t s = dlua_backend_for("conv2d", 0, &be);
  if (dlua_cuda_device_count() > 0) {
    ck_assert_int_eq(s, DLUA_OK);
    ck_assert_str_eq(be->name, "cuda");
  } else {
    ck_assert_int_eq(s, DLUA_ERR_ARG);
    ck_assert_ptr_null(be);
    ck_assert_ptr_nonnull(strstr(dlua_last_error(), "conv2d: no CUDA device available ("));
    ck_assert_ptr_nonnull(strstr(dlua_last_error(), dlua_cuda_unavailable_reason()));
  }
}
END_TEST

START_TEST(test_unsupported_names_op_and_backend) {
  dlua_backend_t fake = {.name = "cuda"};
  ck_assert_int_eq(dlua_backend_unsupported("max_pool2d", &fake), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "max_pool2d: not supported on cuda"));
}
END_TEST

int main(void) {
  Suite *s = suite_create("backend");
  TCase *tc = tcase_create("registry");
  tcase_add_test(tc, test_cpu_table);
  tcase_add_test(tc, test_cuda_table_or_one_message);
  tcase_add_test(tc, test_unsupported_names_op_and_backend);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

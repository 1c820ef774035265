/* Check suite for host/core/error.c and runtime.c: messages, statuses, thread-locality. */
#include <check.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/runtime.h"
#include "core/api.h"

#include "testutil.h"

START_TEST(test_message_has_file_and_line) {
  dlua_clear_error();
  dlua_status_t s = DLUA_ERR(DLUA_ERR_ARG, "add: shapes (%d) and (%d) differ", 3, 4);
  ck_assert_int_eq(s, DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_last_status(), DLUA_ERR_ARG);
  const char *m = dlua_last_error();
  ck_assert_ptr_nonnull(strstr(m, "add: shapes (3) and (4) differ"));
  ck_assert_ptr_nonnull(strstr(m, "test_error.c:"));
  dlua_clear_error();
  ck_assert_str_eq(dlua_last_error(), "");
  ck_assert_int_eq(dlua_last_status(), DLUA_OK);
}
END_TEST

START_TEST(test_long_message_truncated_not_overflowing) {
  char big[5000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  DLUA_ERR(DLUA_ERR_IO, "%s", big);
  ck_assert_uint_lt(strlen(dlua_last_error()), 2048);
}
END_TEST

static void *other_thread(void *arg) {
  (void)arg;
  DLUA_ERR(DLUA_ERR_IO, "from the other thread");
  return NULL;
}

START_TEST(test_thread_local) {
  DLUA_ERR(DLUA_ERR_ARG, "main thread");
  pthread_t t;
  pthread_create(&t, NULL, other_thread, NULL);
  pthread_join(t, NULL);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "main thread"));
  ck_assert_int_eq(dlua_last_status(), DLUA_ERR_ARG);
}
END_TEST

START_TEST(test_status_names) {
  ck_assert_str_eq(dlua_status_name(DLUA_OK), "ok");
  ck_assert_str_eq(dlua_status_name(DLUA_ERR_OOM), "out of memory");
  ck_assert_str_eq(dlua_status_name(DLUA_STATUS_COUNT), "unknown status");
  for (int s = 0; s < DLUA_STATUS_COUNT; s++) ck_assert_ptr_nonnull(dlua_status_name((dlua_status_t)s));
}
END_TEST

START_TEST(test_threads_setter) {
  ck_assert_int_eq(dlua_set_num_threads(3), DLUA_OK);
  ck_assert_int_eq(dlua_get_num_threads(), 3);
  ck_assert_int_eq(dlua_set_num_threads(0), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "got 0"));
  ck_assert_int_eq(dlua_get_num_threads(), 3);
}
END_TEST

START_TEST(test_interrupt_flag) {
  dlua_interrupt_set(1);
  ck_assert_int_eq(dlua_interrupt_pending(), 1);
  dlua_interrupt_set(0);
  ck_assert_int_eq(dlua_interrupt_pending(), 0);
}
END_TEST

START_TEST(test_versions) {
  ck_assert_str_eq(dlua_version(), DLUA_VERSION_STRING);
  const char *cuda = dlua_cuda_build_info();
  if (dlua_has_cuda_build())
    ck_assert_ptr_nonnull(strstr(cuda, "cuDNN"));
  else
    ck_assert_str_eq(cuda, "no CUDA");
}
END_TEST

int main(void) {
  Suite *s = suite_create("error");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, test_message_has_file_and_line);
  tcase_add_test(tc, test_long_message_truncated_not_overflowing);
  tcase_add_test(tc, test_thread_local);
  tcase_add_test(tc, test_status_names);
  tcase_add_test(tc, test_threads_setter);
  tcase_add_test(tc, test_interrupt_flag);
  tcase_add_test(tc, test_versions);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

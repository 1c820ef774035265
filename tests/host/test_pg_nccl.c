/* Check suite for the NCCL group's no-GPU answers (host/comm/pg_registry.c) and the grouped all-reduce (pg.c) on gloo. */
#define _GNU_SOURCE
#include <check.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"

#include "testutil.h"

static const char *TOKEN = "pg-nccl-test-41d2";

/* Without a device (or without CUDA) the constructor fails at once, saying why; with one, a device
   that does not exist is named. Neither touches the store (nothing listens on port 1). */
START_TEST(test_nccl_new_errors) {
  dlua_pg_t *pg = (dlua_pg_t *)1;
  if (dlua_cuda_device_count() == 0) {
    ck_assert_int_eq(dlua_pg_nccl_new("127.0.0.1", 1, TOKEN, "nccl0", 0, 1, 0, 1000, &pg), DLUA_ERR_ARG);
    ck_assert_ptr_null(pg);
    ck_assert_msg(strstr(dlua_last_error(), "process group nccl0: nccl: no CUDA device available ("), "%s",
                  dlua_last_error());
    ck_assert_msg(strstr(dlua_last_error(), dlua_cuda_unavailable_reason()), "%s", dlua_last_error());
  } else {
    ck_assert_int_eq(dlua_pg_nccl_new("127.0.0.1", 1, TOKEN, "nccl0", 0, 1, 999, 1000, &pg), DLUA_ERR_ARG);
    ck_assert_msg(strstr(dlua_last_error(), "no device cuda:999"), "%s", dlua_last_error());
  }
  ck_assert_str_eq(dlua_pg_backend(NULL), "");
  // The backend registry knows NCCL even where it is not built, and says why it cannot be used.
  if (!strcmp(dlua_cuda_unavailable_reason(), "built without CUDA"))
    ck_assert_str_eq(dlua_pg_nccl_unavailable() ? dlua_pg_nccl_unavailable() : "(null)", "built without CUDA");
}
END_TEST

/* ---- all_reduce_many on gloo: forked ranks, results against local sums -------------------------- */

#define EXPECT(cond, ...)                                          \
  do {                                                             \
    if (!(cond)) {                                                 \
      fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                \
      fputc('\n', stderr);                                         \
      return 1;                                                    \
    }                                                              \
  } while (0)

enum { NT = 5 };
static const dlua_dtype_t DT[NT] = {DLUA_DTYPE_F32, DLUA_DTYPE_I64, DLUA_DTYPE_BF16, DLUA_DTYPE_BOOL, DLUA_DTYPE_F64};
static const int64_t N[NT] = {1009, 1, 0, 37, 5};  // the f64 one is a strided view

static double v(int k, int rank, int64_t i) {
  if (DT[k] == DLUA_DTYPE_BOOL) return (i + rank + k) % 3 == 0;
  return (double)((i * 3 + rank * 5 + k) % 7 - 3);
}

static void *el(const dlua_tensor_t *t, int64_t i) {
  return (char *)dlua_tensor_ptr(t) + i * t->strides[0] * (int64_t)dlua_dtype_size(t->dtype);
}

static int make(int k, int rank, dlua_tensor_t **out, dlua_tensor_t **base) {
  int64_t n = N[k];
  *base = NULL;
  if (k == NT - 1) {  // (n, 2)[:, 1]: not contiguous, staged
    int64_t sz[2] = {n, 2};
    if (dlua_tensor_zeros(base, 2, sz, DT[k], DLUA_CPU) != DLUA_OK) return 1;
    if (dlua_tensor_select(out, *base, 1, 1) != DLUA_OK) return 1;
  } else if (dlua_tensor_zeros(out, 1, &n, DT[k], DLUA_CPU) != DLUA_OK) {
    return 1;
  }
  for (int64_t i = 0; i < n; i++) tu_put(DT[k], el(*out, i), 0, v(k, rank, i));
  return 0;
}

static int body(int port, int rank, int size) {
  dlua_pg_t *pg = NULL;
  EXPECT(dlua_pg_gloo_new("127.0.0.1", port, TOKEN, "pg0", rank, size, 20000, &pg) == DLUA_OK, "join: %s",
         dlua_last_error());
  EXPECT(!strcmp(dlua_pg_backend(pg), "gloo"), "backend %s", dlua_pg_backend(pg));
  dlua_pg_set_debug(pg, 1);  // the fingerprint of a list: every rank agrees
  for (int round = 0; round < 2; round++) {
    dlua_reduce_t op = round == 0 ? DLUA_PG_REDUCE_SUM : DLUA_PG_REDUCE_MAX;
    dlua_tensor_t *ts[NT], *bases[NT];
    for (int k = 0; k < NT; k++) EXPECT(make(k, rank, &ts[k], &bases[k]) == 0, "make %d", k);
    dlua_work_t *w = NULL;
    EXPECT(dlua_pg_all_reduce_many(pg, ts, NT, op, "many.lua:1", round ? &w : NULL) == DLUA_OK, "%s",
           dlua_last_error());
    if (w) {
      EXPECT(dlua_work_wait(w, -1) == DLUA_OK, "wait: %s", dlua_last_error());
      dlua_work_free(w);
    }
    for (int k = 0; k < NT; k++) {
      for (int64_t i = 0; i < N[k]; i++) {
        double want = v(k, 0, i);
        for (int q = 1; q < size; q++) {
          double x = v(k, q, i);
          if (DT[k] == DLUA_DTYPE_BOOL) want = (want != 0) || (x != 0);
          else want = op == DLUA_PG_REDUCE_SUM ? want + x : (x > want ? x : want);
        }
        double got = tu_get(DT[k], el(ts[k], i), 0);
        EXPECT(got == want, "%s tensors[%d] %s [%" PRId64 "] = %g, expected %g", op ? "max" : "sum", k,
               dlua_dtype_name(DT[k]), i, got, want);
      }
      dlua_tensor_free(ts[k]);
      dlua_tensor_free(bases[k]);
    }
  }
  EXPECT(dlua_pg_seq(pg) == 2, "one collective per call: seq %" PRId64, dlua_pg_seq(pg));
  // Argument errors name the tensor; avg on an integer tensor is refused like all_reduce's.
  dlua_tensor_t *ts[2];
  int64_t n = 3;
  dlua_tensor_zeros(&ts[0], 1, &n, DLUA_DTYPE_F32, DLUA_CPU);
  dlua_tensor_zeros(&ts[1], 1, &n, DLUA_DTYPE_I32, DLUA_CPU);
  EXPECT(dlua_pg_all_reduce_many(pg, ts, 2, DLUA_PG_REDUCE_AVG, NULL, NULL) == DLUA_ERR_ARG &&
             strstr(dlua_last_error(), "all_reduce_many: avg needs a floating dtype, got int32"),
         "%s", dlua_last_error());
  EXPECT(dlua_pg_all_reduce_many(pg, ts, 0, DLUA_PG_REDUCE_SUM, NULL, NULL) == DLUA_OK, "empty list: %s",
         dlua_last_error());
  dlua_tensor_free(ts[0]);
  dlua_tensor_free(ts[1]);
  dlua_pg_free(pg);
  return 0;
}

START_TEST(test_all_reduce_many_gloo) {
  enum { SIZE = 3 };
  dlua_store_server_t *srv = NULL;
  ck_assert_int_eq(dlua_store_server_start("127.0.0.1", 0, TOKEN, &srv), DLUA_OK);
  int port = dlua_store_server_port(srv);
  pid_t pids[SIZE];
  fflush(NULL);
  for (int r = 0; r < SIZE; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      for (int fd = 3; fd < 1024; fd++) close(fd);  // the store server's sockets stay with the parent
      _exit(body(port, r, SIZE));
    }
    ck_assert_int_ge(pids[r], 0);
  }
  for (int r = 0; r < SIZE; r++) {
    int st = 0;
    // the group's timeout (20 s) bounds every rank; ctest's timeout catches anything else
    waitpid(pids[r], &st, 0);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d ended with status %d", r, st);
  }
  dlua_store_server_stop(srv);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("pg_nccl");
  TCase *tc = tcase_create("pg_nccl");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_nccl_new_errors);
  tcase_add_test(tc, test_all_reduce_many_gloo);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run(suite()); }

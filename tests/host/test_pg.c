/* Check suite for host/comm/pg*.c: process groups over the gloo backend (TCP and shared memory), forked ranks on loopback.
   Over 900 lines on purpose: every case runs through the one forked-ranks harness below (store, fork, reap, timeouts);
   split, each file would carry the harness again. */
#define _GNU_SOURCE
#include <check.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"

#include "testutil.h"

/* ---- the harness: a store in this process, one forked child per rank ------------------------------
   Children report through their exit code (0: every check passed) and a line on stderr. They never
   call ck_assert: Check's reporting belongs to this process. */

static const char *TOKEN = "pg-test-7c1e";
static int g_rank = -1;
/* Which forked ranks set DLUA_SHM=0 (all-reduce over gloo's TCP instead of shared memory): none,
   every rank, or one. */
enum { SHM_ON = -1, SHM_OFF_ALL = -2 };
static int g_shm_off = SHM_ON;

typedef int (*rank_body)(dlua_pg_t *pg, int rank, int size);

#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "rank %d: %s:%d: ", g_rank, __FILE__, __LINE__);         \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      return 1;                                                                \
    }                                                                          \
  } while (0)
#define EXPECT_OK(expr)                                                        \
  do {                                                                         \
    dlua_status_t s_ = (expr);                                                 \
    EXPECT(s_ == DLUA_OK, "%s failed: %s", #expr, dlua_last_error());          \
  } while (0)
#define EXPECT_ERR(expr, status, needle)                                       \
  do {                                                                         \
    dlua_status_t s_ = (expr);                                                 \
    if (getenv("PG_TEST_VERBOSE")) fprintf(stderr, "rank %d: %s\n", g_rank, dlua_last_error()); \
    EXPECT(s_ == (status), "%s gave %s, not %s: %s", #expr, dlua_status_name(s_), \
           dlua_status_name(status), dlua_last_error());                       \
    EXPECT(strstr(dlua_last_error(), (needle)), "%s: \"%s\" lacks \"%s\"", #expr, dlua_last_error(), (needle)); \
  } while (0)

static int child_main(int port, int rank, int size, int64_t timeout_ms, rank_body body) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (int fd = 3; fd < 1024; fd++) close(fd);  // the store server's sockets stay with the parent
  g_rank = rank;
  if (g_shm_off == SHM_OFF_ALL || g_shm_off == rank) setenv("DLUA_SHM", "0", 1);
  dlua_pg_t *pg = NULL;
  dlua_status_t s = dlua_pg_gloo_new("127.0.0.1", port, TOKEN, "pg0", rank, size, timeout_ms, &pg);
  if (s != DLUA_OK) {
    fprintf(stderr, "rank %d: join failed: %s\n", rank, dlua_last_error());
    return 90;
  }
  int code = body(pg, rank, size);
  dlua_pg_free(pg);
  return code;
}

/* Runs body on `size` forked ranks; codes[r] gets each exit code (-signal when killed). Every child
   is reaped: after 60 s the stragglers are killed. */
/* The dlua-* names in /dev/shm now (n of them, malloc'ed): segments that other jobs on this machine left
   behind before ours started. pid_max may be small, so such a name can carry one of our ranks' pids. */
static char **shm_names(int *n) {
  char **names = NULL;
  int cap = 0;
  *n = 0;
  DIR *d = opendir("/dev/shm");
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (strncmp(e->d_name, "dlua-", 5) != 0) continue;
    if (*n == cap) {
      cap = cap ? cap * 2 : 64;
      char **grown = realloc(names, (size_t)cap * sizeof *names);
      ck_assert_ptr_nonnull(grown);
      names = grown;
    }
    ck_assert_ptr_nonnull(names[(*n)++] = strdup(e->d_name));
  }
  if (d) closedir(d);
  return names;
}

static void run_job(int size, int64_t timeout_ms, rank_body body, int *codes) {
  int nbefore = 0;
  char **before = shm_names(&nbefore);
  dlua_store_server_t *srv = NULL;
  ck_assert_int_eq(dlua_store_server_start("127.0.0.1", 0, TOKEN, &srv), DLUA_OK);
  int port = dlua_store_server_port(srv);
  pid_t pids[8] = {0};
  fflush(NULL);
  for (int r = 0; r < size; r++) {
    pid_t p = fork();
    if (p == 0) _exit(child_main(port, r, size, timeout_ms, body));
    ck_assert_int_ge(p, 0);
    pids[r] = p;
  }
  pid_t all[8];
  memcpy(all, pids, sizeof all);
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int left = size;
  while (left > 0) {
    for (int r = 0; r < size; r++) {
      if (!pids[r]) continue;
      int st;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
        pids[r] = 0;
        left--;
      }
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 60) {
      for (int r = 0; r < size; r++)
        if (pids[r]) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], NULL, 0);
          codes[r] = 999;
          pids[r] = 0;
        }
      break;
    }
    usleep(5000);
  }
  dlua_store_server_stop(srv);
  // Shared-memory segments and regions are named after their maker's pid: none may outlive the job.
  int nafter = 0;
  char **after = shm_names(&nafter);
  for (int i = 0; i < nafter; i++) {
    int old = 0;
    for (int j = 0; j < nbefore && !old; j++) old = !strcmp(after[i], before[j]);
    for (int r = 0; r < size && !old; r++) {
      char prefix[32];
      snprintf(prefix, sizeof prefix, "dlua-%d-", (int)all[r]);
      ck_assert_msg(strncmp(after[i], prefix, strlen(prefix)) != 0, "/dev/shm/%s was left behind", after[i]);
    }
  }
  for (int i = 0; i < nafter; i++) free(after[i]);
  for (int i = 0; i < nbefore; i++) free(before[i]);
  free(after);
  free(before);
}

static void expect_all_ok(int size, int64_t timeout_ms, rank_body body) {
  int codes[8];
  run_job(size, timeout_ms, body, codes);
  for (int r = 0; r < size; r++) ck_assert_msg(codes[r] == 0, "rank %d of %d exited with %d", r, size, codes[r]);
}

/* ---- deterministic values: every rank can compute what every other rank holds -------------------- */

static const dlua_dtype_t ALL_DTYPES[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16,  DLUA_DTYPE_BF16,
                                          DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8, DLUA_DTYPE_BOOL};
static const int64_t COUNTS[] = {0, 1, 1009};

/* Small integers: exact in every dtype, so sums and products of up to 4 ranks are exact too (u8
   products wrap, as C does). `salt` varies the pattern between tensors of one rank. */
static double val(dlua_dtype_t dt, int rank, int64_t i, int salt) {
  int64_t k = (i * 7 + rank * 3 + salt * 5 + 1) % 7;
  if (dt == DLUA_DTYPE_BOOL) return (i + rank + salt) % 3 == 0;
  if (dt == DLUA_DTYPE_U8) return (double)k;
  return (double)(k - 3);
}

static double reduce_expect(dlua_dtype_t dt, dlua_reduce_t op, int size, int64_t i, int salt_of_rank_base, int salt_per_rank) {
  double acc = 0;
  for (int q = 0; q < size; q++) {
    double x = val(dt, q, i, salt_of_rank_base + salt_per_rank * q);
    if (q == 0) {
      acc = x;
      continue;
    }
    switch (op) {
      case DLUA_PG_REDUCE_SUM:
      case DLUA_PG_REDUCE_AVG: acc += x; break;
      case DLUA_PG_REDUCE_PRODUCT: acc *= x; break;
      case DLUA_PG_REDUCE_MAX: acc = x > acc ? x : acc; break;
      default: acc = x < acc ? x : acc; break;
    }
  }
  if (op == DLUA_PG_REDUCE_AVG) {
    if (dt == DLUA_DTYPE_F64) return acc / size;
    return tu_as_dtype(dt, (double)((float)acc / (float)size));
  }
  return tu_as_dtype(dt, acc);
}

/* A 1-D tensor of n elements; strided (every other element of an (n, 2) buffer) when strided != 0. */
static dlua_tensor_t *vec(dlua_dtype_t dt, int64_t n, int strided) {
  dlua_tensor_t *t = NULL;
  if (!strided) {
    if (dlua_tensor_zeros(&t, 1, &n, dt, DLUA_CPU) != DLUA_OK) return NULL;
    return t;
  }
  int64_t sz[2] = {n, 2};
  dlua_tensor_t *base = NULL;
  if (dlua_tensor_zeros(&base, 2, sz, dt, DLUA_CPU) != DLUA_OK) return NULL;
  dlua_tensor_select(&t, base, 1, 1);
  dlua_tensor_free(base);
  return t;
}

static void *elem(const dlua_tensor_t *t, int64_t i) {
  return (char *)dlua_tensor_ptr(t) + i * t->strides[0] * (int64_t)dlua_dtype_size(t->dtype);
}
static void put(dlua_tensor_t *t, int64_t i, double x) { tu_put(t->dtype, elem(t, i), 0, x); }
static double get(const dlua_tensor_t *t, int64_t i) { return tu_get(t->dtype, elem(t, i), 0); }

static void fill(dlua_tensor_t *t, int rank, int salt) {
  for (int64_t i = 0; i < dlua_tensor_numel(t); i++) put(t, i, val(t->dtype, rank, i, salt));
}

/* ---- collectives against local results ------------------------------------------------------------ */

/* The transport the harness asked for: shared memory unless some rank turned it off. */
static int expect_transport(dlua_pg_t *pg) {
  const char *why = NULL, *tr = dlua_pg_transport(pg, &why);
  const char *want = g_shm_off == SHM_ON ? "shm" : "tcp";
  EXPECT(!strcmp(tr, want), "transport %s (%s), want %s", tr, why, want);
  if (g_shm_off >= 0) EXPECT(strstr(why, "set DLUA_SHM=0"), "why: %s", why);
  return 0;
}

static int body_all_reduce(dlua_pg_t *pg, int rank, int size) {
  if (expect_transport(pg)) return 1;
  for (size_t d = 0; d < sizeof ALL_DTYPES / sizeof *ALL_DTYPES; d++) {
    dlua_dtype_t dt = ALL_DTYPES[d];
    for (int op = 0; op < DLUA_PG_REDUCE_COUNT; op++) {
      if (op == DLUA_PG_REDUCE_AVG && !dlua_dtype_is_floating(dt)) continue;
      for (size_t c = 0; c < 3; c++) {
        int strided = c == 2 && op == DLUA_PG_REDUCE_SUM;
        dlua_tensor_t *t = vec(dt, COUNTS[c], strided);
        EXPECT(t, "alloc");
        fill(t, rank, 0);
        EXPECT_OK(dlua_pg_all_reduce(pg, t, (dlua_reduce_t)op, "ar.lua:1", NULL));
        for (int64_t i = 0; i < COUNTS[c]; i++) {
          double want = reduce_expect(dt, (dlua_reduce_t)op, size, i, 0, 0);
          EXPECT(get(t, i) == want, "all_reduce %s op %d n %" PRId64 " [%" PRId64 "]: got %g, want %g",
                 dlua_dtype_name(dt), op, COUNTS[c], i, get(t, i), want);
        }
        dlua_tensor_free(t);
      }
    }
  }
  // avg on integers is refused before anything is sent
  dlua_tensor_t *it = vec(DLUA_DTYPE_I64, 4, 0);
  int64_t before = dlua_pg_seq(pg);
  EXPECT_ERR(dlua_pg_all_reduce(pg, it, DLUA_PG_REDUCE_AVG, NULL, NULL), DLUA_ERR_ARG,
             "all_reduce: avg needs a floating dtype, got int64");
  EXPECT(dlua_pg_seq(pg) == before, "a refused call counted");
  dlua_tensor_free(it);
  return 0;
}

/* A multi-MB f32 sum of non-integers: equal to the local sum within rounding, and identical bytes
   on every rank (all-gathered checksums). */
static int body_big_sum(dlua_pg_t *pg, int rank, int size) {
  const int64_t n = 3000017;
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, n, 0);
  EXPECT(t, "alloc");
  float *p = dlua_tensor_data(t);
  for (int64_t i = 0; i < n; i++) p[i] = (float)sin(0.001 * (double)i + rank) * (float)(rank + 1);
  EXPECT_OK(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, NULL, NULL));
  for (int64_t i = 0; i < n; i += 1) {
    double want = 0;
    for (int q = 0; q < size; q++) want += (double)((float)sin(0.001 * (double)i + q) * (float)(q + 1));
    EXPECT(fabs(p[i] - want) <= 1e-5 * (1 + fabs(want)), "[%" PRId64 "]: %g vs %g", i, p[i], want);
  }
  uint64_t h = 1469598103934665603ull;
  const unsigned char *b = (const unsigned char *)p;
  for (int64_t i = 0; i < n * 4; i++) h = (h ^ b[i]) * 1099511628211ull;
  dlua_tensor_t *mine = vec(DLUA_DTYPE_I64, 1, 0), *all[8];
  *(int64_t *)dlua_tensor_data(mine) = (int64_t)h;
  for (int q = 0; q < size; q++) all[q] = vec(DLUA_DTYPE_I64, 1, 0);
  EXPECT_OK(dlua_pg_all_gather(pg, all, mine, "sum.lua:9", NULL));
  for (int q = 0; q < size; q++)
    EXPECT(*(int64_t *)dlua_tensor_data(all[q]) == (int64_t)h, "rank %d's result bytes differ from rank %d's", q, rank);
  for (int q = 0; q < size; q++) dlua_tensor_free(all[q]);
  dlua_tensor_free(mine);
  dlua_tensor_free(t);
  // Several 1 MB shared-memory chunks and a ragged tail, in 2-byte elements: exact small integers.
  const int64_t m = 1100003;
  dlua_tensor_t *h16 = vec(DLUA_DTYPE_F16, m, 0);
  fill(h16, rank, 6);
  EXPECT_OK(dlua_pg_all_reduce(pg, h16, DLUA_PG_REDUCE_SUM, NULL, NULL));
  for (int64_t i = 0; i < m; i++)
    EXPECT(get(h16, i) == reduce_expect(DLUA_DTYPE_F16, DLUA_PG_REDUCE_SUM, size, i, 6, 0), "f16 [%" PRId64 "]", i);
  dlua_tensor_free(h16);
  return 0;
}

/* Many shared-memory chunks for reduce_scatter, all_gather (unequal sizes) and broadcast. */
static int body_big_others(dlua_pg_t *pg, int rank, int size) {
  const int64_t m = 200003;
  dlua_tensor_t *ins[8], *out = vec(DLUA_DTYPE_F32, m, 0);
  for (int q = 0; q < size; q++) {
    ins[q] = vec(DLUA_DTYPE_F32, m, 0);
    fill(ins[q], rank, 10 + q);
  }
  EXPECT_OK(dlua_pg_reduce_scatter(pg, out, ins, DLUA_PG_REDUCE_SUM, "big.lua:1", NULL));
  for (int64_t i = 0; i < m; i++)
    EXPECT(get(out, i) == reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_SUM, size, i, 10 + rank, 0), "reduce_scatter [%" PRId64 "]", i);
  for (int q = 0; q < size; q++) dlua_tensor_free(ins[q]);
  // inputs that are views of one flat buffer are read where they lie (and left unchanged)
  dlua_tensor_t *flat = vec(DLUA_DTYPE_F32, size * m, 0);
  for (int q = 0; q < size; q++) {
    dlua_tensor_narrow(&ins[q], flat, 0, q * m, m);
    fill(ins[q], rank, 10 + q);
  }
  EXPECT_OK(dlua_pg_reduce_scatter(pg, out, ins, DLUA_PG_REDUCE_AVG, "big.lua:4", NULL));
  for (int64_t i = 0; i < m; i++) {
    double want = reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_SUM, size, i, 10 + rank, 0) / size;
    EXPECT(fabs(get(out, i) - want) <= 1e-6 * (1 + fabs(want)), "reduce_scatter avg, packed [%" PRId64 "]", i);
    for (int q = 0; q < size; q++) EXPECT(get(ins[q], i) == val(DLUA_DTYPE_F32, rank, i, 10 + q), "input %d changed", q);
  }
  for (int q = 0; q < size; q++) dlua_tensor_free(ins[q]);
  dlua_tensor_free(flat);
  dlua_tensor_free(out);

  const int64_t n = 150001;
  dlua_tensor_t *in = vec(DLUA_DTYPE_F64, n + 7 * rank, 0), *outs[8];
  fill(in, rank, 2);
  for (int q = 0; q < size; q++) outs[q] = vec(DLUA_DTYPE_F64, n + 7 * q, 0);
  EXPECT_OK(dlua_pg_all_gather(pg, outs, in, "big.lua:2", NULL));
  for (int q = 0; q < size; q++)
    for (int64_t i = 0; i < n + 7 * q; i++) EXPECT(get(outs[q], i) == val(DLUA_DTYPE_F64, q, i, 2), "all_gather [%d][%" PRId64 "]", q, i);
  for (int q = 0; q < size; q++) dlua_tensor_free(outs[q]);
  dlua_tensor_free(in);

  dlua_tensor_t *b = vec(DLUA_DTYPE_BF16, 300007, 0);
  fill(b, rank, 4);
  EXPECT_OK(dlua_pg_broadcast(pg, b, size - 1, "big.lua:3", NULL));
  for (int64_t i = 0; i < 300007; i++) EXPECT(get(b, i) == val(DLUA_DTYPE_BF16, size - 1, i, 4), "broadcast [%" PRId64 "]", i);
  dlua_tensor_free(b);
  return 0;
}

/* Without debug mode: ranks that all-reduce different shapes, dtypes or ops over shared memory all
   get the same error naming each rank's call, and the group stays usable. */
static int body_shm_mismatch(dlua_pg_t *pg, int rank, int size) {
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 1000 + (rank == 1), 0);
  EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG,
             "collective mismatch at #1: rank 0 all_reduce #1 float32 (1000) op sum; rank 1 all_reduce #1 float32 (1001) op sum");
  dlua_tensor_free(t);
  t = vec(rank == 0 ? DLUA_DTYPE_F64 : DLUA_DTYPE_F32, 3000000, 0);  // several chunks on one side
  EXPECT_ERR(dlua_pg_all_reduce(pg, t, rank == 0 ? DLUA_PG_REDUCE_MAX : DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG,
             "rank 0 all_reduce #2 float64 (3000000) op max; rank 1 all_reduce #2 float32 (3000000) op sum");
  dlua_tensor_free(t);
  // different collectives, and all_gather outputs that disagree
  t = vec(DLUA_DTYPE_F32, 1000, 0);
  if (rank == 0)
    EXPECT_ERR(dlua_pg_broadcast(pg, t, 1, NULL, NULL), DLUA_ERR_ARG,
               "collective mismatch at #3: rank 0 broadcast #3 float32 (1000) src 1; rank 1 all_reduce #3 float32 (1000) op avg");
  else
    EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_AVG, NULL, NULL), DLUA_ERR_ARG, "rank 0 broadcast #3");
  dlua_tensor_t *outs[2] = {vec(DLUA_DTYPE_F32, 1000, 0), vec(DLUA_DTYPE_F32, 1000 + rank, 0)};
  EXPECT_ERR(dlua_pg_all_gather(pg, outs, rank == 0 ? t : outs[1], NULL, NULL), DLUA_ERR_ARG,
             "rank 0 all_gather #4 float32 (1000); rank 1 all_gather #4 float32 (1001)");
  dlua_tensor_free(outs[0]);
  dlua_tensor_free(outs[1]);
  fill(t, rank, 0);
  EXPECT_OK(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, NULL, NULL));
  for (int64_t i = 0; i < 1000; i++)
    EXPECT(get(t, i) == reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_SUM, size, i, 0, 0), "after mismatches [%" PRId64 "]", i);
  dlua_tensor_free(t);
  return 0;
}

static int body_broadcast(dlua_pg_t *pg, int rank, int size) {
  int src = size - 1;
  for (size_t d = 0; d < 8; d++)
    for (size_t c = 0; c < 3; c++)
      for (int strided = 0; strided < 2; strided++) {
        dlua_dtype_t dt = ALL_DTYPES[d];
        dlua_tensor_t *t = vec(dt, COUNTS[c], strided);
        fill(t, rank, 1);
        EXPECT_OK(dlua_pg_broadcast(pg, t, src, "bc.lua:3", NULL));
        for (int64_t i = 0; i < COUNTS[c]; i++)
          EXPECT(get(t, i) == val(dt, src, i, 1), "broadcast %s [%" PRId64 "]", dlua_dtype_name(dt), i);
        dlua_tensor_free(t);
      }
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 3, 0);
  EXPECT_ERR(dlua_pg_broadcast(pg, t, size, NULL, NULL), DLUA_ERR_ARG, "broadcast: src");
  dlua_tensor_free(t);
  return 0;
}

/* Unequal sizes (rank q gives n + q elements); outs separate tensors, strided tensors, or views of
   one flat buffer (gloo writes those directly). */
static int body_all_gather(dlua_pg_t *pg, int rank, int size) {
  for (size_t d = 0; d < 8; d++)
    for (size_t c = 0; c < 3; c++)
      for (int layout = 0; layout < 3; layout++) {
        dlua_dtype_t dt = ALL_DTYPES[d];
        int64_t n = COUNTS[c];
        dlua_tensor_t *in = vec(dt, n + rank, layout == 1), *outs[8], *flat = NULL;
        fill(in, rank, 2);
        int64_t total = 0;
        for (int q = 0; q < size; q++) total += n + q;
        if (layout == 2) flat = vec(dt, total, 0);
        for (int q = 0, off = 0; q < size; off += (int)(n + q), q++) {
          if (layout == 2)
            dlua_tensor_narrow(&outs[q], flat, 0, off, n + q);
          else
            outs[q] = vec(dt, n + q, layout == 1);
        }
        EXPECT_OK(dlua_pg_all_gather(pg, outs, in, "ag.lua:5", NULL));
        for (int q = 0; q < size; q++)
          for (int64_t i = 0; i < n + q; i++)
            EXPECT(get(outs[q], i) == val(dt, q, i, 2), "all_gather %s layout %d outs[%d][%" PRId64 "]",
                   dlua_dtype_name(dt), layout, q, i);
        for (int q = 0; q < size; q++) dlua_tensor_free(outs[q]);
        dlua_tensor_free(flat);
        dlua_tensor_free(in);
      }
  // wrong numel for this rank's slot, wrong dtype
  dlua_tensor_t *in = vec(DLUA_DTYPE_F32, 4, 0), *outs[8];
  for (int q = 0; q < size; q++) outs[q] = vec(DLUA_DTYPE_F32, 3, 0);
  EXPECT_ERR(dlua_pg_all_gather(pg, outs, in, NULL, NULL), DLUA_ERR_ARG, "all_gather: outs[");
  dlua_tensor_free(outs[size - 1]);
  outs[size - 1] = vec(DLUA_DTYPE_I32, 4, 0);
  EXPECT_ERR(dlua_pg_all_gather(pg, outs, in, NULL, NULL), DLUA_ERR_ARG, "is int32, the input is float32");
  for (int q = 0; q < size; q++) dlua_tensor_free(outs[q]);
  dlua_tensor_free(in);
  return 0;
}

static int body_reduce_scatter(dlua_pg_t *pg, int rank, int size) {
  for (size_t d = 0; d < 8; d++)
    for (int op = 0; op < DLUA_PG_REDUCE_COUNT; op++) {
      dlua_dtype_t dt = ALL_DTYPES[d];
      if (op == DLUA_PG_REDUCE_AVG && !dlua_dtype_is_floating(dt)) continue;
      for (size_t c = 0; c < 3; c++) {
        int64_t m = COUNTS[c];
        dlua_tensor_t *ins[8], *out = vec(dt, m, c == 1);
        // ins[q] of rank r holds val(dt, r, i, salt 10 + q): each destination sees its own pattern
        for (int q = 0; q < size; q++) {
          ins[q] = vec(dt, m, q == 0);
          fill(ins[q], rank, 10 + q);
        }
        EXPECT_OK(dlua_pg_reduce_scatter(pg, out, ins, (dlua_reduce_t)op, "rs.lua:7", NULL));
        for (int64_t i = 0; i < m; i++) {
          double want = reduce_expect(dt, (dlua_reduce_t)op, size, i, 10 + rank, 0);
          EXPECT(get(out, i) == want, "reduce_scatter %s op %d m %" PRId64 " [%" PRId64 "]: got %g, want %g",
                 dlua_dtype_name(dt), op, m, i, get(out, i), want);
        }
        for (int q = 0; q < size; q++) dlua_tensor_free(ins[q]);
        dlua_tensor_free(out);
      }
    }
  // parts of different sizes, some empty (ZeRO's shards of a bucket), small and over many shared-memory
  // chunks: part q of every rank reduces into rank q's out
  static const int64_t small[] = {7, 0, 13, 1}, large[] = {200003, 0, 3, 150001};
  for (int k = 0; k < 2; k++) {
    dlua_tensor_t *ins[8], *out;
    for (int q = 0; q < size; q++) {
      ins[q] = vec(DLUA_DTYPE_F64, (k ? large : small)[q % 4] + (q >= 4), 0);
      fill(ins[q], rank, 10 + q);
    }
    out = vec(DLUA_DTYPE_F64, dlua_tensor_numel(ins[rank]), 0);
    EXPECT_OK(dlua_pg_reduce_scatter(pg, out, ins, DLUA_PG_REDUCE_AVG, "rs.lua:9", NULL));
    for (int64_t i = 0; i < dlua_tensor_numel(out); i++) {
      double want = reduce_expect(DLUA_DTYPE_F64, DLUA_PG_REDUCE_SUM, size, i, 10 + rank, 0) / size;
      EXPECT(fabs(get(out, i) - want) <= 1e-12 * (1 + fabs(want)), "reduce_scatter unequal parts %d [%" PRId64 "]: got %g, want %g",
             k, i, get(out, i), want);
    }
    for (int q = 0; q < size; q++) dlua_tensor_free(ins[q]);
    dlua_tensor_free(out);
  }
  // out must be this rank's part (checked on every rank before anything is sent)
  dlua_tensor_t *ins[8], *out = vec(DLUA_DTYPE_F32, 5, 0);
  for (int q = 0; q < size; q++) ins[q] = vec(DLUA_DTYPE_F32, 4, 0);
  char want[96];
  snprintf(want, sizeof want, "reduce_scatter: out has 5 elements, this rank's part ins[%d] has 4", rank);
  EXPECT_ERR(dlua_pg_reduce_scatter(pg, out, ins, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG, want);
  for (int q = 0; q < size; q++) dlua_tensor_free(ins[q]);
  dlua_tensor_free(out);
  return 0;
}

/* Rank r sends n + r + q elements to rank q, valued val(dt, r, i, q); receives n + q + r from q. */
static int body_all_to_all(dlua_pg_t *pg, int rank, int size) {
  for (size_t d = 0; d < 8; d++)
    for (size_t c = 0; c < 3; c++)
      for (int strided = 0; strided < 2; strided++) {
        dlua_dtype_t dt = ALL_DTYPES[d];
        int64_t n = COUNTS[c];
        dlua_tensor_t *ins[8], *outs[8];
        for (int q = 0; q < size; q++) {
          ins[q] = vec(dt, n + rank + q, strided);
          fill(ins[q], rank, q);
          outs[q] = vec(dt, n + rank + q, strided && q % 2);
        }
        EXPECT_OK(dlua_pg_all_to_all(pg, outs, ins, "a2a.lua:2", NULL));
        for (int q = 0; q < size; q++)
          for (int64_t i = 0; i < n + rank + q; i++)
            EXPECT(get(outs[q], i) == val(dt, q, i, rank), "all_to_all %s outs[%d][%" PRId64 "]", dlua_dtype_name(dt),
                   q, i);
        for (int q = 0; q < size; q++) {
          dlua_tensor_free(ins[q]);
          dlua_tensor_free(outs[q]);
        }
      }
  return 0;
}

/* barrier, send/recv between ranks 0 and 1 (tags, strided, every dtype), and argument errors. */
static int body_p2p(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_barrier(pg, "b.lua:1", NULL));
  for (size_t d = 0; d < 8; d++) {
    dlua_dtype_t dt = ALL_DTYPES[d];
    if (rank == 0) {
      dlua_tensor_t *a = vec(dt, 1009, 0), *b = vec(dt, 17, 1);
      fill(a, 0, 3);
      fill(b, 0, 4);
      EXPECT_OK(dlua_pg_send(pg, a, 1, 7, "p.lua:1", NULL));
      EXPECT_OK(dlua_pg_send(pg, b, 1, 8, "p.lua:2", NULL));
      dlua_tensor_free(a);
      dlua_tensor_free(b);
    } else if (rank == 1) {
      dlua_tensor_t *a = vec(dt, 1009, 1), *b = vec(dt, 17, 0);
      dlua_work_t *wb = NULL;
      EXPECT_OK(dlua_pg_recv(pg, b, 0, 8, "p.lua:3", &wb));  // tags pair them, whatever the order here
      EXPECT_OK(dlua_pg_recv(pg, a, 0, 7, "p.lua:4", NULL));
      EXPECT_OK(dlua_work_wait(wb, -1));
      dlua_work_free(wb);
      for (int64_t i = 0; i < 1009; i++) EXPECT(get(a, i) == val(dt, 0, i, 3), "recv %s a[%" PRId64 "]", dlua_dtype_name(dt), i);
      for (int64_t i = 0; i < 17; i++) EXPECT(get(b, i) == val(dt, 0, i, 4), "recv %s b[%" PRId64 "]", dlua_dtype_name(dt), i);
      dlua_tensor_free(a);
      dlua_tensor_free(b);
    }
  }
  EXPECT(dlua_pg_seq(pg) == 1, "send/recv counted as collectives: seq %" PRId64, dlua_pg_seq(pg));
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 2, 0);
  EXPECT_ERR(dlua_pg_send(pg, t, rank, 0, NULL, NULL), DLUA_ERR_ARG, "is this rank");
  EXPECT_ERR(dlua_pg_recv(pg, t, -1, 0, NULL, NULL), DLUA_ERR_ARG, "recv: src -1 is out of range");
  EXPECT_ERR(dlua_pg_all_reduce(NULL, t, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG, "all_reduce");
  // Pretend cuda:0 tensors: gloo stages them through the device layer, which (no GPU here) says so;
  // strided ones are refused before that.
  t->device = t->storage->device = 0;
  if (dlua_cuda_device_count() == 0)
    EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG, "no CUDA device available");
  t->strides[0] = 2;
  EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG,
             "gloo stages cuda:0 tensors through pinned host memory, and the tensor is not contiguous");
  t->strides[0] = 1;
  t->device = t->storage->device = DLUA_CPU;
  dlua_tensor_free(t);
  EXPECT_OK(dlua_pg_barrier(pg, "b.lua:2", NULL));
  return 0;
}

/* Several async works in flight, mixed with sync calls, waited in reverse order; one freed early. */
static int body_async(dlua_pg_t *pg, int rank, int size) {
  enum { K = 6 };
  dlua_tensor_t *ts[K];
  dlua_work_t *ws[K];
  for (int k = 0; k < K; k++) {
    ts[k] = vec(DLUA_DTYPE_F64, 100003, k % 2);
    fill(ts[k], rank, k);
    EXPECT_OK(dlua_pg_all_reduce(pg, ts[k], DLUA_PG_REDUCE_SUM, "async.lua:1", &ws[k]));
  }
  dlua_tensor_t *s = vec(DLUA_DTYPE_I32, 5, 0);
  fill(s, rank, 9);
  EXPECT_OK(dlua_pg_all_reduce(pg, s, DLUA_PG_REDUCE_MAX, "async.lua:2", NULL));  // after all of them
  for (int k = 0; k < K; k++) EXPECT(dlua_work_is_completed(ws[k]), "sync call returned before earlier async work %d", k);
  for (int k = K - 1; k >= 0; k--) {
    EXPECT_OK(dlua_work_wait(ws[k], -1));
    dlua_work_free(ws[k]);
    for (int64_t i = 0; i < 100003; i += 97)
      EXPECT(get(ts[k], i) == reduce_expect(DLUA_DTYPE_F64, DLUA_PG_REDUCE_SUM, size, i, k, 0), "async %d [%" PRId64 "]", k, i);
    dlua_tensor_free(ts[k]);
  }
  for (int64_t i = 0; i < 5; i++)
    EXPECT(get(s, i) == reduce_expect(DLUA_DTYPE_I32, DLUA_PG_REDUCE_MAX, size, i, 9, 0), "sync after async [%" PRId64 "]", i);
  // a work freed before it completes, whose tensor the caller also freed: the group finishes both
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 50000, 0);
  dlua_work_t *w = NULL;
  EXPECT_OK(dlua_pg_broadcast(pg, t, 0, "async.lua:3", &w));
  dlua_work_free(w);
  dlua_tensor_free(t);
  dlua_work_t *wb = NULL;
  EXPECT_OK(dlua_pg_barrier(pg, "async.lua:4", &wb));
  EXPECT_OK(dlua_work_wait(wb, 10000));
  dlua_work_free(wb);
  EXPECT(dlua_pg_seq(pg) == K + 3, "seq %" PRId64, dlua_pg_seq(pg));
  dlua_tensor_free(s);
  return 0;
}

/* ---- failures: timeouts, exits, debug mismatches, Ctrl-C ----------------------------------------- */

/* Rank 1 skips all_reduce #2 and does something else for a while: the others time out naming it. */
static int body_skip_busy(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_barrier(pg, "s.lua:1", NULL));
  if (rank == 1) {
    sleep(4);
    return 0;
  }
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 4, 0);
  EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, "s.lua:2", NULL), DLUA_ERR_TIMEOUT, "all_reduce #2");
  EXPECT(strstr(dlua_last_error(), "rank 1 did not answer"), "no rank 1 in: %s", dlua_last_error());
  EXPECT(strstr(dlua_last_error(), "(4) float32 at s.lua:2"), "no shape/site in: %s", dlua_last_error());
  if (size == 3) EXPECT(strstr(dlua_last_error(), "arrived: "), "no arrived list in: %s", dlua_last_error());
  EXPECT_ERR(dlua_pg_barrier(pg, NULL, NULL), DLUA_ERR_BACKEND, "process group pg0 is unusable after all_reduce #2");
  dlua_tensor_free(t);
  return 0;
}

/* Rank 1 skips all_reduce #2 and goes to a barrier: each side names where the other is. */
static int body_skip_elsewhere(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_barrier(pg, "s.lua:1", NULL));
  if (rank == 1) {
    EXPECT_ERR(dlua_pg_barrier(pg, "s.lua:9", NULL), DLUA_ERR_TIMEOUT, "barrier #2");
    EXPECT(strstr(dlua_last_error(), "rank 0 is at all_reduce #2 (s.lua:2)"), "%s", dlua_last_error());
    return 0;
  }
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 4, 0);
  EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, "s.lua:2", NULL), DLUA_ERR_TIMEOUT, "all_reduce #2");
  EXPECT(strstr(dlua_last_error(), "rank 1 is at barrier #2 (s.lua:9)"), "%s", dlua_last_error());
  dlua_tensor_free(t);
  return 0;
}

/* After rank 1 has gone: all_reduce #2 of t on this rank fails within 8 s (its timeout is 20 s), saying
   `why`; t is freed. */
static int expect_prompt_failure(dlua_pg_t *pg, dlua_tensor_t *t, const char *site, const char *why) {
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  dlua_status_t s = dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, site, NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  EXPECT(s != DLUA_OK, "all_reduce without rank 1 succeeded");
  EXPECT(strstr(dlua_last_error(), why), "%s", dlua_last_error());
  EXPECT(strstr(dlua_last_error(), "all_reduce #2"), "%s", dlua_last_error());
  EXPECT(b.tv_sec - a.tv_sec < 8, "took %ld s", (long)(b.tv_sec - a.tv_sec));
  dlua_tensor_free(t);
  return 0;
}

/* Rank 1 leaves after one collective; rank 0's next one fails at once and says so. */
static int body_exit(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_barrier(pg, "e.lua:1", NULL));
  if (rank == 1) return 0;  // dlua_pg_free writes "exited after 1" and closes
  return expect_prompt_failure(pg, vec(DLUA_DTYPE_F32, 1000, 0), "e.lua:2", "rank 1 exited after 1 collective");
}

/* Shared regions (DDP's gradient arena): all-reduce of ranges in them reads the peers' copies in place. */
static int body_shared(dlua_pg_t *pg, int rank, int size) {
  const char *why = NULL;
  dlua_tensor_t *t = NULL;
  const int64_t n = 700001;
  EXPECT_OK(dlua_pg_shared_zeros(pg, DLUA_DTYPE_F32, n, &t, &why));
  if (g_shm_off != SHM_ON) {
    EXPECT(!t && strstr(why, "set DLUA_SHM=0"), "shared_zeros without shm: %p, %s", (void *)t, why);
    return 0;
  }
  EXPECT(t, "no shared tensor: %s", why);
  for (int64_t i = 0; i < n; i += 9973) EXPECT(get(t, i) == 0, "not zeroed at %" PRId64, i);
  fill(t, rank, 3);
  dlua_tensor_t *v = NULL;
  EXPECT_OK(dlua_tensor_narrow(&v, t, 0, 1001, 500000));
  EXPECT_OK(dlua_pg_all_reduce(pg, v, DLUA_PG_REDUCE_SUM, "sh.lua:1", NULL));
  for (int64_t i = 0; i < n; i++) {
    double want = i >= 1001 && i < 501001 ? reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_SUM, size, i, 3, 0)
                                          : val(DLUA_DTYPE_F32, rank, i, 3);
    EXPECT(get(t, i) == want, "shared sum [%" PRId64 "]: %g, want %g", i, get(t, i), want);
  }
  dlua_tensor_free(v);
  // a second region, float64, whole-tensor avg; then the first again (regions stay apart)
  dlua_tensor_t *d = NULL;
  EXPECT_OK(dlua_pg_shared_zeros(pg, DLUA_DTYPE_F64, 4099, &d, &why));
  EXPECT(d, "second region: %s", why);
  fill(d, rank, 5);
  EXPECT_OK(dlua_pg_all_reduce(pg, d, DLUA_PG_REDUCE_AVG, "sh.lua:2", NULL));
  for (int64_t i = 0; i < 4099; i++) {
    double want = reduce_expect(DLUA_DTYPE_F64, DLUA_PG_REDUCE_SUM, size, i, 5, 0) / size;
    EXPECT(fabs(get(d, i) - want) < 1e-12, "shared avg [%" PRId64 "]: %g, want %g", i, get(d, i), want);
  }
  fill(t, rank, 7);
  EXPECT_OK(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_MAX, "sh.lua:3", NULL));
  for (int64_t i = 0; i < n; i++)
    EXPECT(get(t, i) == reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_MAX, size, i, 7, 0), "shared max [%" PRId64 "]", i);
  // ranks that reduce different ranges of the region are told so, and stay in step
  EXPECT_OK(dlua_tensor_narrow(&v, t, 0, rank == 0 ? 0 : 16, 1000));
  EXPECT_ERR(dlua_pg_all_reduce(pg, v, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG,
             "rank 0 all_reduce #4 float32 (1000) op sum, shared at +0; rank 1 all_reduce #4 float32 (1000) op sum, shared at +64");
  dlua_tensor_free(v);
  // a region and a private tensor: also a mismatch
  dlua_tensor_t *priv = vec(DLUA_DTYPE_F64, 4099, 0);
  EXPECT_ERR(dlua_pg_all_reduce(pg, rank == 0 ? d : priv, DLUA_PG_REDUCE_SUM, NULL, NULL), DLUA_ERR_ARG,
             "collective mismatch at #5");
  dlua_tensor_free(d);
  dlua_tensor_free(t);
  fill(priv, rank, 1);
  EXPECT_OK(dlua_pg_all_reduce(pg, priv, DLUA_PG_REDUCE_SUM, "sh.lua:4", NULL));
  for (int64_t i = 0; i < 4099; i++)
    EXPECT(get(priv, i) == reduce_expect(DLUA_DTYPE_F64, DLUA_PG_REDUCE_SUM, size, i, 1, 0), "after regions [%" PRId64 "]", i);
  dlua_tensor_free(priv);
  return 0;
}

/* A rank dies while the others all-reduce in a shared region: they fail soon. */
static int body_killed_shared(dlua_pg_t *pg, int rank, int size) {
  dlua_tensor_t *t = NULL;
  const char *why = NULL;
  EXPECT_OK(dlua_pg_shared_zeros(pg, DLUA_DTYPE_F32, 100000, &t, &why));
  EXPECT(t, "no shared tensor: %s", why);
  EXPECT_OK(dlua_pg_barrier(pg, "k.lua:1", NULL));
  if (rank == 1) _exit(0);
  return expect_prompt_failure(pg, t, "k.lua:2", "rank 1 did not answer");
}

/* Rank 1 dies after one collective without closing anything: rank 0's next all-reduce fails soon,
   not after its 20 s timeout. */
static int body_killed(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_barrier(pg, "k.lua:1", NULL));
  if (rank == 1) _exit(0);
  return expect_prompt_failure(pg, vec(DLUA_DTYPE_F32, 300000, 0), "k.lua:2", "rank 1 did not answer");
}

static int body_debug_mismatch(dlua_pg_t *pg, int rank, int size) {
  EXPECT_OK(dlua_pg_set_debug(pg, 1));
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 4, 0);
  const char *want = "collective mismatch at #1: rank 0 all_reduce float32 (4) at a.lua:10; "
                     "rank 1 broadcast float32 (4) at a.lua:12";
  if (rank == 0)
    EXPECT_ERR(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, "a.lua:10", NULL), DLUA_ERR_ARG, want);
  else
    EXPECT_ERR(dlua_pg_broadcast(pg, t, 0, "a.lua:12", NULL), DLUA_ERR_ARG, want);
  // same collective, other shapes
  dlua_tensor_t *u = vec(DLUA_DTYPE_F32, 4 + rank, 0);
  EXPECT_ERR(dlua_pg_all_reduce(pg, u, DLUA_PG_REDUCE_SUM, "a.lua:20", NULL), DLUA_ERR_ARG,
             "collective mismatch at #2: rank 0 all_reduce float32 (4) at a.lua:20; rank 1 all_reduce float32 (5) at a.lua:20");
  // agreeing calls go through, the group is still usable
  fill(t, rank, 0);
  EXPECT_OK(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, "a.lua:30", NULL));
  for (int64_t i = 0; i < 4; i++) EXPECT(get(t, i) == reduce_expect(DLUA_DTYPE_F32, DLUA_PG_REDUCE_SUM, size, i, 0, 0), "sum");
  dlua_tensor_free(t);
  dlua_tensor_free(u);
  return 0;
}

static void *press_ctrl_c(void *arg) {
  usleep(300 * 1000);
  dlua_interrupt_set(1);
  return NULL;
}

/* Rank 1 stays away; Ctrl-C on rank 0 ends its wait within ~100 ms and breaks the group. */
static int body_ctrl_c(dlua_pg_t *pg, int rank, int size) {
  if (rank == 1) {
    sleep(2);
    return 0;
  }
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 4, 0);
  pthread_t th;
  pthread_create(&th, NULL, press_ctrl_c, NULL);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  dlua_status_t s = dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_SUM, "c.lua:1", NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  pthread_join(th, NULL);
  dlua_interrupt_set(0);
  double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
  EXPECT(s == DLUA_ERR_INTERRUPTED, "got %s: %s", dlua_status_name(s), dlua_last_error());
  EXPECT(ms < 1000, "interrupt took %.0f ms", ms);
  EXPECT_ERR(dlua_pg_barrier(pg, NULL, NULL), DLUA_ERR_BACKEND, "is unusable after all_reduce #1 was interrupted");
  dlua_tensor_free(t);
  return 0;
}

/* ---- tests ------------------------------------------------------------------------------------------ */

/* Each failure test runs over shared memory and over gloo's TCP. */
static void both_transports(int size, int64_t timeout_ms, rank_body body) {
  expect_all_ok(size, timeout_ms, body);
  g_shm_off = SHM_OFF_ALL;
  expect_all_ok(size, timeout_ms, body);
  g_shm_off = SHM_ON;
}

START_TEST(test_all_reduce) {
  expect_all_ok(2, 20000, body_all_reduce);
  expect_all_ok(3, 20000, body_all_reduce);
  g_shm_off = SHM_OFF_ALL;
  expect_all_ok(2, 20000, body_all_reduce);
  g_shm_off = 2;  // one rank without shared memory: all of them fall back alike
  expect_all_ok(3, 20000, body_all_reduce);
  g_shm_off = SHM_ON;
}
END_TEST

START_TEST(test_big_sum_identical_bytes) { both_transports(3, 20000, body_big_sum); }
END_TEST

START_TEST(test_shm_mismatch) { expect_all_ok(2, 20000, body_shm_mismatch); }
END_TEST

START_TEST(test_shared_regions) {
  expect_all_ok(2, 20000, body_shared);
  expect_all_ok(3, 20000, body_shared);  // rank 2 sums through scratch
  g_shm_off = SHM_OFF_ALL;
  expect_all_ok(2, 20000, body_shared);
  g_shm_off = SHM_ON;
  expect_all_ok(2, 20000, body_killed_shared);
}
END_TEST

START_TEST(test_broadcast) { both_transports(3, 20000, body_broadcast); }
END_TEST

START_TEST(test_all_gather) {
  both_transports(2, 20000, body_all_gather);
  expect_all_ok(4, 20000, body_all_gather);
}
END_TEST

START_TEST(test_reduce_scatter) {
  both_transports(3, 20000, body_reduce_scatter);
  expect_all_ok(4, 20000, body_reduce_scatter);
}
END_TEST

START_TEST(test_big_others) { both_transports(3, 20000, body_big_others); }
END_TEST

START_TEST(test_all_to_all) {
  expect_all_ok(2, 20000, body_all_to_all);
  expect_all_ok(3, 20000, body_all_to_all);
}
END_TEST

START_TEST(test_p2p_and_arguments) { expect_all_ok(2, 20000, body_p2p); }
END_TEST

START_TEST(test_async) { expect_all_ok(3, 20000, body_async); }
END_TEST

START_TEST(test_skipped_collective_times_out) {
  both_transports(3, 1500, body_skip_busy);
  both_transports(2, 1500, body_skip_elsewhere);
}
END_TEST

START_TEST(test_exited_rank_is_named) {
  both_transports(2, 20000, body_exit);
  both_transports(2, 20000, body_killed);
}
END_TEST

START_TEST(test_debug_mismatch) { expect_all_ok(2, 20000, body_debug_mismatch); }
END_TEST

START_TEST(test_ctrl_c) { expect_all_ok(2, 1500, body_ctrl_c); }
END_TEST

START_TEST(test_join_errors) {
  dlua_pg_t *pg = (dlua_pg_t *)1;
  tu_expect_error(dlua_pg_gloo_new("127.0.0.1", 1, TOKEN, "pg0", 2, 2, 1000, &pg), "rank 2 is out of range");
  ck_assert_ptr_null(pg);
  tu_expect_error(dlua_pg_gloo_new("127.0.0.1", 1, TOKEN, "", 0, 2, 1000, &pg), "name");
  tu_expect_error(dlua_pg_gloo_new("127.0.0.1", 1, TOKEN, "pg0", 0, 2, 0, &pg), "timeout must be positive");
  // the other rank never comes: the join times out and says who is missing
  dlua_store_server_t *srv = NULL;
  ck_assert_int_eq(dlua_store_server_start("127.0.0.1", 0, TOKEN, &srv), DLUA_OK);
  dlua_status_t s = dlua_pg_gloo_new("127.0.0.1", dlua_store_server_port(srv), TOKEN, "pg7", 0, 2, 500, &pg);
  ck_assert_int_eq(s, DLUA_ERR_TIMEOUT);
  ck_assert_msg(strstr(dlua_last_error(), "process group pg7: rank 0 of 2 could not join"), "%s", dlua_last_error());
  ck_assert_ptr_null(pg);
  // a group of one works without peers
  ck_assert_int_eq(dlua_pg_gloo_new("127.0.0.1", dlua_store_server_port(srv), TOKEN, "solo", 0, 1, 2000, &pg), DLUA_OK);
  dlua_tensor_t *t = vec(DLUA_DTYPE_F32, 3, 0);
  fill(t, 0, 0);
  ck_assert_int_eq(dlua_pg_all_reduce(pg, t, DLUA_PG_REDUCE_AVG, NULL, NULL), DLUA_OK);
  for (int64_t i = 0; i < 3; i++) ck_assert(get(t, i) == val(DLUA_DTYPE_F32, 0, i, 0));
  ck_assert_int_eq(dlua_pg_barrier(pg, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_pg_seq(pg), 2);
  dlua_tensor_free(t);
  dlua_pg_free(pg);
  dlua_pg_free(NULL);
  dlua_store_server_stop(srv);
}
END_TEST

static Suite *pg_suite(void) {
  Suite *s = suite_create("pg");
  TCase *tc = tcase_create("pg");
  tcase_set_timeout(tc, 90);
  tcase_add_test(tc, test_join_errors);
  tcase_add_test(tc, test_all_reduce);
  tcase_add_test(tc, test_big_sum_identical_bytes);
  tcase_add_test(tc, test_shm_mismatch);
  tcase_add_test(tc, test_big_others);
  tcase_add_test(tc, test_shared_regions);
  tcase_add_test(tc, test_broadcast);
  tcase_add_test(tc, test_all_gather);
  tcase_add_test(tc, test_reduce_scatter);
  tcase_add_test(tc, test_all_to_all);
  tcase_add_test(tc, test_p2p_and_arguments);
  tcase_add_test(tc, test_async);
  tcase_add_test(tc, test_skipped_collective_times_out);
  tcase_add_test(tc, test_exited_rank_is_named);
  tcase_add_test(tc, test_debug_mismatch);
  tcase_add_test(tc, test_ctrl_c);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run(pg_suite()); }

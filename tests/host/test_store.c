/* Check suite for host/comm/store_*.c: the rendezvous store's server, client and protocol. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/store.h"
#include "comm/store_server.h"
#include "core/api.h"
#include "core/error.h"

#include "testutil.h"

static const char *TOKEN = "job-7f3a";

static double ms_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Threads of this process, from the kernel: proves no test leaves one behind. */
static int thread_count(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  int n = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  fclose(f);
  return n;
}

/* A port nobody listens on right now (the kernel hands out a free one, we release it). */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = 0};
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t l = sizeof a;
  getsockname(fd, (struct sockaddr *)&a, &l);
  close(fd);
  return ntohs(a.sin_port);
}

static dlua_store_server_t *start_server(void) {
  dlua_store_server_t *srv = NULL;
  ck_assert_msg(dlua_store_server_start("127.0.0.1", 0, TOKEN, &srv) == DLUA_OK, "%s", dlua_last_error());
  ck_assert_int_gt(dlua_store_server_port(srv), 0);
  return srv;
}

static dlua_store_t *connect_to(dlua_store_server_t *srv) {
  dlua_store_t *c = NULL;
  ck_assert_msg(dlua_store_connect("127.0.0.1", dlua_store_server_port(srv), TOKEN, 5000, &c) == DLUA_OK, "%s",
                dlua_last_error());
  return c;
}

static int wait_for_clients(dlua_store_server_t *srv, int n, int ms) {
  for (int i = 0; i < ms / 10; i++) {
    if (dlua_store_server_num_clients(srv) == n) return 1;
    sleep_ms(10);
  }
  return dlua_store_server_num_clients(srv) == n;
}

/* ---- raw protocol, to play a broken or hostile client ---------------------------------- */

static void le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  struct timeval tv = {2, 0};  // a test must never hang on a server that does not answer
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Builds a request frame; returns its length. */
static size_t raw_frame(uint8_t *buf, uint8_t op, uint32_t n, const char *const *blobs, const uint32_t *lens) {
  size_t body = DLUA_STORE_REQUEST_FIXED;
  for (uint32_t i = 0; i < n; i++) body += 4 + lens[i];
  le32(buf, (uint32_t)body);
  buf[4] = op;
  memset(buf + 5, 0, 8);
  le32(buf + 13, n);
  uint8_t *p = buf + 17;
  for (uint32_t i = 0; i < n; i++) {
    le32(p, lens[i]);
    memcpy(p + 4, blobs[i], lens[i]);
    p += 4 + lens[i];
  }
  return 4 + body;
}

static void raw_send(int fd, const void *p, size_t n) {
  ck_assert_int_eq(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* Sends a correct HELLO and reads the server's OK. */
static void raw_hello(int fd, const char *token) {
  uint8_t ver[4];
  le32(ver, DLUA_STORE_VERSION);
  const char *blobs[3] = {DLUA_STORE_MAGIC, (const char *)ver, token};
  uint32_t lens[3] = {DLUA_STORE_MAGIC_LEN, 4, (uint32_t)strlen(token)};
  uint8_t buf[256];
  raw_send(fd, buf, raw_frame(buf, DLUA_STORE_OP_HELLO, 3, blobs, lens));
  uint8_t reply[64];
  ssize_t k = recv(fd, reply, sizeof reply, 0);
  ck_assert_int_ge(k, 9);
  ck_assert_int_eq(reply[4], DLUA_STORE_REPLY_OK);
}

/* True once the server has closed fd (EOF or reset), reading and discarding any reply. */
static int raw_closed_by_server(int fd) {
  uint8_t buf[4096];
  for (int i = 0; i < 100; i++) {
    ssize_t k = recv(fd, buf, sizeof buf, 0);
    if (k == 0 || (k < 0 && errno == ECONNRESET)) return 1;
    if (k < 0) return 0;  // timed out: still open
  }
  return 0;
}

/* ---- tests ------------------------------------------------------------------------------- */

START_TEST(test_set_get_round_trip) {
  int threads_at_start = thread_count();
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(c, "greeting", "hello", 5), DLUA_OK);
  void *v = NULL;
  size_t n = 99;
  ck_assert_int_eq(dlua_store_get(c, "greeting", 1000, &v, &n), DLUA_OK);
  ck_assert_uint_eq(n, 5);
  ck_assert_str_eq((const char *)v, "hello");  // NUL-terminated for C and ffi.string
  dlua_store_free_value(v);

  // Overwrite, empty and binary values (embedded NULs, every byte value).
  ck_assert_int_eq(dlua_store_set(c, "greeting", "bye", 3), DLUA_OK);
  ck_assert_int_eq(dlua_store_set(c, "empty", "", 0), DLUA_OK);
  uint8_t bin[256];
  for (int i = 0; i < 256; i++) bin[i] = (uint8_t)(255 - i);
  ck_assert_int_eq(dlua_store_set(c, "binary", bin, sizeof bin), DLUA_OK);
  ck_assert_int_eq(dlua_store_get(c, "greeting", 1000, &v, &n), DLUA_OK);
  ck_assert_uint_eq(n, 3);
  ck_assert_int_eq(memcmp(v, "bye", 3), 0);
  dlua_store_free_value(v);
  ck_assert_int_eq(dlua_store_get(c, "empty", 0, &v, &n), DLUA_OK);
  ck_assert_uint_eq(n, 0);
  ck_assert_ptr_nonnull(v);
  dlua_store_free_value(v);
  ck_assert_int_eq(dlua_store_get(c, "binary", 0, &v, &n), DLUA_OK);
  ck_assert_uint_eq(n, 256);
  ck_assert_int_eq(memcmp(v, bin, 256), 0);
  dlua_store_free_value(v);
  ck_assert_int_eq(dlua_store_server_num_keys(srv), 3);

  // A second client sees the first one's keys.
  dlua_store_t *c2 = connect_to(srv);
  ck_assert_int_eq(dlua_store_get(c2, "greeting", 0, &v, &n), DLUA_OK);
  ck_assert_int_eq(memcmp(v, "bye", 3), 0);
  dlua_store_free_value(v);
  dlua_store_close(c2);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
  ck_assert_int_eq(thread_count(), threads_at_start);
}
END_TEST

START_TEST(test_check_and_delete) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(c, "a", "1", 1), DLUA_OK);
  ck_assert_int_eq(dlua_store_set(c, "c", "3", 1), DLUA_OK);
  const char *keys[3] = {"a", "b", "c"};
  int ex[3] = {-1, -1, -1};
  ck_assert_int_eq(dlua_store_check(c, keys, 3, ex), DLUA_OK);
  ck_assert_int_eq(ex[0], 1);
  ck_assert_int_eq(ex[1], 0);
  ck_assert_int_eq(ex[2], 1);
  int deleted = -1;
  ck_assert_int_eq(dlua_store_delete(c, "a", &deleted), DLUA_OK);
  ck_assert_int_eq(deleted, 1);
  ck_assert_int_eq(dlua_store_delete(c, "a", &deleted), DLUA_OK);
  ck_assert_int_eq(deleted, 0);
  ck_assert_int_eq(dlua_store_delete(c, "never", NULL), DLUA_OK);
  ck_assert_int_eq(dlua_store_check(c, keys, 3, ex), DLUA_OK);
  ck_assert_int_eq(ex[0], 0);
  ck_assert_int_eq(ex[1], 0);
  ck_assert_int_eq(ex[2], 1);
  ck_assert_int_eq(dlua_store_server_num_keys(srv), 1);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

typedef struct {
  int port;
  int delay_ms;
  const char *key;
  const char *value;
  dlua_status_t status;
} setter_t;

static void *set_later(void *arg) {
  setter_t *s = arg;
  dlua_store_t *c = NULL;
  s->status = dlua_store_connect("127.0.0.1", s->port, TOKEN, 5000, &c);
  if (s->status != DLUA_OK) return NULL;
  sleep_ms(s->delay_ms);
  s->status = dlua_store_set(c, s->key, s->value, strlen(s->value));
  dlua_store_close(c);
  return NULL;
}

START_TEST(test_get_waits_for_later_set) {
  int threads_at_start = thread_count();
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  setter_t s = {dlua_store_server_port(srv), 150, "nccl-id", "0123456789abcdef", DLUA_ERR_INTERNAL};
  pthread_t t;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_create(&t, NULL, set_later, &s);
  void *v = NULL;
  size_t n = 0;
  ck_assert_msg(dlua_store_get(c, "nccl-id", 5000, &v, &n) == DLUA_OK, "%s", dlua_last_error());
  double waited = ms_since(&t0);
  pthread_join(t, NULL);
  ck_assert_int_eq(s.status, DLUA_OK);
  ck_assert_uint_eq(n, 16);
  ck_assert_int_eq(memcmp(v, "0123456789abcdef", 16), 0);
  ck_assert_double_ge(waited, 140.0);   // it really waited for the set...
  ck_assert_double_lt(waited, 3000.0);  // ...and woke when it came, not at the timeout
  dlua_store_free_value(v);

  // wait() on several keys, set one by one by another thread.
  setter_t s2 = {dlua_store_server_port(srv), 100, "rank1", "ready", DLUA_ERR_INTERNAL};
  ck_assert_int_eq(dlua_store_set(c, "rank0", "ready", 5), DLUA_OK);
  pthread_create(&t, NULL, set_later, &s2);
  const char *keys[2] = {"rank0", "rank1"};
  ck_assert_msg(dlua_store_wait(c, keys, 2, 5000) == DLUA_OK, "%s", dlua_last_error());
  pthread_join(t, NULL);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
  ck_assert_int_eq(thread_count(), threads_at_start);
}
END_TEST

START_TEST(test_timeouts_name_the_missing_keys) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  struct timespec t0;
  void *v = (void *)1;
  size_t n = 7;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_get(c, "missing-key", 200, &v, &n), DLUA_ERR_TIMEOUT);
  double waited = ms_since(&t0);
  ck_assert_double_ge(waited, 190.0);
  ck_assert_double_lt(waited, 1500.0);
  ck_assert_ptr_null(v);
  ck_assert_uint_eq(n, 0);
  const char *m = dlua_last_error();
  ck_assert_msg(strncmp(m, "store get:", 10) == 0, "%s", m);
  ck_assert_msg(strstr(m, "'missing-key'") && strstr(m, "200 ms"), "%s", m);

  // wait(): only the keys still missing are named.
  ck_assert_int_eq(dlua_store_set(c, "y", "1", 1), DLUA_OK);
  const char *keys[3] = {"x", "y", "z"};
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_wait(c, keys, 3, 200), DLUA_ERR_TIMEOUT);
  ck_assert_double_ge(ms_since(&t0), 190.0);
  m = dlua_last_error();
  ck_assert_msg(strncmp(m, "store wait:", 11) == 0, "%s", m);
  ck_assert_msg(strstr(m, "'x'") && strstr(m, "'z'") && !strstr(m, "'y'") && strstr(m, "2 of 3"), "%s", m);

  // The connection stays in step after a timeout: the next request gets its own reply.
  ck_assert_int_eq(dlua_store_set(c, "after", "ok", 2), DLUA_OK);
  ck_assert_int_eq(dlua_store_get(c, "after", 0, &v, &n), DLUA_OK);
  ck_assert_str_eq((const char *)v, "ok");
  dlua_store_free_value(v);

  // A negative timeout takes the client's default; timeout 0 does not wait at all.
  ck_assert_int_eq(dlua_store_set_timeout(c, 150), DLUA_OK);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_get(c, "missing-key", -1, &v, &n), DLUA_ERR_TIMEOUT);
  waited = ms_since(&t0);
  ck_assert_double_ge(waited, 140.0);
  ck_assert_double_lt(waited, 1500.0);
  ck_assert_int_eq(dlua_store_set_timeout(c, 5000), DLUA_OK);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_get(c, "missing-key", 0, &v, &n), DLUA_ERR_TIMEOUT);
  ck_assert_double_lt(ms_since(&t0), 1000.0);

  // Many missing keys: the message lists a few and counts the rest.
  const char *many[20];
  char names[20][16];
  for (int i = 0; i < 20; i++) {
    snprintf(names[i], sizeof names[i], "k%02d", i);
    many[i] = names[i];
  }
  ck_assert_int_eq(dlua_store_wait(c, many, 20, 50), DLUA_ERR_TIMEOUT);
  ck_assert_msg(strstr(dlua_last_error(), "20 of 20") && strstr(dlua_last_error(), "'k00'") &&
                    strstr(dlua_last_error(), "and 12 more"),
                "%s", dlua_last_error());
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

enum { ADD_THREADS = 8, ADD_ITERS = 1000 };

typedef struct {
  int port;
  dlua_store_t *shared; /* NULL: the thread opens its own connection, like a rank */
  int64_t *seen;        /* (ADD_THREADS * ADD_ITERS + 1) tallies of returned values */
  pthread_mutex_t *seen_lock;
  int iters;
  dlua_status_t status;
} adder_t;

static void *add_many(void *arg) {
  adder_t *a = arg;
  dlua_store_t *c = a->shared;
  a->status = DLUA_OK;
  if (!c && (a->status = dlua_store_connect("127.0.0.1", a->port, TOKEN, 5000, &c)) != DLUA_OK) return NULL;
  for (int i = 0; i < a->iters; i++) {
    int64_t v = 0;
    if ((a->status = dlua_store_add(c, "counter", 1, &v)) != DLUA_OK) break;
    pthread_mutex_lock(a->seen_lock);
    if (v >= 1 && v <= ADD_THREADS * ADD_ITERS) a->seen[v]++;
    pthread_mutex_unlock(a->seen_lock);
  }
  if (!a->shared) dlua_store_close(c);
  return NULL;
}

START_TEST(test_add_is_atomic_across_threads) {
  int threads_at_start = thread_count();
  dlua_store_server_t *srv = start_server();
  int64_t seen[ADD_THREADS * ADD_ITERS + 1] = {0};
  pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_t t[ADD_THREADS];
  adder_t a[ADD_THREADS];
  for (int i = 0; i < ADD_THREADS; i++) {
    a[i] = (adder_t){dlua_store_server_port(srv), NULL, seen, &lock, ADD_ITERS, DLUA_ERR_INTERNAL};
    pthread_create(&t[i], NULL, add_many, &a[i]);
  }
  for (int i = 0; i < ADD_THREADS; i++) {
    pthread_join(t[i], NULL);
    ck_assert_int_eq(a[i].status, DLUA_OK);
  }
  // Atomic: every new value 1..8000 was handed to exactly one caller.
  for (int v = 1; v <= ADD_THREADS * ADD_ITERS; v++) ck_assert_msg(seen[v] == 1, "value %d seen %d times", v, (int)seen[v]);
  dlua_store_t *c = connect_to(srv);
  void *v = NULL;
  size_t n = 0;
  ck_assert_int_eq(dlua_store_get(c, "counter", 0, &v, &n), DLUA_OK);
  ck_assert_str_eq((const char *)v, "8000");  // counters read back as decimal text
  dlua_store_free_value(v);

  // One handle shared by threads: requests queue up instead of interleaving on the socket.
  memset(seen, 0, sizeof seen);
  ck_assert_int_eq(dlua_store_delete(c, "counter", NULL), DLUA_OK);
  for (int i = 0; i < 4; i++) {
    a[i] = (adder_t){0, c, seen, &lock, 250, DLUA_ERR_INTERNAL};
    pthread_create(&t[i], NULL, add_many, &a[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    ck_assert_int_eq(a[i].status, DLUA_OK);
  }
  for (int k = 1; k <= 1000; k++) ck_assert_int_eq(seen[k], 1);

  // Negative deltas, a missing key counting as 0, text that is not a number, overflow.
  int64_t x = 0;
  ck_assert_int_eq(dlua_store_add(c, "fresh", -5, &x), DLUA_OK);
  ck_assert_int_eq(x, -5);
  ck_assert_int_eq(dlua_store_add(c, "fresh", 12, &x), DLUA_OK);
  ck_assert_int_eq(x, 7);
  ck_assert_int_eq(dlua_store_set(c, "text", "12abc", 5), DLUA_OK);
  ck_assert_int_eq(dlua_store_add(c, "text", 1, &x), DLUA_ERR_ARG);
  ck_assert_msg(strncmp(dlua_last_error(), "store add:", 10) == 0 && strstr(dlua_last_error(), "'text'"), "%s",
                dlua_last_error());
  ck_assert_int_eq(dlua_store_set(c, "big", "9223372036854775800", 19), DLUA_OK);
  ck_assert_int_eq(dlua_store_add(c, "big", 7, &x), DLUA_OK);
  ck_assert_int_eq(x, INT64_MAX);
  ck_assert_int_eq(dlua_store_add(c, "big", 1, &x), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "overflow"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_store_add(c, "big", 0, &x), DLUA_OK);  // unchanged by the refused add
  ck_assert_int_eq(x, INT64_MAX);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
  ck_assert_int_eq(thread_count(), threads_at_start);
}
END_TEST

enum { BARRIER_RANKS = 48 };

typedef struct {
  int port;
  dlua_status_t status;
  int64_t arrival;
} ranker_t;

/* A barrier as the process groups build it: count arrivals with add, the last one in
   releases everybody through a key they all wait on. */
static void *barrier_rank(void *arg) {
  ranker_t *r = arg;
  dlua_store_t *c = NULL;
  if ((r->status = dlua_store_connect(NULL, r->port, TOKEN, 5000, &c)) != DLUA_OK) return NULL;
  if ((r->status = dlua_store_add(c, "barrier/0/count", 1, &r->arrival)) == DLUA_OK) {
    if (r->arrival == BARRIER_RANKS) r->status = dlua_store_set(c, "barrier/0/done", "1", 1);
    const char *k[1] = {"barrier/0/done"};
    if (r->status == DLUA_OK) r->status = dlua_store_wait(c, k, 1, 10000);
  }
  dlua_store_close(c);
  return NULL;
}

START_TEST(test_barrier_of_many_clients) {
  dlua_store_server_t *srv = NULL;
  ck_assert_int_eq(dlua_store_server_start(NULL, 0, TOKEN, &srv), DLUA_OK);  // NULL host: loopback
  pthread_t t[BARRIER_RANKS];
  ranker_t r[BARRIER_RANKS];
  for (int i = 0; i < BARRIER_RANKS; i++) {
    r[i] = (ranker_t){dlua_store_server_port(srv), DLUA_ERR_INTERNAL, 0};
    pthread_create(&t[i], NULL, barrier_rank, &r[i]);
  }
  int arrived[BARRIER_RANKS + 1] = {0};
  for (int i = 0; i < BARRIER_RANKS; i++) {
    pthread_join(t[i], NULL);
    ck_assert_msg(r[i].status == DLUA_OK, "rank %d: %s", i, dlua_status_name(r[i].status));
    ck_assert(r[i].arrival >= 1 && r[i].arrival <= BARRIER_RANKS);
    arrived[r[i].arrival]++;
  }
  for (int k = 1; k <= BARRIER_RANKS; k++) ck_assert_int_eq(arrived[k], 1);
  ck_assert(wait_for_clients(srv, 0, 2000));
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_compare_set) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  void *cur = NULL;
  size_t n = 0;
  // Absent and expected absent (NULL): the swap happens.
  ck_assert_int_eq(dlua_store_compare_set(c, "leader", NULL, 0, "rank3", 5, &cur, &n), DLUA_OK);
  ck_assert_uint_eq(n, 5);
  ck_assert_str_eq((const char *)cur, "rank3");
  dlua_store_free_value(cur);
  // Present but expected absent: no swap, the current value comes back.
  ck_assert_int_eq(dlua_store_compare_set(c, "leader", NULL, 0, "rank1", 5, &cur, &n), DLUA_OK);
  ck_assert_str_eq((const char *)cur, "rank3");
  dlua_store_free_value(cur);
  // Present and different from expected: no swap.
  ck_assert_int_eq(dlua_store_compare_set(c, "leader", "rank9", 5, "rank1", 5, &cur, &n), DLUA_OK);
  ck_assert_str_eq((const char *)cur, "rank3");
  dlua_store_free_value(cur);
  // Present and equal: swapped.
  ck_assert_int_eq(dlua_store_compare_set(c, "leader", "rank3", 5, "rank1", 5, &cur, &n), DLUA_OK);
  ck_assert_str_eq((const char *)cur, "rank1");
  dlua_store_free_value(cur);
  // Absent with an expected value: no swap and no key (reported as NULL, not as `expected`).
  ck_assert_int_eq(dlua_store_compare_set(c, "nobody", "x", 1, "y", 1, &cur, &n), DLUA_OK);
  ck_assert_ptr_null(cur);
  ck_assert_uint_eq(n, 0);
  const char *k[1] = {"nobody"};
  int ex = -1;
  ck_assert_int_eq(dlua_store_check(c, k, 1, &ex), DLUA_OK);
  ck_assert_int_eq(ex, 0);
  // An empty value is not an absent key.
  ck_assert_int_eq(dlua_store_set(c, "e", "", 0), DLUA_OK);
  ck_assert_int_eq(dlua_store_compare_set(c, "e", NULL, 0, "z", 1, &cur, &n), DLUA_OK);
  ck_assert_uint_eq(n, 0);
  dlua_store_free_value(cur);
  ck_assert_int_eq(dlua_store_compare_set(c, "e", "", 0, "z", 1, &cur, &n), DLUA_OK);
  ck_assert_str_eq((const char *)cur, "z");
  dlua_store_free_value(cur);
  // A compare_set that creates the key wakes a waiter.
  ck_assert_int_eq(dlua_store_compare_set(c, "made-by-cas", NULL, 0, "v", 1, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_store_get(c, "made-by-cas", 0, &cur, &n), DLUA_OK);
  dlua_store_free_value(cur);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_wrong_token_is_refused) {
  dlua_store_server_t *srv = start_server();
  int port = dlua_store_server_port(srv);
  dlua_store_t *c = (dlua_store_t *)1;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", port, "another-job", 5000, &c), DLUA_ERR_ARG);
  ck_assert_ptr_null(c);
  ck_assert_double_lt(ms_since(&t0), 1000.0);  // refused at once, not retried until the timeout
  ck_assert_msg(strncmp(dlua_last_error(), "store connect:", 14) == 0 && strstr(dlua_last_error(), "wrong job token"),
                "%s", dlua_last_error());
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", port, "", 5000, &c), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", port, "job-7f3", 5000, &c), DLUA_ERR_ARG);  // a prefix
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", port, "job-7f3a ", 5000, &c), DLUA_ERR_ARG);

  // A first message that is not HELLO (here a GET) is refused and the connection closed.
  int fd = raw_connect(port);
  const char *blob[1] = {"secret"};
  uint32_t len[1] = {6};
  uint8_t buf[128];
  raw_send(fd, buf, raw_frame(buf, DLUA_STORE_OP_GET, 1, blob, len));
  uint8_t reply[256];
  ssize_t k = recv(fd, reply, sizeof reply, 0);
  ck_assert_int_ge(k, 5);
  ck_assert_int_eq(reply[4], DLUA_STORE_REPLY_WRONG_TOKEN);
  ck_assert(raw_closed_by_server(fd));
  close(fd);

  // The server is unharmed and the right token still gets in.
  dlua_store_t *ok = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(ok, "k", "v", 1), DLUA_OK);
  ck_assert(wait_for_clients(srv, 1, 2000));
  dlua_store_close(ok);
  dlua_store_server_stop(srv);
}
END_TEST

typedef struct {
  int port;
  int delay_ms;
  dlua_store_server_t *srv;
  dlua_status_t status;
} late_server_t;

static void *start_late(void *arg) {
  late_server_t *l = arg;
  sleep_ms(l->delay_ms);
  l->status = dlua_store_server_start("127.0.0.1", l->port, TOKEN, &l->srv);
  return NULL;
}

START_TEST(test_client_before_server) {
  int threads_at_start = thread_count();
  late_server_t l = {free_port(), 400, NULL, DLUA_ERR_INTERNAL};
  pthread_t t;
  pthread_create(&t, NULL, start_late, &l);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  dlua_store_t *c = NULL;
  dlua_status_t st = dlua_store_connect("127.0.0.1", l.port, TOKEN, 10000, &c);
  double waited = ms_since(&t0);
  pthread_join(t, NULL);
  ck_assert_msg(l.status == DLUA_OK, "server: %s", dlua_last_error());
  ck_assert_msg(st == DLUA_OK, "%s", dlua_last_error());
  ck_assert_double_ge(waited, 350.0);   // it had to retry...
  ck_assert_double_lt(waited, 3000.0);  // ...and got in soon after the server came up (back-off <= 1 s)
  ck_assert_int_eq(dlua_store_set(c, "k", "v", 1), DLUA_OK);
  dlua_store_close(c);
  dlua_store_server_stop(l.srv);
  ck_assert_int_eq(thread_count(), threads_at_start);
}
END_TEST

START_TEST(test_connect_times_out_without_server) {
  int port = free_port();
  dlua_store_t *c = NULL;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", port, TOKEN, 300, &c), DLUA_ERR_TIMEOUT);
  double waited = ms_since(&t0);
  ck_assert_double_ge(waited, 290.0);
  ck_assert_double_lt(waited, 2000.0);
  char where[64];
  snprintf(where, sizeof where, "127.0.0.1:%d", port);
  const char *m = dlua_last_error();
  ck_assert_msg(strncmp(m, "store connect:", 14) == 0 && strstr(m, where) && strstr(m, "refused"), "%s", m);
}
END_TEST

START_TEST(test_port_in_use_and_rebind) {
  dlua_store_server_t *srv = start_server();
  int port = dlua_store_server_port(srv);
  dlua_store_t *c = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(c, "k", "v", 1), DLUA_OK);
  dlua_store_server_t *second = (dlua_store_server_t *)1;
  ck_assert_int_eq(dlua_store_server_start("127.0.0.1", port, TOKEN, &second), DLUA_ERR_IO);
  ck_assert_ptr_null(second);
  ck_assert_msg(strstr(dlua_last_error(), "already in use"), "%s", dlua_last_error());
  // The server closes first, so its side of the connection lingers in TIME_WAIT: a new
  // job must still be able to bind the port (SO_REUSEADDR).
  dlua_store_server_stop(srv);
  dlua_store_close(c);
  ck_assert_msg(dlua_store_server_start("127.0.0.1", port, TOKEN, &srv) == DLUA_OK, "%s", dlua_last_error());
  ck_assert_int_eq(dlua_store_server_port(srv), port);
  dlua_store_server_stop(srv);
}
END_TEST

static void *get_blocking(void *arg) {
  dlua_store_t *c = arg;
  void *v = NULL;
  size_t n = 0;
  dlua_status_t st = dlua_store_get(c, "never-set", 10000, &v, &n);
  dlua_store_free_value(v);
  return (void *)(intptr_t)st;
}

START_TEST(test_client_dying_mid_request) {
  dlua_store_server_t *srv = start_server();
  int port = dlua_store_server_port(srv);
  dlua_store_t *c = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(c, "survivor", "yes", 3), DLUA_OK);

  // Half a SET frame, then the client vanishes.
  int fd = raw_connect(port);
  raw_hello(fd, TOKEN);
  const char *blobs[2] = {"half", "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"};
  uint32_t lens[2] = {4, 32};
  uint8_t buf[128];
  size_t n = raw_frame(buf, DLUA_STORE_OP_SET, 2, blobs, lens);
  raw_send(fd, buf, n / 2);
  close(fd);
  ck_assert_msg(wait_for_clients(srv, 1, 2000), "server still holds %d connections", dlua_store_server_num_clients(srv));

  // A process killed (SIGKILL) while parked in a blocking get.
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    dlua_store_t *cc = NULL;
    if (dlua_store_connect("127.0.0.1", port, TOKEN, 5000, &cc) != DLUA_OK) _exit(2);
    void *v;
    size_t len;
    dlua_store_get(cc, "never-set", 60000, &v, &len);
    _exit(3);
  }
  ck_assert(wait_for_clients(srv, 2, 5000));  // c and the child
  sleep_ms(50);                               // let the child's GET reach the server and park
  kill(pid, SIGKILL);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  ck_assert(WIFSIGNALED(wstatus));
  ck_assert_msg(wait_for_clients(srv, 1, 2000), "server still holds %d connections", dlua_store_server_num_clients(srv));

  // The server never saw the half SET, and still serves.
  const char *k[2] = {"half", "survivor"};
  int ex[2];
  ck_assert_int_eq(dlua_store_check(c, k, 2, ex), DLUA_OK);
  ck_assert_int_eq(ex[0], 0);
  ck_assert_int_eq(ex[1], 1);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_malformed_input_never_hurts_the_server) {
  dlua_store_server_t *srv = start_server();
  int port = dlua_store_server_port(srv);
  dlua_store_t *c = connect_to(srv);

  // An HTTP client on the wrong port: "GET " reads as a 542 MB frame; dropped before allocating.
  int fd = raw_connect(port);
  const char *http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  raw_send(fd, http, strlen(http));
  ck_assert(raw_closed_by_server(fd));
  close(fd);

  // After a good HELLO: a frame longer than the limit, a blob count that cannot fit, blob
  // lengths that overrun the frame, an unknown op, wrong arity, an empty key.
  uint8_t bad[6][64];
  size_t bad_len[6];
  le32(bad[0], 0xFFFFFFF0u);
  bad_len[0] = 4;
  const char *one[1] = {"k"};
  uint32_t one_len[1] = {1};
  bad_len[1] = raw_frame(bad[1], DLUA_STORE_OP_CHECK, 1, one, one_len);
  le32(bad[1] + 13, 0x7FFFFFFFu);
  bad_len[2] = raw_frame(bad[2], DLUA_STORE_OP_GET, 1, one, one_len);
  le32(bad[2] + 17, 1000);
  bad_len[3] = raw_frame(bad[3], 99, 1, one, one_len);
  bad_len[4] = raw_frame(bad[4], DLUA_STORE_OP_SET, 1, one, one_len);
  uint32_t zero[1] = {0};
  bad_len[5] = raw_frame(bad[5], DLUA_STORE_OP_GET, 1, one, zero);
  for (int i = 0; i < 6; i++) {
    fd = raw_connect(port);
    raw_hello(fd, TOKEN);
    raw_send(fd, bad[i], bad_len[i]);
    ck_assert_msg(raw_closed_by_server(fd), "malformed frame %d left the connection open", i);
    close(fd);
  }

  // Random bytes after a good HELLO: whatever they say, the server lives on.
  unsigned seed = 12345;
  for (int round = 0; round < 200; round++) {
    fd = raw_connect(port);
    raw_hello(fd, TOKEN);
    uint8_t junk[96];
    size_t len = 1 + (size_t)(rand_r(&seed) % sizeof junk);
    for (size_t i = 0; i < len; i++) junk[i] = (uint8_t)rand_r(&seed);
    if (round % 2) le32(junk, (uint32_t)(len >= 4 ? len - 4 : 0));  // half of them framed exactly
    raw_send(fd, junk, len);
    close(fd);
  }
  ck_assert_msg(wait_for_clients(srv, 1, 3000), "server still holds %d connections", dlua_store_server_num_clients(srv));
  ck_assert_int_eq(dlua_store_set(c, "alive", "1", 1), DLUA_OK);
  int64_t v = 0;
  ck_assert_int_eq(dlua_store_add(c, "n", 41, &v), DLUA_OK);
  ck_assert_int_eq(dlua_store_add(c, "n", 1, &v), DLUA_OK);
  ck_assert_int_eq(v, 42);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_large_values) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *a = connect_to(srv), *b = connect_to(srv);
  size_t sizes[2] = {(size_t)5 << 20, ((size_t)12 << 20) + 7};
  for (int k = 0; k < 2; k++) {
    size_t n = sizes[k];
    uint8_t *data = malloc(n);
    uint32_t x = 2463534242u + (uint32_t)k;
    for (size_t i = 0; i < n; i++) {  // xorshift: every byte matters
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      data[i] = (uint8_t)x;
    }
    ck_assert_msg(dlua_store_set(a, "blob", data, n) == DLUA_OK, "%s", dlua_last_error());
    void *v = NULL;
    size_t got = 0;
    ck_assert_msg(dlua_store_get(b, "blob", 5000, &v, &got) == DLUA_OK, "%s", dlua_last_error());
    ck_assert_uint_eq(got, n);
    ck_assert_int_eq(memcmp(v, data, n), 0);
    ck_assert_int_eq(((uint8_t *)v)[n], 0);
    dlua_store_free_value(v);
    free(data);
  }
  // Small requests still work on the same connections afterwards.
  ck_assert_int_eq(dlua_store_set(b, "small", "s", 1), DLUA_OK);
  int64_t cnt;
  ck_assert_int_eq(dlua_store_add(a, "c", 1, &cnt), DLUA_OK);
  dlua_store_close(a);
  dlua_store_close(b);
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_server_stop_with_clients_connected) {
  int threads_at_start = thread_count();
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c1 = connect_to(srv), *c2 = connect_to(srv), *c3 = connect_to(srv);
  ck_assert_int_eq(dlua_store_set(c1, "k", "v", 1), DLUA_OK);
  pthread_t t;
  pthread_create(&t, NULL, get_blocking, c2);
  sleep_ms(100);  // c2 is parked in the server
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  dlua_store_server_stop(srv);
  ck_assert_double_lt(ms_since(&t0), 1000.0);
  void *r;
  pthread_join(t, &r);
  ck_assert_double_lt(ms_since(&t0), 2000.0);  // the blocked get ended with the server, not at its 10 s timeout
  ck_assert_int_eq((dlua_status_t)(intptr_t)r, DLUA_ERR_IO);
  // Later calls fail quickly with an I/O error naming the op and the server.
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(dlua_store_set(c3, "k", "v", 1), DLUA_ERR_IO);
  ck_assert_double_lt(ms_since(&t0), 2000.0);
  ck_assert_msg(strncmp(dlua_last_error(), "store set:", 10) == 0 && strstr(dlua_last_error(), "127.0.0.1:"), "%s",
                dlua_last_error());
  ck_assert_int_eq(dlua_store_set(c1, "k", "v", 1), DLUA_ERR_IO);
  dlua_store_close(c1);
  dlua_store_close(c2);
  dlua_store_close(c3);
  ck_assert_int_eq(thread_count(), threads_at_start);
}
END_TEST

/* What the host's SIGINT handler does, from a real signal handler on this thread. */
static void on_alarm(int sig) {
  (void)sig;
  dlua_interrupt_set(1);
}

START_TEST(test_ctrl_c_interrupts_a_blocking_get) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  struct sigaction sa = {.sa_handler = on_alarm}, old;
  sigaction(SIGALRM, &sa, &old);
  struct itimerval it = {.it_value = {0, 200000}};
  setitimer(ITIMER_REAL, &it, NULL);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  void *v = NULL;
  size_t n = 0;
  ck_assert_int_eq(dlua_store_get(c, "never", 10000, &v, &n), DLUA_ERR_INTERRUPTED);
  double waited = ms_since(&t0);
  ck_assert_double_ge(waited, 190.0);
  ck_assert_double_lt(waited, 1500.0);
  ck_assert_msg(strncmp(dlua_last_error(), "store get: interrupted", 22) == 0, "%s", dlua_last_error());
  sigaction(SIGALRM, &old, NULL);
  dlua_interrupt_set(0);
  // The abandoned request's reply would arrive later on the old socket: the client
  // reconnected instead, so this set gets its own reply.
  ck_assert_msg(dlua_store_set(c, "never", "now", 3) == DLUA_OK, "%s", dlua_last_error());
  ck_assert_int_eq(dlua_store_get(c, "never", 0, &v, &n), DLUA_OK);
  ck_assert_str_eq((const char *)v, "now");
  dlua_store_free_value(v);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

START_TEST(test_bad_arguments) {
  dlua_store_server_t *srv = start_server();
  dlua_store_t *c = connect_to(srv);
  void *v;
  size_t n;
  ck_assert_int_eq(dlua_store_set(c, "", "v", 1), DLUA_ERR_ARG);
  ck_assert_msg(strncmp(dlua_last_error(), "store set:", 10) == 0, "%s", dlua_last_error());
  ck_assert_int_eq(dlua_store_set(c, NULL, "v", 1), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_set(c, "k", NULL, 3), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_set(NULL, "k", "v", 1), DLUA_ERR_ARG);
  char *longkey = malloc(DLUA_STORE_MAX_KEY + 2);
  memset(longkey, 'k', DLUA_STORE_MAX_KEY + 1);
  longkey[DLUA_STORE_MAX_KEY + 1] = '\0';
  ck_assert_int_eq(dlua_store_get(c, longkey, 0, &v, &n), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "4097 bytes"), "%s", dlua_last_error());
  longkey[DLUA_STORE_MAX_KEY] = '\0';  // exactly at the limit: accepted
  ck_assert_int_eq(dlua_store_set(c, longkey, "v", 1), DLUA_OK);
  free(longkey);
  const char *keys[1] = {"k"};
  ck_assert_int_eq(dlua_store_wait(c, keys, 0, 10), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_check(c, keys, 1, NULL), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_set(c, "k", "v", DLUA_STORE_MAX_VALUE + 1), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_set_timeout(c, -1), DLUA_ERR_ARG);
  dlua_store_t *bad = NULL;
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", 0, TOKEN, 100, &bad), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", 70000, TOKEN, 100, &bad), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_connect("127.0.0.1", 1, TOKEN, -5, &bad), DLUA_ERR_ARG);
  dlua_store_server_t *s2 = NULL;
  ck_assert_int_eq(dlua_store_server_start("127.0.0.1", -1, TOKEN, &s2), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_store_server_start("192.0.2.1", 0, TOKEN, &s2), DLUA_ERR_IO);  // not ours (TEST-NET)
  ck_assert_msg(strstr(dlua_last_error(), "not an address of this machine"), "%s", dlua_last_error());
  // The connection is still fine after all that.
  ck_assert_int_eq(dlua_store_set(c, "fine", "1", 1), DLUA_OK);
  dlua_store_server_stop(NULL);
  dlua_store_close(NULL);
  dlua_store_free_value(NULL);
  dlua_store_close(c);
  dlua_store_server_stop(srv);
}
END_TEST

static Suite *store_suite(void) {
  Suite *s = suite_create("store");
  TCase *tc = tcase_create("store");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_set_get_round_trip);
  tcase_add_test(tc, test_check_and_delete);
  tcase_add_test(tc, test_get_waits_for_later_set);
  tcase_add_test(tc, test_timeouts_name_the_missing_keys);
  tcase_add_test(tc, test_add_is_atomic_across_threads);
  tcase_add_test(tc, test_barrier_of_many_clients);
  tcase_add_test(tc, test_compare_set);
  tcase_add_test(tc, test_wrong_token_is_refused);
  tcase_add_test(tc, test_client_before_server);
  tcase_add_test(tc, test_connect_times_out_without_server);
  tcase_add_test(tc, test_port_in_use_and_rebind);
  tcase_add_test(tc, test_client_dying_mid_request);
  tcase_add_test(tc, test_malformed_input_never_hurts_the_server);
  tcase_add_test(tc, test_large_values);
  tcase_add_test(tc, test_server_stop_with_clients_connected);
  tcase_add_test(tc, test_ctrl_c_interrupts_a_blocking_get);
  tcase_add_test(tc, test_bad_arguments);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  return tu_run(store_suite());
}

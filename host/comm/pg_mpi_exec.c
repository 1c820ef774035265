/* Running one MPI call of a group within its deadline: polled on the comm thread, or blocking on the group's executor thread; the store watch for peers that exited. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/pg_mpi_exec.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/runtime.h"

/* Two ways to run a collective within the group's deadline, while watching the store for a peer that exited:
   - polled: its non-blocking form (MPI_Iallreduce...: Open MPI's libnbc) started on the comm thread and
     tested there, spinning briefly, then sleeping between tests. Nothing else is woken, and a wait for a late
     peer costs no CPU. Small collectives take this way (below blocking_from bytes; all-to-all never).
   - blocking: MPI's blocking call (coll/tuned's algorithms: ring, recursive halving, which let every rank
     reduce at once; libnbc's all-reduce for 2-3 ranks funnels through one) on the group's executor thread,
     which the comm thread waits for. It cannot be bounded or cancelled, so the thread hand-offs (costly on
     a busy machine) are paid only where the bytes dwarf them.
   A collective that does not end in time stays inside MPI for good: the group is broken, and its state, the
   executor and every buffer MPI may still touch stay allocated (the process is about to fail; MPI cannot
   abort one communicator). PyTorch's ProcessGroupMPI runs blocking calls on one thread, without a bound. */

int64_t dlua_mpi_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

dlua_pg_result_t dlua_mpi_fail(char *err, size_t n, dlua_pg_result_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
  return r;
}

static int64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Spins up to `us` microseconds for *flag to become set: a wake-up through the scheduler costs far more than
   a small collective on a busy machine. (No sched_yield: under load it hands whole time slices away.) */
static int spin_for(const int *flag, int us) {
  int64_t end = now_us() + us;
  for (int i = 0;; i++) {
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) return 1;
    if ((i & 63) == 63 && now_us() >= end) return 0;
    __builtin_ia32_pause();
  }
}

/* ---- the crash note ----------------------------------------------------------------------------
   MPI is allowed to crash on an erroneous program, and Open MPI does: ranks whose all-reduce counts differ get
   MPI_ERR_TRUNCATE on one side, and sometimes a segmentation fault in the shared-memory transport on the
   other, before the first has said anything. A crash inside one of a collective's MPI calls then says which
   call it was, on which rank, and the usual cause, before MPI's own handler prints its backtrace. */
static __thread const mpi_ctx_t *tl_ctx;  /* set while this thread is inside a collective's MPI calls */
static __thread const dlua_work_t *tl_work;
static struct sigaction g_prev[NSIG];
static const int g_crash_sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

static size_t put(char *b, size_t at, size_t cap, const char *s) {  // async-signal-safe strcat
  while (*s && at + 1 < cap) b[at++] = *s++;
  b[at] = '\0';
  return at;
}

static size_t put_int(char *b, size_t at, size_t cap, int64_t v) {
  char d[24];
  int n = 0;
  uint64_t u = v < 0 ? (uint64_t)-v : (uint64_t)v;
  do d[n++] = (char)('0' + u % 10); while ((u /= 10) && n < 23);
  if (v < 0) d[n++] = '-';
  while (n > 0 && at + 1 < cap) b[at++] = d[--n];
  b[at] = '\0';
  return at;
}

static void on_crash(int sig, siginfo_t *si, void *uc) {
  const mpi_ctx_t *x = tl_ctx;
  const dlua_work_t *w = tl_work;
  if (x && w) {
    static char b[1024];
    static const char *names[] = {[SIGSEGV] = "segmentation fault", [SIGBUS] = "bus error",
                                  [SIGFPE] = "arithmetic fault", [SIGILL] = "illegal instruction", [SIGABRT] = "abort"};
    size_t n = put(b, 0, sizeof b, "dlua: rank ");
    n = put_int(b, n, sizeof b, x->rank);
    n = put(b, n, sizeof b, " of group ");
    n = put(b, n, sizeof b, x->name);
    n = put(b, n, sizeof b, ": ");
    n = put(b, n, sizeof b, names[sig] ? names[sig] : "fatal signal");
    n = put(b, n, sizeof b, " inside MPI, in ");
    n = put(b, n, sizeof b, dlua_pg_kind_name(w->kind));
    n = put(b, n, sizeof b, " #");
    n = put_int(b, n, sizeof b, w->seq);
    n = put(b, n, sizeof b, " on ");
    n = put(b, n, sizeof b, w->desc);
    if (w->site[0]) {
      n = put(b, n, sizeof b, " at ");
      n = put(b, n, sizeof b, w->site);
    }
    n = put(b, n, sizeof b, ". MPI may crash when the ranks' calls disagree (sizes, dtypes, the order of collectives): "
                            "DLUA_DIST_DEBUG=1 checks each call against the other ranks' and names the first that differs\n");
    ssize_t r = write(2, b, n);
    (void)r;
  }
  // MPI's handler (or the default action) next: restored, it takes the fault again as this handler returns,
  // or the signal raised again
  sigaction(sig, &g_prev[sig], NULL);
  if (si && si->si_code <= 0) raise(sig);
  (void)uc;
}

void dlua_mpi_crash_note_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_crash;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < sizeof g_crash_sigs / sizeof g_crash_sigs[0]; i++)
    sigaction(g_crash_sigs[i], &sa, &g_prev[g_crash_sigs[i]]);
}

void *dlua_mpi_executor_main(void *arg) {
  mpi_ctx_t *x = arg;
  dlua_thread_name("dlua-mpi-exec");
  pthread_mutex_lock(&x->mu);
  for (;;) {
    if (!x->pending && !x->quit) {  // the next collective often comes at once (a loop, DDP's buckets)
      pthread_mutex_unlock(&x->mu);
      spin_for(&x->pending, SPIN_US);
      pthread_mutex_lock(&x->mu);
    }
    while (!x->pending && !x->quit) pthread_cond_wait(&x->cv_job, &x->mu);
    if (!x->pending) break;
    mpi_job_t j = x->job;
    pthread_mutex_unlock(&x->mu);
    tl_ctx = x;
    tl_work = x->cur;
    int rc = j.fn(x, &j);
    tl_ctx = NULL;
    pthread_mutex_lock(&x->mu);
    __atomic_store_n(&x->pending, 0, __ATOMIC_RELAXED);
    x->rc = rc;
    __atomic_store_n(&x->done, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&x->cv_done);
  }
  pthread_mutex_unlock(&x->mu);
  return NULL;
}

/* A peer that closed its group normally ("exited after N" in the group's store keys, pg_diag.c's convention)
   will never join this collective: its failure may not be this rank's, but MPI would wait for it forever. So
   would a store that stopped answering twice in a row: outside dlua's launcher rank 0 serves it, and it is
   gone. `only` >= 0 asks about that peer alone; *io_errors counts the store's failures in a row. */
int dlua_mpi_peer_exited(mpi_ctx_t *x, int only, int *io_errors, char *who, size_t n) {
  if (!x->store) return 0;
  int m = 0, found = 0;
  char **keys = calloc((size_t)x->size, sizeof(char *));
  int *peers = calloc((size_t)x->size, sizeof(int)), *exists = calloc((size_t)x->size, sizeof(int));
  for (int q = 0; keys && peers && exists && q < x->size; q++) {
    if (q == x->rank || (only >= 0 && q != only)) continue;
    if (!(keys[m] = malloc(PG_NAME + 32))) break;
    snprintf(keys[m], PG_NAME + 32, "%s/at/%d", x->name, q);
    peers[m++] = q;
  }
  if (m > 0 && dlua_store_check(x->store, (const char *const *)keys, m, exists) != DLUA_OK) {
    int io = dlua_last_status() == DLUA_ERR_IO;
    dlua_clear_error();
    if (io && ++*io_errors >= 2) {
      snprintf(who, n, "the job's store at %s:%d stopped answering (rank 0, which serves it, ended?)", x->store_host,
               x->store_port);
      found = 1;
    }
    m = 0;
  } else {
    *io_errors = 0;
  }
  for (int i = 0; i < m && !found; i++) {
    void *v = NULL;
    size_t len = 0;
    if (!exists[i]) continue;
    if (dlua_store_get(x->store, keys[i], 0, &v, &len) != DLUA_OK) {
      dlua_clear_error();
      continue;
    }
    if (!strncmp(v, "exited after ", 13)) {
      snprintf(who, n, "rank %d %s", peers[i], (char *)v);
      found = 1;
    }
    dlua_store_free_value(v);
  }
  if (keys)
    for (int i = 0; i < x->size; i++) free(keys[i]);
  free(keys);
  free(peers);
  free(exists);
  return found;
}

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t until_ms) {
  struct timespec ts = {until_ms / 1000, (long)(until_ms % 1000) * 1000000L};
  pthread_cond_timedwait(cv, mu, &ts);
}

static dlua_pg_result_t mpi_failed(int rc, const char *what, char *err, size_t errlen) {
  char e[MPI_MAX_ERROR_STRING + 40];
  dlua_mpi_error_text(rc, e, sizeof e);
  dlua_mpi_note_failure(0);
  int cls = rc;
  MPI_Error_class(rc, &cls);
  if (cls == MPI_ERR_TRUNCATE)
    return dlua_mpi_fail(err, errlen, DLUA_PG_MISMATCH,
                "%s: %s: the ranks disagree on the size (DLUA_DIST_DEBUG=1 names each rank's call)", what, e);
  return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "%s: %s", what, e);
}

/* Starts x->job's non-blocking form and tests it until it ends or the deadline passes: spinning for the
   first SPIN_US (small collectives), then sleeping between tests, longer as the wait grows (MPI moves
   bytes only while some thread is inside it, so a sleep delays the transfer by at most its length). */
static dlua_pg_result_t exec_polled(mpi_ctx_t *x, int64_t deadline, const char *what, char *err, size_t errlen) {
  MPI_Request rq;
  // The bytes take their memory-copy time anyway (about 1 GB/s per pass here): sleeping before that has
  // passed only delays the transfer, which moves while this thread tests.
  x->job.spin_us = SPIN_US + (int64_t)(x->job.bytes / 1000);
  int rc = x->job.ifn(x, &x->job, &rq);
  if (rc != MPI_SUCCESS) return mpi_failed(rc, what, err, errlen);
  int64_t start = now_us(), next_check = start + PEER_CHECK_MS * 1000;
  int done = 0, io_errors = 0;
  for (int i = 0;; i++) {
    rc = MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
    if (done || rc != MPI_SUCCESS) break;
    int64_t t = now_us(), waited = t - start;
    if (waited < x->job.spin_us) {
      for (int k = 0; k < 32; k++) __builtin_ia32_pause();
      continue;
    }
    if (t / 1000 >= deadline) {
      x->stuck = 1;  // the request stays: MPI may still write into the buffers
      dlua_mpi_note_failure(0);
      return dlua_mpi_fail(err, errlen, DLUA_PG_TIMEOUT, "%s: not complete after %" PRId64 " ms", what, waited / 1000);
    }
    if (t >= next_check) {
      char who[400] = "";
      if (dlua_mpi_peer_exited(x, -1, &io_errors, who, sizeof who)) {
        x->stuck = 1;
        dlua_mpi_note_failure(1);
        return dlua_mpi_fail(err, errlen, DLUA_PG_PEER_LOST, "%s: %s", what, who);
      }
      next_check = now_us() + PEER_CHECK_MS * 1000;
    }
    struct timespec ts = {0, waited < 2000 ? 5000L : waited < 20000 ? 50000L : 500000L};
    nanosleep(&ts, NULL);
  }
  return rc == MPI_SUCCESS ? DLUA_PG_OK : mpi_failed(rc, what, err, errlen);
}

/* Runs x->job within the deadline: polled on this thread, or on the executor. The caller filled x->job, whose
   bytes must be the same on every rank (so is DLUA_MPI_BLOCKING_FROM): MPI matches no blocking collective
   with a non-blocking one, so ranks that chose differently would wait for each other until the timeout. */
dlua_pg_result_t dlua_mpi_exec(mpi_ctx_t *x, int64_t deadline, const char *what, char *err, size_t errlen) {
  if (x->stuck) return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "%s: an earlier MPI call of this group never ended", what);
  if (x->job.ifn && x->job.bytes < x->blocking_from) {
    tl_ctx = x;
    tl_work = x->cur;
    dlua_pg_result_t r = exec_polled(x, deadline, what, err, errlen);
    tl_ctx = NULL;
    return r;
  }
  pthread_mutex_lock(&x->mu);
  __atomic_store_n(&x->done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&x->pending, 1, __ATOMIC_RELEASE);
  pthread_cond_signal(&x->cv_job);
  pthread_mutex_unlock(&x->mu);
  spin_for(&x->done, SPIN_US);  // small collectives end within microseconds
  int64_t start = dlua_mpi_now_ms(), next_check = start + PEER_CHECK_MS;
  int io_errors = 0;
  pthread_mutex_lock(&x->mu);
  while (!__atomic_load_n(&x->done, __ATOMIC_ACQUIRE)) {
    int64_t t = dlua_mpi_now_ms(), until = deadline < next_check ? deadline : next_check;
    if (t < until) {
      timed_wait(&x->cv_done, &x->mu, until);
      continue;
    }
    if (t >= deadline) {
      x->stuck = 1;
      pthread_mutex_unlock(&x->mu);
      dlua_mpi_note_failure(0);
      return dlua_mpi_fail(err, errlen, DLUA_PG_TIMEOUT, "%s: not complete after %" PRId64 " ms", what, t - start);
    }
    pthread_mutex_unlock(&x->mu);
    char who[400] = "";
    int lost = dlua_mpi_peer_exited(x, -1, &io_errors, who, sizeof who);
    pthread_mutex_lock(&x->mu);
    if (lost && !__atomic_load_n(&x->done, __ATOMIC_ACQUIRE)) {
      x->stuck = 1;
      pthread_mutex_unlock(&x->mu);
      dlua_mpi_note_failure(1);
      return dlua_mpi_fail(err, errlen, DLUA_PG_PEER_LOST, "%s: %s", what, who);
    }
    next_check = dlua_mpi_now_ms() + PEER_CHECK_MS;
  }
  int rc = x->rc;
  pthread_mutex_unlock(&x->mu);
  return rc == MPI_SUCCESS ? DLUA_PG_OK : mpi_failed(rc, what, err, errlen);
}

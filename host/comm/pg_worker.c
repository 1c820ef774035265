/* Process groups' works and the threads that run them: the queue, the comm thread, the p2p thread, waits. */
#define _GNU_SOURCE
#include "comm/pg_worker.h"

#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/pg.h"
#include "comm/flight.h"
#include "comm/pg_diag.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/runtime.h"

static const char *const kind_names[] = {"all_reduce", "broadcast",  "all_gather", "reduce_scatter",
                                         "all_to_all", "barrier",    "send",       "recv",
                                         "all_reduce_many"};

const char *dlua_pg_kind_name(int kind) {
  return kind >= 0 && kind < (int)(sizeof kind_names / sizeof kind_names[0]) ? kind_names[kind] : "?";
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- a work's life -------------------------------------------------------------------------------- */

void dlua_pg_work_set(dlua_work_t *w, dlua_status_t s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->msg, sizeof w->msg, fmt, ap);
  va_end(ap);
  w->status = s;
}

/* A callee's message without its " (host/...:N)" suffix: the wait adds its own location. */
void dlua_pg_work_from_last_error(dlua_work_t *w, const char *what) {
  char m[PG_MSG];
  snprintf(m, sizeof m, "%s", dlua_last_error());
  char *loc = strstr(m, " (host/");
  if (loc) *loc = '\0';
  dlua_pg_work_set(w, dlua_last_status() != DLUA_OK ? dlua_last_status() : DLUA_ERR_INTERNAL,
                   "%s #%" PRId64 ": %s: %s", kind_names[w->kind], w->seq, what, m);
}

static void work_release_tensors(dlua_work_t *w) {
  int n = w->nlist;
  dlua_tensor_free(w->t);
  w->t = NULL;
  if (w->outs)
    for (int r = 0; r < n; r++) dlua_tensor_free(w->outs[r]);
  if (w->ins)
    for (int r = 0; r < n; r++) dlua_tensor_free(w->ins[r]);
  free(w->outs);
  free(w->ins);
  w->outs = w->ins = NULL;
}

/* Staging buffers: page-locked when a CUDA tensor is copied through them (fast, asynchronous copies
   from the pinned caching allocator), plain malloc otherwise. */
void *dlua_pg_stage_alloc(const dlua_work_t *w, size_t bytes) {
  if (!w->pinned) return malloc(bytes);
  void *p = NULL;
  if (dlua_cuda_host_alloc(&p, bytes ? bytes : 1) != DLUA_OK) return NULL;
  return p;
}

void dlua_pg_stage_free(const dlua_work_t *w, void *p) {
  if (!p) return;
  if (!w->pinned) {
    free(p);
  } else if (dlua_cuda_host_free(p) != DLUA_OK) {
    dlua_clear_error();
  }
}

dlua_work_t *dlua_pg_work_new(dlua_pg_t *pg, int kind, const char *site) {
  dlua_work_t *w = calloc(1, sizeof *w);
  if (!w) {
    DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", kind_names[kind]);
    return NULL;
  }
  w->pg = pg;
  w->kind = kind;
  w->nlist = pg->size;
  w->cuda_dev = -1;
  snprintf(w->site, sizeof w->site, "%s", site ? site : "");
  return w;
}

/* The backend ended w->xfer (wait_posted, or post that failed): only what the group owns is left. */
void dlua_pg_work_destroy(dlua_work_t *w) {
  if (!w) return;
  work_release_tensors(w);
  dlua_pg_stage_free(w, w->stage);
  dlua_cuda_event_destroy(w->ready);
  free(w);
}

void dlua_pg_mark_broken(dlua_pg_t *pg, const dlua_work_t *w) {
  pthread_mutex_lock(&pg->mu);
  if (!pg->broken) {
    pg->broken = 1;
    // The summary: the failure itself, up to the list of ranks.
    int n = (int)strcspn(w->msg, ";");
    snprintf(pg->broken_msg, sizeof pg->broken_msg, "%.*s", n < 600 ? n : 600, w->msg);
  }
  pthread_mutex_unlock(&pg->mu);
}

/* ---- running one work on the comm thread ------------------------------------------------------- */

static void run_work(dlua_pg_t *pg, dlua_work_t *w) {
  int64_t timeout = __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED);
  pthread_mutex_lock(&pg->mu);
  int broken = pg->broken;
  if (broken)
    dlua_pg_work_set(w, DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", kind_names[w->kind], pg->name,
                     pg->broken_msg);
  pthread_mutex_unlock(&pg->mu);
  if (broken) return;
  w->status = DLUA_OK;
  w->msg[0] = '\0';
  dlua_flight_started(w);

  if (__atomic_load_n(&pg->debug, __ATOMIC_RELAXED) && w->kind != K_SEND && w->kind != K_RECV) {
    int d = dlua_pg_debug_check(pg, w, timeout);
    if (d == 1) return;   // the ranks disagree: every rank fails alike, the group stays usable
    if (d == 2) {
      dlua_pg_mark_broken(pg, w);
      return;
    }
  }

  char err[1024] = "";
  dlua_pg_result_t r = pg->be->run(pg->be_ctx, w, timeout, err, sizeof err);
  if (r == DLUA_PG_OK) return;
  dlua_pg_diagnose(pg, w, r, err, timeout);
  dlua_pg_mark_broken(pg, w);
}

/* Publishes a finished work (or frees it, when its caller already let go). */
static void work_complete(dlua_pg_t *pg, dlua_work_t *w) {
  dlua_flight_ended(w);
  work_release_tensors(w);  // before `done`: the caller may free its memory once it sees done
  pthread_mutex_lock(&pg->mu);
  int detached = w->detached;
  if (!detached) __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&pg->cv_done);
  pthread_mutex_unlock(&pg->mu);
  if (detached) dlua_pg_work_destroy(w);
}

/* ---- the threads -------------------------------------------------------------------------------- */

int dlua_pg_start_quiet_thread(pthread_t *th, void *(*fn)(void *), void *arg) {
  sigset_t all, old;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int e = pthread_create(th, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return e;
}

void *dlua_pg_comm_main(void *arg) {
  dlua_pg_t *pg = arg;
  dlua_thread_name("dlua-comm");
  char err[1024] = "";
  dlua_status_t store_status = DLUA_OK;
  dlua_pg_info_t info = {pg->store, pg->store_host, pg->store_port, pg->token, pg->name,
                         pg->rank,  pg->size,       pg->timeout_ms};
  dlua_pg_result_t r = pg->be->join(pg->be_ctx, &info, &store_status, err, sizeof err);
  pthread_mutex_lock(&pg->mu);
  if (r == DLUA_PG_OK) {
    pg->joined = 1;
  } else {
    pg->joined = -1;
    pg->join_status = store_status != DLUA_OK ? store_status
                      : r == DLUA_PG_TIMEOUT  ? DLUA_ERR_TIMEOUT
                                              : DLUA_ERR_BACKEND;
    char *loc = strstr(err, " (host/");
    if (loc) *loc = '\0';
    snprintf(pg->join_msg, sizeof pg->join_msg, "%s", err);
  }
  pthread_cond_broadcast(&pg->cv_done);
  pthread_mutex_unlock(&pg->mu);
  if (r != DLUA_PG_OK) return NULL;

  for (;;) {
    pthread_mutex_lock(&pg->mu);
    while (!pg->head && !pg->closing) pthread_cond_wait(&pg->cv_queue, &pg->mu);
    dlua_work_t *w = pg->head;
    if (!w) {
      pthread_mutex_unlock(&pg->mu);
      break;
    }
    pg->head = w->next;
    if (!pg->head) pg->tail = NULL;
    pthread_mutex_unlock(&pg->mu);

    run_work(pg, w);
    work_complete(pg, w);
  }
  return NULL;
}

/* Waits for posted send/recv in the order they were posted; later ones may finish first, which
   only delays their report, never their transfer. */
static void *p2p_main(void *arg) {
  dlua_thread_name("dlua-p2p");
  dlua_pg_t *pg = arg;
  for (;;) {
    pthread_mutex_lock(&pg->mu);
    while (!pg->p2p_head && !pg->closing) pthread_cond_wait(&pg->cv_queue, &pg->mu);
    dlua_work_t *w = pg->p2p_head;
    if (!w) {
      pthread_mutex_unlock(&pg->mu);
      break;
    }
    pg->p2p_head = w->next;
    if (!pg->p2p_head) pg->p2p_tail = NULL;
    pthread_mutex_unlock(&pg->mu);

    int64_t timeout = __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED);
    char err[1024] = "";
    dlua_pg_result_t r = pg->be->wait_posted(pg->be_ctx, w, timeout, err, sizeof err);
    if (r != DLUA_PG_OK) {
      dlua_pg_diagnose(pg, w, r, err, timeout);
      dlua_pg_mark_broken(pg, w);
    }
    work_complete(pg, w);
  }
  return NULL;
}

/* ---- queueing ----------------------------------------------------------------------------------- */

/* A queued work goes back to an async caller (work != NULL), or is waited for and freed here. */
static dlua_status_t hand_back_or_wait(dlua_work_t *w, dlua_work_t **work) {
  if (work) {
    *work = w;
    return DLUA_OK;
  }
  dlua_status_t s = dlua_work_wait(w, -1);
  dlua_work_free(w);
  return s;
}

dlua_status_t dlua_pg_enqueue(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work) {
  pthread_mutex_lock(&pg->mu);
  if (pg->broken) {
    char m[sizeof pg->broken_msg];
    snprintf(m, sizeof m, "%s", pg->broken_msg);
    pthread_mutex_unlock(&pg->mu);
    dlua_status_t s =
        DLUA_ERR(DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", kind_names[w->kind], pg->name, m);
    dlua_pg_work_destroy(w);
    return s;
  }
  w->seq = (w->kind == K_SEND || w->kind == K_RECV) ? pg->seq : ++pg->seq;
  dlua_flight_issued(pg, w);  // under mu: before the comm thread can end it
  if (pg->tail)
    pg->tail->next = w;
  else
    pg->head = w;
  pg->tail = w;
  pthread_cond_broadcast(&pg->cv_queue);
  pthread_mutex_unlock(&pg->mu);
  return hand_back_or_wait(w, work);
}

dlua_status_t dlua_pg_track_posted(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work) {
  pthread_mutex_lock(&pg->mu);
  dlua_flight_issued(pg, w);
  dlua_flight_started(w);  // posted: its transfer runs
  if (!w->xfer) {
    dlua_flight_ended(w);
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);  // nothing to move
  } else {
    if (!pg->has_p2p_thread) {
      if (dlua_pg_start_quiet_thread(&pg->p2p_thread, p2p_main, pg) != 0) {
        pthread_mutex_unlock(&pg->mu);
        // the transfer is posted and cannot be withdrawn: wait for it here instead
        char err[1024] = "";
        dlua_pg_result_t r = pg->be->wait_posted(pg->be_ctx, w, pg->timeout_ms, err, sizeof err);
        dlua_status_t s = r != DLUA_PG_OK     ? DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s", kind_names[w->kind], err)
                          : w->status != DLUA_OK ? DLUA_ERR(w->status, "%s", w->msg)
                                                 : DLUA_OK;
        if (s != DLUA_OK && w->status == DLUA_OK) w->status = s;
        dlua_flight_ended(w);
        dlua_pg_work_destroy(w);
        return s;
      }
      pg->has_p2p_thread = 1;
    }
    if (pg->p2p_tail)
      pg->p2p_tail->next = w;
    else
      pg->p2p_head = w;
    pg->p2p_tail = w;
    pthread_cond_broadcast(&pg->cv_queue);
  }
  pthread_mutex_unlock(&pg->mu);
  return hand_back_or_wait(w, work);
}

/* ---- waiting ------------------------------------------------------------------------------------ */

static dlua_status_t raise_work(const dlua_work_t *w) {
  if (w->status == DLUA_OK) return DLUA_OK;
  return DLUA_ERR(w->status, "%s", w->msg);
}

dlua_status_t dlua_work_wait(dlua_work_t *w, int64_t timeout_ms) {
  if (!w) return DLUA_ERR(DLUA_ERR_ARG, "work wait: the work is NULL");
  if (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE)) return raise_work(w);
  dlua_pg_t *pg = w->pg;
  int64_t start = now_ms();
  pthread_mutex_lock(&pg->mu);
  while (!__atomic_load_n(&w->done, __ATOMIC_ACQUIRE)) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += 100 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&pg->cv_done, &pg->mu, &ts);
    if (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE)) break;
    if (dlua_interrupt_pending()) {
      // The ranks' sequences are about to diverge (this one unwinds), so nothing later can match.
      if (!pg->broken) {
        pg->broken = 1;
        snprintf(pg->broken_msg, sizeof pg->broken_msg, "%s #%" PRId64 " was interrupted (Ctrl-C) on rank %d",
                 kind_names[w->kind], w->seq, pg->rank);
      }
      pthread_mutex_unlock(&pg->mu);
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s #%" PRId64 ": interrupted (Ctrl-C); process group %s is unusable now",
                      kind_names[w->kind], w->seq, pg->name);
    }
    if (timeout_ms >= 0 && now_ms() - start >= timeout_ms) {
      pthread_mutex_unlock(&pg->mu);
      return DLUA_ERR(DLUA_ERR_TIMEOUT, "%s #%" PRId64 ": not complete after %" PRId64 " ms (it goes on; wait again)",
                      kind_names[w->kind], w->seq, timeout_ms);
    }
  }
  pthread_mutex_unlock(&pg->mu);
  return raise_work(w);
}

int dlua_work_is_completed(const dlua_work_t *w) { return w ? __atomic_load_n(&w->done, __ATOMIC_ACQUIRE) : 1; }

void dlua_work_free(dlua_work_t *w) {
  if (!w) return;
  if (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE)) {
    dlua_pg_work_destroy(w);
    return;
  }
  dlua_pg_t *pg = w->pg;
  pthread_mutex_lock(&pg->mu);
  int done = __atomic_load_n(&w->done, __ATOMIC_ACQUIRE);
  if (!done) w->detached = 1;
  pthread_mutex_unlock(&pg->mu);
  if (done) dlua_pg_work_destroy(w);
}

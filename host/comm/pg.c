/* Process groups: the group object and its calls (checks, works, queueing); the comm thread is pg_worker.c's, bytes move in a backend. */
#define _GNU_SOURCE
#include "comm/pg.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/flight_agent.h"
#include "comm/pg_diag.h"
#include "comm/pg_worker.h"
#include "comm/store.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

/* ---- creating and freeing ------------------------------------------------------------------------ */

static void pg_destroy(dlua_pg_t *pg) {
  pthread_mutex_destroy(&pg->mu);
  pthread_cond_destroy(&pg->cv_queue);
  pthread_cond_destroy(&pg->cv_done);
  free(pg);
}

/* The backend's state goes with a group that never came to be (the status passes through). */
static dlua_status_t drop_backend(const dlua_pg_backend_t *be, void *ctx, dlua_status_t s) {
  if (be) be->close(ctx, 1);
  return s;
}

dlua_status_t dlua_pg_new_with_backend(const char *store_host, int store_port, const char *token, const char *name,
                                       int rank, int size, int64_t timeout_ms, const dlua_pg_backend_t *be, void *ctx,
                                       dlua_pg_t **out) {
  if (!be) return DLUA_ERR(DLUA_ERR_INTERNAL, "process group: no backend");
  if (!out) return drop_backend(be, ctx, DLUA_ERR(DLUA_ERR_ARG, "process group: out is NULL"));
  *out = NULL;
  if (!name || !*name || strlen(name) >= PG_NAME)
    return drop_backend(be, ctx, DLUA_ERR(DLUA_ERR_ARG, "process group: the name must be 1 to %d bytes", PG_NAME - 1));
  if (size < 1 || rank < 0 || rank >= size)
    return drop_backend(be, ctx,
                        DLUA_ERR(DLUA_ERR_ARG, "process group %s: rank %d is out of range for a group of %d ranks",
                                 name, rank, size));
  if (timeout_ms <= 0)
    return drop_backend(be, ctx,
                        DLUA_ERR(DLUA_ERR_ARG, "process group %s: the timeout must be positive, got %" PRId64 " ms",
                                 name, timeout_ms));
  dlua_pg_t *pg = calloc(1, sizeof *pg);
  if (!pg) return drop_backend(be, ctx, DLUA_ERR(DLUA_ERR_OOM, "process group %s: out of memory", name));
  pg->be = be;
  pg->be_ctx = ctx;
  snprintf(pg->name, sizeof pg->name, "%s", name);
  snprintf(pg->store_host, sizeof pg->store_host, "%s", store_host ? store_host : "");
  snprintf(pg->token, sizeof pg->token, "%s", token ? token : "");
  pg->store_port = store_port;
  pg->rank = rank;
  pg->size = size;
  pg->timeout_ms = timeout_ms;
  const char *dbg = getenv("DLUA_DIST_DEBUG");
  pg->debug = dbg && *dbg && strcmp(dbg, "0") != 0;
  pthread_mutex_init(&pg->mu, NULL);
  pthread_cond_init(&pg->cv_queue, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&pg->cv_done, &ca);
  pthread_condattr_destroy(&ca);

  dlua_status_t s = dlua_store_connect(store_host, store_port, token, timeout_ms, &pg->store);
  if (s != DLUA_OK) {
    pg_destroy(pg);
    return drop_backend(be, ctx, s);  // the store's message says where and why
  }
  dlua_agent_note_store(store_host, store_port, token);  // where the flight recorder's requests go too
  // The comm thread joins (gloo creates its device there), so the backend's threads inherit its signal mask.
  int e = dlua_pg_start_quiet_thread(&pg->thread, dlua_pg_comm_main, pg);
  if (e != 0) {
    dlua_store_close(pg->store);
    pg_destroy(pg);
    return drop_backend(be, ctx,
                        DLUA_ERR(DLUA_ERR_INTERNAL, "process group %s: cannot start its comm thread: %s", name,
                                 strerror(e)));
  }
  pthread_mutex_lock(&pg->mu);
  while (pg->joined == 0) pthread_cond_wait(&pg->cv_done, &pg->mu);
  pthread_mutex_unlock(&pg->mu);
  if (pg->joined < 0) {
    pthread_join(pg->thread, NULL);
    be->close(ctx, 1);  // what the backend built before it failed (gloo: its mesh, then no shared memory)
    dlua_store_close(pg->store);
    dlua_status_t js = pg->join_status;
    char msg[PG_MSG];
    snprintf(msg, sizeof msg, "%s", pg->join_msg);
    pg_destroy(pg);
    return DLUA_ERR(js, "process group %s: rank %d of %d could not join within %" PRId64 " ms: %s", name, rank, size,
                    timeout_ms, msg);
  }
  *out = pg;
  return DLUA_OK;
}

void dlua_pg_free(dlua_pg_t *pg) {
  if (!pg) return;
  pthread_mutex_lock(&pg->mu);
  pg->closing = 1;
  pthread_cond_broadcast(&pg->cv_queue);
  int64_t seq = pg->seq;
  int broken = pg->broken;
  int has_p2p = pg->has_p2p_thread;
  pthread_mutex_unlock(&pg->mu);
  pthread_join(pg->thread, NULL);
  if (has_p2p) pthread_join(pg->p2p_thread, NULL);
  // Peers that fail later read this and say "rank r exited after N collectives". It must be in the
  // store before our connections close, since closing them is what makes the peers fail. After a
  // failure the key keeps where this rank failed: peers still diagnosing need that more.
  if (pg->store && !broken) dlua_pg_diag_note_exit(pg, seq);
  pthread_mutex_lock(&pg->mu);
  broken = pg->broken;  // a queued work may have failed while the comm thread drained the queue
  pthread_mutex_unlock(&pg->mu);
  pg->be->close(pg->be_ctx, broken);
  dlua_store_close(pg->store);
  pg_destroy(pg);
}

int dlua_pg_rank(const dlua_pg_t *pg) { return pg ? pg->rank : -1; }
int dlua_pg_size(const dlua_pg_t *pg) { return pg ? pg->size : 0; }

int64_t dlua_pg_seq(const dlua_pg_t *pg) {
  if (!pg) return 0;
  pthread_mutex_lock((pthread_mutex_t *)&pg->mu);
  int64_t s = pg->seq;
  pthread_mutex_unlock((pthread_mutex_t *)&pg->mu);
  return s;
}

dlua_status_t dlua_pg_set_timeout(dlua_pg_t *pg, int64_t timeout_ms) {
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "pg set_timeout: the group is NULL");
  if (timeout_ms <= 0)
    return DLUA_ERR(DLUA_ERR_ARG, "process group %s: the timeout must be positive, got %" PRId64 " ms", pg->name,
                    timeout_ms);
  __atomic_store_n(&pg->timeout_ms, timeout_ms, __ATOMIC_RELAXED);
  return DLUA_OK;
}

dlua_status_t dlua_pg_set_debug(dlua_pg_t *pg, int on) {
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "pg set_debug: the group is NULL");
  __atomic_store_n(&pg->debug, on ? 1 : 0, __ATOMIC_RELAXED);
  return DLUA_OK;
}

/* ---- issuing ------------------------------------------------------------------------------------ */

static dlua_status_t check_tensor(const dlua_pg_t *pg, const char *op, const char *what, const dlua_tensor_t *t) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  return pg->be->check_tensor ? pg->be->check_tensor(pg->be_ctx, op, what, t) : DLUA_OK;
}

/* The CUDA device of the work's tensors (-1: all on the CPU); one device per work. */
static dlua_status_t work_find_device(dlua_work_t *w) {
  w->cuda_dev = -1;
  const dlua_tensor_t *one[1] = {w->t};
  dlua_tensor_t *const *lists[3] = {(dlua_tensor_t *const *)one, w->outs, w->ins};
  int counts[3] = {w->t ? 1 : 0, w->outs ? w->nlist : 0, w->ins ? w->nlist : 0};
  for (int l = 0; l < 3; l++)
    for (int i = 0; i < counts[l]; i++) {
      int d = lists[l][i]->device;
      if (d == DLUA_CPU) continue;
      if (w->cuda_dev >= 0 && d != w->cuda_dev)
        return DLUA_ERR(DLUA_ERR_ARG, "%s: tensors on cuda:%d and cuda:%d in one call (one device per collective)",
                        dlua_pg_kind_name(w->kind), w->cuda_dev, d);
      w->cuda_dev = d;
    }
  return DLUA_OK;
}

/* On the caller's thread, as a work is queued: what only this thread knows (the backend's prepare). */
static dlua_status_t work_prepare(dlua_pg_t *pg, dlua_work_t *w) {
  DLUA_TRY(work_find_device(w));
  return pg->be->prepare ? pg->be->prepare(pg->be_ctx, w) : DLUA_OK;
}

static dlua_status_t check_op(const char *op, dlua_reduce_t rop, dlua_dtype_t dt) {
  if ((int)rop < 0 || rop >= DLUA_PG_REDUCE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "%s: unknown reduce op %d", op, (int)rop);
  if (rop == DLUA_PG_REDUCE_AVG && !dlua_dtype_is_floating(dt))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: avg needs a floating dtype, got %s", op, dlua_dtype_name(dt));
  return DLUA_OK;
}

static dlua_status_t check_rank(const dlua_pg_t *pg, const char *op, const char *what, int r) {
  if (r < 0 || r >= pg->size)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %d is out of range for a group of %d ranks (0..%d)", op, what, r, pg->size,
                    pg->size - 1);
  return DLUA_OK;
}

static void describe(dlua_work_t *w, const dlua_tensor_t *t) {
  char s[140];
  snprintf(w->desc, sizeof w->desc, "%s %s", dlua_shape_str(t->ndim, t->sizes, s, sizeof s), dlua_dtype_name(t->dtype));
}

/* Takes handles on the caller's tensors so that they live until the work completes. */
static dlua_status_t hold_list(dlua_work_t *w, dlua_tensor_t ***dst, dlua_tensor_t *const *src) {
  int n = w->nlist;
  *dst = calloc((size_t)n, sizeof(dlua_tensor_t *));
  if (!*dst) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", dlua_pg_kind_name(w->kind));
  for (int r = 0; r < n; r++)
    if (!((*dst)[r] = dlua_tensor_alias(src[r]))) return DLUA_ERR_OOM;
  return DLUA_OK;
}

/* Queues w (synchronously waits for it when work is NULL). Takes w in every case. */
static dlua_status_t submit(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work) {
  dlua_status_t ps = work_prepare(pg, w);
  if (ps != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return ps;
  }
  return dlua_pg_enqueue(pg, w, work);
}

#define PG_PROLOGUE(opname)                                                          \
  if (work) *work = NULL;                                                            \
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "%s: the process group is NULL", opname)

dlua_status_t dlua_pg_all_reduce(dlua_pg_t *pg, dlua_tensor_t *t, dlua_reduce_t op, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("all_reduce");
  DLUA_TRY(check_tensor(pg, "all_reduce", "the tensor", t));
  DLUA_TRY(check_op("all_reduce", op, t->dtype));
  dlua_work_t *w = dlua_pg_work_new(pg, K_ALL_REDUCE, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_all_reduce_many(dlua_pg_t *pg, dlua_tensor_t *const *ts, int n, dlua_reduce_t op, const char *site,
                                      dlua_work_t **work) {
  PG_PROLOGUE("all_reduce_many");
  if (n < 0 || (n > 0 && !ts))
    return DLUA_ERR(DLUA_ERR_ARG, "all_reduce_many: %d tensors at %p", n, (const void *)ts);
  int64_t total = 0;
  for (int i = 0; i < n; i++) {
    char what[32];
    snprintf(what, sizeof what, "tensors[%d]", i);
    DLUA_TRY(check_tensor(pg, "all_reduce_many", what, ts[i]));
    DLUA_TRY(check_op("all_reduce_many", op, ts[i]->dtype));
    total += dlua_tensor_numel(ts[i]);
  }
  dlua_work_t *w = dlua_pg_work_new(pg, K_ALL_REDUCE_MANY, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  w->nlist = n;
  snprintf(w->desc, sizeof w->desc, "%d tensor%s, %" PRId64 " elements%s%s", n, n == 1 ? "" : "s", total,
           n ? " of " : "", n ? dlua_dtype_name(ts[0]->dtype) : "");
  if (n > 0 && hold_list(w, &w->ins, ts) != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_broadcast(dlua_pg_t *pg, dlua_tensor_t *t, int src, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("broadcast");
  DLUA_TRY(check_tensor(pg, "broadcast", "the tensor", t));
  DLUA_TRY(check_rank(pg, "broadcast", "src", src));
  dlua_work_t *w = dlua_pg_work_new(pg, K_BROADCAST, site);
  if (!w) return DLUA_ERR_OOM;
  w->peer = src;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_all_gather(dlua_pg_t *pg, dlua_tensor_t *const *outs, const dlua_tensor_t *t, const char *site,
                                 dlua_work_t **work) {
  PG_PROLOGUE("all_gather");
  DLUA_TRY(check_tensor(pg, "all_gather", "the input", t));
  if (!outs) return DLUA_ERR(DLUA_ERR_ARG, "all_gather: outs is NULL (expected %d tensors)", pg->size);
  for (int r = 0; r < pg->size; r++) {
    char what[32];
    snprintf(what, sizeof what, "outs[%d]", r);
    DLUA_TRY(check_tensor(pg, "all_gather", what, outs[r]));
    if (outs[r]->dtype != t->dtype)
      return DLUA_ERR(DLUA_ERR_ARG, "all_gather: outs[%d] is %s, the input is %s", r, dlua_dtype_name(outs[r]->dtype),
                      dlua_dtype_name(t->dtype));
  }
  if (dlua_tensor_numel(outs[pg->rank]) != dlua_tensor_numel(t))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "all_gather: outs[%d] (this rank's) has %" PRId64 " elements, the input has %" PRId64, pg->rank,
                    dlua_tensor_numel(outs[pg->rank]), dlua_tensor_numel(t));
  dlua_work_t *w = dlua_pg_work_new(pg, K_ALL_GATHER, site);
  if (!w) return DLUA_ERR_OOM;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t)) || hold_list(w, &w->outs, outs) != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_reduce_scatter(dlua_pg_t *pg, dlua_tensor_t *out, dlua_tensor_t *const *ins, dlua_reduce_t op,
                                     const char *site, dlua_work_t **work) {
  PG_PROLOGUE("reduce_scatter");
  DLUA_TRY(check_tensor(pg, "reduce_scatter", "out", out));
  DLUA_TRY(check_op("reduce_scatter", op, out->dtype));
  if (!ins) return DLUA_ERR(DLUA_ERR_ARG, "reduce_scatter: ins is NULL (expected %d tensors)", pg->size);
  for (int r = 0; r < pg->size; r++) {
    char what[32];
    snprintf(what, sizeof what, "ins[%d]", r);
    DLUA_TRY(check_tensor(pg, "reduce_scatter", what, ins[r]));
    if (ins[r]->dtype != out->dtype)
      return DLUA_ERR(DLUA_ERR_ARG, "reduce_scatter: ins[%d] is %s, out is %s", r, dlua_dtype_name(ins[r]->dtype),
                      dlua_dtype_name(out->dtype));
  }
  /* the parts may differ in size (every rank passes the same sizes: ZeRO's shards of a bucket); out is
     this rank's */
  if (dlua_tensor_numel(ins[pg->rank]) != dlua_tensor_numel(out))
    return DLUA_ERR(DLUA_ERR_ARG, "reduce_scatter: out has %" PRId64 " elements, this rank's part ins[%d] has %" PRId64,
                    dlua_tensor_numel(out), pg->rank, dlua_tensor_numel(ins[pg->rank]));
  dlua_work_t *w = dlua_pg_work_new(pg, K_REDUCE_SCATTER, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  describe(w, out);
  if (!(w->t = dlua_tensor_alias(out)) || hold_list(w, &w->ins, ins) != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_all_to_all(dlua_pg_t *pg, dlua_tensor_t *const *outs, dlua_tensor_t *const *ins, const char *site,
                                 dlua_work_t **work) {
  PG_PROLOGUE("all_to_all");
  if (!outs || !ins)
    return DLUA_ERR(DLUA_ERR_ARG, "all_to_all: %s is NULL (expected %d tensors)", outs ? "ins" : "outs", pg->size);
  int64_t sent = 0;
  for (int r = 0; r < pg->size; r++) {
    char what[32];
    snprintf(what, sizeof what, "ins[%d]", r);
    DLUA_TRY(check_tensor(pg, "all_to_all", what, ins[r]));
    snprintf(what, sizeof what, "outs[%d]", r);
    DLUA_TRY(check_tensor(pg, "all_to_all", what, outs[r]));
    if (ins[r]->dtype != ins[0]->dtype || outs[r]->dtype != ins[0]->dtype)
      return DLUA_ERR(DLUA_ERR_ARG, "all_to_all: every tensor needs one dtype: ins[0] is %s, %s[%d] is %s",
                      dlua_dtype_name(ins[0]->dtype), ins[r]->dtype != ins[0]->dtype ? "ins" : "outs", r,
                      dlua_dtype_name(ins[r]->dtype != ins[0]->dtype ? ins[r]->dtype : outs[r]->dtype));
    sent += dlua_tensor_numel(ins[r]);
  }
  if (dlua_tensor_numel(outs[pg->rank]) != dlua_tensor_numel(ins[pg->rank]))
    return DLUA_ERR(DLUA_ERR_ARG, "all_to_all: outs[%d] has %" PRId64 " elements but ins[%d] (sent to itself) has %" PRId64,
                    pg->rank, dlua_tensor_numel(outs[pg->rank]), pg->rank, dlua_tensor_numel(ins[pg->rank]));
  dlua_work_t *w = dlua_pg_work_new(pg, K_ALL_TO_ALL, site);
  if (!w) return DLUA_ERR_OOM;
  snprintf(w->desc, sizeof w->desc, "%s, %" PRId64 " elements sent", dlua_dtype_name(ins[0]->dtype), sent);
  if (hold_list(w, &w->outs, outs) != DLUA_OK || hold_list(w, &w->ins, ins) != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_barrier(dlua_pg_t *pg, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("barrier");
  dlua_work_t *w = dlua_pg_work_new(pg, K_BARRIER, site);
  if (!w) return DLUA_ERR_OOM;
  snprintf(w->desc, sizeof w->desc, "no tensor");
  return submit(pg, w, work);
}

/* send/recv do not queue behind collectives where the backend can post them: at once and in call order
   (as torch.distributed's gloo does), and a separate thread waits for them. So a rank may post several
   and its peers may match them in any order (isend + irecv both ways, pipelines). */
static dlua_status_t p2p(dlua_pg_t *pg, int kind, const dlua_tensor_t *t, int peer, int tag, const char *site,
                         dlua_work_t **work) {
  const char *op = dlua_pg_kind_name(kind);
  const char *who = kind == K_SEND ? "dst" : "src";
  DLUA_TRY(check_tensor(pg, op, "the tensor", t));
  DLUA_TRY(check_rank(pg, op, who, peer));
  if (peer == pg->rank) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %d is this rank", op, who, peer);
  if (tag < 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: tag %d is negative", op, tag);
  dlua_work_t *w = dlua_pg_work_new(pg, kind, site);
  if (!w) return DLUA_ERR_OOM;
  w->peer = peer;
  w->tag = tag;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR_OOM;
  }
  // A backend that cannot post them at once (NCCL orders them on its stream): queued like collectives.
  if (!pg->be->post) return submit(pg, w, work);
  if (work_prepare(pg, w) != DLUA_OK) {
    dlua_status_t s = dlua_last_status();
    dlua_pg_work_destroy(w);
    return s;
  }
  pthread_mutex_lock(&pg->mu);
  int broken = pg->broken;
  char bm[sizeof pg->broken_msg];
  snprintf(bm, sizeof bm, "%s", pg->broken_msg);
  w->seq = pg->seq;
  pthread_mutex_unlock(&pg->mu);
  if (broken) {
    dlua_pg_work_destroy(w);
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", op, pg->name, bm);
  }
  dlua_pg_result_t r = DLUA_PG_OK;
  char err[1024] = "";
  dlua_status_t s = pg->be->post(pg->be_ctx, w, &r, err, sizeof err);
  if (s == DLUA_OK && r != DLUA_PG_OK) {
    dlua_pg_diagnose(pg, w, r, err, __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED));
    dlua_pg_mark_broken(pg, w);
    s = DLUA_ERR(w->status, "%s", w->msg);
  }
  if (s != DLUA_OK) {
    dlua_pg_work_destroy(w);
    return s;
  }
  return dlua_pg_track_posted(pg, w, work);
}

dlua_status_t dlua_pg_send(dlua_pg_t *pg, const dlua_tensor_t *t, int dst, int tag, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("send");
  return p2p(pg, K_SEND, t, dst, tag, site, work);
}

dlua_status_t dlua_pg_recv(dlua_pg_t *pg, dlua_tensor_t *t, int src, int tag, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("recv");
  return p2p(pg, K_RECV, t, src, tag, site, work);
}

const char *dlua_pg_backend(const dlua_pg_t *pg) { return pg ? pg->be->name : ""; }


dlua_status_t dlua_pg_shared_zeros(dlua_pg_t *pg, dlua_dtype_t dtype, int64_t numel, dlua_tensor_t **out,
                                   const char **why) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: out is NULL");
  *out = NULL;
  if (why) *why = "";
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: the group is NULL");
  if (numel < 0 || (int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: bad size %" PRId64 " or dtype %d", numel, (int)dtype);
  if (!pg->be->shared_zeros) {
    if (why) *why = "the group is not a gloo group";
    return DLUA_OK;
  }
  return pg->be->shared_zeros(pg->be_ctx, dtype, numel, __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED), out, why);
}

const char *dlua_pg_transport(const dlua_pg_t *pg, const char **why) {
  if (why) *why = "";
  if (!pg) return "";
  return pg->be->transport ? pg->be->transport(pg->be_ctx, why) : pg->be->name;
}

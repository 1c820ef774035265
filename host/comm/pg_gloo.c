/* The gloo backend of process groups: gloo's TCP mesh (gloo.cc), and shared memory (shm.c) when every rank is on this host. */
#define _GNU_SOURCE
#include "comm/pg_gloo.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm/gloo.h"
#include "comm/pg_reduce.h"
#include "comm/shm.h"
#include "comm/store.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

enum {
  PG_P2P_PREFIX = 0x40,         /* gloo slot prefixes of ours, above gloo's own (0x01..0x08) */
  PG_RING_PREFIX = 0x41,
  PG_MAX_CUDA = 16              /* CUDA devices a gloo group stages tensors of (a stream each) */
};

typedef struct {
  char name[PG_NAME];
  int rank, size;
  dlua_gloo_t *gloo;
  dlua_shm_t *shm;         /* all ranks on this host: all-reduce of CPU memory goes through it, not gloo */
  char transport_why[160]; /* why shm is used or not */
  char store_host[256], token[DLUA_STORE_MAX_TOKEN + 1];  /* shared regions meet through a connection of their own */
  int store_port;
  char iface[64];          /* GLOO_SOCKET_IFNAME */
  pthread_mutex_t mu;      /* the comm and p2p threads both stage */
  int64_t regions;         /* shared regions made (under mu) */
  char region_why[160];    /* the last shared_zeros: why it gave no memory */
  dlua_cuda_stream_t *stage_streams[PG_MAX_CUDA];  /* under mu: copies of CUDA tensors */
} gloo_ctx_t;

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t tbytes(const dlua_tensor_t *t) { return (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype); }

/* ---- staging: contiguous bytes for gloo ---------------------------------------------------------
   A CUDA tensor (contiguous: checked when queued) is copied on `cs`, a stream of the group that
   waits for the caller's stream first, and the copy is waited for here. */

static dlua_status_t cuda_copy(void *dst, const void *src, size_t bytes, int kind, dlua_cuda_stream_t *cs) {
  DLUA_TRY(dlua_cuda_memcpy(dst, src, bytes, kind, 1, cs));
  return dlua_cuda_stream_synchronize(cs);
}

static dlua_status_t copy_to_flat(const dlua_tensor_t *t, void *dst, dlua_cuda_stream_t *cs) {
  if (dlua_tensor_numel(t) == 0) return DLUA_OK;
  if (t->device != DLUA_CPU) return cuda_copy(dst, dlua_tensor_ptr(t), tbytes(t), 1, cs);
  if (dlua_tensor_is_contiguous(t)) {
    memcpy(dst, dlua_tensor_ptr(t), tbytes(t));
    return DLUA_OK;
  }
  dlua_tensor_t *v;
  DLUA_TRY(dlua_tensor_wrap(&v, t->ndim, t->sizes, NULL, t->dtype, dst, NULL, NULL));
  dlua_status_t s = dlua_tensor_copy_(v, t);
  dlua_tensor_free(v);
  return s;
}

static dlua_status_t copy_from_flat(dlua_tensor_t *t, const void *src, dlua_cuda_stream_t *cs) {
  if (dlua_tensor_numel(t) == 0) return DLUA_OK;
  if (t->device != DLUA_CPU) return cuda_copy(dlua_tensor_ptr(t), src, tbytes(t), 0, cs);
  if (dlua_tensor_is_contiguous(t)) {
    memmove(dlua_tensor_ptr(t), src, tbytes(t));
    return DLUA_OK;
  }
  dlua_tensor_t *v;
  DLUA_TRY(dlua_tensor_wrap(&v, t->ndim, t->sizes, NULL, t->dtype, (void *)src, NULL, NULL));
  dlua_status_t s = dlua_tensor_copy_(t, v);
  dlua_tensor_free(v);
  return s;
}

/* gloo reads and writes this tensor's own memory (no staging copy). */
static int in_place(const dlua_tensor_t *t) { return t->device == DLUA_CPU && dlua_tensor_is_contiguous(t); }

/* The n tensors' bytes back to back in rank order, if they already lie so in memory (views of one
   flat buffer): then gloo reads/writes them directly. NULL otherwise. */
static char *packed_base(dlua_tensor_t *const *ts, int n) {
  char *base = NULL;
  size_t off = 0;
  for (int r = 0; r < n; r++) {
    size_t b = tbytes(ts[r]);
    if (b == 0) continue;
    if (!in_place(ts[r])) return NULL;
    char *p = dlua_tensor_ptr(ts[r]);
    if (!base) base = p - off;
    if (p != base + off) return NULL;
    off += b;
  }
  return base;
}

/* The group's stream for copies of cuda:dev tensors (created on first use). */
static dlua_cuda_stream_t *stage_stream(gloo_ctx_t *x, int dev) {
  if (dev < 0 || dev >= PG_MAX_CUDA) {
    DLUA_ERR(DLUA_ERR_ARG, "process group %s: cuda:%d is beyond the %d devices gloo stages for", x->name, dev,
             PG_MAX_CUDA);
    return NULL;
  }
  pthread_mutex_lock(&x->mu);
  dlua_cuda_stream_t *s = x->stage_streams[dev];
  pthread_mutex_unlock(&x->mu);
  if (s) return s;
  if (dlua_cuda_stream_create(&s, dev) != DLUA_OK) return NULL;
  pthread_mutex_lock(&x->mu);
  if (x->stage_streams[dev]) {  // the other thread won: keep one
    dlua_cuda_stream_t *won = x->stage_streams[dev];
    pthread_mutex_unlock(&x->mu);
    dlua_cuda_stream_destroy(s);
    return won;
  }
  x->stage_streams[dev] = s;
  pthread_mutex_unlock(&x->mu);
  return s;
}

/* A shared-memory collective's end as gloo's: a mismatch fails the work alike on every rank and leaves the
   group usable. */
static dlua_pg_result_t from_shm(dlua_work_t *w, dlua_shm_result_t sr, const char *err) {
  if (sr == DLUA_SHM_MISMATCH) dlua_pg_work_set(w, DLUA_ERR_ARG, "%s", err);
  return sr == DLUA_SHM_OK || sr == DLUA_SHM_MISMATCH ? DLUA_PG_OK
         : sr == DLUA_SHM_TIMEOUT                      ? DLUA_PG_TIMEOUT
                                                        : DLUA_PG_PEER_LOST;
}

/* reduce_scatter's inputs packed into dst (rank r's part at at[r] elements); false (the work's error set) on
   failure. */
static int stage_parts(dlua_work_t *w, char *dst, const size_t *at, size_t es, dlua_cuda_stream_t *cs) {
  for (int r = 0; r < w->nlist; r++)
    if (copy_to_flat(w->ins[r], dst + at[r] * es, cs) != DLUA_OK) {
      dlua_pg_work_from_last_error(w, "staging");
      return 0;
    }
  return 1;
}

/* all_reduce / broadcast of one tensor, in place when gloo can use its memory, else through a stage. */
static dlua_pg_result_t gloo_one(gloo_ctx_t *x, dlua_work_t *w, dlua_tensor_t *t, int kind, dlua_cuda_stream_t *cs,
                                 uint32_t tag, int64_t timeout, char *err, size_t errlen) {
  size_t n = (size_t)dlua_tensor_numel(t), es = dlua_dtype_size(t->dtype);
  if (n == 0) return DLUA_PG_OK;
  char *buf = dlua_tensor_ptr(t);
  void *stage = NULL;
  if (!in_place(t)) {
    if (!(stage = dlua_pg_stage_alloc(w, n * es))) {
      dlua_pg_work_set(w, DLUA_ERR_OOM, "%s #%" PRId64 ": out of memory staging %zu bytes", dlua_pg_kind_name(w->kind),
                       w->seq, n * es);
      return DLUA_PG_OK;
    }
    if (copy_to_flat(t, stage, cs) != DLUA_OK) {
      dlua_pg_work_from_last_error(w, "staging");
      dlua_pg_stage_free(w, stage);
      return DLUA_PG_OK;
    }
    buf = stage;
  }
  dlua_pg_result_t gr;
  if (kind == K_ALL_REDUCE && x->shm)
    gr = from_shm(w, dlua_shm_all_reduce(x->shm, buf, n, t->dtype, w->op, w->seq, timeout, err, errlen), err);
  else if (x->shm)
    gr = from_shm(w, dlua_shm_broadcast(x->shm, buf, n, t->dtype, w->peer, w->seq, timeout, err, errlen), err);
  else if (kind == K_ALL_REDUCE)
    gr = dlua_gloo_allreduce(x->gloo, buf, n, es, dlua_pg_reduce_fn_for(w->op, t->dtype), tag, timeout, err, errlen);
  else
    gr = dlua_gloo_broadcast(x->gloo, buf, n, es, w->peer, tag, timeout, err, errlen);
  if (gr == DLUA_PG_OK && kind == K_ALL_REDUCE && w->op == DLUA_PG_REDUCE_AVG && !x->shm)
    dlua_pg_divide_by(buf, n, t->dtype, x->size);
  int writes = kind == K_ALL_REDUCE || x->rank != w->peer;
  if (gr == DLUA_PG_OK && w->status == DLUA_OK && stage && writes && copy_from_flat(t, stage, cs) != DLUA_OK)
    dlua_pg_work_from_last_error(w, "writing back the staged result");
  dlua_pg_stage_free(w, stage);
  return gr;
}

/* Reduce-scatter as a ring over point-to-point exchanges: after size-1 steps, part `rank` of acc holds the
   reduction of every rank's ins[rank]. Part q has counts[q] elements at at[q] (sizes may differ); acc is
   consumed; tmp holds the largest part. */
static dlua_pg_result_t ring_reduce_scatter(gloo_ctx_t *x, char *acc, char *tmp, const size_t *counts,
                                            const size_t *at, size_t es, dlua_pg_reduce_fn fn, uint32_t tag,
                                            int64_t timeout, char *err, size_t errlen) {
  int n = x->size, r = x->rank;
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  int64_t deadline = now_ms() + timeout;
  for (int s = 0; s < n - 1; s++) {
    int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    int64_t left = deadline - now_ms();
    // an empty part is neither sent nor received (every rank knows every part's size)
    dlua_pg_result_t gr = dlua_gloo_exchange(x->gloo, acc + at[send_idx] * es, counts[send_idx] * es,
                                             counts[send_idx] ? next : -1, tmp, counts[recv_idx] * es,
                                             counts[recv_idx] ? prev : -1, PG_RING_PREFIX, tag, left > 0 ? left : 1,
                                             err, errlen);
    if (gr != DLUA_PG_OK) return gr;
    char *c = acc + at[recv_idx] * es;
    fn(c, c, tmp, counts[recv_idx]);
  }
  return DLUA_PG_OK;
}

/* ---- the backend's table ------------------------------------------------------------------------------ */

static dlua_pg_result_t gl_run(void *c, dlua_work_t *w, int64_t timeout, char *err, size_t errlen) {
  gloo_ctx_t *x = c;
  dlua_pg_result_t gr = DLUA_PG_OK;
  uint32_t tag = (uint32_t)(w->seq * 2);
  int size = x->size, rank = x->rank;
  void *stage = NULL, *stage2 = NULL;
  static char dummy[8];  // a valid address for empty buffers
  dlua_cuda_stream_t *cs = NULL;  // CUDA tensors: copies wait for the caller's stream, then run on this one
  if (w->cuda_dev >= 0 && w->kind != K_SEND && w->kind != K_RECV) {
    if (!(cs = stage_stream(x, w->cuda_dev)) ||
        (w->ready && dlua_cuda_stream_wait_event(cs, w->ready) != DLUA_OK)) {
      dlua_pg_work_from_last_error(w, "staging CUDA tensors");
      return DLUA_PG_OK;
    }
  }

  switch (w->kind) {
    case K_SEND:
    case K_RECV: break;  // posted (gl_post), never queued
    case K_ALL_REDUCE:
    case K_BROADCAST: gr = gloo_one(x, w, w->t, w->kind, cs, tag, timeout, err, errlen); break;
    case K_ALL_REDUCE_MANY:
      // gloo has no grouped calls: one ring after the other, under one sequence number
      for (int i = 0; i < w->nlist && gr == DLUA_PG_OK && w->status == DLUA_OK; i++)
        gr = gloo_one(x, w, w->ins[i], K_ALL_REDUCE, cs, tag, timeout, err, errlen);
      break;
    case K_ALL_GATHER: {
      size_t es = dlua_dtype_size(w->t->dtype), total = 0;
      size_t *counts = malloc((size_t)size * sizeof(size_t));
      if (!counts) {
        dlua_pg_work_set(w, DLUA_ERR_OOM, "all_gather #%" PRId64 ": out of memory", w->seq);
        return DLUA_PG_OK;
      }
      for (int r = 0; r < size; r++) total += counts[r] = (size_t)dlua_tensor_numel(w->outs[r]);
      if (total == 0) {
        free(counts);
        break;
      }
      char *out = packed_base(w->outs, size);
      char *in = in_place(w->t) ? dlua_tensor_ptr(w->t) : NULL;
      if (!out) out = stage = dlua_pg_stage_alloc(w, total * es);
      if (!in) {
        in = stage2 = dlua_pg_stage_alloc(w, counts[rank] * es + 1);
        if (in && copy_to_flat(w->t, in, cs) != DLUA_OK) {
          dlua_pg_work_from_last_error(w, "staging");
          free(counts);
          break;
        }
      }
      if (!out || !in) {
        dlua_pg_work_set(w, DLUA_ERR_OOM, "all_gather #%" PRId64 ": out of memory staging %zu bytes", w->seq,
                         total * es);
        free(counts);
        break;
      }
      if (counts[rank] == 0) in = dummy;
      if (x->shm)
        gr = from_shm(w, dlua_shm_all_gather(x->shm, in, out, counts, w->t->dtype, w->seq, timeout, err, errlen),
                      err);
      else
        gr = dlua_gloo_allgatherv(x->gloo, in, out, counts, es, tag, timeout, err, errlen);
      if (gr == DLUA_PG_OK && w->status == DLUA_OK && stage) {
        size_t off = 0;
        for (int r = 0; r < size && w->status == DLUA_OK; r++) {
          if (copy_from_flat(w->outs[r], (char *)stage + off * es, cs) != DLUA_OK)
            dlua_pg_work_from_last_error(w, "writing back the staged result");
          off += counts[r];
        }
      }
      free(counts);
      break;
    }
    case K_REDUCE_SCATTER: {
      dlua_tensor_t *out = w->t;
      size_t es = dlua_dtype_size(out->dtype), total = 0, most = 0;
      size_t *counts = malloc(2 * (size_t)size * sizeof(size_t)), *at = counts + size;
      if (!counts) {
        dlua_pg_work_set(w, DLUA_ERR_OOM, "reduce_scatter #%" PRId64 ": out of memory", w->seq);
        break;
      }
      for (int q = 0; q < size; q++) {  // the parts may differ in size (the same on every rank)
        at[q] = total;
        total += counts[q] = (size_t)dlua_tensor_numel(w->ins[q]);
        if (counts[q] > most) most = counts[q];
      }
      size_t m = counts[rank];
      if (total == 0) {
        free(counts);
        break;
      }
      if (x->shm) {  // reads the inputs where they lie when they are one flat buffer, writes out in place
        const char *in = cs ? NULL : packed_base(w->ins, size);
        char *dst = in_place(out) && m ? dlua_tensor_ptr(out) : NULL;
        if (!in) in = stage = dlua_pg_stage_alloc(w, total * es + 1);
        if (!dst) dst = stage2 = dlua_pg_stage_alloc(w, m * es + 1);
        if (!in || !dst) {
          dlua_pg_work_set(w, DLUA_ERR_OOM, "reduce_scatter #%" PRId64 ": out of memory staging %zu bytes", w->seq,
                           (total + m) * es);
        } else if (!stage || stage_parts(w, stage, at, es, cs)) {
          gr = from_shm(w,
                        dlua_shm_reduce_scatter(x->shm, in, dst, counts, out->dtype, w->op, w->seq, timeout, err,
                                                errlen),
                        err);  // reduces and divides
          if (gr == DLUA_PG_OK && w->status == DLUA_OK && stage2 && m && copy_from_flat(out, dst, cs) != DLUA_OK)
            dlua_pg_work_from_last_error(w, "writing the result");
        }
        free(counts);
        break;
      }
      char *acc = stage = dlua_pg_stage_alloc(w, total * es);
      char *tmp = stage2 = dlua_pg_stage_alloc(w, most * es);
      if (!acc || !tmp) {
        dlua_pg_work_set(w, DLUA_ERR_OOM, "reduce_scatter #%" PRId64 ": out of memory staging %zu bytes", w->seq,
                         (total + most) * es);
      } else if (stage_parts(w, acc, at, es, cs)) {
        if (size > 1)
          gr = ring_reduce_scatter(x, acc, tmp, counts, at, es, dlua_pg_reduce_fn_for(w->op, out->dtype), tag,
                                   timeout, err, errlen);
        char *mine = acc + at[rank] * es;
        if (gr == DLUA_PG_OK && m) {
          if (w->op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(mine, m, out->dtype, size);
          if (copy_from_flat(out, mine, cs) != DLUA_OK) dlua_pg_work_from_last_error(w, "writing the result");
        }
      }
      free(counts);
      break;
    }
    case K_ALL_TO_ALL: {
      size_t es = dlua_dtype_size(w->ins[0]->dtype), tin = 0, tout = 0;
      int64_t *ic = malloc((size_t)size * sizeof(int64_t)), *oc = malloc((size_t)size * sizeof(int64_t));
      if (!ic || !oc) {
        free(ic);
        free(oc);
        dlua_pg_work_set(w, DLUA_ERR_OOM, "all_to_all #%" PRId64 ": out of memory", w->seq);
        return DLUA_PG_OK;
      }
      for (int r = 0; r < size; r++) {
        tin += (size_t)(ic[r] = dlua_tensor_numel(w->ins[r]));
        tout += (size_t)(oc[r] = dlua_tensor_numel(w->outs[r]));
      }
      char *in = tin ? packed_base(w->ins, size) : dummy;
      char *out = tout ? packed_base(w->outs, size) : dummy;
      if (!in) {
        in = stage2 = dlua_pg_stage_alloc(w, tin * es);
        size_t off = 0;
        for (int r = 0; in && r < size; off += (size_t)ic[r], r++)
          if (copy_to_flat(w->ins[r], in + off * es, cs) != DLUA_OK) {
            dlua_pg_work_from_last_error(w, "staging");
            break;
          }
      }
      if (!out) out = stage = dlua_pg_stage_alloc(w, tout * es);
      if (w->status == DLUA_OK && (!in || !out))
        dlua_pg_work_set(w, DLUA_ERR_OOM, "all_to_all #%" PRId64 ": out of memory staging", w->seq);
      if (w->status == DLUA_OK) {
        gr = dlua_gloo_alltoallv(x->gloo, in, ic, out, oc, es, tag, timeout, err, errlen);
        if (gr == DLUA_PG_OK && stage) {
          size_t off = 0;
          for (int r = 0; r < size && w->status == DLUA_OK; r++) {
            if (copy_from_flat(w->outs[r], (char *)stage + off * es, cs) != DLUA_OK)
              dlua_pg_work_from_last_error(w, "writing back the staged result");
            off += (size_t)oc[r];
          }
        }
      }
      free(ic);
      free(oc);
      break;
    }
    case K_BARRIER: gr = dlua_gloo_barrier(x->gloo, tag, timeout, err, errlen); break;
  }
  dlua_pg_stage_free(w, stage);
  dlua_pg_stage_free(w, stage2);
  return gr;
}

static dlua_status_t gl_check_tensor(void *c, const char *op, const char *what, const dlua_tensor_t *t) {
  if (t->device != DLUA_CPU && !dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: gloo stages cuda:%d tensors through pinned host memory, and %s is not contiguous (CUDA "
                    "strided copies are not built yet: pass t:contiguous())",
                    op, t->device, what);
  return DLUA_OK;
}

/* An event on the caller's current stream of the CUDA tensors' device, which the staging copies wait
   for; so the copies see every kernel the caller queued before the call, as NCCL's stream ordering does. */
static dlua_status_t gl_prepare(void *c, dlua_work_t *w) {
  if (w->cuda_dev < 0) return DLUA_OK;
  w->pinned = 1;
  if (w->kind == K_SEND || w->kind == K_RECV) return DLUA_OK;  // staged on the caller's thread
  DLUA_TRY(dlua_cuda_event_create(&w->ready, w->cuda_dev, 0));
  return dlua_cuda_event_record(w->ready, NULL);
}

/* send/recv go to gloo's event loop at once (a strided or CUDA send is read here, into the stage). */
static dlua_status_t gl_post(void *c, dlua_work_t *w, dlua_pg_result_t *result, char *err, size_t errlen) {
  gloo_ctx_t *x = c;
  const char *op = dlua_pg_kind_name(w->kind);
  const dlua_tensor_t *t = w->t;
  *result = DLUA_PG_OK;
  size_t bytes = tbytes(t);
  void *ptr = dlua_tensor_ptr(t);
  if (bytes && !in_place(t)) {
    if (!(w->stage = dlua_pg_stage_alloc(w, bytes)))
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory staging %zu bytes", op, bytes);
    // A CUDA tensor is read here, after the caller's stream has produced it.
    dlua_cuda_stream_t *cs = t->device != DLUA_CPU ? dlua_cuda_current_stream(t->device) : NULL;
    if (w->kind == K_SEND && copy_to_flat(t, w->stage, cs) != DLUA_OK) return dlua_last_status();
    ptr = w->stage;
  }
  if (!bytes) return DLUA_OK;  // nothing to move: w->xfer stays NULL, the work is done
  // gloo may write to the socket from this thread: a peer that just died must not SIGPIPE us.
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  dlua_gloo_p2p_t *p = NULL;
  *result = dlua_gloo_p2p_post(x->gloo, ptr, bytes, w->peer, w->kind == K_SEND, PG_P2P_PREFIX, (uint32_t)w->tag, &p,
                               err, errlen);
  struct timespec zero = {0, 0};
  while (sigtimedwait(&pipe_set, NULL, &zero) > 0) {
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (*result != DLUA_PG_OK) {
    dlua_gloo_p2p_free(p);
    return DLUA_OK;
  }
  w->xfer = p;
  return DLUA_OK;
}

static dlua_pg_result_t gl_wait_posted(void *c, dlua_work_t *w, int64_t timeout, char *err, size_t errlen) {
  gloo_ctx_t *x = c;
  dlua_pg_result_t r = dlua_gloo_p2p_wait(w->xfer, timeout, err, errlen);
  if (r == DLUA_PG_OK && w->kind == K_RECV && w->stage) {
    dlua_cuda_stream_t *cs = w->cuda_dev >= 0 ? stage_stream(x, w->cuda_dev) : NULL;
    if ((w->cuda_dev >= 0 && !cs) || copy_from_flat(w->t, w->stage, cs) != DLUA_OK)
      dlua_pg_work_from_last_error(w, "writing back the staged result");
  }
  dlua_gloo_p2p_free(w->xfer);
  w->xfer = NULL;
  dlua_pg_stage_free(w, w->stage);
  w->stage = NULL;
  return r;
}

/* Tag 2 * seq + 1: beside the collective's own 2 * seq. */
static dlua_pg_result_t gl_allgather_host(void *c, int64_t seq, const void *in, void *out, size_t bytes,
                                          int64_t timeout, char *err, size_t errlen) {
  gloo_ctx_t *x = c;
  size_t *counts = calloc((size_t)x->size, sizeof(size_t));
  if (!counts) {
    snprintf(err, errlen, "out of memory");
    return DLUA_PG_FAILED;
  }
  for (int r = 0; r < x->size; r++) counts[r] = bytes;
  dlua_pg_result_t gr =
      dlua_gloo_allgatherv(x->gloo, in, out, counts, 1, (uint32_t)(seq * 2 + 1), timeout, err, errlen);
  free(counts);
  return gr;
}

static const char *gl_transport(void *c, const char **why) {
  gloo_ctx_t *x = c;
  if (why) *why = x->transport_why;
  return x->shm ? "shm" : "tcp";
}

static dlua_status_t gl_shared_zeros(void *c, dlua_dtype_t dtype, int64_t numel, int64_t timeout, dlua_tensor_t **out,
                                     const char **why) {
  gloo_ctx_t *x = c;
  if (!x->shm) {
    if (why) *why = x->transport_why;
    return DLUA_OK;
  }
  pthread_mutex_lock(&x->mu);
  int64_t id = ++x->regions;
  pthread_mutex_unlock(&x->mu);
  dlua_store_t *st = NULL;
  DLUA_TRY(dlua_store_connect(x->store_host, x->store_port, x->token, timeout, &st));
  void *p = NULL, *handle = NULL;
  size_t bytes = (size_t)numel * dlua_dtype_size(dtype);
  dlua_status_t s = dlua_shm_region_new(x->shm, st, x->name, id, bytes, timeout, &p, &handle, x->region_why,
                                        sizeof x->region_why);
  dlua_store_close(st);
  if (why) *why = x->region_why;
  if (s != DLUA_OK || !p) return s;
  int64_t n = numel;
  s = dlua_tensor_wrap(out, 1, &n, NULL, dtype, p, dlua_shm_region_free, handle);
  if (s != DLUA_OK) dlua_shm_region_free(handle, p);
  return s;
}

static int is_loopback(const char *host) {
  return !host || !*host || !strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1");
}

/* The address of this machine that routes to the store host: a UDP "connect" sends nothing but
   makes the kernel pick the interface, which getsockname reports. */
static void local_address_towards(const char *host, int port, char *out, size_t n) {
  snprintf(out, n, "127.0.0.1");
  if (is_loopback(host)) return;
  struct addrinfo hints = {.ai_socktype = SOCK_DGRAM}, *res = NULL;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port > 0 ? port : 1);
  if (getaddrinfo(host, ps, &hints, &res) != 0 || !res) {
    gethostname(out, n);
    return;
  }
  int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 && getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
    if (ss.ss_family == AF_INET)
      inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, out, (socklen_t)n);
    else if (ss.ss_family == AF_INET6)
      inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, out, (socklen_t)n);
  } else {
    gethostname(out, n);
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
}

/* The TCP mesh over the store, then shared memory if every rank is on this host. */
static dlua_pg_result_t gl_join(void *c, const dlua_pg_info_t *g, dlua_status_t *store_status, char *err,
                                size_t errlen) {
  gloo_ctx_t *x = c;
  snprintf(x->name, sizeof x->name, "%s", g->name);
  snprintf(x->store_host, sizeof x->store_host, "%s", g->store_host);
  snprintf(x->token, sizeof x->token, "%s", g->token);
  x->store_port = g->store_port;
  x->rank = g->rank;
  x->size = g->size;
  char bind_host[128];
  local_address_towards(g->store_host, g->store_port, bind_host, sizeof bind_host);
  dlua_pg_result_t r = dlua_gloo_connect(g->store, g->name, bind_host, x->iface, g->rank, g->size, g->timeout_ms,
                                         &x->gloo, store_status, err, errlen);
  if (r != DLUA_PG_OK) return r;
  return dlua_shm_join(g->store, g->name, g->rank, g->size, g->timeout_ms, &x->shm, x->transport_why,
                       sizeof x->transport_why, store_status, err, errlen);
}

static void gl_close(void *c, int broken) {
  gloo_ctx_t *x = c;
  if (!x) return;
  for (int d = 0; d < PG_MAX_CUDA; d++) dlua_cuda_stream_destroy(x->stage_streams[d]);
  dlua_shm_close(x->shm);
  dlua_gloo_destroy(x->gloo);
  pthread_mutex_destroy(&x->mu);
  free(x);
}

static const dlua_pg_backend_t gloo_backend = {
    .name = "gloo",
    .join = gl_join,
    .check_tensor = gl_check_tensor,
    .prepare = gl_prepare,
    .run = gl_run,
    .post = gl_post,
    .wait_posted = gl_wait_posted,
    .allgather_host = gl_allgather_host,
    .transport = gl_transport,
    .shared_zeros = gl_shared_zeros,
    .close = gl_close,
};

dlua_status_t dlua_pg_gloo_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx) {
  gloo_ctx_t *x = calloc(1, sizeof *x);
  if (!x) return DLUA_ERR(DLUA_ERR_OOM, "process group %s: out of memory", args->name ? args->name : "?");
  pthread_mutex_init(&x->mu, NULL);
  const char *ifname = getenv("GLOO_SOCKET_IFNAME");
  if (ifname) snprintf(x->iface, sizeof x->iface, "%s", ifname);
  *be = &gloo_backend;
  *ctx = x;
  return DLUA_OK;
}

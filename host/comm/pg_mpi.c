/* The MPI backend of process groups: one communicator per group, staging, the collectives, send/recv and the backend's table (each MPI call runs within the group's timeout through pg_mpi_exec.c). */
#define _GNU_SOURCE
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/pg_mpi.h"
#include "comm/pg_mpi_exec.h"
#include "comm/pg_reduce.h"
#include "comm/store.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

static size_t tbytes(const dlua_tensor_t *t) { return (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype); }

static int j_allreduce(mpi_ctx_t *x, mpi_job_t *j) {
  return MPI_Allreduce(MPI_IN_PLACE, j->rbuf, j->count, j->dt, j->op, x->comm);
}
static int j_bcast(mpi_ctx_t *x, mpi_job_t *j) { return MPI_Bcast(j->rbuf, j->count, j->dt, j->root, x->comm); }
static int j_allgatherv(mpi_ctx_t *x, mpi_job_t *j) {
  return MPI_Allgatherv(j->sbuf, j->count, j->dt, j->rbuf, x->c[0], x->c[1], j->dt, x->comm);
}
static int j_allgather_bytes(mpi_ctx_t *x, mpi_job_t *j) {
  return MPI_Allgather(j->sbuf, j->count, MPI_BYTE, j->rbuf, j->count, MPI_BYTE, x->comm);
}
static int j_reduce_scatter_block(mpi_ctx_t *x, mpi_job_t *j) {
  return MPI_Reduce_scatter_block(j->sbuf, j->rbuf, j->count, j->dt, j->op, x->comm);
}
static int j_reduce_scatter(mpi_ctx_t *x, mpi_job_t *j) {  // x->c[0]: each part's count
  return MPI_Reduce_scatter(j->sbuf, j->rbuf, x->c[0], j->dt, j->op, x->comm);
}
static int j_alltoallv(mpi_ctx_t *x, mpi_job_t *j) {
  return MPI_Alltoallv(j->sbuf, x->c[0], x->c[1], j->dt, j->rbuf, x->c[2], x->c[3], j->dt, x->comm);
}
static int j_barrier(mpi_ctx_t *x, mpi_job_t *j) { return MPI_Barrier(x->comm); }

static int i_allreduce(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Iallreduce(MPI_IN_PLACE, j->rbuf, j->count, j->dt, j->op, x->comm, rq);
}
static int i_bcast(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Ibcast(j->rbuf, j->count, j->dt, j->root, x->comm, rq);
}
static int i_allgatherv(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Iallgatherv(j->sbuf, j->count, j->dt, j->rbuf, x->c[0], x->c[1], j->dt, x->comm, rq);
}
static int i_allgather_bytes(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Iallgather(j->sbuf, j->count, MPI_BYTE, j->rbuf, j->count, MPI_BYTE, x->comm, rq);
}
static int i_reduce_scatter_block(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Ireduce_scatter_block(j->sbuf, j->rbuf, j->count, j->dt, j->op, x->comm, rq);
}
static int i_reduce_scatter(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) {
  return MPI_Ireduce_scatter(j->sbuf, j->rbuf, x->c[0], j->dt, j->op, x->comm, rq);
}
static int i_barrier(mpi_ctx_t *x, mpi_job_t *j, MPI_Request *rq) { return MPI_Ibarrier(x->comm, rq); }

/* The group's communicator: the members (x->wranks, in group-rank order) out of MPI_COMM_WORLD, made by
   the members alone (the others never call: dist.new_group creates nothing on them). */
static int j_create(mpi_ctx_t *x, mpi_job_t *j) {
  MPI_Group world, g;
  int rc = MPI_Comm_group(MPI_COMM_WORLD, &world);
  if (rc == MPI_SUCCESS) rc = MPI_Group_incl(world, x->size, x->wranks, &g);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_create_group(MPI_COMM_WORLD, g, j->root, &x->comm);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(x->comm, MPI_ERRORS_RETURN);
  MPI_Comm local = MPI_COMM_NULL;
  if (rc == MPI_SUCCESS) rc = MPI_Comm_split_type(x->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(local, &x->local);
  if (local != MPI_COMM_NULL) MPI_Comm_free(&local);
  MPI_Group_free(&world);
  if (rc == MPI_SUCCESS) MPI_Group_free(&g);
  return rc;
}

/* ---- staging: memory MPI can read and write --------------------------------------------------------
   A CUDA tensor (contiguous: checked when queued) is copied on a stream of the group that first waits for
   the caller's stream, unless the library takes device pointers. */

static dlua_cuda_stream_t *stage_stream(mpi_ctx_t *x, int dev) {
  if (dev < 0 || dev >= PG_MAX_CUDA) {
    DLUA_ERR(DLUA_ERR_ARG, "process group %s: cuda:%d is beyond the %d devices mpi stages for", x->name, dev,
             PG_MAX_CUDA);
    return NULL;
  }
  pthread_mutex_lock(&x->stage_mu);
  dlua_cuda_stream_t *s = x->stage_streams[dev];
  pthread_mutex_unlock(&x->stage_mu);
  if (s) return s;
  if (dlua_cuda_stream_create(&s, dev) != DLUA_OK) return NULL;
  pthread_mutex_lock(&x->stage_mu);
  if (x->stage_streams[dev]) {  // the other thread won: keep one
    dlua_cuda_stream_t *won = x->stage_streams[dev];
    pthread_mutex_unlock(&x->stage_mu);
    dlua_cuda_stream_destroy(s);
    return won;
  }
  x->stage_streams[dev] = s;
  pthread_mutex_unlock(&x->stage_mu);
  return s;
}

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

/* MPI reads and writes this tensor's own memory: CPU and contiguous, or contiguous CUDA memory when the
   library takes device pointers and nothing is reduced (dlua's reduce functions, which MPI may call, read
   host memory). */
static int direct(const mpi_ctx_t *x, const dlua_tensor_t *t, int reduces) {
  return dlua_tensor_is_contiguous(t) && (t->device == DLUA_CPU || (x->cuda_aware && !reduces));
}

/* The n tensors' bytes back to back in rank order, if they already lie so (views of one flat buffer). */
static char *packed_base(const mpi_ctx_t *x, dlua_tensor_t *const *ts, int n, int reduces) {
  char *base = NULL;
  size_t off = 0;
  for (int r = 0; r < n; r++) {
    size_t b = tbytes(ts[r]);
    if (b == 0) continue;
    if (!direct(x, ts[r], reduces)) return NULL;
    char *p = dlua_tensor_ptr(ts[r]);
    if (!base) base = p - off;
    if (p != base + off) return NULL;
    off += b;
  }
  return base;
}

static int overlaps(const char *a, size_t na, const char *b, size_t nb) { return na && nb && a < b + nb && b < a + na; }

/* A stuck job may still write into the work's tensors after the group lets go of them: hold them forever. */
static void keep_tensors(mpi_ctx_t *x, const dlua_work_t *w) {
  int n = (w->t ? 1 : 0) + (w->outs ? w->nlist : 0) + (w->ins ? w->nlist : 0);
  dlua_tensor_t **k = realloc(x->kept, (size_t)(x->nkept + n) * sizeof *k);
  if (!k) return;
  x->kept = k;
  if (w->t) k[x->nkept++] = dlua_tensor_alias(w->t);
  for (int i = 0; w->outs && i < w->nlist; i++) k[x->nkept++] = dlua_tensor_alias(w->outs[i]);
  for (int i = 0; w->ins && i < w->nlist; i++) k[x->nkept++] = dlua_tensor_alias(w->ins[i]);
}

/* Staging memory of one run: freed at the end, unless a job that may still use it is stuck. */
typedef struct {
  void *p[3];
} stages_t;

static void *stage(stages_t *st, const dlua_work_t *w, size_t bytes) {
  for (int i = 0; i < 3; i++)
    if (!st->p[i]) return st->p[i] = dlua_pg_stage_alloc(w, bytes ? bytes : 1);
  return NULL;
}

static void stages_free(mpi_ctx_t *x, stages_t *st, const dlua_work_t *w) {
  if (x->stuck) return;
  for (int i = 0; i < 3; i++) dlua_pg_stage_free(w, st->p[i]);
}

/* ---- collectives ------------------------------------------------------------------------------------ */

#define OOM(w, bytes)                                                                                            \
  (dlua_pg_work_set(w, DLUA_ERR_OOM, "%s #%" PRId64 ": out of memory staging %zu bytes", dlua_pg_kind_name(w->kind), \
                    w->seq, (size_t)(bytes)),                                                                    \
   DLUA_PG_OK)

static int count_ok(dlua_work_t *w, size_t n) {
  if (n <= INT_MAX) return 1;
  dlua_pg_work_set(w, DLUA_ERR_ARG, "%s #%" PRId64 ": %zu elements to one rank; MPI counts are ints (at most %d)",
                   dlua_pg_kind_name(w->kind), w->seq, n, INT_MAX);
  return 0;
}

/* all_reduce / broadcast of one tensor, in place where MPI can use its memory, else through a stage;
   CHUNK elements per call. */
static dlua_pg_result_t one(mpi_ctx_t *x, dlua_work_t *w, dlua_tensor_t *t, int kind, dlua_cuda_stream_t *cs,
                            int64_t deadline, char *err, size_t errlen) {
  size_t n = (size_t)dlua_tensor_numel(t), es = dlua_dtype_size(t->dtype);
  if (n == 0) return DLUA_PG_OK;
  char *buf = dlua_tensor_ptr(t);
  stages_t st = {{0}};
  if (!direct(x, t, kind == K_ALL_REDUCE)) {
    if (!(buf = stage(&st, w, n * es))) return OOM(w, n * es);
    if ((kind == K_ALL_REDUCE || x->rank == w->peer) && copy_to_flat(t, buf, cs) != DLUA_OK) {
      dlua_pg_work_from_last_error(w, "staging");
      stages_free(x, &st, w);
      return DLUA_PG_OK;
    }
  }
  dlua_pg_result_t r = DLUA_PG_OK;
  for (size_t off = 0; off < n && r == DLUA_PG_OK; off += CHUNK) {
    size_t c = n - off < CHUNK ? n - off : CHUNK;
    x->job = (mpi_job_t){.fn = kind == K_ALL_REDUCE ? j_allreduce : j_bcast,
                         .ifn = kind == K_ALL_REDUCE ? i_allreduce : i_bcast, .rbuf = buf + off * es, .count = (int)c,
                         .root = w->peer, .dt = dlua_mpi_datatype(t->dtype), .op = dlua_mpi_op(w->op, t->dtype),
                         .bytes = c * es};
    r = dlua_mpi_exec(x, deadline, dlua_pg_kind_name(kind), err, errlen);
  }
  if (r == DLUA_PG_OK && kind == K_ALL_REDUCE && w->op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(buf, n, t->dtype, x->size);
  int writes = kind == K_ALL_REDUCE || x->rank != w->peer;
  if (r == DLUA_PG_OK && w->status == DLUA_OK && buf != dlua_tensor_ptr(t) && writes && copy_from_flat(t, buf, cs) != DLUA_OK)
    dlua_pg_work_from_last_error(w, "writing back the staged result");
  stages_free(x, &st, w);
  return r;
}

static dlua_pg_result_t all_gather(mpi_ctx_t *x, dlua_work_t *w, dlua_cuda_stream_t *cs, int64_t deadline,
                                   char *err, size_t errlen) {
  size_t es = dlua_dtype_size(w->t->dtype), total = 0;
  for (int r = 0; r < x->size; r++) {
    size_t c = (size_t)dlua_tensor_numel(w->outs[r]);
    if (!count_ok(w, c) || !count_ok(w, total)) return DLUA_PG_OK;
    x->c[0][r] = (int)c;
    x->c[1][r] = (int)total;
    total += c;
  }
  if (total == 0) return DLUA_PG_OK;  // every rank sees the same sizes
  stages_t st = {{0}};
  char *out = packed_base(x, w->outs, x->size, 0);
  int staged_out = !out;
  size_t mine = (size_t)x->c[0][x->rank];
  const char *in = direct(x, w->t, 0) ? dlua_tensor_ptr(w->t) : NULL;
  if (!out && !(out = stage(&st, w, total * es))) return OOM(w, total * es);
  if (!in) {
    char *s = stage(&st, w, mine * es);
    if (!s) {
      stages_free(x, &st, w);
      return OOM(w, mine * es);
    }
    if (copy_to_flat(w->t, s, cs) != DLUA_OK) {
      dlua_pg_work_from_last_error(w, "staging");
      stages_free(x, &st, w);
      return DLUA_PG_OK;
    }
    in = s;
  }
  char *slot = out + (size_t)x->c[1][x->rank] * es;
  if (in == slot) in = MPI_IN_PLACE;  // the input is this rank's output already
  else if (overlaps(in, mine * es, out, total * es)) {
    char *s = stage(&st, w, mine * es);
    if (!s) {
      stages_free(x, &st, w);
      return OOM(w, mine * es);
    }
    memcpy(s, in, mine * es);
    in = s;
  }
  x->job = (mpi_job_t){.fn = j_allgatherv, .ifn = i_allgatherv, .sbuf = in, .rbuf = out, .count = (int)mine,
                       .bytes = total * es,
                       .dt = dlua_mpi_datatype(w->t->dtype)};
  dlua_pg_result_t r = dlua_mpi_exec(x, deadline, "all_gather", err, errlen);
  if (r == DLUA_PG_OK && staged_out)
    for (int q = 0; q < x->size && w->status == DLUA_OK; q++)
      if (copy_from_flat(w->outs[q], out + (size_t)x->c[1][q] * es, cs) != DLUA_OK)
        dlua_pg_work_from_last_error(w, "writing back the staged result");
  stages_free(x, &st, w);
  return r;
}

/* Rank r's out = op over ranks of their ins[r]. The parts may differ in size (the same sizes on every rank:
   ZeRO's shards of a bucket); then MPI_Reduce_scatter with the parts' counts, else its _block form. */
static dlua_pg_result_t reduce_scatter(mpi_ctx_t *x, dlua_work_t *w, dlua_cuda_stream_t *cs, int64_t deadline,
                                       char *err, size_t errlen) {
  dlua_tensor_t *out = w->t;
  size_t m = (size_t)dlua_tensor_numel(out), es = dlua_dtype_size(out->dtype), all = 0;
  int equal = 1;
  for (int q = 0; q < x->size; q++) {
    size_t c = (size_t)dlua_tensor_numel(w->ins[q]);
    if (!count_ok(w, c)) return DLUA_PG_OK;
    x->c[0][q] = (int)c;
    x->c[1][q] = (int)(all < INT_MAX ? all : INT_MAX);
    equal &= c == m;
    all += c;
  }
  if (all == 0) return DLUA_PG_OK;  // every rank sees the same sizes; an empty part of its own still takes part
  if (all > INT_MAX) {              // Open MPI offsets the parts with ints
    dlua_pg_work_set(w, DLUA_ERR_ARG, "reduce_scatter #%" PRId64 ": %zu elements in all; MPI offsets are ints (at most %d)",
                     w->seq, all, INT_MAX);
    return DLUA_PG_OK;
  }
  stages_t st = {{0}};
  const char *in = packed_base(x, w->ins, x->size, 1);
  char *dst = m && direct(x, out, 1) ? dlua_tensor_ptr(out) : NULL;
  if (dst && in && overlaps(dst, m * es, in, all * es)) dst = NULL;  // MPI wants them apart
  if (!in) {
    char *s = stage(&st, w, all * es);
    if (!s) return OOM(w, all * es);
    for (int q = 0; q < x->size; q++)
      if (copy_to_flat(w->ins[q], s + (size_t)x->c[1][q] * es, cs) != DLUA_OK) {
        dlua_pg_work_from_last_error(w, "staging");
        stages_free(x, &st, w);
        return DLUA_PG_OK;
      }
    in = s;
  }
  if (!dst && !(dst = stage(&st, w, m * es))) {
    stages_free(x, &st, w);
    return OOM(w, m * es);
  }
  x->job = (mpi_job_t){.fn = equal ? j_reduce_scatter_block : j_reduce_scatter,
                       .ifn = equal ? i_reduce_scatter_block : i_reduce_scatter, .sbuf = in, .rbuf = dst,
                       .count = (int)m, .bytes = all * es, .dt = dlua_mpi_datatype(out->dtype),
                       .op = dlua_mpi_op(w->op, out->dtype)};
  dlua_pg_result_t r = dlua_mpi_exec(x, deadline, "reduce_scatter", err, errlen);
  if (r == DLUA_PG_OK) {
    if (w->op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(dst, m, out->dtype, x->size);
    if (dst != dlua_tensor_ptr(out) && copy_from_flat(out, dst, cs) != DLUA_OK)
      dlua_pg_work_from_last_error(w, "writing the result");
  }
  stages_free(x, &st, w);
  return r;
}

static dlua_pg_result_t all_to_all(mpi_ctx_t *x, dlua_work_t *w, dlua_cuda_stream_t *cs, int64_t deadline,
                                   char *err, size_t errlen) {
  size_t es = dlua_dtype_size(w->ins[0]->dtype), tin = 0, tout = 0;
  for (int r = 0; r < x->size; r++) {
    size_t ic = (size_t)dlua_tensor_numel(w->ins[r]), oc = (size_t)dlua_tensor_numel(w->outs[r]);
    if (!count_ok(w, ic) || !count_ok(w, oc) || !count_ok(w, tin) || !count_ok(w, tout)) return DLUA_PG_OK;
    x->c[0][r] = (int)ic;
    x->c[1][r] = (int)tin;
    x->c[2][r] = (int)oc;
    x->c[3][r] = (int)tout;
    tin += ic;
    tout += oc;
  }
  static char dummy[16];  // a valid address for empty buffers
  stages_t st = {{0}};
  char *in = tin ? packed_base(x, w->ins, x->size, 0) : dummy;
  char *out = tout ? packed_base(x, w->outs, x->size, 0) : dummy + 8;
  if (in && out && overlaps(in, tin * es, out, tout * es)) out = NULL;
  if (!in) {
    if (!(in = stage(&st, w, tin * es))) return OOM(w, tin * es);
    for (int r = 0; r < x->size; r++)
      if (copy_to_flat(w->ins[r], in + (size_t)x->c[1][r] * es, cs) != DLUA_OK) {
        dlua_pg_work_from_last_error(w, "staging");
        stages_free(x, &st, w);
        return DLUA_PG_OK;
      }
  }
  int staged_out = !out;
  if (!out && !(out = stage(&st, w, tout * es))) {
    stages_free(x, &st, w);
    return OOM(w, tout * es);
  }
  // Always blocking: every rank must take the same way (MPI never matches a blocking collective with a
  // non-blocking one), and each rank knows only its own byte counts here.
  x->job = (mpi_job_t){.fn = j_alltoallv, .sbuf = in, .rbuf = out, .dt = dlua_mpi_datatype(w->ins[0]->dtype)};
  dlua_pg_result_t r = dlua_mpi_exec(x, deadline, "all_to_all", err, errlen);
  if (r == DLUA_PG_OK && staged_out)
    for (int q = 0; q < x->size && w->status == DLUA_OK; q++)
      if (copy_from_flat(w->outs[q], out + (size_t)x->c[3][q] * es, cs) != DLUA_OK)
        dlua_pg_work_from_last_error(w, "writing back the staged result");
  stages_free(x, &st, w);
  return r;
}

/* ---- the backend's table ------------------------------------------------------------------------------ */

static dlua_pg_result_t mp_run(void *c, dlua_work_t *w, int64_t timeout, char *err, size_t errlen) {
  mpi_ctx_t *x = c;
  int64_t deadline = dlua_mpi_now_ms() + timeout;
  dlua_cuda_stream_t *cs = NULL;  // staged CUDA tensors: copies wait for the caller's stream, then run on this one
  if (w->cuda_dev >= 0) {
    int ok = 1;
    if (x->cuda_aware)  // MPI reads device memory itself: what the caller queued must be done
      ok = !w->ready || dlua_cuda_event_synchronize(w->ready) == DLUA_OK;
    if (ok && !(cs = stage_stream(x, w->cuda_dev))) ok = 0;
    if (ok && !x->cuda_aware && w->ready && dlua_cuda_stream_wait_event(cs, w->ready) != DLUA_OK) ok = 0;
    if (!ok) {
      dlua_pg_work_from_last_error(w, "staging CUDA tensors");
      return DLUA_PG_OK;
    }
  }
  dlua_pg_result_t r = DLUA_PG_OK;
  x->cur = w;
  switch (w->kind) {
    case K_ALL_REDUCE:
    case K_BROADCAST: r = one(x, w, w->t, w->kind, cs, deadline, err, errlen); break;
    case K_ALL_REDUCE_MANY:  // one all-reduce after the other, under one sequence number
      for (int i = 0; i < w->nlist && r == DLUA_PG_OK && w->status == DLUA_OK; i++)
        r = one(x, w, w->ins[i], K_ALL_REDUCE, cs, deadline, err, errlen);
      break;
    case K_ALL_GATHER: r = all_gather(x, w, cs, deadline, err, errlen); break;
    case K_REDUCE_SCATTER: r = reduce_scatter(x, w, cs, deadline, err, errlen); break;
    case K_ALL_TO_ALL: r = all_to_all(x, w, cs, deadline, err, errlen); break;
    case K_BARRIER:
      x->job = (mpi_job_t){.fn = j_barrier, .ifn = i_barrier};
      r = dlua_mpi_exec(x, deadline, "barrier", err, errlen);
      break;
    default: return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "%s is not run by the comm thread", dlua_pg_kind_name(w->kind));
  }
  if (x->stuck) {
    pthread_mutex_lock(&x->stage_mu);
    keep_tensors(x, w);
    pthread_mutex_unlock(&x->stage_mu);
  }
  return r;
}

static dlua_status_t mp_check_tensor(void *c, const char *op, const char *what, const dlua_tensor_t *t) {
  if (t->device != DLUA_CPU && !dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: mpi takes cuda:%d tensors contiguous, and %s is not (CUDA strided copies are not built yet: "
                    "pass t:contiguous())",
                    op, t->device, what);
  return DLUA_OK;
}

/* An event on the caller's current stream, which the staging copies (or, with a CUDA-aware library, the MPI
   call itself) wait for: the collective sees every kernel queued before the call. */
static dlua_status_t mp_prepare(void *c, dlua_work_t *w) {
  if (w->cuda_dev < 0) return DLUA_OK;
  w->pinned = 1;  // reductions are staged even when the library takes device pointers
  if (w->kind == K_SEND || w->kind == K_RECV) return DLUA_OK;  // staged on the caller's thread
  DLUA_TRY(dlua_cuda_event_create(&w->ready, w->cuda_dev, 0));
  return dlua_cuda_event_record(w->ready, NULL);
}

/* ---- send / recv: posted at once (MPI_Isend/MPI_Irecv on the caller's thread), waited on the p2p thread */

typedef struct {
  MPI_Request rq;
} mpi_xfer_t;

static dlua_status_t mp_post(void *c, dlua_work_t *w, dlua_pg_result_t *result, char *err, size_t errlen) {
  mpi_ctx_t *x = c;
  const char *op = dlua_pg_kind_name(w->kind);
  const dlua_tensor_t *t = w->t;
  *result = DLUA_PG_OK;
  int ub = dlua_mpi_process()->tag_ub;
  if (w->tag > ub) return DLUA_ERR(DLUA_ERR_ARG, "%s: tag %d is above this MPI's largest tag (%d)", op, w->tag, ub);
  size_t n = (size_t)dlua_tensor_numel(t), bytes = tbytes(t);
  if (n > INT_MAX) return DLUA_ERR(DLUA_ERR_ARG, "%s: %zu elements; MPI counts are ints (at most %d)", op, n, INT_MAX);
  if (!bytes) return DLUA_OK;  // nothing to move: w->xfer stays NULL, the work is done
  void *ptr = dlua_tensor_ptr(t);
  if (!direct(x, t, 0)) {
    if (!(w->stage = dlua_pg_stage_alloc(w, bytes)))
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory staging %zu bytes", op, bytes);
    // A CUDA tensor is read here, after the caller's stream has produced it.
    dlua_cuda_stream_t *cs = t->device != DLUA_CPU ? dlua_cuda_current_stream(t->device) : NULL;
    if (w->kind == K_SEND && copy_to_flat(t, w->stage, cs) != DLUA_OK) return dlua_last_status();
    ptr = w->stage;
  } else if (t->device != DLUA_CPU) {
    DLUA_TRY(dlua_cuda_stream_synchronize(dlua_cuda_current_stream(t->device)));
  }
  mpi_xfer_t *xf = calloc(1, sizeof *xf);
  if (!xf) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", op);
  int rc = w->kind == K_SEND ? MPI_Isend(ptr, (int)n, dlua_mpi_datatype(t->dtype), w->peer, w->tag, x->comm, &xf->rq)
                             : MPI_Irecv(ptr, (int)n, dlua_mpi_datatype(t->dtype), w->peer, w->tag, x->comm, &xf->rq);
  if (rc != MPI_SUCCESS) {
    free(xf);
    char e[MPI_MAX_ERROR_STRING + 40];
    dlua_mpi_error_text(rc, e, sizeof e);
    dlua_mpi_note_failure(0);
    *result = dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "%s: %s", w->kind == K_SEND ? "MPI_Isend" : "MPI_Irecv", e);
    return DLUA_OK;
  }
  w->xfer = xf;
  return DLUA_OK;
}

static dlua_pg_result_t mp_wait_posted(void *c, dlua_work_t *w, int64_t timeout, char *err, size_t errlen) {
  mpi_ctx_t *x = c;
  mpi_xfer_t *xf = w->xfer;
  const char *what = w->kind == K_SEND ? "send" : "recv";
  int64_t start = dlua_mpi_now_ms(), deadline = start + timeout, next_check = start + PEER_CHECK_MS;
  int done = 0, rc = MPI_SUCCESS, io_errors = 0;
  dlua_pg_result_t r = DLUA_PG_OK;
  // MPI progresses a transfer only while some thread is inside MPI: test often, then back off.
  for (long spins = 0;; spins++) {
    rc = MPI_Test(&xf->rq, &done, MPI_STATUS_IGNORE);
    if (done || rc != MPI_SUCCESS) break;
    int64_t t = dlua_mpi_now_ms();
    char who[400] = "";
    if (t >= deadline) {
      r = dlua_mpi_fail(err, errlen, DLUA_PG_TIMEOUT, "%s: not complete after %" PRId64 " ms", what, t - start);
      break;
    }
    if (t >= next_check) {
      if (dlua_mpi_peer_exited(x, w->peer, &io_errors, who, sizeof who)) {
        r = dlua_mpi_fail(err, errlen, DLUA_PG_PEER_LOST, "%s: %s", what, who);
        break;
      }
      next_check = t + PEER_CHECK_MS;
    }
    if (spins < 200) {
      for (int i = 0; i < 256; i++) __builtin_ia32_pause();
    } else {
      struct timespec ts = {0, spins < 2000 ? 50000L : 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  if (rc != MPI_SUCCESS) {
    char e[MPI_MAX_ERROR_STRING + 40];
    dlua_mpi_error_text(rc, e, sizeof e);
    r = dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "%s: %s", what, e);
  }
  if (r == DLUA_PG_OK && w->kind == K_RECV && w->stage) {
    dlua_cuda_stream_t *cs = w->cuda_dev >= 0 ? stage_stream(x, w->cuda_dev) : NULL;
    if ((w->cuda_dev >= 0 && !cs) || copy_from_flat(w->t, w->stage, cs) != DLUA_OK)
      dlua_pg_work_from_last_error(w, "writing back the staged result");
  }
  if (r != DLUA_PG_OK) dlua_mpi_note_failure(r == DLUA_PG_PEER_LOST);
  if (!done) {  // MPI may still read or write the buffer: it stays, and so does the request
    pthread_mutex_lock(&x->stage_mu);
    keep_tensors(x, w);
    x->leak = 1;
    pthread_mutex_unlock(&x->stage_mu);
    w->stage = NULL;
  } else {
    free(xf);
    dlua_pg_stage_free(w, w->stage);
    w->stage = NULL;
  }
  w->xfer = NULL;
  return r;
}

static dlua_pg_result_t mp_allgather_host(void *c, int64_t seq, const void *in, void *out, size_t bytes,
                                          int64_t timeout, char *err, size_t errlen) {
  mpi_ctx_t *x = c;
  if (bytes > INT_MAX) return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "debug check: %zu bytes", bytes);
  x->job = (mpi_job_t){.fn = j_allgather_bytes, .ifn = i_allgather_bytes, .sbuf = in, .rbuf = out, .count = (int)bytes};
  return dlua_mpi_exec(x, dlua_mpi_now_ms() + timeout, "debug check", err, errlen);
}

static const char *mp_transport(void *c, const char **why) {
  mpi_ctx_t *x = c;
  if (why) *why = x->why;
  return "mpi";
}

/* Every member publishes its rank in MPI_COMM_WORLD; once all are there (within the timeout, which names the
   missing ones), the members make the group's communicator on the executor. */
static dlua_pg_result_t mp_join(void *c, const dlua_pg_info_t *g, dlua_status_t *store_status, char *err,
                                size_t errlen) {
  mpi_ctx_t *x = c;
  int64_t deadline = dlua_mpi_now_ms() + g->timeout_ms;
  snprintf(x->name, sizeof x->name, "%s", g->name);
  x->rank = g->rank;
  x->size = g->size;
  x->store = g->store;
  snprintf(x->store_host, sizeof x->store_host, "%s", g->store_host ? g->store_host : "");
  x->store_port = g->store_port;
  x->wranks = calloc((size_t)g->size, sizeof(int));
  for (int i = 0; i < 4; i++) x->c[i] = calloc((size_t)g->size, sizeof(int));
  if (!x->wranks || !x->c[0] || !x->c[1] || !x->c[2] || !x->c[3])
    return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "out of memory");
  const dlua_mpi_process_t *p = dlua_mpi_process();
  char key[PG_NAME + 48], val[32];
  snprintf(key, sizeof key, "%s/mpi/rank/%d", g->name, g->rank);
  snprintf(val, sizeof val, "%d", p->rank);
  dlua_status_t st = dlua_store_set(g->store, key, val, strlen(val));
  char **keys = calloc((size_t)g->size, sizeof(char *));
  for (int q = 0; keys && st == DLUA_OK && q < g->size; q++) {
    if (!(keys[q] = malloc(PG_NAME + 48))) break;
    snprintf(keys[q], PG_NAME + 48, "%s/mpi/rank/%d", g->name, q);
  }
  int all_keys = keys != NULL;
  for (int q = 0; all_keys && q < g->size; q++) all_keys = keys[q] != NULL;
  if (st == DLUA_OK && !all_keys) {
    if (keys)
      for (int q = 0; q < g->size; q++) free(keys[q]);
    free(keys);
    return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "out of memory");
  }
  if (st == DLUA_OK) st = dlua_store_wait(g->store, (const char *const *)keys, g->size, g->timeout_ms);
  for (int q = 0; st == DLUA_OK && q < g->size; q++) {
    void *v = NULL;
    size_t n = 0;
    if ((st = dlua_store_get(g->store, keys[q], g->timeout_ms, &v, &n)) != DLUA_OK) break;
    x->wranks[q] = atoi(v);
    dlua_store_free_value(v);
  }
  if (keys)
    for (int q = 0; q < g->size; q++) free(keys[q]);
  free(keys);
  if (st != DLUA_OK) {
    *store_status = st;
    return dlua_mpi_fail(err, errlen, st == DLUA_ERR_TIMEOUT ? DLUA_PG_TIMEOUT : DLUA_PG_FAILED, "%s", dlua_last_error());
  }
  for (int q = 0; q < g->size; q++)
    for (int o = 0; o < q; o++)
      if (x->wranks[q] == x->wranks[o] || x->wranks[q] < 0 || x->wranks[q] >= p->size)
        return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED,
                    "ranks %d and %d of the group are both MPI rank %d of %d (were the ranks started by different "
                    "mpirun commands?)",
                    o, q, x->wranks[q], p->size);
  // A started thread inherits the comm thread's mask: every signal blocked.
  if (pthread_create(&x->th, NULL, dlua_mpi_executor_main, x) != 0)
    return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "cannot start the MPI executor thread");
  x->has_th = 1;
  uint32_t h = 2166136261u;  // the tag keeps apart groups that are created at once
  for (const char *s = g->name; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
  x->job = (mpi_job_t){.fn = j_create, .root = (int)(h % 32768)};
  dlua_pg_result_t r = dlua_mpi_exec(x, deadline, "MPI_Comm_create_group", err, errlen);
  if (r != DLUA_PG_OK) return r;
  int me = -1;
  MPI_Comm_rank(x->comm, &me);
  if (me != g->rank)
    return dlua_mpi_fail(err, errlen, DLUA_PG_FAILED, "MPI gave this member rank %d in the group, dlua expected %d", me, g->rank);
  x->cuda_aware = p->cuda_aware;
  const char *b = getenv("DLUA_MPI_BLOCKING_FROM");  // bytes; measured on 2 ranks of a loaded 2-core machine
  x->blocking_from = b && *b ? (size_t)strtoull(b, NULL, 10) : (size_t)4 << 20;
  snprintf(x->why, sizeof x->why, "%s; %s%s", p->version,
           x->local == g->size ? "every rank on this host (MPI's shared-memory transport)" : "ranks on several hosts",
           x->cuda_aware ? "; CUDA-aware: device memory passed directly" : "");
  return DLUA_PG_OK;
}

static void mp_close(void *c, int broken) {
  mpi_ctx_t *x = c;
  if (!x) return;
  if (broken) dlua_mpi_note_failure(0);
  if (x->stuck || x->leak) return;  // MPI may still touch it all for good: everything stays
  if (x->has_th) {
    pthread_mutex_lock(&x->mu);
    x->quit = 1;
    pthread_cond_signal(&x->cv_job);
    pthread_mutex_unlock(&x->mu);
    pthread_join(x->th, NULL);
  }
  if (x->comm != MPI_COMM_NULL) MPI_Comm_free(&x->comm);
  for (int d = 0; d < PG_MAX_CUDA; d++) dlua_cuda_stream_destroy(x->stage_streams[d]);
  for (int i = 0; i < x->nkept; i++) dlua_tensor_free(x->kept[i]);
  free(x->kept);
  free(x->wranks);
  for (int i = 0; i < 4; i++) free(x->c[i]);
  pthread_mutex_destroy(&x->mu);
  pthread_mutex_destroy(&x->stage_mu);
  pthread_cond_destroy(&x->cv_job);
  pthread_cond_destroy(&x->cv_done);
  free(x);
}

static const dlua_pg_backend_t mpi_backend = {
    .name = "mpi",
    .join = mp_join,
    .check_tensor = mp_check_tensor,
    .prepare = mp_prepare,
    .run = mp_run,
    .post = mp_post,
    .wait_posted = mp_wait_posted,
    .allgather_host = mp_allgather_host,
    .transport = mp_transport,
    .close = mp_close,
};

/* On the caller's thread, which initialises MPI if nobody did yet (dist.init has, on the main thread). */
dlua_status_t dlua_pg_mpi_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx) {
  const char *nm = args->name ? args->name : "?";
  if (dlua_mpi_init() != DLUA_OK) {
    char m[600];
    snprintf(m, sizeof m, "%s", dlua_last_error());
    return DLUA_ERR(DLUA_ERR_BACKEND, "process group %s: %s", nm, m);
  }
  mpi_ctx_t *x = calloc(1, sizeof *x);
  if (!x) return DLUA_ERR(DLUA_ERR_OOM, "process group %s: out of memory", nm);
  x->comm = MPI_COMM_NULL;
  pthread_mutex_init(&x->mu, NULL);
  pthread_mutex_init(&x->stage_mu, NULL);
  pthread_cond_init(&x->cv_job, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&x->cv_done, &ca);
  pthread_condattr_destroy(&ca);
  *be = &mpi_backend;
  *ctx = x;
  return DLUA_OK;
}

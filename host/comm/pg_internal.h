/* Process groups' internals shared by pg.c (the group, its comm thread, gloo) and a second backend (pg_nccl.c). */
#ifndef DLUA_COMM_PG_INTERNAL_H
#define DLUA_COMM_PG_INTERNAL_H
#include <stddef.h>
#include <stdint.h>
#include "comm/pg.h"

enum dlua_pg_kind {
  K_ALL_REDUCE, K_BROADCAST, K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_TO_ALL, K_BARRIER, K_SEND, K_RECV,
  K_ALL_REDUCE_MANY  /* one grouped all-reduce over a list of tensors (ins[0..nlist-1]) */
};

enum { PG_MSG = 2048, PG_SITE = 128, PG_NAME = 64 };

struct dlua_work {
  dlua_pg_t *pg;
  struct dlua_work *next;
  int kind;
  int64_t seq;             /* collective number (1-based); send/recv: collectives issued before it */
  dlua_reduce_t op;
  int peer;                /* broadcast root, send dst, recv src */
  int tag;
  char site[PG_SITE];
  char desc[160];          /* "(4) float32" for messages */
  dlua_tensor_t *t;        /* all_reduce/broadcast/send/recv tensor, all_gather input, reduce_scatter out */
  dlua_tensor_t **outs;    /* all_gather/all_to_all outputs (nlist of them) */
  dlua_tensor_t **ins;     /* reduce_scatter/all_to_all inputs, all_reduce_many's tensors (nlist of them) */
  int nlist;               /* entries of outs and ins: the group size, or all_reduce_many's count */
  int cuda_dev;            /* the CUDA device of the work's tensors, -1 when all are CPU tensors */
  dlua_cuda_event_t *ready;/* recorded on the caller's current stream when queued: inputs are ready */
  int pinned;              /* stage buffers are page-locked (gloo staging of CUDA tensors) */
  dlua_gloo_p2p_t *p2p;    /* send/recv: the posted transfer */
  void *stage;             /* send/recv: contiguous copy of a strided (or CUDA) tensor */
  int detached;            /* under pg->mu: the caller freed it; the comm thread frees it when done */
  int done;                /* atomic: set last, after status and msg */
  dlua_status_t status;
  char msg[PG_MSG];
};

/* A backend other than gloo: the group keeps its queue, sequence numbers, waits, timeouts' diagnostics
   and broken state; the backend meets the ranks and runs each work. Results reuse the gloo codes:
   OK, TIMEOUT (this rank's wait ran out), IO (a peer failed), OTHER (message in err). */
typedef struct dlua_pg_backend {
  const char *name;  /* "nccl" */
  /* On the comm thread, first: meet the other ranks through `store` under "<name>/...". A store
     failure's status goes to *store_status. */
  dlua_gloo_result_t (*join)(void *ctx, dlua_store_t *store, const char *name, int rank, int size,
                             int64_t timeout_ms, dlua_status_t *store_status, char *err, size_t errlen);
  /* On the caller's thread, before w is queued: checks its tensors (an error status with the message
     recorded) and captures what only that thread knows (its current stream). */
  dlua_status_t (*prepare)(void *ctx, dlua_work_t *w);
  /* On the comm thread: runs w to completion within timeout_ms. */
  dlua_gloo_result_t (*run)(void *ctx, dlua_work_t *w, int64_t timeout_ms, char *err, size_t errlen);
  /* Debug mode's fingerprints: `bytes` of host memory from every rank into out (size * bytes). */
  dlua_gloo_result_t (*allgather_host)(void *ctx, const void *in, void *out, size_t bytes, int64_t timeout_ms,
                                       char *err, size_t errlen);
  /* On the comm thread as the group closes (broken: abort rather than a clean finish); frees ctx. */
  void (*close)(void *ctx, int broken);
} dlua_pg_backend_t;

const char *dlua_pg_kind_name(int kind); /* "all_reduce"... for messages */

/* A group run by `be` (ctx is the backend's, freed by be->close even when the join fails). */
dlua_status_t dlua_pg_new_with_backend(const char *store_host, int store_port, const char *token, const char *name,
                                       int rank, int size, int64_t timeout_ms, const dlua_pg_backend_t *be, void *ctx,
                                       dlua_pg_t **out);

#endif

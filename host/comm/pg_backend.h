/* The process-group backend interface: the table that gloo (pg_gloo.c) and NCCL (pg_nccl.c) fill, and MPI will. */
#ifndef DLUA_COMM_PG_BACKEND_H
#define DLUA_COMM_PG_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {  /* the gloo wrapper (gloo.cc) returns dlua_pg_result_t */
#endif
#include "core/api.h"

/* The group (pg.c: the object and its calls; pg_worker.c: the comm thread and waits; pg_diag.c: debug
   mode and failure diagnostics) owns everything every backend shares: the queue and the comm thread,
   sequence numbers, work handles, timeouts, the debug check, the message that names the ranks that did
   not arrive, the launcher's own/peer verdict, and the broken state after a failure. A backend only meets
   the ranks and moves bytes; it never sees another backend's files. See docs/comm.md, "Backends". */

enum dlua_pg_kind {
  K_ALL_REDUCE, K_BROADCAST, K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_TO_ALL, K_BARRIER, K_SEND, K_RECV,
  K_ALL_REDUCE_MANY  /* one grouped all-reduce over a list of tensors (ins[0..nlist-1]) */
};

enum { PG_MSG = 2048, PG_SITE = 128, PG_NAME = 64 };

/* How a backend call ended (the group makes the status and the message of it; c10d's ErrorType). */
typedef enum {
  DLUA_PG_OK = 0,
  DLUA_PG_TIMEOUT = 1,   /* this rank's wait ran out: DLUA_ERR_TIMEOUT */
  DLUA_PG_PEER_LOST = 2, /* a peer closed its connection, exited or failed first: the launcher blames that peer */
  DLUA_PG_FAILED = 3,    /* anything else, its text in err: DLUA_ERR_BACKEND */
  DLUA_PG_MISMATCH = 4   /* the ranks' calls disagree (MPI_ERR_TRUNCATE), a diagnosis of its own: DLUA_ERR_BACKEND at
                            once, without the wait for the others' positions (a peer's MPI may crash on the same
                            mismatch, and its launcher then kills this rank before it has said anything) */
} dlua_pg_result_t;

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
  /* The backend's, set in prepare/post; the group frees ready and stage with the work. */
  dlua_cuda_event_t *ready;/* recorded on the caller's current stream when queued: inputs are ready */
  int pinned;              /* stage buffers are page-locked (host staging of CUDA tensors) */
  void *stage;             /* posted send/recv: contiguous copy of a strided (or CUDA) tensor */
  void *xfer;              /* posted send/recv: the backend's transfer in flight (NULL: none); wait_posted ends it */
  /* The group's. */
  int detached;            /* under pg->mu: the caller freed it; the comm thread frees it when done */
  int done;                /* atomic: set last, after status and msg */
  dlua_status_t status;    /* a backend sets it (dlua_pg_work_set) for a failure that leaves the group usable */
  char msg[PG_MSG];
};

/* What a backend learns of its group when it joins. */
typedef struct {
  dlua_store_t *store;     /* the group's connection (keys under "<name>/<backend>/..."); the group closes it */
  const char *store_host;  /* where it is, for connections of the backend's own */
  int store_port;
  const char *token;
  const char *name;        /* the group's name */
  int rank, size;
  int64_t timeout_ms;      /* the group's timeout when created */
} dlua_pg_info_t;

/* One backend: a table of functions over the backend's state `ctx` (one per group). The optional ones
   may be NULL. Threads: "caller" is the thread that issues a call, "comm" the group's comm thread
   (signals blocked: so are the threads a backend starts from it), "p2p" the thread that waits for
   posted send/recv. */
typedef struct dlua_pg_backend {
  const char *name;  /* "gloo", "nccl": dlua_pg_backend() and messages */
  /* comm, first: meets the other ranks within g->timeout_ms. A store call's failure status goes to
     *store_status (so Ctrl-C and store timeouts keep theirs). */
  dlua_pg_result_t (*join)(void *ctx, const dlua_pg_info_t *g, dlua_status_t *store_status, char *err, size_t errlen);
  /* caller, optional: refuses a tensor the backend cannot take at all, as the call checks its arguments
     (`op` is the call, `what` names the tensor in messages). */
  dlua_status_t (*check_tensor)(void *ctx, const char *op, const char *what, const dlua_tensor_t *t);
  /* caller, optional: as w is queued (w->cuda_dev is set): checks its tensors and captures what only
     this thread knows (its current stream, in w->ready). An error status with the message recorded. */
  dlua_status_t (*prepare)(void *ctx, dlua_work_t *w);
  /* comm: runs the collective w to completion within timeout_ms. A failure that every rank sees alike
     and that leaves the group usable (a mismatch, out of memory) is dlua_pg_work_set with DLUA_PG_OK;
     anything else returns a result other than DLUA_PG_OK, and the group diagnoses it and breaks. */
  dlua_pg_result_t (*run)(void *ctx, dlua_work_t *w, int64_t timeout_ms, char *err, size_t errlen);
  /* caller, optional (NULL: send/recv are queued behind the collectives and run by `run`): posts the
     send/recv w at once, leaving w->xfer non-NULL when a transfer is in flight. An error status (message
     recorded) for a local failure; a transport failure in *result, text in err. */
  dlua_status_t (*post)(void *ctx, dlua_work_t *w, dlua_pg_result_t *result, char *err, size_t errlen);
  /* p2p, with post: waits for w's transfer, finishes it (a received stage written back; a failure there
     is dlua_pg_work_set) and ends w->xfer and w->stage, whatever the result. */
  dlua_pg_result_t (*wait_posted)(void *ctx, dlua_work_t *w, int64_t timeout_ms, char *err, size_t errlen);
  /* comm: debug mode's fingerprints, `bytes` of host memory from every rank into out (size * bytes);
     seq is the collective they describe. */
  dlua_pg_result_t (*allgather_host)(void *ctx, int64_t seq, const void *in, void *out, size_t bytes,
                                     int64_t timeout_ms, char *err, size_t errlen);
  /* caller, optional (NULL: the backend's name, no reason): how collectives travel, and why. */
  const char *(*transport)(void *ctx, const char **why);
  /* caller, optional (NULL: never, "the group is not a gloo group"): dlua_pg_shared_zeros. */
  dlua_status_t (*shared_zeros)(void *ctx, dlua_dtype_t dtype, int64_t numel, int64_t timeout_ms, dlua_tensor_t **out,
                                const char **why);
  /* The thread that frees the group, after the comm and p2p threads ended (also when the join failed;
     broken: after a failure, abort rather than finish cleanly): frees ctx. */
  void (*close)(void *ctx, int broken);
} dlua_pg_backend_t;

/* What a backend's open function (pg_registry.c calls it) gets: it makes the state for one group. */
typedef struct {
  const char *name;        /* the group's, for messages */
  int device;              /* NCCL: the CUDA device the group works on (checked); gloo: unused */
  int64_t timeout_ms;
} dlua_pg_open_t;
typedef dlua_status_t (*dlua_pg_open_fn)(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx);

/* A group run by `be` over ctx (be->close frees ctx on every failure). pg_registry.c calls it. */
dlua_status_t dlua_pg_new_with_backend(const char *store_host, int store_port, const char *token, const char *name,
                                       int rank, int size, int64_t timeout_ms, const dlua_pg_backend_t *be, void *ctx,
                                       dlua_pg_t **out);

/* ---- for backends ------------------------------------------------------------------------------------- */

const char *dlua_pg_kind_name(int kind); /* "all_reduce"... for messages */
/* A failure of w that leaves the group usable: the caller's wait returns status with this message. */
void dlua_pg_work_set(dlua_work_t *w, dlua_status_t s, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* dlua_pg_work_set from the error a callee recorded: "<kind> #<seq>: <what>: <its message>". */
void dlua_pg_work_from_last_error(dlua_work_t *w, const char *what);
/* Staging memory for w's tensors: page-locked when w->pinned (CUDA copies), else malloc; NULL when out. */
void *dlua_pg_stage_alloc(const dlua_work_t *w, size_t bytes);
void dlua_pg_stage_free(const dlua_work_t *w, void *p);

#ifdef __cplusplus
}
#endif
#endif

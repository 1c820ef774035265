/* The process group object, shared by the group's files: pg.c (creation, the calls), pg_worker.c (works, threads, waits), pg_diag.c. */
#ifndef DLUA_COMM_PG_H
#define DLUA_COMM_PG_H
#include <pthread.h>
#include <stdint.h>

#include "comm/pg_backend.h"
#include "comm/store.h"

struct dlua_pg {
  char name[PG_NAME];
  int rank, size;
  int64_t timeout_ms;      /* atomic */
  int debug;               /* atomic */
  dlua_store_t *store;     /* ours: the join, then diagnostics, then the exit note */
  char store_host[256], token[DLUA_STORE_MAX_TOKEN + 1];  /* for the backend's own connections */
  int store_port;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv_queue; /* work queued, or closing (broadcast: two threads wait on it) */
  pthread_cond_t cv_done;  /* a work finished, or the join ended */
  dlua_work_t *head, *tail;          /* collectives, for the comm thread */
  dlua_work_t *p2p_head, *p2p_tail;  /* posted send/recv, for the p2p thread that waits on them */
  int has_p2p_thread;
  pthread_t p2p_thread;
  int closing;
  int64_t seq;             /* collectives issued (under mu) */
  int joined;              /* 0 joining, 1 joined, -1 failed (under mu) */
  dlua_status_t join_status;
  char join_msg[PG_MSG];
  int broken;              /* under mu: after the first failure every call fails at once */
  char broken_msg[640];
  const dlua_pg_backend_t *be;  /* runs the works: gloo, nccl */
  void *be_ctx;
};

#endif

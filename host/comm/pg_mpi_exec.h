/* The MPI backend's group state and its way of running one MPI call within a deadline (pg_mpi_exec.c), shared by pg_mpi.c. */
#ifndef DLUA_COMM_PG_MPI_EXEC_H
#define DLUA_COMM_PG_MPI_EXEC_H
#include <pthread.h>
#include <stdint.h>

#include "comm/pg_mpi.h"

enum {
  PG_MAX_CUDA = 16,          /* CUDA devices a group stages tensors of (a stream each) */
  PEER_CHECK_MS = 500,       /* how often a long wait looks in the store for peers that exited */
  SPIN_US = 50,              /* how long a thread spins for the other before it sleeps */
  CHUNK = 1 << 30            /* elements per MPI call: counts are ints */
};

struct mpi_ctx;
typedef struct mpi_job {
  int (*fn)(struct mpi_ctx *x, struct mpi_job *j);                    /* MPI's blocking call, on the executor */
  int (*ifn)(struct mpi_ctx *x, struct mpi_job *j, MPI_Request *rq);  /* its non-blocking form, polled here */
  const void *sbuf;
  void *rbuf;
  int count, root;
  MPI_Datatype dt;
  MPI_Op op;
  int64_t spin_us;         /* polled: how long to test without sleeping (exec sets it from bytes) */
  size_t bytes;            /* what this rank moves, for spin_us */
} mpi_job_t;

typedef struct mpi_ctx {
  char name[PG_NAME];
  int rank, size;
  MPI_Comm comm;           /* MPI_COMM_NULL until joined */
  dlua_store_t *store;     /* the group's connection (borrowed): peers' exit notes */
  char store_host[256];
  int store_port;
  int *wranks;             /* (size): the members' ranks in MPI_COMM_WORLD */
  int *c[4];               /* (size) each: counts and displacements for the v-collectives */
  int local;               /* members on this host */
  char why[400];           /* dist.transport()'s reason */
  int cuda_aware;
  size_t blocking_from;    /* collectives moving this many bytes or more run blocking on the executor */
  /* the executor */
  pthread_t th;
  int has_th;
  pthread_mutex_t mu;
  pthread_cond_t cv_job, cv_done;
  mpi_job_t job;           /* under mu */
  const dlua_work_t *cur;  /* the work whose MPI calls run now (the crash note names it) */
  int pending, quit;       /* under mu */
  int done, rc;            /* done: atomic; rc: the job's MPI return code */
  int stuck;               /* a job never ended: ctx, executor and buffers stay */
  int leak;                /* a send/recv never ended: ctx and its buffers stay */
  dlua_tensor_t **kept;    /* tensors a stuck job may still write (never freed) */
  int nkept;
  pthread_mutex_t stage_mu;/* the comm and p2p threads both stage */
  dlua_cuda_stream_t *stage_streams[PG_MAX_CUDA];
} mpi_ctx_t;

int64_t dlua_mpi_now_ms(void);
/* Formats err and returns r. */
dlua_pg_result_t dlua_mpi_fail(char *err, size_t n, dlua_pg_result_t r, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The group's executor thread (pthread_create's start routine; arg: the mpi_ctx_t). */
void *dlua_mpi_executor_main(void *arg);
/* Whether a member (only >= 0: that one) closed its group, or the store stopped answering twice in a row
   (*io_errors counts); who says which. */
int dlua_mpi_peer_exited(mpi_ctx_t *x, int only, int *io_errors, char *who, size_t n);
/* Runs x->job (filled by the caller) within the deadline (ms, CLOCK_MONOTONIC); what names it in errors. */
dlua_pg_result_t dlua_mpi_exec(mpi_ctx_t *x, int64_t deadline, const char *what, char *err, size_t errlen);

#endif

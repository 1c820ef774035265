/* This process' MPI: initialised once, finalised in an exit handler (or not, after a failure), types and ops, the store's address broadcast at dist.init. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/pg_mpi.h"
#include "comm/pg_reduce.h"
#include "core/error.h"
#include "core/runtime.h"

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  /* MPIX_Query_cuda_support */
#endif

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static int inited;             /* under init_mu: 1 ready, -1 failed (init_err says why) */
static char init_err[512];
static pthread_t init_thread;  /* MPI_Finalize belongs to the thread that initialised MPI */
static dlua_mpi_process_t proc;
static int failed, peer_lost;  /* atomic: set by the groups, read by the exit handler */

/* ---- dlua's element functions as MPI ops ---------------------------------------------------------
   MPI passes a user function no context, so each (op, dtype) pair gets a function of its own. MPI's
   user functions compute inout = in op inout; every op here is commutative. */

#define USER_OP(name, OP, DT)                                                   \
  static void name(void *in, void *inout, int *len, MPI_Datatype *type) {      \
    (void)type;                                                                 \
    dlua_pg_reduce_fn_for(OP, DT)(inout, inout, in, (size_t)*len);              \
  }
USER_OP(max_f32, DLUA_PG_REDUCE_MAX, DLUA_DTYPE_F32)
USER_OP(min_f32, DLUA_PG_REDUCE_MIN, DLUA_DTYPE_F32)
USER_OP(max_f64, DLUA_PG_REDUCE_MAX, DLUA_DTYPE_F64)
USER_OP(min_f64, DLUA_PG_REDUCE_MIN, DLUA_DTYPE_F64)
USER_OP(sum_f16, DLUA_PG_REDUCE_SUM, DLUA_DTYPE_F16)
USER_OP(max_f16, DLUA_PG_REDUCE_MAX, DLUA_DTYPE_F16)
USER_OP(min_f16, DLUA_PG_REDUCE_MIN, DLUA_DTYPE_F16)
USER_OP(prod_f16, DLUA_PG_REDUCE_PRODUCT, DLUA_DTYPE_F16)
USER_OP(sum_bf16, DLUA_PG_REDUCE_SUM, DLUA_DTYPE_BF16)
USER_OP(max_bf16, DLUA_PG_REDUCE_MAX, DLUA_DTYPE_BF16)
USER_OP(min_bf16, DLUA_PG_REDUCE_MIN, DLUA_DTYPE_BF16)
USER_OP(prod_bf16, DLUA_PG_REDUCE_PRODUCT, DLUA_DTYPE_BF16)
#undef USER_OP

enum { OP_MAX_F32, OP_MIN_F32, OP_MAX_F64, OP_MIN_F64, OP_SUM_F16, OP_MAX_F16, OP_MIN_F16, OP_PROD_F16,
       OP_SUM_BF16, OP_MAX_BF16, OP_MIN_BF16, OP_PROD_BF16, OP_USER_COUNT };
static MPI_User_function *const user_fns[OP_USER_COUNT] = {max_f32, min_f32, max_f64,  min_f64,  sum_f16,  max_f16,
                                                           min_f16, prod_f16, sum_bf16, max_bf16, min_bf16, prod_bf16};
static MPI_Op user_ops[OP_USER_COUNT];

MPI_Datatype dlua_mpi_datatype(dlua_dtype_t dt) {
  switch (dt) {
    case DLUA_DTYPE_F32: return MPI_FLOAT;
    case DLUA_DTYPE_F64: return MPI_DOUBLE;
    case DLUA_DTYPE_F16:
    case DLUA_DTYPE_BF16: return MPI_UINT16_T;
    case DLUA_DTYPE_I32: return MPI_INT32_T;
    case DLUA_DTYPE_I64: return MPI_INT64_T;
    default: return MPI_UINT8_T;  // u8, and bool (0/1 bytes)
  }
}

MPI_Op dlua_mpi_op(dlua_reduce_t op, dlua_dtype_t dt) {
  int sum = op == DLUA_PG_REDUCE_SUM || op == DLUA_PG_REDUCE_AVG;
  if (dt == DLUA_DTYPE_BOOL) return sum || op == DLUA_PG_REDUCE_MAX ? MPI_MAX : MPI_MIN;  // or, and
  int f16 = dt == DLUA_DTYPE_F16, bf16 = dt == DLUA_DTYPE_BF16;
  if (f16 || bf16) {
    int base = f16 ? OP_SUM_F16 : OP_SUM_BF16;
    return user_ops[base + (sum ? 0 : op == DLUA_PG_REDUCE_MAX ? 1 : op == DLUA_PG_REDUCE_MIN ? 2 : 3)];
  }
  if (sum) return MPI_SUM;
  if (op == DLUA_PG_REDUCE_PRODUCT) return MPI_PROD;
  // MPI's max/min of floats may drop a NaN; dlua's (torch.maximum's) keep it
  if (dt == DLUA_DTYPE_F32) return user_ops[op == DLUA_PG_REDUCE_MAX ? OP_MAX_F32 : OP_MIN_F32];
  if (dt == DLUA_DTYPE_F64) return user_ops[op == DLUA_PG_REDUCE_MAX ? OP_MAX_F64 : OP_MIN_F64];
  return op == DLUA_PG_REDUCE_MAX ? MPI_MAX : MPI_MIN;
}

void dlua_mpi_error_text(int code, char *buf, size_t n) {
  char s[MPI_MAX_ERROR_STRING] = "";
  int len = 0, cls = code;
  MPI_Error_class(code, &cls);
  if (MPI_Error_string(code, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", code);
  snprintf(buf, n, "%s (error class %d)", s, cls);
}

void dlua_mpi_note_failure(int lost) {
  __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
  if (lost) __atomic_store_n(&peer_lost, 1, __ATOMIC_RELAXED);
}

/* ---- the end of the process ----------------------------------------------------------------------
   MPI_Finalize waits for every rank (Open MPI fences there), so only a rank that ends well calls it. A rank
   that fails exits without it: mpirun then stops the job and names the first rank that exited non-zero
   (srun does with --kill-on-bad-exit). A rank that failed because a peer was lost waits a moment first, so
   that the peer it lost, whose own failure caused this one, is the one named. That is the launcher's
   own/peer verdict (docs/comm.md) told through exit order, the only thing mpirun reads. A rank whose own
   collective failed (a timeout) waits as long, so that its peers' diagnosis can still read the store. */

static void at_exit(int status, void *arg) {
  (void)arg;
  if (!pthread_equal(pthread_self(), init_thread)) return;  // exit() from another thread: not ours to finalize
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return;
  int bad = __atomic_load_n(&failed, __ATOMIC_RELAXED);
  if (status == 0 && !bad) {
    MPI_Finalize();
    return;
  }
  fflush(NULL);
  if (status != 0 && __atomic_load_n(&peer_lost, __ATOMIC_RELAXED)) {
    struct timespec ts = {2, 0};  // mpirun ends this process meanwhile, once the cause has exited
    nanosleep(&ts, NULL);
    return;
  }
  if (status != 0) {
    fprintf(stderr, "dlua: rank %d of %d (MPI) failed with exit status %d\n", proc.rank, proc.size, status);
    if (bad) {
      // A collective failed here (a timeout): the ranks that failed it too are reading where everybody is
      // from the store, which rank 0 serves. Their diagnosis takes up to 2 s; ending now would cut it short.
      fflush(stderr);
      struct timespec ts = {2, 0};
      nanosleep(&ts, NULL);
    }
    return;
  }
  // Exit status 0 after a collective failed (the error was caught): a peer may still wait in that
  // collective, and MPI_Finalize with it forever. End with a failure instead, which ends the job.
  fprintf(stderr, "dlua: rank %d of %d (MPI): a collective failed earlier, so MPI cannot be finalized; exit status 1\n",
          proc.rank, proc.size);
  fflush(stderr);
  _exit(1);
}

/* ---- initialisation ---------------------------------------------------------------------------------- */

static void init_once(void) {
  int already = 0;
  MPI_Initialized(&already);
  int provided = MPI_THREAD_SINGLE;
  // MPI's own threads (PMIx, its event loop) start here: with every asynchronous signal blocked they inherit the mask,
  // so Ctrl-C and SIGPIPE reach dlua's threads and not theirs.
  sigset_t all, old;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  // A rank waiting inside MPI yields its core between polls unless the user says otherwise: the cores run
  // this rank's compute (OpenMP threads, a backward pass overlapping DDP's all-reduce) and often other ranks
  // too, and Open MPI's default busy poll, when the node is not oversubscribed, takes a core from them. On
  // the loaded 2-core build machine MPI_Allreduce of 16-64 MB was faster so in most runs (docs/comm.md).
  if (!already) setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
  int rc = already ? MPI_Query_thread(&provided) : MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != MPI_SUCCESS) {
    snprintf(init_err, sizeof init_err, "MPI_Init_thread failed (MPI error %d)", rc);
    inited = -1;
    return;
  }
  init_thread = pthread_self();
  dlua_mpi_crash_note_install();
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &proc.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &proc.size);
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int vl = 0;
  MPI_Get_library_version(v, &vl);
  v[strcspn(v, ",\n")] = '\0';
  snprintf(proc.version, sizeof proc.version, "%s", v);
  if (!already && on_exit(at_exit, NULL) != 0) {
    snprintf(init_err, sizeof init_err, "cannot register MPI's exit handler");
    inited = -1;
    return;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    // each group's comm and executor threads, the p2p thread and the caller all call MPI
    snprintf(init_err, sizeof init_err,
             "%s gives thread level %d; dlua needs MPI_THREAD_MULTIPLE (%d): its comm, point-to-point and calling "
             "threads all call MPI",
             proc.version, provided, MPI_THREAD_MULTIPLE);
    inited = -1;
    return;
  }
  int *ub = NULL, flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  proc.tag_ub = flag && ub ? *ub : 32767;
  for (int i = 0; i < OP_USER_COUNT; i++) MPI_Op_create(user_fns[i], 1, &user_ops[i]);
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  const char *env = getenv("DLUA_MPI_CUDA");
  proc.cuda_aware = MPIX_Query_cuda_support() == 1 && !(env && !strcmp(env, "0"));
#endif
  inited = 1;
}

dlua_status_t dlua_mpi_init(void) {
  pthread_mutex_lock(&init_mu);
  if (inited == 0) init_once();
  int ok = inited;
  pthread_mutex_unlock(&init_mu);
  if (ok < 0) return DLUA_ERR(DLUA_ERR_BACKEND, "mpi: %s", init_err);
  return DLUA_OK;
}

const dlua_mpi_process_t *dlua_mpi_process(void) { return &proc; }

/* ---- dlua.h: the world, for dist.init ------------------------------------------------------------------ */

dlua_status_t dlua_mpi_world(int *rank, int *size) {
  DLUA_TRY(dlua_mpi_init());
  if (rank) *rank = proc.rank;
  if (size) *size = proc.size;
  return DLUA_OK;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Non-blocking, so a rank that never comes bounds it. The request cannot be withdrawn after a timeout, so
   the bytes it may still write go to a buffer that is never freed. */
dlua_status_t dlua_mpi_world_broadcast(void *buf, int64_t n, int root, int64_t timeout_ms) {
  DLUA_TRY(dlua_mpi_init());
  if (n < 0 || n > INT_MAX || (n > 0 && !buf))
    return DLUA_ERR(DLUA_ERR_ARG, "mpi broadcast: %" PRId64 " bytes at %p", n, buf);
  if (root < 0 || root >= proc.size)
    return DLUA_ERR(DLUA_ERR_ARG, "mpi broadcast: root %d is not a rank of MPI_COMM_WORLD (0..%d)", root, proc.size - 1);
  char *tmp = malloc(n > 0 ? (size_t)n : 1);
  if (!tmp) return DLUA_ERR(DLUA_ERR_OOM, "mpi broadcast: out of memory (%" PRId64 " bytes)", n);
  if (proc.rank == root && n > 0) memcpy(tmp, buf, (size_t)n);
  MPI_Request rq;
  int rc = MPI_Ibcast(tmp, (int)n, MPI_BYTE, root, MPI_COMM_WORLD, &rq);
  int64_t start = now_ms();
  int done = 0;
  for (long spins = 0; rc == MPI_SUCCESS && !done; spins++) {
    rc = MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
    if (done || rc != MPI_SUCCESS) break;
    if (dlua_interrupt_pending()) {
      dlua_mpi_note_failure(0);
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "mpi broadcast from rank %d: interrupted (Ctrl-C)", root);
    }
    if (now_ms() - start >= timeout_ms) {
      dlua_mpi_note_failure(0);
      return DLUA_ERR(DLUA_ERR_TIMEOUT,
                      "mpi broadcast from rank %d: not complete after %" PRId64 " ms on rank %d of %d (did every "
                      "rank call dist.init?)",
                      root, timeout_ms, proc.rank, proc.size);
    }
    struct timespec ts = {0, spins < 1000 ? 20000L : 1000000L};
    nanosleep(&ts, NULL);
  }
  if (rc != MPI_SUCCESS) {
    char e[MPI_MAX_ERROR_STRING + 40];
    dlua_mpi_error_text(rc, e, sizeof e);
    free(tmp);
    dlua_mpi_note_failure(0);
    return DLUA_ERR(DLUA_ERR_BACKEND, "mpi broadcast from rank %d: %s", root, e);
  }
  if (n > 0) memcpy(buf, tmp, (size_t)n);
  free(tmp);
  return DLUA_OK;
}

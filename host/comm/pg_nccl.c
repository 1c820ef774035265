/* NCCL process groups: libnccl.so.2 loaded at run time, one communicator and stream per group, works that end on an event. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/pg_nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>
#include <nccl.h>
#include <sched.h>

#include "core/error.h"
#include "core/tensor.h"
#include "cuda/stream_handle.h"

/* ---- libnccl, loaded on first use ------------------------------------------------------------------
   dlopen rather than linking: the binary then starts on machines without NCCL (CPU jobs), and finds the
   library where the machine has it: DLUA_NCCL_LIBRARY, the loader's path, the CUDA toolkit, or a Python
   package's nvidia/nccl/lib (pip's nvidia-nccl-cu12). The header only gives the types. */

static struct {
  void *h;
  char path[512];
  int version;
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);  // 2.13 and later; may be NULL
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
} nc;
static pthread_once_t nc_once = PTHREAD_ONCE_INIT;
static char nc_err[1024];

static void *try_open(const char *path, char *tried, size_t n) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h) {
    snprintf(nc.path, sizeof nc.path, "%s", path);
    return h;
  }
  size_t l = strlen(tried);
  if (l + 4 < n) snprintf(tried + l, n - l, "%s%s", l ? ", " : "", path);
  return NULL;
}

/* The first libnccl.so.2 matching a glob pattern. */
static void *try_glob(const char *pattern, char *tried, size_t n) {
  glob_t g;
  void *h = NULL;
  if (glob(pattern, 0, NULL, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc && !h; i++) h = try_open(g.gl_pathv[i], tried, n);
    globfree(&g);
  }
  return h;
}

static void nc_load(void) {
  char tried[600] = "";
  void *h = NULL;
  const char *env = getenv("DLUA_NCCL_LIBRARY");
  if (env && *env) h = try_open(env, tried, sizeof tried);
  if (!h) h = try_open("libnccl.so.2", tried, sizeof tried);
  char pat[700];
  const char *roots[] = {getenv("NCCL_ROOT"), getenv("CUDA_HOME"), getenv("CUDA_PATH"), "/usr/local/cuda"};
  for (int i = 0; i < 4 && !h; i++) {
    if (!roots[i] || !*roots[i]) continue;
    snprintf(pat, sizeof pat, "%s/lib*/libnccl.so.2", roots[i]);
    h = try_glob(pat, tried, sizeof tried);
  }
  const char *prefixes[] = {getenv("VIRTUAL_ENV"), getenv("CONDA_PREFIX"), getenv("HOME"), "/usr/local", "/usr"};
  for (int i = 0; i < 5 && !h; i++) {
    if (!prefixes[i] || !*prefixes[i]) continue;
    snprintf(pat, sizeof pat, "%s%s/lib/python3*/*-packages/nvidia/nccl/lib/libnccl.so.2", prefixes[i],
             i == 2 ? "/.local" : "");
    h = try_glob(pat, tried, sizeof tried);
  }
  if (!h) {
    snprintf(nc_err, sizeof nc_err,
             "libnccl.so.2 not found (tried %s; set DLUA_NCCL_LIBRARY to its path, or LD_LIBRARY_PATH)", tried);
    return;
  }
  const char *missing = NULL;
#define NC_SYM(field, sym, required)                          \
  do {                                                        \
    *(void **)&nc.field = dlsym(h, sym);                      \
    if (!nc.field && (required) && !missing) missing = sym;   \
  } while (0)
  NC_SYM(GetVersion, "ncclGetVersion", 1);
  NC_SYM(GetUniqueId, "ncclGetUniqueId", 1);
  NC_SYM(CommInitRankConfig, "ncclCommInitRankConfig", 1);
  NC_SYM(CommGetAsyncError, "ncclCommGetAsyncError", 1);
  NC_SYM(CommAbort, "ncclCommAbort", 1);
  NC_SYM(CommFinalize, "ncclCommFinalize", 1);
  NC_SYM(CommDestroy, "ncclCommDestroy", 1);
  NC_SYM(GetErrorString, "ncclGetErrorString", 1);
  NC_SYM(GetLastError, "ncclGetLastError", 0);
  NC_SYM(AllReduce, "ncclAllReduce", 1);
  NC_SYM(Broadcast, "ncclBroadcast", 1);
  NC_SYM(AllGather, "ncclAllGather", 1);
  NC_SYM(ReduceScatter, "ncclReduceScatter", 1);
  NC_SYM(Reduce, "ncclReduce", 1);
  NC_SYM(Send, "ncclSend", 1);
  NC_SYM(Recv, "ncclRecv", 1);
  NC_SYM(GroupStart, "ncclGroupStart", 1);
  NC_SYM(GroupEnd, "ncclGroupEnd", 1);
#undef NC_SYM
  if (nc.GetVersion) nc.GetVersion(&nc.version);
  // ncclAvg and bfloat16 came in 2.10, non-blocking communicators (ncclCommInitRankConfig) in 2.14.
  if (missing || nc.version < 21400) {
    snprintf(nc_err, sizeof nc_err, "%s is NCCL %d.%d.%d%s%s; dlua needs 2.14 or newer", nc.path, nc.version / 10000,
             (nc.version % 10000) / 100, nc.version % 100, missing ? ", without " : "", missing ? missing : "");
    dlclose(h);
    return;
  }
  nc.h = h;
}

/* ---- the group's state ------------------------------------------------------------------------- */

typedef struct {
  int device;
  int rank, size;
  int64_t timeout_ms;        /* the join's: bounds the clean close too */
  ncclComm_t comm;           /* NULL after an abort */
  dlua_cuda_stream_t *stream;/* the group's stream: a dlua stream, so scratch memory is keyed by it */
  cudaStream_t cs;           /* its handle, for NCCL */
  cudaEvent_t done;          /* recorded after each work; one suffices: works run one at a time */
  int has_done;
  void *scratch;             /* device memory for packing, the barrier's element, the debug all-gather */
  size_t scratch_bytes;
} nccl_ctx_t;

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void pause_us(long us) {
  struct timespec ts = {0, us * 1000L};
  nanosleep(&ts, NULL);
}

static size_t tbytes(const dlua_tensor_t *t) { return (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype); }

static dlua_pg_result_t fail(char *err, size_t n, dlua_pg_result_t r, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static dlua_pg_result_t fail(char *err, size_t n, dlua_pg_result_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, n, fmt, ap);
  va_end(ap);
  return r;
}

/* "ncclX: <NCCL's name for r>: <its last message>". */
static dlua_pg_result_t nccl_fail(nccl_ctx_t *x, ncclResult_t r, const char *what, char *err, size_t n) {
  const char *last = nc.GetLastError ? nc.GetLastError(x->comm) : "";
  return fail(err, n, r == ncclRemoteError ? DLUA_PG_PEER_LOST : DLUA_PG_FAILED, "%s: %s%s%s", what,
              nc.GetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

static void abort_comm(nccl_ctx_t *x) {
  if (x->comm) nc.CommAbort(x->comm);
  x->comm = NULL;
}

/* A non-blocking communicator answers ncclInProgress while it works; polls it until it settles or
   the deadline passes (then ncclInProgress comes back). */
static ncclResult_t settle(nccl_ctx_t *x, ncclResult_t r, int64_t deadline) {
  while (r == ncclInProgress) {
    if (now_ms() >= deadline) return ncclInProgress;
    pause_us(200);
    if (nc.CommGetAsyncError(x->comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

/* Waits for everything queued on the group's stream, watching NCCL's asynchronous errors; at the
   deadline the communicator is aborted, which ends its kernels (stuck waiting for a peer). */
static dlua_pg_result_t wait_stream(nccl_ctx_t *x, int64_t deadline, const char *what, char *err, size_t n) {
  cudaError_t ce = cudaEventRecord(x->done, x->cs);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return fail(err, n, DLUA_PG_FAILED, "%s: cudaEventRecord: %s", what, cudaGetErrorString(ce));
  }
  for (long spins = 0;; spins++) {
    ce = cudaEventQuery(x->done);
    if (ce == cudaSuccess) return DLUA_PG_OK;
    if (ce != cudaErrorNotReady) {
      cudaGetLastError();
      abort_comm(x);
      return fail(err, n, DLUA_PG_FAILED, "%s: CUDA error %d: %s", what, (int)ce, cudaGetErrorString(ce));
    }
    ncclResult_t ae = ncclSuccess;
    if (x->comm && nc.CommGetAsyncError(x->comm, &ae) == ncclSuccess && ae != ncclSuccess && ae != ncclInProgress) {
      dlua_pg_result_t r = nccl_fail(x, ae, what, err, n);
      abort_comm(x);
      return r;
    }
    if (now_ms() >= deadline) {
      abort_comm(x);
      return fail(err, n, DLUA_PG_TIMEOUT, "%s: not complete at the deadline; communicator aborted", what);
    }
    // Spin briefly (small collectives end in microseconds), then sleep between polls.
    if (spins < 2000)
      sched_yield();
    else
      pause_us(spins < 20000 ? 50 : 500);
  }
}

static dlua_pg_result_t need_scratch(nccl_ctx_t *x, size_t bytes, char *err, size_t n) {
  if (x->scratch_bytes >= bytes) return DLUA_PG_OK;
  if (x->scratch && dlua_cuda_free(x->device, x->scratch) != DLUA_OK) dlua_clear_error();
  x->scratch = NULL;
  x->scratch_bytes = 0;
  if (dlua_cuda_malloc(&x->scratch, x->device, bytes, x->stream) != DLUA_OK)
    return fail(err, n, DLUA_PG_FAILED, "scratch memory: %s", dlua_last_error());
  x->scratch_bytes = bytes;
  return DLUA_PG_OK;
}

/* ---- the backend ---------------------------------------------------------------------------------- */

static ncclDataType_t nccl_type(dlua_dtype_t dt) {
  switch (dt) {
    case DLUA_DTYPE_F32: return ncclFloat32;
    case DLUA_DTYPE_F64: return ncclFloat64;
    case DLUA_DTYPE_F16: return ncclFloat16;
    case DLUA_DTYPE_BF16: return ncclBfloat16;
    case DLUA_DTYPE_I32: return ncclInt32;
    case DLUA_DTYPE_I64: return ncclInt64;
    default: return ncclUint8;  // u8, and bool (0/1 bytes)
  }
}

/* bool: sum and max are "or" (max of 0/1), product and min are "and" (min), as on gloo. */
static ncclRedOp_t nccl_op(dlua_reduce_t op, dlua_dtype_t dt) {
  if (dt == DLUA_DTYPE_BOOL) return op == DLUA_PG_REDUCE_SUM || op == DLUA_PG_REDUCE_MAX ? ncclMax : ncclMin;
  switch (op) {
    case DLUA_PG_REDUCE_AVG: return ncclAvg;
    case DLUA_PG_REDUCE_MAX: return ncclMax;
    case DLUA_PG_REDUCE_MIN: return ncclMin;
    case DLUA_PG_REDUCE_PRODUCT: return ncclProd;
    default: return ncclSum;
  }
}

/* Views of one buffer, back to back in list order: one NCCL call covers them. */
static char *packed(dlua_tensor_t *const *ts, int n) {
  char *base = NULL;
  size_t off = 0;
  for (int r = 0; r < n; r++) {
    char *p = dlua_tensor_ptr(ts[r]);
    if (!base) base = p;
    if (p != base + off) return NULL;
    off += tbytes(ts[r]);
  }
  return base;
}

static dlua_status_t check_one(nccl_ctx_t *x, const dlua_work_t *w, const dlua_tensor_t *t, const char *what) {
  const char *op = dlua_pg_kind_name(w->kind);
  if (t->device == DLUA_CPU)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: %s is a CPU tensor; NCCL groups take CUDA tensors on cuda:%d (gloo runs CPU collectives: "
                    "dist.init{backend='auto'} keeps both)",
                    op, what, x->device);
  if (t->device != x->device)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is on cuda:%d, but this NCCL group works on cuda:%d", op, what, t->device,
                    x->device);
  if (!dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: NCCL needs contiguous tensors; %s is not (pass t:contiguous())", op, what);
  return DLUA_OK;
}

static dlua_status_t nc_prepare(void *c, dlua_work_t *w) {
  nccl_ctx_t *x = c;
  char what[32];
  if (w->t) DLUA_TRY(check_one(x, w, w->t, "the tensor"));
  for (int i = 0; w->outs && i < w->nlist; i++) {
    snprintf(what, sizeof what, "outs[%d]", i);
    DLUA_TRY(check_one(x, w, w->outs[i], what));
  }
  for (int i = 0; w->ins && i < w->nlist; i++) {
    snprintf(what, sizeof what, w->kind == K_ALL_REDUCE_MANY ? "tensors[%d]" : "ins[%d]", i);
    DLUA_TRY(check_one(x, w, w->ins[i], what));
  }
  // The group's stream starts the work after what the caller's stream has queued so far.
  DLUA_TRY(dlua_cuda_event_create(&w->ready, x->device, 0));
  return dlua_cuda_event_record(w->ready, NULL);
}

/* The caching allocator must not hand a tensor's block to its own stream while ours may still use it. */
static void record_uses(nccl_ctx_t *x, const dlua_work_t *w) {
  const dlua_tensor_t *ts[3] = {w->t, NULL, NULL};
  for (int k = 0; k < 3; k++) {
    dlua_tensor_t *const *list = k == 0 ? (dlua_tensor_t *const *)ts : k == 1 ? w->outs : w->ins;
    int n = k == 0 ? (w->t ? 1 : 0) : list ? w->nlist : 0;
    for (int i = 0; i < n; i++)
      if (dlua_cuda_record_stream(x->device, list[i]->storage->data, x->stream) != DLUA_OK) dlua_clear_error();
  }
}

static dlua_pg_result_t d2d(nccl_ctx_t *x, void *dst, const void *src, size_t bytes, char *err, size_t n) {
  if (bytes == 0) return DLUA_PG_OK;
  cudaError_t ce = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, x->cs);
  if (ce == cudaSuccess) return DLUA_PG_OK;
  cudaGetLastError();
  return fail(err, n, DLUA_PG_FAILED, "cudaMemcpyAsync: %s", cudaGetErrorString(ce));
}

static dlua_pg_result_t nc_run(void *c, dlua_work_t *w, int64_t timeout_ms, char *err, size_t errlen) {
  nccl_ctx_t *x = c;
  int64_t deadline = now_ms() + timeout_ms;
  const char *name = dlua_pg_kind_name(w->kind);
  if (!x->comm) return fail(err, errlen, DLUA_PG_FAILED, "%s: the communicator was aborted", name);
  cudaSetDevice(x->device);
  if (w->ready && dlua_cuda_stream_wait_event(x->stream, w->ready) != DLUA_OK)
    return fail(err, errlen, DLUA_PG_FAILED, "%s", dlua_last_error());
  int rank = x->rank, size = x->size;
  ncclComm_t cm = x->comm;
  cudaStream_t s = x->cs;
  ncclResult_t r = ncclSuccess;
  dlua_pg_result_t gr = DLUA_PG_OK;
  switch (w->kind) {
    case K_ALL_REDUCE: {
      void *p = dlua_tensor_ptr(w->t);
      r = nc.AllReduce(p, p, (size_t)dlua_tensor_numel(w->t), nccl_type(w->t->dtype), nccl_op(w->op, w->t->dtype), cm, s);
      break;
    }
    case K_ALL_REDUCE_MANY:
      nc.GroupStart();
      for (int i = 0; i < w->nlist && r == ncclSuccess; i++) {
        dlua_tensor_t *t = w->ins[i];
        void *p = dlua_tensor_ptr(t);
        r = nc.AllReduce(p, p, (size_t)dlua_tensor_numel(t), nccl_type(t->dtype), nccl_op(w->op, t->dtype), cm, s);
      }
      {
        ncclResult_t e = nc.GroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    case K_BROADCAST: {
      void *p = dlua_tensor_ptr(w->t);
      r = nc.Broadcast(p, p, (size_t)dlua_tensor_numel(w->t), nccl_type(w->t->dtype), w->peer, cm, s);
      break;
    }
    case K_ALL_GATHER: {
      size_t cnt = (size_t)dlua_tensor_numel(w->t);
      ncclDataType_t dt = nccl_type(w->t->dtype);
      int equal = 1;
      for (int q = 0; q < size; q++) equal &= (size_t)dlua_tensor_numel(w->outs[q]) == cnt;
      char *base = equal ? packed(w->outs, size) : NULL;
      if (base) {
        r = nc.AllGather(dlua_tensor_ptr(w->t), base, cnt, dt, cm, s);
        break;
      }
      // Unequal sizes, or outputs apart: every pair exchanges directly (one grouped call).
      if ((gr = d2d(x, dlua_tensor_ptr(w->outs[rank]), dlua_tensor_ptr(w->t), tbytes(w->t), err, errlen)) != DLUA_PG_OK)
        return gr;
      nc.GroupStart();
      for (int q = 0; q < size && r == ncclSuccess; q++) {
        if (q == rank) continue;
        size_t oc = (size_t)dlua_tensor_numel(w->outs[q]);
        if (cnt) r = nc.Send(dlua_tensor_ptr(w->t), cnt, dt, q, cm, s);
        if (oc && r == ncclSuccess) r = nc.Recv(dlua_tensor_ptr(w->outs[q]), oc, dt, q, cm, s);
      }
      {
        ncclResult_t e = nc.GroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    }
    case K_REDUCE_SCATTER: {
      size_t m = (size_t)dlua_tensor_numel(w->t), es = dlua_dtype_size(w->t->dtype);
      int equal = 1;
      for (int q = 0; q < size; q++) equal &= (size_t)dlua_tensor_numel(w->ins[q]) == m;
      if (!equal) {  // parts of different sizes (ZeRO's shards of a bucket): one reduce to each part's rank
        ncclDataType_t dt = nccl_type(w->t->dtype);
        ncclRedOp_t op = nccl_op(w->op, w->t->dtype);
        nc.GroupStart();
        for (int q = 0; q < size && r == ncclSuccess; q++) {
          size_t c = (size_t)dlua_tensor_numel(w->ins[q]);
          if (c) r = nc.Reduce(dlua_tensor_ptr(w->ins[q]), q == rank ? dlua_tensor_ptr(w->t) : NULL, c, dt, op, q, cm, s);
        }
        ncclResult_t e = nc.GroupEnd();
        if (r == ncclSuccess) r = e;
        break;
      }
      char *in = packed(w->ins, size);
      if (!in) {  // pack the inputs into scratch memory, in rank order
        if ((gr = need_scratch(x, (size_t)size * m * es, err, errlen)) != DLUA_PG_OK) return gr;
        in = x->scratch;
        for (int q = 0; q < size; q++)
          if ((gr = d2d(x, in + (size_t)q * m * es, dlua_tensor_ptr(w->ins[q]), m * es, err, errlen)) != DLUA_PG_OK)
            return gr;
      }
      r = nc.ReduceScatter(in, dlua_tensor_ptr(w->t), m, nccl_type(w->t->dtype), nccl_op(w->op, w->t->dtype), cm, s);
      break;
    }
    case K_ALL_TO_ALL: {
      ncclDataType_t dt = nccl_type(w->ins[0]->dtype);
      if ((gr = d2d(x, dlua_tensor_ptr(w->outs[rank]), dlua_tensor_ptr(w->ins[rank]), tbytes(w->ins[rank]), err,
                    errlen)) != DLUA_PG_OK)
        return gr;
      nc.GroupStart();
      for (int q = 0; q < size && r == ncclSuccess; q++) {
        if (q == rank) continue;
        size_t ic = (size_t)dlua_tensor_numel(w->ins[q]), oc = (size_t)dlua_tensor_numel(w->outs[q]);
        if (ic) r = nc.Send(dlua_tensor_ptr(w->ins[q]), ic, dt, q, cm, s);
        if (oc && r == ncclSuccess) r = nc.Recv(dlua_tensor_ptr(w->outs[q]), oc, dt, q, cm, s);
      }
      {
        ncclResult_t e = nc.GroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    }
    case K_BARRIER:  // an all-reduce of one element: returns when every rank's stream got there
      if ((gr = need_scratch(x, 512, err, errlen)) != DLUA_PG_OK) return gr;
      r = nc.AllReduce(x->scratch, x->scratch, 1, ncclInt32, ncclSum, cm, s);
      break;
    case K_SEND:
      if (dlua_tensor_numel(w->t))
        r = nc.Send(dlua_tensor_ptr(w->t), (size_t)dlua_tensor_numel(w->t), nccl_type(w->t->dtype), w->peer, cm, s);
      break;
    case K_RECV:
      if (dlua_tensor_numel(w->t))
        r = nc.Recv(dlua_tensor_ptr(w->t), (size_t)dlua_tensor_numel(w->t), nccl_type(w->t->dtype), w->peer, cm, s);
      break;
    default: return fail(err, errlen, DLUA_PG_FAILED, "unknown work kind %d", w->kind);
  }
  r = settle(x, r, deadline);
  if (r == ncclInProgress) {
    abort_comm(x);
    return fail(err, errlen, DLUA_PG_TIMEOUT, "%s: NCCL did not accept the call before the deadline", name);
  }
  if (r != ncclSuccess) {
    char what[64];
    snprintf(what, sizeof what, "nccl %s", name);
    gr = nccl_fail(x, r, what, err, errlen);
    abort_comm(x);
    return gr;
  }
  record_uses(x, w);
  return wait_stream(x, deadline, name, err, errlen);
}

/* Debug mode's fingerprints through NCCL: host bytes up, one all-gather, back down. */
static dlua_pg_result_t nc_allgather_host(void *c, int64_t seq, const void *in, void *out, size_t bytes,
                                          int64_t timeout_ms, char *err, size_t errlen) {
  nccl_ctx_t *x = c;
  int64_t deadline = now_ms() + timeout_ms;
  if (!x->comm) return fail(err, errlen, DLUA_PG_FAILED, "debug check: the communicator was aborted");
  cudaSetDevice(x->device);
  size_t all = (size_t)x->size * bytes;
  dlua_pg_result_t gr = need_scratch(x, all + bytes, err, errlen);
  if (gr != DLUA_PG_OK) return gr;
  char *mine = (char *)x->scratch + all;
  cudaError_t ce = cudaMemcpyAsync(mine, in, bytes, cudaMemcpyHostToDevice, x->cs);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return fail(err, errlen, DLUA_PG_FAILED, "debug check: copy: %s", cudaGetErrorString(ce));
  }
  ncclResult_t r = settle(x, nc.AllGather(mine, x->scratch, bytes, ncclUint8, x->comm, x->cs), deadline);
  if (r != ncclSuccess) {
    gr = r == ncclInProgress ? fail(err, errlen, DLUA_PG_TIMEOUT, "debug check: NCCL did not accept the call")
                             : nccl_fail(x, r, "debug check", err, errlen);
    abort_comm(x);
    return gr;
  }
  if ((gr = wait_stream(x, deadline, "debug check", err, errlen)) != DLUA_PG_OK) return gr;
  ce = cudaMemcpy(out, x->scratch, all, cudaMemcpyDeviceToHost);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return fail(err, errlen, DLUA_PG_FAILED, "debug check: copy back: %s", cudaGetErrorString(ce));
  }
  return DLUA_PG_OK;
}

/* Rank 0's unique id through the store, then a non-blocking ncclCommInitRankConfig polled until the
   deadline: a rank that never comes makes the others fail here, naming it, instead of hanging. */
static dlua_pg_result_t nc_join(void *c, const dlua_pg_info_t *g, dlua_status_t *store_status, char *err,
                                size_t errlen) {
  nccl_ctx_t *x = c;
  dlua_store_t *store = g->store;
  const char *name = g->name;
  int rank = g->rank, size = g->size;
  int64_t timeout_ms = g->timeout_ms;
  int64_t start = now_ms(), deadline = start + timeout_ms;
  x->rank = rank;
  x->size = size;
  cudaError_t ce = cudaSetDevice(x->device);
  if (ce == cudaSuccess) ce = cudaEventCreateWithFlags(&x->done, cudaEventDisableTiming);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return fail(err, errlen, DLUA_PG_FAILED, "cuda:%d: %s", x->device, cudaGetErrorString(ce));
  }
  x->has_done = 1;
  if (dlua_cuda_stream_create(&x->stream, x->device) != DLUA_OK)
    return fail(err, errlen, DLUA_PG_FAILED, "%s", dlua_last_error());
  x->cs = (cudaStream_t)dlua_cuda_stream_handle(x->stream, x->device);

  char key[PG_NAME + 48];
  ncclUniqueId id;
  snprintf(key, sizeof key, "%s/nccl/id", name);
  dlua_status_t st;
  if (rank == 0) {
    ncclResult_t r = nc.GetUniqueId(&id);
    if (r != ncclSuccess) return fail(err, errlen, DLUA_PG_FAILED, "ncclGetUniqueId: %s", nc.GetErrorString(r));
    st = dlua_store_set(store, key, &id, sizeof id);
  } else {
    void *v = NULL;
    size_t n = 0;
    st = dlua_store_get(store, key, timeout_ms, &v, &n);
    if (st == DLUA_OK && n != sizeof id) {
      dlua_store_free_value(v);
      return fail(err, errlen, DLUA_PG_FAILED, "'%s' holds %zu bytes, not an NCCL unique id (%zu)", key, n, sizeof id);
    }
    if (st == DLUA_OK) {
      memcpy(&id, v, sizeof id);
      dlua_store_free_value(v);
    }
  }
  if (st == DLUA_OK) {
    snprintf(key, sizeof key, "%s/nccl/in/%d", name, rank);
    st = dlua_store_set(store, key, "1", 1);
  }
  if (st != DLUA_OK) {
    *store_status = st;
    return fail(err, errlen, st == DLUA_ERR_TIMEOUT ? DLUA_PG_TIMEOUT : DLUA_PG_FAILED, "%s", dlua_last_error());
  }

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = nc.CommInitRankConfig(&x->comm, size, id, rank, &cfg);
  while (r == ncclInProgress && now_ms() < deadline) {
    pause_us(1000);
    if (nc.CommGetAsyncError(x->comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) return DLUA_PG_OK;
  if (r != ncclInProgress) {
    dlua_pg_result_t gr = nccl_fail(x, r, "ncclCommInitRankConfig", err, errlen);
    abort_comm(x);
    return gr;
  }
  abort_comm(x);
  // Who never started: their "in" keys are missing.
  char missing[400] = "";
  size_t l = 0;
  int nmissing = 0;
  for (int q = 0; q < size && l < sizeof missing - 16; q++) {
    int exists = 0;
    snprintf(key, sizeof key, "%s/nccl/in/%d", name, q);
    const char *k = key;
    if (dlua_store_check(store, &k, 1, &exists) != DLUA_OK) {
      dlua_clear_error();
      break;
    }
    if (!exists) {
      l += (size_t)snprintf(missing + l, sizeof missing - l, "%s%d", nmissing ? ", " : "", q);
      nmissing++;
    }
  }
  if (nmissing)
    return fail(err, errlen, DLUA_PG_TIMEOUT, "NCCL communicator not ready after %" PRId64 " ms; rank%s %s never arrived",
                now_ms() - start, nmissing > 1 ? "s" : "", missing);
  return fail(err, errlen, DLUA_PG_TIMEOUT,
              "NCCL communicator not ready after %" PRId64 " ms, though every rank arrived (NCCL's bootstrap is stuck: "
              "check NCCL_SOCKET_IFNAME and that the ranks reach each other)",
              now_ms() - start);
}

/* Ends the communicator (cleanly, or by abort after a failure) and frees the group's CUDA state. Runs
   on the thread that frees the group: its current device is put back. */
static void nc_close(void *c, int broken) {
  nccl_ctx_t *x = c;
  if (!x) return;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  cudaSetDevice(x->device);
  if (x->comm && !broken) {
    ncclResult_t r = settle(x, nc.CommFinalize(x->comm), now_ms() + (x->timeout_ms < 10000 ? x->timeout_ms : 10000));
    if (r == ncclSuccess) {
      nc.CommDestroy(x->comm);
      x->comm = NULL;
    }
  }
  abort_comm(x);  // after a failure, or a finalize that did not finish
  if (x->scratch && dlua_cuda_free(x->device, x->scratch) != DLUA_OK) dlua_clear_error();
  if (x->has_done) cudaEventDestroy(x->done);
  dlua_cuda_stream_destroy(x->stream);
  cudaGetLastError();
  if (prev >= 0 && prev != x->device) cudaSetDevice(prev);
  free(x);
}

static const dlua_pg_backend_t nccl_backend = {
    .name = "nccl",
    .join = nc_join,
    .prepare = nc_prepare,
    .run = nc_run,
    .allgather_host = nc_allgather_host,
    .close = nc_close,
};

const char *dlua_pg_nccl_library_error(void) {
  pthread_once(&nc_once, nc_load);
  return nc.h ? NULL : nc_err;
}

dlua_status_t dlua_pg_nccl_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx) {
  nccl_ctx_t *x = calloc(1, sizeof *x);
  if (!x) return DLUA_ERR(DLUA_ERR_OOM, "process group %s: out of memory", args->name ? args->name : "?");
  x->device = args->device;
  x->timeout_ms = args->timeout_ms;
  *be = &nccl_backend;
  *ctx = x;
  return DLUA_OK;
}

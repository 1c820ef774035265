/* Process groups: the group object, its comm thread and work queue, timeouts and their diagnostics, reduce functions. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm/launch.h"
#include "comm/pg.h"
#include "comm/pg_internal.h"
#include "comm/shm.h"
#include "comm/store.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

/* ---- element reduce functions -------------------------------------------------------------------
   gloo calls these with out == a (in place). Integer sums and products wrap (through unsigned, so
   no undefined overflow); float max/min propagate NaN as torch.maximum does; f16/bf16 compute in f32
   and round once per step; bool: sum/max = or, product/min = and. */

#define PG_FN(name, T, EXPR)                                                  \
  static void name(void *o_, const void *a_, const void *b_, size_t n) {      \
    T *o = (T *)o_;                                                           \
    const T *a = (const T *)a_, *b = (const T *)b_;                           \
    for (size_t i = 0; i < n; i++) {                                          \
      T x = a[i], y = b[i];                                                   \
      o[i] = (EXPR);                                                          \
    }                                                                         \
  }

#define PG_FLOAT_FNS(sfx, T)                                   \
  PG_FN(sum_##sfx, T, x + y)                                   \
  PG_FN(prod_##sfx, T, x * y)                                  \
  PG_FN(max_##sfx, T, (x > y || x != x) ? x : y)               \
  PG_FN(min_##sfx, T, (x < y || x != x) ? x : y)
PG_FLOAT_FNS(f32, float)
PG_FLOAT_FNS(f64, double)

#define PG_INT_FNS(sfx, T, U)                                  \
  PG_FN(sum_##sfx, T, (T)((U)x + (U)y))                        \
  PG_FN(prod_##sfx, T, (T)((U)x * (U)y))                       \
  PG_FN(max_##sfx, T, x > y ? x : y)                           \
  PG_FN(min_##sfx, T, x < y ? x : y)
PG_INT_FNS(i32, int32_t, uint32_t)
PG_INT_FNS(i64, int64_t, uint64_t)
PG_INT_FNS(u8, uint8_t, uint32_t)

PG_FN(or_b8, uint8_t, (uint8_t)((x | y) != 0))
PG_FN(and_b8, uint8_t, (uint8_t)((x != 0) & (y != 0)))

#define PG_HALF_FNS(sfx, TO, FROM)                                                         \
  PG_FN(sum_##sfx, uint16_t, TO(FROM(x) + FROM(y)))                                         \
  PG_FN(prod_##sfx, uint16_t, TO(FROM(x) * FROM(y)))                                        \
  PG_FN(max_##sfx, uint16_t, (FROM(x) > FROM(y) || FROM(x) != FROM(x)) ? x : y)             \
  PG_FN(min_##sfx, uint16_t, (FROM(x) < FROM(y) || FROM(x) != FROM(x)) ? x : y)
PG_HALF_FNS(f16, dlua_f32_to_f16_inl, dlua_f16_to_f32_inl)
PG_HALF_FNS(bf16, dlua_f32_to_bf16_inl, dlua_bf16_to_f32_inl)

dlua_pg_reduce_fn dlua_pg_reduce_fn_for(dlua_reduce_t op, dlua_dtype_t dtype) {
  // Rows: SUM (AVG sums first), MAX, MIN, PRODUCT; columns: dtypes in enum order.
  static const dlua_pg_reduce_fn table[4][DLUA_DTYPE_COUNT] = {
      {sum_f32, sum_f64, sum_f16, sum_bf16, sum_i32, sum_i64, sum_u8, or_b8},
      {max_f32, max_f64, max_f16, max_bf16, max_i32, max_i64, max_u8, or_b8},
      {min_f32, min_f64, min_f16, min_bf16, min_i32, min_i64, min_u8, and_b8},
      {prod_f32, prod_f64, prod_f16, prod_bf16, prod_i32, prod_i64, prod_u8, and_b8}};
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return NULL;
  switch (op) {
    case DLUA_PG_REDUCE_SUM:
    case DLUA_PG_REDUCE_AVG: return table[0][dtype];
    case DLUA_PG_REDUCE_MAX: return table[1][dtype];
    case DLUA_PG_REDUCE_MIN: return table[2][dtype];
    case DLUA_PG_REDUCE_PRODUCT: return table[3][dtype];
    default: return NULL;
  }
}

void dlua_pg_divide_by(void *buf, size_t n, dlua_dtype_t dt, int size) {
  switch (dt) {
    case DLUA_DTYPE_F32: {
      float *p = buf;
      for (size_t i = 0; i < n; i++) p[i] /= (float)size;
      break;
    }
    case DLUA_DTYPE_F64: {
      double *p = buf;
      for (size_t i = 0; i < n; i++) p[i] /= (double)size;
      break;
    }
    case DLUA_DTYPE_F16: {
      uint16_t *p = buf;
      for (size_t i = 0; i < n; i++) p[i] = dlua_f32_to_f16_inl(dlua_f16_to_f32_inl(p[i]) / (float)size);
      break;
    }
    case DLUA_DTYPE_BF16: {
      uint16_t *p = buf;
      for (size_t i = 0; i < n; i++) p[i] = dlua_f32_to_bf16_inl(dlua_bf16_to_f32_inl(p[i]) / (float)size);
      break;
    }
    default: break;
  }
}

/* ---- the group and its work ------------------------------------------------------------------- */

static const char *const kind_names[] = {"all_reduce", "broadcast",  "all_gather", "reduce_scatter",
                                         "all_to_all", "barrier",    "send",       "recv",
                                         "all_reduce_many"};
static const char *const op_names[] = {"sum", "avg", "max", "min", "product"};

enum {
  PG_DIAG_MS = 2000,            /* how long a failed rank listens for the others' positions */
  PG_P2P_PREFIX = 0x40,         /* gloo slot prefixes of ours, above gloo's own (0x01..0x08) */
  PG_RING_PREFIX = 0x41,
  PG_MAX_CUDA = 16              /* CUDA devices a gloo group stages tensors of (a stream each) */
};

struct dlua_pg {
  char name[PG_NAME];
  int rank, size;
  int64_t timeout_ms;      /* atomic */
  int debug;               /* atomic */
  dlua_store_t *store;     /* ours: the join, then diagnostics, then the exit note */
  dlua_gloo_t *gloo;
  dlua_shm_t *shm;         /* all ranks on this host: all-reduce of CPU memory goes through it, not gloo */
  char transport_why[160]; /* why shm is used or not */
  char store_host[256], token[DLUA_STORE_MAX_TOKEN + 1];  /* shared regions meet through a store connection of their own */
  int store_port;
  int64_t regions;         /* shared regions made (under mu) */
  char region_why[160];    /* the last shared_zeros: why it gave no memory */
  char bind_host[128], iface[64];
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
  const dlua_pg_backend_t *be;  /* NULL: gloo (the code below); else the backend that runs the works */
  void *be_ctx;
  dlua_cuda_stream_t *stage_streams[PG_MAX_CUDA];  /* under mu: gloo's copies of CUDA tensors */
};

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static size_t tbytes(const dlua_tensor_t *t) { return (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype); }

static void work_set(dlua_work_t *w, dlua_status_t s, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void work_set(dlua_work_t *w, dlua_status_t s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->msg, sizeof w->msg, fmt, ap);
  va_end(ap);
  w->status = s;
}

/* A callee's message without its " (host/...:N)" suffix: the wait adds its own location. */
static void work_from_last_error(dlua_work_t *w, const char *what) {
  char m[PG_MSG];
  snprintf(m, sizeof m, "%s", dlua_last_error());
  char *loc = strstr(m, " (host/");
  if (loc) *loc = '\0';
  work_set(w, dlua_last_status() != DLUA_OK ? dlua_last_status() : DLUA_ERR_INTERNAL, "%s #%" PRId64 ": %s: %s",
           kind_names[w->kind], w->seq, what, m);
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
static void *st_alloc(const dlua_work_t *w, size_t bytes) {
  if (!w->pinned) return malloc(bytes);
  void *p = NULL;
  if (dlua_cuda_host_alloc(&p, bytes ? bytes : 1) != DLUA_OK) return NULL;
  return p;
}

static void st_free(const dlua_work_t *w, void *p) {
  if (!p) return;
  if (!w->pinned) {
    free(p);
  } else if (dlua_cuda_host_free(p) != DLUA_OK) {
    dlua_clear_error();
  }
}

static void work_destroy(dlua_work_t *w) {
  if (!w) return;
  work_release_tensors(w);
  dlua_gloo_p2p_free(w->p2p);
  st_free(w, w->stage);
  dlua_cuda_event_destroy(w->ready);
  free(w);
}

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

/* ---- failure diagnostics ------------------------------------------------------------------------ */

static void at_key(char *buf, size_t n, const dlua_pg_t *pg, int rank) { snprintf(buf, n, "%s/at/%d", pg->name, rank); }

/* After a failed collective: says where this rank is, listens up to PG_DIAG_MS for where the others
   are, and writes the message that names the ranks that did not arrive. */
static void diagnose(dlua_pg_t *pg, dlua_work_t *w, dlua_gloo_result_t r, const char *gloo_msg, int64_t timeout_ms) {
  char key[PG_NAME + 32], val[PG_SITE + 64];
  const char *coll = kind_names[w->kind];
  at_key(key, sizeof key, pg, pg->rank);
  snprintf(val, sizeof val, "%" PRId64 " %s %s", w->seq, coll, w->site[0] ? w->site : "-");
  int store_ok = pg->store && dlua_store_set(pg->store, key, val, strlen(val)) == DLUA_OK;

  // Whom to ask: everybody for a collective, the peer for send/recv.
  int n = pg->size;
  int *ranks = calloc((size_t)n, sizeof(int));
  char **keys = calloc((size_t)n, sizeof(char *));
  int *exists = calloc((size_t)n, sizeof(int));
  char **vals = calloc((size_t)n, sizeof(char *));
  int m = 0;
  if (ranks && keys && exists && vals) {
    for (int q = 0; q < n; q++) {
      if (q == pg->rank) continue;
      if ((w->kind == K_SEND || w->kind == K_RECV) && q != w->peer) continue;
      keys[m] = malloc(PG_NAME + 32);
      if (!keys[m]) break;
      at_key(keys[m], PG_NAME + 32, pg, q);
      ranks[m++] = q;
    }
    int64_t end = now_ms() + PG_DIAG_MS;
    while (store_ok) {
      if (dlua_store_check(pg->store, (const char *const *)keys, m, exists) != DLUA_OK) break;
      int all = 1;
      for (int i = 0; i < m; i++) all &= exists[i];
      if (all || now_ms() >= end) break;
      sleep_ms(100);
    }
    for (int i = 0; i < m && store_ok; i++) {
      size_t len;
      void *v = NULL;
      if (exists[i] && dlua_store_get(pg->store, keys[i], 0, &v, &len) == DLUA_OK) vals[i] = v;
    }
  }

  // Sort the others into arrived (same collective, same number) and not arrived.
  char missing[1200] = "", arrived[400] = "";
  int any_exited = 0, any_missing = 0;
  size_t lm = 0, la = 0;
  for (int i = 0; i < m; i++) {
    const char *v = vals[i];
    char *end = NULL;
    int64_t seq = v ? strtoll(v, &end, 10) : 0;
    char vcoll[32] = "";
    const char *vsite = "";
    if (v && end != v) {
      int k = 0;
      while (*end == ' ') end++;
      while (*end && *end != ' ' && k < 31) vcoll[k++] = *end++;
      vcoll[k] = '\0';
      while (*end == ' ') end++;
      vsite = end;
    }
    int is_p2p = w->kind == K_SEND || w->kind == K_RECV;
    if (v && end != v && !is_p2p && seq == w->seq && !strcmp(vcoll, coll)) {
      la += (size_t)snprintf(arrived + la, la < sizeof arrived ? sizeof arrived - la : 0, "%s%d", la ? ", " : "",
                             ranks[i]);
      if (la >= sizeof arrived) la = sizeof arrived - 1;
      continue;
    }
    char what[PG_SITE + 96];
    if (!v) {
      snprintf(what, sizeof what, "rank %d did not answer (exited or busy elsewhere)", ranks[i]);
    } else if (!strncmp(v, "exited after ", 13)) {
      any_exited = 1;
      snprintf(what, sizeof what, "rank %d exited after %s collective%s", ranks[i], v + 13, strcmp(v + 13, "1") ? "s" : "");
    } else if (end != v) {
      if (strcmp(vsite, "-"))
        snprintf(what, sizeof what, "rank %d is at %s #%" PRId64 " (%s)", ranks[i], vcoll, seq, vsite);
      else
        snprintf(what, sizeof what, "rank %d is at %s #%" PRId64, ranks[i], vcoll, seq);
    } else {
      snprintf(what, sizeof what, "rank %d says '%.60s'", ranks[i], v);
    }
    any_missing = 1;
    lm += (size_t)snprintf(missing + lm, lm < sizeof missing ? sizeof missing - lm : 0, "%s%s", lm ? ", " : "", what);
    if (lm >= sizeof missing) lm = sizeof missing - 1;
  }
  for (int i = 0; i < m; i++) {
    free(keys[i]);
    dlua_store_free_value(vals[i]);
  }
  free(ranks);
  free(keys);
  free(exists);
  free(vals);

  char head[600];
  int at_site = w->site[0] != 0;
  if (w->kind == K_SEND || w->kind == K_RECV)
    snprintf(head, sizeof head, "%s %s rank %d (tag %d, %s%s%s, after collective #%" PRId64 ")", coll,
             w->kind == K_SEND ? "to" : "from", w->peer, w->tag, w->desc, at_site ? " at " : "", w->site, w->seq);
  else
    snprintf(head, sizeof head, "%s #%" PRId64 "%s%s%s%s", coll, w->seq, w->kind == K_BARRIER ? "" : " on ",
             w->kind == K_BARRIER ? "" : w->desc, at_site ? " at " : "", w->site);
  dlua_status_t st = DLUA_ERR_TIMEOUT;
  if (r == DLUA_GLOO_OTHER || (r != DLUA_GLOO_TIMEOUT && any_exited)) st = DLUA_ERR_BACKEND;
  /* this rank's failure, if it follows, is a consequence: the launcher blames the peer's */
  if (r == DLUA_GLOO_IO || any_exited) dlua_launch_note_peer_lost();
  char how[200];
  if (r == DLUA_GLOO_TIMEOUT)
    snprintf(how, sizeof how, "timed out after %" PRId64 " ms", timeout_ms);
  else if (r == DLUA_GLOO_IO)
    snprintf(how, sizeof how, "failed: a peer closed its connection");
  else
    snprintf(how, sizeof how, "failed");
  char tail[1400];
  if (any_missing)
    snprintf(tail, sizeof tail, "; not arrived: %s%s%s", missing,
             la ? (strchr(arrived, ',') ? "; arrived: ranks " : "; arrived: rank ") : "", arrived);
  else if (w->kind == K_SEND || w->kind == K_RECV)
    tail[0] = '\0';
  else
    snprintf(tail, sizeof tail, "; every rank arrived%s%s", la ? " (" : "", la ? "they failed too)" : "");
  if (!store_ok) snprintf(tail + strlen(tail), sizeof tail - strlen(tail), "; the store is unreachable, so the other ranks' positions are unknown");
  if (r == DLUA_GLOO_OTHER || (!any_missing && r != DLUA_GLOO_TIMEOUT))
    work_set(w, st, "%s %s on rank %d of group %s%s (gloo: %.300s)", head, how, pg->rank, pg->name, tail, gloo_msg);
  else
    work_set(w, st, "%s %s on rank %d of group %s%s", head, how, pg->rank, pg->name, tail);
}

/* ---- running one work on the comm thread ------------------------------------------------------- */

/* Debug mode's fingerprint: what this rank is about to call, in a fixed 256 bytes. */
typedef struct {
  char coll[16];
  int32_t dtype, op, root, ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  uint64_t extra;          /* all_gather: a hash of the output numels */
  char site[152];
} pg_fingerprint_t;
_Static_assert(sizeof(pg_fingerprint_t) == 256, "fingerprint is 256 bytes");

static void fingerprint(const dlua_pg_t *pg, const dlua_work_t *w, pg_fingerprint_t *f) {
  memset(f, 0, sizeof *f);
  snprintf(f->coll, sizeof f->coll, "%s", kind_names[w->kind]);
  f->dtype = -1;
  f->op = w->kind == K_ALL_REDUCE || w->kind == K_REDUCE_SCATTER ? (int32_t)w->op : -1;
  f->root = w->kind == K_BROADCAST ? w->peer : -1;
  const dlua_tensor_t *t = w->t;
  if (!t && w->ins) t = w->ins[w->kind == K_ALL_REDUCE_MANY ? 0 : pg->rank];
  if (t) {
    f->dtype = t->dtype;
    f->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) f->sizes[d] = t->sizes[d];
  }
  if (w->kind == K_ALL_GATHER || w->kind == K_ALL_REDUCE_MANY) {  // every output's / tensor's numel
    dlua_tensor_t *const *list = w->kind == K_ALL_GATHER ? w->outs : w->ins;
    uint64_t h = 1469598103934665603ull;
    for (int r = 0; r < w->nlist; r++) h = (h ^ (uint64_t)dlua_tensor_numel(list[r])) * 1099511628211ull;
    f->extra = h;
  }
  snprintf(f->site, sizeof f->site, "%s", w->site);
}

static int shape_must_match(int kind) { return kind == K_ALL_REDUCE || kind == K_BROADCAST || kind == K_REDUCE_SCATTER; }

static int fingerprints_agree(const pg_fingerprint_t *a, const pg_fingerprint_t *b, int kind) {
  if (strcmp(a->coll, b->coll) || a->dtype != b->dtype || a->op != b->op || a->root != b->root || a->extra != b->extra)
    return 0;
  if (!shape_must_match(kind)) return 1;
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->sizes[d] != b->sizes[d]) return 0;
  return 1;
}

/* All ranks compare what they are about to call; 0: agreed (or failed: w->status says). */
static int debug_check(dlua_pg_t *pg, dlua_work_t *w, int64_t timeout) {
  pg_fingerprint_t mine, *all = calloc((size_t)pg->size, sizeof *all);
  if (!all) {
    work_set(w, DLUA_ERR_OOM, "%s #%" PRId64 ": out of memory for the debug check", kind_names[w->kind], w->seq);
    return 1;
  }
  fingerprint(pg, w, &mine);
  size_t *counts = calloc((size_t)pg->size, sizeof(size_t));
  for (int r = 0; counts && r < pg->size; r++) counts[r] = sizeof mine;
  char err[512];
  dlua_gloo_result_t gr = !counts ? DLUA_GLOO_OTHER
                          : pg->be ? pg->be->allgather_host(pg->be_ctx, &mine, all, sizeof mine, timeout, err, sizeof err)
                                   : dlua_gloo_allgatherv(pg->gloo, &mine, all, counts, 1, (uint32_t)(w->seq * 2 + 1),
                                                          timeout, err, sizeof err);
  if (!counts) snprintf(err, sizeof err, "out of memory");
  free(counts);
  if (gr != DLUA_GLOO_OK) {
    diagnose(pg, w, gr, err, timeout);
    free(all);
    return 2;
  }
  int agree = 1;
  for (int r = 0; r < pg->size; r++) agree &= fingerprints_agree(&all[r], &all[0], w->kind);
  if (agree) {
    free(all);
    return 0;
  }
  // Ops and roots are shown only when they are what differs, so the common case reads short.
  int show_op = 0, show_root = 0;
  for (int r = 0; r < pg->size; r++)
    for (int q = 0; q < r; q++) {
      show_op |= all[r].op >= 0 && all[q].op >= 0 && all[r].op != all[q].op;
      show_root |= all[r].root >= 0 && all[q].root >= 0 && all[r].root != all[q].root;
    }
  char list[PG_MSG - 100];
  size_t l = 0;
  for (int r = 0; r < pg->size && l < sizeof list; r++) {
    pg_fingerprint_t *f = &all[r];
    char shape[160] = "";
    if (f->dtype >= 0) {
      char s[140];
      snprintf(shape, sizeof shape, " %s %s", dlua_dtype_name((dlua_dtype_t)f->dtype),
               dlua_shape_str(f->ndim < 0 || f->ndim > DLUA_MAX_DIMS ? 0 : f->ndim, f->sizes, s, sizeof s));
    }
    char extra[48] = "";
    if (show_op && f->op >= 0 && f->op < DLUA_PG_REDUCE_COUNT) snprintf(extra, sizeof extra, " op %s", op_names[f->op]);
    if (show_root && f->root >= 0) snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " src %d", f->root);
    f->coll[sizeof f->coll - 1] = '\0';
    f->site[sizeof f->site - 1] = '\0';
    l += (size_t)snprintf(list + l, sizeof list - l, "%srank %d %s%s%s%s%s", r ? "; " : "", r, f->coll, shape, extra,
                          f->site[0] ? " at " : "", f->site);
  }
  work_set(w, DLUA_ERR_ARG, "collective mismatch at #%" PRId64 ": %s", w->seq, list);
  free(all);
  return 1;
}

/* Reduce-scatter as a ring over point-to-point exchanges: after size-1 steps, chunk `rank` of acc
   holds the reduction of every rank's ins[rank]. acc (size * m elements) is consumed. */
static dlua_gloo_result_t ring_reduce_scatter(dlua_pg_t *pg, char *acc, char *tmp, size_t m, size_t es,
                                              dlua_pg_reduce_fn fn, uint32_t tag, int64_t timeout, char *err,
                                              size_t errlen) {
  int n = pg->size, r = pg->rank;
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  int64_t deadline = now_ms() + timeout;
  for (int s = 0; s < n - 1; s++) {
    int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    int64_t left = deadline - now_ms();
    dlua_gloo_result_t gr = dlua_gloo_exchange(pg->gloo, acc + (size_t)send_idx * m * es, m * es, next, tmp, m * es,
                                               prev, PG_RING_PREFIX, tag, left > 0 ? left : 1, err, errlen);
    if (gr != DLUA_GLOO_OK) return gr;
    char *c = acc + (size_t)recv_idx * m * es;
    fn(c, c, tmp, m);
  }
  return DLUA_GLOO_OK;
}

static void mark_broken(dlua_pg_t *pg, const dlua_work_t *w) {
  pthread_mutex_lock(&pg->mu);
  if (!pg->broken) {
    pg->broken = 1;
    // The summary: the failure itself, up to the list of ranks.
    int n = (int)strcspn(w->msg, ";");
    snprintf(pg->broken_msg, sizeof pg->broken_msg, "%.*s", n < 600 ? n : 600, w->msg);
  }
  pthread_mutex_unlock(&pg->mu);
}

/* The group's stream for copies of cuda:dev tensors (created on first use). */
static dlua_cuda_stream_t *stage_stream(dlua_pg_t *pg, int dev) {
  if (dev < 0 || dev >= PG_MAX_CUDA) {
    DLUA_ERR(DLUA_ERR_ARG, "process group %s: cuda:%d is beyond the %d devices gloo stages for", pg->name, dev,
             PG_MAX_CUDA);
    return NULL;
  }
  pthread_mutex_lock(&pg->mu);
  dlua_cuda_stream_t *s = pg->stage_streams[dev];
  pthread_mutex_unlock(&pg->mu);
  if (s) return s;
  if (dlua_cuda_stream_create(&s, dev) != DLUA_OK) return NULL;
  pthread_mutex_lock(&pg->mu);
  if (pg->stage_streams[dev]) {  // the other thread won: keep one
    dlua_cuda_stream_t *won = pg->stage_streams[dev];
    pthread_mutex_unlock(&pg->mu);
    dlua_cuda_stream_destroy(s);
    return won;
  }
  pg->stage_streams[dev] = s;
  pthread_mutex_unlock(&pg->mu);
  return s;
}

/* A shared-memory collective's end as gloo's: a mismatch fails the work alike on every rank and leaves the
   group usable. */
static dlua_gloo_result_t from_shm(dlua_work_t *w, dlua_shm_result_t sr, const char *err) {
  if (sr == DLUA_SHM_MISMATCH) work_set(w, DLUA_ERR_ARG, "%s", err);
  return sr == DLUA_SHM_OK || sr == DLUA_SHM_MISMATCH ? DLUA_GLOO_OK
         : sr == DLUA_SHM_TIMEOUT                      ? DLUA_GLOO_TIMEOUT
                                                        : DLUA_GLOO_IO;
}

/* reduce_scatter's inputs packed into dst (rank r's at r * m elements); false (the work's error set) on failure. */
static int stage_parts(dlua_work_t *w, char *dst, size_t m, size_t es, dlua_cuda_stream_t *cs) {
  for (int r = 0; r < w->nlist; r++)
    if (copy_to_flat(w->ins[r], dst + (size_t)r * m * es, cs) != DLUA_OK) {
      work_from_last_error(w, "staging");
      return 0;
    }
  return 1;
}

/* all_reduce / broadcast of one tensor, in place when gloo can use its memory, else through a stage. */
static dlua_gloo_result_t gloo_one(dlua_pg_t *pg, dlua_work_t *w, dlua_tensor_t *t, int kind, dlua_cuda_stream_t *cs,
                                   uint32_t tag, int64_t timeout, char *err, size_t errlen) {
  size_t n = (size_t)dlua_tensor_numel(t), es = dlua_dtype_size(t->dtype);
  if (n == 0) return DLUA_GLOO_OK;
  char *buf = dlua_tensor_ptr(t);
  void *stage = NULL;
  if (!in_place(t)) {
    if (!(stage = st_alloc(w, n * es))) {
      work_set(w, DLUA_ERR_OOM, "%s #%" PRId64 ": out of memory staging %zu bytes", kind_names[w->kind], w->seq, n * es);
      return DLUA_GLOO_OK;
    }
    if (copy_to_flat(t, stage, cs) != DLUA_OK) {
      work_from_last_error(w, "staging");
      st_free(w, stage);
      return DLUA_GLOO_OK;
    }
    buf = stage;
  }
  dlua_gloo_result_t gr;
  if (kind == K_ALL_REDUCE && pg->shm)
    gr = from_shm(w, dlua_shm_all_reduce(pg->shm, buf, n, t->dtype, w->op, w->seq, timeout, err, errlen), err);
  else if (pg->shm)
    gr = from_shm(w, dlua_shm_broadcast(pg->shm, buf, n, t->dtype, w->peer, w->seq, timeout, err, errlen), err);
  else if (kind == K_ALL_REDUCE)
    gr = dlua_gloo_allreduce(pg->gloo, buf, n, es, dlua_pg_reduce_fn_for(w->op, t->dtype), tag, timeout, err, errlen);
  else
    gr = dlua_gloo_broadcast(pg->gloo, buf, n, es, w->peer, tag, timeout, err, errlen);
  if (gr == DLUA_GLOO_OK && kind == K_ALL_REDUCE && w->op == DLUA_PG_REDUCE_AVG && !pg->shm)
    dlua_pg_divide_by(buf, n, t->dtype, pg->size);
  int writes = kind == K_ALL_REDUCE || pg->rank != w->peer;
  if (gr == DLUA_GLOO_OK && w->status == DLUA_OK && stage && writes && copy_from_flat(t, stage, cs) != DLUA_OK)
    work_from_last_error(w, "writing back the staged result");
  st_free(w, stage);
  return gr;
}

static void run_work(dlua_pg_t *pg, dlua_work_t *w) {
  int64_t timeout = __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED);
  pthread_mutex_lock(&pg->mu);
  int broken = pg->broken;
  if (broken)
    work_set(w, DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", kind_names[w->kind], pg->name,
             pg->broken_msg);
  pthread_mutex_unlock(&pg->mu);
  if (broken) return;
  w->status = DLUA_OK;
  w->msg[0] = '\0';

  if (__atomic_load_n(&pg->debug, __ATOMIC_RELAXED) && w->kind != K_SEND && w->kind != K_RECV) {
    int d = debug_check(pg, w, timeout);
    if (d == 1) return;   // the ranks disagree: every rank fails alike, the group stays usable
    if (d == 2) goto broke;
  }

  char err[1024] = "";
  dlua_gloo_result_t gr = DLUA_GLOO_OK;
  if (pg->be) {
    gr = pg->be->run(pg->be_ctx, w, timeout, err, sizeof err);
    if (gr == DLUA_GLOO_OK) return;
    diagnose(pg, w, gr, err, timeout);
    goto broke;
  }

  uint32_t tag = (uint32_t)(w->seq * 2);
  int size = pg->size, rank = pg->rank;
  void *stage = NULL, *stage2 = NULL;
  static char dummy[8];  // a valid address for empty buffers
  dlua_cuda_stream_t *cs = NULL;  // CUDA tensors: copies wait for the caller's stream, then run on this one
  if (w->cuda_dev >= 0 && w->kind != K_SEND && w->kind != K_RECV) {
    if (!(cs = stage_stream(pg, w->cuda_dev)) ||
        (w->ready && dlua_cuda_stream_wait_event(cs, w->ready) != DLUA_OK)) {
      work_from_last_error(w, "staging CUDA tensors");
      return;
    }
  }

  switch (w->kind) {
    case K_SEND:
    case K_RECV: break;  // posted by the caller, waited on by the p2p thread
    case K_ALL_REDUCE:
    case K_BROADCAST: gr = gloo_one(pg, w, w->t, w->kind, cs, tag, timeout, err, sizeof err); break;
    case K_ALL_REDUCE_MANY:
      // gloo has no grouped calls: one ring after the other, under one sequence number
      for (int i = 0; i < w->nlist && gr == DLUA_GLOO_OK && w->status == DLUA_OK; i++)
        gr = gloo_one(pg, w, w->ins[i], K_ALL_REDUCE, cs, tag, timeout, err, sizeof err);
      break;
    case K_ALL_GATHER: {
      size_t es = dlua_dtype_size(w->t->dtype), total = 0;
      size_t *counts = malloc((size_t)size * sizeof(size_t));
      if (!counts) {
        work_set(w, DLUA_ERR_OOM, "all_gather #%" PRId64 ": out of memory", w->seq);
        return;
      }
      for (int r = 0; r < size; r++) total += counts[r] = (size_t)dlua_tensor_numel(w->outs[r]);
      if (total == 0) {
        free(counts);
        break;
      }
      char *out = packed_base(w->outs, size);
      char *in = in_place(w->t) ? dlua_tensor_ptr(w->t) : NULL;
      if (!out) out = stage = st_alloc(w, total * es);
      if (!in) {
        in = stage2 = st_alloc(w, counts[rank] * es + 1);
        if (in && copy_to_flat(w->t, in, cs) != DLUA_OK) {
          work_from_last_error(w, "staging");
          free(counts);
          break;
        }
      }
      if (!out || !in) {
        work_set(w, DLUA_ERR_OOM, "all_gather #%" PRId64 ": out of memory staging %zu bytes", w->seq, total * es);
        free(counts);
        break;
      }
      if (counts[rank] == 0) in = dummy;
      if (pg->shm)
        gr = from_shm(w, dlua_shm_all_gather(pg->shm, in, out, counts, w->t->dtype, w->seq, timeout, err, sizeof err),
                      err);
      else
        gr = dlua_gloo_allgatherv(pg->gloo, in, out, counts, es, tag, timeout, err, sizeof err);
      if (gr == DLUA_GLOO_OK && w->status == DLUA_OK && stage) {
        size_t off = 0;
        for (int r = 0; r < size && w->status == DLUA_OK; r++) {
          if (copy_from_flat(w->outs[r], (char *)stage + off * es, cs) != DLUA_OK)
            work_from_last_error(w, "writing back the staged result");
          off += counts[r];
        }
      }
      free(counts);
      break;
    }
    case K_REDUCE_SCATTER: {
      dlua_tensor_t *out = w->t;
      size_t m = (size_t)dlua_tensor_numel(out), es = dlua_dtype_size(out->dtype);
      if (m == 0) break;
      if (pg->shm) {  // reads the inputs where they lie when they are one flat buffer, writes out in place
        const char *in = cs ? NULL : packed_base(w->ins, size);
        char *dst = in_place(out) ? dlua_tensor_ptr(out) : NULL;
        if (!in) in = stage = st_alloc(w, (size_t)size * m * es);
        if (!dst) dst = stage2 = st_alloc(w, m * es);
        if (!in || !dst) {
          work_set(w, DLUA_ERR_OOM, "reduce_scatter #%" PRId64 ": out of memory staging %zu bytes", w->seq,
                   (size_t)(size + 1) * m * es);
          break;
        }
        if (stage && !stage_parts(w, stage, m, es, cs)) break;
        gr = from_shm(w, dlua_shm_reduce_scatter(pg->shm, in, dst, m, out->dtype, w->op, w->seq, timeout, err, sizeof err),
                      err);  // reduces and divides
        if (gr == DLUA_GLOO_OK && w->status == DLUA_OK && stage2 && copy_from_flat(out, dst, cs) != DLUA_OK)
          work_from_last_error(w, "writing the result");
        break;
      }
      char *acc = stage = st_alloc(w, (size_t)size * m * es);
      char *tmp = stage2 = st_alloc(w, m * es);
      if (!acc || !tmp) {
        work_set(w, DLUA_ERR_OOM, "reduce_scatter #%" PRId64 ": out of memory staging %zu bytes", w->seq,
                 (size_t)(size + 1) * m * es);
        break;
      }
      if (!stage_parts(w, acc, m, es, cs)) break;
      if (size > 1)
        gr = ring_reduce_scatter(pg, acc, tmp, m, es, dlua_pg_reduce_fn_for(w->op, out->dtype), tag, timeout, err,
                                 sizeof err);
      if (gr != DLUA_GLOO_OK) break;
      char *mine = acc + (size_t)rank * m * es;
      if (w->op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(mine, m, out->dtype, size);
      if (copy_from_flat(out, mine, cs) != DLUA_OK) work_from_last_error(w, "writing the result");
      break;
    }
    case K_ALL_TO_ALL: {
      size_t es = dlua_dtype_size(w->ins[0]->dtype), tin = 0, tout = 0;
      int64_t *ic = malloc((size_t)size * sizeof(int64_t)), *oc = malloc((size_t)size * sizeof(int64_t));
      if (!ic || !oc) {
        free(ic);
        free(oc);
        work_set(w, DLUA_ERR_OOM, "all_to_all #%" PRId64 ": out of memory", w->seq);
        return;
      }
      for (int r = 0; r < size; r++) {
        tin += (size_t)(ic[r] = dlua_tensor_numel(w->ins[r]));
        tout += (size_t)(oc[r] = dlua_tensor_numel(w->outs[r]));
      }
      char *in = tin ? packed_base(w->ins, size) : dummy;
      char *out = tout ? packed_base(w->outs, size) : dummy;
      if (!in) {
        in = stage2 = st_alloc(w, tin * es);
        size_t off = 0;
        for (int r = 0; in && r < size; off += (size_t)ic[r], r++)
          if (copy_to_flat(w->ins[r], in + off * es, cs) != DLUA_OK) {
            work_from_last_error(w, "staging");
            break;
          }
      }
      if (!out) out = stage = st_alloc(w, tout * es);
      if (w->status == DLUA_OK && (!in || !out))
        work_set(w, DLUA_ERR_OOM, "all_to_all #%" PRId64 ": out of memory staging", w->seq);
      if (w->status == DLUA_OK) {
        gr = dlua_gloo_alltoallv(pg->gloo, in, ic, out, oc, es, tag, timeout, err, sizeof err);
        if (gr == DLUA_GLOO_OK && stage) {
          size_t off = 0;
          for (int r = 0; r < size && w->status == DLUA_OK; r++) {
            if (copy_from_flat(w->outs[r], (char *)stage + off * es, cs) != DLUA_OK)
              work_from_last_error(w, "writing back the staged result");
            off += (size_t)oc[r];
          }
        }
      }
      free(ic);
      free(oc);
      break;
    }
    case K_BARRIER: gr = dlua_gloo_barrier(pg->gloo, tag, timeout, err, sizeof err); break;
  }
  st_free(w, stage);
  st_free(w, stage2);
  if (gr == DLUA_GLOO_OK) return;
  diagnose(pg, w, gr, err, timeout);
broke:
  mark_broken(pg, w);
}

/* ---- the comm thread ---------------------------------------------------------------------------- */

/* Publishes a finished work (or frees it, when its caller already let go). */
static void work_complete(dlua_pg_t *pg, dlua_work_t *w) {
  work_release_tensors(w);  // before `done`: the caller may free its memory once it sees done
  pthread_mutex_lock(&pg->mu);
  int detached = w->detached;
  if (!detached) __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&pg->cv_done);
  pthread_mutex_unlock(&pg->mu);
  if (detached) work_destroy(w);
}

/* Starts a thread that blocks every signal (so do the threads it starts: gloo's event loop), so
   Ctrl-C goes to the caller's thread and SIGPIPE from a dead peer's socket is never delivered. */
static int start_quiet_thread(pthread_t *th, void *(*fn)(void *), void *arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int e = pthread_create(th, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return e;
}

static void *comm_main(void *arg) {
  dlua_pg_t *pg = arg;
  char err[1024] = "";
  dlua_status_t store_status = DLUA_OK;
  dlua_gloo_result_t gr =
      pg->be ? pg->be->join(pg->be_ctx, pg->store, pg->name, pg->rank, pg->size, pg->timeout_ms, &store_status, err,
                            sizeof err)
             : dlua_gloo_connect(pg->store, pg->name, pg->bind_host, pg->iface, pg->rank, pg->size, pg->timeout_ms,
                                 &pg->gloo, &store_status, err, sizeof err);
  if (gr == DLUA_GLOO_OK && !pg->be)
    gr = dlua_shm_join(pg->store, pg->name, pg->rank, pg->size, pg->timeout_ms, &pg->shm, pg->transport_why,
                       sizeof pg->transport_why, &store_status, err, sizeof err);
  pthread_mutex_lock(&pg->mu);
  if (gr == DLUA_GLOO_OK) {
    pg->joined = 1;
  } else {
    pg->joined = -1;
    pg->join_status = store_status != DLUA_OK ? store_status
                      : gr == DLUA_GLOO_TIMEOUT ? DLUA_ERR_TIMEOUT
                                                : DLUA_ERR_BACKEND;
    char *loc = strstr(err, " (host/");
    if (loc) *loc = '\0';
    snprintf(pg->join_msg, sizeof pg->join_msg, "%s", err);
  }
  pthread_cond_broadcast(&pg->cv_done);
  pthread_mutex_unlock(&pg->mu);
  if (gr != DLUA_GLOO_OK) return NULL;

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
    dlua_gloo_result_t gr = dlua_gloo_p2p_wait(w->p2p, timeout, err, sizeof err);
    if (gr != DLUA_GLOO_OK) {
      diagnose(pg, w, gr, err, timeout);
      mark_broken(pg, w);
    } else if (w->kind == K_RECV && w->stage) {
      dlua_cuda_stream_t *cs = w->cuda_dev >= 0 ? stage_stream(pg, w->cuda_dev) : NULL;
      if ((w->cuda_dev >= 0 && !cs) || copy_from_flat(w->t, w->stage, cs) != DLUA_OK)
        work_from_last_error(w, "writing back the staged result");
    }
    dlua_gloo_p2p_free(w->p2p);
    w->p2p = NULL;
    st_free(w, w->stage);
    w->stage = NULL;
    work_complete(pg, w);
  }
  return NULL;
}

/* ---- public API ------------------------------------------------------------------------------- */

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

dlua_status_t dlua_pg_gloo_new(const char *store_host, int store_port, const char *token, const char *name, int rank,
                               int size, int64_t timeout_ms, dlua_pg_t **out) {
  return dlua_pg_new_with_backend(store_host, store_port, token, name, rank, size, timeout_ms, NULL, NULL, out);
}

dlua_status_t dlua_pg_new_with_backend(const char *store_host, int store_port, const char *token, const char *name,
                                       int rank, int size, int64_t timeout_ms, const dlua_pg_backend_t *be, void *ctx,
                                       dlua_pg_t **out) {
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
  const char *ifname = getenv("GLOO_SOCKET_IFNAME");
  if (ifname) snprintf(pg->iface, sizeof pg->iface, "%s", ifname);
  local_address_towards(store_host, store_port, pg->bind_host, sizeof pg->bind_host);
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
  // The comm thread creates the gloo device, so gloo's event-loop thread inherits its signal mask.
  int e = start_quiet_thread(&pg->thread, comm_main, pg);
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
    dlua_gloo_destroy(pg->gloo);  // joined gloo, then failed to agree on shared memory
    dlua_store_close(pg->store);
    dlua_status_t js = pg->join_status;
    char msg[PG_MSG];
    snprintf(msg, sizeof msg, "%s", pg->join_msg);
    pg_destroy(pg);
    return drop_backend(be, ctx,
                        DLUA_ERR(js, "process group %s: rank %d of %d could not join within %" PRId64 " ms: %s", name,
                                 rank, size, timeout_ms, msg));
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
  if (pg->store && !broken) {
    char key[PG_NAME + 32], val[64];
    at_key(key, sizeof key, pg, pg->rank);
    snprintf(val, sizeof val, "exited after %" PRId64, seq);
    dlua_store_set_timeout(pg->store, 2000);
    dlua_store_set(pg->store, key, val, strlen(val));
  }
  if (pg->be) {
    pthread_mutex_lock(&pg->mu);
    broken = pg->broken;  // a queued work may have failed while the comm thread drained the queue
    pthread_mutex_unlock(&pg->mu);
    pg->be->close(pg->be_ctx, broken);
  }
  for (int d = 0; d < PG_MAX_CUDA; d++) dlua_cuda_stream_destroy(pg->stage_streams[d]);
  dlua_shm_close(pg->shm);
  dlua_gloo_destroy(pg->gloo);
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
    work_destroy(w);
    return;
  }
  dlua_pg_t *pg = w->pg;
  pthread_mutex_lock(&pg->mu);
  int done = __atomic_load_n(&w->done, __ATOMIC_ACQUIRE);
  if (!done) w->detached = 1;
  pthread_mutex_unlock(&pg->mu);
  if (done) work_destroy(w);
}

/* ---- issuing ------------------------------------------------------------------------------------ */

static dlua_status_t check_tensor(const dlua_pg_t *pg, const char *op, const char *what, const dlua_tensor_t *t) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL (freed, or never created)", op, what);
  if (pg->be) return DLUA_OK;  // the backend checks devices when the work is prepared
  if (t->device != DLUA_CPU && !dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: gloo stages cuda:%d tensors through pinned host memory, and %s is not contiguous (CUDA "
                    "strided copies are not built yet: pass t:contiguous())",
                    op, t->device, what);
  return DLUA_OK;
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
                        kind_names[w->kind], w->cuda_dev, d);
      w->cuda_dev = d;
    }
  return DLUA_OK;
}

/* On the caller's thread, as a work is queued: what only this thread knows. gloo: an event on the
   caller's current stream of the CUDA tensors' device, which the staging copies wait for; so the
   copies see every kernel the caller queued before the call, as NCCL's stream ordering does. */
static dlua_status_t work_prepare(dlua_pg_t *pg, dlua_work_t *w) {
  DLUA_TRY(work_find_device(w));
  if (pg->be) return pg->be->prepare(pg->be_ctx, w);
  if (w->cuda_dev < 0) return DLUA_OK;
  w->pinned = 1;
  if (w->kind == K_SEND || w->kind == K_RECV) return DLUA_OK;  // staged on the caller's thread
  DLUA_TRY(dlua_cuda_event_create(&w->ready, w->cuda_dev, 0));
  return dlua_cuda_event_record(w->ready, NULL);
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

static dlua_work_t *work_new(dlua_pg_t *pg, int kind, const char *site) {
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

static void describe(dlua_work_t *w, const dlua_tensor_t *t) {
  char s[140];
  snprintf(w->desc, sizeof w->desc, "%s %s", dlua_shape_str(t->ndim, t->sizes, s, sizeof s), dlua_dtype_name(t->dtype));
}

/* Takes handles on the caller's tensors so that they live until the work completes. */
static dlua_status_t hold_list(dlua_work_t *w, dlua_tensor_t ***dst, dlua_tensor_t *const *src) {
  int n = w->nlist;
  *dst = calloc((size_t)n, sizeof(dlua_tensor_t *));
  if (!*dst) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", kind_names[w->kind]);
  for (int r = 0; r < n; r++)
    if (!((*dst)[r] = dlua_tensor_alias(src[r]))) return DLUA_ERR_OOM;
  return DLUA_OK;
}

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

/* Queues w (synchronously waits for it when work is NULL). Takes w in every case. */
static dlua_status_t submit(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work) {
  dlua_status_t ps = work_prepare(pg, w);
  if (ps != DLUA_OK) {
    work_destroy(w);
    return ps;
  }
  pthread_mutex_lock(&pg->mu);
  if (pg->broken) {
    char m[sizeof pg->broken_msg];
    snprintf(m, sizeof m, "%s", pg->broken_msg);
    pthread_mutex_unlock(&pg->mu);
    dlua_status_t s =
        DLUA_ERR(DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", kind_names[w->kind], pg->name, m);
    work_destroy(w);
    return s;
  }
  w->seq = (w->kind == K_SEND || w->kind == K_RECV) ? pg->seq : ++pg->seq;
  if (pg->tail)
    pg->tail->next = w;
  else
    pg->head = w;
  pg->tail = w;
  pthread_cond_broadcast(&pg->cv_queue);
  pthread_mutex_unlock(&pg->mu);
  return hand_back_or_wait(w, work);
}

#define PG_PROLOGUE(opname)                                                          \
  if (work) *work = NULL;                                                            \
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "%s: the process group is NULL", opname)

dlua_status_t dlua_pg_all_reduce(dlua_pg_t *pg, dlua_tensor_t *t, dlua_reduce_t op, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("all_reduce");
  DLUA_TRY(check_tensor(pg, "all_reduce", "the tensor", t));
  DLUA_TRY(check_op("all_reduce", op, t->dtype));
  dlua_work_t *w = work_new(pg, K_ALL_REDUCE, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    work_destroy(w);
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
  dlua_work_t *w = work_new(pg, K_ALL_REDUCE_MANY, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  w->nlist = n;
  snprintf(w->desc, sizeof w->desc, "%d tensor%s, %" PRId64 " elements%s%s", n, n == 1 ? "" : "s", total,
           n ? " of " : "", n ? dlua_dtype_name(ts[0]->dtype) : "");
  if (n > 0 && hold_list(w, &w->ins, ts) != DLUA_OK) {
    work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_broadcast(dlua_pg_t *pg, dlua_tensor_t *t, int src, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("broadcast");
  DLUA_TRY(check_tensor(pg, "broadcast", "the tensor", t));
  DLUA_TRY(check_rank(pg, "broadcast", "src", src));
  dlua_work_t *w = work_new(pg, K_BROADCAST, site);
  if (!w) return DLUA_ERR_OOM;
  w->peer = src;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    work_destroy(w);
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
  dlua_work_t *w = work_new(pg, K_ALL_GATHER, site);
  if (!w) return DLUA_ERR_OOM;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t)) || hold_list(w, &w->outs, outs) != DLUA_OK) {
    work_destroy(w);
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
    if (dlua_tensor_numel(ins[r]) != dlua_tensor_numel(out))
      return DLUA_ERR(DLUA_ERR_ARG, "reduce_scatter: ins[%d] has %" PRId64 " elements, out has %" PRId64, r,
                      dlua_tensor_numel(ins[r]), dlua_tensor_numel(out));
  }
  dlua_work_t *w = work_new(pg, K_REDUCE_SCATTER, site);
  if (!w) return DLUA_ERR_OOM;
  w->op = op;
  describe(w, out);
  if (!(w->t = dlua_tensor_alias(out)) || hold_list(w, &w->ins, ins) != DLUA_OK) {
    work_destroy(w);
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
  dlua_work_t *w = work_new(pg, K_ALL_TO_ALL, site);
  if (!w) return DLUA_ERR_OOM;
  snprintf(w->desc, sizeof w->desc, "%s, %" PRId64 " elements sent", dlua_dtype_name(ins[0]->dtype), sent);
  if (hold_list(w, &w->outs, outs) != DLUA_OK || hold_list(w, &w->ins, ins) != DLUA_OK) {
    work_destroy(w);
    return DLUA_ERR_OOM;
  }
  return submit(pg, w, work);
}

dlua_status_t dlua_pg_barrier(dlua_pg_t *pg, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("barrier");
  dlua_work_t *w = work_new(pg, K_BARRIER, site);
  if (!w) return DLUA_ERR_OOM;
  snprintf(w->desc, sizeof w->desc, "no tensor");
  return submit(pg, w, work);
}

/* send/recv do not queue behind collectives: they are posted here, at once and in call order (as
   torch.distributed's gloo does), and a separate thread waits for them. So a rank may post several
   and its peers may match them in any order (isend + irecv both ways, pipelines). */
static dlua_status_t p2p(dlua_pg_t *pg, int kind, const dlua_tensor_t *t, int peer, int tag, const char *site,
                         dlua_work_t **work) {
  const char *op = kind_names[kind];
  const char *who = kind == K_SEND ? "dst" : "src";
  DLUA_TRY(check_tensor(pg, op, "the tensor", t));
  DLUA_TRY(check_rank(pg, op, who, peer));
  if (peer == pg->rank) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s %d is this rank", op, who, peer);
  if (tag < 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: tag %d is negative", op, tag);
  dlua_work_t *w = work_new(pg, kind, site);
  if (!w) return DLUA_ERR_OOM;
  w->peer = peer;
  w->tag = tag;
  describe(w, t);
  if (!(w->t = dlua_tensor_alias(t))) {
    work_destroy(w);
    return DLUA_ERR_OOM;
  }
  // Another backend (NCCL) orders send/recv on its stream with the collectives: queued like them.
  if (pg->be) return submit(pg, w, work);
  if (work_prepare(pg, w) != DLUA_OK) {
    dlua_status_t s = dlua_last_status();
    work_destroy(w);
    return s;
  }
  pthread_mutex_lock(&pg->mu);
  int broken = pg->broken;
  char bm[sizeof pg->broken_msg];
  snprintf(bm, sizeof bm, "%s", pg->broken_msg);
  w->seq = pg->seq;
  pthread_mutex_unlock(&pg->mu);
  if (broken) {
    work_destroy(w);
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: process group %s is unusable after %s", op, pg->name, bm);
  }
  size_t bytes = tbytes(t);
  void *ptr = dlua_tensor_ptr(t);
  if (bytes && !in_place(t)) {
    if (!(w->stage = st_alloc(w, bytes))) {
      work_destroy(w);
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory staging %zu bytes", op, bytes);
    }
    // A CUDA tensor is read here, after the caller's stream has produced it.
    dlua_cuda_stream_t *cs = t->device != DLUA_CPU ? dlua_cuda_current_stream(t->device) : NULL;
    if (kind == K_SEND && copy_to_flat(t, w->stage, cs) != DLUA_OK) {
      work_destroy(w);
      return dlua_last_status();
    }
    ptr = w->stage;
  }
  if (bytes) {
    // gloo may write to the socket from this thread: a peer that just died must not SIGPIPE us.
    sigset_t pipe_set, old;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    char err[1024] = "";
    dlua_gloo_result_t gr = dlua_gloo_p2p_post(pg->gloo, ptr, bytes, peer, kind == K_SEND, PG_P2P_PREFIX,
                                               (uint32_t)tag, &w->p2p, err, sizeof err);
    struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_set, NULL, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (gr != DLUA_GLOO_OK) {
      diagnose(pg, w, gr, err, __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED));
      mark_broken(pg, w);
      dlua_status_t s = DLUA_ERR(w->status, "%s", w->msg);
      work_destroy(w);
      return s;
    }
  }
  pthread_mutex_lock(&pg->mu);
  if (!bytes) {
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);  // nothing to move
  } else {
    if (!pg->has_p2p_thread) {
      if (start_quiet_thread(&pg->p2p_thread, p2p_main, pg) != 0) {
        pthread_mutex_unlock(&pg->mu);
        // the transfer is posted and cannot be withdrawn: wait for it here instead
        char err[1024];
        dlua_gloo_result_t gr = dlua_gloo_p2p_wait(w->p2p, pg->timeout_ms, err, sizeof err);
        if (gr == DLUA_GLOO_OK && kind == K_RECV && w->stage)
          copy_from_flat(w->t, w->stage, w->cuda_dev >= 0 ? dlua_cuda_current_stream(w->cuda_dev) : NULL);
        work_destroy(w);
        return gr == DLUA_GLOO_OK ? DLUA_OK : DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s", op, err);
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

dlua_status_t dlua_pg_send(dlua_pg_t *pg, const dlua_tensor_t *t, int dst, int tag, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("send");
  return p2p(pg, K_SEND, t, dst, tag, site, work);
}

dlua_status_t dlua_pg_recv(dlua_pg_t *pg, dlua_tensor_t *t, int src, int tag, const char *site, dlua_work_t **work) {
  PG_PROLOGUE("recv");
  return p2p(pg, K_RECV, t, src, tag, site, work);
}

const char *dlua_pg_backend(const dlua_pg_t *pg) { return !pg ? "" : pg->be ? pg->be->name : "gloo"; }
dlua_status_t dlua_pg_shared_zeros(dlua_pg_t *pg, dlua_dtype_t dtype, int64_t numel, dlua_tensor_t **out,
                                   const char **why) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: out is NULL");
  *out = NULL;
  if (why) *why = "";
  if (!pg) return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: the group is NULL");
  if (numel < 0 || (int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "shared_zeros: bad size %" PRId64 " or dtype %d", numel, (int)dtype);
  if (!pg->shm) {
    if (why) *why = pg->be ? "the group is not a gloo group" : pg->transport_why;
    return DLUA_OK;
  }
  pthread_mutex_lock(&pg->mu);
  int64_t id = ++pg->regions;
  pthread_mutex_unlock(&pg->mu);
  int64_t timeout = __atomic_load_n(&pg->timeout_ms, __ATOMIC_RELAXED);
  dlua_store_t *st = NULL;
  DLUA_TRY(dlua_store_connect(pg->store_host, pg->store_port, pg->token, timeout, &st));
  void *p = NULL, *handle = NULL;
  size_t bytes = (size_t)numel * dlua_dtype_size(dtype);
  dlua_status_t s = dlua_shm_region_new(pg->shm, st, pg->name, id, bytes, timeout, &p, &handle, pg->region_why,
                                        sizeof pg->region_why);
  dlua_store_close(st);
  if (why) *why = pg->region_why;
  if (s != DLUA_OK || !p) return s;
  int64_t n = numel;
  s = dlua_tensor_wrap(out, 1, &n, NULL, dtype, p, dlua_shm_region_free, handle);
  if (s != DLUA_OK) dlua_shm_region_free(handle, p);
  return s;
}

const char *dlua_pg_transport(const dlua_pg_t *pg, const char **why) {
  if (why) *why = pg && !pg->be ? pg->transport_why : "";
  return !pg ? "" : pg->be ? pg->be->name : pg->shm ? "shm" : "tcp";
}
const char *dlua_pg_kind_name(int kind) {
  return kind >= 0 && kind < (int)(sizeof kind_names / sizeof kind_names[0]) ? kind_names[kind] : "?";
}

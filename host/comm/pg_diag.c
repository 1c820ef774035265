/* Process groups' diagnostics: where every rank is when a collective fails (and whom the launcher blames), the debug-mode check. */
#define _GNU_SOURCE
#include "comm/pg_diag.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/flight_agent.h"
#include "comm/launch.h"
#include "comm/pg.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

enum { PG_DIAG_MS = 2000 };  /* how long a failed rank listens for the others' positions */

static const char *const op_names[] = {"sum", "avg", "max", "min", "product"};

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- failure diagnostics ------------------------------------------------------------------------ */

static void at_key(char *buf, size_t n, const dlua_pg_t *pg, int rank) { snprintf(buf, n, "%s/at/%d", pg->name, rank); }

void dlua_pg_diagnose(dlua_pg_t *pg, dlua_work_t *w, dlua_pg_result_t r, const char *be_msg, int64_t timeout_ms) {
  /* a hang: every rank's flight recorder, while the ranks are still where they hung */
  if (r == DLUA_PG_TIMEOUT) dlua_agent_request_job_dump("timeout");
  char key[PG_NAME + 32], val[PG_SITE + 64];
  const char *coll = dlua_pg_kind_name(w->kind);
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
  if (ranks && keys && exists && vals && r != DLUA_PG_MISMATCH) {
    for (int q = 0; q < n; q++) {
      if (q == pg->rank) continue;
      if ((w->kind == K_SEND || w->kind == K_RECV) && q != w->peer) continue;
      keys[m] = malloc(PG_NAME + 32);
      if (!keys[m]) break;
      at_key(keys[m], PG_NAME + 32, pg, q);
      ranks[m++] = q;
    }
    /* Each position is read as soon as it appears: outside dlua's launcher rank 0 serves the store, and once its
       own diagnosis is over it exits, taking the store with it, before a later rank's window ends. */
    int64_t end = now_ms() + PG_DIAG_MS;
    while (store_ok) {
      if (dlua_store_check(pg->store, (const char *const *)keys, m, exists) != DLUA_OK) break;
      int all = 1;
      for (int i = 0; i < m; i++) {
        size_t len;
        void *v = NULL;
        if (exists[i] && !vals[i] && dlua_store_get(pg->store, keys[i], 0, &v, &len) == DLUA_OK) vals[i] = v;
        all &= vals[i] != NULL;
      }
      if (all || now_ms() >= end) break;
      sleep_ms(100);
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
  if (r == DLUA_PG_FAILED || r == DLUA_PG_MISMATCH || (r != DLUA_PG_TIMEOUT && any_exited)) st = DLUA_ERR_BACKEND;
  /* this rank's failure, if it follows, is a consequence: the launcher blames the peer's */
  if (r == DLUA_PG_PEER_LOST || any_exited) dlua_launch_note_peer_lost();
  char how[200];
  if (r == DLUA_PG_TIMEOUT)
    snprintf(how, sizeof how, "timed out after %" PRId64 " ms", timeout_ms);
  else if (r == DLUA_PG_PEER_LOST)
    snprintf(how, sizeof how, "failed: a peer closed its connection");
  else
    snprintf(how, sizeof how, "failed");
  char tail[1400];
  if (r == DLUA_PG_MISMATCH)
    tail[0] = '\0';
  else if (any_missing)
    snprintf(tail, sizeof tail, "; not arrived: %s%s%s", missing,
             la ? (strchr(arrived, ',') ? "; arrived: ranks " : "; arrived: rank ") : "", arrived);
  else if (w->kind == K_SEND || w->kind == K_RECV)
    tail[0] = '\0';
  else
    snprintf(tail, sizeof tail, "; every rank arrived%s%s", la ? " (" : "", la ? "they failed too)" : "");
  if (!store_ok && r != DLUA_PG_MISMATCH) snprintf(tail + strlen(tail), sizeof tail - strlen(tail), "; the store is unreachable, so the other ranks' positions are unknown");
  if (r == DLUA_PG_FAILED || r == DLUA_PG_MISMATCH || (!any_missing && r != DLUA_PG_TIMEOUT))
    dlua_pg_work_set(w, st, "%s %s on rank %d of group %s%s (%s: %.300s)", head, how, pg->rank, pg->name, tail,
                     pg->be->name, be_msg);
  else
    dlua_pg_work_set(w, st, "%s %s on rank %d of group %s%s", head, how, pg->rank, pg->name, tail);
}

/* Peers that fail later read this and say "rank r exited after N collectives". */
void dlua_pg_diag_note_exit(dlua_pg_t *pg, int64_t seq) {
  char key[PG_NAME + 32], val[64];
  at_key(key, sizeof key, pg, pg->rank);
  snprintf(val, sizeof val, "exited after %" PRId64, seq);
  dlua_store_set_timeout(pg->store, 2000);
  dlua_store_set(pg->store, key, val, strlen(val));
}

/* ---- debug mode --------------------------------------------------------------------------------- */

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
  snprintf(f->coll, sizeof f->coll, "%s", dlua_pg_kind_name(w->kind));
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

int dlua_pg_debug_check(dlua_pg_t *pg, dlua_work_t *w, int64_t timeout) {
  pg_fingerprint_t mine, *all = calloc((size_t)pg->size, sizeof *all);
  if (!all) {
    dlua_pg_work_set(w, DLUA_ERR_OOM, "%s #%" PRId64 ": out of memory for the debug check", dlua_pg_kind_name(w->kind),
                     w->seq);
    return 1;
  }
  fingerprint(pg, w, &mine);
  char err[512];
  dlua_pg_result_t gr = pg->be->allgather_host(pg->be_ctx, w->seq, &mine, all, sizeof mine, timeout, err, sizeof err);
  if (gr != DLUA_PG_OK) {
    dlua_pg_diagnose(pg, w, gr, err, timeout);
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
  dlua_pg_work_set(w, DLUA_ERR_ARG, "collective mismatch at #%" PRId64 ": %s", w->seq, list);
  free(all);
  return 1;
}

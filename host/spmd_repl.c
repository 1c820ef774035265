/* The SPMD REPL of `dlua --nproc N -i`: the launcher reads chunks, every rank runs them. */
#include "spmd_repl.h"

#include <lauxlib.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/api.h"
#include "lua_state.h"
#include "repl.h"

typedef struct {
  dlua_job_t *job;
  dlua_store_t *store;
  int world;
  long seq;      /* chunks sent so far */
  int job_ended; /* a rank died: the session is over */
} frontend_t;

/* "0-3", "0,2", "0-1,3": the ranks whose output was identical. */
static void rank_label(const int *ranks, int n, char *out, size_t cap) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < n && used + 24 < cap;) {
    int j = i;
    while (j + 1 < n && ranks[j + 1] == ranks[j] + 1) j++;
    if (j > i)
      used += (size_t)snprintf(out + used, cap - used, "%s%d-%d", i ? "," : "", ranks[i], ranks[j]);
    else
      used += (size_t)snprintf(out + used, cap - used, "%s%d", i ? "," : "", ranks[i]);
    i = j + 1;
  }
}

static void print_tagged(FILE *f, const char *label, const char *text, size_t len) {
  if (len > 0 && text[len - 1] == '\n') len--;
  if (len == 0) return;
  size_t start = 0;
  for (size_t i = 0; i <= len; i++) {
    if (i == len || text[i] == '\n') {
      fprintf(f, "[%s] %.*s\n", label, (int)(i - start), text + start);
      start = i + 1;
    }
  }
  fflush(f);
}

/* Waits for the outputs of the ranks that ran chunk k; Ctrl-C meanwhile goes to the ranks. */
static int wait_outputs(frontend_t *fe, char **keys, int n) {
  for (;;) {
    dlua_status_t st = dlua_store_wait(fe->store, (const char *const *)keys, n, 200);
    if (st == DLUA_OK) return 0;
    if (st == DLUA_ERR_INTERRUPTED || dlua_interrupt_pending()) {
      dlua_interrupt_set(0);
      dlua_job_interrupt(fe->job);
      continue;
    }
    if (st != DLUA_ERR_TIMEOUT) {
      fprintf(stderr, "dlua: the SPMD REPL lost the job's store: %s\n", dlua_last_error());
      return -1;
    }
    dlua_clear_error();
    if (dlua_job_finished(fe->job)) return -1;  // a rank died: dlua_job_wait says which
  }
}

static int run_on_ranks(lua_State *L, const char *chunk, void *ctx) {
  (void)L;
  frontend_t *fe = ctx;
  const char *code = dlua_repl_code(chunk);
  int target = -1;
  if (code != chunk) {
    target = (int)strtol(strstr(chunk, ":on") + 3, NULL, 10);
    if (target >= fe->world) {
      fprintf(stderr, "dlua: ':on %d': the job has ranks 0..%d\n", target, fe->world - 1);
      return 0;
    }
  }
  fe->seq++;
  char key[96];
  snprintf(key, sizeof key, "dlua/repl/chunk/%ld", fe->seq);
  size_t clen = strlen(code);
  char *msg = malloc(clen + 32);
  if (msg == NULL) return 1;
  int hl = target < 0 ? snprintf(msg, 32, "all\n") : snprintf(msg, 32, "%d\n", target);
  memcpy(msg + hl, code, clen);
  if (dlua_store_set(fe->store, key, msg, (size_t)hl + clen) != DLUA_OK) {
    fprintf(stderr, "dlua: the SPMD REPL cannot reach the ranks: %s\n", dlua_last_error());
    free(msg);
    return 1;
  }
  free(msg);

  int n = target < 0 ? fe->world : 1;
  char **keys = calloc((size_t)n, sizeof *keys);
  char **vals = calloc((size_t)n, sizeof *vals);
  size_t *lens = calloc((size_t)n, sizeof *lens);
  int *ranks = calloc((size_t)n, sizeof *ranks);
  int *done = calloc((size_t)n, sizeof *done);
  int stop = 0;
  if (!keys || !vals || !lens || !ranks || !done) {
    stop = 1;
    goto out;
  }
  for (int i = 0; i < n; i++) {
    int r = target < 0 ? i : target;
    keys[i] = malloc(96);
    if (keys[i] == NULL) {
      stop = 1;
      goto out;
    }
    snprintf(keys[i], 96, "dlua/repl/out/%ld/%d", fe->seq, r);
  }
  if (wait_outputs(fe, keys, n) != 0) {
    fe->job_ended = 1;
    stop = 1;
    goto out;
  }
  for (int i = 0; i < n; i++) {
    if (dlua_store_get(fe->store, keys[i], 5000, (void **)&vals[i], &lens[i]) != DLUA_OK) {
      fprintf(stderr, "dlua: the SPMD REPL lost an output: %s\n", dlua_last_error());
      stop = 1;
      goto out;
    }
    dlua_store_delete(fe->store, keys[i], NULL);
  }
  /* identical outputs print once, tagged with every rank that gave them */
  for (int i = 0; i < n; i++) {
    if (done[i]) continue;
    int m = 0;
    for (int j = i; j < n; j++)
      if (!done[j] && lens[j] == lens[i] && memcmp(vals[j], vals[i], lens[i]) == 0) {
        ranks[m++] = target < 0 ? j : target;
        done[j] = 1;
      }
    char label[256];
    rank_label(ranks, m, label, sizeof label);
    const char *v = vals[i];
    int is_err = lens[i] >= 4 && memcmp(v, "err\n", 4) == 0;
    size_t skip = is_err ? 4 : (lens[i] >= 3 && memcmp(v, "ok\n", 3) == 0 ? 3 : 0);
    print_tagged(is_err ? stderr : stdout, label, v + skip, lens[i] - skip);
  }
out:
  if (keys)
    for (int i = 0; i < n; i++) free(keys[i]);
  if (vals)
    for (int i = 0; i < n; i++)
      if (vals[i]) dlua_store_free_value(vals[i]);
  free(keys);
  free(vals);
  free(lens);
  free(ranks);
  free(done);
  /* the chunk's key is removed by the last rank to read it (lua/dlua/spmd.lua): for ':on R' only rank R
     answers, and another rank may not have read the chunk yet */
  return stop;
}

int dlua_spmd_frontend(dlua_job_t *job) {
  frontend_t fe;
  memset(&fe, 0, sizeof fe);
  fe.job = job;
  fe.world = dlua_job_world_size(job);
  if (dlua_store_connect(dlua_job_store_host(job), dlua_job_store_port(job), dlua_job_token(job), 60000,
                         &fe.store) != DLUA_OK) {
    fprintf(stderr, "dlua: the SPMD REPL cannot reach the job's store: %s\n", dlua_last_error());
    return 1;
  }
  /* a Lua state only to tell complete chunks from unfinished ones, as the plain REPL does */
  lua_State *L = dlua_state_new();
  if (L == NULL) {
    dlua_store_close(fe.store);
    return 1;
  }
  if (isatty(STDIN_FILENO)) {
    printf("dlua SPMD REPL: %d ranks run every chunk; ':on R <chunk>' runs it on rank R only\n", fe.world);
    fflush(stdout);
  }
  /* SIGTERM/SIGHUP end the launcher at once (its ranks die with it: PR_SET_PDEATHSIG); the
     loop below blocks in reads that the launcher's counting handler would only restart. */
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  dlua_repl_loop(L, run_on_ranks, &fe);
  lua_close(L);
  dlua_launch_install_signals();  // the Lua state had taken over Ctrl-C for the prompt
  if (!fe.job_ended) {
    char key[96];
    snprintf(key, sizeof key, "dlua/repl/chunk/%ld", fe.seq + 1);
    dlua_store_set(fe.store, key, "exit\n", 5);
  }
  dlua_store_close(fe.store);
  return dlua_job_wait(job);
}

int dlua_spmd_serve(lua_State *L) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "dlua.spmd");
  int status = dlua_state_docall(L, 1, 1);
  if (status == 0) {
    lua_getfield(L, -1, "serve");
    lua_remove(L, -2);
    status = dlua_state_docall(L, 0, 0);
  }
  if (status) dlua_state_report(L, status);
  return status;
}

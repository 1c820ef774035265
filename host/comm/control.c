/* A running job's control page: memory the launcher shares with its ranks (a memfd), where each rank marks the steps it finished and finds the commands `dlua attach` sends. */
#define _GNU_SOURCE
#include "comm/control.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/api.h"

static const uint64_t MAGIC = 0x646c75612d63746cull; /* "dlua-ctl" */
enum { PENDING_WAIT_MS = 2000 };

static size_t page_bytes(int nproc) { return sizeof(dlua_control_t) + (size_t)nproc * sizeof(dlua_control_rank_t); }

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- the launcher's side --------------------------------------------------------------------- */

dlua_control_t *dlua_control_create(int nproc, int first_rank, int *fd) {
  *fd = -1;
  int f = memfd_create("dlua-control", MFD_CLOEXEC);
  if (f < 0) return NULL;
  size_t bytes = page_bytes(nproc);
  void *p = MAP_FAILED;
  if (ftruncate(f, (off_t)bytes) == 0) p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (p == MAP_FAILED) {
    close(f);
    return NULL;
  }
  dlua_control_t *c = p;
  c->nproc = nproc;
  c->first_rank = first_rank;
  c->cmd_target = -1;
  dlua_control_reset(c);
  c->magic = MAGIC;
  *fd = f;
  return c;
}

void dlua_control_reset(dlua_control_t *c) {
  for (int i = 0; i < c->nproc; i++) {
    atomic_store(&c->rank[i].step, -1);
    atomic_store(&c->rank[i].done_seq, atomic_load(&c->cmd_seq));
    atomic_store(&c->rank[i].ok, 1);
    c->rank[i].text[0] = '\0';
  }
}

void dlua_control_destroy(dlua_control_t *c) {
  if (c) munmap(c, page_bytes(c->nproc));
}

int64_t dlua_control_max_step(const dlua_control_t *c, int *all_started) {
  int64_t m = -1;
  int all = 1;
  for (int i = 0; i < c->nproc; i++) {
    int64_t s = atomic_load(&((dlua_control_t *)c)->rank[i].step);
    if (s < 0) all = 0;
    if (s > m) m = s;
  }
  if (all_started) *all_started = all;
  return m;
}

int64_t dlua_control_post(dlua_control_t *c, int target, const char *code, int64_t *at_step, char *err, size_t errlen) {
  if (target >= 0 && atomic_load(&c->rank[target].step) < 0) {
    snprintf(err, errlen, "rank %d has not reached a step boundary yet (chunks run there: the training loop calls "
             "dlua.monitor's step() after each step)", c->first_rank + target);
    return -1;
  }
  atomic_store(&c->pending, 1);
  int64_t at = -1;
  if (target < 0) {
    /* after `pending` is up no rank passes another boundary unseen: every rank is at most one step past
       what we read, and meets the command at its next boundary, at the latest the one after `at` */
    int all = 0;
    int64_t m = dlua_control_max_step(c, &all);
    if (!all) {
      atomic_store(&c->pending, 0);
      snprintf(err, errlen, "not every rank has reached a step boundary yet (commands run there: the training loop calls "
               "dlua.monitor's step() after each step)");
      return -1;
    }
    at = m + 1;
  }
  snprintf(c->cmd, sizeof c->cmd, "%s", code);
  c->cmd_target = target;
  c->cmd_step = at;
  int64_t seq = atomic_fetch_add(&c->cmd_seq, 1) + 1;
  atomic_store(&c->pending, 0);
  if (at_step) *at_step = at;
  return seq;
}

/* ---- a rank's side ----------------------------------------------------------------------------- */

static dlua_control_t *g_page;
static int g_li = -1;
static int64_t g_seen;        /* the last command this rank took */
static int64_t g_running;     /* the command it runs now (0: none) */

void dlua_control_rank_init(void) {
  const char *v = getenv("DLUA_CONTROL_FD");
  const char *lr = getenv("LOCAL_RANK");
  if (!v) return;
  int fd = atoi(v);
  unsetenv("DLUA_CONTROL_FD");
  struct stat st;
  if (fd <= 2 || !lr || fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(dlua_control_t)) return;
  fcntl(fd, F_SETFD, FD_CLOEXEC);
  void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return;
  dlua_control_t *c = p;
  int li = atoi(lr);
  if (c->magic != MAGIC || li < 0 || li >= c->nproc || (size_t)st.st_size < page_bytes(c->nproc)) {
    munmap(p, (size_t)st.st_size);
    return;
  }
  g_page = c;
  g_li = li;
  g_seen = atomic_load(&c->cmd_seq);  // a command of an earlier run of the job is not ours
}

int dlua_control_available(void) { return g_page != NULL; }

int dlua_control_boundary(int64_t step) {
  dlua_control_t *c = g_page;
  if (!c || g_running) return 0;
  atomic_store(&c->rank[g_li].step, step);
  for (int waited = 0; atomic_load(&c->pending) && waited < PENDING_WAIT_MS; waited++) sleep_ms(1);
  int64_t seq = atomic_load(&c->cmd_seq);
  if (seq == g_seen) return 0;
  int target = c->cmd_target;
  if (target >= 0 && target != g_li) {  // another rank's: nothing to do here
    g_seen = seq;
    atomic_store(&c->rank[g_li].done_seq, seq);
    return 0;
  }
  if (target < 0 && step < c->cmd_step) return 0;  // every rank's: at the agreed step
  g_running = seq;
  return 1;
}

const char *dlua_control_command(int *every_rank, int64_t *at_step) {
  dlua_control_t *c = g_page;
  if (!c || !g_running) return NULL;
  if (every_rank) *every_rank = c->cmd_target < 0;
  if (at_step) *at_step = c->cmd_step;
  return c->cmd;
}

void dlua_control_done(int ok, const char *text) {
  dlua_control_t *c = g_page;
  if (!c || !g_running) return;
  int64_t seq = g_running;
  dlua_control_rank_t *me = &c->rank[g_li];
  snprintf(me->text, sizeof me->text, "%s", text ? text : "");
  atomic_store(&me->ok, ok ? 1 : 0);
  if (c->cmd_target == g_li || (c->cmd_target < 0 && g_li == 0)) {
    snprintf(c->reply, sizeof c->reply, "%s", text ? text : "");
    atomic_store(&c->reply_seq, seq);
  }
  atomic_store(&me->done_seq, seq);
  g_seen = seq;
  g_running = 0;
}

/* A rank's flight-recorder agent: SIGUSR1 (or a timeout, or the launcher, or a peer's request file) makes it dump the ring with where the rank is. */
#define _GNU_SOURCE
#include "comm/flight_agent.h"

#include <errno.h>
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "comm/flight.h"
#include "comm/launch.h"
#include "comm/pg_worker.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/runtime.h"

enum {
  LUA_WAIT_MS = 1000,  /* how long the running Lua code has to answer (it answers at its next line) */
  CSTACK_WAIT_MS = 300,
  MAX_FRAMES = 48,
  TB_BYTES = 8192,
  REQUEST_GAP_S = 5,
  EXPECT_S = 2,         /* how long after asking the launcher for a dump its signal may take */
  POLL_MS = 200,        /* without a launcher: how often the agent looks for a peer's dump request */
  GATHER_MS = 2500,     /* ... and how long the rank that asked waits for every rank's dump */
  SAME_HANG_S = 10      /* a timeout this soon after a dump request is the same hang */
};

static int g_started;
static pthread_t g_main, g_thread;
static sem_t g_wake;                 /* posted by the signal handler and by requests */
static atomic_long g_pending_id;     /* the launcher's dump number (sigqueue's value), 0: none */
static atomic_int g_pending_timeout; /* a local request after a timeout */
static atomic_int g_busy;            /* a dump is being written */
static atomic_int g_exiting;         /* the main thread waits in dlua_agent_flush: it runs no Lua any more */
static _Atomic double g_expect_until; /* we asked the launcher for a dump: its signal may come until then */

/* Without a launcher (mpirun, srun, torchrun): a rank whose collective timed out writes DIR/flight-request
   (DIR: where the dumps go, which every rank must share for the diagnosis anyway); every rank's agent polls it. */
static int g_poll;                    /* this rank polls: no launcher, several ranks */
static int64_t g_seen_id;             /* the newest request handled (or found at start: an old job's) */
static double g_seen_at;              /* when (monotonic) */
static char *(*g_diagnose)(const char *dir, int first, int n, int64_t id);

static void (*g_lua_trigger)(void);
static atomic_int g_lua_want;
static sem_t g_lua_sem;
static pthread_mutex_t g_lua_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_lua_tb[TB_BYTES];

/* The main thread's registers and the top of its stack, copied by its own signal handler: unwinding there
   (backtrace()) may allocate (libgcc sorts the unwind tables LuaJIT registers for its machine code on first
   use), and the handler may have interrupted malloc. Copying memory is safe; the agent reads the copy. */
enum { STACK_COPY = 64 * 1024 };
static uintptr_t g_pc, g_sp;
static uintptr_t g_stack_lo, g_stack_hi;     /* the main thread's stack */
static unsigned char g_stack[STACK_COPY];
static volatile sig_atomic_t g_stack_len;
static sem_t g_bt_sem;

static void on_dump_signal(int sig, siginfo_t *si, void *uc) {
  (void)sig;
  (void)uc;
  int saved = errno;
  if (si && si->si_code == SI_QUEUE) atomic_store(&g_pending_id, (long)si->si_value.sival_int);
  sem_post(&g_wake);  // async-signal-safe
  errno = saved;
}

/* On the main thread, at the agent's request: where the C code is. */
static void on_stack_signal(int sig, siginfo_t *si, void *ucv) {
  (void)sig;
  (void)si;
  int saved = errno;
  ucontext_t *uc = ucv;
#if defined(__x86_64__)
  g_pc = (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
  g_sp = (uintptr_t)uc->uc_mcontext.gregs[REG_RSP];
#elif defined(__aarch64__)
  g_pc = (uintptr_t)uc->uc_mcontext.pc;
  g_sp = (uintptr_t)uc->uc_mcontext.sp;
#else
  (void)uc;
  g_pc = g_sp = 0;
#endif
  size_t n = 0;
  if (g_sp >= g_stack_lo && g_sp < g_stack_hi) {
    n = g_stack_hi - g_sp;
    if (n > STACK_COPY) n = STACK_COPY;
    memcpy(g_stack, (const void *)g_sp, n);
  }
  g_stack_len = (sig_atomic_t)n;
  sem_post(&g_bt_sem);
  errno = saved;
}

static int wait_sem(sem_t *s, int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  int r;
  while ((r = sem_timedwait(s, &ts)) != 0 && errno == EINTR) {
  }
  return r == 0;
}

void dlua_agent_set_lua(void (*trigger)(void)) { g_lua_trigger = trigger; }
int dlua_agent_lua_wanted(void) { return atomic_load(&g_lua_want); }

void dlua_agent_lua_where(const char *traceback) {
  pthread_mutex_lock(&g_lua_mu);
  if (atomic_exchange(&g_lua_want, 0)) {
    snprintf(g_lua_tb, sizeof g_lua_tb, "%s", traceback ? traceback : "");
    sem_post(&g_lua_sem);
  }
  pthread_mutex_unlock(&g_lua_mu);
}

/* The executable mappings of this process, for telling return addresses from other words. */
typedef struct {
  uintptr_t lo, hi;
} range_t;

static int text_ranges(range_t *out, int cap) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return 0;
  int n = 0;
  char line[512];
  while (n < cap && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    char perms[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && perms[2] == 'x') out[n++] = (range_t){lo, hi};
  }
  fclose(f);
  return n;
}

static const range_t *in_text(const range_t *r, int n, uintptr_t a) {
  for (int i = 0; i < n; i++)
    if (a >= r[i].lo && a < r[i].hi) return &r[i];
  return NULL;
}

/* Whether the instruction before `ret` is a call (x86-64: e8 rel32, or ff /2 through a register or memory). */
static int after_call(const range_t *r, uintptr_t ret) {
#if defined(__x86_64__)
  if (ret < r->lo + 7) return 0;
  const unsigned char *p = (const unsigned char *)ret;
  if (p[-5] == 0xe8) return 1;
  for (int k = 2; k <= 7; k++)
    if (p[-k] == 0xff && ((p[-k + 1] >> 3) & 7) == 2) return 1;
  return 0;
#else
  (void)r;
  (void)ret;
  return 1;
#endif
}

static void frame_name(uintptr_t a, char *out, size_t cap) {
  Dl_info info;
  if (dladdr((void *)a, &info) && info.dli_fname) {
    const char *slash = strrchr(info.dli_fname, '/');
    const char *file = slash ? slash + 1 : info.dli_fname;
    if (info.dli_sname)
      snprintf(out, cap, "%s+0x%lx (%s)", info.dli_sname, (unsigned long)(a - (uintptr_t)info.dli_saddr), file);
    else
      snprintf(out, cap, "0x%lx (%s+0x%lx)", (unsigned long)a, file, (unsigned long)(a - (uintptr_t)info.dli_fbase));
  } else {
    snprintf(out, cap, "0x%lx (JIT-compiled Lua code, or an unnamed mapping)", (unsigned long)a);
  }
}

/* The main thread's C stack, as text: the function it is in, then the return addresses found on its stack
   (a scan: a frame may be missing or stale, the first lines are the reliable ones). NULL: no answer. */
static char *c_stack(void) {
  g_stack_len = 0;
  while (sem_trywait(&g_bt_sem) == 0) {  // a stray SIGURG's answer (the kernel sends SIGURG for out-of-band data)
  }
  if (pthread_kill(g_main, SIGURG) != 0 || !wait_sem(&g_bt_sem, CSTACK_WAIT_MS)) return NULL;
  range_t ranges[256];
  int nr = text_ranges(ranges, 256);
  size_t cap = (size_t)MAX_FRAMES * 160 + 1, used = 0;
  char *text = malloc(cap);
  if (!text) return NULL;
  text[0] = '\0';
  char name[150], prev[150] = "";
  frame_name(g_pc, name, sizeof name);
  used += (size_t)snprintf(text + used, cap - used, "%s\n", name);
  int frames = 1;
  size_t len = (size_t)g_stack_len;
  for (size_t off = 0; off + sizeof(uintptr_t) <= len && frames < MAX_FRAMES; off += sizeof(uintptr_t)) {
    uintptr_t a;
    memcpy(&a, g_stack + off, sizeof a);
    const range_t *r = in_text(ranges, nr, a);
    if (!r || !after_call(r, a)) continue;
    frame_name(a - 1, name, sizeof name);  // the call instruction's address: its line, not the next one's
    if (!strcmp(name, prev)) continue;
    snprintf(prev, sizeof prev, "%s", name);
    used += (size_t)snprintf(text + used, cap - used, "%s\n", name);
    frames++;
    if (used >= cap - 1) break;
  }
  return text;
}

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void dump_now(const char *reason, long dump_id) {
  dlua_flight_where_t where = {"unknown", NULL, NULL};
  char *tb = NULL, *cs = NULL;
  if (atomic_load(&g_exiting)) {
    where.state = "exiting";  // its program failed; the main thread waits for this dump before it exits
  } else if (g_lua_trigger) {
    while (sem_trywait(&g_lua_sem) == 0) {  // a stale answer
    }
    atomic_store(&g_lua_want, 1);
    g_lua_trigger();
    int got = wait_sem(&g_lua_sem, LUA_WAIT_MS);
    pthread_mutex_lock(&g_lua_mu);
    atomic_store(&g_lua_want, 0);
    if (got) tb = strdup(g_lua_tb);
    pthread_mutex_unlock(&g_lua_mu);
  }
  if (tb) {
    where.state = "lua";
    where.traceback = tb;
  } else if (!atomic_load(&g_exiting) && (cs = c_stack()) != NULL) {
    where.state = "c";  // not at a Lua line within LUA_WAIT_MS: inside a C call (or a collective's wait)
    where.c_stack = cs;
  }
  if (dlua_flight_write(dlua_flight_default_dir(), reason, dump_id, &where) != DLUA_OK) {
    fprintf(stderr, "dlua: %s\n", dlua_last_error());
    dlua_clear_error();
  }
  free(tb);
  free(cs);
  char arg[32];
  snprintf(arg, sizeof arg, "%ld", dump_id);
  dlua_launch_notify("dumped", arg);
}

/* ---- the dump request without a launcher: the store and a file ------------------------------------ */

typedef struct {
  int64_t id;
  int rank;         /* who asked */
  double time;      /* when (wall clock) */
  char key[128];    /* the job (dlua_flight_job_key) */
  char reason[200];
} request_t;

static void request_path(char *out, size_t cap) { snprintf(out, cap, "%s/flight-request", dlua_flight_default_dir()); }

/* A request's line, "dlua.flight-request/1 ID RANK TIME KEY REASON...", if it is one of this job. */
static int request_parse(const char *line, request_t *q) {
  char key[128];
  int at = 0;
  if (sscanf(line, "dlua.flight-request/1 %" SCNd64 " %d %lf %127s %n", &q->id, &q->rank, &q->time, q->key, &at) < 4 ||
      at == 0)
    return 0;
  snprintf(q->reason, sizeof q->reason, "%.*s", (int)strcspn(line + at, "\n"), line + at);
  dlua_flight_job_key(key, sizeof key);
  return strcmp(key, q->key) == 0;
}

/* The job's store (its first process group's), when there is one: a request goes there too, so that ranks whose dump
   directories differ (node-local disks) see it. The agent's own connection, used on its thread only. */
#define STORE_KEY "dlua/flight/request"
static pthread_mutex_t g_store_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_store_host[256], g_store_token[256];
static int g_store_port;
static dlua_store_t *g_store;
static int g_store_broken;  /* it stopped answering (its rank ended): the file only, from then on */

void dlua_agent_note_store(const char *host, int port, const char *token) {
  pthread_mutex_lock(&g_store_mu);
  if (!g_store_port && host && *host && port > 0) {
    snprintf(g_store_host, sizeof g_store_host, "%s", host);
    snprintf(g_store_token, sizeof g_store_token, "%s", token ? token : "");
    g_store_port = port;
  }
  pthread_mutex_unlock(&g_store_mu);
}

static void store_broke(void) {
  dlua_store_close(g_store);
  g_store = NULL;
  g_store_broken = 1;
  dlua_clear_error();  // the agent's thread's own error: nobody else reads it
}

static dlua_store_t *agent_store(void) {
  if (g_store || g_store_broken) return g_store;
  char host[256], token[256];
  pthread_mutex_lock(&g_store_mu);
  int port = g_store_port;
  snprintf(host, sizeof host, "%s", g_store_host);
  snprintf(token, sizeof token, "%s", g_store_token);
  pthread_mutex_unlock(&g_store_mu);
  if (!port) return NULL;
  if (dlua_store_connect(host, port, token, 2000, &g_store) != DLUA_OK) store_broke();
  return g_store;
}

/* The store's value of key (text) into out, if the store has it. */
static int store_read(const char *key, char *out, size_t cap) {
  dlua_store_t *st = agent_store();
  if (!st) return 0;
  const char *keys[1] = {key};
  int exists = 0;
  void *v = NULL;
  size_t n = 0;
  if (dlua_store_check(st, keys, 1, &exists) != DLUA_OK || (exists && dlua_store_get(st, key, 1000, &v, &n) != DLUA_OK)) {
    store_broke();
    return 0;
  }
  if (!exists) return 0;
  snprintf(out, cap, "%s", (const char *)v);
  dlua_store_free_value(v);
  return 1;
}

/* The request in the store, else in the file, if there is one of this job. */
static int request_read(request_t *q) {
  char line[512];
  if (store_read(STORE_KEY, line, sizeof line) && request_parse(line, q)) return 1;
  char path[4096];
  request_path(path, sizeof path);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char *got = fgets(line, sizeof line, f);
  fclose(f);
  return got && request_parse(line, q);
}

/* Into the file (atomically: a poller reads the old request or this one, never half) and the store. */
static int request_post(const request_t *q) {
  char line[512];
  snprintf(line, sizeof line, "dlua.flight-request/1 %" PRId64 " %d %.6f %s %s\n", q->id, q->rank, q->time, q->key,
           q->reason);
  dlua_store_t *st = agent_store();
  int stored = st && dlua_store_set(st, STORE_KEY, line, strlen(line)) == DLUA_OK;
  if (st && !stored) store_broke();
  const char *dir = dlua_flight_default_dir();
  char path[4096], tmp[4096 + 16];
  if (dlua_flight_mkdirs(dir) != 0) return stored;
  request_path(path, sizeof path);
  snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return stored;
  fputs(line, f);
  int bad = fclose(f) != 0;
  if (bad || rename(tmp, path) != 0) {
    unlink(tmp);
    return stored;
  }
  return 1;
}

/* In the store, where this rank wrote its dump of request id: "dlua/flight/dumped/<rank>" = "ID HOST PATH". */
static void note_dump(int64_t id) {
  dlua_store_t *st = agent_store();
  if (!st) return;
  char key[64], dir[4096], host[256] = "", line[4600];
  if (!realpath(dlua_flight_default_dir(), dir)) snprintf(dir, sizeof dir, "%s", dlua_flight_default_dir());
  gethostname(host, sizeof host - 1);
  int rank = dlua_flight_rank();
  snprintf(key, sizeof key, "dlua/flight/dumped/%d", rank);
  snprintf(line, sizeof line, "%" PRId64 " %s %s/flight-rank%d.json", id, host[0] ? host : "?", dir, rank);
  if (dlua_store_set(st, key, line, strlen(line)) != DLUA_OK) store_broke();
}

/* Where rank r wrote its dump of request id if the store says so (into `where`, "host HOST: PATH"); 0 if it does not. */
static int dumped_elsewhere(int r, int64_t id, char *where, size_t cap) {
  char key[64], line[4600], host[256];
  snprintf(key, sizeof key, "dlua/flight/dumped/%d", r);
  if (!store_read(key, line, sizeof line)) return 0;
  int64_t got = -1;
  int at = 0;
  if (sscanf(line, "%" SCNd64 " %255s %n", &got, host, &at) != 2 || got != id || at == 0) return 0;
  snprintf(where, cap, "host %s: %s", host, line + at);
  return 1;
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A peer's request (or ours) not handled yet: dump for it. */
static void poll_request(void) {
  request_t q;
  if (!request_read(&q) || q.id == g_seen_id) return;
  g_seen_id = q.id;
  g_seen_at = mono_now();
  dump_now(q.reason, (long)q.id);
  note_dump(q.id);
}

/* Every rank's dump of request id is there (in DIR, or elsewhere as the store says: `elsewhere` gets a line for each
   such rank), or the request was replaced (another rank asked too: its asker prints). */
static int gathered(int64_t id, int world, double deadline, char *elsewhere, size_t cap) {
  const char *dir = dlua_flight_default_dir();
  for (;;) {
    int have = 0;
    size_t used = 0;
    elsewhere[0] = '\0';
    for (int r = 0; r < world; r++) {
      char where[4400];
      if (dlua_flight_dump_id_of(dir, r) == id) {
        have++;
      } else if (dumped_elsewhere(r, id, where, sizeof where)) {
        have++;
        if (used < cap) used += (size_t)snprintf(elsewhere + used, cap - used, "rank %d wrote its dump on %s\n", r, where);
      }
    }
    if (have == world) return 1;
    request_t q;
    if (request_read(&q) && q.id != id) return 0;
    if (mono_now() >= deadline) return 1;  // the diagnosis names the ranks that did not answer
    struct timespec ts = {0, 50 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

/* This rank's collective timed out: ask every rank for a dump (unless one asked already for this hang), then say what
   the dumps say, as the launcher does. */
static void timeout_request(void) {
  request_t q;
  if (request_read(&q) && q.id != g_seen_id && wall_now() - q.time < SAME_HANG_S) {
    poll_request();  // a peer timed out first: its request is this hang's
    return;
  }
  if (g_seen_id && mono_now() - g_seen_at < SAME_HANG_S) return;  // dumped for this hang already
  memset(&q, 0, sizeof q);
  q.time = wall_now();
  q.id = (int64_t)(q.time * 1000);
  if (q.id <= g_seen_id) q.id = g_seen_id + 1;
  q.rank = dlua_flight_rank();
  dlua_flight_job_key(q.key, sizeof q.key);
  snprintf(q.reason, sizeof q.reason, "a collective timed out on rank %d", q.rank);
  double deadline = mono_now() + GATHER_MS / 1000.0;
  if (!request_post(&q)) {
    char path[4096];
    request_path(path, sizeof path);
    fprintf(stderr, "dlua: flight recorder: cannot write %s: %s (only this rank dumps)\n", path, strerror(errno));
  }
  g_seen_id = q.id;
  g_seen_at = mono_now();
  dump_now(q.reason, (long)q.id);
  int world = dlua_flight_world();
  char elsewhere[8192];
  if (!gathered(q.id, world, deadline, elsewhere, sizeof elsewhere)) return;
  const char *dir = dlua_flight_default_dir();
  char *text = g_diagnose ? g_diagnose(dir, 0, world, q.id) : NULL;
  char head[4400];
  dlua_flight_heading(head, sizeof head, q.reason, dir, 0, world);
  if (elsewhere[0]) {  // dump directories that differ (node-local disks): say where the others are
    size_t cap = (text ? strlen(text) : 0) + strlen(elsewhere) + 2 * strlen(dir) + 128;
    char *all = malloc(cap);
    if (all) {
      snprintf(all, cap, "%s%s(copy them into %s and run `dlua flight %s` for the whole diagnosis)\n", text ? text : "",
               elsewhere, dir, dir);
      free(text);
      text = all;
    }
  }
  dlua_flight_print(head, text);
  free(text);
}

static void *agent_main(void *arg) {
  (void)arg;
  dlua_thread_name("dlua-flight");
  for (;;) {
    if (g_poll) {
      if (!wait_sem(&g_wake, POLL_MS)) {
        atomic_store(&g_busy, 1);
        poll_request();
        atomic_store(&g_busy, 0);
        continue;
      }
    } else {
      while (sem_wait(&g_wake) != 0 && errno == EINTR) {
      }
    }
    atomic_store(&g_busy, 1);
    long id = atomic_exchange(&g_pending_id, 0);
    int timeout = atomic_exchange(&g_pending_timeout, 0);
    if (timeout && g_poll)
      timeout_request();
    if (id || !timeout || !g_poll)
      dump_now(timeout && id == 0 ? "timeout" : id ? "job" : "signal", id);
    atomic_store(&g_busy, 0);
  }
  return NULL;
}

void dlua_agent_set_diagnoser(char *(*fn)(const char *dir, int first, int n, int64_t id)) { g_diagnose = fn; }

void dlua_agent_start(void) {
  if (g_started) return;
  g_started = 1;
  g_main = pthread_self();
  sem_init(&g_wake, 0, 0);
  sem_init(&g_lua_sem, 0, 0);
  sem_init(&g_bt_sem, 0, 0);
  pthread_attr_t attr;
  if (pthread_getattr_np(g_main, &attr) == 0) {
    void *lo;
    size_t size;
    if (pthread_attr_getstack(&attr, &lo, &size) == 0) {
      g_stack_lo = (uintptr_t)lo;
      g_stack_hi = (uintptr_t)lo + size;
    }
    pthread_attr_destroy(&attr);
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_dump_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, NULL);
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_stack_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGURG, &sa, NULL);
  g_poll = !dlua_launch_has_launcher() && dlua_flight_world() > 1;
  if (g_poll) {
    request_t q;
    if (request_read(&q)) g_seen_id = q.id;  // an earlier run's: not ours to answer
  }
  if (dlua_pg_start_quiet_thread(&g_thread, agent_main, NULL) == 0)
    pthread_detach(g_thread);
  else
    g_started = 0;
}

void dlua_agent_request_job_dump(const char *reason) {
  static atomic_long last;
  long now = (long)time(NULL);
  long prev = atomic_load(&last);
  if (prev && now - prev < REQUEST_GAP_S) return;
  atomic_store(&last, now);
  if (dlua_launch_notify("dump", reason ? reason : "timeout")) {  // the launcher signals every rank, this one too
    atomic_store(&g_expect_until, mono_now() + EXPECT_S);
    return;
  }
  if (!g_started) return;
  atomic_store(&g_pending_timeout, 1);
  sem_post(&g_wake);
}

void dlua_agent_flush(int ms) {
  if (!g_started) return;
  atomic_store(&g_exiting, 1);
  double deadline = mono_now() + ms / 1000.0;
  for (;;) {
    double t = mono_now();
    int value = 0;
    sem_getvalue(&g_wake, &value);
    int waiting = atomic_load(&g_busy) || value > 0 || atomic_load(&g_pending_id) != 0 || t < atomic_load(&g_expect_until);
    if (!waiting || t >= deadline) break;
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

/* The flight recorder: a ring of this process's last N collectives (every group, every backend), written as JSON on demand. */
#define _GNU_SOURCE
#include "comm/flight.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "comm/pg.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

enum { FLIGHT_DEFAULT = 1024, FLIGHT_MAX = 1 << 20, ERR_BYTES = 240 };

enum { ST_QUEUED, ST_STARTED, ST_COMPLETED, ST_FAILED };
static const char *const state_names[] = {"queued", "started", "completed", "failed"};
static const char *const op_names[] = {"sum", "avg", "max", "min", "product"};

typedef struct {
  int64_t id;             /* 0: empty; else the record's number, from 1 */
  const void *work;       /* the work while it runs (NULL once it ended): how updates find their entry */
  char group[PG_NAME];
  char backend[16];
  int group_rank, group_size;
  int64_t seq;            /* the collective's number in its group; send/recv: collectives issued before */
  int kind;
  int op;                 /* reduce op, or -1 */
  int peer;               /* broadcast root, send dst, recv src; -1 */
  int dtype;              /* -1: no tensor */
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  int bucket;             /* the DDP/ZeRO bucket (1-based), 0: none */
  char desc[160];
  char site[PG_SITE];
  int state;
  double issued, started, ended;  /* wall-clock seconds (CLOCK_REALTIME): comparable across ranks; 0: not yet */
  char error[ERR_BYTES];
} entry_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static entry_t *g_ring;  /* g_cap entries, allocated with the first record */
static int g_cap = -1;   /* -1: not read yet; 0: off */
static int64_t g_next = 1;
static __thread int t_bucket;

void dlua_flight_set_bucket(int bucket) { t_bucket = bucket > 0 ? bucket : 0; }

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Called with g_mu held. */
static int ring_ready(void) {
  if (g_cap < 0) {
    const char *v = getenv("DLUA_FLIGHT_SIZE");
    long n = v && *v ? strtol(v, NULL, 10) : FLIGHT_DEFAULT;
    g_cap = n < 0 ? 0 : n > FLIGHT_MAX ? FLIGHT_MAX : (int)n;
  }
  if (g_cap > 0 && !g_ring) {
    g_ring = calloc((size_t)g_cap, sizeof *g_ring);
    if (!g_ring) g_cap = 0;  // no memory for the recorder: collectives go on unrecorded
  }
  return g_cap > 0;
}

int dlua_flight_capacity(void) {
  pthread_mutex_lock(&g_mu);
  int c = ring_ready() ? g_cap : 0;
  pthread_mutex_unlock(&g_mu);
  return c;
}

void dlua_flight_issued(const dlua_pg_t *pg, const dlua_work_t *w) {
  double t = wall_now();
  pthread_mutex_lock(&g_mu);
  if (!ring_ready()) {
    pthread_mutex_unlock(&g_mu);
    return;
  }
  int64_t id = g_next++;
  entry_t *e = &g_ring[(id - 1) % g_cap];
  memset(e, 0, sizeof *e);
  e->id = id;
  e->work = w;
  snprintf(e->group, sizeof e->group, "%s", pg->name);
  snprintf(e->backend, sizeof e->backend, "%s", pg->be->name);
  e->group_rank = pg->rank;
  e->group_size = pg->size;
  e->seq = w->seq;
  e->kind = w->kind;
  e->op = (w->kind == K_ALL_REDUCE || w->kind == K_REDUCE_SCATTER || w->kind == K_ALL_REDUCE_MANY) ? (int)w->op : -1;
  e->peer = (w->kind == K_BROADCAST || w->kind == K_SEND || w->kind == K_RECV) ? w->peer : -1;
  const dlua_tensor_t *tt = w->t ? w->t : (w->ins && w->nlist > 0 ? w->ins[0] : NULL);
  e->dtype = tt ? (int)tt->dtype : -1;
  if (tt) {
    e->ndim = tt->ndim;
    memcpy(e->sizes, tt->sizes, sizeof(int64_t) * (size_t)tt->ndim);
  }
  e->bucket = t_bucket;
  snprintf(e->desc, sizeof e->desc, "%s", w->desc);
  snprintf(e->site, sizeof e->site, "%s", w->site);
  e->state = ST_QUEUED;
  e->issued = t;
  pthread_mutex_unlock(&g_mu);
}

/* The live entry of w, newest first (a work's address may be reused only after its entry let go). */
static entry_t *find(const dlua_work_t *w) {
  if (!g_ring) return NULL;
  int64_t n = g_next - 1 < g_cap ? g_next - 1 : g_cap;
  for (int64_t k = 0; k < n; k++) {
    entry_t *e = &g_ring[(g_next - 2 - k) % g_cap];
    if (e->work == w) return e;
  }
  return NULL;
}

void dlua_flight_started(const dlua_work_t *w) {
  double t = wall_now();
  pthread_mutex_lock(&g_mu);
  entry_t *e = find(w);
  if (e && e->state == ST_QUEUED) {
    e->state = ST_STARTED;
    e->started = t;
  }
  pthread_mutex_unlock(&g_mu);
}

void dlua_flight_ended(const dlua_work_t *w) {
  double t = wall_now();
  pthread_mutex_lock(&g_mu);
  entry_t *e = find(w);
  if (e) {
    if (e->started == 0) e->started = t;
    e->ended = t;
    e->state = w->status == DLUA_OK ? ST_COMPLETED : ST_FAILED;
    if (w->status != DLUA_OK) snprintf(e->error, sizeof e->error, "%.*s", (int)sizeof e->error - 1, w->msg);
    e->work = NULL;
  }
  pthread_mutex_unlock(&g_mu);
}

/* ---- the dump ------------------------------------------------------------------------------------ */

static void put_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(f, "\\%c", *p);
    else if (*p == '\n')
      fputs("\\n", f);
    else if (*p == '\t')
      fputs("\\t", f);
    else if (*p < 0x20)
      fprintf(f, "\\u%04x", *p);
    else
      fputc(*p, f);
  }
  fputc('"', f);
}

/* A newline-separated text as a JSON list of its lines. */
static void put_lines(FILE *f, const char *text) {
  fputc('[', f);
  int first = 1;
  for (const char *p = text; p && *p;) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    if (n > 0) {
      char *line = strndup(p, n);
      if (line) {
        if (!first) fputs(", ", f);
        put_str(f, line);
        first = 0;
        free(line);
      }
    }
    p += n + (nl ? 1 : 0);
  }
  fputc(']', f);
}

static void put_time(FILE *f, const char *key, double t) {
  if (t > 0)
    fprintf(f, ", \"%s\": %.6f", key, t);
  else
    fprintf(f, ", \"%s\": null", key);
}

static void put_entry(FILE *f, const entry_t *e) {
  fprintf(f, "    {\"id\": %" PRId64 ", \"group\": ", e->id);
  put_str(f, e->group);
  fputs(", \"backend\": ", f);
  put_str(f, e->backend);
  fprintf(f, ", \"group_rank\": %d, \"group_size\": %d, \"seq\": %" PRId64 ", \"op\": \"%s\"", e->group_rank,
          e->group_size, e->seq, dlua_pg_kind_name(e->kind));
  if (e->op >= 0 && e->op < (int)(sizeof op_names / sizeof op_names[0])) fprintf(f, ", \"reduce\": \"%s\"", op_names[e->op]);
  if (e->peer >= 0) fprintf(f, ", \"peer\": %d", e->peer);
  if (e->dtype >= 0) {
    fprintf(f, ", \"dtype\": \"%s\", \"shape\": [", dlua_dtype_name((dlua_dtype_t)e->dtype));
    for (int d = 0; d < e->ndim; d++) fprintf(f, "%s%" PRId64, d ? ", " : "", e->sizes[d]);
    fputc(']', f);
  }
  if (e->bucket > 0) fprintf(f, ", \"bucket\": %d", e->bucket);
  fputs(", \"desc\": ", f);
  put_str(f, e->desc);
  fputs(", \"site\": ", f);
  put_str(f, e->site);
  fprintf(f, ", \"state\": \"%s\"", state_names[e->state]);
  put_time(f, "issued", e->issued);
  put_time(f, "started", e->state == ST_QUEUED ? 0 : e->started);
  put_time(f, "ended", e->ended);
  if (e->error[0]) {
    fputs(", \"error\": ", f);
    put_str(f, e->error);
  }
  fputc('}', f);
}

const char *dlua_flight_default_dir(void) {
  const char *d = getenv("DLUA_FLIGHT_DIR");
  return d && *d ? d : ".";
}

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

/* The first of the launchers' variables that is set: dlua --nproc and torchrun set RANK, mpirun and
   srun their own (a rank they started has no RANK, and every rank would write flight-rank0.json). */
static int env_first(const char *a, const char *b, const char *c, int dflt) {
  return env_int(a, env_int(b, env_int(c, dflt)));
}

int dlua_flight_rank(void) { return env_first("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", 0); }
int dlua_flight_world(void) { return env_first("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", 1); }

void dlua_flight_job_key(char *out, size_t cap) {
  static const char *const names[] = {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "TORCHELASTIC_RUN_ID"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    const char *v = getenv(names[i]);
    if (v && *v) {
      snprintf(out, cap, "%s", v);
      return;
    }
  }
  const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
  const char *host = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
  if (job && *job)
    snprintf(out, cap, "slurm-%s.%s", job, step ? step : "");
  else if (port && *port)
    snprintf(out, cap, "%s:%s", host ? host : "", port);
  else
    snprintf(out, cap, "-");
  for (char *p = out; *p; p++)
    if (*p == ' ' || *p == '\n') *p = '_';  // one word in the request's line
}

void dlua_flight_heading(char *out, size_t cap, const char *reason, const char *dir, int first, int n) {
  if (n == 1)
    snprintf(out, cap, "flight recorder (%s): %s/flight-rank%d.json", reason, dir, first);
  else
    snprintf(out, cap, "flight recorder (%s): %s/flight-rank{%d..%d}.json", reason, dir, first, first + n - 1);
}

void dlua_flight_print(const char *head, const char *text) {
  fprintf(stderr, "dlua: %s\n", head);
  for (const char *p = text; p && *p;) {
    const char *nl = strchr(p, '\n');
    int n = nl ? (int)(nl - p) : (int)strlen(p);
    if (n > 0) fprintf(stderr, "dlua:   %.*s\n", n, p);
    p += n + (nl ? 1 : 0);
  }
  fflush(stderr);
}

int64_t dlua_flight_dump_id_of(const char *dir, int rank) {
  char path[4096], head[1024];
  snprintf(path, sizeof path, "%s/flight-rank%d.json", dir, rank);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(head, 1, sizeof head - 1, f);
  fclose(f);
  head[n] = '\0';
  const char *p = strstr(head, "\"dump_id\": ");  // on the first line, as dlua_flight_write puts it
  return p ? strtoll(p + 11, NULL, 10) : -1;
}

int dlua_flight_mkdirs(const char *dir) {
  char p[4096];
  snprintf(p, sizeof p, "%s", dir);
  for (char *c = p + 1; *c; c++) {  // its parents first (mkdir -p), each 0700 when we make it
    if (*c != '/') continue;
    *c = '\0';
    if (mkdir(p, 0700) != 0 && errno != EEXIST) return -1;
    *c = '/';
  }
  return mkdir(p, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

dlua_status_t dlua_flight_write(const char *dir, const char *reason, int64_t dump_id, const dlua_flight_where_t *where) {
  if (!dir || !*dir) dir = dlua_flight_default_dir();
  if (dlua_flight_mkdirs(dir) != 0)
    return DLUA_ERR(DLUA_ERR_IO, "flight recorder: cannot create %s: %s", dir, strerror(errno));
  int rank = dlua_flight_rank();
  int world = dlua_flight_world();
  char path[4096], tmp[4096];
  snprintf(path, sizeof path, "%s/flight-rank%d.json", dir, rank);
  snprintf(tmp, sizeof tmp, "%s/.flight-rank%d.json.%d", dir, rank, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return DLUA_ERR(DLUA_ERR_IO, "flight recorder: cannot write %s: %s", tmp, strerror(errno));
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  fprintf(f, "{\"format\": \"dlua.flight/1\", \"rank\": %d, \"world_size\": %d, \"local_rank\": %d, \"pid\": %d, \"host\": ",
          rank, world, env_first("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", 0), (int)getpid());
  put_str(f, host);
  fputs(", \"reason\": ", f);
  put_str(f, reason ? reason : "request");
  fprintf(f, ", \"dump_id\": %" PRId64 ", \"time\": %.6f,\n  \"where\": {\"state\": ", dump_id, wall_now());
  put_str(f, where && where->state ? where->state : "unknown");
  fputs(", \"traceback\": ", f);
  put_lines(f, where ? where->traceback : NULL);
  fputs(", \"c_stack\": ", f);
  put_lines(f, where ? where->c_stack : NULL);
  fputs("},\n", f);

  pthread_mutex_lock(&g_mu);
  int cap = ring_ready() ? g_cap : 0;
  fprintf(f, "  \"capacity\": %d, \"recorded\": %" PRId64 ",\n  \"entries\": [\n", cap, g_next - 1);
  int64_t n = g_next - 1 < cap ? g_next - 1 : cap;
  for (int64_t k = 0; k < n; k++) {  // oldest first
    const entry_t *e = &g_ring[(g_next - 1 - n + k) % cap];
    put_entry(f, e);
    fputs(k + 1 < n ? ",\n" : "\n", f);
  }
  pthread_mutex_unlock(&g_mu);
  fputs("  ]\n}\n", f);
  int bad = ferror(f);
  if (fflush(f) != 0) bad = 1;
  if (fsync(fileno(f)) != 0) bad = 1;
  if (fclose(f) != 0) bad = 1;
  if (bad || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    return DLUA_ERR(DLUA_ERR_IO, "flight recorder: cannot write %s: %s", path, strerror(e));
  }
  return DLUA_OK;
}

dlua_status_t dlua_flight_dump(const char *dir, const char *reason, const char *traceback) {
  dlua_flight_where_t where = {traceback ? "lua" : "unknown", traceback, NULL};
  return dlua_flight_write(dir, reason ? reason : "request", 0, &where);
}

/* The launcher's control of a running job: its private directory (token, `dlua attach`'s Unix socket), the
   commands attach relays to the ranks through the control page, and the flight-recorder dumps with their diagnosis. */
#define _GNU_SOURCE 1
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "comm/flight.h"
#include "comm/launch_job.h"
#include "core/runtime.h"

enum {
  HELLO_MS = 5000,            /* a client has this long to say who it is */
  TIMEOUT_DUMP_GAP_MS = 10000 /* a timeout's dump request this soon after a dump is the same hang */
};

static dlua_launch_diagnose_fn g_diagnose;
void dlua_launch_set_diagnoser(dlua_launch_diagnose_fn fn) { g_diagnose = fn; }

/* ---- the job directory -------------------------------------------------------------------------- */

int dlua_launch_job_dir(int pid, char *out, size_t cap) {
  const char *run = getenv("DLUA_RUN_DIR"), *xdg = getenv("XDG_RUNTIME_DIR");
  int n;
  if (run && *run)
    n = snprintf(out, cap, "%s/%d", run, pid);
  else if (xdg && *xdg)
    n = snprintf(out, cap, "%s/dlua/%d", xdg, pid);
  else
    n = snprintf(out, cap, "/tmp/dlua-%u/%d", (unsigned)getuid(), pid);
  return n > 0 && (size_t)n < cap - 32 ? 0 : -1;
}

/* mkdir 0700 if missing, then insist that it is ours and private: another user's directory (made in /tmp
   before us) must not hold our socket and token. */
static int private_dir(const char *path, char *why, size_t cap) {
  if (mkdir(path, 0700) != 0 && errno != EEXIST) {
    snprintf(why, cap, "cannot create %s: %s", path, strerror(errno));
    return -1;
  }
  struct stat st;
  if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
    snprintf(why, cap, "%s is not a directory", path);
    return -1;
  }
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    snprintf(why, cap, "%s is not private (owner %u, mode %03o; needs owner %u, mode 700)", path, (unsigned)st.st_uid,
             (unsigned)(st.st_mode & 0777), (unsigned)geteuid());
    return -1;
  }
  return 0;
}

static void path_in(const dlua_job_t *job, const char *name, char *out, size_t cap) {
  snprintf(out, cap, "%s/%s", job->dir, name);
}

static int write_private_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return -1;
  size_t n = strlen(text);
  int ok = write(fd, text, n) == (ssize_t)n;
  close(fd);
  return ok ? 0 : -1;
}

static void *attach_main(void *arg);

/* The directories of launchers that died without cleaning up (SIGKILL): their socket, token and job file go, and the
   directory with them unless it holds flight-recorder dumps. A directory's name is its launcher's pid. */
static void sweep_dead(const char *base) {
  DIR *d = opendir(base);
  if (!d) return;
  struct dirent *e;
  char p[PATH_MAX + 300];
  while ((e = readdir(d)) != NULL) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
    static const char *const names[] = {"attach.sock", "token", "job"};
    for (int i = 0; i < 3; i++) {
      snprintf(p, sizeof p, "%s/%s/%s", base, e->d_name, names[i]);
      unlink(p);
    }
    snprintf(p, sizeof p, "%s/%s", base, e->d_name);
    rmdir(p);  // fails, and keeps it, when dumps are there
  }
  closedir(d);
}

/* A directory named after our pid is left from an earlier launcher that had it (killed, say): its files are not ours. */
static void clear_stale(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char p[PATH_MAX + 300];
  while ((e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    if (!strcmp(n, "attach.sock") || !strcmp(n, "token") || !strcmp(n, "job") || !strncmp(n, "flight-rank", 11) ||
        !strncmp(n, ".flight-rank", 12)) {
      snprintf(p, sizeof p, "%s/%s", dir, n);
      unlink(p);
    }
  }
  closedir(d);
}

int dlua_launch_ctl_open(dlua_job_t *job) {
  char base[PATH_MAX], why[PATH_MAX + 128] = "";
  const char *user_flight = getenv("DLUA_FLIGHT_DIR");
  if (user_flight && *user_flight) snprintf(job->flight_dir, sizeof job->flight_dir, "%s", user_flight);
  if (dlua_launch_job_dir((int)getpid(), job->dir, sizeof job->dir) != 0) goto off;
  snprintf(base, sizeof base, "%s", job->dir);
  *strrchr(base, '/') = '\0';
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  if (xdg && *xdg && !(getenv("DLUA_RUN_DIR") && *getenv("DLUA_RUN_DIR"))) {
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", base);
    *strrchr(parent, '/') = '\0';
    if (access(parent, W_OK) != 0) {
      snprintf(why, sizeof why, "XDG_RUNTIME_DIR %s is not writable", parent);
      goto off;
    }
  }
  if (private_dir(base, why, sizeof why) != 0 || private_dir(job->dir, why, sizeof why) != 0) goto off;
  clear_stale(job->dir);
  sweep_dead(base);
  job->own_dir = 1;
  if (!job->flight_dir[0]) snprintf(job->flight_dir, sizeof job->flight_dir, "%s", job->dir);
  char p[PATH_MAX + 32], info[512];
  path_in(job, "token", p, sizeof p);
  if (write_private_file(p, job->token) != 0) {
    snprintf(why, sizeof why, "cannot write %s: %s", p, strerror(errno));
    goto off;
  }
  path_in(job, "job", p, sizeof p);
  snprintf(info, sizeof info, "pid %d\nworld_size %d\nnproc %d\nfirst_rank %d\nnode_rank %d\nnnodes %d\n",
           (int)getpid(), job->world, job->o.nproc, job->first_rank, job->o.node_rank, job->o.nnodes);
  write_private_file(p, info);
  if (!job->control) {
    snprintf(why, sizeof why, "no control page (memfd_create failed)");
    goto off;
  }
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/attach.sock", job->dir) >= (int)sizeof sa.sun_path) {
    snprintf(why, sizeof why, "the socket's path is longer than %zu bytes: %s/attach.sock", sizeof sa.sun_path - 1,
             job->dir);
    goto off;
  }
  unlink(sa.sun_path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  mode_t old = umask(077);  // the socket is born 0600: no moment in which another user could connect
  int ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && chmod(sa.sun_path, 0600) == 0 &&
           listen(fd, 4) == 0;
  umask(old);
  if (!ok) {
    snprintf(why, sizeof why, "cannot listen on %s: %s", sa.sun_path, strerror(errno));
    if (fd >= 0) close(fd);
    goto off;
  }
  job->listen_fd = fd;
  sigset_t all, prev;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_SETMASK, &all, &prev);
  if (pthread_create(&job->attach_thread, NULL, attach_main, job) == 0) job->attach_started = 1;
  pthread_sigmask(SIG_SETMASK, &prev, NULL);
  return 0;
off:
  /* the job runs without attach (its dumps then go to DLUA_FLIGHT_DIR or the ranks' directory) */
  if (why[0]) fprintf(stderr, "dlua: dlua attach is off for this job: %s\n", why);
  return 0;
}

void dlua_launch_ctl_close(dlua_job_t *job) {
  if (job->attach_started) {
    job->attach_stop = 1;
    pthread_join(job->attach_thread, NULL);
    job->attach_started = 0;
  }
  if (job->listen_fd >= 0) close(job->listen_fd);
  job->listen_fd = -1;
  if (!job->own_dir) return;
  job->own_dir = 0;
  const char *names[] = {"attach.sock", "token", "job"};
  char p[PATH_MAX + 32];
  for (int i = 0; i < 3; i++) {
    path_in(job, names[i], p, sizeof p);
    unlink(p);
  }
  /* kept when it holds this job's flight-recorder dumps: the diagnosis named them */
  if (rmdir(job->dir) != 0 && errno == ENOTEMPTY && job->dumps_written && !strcmp(job->flight_dir, job->dir))
    fprintf(stderr, "dlua: flight-recorder dumps kept in %s\n", job->dir);
  free(job->diagnosis);
  job->diagnosis = NULL;
}

/* ---- flight-recorder dumps ---------------------------------------------------------------------- */

void dlua_launch_dump_begin(dlua_job_t *job, const char *reason) {
  double t = dlua_launch_now();
  if (job->dump_active) return;
  int from_timeout = strstr(reason, "timed out") != NULL;
  if (from_timeout && job->dump_ended_at > 0 && t - job->dump_ended_at < TIMEOUT_DUMP_GAP_MS / 1000.0) return;
  job->dump_id++;
  job->dump_active = 1;
  job->dump_deadline = t + DUMP_MS / 1000.0;
  snprintf(job->dump_reason, sizeof job->dump_reason, "%s", reason);
  union sigval v;
  v.sival_int = (int)job->dump_id;
  for (int i = 0; i < job->o.nproc; i++) {
    rank_t *r = &job->ranks[i];
    r->dump_asked = r->running && sigqueue(r->pid, SIGUSR1, v) == 0;
  }
}

int dlua_launch_dump_poll(dlua_job_t *job) {
  if (!job->dump_active) return 0;
  int done = 1;
  for (int i = 0; i < job->o.nproc; i++) {
    const rank_t *r = &job->ranks[i];
    if (r->dump_asked && r->running && r->dumped < job->dump_id) done = 0;
  }
  if (!done && dlua_launch_now() < job->dump_deadline) return 1;
  job->dump_active = 0;
  job->dump_ended_at = dlua_launch_now();
  const char *dir = job->flight_dir[0] ? job->flight_dir : ".";
  char *text = g_diagnose ? g_diagnose(dir, job->first_rank, job->o.nproc, job->dump_id) : NULL;
  char head[PATH_MAX + 256];
  dlua_flight_heading(head, sizeof head, job->dump_reason, dir, job->first_rank, job->o.nproc);
  size_t cap = strlen(head) + (text ? strlen(text) : 0) + 2;
  char *full = malloc(cap);
  if (full) snprintf(full, cap, "%s\n%s", head, text ? text : "");
  dlua_flight_print(head, text);  // as the launcher's own lines
  free(text);
  free(job->diagnosis);
  job->diagnosis = full;
  job->diagnosis_id = job->dump_id;
  pthread_cond_broadcast(&job->cv);
  return 0;
}

/* ---- dlua attach's socket ----------------------------------------------------------------------- */

/* Reads a line into buf (NUL-terminated, without '\n') within ms; -1 on EOF, timeout or overflow. */
static int read_line(int fd, char *buf, size_t cap, int ms) {
  size_t n = 0;
  while (n + 1 < cap) {
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    char c;
    ssize_t k = read(fd, &c, 1);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    if (c == '\n') {
      buf[n] = '\0';
      return (int)n;
    }
    buf[n++] = c;
  }
  return -1;
}

static int read_exact(int fd, char *buf, size_t n, int ms) {
  size_t got = 0;
  while (got < n) {
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t k = read(fd, buf + got, n - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

static int send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* A reply frame: "ok <len>\n<text>" or "err <len>\n<text>". */
static int reply(int fd, int ok, const char *text) {
  char head[64];
  size_t n = strlen(text);
  int h = snprintf(head, sizeof head, "%s %zu\n", ok ? "ok" : "err", n);
  return send_all(fd, head, (size_t)h) || send_all(fd, text, n) ? -1 : 0;
}

static int tokens_equal(const char *a, const char *b) {
  size_t na = strlen(a), nb = strlen(b);
  unsigned char d = na != nb;
  for (size_t i = 0; i < na && i < nb; i++) d |= (unsigned char)(a[i] ^ b[i]);
  return d == 0;
}

/* Whether the client went away (it may cancel a wait by closing). */
static int client_gone(int fd) {
  struct pollfd p = {fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return 0;
  if (p.revents & (POLLHUP | POLLERR)) return 1;
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

static void dump_command(dlua_job_t *job, int fd) {
  pthread_mutex_lock(&job->mu);
  int64_t id = job->dump_active ? job->dump_id : job->dump_id + 1;
  if (!job->dump_active) dlua_launch_dump_begin(job, "dlua attach --dump");
  while (job->diagnosis_id < id && !job->finished) pthread_cond_wait(&job->cv, &job->mu);
  char *text = job->diagnosis_id >= id && job->diagnosis ? strdup(job->diagnosis) : NULL;
  pthread_mutex_unlock(&job->mu);
  reply(fd, text != NULL, text ? text : "the job ended before its ranks were dumped");
  free(text);
}

/* Runs `code` on local rank li (-1: on every rank at one step) and answers the client. */
static void rank_command(dlua_job_t *job, int fd, int li, const char *code) {
  dlua_control_t *c = job->control;
  char err[512];
  int64_t at = -1;
  int64_t seq = dlua_control_post(c, li, code, &at, err, sizeof err);
  if (seq < 0) {
    reply(fd, 0, err);
    return;
  }
  const char *w = getenv("DLUA_ATTACH_WAIT");
  double limit = dlua_launch_now() + (w && *w ? atof(w) : 120.0);
  for (;;) {
    int all = 1, any_running = 0, late = li >= 0 ? li : 0;
    pthread_mutex_lock(&job->mu);
    int finished = job->finished || job->failed_rank >= 0;
    for (int i = 0; i < c->nproc; i++) {
      if (li >= 0 && i != li) continue;
      if (job->ranks[i].running) any_running = 1;
      if (atomic_load(&c->rank[i].done_seq) < seq && job->ranks[i].running) {
        if (all) late = i;
        all = 0;
      }
    }
    pthread_mutex_unlock(&job->mu);
    if (all && any_running) break;
    if (finished || !any_running) {
      reply(fd, 0, "the job ended before the command ran");
      return;
    }
    if (client_gone(fd)) return;
    if (dlua_launch_now() > limit) {
      snprintf(err, sizeof err, "rank %d did not reach a step boundary in time (its last: step %lld); the command "
               "stays posted and runs there when it does", job->first_rank + late, (long long)atomic_load(&c->rank[late].step));
      reply(fd, 0, err);
      return;
    }
    usleep(10 * 1000);
  }
  if (li >= 0) {  // one rank: its whole answer
    int ok = atomic_load(&c->rank[li].ok);
    reply(fd, ok, atomic_load(&c->reply_seq) == seq ? c->reply : c->rank[li].text);
    return;
  }
  /* every rank: the step, then each rank's answer, ranks with the same answer on one line */
  size_t cap = (size_t)c->nproc * (CONTROL_TEXT_BYTES + 48) + 128;
  char *text = malloc(cap);
  unsigned char *told = calloc((size_t)c->nproc, 1);
  if (!text || !told) {
    free(text);
    free(told);
    reply(fd, 0, "out of memory");
    return;
  }
  size_t used = (size_t)snprintf(text, cap, "applied at step %lld on ranks %d-%d\n", (long long)at, job->first_rank,
                                 job->first_rank + c->nproc - 1);
  int ok = 1;
  for (int i = 0; i < c->nproc; i++) {
    if (told[i]) continue;
    int oki = atomic_load(&c->rank[i].ok);
    if (!oki) ok = 0;
    char ranks[128];
    size_t rn = 0;
    int same = 0;
    for (int j = i; j < c->nproc; j++) {
      if (told[j] || atomic_load(&c->rank[j].ok) != oki || strcmp(c->rank[j].text, c->rank[i].text) != 0) continue;
      told[j] = 1;
      same++;
      int end = j;  // a run j..end of ranks with this answer
      while (end + 1 < c->nproc && !told[end + 1] && atomic_load(&c->rank[end + 1].ok) == oki &&
             strcmp(c->rank[end + 1].text, c->rank[i].text) == 0)
        told[++end] = 1, same++;
      if (rn + 24 < sizeof ranks)
        rn += (size_t)(end > j ? snprintf(ranks + rn, sizeof ranks - rn, "%s%d-%d", rn ? "," : "", job->first_rank + j,
                                          job->first_rank + end)
                               : snprintf(ranks + rn, sizeof ranks - rn, "%s%d", rn ? "," : "", job->first_rank + j));
      j = end;
    }
    const char *t = c->rank[i].text;
    size_t tn = strlen(t);
    while (tn > 0 && t[tn - 1] == '\n') tn--;
    if (tn == 0) t = "(nothing)", tn = 9;
    if (used < cap)
      used += (size_t)snprintf(text + used, cap - used, "%s %s: %.*s\n", same > 1 ? "ranks" : "rank", ranks, (int)tn, t);
  }
  reply(fd, ok, text);
  free(text);
  free(told);
}

static void serve(dlua_job_t *job, int fd) {
  char line[512];
  struct ucred cred;
  socklen_t cl = sizeof cred;
  /* the hello first, even from a client we refuse: a Unix socket closed with unread data resets the connection, and
     the client would not read why */
  int said = read_line(fd, line, sizeof line, HELLO_MS);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != geteuid()) {
    reply(fd, 0, "refused: the job belongs to another user");
    return;
  }
  char token[400] = "";
  if (said < 0 || sscanf(line, "dlua-attach 1 %399s", token) != 1) {
    reply(fd, 0, "refused: expected 'dlua-attach 1 <token>'");
    return;
  }
  if (!tokens_equal(token, job->token)) {
    reply(fd, 0, "refused: wrong token");
    return;
  }
  char hello[160];
  snprintf(hello, sizeof hello, "world_size %d first_rank %d nproc %d restarts %d", job->world, job->first_rank,
           job->o.nproc, job->restarts);
  if (reply(fd, 1, hello) != 0) return;
  for (;;) {
    char kind[16];
    long arg = 0, len = 0;
    int r = read_line(fd, line, sizeof line, 500);
    if (r < 0) {
      if (job->attach_stop || client_gone(fd)) return;
      continue;
    }
    if (sscanf(line, "%15s %ld %ld", kind, &arg, &len) != 3 || len < 0 || len >= CONTROL_CMD_BYTES) {
      reply(fd, 0, "bad request");
      return;
    }
    char *code = calloc(1, (size_t)len + 1);
    if (!code || read_exact(fd, code, (size_t)len, HELLO_MS) != 0) {
      free(code);
      return;
    }
    if (!strcmp(kind, "dump")) {
      dump_command(job, fd);
    } else if (!strcmp(kind, "run") || !strcmp(kind, "all")) {
      int every = !strcmp(kind, "all");
      int li = every ? -1 : (int)(arg - job->first_rank);
      char why[200];
      if (every && job->o.nnodes > 1) {
        snprintf(why, sizeof why, "changes for every rank need a single-node job (this launcher runs ranks %d-%d of %d)",
                 job->first_rank, job->first_rank + job->o.nproc - 1, job->world);
        reply(fd, 0, why);
      } else if (!every && (li < 0 || li >= job->o.nproc)) {
        snprintf(why, sizeof why, "rank %ld is not a rank of this launcher (ranks %d-%d of %d)", arg, job->first_rank,
                 job->first_rank + job->o.nproc - 1, job->world);
        reply(fd, 0, why);
      } else {
        rank_command(job, fd, li, code);
      }
    } else {
      reply(fd, 0, "unknown request");
    }
    free(code);
  }
}

static void *attach_main(void *arg) {
  dlua_job_t *job = arg;
  while (!job->attach_stop) {
    struct pollfd p = {job->listen_fd, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    int fd = accept4(job->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    serve(job, fd);  // one client at a time: its commands run in order
    close(fd);
  }
  return NULL;
}

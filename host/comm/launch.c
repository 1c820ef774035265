/* The launcher behind `dlua --nproc N`: starts the ranks of this node, tags their output,
   stops the whole job when one rank fails, and never leaves a process behind. */
#define _GNU_SOURCE 1  /* pipe2, sigabbrev_np */
#include "comm/launch.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/launch_job.h"
#include "core/api.h"
#include "core/runtime.h"

extern char **environ;

double dlua_launch_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- signals ------------------------------------------------------------------------ */

static volatile sig_atomic_t g_signals, g_dump_signals;

static void on_signal(int sig) {
  if (sig == SIGUSR1)
    g_dump_signals++;
  else
    g_signals++;
}

void dlua_launch_install_signals(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  sigaction(SIGUSR1, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

int dlua_launch_dump_signals(void) { return (int)g_dump_signals; }

int dlua_launch_signals_seen(void) { return (int)g_signals; }
void dlua_launch_signals_reset(void) { g_signals = 0; }

/* ---- ranks -------------------------------------------------------------------------- */

static void signal_running(dlua_job_t *job, int sig, int except) {
  for (int i = 0; i < job->o.nproc; i++) {
    rank_t *r = &job->ranks[i];
    if (i == except || !r->running) continue;
    if (sig != SIGINT) r->stopped_by_us = 1;
    kill(r->pid, sig);
  }
}

static int any_running(const dlua_job_t *job) {
  for (int i = 0; i < job->o.nproc; i++)
    if (job->ranks[i].running) return 1;
  return 0;
}

static int any_pipe_open(const dlua_job_t *job) {
  for (int i = 0; i < job->o.nproc; i++)
    if (job->ranks[i].fd[0] >= 0 || job->ranks[i].fd[1] >= 0) return 1;
  return 0;
}

static int failed_status(int status) {
  return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

static void announce_failure(dlua_job_t *job, const char *what) {
  if (job->store == NULL) return;
  /* the first failure of the job wins; later ones are consequences */
  void *cur = NULL;
  size_t curlen = 0;
  if (dlua_store_compare_set(job->store, "dlua/launch/failed", NULL, 0, what, strlen(what), &cur,
                             &curlen) == DLUA_OK)
    dlua_store_free_value(cur);
}

static void describe_end(const rank_t *r, char *out, size_t cap) {
  if (WIFSIGNALED(r->status)) {
    int sig = WTERMSIG(r->status);
    const char *name = sigabbrev_np(sig);
    snprintf(out, cap, "killed by signal %d (SIG%s)", sig, name ? name : "?");
  } else {
    snprintf(out, cap, "exit code %d", WEXITSTATUS(r->status));
  }
}

/* Collects ended ranks. Called with job->mu held. */
static void reap(dlua_job_t *job) {
  for (int i = 0; i < job->o.nproc; i++) {
    rank_t *r = &job->ranks[i];
    if (!r->running) continue;
    int status;
    pid_t p = waitpid(r->pid, &status, WNOHANG);
    if (p != r->pid) continue;
    r->running = 0;
    r->status = status;
  }
}

/* Picks the rank to blame, once there is one, and stops the rest. The cause is, in order: the
   first rank to claim a failure of its own code on the failure pipe (even before it exits: it
   may hang closing its groups); a rank that failed without a claim (a signal, os.exit, a crash:
   a signal first, else the lowest); and only when none turns up within PEER_GRACE_MS, the first
   rank that failed because a peer went away (at once when every rank ended: `final`). Called with
   job->mu held, after reap and read_ctl. */
static void decide(dlua_job_t *job, int final) {
  if (job->failed_rank >= 0 || job->remote_failure[0] || job->interrupted) return;
  int own = -1, plain = -1, peer = -1;
  for (int i = 0; i < job->o.nproc; i++) {
    rank_t *r = &job->ranks[i];
    if (r->stopped_by_us) continue;
    if (r->claim == CLAIM_OWN) {
      if (own < 0 || r->claim_seq < job->ranks[own].claim_seq) own = i;
      continue;
    }
    if (r->running || !failed_status(r->status)) continue;
    /* SIGPIPE: it wrote to a connection a peer had closed */
    if (r->claim == CLAIM_PEER || (WIFSIGNALED(r->status) && WTERMSIG(r->status) == SIGPIPE)) {
      long seq = r->claim == CLAIM_PEER ? r->claim_seq : LONG_MAX;
      if (peer < 0 || seq < (job->ranks[peer].claim == CLAIM_PEER ? job->ranks[peer].claim_seq : LONG_MAX)) peer = i;
    } else if (plain < 0 || (WIFSIGNALED(r->status) && !WIFSIGNALED(job->ranks[plain].status))) {
      plain = i;
    }
  }
  int culprit = own >= 0 ? own : plain;
  if (culprit < 0 && peer >= 0) {
    double t = dlua_launch_now();
    if (job->peer_since == 0) job->peer_since = t;
    if (final || t - job->peer_since >= PEER_GRACE_MS / 1000.0) culprit = peer;
  }
  if (culprit < 0) return;
  job->failed_rank = culprit;
  signal_running(job, SIGTERM, culprit);
  job->kill_at = dlua_launch_now() + STOP_GRACE_MS / 1000.0;
}

/* Multi-node: posts the failure in the store once the failed rank ended (its error read). */
static void announce_when_ended(dlua_job_t *job) {
  if (job->store == NULL || job->failed_rank < 0 || job->announced) return;
  rank_t *r = &job->ranks[job->failed_rank];
  if (r->running) return;
  job->announced = 1;
  char how[96], what[700];
  describe_end(r, how, sizeof how);
  snprintf(what, sizeof what, "rank %d (node %d) failed (%s)%s%s", job->first_rank + job->failed_rank,
           job->o.node_rank, how, r->last_error[0] ? ": " : "", r->last_error);
  announce_failure(job, what);
}

/* Multi-node: another node's rank failed → stop ours. Called with job->mu held. */
static void watch_remote(dlua_job_t *job) {
  if (job->store == NULL || job->failed_rank >= 0 || job->remote_failure[0] || job->interrupted) return;
  double t = dlua_launch_now();
  if (t < job->next_watch) return;
  job->next_watch = t + WATCH_MS / 1000.0;
  void *v = NULL;
  size_t n = 0;
  if (dlua_store_get(job->store, "dlua/launch/failed", 0, &v, &n) != DLUA_OK) {
    dlua_clear_error();
    return;
  }
  snprintf(job->remote_failure, sizeof job->remote_failure, "%.*s", (int)n, (const char *)v);
  dlua_store_free_value(v);
  signal_running(job, SIGTERM, -1);
  job->kill_at = dlua_launch_now() + STOP_GRACE_MS / 1000.0;
}

static void *pump_main(void *arg) {
  dlua_job_t *job = arg;
  sigset_t all;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  int n = job->o.nproc;
  struct pollfd *pf = calloc((size_t)(2 * n + 1), sizeof *pf);
  int *who = calloc((size_t)(2 * n + 1), sizeof *who);
  int dump_signals = dlua_launch_dump_signals();
  for (;;) {
    int k = 0;
    if (job->ctl[0] >= 0 && pf) {
      pf[k].fd = job->ctl[0];
      pf[k].events = POLLIN;
      pf[k].revents = 0;
      who[k++] = -1;
    }
    for (int i = 0; i < n; i++)
      for (int s = 0; s < 2; s++)
        if (job->ranks[i].fd[s] >= 0 && pf) {
          pf[k].fd = job->ranks[i].fd[s];
          pf[k].events = POLLIN;
          pf[k].revents = 0;
          who[k++] = 2 * i + s;
        }
    if (k > 0 && pf) {
      int rc = poll(pf, (nfds_t)k, 50);
      if (rc > 0)
        for (int j = 0; j < k; j++)
          if (pf[j].revents && who[j] >= 0) dlua_launch_read_pipe(job, who[j] / 2, who[j] % 2);
    } else {
      usleep(50 * 1000);
    }
    pthread_mutex_lock(&job->mu);
    /* the pipe after reaping: a rank's line is written before it exits, so it is there by now */
    reap(job);
    dlua_launch_read_ctl(job);
    int sigs = dlua_launch_dump_signals();
    if (sigs != dump_signals) {
      dump_signals = sigs;
      dlua_launch_dump_begin(job, "SIGUSR1 to the launcher");
    }
    /* while the ranks write their dumps, none is stopped: a failure's verdict waits for them */
    int dumping = dlua_launch_dump_poll(job);
    if (!dumping) decide(job, !any_running(job));
    announce_when_ended(job);
    watch_remote(job);
    double t = dlua_launch_now();
    if (!dumping && job->kill_at > 0 && t >= job->kill_at && any_running(job)) {
      signal_running(job, SIGKILL, -1);
      job->kill_at = 0;
    }
    int done = 0;
    if (!any_running(job)) {
      if (job->all_ended_at == 0) job->all_ended_at = t;
      /* a grandchild may hold a pipe open: read what comes for a moment, then let go */
      if (!any_pipe_open(job) || t - job->all_ended_at > DRAIN_MS / 1000.0) done = 1;
    }
    if (done) {
      for (int i = 0; i < n; i++)
        for (int s = 0; s < 2; s++)
          if (job->ranks[i].fd[s] >= 0) {
            dlua_launch_flush_lines(job, i, s, 1);
            close(job->ranks[i].fd[s]);
            job->ranks[i].fd[s] = -1;
          }
      job->finished = 1;
      pthread_cond_broadcast(&job->cv);
      pthread_mutex_unlock(&job->mu);
      break;
    }
    pthread_mutex_unlock(&job->mu);
  }
  free(pf);
  free(who);
  return NULL;
}

int dlua_launch_gpu_count(void) {
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (vis != NULL) {
    int n = 0;
    for (const char *p = vis; *p;) {
      while (*p == ' ' || *p == ',') p++;
      if (*p == '\0') break;
      if (*p == '-') break;  // "-1" and what follows hide every device, as CUDA reads it
      n++;
      while (*p && *p != ',') p++;
    }
    return n;
  }
  DIR *d = opendir("/proc/driver/nvidia/gpus");
  if (d == NULL) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* ---- start -------------------------------------------------------------------------- */

static int random_token(char *out, size_t cap) {
  unsigned char raw[16];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, raw, sizeof raw) != (ssize_t)sizeof raw) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  for (size_t i = 0; i < sizeof raw && 2 * i + 2 < cap; i++) snprintf(out + 2 * i, 3, "%02x", raw[i]);
  return 0;
}

static int parse_show(dlua_job_t *job) {
  int n = job->o.nproc;
  job->show = calloc((size_t)n, 1);
  if (job->show == NULL) return -1;
  if (job->o.ranks_output == NULL) {
    memset(job->show, 1, (size_t)n);
    return 0;
  }
  const char *p = job->o.ranks_output;
  while (*p) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 0 || v >= job->world) {
      fprintf(stderr, "dlua: --ranks-output '%s': expected ranks in 0..%d, separated by commas\n",
              job->o.ranks_output, job->world - 1);
      return -1;
    }
    if (v >= job->first_rank && v < job->first_rank + n) job->show[v - job->first_rank] = 1;
    p = end;
    if (*p == ',') p++;
    else if (*p) {
      fprintf(stderr, "dlua: --ranks-output '%s': expected ranks separated by commas\n", job->o.ranks_output);
      return -1;
    }
  }
  return 0;
}

/* The environment of one rank: ours plus the torchrun-style variables, built before fork
   because the child may only call async-signal-safe functions until exec. */
static char **rank_env(const dlua_job_t *job, int li) {
  static const char *ours[] = {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "GROUP_RANK=",
                               "NODE_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "DLUA_JOB_TOKEN=",
                               "DLUA_LAUNCHER=", "DLUA_SPMD_REPL=", "DLUA_LAUNCH_FD=", "DLUA_CONTROL_FD=",
                               "DLUA_JOB_DIR=", "DLUA_RESTART_COUNT=", "DLUA_RESTART_STEP=", "DLUA_MAX_RESTARTS=",
                               NULL};
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 24, sizeof *env);
  if (env == NULL) return NULL;
  size_t k = 0;
  int has_omp = 0;
  for (size_t i = 0; i < n; i++) {
    int skip = 0;
    for (int j = 0; ours[j]; j++)
      if (strncmp(environ[i], ours[j], strlen(ours[j])) == 0) skip = 1;
    if (strncmp(environ[i], "OMP_NUM_THREADS=", 16) == 0) has_omp = 1;
    if (!skip) env[k++] = strdup(environ[i]);
  }
  char v[PATH_MAX + 64];
#define PUT(...) (snprintf(v, sizeof v, __VA_ARGS__), env[k++] = strdup(v))
  PUT("RANK=%d", job->first_rank + li);
  PUT("WORLD_SIZE=%d", job->world);
  PUT("LOCAL_RANK=%d", li);
  PUT("LOCAL_WORLD_SIZE=%d", job->o.nproc);
  PUT("GROUP_RANK=%d", job->o.node_rank);
  PUT("NODE_RANK=%d", job->o.node_rank);
  PUT("MASTER_ADDR=%s", job->host);
  PUT("MASTER_PORT=%d", job->port);
  PUT("DLUA_JOB_TOKEN=%s", job->token);
  PUT("DLUA_LAUNCHER=1");
  PUT("DLUA_LAUNCH_FD=%d", LAUNCH_FD);
  if (job->o.spmd_repl) PUT("DLUA_SPMD_REPL=1");
  if (job->control) PUT("DLUA_CONTROL_FD=%d", CONTROL_FD);
  if (job->dir[0]) PUT("DLUA_JOB_DIR=%s", job->dir);
  if (job->flight_dir[0] && !getenv("DLUA_FLIGHT_DIR")) PUT("DLUA_FLIGHT_DIR=%s", job->flight_dir);
  PUT("DLUA_RESTART_COUNT=%d", job->restarts);
  PUT("DLUA_MAX_RESTARTS=%d", job->o.max_restarts);
  if (job->restarts > 0) PUT("DLUA_RESTART_STEP=%lld", (long long)job->reached);
  if (!has_omp) {
    /* N ranks sharing the cores: each gets its share instead of N full thread pools */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long per = cores / job->o.nproc;
    PUT("OMP_NUM_THREADS=%ld", per < 1 ? 1 : per);
  }
#undef PUT
  env[k] = NULL;
  return env;
}

static void free_env(char **env) {
  if (env == NULL) return;
  for (size_t i = 0; env[i]; i++) free(env[i]);
  free(env);
}

static int spawn(dlua_job_t *job, int li, const char *exe) {
  rank_t *r = &job->ranks[li];
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return -1;
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return -1;
  }
  char **env = rank_env(job, li);
  char **argv = calloc((size_t)job->o.argc + 2, sizeof *argv);
  if (env == NULL || argv == NULL) {
    free_env(env);
    free(argv);
    close(out[0]);
    close(out[1]);
    close(err[0]);
    close(err[1]);
    return -1;
  }
  argv[0] = (char *)exe;
  for (int i = 0; i < job->o.argc; i++) argv[i + 1] = job->o.argv[i];
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    /* the child: only async-signal-safe calls until exec */
    setpgid(0, job->pgid);  // 0 for the first rank: a new group led by it
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the launcher died before prctl took effect
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    signal(SIGUSR1, SIG_IGN);  // kept across exec until the rank's flight recorder takes it: a dump never kills
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    dup2(job->ctl[1], LAUNCH_FD);  // ctl[1] and control_fd are above CONTROL_FD: no dup2 clobbers them
    if (job->control_fd >= 0) dup2(job->control_fd, CONTROL_FD);
    execve(exe, argv, env);
    static const char msg[] = "dlua: cannot start a rank: exec failed\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(127);
  }
  int saved = errno;
  free_env(env);
  free(argv);
  close(out[1]);
  close(err[1]);
  if (pid < 0) {
    close(out[0]);
    close(err[0]);
    errno = saved;
    return -1;
  }
  if (job->pgid == 0) job->pgid = pid;
  setpgid(pid, job->pgid);  // also from here, so the group exists before the next fork
  r->pid = pid;
  r->running = 1;
  r->fd[0] = out[0];
  r->fd[1] = err[0];
  fcntl(out[0], F_SETFL, O_NONBLOCK);
  fcntl(err[0], F_SETFL, O_NONBLOCK);
  return 0;
}

/* A fresh store on node 0 (each run of the job gets its own: the last run's keys would mislead the next). */
static int start_store(dlua_job_t *job) {
  if (job->server) {
    dlua_store_server_stop(job->server);
    job->server = NULL;
  }
  /* single node: loopback only; several nodes: every interface, the others must reach it */
  const char *bind = job->o.nnodes > 1 ? "0.0.0.0" : job->host;
  if (dlua_store_server_start(bind, job->o.master_port, job->token, &job->server) != DLUA_OK) {
    fprintf(stderr, "dlua: cannot start the job's store: %s\n", dlua_last_error());
    return -1;
  }
  job->port = dlua_store_server_port(job->server);
  return 0;
}

/* Starts every local rank and the pump: once, then again for each restart. */
static int start_ranks(dlua_job_t *job) {
  for (int i = 0; i < job->o.nproc; i++) {
    rank_t *r = &job->ranks[i];
    for (int s = 0; s < 2; s++) free(r->buf[s].data);
    memset(r, 0, sizeof *r);
    r->fd[0] = r->fd[1] = -1;
  }
  job->pgid = 0;
  job->failed_rank = -1;
  job->finished = 0;
  job->kill_at = job->all_ended_at = job->peer_since = 0;
  if (job->control) dlua_control_reset(job->control);
  for (int i = 0; i < job->o.nproc; i++) {
    if (spawn(job, i, job->exe) != 0) {
      fprintf(stderr, "dlua: cannot start rank %d: %s\n", job->first_rank + i, strerror(errno));
      pthread_mutex_lock(&job->mu);
      signal_running(job, SIGKILL, -1);
      pthread_mutex_unlock(&job->mu);
      for (int j = 0; j < i; j++) waitpid(job->ranks[j].pid, NULL, 0);
      for (int j = 0; j < i; j++) job->ranks[j].running = 0;
      return -1;
    }
  }
  if (pthread_create(&job->pump, NULL, pump_main, job) != 0) {
    fprintf(stderr, "dlua: cannot start the launcher's output thread\n");
    signal_running(job, SIGKILL, -1);
    for (int j = 0; j < job->o.nproc; j++) waitpid(job->ranks[j].pid, NULL, 0);
    for (int j = 0; j < job->o.nproc; j++) job->ranks[j].running = 0;
    return -1;
  }
  job->pump_started = 1;
  return 0;
}

int dlua_job_start(const dlua_launch_opts_t *opts, dlua_job_t **out) {
  *out = NULL;
  dlua_job_t *job = calloc(1, sizeof *job);
  if (job == NULL) {
    fprintf(stderr, "dlua: out of memory starting the launcher\n");
    return -1;
  }
  job->o = *opts;
  job->failed_rank = -1;
  job->ctl[0] = job->ctl[1] = -1;
  job->control_fd = job->listen_fd = -1;
  job->reached = -1;
  pthread_mutex_init(&job->mu, NULL);
  pthread_cond_init(&job->cv, NULL);
  if (job->o.nnodes < 1) job->o.nnodes = 1;
  job->world = job->o.nproc * job->o.nnodes;
  job->first_rank = job->o.node_rank * job->o.nproc;
  int multi = job->o.nnodes > 1;

  if (parse_show(job) != 0) goto fail;
  snprintf(job->host, sizeof job->host, "%s", job->o.master_host ? job->o.master_host : "127.0.0.1");

  const char *tok = getenv("DLUA_JOB_TOKEN");
  if (tok && *tok) {
    snprintf(job->token, sizeof job->token, "%s", tok);
  } else if (multi) {
    /* every node's launcher must agree without talking first: derive it from the master */
    snprintf(job->token, sizeof job->token, "dlua:%s:%d", job->host, job->o.master_port);
  } else if (random_token(job->token, sizeof job->token) != 0) {
    fprintf(stderr, "dlua: cannot read /dev/urandom for the job token\n");
    goto fail;
  }

  if (job->o.node_rank == 0) {
    if (start_store(job) != 0) goto fail;
  } else {
    job->port = job->o.master_port;
  }
  if (multi && dlua_store_connect(job->host, job->port, job->token, 300000, &job->store) != DLUA_OK) {
    fprintf(stderr, "dlua: node %d cannot reach the job's store: %s\n", job->o.node_rank, dlua_last_error());
    goto fail;
  }

  /* the failure pipe; its write end stays open here too, so the read end never reports a hang-up */
  int ctl[2];
  if (pipe2(ctl, O_CLOEXEC | O_NONBLOCK) != 0) {
    fprintf(stderr, "dlua: cannot create the launcher's failure pipe: %s\n", strerror(errno));
    goto fail;
  }
  job->ctl[0] = ctl[0];
  job->ctl[1] = fcntl(ctl[1], F_DUPFD_CLOEXEC, CONTROL_FD + 1);
  close(ctl[1]);
  if (job->ctl[1] < 0) {
    fprintf(stderr, "dlua: cannot create the launcher's failure pipe: %s\n", strerror(errno));
    goto fail;
  }
  /* the control page (steps, attach's commands); without it the job runs, unattachable */
  int cfd = -1;
  job->control = dlua_control_create(job->o.nproc, job->first_rank, &cfd);
  if (job->control) {
    job->control_fd = fcntl(cfd, F_DUPFD_CLOEXEC, CONTROL_FD + 1);
    close(cfd);
    if (job->control_fd < 0) {
      dlua_control_destroy(job->control);
      job->control = NULL;
    }
  }
  job->ranks = calloc((size_t)job->o.nproc, sizeof *job->ranks);
  if (job->ranks == NULL) goto fail;
  for (int i = 0; i < job->o.nproc; i++) job->ranks[i].fd[0] = job->ranks[i].fd[1] = -1;
  if (dlua_launch_ctl_open(job) != 0) goto fail;
  /* DLUA_EXE: a wrapper that starts this dlua (tests/gpu/run.sh's bundle runs the binary through its own
     dynamic loader, so /proc/self/exe is the loader there). */
  const char *env_exe = getenv("DLUA_EXE");
  job->exe = job->o.exe ? job->o.exe : env_exe && *env_exe ? env_exe : "/proc/self/exe";
  if (start_ranks(job) != 0) goto fail;
  *out = job;
  return 0;
fail:
  dlua_job_free(job);
  return -1;
}

const char *dlua_job_store_host(const dlua_job_t *job) { return job->host; }
int dlua_job_store_port(const dlua_job_t *job) { return job->port; }
const char *dlua_job_token(const dlua_job_t *job) { return job->token; }
int dlua_job_world_size(const dlua_job_t *job) { return job->world; }

void dlua_job_interrupt(dlua_job_t *job) {
  pthread_mutex_lock(&job->mu);
  signal_running(job, SIGINT, -1);
  pthread_mutex_unlock(&job->mu);
}

int dlua_job_finished(dlua_job_t *job) {
  pthread_mutex_lock(&job->mu);
  int f = job->finished || job->failed_rank >= 0 || job->remote_failure[0];
  pthread_mutex_unlock(&job->mu);
  return f;
}

/* Node 0 keeps the store up until every node's ranks are done with it. */
static void multi_node_finish(dlua_job_t *job, int ok) {
  if (job->store == NULL) return;
  int64_t v = 0;
  if (ok) dlua_store_add(job->store, "dlua/launch/done", 1, &v);
  if (job->o.node_rank != 0 || !ok) return;
  while (v < job->o.nnodes && dlua_launch_signals_seen() == 0) {
    const char *keys[1] = {"dlua/launch/failed"};
    int exists = 0;
    if (dlua_store_check(job->store, keys, 1, &exists) == DLUA_OK && exists) break;
    usleep(200 * 1000);
    if (dlua_store_add(job->store, "dlua/launch/done", 0, &v) != DLUA_OK) break;
  }
}

/* The failure's summary: the rank that failed, how, its error; the ranks stopped with it. */
static void report_failure(dlua_job_t *job) {
  rank_t *r = &job->ranks[job->failed_rank];
  char how[128];
  describe_end(r, how, sizeof how);
  if (r->claim == CLAIM_OWN && r->stopped_by_us) {
    /* it failed, then hung closing (e.g. a collective in flight): say so rather than only the kill */
    char killed[sizeof how];
    memcpy(killed, how, sizeof how);
    snprintf(how, sizeof how, "an error, then %.80s as it did not exit", killed);
  }
  /* the others: stopped by us, or failed only because a peer (the failed rank) went away */
  char others[256] = "";
  size_t used = 0;
  int nstopped = 0;
  for (int i = 0; i < job->o.nproc && used < sizeof others - 16; i++) {
    const rank_t *q = &job->ranks[i];
    if (i == job->failed_rank || !(q->stopped_by_us || q->claim == CLAIM_PEER)) continue;
    used += (size_t)snprintf(others + used, sizeof others - used, "%s%d", nstopped ? ", " : "", job->first_rank + i);
    nstopped++;
  }
  fprintf(stderr, "dlua: rank %d failed (%s)%s%s\n", job->first_rank + job->failed_rank, how,
          r->last_error[0] ? ": " : "", r->last_error);
  if (nstopped) fprintf(stderr, "dlua: stopped rank%s %s\n", nstopped == 1 ? "" : "s", others);
}

/* After a failure: restarts the job when the budget allows and the job had started (every rank finished a
   step: a failure before that is start-up's, and would fail again, pytorch #60910). 1: restarted. */
static int maybe_restart(dlua_job_t *job) {
  if (job->o.max_restarts <= 0) return 0;
  int started = 0;
  int64_t reached = job->control ? dlua_control_max_step(job->control, &started) : -1;
  if (!started) {
    fprintf(stderr, "dlua: not restarting: the job failed during start-up (before every rank finished a step; "
                    "it would fail again)\n");
    return 0;
  }
  if (job->restarts >= job->o.max_restarts) {
    fprintf(stderr, "dlua: not restarting: %d restart%s of the job used (--max-restarts %d)\n", job->restarts,
            job->restarts == 1 ? "" : "s", job->o.max_restarts);
    return 0;
  }
  job->restarts++;
  job->reached = reached;
  fprintf(stderr, "dlua: restarting the job (restart %d of %d); it had finished step %lld\n", job->restarts,
          job->o.max_restarts, (long long)reached);
  if (job->o.node_rank == 0 && start_store(job) != 0) return 0;
  return start_ranks(job) == 0;
}

int dlua_job_wait(dlua_job_t *job) {
  int seen = 0;
  for (;;) {
    pthread_mutex_lock(&job->mu);
    int finished = job->finished;
    pthread_mutex_unlock(&job->mu);
    if (finished) {
      pthread_join(job->pump, NULL);
      job->pump_started = 0;
      if (job->interrupted || job->remote_failure[0] || job->failed_rank < 0) break;
      report_failure(job);
      if (!maybe_restart(job)) return 1;
      continue;
    }
    int s = dlua_launch_signals_seen();
    if (s > seen) {
      pthread_mutex_lock(&job->mu);
      if (seen == 0) {
        job->interrupted = 1;
        signal_running(job, SIGINT, -1);
        job->kill_at = dlua_launch_now() + INTERRUPT_GRACE_MS / 1000.0;
      } else {
        signal_running(job, SIGKILL, -1);
      }
      pthread_mutex_unlock(&job->mu);
      seen = s;
    }
    usleep(20 * 1000);
  }

  if (job->interrupted) {
    fprintf(stderr, "dlua: interrupted; stopped %d rank%s\n", job->o.nproc, job->o.nproc == 1 ? "" : "s");
    return 130;
  }
  if (job->remote_failure[0]) {
    fprintf(stderr, "dlua: job failed on another node: %s; stopped the ranks of node %d\n", job->remote_failure,
            job->o.node_rank);
    return 1;
  }
  multi_node_finish(job, 1);
  return 0;
}

void dlua_job_free(dlua_job_t *job) {
  if (job == NULL) return;
  dlua_launch_ctl_close(job);  // first: the attach thread reads the ranks
  if (job->ranks) {
    pthread_mutex_lock(&job->mu);
    signal_running(job, SIGKILL, -1);
    pthread_mutex_unlock(&job->mu);
  }
  if (job->pump_started) pthread_join(job->pump, NULL);
  if (job->ranks) {
    for (int i = 0; i < job->o.nproc; i++) {
      rank_t *r = &job->ranks[i];
      if (r->running) waitpid(r->pid, NULL, 0);
      for (int s = 0; s < 2; s++) {
        if (r->fd[s] >= 0) close(r->fd[s]);
        free(r->buf[s].data);
      }
    }
    free(job->ranks);
  }
  free(job->show);
  if (job->control) dlua_control_destroy(job->control);
  if (job->control_fd >= 0) close(job->control_fd);
  if (job->store) dlua_store_close(job->store);
  if (job->server) dlua_store_server_stop(job->server);
  for (int s = 0; s < 2; s++)
    if (job->ctl[s] >= 0) close(job->ctl[s]);
  pthread_cond_destroy(&job->cv);
  pthread_mutex_destroy(&job->mu);
  free(job);
}

/* The launcher's job, shared by its files: launch.c (start, watch, stop, restart), launch_output.c (tagged output,
   the failure pipe), launch_ctl.c (the job directory, `dlua attach`'s socket, flight-recorder dumps). */
#ifndef DLUA_COMM_LAUNCH_JOB_H
#define DLUA_COMM_LAUNCH_JOB_H
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "comm/control.h"
#include "comm/launch.h"
#include "core/api.h"

enum {
  LINE_MAX_BYTES = 65536,  /* a longer line is cut and emitted in pieces */
  STOP_GRACE_MS = 3000,    /* SIGTERM to SIGKILL when a rank failed */
  INTERRUPT_GRACE_MS = 10000, /* SIGINT to SIGKILL after Ctrl-C */
  DRAIN_MS = 1000,         /* output still read after every rank ended */
  WATCH_MS = 500,          /* multi-node: how often the job's failure key is checked */
  PEER_GRACE_MS = 1000,    /* a rank failed because a peer went away: how long to wait for the cause */
  LAUNCH_FD = 3,           /* the failure pipe's write end, in every rank */
  CONTROL_FD = 4,          /* the control page's memfd, in every rank */
  DUMP_MS = 3000           /* how long the ranks have to write their flight-recorder dumps */
};

/* What a failed rank said of itself on the failure pipe. */
enum { CLAIM_NONE, CLAIM_OWN, CLAIM_PEER };

typedef struct {
  char *data;
  size_t len;
} linebuf_t;

typedef struct {
  pid_t pid;
  int fd[2];          /* stdout, stderr pipes; -1 once closed */
  linebuf_t buf[2];
  int running;
  int status;         /* waitpid status once ended */
  int stopped_by_us;  /* we sent it a signal before it ended */
  char last_error[512];
  int in_traceback;
  int claim;          /* CLAIM_*: its line on the failure pipe, if any */
  long claim_seq;     /* that line's place in the pipe, from 1 */
  int64_t dumped;     /* the last dump it reported written */
  int dump_asked;     /* signalled for the running dump */
} rank_t;

struct dlua_job {
  dlua_launch_opts_t o;
  int world;
  int first_rank;                 /* global rank of local rank 0 */
  char token[320];
  char host[256];
  int port;
  dlua_store_server_t *server;
  dlua_store_t *store;            /* multi-node only: the failure key */
  rank_t *ranks;
  unsigned char *show;            /* per local rank: echo its output */
  pid_t pgid;
  pthread_t pump;
  int pump_started;
  pthread_mutex_t mu;
  int finished;
  int failed_rank;                /* local index of the rank that failed first, or -1 */
  char remote_failure[600];       /* another node reported a failure */
  int interrupted;
  double kill_at;                 /* 0: no deadline; else SIGKILL the rest then */
  double all_ended_at;
  double next_watch;
  int ctl[2];                     /* the failure pipe every rank writes to; -1 when closed */
  char ctlbuf[256];               /* a line of it not yet complete */
  size_t ctllen;
  long claims;                    /* lines read from it */
  double peer_since;              /* when a rank first failed because a peer went away (0: none) */
  int announced;                  /* multi-node: the failure is posted in the store */
  /* restarts (launch.c) */
  int restarts;                   /* done so far */
  int64_t reached;                /* the furthest step the failed run had finished (-1: none) */
  const char *exe;
  /* the job directory, the control page, `dlua attach` (launch_ctl.c) */
  char dir[PATH_MAX];             /* "": none */
  int own_dir;                    /* we made it: removed at the end unless it holds dumps */
  char flight_dir[PATH_MAX];      /* where ranks write their dumps */
  dlua_control_t *control;
  int control_fd;
  int listen_fd;
  pthread_t attach_thread;
  int attach_started;
  volatile int attach_stop;
  pthread_cond_t cv;              /* a dump's diagnosis is ready, or the job ended (with mu) */
  /* flight-recorder dumps (launch_ctl.c) */
  int64_t dump_id;                /* the last dump started, 0: none */
  int dump_active;
  double dump_deadline, dump_ended_at;
  char dump_reason[160];
  char *diagnosis;                /* the last dump's, for `dlua attach --dump` */
  int64_t diagnosis_id;
  int dumps_written;              /* some dump landed in the job directory: keep it */
};

double dlua_launch_now(void);

/* launch_output.c. Called with job->mu held (the pump thread). */
void dlua_launch_flush_lines(dlua_job_t *job, int li, int stream, int eof);
void dlua_launch_read_pipe(dlua_job_t *job, int li, int stream);
void dlua_launch_read_ctl(dlua_job_t *job);

/* launch_ctl.c */
/* The job directory (0700) with its token file and `dlua attach`'s socket; 0 or -1 (printed). */
int dlua_launch_ctl_open(dlua_job_t *job);
void dlua_launch_ctl_close(dlua_job_t *job);
/* Starts a dump of every running local rank (with job->mu held), unless one runs. */
void dlua_launch_dump_begin(dlua_job_t *job, const char *reason);
/* The pump's turn (job->mu held): ends a dump once every rank answered or its time is up, and prints
   the diagnosis. Nonzero while a dump is running (the pump then stops no rank). */
int dlua_launch_dump_poll(dlua_job_t *job);
/* Launcher's SIGUSR1 count (a dump request). */
int dlua_launch_dump_signals(void);

#endif

/* The launcher behind `dlua --nproc N`: starts the ranks of this node, tags their output,
   stops the whole job when one rank fails, and never leaves a process behind. */
#ifndef DLUA_COMM_LAUNCH_H
#define DLUA_COMM_LAUNCH_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
  int nproc;                /* ranks on this node */
  int nnodes;               /* nodes in the job (1: single node, store on loopback) */
  int node_rank;            /* this node, 0..nnodes-1 */
  const char *master_host;  /* multi-node: where node 0's store listens (NULL: 127.0.0.1) */
  int master_port;          /* 0: any free port (single node only) */
  const char *ranks_output; /* NULL: every rank's output; else "0" or "0,2,3" */
  int spmd_repl;            /* the ranks serve the SPMD REPL (the caller runs the frontend) */
  const char *exe;          /* the dlua binary to start (NULL: /proc/self/exe) */
  int max_restarts;         /* restarts of the whole job after a rank failed (single node) */
  int argc;                 /* arguments given to every rank after the executable */
  char **argv;
} dlua_launch_opts_t;

typedef struct dlua_job dlua_job_t;

/* Starts the store (node 0) and the ranks, and a thread that pumps their output and
   watches them. Returns 0, or prints why and returns -1. */
int dlua_job_start(const dlua_launch_opts_t *opts, dlua_job_t **job);

/* Where the ranks meet, for a frontend that talks to them through the store. */
const char *dlua_job_store_host(const dlua_job_t *job);
int dlua_job_store_port(const dlua_job_t *job);
const char *dlua_job_token(const dlua_job_t *job);
int dlua_job_world_size(const dlua_job_t *job);

/* Forwards Ctrl-C (SIGINT) to every local rank, e.g. to interrupt a REPL chunk. */
void dlua_job_interrupt(dlua_job_t *job);

/* Nonzero once a rank failed or every rank ended. */
int dlua_job_finished(dlua_job_t *job);

/* Waits until the job ends. A first Ctrl-C (SIGINT/SIGTERM to the launcher) forwards SIGINT
   to the ranks, a second or a 10 s grace period kills them. Returns the exit status for
   the launcher: 0 when every rank succeeded, 130 after Ctrl-C, 1 otherwise. */
int dlua_job_wait(dlua_job_t *job);

/* Stops the ranks if still running, the store, the thread; frees the job. */
void dlua_job_free(dlua_job_t *job);

/* The flight recorder's diagnosis of the dumps in dir (ranks first..first+n-1, dump number id), as
   text (malloc'ed; NULL: none). main.c supplies it: it is Lua (lua/dlua/flight.lua). */
typedef char *(*dlua_launch_diagnose_fn)(const char *dir, int first, int n, int64_t id);
void dlua_launch_set_diagnoser(dlua_launch_diagnose_fn fn);

/* Where the launcher with process id `pid` keeps its job directory (token, `dlua attach`'s socket,
   flight-recorder dumps): $DLUA_RUN_DIR, else $XDG_RUNTIME_DIR/dlua, else /tmp/dlua-<uid>, then
   /<pid>. Returns 0, or -1 when the name does not fit. */
int dlua_launch_job_dir(int pid, char *out, size_t cap);

/* GPUs this machine shows the ranks: CUDA_VISIBLE_DEVICES if set, else the NVIDIA driver's
   /proc entries. The launcher does not initialise CUDA itself (its children would inherit a
   context they cannot use). */
int dlua_launch_gpu_count(void);

/* ---- a rank's side (the process the launcher started) ----------------------------------
   The launcher hands each rank the write end of one pipe that every rank shares (fd
   DLUA_LAUNCH_FD). A rank whose program fails writes one line to it before its process groups
   close: whether it saw a peer go away first. A peer fails only after our connections close,
   so the cause's line precedes its consequences' in the pipe: that order, not exit timing,
   tells the launcher whom to blame. */

/* Takes DLUA_LAUNCH_FD out of the environment (a child dlua must not write to an unrelated fd)
   and keeps the fd, close-on-exec. Call once at startup; without the variable, nothing. */
void dlua_launch_rank_init(void);

/* 1 in a rank that a dlua launcher started (it has the pipe), 0 under mpirun, srun, torchrun or alone. */
int dlua_launch_has_launcher(void);

/* Writes "dlua-rank-<what> <local rank> <arg>" to the launcher's pipe; 1 when there is a launcher. */
int dlua_launch_notify(const char *what, const char *arg);

/* Records that a collective failed because a peer closed its connection or exited. Any thread. */
void dlua_launch_note_peer_lost(void);

/* Tells the launcher (if any) that this rank's program failed: "own" or, after a peer was
   lost, "peer". Call before closing the Lua state. */
void dlua_launch_report_failure(void);

/* Installs the launcher's SIGINT/SIGTERM handling (a flag dlua_job_wait reads) and SIGUSR1 (every rank
   dumps its flight recorder). */
void dlua_launch_install_signals(void);
/* Set by those handlers: how many Ctrl-C/SIGTERM arrived. */
int dlua_launch_signals_seen(void);
void dlua_launch_signals_reset(void);

#endif

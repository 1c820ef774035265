/* The flight recorder: a ring of this process's last N collectives (every group, every backend), written as JSON on demand. */
#ifndef DLUA_COMM_FLIGHT_H
#define DLUA_COMM_FLIGHT_H
#include <stddef.h>
#include <stdint.h>

#include "comm/pg_backend.h"

/* The group's life of a work, called by pg.c and pg_worker.c; each costs one short lock. */
void dlua_flight_issued(const dlua_pg_t *pg, const dlua_work_t *w);  /* queued or posted, seq set */
void dlua_flight_started(const dlua_work_t *w);                      /* the comm thread runs it */
void dlua_flight_ended(const dlua_work_t *w);                        /* w->status and w->msg are final */

/* Where this process is, as the agent found it (flight_agent.c), for the dump. */
typedef struct {
  const char *state;      /* "lua" (traceback), "c" (C stack: inside a C call), "unknown" */
  const char *traceback;  /* newline-separated "file:line function" frames, innermost first (or NULL) */
  const char *c_stack;    /* newline-separated frames (or NULL) */
} dlua_flight_where_t;

/* Writes <dir>/flight-rank<r>.json (r: RANK, else 0) through a temporary file and a rename. reason says
   what asked for it ("timeout", "signal", "attach"...), dump_id which job-wide dump it belongs to (0:
   none). The directory (and its parents) are created (0700) if missing. */
dlua_status_t dlua_flight_write(const char *dir, const char *reason, int64_t dump_id, const dlua_flight_where_t *where);

/* mkdir -p dir (mode 0700); 0, or -1 with errno. */
int dlua_flight_mkdirs(const char *dir);

/* The directory dumps go to: DLUA_FLIGHT_DIR, else the current directory. */
const char *dlua_flight_default_dir(void);

/* This process's rank and world size from the launchers' variables (dlua --nproc and torchrun's RANK, mpirun's,
   srun's), 0 and 1 without them. */
int dlua_flight_rank(void);
int dlua_flight_world(void);

/* One word naming this job, the same on every rank (PMIx's namespace, Open MPI's job id, torchrun's run id, Slurm's
   job and step, the store's address), "-" when nothing names it: a dump request of another job is not ours. */
void dlua_flight_job_key(char *out, size_t cap);

/* The diagnosis's first line ("flight recorder (REASON): DIR/flight-rank{0..3}.json"), and the diagnosis printed
   on stderr as the launcher's lines: "dlua: " before the heading, "dlua:   " before each line of text. */
void dlua_flight_heading(char *out, size_t cap, const char *reason, const char *dir, int first, int n);
void dlua_flight_print(const char *head, const char *text);

/* The dump number in DIR/flight-rank<r>.json, -1 when there is no such file. */
int64_t dlua_flight_dump_id_of(const char *dir, int rank);

#endif

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
   none). The directory is created (0700) if missing. */
dlua_status_t dlua_flight_write(const char *dir, const char *reason, int64_t dump_id, const dlua_flight_where_t *where);

/* The directory dumps go to: DLUA_FLIGHT_DIR, else the current directory. */
const char *dlua_flight_default_dir(void);

#endif

/* Process groups' diagnostics: the message that names the ranks that did not arrive, the launcher's own/peer verdict, debug mode. */
#ifndef DLUA_COMM_PG_DIAG_H
#define DLUA_COMM_PG_DIAG_H
#include <stdint.h>

#include "comm/pg_backend.h"

/* After w failed with r (be_msg: the backend's text): writes where this rank is to the store
   ("<name>/at/<rank>" = "<seq> <collective> <site>"), listens up to 2 s for where the others are, and
   sets w's status and message naming the ranks that did not arrive. A peer that closed its connection
   or exited makes this rank's failure a consequence: the launcher is told (dlua_launch_note_peer_lost). */
void dlua_pg_diagnose(dlua_pg_t *pg, dlua_work_t *w, dlua_pg_result_t r, const char *be_msg, int64_t timeout_ms);
/* A group closing normally says "exited after <seq>" under its key, before its connections close. */
void dlua_pg_diag_note_exit(dlua_pg_t *pg, int64_t seq);
/* Debug mode: every rank compares what it is about to call. 0: they agree; 1: they do not (w fails
   alike on every rank, the group stays usable); 2: the exchange failed (w diagnosed: break the group). */
int dlua_pg_debug_check(dlua_pg_t *pg, dlua_work_t *w, int64_t timeout);

#endif

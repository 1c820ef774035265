/* Process groups' works and the threads that run them (pg_worker.c), for pg.c. */
#ifndef DLUA_COMM_PG_WORKER_H
#define DLUA_COMM_PG_WORKER_H
#include <pthread.h>

#include "comm/pg_backend.h"

/* A zeroed work of `kind` for pg, at `site`; NULL (the error recorded) when out of memory. */
dlua_work_t *dlua_pg_work_new(dlua_pg_t *pg, int kind, const char *site);
/* Frees a work that never reached a thread, or that has completed. */
void dlua_pg_work_destroy(dlua_work_t *w);
/* The group is unusable after w's failure: later calls fail at once, naming it. */
void dlua_pg_mark_broken(dlua_pg_t *pg, const dlua_work_t *w);

/* Queues the prepared w for the comm thread (numbering it), or fails at once when the group is broken;
   then hands it back (work != NULL) or waits for it. Takes w in every case. */
dlua_status_t dlua_pg_enqueue(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work);
/* After the backend posted the send/recv w: the p2p thread waits for it (started on first use), or w
   is done at once when nothing is in flight; then as dlua_pg_enqueue. Takes w. */
dlua_status_t dlua_pg_track_posted(dlua_pg_t *pg, dlua_work_t *w, dlua_work_t **work);

/* Starts a thread that blocks every signal (so do the threads it starts: gloo's event loop), so
   Ctrl-C goes to the caller's thread and SIGPIPE from a dead peer's socket is never delivered. */
int dlua_pg_start_quiet_thread(pthread_t *th, void *(*fn)(void *), void *arg);
/* The comm thread: joins through the backend, then runs the queue in order until the group closes. */
void *dlua_pg_comm_main(void *pg);

#endif

/* Process-wide runtime settings: versions, thread count, the Ctrl-C flag. */
#ifndef DLUA_CORE_RUNTIME_H
#define DLUA_CORE_RUNTIME_H
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* True once Ctrl-C was pressed and not yet consumed; cheap enough for inner loops. */
extern volatile int dlua_interrupt_flag;

/* Every signal but the synchronous faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT): the mask of
   dlua's background threads, so Ctrl-C and the launcher's signals reach the main thread. A fault stays deliverable:
   blocked, the kernel kills the process at once, and no crash handler (MPI's, dlua's note naming the collective in
   flight) gets to say where. */
void dlua_async_signals(sigset_t *set);

/* Names the calling thread (at most 15 characters: "dlua-comm"), as top -H, gdb and /proc/PID/task/TID/comm show it. */
void dlua_thread_name(const char *name);

#endif

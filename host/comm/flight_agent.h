/* A rank's flight-recorder agent: SIGUSR1 (or a timeout, or the launcher) makes it dump the ring with where the rank is. */
#ifndef DLUA_COMM_FLIGHT_AGENT_H
#define DLUA_COMM_FLIGHT_AGENT_H
#include <stdint.h>

/* Installs SIGUSR1 (dump this rank: the launcher sends it with sigqueue and a dump number) and starts
   the thread that writes dumps. Call once, on the main thread, in a process that runs a program (not in
   the launcher). */
void dlua_agent_start(void);

/* The Lua side (lua_state.c): `trigger` asks the running Lua code for its traceback; it is called
   from the agent's thread and must be async-signal-safe. The Lua code answers with
   dlua_agent_lua_where, on its own thread, while dlua_agent_lua_wanted() is nonzero. */
void dlua_agent_set_lua(void (*trigger)(void));
int dlua_agent_lua_wanted(void);
void dlua_agent_lua_where(const char *traceback);

/* A collective timed out here: under the launcher every local rank dumps (the launcher sends the
   signals and prints the diagnosis). Without one (mpirun, srun, torchrun), when there are several ranks, this
   rank writes DIR/flight-request (DIR: DLUA_FLIGHT_DIR, else the current directory) and the same line into the
   job's store (if there is one), every rank's agent finds it within 0.2 s and dumps, and this rank prints the diagnosis once the dumps are there (at most 2.5 s). Alone,
   this rank dumps. At most one request per 5 s. */
void dlua_agent_request_job_dump(const char *reason);

/* The program failed and the process is about to exit: waits (at most ms) for a dump that is being written or that
   the launcher is about to ask for (this rank asked it to, after a timeout), so the dump is not lost with the process. */
void dlua_agent_flush(int ms);

/* The job's store (pg.c, at its first process group): without a launcher, dump requests go there too, and every
   rank's agent looks for them there (over a connection of its own), so ranks whose dump directories differ see them. */
void dlua_agent_note_store(const char *host, int port, const char *token);

/* The diagnosis of dumps that a rank without a launcher prints after its request (as dlua_launch_set_diagnoser). */
void dlua_agent_set_diagnoser(char *(*fn)(const char *dir, int first, int n, int64_t id));

#endif

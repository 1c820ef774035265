/* The SPMD REPL of `dlua --nproc N -i`: the launcher reads chunks, every rank runs them. */
#ifndef DLUA_SPMD_REPL_H
#define DLUA_SPMD_REPL_H
#include <lua.h>

#include "comm/launch.h"

/* The launcher's side: the prompt, sending chunks to the ranks through the job's store,
   printing their outputs tagged by rank (identical ones collapsed). Ends the job at end of
   input and returns the launcher's exit status. */
int dlua_spmd_frontend(dlua_job_t *job);

/* A rank's side: runs `require('dlua.spmd').serve()`, which executes what the frontend
   sends until it says exit. Returns the Lua status. */
int dlua_spmd_serve(lua_State *L);

#endif

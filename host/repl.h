/* The read-eval-print loop: libedit on a terminal, plain statements from a pipe. */
#ifndef DLUA_REPL_H
#define DLUA_REPL_H
#include <lua.h>

/* Runs until end of input; returns 0 (errors inside chunks are printed, not fatal). */
int dlua_repl(lua_State *L);

#endif

/* The read-eval-print loop: libedit on a terminal, plain statements from a pipe. */
#ifndef DLUA_REPL_H
#define DLUA_REPL_H
#include <lua.h>

/* Runs until end of input; returns 0 (errors inside chunks are printed, not fatal). */
int dlua_repl(lua_State *L);

/* Runs one complete chunk (its text as typed, possibly ":on N ..."); returns nonzero to end
   the loop. */
typedef int (*dlua_repl_exec_fn)(lua_State *L, const char *chunk, void *ctx);

/* The loop itself: reads lines (libedit with history on a terminal, getline from a pipe),
   joins them until L compiles them (a leading ":on N" is skipped for that check), and hands
   each complete chunk to `exec`. */
int dlua_repl_loop(lua_State *L, dlua_repl_exec_fn exec, void *ctx);

/* Where the code of a chunk starts: after a leading ":on <digits> ", else the chunk. */
const char *dlua_repl_code(const char *chunk);

#endif

/* The embedded LuaJIT state: creation, module paths, protected calls with traceback, Ctrl-C. */
#ifndef DLUA_LUA_STATE_H
#define DLUA_LUA_STATE_H
#include <lua.h>
#include <stdint.h>

/* Opens a state with the standard libraries, dlua's module paths and the `dlua.host`
   preload. Returns NULL (message printed) on failure. */
lua_State *dlua_state_new(void);

/* lua_pcall with a traceback handler; Ctrl-C during the call raises "interrupted". */
int dlua_state_docall(lua_State *L, int narg, int nres);

/* Prints the error message on top of the stack to stderr ("dlua: ...") and pops it. */
void dlua_state_report(lua_State *L, int status);

/* Loads and runs a file (NULL: stdin) with the arguments already on the stack. */
int dlua_state_dofile_args(lua_State *L, const char *path, int narg);

/* Runs `dlua = require 'dlua'`; reports failures and returns their status. */
int dlua_state_preload_global(lua_State *L);

/* The flight recorder's diagnosis (lua/dlua/flight.lua) of the dumps dir/flight-rank<first..first+n-1>.json
   of dump `id` (0: any), as text to free; for the launcher (dlua_launch_set_diagnoser). */
char *dlua_state_flight_diagnosis(const char *dir, int first, int n, int64_t id);

/* The directory holding lua/dlua/init.lua, as found at start-up. */
const char *dlua_state_root(void);

/* Called by the REPL around its prompt: Ctrl-C then cancels the line instead. */
void dlua_state_at_prompt(int on);
int dlua_state_prompt_interrupted(void);

#endif

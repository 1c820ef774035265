/* The embedded LuaJIT state: creation, module paths, protected calls with traceback, Ctrl-C. */
#include "lua_state.h"

#include <errno.h>
#include <limits.h>
#include <luajit.h>
#include <lauxlib.h>
#include <lualib.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "comm/flight_agent.h"
#include "core/api.h"

extern const char dlua_embedded_header[];

static lua_State *g_L;
static volatile sig_atomic_t g_in_call;
static volatile sig_atomic_t g_at_prompt;
static volatile sig_atomic_t g_prompt_interrupted;
static char g_root[PATH_MAX];
static char g_exe[PATH_MAX];

/* ---- Ctrl-C ------------------------------------------------------------------------ */

/* Runs inside Lua at the next call, return or instruction after Ctrl-C. */
static void interrupt_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  if (!dlua_interrupt_pending()) return;  // a C op already turned it into an error
  dlua_interrupt_set(0);
  luaL_error(L, "interrupted");
}

static void on_sigint(int sig) {
  (void)sig;
  if (g_at_prompt) {
    g_prompt_interrupted = 1;
    return;
  }
  if (g_in_call && dlua_interrupt_pending()) {
    /* The first Ctrl-C was never taken: LuaJIT runs compiled traces without hooks, so a
       tight loop can miss it. A second press ends the process rather than hang. */
    static const char msg[] = "\ndlua: interrupted twice while Lua ran a compiled loop; exiting\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(130);
  }
  dlua_interrupt_set(1);
  if (g_L && g_in_call) lua_sethook(g_L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

static void install_sigint(int restart) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = restart ? SA_RESTART : 0;
  sigaction(SIGINT, &sa, NULL);
}

void dlua_state_at_prompt(int on) {
  if (on) {
    g_prompt_interrupted = 0;  // kept after the prompt, for the REPL to read
    dlua_interrupt_set(0);     // a Ctrl-C from before the prompt is stale
  }
  g_at_prompt = on;
  install_sigint(!on);  // at the prompt a read must return EINTR to cancel the line
}

int dlua_state_prompt_interrupted(void) { return g_prompt_interrupted; }

/* ---- where the Lua code is, for the flight recorder ------------------------------------ */

/* LuaJIT's profiler runs its callback at the next line the Lua code reaches, in machine code too (traces
   compiled with it on check for it at every new line), where a hook never runs inside a compiled loop.
   So the profiler is on from the start with its timer stopped, and the flight recorder's agent fires it
   once, by hand, when it wants a traceback. */
static pthread_t g_lua_thread;

static void where_cb(void *data, lua_State *L, int samples, int vmstate) {
  (void)data;
  (void)samples;
  (void)vmstate;
  if (!dlua_agent_lua_wanted()) return;  // a stray SIGPROF
  size_t len = 0;
  const char *s = luaJIT_profile_dumpstack(L, "pl\n", 40, &len);
  char buf[8192];
  snprintf(buf, sizeof buf, "%.*s", (int)len, s ? s : "");
  dlua_agent_lua_where(buf);
}

static void where_trigger(void) { pthread_kill(g_lua_thread, SIGPROF); }

static void start_where(lua_State *L) {
  const char *v = getenv("DLUA_FLIGHT_LUA");
  if (v && !strcmp(v, "0")) return;
  g_lua_thread = pthread_self();
  luaJIT_profile_start(L, "li1000000", where_cb, NULL);
  struct itimerval off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_PROF, &off, NULL);  // no sampling: only the agent's SIGPROF
  dlua_agent_set_lua(where_trigger);
}

/* ---- protected calls ---------------------------------------------------------------- */

static int traceback_handler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

int dlua_state_docall(lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, traceback_handler);
  lua_insert(L, base);
  g_in_call = 1;
  /* A Ctrl-C that landed between reading a line and this call still counts. */
  if (dlua_interrupt_pending()) lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
  int status = lua_pcall(L, narg, nres, base);
  g_in_call = 0;
  lua_sethook(L, NULL, 0, 0);
  dlua_interrupt_set(0);
  lua_remove(L, base);
  return status;
}

void dlua_state_report(lua_State *L, int status) {
  if (status == 0 || lua_isnil(L, -1)) return;
  const char *msg = lua_tostring(L, -1);
  if (msg == NULL) msg = "(error object is not a string)";
  fprintf(stderr, "dlua: %s\n", msg);
  fflush(stderr);
  lua_pop(L, 1);
}

int dlua_state_dofile_args(lua_State *L, const char *path, int narg) {
  int status = luaL_loadfile(L, path);
  if (status != 0) {
    lua_insert(L, -(narg + 1));
    lua_pop(L, narg);
    if (status == LUA_ERRFILE && path != NULL) {
      /* luaL_loadfile says "cannot open x.lua: No such file..."; keep lua's familiar form. */
      lua_pop(L, 1);
      lua_pushfstring(L, "cannot open %s (%s)", path, strerror(errno));
    }
    return status;
  }
  lua_insert(L, -(narg + 1));
  return dlua_state_docall(L, narg, 0);
}

int dlua_state_preload_global(lua_State *L) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "dlua");
  int status = dlua_state_docall(L, 1, 1);
  if (status != 0) return status;
  lua_setglobal(L, "dlua");
  return 0;
}

/* ---- module paths ------------------------------------------------------------------- */

static int file_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

static int has_dlua_tree(const char *dir) {
  char probe[PATH_MAX];
  if (snprintf(probe, sizeof probe, "%s/lua/dlua/init.lua", dir) >= (int)sizeof probe) return 0;
  return file_exists(probe);
}

/* The root is the first of: the executable's parent (build/ or bin/ inside the tree),
   <prefix>/share/dlua (installed), the executable's own folder (a flat bundle), and the
   source tree this binary was built from. */
static void find_root(void) {
  ssize_t n = readlink("/proc/self/exe", g_exe, sizeof g_exe - 1);
  g_exe[n > 0 ? n : 0] = '\0';
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", g_exe);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = '\0';

  static const char *const suffix[3] = {"/..", "/../share/dlua", ""};
  char cand[PATH_MAX];
  for (int i = 0; i < 4; i++) {
    int len;
    if (i < 3) {
      if (n <= 0) continue;
      len = snprintf(cand, sizeof cand, "%s%s", dir, suffix[i]);
    } else {
      len = snprintf(cand, sizeof cand, "%s", DLUA_SOURCE_DIR);
    }
    if (len >= (int)sizeof cand || !has_dlua_tree(cand)) continue;
    if (!realpath(cand, g_root)) memcpy(g_root, cand, (size_t)len + 1);
    return;
  }
  g_root[0] = '\0';
}

const char *dlua_state_root(void) { return g_root; }

/* package.path = DLUA_PATH entries; root/lua, root (models.*, recipes.*, bindings.*);
   then whatever LUA_PATH or LuaJIT's default gave. A DLUA_PATH entry without '?' is a
   folder and gets '/?.lua' and '/?/init.lua'. */
static void set_paths(lua_State *L) {
  luaL_Buffer b;
  lua_getglobal(L, "package");
  luaL_buffinit(L, &b);
  const char *extra = getenv("DLUA_PATH");
  if (extra && *extra) {
    const char *p = extra;
    while (*p) {
      const char *end = strchr(p, ';');
      size_t len = end ? (size_t)(end - p) : strlen(p);
      if (len > 0) {
        if (memchr(p, '?', len)) {
          luaL_addlstring(&b, p, len);
          luaL_addchar(&b, ';');
        } else {
          for (int k = 0; k < 2; k++) {
            luaL_addlstring(&b, p, len);
            luaL_addstring(&b, k == 0 ? "/?.lua;" : "/?/init.lua;");
          }
        }
      }
      p += len;
      if (*p == ';') p++;
    }
  }
  if (g_root[0]) {
    const char *fmt[] = {"%s/lua/?.lua;", "%s/lua/?/init.lua;", "%s/?.lua;", "%s/?/init.lua;"};
    for (int k = 0; k < 4; k++) {
      lua_pushfstring(L, fmt[k], g_root);
      luaL_addvalue(&b);
    }
  }
  luaL_pushresult(&b);
  lua_getfield(L, -2, "path");
  lua_concat(L, 2);
  lua_setfield(L, -2, "path");
  lua_pop(L, 1);
}

/* require 'dlua.host': what the C side knows that Lua cannot find out by itself. */
static int open_host(lua_State *L) {
  lua_createtable(L, 0, 8);
  lua_pushstring(L, dlua_embedded_header);
  lua_setfield(L, -2, "header");
  lua_pushstring(L, g_root);
  lua_setfield(L, -2, "root");
  lua_pushstring(L, g_exe);
  lua_setfield(L, -2, "exe");
  lua_pushstring(L, dlua_version());
  lua_setfield(L, -2, "version");
  lua_pushstring(L, LUAJIT_VERSION);
  lua_setfield(L, -2, "luajit_version");
  lua_pushstring(L, dlua_cuda_build_info());
  lua_setfield(L, -2, "cuda_build");
  return 1;
}

lua_State *dlua_state_new(void) {
  find_root();
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, "dlua: cannot create the Lua state (out of memory)\n");
    return NULL;
  }
  g_L = L;
  luaL_openlibs(L);
  set_paths(L);
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, open_host);
  lua_setfield(L, -2, "dlua.host");
  lua_pop(L, 2);
  install_sigint(1);
  start_where(L);
  return L;
}

/* The launcher's diagnosis of flight-recorder dumps: lua/dlua/flight.lua in a state of its own (no signal
   handling: the launcher keeps its own). */
char *dlua_state_flight_diagnosis(const char *dir, int first, int n, int64_t id) {
  if (!g_root[0]) find_root();
  lua_State *L = luaL_newstate();
  if (L == NULL) return NULL;
  luaL_openlibs(L);
  set_paths(L);
  char *out = NULL;
  lua_pushcfunction(L, traceback_handler);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "dlua.flight");
  if (lua_pcall(L, 1, 1, 1) == 0) {
    lua_getfield(L, -1, "diagnose");
    lua_pushstring(L, dir);
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, first);
    lua_setfield(L, -2, "first");
    lua_pushinteger(L, n);
    lua_setfield(L, -2, "count");
    lua_pushnumber(L, (lua_Number)id);
    lua_setfield(L, -2, "dump_id");
    if (lua_pcall(L, 2, 1, 1) == 0 && lua_isstring(L, -1)) {
      out = strdup(lua_tostring(L, -1));
    } else {
      const char *e = lua_tostring(L, -1);
      size_t cap = 64 + (e ? strlen(e) : 0);
      out = malloc(cap);
      if (out) snprintf(out, cap, "the diagnosis failed: %s", e ? e : "?");
    }
  } else {
    const char *e = lua_tostring(L, -1);
    size_t cap = 64 + (e ? strlen(e) : 0);
    out = malloc(cap);
    if (out) snprintf(out, cap, "no diagnosis: %s", e ? e : "?");
  }
  lua_close(L);
  return out;
}

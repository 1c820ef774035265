/* The read-eval-print loop: libedit on a terminal, plain statements from a pipe. */
#include "repl.h"

#include <editline/readline.h>
#include <lauxlib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lua_state.h"

enum { HISTORY_MAX = 1000 };

typedef struct {
  int tty;
  char history[4096];  /* empty: no history file */
} repl_t;

/* Returns a malloc'd line without its newline, or NULL at end of input / on Ctrl-C. */
static char *read_line(repl_t *r, int continuation) {
  if (r->tty) {
    dlua_state_at_prompt(1);
    char *line = readline(continuation ? ">> " : "> ");
    dlua_state_at_prompt(0);
    return line;
  }
  char *line = NULL;
  size_t cap = 0;
  ssize_t n = getline(&line, &cap, stdin);
  if (n < 0) {
    free(line);
    return NULL;
  }
  if (n > 0 && line[n - 1] == '\n') line[n - 1] = '\0';
  return line;
}

/* lua.c's rule: a syntax error at <eof> means the chunk is not finished yet. */
static int incomplete(lua_State *L, int status) {
  if (status != LUA_ERRSYNTAX) return 0;
  size_t len;
  const char *msg = lua_tolstring(L, -1, &len);
  static const char eof[] = "'<eof>'";
  size_t k = sizeof eof - 1;
  return msg && len >= k && strcmp(msg + len - k, eof) == 0;
}

/* Compiles the buffer: first as an expression so bare expressions print, then as is.
   `return select(1, <buf>)` keeps every value and, unlike `return <buf>`, is no tail
   call, so an error raised by <buf> keeps its "stdin:N:" position. */
static int compile(lua_State *L, const char *buf) {
  const char *src = buf;
  if (buf[0] == '=') src = buf + 1;
  lua_pushfstring(L, "return select(1, %s\n)", src);
  size_t len;
  const char *ret = lua_tolstring(L, -1, &len);
  int status = luaL_loadbuffer(L, ret, len, "=stdin");
  lua_remove(L, -2);
  if (status == 0 || buf[0] == '=') return status;
  lua_pop(L, 1);
  return luaL_loadbuffer(L, buf, strlen(buf), "=stdin");
}

static void print_results(lua_State *L, int printer_ref, int base) {
  int n = lua_gettop(L) - base;
  if (n <= 0) return;
  if (printer_ref != LUA_NOREF) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, printer_ref);
    lua_insert(L, base + 1);
    int status = dlua_state_docall(L, n, 0);
    if (status) dlua_state_report(L, status);
  } else {
    lua_getglobal(L, "print");
    lua_insert(L, base + 1);
    int status = dlua_state_docall(L, n, 0);
    if (status) dlua_state_report(L, status);
  }
  lua_settop(L, base);
}

static int setup_printer(lua_State *L) {
  int ref = LUA_NOREF;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "dlua.pretty");
  if (lua_pcall(L, 1, 1, 0) != 0) {
    lua_pop(L, 1);
    return ref;
  }
  lua_getfield(L, -1, "print_values");
  if (lua_isfunction(L, -1))
    ref = luaL_ref(L, LUA_REGISTRYINDEX);
  else
    lua_pop(L, 1);
  lua_pop(L, 1);
  return ref;
}

static void setup_history(repl_t *r) {
  r->history[0] = '\0';
  if (!r->tty) return;
  const char *home = getenv("HOME");
  if (!home || !*home) return;
  snprintf(r->history, sizeof r->history, "%s/.dlua_history", home);
  using_history();
  stifle_history(HISTORY_MAX);
  read_history(r->history);  // a missing file is fine: it is created on the first line
}

static void remember(repl_t *r, const char *chunk) {
  if (!r->history[0] || !chunk[0]) return;
  add_history(chunk);
  write_history(r->history);  // every chunk, so a killed session keeps its history
}

const char *dlua_repl_code(const char *chunk) {
  const char *p = chunk;
  while (*p == ' ' || *p == '\t') p++;
  if (strncmp(p, ":on", 3) != 0 || (p[3] != ' ' && p[3] != '\t')) return chunk;
  p += 3;
  while (*p == ' ' || *p == '\t') p++;
  if (*p < '0' || *p > '9') return chunk;
  while (*p >= '0' && *p <= '9') p++;
  while (*p == ' ' || *p == '\t') p++;
  return p;
}

int dlua_repl_loop(lua_State *L, dlua_repl_exec_fn exec, void *ctx) {
  repl_t r;
  memset(&r, 0, sizeof r);
  r.tty = isatty(STDIN_FILENO);
  setup_history(&r);

  char *chunk = NULL;  /* the lines of an unfinished chunk, joined by '\n' */
  size_t chunk_len = 0;
  for (;;) {
    char *line = read_line(&r, chunk != NULL);
    if (line == NULL) {
      if (r.tty && dlua_state_prompt_interrupted()) {  // Ctrl-C: drop the line, go on
        fputs("\n", stdout);
        fflush(stdout);
        free(chunk);
        chunk = NULL;
        chunk_len = 0;
        continue;
      }
      if (chunk) {  // end of input inside an unfinished chunk: say why it is invalid
        int base = lua_gettop(L);
        const char *code = dlua_repl_code(chunk);
        if (luaL_loadbuffer(L, code, strlen(code), "=stdin") != 0) dlua_state_report(L, 1);
        lua_settop(L, base);
        free(chunk);
      }
      if (r.tty) fputs("\n", stdout);
      break;
    }
    size_t len = strlen(line);
    char *joined = realloc(chunk, chunk_len + len + 2);
    if (!joined) {
      fprintf(stderr, "dlua: out of memory reading input\n");
      free(line);
      break;
    }
    if (chunk) joined[chunk_len++] = '\n';
    memcpy(joined + chunk_len, line, len + 1);
    chunk = joined;
    chunk_len += len;
    free(line);

    int base = lua_gettop(L);
    int status = compile(L, dlua_repl_code(chunk));
    int more = incomplete(L, status);
    lua_settop(L, base);
    if (more) continue;  // ask for more
    remember(&r, chunk);
    int stop = exec(L, chunk, ctx);
    free(chunk);
    chunk = NULL;
    chunk_len = 0;
    fflush(stdout);
    if (stop) break;
  }
  return 0;
}

typedef struct {
  int printer_ref; /* dlua.pretty.print_values, or LUA_NOREF */
} local_t;

static int run_local(lua_State *L, const char *chunk, void *ctx) {
  local_t *lo = ctx;
  if (dlua_repl_code(chunk) != chunk) {
    fprintf(stderr, "dlua: ':on N' runs a chunk on one rank of `dlua --nproc N -i`; this REPL has one process\n");
    return 0;
  }
  int base = lua_gettop(L);
  int status = compile(L, chunk);
  if (status == 0) status = dlua_state_docall(L, 0, LUA_MULTRET);
  if (status == 0)
    print_results(L, lo->printer_ref, base);
  else
    dlua_state_report(L, status);
  lua_settop(L, base);
  return 0;
}

int dlua_repl(lua_State *L) {
  int status = dlua_state_preload_global(L);
  if (status) dlua_state_report(L, status);  // the REPL still works as plain Lua
  local_t lo;
  lo.printer_ref = setup_printer(L);
  return dlua_repl_loop(L, run_local, &lo);
}

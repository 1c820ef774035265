/* dlua's command line: options, scripts with arguments, -e/-l/-i, versions, the REPL. */
#include <lauxlib.h>
#include <luajit.h>
#include <lua.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/api.h"
#include "lua_state.h"
#include "repl.h"

static void print_usage(FILE *f) {
  fputs(
      "usage: dlua [options] [script.lua [args...]]\n"
      "Runs a dlua training script or recipe; with no script, a REPL on a terminal, or the\n"
      "program read from standard input otherwise.\n"
      "\n"
      "options:\n"
      "  -e stmt        execute the Lua statement stmt (the global `dlua` is preloaded)\n"
      "  -l name        require library `name` and assign it to the global `name`\n"
      "  -i             enter the REPL after running the script (or -e)\n"
      "  -v, --version  print the versions of dlua, LuaJIT and the CUDA libraries\n"
      "  -h, --help     print this help\n"
      "  --             stop handling options\n"
      "  -              run the program read from standard input\n"
      "\n"
      "environment:\n"
      "  DLUA_PATH      extra module folders or ?-templates, ';'-separated, searched first\n"
      "  LUA_PATH       the usual Lua module path, searched after dlua's own tree\n",
      f);
}

static void print_version(void) {
  printf("dlua %s\n", dlua_version());
  printf("%s (%s)\n", LUAJIT_VERSION, DLUA_LUAJIT_KIND);
  if (dlua_has_cuda_build())
    printf("built against %s\n", dlua_cuda_build_info());
  else
    printf("no CUDA (built without the CUDA backend)\n");
  fflush(stdout);
}

typedef struct {
  int interactive;   /* -i */
  int version;       /* -v */
  int has_exec;      /* some -e or -l */
  int script;        /* argv index of the script, or 0 */
  int script_stdin;  /* the script is "-" */
} options_t;

/* Checks the options; returns 0 or prints the error and returns -1. */
static int parse_options(int argc, char **argv, options_t *o) {
  memset(o, 0, sizeof *o);
  int i;
  for (i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-') break;
    if (strcmp(a, "-") == 0) {
      o->script_stdin = 1;
      break;
    }
    if (strcmp(a, "--") == 0) {
      i++;
      break;
    }
    if (strcmp(a, "-i") == 0) {
      o->interactive = 1;
    } else if (strcmp(a, "-v") == 0 || strcmp(a, "--version") == 0) {
      o->version = 1;
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      print_usage(stdout);
      exit(0);
    } else if (strcmp(a, "-e") == 0 || strcmp(a, "-l") == 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "dlua: '%s' needs an argument\n", a);
        print_usage(stderr);
        return -1;
      }
      o->has_exec = 1;
      i++;
    } else if ((a[1] == 'e' || a[1] == 'l') && a[2] != '\0') {
      o->has_exec = 1;  // -e'stmt' / -lname, as lua accepts
    } else {
      fprintf(stderr, "dlua: unrecognized option '%s'\n", a);
      print_usage(stderr);
      return -1;
    }
  }
  if (i < argc) o->script = i;
  return 0;
}

/* arg[0] = script, arg[1..] = its arguments, negative indices = dlua and its options. */
static void create_arg_table(lua_State *L, int argc, char **argv, int script) {
  int base = script > 0 ? script : argc;
  lua_createtable(L, argc - base, base + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - base);
  }
  lua_setglobal(L, "arg");
}

static int run_exec_options(lua_State *L, int argc, char **argv, int upto) {
  int preloaded = 0;
  for (int i = 1; i < upto; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) break;
    if (a[0] != '-' || (a[1] != 'e' && a[1] != 'l')) continue;
    const char *val = a[2] ? a + 2 : argv[++i];
    int status;
    if (a[1] == 'e') {
      if (!preloaded) {
        status = dlua_state_preload_global(L);
        if (status) {
          dlua_state_report(L, status);
          return status;
        }
        preloaded = 1;
      }
      status = luaL_loadbuffer(L, val, strlen(val), "=(command line)");
      if (status == 0) status = dlua_state_docall(L, 0, 0);
    } else {
      lua_getglobal(L, "require");
      lua_pushstring(L, val);
      status = dlua_state_docall(L, 1, 1);
      if (status == 0) lua_setglobal(L, val);
    }
    if (status) {
      dlua_state_report(L, status);
      return status;
    }
  }
  return 0;
}

static int run_script(lua_State *L, int argc, char **argv, const options_t *o) {
  const char *path = NULL;
  int first_arg;
  if (o->script_stdin) {
    first_arg = o->script + 1;
  } else {
    path = argv[o->script];
    first_arg = o->script + 1;
  }
  int narg = argc - first_arg;
  luaL_checkstack(L, narg + 3, "too many arguments to the script");
  for (int i = first_arg; i < argc; i++) lua_pushstring(L, argv[i]);
  int status = dlua_state_dofile_args(L, path, narg);
  if (status) dlua_state_report(L, status);
  return status;
}

int main(int argc, char **argv) {
  options_t o;
  if (parse_options(argc, argv, &o) != 0) return 1;
  if (o.version) {
    print_version();
    if (!o.script && !o.script_stdin && !o.has_exec && !o.interactive) return 0;
  }

  lua_State *L = dlua_state_new();
  if (L == NULL) return 1;
  int script_at = o.script;  // index of the script (or "-"), 0 if none
  create_arg_table(L, argc, argv, script_at);

  int status = run_exec_options(L, argc, argv, script_at ? script_at : argc);
  if (status == 0 && (o.script || o.script_stdin)) status = run_script(L, argc, argv, &o);

  if (status == 0) {
    int want_repl = o.interactive;
    if (!o.script && !o.script_stdin && !o.has_exec && !o.version && !o.interactive) {
      if (isatty(STDIN_FILENO)) {
        want_repl = 1;
      } else {
        status = dlua_state_dofile_args(L, NULL, 0);  // like lua: a program on stdin
        if (status) dlua_state_report(L, status);
      }
    }
    if (want_repl && status == 0) {
      if (isatty(STDIN_FILENO) && !o.version) print_version();
      status = dlua_repl(L);
    }
  }
  lua_close(L);
  return status == 0 ? 0 : 1;
}

/* dlua's command line: options, scripts with arguments, -e/-l/-i, versions, the REPL. */
#include <lauxlib.h>
#include <luajit.h>
#include <lua.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attach.h"
#include "comm/control.h"
#include "comm/flight_agent.h"
#include "comm/launch.h"
#include "core/api.h"
#include "lua_state.h"
#include "repl.h"
#include "spmd_repl.h"

static void print_usage(FILE *f) {
  fputs(
      "usage: dlua [options] [script.lua [args...]]\n"
      "       dlua attach PID|JOBDIR [--rank R] [--dump]   (a running job: docs/launch.md)\n"
      "       dlua plot|experiment|flight [args...]   (subcommands; `dlua plot --help`)\n"
      "Runs a dlua training script or recipe; with no script, a REPL on a terminal, or the\n"
      "program read from standard input otherwise.\n"
      "\n"
      "options:\n"
      "  -e stmt        execute the Lua statement stmt (the global `dlua` is preloaded)\n"
      "  -l name        require library `name` and assign it to the global `name`\n"
      "  -i             enter the REPL after running the script (or -e)\n"
      "  -v, --version  print the versions of dlua, LuaJIT and the CUDA libraries\n"
      "  -h, --help     print this help\n"
      "  -              run the program read from standard input\n"
      "  --             stop handling options\n"
      "\n"
      "launching ranks (docs/launch.md):\n"
      "  --nproc N      start N ranks of the script or -e code here ('gpu': one per GPU)\n"
      "  --nnodes M     the job spans M machines (default 1), each started with --nproc\n"
      "  --node-rank K  this machine is node K, 0..M-1\n"
      "  --master H:P   where node 0's rendezvous store listens (multi-node; single-node\n"
      "                 jobs use a free port on 127.0.0.1)\n"
      "  --ranks-output R  show only these ranks' output, e.g. 0 or 0,3\n"
      "  --max-restarts K  when a rank fails, restart the whole job up to K times (the\n"
      "                 recipe resumes from its newest checkpoint: docs/launch.md)\n"
      "\n"
      "environment:\n"
      "  DLUA_PATH      extra module folders or ?-templates, ';'-separated, searched first\n"
      "  LUA_PATH       the usual Lua module path, searched after dlua's own tree\n"
      "  DLUA_EXE       what --nproc starts for each rank (default: this dlua binary)\n"
      "  DLUA_FLIGHT_DIR  where ranks write flight-recorder dumps (SIGUSR1, a timeout)\n"
      "  DLUA_RUN_DIR   where launchers keep their jobs' private directories (dlua attach)\n"
      "  DLUA_NAN_CHECK loss (default), modules or off: dlua.monitor's NaN guard\n"
      "  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun), SLURM_PROCID...,\n"
      "  OMPI_COMM_WORLD_RANK...: a script calling dlua.dist.init() joins that job\n",
      f);
}

static void print_version(void) {
  printf("dlua %s\n", dlua_version());
  printf("%s (%s)\n", LUAJIT_VERSION, DLUA_LUAJIT_KIND);
  if (dlua_has_cuda_build()) {
    printf("built against %s\n", dlua_cuda_build_info());
    printf("%s\n", dlua_cuda_runtime_info());  // driver, devices, loaded libraries; or why none
  } else
    printf("no CUDA (built without the CUDA backend)\n");
  fflush(stdout);
}

typedef struct {
  int nproc;         /* --nproc: 0 = no launcher, -1 = one per GPU */
  int nnodes;
  int node_rank;
  char master_host[256];
  int master_port;
  const char *ranks_output;
  int max_restarts;
  int launcher_opts; /* any launcher option given */
  int interactive;   /* -i */
  int version;       /* -v */
  int has_exec;      /* some -e or -l */
  int script;        /* argv index of the script, or 0 */
  int script_stdin;  /* the script is "-" */
} options_t;

static int parse_int(const char *opt, const char *v, int lo, int hi, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || x < lo || x > hi) {
    fprintf(stderr, "dlua: %s '%s': expected a whole number in %d..%d\n", opt, v, lo, hi);
    return -1;
  }
  *out = (int)x;
  return 0;
}

/* The launcher's options (--nproc N, --nnodes M, --node-rank K, --master H:P,
   --ranks-output R, also as --opt=value). Returns 1 if argv[*i] was one (advancing *i past
   its value), 0 if not, -1 after printing an error. */
static int launcher_option(int argc, char **argv, int *i, options_t *o) {
  static const char *names[] = {"--nproc", "--nnodes", "--node-rank", "--master", "--ranks-output",
                                "--max-restarts", NULL};
  const char *a = argv[*i];
  int which = -1;
  const char *val = NULL;
  for (int k = 0; names[k]; k++) {
    size_t n = strlen(names[k]);
    if (strncmp(a, names[k], n) == 0 && (a[n] == '\0' || a[n] == '=')) {
      which = k;
      if (a[n] == '=') val = a + n + 1;
    }
  }
  if (which < 0) return 0;
  if (val == NULL) {
    if (*i + 1 >= argc) {
      fprintf(stderr, "dlua: '%s' needs a value\n", a);
      return -1;
    }
    val = argv[++*i];
  }
  o->launcher_opts = 1;
  switch (which) {
    case 0:
      if (strcmp(val, "gpu") == 0) {
        o->nproc = -1;
        return 1;
      }
      return parse_int("--nproc", val, 1, 4096, &o->nproc) ? -1 : 1;
    case 1: return parse_int("--nnodes", val, 1, 65536, &o->nnodes) ? -1 : 1;
    case 2: return parse_int("--node-rank", val, 0, 65535, &o->node_rank) ? -1 : 1;
    case 3: {
      const char *colon = strrchr(val, ':');
      if (colon == NULL || colon == val || (size_t)(colon - val) >= sizeof o->master_host) {
        fprintf(stderr, "dlua: --master '%s': expected host:port\n", val);
        return -1;
      }
      memcpy(o->master_host, val, (size_t)(colon - val));
      o->master_host[colon - val] = '\0';
      return parse_int("--master port", colon + 1, 1, 65535, &o->master_port) ? -1 : 1;
    }
    case 5: return parse_int("--max-restarts", val, 0, 1000000, &o->max_restarts) ? -1 : 1;
    default: o->ranks_output = val; return 1;
  }
}

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
    int lo = launcher_option(argc, argv, &i, o);
    if (lo < 0) return -1;
    if (lo > 0) continue;
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
  if (o->launcher_opts && o->nproc == 0) {
    fprintf(stderr, "dlua: --nnodes/--node-rank/--master/--ranks-output/--max-restarts need --nproc\n");
    return -1;
  }
  if (o->nnodes == 0) o->nnodes = 1;
  if (o->node_rank >= o->nnodes) {
    fprintf(stderr, "dlua: --node-rank %d: expected 0..%d for --nnodes %d\n", o->node_rank, o->nnodes - 1, o->nnodes);
    return -1;
  }
  if (o->nnodes > 1 && o->master_host[0] == '\0') {
    fprintf(stderr, "dlua: --nnodes %d needs --master host:port (where node 0's store listens)\n", o->nnodes);
    return -1;
  }
  if (o->max_restarts > 0 && o->nnodes > 1) {
    fprintf(stderr, "dlua: --max-restarts restarts a single-node job; for several nodes use the cluster's "
                    "scheduler (each node's launcher would restart on its own)\n");
    return -1;
  }
  if (o->max_restarts > 0 && o->interactive) {
    fprintf(stderr, "dlua: --max-restarts does not go with -i (the SPMD REPL)\n");
    return -1;
  }
  if (o->nproc != 0 && !o->script && !o->script_stdin && !o->interactive && !o->has_exec) {
    fprintf(stderr, "dlua: --nproc needs a script to run, -e code, or -i for the SPMD REPL\n");
    return -1;
  }
  if (o->nproc != 0 && o->script_stdin) {
    fprintf(stderr, "dlua: --nproc cannot run a program from standard input ('-'): give a script file\n");
    return -1;
  }
  return 0;
}

/* `dlua --nproc N [options] script args`: the ranks run this binary with the same command
   line minus the launcher's options (and minus -i: the launcher runs the REPL frontend). */
static int launch(int argc, char **argv, const options_t *o) {
  int nproc = o->nproc;
  if (nproc < 0) {
    nproc = dlua_launch_gpu_count();
    if (nproc <= 0) {
      fprintf(stderr, "dlua: --nproc gpu: no CUDA device available\n");
      return 1;
    }
  }
  char **rargv = calloc((size_t)argc, sizeof *rargv);
  if (rargv == NULL) return 1;
  int rargc = 0;
  int i;
  for (i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (o->script && i >= o->script) break;
    if (strcmp(a, "--") == 0) break;
    options_t scratch;
    memset(&scratch, 0, sizeof scratch);
    int j = i;
    if (launcher_option(argc, argv, &j, &scratch) > 0) {
      i = j;
      continue;
    }
    if (strcmp(a, "-i") == 0) continue;
    rargv[rargc++] = argv[i];
    if ((strcmp(a, "-e") == 0 || strcmp(a, "-l") == 0) && i + 1 < argc) rargv[rargc++] = argv[++i];
  }
  for (; i < argc; i++) rargv[rargc++] = argv[i];

  dlua_launch_opts_t lo;
  memset(&lo, 0, sizeof lo);
  lo.nproc = nproc;
  lo.nnodes = o->nnodes;
  lo.node_rank = o->node_rank;
  lo.master_host = o->master_host[0] ? o->master_host : NULL;
  lo.master_port = o->master_port;
  lo.ranks_output = o->ranks_output;
  lo.spmd_repl = o->interactive;
  lo.max_restarts = o->max_restarts;
  lo.argc = rargc;
  lo.argv = rargv;
  dlua_launch_install_signals();
  dlua_launch_set_diagnoser(dlua_state_flight_diagnosis);
  dlua_job_t *job;
  if (dlua_job_start(&lo, &job) != 0) {
    free(rargv);
    return 1;
  }
  int rc = o->interactive ? dlua_spmd_frontend(job) : dlua_job_wait(job);
  dlua_job_free(job);
  free(rargv);
  return rc;
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

/* `dlua plot ...`, `dlua experiment ...`: a script name that is a bare word (no '/' or '.') and no
   file here names a subcommand; lua/dlua/cmd.lua runs it (or says there is no such file or
   subcommand). */
static int is_subcommand(const char *a) {
  return a[0] != '\0' && strchr(a, '/') == NULL && strchr(a, '.') == NULL && access(a, F_OK) != 0;
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
  luaL_checkstack(L, narg + 5, "too many arguments to the script");
  int status;
  if (path != NULL && is_subcommand(path)) {
    lua_getglobal(L, "require");
    lua_pushliteral(L, "dlua.cmd");
    status = dlua_state_docall(L, 1, 1);
    if (status == 0) {
      lua_getfield(L, -1, "run");
      lua_remove(L, -2);
      lua_pushstring(L, path);
      for (int i = first_arg; i < argc; i++) lua_pushstring(L, argv[i]);
      status = dlua_state_docall(L, narg + 1, 0);
    }
  } else {
    for (int i = first_arg; i < argc; i++) lua_pushstring(L, argv[i]);
    status = dlua_state_dofile_args(L, path, narg);
  }
  if (status) dlua_state_report(L, status);
  return status;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "attach") == 0) return dlua_attach_main(argc - 1, argv + 1);
  options_t o;
  if (parse_options(argc, argv, &o) != 0) return 1;
  if (o.version) {
    print_version();
    if (!o.script && !o.script_stdin && !o.has_exec && !o.interactive) return 0;
  }
  if (o.nproc != 0) return launch(argc, argv, &o);
  dlua_launch_rank_init();  // a rank of `dlua --nproc N`: where to say that it failed
  dlua_control_rank_init(); // ... and its launcher's control page (dlua attach, restarts)
  dlua_agent_start();       // SIGUSR1 dumps the flight recorder
  dlua_agent_set_diagnoser(dlua_state_flight_diagnosis);  // printed by a rank that asked for a dump under mpirun
  /* a rank under the launcher writes into a pipe: flush each line so output is live */
  if (getenv("DLUA_LAUNCHER")) setvbuf(stdout, NULL, _IOLBF, 0);

  lua_State *L = dlua_state_new();
  if (L == NULL) return 1;
  int script_at = o.script;  // index of the script (or "-"), 0 if none
  create_arg_table(L, argc, argv, script_at);

  int status = run_exec_options(L, argc, argv, script_at ? script_at : argc);
  if (status == 0 && (o.script || o.script_stdin)) status = run_script(L, argc, argv, &o);

  int spmd = getenv("DLUA_SPMD_REPL") != NULL;
  if (status == 0) {
    int want_repl = o.interactive;
    if (!spmd && !o.script && !o.script_stdin && !o.has_exec && !o.version && !o.interactive) {
      if (isatty(STDIN_FILENO)) {
        want_repl = 1;
      } else {
        status = dlua_state_dofile_args(L, NULL, 0);  // like lua: a program on stdin
        if (status) dlua_state_report(L, status);
      }
    }
    if (status == 0 && spmd) {
      status = dlua_spmd_serve(L);  // a rank of `dlua --nproc N -i`: run what the frontend sends
      want_repl = 0;
    }
    if (want_repl && status == 0) {
      if (isatty(STDIN_FILENO) && !o.version) print_version();
      status = dlua_repl(L);
    }
  }
  /* before lua_close closes our process groups: that is what makes the peers fail */
  if (status != 0) {
    dlua_agent_flush(3000);  // a flight-recorder dump in progress (say, after this rank's collective timed out)
    dlua_launch_report_failure();
  }
  lua_close(L);
  return status == 0 ? 0 : 1;
}

/* `dlua attach PID|JOBDIR`: a REPL into a running job of `dlua --nproc` through its launcher's Unix socket. */
#define _GNU_SOURCE 1
#include "attach.h"

#include <errno.h>
#include <limits.h>
#include <lua.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "comm/launch.h"
#include "core/api.h"
#include "lua_state.h"
#include "repl.h"

typedef struct {
  int fd;
  int rank;      /* the rank that runs plain chunks */
  int world;
  int lost;      /* the job went away */
} client_t;

static const char usage[] =
    "usage: dlua attach PID|JOBDIR [--rank R] [--dump] [--token T] [-e CHUNK]...\n"
    "Connects to a job started by `dlua --nproc N` (PID: its launcher's process id). Each chunk runs on\n"
    "rank R (default 0) at its next step boundary and prints what it returns (=loss, =lr, =model...).\n"
    "Commands, run on every rank at the same step:\n"
    "  :lr X          set the learning rate to X from the next step on (instead of the schedule)\n"
    "  :checkpoint    save a checkpoint after this step (the recipe's --save directory)\n"
    "  :stop          stop after this step (saving first, as --stop-after)\n"
    "  :all CHUNK     run CHUNK on every rank at the same step\n"
    "and :rank R (where chunks run), :dump (flight recorder: every rank's dump and the diagnosis), :help.\n";

static int send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* One reply frame ("ok <len>\n<text>"): 1 ok, 0 an error, -1 the connection ended. *text to free. */
static int read_reply(int fd, char **text) {
  *text = NULL;
  char head[64];
  size_t n = 0;
  for (;;) {
    if (n + 1 >= sizeof head) return -1;
    ssize_t k = read(fd, head + n, 1);
    if (k < 0 && errno == EINTR) {
      if (dlua_interrupt_pending()) return -2;
      continue;
    }
    if (k <= 0) return -1;
    if (head[n] == '\n') break;
    n++;
  }
  head[n] = '\0';
  char kind[8];
  size_t len;
  if (sscanf(head, "%7s %zu", kind, &len) != 2) return -1;
  char *buf = malloc(len + 1);
  if (!buf) return -1;
  size_t got = 0;
  while (got < len) {
    ssize_t k = read(fd, buf + got, len - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      free(buf);
      return -1;
    }
    got += (size_t)k;
  }
  buf[len] = '\0';
  *text = buf;
  return strcmp(kind, "ok") == 0 ? 1 : 0;
}

static void print_text(FILE *f, const char *text) {
  size_t n = strlen(text);
  fputs(text, f);
  if (n > 0 && text[n - 1] != '\n') fputc('\n', f);
  fflush(f);
}

/* Sends one request and prints its answer; 0 when the session may go on. */
static int request(client_t *c, const char *kind, long arg, const char *code) {
  char head[96];
  size_t len = code ? strlen(code) : 0;
  int h = snprintf(head, sizeof head, "%s %ld %zu\n", kind, arg, len);
  if (send_all(c->fd, head, (size_t)h) != 0 || (len && send_all(c->fd, code, len) != 0)) {
    fprintf(stderr, "dlua attach: the job went away\n");
    c->lost = 1;
    return 1;
  }
  char *text;
  int r = read_reply(c->fd, &text);
  if (r == -2) {
    fprintf(stderr, "dlua attach: interrupted: the command may still run at the rank's next step boundary\n");
    c->lost = 1;
    return 1;
  }
  if (r < 0) {
    fprintf(stderr, "dlua attach: the job went away\n");
    c->lost = 1;
    return 1;
  }
  print_text(r ? stdout : stderr, text);
  free(text);
  return 0;
}

static const char *skip_ws(const char *p) {
  while (*p == ' ' || *p == '\t') p++;
  return p;
}

static int is_cmd(const char *p, const char *name, const char **rest) {
  size_t n = strlen(name);
  if (strncmp(p, name, n) != 0 || (p[n] && p[n] != ' ' && p[n] != '\t' && p[n] != '\n')) return 0;
  *rest = skip_ws(p + n);
  return 1;
}

static int run_chunk(lua_State *L, const char *chunk, void *ctx) {
  (void)L;
  client_t *c = ctx;
  const char *p = skip_ws(chunk), *rest;
  if (*p == '\0') return 0;
  if (is_cmd(p, ":help", &rest)) {
    fputs(usage, stdout);
    return 0;
  }
  if (is_cmd(p, ":quit", &rest) || is_cmd(p, ":q", &rest)) return 1;
  if (is_cmd(p, ":dump", &rest)) return request(c, "dump", 0, "");
  if (is_cmd(p, ":rank", &rest)) {
    char *end;
    long r = strtol(rest, &end, 10);
    if (end == rest || r < 0 || r >= c->world) {
      fprintf(stderr, "dlua attach: :rank R with R in 0..%d\n", c->world - 1);
      return 0;
    }
    c->rank = (int)r;
    printf("chunks run on rank %d\n", c->rank);
    return 0;
  }
  if (is_cmd(p, ":lr", &rest)) {
    char *end;
    double v = strtod(rest, &end);
    if (end == rest || *skip_ws(end) != '\0' || !(v >= 0)) {
      fprintf(stderr, "dlua attach: :lr X with a learning rate X >= 0\n");
      return 0;
    }
    char code[96];
    snprintf(code, sizeof code, "set_lr(%.17g)", v);
    return request(c, "all", 0, code);
  }
  if (is_cmd(p, ":checkpoint", &rest)) return request(c, "all", 0, "checkpoint()");
  if (is_cmd(p, ":stop", &rest)) return request(c, "all", 0, "stop()");
  if (is_cmd(p, ":all", &rest)) return request(c, "all", 0, rest);
  if (*p == ':') {
    fprintf(stderr, "dlua attach: unknown command '%.*s' (:help lists them)\n", (int)strcspn(p, " \t\n"), p);
    return 0;
  }
  return request(c, "run", c->rank, chunk);
}

static int read_token(const char *dir, char *out, size_t cap) {
  char path[PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/token", dir);
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "dlua attach: cannot read %s: %s\n", path, strerror(errno));
    return -1;
  }
  int ok = fgets(out, (int)cap, f) != NULL;
  fclose(f);
  out[strcspn(out, "\r\n")] = '\0';
  return ok && out[0] ? 0 : -1;
}

int dlua_attach_main(int argc, char **argv) {
  const char *target = NULL, *token_opt = NULL;
  int rank = 0, dump = 0;
  const char *chunks[64];
  int nchunks = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      fputs(usage, stdout);
      return 0;
    } else if (!strcmp(a, "--dump")) {
      dump = 1;
    } else if ((!strcmp(a, "--rank") || !strcmp(a, "--token") || !strcmp(a, "-e")) && i + 1 < argc) {
      const char *v = argv[++i];
      if (!strcmp(a, "--token")) {
        token_opt = v;
      } else if (!strcmp(a, "-e")) {
        if (nchunks < 64) chunks[nchunks++] = v;
      } else {
        char *end;
        long r = strtol(v, &end, 10);
        if (*v == '\0' || *end || r < 0) {
          fprintf(stderr, "dlua attach: --rank '%s': expected a rank (0, 1, ...)\n", v);
          return 2;
        }
        rank = (int)r;
      }
    } else if (a[0] == '-') {
      fprintf(stderr, "dlua attach: unknown option '%s'\n%s", a, usage);
      return 2;
    } else if (!target) {
      target = a;
    } else {
      fprintf(stderr, "dlua attach: one job at a time ('%s' and '%s')\n", target, a);
      return 2;
    }
  }
  if (!target) {
    fputs(usage, stderr);
    return 2;
  }
  char dir[PATH_MAX];
  if (strspn(target, "0123456789") == strlen(target)) {
    if (dlua_launch_job_dir(atoi(target), dir, sizeof dir) != 0) {
      fprintf(stderr, "dlua attach: the job directory's name is too long\n");
      return 1;
    }
  } else {
    snprintf(dir, sizeof dir, "%s", target);
  }
  struct stat st;
  if (stat(dir, &st) != 0) {
    if (errno == EACCES)
      fprintf(stderr, "dlua attach: cannot reach %s: %s (another user's job?)\n", dir, strerror(errno));
    else
      fprintf(stderr, "dlua attach: no job at %s (%s): is %s a launcher of `dlua --nproc`, still running?\n", dir,
              strerror(errno), target);
    return 1;
  }
  char token[400];
  if (token_opt)
    snprintf(token, sizeof token, "%s", token_opt);
  else if (read_token(dir, token, sizeof token) != 0)
    return 1;

  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/attach.sock", dir) >= (int)sizeof sa.sun_path) {
    fprintf(stderr, "dlua attach: the socket's path is too long: %s/attach.sock\n", dir);
    return 1;
  }
  client_t c = {socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), rank, 0, 0};
  if (c.fd < 0 || connect(c.fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int e = errno;
    fprintf(stderr, "dlua attach: cannot connect to %s: %s%s\n", sa.sun_path, strerror(e),
            e == ECONNREFUSED || e == ENOENT ? " (the job ended?)" : e == EACCES ? " (another user's job?)" : "");
    return 1;
  }
  char hello[512];
  snprintf(hello, sizeof hello, "dlua-attach 1 %s\n", token);
  char *text = NULL;
  if (send_all(c.fd, hello, strlen(hello)) != 0 || read_reply(c.fd, &text) != 1) {
    fprintf(stderr, "dlua attach: %s\n", text ? text : "the job closed the connection");
    free(text);
    close(c.fd);
    return 1;
  }
  if (sscanf(text, "world_size %d", &c.world) != 1) c.world = 1;
  free(text);
  if (c.rank >= c.world) {
    fprintf(stderr, "dlua attach: --rank %d: the job has ranks 0..%d\n", c.rank, c.world - 1);
    close(c.fd);
    return 2;
  }
  int rc = 0;
  if (dump) {
    rc = request(&c, "dump", 0, "") || c.lost;
  } else if (nchunks > 0) {
    for (int i = 0; i < nchunks && !c.lost; i++) run_chunk(NULL, chunks[i], &c);
    rc = c.lost;
  } else {
    lua_State *L = dlua_state_new();  // only to tell complete chunks from unfinished ones
    if (!L) {
      close(c.fd);
      return 1;
    }
    if (isatty(STDIN_FILENO))
      printf("dlua attach: %s (%d ranks); chunks run on rank %d at its next step boundary; :help\n", dir, c.world, c.rank);
    dlua_repl_loop(L, run_chunk, &c);
    lua_close(L);
    rc = c.lost;
  }
  close(c.fd);
  return rc;
}

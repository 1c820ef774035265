/* The launcher's output: each rank's lines tagged `[r] ` as they come, the error line the summary quotes, and the
   failure pipe on which ranks say that they failed or ask for and report flight-recorder dumps. */
#define _GNU_SOURCE 1
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/launch_job.h"

/* ---- output ------------------------------------------------------------------------- */

static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // our own stdout is gone: nothing useful left to do with the text
    }
    p += w;
    n -= (size_t)w;
  }
}

/* Remembers the line that starts the rank's last error report ("dlua: <message>"), the
   line the failure summary quotes. */
static void note_error_line(rank_t *r, const char *line, size_t n) {
  static const char tb[] = "stack traceback:";
  if (n >= sizeof tb - 1 && memcmp(line, tb, sizeof tb - 1) == 0) {
    r->in_traceback = 1;
    return;
  }
  if (r->in_traceback && (line[0] == '\t' || line[0] == ' ')) return;
  r->in_traceback = 0;
  static const char pre[] = "dlua: ";
  if (n > sizeof pre - 1 && memcmp(line, pre, sizeof pre - 1) == 0) {
    line += sizeof pre - 1;
    n -= sizeof pre - 1;
  } else if (r->last_error[0] && strncmp(r->last_error, "dlua", 4) != 0) {
    /* keep a "dlua: " line over later plain ones (e.g. a C library's chatter) */
  }
  if (n == 0) return;
  if (n >= sizeof r->last_error) n = sizeof r->last_error - 1;
  memcpy(r->last_error, line, n);
  r->last_error[n] = '\0';
}

static void emit_line(dlua_job_t *job, int li, int stream, const char *line, size_t n) {
  rank_t *r = &job->ranks[li];
  if (stream == 1) note_error_line(r, line, n);
  if (!job->show[li]) return;
  char prefix[32];
  int pn = snprintf(prefix, sizeof prefix, "[%d] ", job->first_rank + li);
  char *out = malloc((size_t)pn + n + 1);
  if (out == NULL) return;
  memcpy(out, prefix, (size_t)pn);
  memcpy(out + pn, line, n);
  out[(size_t)pn + n] = '\n';
  write_all(stream == 0 ? STDOUT_FILENO : STDERR_FILENO, out, (size_t)pn + n + 1);
  free(out);
}

/* Emits the complete lines in the rank's buffer; at EOF (or a full buffer) the rest too. */
void dlua_launch_flush_lines(dlua_job_t *job, int li, int stream, int eof) {
  linebuf_t *b = &job->ranks[li].buf[stream];
  size_t start = 0;
  for (size_t i = 0; i < b->len; i++) {
    if (b->data[i] == '\n') {
      emit_line(job, li, stream, b->data + start, i - start);
      start = i + 1;
    }
  }
  if ((eof || b->len - start >= LINE_MAX_BYTES) && b->len > start) {
    emit_line(job, li, stream, b->data + start, b->len - start);
    start = b->len;
  }
  memmove(b->data, b->data + start, b->len - start);
  b->len -= start;
}

void dlua_launch_read_pipe(dlua_job_t *job, int li, int stream) {
  rank_t *r = &job->ranks[li];
  linebuf_t *b = &r->buf[stream];
  char chunk[16384];
  ssize_t n = read(r->fd[stream], chunk, sizeof chunk);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    dlua_launch_flush_lines(job, li, stream, 1);
    close(r->fd[stream]);
    r->fd[stream] = -1;
    return;
  }
  char *grown = realloc(b->data, b->len + (size_t)n);
  if (grown == NULL) return;  // drop this piece rather than stop pumping
  b->data = grown;
  memcpy(b->data + b->len, chunk, (size_t)n);
  b->len += (size_t)n;
  dlua_launch_flush_lines(job, li, stream, 0);
}

/* One line of the failure pipe: "dlua-rank-<what> <local rank> <arg>". */
static void ctl_line(dlua_job_t *job, const char *line) {
  static const char tag[] = "dlua-rank-";
  int li = -1;
  char what[16] = "", arg[96] = "";
  if (strncmp(line, tag, sizeof tag - 1) != 0 || sscanf(line + sizeof tag - 1, "%15s %d %95[^\n]", what, &li, arg) < 2 ||
      li < 0 || li >= job->o.nproc)
    return;  // not ours
  rank_t *r = &job->ranks[li];
  if (!strcmp(what, "failed")) {
    if (r->claim != CLAIM_NONE) return;
    r->claim = strcmp(arg, "peer") == 0 ? CLAIM_PEER : CLAIM_OWN;
    r->claim_seq = ++job->claims;
  } else if (!strcmp(what, "dumped")) {
    r->dumped = strtoll(arg, NULL, 10);
    job->dumps_written = 1;
  } else if (!strcmp(what, "dump")) {
    char reason[160];
    snprintf(reason, sizeof reason, "a collective timed out on rank %d", job->first_rank + li);
    dlua_launch_dump_begin(job, reason);
  }
}

/* Reads the failure pipe: each line claims a failure for a local rank (in the order written), or asks for
   a dump, or says that one was written. */
void dlua_launch_read_ctl(dlua_job_t *job) {
  if (job->ctl[0] < 0) return;
  for (;;) {
    ssize_t n = read(job->ctl[0], job->ctlbuf + job->ctllen, sizeof job->ctlbuf - 1 - job->ctllen);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    job->ctllen += (size_t)n;
    job->ctlbuf[job->ctllen] = '\0';
    char *start = job->ctlbuf, *nl;
    while ((nl = strchr(start, '\n')) != NULL) {
      *nl = '\0';
      ctl_line(job, start);
      start = nl + 1;
    }
    job->ctllen = strlen(start);
    memmove(job->ctlbuf, start, job->ctllen);
    if (job->ctllen == sizeof job->ctlbuf - 1) job->ctllen = 0;  // not ours: drop it
  }
}

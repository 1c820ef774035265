/* A rank's side of the launcher (`dlua --nproc`): the shared pipe on which a rank says that it failed, and asks for or reports flight-recorder dumps. */
#define _GNU_SOURCE 1
#include "comm/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_report_fd = -1;
static int g_local_rank = -1;
static atomic_int g_peer_lost;
static atomic_int g_reported;

void dlua_launch_rank_init(void) {
  const char *v = getenv("DLUA_LAUNCH_FD");
  const char *lr = getenv("LOCAL_RANK");
  if (v == NULL) return;
  int fd = atoi(v);
  struct stat st;
  /* only the pipe the launcher gave us: an inherited variable may name an unrelated fd */
  if (fd > 2 && lr != NULL && fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode)) {
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    g_report_fd = fd;
    g_local_rank = atoi(lr);
  }
  unsetenv("DLUA_LAUNCH_FD");
}

int dlua_launch_has_launcher(void) { return g_report_fd >= 0; }

void dlua_launch_note_peer_lost(void) { atomic_store(&g_peer_lost, 1); }

int dlua_launch_notify(const char *what, const char *arg) {
  if (g_report_fd < 0) return 0;
  char line[256];
  int n = snprintf(line, sizeof line, "dlua-rank-%s %d %s\n", what, g_local_rank, arg ? arg : "");
  if (n <= 0 || n >= (int)sizeof line) return 0;
  /* one write under PIPE_BUF bytes: atomic, so the ranks' lines never interleave */
  ssize_t w;
  do w = write(g_report_fd, line, (size_t)n);
  while (w < 0 && errno == EINTR);
  return w == n;
}

void dlua_launch_report_failure(void) {
  /* once: the fd stays open (close-on-exec) for the flight recorder's dump that may still follow */
  if (atomic_exchange(&g_reported, 1)) return;
  dlua_launch_notify("failed", atomic_load(&g_peer_lost) ? "peer" : "own");
}

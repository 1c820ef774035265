/* Process-wide runtime settings: versions, thread count, the Ctrl-C flag. */
#include "core/runtime.h"
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <time.h>
#include "core/error.h"

volatile int dlua_interrupt_flag = 0;

const char *dlua_version(void) { return DLUA_VERSION_STRING; }

dlua_status_t dlua_set_num_threads(int n) {
  if (n < 1) return DLUA_ERR(DLUA_ERR_ARG, "set_num_threads: expected a positive thread count, got %d", n);
  omp_set_num_threads(n);
  return DLUA_OK;
}

int dlua_get_num_threads(void) { return omp_get_max_threads(); }

void dlua_interrupt_set(int on) { dlua_interrupt_flag = on ? 1 : 0; }
int dlua_interrupt_pending(void) { return dlua_interrupt_flag; }

double dlua_wall_time(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void dlua_async_signals(sigset_t *set) {
  static const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
  sigfillset(set);
  for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) sigdelset(set, faults[i]);
}

void dlua_thread_name(const char *name) { prctl(PR_SET_NAME, (unsigned long)name, 0, 0, 0); }

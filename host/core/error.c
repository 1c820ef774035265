/* Thread-local last-error message and status names. */
#include "core/error.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { DLUA_ERROR_MAX = 2048 };
static _Thread_local char tl_message[DLUA_ERROR_MAX];
static _Thread_local dlua_status_t tl_status = DLUA_OK;

static const char *basename_of(const char *path) {
  const char *host = strstr(path, "host/");
  if (host) return host;  // keep "host/core/x.c": enough to find it, short to read
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

dlua_status_t dlua_error_set(dlua_status_t status, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tl_message, sizeof tl_message, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n < sizeof tl_message)
    snprintf(tl_message + n, sizeof tl_message - (size_t)n, " (%s:%d)", basename_of(file), line);
  tl_status = status;
  return status;
}

const char *dlua_last_error(void) { return tl_message; }
dlua_status_t dlua_last_status(void) { return tl_status; }

void dlua_clear_error(void) {
  tl_message[0] = '\0';
  tl_status = DLUA_OK;
}

const char *dlua_status_name(dlua_status_t status) {
  static const char *const names[DLUA_STATUS_COUNT] = {
      "ok", "bad argument", "out of memory", "I/O error", "backend error",
      "interrupted", "timeout", "internal error"};
  if ((int)status < 0 || status >= DLUA_STATUS_COUNT) return "unknown status";
  return names[status];
}

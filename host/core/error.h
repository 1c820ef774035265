/* Thread-local error recording: functions return a status and leave a message here. */
#ifndef DLUA_CORE_ERROR_H
#define DLUA_CORE_ERROR_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* Records "msg (file:line)" for the calling thread and returns status. */
dlua_status_t dlua_error_set(dlua_status_t status, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define DLUA_ERR(status, ...) dlua_error_set((status), __FILE__, __LINE__, __VA_ARGS__)
/* Propagates a failed status from a callee, keeping its message. */
#define DLUA_TRY(expr)                      \
  do {                                      \
    dlua_status_t dlua_try_s_ = (expr);     \
    if (dlua_try_s_ != DLUA_OK) return dlua_try_s_; \
  } while (0)

#endif

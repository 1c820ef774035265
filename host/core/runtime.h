/* Process-wide runtime settings: versions, thread count, the Ctrl-C flag. */
#ifndef DLUA_CORE_RUNTIME_H
#define DLUA_CORE_RUNTIME_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* True once Ctrl-C was pressed and not yet consumed; cheap enough for inner loops. */
extern volatile int dlua_interrupt_flag;

#endif

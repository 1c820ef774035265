/* The one place C code includes the public API: dlua.h has no include guard (ffi.cdef
   reads it verbatim), so everything includes it through this guarded wrapper. */
#ifndef DLUA_CORE_API_H
#define DLUA_CORE_API_H
#include <stddef.h>
#include <stdint.h>
#include "dlua.h"
#endif

/* Byte counters behind dlua_memory_allocated/peak, shared by the CPU and device allocators. */
#ifndef DLUA_CORE_ALLOC_H
#define DLUA_CORE_ALLOC_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* Counters exist for the CPU and device ordinals 0..DLUA_ALLOC_MAX_DEVICES-1. */
enum { DLUA_ALLOC_MAX_DEVICES = 64 };

/* A device allocator calls these when it hands memory to a storage and when it gets it
   back, so every backend reports through the same dlua_memory_* functions. */
void dlua_memory_note_alloc(int device, size_t nbytes);
void dlua_memory_note_free(int device, size_t nbytes);

#endif

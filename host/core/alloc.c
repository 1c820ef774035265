/* 64-byte aligned CPU allocation, and live/peak byte counters per device. */
#include "core/alloc.h"
#include <stdlib.h>
#include "core/error.h"
#include "core/tensor.h"

/* Slot 0 is the CPU, slot d+1 is cuda:d. Relaxed atomics: counters, not synchronisation. */
static int64_t live_bytes[DLUA_ALLOC_MAX_DEVICES + 1];
static int64_t peak_bytes[DLUA_ALLOC_MAX_DEVICES + 1];
static int64_t total_live;

static int slot_of(int device) {
  if (device < DLUA_CPU || device >= DLUA_ALLOC_MAX_DEVICES) return -1;
  return device + 1;
}

void dlua_memory_note_alloc(int device, size_t nbytes) {
  int s = slot_of(device);
  if (s < 0) return;
  int64_t now = __atomic_add_fetch(&live_bytes[s], (int64_t)nbytes, __ATOMIC_RELAXED);
  __atomic_add_fetch(&total_live, (int64_t)nbytes, __ATOMIC_RELAXED);
  int64_t peak = __atomic_load_n(&peak_bytes[s], __ATOMIC_RELAXED);
  while (now > peak &&
         !__atomic_compare_exchange_n(&peak_bytes[s], &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

void dlua_memory_note_free(int device, size_t nbytes) {
  int s = slot_of(device);
  if (s < 0) return;
  __atomic_sub_fetch(&live_bytes[s], (int64_t)nbytes, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&total_live, (int64_t)nbytes, __ATOMIC_RELAXED);
}

int64_t dlua_memory_allocated(int device) {
  int s = slot_of(device);
  return s < 0 ? 0 : __atomic_load_n(&live_bytes[s], __ATOMIC_RELAXED);
}

int64_t dlua_memory_peak(int device) {
  int s = slot_of(device);
  return s < 0 ? 0 : __atomic_load_n(&peak_bytes[s], __ATOMIC_RELAXED);
}

int64_t dlua_memory_allocated_total(void) { return __atomic_load_n(&total_live, __ATOMIC_RELAXED); }

void *dlua_cpu_alloc(size_t nbytes) {
  // Zero bytes still gets a real, unique pointer: memcpy/memset on it stay defined.
  size_t ask = nbytes ? nbytes : 1;
  void *p = NULL;
  if (ask > (size_t)INT64_MAX || posix_memalign(&p, 64, ask) != 0 || !p) {
    DLUA_ERR(DLUA_ERR_OOM, "alloc: out of memory allocating %zu bytes on the CPU (%lld bytes in use)",
             nbytes, (long long)dlua_memory_allocated(DLUA_CPU));
    return NULL;
  }
  dlua_memory_note_alloc(DLUA_CPU, nbytes);
  return p;
}

void dlua_cpu_free(void *p, size_t nbytes) {
  if (!p) return;
  free(p);
  dlua_memory_note_free(DLUA_CPU, nbytes);
}

/* 64-byte aligned CPU allocation, and live/peak byte counters per device. */
#include "core/alloc.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
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

/* The peak restarts from what is alive now (torch.cuda.reset_peak_memory_stats): a peak over one
   training step is then the step's own. */
void dlua_memory_reset_peak(int device) {
  int s = slot_of(device);
  if (s < 0) return;
  __atomic_store_n(&peak_bytes[s], __atomic_load_n(&live_bytes[s], __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}

/* ---- the CPU block cache ------------------------------------------------------------------
   A training step frees and re-allocates the same activation sizes every step. Large blocks
   from glibc come from fresh mmap()s, so each step paid page faults and the kernel's zeroing
   (a quarter of the CPU time of a ResNet-20 step was in the kernel). Freed blocks of at least
   CACHE_MIN bytes are kept in exact-size free lists (sizes rounded up to pages) and handed
   out again; the cache holds at most cache_limit bytes (DLUA_CPU_CACHE_MB, default 2048) and
   is emptied before an allocation is reported as out of memory. */

enum { CACHE_MIN = 256 * 1024, PAGE = 4096, MAX_BUCKETS = 512 };

typedef struct {
  size_t size;    /* rounded block size */
  void **blocks;  /* free blocks of that size */
  int count, cap;
} bucket_t;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static bucket_t buckets[MAX_BUCKETS];
static int nbuckets;
static int64_t cached_bytes;
static int64_t cache_limit = -1;

static size_t round_size(size_t n) { return (n + PAGE - 1) / PAGE * PAGE; }

static int64_t limit_of_cache(void) {
  if (cache_limit < 0) {
    const char *e = getenv("DLUA_CPU_CACHE_MB");
    long long mb = e && *e ? atoll(e) : 2048;
    cache_limit = mb < 0 ? 0 : (int64_t)mb << 20;
  }
  return cache_limit;
}

static bucket_t *find_bucket(size_t size, int create) {
  for (int i = 0; i < nbuckets; i++)
    if (buckets[i].size == size) return &buckets[i];
  if (!create || nbuckets == MAX_BUCKETS) return NULL;
  bucket_t *b = &buckets[nbuckets++];
  memset(b, 0, sizeof *b);
  b->size = size;
  return b;
}

/* A cached block of exactly `size` bytes, or NULL. */
static void *cache_take(size_t size) {
  void *p = NULL;
  pthread_mutex_lock(&cache_lock);
  bucket_t *b = find_bucket(size, 0);
  if (b && b->count > 0) {
    p = b->blocks[--b->count];
    cached_bytes -= (int64_t)size;
  }
  pthread_mutex_unlock(&cache_lock);
  return p;
}

/* Keeps p (of `size` bytes) for reuse; returns 0 when the cache is full (caller frees). */
static int cache_put(void *p, size_t size) {
  int kept = 0;
  pthread_mutex_lock(&cache_lock);
  if (cached_bytes + (int64_t)size <= limit_of_cache()) {
    bucket_t *b = find_bucket(size, 1);
    if (b && b->count == b->cap) {
      int cap = b->cap ? 2 * b->cap : 8;
      void **nb = realloc(b->blocks, (size_t)cap * sizeof *nb);
      if (nb) {
        b->blocks = nb;
        b->cap = cap;
      }
    }
    if (b && b->count < b->cap) {
      b->blocks[b->count++] = p;
      cached_bytes += (int64_t)size;
      kept = 1;
    }
  }
  pthread_mutex_unlock(&cache_lock);
  return kept;
}

void dlua_memory_empty_cache(int device) {
  if (device != DLUA_CPU) {
    if (dlua_cuda_empty_cache(device) != DLUA_OK) dlua_clear_error();  // no such device: nothing cached
    return;
  }
  pthread_mutex_lock(&cache_lock);
  for (int i = 0; i < nbuckets; i++) {
    for (int k = 0; k < buckets[i].count; k++) free(buckets[i].blocks[k]);
    buckets[i].count = 0;
  }
  cached_bytes = 0;
  pthread_mutex_unlock(&cache_lock);
}

int64_t dlua_memory_cached(int device) {
  if (device != DLUA_CPU) {
    dlua_memory_stats_t st;
    if (dlua_cuda_memory_stats(device, &st) != DLUA_OK) {
      dlua_clear_error();
      return 0;
    }
    return st.reserved - st.allocated;
  }
  pthread_mutex_lock(&cache_lock);
  int64_t n = cached_bytes;
  pthread_mutex_unlock(&cache_lock);
  return n;
}

void *dlua_cpu_alloc(size_t nbytes) {
  // Zero bytes still gets a real, unique pointer: memcpy/memset on it stay defined.
  size_t ask = nbytes ? nbytes : 1;
  void *p = NULL;
  if (ask > (size_t)INT64_MAX / 2) {
    DLUA_ERR(DLUA_ERR_OOM, "alloc: out of memory allocating %zu bytes on the CPU (%lld bytes in use)", nbytes,
             (long long)dlua_memory_allocated(DLUA_CPU));
    return NULL;
  }
  if (ask >= CACHE_MIN) {
    ask = round_size(ask);
    p = cache_take(ask);
  }
  if (!p && posix_memalign(&p, 64, ask) != 0) {
    p = NULL;
    dlua_memory_empty_cache(DLUA_CPU);  // cached blocks of other sizes may be what is missing
    if (posix_memalign(&p, 64, ask) != 0) p = NULL;
  }
  if (!p) {
    DLUA_ERR(DLUA_ERR_OOM, "alloc: out of memory allocating %zu bytes on the CPU (%lld bytes in use)", nbytes,
             (long long)dlua_memory_allocated(DLUA_CPU));
    return NULL;
  }
  dlua_memory_note_alloc(DLUA_CPU, nbytes);
  return p;
}

void dlua_cpu_free(void *p, size_t nbytes) {
  if (!p) return;
  size_t ask = nbytes ? nbytes : 1;
  if (ask < CACHE_MIN || !cache_put(p, round_size(ask))) free(p);
  dlua_memory_note_free(DLUA_CPU, nbytes);
}

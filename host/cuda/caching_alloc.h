/* The caching device allocator: size classes, block splitting/merging, per-stream reuse, stats;
   plain C over a raw-allocation interface, so CI tests it with a fake device. */
#ifndef DLUA_CUDA_CACHING_ALLOC_H
#define DLUA_CUDA_CACHING_ALLOC_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* Where raw memory and stream events come from: cudaMalloc/cudaEvent* in device.c, cudaHostAlloc
   for pinned host memory, malloc in the tests. Streams and events are opaque pointers (a NULL
   stream is the device's default stream). Every callback runs with the device's lock held. */
typedef struct dlua_raw_source {
  void *ctx;
  /* Names the device in messages, e.g. "cuda:%d" or "pinned host memory" (printf with device). */
  const char *device_fmt;
  /* DLUA_OK and *ptr set; DLUA_ERR_OOM when the device is out of memory (no message needed);
     anything else is a backend failure whose message the callback recorded. */
  dlua_status_t (*alloc)(void *ctx, int device, size_t bytes, void **ptr);
  /* Must not release memory that queued work still uses (cudaFree synchronizes the device). */
  void (*free)(void *ctx, int device, void *ptr);
  /* An event marking the work queued on `stream` so far. May be NULL when the caller never records
     cross-stream uses (dlua_caching_alloc_record_stream then fails). */
  dlua_status_t (*record_event)(void *ctx, int device, void *stream, void **event);
  /* 1 when the event's work is done, 0 while pending; < 0 on error (treated as done: the stream is
     broken and the error surfaces from the op that used it). */
  int (*query_event)(void *ctx, int device, void *event);
  /* Blocks until the event is done; may be NULL (then empty_cache only frees finished blocks). */
  void (*sync_event)(void *ctx, int device, void *event);
  void (*destroy_event)(void *ctx, int device, void *event);
} dlua_raw_source_t;

typedef struct dlua_caching_alloc dlua_caching_alloc_t;

/* Size classes (bytes). Requests round up to BLOCK_ALIGN; up to SMALL_MAX they come from the small
   pool, carved from SMALL_SEGMENT segments; larger ones from the large pool: requests under
   LARGE_MIN_ALONE share LARGE_SEGMENT segments, bigger ones get their own segment rounded to
   LARGE_ROUND. A free remainder is split off when it is at least BLOCK_ALIGN (small pool) or more
   than SMALL_MAX (large pool: smaller slivers would only feed the small pool's sizes). */
enum {
  DLUA_CALLOC_BLOCK_ALIGN = 512,
  DLUA_CALLOC_SMALL_MAX = 1 << 20,
  DLUA_CALLOC_SMALL_SEGMENT = 2 << 20,
  DLUA_CALLOC_LARGE_SEGMENT = 20 << 20,
  DLUA_CALLOC_LARGE_MIN_ALONE = 10 << 20,
  DLUA_CALLOC_LARGE_ROUND = 2 << 20
};

/* An allocator for devices 0..ndevices-1; `src` is copied. */
dlua_status_t dlua_caching_alloc_create(dlua_caching_alloc_t **out, const dlua_raw_source_t *src, int ndevices);
/* Returns every segment to the source (live blocks too: call it when nothing uses them). */
void dlua_caching_alloc_destroy(dlua_caching_alloc_t *a);

/* A block of at least `bytes` (0 allowed) for use on `stream`. On a raw-allocation failure the
   cache is emptied once and the raw allocation retried; then DLUA_ERR_OOM naming the request, the
   device and the statistics. */
dlua_status_t dlua_caching_alloc_malloc(dlua_caching_alloc_t *a, int device, void *stream, size_t bytes, void **ptr);
/* Gives a block back. Reused at once on its own stream; if other streams were recorded, only
   after events recorded on each of them now have completed. */
dlua_status_t dlua_caching_alloc_free(dlua_caching_alloc_t *a, int device, void *ptr);
/* Notes that work on `stream` uses the live block at ptr (PyTorch's record_stream). */
dlua_status_t dlua_caching_alloc_record_stream(dlua_caching_alloc_t *a, int device, void *ptr, void *stream);
/* Requested size, stream and birth (the allocation clock when it was handed out) of the live block at ptr
   (DLUA_ERR_ARG if ptr is not one); NULL outputs are skipped. */
dlua_status_t dlua_caching_alloc_block_info(dlua_caching_alloc_t *a, int device, void *ptr, size_t *bytes, void **stream,
                                            uint64_t *born);
/* The device's allocation clock (allocations handed out so far): the device layer compares a block's birth with
   when other streams were current (automatic record_stream). */
uint64_t dlua_caching_alloc_clock(dlua_caching_alloc_t *a, int device);
/* n bytes for a message: "1.50 GiB", "512 bytes". Returns buf. */
const char *dlua_caching_alloc_human(char *buf, size_t len, int64_t n);

/* Returns the unused segments to the source (waiting for pending events when it can). */
void dlua_caching_alloc_empty_cache(dlua_caching_alloc_t *a, int device);
void dlua_caching_alloc_stats(dlua_caching_alloc_t *a, int device, dlua_memory_stats_t *out);
void dlua_caching_alloc_reset_peak(dlua_caching_alloc_t *a, int device);
/* Checks the allocator's invariants (tests): DLUA_ERR_INTERNAL with what is broken. */
dlua_status_t dlua_caching_alloc_check(dlua_caching_alloc_t *a, int device);

#endif

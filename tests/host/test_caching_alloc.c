/* Check suite for host/cuda/caching_alloc.c over a fake, malloc-backed device: size classes,
   splitting/merging, streams, events, stats, empty_cache, OOM, fragmentation, a model-checked stress. */
#include <check.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "cuda/caching_alloc.h"

#include "testutil.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

/* ---- the fake device ---------------------------------------------------------------------------- */

typedef struct {
  int done, destroyed;
  void *stream;
} fake_event_t;

typedef struct {
  size_t capacity, used;
  int64_t nalloc, nfree, nrecord, nquery, nsync, ndestroy;
  int fail_backend;         /* next alloc fails with DLUA_ERR_BACKEND */
  int64_t attempts;         /* raw alloc calls, failed ones included */
  void *ptrs[4096];
  size_t sizes[4096];
  int nlive;
  fake_event_t *events[65536];
  int nevents;
} fake_t;

static dlua_status_t fake_alloc(void *ctx, int device, size_t bytes, void **ptr) {
  fake_t *f = ctx;
  f->attempts++;
  if (f->fail_backend) {
    f->fail_backend = 0;
    return DLUA_ERR(DLUA_ERR_BACKEND, "fake: the device fell over");
  }
  if (f->used + bytes > f->capacity || f->nlive == 4096) return DLUA_ERR_OOM;
  void *p = aligned_alloc(512, bytes);
  if (!p) return DLUA_ERR_OOM;
  f->ptrs[f->nlive] = p;
  f->sizes[f->nlive++] = bytes;
  f->used += bytes;
  f->nalloc++;
  *ptr = p;
  return DLUA_OK;
}

static void fake_free(void *ctx, int device, void *ptr) {
  fake_t *f = ctx;
  for (int i = 0; i < f->nlive; i++)
    if (f->ptrs[i] == ptr) {
      f->used -= f->sizes[i];
      f->ptrs[i] = f->ptrs[--f->nlive];
      f->sizes[i] = f->sizes[f->nlive];
      f->nfree++;
      free(ptr);
      return;
    }
  ck_abort_msg("fake_free: %p was never allocated", ptr);
}

static dlua_status_t fake_record(void *ctx, int device, void *stream, void **event) {
  fake_t *f = ctx;
  ck_assert_int_lt(f->nevents, 65536);
  fake_event_t *e = calloc(1, sizeof *e);
  e->stream = stream;
  f->events[f->nevents++] = e;
  f->nrecord++;
  *event = e;
  return DLUA_OK;
}

static int fake_query(void *ctx, int device, void *event) {
  fake_t *f = ctx;
  f->nquery++;
  fake_event_t *e = event;
  ck_assert(!e->destroyed);
  return e->done;
}

static void fake_sync(void *ctx, int device, void *event) {
  fake_t *f = ctx;
  f->nsync++;
  ((fake_event_t *)event)->done = 1;
}

static void fake_destroy(void *ctx, int device, void *event) {
  fake_t *f = ctx;
  fake_event_t *e = event;
  ck_assert(!e->destroyed);
  e->destroyed = 1;
  f->ndestroy++;
}

static void fake_complete_all(fake_t *f) {
  for (int i = 0; i < f->nevents; i++) f->events[i]->done = 1;
}

static void fake_release(fake_t *f) {
  for (int i = 0; i < f->nevents; i++) free(f->events[i]);
  free(f);
}

static dlua_caching_alloc_t *make(fake_t **fp, size_t capacity, int with_sync) {
  fake_t *f = calloc(1, sizeof *f);
  f->capacity = capacity;
  dlua_raw_source_t src = {f, "fake:%d", fake_alloc, fake_free, fake_record, fake_query,
                           with_sync ? fake_sync : NULL, fake_destroy};
  dlua_caching_alloc_t *a = NULL;
  ck_assert_int_eq(dlua_caching_alloc_create(&a, &src, 2), DLUA_OK);
  *fp = f;
  return a;
}

#define S(k) ((void *)(uintptr_t)(0x1000 * (k)))  /* fake streams; NULL is the default one */

static void *alloc_ok(dlua_caching_alloc_t *a, void *stream, size_t n) {
  void *p = NULL;
  dlua_status_t s = dlua_caching_alloc_malloc(a, 0, stream, n, &p);
  ck_assert_msg(s == DLUA_OK, "alloc %zu: %s", n, dlua_last_error());
  ck_assert_ptr_nonnull(p);
  return p;
}

static void free_ok(dlua_caching_alloc_t *a, void *p) {
  dlua_status_t s = dlua_caching_alloc_free(a, 0, p);
  ck_assert_msg(s == DLUA_OK, "free: %s", dlua_last_error());
}

static void check_ok(dlua_caching_alloc_t *a) {
  dlua_status_t s = dlua_caching_alloc_check(a, 0);
  ck_assert_msg(s == DLUA_OK, "invariants: %s", dlua_last_error());
}

static dlua_memory_stats_t stats(dlua_caching_alloc_t *a) {
  dlua_memory_stats_t st;
  dlua_caching_alloc_stats(a, 0, &st);
  return st;
}

/* ---- tests ------------------------------------------------------------------------------------------ */

START_TEST(test_steady_state_makes_no_raw_calls) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  const size_t sizes[] = {1, 100, 4096, 700 * KiB, 1 * MiB, 3 * MiB + 7, 12 * MiB, 50 * MiB, 333};
  enum { N = sizeof sizes / sizeof *sizes };
  void *p[N];
  for (int it = 0; it < 200; it++) {
    if (it == 1) ck_assert_int_gt(f->nalloc, 0);
    int64_t before = f->attempts;
    for (int i = 0; i < N; i++) p[i] = alloc_ok(a, NULL, sizes[(i + it) % N]);
    // free in an order that changes every iteration: merges happen in different orders
    for (int i = 0; i < N; i++) free_ok(a, p[(i * 4 + it) % N]);
    if (it >= 2) ck_assert_int_eq(f->attempts, before);  // warm: every request is a cache hit
  }
  check_ok(a);
  dlua_memory_stats_t st = stats(a);
  ck_assert_int_eq(st.allocated, 0);
  ck_assert_int_eq(st.blocks, 0);
  ck_assert_int_eq(st.num_allocs, 200 * N);
  ck_assert_int_eq(st.num_frees, 200 * N);
  ck_assert_int_eq(st.num_raw_allocs, f->nalloc);
  ck_assert_int_eq(st.reserved, (int64_t)f->used);
  ck_assert_int_eq(f->nrecord, 0);  // no cross-stream use: no events at all
  dlua_caching_alloc_destroy(a);
  ck_assert_int_eq(f->used, 0);
  fake_release(f);
}
END_TEST

START_TEST(test_size_classes_and_splitting) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  char *p1 = alloc_ok(a, NULL, 1);  // 512 bytes of a 2 MiB small segment
  dlua_memory_stats_t st = stats(a);
  ck_assert_int_eq(st.allocated, 512);
  ck_assert_int_eq(st.requested, 1);
  ck_assert_int_eq(st.reserved, 2 * MiB);
  ck_assert_int_eq(f->nalloc, 1);
  char *p2 = alloc_ok(a, NULL, 1000);  // rounds to 1024, carved right after p1
  ck_assert_ptr_eq(p2, p1 + 512);
  char *p3 = alloc_ok(a, NULL, 1 * MiB);  // exactly 1 MiB is still small
  ck_assert_ptr_eq(p3, p1 + 1536);
  ck_assert_int_eq(f->nalloc, 1);
  ck_assert_int_eq(stats(a).cached_blocks, 1);  // the segment's tail
  ck_assert_int_eq(stats(a).largest_free, 2 * MiB - 1536 - MiB);
  char *p4 = alloc_ok(a, NULL, 1 * MiB + 1);  // large: a 20 MiB segment
  ck_assert_int_eq(f->nalloc, 2);
  ck_assert_int_eq(stats(a).reserved, 22 * MiB);
  ck_assert_int_eq(stats(a).allocated, 512 + 1024 + MiB + MiB + 512);
  char *p5 = alloc_ok(a, NULL, 10 * MiB - 512);  // below 10 MiB: shares the 20 MiB segment
  ck_assert_ptr_eq(p5, p4 + MiB + 512);
  ck_assert_int_eq(f->nalloc, 2);
  char *p6 = alloc_ok(a, NULL, 10 * MiB);  // 9 MiB left there: its own 10 MiB segment
  ck_assert_int_eq(f->nalloc, 3);
  ck_assert_int_eq(stats(a).reserved, 32 * MiB);
  char *p7 = alloc_ok(a, NULL, 10 * MiB + 1);  // 10 MiB + 512 in a 12 MiB segment, tail split off
  ck_assert_int_eq(stats(a).reserved, 44 * MiB);
  ck_assert_int_eq(stats(a).largest_free, 20 * MiB - (MiB + 512) - (10 * MiB - 512));
  check_ok(a);
  // merging: free p2 (middle) then p1 and p3; the small segment becomes one free block
  free_ok(a, p2);
  check_ok(a);
  ck_assert_int_eq(stats(a).cached_blocks, 4);  // p2's hole + three segment tails
  free_ok(a, p1);
  check_ok(a);
  ck_assert_int_eq(stats(a).cached_blocks, 4);  // p1 merged with p2's hole
  free_ok(a, p3);
  check_ok(a);
  ck_assert_int_eq(stats(a).cached_blocks, 3);  // whole small segment
  ck_assert_int_eq(stats(a).largest_free, 9 * MiB);  // the 20 MiB segment's tail
  // the merged block serves a 2 MiB-wide small request range again at the same address
  char *q = alloc_ok(a, NULL, 1 * MiB);
  ck_assert_ptr_eq(q, p1);
  free_ok(a, q);
  // large pool: no split when the remainder would be 1 MiB or less
  free_ok(a, p4);
  free_ok(a, p5);
  ck_assert_int_eq(stats(a).largest_free, 20 * MiB);
  char *r = alloc_ok(a, NULL, 19 * MiB + 1);  // remainder 1 MiB - 512: the whole 20 MiB block
  ck_assert_ptr_eq(r, p4);
  ck_assert_int_eq(stats(a).allocated, 20 * MiB + 10 * MiB + 10 * MiB + 512);
  ck_assert_int_eq(stats(a).requested, 19 * MiB + 1 + 10 * MiB + 10 * MiB + 1);
  check_ok(a);
  free_ok(a, r);
  free_ok(a, p6);
  free_ok(a, p7);
  ck_assert_int_eq(stats(a).allocated, 0);
  ck_assert_int_eq(f->nalloc, 4);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_zero_bytes_and_bad_frees) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 64 * MiB, 1);
  char *p = alloc_ok(a, NULL, 0);
  char *q = alloc_ok(a, NULL, 0);
  ck_assert_ptr_ne(p, q);  // distinct, real blocks
  ck_assert_int_eq(dlua_caching_alloc_free(a, 0, p + 8), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "not a live allocation on fake:0"));
  free_ok(a, p);
  ck_assert_int_eq(dlua_caching_alloc_free(a, 0, p), DLUA_ERR_ARG);  // double free is caught
  ck_assert_int_eq(dlua_caching_alloc_free(a, 0, NULL), DLUA_OK);
  void *r;
  ck_assert_int_eq(dlua_caching_alloc_malloc(a, 7, NULL, 10, &r), DLUA_ERR_ARG);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "device 7"));
  size_t n;
  void *s;
  ck_assert_int_eq(dlua_caching_alloc_block_info(a, 0, q, &n, &s, NULL), DLUA_OK);
  ck_assert_int_eq(n, 0);
  ck_assert_ptr_null(s);
  free_ok(a, q);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_streams_are_separate) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  char *pa = alloc_ok(a, S(1), 4096);
  free_ok(a, pa);
  char *pb = alloc_ok(a, S(2), 4096);  // A's free block is not B's: new segment
  ck_assert_int_eq(f->nalloc, 2);
  ck_assert((uintptr_t)pb < (uintptr_t)pa || (uintptr_t)pb >= (uintptr_t)pa + 2 * MiB);
  char *pa2 = alloc_ok(a, S(1), 4096);  // A gets its own block back
  ck_assert_ptr_eq(pa2, pa);
  size_t n;
  void *st;
  ck_assert_int_eq(dlua_caching_alloc_block_info(a, 0, pb, &n, &st, NULL), DLUA_OK);
  ck_assert_ptr_eq(st, S(2));
  ck_assert_int_eq(n, 4096);
  // recording a block's own stream is a no-op: freeing it needs no event
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, pa2, S(1)), DLUA_OK);
  free_ok(a, pa2);
  ck_assert_int_eq(f->nrecord, 0);
  free_ok(a, pb);
  // the second device is independent
  void *d1;
  ck_assert_int_eq(dlua_caching_alloc_malloc(a, 1, S(1), 4096, &d1), DLUA_OK);
  ck_assert_int_eq(f->nalloc, 3);
  dlua_memory_stats_t s1;
  dlua_caching_alloc_stats(a, 1, &s1);
  ck_assert_int_eq(s1.allocated, 4096);
  ck_assert_int_eq(stats(a).allocated, 0);
  ck_assert_int_eq(dlua_caching_alloc_free(a, 0, d1), DLUA_ERR_ARG);  // wrong device
  ck_assert_int_eq(dlua_caching_alloc_free(a, 1, d1), DLUA_OK);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_cross_stream_reuse_waits_for_events) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  char *p = alloc_ok(a, S(1), MiB);  // first half of a small segment
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, p, S(2)), DLUA_OK);
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, p, S(3)), DLUA_OK);
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, p, S(2)), DLUA_OK);  // once per stream
  free_ok(a, p);
  ck_assert_int_eq(f->nrecord, 2);
  ck_assert_ptr_eq(f->events[0]->stream, S(2));
  ck_assert_ptr_eq(f->events[1]->stream, S(3));
  ck_assert_int_eq(stats(a).pending_blocks, 1);
  ck_assert_int_eq(stats(a).allocated, 0);
  check_ok(a);
  char *q = alloc_ok(a, S(1), MiB);  // the segment's other half
  ck_assert_ptr_eq(q, p + MiB);
  int64_t queries = f->nquery;
  char *r = alloc_ok(a, S(1), MiB);  // miss: events polled, still pending -> new segment
  ck_assert_int_gt(f->nquery, queries);
  ck_assert_ptr_ne(r, p);
  ck_assert_int_eq(f->nalloc, 2);
  f->events[0]->done = 1;  // one of two streams is done: still not reusable
  char *s = alloc_ok(a, S(1), MiB);
  ck_assert_ptr_ne(s, p);
  ck_assert_int_eq(f->nalloc, 2);  // r's segment tail
  f->events[1]->done = 1;
  char *t = alloc_ok(a, S(1), MiB);  // miss -> events done -> p again, no raw call
  ck_assert_ptr_eq(t, p);
  ck_assert_int_eq(f->nalloc, 2);
  ck_assert_int_eq(f->ndestroy, 2);
  ck_assert_int_eq(stats(a).pending_blocks, 0);
  check_ok(a);
  // a pending block is not merged with its free neighbours until released
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, t, S(2)), DLUA_OK);
  free_ok(a, q);
  free_ok(a, t);
  check_ok(a);
  ck_assert_int_eq(stats(a).largest_free, MiB);  // q's half alone
  // empty_cache waits for the pending event (sync) and then frees the whole segment
  free_ok(a, r);
  free_ok(a, s);
  dlua_caching_alloc_empty_cache(a, 0);
  ck_assert_int_eq(f->nsync, 1);
  ck_assert_int_eq(stats(a).reserved, 0);
  ck_assert_int_eq(f->used, 0);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_empty_cache_without_sync_keeps_busy_blocks) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 0);
  char *p = alloc_ok(a, S(1), 3 * MiB);
  ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, p, S(2)), DLUA_OK);
  free_ok(a, p);
  dlua_caching_alloc_empty_cache(a, 0);  // cannot wait: the segment stays
  ck_assert_int_eq(stats(a).reserved, 20 * MiB);
  f->events[0]->done = 1;
  dlua_caching_alloc_empty_cache(a, 0);
  ck_assert_int_eq(stats(a).reserved, 0);
  ck_assert_int_eq(stats(a).num_raw_frees, 1);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_stats_and_empty_cache) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  char *x = alloc_ok(a, NULL, 5 * MiB);
  char *y = alloc_ok(a, NULL, 3000);
  char *z = alloc_ok(a, NULL, 30 * MiB);
  dlua_memory_stats_t st = stats(a);
  ck_assert_int_eq(st.allocated, 5 * MiB + 3072 + 30 * MiB);
  ck_assert_int_eq(st.requested, 5 * MiB + 3000 + 30 * MiB);
  ck_assert_int_eq(st.reserved, 20 * MiB + 2 * MiB + 30 * MiB);
  ck_assert_int_eq(st.peak_allocated, st.allocated);
  ck_assert_int_eq(st.blocks, 3);
  ck_assert_int_eq(st.segments, 3);
  ck_assert_int_eq(st.num_raw_allocs, 3);
  free_ok(a, z);
  free_ok(a, x);
  st = stats(a);
  ck_assert_int_eq(st.allocated, 3072);
  ck_assert_int_eq(st.peak_allocated, 5 * MiB + 3072 + 30 * MiB);
  ck_assert_int_eq(st.peak_reserved, 52 * MiB);
  ck_assert_int_eq(st.blocks, 1);
  ck_assert_int_eq(st.largest_free, 30 * MiB);
  dlua_caching_alloc_reset_peak(a, 0);
  ck_assert_int_eq(stats(a).peak_allocated, 3072);
  ck_assert_int_eq(stats(a).peak_reserved, 52 * MiB);
  dlua_caching_alloc_empty_cache(a, 0);  // frees the two unused segments, keeps y's
  st = stats(a);
  ck_assert_int_eq(st.reserved, 2 * MiB);
  ck_assert_int_eq(st.segments, 1);
  ck_assert_int_eq(st.num_raw_frees, 2);
  ck_assert_int_eq(f->used, 2 * MiB);
  ck_assert_int_eq(st.cached_blocks, 1);  // y's segment tail
  free_ok(a, y);
  dlua_caching_alloc_empty_cache(a, 0);
  st = stats(a);
  ck_assert_int_eq(st.reserved, 0);
  ck_assert_int_eq(st.cached_blocks, 0);
  ck_assert_int_eq(st.num_raw_allocs, st.num_raw_frees);
  ck_assert_int_eq(f->used, 0);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

START_TEST(test_oom_empties_cache_and_retries) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 24 * MiB, 1);
  char *x = alloc_ok(a, S(1), 2 * MiB);  // 20 MiB segment on stream 1
  free_ok(a, x);
  char *y = alloc_ok(a, S(2), 512);       // 2 MiB small segment: 22 MiB in use
  // stream 2 needs a large block: 20 MiB does not fit until stream 1's cached segment goes
  char *z = alloc_ok(a, S(2), 3 * MiB);
  ck_assert_int_eq(f->nfree, 1);
  ck_assert_int_eq(stats(a).num_ooms, 0);
  ck_assert_int_eq(stats(a).reserved, 22 * MiB);
  // stream 3: nothing cached is a whole segment, 20 MiB cannot fit, a 2 MiB segment can
  char *w = alloc_ok(a, S(3), 3 * MiB / 2);
  ck_assert_int_eq(stats(a).reserved, 24 * MiB);
  check_ok(a);
  // now nothing fits
  void *v = (void *)1;
  ck_assert_int_eq(dlua_caching_alloc_malloc(a, 0, S(3), 100 * MiB, &v), DLUA_ERR_OOM);
  ck_assert_ptr_null(v);
  const char *msg = dlua_last_error();
  ck_assert_msg(strstr(msg, "out of memory allocating 100.00 MiB (104857600 bytes) on fake:0") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "after emptying the cache") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "reserved in 3 segments") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "allocated in 3 blocks") != NULL, "%s", msg);
  ck_assert_int_eq(stats(a).num_ooms, 1);
  check_ok(a);
  // an impossible size fails at once, naming it
  ck_assert_int_eq(dlua_caching_alloc_malloc(a, 0, NULL, SIZE_MAX - 5, &v), DLUA_ERR_OOM);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "larger than any device"));
  // a backend failure is reported as such, without emptying the cache or retrying
  free_ok(a, w);
  int64_t attempts = f->attempts;
  f->fail_backend = 1;
  ck_assert_int_eq(dlua_caching_alloc_malloc(a, 0, S(4), 4096, &v), DLUA_ERR_BACKEND);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "fell over"));
  ck_assert_int_eq(f->attempts, attempts + 1);
  ck_assert_int_eq(stats(a).reserved, 24 * MiB);
  free_ok(a, y);
  free_ok(a, z);
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  ck_assert_int_eq(f->used, 0);
  fake_release(f);
}
END_TEST

START_TEST(test_fragmentation) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  char *b[8];
  for (int i = 0; i < 8; i++) b[i] = alloc_ok(a, NULL, 256 * KiB);  // fills one small segment
  ck_assert_int_eq(f->nalloc, 1);
  ck_assert_int_eq(stats(a).cached_blocks, 0);
  free_ok(a, b[0]);
  free_ok(a, b[2]);
  // two 256 KiB holes, not adjacent: 512 KiB needs a new segment
  char *c = alloc_ok(a, NULL, 512 * KiB);
  ck_assert_int_eq(f->nalloc, 2);
  free_ok(a, b[1]);  // b0..b2 merge into 768 KiB
  check_ok(a);
  char *d = alloc_ok(a, NULL, 768 * KiB);  // best fit: the merged hole, not the 1.5 MiB tail
  ck_assert_ptr_eq(d, b[0]);
  ck_assert_int_eq(f->nalloc, 2);
  // best fit: the exact 256 KiB hole rather than the 2 MiB free segment
  free_ok(a, c);
  free_ok(a, b[7]);
  char *e = alloc_ok(a, NULL, 256 * KiB);
  ck_assert_ptr_eq(e, b[7]);
  // small and large pools do not mix: a free 20 MiB large segment does not serve 512 bytes
  char *g = alloc_ok(a, NULL, 5 * MiB);
  free_ok(a, g);
  int64_t n = f->nalloc;
  char *h = alloc_ok(a, NULL, 512);
  ck_assert_int_eq(f->nalloc, n);  // from the free small segment
  ck_assert((uintptr_t)h < (uintptr_t)g || (uintptr_t)h >= (uintptr_t)g + 20 * MiB);
  char *big[8];
  for (int i = 0; i < 8; i++) big[i] = alloc_ok(a, NULL, 2 * MiB);  // carved from g's segment
  for (int i = 0; i < 8; i++) ck_assert((uintptr_t)big[i] >= (uintptr_t)g && (uintptr_t)big[i] < (uintptr_t)g + 20 * MiB);
  ck_assert_int_eq(f->nalloc, n);
  for (int i = 0; i < 8; i += 2) free_ok(a, big[i]);  // checkerboard: 4 holes of 2 MiB
  char *k = alloc_ok(a, NULL, 4 * MiB);  // fits only the 4 MiB tail of the segment
  ck_assert_ptr_eq(k, g + 16 * MiB);
  for (int i = 1; i < 8; i += 2) free_ok(a, big[i]);
  free_ok(a, k);
  check_ok(a);
  ck_assert_int_eq(stats(a).largest_free, 20 * MiB);  // all merged back
  free_ok(a, d);
  free_ok(a, e);
  for (int i = 3; i < 7; i++) free_ok(a, b[i]);
  free_ok(a, h);
  dlua_caching_alloc_empty_cache(a, 0);
  ck_assert_int_eq(f->used, 0);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

/* Random allocations, frees, cross-stream records and event completions, checked against a model
   of which byte ranges are busy (live, or freed with events not all done). */
typedef struct {
  char *p;
  size_t n;
  void *stream;
  int first_event, nevents; /* events recorded at free (pending entries) */
  int pending;
  unsigned char tag;
} entry_t;

static int busy_overlap(entry_t *m, int nm, fake_t *f, const char *p, size_t n) {
  size_t span = n ? n : 1;
  for (int i = 0; i < nm; i++) {
    size_t mspan = m[i].n ? m[i].n : 1;
    if (m[i].pending) {
      int done = 1;
      for (int k = 0; k < m[i].nevents; k++) done &= f->events[m[i].first_event + k]->done;
      if (done) continue;
    }
    if (p < m[i].p + mspan && m[i].p < p + span) return 1;
  }
  return 0;
}

START_TEST(test_random_stress_against_model) {
  fake_t *f;
  size_t cap = 256 * MiB;
  dlua_caching_alloc_t *a = make(&f, cap, 1);
  enum { MAXM = 4096 };
  entry_t *m = calloc(MAXM, sizeof *m);
  int nm = 0;
  uint64_t rs = 12345;
  int ooms = 0, allocs = 0;
  for (int op = 0; op < 20000; op++) {
    double u = (tu_splitmix(&rs) + 1) / 2;
    int nlive = 0;
    for (int i = 0; i < nm; i++) nlive += !m[i].pending;
    if (u < 0.45 && nm < MAXM - 1) {
      double v = (tu_splitmix(&rs) + 1) / 2;
      size_t n = v < 0.7 ? (size_t)(v / 0.7 * 1.2 * MiB) : (size_t)((v - 0.7) / 0.3 * 40 * MiB);
      void *stream = S((int)((tu_splitmix(&rs) + 1) * 1.5));  // streams 0..2
      char *p = NULL;
      dlua_status_t s = dlua_caching_alloc_malloc(a, 0, stream, n, (void **)&p);
      if (s == DLUA_ERR_OOM) {
        ooms++;
        size_t tight = (n + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
        ck_assert_msg(f->used + (n <= MiB ? 2 * MiB : tight) > cap, "OOM with room: used %zu, asked %zu", f->used, n);
        continue;
      }
      ck_assert_msg(s == DLUA_OK, "%s", dlua_last_error());
      ck_assert_msg(!busy_overlap(m, nm, f, p, n), "op %d: %zu bytes at %p overlap a busy block", op, n, p);
      allocs++;
      entry_t e = {p, n, stream, 0, 0, 0, (unsigned char)(op * 7 + 1)};
      memset(p, e.tag, n < 64 ? n : 64);
      if (n > 64) memset(p + n - 64, e.tag, 64);
      m[nm++] = e;
    } else if (u < 0.9 && nlive > 0) {
      int k = (int)((tu_splitmix(&rs) + 1) / 2 * nm) % nm;
      while (m[k].pending) k = (k + 1) % nm;
      entry_t *e = &m[k];
      for (size_t i = 0; i < (e->n < 64 ? e->n : 64); i++) ck_assert_int_eq((unsigned char)e->p[i], e->tag);
      if (e->n > 64)
        for (size_t i = e->n - 64; i < e->n; i++) ck_assert_int_eq((unsigned char)e->p[i], e->tag);
      int before = f->nevents;
      free_ok(a, e->p);
      if (f->nevents > before) {
        e->pending = 1;
        e->first_event = before;
        e->nevents = f->nevents - before;
      } else {
        m[k] = m[--nm];
      }
    } else if (u < 0.95 && nlive > 0) {
      int k = (int)((tu_splitmix(&rs) + 1) / 2 * nm) % nm;
      while (m[k].pending) k = (k + 1) % nm;
      ck_assert_int_eq(dlua_caching_alloc_record_stream(a, 0, m[k].p, S((int)((tu_splitmix(&rs) + 1) * 1.5))), DLUA_OK);
    } else if (f->nevents > 0) {
      f->events[(int)((tu_splitmix(&rs) + 1) / 2 * f->nevents) % f->nevents]->done = 1;
    }
    // drop pending entries whose events are all done
    for (int i = 0; i < nm; i++) {
      if (!m[i].pending) continue;
      int done = 1;
      for (int k = 0; k < m[i].nevents; k++) done &= f->events[m[i].first_event + k]->done;
      if (done) m[i--] = m[--nm];
    }
    if (op % 1000 == 999) {
      check_ok(a);
      dlua_memory_stats_t st = stats(a);
      int64_t req = 0, live = 0;
      for (int i = 0; i < nm; i++)
        if (!m[i].pending) {
          req += (int64_t)m[i].n;
          live++;
        }
      ck_assert_int_eq(st.requested, req);
      ck_assert_int_eq(st.blocks, live);
      ck_assert_int_eq(st.reserved, (int64_t)f->used);
      ck_assert_int_le(st.allocated, st.reserved);
    }
  }
  ck_assert_int_gt(allocs, 5000);
  ck_assert_int_gt(ooms, 0);  // the capacity was reached: the OOM path ran
  for (int i = 0; i < nm; i++)
    if (!m[i].pending) free_ok(a, m[i].p);
  fake_complete_all(f);
  dlua_caching_alloc_empty_cache(a, 0);
  dlua_memory_stats_t st = stats(a);
  ck_assert_int_eq(st.reserved, 0);
  ck_assert_int_eq(st.allocated, 0);
  ck_assert_int_eq(st.pending_blocks, 0);
  ck_assert_int_eq(f->used, 0);
  ck_assert_int_eq(f->nalloc, f->nfree);
  ck_assert_int_eq(f->ndestroy, f->nrecord);
  check_ok(a);
  free(m);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

typedef struct {
  dlua_caching_alloc_t *a;
  int id;
  int failures;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  void *p[16];
  for (int it = 0; it < 2000; it++) {
    for (int i = 0; i < 16; i++) {
      if (dlua_caching_alloc_malloc(w->a, 0, S(w->id + 1), (size_t)(i + 1) * 3000, &p[i]) != DLUA_OK) w->failures++;
      else memset(p[i], w->id, 16);
    }
    for (int i = 0; i < 16; i++) {
      if (p[i] && ((unsigned char *)p[i])[15] != w->id) w->failures++;
      if (p[i] && dlua_caching_alloc_free(w->a, 0, p[i]) != DLUA_OK) w->failures++;
    }
  }
  return NULL;
}

START_TEST(test_threads) {
  fake_t *f;
  dlua_caching_alloc_t *a = make(&f, 1024 * MiB, 1);
  pthread_t t[4];
  worker_t w[4];
  for (int i = 0; i < 4; i++) {
    w[i] = (worker_t){a, i, 0};
    pthread_create(&t[i], NULL, worker, &w[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(w[i].failures, 0);
  dlua_memory_stats_t st = stats(a);
  ck_assert_int_eq(st.allocated, 0);
  ck_assert_int_eq(st.num_allocs, 4 * 2000 * 16);
  ck_assert_int_eq(st.num_raw_allocs, 4);  // one small segment per stream, reused ever after
  check_ok(a);
  dlua_caching_alloc_destroy(a);
  fake_release(f);
}
END_TEST

/* Without a GPU the device layer's allocator is unreachable: every entry point says why. */
START_TEST(test_device_layer_without_gpu) {
  if (dlua_cuda_device_count() > 0) {
    printf("test_device_layer_without_gpu: skipped, %d CUDA device(s) present\n", dlua_cuda_device_count());
    return;
  }
  void *p = (void *)1;
  ck_assert_int_eq(dlua_cuda_malloc(&p, 0, 16, NULL), DLUA_ERR_ARG);
  ck_assert_ptr_null(p);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "no CUDA device available ("));
  ck_assert_str_ne(dlua_cuda_unavailable_reason(), "");
  dlua_memory_stats_t st;
  ck_assert_int_eq(dlua_cuda_memory_stats(0, &st), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_cuda_host_alloc(&p, 16), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_memory_cached(0), 0);
  dlua_memory_empty_cache(0);  // harmless
  ck_assert_ptr_nonnull(strstr(dlua_cuda_runtime_info(), "no CUDA device available"));
}
END_TEST

int main(void) {
  Suite *s = suite_create("caching_alloc");
  TCase *tc = tcase_create("fake device");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_steady_state_makes_no_raw_calls);
  tcase_add_test(tc, test_size_classes_and_splitting);
  tcase_add_test(tc, test_zero_bytes_and_bad_frees);
  tcase_add_test(tc, test_streams_are_separate);
  tcase_add_test(tc, test_cross_stream_reuse_waits_for_events);
  tcase_add_test(tc, test_empty_cache_without_sync_keeps_busy_blocks);
  tcase_add_test(tc, test_stats_and_empty_cache);
  tcase_add_test(tc, test_oom_empties_cache_and_retries);
  tcase_add_test(tc, test_fragmentation);
  tcase_add_test(tc, test_random_stress_against_model);
  tcase_add_test(tc, test_threads);
  tcase_add_test(tc, test_device_layer_without_gpu);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

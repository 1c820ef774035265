/* The caching device allocator (see caching_alloc.h and docs/cuda.md): best-fit reuse per stream,
   split/merge within segments, event-guarded cross-stream reuse, statistics, OOM retry. */
#include "cuda/caching_alloc.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/error.h"

typedef struct block {
  char *ptr;
  size_t size;            /* bytes, a multiple of BLOCK_ALIGN */
  size_t requested;       /* what the live allocation asked for */
  size_t seg_size;        /* segment bytes (head block only) */
  void *stream;           /* the stream of its segment */
  struct block *prev, *next; /* address-ordered neighbours in the segment */
  struct block *hnext;    /* live-block hash chain */
  void **uses;            /* other streams recorded while live */
  int nuses, capuses;
  int nevents;            /* outstanding events before a freed block may be reused */
  uint64_t born;          /* the device's allocation clock when it was handed out */
  unsigned char allocated, pending, small;
} block_t;

/* Free blocks of one pool, sorted by (stream, size, address): a lower bound finds the best fit on
   a stream in O(log n); inserts and removals move the tail (n is hundreds, not millions). */
typedef struct {
  block_t **v;
  int n, cap;
} pool_t;

typedef struct {
  void *event;
  block_t *b;
} pending_t;

typedef struct {
  pthread_mutex_t lock;
  pool_t pools[2]; /* 0 small, 1 large */
  block_t **hash;  /* live blocks by address */
  size_t hcap, hcount;
  block_t **segs;  /* segment heads */
  int nsegs, capsegs;
  pending_t *pend;
  int npend, cappend;
  dlua_memory_stats_t st;
  uint64_t clock;  /* allocations handed out so far */
} dev_t_;

struct dlua_caching_alloc {
  dlua_raw_source_t src;
  int ndevices;
  dev_t_ *devs;
};

/* ---- small containers ------------------------------------------------------------------------ */

static int grow(void **v, int *cap, int need, size_t elem) {
  if (need <= *cap) return 1;
  int c = *cap ? *cap * 2 : 16;
  while (c < need) c *= 2;
  void *nv = realloc(*v, (size_t)c * elem);
  if (!nv) return 0;
  *v = nv;
  *cap = c;
  return 1;
}

static int block_less(const block_t *a, void *stream, size_t size, const char *ptr) {
  if ((uintptr_t)a->stream != (uintptr_t)stream) return (uintptr_t)a->stream < (uintptr_t)stream;
  if (a->size != size) return a->size < size;
  return (uintptr_t)a->ptr < (uintptr_t)ptr;
}

static int pool_lower_bound(const pool_t *p, void *stream, size_t size, const char *ptr) {
  int lo = 0, hi = p->n;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (block_less(p->v[mid], stream, size, ptr)) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static int pool_insert(pool_t *p, block_t *b) {
  if (!grow((void **)&p->v, &p->cap, p->n + 1, sizeof *p->v)) return 0;
  int i = pool_lower_bound(p, b->stream, b->size, b->ptr);
  memmove(p->v + i + 1, p->v + i, (size_t)(p->n - i) * sizeof *p->v);
  p->v[i] = b;
  p->n++;
  return 1;
}

static void pool_remove(pool_t *p, block_t *b) {
  int i = pool_lower_bound(p, b->stream, b->size, b->ptr);
  if (i < p->n && p->v[i] == b) {
    memmove(p->v + i, p->v + i + 1, (size_t)(p->n - i - 1) * sizeof *p->v);
    p->n--;
  }
}

static size_t hash_of(const void *ptr, size_t cap) {
  uint64_t x = (uint64_t)(uintptr_t)ptr >> 9;  // blocks are 512-byte aligned within segments
  x *= 0x9e3779b97f4a7c15ull;
  return (size_t)(x >> 17) & (cap - 1);
}

static int hash_insert(dev_t_ *d, block_t *b) {
  if (d->hcount + 1 > d->hcap) {
    size_t ncap = d->hcap ? d->hcap * 2 : 256;
    block_t **nh = calloc(ncap, sizeof *nh);
    if (!nh) return 0;
    for (size_t i = 0; i < d->hcap; i++) {
      block_t *e = d->hash[i];
      while (e) {
        block_t *nx = e->hnext;
        size_t h = hash_of(e->ptr, ncap);
        e->hnext = nh[h];
        nh[h] = e;
        e = nx;
      }
    }
    free(d->hash);
    d->hash = nh;
    d->hcap = ncap;
  }
  size_t h = hash_of(b->ptr, d->hcap);
  b->hnext = d->hash[h];
  d->hash[h] = b;
  d->hcount++;
  return 1;
}

/* Removes and returns the live block at ptr, or NULL. */
static block_t *hash_take(dev_t_ *d, const void *ptr, int remove) {
  if (!d->hcap) return NULL;
  block_t **pp = &d->hash[hash_of(ptr, d->hcap)];
  for (; *pp; pp = &(*pp)->hnext) {
    if ((*pp)->ptr == ptr) {
      block_t *b = *pp;
      if (remove) {
        *pp = b->hnext;
        b->hnext = NULL;
        d->hcount--;
      }
      return b;
    }
  }
  return NULL;
}

/* ---- sizes ----------------------------------------------------------------------------------- */

static size_t round_size(size_t n) {
  if (n < DLUA_CALLOC_BLOCK_ALIGN) return DLUA_CALLOC_BLOCK_ALIGN;
  return (n + DLUA_CALLOC_BLOCK_ALIGN - 1) / DLUA_CALLOC_BLOCK_ALIGN * DLUA_CALLOC_BLOCK_ALIGN;
}

static size_t segment_size(size_t n) {
  if (n <= DLUA_CALLOC_SMALL_MAX) return DLUA_CALLOC_SMALL_SEGMENT;
  if (n < DLUA_CALLOC_LARGE_MIN_ALONE) return DLUA_CALLOC_LARGE_SEGMENT;
  return (n + DLUA_CALLOC_LARGE_ROUND - 1) / DLUA_CALLOC_LARGE_ROUND * DLUA_CALLOC_LARGE_ROUND;
}

static int should_split(const block_t *b, size_t n) {
  size_t rest = b->size - n;
  return b->small ? rest >= DLUA_CALLOC_BLOCK_ALIGN : rest > DLUA_CALLOC_SMALL_MAX;
}

const char *dlua_caching_alloc_human(char *buf, size_t len, int64_t n) {
  const char *unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0) snprintf(buf, len, "%lld bytes", (long long)n);
  else snprintf(buf, len, "%.2f %s", v, unit[u]);
  return buf;
}

/* ---- the allocator --------------------------------------------------------------------------- */

dlua_status_t dlua_caching_alloc_create(dlua_caching_alloc_t **out, const dlua_raw_source_t *src, int ndevices) {
  *out = NULL;
  if (!src || !src->alloc || !src->free || ndevices < 1)
    return DLUA_ERR(DLUA_ERR_ARG, "caching_alloc: a raw source with alloc and free, and at least one device, are required");
  dlua_caching_alloc_t *a = calloc(1, sizeof *a);
  dev_t_ *devs = calloc((size_t)ndevices, sizeof *devs);
  if (!a || !devs) {
    free(a);
    free(devs);
    return DLUA_ERR(DLUA_ERR_OOM, "caching_alloc: out of host memory creating the allocator");
  }
  a->src = *src;
  if (!a->src.device_fmt) a->src.device_fmt = "device %d";
  a->ndevices = ndevices;
  a->devs = devs;
  for (int i = 0; i < ndevices; i++) pthread_mutex_init(&devs[i].lock, NULL);
  *out = a;
  return DLUA_OK;
}

static void free_block_struct(block_t *b) {
  free(b->uses);
  free(b);
}

void dlua_caching_alloc_destroy(dlua_caching_alloc_t *a) {
  if (!a) return;
  for (int i = 0; i < a->ndevices; i++) {
    dev_t_ *d = &a->devs[i];
    for (int k = 0; k < d->npend; k++)
      if (a->src.destroy_event) a->src.destroy_event(a->src.ctx, i, d->pend[k].event);
    for (int s = 0; s < d->nsegs; s++) {
      block_t *b = d->segs[s];
      a->src.free(a->src.ctx, i, b->ptr);
      while (b) {
        block_t *nx = b->next;
        free_block_struct(b);
        b = nx;
      }
    }
    free(d->segs);
    free(d->pend);
    free(d->hash);
    free(d->pools[0].v);
    free(d->pools[1].v);
    pthread_mutex_destroy(&d->lock);
  }
  free(a->devs);
  free(a);
}

static dlua_status_t check_device(const dlua_caching_alloc_t *a, const char *op, int device) {
  if (device < 0 || device >= a->ndevices)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: device %d out of range (the allocator has %d)", op, device, a->ndevices);
  return DLUA_OK;
}

/* Puts a block that nothing uses any more back in its pool, merged with free neighbours. */
static void release_block(dev_t_ *d, block_t *b) {
  pool_t *p = &d->pools[b->small ? 0 : 1];
  b->allocated = 0;
  b->pending = 0;
  b->nuses = 0;
  block_t *pr = b->prev;
  if (pr && !pr->allocated && !pr->pending) {
    pool_remove(p, pr);
    pr->size += b->size;
    pr->next = b->next;
    if (b->next) b->next->prev = pr;
    free_block_struct(b);
    b = pr;
  }
  block_t *nx = b->next;
  if (nx && !nx->allocated && !nx->pending) {
    pool_remove(p, nx);
    b->size += nx->size;
    b->next = nx->next;
    if (nx->next) nx->next->prev = b;
    free_block_struct(nx);
  }
  // An insert fails only when the host is out of memory; the block then stays out of the pool
  // (leaked to reuse, not corrupted) until empty_cache or destroy walk the segment.
  if (pool_insert(p, b)) d->st.cached_blocks = d->pools[0].n + d->pools[1].n;
}

/* Retires the events that have completed (all of them, waiting, when `wait`), releasing blocks
   whose last event is done. */
static void process_events(dlua_caching_alloc_t *a, int device, int wait) {
  dev_t_ *d = &a->devs[device];
  int k = 0;
  for (int i = 0; i < d->npend; i++) {
    pending_t e = d->pend[i];
    int done;
    if (wait && a->src.sync_event) {
      a->src.sync_event(a->src.ctx, device, e.event);
      done = 1;
    } else {
      done = a->src.query_event ? a->src.query_event(a->src.ctx, device, e.event) != 0 : 1;
    }
    if (!done) {
      d->pend[k++] = e;
      continue;
    }
    if (a->src.destroy_event) a->src.destroy_event(a->src.ctx, device, e.event);
    if (--e.b->nevents == 0) {
      d->st.pending_blocks--;
      release_block(d, e.b);
    }
  }
  d->npend = k;
}

/* Frees every cached block that is a whole segment. */
static void release_cached(dlua_caching_alloc_t *a, int device) {
  dev_t_ *d = &a->devs[device];
  for (int pi = 0; pi < 2; pi++) {
    pool_t *p = &d->pools[pi];
    int k = 0;
    for (int i = 0; i < p->n; i++) {
      block_t *b = p->v[i];
      if (b->prev || b->next) {
        p->v[k++] = b;
        continue;
      }
      for (int s = 0; s < d->nsegs; s++)
        if (d->segs[s] == b) {
          d->segs[s] = d->segs[--d->nsegs];
          break;
        }
      a->src.free(a->src.ctx, device, b->ptr);
      d->st.reserved -= (int64_t)b->seg_size;
      d->st.num_raw_frees++;
      d->st.segments--;
      free_block_struct(b);
    }
    p->n = k;
  }
  d->st.cached_blocks = d->pools[0].n + d->pools[1].n;
}

/* Best fit on `stream`: the smallest free block of at least n bytes, removed from its pool. */
static block_t *take_free(dev_t_ *d, int small, void *stream, size_t n) {
  pool_t *p = &d->pools[small ? 0 : 1];
  int i = pool_lower_bound(p, stream, n, NULL);
  if (i == p->n || p->v[i]->stream != stream) return NULL;
  block_t *b = p->v[i];
  memmove(p->v + i, p->v + i + 1, (size_t)(p->n - i - 1) * sizeof *p->v);
  p->n--;
  return b;
}

static int64_t largest_free(const dev_t_ *d) {
  int64_t m = 0;
  for (int pi = 0; pi < 2; pi++)
    for (int i = 0; i < d->pools[pi].n; i++)
      if ((int64_t)d->pools[pi].v[i]->size > m) m = (int64_t)d->pools[pi].v[i]->size;
  return m;
}

static dlua_status_t oom_error(dlua_caching_alloc_t *a, int device, size_t bytes, const char *detail) {
  dev_t_ *d = &a->devs[device];
  char dev[64], req[32], al[32], rs[32], pk[32], lf[32];
  snprintf(dev, sizeof dev, a->src.device_fmt, device);
  d->st.num_ooms++;
  return DLUA_ERR(DLUA_ERR_OOM,
                  "out of memory allocating %s (%zu bytes) on %s%s: %s allocated in %lld blocks, %s reserved in "
                  "%lld segments (largest cached free block %s), peak allocated %s, %lld raw allocations",
                  dlua_caching_alloc_human(req, sizeof req, (int64_t)bytes), bytes, dev, detail,
                  dlua_caching_alloc_human(al, sizeof al, d->st.allocated), (long long)d->st.blocks,
                  dlua_caching_alloc_human(rs, sizeof rs, d->st.reserved), (long long)d->st.segments,
                  dlua_caching_alloc_human(lf, sizeof lf, largest_free(d)),
                  dlua_caching_alloc_human(pk, sizeof pk, d->st.peak_allocated), (long long)d->st.num_raw_allocs);
}

/* A new segment holding one free block (not in any pool yet). */
static dlua_status_t new_segment(dlua_caching_alloc_t *a, int device, void *stream, size_t seg, int small, block_t **out) {
  dev_t_ *d = &a->devs[device];
  *out = NULL;
  block_t *b = calloc(1, sizeof *b);
  if (!b || !grow((void **)&d->segs, &d->capsegs, d->nsegs + 1, sizeof *d->segs)) {
    free(b);
    return DLUA_ERR(DLUA_ERR_OOM, "caching_alloc: out of host memory for block bookkeeping");
  }
  void *ptr = NULL;
  dlua_status_t s = a->src.alloc(a->src.ctx, device, seg, &ptr);
  if (s != DLUA_OK) {
    free(b);
    return s;
  }
  b->ptr = ptr;
  b->size = b->seg_size = seg;
  b->stream = stream;
  b->small = (unsigned char)small;
  d->segs[d->nsegs++] = b;
  d->st.reserved += (int64_t)seg;
  if (d->st.reserved > d->st.peak_reserved) d->st.peak_reserved = d->st.reserved;
  d->st.num_raw_allocs++;
  d->st.segments++;
  *out = b;
  return DLUA_OK;
}

dlua_status_t dlua_caching_alloc_malloc(dlua_caching_alloc_t *a, int device, void *stream, size_t bytes, void **ptr) {
  *ptr = NULL;
  DLUA_TRY(check_device(a, "cuda alloc", device));
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  d->st.num_allocs++;
  if (bytes > SIZE_MAX / 4) {
    dlua_status_t s = oom_error(a, device, bytes, " (larger than any device)");
    pthread_mutex_unlock(&d->lock);
    return s;
  }
  size_t n = round_size(bytes);
  int small = n <= DLUA_CALLOC_SMALL_MAX;
  block_t *b = take_free(d, small, stream, n);
  // Events are polled only on a miss: the hot path (a hit) never queries the device.
  if (!b && d->npend) {
    process_events(a, device, 0);
    b = take_free(d, small, stream, n);
  }
  dlua_status_t s = DLUA_OK;
  if (!b) {
    size_t seg = segment_size(n);
    s = new_segment(a, device, stream, seg, small, &b);
    if (s == DLUA_ERR_OOM) {
      // Empty the cache once (waiting for pending cross-stream frees) and retry; then, near
      // capacity, a large request tries a segment of just its own size rather than 20 MiB.
      process_events(a, device, 1);
      release_cached(a, device);
      b = take_free(d, small, stream, n);
      if (!b) s = new_segment(a, device, stream, seg, small, &b);
      size_t tight = (n + DLUA_CALLOC_LARGE_ROUND - 1) / DLUA_CALLOC_LARGE_ROUND * DLUA_CALLOC_LARGE_ROUND;
      if (!b && s == DLUA_ERR_OOM && !small && tight < seg) s = new_segment(a, device, stream, tight, small, &b);
      if (b) s = DLUA_OK;
    }
    if (s != DLUA_OK) {
      if (s == DLUA_ERR_OOM) s = oom_error(a, device, bytes, ", after emptying the cache");
      pthread_mutex_unlock(&d->lock);
      return s;
    }
  }
  if (should_split(b, n)) {
    block_t *r = calloc(1, sizeof *r);
    if (r) {
      r->ptr = b->ptr + n;
      r->size = b->size - n;
      r->stream = b->stream;
      r->small = b->small;
      r->prev = b;
      r->next = b->next;
      if (b->next) b->next->prev = r;
      b->next = r;
      b->size = n;
      if (!pool_insert(&d->pools[small ? 0 : 1], r)) {
        // No room to track the remainder: give the whole block instead.
        b->size += r->size;
        b->next = r->next;
        if (r->next) r->next->prev = b;
        free(r);
      }
    }
  }
  if (!hash_insert(d, b)) {
    release_block(d, b);
    pthread_mutex_unlock(&d->lock);
    return DLUA_ERR(DLUA_ERR_OOM, "caching_alloc: out of host memory for block bookkeeping");
  }
  b->allocated = 1;
  b->requested = bytes;
  b->born = ++d->clock;
  d->st.allocated += (int64_t)b->size;
  d->st.requested += (int64_t)bytes;
  if (d->st.allocated > d->st.peak_allocated) d->st.peak_allocated = d->st.allocated;
  d->st.blocks++;
  d->st.cached_blocks = d->pools[0].n + d->pools[1].n;
  *ptr = b->ptr;
  pthread_mutex_unlock(&d->lock);
  return DLUA_OK;
}

dlua_status_t dlua_caching_alloc_free(dlua_caching_alloc_t *a, int device, void *ptr) {
  if (!ptr) return DLUA_OK;
  DLUA_TRY(check_device(a, "cuda free", device));
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  block_t *b = hash_take(d, ptr, 1);
  if (!b) {
    pthread_mutex_unlock(&d->lock);
    char dev[64];
    snprintf(dev, sizeof dev, a->src.device_fmt, device);
    return DLUA_ERR(DLUA_ERR_ARG, "cuda free: %p is not a live allocation on %s", ptr, dev);
  }
  d->st.num_frees++;
  d->st.allocated -= (int64_t)b->size;
  d->st.requested -= (int64_t)b->requested;
  d->st.blocks--;
  b->allocated = 0;
  if (b->nuses == 0) {
    release_block(d, b);
    pthread_mutex_unlock(&d->lock);
    return DLUA_OK;
  }
  // Used on other streams: reusable once the work they have queued so far is done.
  b->pending = 1;
  d->st.pending_blocks++;
  dlua_status_t s = DLUA_OK;
  for (int i = 0; i < b->nuses; i++) {
    void *ev = NULL;
    if (!grow((void **)&d->pend, &d->cappend, d->npend + 1, sizeof *d->pend)) {
      s = DLUA_ERR(DLUA_ERR_OOM, "caching_alloc: out of host memory for events");
      break;
    }
    s = a->src.record_event(a->src.ctx, device, b->uses[i], &ev);
    if (s != DLUA_OK) break;
    d->pend[d->npend++] = (pending_t){ev, b};
    b->nevents++;
  }
  // Could not guard the block with an event on every stream: it stays pending for good (leaked,
  // counted in pending_blocks) rather than risk reuse while that stream may still read it.
  if (s != DLUA_OK) b->nevents++;
  pthread_mutex_unlock(&d->lock);
  return s;
}

dlua_status_t dlua_caching_alloc_record_stream(dlua_caching_alloc_t *a, int device, void *ptr, void *stream) {
  DLUA_TRY(check_device(a, "record_stream", device));
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  block_t *b = hash_take(d, ptr, 0);
  dlua_status_t s = DLUA_OK;
  if (!b) {
    s = DLUA_ERR(DLUA_ERR_ARG, "record_stream: %p is not a live allocation", ptr);
  } else if (!a->src.record_event) {
    s = DLUA_ERR(DLUA_ERR_ARG, "record_stream: this allocator has no events");
  } else if (stream != b->stream) {
    int seen = 0;
    for (int i = 0; i < b->nuses; i++) seen |= b->uses[i] == stream;
    if (!seen) {
      if (grow((void **)&b->uses, &b->capuses, b->nuses + 1, sizeof *b->uses)) b->uses[b->nuses++] = stream;
      else s = DLUA_ERR(DLUA_ERR_OOM, "record_stream: out of host memory");
    }
  }
  pthread_mutex_unlock(&d->lock);
  return s;
}

dlua_status_t dlua_caching_alloc_block_info(dlua_caching_alloc_t *a, int device, void *ptr, size_t *bytes, void **stream,
                                            uint64_t *born) {
  DLUA_TRY(check_device(a, "block_info", device));
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  block_t *b = hash_take(d, ptr, 0);
  if (b) {
    if (bytes) *bytes = b->requested;
    if (stream) *stream = b->stream;
    if (born) *born = b->born;
  }
  pthread_mutex_unlock(&d->lock);
  if (!b) return DLUA_ERR(DLUA_ERR_ARG, "block_info: %p is not a live allocation", ptr);
  return DLUA_OK;
}

uint64_t dlua_caching_alloc_clock(dlua_caching_alloc_t *a, int device) {
  if (device < 0 || device >= a->ndevices) return 0;
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  uint64_t c = d->clock;
  pthread_mutex_unlock(&d->lock);
  return c;
}

void dlua_caching_alloc_empty_cache(dlua_caching_alloc_t *a, int device) {
  if (device < 0 || device >= a->ndevices) return;
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  process_events(a, device, 1);
  release_cached(a, device);
  pthread_mutex_unlock(&d->lock);
}

void dlua_caching_alloc_stats(dlua_caching_alloc_t *a, int device, dlua_memory_stats_t *out) {
  memset(out, 0, sizeof *out);
  if (device < 0 || device >= a->ndevices) return;
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  *out = d->st;
  out->cached_blocks = d->pools[0].n + d->pools[1].n;
  out->largest_free = largest_free(d);
  pthread_mutex_unlock(&d->lock);
}

void dlua_caching_alloc_reset_peak(dlua_caching_alloc_t *a, int device) {
  if (device < 0 || device >= a->ndevices) return;
  dev_t_ *d = &a->devs[device];
  pthread_mutex_lock(&d->lock);
  d->st.peak_allocated = d->st.allocated;
  d->st.peak_reserved = d->st.reserved;
  pthread_mutex_unlock(&d->lock);
}

/* Walks every segment: blocks tile it exactly, no two free neighbours, pools sorted and holding
   exactly the free blocks, counters equal to what the walk finds. */
dlua_status_t dlua_caching_alloc_check(dlua_caching_alloc_t *a, int device) {
  DLUA_TRY(check_device(a, "caching_alloc_check", device));
  dev_t_ *d = &a->devs[device];
  dlua_status_t s = DLUA_OK;
  pthread_mutex_lock(&d->lock);
  int64_t reserved = 0, allocated = 0, nfree = 0, nlive = 0, npending = 0;
#define FAIL(...)                                  \
  do {                                             \
    s = DLUA_ERR(DLUA_ERR_INTERNAL, __VA_ARGS__); \
    goto done;                                     \
  } while (0)
  for (int i = 0; i < d->nsegs; i++) {
    block_t *h = d->segs[i];
    if (h->prev) FAIL("segment %d: head has a predecessor", i);
    reserved += (int64_t)h->seg_size;
    size_t covered = 0;
    for (block_t *b = h; b; b = b->next) {
      if (b->ptr != h->ptr + covered) FAIL("segment %d: block at offset %zu is not contiguous", i, covered);
      if (b->size == 0 || b->size % DLUA_CALLOC_BLOCK_ALIGN) FAIL("segment %d: block size %zu", i, b->size);
      if (b->stream != h->stream || b->small != h->small) FAIL("segment %d: block stream/pool differs", i);
      if (b->next && b->next->prev != b) FAIL("segment %d: broken back link", i);
      int isfree = !b->allocated && !b->pending;
      if (isfree && b->next && !b->next->allocated && !b->next->pending) FAIL("segment %d: adjacent free blocks", i);
      if (b->allocated) {
        allocated += (int64_t)b->size;
        nlive++;
        if (hash_take(d, b->ptr, 0) != b) FAIL("segment %d: live block missing from the hash", i);
      } else if (b->pending) {
        npending++;
      } else {
        nfree++;
        pool_t *p = &d->pools[b->small ? 0 : 1];
        int k = pool_lower_bound(p, b->stream, b->size, b->ptr);
        if (k >= p->n || p->v[k] != b) FAIL("segment %d: free block missing from its pool", i);
      }
      covered += b->size;
    }
    if (covered != h->seg_size) FAIL("segment %d: blocks cover %zu of %zu bytes", i, covered, h->seg_size);
  }
  for (int pi = 0; pi < 2; pi++)
    for (int k = 1; k < d->pools[pi].n; k++) {
      block_t *x = d->pools[pi].v[k - 1], *y = d->pools[pi].v[k];
      if (!block_less(x, y->stream, y->size, y->ptr)) FAIL("pool %d not sorted at %d", pi, k);
    }
  if (nfree != d->pools[0].n + d->pools[1].n) FAIL("pools hold %d blocks, segments %lld free", d->pools[0].n + d->pools[1].n, (long long)nfree);
  if (reserved != d->st.reserved) FAIL("reserved %lld, segments sum to %lld", (long long)d->st.reserved, (long long)reserved);
  if (allocated != d->st.allocated) FAIL("allocated %lld, live blocks sum to %lld", (long long)d->st.allocated, (long long)allocated);
  if (nlive != d->st.blocks || (size_t)nlive != d->hcount) FAIL("live blocks %lld, counter %lld", (long long)nlive, (long long)d->st.blocks);
  if (npending != d->st.pending_blocks) FAIL("pending blocks %lld, counter %lld", (long long)npending, (long long)d->st.pending_blocks);
  if (d->nsegs != d->st.segments) FAIL("segments %d, counter %lld", d->nsegs, (long long)d->st.segments);
#undef FAIL
done:
  pthread_mutex_unlock(&d->lock);
  return s;
}

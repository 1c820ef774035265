/* Same-host collectives through one shared-memory segment (docs/comm.md, "Ranks on one host").

   gloo's TCP ring over loopback costs each rank several kernel copies and many system calls per
   byte. Here every rank copies its data into the segment once, reduces the 1/N piece it owns by
   reading the others' copies in place, and copies the N-1 pieces it does not own back out: about
   three memory passes, no system call while peers keep pace.

   Reduce-scatter is the first half of that, all-gather and broadcast the second (a copy in, a copy
   out); every collective works chunk by chunk through the same slots and counters.

   Segment: a header page; one 128-byte control line per rank (its progress counter, the futex word
   its peers sleep on, and what it is reducing); then two sets of one slot per rank, so chunk g+1
   fills one set while slow peers still read chunk g from the other. Each rank holds an OFD lock on
   byte `rank` of the segment's file for as long as it is in the group: the kernel drops it when
   the process exits however it exits, which is how a waiting peer tells "gone" from "slow". */
#define _GNU_SOURCE
#include "comm/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/dtype.h"
#include "core/error.h"

enum {
  SHM_SLOT_BYTES = 1 << 18,  /* one rank's share of a chunk; measured in bench/ddp_overlap (docs/comm.md) */
  SHM_CTL_BYTES = 128,
  SHM_HEADER_BYTES = 4096,
  SHM_POLL_MS = 50,          /* a sleeping waiter looks at the clock and its peers' locks this often */
  SHM_SPIN_NS = 20000        /* spin this long before sleeping: a peer a few microseconds behind */
};
static const uint64_t SHM_MAGIC = 0x646c75612d73686dull;  /* "dlua-shm" */

/* The collective a rank is in and its shape, for the mismatch check. */
typedef struct {
  int64_t op_seq;
  uint64_t count;      /* its element count (all_gather: this rank's input) */
  uint64_t total;      /* all_gather: the sum of every rank's count as this rank sees it */
  int64_t shared_at;   /* all_reduce in a shared region: its offset there; -1 otherwise */
  int32_t kind;        /* SHM_ALL_REDUCE... */
  int32_t dtype, arg;  /* arg: the reduce op, or broadcast's root */
} shm_desc_t;

typedef struct {
  uint32_t seq;      /* futex word: 2g-1 once chunk g's data is in, 2g once its all-reduce piece is reduced */
  uint32_t waiters;  /* peers asleep (or about to be) on seq: the writer wakes them only then */
  shm_desc_t d[2];   /* by the set of the collective's first chunk: a slow peer may still read the last one */
} shm_ctl_t;
_Static_assert(sizeof(shm_ctl_t) <= SHM_CTL_BYTES, "control line");

typedef struct {
  uint64_t magic, nonce;
  int32_t size, pad;
  uint64_t slot_bytes;
} shm_header_t;

struct dlua_shm {
  int rank, size, fd;
  char *base;
  size_t bytes;
  uint32_t chunk;  /* chunks done: the next one is chunk + 1 */
  char *scratch;   /* SHM_SLOT_BYTES for in-place sums that cannot write their destination as they go */
};

/* Memory every rank of a group maps (DDP's gradient arena): all-reduce of a range in it reads the peers'
   copies where they lie. Regions outlive their group (the tensor may be freed later): owner is then NULL. */
typedef struct shm_region {
  struct shm_region *next;
  dlua_shm_t *owner;
  int rank, size;
  size_t bytes;
  char *base[];  /* each rank's copy as mapped here; this rank's own at [rank] */
} shm_region_t;
static pthread_mutex_t regions_mu = PTHREAD_MUTEX_INITIALIZER;
static shm_region_t *regions;

static shm_ctl_t *ctl(const dlua_shm_t *s, int q) {
  return (shm_ctl_t *)(s->base + SHM_HEADER_BYTES + (size_t)q * SHM_CTL_BYTES);
}
static size_t slots_offset(int size) {
  size_t o = SHM_HEADER_BYTES + (size_t)size * SHM_CTL_BYTES;
  return (o + 4095) & ~(size_t)4095;
}
static size_t segment_bytes(int size) { return slots_offset(size) + 2 * (size_t)size * SHM_SLOT_BYTES; }
static char *slot(const dlua_shm_t *s, int set, int q) {
  return s->base + slots_offset(s->size) + ((size_t)set * (size_t)s->size + (size_t)q) * SHM_SLOT_BYTES;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- joining ------------------------------------------------------------------------------------ */

/* Where this process's /dev/shm is: kernel boot, mount namespace and host name. */
static void place(char *out, size_t n) {
  char host[128] = "?", boot[64] = "?", mnt[64] = "?";
  gethostname(host, sizeof host - 1);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (!fgets(boot, sizeof boot, f)) snprintf(boot, sizeof boot, "?");
    boot[strcspn(boot, "\n")] = '\0';
    fclose(f);
  }
  ssize_t l = readlink("/proc/self/ns/mnt", mnt, sizeof mnt - 1);
  mnt[l > 0 ? l : 1] = '\0';
  snprintf(out, n, "%s %s %s", boot, mnt, host);
}

static int lock_byte(int fd, int cmd, int q, short *type) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = q, .l_len = 1};
  int r = fcntl(fd, cmd, &fl);
  if (type) *type = fl.l_type;
  return r;
}

/* Whether rank q still holds its lock: 0 only when it has surely left. */
static int alive(const dlua_shm_t *s, int q) {
  short type;
  if (lock_byte(s->fd, F_OFD_GETLK, q, &type) != 0) return 1;
  return type != F_UNLCK;
}

/* A new /dev/shm object `name` of `bytes`, its pages reserved now (a full /dev/shm fails here, not with
   SIGBUS later), mapped; MAP_FAILED with why (name unlinked) on failure. *fd keeps it open, or NULL closes it. */
static void *map_new(const char *name, size_t bytes, int *fd, char *why, size_t whylen) {
  int f = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (f < 0) {
    snprintf(why, whylen, "shm_open %s: %s", name, strerror(errno));
    return MAP_FAILED;
  }
  int e = ftruncate(f, (off_t)bytes) != 0 ? errno : posix_fallocate(f, 0, (off_t)bytes);
  void *p = e ? MAP_FAILED : mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (p == MAP_FAILED) {
    snprintf(why, whylen, "reserving %zu bytes of /dev/shm: %s", bytes, strerror(e ? e : errno));
    shm_unlink(name);
  }
  if (p == MAP_FAILED || !fd)
    close(f);
  else
    *fd = f;
  return p;
}

/* Another rank's object `name`, mapped if it has exactly `bytes`; MAP_FAILED otherwise, with *open_errno
   shm_open's errno when it could not even be opened (else 0). */
static void *map_existing(const char *name, size_t bytes, int *fd, int *open_errno) {
  int f = shm_open(name, O_RDWR, 0);
  *open_errno = f < 0 ? errno : 0;
  struct stat st;
  void *p = f >= 0 && fstat(f, &st) == 0 && (size_t)st.st_size == bytes
                ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0)
                : MAP_FAILED;
  if (f >= 0 && (p == MAP_FAILED || !fd)) close(f);
  if (p != MAP_FAILED && fd) *fd = f;
  return p;
}

/* The mapped segment as this rank's handle; NULL (mapping and fd released) when out of memory. */
static dlua_shm_t *wrap_segment(int rank, int size, int fd, void *p, size_t bytes, char *why, size_t whylen) {
  dlua_shm_t *s = calloc(1, sizeof *s);
  char *scratch = malloc(SHM_SLOT_BYTES);
  if (!s || !scratch) {
    free(s);
    free(scratch);
    munmap(p, bytes);
    close(fd);
    snprintf(why, whylen, "out of memory");
    return NULL;
  }
  *s = (dlua_shm_t){.rank = rank, .size = size, .fd = fd, .base = p, .bytes = bytes, .scratch = scratch};
  return s;
}

/* Rank 0: a fresh segment, its header written. */
static dlua_shm_t *create(int size, char *name, size_t namelen, uint64_t nonce, char *why, size_t whylen) {
  static unsigned counter;
  snprintf(name, namelen, "/dlua-%d-%u-%08x", (int)getpid(), __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED),
           (unsigned)nonce);
  size_t bytes = segment_bytes(size);
  int fd = -1;
  void *p = map_new(name, bytes, &fd, why, whylen);
  if (p == MAP_FAILED) return NULL;
  *(shm_header_t *)p = (shm_header_t){.magic = SHM_MAGIC, .nonce = nonce, .size = size, .slot_bytes = SHM_SLOT_BYTES};
  dlua_shm_t *s = wrap_segment(0, size, fd, p, bytes, why, whylen);
  if (!s) shm_unlink(name);
  return s;
}

/* Ranks 1..: the segment rank 0 named, checked to be the one it made (same size, magic, nonce). */
static dlua_shm_t *attach(int rank, int size, const char *name, uint64_t nonce, char *why, size_t whylen) {
  size_t bytes = segment_bytes(size);
  int fd = -1, open_errno;
  void *p = map_existing(name, bytes, &fd, &open_errno);
  if (open_errno) {
    snprintf(why, whylen, "shm_open %s on rank %d: %s", name, rank, strerror(open_errno));
    return NULL;
  }
  const shm_header_t *h = p;
  if (p == MAP_FAILED || h->magic != SHM_MAGIC || h->nonce != nonce || h->size != size ||
      h->slot_bytes != SHM_SLOT_BYTES) {
    snprintf(why, whylen, "rank %d found another segment under %s", rank, name);
    if (p != MAP_FAILED) {
      munmap(p, bytes);
      close(fd);
    }
    return NULL;
  }
  return wrap_segment(rank, size, fd, p, bytes, why, whylen);
}

static void drop(dlua_shm_t *s) {
  if (!s) return;
  free(s->scratch);
  munmap(s->base, s->bytes);
  close(s->fd);  // releases the lock: peers see this rank gone
  free(s);
}

static uint64_t random_nonce(void) {
  uint64_t v = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
    close(fd);
  }
  return v ^ (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32);
}

/* Every rank's value of "<prefix>/shm/<what>/<q>" into vals (freed by the caller), within one timeout. */
static dlua_status_t gather(dlua_store_t *store, const char *prefix, const char *what, int size, int64_t timeout_ms,
                            char **vals) {
  char **keys = calloc((size_t)size, sizeof(char *));
  dlua_status_t st = keys ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "shm: out of memory");
  for (int q = 0; st == DLUA_OK && q < size; q++) {
    size_t n = strlen(prefix) + strlen(what) + 32;
    if (!(keys[q] = malloc(n)))
      st = DLUA_ERR(DLUA_ERR_OOM, "shm: out of memory");
    else
      snprintf(keys[q], n, "%s/shm/%s/%d", prefix, what, q);
  }
  if (st == DLUA_OK) st = dlua_store_wait(store, (const char *const *)keys, size, timeout_ms);
  for (int q = 0; st == DLUA_OK && q < size; q++) {
    size_t len;
    st = dlua_store_get(store, keys[q], timeout_ms, (void **)&vals[q], &len);
  }
  for (int q = 0; keys && q < size; q++) free(keys[q]);
  free(keys);
  return st;
}

static dlua_status_t put(dlua_store_t *store, const char *prefix, const char *what, int rank, const char *val) {
  char key[256];
  snprintf(key, sizeof key, "%s/shm/%s/%d", prefix, what, rank);
  return dlua_store_set(store, key, val, strlen(val));
}

dlua_pg_result_t dlua_shm_join(dlua_store_t *store, const char *prefix, int rank, int size, int64_t timeout_ms,
                               dlua_shm_t **out, char *why, size_t whylen, dlua_status_t *store_status, char *err,
                               size_t errlen) {
  *out = NULL;
  snprintf(why, whylen, "one rank");
  if (size < 2) return DLUA_PG_OK;
  char mine[320];
  const char *env = getenv("DLUA_SHM");
  if (env && !strcmp(env, "0"))
    snprintf(mine, sizeof mine, "off");
  else
    place(mine, sizeof mine);

  // 1. Where is everybody? All ranks read the same answers, so all decide alike.
  char **vals = calloc((size_t)size, sizeof(char *));
  dlua_shm_t *s = NULL;
  dlua_status_t st = !vals ? DLUA_ERR(DLUA_ERR_OOM, "shm join: out of memory") : put(store, prefix, "place", rank, mine);
  if (st == DLUA_OK) st = gather(store, prefix, "place", size, timeout_ms, vals);
  int usable = st == DLUA_OK;
  for (int q = 0; q < size && usable; q++) {
    if (!strcmp(vals[q], "off")) {
      snprintf(why, whylen, "rank %d set DLUA_SHM=0", q);
      usable = 0;
    } else if (strcmp(vals[q], vals[0])) {
      snprintf(why, whylen, "ranks 0 and %d are on different hosts", q);
      usable = 0;
    }
  }
  for (int q = 0; vals && q < size; q++) dlua_store_free_value(vals[q]), vals[q] = NULL;

  // 2. Rank 0 makes the segment and names it; the others map it and say whether they could.
  char name[96] = "", val[160];
  uint64_t nonce = 0;
  if (st == DLUA_OK && usable) {
    if (rank == 0) {
      nonce = random_nonce();
      s = create(size, name, sizeof name, nonce, why, whylen);
      snprintf(val, sizeof val, "%s %016" PRIx64, s ? name : "-", nonce);
      st = put(store, prefix, "segment", 0, val);
    } else {
      char key[256];
      void *v = NULL;
      size_t len;
      snprintf(key, sizeof key, "%s/shm/segment/0", prefix);
      st = dlua_store_get(store, key, timeout_ms, &v, &len);
      if (st == DLUA_OK) {
        if (sscanf(v, "%95s %" SCNx64, name, &nonce) == 2 && strcmp(name, "-"))
          s = attach(rank, size, name, nonce, why, whylen);
        else
          snprintf(why, whylen, "rank 0 could not make the segment");
      }
      dlua_store_free_value(v);
    }
    if (s && lock_byte(s->fd, F_OFD_SETLK, rank, NULL) != 0) {
      snprintf(why, whylen, "locking the segment on rank %d: %s", rank, strerror(errno));
      drop(s);
      s = NULL;
    }
    if (st == DLUA_OK) st = put(store, prefix, "mapped", rank, s ? "1" : "0");
    if (st == DLUA_OK) st = gather(store, prefix, "mapped", size, timeout_ms, vals);
    // Every rank has opened it (or given up): the name can go, so nothing is left behind however we end.
    if (rank == 0 && name[0] && strcmp(name, "-")) shm_unlink(name);
    for (int q = 0; st == DLUA_OK && q < size; q++)
      if (strcmp(vals[q], "1")) {
        if (s) snprintf(why, whylen, "rank %d could not map the segment", q);
        drop(s);
        s = NULL;
        break;
      }
    for (int q = 0; vals && q < size; q++) dlua_store_free_value(vals[q]);
  }
  free(vals);
  if (st != DLUA_OK) {
    drop(s);
    *store_status = st;
    snprintf(err, errlen, "%s", dlua_last_error());
    return st == DLUA_ERR_TIMEOUT ? DLUA_PG_TIMEOUT : DLUA_PG_FAILED;
  }
  if (s) snprintf(why, whylen, "all %d ranks on this host", size);
  *out = s;
  return DLUA_PG_OK;
}

/* ---- shared regions ----------------------------------------------------------------------------------- */

static void region_unmap(shm_region_t *g) {
  size_t map = (g->bytes + 4095) & ~(size_t)4095;
  for (int q = 0; q < g->size; q++)
    if (g->base[q]) munmap(g->base[q], map);
  free(g);
}

dlua_status_t dlua_shm_region_new(dlua_shm_t *s, dlua_store_t *store, const char *prefix, int64_t id, size_t bytes,
                                  int64_t timeout_ms, void **out, void **handle, char *why, size_t whylen) {
  *out = *handle = NULL;
  const int n = s->size, r = s->rank;
  size_t map = (bytes + 4095) & ~(size_t)4095;
  if (map == 0) map = 4096;
  shm_region_t *g = calloc(1, sizeof *g + (size_t)n * sizeof(char *));
  char **vals = calloc((size_t)n, sizeof(char *));
  char name[96], what[64];
  int ok = g && vals;
  if (g) *g = (shm_region_t){.owner = s, .rank = r, .size = n, .bytes = map};
  // 1. This rank's copy, pages reserved, under a fresh name.
  snprintf(name, sizeof name, "/dlua-%d-r%" PRId64 "-%08x", (int)getpid(), id, (unsigned)random_nonce());
  char failure[128] = "out of memory";
  void *own = ok ? map_new(name, map, NULL, failure, sizeof failure) : MAP_FAILED;
  if (own == MAP_FAILED) {
    ok = 0;
    snprintf(why, whylen, "rank %d: %s", r, failure);
  } else {
    g->base[r] = own;
  }
  snprintf(what, sizeof what, "region%" PRId64 "/name", id);
  dlua_status_t st = put(store, prefix, what, r, ok ? name : "-");
  if (st == DLUA_OK) st = gather(store, prefix, what, n, timeout_ms, vals);
  // 2. Everybody's copy, mapped here.
  for (int q = 0; st == DLUA_OK && q < n; q++) {
    if (q == r || !ok) continue;
    if (!strcmp(vals[q], "-")) {
      ok = 0;
      snprintf(why, whylen, "rank %d could not make its copy", q);
      break;
    }
    int open_errno;
    void *p = map_existing(vals[q], map, NULL, &open_errno);
    if (p == MAP_FAILED) {
      ok = 0;
      snprintf(why, whylen, "rank %d: mapping rank %d's copy %s failed", r, q, vals[q]);
      break;
    }
    g->base[q] = p;
  }
  for (int q = 0; vals && q < n; q++) dlua_store_free_value(vals[q]), vals[q] = NULL;
  // 3. Did everyone map everything? Then the names can go (the mappings keep the memory).
  snprintf(what, sizeof what, "region%" PRId64 "/mapped", id);
  if (st == DLUA_OK) st = put(store, prefix, what, r, ok ? "1" : "0");
  if (st == DLUA_OK) st = gather(store, prefix, what, n, timeout_ms, vals);
  if (own != MAP_FAILED) shm_unlink(name);  // (map_new unlinked it itself on failure)
  for (int q = 0; st == DLUA_OK && q < n; q++)
    if (strcmp(vals[q], "1")) {
      if (ok) snprintf(why, whylen, "rank %d could not map every copy", q);
      ok = 0;
    }
  for (int q = 0; vals && q < n; q++) dlua_store_free_value(vals[q]);
  free(vals);
  if (st != DLUA_OK || !ok) {
    if (g) region_unmap(g);
    return st;  // not ok with a working store: no region, every rank alike (*out NULL, why says why)
  }
  pthread_mutex_lock(&regions_mu);
  g->next = regions;
  regions = g;
  pthread_mutex_unlock(&regions_mu);
  *out = g->base[r];
  *handle = g;
  snprintf(why, whylen, "shared by all %d ranks", n);
  return DLUA_OK;
}

void dlua_shm_region_free(void *ctx, void *data) {
  (void)data;
  shm_region_t *g = ctx;
  pthread_mutex_lock(&regions_mu);
  for (shm_region_t **pp = &regions; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  pthread_mutex_unlock(&regions_mu);
  region_unmap(g);
}

void dlua_shm_close(dlua_shm_t *s) {
  if (!s) return;
  pthread_mutex_lock(&regions_mu);
  for (shm_region_t *g = regions; g; g = g->next)
    if (g->owner == s) g->owner = NULL;
  pthread_mutex_unlock(&regions_mu);
  drop(s);
}

/* ---- progress counters ---------------------------------------------------------------------------- */

static void post(dlua_shm_t *s, uint32_t v) {
  shm_ctl_t *c = ctl(s, s->rank);
  __atomic_store_n(&c->seq, v, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&c->waiters, __ATOMIC_SEQ_CST))
    syscall(SYS_futex, &c->seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static int reached(const shm_ctl_t *c, uint32_t v) {
  return (int32_t)(__atomic_load_n(&c->seq, __ATOMIC_ACQUIRE) - v) >= 0;
}

/* Until rank q has posted v: spins briefly, then sleeps on q's counter, looking every SHM_POLL_MS at
   the deadline and whether q still holds its lock. *who gets q on failure. */
static dlua_shm_result_t wait_for(dlua_shm_t *s, int q, uint32_t v, int64_t deadline) {
  shm_ctl_t *c = ctl(s, q);
  int64_t spin_end = now_ns() + SHM_SPIN_NS;
  while (!reached(c, v)) {
    if (now_ns() < spin_end) {
      __builtin_ia32_pause();
      continue;
    }
    __atomic_add_fetch(&c->waiters, 1, __ATOMIC_SEQ_CST);
    uint32_t seen = __atomic_load_n(&c->seq, __ATOMIC_SEQ_CST);
    int timed_out = 0;
    if ((int32_t)(seen - v) < 0) {
      struct timespec ts = {0, SHM_POLL_MS * 1000000L};
      timed_out = syscall(SYS_futex, &c->seq, FUTEX_WAIT, seen, &ts, NULL, 0) != 0 && errno == ETIMEDOUT;
    }
    __atomic_sub_fetch(&c->waiters, 1, __ATOMIC_SEQ_CST);
    if (reached(c, v)) break;
    if (timed_out || now_ns() >= deadline) {
      if (!alive(s, q)) return DLUA_SHM_GONE;
      if (now_ns() >= deadline) return DLUA_SHM_TIMEOUT;
    }
  }
  return DLUA_SHM_OK;
}

static dlua_shm_result_t wait_all(dlua_shm_t *s, uint32_t v, int64_t deadline, int *who) {
  for (int q = 0; q < s->size; q++) {
    if (q == s->rank) continue;
    dlua_shm_result_t r = wait_for(s, q, v, deadline);
    if (r != DLUA_SHM_OK) {
      *who = q;
      return r;
    }
  }
  return DLUA_SHM_OK;
}

/* ---- collectives ------------------------------------------------------------------------------------ */

enum { SHM_ALL_REDUCE, SHM_REDUCE_SCATTER, SHM_ALL_GATHER, SHM_BROADCAST };
static const char *const kind_name[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
static const char *const op_name[] = {"sum", "avg", "max", "min", "product"};

static dlua_shm_result_t failed(dlua_shm_result_t r, int who, int64_t timeout_ms, char *err, size_t errlen) {
  if (r == DLUA_SHM_GONE)
    snprintf(err, errlen, "rank %d left the shared-memory segment", who);
  else
    snprintf(err, errlen, "rank %d did not reach the shared-memory segment within %" PRId64 " ms", who, timeout_ms);
  return r;
}

/* This rank's side of the collective, for the peers' mismatch check. */
static void describe_at(dlua_shm_t *s, int kind, int64_t seq, uint64_t count, uint64_t total, dlua_dtype_t dt, int arg,
                        int64_t shared_at) {
  ctl(s, s->rank)->d[(s->chunk + 1) & 1] = (shm_desc_t){.op_seq = seq, .kind = kind, .count = count, .total = total,
                                                        .dtype = (int32_t)dt, .arg = arg, .shared_at = shared_at};
}
static void describe(dlua_shm_t *s, int kind, int64_t seq, uint64_t count, uint64_t total, dlua_dtype_t dt, int arg) {
  describe_at(s, kind, seq, count, total, dt, arg, -1);
}

/* After chunk 1's data phase: do all ranks run the same collective on the same shape? */
static int mismatch(const dlua_shm_t *s, int set, int64_t seq, char *err, size_t errlen) {
  const shm_desc_t *me = &ctl(s, s->rank)->d[set];
  int bad = 0;
  for (int q = 0; q < s->size; q++) {
    const shm_desc_t *c = &ctl(s, q)->d[set];
    int own_count = me->kind == SHM_ALL_GATHER || me->kind == SHM_REDUCE_SCATTER;  // per rank, may differ
    bad |= c->op_seq != me->op_seq || c->kind != me->kind || c->total != me->total || c->dtype != me->dtype ||
           c->arg != me->arg || (!own_count && c->count != me->count) || c->shared_at != me->shared_at;
  }
  if (!bad) return 0;
  size_t l = (size_t)snprintf(err, errlen, "collective mismatch at #%" PRId64 ":", seq);
  for (int q = 0; q < s->size && l < errlen; q++) {
    const shm_desc_t *c = &ctl(s, q)->d[set];
    const char *dn = c->dtype >= 0 && c->dtype < DLUA_DTYPE_COUNT ? dlua_dtype_name((dlua_dtype_t)c->dtype) : "?";
    const char *kn = c->kind >= 0 && c->kind <= SHM_BROADCAST ? kind_name[c->kind] : "?";
    char extra[80] = "";
    if (c->shared_at >= 0)
      snprintf(extra, sizeof extra, " op %s, shared at +%" PRId64,
               c->arg >= 0 && c->arg < DLUA_PG_REDUCE_COUNT ? op_name[c->arg] : "?", c->shared_at);
    else if (c->kind == SHM_BROADCAST)
      snprintf(extra, sizeof extra, " src %d", c->arg);
    else if (c->kind != SHM_ALL_GATHER)
      snprintf(extra, sizeof extra, " op %s", c->arg >= 0 && c->arg < DLUA_PG_REDUCE_COUNT ? op_name[c->arg] : "?");
    l += (size_t)snprintf(err + l, errlen - l, "%s rank %d %s #%" PRId64 " %s (%" PRIu64 ")%s", q ? ";" : "", q, kn,
                          c->op_seq, dn, c->count, extra);
  }
  return 1;
}

/* Chunk g's data is in this rank's slot: tell the peers, wait until theirs is too, and on the first chunk
   check that everybody runs the same collective. */
static dlua_shm_result_t data_in(dlua_shm_t *s, uint32_t g, int first, int64_t seq, int64_t deadline,
                                 int64_t timeout_ms, char *err, size_t errlen) {
  int who = -1;
  post(s, 2 * g - 1);
  dlua_shm_result_t res = wait_all(s, 2 * g - 1, deadline, &who);
  if (res != DLUA_SHM_OK) return failed(res, who, timeout_ms, err, errlen);
  if (first && mismatch(s, (int)(g & 1), seq, err, errlen)) return DLUA_SHM_MISMATCH;  // every rank sees the same
  return DLUA_SHM_OK;
}

static int64_t deadline_of(int64_t timeout_ms) { return now_ns() + timeout_ms * 1000000; }

/* dst = src[0] op src[1] op ... op src[n-1], in rank order (dst may be src[0] or src[1], not a later one). */
static void sum_ranks(dlua_pg_reduce_fn fn, void *dst, const char *const *src, int n, size_t len) {
  fn(dst, src[0], src[1], len);
  for (int q = 2; q < n; q++) fn(dst, dst, src[q], len);
}

/* All-reduce's split of m elements into one piece per rank: rank q owns [lo(q), hi(q)), pieces starting
   on cache lines. */
typedef struct {
  size_t piece, m;
} shm_split_t;
static shm_split_t split(size_t m, int n, size_t es) {
  size_t align = 64 / es, piece = (m + (size_t)n - 1) / (size_t)n;
  return (shm_split_t){.piece = (piece + align - 1) / align * align, .m = m};
}
static size_t lo(shm_split_t sp, int q) { return (size_t)q * sp.piece < sp.m ? (size_t)q * sp.piece : sp.m; }
static size_t hi(shm_split_t sp, int q) { return lo(sp, q) + sp.piece < sp.m ? lo(sp, q) + sp.piece : sp.m; }

/* The region of this group that holds [p, p + len), and p's offset in it; NULL if none does. The region
   stays mapped while the caller holds a tensor on it (the work does). */
static shm_region_t *region_of(dlua_shm_t *s, const void *p, size_t len, size_t *at) {
  const char *c = p;
  shm_region_t *found = NULL;
  pthread_mutex_lock(&regions_mu);
  for (shm_region_t *g = regions; g && !found; g = g->next)
    if (g->owner == s && c >= g->base[g->rank] && c + len <= g->base[g->rank] + g->bytes) found = g;
  pthread_mutex_unlock(&regions_mu);
  if (found) *at = (size_t)(c - found->base[found->rank]);
  return found;
}

/* All-reduce of a range every rank holds in a shared region: no copy in. Each rank sums its 1/N piece
   from the N copies where they lie into its own copy, then copies the others' pieces from theirs; three
   rendezvous per call whatever the size, the last one so that no peer still reads this rank's copy when
   the caller writes it again. */
static dlua_shm_result_t all_reduce_shared(dlua_shm_t *s, shm_region_t *rg, size_t at, size_t count, dlua_dtype_t dt,
                                           dlua_reduce_t op, int64_t seq, int64_t timeout_ms, char *err,
                                           size_t errlen) {
  const size_t es = dlua_dtype_size(dt);
  const int n = s->size, r = s->rank;
  const int64_t deadline = deadline_of(timeout_ms);
  dlua_pg_reduce_fn fn = dlua_pg_reduce_fn_for(op, dt);
  describe_at(s, SHM_ALL_REDUCE, seq, count, count, dt, (int)op, (int64_t)at);
  uint32_t g = ++s->chunk;
  dlua_shm_result_t res = data_in(s, g, 1, seq, deadline, timeout_ms, err, errlen);
  if (res != DLUA_SHM_OK) return res;
  ++s->chunk;  // two chunk numbers: the rendezvous after the sums and the one at the end
  shm_split_t sp = split(count, n, es);
#define AT(q, i) (rg->base[(q)] + at + (i) * es)
  const char *src[n];
  size_t mine = lo(sp, r), len = hi(sp, r) - mine;
  // The destination is one of the first two operands (ranks 0, 1): sum as it goes. Otherwise this rank's
  // copy is read in its turn: sum a block at a time in scratch.
  size_t block = r < 2 ? len : SHM_SLOT_BYTES / es;
  for (size_t b = mine; b < mine + len; b += block) {
    size_t k = mine + len - b < block ? mine + len - b : block;
    for (int q = 0; q < n; q++) src[q] = AT(q, b);
    sum_ranks(fn, r < 2 ? AT(r, b) : s->scratch, src, n, k);
    if (r >= 2) memcpy(AT(r, b), s->scratch, k * es);
  }
  if (len && op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(AT(r, mine), len, dt, n);
  int who = -1;
  post(s, 2 * g);
  if ((res = wait_all(s, 2 * g, deadline, &who)) != DLUA_SHM_OK) return failed(res, who, timeout_ms, err, errlen);
  for (int q = 0; q < n; q++)
    if (q != r) memcpy(AT(r, lo(sp, q)), AT(q, lo(sp, q)), (hi(sp, q) - lo(sp, q)) * es);
#undef AT
  post(s, 2 * (g + 1) - 1);
  if ((res = wait_all(s, 2 * (g + 1) - 1, deadline, &who)) != DLUA_SHM_OK)
    return failed(res, who, timeout_ms, err, errlen);
  return DLUA_SHM_OK;
}

dlua_shm_result_t dlua_shm_all_reduce(dlua_shm_t *s, void *buf, size_t count, dlua_dtype_t dt, dlua_reduce_t op,
                                      int64_t seq, int64_t timeout_ms, char *err, size_t errlen) {
  const size_t es = dlua_dtype_size(dt), per_chunk = SHM_SLOT_BYTES / es;
  dlua_pg_reduce_fn fn = dlua_pg_reduce_fn_for(op, dt);
  const int n = s->size, r = s->rank;
  const int64_t deadline = deadline_of(timeout_ms);
  char *data = buf;
  size_t at;
  shm_region_t *rg = region_of(s, buf, count * es, &at);
  if (rg) return all_reduce_shared(s, rg, at, count, dt, op, seq, timeout_ms, err, errlen);
  describe(s, SHM_ALL_REDUCE, seq, count, count, dt, (int)op);
  size_t off = 0;
  do {
    size_t m = count - off < per_chunk ? count - off : per_chunk;
    shm_split_t sp = split(m, n, es);
    uint32_t g = ++s->chunk;
    int set = (int)(g & 1);
    char *mine = slot(s, set, r), *src = data + off * es;
    size_t a = lo(sp, r), len = hi(sp, r) - a;
    // In: everything but the piece this rank reduces (it reads that one from its own buffer).
    memcpy(mine, src, a * es);
    memcpy(mine + (a + len) * es, src + (a + len) * es, (m - a - len) * es);
    dlua_shm_result_t res = data_in(s, g, off == 0, seq, deadline, timeout_ms, err, errlen);
    if (res != DLUA_SHM_OK) return res;
    // Reduce: this rank's piece, in rank order, into its own slot, where the others will read it.
    if (len) {
      char *dst = mine + a * es;
      const char *from[n];
      for (int q = 0; q < n; q++) from[q] = (q == r ? src : slot(s, set, q)) + a * es;
      sum_ranks(fn, dst, from, n, len);
      if (op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(dst, len, dt, n);
      memcpy(src + a * es, dst, len * es);
    }
    int who = -1;
    post(s, 2 * g);
    res = wait_all(s, 2 * g, deadline, &who);
    if (res != DLUA_SHM_OK) return failed(res, who, timeout_ms, err, errlen);
    // Out: the others' reduced pieces.
    for (int q = 0; q < n; q++)
      if (q != r) memcpy(src + lo(sp, q) * es, slot(s, set, q) + lo(sp, q) * es, (hi(sp, q) - lo(sp, q)) * es);
    off += m;
  } while (off < count);
  return DLUA_SHM_OK;
}

dlua_shm_result_t dlua_shm_reduce_scatter(dlua_shm_t *s, const void *in, void *out, const size_t *counts,
                                          dlua_dtype_t dt, dlua_reduce_t op, int64_t seq, int64_t timeout_ms, char *err,
                                          size_t errlen) {
  const int n = s->size, r = s->rank;
  const size_t es = dlua_dtype_size(dt), per_chunk = SHM_SLOT_BYTES / es / (size_t)n;
  dlua_pg_reduce_fn fn = dlua_pg_reduce_fn_for(op, dt);
  const int64_t deadline = deadline_of(timeout_ms);
  const char *data = in;
  size_t most = 0, total = 0, at[n];  // at[q]: where destination q's part starts in `in`
  for (int q = 0; q < n; q++) {
    at[q] = total;
    total += counts[q];
    if (counts[q] > most) most = counts[q];
  }
  describe(s, SHM_REDUCE_SCATTER, seq, counts[r], total, dt, (int)op);
  size_t off = 0;
  do {
    uint32_t g = ++s->chunk;
    int set = (int)(g & 1);
#define PART(q) (off < counts[q] ? (counts[q] - off < per_chunk ? counts[q] - off : per_chunk) : 0)
    // In: this chunk of every destination's part, own included (so the sum below reads slots only); part q
    // at q * per_chunk in the slot
    char *mine = slot(s, set, r);
    for (int q = 0; q < n; q++) memcpy(mine + (size_t)q * per_chunk * es, data + (at[q] + off) * es, PART(q) * es);
    dlua_shm_result_t res = data_in(s, g, off == 0, seq, deadline, timeout_ms, err, errlen);
    if (res != DLUA_SHM_OK) return res;
    // Reduce this rank's part over the ranks, in rank order, into out.
    size_t c = PART(r);
#undef PART
    if (c) {
      char *dst = (char *)out + off * es;
      const char *from[n];
      for (int q = 0; q < n; q++) from[q] = slot(s, set, q) + (size_t)r * per_chunk * es;
      sum_ranks(fn, dst, from, n, c);
      if (op == DLUA_PG_REDUCE_AVG) dlua_pg_divide_by(dst, c, dt, n);
    }
    off += per_chunk;
  } while (off < most);
  return DLUA_SHM_OK;
}

dlua_shm_result_t dlua_shm_all_gather(dlua_shm_t *s, const void *in, void *out, const size_t *counts, dlua_dtype_t dt,
                                      int64_t seq, int64_t timeout_ms, char *err, size_t errlen) {
  const int n = s->size, r = s->rank;
  const size_t es = dlua_dtype_size(dt), per_chunk = SHM_SLOT_BYTES / es;
  const int64_t deadline = deadline_of(timeout_ms);
  size_t most = 0, total = 0;
  for (int q = 0; q < n; q++) {
    total += counts[q];
    if (counts[q] > most) most = counts[q];
  }
  describe(s, SHM_ALL_GATHER, seq, counts[r], total, dt, 0);
  size_t off = 0;
  do {
    uint32_t g = ++s->chunk;
    int set = (int)(g & 1);
#define PART(q) (off < counts[q] ? (counts[q] - off < per_chunk ? counts[q] - off : per_chunk) : 0)
    memcpy(slot(s, set, r), (const char *)in + off * es, PART(r) * es);
    dlua_shm_result_t res = data_in(s, g, off == 0, seq, deadline, timeout_ms, err, errlen);
    if (res != DLUA_SHM_OK) return res;
    size_t base = 0;
    for (int q = 0; q < n; base += counts[q], q++)
      memcpy((char *)out + (base + off) * es, q == r ? (const char *)in + off * es : slot(s, set, q), PART(q) * es);
#undef PART
    off += per_chunk;
  } while (off < most);
  return DLUA_SHM_OK;
}

dlua_shm_result_t dlua_shm_broadcast(dlua_shm_t *s, void *buf, size_t count, dlua_dtype_t dt, int root, int64_t seq,
                                     int64_t timeout_ms, char *err, size_t errlen) {
  const size_t es = dlua_dtype_size(dt), per_chunk = SHM_SLOT_BYTES / es;
  const int64_t deadline = deadline_of(timeout_ms);
  describe(s, SHM_BROADCAST, seq, count, count, dt, root);
  size_t off = 0;
  do {
    size_t c = count - off < per_chunk ? count - off : per_chunk;
    uint32_t g = ++s->chunk;
    int set = (int)(g & 1);
    char *data = (char *)buf + off * es;
    if (s->rank == root) memcpy(slot(s, set, root), data, c * es);
    dlua_shm_result_t res = data_in(s, g, off == 0, seq, deadline, timeout_ms, err, errlen);
    if (res != DLUA_SHM_OK) return res;
    if (s->rank != root) memcpy(data, slot(s, set, root), c * es);
    off += c;
  } while (off < count);
  return DLUA_SHM_OK;
}

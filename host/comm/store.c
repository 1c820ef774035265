/* The rendezvous store: a TCP key-value server (one poll() thread) and its blocking client. */
#define _GNU_SOURCE /* accept4, pipe2, POLLRDHUP */
#include "comm/store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"
#include "core/runtime.h"

#ifndef POLLRDHUP
#define POLLRDHUP 0
#endif

/* Longest timeout honoured; larger ones are clamped so deadlines never overflow. */
#define STORE_MAX_TIMEOUT_MS ((int64_t)30 * 24 * 3600 * 1000)
/* How long the client waits for a reply beyond the server-side timeout of a blocking op,
   before it declares the server unresponsive. */
#define STORE_REPLY_GRACE_MS 2000
/* The client wakes this often while blocked, to notice Ctrl-C. */
#define STORE_POLL_SLICE_MS 100

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t clamp_timeout(int64_t ms) {
  if (ms < 0) return 0;
  return ms > STORE_MAX_TIMEOUT_MS ? STORE_MAX_TIMEOUT_MS : ms;
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

typedef struct {
  const uint8_t *p;
  uint32_t len;
} blob_t;

/* Splits `n` length-prefixed blobs out of [p, end); -1 if the lengths do not add up. */
static int parse_blobs(const uint8_t *p, const uint8_t *end, uint32_t n, blob_t *out) {
  for (uint32_t i = 0; i < n; i++) {
    if (end - p < 4) return -1;
    uint32_t len = get_u32(p);
    p += 4;
    if ((uint64_t)(end - p) < len) return -1;
    out[i].p = p;
    out[i].len = len;
    p += len;
  }
  return p == end ? 0 : -1;
}

/* Keys printed in messages: non-printable bytes become '?', long keys are cut. */
static void key_for_message(char *dst, size_t cap, const uint8_t *key, size_t len) {
  size_t n = 0;
  for (size_t i = 0; i < len && n + 4 < cap; i++) {
    if (i == 64) {
      memcpy(dst + n, "...", 3);
      n += 3;
      break;
    }
    dst[n++] = (key[i] >= 0x20 && key[i] < 0x7f) ? (char)key[i] : '?';
  }
  dst[n] = '\0';
}

/* ==== the table ============================================================================ */

typedef struct entry {
  struct entry *next;
  uint64_t hash;
  uint8_t *value; /* value_len bytes plus a NUL, so counters parse as text */
  size_t value_len;
  uint32_t key_len;
  uint8_t key[];
} entry_t;

typedef struct {
  entry_t **buckets;
  size_t nbuckets; /* a power of two */
  size_t count;
} table_t;

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: keys are short, collisions only cost a compare
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static entry_t **table_slot(table_t *t, const uint8_t *key, size_t len, uint64_t h) {
  entry_t **e = &t->buckets[h & (t->nbuckets - 1)];
  while (*e && !((*e)->hash == h && (*e)->key_len == len && memcmp((*e)->key, key, len) == 0)) e = &(*e)->next;
  return e;
}

static entry_t *table_find(table_t *t, const blob_t *key) {
  if (t->count == 0) return NULL;
  return *table_slot(t, key->p, key->len, hash_bytes(key->p, key->len));
}

static int table_grow(table_t *t) {
  size_t n = t->nbuckets ? t->nbuckets * 2 : 64;
  entry_t **b = calloc(n, sizeof *b);
  if (!b) return -1;
  for (size_t i = 0; i < t->nbuckets; i++) {
    for (entry_t *e = t->buckets[i], *next; e; e = next) {
      next = e->next;
      e->next = b[e->hash & (n - 1)];
      b[e->hash & (n - 1)] = e;
    }
  }
  free(t->buckets);
  t->buckets = b;
  t->nbuckets = n;
  return 0;
}

static uint8_t *copy_value(const uint8_t *p, size_t len) {
  uint8_t *v = malloc(len + 1);
  if (!v) return NULL;
  if (len) memcpy(v, p, len);
  v[len] = '\0';
  return v;
}

/* Stores key = value; *created says whether the key is new. -1 when out of memory. */
static int table_put(table_t *t, const blob_t *key, const uint8_t *value, size_t len, int *created) {
  if (t->count >= t->nbuckets && table_grow(t) != 0) return -1;
  uint64_t h = hash_bytes(key->p, key->len);
  entry_t **slot = table_slot(t, key->p, key->len, h);
  uint8_t *v = copy_value(value, len);
  if (!v) return -1;
  if (*slot) {
    free((*slot)->value);
    (*slot)->value = v;
    (*slot)->value_len = len;
    *created = 0;
    return 0;
  }
  entry_t *e = malloc(sizeof *e + key->len);
  if (!e) {
    free(v);
    return -1;
  }
  e->next = NULL;
  e->hash = h;
  e->value = v;
  e->value_len = len;
  e->key_len = key->len;
  memcpy(e->key, key->p, key->len);
  *slot = e;
  t->count++;
  *created = 1;
  return 0;
}

static int table_delete(table_t *t, const blob_t *key) {
  if (t->count == 0) return 0;
  entry_t **slot = table_slot(t, key->p, key->len, hash_bytes(key->p, key->len));
  entry_t *e = *slot;
  if (!e) return 0;
  *slot = e->next;
  free(e->value);
  free(e);
  t->count--;
  return 1;
}

static void table_free(table_t *t) {
  for (size_t i = 0; i < t->nbuckets; i++) {
    for (entry_t *e = t->buckets[i], *next; e; e = next) {
      next = e->next;
      free(e->value);
      free(e);
    }
  }
  free(t->buckets);
  memset(t, 0, sizeof *t);
}

/* ==== the server =========================================================================== */

/* One thread polls every socket. Why not a thread per client: a job of N ranks parks N
   connections in the same barrier wait; one thread with a table of parked requests wakes
   them when the key appears, needs no locks around the table, costs no thread stacks per
   rank, and stops deterministically (one pipe write, one join). */

typedef struct {
  int fd;
  int authed;
  int closing; /* close once the output is flushed (refusals, protocol errors) */
  int dead;
  int parked;          /* a GET/WAIT whose frame stays at the head of `in` until it completes */
  uint64_t parked_gen; /* the server's key-creation count when it was last checked */
  int64_t deadline;    /* parked: when to answer TIMEOUT; not yet authed: end of handshake */
  uint8_t *in;
  size_t in_len, in_cap;
  uint8_t *out;
  size_t out_len, out_off, out_cap;
} conn_t;

struct dlua_store_server {
  pthread_t thread;
  int listen_fd;
  int wake_rd, wake_wr; /* stop() writes a byte here */
  int port;
  char host[256];
  char token[DLUA_STORE_MAX_TOKEN + 1];
  size_t token_len;
  conn_t **conns;
  size_t nconns, conns_cap;
  struct pollfd *pfds;
  size_t pfds_cap;
  table_t table;
  uint64_t create_gen;         /* bumped whenever a key comes into existence */
  int64_t accept_paused_until; /* out of file descriptors: stop accepting for a moment */
  atomic_int num_clients;
  atomic_int_fast64_t num_keys;
};

static void conn_free(conn_t *c) {
  if (c->fd >= 0) close(c->fd);
  free(c->in);
  free(c->out);
  free(c);
}

static int out_reserve(conn_t *c, size_t extra) {
  if (c->out_cap - c->out_len >= extra) return 0;
  size_t need = c->out_len + extra;
  size_t cap = c->out_cap ? c->out_cap : 256;
  while (cap < need) cap *= 2;
  uint8_t *p = realloc(c->out, cap);
  if (!p) return -1;
  c->out = p;
  c->out_cap = cap;
  return 0;
}

/* Queues one reply frame. On allocation failure the connection is dropped: the client
   then sees a lost connection, which beats a reply that never comes. */
static void reply(conn_t *c, uint8_t status, uint32_t n, const blob_t *blobs) {
  size_t body = 1 + 4;
  for (uint32_t i = 0; i < n; i++) body += 4 + (size_t)blobs[i].len;
  if (out_reserve(c, 4 + body) != 0) {
    c->dead = 1;
    return;
  }
  uint8_t *p = c->out + c->out_len;
  put_u32(p, (uint32_t)body);
  p[4] = status;
  put_u32(p + 5, n);
  p += 9;
  for (uint32_t i = 0; i < n; i++) {
    put_u32(p, blobs[i].len);
    if (blobs[i].len) memcpy(p + 4, blobs[i].p, blobs[i].len);
    p += 4 + blobs[i].len;
  }
  c->out_len += 4 + body;
}

static void reply_text(conn_t *c, uint8_t status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void reply_text(conn_t *c, uint8_t status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  blob_t b = {(const uint8_t *)msg, (uint32_t)strlen(msg)};
  reply(c, status, 1, &b);
}

static void conn_flush(conn_t *c) {
  while (c->out_off < c->out_len) {
    ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (k > 0) {
      c->out_off += (size_t)k;
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      c->dead = 1;  // the peer went away; its pending replies have nobody to read them
      return;
    }
  }
  c->out_off = c->out_len = 0;
  if (c->out_cap > ((size_t)1 << 20)) {  // a multi-MB GET reply: do not keep the buffer per client
    free(c->out);
    c->out = NULL;
    c->out_cap = 0;
  }
  if (c->closing) c->dead = 1;
}

/* Reads what the socket has, without letting the buffer grow past the frame being read. */
static void conn_read(conn_t *c) {
  size_t limit = c->authed ? DLUA_STORE_MAX_FRAME : DLUA_STORE_MAX_HELLO_FRAME;
  size_t want = 64 * 1024;
  if (c->in_len >= 4) {
    size_t frame = 4 + (size_t)get_u32(c->in);
    if (frame - 4 > limit) {
      c->dead = 1;
      return;
    }
    if (frame > c->in_len && frame - c->in_len > want) want = frame - c->in_len;
  }
  if (c->in_cap - c->in_len < want) {
    size_t cap = c->in_len + want;
    uint8_t *p = realloc(c->in, cap);
    if (!p) {
      c->dead = 1;
      return;
    }
    c->in = p;
    c->in_cap = cap;
  }
  ssize_t k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
  if (k > 0) {
    c->in_len += (size_t)k;
  } else if (k == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
    c->dead = 1;  // closed or reset, possibly mid-frame: drop it, nothing else to undo
  }
}

static int token_equal(const dlua_store_server_t *s, const blob_t *b) {
  // Constant time in the token's content, so probing it byte by byte learns nothing.
  unsigned diff = (unsigned)(b->len != s->token_len);
  for (size_t i = 0; i < s->token_len; i++) diff |= (unsigned)(s->token[i] ^ (i < b->len ? b->p[i] : 0));
  return diff == 0;
}

static void handle_hello(dlua_store_server_t *s, conn_t *c, uint8_t op, uint32_t n, const blob_t *b) {
  if (op != DLUA_STORE_OP_HELLO || n != 3 || b[0].len != DLUA_STORE_MAGIC_LEN ||
      memcmp(b[0].p, DLUA_STORE_MAGIC, DLUA_STORE_MAGIC_LEN) != 0 || b[1].len != 4) {
    reply_text(c, DLUA_STORE_REPLY_WRONG_TOKEN, "the first message must carry the job token");
    c->closing = 1;
    return;
  }
  uint32_t version = get_u32(b[1].p);
  if (version != DLUA_STORE_VERSION) {
    reply_text(c, DLUA_STORE_REPLY_BAD_REQUEST, "protocol version %u, the server speaks %d", version, DLUA_STORE_VERSION);
    c->closing = 1;
    return;
  }
  if (!token_equal(s, &b[2])) {
    reply_text(c, DLUA_STORE_REPLY_WRONG_TOKEN, "wrong job token");
    c->closing = 1;
    return;
  }
  c->authed = 1;
  c->deadline = 0;
  blob_t magic = {(const uint8_t *)DLUA_STORE_MAGIC, DLUA_STORE_MAGIC_LEN};
  reply(c, DLUA_STORE_REPLY_OK, 1, &magic);
}

/* Parses a decimal counter; the whole value must be the number. */
static int parse_counter(const entry_t *e, int64_t *v) {
  if (e->value_len == 0 || e->value_len > 20) return -1;
  char *end;
  errno = 0;
  long long x = strtoll((const char *)e->value, &end, 10);
  if (errno != 0 || end != (const char *)e->value + e->value_len) return -1;
  *v = (int64_t)x;
  return 0;
}

enum { FRAME_DONE, FRAME_PARKED };

/* GET and WAIT: answer now if every key exists, at the deadline with the missing keys, or
   park the connection until a key appears. */
static int handle_wait(dlua_store_server_t *s, conn_t *c, uint8_t op, int64_t timeout, uint32_t n, const blob_t *b) {
  uint32_t missing = 0;
  for (uint32_t i = 0; i < n; i++) missing += table_find(&s->table, &b[i]) == NULL;
  if (missing == 0) {
    if (op == DLUA_STORE_OP_GET) {
      entry_t *e = table_find(&s->table, &b[0]);
      blob_t v = {e->value, (uint32_t)e->value_len};
      reply(c, DLUA_STORE_REPLY_OK, 1, &v);
    } else {
      reply(c, DLUA_STORE_REPLY_OK, 0, NULL);
    }
    c->parked = 0;
    return FRAME_DONE;
  }
  int64_t now = now_ms();
  if (!c->parked) c->deadline = now + clamp_timeout(timeout);
  if (now >= c->deadline) {
    blob_t *miss = malloc(missing * sizeof *miss);
    if (!miss) {
      c->dead = 1;
      return FRAME_DONE;
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
      if (!table_find(&s->table, &b[i])) miss[k++] = b[i];
    reply(c, DLUA_STORE_REPLY_TIMEOUT, k, miss);
    free(miss);
    c->parked = 0;
    return FRAME_DONE;
  }
  c->parked = 1;
  c->parked_gen = s->create_gen;
  return FRAME_PARKED;
}

static void key_created(dlua_store_server_t *s) {
  s->create_gen++;
  atomic_store(&s->num_keys, (int_fast64_t)s->table.count);
}

static int valid_keys(uint32_t n, const blob_t *b) {
  for (uint32_t i = 0; i < n; i++)
    if (b[i].len == 0 || b[i].len > DLUA_STORE_MAX_KEY) return 0;
  return 1;
}

/* Handles the complete frame at the head of c->in. */
static int handle_frame(dlua_store_server_t *s, conn_t *c, const uint8_t *body, size_t len) {
  if (len < DLUA_STORE_REQUEST_FIXED) goto malformed;
  uint8_t op = body[0];
  int64_t timeout = (int64_t)get_u64(body + 1);
  uint32_t n = get_u32(body + 9);
  // Every blob costs at least its 4-byte length, which bounds n before allocating.
  if (n > DLUA_STORE_MAX_KEYS + 4 || (uint64_t)n * 4 > len - DLUA_STORE_REQUEST_FIXED) goto malformed;
  blob_t stack_blobs[8];
  blob_t *b = n <= 8 ? stack_blobs : malloc(n * sizeof *b);
  if (!b) {
    c->dead = 1;
    return FRAME_DONE;
  }
  int result = FRAME_DONE;
  if (parse_blobs(body + DLUA_STORE_REQUEST_FIXED, body + len, n, b) != 0) {
    reply_text(c, DLUA_STORE_REPLY_BAD_REQUEST, "blob lengths do not add up to the frame length");
    c->closing = 1;
    goto done;
  }
  if (!c->authed) {
    handle_hello(s, c, op, n, b);
    goto done;
  }
  int created = 0;
  switch (op) {
    case DLUA_STORE_OP_SET:
      if (n != 2 || !valid_keys(1, b)) goto bad_args;
      if (table_put(&s->table, &b[0], b[1].p, b[1].len, &created) != 0) {
        reply_text(c, DLUA_STORE_REPLY_ERROR, "store server out of memory storing %u bytes", b[1].len);
        break;
      }
      if (created) key_created(s);
      reply(c, DLUA_STORE_REPLY_OK, 0, NULL);
      break;
    case DLUA_STORE_OP_GET:
    case DLUA_STORE_OP_WAIT:
      if (n < 1 || n > DLUA_STORE_MAX_KEYS || (op == DLUA_STORE_OP_GET && n != 1) || !valid_keys(n, b)) goto bad_args;
      result = handle_wait(s, c, op, timeout, n, b);
      break;
    case DLUA_STORE_OP_ADD: {
      if (n != 2 || !valid_keys(1, b) || b[1].len != 8) goto bad_args;
      int64_t delta = (int64_t)get_u64(b[1].p), value = 0;
      entry_t *e = table_find(&s->table, &b[0]);
      char kbuf[80];
      if (e && parse_counter(e, &value) != 0) {
        key_for_message(kbuf, sizeof kbuf, b[0].p, b[0].len);
        reply_text(c, DLUA_STORE_REPLY_ERROR, "key '%s' holds %zu bytes that are not a decimal integer", kbuf, e->value_len);
        break;
      }
      if ((delta > 0 && value > INT64_MAX - delta) || (delta < 0 && value < INT64_MIN - delta)) {
        key_for_message(kbuf, sizeof kbuf, b[0].p, b[0].len);
        reply_text(c, DLUA_STORE_REPLY_ERROR, "counter '%s' = %" PRId64 " would overflow adding %" PRId64, kbuf, value, delta);
        break;
      }
      value += delta;
      char text[24];
      int tl = snprintf(text, sizeof text, "%" PRId64, value);
      if (table_put(&s->table, &b[0], (const uint8_t *)text, (size_t)tl, &created) != 0) {
        reply_text(c, DLUA_STORE_REPLY_ERROR, "store server out of memory");
        break;
      }
      if (created) key_created(s);
      uint8_t v8[8];
      put_u64(v8, (uint64_t)value);
      blob_t r = {v8, 8};
      reply(c, DLUA_STORE_REPLY_OK, 1, &r);
      break;
    }
    case DLUA_STORE_OP_COMPARE_SET: {
      if (n != 4 || !valid_keys(1, b) || b[1].len != 1) goto bad_args;
      int expect_absent = b[1].p[0] & DLUA_STORE_CAS_EXPECT_ABSENT;
      entry_t *e = table_find(&s->table, &b[0]);
      int swap = e ? (!expect_absent && e->value_len == b[2].len && memcmp(e->value, b[2].p, b[2].len) == 0)
                   : expect_absent;
      if (swap) {
        if (table_put(&s->table, &b[0], b[3].p, b[3].len, &created) != 0) {
          reply_text(c, DLUA_STORE_REPLY_ERROR, "store server out of memory storing %u bytes", b[3].len);
          break;
        }
        if (created) key_created(s);
        e = table_find(&s->table, &b[0]);
      }
      uint8_t present = e != NULL;
      blob_t r[2] = {{&present, 1}, {e ? e->value : NULL, e ? (uint32_t)e->value_len : 0}};
      reply(c, DLUA_STORE_REPLY_OK, 2, r);
      break;
    }
    case DLUA_STORE_OP_CHECK: {
      if (n < 1 || n > DLUA_STORE_MAX_KEYS || !valid_keys(n, b)) goto bad_args;
      uint8_t *flags = malloc(n);
      if (!flags) {
        c->dead = 1;
        break;
      }
      for (uint32_t i = 0; i < n; i++) flags[i] = table_find(&s->table, &b[i]) != NULL;
      blob_t r = {flags, n};
      reply(c, DLUA_STORE_REPLY_OK, 1, &r);
      free(flags);
      break;
    }
    case DLUA_STORE_OP_DELETE: {
      if (n != 1 || !valid_keys(1, b)) goto bad_args;
      uint8_t deleted = (uint8_t)table_delete(&s->table, &b[0]);
      atomic_store(&s->num_keys, (int_fast64_t)s->table.count);
      blob_t r = {&deleted, 1};
      reply(c, DLUA_STORE_REPLY_OK, 1, &r);
      break;
    }
    default:
      reply_text(c, DLUA_STORE_REPLY_BAD_REQUEST, "unknown operation %u", op);
      c->closing = 1;
      break;
  }
  goto done;
bad_args:
  reply_text(c, DLUA_STORE_REPLY_BAD_REQUEST, "operation %u: wrong arguments (%u blobs)", op, n);
  c->closing = 1;
done:
  if (b != stack_blobs) free(b);
  return result;
malformed:
  reply_text(c, DLUA_STORE_REPLY_BAD_REQUEST, "malformed request frame (%zu bytes)", len);
  c->closing = 1;
  return FRAME_DONE;
}

/* Runs the frames buffered on c until one parks, output backs up or the buffer runs dry.
   Returns 1 if anything happened. */
static int conn_process(dlua_store_server_t *s, conn_t *c, int64_t now) {
  int progress = 0;
  while (!c->dead && !c->closing && c->out_off == c->out_len) {
    if (c->parked && c->parked_gen == s->create_gen && now < c->deadline) break;
    if (c->in_len < 4) break;
    size_t body = get_u32(c->in);
    if (body > (c->authed ? DLUA_STORE_MAX_FRAME : DLUA_STORE_MAX_HELLO_FRAME)) {
      c->dead = 1;  // not our protocol (or hostile): there is no frame boundary to resync on
      break;
    }
    if (c->in_len < 4 + body) break;
    int was_parked = c->parked;
    int r = handle_frame(s, c, c->in + 4, body);
    if (r == FRAME_PARKED) {
      progress |= !was_parked;
      break;
    }
    progress = 1;
    c->in_len -= 4 + body;
    memmove(c->in, c->in + 4 + body, c->in_len);
    if (c->in_cap > ((size_t)1 << 20) && c->in_len < 64 * 1024) {  // release a multi-MB SET's buffer
      uint8_t *p = realloc(c->in, 64 * 1024);
      if (p) {
        c->in = p;
        c->in_cap = 64 * 1024;
      }
    }
    conn_flush(c);
  }
  return progress;
}

static void accept_clients(dlua_store_server_t *s) {
  for (;;) {
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors: the pending connection stays readable and poll() would spin.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        s->accept_paused_until = now_ms() + 100;
      return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small requests: no Nagle delay
    if (s->nconns == s->conns_cap) {
      size_t cap = s->conns_cap ? s->conns_cap * 2 : 16;
      conn_t **p = realloc(s->conns, cap * sizeof *p);
      if (!p) {
        close(fd);
        return;
      }
      s->conns = p;
      s->conns_cap = cap;
    }
    conn_t *c = calloc(1, sizeof *c);
    if (!c) {
      close(fd);
      return;
    }
    c->fd = fd;
    c->deadline = now_ms() + DLUA_STORE_HANDSHAKE_MS;
    s->conns[s->nconns++] = c;
    atomic_store(&s->num_clients, (int)s->nconns);
  }
}

static void *server_main(void *arg) {
  dlua_store_server_t *s = arg;
  for (;;) {
    size_t need = 2 + s->nconns;
    if (need > s->pfds_cap) {
      struct pollfd *p = realloc(s->pfds, need * 2 * sizeof *p);
      if (p) {
        s->pfds = p;
        s->pfds_cap = need * 2;
      } else {
        need = s->pfds_cap;  // poll the ones that fit; the rest wait for memory
      }
    }
    int64_t now = now_ms();
    int64_t next = -1;
    struct pollfd *pf = s->pfds;
    pf[0] = (struct pollfd){.fd = s->wake_rd, .events = POLLIN};
    int accepting = now >= s->accept_paused_until;
    pf[1] = (struct pollfd){.fd = accepting ? s->listen_fd : -1, .events = POLLIN};
    if (!accepting) next = s->accept_paused_until;
    size_t npf = 2;
    for (size_t i = 0; i < s->nconns && npf < need; i++) {
      conn_t *c = s->conns[i];
      short ev = POLLRDHUP;
      if (c->out_off < c->out_len) ev |= POLLOUT;
      else if (!c->parked) ev |= POLLIN;
      // A parked client only waits: POLLRDHUP alone tells us if it goes away.
      if ((c->parked || !c->authed) && (next < 0 || c->deadline < next)) next = c->deadline;
      pf[npf++] = (struct pollfd){.fd = c->fd, .events = ev};
    }
    int timeout = -1;
    if (next >= 0) timeout = next <= now ? 0 : (int)(next - now > INT_MAX ? INT_MAX : next - now);
    int r = poll(pf, npf, timeout);
    if (r < 0 && errno != EINTR) break;  // cannot happen with valid descriptors; do not spin
    if (r > 0 && (pf[0].revents & POLLIN)) break;
    if (r > 0 && (pf[1].revents & POLLIN)) accept_clients(s);
    now = now_ms();
    for (size_t i = 2; r > 0 && i < npf; i++) {
      conn_t *c = s->conns[i - 2];
      short re = pf[i].revents;
      if (re & POLLOUT) conn_flush(c);
      if (re & POLLIN) conn_read(c);
      else if (re & (POLLRDHUP | POLLHUP | POLLERR)) c->dead = 1;
    }
    // Keys set by one client can complete the requests parked by others: repeat until quiet.
    for (int progress = 1; progress;) {
      progress = 0;
      for (size_t i = 0; i < s->nconns; i++) {
        conn_t *c = s->conns[i];
        if (!c->authed && !c->dead && now >= c->deadline) c->dead = 1;  // never said HELLO
        progress |= conn_process(s, c, now);
      }
    }
    size_t k = 0;
    for (size_t i = 0; i < s->nconns; i++) {
      if (s->conns[i]->dead) conn_free(s->conns[i]);
      else s->conns[k++] = s->conns[i];
    }
    s->nconns = k;
    atomic_store(&s->num_clients, (int)k);
  }
  return NULL;
}

static void server_free(dlua_store_server_t *s) {
  for (size_t i = 0; i < s->nconns; i++) conn_free(s->conns[i]);
  free(s->conns);
  free(s->pfds);
  table_free(&s->table);
  if (s->listen_fd >= 0) close(s->listen_fd);
  if (s->wake_rd >= 0) close(s->wake_rd);
  if (s->wake_wr >= 0) close(s->wake_wr);
  free(s);
}

static dlua_status_t server_listen(dlua_store_server_t *s, const char *host, int port) {
  char port_str[16];
  snprintf(port_str, sizeof port_str, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(host, port_str, &hints, &res);
  if (gai != 0)
    return DLUA_ERR(DLUA_ERR_IO, "store server: cannot resolve host '%s': %s", host, gai_strerror(gai));
  int err = 0;
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    // A restarted job must be able to rebind while the old job's connections sit in
    // TIME_WAIT; Linux still refuses a second live listener on the port.
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    // SOMAXCONN: thousands of ranks connect at once; an overflowing backlog resets them.
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
      struct sockaddr_storage ss;
      socklen_t sl = sizeof ss;
      if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        s->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&ss)->sin_port);
        s->listen_fd = fd;
        freeaddrinfo(res);
        return DLUA_OK;
      }
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  if (err == EADDRINUSE)
    return DLUA_ERR(DLUA_ERR_IO, "store server: port %d on %s is already in use (another job's store?); "
                    "choose another MASTER_PORT, or port 0 for a free one", port, host);
  if (err == EADDRNOTAVAIL)
    return DLUA_ERR(DLUA_ERR_IO, "store server: %s is not an address of this machine", host);
  if (err == EACCES)
    return DLUA_ERR(DLUA_ERR_IO, "store server: port %d on %s needs privileges; use a port above 1023", port, host);
  return DLUA_ERR(DLUA_ERR_IO, "store server: cannot listen on %s:%d: %s", host, port, strerror(err));
}

dlua_status_t dlua_store_server_start(const char *host, int port, const char *token, dlua_store_server_t **server) {
  if (!server) return DLUA_ERR(DLUA_ERR_ARG, "store server: server must not be NULL");
  *server = NULL;
  if (!host || !*host) host = "127.0.0.1";
  if (!token) token = "";
  if (port < 0 || port > 65535)
    return DLUA_ERR(DLUA_ERR_ARG, "store server: port %d is outside 0..65535", port);
  size_t tl = strlen(token);
  if (tl > DLUA_STORE_MAX_TOKEN)
    return DLUA_ERR(DLUA_ERR_ARG, "store server: token of %zu bytes is longer than %d", tl, DLUA_STORE_MAX_TOKEN);
  if (strlen(host) >= sizeof((dlua_store_server_t *)0)->host)
    return DLUA_ERR(DLUA_ERR_ARG, "store server: host name of %zu bytes is too long", strlen(host));
  dlua_store_server_t *s = calloc(1, sizeof *s);
  if (!s) return DLUA_ERR(DLUA_ERR_OOM, "store server: out of memory allocating %zu bytes", sizeof *s);
  s->listen_fd = s->wake_rd = s->wake_wr = -1;
  strcpy(s->host, host);
  memcpy(s->token, token, tl);
  s->token_len = tl;
  dlua_status_t st = server_listen(s, host, port);
  if (st != DLUA_OK) {
    server_free(s);
    return st;
  }
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) {
    st = DLUA_ERR(DLUA_ERR_IO, "store server: cannot create its wake-up pipe: %s", strerror(errno));
    server_free(s);
    return st;
  }
  s->wake_rd = pipefd[0];
  s->wake_wr = pipefd[1];
  s->pfds_cap = 16;
  s->pfds = malloc(s->pfds_cap * sizeof *s->pfds);
  if (!s->pfds) {
    server_free(s);
    return DLUA_ERR(DLUA_ERR_OOM, "store server: out of memory allocating %zu bytes", 16 * sizeof(struct pollfd));
  }
  // The server thread takes no signals: Ctrl-C must interrupt the caller's blocking calls.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&s->thread, NULL, server_main, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    server_free(s);
    return DLUA_ERR(DLUA_ERR_IO, "store server: cannot start its thread: %s", strerror(rc));
  }
  *server = s;
  return DLUA_OK;
}

int dlua_store_server_port(const dlua_store_server_t *server) { return server ? server->port : -1; }

int dlua_store_server_num_clients(const dlua_store_server_t *server) {
  return server ? atomic_load(&((dlua_store_server_t *)server)->num_clients) : 0;
}

int64_t dlua_store_server_num_keys(const dlua_store_server_t *server) {
  return server ? (int64_t)atomic_load(&((dlua_store_server_t *)server)->num_keys) : 0;
}

void dlua_store_server_stop(dlua_store_server_t *server) {
  if (!server) return;
  char byte = 1;
  while (write(server->wake_wr, &byte, 1) < 0 && errno == EINTR) {
  }
  pthread_join(server->thread, NULL);
  server_free(server);  // closing the sockets makes every client see the end at once
}

/* ==== the client =========================================================================== */

struct dlua_store {
  pthread_mutex_t lock; /* one request at a time per handle */
  int fd;               /* -1 after a broken or abandoned request; the next call reconnects */
  int64_t timeout_ms;   /* default timeout: connect, replies, blocking ops given a negative one */
  int port;
  char host[256];
  char token[DLUA_STORE_MAX_TOKEN + 1];
};

typedef enum { IO_OK, IO_CLOSED, IO_ERROR, IO_TIMEOUT, IO_INTERRUPTED } io_result_t;

/* Waits for `events` on fd until the deadline, waking every slice to notice Ctrl-C. */
static io_result_t wait_fd(int fd, short events, int64_t deadline) {
  for (;;) {
    if (dlua_interrupt_flag) return IO_INTERRUPTED;
    int64_t left = deadline - now_ms();
    // At the deadline, still look once: what is ready (a refusal, a reply) beats "timeout".
    struct pollfd p = {.fd = fd, .events = events};
    int r = poll(&p, 1, left <= 0 ? 0 : (int)(left < STORE_POLL_SLICE_MS ? left : STORE_POLL_SLICE_MS));
    if (r > 0) return IO_OK;  // errors and hang-ups surface in the following send/recv
    if (r < 0 && errno != EINTR) return IO_ERROR;
    if (r == 0 && left <= 0) return IO_TIMEOUT;
  }
}

static io_result_t send_all(int fd, const uint8_t *p, size_t len, int64_t deadline) {
  while (len > 0) {
    ssize_t k = send(fd, p, len, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      len -= (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      io_result_t r = wait_fd(fd, POLLOUT, deadline);
      if (r != IO_OK) return r;
      continue;
    }
    return (k < 0 && (errno == EPIPE || errno == ECONNRESET)) ? IO_CLOSED : IO_ERROR;
  }
  return IO_OK;
}

static io_result_t recv_all(int fd, uint8_t *p, size_t len, int64_t deadline) {
  while (len > 0) {
    ssize_t k = recv(fd, p, len, 0);
    if (k > 0) {
      p += k;
      len -= (size_t)k;
      continue;
    }
    if (k == 0) return IO_CLOSED;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      io_result_t r = wait_fd(fd, POLLIN, deadline);
      if (r != IO_OK) return r;
      continue;
    }
    return errno == ECONNRESET ? IO_CLOSED : IO_ERROR;
  }
  return IO_OK;
}

typedef struct {
  uint8_t status;
  uint32_t n;
  blob_t *b;
  uint8_t *body; /* owns the bytes the blobs point into */
  size_t body_len;
  blob_t stack[4];
} reply_t;

static void reply_free(reply_t *r) {
  free(r->body);
  if (r->b != r->stack) free(r->b);
  memset(r, 0, sizeof *r);
}

/* Sends one request frame and reads the reply; `*why` names the failure for messages. */
static io_result_t exchange(int fd, uint8_t op, int64_t timeout, uint32_t n, const blob_t *b, int64_t deadline,
                            reply_t *r, const char **why) {
  memset(r, 0, sizeof *r);
  size_t body = DLUA_STORE_REQUEST_FIXED;
  for (uint32_t i = 0; i < n; i++) body += 4 + (size_t)b[i].len;
  *why = "out of memory";
  uint8_t *frame = malloc(4 + body);
  if (!frame) return IO_ERROR;
  put_u32(frame, (uint32_t)body);
  frame[4] = op;
  put_u64(frame + 5, (uint64_t)timeout);
  put_u32(frame + 13, n);
  uint8_t *p = frame + 4 + DLUA_STORE_REQUEST_FIXED;
  for (uint32_t i = 0; i < n; i++) {
    put_u32(p, b[i].len);
    if (b[i].len) memcpy(p + 4, b[i].p, b[i].len);
    p += 4 + b[i].len;
  }
  io_result_t res = send_all(fd, frame, 4 + body, deadline);
  free(frame);
  *why = "sending the request";
  if (res != IO_OK) return res;
  uint8_t hdr[4];
  *why = "reading the reply";
  if ((res = recv_all(fd, hdr, 4, deadline)) != IO_OK) return res;
  r->body_len = get_u32(hdr);
  *why = "the reply is not from a dlua store server";
  errno = EPROTO;
  if (r->body_len < 5 || r->body_len > DLUA_STORE_MAX_FRAME) return IO_ERROR;
  *why = "out of memory for the reply";
  r->body = malloc(r->body_len + 1);  // +1: room for the NUL that get() adds
  if (!r->body) return IO_ERROR;
  *why = "reading the reply";
  if ((res = recv_all(fd, r->body, r->body_len, deadline)) != IO_OK) return res;
  r->status = r->body[0];
  r->n = get_u32(r->body + 1);
  *why = "malformed reply from the store server";
  errno = EPROTO;
  if ((uint64_t)r->n * 4 > r->body_len - 5) return IO_ERROR;
  r->b = r->n <= 4 ? r->stack : malloc(r->n * sizeof *r->b);
  if (!r->b) return IO_ERROR;
  if (parse_blobs(r->body + 5, r->body + r->body_len, r->n, r->b) != 0) return IO_ERROR;
  *why = NULL;
  return IO_OK;
}

static const char *io_text(io_result_t r, int err) {
  switch (r) {
    case IO_CLOSED: return "the server closed the connection";
    case IO_TIMEOUT: return "no reply in time";
    case IO_INTERRUPTED: return "interrupted";
    default: return err ? strerror(err) : "I/O error";
  }
}

typedef enum { TRY_OK, TRY_RETRY, TRY_FATAL } try_t;

/* One attempt: resolve, connect, HELLO. Errors that go away when the server starts
   (refused, reset by a full backlog, unresolvable name not yet in DNS) are RETRY. */
static try_t connect_once(dlua_store_t *s, int64_t deadline, int *out_fd, char *err, size_t errcap, dlua_status_t *fatal) {
  char port_str[16];
  snprintf(port_str, sizeof port_str, "%d", s->port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(s->host, port_str, &hints, &res);
  if (gai != 0) {
    snprintf(err, errcap, "cannot resolve '%s': %s", s->host, gai_strerror(gai));
    return TRY_RETRY;
  }
  int fd = -1;
  snprintf(err, errcap, "no address for '%s'", s->host);
  for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      snprintf(err, errcap, "socket: %s", strerror(errno));
      continue;
    }
    int e = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      e = errno;
      if (e == EINPROGRESS || e == EINTR) {
        io_result_t w = wait_fd(fd, POLLOUT, deadline);
        socklen_t el = sizeof e;
        if (w == IO_OK) getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        else e = w == IO_INTERRUPTED ? EINTR : ETIMEDOUT;
      }
    }
    if (e != 0) {
      snprintf(err, errcap, "%s", strerror(e));
      close(fd);
      fd = -1;
      if (e == EINTR) break;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    if (dlua_interrupt_flag) {
      *fatal = DLUA_ERR_INTERRUPTED;
      snprintf(err, errcap, "interrupted");
      return TRY_FATAL;
    }
    return TRY_RETRY;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uint8_t version[4];
  put_u32(version, DLUA_STORE_VERSION);
  blob_t hello[3] = {{(const uint8_t *)DLUA_STORE_MAGIC, DLUA_STORE_MAGIC_LEN},
                     {version, 4},
                     {(const uint8_t *)s->token, (uint32_t)strlen(s->token)}};
  reply_t r;
  const char *why;
  io_result_t io = exchange(fd, DLUA_STORE_OP_HELLO, 0, 3, hello, deadline, &r, &why);
  try_t result = TRY_OK;
  if (io != IO_OK) {
    snprintf(err, errcap, "handshake: %s (%s)", why ? why : "", io_text(io, errno));
    result = (io == IO_CLOSED || io == IO_TIMEOUT) ? TRY_RETRY : TRY_FATAL;
    *fatal = io == IO_INTERRUPTED ? DLUA_ERR_INTERRUPTED : DLUA_ERR_IO;
  } else if (r.status == DLUA_STORE_REPLY_WRONG_TOKEN) {
    snprintf(err, errcap, "wrong job token: the server belongs to another job, or the ranks were given different tokens");
    result = TRY_FATAL;
    *fatal = DLUA_ERR_ARG;
  } else if (r.status != DLUA_STORE_REPLY_OK || r.n != 1 || r.b[0].len != DLUA_STORE_MAGIC_LEN ||
             memcmp(r.b[0].p, DLUA_STORE_MAGIC, DLUA_STORE_MAGIC_LEN) != 0) {
    if (r.status == DLUA_STORE_REPLY_BAD_REQUEST && r.n == 1)
      snprintf(err, errcap, "refused: %.*s", (int)(r.b[0].len > 200 ? 200 : r.b[0].len), (const char *)r.b[0].p);
    else
      snprintf(err, errcap, "the server is not a dlua store (unexpected handshake reply)");
    result = TRY_FATAL;
    *fatal = DLUA_ERR_IO;
  }
  reply_free(&r);
  if (result != TRY_OK) {
    close(fd);
    return result;
  }
  *out_fd = fd;
  return TRY_OK;
}

/* Sleeps up to ms, in slices so Ctrl-C is noticed; returns nonzero if interrupted. */
static int sleep_ms(int64_t ms) {
  while (ms > 0) {
    if (dlua_interrupt_flag) return 1;
    int64_t slice = ms < STORE_POLL_SLICE_MS ? ms : STORE_POLL_SLICE_MS;
    struct timespec ts = {slice / 1000, (long)(slice % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    ms -= slice;
  }
  return dlua_interrupt_flag != 0;
}

/* Connects, retrying with exponential back-off and jitter while the server is not up yet:
   ranks start in any order, and thousands retrying in lockstep would overflow its backlog. */
static dlua_status_t connect_retrying(dlua_store_t *s, const char *op, int64_t timeout_ms, int retry) {
  int64_t start = now_ms(), deadline = start + timeout_ms;
  int64_t delay = 10;
  unsigned seed = (unsigned)getpid() ^ (unsigned)start ^ (unsigned)(uintptr_t)s;
  char err[512] = "";
  int attempts = 0;
  for (;;) {
    dlua_status_t fatal = DLUA_ERR_IO;
    attempts++;
    try_t t = connect_once(s, deadline, &s->fd, err, sizeof err, &fatal);
    if (t == TRY_OK) return DLUA_OK;
    if (t == TRY_FATAL)
      return DLUA_ERR(fatal, "%s: store server at %s:%d: %s", op, s->host, s->port, err);
    int64_t left = deadline - now_ms();
    if (!retry || left <= 0) break;
    int64_t jittered = delay / 2 + (int64_t)(rand_r(&seed) % (unsigned)(delay / 2 + 1));
    if (sleep_ms(jittered < left ? jittered : left))
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted while connecting to the store server at %s:%d", op, s->host, s->port);
    delay = delay * 2 > 1000 ? 1000 : delay * 2;
  }
  if (!retry)
    return DLUA_ERR(DLUA_ERR_IO, "%s: cannot reconnect to the store server at %s:%d: %s", op, s->host, s->port, err);
  return DLUA_ERR(DLUA_ERR_TIMEOUT,
                  "%s: no store server answered at %s:%d within %" PRId64 " ms (%d attempts, last: %s); "
                  "is rank 0 (or the launcher) running, and do MASTER_ADDR/MASTER_PORT point at it?",
                  op, s->host, s->port, now_ms() - start, attempts, err);
}

dlua_status_t dlua_store_connect(const char *host, int port, const char *token, int64_t timeout_ms, dlua_store_t **store) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store connect: store must not be NULL");
  *store = NULL;
  if (!host || !*host) host = "127.0.0.1";
  if (!token) token = "";
  if (port <= 0 || port > 65535) return DLUA_ERR(DLUA_ERR_ARG, "store connect: port %d is outside 1..65535", port);
  if (timeout_ms < 0) return DLUA_ERR(DLUA_ERR_ARG, "store connect: timeout %" PRId64 " ms is negative", timeout_ms);
  if (strlen(token) > DLUA_STORE_MAX_TOKEN)
    return DLUA_ERR(DLUA_ERR_ARG, "store connect: token of %zu bytes is longer than %d", strlen(token), DLUA_STORE_MAX_TOKEN);
  dlua_store_t *s = calloc(1, sizeof *s);
  if (!s) return DLUA_ERR(DLUA_ERR_OOM, "store connect: out of memory allocating %zu bytes", sizeof *s);
  if (strlen(host) >= sizeof s->host) {
    free(s);
    return DLUA_ERR(DLUA_ERR_ARG, "store connect: host name of %zu bytes is too long", strlen(host));
  }
  strcpy(s->host, host);
  strcpy(s->token, token);
  s->port = port;
  s->fd = -1;
  s->timeout_ms = clamp_timeout(timeout_ms);
  pthread_mutex_init(&s->lock, NULL);
  dlua_status_t st = connect_retrying(s, "store connect", s->timeout_ms, 1);
  if (st != DLUA_OK) {
    pthread_mutex_destroy(&s->lock);
    free(s);
    return st;
  }
  *store = s;
  return DLUA_OK;
}

void dlua_store_close(dlua_store_t *store) {
  if (!store) return;
  if (store->fd >= 0) close(store->fd);
  pthread_mutex_destroy(&store->lock);
  free(store);
}

dlua_status_t dlua_store_set_timeout(dlua_store_t *store, int64_t timeout_ms) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store set_timeout: store must not be NULL");
  if (timeout_ms < 0) return DLUA_ERR(DLUA_ERR_ARG, "store set_timeout: timeout %" PRId64 " ms is negative", timeout_ms);
  pthread_mutex_lock(&store->lock);
  store->timeout_ms = clamp_timeout(timeout_ms);
  pthread_mutex_unlock(&store->lock);
  return DLUA_OK;
}

/* One request/reply on the handle (lock held by the caller). `wait_ms` >= 0 marks a
   blocking op: the server answers by then, so the reply is awaited a little longer. A
   failed exchange leaves the stream mid-frame, so the socket is dropped and the next call
   reconnects (once, without back-off: the server was up a moment ago). */
static dlua_status_t request(dlua_store_t *s, const char *op, uint8_t code, int64_t wait_ms, uint32_t n, const blob_t *b,
                             reply_t *r) {
  memset(r, 0, sizeof *r);
  if (s->fd < 0) DLUA_TRY(connect_retrying(s, op, s->timeout_ms, 0));
  int64_t deadline = now_ms() + (wait_ms >= 0 ? wait_ms + STORE_REPLY_GRACE_MS : s->timeout_ms);
  const char *why = NULL;
  io_result_t io = exchange(s->fd, code, wait_ms < 0 ? 0 : wait_ms, n, b, deadline, r, &why);
  int err = errno;
  if (io == IO_OK && r->status != DLUA_STORE_REPLY_BAD_REQUEST) return DLUA_OK;
  close(s->fd);
  s->fd = -1;
  dlua_status_t st;
  if (io == IO_OK)
    st = DLUA_ERR(DLUA_ERR_INTERNAL, "%s: the store server at %s:%d rejected the request: %.*s", op, s->host, s->port,
                  (int)(r->n ? (r->b[0].len > 300 ? 300 : r->b[0].len) : 0), r->n ? (const char *)r->b[0].p : "");
  else if (io == IO_INTERRUPTED)
    st = DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted while talking to the store server at %s:%d", op, s->host, s->port);
  else if (io == IO_TIMEOUT)
    st = DLUA_ERR(DLUA_ERR_TIMEOUT, "%s: the store server at %s:%d did not answer within %" PRId64 " ms (%s)", op, s->host,
                  s->port, wait_ms >= 0 ? wait_ms + STORE_REPLY_GRACE_MS : s->timeout_ms, why ? why : "");
  else
    st = DLUA_ERR(DLUA_ERR_IO, "%s: lost the store server at %s:%d while %s: %s", op, s->host, s->port, why ? why : "",
                  io_text(io, err));
  reply_free(r);
  return st;
}

/* A reply that is not OK (and not a timeout the caller formats itself). */
static dlua_status_t reply_error(dlua_store_t *s, const char *op, const reply_t *r) {
  const char *msg = r->n >= 1 ? (const char *)r->b[0].p : "(no message)";
  int len = r->n >= 1 ? (int)(r->b[0].len > 400 ? 400 : r->b[0].len) : (int)strlen(msg);
  dlua_status_t st = r->status == DLUA_STORE_REPLY_ERROR ? DLUA_ERR_ARG : DLUA_ERR_INTERNAL;
  return DLUA_ERR(st, "%s: %.*s (store %s:%d)", op, len, msg, s->host, s->port);
}

static dlua_status_t check_key(const char *op, const char *key) {
  if (!key || !*key) return DLUA_ERR(DLUA_ERR_ARG, "%s: the key must be a non-empty string", op);
  size_t len = strlen(key);
  if (len > DLUA_STORE_MAX_KEY)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: key of %zu bytes is longer than %d", op, len, DLUA_STORE_MAX_KEY);
  return DLUA_OK;
}

static blob_t key_blob(const char *key) { return (blob_t){(const uint8_t *)key, (uint32_t)strlen(key)}; }

static dlua_status_t check_value(const char *op, const char *what, const void *p, size_t len) {
  if (!p && len) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is NULL but its length is %zu", op, what, len);
  if (len > DLUA_STORE_MAX_VALUE)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s of %zu bytes is larger than the store's limit of %zu", op, what, len,
                    (size_t)DLUA_STORE_MAX_VALUE);
  return DLUA_OK;
}

dlua_status_t dlua_store_set(dlua_store_t *store, const char *key, const void *value, size_t len) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store set: store must not be NULL");
  DLUA_TRY(check_key("store set", key));
  DLUA_TRY(check_value("store set", "value", value, len));
  blob_t b[2] = {key_blob(key), {value, (uint32_t)len}};
  reply_t r;
  pthread_mutex_lock(&store->lock);
  dlua_status_t st = request(store, "store set", DLUA_STORE_OP_SET, -1, 2, b, &r);
  if (st == DLUA_OK && r.status != DLUA_STORE_REPLY_OK) st = reply_error(store, "store set", &r);
  pthread_mutex_unlock(&store->lock);
  reply_free(&r);
  return st;
}

/* "'a', 'b' and 3 more": the keys a timeout names. */
static void format_keys(char *dst, size_t cap, uint32_t n, const blob_t *b) {
  size_t len = 0;
  dst[0] = '\0';
  for (uint32_t i = 0; i < n && len + 1 < cap; i++) {
    if (i == 8) {
      snprintf(dst + len, cap - len, " and %u more", n - i);
      return;
    }
    char k[80];
    key_for_message(k, sizeof k, b[i].p, b[i].len);
    int w = snprintf(dst + len, cap - len, "%s'%s'", i ? ", " : "", k);
    if (w < 0) return;
    len += (size_t)w;
  }
}

dlua_status_t dlua_store_get(dlua_store_t *store, const char *key, int64_t timeout_ms, void **value, size_t *len) {
  if (!store || !value || !len) return DLUA_ERR(DLUA_ERR_ARG, "store get: store, value and len must not be NULL");
  *value = NULL;
  *len = 0;
  DLUA_TRY(check_key("store get", key));
  blob_t k = key_blob(key);
  reply_t r;
  pthread_mutex_lock(&store->lock);
  int64_t wait = timeout_ms < 0 ? store->timeout_ms : clamp_timeout(timeout_ms);
  dlua_status_t st = request(store, "store get", DLUA_STORE_OP_GET, wait, 1, &k, &r);
  pthread_mutex_unlock(&store->lock);
  if (st != DLUA_OK) return st;
  if (r.status == DLUA_STORE_REPLY_OK && r.n == 1) {
    // Hand out the reply buffer itself: a multi-MB value is not copied again.
    size_t n = r.b[0].len;
    uint8_t *buf = r.body;
    memmove(buf, r.b[0].p, n);
    buf[n] = '\0';  // values are often text: keep them usable as C strings
    r.body = NULL;
    reply_free(&r);
    *value = buf;
    *len = n;
    return DLUA_OK;
  }
  char kbuf[80];
  key_for_message(kbuf, sizeof kbuf, k.p, k.len);
  if (r.status == DLUA_STORE_REPLY_TIMEOUT)
    st = DLUA_ERR(DLUA_ERR_TIMEOUT, "store get: timed out after %" PRId64 " ms waiting for key '%s' (store %s:%d)", wait,
                  kbuf, store->host, store->port);
  else
    st = reply_error(store, "store get", &r);
  reply_free(&r);
  return st;
}

void dlua_store_free_value(void *value) { free(value); }

static dlua_status_t keys_blobs(const char *op, const char *const *keys, int n, blob_t **out) {
  if (n < 1 || n > DLUA_STORE_MAX_KEYS)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected 1 to %d keys, got %d", op, DLUA_STORE_MAX_KEYS, n);
  if (!keys) return DLUA_ERR(DLUA_ERR_ARG, "%s: keys must not be NULL", op);
  for (int i = 0; i < n; i++) DLUA_TRY(check_key(op, keys[i]));
  blob_t *b = malloc((size_t)n * sizeof *b);
  if (!b) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, (size_t)n * sizeof *b);
  for (int i = 0; i < n; i++) b[i] = key_blob(keys[i]);
  *out = b;
  return DLUA_OK;
}

dlua_status_t dlua_store_wait(dlua_store_t *store, const char *const *keys, int n, int64_t timeout_ms) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store wait: store must not be NULL");
  blob_t *b;
  DLUA_TRY(keys_blobs("store wait", keys, n, &b));
  reply_t r;
  pthread_mutex_lock(&store->lock);
  int64_t wait = timeout_ms < 0 ? store->timeout_ms : clamp_timeout(timeout_ms);
  dlua_status_t st = request(store, "store wait", DLUA_STORE_OP_WAIT, wait, (uint32_t)n, b, &r);
  pthread_mutex_unlock(&store->lock);
  free(b);
  if (st != DLUA_OK) return st;
  if (r.status == DLUA_STORE_REPLY_TIMEOUT) {
    char list[800];
    format_keys(list, sizeof list, r.n, r.b);
    st = DLUA_ERR(DLUA_ERR_TIMEOUT, "store wait: timed out after %" PRId64 " ms; %u of %d keys still missing: %s (store %s:%d)",
                  wait, r.n, n, list, store->host, store->port);
  } else if (r.status != DLUA_STORE_REPLY_OK) {
    st = reply_error(store, "store wait", &r);
  }
  reply_free(&r);
  return st;
}

dlua_status_t dlua_store_add(dlua_store_t *store, const char *key, int64_t delta, int64_t *value) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store add: store must not be NULL");
  DLUA_TRY(check_key("store add", key));
  uint8_t d8[8];
  put_u64(d8, (uint64_t)delta);
  blob_t b[2] = {key_blob(key), {d8, 8}};
  reply_t r;
  pthread_mutex_lock(&store->lock);
  dlua_status_t st = request(store, "store add", DLUA_STORE_OP_ADD, -1, 2, b, &r);
  pthread_mutex_unlock(&store->lock);
  if (st != DLUA_OK) return st;
  if (r.status == DLUA_STORE_REPLY_OK && r.n == 1 && r.b[0].len == 8) {
    if (value) *value = (int64_t)get_u64(r.b[0].p);
  } else {
    st = reply_error(store, "store add", &r);
  }
  reply_free(&r);
  return st;
}

dlua_status_t dlua_store_compare_set(dlua_store_t *store, const char *key, const void *expected, size_t expected_len,
                                     const void *desired, size_t desired_len, void **current, size_t *current_len) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store compare_set: store must not be NULL");
  if (current) *current = NULL;
  if (current_len) *current_len = 0;
  DLUA_TRY(check_key("store compare_set", key));
  if (expected) DLUA_TRY(check_value("store compare_set", "expected", expected, expected_len));
  DLUA_TRY(check_value("store compare_set", "desired", desired, desired_len));
  uint8_t flags = expected ? 0 : DLUA_STORE_CAS_EXPECT_ABSENT;
  blob_t b[4] = {key_blob(key), {&flags, 1}, {expected, expected ? (uint32_t)expected_len : 0}, {desired, (uint32_t)desired_len}};
  reply_t r;
  pthread_mutex_lock(&store->lock);
  dlua_status_t st = request(store, "store compare_set", DLUA_STORE_OP_COMPARE_SET, -1, 4, b, &r);
  pthread_mutex_unlock(&store->lock);
  if (st != DLUA_OK) return st;
  if (r.status != DLUA_STORE_REPLY_OK || r.n != 2 || r.b[0].len != 1) {
    st = reply_error(store, "store compare_set", &r);
  } else if (r.b[0].p[0] && current) {
    uint8_t *v = copy_value(r.b[1].p, r.b[1].len);
    if (!v) {
      st = DLUA_ERR(DLUA_ERR_OOM, "store compare_set: out of memory allocating %u bytes", r.b[1].len + 1);
    } else {
      *current = v;
      if (current_len) *current_len = r.b[1].len;
    }
  }
  reply_free(&r);
  return st;
}

dlua_status_t dlua_store_check(dlua_store_t *store, const char *const *keys, int n, int *exists) {
  if (!store || !exists) return DLUA_ERR(DLUA_ERR_ARG, "store check: store and exists must not be NULL");
  blob_t *b;
  DLUA_TRY(keys_blobs("store check", keys, n, &b));
  reply_t r;
  pthread_mutex_lock(&store->lock);
  dlua_status_t st = request(store, "store check", DLUA_STORE_OP_CHECK, -1, (uint32_t)n, b, &r);
  pthread_mutex_unlock(&store->lock);
  free(b);
  if (st != DLUA_OK) return st;
  if (r.status == DLUA_STORE_REPLY_OK && r.n == 1 && r.b[0].len == (uint32_t)n) {
    for (int i = 0; i < n; i++) exists[i] = r.b[0].p[i] != 0;
  } else {
    st = reply_error(store, "store check", &r);
  }
  reply_free(&r);
  return st;
}

dlua_status_t dlua_store_delete(dlua_store_t *store, const char *key, int *deleted) {
  if (!store) return DLUA_ERR(DLUA_ERR_ARG, "store delete: store must not be NULL");
  DLUA_TRY(check_key("store delete", key));
  blob_t k = key_blob(key);
  reply_t r;
  pthread_mutex_lock(&store->lock);
  dlua_status_t st = request(store, "store delete", DLUA_STORE_OP_DELETE, -1, 1, &k, &r);
  pthread_mutex_unlock(&store->lock);
  if (st != DLUA_OK) return st;
  if (r.status == DLUA_STORE_REPLY_OK && r.n == 1 && r.b[0].len == 1) {
    if (deleted) *deleted = r.b[0].p[0] != 0;
  } else {
    st = reply_error(store, "store delete", &r);
  }
  reply_free(&r);
  return st;
}

/* The rendezvous store's server: one poll() thread serving every client's requests from the table. */
#define _GNU_SOURCE /* accept4, pipe2, POLLRDHUP */
#include "comm/store_server.h"

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
#include <unistd.h>

#include "comm/store_table.h"
#include "comm/store_wire.h"
#include "core/error.h"
#include "core/runtime.h"

#ifndef POLLRDHUP
#define POLLRDHUP 0
#endif

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
  dlua_store_table_t table;
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
static int parse_counter(const dlua_store_entry_t *e, int64_t *v) {
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
  for (uint32_t i = 0; i < n; i++) missing += dlua_store_table_find(&s->table, &b[i]) == NULL;
  if (missing == 0) {
    if (op == DLUA_STORE_OP_GET) {
      dlua_store_entry_t *e = dlua_store_table_find(&s->table, &b[0]);
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
      if (!dlua_store_table_find(&s->table, &b[i])) miss[k++] = b[i];
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
      if (dlua_store_table_put(&s->table, &b[0], b[1].p, b[1].len, &created) != 0) {
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
      dlua_store_entry_t *e = dlua_store_table_find(&s->table, &b[0]);
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
      if (dlua_store_table_put(&s->table, &b[0], (const uint8_t *)text, (size_t)tl, &created) != 0) {
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
      dlua_store_entry_t *e = dlua_store_table_find(&s->table, &b[0]);
      int swap = e ? (!expect_absent && e->value_len == b[2].len && memcmp(e->value, b[2].p, b[2].len) == 0)
                   : expect_absent;
      if (swap) {
        if (dlua_store_table_put(&s->table, &b[0], b[3].p, b[3].len, &created) != 0) {
          reply_text(c, DLUA_STORE_REPLY_ERROR, "store server out of memory storing %u bytes", b[3].len);
          break;
        }
        if (created) key_created(s);
        e = dlua_store_table_find(&s->table, &b[0]);
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
      for (uint32_t i = 0; i < n; i++) flags[i] = dlua_store_table_find(&s->table, &b[i]) != NULL;
      blob_t r = {flags, n};
      reply(c, DLUA_STORE_REPLY_OK, 1, &r);
      free(flags);
      break;
    }
    case DLUA_STORE_OP_DELETE: {
      if (n != 1 || !valid_keys(1, b)) goto bad_args;
      uint8_t deleted = (uint8_t)dlua_store_table_delete(&s->table, &b[0]);
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
  dlua_thread_name("dlua-store");
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
  dlua_store_table_free(&s->table);
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
  // The server thread takes no asynchronous signal: Ctrl-C must interrupt the caller's blocking calls.
  sigset_t all, old;
  dlua_async_signals(&all);
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

/* The rendezvous store's blocking client: one connection per handle, reconnecting and retrying as ranks start. */
#define _GNU_SOURCE
#include "comm/store_client.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "comm/store_wire.h"
#include "core/error.h"
#include "core/runtime.h"

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

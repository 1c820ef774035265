/* The rendezvous store's wire protocol and limits, shared by its server, its client and their tests. */
#ifndef DLUA_COMM_STORE_H
#define DLUA_COMM_STORE_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* Wire format (all integers little-endian):
     frame   = u32 body_len, body
     request = u8 op, i64 timeout_ms, u32 nblobs, nblobs x (u32 len, len bytes)
     reply   = u8 status, u32 nblobs, nblobs x (u32 len, len bytes)
   The first request on a connection must be HELLO {magic, u32 version, token}; anything
   else, or a wrong token, is answered with WRONG_TOKEN / BAD_REQUEST and the connection
   is closed. A reply's blobs per op:
     SET {key, value}                       -> {}
     GET {key}                              -> {value}        | TIMEOUT {key}
     WAIT {key...}                          -> {}             | TIMEOUT {missing key...}
     ADD {key, i64 delta}                   -> {i64 new value} | ERROR {message}
     COMPARE_SET {key, u8 flags, expected, desired} -> {u8 present, current value}
     CHECK {key...}                         -> {one byte 0/1 per key}
     DELETE {key}                           -> {u8 deleted}
   Counters written by ADD are stored as decimal text, so GET of a counter reads "8000". */
enum {
  DLUA_STORE_OP_HELLO = 1,
  DLUA_STORE_OP_SET = 2,
  DLUA_STORE_OP_GET = 3,
  DLUA_STORE_OP_WAIT = 4,
  DLUA_STORE_OP_ADD = 5,
  DLUA_STORE_OP_COMPARE_SET = 6,
  DLUA_STORE_OP_CHECK = 7,
  DLUA_STORE_OP_DELETE = 8,
  DLUA_STORE_OP_COUNT = 9
};

enum {
  DLUA_STORE_REPLY_OK = 0,
  DLUA_STORE_REPLY_TIMEOUT = 1,     /* blobs: the keys still missing */
  DLUA_STORE_REPLY_ERROR = 2,       /* blobs: a message; the connection stays usable */
  DLUA_STORE_REPLY_WRONG_TOKEN = 3, /* then the server closes the connection */
  DLUA_STORE_REPLY_BAD_REQUEST = 4  /* malformed frame or bad version; then closed */
};

/* COMPARE_SET flag: `expected` is "the key does not exist" rather than a byte string. */
enum { DLUA_STORE_CAS_EXPECT_ABSENT = 1 };

#define DLUA_STORE_MAGIC "dlua-store"
enum {
  DLUA_STORE_MAGIC_LEN = 10,
  DLUA_STORE_VERSION = 1,
  DLUA_STORE_HEADER_BYTES = 4,              /* the u32 frame length */
  DLUA_STORE_REQUEST_FIXED = 1 + 8 + 4,     /* op, timeout, nblobs */
  DLUA_STORE_MAX_KEY = 4096,                /* bytes */
  DLUA_STORE_MAX_TOKEN = 1024,              /* bytes */
  DLUA_STORE_MAX_KEYS = 65536,              /* keys in one WAIT or CHECK */
  /* Before the token is checked a frame may be at most this long, so a stray connection
     (a port scanner, an HTTP client) cannot make the server allocate much. */
  DLUA_STORE_MAX_HELLO_FRAME = 4096,
  DLUA_STORE_HANDSHAKE_MS = 10000           /* a connection must say HELLO within this */
};
#define DLUA_STORE_MAX_VALUE ((size_t)256 << 20)
#define DLUA_STORE_MAX_FRAME (DLUA_STORE_MAX_VALUE + ((size_t)1 << 20))

#endif

/* The store's frame codec, shared by its server (store_server.c) and client (store_client.c): integers
   little-endian, length-prefixed blobs, clamped timeouts, keys printed in messages. */
#ifndef DLUA_COMM_STORE_WIRE_H
#define DLUA_COMM_STORE_WIRE_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/store.h"

/* Longest timeout honoured; larger ones are clamped so deadlines never overflow. */
#define STORE_MAX_TIMEOUT_MS ((int64_t)30 * 24 * 3600 * 1000)

static inline int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline int64_t clamp_timeout(int64_t ms) {
  if (ms < 0) return 0;
  return ms > STORE_MAX_TIMEOUT_MS ? STORE_MAX_TIMEOUT_MS : ms;
}

static inline void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

typedef struct {
  const uint8_t *p;
  uint32_t len;
} blob_t;

/* Splits `n` length-prefixed blobs out of [p, end); -1 if the lengths do not add up. */
static inline int parse_blobs(const uint8_t *p, const uint8_t *end, uint32_t n, blob_t *out) {
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
static inline void key_for_message(char *dst, size_t cap, const uint8_t *key, size_t len) {
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

/* A malloc'ed copy of a value with a NUL after it, so counters parse as text; NULL when out of memory. */
static inline uint8_t *copy_value(const uint8_t *p, size_t len) {
  uint8_t *v = malloc(len + 1);
  if (!v) return NULL;
  if (len) memcpy(v, p, len);
  v[len] = '\0';
  return v;
}

#endif

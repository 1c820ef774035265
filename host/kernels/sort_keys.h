/* The order-preserving integer keys that sort and top-k compare, shared by host/cpu/sort.c and host/cuda/sort.cu. */
#ifndef DLUA_KERNELS_SORT_KEYS_H
#define DLUA_KERNELS_SORT_KEYS_H
#include <stdint.h>

#ifndef DLUA_HD
#ifdef __CUDACC__
#define DLUA_HD __host__ __device__
#else
#define DLUA_HD
#endif
#endif

/* Every element maps to an unsigned key whose integer order is the order we sort by: larger
   value (or |value|) = larger key. All NaNs map to the largest key, so they sort as the
   largest value and tie with one another; -0 and +0 map to one key, so they tie too (ties
   keep index order). Descending order and "smallest k" flip the key's bits. Each function
   takes the element's bits: v = by value, m = by magnitude. */

static inline DLUA_HD uint64_t dlua_sortkey_f32v(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;
  if (!(u & 0x7fffffffu)) u = 0;
  return (u & 0x80000000u) ? (uint32_t)~u : (u | 0x80000000u);
}
static inline DLUA_HD uint64_t dlua_sortkey_f32m(uint32_t u) {
  u &= 0x7fffffffu;
  return u > 0x7f800000u ? 0xffffffffu : u;
}
static inline DLUA_HD uint64_t dlua_sortkey_f64v(uint64_t u) {
  if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return ~0ull;
  if (!(u & 0x7fffffffffffffffull)) u = 0;
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
static inline DLUA_HD uint64_t dlua_sortkey_f64m(uint64_t u) {
  u &= 0x7fffffffffffffffull;
  return u > 0x7ff0000000000000ull ? ~0ull : u;
}
/* f16 (inf = 0x7c00) and bf16 (inf = 0x7f80). */
static inline DLUA_HD uint64_t dlua_sortkey_half(uint16_t h, uint16_t inf, int magnitude) {
  uint16_t m = h & 0x7fffu;
  if (m > inf) return 0xffffu;  // NaN
  if (magnitude) return m;
  if (!m) return 0x8000u;
  return (h & 0x8000u) ? (uint16_t)~h : (uint16_t)(h | 0x8000u);
}
static inline DLUA_HD uint64_t dlua_sortkey_i32v(uint32_t u) { return u ^ 0x80000000u; }
static inline DLUA_HD uint64_t dlua_sortkey_i32m(int32_t v) { return v < 0 ? 0u - (uint32_t)v : (uint32_t)v; }
static inline DLUA_HD uint64_t dlua_sortkey_i64v(uint64_t u) { return u ^ 0x8000000000000000ull; }
static inline DLUA_HD uint64_t dlua_sortkey_i64m(int64_t v) { return v < 0 ? 0ull - (uint64_t)v : (uint64_t)v; }

#endif

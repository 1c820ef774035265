/* Philox-4x32-10 as an inline function, so CPU fills and a CUDA build share one definition. */
#ifndef DLUA_CORE_RANDOM_H
#define DLUA_CORE_RANDOM_H
#include <stdint.h>
#include "core/api.h"

/* Random123's round multipliers and the Weyl increments of the key schedule. */
#define DLUA_PHILOX_M0 0xD2511F53u
#define DLUA_PHILOX_M1 0xCD9E8D57u
#define DLUA_PHILOX_W0 0x9E3779B9u
#define DLUA_PHILOX_W1 0xBB67AE85u

/* How fills use it: the key is (seed low 32 bits, seed high 32 bits); element i of a fill
   that starts at generator offset o reads lane i % 4 of the block at counter
   {lo32(o + i/4), hi32(o + i/4), d, 0}, where d = 0 for the first draw and d = 1, 2, ...
   for the redraws that unbiased integer sampling needs (rare), so every element's value
   is a function of (seed, o, i) alone, whatever the thread count or backend. */

static inline void dlua_philox_block(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; r++) {
    if (r > 0) {  // the key is bumped between rounds, not before the first
      k0 += DLUA_PHILOX_W0;
      k1 += DLUA_PHILOX_W1;
    }
    uint64_t p0 = (uint64_t)DLUA_PHILOX_M0 * c0;
    uint64_t p1 = (uint64_t)DLUA_PHILOX_M1 * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

#endif

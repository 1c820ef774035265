/* Philox-4x32-10 and the per-element draws of the random fills, as inline functions that nvcc also compiles for
   the device, so CPU fills (host/cpu/random.c) and CUDA fills (host/cuda/random.cu) produce the same bits. */
#ifndef DLUA_KERNELS_PHILOX_H
#define DLUA_KERNELS_PHILOX_H
#include <stdint.h>
#include <string.h>
#include "core/api.h"

#ifdef __CUDACC__
#define DLUA_RNG_HD __host__ __device__
#else
#define DLUA_RNG_HD
#endif

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

static inline DLUA_RNG_HD void dlua_philox_block(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
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

/* ---- the draws of one fill ---------------------------------------------------------------------- */

/* One fill's stream: the key from the generator's seed, base = its offset when the fill began. */
typedef struct {
  uint32_t key[2];
  uint64_t base;
} dlua_rng_stream_t;

static inline DLUA_RNG_HD void dlua_rng_block(const dlua_rng_stream_t *s, uint64_t block, uint32_t draw, uint32_t out[4]) {
  uint64_t c = s->base + block;
  uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), draw, 0};
  dlua_philox_block(ctr, s->key, out);
}

/* Element i's word for redraw d >= 1 (d = 0 is the word of the main block). */
static inline DLUA_RNG_HD uint32_t dlua_rng_word(const dlua_rng_stream_t *s, int64_t i, uint32_t draw) {
  uint32_t out[4];
  dlua_rng_block(s, (uint64_t)i / 4, draw, out);
  return out[i % 4];
}

/* Unbiased integer in [0, range) for element i whose first 32-bit word is `first`. Words
   below 2^32 mod range (or 2^64 mod range) are rejected and redrawn from the next counter
   word d, so the accepted values are exactly uniform. A range above 2^32 builds each
   candidate from two words: (first or word 2d-1) and word 2d. */
static inline DLUA_RNG_HD uint64_t dlua_rng_bounded(const dlua_rng_stream_t *s, int64_t i, uint32_t first,
                                                    uint64_t range) {
  if (range <= 0x100000000ull) {
    uint64_t reject_below = (0x100000000ull - range) % range;
    uint32_t x = first;
    for (uint32_t d = 1; x < reject_below; d++) x = dlua_rng_word(s, i, d);
    return x % range;
  }
  uint64_t reject_below = (0 - range) % range;
  uint64_t x = ((uint64_t)first << 32) | dlua_rng_word(s, i, 1);
  for (uint32_t d = 2; x < reject_below; d += 2)
    x = ((uint64_t)dlua_rng_word(s, i, d) << 32) | dlua_rng_word(s, i, d + 1);
  return x % range;
}

/* ---- bit-reproducible double arithmetic ---------------------------------------------------------
   A float value is identical on both backends only if every operation rounds once, in the same order:
   so no libm (CUDA's log/sin/cos differ from glibc's in the last bit) and no fused multiply-adds (nvcc
   fuses a * b + c by default, and GCC does where the target has FMA). Products go through the device's
   round-to-nearest intrinsics, or on the host through an empty asm that the compiler cannot fuse across. */

static inline DLUA_RNG_HD double dlua_rng_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  double p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(p));
#endif
  return p;
#endif
}

static inline DLUA_RNG_HD double dlua_rng_add(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

static inline DLUA_RNG_HD double dlua_rng_div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

static inline DLUA_RNG_HD double dlua_rng_sqrt(double a) {
#ifdef __CUDA_ARCH__
  return __dsqrt_rn(a);
#else
  return __builtin_sqrt(a);  // IEEE sqrt: correctly rounded everywhere
#endif
}

/* p(z) = c[0] z^(n-1) + ... + c[n-1], Horner's rule with separately rounded steps. */
static inline DLUA_RNG_HD double dlua_rng_horner(const double *c, int n, double z) {
  double p = c[0];
  for (int k = 1; k < n; k++) p = dlua_rng_add(dlua_rng_mul(p, z), c[k]);
  return p;
}

/* Natural log of a positive normal double: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then
   log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^23 (a few ulps). */
static inline DLUA_RNG_HD double dlua_rng_log(double x) {
  const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
  const double inv_odd[12] = {0.043478260869565216, 0.047619047619047616, 0.052631578947368418, 0.058823529411764705,
                              0.066666666666666666, 0.076923076923076927, 0.090909090909090912, 0.1111111111111111,
                              0.14285714285714285,  0.20000000000000001,  0.33333333333333331,  1.0};
  uint64_t bits;
#ifdef __CUDA_ARCH__
  bits = (uint64_t)__double_as_longlong(x);
#else
  memcpy(&bits, &x, sizeof bits);
#endif
  int e = (int)((bits >> 52) & 0x7ff) - 1023;
  uint64_t mb = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
  double m;
#ifdef __CUDA_ARCH__
  m = __longlong_as_double((long long)mb);
#else
  memcpy(&m, &mb, sizeof m);
#endif
  if (m > 1.4142135623730951) {  // exact halving keeps m near 1
    m = dlua_rng_mul(m, 0.5);
    e++;
  }
  double f = dlua_rng_add(m, -1.0);  // exact (Sterbenz)
  double s = dlua_rng_div(f, dlua_rng_add(2.0, f));
  double logm = dlua_rng_mul(dlua_rng_mul(2.0, s), dlua_rng_horner(inv_odd, 12, dlua_rng_mul(s, s)));
  double de = (double)e;
  return dlua_rng_add(dlua_rng_mul(de, LN2_HI), dlua_rng_add(dlua_rng_mul(de, LN2_LO), logm));
}

/* cos and sin of the angle 2 pi t, t in [0, 1): the quadrant is cut off exactly on t, then
   Taylor series on [-pi/4, pi/4] (to x^19 and x^18). */
static inline DLUA_RNG_HD void dlua_rng_cossin_turn(double t, double *c, double *s) {
  const double sin_c[10] = {-8.2206352466243295e-18, 2.8114572543455206e-15, -7.6471637318198164e-13,
                            1.6059043836821613e-10,  -2.505210838544172e-08, 2.7557319223985893e-06,
                            -0.00019841269841269841, 0.0083333333333333332,  -0.16666666666666666,
                            1.0};
  const double cos_c[10] = {-1.5619206968586225e-16, 4.7794773323873853e-14, -1.1470745597729725e-11,
                            2.08767569878681e-09,    -2.7557319223985888e-07, 2.4801587301587302e-05,
                            -0.0013888888888888889,  0.041666666666666664,   -0.5,
                            1.0};
  double q4 = dlua_rng_mul(t, 4.0);  // exact
  int q = (int)q4;                   // t >= 0: truncation is floor
  double f = dlua_rng_add(q4, -(double)q);
  if (f > 0.5) {
    f = dlua_rng_add(f, -1.0);
    q++;
  }
  double x = dlua_rng_mul(f, 1.5707963267948966), x2 = dlua_rng_mul(x, x);
  double sx = dlua_rng_mul(x, dlua_rng_horner(sin_c, 10, x2)), cx = dlua_rng_horner(cos_c, 10, x2);
  switch (q & 3) {
    case 0: *c = cx, *s = sx; break;
    case 1: *c = -sx, *s = cx; break;
    case 2: *c = -cx, *s = -sx; break;
    default: *c = sx, *s = -cx; break;
  }
}

/* uniform_ of one word: 24 random bits for float32 and narrower (they fill a float mantissa
   exactly, so u < 1 survives the cast), 32 for float64 (`wide`). */
static inline DLUA_RNG_HD double dlua_rng_uniform(uint32_t w, int wide, double low, double high) {
  double u = wide ? w / 4294967296.0 : (w >> 8) / 16777216.0;  // exact
  return dlua_rng_add(low, dlua_rng_mul(dlua_rng_add(high, -low), u));
}

/* normal_ of one block: Box-Muller on lanes (0, 1) and (2, 3), lane 0/2 takes the cosine,
   lane 1/3 the sine. (w + 1) / 2^32 lies in (0, 1], so the log never sees 0. */
static inline DLUA_RNG_HD void dlua_rng_normal4(const uint32_t w[4], double mean, double std, double out[4]) {
  for (int p = 0; p < 4; p += 2) {
    double r = dlua_rng_sqrt(dlua_rng_mul(-2.0, dlua_rng_log(((double)w[p] + 1.0) / 4294967296.0)));
    double c, s;
    dlua_rng_cossin_turn(w[p + 1] / 4294967296.0, &c, &s);
    out[p] = dlua_rng_add(mean, dlua_rng_mul(std, dlua_rng_mul(r, c)));
    out[p + 1] = dlua_rng_add(mean, dlua_rng_mul(std, dlua_rng_mul(r, s)));
  }
}

/* bernoulli_: 1 with probability p. */
static inline DLUA_RNG_HD double dlua_rng_bernoulli(uint32_t w, double p) { return (w / 4294967296.0) < p ? 1.0 : 0.0; }

#endif

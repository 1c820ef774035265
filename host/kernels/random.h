/* The random family's descriptors and slots (ops/backend.h): Philox fills (host/ops/random.c fills them,
   host/cpu/random.c and host/cuda/random.cu run them, both by the per-element rules of kernels/philox.h, so
   a fill gives the same bits on every backend for the same generator state). */
#ifndef DLUA_KERNELS_RANDOM_H
#define DLUA_KERNELS_RANDOM_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DLUA_RANDOM_UNIFORM, DLUA_RANDOM_NORMAL, DLUA_RANDOM_RANDINT, DLUA_RANDOM_BERNOULLI };

/* Element i of contiguous dst (n elements of dtype, on device) = the fill's value i, converted as dlua_convert
   does. */
typedef struct {
  int kind;
  double a, b;        /* uniform: low, high; normal: mean, std; bernoulli: p */
  int64_t low;        /* randint */
  uint64_t range;     /* randint: high - low */
  int wide;           /* uniform: 32 random bits (float64) instead of 24 */
  uint32_t key[2];    /* the generator's seed */
  uint64_t base;      /* its offset (in 4-element blocks) reserved for this fill */
  int dtype;
  void *dst;
  int64_t n;
  int device;
} dlua_random_fill_t;

/* perm (n host int64, holding first, first + 1, ...) shuffled by Fisher-Yates from the back: step k swaps
   position n-1-k with a uniform position in [0, n-1-k], drawn as element k of the stream (key, base). */
typedef struct {
  uint32_t key[2];
  uint64_t base;
  int64_t *perm;
  int64_t n;
} dlua_random_perm_t;

struct dlua_random_ops {
  dlua_status_t (*fill)(const char *op, const dlua_random_fill_t *d);
  dlua_status_t (*randperm)(const char *op, const dlua_random_perm_t *d);
};

extern const struct dlua_random_ops dlua_cpu_random_ops, dlua_cuda_random_ops;

#ifdef __cplusplus
}
#endif
#endif

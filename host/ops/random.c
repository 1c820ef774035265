/* Counter-based random numbers: generators (seed, offset) and the front doors of the uniform/normal/randint/
   bernoulli/randperm fills, which run through the backend's random family (kernels/random.h). */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/philox.h"
#include "kernels/random.h"
#include "ops/backend.h"
#include "ops/common.h"

struct dlua_generator {
  uint64_t seed;
  uint64_t offset; /* counter blocks consumed so far; atomic: fills on several threads reserve ranges */
};

/* PyTorch's default seed, so an unseeded run is as reproducible there as here. */
static dlua_generator_t default_generator = {67280421310721ull, 0};

dlua_status_t dlua_generator_new(dlua_generator_t **out, uint64_t seed) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "generator_new: out is NULL");
  *out = malloc(sizeof **out);
  if (!*out) return DLUA_ERR(DLUA_ERR_OOM, "generator_new: out of memory allocating %zu bytes", sizeof **out);
  (*out)->seed = seed;
  (*out)->offset = 0;
  return DLUA_OK;
}

void dlua_generator_free(dlua_generator_t *g) {
  if (g && g != &default_generator) free(g);
}

dlua_generator_t *dlua_generator_default(void) { return &default_generator; }

void dlua_generator_manual_seed(dlua_generator_t *g, uint64_t seed) {
  if (!g) g = &default_generator;
  __atomic_store_n(&g->seed, seed, __ATOMIC_RELAXED);
  __atomic_store_n(&g->offset, 0, __ATOMIC_RELAXED);
}

uint64_t dlua_generator_seed(const dlua_generator_t *g) {
  return __atomic_load_n(&(g ? g : &default_generator)->seed, __ATOMIC_RELAXED);
}

uint64_t dlua_generator_offset(const dlua_generator_t *g) {
  return __atomic_load_n(&(g ? g : &default_generator)->offset, __ATOMIC_RELAXED);
}

void dlua_generator_set_offset(dlua_generator_t *g, uint64_t offset) {
  __atomic_store_n(&(g ? g : &default_generator)->offset, offset, __ATOMIC_RELAXED);
}

void dlua_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  dlua_philox_block(counter, key, out);
}

/* ---- draws (the per-element rules live in kernels/philox.h, shared by both backends) ---------------- */

typedef dlua_rng_stream_t stream_t;

static stream_t stream_reserve(dlua_generator_t *g, int64_t numel) {
  if (!g) g = &default_generator;
  stream_t s;
  uint64_t seed = __atomic_load_n(&g->seed, __ATOMIC_RELAXED);
  s.key[0] = (uint32_t)seed;
  s.key[1] = (uint32_t)(seed >> 32);
  s.base = __atomic_fetch_add(&g->offset, (uint64_t)((numel + 3) / 4), __ATOMIC_RELAXED);
  return s;
}

/* ---- fills -------------------------------------------------------------------------------------- */

static dlua_status_t run_fill(const char *op, dlua_tensor_t *t, dlua_generator_t *g, dlua_random_fill_t *f) {
  const struct dlua_random_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, t->device, random, fill, &k));
  int64_t n = dlua_tensor_numel(t);
  dlua_tensor_t *target = t;
  // Element i is the i-th in row-major order of t; a non-contiguous t is filled through a
  // contiguous buffer so that order is kept.
  if (!dlua_tensor_is_contiguous(t)) {
    target = NULL;
    DLUA_TRY(dlua_tensor_empty(&target, t->ndim, t->sizes, t->dtype, t->device));
  }
  stream_t s = stream_reserve(g, n);
  f->wide = t->dtype == DLUA_DTYPE_F64;
  f->key[0] = s.key[0];
  f->key[1] = s.key[1];
  f->base = s.base;
  f->dtype = (int)t->dtype;
  f->dst = dlua_tensor_ptr(target);
  f->n = n;
  f->device = t->device;
  dlua_status_t st = k->fill(op, f);
  if (target != t) {
    if (st == DLUA_OK) st = dlua_tensor_copy_(t, target);
    dlua_tensor_free(target);
  }
  return st;
}

/* A fill's tensor: a live one (whether its device runs fills is the backend table's answer). */
static dlua_status_t check_target(const char *op, const dlua_tensor_t *t) { return dlua_ops_check_input(op, t, NULL); }

static dlua_status_t require_floating(const char *op, const dlua_tensor_t *t) {
  if (!dlua_dtype_is_floating(t->dtype)) {
    char b[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a floating-point tensor, got %s", op, dlua_tensor_describe(t, b, sizeof b));
  }
  return DLUA_OK;
}

dlua_status_t dlua_tensor_uniform_(dlua_tensor_t *t, double low, double high, dlua_generator_t *g) {
  DLUA_TRY(check_target("uniform_", t));
  DLUA_TRY(require_floating("uniform_", t));
  if (!isfinite(low) || !isfinite(high) || low > high)
    return DLUA_ERR(DLUA_ERR_ARG, "uniform_: expected finite low <= high, got [%g, %g)", low, high);
  dlua_random_fill_t f = {.kind = DLUA_RANDOM_UNIFORM, .a = low, .b = high};
  return run_fill("uniform_", t, g, &f);
}

dlua_status_t dlua_tensor_normal_(dlua_tensor_t *t, double mean, double std, dlua_generator_t *g) {
  DLUA_TRY(check_target("normal_", t));
  DLUA_TRY(require_floating("normal_", t));
  if (!isfinite(mean) || !isfinite(std) || std < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "normal_: expected a finite mean and std >= 0, got mean %g, std %g", mean, std);
  dlua_random_fill_t f = {.kind = DLUA_RANDOM_NORMAL, .a = mean, .b = std};
  return run_fill("normal_", t, g, &f);
}

/* The integers a dtype holds exactly, for randint_ and randperm range checks. */
static void exact_int_range(dlua_dtype_t d, int64_t *lo, int64_t *hi) {
  switch (d) {
    case DLUA_DTYPE_BOOL: *lo = 0, *hi = 1; break;
    case DLUA_DTYPE_U8: *lo = 0, *hi = 255; break;
    case DLUA_DTYPE_I32: *lo = INT32_MIN, *hi = INT32_MAX; break;
    case DLUA_DTYPE_F16: *lo = -2048, *hi = 2048; break;
    case DLUA_DTYPE_BF16: *lo = -256, *hi = 256; break;
    case DLUA_DTYPE_F32: *lo = -(1ll << 24), *hi = 1ll << 24; break;
    case DLUA_DTYPE_F64: *lo = -(1ll << 53), *hi = 1ll << 53; break;
    default: *lo = INT64_MIN, *hi = INT64_MAX; break;
  }
}

dlua_status_t dlua_tensor_randint_(dlua_tensor_t *t, int64_t low, int64_t high, dlua_generator_t *g) {
  DLUA_TRY(check_target("randint_", t));
  char b[200];
  if (high <= low)
    return DLUA_ERR(DLUA_ERR_ARG, "randint_: expected low < high, got [%" PRId64 ", %" PRId64 ")", low, high);
  int64_t lo, hi;
  exact_int_range(t->dtype, &lo, &hi);
  if (low < lo || high - 1 > hi)
    return DLUA_ERR(DLUA_ERR_ARG, "randint_: [%" PRId64 ", %" PRId64 ") does not fit %s exactly (%s)", low, high,
                    dlua_dtype_name(t->dtype), dlua_tensor_describe(t, b, sizeof b));
  dlua_random_fill_t f = {.kind = DLUA_RANDOM_RANDINT, .low = low, .range = (uint64_t)high - (uint64_t)low};
  return run_fill("randint_", t, g, &f);
}

dlua_status_t dlua_tensor_bernoulli_(dlua_tensor_t *t, double p, dlua_generator_t *g) {
  DLUA_TRY(check_target("bernoulli_", t));
  if (!(p >= 0 && p <= 1)) return DLUA_ERR(DLUA_ERR_ARG, "bernoulli_: p must be in [0, 1], got %g", p);
  dlua_random_fill_t f = {.kind = DLUA_RANDOM_BERNOULLI, .a = p};
  return run_fill("bernoulli_", t, g, &f);
}

/* A permutation on the CPU, shuffled there (kernels/random.h's randperm: sequential, but each draw is still a
   function of (seed, offset, k), so any backend reproduces it). */
dlua_status_t dlua_tensor_randperm(dlua_tensor_t **out, int64_t n, int64_t base, dlua_dtype_t dtype,
                                   dlua_generator_t *g) {
  const char *op = "randperm";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "randperm: out is NULL");
  *out = NULL;
  if (n < 0) return DLUA_ERR(DLUA_ERR_ARG, "randperm: n must be non-negative, got %" PRId64, n);
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "randperm: invalid dtype %d", (int)dtype);
  int64_t lo, hi;
  exact_int_range(dtype, &lo, &hi);
  if (n > 0 && (base < lo || base > hi || n - 1 > hi - base))
    return DLUA_ERR(DLUA_ERR_ARG, "randperm: %" PRId64 "..%" PRId64 " cannot be held exactly by %s", base,
                    base + (n - 1), dlua_dtype_name(dtype));
  const struct dlua_random_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, DLUA_CPU, random, randperm, &k));
  DLUA_TRY(dlua_tensor_empty(out, 1, &n, dtype, DLUA_CPU));
  int64_t *perm = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  if (!perm) {
    dlua_tensor_free(*out);
    *out = NULL;
    return DLUA_ERR(DLUA_ERR_OOM, "randperm: out of memory allocating %zu bytes", (size_t)n * sizeof(int64_t));
  }
  for (int64_t i = 0; i < n; i++) perm[i] = base + i;
  stream_t s = stream_reserve(g, n);
  dlua_random_perm_t d = {.key = {s.key[0], s.key[1]}, .base = s.base, .perm = perm, .n = n};
  dlua_status_t st = k->randperm(op, &d);
  if (st == DLUA_OK) dlua_convert(dlua_tensor_ptr(*out), dtype, perm, DLUA_DTYPE_I64, n);
  free(perm);
  if (st != DLUA_OK) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return st;
}

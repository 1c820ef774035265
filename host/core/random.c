/* Counter-based random numbers: generators (seed, offset) and the uniform/normal/randint/bernoulli/randperm fills. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/copy.h"
#include "core/error.h"
#include "core/random.h"
#include "core/tensor.h"
#include "cuda/loss_cuda.h" /* plain C: only CUDA builds call into it */

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

/* ---- draws (the per-element rules live in core/random.h, shared with host/cuda/random.cu) ---------- */

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

/* Numbered as host/cuda/random.cu's fills. */
typedef enum {
  FILL_UNIFORM = DLUA_CUDA_FILL_UNIFORM,
  FILL_NORMAL = DLUA_CUDA_FILL_NORMAL,
  FILL_RANDINT = DLUA_CUDA_FILL_RANDINT,
  FILL_BERNOULLI = DLUA_CUDA_FILL_BERNOULLI
} fill_kind_t;

typedef struct {
  fill_kind_t kind;
  double a, b;          /* uniform: low, high; normal: mean, std; bernoulli: p */
  int64_t low;          /* randint */
  uint64_t range;       /* randint: high - low */
  int wide;             /* uniform: 32 random bits (float64) instead of 24 */
} fill_spec_t;

enum { FILL_CHUNK = 2048 };  // elements per work item; a multiple of 4 so blocks never straddle

/* Elements [lo, lo + n) of the fill, lo a multiple of 4, into buf as f64 or i64. */
static void fill_chunk(const fill_spec_t *f, const stream_t *s, int64_t lo, int64_t n, double *dbuf, int64_t *ibuf) {
  for (int64_t j = 0; j < n; j += 4) {
    uint32_t w[4];
    dlua_rng_block(s, (uint64_t)(lo + j) / 4, 0, w);
    int64_t m = n - j < 4 ? n - j : 4;
    switch (f->kind) {
      case FILL_UNIFORM:
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = dlua_rng_uniform(w[k], f->wide, f->a, f->b);
        break;
      case FILL_NORMAL: {
        double z[4];
        dlua_rng_normal4(w, f->a, f->b, z);
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = z[k];
        break;
      }
      case FILL_RANDINT:
        for (int64_t k = 0; k < m; k++) ibuf[j + k] = f->low + (int64_t)dlua_rng_bounded(s, lo + j + k, w[k], f->range);
        break;
      case FILL_BERNOULLI:
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = dlua_rng_bernoulli(w[k], f->a);
        break;
    }
  }
}

/* The same fill on CUDA: one thread per 4-element block of the stream (host/cuda/random.cu). */
static dlua_status_t cuda_fill(const char *op, const fill_spec_t *f, const stream_t *s, dlua_tensor_t *target,
                               int64_t n) {
#ifdef DLUA_HAVE_CUDA
  dlua_cuda_fill_t cf = {.kind = (int)f->kind, .a = f->a, .b = f->b, .low = f->low, .range = f->range,
                         .wide = f->wide, .key = {s->key[0], s->key[1]}, .base = s->base};
  return dlua_cuda_random_fill(op, &cf, (int)target->dtype, dlua_tensor_ptr(target), n, target->device);
#else
  (void)f, (void)s, (void)n;
  return dlua_require_cpu(op, target);
#endif
}

static dlua_status_t run_fill(const char *op, dlua_tensor_t *t, dlua_generator_t *g, fill_spec_t *f) {
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
  if (t->device != DLUA_CPU) {
    dlua_status_t st = cuda_fill(op, f, &s, target, n);
    if (st == DLUA_OK && target != t) st = dlua_tensor_copy_(t, target);
    if (target != t) dlua_tensor_free(target);
    return st;
  }
  char *dst = dlua_tensor_ptr(target);
  size_t es = dlua_dtype_size(t->dtype);
  int64_t nchunks = (n + FILL_CHUNK - 1) / FILL_CHUNK;
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t c = 0; c < nchunks; c++) {
    double dbuf[FILL_CHUNK];
    int64_t ibuf[FILL_CHUNK];
    int64_t lo = c * FILL_CHUNK, cnt = n - lo < FILL_CHUNK ? n - lo : FILL_CHUNK;
    fill_chunk(f, &s, lo, cnt, dbuf, ibuf);
    if (f->kind == FILL_RANDINT)
      dlua_convert(dst + lo * (int64_t)es, t->dtype, ibuf, DLUA_DTYPE_I64, cnt);
    else
      dlua_convert(dst + lo * (int64_t)es, t->dtype, dbuf, DLUA_DTYPE_F64, cnt);
  }
  dlua_status_t st = DLUA_OK;
  if (target != t) {
    st = dlua_tensor_copy_(t, target);
    dlua_tensor_free(target);
  }
  return st;
}

/* A fill's tensor: on any device where CUDA is built (the dispatch is in run_fill). */
static dlua_status_t check_target(const char *op, const dlua_tensor_t *t) {
#ifdef DLUA_HAVE_CUDA
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", op);
  return DLUA_OK;
#else
  return dlua_require_cpu(op, t);
#endif
}

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
  fill_spec_t f = {.kind = FILL_UNIFORM, .a = low, .b = high};
  return run_fill("uniform_", t, g, &f);
}

dlua_status_t dlua_tensor_normal_(dlua_tensor_t *t, double mean, double std, dlua_generator_t *g) {
  DLUA_TRY(check_target("normal_", t));
  DLUA_TRY(require_floating("normal_", t));
  if (!isfinite(mean) || !isfinite(std) || std < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "normal_: expected a finite mean and std >= 0, got mean %g, std %g", mean, std);
  fill_spec_t f = {.kind = FILL_NORMAL, .a = mean, .b = std};
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
  fill_spec_t f = {.kind = FILL_RANDINT, .low = low, .range = (uint64_t)high - (uint64_t)low};
  return run_fill("randint_", t, g, &f);
}

dlua_status_t dlua_tensor_bernoulli_(dlua_tensor_t *t, double p, dlua_generator_t *g) {
  DLUA_TRY(check_target("bernoulli_", t));
  if (!(p >= 0 && p <= 1)) return DLUA_ERR(DLUA_ERR_ARG, "bernoulli_: p must be in [0, 1], got %g", p);
  fill_spec_t f = {.kind = FILL_BERNOULLI, .a = p};
  return run_fill("bernoulli_", t, g, &f);
}

/* Fisher-Yates from the back: step k (k = 0 .. n-2) swaps position n-1-k with a uniform
   position in [0, n-1-k], drawn as element k of the stream. Sequential, but each draw is
   still a function of (seed, offset, k), so any backend reproduces it. */
dlua_status_t dlua_tensor_randperm(dlua_tensor_t **out, int64_t n, int64_t base, dlua_dtype_t dtype,
                                   dlua_generator_t *g) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "randperm: out is NULL");
  *out = NULL;
  if (n < 0) return DLUA_ERR(DLUA_ERR_ARG, "randperm: n must be non-negative, got %" PRId64, n);
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return DLUA_ERR(DLUA_ERR_ARG, "randperm: invalid dtype %d", (int)dtype);
  int64_t lo, hi;
  exact_int_range(dtype, &lo, &hi);
  if (n > 0 && (base < lo || base > hi || n - 1 > hi - base))
    return DLUA_ERR(DLUA_ERR_ARG, "randperm: %" PRId64 "..%" PRId64 " cannot be held exactly by %s", base,
                    base + (n - 1), dlua_dtype_name(dtype));
  DLUA_TRY(dlua_tensor_empty(out, 1, &n, dtype, DLUA_CPU));
  int64_t *perm = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  if (!perm) {
    dlua_tensor_free(*out);
    *out = NULL;
    return DLUA_ERR(DLUA_ERR_OOM, "randperm: out of memory allocating %zu bytes", (size_t)n * sizeof(int64_t));
  }
  for (int64_t i = 0; i < n; i++) perm[i] = base + i;
  stream_t s = stream_reserve(g, n);
  uint32_t w[4];
  for (int64_t k = 0; k + 1 < n; k++) {
    if (k % 4 == 0) dlua_rng_block(&s, (uint64_t)k / 4, 0, w);
    int64_t i = n - 1 - k;
    int64_t j = (int64_t)dlua_rng_bounded(&s, k, w[k % 4], (uint64_t)i + 1);
    int64_t tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  dlua_convert(dlua_tensor_ptr(*out), dtype, perm, DLUA_DTYPE_I64, n);
  free(perm);
  return DLUA_OK;
}

/* The CPU's random fills (kernels/random.h): Philox blocks by kernels/philox.h's per-element rules, in chunks
   over the OpenMP pool, converted into the tensor's dtype; randperm's Fisher-Yates shuffle. */
#include <stdint.h>
#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/philox.h"
#include "kernels/random.h"

typedef dlua_rng_stream_t stream_t;

enum { FILL_CHUNK = 2048 };  // elements per work item; a multiple of 4 so blocks never straddle

/* Elements [lo, lo + n) of the fill, lo a multiple of 4, into buf as f64 or i64. */
static void fill_chunk(const dlua_random_fill_t *f, const stream_t *s, int64_t lo, int64_t n, double *dbuf,
                       int64_t *ibuf) {
  for (int64_t j = 0; j < n; j += 4) {
    uint32_t w[4];
    dlua_rng_block(s, (uint64_t)(lo + j) / 4, 0, w);
    int64_t m = n - j < 4 ? n - j : 4;
    switch (f->kind) {
      case DLUA_RANDOM_UNIFORM:
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = dlua_rng_uniform(w[k], f->wide, f->a, f->b);
        break;
      case DLUA_RANDOM_NORMAL: {
        double z[4];
        dlua_rng_normal4(w, f->a, f->b, z);
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = z[k];
        break;
      }
      case DLUA_RANDOM_RANDINT:
        for (int64_t k = 0; k < m; k++) ibuf[j + k] = f->low + (int64_t)dlua_rng_bounded(s, lo + j + k, w[k], f->range);
        break;
      case DLUA_RANDOM_BERNOULLI:
        for (int64_t k = 0; k < m; k++) dbuf[j + k] = dlua_rng_bernoulli(w[k], f->a);
        break;
    }
  }
}

static dlua_status_t cpu_fill(const char *op, const dlua_random_fill_t *f) {
  (void)op;
  stream_t s = {.key = {f->key[0], f->key[1]}, .base = f->base};
  int64_t n = f->n;
  dlua_dtype_t dt = (dlua_dtype_t)f->dtype;
  char *dst = f->dst;
  size_t es = dlua_dtype_size(dt);
  int64_t nchunks = (n + FILL_CHUNK - 1) / FILL_CHUNK;
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (int64_t c = 0; c < nchunks; c++) {
    double dbuf[FILL_CHUNK];
    int64_t ibuf[FILL_CHUNK];
    int64_t lo = c * FILL_CHUNK, cnt = n - lo < FILL_CHUNK ? n - lo : FILL_CHUNK;
    fill_chunk(f, &s, lo, cnt, dbuf, ibuf);
    if (f->kind == DLUA_RANDOM_RANDINT)
      dlua_convert(dst + lo * (int64_t)es, dt, ibuf, DLUA_DTYPE_I64, cnt);
    else
      dlua_convert(dst + lo * (int64_t)es, dt, dbuf, DLUA_DTYPE_F64, cnt);
  }
  return DLUA_OK;
}

static dlua_status_t cpu_randperm(const char *op, const dlua_random_perm_t *d) {
  (void)op;
  stream_t s = {.key = {d->key[0], d->key[1]}, .base = d->base};
  int64_t n = d->n, *perm = d->perm;
  uint32_t w[4];
  for (int64_t k = 0; k + 1 < n; k++) {
    if (k % 4 == 0) dlua_rng_block(&s, (uint64_t)k / 4, 0, w);
    int64_t i = n - 1 - k;
    int64_t j = (int64_t)dlua_rng_bounded(&s, k, w[k % 4], (uint64_t)i + 1);
    int64_t tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  return DLUA_OK;
}

const struct dlua_random_ops dlua_cpu_random_ops = {
    .fill = cpu_fill,
    .randperm = cpu_randperm,
};

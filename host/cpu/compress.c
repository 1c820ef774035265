/* The CPU kernels of gradient compression for DDP's communication hooks (lua/dlua/compress.lua, docs/ddp.md):
   16-bit casts, top-k pack and scatter-add with error feedback, PowerSGD's orthogonalisation. Slots of the CPU
   optim table (host/kernels/optim.h); host/ops/compress.c checked every argument. */
#include "cpu/compress.h"
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu/index.h"

enum { CHUNK = 1 << 16 };  // elements per parallel work item

/* ---- 16-bit casts ------------------------------------------------------------------------- */

/* The cast of n elements, split into chunks the threads share; to_half: f32 -> 16 bits times scale, else back. */
static void cast_chunks(void *d, const void *s, int64_t n, float scale, int bf16, int to_half) {
  int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t lo = c * CHUNK, len = n - lo < CHUNK ? n - lo : CHUNK;
    if (to_half)
      dlua_convert_f32_to_half((uint16_t *)d + lo, (const float *)s + lo, len, scale, bf16);
    else
      dlua_convert_half_to_f32((float *)d + lo, (const uint16_t *)s + lo, len, bf16);
  }
}

// src (n) f32 -> dst (n) f16/bf16, times scale
dlua_status_t dlua_cpu_compress_to_half(const char *op, const dlua_compress_cast_desc_t *d) {
  (void)op;
  cast_chunks(d->dst, d->src, d->n, (float)d->scale, d->half_dtype == DLUA_DTYPE_BF16, 1);
  return DLUA_OK;
}

// src (n) f16/bf16 -> dst (n) f32
dlua_status_t dlua_cpu_compress_from_half(const char *op, const dlua_compress_cast_desc_t *d) {
  (void)op;
  cast_chunks(d->dst, d->src, d->n, 1.0f, d->half_dtype == DLUA_DTYPE_BF16, 0);
  return DLUA_OK;
}

/* ---- top-k -------------------------------------------------------------------------------- */

/* packed (2k) int32; grad (n) f32; acc, mom (n) f32 or NULL. */
dlua_status_t dlua_cpu_compress_topk(const char *op, const dlua_compress_topk_desc_t *d) {
  const int64_t n = d->n, k = d->k;
  const float *g = d->grad;
  float *a = d->acc, *u = d->mom;
  const float m = (float)d->momentum;
  int64_t chunks = (n + CHUNK - 1) / CHUNK;
  // DGC: u = m u + g, v += u; plain error feedback: v += g
  if (a) {
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
      int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
      if (u) {
        for (int64_t i = lo; i < hi; i++) {
          u[i] = m * u[i] + g[i];
          a[i] += u[i];
        }
      } else {
        for (int64_t i = lo; i < hi; i++) a[i] += g[i];
      }
    }
  }
  const float *src = a ? a : g;
  int64_t *pos = malloc((size_t)(k > 0 ? k : 1) * sizeof *pos);
  if (!pos) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for %" PRId64 " positions", op, k);
  dlua_status_t st = dlua_cpu_topk_abs_f32(src, n, k, pos);
  if (st != DLUA_OK) {
    free(pos);
    return st;
  }
  int32_t *pv = d->packed, *pi = pv + k;
#pragma omp parallel for schedule(static) if (k > CHUNK)
  for (int64_t j = 0; j < k; j++) {
    int64_t i = pos[j];
    memcpy(pv + j, src + i, 4);
    pi[j] = (int32_t)i;
    if (a) a[i] = 0.0f;  // sent: what remains is exactly what was not sent
    if (u) u[i] = 0.0f;  // DGC's momentum factor masking
  }
  free(pos);
  return DLUA_OK;
}

/* grad (n) f32; gathered (rows, 2k) int32, as dlua_compress_topk packed them. */
dlua_status_t dlua_cpu_compress_topk_unpack(const char *op, const dlua_compress_unpack_desc_t *d) {
  const int64_t n = d->n, rows = d->rows, k = d->k;
  float *g = d->grad;
  const int32_t *p = d->gathered;
  for (int64_t r = 0; r < rows; r++) {  // bad indices first: nothing is written on bad input
    const int32_t *pi = p + r * 2 * k + k;
    for (int64_t j = 0; j < k; j++)
      if (pi[j] < 0 || pi[j] >= n)
        return DLUA_ERR(DLUA_ERR_ARG, "%s: row %" PRId64 " sends index %" PRId32 ", outside the bucket of %" PRId64
                        " elements", op, r, pi[j], n);
  }
  int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
    memset(g + lo, 0, (size_t)(hi - lo) * sizeof *g);
  }
  // rows in rank order, so every rank adds in the same order and gets the same bits
  for (int64_t r = 0; r < rows; r++) {
    const int32_t *pv = p + r * 2 * k, *pi = pv + k;
    for (int64_t j = 0; j < k; j++) {
      float v;
      memcpy(&v, pv + j, 4);
      g[pi[j]] += v;
    }
  }
  // a division, as all-reduce's avg does (not a multiplication by 1 / world)
  const float dv = (float)d->divisor;
  if (dv != 1.0f) {
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
      int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
      for (int64_t i = lo; i < hi; i++) g[i] /= dv;
    }
  }
  return DLUA_OK;
}

/* ---- PowerSGD ----------------------------------------------------------------------------- */

/* p (n, r) f32, row-major: its columns become orthonormal (modified Gram-Schmidt, in double, the
   same order on every rank, so ranks holding the same p get the same bits). A column whose norm
   left after the earlier ones is <= eps, or <= 1e-10 of its own norm (it lies in their span: a
   rank-deficient gradient, e.g. rows of dead ReLU units), becomes zero rather than noise or NaN. */
dlua_status_t dlua_cpu_compress_orthogonalize(const char *op, const dlua_compress_orth_desc_t *d) {
  const int64_t n = d->n, r = d->r;
  const double eps = d->eps;
  double *w = malloc((size_t)(n * r) * sizeof *w);
  if (!w) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for a (%" PRId64 ", %" PRId64 ") double copy", op, n, r);
  float *f = d->p;
  // column-major double copy: each column contiguous
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < r; j++) w[j * n + i] = f[i * r + j];
  double *orig = malloc((size_t)r * sizeof *orig);
  if (!orig) {
    free(w);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", op);
  }
  for (int64_t j = 0; j < r; j++) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += w[j * n + i] * w[j * n + i];
    orig[j] = sqrt(s);
  }
  for (int64_t j = 0; j < r; j++) {
    double *c = w + j * n, s = 0;
    for (int64_t i = 0; i < n; i++) s += c[i] * c[i];
    double norm = sqrt(s);
    // What is left of a column that depends on the earlier ones is double rounding (~1e-16 of it, far below the
    // f32 input's 1e-7): normalising that noise would give a direction not orthogonal to the others.
    if (norm <= eps || norm <= 1e-10 * orig[j]) {
      memset(c, 0, (size_t)n * sizeof *c);
      continue;
    }
    for (int64_t i = 0; i < n; i++) c[i] /= norm;
    for (int64_t l = j + 1; l < r; l++) {
      double *d = w + l * n, dot = 0;
      for (int64_t i = 0; i < n; i++) dot += c[i] * d[i];
      for (int64_t i = 0; i < n; i++) d[i] -= dot * c[i];
    }
  }
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < r; j++) f[i * r + j] = (float)w[j * n + i];
  free(orig);
  free(w);
  return DLUA_OK;
}

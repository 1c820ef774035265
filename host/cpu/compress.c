/* Gradient compression kernels for DDP's communication hooks (lua/dlua/compress.lua, docs/ddp.md): 16-bit casts, top-k pack and scatter-add with error feedback, PowerSGD's orthogonalisation. */
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cpu/index.h"

enum { CHUNK = 1 << 16 };  // elements per parallel work item

/* t must be a live, contiguous CPU tensor of dtype (or of f16/bf16 when dtype is F16 and half is set). */
static dlua_status_t need(const char *op, const char *what, const dlua_tensor_t *t, dlua_dtype_t dtype, int half) {
  char b[200];
  if (!t) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is missing", op, what);
  DLUA_TRY(dlua_require_cpu(op, t));
  int ok = half ? (t->dtype == DLUA_DTYPE_F16 || t->dtype == DLUA_DTYPE_BF16) : t->dtype == dtype;
  if (!ok)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be %s, got %s", op, what, half ? "float16 or bfloat16" : dlua_dtype_name(dtype),
                    dlua_tensor_describe(t, b, sizeof b));
  if (!dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be contiguous, got %s", op, what, dlua_tensor_describe(t, b, sizeof b));
  return DLUA_OK;
}

static dlua_status_t same_numel(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                const dlua_tensor_t *b) {
  int64_t na = dlua_tensor_numel(a), nb = dlua_tensor_numel(b);
  if (na != nb)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s has %" PRId64 " elements, %s %" PRId64, op, wa, na, wb, nb);
  return DLUA_OK;
}

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
dlua_status_t dlua_compress_to_half(dlua_tensor_t *dst, const dlua_tensor_t *src, double scale) {
  const char *op = "compress_to_half";
  DLUA_TRY(need(op, "the output", dst, DLUA_DTYPE_F16, 1));
  DLUA_TRY(need(op, "the input", src, DLUA_DTYPE_F32, 0));
  DLUA_TRY(same_numel(op, "the output", dst, "the input", src));
  cast_chunks(dlua_tensor_ptr(dst), dlua_tensor_ptr(src), dlua_tensor_numel(src), (float)scale, dst->dtype == DLUA_DTYPE_BF16, 1);
  return DLUA_OK;
}

// src (n) f16/bf16 -> dst (n) f32
dlua_status_t dlua_compress_from_half(dlua_tensor_t *dst, const dlua_tensor_t *src) {
  const char *op = "compress_from_half";
  DLUA_TRY(need(op, "the output", dst, DLUA_DTYPE_F32, 0));
  DLUA_TRY(need(op, "the input", src, DLUA_DTYPE_F16, 1));
  DLUA_TRY(same_numel(op, "the output", dst, "the input", src));
  cast_chunks(dlua_tensor_ptr(dst), dlua_tensor_ptr(src), dlua_tensor_numel(src), 1.0f, src->dtype == DLUA_DTYPE_BF16, 0);
  return DLUA_OK;
}

/* ---- top-k -------------------------------------------------------------------------------- */

/* packed (2k) int32; grad (n) f32; acc, mom (n) f32 or NULL. */
dlua_status_t dlua_compress_topk(dlua_tensor_t *packed, const dlua_tensor_t *grad, dlua_tensor_t *acc, dlua_tensor_t *mom,
                                 double momentum, int64_t k) {
  const char *op = "compress_topk";
  DLUA_TRY(need(op, "the gradient", grad, DLUA_DTYPE_F32, 0));
  DLUA_TRY(need(op, "the packed buffer", packed, DLUA_DTYPE_I32, 0));
  int64_t n = dlua_tensor_numel(grad);
  if (k < 0 || k > n)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: k = %" PRId64 " is out of range for a bucket of %" PRId64 " elements", op, k, n);
  if (n > INT32_MAX)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: a bucket of %" PRId64 " elements does not fit 32-bit indices (use a smaller bucket_mb)",
                    op, n);
  if (dlua_tensor_numel(packed) != 2 * k)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the packed buffer has %" PRId64 " elements, expected 2k = %" PRId64, op,
                    dlua_tensor_numel(packed), 2 * k);
  if (mom && !acc) return DLUA_ERR(DLUA_ERR_ARG, "%s: momentum correction needs the accumulator (error feedback)", op);
  if (acc) {
    DLUA_TRY(need(op, "the residual", acc, DLUA_DTYPE_F32, 0));
    DLUA_TRY(same_numel(op, "the residual", acc, "the gradient", grad));
  }
  if (mom) {
    DLUA_TRY(need(op, "the momentum buffer", mom, DLUA_DTYPE_F32, 0));
    DLUA_TRY(same_numel(op, "the momentum buffer", mom, "the gradient", grad));
  }
  const float *g = (const float *)dlua_tensor_ptr(grad);
  float *a = acc ? (float *)dlua_tensor_ptr(acc) : NULL, *u = mom ? (float *)dlua_tensor_ptr(mom) : NULL;
  const float m = (float)momentum;
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
  int32_t *pv = (int32_t *)dlua_tensor_ptr(packed), *pi = pv + k;
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
dlua_status_t dlua_compress_topk_unpack(dlua_tensor_t *grad, const dlua_tensor_t *gathered, int64_t rows, double divisor) {
  const char *op = "compress_topk_unpack";
  DLUA_TRY(need(op, "the gradient", grad, DLUA_DTYPE_F32, 0));
  DLUA_TRY(need(op, "the gathered buffer", gathered, DLUA_DTYPE_I32, 0));
  int64_t n = dlua_tensor_numel(grad), total = dlua_tensor_numel(gathered);
  if (rows <= 0 || total % (2 * rows))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %" PRId64 " gathered elements are not %" PRId64 " rows of (values, indices)", op,
                    total, rows);
  int64_t k = total / (2 * rows);
  float *g = (float *)dlua_tensor_ptr(grad);
  const int32_t *p = (const int32_t *)dlua_tensor_ptr(gathered);
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
  const float dv = (float)divisor;
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
dlua_status_t dlua_compress_orthogonalize(dlua_tensor_t *p, double eps) {
  const char *op = "compress_orthogonalize";
  char b[200];
  DLUA_TRY(need(op, "the matrix", p, DLUA_DTYPE_F32, 0));
  if (p->ndim != 2) return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a matrix (n, r), got %s", op, dlua_tensor_describe(p, b, sizeof b));
  int64_t n = p->sizes[0], r = p->sizes[1];
  if (n == 0 || r == 0) return DLUA_OK;
  double *w = malloc((size_t)(n * r) * sizeof *w);
  if (!w) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for a (%" PRId64 ", %" PRId64 ") double copy", op, n, r);
  float *f = (float *)dlua_tensor_ptr(p);
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

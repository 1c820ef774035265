/* Batch augmentation on the CPU: gather + random crop with zero padding + horizontal flip, and per-channel normalisation. */
#include "data/augment.h"
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "core/error.h"
#include "kernels/philox.h"
#include "core/tensor.h"
#include "ops/common.h"
#include "ops/index.h"

/* Elements below which a batch is processed on one thread: a small-image batch (128 x 784)
   takes tens of microseconds, less than waking a team costs on a busy machine. */
enum { PARALLEL_MIN_ELEMS = 1 << 18 };

void dlua_augment_draw(uint64_t seed, uint64_t epoch, int64_t sample, int64_t pad, double flip_p, int64_t *dy,
                       int64_t *dx, int *flip) {
  uint64_t s = (uint64_t)sample;
  const uint32_t ctr[4] = {(uint32_t)s, (uint32_t)(s >> 32), (uint32_t)epoch,
                           (uint32_t)(epoch >> 32) ^ DLUA_AUGMENT_STREAM_TAG};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  uint32_t r[4];
  dlua_philox_block(ctr, key, r);
  // Multiply-shift maps a word onto [0, 2 pad]: bias below (2 pad + 1) / 2^32, far under
  // anything a crop could show, and no rejection loop to make the draw count vary.
  uint64_t span = 2 * (uint64_t)pad + 1;
  *dy = (int64_t)(((uint64_t)r[0] * span) >> 32);
  *dx = (int64_t)(((uint64_t)r[1] * span) >> 32);
  *flip = (double)r[2] * 0x1p-32 < flip_p;
}

/* One sample: out (C, H, W) contiguous <- the crop of the zero-padded src (C, H, W) with
   strides (sc, sh, sw), mirrored when flip. Rows and columns outside the source are 0. */
#define DEFINE_CROP(NAME, TIN, TOUT)                                                                          \
  static void NAME(TOUT *out, const TIN *src, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh,         \
                   int64_t sw, int64_t oy, int64_t ox, int flip) {                                            \
    for (int64_t c = 0; c < C; c++)                                                                          \
      for (int64_t y = 0; y < H; y++) {                                                                      \
        TOUT *o = out + (c * H + y) * W;                                                                     \
        int64_t sy = y + oy;                                                                                 \
        if (sy < 0 || sy >= H) {                                                                             \
          for (int64_t x = 0; x < W; x++) o[x] = 0;                                                          \
          continue;                                                                                          \
        }                                                                                                    \
        const TIN *row = src + c * sc + sy * sh;                                                             \
        for (int64_t x = 0; x < W; x++) {                                                                    \
          int64_t sx = (flip ? W - 1 - x : x) + ox;                                                          \
          o[x] = (sx >= 0 && sx < W) ? (TOUT)row[sx * sw] : (TOUT)0;                                         \
        }                                                                                                    \
      }                                                                                                      \
  }
DEFINE_CROP(crop_u8_u8, uint8_t, uint8_t)
DEFINE_CROP(crop_u8_f32, uint8_t, float)
DEFINE_CROP(crop_f32_f32, float, float)

dlua_status_t dlua_data_augment(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *index,
                                int64_t index_base, int64_t pad, double flip_p, uint64_t seed, uint64_t epoch) {
  static const char op[] = "augment";
  char b[200];
  if (!x) return DLUA_ERR(DLUA_ERR_ARG, "%s: x is NULL", op);
  DLUA_TRY(dlua_require_cpu(op, x));
  if (x->ndim != 4 || (x->dtype != DLUA_DTYPE_U8 && x->dtype != DLUA_DTYPE_F32))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected images (N, C, H, W) of uint8 or float32, got %s", op,
                    dlua_tensor_describe(x, b, sizeof b));
  if (pad < 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: padding must be >= 0, got %" PRId64, op, pad);
  if (!(flip_p >= 0 && flip_p <= 1))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: flip probability must be in [0, 1], got %g", op, flip_p);
  const int64_t N = x->sizes[0], C = x->sizes[1], H = x->sizes[2], W = x->sizes[3];

  dlua_tensor_t *ix = NULL;
  int64_t B = N;
  if (index) {
    DLUA_TRY(dlua_ops_index_contiguous(op, "index", index, &ix));
    dlua_status_t s = DLUA_OK;
    if (ix->ndim != 1)
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: index must be 1-D (B), got %s", op, dlua_tensor_describe(index, b, sizeof b));
    if (s == DLUA_OK) s = dlua_ops_check_indices(op, ix, N, index_base, "the images' dim 0");
    if (s != DLUA_OK) {
      dlua_tensor_free(ix);
      return s;
    }
    B = ix->sizes[0];
  }

  // Write x's dtype, or float32 when the caller asked for it (uint8 -> float32 conversion
  // in the same pass); any other out dtype is reached by the out convention's cast.
  dlua_dtype_t wd = x->dtype;
  if (out && *out && (*out)->dtype == DLUA_DTYPE_F32) wd = DLUA_DTYPE_F32;
  const int64_t osz[4] = {B, C, H, W};
  dlua_ops_out_t plan;
  dlua_status_t s = dlua_ops_out_begin(op, out, 4, osz, wd, &x, 1, &plan);
  if (s != DLUA_OK) {
    dlua_tensor_free(ix);
    return s;
  }

  const int is64 = ix && ix->dtype == DLUA_DTYPE_I64;
  const void *ip = ix ? dlua_tensor_data(ix) : NULL;
  const int64_t s0 = x->strides[0], sc = x->strides[1], sh = x->strides[2], sw = x->strides[3];
  const char *xb = dlua_tensor_ptr(x);
  char *ob = dlua_tensor_data(plan.dst);
  const size_t ies = dlua_dtype_size(x->dtype), oes = dlua_dtype_size(wd);
  const int64_t per = C * H * W;
#pragma omp parallel for schedule(static) if (B * per > PARALLEL_MIN_ELEMS)
  for (int64_t i = 0; i < B; i++) {
    int64_t n = ix ? dlua_ops_index_at(ip, is64, i) - index_base : i;
    int64_t dy = 0, dx = 0;
    int flip = 0;
    if (pad > 0 || flip_p > 0) dlua_augment_draw(seed, epoch, n, pad, flip_p, &dy, &dx, &flip);
    const char *src = xb + n * s0 * (int64_t)ies;
    char *dst = ob + i * per * (int64_t)oes;
    if (x->dtype == DLUA_DTYPE_F32)
      crop_f32_f32((float *)dst, (const float *)src, C, H, W, sc, sh, sw, dy - pad, dx - pad, flip);
    else if (wd == DLUA_DTYPE_F32)
      crop_u8_f32((float *)dst, (const uint8_t *)src, C, H, W, sc, sh, sw, dy - pad, dx - pad, flip);
    else
      crop_u8_u8((uint8_t *)dst, (const uint8_t *)src, C, H, W, sc, sh, sw, dy - pad, dx - pad, flip);
  }
  dlua_tensor_free(ix);
  return dlua_ops_out_finish(out, &plan, DLUA_OK);
}

#define DEFINE_NORMALIZE(NAME, TIN)                                                                            \
  static void NAME(float *out, const TIN *in, int64_t rows, int64_t C, int64_t inner, const float *a,          \
                   const float *c0) {                                                                         \
    _Pragma("omp parallel for schedule(static) if (rows * inner > PARALLEL_MIN_ELEMS)") for (int64_t r = 0; r < rows; r++) { \
      float m = a[r % C], k = c0[r % C];                                                                      \
      const TIN *p = in + r * inner;                                                                          \
      float *o = out + r * inner;                                                                             \
      for (int64_t j = 0; j < inner; j++) o[j] = (float)p[j] * m + k;                                         \
    }                                                                                                         \
  }
DEFINE_NORMALIZE(normalize_u8, uint8_t)
DEFINE_NORMALIZE(normalize_f32, float)

dlua_status_t dlua_data_normalize(dlua_tensor_t **out, const dlua_tensor_t *x, double scale, int nstats,
                                  const double *mean, const double *std) {
  static const char op[] = "normalize";
  char b[200];
  if (!x) return DLUA_ERR(DLUA_ERR_ARG, "%s: x is NULL", op);
  DLUA_TRY(dlua_require_cpu(op, x));
  if (x->ndim < 2)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected (N, C, ...) with channels along dim 1, got %s", op,
                    dlua_tensor_describe(x, b, sizeof b));
  const int64_t C = x->sizes[1];
  if (nstats != 1 && nstats != C)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %d means/stds for %" PRId64 " channels of %s (expected 1 or %" PRId64 ")", op,
                    nstats, C, dlua_tensor_describe(x, b, sizeof b), C);
  if (!mean || !std) return DLUA_ERR(DLUA_ERR_ARG, "%s: mean or std is NULL", op);
  if (!isfinite(scale)) return DLUA_ERR(DLUA_ERR_ARG, "%s: scale must be finite, got %g", op, scale);
  // (x * scale - mean) / std as one multiply-add per element: x * (scale / std) - mean / std.
  float *coef = malloc(2 * (size_t)(C ? C : 1) * sizeof(float));
  if (!coef) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, 2 * (size_t)C * sizeof(float));
  for (int64_t c = 0; c < C; c++) {
    double m = mean[nstats == 1 ? 0 : c], s = std[nstats == 1 ? 0 : c];
    if (!isfinite(m) || !isfinite(s) || s == 0) {
      free(coef);
      return DLUA_ERR(DLUA_ERR_ARG, "%s: channel %" PRId64 " has mean %g and std %g (need finite values, std != 0)",
                      op, c, m, s);
    }
    coef[c] = (float)(scale / s);
    coef[C + c] = (float)(-m / s);
  }

  // The kernels read uint8 or float32 contiguously; anything else is converted first.
  dlua_tensor_t *xc = NULL;
  dlua_status_t s;
  if (x->dtype == DLUA_DTYPE_U8 || x->dtype == DLUA_DTYPE_F32)
    s = dlua_tensor_contiguous(&xc, x);
  else
    s = dlua_tensor_to_dtype(&xc, x, DLUA_DTYPE_F32);
  if (s != DLUA_OK) {
    free(coef);
    return s;
  }
  // In place (out == x, contiguous float32) is safe: each element is read before it is written.
  int inplace = out && *out == x && xc->storage == x->storage && xc->offset == x->offset && x->dtype == DLUA_DTYPE_F32;
  dlua_ops_out_t plan;
  s = dlua_ops_out_begin(op, out, x->ndim, x->sizes, DLUA_DTYPE_F32, inplace ? NULL : (const dlua_tensor_t *const *)&xc,
                         inplace ? 0 : 1, &plan);
  if (s == DLUA_OK) {
    int64_t numel = dlua_tensor_numel(xc);
    int64_t rows = x->sizes[0] * C, inner = rows ? numel / rows : 0;
    if (xc->dtype == DLUA_DTYPE_U8)
      normalize_u8(dlua_tensor_data(plan.dst), dlua_tensor_data(xc), rows, C, inner, coef, coef + C);
    else
      normalize_f32(dlua_tensor_data(plan.dst), dlua_tensor_data(xc), rows, C, inner, coef, coef + C);
    s = dlua_ops_out_finish(out, &plan, DLUA_OK);
  }
  dlua_tensor_free(xc);
  free(coef);
  return s;
}

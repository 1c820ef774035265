/* Image transforms on 8-bit HWC images with torchvision's (Pillow path) semantics, and their Philox draws keyed by (seed, epoch, sample). */
#include "data/transform.h"
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/error.h"
#include "kernels/philox.h"
#include "core/tensor.h"
#include "data/image.h"

/* Pillow's fixed-point resampling precision for 8-bit images (32 - 8 - 2). */
enum { PRECISION_BITS = 22 };

/* The hot loops get an AVX2 clone picked at load time (glibc ifunc); the portable build
   stays the default, so the binary still runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DLUA_TF_HOT __attribute__((target_clones("avx2", "default")))
#else
#define DLUA_TF_HOT
#endif

/* ---- draws ------------------------------------------------------------------------------------ */

static void draw(const dlua_tf_key_t *k, int position, int block, uint32_t r[4]) {
  uint64_t s = (uint64_t)k->sample;
  const uint32_t ctr[4] = {(uint32_t)s, (uint32_t)(s >> 32), (uint32_t)k->epoch,
                           DLUA_TF_STREAM_TAG ^ ((uint32_t)position << 8) ^ (uint32_t)block};
  const uint32_t key[2] = {(uint32_t)k->seed, (uint32_t)(k->seed >> 32)};
  dlua_philox_block(ctr, key, r);
}

static double unit(uint32_t r) { return (double)r * 0x1p-32; }
/* torch.randint(0, n): multiply-shift, no rejection loop, so the draw count is fixed. */
static int below(uint32_t r, int n) { return (int)(((uint64_t)r * (uint64_t)n) >> 32); }
/* Python's round(): half to even (the default rounding mode). */
static int pyround(double x) { return (int)nearbyint(x); }

void dlua_transform_rrc_box(const double *scale, const double *ratio, int h, int w, uint64_t seed, uint64_t epoch,
                            int64_t sample, int position, int *box) {
  dlua_tf_key_t k = {seed, epoch, sample};
  double area = (double)h * w, lr0 = log(ratio[0]), lr1 = log(ratio[1]);
  for (int a = 0; a < 10; a++) {
    uint32_t r[4];
    draw(&k, position, a, r);
    double target = area * (scale[0] + (scale[1] - scale[0]) * unit(r[0]));
    double aspect = exp(lr0 + (lr1 - lr0) * unit(r[1]));
    int cw = pyround(sqrt(target * aspect)), ch = pyround(sqrt(target / aspect));
    if (cw > 0 && cw <= w && ch > 0 && ch <= h) {
      box[0] = below(r[2], h - ch + 1);
      box[1] = below(r[3], w - cw + 1);
      box[2] = ch;
      box[3] = cw;
      return;
    }
  }
  // torchvision's fallback: the central crop at the nearest allowed aspect ratio.
  double in_ratio = (double)w / h;
  int cw = w, ch = h;
  double rmin = ratio[0] < ratio[1] ? ratio[0] : ratio[1], rmax = ratio[0] < ratio[1] ? ratio[1] : ratio[0];
  if (in_ratio < rmin) {
    ch = pyround(cw / rmin);
  } else if (in_ratio > rmax) {
    cw = pyround(ch * rmax);
  }
  box[0] = (h - ch) / 2;
  box[1] = (w - cw) / 2;
  box[2] = ch;
  box[3] = cw;
}

int dlua_transform_flip_draw(double p, uint64_t seed, uint64_t epoch, int64_t sample, int position) {
  dlua_tf_key_t k = {seed, epoch, sample};
  uint32_t r[4];
  draw(&k, position, 0, r);
  return unit(r[0]) < p;
}

/* ---- the pipeline ----------------------------------------------------------------------------- */

static const char *kind_name(int k) {
  static const char *names[] = {"RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip", "Normalize",
                                "ToTensor"};
  return (k >= 0 && k < DLUA_TF_COUNT) ? names[k] : "?";
}

dlua_status_t dlua_pipeline_new(dlua_pipeline_t **out, const dlua_transform_t *ops, int n) {
  static const char op[] = "Compose";
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  *out = NULL;
  if (n < 0 || n > DLUA_TF_MAX_OPS || (n && !ops))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %d transforms (at most %d)", op, n, DLUA_TF_MAX_OPS);
  dlua_pipeline_t *p = calloc(1, sizeof *p);
  if (!p) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", op);
  p->n = n;
  p->to_tensor = -1;
  p->out_dtype = DLUA_DTYPE_U8;
  for (int c = 0; c < DLUA_TF_MAX_CHANNELS; c++) p->a[c] = 1.0;
  dlua_status_t s = DLUA_OK;
  for (int i = 0; i < n && s == DLUA_OK; i++) {
    const dlua_transform_t *t = &ops[i];
    p->ops[i] = *t;
    const char *name = kind_name(t->kind);
    switch (t->kind) {
      case DLUA_TF_RANDOM_RESIZED_CROP:
        if (t->h < 1 || t->w < 1 || t->h > 65535 || t->w > 65535)
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: size must be 1..65535, got %dx%d", name, t->h, t->w);
        else if (!(t->scale[0] > 0 && t->scale[0] <= t->scale[1] && isfinite(t->scale[1])))
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: scale must be (lo, hi) with 0 < lo <= hi, got (%g, %g)", name, t->scale[0],
                       t->scale[1]);
        else if (!(t->ratio[0] > 0 && t->ratio[0] <= t->ratio[1] && isfinite(t->ratio[1])))
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: ratio must be (lo, hi) with 0 < lo <= hi, got (%g, %g)", name, t->ratio[0],
                       t->ratio[1]);
        break;
      case DLUA_TF_RESIZE:
        if (t->h < 1 || t->w < 0 || t->h > 65535 || t->w > 65535)
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: size must be 1..65535, got %d (w %d)", name, t->h, t->w);
        break;
      case DLUA_TF_CENTER_CROP:
        if (t->h < 1 || t->w < 1 || t->h > 65535 || t->w > 65535)
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: size must be 1..65535, got %dx%d", name, t->h, t->w);
        break;
      case DLUA_TF_HFLIP:
        if (!(t->p >= 0 && t->p <= 1)) s = DLUA_ERR(DLUA_ERR_ARG, "%s: p must be in [0, 1], got %g", name, t->p);
        break;
      case DLUA_TF_NORMALIZE:
        if (p->to_tensor < 0 || p->out_dtype != DLUA_DTYPE_F32) {
          s = DLUA_ERR(DLUA_ERR_ARG, "%s (transform %d) needs a float ToTensor before it, as in torchvision", name, i + 1);
          break;
        }
        if (t->n < 1 || t->n > DLUA_TF_MAX_CHANNELS || (p->nnorm > 1 && t->n > 1 && t->n != p->nnorm)) {
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: %d means/stds (expected 1..%d, one per channel)", name, t->n,
                       DLUA_TF_MAX_CHANNELS);
          break;
        }
        for (int c = 0; c < t->n && s == DLUA_OK; c++)
          if (!isfinite(t->mean[c]) || !isfinite(t->std[c]) || t->std[c] == 0)
            s = DLUA_ERR(DLUA_ERR_ARG, "%s: channel %d has mean %g and std %g (need finite values, std != 0)", name,
                         c + 1, t->mean[c], t->std[c]);
        if (s != DLUA_OK) break;
        // Fold into out = pixel * a + b: x' = (x - m) / s.
        for (int c = 0; c < DLUA_TF_MAX_CHANNELS; c++) {
          double m = t->mean[t->n == 1 ? 0 : c < t->n ? c : 0], sd = t->std[t->n == 1 ? 0 : c < t->n ? c : 0];
          p->a[c] /= sd;
          p->b[c] = (p->b[c] - m) / sd;
        }
        if (t->n > p->nnorm) p->nnorm = t->n;
        break;
      case DLUA_TF_TO_TENSOR:
        if (p->to_tensor >= 0) {
          s = DLUA_ERR(DLUA_ERR_ARG, "%s appears twice (transforms %d and %d)", name, p->to_tensor + 1, i + 1);
          break;
        }
        if (t->dtype != DLUA_DTYPE_F32 && t->dtype != DLUA_DTYPE_U8) {
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: dtype must be float32 or uint8", name);
          break;
        }
        if (t->layout != 0 && t->layout != 1) {
          s = DLUA_ERR(DLUA_ERR_ARG, "%s: layout must be 0 (NCHW) or 1 (NHWC)", name);
          break;
        }
        p->to_tensor = i;
        p->out_dtype = t->dtype;
        p->layout = t->layout;
        if (t->dtype == DLUA_DTYPE_F32)
          for (int c = 0; c < DLUA_TF_MAX_CHANNELS; c++) p->a[c] = 1.0 / 255.0;
        break;
      default: s = DLUA_ERR(DLUA_ERR_ARG, "%s: unknown transform kind %d at position %d", op, t->kind, i + 1);
    }
    if (s == DLUA_OK && p->to_tensor >= 0 && p->to_tensor < i && t->kind != DLUA_TF_NORMALIZE)
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: %s (transform %d) comes after ToTensor: put the image transforms first", op, name,
                   i + 1);
  }
  if (s != DLUA_OK) {
    free(p);
    return s;
  }
  *out = p;
  return DLUA_OK;
}

void dlua_pipeline_free(dlua_pipeline_t *p) { free(p); }

/* torchvision's Resize(int): the shorter side becomes n, the longer int(n * long / short). */
static void resize_hw(const dlua_transform_t *t, int h, int w, int *oh, int *ow) {
  if (t->w > 0) {
    *oh = t->h;
    *ow = t->w;
    return;
  }
  int n = t->h;
  if (w <= h) {
    *ow = n;
    *oh = (int)((double)n * h / w);
  } else {
    *oh = n;
    *ow = (int)((double)n * w / h);
  }
}

void dlua_tf_output_hw(const dlua_pipeline_t *p, int h, int w, int *oh, int *ow) {
  for (int i = 0; i < p->n; i++) {
    const dlua_transform_t *t = &p->ops[i];
    if (t->kind == DLUA_TF_RANDOM_RESIZED_CROP || t->kind == DLUA_TF_CENTER_CROP || (t->kind == DLUA_TF_RESIZE && t->w > 0)) {
      h = t->h;
      w = t->w;
    } else if (t->kind == DLUA_TF_RESIZE) {
      if (h < 0 || w < 0) continue;
      resize_hw(t, h, w, &h, &w);
    }
  }
  *oh = h < 0 || w < 0 ? -1 : h;
  *ow = h < 0 || w < 0 ? -1 : w;
}

void dlua_tf_plan_decode(const dlua_pipeline_t *p, const dlua_tf_key_t *key, int h, int w, int *num, int *den) {
  *num = *den = 1;
  for (int i = 0; i < p->n; i++) {
    const dlua_transform_t *t = &p->ops[i];
    if (t->kind == DLUA_TF_HFLIP) continue;
    int need_h, need_w;
    if (t->kind == DLUA_TF_RANDOM_RESIZED_CROP) {
      int box[4];
      dlua_transform_rrc_box(t->scale, t->ratio, h, w, key->seed, key->epoch, key->sample, i, box);
      // The crop must keep at least the output's size after scaling the whole image.
      need_h = (int)ceil((double)h * t->h / box[2]);
      need_w = (int)ceil((double)w * t->w / box[3]);
    } else if (t->kind == DLUA_TF_RESIZE) {
      resize_hw(t, h, w, &need_h, &need_w);
    } else {
      return;
    }
    // Only factors of 1/2 or less: finer ones (7/8...) save little and use slow IDCTs.
    if (2 * need_h > h || 2 * need_w > w) return;
    dlua_image_pick_scale(h, w, need_h, need_w, num, den);
    return;
  }
}

int dlua_tf_plan_region(const dlua_pipeline_t *p, const dlua_tf_key_t *key, int h, int w, int box[4]) {
  int flip = 0;
  for (int i = 0; i < p->n; i++) {
    const dlua_transform_t *t = &p->ops[i];
    if (t->kind == DLUA_TF_HFLIP) {
      flip ^= dlua_transform_flip_draw(t->p, key->seed, key->epoch, key->sample, i);
      continue;
    }
    if (t->kind != DLUA_TF_RANDOM_RESIZED_CROP) return 0;
    dlua_transform_rrc_box(t->scale, t->ratio, h, w, key->seed, key->epoch, key->sample, i, box);
    if (flip) box[1] = w - box[1] - box[3];
    return box[2] < h || box[3] < w;
  }
  return 0;
}

/* ---- buffers ---------------------------------------------------------------------------------- */

void dlua_tf_scratch_free(dlua_tf_scratch_t *s) {
  if (!s) return;
  free(s->img[0]);
  free(s->img[1]);
  free(s->tmp);
  free(s->coef);
  memset(s, 0, sizeof *s);
}

static void *reserve(void **p, size_t *cap, size_t need) {
  if (need > *cap) {
    void *q = realloc(*p, need + need / 8 + 64);
    if (!q) return NULL;
    *p = q;
    *cap = need + need / 8 + 64;
  }
  return *p;
}

/* ---- resize (Pillow's ImagingResample, bilinear) ------------------------------------------------ */

/* Coefficients of one pass: for output x, taps bounds[2x] .. + bounds[2x+1] with weights k[x * ksize + t]. */
typedef struct {
  int ksize;
  int *bounds;
  int32_t *k;
} coeffs_t;

static double bilinear(double x) {
  if (x < 0) x = -x;
  return x < 1 ? 1 - x : 0;
}

/* Pillow's precompute_coeffs + normalize_coeffs_8bpc for in_size -> out_size over [0, in_size). */
static int precompute(int in_size, int out_size, coeffs_t *cf, void *mem) {
  double scale = (double)in_size / out_size, filterscale = scale < 1 ? 1 : scale;
  double support = 1.0 * filterscale;
  int ksize = (int)ceil(support) * 2 + 1;
  cf->ksize = ksize;
  cf->bounds = mem;
  cf->k = (int32_t *)(cf->bounds + 2 * out_size);
  double kd[ksize];
  for (int xx = 0; xx < out_size; xx++) {
    double center = (xx + 0.5) * scale, ww = 0, ss = 1.0 / filterscale;
    int xmin = (int)(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = (int)(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    for (int x = 0; x < xmax; x++) {
      double w = bilinear((x + xmin - center + 0.5) * ss);
      kd[x] = w;
      ww += w;
    }
    int32_t *k = cf->k + (size_t)xx * ksize;
    for (int x = 0; x < ksize; x++) {
      double v = x < xmax ? (ww != 0 ? kd[x] / ww : kd[x]) : 0;
      k[x] = (int32_t)(v < 0 ? -0.5 + v * (1 << PRECISION_BITS) : 0.5 + v * (1 << PRECISION_BITS));
    }
    // Every output reads exactly ksize taps when the input is wide enough: the window slides
    // left to fit and the extra taps weigh 0, so the sum is unchanged and the loops have a
    // fixed length the compiler unrolls.
    if (in_size >= ksize) {
      int xs = xmin + ksize > in_size ? in_size - ksize : xmin, shift = xmin - xs;
      if (shift > 0) {
        memmove(k + shift, k, (size_t)(ksize - shift) * sizeof(int32_t));
        for (int x = 0; x < shift; x++) k[x] = 0;
      }
      xmin = xs;
      xmax = ksize;
    }
    cf->bounds[2 * xx] = xmin;
    cf->bounds[2 * xx + 1] = xmax;
  }
  return ksize;
}

static size_t coeffs_bytes(int in_size, int out_size) {
  double scale = (double)in_size / out_size;
  int ksize = (int)ceil(scale < 1 ? 1 : scale) * 2 + 1;
  return (size_t)out_size * 2 * sizeof(int) + (size_t)out_size * ksize * sizeof(int32_t);
}

static inline uint8_t clip8(int32_t in) {
  if (in >= (1 << PRECISION_BITS << 8)) return 255;
  if (in <= 0) return 0;
  return (uint8_t)(in >> PRECISION_BITS);
}

/* Rows [y0, y1) of src (w, c) -> dst rows 0.. of width ow. */
DLUA_TF_HOT static void resample_h(const uint8_t *src, ptrdiff_t sstride, int c, int y0, int y1, uint8_t *dst, int ow,
                       const coeffs_t *cf) {
  const int32_t half = 1 << (PRECISION_BITS - 1);
  for (int y = y0; y < y1; y++) {
    const uint8_t *row = src + (ptrdiff_t)y * sstride;
    uint8_t *o = dst + (size_t)(y - y0) * ow * c;
    for (int x = 0; x < ow; x++) {
      int xmin = cf->bounds[2 * x], xn = cf->bounds[2 * x + 1];
      const int32_t *k = cf->k + (size_t)x * cf->ksize;
      const uint8_t *s = row + (ptrdiff_t)xmin * c;
      if (c == 3 && xn == cf->ksize && xn <= 7) {
        int32_t a0 = half, a1 = half, a2 = half;
#define TAPS(KS)                          \
  for (int t = 0; t < KS; t++) {          \
    a0 += s[3 * t] * k[t];                \
    a1 += s[3 * t + 1] * k[t];            \
    a2 += s[3 * t + 2] * k[t];            \
  }
        if (xn == 3) {
          TAPS(3)
        } else if (xn == 5) {
          TAPS(5)
        } else {
          TAPS(7)
        }
#undef TAPS
        o[3 * x] = clip8(a0);
        o[3 * x + 1] = clip8(a1);
        o[3 * x + 2] = clip8(a2);
      } else if (c == 3) {
        int32_t a0 = half, a1 = half, a2 = half;
        for (int t = 0; t < xn; t++, s += 3) {
          a0 += s[0] * k[t];
          a1 += s[1] * k[t];
          a2 += s[2] * k[t];
        }
        o[3 * x] = clip8(a0);
        o[3 * x + 1] = clip8(a1);
        o[3 * x + 2] = clip8(a2);
      } else {
        for (int ch = 0; ch < c; ch++) {
          int32_t a = half;
          for (int t = 0; t < xn; t++) a += s[t * c + ch] * k[t];
          o[x * c + ch] = clip8(a);
        }
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DLUA_TF_AVX2 1

/* resample_h for RGB with every window of ksize taps, in AVX2: a pair of taps per 256-bit
   step, one pixel's R, G, B (and a zero) widened to int32 in each 128-bit half, times the
   taps' coefficients (kk: per output x, per pair, {k0 x4, k1 x4}); the same int32 sums as
   the scalar loop, so the same bytes. Each pair loads 8 bytes from its first pixel: the
   caller makes sure the last window of the last row has 2 (odd ksize: 5) readable bytes
   after it. */
__attribute__((target("avx2"), always_inline)) static inline __m128i h3_pixel(const uint8_t *s, const int32_t *kk,
                                                                              int npairs) {
  const __m256i widen = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1,  //
                                         3, -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, -1, -1, -1, -1);
  __m256i acc = _mm256_setzero_si256();
  for (int q = 0; q < npairs; q++, s += 6) {
    long long b8;
    memcpy(&b8, s, 8);  // one unaligned load
    __m256i px = _mm256_shuffle_epi8(_mm256_set1_epi64x(b8), widen);
    acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(px, _mm256_loadu_si256((const __m256i *)(const void *)(kk + 8 * q))));
  }
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  return _mm_srai_epi32(_mm_add_epi32(sum, _mm_set1_epi32(1 << (PRECISION_BITS - 1))), PRECISION_BITS);
}

/* One row; npairs is a constant in each inlined copy, so the tap loop unrolls. */
__attribute__((target("avx2"), always_inline)) static inline void h3_row(const uint8_t *row, uint8_t *o, int ow,
                                                                         const int *bounds, const int32_t *kk,
                                                                         int npairs) {
  const __m128i compact = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  const size_t kstep = (size_t)npairs * 8;
  int x = 0;
  for (; x + 4 <= ow; x += 4) {
    __m128i r0 = h3_pixel(row + (ptrdiff_t)bounds[2 * x] * 3, kk + x * kstep, npairs);
    __m128i r1 = h3_pixel(row + (ptrdiff_t)bounds[2 * x + 2] * 3, kk + (x + 1) * kstep, npairs);
    __m128i r2 = h3_pixel(row + (ptrdiff_t)bounds[2 * x + 4] * 3, kk + (x + 2) * kstep, npairs);
    __m128i r3 = h3_pixel(row + (ptrdiff_t)bounds[2 * x + 6] * 3, kk + (x + 3) * kstep, npairs);
    // Signed then unsigned saturation: Pillow's clip8.
    __m128i b = _mm_shuffle_epi8(_mm_packus_epi16(_mm_packs_epi32(r0, r1), _mm_packs_epi32(r2, r3)), compact);
    _mm_storel_epi64((__m128i *)(void *)(o + 3 * x), b);
    uint32_t t4 = (uint32_t)_mm_extract_epi32(b, 2);
    memcpy(o + 3 * x + 8, &t4, 4);
  }
  for (; x < ow; x++) {
    __m128i r = h3_pixel(row + (ptrdiff_t)bounds[2 * x] * 3, kk + x * kstep, npairs);
    uint32_t t4 = (uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(r, r), r));
    memcpy(o + 3 * x, &t4, 3);
  }
}

/* resample_h for RGB with every window of ksize taps, in AVX2: a pair of taps per 256-bit
   step, one pixel's R, G, B (and a zero) widened to int32 in each 128-bit half, times the
   taps' coefficients (kk: per output x, per pair, {k0 x4, k1 x4}); the same int32 sums as
   the scalar loop, so the same bytes. Each pair loads 8 bytes from its first pixel: a
   window reads up to 5 bytes past its end, so the caller keeps the last row for the scalar
   loop. */
__attribute__((target("avx2"))) static void resample_h3_avx2(const uint8_t *src, ptrdiff_t sstride, int y0, int y1,
                                                               uint8_t *dst, int ow, const int *bounds,
                                                               const int32_t *kk, int npairs) {
  for (int y = y0; y < y1; y++) {
    const uint8_t *row = src + (ptrdiff_t)y * sstride;
    uint8_t *o = dst + (size_t)(y - y0) * ow * 3;
    switch (npairs) {
      case 2: h3_row(row, o, ow, bounds, kk, 2); break;
      case 3: h3_row(row, o, ow, bounds, kk, 3); break;
      case 4: h3_row(row, o, ow, bounds, kk, 4); break;
      default: h3_row(row, o, ow, bounds, kk, npairs); break;
    }
  }
}

/* resample_v in AVX2: 32 bytes of a row at a time, their int32 sums kept in registers across
   the taps (the portable loop goes through memory once per tap); same sums, same bytes. */
__attribute__((target("avx2"))) static void resample_v_avx2(const uint8_t *src, ptrdiff_t sstride, int wc, uint8_t *dst,
                                                              int oh, const coeffs_t *cf) {
  const __m256i half = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int y = 0; y < oh; y++) {
    const int ymin = cf->bounds[2 * y], yn = cf->bounds[2 * y + 1];
    const int32_t *k = cf->k + (size_t)y * cf->ksize;
    const uint8_t *s0 = src + (ptrdiff_t)ymin * sstride;
    uint8_t *o = dst + (size_t)y * wc;
    int x = 0;
    for (; x + 32 <= wc; x += 32) {
      __m256i a0 = half, a1 = half, a2 = half, a3 = half;
      const uint8_t *s = s0 + x;
      for (int t = 0; t < yn; t++, s += sstride) {
        const __m256i kt = _mm256_set1_epi32(k[t]);
        const __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)s);
        const __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(lo), kt));
        a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), kt));
        a2 = _mm256_add_epi32(a2, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(hi), kt));
        a3 = _mm256_add_epi32(a3, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), kt));
      }
      a0 = _mm256_srai_epi32(a0, PRECISION_BITS);
      a1 = _mm256_srai_epi32(a1, PRECISION_BITS);
      a2 = _mm256_srai_epi32(a2, PRECISION_BITS);
      a3 = _mm256_srai_epi32(a3, PRECISION_BITS);
      // packs/packus work within 128-bit lanes: the permute puts the 32 bytes back in order.
      __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
      _mm256_storeu_si256((__m256i *)(void *)(o + x), _mm256_permutevar8x32_epi32(b, order));
    }
    for (; x < wc; x++) {
      int32_t a = 1 << (PRECISION_BITS - 1);
      for (int t = 0; t < yn; t++) a += s0[(ptrdiff_t)t * sstride + x] * k[t];
      o[x] = clip8(a);
    }
  }
}

/* ToTensor + Normalize of an RGB view into (3, H, W) float: 8 pixels (24 bytes, no more) per
   step, split into channels with byte shuffles, their values gathered from the lookup table
   the scalar loop reads, so the floats are the same. */
__attribute__((target("avx2"))) static void store_chw3_avx2(const float lut[][256], const uint8_t *p, ptrdiff_t stride,
                                                              int H, int W, int flip, float *o) {
  const __m128i lo_m[3] = {_mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                           _mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                           _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1)};
  const __m128i hi_m[3] = {_mm_setr_epi8(-1, -1, -1, -1, -1, -1, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1),
                           _mm_setr_epi8(-1, -1, -1, -1, -1, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1),
                           _mm_setr_epi8(-1, -1, -1, -1, -1, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1)};
  const __m256i rev = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int y = 0; y < H; y++) {
    const uint8_t *row = p + (ptrdiff_t)y * stride;
    int x = 0;
    for (; x + 8 <= W; x += 8) {
      const uint8_t *s = row + (ptrdiff_t)(flip ? W - 8 - x : x) * 3;
      const __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)s);
      const __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(s + 8));
      for (int c = 0; c < 3; c++) {
        __m128i b = _mm_or_si128(_mm_shuffle_epi8(lo, lo_m[c]), _mm_shuffle_epi8(hi, hi_m[c]));
        __m256i idx = _mm256_cvtepu8_epi32(b);
        if (flip) idx = _mm256_permutevar8x32_epi32(idx, rev);
        _mm256_storeu_ps(o + ((size_t)c * H + y) * W + x, _mm256_i32gather_ps(lut[c], idx, 4));
      }
    }
    for (; x < W; x++) {
      const uint8_t *px = row + (ptrdiff_t)(flip ? W - 1 - x : x) * 3;
      for (int c = 0; c < 3; c++) o[((size_t)c * H + y) * W + x] = lut[c][px[c]];
    }
  }
}

static int have_avx2(void) {
  static int v = -1;
  int r = __atomic_load_n(&v, __ATOMIC_RELAXED);
  if (r < 0) {
    __builtin_cpu_init();
    r = __builtin_cpu_supports("avx2") ? 1 : 0;
    __atomic_store_n(&v, r, __ATOMIC_RELAXED);
  }
  return r;
}
#endif

/* src rows (width w * c bytes each) -> dst (oh rows); bounds relative to src row 0. Taps
   outer, pixels inner, so the row loop vectorises (int32 multiply-adds over a row). */
DLUA_TF_HOT static void resample_v(const uint8_t *src, ptrdiff_t sstride, int wc, uint8_t *dst, int oh,
                                   const coeffs_t *cf, int32_t *acc) {
  const int32_t half = 1 << (PRECISION_BITS - 1);
  for (int y = 0; y < oh; y++) {
    int ymin = cf->bounds[2 * y], yn = cf->bounds[2 * y + 1];
    const int32_t *k = cf->k + (size_t)y * cf->ksize;
    for (int x = 0; x < wc; x++) acc[x] = half;
    for (int t = 0; t < yn; t++) {
      const uint8_t *s = src + (ptrdiff_t)(ymin + t) * sstride;
      const int32_t kt = k[t];
      for (int x = 0; x < wc; x++) acc[x] += s[x] * kt;
    }
    uint8_t *o = dst + (size_t)y * wc;
    for (int x = 0; x < wc; x++) o[x] = clip8(acc[x]);
  }
}

/* The horizontal pass over rows [y0, y1) of v into dst; kmem: room for the AVX2 path's
   expanded coefficients (hpass_bytes). */
static void hpass(dlua_tf_view_t v, int y0, int y1, uint8_t *dst, int ow, const coeffs_t *cf, void *kmem) {
#ifdef DLUA_TF_AVX2
  if (v.c == 3 && v.w >= cf->ksize && y1 > y0 && have_avx2()) {
    const int K = cf->ksize, npairs = (K + 1) / 2;
    int32_t *kk = kmem;
    for (int x = 0; x < ow; x++) {
      const int32_t *k = cf->k + (size_t)x * K;
      int32_t *o = kk + (size_t)x * npairs * 8;
      for (int t = 0; t < 2 * npairs; t++)
        for (int j = 0; j < 4; j++) o[(t / 2) * 8 + (t % 2) * 4 + j] = t < K ? k[t] : 0;
    }
    // The last row reads past its end: it takes the scalar loop.
    resample_h3_avx2(v.p, v.stride, y0, y1 - 1, dst, ow, cf->bounds, kk, npairs);
    resample_h(v.p, v.stride, 3, y1 - 1, y1, dst + (size_t)(y1 - 1 - y0) * ow * 3, ow, cf);
    return;
  }
#endif
  (void)kmem;
  resample_h(v.p, v.stride, v.c, y0, y1, dst, ow, cf);
}

static void vpass(const uint8_t *src, ptrdiff_t sstride, int wc, uint8_t *dst, int oh, const coeffs_t *cf, int32_t *acc) {
#ifdef DLUA_TF_AVX2
  if (have_avx2()) {
    resample_v_avx2(src, sstride, wc, dst, oh, cf);
    return;
  }
#endif
  resample_v(src, sstride, wc, dst, oh, cf, acc);
}

static size_t hpass_bytes(int in_size, int out_size) {
  double scale = (double)in_size / out_size;
  int ksize = (int)ceil(scale < 1 ? 1 : scale) * 2 + 1;
  return (size_t)out_size * ((ksize + 1) / 2) * 8 * sizeof(int32_t) + 64;
}

dlua_status_t dlua_tf_resize(dlua_tf_scratch_t *s, dlua_tf_view_t v, uint8_t *dst, int oh, int ow) {
  const int c = v.c;
  int need_h = ow != v.w, need_v = oh != v.h;
  if (!need_h && !need_v) {
    for (int y = 0; y < oh; y++) memcpy(dst + (size_t)y * ow * c, v.p + (ptrdiff_t)y * v.stride, (size_t)ow * c);
    return DLUA_OK;
  }
  size_t bh = need_h ? coeffs_bytes(v.w, ow) : 0, bv = need_v ? coeffs_bytes(v.h, oh) : 0;
  bh = (bh + 63) / 64 * 64;
  bv = (bv + 63) / 64 * 64;
  size_t bacc = ((size_t)ow * c * sizeof(int32_t) + 63) / 64 * 64, bk = need_h ? hpass_bytes(v.w, ow) : 0;
  char *mem = reserve(&s->coef, &s->coef_cap, bh + bv + bacc + bk);
  if (!mem) return DLUA_ERR(DLUA_ERR_OOM, "resize: out of memory for %zu bytes of coefficients", bh + bv + bacc + bk);
  int32_t *acc = (int32_t *)(mem + bh + bv);
  void *kmem = mem + bh + bv + bacc;
  coeffs_t ch = {0}, cv = {0};
  if (need_h) precompute(v.w, ow, &ch, mem);
  if (need_v) precompute(v.h, oh, &cv, mem + bh);
  if (!need_v) {
    hpass(v, 0, oh, dst, ow, &ch, kmem);
    return DLUA_OK;
  }
  if (!need_h) {
    vpass(v.p, v.stride, ow * c, dst, oh, &cv, acc);
    return DLUA_OK;
  }
  // Horizontal pass over the rows the vertical pass reads, as Pillow does.
  int y0 = cv.bounds[0], y1 = cv.bounds[2 * oh - 2] + cv.bounds[2 * oh - 1];
  for (int y = 0; y < oh; y++) cv.bounds[2 * y] -= y0;
  uint8_t *tmp = reserve((void **)&s->tmp, &s->tmp_cap, (size_t)(y1 - y0) * ow * c);
  if (!tmp) return DLUA_ERR(DLUA_ERR_OOM, "resize: out of memory for a %dx%d intermediate", ow, y1 - y0);
  hpass(v, y0, y1, tmp, ow, &ch, kmem);
  vpass(tmp, (ptrdiff_t)ow * c, ow * c, dst, oh, &cv, acc);
  return DLUA_OK;
}

/* ---- running the pipeline ----------------------------------------------------------------------- */

/* The physical window of a logical crop (y, x, h, w) of v (mirroring maps x). */
static dlua_tf_view_t crop(dlua_tf_view_t v, int y, int x, int h, int w) {
  int px = v.flip ? v.w - x - w : x;
  v.p += (ptrdiff_t)(y - v.oy) * v.stride + (ptrdiff_t)(px - v.ox) * v.c;
  v.h = h;
  v.w = w;
  v.lh = h;
  v.lw = w;
  v.oy = v.ox = v.rh = v.rw = 0;
  return v;
}

/* A view holding only a decoded region can take one crop inside that region and nothing else. */
static dlua_status_t region_check(const dlua_tf_view_t *v, const char *name, const int *box) {
  if (v->rh <= 0) return DLUA_OK;
  if (box) {
    int px = v->flip ? v->w - box[1] - box[3] : box[1];
    if (box[0] >= v->oy && box[0] + box[2] <= v->oy + v->rh && px >= v->ox && px + box[3] <= v->ox + v->rw)
      return DLUA_OK;
  }
  return DLUA_ERR(DLUA_ERR_INTERNAL, "transforms: %s needs pixels outside the decoded region (%d, %d) %dx%d of a %dx%d image",
                  name, v->oy, v->ox, v->rw, v->rh, v->w, v->h);
}

/* A buffer of the scratch that v does not point into. */
static uint8_t *other_buffer(dlua_tf_scratch_t *s, const dlua_tf_view_t *v, size_t need, int *which) {
  int k = (v->p >= s->img[0] && s->img[0] && v->p < s->img[0] + s->img_cap[0]) ? 1 : 0;
  *which = k;
  return reserve((void **)&s->img[k], &s->img_cap[k], need);
}

static dlua_status_t resize_to(dlua_tf_scratch_t *s, dlua_tf_view_t *v, int oh, int ow) {
  int k;
  uint8_t *dst = other_buffer(s, v, (size_t)oh * ow * v->c, &k);
  if (!dst) return DLUA_ERR(DLUA_ERR_OOM, "resize: out of memory for a %dx%d image", ow, oh);
  DLUA_TRY(dlua_tf_resize(s, *v, dst, oh, ow));
  v->p = dst;
  v->h = v->lh = oh;
  v->w = v->lw = ow;
  v->stride = (ptrdiff_t)ow * v->c;
  return DLUA_OK;  // v->flip is kept: resampling commutes with mirroring
}

static dlua_status_t center_crop(dlua_tf_scratch_t *s, dlua_tf_view_t *v, int ch, int cw) {
  if (ch <= v->h && cw <= v->w) {
    *v = crop(*v, pyround((v->h - ch) / 2.0), pyround((v->w - cw) / 2.0), ch, cw);
    return DLUA_OK;
  }
  // Larger than the image: torchvision pads with zeros ((crop - size) // 2 before), then crops.
  int k;
  uint8_t *dst = other_buffer(s, v, (size_t)ch * cw * v->c, &k);
  if (!dst) return DLUA_ERR(DLUA_ERR_OOM, "CenterCrop: out of memory for a %dx%d image", cw, ch);
  memset(dst, 0, (size_t)ch * cw * v->c);
  int oy = ch > v->h ? (ch - v->h) / 2 : -pyround((v->h - ch) / 2.0);
  int ox = cw > v->w ? (cw - v->w) / 2 : -pyround((v->w - cw) / 2.0);
  for (int y = 0; y < ch; y++) {
    int sy = y - oy;
    if (sy < 0 || sy >= v->h) continue;
    for (int x = 0; x < cw; x++) {
      int sx = x - ox;
      if (sx < 0 || sx >= v->w) continue;
      int px = v->flip ? v->w - 1 - sx : sx;
      memcpy(dst + ((size_t)y * cw + x) * v->c, v->p + (ptrdiff_t)sy * v->stride + (ptrdiff_t)px * v->c, (size_t)v->c);
    }
  }
  v->p = dst;
  v->h = v->lh = ch;
  v->w = v->lw = cw;
  v->stride = (ptrdiff_t)cw * v->c;
  v->flip = 0;
  return DLUA_OK;
}

/* The final write: ToTensor (and the folded Normalize) or the raw 8-bit pixels. */
DLUA_TF_HOT static void store(const dlua_pipeline_t *p, const dlua_tf_view_t *v, void *dst) {
  const int H = v->h, W = v->w, C = v->c;
  if (p->out_dtype == DLUA_DTYPE_F32) {
    float lut[DLUA_TF_MAX_CHANNELS][256];
    for (int c = 0; c < C; c++) {
      for (int i = 0; i < 256; i++) lut[c][i] = (float)(i * p->a[c] + p->b[c]);
    }
    float *o = dst;
#ifdef DLUA_TF_AVX2
    if (C == 3 && p->layout == 0 && have_avx2()) {
      store_chw3_avx2((const float(*)[256])lut, v->p, v->stride, H, W, v->flip, o);
      return;
    }
#endif
    for (int y = 0; y < H; y++) {
      const uint8_t *row = v->p + (ptrdiff_t)y * v->stride;
      if (p->layout == 0) {
        for (int c = 0; c < C; c++) {
          float *oc = o + ((size_t)c * H + y) * W;
          const float *l = lut[c];
          if (v->flip)
            for (int x = 0; x < W; x++) oc[x] = l[row[(W - 1 - x) * C + c]];
          else
            for (int x = 0; x < W; x++) oc[x] = l[row[x * C + c]];
        }
      } else {
        float *oy = o + (size_t)y * W * C;
        for (int x = 0; x < W; x++) {
          const uint8_t *px = row + (v->flip ? W - 1 - x : x) * C;
          for (int c = 0; c < C; c++) oy[x * C + c] = lut[c][px[c]];
        }
      }
    }
  } else {
    uint8_t *o = dst;
    for (int y = 0; y < H; y++) {
      const uint8_t *row = v->p + (ptrdiff_t)y * v->stride;
      if (p->layout == 0) {
        for (int c = 0; c < C; c++) {
          uint8_t *oc = o + ((size_t)c * H + y) * W;
          for (int x = 0; x < W; x++) oc[x] = row[(v->flip ? W - 1 - x : x) * C + c];
        }
      } else if (!v->flip) {
        memcpy(o + (size_t)y * W * C, row, (size_t)W * C);
      } else {
        for (int x = 0; x < W; x++) memcpy(o + ((size_t)y * W + x) * C, row + (W - 1 - x) * C, (size_t)C);
      }
    }
  }
}

dlua_status_t dlua_tf_run(const dlua_pipeline_t *p, dlua_tf_scratch_t *s, const dlua_tf_key_t *key, dlua_tf_view_t v,
                          void *dst, int eh, int ew, int *oh, int *ow) {
  if (v.c < 1 || v.c > DLUA_TF_MAX_CHANNELS)
    return DLUA_ERR(DLUA_ERR_ARG, "transforms: images need 1..%d channels, got %d", DLUA_TF_MAX_CHANNELS, v.c);
  if (p->nnorm > 1 && p->nnorm != v.c)
    return DLUA_ERR(DLUA_ERR_ARG, "Normalize: %d means/stds for an image of %d channels", p->nnorm, v.c);
  if (v.lh <= 0 || v.lw <= 0) {
    v.lh = v.h;
    v.lw = v.w;
  }
  for (int i = 0; i < p->n; i++) {
    const dlua_transform_t *t = &p->ops[i];
    switch (t->kind) {
      case DLUA_TF_RANDOM_RESIZED_CROP: {
        int box[4];
        dlua_transform_rrc_box(t->scale, t->ratio, v.lh, v.lw, key->seed, key->epoch, key->sample, i, box);
        DLUA_TRY(region_check(&v, "RandomResizedCrop", box));
        if (v.lh != v.h || v.lw != v.w) {
          // Drawn on the full-size image, applied to its DCT-scaled decode.
          double fy = (double)v.h / v.lh, fx = (double)v.w / v.lw;
          int y0 = (int)floor(box[0] * fy), x0 = (int)floor(box[1] * fx);
          int bh = (int)lround(box[2] * fy), bw = (int)lround(box[3] * fx);
          if (bh < 1) bh = 1;
          if (bw < 1) bw = 1;
          if (y0 + bh > v.h) y0 = v.h - bh;
          if (x0 + bw > v.w) x0 = v.w - bw;
          box[0] = y0 < 0 ? 0 : y0;
          box[1] = x0 < 0 ? 0 : x0;
          box[2] = bh > v.h ? v.h : bh;
          box[3] = bw > v.w ? v.w : bw;
        }
        v = crop(v, box[0], box[1], box[2], box[3]);
        DLUA_TRY(resize_to(s, &v, t->h, t->w));
        break;
      }
      case DLUA_TF_RESIZE: {
        int nh, nw;
        DLUA_TRY(region_check(&v, "Resize", NULL));
        resize_hw(t, v.lh, v.lw, &nh, &nw);
        v.lh = v.h;
        v.lw = v.w;
        DLUA_TRY(resize_to(s, &v, nh, nw));
        break;
      }
      case DLUA_TF_CENTER_CROP:
        DLUA_TRY(region_check(&v, "CenterCrop", NULL));
        DLUA_TRY(center_crop(s, &v, t->h, t->w));
        break;
      case DLUA_TF_HFLIP:
        if (dlua_transform_flip_draw(t->p, key->seed, key->epoch, key->sample, i)) v.flip = !v.flip;
        break;
      default: break;  // ToTensor and Normalize are folded into the store
    }
  }
  DLUA_TRY(region_check(&v, "the output", NULL));
  if (oh) *oh = v.h;
  if (ow) *ow = v.w;
  if (eh >= 0 && (v.h != eh || v.w != ew))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "transforms: sample %" PRId64 " came out %dx%d, the batch holds %dx%d images (end the transforms "
                    "with a fixed size: RandomResizedCrop, CenterCrop or Resize{h, w})",
                    key->sample + 1, v.w, v.h, ew, eh);
  if (dst) store(p, &v, dst);
  return DLUA_OK;
}

dlua_status_t dlua_pipeline_apply(dlua_tensor_t **out, const dlua_pipeline_t *p, const dlua_tensor_t *img, uint64_t seed,
                                  uint64_t epoch, int64_t sample) {
  static const char op[] = "transform";
  char b[160];
  if (!out || !p) return DLUA_ERR(DLUA_ERR_ARG, "%s: out or pipeline is NULL", op);
  *out = NULL;
  if (!img) return DLUA_ERR(DLUA_ERR_ARG, "%s: image is NULL", op);
  DLUA_TRY(dlua_require_cpu(op, img));
  if (img->ndim != 3 || img->dtype != DLUA_DTYPE_U8 || img->sizes[2] < 1 || img->sizes[2] > DLUA_TF_MAX_CHANNELS ||
      img->sizes[0] < 1 || img->sizes[1] < 1 || img->sizes[0] > 65535 || img->sizes[1] > 65535)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a uint8 image (H, W, C) with 1..%d channels, got %s", op,
                    DLUA_TF_MAX_CHANNELS, dlua_tensor_describe(img, b, sizeof b));
  dlua_tensor_t *c = NULL;
  DLUA_TRY(dlua_tensor_contiguous(&c, img));
  dlua_tf_view_t v = {(const uint8_t *)dlua_tensor_ptr(c), (int)c->sizes[0], (int)c->sizes[1], (int)c->sizes[2],
                      (ptrdiff_t)(c->sizes[1] * c->sizes[2]), 0, 0, 0, 0, 0, 0, 0};
  dlua_tf_scratch_t s = {0};
  dlua_tf_key_t key = {seed, epoch, sample};
  int oh = 0, ow = 0;
  dlua_status_t st = dlua_tf_run(p, &s, &key, v, NULL, -1, -1, &oh, &ow);
  if (st == DLUA_OK) {
    // (C, H, W) either way; channels-last memory is (H, W, C) bytes seen with strides (1, W*C, C).
    int64_t sz[3] = {v.c, oh, ow}, hwc[3] = {oh, ow, v.c};
    if (p->layout == 0) {
      st = dlua_tensor_empty(out, 3, sz, (dlua_dtype_t)p->out_dtype, DLUA_CPU);
    } else {
      dlua_tensor_t *t = NULL;
      static const int chw[3] = {2, 0, 1};
      st = dlua_tensor_empty(&t, 3, hwc, (dlua_dtype_t)p->out_dtype, DLUA_CPU);
      if (st == DLUA_OK) st = dlua_tensor_permute(out, t, chw);
      dlua_tensor_free(t);
    }
    if (st == DLUA_OK) st = dlua_tf_run(p, &s, &key, v, dlua_tensor_data(*out), oh, ow, NULL, NULL);
    if (st != DLUA_OK) {
      dlua_tensor_free(*out);
      *out = NULL;
    }
  }
  dlua_tf_scratch_free(&s);
  dlua_tensor_free(c);
  return st;
}

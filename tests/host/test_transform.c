/* Check suite for host/data/transform.c: RandomResizedCrop boxes and flips against an independent recomputation of the documented Philox rule, Pillow's bilinear resize by hand and against a plain rewrite of Pillow's resampler on many shapes (the vectorised paths), region views, CenterCrop offsets and padding, ToTensor/Normalize values. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "data/transform.h"

#include "testutil.h"

/* The documented draw: Philox keyed by the seed at (sample lo, sample hi, epoch lo, 0x54460000 ^ pos << 8 ^ block). */
static void spec_block(uint64_t seed, uint64_t epoch, int64_t sample, int pos, int block, uint32_t r[4]) {
  uint32_t ctr[4] = {(uint32_t)sample, (uint32_t)((uint64_t)sample >> 32), (uint32_t)epoch,
                     0x54460000u ^ ((uint32_t)pos << 8) ^ (uint32_t)block};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  dlua_philox4x32_10(ctr, key, r);
}

/* torchvision's RandomResizedCrop.get_params with those draws, written out again. */
static void spec_box(double s0, double s1, double r0, double r1, int H, int W, uint64_t seed, uint64_t epoch,
                     int64_t sample, int pos, int box[4]) {
  for (int a = 0; a < 10; a++) {
    uint32_t r[4];
    spec_block(seed, epoch, sample, pos, a, r);
    double area = (double)H * W * (s0 + (s1 - s0) * (r[0] / 4294967296.0));
    double logr = log(r0) + (log(r1) - log(r0)) * (r[1] / 4294967296.0);
    double ar = exp(logr);
    double fw = sqrt(area * ar), fh = sqrt(area / ar);
    int w = (int)nearbyint(fw), h = (int)nearbyint(fh);
    if (w > 0 && w <= W && h > 0 && h <= H) {
      box[0] = (int)(((uint64_t)r[2] * (uint64_t)(H - h + 1)) >> 32);
      box[1] = (int)(((uint64_t)r[3] * (uint64_t)(W - w + 1)) >> 32);
      box[2] = h;
      box[3] = w;
      return;
    }
  }
  double in_ratio = (double)W / H;
  int w = W, h = H;
  if (in_ratio < r0)
    h = (int)nearbyint(w / r0);
  else if (in_ratio > r1)
    w = (int)nearbyint(h * r1);
  box[0] = (H - h) / 2;
  box[1] = (W - w) / 2;
  box[2] = h;
  box[3] = w;
}

START_TEST(test_rrc_boxes_follow_the_rule) {
  const double scale[2] = {0.08, 1.0}, ratio[2] = {3.0 / 4, 4.0 / 3};
  const int sizes[][2] = {{375, 500}, {500, 375}, {224, 224}, {17, 301}, {1, 1}};
  int checked = 0, distinct = 0, prev_top = -1;
  for (int si = 0; si < 5; si++)
    for (int64_t sample = 0; sample < 200; sample += 7)
      for (uint64_t epoch = 1; epoch <= 3; epoch++) {
        int got[4], want[4];
        int H = sizes[si][0], W = sizes[si][1];
        dlua_transform_rrc_box(scale, ratio, H, W, 42, epoch, sample, 2, got);
        spec_box(scale[0], scale[1], ratio[0], ratio[1], H, W, 42, epoch, sample, 2, want);
        ck_assert_msg(!memcmp(got, want, sizeof got), "%dx%d sample %lld epoch %llu: box (%d %d %d %d), expected (%d %d %d %d)",
                      W, H, (long long)sample, (unsigned long long)epoch, got[0], got[1], got[2], got[3], want[0],
                      want[1], want[2], want[3]);
        ck_assert(got[0] >= 0 && got[1] >= 0 && got[2] >= 1 && got[3] >= 1 && got[0] + got[2] <= H && got[1] + got[3] <= W);
        distinct += got[0] != prev_top;
        prev_top = got[0];
        checked++;
      }
  ck_assert_int_gt(distinct, checked / 3);  // the draws vary with sample and epoch
  // The fallback: a ratio no crop of a square can meet gives torchvision's central crop.
  const double odd_ratio[2] = {5.0, 6.0}, big[2] = {0.9, 1.0};
  int got[4];
  dlua_transform_rrc_box(big, odd_ratio, 100, 100, 1, 1, 0, 0, got);
  ck_assert_int_eq(got[3], 100);
  ck_assert_int_eq(got[2], 20);  // round(100 / 5)
  ck_assert_int_eq(got[0], 40);
  ck_assert_int_eq(got[1], 0);
  // The position keeps two random transforms of one list apart.
  int a[4], b[4];
  dlua_transform_rrc_box(scale, ratio, 375, 500, 7, 1, 3, 0, a);
  dlua_transform_rrc_box(scale, ratio, 375, 500, 7, 1, 3, 1, b);
  ck_assert(memcmp(a, b, sizeof a) != 0);
}
END_TEST

START_TEST(test_flip_draw_follows_the_rule) {
  int flips = 0;
  for (int64_t s = 0; s < 400; s++) {
    uint32_t r[4];
    spec_block(9, 4, s, 3, 0, r);
    int want = r[0] / 4294967296.0 < 0.5;
    ck_assert_int_eq(dlua_transform_flip_draw(0.5, 9, 4, s, 3), want);
    flips += want;
    ck_assert_int_eq(dlua_transform_flip_draw(0.0, 9, 4, s, 3), 0);
    ck_assert_int_eq(dlua_transform_flip_draw(1.0, 9, 4, s, 3), 1);
  }
  ck_assert(flips > 150 && flips < 250);
}
END_TEST

static dlua_pipeline_t *pipe_of(const dlua_transform_t *ops, int n) {
  dlua_pipeline_t *p = NULL;
  dlua_status_t s = dlua_pipeline_new(&p, ops, n);
  ck_assert_msg(s == DLUA_OK, "%s", dlua_last_error());
  return p;
}

static dlua_tensor_t *image(int h, int w, int c, const uint8_t *v) {
  int64_t sz[3] = {h, w, c};
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, 3, sz, DLUA_DTYPE_U8, v), DLUA_OK);
  return t;
}

static dlua_tensor_t *apply(const dlua_pipeline_t *p, const dlua_tensor_t *img, int64_t sample) {
  dlua_tensor_t *out = NULL;
  dlua_status_t s = dlua_pipeline_apply(&out, p, img, 5, 1, sample);
  ck_assert_msg(s == DLUA_OK, "%s", dlua_last_error());
  return out;
}

START_TEST(test_resize_matches_pillow_by_hand) {
  // 4x1 -> 2x1, one channel: Pillow's bilinear support widens to 2 when shrinking by 2,
  // taps (3/7, 3/7, 1/7) and (1/7, 3/7, 3/7): 500/7 = 71.4 -> 71, 820/7 = 117.1 -> 117.
  const uint8_t row[4] = {0, 100, 200, 40};
  dlua_tensor_t *img = image(1, 4, 1, row);
  dlua_transform_t ops[2] = {{.kind = DLUA_TF_RESIZE, .h = 1, .w = 2}, {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_U8, .layout = 1}};
  dlua_pipeline_t *p = pipe_of(ops, 2);
  dlua_tensor_t *o = apply(p, img, 0);
  const uint8_t *q = dlua_tensor_data(o);
  // (C, H, W) = (1, 1, 2) over channels-last memory: strides (1, W*C, C)
  ck_assert(o->sizes[0] == 1 && o->sizes[1] == 1 && o->sizes[2] == 2);
  ck_assert(o->strides[0] == 1 && o->strides[1] == 2 && o->strides[2] == 1);
  ck_assert_int_eq(q[0], 71);
  ck_assert_int_eq(q[1], 117);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
  // 2x1 -> 4x1 (enlarging: support 1): 0, 25, 75, 100.
  const uint8_t two[2] = {0, 100};
  img = image(1, 2, 1, two);
  ops[0].w = 4;
  p = pipe_of(ops, 2);
  o = apply(p, img, 0);
  q = dlua_tensor_data(o);
  ck_assert(q[0] == 0 && q[1] == 25 && q[2] == 75 && q[3] == 100);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
  // Vertical: the same numbers down a column, 3 channels; shorter-side Resize(n).
  uint8_t col[4 * 3];
  for (int i = 0; i < 4; i++) col[3 * i] = col[3 * i + 1] = col[3 * i + 2] = row[i];
  img = image(4, 1, 3, col);
  ops[0] = (dlua_transform_t){.kind = DLUA_TF_RESIZE, .h = 1, .w = 0};  // shorter side (w = 1) stays 1: int(1 * 4 / 1) = 4 rows
  p = pipe_of(ops, 2);
  o = apply(p, img, 0);
  ck_assert(o->sizes[0] == 3 && o->sizes[1] == 4 && o->sizes[2] == 1);
  ck_assert(o->strides[0] == 1 && o->strides[1] == 3 && o->strides[2] == 3);
  ck_assert_int_eq(memcmp(dlua_tensor_data(o), col, sizeof col), 0);  // same size: a copy
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  ops[0] = (dlua_transform_t){.kind = DLUA_TF_RESIZE, .h = 2, .w = 1};
  p = pipe_of(ops, 2);
  o = apply(p, img, 0);
  q = dlua_tensor_data(o);
  ck_assert(q[0] == 71 && q[1] == 71 && q[2] == 71 && q[3] == 117 && q[5] == 117);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
  // torchvision's shorter-side sizes: 500x375 -> Resize(256) -> 341x256; 375x500 -> 256x341.
  dlua_transform_t r256 = {.kind = DLUA_TF_RESIZE, .h = 256, .w = 0};
  p = pipe_of(&r256, 1);
  int oh, ow;
  dlua_tf_output_hw(p, 375, 500, &oh, &ow);
  ck_assert(oh == 256 && ow == 341);
  dlua_tf_output_hw(p, 500, 375, &oh, &ow);
  ck_assert(oh == 341 && ow == 256);
  dlua_tf_output_hw(p, -1, -1, &oh, &ow);
  ck_assert(oh == -1 && ow == -1);
  dlua_pipeline_free(p);
}
END_TEST

/* Pillow's ImagingResample (bilinear, 8 bits) written out plainly: per output the window
   [xmin, xmin + n) with normalised weights in 22-bit fixed point, horizontal pass first over
   every row, then vertical; no window sliding, no vector code. */
static void pil_coeffs(int in, int out, int *xmin, int *n, int32_t *k, int ksize_max) {
  double scale = (double)in / out, fs = scale < 1 ? 1 : scale, support = fs;
  for (int xx = 0; xx < out; xx++) {
    double center = (xx + 0.5) * scale, ww = 0, w[300];
    int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
    if (lo < 0) lo = 0;
    if (hi > in) hi = in;
    ck_assert(hi - lo <= ksize_max && hi - lo <= 300);
    for (int x = lo; x < hi; x++) {
      double t = fabs((x - center + 0.5) / fs);
      w[x - lo] = t < 1 ? 1 - t : 0;
      ww += w[x - lo];
    }
    for (int x = 0; x < hi - lo; x++) {
      double v = ww != 0 ? w[x] / ww : w[x];
      k[xx * ksize_max + x] = (int32_t)(v < 0 ? -0.5 + v * (1 << 22) : 0.5 + v * (1 << 22));
    }
    xmin[xx] = lo;
    n[xx] = hi - lo;
  }
}

static uint8_t pil_clip(int64_t v) { return v <= 0 ? 0 : v >= (255LL << 22) ? 255 : (uint8_t)(v >> 22); }

static void pil_resize(const uint8_t *src, ptrdiff_t stride, int h, int w, int c, uint8_t *dst, int oh, int ow) {
  enum { KM = 300 };
  int *xmin = malloc(sizeof(int) * (ow + oh)), *xn = malloc(sizeof(int) * (ow + oh));
  int32_t *k = malloc(sizeof(int32_t) * KM * (ow + oh));
  uint8_t *mid = malloc((size_t)h * ow * c);
  if (ow != w) {
    pil_coeffs(w, ow, xmin, xn, k, KM);
    for (int y = 0; y < h; y++)
      for (int x = 0; x < ow; x++)
        for (int ch = 0; ch < c; ch++) {
          int64_t a = 1 << 21;
          for (int t = 0; t < xn[x]; t++) a += (int64_t)src[y * stride + (xmin[x] + t) * c + ch] * k[x * KM + t];
          mid[((size_t)y * ow + x) * c + ch] = pil_clip(a);
        }
  } else {
    for (int y = 0; y < h; y++) memcpy(mid + (size_t)y * w * c, src + y * stride, (size_t)w * c);
  }
  if (oh != h) {
    pil_coeffs(h, oh, xmin, xn, k, KM);
    for (int y = 0; y < oh; y++)
      for (int i = 0; i < ow * c; i++) {
        int64_t a = 1 << 21;
        for (int t = 0; t < xn[y]; t++) a += (int64_t)mid[(size_t)(xmin[y] + t) * ow * c + i] * k[y * KM + t];
        dst[(size_t)y * ow * c + i] = pil_clip(a);
      }
  } else {
    memcpy(dst, mid, (size_t)h * ow * c);
  }
  free(mid);
  free(k);
  free(xn);
  free(xmin);
}

START_TEST(test_resize_matches_plain_pillow_on_many_shapes) {
  // Parent images with noise (every byte value), crops of them as views with the parent's
  // stride; outputs that shrink by 1..10x (3..23 taps), enlarge, or keep one side; 1, 3 and 4
  // channels; widths that leave vector tails.
  enum { PH = 97, PW = 131 };
  uint8_t *parent = malloc(PH * PW * 4);
  uint32_t z = 99;
  for (int i = 0; i < PH * PW * 4; i++) {
    z = z * 1664525u + 1013904223u;
    parent[i] = (uint8_t)(z >> 24);
  }
  static const int cases[][6] = {
      // crop y, x, h, w; out h, w
      {0, 0, 97, 131, 40, 55},   {3, 5, 90, 120, 45, 60},  {10, 7, 60, 77, 31, 33},  {1, 2, 95, 128, 13, 17},
      {0, 0, 97, 131, 97, 37},   {0, 0, 97, 131, 11, 131}, {5, 9, 33, 50, 66, 100},  {2, 2, 7, 9, 40, 36},
      {20, 30, 41, 59, 41, 59},  {0, 0, 96, 130, 9, 13},   {4, 4, 80, 120, 224, 224}, {0, 1, 97, 130, 95, 127},
      {6, 3, 88, 121, 1, 1},     {0, 0, 97, 131, 3, 5},    {7, 11, 50, 70, 49, 69},  {0, 0, 60, 131, 60, 12}};
  dlua_tf_scratch_t sc = {0};
  int checked = 0;
  for (int c = 1; c <= 4; c++) {
    if (c == 2) continue;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      const int *k = cases[i];
      ptrdiff_t stride = (ptrdiff_t)PW * c;
      const uint8_t *p = parent + k[0] * stride + k[1] * c;
      int oh = k[4], ow = k[5];
      uint8_t *got = malloc((size_t)oh * ow * c), *want = malloc((size_t)oh * ow * c);
      pil_resize(p, stride, k[2], k[3], c, want, oh, ow);
      dlua_tf_view_t v = {p, k[2], k[3], c, stride, 0, k[2], k[3], 0, 0, 0, 0};
      ck_assert_int_eq(dlua_tf_resize(&sc, v, got, oh, ow), DLUA_OK);
      for (size_t j = 0; j < (size_t)oh * ow * c; j++)
        ck_assert_msg(got[j] == want[j], "%d channels, %dx%d crop at (%d, %d) -> %dx%d: byte %zu is %d, Pillow %d", c,
                      k[3], k[2], k[0], k[1], ow, oh, j, got[j], want[j]);
      checked++;
      free(got);
      free(want);
    }
  }
  ck_assert_int_eq(checked, 48);
  // The last rows of a buffer that ends right after them: the vector loops must not read past it.
  const int h = 5, w = 40;
  uint8_t *tight = malloc(h * w * 3), *got = malloc(3 * 16 * 3), *want = malloc(3 * 16 * 3);
  memcpy(tight, parent, h * w * 3);
  pil_resize(tight, w * 3, h, w, 3, want, 3, 16);
  dlua_tf_view_t v = {tight, h, w, 3, w * 3, 0, h, w, 0, 0, 0, 0};
  ck_assert_int_eq(dlua_tf_resize(&sc, v, got, 3, 16), DLUA_OK);
  ck_assert_int_eq(memcmp(got, want, 3 * 16 * 3), 0);
  free(tight);
  free(got);
  free(want);
  dlua_tf_scratch_free(&sc);
  free(parent);
}
END_TEST

START_TEST(test_region_view_equals_whole_image) {
  // The loader's crop decode hands dlua_tf_run only the block the first crop needs; the
  // result must be the whole image's, with and without a flip before the crop.
  enum { H = 90, W = 120 };
  uint8_t *img = malloc(H * W * 3);
  for (int i = 0; i < H * W * 3; i++) img[i] = (uint8_t)(i * 13 + i / 7);
  dlua_transform_t ops[5] = {{.kind = DLUA_TF_HFLIP, .p = 0.5},
                             {.kind = DLUA_TF_RANDOM_RESIZED_CROP, .h = 24, .w = 20, .scale = {0.08, 1}, .ratio = {0.75, 4.0 / 3}},
                             {.kind = DLUA_TF_HFLIP, .p = 0.5},
                             {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32},
                             {.kind = DLUA_TF_NORMALIZE, .n = 3, .mean = {0.4, 0.5, 0.6}, .std = {0.2, 0.3, 0.4}}};
  dlua_pipeline_t *p = pipe_of(ops, 5);
  dlua_tf_scratch_t sc = {0};
  float *a = malloc(sizeof(float) * 3 * 24 * 20), *b = malloc(sizeof(float) * 3 * 24 * 20);
  uint8_t *block = malloc(H * W * 3);
  int flipped = 0, regions = 0;
  for (int64_t sample = 0; sample < 60; sample++) {
    dlua_tf_key_t key = {3, 2, sample};
    dlua_tf_view_t whole = {img, H, W, 3, W * 3, 0, H, W, 0, 0, 0, 0};
    ck_assert_int_eq(dlua_tf_run(p, &sc, &key, whole, a, 24, 20, NULL, NULL), DLUA_OK);
    int box[4];
    if (!dlua_tf_plan_region(p, &key, H, W, box)) continue;
    regions++;
    flipped += dlua_transform_flip_draw(0.5, 3, 2, sample, 0);
    // Exactly the box, copied out: nothing outside it may be read.
    for (int y = 0; y < box[2]; y++) memcpy(block + (size_t)y * box[3] * 3, img + ((box[0] + y) * W + box[1]) * 3, box[3] * 3);
    dlua_tf_view_t part = {block, H, W, 3, box[3] * 3, 0, H, W, box[0], box[1], box[2], box[3]};
    ck_assert_int_eq(dlua_tf_run(p, &sc, &key, part, b, 24, 20, NULL, NULL), DLUA_OK);
    ck_assert_msg(!memcmp(a, b, sizeof(float) * 3 * 24 * 20), "sample %d: region result differs", (int)sample);
  }
  ck_assert_int_ge(regions, 50);
  ck_assert(flipped > 5 && flipped < regions - 5);
  // A region that misses the crop is refused, not read out of bounds.
  dlua_tf_key_t key = {3, 2, 0};
  int box[4];
  ck_assert(dlua_tf_plan_region(p, &key, H, W, box));
  dlua_tf_view_t wrong = {block, H, W, 3, 3, 0, H, W, 0, 0, 1, 1};
  ck_assert_int_eq(dlua_tf_run(p, &sc, &key, wrong, b, 24, 20, NULL, NULL), DLUA_ERR_INTERNAL);
  // No region when a Resize comes first.
  dlua_transform_t rs[2] = {{.kind = DLUA_TF_RESIZE, .h = 40, .w = 0}, {.kind = DLUA_TF_CENTER_CROP, .h = 20, .w = 20}};
  dlua_pipeline_t *q = pipe_of(rs, 2);
  ck_assert(!dlua_tf_plan_region(q, &key, H, W, box));
  dlua_pipeline_free(q);
  free(block);
  free(a);
  free(b);
  dlua_tf_scratch_free(&sc);
  dlua_pipeline_free(p);
  free(img);
}
END_TEST

START_TEST(test_to_tensor_wide_rgb_rows) {
  // Rows of 8-pixel steps plus tails (the vectorised store), mirrored or not, against
  // (x / 255 - mean) / std per pixel; NCHW and NHWC must hold the same values.
  static const int widths[] = {1, 7, 8, 9, 16, 21, 40};
  const double m[3] = {0.485, 0.456, 0.406}, sd[3] = {0.229, 0.224, 0.225};
  for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
    const int H = 5, W = widths[wi];
    uint8_t *v = malloc(H * W * 3);
    for (int i = 0; i < H * W * 3; i++) v[i] = (uint8_t)(i * 37 + i / 5);
    dlua_tensor_t *img = image(H, W, 3, v);
    for (int flip = 0; flip <= 1; flip++) {
      dlua_transform_t ops[3] = {{.kind = DLUA_TF_HFLIP, .p = flip},
                                 {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32},
                                 {.kind = DLUA_TF_NORMALIZE, .n = 3, .mean = {m[0], m[1], m[2]}, .std = {sd[0], sd[1], sd[2]}}};
      dlua_pipeline_t *p = pipe_of(ops, 3);
      dlua_tensor_t *o = apply(p, img, 0);
      ops[1].layout = 1;
      dlua_pipeline_t *q = pipe_of(ops, 3);
      dlua_tensor_t *o2 = apply(q, img, 0);
      const float *f = dlua_tensor_data(o), *g = dlua_tensor_data(o2);
      for (int c = 0; c < 3; c++)
        for (int y = 0; y < H; y++)
          for (int x = 0; x < W; x++) {
            int sx = flip ? W - 1 - x : x;
            double want = (v[(y * W + sx) * 3 + c] / 255.0 - m[c]) / sd[c];
            float got = f[(c * H + y) * W + x];
            ck_assert_msg(fabs(got - want) < 1e-5, "width %d flip %d (%d, %d, %d): %g, expected %g", W, flip, c, y, x, got,
                          want);
            ck_assert_msg(got == g[(y * W + x) * 3 + c], "width %d: NCHW and NHWC differ at (%d, %d, %d)", W, c, y, x);
          }
      dlua_tensor_free(o);
      dlua_tensor_free(o2);
      dlua_pipeline_free(p);
      dlua_pipeline_free(q);
    }
    dlua_tensor_free(img);
    free(v);
  }
}
END_TEST

START_TEST(test_center_crop_flip_to_tensor_normalize) {
  // 5x7 single-channel image, v(y, x) = 10 y + x.
  uint8_t v[5 * 7];
  for (int y = 0; y < 5; y++)
    for (int x = 0; x < 7; x++) v[y * 7 + x] = (uint8_t)(10 * y + x);
  dlua_tensor_t *img = image(5, 7, 1, v);
  // CenterCrop 2x2: top = round(1.5) = 2, left = round(2.5) = 2 (half to even).
  dlua_transform_t ops[3] = {{.kind = DLUA_TF_CENTER_CROP, .h = 2, .w = 2},
                             {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_U8}};
  dlua_pipeline_t *p = pipe_of(ops, 2);
  dlua_tensor_t *o = apply(p, img, 0);
  const uint8_t *q = dlua_tensor_data(o);
  ck_assert(q[0] == 22 && q[1] == 23 && q[2] == 32 && q[3] == 33);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  // Larger than the image: zero padding, (crop - size) // 2 before: 7x9 around 5x7 -> 1 row, 1 column.
  ops[0] = (dlua_transform_t){.kind = DLUA_TF_CENTER_CROP, .h = 7, .w = 9};
  p = pipe_of(ops, 2);
  o = apply(p, img, 0);
  q = dlua_tensor_data(o);
  ck_assert_int_eq(o->sizes[1], 7);
  ck_assert_int_eq(o->sizes[2], 9);
  ck_assert_int_eq(q[0], 0);
  ck_assert_int_eq(q[1 * 9 + 1], 0);   // v(0, 0) = 0 as well: check a non-zero one
  ck_assert_int_eq(q[2 * 9 + 3], 12);  // v(1, 2)
  ck_assert_int_eq(q[6 * 9 + 8], 0);
  ck_assert_int_eq(q[5 * 9 + 7], 46);  // v(4, 6)
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  // Flip (p = 1) then CenterCrop 3x3, then float ToTensor and Normalize(mean 0.5, std 0.25):
  // out(y, x) = (v(1 + y, 6 - (2 + x)) / 255 - 0.5) / 0.25.
  dlua_transform_t ops3[4] = {{.kind = DLUA_TF_HFLIP, .p = 1.0},
                              {.kind = DLUA_TF_CENTER_CROP, .h = 3, .w = 3},
                              {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32},
                              {.kind = DLUA_TF_NORMALIZE, .n = 1, .mean = {0.5}, .std = {0.25}}};
  p = pipe_of(ops3, 4);
  o = apply(p, img, 0);
  ck_assert_int_eq(o->dtype, DLUA_DTYPE_F32);
  ck_assert(o->sizes[0] == 1 && o->sizes[1] == 3 && o->sizes[2] == 3);
  const float *f = dlua_tensor_data(o);
  for (int y = 0; y < 3; y++)
    for (int x = 0; x < 3; x++) {
      double want = ((10 * (1 + y) + (6 - (2 + x))) / 255.0 - 0.5) / 0.25;
      ck_assert_msg(fabs(f[y * 3 + x] - want) < 1e-5, "(%d, %d): %g, expected %g", y, x, f[y * 3 + x], want);
    }
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
  // Per-channel statistics, NCHW vs NHWC of a 3-channel image.
  uint8_t rgb[2 * 2 * 3] = {0, 51, 102, 153, 204, 255, 10, 20, 30, 40, 50, 60};
  img = image(2, 2, 3, rgb);
  dlua_transform_t ops4[2] = {{.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32, .layout = 0},
                              {.kind = DLUA_TF_NORMALIZE, .n = 3, .mean = {0.1, 0.2, 0.3}, .std = {0.5, 2.0, 4.0}}};
  p = pipe_of(ops4, 2);
  o = apply(p, img, 0);
  f = dlua_tensor_data(o);
  const double m[3] = {0.1, 0.2, 0.3}, sd[3] = {0.5, 2.0, 4.0};
  for (int c = 0; c < 3; c++)
    for (int i = 0; i < 4; i++) {
      double want = (rgb[i * 3 + c] / 255.0 - m[c]) / sd[c];
      ck_assert(fabs(f[c * 4 + i] - want) < 1e-5);
    }
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  ops4[0].layout = 1;
  p = pipe_of(ops4, 2);
  o = apply(p, img, 0);
  ck_assert(o->sizes[0] == 3 && o->sizes[1] == 2 && o->sizes[2] == 2);  // (C, H, W) over (H, W, C) memory
  ck_assert(o->strides[0] == 1 && o->strides[1] == 6 && o->strides[2] == 3);
  f = dlua_tensor_data(o);
  for (int i = 0; i < 12; i++) ck_assert(fabs(f[i] - (rgb[i] / 255.0 - m[i % 3]) / sd[i % 3]) < 1e-5);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
}
END_TEST

START_TEST(test_rrc_applies_its_box) {
  // RandomResizedCrop to the box's own size is a pure crop: compare with the box drawn.
  enum { H = 40, W = 60 };
  uint8_t v[H * W * 3];
  for (int i = 0; i < H * W * 3; i++) v[i] = (uint8_t)(i * 7 + i / 11);
  dlua_tensor_t *img = image(H, W, 3, v);
  const double sc[2] = {0.25, 0.25}, ra[2] = {1.0, 1.0};  // always a 20x30-area square: 24x24 crop? sqrt(600)=24.49 -> 24
  int box[4];
  dlua_transform_rrc_box(sc, ra, H, W, 5, 1, 3, 0, box);
  ck_assert(box[2] == 24 && box[3] == 24);
  dlua_transform_t ops[2] = {{.kind = DLUA_TF_RANDOM_RESIZED_CROP, .h = 24, .w = 24, .scale = {0.25, 0.25}, .ratio = {1.0, 1.0}},
                             {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_U8, .layout = 1}};
  dlua_pipeline_t *p = pipe_of(ops, 2);
  dlua_tensor_t *o = apply(p, img, 3);  // seed 5, epoch 1, sample 3
  const uint8_t *q = dlua_tensor_data(o);
  for (int y = 0; y < 24; y++)
    for (int x = 0; x < 24; x++)
      for (int c = 0; c < 3; c++)
        ck_assert_int_eq(q[(y * 24 + x) * 3 + c], v[((box[0] + y) * W + box[1] + x) * 3 + c]);
  dlua_tensor_free(o);
  dlua_pipeline_free(p);
  dlua_tensor_free(img);
}
END_TEST

START_TEST(test_pipeline_errors) {
  dlua_pipeline_t *p = NULL;
  dlua_transform_t bad1[1] = {{.kind = DLUA_TF_NORMALIZE, .n = 1, .mean = {0}, .std = {1}}};
  tu_expect_error(dlua_pipeline_new(&p, bad1, 1), "needs a float ToTensor before it");
  dlua_transform_t bad2[2] = {{.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32}, {.kind = DLUA_TF_CENTER_CROP, .h = 2, .w = 2}};
  tu_expect_error(dlua_pipeline_new(&p, bad2, 2), "comes after ToTensor");
  dlua_transform_t bad3[1] = {{.kind = DLUA_TF_RANDOM_RESIZED_CROP, .h = 8, .w = 8, .scale = {0.5, 0.1}, .ratio = {1, 1}}};
  tu_expect_error(dlua_pipeline_new(&p, bad3, 1), "scale must be");
  dlua_transform_t bad4[2] = {{.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32}, {.kind = DLUA_TF_NORMALIZE, .n = 1, .mean = {0}, .std = {0}}};
  tu_expect_error(dlua_pipeline_new(&p, bad4, 2), "std != 0");
  ck_assert_ptr_null(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("transform");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_rrc_boxes_follow_the_rule);
  tcase_add_test(tc, test_flip_draw_follows_the_rule);
  tcase_add_test(tc, test_resize_matches_pillow_by_hand);
  tcase_add_test(tc, test_resize_matches_plain_pillow_on_many_shapes);
  tcase_add_test(tc, test_region_view_equals_whole_image);
  tcase_add_test(tc, test_to_tensor_wide_rgb_rows);
  tcase_add_test(tc, test_center_crop_flip_to_tensor_normalize);
  tcase_add_test(tc, test_rrc_applies_its_box);
  tcase_add_test(tc, test_pipeline_errors);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Check suite for host/data/image.c: JPEG/PNG fixtures encoded here with TurboJPEG and libpng, decoded pixels against the known ones, grey/CMYK/palette/16-bit/alpha conversions, DCT scaling, crop-region decodes equal to full decodes, bad files. */
#include <check.h>
#include <png.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>
#include <unistd.h>

#include "core/api.h"
#include "core/tensor.h"
#include "data/image.h"

#include "testutil.h"

/* A smooth test pattern (JPEG keeps smooth images within a few levels at quality 100). */
static uint8_t pat(int y, int x, int c) { return (uint8_t)(40 + 3 * y + 2 * x + 50 * c); }

/* JPEG bytes of `px` (h, w, ch) encoded by TurboJPEG directly (not through the library). */
static unsigned char *encode_jpeg(const uint8_t *px, int h, int w, int pf, int samp, unsigned long *len) {
  tjhandle tj = tjInitCompress();
  unsigned char *out = NULL;
  ck_assert_int_eq(tjCompress2(tj, px, w, 0, h, pf, &out, len, samp, 100, TJFLAG_ACCURATEDCT), 0);
  tjDestroy(tj);
  return out;
}

static dlua_tensor_t *decode(const void *buf, size_t len, int num, int den) {
  dlua_tensor_t *t = NULL;
  dlua_status_t s = dlua_image_decode(&t, buf, len, num, den);
  ck_assert_msg(s == DLUA_OK, "decode failed: %s", dlua_last_error());
  return t;
}

static int max_diff(const dlua_tensor_t *t, int h, int w, uint8_t (*want)(int, int, int)) {
  ck_assert_int_eq(t->ndim, 3);
  ck_assert_int_eq(t->sizes[0], h);
  ck_assert_int_eq(t->sizes[1], w);
  ck_assert_int_eq(t->sizes[2], 3);
  const uint8_t *p = dlua_tensor_data(t);
  int worst = 0;
  for (int y = 0; y < h; y++)
    for (int x = 0; x < w; x++)
      for (int c = 0; c < 3; c++) {
        int d = abs((int)p[(y * w + x) * 3 + c] - (int)want(y, x, c));
        if (d > worst) worst = d;
      }
  return worst;
}

START_TEST(test_jpeg_rgb_and_sniff) {
  enum { H = 13, W = 21 };  // not multiples of the 8x8/16x16 MCU: edge blocks matter
  uint8_t px[H * W * 3];
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) px[(y * W + x) * 3 + c] = pat(y, x, c);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg(px, H, W, TJPF_RGB, TJSAMP_444, &len);
  ck_assert_int_eq(dlua_image_sniff(jpg, len), DLUA_IMAGE_JPEG);
  dlua_tensor_t *t = decode(jpg, len, 1, 0);
  int d = max_diff(t, H, W, pat);
  ck_assert_msg(d <= 3, "RGB JPEG decoded %d levels away from the encoded pixels", d);
  dlua_tensor_free(t);
  int h = 0, w = 0;
  ck_assert_int_eq(dlua_image_peek("t", "x.jpg", jpg, len, &h, &w), DLUA_OK);
  ck_assert_int_eq(h, H);
  ck_assert_int_eq(w, W);
  tjFree(jpg);
}
END_TEST

static uint8_t grey_of(int y, int x, int c) { return pat(y, x, 0); }

START_TEST(test_jpeg_grey_becomes_rgb) {
  enum { H = 16, W = 24 };
  uint8_t px[H * W];
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++) px[y * W + x] = pat(y, x, 0);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg(px, H, W, TJPF_GRAY, TJSAMP_GRAY, &len);
  dlua_tensor_t *t = decode(jpg, len, 1, 0);
  int d = max_diff(t, H, W, grey_of);
  ck_assert_msg(d <= 2, "grey JPEG decoded %d levels away", d);
  const uint8_t *p = dlua_tensor_data(t);
  for (int i = 0; i < H * W; i++) ck_assert(p[3 * i] == p[3 * i + 1] && p[3 * i] == p[3 * i + 2]);
  dlua_tensor_free(t);
  tjFree(jpg);
}
END_TEST

/* CMYK samples as stored (inverted, Adobe style: 255 = no ink); RGB = stored C * stored K / 255, as Pillow. */
static uint8_t cmyk_c(int y, int x, int c) {
  static const int base[4] = {250, 200, 120, 230};
  return (uint8_t)(base[c] - 2 * y - x);
}
static uint8_t cmyk_rgb(int y, int x, int c) { return (uint8_t)((cmyk_c(y, x, c) * cmyk_c(y, x, 3) + 127) / 255); }

START_TEST(test_jpeg_cmyk_becomes_rgb) {
  enum { H = 16, W = 16 };
  uint8_t px[H * W * 4];
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 4; c++) px[(y * W + x) * 4 + c] = cmyk_c(y, x, c);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg(px, H, W, TJPF_CMYK, TJSAMP_444, &len);
  dlua_tensor_t *t = decode(jpg, len, 1, 0);
  int d = max_diff(t, H, W, cmyk_rgb);
  ck_assert_msg(d <= 4, "CMYK JPEG converted %d levels away from C*K/255", d);
  dlua_tensor_free(t);
  tjFree(jpg);
}
END_TEST

/* 2x2 block means of the pattern: what a 1/2 DCT-domain decode approximates. */
static uint8_t half_pat(int y, int x, int c) {
  int s = pat(2 * y, 2 * x, c) + pat(2 * y + 1, 2 * x, c) + pat(2 * y, 2 * x + 1, c) + pat(2 * y + 1, 2 * x + 1, c);
  return (uint8_t)((s + 2) / 4);
}

START_TEST(test_jpeg_dct_scaling) {
  enum { H = 32, W = 48 };
  uint8_t px[H * W * 3];
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) px[(y * W + x) * 3 + c] = pat(y, x, c);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg(px, H, W, TJPF_RGB, TJSAMP_444, &len);
  dlua_tensor_t *t = decode(jpg, len, 1, 2);
  int d = max_diff(t, H / 2, W / 2, half_pat);
  ck_assert_msg(d <= 4, "1/2-scale decode is %d levels from the 2x2 means", d);
  dlua_tensor_free(t);
  tjFree(jpg);
  // The picker: smallest factor keeping the needed size, 1/1 when none does.
  int num, den;
  dlua_image_pick_scale(375, 500, 100, 100, &num, &den);
  // 3/8: ceil(375 * 3 / 8) = 141 >= 100, while 1/4 gives ceil(375 / 4) = 94 < 100.
  ck_assert_int_eq(num, 3);
  ck_assert_int_eq(den, 8);
  dlua_image_pick_scale(375, 500, 375, 500, &num, &den);
  ck_assert_int_eq(num, 1);
  ck_assert_int_eq(den, 1);
  dlua_image_pick_scale(800, 800, 90, 90, &num, &den);
  ck_assert_int_eq(num, 1);
  ck_assert_int_eq(den, 8);
}
END_TEST

/* Textured pixels (noise on a gradient), so chroma upsampling and IDCT edges show in every block. */
static void noisy(uint8_t *px, int h, int w, int ch, unsigned seed) {
  uint32_t z = seed * 2654435761u + 1;
  for (int i = 0; i < h * w * ch; i++) {
    z = z * 1664525u + 1013904223u;
    int y = i / (w * ch), x = (i / ch) % w;
    px[i] = (uint8_t)((3 * y + 5 * x + (i % ch) * 70) % 200 + (int)(z >> 27));
  }
}

/* A JPEG like TurboJPEG's encoder writes them (progressive optional), quality 85. */
static unsigned char *encode_jpeg_q(const uint8_t *px, int h, int w, int pf, int samp, int flags, unsigned long *len) {
  tjhandle tj = tjInitCompress();
  unsigned char *out = NULL;
  ck_assert_int_eq(tjCompress2(tj, px, w, 0, h, pf, &out, len, samp, 85, flags), 0);
  tjDestroy(tj);
  return out;
}

/* Region pixels against the same rows and columns of a full decode, byte for byte. */
static void check_region(const unsigned char *jpg, unsigned long len, int H, int W, const int want[4], const char *what) {
  dlua_image_decoder_t full = {0}, part = {0};
  int h, w, got[4];
  ck_assert_int_eq(dlua_image_decode_into(&full, "t", "full.jpg", jpg, len, 1, 0, &h, &w), DLUA_OK);
  ck_assert(h == H && w == W);
  dlua_status_t st = dlua_image_decode_region(&part, "t", "part.jpg", jpg, len, want, got);
  ck_assert_msg(st == DLUA_OK, "%s: %s", what, dlua_last_error());
  ck_assert_msg(got[0] <= want[0] && got[1] <= want[1] && got[0] + got[2] >= want[0] + want[2] &&
                    got[1] + got[3] >= want[1] + want[3] && got[0] >= 0 && got[1] >= 0 && got[0] + got[2] <= H &&
                    got[1] + got[3] <= W,
                "%s: block (%d, %d) %dx%d does not hold (%d, %d) %dx%d", what, got[0], got[1], got[3], got[2], want[0],
                want[1], want[3], want[2]);
  for (int y = want[0]; y < want[0] + want[2]; y++) {
    const uint8_t *a = full.pixels + ((size_t)y * W + want[1]) * 3;
    const uint8_t *b = part.pixels + ((size_t)(y - got[0]) * got[3] + want[1] - got[1]) * 3;
    ck_assert_msg(!memcmp(a, b, (size_t)want[3] * 3), "%s: row %d of (%d, %d) %dx%d differs from a full decode", what, y,
                  want[0], want[1], want[3], want[2]);
  }
  dlua_image_decoder_free(&full);
  dlua_image_decoder_free(&part);
}

START_TEST(test_jpeg_region_equals_full_decode) {
  // Sizes that are not multiples of the MCU, every chroma subsampling, grey, progressive; boxes
  // at the corners, the edges, inside, one pixel, whole rows and columns, and many random ones.
  static const int sizes[][2] = {{61, 83}, {120, 97}, {33, 250}};
  static const struct {
    int pf, samp, flags;
    const char *name;
  } kinds[] = {{TJPF_RGB, TJSAMP_420, 0, "4:2:0"},          {TJPF_RGB, TJSAMP_422, 0, "4:2:2"},
               {TJPF_RGB, TJSAMP_444, 0, "4:4:4"},          {TJPF_RGB, TJSAMP_440, 0, "4:4:0"},
               {TJPF_RGB, TJSAMP_411, 0, "4:1:1"},          {TJPF_GRAY, TJSAMP_GRAY, 0, "grey"},
               {TJPF_RGB, TJSAMP_420, TJFLAG_PROGRESSIVE, "progressive 4:2:0"}};
  int checked = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    const int H = sizes[si][0], W = sizes[si][1];
    for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
      const int ch = kinds[ki].pf == TJPF_GRAY ? 1 : 3;
      uint8_t *px = malloc((size_t)H * W * ch);
      noisy(px, H, W, ch, (unsigned)(si * 10 + ki));
      unsigned long len = 0;
      unsigned char *jpg = encode_jpeg_q(px, H, W, kinds[ki].pf, kinds[ki].samp, kinds[ki].flags, &len);
      const int fixed[][4] = {{0, 0, 1, 1},          {H - 1, W - 1, 1, 1},     {0, W - 9, 9, 9},      {H - 7, 0, 7, 5},
                              {17, 16, 16, 16},       {16, 17, 15, 17},         {31, 33, H - 31, 1},   {0, 40, H, 3},
                              {H / 2, 0, 1, W},       {1, 1, H - 2, W - 2},     {9, 8, H - 20, W / 3}, {0, 0, H, W}};
      char what[96];
      for (size_t b = 0; b < sizeof fixed / sizeof fixed[0]; b++) {
        int box[4] = {fixed[b][0], fixed[b][1], fixed[b][2], fixed[b][3]};
        if (box[0] < 0 || box[1] < 0 || box[2] < 1 || box[3] < 1 || box[0] + box[2] > H || box[1] + box[3] > W) continue;
        snprintf(what, sizeof what, "%s %dx%d, fixed box %zu", kinds[ki].name, W, H, b);
        check_region(jpg, len, H, W, box, what);
        checked++;
      }
      uint32_t z = 12345u + (uint32_t)(si * 7 + ki);
      for (int r = 0; r < 25; r++) {
        z = z * 1664525u + 1013904223u;
        int bh = 1 + (int)((z >> 8) % (uint32_t)H), bw = 1 + (int)((z >> 20) % (uint32_t)W);
        z = z * 1664525u + 1013904223u;
        int box[4] = {(int)((z >> 8) % (uint32_t)(H - bh + 1)), (int)((z >> 20) % (uint32_t)(W - bw + 1)), bh, bw};
        snprintf(what, sizeof what, "%s %dx%d, random box %d", kinds[ki].name, W, H, r);
        check_region(jpg, len, H, W, box, what);
        checked++;
      }
      tjFree(jpg);
      free(px);
    }
  }
  ck_assert_int_ge(checked, 500);
}
END_TEST

START_TEST(test_jpeg_region_fallbacks_and_errors) {
  enum { H = 48, W = 64 };
  uint8_t px[H * W * 4];
  noisy(px, H, W, 3, 5);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg_q(px, H, W, TJPF_RGB, TJSAMP_420, 0, &len);
  dlua_image_decoder_t d = {0};
  int got[4], box[4] = {20, 20, 10, 10};
  // Trailing bytes after EOI: the whole image (a full decode), still the same pixels.
  unsigned char *tail = malloc(len + 3);
  memcpy(tail, jpg, len);
  memset(tail + len, 0, 3);
  check_region(tail, len + 3, H, W, box, "trailing bytes");
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "tail.jpg", tail, len + 3, box, got), DLUA_OK);
  ck_assert(got[0] == 0 && got[1] == 0 && got[2] == H && got[3] == W);
  // Truncated above the region: an error, as a full decode; truncated below it too (no EOI).
  int top[4] = {0, 0, 4, 4};
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "cut.jpg", jpg, len / 2, top, got), DLUA_ERR_IO);
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "cut.jpg", jpg, len / 2, box, got), DLUA_ERR_IO);
  ck_assert(tu_err_has("cut.jpg"));
  // Corrupt entropy data before the region's last row, EOI intact: an error naming the file,
  // and the decoder still works afterwards.
  memcpy(tail, jpg, len);
  for (unsigned long i = len / 3; i < len / 3 + 40; i++) tail[i] = 0xFF;
  int all_rows[4] = {0, 0, H, 8};
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "bad.jpg", tail, len, all_rows, got), DLUA_ERR_IO);
  ck_assert_msg(tu_err_has("bad.jpg"), "%s", dlua_last_error());
  check_region(jpg, len, H, W, box, "after an error");
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "ok.jpg", jpg, len, box, got), DLUA_OK);
  ck_assert(got[2] < H || got[3] < W);  // a real region this time
  free(tail);
  // A header cut before its SOS marker, then a good file, through one decoder: the good
  // file's size (TurboJPEG's handle must not keep the failed read's state).
  int hh = -1, ww = -1;
  ck_assert_int_eq(dlua_image_jpeg_size(&d, "t", "head.jpg", jpg, 300, &hh, &ww), DLUA_ERR_IO);
  ck_assert_int_eq(dlua_image_jpeg_size(&d, "t", "ok.jpg", jpg, len, &hh, &ww), DLUA_OK);
  ck_assert(hh == H && ww == W);
  tjFree(jpg);
  // CMYK takes the full decode (with the Pillow conversion).
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 4; c++) px[(y * W + x) * 4 + c] = cmyk_c(y / 3, x / 4, c);
  jpg = encode_jpeg_q(px, H, W, TJPF_CMYK, TJSAMP_444, 0, &len);
  check_region(jpg, len, H, W, box, "CMYK");
  ck_assert_int_eq(dlua_image_decode_region(&d, "t", "cmyk.jpg", jpg, len, box, got), DLUA_OK);
  ck_assert(got[2] == H && got[3] == W);
  tjFree(jpg);
  dlua_image_decoder_free(&d);
}
END_TEST

/* ---- PNG fixtures written with libpng here ---- */

typedef struct {
  unsigned char *buf;
  size_t len, cap;
} mem_t;

static void mem_write(png_structp png, png_bytep data, png_size_t n) {
  mem_t *m = png_get_io_ptr(png);
  if (m->len + n > m->cap) {
    m->cap = (m->len + n) * 2;
    m->buf = realloc(m->buf, m->cap);
  }
  memcpy(m->buf + m->len, data, n);
  m->len += n;
}
static void mem_flush(png_structp png) { (void)png; }

/* A PNG of `rows` (h rows of rowbytes each) with the given IHDR; palette (n entries) optional. */
static mem_t write_png(int h, int w, int depth, int color, const uint8_t *rows, size_t rowbytes, const png_color *pal,
                       int npal) {
  mem_t m = {0};
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
  png_infop info = png_create_info_struct(png);
  ck_assert(!setjmp(png_jmpbuf(png)));
  png_set_write_fn(png, &m, mem_write, mem_flush);
  png_set_IHDR(png, info, w, h, depth, color, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (pal) png_set_PLTE(png, info, pal, npal);
  png_write_info(png, info);
  for (int y = 0; y < h; y++) png_write_row(png, (png_const_bytep)(rows + y * rowbytes));
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  return m;
}

START_TEST(test_png_conversions_exact) {
  enum { H = 5, W = 7 };
  // RGB 8-bit: exact.
  uint8_t rgb[H * W * 3];
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) rgb[(y * W + x) * 3 + c] = (uint8_t)(17 * y + 29 * x + 83 * c);
  mem_t m = write_png(H, W, 8, PNG_COLOR_TYPE_RGB, rgb, W * 3, NULL, 0);
  ck_assert_int_eq(dlua_image_sniff(m.buf, m.len), DLUA_IMAGE_PNG);
  dlua_tensor_t *t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), rgb, sizeof rgb), 0);
  dlua_tensor_free(t);
  free(m.buf);

  // RGBA: alpha dropped, colour kept (Pillow's convert('RGB')).
  uint8_t rgba[H * W * 4];
  for (int i = 0; i < H * W; i++) {
    memcpy(rgba + 4 * i, rgb + 3 * i, 3);
    rgba[4 * i + 3] = (uint8_t)(i * 7);
  }
  m = write_png(H, W, 8, PNG_COLOR_TYPE_RGB_ALPHA, rgba, W * 4, NULL, 0);
  t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), rgb, sizeof rgb), 0);
  dlua_tensor_free(t);
  free(m.buf);

  // 16-bit RGB: the high byte of each big-endian sample.
  uint8_t rgb16[H * W * 6];
  for (int i = 0; i < H * W * 3; i++) {
    rgb16[2 * i] = rgb[i];
    rgb16[2 * i + 1] = (uint8_t)(255 - rgb[i]);  // a low byte that would change a rounded result
  }
  m = write_png(H, W, 16, PNG_COLOR_TYPE_RGB, rgb16, W * 6, NULL, 0);
  t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), rgb, sizeof rgb), 0);
  dlua_tensor_free(t);
  free(m.buf);

  // Palette (4 colours at 2 bits per pixel): expanded to the palette's RGB.
  png_color pal[4] = {{0, 0, 0}, {255, 0, 0}, {10, 200, 30}, {5, 6, 7}};
  uint8_t packed[H * 2];  // 7 pixels of 2 bits: 2 bytes per row
  uint8_t want[H * W * 3];
  for (int y = 0; y < H; y++) {
    packed[2 * y] = packed[2 * y + 1] = 0;
    for (int x = 0; x < W; x++) {
      int idx = (x + y) % 4;
      packed[2 * y + x / 4] |= (uint8_t)(idx << (6 - 2 * (x % 4)));
      want[(y * W + x) * 3] = pal[idx].red;
      want[(y * W + x) * 3 + 1] = pal[idx].green;
      want[(y * W + x) * 3 + 2] = pal[idx].blue;
    }
  }
  m = write_png(H, W, 2, PNG_COLOR_TYPE_PALETTE, packed, 2, pal, 4);
  t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), want, sizeof want), 0);
  dlua_tensor_free(t);
  free(m.buf);

  // Grey + alpha, 8-bit: grey replicated, alpha dropped.
  uint8_t ga[H * W * 2];
  for (int i = 0; i < H * W; i++) {
    ga[2 * i] = (uint8_t)(i * 5);
    ga[2 * i + 1] = 99;
    want[3 * i] = want[3 * i + 1] = want[3 * i + 2] = (uint8_t)(i * 5);
  }
  m = write_png(H, W, 8, PNG_COLOR_TYPE_GRAY_ALPHA, ga, W * 2, NULL, 0);
  t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), want, sizeof want), 0);
  dlua_tensor_free(t);
  free(m.buf);

  // 1-bit grey: 0 -> 0, 1 -> 255.
  uint8_t bits[H];
  for (int y = 0; y < H; y++) {
    bits[y] = (uint8_t)(0xA5 ^ y);
    for (int x = 0; x < W; x++) {
      uint8_t v = ((bits[y] >> (7 - x)) & 1) ? 255 : 0;
      want[(y * W + x) * 3] = want[(y * W + x) * 3 + 1] = want[(y * W + x) * 3 + 2] = v;
    }
  }
  m = write_png(H, W, 1, PNG_COLOR_TYPE_GRAY, bits, 1, NULL, 0);
  t = decode(m.buf, m.len, 1, 0);
  ck_assert_int_eq(memcmp(dlua_tensor_data(t), want, sizeof want), 0);
  dlua_tensor_free(t);
  free(m.buf);
}
END_TEST

START_TEST(test_bad_data_is_an_io_error_naming_the_file) {
  enum { H = 16, W = 16 };
  uint8_t px[H * W * 3];
  for (int i = 0; i < H * W * 3; i++) px[i] = (uint8_t)(i * 13);
  unsigned long len = 0;
  unsigned char *jpg = encode_jpeg(px, H, W, TJPF_RGB, TJSAMP_420, &len);
  dlua_image_decoder_t d = {0};
  int h, w;
  // Truncated: half the file.
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "cut.jpg", jpg, len / 2, 1, 0, &h, &w), DLUA_ERR_IO);
  ck_assert_msg(tu_err_has("cut.jpg"), "%s", dlua_last_error());
  // Header only.
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "head.jpg", jpg, 20, 1, 0, &h, &w), DLUA_ERR_IO);
  // Garbage after a JPEG signature.
  unsigned char junk[64] = {0xFF, 0xD8, 0xFF, 0xE0};
  for (int i = 4; i < 64; i++) junk[i] = (unsigned char)(i * 37);
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "junk.jpg", junk, sizeof junk, 1, 0, &h, &w), DLUA_ERR_IO);
  // Empty and text.
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "empty.jpg", jpg, 0, 1, 0, &h, &w), DLUA_ERR_IO);
  ck_assert(tu_err_has("empty file") && tu_err_has("empty.jpg"));
  const char *text = "this is not an image at all";
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "notes.png", (const uint8_t *)text, strlen(text), 1, 0, &h, &w),
                   DLUA_ERR_IO);
  ck_assert(tu_err_has("not a JPEG or PNG") && tu_err_has("notes.png"));
  // Truncated PNG.
  mem_t m = write_png(H, W, 8, PNG_COLOR_TYPE_RGB, px, W * 3, NULL, 0);
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "cut.png", m.buf, m.len / 2, 1, 0, &h, &w), DLUA_ERR_IO);
  ck_assert_msg(tu_err_has("cut.png"), "%s", dlua_last_error());
  // A good decode still works with the same decoder afterwards.
  ck_assert_int_eq(dlua_image_decode_into(&d, "op", "ok.png", m.buf, m.len, 1, 0, &h, &w), DLUA_OK);
  ck_assert_int_eq(memcmp(d.pixels, px, sizeof px), 0);
  free(m.buf);
  dlua_image_decoder_free(&d);
  tjFree(jpg);
  // Missing file.
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_image_read(&t, "/nonexistent/dir/x.jpg", 1, 0), DLUA_ERR_IO);
  ck_assert(tu_err_has("/nonexistent/dir/x.jpg"));
}
END_TEST

START_TEST(test_write_and_read_files) {
  char dir[] = "/tmp/dlua_test_image_XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char jpath[256], ppath[256];
  snprintf(jpath, sizeof jpath, "%s/a.jpg", dir);
  snprintf(ppath, sizeof ppath, "%s/a.png", dir);
  enum { H = 9, W = 11 };
  int64_t sz[3] = {H, W, 3};
  dlua_tensor_t *img = tu_new_t(3, sz, DLUA_DTYPE_U8);
  uint8_t *p = dlua_tensor_data(img);
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) p[(y * W + x) * 3 + c] = pat(y, x, c);
  ck_assert_int_eq(dlua_image_write_png(img, ppath), DLUA_OK);
  ck_assert_int_eq(dlua_image_write_jpeg(img, jpath, 100), DLUA_OK);
  dlua_tensor_t *a = NULL, *b = NULL;
  ck_assert_int_eq(dlua_image_read(&a, ppath, 1, 0), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(a), p, H * W * 3), 0);
  ck_assert_int_eq(dlua_image_read(&b, jpath, 1, 0), DLUA_OK);
  int d = max_diff(b, H, W, pat);
  ck_assert_msg(d <= 6, "q100 4:2:0 JPEG written and read back is %d levels off", d);
  ck_assert_int_eq(dlua_image_write_jpeg(img, jpath, 0), DLUA_ERR_ARG);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
  dlua_tensor_free(img);
  remove(jpath);
  remove(ppath);
  rmdir(dir);
}
END_TEST

int main(void) {
  Suite *s = suite_create("image");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_jpeg_rgb_and_sniff);
  tcase_add_test(tc, test_jpeg_grey_becomes_rgb);
  tcase_add_test(tc, test_jpeg_cmyk_becomes_rgb);
  tcase_add_test(tc, test_jpeg_dct_scaling);
  tcase_add_test(tc, test_jpeg_region_equals_full_decode);
  tcase_add_test(tc, test_jpeg_region_fallbacks_and_errors);
  tcase_add_test(tc, test_png_conversions_exact);
  tcase_add_test(tc, test_bad_data_is_an_io_error_naming_the_file);
  tcase_add_test(tc, test_write_and_read_files);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

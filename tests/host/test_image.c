/* Check suite for host/data/image.c: JPEG/PNG fixtures encoded here with TurboJPEG and libpng, decoded pixels against the known ones, grey/CMYK/palette/16-bit/alpha conversions, DCT scaling, bad files. */
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
  tcase_add_test(tc, test_png_conversions_exact);
  tcase_add_test(tc, test_bad_data_is_an_io_error_naming_the_file);
  tcase_add_test(tc, test_write_and_read_files);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

/* Image decoding and encoding: JPEG through TurboJPEG (with DCT-domain scaling) or libjpeg-turbo's libjpeg API (crop regions), PNG through libpng, always to 8-bit RGB. */
#include "data/image.h"
#include <errno.h>
#include <limits.h>
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <jpeglib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>
#include "core/error.h"
#include "core/tensor.h"

/* Larger images are refused before any allocation: a corrupt header could otherwise ask
   for gigabytes (Pillow's decompression-bomb limit is of the same order). */
enum { MAX_PIXELS = 1 << 28 };

dlua_image_format_t dlua_image_sniff(const uint8_t *buf, size_t len) {
  if (len >= 3 && buf[0] == 0xFF && buf[1] == 0xD8 && buf[2] == 0xFF) return DLUA_IMAGE_JPEG;
  if (len >= 8 && !png_sig_cmp((png_const_bytep)buf, 0, 8)) return DLUA_IMAGE_PNG;
  return DLUA_IMAGE_UNKNOWN;
}

void dlua_image_decoder_free(dlua_image_decoder_t *d) {
  if (!d) return;
  if (d->tj) tjDestroy((tjhandle)d->tj);
  if (d->jd) {
    jpeg_destroy_decompress(d->jd);
    free(d->jd);
  }
  free(d->pixels);
  free(d->aux);
  memset(d, 0, sizeof *d);
}

static int grow(uint8_t **p, size_t *cap, size_t need) {
  if (need <= *cap) return 1;
  size_t n = need + need / 4;
  uint8_t *q = realloc(*p, n);
  if (!q) return 0;
  *p = q;
  *cap = n;
  return 1;
}

dlua_status_t dlua_image_read_file(const char *op, const char *path, uint8_t **buf, size_t *cap, size_t *len) {
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return DLUA_ERR(DLUA_ERR_IO, "%s: cannot open '%s': %s", op, path, strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    fclose(f);
    return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is not a regular file", op, path);
  }
  size_t n = (size_t)st.st_size;
  if (!grow(buf, cap, n ? n : 1)) {
    fclose(f);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory reading '%s' (%zu bytes)", op, path, n);
  }
  size_t got = n ? fread(*buf, 1, n, f) : 0;
  int err = ferror(f);
  fclose(f);
  if (err || got != n) return DLUA_ERR(DLUA_ERR_IO, "%s: cannot read '%s' (%zu of %zu bytes)", op, path, got, n);
  *len = n;
  return DLUA_OK;
}

/* ---- JPEG ------------------------------------------------------------------------------------- */

static tjhandle tj_of(dlua_image_decoder_t *d) {
  if (!d->tj) d->tj = tjInitDecompress();
  return (tjhandle)d->tj;
}

void dlua_image_pick_scale(int h, int w, int need_h, int need_w, int *num, int *den) {
  *num = 1;
  *den = 1;
  int n = 0;
  tjscalingfactor *sf = tjGetScalingFactors(&n);
  double best = 1.0;
  for (int i = 0; i < n; i++) {
    double f = (double)sf[i].num / sf[i].denom;
    if (f >= best) continue;
    if (TJSCALED(h, sf[i]) < need_h || TJSCALED(w, sf[i]) < need_w) continue;
    best = f;
    *num = sf[i].num;
    *den = sf[i].denom;
  }
}

static dlua_status_t jpeg_header(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                 size_t len, int *h, int *w, int *cs) {
  tjhandle tj = tj_of(d);
  if (!tj) return DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a TurboJPEG decoder", op);
  int sub = 0, color = 0;
  *w = *h = 0;  // a corrupt header can return success without setting them
  if (len > ULONG_MAX || tjDecompressHeader3(tj, buf, (unsigned long)len, w, h, &sub, &color) != 0) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is not a readable JPEG: %s", op, name, tjGetErrorStr2(tj));
    // TurboJPEG 2.1 leaves the handle mid-header after a failed header read, and the next
    // file's header would then come out as 0x0: start again with a fresh handle.
    tjDestroy(tj);
    d->tj = NULL;
    return s;
  }
  if (*w <= 0 || *h <= 0 || (int64_t)*w * *h > MAX_PIXELS)
    return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' has an unusable size %dx%d", op, name, *w, *h);
  if (cs) *cs = color;
  return DLUA_OK;
}

dlua_status_t dlua_image_jpeg_size(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                   size_t len, int *h, int *w) {
  return jpeg_header(d, op, name, buf, len, h, w, NULL);
}

static dlua_status_t jpeg_decode(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                 size_t len, int num, int den, int *oh, int *ow) {
  int h, w, cs;
  DLUA_TRY(jpeg_header(d, op, name, buf, len, &h, &w, &cs));
  tjscalingfactor sf = {num, den};
  if (den <= 0) sf.num = sf.denom = 1;
  int sh = TJSCALED(h, sf), sw = TJSCALED(w, sf);
  tjhandle tj = (tjhandle)d->tj;
  // Default flags: accurate integer IDCT and fancy upsampling, what Pillow's libjpeg uses,
  // so an unscaled decode matches torchvision's pixels exactly.
  const int flags = 0;
  if (!grow(&d->pixels, &d->cap, (size_t)sh * sw * 3))
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory decoding '%s' (%dx%d)", op, name, sw, sh);
  int rc;
  if (cs == TJCS_CMYK || cs == TJCS_YCCK) {
    // libjpeg has no CMYK -> RGB conversion: take the CMYK samples and convert as Pillow
    // does. Adobe's files (and libjpeg's, which write the Adobe marker) store them
    // inverted, 255 = no ink, so R = C * K / 255 on the stored values.
    if (!grow(&d->aux, &d->aux_cap, (size_t)sh * sw * 4))
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory decoding '%s' (%dx%d)", op, name, sw, sh);
    rc = tjDecompress2(tj, buf, (unsigned long)len, d->aux, sw, sw * 4, sh, TJPF_CMYK, flags);
    if (rc == 0 || tjGetErrorCode(tj) == TJERR_WARNING) {
      const uint8_t *s = d->aux;
      uint8_t *o = d->pixels;
      for (size_t i = 0, n = (size_t)sh * sw; i < n; i++, s += 4, o += 3) {
        unsigned k = s[3];
        // (a * k + 127) / 255 rounded, Pillow's MULDIV255.
        for (int c = 0; c < 3; c++) {
          unsigned t = s[c] * k + 128;
          o[c] = (uint8_t)((t + (t >> 8)) >> 8);
        }
      }
    }
  } else {
    rc = tjDecompress2(tj, buf, (unsigned long)len, d->pixels, sw, sw * 3, sh, TJPF_RGB, flags);
  }
  // A warning (e.g. "Premature end of JPEG file") still leaves a full image, grey where the
  // data ran out; Pillow refuses such files by default (LOAD_TRUNCATED_IMAGES = False), so
  // a truncated file is an error here too.
  if (rc != 0) return DLUA_ERR(DLUA_ERR_IO, "%s: cannot decode JPEG '%s': %s", op, name, tjGetErrorStr2(tj));
  *oh = sh;
  *ow = sw;
  return DLUA_OK;
}

/* ---- JPEG regions (libjpeg API) ---------------------------------------------------------------- */

/* TurboJPEG 2.1 cannot crop; the libjpeg API of the same library can (jpeg_crop_scanline,
   jpeg_skip_scanlines), and stopping after the last needed row skips even the entropy
   decoding of the rows below. */
typedef struct {
  struct jpeg_decompress_struct ci; /* first: ci.err points at err */
  struct jpeg_error_mgr err;
  jmp_buf jb;
  int warned;
  char msg[JMSG_LENGTH_MAX];
} jdec_t;

static void jdec_error_exit(j_common_ptr c) {
  jdec_t *j = (jdec_t *)(void *)c;
  (*c->err->format_message)(c, j->msg);
  longjmp(j->jb, 1);
}

/* Warnings (corrupt or missing data) make the decode fail, as TurboJPEG's do. */
static void jdec_emit(j_common_ptr c, int level) {
  jdec_t *j = (jdec_t *)(void *)c;
  if (level < 0 && !j->warned) {
    (*c->err->format_message)(c, j->msg);
    j->warned = 1;
  }
}

static jdec_t *jdec_of(dlua_image_decoder_t *d) {
  if (d->jd) return d->jd;
  jdec_t *j = calloc(1, sizeof *j);
  if (!j) return NULL;
  j->ci.err = jpeg_std_error(&j->err);
  j->err.error_exit = jdec_error_exit;
  j->err.emit_message = jdec_emit;
  if (setjmp(j->jb)) {  // jpeg_create_decompress fails only when out of memory
    free(j);
    return NULL;
  }
  jpeg_create_decompress(&j->ci);
  d->jd = j;
  return j;
}

/* A complete JPEG ends with its EOI marker. Files that do not (truncated ones, or trailing
   bytes) take the full decode, which sees the whole stream: a region decode stops early and
   would accept a truncated file whose missing part lies below the crop. */
static int ends_with_eoi(const uint8_t *buf, size_t len) { return len >= 4 && buf[len - 2] == 0xFF && buf[len - 1] == 0xD9; }

dlua_status_t dlua_image_decode_region(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                       size_t len, const int want[4], int got[4]) {
  int h = 0, w = 0, cs = 0;
  DLUA_TRY(jpeg_header(d, op, name, buf, len, &h, &w, &cs));
  int y0 = want[0], x0 = want[1], y1 = want[0] + want[2], x1 = want[1] + want[3];
  if (y0 < 0) y0 = 0;
  if (x0 < 0) x0 = 0;
  if (y1 > h) y1 = h;
  if (x1 > w) x1 = w;
  if (y0 >= y1 || x0 >= x1 || cs == TJCS_CMYK || cs == TJCS_YCCK || !ends_with_eoi(buf, len) ||
      (y0 == 0 && x0 == 0 && y1 == h && x1 == w)) {
    got[0] = got[1] = 0;
    DLUA_TRY(jpeg_decode(d, op, name, buf, len, 1, 1, &got[2], &got[3]));
    return DLUA_OK;
  }
  jdec_t *j = jdec_of(d);
  if (!j) return DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a JPEG decoder", op);
  struct jpeg_decompress_struct *ci = &j->ci;
  // volatile: read after a longjmp back to the setjmp below.
  volatile dlua_status_t st = DLUA_OK;
  JSAMPROW row[1];
  if (setjmp(j->jb)) {
    jpeg_abort_decompress(ci);
    if (st != DLUA_OK) return st;
    return DLUA_ERR(DLUA_ERR_IO, "%s: cannot decode JPEG '%s': %s", op, name, j->msg);
  }
  j->warned = 0;
  jpeg_mem_src(ci, buf, (unsigned long)len);
  jpeg_read_header(ci, TRUE);
  // What TurboJPEG does for TJPF_RGB without flags: accurate integer IDCT, fancy upsampling,
  // so that the region equals the same rows and columns of a full decode.
  ci->out_color_space = JCS_EXT_RGB;
  ci->dct_method = JDCT_ISLOW;
  ci->do_fancy_upsampling = TRUE;
  ci->do_block_smoothing = TRUE;
  ci->scale_num = ci->scale_denom = 1;
  jpeg_start_decompress(ci);
  if ((int)ci->output_width != w || (int)ci->output_height != h || ci->output_components != 3) {
    snprintf(j->msg, sizeof j->msg, "the header says %dx%d, the decoder %ux%u", w, h, ci->output_width,
             ci->output_height);
    longjmp(j->jb, 1);
  }
  // The fancy upsampler interpolates chroma across a cropped region's edges from neighbours
  // outside it, and a skip resumes at an iMCU row: keep a whole iMCU of margin on the left,
  // right and top, so the pixels asked for are interior and equal a full decode's.
  const int mw = ci->max_h_samp_factor * DCTSIZE, mh = ci->max_v_samp_factor * DCTSIZE;
  int cx0 = x0 - mw < 0 ? 0 : x0 - mw, cx1 = x1 + mw > w ? w : x1 + mw;
  int ry0 = y0 - mh < 0 ? 0 : (y0 - mh) / mh * mh;
  JDIMENSION xoff = (JDIMENSION)cx0, cw = (JDIMENSION)(cx1 - cx0);
  if (cx0 > 0 || cx1 < w) jpeg_crop_scanline(ci, &xoff, &cw);
  const size_t stride = (size_t)cw * 3;
  if (!grow(&d->pixels, &d->cap, stride * (size_t)(y1 - ry0) + 64)) {
    st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory decoding '%s' (%ux%d)", op, name, cw, y1 - ry0);
    longjmp(j->jb, 1);
  }
  if (ry0 > 0 && (int)jpeg_skip_scanlines(ci, (JDIMENSION)ry0) != ry0) {
    snprintf(j->msg, sizeof j->msg, "cannot skip to row %d", ry0);
    longjmp(j->jb, 1);
  }
  while ((int)ci->output_scanline < y1) {
    row[0] = d->pixels + stride * (ci->output_scanline - (JDIMENSION)ry0);
    if (jpeg_read_scanlines(ci, row, 1) != 1) {
      snprintf(j->msg, sizeof j->msg, "no data at row %u", ci->output_scanline);
      longjmp(j->jb, 1);
    }
  }
  int warned = j->warned;
  // Rows below the region are never decoded: abort rather than finish.
  jpeg_abort_decompress(ci);
  if (warned) return DLUA_ERR(DLUA_ERR_IO, "%s: cannot decode JPEG '%s': %s", op, name, j->msg);
  got[0] = ry0;
  got[1] = (int)xoff;
  got[2] = y1 - ry0;
  got[3] = (int)cw;
  return DLUA_OK;
}

/* ---- PNG -------------------------------------------------------------------------------------- */

typedef struct {
  const uint8_t *buf;
  size_t len, pos;
  char msg[160];
} png_src_t;

static void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  png_src_t *s = png_get_io_ptr(png);
  if (n > s->len - s->pos) png_error(png, "file is truncated");
  memcpy(out, s->buf + s->pos, n);
  s->pos += n;
}

static void png_on_error(png_structp png, png_const_charp msg) {
  png_src_t *s = png_get_error_ptr(png);
  snprintf(s->msg, sizeof s->msg, "%s", msg);
  png_longjmp(png, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg) { (void)png, (void)msg; }

static dlua_status_t png_decode(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                size_t len, int header_only, int *oh, int *ow) {
  png_src_t src = {buf, len, 0, "corrupt data"};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
  if (!png) return DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a PNG decoder", op);
  png_infop info = png_create_info_struct(png);
  png_bytep *volatile rows = NULL;
  // volatile: read after longjmp returns to the setjmp below.
  volatile dlua_status_t st = DLUA_OK;
  if (!info) {
    png_destroy_read_struct(&png, NULL, NULL);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a PNG decoder", op);
  }
  if (setjmp(png_jmpbuf(png))) {
    free(rows);
    png_destroy_read_struct(&png, &info, NULL);
    if (st != DLUA_OK) return st;
    return DLUA_ERR(DLUA_ERR_IO, "%s: cannot decode PNG '%s': %s", op, name, src.msg);
  }
  png_set_read_fn(png, &src, png_read_mem);
  // Huge declared sizes are refused by libpng itself before it allocates.
  png_set_user_limits(png, 1 << 20, 1 << 20);
  png_read_info(png, info);
  png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  if ((uint64_t)w * h > MAX_PIXELS) {
    st = DLUA_ERR(DLUA_ERR_IO, "%s: '%s' has an unusable size %ux%u", op, name, (unsigned)w, (unsigned)h);
    png_longjmp(png, 1);
  }
  *oh = (int)h;
  *ow = (int)w;
  if (header_only) {
    png_destroy_read_struct(&png, &info, NULL);
    return DLUA_OK;
  }
  int color = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
  // To 8-bit RGB as Pillow's convert('RGB'): palettes expand, 16-bit keeps the high byte,
  // grey is replicated, alpha (and tRNS, never expanded) is dropped rather than composited.
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (depth == 16) png_set_strip_16(png);
  if (color & PNG_COLOR_MASK_ALPHA) png_set_strip_alpha(png);
  if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_channels(png, info) != 3 || png_get_rowbytes(png, info) != (size_t)w * 3) {
    snprintf(src.msg, sizeof src.msg, "unsupported pixel layout (%d channels)", png_get_channels(png, info));
    png_longjmp(png, 1);
  }
  if (!grow(&d->pixels, &d->cap, (size_t)w * h * 3)) {
    st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory decoding '%s' (%ux%u)", op, name, (unsigned)w, (unsigned)h);
    png_longjmp(png, 1);
  }
  rows = malloc(sizeof(png_bytep) * h);
  if (!rows) {
    st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory decoding '%s'", op, name);
    png_longjmp(png, 1);
  }
  for (png_uint_32 y = 0; y < h; y++) rows[y] = d->pixels + (size_t)y * w * 3;
  png_read_image(png, rows);
  // Errors in what follows the pixels (a cut IEND, a bad trailing CRC) do not matter: the
  // image is complete; Pillow does not read past the data either.
  free(rows);
  png_destroy_read_struct(&png, &info, NULL);
  return DLUA_OK;
}

/* ---- dispatch ------------------------------------------------------------------------------- */

dlua_status_t dlua_image_peek(const char *op, const char *name, const uint8_t *buf, size_t len, int *h, int *w) {
  switch (dlua_image_sniff(buf, len)) {
    case DLUA_IMAGE_JPEG: {
      dlua_image_decoder_t tmp = {0};
      dlua_status_t s = jpeg_header(&tmp, op, name, buf, len, h, w, NULL);
      dlua_image_decoder_free(&tmp);
      return s;
    }
    case DLUA_IMAGE_PNG: return png_decode(NULL, op, name, buf, len, 1, h, w);
    default:
      return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is not a JPEG or PNG image (%s)", op, name,
                      len ? "unknown magic number" : "empty file");
  }
}

dlua_status_t dlua_image_decode_into(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                     size_t len, int num, int den, int *h, int *w) {
  switch (dlua_image_sniff(buf, len)) {
    case DLUA_IMAGE_JPEG: return jpeg_decode(d, op, name, buf, len, num, den, h, w);
    case DLUA_IMAGE_PNG: return png_decode(d, op, name, buf, len, 0, h, w);
    default:
      return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is not a JPEG or PNG image (%s)", op, name,
                      len ? "unknown magic number" : "empty file");
  }
}

/* ---- the public API ------------------------------------------------------------------------- */

static dlua_status_t decoded_tensor(dlua_tensor_t **out, dlua_image_decoder_t *d, int h, int w) {
  int64_t s[3] = {h, w, 3};
  return dlua_tensor_from_data(out, 3, s, DLUA_DTYPE_U8, d->pixels);
}

dlua_status_t dlua_image_decode(dlua_tensor_t **out, const void *buf, size_t len, int scale_num, int scale_den) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "image_decode: out is NULL");
  *out = NULL;
  if (!buf && len) return DLUA_ERR(DLUA_ERR_ARG, "image_decode: buffer is NULL");
  dlua_image_decoder_t d = {0};
  int h = 0, w = 0;
  dlua_status_t s = dlua_image_decode_into(&d, "image_decode", "<buffer>", buf, len, scale_num, scale_den, &h, &w);
  if (s == DLUA_OK) s = decoded_tensor(out, &d, h, w);
  dlua_image_decoder_free(&d);
  return s;
}

dlua_status_t dlua_image_read(dlua_tensor_t **out, const char *path, int scale_num, int scale_den) {
  if (!out || !path) return DLUA_ERR(DLUA_ERR_ARG, "image_read: out or path is NULL");
  *out = NULL;
  uint8_t *buf = NULL;
  size_t cap = 0, len = 0;
  dlua_status_t s = dlua_image_read_file("image_read", path, &buf, &cap, &len);
  if (s == DLUA_OK) {
    dlua_image_decoder_t d = {0};
    int h = 0, w = 0;
    s = dlua_image_decode_into(&d, "image_read", path, buf, len, scale_num, scale_den, &h, &w);
    if (s == DLUA_OK) s = decoded_tensor(out, &d, h, w);
    dlua_image_decoder_free(&d);
  }
  free(buf);
  return s;
}

/* A contiguous (H, W, C) uint8 CPU image, or an error naming op. */
static dlua_status_t image_arg(const char *op, const dlua_tensor_t *img, int cmin, int cmax, dlua_tensor_t **c) {
  char b[160];
  if (!img) return DLUA_ERR(DLUA_ERR_ARG, "%s: image is NULL", op);
  DLUA_TRY(dlua_require_cpu(op, img));
  if (img->ndim != 3 || img->dtype != DLUA_DTYPE_U8 || img->sizes[2] < cmin || img->sizes[2] > cmax ||
      img->sizes[0] < 1 || img->sizes[1] < 1 || img->sizes[0] > 65535 || img->sizes[1] > 65535)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a uint8 image (H, W, C) with %d..%d channels and sides 1..65535, got %s",
                    op, cmin, cmax, dlua_tensor_describe(img, b, sizeof b));
  return dlua_tensor_contiguous(c, img);
}

static dlua_status_t write_all(const char *op, const char *path, const void *data, size_t n) {
  // Temporary file then rename: a reader (or a crash) never sees half an image.
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 40);
  if (!tmp) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", op);
  static int counter;
  snprintf(tmp, pl + 40, "%s.tmp.%d.%d", path, (int)getpid(), __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_IO, "%s: cannot write '%s': %s", op, path, strerror(errno));
    free(tmp);
    return s;
  }
  size_t put = fwrite(data, 1, n, f);
  int bad = put != n || fclose(f) != 0;
  if (bad || rename(tmp, path) != 0) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_IO, "%s: cannot write '%s': %s", op, path, strerror(errno));
    remove(tmp);
    free(tmp);
    return s;
  }
  free(tmp);
  return DLUA_OK;
}

dlua_status_t dlua_image_write_jpeg(const dlua_tensor_t *img, const char *path, int quality) {
  static const char op[] = "image_write_jpeg";
  if (!path) return DLUA_ERR(DLUA_ERR_ARG, "%s: path is NULL", op);
  if (quality < 1 || quality > 100) return DLUA_ERR(DLUA_ERR_ARG, "%s: quality must be 1..100, got %d", op, quality);
  dlua_tensor_t *c = NULL;
  DLUA_TRY(image_arg(op, img, 1, 4, &c));
  if (c->sizes[2] == 2) {
    dlua_tensor_free(c);
    return DLUA_ERR(DLUA_ERR_ARG, "%s: 2 channels: JPEG stores 1 (grey), 3 (RGB) or 4 (CMYK)", op);
  }
  int h = (int)c->sizes[0], w = (int)c->sizes[1], ch = (int)c->sizes[2];
  int pf = ch == 1 ? TJPF_GRAY : ch == 3 ? TJPF_RGB : TJPF_CMYK;
  int samp = ch == 1 ? TJSAMP_GRAY : TJSAMP_420;
  tjhandle tj = tjInitCompress();
  dlua_status_t s = DLUA_OK;
  unsigned char *jpeg = NULL;
  unsigned long jlen = 0;
  if (!tj) {
    s = DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a TurboJPEG encoder", op);
  } else if (tjCompress2(tj, (const unsigned char *)dlua_tensor_ptr(c), w, w * ch, h, pf, &jpeg, &jlen, samp, quality,
                         TJFLAG_ACCURATEDCT) != 0) {
    s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: TurboJPEG failed on '%s': %s", op, path, tjGetErrorStr2(tj));
  } else {
    s = write_all(op, path, jpeg, jlen);
  }
  if (jpeg) tjFree(jpeg);
  if (tj) tjDestroy(tj);
  dlua_tensor_free(c);
  return s;
}

typedef struct {
  uint8_t *data;
  size_t len, cap;
  int oom;
} png_sink_t;

static void png_write_mem(png_structp png, png_bytep data, png_size_t n) {
  png_sink_t *s = png_get_io_ptr(png);
  if (s->oom) return;
  if (!grow(&s->data, &s->cap, s->len + n)) {
    s->oom = 1;
    return;
  }
  memcpy(s->data + s->len, data, n);
  s->len += n;
}

static void png_flush_mem(png_structp png) { (void)png; }

dlua_status_t dlua_image_write_png(const dlua_tensor_t *img, const char *path) {
  static const char op[] = "image_write_png";
  if (!path) return DLUA_ERR(DLUA_ERR_ARG, "%s: path is NULL", op);
  dlua_tensor_t *c = NULL;
  DLUA_TRY(image_arg(op, img, 1, 4, &c));
  int h = (int)c->sizes[0], w = (int)c->sizes[1], ch = (int)c->sizes[2];
  static const int types[5] = {0, PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA, PNG_COLOR_TYPE_RGB,
                               PNG_COLOR_TYPE_RGB_ALPHA};
  png_src_t err = {NULL, 0, 0, "failed"};
  png_sink_t sink = {0};
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &err, png_on_error, png_on_warning);
  png_infop info = png ? png_create_info_struct(png) : NULL;
  if (!info) {
    if (png) png_destroy_write_struct(&png, NULL);
    dlua_tensor_free(c);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: cannot create a PNG encoder", op);
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    free(sink.data);
    dlua_tensor_free(c);
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: libpng failed on '%s': %s", op, path, err.msg);
  }
  png_set_write_fn(png, &sink, png_write_mem, png_flush_mem);
  png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 8, types[ch], PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  const uint8_t *p = (const uint8_t *)dlua_tensor_ptr(c);
  for (int y = 0; y < h; y++) png_write_row(png, (png_const_bytep)(p + (size_t)y * w * ch));
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  dlua_tensor_free(c);
  dlua_status_t s = sink.oom ? DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory encoding '%s'", op, path)
                             : write_all(op, path, sink.data, sink.len);
  free(sink.data);
  return s;
}

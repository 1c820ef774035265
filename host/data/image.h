/* JPEG (TurboJPEG with DCT-domain down-scaling; libjpeg API for crop regions) and PNG (libpng) decoding into 8-bit RGB, and JPEG/PNG encoding for tools and tests. */
#ifndef DLUA_DATA_IMAGE_H
#define DLUA_DATA_IMAGE_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

typedef enum { DLUA_IMAGE_UNKNOWN = 0, DLUA_IMAGE_JPEG = 1, DLUA_IMAGE_PNG = 2 } dlua_image_format_t;

/* The format a buffer's first bytes announce (its magic number), whatever the file is called. */
dlua_image_format_t dlua_image_sniff(const uint8_t *buf, size_t len);

/* A decoder's reusable state, one per thread: the TurboJPEG handle and the pixel buffer
   (grown, never shrunk), so a worker allocates nothing per image once warm. */
typedef struct dlua_image_decoder {
  void *tj;             /* tjhandle, created on first use */
  uint8_t *pixels;      /* (h, w, 3) RGB of the last decode */
  size_t cap;
  void *jd;             /* libjpeg decompressor for regions, created on first use */
  uint8_t *aux;         /* CMYK staging */
  size_t aux_cap;
} dlua_image_decoder_t;

void dlua_image_decoder_free(dlua_image_decoder_t *d);

/* Image size from the header alone: *h, *w of the full-size image. */
dlua_status_t dlua_image_peek(const char *op, const char *name, const uint8_t *buf, size_t len, int *h, int *w);

/* Decodes buf into d->pixels as RGB (h, w, 3). For a JPEG, num/den (den > 0) pick one of
   TurboJPEG's DCT scaling factors (den == 0: full size); *h and *w get the decoded size.
   Grey and CMYK JPEGs, palette/grey/alpha/16-bit PNGs all come out as 8-bit RGB: alpha and
   tRNS are dropped and 16-bit samples keep their high byte, as Pillow's convert('RGB'). A
   corrupt or truncated image is DLUA_ERR_IO naming `name`. */
dlua_status_t dlua_image_decode_into(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                     size_t len, int num, int den, int *h, int *w);

/* The size of a JPEG from its header, with d's decoder (no allocation once warm). */
dlua_status_t dlua_image_jpeg_size(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                   size_t len, int *h, int *w);

/* Decodes, at full size, a block of a JPEG that contains the rows and columns want = (y, x, h,
   w) of the image (clipped to it), into d->pixels as RGB; got = (y, x, h, w) is the block's
   place in the image (pixel (y, x) of the image is at d->pixels[((y - got[0]) * got[3] +
   x - got[1]) * 3]). Inside want the pixels equal those of a full decode. Rows below the block
   are not even entropy-decoded. CMYK files, files that do not end with an EOI marker (so a
   truncated file fails as in a full decode) and a region covering the whole image take the
   full decode (got = the whole image). */
dlua_status_t dlua_image_decode_region(dlua_image_decoder_t *d, const char *op, const char *name, const uint8_t *buf,
                                       size_t len, const int want[4], int got[4]);

/* The smallest TurboJPEG scaling factor num/den (den > 0) that keeps a full-size extent of
   (h, w) at least (need_h, need_w) after scaling; 1/1 when none is smaller. */
void dlua_image_pick_scale(int h, int w, int need_h, int need_w, int *num, int *den);

/* Reads a whole file into *buf (grown with realloc, *cap its size); *len gets its length. */
dlua_status_t dlua_image_read_file(const char *op, const char *path, uint8_t **buf, size_t *cap, size_t *len);

#endif

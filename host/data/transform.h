/* Image transforms with torchvision's semantics (RandomResizedCrop, Resize, CenterCrop, flip, ToTensor, Normalize) on 8-bit HWC images. */
#ifndef DLUA_DATA_TRANSFORM_H
#define DLUA_DATA_TRANSFORM_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

/* Philox counter word 3 of transform draws is this tag ("TF") ^ (position << 8) ^ block:
   words 0-1 hold the sample index, word 2 the epoch (mod 2^32). Distinct from the
   small-image augmentation's tag and from generator fills (word 3 = 0). */
#define DLUA_TF_STREAM_TAG 0x54460000u

enum { DLUA_TF_MAX_OPS = 32, DLUA_TF_MAX_CHANNELS = 4 };

struct dlua_pipeline {
  int n;
  dlua_transform_t ops[DLUA_TF_MAX_OPS];
  int to_tensor;        /* position of ToTensor, or -1 */
  int out_dtype;        /* DLUA_DTYPE_F32 or DLUA_DTYPE_U8 */
  int layout;           /* memory of a (C, H, W) sample: 0 row-major, 1 channels-last ((H, W, C) bytes) */
  int nnorm;            /* 0, 1 or channels: the folded Normalize statistics */
  double a[DLUA_TF_MAX_CHANNELS], b[DLUA_TF_MAX_CHANNELS]; /* out = pixel * a[c] + b[c] */
};

/* Which sample a draw is for. */
typedef struct {
  uint64_t seed, epoch;
  int64_t sample;
} dlua_tf_key_t;

/* An 8-bit image seen through a crop: pixel (y, x) channel c is at p[y * stride + x * c + c],
   mirrored (x -> w - 1 - x) when flip. lh, lw: the size the random draws see (the full-size
   image when it was decoded at a reduced DCT scale), else h, w. rh > 0: only a region was
   decoded, rows oy .. oy + rh - 1 and columns ox .. ox + rw - 1 (unmirrored), and p points at
   pixel (oy, ox); the pipeline's first crop must lie inside it (dlua_tf_plan_region). */
typedef struct {
  const uint8_t *p;
  int h, w, c;
  ptrdiff_t stride;
  int flip;
  int lh, lw;
  int oy, ox, rh, rw;
} dlua_tf_view_t;

/* Per-thread buffers, grown on demand and reused across samples. */
typedef struct dlua_tf_scratch {
  uint8_t *img[2];
  size_t img_cap[2];
  uint8_t *tmp;
  size_t tmp_cap;
  void *coef;
  size_t coef_cap;
} dlua_tf_scratch_t;

void dlua_tf_scratch_free(dlua_tf_scratch_t *s);

/* The DCT scale to decode a full-size (h, w) image at: the first size-changing transform
   decides, and only factors of 1/2 or less are used (what stays is still downscaled by
   the transform, so the result differs from a full decode by resampling detail only).
   *num / *den = 1 / 1 when no smaller decode helps. */
void dlua_tf_plan_decode(const dlua_pipeline_t *p, const dlua_tf_key_t *key, int h, int w, int *num, int *den);

/* The part of a full-size (h, w) image the transforms read, when it is less than all of it:
   the first resizing transform is a RandomResizedCrop (flips before it mirror its box).
   Returns 1 and box = (y, x, h, w) in unmirrored image coordinates, else 0. */
int dlua_tf_plan_region(const dlua_pipeline_t *p, const dlua_tf_key_t *key, int h, int w, int box[4]);

/* Runs every transform on v and writes the result to dst in the pipeline's output dtype and
   layout. The result must be exactly (eh, ew) (the batch's sample size) unless eh < 0;
   *oh, *ow get the result's size (may be NULL). */
dlua_status_t dlua_tf_run(const dlua_pipeline_t *p, dlua_tf_scratch_t *s, const dlua_tf_key_t *key, dlua_tf_view_t v,
                          void *dst, int eh, int ew, int *oh, int *ow);

/* The size an (h, w) image has after the transforms; -1, -1 when it depends on the image and
   h or w is unknown (< 0). */
void dlua_tf_output_hw(const dlua_pipeline_t *p, int h, int w, int *oh, int *ow);

/* PIL's antialiased bilinear resize of v (mirroring kept as v.flip says) into dst (oh, ow, c)
   contiguous: separable, horizontal pass first, 8-bit intermediate, 22-bit fixed-point
   coefficients, as Pillow's ImagingResample, so results match Pillow's pixel for pixel. */
dlua_status_t dlua_tf_resize(dlua_tf_scratch_t *s, dlua_tf_view_t v, uint8_t *dst, int oh, int ow);

#endif

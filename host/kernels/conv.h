/* The conv family of the backend table (ops/backend.h): 2-d convolution (cross-correlation), forward and both
   gradients. host/ops/conv.c checks the arguments, settles the output, the dtype and memory format each operand
   is staged in (by the backend's `caps`), folds temporaries back and adds the bias where the backend does not,
   then calls one slot with this descriptor; host/cpu/conv.c (oneDNN, float64 loops) and host/cuda/conv_cudnn.c
   (cuDNN) run it. */
#ifndef DLUA_KERNELS_CONV_H
#define DLUA_KERNELS_CONV_H
#include <stdint.h>
#include "core/api.h"
#include "kernels/act_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Memory formats of a logically (N, C, H, W) tensor: act_layout.h's, named for images; weights
   (O, C/g, kH, kW) use the same two: OIHW is the NCHW pattern, OHWI the NHWC one. */
enum { FMT_NCHW = ACT_CONTIG, FMT_NHWC = ACT_CL, FMT_OTHER = ACT_OTHER };

/* A convolution's sizes, as the front door and the CPU kernels work them out. */
typedef struct {
  int64_t n, c, h, w;  /* input (N, C, H, W) */
  int64_t o, kh, kw;   /* weight (O, C/groups, kH, kW) */
  int64_t oh, ow;      /* output spatial size */
  int64_t sh, sw, ph, pw, dh, dw, g;
} dlua_conv_geom_t;

/* How a backend wants a convolution of input dtype `dtype` staged. */
typedef struct {
  int dtype;        /* the dtype of x, w and y (grad_x, grad_y) in the kernel */
  int param_dtype;  /* the dtype the kernel writes weight and bias gradients (and reads the bias) in */
  int one_format;   /* 1: x, w and y in one packed format, 16-byte aligned (the front door stages copies and,
                       where the kernel has nothing for that format, retries in the other one);
                       0: each operand NCHW or NHWC, its own */
  int bias;         /* 1: the kernels add the bias and compute its gradient; 0: the front door does */
  int empty;        /* 1: the kernels take empty dimensions; 0: the front door settles those convolutions */
} dlua_conv_caps_t;

/* One convolution: x (N, C, H, W), w (O, C/groups, kH, kW), y (N, O, OH, OW), each the input or the output by
   direction (forward: y; backward data: x; backward weights: w and bias). */
typedef struct {
  int dtype, param_dtype;                     /* as caps chose them */
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  int sh, sw, ph, pw, dh, dw, groups;
  void *x, *wt, *y, *bias;                    /* addresses on `device`; bias may be NULL */
  int64_t xs[4], ws[4], ys[4], bs;            /* strides in elements */
  int xfmt, wfmt, yfmt;                       /* ACT_CONTIG (NCHW / OIHW) or ACT_CL (NHWC / OHWI), kernels/act_layout.h */
  int acc, acc_bias;                          /* add into the output (forward: y; backward data: x; weights: w), the bias */
  int device;
  const char *ctx;                            /* the operands and parameters, for the backend's error messages */
  int unsupported;                            /* out: the backend has no kernel for these formats (nothing ran) */
} dlua_conv_desc_t;

/* caps and bwd_data_accumulates are required of a backend that gives the family; a NULL direction slot is
   "not supported" there. */
struct dlua_conv_ops {
  /* *caps for the convolution of d's geometry on input dtype d->dtype (no operand set yet). */
  dlua_status_t (*caps)(const char *op, const dlua_conv_desc_t *d, dlua_conv_caps_t *caps);
  /* Whether the backward-data kernel adds into grad_x itself for this problem (else the front door gives it a
     temporary and adds that). */
  dlua_status_t (*bwd_data_accumulates)(const char *op, const dlua_conv_desc_t *d, int *yes);
  dlua_status_t (*forward)(const char *op, dlua_conv_desc_t *d);
  dlua_status_t (*backward_data)(const char *op, dlua_conv_desc_t *d);
  dlua_status_t (*backward_weights)(const char *op, dlua_conv_desc_t *d);
};

extern const struct dlua_conv_ops dlua_cpu_conv_ops, dlua_cuda_conv_ops;

#ifdef __cplusplus
}
#endif
#endif

/* Private to host/cpu/conv.c and conv_dnnl.c: a convolution's geometry, and the oneDNN side (engine,
   per-thread streams and workspaces, the primitive cache) that runs float32 and bfloat16 convolutions. */
#ifndef DLUA_CPU_CONV_IMPL_H
#define DLUA_CPU_CONV_IMPL_H
#include <stdint.h>

#include "core/error.h"
#include "kernels/act_layout.h"
#include "kernels/conv.h"

typedef dlua_conv_geom_t geom_t; /* kernels/conv.h */

typedef enum { DIR_FWD = 0, DIR_BWD_DATA = 1, DIR_BWD_WEIGHTS = 2 } conv_dir_t;

/* Everything a primitive depends on. Built on a zeroed struct so memcmp/hash see no padding junk. */
typedef struct {
  int32_t dir, threads;
  int32_t src_fmt, dst_fmt, w_fmt; /* x / grad_x, y / grad_y, weight / grad_weight */
  int32_t has_bias;
  int32_t acc_w, acc_b;            /* backward weights: += into grad_weight / grad_bias */
  int32_t acc_y;                   /* forward: += into y (a sum post-op on the convolution itself) */
  int32_t lowp;                    /* bfloat16 activations and weights (weight and bias gradients stay float32) */
  geom_t g;
} conv_key_t;

/* The key of one convolution (the thread count included: oneDNN splits work for the count it was built for). */
conv_key_t dlua_conv_dnnl_key(conv_dir_t dir, const geom_t *g, int src_fmt, int dst_fmt, int w_fmt, int has_bias);
/* Runs one float32 or bfloat16 convolution; ptrs are the caller's buffers in the key's slot order
   (input, weight, [bias,] output for the forward; see entry_build in conv_dnnl.c). */
dlua_status_t dlua_conv_dnnl_run(const char *op, const conv_key_t *k, void *const *ptrs);

#endif

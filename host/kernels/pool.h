/* 2-D pooling's family (ops/backend.h): the descriptors host/ops/pool.c fills and the slots
   host/cpu/pool.c and host/cuda/pool.cu provide. Plain C, read by C++ too. */
#ifndef DLUA_KERNELS_POOL_H
#define DLUA_KERNELS_POOL_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DLUA_POOL_MAX = 0, DLUA_POOL_AVG = 1, DLUA_POOL_ADAPTIVE = 2 };

/* 2-D pooling of (N, C, H, W) activations of `dtype` in NCHW (cl 0) or channels-last (cl 1) memory.
   kind DLUA_POOL_MAX (dilation dh, dw), DLUA_POOL_AVG (include_pad, div_override: 0 none),
   DLUA_POOL_ADAPTIVE (windows from H, W, OH, OW alone). */
typedef struct {
  int kind, dtype, cl, device;
  int64_t N, C, H, W, OH, OW;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int include_pad;
  int64_t div_override;
} dlua_pool_geom_t;

/* y (N, C, OH, OW); ind (same shape, int64 positions ih * W + iw in the plane) for max, may be NULL. */
typedef struct {
  dlua_pool_geom_t p;
  const void *x;
  void *y;
  int64_t *ind;
} dlua_pool_fwd_t;

/* gx (N, C, H, W) from gy (N, C, OH, OW). Max pooling takes the positions `ind` and sets *bad when
   one lies outside its plane (then gx is incomplete; the slot still returns DLUA_OK). */
typedef struct {
  dlua_pool_geom_t p;
  const void *gy;
  const int64_t *ind;
  void *gx;
  int *bad;
} dlua_pool_bwd_t;

struct dlua_pool_ops {
  /* 1: the kernels read and write f16/bf16 activations themselves (computing in float); 0: the front
     door stages them in the compute type. */
  int native_16bit;
  dlua_status_t (*forward)(const char *op, const dlua_pool_fwd_t *a);
  dlua_status_t (*backward)(const char *op, const dlua_pool_bwd_t *a);
};

extern const struct dlua_pool_ops dlua_cpu_pool_ops, dlua_cuda_pool_ops;

#ifdef __cplusplus
}
#endif
#endif

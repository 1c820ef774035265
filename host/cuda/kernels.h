/* The internal interface between the C dispatchers (host/cpu, host/core) and the CUDA kernels. */
#ifndef DLUA_CUDA_KERNELS_H
#define DLUA_CUDA_KERNELS_H
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What an element-wise launch does. Positions (`op`) are those of the X-macro lists in
   host/kernels/elementwise_ops.h, so the CPU and CUDA number ops alike. */
enum {
  DLUA_CUDA_EW_UNARY,   /* o = f(a, p1, p2);                 ops: o, a */
  DLUA_CUDA_EW_BINARY,  /* o = f(a, b, alpha) (mode 0), f(a, s) (1), f(s, a) (2); ops: o, a[, b] */
  DLUA_CUDA_EW_TERNARY, /* x = f(x, a, b, value);            ops: x, a, b */
  DLUA_CUDA_EW_WHERE,   /* o = c ? a : b, bits of `elsize`;  ops: o, c (uint8), a, b */
  DLUA_CUDA_EW_MFILL,   /* if m: o = bits i[0];              ops: o, m (uint8) */
  DLUA_CUDA_EW_FILL,    /* o = bits i[0];                    ops: o */
  DLUA_CUDA_EW_COPY,    /* o = convert(a) from src_dtype to dtype, copy_'s rules; ops: o, a */
};

/* One launch: operand 0 is the output; every operand is viewed at the iteration shape (dims
   ordered outer to inner, broadcast dims with stride 0), as host/cpu/elementwise.c's iterator
   builds it. Pointers are device addresses on `device`. */
typedef struct {
  int family, op;
  int dtype;     /* unary/binary/ternary: the compute storage dtype of the inputs (and of the output
                    unless the op is a predicate, whose output is bool); copy: the destination's */
  int src_dtype; /* copy: the source's dtype */
  int elsize;    /* where/mfill/fill: bytes per element (1, 2, 4, 8) */
  int nops, ndim;
  int64_t numel;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t strides[4][DLUA_MAX_DIMS]; /* bytes */
  char *base[4];
  double d[2];   /* float scalars: unary p1, p2; binary alpha, s; ternary value */
  int64_t i[2];  /* the same as integers (bounds that do not survive double), or fill bits */
  int mode;      /* binary: 0 tensor-tensor, 1 a op s, 2 s op a */
  int device;
} dlua_cuda_ew_t;

/* Queues the launch on the current stream of e->device. `op` names the user's op in errors. */
dlua_status_t dlua_cuda_ew_run(const char *op, const dlua_cuda_ew_t *e);

/* The raw cudaStream_t (as void *) that kernels for `device` queue on: its current stream. */
void *dlua_cuda_raw_stream(int device);

/* Fused optimizer steps on CUDA over `length` elements of f32/f64 arenas (args as host/kernels/optim_ops.h's
   dlua_opt_args_t, device pointers): kind 0 SGD, 1 Adam/AdamW (args->decoupled); the per-element code is
   the CPU's. */
dlua_status_t dlua_cuda_optim_step(const char *op, int kind, int dtype, const void *args, int64_t length, int device);
/* x *= inv_scale over n elements (f32, f64, f16, bf16), *nonfinite = how many were Inf/NaN before (an integer
   count: the same whatever order blocks finish). Waits for the count. */
dlua_status_t dlua_cuda_unscale(const char *op, int dtype, void *x, int64_t n, double inv_scale, int64_t *nonfinite,
                                int device);
/* x *= scale over n elements (f32, f64, f16, bf16), queued on the current stream (no wait). */
dlua_status_t dlua_cuda_grad_scale(const char *op, int dtype, void *x, int64_t n, double scale, int device);
/* *out = sum of |x|^p (or max |x| for p = inf) over n elements, in double, as host/cpu/optim.c's
   dlua_optim_grad_norm_partial: fixed chunks folded in order, no atomics. Waits for the value. */
dlua_status_t dlua_cuda_grad_norm_partial(const char *op, int dtype, const void *x, int64_t n, double p, double *out,
                                          int device);

#ifdef __cplusplus
}
#endif
#endif

/* The element-wise family of the backend table (ops/backend.h): what one element-wise launch gets, and the
   slots a backend fills. host/ops/elementwise.c and host/ops/copy.c fill the descriptor (their iterators merge
   the operands' layouts); host/cpu/elementwise.c, host/cpu/copy.c and host/cuda/elementwise*.cu run it.
   Op positions (`op`) are those of the X-macro lists in host/kernels/elementwise_ops.h, so both backends
   number ops alike. */
#ifndef DLUA_KERNELS_EW_H
#define DLUA_KERNELS_EW_H
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a launch does (dlua_ew_desc_t.family). */
enum {
  DLUA_EW_UNARY,   /* o = f(a, p1, p2);                 ops: o, a */
  DLUA_EW_BINARY,  /* o = f(a, b, alpha) (mode 0), f(a, s) (1), f(s, a) (2); ops: o, a[, b] */
  DLUA_EW_TERNARY, /* x = f(x, a, b, value);            ops: x, a, b */
  DLUA_EW_WHERE,   /* o = c ? a : b, bits of `elsize`;  ops: o, c (uint8), a, b */
  DLUA_EW_MFILL,   /* if m: o = bits i[0];              ops: o, m (uint8) */
  DLUA_EW_FILL,    /* o = bits i[0];                    ops: o */
  DLUA_EW_COPY,    /* o = convert(a) from src_dtype to dtype, copy_'s rules; ops: o, a */
};

enum { DLUA_EW_MAX_OPS = 4 };

/* One launch: operand 0 is the output; every operand is viewed at the iteration shape (dims ordered outer to
   inner, broadcast dims with stride 0), merged where memory allows. Pointers are addresses on `device`. */
typedef struct {
  int family, op;
  int dtype;     /* unary/binary/ternary: the compute storage dtype of the inputs (and of the output
                    unless the op is a predicate, whose output is bool); copy: the destination's */
  int src_dtype; /* copy: the source's dtype */
  int elsize;    /* where/mfill/fill: bytes per element (1, 2, 4, 8) */
  int nops, ndim;
  int64_t numel;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t strides[DLUA_EW_MAX_OPS][DLUA_MAX_DIMS]; /* bytes */
  int64_t inner[DLUA_EW_MAX_OPS];                  /* the innermost stride, in elements of each operand */
  char *base[DLUA_EW_MAX_OPS];
  double d[2];   /* float scalars: unary p1, p2; binary alpha, s; ternary value */
  int64_t i[2];  /* the same as integers (bounds that do not survive double), or fill bits */
  int mode;      /* binary: 0 tensor-tensor, 1 a op s, 2 s op a */
  int device;
} dlua_ew_desc_t;

struct dlua_ew_ops {
  /* The maps (families UNARY .. MFILL) over the merged iterator. */
  dlua_status_t (*run)(const char *op, const dlua_ew_desc_t *e);
  /* copy_ and fill_ (families COPY, FILL): two operands (one for FILL), sizes and byte strides merged. */
  dlua_status_t (*copy)(const char *op, const dlua_ew_desc_t *e);
  /* `bytes` of contiguous memory at src on `device` into host memory dst, after the work queued there that
     writes src; returns when dst holds them (to_data). */
  dlua_status_t (*download)(const char *op, void *dst, const void *src, size_t bytes, int device);
};

extern const struct dlua_ew_ops dlua_cpu_ew_ops, dlua_cuda_ew_ops;

#ifdef __cplusplus
}
#endif
#endif

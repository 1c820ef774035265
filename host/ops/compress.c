/* The front doors of gradient compression for DDP's communication hooks (lua/dlua/compress.lua, docs/ddp.md):
   16-bit casts, top-k pack and scatter-add with error feedback, PowerSGD's orthogonalisation. Checks, the
   descriptor, then the compression slots of the optim family (host/kernels/optim.h; the CPU runs them in
   host/cpu/compress.c, the CUDA table leaves them NULL). */
#include "ops/compress.h"
#include <inttypes.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/optim.h"
#include "ops/backend.h"
#include "ops/common.h"

/* The first tensor of an op: given, live, and its device's optim table holds the op's slot. */
#define FIRST_BACKEND(op, what, t, slot, k)                                        \
  do {                                                                             \
    if (!(t)) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is missing", op, what);        \
    DLUA_TRY(dlua_ops_check_input(op, t, NULL));                                   \
    DLUA_TRY(DLUA_BACKEND(op, (t)->device, optim, slot, k));                       \
  } while (0)

/* t must be a live, contiguous tensor of dtype (or of f16/bf16 when dtype is F16 and half is set), on the
   device of first (when given). */
static dlua_status_t need(const char *op, const char *what, const dlua_tensor_t *t, dlua_dtype_t dtype, int half,
                          const dlua_tensor_t *first) {
  char b[200];
  if (!t) return DLUA_ERR(DLUA_ERR_ARG, "%s: %s is missing", op, what);
  DLUA_TRY(dlua_ops_check_input(op, t, first));
  int ok = half ? (t->dtype == DLUA_DTYPE_F16 || t->dtype == DLUA_DTYPE_BF16) : t->dtype == dtype;
  if (!ok)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be %s, got %s", op, what, half ? "float16 or bfloat16" : dlua_dtype_name(dtype),
                    dlua_tensor_describe(t, b, sizeof b));
  if (!dlua_tensor_is_contiguous(t))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s must be contiguous, got %s", op, what, dlua_tensor_describe(t, b, sizeof b));
  return DLUA_OK;
}

static dlua_status_t same_numel(const char *op, const char *wa, const dlua_tensor_t *a, const char *wb,
                                const dlua_tensor_t *b) {
  int64_t na = dlua_tensor_numel(a), nb = dlua_tensor_numel(b);
  if (na != nb)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s has %" PRId64 " elements, %s %" PRId64, op, wa, na, wb, nb);
  return DLUA_OK;
}

/* ---- 16-bit casts ------------------------------------------------------------------------- */

// src (n) f32 -> dst (n) f16/bf16, times scale
dlua_status_t dlua_compress_to_half(dlua_tensor_t *dst, const dlua_tensor_t *src, double scale) {
  const char *op = "compress_to_half";
  const struct dlua_optim_ops *k;
  FIRST_BACKEND(op, "the output", dst, compress_to_half, &k);
  DLUA_TRY(need(op, "the output", dst, DLUA_DTYPE_F16, 1, NULL));
  DLUA_TRY(need(op, "the input", src, DLUA_DTYPE_F32, 0, dst));
  DLUA_TRY(same_numel(op, "the output", dst, "the input", src));
  dlua_compress_cast_desc_t d = {.dst = dlua_tensor_ptr(dst), .src = dlua_tensor_ptr(src),
                                 .n = dlua_tensor_numel(src), .scale = scale, .half_dtype = (int)dst->dtype,
                                 .device = dst->device};
  return k->compress_to_half(op, &d);
}

// src (n) f16/bf16 -> dst (n) f32
dlua_status_t dlua_compress_from_half(dlua_tensor_t *dst, const dlua_tensor_t *src) {
  const char *op = "compress_from_half";
  const struct dlua_optim_ops *k;
  FIRST_BACKEND(op, "the output", dst, compress_from_half, &k);
  DLUA_TRY(need(op, "the output", dst, DLUA_DTYPE_F32, 0, NULL));
  DLUA_TRY(need(op, "the input", src, DLUA_DTYPE_F16, 1, dst));
  DLUA_TRY(same_numel(op, "the output", dst, "the input", src));
  dlua_compress_cast_desc_t d = {.dst = dlua_tensor_ptr(dst), .src = dlua_tensor_ptr(src),
                                 .n = dlua_tensor_numel(src), .scale = 1.0, .half_dtype = (int)src->dtype,
                                 .device = dst->device};
  return k->compress_from_half(op, &d);
}

/* ---- top-k -------------------------------------------------------------------------------- */

/* packed (2k) int32; grad (n) f32; acc, mom (n) f32 or NULL. */
dlua_status_t dlua_compress_topk(dlua_tensor_t *packed, const dlua_tensor_t *grad, dlua_tensor_t *acc, dlua_tensor_t *mom,
                                 double momentum, int64_t k) {
  const char *op = "compress_topk";
  const struct dlua_optim_ops *ops;
  FIRST_BACKEND(op, "the gradient", grad, compress_topk, &ops);
  DLUA_TRY(need(op, "the gradient", grad, DLUA_DTYPE_F32, 0, NULL));
  DLUA_TRY(need(op, "the packed buffer", packed, DLUA_DTYPE_I32, 0, grad));
  int64_t n = dlua_tensor_numel(grad);
  if (k < 0 || k > n)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: k = %" PRId64 " is out of range for a bucket of %" PRId64 " elements", op, k, n);
  if (n > INT32_MAX)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: a bucket of %" PRId64 " elements does not fit 32-bit indices (use a smaller bucket_mb)",
                    op, n);
  if (dlua_tensor_numel(packed) != 2 * k)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the packed buffer has %" PRId64 " elements, expected 2k = %" PRId64, op,
                    dlua_tensor_numel(packed), 2 * k);
  if (mom && !acc) return DLUA_ERR(DLUA_ERR_ARG, "%s: momentum correction needs the accumulator (error feedback)", op);
  if (acc) {
    DLUA_TRY(need(op, "the residual", acc, DLUA_DTYPE_F32, 0, grad));
    DLUA_TRY(same_numel(op, "the residual", acc, "the gradient", grad));
  }
  if (mom) {
    DLUA_TRY(need(op, "the momentum buffer", mom, DLUA_DTYPE_F32, 0, grad));
    DLUA_TRY(same_numel(op, "the momentum buffer", mom, "the gradient", grad));
  }
  dlua_compress_topk_desc_t d = {.packed = (int32_t *)dlua_tensor_ptr(packed),
                                 .grad = (const float *)dlua_tensor_ptr(grad),
                                 .acc = acc ? (float *)dlua_tensor_ptr(acc) : NULL,
                                 .mom = mom ? (float *)dlua_tensor_ptr(mom) : NULL,
                                 .momentum = momentum, .n = n, .k = k, .device = grad->device};
  return ops->compress_topk(op, &d);
}

/* grad (n) f32; gathered (rows, 2k) int32, as dlua_compress_topk packed them. */
dlua_status_t dlua_compress_topk_unpack(dlua_tensor_t *grad, const dlua_tensor_t *gathered, int64_t rows, double divisor) {
  const char *op = "compress_topk_unpack";
  const struct dlua_optim_ops *k;
  FIRST_BACKEND(op, "the gradient", grad, compress_topk_unpack, &k);
  DLUA_TRY(need(op, "the gradient", grad, DLUA_DTYPE_F32, 0, NULL));
  DLUA_TRY(need(op, "the gathered buffer", gathered, DLUA_DTYPE_I32, 0, grad));
  int64_t n = dlua_tensor_numel(grad), total = dlua_tensor_numel(gathered);
  if (rows <= 0 || total % (2 * rows))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %" PRId64 " gathered elements are not %" PRId64 " rows of (values, indices)", op,
                    total, rows);
  dlua_compress_unpack_desc_t d = {.grad = (float *)dlua_tensor_ptr(grad),
                                   .gathered = (const int32_t *)dlua_tensor_ptr(gathered), .n = n, .rows = rows,
                                   .k = total / (2 * rows), .divisor = divisor, .device = grad->device};
  return k->compress_topk_unpack(op, &d);
}

/* ---- PowerSGD ----------------------------------------------------------------------------- */

/* p (n, r) f32, row-major: its columns become orthonormal (host/cpu/compress.c says how). */
dlua_status_t dlua_compress_orthogonalize(dlua_tensor_t *p, double eps) {
  const char *op = "compress_orthogonalize";
  char b[200];
  const struct dlua_optim_ops *k;
  FIRST_BACKEND(op, "the matrix", p, compress_orthogonalize, &k);
  DLUA_TRY(need(op, "the matrix", p, DLUA_DTYPE_F32, 0, NULL));
  if (p->ndim != 2) return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a matrix (n, r), got %s", op, dlua_tensor_describe(p, b, sizeof b));
  int64_t n = p->sizes[0], r = p->sizes[1];
  if (n == 0 || r == 0) return DLUA_OK;
  dlua_compress_orth_desc_t d = {.p = (float *)dlua_tensor_ptr(p), .n = n, .r = r, .eps = eps, .device = p->device};
  return k->compress_orthogonalize(op, &d);
}

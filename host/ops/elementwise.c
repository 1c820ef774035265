/* The front doors of the element-wise ops (dlua_tensor_unary, binary, binary_scalar, clamp, where, masked_fill_,
   addcmul_, addcdiv_, lerp_): checks, result dtypes, the `out` convention, then one launch of the ew family of
   the tensors' backend table (host/kernels/ew.h) over a broadcasting strided iterator built here: the merged
   layout of every operand, the same for both backends (host/cpu/elementwise.c, host/cuda/elementwise*.cu). */
#include "ops/elementwise.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/elementwise_ops.h"
#include "kernels/ew.h"
#include "ops/backend.h"
#include "ops/common.h"

/* ---- op tables derived from the X-macro lists (positions: EWU_/EWB_/EWT_, kernels/elementwise_ops.h) --- */

enum { EW_KIND_ARITH, EW_KIND_FLOAT, EW_KIND_PRED };

_Static_assert((int)EWU_LOGICAL_NOT == (int)DLUA_UNARY_LOGICAL_NOT && (int)EWU_CLAMP == (int)DLUA_UNARY_COUNT,
               "DLUA_EW_UNARY_OPS must list the public unary ops in enum order");
_Static_assert((int)EWB_ATAN2 == (int)DLUA_BINARY_ATAN2 && (int)EWB_LOGICAL_XOR == (int)DLUA_BINARY_LOGICAL_XOR &&
                   (int)EWB_LERP == (int)DLUA_BINARY_COUNT,
               "DLUA_EW_BINARY_OPS must list the public binary ops in enum order");

#define EW_KIND_ENTRY(NAME, name, kind) EW_KIND_##kind,
#define EW_NAME_ENTRY(NAME, name, kind) #name,
static const int unary_kind[EWU_COUNT] = {DLUA_EW_UNARY_OPS(EW_KIND_ENTRY)};
static const int binary_kind[EWB_COUNT] = {DLUA_EW_BINARY_OPS(EW_KIND_ENTRY)};
static const char *const unary_name[EWU_COUNT] = {DLUA_EW_UNARY_OPS(EW_NAME_ENTRY)};
static const char *const binary_name[EWB_COUNT] = {DLUA_EW_BINARY_OPS(EW_NAME_ENTRY)};

/* ---- the iterator --------------------------------------------------------------------------- */

/* The layout of a launch, in e: operand 0 is the output; all operands are viewed at the output's shape
   (broadcast dims have stride 0), dims ordered outer to inner and merged where memory allows. */
typedef dlua_ew_desc_t ew_iter_t;
#define EW_MAX_OPS DLUA_EW_MAX_OPS


/* Whether dim `outer` should rather be inside dim `inner`: the first operand with both strides
   nonzero and different decides (the output first, so writes stay sequential). */
static int ew_should_swap(const ew_iter_t *it, int outer, int inner) {
  for (int k = 0; k < it->nops; k++) {
    int64_t so = llabs(it->strides[k][outer]), si = llabs(it->strides[k][inner]);
    if (so == 0 || si == 0 || so == si) continue;
    return so < si;
  }
  return 0;
}

/* ops[0] is the output (its shape is the iteration shape); the others broadcast to it. */
static void ew_iter_init(ew_iter_t *it, int nops, const dlua_tensor_t *const *ops) {
  const dlua_tensor_t *o = ops[0];
  int nd = o->ndim;
  it->nops = nops;
  it->numel = dlua_shape_numel(nd, o->sizes);
  int64_t sizes[DLUA_MAX_DIMS], bs[EW_MAX_OPS][DLUA_MAX_DIMS];
  for (int k = 0; k < nops; k++) {
    const dlua_tensor_t *t = ops[k];
    int64_t es = (int64_t)dlua_dtype_size(t->dtype);
    it->base[k] = dlua_tensor_ptr(t);
    for (int d = 0; d < nd; d++) {
      int td = d - (nd - t->ndim);
      bs[k][d] = (td < 0 || t->sizes[td] == 1) ? 0 : t->strides[td] * es;
    }
  }
  // Keep only dims of size > 1, then order them by stride.
  int perm[DLUA_MAX_DIMS], n = 0;
  for (int d = 0; d < nd; d++)
    if (o->sizes[d] != 1) perm[n++] = d;
  for (int d = 0; d < nd; d++) sizes[d] = o->sizes[d];
  it->ndim = 0;
  for (int k = 0; k < nops; k++)
    for (int d = 0; d < nd; d++) it->strides[k][d] = bs[k][d];
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && ew_should_swap(it, perm[j - 1], perm[j]); j--) {
      int tmp = perm[j];
      perm[j] = perm[j - 1];
      perm[j - 1] = tmp;
    }
  // Merge neighbours that walk memory as one dim for every operand.
  int m = 0;
  for (int i = 0; i < n; i++) {
    int d = perm[i];
    if (m > 0) {
      int mergeable = 1;
      for (int k = 0; k < nops && mergeable; k++) mergeable = it->strides[k][m - 1] == bs[k][d] * sizes[d];
      if (mergeable) {
        it->sizes[m - 1] *= sizes[d];
        for (int k = 0; k < nops; k++) it->strides[k][m - 1] = bs[k][d];
        continue;
      }
    }
    it->sizes[m] = sizes[d];
    for (int k = 0; k < nops; k++) it->strides[k][m] = bs[k][d];
    m++;
  }
  if (m == 0) {  // a single element (or every dim of size 1)
    it->sizes[0] = 1;
    for (int k = 0; k < nops; k++) it->strides[k][0] = 0;
    m = 1;
  }
  it->ndim = m;
  for (int k = 0; k < nops; k++)
    it->inner[k] = it->strides[k][m - 1] / (int64_t)dlua_dtype_size(ops[k]->dtype);
}

/* ---- argument checks and the `out` convention --------------------------------------------- */


static void byte_extent(const dlua_tensor_t *t, uintptr_t *lo, uintptr_t *hi) {
  uintptr_t p = (uintptr_t)dlua_tensor_ptr(t);
  int64_t es = (int64_t)dlua_dtype_size(t->dtype), neg = 0, pos = es;
  for (int d = 0; d < t->ndim; d++) {
    int64_t span = (t->sizes[d] - 1) * t->strides[d] * es;
    if (span < 0) neg += span;
    else pos += span;
  }
  *lo = p + (uintptr_t)neg;
  *hi = p + (uintptr_t)pos;
}

/* Whether writing `out` element by element could clobber an element of `in` before it is read:
   true when their memory intersects, unless `in` (broadcast to out's shape) is exactly out. */
static int unsafe_overlap(const dlua_tensor_t *out, const dlua_tensor_t *in) {
  if (out->storage != in->storage) return 0;
  if (dlua_shape_numel(out->ndim, out->sizes) == 0 || dlua_shape_numel(in->ndim, in->sizes) == 0) return 0;
  uintptr_t olo, ohi, ilo, ihi;
  byte_extent(out, &olo, &ohi);
  byte_extent(in, &ilo, &ihi);
  if (ohi <= ilo || ihi <= olo) return 0;
  if (dlua_tensor_ptr(out) != dlua_tensor_ptr(in) || dlua_dtype_size(out->dtype) != dlua_dtype_size(in->dtype))
    return 1;
  for (int d = 0; d < out->ndim; d++) {
    if (out->sizes[d] == 1) continue;
    int id = d - (out->ndim - in->ndim);
    int64_t s = (id < 0 || in->sizes[id] == 1) ? 0 : in->strides[id];
    if (s != out->strides[d]) return 1;
  }
  return 0;
}

/* Runs the launch described by e (family, op, dtype, elsize and scalars set by the caller) over (*out, ins...) at
   shape (nd, shape). The kernel computes in dtype `rdt` for its output and reads inputs of dtype in_dt[i] (-1: as
   they are). Resolves the `out` convention: allocates *out, or writes through a temporary when *out has another
   dtype, and copies inputs that differ in dtype or that partially overlap the output. */
static dlua_status_t ew_exec(const char *op, dlua_tensor_t **out, dlua_dtype_t rdt, int nd, const int64_t *shape,
                             int nin, const dlua_tensor_t *const *ins, const int *in_dt, dlua_ew_desc_t *e) {
  const int device = ins[0]->device;  // dlua_ops_check_input made every operand agree
  const struct dlua_ew_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, device, ew, run, &k));
  int allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, out, nd, shape, rdt, device, &allocated));
  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *tmp_out = NULL, *tmp_in[EW_MAX_OPS] = {NULL};
  const dlua_tensor_t *ops[EW_MAX_OPS];
  dlua_tensor_t *dst = *out;
  if (!allocated) {
    s = dlua_ops_check_writable(op, dst);
    if (s == DLUA_OK && dst->dtype != rdt) {
      s = dlua_tensor_empty(&tmp_out, nd, shape, rdt, device);
      dst = tmp_out;
    }
  }
  for (int i = 0; i < nin && s == DLUA_OK; i++) {
    ops[i + 1] = ins[i];
    if (in_dt[i] >= 0 && ins[i]->dtype != (dlua_dtype_t)in_dt[i]) {
      s = dlua_tensor_to_dtype(&tmp_in[i], ins[i], (dlua_dtype_t)in_dt[i]);
      ops[i + 1] = tmp_in[i];
    } else if (!allocated && unsafe_overlap(dst, ins[i])) {
      s = dlua_tensor_clone(&tmp_in[i], ins[i]);
      ops[i + 1] = tmp_in[i];
    }
  }
  if (s == DLUA_OK) {
    ops[0] = dst;
    ew_iter_init(e, nin + 1, ops);
    e->src_dtype = e->dtype;
    e->device = device;
    s = k->run(op, e);
    if (s == DLUA_OK && tmp_out) s = dlua_tensor_copy_(*out, tmp_out);
  }
  dlua_tensor_free(tmp_out);
  for (int i = 0; i < nin; i++) dlua_tensor_free(tmp_in[i]);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

/* A double that converts to int64 exactly. */
static int is_int_scalar(double s) { return isfinite(s) && s == floor(s) && fabs(s) < 9.2233720368547758e18; }

static dlua_status_t check_no_zero(const char *op, const dlua_tensor_t *b) {
  dlua_tensor_t *z = NULL, *any = NULL;
  DLUA_TRY(dlua_tensor_binary_scalar(&z, b, 0, DLUA_BINARY_EQ, 0));
  dlua_status_t s = dlua_tensor_reduce(&any, NULL, z, DLUA_REDUCE_ANY, 0, NULL, 0, 0, 0);
  uint8_t flag = 0;  // read through to_data: `any` lives on b's device
  if (s == DLUA_OK) s = dlua_tensor_to_data(any, &flag, 1);
  int has_zero = s == DLUA_OK && flag;
  dlua_tensor_free(z);
  dlua_tensor_free(any);
  if (s != DLUA_OK) return s;
  if (has_zero) return DLUA_ERR(DLUA_ERR_ARG, "%s: integer division by zero", op);
  return DLUA_OK;
}

static void params_set(dlua_ew_desc_t *pp, int k, double v) {
  pp->d[k] = v;
  pp->i[k] = is_int_scalar(v) ? (int64_t)v : 0;
}

/* ---- public entry points ------------------------------------------------------------------ */

dlua_status_t dlua_tensor_unary(dlua_tensor_t **out, const dlua_tensor_t *a, dlua_unary_op_t op) {
  if ((int)op < 0 || op >= DLUA_UNARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "unary: unknown op %d", (int)op);
  const char *name = unary_name[op];
  DLUA_TRY(dlua_ops_check_input(name, a, NULL));
  dlua_dtype_t ct = a->dtype;
  int kind = unary_kind[op];
  if (kind == EW_KIND_FLOAT && !dlua_dtype_is_floating(ct)) ct = DLUA_DTYPE_F32;
  if (op == DLUA_UNARY_NEG && ct == DLUA_DTYPE_BOOL)
    return DLUA_ERR(DLUA_ERR_ARG, "neg: negating a bool tensor is not supported; use logical_not");
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  int in_dt = (int)ct;
  pp.family = DLUA_EW_UNARY;
  pp.op = (int)op;
  pp.dtype = (int)ct;
  pp.elsize = 0;
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, a->ndim, a->sizes, 1, &a, &in_dt, &pp);
}

dlua_status_t dlua_tensor_binary(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b,
                                 dlua_binary_op_t op, double alpha) {
  if ((int)op < 0 || op >= DLUA_BINARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "binary: unknown op %d", (int)op);
  const char *name = binary_name[op];
  DLUA_TRY(dlua_ops_check_input(name, a, NULL));
  DLUA_TRY(dlua_ops_check_input(name, b, a));
  int nd;
  int64_t shape[DLUA_MAX_DIMS];
  DLUA_TRY(dlua_broadcast_shapes(name, a->ndim, a->sizes, b->ndim, b->sizes, &nd, shape));
  int kind = binary_kind[op];
  dlua_dtype_t ct = dlua_dtype_promote(a->dtype, b->dtype);
  if (kind == EW_KIND_FLOAT && !dlua_dtype_is_floating(ct)) ct = DLUA_DTYPE_F32;
  if (ct == DLUA_DTYPE_BOOL && op == DLUA_BINARY_SUB)
    return DLUA_ERR(DLUA_ERR_ARG, "sub: subtracting bool tensors is not supported; use logical_xor");
  int has_alpha = op == DLUA_BINARY_ADD || op == DLUA_BINARY_SUB;
  if (!has_alpha) alpha = 1;
  if (!dlua_dtype_is_floating(ct) && !is_int_scalar(alpha))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: alpha %g must be an integer for %s tensors", name, alpha, dlua_dtype_name(ct));
  if ((op == DLUA_BINARY_FMOD || op == DLUA_BINARY_REMAINDER) && !dlua_dtype_is_floating(ct))
    DLUA_TRY(check_no_zero(name, b));
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, alpha);
  const dlua_tensor_t *ins[2] = {a, b};
  int in_dt[2] = {(int)ct, (int)ct};
  pp.family = DLUA_EW_BINARY;
  pp.op = (int)op;
  pp.dtype = (int)ct;
  pp.elsize = 0;
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, nd, shape, 2, ins, in_dt, &pp);
}

dlua_status_t dlua_tensor_binary_scalar(dlua_tensor_t **out, const dlua_tensor_t *a, double s, dlua_binary_op_t op,
                                        int scalar_first) {
  if ((int)op < 0 || op >= DLUA_BINARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "binary: unknown op %d", (int)op);
  const char *name = binary_name[op];
  DLUA_TRY(dlua_ops_check_input(name, a, NULL));
  int kind = binary_kind[op];
  dlua_dtype_t ct = a->dtype;
  // PyTorch: a scalar never widens a float tensor; a fractional one makes an integer tensor
  // float32; bool arithmetic with a number counts in int64.
  if (!dlua_dtype_is_floating(ct)) {
    if (!is_int_scalar(s) || kind == EW_KIND_FLOAT) ct = DLUA_DTYPE_F32;
    else if (ct == DLUA_DTYPE_BOOL && kind != EW_KIND_PRED) ct = DLUA_DTYPE_I64;
  }
  if (!dlua_dtype_is_floating(ct)) {
    if (op == DLUA_BINARY_POW && !scalar_first && s < 0)
      return DLUA_ERR(DLUA_ERR_ARG, "pow: integers to negative integer powers are not allowed (%s tensor ** %g)",
                      dlua_dtype_name(ct), s);
    if (op == DLUA_BINARY_FMOD || op == DLUA_BINARY_REMAINDER) {
      if (!scalar_first && s == 0) return DLUA_ERR(DLUA_ERR_ARG, "%s: integer division by zero", name);
      if (scalar_first) DLUA_TRY(check_no_zero(name, a));
    }
  }
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, 1);
  params_set(&pp, 1, s);
  pp.mode = scalar_first ? 2 : 1;
  int in_dt = (int)ct;
  pp.family = DLUA_EW_BINARY;
  pp.op = (int)op;
  pp.dtype = (int)ct;
  pp.elsize = 0;
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, a->ndim, a->sizes, 1, &a, &in_dt, &pp);
}

dlua_status_t dlua_tensor_clamp(dlua_tensor_t **out, const dlua_tensor_t *a, double low, double high) {
  DLUA_TRY(dlua_ops_check_input("clamp", a, NULL));
  dlua_dtype_t ct = a->dtype;
  if (!dlua_dtype_is_floating(ct) && ((!isnan(low) && !is_int_scalar(low)) || (!isnan(high) && !is_int_scalar(high))))
    ct = DLUA_DTYPE_F32;
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  // A NaN bound means no bound: the widest value of the compute type stands in for it.
  pp.d[0] = isnan(low) ? -INFINITY : low;
  pp.d[1] = isnan(high) ? INFINITY : high;
  pp.i[0] = is_int_scalar(low) ? (int64_t)low : INT64_MIN;
  pp.i[1] = is_int_scalar(high) ? (int64_t)high : INT64_MAX;
  int in_dt = (int)ct;
  pp.family = DLUA_EW_UNARY;
  pp.op = EWU_CLAMP;
  pp.dtype = (int)ct;
  pp.elsize = 0;
  return ew_exec("clamp", out, ct, a->ndim, a->sizes, 1, &a, &in_dt, &pp);
}

dlua_status_t dlua_tensor_where(dlua_tensor_t **out, const dlua_tensor_t *cond, const dlua_tensor_t *a,
                                const dlua_tensor_t *b) {
  DLUA_TRY(dlua_ops_check_input("where", cond, NULL));
  DLUA_TRY(dlua_ops_check_input("where", a, cond));
  DLUA_TRY(dlua_ops_check_input("where", b, cond));
  if (cond->dtype != DLUA_DTYPE_BOOL && cond->dtype != DLUA_DTYPE_U8)
    return DLUA_ERR(DLUA_ERR_ARG, "where: the condition must be bool (or uint8), got %s", dlua_dtype_name(cond->dtype));
  int nab, nd;
  int64_t sab[DLUA_MAX_DIMS], shape[DLUA_MAX_DIMS];
  DLUA_TRY(dlua_broadcast_shapes("where", a->ndim, a->sizes, b->ndim, b->sizes, &nab, sab));
  DLUA_TRY(dlua_broadcast_shapes("where", cond->ndim, cond->sizes, nab, sab, &nd, shape));
  dlua_dtype_t rdt = dlua_dtype_promote(a->dtype, b->dtype);
  const dlua_tensor_t *ins[3] = {cond, a, b};
  int in_dt[3] = {-1, (int)rdt, (int)rdt};
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  pp.family = DLUA_EW_WHERE;
  pp.op = 0;
  pp.dtype = (int)rdt;
  pp.elsize = (int)dlua_dtype_size(rdt);
  return ew_exec("where", out, rdt, nd, shape, 3, ins, in_dt, &pp);
}

/* Checks that `other` broadcasts to t's own shape (in-place ops cannot grow t). */
static dlua_status_t check_broadcasts_to(const char *op, const dlua_tensor_t *t, const dlua_tensor_t *other) {
  int nd;
  int64_t shape[DLUA_MAX_DIMS];
  DLUA_TRY(dlua_broadcast_shapes(op, t->ndim, t->sizes, other->ndim, other->sizes, &nd, shape));
  int same = nd == t->ndim;
  for (int d = 0; same && d < nd; d++) same = shape[d] == t->sizes[d];
  if (!same) {
    char b1[200], b2[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s does not broadcast to the shape of the tensor updated in place, %s", op,
                    dlua_tensor_describe(other, b1, sizeof b1), dlua_tensor_describe(t, b2, sizeof b2));
  }
  return DLUA_OK;
}

dlua_status_t dlua_tensor_masked_fill_(dlua_tensor_t *t, const dlua_tensor_t *mask, double value) {
  const char *op = "masked_fill_";
  DLUA_TRY(dlua_ops_check_input(op, t, NULL));
  DLUA_TRY(dlua_ops_check_input(op, mask, t));
  if (mask->dtype != DLUA_DTYPE_BOOL && mask->dtype != DLUA_DTYPE_U8)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: the mask must be bool (or uint8), got %s", op, dlua_dtype_name(mask->dtype));
  DLUA_TRY(check_broadcasts_to(op, t, mask));
  if (!dlua_dtype_is_floating(t->dtype) && t->dtype != DLUA_DTYPE_BOOL && !is_int_scalar(trunc(value)))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: value %g cannot be stored in a %s tensor", op, value, dlua_dtype_name(t->dtype));
  // The value's bits in t's dtype, so the kernel only moves bits.
  union {
    float f;
    double d;
    uint16_t h;
    int32_t i32;
    int64_t i64;
    uint8_t u8;
    uint64_t bits;
  } v;
  v.bits = 0;
  switch (t->dtype) {
    case DLUA_DTYPE_F32: v.f = (float)value; break;
    case DLUA_DTYPE_F64: v.d = value; break;
    case DLUA_DTYPE_F16: v.h = dlua_f32_to_f16_inl((float)value); break;
    case DLUA_DTYPE_BF16: v.h = dlua_f32_to_bf16_inl((float)value); break;
    case DLUA_DTYPE_I32: v.i32 = (int32_t)(int64_t)trunc(value); break;
    case DLUA_DTYPE_I64: v.i64 = (int64_t)trunc(value); break;
    case DLUA_DTYPE_U8: v.u8 = (uint8_t)(int64_t)trunc(value); break;
    default: v.u8 = value != 0; break;
  }
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  size_t es = dlua_dtype_size(t->dtype);
  switch (es) {
    case 1: pp.i[0] = v.u8; break;
    case 2: pp.i[0] = v.h; break;
    case 4: pp.i[0] = (int64_t)(uint32_t)v.i32; break;
    default: pp.i[0] = v.i64; break;
  }
  int in_dt = -1;
  dlua_tensor_t *dst = t;
  pp.family = DLUA_EW_MFILL;
  pp.op = 0;
  pp.dtype = (int)t->dtype;
  pp.elsize = (int)es;
  return ew_exec(op, &dst, t->dtype, t->ndim, t->sizes, 1, &mask, &in_dt, &pp);
}

static dlua_status_t addc(const char *op, int top, dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b,
                          double value) {
  DLUA_TRY(dlua_ops_check_input(op, t, NULL));
  DLUA_TRY(dlua_ops_check_input(op, a, t));
  DLUA_TRY(dlua_ops_check_input(op, b, t));
  DLUA_TRY(check_broadcasts_to(op, t, a));
  DLUA_TRY(check_broadcasts_to(op, t, b));
  dlua_dtype_t ct = t->dtype;
  if (!dlua_dtype_is_floating(ct)) {
    if (top == EWT_ADDCDIV)
      return DLUA_ERR(DLUA_ERR_ARG, "%s: integer division is not supported (tensor is %s)", op, dlua_dtype_name(ct));
    if (dlua_dtype_is_floating(a->dtype) || dlua_dtype_is_floating(b->dtype))
      return DLUA_ERR(DLUA_ERR_ARG, "%s: a floating-point result cannot be stored in the %s tensor", op,
                      dlua_dtype_name(ct));
    if (!is_int_scalar(value))
      return DLUA_ERR(DLUA_ERR_ARG, "%s: value %g must be an integer for a %s tensor", op, value, dlua_dtype_name(ct));
  }
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, value);
  const dlua_tensor_t *ins[2] = {a, b};
  int in_dt[2] = {(int)ct, (int)ct};
  dlua_tensor_t *dst = t;
  pp.family = DLUA_EW_TERNARY;
  pp.op = top;
  pp.dtype = (int)ct;
  pp.elsize = 0;
  return ew_exec(op, &dst, ct, t->ndim, t->sizes, 2, ins, in_dt, &pp);
}

dlua_status_t dlua_tensor_addcmul_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value) {
  return addc("addcmul_", EWT_ADDCMUL, t, a, b, value);
}

dlua_status_t dlua_tensor_addcdiv_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value) {
  return addc("addcdiv_", EWT_ADDCDIV, t, a, b, value);
}

dlua_status_t dlua_tensor_lerp_(dlua_tensor_t *t, const dlua_tensor_t *end, double weight) {
  const char *op = "lerp_";
  DLUA_TRY(dlua_ops_check_input(op, t, NULL));
  DLUA_TRY(dlua_ops_check_input(op, end, t));
  DLUA_TRY(check_broadcasts_to(op, t, end));
  if (!dlua_dtype_is_floating(t->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a floating-point tensor, got %s", op, dlua_dtype_name(t->dtype));
  dlua_ew_desc_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, weight);
  const dlua_tensor_t *ins[2] = {t, end};
  int in_dt[2] = {(int)t->dtype, (int)t->dtype};
  dlua_tensor_t *dst = t;
  pp.family = DLUA_EW_BINARY;
  pp.op = EWB_LERP;
  pp.dtype = (int)t->dtype;
  pp.elsize = 0;
  return ew_exec(op, &dst, t->dtype, t->ndim, t->sizes, 2, ins, in_dt, &pp);
}

/* CPU element-wise ops: a broadcasting strided iterator feeding the bodies of elementwise_ops.h. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/elementwise_ops.h"
#include "cuda/kernels.h" /* plain C: the launch descriptor; only CUDA builds call into it */

/* ---- op tables derived from the X-macro lists ----------------------------------------------- */

enum { EW_KIND_ARITH, EW_KIND_FLOAT, EW_KIND_PRED };

#define EW_ENUM_U(NAME, name, kind) EWU_##NAME,
#define EW_ENUM_B(NAME, name, kind) EWB_##NAME,
#define EW_ENUM_T(NAME, name, kind) EWT_##NAME,
enum { DLUA_EW_UNARY_OPS(EW_ENUM_U) EWU_COUNT };
enum { DLUA_EW_BINARY_OPS(EW_ENUM_B) EWB_COUNT };
enum { DLUA_EW_TERNARY_OPS(EW_ENUM_T) EWT_COUNT };
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

enum { EW_MAX_OPS = 4 };
/* Below this many elements a loop runs on the calling thread: a parallel region costs more. */
enum { EW_GRAIN = 32768 };

/* Operand 0 is the output; all operands are viewed at the output's shape (broadcast dims have
   stride 0), dims ordered outer to inner and merged where memory allows. */
typedef struct {
  int ndim, nops;
  int64_t numel;
  int64_t sizes[DLUA_MAX_DIMS];
  int64_t bstrides[EW_MAX_OPS][DLUA_MAX_DIMS]; /* bytes */
  int64_t inner[EW_MAX_OPS];                   /* innermost stride, in elements */
  char *base[EW_MAX_OPS];
} ew_iter_t;

/* Scalars of a kernel, in both representations: int64 bounds do not survive a trip through
   double. Unary: p1, p2 = [0], [1]; binary: alpha = [0], scalar = [1]; ternary: value = [0]. */
typedef struct {
  double d[2];
  int64_t i[2];
  int mode; /* binary: 0 tensor-tensor, 1 a op scalar, 2 scalar op a */
} ew_params_t;

typedef void (*ew_kernel_t)(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp);

/* Whether dim `outer` should rather be inside dim `inner`: the first operand with both strides
   nonzero and different decides (the output first, so writes stay sequential). */
static int ew_should_swap(const ew_iter_t *it, int outer, int inner) {
  for (int k = 0; k < it->nops; k++) {
    int64_t so = llabs(it->bstrides[k][outer]), si = llabs(it->bstrides[k][inner]);
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
    for (int d = 0; d < nd; d++) it->bstrides[k][d] = bs[k][d];
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
      for (int k = 0; k < nops && mergeable; k++) mergeable = it->bstrides[k][m - 1] == bs[k][d] * sizes[d];
      if (mergeable) {
        it->sizes[m - 1] *= sizes[d];
        for (int k = 0; k < nops; k++) it->bstrides[k][m - 1] = bs[k][d];
        continue;
      }
    }
    it->sizes[m] = sizes[d];
    for (int k = 0; k < nops; k++) it->bstrides[k][m] = bs[k][d];
    m++;
  }
  if (m == 0) {  // a single element (or every dim of size 1)
    it->sizes[0] = 1;
    for (int k = 0; k < nops; k++) it->bstrides[k][0] = 0;
    m = 1;
  }
  it->ndim = m;
  for (int k = 0; k < nops; k++)
    it->inner[k] = it->bstrides[k][m - 1] / (int64_t)dlua_dtype_size(ops[k]->dtype);
}

/* Multi-index and operand addresses of linear element `pos` (row-major over it->sizes). */
static inline void ew_seek(const ew_iter_t *it, int64_t pos, int64_t *idx, char **ptr) {
  for (int k = 0; k < it->nops; k++) ptr[k] = it->base[k];
  for (int d = it->ndim - 1; d >= 0; d--) {
    idx[d] = pos % it->sizes[d];
    pos /= it->sizes[d];
    for (int k = 0; k < it->nops; k++) ptr[k] += idx[d] * it->bstrides[k][d];
  }
}

/* Steps n elements along the innermost dim (never past its end) and carries outwards. */
static inline void ew_next(const ew_iter_t *it, int64_t *idx, char **ptr, int64_t n) {
  int d = it->ndim - 1;
  idx[d] += n;
  for (int k = 0; k < it->nops; k++) ptr[k] += n * it->bstrides[k][d];
  while (d > 0 && idx[d] >= it->sizes[d]) {
    for (int k = 0; k < it->nops; k++) ptr[k] += it->bstrides[k][d - 1] - idx[d] * it->bstrides[k][d];
    idx[d] = 0;
    d--;
    idx[d]++;
  }
}

/* Walks elements [lo, hi) as runs along the innermost dim: the body sees ew_p[k] (address of the
   run's first element of operand k) and ew_n (run length). */
#define EW_RUNS_BEGIN(it, lo, hi)                          \
  {                                                        \
    int64_t ew_idx[DLUA_MAX_DIMS];                         \
    char *ew_p[EW_MAX_OPS];                                \
    ew_seek((it), (lo), ew_idx, ew_p);                     \
    const int64_t ew_last = (it)->sizes[(it)->ndim - 1];   \
    for (int64_t ew_pos = (lo); ew_pos < (hi);) {          \
      int64_t ew_n = ew_last - ew_idx[(it)->ndim - 1];     \
      if (ew_n > (hi)-ew_pos) ew_n = (hi)-ew_pos;
#define EW_RUNS_END(it)              \
  ew_pos += ew_n;                    \
  ew_next((it), ew_idx, ew_p, ew_n); \
  }                                  \
  }

/* Splits [0, numel) into one contiguous piece per thread: element-wise results do not depend
   on the split, and one piece per thread keeps each thread's memory stream sequential. */
static void ew_launch(const ew_iter_t *it, ew_kernel_t kernel, const ew_params_t *pp) {
  int64_t n = it->numel;
  if (n <= 0) return;
  int64_t nt = omp_get_max_threads();
  if (nt > n / EW_GRAIN) nt = n / EW_GRAIN;
  if (nt <= 1 || omp_in_parallel()) {
    kernel(it, 0, n, pp);
    return;
  }
  // Pieces are multiples of 64 elements so every thread starts on a cache line.
  int64_t piece = ((n + nt - 1) / nt + 63) & ~(int64_t)63;
#pragma omp parallel num_threads((int)nt)
  {
    int64_t lo = (int64_t)omp_get_thread_num() * piece;
    int64_t hi = lo + piece < n ? lo + piece : n;
    if (lo < hi) kernel(it, lo, hi, pp);
  }
}

/* ---- kernels, generated per (op, storage dtype) ------------------------------------------ */

/* (storage dtype, C type, compute suffix) */
#define EW_DT_FLOAT(X, ...) \
  X(F32, float, f, __VA_ARGS__) X(F64, double, d, __VA_ARGS__) X(F16, uint16_t, f, __VA_ARGS__) X(BF16, uint16_t, f, __VA_ARGS__)
#define EW_DT_INT(X, ...) \
  X(I32, int32_t, i, __VA_ARGS__) X(I64, int64_t, i, __VA_ARGS__) X(U8, uint8_t, i, __VA_ARGS__) X(BOOL, uint8_t, i, __VA_ARGS__)
#define EW_DT_ARITH(X, ...) EW_DT_FLOAT(X, __VA_ARGS__) EW_DT_INT(X, __VA_ARGS__)
#define EW_DT_PRED(X, ...) EW_DT_ARITH(X, __VA_ARGS__)

/* Which storage dtypes get per-ISA clones (code size: the others are rarely hot). */
#define EW_CLONES_F32 DLUA_CPU_CLONES
#define EW_CLONES_BF16 DLUA_CPU_CLONES
#define EW_CLONES_F64
#define EW_CLONES_F16
#define EW_CLONES_I32
#define EW_CLONES_I64
#define EW_CLONES_U8
#define EW_CLONES_BOOL

#define CT_f float
#define CT_d double
#define CT_i int64_t
#define EW_PARAM_f(pp, k) ((float)(pp)->d[k])
#define EW_PARAM_d(pp, k) ((pp)->d[k])
#define EW_PARAM_i(pp, k) ((pp)->i[k])

#define LD_F32(v) (v)
#define LD_F64(v) (v)
#define LD_F16(v) dlua_f16_to_f32_inl(v)
#define LD_BF16(v) dlua_bf16_to_f32_inl(v)
#define LD_I32(v) ((int64_t)(v))
#define LD_I64(v) (v)
#define LD_U8(v) ((int64_t)(v))
#define LD_BOOL(v) ((int64_t)(v))
#define ST_F32(x) (x)
#define ST_F64(x) (x)
#define ST_F16(x) dlua_f32_to_f16_inl(x)
#define ST_BF16(x) dlua_f32_to_bf16_inl(x)
#define ST_I32(x) ((int32_t)(x))
#define ST_I64(x) (x)
#define ST_U8(x) ((uint8_t)(x))
#define ST_BOOL(x) ((uint8_t)((x) != 0))

#define OUT_T_ARITH(ST) ST
#define OUT_T_FLOAT(ST) ST
#define OUT_T_PRED(ST) uint8_t
#define STORE_ARITH(DT, x) ST_##DT(x)
#define STORE_FLOAT(DT, x) ST_##DT(x)
#define STORE_PRED(DT, x) ((uint8_t)(x))

/* Each kernel is a contiguous loop (`_c`, the only part cloned per ISA: compile time) and a
   strided walker that calls it for unit-stride runs. Contiguous loops get `omp simd`, which also
   states that out == in (exact in-place) is fine, as restrict could not. */
#define GEN_UNARY(DT, ST, CS, name, kind)                                                             \
  EW_CLONES_##DT static void un_##name##_##DT##_c(OUT_T_##kind(ST) *o, const ST *a, int64_t n, CT_##CS p1, \
                                                  CT_##CS p2) {                                        \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                \
        o[i] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i]), p1, p2));                         \
  }                                                                                                     \
  static void un_##name##_##DT(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp) {   \
    const CT_##CS p1 = EW_PARAM_##CS(pp, 0), p2 = EW_PARAM_##CS(pp, 1);                               \
    const int64_t so = it->inner[0], sa = it->inner[1];                                                 \
    EW_RUNS_BEGIN(it, lo, hi)                                                                           \
    OUT_T_##kind(ST) *o = (OUT_T_##kind(ST) *)ew_p[0];                                                  \
    const ST *a = (const ST *)ew_p[1];                                                                  \
    if (so == 1 && sa == 1) {                                                                           \
      un_##name##_##DT##_c(o, a, ew_n, p1, p2);                                                         \
    } else {                                                                                            \
      for (int64_t i = 0; i < ew_n; i++)                                                                \
        o[i * so] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i * sa]), p1, p2));                \
    }                                                                                                   \
    EW_RUNS_END(it)                                                                                     \
  }

/* mode 0: b is a tensor (sb 1, or 0 when broadcast along the run); 1: a op s; 2: s op a. */
#define GEN_BINARY(DT, ST, CS, name, kind)                                                             \
  EW_CLONES_##DT static void bin_##name##_##DT##_c(OUT_T_##kind(ST) *o, const ST *a, const ST *b,        \
                                                   int64_t sb, int64_t n, int mode, CT_##CS s,          \
                                                   CT_##CS al) {                                        \
    if (mode == 0 && sb == 1) {                                                                          \
      _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                \
          o[i] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i]), LD_##DT(b[i]), al));              \
    } else if (mode == 2) {                                                                              \
      _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                \
          o[i] = STORE_##kind(DT, dlua_ew_##name##_##CS(s, LD_##DT(a[i]), al));                          \
    } else {                                                                                             \
      const CT_##CS bv = mode == 0 ? (CT_##CS)LD_##DT(b[0]) : s;                                         \
      _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                \
          o[i] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i]), bv, al));                         \
    }                                                                                                    \
  }                                                                                                      \
  static void bin_##name##_##DT(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp) {   \
    const CT_##CS al = EW_PARAM_##CS(pp, 0), s = EW_PARAM_##CS(pp, 1);                                 \
    const int mode = pp->mode;                                                                           \
    const int64_t so = it->inner[0], sa = it->inner[1], sb = mode == 0 ? it->inner[2] : 0;               \
    EW_RUNS_BEGIN(it, lo, hi)                                                                            \
    OUT_T_##kind(ST) *o = (OUT_T_##kind(ST) *)ew_p[0];                                                   \
    const ST *a = (const ST *)ew_p[1];                                                                   \
    const ST *b = mode == 0 ? (const ST *)ew_p[2] : a;                                                   \
    if (so == 1 && sa == 1 && (sb == 0 || sb == 1)) {                                                           \
      bin_##name##_##DT##_c(o, a, b, sb, ew_n, mode, s, al);                                             \
    } else if (mode == 0) {                                                                              \
      for (int64_t i = 0; i < ew_n; i++)                                                                 \
        o[i * so] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i * sa]), LD_##DT(b[i * sb]), al)); \
    } else if (mode == 1) {                                                                              \
      for (int64_t i = 0; i < ew_n; i++)                                                                 \
        o[i * so] = STORE_##kind(DT, dlua_ew_##name##_##CS(LD_##DT(a[i * sa]), s, al));                  \
    } else {                                                                                             \
      for (int64_t i = 0; i < ew_n; i++)                                                                 \
        o[i * so] = STORE_##kind(DT, dlua_ew_##name##_##CS(s, LD_##DT(a[i * sa]), al));                  \
    }                                                                                                    \
    EW_RUNS_END(it)                                                                                      \
  }

/* x (operand 0) is read and written: x = f(x, a, b, v). */
#define GEN_TERNARY(DT, ST, CS, name, kind)                                                            \
  EW_CLONES_##DT static void ter_##name##_##DT##_c(ST *x, const ST *a, const ST *b, int64_t n, CT_##CS v) { \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                  \
        x[i] = ST_##DT(dlua_ew_##name##_##CS(LD_##DT(x[i]), LD_##DT(a[i]), LD_##DT(b[i]), v));          \
  }                                                                                                      \
  static void ter_##name##_##DT(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp) {   \
    const CT_##CS v = EW_PARAM_##CS(pp, 0);                                                              \
    const int64_t sx = it->inner[0], sa = it->inner[1], sb = it->inner[2];                               \
    EW_RUNS_BEGIN(it, lo, hi)                                                                            \
    ST *x = (ST *)ew_p[0];                                                                               \
    const ST *a = (const ST *)ew_p[1], *b = (const ST *)ew_p[2];                                         \
    if (sx == 1 && sa == 1 && sb == 1) {                                                                 \
      ter_##name##_##DT##_c(x, a, b, ew_n, v);                                                           \
    } else {                                                                                             \
      for (int64_t i = 0; i < ew_n; i++)                                                                 \
        x[i * sx] = ST_##DT(dlua_ew_##name##_##CS(LD_##DT(x[i * sx]), LD_##DT(a[i * sa]), LD_##DT(b[i * sb]), v)); \
    }                                                                                                    \
    EW_RUNS_END(it)                                                                                      \
  }

#define GEN_UNARY_OP(NAME, name, kind) EW_DT_##kind(GEN_UNARY, name, kind)
#define GEN_BINARY_OP(NAME, name, kind) EW_DT_##kind(GEN_BINARY, name, kind)
#define GEN_TERNARY_OP(NAME, name, kind) EW_DT_##kind(GEN_TERNARY, name, kind)
DLUA_EW_UNARY_OPS(GEN_UNARY_OP)
DLUA_EW_BINARY_OPS(GEN_BINARY_OP)
DLUA_EW_TERNARY_OPS(GEN_TERNARY_OP)

/* Tables: [op][dtype]; NULL where the op has no kernel for the dtype (the caller converts). */
#define UN_ENTRY(DT, ST, CS, name, kind) [DLUA_DTYPE_##DT] = un_##name##_##DT,
#define BIN_ENTRY(DT, ST, CS, name, kind) [DLUA_DTYPE_##DT] = bin_##name##_##DT,
#define TER_ENTRY(DT, ST, CS, name, kind) [DLUA_DTYPE_##DT] = ter_##name##_##DT,
#define UN_ROW(NAME, name, kind) {EW_DT_##kind(UN_ENTRY, name, kind)},
#define BIN_ROW(NAME, name, kind) {EW_DT_##kind(BIN_ENTRY, name, kind)},
#define TER_ROW(NAME, name, kind) {EW_DT_##kind(TER_ENTRY, name, kind)},
static const ew_kernel_t unary_kernels[EWU_COUNT][DLUA_DTYPE_COUNT] = {DLUA_EW_UNARY_OPS(UN_ROW)};
static const ew_kernel_t binary_kernels[EWB_COUNT][DLUA_DTYPE_COUNT] = {DLUA_EW_BINARY_OPS(BIN_ROW)};
static const ew_kernel_t ternary_kernels[EWT_COUNT][DLUA_DTYPE_COUNT] = {DLUA_EW_TERNARY_OPS(TER_ROW)};

/* where and masked_fill move bits: one kernel per element size. */
#define GEN_WHERE(BITS)                                                                              \
  static void where_##BITS(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp) {     \
    const int64_t so = it->inner[0], sc = it->inner[1], sa = it->inner[2], sb = it->inner[3];         \
    EW_RUNS_BEGIN(it, lo, hi)                                                                         \
    uint##BITS##_t *o = (uint##BITS##_t *)ew_p[0];                                                    \
    const uint8_t *c = (const uint8_t *)ew_p[1];                                                      \
    const uint##BITS##_t *a = (const uint##BITS##_t *)ew_p[2], *b = (const uint##BITS##_t *)ew_p[3];  \
    if (so == 1 && sc == 1 && sa == 1 && sb == 1) {                                                   \
      _Pragma("omp simd") for (int64_t i = 0; i < ew_n; i++) o[i] = c[i] ? a[i] : b[i];               \
    } else {                                                                                          \
      for (int64_t i = 0; i < ew_n; i++) o[i * so] = c[i * sc] ? a[i * sa] : b[i * sb];               \
    }                                                                                                 \
    EW_RUNS_END(it)                                                                                   \
  }                                                                                                   \
  static void mfill_##BITS(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp) {      \
    const uint##BITS##_t v = (uint##BITS##_t)pp->i[0];                                                \
    const int64_t so = it->inner[0], sm = it->inner[1];                                               \
    EW_RUNS_BEGIN(it, lo, hi)                                                                         \
    uint##BITS##_t *o = (uint##BITS##_t *)ew_p[0];                                                    \
    const uint8_t *m = (const uint8_t *)ew_p[1];                                                      \
    if (so == 1 && sm == 1) {                                                                         \
      _Pragma("omp simd") for (int64_t i = 0; i < ew_n; i++) o[i] = m[i] ? v : o[i];                  \
    } else {                                                                                          \
      for (int64_t i = 0; i < ew_n; i++)                                                              \
        if (m[i * sm]) o[i * so] = v;                                                                 \
    }                                                                                                 \
    EW_RUNS_END(it)                                                                                   \
  }
GEN_WHERE(8)
GEN_WHERE(16)
GEN_WHERE(32)
GEN_WHERE(64)

static ew_kernel_t where_kernel(size_t elsize) {
  switch (elsize) {
    case 1: return where_8;
    case 2: return where_16;
    case 4: return where_32;
    default: return where_64;
  }
}

static ew_kernel_t mfill_kernel(size_t elsize) {
  switch (elsize) {
    case 1: return mfill_8;
    case 2: return mfill_16;
    case 4: return mfill_32;
    default: return mfill_64;
  }
}

/* ---- argument checks and the `out` convention --------------------------------------------- */

static dlua_status_t check_input(const char *op, const dlua_tensor_t *t, const dlua_tensor_t *first) {
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "%s: the tensor is NULL (freed, or never created)", op);
  if (first && first->storage && t->device != first->device) {
    char b1[200], b2[200];
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected tensors on one device, got %s and %s", op,
                    dlua_tensor_describe(first, b1, sizeof b1), dlua_tensor_describe(t, b2, sizeof b2));
  }
#ifdef DLUA_HAVE_CUDA
  return DLUA_OK;  // every op of this file runs on CUDA too (ew_exec)
#else
  return dlua_require_cpu(op, t);
#endif
}

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

static dlua_status_t check_writable(const char *op, const dlua_tensor_t *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->sizes[d] > 1 && t->strides[d] == 0) {
      char b[200];
      return DLUA_ERR(DLUA_ERR_ARG,
                      "%s: cannot write into %s: it is an expanded view whose elements share memory (clone it first)",
                      op, dlua_tensor_describe(t, b, sizeof b));
    }
  return DLUA_OK;
}

/* What the CUDA side needs besides the iterator: the kernel family (DLUA_CUDA_EW_*), the op's position in
   its X-macro list, the compute storage dtype, and for the bit movers the element size. */
typedef struct {
  int family, op, dtype, elsize;
} ew_cuda_t;

/* Hands the iterator's merged layout to the CUDA kernels (host/cuda/elementwise*.cu). */
static dlua_status_t ew_cuda_launch(const char *op, const ew_iter_t *it, const ew_cuda_t *cu, const ew_params_t *pp,
                                    int device) {
#ifdef DLUA_HAVE_CUDA
  dlua_cuda_ew_t e;
  memset(&e, 0, sizeof e);
  e.family = cu->family;
  e.op = cu->op;
  e.dtype = cu->dtype;
  e.src_dtype = cu->dtype;
  e.elsize = cu->elsize;
  e.nops = it->nops;
  e.ndim = it->ndim;
  e.numel = it->numel;
  for (int d = 0; d < it->ndim; d++) {
    e.sizes[d] = it->sizes[d];
    for (int k = 0; k < it->nops; k++) e.strides[k][d] = it->bstrides[k][d];
  }
  for (int k = 0; k < it->nops; k++) e.base[k] = it->base[k];
  e.d[0] = pp->d[0];
  e.d[1] = pp->d[1];
  e.i[0] = pp->i[0];
  e.i[1] = pp->i[1];
  e.mode = pp->mode;
  e.device = device;
  return dlua_cuda_ew_run(op, &e);
#else
  return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d (built without CUDA)", op, device);
#endif
}

/* Runs `kernel` over (*out, ins...) at shape (nd, shape). The kernel computes in dtype `rdt` for
   its output and reads inputs of dtype in_dt[i] (-1: as they are). Resolves the `out`
   convention: allocates *out, or writes through a temporary when *out has another dtype, and
   copies inputs that differ in dtype or that partially overlap the output. */
static dlua_status_t ew_exec(const char *op, dlua_tensor_t **out, dlua_dtype_t rdt, int nd, const int64_t *shape,
                             int nin, const dlua_tensor_t *const *ins, const int *in_dt, ew_kernel_t kernel,
                             const ew_cuda_t *cu, const ew_params_t *pp) {
  if (!kernel) return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CPU kernel for %s", op, dlua_dtype_name(rdt));
  const int device = ins[0]->device;  // check_input made every operand agree
  int allocated = 0;
  DLUA_TRY(dlua_prepare_out_on(op, out, nd, shape, rdt, device, &allocated));
  dlua_status_t s = DLUA_OK;
  dlua_tensor_t *tmp_out = NULL, *tmp_in[EW_MAX_OPS] = {NULL};
  const dlua_tensor_t *ops[EW_MAX_OPS];
  dlua_tensor_t *dst = *out;
  if (!allocated) {
    s = check_writable(op, dst);
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
    ew_iter_t it;
    ew_iter_init(&it, nin + 1, ops);
    if (device == DLUA_CPU) ew_launch(&it, kernel, pp);
    else s = ew_cuda_launch(op, &it, cu, pp, device);
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

static void params_set(ew_params_t *pp, int k, double v) {
  pp->d[k] = v;
  pp->i[k] = is_int_scalar(v) ? (int64_t)v : 0;
}

/* ---- public entry points ------------------------------------------------------------------ */

dlua_status_t dlua_tensor_unary(dlua_tensor_t **out, const dlua_tensor_t *a, dlua_unary_op_t op) {
  if ((int)op < 0 || op >= DLUA_UNARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "unary: unknown op %d", (int)op);
  const char *name = unary_name[op];
  DLUA_TRY(check_input(name, a, NULL));
  dlua_dtype_t ct = a->dtype;
  int kind = unary_kind[op];
  if (kind == EW_KIND_FLOAT && !dlua_dtype_is_floating(ct)) ct = DLUA_DTYPE_F32;
  if (op == DLUA_UNARY_NEG && ct == DLUA_DTYPE_BOOL)
    return DLUA_ERR(DLUA_ERR_ARG, "neg: negating a bool tensor is not supported; use logical_not");
  ew_params_t pp = {{0, 0}, {0, 0}, 0};
  int in_dt = (int)ct;
  const ew_cuda_t cu = {DLUA_CUDA_EW_UNARY, (int)op, (int)ct, 0};
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, a->ndim, a->sizes, 1, &a, &in_dt,
                 unary_kernels[op][ct], &cu, &pp);
}

dlua_status_t dlua_tensor_binary(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b,
                                 dlua_binary_op_t op, double alpha) {
  if ((int)op < 0 || op >= DLUA_BINARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "binary: unknown op %d", (int)op);
  const char *name = binary_name[op];
  DLUA_TRY(check_input(name, a, NULL));
  DLUA_TRY(check_input(name, b, a));
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
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, alpha);
  const dlua_tensor_t *ins[2] = {a, b};
  int in_dt[2] = {(int)ct, (int)ct};
  const ew_cuda_t cu = {DLUA_CUDA_EW_BINARY, (int)op, (int)ct, 0};
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, nd, shape, 2, ins, in_dt,
                 binary_kernels[op][ct], &cu, &pp);
}

dlua_status_t dlua_tensor_binary_scalar(dlua_tensor_t **out, const dlua_tensor_t *a, double s, dlua_binary_op_t op,
                                        int scalar_first) {
  if ((int)op < 0 || op >= DLUA_BINARY_COUNT)
    return DLUA_ERR(DLUA_ERR_ARG, "binary: unknown op %d", (int)op);
  const char *name = binary_name[op];
  DLUA_TRY(check_input(name, a, NULL));
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
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, 1);
  params_set(&pp, 1, s);
  pp.mode = scalar_first ? 2 : 1;
  int in_dt = (int)ct;
  const ew_cuda_t cu = {DLUA_CUDA_EW_BINARY, (int)op, (int)ct, 0};
  return ew_exec(name, out, kind == EW_KIND_PRED ? DLUA_DTYPE_BOOL : ct, a->ndim, a->sizes, 1, &a, &in_dt,
                 binary_kernels[op][ct], &cu, &pp);
}

dlua_status_t dlua_tensor_clamp(dlua_tensor_t **out, const dlua_tensor_t *a, double low, double high) {
  DLUA_TRY(check_input("clamp", a, NULL));
  dlua_dtype_t ct = a->dtype;
  if (!dlua_dtype_is_floating(ct) && ((!isnan(low) && !is_int_scalar(low)) || (!isnan(high) && !is_int_scalar(high))))
    ct = DLUA_DTYPE_F32;
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  // A NaN bound means no bound: the widest value of the compute type stands in for it.
  pp.d[0] = isnan(low) ? -INFINITY : low;
  pp.d[1] = isnan(high) ? INFINITY : high;
  pp.i[0] = is_int_scalar(low) ? (int64_t)low : INT64_MIN;
  pp.i[1] = is_int_scalar(high) ? (int64_t)high : INT64_MAX;
  int in_dt = (int)ct;
  const ew_cuda_t cu = {DLUA_CUDA_EW_UNARY, EWU_CLAMP, (int)ct, 0};
  return ew_exec("clamp", out, ct, a->ndim, a->sizes, 1, &a, &in_dt, unary_kernels[EWU_CLAMP][ct], &cu, &pp);
}

dlua_status_t dlua_tensor_where(dlua_tensor_t **out, const dlua_tensor_t *cond, const dlua_tensor_t *a,
                                const dlua_tensor_t *b) {
  DLUA_TRY(check_input("where", cond, NULL));
  DLUA_TRY(check_input("where", a, cond));
  DLUA_TRY(check_input("where", b, cond));
  if (cond->dtype != DLUA_DTYPE_BOOL && cond->dtype != DLUA_DTYPE_U8)
    return DLUA_ERR(DLUA_ERR_ARG, "where: the condition must be bool (or uint8), got %s", dlua_dtype_name(cond->dtype));
  int nab, nd;
  int64_t sab[DLUA_MAX_DIMS], shape[DLUA_MAX_DIMS];
  DLUA_TRY(dlua_broadcast_shapes("where", a->ndim, a->sizes, b->ndim, b->sizes, &nab, sab));
  DLUA_TRY(dlua_broadcast_shapes("where", cond->ndim, cond->sizes, nab, sab, &nd, shape));
  dlua_dtype_t rdt = dlua_dtype_promote(a->dtype, b->dtype);
  const dlua_tensor_t *ins[3] = {cond, a, b};
  int in_dt[3] = {-1, (int)rdt, (int)rdt};
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  const ew_cuda_t cu = {DLUA_CUDA_EW_WHERE, 0, (int)rdt, (int)dlua_dtype_size(rdt)};
  return ew_exec("where", out, rdt, nd, shape, 3, ins, in_dt, where_kernel(dlua_dtype_size(rdt)), &cu, &pp);
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
  DLUA_TRY(check_input(op, t, NULL));
  DLUA_TRY(check_input(op, mask, t));
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
  ew_params_t pp;
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
  const ew_cuda_t cu = {DLUA_CUDA_EW_MFILL, 0, (int)t->dtype, (int)es};
  return ew_exec(op, &dst, t->dtype, t->ndim, t->sizes, 1, &mask, &in_dt, mfill_kernel(es), &cu, &pp);
}

static dlua_status_t addc(const char *op, int top, dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b,
                          double value) {
  DLUA_TRY(check_input(op, t, NULL));
  DLUA_TRY(check_input(op, a, t));
  DLUA_TRY(check_input(op, b, t));
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
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, value);
  const dlua_tensor_t *ins[2] = {a, b};
  int in_dt[2] = {(int)ct, (int)ct};
  dlua_tensor_t *dst = t;
  const ew_cuda_t cu = {DLUA_CUDA_EW_TERNARY, top, (int)ct, 0};
  return ew_exec(op, &dst, ct, t->ndim, t->sizes, 2, ins, in_dt, ternary_kernels[top][ct], &cu, &pp);
}

dlua_status_t dlua_tensor_addcmul_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value) {
  return addc("addcmul_", EWT_ADDCMUL, t, a, b, value);
}

dlua_status_t dlua_tensor_addcdiv_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value) {
  return addc("addcdiv_", EWT_ADDCDIV, t, a, b, value);
}

dlua_status_t dlua_tensor_lerp_(dlua_tensor_t *t, const dlua_tensor_t *end, double weight) {
  const char *op = "lerp_";
  DLUA_TRY(check_input(op, t, NULL));
  DLUA_TRY(check_input(op, end, t));
  DLUA_TRY(check_broadcasts_to(op, t, end));
  if (!dlua_dtype_is_floating(t->dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a floating-point tensor, got %s", op, dlua_dtype_name(t->dtype));
  ew_params_t pp;
  memset(&pp, 0, sizeof pp);
  params_set(&pp, 0, weight);
  const dlua_tensor_t *ins[2] = {t, end};
  int in_dt[2] = {(int)t->dtype, (int)t->dtype};
  dlua_tensor_t *dst = t;
  const ew_cuda_t cu = {DLUA_CUDA_EW_BINARY, EWB_LERP, (int)t->dtype, 0};
  return ew_exec(op, &dst, t->dtype, t->ndim, t->sizes, 2, ins, in_dt, binary_kernels[EWB_LERP][t->dtype], &cu, &pp);
}

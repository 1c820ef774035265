/* The CPU backend's element-wise family (kernels/ew.h): the bodies of elementwise_ops.h per (op, storage dtype),
   walked over the merged iterator that host/ops/elementwise.c builds, split across threads. */
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
#include "cpu/copy.h"
#include "kernels/ew.h"

/* ---- the iterator --------------------------------------------------------------------------- */

#define EW_MAX_OPS DLUA_EW_MAX_OPS
/* Below this many elements a loop runs on the calling thread: a parallel region costs more. */
enum { EW_GRAIN = 32768 };

/* The descriptor is both the iterator (operand 0 is the output; all operands are viewed at the output's shape,
   broadcast dims with stride 0, dims ordered outer to inner and merged where memory allows) and the scalars of
   a kernel, in both representations: int64 bounds do not survive a trip through double. Unary: p1, p2 = [0], [1];
   binary: alpha = [0], scalar = [1]; ternary: value = [0]. */
typedef dlua_ew_desc_t ew_iter_t;
typedef dlua_ew_desc_t ew_params_t;

typedef void (*ew_kernel_t)(const ew_iter_t *it, int64_t lo, int64_t hi, const ew_params_t *pp);


/* Multi-index and operand addresses of linear element `pos` (row-major over it->sizes). */
static inline void ew_seek(const ew_iter_t *it, int64_t pos, int64_t *idx, char **ptr) {
  for (int k = 0; k < it->nops; k++) ptr[k] = it->base[k];
  for (int d = it->ndim - 1; d >= 0; d--) {
    idx[d] = pos % it->sizes[d];
    pos /= it->sizes[d];
    for (int k = 0; k < it->nops; k++) ptr[k] += idx[d] * it->strides[k][d];
  }
}

/* Steps n elements along the innermost dim (never past its end) and carries outwards. */
static inline void ew_next(const ew_iter_t *it, int64_t *idx, char **ptr, int64_t n) {
  int d = it->ndim - 1;
  idx[d] += n;
  for (int k = 0; k < it->nops; k++) ptr[k] += n * it->strides[k][d];
  while (d > 0 && idx[d] >= it->sizes[d]) {
    for (int k = 0; k < it->nops; k++) ptr[k] += it->strides[k][d - 1] - idx[d] * it->strides[k][d];
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

/* ---- the slot ------------------------------------------------------------------------------ */

static ew_kernel_t kernel_for(const dlua_ew_desc_t *e) {
  if (e->dtype < 0 || e->dtype >= DLUA_DTYPE_COUNT) return NULL;
  switch (e->family) {
    case DLUA_EW_UNARY: return e->op >= 0 && e->op < EWU_COUNT ? unary_kernels[e->op][e->dtype] : NULL;
    case DLUA_EW_BINARY: return e->op >= 0 && e->op < EWB_COUNT ? binary_kernels[e->op][e->dtype] : NULL;
    case DLUA_EW_TERNARY: return e->op >= 0 && e->op < EWT_COUNT ? ternary_kernels[e->op][e->dtype] : NULL;
    case DLUA_EW_WHERE: return where_kernel((size_t)e->elsize);
    case DLUA_EW_MFILL: return mfill_kernel((size_t)e->elsize);
    default: return NULL;
  }
}

static dlua_status_t cpu_ew_run(const char *op, const dlua_ew_desc_t *e) {
  ew_kernel_t kernel = kernel_for(e);
  if (!kernel) return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CPU kernel for %s", op, dlua_dtype_name((dlua_dtype_t)e->dtype));
  ew_launch(e, kernel, e);
  return DLUA_OK;
}

const struct dlua_ew_ops dlua_cpu_ew_ops = {
    .run = cpu_ew_run,
    .copy = dlua_cpu_ew_copy,
    .download = dlua_cpu_ew_download,
};

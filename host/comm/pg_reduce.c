/* Element reduce functions for every dtype and op (gloo's ring and the shared-memory transport call them), and AVG's division. */
#include "comm/pg_reduce.h"

#include <stdint.h>

#include "core/copy.h"
#include "core/dtype.h"

/* gloo calls these with out == a (in place). Integer sums and products wrap (through unsigned, so
   no undefined overflow); float max/min propagate NaN as torch.maximum does; f16/bf16 compute in f32
   and round once per step; bool: sum/max = or, product/min = and. */

#define PG_FN(name, T, EXPR)                                                  \
  static void name(void *o_, const void *a_, const void *b_, size_t n) {      \
    T *o = (T *)o_;                                                           \
    const T *a = (const T *)a_, *b = (const T *)b_;                           \
    for (size_t i = 0; i < n; i++) {                                          \
      T x = a[i], y = b[i];                                                   \
      o[i] = (EXPR);                                                          \
    }                                                                         \
  }

#define PG_FLOAT_FNS(sfx, T)                                   \
  PG_FN(sum_##sfx, T, x + y)                                   \
  PG_FN(prod_##sfx, T, x * y)                                  \
  PG_FN(max_##sfx, T, (x > y || x != x) ? x : y)               \
  PG_FN(min_##sfx, T, (x < y || x != x) ? x : y)
PG_FLOAT_FNS(f32, float)
PG_FLOAT_FNS(f64, double)

#define PG_INT_FNS(sfx, T, U)                                  \
  PG_FN(sum_##sfx, T, (T)((U)x + (U)y))                        \
  PG_FN(prod_##sfx, T, (T)((U)x * (U)y))                       \
  PG_FN(max_##sfx, T, x > y ? x : y)                           \
  PG_FN(min_##sfx, T, x < y ? x : y)
PG_INT_FNS(i32, int32_t, uint32_t)
PG_INT_FNS(i64, int64_t, uint64_t)
PG_INT_FNS(u8, uint8_t, uint32_t)

PG_FN(or_b8, uint8_t, (uint8_t)((x | y) != 0))
PG_FN(and_b8, uint8_t, (uint8_t)((x != 0) & (y != 0)))

/* 16-bit sums (what the fp16/bf16 compression hooks reduce): blocks through f32 with the vector casts of
   core/copy.c, the same bits as the scalar TO(FROM(x) + FROM(y)). */
#define PG_HALF_SUM(sfx, BF)                                                  \
  static void sum_##sfx(void *o_, const void *a_, const void *b_, size_t n) { \
    uint16_t *o = (uint16_t *)o_;                                             \
    const uint16_t *a = (const uint16_t *)a_, *b = (const uint16_t *)b_;      \
    float fa[256], fb[256];                                                   \
    for (size_t i = 0; i < n; i += 256) {                                     \
      int64_t m = n - i < 256 ? (int64_t)(n - i) : 256;                       \
      dlua_convert_half_to_f32(fa, a + i, m, BF);                             \
      dlua_convert_half_to_f32(fb, b + i, m, BF);                             \
      for (int64_t j = 0; j < m; j++) fa[j] += fb[j];                         \
      dlua_convert_f32_to_half(o + i, fa, m, 1.0f, BF);                       \
    }                                                                         \
  }
PG_HALF_SUM(f16, 0)
PG_HALF_SUM(bf16, 1)
#define PG_HALF_FNS(sfx, TO, FROM)                                                         \
  PG_FN(prod_##sfx, uint16_t, TO(FROM(x) * FROM(y)))                                        \
  PG_FN(max_##sfx, uint16_t, (FROM(x) > FROM(y) || FROM(x) != FROM(x)) ? x : y)             \
  PG_FN(min_##sfx, uint16_t, (FROM(x) < FROM(y) || FROM(x) != FROM(x)) ? x : y)
PG_HALF_FNS(f16, dlua_f32_to_f16_inl, dlua_f16_to_f32_inl)
PG_HALF_FNS(bf16, dlua_f32_to_bf16_inl, dlua_bf16_to_f32_inl)

dlua_pg_reduce_fn dlua_pg_reduce_fn_for(dlua_reduce_t op, dlua_dtype_t dtype) {
  // Rows: SUM (AVG sums first), MAX, MIN, PRODUCT; columns: dtypes in enum order.
  static const dlua_pg_reduce_fn table[4][DLUA_DTYPE_COUNT] = {
      {sum_f32, sum_f64, sum_f16, sum_bf16, sum_i32, sum_i64, sum_u8, or_b8},
      {max_f32, max_f64, max_f16, max_bf16, max_i32, max_i64, max_u8, or_b8},
      {min_f32, min_f64, min_f16, min_bf16, min_i32, min_i64, min_u8, and_b8},
      {prod_f32, prod_f64, prod_f16, prod_bf16, prod_i32, prod_i64, prod_u8, and_b8}};
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return NULL;
  switch (op) {
    case DLUA_PG_REDUCE_SUM:
    case DLUA_PG_REDUCE_AVG: return table[0][dtype];
    case DLUA_PG_REDUCE_MAX: return table[1][dtype];
    case DLUA_PG_REDUCE_MIN: return table[2][dtype];
    case DLUA_PG_REDUCE_PRODUCT: return table[3][dtype];
    default: return NULL;
  }
}

void dlua_pg_divide_by(void *buf, size_t n, dlua_dtype_t dt, int size) {
  switch (dt) {
    case DLUA_DTYPE_F32: {
      float *p = buf;
      for (size_t i = 0; i < n; i++) p[i] /= (float)size;
      break;
    }
    case DLUA_DTYPE_F64: {
      double *p = buf;
      for (size_t i = 0; i < n; i++) p[i] /= (double)size;
      break;
    }
    case DLUA_DTYPE_F16: {
      uint16_t *p = buf;
      for (size_t i = 0; i < n; i++) p[i] = dlua_f32_to_f16_inl(dlua_f16_to_f32_inl(p[i]) / (float)size);
      break;
    }
    case DLUA_DTYPE_BF16: {
      uint16_t *p = buf;
      for (size_t i = 0; i < n; i++) p[i] = dlua_f32_to_bf16_inl(dlua_bf16_to_f32_inl(p[i]) / (float)size);
      break;
    }
    default: break;
  }
}

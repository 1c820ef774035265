/* The per-element arithmetic of every element-wise op, written once for the CPU loops and CUDA kernels. */
#ifndef DLUA_CPU_ELEMENTWISE_OPS_H
#define DLUA_CPU_ELEMENTWISE_OPS_H
#include <math.h>
#include <stdint.h>

/* Bodies compile unchanged as nvcc device code: only math that exists on both sides. */
#ifdef __CUDACC__
#define DLUA_HD __host__ __device__ /* the bodies are already static inline */
#else
#define DLUA_HD
#endif

#include "kernels/clones.h"

/* Compute types: f (float: f32, f16, bf16 compute in it), d (double: f64), i (int64_t: every
   integer dtype and bool; the iterator truncates into narrower storage, which wraps like
   PyTorch). Integer arithmetic goes through uint64_t so overflow wraps instead of being UB. */

/* Op lists. X(ENUM, name, kind). The unary and binary lists run in the order of the public
   enums (dlua.h) followed by internal ops, so a list position is the op's enum value.
   kind ARITH: every dtype, result in the compute dtype.
   kind FLOAT: float dtypes only; integer operands are converted to float32 first.
   kind PRED:  every dtype, result bool. */
#define DLUA_EW_UNARY_OPS(X)                                                                   \
  X(NEG, neg, ARITH) X(ABS, abs, ARITH) X(SQRT, sqrt, FLOAT) X(RSQRT, rsqrt, FLOAT)            \
  X(EXP, exp, FLOAT) X(LOG, log, FLOAT) X(TANH, tanh, FLOAT) X(SIGMOID, sigmoid, FLOAT)        \
  X(RELU, relu, ARITH) X(SIGN, sign, ARITH) X(RECIPROCAL, reciprocal, FLOAT)                   \
  X(SQUARE, square, ARITH) X(FLOOR, floor, ARITH) X(CEIL, ceil, ARITH) X(ROUND, round, ARITH) \
  X(SIN, sin, FLOAT) X(COS, cos, FLOAT) X(LOG1P, log1p, FLOAT) X(EXPM1, expm1, FLOAT)          \
  X(ISFINITE, isfinite, PRED) X(ISNAN, isnan, PRED) X(ISINF, isinf, PRED)                      \
  X(LOGICAL_NOT, logical_not, PRED)                                                            \
  X(CLAMP, clamp, ARITH) /* internal: p1 = low, p2 = high */

#define DLUA_EW_BINARY_OPS(X)                                                                  \
  X(ADD, add, ARITH) X(SUB, sub, ARITH) X(MUL, mul, ARITH) X(DIV, div, FLOAT)                  \
  X(POW, pow, ARITH) X(MAXIMUM, maximum, ARITH) X(MINIMUM, minimum, ARITH)                     \
  X(FMOD, fmod, ARITH) X(REMAINDER, remainder, ARITH) X(ATAN2, atan2, FLOAT)                   \
  X(EQ, eq, PRED) X(NE, ne, PRED) X(LT, lt, PRED) X(LE, le, PRED) X(GT, gt, PRED)              \
  X(GE, ge, PRED) X(LOGICAL_AND, logical_and, PRED) X(LOGICAL_OR, logical_or, PRED)           \
  X(LOGICAL_XOR, logical_xor, PRED)                                                            \
  X(LERP, lerp, FLOAT) /* internal: a + w * (b - a), w in the alpha slot */

/* Ternary ops update x in place: x = f(x, a, b, v). */
#define DLUA_EW_TERNARY_OPS(X) X(ADDCMUL, addcmul, ARITH) X(ADDCDIV, addcdiv, FLOAT)

/* Each op's position in its list: the `op` of an element-wise descriptor (kernels/ew.h), alike on every backend. */
#define EW_ENUM_U(NAME, name, kind) EWU_##NAME,
#define EW_ENUM_B(NAME, name, kind) EWB_##NAME,
#define EW_ENUM_T(NAME, name, kind) EWT_##NAME,
enum { DLUA_EW_UNARY_OPS(EW_ENUM_U) EWU_COUNT };
enum { DLUA_EW_BINARY_OPS(EW_ENUM_B) EWB_COUNT };
enum { DLUA_EW_TERNARY_OPS(EW_ENUM_T) EWT_COUNT };

/* ---- unary: f(x, p1, p2); p1/p2 are only read by clamp ---------------------------------- */

#define DLUA_EW_UNARY_FLOATS(T, S, M)                                                          \
  static inline DLUA_HD T dlua_ew_neg_##S(T x, T p1, T p2) { return -x; }                       \
  static inline DLUA_HD T dlua_ew_abs_##S(T x, T p1, T p2) { return M(fabs)(x); }               \
  static inline DLUA_HD T dlua_ew_sqrt_##S(T x, T p1, T p2) { return M(sqrt)(x); }              \
  static inline DLUA_HD T dlua_ew_rsqrt_##S(T x, T p1, T p2) { return (T)1 / M(sqrt)(x); }      \
  static inline DLUA_HD T dlua_ew_exp_##S(T x, T p1, T p2) { return M(exp)(x); }                \
  static inline DLUA_HD T dlua_ew_log_##S(T x, T p1, T p2) { return M(log)(x); }                \
  static inline DLUA_HD T dlua_ew_tanh_##S(T x, T p1, T p2) { return M(tanh)(x); }              \
  /* exp(-x) overflows to Inf for very negative x, and 1 / Inf is the right 0. */               \
  static inline DLUA_HD T dlua_ew_sigmoid_##S(T x, T p1, T p2) { return (T)1 / ((T)1 + M(exp)(-x)); } \
  /* x < 0 is false for NaN, so NaN passes through as in torch.relu. */                        \
  static inline DLUA_HD T dlua_ew_relu_##S(T x, T p1, T p2) { return x < (T)0 ? (T)0 : x; }     \
  static inline DLUA_HD T dlua_ew_sign_##S(T x, T p1, T p2) {                                   \
    return x > (T)0 ? (T)1 : (x < (T)0 ? (T)-1 : (x == (T)0 ? (T)0 : x));                      \
  }                                                                                              \
  static inline DLUA_HD T dlua_ew_reciprocal_##S(T x, T p1, T p2) { return (T)1 / x; }          \
  static inline DLUA_HD T dlua_ew_square_##S(T x, T p1, T p2) { return x * x; }                 \
  static inline DLUA_HD T dlua_ew_floor_##S(T x, T p1, T p2) { return M(floor)(x); }            \
  static inline DLUA_HD T dlua_ew_ceil_##S(T x, T p1, T p2) { return M(ceil)(x); }              \
  /* Half to even, as torch.round: rint in the default rounding mode. */                       \
  static inline DLUA_HD T dlua_ew_round_##S(T x, T p1, T p2) { return M(rint)(x); }             \
  static inline DLUA_HD T dlua_ew_sin_##S(T x, T p1, T p2) { return M(sin)(x); }                \
  static inline DLUA_HD T dlua_ew_cos_##S(T x, T p1, T p2) { return M(cos)(x); }                \
  static inline DLUA_HD T dlua_ew_log1p_##S(T x, T p1, T p2) { return M(log1p)(x); }            \
  static inline DLUA_HD T dlua_ew_expm1_##S(T x, T p1, T p2) { return M(expm1)(x); }            \
  static inline DLUA_HD int dlua_ew_isfinite_##S(T x, T p1, T p2) { return x - x == x - x; }    \
  static inline DLUA_HD int dlua_ew_isnan_##S(T x, T p1, T p2) { return x != x; }               \
  static inline DLUA_HD int dlua_ew_isinf_##S(T x, T p1, T p2) { return x == x && x - x != x - x; } \
  static inline DLUA_HD int dlua_ew_logical_not_##S(T x, T p1, T p2) { return x == (T)0; }      \
  /* max then min, like torch.clamp: low > high gives high; NaN x stays NaN (comparisons fail). \
     A missing bound arrives as -Inf / +Inf. */                                                 \
  static inline DLUA_HD T dlua_ew_clamp_##S(T x, T lo, T hi) {                                  \
    T y = x < lo ? lo : x;                                                                       \
    return y > hi ? hi : y;                                                                      \
  }

#define DLUA_EW_MATH_F(fn) fn##f
#define DLUA_EW_MATH_D(fn) fn
DLUA_EW_UNARY_FLOATS(float, f, DLUA_EW_MATH_F)
DLUA_EW_UNARY_FLOATS(double, d, DLUA_EW_MATH_D)

static inline DLUA_HD int64_t dlua_ew_neg_i(int64_t x, int64_t p1, int64_t p2) { return (int64_t)(0u - (uint64_t)x); }
static inline DLUA_HD int64_t dlua_ew_abs_i(int64_t x, int64_t p1, int64_t p2) { return x < 0 ? (int64_t)(0u - (uint64_t)x) : x; }
static inline DLUA_HD int64_t dlua_ew_relu_i(int64_t x, int64_t p1, int64_t p2) { return x < 0 ? 0 : x; }
static inline DLUA_HD int64_t dlua_ew_sign_i(int64_t x, int64_t p1, int64_t p2) { return (x > 0) - (x < 0); }
static inline DLUA_HD int64_t dlua_ew_square_i(int64_t x, int64_t p1, int64_t p2) { return (int64_t)((uint64_t)x * (uint64_t)x); }
static inline DLUA_HD int64_t dlua_ew_floor_i(int64_t x, int64_t p1, int64_t p2) { return x; }
static inline DLUA_HD int64_t dlua_ew_ceil_i(int64_t x, int64_t p1, int64_t p2) { return x; }
static inline DLUA_HD int64_t dlua_ew_round_i(int64_t x, int64_t p1, int64_t p2) { return x; }
static inline DLUA_HD int dlua_ew_isfinite_i(int64_t x, int64_t p1, int64_t p2) { return 1; }
static inline DLUA_HD int dlua_ew_isnan_i(int64_t x, int64_t p1, int64_t p2) { return 0; }
static inline DLUA_HD int dlua_ew_isinf_i(int64_t x, int64_t p1, int64_t p2) { return 0; }
static inline DLUA_HD int dlua_ew_logical_not_i(int64_t x, int64_t p1, int64_t p2) { return x == 0; }
static inline DLUA_HD int64_t dlua_ew_clamp_i(int64_t x, int64_t lo, int64_t hi) {
  int64_t y = x < lo ? lo : x;
  return y > hi ? hi : y;
}

/* ---- binary: f(a, b, alpha); alpha is read by add/sub (scale of b) and lerp (weight) -------- */

#define DLUA_EW_BINARY_FLOATS(T, S, M)                                                         \
  static inline DLUA_HD T dlua_ew_add_##S(T a, T b, T al) { return a + al * b; }                \
  static inline DLUA_HD T dlua_ew_sub_##S(T a, T b, T al) { return a - al * b; }                \
  static inline DLUA_HD T dlua_ew_mul_##S(T a, T b, T al) { return a * b; }                     \
  static inline DLUA_HD T dlua_ew_div_##S(T a, T b, T al) { return a / b; }                     \
  static inline DLUA_HD T dlua_ew_pow_##S(T a, T b, T al) { return M(pow)(a, b); }              \
  /* NaN in either operand wins, as torch.maximum (fmax would drop it). */                     \
  static inline DLUA_HD T dlua_ew_maximum_##S(T a, T b, T al) {                                 \
    return a != a ? a : (b != b ? b : (a > b ? a : b));                                          \
  }                                                                                              \
  static inline DLUA_HD T dlua_ew_minimum_##S(T a, T b, T al) {                                 \
    return a != a ? a : (b != b ? b : (a < b ? a : b));                                          \
  }                                                                                              \
  static inline DLUA_HD T dlua_ew_fmod_##S(T a, T b, T al) { return M(fmod)(a, b); }            \
  /* torch.remainder: the result takes the divisor's sign. */                                  \
  static inline DLUA_HD T dlua_ew_remainder_##S(T a, T b, T al) {                               \
    T r = M(fmod)(a, b);                                                                         \
    return (r != (T)0 && ((r < (T)0) != (b < (T)0))) ? r + b : r;                                \
  }                                                                                              \
  static inline DLUA_HD T dlua_ew_atan2_##S(T a, T b, T al) { return M(atan2)(a, b); }          \
  static inline DLUA_HD int dlua_ew_eq_##S(T a, T b, T al) { return a == b; }                   \
  static inline DLUA_HD int dlua_ew_ne_##S(T a, T b, T al) { return a != b; }                   \
  static inline DLUA_HD int dlua_ew_lt_##S(T a, T b, T al) { return a < b; }                    \
  static inline DLUA_HD int dlua_ew_le_##S(T a, T b, T al) { return a <= b; }                   \
  static inline DLUA_HD int dlua_ew_gt_##S(T a, T b, T al) { return a > b; }                    \
  static inline DLUA_HD int dlua_ew_ge_##S(T a, T b, T al) { return a >= b; }                   \
  static inline DLUA_HD int dlua_ew_logical_and_##S(T a, T b, T al) { return a != (T)0 && b != (T)0; } \
  static inline DLUA_HD int dlua_ew_logical_or_##S(T a, T b, T al) { return a != (T)0 || b != (T)0; }  \
  static inline DLUA_HD int dlua_ew_logical_xor_##S(T a, T b, T al) { return (a != (T)0) != (b != (T)0); } \
  /* torch.lerp's two-sided form: exact at w = 0 and at w = 1. */                              \
  static inline DLUA_HD T dlua_ew_lerp_##S(T a, T b, T w) {                                     \
    return M(fabs)(w) < (T)0.5 ? a + w * (b - a) : b - (b - a) * ((T)1 - w);                    \
  }

DLUA_EW_BINARY_FLOATS(float, f, DLUA_EW_MATH_F)
DLUA_EW_BINARY_FLOATS(double, d, DLUA_EW_MATH_D)

static inline DLUA_HD int64_t dlua_ew_add_i(int64_t a, int64_t b, int64_t al) {
  return (int64_t)((uint64_t)a + (uint64_t)al * (uint64_t)b);
}
static inline DLUA_HD int64_t dlua_ew_sub_i(int64_t a, int64_t b, int64_t al) {
  return (int64_t)((uint64_t)a - (uint64_t)al * (uint64_t)b);
}
static inline DLUA_HD int64_t dlua_ew_mul_i(int64_t a, int64_t b, int64_t al) { return (int64_t)((uint64_t)a * (uint64_t)b); }
/* Integer powers by squaring; negative exponents give what 1 / a^-b truncates to (PyTorch). */
static inline DLUA_HD int64_t dlua_ew_pow_i(int64_t a, int64_t b, int64_t al) {
  if (b < 0) {
    if (a == 1) return 1;
    if (a == -1) return (b & 1) ? -1 : 1;
    return 0;
  }
  uint64_t r = 1, base = (uint64_t)a;
  while (b) {
    if (b & 1) r *= base;
    base *= base;
    b >>= 1;
  }
  return (int64_t)r;
}
static inline DLUA_HD int64_t dlua_ew_maximum_i(int64_t a, int64_t b, int64_t al) { return a > b ? a : b; }
static inline DLUA_HD int64_t dlua_ew_minimum_i(int64_t a, int64_t b, int64_t al) { return a < b ? a : b; }
/* Division by zero is rejected before the loop; -1 is special-cased because INT64_MIN % -1
   traps on x86 although the answer is 0. */
static inline DLUA_HD int64_t dlua_ew_fmod_i(int64_t a, int64_t b, int64_t al) {
  return (b == 0 || b == -1) ? 0 : a % b;
}
static inline DLUA_HD int64_t dlua_ew_remainder_i(int64_t a, int64_t b, int64_t al) {
  int64_t r = (b == 0 || b == -1) ? 0 : a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
static inline DLUA_HD int dlua_ew_eq_i(int64_t a, int64_t b, int64_t al) { return a == b; }
static inline DLUA_HD int dlua_ew_ne_i(int64_t a, int64_t b, int64_t al) { return a != b; }
static inline DLUA_HD int dlua_ew_lt_i(int64_t a, int64_t b, int64_t al) { return a < b; }
static inline DLUA_HD int dlua_ew_le_i(int64_t a, int64_t b, int64_t al) { return a <= b; }
static inline DLUA_HD int dlua_ew_gt_i(int64_t a, int64_t b, int64_t al) { return a > b; }
static inline DLUA_HD int dlua_ew_ge_i(int64_t a, int64_t b, int64_t al) { return a >= b; }
static inline DLUA_HD int dlua_ew_logical_and_i(int64_t a, int64_t b, int64_t al) { return a != 0 && b != 0; }
static inline DLUA_HD int dlua_ew_logical_or_i(int64_t a, int64_t b, int64_t al) { return a != 0 || b != 0; }
static inline DLUA_HD int dlua_ew_logical_xor_i(int64_t a, int64_t b, int64_t al) { return (a != 0) != (b != 0); }

/* ---- ternary: x = f(x, a, b, v) ------------------------------------------------------------ */

static inline DLUA_HD float dlua_ew_addcmul_f(float x, float a, float b, float v) { return x + v * a * b; }
static inline DLUA_HD double dlua_ew_addcmul_d(double x, double a, double b, double v) { return x + v * a * b; }
static inline DLUA_HD int64_t dlua_ew_addcmul_i(int64_t x, int64_t a, int64_t b, int64_t v) {
  return (int64_t)((uint64_t)x + (uint64_t)v * (uint64_t)a * (uint64_t)b);
}
static inline DLUA_HD float dlua_ew_addcdiv_f(float x, float a, float b, float v) { return x + v * a / b; }
static inline DLUA_HD double dlua_ew_addcdiv_d(double x, double a, double b, double v) { return x + v * a / b; }

/* ---- reductions: the per-element steps shared by the CPU folds and a CUDA version --------- */

/* Whether x replaces the running best of a max (min: swap the operands of the comparison).
   The first NaN wins and is never replaced, as in torch.max. */
static inline DLUA_HD int dlua_red_max_better_d(double x, double best) { return best == best && (x > best || x != x); }
static inline DLUA_HD int dlua_red_min_better_d(double x, double best) { return best == best && (x < best || x != x); }
/* Inf-norm step: NaN sticks. */
static inline DLUA_HD double dlua_red_absmax_d(double acc, double x) {
  double ax = fabs(x);
  return (ax > acc || ax != ax) ? ax : acc;
}

#endif

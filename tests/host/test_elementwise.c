/* Check suite for host/ops/elementwise.c and host/cpu/elementwise.c: every op against double-precision reference
   loops, and the ew family of the backend table. */
#include <check.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"
#include "kernels/ew.h"
#include "ops/backend.h"

#include "testutil.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static const dlua_dtype_t ALL_DT[] = {DLUA_DTYPE_F32, DLUA_DTYPE_F64, DLUA_DTYPE_F16, DLUA_DTYPE_BF16,
                                      DLUA_DTYPE_I32, DLUA_DTYPE_I64, DLUA_DTYPE_U8,  DLUA_DTYPE_BOOL};

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* A tensor of n random values in [-scale, scale), stored in *vals as the dtype holds them. */
static dlua_tensor_t *mk_rand(dlua_dtype_t dt, int nd, const int64_t *sz, double scale, double **vals) {
  int64_t n = dlua_shape_numel(nd, sz);
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = tu_as_dtype(dt, tu_lcg(&rng_state) * scale);
  dlua_tensor_t *t = tu_mk(dt, nd, sz, v);
  if (vals) *vals = v;
  else free(v);
  return t;
}

#define CHECK_CLOSE(got, want, tol, what, i)                                                              \
  ck_assert_msg(tu_close_to((got), (want), (tol)), "%s: element %lld: got %.17g, want %.17g (tol %g)", (what), \
                (long long)(i), (double)(got), (double)(want), (double)(tol))

static double eps_of(dlua_dtype_t dt) {
  switch (dt) {
    case DLUA_DTYPE_F32: return 0x1p-24;
    case DLUA_DTYPE_F64: return 0x1p-53;
    case DLUA_DTYPE_F16: return 0x1p-11;
    case DLUA_DTYPE_BF16: return 0x1p-8;
    default: return 0;
  }
}

/* ---- double-precision references ------------------------------------------------------------ */

static double ref_binary(dlua_binary_op_t op, double a, double b, double alpha) {
  switch (op) {
    case DLUA_BINARY_ADD: return a + alpha * b;
    case DLUA_BINARY_SUB: return a - alpha * b;
    case DLUA_BINARY_MUL: return a * b;
    case DLUA_BINARY_DIV: return a / b;
    case DLUA_BINARY_POW: return pow(a, b);
    case DLUA_BINARY_MAXIMUM: return (isnan(a) || isnan(b)) ? NAN : (a > b ? a : b);
    case DLUA_BINARY_MINIMUM: return (isnan(a) || isnan(b)) ? NAN : (a < b ? a : b);
    case DLUA_BINARY_FMOD: return fmod(a, b);
    case DLUA_BINARY_REMAINDER: return b == 0 ? NAN : a - b * floor(a / b);
    case DLUA_BINARY_ATAN2: return atan2(a, b);
    case DLUA_BINARY_EQ: return a == b;
    case DLUA_BINARY_NE: return a != b;
    case DLUA_BINARY_LT: return a < b;
    case DLUA_BINARY_LE: return a <= b;
    case DLUA_BINARY_GT: return a > b;
    case DLUA_BINARY_GE: return a >= b;
    case DLUA_BINARY_LOGICAL_AND: return a != 0 && b != 0;
    case DLUA_BINARY_LOGICAL_OR: return a != 0 || b != 0;
    case DLUA_BINARY_LOGICAL_XOR: return (a != 0) != (b != 0);
    default: return NAN;
  }
}

static int is_pred(dlua_binary_op_t op) { return op >= DLUA_BINARY_EQ; }

static double ref_unary(dlua_unary_op_t op, double x) {
  switch (op) {
    case DLUA_UNARY_NEG: return -x;
    case DLUA_UNARY_ABS: return fabs(x);
    case DLUA_UNARY_SQRT: return sqrt(x);
    case DLUA_UNARY_RSQRT: return 1 / sqrt(x);
    case DLUA_UNARY_EXP: return exp(x);
    case DLUA_UNARY_LOG: return log(x);
    case DLUA_UNARY_TANH: return tanh(x);
    case DLUA_UNARY_SIGMOID: return 1 / (1 + exp(-x));
    case DLUA_UNARY_RELU: return isnan(x) ? x : (x > 0 ? x : 0);
    case DLUA_UNARY_SIGN: return isnan(x) ? x : (x > 0) - (x < 0);
    case DLUA_UNARY_RECIPROCAL: return 1 / x;
    case DLUA_UNARY_SQUARE: return x * x;
    case DLUA_UNARY_FLOOR: return floor(x);
    case DLUA_UNARY_CEIL: return ceil(x);
    case DLUA_UNARY_ROUND: {  // half to even, by hand
      double f = floor(x), d = x - f;
      if (d > 0.5 || (d == 0.5 && fmod(f, 2) != 0)) f += 1;
      return isfinite(x) ? f : x;
    }
    case DLUA_UNARY_SIN: return sin(x);
    case DLUA_UNARY_COS: return cos(x);
    case DLUA_UNARY_LOG1P: return log1p(x);
    case DLUA_UNARY_EXPM1: return expm1(x);
    case DLUA_UNARY_ISFINITE: return isfinite(x) != 0;
    case DLUA_UNARY_ISNAN: return isnan(x) != 0;
    case DLUA_UNARY_ISINF: return isinf(x) != 0;
    case DLUA_UNARY_LOGICAL_NOT: return x == 0;
    default: return NAN;
  }
}

/* ---- binary ops ------------------------------------------------------------------------------- */

/* Every binary op on f32 and f64, broadcasting (3, 1, 5) with (4, 1), with NaN/Inf/0 mixed in. */
START_TEST(test_binary_all_ops_broadcast) {
  static const double special[] = {NAN, INFINITY, -INFINITY, 0.0, -0.0, 1.0};
  int64_t sa[3] = {3, 1, 5}, sb[2] = {4, 1};
  for (int di = 0; di < 2; di++) {
    dlua_dtype_t dt = di == 0 ? DLUA_DTYPE_F32 : DLUA_DTYPE_F64;
    double va[15], vb[4];
    for (int i = 0; i < 15; i++) va[i] = tu_as_dtype(dt, tu_lcg(&rng_state) * 4);
    for (int i = 0; i < 4; i++) vb[i] = tu_as_dtype(dt, tu_lcg(&rng_state) * 4);
    va[0] = special[0], va[3] = special[1], va[7] = special[3], va[11] = special[2], vb[2] = special[0];
    vb[1] = 0.0;
    dlua_tensor_t *a = tu_mk(dt, 3, sa, va), *b = tu_mk(dt, 2, sb, vb);
    for (int op = 0; op < DLUA_BINARY_COUNT; op++) {
      dlua_tensor_t *o = NULL;
      double alpha = (op <= DLUA_BINARY_SUB) ? 0.5 : 1;
      ck_assert_msg(dlua_tensor_binary(&o, a, b, (dlua_binary_op_t)op, alpha) == DLUA_OK, "op %d: %s", op,
                    dlua_last_error());
      ck_assert_int_eq(dlua_tensor_ndim(o), 3);
      ck_assert_int_eq(dlua_tensor_sizes(o)[0], 3);
      ck_assert_int_eq(dlua_tensor_sizes(o)[1], 4);
      ck_assert_int_eq(dlua_tensor_sizes(o)[2], 5);
      ck_assert_int_eq(dlua_tensor_dtype(o), is_pred((dlua_binary_op_t)op) ? DLUA_DTYPE_BOOL : dt);
      double *got = tu_rd(o);
      for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++)
          for (int k = 0; k < 5; k++) {
            double x = va[i * 5 + k], y = vb[j];
            double want = ref_binary((dlua_binary_op_t)op, x, y, alpha);
            if (!is_pred((dlua_binary_op_t)op)) want = tu_as_dtype(dt, want);
            double tol = 4 * eps_of(dt) * (fabs(want) + fabs(x) + fabs(y));
            if (op == DLUA_BINARY_POW && isfinite(want) && isfinite(x)) tol = 8 * eps_of(dt) * fabs(want) * (1 + fmin(fabs(log(fabs(x) + 1e-300) * y), 100.0));
            char what[64];
            snprintf(what, sizeof what, "binary op %d dtype %d", op, dt);
            CHECK_CLOSE(got[(i * 4 + j) * 5 + k], want, tol, what, (i * 4 + j) * 5 + k);
          }
      free(got);
      dlua_tensor_free(o);
    }
    dlua_tensor_free(a);
    dlua_tensor_free(b);
  }
}
END_TEST

/* Contiguous add and mul at sizes that hit the empty, single, tail and multi-thread paths. */
START_TEST(test_binary_sizes) {
  static const int64_t sizes[] = {0, 1, 7, 31, 1009, 100003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    double *va, *vb;
    dlua_tensor_t *a = mk_rand(DLUA_DTYPE_F32, 1, &n, 10, &va), *b = mk_rand(DLUA_DTYPE_F32, 1, &n, 10, &vb);
    dlua_tensor_t *o = NULL, *m = NULL;
    ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_ADD, -2.0), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_binary(&m, a, b, DLUA_BINARY_MUL, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_numel(o), n);
    double *go = tu_rd(o), *gm = tu_rd(m);
    for (int64_t i = 0; i < n; i++) {
      // -2 * b is exact in float, so the sum is rounded once: it must be the nearest float.
      CHECK_CLOSE(go[i], (double)(float)(va[i] - 2.0 * vb[i]), 0, "add alpha", i);
      CHECK_CLOSE(gm[i], (double)(float)(va[i] * vb[i]), 0, "mul", i);
    }
    free(go), free(gm), free(va), free(vb);
    dlua_tensor_free(o), dlua_tensor_free(m), dlua_tensor_free(a), dlua_tensor_free(b);
  }
}
END_TEST

/* add and mul for every pair of dtypes: PyTorch's promotion and exact small-integer values. */
START_TEST(test_binary_every_dtype_pair) {
  int64_t n = 37;
  double va[37], vb[37];
  for (int i = 0; i < n; i++) va[i] = i % 4, vb[i] = (i * 7) % 3;
  for (int x = 0; x < 8; x++)
    for (int y = 0; y < 8; y++) {
      dlua_dtype_t da = ALL_DT[x], db = ALL_DT[y];
      dlua_tensor_t *a = tu_mk(da, 1, &n, va), *b = tu_mk(db, 1, &n, vb);
      dlua_dtype_t want_dt = dlua_dtype_promote(da, db);
      for (int opi = 0; opi < 2; opi++) {
        dlua_binary_op_t op = opi ? DLUA_BINARY_MUL : DLUA_BINARY_ADD;
        dlua_tensor_t *o = NULL;
        ck_assert_msg(dlua_tensor_binary(&o, a, b, op, 1) == DLUA_OK, "%s", dlua_last_error());
        ck_assert_int_eq(dlua_tensor_dtype(o), want_dt);
        double *g = tu_rd(o);
        for (int i = 0; i < n; i++) {
          double ea = tu_as_dtype(da, va[i]), eb = tu_as_dtype(db, vb[i]);
          double want = tu_as_dtype(want_dt, opi ? ea * eb : ea + eb);
          ck_assert_msg(g[i] == want, "%s %s %s [%d]: got %g want %g", opi ? "mul" : "add", dlua_dtype_name(da),
                        dlua_dtype_name(db), i, g[i], want);
        }
        free(g);
        dlua_tensor_free(o);
      }
      dlua_tensor_free(a), dlua_tensor_free(b);
    }
}
END_TEST

START_TEST(test_integer_semantics) {
  int64_t n = 4;
  double va[4] = {-7, 7, -8, 9}, vb[4] = {3, -3, 2, 4};
  dlua_tensor_t *a = tu_mk(DLUA_DTYPE_I64, 1, &n, va), *b = tu_mk(DLUA_DTYPE_I64, 1, &n, vb), *o = NULL;
  // True division gives float32, as `/` in PyTorch.
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_DIV, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F32);
  double *g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], (float)(va[i] / vb[i]), 0, "int div", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // fmod keeps the dividend's sign, remainder the divisor's: -7 fmod 3 = -1, remainder 2.
  static const double fm[4] = {-1, 1, 0, 1}, rm[4] = {2, -2, 0, 1};
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_FMOD, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I64);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], fm[i], 0, "int fmod", i);
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_REMAINDER, 1), DLUA_OK);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], rm[i], 0, "int remainder", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // Integer pow: 2^-1 truncates to 0, (-1)^-3 = -1, 1^-2 = 1; 3^4 = 81.
  double pa[4] = {2, -1, 1, 3}, pb[4] = {-1, -3, -2, 4}, pw[4] = {0, -1, 1, 81};
  dlua_tensor_t *p1 = tu_mk(DLUA_DTYPE_I32, 1, &n, pa), *p2 = tu_mk(DLUA_DTYPE_I32, 1, &n, pb);
  ck_assert_int_eq(dlua_tensor_binary(&o, p1, p2, DLUA_BINARY_POW, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I32);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], pw[i], 0, "int pow", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // u8 wraps: 1 - 3 = 254.
  double ua[1] = {1}, ub[1] = {3};
  int64_t one = 1;
  dlua_tensor_t *u1 = tu_mk(DLUA_DTYPE_U8, 1, &one, ua), *u2 = tu_mk(DLUA_DTYPE_U8, 1, &one, ub);
  ck_assert_int_eq(dlua_tensor_binary(&o, u1, u2, DLUA_BINARY_SUB, 1), DLUA_OK);
  g = tu_rd(o);
  ck_assert(g[0] == 254);
  free(g), dlua_tensor_free(o), o = NULL;
  // Division by an integer zero is an error, not a trap.
  double zb[4] = {1, 0, 1, 1};
  dlua_tensor_t *z = tu_mk(DLUA_DTYPE_I64, 1, &n, zb);
  ck_assert_int_eq(dlua_tensor_binary(&o, a, z, DLUA_BINARY_FMOD, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("fmod: integer division by zero"));
  ck_assert_ptr_null(o);
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, a, 0, DLUA_BINARY_REMAINDER, 0), DLUA_ERR_ARG);
  // Integer alpha only for integer tensors; bool - bool is refused as in PyTorch.
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_ADD, 0.5), DLUA_ERR_ARG);
  ck_assert(tu_err_has("add: alpha"));
  dlua_tensor_t *bo = tu_mk(DLUA_DTYPE_BOOL, 1, &n, va);
  ck_assert_int_eq(dlua_tensor_binary(&o, bo, bo, DLUA_BINARY_SUB, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("sub:"));
  // INT64_MIN fmod -1 is 0 (and must not trap).
  int64_t big[1] = {INT64_MIN}, m1[1] = {-1};
  dlua_tensor_t *tb = NULL, *tm = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&tb, 1, &one, DLUA_DTYPE_I64, big), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_from_data(&tm, 1, &one, DLUA_DTYPE_I64, m1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_binary(&o, tb, tm, DLUA_BINARY_FMOD, 1), DLUA_OK);
  ck_assert(*(int64_t *)dlua_tensor_data(o) == 0);
  dlua_tensor_free(o);
  dlua_tensor_free(tb), dlua_tensor_free(tm), dlua_tensor_free(bo), dlua_tensor_free(z);
  dlua_tensor_free(u1), dlua_tensor_free(u2), dlua_tensor_free(p1), dlua_tensor_free(p2);
  dlua_tensor_free(a), dlua_tensor_free(b);
}
END_TEST

/* f16/bf16 compute in float and round once to nearest even; Inf and NaN survive. */
START_TEST(test_half_rounding) {
  int64_t n = 4;
  // f16 ulp at 1 is 2^-10: 1 + 2^-11 ties to even (1); (1 + 2^-10) + 2^-11 ties up to 1 + 2^-9.
  double ha[4] = {1.0, 1.0 + 0x1p-10, 60000, NAN}, hb[4] = {0x1p-11, 0x1p-11, 10000, 1};
  double hw[4] = {1.0, 1.0 + 0x1p-9, INFINITY, NAN};
  dlua_tensor_t *a = tu_mk(DLUA_DTYPE_F16, 1, &n, ha), *b = tu_mk(DLUA_DTYPE_F16, 1, &n, hb), *o = NULL;
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_ADD, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F16);
  double *g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], hw[i], 0, "f16 add", i);
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(a), dlua_tensor_free(b);
  // bf16 ulp at 1 is 2^-7.
  double ba[4] = {1.0, 1.0 + 0x1p-7, 3e38, -INFINITY}, bb[4] = {0x1p-8, 0x1p-8, 3e38, 1};
  double bw[4] = {1.0, 1.0 + 0x1p-6, INFINITY, -INFINITY};
  a = tu_mk(DLUA_DTYPE_BF16, 1, &n, ba), b = tu_mk(DLUA_DTYPE_BF16, 1, &n, bb);
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_ADD, 1), DLUA_OK);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], bw[i], 0, "bf16 add", i);
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(a), dlua_tensor_free(b);
  // Long half tensors against float compute then one rounding, incl. non-contiguous.
  int64_t sz[2] = {33, 41};
  for (int h = 0; h < 2; h++) {
    dlua_dtype_t dt = h ? DLUA_DTYPE_BF16 : DLUA_DTYPE_F16;
    double *va, *vb;
    a = mk_rand(dt, 2, sz, 3, &va), b = mk_rand(dt, 2, sz, 3, &vb);
    dlua_tensor_t *at = NULL;
    ck_assert_int_eq(dlua_tensor_transpose(&at, a, 0, 1), DLUA_OK);  // (41, 33)
    dlua_tensor_t *bt = NULL;
    ck_assert_int_eq(dlua_tensor_transpose(&bt, b, 0, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_binary(&o, at, bt, DLUA_BINARY_MUL, 1), DLUA_OK);
    g = tu_rd(o);
    for (int i = 0; i < 41; i++)
      for (int j = 0; j < 33; j++) {
        double x = va[j * 41 + i], y = vb[j * 41 + i];
        CHECK_CLOSE(g[i * 33 + j], tu_as_dtype(dt, (float)x * (float)y), 0, "half mul", i * 33 + j);
      }
    free(g), free(va), free(vb), dlua_tensor_free(o), o = NULL;
    dlua_tensor_free(at), dlua_tensor_free(bt), dlua_tensor_free(a), dlua_tensor_free(b);
  }
}
END_TEST

/* Transposed, narrowed and expanded operands, writing into a transposed output in place. */
START_TEST(test_noncontiguous) {
  int64_t s1[2] = {6, 8}, s2[2] = {8, 10}, s3[2] = {1, 6};
  double *v1, *v2, *v3;
  dlua_tensor_t *base1 = mk_rand(DLUA_DTYPE_F64, 2, s1, 5, &v1);
  dlua_tensor_t *base2 = mk_rand(DLUA_DTYPE_F64, 2, s2, 5, &v2);
  dlua_tensor_t *base3 = mk_rand(DLUA_DTYPE_F64, 2, s3, 5, &v3);
  dlua_tensor_t *a = NULL, *b = NULL, *c = NULL, *o = NULL;
  ck_assert_int_eq(dlua_tensor_transpose(&a, base1, 0, 1), DLUA_OK);  // (8, 6): a[i][j] = v1[j*8+i]
  ck_assert_int_eq(dlua_tensor_narrow(&b, base2, 1, 2, 6), DLUA_OK);  // (8, 6): b[i][j] = v2[i*10+j+2]
  int64_t es[2] = {8, 6};
  ck_assert_int_eq(dlua_tensor_expand(&c, base3, 2, es), DLUA_OK);  // (8, 6): c[i][j] = v3[j]
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_SUB, 3), DLUA_OK);
  ck_assert(dlua_tensor_is_contiguous(o));
  double *g = tu_rd(o);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 6; j++) CHECK_CLOSE(g[i * 6 + j], v1[j * 8 + i] - 3 * v2[i * 10 + j + 2], 1e-14, "strided sub", i * 6 + j);
  free(g);
  // In place into the transposed view a: base1 changes through strides.
  dlua_tensor_t *ai = a;
  ck_assert_int_eq(dlua_tensor_binary(&ai, a, c, DLUA_BINARY_MUL, 1), DLUA_OK);
  ck_assert_ptr_eq(ai, a);
  g = tu_rd(base1);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 6; j++) CHECK_CLOSE(g[j * 8 + i], v1[j * 8 + i] * v3[j], 1e-14, "in-place transposed", i);
  free(g);
  // Writing into an expanded view is refused.
  dlua_tensor_t *ci = c;
  ck_assert_int_eq(dlua_tensor_binary(&ci, c, c, DLUA_BINARY_ADD, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("add:"));
  dlua_tensor_free(o), dlua_tensor_free(a), dlua_tensor_free(b), dlua_tensor_free(c);
  dlua_tensor_free(base1), dlua_tensor_free(base2), dlua_tensor_free(base3);
  free(v1), free(v2), free(v3);
}
END_TEST

/* out == input works; a partially overlapping input is read as it was before the op. */
START_TEST(test_inplace_and_overlap) {
  int64_t n = 10;
  double v[10];
  for (int i = 0; i < 10; i++) v[i] = i + 1;
  dlua_tensor_t *t = tu_mk(DLUA_DTYPE_F32, 1, &n, v), *o = t;
  ck_assert_int_eq(dlua_tensor_binary(&o, t, t, DLUA_BINARY_MUL, 1), DLUA_OK);  // t = t * t
  double *g = tu_rd(t);
  for (int i = 0; i < 10; i++) CHECK_CLOSE(g[i], v[i] * v[i], 0, "t*t in place", i);
  free(g);
  // dst = t[1:], src = t[:9]: a naive loop would smear t[0] along the whole tensor.
  dlua_tensor_t *dst = NULL, *src = NULL;
  ck_assert_int_eq(dlua_tensor_narrow(&dst, t, 0, 1, 9), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_narrow(&src, t, 0, 0, 9), DLUA_OK);
  dlua_tensor_t *d2 = dst;
  ck_assert_int_eq(dlua_tensor_binary_scalar(&d2, src, 1, DLUA_BINARY_ADD, 0), DLUA_OK);
  g = tu_rd(t);
  CHECK_CLOSE(g[0], 1, 0, "overlap", 0);
  for (int i = 1; i < 10; i++) CHECK_CLOSE(g[i], v[i - 1] * v[i - 1] + 1, 0, "overlap", i);
  free(g);
  // out of another dtype: computed in float32, cast into int32.
  dlua_tensor_t *oi = NULL;
  int64_t on = 10;
  ck_assert_int_eq(dlua_tensor_zeros(&oi, 1, &on, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *oi2 = oi;
  ck_assert_int_eq(dlua_tensor_binary_scalar(&oi2, t, 0.5, DLUA_BINARY_MUL, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(oi), DLUA_DTYPE_I32);
  g = tu_rd(oi);
  double *gt = tu_rd(t);
  for (int i = 0; i < 10; i++) CHECK_CLOSE(g[i], trunc(gt[i] * 0.5), 0, "cast out", i);
  free(g), free(gt);
  // out with the wrong shape is an error naming the op.
  int64_t wn = 3;
  dlua_tensor_t *w = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&w, 1, &wn, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  dlua_tensor_t *w2 = w;
  ck_assert_int_eq(dlua_tensor_binary(&w2, t, t, DLUA_BINARY_ADD, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("add:"));
  dlua_tensor_free(w), dlua_tensor_free(oi), dlua_tensor_free(dst), dlua_tensor_free(src), dlua_tensor_free(t);
}
END_TEST

START_TEST(test_errors) {
  int64_t s23[2] = {2, 3}, s4 = 4;
  dlua_tensor_t *a = NULL, *b = NULL, *o = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&a, 2, s23, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_zeros(&b, 1, &s4, DLUA_DTYPE_F32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_binary(&o, a, b, DLUA_BINARY_MUL, 1), DLUA_ERR_ARG);
  ck_assert_msg(tu_err_has("mul: shapes (2, 3) and (4) cannot broadcast"), "%s", dlua_last_error());
  ck_assert_ptr_null(o);
  ck_assert_int_eq(dlua_tensor_binary(&o, a, NULL, DLUA_BINARY_ADD, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("add:"));
  ck_assert_int_eq(dlua_tensor_unary(&o, NULL, DLUA_UNARY_EXP), DLUA_ERR_ARG);
  ck_assert(tu_err_has("exp:"));
  ck_assert_int_eq(dlua_tensor_unary(&o, a, DLUA_UNARY_COUNT), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_tensor_binary(&o, a, a, DLUA_BINARY_COUNT, 1), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_tensor_where(&o, a, a, a), DLUA_ERR_ARG);
  ck_assert(tu_err_has("where: the condition must be bool"));
  dlua_tensor_t *m = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&m, 1, &s4, DLUA_DTYPE_BOOL, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_masked_fill_(a, m, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("masked_fill_:"));
  ck_assert_int_eq(dlua_tensor_addcmul_(b, a, a, 1), DLUA_ERR_ARG);  // (2, 3) does not fit (4)
  ck_assert(tu_err_has("addcmul_:"));
  ck_assert_int_eq(dlua_tensor_lerp_(a, b, 0.5), DLUA_ERR_ARG);
  ck_assert(tu_err_has("lerp_:"));
  // Mixed devices name both tensors (a fake CUDA tensor: only its device field is read).
  dlua_tensor_t *g = dlua_tensor_alias(b);
  g->device = 0;
  ck_assert_int_eq(dlua_tensor_binary(&o, b, g, DLUA_BINARY_ADD, 1), DLUA_ERR_ARG);
  ck_assert_msg(tu_err_has("add:") && tu_err_has("cpu") && tu_err_has("cuda"), "%s", dlua_last_error());
  g->device = DLUA_CPU;
  dlua_tensor_free(g), dlua_tensor_free(m), dlua_tensor_free(a), dlua_tensor_free(b);
}
END_TEST

/* ---- unary, scalar, clamp ------------------------------------------------------------------- */

START_TEST(test_unary_all_ops) {
  int64_t n = 41;
  for (int di = 0; di < 4; di++) {
    dlua_dtype_t dt = ALL_DT[di];
    double *v;
    dlua_tensor_t *a = mk_rand(dt, 1, &n, 3, &v);
    v[0] = tu_as_dtype(dt, NAN), v[1] = INFINITY, v[2] = -INFINITY, v[3] = 0, v[4] = 0.5, v[5] = 1.5, v[6] = -2.5;
    dlua_tensor_free(a);
    a = tu_mk(dt, 1, &n, v);
    for (int op = 0; op < DLUA_UNARY_COUNT; op++) {
      dlua_tensor_t *o = NULL;
      ck_assert_msg(dlua_tensor_unary(&o, a, (dlua_unary_op_t)op) == DLUA_OK, "%s", dlua_last_error());
      int pred = op >= DLUA_UNARY_ISFINITE;
      ck_assert_int_eq(dlua_tensor_dtype(o), pred ? DLUA_DTYPE_BOOL : dt);
      double *g = tu_rd(o);
      for (int i = 0; i < n; i++) {
        // Float32 compute: inputs are exact, so the reference is the double result rounded
        // to float, then to the storage dtype, give or take a few float ulps.
        double want = ref_unary((dlua_unary_op_t)op, v[i]);
        double tol = 0;
        if (!pred) {
          double cw = want;
          want = tu_as_dtype(dt, want);
          double ce = dt == DLUA_DTYPE_F64 ? 0x1p-50 : 0x1p-21;
          tol = fabs(want - cw) + ce * fabs(cw) + ce * 1e-300;
          if (dt == DLUA_DTYPE_F16 || dt == DLUA_DTYPE_BF16) tol = eps_of(dt) * 2 * fabs(cw);
        }
        char what[64];
        snprintf(what, sizeof what, "unary op %d %s", op, dlua_dtype_name(dt));
        CHECK_CLOSE(g[i], want, tol, what, i);
      }
      free(g);
      dlua_tensor_free(o);
    }
    dlua_tensor_free(a);
    free(v);
  }
}
END_TEST

START_TEST(test_unary_integers) {
  int64_t n = 5;
  double v[5] = {-3, 0, 2, 7, -1};
  dlua_tensor_t *a = tu_mk(DLUA_DTYPE_I32, 1, &n, v), *o = NULL;
  ck_assert_int_eq(dlua_tensor_unary(&o, a, DLUA_UNARY_SQRT), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F32);  // fractional result: float32
  double *g = tu_rd(o);
  for (int i = 0; i < 5; i++) CHECK_CLOSE(g[i], (float)sqrt(v[i]), 0, "int sqrt", i);
  free(g), dlua_tensor_free(o), o = NULL;
  static const dlua_unary_op_t ops[] = {DLUA_UNARY_NEG, DLUA_UNARY_ABS, DLUA_UNARY_SIGN, DLUA_UNARY_RELU,
                                        DLUA_UNARY_SQUARE, DLUA_UNARY_FLOOR};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    ck_assert_int_eq(dlua_tensor_unary(&o, a, ops[k]), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I32);
    g = tu_rd(o);
    for (int i = 0; i < 5; i++) CHECK_CLOSE(g[i], ref_unary(ops[k], v[i]), 0, "int unary", i);
    free(g), dlua_tensor_free(o), o = NULL;
  }
  ck_assert_int_eq(dlua_tensor_unary(&o, a, DLUA_UNARY_ISNAN), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_BOOL);
  g = tu_rd(o);
  for (int i = 0; i < 5; i++) ck_assert(g[i] == 0);
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_t *b = tu_mk(DLUA_DTYPE_BOOL, 1, &n, v);
  ck_assert_int_eq(dlua_tensor_unary(&o, b, DLUA_UNARY_NEG), DLUA_ERR_ARG);
  ck_assert(tu_err_has("neg:"));
  ck_assert_int_eq(dlua_tensor_unary(&o, b, DLUA_UNARY_LOGICAL_NOT), DLUA_OK);
  g = tu_rd(o);
  for (int i = 0; i < 5; i++) ck_assert(g[i] == (v[i] == 0));
  free(g), dlua_tensor_free(o);
  dlua_tensor_free(a), dlua_tensor_free(b);
}
END_TEST

START_TEST(test_scalar_ops) {
  int64_t n = 6;
  double v[6] = {-3, 0, 2, 7, -1, 5};
  dlua_tensor_t *i32 = tu_mk(DLUA_DTYPE_I32, 1, &n, v), *o = NULL;
  // Fractional scalar with an integer tensor: float32.
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, i32, 2.5, DLUA_BINARY_ADD, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F32);
  double *g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], v[i] + 2.5, 0, "i32 + 2.5", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // Integral scalar keeps int32; scalar first: 10 - a.
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, i32, 10, DLUA_BINARY_SUB, 1), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I32);
  g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], 10 - v[i], 0, "10 - i32", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // 2 ** a with an integer tensor and a < 0 entries (powi rule), and a ** -1 refused.
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, i32, 2, DLUA_BINARY_POW, 1), DLUA_OK);
  g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], v[i] < 0 ? 0 : pow(2, v[i]), 0, "2 ** i32", i);
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, i32, -1, DLUA_BINARY_POW, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("pow:"));
  // bool + 1 counts in int64; bool < 1 stays a comparison.
  dlua_tensor_t *bo = tu_mk(DLUA_DTYPE_BOOL, 1, &n, v);
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, bo, 1, DLUA_BINARY_ADD, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I64);
  g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], (v[i] != 0) + 1, 0, "bool + 1", i);
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, bo, 1, DLUA_BINARY_LT, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_BOOL);
  g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], v[i] == 0, 0, "bool < 1", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // f16 tensor with a scalar stays f16; the scalar is used in float (0.1 is not rounded to f16
  // before the multiply).
  double *hv;
  int64_t hn = 101;
  dlua_tensor_t *h = mk_rand(DLUA_DTYPE_F16, 1, &hn, 100, &hv);
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, h, 0.1, DLUA_BINARY_MUL, 0), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F16);
  g = tu_rd(o);
  for (int i = 0; i < hn; i++) CHECK_CLOSE(g[i], tu_as_dtype(DLUA_DTYPE_F16, (float)hv[i] * 0.1f), 0, "f16 * 0.1", i);
  free(g), free(hv), dlua_tensor_free(o), o = NULL;
  // Division of a float tensor by a scalar on a strided view; s / a with a zero: Inf.
  double fv[6] = {1, 2, 0, -4, 8, -0.0};
  dlua_tensor_t *f = tu_mk(DLUA_DTYPE_F64, 1, &n, fv), *fs = NULL;
  ck_assert_int_eq(dlua_tensor_slice(&fs, f, 0, 0, 6, 2), DLUA_OK);  // {1, 0, 8}
  ck_assert_int_eq(dlua_tensor_binary_scalar(&o, fs, 3, DLUA_BINARY_DIV, 1), DLUA_OK);
  g = tu_rd(o);
  CHECK_CLOSE(g[0], 3.0, 0, "3 / a", 0);
  CHECK_CLOSE(g[1], INFINITY, 0, "3 / a", 1);
  CHECK_CLOSE(g[2], 3.0 / 8, 0, "3 / a", 2);
  free(g), dlua_tensor_free(o), o = NULL;
  dlua_tensor_free(fs), dlua_tensor_free(f), dlua_tensor_free(h), dlua_tensor_free(bo), dlua_tensor_free(i32);
}
END_TEST

START_TEST(test_clamp) {
  int64_t n = 6;
  double v[6] = {-5, -1, 0.5, 2, NAN, 9};
  dlua_tensor_t *a = tu_mk(DLUA_DTYPE_F32, 1, &n, v), *o = NULL;
  ck_assert_int_eq(dlua_tensor_clamp(&o, a, -1.5, 2), DLUA_OK);
  double *g = tu_rd(o);
  double w1[6] = {-1.5, -1, 0.5, 2, NAN, 2};
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], w1[i], 0, "clamp", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // NaN bound: no bound on that side.
  ck_assert_int_eq(dlua_tensor_clamp(&o, a, NAN, 0), DLUA_OK);
  g = tu_rd(o);
  double w2[6] = {-5, -1, 0, 0, NAN, 0};
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], w2[i], 0, "clamp max only", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // low > high: everything becomes high (torch.clamp).
  ck_assert_int_eq(dlua_tensor_clamp(&o, a, 3, 1), DLUA_OK);
  g = tu_rd(o);
  for (int i = 0; i < n; i++) CHECK_CLOSE(g[i], isnan(v[i]) ? NAN : 1, 0, "clamp low > high", i);
  free(g), dlua_tensor_free(o), o = NULL;
  // Integers: integral bounds keep the dtype, a fractional bound gives float32.
  double iv[4] = {-5, 1, 3, 100};
  int64_t in = 4;
  dlua_tensor_t *ia = tu_mk(DLUA_DTYPE_I64, 1, &in, iv);
  ck_assert_int_eq(dlua_tensor_clamp(&o, ia, 0, NAN), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_I64);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], iv[i] < 0 ? 0 : iv[i], 0, "int clamp", i);
  free(g), dlua_tensor_free(o), o = NULL;
  ck_assert_int_eq(dlua_tensor_clamp(&o, ia, 1.5, NAN), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(o), DLUA_DTYPE_F32);
  g = tu_rd(o);
  for (int i = 0; i < 4; i++) CHECK_CLOSE(g[i], iv[i] < 1.5 ? 1.5 : iv[i], 0, "int clamp 1.5", i);
  free(g), dlua_tensor_free(o);
  dlua_tensor_free(ia), dlua_tensor_free(a);
}
END_TEST

/* ---- where, masked_fill_, addcmul_, addcdiv_, lerp_ ----------------------------------------- */

START_TEST(test_where_every_dtype) {
  int64_t sc[2] = {3, 1}, sab[1] = {4};
  double cv[3] = {1, 0, 1};
  dlua_tensor_t *c = tu_mk(DLUA_DTYPE_BOOL, 2, sc, cv);
  for (int x = 0; x < 8; x++) {
    dlua_dtype_t dt = ALL_DT[x];
    double va[4] = {1, 2, 3, 0}, vb[12];
    for (int i = 0; i < 12; i++) vb[i] = (i * 5) % 3;
    int64_t sb[2] = {3, 4};
    dlua_tensor_t *a = tu_mk(dt, 1, sab, va), *b = tu_mk(DLUA_DTYPE_F32, 2, sb, vb), *o = NULL;
    ck_assert_int_eq(dlua_tensor_where(&o, c, a, b), DLUA_OK);
    dlua_dtype_t rdt = dlua_dtype_promote(dt, DLUA_DTYPE_F32);
    ck_assert_int_eq(dlua_tensor_dtype(o), rdt);
    double *g = tu_rd(o);
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 4; j++)
        CHECK_CLOSE(g[i * 4 + j], cv[i] ? tu_as_dtype(dt, va[j]) : vb[i * 4 + j], 0, "where", i * 4 + j);
    free(g), dlua_tensor_free(o), o = NULL;
    // Same dtype on both sides: the element moves bit for bit.
    dlua_tensor_t *a2 = tu_mk(dt, 2, sb, vb);
    ck_assert_int_eq(dlua_tensor_where(&o, c, a, a2), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_dtype(o), dt);
    g = tu_rd(o);
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 4; j++)
        CHECK_CLOSE(g[i * 4 + j], tu_as_dtype(dt, cv[i] ? va[j] : vb[i * 4 + j]), 0, "where same dtype", i * 4 + j);
    free(g), dlua_tensor_free(o);
    dlua_tensor_free(a), dlua_tensor_free(a2), dlua_tensor_free(b);
  }
  dlua_tensor_free(c);
}
END_TEST

START_TEST(test_masked_fill_every_dtype) {
  int64_t s[2] = {5, 7}, sm[1] = {7};
  double mv[7] = {1, 0, 0, 1, 1, 0, 1};
  dlua_tensor_t *m = tu_mk(DLUA_DTYPE_BOOL, 1, sm, mv);
  for (int x = 0; x < 8; x++) {
    dlua_dtype_t dt = ALL_DT[x];
    double v[35];
    for (int i = 0; i < 35; i++) v[i] = i % 2;
    dlua_tensor_t *base = tu_mk(dt, 2, s, v);
    // Fill the (5, 7) tensor where the (7) mask, broadcast along dim 0, is set.
    double value = dt == DLUA_DTYPE_BOOL ? 1 : 3;
    ck_assert_int_eq(dlua_tensor_masked_fill_(base, m, value), DLUA_OK);
    double *g = tu_rd(base);
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 7; j++) CHECK_CLOSE(g[i * 7 + j], mv[j] ? value : v[i * 7 + j], 0, "masked_fill_", i * 7 + j);
    free(g);
    dlua_tensor_free(base);
  }
  // A NaN into an integer tensor is refused; into a float tensor it lands.
  dlua_tensor_t *ti = NULL, *tf = NULL;
  ck_assert_int_eq(dlua_tensor_zeros(&ti, 1, sm, DLUA_DTYPE_I32, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_masked_fill_(ti, m, NAN), DLUA_ERR_ARG);
  ck_assert(tu_err_has("masked_fill_:"));
  ck_assert_int_eq(dlua_tensor_zeros(&tf, 1, sm, DLUA_DTYPE_BF16, DLUA_CPU), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_masked_fill_(tf, m, NAN), DLUA_OK);
  double *g = tu_rd(tf);
  for (int j = 0; j < 7; j++) ck_assert(mv[j] ? isnan(g[j]) : g[j] == 0);
  free(g);
  dlua_tensor_free(ti), dlua_tensor_free(tf), dlua_tensor_free(m);
}
END_TEST

START_TEST(test_addcmul_addcdiv_lerp) {
  int64_t s[2] = {17, 13}, srow[1] = {13};
  for (int di = 0; di < 4; di++) {
    dlua_dtype_t dt = ALL_DT[di];
    double *vt, *va, *vb;
    dlua_tensor_t *base = mk_rand(dt, 2, s, 2, &vt), *a = mk_rand(dt, 2, s, 2, &va), *b = mk_rand(dt, 1, srow, 2, &vb);
    for (int j = 0; j < 13; j++)
      if (vb[j] == 0) vb[j] = 1;
    dlua_tensor_free(b);
    b = tu_mk(dt, 1, srow, vb);
    // t is a transposed view (13, 17); a is transposed too, b (13) broadcasts along dim 1 after
    // being made a column: use a (13, 1) view.
    dlua_tensor_t *t = NULL, *at = NULL, *bc = NULL;
    ck_assert_int_eq(dlua_tensor_transpose(&t, base, 0, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_transpose(&at, a, 0, 1), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_unsqueeze(&bc, b, 1), DLUA_OK);
    double tol_scale = dt == DLUA_DTYPE_F64 ? 1e-14 : (dt == DLUA_DTYPE_F32 ? 1e-6 : 4 * eps_of(dt));
    ck_assert_msg(dlua_tensor_addcmul_(t, at, bc, 0.75) == DLUA_OK, "%s", dlua_last_error());
    double *g = tu_rd(base);
    double *cur = malloc(sizeof(double) * 221);
    for (int i = 0; i < 17; i++)
      for (int j = 0; j < 13; j++) {
        int k = i * 13 + j;
        double want = vt[k] + 0.75 * va[k] * vb[j];
        CHECK_CLOSE(g[k], want, tol_scale * (fabs(want) + 4), "addcmul_", k);
        cur[k] = g[k];
      }
    free(g);
    ck_assert_int_eq(dlua_tensor_addcdiv_(t, at, bc, -0.5), DLUA_OK);
    g = tu_rd(base);
    for (int i = 0; i < 17; i++)
      for (int j = 0; j < 13; j++) {
        int k = i * 13 + j;
        double want = cur[k] - 0.5 * va[k] / vb[j];
        CHECK_CLOSE(g[k], want, tol_scale * (fabs(want) + fabs(va[k] / vb[j]) + 4), "addcdiv_", k);
        cur[k] = g[k];
      }
    free(g);
    // lerp_ with weight 1 lands exactly on end; 0.25 against the reference.
    ck_assert_int_eq(dlua_tensor_lerp_(t, at, 0.25), DLUA_OK);
    g = tu_rd(base);
    for (int k = 0; k < 221; k++) {
      double want = cur[k] + 0.25 * (va[k] - cur[k]);
      CHECK_CLOSE(g[k], want, tol_scale * (fabs(want) + 4), "lerp_", k);
    }
    free(g);
    ck_assert_int_eq(dlua_tensor_lerp_(t, at, 1.0), DLUA_OK);
    g = tu_rd(base);
    for (int k = 0; k < 221; k++) CHECK_CLOSE(g[k], va[k], 0, "lerp_ w=1", k);
    free(g);
    free(cur), free(vt), free(va), free(vb);
    dlua_tensor_free(t), dlua_tensor_free(at), dlua_tensor_free(bc);
    dlua_tensor_free(base), dlua_tensor_free(a), dlua_tensor_free(b);
  }
  // Integer addcmul_ with an integer value; addcdiv_ on integers is refused.
  int64_t n = 3;
  double x[3] = {1, 2, 3}, y[3] = {4, 5, 6};
  dlua_tensor_t *ti = tu_mk(DLUA_DTYPE_I64, 1, &n, x), *ty = tu_mk(DLUA_DTYPE_I64, 1, &n, y);
  ck_assert_int_eq(dlua_tensor_addcmul_(ti, ty, ty, 2), DLUA_OK);
  double *g = tu_rd(ti);
  for (int i = 0; i < 3; i++) CHECK_CLOSE(g[i], x[i] + 2 * y[i] * y[i], 0, "int addcmul_", i);
  free(g);
  ck_assert_int_eq(dlua_tensor_addcdiv_(ti, ty, ty, 1), DLUA_ERR_ARG);
  ck_assert(tu_err_has("addcdiv_:"));
  dlua_tensor_free(ti), dlua_tensor_free(ty);
}
END_TEST

/* The fused update that optimizers run: results do not depend on the thread count. */
START_TEST(test_thread_count_independent) {
  int64_t n = 300007;
  double *va, *vb;
  dlua_tensor_t *a = mk_rand(DLUA_DTYPE_F32, 1, &n, 1, &va), *b = mk_rand(DLUA_DTYPE_F32, 1, &n, 1, &vb);
  dlua_tensor_t *o1 = NULL, *o4 = NULL;
  int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  ck_assert_int_eq(dlua_tensor_binary(&o1, a, b, DLUA_BINARY_ADD, 0.1), DLUA_OK);
  omp_set_num_threads(4);
  ck_assert_int_eq(dlua_tensor_binary(&o4, a, b, DLUA_BINARY_ADD, 0.1), DLUA_OK);
  omp_set_num_threads(saved);
  ck_assert(memcmp(dlua_tensor_data(o1), dlua_tensor_data(o4), (size_t)n * 4) == 0);
  double *g = tu_rd(o4);
  for (int64_t i = 0; i < n; i++) CHECK_CLOSE(g[i], va[i] + 0.1 * vb[i], 1e-6, "axpy", i);
  free(g), free(va), free(vb);
  dlua_tensor_free(o1), dlua_tensor_free(o4), dlua_tensor_free(a), dlua_tensor_free(b);
}
END_TEST

/* The front doors reach the kernels through the backend table: the CPU's ew family runs a descriptor itself (a
   map over the merged iterator, a fill through the copy slot); a tensor on device 0 gets the registry's one
   message when no CUDA device exists, and the CUDA family otherwise. */
START_TEST(test_through_the_table) {
  const struct dlua_ew_ops *k = NULL;
  ck_assert_int_eq(DLUA_BACKEND("add", DLUA_CPU, ew, run, &k), DLUA_OK);
  ck_assert_ptr_eq(k, &dlua_cpu_ew_ops);
  ck_assert_ptr_nonnull(k->copy);
  ck_assert_ptr_nonnull(k->download);

  // o = a + 2 * b over three contiguous f64 elements (positions of the X-macro list = the public enum)
  double a[3] = {1, 2, 3}, b[3] = {10, 20, 30}, o[3] = {0, 0, 0};
  dlua_ew_desc_t e;
  memset(&e, 0, sizeof e);
  e.family = DLUA_EW_BINARY;
  e.op = DLUA_BINARY_ADD;
  e.dtype = e.src_dtype = DLUA_DTYPE_F64;
  e.nops = 3, e.ndim = 1, e.numel = 3, e.sizes[0] = 3;
  for (int i = 0; i < 3; i++) e.strides[i][0] = sizeof(double), e.inner[i] = 1;
  e.base[0] = (char *)o, e.base[1] = (char *)a, e.base[2] = (char *)b;
  e.d[0] = 2, e.i[0] = 2;
  e.device = DLUA_CPU;
  ck_assert_int_eq(k->run("add", &e), DLUA_OK);
  ck_assert(o[0] == 21 && o[1] == 42 && o[2] == 63);

  // fill every other int32 of x with the bits of 7
  int32_t x[6] = {0, 0, 0, 0, 0, 0};
  memset(&e, 0, sizeof e);
  e.family = DLUA_EW_FILL;
  e.dtype = e.src_dtype = DLUA_DTYPE_I32;
  e.elsize = 4;
  e.nops = 1, e.ndim = 1, e.numel = 3, e.sizes[0] = 3;
  e.strides[0][0] = 2 * sizeof(int32_t), e.inner[0] = 2;
  e.base[0] = (char *)x;
  e.i[0] = 7;
  ck_assert_int_eq(k->copy("fill_", &e), DLUA_OK);
  ck_assert(x[0] == 7 && x[1] == 0 && x[2] == 7 && x[3] == 0 && x[4] == 7 && x[5] == 0);

  int64_t sz[1] = {3};
  dlua_tensor_t *t = tu_make(1, sz, DLUA_DTYPE_F64, a), *out = NULL;
  struct dlua_tensor on0 = *t;  // the same header claiming device 0: never read unless a device exists
  on0.device = 0;
  if (dlua_cuda_device_count() == 0) {
    tu_expect_error_at(dlua_tensor_binary(&out, &on0, &on0, DLUA_BINARY_ADD, 1), "add", "add: no CUDA device available");
    ck_assert_ptr_null(out);
    tu_expect_error_at(dlua_tensor_unary(&out, &on0, DLUA_UNARY_EXP), "exp", "exp: no CUDA device available");
    ck_assert_ptr_null(out);
    tu_expect_error_at(dlua_tensor_fill_(&on0, 1), "fill_", "fill_: no CUDA device available");
    tu_expect_error_at(dlua_tensor_copy_(&on0, &on0), "copy_", "copy_: no CUDA device available");
    double back[3];
    tu_expect_error_at(dlua_tensor_to_data(&on0, back, sizeof back), "to_data", "to_data: no CUDA device available");
  } else {
    const struct dlua_ew_ops *kc = NULL;
    ck_assert_int_eq(DLUA_BACKEND("add", 0, ew, run, &kc), DLUA_OK);
    ck_assert_ptr_ne(kc, &dlua_cpu_ew_ops);
    ck_assert_ptr_nonnull(kc->copy);
    ck_assert_ptr_nonnull(kc->download);
  }
  dlua_tensor_free(t);
}
END_TEST

int main(void) {
  Suite *s = suite_create("elementwise");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_binary_all_ops_broadcast);
  tcase_add_test(tc, test_binary_sizes);
  tcase_add_test(tc, test_binary_every_dtype_pair);
  tcase_add_test(tc, test_integer_semantics);
  tcase_add_test(tc, test_half_rounding);
  tcase_add_test(tc, test_noncontiguous);
  tcase_add_test(tc, test_inplace_and_overlap);
  tcase_add_test(tc, test_errors);
  tcase_add_test(tc, test_unary_all_ops);
  tcase_add_test(tc, test_unary_integers);
  tcase_add_test(tc, test_scalar_ops);
  tcase_add_test(tc, test_clamp);
  tcase_add_test(tc, test_where_every_dtype);
  tcase_add_test(tc, test_masked_fill_every_dtype);
  tcase_add_test(tc, test_addcmul_addcdiv_lerp);
  tcase_add_test(tc, test_thread_count_independent);
  tcase_add_test(tc, test_through_the_table);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

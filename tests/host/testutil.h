/* Helpers shared by the host Check suites: reproducible random numbers, dtype round-trips, tensor I/O. */
#ifndef DLUA_TESTS_HOST_TESTUTIL_H
#define DLUA_TESTS_HOST_TESTUTIL_H

#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/tensor.h"

/* ---- random numbers ---------------------------------------------------------------------------
   Three generators, because existing suites depend on the exact sequence theirs produces; each
   suite keeps its own state and seed, so its sequence is unchanged. None uses the library, so a
   library bug cannot hide in the inputs. All return uniform doubles in [-1, 1). */

static inline double tu_lcg(uint64_t *state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(*state >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static inline double tu_xorshift(uint64_t *state) {
  *state ^= *state << 13;
  *state ^= *state >> 7;
  *state ^= *state << 17;
  return (double)(*state >> 11) / (double)(1ull << 52) - 1.0;
}

static inline double tu_splitmix(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* n values scale * gen(state) (caller frees); never a zero-size malloc, so an empty shape still works. */
static inline double *tu_rand_vals(double (*gen)(uint64_t *), uint64_t *state, int64_t n, double scale) {
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = scale * gen(state);
  return v;
}

/* ---- dtype round-trips on raw buffers ------------------------------------------------------------
   Written independently of the library's casts so the kernels are checked against C semantics:
   floats round to nearest even, integers wrap like C casts through int64, bool is x != 0. */

static inline double tu_as_dtype(dlua_dtype_t dt, double x) {
  switch (dt) {
    case DLUA_DTYPE_F32: return (float)x;
    case DLUA_DTYPE_F64: return x;
    case DLUA_DTYPE_F16: return dlua_f16_to_f32(dlua_f32_to_f16((float)x));
    case DLUA_DTYPE_BF16: return dlua_bf16_to_f32(dlua_f32_to_bf16((float)x));
    case DLUA_DTYPE_I32: return (double)(int32_t)(int64_t)x;
    case DLUA_DTYPE_I64: return (double)(int64_t)x;
    case DLUA_DTYPE_U8: return (double)(uint8_t)(int64_t)x;
    default: return x != 0;
  }
}

static inline void tu_put(dlua_dtype_t dt, void *buf, int64_t i, double x) {
  switch (dt) {
    case DLUA_DTYPE_F32: ((float *)buf)[i] = (float)x; break;
    case DLUA_DTYPE_F64: ((double *)buf)[i] = x; break;
    case DLUA_DTYPE_F16: ((uint16_t *)buf)[i] = dlua_f32_to_f16((float)x); break;
    case DLUA_DTYPE_BF16: ((uint16_t *)buf)[i] = dlua_f32_to_bf16((float)x); break;
    case DLUA_DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)(int64_t)x; break;
    case DLUA_DTYPE_I64: ((int64_t *)buf)[i] = (int64_t)x; break;
    case DLUA_DTYPE_U8: ((uint8_t *)buf)[i] = (uint8_t)(int64_t)x; break;
    default: ((uint8_t *)buf)[i] = x != 0; break;
  }
}

static inline double tu_get(dlua_dtype_t dt, const void *buf, int64_t i) {
  switch (dt) {
    case DLUA_DTYPE_F32: return ((const float *)buf)[i];
    case DLUA_DTYPE_F64: return ((const double *)buf)[i];
    case DLUA_DTYPE_F16: return dlua_f16_to_f32(((const uint16_t *)buf)[i]);
    case DLUA_DTYPE_BF16: return dlua_bf16_to_f32(((const uint16_t *)buf)[i]);
    case DLUA_DTYPE_I32: return ((const int32_t *)buf)[i];
    case DLUA_DTYPE_I64: return (double)((const int64_t *)buf)[i];
    default: return ((const uint8_t *)buf)[i];
  }
}

/* ---- tensors from and to doubles ----------------------------------------------------------------- */

/* Built from a raw buffer filled by tu_put, so no library cast is involved (suites testing casts). */
static inline dlua_tensor_t *tu_mk(dlua_dtype_t dt, int nd, const int64_t *sz, const double *v) {
  int64_t n = dlua_shape_numel(nd, sz);
  void *buf = malloc((size_t)(n > 0 ? n : 1) * 8);
  for (int64_t i = 0; i < n; i++) tu_put(dt, buf, i, v[i]);
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&t, nd, sz, dt, buf), DLUA_OK);
  free(buf);
  return t;
}

/* Read back through to_data + tu_get, the mirror of tu_mk. */
static inline double *tu_rd(const dlua_tensor_t *t) {
  int64_t n = dlua_tensor_numel(t);
  size_t es = dlua_dtype_size(dlua_tensor_dtype(t));
  void *buf = malloc((size_t)(n > 0 ? n : 1) * es);
  ck_assert_int_eq(dlua_tensor_to_data(t, buf, (size_t)n * es), DLUA_OK);
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = tu_get(dlua_tensor_dtype(t), buf, i);
  free(buf);
  return v;
}

/* Built through float64 + the library's to_dtype (suites that trust the casts); NULL vals: zeros. */
static inline dlua_tensor_t *tu_make(int nd, const int64_t *sizes, dlua_dtype_t dtype, const double *vals) {
  double *zeros = NULL;
  if (!vals) {
    int64_t n = dlua_shape_numel(nd, sizes);
    vals = zeros = calloc((size_t)(n ? n : 1), sizeof(double));
  }
  dlua_tensor_t *d = NULL, *t = NULL;
  ck_assert_int_eq(dlua_tensor_from_data(&d, nd, sizes, DLUA_DTYPE_F64, vals), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_to_dtype(&t, d, dtype), DLUA_OK);
  dlua_tensor_free(d);
  free(zeros);
  return t;
}

/* Logical (row-major) contents as doubles via to_dtype(F64), so views and odd layouts read right. */
static inline double *tu_values(const dlua_tensor_t *t) {
  dlua_tensor_t *d = NULL;
  ck_assert_int_eq(dlua_tensor_to_dtype(&d, t, DLUA_DTYPE_F64), DLUA_OK);
  int64_t n = dlua_tensor_numel(d);
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  ck_assert_int_eq(dlua_tensor_to_data(d, v, (size_t)n * sizeof(double)), DLUA_OK);
  dlua_tensor_free(d);
  return v;
}

static inline dlua_tensor_t *tu_new_t(int ndim, const int64_t *sizes, dlua_dtype_t dtype) {
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_tensor_empty(&t, ndim, sizes, dtype, DLUA_CPU), DLUA_OK);
  return t;
}

/* ---- assertions ------------------------------------------------------------------------------------ */

/* Relative-plus-absolute tolerance; NaN anywhere fails (suites that accept NaN keep their own). */
static inline void tu_expect_close(const double *got, const double *want, int64_t n, double tol, const char *what) {
  for (int64_t i = 0; i < n; i++) {
    double err = fabs(got[i] - want[i]);
    if (!(err <= tol * (1.0 + fabs(want[i]))))
      ck_abort_msg("%s: element %lld is %.9g, expected %.9g (tolerance %g)", what, (long long)i, got[i], want[i], tol);
  }
}

/* Equal within tol, NaN equal to NaN, infinities equal only to themselves. */
static inline int tu_close_to(double got, double want, double tol) {
  if (isnan(want)) return isnan(got);
  if (isinf(want)) return got == want;
  if (!isfinite(tol)) tol = 0;
  return fabs(got - want) <= tol;
}

static inline int tu_err_has(const char *s) { return strstr(dlua_last_error(), s) != NULL; }

static inline void tu_expect_error(dlua_status_t s, const char *needle) {
  ck_assert_int_eq(s, DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), needle) != NULL, "error \"%s\" lacks \"%s\"", dlua_last_error(), needle);
}

/* Errors of ops that must name themselves first, so a message from a nested op cannot pass. */
static inline void tu_expect_error_at(dlua_status_t s, const char *op, const char *needle) {
  ck_assert_int_eq(s, DLUA_ERR_ARG);
  const char *m = dlua_last_error();
  ck_assert_msg(strncmp(m, op, strlen(op)) == 0, "error \"%s\" does not start with \"%s\"", m, op);
  ck_assert_msg(strstr(m, needle) != NULL, "error \"%s\" lacks \"%s\"", m, needle);
}

/* ---- main ------------------------------------------------------------------------------------------ */

/* Runs the suite and turns the failure count into main's exit status for ctest. */
static inline int tu_run(Suite *s) {
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

#endif

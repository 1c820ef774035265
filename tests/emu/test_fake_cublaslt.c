/* The fake cuBLASLt (fake_cublaslt.c) against a naive reference, with stand-ins for the emulator's hooks:
   cuemu_enqueue queues a copy of the work, which runs only at flush(), after the test has destroyed the descriptors
   and scribbled over alpha and beta; cuemu_memory_kind knows the buffers the test registered.
     gcc -std=c11 -O1 -Wall -Wextra -I/usr/local/cuda/include -Ihost/cuemu tests/emu/test_fake_cublaslt.c \
         host/cuemu/fake_cublaslt.c -lm -o /tmp/t_lt && /tmp/t_lt */
#include <cublasLt.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuemu.h"

/* ---- the emulator's hooks ------------------------------------------------------------------------ */

enum { MAXQ = 16, MAXBUF = 16 };
static struct {
  void (*fn)(void *);
  void *arg;
} queue[MAXQ];
static int queued, fails;
static cudaStream_t last_stream;
static struct {
  const char *p;
  size_t n;
} bufs[MAXBUF];
static int nbufs;

void cuemu_enqueue(cudaStream_t s, void (*fn)(void *arg), const void *arg, size_t size) {
  if (queued == MAXQ) abort();
  queue[queued].fn = fn, queue[queued].arg = malloc(size);
  memcpy(queue[queued++].arg, arg, size);
  last_stream = s;
}

int cuemu_memory_kind(const void *p, size_t n) {
  for (int i = 0; i < nbufs; i++)
    if ((const char *)p >= bufs[i].p && (const char *)p + n <= bufs[i].p + bufs[i].n) return 1;
  return 0;
}

void cuemu_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "  (cuemu_fail: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, ")\n");
  va_end(ap);
  fails++;
}

static void flush(void) {
  for (int i = 0; i < queued; i++) queue[i].fn(queue[i].arg), free(queue[i].arg);
  queued = 0;
}

static void *dev_alloc(size_t n) {  // "device" memory
  char *p = malloc(n ? n : 1);
  bufs[nbufs].p = p, bufs[nbufs++].n = n;
  return p;
}

static void dev_free_all(void) {
  for (int i = 0; i < nbufs; i++) free((void *)bufs[i].p);
  nbufs = 0;
}

/* ---- values: encoded exactly (test inputs are representable), decoded independently of the fake ---- */

static int failures, checks;
#define CHECK(cond, ...)                                               \
  do {                                                                 \
    checks++;                                                          \
    if (!(cond)) {                                                     \
      failures++;                                                      \
      printf("FAIL %s:%d: ", __FILE__, __LINE__), printf(__VA_ARGS__); \
      printf("\n");                                                    \
    }                                                                  \
  } while (0)

static uint16_t f16_exact(double v) {  // v must be 0 or a normal half
  if (v == 0) return signbit(v) ? 0x8000 : 0;
  int e;
  double f = frexp(fabs(v), &e);  // |v| = f 2^e, f in [0.5, 1)
  return (uint16_t)((v < 0 ? 0x8000 : 0) | ((e + 14) << 10) | ((int)(f * 2048) - 1024));
}

static double f16_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0x1f ? (m ? NAN : INFINITY) : e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
  return h & 0x8000 ? -v : v;
}

static uint16_t bf16_exact(double v) {
  float f = (float)v;
  uint32_t x;
  memcpy(&x, &f, 4);
  return (uint16_t)(x >> 16);
}

static double bf16_value(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static size_t esize(cudaDataType t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }

static double get(cudaDataType t, const void *p, int64_t i) {
  switch (t) {
    case CUDA_R_64F: return ((const double *)p)[i];
    case CUDA_R_32F: return ((const float *)p)[i];
    case CUDA_R_16F: return f16_value(((const uint16_t *)p)[i]);
    default: return bf16_value(((const uint16_t *)p)[i]);
  }
}

static void put(cudaDataType t, void *p, int64_t i, double v) {
  switch (t) {
    case CUDA_R_64F: ((double *)p)[i] = v; break;
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_16F: ((uint16_t *)p)[i] = isnan(v) ? 0x7e00 : f16_exact(v); break;
    default: ((uint16_t *)p)[i] = isnan(v) ? 0x7fc0 : bf16_exact(v); break;
  }
}

static uint64_t rng = 0x9e3779b97f4a7c15u;
static double rnd(cudaDataType t) {  // in [-2, 2]; multiples of 1/32 for the 16-bit types (exact there)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  int64_t r = (int64_t)(rng >> 11) % 129 - 64;
  return t == CUDA_R_16F || t == CUDA_R_16BF ? r / 32.0 : (double)(rng >> 11) / 9007199254740992.0 * 4 - 2;
}

/* ---- one product against the reference ------------------------------------------------------------ */

typedef struct {
  cudaDataType ab, cd;
  cublasComputeType_t compute;
  int ta, tb, m, n, k, pad, batch, row_major, alias, nan_c;
  double alpha, beta;
} case_t;

static int64_t at(int row_major, int64_t ld, int64_t i, int64_t j) { return row_major ? i * ld + j : i + j * ld; }

static void run_case(const char *name, case_t t) {
  cudaDataType_t scale = t.compute == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F;
  int64_t ar = t.ta ? t.k : t.m, ac = t.ta ? t.m : t.k, br = t.tb ? t.n : t.k, bc = t.tb ? t.k : t.n;
  int64_t lda = (t.row_major ? ac : ar) + t.pad, ldb = (t.row_major ? bc : br) + 2 * t.pad,
          ldc = (t.row_major ? t.n : t.m) + t.pad;
  int64_t sa = lda * (t.row_major ? ar : ac) + 3, sb = ldb * (t.row_major ? br : bc) + 1,
          sc = ldc * (t.row_major ? t.m : t.n) + 2;  // batch strides with gaps
  size_t na = (size_t)(sa * t.batch), nb = (size_t)(sb * t.batch), nc = (size_t)(sc * t.batch);
  char *A = dev_alloc(na * esize(t.ab)), *B = dev_alloc(nb * esize(t.ab)), *C = dev_alloc(nc * esize(t.cd));
  char *D = t.alias ? C : dev_alloc(nc * esize(t.cd));
  double *ref = malloc(sizeof(double) * nc), *mag = malloc(sizeof(double) * nc);
  for (size_t i = 0; i < na; i++) put(t.ab, A, (int64_t)i, rnd(t.ab));
  for (size_t i = 0; i < nb; i++) put(t.ab, B, (int64_t)i, rnd(t.ab));
  for (size_t i = 0; i < nc; i++) put(t.cd, C, (int64_t)i, t.nan_c ? NAN : rnd(t.cd));
  if (!t.alias)
    for (size_t i = 0; i < nc; i++) put(t.cd, D, (int64_t)i, 77);  // sentinel
  for (size_t i = 0; i < nc; i++) ref[i] = get(t.cd, D, (int64_t)i), mag[i] = 0;  // what must stay outside
  for (int bi = 0; bi < t.batch; bi++)
    for (int64_t i = 0; i < t.m; i++)
      for (int64_t j = 0; j < t.n; j++) {
        double acc = 0, sum = 0;
        for (int64_t p = 0; p < t.k; p++) {
          double x = get(t.ab, A, bi * sa + (t.ta ? at(t.row_major, lda, p, i) : at(t.row_major, lda, i, p)));
          double y = get(t.ab, B, bi * sb + (t.tb ? at(t.row_major, ldb, j, p) : at(t.row_major, ldb, p, j)));
          acc += x * y, sum += fabs(x * y);
        }
        int64_t o = bi * sc + at(t.row_major, ldc, i, j);
        double c = t.beta != 0 ? get(t.cd, C, o) : 0;
        ref[o] = t.alpha * acc + t.beta * c, mag[o] = fabs(t.alpha) * sum + fabs(t.beta * c) + 1e-300;
      }

  cublasLtHandle_t h;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulPreference_t pref;
  int32_t opa = t.ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = t.tb ? CUBLAS_OP_T : CUBLAS_OP_N, order = CUBLASLT_ORDER_ROW;
  int ok = cublasLtCreate(&h) == 0 && cublasLtMatmulDescCreate(&desc, t.compute, scale) == 0 &&
           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) == 0 &&
           cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb) == 0 &&
           cublasLtMatrixLayoutCreate(&la, t.ab, (uint64_t)ar, (uint64_t)ac, lda) == 0 &&
           cublasLtMatrixLayoutCreate(&lb, t.ab, (uint64_t)br, (uint64_t)bc, ldb) == 0 &&
           cublasLtMatrixLayoutCreate(&lc, t.cd, (uint64_t)t.m, (uint64_t)t.n, ldc) == 0 &&
           cublasLtMatmulPreferenceCreate(&pref) == 0;
  cublasLtMatrixLayout_t ls[3] = {la, lb, lc};
  int64_t strides[3] = {sa, sb, sc};
  for (int i = 0; i < 3 && ok; i++) {
    int32_t n = t.batch;
    ok = (t.batch == 1 || (cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, 4) == 0 &&
                           cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                            &strides[i], 8) == 0)) &&
         (!t.row_major || cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_ORDER, &order, 4) == 0);
  }
  size_t ws = 1 << 20;
  uint32_t al = 2;
  ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) == 0 &&
       cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al) == 0;
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  ok = ok && cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &res, &found) == 0;
  CHECK(ok && found == 1 && res.state == CUBLAS_STATUS_SUCCESS && res.workspaceSize == 0, "%s: setup", name);
  float af = (float)t.alpha, bf = (float)t.beta;
  double ad = t.alpha, bd = t.beta;
  cudaStream_t stream = (cudaStream_t)(uintptr_t)0x5150;
  cublasStatus_t st = cublasLtMatmul(h, desc, scale == CUDA_R_64F ? (void *)&ad : (void *)&af, A, la, B, lb,
                                     scale == CUDA_R_64F ? (void *)&bd : (void *)&bf, C, lc, D, lc, &res.algo, NULL, 0,
                                     stream);
  CHECK(st == CUBLAS_STATUS_SUCCESS, "%s: cublasLtMatmul: %s", name, cublasLtGetStatusString(st));
  CHECK(queued == 1 && last_stream == stream, "%s: queued %d on %p", name, queued, (void *)last_stream);
  int untouched = 1;  // nothing computed at the call
  for (size_t i = 0; i < nc && !t.alias; i++) untouched &= get(t.cd, D, (int64_t)i) == 77;
  CHECK(untouched, "%s: D written at the call", name);
  cublasLtMatmulPreferenceDestroy(pref), cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc), cublasLtMatmulDescDestroy(desc), cublasLtDestroy(h);
  af = bf = 1e30f, ad = bd = 1e300;  // alpha and beta are taken by value at the call
  flush();
  double rel = t.cd == CUDA_R_64F ? 0x1p-52 : t.cd == CUDA_R_32F ? 0x1p-24 : t.cd == CUDA_R_16F ? 0x1p-11 : 0x1p-8;
  double worst = 0;
  int bad = 0;
  for (size_t i = 0; i < nc; i++) {
    double g = get(t.cd, D, (int64_t)i), err = fabs(g - ref[i]);
    if (mag[i] == 0) {  // outside the matrices: unchanged (C's own values when D is C)
      bad += !(g == ref[i] || (isnan(g) && isnan(ref[i])));
      continue;
    }
    double tol = rel * fabs(ref[i]) + 1e-15 * mag[i] + (t.cd == CUDA_R_16F ? 0x1p-25 : 0);
    if (!(err <= tol)) {
      if (bad++ < 3) printf("  %s: element %zu: got %.17g want %.17g\n", name, i, g, ref[i]);
    } else if (err / mag[i] > worst) {
      worst = err / mag[i];
    }
  }
  CHECK(bad == 0, "%s: %d wrong elements", name, bad);
  printf("%-44s m=%-2d n=%-2d k=%-2d batch=%d  max |err|/sum|terms| %.2g\n", name, t.m, t.n, t.k, t.batch, worst);
  free(ref), free(mag), dev_free_all();
}

/* One element, D = alpha * 1 * 1 in the 16-bit types: float-to-half rounding through the fake. */
static double round_16(cudaDataType t, float x) {
  uint16_t one = t == CUDA_R_16F ? 0x3c00 : 0x3f80, *a = dev_alloc(2), *b = dev_alloc(2), *d = dev_alloc(2);
  *a = *b = one;
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t l;
  float zero = 0;
  cublasLtCreate(&h), cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatrixLayoutCreate(&l, t, 1, 1, 1);
  cublasStatus_t st = cublasLtMatmul(h, desc, &x, a, l, b, l, &zero, NULL, l, d, l, NULL, NULL, 0, 0);
  flush();
  double v = st ? -1 : t == CUDA_R_16F ? f16_value(*d) : bf16_value(*d);
  cublasLtMatrixLayoutDestroy(l), cublasLtMatmulDescDestroy(desc), cublasLtDestroy(h), dev_free_all();
  return v;
}

int main(void) {
  const cublasComputeType_t F32 = CUBLAS_COMPUTE_32F;
  char name[80];
  for (int tt = 0; tt < 4; tt++) {  // all four transpose pairs, each dtype
    int ta = tt & 1, tb = tt >> 1;
    snprintf(name, sizeof name, "f32 ta=%d tb=%d", ta, tb);
    run_case(name, (case_t){CUDA_R_32F, CUDA_R_32F, F32, ta, tb, 7, 5, 3, 0, 1, 0, 0, 0, 1, 0});
    snprintf(name, sizeof name, "f64 ta=%d tb=%d ld+2 beta=1", ta, tb);
    run_case(name, (case_t){CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, ta, tb, 33, 17, 9, 2, 1, 0, 0, 0, 1, 1});
    snprintf(name, sizeof name, "f16 ta=%d tb=%d batch=3 alpha=2 beta=1", ta, tb);
    run_case(name, (case_t){CUDA_R_16F, CUDA_R_16F, F32, ta, tb, 7, 5, 3, 1, 3, 0, 0, 0, 2, 1});
    snprintf(name, sizeof name, "bf16 ta=%d tb=%d ld+3 beta=0 NaN C", ta, tb);
    run_case(name, (case_t){CUDA_R_16BF, CUDA_R_16BF, F32, ta, tb, 33, 17, 9, 3, 1, 0, 0, 1, 1, 0});
  }
  run_case("f32 1x1x1", (case_t){CUDA_R_32F, CUDA_R_32F, F32, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0});
  run_case("f32 tf32 batch=3 ld+1 alpha=2 beta=0 NaN C",
           (case_t){CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, 1, 0, 33, 17, 9, 1, 3, 0, 0, 1, 2, 0});
  run_case("f64 batch=3 C is D beta=1 (blaslt's call)",
           (case_t){CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, 1, 1, 7, 5, 3, 1, 3, 0, 1, 0, 1, 1});
  run_case("f32 C is D beta=0 NaN C", (case_t){CUDA_R_32F, CUDA_R_32F, F32, 0, 1, 7, 5, 3, 0, 1, 0, 1, 1, 1, 0});
  run_case("f16 in f32 out beta=-0.5", (case_t){CUDA_R_16F, CUDA_R_32F, F32, 0, 1, 33, 17, 9, 1, 1, 0, 0, 0, 1, -.5});
  run_case("bf16 row-major batch=3 beta=1",
           (case_t){CUDA_R_16BF, CUDA_R_16BF, F32, 1, 0, 7, 5, 3, 2, 3, 1, 0, 0, 1, 1});
  run_case("f32 k=0 beta=2", (case_t){CUDA_R_32F, CUDA_R_32F, F32, 0, 0, 7, 5, 0, 0, 1, 0, 0, 0, 1, 2});
  CHECK(fails == 0, "cuemu_fail called %d times", fails);

  // float -> f16 / bf16, round to nearest even, through D.
  struct {
    cudaDataType t;
    float x;
    double want;
  } r16[] = {
      {CUDA_R_16F, 65504.f, 65504}, {CUDA_R_16F, 65519.f, 65504}, {CUDA_R_16F, 65520.f, INFINITY},
      {CUDA_R_16F, 1 + 0x1p-11f, 1}, {CUDA_R_16F, 1 + 3 * 0x1p-11f, 1 + 0x1p-9}, {CUDA_R_16F, -0x1p-24f, -0x1p-24},
      {CUDA_R_16F, 0x1p-25f, 0}, {CUDA_R_16F, 1.5f * 0x1p-25f, 0x1p-24}, {CUDA_R_16F, 3 * 0x1p-25f, 0x1p-23},
      {CUDA_R_16F, 0x1p-14f - 0x1p-25f, 0x1p-14}, {CUDA_R_16F, 0.1f, 0x1.998p-4}, {CUDA_R_16BF, 1 + 0x1p-8f, 1},
      {CUDA_R_16BF, 1 + 3 * 0x1p-8f, 1 + 0x1p-6}, {CUDA_R_16BF, 3.4028235e38f, INFINITY}, {CUDA_R_16BF, -0.1f, -0x1.9ap-4},
  };
  for (size_t i = 0; i < sizeof r16 / sizeof r16[0]; i++) {
    double g = round_16(r16[i].t, r16[i].x);
    CHECK(g == r16[i].want, "%s rounding of %a: got %a want %a", r16[i].t == CUDA_R_16F ? "f16" : "bf16",
          (double)r16[i].x, g, r16[i].want);
  }
  CHECK(isnan(round_16(CUDA_R_16F, NAN)) && isnan(round_16(CUDA_R_16BF, NAN)), "NaN to 16 bits");

  // What is not supported says so; wrong shapes and sizes are invalid values.
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t l16, l64, l32, lbad;
  cublasLtMatmulPreference_t pref;
  cublasLtCreate(&h), cublasLtMatmulDescCreate(&desc, F32, CUDA_R_32F), cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatrixLayoutCreate(&l16, CUDA_R_16F, 4, 4, 4), cublasLtMatrixLayoutCreate(&l64, CUDA_R_64F, 4, 4, 4);
  cublasLtMatrixLayoutCreate(&l32, CUDA_R_32F, 4, 4, 4), cublasLtMatrixLayoutCreate(&lbad, CUDA_R_32F, 4, 3, 4);
  uint32_t relu = CUBLASLT_EPILOGUE_RELU;
  int32_t op7 = 7, devptr = CUBLASLT_POINTER_MODE_DEVICE, col32 = CUBLASLT_ORDER_COL32, ptrs = 1, opt = 1;
  int64_t plane = 64;
  void *bias = NULL;
  cublasStatus_t NS = CUBLAS_STATUS_NOT_SUPPORTED, IV = CUBLAS_STATUS_INVALID_VALUE;
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &relu, 4) == NS, "epilogue relu");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) == NS, "bias");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op7, 4) == NS, "transa 7");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opt, 8) == IV, "transa, 8 bytes");
  CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &devptr, 4) == NS, "device pointers");
  CHECK(cublasLtMatrixLayoutSetAttribute(l32, CUBLASLT_MATRIX_LAYOUT_ORDER, &col32, 4) == NS, "order col32");
  CHECK(cublasLtMatrixLayoutSetAttribute(l32, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &ptrs, 4) == NS, "pointer array");
  CHECK(cublasLtMatrixLayoutSetAttribute(l32, CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET, &plane, 8) == NS, "planar");
  CHECK(cublasLtMatmulPreferenceSetAttribute(pref, (cublasLtMatmulPreferenceAttributes_t)99, &opt, 4) == NS, "pref");
  cublasLtMatmulDesc_t d2 = NULL;
  CHECK(cublasLtMatmulDescCreate(&d2, CUBLAS_COMPUTE_32I, CUDA_R_32I) == NS, "compute 32I");
  CHECK(cublasLtMatmulDescCreate(&d2, CUBLAS_COMPUTE_64F, CUDA_R_64F) == 0, "compute 64F");
  cublasLtMatrixLayout_t l8;
  CHECK(cublasLtMatrixLayoutCreate(&l8, CUDA_R_8I, 4, 4, 4) == NS, "int8 layout");
  float one = 1;
  double oned = 1;
  cublasLtMatmulHeuristicResult_t res;
  int found = 5;
  CHECK(cublasLtMatmul(h, desc, &one, NULL, l16, NULL, l16, &one, NULL, l64, NULL, l64, NULL, NULL, 0, 0) == NS,
        "f16 in f64 out");
  CHECK(cublasLtMatmul(h, desc, &one, NULL, l64, NULL, l64, &one, NULL, l64, NULL, l64, NULL, NULL, 0, 0) == NS,
        "f64 with f32 compute");
  CHECK(cublasLtMatmul(h, d2, &oned, NULL, l32, NULL, l32, &oned, NULL, l32, NULL, l32, NULL, NULL, 0, 0) == NS,
        "f32 with f64 compute");
  CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, l32, l32, lbad, lbad, pref, 1, &res, &found) == IV && found == 0,
        "shape mismatch");
  CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, l32, l32, l32, l32, pref, 0, &res, &found) == IV, "0 algorithms");
  CHECK(queued == 0, "nothing queued by failed calls");
  CHECK(strcmp(cublasLtGetStatusString(NS), "CUBLAS_STATUS_NOT_SUPPORTED") == 0, "status string");

  // C and D with different leading dimensions and batch strides; A and B broadcast over the batch (stride 0).
  {
    double *pa = dev_alloc(2 * 8), *pb = dev_alloc(2 * 8), *pc = dev_alloc(8 * 8), *pd = dev_alloc(14 * 8);
    pa[0] = 1, pa[1] = 2, pb[0] = 3, pb[1] = 4;
    for (int i = 0; i < 8; i++) pc[i] = 10 * i;
    for (int i = 0; i < 14; i++) pd[i] = -1;
    cublasLtMatrixLayout_t xa, xb, xc, xd;
    int32_t two = 2;
    int64_t s0 = 0, s4 = 4, s7 = 7;
    cublasLtMatrixLayoutCreate(&xa, CUDA_R_64F, 2, 1, 2), cublasLtMatrixLayoutCreate(&xb, CUDA_R_64F, 1, 2, 1);
    cublasLtMatrixLayoutCreate(&xc, CUDA_R_64F, 2, 2, 2), cublasLtMatrixLayoutCreate(&xd, CUDA_R_64F, 2, 2, 3);
    cublasLtMatrixLayout_t xs[4] = {xa, xb, xc, xd};
    int64_t *ss[4] = {&s0, &s0, &s4, &s7};
    for (int i = 0; i < 4; i++) {
      cublasLtMatrixLayoutSetAttribute(xs[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, 4);
      cublasLtMatrixLayoutSetAttribute(xs[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, ss[i], 8);
    }
    CHECK(cublasLtMatmul(h, d2, &oned, pa, xa, pb, xb, &oned, pc, xc, pd, xd, NULL, NULL, 0, 0) == 0, "C != D");
    flush();
    int good = 1;
    for (int b = 0; b < 2; b++)
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) good &= pd[b * 7 + i + j * 3] == pa[i] * pb[j] + pc[b * 4 + i + j * 2];
    good &= pd[2] == -1 && pd[5] == -1 && pd[6] == -1 && pd[13] == -1;
    CHECK(good, "C and D laid out differently");
    for (int i = 0; i < 4; i++) cublasLtMatrixLayoutDestroy(xs[i]);
    dev_free_all();
  }

  // A matrix reaching past its allocation is reported when the product runs, and D is not written.
  float *a = dev_alloc(16 * 4), *d = dev_alloc(15 * 4);
  for (int i = 0; i < 16; i++) a[i] = 1;
  for (int i = 0; i < 15; i++) d[i] = 7;
  float zero = 0;
  CHECK(cublasLtMatmul(h, desc, &one, a, l32, a, l32, &zero, d, l32, d, l32, NULL, NULL, 0, 0) == 0, "queued");
  flush();
  CHECK(fails == 1 && d[0] == 7, "out of bounds D: %d failures", fails);
  dev_free_all();

  cublasLtMatrixLayoutDestroy(l16), cublasLtMatrixLayoutDestroy(l64), cublasLtMatrixLayoutDestroy(l32);
  cublasLtMatrixLayoutDestroy(lbad), cublasLtMatmulDescDestroy(desc), cublasLtMatmulDescDestroy(d2);
  cublasLtMatmulPreferenceDestroy(pref), cublasLtDestroy(h);
  printf("%s: %d checks, %d failed\n", failures ? "FAILED" : "ok", checks, failures);
  return failures != 0;
}

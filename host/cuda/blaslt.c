/* GEMM on CUDA through cuBLASLt, loaded with dlopen (the toolkit's lib64 or Python packages' nvidia/cublas/lib,
   via LD_LIBRARY_PATH): f32 (exact unless TF32 is allowed), f64, f16 and bf16 with f32 accumulation. */
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda/kernels.h"
#include "kernels/blas.h"


/* ---- the library ------------------------------------------------------------------------------- */

typedef struct {
  cublasStatus_t (*create)(cublasLtHandle_t *);
  const char *(*status_string)(cublasStatus_t);
  cublasStatus_t (*desc_create)(cublasLtMatmulDesc_t *, cublasComputeType_t, cudaDataType_t);
  cublasStatus_t (*desc_destroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*desc_set)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void *, size_t);
  cublasStatus_t (*layout_create)(cublasLtMatrixLayout_t *, cudaDataType, uint64_t, uint64_t, int64_t);
  cublasStatus_t (*layout_destroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*layout_set)(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t, const void *, size_t);
  cublasStatus_t (*pref_create)(cublasLtMatmulPreference_t *);
  cublasStatus_t (*pref_destroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*pref_set)(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void *, size_t);
  cublasStatus_t (*heuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                              cublasLtMatmulHeuristicResult_t[], int *);
  cublasStatus_t (*matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *, cublasLtMatrixLayout_t,
                           const void *, cublasLtMatrixLayout_t, const void *, const void *, cublasLtMatrixLayout_t,
                           void *, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t);
} lt_api_t;

static lt_api_t lt;
static char lt_error[512];
static pthread_once_t lt_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lt_lock = PTHREAD_MUTEX_INITIALIZER;
static cublasLtHandle_t handles[64];
static int allow_tf32;  // PyTorch's default for matmul since 1.12: exact f32

static void lt_load(void) {
#ifdef DLUA_CUDA_EMU
  /* The CUDA emulator's build loads its own cuBLASLt (host/cuemu/fake_cublaslt.c) and never a real one. */
  static const char *const names[] = {DLUA_CUEMU_CUBLASLT, NULL};
#else
  static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
                                      "/usr/local/cuda/lib64/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so",
                                      NULL};
#endif
  void *h = NULL;
  const char *why = "not found";
  for (int i = 0; names[i] && !h; i++) {
    h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) why = dlerror();
  }
  if (!h) {
    snprintf(lt_error, sizeof lt_error, "cannot load cuBLASLt (libcublasLt.so.13; set LD_LIBRARY_PATH to the CUDA "
                                        "toolkit's lib64 or to Python's nvidia/cublas/lib): %s", why ? why : "");
    return;
  }
  struct {
    void **slot;
    const char *name;
  } syms[] = {
      {(void **)&lt.create, "cublasLtCreate"},
      {(void **)&lt.status_string, "cublasLtGetStatusString"},
      {(void **)&lt.desc_create, "cublasLtMatmulDescCreate"},
      {(void **)&lt.desc_destroy, "cublasLtMatmulDescDestroy"},
      {(void **)&lt.desc_set, "cublasLtMatmulDescSetAttribute"},
      {(void **)&lt.layout_create, "cublasLtMatrixLayoutCreate"},
      {(void **)&lt.layout_destroy, "cublasLtMatrixLayoutDestroy"},
      {(void **)&lt.layout_set, "cublasLtMatrixLayoutSetAttribute"},
      {(void **)&lt.pref_create, "cublasLtMatmulPreferenceCreate"},
      {(void **)&lt.pref_destroy, "cublasLtMatmulPreferenceDestroy"},
      {(void **)&lt.pref_set, "cublasLtMatmulPreferenceSetAttribute"},
      {(void **)&lt.heuristic, "cublasLtMatmulAlgoGetHeuristic"},
      {(void **)&lt.matmul, "cublasLtMatmul"},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(lt_error, sizeof lt_error, "cuBLASLt lacks %s", syms[i].name);
      lt.matmul = NULL;
      return;
    }
  }
}

void dlua_cuda_set_allow_tf32(int allow) { __atomic_store_n(&allow_tf32, allow ? 1 : 0, __ATOMIC_RELAXED); }
int dlua_cuda_get_allow_tf32(void) { return __atomic_load_n(&allow_tf32, __ATOMIC_RELAXED); }

static const char *lt_str(cublasStatus_t st) { return lt.status_string ? lt.status_string(st) : "?"; }

#define LT_TRY(call)                                                                                            \
  do {                                                                                                          \
    cublasStatus_t st_ = (call);                                                                                \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                                         \
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: cuBLASLt %s failed: %s (status %d)", op, #call, lt_str(st_), (int)st_); \
      goto done;                                                                                                \
    }                                                                                                           \
  } while (0)

/* The largest power of two (up to 256) dividing the address and the batch stride in bytes (0: none). */
static uint32_t alignment(const void *p, int64_t stride_bytes) {
  uint32_t a = 256;
  while (a > 1 && (((uintptr_t)p % a) != 0 || (stride_bytes != 0 && stride_bytes % (int64_t)a != 0))) a /= 2;
  return a;
}

/* ---- one (strided-batched) product -------------------------------------------------------------- */

enum { WORKSPACE = 32 << 20 };

static dlua_status_t lt_gemm(const char *op, int dtype, int ta, int tb, int64_t m, int64_t n, int64_t k, double alpha,
                             const void *a, int64_t lda, int64_t sa, const void *b, int64_t ldb, int64_t sb, double beta,
                             void *c, int64_t ldc, int64_t sc, int64_t batch, int device) {
  if (m == 0 || n == 0 || batch == 0) return DLUA_OK;
  pthread_once(&lt_once, lt_load);
  if (!lt.matmul) return DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s", op, lt_error);
  if (device < 0 || device >= 64) return DLUA_ERR(DLUA_ERR_ARG, "%s: invalid device %d", op, device);

  cudaDataType_t io;
  cublasComputeType_t ct;
  cudaDataType_t scale;
  switch (dtype) {
    case DLUA_DTYPE_F32:
      io = CUDA_R_32F;
      ct = dlua_cuda_get_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      scale = CUDA_R_32F;
      break;
    case DLUA_DTYPE_F64: io = CUDA_R_64F, ct = CUBLAS_COMPUTE_64F, scale = CUDA_R_64F; break;
    case DLUA_DTYPE_F16: io = CUDA_R_16F, ct = CUBLAS_COMPUTE_32F, scale = CUDA_R_32F; break;
    case DLUA_DTYPE_BF16: io = CUDA_R_16BF, ct = CUBLAS_COMPUTE_32F, scale = CUDA_R_32F; break;
    default: return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d yet for dtype %d", op, device, dtype);
  }

  int prev = 0;
  cudaError_t ce = cudaGetDevice(&prev);
  if (ce == cudaSuccess && prev != device) ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s", op, device, cudaGetErrorString(ce));
  }
  dlua_status_t s = DLUA_OK;
  cublasLtMatmulDesc_t desc = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
  cublasLtMatmulPreference_t pref = NULL;
  void *ws = NULL;
  cudaStream_t stream = (cudaStream_t)dlua_cuda_raw_stream(device);

  pthread_mutex_lock(&lt_lock);
  if (!handles[device]) {
    cublasStatus_t st = lt.create(&handles[device]);
    if (st != CUBLAS_STATUS_SUCCESS) {
      handles[device] = NULL;
      pthread_mutex_unlock(&lt_lock);
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: cublasLtCreate failed on cuda:%d: %s (status %d)", op, device, lt_str(st),
                   (int)st);
      goto done;
    }
  }
  cublasLtHandle_t handle = handles[device];
  pthread_mutex_unlock(&lt_lock);

  // Row-major C (m, n) = A (m, k) B (k, n) is column-major C^T (n, m) = B^T A^T: cuBLASLt's "A" is our B.
  cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_TRY(lt.desc_create(&desc, ct, scale));
  LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  // Column-major shapes as stored: our B is (k, n) row-major = (n, k) column-major, transposed when tb.
  LT_TRY(lt.layout_create(&la, io, tb ? (uint64_t)k : (uint64_t)n, tb ? (uint64_t)n : (uint64_t)k, ldb));
  LT_TRY(lt.layout_create(&lb, io, ta ? (uint64_t)m : (uint64_t)k, ta ? (uint64_t)k : (uint64_t)m, lda));
  LT_TRY(lt.layout_create(&lc, io, (uint64_t)n, (uint64_t)m, ldc));
  if (batch > 1) {
    int32_t bc = (int32_t)batch;
    LT_TRY(lt.layout_set(la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    LT_TRY(lt.layout_set(lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    LT_TRY(lt.layout_set(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    LT_TRY(lt.layout_set(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sb, sizeof sb));
    LT_TRY(lt.layout_set(lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sa, sizeof sa));
    LT_TRY(lt.layout_set(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc, sizeof sc));
  }
  size_t wsize = WORKSPACE;
  LT_TRY(lt.pref_create(&pref));
  LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsize, sizeof wsize));
  {
    // The heuristic assumes 256-byte aligned matrices unless told: views and batch offsets may be less.
    const size_t es = dtype == DLUA_DTYPE_F64 ? 8 : dtype == DLUA_DTYPE_F32 ? 4 : 2;
    uint32_t al_a = alignment(b, batch > 1 ? sb * (int64_t)es : 0), al_b = alignment(a, batch > 1 ? sa * (int64_t)es : 0);
    uint32_t al_c = alignment(c, batch > 1 ? sc * (int64_t)es : 0);
    LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
    LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));
  }
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  memset(&res, 0, sizeof res);
  LT_TRY(lt.heuristic(handle, desc, la, lb, lc, lc, pref, 1, &res, &found));
  if (found < 1) {
    s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: cuBLASLt has no algorithm for this product (m=%lld n=%lld k=%lld, dtype %d)", op,
                 (long long)m, (long long)n, (long long)k, dtype);
    goto done;
  }
  // Workspace from the caching allocator on the stream the product runs on: reused in stream order.
  if (res.workspaceSize > 0) {
    s = dlua_cuda_malloc(&ws, device, res.workspaceSize, NULL);
    if (s != DLUA_OK) goto done;
  }
  {
    float af = (float)alpha, bf = (float)beta;
    const void *pa = scale == CUDA_R_64F ? (const void *)&alpha : (const void *)&af;
    const void *pb = scale == CUDA_R_64F ? (const void *)&beta : (const void *)&bf;
    LT_TRY(lt.matmul(handle, desc, pa, b, la, a, lb, pb, c, lc, c, lc, &res.algo, ws, res.workspaceSize, stream));
  }
done:
  if (ws && dlua_cuda_free(device, ws) != DLUA_OK && s == DLUA_OK) s = DLUA_ERR_BACKEND;
  if (pref) lt.pref_destroy(pref);
  if (lc) lt.layout_destroy(lc);
  if (lb) lt.layout_destroy(lb);
  if (la) lt.layout_destroy(la);
  if (desc) lt.desc_destroy(desc);
  if (prev != device) cudaSetDevice(prev);
  return s;
}

/* ---- the blas table's slots (kernels/blas.h) ------------------------------------------------------- */

/* Products in the result dtype (f16/bf16 accumulate in f32 in cuBLASLt), every operand in BLAS form; cuBLASLt
   takes no k = 0, so the front door makes that empty sum itself. */
static dlua_status_t cuda_caps(const char *op, int dtype, dlua_gemm_caps_t *caps) {
  (void)op;
  const int ok = dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_F64 || dtype == DLUA_DTYPE_F16 || dtype == DLUA_DTYPE_BF16;
  *caps = (dlua_gemm_caps_t){.dtype = ok ? dtype : -1, .blas_form = 1, .empty_sum = 0};
  return DLUA_OK;
}

/* One strided-batched call when the batch allows, else one call per matrix. */
static dlua_status_t cuda_gemm(const char *op, const dlua_gemm_desc_t *pl) {
  const int64_t nbatch = dlua_shape_numel(pl->bnd, pl->bsz), es = (int64_t)dlua_dtype_size((dlua_dtype_t)pl->dtype);
  if (nbatch == 0 || pl->m == 0 || pl->n == 0) return DLUA_OK;
  int tra = 0, trb = 0;
  int64_t lda = 0, ldb = 0;
  if (!dlua_blas_form(pl->m, pl->k, pl->ars, pl->acs, &tra, &lda) ||
      !dlua_blas_form(pl->k, pl->n, pl->brs, pl->bcs, &trb, &ldb))
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: operand layout not expressible for cuBLASLt", op);
  const char *ap = pl->a, *bp = pl->b;
  char *cp = pl->c;
  if (pl->bnd == 0)
    return lt_gemm(op, pl->dtype, tra, trb, pl->m, pl->n, pl->k, pl->alpha, ap, lda, 0, bp, ldb, 0, pl->beta, cp, pl->n,
                   0, 1, pl->device);
  if (pl->bnd == 1 && pl->ast[0] != 0 && pl->bst[0] != 0)
    return lt_gemm(op, pl->dtype, tra, trb, pl->m, pl->n, pl->k, pl->alpha, ap, lda, pl->ast[0], bp, ldb, pl->bst[0],
                   pl->beta, cp, pl->n, pl->cst[0], nbatch, pl->device);
  dlua_status_t s = DLUA_OK;
  for (int64_t bi = 0; bi < nbatch && s == DLUA_OK; bi++)
    s = lt_gemm(op, pl->dtype, tra, trb, pl->m, pl->n, pl->k, pl->alpha,
                ap + dlua_unravel(pl->bnd, pl->bsz, pl->ast, bi) * es, lda, 0,
                bp + dlua_unravel(pl->bnd, pl->bsz, pl->bst, bi) * es, ldb, 0, pl->beta,
                cp + dlua_unravel(pl->bnd, pl->bsz, pl->cst, bi) * es, pl->n, 0, 1, pl->device);
  return s;
}

const struct dlua_blas_ops dlua_cuda_blas_ops = {
    .caps = cuda_caps,
    .gemm = cuda_gemm,
};

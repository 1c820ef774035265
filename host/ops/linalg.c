/* The front doors of the matrix products (mm, bmm, addmm, matmul): operand checks, matmul's 1-D promotion,
   broadcast batch dims, dtypes, the operands' BLAS form and `out`, then one call through the blas table of
   the operands' device (host/kernels/blas.h). */
#include <inttypes.h>
#include <string.h>
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/blas.h"
#include "ops/backend.h"
#include "ops/common.h"

/* ---- shapes and operands ---------------------------------------------------------------------- */

/* Makes the (rows, cols) matrix view *v usable by BLAS (one unit stride): when it is not, *v
   becomes a contiguous copy, held through *owned (which frees what it held before). */
static dlua_status_t to_blas_form(dlua_tensor_t *v, dlua_tensor_t **owned, int64_t rows, int64_t cols, int64_t rs,
                                  int64_t cs) {
  int tr;
  int64_t ld;
  if (dlua_blas_form(rows, cols, rs, cs, &tr, &ld)) return DLUA_OK;
  dlua_tensor_t *copy = NULL;
  DLUA_TRY(dlua_tensor_contiguous(&copy, v));
  dlua_tensor_free(*owned);
  *owned = copy;
  *v = *copy;
  return DLUA_OK;
}

/* Builds the plan for local views av (..., m, k) and bv (..., k, n), both with >= 2 dims. */
static dlua_status_t make_plan(const char *op, const struct dlua_tensor *av, const struct dlua_tensor *bv,
                               const dlua_tensor_t *a0, const dlua_tensor_t *b0, dlua_gemm_desc_t *pl) {
  int na = av->ndim, nb = bv->ndim;
  pl->m = av->sizes[na - 2];
  pl->k = av->sizes[na - 1];
  pl->n = bv->sizes[nb - 1];
  char b1[200], b2[200];
  if (bv->sizes[nb - 2] != pl->k)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: %s and %s cannot be multiplied (%" PRId64 " columns vs %" PRId64 " rows)", op,
                    dlua_tensor_describe(a0, b1, sizeof b1), dlua_tensor_describe(b0, b2, sizeof b2), pl->k,
                    bv->sizes[nb - 2]);
  pl->ars = av->strides[na - 2];
  pl->acs = av->strides[na - 1];
  pl->brs = bv->strides[nb - 2];
  pl->bcs = bv->strides[nb - 1];
  DLUA_TRY(dlua_broadcast_shapes(op, na - 2, av->sizes, nb - 2, bv->sizes, &pl->bnd, pl->bsz));
  for (int d = 0; d < pl->bnd; d++) {
    int da = d - (pl->bnd - (na - 2)), db = d - (pl->bnd - (nb - 2));
    pl->ast[d] = da >= 0 && av->sizes[da] != 1 ? av->strides[da] : 0;
    pl->bst[d] = db >= 0 && bv->sizes[db] != 1 ? bv->strides[db] : 0;
  }
  dlua_contiguous_strides(pl->bnd, pl->bsz, pl->cst);
  for (int d = 0; d < pl->bnd; d++) pl->cst[d] *= pl->m * pl->n;
  return DLUA_OK;
}

/* A batch of products with a shared 2-D B and a batched A whose batch and row dims walk memory
   with one stride becomes a single taller product: (B*m, k) x (k, n). */
static void fold_batch(dlua_gemm_desc_t *pl, const struct dlua_tensor *av, const struct dlua_tensor *bv, dlua_dtype_t ct) {
  if (pl->bnd == 0 || bv->ndim != 2 || av->ndim < 3) return;
  int na = av->ndim;
  int64_t stride = pl->ars, need = pl->m;  // walking up from the row dim
  for (int d = na - 3; d >= 0; d--) {
    if (av->sizes[d] == 1) continue;
    if (av->strides[d] != stride * need) return;
    stride = av->strides[d];
    need = av->sizes[d];
  }
  int64_t tall = pl->m * dlua_shape_numel(pl->bnd, pl->bsz);
  int tr;
  int64_t ld;
  // sgemm must still see the taller matrix in BLAS form (a transposed A stacks badly).
  if (ct == DLUA_DTYPE_F32 && !dlua_blas_form(tall, pl->k, pl->ars, pl->acs, &tr, &ld)) return;
  pl->m = tall;
  pl->bnd = 0;
}

/* Moves t into the compute dtype (a copy) when it is not there already. */
static dlua_status_t to_compute(const dlua_tensor_t *t, dlua_dtype_t ct, dlua_tensor_t **tmp, struct dlua_tensor *v) {
  *tmp = NULL;
  if (t->dtype != ct) {
    DLUA_TRY(dlua_tensor_to_dtype(tmp, t, ct));
    *v = **tmp;
  } else {
    *v = *t;
  }
  return DLUA_OK;
}

/* Appends/prepends size-1 dims so a local view has ndim >= 2 (matmul's 1-D promotion). */
static void promote_1d(struct dlua_tensor *v, int as_row) {
  if (v->ndim != 1) return;
  if (as_row) {  // (k) -> (1, k)
    v->sizes[1] = v->sizes[0];
    v->strides[1] = v->strides[0];
    v->sizes[0] = 1;
    v->strides[0] = v->sizes[1] * v->strides[1];
  } else {  // (k) -> (k, 1)
    v->sizes[1] = 1;
    v->strides[1] = 1;
  }
  v->ndim = 2;
}

/* The shared driver: out (out_nd, out_sizes) holds the batch of (m, n) products contiguously.
   c (may be NULL) is addmm's term, broadcast to out and scaled by beta. */
static dlua_status_t product(const char *op, dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b,
                             int a_as_row, int b_as_col, const dlua_tensor_t *c, double beta, double alpha) {
  char b1[200], b2[200];
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  if (!a || !b) return DLUA_ERR(DLUA_ERR_ARG, "%s: operand is NULL", op);
  DLUA_TRY(dlua_ops_check_input(op, a, NULL));
  DLUA_TRY(dlua_ops_check_input(op, b, NULL));
  if (c) DLUA_TRY(dlua_ops_check_input(op, c, NULL));
  DLUA_TRY(dlua_ops_check_input(op, b, a));
  if (c) DLUA_TRY(dlua_ops_check_input(op, c, a));
  const int dev = a->device;
  dlua_dtype_t rdt = dlua_dtype_promote(a->dtype, b->dtype);
  if (c) rdt = dlua_dtype_promote(rdt, c->dtype);
  if (rdt == DLUA_DTYPE_BOOL)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: cannot multiply bool tensors %s and %s", op,
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  const struct dlua_blas_ops *k;
  DLUA_TRY(DLUA_BACKEND(op, dev, blas, gemm, &k));
  dlua_gemm_caps_t caps = {.dtype = -1};
  if (k->caps) DLUA_TRY(k->caps(op, (int)rdt, &caps));
  if (caps.dtype < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: not supported for %s tensors on their device (got %s and %s)", op,
                    dlua_dtype_name(rdt), dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  const dlua_dtype_t ct = (dlua_dtype_t)caps.dtype;
  // bf16 x bf16 on a backend that multiplies bf16 into its float32 C: the operands are not staged.
  const int ab_bf16 = caps.bf16_ab && ct == DLUA_DTYPE_F32 && a->dtype == DLUA_DTYPE_BF16 && b->dtype == DLUA_DTYPE_BF16;
  const dlua_dtype_t abt = ab_bf16 ? DLUA_DTYPE_BF16 : ct;

  // Shape first (on the caller's tensors), so errors name them before any copy is made.
  struct dlua_tensor av = *a, bv = *b;
  promote_1d(&av, a_as_row);
  promote_1d(&bv, b_as_col ? 0 : 1);
  dlua_gemm_desc_t pl;
  memset(&pl, 0, sizeof pl);
  DLUA_TRY(make_plan(op, &av, &bv, a, b, &pl));
  int64_t osizes[DLUA_MAX_DIMS];
  int ond = 0;
  for (int d = 0; d < pl.bnd; d++) osizes[ond++] = pl.bsz[d];
  if (!(a->ndim == 1 && a_as_row)) osizes[ond++] = pl.m;
  if (!(b->ndim == 1 && b_as_col)) osizes[ond++] = pl.n;

  int64_t csizes[DLUA_MAX_DIMS];
  int cnd = 0;
  if (c) {  // addmm's c broadcasts to the result
    DLUA_TRY(dlua_broadcast_shapes(op, c->ndim, c->sizes, ond, osizes, &cnd, csizes));
    if (cnd != ond || memcmp(csizes, osizes, sizeof(int64_t) * (size_t)ond) != 0) {
      char b3[200];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: input %s does not broadcast to the product's shape %s", op,
                      dlua_tensor_describe(c, b1, sizeof b1), dlua_shape_str(ond, osizes, b3, sizeof b3));
    }
  }

  // Result tensor: *out in the result dtype; the kernel writes ct (a temporary if they differ).
  int allocated = 0;
  if (!*out && rdt != ct) {
    DLUA_TRY(dlua_tensor_empty(out, ond, osizes, rdt, dev));
    allocated = 1;
  }
  dlua_tensor_t *ta = NULL, *tb = NULL, *tc = NULL;
  dlua_ops_out_t plan = {0};
  const dlua_tensor_t *ins[2] = {a, b};
  dlua_status_t s = dlua_ops_out_begin_on(op, out, ond, osizes, ct, ins, 2, dev, &plan);
  if (s == DLUA_OK) s = to_compute(a, abt, &ta, &av);
  if (s == DLUA_OK) s = to_compute(b, abt, &tb, &bv);
  if (s == DLUA_OK) {
    promote_1d(&av, a_as_row);
    promote_1d(&bv, b_as_col ? 0 : 1);
    s = make_plan(op, &av, &bv, a, b, &pl);
  }
  if (s == DLUA_OK && (ct == DLUA_DTYPE_F32 || caps.blas_form)) {
    // BLAS needs each matrix with one unit stride; otherwise work on a contiguous copy.
    s = to_blas_form(&av, &ta, pl.m, pl.k, pl.ars, pl.acs);
    if (s == DLUA_OK) s = to_blas_form(&bv, &tb, pl.k, pl.n, pl.brs, pl.bcs);
    if (s == DLUA_OK) s = make_plan(op, &av, &bv, a, b, &pl);
  }
  if (s == DLUA_OK) fold_batch(&pl, &av, &bv, caps.blas_form ? DLUA_DTYPE_F32 : ct);  // F32: keep A in BLAS form
  double kbeta = 0.0;
  if (s == DLUA_OK && c && beta != 0.0) {
    // dst <- c, unless dst already is c (in-place addmm_); a c overlapping dst otherwise is
    // copied aside first so the broadcast copy does not read what it wrote.
    struct dlua_tensor dv = *plan.dst;
    int same = dlua_tensor_same_storage(plan.dst, c) && c->offset == dv.offset && c->ndim == dv.ndim &&
               memcmp(c->sizes, dv.sizes, sizeof(int64_t) * (size_t)c->ndim) == 0 &&
               memcmp(c->strides, dv.strides, sizeof(int64_t) * (size_t)c->ndim) == 0 && c->dtype == dv.dtype;
    if (!same) {
      const dlua_tensor_t *src = c;
      if (dlua_tensor_same_storage(plan.dst, c)) {
        s = dlua_tensor_clone(&tc, c);
        src = tc;
      }
      if (s == DLUA_OK) s = dlua_tensor_copy_(plan.dst, src);
    }
    kbeta = beta;
  }
  if (s == DLUA_OK) {
    const int64_t nbatch = dlua_shape_numel(pl.bnd, pl.bsz);
    pl.dtype = (int)ct;
    pl.ab_bf16 = ab_bf16;
    pl.a = dlua_tensor_ptr(&av);
    pl.b = dlua_tensor_ptr(&bv);
    pl.c = dlua_tensor_ptr(plan.dst);
    pl.alpha = alpha;
    pl.beta = kbeta;
    pl.device = dev;
    if (!caps.empty_sum && pl.k == 0 && nbatch != 0 && pl.m != 0 && pl.n != 0) {  // an empty sum: C = beta * C
      dlua_tensor_t *dst = plan.dst;
      if (kbeta == 0.0) s = dlua_tensor_fill_(dst, 0.0);
      else if (kbeta != 1.0) s = dlua_tensor_binary_scalar(&dst, dst, kbeta, DLUA_BINARY_MUL, 0);
    } else {
      s = k->gemm(op, &pl);
    }
  }
  dlua_tensor_free(ta);
  dlua_tensor_free(tb);
  dlua_tensor_free(tc);
  s = dlua_ops_out_finish(out, &plan, s);
  if (s != DLUA_OK && allocated) {
    dlua_tensor_free(*out);
    *out = NULL;
  }
  return s;
}

// a: (n, k), b: (k, m)  ->  out: (n, m)
dlua_status_t dlua_tensor_mm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim != 2 || b->ndim != 2))
    return DLUA_ERR(DLUA_ERR_ARG, "mm: expected 2-D matrices, got %s and %s", dlua_tensor_describe(a, b1, sizeof b1),
                    dlua_tensor_describe(b, b2, sizeof b2));
  return product("mm", out, a, b, 0, 0, NULL, 0.0, 1.0);
}

// a: (B, n, k), b: (B, k, m)  ->  out: (B, n, m)
dlua_status_t dlua_tensor_bmm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim != 3 || b->ndim != 3 || a->sizes[0] != b->sizes[0]))
    return DLUA_ERR(DLUA_ERR_ARG, "bmm: expected 3-D batches of the same size, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("bmm", out, a, b, 0, 0, NULL, 0.0, 1.0);
}

// c: broadcasts to (n, m) ; a: (n, k) ; b: (k, m)  ->  out: (n, m) = beta * c + alpha * a @ b
dlua_status_t dlua_tensor_addmm(dlua_tensor_t **out, const dlua_tensor_t *c, const dlua_tensor_t *a,
                                const dlua_tensor_t *b, double beta, double alpha) {
  char b1[200], b2[200];
  if (!c) return DLUA_ERR(DLUA_ERR_ARG, "addmm: input is NULL");
  if (a && b && (a->ndim != 2 || b->ndim != 2))
    return DLUA_ERR(DLUA_ERR_ARG, "addmm: expected 2-D matrices, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("addmm", out, a, b, 0, 0, c, beta, alpha);
}

// torch.matmul: (k)·(k) -> () ; (n, k)·(k) -> (n) ; (k)·(k, m) -> (m) ; (..., n, k)·(..., k, m) -> (..., n, m)
dlua_status_t dlua_tensor_matmul(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b) {
  char b1[200], b2[200];
  if (a && b && (a->ndim == 0 || b->ndim == 0))
    return DLUA_ERR(DLUA_ERR_ARG, "matmul: both operands need at least one dimension, got %s and %s",
                    dlua_tensor_describe(a, b1, sizeof b1), dlua_tensor_describe(b, b2, sizeof b2));
  return product("matmul", out, a, b, 1, 1, NULL, 0.0, 1.0);
}

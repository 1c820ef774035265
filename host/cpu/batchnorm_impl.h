/* Batch-norm kernels for one scalar type: batchnorm.c includes this once per T (float, double) with FN naming the copies;
   with BN_HALF (float only) the same four passes also take f16/bf16 activations (a bn_half_t), unit by unit. */
/* No include guard on purpose: each inclusion instantiates the kernels for another T.

   Inner loops live in always-inline helpers taking their options (ReLU mask, skip, which
   outputs) as arguments; callers pass literal constants, so each combination compiles to a
   branch-free loop the vectoriser takes. Every value is loaded unconditionally for the same
   reason: a load under a condition keeps a loop scalar. */

/* d where y > 0, else +0, by masking the bits: a select here leaves GCC's if-conversion
   unable to vectorise the float reductions below. */
static inline __attribute__((always_inline)) T FN(relu_mask)(T y, T d) {
  UT bits;
  memcpy(&bits, &d, sizeof bits);
  bits &= (UT)0 - (UT)(y > 0);
  memcpy(&d, &bits, sizeof d);
  return d;
}

/* Activations are AT: T itself, or with BN_BF16 (T float) bfloat16 bits, widened on load and rounded
   to nearest even on store exactly as dlua_bf16_to_f32_inl / dlua_f32_to_bf16_inl (copy_'s rules). */
#ifdef BN_BF16
static inline __attribute__((always_inline)) T FN(aget)(const AT *p, int64_t i) { return dlua_bf16_to_f32_inl(p[i]); }
static inline __attribute__((always_inline)) void FN(aset)(AT *p, int64_t i, T v) { p[i] = dlua_f32_to_bf16_inl(v); }
#else
static inline __attribute__((always_inline)) T FN(aget)(const AT *p, int64_t i) { return p[i]; }
static inline __attribute__((always_inline)) void FN(aset)(AT *p, int64_t i, T v) { p[i] = v; }
#endif

/* d masked as `mask` says (batchnorm.c's bn_mask_kind): by y[i] > 0, by the forward's own ReLU
   test xm * a + b > 0 (xm = x - mean; a, b the forward's scale and shift), or not at all. */
static inline __attribute__((always_inline)) T FN(bwd_mask)(T d, int mask, const AT *y, int64_t i, T xm, T a, T b) {
  if (mask == BN_MASK_Y) return FN(relu_mask)(FN(aget)(y, i), d);
  if (mask == BN_MASK_X) return FN(relu_mask)(xm * a + b, d);
  return d;
}

/* call(k) with the mask kind k as a literal, so each kind compiles to its own loop. */
#define BN_MASK_DISPATCH(call, mask)               \
  do {                                             \
    if ((mask) == BN_MASK_X) call(BN_MASK_X);      \
    else if ((mask) == BN_MASK_Y) call(BN_MASK_Y); \
    else call(BN_NO_MASK);                         \
  } while (0)

/* call(k, want_dx, want_ds) with literals: mask kind k, and which of dx (gx), ds (gs) to write. */
#define BN_BWD_WANTS(call, k, gx, gs) \
  do {                                \
    if ((gx) && (gs)) call(k, 1, 1);  \
    else if (gx) call(k, 1, 0);       \
    else call(k, 0, 1);               \
  } while (0)
#define BN_BWD_DISPATCH(call, mask, gx, gs)                              \
  do {                                                                   \
    if ((mask) == BN_MASK_X) BN_BWD_WANTS(call, BN_MASK_X, gx, gs);      \
    else if ((mask) == BN_MASK_Y) BN_BWD_WANTS(call, BN_MASK_Y, gx, gs); \
    else BN_BWD_WANTS(call, BN_NO_MASK, gx, gs);                         \
  } while (0)

#define BN_APPLY_DISPATCH(call, skip, relu) \
  do {                                      \
    if (skip) {                             \
      if (relu) call(1, 1);                 \
      else call(1, 0);                      \
    } else {                                \
      if (relu) call(0, 1);                 \
      else call(0, 0);                      \
    }                                       \
  } while (0)

/* ---- channels-last blocks ------------------------------------------------------------------------- */

/* Channels-last passes run over blocks of rows (one row = the C channels of one position). A
   block function takes VW channels at a time, keeps their parameters and sums in vector
   registers across the block's rows, and leaves the C % VW last channels to a plain loop. The
   functions are compiled per ISA (DLUA_CPU_CLONES) and called from the OpenMP loops, whose
   outlined bodies would only get baseline x86-64. Each lane is one channel and sees its rows in
   order, so every ISA computes the same sums. */
#define VW ((int)(64 / sizeof(T)))
typedef T FN(vT) __attribute__((vector_size(64)));
typedef UT FN(vU) __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) FN(vT) FN(vload)(const T *p) {
  FN(vT) v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void FN(vstore)(T *p, FN(vT) v) { memcpy(p, &v, sizeof v); }
#ifdef BN_BF16
/* VW bfloat16 activations, widened, and stored as aset. The load skips aget's quieting of a signalling
   NaN: every use of a loaded value (arithmetic, a > 0 test, a masked copy stored through astore, which
   sets the quiet bit itself) gives the same bits for a signalling NaN as for its quiet twin. */
typedef uint16_t FN(vH) __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) FN(vT) FN(aload)(const AT *p) {
  FN(vH) h;
  memcpy(&h, p, sizeof h);
  return (FN(vT))(__builtin_convertvector(h, FN(vU)) << 16);
}
static inline __attribute__((always_inline)) void FN(astore)(AT *p, FN(vT) v) {
  const FN(vU) x = (FN(vU))v;
  const FN(vU) nan = (FN(vU))((x & 0x7fffffffu) > 0x7f800000u);
  const FN(vU) r = (nan & ((x >> 16) | 0x40u)) | (~nan & ((x + (0x7fffu + ((x >> 16) & 1u))) >> 16));
  const FN(vH) h = __builtin_convertvector(r, FN(vH));
  memcpy(p, &h, sizeof h);
}
#else
static inline __attribute__((always_inline)) FN(vT) FN(aload)(const AT *p) { return FN(vload)(p); }
static inline __attribute__((always_inline)) void FN(astore)(AT *p, FN(vT) v) { FN(vstore)(p, v); }
#endif
/* v where keep is all ones, else +0. */
static inline __attribute__((always_inline)) FN(vT) FN(vkeep)(FN(vT) v, FN(vU) keep) {
  return (FN(vT))((FN(vU))v & keep);
}
/* bwd_mask on VW channels: y + i their outputs, xm, a, b their vectors. */
static inline __attribute__((always_inline)) FN(vT) FN(vbwd_mask)(FN(vT) d, int mask, const AT *y, int64_t i, FN(vT) xm,
                                                                  FN(vT) a, FN(vT) b) {
  const FN(vT) zero = {0};
  if (mask == BN_MASK_Y) return FN(vkeep)(d, (FN(vU))(FN(aload)(y + i) > zero));
  if (mask == BN_MASK_X) return FN(vkeep)(d, (FN(vU))(xm * a + b > zero));
  return d;
}

/* Double-precision accumulators are native 8-lane vectors, a float chunk's two halves each in
   its own: a 16-double generic vector has no machine mode, so GCC keeps it on the stack and
   every add goes through a store and a reload. */
typedef double FN(vN) __attribute__((vector_size(64)));
#define NH (VW / 8)
static inline __attribute__((always_inline)) FN(vN) FN(lo8)(FN(vT) v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), FN(vN));
}
/* (for double, NH is 1 and this is never called) */
static inline __attribute__((always_inline)) FN(vN) FN(hi8)(FN(vT) v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), FN(vN));
}
/* a += v in double: a##l takes lanes 0-7, a##h lanes 8-15 (float only). */
#define BN_ACC(a, v)                  \
  do {                                \
    const FN(vT) v_ = (v);            \
    a##l += FN(lo8)(v_);              \
    if (NH == 2) a##h += FN(hi8)(v_); \
  } while (0)

/* The grouped sums of stats_rows and reduce_rows_k: rows go in groups of G, and each
   VW-channel chunk of a group is summed in registers, in two chains that hide the add latency,
   onto the running totals in bs/bq. TERM(row, s, q) adds one row's chunk at channel c into
   s##l/s##h and q##l/q##h; CHUNK_SETUP declares what TERM needs per chunk. */
#define BN_GROUPED_SUMS(CHUNK_SETUP, TERM)                                                    \
  for (int64_t g0 = 0; g0 < n; g0 += G) {                                                     \
    const int64_t g1 = g0 + G < n ? g0 + G : n;                                               \
    for (int64_t c = 0; c < cv; c += VW) {                                                    \
      CHUNK_SETUP;                                                                            \
      FN(vN) s0l, s0h = {0}, q0l, q0h = {0}, s1l = {0}, s1h = {0}, q1l = {0}, q1h = {0};      \
      memcpy(&s0l, bs + c, sizeof s0l);                                                       \
      memcpy(&q0l, bq + c, sizeof q0l);                                                       \
      if (NH == 2) {                                                                          \
        memcpy(&s0h, bs + c + 8, sizeof s0h);                                                 \
        memcpy(&q0h, bq + c + 8, sizeof q0h);                                                 \
      }                                                                                       \
      int64_t r = g0;                                                                         \
      for (; r + 2 <= g1; r += 2) {                                                           \
        TERM(r, s0, q0);                                                                      \
        TERM(r + 1, s1, q1);                                                                  \
      }                                                                                       \
      if (r < g1) TERM(r, s0, q0);                                                            \
      s0l += s1l;                                                                             \
      q0l += q1l;                                                                             \
      memcpy(bs + c, &s0l, sizeof s0l);                                                       \
      memcpy(bq + c, &q0l, sizeof q0l);                                                       \
      if (NH == 2) {                                                                          \
        s0h += s1h;                                                                           \
        q0h += q1h;                                                                           \
        memcpy(bs + c + 8, &s0h, sizeof s0h);                                                 \
        memcpy(bq + c + 8, &q0h, sizeof q0h);                                                 \
      }                                                                                       \
    }                                                                                         \
  }

/* Sums of (x - shift) and its square per channel over n rows, in double. Groups of about 8 KiB
   of rows keep the chunks of a wide row re-reading L1 rather than memory. */
#define BN_GROUP(C) ((C) >= 1024 ? 2 : 2048 / (C) + 1)
static DLUA_CPU_CLONES void FN(stats_rows)(int64_t C, int64_t n, const AT *x, const double *shift, double *bs,
                                           double *bq) {
  const int64_t cv = C - C % VW, G = BN_GROUP(C);
  for (int64_t c = 0; c < C; c++) bs[c] = bq[c] = 0;
#define BN_STATS_SETUP               \
  FN(vN) kl, kh = {0};               \
  memcpy(&kl, shift + c, sizeof kl); \
  if (NH == 2) memcpy(&kh, shift + c + 8, sizeof kh)
#define BN_TERM(row, s, q)                         \
  do {                                             \
    const FN(vT) v = FN(aload)(x + (row) * C + c); \
    const FN(vN) dl = FN(lo8)(v) - kl;             \
    s##l += dl;                                    \
    q##l += dl * dl;                               \
    if (NH == 2) {                                 \
      const FN(vN) dh = FN(hi8)(v) - kh;           \
      s##h += dh;                                  \
      q##h += dh * dh;                             \
    }                                              \
  } while (0)
  BN_GROUPED_SUMS(BN_STATS_SETUP, BN_TERM)
#undef BN_TERM
#undef BN_STATS_SETUP
  for (int64_t c = cv; c < C; c++) {
    double s = 0, q = 0;
    for (int64_t r = 0; r < n; r++) {
      double d = (double)FN(aget)(x, r * C + c) - shift[c];
      s += d;
      q += d * d;
    }
    bs[c] = s;
    bq[c] = q;
  }
}

/* y = act((x - m) * a + b (+ skip)) over n rows; y may be x. */
static inline __attribute__((always_inline)) void FN(apply_rows_k)(int64_t C, int64_t n, const AT *x, const AT *sk,
                                                                   AT *y, const T *m, const T *a, const T *b,
                                                                   int has_skip, int relu) {
  const FN(vT) zero = {0};
  const int64_t cv = C - C % VW;
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < cv; c += VW) {
      FN(vT) v = (FN(aload)(x + r * C + c) - FN(vload)(m + c)) * FN(vload)(a + c) + FN(vload)(b + c);
      if (has_skip) v += FN(aload)(sk + r * C + c);
      if (relu) v = FN(vkeep)(v, ~(FN(vU))(v < zero));
      FN(astore)(y + r * C + c, v);
    }
  for (int64_t c = cv; c < C; c++)
    for (int64_t r = 0; r < n; r++) {
      T v = (FN(aget)(x, r * C + c) - m[c]) * a[c] + b[c];
      if (has_skip) v += FN(aget)(sk, r * C + c);
      if (relu) v = v < 0 ? (T)0 : v;
      FN(aset)(y, r * C + c, v);
    }
}

static DLUA_CPU_CLONES void FN(apply_rows)(int64_t C, int64_t n, const AT *x, const AT *sk, AT *y, const T *m,
                                           const T *a, const T *b, int relu) {
#define BN_CALL(k, rl) FN(apply_rows_k)(C, n, x, sk, y, m, a, b, k, rl)
  BN_APPLY_DISPATCH(BN_CALL, sk, relu);
#undef BN_CALL
}

/* Sums of d and d * (x - m) per channel over n rows, in double; d = dy, masked as `mask` says
   (fa, fb: the forward's scale and shift for BN_MASK_X). Grouped like stats_rows. */
static inline __attribute__((always_inline)) void FN(reduce_rows_k)(int64_t C, int64_t n, const AT *x, const AT *dy,
                                                                    const AT *y, const T *m, const T *fa, const T *fb,
                                                                    double *bs, double *bq, int mask) {
  const int64_t cv = C - C % VW, G = BN_GROUP(C);
  const FN(vT) zero = {0};
  for (int64_t c = 0; c < C; c++) bs[c] = bq[c] = 0;
#define BN_REDUCE_SETUP                                             \
  const FN(vT) vm = FN(vload)(m + c);                               \
  const FN(vT) va = mask == BN_MASK_X ? FN(vload)(fa + c) : zero;   \
  const FN(vT) vb = mask == BN_MASK_X ? FN(vload)(fb + c) : zero
#define BN_TERM(row, s, q)                                                           \
  do {                                                                               \
    const int64_t i_ = (row) * C + c;                                                \
    const FN(vT) xm = FN(aload)(x + i_) - vm;                                        \
    const FN(vT) d = FN(vbwd_mask)(FN(aload)(dy + i_), mask, y, i_, xm, va, vb);     \
    BN_ACC(s, d);                                                                    \
    BN_ACC(q, d * xm);                                                               \
  } while (0)
  BN_GROUPED_SUMS(BN_REDUCE_SETUP, BN_TERM)
#undef BN_TERM
#undef BN_REDUCE_SETUP
  for (int64_t c = cv; c < C; c++) {
    const T a = mask == BN_MASK_X ? fa[c] : 0, b = mask == BN_MASK_X ? fb[c] : 0;
    double s = 0, q = 0;
    for (int64_t r = 0; r < n; r++) {
      const T xm = FN(aget)(x, r * C + c) - m[c];
      const T d = FN(bwd_mask)(FN(aget)(dy, r * C + c), mask, y, r * C + c, xm, a, b);
      s += d;
      q += d * xm;
    }
    bs[c] = s;
    bq[c] = q;
  }
}

static DLUA_CPU_CLONES void FN(reduce_rows)(int64_t C, int64_t n, const AT *x, const AT *dy, const AT *y, const T *m,
                                            const T *fa, const T *fb, double *bs, double *bq) {
#define BN_CALL(mk) FN(reduce_rows_k)(C, n, x, dy, y, m, fa, fb, bs, bq, mk)
  BN_MASK_DISPATCH(BN_CALL, bn_mask_kind(y, fa));
#undef BN_CALL
}

/* dx = d * A + (x - m) * B + D and ds = d over n rows (d = dy, masked as `mask` says). */
static inline __attribute__((always_inline)) void FN(bwd_rows_k)(int64_t C, int64_t n, const AT *x, const AT *dy,
                                                                 const AT *y, AT *dx, AT *ds, const T *m, const T *fa,
                                                                 const T *fb, const T *A, const T *B, const T *D,
                                                                 int mask, int want_dx, int want_ds) {
  const FN(vT) zero = {0};
  const int64_t cv = C - C % VW;
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < cv; c += VW) {
      const FN(vT) xm = FN(aload)(x + r * C + c) - FN(vload)(m + c);
      const FN(vT) va = mask == BN_MASK_X ? FN(vload)(fa + c) : zero, vb = mask == BN_MASK_X ? FN(vload)(fb + c) : zero;
      const FN(vT) d = FN(vbwd_mask)(FN(aload)(dy + r * C + c), mask, y, r * C + c, xm, va, vb);
      FN(vT) v = d * FN(vload)(A + c) + xm * FN(vload)(B + c) + FN(vload)(D + c);
      if (want_ds) FN(astore)(ds + r * C + c, d);
      if (want_dx) FN(astore)(dx + r * C + c, v);
    }
  for (int64_t c = cv; c < C; c++) {
    const T a = mask == BN_MASK_X ? fa[c] : 0, b = mask == BN_MASK_X ? fb[c] : 0;
    for (int64_t r = 0; r < n; r++) {
      const T xm = FN(aget)(x, r * C + c) - m[c];
      const T d = FN(bwd_mask)(FN(aget)(dy, r * C + c), mask, y, r * C + c, xm, a, b);
      T v = d * A[c] + xm * B[c] + D[c];
      if (want_ds) FN(aset)(ds, r * C + c, d);
      if (want_dx) FN(aset)(dx, r * C + c, v);
    }
  }
}

static DLUA_CPU_CLONES void FN(bwd_rows)(int64_t C, int64_t n, const AT *x, const AT *dy, const AT *y, AT *dx, AT *ds,
                                         const T *m, const T *fa, const T *fb, const T *A, const T *B, const T *D) {
#define BN_CALL(mk, wx, ws) FN(bwd_rows_k)(C, n, x, dy, y, dx, ds, m, fa, fb, A, B, D, mk, wx, ws)
  BN_BWD_DISPATCH(BN_CALL, bn_mask_kind(y, fa), dx, ds);
#undef BN_CALL
}

#ifndef BN_ROWS_ONLY /* (the bfloat16 instantiation has the channels-last blocks only) */
/* ---- statistics ---------------------------------------------------------------------------------- */

/* Per-channel sums of (x - shift) and (x - shift)^2 in double. Shifting by a sample of the
   channel keeps the one-pass variance accurate when |mean| >> std. Partial sums are taken per
   (n, c) plane (planar) or per fixed block of rows (channels-last) and added in a fixed order,
   so the result does not depend on the thread count. */
/* Sums of (x - k) and its square over a run of one channel, in double. */
static inline __attribute__((always_inline)) void FN(stats_run)(int64_t n, const T *x, double k, double *s_out,
                                                                double *q_out) {
  double s = 0, q = 0;
#pragma omp simd reduction(+ : s, q)
  for (int64_t i = 0; i < n; i++) {
    double d = (double)x[i] - k;
    s += d;
    q += d * d;
  }
  *s_out = s;
  *q_out = q;
}

/* A unit of work's activations (an (n, c) plane, or a block of rows): the tensor's own, or (h: 16-bit, the float
   instantiation) widened into buffer `slot` of the calling thread's k buffers of h->wl floats. Widening is exact
   and the units and their order are the float kernel's, so 16-bit results are the bits of staging the whole
   tensor in float32 and casting back. */
static inline T *FN(unit_buf)(const bn_half_t *h, int k, int slot) {
#ifdef BN_HALF
  if (h) return h->work + ((int64_t)omp_get_thread_num() * k + slot) * h->wl;
#endif
  (void)h, (void)k, (void)slot;
  return NULL;
}
static inline const T *FN(unit_in)(const void *src, int64_t off, int64_t n, const bn_half_t *h, int k, int slot) {
#ifdef BN_HALF
  if (h) {
    T *w = FN(unit_buf)(h, k, slot);
    dlua_convert_half_to_f32(w, (const uint16_t *)src + off, n, h->bf);
    return w;
  }
#endif
  (void)n, (void)k, (void)slot;
  return (const T *)src + off;
}
/* Where a unit's output goes: the tensor itself, or buffer `slot`, rounded into the tensor by unit_out. */
static inline T *FN(unit_dst)(void *dst, int64_t off, const bn_half_t *h, int k, int slot) {
  return h ? FN(unit_buf)(h, k, slot) : (T *)dst + off;
}
static inline void FN(unit_out)(void *dst, int64_t off, const T *buf, int64_t n, const bn_half_t *h) {
#ifdef BN_HALF
  if (h) dlua_convert_f32_to_half((uint16_t *)dst + off, buf, n, 1.0f, h->bf);  // nearest even: copy_'s rounding
#endif
  (void)dst, (void)off, (void)buf, (void)n, (void)h;
}
/* (bfloat16 blocks of rows skip the buffers: the _bf16 block functions, the same code loading and storing
   bfloat16, read and write the activations directly, interleaved with the arithmetic.) */

/* x: T, or 16-bit when h (work: 1 buffer per thread). */
static void FN(bn_stats)(const bn_geom_t *g, const void *x, const bn_half_t *h, const double *shift, double *scratch,
                         double *sum, double *sumsq) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
    double *ps = scratch, *pq = scratch + P;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const T *xp = FN(unit_in)(x, p * S, S, h, 1, 0);
      FN(stats_run)(S, xp, shift[p % C], &ps[p], &pq[p]);
    }
    bn_combine(ps, pq, g->N, C, sum, sumsq);
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
  double *ps = scratch, *pq = scratch + nb * C;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M, o = b * R * C;
#ifdef BN_HALF
    if (h && h->bf) {
      stats_rows_bf16(C, r1 - b * R, (const uint16_t *)x + o, shift, ps + b * C, pq + b * C);
      continue;
    }
#endif
    FN(stats_rows)(C, r1 - b * R, FN(unit_in)(x, o, (r1 - b * R) * C, h, 1, 0), shift, ps + b * C, pq + b * C);
  }
  bn_combine(ps, pq, nb, C, sum, sumsq);
}

/* ---- normalise ------------------------------------------------------------------------------------ */

/* One run of n values of one channel: y = act((x - m) * a + b (+ s)). */
static inline __attribute__((always_inline)) void FN(apply_run)(int64_t n, const T *x, const T *s, T *y, T m, T a, T b,
                                                                int has_skip, int relu) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    T v = (x[i] - m) * a + b;
    if (has_skip) v += s[i];
    if (relu) v = v < 0 ? (T)0 : v;
    y[i] = v;
  }
}

/* y = act((x - mean) * a + beta + skip): a = gamma * invstd; skip may be NULL. y may be x. */
/* x, skip, y: T, or 16-bit when h (work: 2 buffers per thread; y may be x). */
static void FN(bn_apply)(const bn_geom_t *g, const void *x, const void *skip, void *y, const bn_half_t *h,
                         const T *mean, const T *a, const T *beta, int relu) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const int64_t c = p % C;
      const T *xp = FN(unit_in)(x, p * S, S, h, 2, 0), *sp = skip ? FN(unit_in)(skip, p * S, S, h, 2, 1) : NULL;
      T *yp = FN(unit_dst)(y, p * S, h, 2, 0);  // 16-bit: over x's buffer
#define BN_CALL(k, r) FN(apply_run)(S, xp, sp, yp, mean[c], a[c], beta[c], k, r)
      BN_APPLY_DISPATCH(BN_CALL, sp, relu);
#undef BN_CALL
      FN(unit_out)(y, p * S, yp, S, h);
    }
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M, o = b * R * C, n = (r1 - b * R) * C;
#ifdef BN_HALF
    if (h && h->bf) {
      apply_rows_bf16(C, r1 - b * R, (const uint16_t *)x + o, skip ? (const uint16_t *)skip + o : NULL,
                      (uint16_t *)y + o, mean, a, beta, relu);
      continue;
    }
#endif
    const T *xp = FN(unit_in)(x, o, n, h, 2, 0), *sp = skip ? FN(unit_in)(skip, o, n, h, 2, 1) : NULL;
    T *yp = FN(unit_dst)(y, o, h, 2, 0);
    FN(apply_rows)(C, r1 - b * R, xp, sp, yp, mean, a, beta, relu);
    FN(unit_out)(y, o, yp, n, h);
  }
}

/* ---- backward ------------------------------------------------------------------------------------- */

/* Sums of d and d * (x - m) over a run of one channel, d = dy masked as `mask` says (fa, fb: the
   forward's scale and shift of this channel). */
static inline __attribute__((always_inline)) void FN(reduce_run)(int64_t n, const T *x, const T *dy, const T *y, T m,
                                                                 T fa, T fb, double *s_out, double *q_out, int mask) {
  double s = 0, q = 0;
#pragma omp simd reduction(+ : s, q)
  for (int64_t i = 0; i < n; i++) {
    const T xm = x[i] - m;
    const T d = FN(bwd_mask)(dy[i], mask, y, i, xm, fa, fb);
    // The product in T, the sums in double: GCC keeps a float select feeding double
    // arithmetic scalar (it may trap), and one rounding per term is harmless here.
    s += d;
    q += d * xm;
  }
  *s_out = s;
  *q_out = q;
}

/* Per-channel sum(d) and sum(d * (x - mean)) in double, d = dy masked by y > 0 when y, else by
   the forward's (x - mean) * fa + fb > 0 when fa; blocked like bn_stats. x, dy, y: T, or 16-bit when h (work: 3
   buffers per thread). */
static void FN(bn_bwd_reduce)(const bn_geom_t *g, const void *x, const void *dy, const void *y, const bn_half_t *h,
                              const T *mean, const T *fa, const T *fb, double *scratch, double *sdy, double *sdx) {
  const int64_t C = g->C, S = g->S;
  if (!g->rows) {
    const int64_t P = g->N * C;
    double *ps = scratch, *pq = scratch + P;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const int64_t c = p % C;
      const T *xp = FN(unit_in)(x, p * S, S, h, 3, 0), *dp = FN(unit_in)(dy, p * S, S, h, 3, 1);
      const T *yp = y ? FN(unit_in)(y, p * S, S, h, 3, 2) : NULL;
      const T a = fa ? fa[c] : 0, b = fa ? fb[c] : 0;
#define BN_CALL(mk) FN(reduce_run)(S, xp, dp, yp, mean[c], a, b, &ps[p], &pq[p], mk)
      BN_MASK_DISPATCH(BN_CALL, bn_mask_kind(y, fa));
#undef BN_CALL
    }
    bn_combine(ps, pq, g->N, C, sdy, sdx);
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
  double *ps = scratch, *pq = scratch + nb * C;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M, o = b * R * C, n = (r1 - b * R) * C;
#ifdef BN_HALF
    if (h && h->bf) {
      reduce_rows_bf16(C, r1 - b * R, (const uint16_t *)x + o, (const uint16_t *)dy + o,
                       y ? (const uint16_t *)y + o : NULL, mean, fa, fb, ps + b * C, pq + b * C);
      continue;
    }
#endif
    const T *xp = FN(unit_in)(x, o, n, h, 3, 0), *dp = FN(unit_in)(dy, o, n, h, 3, 1);
    const T *yp = y ? FN(unit_in)(y, o, n, h, 3, 2) : NULL;
    FN(reduce_rows)(C, r1 - b * R, xp, dp, yp, mean, fa, fb, ps + b * C, pq + b * C);
  }
  bn_combine(ps, pq, nb, C, sdy, sdx);
}

/* dx = d * A + (x - m) * B + D and ds = d over a run of one channel (d = masked dy). Each
   element is read before either output is written, so dx or ds may be dy itself. */
static inline __attribute__((always_inline)) void FN(bwd_run)(int64_t n, const T *x, const T *dy, const T *y, T *dx,
                                                              T *ds, T m, T fa, T fb, T A, T B, T D, int mask,
                                                              int want_dx, int want_ds) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const T xm = x[i] - m;
    const T d = FN(bwd_mask)(dy[i], mask, y, i, xm, fa, fb);
    T v = d * A + xm * B + D;
    if (want_ds) ds[i] = d;
    if (want_dx) dx[i] = v;
  }
}

/* dx = d * A + (x - mean) * B + D and dskip = d, d = dy masked as bn_bwd_reduce's; one of dx,
   dskip may be NULL. x, dy, y, dx, dskip: T, or 16-bit when h (work: 5 buffers per thread; dx or dskip may be dy). */
static void FN(bn_bwd_apply)(const bn_geom_t *g, const void *x, const void *dy, const void *y, void *dx, void *dskip,
                             const bn_half_t *h, const T *mean, const T *fa, const T *fb, const T *A, const T *B,
                             const T *D) {
  const int64_t C = g->C, S = g->S;
  const int mask = bn_mask_kind(y, fa);
  if (!g->rows) {
    const int64_t P = g->N * C;
#pragma omp parallel for schedule(static) if (P * S > BN_PAR_MIN)
    for (int64_t p = 0; p < P; p++) {
      const int64_t c = p % C;
      const T *xp = FN(unit_in)(x, p * S, S, h, 5, 0), *dp = FN(unit_in)(dy, p * S, S, h, 5, 1);
      const T *yp = y ? FN(unit_in)(y, p * S, S, h, 5, 2) : NULL;
      T *gp = dx ? FN(unit_dst)(dx, p * S, h, 5, 3) : NULL, *sp = dskip ? FN(unit_dst)(dskip, p * S, h, 5, 4) : NULL;
      const T a = fa ? fa[c] : 0, b = fa ? fb[c] : 0;
#define BN_CALL(mk, wx, ws) FN(bwd_run)(S, xp, dp, yp, gp, sp, mean[c], a, b, A[c], B[c], D[c], mk, wx, ws)
      BN_BWD_DISPATCH(BN_CALL, mask, gp, sp);
#undef BN_CALL
      if (gp) FN(unit_out)(dx, p * S, gp, S, h);
      if (sp) FN(unit_out)(dskip, p * S, sp, S, h);
    }
    return;
  }
  const int64_t M = g->N * S, R = g->block_rows, nb = (M + R - 1) / R;
#pragma omp parallel for schedule(static) if (M * C > BN_PAR_MIN)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t r1 = b * R + R < M ? b * R + R : M, o = b * R * C, n = (r1 - b * R) * C;
#ifdef BN_HALF
    if (h && h->bf) {
      bwd_rows_bf16(C, r1 - b * R, (const uint16_t *)x + o, (const uint16_t *)dy + o, y ? (const uint16_t *)y + o : NULL,
                    dx ? (uint16_t *)dx + o : NULL, dskip ? (uint16_t *)dskip + o : NULL, mean, fa, fb, A, B, D);
      continue;
    }
#endif
    const T *xp = FN(unit_in)(x, o, n, h, 5, 0), *dp = FN(unit_in)(dy, o, n, h, 5, 1);
    const T *yp = y ? FN(unit_in)(y, o, n, h, 5, 2) : NULL;
    T *gp = dx ? FN(unit_dst)(dx, o, h, 5, 3) : NULL, *sp = dskip ? FN(unit_dst)(dskip, o, h, 5, 4) : NULL;
    FN(bwd_rows)(C, r1 - b * R, xp, dp, yp, gp, sp, mean, fa, fb, A, B, D);
    if (gp) FN(unit_out)(dx, o, gp, n, h);
    if (sp) FN(unit_out)(dskip, o, sp, n, h);
  }
}

#endif /* BN_ROWS_ONLY */

#undef BN_APPLY_DISPATCH
#undef BN_BWD_DISPATCH
#undef BN_BWD_WANTS
#undef BN_MASK_DISPATCH
#undef VW
#undef BN_GROUP
#undef BN_GROUPED_SUMS
#undef BN_ACC
#undef NH

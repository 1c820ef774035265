/* oneDNN convolution microbenchmark for ResNet-20's shapes: float32 vs bfloat16, forward, backward
   data and backward weights, over the memory formats, algorithms and weight-gradient dtypes oneDNN
   2.6 offers, plus an explicit im2col + dnnl_gemm_bf16bf16f32 forward for comparison (issue #20).

     cc -O2 -o /tmp/dnnl_conv bench/dnnl_conv.c -ldnnl -lm
     OMP_NUM_THREADS=1 /tmp/dnnl_conv [reps=10] [batch=128]
     ONEDNN_MAX_CPU_ISA=AVX512_CORE OMP_NUM_THREADS=1 /tmp/dnnl_conv     # cap the ISA
     FLUSH=1 OMP_NUM_THREADS=1 /tmp/dnnl_conv 10 128 "nhwc/any direct"  # cold caches, one config
     ALL_IMPLS=1 OMP_NUM_THREADS=2 /tmp/dnnl_conv 10 128 "nhwc/any direct"  # every non-reference impl

   Prints one line per (shape, direction, dtype, config): the minimum time of `reps` runs of the
   primitive alone, the reorders the caller's NHWC tensors would need to reach the primitive's
   layout (timed separately, 0 when none), and oneDNN's implementation name. */
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Exported by oneDNN 2.6 but not declared in its public header (as host/cpu/linalg.c does). */
extern dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                           float alpha, const uint16_t *A, dnnl_dim_t lda, const uint16_t *B,
                                           dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);

static dnnl_engine_t eng;
static dnnl_stream_t strm;
static int reps = 10;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

#define CK(x)                                                                \
  do {                                                                       \
    dnnl_status_t st_ = (x);                                                 \
    if (st_ != dnnl_success) {                                               \
      fprintf(stderr, "%s:%d: %s -> status %d\n", __FILE__, __LINE__, #x, st_); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

typedef struct {
  int c, o, hw, s;
} shape_t;

typedef enum { FWD, BWD_D, BWD_W } dir_t;
static const char *dir_name[] = {"fwd", "bwd_data", "bwd_weights"};

/* A configuration: activation tag (dnnl_format_tag_any allowed), weights tag, algorithm and the
   weight-gradient dtype (bf16 runs only). */
typedef struct {
  const char *name;
  dnnl_format_tag_t act, wei;
  dnnl_alg_kind_t alg;
  int dw_f32;
} cfg_t;

static void *fill(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes ? bytes : 64)) exit(1);
  // Small values, valid in f32 and bf16 (0x3c00 pattern is a bf16 ~0.0078; as f32 a tiny number).
  uint16_t *q = p;
  for (size_t i = 0; i < bytes / 2; i++) q[i] = 0x3c00 + (uint16_t)(i % 97);
  return p;
}

static dnnl_memory_t mem(const dnnl_memory_desc_t *md) {
  dnnl_memory_t m;
  void *p = fill(dnnl_memory_desc_get_size(md));
  CK(dnnl_memory_create(&m, md, eng, p));
  return m;
}

static void mem_free(dnnl_memory_t m) {
  void *p = NULL;
  dnnl_memory_get_data_handle(m, &p);
  dnnl_memory_destroy(m);
  free(p);
}

/* FLUSH=1: write 64 MB before each timed run, so operands start outside the caches as in a
   training step (which touches every layer's activations between two uses of one). */
static void flush_caches(void) {
  static char *junk;
  static int on = -1;
  if (on < 0) on = getenv("FLUSH") && atoi(getenv("FLUSH"));
  if (!on) return;
  if (!junk) junk = malloc(64 << 20);
  memset(junk, on++, 64 << 20);
}

static double time_prim(dnnl_primitive_t p, int n, dnnl_exec_arg_t *a) {
  double best = 1e30;
  for (int r = 0; r < reps + 1; r++) {
    flush_caches();
    double t0 = now_ms();
    CK(dnnl_primitive_execute(p, strm, n, a));
    CK(dnnl_stream_wait(strm));
    double t = now_ms() - t0;
    if (r > 0 && t < best) best = t;  // first run warms up
  }
  return best;
}

/* Time of reordering between the NHWC (or oihw-as-stored hwio: dlua keeps weights OHWI for NHWC)
   user layout and the primitive's, 0 when equal. */
static double reorder_ms(const dnnl_memory_desc_t *user, const dnnl_memory_desc_t *inner, int to_inner) {
  if (dnnl_memory_desc_equal(user, inner)) return 0;
  dnnl_primitive_desc_t rpd;
  const dnnl_memory_desc_t *from = to_inner ? user : inner, *to = to_inner ? inner : user;
  if (dnnl_reorder_primitive_desc_create(&rpd, from, eng, to, eng, NULL) != dnnl_success) return NAN;
  dnnl_primitive_t r;
  CK(dnnl_primitive_create(&r, rpd));
  dnnl_memory_t a = mem(from), b = mem(to);
  dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}};
  double t = time_prim(r, 2, args);
  dnnl_primitive_destroy(r);
  dnnl_primitive_desc_destroy(rpd);
  mem_free(a);
  mem_free(b);
  return t;
}

static void time_pd(const_dnnl_primitive_desc_t pd, int n, const shape_t *sh, dir_t dir, const char *dtn,
                    const cfg_t *cf, const dnnl_memory_desc_t *x_u, const dnnl_memory_desc_t *y_u);

static void run_one(int n, const shape_t *sh, dir_t dir, dnnl_data_type_t dt, const cfg_t *cf) {
  int oh = sh->hw / sh->s;
  dnnl_dims_t xd = {n, sh->c, sh->hw, sh->hw}, yd = {n, sh->o, oh, oh}, wd = {sh->o, sh->c, 3, 3};
  dnnl_dims_t strides = {sh->s, sh->s}, pad = {1, 1};
  dnnl_data_type_t wdt = dt == dnnl_bf16 && dir == BWD_W && cf->dw_f32 ? dnnl_f32 : dt;
  dnnl_memory_desc_t x, y, w, wf, x_u, y_u;
  CK(dnnl_memory_desc_init_by_tag(&x, 4, xd, dt, cf->act));
  CK(dnnl_memory_desc_init_by_tag(&y, 4, yd, dt, cf->act));
  CK(dnnl_memory_desc_init_by_tag(&w, 4, wd, wdt, cf->wei));
  CK(dnnl_memory_desc_init_by_tag(&wf, 4, wd, dt, cf->wei));
  CK(dnnl_memory_desc_init_by_tag(&x_u, 4, xd, dt, dnnl_nhwc));
  CK(dnnl_memory_desc_init_by_tag(&y_u, 4, yd, dt, dnnl_nhwc));
  dnnl_convolution_desc_t fd, bd;
  dnnl_primitive_desc_t fpd = NULL, pd = NULL;
  const char *dtn = dt == dnnl_bf16 ? (dir == BWD_W ? (cf->dw_f32 ? "bf16/dwf32" : "bf16/dwbf16") : "bf16") : "f32";
  CK(dnnl_convolution_forward_desc_init(&fd, dnnl_forward_training, cf->alg, &x, &wf, NULL, &y, strides, pad, pad));
  if (dnnl_primitive_desc_create(&fpd, &fd, NULL, eng, NULL) != dnnl_success) {
    printf("%-3d->%-3d %2dx%-2d s%d  %-11s %-11s %-22s unsupported (forward hint)\n", sh->c, sh->o, sh->hw, sh->hw,
           sh->s, dir_name[dir], dtn, cf->name);
    return;
  }
  // ALL_IMPLS=1: every implementation oneDNN offers for the descriptor, in its order of
  // preference (reference ones skipped), not only the first.
  int all = getenv("ALL_IMPLS") && atoi(getenv("ALL_IMPLS"));
  const_dnnl_op_desc_t od = &fd;
  if (dir == BWD_D) {
    CK(dnnl_convolution_backward_data_desc_init(&bd, cf->alg, &x, &w, &y, strides, pad, pad));
    od = &bd;
  } else if (dir == BWD_W) {
    CK(dnnl_convolution_backward_weights_desc_init(&bd, cf->alg, &x, &w, NULL, &y, strides, pad, pad));
    od = &bd;
  }
  dnnl_primitive_desc_iterator_t it = NULL;
  if (dnnl_primitive_desc_iterator_create(&it, od, NULL, eng, dir == FWD ? NULL : fpd) != dnnl_success) {
    printf("%-3d->%-3d %2dx%-2d s%d  %-11s %-11s %-22s unsupported\n", sh->c, sh->o, sh->hw, sh->hw, sh->s,
           dir_name[dir], dtn, cf->name);
    dnnl_primitive_desc_destroy(fpd);
    return;
  }
  for (int first = 1;; first = 0) {
    if (!first && (!all || dnnl_primitive_desc_iterator_next(it) != dnnl_success)) break;
    pd = dnnl_primitive_desc_iterator_fetch(it);
    const char *nm = "?";
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &nm);
    if (!first && strncmp(nm, "ref", 3) == 0) {
      dnnl_primitive_desc_destroy(pd);
      continue;
    }
    time_pd(pd, n, sh, dir, dtn, cf, &x_u, &y_u);
    dnnl_primitive_desc_destroy(pd);
  }
  dnnl_primitive_desc_iterator_destroy(it);
  dnnl_primitive_desc_destroy(fpd);
}

/* Times one primitive descriptor's primitive and prints its line. */
static void time_pd(const_dnnl_primitive_desc_t pd, int n, const shape_t *sh, dir_t dir, const char *dtn,
                    const cfg_t *cf, const dnnl_memory_desc_t *x_u, const dnnl_memory_desc_t *y_u) {
  int oh = sh->hw / sh->s;
  const char *impl = "?";
  dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
  dnnl_query_t qa, qb, qc;
  int ia, ib, ic;
  if (dir == FWD) {
    qa = dnnl_query_src_md, ia = DNNL_ARG_SRC;
    qb = dnnl_query_weights_md, ib = DNNL_ARG_WEIGHTS;
    qc = dnnl_query_dst_md, ic = DNNL_ARG_DST;
  } else if (dir == BWD_D) {
    qa = dnnl_query_diff_dst_md, ia = DNNL_ARG_DIFF_DST;
    qb = dnnl_query_weights_md, ib = DNNL_ARG_WEIGHTS;
    qc = dnnl_query_diff_src_md, ic = DNNL_ARG_DIFF_SRC;
  } else {
    qa = dnnl_query_src_md, ia = DNNL_ARG_SRC;
    qb = dnnl_query_diff_dst_md, ib = DNNL_ARG_DIFF_DST;
    qc = dnnl_query_diff_weights_md, ic = DNNL_ARG_DIFF_WEIGHTS;
  }
  const dnnl_memory_desc_t *ma = dnnl_primitive_desc_query_md(pd, qa, 0), *mb = dnnl_primitive_desc_query_md(pd, qb, 0),
                           *mc = dnnl_primitive_desc_query_md(pd, qc, 0);
  const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  dnnl_primitive_t p;
  CK(dnnl_primitive_create(&p, pd));
  dnnl_memory_t a = mem(ma), b = mem(mb), c = mem(mc), s = sp ? mem(sp) : NULL;
  dnnl_exec_arg_t args[4] = {{ia, a}, {ib, b}, {ic, c}, {DNNL_ARG_SCRATCHPAD, s}};
  double t = time_prim(p, s ? 4 : 3, args);
  // Activation reorders a caller with NHWC tensors would pay (weights excluded: microseconds).
  double ro = 0;
  if (dir == FWD) ro = reorder_ms(x_u, ma, 1) + reorder_ms(y_u, mc, 0);
  else if (dir == BWD_D) ro = reorder_ms(y_u, ma, 1) + reorder_ms(x_u, mc, 0);
  else ro = reorder_ms(x_u, ma, 1) + reorder_ms(y_u, mb, 1);
  double gmac = (double)n * oh * oh * sh->o * sh->c * 9 / (t * 1e6);
  printf("%-3d->%-3d %2dx%-2d s%d  %-11s %-11s %-22s %7.3f ms  +reorder %6.3f  %5.1f GMAC/s  %s\n", sh->c, sh->o,
         sh->hw, sh->hw, sh->s, dir_name[dir], dtn, cf->name, t, ro, gmac, impl);
  fflush(stdout);
  dnnl_primitive_destroy(p);
  mem_free(a);
  mem_free(b);
  mem_free(c);
  if (s) mem_free(s);
}

/* Forward as im2col (NHWC, bf16) + dnnl_gemm_bf16bf16f32 (M = N*OH*OW, K = 9*C, N = O) + the f32
   result rounded to bf16; and the same with sgemm for float32. */
static uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static void im2col_fwd(int n, const shape_t *sh, int bf) {
  int oh = sh->hw / sh->s, C = sh->c, H = sh->hw;
  int64_t M = (int64_t)n * oh * oh, K = 9 * C, O = sh->o;
  size_t es = bf ? 2 : 4;
  char *x = fill((size_t)n * H * H * C * es), *col = fill(M * K * es), *w = fill(K * O * es);
  float *y = fill(M * O * 4);
  uint16_t *yb = fill(M * O * 2);
  double best = 1e30, bgemm = 1e30;
  for (int r = 0; r < reps + 1; r++) {
    double t0 = now_ms();
    for (int b = 0; b < n; b++)
      for (int i = 0; i < oh; i++)
        for (int j = 0; j < oh; j++) {
          char *dst = col + (((int64_t)b * oh + i) * oh + j) * K * es;
          for (int ki = 0; ki < 3; ki++) {
            int yy = i * sh->s - 1 + ki;
            for (int kj = 0; kj < 3; kj++) {
              int xx = j * sh->s - 1 + kj;
              char *d = dst + (ki * 3 + kj) * C * es;
              if (yy < 0 || yy >= H || xx < 0 || xx >= H) memset(d, 0, C * es);
              else memcpy(d, x + (((int64_t)b * H + yy) * H + xx) * C * es, C * es);
            }
          }
        }
    double t1 = now_ms();
    if (bf) CK(dnnl_gemm_bf16bf16f32('N', 'N', M, O, K, 1.f, (const uint16_t *)col, K, (const uint16_t *)w, O, 0.f, y, O));
    else CK(dnnl_sgemm('N', 'N', M, O, K, 1.f, (float *)col, K, (float *)w, O, 0.f, y, O));
    double t2 = now_ms();
    if (bf)
      for (int64_t i = 0; i < M * O; i++) yb[i] = f2bf(y[i]);
    double t3 = now_ms();
    if (r > 0 && t3 - t0 < best) best = t3 - t0;
    if (r > 0 && t2 - t1 < bgemm) bgemm = t2 - t1;
  }
  double gmac = (double)M * O * K / (bgemm * 1e6);
  printf("%-3d->%-3d %2dx%-2d s%d  %-11s %-11s %-22s %7.3f ms  (gemm alone %6.3f, %5.1f GMAC/s)\n", sh->c, sh->o,
         sh->hw, sh->hw, sh->s, "fwd", bf ? "bf16" : "f32", "im2col+gemm", best, bgemm, gmac);
  free(x);
  free(col);
  free(w);
  free(y);
  free(yb);
}

int main(int argc, char **argv) {
  if (argc > 1) reps = atoi(argv[1]);
  int n = argc > 2 ? atoi(argv[2]) : 128;
  const char *only = argc > 3 ? argv[3] : NULL;  // substring of a config name
  CK(dnnl_engine_create(&eng, dnnl_cpu, 0));
  CK(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
  const dnnl_version_t *v = dnnl_version();
  printf("oneDNN %d.%d.%d, batch %d, min of %d, max ISA %s, caches %s\n", v->major, v->minor, v->patch, n, reps,
         getenv("ONEDNN_MAX_CPU_ISA") ? getenv("ONEDNN_MAX_CPU_ISA") : "(default)",
         getenv("FLUSH") && atoi(getenv("FLUSH")) ? "flushed before each run" : "warm");
  shape_t shapes[] = {{16, 16, 28, 1}, {16, 32, 28, 2}, {32, 32, 14, 1}, {32, 64, 14, 2}, {64, 64, 7, 1}};
  cfg_t cfgs[] = {
      {"nhwc/any direct", dnnl_nhwc, dnnl_format_tag_any, dnnl_convolution_direct, 1},
      {"nhwc/any direct dwbf16", dnnl_nhwc, dnnl_format_tag_any, dnnl_convolution_direct, 0},
      // (plain ohwi weights with nhwc activations fall to ref:any, seconds per call: left out)
      {"nhwc/any auto", dnnl_nhwc, dnnl_format_tag_any, dnnl_convolution_auto, 1},
      {"16c/any direct", dnnl_aBcd16b, dnnl_format_tag_any, dnnl_convolution_direct, 1},
      {"16c/any direct dwbf16", dnnl_aBcd16b, dnnl_format_tag_any, dnnl_convolution_direct, 0},
      {"any/any direct", dnnl_format_tag_any, dnnl_format_tag_any, dnnl_convolution_direct, 1},
      {"any/any direct dwbf16", dnnl_format_tag_any, dnnl_format_tag_any, dnnl_convolution_direct, 0},
  };
  int ncfg = sizeof cfgs / sizeof cfgs[0];
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    for (int d = 0; d < 3; d++)
      for (int ci = 0; ci < ncfg; ci++) {
        if (only && !strstr(cfgs[ci].name, only)) continue;
        for (int bf = 0; bf < 2; bf++) {
          // dwbf16 variants differ from their dwf32 twin only for bf16 weight gradients.
          if (!cfgs[ci].dw_f32 && (!bf || d != BWD_W)) continue;
          run_one(n, &shapes[si], (dir_t)d, bf ? dnnl_bf16 : dnnl_f32, &cfgs[ci]);
        }
      }
    if (!only || strstr("im2col", only))
      for (int bf = 0; bf < 2; bf++) im2col_fwd(n, &shapes[si], bf);
  }
  dnnl_stream_destroy(strm);
  dnnl_engine_destroy(eng);
  return 0;
}

/* 2-D convolution on the CPU, the oneDNN side: the engine, a stream and workspace per thread, and the
   primitive cache (keyed by geometry, formats, direction, thread count and precision), split from conv.c. */
#include <inttypes.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/api.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/act_layout.h"
#include "cpu/conv.h"
#include "cpu/conv_impl.h"

/* ---- oneDNN: engine, per-thread stream and workspace ----------------------------------------- */

static pthread_once_t dnnl_once = PTHREAD_ONCE_INIT;
static dnnl_engine_t dnnl_eng;
static dnnl_status_t dnnl_eng_status;
static pthread_key_t tls_key;

/* Per thread: a stream (oneDNN streams are not meant to be shared across threads) and a
   workspace that outlives calls, so the scratchpad and reorder buffers are not faulted in
   afresh on every convolution. */
typedef struct {
  dnnl_stream_t stream;
  void *ws;
  size_t ws_cap;
} conv_tls_t;

/* Workspaces above this are released after each call: NCHW reorders of big activations
   would otherwise pin hundreds of megabytes between steps. */
enum { WS_KEEP_BYTES = 64 << 20 };

static void tls_free(void *p) {
  conv_tls_t *t = p;
  if (t->stream) dnnl_stream_destroy(t->stream);
  free(t->ws);
  free(t);
}

static void dnnl_init(void) {
  dnnl_eng_status = dnnl_engine_create(&dnnl_eng, dnnl_cpu, 0);
  if (pthread_key_create(&tls_key, tls_free) != 0 && dnnl_eng_status == dnnl_success)
    dnnl_eng_status = dnnl_out_of_memory;
}

static dlua_status_t get_tls(const char *op, conv_tls_t **out) {
  pthread_once(&dnnl_once, dnnl_init);
  if (dnnl_eng_status != dnnl_success)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN CPU engine creation failed (status %d)", op, (int)dnnl_eng_status);
  conv_tls_t *t = pthread_getspecific(tls_key);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, sizeof *t);
    dnnl_status_t st = dnnl_stream_create(&t->stream, dnnl_eng, dnnl_stream_default_flags);
    if (st != dnnl_success) {
      free(t);
      return DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN stream creation failed (status %d)", op, (int)st);
    }
    pthread_setspecific(tls_key, t);
  }
  *out = t;
  return DLUA_OK;
}

static dlua_status_t tls_workspace(const char *op, conv_tls_t *t, size_t bytes, char **ws) {
  if (bytes > t->ws_cap) {
    free(t->ws);
    t->ws = NULL;
    t->ws_cap = 0;
    size_t ask = (bytes + 4095) & ~(size_t)4095;
    if (posix_memalign(&t->ws, 4096, ask) != 0 || !t->ws) {
      t->ws = NULL;
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating a %zu-byte oneDNN workspace", op, ask);
    }
    t->ws_cap = ask;
  }
  *ws = t->ws;
  return DLUA_OK;
}

static void tls_trim(conv_tls_t *t) {
  if (t->ws_cap > WS_KEEP_BYTES) {
    free(t->ws);
    t->ws = NULL;
    t->ws_cap = 0;
  }
}

/* ---- oneDNN: primitive cache ------------------------------------------------------------------ */

/* One argument of the convolution: where the caller's memory is and how it is laid out, and the
   layout the primitive wants. Inputs reorder user -> inner before the convolution, outputs
   inner -> user after it (with a sum post-op when accumulating). */
typedef struct {
  int arg;
  int output;
  dnnl_memory_desc_t user, inner;
  dnnl_primitive_t reorder; /* NULL: the primitive works on the caller's memory directly */
  size_t off;               /* of the inner buffer in the workspace */
} conv_slot_t;

typedef struct conv_entry {
  conv_key_t key;
  uint64_t hash, last_use;
  int refs, evicted;
  dnnl_primitive_t conv;
  int nslots;
  conv_slot_t slot[4];
  size_t scratch_bytes, ws_bytes;
  char impl[64];
} conv_entry_t;

enum { CACHE_MAX = 4096 };
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static conv_entry_t *cache_tab[CACHE_MAX];
static int cache_n, cache_cap = 256;
static uint64_t cache_clock;
static int64_t cache_hits, cache_misses;

static uint64_t key_hash(const conv_key_t *k) {
  const unsigned char *p = (const unsigned char *)k;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void entry_destroy(conv_entry_t *e) {
  if (!e) return;
  if (e->conv) dnnl_primitive_destroy(e->conv);
  for (int i = 0; i < e->nslots; i++)
    if (e->slot[i].reorder) dnnl_primitive_destroy(e->slot[i].reorder);
  free(e);
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

#define DNNL_CHECK(call, what)                                                                               \
  do {                                                                                                       \
    dnnl_status_t st_ = (call);                                                                              \
    if (st_ != dnnl_success) {                                                                               \
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN %s failed (status %d) for input (%" PRId64 ", %" PRId64    \
                   ", %" PRId64 ", %" PRId64 ") and weight (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 \
                   ") with groups %" PRId64,                                                                 \
                   op, what, (int)st_, g->n, g->c, g->h, g->w, g->o, g->c / g->g, g->kh, g->kw, g->g);       \
      goto done;                                                                                             \
    }                                                                                                        \
  } while (0)

/* The weights' layout as oneDNN sees it: (G, O/G, C/G, kH, kW) when grouped. */
static dnnl_status_t weights_md(dnnl_memory_desc_t *md, const geom_t *g, int fmt, int any, dnnl_data_type_t dt) {
  int64_t ws4[4] = {g->o, g->c / g->g, g->kh, g->kw}, st[4];
  act_strides(4, ws4, fmt, st);
  if (g->g == 1) {
    dnnl_dims_t d = {ws4[0], ws4[1], ws4[2], ws4[3]}, s = {st[0], st[1], st[2], st[3]};
    return any ? dnnl_memory_desc_init_by_tag(md, 4, d, dt, dnnl_format_tag_any)
               : dnnl_memory_desc_init_by_strides(md, 4, d, dt, s);
  }
  int64_t og = g->o / g->g;
  dnnl_dims_t d = {g->g, og, ws4[1], ws4[2], ws4[3]}, s = {og * st[0], st[0], st[1], st[2], st[3]};
  return any ? dnnl_memory_desc_init_by_tag(md, 5, d, dt, dnnl_format_tag_any)
             : dnnl_memory_desc_init_by_strides(md, 5, d, dt, s);
}

static dnnl_status_t act_md(dnnl_memory_desc_t *md, const int64_t *sizes, int fmt, dnnl_data_type_t dt) {
  int64_t st[4];
  act_strides(4, sizes, fmt, st);
  dnnl_dims_t d = {sizes[0], sizes[1], sizes[2], sizes[3]}, s = {st[0], st[1], st[2], st[3]};
  return dnnl_memory_desc_init_by_strides(md, 4, d, dt, s);
}

/* What entry_build needs to know of one slot: its argument, direction, the caller's layout and
   where to ask the primitive for its own. */
typedef struct {
  int arg, output, accumulate;
  const dnnl_memory_desc_t *user;
  dnnl_query_t q;
  int qi;
} slot_spec_t;

/* A bfloat16 forward on channels-last (or other plain) activations: oneDNN 2.6 ranks its brgconv
   kernel first, but its jit_bf16 kernel on the same activation layouts is faster at every ResNet-20
   shape measured (bench/dnnl_conv.c, ALL_IMPLS=1, batch 128, 1 thread, flushed caches: 16 channels
   28x28 1.17 vs 2.04 ms, 32 channels 14x14 1.06 vs 1.27, 64 channels 7x7 0.95 vs 1.17, stride 2
   16->32 0.65 vs 0.86 and 32->64 0.53 vs 1.10; warm caches 8-20% apart, same order). So the first
   jit_bf16 implementation that takes pd's source and destination layouts replaces pd (weights
   take whatever layout it wants, as always); otherwise pd stays. */
static dnnl_primitive_desc_t prefer_jit_bf16(dnnl_primitive_desc_t pd, const dnnl_convolution_desc_t *fd,
                                             const_dnnl_primitive_attr_t attr) {
  const char *impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl ||
      strncmp(impl, "brgconv", 7) != 0)
    return pd;
  const dnnl_memory_desc_t *src = dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                           *dst = dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
  dnnl_primitive_desc_iterator_t it = NULL;
  if (!src || !dst || dnnl_primitive_desc_iterator_create(&it, fd, attr, dnnl_eng, NULL) != dnnl_success) return pd;
  do {
    dnnl_primitive_desc_t c = dnnl_primitive_desc_iterator_fetch(it);
    if (!c) break;
    const char *ci = NULL;
    const dnnl_memory_desc_t *cs = dnnl_primitive_desc_query_md(c, dnnl_query_src_md, 0),
                             *cd = dnnl_primitive_desc_query_md(c, dnnl_query_dst_md, 0);
    if (dnnl_primitive_desc_query(c, dnnl_query_impl_info_str, 0, &ci) == dnnl_success && ci &&
        strncmp(ci, "jit_bf16", 8) == 0 && cs && cd && dnnl_memory_desc_equal(cs, src) &&
        dnnl_memory_desc_equal(cd, dst)) {
      dnnl_primitive_desc_destroy(pd);
      pd = c;
      break;
    }
    dnnl_primitive_desc_destroy(c);
  } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
  dnnl_primitive_desc_iterator_destroy(it);
  return pd;
}

static dlua_status_t entry_build(const char *op, const conv_key_t *k, conv_entry_t **out) {
  const geom_t *g = &k->g;
  dlua_status_t s = DLUA_OK;
  dnnl_primitive_attr_t attr = NULL, racc = NULL, afwd = NULL;
  dnnl_post_ops_t sum = NULL;
  dnnl_primitive_desc_t fpd = NULL, pd = NULL;
  conv_entry_t *e = calloc(1, sizeof *e);
  if (!e) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating %zu bytes", op, sizeof *e);
  e->key = *k;

  int64_t xs[4] = {g->n, g->c, g->h, g->w}, ys[4] = {g->n, g->o, g->oh, g->ow};
  dnnl_memory_desc_t x_user, y_user, w_user, b_md, x_any, y_any, w_any, wf_any;
  // bfloat16 (lowp): activations and weights in bf16, accumulation in f32 inside oneDNN; the weight
  // gradient (and bias) are written in f32, straight into the float32 gradient arena.
  const dnnl_data_type_t adt = k->lowp ? dnnl_bf16 : dnnl_f32;
  const dnnl_data_type_t wdt = k->lowp && k->dir == DIR_BWD_WEIGHTS ? dnnl_f32 : adt;
  DNNL_CHECK(act_md(&x_user, xs, k->src_fmt, adt), "memory descriptor");
  DNNL_CHECK(act_md(&y_user, ys, k->dst_fmt, adt), "memory descriptor");
  DNNL_CHECK(weights_md(&w_user, g, k->w_fmt, 0, wdt), "memory descriptor");
  DNNL_CHECK(weights_md(&w_any, g, k->w_fmt, 1, wdt), "memory descriptor");
  DNNL_CHECK(weights_md(&wf_any, g, k->w_fmt, 1, adt), "memory descriptor");  // the forward's (hint for backward)
  dnnl_dims_t bd = {g->o};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&b_md, 1, bd, dnnl_f32, dnnl_a), "memory descriptor");
  // Measured on AVX-512 (ResNet-20 shapes, 2 threads): with plain NCHW activations oneDNN 2.6
  // falls back to im2col + GEMM, about 10x slower than its direct kernels, while its NCHW <->
  // blocked reorders cost ~0.3 ms per 6 MB. So NCHW activations go through the layout the
  // primitive picks; NHWC ones it runs on directly. Weights always take the primitive's
  // layout: reordering them costs microseconds, plain weights push NHWC to a reference kernel.
  int nhwc = k->src_fmt == FMT_NHWC || k->dst_fmt == FMT_NHWC;
  dnnl_dims_t xd = {xs[0], xs[1], xs[2], xs[3]}, yd = {ys[0], ys[1], ys[2], ys[3]};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&x_any, 4, xd, adt, nhwc ? dnnl_nhwc : dnnl_format_tag_any),
             "memory descriptor");
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(&y_any, 4, yd, adt, nhwc ? dnnl_nhwc : dnnl_format_tag_any),
             "memory descriptor");
  // With 16 channels, NHWC memory is byte for byte oneDNN's nChw16c (aBcd16b). Naming it so when
  // input and output both have 16 channels gets the blocked direct kernel instead of the NHWC
  // brgconv one: forward 3.5 instead of 4.6 ms for ResNet-20's 16x28x28 convolutions at batch
  // 128 on AVX-512 (backward-data, run as a forward, likewise). The weight gradient keeps the
  // NHWC names in float32: there oneDNN's direct kernel takes 1.76 instead of 2.25 ms (batch 64, 1
  // thread). In bfloat16 the blocked names win for the weight gradient too: 1.30 vs 1.37 ms warm,
  // 1.63 vs 2.03 ms with cold caches (batch 128, 1 thread, bench/dnnl_conv.c; both jit_bf16).
  // (Mixed formats fall to oneDNN's reference kernels.)
  if ((k->dir != DIR_BWD_WEIGHTS || k->lowp) && k->src_fmt == FMT_NHWC && k->dst_fmt == FMT_NHWC && xs[1] == 16 &&
      ys[1] == 16) {
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&x_any, 4, xd, adt, dnnl_aBcd16b), "memory descriptor");
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&y_any, 4, yd, adt, dnnl_aBcd16b), "memory descriptor");
    x_user = x_any;
    y_user = y_any;
  }

  dnnl_dims_t strides = {g->sh, g->sw}, dil = {g->dh - 1, g->dw - 1}, pad = {g->ph, g->pw};
  // Symmetric padding: with the output size rounded down, oneDNN's consistency check
  // (H + pad_l + pad_r - extent) / stride + 1 == OH holds for pad_r = pad_l, as in PyTorch.
  DNNL_CHECK(dnnl_primitive_attr_create(&attr), "attribute creation");
  DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "scratchpad mode");
  dnnl_convolution_desc_t fd, bd_;
  DNNL_CHECK(dnnl_dilated_convolution_forward_desc_init(&fd, dnnl_forward_training, dnnl_convolution_direct, &x_any,
                                                        &wf_any, k->has_bias ? &b_md : NULL, &y_any, strides, dil,
                                                        pad, pad),
             "convolution descriptor");
  DNNL_CHECK(dnnl_post_ops_create(&sum), "post-op creation");
  DNNL_CHECK(dnnl_post_ops_append_sum(sum, 1.0f), "sum post-op");
  // A forward accumulating into y adds in the convolution (a sum post-op: y is read where it is
  // written) when the primitive works on the caller's y directly; otherwise in y's reorder.
  int fused_sum = 0;
  if (k->dir == DIR_FWD && k->acc_y) {
    DNNL_CHECK(dnnl_primitive_attr_create(&afwd), "attribute creation");
    DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(afwd, dnnl_scratchpad_mode_user), "scratchpad mode");
    DNNL_CHECK(dnnl_primitive_attr_set_post_ops(afwd, sum), "sum post-op");
    DNNL_CHECK(dnnl_primitive_desc_create(&fpd, &fd, afwd, dnnl_eng, NULL), "forward convolution");
    const dnnl_memory_desc_t *dmd = dnnl_primitive_desc_query_md(fpd, dnnl_query_dst_md, 0);
    fused_sum = dmd && dnnl_memory_desc_equal(dmd, &y_user);
    if (!fused_sum) {
      dnnl_primitive_desc_destroy(fpd);
      fpd = NULL;
    }
  }
  if (!fpd) DNNL_CHECK(dnnl_primitive_desc_create(&fpd, &fd, attr, dnnl_eng, NULL), "forward convolution");
  if (k->dir == DIR_FWD) {
    // (Only where it runs: as a backward's hint the primitive oneDNN ranks first stays.)
    pd = k->lowp ? prefer_jit_bf16(fpd, &fd, fused_sum ? afwd : attr) : fpd;
    fpd = NULL;
  } else if (k->dir == DIR_BWD_DATA) {
    DNNL_CHECK(dnnl_dilated_convolution_backward_data_desc_init(&bd_, dnnl_convolution_direct, &x_any, &w_any, &y_any,
                                                                strides, dil, pad, pad),
               "convolution descriptor");
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &bd_, attr, dnnl_eng, fpd), "backward-data convolution");
  } else {
    DNNL_CHECK(dnnl_dilated_convolution_backward_weights_desc_init(&bd_, dnnl_convolution_direct, &x_any, &w_any,
                                                                   k->has_bias ? &b_md : NULL, &y_any, strides, dil,
                                                                   pad, pad),
               "convolution descriptor");
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &bd_, attr, dnnl_eng, fpd), "backward-weights convolution");
  }
  const char *impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl)
    snprintf(e->impl, sizeof e->impl, "%s", impl);

  // Slots in the order the callers pass pointers.
  slot_spec_t spec[4];
  int ns = 0;
  if (k->dir == DIR_FWD) {
    spec[ns++] = (slot_spec_t){DNNL_ARG_SRC, 0, 0, &x_user, dnnl_query_src_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_WEIGHTS, 0, 0, &w_user, dnnl_query_weights_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DST, 1, k->acc_y && !fused_sum, &y_user, dnnl_query_dst_md, 0};
    if (k->has_bias) spec[ns++] = (slot_spec_t){DNNL_ARG_BIAS, 0, 0, &b_md, dnnl_query_weights_md, 1};
  } else if (k->dir == DIR_BWD_DATA) {
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_DST, 0, 0, &y_user, dnnl_query_diff_dst_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_WEIGHTS, 0, 0, &w_user, dnnl_query_weights_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_SRC, 1, 0, &x_user, dnnl_query_diff_src_md, 0};
  } else {
    spec[ns++] = (slot_spec_t){DNNL_ARG_SRC, 0, 0, &x_user, dnnl_query_src_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_DST, 0, 0, &y_user, dnnl_query_diff_dst_md, 0};
    spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_WEIGHTS, 1, k->acc_w, &w_user, dnnl_query_diff_weights_md, 0};
    if (k->has_bias)
      spec[ns++] = (slot_spec_t){DNNL_ARG_DIFF_BIAS, 1, k->acc_b, &b_md, dnnl_query_diff_weights_md, 1};
  }

  const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  e->scratch_bytes = smd ? dnnl_memory_desc_get_size(smd) : 0;
  DNNL_CHECK(dnnl_primitive_attr_create(&racc), "attribute creation");
  DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(racc, dnnl_scratchpad_mode_user), "scratchpad mode");
  DNNL_CHECK(dnnl_primitive_attr_set_post_ops(racc, sum), "sum post-op");
  e->nslots = ns;
  for (int i = 0; i < ns; i++) {
    conv_slot_t *sl = &e->slot[i];
    sl->arg = spec[i].arg;
    sl->output = spec[i].output;
    sl->user = *spec[i].user;
    const dnnl_memory_desc_t *in = dnnl_primitive_desc_query_md(pd, spec[i].q, spec[i].qi);
    if (!in) {
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: oneDNN convolution has no memory descriptor for argument %d", op, sl->arg);
      goto done;
    }
    sl->inner = *in;
    // Accumulating outputs always go through a buffer: the sum happens in the reorder.
    if (dnnl_memory_desc_equal(&sl->user, &sl->inner) && !spec[i].accumulate) continue;
    dnnl_primitive_desc_t rpd = NULL;
    const dnnl_memory_desc_t *from = sl->output ? &sl->inner : &sl->user, *to = sl->output ? &sl->user : &sl->inner;
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, from, dnnl_eng, to, dnnl_eng, spec[i].accumulate ? racc : attr),
               "reorder");
    const dnnl_memory_desc_t *rs = dnnl_primitive_desc_query_md(rpd, dnnl_query_scratchpad_md, 0);
    size_t rb = rs ? dnnl_memory_desc_get_size(rs) : 0;
    if (rb > e->scratch_bytes) e->scratch_bytes = rb;
    dnnl_status_t st = dnnl_primitive_create(&sl->reorder, rpd);
    dnnl_primitive_desc_destroy(rpd);
    DNNL_CHECK(st, "reorder creation");
  }
  size_t off = align64(e->scratch_bytes);
  for (int i = 0; i < ns; i++)
    if (e->slot[i].reorder) {
      e->slot[i].off = off;
      off += align64(dnnl_memory_desc_get_size(&e->slot[i].inner));
    }
  e->ws_bytes = off;
  DNNL_CHECK(dnnl_primitive_create(&e->conv, pd), "convolution creation");

done:
  if (sum) dnnl_post_ops_destroy(sum);
  if (racc) dnnl_primitive_attr_destroy(racc);
  if (afwd) dnnl_primitive_attr_destroy(afwd);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (fpd) dnnl_primitive_desc_destroy(fpd);
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (s != DLUA_OK) {
    entry_destroy(e);
    return s;
  }
  *out = e;
  return DLUA_OK;
}

static conv_entry_t *cache_find(const conv_key_t *k, uint64_t h) {
  for (int i = 0; i < cache_n; i++)
    if (cache_tab[i]->hash == h && memcmp(&cache_tab[i]->key, k, sizeof *k) == 0) return cache_tab[i];
  return NULL;
}

/* Removes table slot i; the entry goes now, or when its last user releases it. */
static void cache_drop(int i) {
  conv_entry_t *e = cache_tab[i];
  cache_tab[i] = cache_tab[--cache_n];
  if (e->refs == 0)
    entry_destroy(e);
  else
    e->evicted = 1;
}

/* A referenced entry for k (released with cache_release). Building (JIT compilation) runs
   outside the lock; if two threads race on one key the later copy is dropped. */
static dlua_status_t cache_get(const char *op, const conv_key_t *k, conv_entry_t **out) {
  uint64_t h = key_hash(k);
  pthread_mutex_lock(&cache_mu);
  conv_entry_t *e = cache_find(k, h);
  if (e) {
    e->refs++;
    e->last_use = ++cache_clock;
    cache_hits++;
    pthread_mutex_unlock(&cache_mu);
    *out = e;
    return DLUA_OK;
  }
  cache_misses++;
  pthread_mutex_unlock(&cache_mu);

  conv_entry_t *fresh = NULL;
  DLUA_TRY(entry_build(op, k, &fresh));
  fresh->hash = h;
  pthread_mutex_lock(&cache_mu);
  e = cache_find(k, h);
  if (e) {
    entry_destroy(fresh);
  } else {
    while (cache_n >= cache_cap) {
      int lru = 0;
      for (int i = 1; i < cache_n; i++)
        if (cache_tab[i]->last_use < cache_tab[lru]->last_use) lru = i;
      cache_drop(lru);
    }
    e = fresh;
    cache_tab[cache_n++] = e;
  }
  e->refs++;
  e->last_use = ++cache_clock;
  pthread_mutex_unlock(&cache_mu);
  *out = e;
  return DLUA_OK;
}

static void cache_release(conv_entry_t *e) {
  pthread_mutex_lock(&cache_mu);
  if (--e->refs == 0 && e->evicted) entry_destroy(e);
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_clear(void) {
  pthread_mutex_lock(&cache_mu);
  while (cache_n > 0) cache_drop(cache_n - 1);
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_set_capacity(int capacity) {
  if (capacity < 1) capacity = 1;
  if (capacity > CACHE_MAX) capacity = CACHE_MAX;
  pthread_mutex_lock(&cache_mu);
  cache_cap = capacity;
  while (cache_n > cache_cap) {
    int lru = 0;
    for (int i = 1; i < cache_n; i++)
      if (cache_tab[i]->last_use < cache_tab[lru]->last_use) lru = i;
    cache_drop(lru);
  }
  pthread_mutex_unlock(&cache_mu);
}

void dlua_conv_cache_stats(int *entries, int64_t *hits, int64_t *misses) {
  pthread_mutex_lock(&cache_mu);
  if (entries) *entries = cache_n;
  if (hits) *hits = cache_hits;
  if (misses) *misses = cache_misses;
  pthread_mutex_unlock(&cache_mu);
}

/* Runs one float32 or bfloat16 convolution; ptrs are the caller's buffers in the entry's slot order. */
dlua_status_t dlua_conv_dnnl_run(const char *op, const conv_key_t *k, void *const *ptrs) {
  const geom_t *g = &k->g;
  conv_tls_t *t = NULL;
  DLUA_TRY(get_tls(op, &t));
  conv_entry_t *e = NULL;
  DLUA_TRY(cache_get(op, k, &e));
  dlua_status_t s = DLUA_OK;
  dnnl_memory_t user[4] = {0}, inner[4] = {0}, scratch = NULL;
  char *ws = NULL;
  s = tls_workspace(op, t, e->ws_bytes ? e->ws_bytes : 64, &ws);
  if (s != DLUA_OK) goto done;
  if (e->scratch_bytes) {
    dnnl_memory_desc_t smd;
    dnnl_dims_t sd = {(int64_t)e->scratch_bytes};
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&smd, 1, sd, dnnl_u8, dnnl_a), "memory descriptor");
    DNNL_CHECK(dnnl_memory_create(&scratch, &smd, dnnl_eng, ws), "memory creation");
  }
  dnnl_exec_arg_t cargs[5];
  int nc = 0;
  for (int i = 0; i < e->nslots; i++) {
    conv_slot_t *sl = &e->slot[i];
    DNNL_CHECK(dnnl_memory_create(&user[i], &sl->user, dnnl_eng, ptrs[i]), "memory creation");
    if (sl->reorder) DNNL_CHECK(dnnl_memory_create(&inner[i], &sl->inner, dnnl_eng, ws + sl->off), "memory creation");
    cargs[nc++] = (dnnl_exec_arg_t){sl->arg, sl->reorder ? inner[i] : user[i]};
  }
  if (scratch) cargs[nc++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, scratch};
  for (int i = 0; i < e->nslots; i++) {
    if (!e->slot[i].reorder || e->slot[i].output) continue;
    dnnl_exec_arg_t ra[3] = {{DNNL_ARG_FROM, user[i]}, {DNNL_ARG_TO, inner[i]}, {DNNL_ARG_SCRATCHPAD, scratch}};
    DNNL_CHECK(dnnl_primitive_execute(e->slot[i].reorder, t->stream, scratch ? 3 : 2, ra), "reorder");
  }
  DNNL_CHECK(dnnl_primitive_execute(e->conv, t->stream, nc, cargs), "convolution");
  for (int i = 0; i < e->nslots; i++) {
    if (!e->slot[i].reorder || !e->slot[i].output) continue;
    dnnl_exec_arg_t ra[3] = {{DNNL_ARG_FROM, inner[i]}, {DNNL_ARG_TO, user[i]}, {DNNL_ARG_SCRATCHPAD, scratch}};
    DNNL_CHECK(dnnl_primitive_execute(e->slot[i].reorder, t->stream, scratch ? 3 : 2, ra), "reorder");
  }
  DNNL_CHECK(dnnl_stream_wait(t->stream), "stream wait");

done:
  for (int i = 0; i < 4; i++) {
    if (user[i]) dnnl_memory_destroy(user[i]);
    if (inner[i]) dnnl_memory_destroy(inner[i]);
  }
  if (scratch) dnnl_memory_destroy(scratch);
  cache_release(e);
  tls_trim(t);
  return s;
}

conv_key_t dlua_conv_dnnl_key(conv_dir_t dir, const geom_t *g, int src_fmt, int dst_fmt, int w_fmt, int has_bias) {
  conv_key_t k;
  memset(&k, 0, sizeof k);
  k.dir = dir;
  k.threads = omp_get_max_threads();  // oneDNN splits work for the thread count it was built for
  k.src_fmt = src_fmt;
  k.dst_fmt = dst_fmt;
  k.w_fmt = w_fmt;
  k.has_bias = has_bias;
  k.g = *g;
  return k;
}

/* The data loader: pthread workers (signals blocked) fill batch buffers from a pool, `prefetch` batches ahead of the consumer, in sampler order; bad files are skipped and counted. */
#include "data/loader.h"
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "core/error.h"
#include "core/runtime.h"
#include "core/tensor.h"
#include "data/folder.h"
#include "data/image.h"
#include "data/transform.h"

static const char OP[] = "DataLoader";

enum { SRC_FOLDER, SRC_TENSOR, SRC_SYNTHETIC };

/* Worker threads alive in the process, all loaders together (tests check it drops to 0). */
static int g_live_threads;

int dlua_loader_live_threads(void) { return __atomic_load_n(&g_live_threads, __ATOMIC_ACQUIRE); }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- the buffer pool ------------------------------------------------------------------------------
   A batch tensor wraps a pool buffer; its deleter gives the buffer back. The pool outlives the
   loader while batches are alive (a user may keep one), and is freed with the last of them. */

typedef struct {
  pthread_mutex_t mu;
  int refs;        /* the loader + every buffer lent out */
  int closed;      /* the loader is gone: returned buffers are freed */
  size_t bytes;    /* one buffer */
  void **free;
  int nfree, cap;
  int64_t allocated; /* buffers in existence */
  int pinned;        /* page-locked buffers (pin_memory with a GPU present) */
} pool_t;

static void *pool_alloc(pool_t *p) {
  if (!p->pinned) return dlua_cpu_alloc(p->bytes);
  void *b = NULL;
  if (dlua_cuda_host_alloc(&b, p->bytes) != DLUA_OK) return NULL;
  return b;
}

static void pool_free_buf(pool_t *p, void *b) {
  if (!p->pinned) {
    dlua_cpu_free(b, p->bytes);
  } else if (dlua_cuda_host_free(b) != DLUA_OK) {
    dlua_clear_error();
  }
}

static void pool_release(pool_t *p) {
  pthread_mutex_lock(&p->mu);
  int last = --p->refs == 0;
  pthread_mutex_unlock(&p->mu);
  if (!last) return;
  for (int i = 0; i < p->nfree; i++) pool_free_buf(p, p->free[i]);
  free(p->free);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

/* Called with p->mu held. */
static void *pool_take_locked(pool_t *p) {
  if (p->nfree) return p->free[--p->nfree];
  void *b = pool_alloc(p);
  if (b) p->allocated++;
  return b;
}

static void pool_put(pool_t *p, void *b) {
  pthread_mutex_lock(&p->mu);
  // Keep a handful for reuse; more means the user held batches and the pool grew past need.
  if (!p->closed && p->nfree < p->cap) {
    p->free[p->nfree++] = b;
    b = NULL;
  } else {
    p->allocated--;
  }
  pthread_mutex_unlock(&p->mu);
  if (b) pool_free_buf(p, b);
}

/* The storage deleter of a batch tensor. */
static void pool_deleter(void *ctx, void *data) {
  pool_t *p = ctx;
  pool_put(p, data);
  pool_release(p);
}

/* ---- the loader ------------------------------------------------------------------------------------ */

typedef struct {
  int64_t batch;     /* the batch this slot holds, -1 when free */
  int count, done, nbad;
  void *buf;
  int64_t *labels;   /* (batch) */
  uint8_t *bad;      /* (batch) 1 where the sample was skipped */
} slot_t;

typedef struct {
  dlua_image_decoder_t dec;
  dlua_tf_scratch_t tf;
  uint8_t *file;
  size_t file_cap;
  char *path;
  size_t path_cap;
  uint8_t *hwc;      /* a tensor sample as HWC, or a synthetic image */
  size_t hwc_cap;
} scratch_t;

struct dlua_loader {
  int source;
  dlua_folder_t *folder;
  dlua_tensor_t *x, *y;
  int64_t n;                     /* samples in the dataset */
  int64_t syn_c, syn_h, syn_w;
  int syn_classes;
  int has_pipe;
  dlua_pipeline_t pipe;
  int64_t batch;
  int workers, nslots, pin, dct, quiet;
  uint64_t seed;
  int64_t label_base;
  /* One sample of x: shape, dtype, bytes; in_* is what the pipeline gets (tensor/synthetic). */
  int sample_ndim;
  int64_t sample_sizes[DLUA_MAX_DIMS];
  int channels_last;             /* samples (C, H, W) written as (H, W, C) bytes: batches get channels-last strides */
  dlua_dtype_t dtype;
  size_t sample_bytes;
  int out_h, out_w;
  int in_c, in_h, in_w;

  pool_t *pool;
  pthread_mutex_t mu;
  pthread_cond_t cv_work, cv_ready;
  slot_t *slots;
  /* The epoch. */
  int active, stop;
  int64_t *order, norder, total, nbatches, next_pos, delivered;
  uint64_t epoch;
  pthread_t *threads;
  int nthreads;
  dlua_status_t err;
  char errmsg[1024];
  scratch_t inline_scratch;      /* workers == 0 */
  /* Bad files: a bit per sample, set at the first failure, then skipped without reading. */
  uint8_t *known_bad;
  char *bad_msgs[DLUA_LOADER_MAX_BAD_MESSAGES];
  /* Statistics (under mu). */
  int64_t st_samples, st_decoded, st_skipped, st_bad, st_batches, st_scaled;
  double st_wait, st_work;
};

static void scratch_free(scratch_t *s) {
  dlua_image_decoder_free(&s->dec);
  dlua_tf_scratch_free(&s->tf);
  free(s->file);
  free(s->path);
  free(s->hwc);
  memset(s, 0, sizeof *s);
}

static int grow(uint8_t **p, size_t *cap, size_t need) {
  if (need <= *cap) return 1;
  uint8_t *q = realloc(*p, need);
  if (!q) return 0;
  *p = q;
  *cap = need;
  return 1;
}

/* The message without its " (host/file.c:line)" suffix, for a user-facing warning. */
static void user_message(const char *msg, char *buf, size_t len) {
  snprintf(buf, len, "%s", msg);
  char *at = strstr(buf, " (host/");
  char *last = NULL;
  while (at) {
    last = at;
    at = strstr(at + 1, " (host/");
  }
  if (last) *last = '\0';
}

/* Synthetic pixels: a cheap hash of (seed, sample, row), the same on every run. */
static void synth_image(const dlua_loader_t *l, int64_t sample, uint8_t *dst) {
  size_t row = (size_t)l->syn_w * l->syn_c;
  for (int64_t y = 0; y < l->syn_h; y++) {
    uint64_t z = l->seed * 0x9E3779B97F4A7C15ull + (uint64_t)sample * 0xBF58476D1CE4E5B9ull + (uint64_t)y + 1;
    uint8_t *o = dst + (size_t)y * row;
    for (size_t i = 0; i < row; i += 8) {
      z ^= z << 13;
      z ^= z >> 7;
      z ^= z << 17;
      size_t k = row - i < 8 ? row - i : 8;
      memcpy(o + i, &z, k);
    }
  }
}

/* Sample `index` into out (sample_bytes) and its label; DLUA_ERR_IO for a bad file (skipped),
   anything else is fatal. */
static dlua_status_t load_sample(dlua_loader_t *l, scratch_t *s, int64_t index, void *out, int64_t *label,
                                 int *scaled) {
  dlua_tf_key_t key = {l->seed, l->epoch, index};
  *scaled = 0;
  if (l->source == SRC_FOLDER) {
    *label = (int64_t)l->folder->labels[index] + l->label_base;
    const char *path = dlua_folder_full_path(l->folder, index, &s->path, &s->path_cap);
    if (!path) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
    size_t len = 0;
    DLUA_TRY(dlua_image_read_file(OP, path, &s->file, &s->file_cap, &len));
    int num = 1, den = 1, h = 0, w = 0;
    if (dlua_image_sniff(s->file, len) == DLUA_IMAGE_JPEG) {
      int h0, w0, box[4];
      DLUA_TRY(dlua_image_jpeg_size(&s->dec, OP, path, s->file, len, &h0, &w0));
      if (l->dct) dlua_tf_plan_decode(&l->pipe, &key, h0, w0, &num, &den);
      if (num == den && dlua_tf_plan_region(&l->pipe, &key, h0, w0, box)) {
        // Only the rows and columns the crop reads: the same pixels, less decoding.
        int got[4];
        DLUA_TRY(dlua_image_decode_region(&s->dec, OP, path, s->file, len, box, got));
        dlua_tf_view_t v = {s->dec.pixels, h0, w0, 3, (ptrdiff_t)got[3] * 3, 0, h0, w0, got[0], got[1], got[2], got[3]};
        return dlua_tf_run(&l->pipe, &s->tf, &key, v, out, l->out_h, l->out_w, NULL, NULL);
      }
      DLUA_TRY(dlua_image_decode_into(&s->dec, OP, path, s->file, len, num, den, &h, &w));
      dlua_tf_view_t v = {s->dec.pixels, h, w, 3, (ptrdiff_t)w * 3, 0, h0, w0, 0, 0, 0, 0};
      *scaled = num != den;
      return dlua_tf_run(&l->pipe, &s->tf, &key, v, out, l->out_h, l->out_w, NULL, NULL);
    }
    DLUA_TRY(dlua_image_decode_into(&s->dec, OP, path, s->file, len, 1, 0, &h, &w));
    dlua_tf_view_t v = {s->dec.pixels, h, w, 3, (ptrdiff_t)w * 3, 0, h, w, 0, 0, 0, 0};
    return dlua_tf_run(&l->pipe, &s->tf, &key, v, out, l->out_h, l->out_w, NULL, NULL);
  }
  if (l->source == SRC_SYNTHETIC) {
    *label = index % l->syn_classes + l->label_base;
    if (!grow(&s->hwc, &s->hwc_cap, (size_t)l->in_h * l->in_w * l->in_c))
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for a synthetic image", OP);
    synth_image(l, index, s->hwc);
    dlua_tf_view_t v = {s->hwc, l->in_h, l->in_w, l->in_c, (ptrdiff_t)l->in_w * l->in_c, 0, l->in_h, l->in_w, 0, 0, 0, 0};
    return dlua_tf_run(&l->pipe, &s->tf, &key, v, out, l->out_h, l->out_w, NULL, NULL);
  }
  // In memory: x[index], raw or through the transforms.
  const dlua_tensor_t *x = l->x;
  if (l->y) {
    const dlua_tensor_t *y = l->y;
    *label = ((const int64_t *)(void *)dlua_tensor_ptr(y))[index * y->strides[0]];
  } else {
    *label = 0;
  }
  const char *src = dlua_tensor_ptr(x) + (size_t)(index * x->strides[0]) * dlua_dtype_size(x->dtype);
  if (!l->has_pipe) {
    memcpy(out, src, l->sample_bytes);  // x was made contiguous at construction
    return DLUA_OK;
  }
  // (C, H, W) -> (H, W, C) for the transforms.
  const int C = l->in_c, H = l->in_h, W = l->in_w;
  const uint8_t *p = (const uint8_t *)src;
  if (!grow(&s->hwc, &s->hwc_cap, (size_t)H * W * C)) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  if (C == 1) {
    memcpy(s->hwc, p, (size_t)H * W);
  } else {
    for (int c = 0; c < C; c++)
      for (int i = 0; i < H * W; i++) s->hwc[(size_t)i * C + c] = p[(size_t)c * H * W + i];
  }
  dlua_tf_view_t v = {s->hwc, H, W, C, (ptrdiff_t)W * C, 0, H, W, 0, 0, 0, 0};
  return dlua_tf_run(&l->pipe, &s->tf, &key, v, out, l->out_h, l->out_w, NULL, NULL);
}

/* Runs one sample and records its outcome; called without the lock. Returns 1 if skipped,
   0 if loaded, -1 on a fatal error (recorded in l->err). */
static int run_sample(dlua_loader_t *l, scratch_t *s, int64_t index, void *out, int64_t *label) {
  if (l->known_bad && __atomic_load_n(&l->known_bad[index], __ATOMIC_RELAXED)) {
    pthread_mutex_lock(&l->mu);
    l->st_skipped++;
    pthread_mutex_unlock(&l->mu);
    return 1;
  }
  int scaled = 0;
  double t0 = now_s();
  dlua_status_t st = load_sample(l, s, index, out, label, &scaled);
  double dt = now_s() - t0;
  if (st == DLUA_OK) {
    pthread_mutex_lock(&l->mu);
    l->st_decoded++;
    l->st_scaled += scaled;
    l->st_work += dt;
    pthread_mutex_unlock(&l->mu);
    return 0;
  }
  char msg[1024];
  user_message(dlua_last_error(), msg, sizeof msg);
  if (st == DLUA_ERR_IO && l->source == SRC_FOLDER) {
    int first = l->known_bad && !__atomic_exchange_n(&l->known_bad[index], 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&l->mu);
    l->st_skipped++;
    l->st_work += dt;
    if (first) {
      if (l->st_bad < DLUA_LOADER_MAX_BAD_MESSAGES) l->bad_msgs[l->st_bad] = strdup(msg);
      l->st_bad++;
    }
    pthread_mutex_unlock(&l->mu);
    if (first && !l->quiet) fprintf(stderr, "dlua: warning: skipping a sample: %s\n", msg);
    return 1;
  }
  pthread_mutex_lock(&l->mu);
  if (l->err == DLUA_OK) {
    l->err = st;
    snprintf(l->errmsg, sizeof l->errmsg, "%s", dlua_last_error());
  }
  pthread_cond_broadcast(&l->cv_ready);
  pthread_cond_broadcast(&l->cv_work);
  pthread_mutex_unlock(&l->mu);
  return -1;
}

/* Sets slot up for batch b (lock held). */
static int slot_init(dlua_loader_t *l, slot_t *slot, int64_t b) {
  if (!slot->buf) {
    pthread_mutex_lock(&l->pool->mu);
    slot->buf = pool_take_locked(l->pool);
    pthread_mutex_unlock(&l->pool->mu);
    if (!slot->buf) return 0;
  }
  slot->batch = b;
  int64_t first = b * l->batch;
  slot->count = (int)(l->total - first < l->batch ? l->total - first : l->batch);
  slot->done = 0;
  slot->nbad = 0;
  memset(slot->bad, 0, (size_t)l->batch);
  return 1;
}

static void set_error_locked(dlua_loader_t *l, dlua_status_t st, const char *msg) {
  if (l->err != DLUA_OK) return;
  l->err = st;
  snprintf(l->errmsg, sizeof l->errmsg, "%s", msg);
  pthread_cond_broadcast(&l->cv_ready);
  pthread_cond_broadcast(&l->cv_work);
}

static void *worker_main(void *arg) {
  dlua_loader_t *l = arg;
  dlua_thread_name("dlua-loader");
  scratch_t s = {0};
  pthread_mutex_lock(&l->mu);
  for (;;) {
    if (l->stop || l->err != DLUA_OK || l->next_pos >= l->total) break;
    int64_t pos = l->next_pos, b = pos / l->batch;
    if (b >= l->delivered + l->nslots) {
      pthread_cond_wait(&l->cv_work, &l->mu);
      continue;
    }
    slot_t *slot = &l->slots[b % l->nslots];
    if (slot->batch != b && !slot_init(l, slot, b)) {
      set_error_locked(l, DLUA_ERR_OOM, "DataLoader: out of memory allocating a batch buffer");
      break;
    }
    l->next_pos++;
    int row = (int)(pos - b * l->batch);
    char *out = (char *)slot->buf + (size_t)row * l->sample_bytes;
    int64_t *label = &slot->labels[row];
    pthread_mutex_unlock(&l->mu);
    int r = run_sample(l, &s, l->order[pos], out, label);
    pthread_mutex_lock(&l->mu);
    if (r == 1) {
      slot->bad[row] = 1;
      slot->nbad++;
    }
    if (++slot->done == slot->count) pthread_cond_broadcast(&l->cv_ready);
  }
  pthread_mutex_unlock(&l->mu);
  scratch_free(&s);
  __atomic_sub_fetch(&g_live_threads, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* ---- construction ----------------------------------------------------------------------------------- */

void dlua_loader_stop(dlua_loader_t *l);

void dlua_loader_free(dlua_loader_t *l) {
  if (!l) return;
  dlua_loader_stop(l);
  for (int i = 0; i < l->nslots && l->slots; i++) {
    if (l->slots[i].buf) pool_put(l->pool, l->slots[i].buf);
    free(l->slots[i].labels);
    free(l->slots[i].bad);
  }
  free(l->slots);
  if (l->pool) {
    pthread_mutex_lock(&l->pool->mu);
    l->pool->closed = 1;
    for (int i = 0; i < l->pool->nfree; i++) pool_free_buf(l->pool, l->pool->free[i]);  // pinned or not
    l->pool->nfree = 0;
    pthread_mutex_unlock(&l->pool->mu);
    pool_release(l->pool);
  }
  scratch_free(&l->inline_scratch);
  for (int i = 0; i < DLUA_LOADER_MAX_BAD_MESSAGES; i++) free(l->bad_msgs[i]);
  free(l->known_bad);
  free(l->order);
  free(l->threads);
  dlua_folder_free(l->folder);
  dlua_tensor_free(l->x);
  dlua_tensor_free(l->y);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv_work);
  pthread_cond_destroy(&l->cv_ready);
  free(l);
}

static dlua_status_t setup_source(dlua_loader_t *l, const dlua_loader_config_t *cfg) {
  char b1[160], b2[160];
  int nsrc = (cfg->folder != NULL) + (cfg->x != NULL) + (cfg->synthetic_n > 0);
  if (nsrc != 1)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: give exactly one dataset (an ImageFolder, tensors or Synthetic), got %d", OP, nsrc);
  if (cfg->pipeline) {
    l->pipe = *cfg->pipeline;
    l->has_pipe = 1;
  }
  if (cfg->folder) {
    l->source = SRC_FOLDER;
    l->folder = (dlua_folder_t *)cfg->folder;
    dlua_folder_retain(l->folder);
    l->n = l->folder->n;
    l->in_c = 3;
    l->in_h = l->in_w = -1;
  } else if (cfg->synthetic_n > 0) {
    l->source = SRC_SYNTHETIC;
    l->n = cfg->synthetic_n;
    l->syn_c = cfg->synthetic_shape[0];
    l->syn_h = cfg->synthetic_shape[1];
    l->syn_w = cfg->synthetic_shape[2];
    l->syn_classes = cfg->synthetic_classes;
    if (l->syn_c < 1 || l->syn_c > DLUA_TF_MAX_CHANNELS || l->syn_h < 1 || l->syn_w < 1 || l->syn_h > 65535 ||
        l->syn_w > 65535)
      return DLUA_ERR(DLUA_ERR_ARG, "Synthetic: shape must be (C, H, W) with C in 1..%d, got (%" PRId64 ", %" PRId64
                      ", %" PRId64 ")", DLUA_TF_MAX_CHANNELS, l->syn_c, l->syn_h, l->syn_w);
    if (l->syn_classes < 1) return DLUA_ERR(DLUA_ERR_ARG, "Synthetic: classes must be >= 1, got %d", l->syn_classes);
    l->in_c = (int)l->syn_c;
    l->in_h = (int)l->syn_h;
    l->in_w = (int)l->syn_w;
  } else {
    l->source = SRC_TENSOR;
    DLUA_TRY(dlua_require_cpu(OP, cfg->x));
    if (cfg->x->ndim < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: x must have a sample dimension, got a 0-d tensor", OP);
    DLUA_TRY(dlua_tensor_contiguous(&l->x, cfg->x));
    l->n = l->x->sizes[0];
    if (cfg->y) {
      DLUA_TRY(dlua_require_cpu(OP, cfg->y));
      if (cfg->y->ndim != 1 || cfg->y->sizes[0] != l->n || cfg->y->dtype != DLUA_DTYPE_I64)
        return DLUA_ERR(DLUA_ERR_ARG, "%s: labels must be int64 (%" PRId64 ") for x %s, got %s", OP, l->n,
                        dlua_tensor_describe(cfg->x, b1, sizeof b1), dlua_tensor_describe(cfg->y, b2, sizeof b2));
      l->y = dlua_tensor_alias(cfg->y);
      if (!l->y) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
    }
    if (l->has_pipe) {
      const dlua_tensor_t *x = l->x;
      int ok = x->dtype == DLUA_DTYPE_U8 && (x->ndim == 3 || x->ndim == 4);
      if (ok) {
        l->in_c = x->ndim == 4 ? (int)x->sizes[1] : 1;
        l->in_h = (int)x->sizes[x->ndim - 2];
        l->in_w = (int)x->sizes[x->ndim - 1];
        ok = l->in_c >= 1 && l->in_c <= DLUA_TF_MAX_CHANNELS && l->in_h >= 1 && l->in_w >= 1;
      }
      if (!ok)
        return DLUA_ERR(DLUA_ERR_ARG, "%s: transforms need uint8 images (N, C, H, W) or (N, H, W) with C in 1..%d, got x %s",
                        OP, DLUA_TF_MAX_CHANNELS, dlua_tensor_describe(x, b1, sizeof b1));
    }
  }
  if (l->n < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: the dataset is empty", OP);
  // What one sample of a batch is.
  if (l->source == SRC_TENSOR && !l->has_pipe) {
    l->dtype = l->x->dtype;
    l->sample_ndim = l->x->ndim - 1;
    for (int d = 1; d < l->x->ndim; d++) l->sample_sizes[d - 1] = l->x->sizes[d];
    l->sample_bytes = (size_t)dlua_shape_numel(l->sample_ndim, l->sample_sizes) * dlua_dtype_size(l->dtype);
    return DLUA_OK;
  }
  if (!l->has_pipe) {  // images without transforms: ToTensor, as torchvision's FakeData needs too
    dlua_transform_t tt = {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32};
    dlua_pipeline_t *p = NULL;
    DLUA_TRY(dlua_pipeline_new(&p, &tt, 1));
    l->pipe = *p;
    dlua_pipeline_free(p);
    l->has_pipe = 1;
  }
  dlua_tf_output_hw(&l->pipe, l->in_h, l->in_w, &l->out_h, &l->out_w);
  if (l->out_h < 0)
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: the images of '%s' may differ in size: end the transforms with a fixed size "
                    "(RandomResizedCrop(n), CenterCrop(n) or Resize{h, w}) so that samples stack into a batch",
                    OP, l->folder ? l->folder->root : "the dataset");
  if (l->pipe.nnorm > 1 && l->pipe.nnorm != l->in_c)
    return DLUA_ERR(DLUA_ERR_ARG, "Normalize: %d means/stds for images of %d channels", l->pipe.nnorm, l->in_c);
  l->dtype = (dlua_dtype_t)l->pipe.out_dtype;
  // A sample is (C, H, W) in either memory format, as in torchvision: channels-last is a stride order, not a shape.
  l->sample_ndim = 3;
  l->sample_sizes[0] = l->in_c, l->sample_sizes[1] = l->out_h, l->sample_sizes[2] = l->out_w;
  l->channels_last = l->pipe.layout == 1;
  l->sample_bytes = (size_t)l->in_c * l->out_h * l->out_w * dlua_dtype_size(l->dtype);
  return DLUA_OK;
}

dlua_status_t dlua_loader_new(dlua_loader_t **out, const dlua_loader_config_t *cfg) {
  if (!out || !cfg) return DLUA_ERR(DLUA_ERR_ARG, "%s: out or config is NULL", OP);
  *out = NULL;
  if (cfg->batch < 1) return DLUA_ERR(DLUA_ERR_ARG, "%s: batch must be >= 1, got %" PRId64, OP, cfg->batch);
  if (cfg->workers < 0 || cfg->workers > 1024)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: workers must be 0..1024, got %d", OP, cfg->workers);
  if (cfg->prefetch < 1 || cfg->prefetch > 1024)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: prefetch must be 1..1024 batches, got %d", OP, cfg->prefetch);
  dlua_loader_t *l = calloc(1, sizeof *l);
  if (!l) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv_work, NULL);
  pthread_cond_init(&l->cv_ready, NULL);
  l->batch = cfg->batch;
  l->workers = cfg->workers;
  l->nslots = cfg->prefetch;
  l->pin = cfg->pin_memory;
  l->dct = cfg->dct_scaling;
  l->quiet = cfg->quiet;
  l->seed = cfg->seed;
  l->label_base = cfg->label_base;
  dlua_status_t s = setup_source(l, cfg);
  if (s == DLUA_OK && l->sample_bytes > (SIZE_MAX / 4) / (size_t)l->batch)
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: a batch of %" PRId64 " samples of %zu bytes is too large", OP, l->batch,
                 l->sample_bytes);
  if (s == DLUA_OK) {
    l->pool = calloc(1, sizeof *l->pool);
    l->slots = calloc((size_t)l->nslots, sizeof *l->slots);
    if (l->source == SRC_FOLDER) l->known_bad = calloc((size_t)l->n, 1);
    if (!l->pool || !l->slots || (l->source == SRC_FOLDER && !l->known_bad)) s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  }
  if (s == DLUA_OK) {
    pthread_mutex_init(&l->pool->mu, NULL);
    l->pool->refs = 1;
    l->pool->bytes = l->sample_bytes * (size_t)l->batch;
    // Page-locked buffers let the GPU copy run asynchronously; without a GPU there is nothing to pin.
    l->pool->pinned = l->pin && dlua_cuda_device_count() > 0;
    l->pool->cap = l->nslots + 2;
    l->pool->free = calloc((size_t)l->pool->cap, sizeof(void *));
    if (!l->pool->free) s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
    for (int i = 0; i < l->nslots && s == DLUA_OK; i++) {
      l->slots[i].batch = -1;
      l->slots[i].labels = calloc((size_t)l->batch, sizeof(int64_t));
      l->slots[i].bad = calloc((size_t)l->batch, 1);
      if (!l->slots[i].labels || !l->slots[i].bad) s = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
    }
  }
  if (s != DLUA_OK) {
    if (l->pool && !l->pool->free) {
      free(l->pool);
      l->pool = NULL;
    }
    dlua_loader_free(l);
    return s;
  }
  *out = l;
  return DLUA_OK;
}

int dlua_loader_sample_shape(const dlua_loader_t *l, int64_t *sizes, int *dtype) {
  if (!l) return -1;
  for (int d = 0; d < l->sample_ndim; d++) sizes[d] = l->sample_sizes[d];
  if (dtype) *dtype = (int)l->dtype;
  return l->sample_ndim;
}

int64_t dlua_loader_dataset_size(const dlua_loader_t *l) { return l ? l->n : 0; }

/* ---- epochs ----------------------------------------------------------------------------------------- */

void dlua_loader_stop(dlua_loader_t *l) {
  if (!l || !l->active) return;
  pthread_mutex_lock(&l->mu);
  l->stop = 1;
  pthread_cond_broadcast(&l->cv_work);
  pthread_cond_broadcast(&l->cv_ready);
  pthread_mutex_unlock(&l->mu);
  for (int i = 0; i < l->nthreads; i++) pthread_join(l->threads[i], NULL);
  l->nthreads = 0;
  // Buffers of batches that were never delivered stay with their slots for the next epoch.
  for (int i = 0; i < l->nslots; i++) l->slots[i].batch = -1;
  l->active = 0;
  l->stop = 0;
}

dlua_status_t dlua_loader_start(dlua_loader_t *l, const int64_t *order, int64_t n, int64_t base, uint64_t epoch,
                                int drop_last) {
  if (!l) return DLUA_ERR(DLUA_ERR_ARG, "%s: loader is NULL", OP);
  dlua_loader_stop(l);
  if (n < 0 || (n && !order)) return DLUA_ERR(DLUA_ERR_ARG, "%s: bad sample order (%" PRId64 " entries)", OP, n);
  int64_t *o = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  if (!o) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for an order of %" PRId64 " samples", OP, n);
  for (int64_t i = 0; i < n; i++) {
    o[i] = order[i] - base;
    if (o[i] < 0 || o[i] >= l->n) {
      free(o);
      return DLUA_ERR(DLUA_ERR_ARG, "%s: the sampler gave sample %" PRId64 " at position %" PRId64
                      ", outside the dataset's %" PRId64 "..%" PRId64, OP, order[i], i + base, base, l->n - 1 + base);
    }
  }
  free(l->order);
  l->order = o;
  l->norder = n;
  l->epoch = epoch;
  l->nbatches = drop_last ? n / l->batch : (n + l->batch - 1) / l->batch;
  l->total = drop_last ? l->nbatches * l->batch : n;
  l->next_pos = 0;
  l->delivered = 0;
  l->err = DLUA_OK;
  l->errmsg[0] = '\0';
  l->stop = 0;
  l->active = 1;
  for (int i = 0; i < l->nslots; i++) l->slots[i].batch = -1;
  if (l->workers == 0 || l->total == 0) return DLUA_OK;
  int nt = l->workers;
  if (!l->threads) l->threads = calloc((size_t)l->workers, sizeof(pthread_t));
  if (!l->threads) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  // Workers take no asynchronous signal (faults stay deliverable): Ctrl-C goes to the main thread, which owns the
  // Lua state.
  sigset_t all, old;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  dlua_status_t s = DLUA_OK;
  for (int i = 0; i < nt; i++) {
    __atomic_add_fetch(&g_live_threads, 1, __ATOMIC_RELEASE);
    int e = pthread_create(&l->threads[i], NULL, worker_main, l);
    if (e != 0) {
      __atomic_sub_fetch(&g_live_threads, 1, __ATOMIC_RELEASE);
      s = DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot start worker thread %d of %d: %s", OP, i + 1, nt, strerror(e));
      break;
    }
    l->nthreads++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (s != DLUA_OK) dlua_loader_stop(l);
  return s;
}

/* workers == 0: the batch is made on the calling thread. */
static dlua_status_t fill_inline(dlua_loader_t *l, slot_t *slot, int64_t b) {
  if (!slot_init(l, slot, b)) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory allocating a batch buffer", OP);
  for (int row = 0; row < slot->count; row++) {
    if (dlua_interrupt_flag) {
      slot->batch = -1;
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted", OP);
    }
    int64_t pos = b * l->batch + row;
    int r = run_sample(l, &l->inline_scratch, l->order[pos], (char *)slot->buf + (size_t)row * l->sample_bytes,
                       &slot->labels[row]);
    if (r < 0) {
      char clean[sizeof l->errmsg];
      user_message(l->errmsg, clean, sizeof clean);
      return DLUA_ERR(l->err, "%s", clean);
    }
    if (r == 1) {
      slot->bad[row] = 1;
      slot->nbad++;
    }
    slot->done++;
  }
  l->next_pos = (b + 1) * l->batch;
  return DLUA_OK;
}

dlua_status_t dlua_loader_next(dlua_loader_t *l, dlua_tensor_t **x, dlua_tensor_t **y, int64_t *batch) {
  if (!l || !x) return DLUA_ERR(DLUA_ERR_ARG, "%s: loader or out is NULL", OP);
  *x = NULL;
  if (y) *y = NULL;
  if (batch) *batch = -1;
  if (!l->active) return DLUA_OK;
  double t0 = now_s();
  for (;;) {
    pthread_mutex_lock(&l->mu);
    slot_t *slot = NULL;
    int64_t b = l->delivered;
    for (;;) {
      if (l->err != DLUA_OK) {
        dlua_status_t st = l->err;
        char msg[sizeof l->errmsg];
        memcpy(msg, l->errmsg, sizeof msg);
        pthread_mutex_unlock(&l->mu);
        dlua_loader_stop(l);
        char clean[sizeof l->errmsg];
        user_message(msg, clean, sizeof clean);
        return DLUA_ERR(st, "%s", clean);
      }
      if (b >= l->nbatches) break;
      slot = &l->slots[b % l->nslots];
      if (l->workers == 0) break;
      if (slot->batch == b && slot->done == slot->count) break;
      if (dlua_interrupt_flag) {
        // Stopped here, not by the caller: the Lua hook raises as soon as this returns.
        pthread_mutex_unlock(&l->mu);
        dlua_loader_stop(l);
        return DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted while waiting for batch %" PRId64, OP, b + 1);
      }
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += 20 * 1000 * 1000;  // poll Ctrl-C every 20 ms
      if (until.tv_nsec >= 1000000000) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&l->cv_ready, &l->mu, &until);
    }
    if (b >= l->nbatches) {
      l->st_wait += now_s() - t0;
      pthread_mutex_unlock(&l->mu);
      dlua_loader_stop(l);  // the workers have finished: join them
      return DLUA_OK;
    }
    if (l->workers == 0) {
      pthread_mutex_unlock(&l->mu);
      dlua_status_t st = fill_inline(l, slot, b);
      if (st != DLUA_OK) {
        dlua_loader_stop(l);
        return st;
      }
      pthread_mutex_lock(&l->mu);
    }
    // Take the batch: its buffer, labels and skip flags are ours once the slot is released.
    void *buf = slot->buf;
    slot->buf = NULL;
    int count = slot->count, nbad = slot->nbad;
    int64_t *labels = malloc((size_t)count * sizeof(int64_t) + (size_t)count + 1);
    if (!labels) {
      slot->buf = buf;
      pthread_mutex_unlock(&l->mu);
      return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
    }
    uint8_t *bad = (uint8_t *)(labels + count);
    memcpy(labels, slot->labels, (size_t)count * sizeof(int64_t));
    memcpy(bad, slot->bad, (size_t)count);
    slot->batch = -1;
    l->delivered++;
    l->st_wait += now_s() - t0;
    pthread_cond_broadcast(&l->cv_work);
    pthread_mutex_unlock(&l->mu);

    int keep = count - nbad;
    if (nbad) {  // skipped samples: close the gaps, the batch is shorter
      int k = 0;
      for (int i = 0; i < count; i++) {
        if (bad[i]) continue;
        if (k != i) {
          memmove((char *)buf + (size_t)k * l->sample_bytes, (char *)buf + (size_t)i * l->sample_bytes, l->sample_bytes);
          labels[k] = labels[i];
        }
        k++;
      }
    }
    if (keep == 0) {  // every sample of the batch was bad: go on with the next one
      pool_put(l->pool, buf);
      free(labels);
      continue;
    }
    int64_t sizes[DLUA_MAX_DIMS];
    sizes[0] = keep;
    for (int d = 0; d < l->sample_ndim; d++) sizes[d + 1] = l->sample_sizes[d];
    // (N, C, H, W) over the NHWC bytes the workers wrote: strides (H*W*C, 1, W*C, C), no copy.
    int64_t cl[4] = {sizes[1] * sizes[2] * sizes[3], 1, sizes[3] * sizes[1], sizes[1]};
    pthread_mutex_lock(&l->pool->mu);
    l->pool->refs++;
    pthread_mutex_unlock(&l->pool->mu);
    dlua_status_t st = dlua_tensor_wrap(x, l->sample_ndim + 1, sizes, l->channels_last ? cl : NULL, l->dtype, buf,
                                        pool_deleter, l->pool);
    if (st != DLUA_OK) {
      pool_put(l->pool, buf);
      pool_release(l->pool);
      free(labels);
      return st;
    }
    if (y && (l->source != SRC_TENSOR || l->y)) {
      int64_t ys = keep;
      st = dlua_tensor_from_data(y, 1, &ys, DLUA_DTYPE_I64, labels);
      if (st != DLUA_OK) {
        dlua_tensor_free(*x);
        *x = NULL;
        free(labels);
        return st;
      }
    }
    free(labels);
    if (batch) *batch = b;
    pthread_mutex_lock(&l->mu);
    l->st_batches++;
    l->st_samples += keep;
    pthread_mutex_unlock(&l->mu);
    return DLUA_OK;
  }
}

void dlua_loader_get_stats(const dlua_loader_t *l, dlua_loader_stats_t *st) {
  memset(st, 0, sizeof *st);
  if (!l) return;
  dlua_loader_t *m = (dlua_loader_t *)l;
  pthread_mutex_lock(&m->mu);
  st->samples = l->st_samples;
  st->batches = l->st_batches;
  st->decoded = l->st_decoded;
  st->skipped = l->st_skipped;
  st->bad_files = l->st_bad;
  st->dct_scaled = l->st_scaled;
  st->wait_s = l->st_wait;
  st->work_s = l->st_work;
  st->threads = l->nthreads;
  st->epoch_active = l->active;
  pthread_mutex_unlock(&m->mu);
  pthread_mutex_lock(&l->pool->mu);
  st->buffers = l->pool->allocated;
  pthread_mutex_unlock(&l->pool->mu);
}

const char *dlua_loader_bad_file(const dlua_loader_t *l, int64_t i) {
  if (!l || i < 0 || i >= l->st_bad || i >= DLUA_LOADER_MAX_BAD_MESSAGES) return NULL;
  return l->bad_msgs[i];
}

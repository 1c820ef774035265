/* Checkpoint jobs: snapshots of tensors in host memory and the steps (files, signals, waits, removals) a save runs, on the caller's thread or a background one. */
#include "io/ckpt_job.h"
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "core/error.h"
#include "core/tensor.h"
#include "io/files.h"
#include "io/safetensors.h"
#include "core/runtime.h"

typedef enum { STEP_FILE, STEP_TEXT, STEP_SIGNAL, STEP_WAIT, STEP_REMOVE } step_kind_t;

/* One tensor of a file step: a snapshot in host memory, or a reference to the live tensor. */
typedef struct {
  char *name;
  int dtype, ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  dlua_tensor_t *ref; /* snapshot 0; 2 until copied */
  void *host;         /* snapshot 1 and 2: bytes, row-major */
  size_t bytes;
  int pinned;         /* host came from dlua_cuda_host_alloc */
  int deferred;       /* snapshot 2: ref is copied into host by the job's thread */
} item_t;

typedef struct {
  step_kind_t kind;
  char *path;         /* file, text, remove */
  int64_t n;
  item_t *items;
  int64_t nmeta;
  char **keys, **values;
  char *text;
  size_t text_len;
  dlua_store_t *store;
  int nkeys;
  char **store_keys;  /* signal: one; wait: nkeys */
  int64_t timeout_ms;
} step_t;

struct dlua_ckpt_job {
  step_t *steps;
  int nsteps, cap;
  pthread_t thread;
  int started, joined, in_background;
  int done;              /* atomic */
  dlua_status_t status;
  char message[2048];
  int64_t snap_bytes;    /* atomic */
  int ndeferred;         /* snapshot = 2 tensors not yet copied */
  int snap_ready;        /* under lock: the deferred copies are done */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int64_t snap_peak;
  double seconds;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void free_item(dlua_ckpt_job_t *job, item_t *it) {
  if (it->deferred) {
    it->deferred = 0;
    job->ndeferred--;
  }
  free(it->name);
  it->name = NULL;
  if (it->ref) dlua_tensor_free(it->ref);
  it->ref = NULL;
  if (it->host) {
    if (it->pinned) {
      if (dlua_cuda_host_free(it->host) != DLUA_OK) dlua_clear_error();
    } else {
      dlua_cpu_free(it->host, it->bytes);
    }
    __atomic_sub_fetch(&job->snap_bytes, (int64_t)it->bytes, __ATOMIC_RELAXED);
    it->host = NULL;
  }
}

static void free_step(dlua_ckpt_job_t *job, step_t *st) {
  for (int64_t i = 0; i < st->n; i++) free_item(job, &st->items[i]);
  free(st->items);
  for (int64_t k = 0; k < st->nmeta; k++) {
    free(st->keys[k]);
    free(st->values[k]);
  }
  free(st->keys);
  free(st->values);
  for (int k = 0; k < st->nkeys; k++) free(st->store_keys[k]);
  free(st->store_keys);
  free(st->path);
  free(st->text);
  memset(st, 0, sizeof *st);
}

dlua_status_t dlua_ckpt_job_new(dlua_ckpt_job_t **out) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: out is NULL");
  *out = calloc(1, sizeof **out);
  if (!*out) return DLUA_ERR(DLUA_ERR_OOM, "checkpoint job: out of memory");
  (*out)->done = 1;
  (*out)->snap_ready = 1;
  pthread_mutex_init(&(*out)->lock, NULL);
  pthread_cond_init(&(*out)->cond, NULL);
  return DLUA_OK;
}

static dlua_status_t new_step(dlua_ckpt_job_t *job, step_kind_t kind, step_t **out) {
  if (!job) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: NULL");
  if (job->started) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: already started");
  if (job->nsteps == job->cap) {
    int cap = job->cap ? 2 * job->cap : 8;
    step_t *ns = realloc(job->steps, (size_t)cap * sizeof *ns);
    if (!ns) return DLUA_ERR(DLUA_ERR_OOM, "checkpoint job: out of memory");
    job->steps = ns;
    job->cap = cap;
  }
  step_t *st = &job->steps[job->nsteps++];
  memset(st, 0, sizeof *st);
  st->kind = kind;
  *out = st;
  return DLUA_OK;
}

/* dst <- the logical bytes of t; large contiguous CPU copies run on all threads. */
static dlua_status_t copy_out(const dlua_tensor_t *t, void *dst, size_t bytes) {
  if (bytes == 0) return DLUA_OK;
  if (t->device != DLUA_CPU || !dlua_tensor_is_contiguous(t) || bytes <= DLUA_CKPT_COPY_CHUNK) return dlua_tensor_to_data(t, dst, bytes);
  const char *src = dlua_tensor_ptr(t);
  int64_t chunks = (int64_t)((bytes + DLUA_CKPT_COPY_CHUNK - 1) / DLUA_CKPT_COPY_CHUNK);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    size_t off = (size_t)c * DLUA_CKPT_COPY_CHUNK;
    size_t k = bytes - off < DLUA_CKPT_COPY_CHUNK ? bytes - off : DLUA_CKPT_COPY_CHUNK;
    memcpy((char *)dst + off, src + off, k);
  }
  return DLUA_OK;
}

dlua_status_t dlua_ckpt_job_add_file(dlua_ckpt_job_t *job, const char *path, int64_t n, const char *const *names,
                                     dlua_tensor_t *const *tensors, int64_t nmeta, const char *const *keys,
                                     const char *const *values, const int *snapshot) {
  if (!path || n < 0 || (n > 0 && (!names || !tensors)) || nmeta < 0 || (nmeta > 0 && (!keys || !values)))
    return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: bad arguments for a file");
  step_t *st = NULL;
  DLUA_TRY(new_step(job, STEP_FILE, &st));
  dlua_status_t s = DLUA_OK;
  st->path = strdup(path);
  st->items = calloc((size_t)(n ? n : 1), sizeof *st->items);
  st->keys = calloc((size_t)(nmeta ? nmeta : 1), sizeof(char *));
  st->values = calloc((size_t)(nmeta ? nmeta : 1), sizeof(char *));
  if (!st->path || !st->items || !st->keys || !st->values) s = DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory", path);
  for (int64_t k = 0; s == DLUA_OK && k < nmeta; k++) {
    st->keys[k] = strdup(keys[k] ? keys[k] : "");
    st->values[k] = strdup(values[k] ? values[k] : "");
    st->nmeta = k + 1;
    if (!st->keys[k] || !st->values[k]) s = DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory", path);
  }
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) {
    const dlua_tensor_t *t = tensors[i];
    item_t *it = &st->items[i];
    st->n = i + 1;
    if (!t || !t->storage) {
      s = DLUA_ERR(DLUA_ERR_ARG, "checkpoint %s: tensor '%s' is NULL (freed?)", path, names[i] ? names[i] : "?");
      break;
    }
    it->name = strdup(names[i] ? names[i] : "");
    if (!it->name) {
      s = DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory", path);
      break;
    }
    it->dtype = (int)t->dtype;
    it->ndim = t->ndim;
    memcpy(it->sizes, t->sizes, sizeof it->sizes);
    it->bytes = (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype);
    int mode = snapshot ? snapshot[i] : 0;
    if (mode == 2 && t->device != DLUA_CPU) mode = 1;  // device memory: copied now (a stream orders it, not a promise)
    if (mode < 0 || mode > 2) {
      s = DLUA_ERR(DLUA_ERR_ARG, "checkpoint %s: snapshot mode %d for '%s' (0, 1 or 2)", path, mode, it->name);
      break;
    }
    if (mode != 1) {
      it->ref = dlua_tensor_alias(t);  // keeps the storage alive until written (or copied)
      if (!it->ref) {
        s = DLUA_ERR_OOM;
        break;
      }
      if (mode == 0) continue;
      it->deferred = 1;
      job->ndeferred++;
    }
    if (t->device != DLUA_CPU) {
      // Pinned, so the device-to-host copy runs at full speed.
      s = dlua_cuda_host_alloc(&it->host, it->bytes ? it->bytes : 1);
      it->pinned = s == DLUA_OK;
    } else {
      it->host = dlua_cpu_alloc(it->bytes);
      if (!it->host) s = DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory for the snapshot of '%s' (%zu bytes)", path, it->name, it->bytes);
    }
    if (s != DLUA_OK) break;
    int64_t now = __atomic_add_fetch(&job->snap_bytes, (int64_t)it->bytes, __ATOMIC_RELAXED);
    if (now > job->snap_peak) job->snap_peak = now;
    if (!it->deferred) s = copy_out(t, it->host, it->bytes);
  }
  if (s != DLUA_OK) {
    free_step(job, st);
    job->nsteps--;
  }
  return s;
}

dlua_status_t dlua_ckpt_job_add_text(dlua_ckpt_job_t *job, const char *path, const char *data, size_t len) {
  if (!path || (!data && len)) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: bad arguments for a text file");
  step_t *st = NULL;
  DLUA_TRY(new_step(job, STEP_TEXT, &st));
  st->path = strdup(path);
  st->text = malloc(len ? len : 1);
  if (!st->path || !st->text) {
    free_step(job, st);
    job->nsteps--;
    return DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory", path);
  }
  if (len) memcpy(st->text, data, len);
  st->text_len = len;
  return DLUA_OK;
}

static dlua_status_t add_keys(dlua_ckpt_job_t *job, step_kind_t kind, dlua_store_t *store, int n, const char *const *keys, int64_t timeout_ms) {
  if (!store || n < 1 || !keys) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: a store and keys are needed");
  step_t *st = NULL;
  DLUA_TRY(new_step(job, kind, &st));
  st->store = store;
  st->timeout_ms = timeout_ms;
  st->store_keys = calloc((size_t)n, sizeof(char *));
  dlua_status_t s = st->store_keys ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "checkpoint job: out of memory");
  for (int k = 0; s == DLUA_OK && k < n; k++) {
    st->store_keys[k] = strdup(keys[k] ? keys[k] : "");
    st->nkeys = k + 1;
    if (!st->store_keys[k]) s = DLUA_ERR(DLUA_ERR_OOM, "checkpoint job: out of memory");
  }
  if (s != DLUA_OK) {
    free_step(job, st);
    job->nsteps--;
  }
  return s;
}

dlua_status_t dlua_ckpt_job_add_signal(dlua_ckpt_job_t *job, dlua_store_t *store, const char *key) {
  return add_keys(job, STEP_SIGNAL, store, 1, &key, -1);
}

dlua_status_t dlua_ckpt_job_add_wait(dlua_ckpt_job_t *job, dlua_store_t *store, int n, const char *const *keys, int64_t timeout_ms) {
  return add_keys(job, STEP_WAIT, store, n, keys, timeout_ms);
}

dlua_status_t dlua_ckpt_job_add_remove(dlua_ckpt_job_t *job, const char *dir) {
  if (!dir) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: a directory is needed");
  step_t *st = NULL;
  DLUA_TRY(new_step(job, STEP_REMOVE, &st));
  st->path = strdup(dir);
  if (!st->path) {
    job->nsteps--;
    return DLUA_ERR(DLUA_ERR_OOM, "checkpoint job: out of memory");
  }
  return DLUA_OK;
}

/* ---- running -------------------------------------------------------------------------------------- */

static dlua_status_t run_file(dlua_ckpt_job_t *job, step_t *st) {
  int64_t n = st->n;
  const char **names = malloc((size_t)(n ? n : 1) * sizeof *names);
  int *dtypes = malloc((size_t)(n ? n : 1) * sizeof *dtypes);
  int *ndims = malloc((size_t)(n ? n : 1) * sizeof *ndims);
  int64_t *sizes = malloc((size_t)(n ? n : 1) * DLUA_MAX_DIMS * sizeof *sizes);
  dlua_status_t s = names && dtypes && ndims && sizes ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "checkpoint %s: out of memory", st->path);
  int64_t k = 0;
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) {
    names[i] = st->items[i].name;
    dtypes[i] = st->items[i].dtype;
    ndims[i] = st->items[i].ndim;
    for (int d = 0; d < ndims[i]; d++) sizes[k++] = st->items[i].sizes[d];
  }
  dlua_st_writer_t *w = NULL;
  if (s == DLUA_OK)
    s = dlua_st_writer_open(&w, st->path, n, names, dtypes, ndims, sizes, st->nmeta, (const char *const *)st->keys,
                            (const char *const *)st->values);
  free(names);
  free(dtypes);
  free(ndims);
  free(sizes);
  if (s == DLUA_OK) dlua_st_writer_set_interruptible(w, !job->in_background);
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) {
    item_t *it = &st->items[i];
    s = it->host ? dlua_st_writer_put_bytes(w, i, it->host, it->bytes) : dlua_st_writer_put(w, i, it->ref);
    free_item(job, it);  // the snapshot memory goes as soon as it is on its way to the disk
  }
  if (s == DLUA_OK) s = dlua_st_writer_commit(w);
  dlua_st_writer_free(w);
  return s;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static dlua_status_t run_wait(step_t *st) {
  int *exists = calloc((size_t)st->nkeys, sizeof *exists);
  if (!exists) return DLUA_ERR(DLUA_ERR_OOM, "checkpoint: out of memory");
  double deadline = st->timeout_ms < 0 ? -1 : now_s() + (double)st->timeout_ms / 1000.0;
  dlua_status_t s = DLUA_OK;
  for (;;) {
    s = dlua_store_check(st->store, (const char *const *)st->store_keys, st->nkeys, exists);
    if (s != DLUA_OK) break;
    int all = 1;
    for (int k = 0; k < st->nkeys; k++) all &= exists[k];
    if (all) break;
    if (deadline >= 0 && now_s() > deadline) {
      for (int k = 0; k < st->nkeys; k++)
        if (!exists[k]) {
          s = DLUA_ERR(DLUA_ERR_TIMEOUT, "checkpoint: gave up after %.0f s waiting for '%s' (a rank did not finish its part)",
                       (double)st->timeout_ms / 1000.0, st->store_keys[k]);
          break;
        }
      break;
    }
    sleep_ms(DLUA_CKPT_POLL_MS);
  }
  free(exists);
  for (int k = 0; s == DLUA_OK && k < st->nkeys; k++) {
    void *v = NULL;
    size_t len = 0;
    s = dlua_store_get(st->store, st->store_keys[k], 1000, &v, &len);
    if (s != DLUA_OK) break;
    int ok = len == 2 && !memcmp(v, "ok", 2);
    if (!ok) s = DLUA_ERR(DLUA_ERR_IO, "checkpoint: '%s' failed: %.*s", st->store_keys[k], (int)(len > 1500 ? 1500 : len), (const char *)v);
    dlua_store_free_value(v);
    if (dlua_store_delete(st->store, st->store_keys[k], NULL) != DLUA_OK && s == DLUA_OK) s = DLUA_ERR_IO;
  }
  return s;
}

/* The deferred copies (snapshot 2), before anything is written; then the caller may go on. */
static dlua_status_t take_deferred(dlua_ckpt_job_t *job) {
  dlua_status_t s = DLUA_OK;
  for (int i = 0; i < job->nsteps; i++) {
    step_t *st = &job->steps[i];
    for (int64_t k = 0; st->kind == STEP_FILE && k < st->n; k++) {
      item_t *it = &st->items[k];
      if (!it->deferred) continue;
      if (s == DLUA_OK) s = dlua_tensor_to_data(it->ref, it->host, it->bytes);
      dlua_tensor_free(it->ref);
      it->ref = NULL;
      it->deferred = 0;
      job->ndeferred--;
    }
  }
  pthread_mutex_lock(&job->lock);
  job->snap_ready = 1;
  pthread_cond_broadcast(&job->cond);
  pthread_mutex_unlock(&job->lock);
  return s;
}

void dlua_ckpt_job_wait_snapshot(dlua_ckpt_job_t *job) {
  if (!job) return;
  pthread_mutex_lock(&job->lock);
  while (!job->snap_ready) pthread_cond_wait(&job->cond, &job->lock);
  pthread_mutex_unlock(&job->lock);
}

static void run_steps(dlua_ckpt_job_t *job) {
  double t0 = now_s();
  dlua_status_t s = take_deferred(job);
  if (s != DLUA_OK) snprintf(job->message, sizeof job->message, "%s", dlua_last_error());
  for (int i = 0; i < job->nsteps; i++) {
    step_t *st = &job->steps[i];
    if (st->kind == STEP_SIGNAL) {
      const char *v = s == DLUA_OK ? "ok" : job->message;
      if (dlua_store_set(st->store, st->store_keys[0], v, strlen(v)) != DLUA_OK && s == DLUA_OK) {
        s = dlua_last_status();
        snprintf(job->message, sizeof job->message, "%s", dlua_last_error());
      }
      continue;
    }
    if (s != DLUA_OK) {
      free_step(job, st);  // skipped: its snapshot is released all the same
      continue;
    }
    switch (st->kind) {
      case STEP_FILE: s = run_file(job, st); break;
      case STEP_TEXT: s = dlua_io_write_file(st->path, st->text, st->text_len); break;
      case STEP_WAIT: s = run_wait(st); break;
      case STEP_REMOVE: s = dlua_io_remove_dir(st->path); break;
      default: break;
    }
    if (s != DLUA_OK) snprintf(job->message, sizeof job->message, "%s", dlua_last_error());
    free_step(job, st);
  }
  job->status = s;
  job->seconds = now_s() - t0;
  __atomic_store_n(&job->done, 1, __ATOMIC_RELEASE);
}

/* Raises the job's message on the calling thread, keeping the file:line where it was first recorded. */
static dlua_status_t reraise(const dlua_ckpt_job_t *job) {
  const char *m = job->message;
  const char *at = strrchr(m, '(');
  const char *colon = at ? strrchr(at, ':') : NULL;
  size_t len = strlen(m);
  if (at && colon && at > m && at[-1] == ' ' && len > 0 && m[len - 1] == ')') {
    char file[256];
    snprintf(file, sizeof file, "%.*s", (int)(colon - at - 1), at + 1);
    return dlua_error_set(job->status, file, atoi(colon + 1), "%.*s", (int)(at - 1 - m), m);
  }
  return dlua_error_set(job->status, __FILE__, __LINE__, "%s", m);
}

dlua_status_t dlua_ckpt_job_run(dlua_ckpt_job_t *job) {
  if (!job) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: NULL");
  if (job->started) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: already started");
  job->started = job->joined = 1;
  job->done = 0;
  run_steps(job);
  if (job->status != DLUA_OK) return reraise(job);
  return DLUA_OK;
}

static void *thread_main(void *arg) {
  dlua_thread_name("dlua-ckpt");
  run_steps(arg);
  return NULL;
}

dlua_status_t dlua_ckpt_job_start(dlua_ckpt_job_t *job) {
  if (!job) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: NULL");
  if (job->started) return DLUA_ERR(DLUA_ERR_ARG, "checkpoint job: already started");
  job->in_background = 1;
  job->done = 0;
  job->snap_ready = job->ndeferred == 0;
  // Signals stay with the main thread (Ctrl-C must reach the training loop, not the writer).
  sigset_t all, old;
  dlua_async_signals(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  int rc = pthread_create(&job->thread, NULL, thread_main, job);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    job->done = 1;
    job->snap_ready = 1;
    return DLUA_ERR(DLUA_ERR_BACKEND, "checkpoint: cannot start the writer thread: %s", strerror(rc));
  }
  job->started = 1;
  return DLUA_OK;
}

int dlua_ckpt_job_done(const dlua_ckpt_job_t *job) { return !job || __atomic_load_n(&job->done, __ATOMIC_ACQUIRE); }

dlua_status_t dlua_ckpt_job_wait(dlua_ckpt_job_t *job) {
  if (!job) return DLUA_OK;
  if (job->started && !job->joined) {
    pthread_join(job->thread, NULL);
    job->joined = 1;
  }
  if (job->status != DLUA_OK) return reraise(job);
  return DLUA_OK;
}

int64_t dlua_ckpt_job_snapshot_bytes(const dlua_ckpt_job_t *job) { return job ? __atomic_load_n(&job->snap_bytes, __ATOMIC_RELAXED) : 0; }
int64_t dlua_ckpt_job_snapshot_peak(const dlua_ckpt_job_t *job) { return job ? job->snap_peak : 0; }
double dlua_ckpt_job_seconds(const dlua_ckpt_job_t *job) { return job ? job->seconds : 0; }

void dlua_ckpt_job_free(dlua_ckpt_job_t *job) {
  if (!job) return;
  if (job->started && !job->joined) pthread_join(job->thread, NULL);
  for (int i = 0; i < job->nsteps; i++) free_step(job, &job->steps[i]);
  free(job->steps);
  pthread_mutex_destroy(&job->lock);
  pthread_cond_destroy(&job->cond);
  free(job);
}

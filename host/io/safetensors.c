/* safetensors files: the writer (temporary file, checksums, fsync, rename) and the mmap reader that checks everything before use. */
#define _GNU_SOURCE /* sync_file_range */
#include "io/safetensors.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/error.h"
#include "core/tensor.h"
#include "io/files.h"

/* The JSON header may not be larger (the reference implementation's limit too). */
#define MAX_HEADER ((uint64_t)100000000)
/* Integers in the header travel as JSON numbers (doubles): exact up to 2^53. */
#define MAX_EXACT 9007199254740992.0

static const char *const st_names[DLUA_DTYPE_COUNT] = {
    [DLUA_DTYPE_F32] = "F32", [DLUA_DTYPE_F64] = "F64", [DLUA_DTYPE_F16] = "F16", [DLUA_DTYPE_BF16] = "BF16",
    [DLUA_DTYPE_I32] = "I32", [DLUA_DTYPE_I64] = "I64", [DLUA_DTYPE_U8] = "U8",   [DLUA_DTYPE_BOOL] = "BOOL",
};

int dlua_ckpt_available(void) { return 1; }

const char *dlua_st_dtype_name(int dtype) {
  return dtype >= 0 && dtype < DLUA_DTYPE_COUNT ? st_names[dtype] : NULL;
}

int dlua_st_dtype_from_name(const char *name) {
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++)
    if (name && !strcmp(name, st_names[d])) return d;
  return -1;
}

typedef struct {
  char *name;
  int dtype, ndim;
  int64_t sizes[DLUA_MAX_DIMS];
  uint64_t begin, end; /* bytes, from the start of the data */
  uint32_t crc;
  int has_crc;
  int state; /* reader: 0 unchecked, 1 checksum good, -1 bad; writer: 1 once written */
} entry_t;

static void free_entries(entry_t *e, int64_t n) {
  if (!e) return;
  for (int64_t i = 0; i < n; i++) free(e[i].name);
  free(e);
}

static const char *shape_of(const entry_t *e, char *buf, size_t len) { return dlua_shape_str(e->ndim, e->sizes, buf, len); }

/* ---- writer -------------------------------------------------------------------------------------- */

struct dlua_st_writer {
  char *path, *tmp;
  int fd;
  int interruptible;
  int64_t n;
  entry_t *e;        /* in file order */
  int64_t *by_input; /* input position -> file position */
  cJSON *header;     /* printed twice: with placeholder checksums at open, the real ones at commit */
  cJSON *crc_item;   /* the "dlua.crc32" string inside header.__metadata__ */
  uint64_t header_len; /* N, padding included */
  uint64_t data_bytes;
  int committed;
};

static int by_size_then_name(const void *a, const void *b) {
  const entry_t *x = a, *y = b;
  size_t sx = dlua_dtype_size(x->dtype), sy = dlua_dtype_size(y->dtype);
  if (sx != sy) return sx > sy ? -1 : 1;
  return strcmp(x->name, y->name);
}

static int by_name(const void *a, const void *b) { return strcmp((*(const entry_t *const *)a)->name, (*(const entry_t *const *)b)->name); }

/* The "dlua.crc32" text: {"name": "8 hex digits", ...} in file order (fixed length for given names). */
static char *crc_text(const dlua_st_writer_t *w, int placeholder) {
  cJSON *o = cJSON_CreateObject();
  if (!o) return NULL;
  for (int64_t i = 0; i < w->n; i++) {
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", placeholder ? 0u : w->e[i].crc);
    if (!cJSON_AddStringToObject(o, w->e[i].name, hex)) {
      cJSON_Delete(o);
      return NULL;
    }
  }
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

/* Prints the header with the current checksum text, padded so the data starts at a multiple of DLUA_ST_ALIGN. */
static dlua_status_t print_header(dlua_st_writer_t *w, char **out, uint64_t *len) {
  char *json = cJSON_PrintUnformatted(w->header);
  if (!json) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory printing the header", w->path);
  uint64_t k = strlen(json);
  uint64_t total = (8 + k + DLUA_ST_ALIGN - 1) / DLUA_ST_ALIGN * DLUA_ST_ALIGN;
  char *buf = malloc(total);
  if (!buf) {
    free(json);
    return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory for a header of %llu bytes", w->path, (unsigned long long)total);
  }
  uint64_t n = total - 8;
  for (int b = 0; b < 8; b++) buf[b] = (char)(n >> (8 * b) & 0xff); /* little-endian u64 */
  memcpy(buf + 8, json, k);
  memset(buf + 8 + k, ' ', total - 8 - k);
  free(json);
  *out = buf;
  *len = total;
  return DLUA_OK;
}

void dlua_st_writer_set_interruptible(dlua_st_writer_t *w, int on) {
  if (w) w->interruptible = on;
}

void dlua_st_writer_free(dlua_st_writer_t *w) {
  if (!w) return;
  if (w->fd >= 0) close(w->fd);
  if (!w->committed && w->tmp) unlink(w->tmp);
  free(w->path);
  free(w->tmp);
  free_entries(w->e, w->n);
  free(w->by_input);
  cJSON_Delete(w->header);
  free(w);
}

static dlua_status_t build_header(dlua_st_writer_t *w, int64_t nmeta, const char *const *keys, const char *const *values) {
  cJSON *h = cJSON_CreateObject();
  w->header = h;
  cJSON *meta = h ? cJSON_AddObjectToObject(h, "__metadata__") : NULL;
  if (!meta) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory building the header", w->path);
  int has_format = 0;
  for (int64_t k = 0; k < nmeta; k++) {
    if (!keys || !values || !keys[k] || !values[k])
      return DLUA_ERR(DLUA_ERR_ARG, "writing %s: metadata entry %lld is NULL", w->path, (long long)k + 1);
    if (!strcmp(keys[k], "dlua.crc32"))
      return DLUA_ERR(DLUA_ERR_ARG, "writing %s: metadata key 'dlua.crc32' is reserved for the checksums", w->path);
    if (cJSON_GetObjectItemCaseSensitive(meta, keys[k]))
      return DLUA_ERR(DLUA_ERR_ARG, "writing %s: metadata key '%s' given twice", w->path, keys[k]);
    if (!strcmp(keys[k], "format")) has_format = 1;
    if (!cJSON_AddStringToObject(meta, keys[k], values[k])) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory", w->path);
  }
  // PyTorch's safetensors writes format "pt"; transformers checks it before loading a file.
  if (!has_format && !cJSON_AddStringToObject(meta, "format", "pt")) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory", w->path);
  char *crcs = crc_text(w, 1);
  w->crc_item = crcs ? cJSON_AddStringToObject(meta, "dlua.crc32", crcs) : NULL;
  free(crcs);
  if (!w->crc_item) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory", w->path);
  for (int64_t i = 0; i < w->n; i++) {
    const entry_t *e = &w->e[i];
    // Keys in the reference writer's order: dtype, shape, data_offsets.
    cJSON *t = cJSON_AddObjectToObject(h, e->name);
    if (t && !cJSON_AddStringToObject(t, "dtype", st_names[e->dtype])) t = NULL;
    cJSON *shape = t ? cJSON_AddArrayToObject(t, "shape") : NULL;
    cJSON *offs = NULL;
    if (shape)
      for (int d = 0; d < e->ndim; d++)
        if (!cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e->sizes[d]))) shape = NULL;
    if (t && shape) offs = cJSON_AddArrayToObject(t, "data_offsets");
    if (offs && (!cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)e->begin)) ||
                 !cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)e->end))))
      offs = NULL;
    if (!offs) return DLUA_ERR(DLUA_ERR_OOM, "writing %s: out of memory building the header", w->path);
  }
  return DLUA_OK;
}

dlua_status_t dlua_st_writer_open(dlua_st_writer_t **out, const char *path, int64_t n, const char *const *names,
                                  const int *dtypes, const int *ndims, const int64_t *sizes, int64_t nmeta,
                                  const char *const *keys, const char *const *values) {
  if (!out || !path || !*path || n < 0 || (n > 0 && (!names || !dtypes || !ndims)) || nmeta < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "save: bad arguments (path, names, dtypes and shapes are required)");
  *out = NULL;
  dlua_st_writer_t *w = calloc(1, sizeof *w);
  if (!w) return DLUA_ERR(DLUA_ERR_OOM, "save: out of memory");
  w->fd = -1;
  w->interruptible = 1;
  w->n = n;
  w->path = strdup(path);
  w->e = calloc((size_t)(n > 0 ? n : 1), sizeof *w->e);
  w->by_input = malloc((size_t)(n > 0 ? n : 1) * sizeof *w->by_input);
  dlua_status_t s = (w->path && w->e && w->by_input) ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory", path);
  // Entries carry their input position in `crc` until sorted (then reset).
  int64_t so = 0;
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) {
    entry_t *e = &w->e[i];
    if (!names[i] || !*names[i]) {
      s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor %lld has an empty name", path, (long long)i + 1);
      break;
    }
    if (!strcmp(names[i], "__metadata__")) {
      s = DLUA_ERR(DLUA_ERR_ARG, "save %s: '__metadata__' cannot name a tensor (the format reserves it)", path);
      break;
    }
    e->name = strdup(names[i]);
    e->dtype = dtypes[i];
    e->ndim = ndims[i];
    e->crc = (uint32_t)i;
    if (!e->name) {
      s = DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory", path);
    } else if (e->dtype < 0 || e->dtype >= DLUA_DTYPE_COUNT) {
      s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' has an unknown dtype %d", path, e->name, e->dtype);
    } else if (e->ndim < 0 || e->ndim > DLUA_MAX_DIMS) {
      s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' has %d dimensions (at most %d)", path, e->name, e->ndim, DLUA_MAX_DIMS);
    } else {
      for (int d = 0; d < e->ndim; d++) {
        e->sizes[d] = sizes[so++];
        if (e->sizes[d] < 0) s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' has a negative size", path, e->name);
      }
    }
  }
  if (s == DLUA_OK && n > 1) {
    entry_t **idx = malloc((size_t)n * sizeof *idx);
    if (!idx) {
      s = DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory", path);
    } else {
      for (int64_t i = 0; i < n; i++) idx[i] = &w->e[i];
      qsort(idx, (size_t)n, sizeof *idx, by_name);
      for (int64_t i = 1; i < n && s == DLUA_OK; i++)
        if (!strcmp(idx[i]->name, idx[i - 1]->name)) s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor name '%s' given twice", path, idx[i]->name);
      free(idx);
    }
  }
  if (s == DLUA_OK) {
    qsort(w->e, (size_t)n, sizeof *w->e, by_size_then_name);
    uint64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
      entry_t *e = &w->e[i];
      w->by_input[e->crc] = i;
      e->crc = 0;
      uint64_t bytes = dlua_dtype_size(e->dtype);
      for (int d = 0; d < e->ndim; d++)
        if (__builtin_mul_overflow(bytes, (uint64_t)e->sizes[d], &bytes)) s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' is too large", path, e->name);
      e->begin = off;
      e->end = off + bytes;
      off = e->end;
      if ((double)off > MAX_EXACT) s = DLUA_ERR(DLUA_ERR_ARG, "save %s: more than 2^53 bytes of tensors", path);
    }
    w->data_bytes = off;
  }
  if (s == DLUA_OK) s = build_header(w, nmeta, keys, values);
  char *hdr = NULL;
  if (s == DLUA_OK) s = print_header(w, &hdr, &w->header_len);
  if (s == DLUA_OK && w->header_len - 8 > MAX_HEADER)
    s = DLUA_ERR(DLUA_ERR_ARG, "save %s: the header would take %llu bytes (safetensors allows %llu)", path,
                 (unsigned long long)(w->header_len - 8), (unsigned long long)MAX_HEADER);
  if (s == DLUA_OK) {
    w->tmp = dlua_io_temp_name(path);
    if (!w->tmp) s = DLUA_ERR_OOM;
  }
  if (s == DLUA_OK) {
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (w->fd < 0) s = DLUA_ERR(DLUA_ERR_IO, "save: creating %s (beside %s): %s", w->tmp, path, strerror(errno));
  }
  // The placeholder header now, so a file whose commit never came is not even parseable as complete.
  if (s == DLUA_OK) s = dlua_io_pwrite_all(w->fd, hdr, w->header_len, 0, w->tmp);
  free(hdr);
  if (s != DLUA_OK) {
    dlua_st_writer_free(w);
    return s;
  }
  *out = w;
  return DLUA_OK;
}

static dlua_status_t write_chunks(dlua_st_writer_t *w, entry_t *e, const char *p, uint64_t bytes) {
  uint64_t off = w->header_len + e->begin;
  uint32_t crc = 0;
  for (uint64_t done = 0; done < bytes;) {
    if (w->interruptible && dlua_interrupt_pending())
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "save %s: interrupted while writing tensor '%s'", w->path, e->name);
    uint64_t k = bytes - done < DLUA_ST_CHUNK ? bytes - done : DLUA_ST_CHUNK;
    crc = dlua_crc32(crc, p + done, k);
    DLUA_TRY(dlua_io_pwrite_all(w->fd, p + done, k, (off_t)(off + done), w->tmp));
    // Start the write-back now (no wait): the disk then writes while the next chunk is summed,
    // and the final fsync has little left to do.
    sync_file_range(w->fd, (off_t)(off + done), (off_t)k, SYNC_FILE_RANGE_WRITE);
    done += k;
  }
  e->crc = crc;
  e->state = 1;
  return DLUA_OK;
}

static dlua_status_t check_index(dlua_st_writer_t *w, int64_t i, entry_t **e) {
  if (!w) return DLUA_ERR(DLUA_ERR_ARG, "save: the writer is NULL");
  if (w->committed) return DLUA_ERR(DLUA_ERR_ARG, "save %s: already committed", w->path);
  if (i < 0 || i >= w->n) return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor %lld of %lld", w->path, (long long)i + 1, (long long)w->n);
  *e = &w->e[w->by_input[i]];
  return DLUA_OK;
}

dlua_status_t dlua_st_writer_put_bytes(dlua_st_writer_t *w, int64_t i, const void *data, size_t bytes) {
  entry_t *e = NULL;
  DLUA_TRY(check_index(w, i, &e));
  if (bytes != e->end - e->begin)
    return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' takes %llu bytes, got %zu", w->path, e->name,
                    (unsigned long long)(e->end - e->begin), bytes);
  if (bytes && !data) return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s': no data", w->path, e->name);
  return write_chunks(w, e, data, bytes);
}

dlua_status_t dlua_st_writer_put(dlua_st_writer_t *w, int64_t i, const dlua_tensor_t *t) {
  entry_t *e = NULL;
  DLUA_TRY(check_index(w, i, &e));
  char b1[200], b2[200];
  if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' is NULL (freed?)", w->path, e->name);
  int same = (int)t->dtype == e->dtype && t->ndim == e->ndim;
  for (int d = 0; same && d < e->ndim; d++) same = t->sizes[d] == e->sizes[d];
  if (!same)
    return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' was declared %s %s, got %s", w->path, e->name, shape_of(e, b1, sizeof b1),
                    dlua_dtype_name(e->dtype), dlua_tensor_describe(t, b2, sizeof b2));
  uint64_t bytes = e->end - e->begin;
  if (bytes == 0) {
    e->state = 1;
    return DLUA_OK;
  }
  if (t->device == DLUA_CPU && dlua_tensor_is_contiguous(t)) return write_chunks(w, e, dlua_tensor_ptr(t), bytes);
  // Another layout or device: its logical row-major bytes, staged once in host memory.
  void *buf = dlua_cpu_alloc(bytes);
  if (!buf) return DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory staging tensor '%s' (%llu bytes)", w->path, e->name, (unsigned long long)bytes);
  dlua_status_t s = dlua_tensor_to_data(t, buf, bytes);
  if (s == DLUA_OK) s = write_chunks(w, e, buf, bytes);
  dlua_cpu_free(buf, bytes);
  return s;
}

dlua_status_t dlua_st_writer_commit(dlua_st_writer_t *w) {
  if (!w) return DLUA_ERR(DLUA_ERR_ARG, "save: the writer is NULL");
  if (w->committed) return DLUA_ERR(DLUA_ERR_ARG, "save %s: already committed", w->path);
  for (int64_t i = 0; i < w->n; i++)
    if (!w->e[i].state) return DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' was never written", w->path, w->e[i].name);
  char *crcs = crc_text(w, 0);
  if (!crcs || !cJSON_SetValuestring(w->crc_item, crcs)) {
    free(crcs);
    return DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory", w->path);
  }
  free(crcs);
  char *hdr = NULL;
  uint64_t len = 0;
  DLUA_TRY(print_header(w, &hdr, &len));
  dlua_status_t s = DLUA_OK;
  if (len != w->header_len)  // checksums are fixed-width: the header cannot have moved
    s = DLUA_ERR(DLUA_ERR_INTERNAL, "save %s: the header changed size (%llu -> %llu bytes)", w->path,
                 (unsigned long long)w->header_len, (unsigned long long)len);
  if (s == DLUA_OK) s = dlua_io_pwrite_all(w->fd, hdr, len, 0, w->tmp);
  free(hdr);
  // A file shorter than its header says (the last tensors empty) still needs its full length.
  if (s == DLUA_OK && ftruncate(w->fd, (off_t)(w->header_len + w->data_bytes)) != 0)
    s = DLUA_ERR(DLUA_ERR_IO, "save %s: sizing %s: %s", w->path, w->tmp, strerror(errno));
  if (s == DLUA_OK && fsync(w->fd) != 0) s = DLUA_ERR(DLUA_ERR_IO, "save %s: fsync of %s: %s", w->path, w->tmp, strerror(errno));
  if (close(w->fd) != 0 && s == DLUA_OK) s = DLUA_ERR(DLUA_ERR_IO, "save %s: closing %s: %s", w->path, w->tmp, strerror(errno));
  w->fd = -1;
  if (s != DLUA_OK) return s;
  DLUA_TRY(dlua_io_publish(w->tmp, w->path));
  w->committed = 1;
  return DLUA_OK;
}

dlua_status_t dlua_st_save(const char *path, int64_t n, const char *const *names, dlua_tensor_t *const *tensors,
                           int64_t nmeta, const char *const *keys, const char *const *values) {
  if (n < 0 || (n > 0 && (!names || !tensors))) return DLUA_ERR(DLUA_ERR_ARG, "save: bad arguments");
  int *dtypes = calloc((size_t)(n > 0 ? n : 1), sizeof *dtypes);
  int *ndims = calloc((size_t)(n > 0 ? n : 1), sizeof *ndims);
  int64_t *sizes = calloc((size_t)(n > 0 ? n : 1) * DLUA_MAX_DIMS, sizeof *sizes);
  dlua_status_t s = dtypes && ndims && sizes ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "save %s: out of memory", path ? path : "");
  int64_t k = 0;
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) {
    const dlua_tensor_t *t = tensors[i];
    if (!t || !t->storage) {
      s = DLUA_ERR(DLUA_ERR_ARG, "save %s: tensor '%s' is NULL (freed?)", path ? path : "", names[i] ? names[i] : "?");
      break;
    }
    dtypes[i] = (int)t->dtype;
    ndims[i] = t->ndim;
    for (int d = 0; d < t->ndim; d++) sizes[k++] = t->sizes[d];
  }
  dlua_st_writer_t *w = NULL;
  if (s == DLUA_OK) s = dlua_st_writer_open(&w, path, n, names, dtypes, ndims, sizes, nmeta, keys, values);
  free(dtypes);
  free(ndims);
  free(sizes);
  for (int64_t i = 0; s == DLUA_OK && i < n; i++) s = dlua_st_writer_put(w, i, tensors[i]);
  if (s == DLUA_OK) s = dlua_st_writer_commit(w);
  dlua_st_writer_free(w);
  return s;
}

/* ---- reader -------------------------------------------------------------------------------------- */

struct dlua_st_file {
  char *path;
  const unsigned char *map;
  size_t map_len;
  uint64_t data_start; /* 8 + N */
  int64_t n;
  entry_t *e;          /* in file order */
  entry_t **sorted;    /* by name, for find */
  int64_t nmeta;
  char **meta_keys, **meta_values;
};

void dlua_st_close(dlua_st_file_t *f) {
  if (!f) return;
  if (f->map && f->map_len) munmap((void *)f->map, f->map_len);
  for (int64_t k = 0; k < f->nmeta; k++) {
    free(f->meta_keys[k]);
    free(f->meta_values[k]);
  }
  free(f->meta_keys);
  free(f->meta_values);
  free_entries(f->e, f->n);
  free(f->sorted);
  free(f->path);
  free(f);
}

static int by_begin(const void *a, const void *b) {
  const entry_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* A JSON number that is an exact non-negative integer. */
static int get_u64(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return 0;
  double d = v->valuedouble;
  if (!(d >= 0) || d > MAX_EXACT || d != (double)(uint64_t)d) return 0;
  *out = (uint64_t)d;
  return 1;
}

#define BAD(...) (s = DLUA_ERR(DLUA_ERR_IO, __VA_ARGS__))

static dlua_status_t parse_entry(dlua_st_file_t *f, const cJSON *item, entry_t *e) {
  dlua_status_t s = DLUA_OK;
  const char *nm = item->string;
  if (!cJSON_IsObject(item)) return BAD("load %s: corrupt header: tensor '%s' is not an object", f->path, nm);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  if (!cJSON_IsString(dt) || !cJSON_IsArray(shape) || !cJSON_IsArray(offs))
    return BAD("load %s: corrupt header: tensor '%s' needs dtype, shape and data_offsets", f->path, nm);
  e->name = strdup(nm);
  if (!e->name) return DLUA_ERR(DLUA_ERR_OOM, "load %s: out of memory", f->path);
  e->dtype = dlua_st_dtype_from_name(dt->valuestring);
  if (e->dtype < 0)
    return DLUA_ERR(DLUA_ERR_ARG, "load %s: tensor '%s' has dtype %s, which dlua does not have (it has F32, F64, F16, BF16, I64, I32, U8, BOOL)",
                    f->path, nm, dt->valuestring);
  int nd = cJSON_GetArraySize(shape);
  if (nd > DLUA_MAX_DIMS) return DLUA_ERR(DLUA_ERR_ARG, "load %s: tensor '%s' has %d dimensions (dlua has at most %d)", f->path, nm, nd, DLUA_MAX_DIMS);
  e->ndim = nd;
  uint64_t bytes = dlua_dtype_size(e->dtype);
  int d = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, shape) {
    uint64_t sz;
    if (!get_u64(v, &sz) || sz > (uint64_t)INT64_MAX) return BAD("load %s: corrupt header: tensor '%s' has a bad size in its shape", f->path, nm);
    e->sizes[d++] = (int64_t)sz;
    if (__builtin_mul_overflow(bytes, sz, &bytes)) return BAD("load %s: corrupt header: tensor '%s' is impossibly large", f->path, nm);
  }
  if (cJSON_GetArraySize(offs) != 2 || !get_u64(cJSON_GetArrayItem(offs, 0), &e->begin) || !get_u64(cJSON_GetArrayItem(offs, 1), &e->end) ||
      e->end < e->begin)
    return BAD("load %s: corrupt header: tensor '%s' has bad data_offsets", f->path, nm);
  if (e->end - e->begin != bytes) {
    char b[200];
    return BAD("load %s: corrupt header: tensor '%s' is %s %s (%llu bytes) but its data_offsets span %llu bytes", f->path, nm,
               shape_of(e, b, sizeof b), dlua_dtype_name(e->dtype), (unsigned long long)bytes, (unsigned long long)(e->end - e->begin));
  }
  return DLUA_OK;
}

static dlua_status_t parse_crcs(dlua_st_file_t *f, const char *text) {
  dlua_status_t s = DLUA_OK;
  cJSON *o = cJSON_Parse(text);
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return BAD("load %s: corrupt header: metadata 'dlua.crc32' is not a JSON object", f->path);
  }
  int count = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, o) {
    int64_t i = dlua_st_find(f, v->string);
    char *end = NULL;
    unsigned long c = cJSON_IsString(v) ? strtoul(v->valuestring, &end, 16) : 0;
    if (i < 0) {
      BAD("load %s: corrupt header: a checksum is given for tensor '%s', which the file does not hold", f->path, v->string);
      break;
    }
    if (!end || end != v->valuestring + 8 || *end || f->e[i].has_crc) {
      BAD("load %s: corrupt header: the checksum of tensor '%s' is not 8 hex digits given once", f->path, v->string);
      break;
    }
    f->e[i].crc = (uint32_t)c;
    f->e[i].has_crc = 1;
    count++;
  }
  cJSON_Delete(o);
  for (int64_t i = 0; s == DLUA_OK && i < f->n; i++)
    if (!f->e[i].has_crc) BAD("load %s: corrupt header: tensor '%s' has no checksum in 'dlua.crc32'", f->path, f->e[i].name);
  (void)count;
  return s;
}

static dlua_status_t parse_header(dlua_st_file_t *f, const char *json, size_t len) {
  dlua_status_t s = DLUA_OK;
  const char *end = NULL;
  cJSON *h = cJSON_ParseWithLengthOpts(json, len, &end, 0);
  if (!h) return BAD("load %s: corrupt header: not valid JSON (near byte %lld of %zu)", f->path,
                     (long long)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json : -1), len);
  for (const char *p = end; p && p < json + len; p++)
    if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t') {
      cJSON_Delete(h);
      return BAD("load %s: corrupt header: bytes after the JSON object", f->path);
    }
  if (!cJSON_IsObject(h)) {
    cJSON_Delete(h);
    return BAD("load %s: corrupt header: not a JSON object", f->path);
  }
  int64_t count = 0;
  const cJSON *item;
  const cJSON *meta = NULL;
  cJSON_ArrayForEach(item, h) {
    if (!strcmp(item->string, "__metadata__")) {
      if (meta) BAD("load %s: corrupt header: __metadata__ given twice", f->path);
      meta = item;
    } else {
      count++;
    }
  }
  if (s == DLUA_OK) {
    f->e = calloc((size_t)(count ? count : 1), sizeof *f->e);
    f->sorted = malloc((size_t)(count ? count : 1) * sizeof *f->sorted);
    if (!f->e || !f->sorted) s = DLUA_ERR(DLUA_ERR_OOM, "load %s: out of memory", f->path);
  }
  if (s == DLUA_OK && meta) {
    if (!cJSON_IsObject(meta)) {
      BAD("load %s: corrupt header: __metadata__ is not an object", f->path);
    } else {
      int64_t m = cJSON_GetArraySize(meta);
      f->meta_keys = calloc((size_t)(m ? m : 1), sizeof(char *));
      f->meta_values = calloc((size_t)(m ? m : 1), sizeof(char *));
      if (!f->meta_keys || !f->meta_values) s = DLUA_ERR(DLUA_ERR_OOM, "load %s: out of memory", f->path);
      cJSON_ArrayForEach(item, meta) {
        if (s != DLUA_OK) break;
        if (!cJSON_IsString(item)) {
          BAD("load %s: corrupt header: metadata '%s' is not a string", f->path, item->string);
          break;
        }
        f->meta_keys[f->nmeta] = strdup(item->string);
        f->meta_values[f->nmeta] = strdup(item->valuestring);
        f->nmeta++;
        if (!f->meta_keys[f->nmeta - 1] || !f->meta_values[f->nmeta - 1]) s = DLUA_ERR(DLUA_ERR_OOM, "load %s: out of memory", f->path);
      }
    }
  }
  cJSON_ArrayForEach(item, h) {
    if (s != DLUA_OK) break;
    if (item == meta) continue;
    s = parse_entry(f, item, &f->e[f->n]);
    f->n++;
  }
  cJSON_Delete(h);
  DLUA_TRY(s);
  qsort(f->e, (size_t)f->n, sizeof *f->e, by_begin);
  for (int64_t i = 0; i < f->n; i++) f->sorted[i] = &f->e[i];
  qsort(f->sorted, (size_t)f->n, sizeof *f->sorted, by_name);
  for (int64_t i = 1; i < f->n; i++)
    if (!strcmp(f->sorted[i]->name, f->sorted[i - 1]->name)) return BAD("load %s: corrupt header: tensor '%s' appears twice", f->path, f->sorted[i]->name);
  // The tensors must tile the data exactly: no gap, no overlap, nothing past the end.
  uint64_t data_len = f->map_len - f->data_start, at = 0;
  for (int64_t i = 0; i < f->n; i++) {
    const entry_t *e = &f->e[i];
    if (e->begin != at) {
      if (e->begin > data_len || e->end > data_len)
        return BAD("load %s: tensor '%s' lies at bytes %llu..%llu of the data, past its end (%llu bytes): the file is truncated",
                   f->path, e->name, (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)data_len);
      return BAD("load %s: corrupt header: tensor '%s' starts at data byte %llu, expected %llu (tensors must follow each other)",
                 f->path, e->name, (unsigned long long)e->begin, (unsigned long long)at);
    }
    if (e->end > data_len)
      return BAD("load %s: tensor '%s' ends at data byte %llu, past the end of the data (%llu bytes): the file is truncated",
                 f->path, e->name, (unsigned long long)e->end, (unsigned long long)data_len);
    at = e->end;
  }
  if (at != data_len)
    return BAD("load %s: the tensors cover %llu bytes of data but the file holds %llu after its header (trailing bytes: corrupt)",
               f->path, (unsigned long long)at, (unsigned long long)data_len);
  for (int64_t k = 0; k < f->nmeta; k++)
    if (!strcmp(f->meta_keys[k], "dlua.crc32")) return parse_crcs(f, f->meta_values[k]);
  return DLUA_OK;
}

dlua_status_t dlua_st_open(dlua_st_file_t **out, const char *path) {
  if (!out || !path) return DLUA_ERR(DLUA_ERR_ARG, "load: expected a file name");
  *out = NULL;
  dlua_st_file_t *f = calloc(1, sizeof *f);
  if (!f || !(f->path = strdup(path))) {
    free(f);
    return DLUA_ERR(DLUA_ERR_OOM, "load %s: out of memory", path);
  }
  dlua_status_t s = DLUA_OK;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0) {
    BAD("load %s: %s", path, strerror(errno));
  } else if (fstat(fd, &st) != 0) {
    BAD("load %s: %s", path, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    BAD("load %s: not a regular file", path);
  } else if (st.st_size < 8) {
    BAD("load %s: truncated: %lld bytes, a safetensors file has at least 8", path, (long long)st.st_size);
  } else {
    f->map_len = (size_t)st.st_size;
    void *m = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      f->map_len = 0;
      BAD("load %s: mmap: %s", path, strerror(errno));
    } else {
      f->map = m;
      madvise(m, f->map_len, MADV_SEQUENTIAL);
    }
  }
  if (fd >= 0) close(fd);  // the mapping stays valid without the descriptor
  if (s == DLUA_OK) {
    uint64_t n = 0;
    for (int b = 0; b < 8; b++) n |= (uint64_t)f->map[b] << (8 * b);
    if (n > MAX_HEADER)
      BAD("load %s: corrupt header: it claims %llu bytes (at most %llu): not a safetensors file?", path, (unsigned long long)n,
          (unsigned long long)MAX_HEADER);
    else if (n > f->map_len - 8)
      BAD("load %s: truncated: the header claims %llu bytes but the file has %zu after the length", path, (unsigned long long)n, f->map_len - 8);
    else if (n < 2)
      BAD("load %s: corrupt header: %llu bytes", path, (unsigned long long)n);
    else {
      f->data_start = 8 + n;
      s = parse_header(f, (const char *)f->map + 8, (size_t)n);
    }
  }
  if (s != DLUA_OK) {
    dlua_st_close(f);
    return s;
  }
  *out = f;
  return DLUA_OK;
}

const char *dlua_st_path(const dlua_st_file_t *f) { return f ? f->path : NULL; }
int64_t dlua_st_count(const dlua_st_file_t *f) { return f ? f->n : 0; }
int64_t dlua_st_file_bytes(const dlua_st_file_t *f) { return f ? (int64_t)f->map_len : 0; }

int64_t dlua_st_find(const dlua_st_file_t *f, const char *name) {
  if (!f || !name) return -1;
  int64_t lo = 0, hi = f->n - 1;
  while (lo <= hi) {
    int64_t mid = (lo + hi) / 2;
    int c = strcmp(f->sorted[mid]->name, name);
    if (c == 0) return f->sorted[mid] - f->e;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid - 1;
  }
  return -1;
}

static const entry_t *entry(const dlua_st_file_t *f, int64_t i) { return f && i >= 0 && i < f->n ? &f->e[i] : NULL; }
const char *dlua_st_name(const dlua_st_file_t *f, int64_t i) { return entry(f, i) ? f->e[i].name : NULL; }
int dlua_st_dtype(const dlua_st_file_t *f, int64_t i) { return entry(f, i) ? f->e[i].dtype : -1; }
int dlua_st_ndim(const dlua_st_file_t *f, int64_t i) { return entry(f, i) ? f->e[i].ndim : -1; }
const int64_t *dlua_st_sizes(const dlua_st_file_t *f, int64_t i) { return entry(f, i) ? f->e[i].sizes : NULL; }
int dlua_st_has_crc(const dlua_st_file_t *f, int64_t i) { return entry(f, i) ? f->e[i].has_crc : 0; }
int64_t dlua_st_metadata_count(const dlua_st_file_t *f) { return f ? f->nmeta : 0; }
const char *dlua_st_metadata_key(const dlua_st_file_t *f, int64_t i) { return f && i >= 0 && i < f->nmeta ? f->meta_keys[i] : NULL; }
const char *dlua_st_metadata_value(const dlua_st_file_t *f, int64_t i) { return f && i >= 0 && i < f->nmeta ? f->meta_values[i] : NULL; }

static dlua_status_t check_entry(const dlua_st_file_t *f, int64_t i) {
  if (!f) return DLUA_ERR(DLUA_ERR_ARG, "load: the file is NULL (closed?)");
  if (i < 0 || i >= f->n) return DLUA_ERR(DLUA_ERR_ARG, "load %s: tensor %lld of %lld", f->path, (long long)i + 1, (long long)f->n);
  return DLUA_OK;
}

static dlua_status_t mismatch(const dlua_st_file_t *f, const entry_t *e, uint32_t got) {
  return DLUA_ERR(DLUA_ERR_IO, "load %s: checksum mismatch for tensor '%s': the file says crc32 %08x, its bytes give %08x (the file is corrupt)",
                  f->path, e->name, e->crc, got);
}

dlua_status_t dlua_st_verify(dlua_st_file_t *f, int64_t i) {
  DLUA_TRY(check_entry(f, i));
  entry_t *e = &f->e[i];
  if (!e->has_crc || e->state == 1) return DLUA_OK;
  const unsigned char *p = f->map + f->data_start + e->begin;
  uint64_t bytes = e->end - e->begin;
  uint32_t crc = 0;
  for (uint64_t done = 0; done < bytes;) {
    if (dlua_interrupt_pending()) return DLUA_ERR(DLUA_ERR_INTERRUPTED, "load %s: interrupted while checking tensor '%s'", f->path, e->name);
    uint64_t k = bytes - done < DLUA_ST_CHUNK ? bytes - done : DLUA_ST_CHUNK;
    crc = dlua_crc32(crc, p + done, k);
    done += k;
  }
  e->state = crc == e->crc ? 1 : -1;
  if (e->state < 0) return mismatch(f, e, crc);
  return DLUA_OK;
}

dlua_status_t dlua_st_read(dlua_st_file_t *f, int64_t i, dlua_tensor_t **out) {
  DLUA_TRY(check_entry(f, i));
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "load %s: out is NULL", f->path);
  entry_t *e = &f->e[i];
  dlua_tensor_t *t = NULL;
  DLUA_TRY(dlua_tensor_empty(&t, e->ndim, e->sizes, (dlua_dtype_t)e->dtype, DLUA_CPU));
  const unsigned char *p = f->map + f->data_start + e->begin;
  unsigned char *dst = (unsigned char *)dlua_tensor_ptr(t);
  uint64_t bytes = e->end - e->begin;
  uint32_t crc = 0;
  int check = e->has_crc && e->state != 1;
  for (uint64_t done = 0; done < bytes;) {
    if (dlua_interrupt_pending()) {
      dlua_tensor_free(t);
      return DLUA_ERR(DLUA_ERR_INTERRUPTED, "load %s: interrupted while reading tensor '%s'", f->path, e->name);
    }
    uint64_t k = bytes - done < DLUA_ST_CHUNK ? bytes - done : DLUA_ST_CHUNK;
    memcpy(dst + done, p + done, k);
    if (check) crc = dlua_crc32(crc, dst + done, k);  // the copy, still in cache
    done += k;
  }
  if (check) {
    e->state = crc == e->crc ? 1 : -1;
    if (e->state < 0) {
      dlua_tensor_free(t);
      return mismatch(f, e, crc);
    }
  }
  *out = t;
  return DLUA_OK;
}

dlua_status_t dlua_st_read_into(dlua_st_file_t *f, int64_t i, dlua_tensor_t *dst) {
  DLUA_TRY(check_entry(f, i));
  const entry_t *e = &f->e[i];
  char b1[200], b2[200];
  if (!dst || !dst->storage) return DLUA_ERR(DLUA_ERR_ARG, "load %s: the destination of tensor '%s' is NULL (freed?)", f->path, e->name);
  int same = (int)dst->dtype == e->dtype && dst->ndim == e->ndim;
  for (int d = 0; same && d < e->ndim; d++) same = dst->sizes[d] == e->sizes[d];
  if (!same)
    return DLUA_ERR(DLUA_ERR_ARG, "load %s: tensor '%s' is %s %s in the file, the destination is %s", f->path, e->name,
                    shape_of(e, b1, sizeof b1), dlua_dtype_name(e->dtype), dlua_tensor_describe(dst, b2, sizeof b2));
  DLUA_TRY(dlua_st_verify(f, i));
  if (e->end == e->begin) return DLUA_OK;
  dlua_tensor_t *src = NULL;
  DLUA_TRY(dlua_tensor_wrap(&src, e->ndim, e->sizes, NULL, (dlua_dtype_t)e->dtype, (void *)(f->map + f->data_start + e->begin), NULL, NULL));
  dlua_status_t s = dlua_tensor_copy_(dst, src);
  dlua_tensor_free(src);  // a view of the mapping: gone before the mapping can be
  return s;
}

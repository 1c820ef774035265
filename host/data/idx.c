/* IDX reader (MNIST's file format), gzipped or not, into CPU tensors; MNIST image/label pairs. */
#include "data/idx.h"
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>
#include "core/error.h"
#include "core/runtime.h"
#include "core/tensor.h"

/* Where Debian's dataset-fashion-mnist package puts its files: a missing file there is
   almost always a missing package, so the error says how to install it. */
static const char FASHION_MNIST_DIR[] = "/usr/share/datasets/fashion-mnist";

/* Large reads go through in slices: gzread takes an unsigned int, and Ctrl-C is polled in between. */
enum { READ_SLICE = 1 << 24 };

typedef struct {
  const char *op;
  const char *path;
  gzFile f;
} reader_t;

static const char *package_hint(const char *path) {
  size_t n = sizeof FASHION_MNIST_DIR - 1;
  if (strncmp(path, FASHION_MNIST_DIR, n) == 0 && (path[n] == '/' || path[n] == '\0'))
    return " (Fashion-MNIST comes from the Debian package dataset-fashion-mnist: apt-get install dataset-fashion-mnist)";
  return "";
}

static dlua_status_t open_reader(reader_t *r) {
  struct stat st;
  if (stat(r->path, &st) != 0) {
    int e = errno;
    return DLUA_ERR(DLUA_ERR_IO, "%s: cannot open '%s': %s%s", r->op, r->path, strerror(e),
                    e == ENOENT ? package_hint(r->path) : "");
  }
  // open(2) accepts a directory and only read(2) fails; say what is wrong up front.
  if (S_ISDIR(st.st_mode)) return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is a directory, not an IDX file", r->op, r->path);
  errno = 0;
  r->f = gzopen(r->path, "rb");  // reads plain files unchanged, so one path serves both
  if (!r->f) {
    int e = errno;
    return DLUA_ERR(e ? DLUA_ERR_IO : DLUA_ERR_OOM, "%s: cannot open '%s': %s", r->op, r->path,
                    e ? strerror(e) : "zlib could not allocate its state");
  }
  gzbuffer(r->f, 1 << 17);
  return DLUA_OK;
}

/* Reads exactly len bytes, or reports what was wrong: a corrupt or cut gzip stream, or a
   file that ends early (`what` names the part being read, for the message). */
static dlua_status_t read_exact(reader_t *r, void *dst, size_t len, const char *what, size_t *got_total) {
  size_t done = 0;
  while (done < len) {
    if (dlua_interrupt_flag) return DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted reading '%s'", r->op, r->path);
    size_t want = len - done < READ_SLICE ? len - done : READ_SLICE;
    int got = gzread(r->f, (char *)dst + done, (unsigned)want);
    if (got < 0) {
      int errnum = 0;
      const char *msg = gzerror(r->f, &errnum);
      if (errnum == Z_ERRNO)
        return DLUA_ERR(DLUA_ERR_IO, "%s: reading '%s' failed: %s", r->op, r->path, strerror(errno));
      return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is not a valid gzip file: %s", r->op, r->path, msg);
    }
    done += (size_t)got;
    if ((size_t)got < want) break;
  }
  if (got_total) *got_total = done;
  if (done == len) return DLUA_OK;
  int errnum = 0;
  gzerror(r->f, &errnum);
  const char *cut = errnum == Z_BUF_ERROR ? " (the gzip stream is cut short)" : "";
  return DLUA_ERR(DLUA_ERR_IO, "%s: '%s' is truncated: %s needs %zu bytes, the file holds %zu%s", r->op, r->path, what,
                  len, done, cut);
}

static uint32_t be32(const unsigned char *b) {
  return ((uint32_t)b[0] << 24) | ((uint32_t)b[1] << 16) | ((uint32_t)b[2] << 8) | (uint32_t)b[3];
}

/* IDX element type codes and the dtype each becomes (int8 and int16 have none). */
static int idx_dtype(unsigned code, dlua_dtype_t *dtype) {
  switch (code) {
    case 0x08: *dtype = DLUA_DTYPE_U8; return 1;
    case 0x0C: *dtype = DLUA_DTYPE_I32; return 1;
    case 0x0D: *dtype = DLUA_DTYPE_F32; return 1;
    case 0x0E: *dtype = DLUA_DTYPE_F64; return 1;
    default: return 0;
  }
}

/* IDX stores multi-byte elements big-endian. */
static void to_host_order(void *data, int64_t n, size_t es) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  (void)data, (void)n, (void)es;
#else
  if (es == 4) {
    uint32_t *p = data;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) p[i] = __builtin_bswap32(p[i]);
  } else if (es == 8) {
    uint64_t *p = data;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) p[i] = __builtin_bswap64(p[i]);
  }
#endif
}

static dlua_status_t read_body(reader_t *r, dlua_tensor_t **out, uint32_t *magic_out) {
  unsigned char head[4];
  size_t got = 0;
  dlua_status_t s = read_exact(r, head, 4, "the IDX magic number", &got);
  if (s != DLUA_OK) return s;
  uint32_t magic = be32(head);
  unsigned code = head[2], ndim = head[3];
  dlua_dtype_t dtype = DLUA_DTYPE_U8;
  if (head[0] != 0 || head[1] != 0 || ndim == 0 || ndim > DLUA_MAX_DIMS ||
      (code != 0x09 && code != 0x0B && !idx_dtype(code, &dtype)))
    return DLUA_ERR(DLUA_ERR_ARG,
                    "%s: '%s' is not an IDX file: bad magic number 0x%08" PRIx32
                    " (expected 0x00000803 for images, 0x00000801 for labels, or 0x0000TTDD with element type TT"
                    " and 1..%d dims DD)",
                    r->op, r->path, magic, DLUA_MAX_DIMS);
  if (!idx_dtype(code, &dtype))
    return DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' holds %s elements (IDX type 0x%02x), which dlua has no dtype for", r->op,
                    r->path, code == 0x09 ? "int8" : "int16", code);

  unsigned char dimbuf[4 * DLUA_MAX_DIMS];
  char what[64];
  snprintf(what, sizeof what, "a header of %u dims", ndim);
  DLUA_TRY(read_exact(r, dimbuf, 4 * (size_t)ndim, what, NULL));
  int64_t sizes[DLUA_MAX_DIMS];
  size_t es = dlua_dtype_size(dtype);
  uint64_t bytes = es;
  for (unsigned d = 0; d < ndim; d++) {
    sizes[d] = be32(dimbuf + 4 * d);
    // Each size is below 2^32, so the product overflows only through many large dims.
    if (sizes[d] && bytes > (uint64_t)INT64_MAX / (uint64_t)sizes[d]) {
      char b[160];
      return DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' claims dims %s: too large to address", r->op, r->path,
                      dlua_shape_str((int)ndim, sizes, b, sizeof b));
    }
    bytes *= (uint64_t)sizes[d];
  }

  dlua_tensor_t *t = NULL;
  s = dlua_tensor_empty(&t, (int)ndim, sizes, dtype, DLUA_CPU);
  if (s != DLUA_OK) {
    char cause[512], b[160];
    snprintf(cause, sizeof cause, "%s", dlua_last_error());
    return DLUA_ERR(s, "%s: cannot hold '%s', dims %s %s: %s", r->op, r->path,
                    dlua_shape_str((int)ndim, sizes, b, sizeof b), dlua_dtype_name(dtype), cause);
  }
  char b[160];
  snprintf(what, sizeof what, "dims %s", dlua_shape_str((int)ndim, sizes, b, sizeof b));
  s = read_exact(r, dlua_tensor_data(t), (size_t)bytes, what, NULL);
  if (s == DLUA_OK) {
    // Anything after the data means the dims do not describe the file (or it is not IDX).
    size_t extra = 0;
    unsigned char scratch[4096];
    int got2;
    while ((got2 = gzread(r->f, scratch, sizeof scratch)) > 0) extra += (size_t)got2;
    if (extra)
      s = DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' has %zu bytes after the %" PRIu64 " bytes of data that %s need", r->op,
                   r->path, extra, bytes, what);
  }
  if (s != DLUA_OK) {
    dlua_tensor_free(t);
    return s;
  }
  to_host_order(dlua_tensor_data(t), dlua_tensor_numel(t), es);
  *out = t;
  if (magic_out) *magic_out = magic;
  return DLUA_OK;
}

dlua_status_t dlua_idx_read(const char *op, const char *path, dlua_tensor_t **out, uint32_t *magic) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", op);
  *out = NULL;
  if (!path || !*path) return DLUA_ERR(DLUA_ERR_ARG, "%s: expected a file name, got %s", op, path ? "''" : "NULL");
  reader_t r = {.op = op, .path = path, .f = NULL};
  DLUA_TRY(open_reader(&r));
  dlua_status_t s = read_body(&r, out, magic);
  gzclose_r(r.f);
  return s;
}

dlua_status_t dlua_data_read_idx(dlua_tensor_t **out, const char *path) {
  return dlua_idx_read("read_idx", path, out, NULL);
}

dlua_status_t dlua_data_read_mnist(dlua_tensor_t **images, dlua_tensor_t **labels, const char *images_path,
                                   const char *labels_path, int64_t label_base) {
  static const char op[] = "read_mnist";
  if (!images || !labels) return DLUA_ERR(DLUA_ERR_ARG, "%s: images or labels is NULL", op);
  *images = *labels = NULL;
  dlua_tensor_t *x = NULL, *raw = NULL, *y = NULL;
  uint32_t magic = 0;
  dlua_status_t s = dlua_idx_read(op, images_path, &x, &magic);
  if (s != DLUA_OK) return s;
  char b[200];
  if (magic != DLUA_IDX_MAGIC_IMAGES) {
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' is an IDX file of %s, not of images (magic 0x%08" PRIx32
                 ", expected 0x00000803: uint8, 3 dims)", op, images_path, dlua_tensor_describe(x, b, sizeof b), magic);
    goto fail;
  }
  s = dlua_idx_read(op, labels_path, &raw, &magic);
  if (s != DLUA_OK) goto fail;
  if (magic != DLUA_IDX_MAGIC_LABELS) {
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' is an IDX file of %s, not of labels (magic 0x%08" PRIx32
                 ", expected 0x00000801: uint8, 1 dim)", op, labels_path, dlua_tensor_describe(raw, b, sizeof b), magic);
    goto fail;
  }
  int64_t n = dlua_tensor_sizes(x)[0], nl = dlua_tensor_sizes(raw)[0];
  if (n != nl) {
    s = DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' holds %" PRId64 " images but '%s' holds %" PRId64 " labels", op, images_path,
                 n, labels_path, nl);
    goto fail;
  }
  // Labels become int64 counted from label_base: Lua's classes count from 1 (DESIGN.md).
  s = dlua_tensor_empty(&y, 1, &n, DLUA_DTYPE_I64, DLUA_CPU);
  if (s != DLUA_OK) goto fail;
  const uint8_t *src = dlua_tensor_data(raw);
  int64_t *dst = dlua_tensor_data(y);
  for (int64_t i = 0; i < n; i++) dst[i] = (int64_t)src[i] + label_base;
  dlua_tensor_free(raw);
  *images = x;
  *labels = y;
  return DLUA_OK;
fail:
  dlua_tensor_free(x);
  dlua_tensor_free(raw);
  dlua_tensor_free(y);
  return s;
}

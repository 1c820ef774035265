/* Check suite for host/data/idx.c: IDX files written here (plain, gzipped, corrupt, cut short) read back or rejected by name. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core/api.h"

#include "testutil.h"

static char tmpdir[256];

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dlua_test_idx_XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void remove_tmpdir(void) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
}

static const char *tmp_path(const char *name) {
  static char buf[4][400];
  static int k = 0;
  k = (k + 1) % 4;
  snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
  return buf[k];
}

/* A byte buffer that tests fill with an IDX image by hand. */
typedef struct {
  unsigned char *p;
  size_t n, cap;
} bytes_t;

static void put(bytes_t *b, const void *src, size_t n) {
  if (b->n + n > b->cap) {
    b->cap = (b->n + n) * 2 + 64;
    b->p = realloc(b->p, b->cap);
    ck_assert_ptr_nonnull(b->p);
  }
  memcpy(b->p + b->n, src, n);
  b->n += n;
}

static void put_be32(bytes_t *b, uint32_t v) {
  unsigned char w[4] = {(unsigned char)(v >> 24), (unsigned char)(v >> 16), (unsigned char)(v >> 8), (unsigned char)v};
  put(b, w, 4);
}

/* Header: magic 0x0000TTDD, then the dims. */
static void put_header(bytes_t *b, unsigned type, int ndim, const uint32_t *dims) {
  put_be32(b, (type << 8) | (unsigned)ndim);
  for (int d = 0; d < ndim; d++) put_be32(b, dims[d]);
}

static void write_plain(const char *path, const bytes_t *b, size_t n) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(b->p, 1, n, f), n);
  fclose(f);
}

static void write_gz(const char *path, const bytes_t *b, size_t n) {
  gzFile f = gzopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(gzwrite(f, b->p, (unsigned)n), (int)n);
  ck_assert_int_eq(gzclose(f), Z_OK);
}

static long file_size(const char *path) {
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  return (long)st.st_size;
}

/* u8 images (n, h, w) whose pixel (i, y, x) is (7 i + 3 y + x) mod 256, the value the tests expect. */
static bytes_t images_file(uint32_t n, uint32_t h, uint32_t w) {
  bytes_t b = {0};
  uint32_t dims[3] = {n, h, w};
  put_header(&b, 0x08, 3, dims);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t y = 0; y < h; y++)
      for (uint32_t x = 0; x < w; x++) {
        unsigned char v = (unsigned char)((7 * i + 3 * y + x) & 0xff);
        put(&b, &v, 1);
      }
  return b;
}

static bytes_t labels_file(uint32_t n) {
  bytes_t b = {0};
  put_header(&b, 0x08, 1, &n);
  for (uint32_t i = 0; i < n; i++) {
    unsigned char v = (unsigned char)((i * 3) % 10);
    put(&b, &v, 1);
  }
  return b;
}

static void check_images(dlua_tensor_t *t, uint32_t n, uint32_t h, uint32_t w) {
  ck_assert_int_eq(dlua_tensor_ndim(t), 3);
  ck_assert_int_eq(dlua_tensor_dtype(t), DLUA_DTYPE_U8);
  ck_assert_int_eq(dlua_tensor_sizes(t)[0], n);
  ck_assert_int_eq(dlua_tensor_sizes(t)[1], h);
  ck_assert_int_eq(dlua_tensor_sizes(t)[2], w);
  ck_assert(dlua_tensor_is_contiguous(t));
  const uint8_t *p = dlua_tensor_data(t);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t y = 0; y < h; y++)
      for (uint32_t x = 0; x < w; x++)
        ck_assert_uint_eq(p[((size_t)i * h + y) * w + x], (7 * i + 3 * y + x) & 0xff);
}

/* Fails unless reading `path` fails with `status` and a message holding every given piece. */
static void expect_error(const char *path, dlua_status_t status, const char *a, const char *b, const char *c) {
  dlua_tensor_t *t = NULL;
  dlua_status_t s = dlua_data_read_idx(&t, path);
  ck_assert_msg(s == status, "%s: status %d, expected %d (%s)", path, s, status, dlua_last_error());
  ck_assert_ptr_null(t);
  const char *m = dlua_last_error();
  ck_assert_msg(strncmp(m, "read_idx: ", 10) == 0, "message does not start with the op: %s", m);
  const char *pieces[3] = {a, b, c};
  for (int k = 0; k < 3; k++)
    if (pieces[k]) ck_assert_msg(strstr(m, pieces[k]) != NULL, "'%s' not in: %s", pieces[k], m);
  dlua_clear_error();
}

START_TEST(test_plain_and_gzipped_images) {
  make_tmpdir();
  // Prime sizes, and a single image, so row/column mix-ups show.
  const uint32_t shapes[3][3] = {{3, 5, 7}, {1, 1, 1}, {11, 28, 13}};
  for (int k = 0; k < 3; k++) {
    bytes_t b = images_file(shapes[k][0], shapes[k][1], shapes[k][2]);
    const char *plain = tmp_path("img-idx3-ubyte"), *gz = tmp_path("img-idx3-ubyte.gz");
    write_plain(plain, &b, b.n);
    write_gz(gz, &b, b.n);
    for (int which = 0; which < 2; which++) {
      dlua_tensor_t *t = NULL;
      ck_assert_int_eq(dlua_data_read_idx(&t, which ? gz : plain), DLUA_OK);
      check_images(t, shapes[k][0], shapes[k][1], shapes[k][2]);
      dlua_tensor_free(t);
    }
    free(b.p);
  }
  remove_tmpdir();
}
END_TEST

START_TEST(test_empty_and_wide_types) {
  make_tmpdir();
  // Zero images is a valid file: an empty (0, 28, 28) tensor.
  bytes_t b = images_file(0, 28, 28);
  write_gz(tmp_path("empty.gz"), &b, b.n);
  dlua_tensor_t *t = NULL;
  ck_assert_int_eq(dlua_data_read_idx(&t, tmp_path("empty.gz")), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(t), 0);
  ck_assert_int_eq(dlua_tensor_sizes(t)[1], 28);
  dlua_tensor_free(t);
  free(b.p);

  // float32 (2, 3), big-endian: values chosen to be exact.
  bytes_t f = {0};
  uint32_t dims[2] = {2, 3};
  put_header(&f, 0x0D, 2, dims);
  const float fv[6] = {1.5f, -2.25f, 0.0f, 1e-3f, 65504.0f, -0.0f};
  for (int i = 0; i < 6; i++) {
    uint32_t u;
    memcpy(&u, &fv[i], 4);
    put_be32(&f, u);
  }
  write_plain(tmp_path("f32.idx"), &f, f.n);
  ck_assert_int_eq(dlua_data_read_idx(&t, tmp_path("f32.idx")), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(t), DLUA_DTYPE_F32);
  const float *pf = dlua_tensor_data(t);
  for (int i = 0; i < 6; i++) ck_assert(memcmp(&pf[i], &fv[i], 4) == 0);
  dlua_tensor_free(t);
  free(f.p);

  // int32 (4): negative values check the byte order of the sign.
  bytes_t iv = {0};
  uint32_t n4 = 4;
  put_header(&iv, 0x0C, 1, &n4);
  const int32_t vals[4] = {-1, 258, INT32_MIN, 0x01020304};
  for (int i = 0; i < 4; i++) put_be32(&iv, (uint32_t)vals[i]);
  write_gz(tmp_path("i32.idx.gz"), &iv, iv.n);
  ck_assert_int_eq(dlua_data_read_idx(&t, tmp_path("i32.idx.gz")), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_dtype(t), DLUA_DTYPE_I32);
  const int32_t *pi = dlua_tensor_data(t);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(pi[i], vals[i]);
  dlua_tensor_free(t);
  free(iv.p);

  // float64 (1, 1, 1, 1): four dims.
  bytes_t d = {0};
  uint32_t d4[4] = {1, 1, 1, 1};
  put_header(&d, 0x0E, 4, d4);
  double dv = -3.0625;
  uint64_t u;
  memcpy(&u, &dv, 8);
  put_be32(&d, (uint32_t)(u >> 32));
  put_be32(&d, (uint32_t)u);
  write_plain(tmp_path("f64.idx"), &d, d.n);
  ck_assert_int_eq(dlua_data_read_idx(&t, tmp_path("f64.idx")), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(t), 4);
  ck_assert(*(const double *)dlua_tensor_data(t) == dv);
  dlua_tensor_free(t);
  free(d.p);
  remove_tmpdir();
}
END_TEST

START_TEST(test_missing_file_names_path_and_package) {
  make_tmpdir();
  const char *p = tmp_path("no-such-file.gz");
  expect_error(p, DLUA_ERR_IO, p, "No such file", NULL);
  // Elsewhere, no package hint.
  dlua_tensor_t *t = NULL;
  ck_assert_int_ne(dlua_data_read_idx(&t, p), DLUA_OK);
  ck_assert_ptr_null(strstr(dlua_last_error(), "dataset-fashion-mnist"));
  // Under the Debian package's folder, the error says which package ships it.
  expect_error("/usr/share/datasets/fashion-mnist/no-such-file-idx3-ubyte.gz", DLUA_ERR_IO,
               "/usr/share/datasets/fashion-mnist/no-such-file-idx3-ubyte.gz", "dataset-fashion-mnist",
               "apt-get install");
  expect_error(tmpdir, DLUA_ERR_IO, tmpdir, "is a directory", NULL);
  ck_assert_int_eq(dlua_data_read_idx(&t, ""), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_data_read_idx(&t, NULL), DLUA_ERR_ARG);
  ck_assert_int_eq(dlua_data_read_idx(NULL, p), DLUA_ERR_ARG);
  dlua_clear_error();
  remove_tmpdir();
}
END_TEST

START_TEST(test_bad_magic_and_types) {
  make_tmpdir();
  bytes_t b = {0};
  put_be32(&b, 0x12345678);
  put_be32(&b, 0);
  write_plain(tmp_path("bad"), &b, b.n);
  expect_error(tmp_path("bad"), DLUA_ERR_ARG, tmp_path("bad"), "not an IDX file", "0x12345678");
  // A text file gzipped: the magic is checked after inflating.
  b.n = 0;
  put(&b, "hello, world\n", 13);
  write_gz(tmp_path("text.gz"), &b, b.n);
  expect_error(tmp_path("text.gz"), DLUA_ERR_ARG, "text.gz", "bad magic number 0x68656c6c", NULL);
  // Zero dims, and more dims than a tensor has.
  b.n = 0;
  put_be32(&b, 0x00000800);
  write_plain(tmp_path("nodims"), &b, b.n);
  expect_error(tmp_path("nodims"), DLUA_ERR_ARG, "nodims", "0x00000800", NULL);
  b.n = 0;
  put_be32(&b, 0x00000809);
  write_plain(tmp_path("ninedims"), &b, b.n);
  expect_error(tmp_path("ninedims"), DLUA_ERR_ARG, "ninedims", "0x00000809", NULL);
  // int8 is valid IDX but has no dtype.
  b.n = 0;
  uint32_t one = 1;
  put_header(&b, 0x09, 1, &one);
  put(&b, "x", 1);
  write_plain(tmp_path("i8"), &b, b.n);
  expect_error(tmp_path("i8"), DLUA_ERR_ARG, "i8", "int8", "no dtype");
  free(b.p);
  remove_tmpdir();
}
END_TEST

START_TEST(test_truncated_and_trailing) {
  make_tmpdir();
  bytes_t b = images_file(3, 5, 7);  // 16 header bytes + 105 data bytes
  ck_assert_uint_eq(b.n, 16 + 105);
  // Data cut short, plain and as a complete gzip stream of the short content.
  write_plain(tmp_path("short"), &b, 16 + 50);
  expect_error(tmp_path("short"), DLUA_ERR_IO, "'", "is truncated", "needs 105 bytes, the file holds 50");
  expect_error(tmp_path("short"), DLUA_ERR_IO, "(3, 5, 7)", NULL, NULL);
  write_gz(tmp_path("short.gz"), &b, 16 + 50);
  expect_error(tmp_path("short.gz"), DLUA_ERR_IO, "short.gz", "is truncated", "the file holds 50");
  // Header cut inside the dims, and inside the magic.
  write_plain(tmp_path("head"), &b, 10);
  expect_error(tmp_path("head"), DLUA_ERR_IO, "head", "header of 3 dims needs 12 bytes, the file holds 6", NULL);
  write_plain(tmp_path("two"), &b, 2);
  expect_error(tmp_path("two"), DLUA_ERR_IO, "two", "magic number needs 4 bytes, the file holds 2", NULL);
  write_plain(tmp_path("zero"), &b, 0);
  expect_error(tmp_path("zero"), DLUA_ERR_IO, "zero", "the file holds 0", NULL);
  // A gzip file cut in the middle of its compressed stream.
  bytes_t big = images_file(40, 28, 28);
  write_gz(tmp_path("full.gz"), &big, big.n);
  long gzlen = file_size(tmp_path("full.gz"));
  FILE *f = fopen(tmp_path("full.gz"), "rb");
  ck_assert_ptr_nonnull(f);
  bytes_t raw = {0};
  raw.p = malloc((size_t)gzlen);
  raw.n = raw.cap = (size_t)gzlen;
  ck_assert_uint_eq(fread(raw.p, 1, (size_t)gzlen, f), (size_t)gzlen);
  fclose(f);
  write_plain(tmp_path("cut.gz"), &raw, (size_t)gzlen / 2);
  expect_error(tmp_path("cut.gz"), DLUA_ERR_IO, "cut.gz", "truncated", "gzip stream is cut short");
  // Corrupt compressed bytes: zlib's own complaint, with the path.
  for (long i = 20; i < gzlen - 8; i += 7) raw.p[i] ^= 0x5a;
  write_plain(tmp_path("corrupt.gz"), &raw, (size_t)gzlen);
  dlua_tensor_t *t = NULL;
  ck_assert_int_ne(dlua_data_read_idx(&t, tmp_path("corrupt.gz")), DLUA_OK);
  ck_assert_ptr_null(t);
  ck_assert_ptr_nonnull(strstr(dlua_last_error(), "corrupt.gz"));
  // Bytes after the data: the dims do not describe the file.
  put(&b, "zz", 2);
  write_plain(tmp_path("long"), &b, b.n);
  expect_error(tmp_path("long"), DLUA_ERR_ARG, "long", "2 bytes after the 105 bytes of data", "(3, 5, 7)");
  free(b.p);
  free(big.p);
  free(raw.p);
  remove_tmpdir();
}
END_TEST

START_TEST(test_mnist_pairs) {
  make_tmpdir();
  bytes_t im = images_file(5, 4, 3), lb = labels_file(5), lb4 = labels_file(4);
  write_gz(tmp_path("im.gz"), &im, im.n);
  write_plain(tmp_path("lb"), &lb, lb.n);
  write_gz(tmp_path("lb4.gz"), &lb4, lb4.n);
  dlua_tensor_t *x = NULL, *y = NULL;
  ck_assert_int_eq(dlua_data_read_mnist(&x, &y, tmp_path("im.gz"), tmp_path("lb"), 1), DLUA_OK);
  check_images(x, 5, 4, 3);
  ck_assert_int_eq(dlua_tensor_dtype(y), DLUA_DTYPE_I64);
  ck_assert_int_eq(dlua_tensor_numel(y), 5);
  const int64_t *py = dlua_tensor_data(y);
  for (int i = 0; i < 5; i++) ck_assert_int_eq(py[i], (i * 3) % 10 + 1);  // file label 0 is class 1
  dlua_tensor_free(x);
  dlua_tensor_free(y);
  x = y = NULL;

  ck_assert_int_eq(dlua_data_read_mnist(&x, &y, tmp_path("im.gz"), tmp_path("lb4.gz"), 1), DLUA_ERR_ARG);
  ck_assert_ptr_null(x);
  ck_assert_ptr_null(y);
  const char *m = dlua_last_error();
  ck_assert_msg(strstr(m, "read_mnist: ") == m, "%s", m);
  ck_assert_msg(strstr(m, "holds 5 images") && strstr(m, "holds 4 labels") && strstr(m, "im.gz") &&
                    strstr(m, "lb4.gz"),
                "%s", m);
  // Swapped files: each is named with what it holds.
  ck_assert_int_eq(dlua_data_read_mnist(&x, &y, tmp_path("lb"), tmp_path("im.gz"), 1), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "not of images") && strstr(dlua_last_error(), "'"),
                "%s", dlua_last_error());
  ck_assert_int_eq(dlua_data_read_mnist(&x, &y, tmp_path("im.gz"), tmp_path("im.gz"), 1), DLUA_ERR_ARG);
  ck_assert_msg(strstr(dlua_last_error(), "not of labels"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_data_read_mnist(&x, &y, tmp_path("im.gz"), tmp_path("nothere"), 1), DLUA_ERR_IO);
  ck_assert_msg(strstr(dlua_last_error(), "nothere"), "%s", dlua_last_error());
  ck_assert_ptr_null(x);
  ck_assert_ptr_null(y);
  dlua_clear_error();
  free(im.p);
  free(lb.p);
  free(lb4.p);
  remove_tmpdir();
}
END_TEST

/* The real files, when Debian's dataset-fashion-mnist is installed: 60000 training images
   of 28 x 28, six thousand of each of the ten classes (the dataset's published split). */
START_TEST(test_fashion_mnist_if_installed) {
  const char *im = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
  const char *lb = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz";
  if (access(im, R_OK) != 0 || access(lb, R_OK) != 0) {
    fprintf(stderr, "test_fashion_mnist_if_installed: skipped: %s not found (Debian package dataset-fashion-mnist)\n",
            im);
    return;
  }
  dlua_tensor_t *x = NULL, *y = NULL;
  ck_assert_msg(dlua_data_read_mnist(&x, &y, im, lb, 0) == DLUA_OK, "%s", dlua_last_error());
  ck_assert_int_eq(dlua_tensor_sizes(x)[0], 60000);
  ck_assert_int_eq(dlua_tensor_sizes(x)[1], 28);
  ck_assert_int_eq(dlua_tensor_sizes(x)[2], 28);
  int64_t count[10] = {0};
  const int64_t *py = dlua_tensor_data(y);
  for (int i = 0; i < 60000; i++) {
    ck_assert(py[i] >= 0 && py[i] < 10);
    count[py[i]]++;
  }
  for (int c = 0; c < 10; c++) ck_assert_int_eq(count[c], 6000);
  dlua_tensor_free(x);
  dlua_tensor_free(y);
}
END_TEST

int main(void) {
  Suite *s = suite_create("idx");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_plain_and_gzipped_images);
  tcase_add_test(tc, test_empty_and_wide_types);
  tcase_add_test(tc, test_missing_file_names_path_and_package);
  tcase_add_test(tc, test_bad_magic_and_types);
  tcase_add_test(tc, test_truncated_and_trailing);
  tcase_add_test(tc, test_mnist_pairs);
  tcase_add_test(tc, test_fashion_mnist_if_installed);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

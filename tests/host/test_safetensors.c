/* Check suite for host/io: safetensors round trips (every dtype, views, channels-last), files parsed here byte by byte, every corrupt case rejected by name, atomic replacement, background jobs and their memory. */
#include <check.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

static char tmpdir[256];

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/dlua_test_st_XXXXXX");
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

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *p = malloc((size_t)len + 1);
  ck_assert_int_eq(fread(p, 1, (size_t)len, f), (size_t)len);
  fclose(f);
  *n = (size_t)len;
  return p;
}

static void spit(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(fwrite(p, 1, n, f), n);
  fclose(f);
}

/* A file made by hand: the header text as given (padded to 8), then `data`. */
static void hand_file(const char *path, const char *header, const void *data, size_t n) {
  size_t h = strlen(header), pad = (8 - h % 8) % 8;
  unsigned char *buf = malloc(8 + h + pad + n + 1);
  uint64_t N = h + pad;
  for (int b = 0; b < 8; b++) buf[b] = (unsigned char)(N >> (8 * b));
  memcpy(buf + 8, header, h);
  memset(buf + 8 + h, ' ', pad);
  if (n) memcpy(buf + 8 + h + pad, data, n);
  spit(path, buf, 8 + h + pad + n);
  free(buf);
}

/* Tensors whose bytes are a known pattern: byte k of tensor `seed` is (seed * 31 + k * 7) mod 251,
   except bool (0/1) and floats (finite values, so comparisons are of bytes anyway). */
static dlua_tensor_t *pattern(dlua_dtype_t dt, int nd, const int64_t *sz, int seed) {
  dlua_tensor_t *t = tu_new_t(nd, sz, dt);
  int64_t n = dlua_tensor_numel(t);
  unsigned char *p = dlua_tensor_data(t);
  size_t bytes = (size_t)n * dlua_dtype_size(dt);
  for (size_t k = 0; k < bytes; k++) p[k] = (unsigned char)((seed * 31 + k * 7) % 251);
  if (dt == DLUA_DTYPE_BOOL)
    for (size_t k = 0; k < bytes; k++) p[k] &= 1;
  if (dt == DLUA_DTYPE_F16 || dt == DLUA_DTYPE_BF16 || dt == DLUA_DTYPE_F32 || dt == DLUA_DTYPE_F64) {
    for (int64_t i = 0; i < n; i++) tu_put(dt, p, i, (double)((seed * 13 + i * 5) % 97) - 48.5);
  }
  return t;
}

static uint64_t le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int b = 0; b < 8; b++) v |= (uint64_t)p[b] << (8 * b);
  return v;
}

/* The position of "name": {...} in the header and its data_offsets, read with sscanf (not cJSON). */
static void offsets_of(const char *hdr, const char *name, uint64_t *begin, uint64_t *end) {
  char key[300];
  snprintf(key, sizeof key, "\"%s\":{", name);
  const char *at = strstr(hdr, key);
  ck_assert_msg(at != NULL, "no tensor %s in %s", name, hdr);
  const char *offs = strstr(at, "\"data_offsets\":[");
  ck_assert_ptr_nonnull(offs);
  unsigned long long b, e;
  ck_assert_int_eq(sscanf(offs, "\"data_offsets\":[%llu,%llu]", &b, &e), 2);
  *begin = b;
  *end = e;
}

START_TEST(test_every_dtype_round_trip) {
  static const char *names[DLUA_DTYPE_COUNT] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8", "b"};
  static const char *st[DLUA_DTYPE_COUNT] = {"F32", "F64", "F16", "BF16", "I32", "I64", "U8", "BOOL"};
  dlua_tensor_t *ts[DLUA_DTYPE_COUNT];
  const int64_t sz[3] = {3, 5, 7};
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) ts[d] = pattern((dlua_dtype_t)d, d % 3 + 1, sz, d + 1);
  const char *keys[] = {"note", "step"}, *vals[] = {"hello \"world\"", "12"};
  const char *path = tmp_path("all.safetensors");
  ck_assert_int_eq(dlua_st_save(path, DLUA_DTYPE_COUNT, names, ts, 2, keys, vals), DLUA_OK);

  // The file, read here by hand: N, 64-byte aligned data, tensors by decreasing element size
  // without gaps, each aligned to its element size, each holding the tensor's bytes and its CRC.
  size_t len;
  unsigned char *raw = slurp(path, &len);
  uint64_t N = le64(raw);
  ck_assert_uint_eq((8 + N) % 64, 0);
  char *hdr = strndup((char *)raw + 8, N);
  ck_assert_ptr_nonnull(strstr(hdr, "\"format\":\"pt\""));
  ck_assert_ptr_nonnull(strstr(hdr, "\"note\":\"hello \\\"world\\\"\""));
  uint64_t total = 0;
  size_t last_size = 8;
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
    uint64_t b, e;
    offsets_of(hdr, names[d], &b, &e);
    size_t es = dlua_dtype_size((dlua_dtype_t)d);
    size_t bytes = (size_t)dlua_tensor_numel(ts[d]) * es;
    ck_assert_uint_eq(e - b, bytes);
    ck_assert_uint_eq(b % es, 0);
    ck_assert_int_eq(memcmp(raw + 8 + N + b, dlua_tensor_data(ts[d]), bytes), 0);
    char want[80];
    snprintf(want, sizeof want, "\"dtype\":\"%s\"", st[d]);
    ck_assert_ptr_nonnull(strstr(strstr(hdr, names[d]), want));
    snprintf(want, sizeof want, "\\\"%s\\\":\\\"%08lx\\\"", names[d], crc32(0, raw + 8 + N + b, (uInt)bytes));
    ck_assert_msg(strstr(hdr, want) != NULL, "crc entry %s missing in %s", want, hdr);
    total += bytes;
    (void)last_size;
  }
  // Ordered by element size: every 8-byte tensor before every 4-byte one, and so on.
  for (int a = 0; a < DLUA_DTYPE_COUNT; a++)
    for (int c = 0; c < DLUA_DTYPE_COUNT; c++) {
      uint64_t ba, ea, bc, ec;
      offsets_of(hdr, names[a], &ba, &ea);
      offsets_of(hdr, names[c], &bc, &ec);
      if (dlua_dtype_size((dlua_dtype_t)a) > dlua_dtype_size((dlua_dtype_t)c)) ck_assert_uint_lt(ba, bc);
    }
  ck_assert_uint_eq(len, 8 + N + total);
  free(hdr);
  free(raw);

  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  ck_assert_int_eq(dlua_st_count(f), DLUA_DTYPE_COUNT);
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) {
    int64_t i = dlua_st_find(f, names[d]);
    ck_assert_int_ge(i, 0);
    ck_assert_int_eq(dlua_st_dtype(f, i), d);
    ck_assert_int_eq(dlua_st_ndim(f, i), d % 3 + 1);
    ck_assert_int_eq(dlua_st_has_crc(f, i), 1);
    dlua_tensor_t *r = NULL;
    ck_assert_int_eq(dlua_st_read(f, i, &r), DLUA_OK);
    ck_assert_int_eq(dlua_tensor_numel(r), dlua_tensor_numel(ts[d]));
    ck_assert_int_eq(memcmp(dlua_tensor_data(r), dlua_tensor_data(ts[d]), (size_t)dlua_tensor_numel(r) * dlua_dtype_size((dlua_dtype_t)d)), 0);
    dlua_tensor_free(r);
  }
  int found = 0;
  for (int64_t k = 0; k < dlua_st_metadata_count(f); k++)
    if (!strcmp(dlua_st_metadata_key(f, k), "step")) found = !strcmp(dlua_st_metadata_value(f, k), "12");
  ck_assert(found);
  ck_assert_int_eq(dlua_st_find(f, "nope"), -1);
  dlua_st_close(f);
  for (int d = 0; d < DLUA_DTYPE_COUNT; d++) dlua_tensor_free(ts[d]);
}
END_TEST

START_TEST(test_views_and_channels_last_written_logically) {
  // x (2, 3, 4, 5) float32 with x[n,c,h,w] = 1000n + 100c + 10h + w; a transposed view and a
  // channels-last copy must both be written as that row-major sequence.
  const int64_t sz[4] = {2, 3, 4, 5};
  dlua_tensor_t *x = tu_new_t(4, sz, DLUA_DTYPE_F32);
  float *p = dlua_tensor_data(x);
  int64_t k = 0;
  for (int n = 0; n < 2; n++)
    for (int c = 0; c < 3; c++)
      for (int h = 0; h < 4; h++)
        for (int w = 0; w < 5; w++) p[k++] = (float)(1000 * n + 100 * c + 10 * h + w);
  // channels-last storage: (N, H, W, C) memory with (N, C, H, W) sizes
  const int64_t cl_sizes[4] = {2, 3, 4, 5}, cl_strides[4] = {60, 1, 15, 3};
  float *cl_mem = malloc(120 * sizeof(float));
  for (int n = 0; n < 2; n++)
    for (int c = 0; c < 3; c++)
      for (int h = 0; h < 4; h++)
        for (int w = 0; w < 5; w++) cl_mem[n * 60 + h * 15 + w * 3 + c] = (float)(1000 * n + 100 * c + 10 * h + w);
  dlua_tensor_t *cl = NULL;
  ck_assert_int_eq(dlua_tensor_wrap(&cl, 4, cl_sizes, cl_strides, DLUA_DTYPE_F32, cl_mem, NULL, NULL), DLUA_OK);
  dlua_tensor_t *tr = NULL;  // (2, 3, 5, 4): tr[n,c,w,h] = x[n,c,h,w]
  ck_assert_int_eq(dlua_tensor_transpose(&tr, x, 2, 3), DLUA_OK);
  const char *names[] = {"cl", "tr"};
  dlua_tensor_t *ts[] = {cl, tr};
  const char *path = tmp_path("views.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 2, names, ts, 0, NULL, NULL), DLUA_OK);

  size_t len;
  unsigned char *raw = slurp(path, &len);
  uint64_t N = le64(raw), b, e;
  char *hdr = strndup((char *)raw + 8, N);
  offsets_of(hdr, "cl", &b, &e);
  ck_assert_int_eq(memcmp(raw + 8 + N + b, p, 120 * sizeof(float)), 0);
  offsets_of(hdr, "tr", &b, &e);
  const float *t = (const float *)(raw + 8 + N + b);
  k = 0;
  for (int n = 0; n < 2; n++)
    for (int c = 0; c < 3; c++)
      for (int w = 0; w < 5; w++)
        for (int h = 0; h < 4; h++, k++) ck_assert_float_eq(t[k], (float)(1000 * n + 100 * c + 10 * h + w));
  ck_assert_ptr_nonnull(strstr(hdr, "\"tr\":{\"dtype\":\"F32\",\"shape\":[2,3,5,4]"));

  // Loading into a channels-last destination puts each value at its channels-last place.
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  float *dst_mem = calloc(120, sizeof(float));
  dlua_tensor_t *dst = NULL;
  ck_assert_int_eq(dlua_tensor_wrap(&dst, 4, cl_sizes, cl_strides, DLUA_DTYPE_F32, dst_mem, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_st_read_into(f, dlua_st_find(f, "cl"), dst), DLUA_OK);
  ck_assert_int_eq(memcmp(dst_mem, cl_mem, 120 * sizeof(float)), 0);
  dlua_st_close(f);
  dlua_tensor_free(dst);
  free(dst_mem);
  free(hdr);
  free(raw);
  dlua_tensor_free(cl);
  dlua_tensor_free(tr);
  dlua_tensor_free(x);
  free(cl_mem);
}
END_TEST

START_TEST(test_empty_scalar_and_no_tensors) {
  const int64_t zero[2] = {0, 3};
  dlua_tensor_t *e = tu_new_t(2, zero, DLUA_DTYPE_F32);
  dlua_tensor_t *s = tu_new_t(0, NULL, DLUA_DTYPE_I64);
  *(int64_t *)dlua_tensor_data(s) = -42;
  const char *names[] = {"empty", "scalar"};
  dlua_tensor_t *ts[] = {e, s};
  const char *path = tmp_path("edge.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 2, names, ts, 0, NULL, NULL), DLUA_OK);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, dlua_st_find(f, "scalar"), &r), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_ndim(r), 0);
  ck_assert_int_eq(*(int64_t *)dlua_tensor_data(r), -42);
  dlua_tensor_free(r);
  ck_assert_int_eq(dlua_st_read(f, dlua_st_find(f, "empty"), &r), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_numel(r), 0);
  ck_assert_int_eq(dlua_tensor_sizes(r)[1], 3);
  dlua_tensor_free(r);
  dlua_st_close(f);
  ck_assert_int_eq(dlua_st_save(tmp_path("none.safetensors"), 0, NULL, NULL, 0, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_st_open(&f, tmp_path("none.safetensors")), DLUA_OK);
  ck_assert_int_eq(dlua_st_count(f), 0);
  dlua_st_close(f);
  dlua_tensor_free(e);
  dlua_tensor_free(s);
}
END_TEST

START_TEST(test_foreign_file_without_checksums) {
  // As PyTorch's safetensors writes it: no dlua.crc32; loads, with nothing to check.
  const float v[3] = {1.5f, -2.0f, 3.25f};
  hand_file(tmp_path("py.safetensors"), "{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", v, 12);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, tmp_path("py.safetensors")), DLUA_OK);
  ck_assert_int_eq(dlua_st_has_crc(f, 0), 0);
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, 0, &r), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(r), v, 12), 0);
  dlua_tensor_free(r);
  dlua_st_close(f);
}
END_TEST

/* Opening `path` fails with DLUA_ERR_IO or _ARG and a message holding the file name and `needle`. */
static void expect_open_error(const char *path, const char *needle) {
  dlua_st_file_t *f = NULL;
  dlua_status_t s = dlua_st_open(&f, path);
  ck_assert_msg(s == DLUA_ERR_IO || s == DLUA_ERR_ARG, "%s: opened (status %d), expected an error with '%s'", path, s, needle);
  ck_assert_ptr_null(f);
  ck_assert_msg(strstr(dlua_last_error(), path) != NULL, "error \"%s\" lacks the file name", dlua_last_error());
  ck_assert_msg(strstr(dlua_last_error(), needle) != NULL, "error \"%s\" lacks \"%s\"", dlua_last_error(), needle);
}

START_TEST(test_truncated_files) {
  const int64_t sz[1] = {1000};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 3), *b = pattern(DLUA_DTYPE_I64, 1, sz, 4);
  const char *names[] = {"alpha", "beta"};
  dlua_tensor_t *ts[] = {a, b};
  const char *path = tmp_path("whole.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 2, names, ts, 0, NULL, NULL), DLUA_OK);
  size_t len;
  unsigned char *raw = slurp(path, &len);
  uint64_t N = le64(raw);
  const char *cut = tmp_path("cut.safetensors");
  spit(cut, raw, 0);
  expect_open_error(cut, "truncated");
  spit(cut, raw, 5);
  expect_open_error(cut, "truncated");
  spit(cut, raw, 8 + N / 2);
  expect_open_error(cut, "truncated");
  // beta (8-byte elements) comes first; cutting inside it names beta, inside alpha names alpha
  spit(cut, raw, 8 + N + 100);
  expect_open_error(cut, "'beta'");
  spit(cut, raw, len - 1);
  expect_open_error(cut, "'alpha'");
  // one byte too many
  unsigned char *more = malloc(len + 1);
  memcpy(more, raw, len);
  more[len] = 0;
  spit(cut, more, len + 1);
  expect_open_error(cut, "trailing");
  free(more);
  free(raw);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}
END_TEST

START_TEST(test_corrupt_headers) {
  const unsigned char data[16] = {0};
  const char *p = tmp_path("bad.safetensors");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]", data, 16);  // unterminated
  expect_open_error(p, "not valid JSON");
  hand_file(p, "[1,2,3]", data, 16);
  expect_open_error(p, "not a JSON object");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}} x", data, 16);
  expect_open_error(p, "after the JSON");
  hand_file(p, "{\"w\":{\"dtype\":\"Q7\",\"shape\":[4],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "dtype Q7");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "'w' is (5) float32 (20 bytes) but its data_offsets span 16");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,1600]}}", data, 16);
  expect_open_error(p, "'w'");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "bad size");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", data, 16);  // gap
  expect_open_error(p, "starts at data byte 8, expected 0");
  hand_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
            data, 16);  // overlap
  expect_open_error(p, "expected");
  hand_file(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
            data, 16);
  expect_open_error(p, "'a' appears twice");
  hand_file(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4]}}", data, 16);
  expect_open_error(p, "needs dtype, shape and data_offsets");
  hand_file(p, "{\"__metadata__\":{\"k\":3},\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "metadata 'k' is not a string");
  hand_file(p, "{\"__metadata__\":{\"dlua.crc32\":\"{\\\"v\\\":\\\"00000000\\\"}\"},\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "tensor 'v'");
  hand_file(p, "{\"__metadata__\":{\"dlua.crc32\":\"{}\"},\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", data, 16);
  expect_open_error(p, "'w' has no checksum");
  // a header length past the file, and an absurd one
  unsigned char big[16] = {0x00, 0x10, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
  spit(p, big, 16);
  expect_open_error(p, "truncated");
  big[6] = 0x10;
  spit(p, big, 16);
  expect_open_error(p, "claims");
  expect_open_error(tmp_path("missing.safetensors"), "No such file");
}
END_TEST

START_TEST(test_checksum_mismatch_names_tensor) {
  const int64_t sz[1] = {64};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 1), *b = pattern(DLUA_DTYPE_F32, 1, sz, 2);
  const char *names[] = {"first", "second"};
  dlua_tensor_t *ts[] = {a, b};
  const char *path = tmp_path("crc.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 2, names, ts, 0, NULL, NULL), DLUA_OK);
  size_t len;
  unsigned char *raw = slurp(path, &len);
  uint64_t N = le64(raw), bb, be;
  char *hdr = strndup((char *)raw + 8, N);
  offsets_of(hdr, "second", &bb, &be);
  raw[8 + N + bb + 17] ^= 0x10;  // one bit of "second"
  spit(path, raw, len);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);  // the header is fine
  ck_assert_int_eq(dlua_st_verify(f, dlua_st_find(f, "first")), DLUA_OK);
  ck_assert_int_eq(dlua_st_verify(f, dlua_st_find(f, "second")), DLUA_ERR_IO);
  ck_assert(tu_err_has("checksum mismatch for tensor 'second'") && tu_err_has(path));
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, dlua_st_find(f, "second"), &r), DLUA_ERR_IO);
  ck_assert_ptr_null(r);
  // read_into checks before writing: the destination keeps its values
  dlua_tensor_t *dst = tu_new_t(1, sz, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_tensor_fill_(dst, 7.0), DLUA_OK);
  ck_assert_int_eq(dlua_st_read_into(f, dlua_st_find(f, "second"), dst), DLUA_ERR_IO);
  ck_assert(tu_err_has("'second'"));
  for (int i = 0; i < 64; i++) ck_assert_float_eq(((float *)dlua_tensor_data(dst))[i], 7.0f);
  dlua_st_close(f);
  // a corrupted checksum text is caught the same way (the data is right, the record is not)
  raw[8 + N + bb + 17] ^= 0x10;
  char *c = strstr((char *)raw + 8, "\\\"first\\\":\\\"");
  ck_assert_ptr_nonnull(c);
  c += strlen("\\\"first\\\":\\\"");
  *c = *c == '0' ? '1' : '0';
  spit(path, raw, len);
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  ck_assert_int_eq(dlua_st_verify(f, dlua_st_find(f, "first")), DLUA_ERR_IO);
  ck_assert(tu_err_has("'first'"));
  dlua_st_close(f);
  free(hdr);
  free(raw);
  dlua_tensor_free(dst);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}
END_TEST

START_TEST(test_destination_mismatch) {
  const int64_t sz[2] = {2, 3}, other[2] = {3, 2};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 2, sz, 1);
  const char *names[] = {"w"};
  const char *path = tmp_path("dst.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 1, names, &a, 0, NULL, NULL), DLUA_OK);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  dlua_tensor_t *wrong_shape = tu_new_t(2, other, DLUA_DTYPE_F32), *wrong_dtype = tu_new_t(2, sz, DLUA_DTYPE_F16);
  ck_assert_int_eq(dlua_st_read_into(f, 0, wrong_shape), DLUA_ERR_ARG);
  ck_assert(tu_err_has("'w' is (2, 3) float32 in the file, the destination is (3, 2) float32") && tu_err_has(path));
  ck_assert_int_eq(dlua_st_read_into(f, 0, wrong_dtype), DLUA_ERR_ARG);
  ck_assert(tu_err_has("the destination is (2, 3) float16"));
  dlua_st_close(f);
  dlua_tensor_free(wrong_shape);
  dlua_tensor_free(wrong_dtype);
  dlua_tensor_free(a);
}
END_TEST

static int count_dir(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
  closedir(d);
  return n;
}

START_TEST(test_atomic_replacement_and_abort) {
  const int64_t sz[1] = {256};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 1), *b = pattern(DLUA_DTYPE_F32, 1, sz, 9);
  const char *names[] = {"w"};
  const char *path = tmp_path("atomic.safetensors");
  ck_assert_int_eq(dlua_st_save(path, 1, names, &a, 0, NULL, NULL), DLUA_OK);
  size_t len0;
  unsigned char *before = slurp(path, &len0);
  // A writer freed before commit (an error, a kill) leaves the old file and no temporary file.
  int dt = DLUA_DTYPE_F32, nd = 1;
  dlua_st_writer_t *w = NULL;
  ck_assert_int_eq(dlua_st_writer_open(&w, path, 1, names, &dt, &nd, sz, 0, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(count_dir(tmpdir, ".atomic.safetensors.tmp"), 1);
  ck_assert_int_eq(dlua_st_writer_put(w, 0, b), DLUA_OK);
  dlua_st_writer_free(w);
  ck_assert_int_eq(count_dir(tmpdir, ".atomic.safetensors.tmp"), 0);
  size_t len1;
  unsigned char *after = slurp(path, &len1);
  ck_assert_uint_eq(len0, len1);
  ck_assert_int_eq(memcmp(before, after, len0), 0);
  free(after);
  // A commit without every tensor is refused.
  ck_assert_int_eq(dlua_st_writer_open(&w, path, 1, names, &dt, &nd, sz, 0, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(dlua_st_writer_commit(w), DLUA_ERR_ARG);
  ck_assert(tu_err_has("'w' was never written"));
  // put checks what was declared
  const int64_t other[1] = {255};
  dlua_tensor_t *c = tu_new_t(1, other, DLUA_DTYPE_F32);
  ck_assert_int_eq(dlua_st_writer_put(w, 0, c), DLUA_ERR_ARG);
  ck_assert(tu_err_has("'w' was declared (256) float32, got (255) float32"));
  dlua_st_writer_free(w);
  dlua_tensor_free(c);
  // A full save replaces the file whole.
  ck_assert_int_eq(dlua_st_save(path, 1, names, &b, 0, NULL, NULL), DLUA_OK);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, 0, &r), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(r), dlua_tensor_data(b), 1024), 0);
  dlua_tensor_free(r);
  dlua_st_close(f);
  free(before);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}
END_TEST

START_TEST(test_writer_argument_errors) {
  const int64_t sz[1] = {4};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 1);
  const char *dup[] = {"x", "x"};
  dlua_tensor_t *ts[] = {a, a};
  tu_expect_error(dlua_st_save(tmp_path("d.safetensors"), 2, dup, ts, 0, NULL, NULL), "'x' given twice");
  const char *meta[] = {"__metadata__"};
  tu_expect_error(dlua_st_save(tmp_path("d.safetensors"), 1, meta, ts, 0, NULL, NULL), "reserves");
  const char *names[] = {"x"}, *k[] = {"dlua.crc32"}, *v[] = {"x"};
  tu_expect_error(dlua_st_save(tmp_path("d.safetensors"), 1, names, ts, 1, k, v), "reserved");
  ck_assert_int_eq(dlua_st_save("/nonexistent-dir/x.safetensors", 1, names, ts, 0, NULL, NULL), DLUA_ERR_IO);
  ck_assert(tu_err_has("/nonexistent-dir"));
  dlua_tensor_free(a);
}
END_TEST

START_TEST(test_background_job_snapshot_and_memory) {
  const int64_t sz[1] = {1 << 20};  // 4 MiB
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 5);
  unsigned char *orig = malloc(4u << 20);
  memcpy(orig, dlua_tensor_data(a), 4u << 20);
  const int64_t base = dlua_memory_allocated(DLUA_CPU);
  const char *names[] = {"w"};
  const char *path = tmp_path("job.safetensors");
  dlua_ckpt_job_t *job = NULL;
  ck_assert_int_eq(dlua_ckpt_job_new(&job), DLUA_OK);
  const int now[1] = {1};
  ck_assert_int_eq(dlua_ckpt_job_add_file(job, path, 1, names, &a, 0, NULL, NULL, now), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_snapshot_bytes(job), 4 << 20);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), base + (4 << 20));
  ck_assert_int_eq(dlua_ckpt_job_add_text(job, tmp_path("latest"), "job\n", 4), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_start(job), DLUA_OK);
  // training goes on: the tensor changes while the file is written
  ck_assert_int_eq(dlua_tensor_fill_(a, -1.0), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_wait(job), DLUA_OK);
  ck_assert(dlua_ckpt_job_done(job));
  ck_assert_int_eq(dlua_ckpt_job_snapshot_bytes(job), 0);
  ck_assert_int_eq(dlua_ckpt_job_snapshot_peak(job), 4 << 20);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), base);  // the snapshot is gone once written
  dlua_ckpt_job_free(job);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, 0, &r), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(r), orig, 4u << 20), 0);  // the values at the save
  dlua_tensor_free(r);
  dlua_st_close(f);
  size_t n;
  unsigned char *latest = slurp(tmp_path("latest"), &n);
  ck_assert_uint_eq(n, 4);
  ck_assert_int_eq(memcmp(latest, "job\n", 4), 0);
  free(latest);
  free(orig);
  dlua_tensor_free(a);
}
END_TEST

START_TEST(test_deferred_snapshot) {
  // mode 2: copied by the job's thread before it writes; wait_snapshot says when the tensor may change
  const int64_t sz[1] = {1 << 20};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 6), *b = pattern(DLUA_DTYPE_F32, 1, sz, 7);
  const int64_t base = dlua_memory_allocated(DLUA_CPU);
  unsigned char *orig = malloc(4u << 20);
  memcpy(orig, dlua_tensor_data(a), 4u << 20);
  const char *names[] = {"a", "b"};
  dlua_tensor_t *ts[] = {a, b};
  const int modes[2] = {2, 1};
  const char *path = tmp_path("deferred.safetensors");
  dlua_ckpt_job_t *job = NULL;
  ck_assert_int_eq(dlua_ckpt_job_new(&job), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_add_file(job, path, 2, names, ts, 0, NULL, NULL, modes), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_snapshot_bytes(job), 8 << 20);  // both buffers exist from the start
  ck_assert_int_eq(dlua_ckpt_job_start(job), DLUA_OK);
  ck_assert_int_eq(dlua_tensor_fill_(b, 3.0), DLUA_OK);  // b was copied at add: free to change
  dlua_ckpt_job_wait_snapshot(job);
  ck_assert_int_eq(dlua_tensor_fill_(a, -1.0), DLUA_OK);  // a only now
  ck_assert_int_eq(dlua_ckpt_job_wait(job), DLUA_OK);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), base);
  dlua_ckpt_job_free(job);
  dlua_st_file_t *f = NULL;
  ck_assert_int_eq(dlua_st_open(&f, path), DLUA_OK);
  dlua_tensor_t *r = NULL;
  ck_assert_int_eq(dlua_st_read(f, dlua_st_find(f, "a"), &r), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(r), orig, 4u << 20), 0);
  dlua_tensor_free(r);
  ck_assert_int_eq(dlua_st_read(f, dlua_st_find(f, "b"), &r), DLUA_OK);
  ck_assert_float_ne(((float *)dlua_tensor_data(r))[5], 3.0f);
  dlua_tensor_free(r);
  dlua_st_close(f);
  free(orig);
  dlua_tensor_free(a);
  dlua_tensor_free(b);
}
END_TEST

START_TEST(test_failed_step_skips_the_rest) {
  const int64_t sz[1] = {16};
  dlua_tensor_t *a = pattern(DLUA_DTYPE_F32, 1, sz, 5);
  const char *names[] = {"w"};
  const int64_t base = dlua_memory_allocated(DLUA_CPU);
  dlua_ckpt_job_t *job = NULL;
  ck_assert_int_eq(dlua_ckpt_job_new(&job), DLUA_OK);
  const int now[1] = {1};
  ck_assert_int_eq(dlua_ckpt_job_add_file(job, "/nonexistent-dir/a.safetensors", 1, names, &a, 0, NULL, NULL, now), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_add_file(job, tmp_path("b.safetensors"), 1, names, &a, 0, NULL, NULL, now), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_add_text(job, tmp_path("never"), "x", 1), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_start(job), DLUA_OK);
  ck_assert_int_eq(dlua_ckpt_job_wait(job), DLUA_ERR_IO);
  ck_assert(tu_err_has("/nonexistent-dir/a.safetensors"));
  ck_assert_int_eq(access(tmp_path("b.safetensors"), F_OK), -1);
  ck_assert_int_eq(access(tmp_path("never"), F_OK), -1);
  ck_assert_int_eq(dlua_memory_allocated(DLUA_CPU), base);  // skipped snapshots are freed too
  dlua_ckpt_job_free(job);
  dlua_tensor_free(a);
}
END_TEST

START_TEST(test_dir_helpers) {
  char dir[400];
  snprintf(dir, sizeof dir, "%s/a/b/step-000001", tmpdir);
  ck_assert_int_eq(dlua_io_mkdirs(dir), DLUA_OK);
  ck_assert_int_eq(dlua_io_mkdirs(dir), DLUA_OK);  // exists: fine
  char file[450];
  snprintf(file, sizeof file, "%s/x.txt", dir);
  ck_assert_int_eq(dlua_io_write_file(file, "hello", 5), DLUA_OK);
  char *names = NULL;
  size_t len = 0;
  ck_assert_int_eq(dlua_io_list_dir(dir, &names, &len), DLUA_OK);
  ck_assert_uint_eq(len, 6);
  ck_assert_str_eq(names, "x.txt");
  dlua_io_free(names);
  ck_assert_int_eq(dlua_io_remove_dir(dir), DLUA_OK);
  ck_assert_int_eq(access(dir, F_OK), -1);
  ck_assert_int_eq(dlua_io_list_dir(dir, &names, &len), DLUA_OK);  // gone: no names
  ck_assert_uint_eq(len, 0);
  ck_assert_uint_eq(dlua_crc32(0, "123456789", 9), 0xCBF43926u);  // the CRC-32 check value
}
END_TEST

int main(void) {
  Suite *s = suite_create("safetensors");
  TCase *tc = tcase_create("io");
  tcase_add_checked_fixture(tc, make_tmpdir, remove_tmpdir);
  tcase_set_timeout(tc, 60);
  if (!dlua_ckpt_available()) {
    printf("skip: checkpoints are off (built without cJSON)\n");
    return 0;
  }
  tcase_add_test(tc, test_every_dtype_round_trip);
  tcase_add_test(tc, test_views_and_channels_last_written_logically);
  tcase_add_test(tc, test_empty_scalar_and_no_tensors);
  tcase_add_test(tc, test_foreign_file_without_checksums);
  tcase_add_test(tc, test_truncated_files);
  tcase_add_test(tc, test_corrupt_headers);
  tcase_add_test(tc, test_checksum_mismatch_names_tensor);
  tcase_add_test(tc, test_destination_mismatch);
  tcase_add_test(tc, test_atomic_replacement_and_abort);
  tcase_add_test(tc, test_writer_argument_errors);
  tcase_add_test(tc, test_background_job_snapshot_and_memory);
  tcase_add_test(tc, test_deferred_snapshot);
  tcase_add_test(tc, test_failed_step_skips_the_rest);
  tcase_add_test(tc, test_dir_helpers);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

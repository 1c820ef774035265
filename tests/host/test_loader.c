/* Check suite for host/data/folder.c and loader.c: ImageFolder order, cache and errors; batches identical for any worker count; bad files skipped and counted; stopping mid-epoch joins every thread; batches outlive their loader. Also run under valgrind (tests/CMakeLists.txt). */
#include <check.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/api.h"
#include "core/tensor.h"

#include "testutil.h"

static char g_root[64];
static char g_cache[64];

static void put_file(const char *rel, const void *data, size_t n) {
  char p[256];
  snprintf(p, sizeof p, "%s/%s", g_root, rel);
  FILE *f = fopen(p, "wb");
  ck_assert_ptr_nonnull(f);
  if (n) fwrite(data, 1, n, f);
  fclose(f);
}

static void put_jpeg(const char *rel, int h, int w, int seed) {
  int64_t sz[3] = {h, w, 3};
  dlua_tensor_t *img = tu_new_t(3, sz, DLUA_DTYPE_U8);
  uint8_t *p = dlua_tensor_data(img);
  for (int i = 0; i < h * w * 3; i++) p[i] = (uint8_t)(seed * 31 + i * 3 + (i / (w * 3)) * 5);
  char path[256];
  snprintf(path, sizeof path, "%s/%s", g_root, rel);
  ck_assert_int_eq(dlua_image_write_jpeg(img, path, 90), DLUA_OK);
  dlua_tensor_free(img);
}

static void mkdir_rel(const char *rel) {
  char p[256];
  snprintf(p, sizeof p, "%s/%s", g_root, rel);
  ck_assert_int_eq(mkdir(p, 0755), 0);
}

static void rm_tree(const char *path) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  ck_assert_int_eq(system(cmd), 0);
}

/* root/b/{1..5}.jpg + b/sub/0.jpg, root/a/{1..4}.jpg + bad files, root/c/x.png; notes.txt ignored. */
static void make_tree(void) {
  strcpy(g_root, "/tmp/dlua_test_loader_XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(g_root));
  snprintf(g_cache, sizeof g_cache, "%s.cache", g_root);
  mkdir_rel("a");
  mkdir_rel("b");
  mkdir_rel("b/sub");
  mkdir_rel("c");
  char name[64];
  for (int i = 1; i <= 4; i++) {
    snprintf(name, sizeof name, "a/%d.jpg", i);
    put_jpeg(name, 20 + i, 30 - i, i);
  }
  for (int i = 1; i <= 5; i++) {
    snprintf(name, sizeof name, "b/%d.JPG", i);
    put_jpeg(name, 24, 24, 10 + i);
  }
  put_jpeg("b/sub/0.jpeg", 18, 26, 99);
  int64_t sz[3] = {12, 14, 3};
  dlua_tensor_t *img = tu_new_t(3, sz, DLUA_DTYPE_U8);
  memset(dlua_tensor_data(img), 77, 12 * 14 * 3);
  char path[256];
  snprintf(path, sizeof path, "%s/c/x.png", g_root);
  ck_assert_int_eq(dlua_image_write_png(img, path), DLUA_OK);
  dlua_tensor_free(img);
  put_file("a/notes.txt", "not listed", 10);
}

static void add_bad_files(void) {
  uint8_t junk[300];
  for (int i = 0; i < 300; i++) junk[i] = (uint8_t)(i * 91 + 7);
  put_file("a/zz_corrupt.jpg", junk, sizeof junk);
  put_file("a/zz_empty.jpg", "", 0);
  put_file("a/zz_text.png", "hello, I am text", 16);
  // Truncated: the first half of a good JPEG.
  char src[256], dst[256];
  snprintf(src, sizeof src, "%s/a/1.jpg", g_root);
  snprintf(dst, sizeof dst, "%s/a/zz_truncated.jpg", g_root);
  FILE *f = fopen(src, "rb");
  uint8_t buf[8192];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  f = fopen(dst, "wb");
  fwrite(buf, 1, n / 2, f);
  fclose(f);
}

START_TEST(test_folder_order_cache_and_errors) {
  make_tree();
  dlua_folder_t *f = NULL;
  ck_assert_int_eq(dlua_folder_open(&f, g_root, g_cache), DLUA_OK);
  ck_assert_int_eq(dlua_folder_size(f), 11);
  ck_assert_int_eq(dlua_folder_num_classes(f), 3);
  ck_assert_str_eq(dlua_folder_class(f, 0), "a");
  ck_assert_str_eq(dlua_folder_class(f, 2), "c");
  // torchvision's order: by folder, then name; class b's own files before b/sub's.
  ck_assert_str_eq(dlua_folder_file(f, 0), "a/1.jpg");
  ck_assert_str_eq(dlua_folder_file(f, 4), "b/1.JPG");
  ck_assert_str_eq(dlua_folder_file(f, 9), "b/sub/0.jpeg");
  ck_assert_str_eq(dlua_folder_file(f, 10), "c/x.png");
  ck_assert_int_eq(dlua_folder_label(f, 9), 1);
  ck_assert_int_eq(dlua_folder_label(f, 10), 2);
  ck_assert_int_eq(dlua_folder_cached(f), 0);
  dlua_folder_free(f);
  // Reopened: from the cache, same list.
  ck_assert_int_eq(dlua_folder_open(&f, g_root, g_cache), DLUA_OK);
  ck_assert_int_eq(dlua_folder_cached(f), 1);
  ck_assert_int_eq(dlua_folder_size(f), 11);
  ck_assert_str_eq(dlua_folder_file(f, 9), "b/sub/0.jpeg");
  dlua_folder_free(f);
  // A new file in a nested folder changes that folder's mtime: rescanned.
  sleep(0);  // mtimes have nanoseconds here; no sleep needed on ext4/overlayfs
  put_jpeg("b/sub/1.jpg", 16, 16, 5);
  ck_assert_int_eq(dlua_folder_open(&f, g_root, g_cache), DLUA_OK);
  ck_assert_int_eq(dlua_folder_cached(f), 0);
  ck_assert_int_eq(dlua_folder_size(f), 12);
  dlua_folder_free(f);
  // An empty class folder is an error naming it; so is a root without class folders.
  mkdir_rel("d_empty");
  ck_assert_int_eq(dlua_folder_open(&f, g_root, ""), DLUA_ERR_ARG);
  ck_assert_msg(tu_err_has("d_empty") && tu_err_has("holds no image"), "%s", dlua_last_error());
  ck_assert_ptr_null(f);
  char empty[128];
  snprintf(empty, sizeof empty, "%s/d_empty", g_root);
  ck_assert_int_eq(dlua_folder_open(&f, empty, ""), DLUA_ERR_ARG);
  ck_assert_msg(tu_err_has("no class folders") && tu_err_has("d_empty"), "%s", dlua_last_error());
  ck_assert_int_eq(dlua_folder_open(&f, "/nonexistent/x", ""), DLUA_ERR_IO);
  ck_assert(tu_err_has("/nonexistent/x"));
  rm_tree(g_root);
  rm_tree(g_cache);
}
END_TEST

static dlua_pipeline_t *crop_pipeline(void) {
  dlua_transform_t ops[3] = {
      {.kind = DLUA_TF_RANDOM_RESIZED_CROP, .h = 16, .w = 12, .scale = {0.08, 1.0}, .ratio = {0.75, 4.0 / 3}},
      {.kind = DLUA_TF_HFLIP, .p = 0.5},
      {.kind = DLUA_TF_TO_TENSOR, .dtype = DLUA_DTYPE_F32}};
  dlua_pipeline_t *p = NULL;
  ck_assert_int_eq(dlua_pipeline_new(&p, ops, 3), DLUA_OK);
  return p;
}

/* Runs an epoch and returns a copy of every batch's x and y, concatenated. */
static void run_epoch(dlua_loader_t *l, const int64_t *order, int64_t n, uint64_t epoch, float **xs, int64_t **ys,
                      int64_t *count, int64_t *batches) {
  ck_assert_int_eq(dlua_loader_start(l, order, n, 0, epoch, 0), DLUA_OK);
  *xs = NULL;
  *ys = NULL;
  *count = 0;
  *batches = 0;
  for (;;) {
    dlua_tensor_t *x = NULL, *y = NULL;
    int64_t b = -1;
    ck_assert_int_eq(dlua_loader_next(l, &x, &y, &b), DLUA_OK);
    if (!x) break;
    ck_assert_int_eq(b, *batches);
    int64_t k = x->sizes[0], per = dlua_tensor_numel(x) / k;
    *xs = realloc(*xs, (size_t)(*count + k) * per * sizeof(float));
    *ys = realloc(*ys, (size_t)(*count + k) * sizeof(int64_t));
    memcpy(*xs + *count * per, dlua_tensor_data(x), (size_t)k * per * sizeof(float));
    memcpy(*ys + *count, dlua_tensor_data(y), (size_t)k * sizeof(int64_t));
    *count += k;
    (*batches)++;
    dlua_tensor_free(x);
    dlua_tensor_free(y);
  }
  ck_assert_int_eq(dlua_loader_live_threads(), 0);  // the epoch's end joined them
}

START_TEST(test_loader_workers_skip_and_stop) {
  make_tree();
  add_bad_files();
  dlua_folder_t *f = NULL;
  ck_assert_int_eq(dlua_folder_open(&f, g_root, ""), DLUA_OK);
  ck_assert_int_eq(dlua_folder_size(f), 15);  // 4 bad files among them
  dlua_pipeline_t *p = crop_pipeline();
  int64_t order[15];
  for (int i = 0; i < 15; i++) order[i] = (i * 7) % 15;
  float *ref_x = NULL;
  int64_t *ref_y = NULL, ref_n = 0, ref_b = 0;
  const int workers[3] = {0, 1, 4};
  for (int wi = 0; wi < 3; wi++) {
    dlua_loader_config_t cfg = {.folder = f, .pipeline = p, .batch = 4, .workers = workers[wi], .prefetch = 2,
                                .dct_scaling = 1, .quiet = 1, .seed = 11, .label_base = 1};
    dlua_loader_t *l = NULL;
    ck_assert_int_eq(dlua_loader_new(&l, &cfg), DLUA_OK);
    int64_t sz[8];
    int dt = -1;
    ck_assert_int_eq(dlua_loader_sample_shape(l, sz, &dt), 3);
    ck_assert(sz[0] == 3 && sz[1] == 16 && sz[2] == 12 && dt == DLUA_DTYPE_F32);
    float *xs;
    int64_t *ys, n, nb;
    for (int epoch = 1; epoch <= 2; epoch++) {
      run_epoch(l, order, 15, (uint64_t)epoch, &xs, &ys, &n, &nb);
      ck_assert_int_eq(n, 11);  // 15 files, 4 skipped
      ck_assert_int_eq(nb, 4);  // batches stay in place, shorter where a sample was skipped
      if (epoch == 1 && wi == 0) {
        ref_x = xs;
        ref_y = ys;
        ref_n = n;
        ref_b = nb;
        continue;
      }
      if (epoch == 1) {
        ck_assert_int_eq(n, ref_n);
        ck_assert_int_eq(memcmp(ys, ref_y, (size_t)n * sizeof(int64_t)), 0);
        ck_assert_msg(memcmp(xs, ref_x, (size_t)n * 3 * 16 * 12 * sizeof(float)) == 0,
                      "%d workers gave other pixels than 0 workers", workers[wi]);
      } else {
        ck_assert_int_eq(memcmp(ys, ref_y, (size_t)n * sizeof(int64_t)), 0);  // same order given
        ck_assert_msg(memcmp(xs, ref_x, (size_t)n * 3 * 16 * 12 * sizeof(float)) != 0, "epoch 2 drew the same crops");
      }
      free(xs);
      free(ys);
    }
    dlua_loader_stats_t st;
    dlua_loader_get_stats(l, &st);
    ck_assert_int_eq(st.skipped, 8);    // 4 per epoch
    ck_assert_int_eq(st.bad_files, 4);  // each named once
    ck_assert_int_eq(st.decoded, 22);
    int seen[4] = {0};
    for (int i = 0; i < 4; i++) {
      const char *m = dlua_loader_bad_file(l, i);
      ck_assert_ptr_nonnull(m);
      seen[0] += strstr(m, "zz_corrupt.jpg") != NULL;
      seen[1] += strstr(m, "zz_empty.jpg") != NULL;
      seen[2] += strstr(m, "zz_text.png") != NULL;
      seen[3] += strstr(m, "zz_truncated.jpg") != NULL;
    }
    ck_assert(seen[0] == 1 && seen[1] == 1 && seen[2] == 1 && seen[3] == 1);
    ck_assert_ptr_null(dlua_loader_bad_file(l, 4));
    // Stop in the middle of an epoch: every thread joined at once.
    ck_assert_int_eq(dlua_loader_start(l, order, 15, 0, 3, 0), DLUA_OK);
    dlua_tensor_t *x = NULL, *y = NULL;
    ck_assert_int_eq(dlua_loader_next(l, &x, &y, NULL), DLUA_OK);
    ck_assert_ptr_nonnull(x);
    dlua_loader_stop(l);
    ck_assert_int_eq(dlua_loader_live_threads(), 0);
    // Started again and freed mid-epoch, with a batch still held: it stays valid.
    ck_assert_int_eq(dlua_loader_start(l, order, 15, 0, 4, 1), DLUA_OK);
    dlua_tensor_t *x2 = NULL;
    ck_assert_int_eq(dlua_loader_next(l, &x2, NULL, NULL), DLUA_OK);
    dlua_loader_free(l);
    ck_assert_int_eq(dlua_loader_live_threads(), 0);
    const float *q = dlua_tensor_data(x2);
    double s = 0;
    for (int64_t i = 0; i < dlua_tensor_numel(x2); i++) s += q[i];
    ck_assert(s > 0);
    dlua_tensor_free(x2);
    dlua_tensor_free(x);
    dlua_tensor_free(y);
  }
  free(ref_x);
  free(ref_y);
  (void)ref_b;
  dlua_pipeline_free(p);
  dlua_folder_free(f);
  rm_tree(g_root);
}
END_TEST

START_TEST(test_loader_tensors_and_synthetic) {
  // In memory: x (N, 2, 3) float32 gathered raw in the given order, y passed through.
  enum { N = 10 };
  int64_t xs[3] = {N, 2, 3}, ysz[1] = {N};
  dlua_tensor_t *x = tu_new_t(3, xs, DLUA_DTYPE_F32), *y = tu_new_t(1, ysz, DLUA_DTYPE_I64);
  float *xp = dlua_tensor_data(x);
  int64_t *yp = dlua_tensor_data(y);
  for (int i = 0; i < N * 6; i++) xp[i] = (float)i;
  for (int i = 0; i < N; i++) yp[i] = 100 + i;
  dlua_loader_config_t cfg = {.x = x, .y = y, .batch = 3, .workers = 2, .prefetch = 1, .quiet = 1};
  dlua_loader_t *l = NULL;
  ck_assert_int_eq(dlua_loader_new(&l, &cfg), DLUA_OK);
  dlua_tensor_free(x);  // the loader holds its own reference
  dlua_tensor_free(y);
  int64_t order[N];
  for (int i = 0; i < N; i++) order[i] = N - i;  // 1-based, reversed
  ck_assert_int_eq(dlua_loader_start(l, order, N, 1, 1, 1), DLUA_OK);  // drop_last: 3 batches
  int batches = 0;
  for (;;) {
    dlua_tensor_t *bx = NULL, *by = NULL;
    ck_assert_int_eq(dlua_loader_next(l, &bx, &by, NULL), DLUA_OK);
    if (!bx) break;
    ck_assert_int_eq(bx->sizes[0], 3);
    const float *q = dlua_tensor_data(bx);
    const int64_t *lab = dlua_tensor_data(by);
    for (int k = 0; k < 3; k++) {
      int idx = N - 1 - (batches * 3 + k);
      ck_assert_int_eq(lab[k], 100 + idx);
      for (int e = 0; e < 6; e++) ck_assert(q[k * 6 + e] == (float)(idx * 6 + e));
    }
    dlua_tensor_free(bx);
    dlua_tensor_free(by);
    batches++;
  }
  ck_assert_int_eq(batches, 3);
  // An order outside the dataset is an error naming the position.
  order[4] = N + 1;
  ck_assert_int_eq(dlua_loader_start(l, order, N, 1, 1, 0), DLUA_ERR_ARG);
  ck_assert(tu_err_has("outside the dataset"));
  dlua_loader_free(l);

  // Synthetic images: deterministic, labels i % classes + base.
  dlua_loader_config_t sc = {.synthetic_n = 7, .synthetic_shape = {3, 8, 5}, .synthetic_classes = 3, .batch = 7,
                             .workers = 3, .prefetch = 2, .seed = 4, .label_base = 1};
  ck_assert_int_eq(dlua_loader_new(&l, &sc), DLUA_OK);
  int64_t o7[7] = {0, 1, 2, 3, 4, 5, 6};
  ck_assert_int_eq(dlua_loader_start(l, o7, 7, 0, 1, 0), DLUA_OK);
  dlua_tensor_t *a = NULL, *la = NULL, *b = NULL;
  ck_assert_int_eq(dlua_loader_next(l, &a, &la, NULL), DLUA_OK);
  ck_assert(a->sizes[0] == 7 && a->sizes[1] == 3 && a->sizes[2] == 8 && a->sizes[3] == 5 && a->dtype == DLUA_DTYPE_F32);
  ck_assert_int_eq(((int64_t *)dlua_tensor_data(la))[4], 4 % 3 + 1);
  ck_assert_int_eq(dlua_loader_start(l, o7, 7, 0, 2, 0), DLUA_OK);
  ck_assert_int_eq(dlua_loader_next(l, &b, NULL, NULL), DLUA_OK);
  ck_assert_int_eq(memcmp(dlua_tensor_data(a), dlua_tensor_data(b), 7 * 3 * 8 * 5 * sizeof(float)), 0);
  dlua_tensor_free(a);
  dlua_tensor_free(la);
  dlua_tensor_free(b);
  dlua_loader_free(l);

  // Config errors.
  dlua_loader_config_t none = {.batch = 1, .prefetch = 1};
  tu_expect_error(dlua_loader_new(&l, &none), "exactly one dataset");
  sc.prefetch = 0;
  tu_expect_error(dlua_loader_new(&l, &sc), "prefetch");
  ck_assert_int_eq(dlua_loader_live_threads(), 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("loader");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);  // also run under valgrind
  tcase_add_test(tc, test_folder_order_cache_and_errors);
  tcase_add_test(tc, test_loader_workers_skip_and_stop);
  tcase_add_test(tc, test_loader_tensors_and_synthetic);
  suite_add_tcase(s, tc);
  return tu_run(s);
}

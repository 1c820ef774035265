/* safetensors without cJSON at build time: every entry point says that checkpoints are off and how to turn them on. */
#include "io/safetensors.h"
#include <string.h>
#include "core/error.h"

#define OFF DLUA_ERR(DLUA_ERR_ARG, "checkpoints are off: dlua was built without cJSON (apt-get install libcjson-dev, then reconfigure: rm build/CMakeCache.txt && bash scripts/build.sh)")

int dlua_ckpt_available(void) { return 0; }
const char *dlua_st_dtype_name(int dtype) { return NULL; }
int dlua_st_dtype_from_name(const char *name) { return -1; }
void dlua_st_writer_set_interruptible(dlua_st_writer_t *w, int on) {}

dlua_status_t dlua_st_writer_open(dlua_st_writer_t **out, const char *path, int64_t n, const char *const *names, const int *dtypes,
                                  const int *ndims, const int64_t *sizes, int64_t nmeta, const char *const *keys,
                                  const char *const *values) {
  if (out) *out = NULL;
  return OFF;
}
dlua_status_t dlua_st_writer_put(dlua_st_writer_t *w, int64_t i, const dlua_tensor_t *t) { return OFF; }
dlua_status_t dlua_st_writer_put_bytes(dlua_st_writer_t *w, int64_t i, const void *data, size_t bytes) { return OFF; }
dlua_status_t dlua_st_writer_commit(dlua_st_writer_t *w) { return OFF; }
void dlua_st_writer_free(dlua_st_writer_t *w) {}
dlua_status_t dlua_st_save(const char *path, int64_t n, const char *const *names, dlua_tensor_t *const *tensors, int64_t nmeta,
                           const char *const *keys, const char *const *values) {
  return OFF;
}

dlua_status_t dlua_st_open(dlua_st_file_t **out, const char *path) {
  if (out) *out = NULL;
  return OFF;
}
void dlua_st_close(dlua_st_file_t *f) {}
const char *dlua_st_path(const dlua_st_file_t *f) { return NULL; }
int64_t dlua_st_count(const dlua_st_file_t *f) { return 0; }
int64_t dlua_st_find(const dlua_st_file_t *f, const char *name) { return -1; }
const char *dlua_st_name(const dlua_st_file_t *f, int64_t i) { return NULL; }
int dlua_st_dtype(const dlua_st_file_t *f, int64_t i) { return -1; }
int dlua_st_ndim(const dlua_st_file_t *f, int64_t i) { return -1; }
const int64_t *dlua_st_sizes(const dlua_st_file_t *f, int64_t i) { return NULL; }
int dlua_st_has_crc(const dlua_st_file_t *f, int64_t i) { return 0; }
int64_t dlua_st_file_bytes(const dlua_st_file_t *f) { return 0; }
int64_t dlua_st_metadata_count(const dlua_st_file_t *f) { return 0; }
const char *dlua_st_metadata_key(const dlua_st_file_t *f, int64_t i) { return NULL; }
const char *dlua_st_metadata_value(const dlua_st_file_t *f, int64_t i) { return NULL; }
dlua_status_t dlua_st_verify(dlua_st_file_t *f, int64_t i) { return OFF; }
dlua_status_t dlua_st_read(dlua_st_file_t *f, int64_t i, dlua_tensor_t **out) { return OFF; }
dlua_status_t dlua_st_read_into(dlua_st_file_t *f, int64_t i, dlua_tensor_t *dst) { return OFF; }

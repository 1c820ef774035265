/* The CUDA device layer of a build without CUDA: zero devices, every call a clear error. */
#include <stddef.h>
#include <stdint.h>
#include "core/api.h"
#include "core/error.h"

static const char reason[] = "built without CUDA";

static dlua_status_t none(const char *op) {
  return DLUA_ERR(DLUA_ERR_ARG, "%s: no CUDA device available (%s)", op, reason);
}

int dlua_cuda_device_count(void) { return 0; }
const char *dlua_cuda_unavailable_reason(void) { return reason; }
dlua_status_t dlua_cuda_set_device(int device) { return none("set_device"); }
dlua_status_t dlua_cuda_get_device(int *device) {
  *device = -1;
  return none("current_device");
}
dlua_status_t dlua_cuda_synchronize(int device) { return none("synchronize"); }
dlua_status_t dlua_cuda_get_device_capability(int device, int *major, int *minor) {
  *major = *minor = 0;
  return none("get_device_capability");
}
const char *dlua_cuda_runtime_info(void) { return "no CUDA device available (built without CUDA)"; }

dlua_status_t dlua_cuda_stream_create(dlua_cuda_stream_t **out, int device) {
  *out = NULL;
  return none("Stream");
}
void dlua_cuda_stream_destroy(dlua_cuda_stream_t *s) {}
int dlua_cuda_stream_device(const dlua_cuda_stream_t *s) { return -1; }
dlua_status_t dlua_cuda_stream_synchronize(dlua_cuda_stream_t *s) { return none("Stream:synchronize"); }
dlua_status_t dlua_cuda_stream_query(dlua_cuda_stream_t *s, int *done) {
  *done = 1;
  return none("Stream:query");
}
dlua_status_t dlua_cuda_stream_wait_event(dlua_cuda_stream_t *s, dlua_cuda_event_t *e) { return none("Stream:wait"); }
dlua_status_t dlua_cuda_set_current_stream(int device, dlua_cuda_stream_t *s) { return none("set_stream"); }
dlua_cuda_stream_t *dlua_cuda_current_stream(int device) { return NULL; }
dlua_status_t dlua_cuda_event_create(dlua_cuda_event_t **out, int device, int enable_timing) {
  *out = NULL;
  return none("Event");
}
void dlua_cuda_event_destroy(dlua_cuda_event_t *e) {}
dlua_status_t dlua_cuda_event_record(dlua_cuda_event_t *e, dlua_cuda_stream_t *s) { return none("Event:record"); }
dlua_status_t dlua_cuda_event_query(dlua_cuda_event_t *e, int *done) {
  *done = 1;
  return none("Event:query");
}
dlua_status_t dlua_cuda_event_synchronize(dlua_cuda_event_t *e) { return none("Event:synchronize"); }
dlua_status_t dlua_cuda_event_elapsed(const dlua_cuda_event_t *start, const dlua_cuda_event_t *end, double *ms) {
  *ms = 0;
  return none("Event:elapsed_time");
}

dlua_status_t dlua_cuda_memory_stats(int device, dlua_memory_stats_t *out) {
  *out = (dlua_memory_stats_t){0};
  return none("memory_stats");
}
dlua_status_t dlua_cuda_reset_peak_memory_stats(int device) { return none("reset_peak_memory_stats"); }
dlua_status_t dlua_cuda_empty_cache(int device) { return none("empty_cache"); }
dlua_status_t dlua_cuda_malloc(void **ptr, int device, size_t bytes, dlua_cuda_stream_t *stream) {
  *ptr = NULL;
  return none("cuda alloc");
}
dlua_status_t dlua_cuda_free(int device, void *ptr) { return ptr ? none("cuda free") : DLUA_OK; }
dlua_status_t dlua_cuda_record_stream(int device, void *ptr, dlua_cuda_stream_t *stream) { return none("record_stream"); }
dlua_status_t dlua_cuda_host_alloc(void **ptr, size_t bytes) {
  *ptr = NULL;
  return none("pin_memory");
}
dlua_status_t dlua_cuda_host_free(void *ptr) { return ptr ? none("pinned free") : DLUA_OK; }
dlua_status_t dlua_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int async, dlua_cuda_stream_t *stream) {
  return none("cuda memcpy");
}
static int allow_tf32;  // kept so the setting reads back even without CUDA
void dlua_cuda_set_allow_tf32(int allow) { allow_tf32 = allow ? 1 : 0; }
int dlua_cuda_get_allow_tf32(void) { return allow_tf32; }

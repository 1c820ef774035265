/* JSON without cJSON at build time: building or parsing says that JSON is off and how to turn it on. */
#include "io/json.h"
#include "core/error.h"

#define OFF DLUA_ERR(DLUA_ERR_ARG, "JSON is off: dlua was built without cJSON (apt-get install libcjson-dev, then reconfigure: rm build/CMakeCache.txt && bash scripts/build.sh)")

int dlua_json_available(void) { return 0; }
dlua_status_t dlua_json_new(dlua_json_t **out, int kind, double number, const char *text, size_t len) {
  if (out) *out = NULL;
  return OFF;
}
dlua_status_t dlua_json_add(dlua_json_t *parent, const char *key, size_t len, dlua_json_t *child) { return OFF; }
dlua_status_t dlua_json_print(const dlua_json_t *node, char **out) {
  if (out) *out = NULL;
  return OFF;
}
void dlua_json_free_text(char *text) {}
void dlua_json_free(dlua_json_t *node) {}
dlua_status_t dlua_json_parse(const char *text, size_t len, dlua_json_t **out) {
  if (out) *out = NULL;
  return OFF;
}
int dlua_json_kind(const dlua_json_t *node) { return DLUA_JSON_NULL; }
double dlua_json_number(const dlua_json_t *node) { return 0.0; }
const char *dlua_json_string(const dlua_json_t *node) { return NULL; }
const char *dlua_json_key(const dlua_json_t *node) { return NULL; }
const dlua_json_t *dlua_json_first(const dlua_json_t *node) { return NULL; }
const dlua_json_t *dlua_json_next(const dlua_json_t *node) { return NULL; }

/* JSON trees through cJSON: nodes built one by one from Lua, printed on one line; text parsed and walked. */
#include "io/json.h"
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/error.h"

/* dlua_json_t is cJSON itself: the handle is a cJSON node. */
static cJSON *node_of(const dlua_json_t *n) { return (cJSON *)n; }

int dlua_json_available(void) { return 1; }

/* cJSON keeps strings NUL-terminated: a copy of len bytes, refusing NULs inside. */
static char *text_copy(const char *text, size_t len, const char *what) {
  if (text == NULL && len > 0) {
    DLUA_ERR(DLUA_ERR_ARG, "json: %s is NULL", what);
    return NULL;
  }
  if (len > 0 && memchr(text, '\0', len) != NULL) {
    DLUA_ERR(DLUA_ERR_ARG, "json: %s holds a NUL byte (JSON text cannot carry it through cJSON)", what);
    return NULL;
  }
  char *s = cJSON_malloc(len + 1);
  if (s == NULL) {
    DLUA_ERR(DLUA_ERR_OOM, "json: out of memory copying a %s of %zu bytes", what, len);
    return NULL;
  }
  if (len > 0) memcpy(s, text, len);
  s[len] = '\0';
  return s;
}

/* A number as the shortest text that reads back as the same double. cJSON 1.7.15 prints 15 digits
   whenever they read back within a relative epsilon, which loses the last bits (0.30000000000000004
   prints as 0.3); a raw node carries our text instead. NaN and infinities are null, as cJSON has them. */
static cJSON *number_node(double v) {
  if (!isfinite(v)) return cJSON_CreateNull();
  char buf[32];
  for (int digits = 15; digits <= 17; digits++) {
    snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (strtod(buf, NULL) == v) break;
  }
  cJSON *n = cJSON_CreateRaw(buf);
  if (n) n->valuedouble = v;
  return n;
}

dlua_status_t dlua_json_new(dlua_json_t **out, int kind, double number, const char *text, size_t len) {
  if (out == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_new: out is NULL");
  *out = NULL;
  cJSON *n = NULL;
  switch (kind) {
    case DLUA_JSON_NULL: n = cJSON_CreateNull(); break;
    case DLUA_JSON_FALSE: n = cJSON_CreateFalse(); break;
    case DLUA_JSON_TRUE: n = cJSON_CreateTrue(); break;
    case DLUA_JSON_NUMBER: n = number_node(number); break;
    case DLUA_JSON_ARRAY: n = cJSON_CreateArray(); break;
    case DLUA_JSON_OBJECT: n = cJSON_CreateObject(); break;
    case DLUA_JSON_STRING: {
      char *s = text_copy(text, len, "string");
      if (s == NULL) return dlua_last_status();
      n = cJSON_CreateString("");
      if (n == NULL) {
        cJSON_free(s);
        break;
      }
      cJSON_free(n->valuestring);  // ours holds exactly len bytes (cJSON's would stop at the first NUL)
      n->valuestring = s;
      break;
    }
    default: return DLUA_ERR(DLUA_ERR_ARG, "json_new: unknown kind %d (expected 0..6)", kind);
  }
  if (n == NULL) return DLUA_ERR(DLUA_ERR_OOM, "json_new: out of memory");
  *out = (dlua_json_t *)n;
  return DLUA_OK;
}

dlua_status_t dlua_json_add(dlua_json_t *parent, const char *key, size_t len, dlua_json_t *child) {
  cJSON *p = node_of(parent), *c = node_of(child);
  if (c == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_add: child is NULL");
  if (p == NULL || c->prev != NULL || c->next != NULL || c == p) {
    cJSON_Delete(c);
    return DLUA_ERR(DLUA_ERR_ARG, "json_add: %s", p == NULL ? "parent is NULL" : "the child already has a parent");
  }
  if (cJSON_IsObject(p)) {
    if (key == NULL) {
      cJSON_Delete(c);
      return DLUA_ERR(DLUA_ERR_ARG, "json_add: an object member needs a key");
    }
    char *k = text_copy(key, len, "key");
    if (k == NULL) {
      cJSON_Delete(c);
      return dlua_last_status();
    }
    // cJSON_AddItemToObject copies the key; adding with a constant key and handing ours over avoids a second copy
    if (!cJSON_AddItemToObjectCS(p, k, c)) {
      cJSON_free(k);
      cJSON_Delete(c);
      return DLUA_ERR(DLUA_ERR_OOM, "json_add: out of memory");
    }
    c->type &= ~cJSON_StringIsConst;  // the key is ours to free with the node
    return DLUA_OK;
  }
  if (cJSON_IsArray(p)) {
    if (key != NULL) {
      cJSON_Delete(c);
      return DLUA_ERR(DLUA_ERR_ARG, "json_add: an array element takes no key");
    }
    if (!cJSON_AddItemToArray(p, c)) {
      cJSON_Delete(c);
      return DLUA_ERR(DLUA_ERR_OOM, "json_add: out of memory");
    }
    return DLUA_OK;
  }
  cJSON_Delete(c);
  return DLUA_ERR(DLUA_ERR_ARG, "json_add: the parent is neither an array nor an object");
}

dlua_status_t dlua_json_print(const dlua_json_t *node, char **out) {
  if (out == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_print: out is NULL");
  *out = NULL;
  if (node == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_print: node is NULL");
  char *s = cJSON_PrintUnformatted(node_of(node));
  if (s == NULL) return DLUA_ERR(DLUA_ERR_OOM, "json_print: out of memory");
  *out = s;
  return DLUA_OK;
}

void dlua_json_free_text(char *text) {
  if (text) cJSON_free(text);
}

void dlua_json_free(dlua_json_t *node) {
  if (node) cJSON_Delete(node_of(node));
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

dlua_status_t dlua_json_parse(const char *text, size_t len, dlua_json_t **out) {
  if (out == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_parse: out is NULL");
  *out = NULL;
  if (text == NULL) return DLUA_ERR(DLUA_ERR_ARG, "json_parse: text is NULL");
  const char *end = NULL;
  cJSON *n = cJSON_ParseWithLengthOpts(text, len, &end, 0);
  if (n == NULL) {
    size_t at = end != NULL && end >= text ? (size_t)(end - text) : 0;
    if (at >= len) return DLUA_ERR(DLUA_ERR_ARG, "the text ends early (%zu bytes)", len);
    return DLUA_ERR(DLUA_ERR_ARG, "invalid JSON at byte %zu (of %zu)", at + 1, len);
  }
  size_t at = (size_t)(end - text);
  while (at < len && is_space(text[at])) at++;
  if (at < len) {
    cJSON_Delete(n);
    return DLUA_ERR(DLUA_ERR_ARG, "unexpected text after the value at byte %zu (of %zu)", at + 1, len);
  }
  *out = (dlua_json_t *)n;
  return DLUA_OK;
}

int dlua_json_kind(const dlua_json_t *node) {
  const cJSON *n = node_of(node);
  if (n == NULL || cJSON_IsNull(n)) return DLUA_JSON_NULL;
  if (cJSON_IsFalse(n)) return DLUA_JSON_FALSE;
  if (cJSON_IsTrue(n)) return DLUA_JSON_TRUE;
  if (cJSON_IsNumber(n) || cJSON_IsRaw(n)) return DLUA_JSON_NUMBER;  // raw: a number we built
  if (cJSON_IsString(n)) return DLUA_JSON_STRING;
  if (cJSON_IsArray(n)) return DLUA_JSON_ARRAY;
  return DLUA_JSON_OBJECT;
}

double dlua_json_number(const dlua_json_t *node) { return node ? node_of(node)->valuedouble : 0.0; }
const char *dlua_json_string(const dlua_json_t *node) { return node ? node_of(node)->valuestring : NULL; }
const char *dlua_json_key(const dlua_json_t *node) { return node ? node_of(node)->string : NULL; }
const dlua_json_t *dlua_json_first(const dlua_json_t *node) { return node ? (const dlua_json_t *)node_of(node)->child : NULL; }
const dlua_json_t *dlua_json_next(const dlua_json_t *node) { return node ? (const dlua_json_t *)node_of(node)->next : NULL; }

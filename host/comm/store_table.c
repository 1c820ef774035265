/* The store server's key-value table: FNV-1a hashed chains, doubled when as full as it is wide. */
#include "comm/store_table.h"

#include <stdlib.h>
#include <string.h>

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: keys are short, collisions only cost a compare
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static dlua_store_entry_t **table_slot(dlua_store_table_t *t, const uint8_t *key, size_t len, uint64_t h) {
  dlua_store_entry_t **e = &t->buckets[h & (t->nbuckets - 1)];
  while (*e && !((*e)->hash == h && (*e)->key_len == len && memcmp((*e)->key, key, len) == 0)) e = &(*e)->next;
  return e;
}

dlua_store_entry_t *dlua_store_table_find(dlua_store_table_t *t, const blob_t *key) {
  if (t->count == 0) return NULL;
  return *table_slot(t, key->p, key->len, hash_bytes(key->p, key->len));
}

static int table_grow(dlua_store_table_t *t) {
  size_t n = t->nbuckets ? t->nbuckets * 2 : 64;
  dlua_store_entry_t **b = calloc(n, sizeof *b);
  if (!b) return -1;
  for (size_t i = 0; i < t->nbuckets; i++) {
    for (dlua_store_entry_t *e = t->buckets[i], *next; e; e = next) {
      next = e->next;
      e->next = b[e->hash & (n - 1)];
      b[e->hash & (n - 1)] = e;
    }
  }
  free(t->buckets);
  t->buckets = b;
  t->nbuckets = n;
  return 0;
}

int dlua_store_table_put(dlua_store_table_t *t, const blob_t *key, const uint8_t *value, size_t len, int *created) {
  if (t->count >= t->nbuckets && table_grow(t) != 0) return -1;
  uint64_t h = hash_bytes(key->p, key->len);
  dlua_store_entry_t **slot = table_slot(t, key->p, key->len, h);
  uint8_t *v = copy_value(value, len);
  if (!v) return -1;
  if (*slot) {
    free((*slot)->value);
    (*slot)->value = v;
    (*slot)->value_len = len;
    *created = 0;
    return 0;
  }
  dlua_store_entry_t *e = malloc(sizeof *e + key->len);
  if (!e) {
    free(v);
    return -1;
  }
  e->next = NULL;
  e->hash = h;
  e->value = v;
  e->value_len = len;
  e->key_len = key->len;
  memcpy(e->key, key->p, key->len);
  *slot = e;
  t->count++;
  *created = 1;
  return 0;
}

int dlua_store_table_delete(dlua_store_table_t *t, const blob_t *key) {
  if (t->count == 0) return 0;
  dlua_store_entry_t **slot = table_slot(t, key->p, key->len, hash_bytes(key->p, key->len));
  dlua_store_entry_t *e = *slot;
  if (!e) return 0;
  *slot = e->next;
  free(e->value);
  free(e);
  t->count--;
  return 1;
}

void dlua_store_table_free(dlua_store_table_t *t) {
  for (size_t i = 0; i < t->nbuckets; i++) {
    for (dlua_store_entry_t *e = t->buckets[i], *next; e; e = next) {
      next = e->next;
      free(e->value);
      free(e);
    }
  }
  free(t->buckets);
  memset(t, 0, sizeof *t);
}

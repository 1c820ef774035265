/* The store server's key-value table: byte-string keys hashed into chained buckets (one thread uses it). */
#ifndef DLUA_COMM_STORE_TABLE_H
#define DLUA_COMM_STORE_TABLE_H
#include <stddef.h>
#include <stdint.h>

#include "comm/store_wire.h"

typedef struct dlua_store_entry {
  struct dlua_store_entry *next;
  uint64_t hash;
  uint8_t *value; /* value_len bytes plus a NUL, so counters parse as text */
  size_t value_len;
  uint32_t key_len;
  uint8_t key[];
} dlua_store_entry_t;

typedef struct {
  dlua_store_entry_t **buckets;
  size_t nbuckets; /* a power of two */
  size_t count;
} dlua_store_table_t;

/* The entry of key, or NULL. */
dlua_store_entry_t *dlua_store_table_find(dlua_store_table_t *t, const blob_t *key);
/* Stores key = value; *created says whether the key is new. -1 when out of memory. */
int dlua_store_table_put(dlua_store_table_t *t, const blob_t *key, const uint8_t *value, size_t len, int *created);
/* Removes key; 1 if it existed. */
int dlua_store_table_delete(dlua_store_table_t *t, const blob_t *key);
/* Frees every entry; the table is empty (and usable) after. */
void dlua_store_table_free(dlua_store_table_t *t);

#endif

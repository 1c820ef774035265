/* Internal hooks of host/cpu/conv.c: the oneDNN primitive cache, for tests and memory pressure. */
#ifndef DLUA_CPU_CONV_H
#define DLUA_CPU_CONV_H
#include <stdint.h>

/* Drops every cached convolution primitive (ones in use go when their call returns). */
void dlua_conv_cache_clear(void);
/* Bounds the cache (at least 1; the default is 256 entries), evicting the least recently used. */
void dlua_conv_cache_set_capacity(int capacity);
/* Entries held now, and lookups that found / did not find their primitive since the start. */
void dlua_conv_cache_stats(int *entries, int64_t *hits, int64_t *misses);

#endif

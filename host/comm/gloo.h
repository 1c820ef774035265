/* gloo behind a C interface: the C face of the one C++ file (gloo.cc), which pg_gloo.c drives. */
#ifndef DLUA_COMM_GLOO_H
#define DLUA_COMM_GLOO_H
#include <stddef.h>
#include <stdint.h>

#include "comm/pg_backend.h" /* dlua_pg_result_t, and dlua.h: the C++ file calls the store and error functions */
#include "comm/pg_reduce.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One gloo context (full mesh over TCP) and the store adapter that built it. */
typedef struct dlua_gloo dlua_gloo_t;

/* Meets the other ranks through `store` under keys "<prefix>/gloo/...", binding the TCP device to
   `bind_host` (an address of this machine) or the interface `iface` when non-empty. The store's
   status (e.g. DLUA_ERR_INTERRUPTED, DLUA_ERR_TIMEOUT) comes back in *store_status when a store
   call failed. */
dlua_pg_result_t dlua_gloo_connect(dlua_store_t *store, const char *prefix, const char *bind_host, const char *iface,
                                   int rank, int size, int64_t timeout_ms, dlua_gloo_t **out,
                                   dlua_status_t *store_status, char *err, size_t errlen);
void dlua_gloo_destroy(dlua_gloo_t *g);

/* Collectives on contiguous bytes: count elements of elsize (1, 2, 4 or 8) bytes. tag tells
   concurrent operations apart (the sequence number); timeout_ms bounds the whole call. */
dlua_pg_result_t dlua_gloo_allreduce(dlua_gloo_t *g, void *buf, size_t count, size_t elsize, dlua_pg_reduce_fn fn,
                                     uint32_t tag, int64_t timeout_ms, char *err, size_t errlen);
dlua_pg_result_t dlua_gloo_broadcast(dlua_gloo_t *g, void *buf, size_t count, size_t elsize, int root, uint32_t tag,
                                     int64_t timeout_ms, char *err, size_t errlen);
/* in (counts[rank] elements) -> out (sum of counts, rank r's part at the sum of counts before r). */
dlua_pg_result_t dlua_gloo_allgatherv(dlua_gloo_t *g, const void *in, void *out, const size_t *counts, size_t elsize,
                                      uint32_t tag, int64_t timeout_ms, char *err, size_t errlen);
/* in: in_counts[r] elements for rank r, packed in rank order; out likewise, from each rank. */
dlua_pg_result_t dlua_gloo_alltoallv(dlua_gloo_t *g, const void *in, const int64_t *in_counts, void *out,
                                     const int64_t *out_counts, size_t elsize, uint32_t tag, int64_t timeout_ms,
                                     char *err, size_t errlen);
dlua_pg_result_t dlua_gloo_barrier(dlua_gloo_t *g, uint32_t tag, int64_t timeout_ms, char *err, size_t errlen);
/* Point to point: sends sbytes to dst and receives rbytes from src at once (either side may be
   absent: NULL / -1). Slots: prefix 0x40 for user send/recv, 0x41 for the reduce-scatter ring. */
dlua_pg_result_t dlua_gloo_exchange(dlua_gloo_t *g, const void *sbuf, size_t sbytes, int dst, void *rbuf, size_t rbytes,
                                    int src, uint8_t prefix, uint32_t tag, int64_t timeout_ms, char *err,
                                    size_t errlen);

/* Posted point-to-point transfers: post returns at once (the transfer proceeds on gloo's event loop),
   wait blocks until it completes or timeout_ms passes; free only after wait returned (or post failed). */
typedef struct dlua_gloo_p2p dlua_gloo_p2p_t;
dlua_pg_result_t dlua_gloo_p2p_post(dlua_gloo_t *g, void *ptr, size_t bytes, int peer, int is_send, uint8_t prefix,
                                    uint32_t tag, dlua_gloo_p2p_t **out, char *err, size_t errlen);
dlua_pg_result_t dlua_gloo_p2p_wait(dlua_gloo_p2p_t *p, int64_t timeout_ms, char *err, size_t errlen);
void dlua_gloo_p2p_free(dlua_gloo_p2p_t *p);

#ifdef __cplusplus
}
#endif
#endif

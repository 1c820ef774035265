/* Same-host collectives through one shared-memory segment: the CPU path of a gloo group whose ranks all
   run on one machine (docs/comm.md, "Ranks on one host"): all-reduce, reduce-scatter, all-gather and
   broadcast. gloo keeps all-to-all, barrier and point-to-point. Every call is made on every rank, in the
   same order, with the same count (all_gather: the same counts list). */
#ifndef DLUA_COMM_SHM_H
#define DLUA_COMM_SHM_H
#include <stddef.h>
#include <stdint.h>
#include "comm/pg_backend.h"
#include "comm/pg_reduce.h"

typedef struct dlua_shm dlua_shm_t;

typedef enum {
  DLUA_SHM_OK = 0,
  DLUA_SHM_TIMEOUT = 1,  /* this rank's wait ran out */
  DLUA_SHM_GONE = 2,     /* a peer closed its end (exited, crashed or freed its group) */
  DLUA_SHM_MISMATCH = 3  /* the ranks called with different sizes, dtypes or ops: all fail alike, stay in step */
} dlua_shm_result_t;

/* Meets the other ranks through `store` under "<prefix>/shm/...". All ranks agree on the outcome:
   *out is the segment when every rank is on this host (same kernel boot, same /dev/shm) and none set
   DLUA_SHM=0; else NULL, with the reason in why (e.g. "ranks 0 and 2 are on different hosts"). Store
   failures come back as a backend result with *store_status and err set. */
dlua_pg_result_t dlua_shm_join(dlua_store_t *store, const char *prefix, int rank, int size, int64_t timeout_ms,
                               dlua_shm_t **out, char *why, size_t whylen, dlua_status_t *store_status, char *err,
                               size_t errlen);

/* All-reduce of count elements in place (AVG divides too); every rank gets the same bytes, summed in
   rank order whatever the timing. seq is the collective's number (it goes into mismatch messages). */
dlua_shm_result_t dlua_shm_all_reduce(dlua_shm_t *s, void *buf, size_t count, dlua_dtype_t dt, dlua_reduce_t op,
                                      int64_t seq, int64_t timeout_ms, char *err, size_t errlen);

/* Reduce-scatter: in holds destination q's part (counts[q] elements) after those of the ranks before q; out
   (counts[rank] elements) gets the reduction over every rank of their part `rank` (AVG divided). The parts
   may differ in size, the same on every rank. */
dlua_shm_result_t dlua_shm_reduce_scatter(dlua_shm_t *s, const void *in, void *out, const size_t *counts,
                                          dlua_dtype_t dt, dlua_reduce_t op, int64_t seq, int64_t timeout_ms, char *err,
                                          size_t errlen);
/* All-gather: rank q's counts[q] elements of `in` land in out at the sum of counts before q. */
dlua_shm_result_t dlua_shm_all_gather(dlua_shm_t *s, const void *in, void *out, const size_t *counts, dlua_dtype_t dt,
                                      int64_t seq, int64_t timeout_ms, char *err, size_t errlen);
/* Broadcast of count elements from rank root into every rank's buf. */
dlua_shm_result_t dlua_shm_broadcast(dlua_shm_t *s, void *buf, size_t count, dlua_dtype_t dt, int root, int64_t seq,
                                     int64_t timeout_ms, char *err, size_t errlen);

/* Shared regions: `bytes` of zeroed memory on every rank, each rank's copy mapped by all (DDP's gradient
   arena). An all-reduce of a range inside one reads the peers' copies where they lie. Collective: every
   rank calls it with the same id and size, in the same order. *out is this rank's copy, or NULL when some
   rank could not make or map one (why says who; all ranks alike); an error status only when the store
   failed. The region lives until dlua_shm_region_free(*handle, *out), even after the group closes. */
dlua_status_t dlua_shm_region_new(dlua_shm_t *s, dlua_store_t *store, const char *prefix, int64_t id, size_t bytes,
                                  int64_t timeout_ms, void **out, void **handle, char *why, size_t whylen);
void dlua_shm_region_free(void *handle, void *own);  /* a tensor deleter */

/* Leaves the segment: peers still waiting on this rank see it gone. */
void dlua_shm_close(dlua_shm_t *s);

#endif

/* The element functions a reduction applies (gloo's ring, the shared-memory transport), and AVG's division. */
#ifndef DLUA_COMM_PG_REDUCE_H
#define DLUA_COMM_PG_REDUCE_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "core/api.h"

/* out[i] = a[i] op b[i] for n elements; out may equal a or b (gloo reduces in place). */
typedef void (*dlua_pg_reduce_fn)(void *out, const void *a, const void *b, size_t n);
/* The element function of op (AVG: the sum) for dtype; NULL for an unknown pair. */
dlua_pg_reduce_fn dlua_pg_reduce_fn_for(dlua_reduce_t op, dlua_dtype_t dtype);
/* AVG's second half: true division of n elements by the group size (floating dtypes; others untouched). */
void dlua_pg_divide_by(void *buf, size_t n, dlua_dtype_t dt, int size);

#ifdef __cplusplus
}
#endif
#endif

/* Index helpers of the front doors (host/ops/index.c), shared with host/data/augment.c. */
#ifndef DLUA_OPS_INDEX_H
#define DLUA_OPS_INDEX_H
#include "core/tensor.h"

/* Reads element i of a contiguous int32 or int64 index buffer in CPU memory. */
static inline int64_t dlua_ops_index_at(const void *p, int is64, int64_t i) {
  return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* DLUA_ERR_ARG for the first value of a contiguous int32/int64 index tensor outside [base, base + size),
   naming the op, the value as the caller wrote it and the valid range. The search runs on the index's
   device (the index family's first_bad slot); only the answer comes back. */
dlua_status_t dlua_ops_check_indices(const char *op, const dlua_tensor_t *index, int64_t size, int64_t base,
                                     const char *what);

#endif

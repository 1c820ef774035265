/* Internal conversion entry point of copy.c, for fills that compute values in one type. */
#ifndef DLUA_CORE_COPY_H
#define DLUA_CORE_COPY_H
#include "core/api.h"

/* n contiguous elements of src_dtype -> dst_dtype, with copy_'s rules (float -> int
   truncates toward zero, anything -> bool is != 0). No checks: callers own the buffers. */
void dlua_convert(void *dst, dlua_dtype_t dst_dtype, const void *src, dlua_dtype_t src_dtype, int64_t n);

#endif

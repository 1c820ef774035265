/* IDX files (the MNIST format): the reader behind dlua_data_read_idx and dlua_data_read_mnist. */
#ifndef DLUA_DATA_IDX_H
#define DLUA_DATA_IDX_H
#include <stdint.h>
#include "core/api.h"

/* The magic numbers MNIST's files carry: uint8 elements, 3 dims (images) or 1 (labels). */
#define DLUA_IDX_MAGIC_IMAGES 0x00000803u
#define DLUA_IDX_MAGIC_LABELS 0x00000801u

/* Reads `path` (gzipped or not) into a new CPU tensor; *magic (may be NULL) gets the
   file's magic number. Errors start with `op`. */
dlua_status_t dlua_idx_read(const char *op, const char *path, dlua_tensor_t **out, uint32_t *magic);

#endif

/* safetensors files: the writer (temporary file, checksums, fsync, rename) and the mmap reader that checks everything before use. */
#ifndef DLUA_IO_SAFETENSORS_H
#define DLUA_IO_SAFETENSORS_H
#include "core/api.h"

/* Bytes written per pwrite; the CRC of a chunk is taken while it is still in cache, and its
   write-back is started at once (sync_file_range) so the disk works while the next is prepared. */
enum { DLUA_ST_CHUNK = 8 << 20, DLUA_ST_ALIGN = 64 };

/* The safetensors name of a dlua dtype ("F32", "BF16", "BOOL"...), and back (-1: not one of ours). */
const char *dlua_st_dtype_name(int dtype);
int dlua_st_dtype_from_name(const char *name);
/* Writers polling Ctrl-C (the caller's thread) or not (a background save must finish). */
void dlua_st_writer_set_interruptible(dlua_st_writer_t *w, int on);

#endif

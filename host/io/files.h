/* File-system helpers for checkpoints: temporary names, full writes, fsync of a directory, listing and removal. */
#ifndef DLUA_IO_FILES_H
#define DLUA_IO_FILES_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include "core/api.h"

/* "<dir>/.<base>.tmp-<pid>-<n>": hidden, in path's own directory (rename stays within one file
   system), unique per process and call. malloc'd; NULL on OOM (error recorded). */
char *dlua_io_temp_name(const char *path);
/* The directory part of path ("." when there is none), malloc'd. */
char *dlua_io_dirname(const char *path);
/* pwrite of all n bytes at off, retrying short writes and EINTR; errors name `what` and path. */
dlua_status_t dlua_io_pwrite_all(int fd, const void *data, size_t n, off_t off, const char *path);
/* fsync of the directory holding path, so a rename into it survives a crash. */
dlua_status_t dlua_io_fsync_dir_of(const char *path);
/* rename(tmp, path) then fsync of the directory. */
dlua_status_t dlua_io_publish(const char *tmp, const char *path);

#endif

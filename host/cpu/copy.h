/* The CPU backend's copy kernels (copy.c): the copy and download slots of its ew family (kernels/ew.h). */
#ifndef DLUA_CPU_COPY_H
#define DLUA_CPU_COPY_H
#include <stddef.h>
#include "core/api.h"
#include "kernels/ew.h"

dlua_status_t dlua_cpu_ew_copy(const char *op, const dlua_ew_desc_t *e);
dlua_status_t dlua_cpu_ew_download(const char *op, void *dst, const void *src, size_t bytes, int device);
#endif

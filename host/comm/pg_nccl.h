/* The NCCL backend of process groups (pg_nccl.c, built with CUDA only): CUDA tensors on one device per group. */
#ifndef DLUA_COMM_PG_NCCL_H
#define DLUA_COMM_PG_NCCL_H

#include "comm/pg_backend.h"

/* NULL when libnccl.so.2 loads (2.14 or newer; loaded on the first call), else why not. */
const char *dlua_pg_nccl_library_error(void);
/* The state of one NCCL group on args->device (a device that exists: the caller checked), after the
   library loaded. */
dlua_status_t dlua_pg_nccl_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx);

#endif

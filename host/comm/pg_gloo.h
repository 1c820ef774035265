/* The gloo backend of process groups (pg_gloo.c): CPU tensors, and CUDA ones through pinned host staging. */
#ifndef DLUA_COMM_PG_GLOO_H
#define DLUA_COMM_PG_GLOO_H

#include "comm/pg_backend.h"

/* The state of one gloo group (GLOO_SOCKET_IFNAME read now); the group joins it on its comm thread. */
dlua_status_t dlua_pg_gloo_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx);

#endif

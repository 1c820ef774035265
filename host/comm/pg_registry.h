/* The process-group backends this build has (pg_registry.c) and the constructors of dlua.h that pick one. */
#ifndef DLUA_COMM_PG_REGISTRY_H
#define DLUA_COMM_PG_REGISTRY_H

#include "comm/pg_backend.h"

/* One backend's entry: built in (open set), or not (missing says why). */
typedef struct {
  const char *name;                  /* "gloo", "nccl" */
  dlua_pg_open_fn open;              /* NULL: not in this build */
  const char *(*unavailable)(void);  /* optional: NULL when usable (its library loads), else why not */
  const char *missing;               /* not built: why ("built without CUDA") */
} dlua_pg_backend_entry_t;

/* The entry named `name`, or NULL for a backend dlua does not know. */
const dlua_pg_backend_entry_t *dlua_pg_backend_find(const char *name);
/* NULL when the backend can make groups here, else why not. */
const char *dlua_pg_backend_unavailable(const dlua_pg_backend_entry_t *e);

#endif

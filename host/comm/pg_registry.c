/* The process-group backends of this build (the one place that knows which were compiled in), and the constructors that pick one. */
#include "comm/pg_registry.h"

#include <stdio.h>
#include <string.h>

#include "comm/pg_gloo.h"
#include "core/error.h"

/* NCCL needs the CUDA toolkit's headers to build, and a GPU to run; the emulator's build compiles
   pg_nccl.c (so CI checks it compiles) but has no NCCL to load. MPI needs its C library at build time
   (CMake's FindMPI: Debian libopenmpi-dev); it is linked, so a build that has it always has it. */
#if defined(DLUA_HAVE_CUDA) && !defined(DLUA_CUDA_EMU)
#include "comm/pg_nccl.h"
#define NCCL_ENTRY {"nccl", dlua_pg_nccl_open, dlua_pg_nccl_library_error, NULL}
#elif defined(DLUA_HAVE_CUDA)
#define NCCL_ENTRY {"nccl", NULL, NULL, "the CUDA emulator's build has no NCCL; use gloo"}
#else
#define NCCL_ENTRY {"nccl", NULL, NULL, "built without CUDA"}
#endif

#ifdef DLUA_HAVE_MPI
#include "comm/pg_mpi.h"
#define MPI_ENTRY {"mpi", dlua_pg_mpi_open, NULL, NULL}
#else
#define MPI_ENTRY {"mpi", NULL, NULL, "built without MPI (install libopenmpi-dev and rebuild)"}
#endif

static const dlua_pg_backend_entry_t backends[] = {
    {"gloo", dlua_pg_gloo_open, NULL, NULL},
    NCCL_ENTRY,
    MPI_ENTRY,
};

const dlua_pg_backend_entry_t *dlua_pg_backend_find(const char *name) {
  for (size_t i = 0; name && i < sizeof backends / sizeof backends[0]; i++)
    if (!strcmp(backends[i].name, name)) return &backends[i];
  return NULL;
}

const char *dlua_pg_backend_unavailable(const dlua_pg_backend_entry_t *e) {
  if (!e) return "unknown backend";
  if (!e->open) return e->missing;
  return e->unavailable ? e->unavailable() : NULL;
}

/* Through the registry: the backend must be usable, then its state, then the group over it. */
static dlua_status_t group_new(const char *backend, const char *store_host, int store_port, const char *token,
                               const char *name, int rank, int size, int device, int64_t timeout_ms, dlua_pg_t **out) {
  if (out) *out = NULL;
  const char *nm = name ? name : "?";
  const dlua_pg_backend_entry_t *e = dlua_pg_backend_find(backend);
  const char *why = dlua_pg_backend_unavailable(e);
  if (why) return DLUA_ERR(DLUA_ERR_ARG, "process group %s: %s: %s", nm, backend, why);
  dlua_pg_open_t args = {name, device, timeout_ms};
  const dlua_pg_backend_t *be = NULL;
  void *ctx = NULL;
  DLUA_TRY(e->open(&args, &be, &ctx));
  return dlua_pg_new_with_backend(store_host, store_port, token, name, rank, size, timeout_ms, be, ctx, out);
}

dlua_status_t dlua_pg_gloo_new(const char *store_host, int store_port, const char *token, const char *name, int rank,
                               int size, int64_t timeout_ms, dlua_pg_t **out) {
  return group_new("gloo", store_host, store_port, token, name, rank, size, -1, timeout_ms, out);
}

const char *dlua_pg_nccl_unavailable(void) { return dlua_pg_backend_unavailable(dlua_pg_backend_find("nccl")); }

/* The device is checked first, through the device layer that every build has (without CUDA: no devices). */
dlua_status_t dlua_pg_nccl_new(const char *store_host, int store_port, const char *token, const char *name, int rank,
                               int size, int device, int64_t timeout_ms, dlua_pg_t **out) {
  if (out) *out = NULL;
  const char *nm = name ? name : "?";
  int n = dlua_cuda_device_count();
  if (n == 0)
    return DLUA_ERR(DLUA_ERR_ARG, "process group %s: nccl: no CUDA device available (%s)", nm,
                    dlua_cuda_unavailable_reason());
  if (device < 0 || device >= n)
    return DLUA_ERR(DLUA_ERR_ARG, "process group %s: nccl: no device cuda:%d (%d CUDA device%s)", nm, device, n,
                    n == 1 ? "" : "s");
  return group_new("nccl", store_host, store_port, token, name, rank, size, device, timeout_ms, out);
}

const char *dlua_pg_mpi_unavailable(void) { return dlua_pg_backend_unavailable(dlua_pg_backend_find("mpi")); }

dlua_status_t dlua_pg_mpi_new(const char *store_host, int store_port, const char *token, const char *name, int rank,
                              int size, int64_t timeout_ms, dlua_pg_t **out) {
  return group_new("mpi", store_host, store_port, token, name, rank, size, -1, timeout_ms, out);
}

#ifndef DLUA_HAVE_MPI
/* The world calls of dlua.h exist in every build (ffi.C finds them); without MPI they say why not. */
dlua_status_t dlua_mpi_world(int *rank, int *size) {
  if (rank) *rank = 0;
  if (size) *size = 1;
  return DLUA_ERR(DLUA_ERR_ARG, "mpi: %s", dlua_pg_mpi_unavailable());
}

dlua_status_t dlua_mpi_world_broadcast(void *buf, int64_t n, int root, int64_t timeout_ms) {
  return DLUA_ERR(DLUA_ERR_ARG, "mpi: %s", dlua_pg_mpi_unavailable());
}
#endif

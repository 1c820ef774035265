/* The backend registry: which table runs the ops of a device. The only file of host/ops (and with
   host/cuda/build_info.c the only one of the runtime) that knows whether CUDA was built. */
#include "ops/backend.h"
#include <string.h>
#include "core/error.h"

static dlua_status_t no_cuda(const char *op) {
  return DLUA_ERR(DLUA_ERR_ARG, "%s: no CUDA device available (%s)", op, dlua_cuda_unavailable_reason());
}

dlua_status_t dlua_backend_for(const char *op, int device, const dlua_backend_t **be) {
  *be = NULL;
  if (device == DLUA_CPU) {
    *be = &dlua_cpu_backend;
    return DLUA_OK;
  }
#ifdef DLUA_HAVE_CUDA
  if (dlua_cuda_device_count() > 0) {
    *be = &dlua_cuda_backend;
    return DLUA_OK;
  }
#endif
  return no_cuda(op);
}

dlua_status_t dlua_backend_unsupported(const char *op, const dlua_backend_t *be) {
  return DLUA_ERR(DLUA_ERR_ARG, "%s: not supported on %s", op, be ? be->name : "this device");
}

dlua_status_t dlua_backend_slot_(const char *op, int device, size_t family_offset, size_t slot_offset,
                                 const void **fam) {
  const dlua_backend_t *be;
  *fam = NULL;
  DLUA_TRY(dlua_backend_for(op, device, &be));
  const void *table;
  memcpy(&table, (const char *)be + family_offset, sizeof table);
  if (!table) return dlua_backend_unsupported(op, be);
  void (*fn)(void);
  memcpy(&fn, (const char *)table + slot_offset, sizeof fn);
  if (!fn) return dlua_backend_unsupported(op, be);
  *fam = table;
  return DLUA_OK;
}

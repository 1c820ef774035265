/* What the binary was built against: CUDA runtime, cuDNN and NCCL versions from headers. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "core/api.h"

#ifdef DLUA_CUDA_EMU
int dlua_cuda_emulated(void) { return 1; }
#else
int dlua_cuda_emulated(void) { return 0; }
#endif

#ifdef DLUA_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <cudnn_version.h>
#include <nccl.h>
const char *dlua_cuda_build_info(void) {
  static char info[128];
  if (!info[0])  // constant content: a racing second writer writes the same bytes
    snprintf(info, sizeof info, "CUDA %d.%d%s, cuDNN %d.%d.%d, NCCL %d.%d.%d", CUDART_VERSION / 1000,
             (CUDART_VERSION % 1000) / 10, dlua_cuda_emulated() ? " (emulated on the CPU: host/cuemu)" : "",
             CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  return info;
}
int dlua_has_cuda_build(void) { return 1; }
#else
const char *dlua_cuda_build_info(void) { return "no CUDA"; }
int dlua_has_cuda_build(void) { return 0; }
#endif

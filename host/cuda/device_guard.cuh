/* Selects a device for the duration of a scope and restores the caller's: the CUDA launchers' common first step. */
#ifndef DLUA_CUDA_DEVICE_GUARD_CUH
#define DLUA_CUDA_DEVICE_GUARD_CUH
#include <cuda_runtime_api.h>

namespace dlua_cu {

struct DeviceGuard {
  int prev = 0, dev = 0;
  cudaError_t err = cudaSuccess;
  explicit DeviceGuard(int d) : dev(d) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != dev) err = cudaSetDevice(dev);
    if (err != cudaSuccess) cudaGetLastError();
  }
  ~DeviceGuard() {
    if (err == cudaSuccess && prev != dev) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard &) = delete;
  DeviceGuard &operator=(const DeviceGuard &) = delete;
};

}  // namespace dlua_cu

/* In an extern "C" launcher: select `device` or return the error naming op. */
#define DLUA_CU_SELECT(guard, op, device)                                                                        \
  dlua_cu::DeviceGuard guard(device);                                                                            \
  if (guard.err != cudaSuccess)                                                                                  \
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s (CUDA error %d)", op, device,               \
                    cudaGetErrorString(guard.err), (int)guard.err)

#endif

/* The CUDA backend's table (ops/backend.h): one family per line, each filled by the file that runs it.
   Built only with CUDA; host/ops/backend.c hands it out while a device exists. */
#include "ops/backend.h"
#include "kernels/norm.h"
#include "kernels/pool.h"

const dlua_backend_t dlua_cuda_backend = {
    .name = "cuda",
    .norm = &dlua_cuda_norm_ops,
    .pool = &dlua_cuda_pool_ops,
};

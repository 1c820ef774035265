/* The CUDA backend's table (ops/backend.h): one family per line, each filled by the file that runs it.
   Built only with CUDA; host/ops/backend.c hands it out while a device exists. */
#include "ops/backend.h"
#include "kernels/loss.h"
#include "kernels/random.h"

const dlua_backend_t dlua_cuda_backend = {
    .name = "cuda",
    .loss = &dlua_cuda_loss_ops,
    .random = &dlua_cuda_random_ops,
};

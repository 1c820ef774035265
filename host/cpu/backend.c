/* The CPU backend's table (ops/backend.h): one family per line, each filled by the file that runs it. */
#include "ops/backend.h"
#include "kernels/loss.h"
#include "kernels/random.h"

const dlua_backend_t dlua_cpu_backend = {
    .name = "cpu",
    .loss = &dlua_cpu_loss_ops,
    .random = &dlua_cpu_random_ops,
};

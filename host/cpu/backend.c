/* The CPU backend's table (ops/backend.h): one family per line, each filled by the file that runs it. */
#include "ops/backend.h"
#include "kernels/norm.h"
#include "kernels/pool.h"

const dlua_backend_t dlua_cpu_backend = {
    .name = "cpu",
    .norm = &dlua_cpu_norm_ops,
    .pool = &dlua_cpu_pool_ops,
};

/* The CPU backend's table (ops/backend.h): one family per line, each filled by the file that runs it. */
#include "ops/backend.h"
#include "kernels/index.h"
#include "kernels/optim.h"
#include "kernels/reduce.h"

const dlua_backend_t dlua_cpu_backend = {
    .name = "cpu",
    .reduce = &dlua_cpu_reduce_ops,
    .index = &dlua_cpu_index_ops,
    .optim = &dlua_cpu_optim_ops,
};

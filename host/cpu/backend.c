/* The CPU backend's table (ops/backend.h): one family per line, each filled by the file that runs it. */
#include "ops/backend.h"
#include "kernels/ew.h"
#include "kernels/blas.h"
#include "kernels/conv.h"
#include "kernels/index.h"
#include "kernels/loss.h"
#include "kernels/norm.h"
#include "kernels/pool.h"
#include "kernels/random.h"
#include "kernels/optim.h"
#include "kernels/reduce.h"

const dlua_backend_t dlua_cpu_backend = {
    .name = "cpu",
    .ew = &dlua_cpu_ew_ops,
    .blas = &dlua_cpu_blas_ops,
    .conv = &dlua_cpu_conv_ops,
    .reduce = &dlua_cpu_reduce_ops,
    .index = &dlua_cpu_index_ops,
    .norm = &dlua_cpu_norm_ops,
    .pool = &dlua_cpu_pool_ops,
    .loss = &dlua_cpu_loss_ops,
    .random = &dlua_cpu_random_ops,
    .optim = &dlua_cpu_optim_ops,
};

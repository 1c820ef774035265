/* The CUDA backend's table (ops/backend.h): one family per line, each filled by the file that runs it.
   Built only with CUDA; host/ops/backend.c hands it out while a device exists. */
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

const dlua_backend_t dlua_cuda_backend = {
    .name = "cuda",
    .ew = &dlua_cuda_ew_ops,
    .blas = &dlua_cuda_blas_ops,
    .conv = &dlua_cuda_conv_ops,
    .reduce = &dlua_cuda_reduce_ops,
    .index = &dlua_cuda_index_ops,
    .norm = &dlua_cuda_norm_ops,
    .pool = &dlua_cuda_pool_ops,
    .loss = &dlua_cuda_loss_ops,
    .random = &dlua_cuda_random_ops,
    .optim = &dlua_cuda_optim_ops,
};

/* The backend interface: what host/ops calls, what host/cpu and host/cuda provide.

   A backend is one table of the shape below: a pointer per op family, each family a struct of slots
   (function pointers) whose arguments are that family's descriptors, both declared once in
   host/kernels/<family>.h and shared by both backends. The front door of an op (host/ops) checks its
   arguments, settles shapes, dtypes, layouts and `out`, fills the descriptor, then makes exactly one call
   through the table of the tensors' device. A NULL family or slot means "this backend does not run the
   op", and the caller gets one message for every op: "<op>: not supported on cuda".

   Adding an op: its slot in the family struct, its descriptor fields, the front door in host/ops, a
   kernel in each backend that runs it (docs/architecture.md walks through one). */
#ifndef DLUA_OPS_BACKEND_H
#define DLUA_OPS_BACKEND_H
#include <stddef.h>
#include "core/api.h"

#ifdef __cplusplus
extern "C" {
#endif

struct dlua_ew_ops;     /* kernels/ew.h: element-wise maps, where, fills, dtype copies */
struct dlua_blas_ops;   /* kernels/blas.h: matrix products */
struct dlua_conv_ops;   /* kernels/conv.h: 2-d convolution, forward and both gradients */
struct dlua_norm_ops;   /* kernels/norm.h: batch normalisation */
struct dlua_pool_ops;   /* kernels/pool.h: max and average pooling */
struct dlua_loss_ops;   /* kernels/loss.h: softmax, thresholds, dropout masks, mse, cross-entropy */
struct dlua_random_ops; /* kernels/random.h: Philox fills */
struct dlua_reduce_ops; /* kernels/reduce.h: reductions and norms */
struct dlua_index_ops;  /* kernels/index.h: gather, scatter-add, one-hot, index checks, sort and top-k */
struct dlua_optim_ops;  /* kernels/optim.h: optimizer steps, gradient unscale, scale and norm */

typedef struct dlua_backend {
  const char *name; /* "cpu", "cuda": the word of "not supported on <name>" */
  const struct dlua_ew_ops *ew;
  const struct dlua_blas_ops *blas;
  const struct dlua_conv_ops *conv;
  const struct dlua_norm_ops *norm;
  const struct dlua_pool_ops *pool;
  const struct dlua_loss_ops *loss;
  const struct dlua_random_ops *random;
  const struct dlua_reduce_ops *reduce;
  const struct dlua_index_ops *index;
  const struct dlua_optim_ops *optim;
} dlua_backend_t;

/* The table of `device` (DLUA_CPU, or a CUDA ordinal) in *be. No CUDA table (a build without CUDA, or no
   device) gives DLUA_ERR_ARG "<op>: no CUDA device available (<reason>)"; this is the one place that says so. */
dlua_status_t dlua_backend_for(const char *op, int device, const dlua_backend_t **be);

/* DLUA_ERR_ARG "<op>: not supported on <be->name>": what a NULL family or slot answers. */
dlua_status_t dlua_backend_unsupported(const char *op, const dlua_backend_t *be);

/* *fam <- the `family` table of device's backend, checked to hold `slot`; else the errors above.
   Use:  const struct dlua_pool_ops *k;
         DLUA_TRY(DLUA_BACKEND(op, x->device, pool, forward, &k));
         return k->forward(op, &desc);                                                                  */
#define DLUA_BACKEND(op, device, family, slot, fam)                                        \
  dlua_backend_slot_((op), (device), offsetof(dlua_backend_t, family),                     \
                     offsetof(struct dlua_##family##_ops, slot), (const void **)(fam))

dlua_status_t dlua_backend_slot_(const char *op, int device, size_t family_offset, size_t slot_offset,
                                 const void **fam);

/* The backends' own tables (host/cpu/backend.c, host/cuda/backend.c); only host/ops/backend.c reads them. */
extern const dlua_backend_t dlua_cpu_backend;
extern const dlua_backend_t dlua_cuda_backend;

#ifdef __cplusplus
}
#endif
#endif

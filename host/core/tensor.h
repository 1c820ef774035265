/* The tensor and storage structs, and the helpers every kernel file shares. */
#ifndef DLUA_CORE_TENSOR_H
#define DLUA_CORE_TENSOR_H
#include "core/api.h"
#include "core/error.h"

/* A block of memory shared by views. Freed (deleter, or the device allocator) with its
   last reference. */
typedef struct dlua_storage {
  void *data;
  size_t nbytes;
  int device;             /* DLUA_CPU or a CUDA ordinal */
  int refcount;           /* atomic: __atomic builtins */
  void (*deleter)(void *ctx, void *data); /* NULL: memory from dlua_cpu_alloc */
  void *ctx;
} dlua_storage_t;

struct dlua_tensor {
  dlua_storage_t *storage;
  int64_t offset;                   /* elements from storage->data to element 0 */
  int ndim;
  dlua_dtype_t dtype;
  int device;
  int64_t sizes[DLUA_MAX_DIMS];     /* (d0, d1, ...) */
  int64_t strides[DLUA_MAX_DIMS];   /* in elements; 0 for expanded dims */
};

/* 64-byte aligned CPU memory, counted in dlua_memory_allocated(DLUA_CPU). */
void *dlua_cpu_alloc(size_t nbytes);
void dlua_cpu_free(void *p, size_t nbytes);

/* A new handle sharing t's storage, metadata copied (NULL on OOM, error recorded). */
dlua_tensor_t *dlua_tensor_alias(const dlua_tensor_t *t);
/* Byte address of element 0. */
static inline char *dlua_tensor_ptr(const dlua_tensor_t *t) {
  return (char *)t->storage->data + t->offset * (int64_t)dlua_dtype_size(t->dtype);
}
int64_t dlua_shape_numel(int ndim, const int64_t *sizes);
/* Broadcasts two shapes (numpy rules); DLUA_ERR_ARG naming `op` and both shapes. */
dlua_status_t dlua_broadcast_shapes(const char *op, int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out);
/* "(2, 3, 5)" into buf. */
const char *dlua_shape_str(int ndim, const int64_t *sizes, char *buf, size_t len);
/* Contiguous row-major strides for sizes. */
void dlua_contiguous_strides(int ndim, const int64_t *sizes, int64_t *strides);
/* Errors unless t is a live CPU tensor: names the op; a CUDA tensor gets "<op>: not implemented on
   cuda:N yet" (ops reach CUDA one by one, docs/cuda.md). */
dlua_status_t dlua_require_cpu(const char *op, const dlua_tensor_t *t);
/* Errors unless t is a live tensor on `device` (DLUA_CPU or a CUDA ordinal), naming both devices. */
dlua_status_t dlua_require_device(const char *op, const dlua_tensor_t *t, int device);
/* Operands on two devices: "<op>: expected tensors on one device, got <a> and <b>". NULL or freed
   tensors pass (their own checks report them). */
dlua_status_t dlua_same_device(const char *op, const dlua_tensor_t *a, const dlua_tensor_t *b);

/* Resolves the `out` convention: if *out is NULL allocates (ndim, sizes, dtype) on the
   CPU; otherwise checks that *out has exactly that shape (any dtype: the caller casts). */
dlua_status_t dlua_prepare_out(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, int *allocated);
/* The same on `device`: allocates there, or checks that *out lives there. */
dlua_status_t dlua_prepare_out_on(const char *op, dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype,
                                  int device, int *allocated);

#endif

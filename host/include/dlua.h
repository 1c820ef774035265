/* dlua's public C API: every function Lua may call. Plain declarations only (no macros,
   no includes): the build embeds this text and bindings/ hands it to ffi.cdef verbatim.
   C files include <stdint.h> and <stddef.h> before this header. */

/* Every fallible function returns a status; the message is in dlua_last_error(). */
typedef enum {
  DLUA_OK = 0,
  DLUA_ERR_ARG = 1,         /* bad argument: shapes, dtypes, ranges */
  DLUA_ERR_OOM = 2,         /* an allocation failed */
  DLUA_ERR_IO = 3,          /* a file or socket failed */
  DLUA_ERR_BACKEND = 4,     /* CUDA, cuDNN, NCCL, gloo... reported an error */
  DLUA_ERR_INTERRUPTED = 5, /* Ctrl-C arrived while the call ran */
  DLUA_ERR_TIMEOUT = 6,
  DLUA_ERR_INTERNAL = 7,
  DLUA_STATUS_COUNT = 8
} dlua_status_t;

/* The calling thread's last error message, with the C file:line that raised it. */
const char *dlua_last_error(void);
dlua_status_t dlua_last_status(void);
void dlua_clear_error(void);
const char *dlua_status_name(dlua_status_t status);

/* Versions. */
const char *dlua_version(void);
const char *dlua_cuda_build_info(void); /* "CUDA 13.0, cuDNN 9.19.0, NCCL 2.28.9" or "no CUDA" */
int dlua_has_cuda_build(void);

/* Threads used by CPU kernels (one pool, shared with oneDNN). n < 1 is an error. */
dlua_status_t dlua_set_num_threads(int n);
int dlua_get_num_threads(void);

/* Seconds on a monotonic wall clock (for timing: os.clock counts CPU time of all threads). */
double dlua_wall_time(void);

/* Ctrl-C: the host sets the flag from its signal handler; long C loops poll it and
   return DLUA_ERR_INTERRUPTED. */
void dlua_interrupt_set(int on);
int dlua_interrupt_pending(void);

/* ==== dtypes ============================================================================ */

typedef enum {
  DLUA_DTYPE_F32 = 0,
  DLUA_DTYPE_F64 = 1,
  DLUA_DTYPE_F16 = 2,
  DLUA_DTYPE_BF16 = 3,
  DLUA_DTYPE_I32 = 4,
  DLUA_DTYPE_I64 = 5,
  DLUA_DTYPE_U8 = 6,
  DLUA_DTYPE_BOOL = 7,
  DLUA_DTYPE_COUNT = 8
} dlua_dtype_t;

const char *dlua_dtype_name(dlua_dtype_t dtype);       /* "float32", "bfloat16", "int64", "bool"... */
int dlua_dtype_from_name(const char *name);            /* the dtype, or -1; accepts "f32"/"float"/"float32"... */
size_t dlua_dtype_size(dlua_dtype_t dtype);            /* bytes per element */
int dlua_dtype_is_floating(dlua_dtype_t dtype);
/* PyTorch's promotion: float beats int, wider beats narrower, f16 with bf16 gives f32, bool lowest. */
dlua_dtype_t dlua_dtype_promote(dlua_dtype_t a, dlua_dtype_t b);
/* Round-to-nearest-even conversions; NaN and Inf survive. */
uint16_t dlua_f32_to_f16(float x);
float dlua_f16_to_f32(uint16_t h);
uint16_t dlua_f32_to_bf16(float x);
float dlua_bf16_to_f32(uint16_t h);

/* ==== tensors ============================================================================ */

/* A tensor handle: sizes and strides in elements, a storage shared by views (reference
   counted). Device -1 is the CPU, N >= 0 is cuda:N. Every handle returned through an
   `out` argument is owned by the caller and released with dlua_tensor_free. */
typedef struct dlua_tensor dlua_tensor_t;
enum { DLUA_MAX_DIMS = 8, DLUA_CPU = -1 };

/* Output convention for ops with `dlua_tensor_t **out`: if *out is NULL a new tensor is
   allocated (broadcast shape, promoted dtype) and stored there; if *out is a tensor, the
   result is written into it (cast to its dtype; its shape must match), which is how the
   in-place variants (`add_`...) call them with *out = the first operand. Dimensions are
   0-based and non-negative here: the Lua binding converts 1-based and negative ones. */

dlua_status_t dlua_tensor_empty(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, int device);
dlua_status_t dlua_tensor_zeros(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, int device);
/* Copies `data` (contiguous, row-major, of `dtype`) into a new CPU tensor. */
dlua_status_t dlua_tensor_from_data(dlua_tensor_t **out, int ndim, const int64_t *sizes, dlua_dtype_t dtype, const void *data);
/* Wraps caller memory without copying (for loaders); `deleter(ctx, data)` runs when the last view goes (may be NULL). */
dlua_status_t dlua_tensor_wrap(dlua_tensor_t **out, int ndim, const int64_t *sizes, const int64_t *strides, dlua_dtype_t dtype, void *data, void (*deleter)(void *ctx, void *data), void *ctx);
/* Releases the handle; the storage goes with its last view. NULL is ignored. */
void dlua_tensor_free(dlua_tensor_t *t);
/* Writes contiguous row-major elements of t into dst (dst_bytes must be numel * element size). */
dlua_status_t dlua_tensor_to_data(const dlua_tensor_t *t, void *dst, size_t dst_bytes);

int dlua_tensor_ndim(const dlua_tensor_t *t);
const int64_t *dlua_tensor_sizes(const dlua_tensor_t *t);
const int64_t *dlua_tensor_strides(const dlua_tensor_t *t);
int64_t dlua_tensor_offset(const dlua_tensor_t *t);       /* in elements, into the storage */
int64_t dlua_tensor_numel(const dlua_tensor_t *t);
dlua_dtype_t dlua_tensor_dtype(const dlua_tensor_t *t);
int dlua_tensor_device(const dlua_tensor_t *t);
int dlua_tensor_is_contiguous(const dlua_tensor_t *t);
void *dlua_tensor_data(const dlua_tensor_t *t);            /* address of the first element */
int dlua_tensor_same_storage(const dlua_tensor_t *a, const dlua_tensor_t *b);
size_t dlua_tensor_storage_bytes(const dlua_tensor_t *t);
/* "(2, 3, 5) float32 cpu", for error messages and printing. */
const char *dlua_tensor_describe(const dlua_tensor_t *t, char *buf, size_t len);

/* Views: no copy; the result shares t's storage. */
dlua_status_t dlua_tensor_view(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes); /* one size may be -1 */
dlua_status_t dlua_tensor_reshape(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes); /* copies only when a view is impossible */
dlua_status_t dlua_tensor_as_strided(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes, const int64_t *strides, int64_t offset);
dlua_status_t dlua_tensor_narrow(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t start, int64_t length);
dlua_status_t dlua_tensor_slice(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t start, int64_t stop, int64_t step); /* [start, stop) by step > 0 */
dlua_status_t dlua_tensor_select(dlua_tensor_t **out, const dlua_tensor_t *t, int dim, int64_t index);
dlua_status_t dlua_tensor_transpose(dlua_tensor_t **out, const dlua_tensor_t *t, int dim0, int dim1);
dlua_status_t dlua_tensor_permute(dlua_tensor_t **out, const dlua_tensor_t *t, const int *dims); /* t's ndim entries */
dlua_status_t dlua_tensor_expand(dlua_tensor_t **out, const dlua_tensor_t *t, int ndim, const int64_t *sizes); /* -1 keeps a size */
dlua_status_t dlua_tensor_squeeze(dlua_tensor_t **out, const dlua_tensor_t *t, int dim); /* dim < 0: every size-1 dim */
dlua_status_t dlua_tensor_unsqueeze(dlua_tensor_t **out, const dlua_tensor_t *t, int dim); /* 0..ndim */
dlua_status_t dlua_tensor_flatten(dlua_tensor_t **out, const dlua_tensor_t *t, int start_dim, int end_dim); /* inclusive */
/* A new handle on the same storage when t is contiguous, else a contiguous copy. */
dlua_status_t dlua_tensor_contiguous(dlua_tensor_t **out, const dlua_tensor_t *t);
dlua_status_t dlua_tensor_clone(dlua_tensor_t **out, const dlua_tensor_t *t);
/* dst <- src, broadcasting src to dst's shape and converting across dtypes. */
dlua_status_t dlua_tensor_copy_(dlua_tensor_t *dst, const dlua_tensor_t *src);
dlua_status_t dlua_tensor_to_dtype(dlua_tensor_t **out, const dlua_tensor_t *t, dlua_dtype_t dtype); /* a copy, even if same dtype */

/* Filling and ranges. */
dlua_status_t dlua_tensor_fill_(dlua_tensor_t *t, double value);
dlua_status_t dlua_tensor_arange(dlua_tensor_t **out, double start, double end, double step, dlua_dtype_t dtype);
dlua_status_t dlua_tensor_linspace(dlua_tensor_t **out, double start, double end, int64_t steps, dlua_dtype_t dtype);
dlua_status_t dlua_tensor_eye(dlua_tensor_t **out, int64_t n, int64_t m, dlua_dtype_t dtype);

/* Bytes of tensor storage alive on a device (-1: CPU), and the peak since start. */
int64_t dlua_memory_allocated(int device);
int64_t dlua_memory_peak(int device);
int64_t dlua_memory_allocated_total(void); /* all devices: drives the Lua GC's pacing */

/* ==== random numbers ======================================================================= */

/* Philox-4x32-10 keyed by (seed, offset): element i of a fill uses counter offset + i/4 and
   lane i%4, so results do not depend on the thread count or the backend. */
typedef struct dlua_generator dlua_generator_t;
dlua_status_t dlua_generator_new(dlua_generator_t **out, uint64_t seed);
void dlua_generator_free(dlua_generator_t *g);
dlua_generator_t *dlua_generator_default(void);
void dlua_generator_manual_seed(dlua_generator_t *g, uint64_t seed); /* also resets the offset */
uint64_t dlua_generator_seed(const dlua_generator_t *g);
uint64_t dlua_generator_offset(const dlua_generator_t *g);
void dlua_generator_set_offset(dlua_generator_t *g, uint64_t offset);
/* One Philox-4x32-10 block: out = philox(counter, key). */
void dlua_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
/* Fills (g NULL: the default generator); each advances g's offset by ceil(numel/4)... blocks used. */
dlua_status_t dlua_tensor_uniform_(dlua_tensor_t *t, double low, double high, dlua_generator_t *g);
dlua_status_t dlua_tensor_normal_(dlua_tensor_t *t, double mean, double std, dlua_generator_t *g);
dlua_status_t dlua_tensor_randint_(dlua_tensor_t *t, int64_t low, int64_t high, dlua_generator_t *g); /* [low, high) */
dlua_status_t dlua_tensor_bernoulli_(dlua_tensor_t *t, double p, dlua_generator_t *g);
dlua_status_t dlua_tensor_randperm(dlua_tensor_t **out, int64_t n, int64_t base, dlua_dtype_t dtype, dlua_generator_t *g); /* a permutation of base..base+n-1 */

/* ==== element-wise math ===================================================================== */

typedef enum {
  DLUA_UNARY_NEG = 0, DLUA_UNARY_ABS, DLUA_UNARY_SQRT, DLUA_UNARY_RSQRT, DLUA_UNARY_EXP,
  DLUA_UNARY_LOG, DLUA_UNARY_TANH, DLUA_UNARY_SIGMOID, DLUA_UNARY_RELU, DLUA_UNARY_SIGN,
  DLUA_UNARY_RECIPROCAL, DLUA_UNARY_SQUARE, DLUA_UNARY_FLOOR, DLUA_UNARY_CEIL, DLUA_UNARY_ROUND,
  DLUA_UNARY_SIN, DLUA_UNARY_COS, DLUA_UNARY_LOG1P, DLUA_UNARY_EXPM1,
  DLUA_UNARY_ISFINITE, DLUA_UNARY_ISNAN, DLUA_UNARY_ISINF, DLUA_UNARY_LOGICAL_NOT,
  DLUA_UNARY_COUNT
} dlua_unary_op_t;

typedef enum {
  DLUA_BINARY_ADD = 0, /* a + alpha * b */
  DLUA_BINARY_SUB,     /* a - alpha * b */
  DLUA_BINARY_MUL, DLUA_BINARY_DIV, DLUA_BINARY_POW, DLUA_BINARY_MAXIMUM, DLUA_BINARY_MINIMUM,
  DLUA_BINARY_FMOD, DLUA_BINARY_REMAINDER, DLUA_BINARY_ATAN2,
  DLUA_BINARY_EQ, DLUA_BINARY_NE, DLUA_BINARY_LT, DLUA_BINARY_LE, DLUA_BINARY_GT, DLUA_BINARY_GE, /* give bool */
  DLUA_BINARY_LOGICAL_AND, DLUA_BINARY_LOGICAL_OR, DLUA_BINARY_LOGICAL_XOR,                      /* give bool */
  DLUA_BINARY_COUNT
} dlua_binary_op_t;

/* Unary ops on integers promote to float32 where the result is fractional (sqrt, exp...);
   ISFINITE/ISNAN/ISINF/LOGICAL_NOT give bool. */
dlua_status_t dlua_tensor_unary(dlua_tensor_t **out, const dlua_tensor_t *a, dlua_unary_op_t op);
dlua_status_t dlua_tensor_binary(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b, dlua_binary_op_t op, double alpha);
/* a op s (or s op a when scalar_first); an integer tensor with a fractional s gives float32. */
dlua_status_t dlua_tensor_binary_scalar(dlua_tensor_t **out, const dlua_tensor_t *a, double s, dlua_binary_op_t op, int scalar_first);
dlua_status_t dlua_tensor_clamp(dlua_tensor_t **out, const dlua_tensor_t *a, double low, double high); /* NaN bound: none */
dlua_status_t dlua_tensor_where(dlua_tensor_t **out, const dlua_tensor_t *cond, const dlua_tensor_t *a, const dlua_tensor_t *b);
dlua_status_t dlua_tensor_masked_fill_(dlua_tensor_t *t, const dlua_tensor_t *mask, double value);
dlua_status_t dlua_tensor_addcmul_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value); /* t += value * a * b */
dlua_status_t dlua_tensor_addcdiv_(dlua_tensor_t *t, const dlua_tensor_t *a, const dlua_tensor_t *b, double value); /* t += value * a / b */
dlua_status_t dlua_tensor_lerp_(dlua_tensor_t *t, const dlua_tensor_t *end, double weight);          /* t += weight * (end - t) */

/* ==== reductions =========================================================================== */

typedef enum {
  DLUA_REDUCE_SUM = 0, DLUA_REDUCE_MEAN, DLUA_REDUCE_PROD,
  DLUA_REDUCE_MAX, DLUA_REDUCE_MIN,       /* values; indices too when `indices` is given */
  DLUA_REDUCE_ARGMAX, DLUA_REDUCE_ARGMIN, /* int64 indices only */
  DLUA_REDUCE_NORM,                       /* p = 1, 2 or INFINITY */
  DLUA_REDUCE_VAR, DLUA_REDUCE_STD,       /* p = correction (1: unbiased) */
  DLUA_REDUCE_ANY, DLUA_REDUCE_ALL,       /* bool */
  DLUA_REDUCE_COUNT_NONFINITE,            /* int64 */
  DLUA_REDUCE_COUNT
} dlua_reduce_op_t;

/* Reduces over `dims` (ndims of them; ndims == 0: all dims) with keepdim. f16/bf16 sum in
   f32; sums are blocked and combined in a fixed order, so they do not depend on threads.
   `indices` (may be NULL) receives int64 positions of max/min/arg*, plus index_base. */
dlua_status_t dlua_tensor_reduce(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *a, dlua_reduce_op_t op, int ndims, const int *dims, int keepdim, double p, int64_t index_base);

/* ==== indexing =============================================================================== */

/* Index tensors hold integers (i32 or i64) counted from index_base (1 from Lua, 0 from C);
   returned indices are int64 counted from index_base. */
dlua_status_t dlua_tensor_index_select(dlua_tensor_t **out, const dlua_tensor_t *a, int dim, const dlua_tensor_t *index, int64_t index_base);
dlua_status_t dlua_tensor_gather(dlua_tensor_t **out, const dlua_tensor_t *a, int dim, const dlua_tensor_t *index, int64_t index_base);
dlua_status_t dlua_tensor_scatter_add_(dlua_tensor_t *t, int dim, const dlua_tensor_t *index, const dlua_tensor_t *src, int64_t index_base);
/* The k largest (largest=1) or smallest along dim, by value or by |value|; values keep their sign. */
dlua_status_t dlua_tensor_topk(dlua_tensor_t **values, dlua_tensor_t **indices, const dlua_tensor_t *a, int64_t k, int dim, int largest, int by_magnitude, int sorted, int64_t index_base);
/* Stable sort along dim; NaN sorts as the largest value. */
dlua_status_t dlua_tensor_sort(dlua_tensor_t **values, dlua_tensor_t **indices, const dlua_tensor_t *a, int dim, int descending, int64_t index_base);
dlua_status_t dlua_tensor_cat(dlua_tensor_t **out, int n, dlua_tensor_t *const *ts, int dim);
dlua_status_t dlua_tensor_stack(dlua_tensor_t **out, int n, dlua_tensor_t *const *ts, int dim);
/* labels (integers from index_base) -> (..., num_classes) of dtype */
dlua_status_t dlua_tensor_one_hot(dlua_tensor_t **out, const dlua_tensor_t *labels, int64_t num_classes, int64_t index_base, dlua_dtype_t dtype);

/* ==== linear algebra ========================================================================= */

/* torch.matmul: 1-D/2-D/batched with broadcast batch dims; f16/bf16 accumulate in f32. */
dlua_status_t dlua_tensor_matmul(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b);
dlua_status_t dlua_tensor_mm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b);   /* (n,k) x (k,m) */
dlua_status_t dlua_tensor_bmm(dlua_tensor_t **out, const dlua_tensor_t *a, const dlua_tensor_t *b);  /* (b,n,k) x (b,k,m) */
/* out = beta * c + alpha * (a @ b); c broadcasts to (n, m). */
dlua_status_t dlua_tensor_addmm(dlua_tensor_t **out, const dlua_tensor_t *c, const dlua_tensor_t *a, const dlua_tensor_t *b, double beta, double alpha);
/* Row-major single-precision GEMM on raw pointers: C = alpha * op(A) op(B) + beta * C. */
dlua_status_t dlua_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

/* ==== rendezvous store ======================================================================= */

/* A TCP key-value store where the ranks of a job meet (docs/comm.md). The server runs on a
   thread of rank 0 or the launcher; every rank holds a client. A per-job token guards it:
   a connection with another token is refused. Keys are non-empty C strings (at most 4096
   bytes); values are byte strings (pointer + length, at most 256 MiB). Timeouts are in
   milliseconds; a negative timeout means the client's default (the one given to connect).
   A client handle serves one request at a time (calls from several threads queue up). */
typedef struct dlua_store_server dlua_store_server_t;
typedef struct dlua_store dlua_store_t;

/* host NULL or "" binds 127.0.0.1 (single-node jobs); port 0 picks a free port. */
dlua_status_t dlua_store_server_start(const char *host, int port, const char *token, dlua_store_server_t **server);
int dlua_store_server_port(const dlua_store_server_t *server);
/* Closes every connection (blocked clients get an I/O error) and joins the thread. NULL is ignored. */
void dlua_store_server_stop(dlua_store_server_t *server);

/* Retries with exponential back-off while the server is not up yet, until timeout_ms. */
dlua_status_t dlua_store_connect(const char *host, int port, const char *token, int64_t timeout_ms, dlua_store_t **store);
void dlua_store_close(dlua_store_t *store);
dlua_status_t dlua_store_set_timeout(dlua_store_t *store, int64_t timeout_ms);
dlua_status_t dlua_store_set(dlua_store_t *store, const char *key, const void *value, size_t len);
/* Waits until key exists; *value (NUL-terminated, not counted in *len) is freed with dlua_store_free_value. */
dlua_status_t dlua_store_get(dlua_store_t *store, const char *key, int64_t timeout_ms, void **value, size_t *len);
void dlua_store_free_value(void *value);
/* Waits until every key exists; a timeout names the keys still missing. */
dlua_status_t dlua_store_wait(dlua_store_t *store, const char *const *keys, int n, int64_t timeout_ms);
/* Atomic counter (stored as decimal text; a missing key counts as 0); *value gets the new value. */
dlua_status_t dlua_store_add(dlua_store_t *store, const char *key, int64_t delta, int64_t *value);
/* If the key holds `expected` (expected NULL: if the key does not exist), stores `desired`.
   *current gets the value stored afterwards (NULL if the key does not exist), freed with
   dlua_store_free_value; it equals desired when the swap happened. */
dlua_status_t dlua_store_compare_set(dlua_store_t *store, const char *key, const void *expected, size_t expected_len, const void *desired, size_t desired_len, void **current, size_t *current_len);
/* Does not wait: exists[i] = 1 if keys[i] exists, else 0. */
dlua_status_t dlua_store_check(dlua_store_t *store, const char *const *keys, int n, int *exists);
/* *deleted (may be NULL) = 1 if the key existed. */
dlua_status_t dlua_store_delete(dlua_store_t *store, const char *key, int *deleted);

/* dlua's public C API: every function Lua may call. Plain declarations only (no macros,
   no includes): the build embeds this text and bindings/ hands it to ffi.cdef verbatim.
   C files include <stdint.h> and <stddef.h> before this header. */
/* One file, over 900 lines: it is the single text handed to ffi.cdef (embedded by the build), so every
   declaration Lua may call lives here; split headers would need a second embedding and load order. */

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
int dlua_cuda_emulated(void); /* 1 when built with DLUA_CUDA=EMU: "cuda" devices are the CPU emulator (host/cuemu) */

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

/* Bytes of tensor storage alive on a device (-1: CPU), and the peak since start (or the last reset). */
int64_t dlua_memory_allocated(int device);
int64_t dlua_memory_peak(int device);
void dlua_memory_reset_peak(int device);   /* the peak becomes what is alive now */
int64_t dlua_memory_allocated_total(void); /* all devices: drives the Lua GC's pacing */
/* Bytes the allocator keeps for reuse (freed blocks), and giving them back to the system. */
int64_t dlua_memory_cached(int device);
void dlua_memory_empty_cache(int device);

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

/* ==== gradient compression (DDP communication hooks, docs/ddp.md) ============================ */

/* CPU tensors, contiguous. dst (n) f16 or bf16 = src (n) f32 * scale, rounded to nearest even; and back. */
dlua_status_t dlua_compress_to_half(dlua_tensor_t *dst, const dlua_tensor_t *src, double scale);
dlua_status_t dlua_compress_from_half(dlua_tensor_t *dst, const dlua_tensor_t *src);
/* Top-k of one bucket: grad (n) f32; acc (n) f32 or NULL (error feedback: acc += grad); mom (n) f32 or NULL
   (DGC momentum correction: mom = momentum * mom + grad, acc += mom). The k largest |acc| (|grad| without acc)
   go into packed (2k) int32: k float bit patterns, then their k 0-based indices, increasing; their acc and mom
   entries become 0, so acc keeps exactly what was not sent. */
dlua_status_t dlua_compress_topk(dlua_tensor_t *packed, const dlua_tensor_t *grad, dlua_tensor_t *acc, dlua_tensor_t *mom, double momentum, int64_t k);
/* grad (n) f32 = (sum over the rows of gathered (rows, 2k) int32 of their values at their indices, in row
   order) / divisor. */
dlua_status_t dlua_compress_topk_unpack(dlua_tensor_t *grad, const dlua_tensor_t *gathered, int64_t rows, double divisor);
/* PowerSGD: p (n, r) f32 gets orthonormal columns (modified Gram-Schmidt in double); a column whose remaining
   norm is <= eps or <= 1e-10 of its own (in the span of the earlier ones) becomes 0. */
dlua_status_t dlua_compress_orthogonalize(dlua_tensor_t *p, double eps);

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

/* ==== process groups ========================================================================= */

/* A group of ranks that run collectives together (docs/comm.md). gloo over TCP for CPU
   tensors; every group has one comm thread that runs its work in call order. Ranks are
   0-based. The reduce ops are DLUA_PG_REDUCE_* (DLUA_REDUCE_* names the tensor reductions). CUDA
   tensors: gloo stages them through pinned host memory; NCCL groups take them directly. */
typedef struct dlua_pg dlua_pg_t;
typedef struct dlua_work dlua_work_t;
typedef enum { DLUA_PG_REDUCE_SUM = 0, DLUA_PG_REDUCE_AVG = 1, DLUA_PG_REDUCE_MAX = 2, DLUA_PG_REDUCE_MIN = 3,
               DLUA_PG_REDUCE_PRODUCT = 4, DLUA_PG_REDUCE_COUNT = 5 } dlua_reduce_t;
/* Joins a gloo group of `size` members as `rank`; members meet through the store at host:port with
   the job token, under the key prefix `name` (unique per group: "pg0", "pg1"...). timeout_ms bounds the
   join and every collective. */
dlua_status_t dlua_pg_gloo_new(const char *store_host, int store_port, const char *token, const char *name, int rank, int size, int64_t timeout_ms, dlua_pg_t **pg);
/* NULL when libnccl.so.2 loads (a usable version), else why not. */
const char *dlua_pg_nccl_unavailable(void);
/* Joins an NCCL group whose collectives take CUDA tensors on `device` (its GPU; each rank its own).
   Rank 0's unique id travels through the store under "<name>/nccl/id"; the communicator is created
   non-blocking, so a missing rank fails the join after timeout_ms. Works run on the group's own stream
   after the caller's current stream, and complete when the GPU has finished them. Without CUDA, a
   device or libnccl.so.2: DLUA_ERR_ARG naming why ("no CUDA device available (...)"). */
dlua_status_t dlua_pg_nccl_new(const char *store_host, int store_port, const char *token, const char *name, int rank, int size, int device, int64_t timeout_ms, dlua_pg_t **pg);
/* NULL when this build has MPI (found at build time: libopenmpi-dev), else why not. */
const char *dlua_pg_mpi_unavailable(void);
/* Initialises MPI once for this process (MPI_THREAD_MULTIPLE; call it from the thread that will exit the
   process: MPI_Finalize runs in an exit handler there, and only when the process ends well) and gives its
   rank and size in MPI_COMM_WORLD. Without mpirun/srun, a world of one. */
dlua_status_t dlua_mpi_world(int *rank, int *size);
/* Rank root's n bytes to every rank of MPI_COMM_WORLD (dist.init: the store's address), bounded by timeout_ms. */
dlua_status_t dlua_mpi_world_broadcast(void *buf, int64_t n, int root, int64_t timeout_ms);
/* Joins an MPI group (one communicator made of the members, who meet through the store as for gloo). Each
   collective is MPI's non-blocking one polled by the comm thread (under 4 MiB; DLUA_MPI_BLOCKING_FROM bytes) or
   its blocking one run by the group's executor thread, bounded by timeout_ms either way; send/recv
   are MPI_Isend/MPI_Irecv posted at once. CUDA tensors go through pinned host memory (directly, except for
   reductions, when the library is CUDA-aware). */
dlua_status_t dlua_pg_mpi_new(const char *store_host, int store_port, const char *token, const char *name, int rank, int size, int64_t timeout_ms, dlua_pg_t **pg);
const char *dlua_pg_backend(const dlua_pg_t *pg); /* "gloo", "nccl" or "mpi" */
/* How all-reduce travels: "shm" (gloo group, all ranks on this host), "tcp" (gloo), "nccl" or "mpi"; *why (if
   why is not NULL) says why shm is used or not (mpi: the library and whether every rank is on this host). */
const char *dlua_pg_transport(const dlua_pg_t *pg, const char **why);
/* A zeroed 1-D CPU tensor of numel elements whose memory every rank of the group maps, so an all-reduce of
   a range of it reads the peers' copies in place (DDP's gradient arena; docs/comm.md). Collective: every
   rank calls it alike. *out is NULL (status OK) when the ranks do not share a host or some rank could not
   make its copy; *why (if why is not NULL) says which. */
dlua_status_t dlua_pg_shared_zeros(dlua_pg_t *pg, dlua_dtype_t dtype, int64_t numel, dlua_tensor_t **out, const char **why);
void dlua_pg_free(dlua_pg_t *pg);           /* waits for queued work (bounded by the timeout), then closes */
int dlua_pg_rank(const dlua_pg_t *pg);
int dlua_pg_size(const dlua_pg_t *pg);
int64_t dlua_pg_seq(const dlua_pg_t *pg);   /* collectives issued so far (send/recv not counted) */
dlua_status_t dlua_pg_set_timeout(dlua_pg_t *pg, int64_t timeout_ms);
dlua_status_t dlua_pg_set_debug(dlua_pg_t *pg, int on);
/* Collectives. `site` names the caller ("train.lua:42", may be NULL) for error messages and the debug
   check. work == NULL: runs synchronously and returns its status. work != NULL: queued, returns at once
   with *work (wait/is_completed/free). All work of a group runs in call order on the group's comm thread,
   so sync and async calls interleave correctly. Tensors: any dtype; CPU ones of any strides (non-contiguous
   ones go through a contiguous staging copy, written back for outputs), CUDA ones contiguous (gloo: staged
   in pinned memory, one device per call; NCCL: on the group's device only); a queued work keeps its tensors
   alive (hold your own handles, e.g. dlua_tensor_view of the same shape) until it completes. */
dlua_status_t dlua_pg_all_reduce(dlua_pg_t *pg, dlua_tensor_t *t, dlua_reduce_t op, const char *site, dlua_work_t **work);
/* One work that all-reduces n tensors in place (NCCL: one ncclGroupStart/End; gloo: one after the other). */
dlua_status_t dlua_pg_all_reduce_many(dlua_pg_t *pg, dlua_tensor_t *const *ts, int n, dlua_reduce_t op, const char *site, dlua_work_t **work);
dlua_status_t dlua_pg_broadcast(dlua_pg_t *pg, dlua_tensor_t *t, int src, const char *site, dlua_work_t **work);
/* outs: size tensors; outs[r] receives rank r's t (their numels may differ between ranks: all_gather_v). */
dlua_status_t dlua_pg_all_gather(dlua_pg_t *pg, dlua_tensor_t *const *outs, const dlua_tensor_t *t, const char *site, dlua_work_t **work);
/* ins: size tensors of equal numel; rank r's out = reduction over ranks of their ins[r]. */
dlua_status_t dlua_pg_reduce_scatter(dlua_pg_t *pg, dlua_tensor_t *out, dlua_tensor_t *const *ins, dlua_reduce_t op, const char *site, dlua_work_t **work);
/* ins[r] is sent to rank r; outs[r] receives what rank r sent here (numels may differ, must agree pairwise). */
dlua_status_t dlua_pg_all_to_all(dlua_pg_t *pg, dlua_tensor_t *const *outs, dlua_tensor_t *const *ins, const char *site, dlua_work_t **work);
dlua_status_t dlua_pg_barrier(dlua_pg_t *pg, const char *site, dlua_work_t **work);
dlua_status_t dlua_pg_send(dlua_pg_t *pg, const dlua_tensor_t *t, int dst, int tag, const char *site, dlua_work_t **work);
dlua_status_t dlua_pg_recv(dlua_pg_t *pg, dlua_tensor_t *t, int src, int tag, const char *site, dlua_work_t **work);
/* Waits (timeout_ms < 0: until the work ends, which the group's timeout bounds; polls the Ctrl-C flag
   every 100 ms) and returns the work's status; its error message becomes this thread's dlua_last_error.
   timeout_ms >= 0 and not done in time: DLUA_ERR_TIMEOUT, the work goes on. Ctrl-C: DLUA_ERR_INTERRUPTED,
   and the group is unusable afterwards. */
dlua_status_t dlua_work_wait(dlua_work_t *w, int64_t timeout_ms);
int dlua_work_is_completed(const dlua_work_t *w);
void dlua_work_free(dlua_work_t *w);        /* safe before completion: the group finishes it */

/* ==== losses and activations ================================================================= */

/* Float tensors (f32, f64; f16/bf16 compute in f32). Results follow the `out` convention with
   the input's dtype; any input may be a non-contiguous view. `dim` is 0-based. */
typedef enum {
  DLUA_LOSS_NONE = 0, /* one loss per target, in the targets' shape */
  DLUA_LOSS_MEAN = 1, /* a 0-dim tensor; cross-entropy divides by the summed weights of the kept targets */
  DLUA_LOSS_SUM = 2,  /* a 0-dim tensor */
  DLUA_LOSS_REDUCTION_COUNT = 3
} dlua_loss_reduction_t;

/* softmax (log = 0) or log_softmax (log = 1) of x along dim, max-subtracted. */
dlua_status_t dlua_nn_softmax(dlua_tensor_t **out, const dlua_tensor_t *x, int dim, int log);
/* grad_input from grad_output and the forward's output (all the same shape). */
dlua_status_t dlua_nn_softmax_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *output, int dim, int log);

/* torch.nn.functional.cross_entropy with class-index targets. logits (N, K) or (N, K, d1, ...)
   (or (K) with a 0-dim label); labels (N) or (N, d1, ...), integers counted from index_base;
   a label equal to ignore_index (in the same numbering; pass -100 when nothing is ignored)
   is skipped; weight (K) or NULL; label_smoothing in [0, 1] as PyTorch defines it. `out` is
   0-dim (mean/sum) or in labels' shape (none). `log_probs` may be NULL; otherwise it receives
   the log-softmax of the logits (logits' shape and dtype when allocated), which backward takes. */
dlua_status_t dlua_nn_cross_entropy(dlua_tensor_t **out, dlua_tensor_t **log_probs, const dlua_tensor_t *logits, const dlua_tensor_t *labels, const dlua_tensor_t *weight, dlua_loss_reduction_t reduction, double label_smoothing, int64_t ignore_index, int64_t index_base);
/* One fused pass: grad_logits = (softmax * S - q) * grad, q the smoothed and weighted one-hot
   (S = sum of q; 1 without weights), zero for ignored targets. grad_output: 0-dim (mean/sum)
   or labels' shape (none); NULL means 1. Same labels/weight/options as the forward. */
dlua_status_t dlua_nn_cross_entropy_backward(dlua_tensor_t **grad_logits, const dlua_tensor_t *grad_output, const dlua_tensor_t *log_probs, const dlua_tensor_t *labels, const dlua_tensor_t *weight, dlua_loss_reduction_t reduction, double label_smoothing, int64_t ignore_index, int64_t index_base);

/* Mean squared error; input and target have one shape. grad_output NULL means 1. */
dlua_status_t dlua_nn_mse_loss(dlua_tensor_t **out, const dlua_tensor_t *input, const dlua_tensor_t *target, dlua_loss_reduction_t reduction);
dlua_status_t dlua_nn_mse_loss_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *input, const dlua_tensor_t *target, dlua_loss_reduction_t reduction);

/* torch.nn.Threshold: y = x <= threshold ? value : x (ReLU: 0, 0; NaN passes through). */
dlua_status_t dlua_nn_threshold(dlua_tensor_t **out, const dlua_tensor_t *x, double threshold, double value);
/* grad_input = x <= threshold ? 0 : grad_output; x is the layer's input, or ReLU's output. */
dlua_status_t dlua_nn_threshold_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *x, double threshold);
dlua_status_t dlua_nn_relu_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *output);

/* Dropout. Training (train != 0, 0 < p < 1): *mask (x's shape; bool when allocated) is
   bernoulli_(1 - p) drawn from g (NULL: the default generator), so it depends only on
   (seed, offset); out = x * mask / (1 - p). p = 0 keeps everything and p = 1 drops
   everything without drawing. Evaluation: out = x, and mask may be NULL. */
dlua_status_t dlua_nn_dropout(dlua_tensor_t **out, dlua_tensor_t **mask, const dlua_tensor_t *x, double p, int train, dlua_generator_t *g);
/* grad_input = grad_output * (mask != 0) / (1 - p) (0 when p = 1). */
dlua_status_t dlua_nn_dropout_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *mask, double p);

/* ==== optimizers ============================================================================= */

/* One fused loop per call over elements [offset, offset + length) of flat arenas: param, grad
   and the state buffers are contiguous tensors of one float dtype (f32 or f64) and one numel
   (any shape, taken flat), e.g. narrowed views of the model's arenas. Every step first
   multiplies the gradient by grad_scale (1 / loss scale under AMP, else 1) without writing it
   back. Order of operations follows torch.optim, so results match PyTorch's to rounding. */

/* torch.optim.SGD: d = grad (negated when maximize) + weight_decay * p; with momentum,
   buf = first_step ? d : momentum * buf + (1 - dampening) * d and d = nesterov ? d +
   momentum * buf : buf; p -= lr * d. momentum_buf may be NULL when momentum == 0. */
dlua_status_t dlua_optim_sgd_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf, int64_t offset, int64_t length, double lr, double momentum, double dampening, double weight_decay, int nesterov, int maximize, int first_step, double grad_scale);

/* torch.optim.AdamW: p *= 1 - lr * weight_decay; m = beta1 m + (1 - beta1) g; v = beta2 v +
   (1 - beta2) g^2; p -= lr / (1 - beta1^step) * m / (sqrt(v') / sqrt(1 - beta2^step) + eps),
   v' = v, or with amsgrad the running max kept in max_exp_avg_sq (NULL otherwise).
   step counts this step (1 on the first). */
dlua_status_t dlua_optim_adamw_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset, int64_t length, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale);

/* torch.optim.Adam: g = grad (negated when maximize) + weight_decay * p (L2 coupled into the
   gradient, so the moments see the decay), then AdamW's moments and update without its decoupled
   decay. Arguments as dlua_optim_adamw_step. */
dlua_status_t dlua_optim_adam_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset, int64_t length, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale);

/* LARS as NVIDIA's LARC wraps SGD: for each of the n_ranges parameters [offsets[i],
   offsets[i] + lengths[i]) (disjoint), trust = trust_coefficient * |p| / (|g| + weight_decay *
   |p| + eps), d = (g + weight_decay * p) * trust; a parameter with exclude[i] != 0 (bias,
   batch-norm), or with |p| or |g| zero (as LARC), takes d = g: no decay, no adaptation. Then
   buf = first_step ? d : momentum * buf + d; p -= lr * buf. exclude may be NULL. */
dlua_status_t dlua_optim_lars_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf, int n_ranges, const int64_t *offsets, const int64_t *lengths, const int32_t *exclude, double lr, double momentum, double weight_decay, double trust_coefficient, double eps, int first_step, double grad_scale);

/* LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2) with a trust
   ratio per parameter range, ranges as dlua_optim_lars_step's: m = beta1 m + (1 - beta1) g;
   v = beta2 v + (1 - beta2) g^2; u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p, where
   bc1 = 1 - beta1^step and bc2 = 1 - beta2^step with bias_correction, else 1; trust = |p| / |u|
   (2-norms over the parameter, 1 when either is 0); p -= lr * trust * u. A parameter with
   exclude[i] != 0 takes no decay and trust 1 (a plain Adam step). No clamp on the ratio. */
dlua_status_t dlua_optim_lamb_step(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, int n_ranges, const int64_t *offsets, const int64_t *lengths, const int32_t *exclude, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int bias_correction, double grad_scale);

/* Mixed precision's master weights: the same steps as dlua_optim_sgd_step and dlua_optim_adam(w)_step
   (decoupled 0: Adam, 1: AdamW), also writing lowp[i] = param[i] rounded to lowp's dtype for every element
   stepped, chunk by chunk in the same pass over the arena. lowp: a contiguous bfloat16 or float16 tensor of
   param's element count (the arena's 16-bit twin), param float32, both on the CPU. */
dlua_status_t dlua_optim_sgd_step_lowp(dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *momentum_buf, int64_t offset, int64_t length, double lr, double momentum, double dampening, double weight_decay, int nesterov, int maximize, int first_step, double grad_scale, dlua_tensor_t *lowp);
dlua_status_t dlua_optim_adam_step_lowp(int decoupled, dlua_tensor_t *param, const dlua_tensor_t *grad, dlua_tensor_t *exp_avg, dlua_tensor_t *exp_avg_sq, dlua_tensor_t *max_exp_avg_sq, int64_t offset, int64_t length, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int amsgrad, int maximize, double grad_scale, dlua_tensor_t *lowp);

/* Mixed precision: grad[offset, offset + length) *= inv_scale in one pass (f32, f64, f16, bf16);
   *nonfinite receives how many of those gradients were Inf or NaN. */
dlua_status_t dlua_optim_unscale(dlua_tensor_t *grad, int64_t offset, int64_t length, double inv_scale, int64_t *nonfinite);

/* Gradient clipping (clip_grad_norm_), in two pieces so that ranks holding shards of the arena can
   combine theirs: *out = the sum of |g|^norm_type over grad[offset, offset + length) for a finite
   norm_type > 0, or max |g| for norm_type = inf (NaN wins), accumulated in double over fixed
   blocks folded in order (the same bits for any thread count). Sum (or max) the pieces of every
   range and rank, then total = sum^(1 / norm_type). f32, f64, f16, bf16. */
dlua_status_t dlua_optim_grad_norm_partial(const dlua_tensor_t *grad, int64_t offset, int64_t length, double norm_type, double *out);

/* grad[offset, offset + length) *= scale in one pass (f32, f64, f16, bf16): the clip coefficient. */
dlua_status_t dlua_optim_grad_scale(dlua_tensor_t *grad, int64_t offset, int64_t length, double scale);

/* ==== data: IDX files, batch augmentation ==================================================== */

/* Reads an IDX file (MNIST's format: a big-endian magic 0x0000TTDD with element type TT and
   DD dims, DD big-endian uint32 sizes, then the elements row-major and big-endian) into a
   new CPU tensor of the file's dims. Gzipped files (e.g. `.gz`) are inflated through zlib.
   Types: 0x08 uint8, 0x0C int32, 0x0D float32, 0x0E float64. Errors name the path: a
   missing file (and, under /usr/share/datasets/fashion-mnist, the Debian package), a bad
   magic number, a truncated file or gzip stream, bytes left over after the data. */
dlua_status_t dlua_data_read_idx(dlua_tensor_t **out, const char *path);
/* An MNIST pair: *images gets uint8 (N, H, W) from a file with magic 0x00000803, *labels
   int64 (N) from one with magic 0x00000801, each file value plus label_base (1 from Lua);
   the counts must agree. Both are set, or neither. */
dlua_status_t dlua_data_read_mnist(dlua_tensor_t **images, dlua_tensor_t **labels, const char *images_path, const char *labels_path, int64_t label_base);
/* Gathers a batch and augments it: out[b] = flip_b(crop_b(x[index[b]])), where crop_b pads
   the image with `pad` zeros on every side and takes the H x W window at (dy, dx) in
   [0, 2 pad]^2, and flip_b mirrors the columns with probability flip_p. A sample's (dy, dx,
   flip) is a function of (seed, epoch, its index in x) alone: lanes 0, 1, 2 of the Philox
   block keyed by seed at counter (index lo32, index hi32, epoch lo32, epoch hi32 ^
   0x41554731), dy = (lane0 * (2 pad + 1)) >> 32, dx likewise, flip = lane2 / 2^32 < flip_p;
   so results do not depend on the batch, the thread count or the backend.
   x (N, C, H, W) uint8 or float32, any strides; index (B) int32/int64 counted from
   index_base, or NULL for every image in order; out (B, C, H, W): allocated with x's dtype,
   or given (float32 from uint8 converts in the same pass). pad 0, flip_p 0: a plain gather. */
dlua_status_t dlua_data_augment(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *index, int64_t index_base, int64_t pad, double flip_p, uint64_t seed, uint64_t epoch);
/* out = (x * scale - mean[c]) / std[c], c the position along dim 1: x (N, C, ...) of any
   dtype; mean and std hold nstats = 1 or C values; out (N, C, ...) allocated float32, or
   given (may be x itself when x is float32). */
dlua_status_t dlua_data_normalize(dlua_tensor_t **out, const dlua_tensor_t *x, double scale, int nstats, const double *mean, const double *std);

/* ==== data pipeline: image decoding, ImageFolder, transforms, loader ========================= */

/* Images are uint8 (H, W, C). Reading decodes JPEG (TurboJPEG) and PNG (libpng) by their
   magic number into RGB (H, W, 3): grey and CMYK JPEGs and palette/grey/alpha/16-bit PNGs
   are converted as Pillow's convert('RGB') does (alpha dropped, 16-bit keeps the high byte).
   scale_num/scale_den (den 0: full size) picks a TurboJPEG DCT scaling factor for JPEGs
   (1/2, 1/4, 1/8...; ignored for PNG). Corrupt, truncated or non-image data is DLUA_ERR_IO
   naming the file. */
dlua_status_t dlua_image_read(dlua_tensor_t **out, const char *path, int scale_num, int scale_den);
dlua_status_t dlua_image_decode(dlua_tensor_t **out, const void *buf, size_t len, int scale_num, int scale_den);
/* img (H, W, C) uint8: C = 1 (grey), 3 (RGB, 4:2:0) or 4 (CMYK, stored inverted as Adobe's). Written atomically. */
dlua_status_t dlua_image_write_jpeg(const dlua_tensor_t *img, const char *path, int quality);
/* img (H, W, C) uint8: C = 1 grey, 2 grey + alpha, 3 RGB, 4 RGBA; 8-bit. */
dlua_status_t dlua_image_write_png(const dlua_tensor_t *img, const char *path);

/* An ImageFolder: root/<class>/.../<file>.{jpg,jpeg,png} (any case), classes = the sorted
   sub-folder names of root, files sorted by folder then name (torchvision's order), labels
   0-based here. The list is cached in cache_dir/<hash of the root's real path>.list (NULL:
   $XDG_CACHE_HOME/dlua/imagefolder or ~/.cache/dlua/imagefolder; "": no cache) and reused
   while every folder of the tree keeps the mtime recorded there. Errors name the path: a
   missing root, no class folder, a class folder without images. */
typedef struct dlua_folder dlua_folder_t;
dlua_status_t dlua_folder_open(dlua_folder_t **out, const char *root, const char *cache_dir);
void dlua_folder_free(dlua_folder_t *f);
int64_t dlua_folder_size(const dlua_folder_t *f);
int dlua_folder_num_classes(const dlua_folder_t *f);
const char *dlua_folder_class(const dlua_folder_t *f, int c);        /* c 0-based */
const char *dlua_folder_file(const dlua_folder_t *f, int64_t i);     /* relative to the root */
int dlua_folder_label(const dlua_folder_t *f, int64_t i);            /* 0-based, -1 out of range */
const char *dlua_folder_root(const dlua_folder_t *f);
int dlua_folder_cached(const dlua_folder_t *f);                      /* 1: the list came from the cache */
const char *dlua_folder_cache_path(const dlua_folder_t *f);

/* Transforms, torchvision's semantics on the Pillow path. Random ones draw from Philox keyed
   by seed at counter (sample lo32, sample hi32, epoch lo32, 0x54460000 ^ position << 8 ^
   block), position = the transform's 0-based place in the list: the result is a function of
   (seed, epoch, sample) alone. u(r) = r / 2^32, randint(n)(r) = (r * n) >> 32.
   RANDOM_RESIZED_CROP(h, w, scale, ratio): attempt a = 0..9 uses block a: area = H W
     (scale0 + (scale1 - scale0) u(r0)), aspect = exp(log ratio0 + (log ratio1 - log ratio0)
     u(r1)), cw = round(sqrt(area aspect)), ch = round(sqrt(area / aspect)) (half to even);
     if it fits, top = randint(H - ch + 1)(r2), left = randint(W - cw + 1)(r3); else
     torchvision's central fallback. Then a bilinear resize of the crop to (h, w).
   RESIZE(h, w): to (h, w); w == 0: the shorter side becomes h, the other int(h * long / short).
   Resizing is Pillow's antialiased bilinear (Image.resize(BILINEAR)), pixel-exact.
   CENTER_CROP(h, w): top = round((H - h) / 2), zero padding where the crop is larger.
   HFLIP(p): mirrors when u(r0 of block 0) < p.
   TO_TENSOR(layout, dtype): float32 x / 255 (or uint8 kept), a (C, H, W) sample in memory format
     layout 0 (row-major) or 1 (channels-last: (H, W, C) bytes, strides (1, W*C, C)).
   NORMALIZE(n, mean, std): (x - mean[c]) / std[c] after a float ToTensor; n = 1 or C. */
typedef enum {
  DLUA_TF_RANDOM_RESIZED_CROP = 0,
  DLUA_TF_RESIZE = 1,
  DLUA_TF_CENTER_CROP = 2,
  DLUA_TF_HFLIP = 3,
  DLUA_TF_NORMALIZE = 4,
  DLUA_TF_TO_TENSOR = 5,
  DLUA_TF_COUNT = 6
} dlua_transform_kind_t;
typedef struct {
  int kind;
  int h, w;
  double scale[2], ratio[2];
  double p;
  int n;
  double mean[4], std[4];
  int layout;
  int dtype;
} dlua_transform_t;
typedef struct dlua_pipeline dlua_pipeline_t;
dlua_status_t dlua_pipeline_new(dlua_pipeline_t **out, const dlua_transform_t *ops, int n);
void dlua_pipeline_free(dlua_pipeline_t *p);
/* Runs the transforms on one image (H, W, C) uint8 as sample `sample` (0-based) of `epoch`;
   out: (C, H', W'), row-major or channels-last as ToTensor's layout says; float32 after ToTensor, else uint8. */
dlua_status_t dlua_pipeline_apply(dlua_tensor_t **out, const dlua_pipeline_t *p, const dlua_tensor_t *img, uint64_t seed, uint64_t epoch, int64_t sample);
/* The crop RandomResizedCrop at `position` draws for an (h, w) image: box = top, left, height, width. */
void dlua_transform_rrc_box(const double *scale, const double *ratio, int h, int w, uint64_t seed, uint64_t epoch, int64_t sample, int position, int *box);
int dlua_transform_flip_draw(double p, uint64_t seed, uint64_t epoch, int64_t sample, int position);

/* The loader: C worker threads (signals blocked) read, decode and transform samples into
   batch buffers, at most `prefetch` batches ahead of the consumer; batches come out in the
   order given to dlua_loader_start. A sample whose file cannot be read or decoded is
   skipped (one warning naming it on stderr unless quiet; later epochs skip it unread) and
   its batch is shorter; a batch whose samples were all bad is not delivered. Exactly one
   dataset: folder, x (N, ...) with labels y (N) int64 or NULL, or synthetic_n images of
   synthetic_shape (C, H, W). Without a pipeline, images get ToTensor and tensors are
   gathered raw. Labels are 0-based + label_base (synthetic: sample % classes); y from x's
   dataset is passed through. pin_memory: page-locked buffers once a CUDA build exists
   (plain memory now). dct_scaling: decode JPEGs at 1/2, 1/4, 1/8 when the first resizing
   transform allows. */
typedef struct dlua_loader dlua_loader_t;
typedef struct {
  const dlua_folder_t *folder;
  const dlua_tensor_t *x;
  const dlua_tensor_t *y;
  int64_t synthetic_n;
  int64_t synthetic_shape[3];
  int synthetic_classes;
  const dlua_pipeline_t *pipeline;
  int64_t batch;
  int workers;          /* 0: each batch is made by dlua_loader_next on the calling thread */
  int prefetch;         /* batches in flight, >= 1 */
  int pin_memory;
  int dct_scaling;
  int quiet;
  uint64_t seed;
  int64_t label_base;
} dlua_loader_config_t;
typedef struct {
  int64_t samples, batches, decoded, skipped, bad_files, dct_scaled, buffers;
  double wait_s;        /* time dlua_loader_next waited for data */
  double work_s;        /* summed over workers: reading, decoding, transforming */
  int threads, epoch_active;
} dlua_loader_stats_t;
dlua_status_t dlua_loader_new(dlua_loader_t **out, const dlua_loader_config_t *cfg);
/* Stops the epoch (joins the threads) and frees; batches still alive keep their buffers. */
void dlua_loader_free(dlua_loader_t *l);
/* One sample of a batch: returns its ndim (sizes filled), *dtype its dtype. */
int dlua_loader_sample_shape(const dlua_loader_t *l, int64_t *sizes, int *dtype);
int64_t dlua_loader_dataset_size(const dlua_loader_t *l);
/* Starts an epoch over order[0..n) (sample indices counted from base); stops a running one first. */
dlua_status_t dlua_loader_start(dlua_loader_t *l, const int64_t *order, int64_t n, int64_t base, uint64_t epoch, int drop_last);
/* The next batch: *x (B, ...), *y (B) int64 (NULL for unlabelled tensors), *batch its 0-based
   position in the epoch; images are (B, C, H, W), with channels-last strides (H*W*C, 1, W*C, C)
   after a channels-last ToTensor. *x NULL: the epoch is over (threads joined). Waits for the workers,
   polling Ctrl-C; on DLUA_ERR_INTERRUPTED or any error the epoch is stopped (threads joined).
   x wraps a pool buffer that returns to the loader when the tensor is freed. */
dlua_status_t dlua_loader_next(dlua_loader_t *l, dlua_tensor_t **x, dlua_tensor_t **y, int64_t *batch);
/* Ends the epoch at any point: workers finish their sample and are joined. */
void dlua_loader_stop(dlua_loader_t *l);
void dlua_loader_get_stats(const dlua_loader_t *l, dlua_loader_stats_t *st);
/* The message of the i-th distinct bad file (0-based), NULL past the end. */
const char *dlua_loader_bad_file(const dlua_loader_t *l, int64_t i);
/* Loader worker threads alive in the process (all loaders). */
int dlua_loader_live_threads(void);

/* ==== convolution ============================================================================ */

/* 2-D convolution (cross-correlation, as torch.nn.functional.conv2d). Activations are logically
   (N, C, H, W) in either memory format: NCHW (contiguous) or channels-last NHWC (strides
   (H*W*C, 1, W*C, C), as PyTorch's channels_last); weights are (O, C/groups, kH, kW) in OIHW
   (contiguous) or OHWI memory. Other strides are copied into one of those first. float32 runs on
   oneDNN (fastest channels-last; NCHW is reordered inside each call); float16/bfloat16 compute in
   float32; float64 runs direct loops. Inputs of one call share a dtype; outputs follow the `out`
   convention and, when allocated, the memory format of the input they come from. Padding is
   symmetric; dilation 1 means none. */
/* Output extent along one dimension: floor((in + 2*pad - dil*(kernel-1) - 1) / stride) + 1;
   0 when the dilated kernel does not fit, -1 for a bad argument. */
int64_t dlua_conv2d_output_size(int64_t in, int64_t kernel, int stride, int pad, int dil);
/* out (N, O, OH, OW) = conv(x (N, C, H, W), w (O, C/groups, kH, kW)) + bias (O) (bias may be NULL). */
dlua_status_t dlua_conv2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, const dlua_tensor_t *w, const dlua_tensor_t *bias, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups);
/* grad_x (x_sizes: 4 entries, N, C, H, W) from grad_y (N, O, OH, OW) and w (O, C/groups, kH, kW);
   `out` convention (allocated in grad_y's memory format). accumulate 1 adds to the given *grad_x
   instead of overwriting it (a residual block's shortcut gradient: channels-last float32 with
   stride 1 adds inside the convolution, without a pass of its own). */
dlua_status_t dlua_conv2d_backward_data(dlua_tensor_t **grad_x, const dlua_tensor_t *grad_y, const dlua_tensor_t *w, const int64_t *x_sizes, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups, int accumulate);
/* Parameter gradients from x (N, C, H, W) and grad_y (N, O, OH, OW) into grad_w (O, C/groups, kH, kW)
   and grad_bias (O) (may be NULL): accumulate 1 adds to what they hold (Torch7's backward), 0
   overwrites. They may have another floating dtype than x (a float32 gradient arena). */
dlua_status_t dlua_conv2d_backward_weights(dlua_tensor_t *grad_w, dlua_tensor_t *grad_bias, const dlua_tensor_t *x, const dlua_tensor_t *grad_y, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int groups, int accumulate);

/* ==== batch-norm and pooling ================================================================= */

/* Activations are logically (N, C, H, W) (batch-norm also takes (N, C) and (N, C, L)) in either
   memory format: contiguous, or channels-last (channel stride 1, as PyTorch's channels_last:
   strides (H*W*C, 1, W*C, C)); other strides are copied into the contiguous format first.
   Allocated outputs follow the input's format and dtype. Floating dtypes only: float64 computes
   in double, float32/float16/bfloat16 in float with double sums; parameter and statistics
   tensors ((C), any floating dtype, any stride) may have another dtype than x. */

/* PyTorch's BatchNorm2d, optionally fused with a residual add and ReLU:
   out = act(gamma * (x - mean) * invstd + beta + skip), act = max(0, .) when relu != 0.
   x (N, C, ...); gamma, beta (C) or NULL (1 and 0); skip (x's shape) or NULL; out (x's shape).
   Training (train != 0): mean and the biased variance of the batch normalise; running_mean and
   running_var (C) (each may be NULL) become (1 - momentum) * running + momentum * batch, the
   variance unbiased (times M / (M - 1), M = N * H * W); a channel with M = 1 is an error as in
   PyTorch. Evaluation: running_mean and running_var (required) normalise.
   save_mean and save_invstd (C) follow the `out` convention (allocated float32, or float64 for
   float64 x), or may be NULL pointers when no backward follows: they receive the mean and
   1 / sqrt(var + eps) that normalised (the running ones in evaluation), which backward takes. */
dlua_status_t dlua_nn_batch_norm_forward(dlua_tensor_t **out, dlua_tensor_t **save_mean, dlua_tensor_t **save_invstd, const dlua_tensor_t *x, const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *skip, dlua_tensor_t *running_mean, dlua_tensor_t *running_var, int train, double momentum, double eps, int relu);
/* Gradients of the forward above from grad_output (x's shape). output (x's shape) is the forward's
   result, needed when relu != 0 (grad_output counts only where output > 0), else may be NULL.
   beta (C) may be NULL; given with relu, it promises that the forward ran with this gamma and beta
   and without a skip, and the ReLU mask is then recomputed from x as the forward computed it,
   which reads one tensor less than testing output (the result is the same).
   train says whether mean/invstd were the batch's (their gradient then flows into grad_input).
   grad_input (x's shape) and grad_skip (x's shape: grad_output masked by the ReLU) follow the
   `out` convention, allocated in grad_output's format; either may be a NULL pointer when not
   wanted. grad_gamma and grad_beta (C) (may be NULL; any floating dtype) receive sum(dy * xhat)
   and sum(dy): accumulate 1 adds to what they hold (Torch7's backward), 0 overwrites. */
dlua_status_t dlua_nn_batch_norm_backward(dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip, dlua_tensor_t *grad_gamma, dlua_tensor_t *grad_beta, const dlua_tensor_t *grad_output, const dlua_tensor_t *x, const dlua_tensor_t *output, const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *save_mean, const dlua_tensor_t *save_invstd, int train, int relu, int accumulate);
/* SyncBatchNorm (torch.nn.SyncBatchNorm): the two functions above cut at their per-channel
   reductions, so that the ranks sum those between the halves. The reductions travel as one
   contiguous float64 vector of 2C+1 values (`out` convention: allocated, or given and overwritten):
   forward [sum x (C), sum x^2 (C), M], backward [sum d (C), sum d (x - mean) (C), M], where M counts
   the values per channel (N * H * W) and d is grad_output masked by the ReLU. Summed over ranks,
   they give the statistics of the whole batch.
   Forward in training: stats = batch_norm_stats(x) on each rank, summed over ranks, then
   batch_norm_apply: mean = sum x / M, biased var = sum x^2 / M - mean^2 (sums in double), the
   running update as above with the summed M, then out, save_mean, save_invstd as forward's. */
dlua_status_t dlua_nn_batch_norm_stats(dlua_tensor_t **stats, const dlua_tensor_t *x);
dlua_status_t dlua_nn_batch_norm_apply(dlua_tensor_t **out, dlua_tensor_t **save_mean, dlua_tensor_t **save_invstd, const dlua_tensor_t *x, const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *skip, const dlua_tensor_t *stats, dlua_tensor_t *running_mean, dlua_tensor_t *running_var, double momentum, double eps, int relu);
/* Backward: batch_norm_backward_reduce gives this rank's sums and its local grad_gamma
   (sum d xhat) and grad_beta (sum d), accumulated or overwritten as backward does (DDP's average
   of the local sums is the whole batch's gradient of the ranks' mean loss); then, with the sums
   summed over ranks, batch_norm_backward_apply writes grad_input (and grad_skip) as backward does
   in training, normalised by the summed M. gamma and beta (both may be NULL) are backward's. */
dlua_status_t dlua_nn_batch_norm_backward_reduce(dlua_tensor_t **sums, dlua_tensor_t *grad_gamma, dlua_tensor_t *grad_beta, const dlua_tensor_t *grad_output, const dlua_tensor_t *x, const dlua_tensor_t *output, const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *save_mean, const dlua_tensor_t *save_invstd, int relu, int accumulate);
dlua_status_t dlua_nn_batch_norm_backward_apply(dlua_tensor_t **grad_input, dlua_tensor_t **grad_skip, const dlua_tensor_t *grad_output, const dlua_tensor_t *x, const dlua_tensor_t *output, const dlua_tensor_t *gamma, const dlua_tensor_t *beta, const dlua_tensor_t *save_mean, const dlua_tensor_t *save_invstd, const dlua_tensor_t *sums, int relu);

/* Pooling output extent along one dimension, PyTorch's rule: floor (or ceil when ceil_mode)
   of (in + 2*pad - dil*(kernel-1) - 1) / stride, plus 1, less 1 when ceil_mode makes the last
   window start inside the right padding; -1 for a bad argument. */
int64_t dlua_pool2d_output_size(int64_t in, int64_t kernel, int stride, int pad, int dil, int ceil_mode);
/* torch.nn.functional.max_pool2d: x (N, C, H, W) -> out (N, C, OH, OW); padding is at most half
   the kernel and acts as -Inf; NaN wins. indices (N, C, OH, OW) follows the `out` convention
   (allocated int64; given int32 or int64), or may be a NULL pointer in inference: 0-based
   positions h * W + w of each maximum within its (H, W) plane, whatever the memory format. */
dlua_status_t dlua_nn_max_pool2d_forward(dlua_tensor_t **out, dlua_tensor_t **indices, const dlua_tensor_t *x, int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dil_h, int dil_w, int ceil_mode);
/* grad_input (x_sizes: N, C, H, W) = grad_output (N, C, OH, OW) summed into the positions in
   indices (the forward's); written, not accumulated; allocated in grad_output's format. */
dlua_status_t dlua_nn_max_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const dlua_tensor_t *indices, const int64_t *x_sizes);
/* torch.nn.functional.avg_pool2d (no dilation): a window clipped to the padded input is
   divided by its size counting padding (count_include_pad) or by its in-bounds elements;
   divisor_override > 0 replaces either. */
dlua_status_t dlua_nn_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int ceil_mode, int count_include_pad, int divisor_override);
dlua_status_t dlua_nn_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const int64_t *x_sizes, int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int ceil_mode, int count_include_pad, int divisor_override);
/* torch.nn.functional.adaptive_avg_pool2d: output cell i averages input rows
   floor(i * H / OH) .. ceil((i + 1) * H / OH) - 1, and likewise for columns. */
dlua_status_t dlua_nn_adaptive_avg_pool2d_forward(dlua_tensor_t **out, const dlua_tensor_t *x, int64_t out_h, int64_t out_w);
dlua_status_t dlua_nn_adaptive_avg_pool2d_backward(dlua_tensor_t **grad_input, const dlua_tensor_t *grad_output, const int64_t *x_sizes);

/* ==== CUDA devices and memory ================================================================ */

/* Every function exists in every build. Without CUDA, or when cudaGetDeviceCount fails (no
   driver, no GPU: error 35 on our build machines), there are zero devices and the fallible ones
   return DLUA_ERR_ARG with "no CUDA device available (<reason>)". Device -1 means the current one. */
int dlua_cuda_device_count(void);
/* Why there is no device ("built without CUDA", the driver's message...), or "" when there is one. */
const char *dlua_cuda_unavailable_reason(void);
dlua_status_t dlua_cuda_set_device(int device);
dlua_status_t dlua_cuda_get_device(int *device);
/* Waits for all work on the device. */
dlua_status_t dlua_cuda_synchronize(int device);
/* Run-time versions for `dlua -v`: driver, runtime, each device's name and memory, the cuDNN/cuBLAS/NCCL
   actually loaded; or "no CUDA device available (<reason>)". */
const char *dlua_cuda_runtime_info(void);
/* The device's compute capability (9.0 on an H100/H200; bfloat16 arithmetic needs 8.0). */
dlua_status_t dlua_cuda_get_device_capability(int device, int *major, int *minor);

/* Streams and events: opaque handles, released with their destroy function. A NULL stream is the
   device's default stream. */
typedef struct dlua_cuda_stream dlua_cuda_stream_t;
typedef struct dlua_cuda_event dlua_cuda_event_t;
dlua_status_t dlua_cuda_stream_create(dlua_cuda_stream_t **out, int device);
void dlua_cuda_stream_destroy(dlua_cuda_stream_t *s);
int dlua_cuda_stream_device(const dlua_cuda_stream_t *s);
dlua_status_t dlua_cuda_stream_synchronize(dlua_cuda_stream_t *s);
dlua_status_t dlua_cuda_stream_query(dlua_cuda_stream_t *s, int *done); /* 1 when all its work is done */
/* Work queued on s after this call waits for e's work (no host wait). */
dlua_status_t dlua_cuda_stream_wait_event(dlua_cuda_stream_t *s, dlua_cuda_event_t *e);
/* The stream ops on `device` queue on (the current stream); NULL restores the default stream. */
dlua_status_t dlua_cuda_set_current_stream(int device, dlua_cuda_stream_t *s);
dlua_cuda_stream_t *dlua_cuda_current_stream(int device);
dlua_status_t dlua_cuda_event_create(dlua_cuda_event_t **out, int device, int enable_timing);
void dlua_cuda_event_destroy(dlua_cuda_event_t *e);
dlua_status_t dlua_cuda_event_record(dlua_cuda_event_t *e, dlua_cuda_stream_t *s); /* s NULL: the current stream */
dlua_status_t dlua_cuda_event_query(dlua_cuda_event_t *e, int *done);
dlua_status_t dlua_cuda_event_synchronize(dlua_cuda_event_t *e);
/* Milliseconds between two recorded events created with enable_timing. */
dlua_status_t dlua_cuda_event_elapsed(const dlua_cuda_event_t *start, const dlua_cuda_event_t *end, double *ms);

/* The caching allocator's statistics for one device (bytes unless said otherwise). */
typedef struct {
  int64_t allocated;        /* in blocks handed out (sizes rounded up to 512 bytes) */
  int64_t requested;        /* what those allocations asked for */
  int64_t reserved;         /* in segments obtained from the device (cudaMalloc) */
  int64_t peak_allocated;
  int64_t peak_reserved;
  int64_t num_allocs;       /* calls to allocate and free */
  int64_t num_frees;
  int64_t num_raw_allocs;   /* cudaMalloc / cudaFree calls */
  int64_t num_raw_frees;
  int64_t num_ooms;         /* requests that failed even after emptying the cache */
  int64_t blocks;           /* live blocks now */
  int64_t cached_blocks;    /* free blocks kept for reuse */
  int64_t pending_blocks;   /* freed, waiting for other streams' events */
  int64_t segments;
  int64_t largest_free;     /* the largest cached free block */
} dlua_memory_stats_t;
/* device >= 0: that GPU's allocator; DLUA_CPU: the pinned host allocator. */
dlua_status_t dlua_cuda_memory_stats(int device, dlua_memory_stats_t *out);
dlua_status_t dlua_cuda_reset_peak_memory_stats(int device);
/* Returns unused cached segments to the driver (also reached through dlua_memory_empty_cache). */
dlua_status_t dlua_cuda_empty_cache(int device);
/* Device memory from the caching allocator, for use on `stream` (NULL: the current stream). */
dlua_status_t dlua_cuda_malloc(void **ptr, int device, size_t bytes, dlua_cuda_stream_t *stream);
dlua_status_t dlua_cuda_free(int device, void *ptr);
/* Notes that work on `stream` uses the allocation at ptr, so it is not reused before that work ends. */
dlua_status_t dlua_cuda_record_stream(int device, void *ptr, dlua_cuda_stream_t *stream);
/* Page-locked host memory (cudaHostAlloc) through its own caching allocator, for fast and
   asynchronous host<->device copies. */
dlua_status_t dlua_cuda_host_alloc(void **ptr, size_t bytes);
dlua_status_t dlua_cuda_host_free(void *ptr);
/* A contiguous copy of t on `device` (DLUA_CPU or a CUDA ordinal): t:cuda(), t:cpu(), t:to('cuda:1'). */
dlua_status_t dlua_tensor_to_device(dlua_tensor_t **out, const dlua_tensor_t *t, int device);
/* As dlua_tensor_to_device, but a copy from a contiguous CPU tensor to a GPU is only queued on the
   current stream (PyTorch's non_blocking=True): t's memory must stay as it is until that stream has
   run the copy (record an event and wait for it), and is best pinned. Other moves wait as usual. */
dlua_status_t dlua_tensor_to_device_async(dlua_tensor_t **out, const dlua_tensor_t *t, int device);
/* A copy of CPU tensor t in page-locked memory (t:pin_memory()). */
dlua_status_t dlua_tensor_pin_memory(dlua_tensor_t **out, const dlua_tensor_t *t);
/* Copies bytes between host and device memory: kind 0 host->device, 1 device->host, 2 device->device.
   async 0 waits for the copy; 1 queues it on `stream` (NULL: current), for pinned host memory. */
dlua_status_t dlua_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, int async, dlua_cuda_stream_t *stream);
/* Whether f32 matmuls on CUDA may round their inputs to TF32 (faster, ~1e-3 relative error). Off by
   default, as PyTorch's torch.backends.cuda.matmul.allow_tf32 since 1.12. */
void dlua_cuda_set_allow_tf32(int allow);
int dlua_cuda_get_allow_tf32(void);

/* ==== checkpoints ============================================================================ */

/* safetensors files (docs/ckpt.md): 8 bytes little-endian header length N, N bytes of JSON
   {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {string:
   string}}, then every tensor's bytes, contiguous row-major little-endian, back to back (the
   format forbids gaps). dlua orders tensors by decreasing element size, then name, so each is
   aligned to its element size; the header is padded with spaces so the data starts at a multiple
   of 64 bytes; metadata "dlua.crc32" holds a JSON object name -> 8 hex digits, the zlib CRC32 of
   each tensor's bytes, checked on load. Errors name the file and the tensor. Without cJSON at
   build time every function here fails with "checkpoints are off ..." (dlua_ckpt_available 0). */
int dlua_ckpt_available(void);

/* Writing: the file is written under a temporary name beside `path`; commit fills in the
   checksums, fsyncs, renames it to path and fsyncs the directory, so path is either the old
   file or the complete new one, whatever happens. names/dtypes/ndims (n entries) and sizes (the
   entries' shapes back to back) are declared at open; put writes tensor i (any order, any layout
   or device: its logical row-major bytes); metadata keys/values are strings. */
typedef struct dlua_st_writer dlua_st_writer_t;
dlua_status_t dlua_st_writer_open(dlua_st_writer_t **out, const char *path, int64_t n, const char *const *names, const int *dtypes, const int *ndims, const int64_t *sizes, int64_t nmeta, const char *const *keys, const char *const *values);
dlua_status_t dlua_st_writer_put(dlua_st_writer_t *w, int64_t i, const dlua_tensor_t *t);
/* Writes tensor i from host bytes (exactly its size), as put does from a tensor. */
dlua_status_t dlua_st_writer_put_bytes(dlua_st_writer_t *w, int64_t i, const void *data, size_t bytes);
dlua_status_t dlua_st_writer_commit(dlua_st_writer_t *w);
/* Frees the writer; without a commit the temporary file is removed and path is untouched. */
void dlua_st_writer_free(dlua_st_writer_t *w);
/* The whole of open, put every tensor, commit. */
dlua_status_t dlua_st_save(const char *path, int64_t n, const char *const *names, dlua_tensor_t *const *tensors, int64_t nmeta, const char *const *keys, const char *const *values);

/* Reading: open maps the file and checks the whole header (JSON, dtypes, shapes, offsets within
   the file and covering it, checksums present); the tensors are copied out of the mapping, never
   views of it, so close may unmap at once. Entries are numbered 0..count-1 in file order. */
typedef struct dlua_st_file dlua_st_file_t;
dlua_status_t dlua_st_open(dlua_st_file_t **out, const char *path);
void dlua_st_close(dlua_st_file_t *f);
const char *dlua_st_path(const dlua_st_file_t *f);
int64_t dlua_st_count(const dlua_st_file_t *f);
int64_t dlua_st_find(const dlua_st_file_t *f, const char *name); /* -1 when absent */
const char *dlua_st_name(const dlua_st_file_t *f, int64_t i);
int dlua_st_dtype(const dlua_st_file_t *f, int64_t i);
int dlua_st_ndim(const dlua_st_file_t *f, int64_t i);
const int64_t *dlua_st_sizes(const dlua_st_file_t *f, int64_t i);
int dlua_st_has_crc(const dlua_st_file_t *f, int64_t i); /* files from other writers have none */
int64_t dlua_st_file_bytes(const dlua_st_file_t *f);
int64_t dlua_st_metadata_count(const dlua_st_file_t *f);
const char *dlua_st_metadata_key(const dlua_st_file_t *f, int64_t i);
const char *dlua_st_metadata_value(const dlua_st_file_t *f, int64_t i);
/* Checks tensor i's checksum (once; later calls return the first answer). */
dlua_status_t dlua_st_verify(dlua_st_file_t *f, int64_t i);
/* A new contiguous CPU tensor holding tensor i, checksum checked while copying. */
dlua_status_t dlua_st_read(dlua_st_file_t *f, int64_t i, dlua_tensor_t **out);
/* Copies tensor i into dst (any layout or device), whose dtype and shape must be the file's; the
   checksum is checked before dst is touched. */
dlua_status_t dlua_st_read_into(dlua_st_file_t *f, int64_t i, dlua_tensor_t *dst);

/* A checkpoint job: steps run in order on the caller's thread (run) or on a background one
   (start), the next save waiting for the previous one (wait). add_file's snapshot[i] (NULL: all 0)
   says how tensor i is taken: 0 a reference, written from the live tensor (for run); 1 copied now
   into host memory (pinned for CUDA tensors), so training may change it at once; 2 (CPU tensors)
   copied into host memory by the background thread before it writes anything: the caller promises
   not to change it until dlua_ckpt_job_wait_snapshot returns (the optimizer's next step waits, while
   forward and backward run). Snapshot memory is freed as each tensor is written. After a failed
   step the rest are skipped, except signals, which then carry the error. */
typedef struct dlua_ckpt_job dlua_ckpt_job_t;
dlua_status_t dlua_ckpt_job_new(dlua_ckpt_job_t **out);
dlua_status_t dlua_ckpt_job_add_file(dlua_ckpt_job_t *job, const char *path, int64_t n, const char *const *names, dlua_tensor_t *const *tensors, int64_t nmeta, const char *const *keys, const char *const *values, const int *snapshot);
/* A small file (index, pointer) written atomically as the safetensors files are. */
dlua_status_t dlua_ckpt_job_add_text(dlua_ckpt_job_t *job, const char *path, const char *data, size_t len);
/* Sets `key` in the store to "ok", or to the error of an earlier step. */
dlua_status_t dlua_ckpt_job_add_signal(dlua_ckpt_job_t *job, dlua_store_t *store, const char *key);
/* Waits for the n keys (timeout_ms < 0: the store's default), deletes them, and fails naming the
   first whose value is not "ok". */
dlua_status_t dlua_ckpt_job_add_wait(dlua_ckpt_job_t *job, dlua_store_t *store, int n, const char *const *keys, int64_t timeout_ms);
/* Removes a checkpoint directory (its plain files, then itself). */
dlua_status_t dlua_ckpt_job_add_remove(dlua_ckpt_job_t *job, const char *dir);
dlua_status_t dlua_ckpt_job_run(dlua_ckpt_job_t *job);
dlua_status_t dlua_ckpt_job_start(dlua_ckpt_job_t *job);
int dlua_ckpt_job_done(const dlua_ckpt_job_t *job); /* 1 once every step has run (or the job never started) */
/* Returns once every snapshot = 2 tensor has been copied (at once when there are none, or the job
   is done or never started). */
void dlua_ckpt_job_wait_snapshot(dlua_ckpt_job_t *job);
/* Joins the thread; the job's status, its message in dlua_last_error(). */
dlua_status_t dlua_ckpt_job_wait(dlua_ckpt_job_t *job);
/* Host bytes the job's snapshot holds now, and at most (both 0 without snapshots). */
int64_t dlua_ckpt_job_snapshot_bytes(const dlua_ckpt_job_t *job);
int64_t dlua_ckpt_job_snapshot_peak(const dlua_ckpt_job_t *job);
double dlua_ckpt_job_seconds(const dlua_ckpt_job_t *job); /* the steps' wall time */
/* Waits for the job if it runs, then frees it. NULL is ignored. */
void dlua_ckpt_job_free(dlua_ckpt_job_t *job);

/* Files for checkpoint directories. */
dlua_status_t dlua_io_mkdirs(const char *path);
/* Names in a directory (not . and ..), each followed by a NUL, freed with dlua_io_free; *len counts
   the bytes. A missing directory gives no names. */
dlua_status_t dlua_io_list_dir(const char *path, char **names, size_t *len);
void dlua_io_free(void *p);
/* Atomic small file: temporary name, write, fsync, rename, fsync of the directory. */
dlua_status_t dlua_io_write_file(const char *path, const char *data, size_t len);
/* Removes a checkpoint directory: its index.json first (so it stops being complete at once), its other plain files, then itself. */
dlua_status_t dlua_io_remove_dir(const char *dir);
/* zlib's CRC32 of n bytes, continuing from crc (0 to start). */
uint32_t dlua_crc32(uint32_t crc, const void *data, size_t n);
/* The CRC32 of tensors' logical row-major bytes in turn (any layout, any device). */
dlua_status_t dlua_tensors_crc32(int64_t n, dlua_tensor_t *const *tensors, uint32_t *crc);

/* ==== a running job: the flight recorder, the launcher's control page (docs/launch.md) ======== */

/* The flight recorder keeps this process's last DLUA_FLIGHT_SIZE collectives (default 1024, 0: off)
   of every group; SIGUSR1, a collective's timeout or `dlua attach --dump` writes them. */
int dlua_flight_capacity(void);
/* The DDP/ZeRO bucket (1-based; 0: none) that the calling thread's next collectives belong to. */
void dlua_flight_set_bucket(int bucket);
/* Writes this process's dump now: dir/flight-rank<RANK>.json (dir NULL: DLUA_FLIGHT_DIR, else the
   current directory), with `traceback` (newline-separated frames) as where it is. */
dlua_status_t dlua_flight_dump(const char *dir, const char *reason, const char *traceback);

/* A rank of `dlua --nproc` shares a page with its launcher, through which `dlua attach` reaches it. */
int dlua_control_available(void);
/* This rank finished `step` (a step boundary). 1 when a command is to run here now: read it with
   dlua_control_command, answer with dlua_control_done. A command for every rank runs at the same
   step on each. */
int dlua_control_boundary(int64_t step);
const char *dlua_control_command(int *every_rank, int64_t *at_step);
void dlua_control_done(int ok, const char *text);

/* ==== JSON ===================================================================================== */

/* JSON through cJSON (Debian libcjson-dev) for metrics lines and the files `dlua plot` reads: Lua
   builds a tree node by node and prints it on one line, or parses text and walks the tree. Numbers
   are doubles, printed with the fewest digits (15-17) that read back exactly; NaN and infinities
   print as null. Without cJSON at build time dlua_json_available()
   is 0 and dlua_json_new/dlua_json_parse fail saying so. */
typedef struct dlua_json dlua_json_t;
typedef enum {
  DLUA_JSON_NULL = 0, DLUA_JSON_FALSE = 1, DLUA_JSON_TRUE = 2, DLUA_JSON_NUMBER = 3,
  DLUA_JSON_STRING = 4, DLUA_JSON_ARRAY = 5, DLUA_JSON_OBJECT = 6
} dlua_json_kind_t;
int dlua_json_available(void);
/* A new node of `kind`: number (NUMBER) or text (STRING, len bytes, no NUL inside) give its value. */
dlua_status_t dlua_json_new(dlua_json_t **out, int kind, double number, const char *text, size_t len);
/* Adds child to an object under key (len bytes), or to an array (key NULL). The parent owns the
   child from here, also when this fails (it is then freed). */
dlua_status_t dlua_json_add(dlua_json_t *parent, const char *key, size_t len, dlua_json_t *child);
/* The tree as one line of JSON without spaces; free *out with dlua_json_free_text. */
dlua_status_t dlua_json_print(const dlua_json_t *node, char **out);
void dlua_json_free_text(char *text);
/* A root node and everything under it; NULL is ignored. */
void dlua_json_free(dlua_json_t *node);
/* Parses len bytes (one value, whitespace around it allowed); errors give the byte position. */
dlua_status_t dlua_json_parse(const char *text, size_t len, dlua_json_t **out);
int dlua_json_kind(const dlua_json_t *node);
double dlua_json_number(const dlua_json_t *node);
const char *dlua_json_string(const dlua_json_t *node);
/* An object member's key; NULL for array elements. */
const char *dlua_json_key(const dlua_json_t *node);
/* The first child of an array or object (NULL when empty), then the next one (NULL after the last). */
const dlua_json_t *dlua_json_first(const dlua_json_t *node);
const dlua_json_t *dlua_json_next(const dlua_json_t *node);

/* CUDA element-wise launches: the ew family of the CUDA backend table (kernels/ew.h: run, copy, download), and the kernels of the small families (ternary,
   where, masked fill, fill, dtype-converting copy). Unary and binary live in their own files. */
#include "cuda/ew_common.cuh"

namespace dlua_cu {

unsigned grid_for(int64_t work) {
  enum { MAXDEV = 64 };
  static int sms[MAXDEV];  // racy first fill writes the same value: benign
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= MAXDEV) dev = 0;
  if (!sms[dev]) sms[dev] = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0 ? v : 132;
  int64_t blocks = (work + kThreads - 1) / kThreads;
  const int64_t cap = (int64_t)sms[dev] * 8;
  if (blocks > cap) blocks = cap;
  return (unsigned)(blocks < 1 ? 1 : blocks);
}

dlua_status_t launched(const char *op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: CUDA kernel launch failed: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
  return DLUA_OK;
}

namespace {

/* ---- ternary: x = f(x, a, b, v) -------------------------------------------------------------------- */

struct T_ADDCMUL {
  __device__ __forceinline__ float operator()(float x, float a, float b, float v) const { return dlua_ew_addcmul_f(x, a, b, v); }
  __device__ __forceinline__ double operator()(double x, double a, double b, double v) const { return dlua_ew_addcmul_d(x, a, b, v); }
  __device__ __forceinline__ int64_t operator()(int64_t x, int64_t a, int64_t b, int64_t v) const { return dlua_ew_addcmul_i(x, a, b, v); }
};
struct T_ADDCDIV {
  __device__ __forceinline__ float operator()(float x, float a, float b, float v) const { return dlua_ew_addcdiv_f(x, a, b, v); }
  __device__ __forceinline__ double operator()(double x, double a, double b, double v) const { return dlua_ew_addcdiv_d(x, a, b, v); }
};
#define TENUM(ENUM, name, kind) TOP_##ENUM,
enum { DLUA_EW_TERNARY_OPS(TENUM) TOP_COUNT };

template <typename F, int DT> __global__ void k_ternary(Ix ix, int64_t n, typename Tr<DT>::C v, int contig) {
  typedef typename Tr<DT>::S S;
  F f;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    S *x;
    const S *a, *b;
    if (contig) {
      x = (S *)ix.base[0] + i;
      a = (const S *)ix.base[1] + i;
      b = (const S *)ix.base[2] + i;
    } else {
      char *p[3];
      locate<3>(ix, i, p);
      x = (S *)p[0];
      a = (const S *)p[1];
      b = (const S *)p[2];
    }
    *x = Tr<DT>::st(f(Tr<DT>::ld(*x), Tr<DT>::ld(*a), Tr<DT>::ld(*b), v));
  }
}

template <typename F, int DT> dlua_status_t launch_ternary(const char *op, const Ew &e, cudaStream_t s) {
  typedef typename Tr<DT>::S S;
  const int es[3] = {(int)sizeof(S), (int)sizeof(S), (int)sizeof(S)};
  k_ternary<F, DT><<<grid_for(e.numel), kThreads, 0, s>>>(make_ix(e), e.numel, param<typename Tr<DT>::C>(e, 0),
                                                          contiguous(e, 3, es) ? 1 : 0);
  return launched(op);
}

template <typename F> struct LaunchTernary {
  template <int DT> static dlua_status_t run(const char *op, const Ew &e, cudaStream_t s) { return launch_ternary<F, DT>(op, e, s); }
};


/* ---- bit movers: where, masked fill, fill --------------------------------------------------------- */

template <typename U> __global__ void k_where(Ix ix, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    char *p[4];
    locate<4>(ix, i, p);
    *(U *)p[0] = *(const uint8_t *)p[1] ? *(const U *)p[2] : *(const U *)p[3];
  }
}

template <typename U> __global__ void k_mfill(Ix ix, int64_t n, U v) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    char *p[2];
    locate<2>(ix, i, p);
    if (*(const uint8_t *)p[1]) *(U *)p[0] = v;
  }
}

template <typename U> __global__ void k_fill(Ix ix, int64_t n, U v, int contig) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (contig) {
      ((U *)ix.base[0])[i] = v;
    } else {
      char *p[1];
      locate<1>(ix, i, p);
      *(U *)p[0] = v;
    }
  }
}

template <typename U> dlua_status_t launch_bits(const char *op, const Ew &e, cudaStream_t s) {
  const Ix ix = make_ix(e);
  const unsigned g = grid_for(e.numel);
  const int es[1] = {(int)sizeof(U)};
  if (e.family == DLUA_EW_WHERE) k_where<U><<<g, kThreads, 0, s>>>(ix, e.numel);
  else if (e.family == DLUA_EW_MFILL) k_mfill<U><<<g, kThreads, 0, s>>>(ix, e.numel, (U)e.i[0]);
  else k_fill<U><<<g, kThreads, 0, s>>>(ix, e.numel, (U)e.i[0], contiguous(e, 1, es) ? 1 : 0);
  return launched(op);
}

/* ---- copy with dtype conversion: host/core/copy.c's rules ------------------------------------------ */

// Float -> int truncates toward zero; out of range saturates to int64, NaN gives 0; narrower ints wrap.
__device__ __forceinline__ int64_t to_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}
__device__ __forceinline__ int64_t to_i64(float v) { return to_i64((double)v); }
__device__ __forceinline__ int64_t to_i64(int64_t v) { return v; }

template <int DT> struct Cv;
template <> struct Cv<DLUA_DTYPE_F32> {
  typedef float S;
  static __device__ __forceinline__ float ld(S x) { return x; }
  template <typename V> static __device__ __forceinline__ S st(V v) { return (float)v; }
};
template <> struct Cv<DLUA_DTYPE_F64> {
  typedef double S;
  static __device__ __forceinline__ double ld(S x) { return x; }
  template <typename V> static __device__ __forceinline__ S st(V v) { return (double)v; }
};
template <> struct Cv<DLUA_DTYPE_F16> {
  typedef uint16_t S;
  static __device__ __forceinline__ float ld(S x) { return dlua_f16_to_f32_inl(x); }
  template <typename V> static __device__ __forceinline__ S st(V v) { return dlua_f32_to_f16_inl((float)v); }
};
template <> struct Cv<DLUA_DTYPE_BF16> {
  typedef uint16_t S;
  static __device__ __forceinline__ float ld(S x) { return dlua_bf16_to_f32_inl(x); }
  template <typename V> static __device__ __forceinline__ S st(V v) { return dlua_f32_to_bf16_inl((float)v); }
};
template <> struct Cv<DLUA_DTYPE_I32> {
  typedef int32_t S;
  static __device__ __forceinline__ int64_t ld(S x) { return (int64_t)x; }
  template <typename V> static __device__ __forceinline__ S st(V v) { return (int32_t)(uint32_t)(uint64_t)to_i64(v); }
};
template <> struct Cv<DLUA_DTYPE_I64> {
  typedef int64_t S;
  static __device__ __forceinline__ int64_t ld(S x) { return x; }
  template <typename V> static __device__ __forceinline__ S st(V v) { return to_i64(v); }
};
template <> struct Cv<DLUA_DTYPE_U8> {
  typedef uint8_t S;
  static __device__ __forceinline__ int64_t ld(S x) { return (int64_t)x; }
  template <typename V> static __device__ __forceinline__ S st(V v) { return (uint8_t)(uint64_t)to_i64(v); }
};
template <> struct Cv<DLUA_DTYPE_BOOL> {
  typedef uint8_t S;
  static __device__ __forceinline__ int64_t ld(S x) { return (int64_t)(x != 0); }
  template <typename V> static __device__ __forceinline__ S st(V v) { return (uint8_t)(v != 0); }
};

template <int SD, int DD> __global__ void k_copy(Ix ix, int64_t n, int contig) {
  typedef typename Cv<SD>::S SS;
  typedef typename Cv<DD>::S DS;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    DS *d;
    const SS *src;
    if (contig) {
      d = (DS *)ix.base[0] + i;
      src = (const SS *)ix.base[1] + i;
    } else {
      char *p[2];
      locate<2>(ix, i, p);
      d = (DS *)p[0];
      src = (const SS *)p[1];
    }
    // Same dtype moves bits (f16 -> f32 -> f16 would quiet signalling NaNs); bool normalises to 0/1.
    if constexpr (SD == DD && SD != DLUA_DTYPE_BOOL) *d = *src;
    else *d = Cv<DD>::st(Cv<SD>::ld(*src));
  }
}

template <int SD, int DD> dlua_status_t launch_copy(const char *op, const Ew &e, cudaStream_t s) {
  const int es[2] = {(int)sizeof(typename Cv<DD>::S), (int)sizeof(typename Cv<SD>::S)};
  k_copy<SD, DD><<<grid_for(e.numel), kThreads, 0, s>>>(make_ix(e), e.numel, contiguous(e, 2, es) ? 1 : 0);
  return launched(op);
}

template <int SD> dlua_status_t copy_to(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.dtype) {
    case DLUA_DTYPE_F32: return launch_copy<SD, DLUA_DTYPE_F32>(op, e, s);
    case DLUA_DTYPE_F64: return launch_copy<SD, DLUA_DTYPE_F64>(op, e, s);
    case DLUA_DTYPE_F16: return launch_copy<SD, DLUA_DTYPE_F16>(op, e, s);
    case DLUA_DTYPE_BF16: return launch_copy<SD, DLUA_DTYPE_BF16>(op, e, s);
    case DLUA_DTYPE_I32: return launch_copy<SD, DLUA_DTYPE_I32>(op, e, s);
    case DLUA_DTYPE_I64: return launch_copy<SD, DLUA_DTYPE_I64>(op, e, s);
    case DLUA_DTYPE_U8: return launch_copy<SD, DLUA_DTYPE_U8>(op, e, s);
    case DLUA_DTYPE_BOOL: return launch_copy<SD, DLUA_DTYPE_BOOL>(op, e, s);
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: invalid destination dtype %d", op, e.dtype);
  }
}

dlua_status_t run_copy(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.src_dtype) {
    case DLUA_DTYPE_F32: return copy_to<DLUA_DTYPE_F32>(op, e, s);
    case DLUA_DTYPE_F64: return copy_to<DLUA_DTYPE_F64>(op, e, s);
    case DLUA_DTYPE_F16: return copy_to<DLUA_DTYPE_F16>(op, e, s);
    case DLUA_DTYPE_BF16: return copy_to<DLUA_DTYPE_BF16>(op, e, s);
    case DLUA_DTYPE_I32: return copy_to<DLUA_DTYPE_I32>(op, e, s);
    case DLUA_DTYPE_I64: return copy_to<DLUA_DTYPE_I64>(op, e, s);
    case DLUA_DTYPE_U8: return copy_to<DLUA_DTYPE_U8>(op, e, s);
    case DLUA_DTYPE_BOOL: return copy_to<DLUA_DTYPE_BOOL>(op, e, s);
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: invalid source dtype %d", op, e.src_dtype);
  }
}

dlua_status_t dispatch(const char *op, const Ew &e, cudaStream_t s) {
  switch (e.family) {
    case DLUA_EW_UNARY: return run_unary(op, e, s);
    case DLUA_EW_BINARY: return run_binary(op, e, s);
    case DLUA_EW_TERNARY:
      if (e.op == TOP_ADDCMUL) return dispatch_dtype<LaunchTernary<T_ADDCMUL>, false>(op, e, s);
      if (e.op == TOP_ADDCDIV) return dispatch_dtype<LaunchTernary<T_ADDCDIV>, true>(op, e, s);
      return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: unknown CUDA ternary op %d", op, e.op);
    case DLUA_EW_WHERE:
    case DLUA_EW_MFILL:
    case DLUA_EW_FILL:
      switch (e.elsize) {
        case 1: return launch_bits<uint8_t>(op, e, s);
        case 2: return launch_bits<uint16_t>(op, e, s);
        case 4: return launch_bits<uint32_t>(op, e, s);
        case 8: return launch_bits<uint64_t>(op, e, s);
        default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: element size %d", op, e.elsize);
      }
    case DLUA_EW_COPY: return run_copy(op, e, s);
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: unknown CUDA element-wise family %d", op, e.family);
  }
}

}  // namespace
}  // namespace dlua_cu

/* Queues the launch on the current stream of e->device. `op` names the user's op in errors. */
static dlua_status_t cuda_ew_run(const char *op, const dlua_ew_desc_t *e) {
  if (!e || e->nops < 1 || e->nops > DLUA_EW_MAX_OPS || e->ndim < 1 || e->ndim > DLUA_MAX_DIMS || e->numel < 0)
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: malformed CUDA element-wise launch", op);
  if (e->numel == 0) return DLUA_OK;
  int prev = 0;
  cudaError_t err = cudaGetDevice(&prev);
  if (err == cudaSuccess && prev != e->device) err = cudaSetDevice(e->device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s (CUDA error %d)", op, e->device,
                    cudaGetErrorString(err), (int)err);
  }
  dlua_status_t st = dlua_cu::dispatch(op, *e, (cudaStream_t)dlua_cuda_raw_stream(e->device));
  if (prev != e->device) cudaSetDevice(prev);
  return st;
}

/* Contiguous device memory to the host on the device's current stream (after the kernels that wrote it), then
   a wait. */
static dlua_status_t cuda_download(const char *op, void *dst, const void *src, size_t bytes, int device) {
  dlua_cuda_stream_t *st = dlua_cuda_current_stream(device);
  if (!st) return DLUA_ERR(DLUA_ERR_BACKEND, "%s: no stream for cuda:%d", op, device);
  DLUA_TRY(dlua_cuda_memcpy(dst, src, bytes, 1, 1, st));
  return dlua_cuda_stream_synchronize(st);
}

/* One entry for the maps and for copy/fill: the family in the descriptor picks the kernel. */
extern "C" const struct dlua_ew_ops dlua_cuda_ew_ops = {
    cuda_ew_run,   /* run */
    cuda_ew_run,   /* copy */
    cuda_download, /* download */
};

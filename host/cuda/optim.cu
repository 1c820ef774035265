/* Fused optimizer steps (SGD, AdamW) and AMP unscaling on CUDA: grid-stride kernels over flat arena ranges, whose
   per-element code is the CPU's (host/cpu/optim_ops.h). */
#include "cuda/ew_common.cuh"
#include "cpu/optim_ops.h"

namespace dlua_cu {
namespace {

template <typename T> struct Step;
template <> struct Step<float> {
  static __device__ __forceinline__ void sgd(float *p, float g, float *b, float gs, float wd, float mom, float d1,
                                             float lr, int nes, int mx, int first) {
    dlua_opt_sgd_f(p, g, b, gs, wd, mom, d1, lr, nes, mx, first);
  }
  static __device__ __forceinline__ void adamw(float *p, float g, float *m, float *v, float *vm, float gs, float dec,
                                               float b1, float o1, float b2, float o2, float ns, float bc2s, float eps,
                                               int mx, int ams) {
    dlua_opt_adamw_f(p, g, m, v, vm, gs, dec, b1, o1, b2, o2, ns, bc2s, eps, mx, ams);
  }
};
template <> struct Step<double> {
  static __device__ __forceinline__ void sgd(double *p, double g, double *b, double gs, double wd, double mom,
                                             double d1, double lr, int nes, int mx, int first) {
    dlua_opt_sgd_d(p, g, b, gs, wd, mom, d1, lr, nes, mx, first);
  }
  static __device__ __forceinline__ void adamw(double *p, double g, double *m, double *v, double *vm, double gs,
                                               double dec, double b1, double o1, double b2, double o2, double ns,
                                               double bc2s, double eps, int mx, int ams) {
    dlua_opt_adamw_d(p, g, m, v, vm, gs, dec, b1, o1, b2, o2, ns, bc2s, eps, mx, ams);
  }
};

/* Scalars rounded to T on the host exactly as host/cpu/optim.c's loops round them. */
template <typename T> struct SgdK {
  T *p, *buf;
  const T *g;
  T gs, wd, mom, damp1, lr;
  int nesterov, maximize, first;
};
template <typename T> struct AdamK {
  T *p, *m, *v, *vmax;
  const T *g;
  T gs, decay, b1, omb1, b2, omb2, neg_step, bc2_sqrt, eps;
  int maximize, amsgrad;
};

template <typename T> __global__ void k_sgd(SgdK<T> k, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    Step<T>::sgd(k.p + i, k.g[i], k.buf ? k.buf + i : nullptr, k.gs, k.wd, k.mom, k.damp1, k.lr, k.nesterov,
                 k.maximize, k.first);
}

template <typename T> __global__ void k_adamw(AdamK<T> k, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    Step<T>::adamw(k.p + i, k.g[i], k.m + i, k.v + i, k.vmax ? k.vmax + i : nullptr, k.gs, k.decay, k.b1, k.omb1,
                   k.b2, k.omb2, k.neg_step, k.bc2_sqrt, k.eps, k.maximize, k.amsgrad);
}

template <typename T> dlua_status_t step(const char *op, int kind, const dlua_opt_args_t *a, int64_t n, cudaStream_t s) {
  if (kind == 0) {
    SgdK<T> k;
    k.p = (T *)a->p;
    k.buf = (T *)a->s1;
    k.g = (const T *)a->g;
    k.gs = (T)a->grad_scale;
    k.wd = (T)a->weight_decay;
    k.mom = (T)a->momentum;
    k.damp1 = (T)(1.0 - a->dampening);
    k.lr = (T)a->lr;
    k.nesterov = a->nesterov;
    k.maximize = a->maximize;
    k.first = a->first;
    k_sgd<T><<<grid_for(n), kThreads, 0, s>>>(k, n);
  } else {
    AdamK<T> k;
    k.p = (T *)a->p;
    k.m = (T *)a->s1;
    k.v = (T *)a->s2;
    k.vmax = (T *)a->s3;
    k.g = (const T *)a->g;
    k.gs = (T)a->grad_scale;
    k.decay = (T)(1.0 - a->lr * a->weight_decay);
    k.b1 = (T)a->beta1;
    k.omb1 = (T)(1.0 - a->beta1);
    k.b2 = (T)a->beta2;
    k.omb2 = (T)(1.0 - a->beta2);
    k.neg_step = (T)(-(a->lr / a->bc1));
    k.bc2_sqrt = (T)sqrt(a->bc2);
    k.eps = (T)a->eps;
    k.maximize = a->maximize;
    k.amsgrad = a->amsgrad;
    k_adamw<T><<<grid_for(n), kThreads, 0, s>>>(k, n);
  }
  return launched(op);
}

/* x *= s; counts non-finite inputs: a block sum in shared memory, one atomic add of an integer per block. */
template <int DT> __global__ void k_unscale(void *x_, int64_t n, typename Tr<DT>::C s, unsigned long long *bad) {
  typedef typename Tr<DT>::S S;
  S *x = (S *)x_;
  __shared__ unsigned int cnt[kThreads];
  unsigned int mine = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    typename Tr<DT>::C v = Tr<DT>::ld(x[i]);
    mine += !isfinite(v);
    x[i] = Tr<DT>::st(v * s);
  }
  cnt[threadIdx.x] = mine;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) cnt[threadIdx.x] += cnt[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0 && cnt[0]) atomicAdd(bad, (unsigned long long)cnt[0]);
}

template <int DT> void unscale(void *x, int64_t n, double inv, unsigned long long *bad, cudaStream_t s) {
  k_unscale<DT><<<grid_for(n), kThreads, 0, s>>>(x, n, (typename Tr<DT>::C)inv, bad);
}

struct DeviceGuard {
  int prev = 0, dev = 0;
  cudaError_t err = cudaSuccess;
  explicit DeviceGuard(int d) : dev(d) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != dev) err = cudaSetDevice(dev);
    if (err != cudaSuccess) cudaGetLastError();
  }
  ~DeviceGuard() {
    if (err == cudaSuccess && prev != dev) cudaSetDevice(prev);
  }
};

}  // namespace
}  // namespace dlua_cu

extern "C" dlua_status_t dlua_cuda_optim_step(const char *op, int kind, int dtype, const void *args, int64_t length,
                                              int device) {
  using namespace dlua_cu;
  if (length <= 0) return DLUA_OK;
  DeviceGuard g(device);
  if (g.err != cudaSuccess)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s", op, device, cudaGetErrorString(g.err));
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  const dlua_opt_args_t *a = (const dlua_opt_args_t *)args;
  if (dtype == DLUA_DTYPE_F32) return step<float>(op, kind, a, length, s);
  if (dtype == DLUA_DTYPE_F64) return step<double>(op, kind, a, length, s);
  return DLUA_ERR(DLUA_ERR_ARG, "%s: param must be float32 or float64 (dtype %d)", op, dtype);
}

extern "C" dlua_status_t dlua_cuda_unscale(const char *op, int dtype, void *x, int64_t n, double inv_scale,
                                           int64_t *nonfinite, int device) {
  using namespace dlua_cu;
  if (nonfinite) *nonfinite = 0;
  if (n <= 0) return DLUA_OK;
  DeviceGuard g(device);
  if (g.err != cudaSuccess)
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: cannot select cuda:%d: %s", op, device, cudaGetErrorString(g.err));
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  void *mem = NULL;
  DLUA_TRY(dlua_cuda_malloc(&mem, device, sizeof(unsigned long long), NULL));
  unsigned long long *bad = (unsigned long long *)mem, host = 0;
  dlua_status_t st = DLUA_OK;
  cudaError_t e = cudaMemsetAsync(bad, 0, sizeof *bad, s);
  if (e == cudaSuccess) {
    switch (dtype) {
      case DLUA_DTYPE_F32: unscale<DLUA_DTYPE_F32>(x, n, inv_scale, bad, s); break;
      case DLUA_DTYPE_F64: unscale<DLUA_DTYPE_F64>(x, n, inv_scale, bad, s); break;
      case DLUA_DTYPE_F16: unscale<DLUA_DTYPE_F16>(x, n, inv_scale, bad, s); break;
      default: unscale<DLUA_DTYPE_BF16>(x, n, inv_scale, bad, s); break;
    }
    st = launched(op);
    if (st == DLUA_OK) e = cudaMemcpyAsync(&host, bad, sizeof host, cudaMemcpyDeviceToHost, s);
    if (st == DLUA_OK && e == cudaSuccess) e = cudaStreamSynchronize(s);
  }
  if (st == DLUA_OK && e != cudaSuccess) {
    cudaGetLastError();
    st = DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
  }
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  if (st == DLUA_OK && nonfinite) *nonfinite = (int64_t)host;
  return st;
}

/* The CUDA kernels of the index family (host/kernels/index.h): index bounds checks, index_select / gather,
   deterministic scatter_add_, one_hot, cat's row copies (sort and top-k: sort.cu); and the stable radix sorts
   (CUB) that scatter_add_ and sort.cu use. */
#include <cub/device/device_radix_sort.cuh>
#include "cuda/ew_common.cuh"
#include "cuda/index_cuda.h" /* after ew_common.cuh: core/api.h is already in as C */
#include "kernels/index.h"

namespace dlua_cu {

/* ---- stable radix sorts (CUB), scratch from the caching allocator --------------------------------- */

namespace {
template <typename K>
dlua_status_t sort_pairs_t(const char *op, const K *kin, K *kout, const uint32_t *vin, uint32_t *vout, int64_t n,
                           int end_bit, int device, cudaStream_t s) {
  if (n <= 0) return DLUA_OK;
  if (end_bit < 1) end_bit = 1;
  size_t bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, vout, n, 0, end_bit, s);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return DLUA_ERR(DLUA_ERR_BACKEND, "%s: CUB radix sort setup failed: %s (CUDA error %d)", op, cudaGetErrorString(e),
                    (int)e);
  }
  void *tmp = NULL;
  DLUA_TRY(dlua_cuda_malloc(&tmp, device, bytes, NULL));
  e = cub::DeviceRadixSort::SortPairs(tmp, bytes, kin, kout, vin, vout, n, 0, end_bit, s);
  dlua_status_t st = DLUA_OK;
  if (e != cudaSuccess) {
    cudaGetLastError();
    st = DLUA_ERR(DLUA_ERR_BACKEND, "%s: CUB radix sort failed: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
  }
  if (st == DLUA_OK) st = launched(op);
  if (dlua_cuda_free(device, tmp) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  return st;
}
}  // namespace

dlua_status_t sort_pairs(const char *op, const uint64_t *kin, uint64_t *kout, const uint32_t *vin, uint32_t *vout,
                         int64_t n, int end_bit, int device, cudaStream_t s) {
  return sort_pairs_t(op, kin, kout, vin, vout, n, end_bit, device, s);
}
dlua_status_t sort_pairs(const char *op, const uint32_t *kin, uint32_t *kout, const uint32_t *vin, uint32_t *vout,
                         int64_t n, int end_bit, int device, cudaStream_t s) {
  return sort_pairs_t(op, kin, kout, vin, vout, n, end_bit, device, s);
}

namespace {

/* Element-sized bit containers: kernels that only move elements are instantiated per size, not per dtype. */
template <int ES> struct Bits;
template <> struct Bits<1> { typedef uint8_t T; };
template <> struct Bits<2> { typedef uint16_t T; };
template <> struct Bits<4> { typedef uint32_t T; };
template <> struct Bits<8> { typedef uint64_t T; };

struct Lay {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
};

Lay make_lay(const dlua_index_layout_t *l) {
  Lay y;
  memset(&y, 0, sizeof y);
  y.ndim = l->ndim;
  for (int d = 0; d < l->ndim; d++) {
    y.sizes[d] = l->sizes[d];
    y.strides[d] = l->strides[d];
  }
  return y;
}

__device__ __forceinline__ int64_t index_at(const void *p, int is64, int64_t i) {
  return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* ---- bounds check: the first bad position (atomicMin on an integer: the same answer in any order) --- */

__global__ void k_first_bad(const void *idx, int is64, int64_t n, int64_t size, int64_t base,
                            unsigned long long *first) {
  __shared__ unsigned long long sh[kThreads];
  unsigned long long mine = ~0ull;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t v = index_at(idx, is64, i);
    // Unsigned compare, as the CPU's: also catches v - base overflowing below zero.
    if ((uint64_t)(v - base) >= (uint64_t)size) {
      mine = (unsigned long long)i;
      break;  // later positions of this thread are larger
    }
  }
  sh[threadIdx.x] = mine;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w && sh[threadIdx.x + w] < sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0 && sh[0] != ~0ull) atomicMin(first, sh[0]);
}

/* res[1] = the value at position res[0] (when there is one). */
__global__ void k_fetch_bad(const void *idx, int is64, unsigned long long *res) {
  if (res[0] != ~0ull) res[1] = (unsigned long long)index_at(idx, is64, (int64_t)res[0]);
}

/* ---- index_select (MODE 0) and gather (MODE 1) --------------------------------------------------- */

template <int ES, int MODE>
__global__ void k_gather(typename Bits<ES>::T *out, const typename Bits<ES>::T *src, Lay lay, int dim,
                         const void *idx, int is64, int64_t base, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < numel; e += stride) {
    int64_t rest = e, off = 0;
    for (int d = lay.ndim - 1; d >= 0; d--) {
      const int64_t q = rest / lay.sizes[d], c = rest - q * lay.sizes[d];
      rest = q;
      off += (d == dim ? index_at(idx, is64, MODE ? e : c) - base : c) * lay.strides[d];
    }
    out[e] = src[off];
  }
}

template <int ES>
void launch_gather(int mode, void *out, const void *src, const Lay &lay, int dim, const void *idx, int is64,
                   int64_t base, int64_t numel, cudaStream_t s) {
  typedef typename Bits<ES>::T T;
  if (mode) k_gather<ES, 1><<<grid_for(numel), kThreads, 0, s>>>((T *)out, (const T *)src, lay, dim, idx, is64, base, numel);
  else k_gather<ES, 0><<<grid_for(numel), kThreads, 0, s>>>((T *)out, (const T *)src, lay, dim, idx, is64, base, numel);
}

/* ---- scatter_add_ --------------------------------------------------------------------------------
   The CPU's arithmetic per dtype: the sum of the stored value and the term, rounded back to storage after
   every add (f16/bf16 add in float); integer sums wrap. */
template <int DT> struct Add {
  typedef typename Tr<DT>::S S;
  static __device__ __forceinline__ S add(S a, S b) { return Tr<DT>::st(Tr<DT>::ld(a) + Tr<DT>::ld(b)); }
};
template <> struct Add<DLUA_DTYPE_I32> {
  static __device__ __forceinline__ int32_t add(int32_t a, int32_t b) { return (int32_t)((uint32_t)a + (uint32_t)b); }
};
template <> struct Add<DLUA_DTYPE_I64> {
  static __device__ __forceinline__ int64_t add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
};
template <> struct Add<DLUA_DTYPE_U8> {
  static __device__ __forceinline__ uint8_t add(uint8_t a, uint8_t b) { return (uint8_t)(a + b); }
};

/* The fibers of a scatter: every coordinate of the index but dim, (outer, inner) around it. */
struct Fibers {
  int fnd;                                   // dims other than dim
  int64_t fsz[DLUA_MAX_DIMS], tst[DLUA_MAX_DIMS], sst[DLUA_MAX_DIMS];
  int64_t L, inner, tsd, ssd, tdim;          // index's size at dim, inner size, strides at dim, t's size at dim
  int64_t nfib;                              // the fibers: product of fsz
};

__device__ __forceinline__ void fiber_offsets(const Fibers &fb, int64_t f, int64_t &to, int64_t &so) {
  to = so = 0;
  for (int d = fb.fnd - 1; d >= 0; d--) {
    const int64_t q = f / fb.fsz[d], c = f - q * fb.fsz[d];
    f = q;
    to += c * fb.tst[d];
    so += c * fb.sst[d];
  }
}

/* One thread per fiber, adding its terms in order of l: used when fibers are many (or rows short). */
template <int DT>
__global__ void k_scatter_fibers(typename Tr<DT>::S *t, const typename Tr<DT>::S *src, Fibers fb, const void *idx,
                                 int is64, int64_t base, int64_t nfib) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t f = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; f < nfib; f += stride) {
    int64_t to, so;
    fiber_offsets(fb, f, to, so);
    const int64_t o = f / fb.inner, i = f - o * fb.inner;
    for (int64_t l = 0; l < fb.L; l++) {
      const int64_t v = index_at(idx, is64, (o * fb.L + l) * fb.inner + i) - base;
      typename Tr<DT>::S *pt = t + to + v * fb.tsd;
      *pt = Add<DT>::add(*pt, src[so + l * fb.ssd]);
    }
  }
}

/* Keys for the sorted path: element e = (o, l, i) of the index goes to key fiber * tdim + target. */
__global__ void k_scatter_keys(const void *idx, int is64, int64_t base, Fibers fb, int64_t total, uint64_t *keys,
                               uint32_t *vals) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t i = e % fb.inner, o = e / (fb.L * fb.inner);
    keys[e] = (uint64_t)(o * fb.inner + i) * (uint64_t)fb.tdim + (uint64_t)(index_at(idx, is64, e) - base);
    vals[e] = (uint32_t)e;
  }
}

/* After a stable sort by key: the first pair of each run of equal keys adds the run's terms into its
   target, in the order of l (the sort kept it). */
template <int DT>
__global__ void k_scatter_runs(typename Tr<DT>::S *t, const typename Tr<DT>::S *src, Fibers fb, const uint64_t *keys,
                               const uint32_t *vals, int64_t total) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < total; p += stride) {
    const uint64_t k = keys[p];
    if (p > 0 && keys[p - 1] == k) continue;
    const int64_t f = (int64_t)(k / (uint64_t)fb.tdim), v = (int64_t)(k - (uint64_t)f * (uint64_t)fb.tdim);
    int64_t to, so;
    fiber_offsets(fb, f, to, so);
    typename Tr<DT>::S *pt = t + to + v * fb.tsd;
    typename Tr<DT>::S acc = *pt;
    for (int64_t q = p; q < total && keys[q] == k; q++) {
      const int64_t l = ((int64_t)vals[q] / fb.inner) % fb.L;
      acc = Add<DT>::add(acc, src[so + l * fb.ssd]);
    }
    *pt = acc;
  }
}

template <int DT>
dlua_status_t scatter(const char *op, void *t_, const void *src_, const Fibers &fb, const void *idx, int is64,
                      int64_t base, int device, cudaStream_t s) {
  typedef typename Tr<DT>::S S;
  S *t = (S *)t_;
  const S *src = (const S *)src_;
  const int64_t nfib = fb.nfib, total = nfib * fb.L;
  // Enough fibers to fill the GPU, or short ones: a thread per fiber. Few long fibers: sort their terms by
  // target so that every target is one thread's run (the order within a run is l's either way).
  if (nfib >= 16384 || fb.L <= 64 || total > (int64_t)UINT32_MAX) {
    k_scatter_fibers<DT><<<grid_for(nfib), kThreads, 0, s>>>(t, src, fb, idx, is64, base, nfib);
    return launched(op);
  }
  void *mem = NULL;
  const size_t kb = (size_t)total * sizeof(uint64_t), vb = (size_t)total * sizeof(uint32_t);
  DLUA_TRY(dlua_cuda_malloc(&mem, device, 2 * kb + 2 * vb, NULL));
  uint64_t *kin = (uint64_t *)mem, *kout = kin + total;
  uint32_t *vin = (uint32_t *)(kout + total), *vout = vin + total;
  k_scatter_keys<<<grid_for(total), kThreads, 0, s>>>(idx, is64, base, fb, total, kin, vin);
  dlua_status_t st = launched(op);
  if (st == DLUA_OK)
    st = sort_pairs(op, kin, kout, vin, vout, total, bits_for((uint64_t)nfib * (uint64_t)fb.tdim - 1), device, s);
  if (st == DLUA_OK) {
    k_scatter_runs<DT><<<grid_for(total), kThreads, 0, s>>>(t, src, fb, kout, vout, total);
    st = launched(op);
  }
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  return st;
}

/* ---- one_hot ------------------------------------------------------------------------------------- */

template <int ES>
__global__ void k_one_hot(typename Bits<ES>::T *out, typename Bits<ES>::T one, const void *lab, int is64, int64_t n,
                          int64_t classes, int64_t base) {
  const int64_t total = n * classes, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t i = e / classes, c = e - i * classes;
    out[e] = index_at(lab, is64, i) - base == c ? one : (typename Bits<ES>::T)0;
  }
}

template <int ES>
void launch_one_hot(void *out, uint64_t one, const void *lab, int is64, int64_t n, int64_t classes, int64_t base,
                    cudaStream_t s) {
  typedef typename Bits<ES>::T T;
  k_one_hot<ES><<<grid_for(n * classes), kThreads, 0, s>>>((T *)out, (T)one, lab, is64, n, classes, base);
}

/* ---- cat's row copies: outer rows of `row` elements, contiguous in src, to dst + o * pitch ------------- */

template <int ES>
__global__ void k_copy_rows(typename Bits<ES>::T *dst, const typename Bits<ES>::T *src, int64_t outer, int64_t row,
                            int64_t pitch) {
  const int64_t total = outer * row, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t o = e / row, j = e - o * row;
    dst[o * pitch + j] = src[e];
  }
}

template <int ES>
void launch_copy_rows(void *dst, const void *src, int64_t outer, int64_t row, int64_t pitch, cudaStream_t s) {
  typedef typename Bits<ES>::T T;
  k_copy_rows<ES><<<grid_for(outer * row), kThreads, 0, s>>>((T *)dst, (const T *)src, outer, row, pitch);
}

dlua_status_t cuda_failed(const char *op, cudaError_t e) {
  cudaGetLastError();
  return DLUA_ERR(DLUA_ERR_BACKEND, "%s: %s (CUDA error %d)", op, cudaGetErrorString(e), (int)e);
}

}  // namespace
}  // namespace dlua_cu

using namespace dlua_cu;

namespace {

dlua_status_t cuda_first_bad(const char *op, const dlua_index_check_t *c, int64_t *first, int64_t *value) {
  const void *index = c->index;
  const int is64 = c->is64, device = c->device;
  const int64_t n = c->n, size = c->size, base = c->base;
  *first = -1;
  *value = 0;
  if (n <= 0) return DLUA_OK;
  DLUA_CU_SELECT(g, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  void *mem = NULL;
  DLUA_TRY(dlua_cuda_malloc(&mem, device, 2 * sizeof(unsigned long long), NULL));
  unsigned long long *res = (unsigned long long *)mem, host[2] = {0, 0};
  dlua_status_t st = DLUA_OK;
  cudaError_t e = cudaMemsetAsync(res, 0xff, sizeof host, s);
  if (e == cudaSuccess) {
    k_first_bad<<<grid_for(n), kThreads, 0, s>>>(index, is64, n, size, base, res);
    st = launched(op);
    if (st == DLUA_OK) {
      k_fetch_bad<<<1, 1, 0, s>>>(index, is64, res);
      st = launched(op);
    }
    if (st == DLUA_OK) e = cudaMemcpyAsync(host, res, sizeof host, cudaMemcpyDeviceToHost, s);
    if (st == DLUA_OK && e == cudaSuccess) e = cudaStreamSynchronize(s);
  }
  if (st == DLUA_OK && e != cudaSuccess) st = cuda_failed(op, e);
  if (dlua_cuda_free(device, mem) != DLUA_OK && st == DLUA_OK) st = DLUA_ERR_BACKEND;
  if (st == DLUA_OK && host[0] != ~0ull) {
    *first = (int64_t)host[0];
    *value = (int64_t)host[1];
  }
  return st;
}

/* index_select (mode 0) and gather (mode 1). */
dlua_status_t gather_rows(const char *op, int mode, const dlua_index_gather_t *gd) {
  const int elsize = gd->elsize, dim = gd->dim, is64 = gd->is64, device = gd->device;
  void *out = gd->out;
  const void *src = gd->src, *index = gd->index;
  const int64_t base = gd->base;
  const dlua_index_layout_t *lay = &gd->lay;
  int64_t numel = 1;
  for (int d = 0; d < lay->ndim; d++) numel *= lay->sizes[d];
  if (numel <= 0) return DLUA_OK;
  if (lay->ndim < 1 || lay->ndim > DLUA_MAX_DIMS || dim < 0 || dim >= lay->ndim)
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: malformed CUDA gather", op);
  DLUA_CU_SELECT(g, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  const Lay l = make_lay(lay);
  switch (elsize) {
    case 1: launch_gather<1>(mode, out, src, l, dim, index, is64, base, numel, s); break;
    case 2: launch_gather<2>(mode, out, src, l, dim, index, is64, base, numel, s); break;
    case 4: launch_gather<4>(mode, out, src, l, dim, index, is64, base, numel, s); break;
    case 8: launch_gather<8>(mode, out, src, l, dim, index, is64, base, numel, s); break;
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: element size %d", op, elsize);
  }
  return launched(op);
}

dlua_status_t cuda_index_select(const char *op, const dlua_index_gather_t *gd) { return gather_rows(op, 0, gd); }
dlua_status_t cuda_gather(const char *op, const dlua_index_gather_t *gd) { return gather_rows(op, 1, gd); }

dlua_status_t cuda_scatter_add(const char *op, const dlua_index_scatter_t *sc) {
  const int dtype = sc->dtype, ndim = sc->ndim, dim = sc->dim, is64 = sc->is64, device = sc->device;
  void *t = sc->t;
  const void *src = sc->src, *index = sc->index;
  const int64_t *t_strides = sc->t_strides, *s_strides = sc->s_strides, *idx_sizes = sc->idx_sizes;
  const int64_t t_dim_size = sc->t_dim_size, base = sc->base;
  if (ndim < 1 || ndim > DLUA_MAX_DIMS || dim < 0 || dim >= ndim)
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: malformed CUDA scatter", op);
  Fibers fb;
  memset(&fb, 0, sizeof fb);
  fb.L = idx_sizes[dim];
  fb.inner = 1;
  int64_t nfib = 1;
  for (int d = 0; d < ndim; d++) {
    if (d == dim) continue;
    fb.fsz[fb.fnd] = idx_sizes[d];
    fb.tst[fb.fnd] = t_strides[d];
    fb.sst[fb.fnd] = s_strides[d];
    fb.fnd++;
    nfib *= idx_sizes[d];
    if (d > dim) fb.inner *= idx_sizes[d];
  }
  fb.tsd = t_strides[dim];
  fb.ssd = s_strides[dim];
  fb.tdim = t_dim_size;
  fb.nfib = nfib;
  if (nfib <= 0 || fb.L <= 0) return DLUA_OK;
  DLUA_CU_SELECT(g, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  switch (dtype) {
    case DLUA_DTYPE_F32: return scatter<DLUA_DTYPE_F32>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_F64: return scatter<DLUA_DTYPE_F64>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_F16: return scatter<DLUA_DTYPE_F16>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_BF16: return scatter<DLUA_DTYPE_BF16>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_I32: return scatter<DLUA_DTYPE_I32>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_I64: return scatter<DLUA_DTYPE_I64>(op, t, src, fb, index, is64, base, device, s);
    case DLUA_DTYPE_U8: return scatter<DLUA_DTYPE_U8>(op, t, src, fb, index, is64, base, device, s);
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: no CUDA scatter for dtype %d", op, dtype);
  }
}

dlua_status_t cuda_one_hot(const char *op, const dlua_index_one_hot_t *h) {
  const int elsize = h->elsize, is64 = h->is64, device = h->device;
  const uint64_t one = h->one;
  void *out = h->out;
  const void *labels = h->labels;
  const int64_t n = h->n, classes = h->classes, base = h->base;
  if (n <= 0 || classes <= 0) return DLUA_OK;
  DLUA_CU_SELECT(g, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  switch (elsize) {
    case 1: launch_one_hot<1>(out, one, labels, is64, n, classes, base, s); break;
    case 2: launch_one_hot<2>(out, one, labels, is64, n, classes, base, s); break;
    case 4: launch_one_hot<4>(out, one, labels, is64, n, classes, base, s); break;
    case 8: launch_one_hot<8>(out, one, labels, is64, n, classes, base, s); break;
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: element size %d", op, elsize);
  }
  return launched(op);
}

dlua_status_t cuda_copy_rows(const char *op, const dlua_index_rows_t *r) {
  if (r->outer <= 0 || r->row <= 0) return DLUA_OK;
  DLUA_CU_SELECT(g, op, r->device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(r->device);
  switch (r->elsize) {
    case 1: launch_copy_rows<1>(r->dst, r->src, r->outer, r->row, r->pitch, s); break;
    case 2: launch_copy_rows<2>(r->dst, r->src, r->outer, r->row, r->pitch, s); break;
    case 4: launch_copy_rows<4>(r->dst, r->src, r->outer, r->row, r->pitch, s); break;
    case 8: launch_copy_rows<8>(r->dst, r->src, r->outer, r->row, r->pitch, s); break;
    default: return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: element size %d", op, r->elsize);
  }
  return launched(op);
}

}  // namespace

extern "C" const struct dlua_index_ops dlua_cuda_index_ops = {
    cuda_first_bad,    /* first_bad */
    cuda_index_select, /* index_select */
    cuda_gather,       /* gather */
    cuda_scatter_add,  /* scatter_add */
    cuda_one_hot,      /* one_hot */
    cuda_copy_rows,    /* copy_rows */
    dlua_cuda_sort,    /* sort (sort.cu) */
    dlua_cuda_topk,    /* topk (sort.cu) */
};

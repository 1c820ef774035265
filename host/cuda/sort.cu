/* CUDA sort and top-k along any dim: host/kernels/sort_keys.h's keys, then a stable radix sort (index.cu's
   sort_pairs, CUB) of (row, key) pairs. */
#include "cuda/ew_common.cuh"
#include "cuda/index_cuda.h" /* after ew_common.cuh: core/api.h is already in as C */
#include "kernels/sort_keys.h"

namespace dlua_cu {

namespace {

/* The input with the sorted dim moved last: linear position p = row * n + j, row = (outer, inner). */
struct Lay {
  int ndim;
  int64_t sizes[DLUA_MAX_DIMS], strides[DLUA_MAX_DIMS];
};

__device__ __forceinline__ int64_t offset_of(const Lay &l, int64_t p) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; d--) {
    const int64_t q = p / l.sizes[d];
    off += (p - q * l.sizes[d]) * l.strides[d];
    p = q;
  }
  return off;
}

/* The key of element `off` of a (dtype) by value or magnitude, the CPU's. */
__device__ __forceinline__ uint64_t key_at(const char *a, int64_t off, int dtype, int mag) {
  switch (dtype) {
    case DLUA_DTYPE_F32: {
      const uint32_t u = ((const uint32_t *)a)[off];
      return mag ? dlua_sortkey_f32m(u) : dlua_sortkey_f32v(u);
    }
    case DLUA_DTYPE_F64: {
      const uint64_t u = ((const uint64_t *)a)[off];
      return mag ? dlua_sortkey_f64m(u) : dlua_sortkey_f64v(u);
    }
    case DLUA_DTYPE_F16: return dlua_sortkey_half(((const uint16_t *)a)[off], 0x7c00u, mag);
    case DLUA_DTYPE_BF16: return dlua_sortkey_half(((const uint16_t *)a)[off], 0x7f80u, mag);
    case DLUA_DTYPE_I32: {
      const uint32_t u = ((const uint32_t *)a)[off];
      return mag ? dlua_sortkey_i32m((int32_t)u) : dlua_sortkey_i32v(u);
    }
    case DLUA_DTYPE_I64: {
      const uint64_t u = ((const uint64_t *)a)[off];
      return mag ? dlua_sortkey_i64m((int64_t)u) : dlua_sortkey_i64v(u);
    }
    default: return ((const uint8_t *)a)[off];  // u8, bool
  }
}

int key_bits(int dtype) {
  switch (dtype) {
    case DLUA_DTYPE_F64:
    case DLUA_DTYPE_I64: return 64;
    case DLUA_DTYPE_F32:
    case DLUA_DTYPE_I32: return 32;
    case DLUA_DTYPE_F16:
    case DLUA_DTYPE_BF16: return 16;
    default: return 8;
  }
}

/* keys[p] = (row << row_shift) | (key ^ flip) (row_shift 0: the key alone), vals[p] = p. */
template <typename K>
__global__ void k_keys(const char *a, Lay lay, int dtype, int mag, uint64_t flip, int64_t n, int row_shift,
                       int64_t total, K *keys, uint32_t *vals) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < total; p += stride) {
    uint64_t k = key_at(a, offset_of(lay, p), dtype, mag) ^ flip;
    if (row_shift) k |= (uint64_t)(p / n) << row_shift;
    keys[p] = (K)k;
    vals[p] = (uint32_t)p;
  }
}

/* Row of each pair, for the second (stable) pass when row and key do not fit one 64-bit key. */
__global__ void k_rows(const uint32_t *vals, int64_t n, int64_t total, uint32_t *rows) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < total; p += stride)
    rows[p] = (uint32_t)(vals[p] / n);
}

/* The first k positions of each sorted row (unsorted top-k sorts them again, by position). */
__global__ void k_head(const uint32_t *vals, int64_t n, int64_t k, int64_t rows, uint32_t *keys, uint32_t *copy) {
  const int64_t total = rows * k, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
    const int64_t r = q / k;
    keys[q] = copy[q] = vals[r * n + (q - r * k)];
  }
}

/* Output q = (row, t), t < len: the element at position p = pos[row * pstride + t] of the input (pos NULL:
   p = row * n + t), and its index in the row, into contiguous (outer, len, inner) buffers. */
template <typename T>
__global__ void k_write(const T *a, Lay lay, const uint32_t *pos, int64_t pstride, int64_t n, int64_t len,
                        int64_t inner, int64_t rows, T *values, int64_t *indices, int64_t base) {
  const int64_t total = rows * len, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
    const int64_t r = q / len, t = q - r * len;
    const int64_t p = pos ? (int64_t)pos[r * pstride + t] : r * n + t;
    const int64_t o = r / inner, i = r - o * inner;
    const int64_t e = (o * len + t) * inner + i;
    if (values) values[e] = a[offset_of(lay, p)];
    if (indices) indices[e] = p - r * n + base;
  }
}

template <typename T>
void launch_write(const void *a, const Lay &lay, const uint32_t *pos, int64_t pstride, int64_t n, int64_t len,
                  int64_t inner, int64_t rows, void *values, int64_t *indices, int64_t base, cudaStream_t s) {
  k_write<T><<<grid_for(rows * len), kThreads, 0, s>>>((const T *)a, lay, pos, pstride, n, len, inner, rows,
                                                        (T *)values, indices, base);
}

/* Scratch freed on every path. */
struct Scratch {
  int device;
  void *p[4] = {NULL, NULL, NULL, NULL};
  explicit Scratch(int d) : device(d) {}
  dlua_status_t get(int i, size_t bytes) { return dlua_cuda_malloc(&p[i], device, bytes ? bytes : 1, NULL); }
  dlua_status_t release() {
    dlua_status_t st = DLUA_OK;
    for (int i = 0; i < 4; i++)
      if (p[i] && dlua_cuda_free(device, p[i]) != DLUA_OK) st = DLUA_ERR_BACKEND;
    for (int i = 0; i < 4; i++) p[i] = NULL;
    return st;
  }
  ~Scratch() { release(); }
};

/* Sorts every row by (key ^ flip), stably: *sorted = positions p in (row, key, p) order. */
dlua_status_t sort_rows(const char *op, Scratch &sc, const void *a, const Lay &lay, int dtype, int mag, uint64_t flip,
                        int64_t rows, int64_t n, int device, cudaStream_t s, uint32_t **sorted) {
  const int64_t total = rows * n;
  const int kb = key_bits(dtype), rb = bits_for((uint64_t)rows - 1);
  const unsigned grid = grid_for(total);
  if (kb + rb <= 32) {
    DLUA_TRY(sc.get(0, (size_t)total * 2 * sizeof(uint32_t)));
    DLUA_TRY(sc.get(1, (size_t)total * 2 * sizeof(uint32_t)));
    uint32_t *kin = (uint32_t *)sc.p[0], *kout = kin + total, *vin = (uint32_t *)sc.p[1], *vout = vin + total;
    k_keys<uint32_t><<<grid, kThreads, 0, s>>>((const char *)a, lay, dtype, mag, flip, n, rb ? kb : 0, total, kin, vin);
    DLUA_TRY(launched(op));
    DLUA_TRY(sort_pairs(op, kin, kout, vin, vout, total, kb + rb, device, s));
    *sorted = vout;
    return DLUA_OK;
  }
  DLUA_TRY(sc.get(0, (size_t)total * 2 * sizeof(uint64_t)));
  DLUA_TRY(sc.get(1, (size_t)total * 2 * sizeof(uint32_t)));
  uint64_t *kin = (uint64_t *)sc.p[0], *kout = kin + total;
  uint32_t *vin = (uint32_t *)sc.p[1], *vout = vin + total;
  const bool one_key = kb + rb <= 64;
  k_keys<uint64_t><<<grid, kThreads, 0, s>>>((const char *)a, lay, dtype, mag, flip, n, one_key && rb ? kb : 0, total,
                                              kin, vin);
  DLUA_TRY(launched(op));
  DLUA_TRY(sort_pairs(op, kin, kout, vin, vout, total, one_key ? kb + rb : 64, device, s));
  if (one_key) {
    *sorted = vout;
    return DLUA_OK;
  }
  // 64-bit keys of several rows: sorted by key, then stably by row (LSD order): (row, key, p) again.
  uint32_t *rin = (uint32_t *)kin, *rout = rin + total;  // the key buffers are free now
  k_rows<<<grid, kThreads, 0, s>>>(vout, n, total, rin);
  DLUA_TRY(launched(op));
  DLUA_TRY(sort_pairs(op, rin, rout, vout, vin, total, rb, device, s));
  *sorted = vin;
  return DLUA_OK;
}

dlua_status_t run(const char *op, int topk, int dtype, const void *a, const Lay &lay, int64_t rows, int64_t n,
                  int64_t inner, int64_t len, int desc_or_largest, int mag, int sorted, void *values,
                  int64_t *indices, int64_t base, int device, cudaStream_t s) {
  const int kb = key_bits(dtype);
  const uint64_t mask = kb == 64 ? ~0ull : (1ull << kb) - 1;
  // Ascending order of (key ^ flip): sort descending and the k largest flip the key's bits.
  const uint64_t flip = desc_or_largest ? mask : 0;
  Scratch sc(device);
  uint32_t *pos = NULL;
  int64_t pstride = n;
  dlua_status_t st = DLUA_OK;
  if (topk && !sorted && len == n) {
    // k = n unsorted: every row in its own order, as the CPU returns it (pos NULL: the identity).
  } else {
    st = sort_rows(op, sc, a, lay, dtype, topk ? mag : 0, flip, rows, n, device, s, &pos);
  }
  if (st == DLUA_OK && topk && !sorted && len < n) {
    // The selected positions in increasing order: sort them (row * n + j) once more.
    const int64_t m = rows * len;
    st = sc.get(2, (size_t)m * 4 * sizeof(uint32_t));
    if (st == DLUA_OK) {
      uint32_t *hin = (uint32_t *)sc.p[2], *hout = hin + m, *vin = hout + m, *vout = vin + m;
      k_head<<<grid_for(m), kThreads, 0, s>>>(pos, n, len, rows, hin, vin);
      st = launched(op);
      if (st == DLUA_OK) st = sort_pairs(op, hin, hout, vin, vout, m, bits_for((uint64_t)(rows * n - 1)), device, s);
      pos = hout;
      pstride = len;
    }
  }
  if (st == DLUA_OK) {
    switch (dlua_dtype_size((dlua_dtype_t)dtype)) {
      case 1: launch_write<uint8_t>(a, lay, pos, pstride, n, len, inner, rows, values, indices, base, s); break;
      case 2: launch_write<uint16_t>(a, lay, pos, pstride, n, len, inner, rows, values, indices, base, s); break;
      case 4: launch_write<uint32_t>(a, lay, pos, pstride, n, len, inner, rows, values, indices, base, s); break;
      default: launch_write<uint64_t>(a, lay, pos, pstride, n, len, inner, rows, values, indices, base, s); break;
    }
    st = launched(op);
  }
  dlua_status_t rs = sc.release();
  return st == DLUA_OK ? rs : st;
}

}  // namespace
}  // namespace dlua_cu

using namespace dlua_cu;

namespace {

dlua_status_t sort_rows(const char *op, int topk, const dlua_sort_t *sd) {
  const int dtype = sd->dtype, dim = sd->dim, device = sd->device;
  const int descending_or_largest = sd->descending_or_largest, by_magnitude = sd->by_magnitude, sorted = sd->sorted;
  const void *a = sd->a;
  const dlua_index_layout_t *lay = &sd->lay;
  const int64_t len = sd->len, index_base = sd->index_base;
  void *values = sd->values;
  int64_t *indices = sd->indices;
  if (lay->ndim < 1 || lay->ndim > DLUA_MAX_DIMS || dim < 0 || dim >= lay->ndim)
    return DLUA_ERR(DLUA_ERR_INTERNAL, "%s: malformed CUDA sort", op);
  // Dims other than dim first (rows: outer then inner), dim last.
  Lay l;
  memset(&l, 0, sizeof l);
  l.ndim = lay->ndim;
  int64_t rows = 1, inner = 1;
  for (int d = 0, k = 0; d < lay->ndim; d++) {
    if (d == dim) continue;
    l.sizes[k] = lay->sizes[d];
    l.strides[k] = lay->strides[d];
    k++;
    rows *= lay->sizes[d];
    if (d > dim) inner *= lay->sizes[d];
  }
  const int64_t n = lay->sizes[dim];
  l.sizes[lay->ndim - 1] = n;
  l.strides[lay->ndim - 1] = lay->strides[dim];
  if (rows <= 0 || n <= 0 || len <= 0 || (!values && !indices)) return DLUA_OK;
  if (rows * n > (int64_t)UINT32_MAX)
    return DLUA_ERR(DLUA_ERR_ARG, "%s: not implemented on cuda:%d for more than %u elements (got %lld)", op, device,
                    UINT32_MAX, (long long)(rows * n));
  DLUA_CU_SELECT(g, op, device);
  cudaStream_t s = (cudaStream_t)dlua_cuda_raw_stream(device);
  return run(op, topk, dtype, a, l, rows, n, inner, len, descending_or_largest, by_magnitude, sorted, values, indices,
             index_base, device, s);
}

}  // namespace

extern "C" dlua_status_t dlua_cuda_sort(const char *op, const dlua_sort_t *s) { return sort_rows(op, 0, s); }
extern "C" dlua_status_t dlua_cuda_topk(const char *op, const dlua_sort_t *s) { return sort_rows(op, 1, s); }

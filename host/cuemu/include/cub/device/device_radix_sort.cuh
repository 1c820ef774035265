/* The CUDA emulator's stand-in for CUB's DeviceRadixSort::SortPairs: a stable sort of (key, value) pairs by the
   key's bits [begin_bit, end_bit), queued on the stream like the real one, using the scratch it asked for. */
#ifndef DLUA_CUEMU_CUB_RADIX_SORT
#define DLUA_CUEMU_CUB_RADIX_SORT
#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "cuemu.h"

namespace cub {
struct DeviceRadixSort {
  template <typename K, typename V, typename N>
  static cudaError_t SortPairs(void *tmp, size_t &bytes, const K *kin, K *kout, const V *vin, V *vout, N n,
                               int begin_bit = 0, int end_bit = (int)sizeof(K) * 8, cudaStream_t s = 0) {
    static_assert(std::is_unsigned<K>::value, "the emulator sorts unsigned keys only");
    const size_t need = (size_t)n * (sizeof(K) + sizeof(V)) + 256;
    if (!tmp) {
      bytes = need;
      return cudaSuccess;
    }
    if (bytes < need || begin_bit < 0 || end_bit > (int)sizeof(K) * 8 || begin_bit >= end_bit)
      return cudaErrorInvalidValue;
    if (n > 0 && (cuemu_memory_kind(tmp, need) != 1 || cuemu_memory_kind(kin, n * sizeof(K)) != 1 ||
                  cuemu_memory_kind(kout, n * sizeof(K)) != 1 || cuemu_memory_kind(vin, n * sizeof(V)) != 1 ||
                  cuemu_memory_kind(vout, n * sizeof(V)) != 1))
      return cudaErrorInvalidValue;
    struct Job {
      const K *kin;
      K *kout;
      const V *vin;
      V *vout;
      size_t n;
      int b0, b1;
      char *tmp;
      static void run(void *a) {
        const Job &j = *(const Job *)a;
        const K mask = j.b1 - j.b0 >= (int)sizeof(K) * 8 ? (K)~(K)0 : (K)((((K)1 << (j.b1 - j.b0)) - 1) << j.b0);
        K *ks = (K *)j.tmp;  // the scratch holds a copy of the pairs, as CUB's double buffer would
        V *vs = (V *)(j.tmp + j.n * sizeof(K));
        memcpy(ks, j.kin, j.n * sizeof(K));
        memcpy(vs, j.vin, j.n * sizeof(V));
        std::vector<size_t> ord(j.n);
        for (size_t i = 0; i < j.n; i++) ord[i] = i;
        std::stable_sort(ord.begin(), ord.end(), [&](size_t a, size_t b) { return (ks[a] & mask) < (ks[b] & mask); });
        for (size_t i = 0; i < j.n; i++) {
          j.kout[i] = ks[ord[i]];
          j.vout[i] = vs[ord[i]];
        }
      }
    } job = {kin, kout, vin, vout, (size_t)n, begin_bit, end_bit, (char *)tmp};
    cuemu_enqueue(s, &Job::run, &job, sizeof job);
    return cudaSuccess;
  }
};
}  // namespace cub
#endif

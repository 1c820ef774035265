/* What the fake cuBLASLt and cuDNN share: elements of the four float types read as double and written back,
   f16 and bf16 through float with the CPU backend's own round-to-nearest-even conversions (core/dtype.h). */
#ifndef DLUA_CUEMU_FAKE_COMMON_H
#define DLUA_CUEMU_FAKE_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include "core/dtype.h"

typedef enum { FK_NONE, FK_F64, FK_F32, FK_F16, FK_BF16 } fk_type_t;

static inline size_t fk_size(fk_type_t t) { return t == FK_F64 ? 8 : t == FK_F32 ? 4 : t == FK_NONE ? 0 : 2; }

static inline double fk_load(fk_type_t t, const void *p, int64_t i) {
  switch (t) {
    case FK_F64: return ((const double *)p)[i];
    case FK_F32: return ((const float *)p)[i];
    case FK_F16: return dlua_f16_to_f32_inl(((const uint16_t *)p)[i]);
    default: return dlua_bf16_to_f32_inl(((const uint16_t *)p)[i]);
  }
}

static inline void fk_store(fk_type_t t, void *p, int64_t i, double v) {
  switch (t) {
    case FK_F64: ((double *)p)[i] = v; break;
    case FK_F32: ((float *)p)[i] = (float)v; break;
    case FK_F16: ((uint16_t *)p)[i] = dlua_f32_to_f16_inl((float)v); break;
    default: ((uint16_t *)p)[i] = dlua_f32_to_bf16_inl((float)v); break;
  }
}
#endif

/* Element conversions between dtypes over host memory (copy.c): copy_'s rules in one place, for the CPU
   backend's copy kernels and for fills that compute values in one type. */
#ifndef DLUA_CORE_COPY_H
#define DLUA_CORE_COPY_H
#include <stdint.h>
#include "core/api.h"

/* n elements of one dtype from src (step ss bytes) to another at dst (step ds bytes); ss == 0 broadcasts one
   value. Same dtype moves the bits (bool goes through != 0). */
typedef void (*dlua_convert_fn)(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n);
dlua_convert_fn dlua_converter(dlua_dtype_t src, dlua_dtype_t dst);

/* n contiguous elements of src_dtype -> dst_dtype, with copy_'s rules (float -> int
   truncates toward zero, anything -> bool is != 0). No checks: callers own the buffers. */
void dlua_convert(void *dst, dlua_dtype_t dst_dtype, const void *src, dlua_dtype_t src_dtype, int64_t n);

/* n contiguous f32 -> f16 (bf16 = 0) or bf16, each multiplied by scale first (in f32), and back:
   round to nearest even, the same bits as copy_, with F16C / AVX-512 where the CPU has them. */
void dlua_convert_f32_to_half(uint16_t *dst, const float *src, int64_t n, float scale, int bf16);
void dlua_convert_half_to_f32(float *dst, const uint16_t *src, int64_t n, int bf16);

#endif

/* dtype names, sizes, promotion, and the f16/bf16 conversions of the public API. */
#include <string.h>
#include "core/api.h"
#include "core/dtype.h"

static const char *const dtype_names[DLUA_DTYPE_COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool"};
static const size_t dtype_sizes[DLUA_DTYPE_COUNT] = {4, 8, 2, 2, 4, 8, 1, 1};

const char *dlua_dtype_name(dlua_dtype_t dtype) {
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return "invalid dtype";
  return dtype_names[dtype];
}

size_t dlua_dtype_size(dlua_dtype_t dtype) {
  if ((int)dtype < 0 || dtype >= DLUA_DTYPE_COUNT) return 0;
  return dtype_sizes[dtype];
}

int dlua_dtype_is_floating(dlua_dtype_t dtype) {
  return dtype == DLUA_DTYPE_F32 || dtype == DLUA_DTYPE_F64 || dtype == DLUA_DTYPE_F16 ||
         dtype == DLUA_DTYPE_BF16;
}

int dlua_dtype_from_name(const char *name) {
  static const struct {
    const char *name;
    dlua_dtype_t dtype;
  } aliases[] = {
      {"float32", DLUA_DTYPE_F32}, {"f32", DLUA_DTYPE_F32},    {"float", DLUA_DTYPE_F32},
      {"float64", DLUA_DTYPE_F64}, {"f64", DLUA_DTYPE_F64},    {"double", DLUA_DTYPE_F64},
      {"float16", DLUA_DTYPE_F16}, {"f16", DLUA_DTYPE_F16},    {"half", DLUA_DTYPE_F16},
      {"bfloat16", DLUA_DTYPE_BF16}, {"bf16", DLUA_DTYPE_BF16},
      {"int32", DLUA_DTYPE_I32},   {"i32", DLUA_DTYPE_I32},    {"int", DLUA_DTYPE_I32},
      {"int64", DLUA_DTYPE_I64},   {"i64", DLUA_DTYPE_I64},    {"long", DLUA_DTYPE_I64},
      {"uint8", DLUA_DTYPE_U8},    {"u8", DLUA_DTYPE_U8},      {"byte", DLUA_DTYPE_U8},
      {"bool", DLUA_DTYPE_BOOL},   {"boolean", DLUA_DTYPE_BOOL},
  };
  if (!name) return -1;
  // PyTorch users write "torch.float16"; accept the prefix rather than make them strip it.
  if (strncmp(name, "torch.", 6) == 0) name += 6;
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (strcmp(name, aliases[i].name) == 0) return (int)aliases[i].dtype;
  return -1;
}

/* Rank in PyTorch's promotion lattice: bool < uint8 < int32 < int64 < half types < f32 < f64. */
static int promote_rank(dlua_dtype_t d) {
  switch (d) {
    case DLUA_DTYPE_BOOL: return 0;
    case DLUA_DTYPE_U8: return 1;
    case DLUA_DTYPE_I32: return 2;
    case DLUA_DTYPE_I64: return 3;
    case DLUA_DTYPE_F16:
    case DLUA_DTYPE_BF16: return 4;
    case DLUA_DTYPE_F32: return 5;
    case DLUA_DTYPE_F64: return 6;
    default: return -1;
  }
}

dlua_dtype_t dlua_dtype_promote(dlua_dtype_t a, dlua_dtype_t b) {
  if (a == b) return a;
  int ra = promote_rank(a), rb = promote_rank(b);
  // f16 and bf16 have no common 16-bit supertype: neither holds the other's range/precision.
  if (ra == 4 && rb == 4) return DLUA_DTYPE_F32;
  return ra >= rb ? a : b;
}

uint16_t dlua_f32_to_f16(float x) { return dlua_f32_to_f16_inl(x); }
float dlua_f16_to_f32(uint16_t h) { return dlua_f16_to_f32_inl(h); }
uint16_t dlua_f32_to_bf16(float x) { return dlua_f32_to_bf16_inl(x); }
float dlua_bf16_to_f32(uint16_t h) { return dlua_bf16_to_f32_inl(h); }

/* Gradient compression (host/ops/compress.c): its front doors are the dlua_compress_* functions of dlua.h. */
#ifndef DLUA_OPS_COMPRESS_H
#define DLUA_OPS_COMPRESS_H
#include "core/api.h"
#endif

/* The CPU kernels of gradient compression (host/cpu/compress.c): slots of the CPU optim table (host/cpu/optim.c
   fills dlua_cpu_optim_ops with them; host/ops/compress.c checked every argument). */
#ifndef DLUA_CPU_COMPRESS_H
#define DLUA_CPU_COMPRESS_H
#include "kernels/optim.h"

dlua_status_t dlua_cpu_compress_to_half(const char *op, const dlua_compress_cast_desc_t *d);
dlua_status_t dlua_cpu_compress_from_half(const char *op, const dlua_compress_cast_desc_t *d);
dlua_status_t dlua_cpu_compress_topk(const char *op, const dlua_compress_topk_desc_t *d);
dlua_status_t dlua_cpu_compress_topk_unpack(const char *op, const dlua_compress_unpack_desc_t *d);
dlua_status_t dlua_cpu_compress_orthogonalize(const char *op, const dlua_compress_orth_desc_t *d);
#endif

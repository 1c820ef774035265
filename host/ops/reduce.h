/* The reductions (host/ops/reduce.c): their front door is dlua_tensor_reduce of dlua.h. */
#ifndef DLUA_OPS_REDUCE_H
#define DLUA_OPS_REDUCE_H
#include "core/api.h"
#endif

/* Sort and top-k (host/ops/sort.c): their front doors are dlua_tensor_sort and dlua_tensor_topk of dlua.h. */
#ifndef DLUA_OPS_SORT_H
#define DLUA_OPS_SORT_H
#include "core/api.h"
#endif

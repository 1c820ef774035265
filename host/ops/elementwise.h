/* The element-wise front doors (host/ops/elementwise.c); their public declarations are in dlua.h. */
#ifndef DLUA_OPS_ELEMENTWISE_H
#define DLUA_OPS_ELEMENTWISE_H
#include "core/api.h"
#endif

/* The copy front doors (host/ops/copy.c): copy_, to_dtype, from_data, to_data, fill_, arange, linspace, eye;
   their public declarations are in dlua.h. The element conversions they share are core/copy.h's. */
#ifndef DLUA_OPS_COPY_H
#define DLUA_OPS_COPY_H
#include "core/api.h"
#endif

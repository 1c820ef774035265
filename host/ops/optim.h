/* The optimizer steps, gradient unscale, scale and partial norms (host/ops/optim.c): their front doors are the
   dlua_optim_* functions of dlua.h. */
#ifndef DLUA_OPS_OPTIM_H
#define DLUA_OPS_OPTIM_H
#include "core/api.h"
#endif

/* JSON trees through cJSON for Lua (metrics lines, dlua plot): the functions are declared in dlua.h. */
#ifndef DLUA_IO_JSON_H
#define DLUA_IO_JSON_H
#include "core/api.h"
#endif

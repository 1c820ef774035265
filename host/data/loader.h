/* The data loader: C worker threads decode and transform samples into batch buffers, a bounded number of batches ahead, delivered in sampler order. */
#ifndef DLUA_DATA_LOADER_H
#define DLUA_DATA_LOADER_H
#include "core/api.h"

/* How many bad files a loader remembers with their message (all are counted). */
enum { DLUA_LOADER_MAX_BAD_MESSAGES = 256 };

#endif

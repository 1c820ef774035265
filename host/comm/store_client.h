/* The rendezvous store's client (its API is dlua.h's dlua_store_*); here, its timing. */
#ifndef DLUA_COMM_STORE_CLIENT_H
#define DLUA_COMM_STORE_CLIENT_H

#include "comm/store.h"

/* How long the client waits for a reply beyond the server-side timeout of a blocking op,
   before it declares the server unresponsive. */
#define STORE_REPLY_GRACE_MS 2000
/* The client wakes this often while blocked, to notice Ctrl-C. */
#define STORE_POLL_SLICE_MS 100

#endif

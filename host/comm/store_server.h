/* The rendezvous store's server (its API is dlua.h's dlua_store_server_*); here, what tests ask it. */
#ifndef DLUA_COMM_STORE_SERVER_H
#define DLUA_COMM_STORE_SERVER_H
#include <stdint.h>

#include "comm/store.h"

/* Connections the server holds now (authenticated or still in the handshake); for tests
   that check that dead clients are cleaned up. */
int dlua_store_server_num_clients(const dlua_store_server_t *server);
/* Keys stored now. */
int64_t dlua_store_server_num_keys(const dlua_store_server_t *server);

#endif

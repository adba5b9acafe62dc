/* listen: the msgpack protocol's Unix listener (listen.c). Loop thread. */
#ifndef KVD_LISTEN_H
#define KVD_LISTEN_H

#include <stddef.h>

#include "server_impl.h"

/* Takes the socket systemd passed (exactly one), else binds opts.socket_path
 * or the default path (mode 0660, group socket-group), and starts
 * accepting into server_accept. Fills srv->socket_path, own_socket,
 * activated. 0 or an enum kvd_err with a message in err. */
int listen_start(struct server *srv, char *err, size_t errlen);
/* Stops accepting and removes the socket file kvd created. Idempotent. */
void listen_stop(struct server *srv);

#endif

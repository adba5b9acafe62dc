/* http: the OpenAI-compatible HTTP API (docs/http.md), served by kvd's own
 * loop with evhttp on a Unix socket (--http-socket: the peer's uid picks
 * the tenant, as on the msgpack socket) and/or TCP (--http HOST:PORT,
 * loopback unless --http-force: [http] bearer tokens pick the tenant).
 * Requests are generate clients of the executor (ops_generate.h), answered
 * as JSON or Server-Sent Events. */
#ifndef KVD_HTTP_H
#define KVD_HTTP_H

#include <stddef.h>
#include <stdint.h>

struct server;
struct ops_generate;
struct http_api;

/* Starts the listeners the options ask for (none: *out NULL, 0). gen is
 * NULL in store mode (completions answer 503); pool is the text workers,
 * where request bodies are parsed (NULL: on the loop; it must be freed
 * before http_stop); /v1/models lists the server's models. *tcp_port (may be NULL) gets the
 * bound TCP port. Call before server_run. Returns 0 or an enum kvd_err with a message. */
struct workpool;
int http_start(struct server *srv, struct ops_generate *gen, struct workpool *pool,
               struct http_api **out, uint16_t *tcp_port, char *err, size_t errlen);
/* Drops every request in flight (their generates are cancelled), closes the
 * connections and listeners. Call after server_run, before the server and
 * the executor are freed. NULL is a no-op. */
void http_stop(struct http_api *h);

#endif

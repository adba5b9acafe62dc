/* server: the libevent loop that owns the Unix listener (its own socket or
 * the one systemd passes), every client connection, signals (SIGTERM drain,
 * SIGHUP reload) and sd_notify. Quick ops run on the loop thread under
 * kvmm_lock; work done on other threads (the executor) comes back through
 * server_post(), the only server function that is thread-safe besides
 * server_shutdown(). */
#ifndef KVD_SERVER_H
#define KVD_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "config.h"
#include "kvmm.h"
#include "options.h"
#include "ops.h"

struct server;

struct models;
/* Creates the loop and the listener. opts and cfg are copied (cfg's arrays
 * are taken over: the caller must not free them after success). mm and be
 * are not owned and must outlive the server. */
int server_new(const struct options *opts, struct config *cfg, const char *config_path,
               struct kvmm *mm, struct backend *be, struct server **out);
/* Runs until SIGTERM/SIGINT/admin_shutdown has drained every connection.
 * Returns 0 after a clean drain. */
int server_run(struct server *srv);
void server_free(struct server *srv);

/* The socket path the server listens on ("" under socket activation). */
const char *server_socket_path(const struct server *srv);
/* The daemon's models (models.h; not owned, outlive the server): what
 * hello and stats report, the pools the ops pick from, and the kvmms every
 * tenant is registered in (mm, given to server_new, must be the first
 * model's). Serve mode only; call before server_run. 0 or KVD_ENOMEM. */
int server_set_models(struct server *srv, struct models *ms);

/* ---- for observers (stats, metrics): what they read, never the server -- */

struct roofline; /* roofline.h */
struct acct;     /* acct.h */
struct event_base;

/* Gives the server its observability sources (stats and metrics read them;
 * NULL is fine). Not owned. Call before server_run. */
void server_attach_obs(struct server *srv, struct roofline *rl, struct acct *acct);
struct kvevents;
/* The KV events publishers stats and metrics report (not owned): ev[i]
 * is model i's stream (store mode: ev[0]), NULL where it has none. */
void server_attach_kvevents(struct server *srv, struct kvevents *const *ev, size_t n);
struct workpool;
/* The prefetch workers (disk and remote restores) that stats reports as
 * "prefetch" (not owned; NULL: none). */
void server_attach_prefetch(struct server *srv, struct workpool *wp);
/* What an observer reads, on the loop thread: the memory manager (lock it
 * while reading), the sources above, the backend's name, the live
 * counters through pointers so one copy stays current, and the tenant
 * table (tenancy.h). */
struct server_obs {
    struct kvmm *mm;
    struct roofline *rl;
    struct acct *acct;
    const char *backend;
    const size_t *n_conns, *n_pending;
    const uint64_t *n_http_auth_failed; /* TCP HTTP requests refused for their token */
    const struct tenancy *tenancy;
    struct kvevents *const *kvevents; /* (n_kvevents) model i's stream, or NULL */
    size_t n_kvevents;                /* 0: KV events are off */
    struct models *models;            /* NULL in store mode */
    struct workpool *prefetch;        /* the prefetch workers, or NULL */
};
void server_get_obs(struct server *srv, struct server_obs *out);
/* The loop's event base (to add listeners to it) and the settings. */
struct event_base *server_event_base(struct server *srv);
/* The access rules in force (SIGHUP replaces their contents, never the
 * pointer): the HTTP API resolves its peers with them. Loop thread. */
const struct config *server_config(const struct server *srv);
const struct options *server_options(const struct server *srv);

/* A fresh requester id for a client that is not a connection (the HTTP
 * API's requests): from the connections' own counter, so the executor and
 * kvmm never confuse the two. Loop thread. */
uint64_t server_new_id(struct server *srv);
/* The HTTP API refused a TCP request for its bearer token (metrics count
 * them: kvd_http_auth_failures_total). Loop thread. */
void server_count_http_auth_failure(struct server *srv);
/* The HTTP API's streams' unread output, counted with the connections'
 * buffers against max-buffered (the msgpack side drops its connections
 * only for its own bytes; the HTTP API ends its streams that do not read
 * while the total is over). Loop thread. */
void server_http_buffered(struct server *srv, size_t added, size_t deleted);
bool server_over_buffer_budget(const struct server *srv);

/* Registers (or replaces) the handler of an op; see ops.h. Not thread-safe:
 * call before server_run. */
int server_op_register(struct server *srv, const char *op, ops_fn fn, void *ctx, unsigned flags);

/* ---- for other threads -------------------------------------------------- */

/* Queues one complete frame (4-byte length + map, as built with
 * proto_frame_begin/end) for connection conn_id and wakes the loop. The
 * server takes ownership of `frame` (malloc'd) and frees it, also on error.
 * SERVER_POST_FINAL marks the reply that ends request req_id (an op handler
 * that returned OPS_PENDING); events pass 0. Frames for a connection that
 * has closed are dropped. Thread-safe. Returns 0 or KVD_ENOMEM. */
#define SERVER_POST_FINAL 1u
int server_post(struct server *srv, uint64_t conn_id, uint64_t req_id, unsigned flags, void *frame,
                size_t len);

/* Called on the loop thread when a connection closes, however it closes,
 * before its sequences are released (kvmm_close_owner). The hook must stop
 * using the connection's sequences and cancel its requests; anything it
 * posts for that connection afterwards is dropped. */
typedef void (*server_close_fn)(void *ctx, uint64_t conn_id);
int server_on_close(struct server *srv, server_close_fn fn, void *ctx);

/* Called on the loop thread once at SIGTERM, after the listener closed: the
 * hook finishes or cancels every request it holds, answering each with a
 * FINAL server_post (`cancelled` where it cannot finish). Requests still
 * pending after the drain timeout are answered `cancelled` by the server. */
typedef void (*server_drain_fn)(void *ctx);
int server_on_drain(struct server *srv, server_drain_fn fn, void *ctx);

/* Starts the same drain as SIGTERM. Thread-safe. */
void server_shutdown(struct server *srv);
/* Called (loop thread) when the server must end connection conn_id's
 * requests with an error (its unread output passed max-unread-output). */
typedef void (*server_abort_fn)(void *ctx, uint64_t conn_id, int code, const char *msg);
int server_on_abort(struct server *srv, server_abort_fn fn, void *ctx);
/* Whether one more generate may be queued for connection c (may be NULL)
 * of tenant `tenant`: 0, or KVD_EBUSY with err naming the limit
 * (max-queued-per-connection / -per-tenant). Loop thread. */
struct conn;
int server_queue_admit(struct server *srv, struct conn *c, uint32_t tenant, struct kvd_error *err);
/* The same for a request that counts n against its tenant (a generate's
 * choices). */
int server_queue_admit_n(struct server *srv, struct conn *c, uint32_t tenant, uint32_t n,
                         struct kvd_error *err);
/* The tenant table (tenancy.h), for the HTTP API too. Loop thread. */
struct tenancy;
struct tenancy *server_tenancy(struct server *srv);
/* Adds delta to tenant's requests in flight, the count server_queue_admit
 * holds against max-queued-per-tenant: one count per tenant whichever
 * socket its requests came by (tenancy_pending). */
void server_tenant_pending(struct server *srv, uint32_t tenant, long delta);

#endif

/* server internals: the server's struct, for server.c alone (conn.c sees
 * only conn.h; the ops see ops.h's ops_host; observers server.h's
 * server_obs). Everything here runs on the loop thread except the post
 * queue, which has its own mutex. */
#ifndef KVD_SERVER_IMPL_H
#define KVD_SERVER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <msgpack.h>

#include "config.h"
#include "conn.h"
#include "ops.h"
#include "options.h"
#include "server.h"
#include "tenancy.h"

#define SERVER_CONN_BUCKETS 1024u

struct post_item {
    struct post_item *next;
    uint64_t conn_id, req_id;
    unsigned flags;
    void *frame; /* owned, malloc'd */
    size_t len;
};

struct server_hook {
    void (*fn)(void *ctx, uint64_t conn_id); /* close hooks; drain hooks ignore conn_id */
    void *ctx;
};

struct server {
    struct event_base *base;
    struct evconnlistener *listener;
    struct event *ev_term, *ev_int, *ev_hup, *ev_post, *ev_shutdown, *ev_watchdog, *ev_drain,
        *ev_accept;

    struct options opts;
    struct config cfg; /* replaced on SIGHUP */
    char config_path[4096];
    struct kvmm *mm;    /* not owned */
    struct backend *be; /* not owned */
    struct ops_table ops;
    struct ops_host host;  /* what the handlers read of the server (ops.h) */
    struct models *models; /* not owned; NULL in store mode */

    char socket_path[108];
    bool own_socket; /* we created socket_path: unlink it at exit */
    bool activated;  /* socket came from systemd */

    struct conn *conns; /* list of live connections */
    struct conn *buckets[SERVER_CONN_BUCKETS];
    size_t n_conns;
    uint64_t next_conn_id;
    size_t n_pending;        /* requests in flight on all connections */
    size_t buffered;         /* every connection's input + output bytes (max-buffered) */
    size_t http_buffered;    /* the HTTP API's streams' unread output (max-buffered too) */
    size_t freed_since_trim; /* buffer bytes released since the last malloc_trim */
    struct event *ev_budget, *ev_trim;
    uint64_t n_dropped;          /* connections dropped over max-buffered */
    uint64_t n_http_auth_failed; /* HTTP API: TCP requests with no or a wrong token */
    server_abort_fn abort_fn;
    void *abort_ctx;

    struct conn_env cenv; /* what every connection shares (conn.h): limits, the reply
                             batch, the callbacks into this file */
    msgpack_zone *zone;   /* objects of the request being dispatched; cleared after each */

    struct tenancy *tenancy; /* every tenant registered: admission counts, sub-tenants */

    /* what observers read (host.obs, server_get_obs); its sources
     * (server_attach_obs) are not owned, NULL when absent */
    struct server_obs obs;

    struct server_hook *close_hooks, *drain_hooks;
    size_t n_close_hooks, n_drain_hooks;

    pthread_mutex_t post_mu;
    struct post_item *post_head, *post_tail; /* under post_mu */

    atomic_bool shutdown_asked;
    bool shutting_down;
    bool draining_done;
    uint64_t watchdog_usec;
};

/* A new connection on fd (listen.c calls it): the peer's identity and
 * tenant (tenancy.h), the connection limits. A refused peer gets one error
 * frame and is closed once it is flushed. 0 or KVD_ENOMEM. */
int server_accept(struct server *srv, int fd);

/* Buffer memory released before malloc_trim gives it back to the system,
 * and how long after the release it runs (coalescing many releases). */
#define SERVER_TRIM_MIN ((size_t)4 << 20)
#define SERVER_TRIM_DELAY_MS 200

/* server_conns.c's, for server.c: the callbacks every connection gets,
 * the buffer budget's event (drops the connections buffering most while
 * over max-buffered) and the trim timer's. */
extern const struct conn_cbs server_conn_cbs;
void server_budget_cb(evutil_socket_t fd, short what, void *arg);
void server_trim_cb(evutil_socket_t fd, short what, void *arg);
/* Ends the loop once a drain has finished and no connection is left. */
void server_maybe_exit(struct server *srv);

#endif

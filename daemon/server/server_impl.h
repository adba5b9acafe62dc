/* server internals shared by server.c, conn.c and the ops: the server and
 * connection structs. Everything here runs on the loop thread except the
 * post queue, which has its own mutex. */
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
#include "ops.h"
#include "options.h"
#include "server.h"

#define SERVER_CONN_BUCKETS 1024u

/* One client connection. Owned by the server (in its list and hash) from
 * accept until conn_free; owns its bufferevent and pending-id array. */
struct conn {
    struct conn *prev, *next; /* server's list */
    struct conn *hnext;       /* hash chain by id */
    struct server *srv;
    uint64_t id; /* kvmm owner of its sequences; never has bit 63 set */
    struct bufferevent *bev;

    uid_t uid;
    gid_t gid;
    pid_t pid;
    uint32_t tenant, ns;
    char tenant_name[KVD_MAX_NAME + 1];
    bool admin;

    /* Ids of requests in flight elsewhere (a client may reuse an id): an
     * open-addressing table of (id, count), load at most 1/2, so a final
     * reply finds its id in O(1) however deep the pipeline. */
    struct conn_pend *pending; /* (cap_pending) */
    size_t n_pending;          /* requests (sum of counts) */
    size_t n_pend_ids, cap_pending;

    bool paused;  /* reading stopped: output over the high watermark */
    bool overflow; /* unread output passed max-unread-output: generates ended */
    size_t buffered; /* bytes in its input and output buffers */
    struct evbuffer_cb_entry *in_cb, *out_cb;
    bool closing; /* no more input; freed once output is flushed */
};

struct conn_pend {
    uint64_t id;
    uint32_t count; /* 0: empty slot */
};

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
    struct event *ev_term, *ev_int, *ev_hup, *ev_post, *ev_shutdown, *ev_watchdog,
        *ev_drain, *ev_accept;

    struct options opts;
    struct config cfg; /* replaced on SIGHUP */
    char config_path[4096];
    struct kvmm *mm;    /* not owned */
    struct backend *be; /* not owned */
    struct ops_table ops;
    struct ops_host host; /* what the handlers read of the server (ops.h) */
    struct server_model_info model; /* host.model points here in serve mode */

    char socket_path[108];
    bool own_socket; /* we created socket_path: unlink it at exit */
    bool activated;  /* socket came from systemd */

    struct conn *conns; /* list of live connections */
    struct conn *buckets[SERVER_CONN_BUCKETS];
    size_t n_conns;
    uint64_t next_conn_id;
    size_t n_pending; /* requests in flight on all connections */
    size_t out_high;  /* bytes of queued output above which reading pauses */
    size_t buffered;  /* every connection's input + output bytes (max-buffered) */
    size_t freed_since_trim; /* buffer bytes released since the last malloc_trim */
    struct event *ev_budget, *ev_trim;
    uint64_t n_dropped; /* connections dropped over max-buffered */
    server_abort_fn abort_fn;
    void *abort_ctx;

    /* Replies of the connection being processed (out_conn), sent in one
     * write when conn_process() is done with its input; empty otherwise. */
    msgpack_sbuffer out;
    struct conn *out_conn;
    msgpack_zone *zone; /* objects of the request being dispatched; cleared after each */


    struct server_tenant *tenants; /* (n_tenants) every tenant seen, for stats */
    size_t n_tenants;

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

/* conn.c */
int conn_accept(struct server *srv, int fd);
void conn_free(struct conn *c);
struct conn *conn_find(struct server *srv, uint64_t id);
/* Appends an error frame to the connection's output. */
void conn_send_error(struct conn *c, uint64_t id, int code, const char *msg);
/* Appends raw bytes (complete frames) to the output. */
int conn_send(struct conn *c, const void *data, size_t len);
/* Stops reading; the connection is freed once its output is flushed. */
void conn_close_after_flush(struct conn *c);
/* Processes complete frames already buffered (after a pause or at shutdown). */
void conn_process(struct conn *c);
bool conn_pending_remove(struct conn *c, uint64_t req_id);
/* Some id in flight on c (false when none). */
bool conn_pending_any(const struct conn *c, uint64_t *req_id);

/* server.c */
/* Registers a tenant name seen on a connection (for admin stats). */
int server_tenant_note(struct server *srv, const char *name, uint32_t id);
/* A connection's buffers changed size (conn.c's evbuffer callbacks). */
void server_buffered_changed(struct server *srv, size_t added, size_t deleted);
/* Adds delta to the tenant's requests in flight. */
void server_tenant_pending(struct server *srv, uint32_t tenant, long delta);
/* Exits the loop once shutdown has drained everything. */
void server_maybe_exit(struct server *srv);

#endif

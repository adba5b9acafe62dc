/* server: the event loop, signals, sd_notify (READY/RELOADING/STOPPING/
 * WATCHDOG), the cross-thread post queue, close/drain hooks, SIGHUP reload
 * and the SIGTERM drain. The listener is listen.c's, tenants tenancy.c's,
 * and what a connection asks of its owner (accepting a peer, running its
 * requests, the buffer budget, closing) server_conns.c's; connections
 * themselves live in conn.c. */
#include "models.h"
#include "server_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/thread.h>
#include <systemd/sd-daemon.h>

#include "fault.h"
#include "listen.h"
#include "kvd/protocol.h"
#include "log.h"
#include "proto.h"

/* How long SIGTERM waits for in-flight requests before answering them
 * `cancelled` itself. */
#define SERVER_DRAIN_TIMEOUT_S 10
#define SERVER_OUT_HIGH_MIN ((size_t)64 << 20)
/* Frames posted by the executor up to this size are copied into the
 * connection's output buffer (packed with the others) and freed at once;
 * larger ones are handed over without a copy. */
#define SERVER_POST_COPY_MAX (64u << 10)

const char *server_socket_path(const struct server *srv)
{
    return srv->socket_path;
}

void server_attach_obs(struct server *srv, struct roofline *rl, struct acct *acct)
{
    srv->obs.rl = rl;
    srv->obs.acct = acct;
    tenancy_set_acct(srv->tenancy, acct);
}

void server_attach_kvevents(struct server *srv, struct kvevents *const *ev, size_t n)
{
    srv->obs.kvevents = ev;
    srv->obs.n_kvevents = ev ? n : 0;
}

void server_attach_prefetch(struct server *srv, struct workpool *wp)
{
    srv->obs.prefetch = wp;
}

void server_get_obs(struct server *srv, struct server_obs *out)
{
    *out = srv->obs;
}

struct event_base *server_event_base(struct server *srv)
{
    return srv->base;
}

const struct config *server_config(const struct server *srv)
{
    return &srv->cfg;
}

const struct options *server_options(const struct server *srv)
{
    return &srv->opts;
}

int server_set_models(struct server *srv, struct models *ms)
{
    srv->models = ms;
    srv->host.models = ms;
    srv->obs.models = ms;
    /* every model's kvmm learns the tenants the first one assigns */
    for (size_t i = 1; i < models_count(ms); i++) {
        int rc = tenancy_add_pool(srv->tenancy, models_kvmm(models_at(ms, i)));
        if (rc)
            return rc;
    }
    return 0;
}

static void host_shutdown(void *ctx)
{
    server_shutdown(ctx);
}

uint64_t server_new_id(struct server *srv)
{
    return ++srv->next_conn_id;
}

void server_count_http_auth_failure(struct server *srv)
{
    srv->n_http_auth_failed++;
}

int server_op_register(struct server *srv, const char *op, ops_fn fn, void *ctx, unsigned flags)
{
    return ops_table_set(&srv->ops, op, fn, ctx, flags);
}

static int hook_add(struct server_hook **v, size_t *n, void (*fn)(void *, uint64_t), void *ctx)
{
    struct server_hook *nv = realloc(*v, (*n + 1) * sizeof(*nv));
    if (!nv)
        return KVD_ENOMEM;
    nv[*n].fn = fn;
    nv[*n].ctx = ctx;
    *v = nv;
    (*n)++;
    return 0;
}

int server_on_close(struct server *srv, server_close_fn fn, void *ctx)
{
    return hook_add(&srv->close_hooks, &srv->n_close_hooks, fn, ctx);
}

/* Drain hooks are stored with the close-hook signature; the id is unused. */
struct drain_wrap {
    server_drain_fn fn;
    void *ctx;
};

static void drain_call(void *arg, uint64_t unused)
{
    struct drain_wrap *w = arg;
    w->fn(w->ctx);
}

int server_on_drain(struct server *srv, server_drain_fn fn, void *ctx)
{
    struct drain_wrap *w = malloc(sizeof(*w));
    if (!w)
        return KVD_ENOMEM;
    w->fn = fn;
    w->ctx = ctx;
    int rc = hook_add(&srv->drain_hooks, &srv->n_drain_hooks, drain_call, w);
    if (rc)
        free(w);
    return rc;
}

struct tenancy *server_tenancy(struct server *srv)
{
    return srv->tenancy;
}

void server_tenant_pending(struct server *srv, uint32_t tenant, long delta)
{
    tenancy_pending(srv->tenancy, tenant, delta);
}

int server_on_abort(struct server *srv, server_abort_fn fn, void *ctx)
{
    srv->abort_fn = fn;
    srv->abort_ctx = ctx;
    return 0;
}

/* ---- post queue ----------------------------------------------------------- */

static struct conn *conn_find(struct server *srv, uint64_t id)
{
    for (struct conn *c = srv->buckets[id % SERVER_CONN_BUCKETS]; c; c = c->hnext)
        if (c->id == id)
            return c;
    return NULL;
}

int server_post(struct server *srv, uint64_t conn_id, uint64_t req_id, unsigned flags, void *frame,
                size_t len)
{
    struct post_item *it = malloc(sizeof(*it));
    if (!it) {
        free(frame);
        return KVD_ENOMEM;
    }
    *it = (struct post_item){NULL, conn_id, req_id, flags, frame, len};
    pthread_mutex_lock(&srv->post_mu);
    if (srv->post_tail)
        srv->post_tail->next = it;
    else
        srv->post_head = it;
    srv->post_tail = it;
    pthread_mutex_unlock(&srv->post_mu);
    event_active(srv->ev_post, EV_READ, 0);
    return 0;
}

static void free_frame_cb(const void *data, size_t len, void *arg)
{
    free((void *)data);
}

static void post_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    pthread_mutex_lock(&srv->post_mu);
    struct post_item *it = srv->post_head;
    srv->post_head = srv->post_tail = NULL;
    pthread_mutex_unlock(&srv->post_mu);

    while (it) {
        struct post_item *next = it->next;
        struct conn *c = conn_find(srv, it->conn_id);
        bool sent = false;
        /* A connection closing after EOF still gets its last replies. */
        if (c && (!c->closing || (it->flags & SERVER_POST_FINAL))) {
            struct evbuffer *out = bufferevent_get_output(c->bev);
            if (it->len <= SERVER_POST_COPY_MAX) {
                /* Packed into the buffer's chunks: a token event costs its
                 * ~30 bytes, not a block of its own. */
                if (evbuffer_add(out, it->frame, it->len) == 0) {
                    free(it->frame);
                    it->frame = NULL;
                    sent = true;
                }
            } else {
                sent = evbuffer_add_reference(out, it->frame, it->len, free_frame_cb, NULL) == 0;
            }
            size_t unread = evbuffer_get_length(out);
            if (!c->overflow && unread > srv->opts.max_unread_output && !c->closing) {
                /* The client does not read what it asked for: end its
                 * generates (they would only grow the buffer) and take
                 * none until it has read. */
                char msg[160];
                c->overflow = true;
                snprintf(msg, sizeof(msg),
                         "the client did not read its output: %zu bytes unread, over "
                         "max-unread-output (%llu)",
                         unread, (unsigned long long)srv->opts.max_unread_output);
                log_msg(LOG_LVL_NOTICE, "conn %llu (uid %u): %s; ending its generates",
                        (unsigned long long)c->id, (unsigned)c->uid, msg);
                if (srv->abort_fn)
                    srv->abort_fn(srv->abort_ctx, c->id, KVD_EBUSY, msg);
            }
        }
        if (!sent)
            free(it->frame);
        if (c && (it->flags & SERVER_POST_FINAL))
            conn_pending_remove(c, it->req_id);
        free(it);
        it = next;
    }
    server_maybe_exit(srv);
}

/* ---- shutdown ------------------------------------------------------------- */

/* Exits the loop once shutdown has drained everything. */
void server_maybe_exit(struct server *srv)
{
    if (!srv->shutting_down || srv->n_pending > 0)
        return;
    if (!srv->draining_done) {
        /* Everything is answered: close every connection once its output
         * has been read. */
        srv->draining_done = true;
        for (struct conn *c = srv->conns, *next; c; c = next) {
            next = c->next;
            conn_close_after_flush(c);
        }
    }
    if (srv->n_conns == 0)
        event_base_loopexit(srv->base, NULL);
}

static void drain_timeout_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    for (struct conn *c = srv->conns; c; c = c->next) {
        uint64_t id;
        while (conn_pending_any(c, &id)) {
            conn_send_error(c, id, KVD_ECANCELLED, "the server is shutting down");
            conn_pending_remove(c, id);
        }
    }
    log_warn("drain: requests still running after %d s were answered 'cancelled'",
             SERVER_DRAIN_TIMEOUT_S);
    server_maybe_exit(srv);
}

static void begin_shutdown(struct server *srv, const char *why)
{
    if (srv->shutting_down)
        return;
    srv->shutting_down = true;
    srv->cenv.no_read = true;
    sd_notify(0, "STOPPING=1\nSTATUS=draining");
    log_notice("%s: stopping (%zu connections, %zu requests in flight)", why, srv->n_conns,
               srv->n_pending);
    listen_stop(srv);
    for (struct conn *c = srv->conns; c; c = c->next) {
        if (c->closing)
            continue;
        bufferevent_disable(c->bev, EV_READ);
        /* Requests already received but held back by a full output buffer
         * are answered `cancelled` (dispatch refuses new work now). */
        if (c->paused) {
            c->paused = false;
            conn_process(c);
        }
    }
    for (size_t i = 0; i < srv->n_drain_hooks; i++)
        srv->drain_hooks[i].fn(srv->drain_hooks[i].ctx, 0);
    if (srv->n_pending > 0) {
        struct timeval tv = {SERVER_DRAIN_TIMEOUT_S, 0};
        evtimer_add(srv->ev_drain, &tv);
    }
    server_maybe_exit(srv);
}

void server_shutdown(struct server *srv)
{
    atomic_store(&srv->shutdown_asked, true);
    event_active(srv->ev_shutdown, EV_READ, 0);
}

static void shutdown_cb(evutil_socket_t fd, short what, void *arg)
{
    begin_shutdown(arg, "shutdown requested");
}

/* ---- SIGHUP reload -------------------------------------------------------- */

static void reload(struct server *srv)
{
    struct kvd_error err;
    struct config nc;

    sd_notify(0, "RELOADING=1");
    if (!srv->config_path[0]) {
        log_notice("SIGHUP: no --config file; nothing to reload");
        sd_notify(0, "READY=1");
        return;
    }
    if (config_defaults(&nc) != 0) {
        log_err("SIGHUP: out of memory");
        sd_notify(0, "READY=1");
        return;
    }
    if (config_load(srv->config_path, &nc, NULL, &err) != 0) {
        log_err("SIGHUP: %s; keeping the previous configuration", err.message);
        config_free(&nc);
        sd_notify(0, "READY=1");
        return;
    }
    config_free(&srv->cfg);
    srv->cfg = nc;

    /* New limits for every tenant seen so far; a tenant the file no longer
     * names falls back to the [limits] defaults. */
    tenancy_reload(srv->tenancy, &srv->cfg);

    /* Admin rights follow the new file at once; a peer the file now refuses
     * is disconnected. A peer keeps the tenant it connected as. */
    for (struct conn *c = srv->conns, *next; c; c = next) {
        next = c->next;
        struct config_identity ident;
        struct kvd_error e;
        if (c->closing)
            continue;
        if (tenancy_resolve_peer(&srv->cfg, c->uid, c->gid, &ident, &e) != 0) {
            kvd_error_set(&e, KVD_EPERM, "uid %u is no longer allowed by the configuration",
                          (unsigned)c->uid);
            conn_send_error(c, 0, KVD_EPERM, e.message);
            conn_close_after_flush(c);
            continue;
        }
        c->admin = ident.admin;
    }
    log_notice("SIGHUP: reloaded %s (%zu tenants configured)", srv->config_path,
               srv->cfg.n_tenants);
    sd_notify(0, "READY=1");
}

static void signal_cb(evutil_socket_t sig, short what, void *arg)
{
    struct server *srv = arg;
    if (sig == SIGHUP)
        reload(srv);
    else
        begin_shutdown(srv, sig == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void watchdog_cb(evutil_socket_t fd, short what, void *arg)
{
    sd_notify(0, "WATCHDOG=1");
}

/* ---- lifetime ------------------------------------------------------------- */

int server_new(const struct options *opts, struct config *cfg, const char *config_path,
               struct kvmm *mm, struct backend *be, struct server **out)
{
    char err[512];
    int rc = KVD_ENOMEM;
    static bool threads_ready;

    if (!threads_ready) {
        /* event_active from the executor thread needs a locking base. */
        if (evthread_use_pthreads() != 0)
            return KVD_EINTERNAL;
        threads_ready = true;
    }
    struct server *srv = calloc(1, sizeof(*srv));
    if (!srv)
        return KVD_ENOMEM;
    srv->opts = *opts;
    srv->mm = mm;
    srv->be = be;
    srv->obs = (struct server_obs){.mm = mm,
                                   .backend = be->ops->name,
                                   .n_conns = &srv->n_conns,
                                   .n_pending = &srv->n_pending,
                                   .n_http_auth_failed = &srv->n_http_auth_failed};
    srv->host = (struct ops_host){.srv = srv,
                                  .mm = mm,
                                  .backend = be->ops->name,
                                  .max_frame = opts->max_frame,
                                  .cfg = &srv->cfg,
                                  .obs = &srv->obs,
                                  .shutdown = host_shutdown,
                                  .ctx = srv};
    snprintf(srv->config_path, sizeof(srv->config_path), "%s", config_path ? config_path : "");
    pthread_mutex_init(&srv->post_mu, NULL);
    msgpack_sbuffer_init(&srv->cenv.out);
    srv->zone = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
    if (!srv->zone)
        goto fail;
    if (tenancy_new(mm, opts->max_sub_tenants, opts->max_queued_per_tenant, &srv->tenancy))
        goto fail;
    srv->obs.tenancy = srv->tenancy;
    /* Queued replies above which a connection's requests stop being read
     * (flow control, so a client that never reads cannot grow the daemon
     * without bound). Clients that write a long pipeline before reading
     * anything must fit their replies in it: at least 64 MiB, and two
     * maximal frames. */
    srv->cenv.out_high = 2 * (size_t)opts->max_frame + 2 * KVD_FRAME_HEADER_BYTES;
    if (srv->cenv.out_high < SERVER_OUT_HIGH_MIN)
        srv->cenv.out_high = SERVER_OUT_HIGH_MIN;
    srv->cenv.cbs = &server_conn_cbs;
    srv->cenv.ctx = srv;
    srv->cenv.max_frame = opts->max_frame;
    srv->cenv.max_unread_output = opts->max_unread_output;

    srv->base = event_base_new();
    if (!srv->base)
        goto fail;
    srv->cenv.base = srv->base;
    srv->ev_term = evsignal_new(srv->base, SIGTERM, signal_cb, srv);
    srv->ev_int = evsignal_new(srv->base, SIGINT, signal_cb, srv);
    srv->ev_hup = evsignal_new(srv->base, SIGHUP, signal_cb, srv);
    srv->ev_post = event_new(srv->base, -1, 0, post_cb, srv);
    srv->ev_shutdown = event_new(srv->base, -1, 0, shutdown_cb, srv);
    srv->ev_drain = evtimer_new(srv->base, drain_timeout_cb, srv);
    srv->ev_budget = event_new(srv->base, -1, 0, server_budget_cb, srv);
    srv->ev_trim = evtimer_new(srv->base, server_trim_cb, srv);
    if (!srv->ev_term || !srv->ev_int || !srv->ev_hup || !srv->ev_post || !srv->ev_shutdown ||
        !srv->ev_drain || !srv->ev_budget || !srv->ev_trim)
        goto fail;
    if (event_add(srv->ev_term, NULL) || event_add(srv->ev_int, NULL) ||
        event_add(srv->ev_hup, NULL))
        goto fail;
    signal(SIGPIPE, SIG_IGN);

    rc = ops_register_builtin(&srv->ops);
    if (rc)
        goto fail;
    rc = listen_start(srv, err, sizeof(err));
    if (rc) {
        log_err("%s", err);
        goto fail;
    }
    /* Taken last: on failure the caller still owns cfg. */
    srv->cfg = *cfg;
    memset(cfg, 0, sizeof(*cfg));
    *out = srv;
    return 0;

fail:
    server_free(srv);
    return rc;
}

int server_run(struct server *srv)
{
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
        struct timeval tv = {(time_t)(usec / 2 / 1000000), (suseconds_t)(usec / 2 % 1000000)};
        srv->ev_watchdog = event_new(srv->base, -1, EV_PERSIST, watchdog_cb, srv);
        if (srv->ev_watchdog)
            event_add(srv->ev_watchdog, &tv);
        srv->watchdog_usec = usec;
        log_info("systemd watchdog: pinging every %llu ms", (unsigned long long)(usec / 2000));
    }
    sd_notifyf(0, "READY=1\nSTATUS=listening on %s", srv->socket_path);
    log_notice("listening on %s (max frame %u bytes)", srv->socket_path, srv->opts.max_frame);
    if (event_base_dispatch(srv->base) < 0) {
        log_err("event loop failed");
        return KVD_EINTERNAL;
    }
    log_notice("stopped");
    return 0;
}

void server_free(struct server *srv)
{
    if (!srv)
        return;
    while (srv->conns)
        conn_free(srv->conns);
    listen_stop(srv);
    struct event *evs[] = {srv->ev_term,  srv->ev_int,      srv->ev_hup,
                           srv->ev_post,  srv->ev_shutdown, srv->ev_watchdog,
                           srv->ev_drain, srv->ev_budget,   srv->ev_trim};
    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
        if (evs[i])
            event_free(evs[i]);
    for (struct post_item *it = srv->post_head, *next; it; it = next) {
        next = it->next;
        free(it->frame);
        free(it);
    }
    if (srv->base)
        event_base_free(srv->base);
    for (size_t i = 0; i < srv->n_drain_hooks; i++)
        free(srv->drain_hooks[i].ctx);
    free(srv->drain_hooks);
    free(srv->close_hooks);
    tenancy_free(srv->tenancy);
    ops_table_free(&srv->ops);
    config_free(&srv->cfg);
    msgpack_sbuffer_destroy(&srv->cenv.out);
    if (srv->zone)
        msgpack_zone_free(srv->zone);
    pthread_mutex_destroy(&srv->post_mu);
    free(srv);
}

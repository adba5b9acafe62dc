/* server: the event loop, the Unix listener (created here, or handed over by
 * systemd), signals, sd_notify (READY/RELOADING/STOPPING/WATCHDOG), the
 * cross-thread post queue, close/drain hooks, SIGHUP reload and the SIGTERM
 * drain; and what a connection asks of its owner: accepting a peer
 * (identity, limits, tenant), running its requests, and releasing what it
 * owned. Connections themselves live in conn.c, which calls back here only
 * through the struct conn_cbs of the server's conn_env. */
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
#include "kvd/protocol.h"
#include "log.h"
#include "proto.h"

/* How long SIGTERM waits for in-flight requests before answering them
 * `cancelled` itself. */
#define SERVER_DRAIN_TIMEOUT_S 10
#define SERVER_OUT_HIGH_MIN ((size_t)64 << 20)
/* Buffer memory released before malloc_trim gives it back to the system,
 * and how long after the release it runs (coalescing many releases). */
#define SERVER_TRIM_MIN ((size_t)4 << 20)
#define SERVER_TRIM_DELAY_MS 200
/* Frames posted by the executor up to this size are copied into the
 * connection's output buffer (packed with the others) and freed at once;
 * larger ones are handed over without a copy. */
#define SERVER_POST_COPY_MAX (64u << 10)
/* How long accepting pauses after accept() fails (out of descriptors). */
#define SERVER_ACCEPT_PAUSE_MS 100

static void server_maybe_exit(struct server *srv);

const char *server_socket_path(const struct server *srv)
{
    return srv->socket_path;
}

void server_attach_obs(struct server *srv, struct roofline *rl, struct acct *acct)
{
    srv->obs.rl = rl;
    srv->obs.acct = acct;
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

void server_set_model(struct server *srv, const struct server_model_info *m)
{
    if (m)
        srv->model = *m;
    srv->host.model = m ? &srv->model : NULL;
}

static void host_shutdown(void *ctx)
{
    server_shutdown(ctx);
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

int server_tenant_note(struct server *srv, const char *name, uint32_t id)
{
    for (size_t i = 0; i < srv->n_tenants; i++)
        if (srv->tenants[i].id == id)
            return 0;
    struct server_tenant *nv = fault_realloc(srv->tenants, (srv->n_tenants + 1) * sizeof(*nv));
    if (!nv)
        return KVD_ENOMEM;
    snprintf(nv[srv->n_tenants].name, sizeof(nv->name), "%s", name);
    nv[srv->n_tenants].id = id;
    nv[srv->n_tenants].n_pending = 0;
    srv->tenants = nv;
    srv->n_tenants++;
    return 0;
}

void server_tenant_pending(struct server *srv, uint32_t tenant, long delta)
{
    for (size_t i = 0; i < srv->n_tenants; i++)
        if (srv->tenants[i].id == tenant) {
            srv->tenants[i].n_pending += (size_t)delta;
            return;
        }
}

int server_on_abort(struct server *srv, server_abort_fn fn, void *ctx)
{
    srv->abort_fn = fn;
    srv->abort_ctx = ctx;
    return 0;
}

/* A connection's buffers changed size. */
static void server_buffered_changed(struct server *srv, size_t added, size_t deleted)
{
    srv->buffered += added;
    srv->buffered -= deleted;
    if (srv->buffered > srv->opts.max_buffered && srv->ev_budget)
        event_active(srv->ev_budget, EV_TIMEOUT, 0);
    if (deleted) {
        srv->freed_since_trim += deleted;
        if (srv->freed_since_trim >= SERVER_TRIM_MIN && srv->ev_trim &&
            !evtimer_pending(srv->ev_trim, NULL)) {
            struct timeval tv = {0, SERVER_TRIM_DELAY_MS * 1000};
            evtimer_add(srv->ev_trim, &tv);
        }
    }
}

/* Over max-buffered: drops the connections buffering most until the total
 * is back under the budget. */
static void budget_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    while (srv->buffered > srv->opts.max_buffered) {
        struct conn *big = NULL;
        for (struct conn *c = srv->conns; c; c = c->next)
            if (!big || c->buffered > big->buffered)
                big = c;
        if (!big || big->buffered == 0)
            break;
        srv->n_dropped++;
        log_msg(LOG_LVL_WARN,
                "conn %llu (uid %u) dropped: %zu bytes buffered (input + output); all "
                "connections hold %zu, over max-buffered (%llu)",
                (unsigned long long)big->id, (unsigned)big->uid, big->buffered, srv->buffered,
                (unsigned long long)srv->opts.max_buffered);
        conn_free(big);
    }
}

/* Gives freed buffer memory back to the system (glibc keeps the heap's top
 * and the memory of large frames otherwise). */
static void trim_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    srv->freed_since_trim = 0;
    malloc_trim(0);
}

int server_queue_admit(struct server *srv, struct conn *c, uint32_t tenant, struct kvd_error *err)
{
    if (c && c->overflow)
        return kvd_error_set(err, KVD_EBUSY,
                             "this connection has over %llu bytes of unread output "
                             "(max-unread-output); read it before sending more",
                             (unsigned long long)srv->opts.max_unread_output);
    if (c && c->n_pending >= srv->opts.max_queued_per_conn)
        return kvd_error_set(err, KVD_EBUSY,
                             "this connection has %zu generates in flight, the limit "
                             "(max-queued-per-connection = %u); read replies before sending more",
                             c->n_pending, srv->opts.max_queued_per_conn);
    for (size_t i = 0; i < srv->n_tenants; i++)
        if (srv->tenants[i].id == tenant &&
            srv->tenants[i].n_pending >= srv->opts.max_queued_per_tenant)
            return kvd_error_set(err, KVD_EBUSY,
                                 "tenant '%s' has %zu generates in flight, the limit "
                                 "(max-queued-per-tenant = %u)",
                                 srv->tenants[i].name, srv->tenants[i].n_pending,
                                 srv->opts.max_queued_per_tenant);
    return 0;
}

/* ---- connections: what conn.c asks of its owner -------------------------- */

static struct conn *conn_find(struct server *srv, uint64_t id)
{
    for (struct conn *c = srv->buckets[id % SERVER_CONN_BUCKETS]; c; c = c->hnext)
        if (c->id == id)
            return c;
    return NULL;
}

/* A request's `tenant` argument: a trusted front end ([front-end] uids)
 * runs it as its sub-tenant "<its tenant>/<tenant>" (registered with the
 * [limits] quotas, its own namespace); anyone else gets permission_denied.
 * Fills who (name into name_buf). 0 or an error with e filled. */
static int server_sub_tenant(struct server *srv, struct conn *c, const msgpack_object *tn,
                             struct ops_caller *who, char *name_buf, struct kvd_error *e)
{
    struct config_identity id;
    char msg[200];
    if (tn->type != MSGPACK_OBJECT_STR)
        return kvd_error_set(e, KVD_EBADREQ, "'tenant' must be a string");
    if (!config_is_frontend(&srv->cfg, c->uid))
        return kvd_error_set(e, KVD_EPERM,
                             "'tenant': uid %u is not a trusted front end ([front-end] uids)",
                             (unsigned)c->uid);
    if (config_resolve_sub(&srv->cfg, c->tenant_name, tn->via.str.ptr, tn->via.str.size, &id, msg,
                           sizeof(msg)))
        return kvd_error_set(e, KVD_EBADREQ, "'tenant': %s", msg);
    char nsname[KVD_MAX_NAME + 16];
    snprintf(nsname, sizeof(nsname), "tenant:%s", id.conf.name);
    kvmm_lock(srv->mm);
    int rc = kvmm_tenant_set(srv->mm, &id.conf, &who->tenant);
    if (rc == 0)
        rc = kvmm_namespace(srv->mm, nsname, &who->ns);
    if (rc)
        kvd_error_set(e, rc, "'tenant' %s: %s", id.conf.name, kvmm_errmsg(srv->mm));
    kvmm_unlock(srv->mm);
    if (rc)
        return rc;
    if (server_tenant_note(srv, id.conf.name, who->tenant) != 0)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    snprintf(name_buf, KVD_MAX_NAME + 1, "%s", id.conf.name);
    who->tenant_name = name_buf;
    who->admin = false;
    return 0;
}

/* Decodes and runs one request whose payload is p[0..len). Returns false
 * when the connection must close (the message could not be parsed). */
static bool conn_dispatch_cb(void *ctx, struct conn *c, const uint8_t *p, size_t len)
{
    struct server *srv = ctx;
    struct proto_msg m;
    struct kvd_error e; /* filled by whatever fails; its 256-byte message
                         * is not zeroed per request */
    int rc;

    e.code = 0;
    e.message[0] = '\0';
    if (proto_msg_parse_in(&m, p, len, srv->zone, &e) != 0) {
        log_info("conn %llu (uid %u): %s; closing", (unsigned long long)c->id, (unsigned)c->uid,
                 e.message);
        conn_send_error(c, 0, e.code, e.message);
        return false;
    }
    uint64_t id;
    const struct ops_entry *ent;
    if ((rc = ops_resolve(&srv->ops, m.root, c->admin, (unsigned)c->uid, &id, &ent, &e))) {
        conn_send_error(c, id, rc, e.message);
        goto out;
    }
    if (srv->shutting_down) {
        conn_send_error(c, id, KVD_ECANCELLED, "the server is shutting down");
        goto out;
    }

    struct ops_caller who = {.conn = c,
                             .conn_id = c->id,
                             .uid = c->uid,
                             .gid = c->gid,
                             .pid = c->pid,
                             .tenant = c->tenant,
                             .ns = c->ns,
                             .tenant_name = c->tenant_name,
                             .admin = c->admin};
    char sub_name[KVD_MAX_NAME + 1];
    const msgpack_object *tn = proto_map_find(m.root, "tenant");
    if (tn && (rc = server_sub_tenant(srv, c, tn, &who, sub_name, &e))) {
        conn_send_error(c, id, rc, e.message);
        goto out;
    }
    if (ops_run(&srv->host, ent, &who, id, m.root, conn_reply_buf(c)) == OPS_PENDING &&
        conn_pending_add(c, id, who.tenant) != 0)
        log_err("conn %llu: out of memory tracking request %llu", (unsigned long long)c->id,
                (unsigned long long)id);
out:
    proto_msg_free(&m);
    return true;
}

static void conn_pending_cb(void *ctx, struct conn *c, uint32_t tenant, long delta)
{
    struct server *srv = ctx;
    srv->n_pending += (size_t)delta;
    server_tenant_pending(srv, tenant, delta);
}

static void conn_buffered_cb(void *ctx, struct conn *c, size_t added, size_t deleted)
{
    server_buffered_changed(ctx, added, deleted);
}

/* However a connection ends: the close hooks (the executor cancels its
 * requests), then its sequences are released, its requests leave the
 * counts and it leaves the list. */
static void conn_closed_cb(void *ctx, struct conn *c)
{
    struct server *srv = ctx;

    for (size_t i = 0; i < srv->n_close_hooks; i++)
        srv->close_hooks[i].fn(srv->close_hooks[i].ctx, c->id);
    kvmm_lock(srv->mm);
    kvmm_close_owner(srv->mm, c->id);
    kvmm_unlock(srv->mm);

    srv->n_pending -= c->n_pending;
    for (size_t i = 0; i < c->cap_pending; i++)
        if (c->pending[i].count)
            server_tenant_pending(srv, c->pending[i].tenant, -(long)c->pending[i].count);
    struct conn **pp = &srv->buckets[c->id % SERVER_CONN_BUCKETS];
    while (*pp != c)
        pp = &(*pp)->hnext;
    *pp = c->hnext;
    if (c->prev)
        c->prev->next = c->next;
    else
        srv->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    srv->n_conns--;
    server_maybe_exit(srv);
}

static const struct conn_cbs server_conn_cbs = {
    .dispatch = conn_dispatch_cb,
    .pending = conn_pending_cb,
    .buffered = conn_buffered_cb,
    .closed = conn_closed_cb,
};

/* A new connection on fd: the peer's identity from SO_PEERCRED, its tenant
 * and admin rights from the config, the connection limits. A refused peer
 * gets one error frame and is closed once it is flushed. */
static int server_accept(struct server *srv, int fd)
{
    struct ucred cred;
    socklen_t clen = sizeof(cred);
    struct config_identity ident;
    char msg[160];

    struct conn *c = conn_new(&srv->cenv, fd, srv->next_conn_id + 1);
    if (!c)
        return KVD_ENOMEM;
    srv->next_conn_id++;
    c->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = c;
    srv->conns = c;
    c->hnext = srv->buckets[c->id % SERVER_CONN_BUCKETS];
    srv->buckets[c->id % SERVER_CONN_BUCKETS] = c;
    srv->n_conns++;

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        log_warn("accept: SO_PEERCRED failed: %s", strerror(errno));
        conn_send_error(c, 0, KVD_EPERM, "cannot identify the peer (SO_PEERCRED)");
        conn_close_after_flush(c);
        return 0;
    }
    c->uid = cred.uid;
    c->gid = cred.gid;
    c->pid = cred.pid;
    if (config_resolve(&srv->cfg, c->uid, c->gid, &ident) != 0) {
        snprintf(msg, sizeof(msg), "uid %u is not allowed by the configuration", (unsigned)c->uid);
        log_notice("conn from pid %d refused: %s", (int)c->pid, msg);
        conn_send_error(c, 0, KVD_EPERM, msg);
        conn_close_after_flush(c);
        return 0;
    }
    /* Connection slots: the last admin-reserved-connections of
     * max-connections are for admins only, and no uid but an admin's may
     * hold more than max-connections-per-uid (issue 14: one tenant could
     * take every slot). */
    uint32_t reserve = srv->opts.admin_reserved_conns < srv->opts.max_conns
                           ? srv->opts.admin_reserved_conns
                           : srv->opts.max_conns - 1;
    size_t same_uid = 0;
    if (!ident.admin)
        for (struct conn *o = srv->conns; o; o = o->next)
            same_uid += o != c && o->uid == c->uid && !o->closing;
    msg[0] = '\0';
    if (srv->n_conns > srv->opts.max_conns)
        snprintf(msg, sizeof(msg), "too many connections (limit %u)", srv->opts.max_conns);
    else if (!ident.admin && srv->n_conns > srv->opts.max_conns - reserve)
        snprintf(msg, sizeof(msg),
                 "too many connections: the last %u of %u are reserved for admins "
                 "(admin-reserved-connections)",
                 reserve, srv->opts.max_conns);
    else if (!ident.admin && same_uid >= srv->opts.max_conns_per_uid)
        snprintf(msg, sizeof(msg),
                 "uid %u already has %zu connections, the limit (max-connections-per-uid)",
                 (unsigned)c->uid, same_uid);
    if (msg[0]) {
        log_warn("conn from uid %u refused: %s", (unsigned)c->uid, msg);
        conn_send_error(c, 0, KVD_EBUSY, msg);
        conn_close_after_flush(c);
        return 0;
    }
    char nsname[KVD_MAX_NAME + 16];
    snprintf(nsname, sizeof(nsname), "tenant:%s", ident.conf.name);
    kvmm_lock(srv->mm);
    int rc = kvmm_tenant_set(srv->mm, &ident.conf, &c->tenant);
    if (rc == 0)
        rc = kvmm_namespace(srv->mm, nsname, &c->ns);
    if (rc)
        snprintf(msg, sizeof(msg), "tenant '%s': %s", ident.conf.name, kvmm_errmsg(srv->mm));
    kvmm_unlock(srv->mm);
    if (rc == 0 && (rc = server_tenant_note(srv, ident.conf.name, c->tenant)) != 0)
        snprintf(msg, sizeof(msg), "tenant '%s': out of memory noting it for stats",
                 ident.conf.name);
    if (rc) {
        log_err("conn from uid %u: %s", (unsigned)c->uid, msg);
        conn_send_error(c, 0, rc, msg);
        conn_close_after_flush(c);
        return 0;
    }
    snprintf(c->tenant_name, sizeof(c->tenant_name), "%s", ident.conf.name);
    c->admin = ident.admin;
    log_debug("conn %llu: pid %d uid %u gid %u tenant %s%s", (unsigned long long)c->id, (int)c->pid,
              (unsigned)c->uid, (unsigned)c->gid, c->tenant_name, c->admin ? " (admin)" : "");
    conn_start(c);
    return 0;
}

/* ---- post queue ----------------------------------------------------------- */

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
static void server_maybe_exit(struct server *srv)
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
    if (srv->listener) {
        evconnlistener_free(srv->listener);
        srv->listener = NULL;
    }
    if (srv->own_socket) {
        unlink(srv->socket_path);
        srv->own_socket = false;
    }
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
    char err[512];
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
    if (config_load(srv->config_path, &nc, NULL, err, sizeof(err)) != 0) {
        log_err("SIGHUP: %s; keeping the previous configuration", err);
        config_free(&nc);
        sd_notify(0, "READY=1");
        return;
    }
    config_free(&srv->cfg);
    srv->cfg = nc;

    /* New limits for every tenant seen so far; a tenant the file no longer
     * names falls back to the [limits] defaults. */
    kvmm_lock(srv->mm);
    for (size_t i = 0; i < srv->n_tenants; i++) {
        struct kvmm_tenant_conf conf = srv->cfg.defaults;
        for (size_t j = 0; j < srv->cfg.n_tenants; j++)
            if (!strcmp(srv->cfg.tenants[j].conf.name, srv->tenants[i].name))
                conf = srv->cfg.tenants[j].conf;
        snprintf(conf.name, sizeof(conf.name), "%s", srv->tenants[i].name);
        uint32_t id;
        if (kvmm_tenant_set(srv->mm, &conf, &id) != 0)
            log_err("SIGHUP: tenant %s: %s", conf.name, kvmm_errmsg(srv->mm));
    }
    kvmm_unlock(srv->mm);

    /* Admin rights follow the new file at once; a peer the file now refuses
     * is disconnected. A peer keeps the tenant it connected as. */
    for (struct conn *c = srv->conns, *next; c; c = next) {
        next = c->next;
        struct config_identity ident;
        if (c->closing)
            continue;
        if (config_resolve(&srv->cfg, c->uid, c->gid, &ident) != 0) {
            char msg[96];
            snprintf(msg, sizeof(msg), "uid %u is no longer allowed by the configuration",
                     (unsigned)c->uid);
            conn_send_error(c, 0, KVD_EPERM, msg);
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

/* ---- listener ------------------------------------------------------------- */

static void accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen,
                      void *arg)
{
    struct server *srv = arg;
    if (server_accept(srv, fd) != 0)
        log_err("accept: out of memory; connection dropped");
}

static void accept_resume_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    if (srv->listener)
        evconnlistener_enable(srv->listener);
}

static void accept_error_cb(struct evconnlistener *l, void *arg)
{
    struct server *srv = arg;
    /* EMFILE, ENFILE, ENOBUFS: the pending connection stays queued and the
     * listener stays readable, so retrying at once would spin. Pause
     * accepting briefly; connections already open keep being served. */
    log_warn("accept: %s; pausing new connections for %d ms", strerror(errno),
             SERVER_ACCEPT_PAUSE_MS);
    evconnlistener_disable(l);
    struct timeval tv = {0, SERVER_ACCEPT_PAUSE_MS * 1000};
    evtimer_add(srv->ev_accept, &tv);
}

/* Binds a new Unix socket at path with mode 0660 (group: opts.socket_group).
 * A stale socket file is removed only if it is a socket and nobody answers
 * on it. */
static int listen_path(struct server *srv, const char *path, int *out_fd, char *err, size_t errlen)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat st;
    int fd = -1;

    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, errlen, "socket path '%s' is too long", path);
        return KVD_EBADREQ;
    }
    strcpy(sa.sun_path, path);
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            snprintf(err, errlen, "'%s' exists and is not a socket; not touching it", path);
            return KVD_EBADREQ;
        }
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
            close(probe);
            snprintf(err, errlen, "another server is listening on '%s'", path);
            return KVD_EBUSY;
        }
        if (probe >= 0)
            close(probe);
        if (unlink(path) != 0) {
            snprintf(err, errlen, "cannot remove stale socket '%s': %s", path, strerror(errno));
            return KVD_EPERM;
        }
        log_info("removed stale socket %s", path);
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return KVD_EINTERNAL;
    }
    /* umask makes the file 0660 from the moment it exists. */
    mode_t old = umask(0117);
    int brc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc != 0) {
        snprintf(err, errlen, "bind %s: %s", path, strerror(errno));
        goto fail;
    }
    if (srv->opts.socket_group[0]) {
        struct group *gr = getgrnam(srv->opts.socket_group);
        if (!gr) {
            snprintf(err, errlen, "socket-group '%s' does not exist", srv->opts.socket_group);
            goto fail_unlink;
        }
        if (chown(path, (uid_t)-1, gr->gr_gid) != 0) {
            snprintf(err, errlen, "chown %s to group %s: %s", path, srv->opts.socket_group,
                     strerror(errno));
            goto fail_unlink;
        }
    }
    if (chmod(path, 0660) != 0 || listen(fd, 128) != 0) {
        snprintf(err, errlen, "listen %s: %s", path, strerror(errno));
        goto fail_unlink;
    }
    *out_fd = fd;
    return 0;

fail_unlink:
    unlink(path);
fail:
    close(fd);
    return KVD_EPERM;
}

/* The default socket: /run/kvd/kvd.sock when /run/kvd is (or can be made)
 * writable, else the per-user fallback, whose directory must be the
 * daemon's own (issue 14: another user could pre-create /tmp/kvd-<uid> and
 * receive the clients' prompts). */
static int pick_default_socket(char *path, size_t cap, char *err, size_t errlen)
{
    if (mkdir(KVD_SOCKET_DIR, 0755) == 0 || errno == EEXIST) {
        if (access(KVD_SOCKET_DIR, W_OK | X_OK) == 0) {
            snprintf(path, cap, "%s", KVD_DEFAULT_SOCKET);
            log_info("socket: %s (default)", path);
            return 0;
        }
    }
    if (proto_socket_fallback(path, cap) != 0) {
        snprintf(err, errlen, "cannot find a place for the socket");
        return KVD_ETOOLARGE;
    }
    char dir[108];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) != 0 && errno != EEXIST)
            log_warn("cannot create %s: %s", dir, strerror(errno));
    }
    char why[400];
    if (proto_socket_path_check(path, geteuid(), true, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "default socket: %s (remove it, or give --socket)", why);
        return KVD_EPERM;
    }
    log_notice("socket: %s (%s is not writable for uid %u)", path, KVD_SOCKET_DIR,
               (unsigned)geteuid());
    return 0;
}

static int setup_listener(struct server *srv, char *err, size_t errlen)
{
    int fd = -1;
    int n = sd_listen_fds(1);

    if (n > 1) {
        snprintf(err, errlen, "systemd passed %d sockets; kvd takes exactly one", n);
        return KVD_EBADREQ;
    }
    if (n == 1) {
        fd = SD_LISTEN_FDS_START;
        if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
            snprintf(err, errlen, "the socket systemd passed is not a listening Unix stream");
            return KVD_EBADREQ;
        }
        evutil_make_socket_nonblocking(fd);
        evutil_make_socket_closeonexec(fd);
        srv->activated = true;
        struct sockaddr_un sa;
        socklen_t sl = sizeof(sa);
        if (getsockname(fd, (struct sockaddr *)&sa, &sl) == 0 && sl > sizeof(sa_family_t))
            snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", sa.sun_path);
        log_info("socket: %s (from systemd)", srv->socket_path);
    } else {
        if (srv->opts.socket_path[0]) {
            snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", srv->opts.socket_path);
        } else {
            int prc = pick_default_socket(srv->socket_path, sizeof(srv->socket_path), err, errlen);
            if (prc)
                return prc;
        }
        int rc = listen_path(srv, srv->socket_path, &fd, err, errlen);
        if (rc)
            return rc;
        srv->own_socket = true;
    }
    srv->listener = evconnlistener_new(srv->base, accept_cb, srv,
                                       LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd);
    if (!srv->listener) {
        close(fd);
        snprintf(err, errlen, "cannot watch the listening socket");
        return KVD_ENOMEM;
    }
    evconnlistener_set_error_cb(srv->listener, accept_error_cb);
    return 0;
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
                                   .tenants = (const struct server_tenant *const *)&srv->tenants,
                                   .n_tenants = &srv->n_tenants};
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
    srv->ev_accept = evtimer_new(srv->base, accept_resume_cb, srv);
    srv->ev_budget = event_new(srv->base, -1, 0, budget_cb, srv);
    srv->ev_trim = evtimer_new(srv->base, trim_cb, srv);
    if (!srv->ev_term || !srv->ev_int || !srv->ev_hup || !srv->ev_post || !srv->ev_shutdown ||
        !srv->ev_drain || !srv->ev_accept || !srv->ev_budget || !srv->ev_trim)
        goto fail;
    if (event_add(srv->ev_term, NULL) || event_add(srv->ev_int, NULL) ||
        event_add(srv->ev_hup, NULL))
        goto fail;
    signal(SIGPIPE, SIG_IGN);

    rc = ops_register_builtin(&srv->ops);
    if (rc)
        goto fail;
    rc = setup_listener(srv, err, sizeof(err));
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
    if (srv->listener)
        evconnlistener_free(srv->listener);
    if (srv->own_socket)
        unlink(srv->socket_path);
    struct event *evs[] = {srv->ev_term,     srv->ev_int,      srv->ev_hup,   srv->ev_post,
                           srv->ev_shutdown, srv->ev_watchdog, srv->ev_drain, srv->ev_accept,
                           srv->ev_budget,   srv->ev_trim};
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
    free(srv->tenants);
    ops_table_free(&srv->ops);
    config_free(&srv->cfg);
    msgpack_sbuffer_destroy(&srv->cenv.out);
    if (srv->zone)
        msgpack_zone_free(srv->zone);
    pthread_mutex_destroy(&srv->post_mu);
    free(srv);
}

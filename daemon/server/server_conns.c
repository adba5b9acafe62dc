/* server_conns: the server's side of its connections (server_impl.h): accepting
 * a peer (identity through tenancy.c, the connection limits), decoding and
 * dispatching each request (a front end's `tenant` argument resolved
 * first), the per-connection and per-tenant queue limits, the daemon-wide
 * buffer budget and giving freed memory back, and what happens when a
 * connection closes. conn.c calls in only through server_conn_cbs. */
#include "models.h"
#include "server_impl.h"

#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fault.h"
#include "kvd/protocol.h"
#include "log.h"
#include "proto.h"
#include "tenancy.h"

/* A connection's buffers changed size. */
/* Buffer bytes were released: malloc_trim gives them back to the system
 * once enough have gone (trim_cb, coalescing many releases). */
static void note_released(struct server *srv, size_t deleted)
{
    if (!deleted)
        return;
    srv->freed_since_trim += deleted;
    if (srv->freed_since_trim >= SERVER_TRIM_MIN && srv->ev_trim &&
        !evtimer_pending(srv->ev_trim, NULL)) {
        struct timeval tv = {0, SERVER_TRIM_DELAY_MS * 1000};
        evtimer_add(srv->ev_trim, &tv);
    }
}

static void server_buffered_changed(struct server *srv, size_t added, size_t deleted)
{
    srv->buffered += added;
    srv->buffered -= deleted;
    if (srv->buffered > srv->opts.max_buffered && srv->ev_budget)
        event_active(srv->ev_budget, EV_TIMEOUT, 0);
    note_released(srv, deleted);
}

void server_http_buffered(struct server *srv, size_t added, size_t deleted)
{
    srv->http_buffered += added;
    srv->http_buffered -= deleted;
    note_released(srv, deleted);
}

bool server_over_buffer_budget(const struct server *srv)
{
    return srv->buffered + srv->http_buffered > srv->opts.max_buffered;
}

/* Over max-buffered: drops the connections buffering most until the total
 * is back under the budget. */
void server_budget_cb(evutil_socket_t fd, short what, void *arg)
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
void server_trim_cb(evutil_socket_t fd, short what, void *arg)
{
    struct server *srv = arg;
    srv->freed_since_trim = 0;
    malloc_trim(0);
}

int server_queue_admit(struct server *srv, struct conn *c, uint32_t tenant, struct kvd_error *err)
{
    return server_queue_admit_n(srv, c, tenant, 1, err);
}

int server_queue_admit_n(struct server *srv, struct conn *c, uint32_t tenant, uint32_t n,
                         struct kvd_error *err)
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
    return tenancy_admit(srv->tenancy, tenant, n, err);
}

/* ---- connections: what conn.c asks of its owner -------------------------- */

/* A request's `tenant` argument: a trusted front end ([front-end] uids)
 * runs it as its sub-tenant "<its tenant>/<tenant>" (tenancy.h); anyone
 * else gets permission_denied. Fills who (name into name_buf). 0 or an
 * error with e filled. */
static int server_sub_tenant(struct server *srv, struct conn *c, const msgpack_object *tn,
                             struct ops_caller *who, char *name_buf, struct kvd_error *e)
{
    struct config_identity id;
    struct tenancy_who tw;
    if (tn->type != MSGPACK_OBJECT_STR)
        return kvd_error_set(e, KVD_EBADREQ, "'tenant' must be a string");
    int rc = tenancy_resolve_sub(&srv->cfg, c->uid, c->tenant_name, tn->via.str.ptr,
                                 tn->via.str.size, "'tenant'", &id, e);
    if (rc == 0)
        rc = tenancy_register_sub(srv->tenancy, c->tenant_name, &id, &tw, e);
    if (rc)
        return rc;
    snprintf(name_buf, KVD_MAX_NAME + 1, "%s", tw.name);
    who->tenant = tw.tenant;
    who->ns = tw.ns;
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
    size_t at = conn_reply_buf(c)->size;
    uint32_t units = 1;
    rc = ops_run(&srv->host, ent, &who, id, m.root, conn_reply_buf(c), &units);
    if (c->reply_fds)
        conn_fds_attach(c, at, rc == 0);
    if (rc == OPS_PENDING && conn_pending_add(c, id, who.tenant, units) != 0)
        log_err("conn %llu: out of memory tracking request %llu", (unsigned long long)c->id,
                (unsigned long long)id);
out:
    proto_msg_free(&m);
    return true;
}

static void conn_pending_cb(void *ctx, struct conn *c, uint32_t tenant, long delta, long units)
{
    struct server *srv = ctx;
    srv->n_pending += (size_t)delta;
    server_tenant_pending(srv, tenant, units);
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
    for (size_t i = 0; i < (srv->models ? models_count(srv->models) : 1); i++) {
        struct kvmm *mm = srv->models ? models_kvmm(models_at(srv->models, i)) : srv->mm;
        kvmm_lock(mm);
        kvmm_close_owner(mm, c->id);
        kvmm_unlock(mm);
    }

    srv->n_pending -= c->n_pending;
    for (size_t i = 0; i < c->cap_pending; i++)
        if (c->pending[i].count)
            server_tenant_pending(srv, c->pending[i].tenant, -(long)c->pending[i].units);
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

const struct conn_cbs server_conn_cbs = {
    .dispatch = conn_dispatch_cb,
    .pending = conn_pending_cb,
    .buffered = conn_buffered_cb,
    .closed = conn_closed_cb,
};

/* A new connection on fd: the peer's identity from SO_PEERCRED, its tenant
 * and admin rights from the config, the connection limits. A refused peer
 * gets one error frame and is closed once it is flushed. */
int server_accept(struct server *srv, int fd)
{
    struct tenancy_cred cred;
    struct config_identity ident;
    struct tenancy_who tw;
    struct kvd_error e;
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

    int rc = tenancy_peer_cred(fd, &cred, &e);
    if (rc) {
        log_warn("accept: %s", e.message);
        goto refuse;
    }
    c->uid = cred.uid;
    c->gid = cred.gid;
    c->pid = cred.pid;
    if ((rc = tenancy_resolve_peer(&srv->cfg, c->uid, c->gid, &ident, &e))) {
        log_notice("conn from pid %d refused: %s", (int)c->pid, e.message);
        goto refuse;
    }
    /* Connection slots: the last admin-reserved-connections of
     * max-connections are for admins only, and no uid but an admin's may
     * hold more than max-connections-per-uid (one tenant could otherwise
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
    if ((rc = tenancy_register(srv->tenancy, &ident, &tw, &e))) {
        log_err("conn from uid %u: %s", (unsigned)c->uid, e.message);
        goto refuse;
    }
    c->tenant = tw.tenant;
    c->ns = tw.ns;
    snprintf(c->tenant_name, sizeof(c->tenant_name), "%s", tw.name);
    c->admin = ident.admin;
    log_debug("conn %llu: pid %d uid %u gid %u tenant %s%s", (unsigned long long)c->id, (int)c->pid,
              (unsigned)c->uid, (unsigned)c->gid, c->tenant_name, c->admin ? " (admin)" : "");
    conn_start(c);
    return 0;

refuse:
    conn_send_error(c, 0, rc, e.message);
    conn_close_after_flush(c);
    return 0;
}

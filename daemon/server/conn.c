/* conn: one client connection: peer identity from SO_PEERCRED, frame
 * decoding from its bufferevent, dispatch to the op table, replies, back-
 * pressure, and teardown that releases everything the connection owned. */
#include "server_impl.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>

#include "kvd/protocol.h"
#include "fault.h"
#include "log.h"
#include "proto.h"

/* How long a closing connection may take to read what is left for it. */
#define CONN_FLUSH_TIMEOUT_S 10
/* Replies at least this large are handed to libevent without a copy. */
#define CONN_ZEROCOPY_MIN (64u << 10)
/* Batched replies are written once they reach this many bytes, even if more
 * requests are buffered (bounds the scratch buffer and the first reply's
 * wait). */
#define CONN_BATCH_BYTES (64u << 10)
/* Most bytes libevent reads from a socket per read callback (its default is
 * 16 KiB: a deep pipeline of small requests would take many loop passes). */
#define CONN_READ_MAX (256 << 10)
/* The scratch reply buffer is freed after a flush when it grew past this. */
#define CONN_SCRATCH_KEEP (4u << 20)

static void conn_read_cb(struct bufferevent *bev, void *arg);

/* Every change of a connection's input or output buffer: the daemon-wide
 * buffer budget (max-buffered) and the unread-output state. */
static void conn_buf_cb(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg)
{
    struct conn *c = arg;
    c->buffered += info->n_added;
    c->buffered -= info->n_deleted;
    if (c->overflow && info->n_deleted && buf == bufferevent_get_output(c->bev) &&
        evbuffer_get_length(buf) <= c->srv->opts.max_unread_output / 2)
        c->overflow = false; /* it reads again: generates are taken again */
    server_buffered_changed(c->srv, info->n_added, info->n_deleted);
}
static void conn_write_cb(struct bufferevent *bev, void *arg);
static void conn_event_cb(struct bufferevent *bev, short what, void *arg);

struct conn *conn_find(struct server *srv, uint64_t id)
{
    for (struct conn *c = srv->buckets[id % SERVER_CONN_BUCKETS]; c; c = c->hnext)
        if (c->id == id)
            return c;
    return NULL;
}

int conn_send(struct conn *c, const void *data, size_t len)
{
    if (evbuffer_add(bufferevent_get_output(c->bev), data, len) != 0)
        return KVD_ENOMEM;
    return 0;
}

void conn_send_error(struct conn *c, uint64_t id, int code, const char *msg)
{
    if (c->srv->out_conn == c) {
        /* Inside conn_process: behind the replies batched so far, so the
         * client sees them in request order. */
        msgpack_sbuffer *out = &c->srv->out;
        size_t mark = out->size;
        if (proto_frame_error(out, id, code, msg) != 0)
            out->size = mark;
        return;
    }
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    if (proto_frame_error(&sb, id, code, msg) == 0)
        conn_send(c, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
}

void conn_close_after_flush(struct conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    bufferevent_disable(c->bev, EV_READ);
    struct timeval tv = {CONN_FLUSH_TIMEOUT_S, 0};
    bufferevent_set_timeouts(c->bev, NULL, &tv);
    /* The write callback now fires only when the output is empty. */
    bufferevent_setwatermark(c->bev, EV_WRITE, 0, 0);
    /* Never freed synchronously (callers still hold c): the deferred write
     * callback frees it once the output is empty. */
    bufferevent_enable(c->bev, EV_WRITE);
    bufferevent_trigger(c->bev, EV_WRITE, BEV_TRIG_IGNORE_WATERMARKS | BEV_TRIG_DEFER_CALLBACKS);
}

static size_t pend_slot(uint64_t id, size_t cap)
{
    uint64_t h = id * 0x9e3779b97f4a7c15ull;
    return (size_t)(h ^ (h >> 32)) & (cap - 1);
}

static size_t pend_find(const struct conn *c, uint64_t id)
{
    size_t i = pend_slot(id, c->cap_pending);
    while (c->pending[i].count && c->pending[i].id != id)
        i = (i + 1) & (c->cap_pending - 1);
    return i;
}

static int pend_grow(struct conn *c)
{
    size_t cap = c->cap_pending ? 2 * c->cap_pending : 16;
    struct conn_pend *nv = fault_realloc(NULL, cap * sizeof(*nv));
    if (!nv)
        return KVD_ENOMEM;
    memset(nv, 0, cap * sizeof(*nv));
    struct conn_pend *old = c->pending;
    size_t old_cap = c->cap_pending;
    c->pending = nv;
    c->cap_pending = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].count)
            c->pending[pend_find(c, old[i].id)] = old[i];
    free(old);
    return 0;
}

static int pending_add(struct conn *c, uint64_t id)
{
    if (2 * (c->n_pend_ids + 1) > c->cap_pending && pend_grow(c) != 0)
        return KVD_ENOMEM;
    size_t i = pend_find(c, id);
    if (!c->pending[i].count) {
        c->pending[i].id = id;
        c->n_pend_ids++;
    }
    c->pending[i].count++;
    c->n_pending++;
    c->srv->n_pending++;
    server_tenant_pending(c->srv, c->tenant, 1);
    return 0;
}

bool conn_pending_remove(struct conn *c, uint64_t req_id)
{
    if (!c->cap_pending)
        return false;
    size_t i = pend_find(c, req_id), mask = c->cap_pending - 1;
    if (!c->pending[i].count)
        return false;
    c->n_pending--;
    c->srv->n_pending--;
    server_tenant_pending(c->srv, c->tenant, -1);
    if (--c->pending[i].count)
        return true;
    /* Backward-shift deletion keeps every probe run unbroken. */
    c->n_pend_ids--;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!c->pending[j].count)
            break;
        size_t k = pend_slot(c->pending[j].id, c->cap_pending);
        /* j's entry may move to i when its home k is not in (i, j]. */
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
            c->pending[i] = c->pending[j];
            i = j;
        }
    }
    c->pending[i].count = 0;
    return true;
}

bool conn_pending_any(const struct conn *c, uint64_t *req_id)
{
    for (size_t i = 0; i < c->cap_pending; i++)
        if (c->pending[i].count) {
            *req_id = c->pending[i].id;
            return true;
        }
    return false;
}

/* arg: the start of the malloc'd buffer (data may point into it). */
static void free_frame_cb(const void *data, size_t len, void *arg)
{
    free(arg);
}

/* Sends the frames batched in srv->out and empties it. When nothing is
 * queued in libevent they go straight to the socket: no copy into the
 * bufferevent and no write event to arm and disarm (two epoll_ctl per loop
 * pass). Only what the socket cannot take now is queued, large remainders
 * without a copy (a kv_read reply can be max_frame bytes). A failed send is
 * left to libevent's own write, which reports it through conn_event_cb. */
static void flush_out(struct conn *c)
{
    msgpack_sbuffer *sb = &c->srv->out;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    size_t off = 0;

    if (sb->size == 0)
        return;
    if (evbuffer_get_length(out) == 0) {
        ssize_t n;
        do
            n = send(bufferevent_getfd(c->bev), sb->data, sb->size, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        if (n > 0)
            off = (size_t)n;
    }
    if (off == sb->size) {
        sb->size = 0;
    } else if (sb->size - off >= CONN_ZEROCOPY_MIN) {
        size_t n = sb->size;
        char *data = msgpack_sbuffer_release(sb);
        if (evbuffer_add_reference(out, data + off, n - off, free_frame_cb, data) != 0) {
            free(data);
            log_err("conn %llu: out of memory queueing a reply; closing",
                    (unsigned long long)c->id);
            conn_close_after_flush(c);
        }
    } else {
        if (conn_send(c, sb->data + off, sb->size - off) != 0) {
            log_err("conn %llu: out of memory queueing a reply; closing",
                    (unsigned long long)c->id);
            conn_close_after_flush(c);
        }
        sb->size = 0;
    }
    /* A big scratch buffer is not kept around between batches. */
    if (sb->alloc > CONN_SCRATCH_KEEP) {
        msgpack_sbuffer_destroy(sb);
        msgpack_sbuffer_init(sb);
    }
}

/* Decodes and runs one request whose payload is p[0..len). Returns false
 * when the connection must close (the message could not be parsed). */
static bool dispatch(struct conn *c, const uint8_t *p, size_t len)
{
    struct server *srv = c->srv;
    struct proto_msg m;
    struct proto_err e; /* filled by whatever fails; its 256-byte message
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

    struct ops_caller who = {.conn = c, .conn_id = c->id, .uid = c->uid, .gid = c->gid,
                             .pid = c->pid, .tenant = c->tenant, .ns = c->ns,
                             .tenant_name = c->tenant_name, .admin = c->admin};
    if (ops_run(&srv->host, ent, &who, id, m.root, &srv->out) == OPS_PENDING &&
        pending_add(c, id) != 0)
        log_err("conn %llu: out of memory tracking request %llu", (unsigned long long)c->id,
                (unsigned long long)id);
out:
    proto_msg_free(&m);
    return true;
}

/* After each request: writes the batch once it is big, and applies flow
 * control. Returns true when reading must stop for now. */
static bool after_request(struct conn *c, struct evbuffer *out)
{
    struct server *srv = c->srv;
    if (!c->closing && srv->out.size >= CONN_BATCH_BYTES)
        flush_out(c);
    if (c->closing)
        return true;
    if (evbuffer_get_length(out) + srv->out.size > srv->out_high) {
        flush_out(c);
        /* The client is not reading its replies: stop reading its requests
         * until the output drains (conn_write_cb). */
        c->paused = true;
        bufferevent_disable(c->bev, EV_READ);
        log_debug("conn %llu: %zu bytes of replies queued; reading paused",
                  (unsigned long long)c->id, evbuffer_get_length(out));
        return true;
    }
    return false;
}

/* Dispatches the whole frames lying in the first contiguous piece of the
 * input, decoded in place, and drains them together. Returns false when the
 * connection must close (a message could not be parsed). */
static bool process_contiguous(struct conn *c, struct evbuffer *in, struct evbuffer *out,
                               size_t *used)
{
    struct evbuffer_iovec v;
    size_t n = 0;
    bool keep = true;

    *used = 0;
    if (evbuffer_peek(in, -1, NULL, &v, 1) < 1)
        return true;
    const uint8_t *base = v.iov_base;
    while (v.iov_len - *used >= KVD_FRAME_HEADER_BYTES &&
           proto_frame_peek(base + *used, v.iov_len - *used, c->srv->opts.max_frame, &n) ==
               PROTO_FRAME_READY) {
        keep = dispatch(c, base + *used + KVD_FRAME_HEADER_BYTES, n);
        *used += KVD_FRAME_HEADER_BYTES + n;
        if (!keep || after_request(c, out))
            break;
    }
    if (*used)
        evbuffer_drain(in, *used);
    return keep;
}

static void process_input(struct conn *c)
{
    struct server *srv = c->srv;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    struct evbuffer *out = bufferevent_get_output(c->bev);

    while (!c->closing && !c->paused) {
        size_t used;
        if (!process_contiguous(c, in, out, &used)) {
            conn_close_after_flush(c);
            return;
        }
        if (used)
            continue;
        /* The next frame is not whole in the first piece (it straddles
         * libevent's chunks, is incomplete, or is bad): one at a time. */
        uint8_t hdr[KVD_FRAME_HEADER_BYTES];
        size_t avail = evbuffer_get_length(in), n = 0;
        if (avail < sizeof(hdr))
            return;
        evbuffer_copyout(in, hdr, sizeof(hdr));
        switch (proto_frame_peek(hdr, avail, srv->opts.max_frame, &n)) {
        case PROTO_FRAME_NEED_MORE:
            return;
        case PROTO_FRAME_EMPTY:
            conn_send_error(c, 0, KVD_EBADREQ, "zero-length frame");
            conn_close_after_flush(c);
            return;
        case PROTO_FRAME_TOO_LARGE: {
            char msg[128];
            snprintf(msg, sizeof(msg), "frame of %zu bytes is over max_frame (%u bytes)", n,
                     srv->opts.max_frame);
            conn_send_error(c, 0, KVD_ETOOLARGE, msg);
            conn_close_after_flush(c);
            return;
        }
        case PROTO_FRAME_READY:
            break;
        }
        const uint8_t *p = evbuffer_pullup(in, (ev_ssize_t)(sizeof(hdr) + n));
        if (!p) {
            conn_send_error(c, 0, KVD_ENOMEM, "out of memory receiving a frame");
            conn_close_after_flush(c);
            return;
        }
        bool keep = dispatch(c, p + sizeof(hdr), n);
        evbuffer_drain(in, sizeof(hdr) + n);
        if (!keep) {
            conn_close_after_flush(c);
            return;
        }
        after_request(c, out);
    }
}

void conn_process(struct conn *c)
{
    struct server *srv = c->srv;
    /* Replies are batched in srv->out and sent once the input is used up.
     * Not expected to nest; if it does, the outer batch goes first. */
    struct conn *outer = srv->out_conn;
    if (outer)
        flush_out(outer);
    srv->out_conn = c;
    process_input(c);
    flush_out(c);
    srv->out_conn = outer;
}

static void conn_read_cb(struct bufferevent *bev, void *arg)
{
    conn_process(arg);
}

static void conn_write_cb(struct bufferevent *bev, void *arg)
{
    struct conn *c = arg;
    if (c->closing) {
        if (evbuffer_get_length(bufferevent_get_output(bev)) == 0)
            conn_free(c);
        return;
    }
    if (c->paused) {
        c->paused = false;
        if (!c->srv->shutting_down)
            bufferevent_enable(bev, EV_READ);
        conn_process(c);
    }
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg)
{
    struct conn *c = arg;
    if (what & BEV_EVENT_EOF) {
        if (!c->closing) {
            conn_process(c); /* whole frames that arrived with the EOF */
            size_t left = evbuffer_get_length(bufferevent_get_input(bev));
            if (!c->closing && left > 0) {
                /* The peer may have shut down only its write side and still
                 * read: tell it why its last request got no answer. */
                char msg[128];
                snprintf(msg, sizeof(msg),
                         "truncated frame: connection closed after %zu bytes of it", left);
                conn_send_error(c, 0, KVD_EBADREQ, msg);
            }
            conn_close_after_flush(c);
        }
        return;
    }
    /* An error (reset, broken pipe) or the flush timeout: nothing more can be
     * delivered. */
    conn_free(c);
}

void conn_free(struct conn *c)
{
    struct server *srv = c->srv;

    /* Hooks first, so the executor stops touching the sequences before they
     * are released. */
    for (size_t i = 0; i < srv->n_close_hooks; i++)
        srv->close_hooks[i].fn(srv->close_hooks[i].ctx, c->id);
    kvmm_lock(srv->mm);
    kvmm_close_owner(srv->mm, c->id);
    kvmm_unlock(srv->mm);

    srv->n_pending -= c->n_pending;
    server_tenant_pending(srv, c->tenant, -(long)c->n_pending);
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
    log_debug("conn %llu (uid %u) closed", (unsigned long long)c->id, (unsigned)c->uid);
    if (c->in_cb)
        evbuffer_remove_cb_entry(bufferevent_get_input(c->bev), c->in_cb);
    if (c->out_cb)
        evbuffer_remove_cb_entry(bufferevent_get_output(c->bev), c->out_cb);
    server_buffered_changed(srv, 0, c->buffered);
    bufferevent_free(c->bev);
    free(c->pending);
    free(c);
    server_maybe_exit(srv);
}

int conn_accept(struct server *srv, int fd)
{
    struct ucred cred;
    socklen_t clen = sizeof(cred);
    struct config_identity ident;
    struct conn *c = calloc(1, sizeof(*c));
    char msg[160];

    if (!c) {
        close(fd);
        return KVD_ENOMEM;
    }
    c->bev = bufferevent_socket_new(srv->base, fd, BEV_OPT_CLOSE_ON_FREE);
    if (!c->bev) {
        close(fd);
        free(c);
        return KVD_ENOMEM;
    }
    c->srv = srv;
    c->id = ++srv->next_conn_id;
    c->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = c;
    srv->conns = c;
    c->hnext = srv->buckets[c->id % SERVER_CONN_BUCKETS];
    srv->buckets[c->id % SERVER_CONN_BUCKETS] = c;
    srv->n_conns++;
    bufferevent_setcb(c->bev, conn_read_cb, conn_write_cb, conn_event_cb, c);
    c->in_cb = evbuffer_add_cb(bufferevent_get_input(c->bev), conn_buf_cb, c);
    c->out_cb = evbuffer_add_cb(bufferevent_get_output(c->bev), conn_buf_cb, c);
    bufferevent_setwatermark(c->bev, EV_WRITE, srv->out_high / 2, 0);
    bufferevent_set_max_single_read(c->bev, CONN_READ_MAX);

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
    bufferevent_enable(c->bev, EV_READ | EV_WRITE);
    return 0;
}

/* conn: one client connection: frame decoding from its bufferevent,
 * batched replies, back-pressure, the ids in flight, and teardown (see
 * conn.h). What to do with a request, and what the connection owned
 * elsewhere, are its owner's: through the callbacks of its conn_env. */
#include "conn.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/buffer.h>

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
        evbuffer_get_length(buf) <= c->env->max_unread_output / 2)
        c->overflow = false; /* it reads again: generates are taken again */
    c->env->cbs->buffered(c->env->ctx, c, info->n_added, info->n_deleted);
}
static void conn_write_cb(struct bufferevent *bev, void *arg);
static void conn_event_cb(struct bufferevent *bev, short what, void *arg);

msgpack_sbuffer *conn_reply_buf(struct conn *c)
{
    return &c->env->out;
}

int conn_send(struct conn *c, const void *data, size_t len)
{
    if (evbuffer_add(bufferevent_get_output(c->bev), data, len) != 0)
        return KVD_ENOMEM;
    return 0;
}

void conn_send_error(struct conn *c, uint64_t id, int code, const char *msg)
{
    if (c->env->out_conn == c) {
        /* Inside conn_process: behind the replies batched so far, so the
         * client sees them in request order. */
        msgpack_sbuffer *out = &c->env->out;
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

/* The slot of (id, tenant), or the empty slot ending its probe run. One id
 * may be pending for several tenants (a front end naming sub-tenants): the
 * entries share the id's probe run. */
static size_t pend_find(const struct conn *c, uint64_t id, uint32_t tenant)
{
    size_t i = pend_slot(id, c->cap_pending);
    while (c->pending[i].count && (c->pending[i].id != id || c->pending[i].tenant != tenant))
        i = (i + 1) & (c->cap_pending - 1);
    return i;
}

/* The first slot holding id, whatever its tenant (or an empty one). */
static size_t pend_find_id(const struct conn *c, uint64_t id)
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
            c->pending[pend_find(c, old[i].id, old[i].tenant)] = old[i];
    free(old);
    return 0;
}

int conn_pending_add(struct conn *c, uint64_t id, uint32_t tenant)
{
    if (2 * (c->n_pend_ids + 1) > c->cap_pending && pend_grow(c) != 0)
        return KVD_ENOMEM;
    size_t i = pend_find(c, id, tenant);
    if (!c->pending[i].count) {
        c->pending[i].id = id;
        c->pending[i].tenant = tenant;
        c->n_pend_ids++;
    }
    c->pending[i].count++;
    c->n_pending++;
    c->env->cbs->pending(c->env->ctx, c, tenant, 1);
    return 0;
}

bool conn_pending_remove(struct conn *c, uint64_t req_id)
{
    if (!c->cap_pending)
        return false;
    size_t i = pend_find_id(c, req_id), mask = c->cap_pending - 1;
    if (!c->pending[i].count)
        return false;
    c->n_pending--;
    c->env->cbs->pending(c->env->ctx, c, c->pending[i].tenant, -1);
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

/* Sends the frames batched in env->out and empties it. When nothing is
 * queued in libevent they go straight to the socket: no copy into the
 * bufferevent and no write event to arm and disarm (two epoll_ctl per loop
 * pass). Only what the socket cannot take now is queued, large remainders
 * without a copy (a kv_read reply can be max_frame bytes). A failed send is
 * left to libevent's own write, which reports it through conn_event_cb. */
static void flush_out(struct conn *c)
{
    msgpack_sbuffer *sb = &c->env->out;
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

/* After each request: writes the batch once it is big, and applies flow
 * control. Returns true when reading must stop for now. */
static bool after_request(struct conn *c, struct evbuffer *out)
{
    struct conn_env *env = c->env;
    if (!c->closing && env->out.size >= CONN_BATCH_BYTES)
        flush_out(c);
    if (c->closing)
        return true;
    if (evbuffer_get_length(out) + env->out.size > env->out_high) {
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
           proto_frame_peek(base + *used, v.iov_len - *used, c->env->max_frame, &n) ==
               PROTO_FRAME_READY) {
        keep = c->env->cbs->dispatch(c->env->ctx, c, base + *used + KVD_FRAME_HEADER_BYTES, n);
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
    struct conn_env *env = c->env;
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
        switch (proto_frame_peek(hdr, avail, env->max_frame, &n)) {
        case PROTO_FRAME_NEED_MORE:
            return;
        case PROTO_FRAME_EMPTY:
            conn_send_error(c, 0, KVD_EBADREQ, "zero-length frame");
            conn_close_after_flush(c);
            return;
        case PROTO_FRAME_TOO_LARGE: {
            char msg[128];
            snprintf(msg, sizeof(msg), "frame of %zu bytes is over max_frame (%u bytes)", n,
                     env->max_frame);
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
        bool keep = c->env->cbs->dispatch(c->env->ctx, c, p + sizeof(hdr), n);
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
    struct conn_env *env = c->env;
    /* Replies are batched in env->out and sent once the input is used up.
     * Not expected to nest; if it does, the outer batch goes first. */
    struct conn *outer = env->out_conn;
    if (outer)
        flush_out(outer);
    env->out_conn = c;
    process_input(c);
    flush_out(c);
    env->out_conn = outer;
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
        if (!c->env->no_read)
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
    struct conn_env *env = c->env;

    /* The owner first, so whoever uses the connection's sequences stops
     * before they are released. */
    env->cbs->closed(env->ctx, c);
    log_debug("conn %llu (uid %u) closed", (unsigned long long)c->id, (unsigned)c->uid);
    if (c->in_cb)
        evbuffer_remove_cb_entry(bufferevent_get_input(c->bev), c->in_cb);
    if (c->out_cb)
        evbuffer_remove_cb_entry(bufferevent_get_output(c->bev), c->out_cb);
    env->cbs->buffered(env->ctx, c, 0, c->buffered);
    bufferevent_free(c->bev);
    free(c->pending);
    free(c);
}

struct conn *conn_new(struct conn_env *env, int fd, uint64_t id)
{
    struct conn *c = calloc(1, sizeof(*c));
    if (!c) {
        close(fd);
        return NULL;
    }
    c->bev = bufferevent_socket_new(env->base, fd, BEV_OPT_CLOSE_ON_FREE);
    if (!c->bev) {
        close(fd);
        free(c);
        return NULL;
    }
    c->env = env;
    c->id = id;
    bufferevent_setcb(c->bev, conn_read_cb, conn_write_cb, conn_event_cb, c);
    c->in_cb = evbuffer_add_cb(bufferevent_get_input(c->bev), conn_buf_cb, c);
    c->out_cb = evbuffer_add_cb(bufferevent_get_output(c->bev), conn_buf_cb, c);
    bufferevent_setwatermark(c->bev, EV_WRITE, env->out_high / 2, 0);
    bufferevent_set_max_single_read(c->bev, CONN_READ_MAX);
    return c;
}

void conn_start(struct conn *c)
{
    bufferevent_enable(c->bev, EV_READ | EV_WRITE);
}

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

/* A reply frame with descriptors, waiting for everything before it to be
 * written. */
struct conn_fdframe {
    struct conn_fdframe *next;
    char *data; /* the frame */
    size_t len;
    int *fds; /* (n_fds) owned until sent */
    size_t n_fds;
    struct evbuffer *after; /* output produced after it */
};

static void fdframe_free(struct conn_fdframe *f)
{
    for (size_t i = 0; i < f->n_fds; i++)
        close(f->fds[i]);
    free(f->fds);
    free(f->data);
    if (f->after)
        evbuffer_free(f->after);
    free(f);
}

/* Where output goes now: behind the last queued descriptor frame, or the
 * socket's buffer. */
static struct evbuffer *conn_outbuf(struct conn *c)
{
    return c->fdq_tail ? c->fdq_tail->after : bufferevent_get_output(c->bev);
}

static void fdq_run(struct conn *c);

static void fd_ev_cb(evutil_socket_t fd, short what, void *arg)
{
    fdq_run(arg);
}

/* Sends the head descriptor frame while the socket's buffer is empty: one
 * sendmsg whose first byte is the frame's first byte carries the
 * descriptors; what the socket did not take, and the output that waited
 * behind the frame, go to the buffer. */
static void fdq_run(struct conn *c)
{
    struct evbuffer *out = bufferevent_get_output(c->bev);
    while (c->fdq_head && evbuffer_get_length(out) == 0) {
        struct conn_fdframe *f = c->fdq_head;
        char cbuf[CMSG_SPACE(sizeof(int) * KVD_MAX_EXPORT_FDS)];
        struct iovec iov = {.iov_base = f->data, .iov_len = f->len};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t n;
        if (f->n_fds) {
            memset(cbuf, 0, sizeof cbuf);
            mh.msg_control = cbuf;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * f->n_fds);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int) * f->n_fds);
            memcpy(CMSG_DATA(cm), f->fds, sizeof(int) * f->n_fds);
        }
        do
            n = sendmsg(bufferevent_getfd(c->bev), &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (c->fd_ev)
                event_add(c->fd_ev, NULL);
            return;
        }
        if (n < 0) {
            /* The peer is gone or the socket broke: nothing more can be
             * delivered; libevent's own write reports it. */
            log_debug("conn %llu: sending a reply with descriptors: %s", (unsigned long long)c->id,
                      strerror(errno));
            n = 0;
        }
        c->fdq_head = f->next;
        if (!c->fdq_head)
            c->fdq_tail = NULL;
        if ((size_t)n < f->len && evbuffer_add(out, f->data + n, f->len - (size_t)n) != 0)
            log_err("conn %llu: out of memory queueing a reply", (unsigned long long)c->id);
        evbuffer_add_buffer(out, f->after);
        fdframe_free(f); /* the descriptors are the peer's now: ours close */
    }
    /* The write callback must come at empty, not at the low watermark, for
     * the next frame. */
    bufferevent_setwatermark(c->bev, EV_WRITE, c->fdq_head || c->closing ? 0 : c->env->out_high / 2,
                             0);
    if (c->fdq_head)
        bufferevent_enable(c->bev, EV_WRITE);
    else if (c->closing && evbuffer_get_length(out) == 0)
        /* Nothing left for libevent to write: its write callback frees c. */
        bufferevent_trigger(c->bev, EV_WRITE,
                            BEV_TRIG_IGNORE_WATERMARKS | BEV_TRIG_DEFER_CALLBACKS);
}

int conn_reply_fds(struct conn *c, int *fds, size_t n)
{
    int *v = malloc(sizeof *v * (n ? n : 1));
    if (!v) {
        for (size_t i = 0; i < n; i++)
            close(fds[i]);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < c->n_reply_fds; i++)
        close(c->reply_fds[i]);
    free(c->reply_fds);
    memcpy(v, fds, sizeof *v * n);
    c->reply_fds = v;
    c->n_reply_fds = n;
    return 0;
}

static void flush_out(struct conn *c);

void conn_fds_attach(struct conn *c, size_t at, bool ok)
{
    msgpack_sbuffer *sb = &c->env->out;
    struct conn_fdframe *f = NULL;
    int *fds = c->reply_fds;
    size_t n = c->n_reply_fds;

    c->reply_fds = NULL;
    c->n_reply_fds = 0;
    if (!fds)
        return;
    if (ok && at < sb->size && (f = calloc(1, sizeof *f)) && (f->after = evbuffer_new()) &&
        (f->data = malloc(sb->size - at)) &&
        (c->fd_ev ||
         (c->fd_ev = event_new(c->env->base, bufferevent_getfd(c->bev), EV_WRITE, fd_ev_cb, c)))) {
        f->len = sb->size - at;
        memcpy(f->data, sb->data + at, f->len);
        f->fds = fds;
        f->n_fds = n;
        sb->size = at;
        flush_out(c); /* everything before the frame */
        if (c->fdq_tail)
            c->fdq_tail->next = f;
        else
            c->fdq_head = f;
        c->fdq_tail = f;
        fdq_run(c);
        return;
    }
    if (f) {
        f->fds = NULL;
        fdframe_free(f);
    }
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
    if (ok) {
        /* No memory to queue it: the reply cannot keep its promise. */
        sb->size = at;
        log_err("conn %llu: out of memory queueing a reply with descriptors; closing",
                (unsigned long long)c->id);
        conn_close_after_flush(c);
    }
}

msgpack_sbuffer *conn_reply_buf(struct conn *c)
{
    return &c->env->out;
}

int conn_send(struct conn *c, const void *data, size_t len)
{
    if (evbuffer_add(conn_outbuf(c), data, len) != 0)
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

int conn_pending_add(struct conn *c, uint64_t id, uint32_t tenant, uint32_t units)
{
    if (2 * (c->n_pend_ids + 1) > c->cap_pending && pend_grow(c) != 0)
        return KVD_ENOMEM;
    size_t i = pend_find(c, id, tenant);
    if (!c->pending[i].count) {
        c->pending[i].id = id;
        c->pending[i].tenant = tenant;
        c->pending[i].units = 0; /* an emptied slot keeps what was moved out of it */
        c->n_pend_ids++;
    }
    c->pending[i].count++;
    c->pending[i].units += units;
    c->n_pending++;
    c->env->cbs->pending(c->env->ctx, c, tenant, 1, (long)units);
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
    /* requests of one id share its units: each takes its share, the last
     * what is left */
    uint32_t u = c->pending[i].units / c->pending[i].count;
    c->pending[i].units -= u;
    c->env->cbs->pending(c->env->ctx, c, c->pending[i].tenant, -1, -(long)u);
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
    if (c->fdq_tail) {
        /* Behind a reply that carries descriptors: it must go first. */
        if (evbuffer_add(c->fdq_tail->after, sb->data, sb->size) != 0) {
            log_err("conn %llu: out of memory queueing a reply; closing",
                    (unsigned long long)c->id);
            conn_close_after_flush(c);
        }
        sb->size = 0;
        return;
    }
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

/* Bytes that left the input buffer for c->big still count as buffered. */
static void big_frame_account(struct conn *c, size_t added, size_t deleted)
{
    c->buffered += added;
    c->buffered -= deleted;
    c->env->cbs->buffered(c->env->ctx, c, added, deleted);
}

static void big_frame_free(struct conn *c)
{
    if (c->big)
        big_frame_account(c, 0, c->big_have);
    free(c->big);
    c->big = NULL;
    c->big_len = c->big_have = 0;
}

/* Moves what has arrived of the pending big frame out of the input buffer
 * (at most one read's worth per call: the callback that read it) and
 * dispatches the frame once whole. Returns false when the connection must
 * close; *done when the frame was dispatched. */
static bool big_frame_fill(struct conn *c, struct evbuffer *in, bool *done)
{
    size_t want = c->big_len - c->big_have, avail = evbuffer_get_length(in);
    size_t n = avail < want ? avail : want;
    *done = false;
    if (n) {
        /* Accounted before the removal reports it deleted, so the server's
         * total never dips below what is held. */
        big_frame_account(c, n, 0);
        if (evbuffer_remove(in, c->big + c->big_have, n) != (int)n) {
            conn_send_error(c, 0, KVD_EINTERNAL, "cannot receive a frame");
            return false;
        }
        c->big_have += n;
    }
    if (c->big_have < c->big_len)
        return true;
    bool keep = c->env->cbs->dispatch(c->env->ctx, c, c->big, c->big_len);
    big_frame_free(c);
    *done = true;
    return keep;
}

/* A frame whose payload of n bytes is more than one read: takes its header
 * off the input and gives it a buffer of its own (not touched until bytes
 * arrive). Waiting until it is whole and pulling it up would copy and
 * fault in up to max-frame bytes in one callback, a stall every other
 * client of the loop sees. */
static bool big_frame_start(struct conn *c, struct evbuffer *in, size_t n)
{
    c->big = malloc(n);
    if (!c->big) {
        conn_send_error(c, 0, KVD_ENOMEM, "out of memory receiving a frame");
        return false;
    }
    c->big_len = n;
    c->big_have = 0;
    evbuffer_drain(in, KVD_FRAME_HEADER_BYTES);
    return true;
}

static void process_input(struct conn *c)
{
    struct conn_env *env = c->env;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    struct evbuffer *out = bufferevent_get_output(c->bev);

    while (!c->closing && !c->paused) {
        if (c->big) {
            bool done;
            if (!big_frame_fill(c, in, &done)) {
                conn_close_after_flush(c);
                return;
            }
            if (!done)
                return;
            after_request(c, out);
            continue;
        }
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
            if (n > CONN_READ_MAX) {
                if (!big_frame_start(c, in, n)) {
                    conn_close_after_flush(c);
                    return;
                }
                continue;
            }
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
    if (c->fdq_head)
        fdq_run(c);
    if (c->closing) {
        if (evbuffer_get_length(bufferevent_get_output(bev)) == 0 && !c->fdq_head)
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
            if (c->big) /* what came of a big frame: header and payload */
                left += KVD_FRAME_HEADER_BYTES + c->big_have;
            big_frame_free(c);
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
    while (c->fdq_head) {
        struct conn_fdframe *f = c->fdq_head;
        c->fdq_head = f->next;
        fdframe_free(f);
    }
    if (c->fd_ev)
        event_free(c->fd_ev);
    for (size_t i = 0; i < c->n_reply_fds; i++)
        close(c->reply_fds[i]);
    free(c->reply_fds);
    free(c->big); /* its bytes went with c->buffered above */
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

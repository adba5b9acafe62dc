/* libkvd connection: the socket, the send queue (requests framed by the
 * shared codec), the receive buffer and the table of requests in flight that
 * lets replies be collected by id in any order (pipelining). */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "libkvd_int.h"

/* Queued requests are written once this many bytes wait, so a long pipeline
 * does not grow the buffer without bound. */
#define CONN_FLUSH_BYTES (256u << 10)
/* Receive buffer step: one read takes up to this much. */
#define CONN_READ_CHUNK (64u << 10)

/* A request in flight. Open addressing, linear probing, keyed by id (never
 * 0: the daemon's "no id" reply is kept as an orphan). */
struct pending {
    uint64_t id; /* 0: empty slot */
    kvd_event_fn on_event;
    void *user;
    struct kvd_reply_impl *reply; /* arrived, not yet returned */
    bool discard;                 /* internal cancel: drop the reply */
};

struct kvd_conn {
    uint64_t next_id;
    size_t max_frame;
    int timeout_ms; /* -1: none */
    bool dead;      /* KVD_EIO happened; errstr says why */
    char dead_msg[KVD_ERRSTR_LEN];

    msgpack_sbuffer wbuf; /* framed requests not yet written */
    size_t wpos;          /* bytes of wbuf already written */
    msgpack_packer pk;

    char *rbuf; /* received bytes not yet consumed: [rpos, rlen) */
    size_t rpos, rlen, rcap;

    struct pending *tab; /* cap slots, cap a power of two */
    size_t cap, used;
    size_t n_discard; /* entries of internal cancels (not counted by kvd_pending) */

    /* Replies that arrived and were not asked for yet, oldest first, across
     * all ids (kvd_poll returns the head). */
    struct kvd_reply_impl *kept_head, *kept_tail;
    /* The last id-0 error the daemon sent (why it closed on us). */
    char last_orphan[KVD_ERRSTR_LEN];
    /* Descriptors received (SCM_RIGHTS) and not yet given to a reply, in
     * arrival order: a reply with "fds": N takes the first N. */
    int *rfds;
    size_t n_rfds, cap_rfds;
};

/* ---- errors -------------------------------------------------------------- */

int kvd_set_err(struct kvd_ctx *ctx, int err, const char *fmt, ...)
{
    va_list ap;
    ctx->err = err;
    va_start(ap, fmt);
    vsnprintf(ctx->errstr, sizeof(ctx->errstr), fmt, ap);
    va_end(ap);
    return err;
}

void kvd_clear_err(struct kvd_ctx *ctx)
{
    if (ctx->conn && ctx->conn->dead)
        return;
    ctx->err = 0;
    ctx->errstr[0] = '\0';
}

int kvd_err_from_reply(struct kvd_ctx *ctx, const struct kvd_reply *r)
{
    if (!r->err) {
        kvd_clear_err(ctx);
        return 0;
    }
    return kvd_set_err(ctx, r->err, "%s", r->message ? r->message : r->code);
}

/* Marks the connection dead: later calls fail with the same message. */
static int conn_fail(struct kvd_ctx *ctx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int conn_fail(struct kvd_ctx *ctx, const char *fmt, ...)
{
    struct kvd_conn *c = ctx->conn;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->dead_msg, sizeof(c->dead_msg), fmt, ap);
    va_end(ap);
    c->dead = true;
    if (ctx->fd >= 0) {
        close(ctx->fd);
        ctx->fd = -1;
    }
    ctx->err = KVD_EIO;
    snprintf(ctx->errstr, sizeof(ctx->errstr), "%s", c->dead_msg);
    return KVD_EIO;
}

static int conn_dead(struct kvd_ctx *ctx)
{
    ctx->err = KVD_EIO;
    snprintf(ctx->errstr, sizeof(ctx->errstr), "%s", ctx->conn->dead_msg);
    return KVD_EIO;
}

/* ---- connect / close ------------------------------------------------------ */

static bool path_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

/* kvd_default_socket with the reason a fallback socket is refused. */
static int default_socket(char *buf, size_t cap, char *why, size_t whylen)
{
    const char *env = getenv(KVD_SOCKET_ENV);
    const char *p = KVD_DEFAULT_SOCKET;
    char fb[sizeof(((struct sockaddr_un *)0)->sun_path) + 64];

    if (env && *env)
        p = env;
    else if (!path_exists(KVD_DEFAULT_SOCKET) && proto_socket_fallback(fb, sizeof(fb)) == 0 &&
             path_exists(fb)) {
        /* Only a directory of our own: another user could have created it
         * and be listening there for our prompts. */
        char err[400];
        if (proto_socket_path_check(fb, getuid(), true, err, sizeof(err)) != 0) {
            if (why)
                snprintf(why, whylen, "%s", err);
            return KVD_EPERM;
        }
        p = fb;
    }
    if (strlen(p) + 1 > cap)
        return KVD_ETOOLARGE;
    memcpy(buf, p, strlen(p) + 1);
    return 0;
}

unsigned kvd_version(void)
{
    return KVD_VERSION_NUMBER;
}

int kvd_default_socket(char *buf, size_t cap)
{
    return default_socket(buf, cap, NULL, 0);
}

struct kvd_ctx *kvd_connect(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char def[sizeof(sa.sun_path)];
    struct kvd_ctx *ctx = calloc(1, sizeof(*ctx));
    struct kvd_conn *c;

    if (!ctx)
        return NULL;
    ctx->fd = -1;
    c = calloc(1, sizeof(*c));
    if (!c) {
        free(ctx);
        return NULL;
    }
    ctx->conn = c;
    c->next_id = 1;
    c->max_frame = KVD_MAX_FRAME_LIMIT;
    c->timeout_ms = -1;
    msgpack_sbuffer_init(&c->wbuf);
    proto_packer_init(&c->pk, &c->wbuf);

    if (!path) {
        char why[400];
        int drc = default_socket(def, sizeof(def), why, sizeof(why));
        if (drc == KVD_EPERM) {
            conn_fail(ctx, "cannot connect: %s", why);
            ctx->err = KVD_EPERM;
            return ctx;
        }
        if (drc) {
            conn_fail(ctx, "cannot connect: $%s is longer than a socket path can be",
                      KVD_SOCKET_ENV);
            return ctx;
        }
        path = def;
    }
    if (strlen(path) >= sizeof(sa.sun_path)) {
        conn_fail(ctx, "cannot connect to %s: path longer than %zu bytes", path,
                  sizeof(sa.sun_path) - 1);
        return ctx;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    ctx->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ctx->fd < 0) {
        conn_fail(ctx, "cannot create a socket: %s", strerror(errno));
        return ctx;
    }
    if (connect(ctx->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        conn_fail(ctx, "cannot connect to %s: %s", path, strerror(errno));
        return ctx;
    }
    return ctx;
}

void kvd_close(struct kvd_ctx *ctx)
{
    struct kvd_conn *c;
    if (!ctx)
        return;
    c = ctx->conn;
    if (ctx->fd >= 0)
        close(ctx->fd);
    if (c) {
        struct kvd_reply_impl *r = c->kept_head;
        while (r) {
            struct kvd_reply_impl *next = r->next;
            kvd_reply_free(&r->pub);
            r = next;
        }
        for (size_t i = 0; i < c->n_rfds; i++)
            close(c->rfds[i]);
        free(c->rfds);
        free(c->tab);
        free(c->rbuf);
        msgpack_sbuffer_destroy(&c->wbuf);
        free(c);
    }
    free(ctx);
}

int kvd_set_timeout(struct kvd_ctx *ctx, unsigned ms)
{
    ctx->conn->timeout_ms = ms ? (int)(ms > INT32_MAX ? INT32_MAX : ms) : -1;
    return 0;
}

void kvd_set_max_frame(struct kvd_ctx *ctx, size_t bytes)
{
    ctx->conn->max_frame = bytes;
}

/* ---- table of requests in flight ------------------------------------------ */

static size_t tab_slot(uint64_t id, size_t cap)
{
    /* Ids are sequential: a multiplicative hash spreads them. */
    return (size_t)((id * 0x9e3779b97f4a7c15ull) >> 17) & (cap - 1);
}

static struct pending *tab_find(struct kvd_conn *c, uint64_t id)
{
    if (!c->cap || !id)
        return NULL;
    for (size_t i = tab_slot(id, c->cap);; i = (i + 1) & (c->cap - 1)) {
        if (c->tab[i].id == id)
            return &c->tab[i];
        if (c->tab[i].id == 0)
            return NULL;
    }
}

static int tab_grow(struct kvd_conn *c)
{
    size_t ncap = c->cap ? c->cap * 2 : 64;
    struct pending *nt = calloc(ncap, sizeof(*nt));
    if (!nt)
        return KVD_ENOMEM;
    for (size_t i = 0; i < c->cap; i++) {
        if (!c->tab[i].id)
            continue;
        size_t j = tab_slot(c->tab[i].id, ncap);
        while (nt[j].id)
            j = (j + 1) & (ncap - 1);
        nt[j] = c->tab[i];
    }
    free(c->tab);
    c->tab = nt;
    c->cap = ncap;
    return 0;
}

static struct pending *tab_add(struct kvd_conn *c, uint64_t id)
{
    size_t i;
    /* Load factor <= 1/2 keeps probes short. */
    if ((c->used + 1) * 2 > c->cap && tab_grow(c))
        return NULL;
    i = tab_slot(id, c->cap);
    while (c->tab[i].id)
        i = (i + 1) & (c->cap - 1);
    memset(&c->tab[i], 0, sizeof(c->tab[i]));
    c->tab[i].id = id;
    c->used++;
    return &c->tab[i];
}

/* Removes an entry, shifting later entries of its probe run back so lookups
 * never need tombstones. */
static void tab_del(struct kvd_conn *c, struct pending *p)
{
    size_t mask = c->cap - 1;
    size_t i = (size_t)(p - c->tab);
    size_t j = i;
    c->tab[i].id = 0;
    c->used--;
    for (;;) {
        j = (j + 1) & mask;
        if (!c->tab[j].id)
            return;
        size_t home = tab_slot(c->tab[j].id, c->cap);
        /* Move j into the hole at i unless its home lies cyclically in (i, j]. */
        bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            c->tab[i] = c->tab[j];
            c->tab[j].id = 0;
            i = j;
        }
    }
}

static void kept_push(struct kvd_conn *c, struct kvd_reply_impl *r)
{
    r->next = NULL;
    r->prev = c->kept_tail;
    if (c->kept_tail)
        c->kept_tail->next = r;
    else
        c->kept_head = r;
    c->kept_tail = r;
}

static void kept_unlink(struct kvd_conn *c, struct kvd_reply_impl *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        c->kept_head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        c->kept_tail = r->prev;
    r->prev = r->next = NULL;
}

size_t kvd_pending(const struct kvd_ctx *ctx)
{
    return ctx->conn->used - ctx->conn->n_discard;
}

/* ---- sending --------------------------------------------------------------- */

static int pack_arg(msgpack_packer *pk, const struct kvd_arg *a)
{
    int rc = proto_pack_str(pk, a->key ? a->key : "");
    if (rc)
        return rc;
    switch (a->type) {
    case KVD_ARG_NIL:
        rc = msgpack_pack_nil(pk);
        break;
    case KVD_ARG_BOOL:
        rc = a->v.b ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
        break;
    case KVD_ARG_INT:
        rc = msgpack_pack_int64(pk, a->v.i);
        break;
    case KVD_ARG_UINT:
        rc = msgpack_pack_uint64(pk, a->v.u);
        break;
    case KVD_ARG_FLOAT:
        rc = msgpack_pack_double(pk, a->v.f);
        break;
    case KVD_ARG_STR:
        rc = proto_pack_str(pk, a->v.s ? a->v.s : "");
        break;
    case KVD_ARG_BIN:
        rc = msgpack_pack_bin(pk, a->v.bin.len);
        if (!rc && a->v.bin.len)
            rc = msgpack_pack_bin_body(pk, a->v.bin.ptr, a->v.bin.len);
        break;
    case KVD_ARG_U32S:
        rc = msgpack_pack_array(pk, a->v.u32s.n);
        for (size_t i = 0; !rc && i < a->v.u32s.n; i++)
            rc = msgpack_pack_uint32(pk, a->v.u32s.ptr[i]);
        break;
    case KVD_ARG_RAW: /* the caller's packed object, as is (the daemon checks it) */
        if (a->v.bin.len == 0)
            return KVD_EBADREQ;
        rc = pk->callback(pk->data, a->v.bin.ptr, a->v.bin.len);
        break;
    default:
        return KVD_EBADREQ;
    }
    return rc ? KVD_ENOMEM : 0;
}

static int conn_read_frame(struct kvd_ctx *ctx, struct kvd_reply_impl **out, bool nonblock);
static int conn_dispatch(struct kvd_ctx *ctx, struct kvd_reply_impl *r, uint64_t *id_done);

/* Reads and stores every reply the socket holds now, without blocking. */
static int conn_drain_input(struct kvd_ctx *ctx)
{
    for (;;) {
        struct kvd_reply_impl *r;
        uint64_t done;
        int rc = conn_read_frame(ctx, &r, true);
        if (rc == KVD_EBUSY)
            return 0;
        if (rc)
            return rc;
        if ((rc = conn_dispatch(ctx, r, &done)))
            return rc;
    }
}

/* Writes the queue. While the socket is full it also reads replies: the
 * daemon stops reading a connection whose replies are not being read, so a
 * deep pipeline would otherwise block both sides forever. */
static int conn_write_all(struct kvd_ctx *ctx)
{
    struct kvd_conn *c = ctx->conn;
    while (c->wpos < c->wbuf.size) {
        ssize_t n = send(ctx->fd, c->wbuf.data + c->wpos, c->wbuf.size - c->wpos,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->wpos += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pfd = {.fd = ctx->fd, .events = POLLOUT | POLLIN};
            int pr = poll(&pfd, 1, c->timeout_ms);
            if (pr < 0 && errno != EINTR)
                return conn_fail(ctx, "cannot wait for kvd: %s", strerror(errno));
            if (pr == 0)
                return conn_fail(ctx, "timed out after %d ms writing to kvd", c->timeout_ms);
            if (pr > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR))) {
                int rc = conn_drain_input(ctx);
                if (rc)
                    return rc;
            }
            continue;
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
            return conn_fail(ctx, "connection closed by kvd%s%s",
                             c->last_orphan[0] ? " after: " : "", c->last_orphan);
        return conn_fail(ctx, "cannot write to kvd: %s", n < 0 ? strerror(errno) : "short write");
    }
    c->wpos = 0;
    msgpack_sbuffer_clear(&c->wbuf);
    return 0;
}

int kvd_flush(struct kvd_ctx *ctx)
{
    if (ctx->conn->dead)
        return conn_dead(ctx);
    return conn_write_all(ctx);
}

int kvd_send(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n_args,
             kvd_event_fn on_event, void *user, uint64_t *id_out)
{
    struct kvd_conn *c = ctx->conn;
    struct pending *p;
    size_t at, mark;
    uint64_t id;
    int rc = 0;

    if (c->dead)
        return conn_dead(ctx);
    id = c->next_id++;
    mark = c->wbuf.size;
    at = proto_frame_begin(&c->wbuf);
    if (at == SIZE_MAX)
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory queueing a request");
    if (op) {
        rc = proto_request_begin(&c->pk, op, id, n_args);
    } else {
        rc = msgpack_pack_map(&c->pk, n_args + 1) ? KVD_ENOMEM : 0;
        if (!rc)
            rc = proto_pack_kv_uint(&c->pk, "id", id);
    }
    for (size_t i = 0; !rc && i < n_args; i++)
        rc = pack_arg(&c->pk, &args[i]);
    if (!rc)
        rc = proto_frame_end(&c->wbuf, at);
    if (rc) {
        c->wbuf.size = mark; /* drop the half-built frame */
        return kvd_set_err(ctx, rc, "cannot encode request %s: %s", op ? op : "(no op)",
                           rc == KVD_ENOMEM ? "out of memory" : kvd_err_code(rc));
    }
    p = tab_add(c, id);
    if (!p) {
        c->wbuf.size = mark;
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory queueing a request");
    }
    p->on_event = on_event;
    p->user = user;
    if (id_out)
        *id_out = id;
    if (c->wbuf.size - c->wpos >= CONN_FLUSH_BYTES)
        return conn_write_all(ctx);
    kvd_clear_err(ctx);
    return 0;
}

int kvd_send_frame(struct kvd_ctx *ctx, const void *payload, size_t len)
{
    struct kvd_conn *c = ctx->conn;
    unsigned char hdr[4] = {(unsigned char)(len >> 24), (unsigned char)(len >> 16),
                            (unsigned char)(len >> 8), (unsigned char)len};
    if (c->dead)
        return conn_dead(ctx);
    if (len > UINT32_MAX)
        return kvd_set_err(ctx, KVD_ETOOLARGE, "a frame holds at most 4 GiB");
    if (msgpack_sbuffer_write(&c->wbuf, (const char *)hdr, 4) ||
        (len && msgpack_sbuffer_write(&c->wbuf, payload, len)))
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory queueing a frame");
    kvd_clear_err(ctx);
    return 0;
}

/* ---- receiving ------------------------------------------------------------ */

/* Keeps the descriptors of a recvmsg in arrival order. */
static int conn_take_fds(struct kvd_ctx *ctx, struct msghdr *mh)
{
    struct kvd_conn *c = ctx->conn;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(cm);
        if (c->n_rfds + k > c->cap_rfds) {
            size_t ncap = c->cap_rfds ? c->cap_rfds * 2 : 16;
            while (ncap < c->n_rfds + k)
                ncap *= 2;
            int *nv = realloc(c->rfds, sizeof *nv * ncap);
            if (!nv) {
                for (size_t i = 0; i < k; i++) {
                    int fd;
                    memcpy(&fd, data + i * sizeof fd, sizeof fd);
                    close(fd);
                }
                return conn_fail(ctx, "out of memory receiving descriptors");
            }
            c->rfds = nv;
            c->cap_rfds = ncap;
        }
        for (size_t i = 0; i < k; i++)
            memcpy(&c->rfds[c->n_rfds++], data + i * sizeof(int), sizeof(int));
    }
    if (mh->msg_flags & MSG_CTRUNC)
        return conn_fail(ctx, "descriptors from kvd were cut off (MSG_CTRUNC)");
    return 0;
}

/* Reads at least one more byte into rbuf (compacting or growing it so that
 * `need` bytes past rpos fit). */
static int conn_read_more(struct kvd_ctx *ctx, size_t need, bool nonblock)
{
    struct kvd_conn *c = ctx->conn;
    ssize_t n;

    if (c->rpos && (c->rpos == c->rlen || c->rcap - c->rpos < need)) {
        memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
    }
    if (need < CONN_READ_CHUNK)
        need = CONN_READ_CHUNK;
    if (c->rcap - c->rlen < CONN_READ_CHUNK / 4 || c->rcap < need) {
        size_t ncap = c->rcap ? c->rcap : CONN_READ_CHUNK;
        while (ncap < need || ncap - c->rlen < CONN_READ_CHUNK / 4)
            ncap *= 2;
        char *nb = realloc(c->rbuf, ncap);
        if (!nb)
            return conn_fail(ctx, "out of memory receiving a reply of %zu bytes", need);
        c->rbuf = nb;
        c->rcap = ncap;
    }
    for (;;) {
        if (c->timeout_ms >= 0 && !nonblock) {
            struct pollfd pfd = {.fd = ctx->fd, .events = POLLIN};
            int pr = poll(&pfd, 1, c->timeout_ms);
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr == 0)
                return conn_fail(ctx, "timed out after %d ms waiting for kvd", c->timeout_ms);
        }
        /* recvmsg, so descriptors a reply carries (kv_export) are kept:
         * they arrive with the first byte of their frame. */
        char cbuf[CMSG_SPACE(sizeof(int) * KVD_MAX_EXPORT_FDS)];
        struct iovec iov = {.iov_base = c->rbuf + c->rlen, .iov_len = c->rcap - c->rlen};
        struct msghdr mh = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        n = recvmsg(ctx->fd, &mh, MSG_CMSG_CLOEXEC | (nonblock ? MSG_DONTWAIT : 0));
        if (n >= 0) {
            int rc = conn_take_fds(ctx, &mh);
            if (rc)
                return rc;
        }
        if (n > 0) {
            c->rlen += (size_t)n;
            return 0;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && nonblock && (errno == EAGAIN || errno == EWOULDBLOCK))
            return KVD_EBUSY; /* nothing more now; not an error of the connection */
        if (n == 0 || errno == ECONNRESET)
            return conn_fail(ctx, "connection closed by kvd%s%s",
                             c->last_orphan[0] ? " after: " : "", c->last_orphan);
        return conn_fail(ctx, "cannot read from kvd: %s", strerror(errno));
    }
}

/* Reads one whole frame; *out gets its decoded reply or event. */
static int conn_read_frame(struct kvd_ctx *ctx, struct kvd_reply_impl **out, bool nonblock)
{
    struct kvd_conn *c = ctx->conn;
    char errbuf[KVD_ERRSTR_LEN];
    size_t len = 0;
    const char *payload;
    int rc;

    for (;;) {
        /* rbuf is NULL until the first read (NULL + 0 is undefined in C) */
        const char *unread = c->rbuf ? c->rbuf + c->rpos : NULL;
        enum proto_frame_status st =
            proto_frame_peek(unread, c->rlen - c->rpos, c->max_frame, &len);
        if (st == PROTO_FRAME_READY)
            break;
        if (st == PROTO_FRAME_EMPTY)
            return conn_fail(ctx, "kvd sent an empty frame");
        if (st == PROTO_FRAME_TOO_LARGE)
            return conn_fail(ctx, "kvd sent a frame of %zu bytes, over the %zu-byte limit", len,
                             c->max_frame);
        rc = conn_read_more(ctx, len ? KVD_FRAME_HEADER_BYTES + len : KVD_FRAME_HEADER_BYTES,
                            nonblock);
        if (rc)
            return rc;
    }
    payload = c->rbuf + c->rpos + KVD_FRAME_HEADER_BYTES;
    c->rpos += KVD_FRAME_HEADER_BYTES + len;
    rc = kvd_reply_decode(payload, len, out, errbuf, sizeof(errbuf));
    if (rc)
        return conn_fail(ctx, "%s", errbuf); /* the stream cannot be trusted now */
    return 0;
}

/* Handles one frame: an event goes to its request's callback; a reply is
 * stored at its request (or kept as an orphan). Sets *id_done to the id of
 * a reply that arrived, 0 for an event. */
static int conn_dispatch(struct kvd_ctx *ctx, struct kvd_reply_impl *r, uint64_t *id_done)
{
    struct kvd_conn *c = ctx->conn;
    struct pending *p = tab_find(c, r->pub.id);

    *id_done = 0;
    if (r->is_event) {
        if (p && p->on_event && !p->discard &&
            p->on_event(ctx, r->pub.id, r->pub.body, p->user) != 0) {
            /* The callback asked to stop: cancel it, dropping the cancel's reply. */
            uint64_t cid;
            struct kvd_arg a = KVD_ARG_U("target", r->pub.id);
            p->on_event = NULL;
            if (kvd_send(ctx, KVD_OP_CANCEL, &a, 1, NULL, NULL, &cid) == 0) {
                struct pending *cp = tab_find(c, cid);
                if (cp) {
                    cp->discard = true;
                    c->n_discard++;
                }
            }
        }
        kvd_reply_free(&r->pub);
        return 0;
    }
    *id_done = r->pub.id;
    const struct kvd_value *fv = r->pub.err ? NULL : kvd_value_get(r->pub.body, "fds");
    uint64_t nf = 0;
    if (fv && kvd_value_u64(fv, &nf) == 0 && nf > 0) {
        /* Its descriptors came with its first byte: the oldest received. */
        if (nf > c->n_rfds || !(r->fds = malloc(sizeof(int) * nf))) {
            kvd_reply_free(&r->pub);
            return conn_fail(ctx, "a reply announces %llu descriptors; %zu came",
                             (unsigned long long)nf, c->n_rfds);
        }
        memcpy(r->fds, c->rfds, sizeof(int) * nf);
        r->n_fds = nf;
        memmove(c->rfds, c->rfds + nf, sizeof(int) * (c->n_rfds - nf));
        c->n_rfds -= nf;
    }
    if (p && p->discard) {
        c->n_discard--;
        tab_del(c, p);
        kvd_reply_free(&r->pub);
        return 0;
    }
    if (p) {
        p->reply = r;
    } else if (r->pub.err) {
        snprintf(c->last_orphan, sizeof(c->last_orphan), "%s: %s", r->pub.code, r->pub.message);
    }
    kept_push(c, r);
    return 0;
}

/* Reads and dispatches frames until the reply of `id` is stored (id 0:
 * until any reply is kept). nonblock: KVD_EBUSY once the socket is empty. */
static int conn_pump(struct kvd_ctx *ctx, uint64_t id, bool nonblock)
{
    struct kvd_conn *c = ctx->conn;
    int rc;
    if (c->wpos < c->wbuf.size && (rc = conn_write_all(ctx)))
        return rc;
    for (;;) {
        struct pending *p = id ? tab_find(c, id) : NULL;
        struct kvd_reply_impl *r;
        uint64_t done;
        if (id ? (p && p->reply) : (c->kept_head != NULL))
            return 0;
        if (c->dead)
            return conn_dead(ctx);
        if ((rc = conn_read_frame(ctx, &r, nonblock)))
            return rc;
        if ((rc = conn_dispatch(ctx, r, &done)))
            return rc;
        /* An internal cancel sent from a callback must go out now. */
        if (c->wpos < c->wbuf.size && (rc = conn_write_all(ctx)))
            return rc;
    }
}

static int take_reply(struct kvd_ctx *ctx, struct kvd_reply_impl *r, struct kvd_reply **out)
{
    struct kvd_conn *c = ctx->conn;
    struct pending *p = tab_find(c, r->pub.id);
    int rc;
    if (p && p->reply == r)
        tab_del(c, p);
    kept_unlink(c, r);
    rc = kvd_err_from_reply(ctx, &r->pub);
    if (out)
        *out = &r->pub;
    else
        kvd_reply_free(&r->pub);
    return rc;
}

int kvd_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_reply **out)
{
    struct pending *p = tab_find(ctx->conn, id);
    int rc;
    if (out)
        *out = NULL;
    if (!p)
        return kvd_set_err(ctx, KVD_ENOTFOUND, "no request with id %llu is waiting for a reply",
                           (unsigned long long)id);
    if ((rc = conn_pump(ctx, id, false)))
        return rc;
    p = tab_find(ctx->conn, id);
    return take_reply(ctx, p->reply, out);
}

int kvd_try_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_reply **out)
{
    struct pending *p = tab_find(ctx->conn, id);
    int rc;
    if (out)
        *out = NULL;
    if (!p)
        return kvd_set_err(ctx, KVD_ENOTFOUND, "no request with id %llu is waiting for a reply",
                           (unsigned long long)id);
    rc = conn_pump(ctx, id, true);
    if (rc == KVD_EBUSY)
        return KVD_EBUSY; /* ctx->err untouched: nothing failed */
    if (rc)
        return rc;
    p = tab_find(ctx->conn, id);
    return take_reply(ctx, p->reply, out);
}

int kvd_poll(struct kvd_ctx *ctx, struct kvd_reply **out)
{
    int rc;
    if (out)
        *out = NULL;
    if ((rc = conn_pump(ctx, 0, false)))
        return rc;
    return take_reply(ctx, ctx->conn->kept_head, out);
}

int kvd_call(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n_args,
             struct kvd_reply **out)
{
    uint64_t id;
    int rc = kvd_send(ctx, op, args, n_args, NULL, NULL, &id);
    if (rc) {
        if (out)
            *out = NULL;
        return rc;
    }
    return kvd_wait(ctx, id, out);
}

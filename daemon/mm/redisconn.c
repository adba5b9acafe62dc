/* redisconn: the blocking Redis client (redisconn.h, docs/remote.md "The Redis client").
 *
 * hiredis formats commands (redisAppendCommandArgv) and parses replies (its reader); the I/O
 * is ours: after a bounded connect (redisConnectWithTimeout) the socket is made non-blocking
 * and one round (everything appended for the nodes of a batch, written, and every reply read)
 * runs in a poll() loop against a deadline of timeout_ms. SO_RCVTIMEO would only bound each
 * read(): a server that trickles a byte now and then could hold a call forever.
 *
 * A call is a batch of ops (one command per key). Single node: every op goes to node 0.
 * Cluster: each op goes to the master of its key's slot (the slot map, from CLUSTER SLOTS);
 * a MOVED reply updates that slot, schedules a map refresh and sends the op again to the new
 * node; an ASK reply sends it once to the named node, prefixed by ASKING. At most
 * MAX_REDIRECT_ROUNDS rounds per call. */
#include "redisconn.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>

#include "redis_cluster.h"

#define MAX_REDIRECT_ROUNDS 8
#define MAX_NODES 1024
#define MAX_SEEDS 64
#define MAX_CRED 256
#define READ_CHUNK (256u << 10)  /* bytes one read() may take */
#define READER_KEEP (8u << 20)   /* a reader buffer up to this size is kept when empty */
#define ARENA_MIN 4096           /* a GET value this long goes to the arena (smaller: malloc) */
#define ARENA_KEEP (64ull << 20) /* an arena larger than this is freed at the next call */
#define MAX_PENDING_REPLY (1ull << 30) /* unparsed bytes of one reply in the reader */
#define NO_NODE 0xffffu

/* ---- URLs ---- */

struct rc_url {
    bool cluster;
    bool auth;
    char user[MAX_CRED]; /* "" with auth: the default user (AUTH password) */
    char pass[MAX_CRED];
    unsigned db;
    size_t n_hosts;
    char host[MAX_SEEDS][REDIS_HOST_MAX];
    int port[MAX_SEEDS];
};

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decodes s[0..n) into out (cap bytes, NUL-terminated); false when malformed, too
 * long or decoding to a NUL. */
static bool pct_decode(const char *s, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            if (i + 2 >= n)
                return false;
            int hi = hexval(s[i + 1]);
            int lo = hexval(s[i + 2]);
            if (hi < 0 || lo < 0)
                return false;
            c = (char)(hi * 16 + lo);
            i += 2;
        }
        if (c == '\0' || o + 1 >= cap)
            return false;
        out[o++] = c;
    }
    out[o] = '\0';
    return true;
}

/* One "host[:port]" or "[v6]:port" of length n. */
static int parse_hostport(const char *s, size_t n, char *host, int *port, struct kvd_error *e)
{
    const char *hs = s, *he, *ps = NULL;
    if (n == 0)
        return kvd_error_set(e, KVD_EBADREQ, "redis URL: an empty host");
    if (s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (!close)
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: '[' without ']' in '%.*s'", (int)n, s);
        hs = s + 1;
        he = close;
        if (close + 1 < s + n) {
            if (close[1] != ':')
                return kvd_error_set(e, KVD_EBADREQ, "redis URL: junk after ']' in '%.*s'", (int)n,
                                     s);
            ps = close + 2;
        }
    } else {
        const char *colon = memchr(s, ':', n);
        he = colon ? colon : s + n;
        if (colon)
            ps = colon + 1;
        if (colon && memchr(colon + 1, ':', (size_t)(s + n - colon - 1)))
            return kvd_error_set(e, KVD_EBADREQ,
                                 "redis URL: '%.*s': an IPv6 address needs [brackets]", (int)n, s);
    }
    size_t hl = (size_t)(he - hs);
    if (hl == 0)
        return kvd_error_set(e, KVD_EBADREQ, "redis URL: an empty host in '%.*s'", (int)n, s);
    if (hl >= REDIS_HOST_MAX)
        return kvd_error_set(e, KVD_EBADREQ, "redis URL: a host name over %d bytes",
                             REDIS_HOST_MAX - 1);
    for (size_t i = 0; i < hl; i++) {
        unsigned char c = (unsigned char)hs[i];
        if (c <= ' ' || c >= 127 || c == '/' || c == '@' || c == '?' || c == '#')
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: a bad character in host '%.*s'",
                                 (int)hl, hs);
    }
    memcpy(host, hs, hl);
    host[hl] = '\0';
    *port = 6379;
    if (ps) {
        const char *pe = s + n;
        long v = 0;
        if (ps == pe || pe - ps > 5)
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: bad port in '%.*s' (1..65535)", (int)n,
                                 s);
        for (const char *d = ps; d < pe; d++) {
            if (*d < '0' || *d > '9')
                return kvd_error_set(e, KVD_EBADREQ, "redis URL: bad port in '%.*s' (1..65535)",
                                     (int)n, s);
            v = v * 10 + (*d - '0');
        }
        if (v < 1 || v > 65535)
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: bad port in '%.*s' (1..65535)", (int)n,
                                 s);
        *port = (int)v;
    }
    return 0;
}

static int url_parse(const char *url, struct rc_url *u, struct kvd_error *e)
{
    memset(u, 0, sizeof(*u));
    if (!url || !*url)
        return kvd_error_set(e, KVD_EBADREQ, "redis URL: empty");
    const char *rest;
    if (strncmp(url, "redis://", 8) == 0) {
        rest = url + 8;
    } else if (strncmp(url, "redis-cluster://", 16) == 0) {
        rest = url + 16;
        u->cluster = true;
    } else if (strncmp(url, "rediss://", 9) == 0 || strncmp(url, "rediss-cluster://", 17) == 0) {
        return kvd_error_set(e, KVD_EBADREQ,
                             "rediss:// (TLS) is not supported: this hiredis has no TLS; keep "
                             "Redis on a private network");
    } else {
        return kvd_error_set(e, KVD_EBADREQ,
                             "redis URL '%.40s': the scheme must be redis:// or redis-cluster://",
                             url);
    }
    for (const char *c = rest; *c; c++)
        if (*c == '?' || *c == '#')
            return kvd_error_set(e, KVD_EBADREQ,
                                 "redis URL: query strings and fragments are not supported");
    /* userinfo up to the last '@' (a password may hold '/' or '@' when percent-encoded) */
    const char *at = strrchr(rest, '@');
    if (at) {
        const char *colon = memchr(rest, ':', (size_t)(at - rest));
        if (!colon)
            return kvd_error_set(e, KVD_EBADREQ,
                                 "redis URL: credentials must be user:password@ or :password@");
        if (!pct_decode(rest, (size_t)(colon - rest), u->user, sizeof(u->user)) ||
            !pct_decode(colon + 1, (size_t)(at - colon - 1), u->pass, sizeof(u->pass)))
            return kvd_error_set(e, KVD_EBADREQ,
                                 "redis URL: bad credentials (percent-encoding, NUL or over %d "
                                 "bytes)",
                                 MAX_CRED - 1);
        if (!u->pass[0])
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: an empty password");
        u->auth = true;
        rest = at + 1;
    }
    const char *slash = strchr(rest, '/');
    const char *hosts_end = slash ? slash : rest + strlen(rest);
    if (slash) {
        const char *d = slash + 1;
        unsigned long v = 0;
        size_t nd = 0;
        for (; *d; d++, nd++) {
            if (*d < '0' || *d > '9' || nd >= 9)
                return kvd_error_set(e, KVD_EBADREQ, "redis URL: bad db '%s' (a number)",
                                     slash + 1);
            v = v * 10 + (unsigned long)(*d - '0');
        }
        u->db = (unsigned)v;
        if (u->cluster && u->db != 0)
            return kvd_error_set(e, KVD_EBADREQ, "redis-cluster URL: Redis Cluster has only db 0");
    }
    if (hosts_end == rest)
        return kvd_error_set(e, KVD_EBADREQ, "redis URL: no host");
    const char *h = rest;
    for (;;) {
        const char *comma = memchr(h, ',', (size_t)(hosts_end - h));
        const char *he = comma ? comma : hosts_end;
        if (u->n_hosts == MAX_SEEDS)
            return kvd_error_set(e, KVD_EBADREQ, "redis URL: more than %d hosts", MAX_SEEDS);
        if (parse_hostport(h, (size_t)(he - h), u->host[u->n_hosts], &u->port[u->n_hosts], e))
            return e ? e->code : KVD_EBADREQ;
        u->n_hosts++;
        if (!comma)
            break;
        h = comma + 1;
    }
    if (!u->cluster && u->n_hosts > 1)
        return kvd_error_set(
            e, KVD_EBADREQ, "redis URL: redis:// takes one host; use redis-cluster:// for several");
    return 0;
}

int redisconn_url_check(const char *url, struct kvd_error *e)
{
    struct rc_url *u = malloc(sizeof(*u));
    if (!u)
        return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
    int rc = url_parse(url, u, e);
    free(u);
    return rc;
}

/* ---- nodes and connections ---- */

enum sent_kind { SENT_OP, SENT_MAP, SENT_ASKING, SENT_AUTH, SENT_SELECT };
struct sent {
    uint32_t op;
    uint8_t kind;
};

struct rnode {
    char host[REDIS_HOST_MAX];
    int port;
    redisContext *ctx;
    bool ever_connected;
    uint64_t last_attempt_ms; /* 0: never tried */
    int last_code;            /* the last connect failure, reported until the next attempt */
    char last_err[512];
    /* this round */
    struct sent *sent;
    size_t n_sent, cap_sent, n_got;
    size_t woff; /* bytes of ctx->obuf sent so far */
    bool active, failed;
};

struct rc_op {
    int argc;
    const char *argv[5];
    size_t len[5];
    uint16_t slot;
    uint16_t ask_node; /* NO_NODE, or the node an ASK named (this op's next round only) */
    uint16_t node;     /* where it went this round */
    redisReply *reply;
    bool done;
};

struct redisconn {
    struct rc_url url;
    uint32_t timeout_ms;
    struct rnode *nodes;
    size_t n_nodes, cap_nodes;
    struct pollfd *pfds; /* cap_nodes entries, for round_io */
    uint16_t *pidx;
    redisReply *map_reply; /* CLUSTER SLOTS, while refresh_map runs */
    uint16_t *slot_node;   /* cluster: REDIS_CLUSTER_SLOTS entries */
    bool map_loaded, need_refresh;
    struct redisconn_stats st;
    /* The values of the current GET call (see arena_string), reused call after call. */
    char *arena;
    size_t arena_used, arena_cap;
    redisReplyObjectFunctions reply_fns; /* hiredis's, with arena_string for strings */
    void *(*hiredis_string)(const redisReadTask *, char *, size_t);
    /* reused per call */
    struct rc_op *ops;
    size_t cap_ops;
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void node_drop(struct redisconn *rc, struct rnode *nd)
{
    if (nd->ctx) {
        redisFree(nd->ctx);
        nd->ctx = NULL;
    }
    nd->woff = 0;
    if (rc->slot_node)
        rc->need_refresh = true; /* a cluster node went away: the map may have changed */
}

/* The node for host:port, added when new; NO_NODE when the table is full. */
static uint16_t node_find_add(struct redisconn *rc, const char *host, int port)
{
    for (size_t i = 0; i < rc->n_nodes; i++)
        if (rc->nodes[i].port == port && strcmp(rc->nodes[i].host, host) == 0)
            return (uint16_t)i;
    if (rc->n_nodes == MAX_NODES)
        return NO_NODE;
    if (rc->n_nodes == rc->cap_nodes) {
        size_t cap = rc->cap_nodes ? rc->cap_nodes * 2 : 4;
        struct rnode *nn = realloc(rc->nodes, cap * sizeof(*nn));
        if (!nn)
            return NO_NODE;
        rc->nodes = nn;
        struct pollfd *np = realloc(rc->pfds, cap * sizeof(*np));
        if (!np)
            return NO_NODE;
        rc->pfds = np;
        uint16_t *ni = realloc(rc->pidx, cap * sizeof(*ni));
        if (!ni)
            return NO_NODE;
        rc->pidx = ni;
        rc->cap_nodes = cap;
    }
    struct rnode *nd = &rc->nodes[rc->n_nodes];
    memset(nd, 0, sizeof(*nd));
    snprintf(nd->host, sizeof(nd->host), "%s", host);
    nd->port = port;
    return (uint16_t)rc->n_nodes++;
}

static int sent_push(struct rnode *nd, uint32_t op, uint8_t kind)
{
    if (nd->n_sent == nd->cap_sent) {
        size_t cap = nd->cap_sent ? nd->cap_sent * 2 : 16;
        struct sent *ns = realloc(nd->sent, cap * sizeof(*ns));
        if (!ns)
            return -1;
        nd->sent = ns;
        nd->cap_sent = cap;
    }
    nd->sent[nd->n_sent].op = op;
    nd->sent[nd->n_sent].kind = kind;
    nd->n_sent++;
    return 0;
}

/* Makes sure nd has a connection, connecting when allowed (at most one attempt per
 * timeout_ms), and queues AUTH and SELECT on a fresh one. */
/* Makes room for len more bytes in rc's arena: 0, or -1 when out of memory. */
static int arena_room(struct redisconn *rc, size_t len)
{
    if (rc->arena_cap - rc->arena_used >= len)
        return 0;
    size_t cap = rc->arena_cap ? rc->arena_cap : (1u << 20);
    while (cap - rc->arena_used < len) {
        if (cap > SIZE_MAX / 2)
            return -1;
        cap *= 2;
    }
    char *na = realloc(rc->arena, cap);
    if (!na)
        return -1;
    rc->arena = na;
    rc->arena_cap = cap;
    return 0;
}

/* The reader's string constructor: a top-level bulk string (a GET's value) of ARENA_MIN bytes
 * or more is copied into the connection's arena, not into a malloc of its own. A restore moves
 * megabytes per call; allocations that large are mmap'd, or trimmed back to the system when
 * freed, so a fresh buffer per value is page-faulted in anew every call, which cost far more
 * than the network (docs/performance.md "Remote tier"). The arena lives as long as the
 * connection. The reply hiredis gets is its own empty string (len 0, so nothing reads past
 * it), with the arena offset in `integer` and the length in `elements`, which hiredis never
 * sets for a string: arena_value reads them back. */
static void *arena_string(const redisReadTask *task, char *str, size_t len)
{
    struct redisconn *rc = task->privdata;
    if (task->parent || task->type != REDIS_REPLY_STRING || len < ARENA_MIN)
        return rc->hiredis_string(task, str, len);
    if (arena_room(rc, len))
        return NULL; /* the reader reports it as out of memory: the call fails */
    redisReply *r = rc->hiredis_string(task, "", 0);
    if (!r)
        return NULL;
    memcpy(rc->arena + rc->arena_used, str, len);
    r->integer = (long long)rc->arena_used;
    r->elements = len;
    rc->arena_used += len;
    return r;
}

/* At the start of a call (run_ops): the previous call's values are no longer needed. */
static void arena_reset(struct redisconn *rc)
{
    rc->arena_used = 0;
    if (rc->arena_cap > ARENA_KEEP) {
        free(rc->arena);
        rc->arena = NULL;
        rc->arena_cap = 0;
    }
}

static int node_ensure(struct redisconn *rc, struct rnode *nd, struct kvd_error *e)
{
    if (nd->ctx) {
        /* A connection idle since the last call that is readable now was closed by the
         * server (restart, idle timeout) or carries junk: drop it and connect again. */
        struct pollfd p = {.fd = nd->ctx->fd, .events = POLLIN};
        if (poll(&p, 1, 0) == 0)
            return 0;
        node_drop(rc, nd);
    }
    uint64_t t = now_ms();
    if (nd->last_attempt_ms && t - nd->last_attempt_ms < rc->timeout_ms) {
        if (nd->last_code)
            return kvd_error_set(e, nd->last_code, "%s (not retried for %u ms)", nd->last_err,
                                 rc->timeout_ms);
        return kvd_error_set(e, KVD_EINTERNAL,
                             "redis: %s:%d: connection lost; reconnecting at most once per %u ms",
                             nd->host, nd->port, rc->timeout_ms);
    }
    nd->last_attempt_ms = t ? t : 1;
    struct timeval tv = {.tv_sec = rc->timeout_ms / 1000,
                         .tv_usec = (suseconds_t)(rc->timeout_ms % 1000) * 1000};
    redisContext *c = redisConnectWithTimeout(nd->host, nd->port, tv);
    if (!c || c->err) {
        bool to = c && (strstr(c->errstr, "timed out") || strstr(c->errstr, "in progress"));
        nd->last_code = to ? KVD_EBUSY : KVD_EINTERNAL;
        snprintf(nd->last_err, sizeof(nd->last_err), "redis: %s connecting to %s:%d: %s",
                 to ? "timeout" : "connection failed", nd->host, nd->port,
                 c ? c->errstr : "out of memory");
        rc->st.connect_fails++;
        if (to)
            rc->st.timeouts++;
        if (c)
            redisFree(c);
        return kvd_error_set(e, nd->last_code, "%s", nd->last_err);
    }
    int fl = fcntl(c->fd, F_GETFL);
    if (fl < 0 || fcntl(c->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        nd->last_code = KVD_EINTERNAL;
        snprintf(nd->last_err, sizeof(nd->last_err), "redis: fcntl on %s:%d: %s", nd->host,
                 nd->port, strerror(errno));
        redisFree(c);
        return kvd_error_set(e, nd->last_code, "%s", nd->last_err);
    }
    c->flags &= ~REDIS_BLOCK; /* our poll loop does the waiting; EAGAIN is not an error */
    redisEnableKeepAlive(c);
    if (!rc->hiredis_string) {
        rc->reply_fns = *c->reader->fn;
        rc->hiredis_string = rc->reply_fns.createString;
        rc->reply_fns.createString = arena_string;
    }
    c->reader->fn = &rc->reply_fns;
    c->reader->privdata = rc;
    nd->ctx = c;
    nd->last_code = 0;
    if (nd->ever_connected)
        rc->st.reconnects++;
    nd->ever_connected = true;
    if (rc->url.auth) {
        const char *argv[3] = {"AUTH", rc->url.user, rc->url.pass};
        size_t len[3] = {4, strlen(rc->url.user), strlen(rc->url.pass)};
        if (rc->url.user[0]) {
            if (redisAppendCommandArgv(c, 3, argv, len) != REDIS_OK)
                goto oom;
        } else {
            argv[1] = rc->url.pass;
            len[1] = len[2];
            if (redisAppendCommandArgv(c, 2, argv, len) != REDIS_OK)
                goto oom;
        }
        if (sent_push(nd, 0, SENT_AUTH))
            goto oom;
    }
    if (rc->url.db) {
        char db[16];
        int dl = snprintf(db, sizeof(db), "%u", rc->url.db);
        const char *argv[2] = {"SELECT", db};
        size_t len[2] = {6, (size_t)dl};
        if (redisAppendCommandArgv(c, 2, argv, len) != REDIS_OK || sent_push(nd, 0, SENT_SELECT))
            goto oom;
    }
    return 0;
oom:
    node_drop(rc, nd);
    return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory queueing the handshake");
}

/* Fails nd for this round: drops its connection; the first failure of the call sets e. */
static void node_fail(struct redisconn *rc, struct rnode *nd, int code, struct kvd_error *e,
                      bool *failed, const char *fmt, const char *detail)
{
    if (!*failed) {
        char what[160];
        snprintf(what, sizeof(what), fmt, detail);
        kvd_error_set(e, code, "redis: %s:%d: %s", nd->host, nd->port, what);
        *failed = true;
    }
    nd->failed = true;
    nd->active = false;
    node_drop(rc, nd);
}

/* Takes the replies parsed so far out of nd's reader into the ops (or the handshake).
 * Returns -1 on a protocol error. */
static int node_take_replies(struct redisconn *rc, struct rnode *nd, struct kvd_error *e,
                             bool *failed)
{
    while (nd->n_got < nd->n_sent) {
        void *r = NULL;
        if (redisGetReplyFromReader(nd->ctx, &r) != REDIS_OK) {
            node_fail(rc, nd, KVD_EINTERNAL, e, failed, "protocol error: %s", nd->ctx->errstr);
            return -1;
        }
        if (!r)
            return 0;
        struct sent *s = &nd->sent[nd->n_got++];
        redisReply *rep = r;
        if (s->kind == SENT_OP) {
            rc->ops[s->op].reply = rep;
            continue;
        }
        if (s->kind == SENT_MAP) {
            rc->map_reply = rep;
            continue;
        }
        bool ok =
            rep->type == REDIS_REPLY_STATUS && rep->len == 2 && memcmp(rep->str, "OK", 2) == 0;
        if (!ok && !*failed) {
            const char *what = s->kind == SENT_AUTH     ? "AUTH"
                               : s->kind == SENT_SELECT ? "SELECT"
                                                        : "ASKING";
            int code =
                s->kind == SENT_AUTH && rep->type == REDIS_REPLY_ERROR ? KVD_EPERM : KVD_EINTERNAL;
            if (rep->type == REDIS_REPLY_ERROR || rep->type == REDIS_REPLY_STATUS)
                kvd_error_set(e, code, "redis: %s:%d: %s refused: %.*s", nd->host, nd->port, what,
                              (int)(rep->len > 160 ? 160 : rep->len), rep->str);
            else
                kvd_error_set(e, code, "redis: %s:%d: %s: a reply of type %d", nd->host, nd->port,
                              what, rep->type);
            *failed = true;
            /* An AUTH/SELECT failure means every connect fails the same way: remember it so
             * that the calls until the next attempt report it. */
            if (s->kind != SENT_ASKING) {
                nd->last_code = code;
                snprintf(nd->last_err, sizeof(nd->last_err), "%s", e ? e->message : what);
            }
            nd->failed = true; /* dropped once the round is read */
        }
        freeReplyObject(rep);
    }
    /* Every reply is in: anything more in the buffer was not asked for. */
    if (nd->ctx->reader->pos < nd->ctx->reader->len) {
        node_fail(rc, nd, KVD_EINTERNAL, e, failed, "protocol error: %s",
                  "unsolicited bytes after the replies");
        return -1;
    }
    return 0;
}

/* After a round: a reader buffer that holds nothing unread and has grown past READER_KEEP
 * (a reply larger than usual) is given back, as redisReaderFeed would (round_io reads into
 * the buffer itself, so that code never runs). */
static void reader_trim(redisReader *rd)
{
    if (rd->pos < rd->len || sdsalloc(rd->buf) <= READER_KEEP)
        return;
    sds e = sdsempty();
    if (!e)
        return;
    sdsfree(rd->buf);
    rd->buf = e;
    rd->pos = rd->len = 0;
}

/* One round: writes what is queued on every active node and reads all their replies, within
 * timeout_ms. A node that fails is dropped; the others are read to the end. Returns 0, or -1
 * (e set) when any node failed. */
static int round_io(struct redisconn *rc, struct kvd_error *e)
{
    bool failed = false;
    struct pollfd *fds = rc->pfds;
    uint16_t *idx = rc->pidx;
    uint64_t deadline = now_ms() + rc->timeout_ms;
    for (size_t i = 0; i < rc->n_nodes; i++)
        if (rc->nodes[i].active)
            rc->st.rounds++;
    for (;;) {
        size_t k = 0;
        for (size_t i = 0; i < rc->n_nodes; i++) {
            struct rnode *nd = &rc->nodes[i];
            if (!nd->active)
                continue;
            fds[k].fd = nd->ctx->fd;
            fds[k].events = POLLIN | (sdslen(nd->ctx->obuf) > nd->woff ? POLLOUT : 0);
            fds[k].revents = 0;
            idx[k++] = (uint16_t)i;
        }
        if (k == 0)
            break;
        /* Past the deadline, replies already in the socket are still read
         * (a poll that does not wait): a thread kept from its core longer
         * than the timeout (prefetch workers run niced) finds them there on
         * waking. A server still sending then is read to the end of what is
         * ready, up to a second timeout at most. */
        uint64_t t = now_ms();
        int wait = t >= deadline ? 0 : (int)(deadline - t);
        int pr = t < deadline + rc->timeout_ms ? poll(fds, (nfds_t)k, wait) : 0;
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0) {
            for (size_t j = 0; j < k; j++)
                node_fail(rc, &rc->nodes[idx[j]], KVD_EINTERNAL, e, &failed, "poll: %s",
                          strerror(errno));
            break;
        }
        if (pr == 0) {
            for (size_t j = 0; j < k; j++) {
                char d[64];
                snprintf(d, sizeof(d), "%u ms", rc->timeout_ms);
                rc->st.timeouts++;
                node_fail(rc, &rc->nodes[idx[j]], KVD_EBUSY, e, &failed,
                          "timeout after %s waiting for replies (connection dropped)", d);
            }
            break;
        }
        for (size_t j = 0; j < k; j++) {
            struct rnode *nd = &rc->nodes[idx[j]];
            if (!nd->active || !fds[j].revents)
                continue;
            if (fds[j].revents & POLLOUT) {
                /* send(MSG_NOSIGNAL), not hiredis's write(): a peer gone away must not raise
                 * SIGPIPE in a process that did not ignore it. The buffer is cut once, when it
                 * has all gone (cutting it after each partial write moves it each time). */
                size_t len = sdslen(nd->ctx->obuf);
                ssize_t w =
                    send(nd->ctx->fd, nd->ctx->obuf + nd->woff, len - nd->woff, MSG_NOSIGNAL);
                if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    node_fail(rc, nd, KVD_EINTERNAL, e, &failed, "write: %s", strerror(errno));
                    continue;
                }
                if (w > 0) {
                    nd->woff += (size_t)w;
                    rc->st.bytes_out += (uint64_t)w;
                    if (nd->woff == len) {
                        sdsrange(nd->ctx->obuf, (ssize_t)len, -1);
                        nd->woff = 0;
                    }
                }
            }
            if (fds[j].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) {
                /* Straight into the reader's buffer (what redisReaderFeed would copy it to),
                 * kept between calls up to READER_KEEP. */
                redisReader *rd = nd->ctx->reader;
                sds rb = sdsMakeRoomFor(rd->buf, READ_CHUNK);
                if (!rb) {
                    node_fail(rc, nd, KVD_EINTERNAL, e, &failed, "%s", "out of memory reading");
                    continue;
                }
                rd->buf = rb;
                ssize_t got = read(nd->ctx->fd, rb + rd->len, READ_CHUNK);
                if (got == 0) {
                    node_fail(rc, nd, KVD_EINTERNAL, e, &failed, "%s",
                              "connection closed by the server");
                    continue;
                }
                if (got < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                        continue;
                    node_fail(rc, nd, KVD_EINTERNAL, e, &failed, "read: %s", strerror(errno));
                    continue;
                }
                rc->st.bytes_in += (uint64_t)got;
                sdsIncrLen(rb, got);
                rd->len = sdslen(rb);
                if (rd->len - rd->pos > MAX_PENDING_REPLY) {
                    node_fail(rc, nd, KVD_EINTERNAL, e, &failed, "%s",
                              "a reply over 1 GiB (protocol error or a hostile server)");
                    continue;
                }
                if (node_take_replies(rc, nd, e, &failed))
                    continue;
                if (nd->n_got == nd->n_sent)
                    nd->active = false;
            }
        }
    }
    for (size_t i = 0; i < rc->n_nodes; i++) {
        struct rnode *nd = &rc->nodes[i];
        if (nd->failed)
            node_drop(rc, nd);
        else if (nd->ctx)
            reader_trim(nd->ctx->reader);
        nd->active = false;
        nd->failed = false;
        nd->n_sent = nd->n_got = 0;
    }
    return failed ? -1 : 0;
}

static void ops_free_replies(struct redisconn *rc, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (rc->ops[i].reply)
            freeReplyObject(rc->ops[i].reply);
        rc->ops[i].reply = NULL;
    }
}

/* Sends op i to node ni (appending ASKING first when asked). */
static int op_queue(struct redisconn *rc, size_t i, uint16_t ni, struct kvd_error *e)
{
    struct rnode *nd = &rc->nodes[ni];
    struct rc_op *op = &rc->ops[i];
    if (!nd->active) {
        if (node_ensure(rc, nd, e))
            return -1;
        nd->active = true;
    }
    if (op->ask_node != NO_NODE) {
        const char *argv[1] = {"ASKING"};
        size_t len[1] = {6};
        if (redisAppendCommandArgv(nd->ctx, 1, argv, len) != REDIS_OK ||
            sent_push(nd, (uint32_t)i, SENT_ASKING))
            return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
    }
    if (redisAppendCommandArgv(nd->ctx, op->argc, op->argv, op->len) != REDIS_OK ||
        sent_push(nd, (uint32_t)i, SENT_OP))
        return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
    op->node = ni;
    return 0;
}

/* Abandons what was queued this round (after a failure before the I/O). */
static void round_abort(struct redisconn *rc)
{
    for (size_t i = 0; i < rc->n_nodes; i++) {
        struct rnode *nd = &rc->nodes[i];
        if (nd->active)
            node_drop(rc, nd); /* its output buffer holds commands we will not read */
        nd->active = false;
        nd->failed = false;
        nd->n_sent = nd->n_got = 0;
    }
}

static int refresh_map(struct redisconn *rc, struct kvd_error *e);

/* Runs ops[0..n) to completion, following redirects. On success every op has its final reply
 * (the caller checks its type); on failure every reply is freed. */
static int run_ops(struct redisconn *rc, size_t n, struct kvd_error *e)
{
    arena_reset(rc); /* the previous call's values are released now */
    for (size_t i = 0; i < n; i++) {
        rc->ops[i].reply = NULL;
        rc->ops[i].done = false;
        rc->ops[i].ask_node = NO_NODE;
        if (rc->slot_node)
            rc->ops[i].slot = redis_key_slot(rc->ops[i].argv[1], rc->ops[i].len[1]);
    }
    size_t pending = n;
    for (int round = 0; pending; round++) {
        if (round == MAX_REDIRECT_ROUNDS) {
            ops_free_replies(rc, n);
            return kvd_error_set(e, KVD_EINTERNAL,
                                 "redis: cluster: still redirected after %d rounds",
                                 MAX_REDIRECT_ROUNDS);
        }
        if (rc->slot_node && (!rc->map_loaded || rc->need_refresh)) {
            struct kvd_error me;
            if (refresh_map(rc, &me) && !rc->map_loaded) {
                ops_free_replies(rc, n);
                if (e)
                    *e = me;
                return -1;
            }
        }
        for (size_t i = 0; i < n; i++) {
            struct rc_op *op = &rc->ops[i];
            if (op->done)
                continue;
            uint16_t ni = 0;
            if (rc->slot_node) {
                ni = op->ask_node != NO_NODE ? op->ask_node : rc->slot_node[op->slot];
                if (ni == NO_NODE) {
                    round_abort(rc);
                    ops_free_replies(rc, n);
                    rc->need_refresh = true;
                    return kvd_error_set(e, KVD_EINTERNAL,
                                         "redis: cluster: no node serves slot %u (cluster down "
                                         "or being set up?)",
                                         op->slot);
                }
            }
            if (op_queue(rc, i, ni, e)) {
                round_abort(rc);
                ops_free_replies(rc, n);
                return -1;
            }
        }
        if (round_io(rc, e)) {
            ops_free_replies(rc, n);
            return -1;
        }
        for (size_t i = 0; i < n; i++) {
            struct rc_op *op = &rc->ops[i];
            if (op->done)
                continue;
            op->ask_node = NO_NODE;
            redisReply *r = op->reply;
            struct redis_redirect rd;
            if (rc->slot_node && r && r->type == REDIS_REPLY_ERROR &&
                redis_parse_redirect(r->str, r->len, &rd)) {
                if (!rd.host[0]) /* the node that answered */
                    snprintf(rd.host, sizeof(rd.host), "%s", rc->nodes[op->node].host);
                uint16_t ni = node_find_add(rc, rd.host, rd.port);
                if (ni == NO_NODE) {
                    ops_free_replies(rc, n);
                    return kvd_error_set(e, KVD_EINTERNAL, "redis: cluster: over %d nodes",
                                         MAX_NODES);
                }
                if (rd.ask) {
                    rc->st.ask++;
                    op->ask_node = ni;
                } else {
                    rc->st.moved++;
                    rc->slot_node[rd.slot] = ni;
                    rc->need_refresh = true;
                }
                freeReplyObject(r);
                op->reply = NULL;
                continue;
            }
            op->done = true;
            pending--;
        }
    }
    return 0;
}

/* Reloads the slot map from CLUSTER SLOTS, asking the known nodes (connected ones first, then
 * the rest, seeds included) until one answers. */
static int refresh_map(struct redisconn *rc, struct kvd_error *e)
{
    const char *argv[2] = {"CLUSTER", "SLOTS"};
    size_t len[2] = {7, 5};
    size_t cap = 512;
    struct redis_slot_range *ranges = malloc(cap * sizeof(*ranges));
    if (!ranges)
        return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
    kvd_error_set(e, KVD_EINTERNAL, "redis: cluster: no node to ask for the slot map");
    int result = -1;
    size_t order_n = rc->n_nodes;
    for (int pass = 0; pass < 2 && result < 0; pass++) {
        for (size_t i = 0; i < order_n && result < 0; i++) {
            struct rnode *nd = &rc->nodes[i];
            if ((pass == 0) != (nd->ctx != NULL))
                continue;
            if (node_ensure(rc, nd, e))
                continue;
            nd->active = true;
            if (redisAppendCommandArgv(nd->ctx, 2, argv, len) != REDIS_OK ||
                sent_push(nd, 0, SENT_MAP)) {
                round_abort(rc);
                continue;
            }
            rc->map_reply = NULL;
            if (round_io(rc, e) == 0) {
                redisReply *r = rc->map_reply;
                rc->map_reply = NULL;
                char msg[160];
                char host[REDIS_HOST_MAX];
                snprintf(host, sizeof(host), "%s", nd->host);
                int nr = redis_parse_cluster_slots(r, host, ranges, cap, msg, sizeof(msg));
                if (nr < 0 && r && r->type == REDIS_REPLY_ERROR)
                    kvd_error_set(e, KVD_EINTERNAL, "redis: %s:%d: CLUSTER SLOTS: %.*s", nd->host,
                                  nd->port, (int)(r->len > 120 ? 120 : r->len), r->str);
                else if (nr < 0)
                    kvd_error_set(e, KVD_EINTERNAL, "redis: %s:%d: %s", nd->host, nd->port, msg);
                if (nr == 0) {
                    kvd_error_set(e, KVD_EINTERNAL, "redis: %s:%d: CLUSTER SLOTS: no slots", host,
                                  nd->port);
                    nr = -1;
                }
                if (nr > 0) {
                    for (size_t s = 0; s < REDIS_CLUSTER_SLOTS; s++)
                        rc->slot_node[s] = NO_NODE;
                    result = 0;
                    for (int k = 0; k < nr; k++) {
                        uint16_t ni = node_find_add(rc, ranges[k].host, ranges[k].port);
                        if (ni == NO_NODE) {
                            result = kvd_error_set(e, KVD_EINTERNAL,
                                                   "redis: cluster: over %d nodes", MAX_NODES);
                            break;
                        }
                        for (unsigned s = ranges[k].start; s <= ranges[k].end; s++)
                            rc->slot_node[s] = ni;
                    }
                    if (result == 0) {
                        rc->map_loaded = true;
                        rc->need_refresh = false;
                    }
                }
                if (r)
                    freeReplyObject(r);
            }
            if (rc->map_reply) { /* the round failed after the reply came */
                freeReplyObject(rc->map_reply);
                rc->map_reply = NULL;
            }
        }
    }
    free(ranges);
    return result;
}

/* ---- the API ---- */

int redisconn_open(const struct redisconn_conf *c, struct redisconn **out, struct kvd_error *e)
{
    *out = NULL;
    if (!c)
        return kvd_error_set(e, KVD_EBADREQ, "redis: no configuration");
    if (c->timeout_ms == 0 || c->timeout_ms > 3600u * 1000u)
        return kvd_error_set(e, KVD_EBADREQ, "redis: timeout_ms must be 1..3600000");
    struct redisconn *rc = calloc(1, sizeof(*rc));
    if (!rc)
        return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
    int err = url_parse(c->url, &rc->url, e);
    if (err) {
        free(rc);
        return err;
    }
    rc->timeout_ms = c->timeout_ms;
    rc->cap_ops = 1;
    rc->ops = calloc(1, sizeof(*rc->ops));
    if (!rc->ops)
        goto oom;
    if (rc->url.cluster) {
        rc->slot_node = malloc(REDIS_CLUSTER_SLOTS * sizeof(*rc->slot_node));
        if (!rc->slot_node)
            goto oom;
        for (size_t s = 0; s < REDIS_CLUSTER_SLOTS; s++)
            rc->slot_node[s] = NO_NODE;
    }
    for (size_t i = 0; i < rc->url.n_hosts; i++)
        if (node_find_add(rc, rc->url.host[i], rc->url.port[i]) == NO_NODE)
            goto oom;
    *out = rc;
    return 0;
oom:
    redisconn_free(rc);
    return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
}

void redisconn_free(struct redisconn *rc)
{
    if (!rc)
        return;
    for (size_t i = 0; i < rc->n_nodes; i++) {
        if (rc->nodes[i].ctx)
            redisFree(rc->nodes[i].ctx);
        free(rc->nodes[i].sent);
    }
    free(rc->nodes);
    free(rc->pfds);
    free(rc->pidx);
    free(rc->slot_node);
    free(rc->arena);
    free(rc->ops);
    explicit_bzero(&rc->url, sizeof(rc->url));
    free(rc);
}

void redisconn_stats(const struct redisconn *rc, struct redisconn_stats *st)
{
    *st = rc->st;
}

bool redisconn_is_cluster(const struct redisconn *rc)
{
    return rc->url.cluster;
}

/* Checks the arguments and sizes the op table for n ops. */
static int ops_prepare(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                       struct kvd_error *e)
{
    if (n > REDISCONN_MAX_KEYS)
        return kvd_error_set(e, KVD_EBADREQ, "redis: %zu keys in one call, over %u", n,
                             REDISCONN_MAX_KEYS);
    for (size_t i = 0; i < n; i++)
        if (!keys[i].p && keys[i].n)
            return kvd_error_set(e, KVD_EBADREQ, "redis: key %zu has no bytes", i);
    if (n > rc->cap_ops) {
        struct rc_op *no = realloc(rc->ops, n * sizeof(*no));
        if (!no)
            return kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
        rc->ops = no;
        rc->cap_ops = n;
    }
    return 0;
}

static void key_op(struct rc_op *op, const char *cmd, const struct redisconn_buf *key)
{
    op->argc = 2;
    op->argv[0] = cmd;
    op->len[0] = strlen(cmd);
    op->argv[1] = key->p ? key->p : "";
    op->len[1] = key->n;
}

/* The error of op i's reply when it is a server error. */
static int reply_error(struct redisconn *rc, size_t i, const char *cmd, struct kvd_error *e)
{
    redisReply *r = rc->ops[i].reply;
    struct rnode *nd = &rc->nodes[rc->ops[i].node];
    if (r->type == REDIS_REPLY_ERROR)
        return kvd_error_set(e, KVD_EINTERNAL, "redis: %s:%d: %s of key %zu: %.*s", nd->host,
                             nd->port, cmd, i, (int)(r->len > 160 ? 160 : r->len), r->str);
    return kvd_error_set(e, KVD_EINTERNAL, "redis: %s:%d: %s of key %zu: a reply of type %d",
                         nd->host, nd->port, cmd, i, r->type);
}

/* Counts a failed call; returns -1. */
static int call_failed(struct redisconn *rc)
{
    rc->st.errors++;
    return -1;
}

/* n over REDISCONN_MAX_KEYS: refused before the output arrays are touched (n is not trusted). */
static int too_many(struct redisconn *rc, size_t n, struct kvd_error *e)
{
    kvd_error_set(e, KVD_EBADREQ, "redis: %zu keys in one call, over %u", n, REDISCONN_MAX_KEYS);
    return call_failed(rc);
}

int redisconn_get(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  struct redisconn_buf *vals, struct kvd_error *e)
{
    if (n > REDISCONN_MAX_KEYS)
        return too_many(rc, n, e);
    for (size_t i = 0; i < n; i++)
        vals[i] = (struct redisconn_buf){NULL, 0};
    if (n == 0)
        return 0;
    if (ops_prepare(rc, n, keys, e))
        return call_failed(rc);
    for (size_t i = 0; i < n; i++)
        key_op(&rc->ops[i], "GET", &keys[i]);
    if (run_ops(rc, n, e))
        return call_failed(rc);
    int err = 0;
    for (size_t i = 0; i < n; i++) {
        redisReply *r = rc->ops[i].reply;
        if (r->type == REDIS_REPLY_NIL)
            continue;
        if (r->type != REDIS_REPLY_STRING) {
            err = reply_error(rc, i, "GET", e);
            break;
        }
        if (r->elements) { /* in the arena already (arena_string) */
            vals[i].n = r->elements;
            continue;
        }
        /* A short value: hiredis's own string (len + 1 bytes), copied into the arena too, so
         * that every value of the call is owned alike. */
        if (arena_room(rc, r->len + 1)) {
            err = kvd_error_set(e, KVD_ENOMEM, "redis: out of memory");
            break;
        }
        memcpy(rc->arena + rc->arena_used, r->str, r->len + 1);
        r->integer = (long long)rc->arena_used;
        vals[i].n = r->len;
        rc->arena_used += r->len + 1;
    }
    if (!err) /* the arena does not move any more: the pointers now */
        for (size_t i = 0; i < n; i++)
            if (rc->ops[i].reply->type == REDIS_REPLY_STRING)
                vals[i].p = rc->arena + rc->ops[i].reply->integer;
    ops_free_replies(rc, n);
    if (err) {
        for (size_t i = 0; i < n; i++)
            vals[i] = (struct redisconn_buf){NULL, 0};
        return call_failed(rc);
    }
    return 0;
}

int redisconn_exists(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                     bool *present, struct kvd_error *e)
{
    if (n > REDISCONN_MAX_KEYS)
        return too_many(rc, n, e);
    for (size_t i = 0; i < n; i++)
        present[i] = false;
    if (n == 0)
        return 0;
    if (ops_prepare(rc, n, keys, e))
        return call_failed(rc);
    for (size_t i = 0; i < n; i++)
        key_op(&rc->ops[i], "EXISTS", &keys[i]);
    if (run_ops(rc, n, e))
        return call_failed(rc);
    int err = 0;
    for (size_t i = 0; i < n; i++) {
        redisReply *r = rc->ops[i].reply;
        if (r->type != REDIS_REPLY_INTEGER || r->integer < 0 || r->integer > 1) {
            err = reply_error(rc, i, "EXISTS", e);
            break;
        }
        present[i] = r->integer == 1;
    }
    ops_free_replies(rc, n);
    if (err) {
        for (size_t i = 0; i < n; i++)
            present[i] = false;
        return call_failed(rc);
    }
    return 0;
}

int redisconn_set(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  const struct redisconn_buf *vals, uint32_t ttl_s, struct kvd_error *e)
{
    if (n == 0)
        return 0;
    if (ops_prepare(rc, n, keys, e))
        return call_failed(rc);
    char ttl[16];
    int tl = snprintf(ttl, sizeof(ttl), "%u", ttl_s);
    for (size_t i = 0; i < n; i++) {
        if (!vals[i].p && vals[i].n) {
            kvd_error_set(e, KVD_EBADREQ, "redis: value %zu has no bytes", i);
            return call_failed(rc);
        }
        struct rc_op *op = &rc->ops[i];
        key_op(op, "SET", &keys[i]);
        op->argv[2] = vals[i].p ? vals[i].p : "";
        op->len[2] = vals[i].n;
        op->argc = 3;
        if (ttl_s) {
            op->argv[3] = "EX";
            op->len[3] = 2;
            op->argv[4] = ttl;
            op->len[4] = (size_t)tl;
            op->argc = 5;
        }
    }
    if (run_ops(rc, n, e))
        return call_failed(rc);
    int err = 0;
    for (size_t i = 0; i < n; i++) {
        redisReply *r = rc->ops[i].reply;
        if (r->type != REDIS_REPLY_STATUS || r->len != 2 || memcmp(r->str, "OK", 2) != 0) {
            err = reply_error(rc, i, "SET", e);
            break;
        }
    }
    ops_free_replies(rc, n);
    return err ? call_failed(rc) : 0;
}

int redisconn_del(struct redisconn *rc, size_t n, const struct redisconn_buf *keys,
                  struct kvd_error *e)
{
    if (n == 0)
        return 0;
    if (ops_prepare(rc, n, keys, e))
        return call_failed(rc);
    for (size_t i = 0; i < n; i++)
        key_op(&rc->ops[i], "DEL", &keys[i]);
    if (run_ops(rc, n, e))
        return call_failed(rc);
    int err = 0;
    for (size_t i = 0; i < n; i++) {
        redisReply *r = rc->ops[i].reply;
        if (r->type != REDIS_REPLY_INTEGER || r->integer < 0) {
            err = reply_error(rc, i, "DEL", e);
            break;
        }
    }
    ops_free_replies(rc, n);
    return err ? call_failed(rc) : 0;
}

int redisconn_ping(struct redisconn *rc, struct kvd_error *e)
{
    if (rc->slot_node) {
        /* a full slot map from one node: the cluster answers and is set up */
        struct kvd_error me;
        if (refresh_map(rc, &me)) {
            if (e)
                *e = me;
            return call_failed(rc);
        }
        return 0;
    }
    struct rc_op *op = &rc->ops[0]; /* cap_ops >= 1 */
    op->argc = 1;
    op->argv[0] = "PING";
    op->len[0] = 4;
    if (run_ops(rc, 1, e))
        return call_failed(rc);
    redisReply *r = op->reply;
    int err = 0;
    if (r->type != REDIS_REPLY_STATUS || r->len != 4 || memcmp(r->str, "PONG", 4) != 0)
        err = reply_error(rc, 0, "PING", e);
    ops_free_replies(rc, 1);
    return err ? call_failed(rc) : 0;
}

/* kvmm_remote: the memory manager's side of the remote tier (kvmm.h "the
 * remote tier"). Two flows, neither on the event loop or in an executor
 * step:
 *   write-through  a tree block of a tenant with remote on whose value is due
 *                  (its group of K blocks is complete, or a commit or match
 *                  ended at it, and it has min_hits reuses) is queued; the
 *                  writer thread copies the value's blocks out under the
 *                  lock, seals them (remote_value.h) and SETs them with the
 *                  lock released;
 *   prefetch       a request's blocks past the tree are fetched in one
 *                  pipelined GET round on the calling worker thread, every
 *                  value opened and checked against the prompt, and enter
 *                  the tree as host blocks before the request is scheduled.
 * Value k of a chain holds its blocks [k×K, (k+1)×K) and is named by the last
 * one; a tail value [k×K, j] is named by block j. A reader of a prompt of nb
 * whole blocks, of which the tree holds m, asks for the groups from m's on
 * and the tail ending at nb-1, all in one round.
 * A failed round (error or timeout) makes the tier rest for a second: what
 * comes meanwhile is recomputed (lookups) or dropped (writes), and counted.
 * KV events: a value this daemon wrote is announced block by block as
 * REMOTE BlockStored (with events attached), and remembered until it is
 * known gone: its TTL passed (Redis expires keys at exactly that time), a
 * lookup found it missing (evicted, flushed) or refused it (tampered,
 * another fleet key, overwritten), or AllBlocksCleared; then its blocks
 * are REMOTE BlockRemoved. Redis's own evictions are not watched (keyspace
 * notifications would need a subscription per node): until a lookup
 * notices, a router may send a request here for a value that is gone,
 * which costs that request its recomputation, never a wrong token. */
#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fault.h"
#include "kvmm_impl.h"
#include "log.h"
#include "redisconn.h"
#include "remote_value.h"

#define REST_NS 1000000000ull /* after a failed round */
#define QUEUE_MAX 65536       /* values waiting for the writer */
#define POOL_CONNS 64         /* idle connections kept for prefetch */

struct rq_item {
    uint32_t id;
    uint32_t idx; /* chain index */
    struct blockkey key;
    bool tail;
};

/* A value this daemon wrote and announced (REMOTE BlockStored): its
 * blocks' published hashes and owners, by (namespace hash, naming key).
 * Open addressing with tombstones, under the kvmm lock. */
struct ann_blk {
    uint64_t pub;
    uint32_t tenant;
};
struct ann {
    uint64_t ns;
    struct blockkey key;
    uint64_t expires; /* monotonic ns; UINT64_MAX: no TTL */
    struct ann_blk *b;
    uint32_t n;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
};
/* Announced values in the order they expire (the TTL is one for all, so
 * write order); an entry whose value was written again since is stale. */
struct ann_due {
    uint64_t ns;
    struct blockkey key;
    uint64_t expires;
};
#define ANN_MAX (1u << 20) /* values remembered at most; more are not announced */

/* A connection and the stats of it already counted. */
struct rconn {
    struct redisconn *rc;
    struct redisconn_stats seen;
};

struct kvmm_remote {
    struct kvmm *mm;
    struct remote_fleet_key key;
    char url[1024];
    uint32_t timeout_ms, ttl_s, min_hits, k;
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu; /* the writer's wake, the idle connections */
    pthread_cond_t wake, idle;
    bool writing;
    struct rconn *conns[POOL_CONNS];
    size_t n_conns;
    _Atomic uint64_t rest_until; /* monotonic ns */
    /* Under the kvmm lock: */
    struct radix_node **nodes; /* (k) the writer's: a value's nodes */
    struct rq_item *q;
    size_t q_head, q_n, q_cap;
    struct ann *anns; /* (ann_cap, a power of two) */
    size_t ann_cap, ann_used, ann_live;
    struct ann_due *due; /* FIFO: due[due_head, due_n) */
    size_t due_head, due_n, due_cap;
    /* The writer's: what the value being written will announce. */
    struct ann_blk *ev_b; /* (k) */
    uint32_t *ev_toks;    /* (k * block_tokens) */
    uint32_t ev_n;
    uint64_t ev_ns, ev_parent;
    bool ev_on, ev_has_parent;
    /* Counters (atomics: the writer and the workers count without the lock). */
    atomic_uint_fast64_t hits, misses, bytes_in, bytes_out, rounds, lat_sum, lat_last, errors,
        timeouts, skipped, auth_failures, mismatches, writes, write_skips, backoffs, connect_fails,
        reconnects, moved, ask, ev_stored, ev_removed;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static bool resting(struct kvmm_remote *r)
{
    if (now_ns() < atomic_load(&r->rest_until)) {
        atomic_fetch_add(&r->skipped, 1);
        return true;
    }
    return false;
}

/* A failure: the tier rests for REST_NS from now. A failure that comes
 * while it is up starts a new back-off (counted); one during a rest (a
 * round that was already in flight) extends it. */
static void back_off(struct kvmm_remote *r)
{
    uint64_t t = now_ns();
    if (atomic_exchange(&r->rest_until, t + REST_NS) <= t)
        atomic_fetch_add(&r->backoffs, 1);
}

/* ---- connections --------------------------------------------------------- */

static void conn_count(struct kvmm_remote *r, struct rconn *c)
{
    struct redisconn_stats st;
    redisconn_stats(c->rc, &st);
    atomic_fetch_add(&r->errors, st.errors - c->seen.errors);
    atomic_fetch_add(&r->timeouts, st.timeouts - c->seen.timeouts);
    atomic_fetch_add(&r->connect_fails, st.connect_fails - c->seen.connect_fails);
    atomic_fetch_add(&r->reconnects, st.reconnects - c->seen.reconnects);
    atomic_fetch_add(&r->moved, st.moved - c->seen.moved);
    atomic_fetch_add(&r->ask, st.ask - c->seen.ask);
    c->seen = st;
}

/* An idle connection, or a new one; NULL (counted, and the tier rests)
 * when none can be opened. */
static struct rconn *conn_take(struct kvmm_remote *r)
{
    pthread_mutex_lock(&r->mu);
    struct rconn *c = r->n_conns ? r->conns[--r->n_conns] : NULL;
    pthread_mutex_unlock(&r->mu);
    if (c)
        return c;
    c = calloc(1, sizeof *c);
    struct redisconn_conf cf = {.url = r->url, .timeout_ms = r->timeout_ms};
    struct kvd_error e = {0};
    if (!c || redisconn_open(&cf, &c->rc, &e) != 0) {
        free(c);
        atomic_fetch_add(&r->errors, 1);
        back_off(r);
        log_msg(LOG_LVL_DEBUG, "remote tier: %s", e.message);
        return NULL;
    }
    redisconn_stats(c->rc, &c->seen);
    return c;
}

/* Gives c back after a round; rc: the round's result (a failure makes the
 * tier rest). */
static void conn_give(struct kvmm_remote *r, struct rconn *c, int rc)
{
    conn_count(r, c);
    if (rc != 0)
        back_off(r);
    pthread_mutex_lock(&r->mu);
    if (r->n_conns < POOL_CONNS) {
        r->conns[r->n_conns++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    if (c) {
        redisconn_free(c->rc);
        free(c);
    }
}

/* ---- write-through --------------------------------------------------------- */

static bool tenant_remote(const struct kvmm *mm, uint32_t tenant)
{
    return tenant_live(&mm->tt, tenant) && mm->tt.v[tenant].conf.remote;
}

static void q_push(struct kvmm_remote *r, struct rq_item it)
{
    if (r->q_head > 0 && r->q_head * 2 >= r->q_n) {
        memmove(r->q, r->q + r->q_head, sizeof *r->q * (r->q_n - r->q_head));
        r->q_n -= r->q_head;
        r->q_head = 0;
    }
    if (r->q_n - r->q_head >= QUEUE_MAX) {
        atomic_fetch_add(&r->write_skips, 1);
        return;
    }
    if (r->q_n == r->q_cap) {
        size_t cap = r->q_cap ? 2 * r->q_cap : 256;
        struct rq_item *v = fault_realloc(r->q, sizeof *v * cap);
        if (!v) {
            atomic_fetch_add(&r->write_skips, 1);
            return;
        }
        r->q = v;
        r->q_cap = cap;
    }
    r->q[r->q_n++] = it;
    pthread_cond_signal(&r->wake);
}

/* Lock held: queues the value ending at node's block (idx) when it is due. */
static void want_value(struct kvmm *mm, struct radix_node *node, size_t idx, bool tail)
{
    struct kvmm_remote *r = mm->remote;
    if (!r || !node || node->block == POOL_NONE || idx >= UINT32_MAX)
        return;
    struct pool_block *b = pool_block(&mm->pool, node->block);
    unsigned bit = tail ? POOL_REMOTE_TAIL : POOL_REMOTE_FULL;
    if ((b->remote & bit) || b->hits < r->min_hits || !tenant_remote(mm, b->tenant))
        return;
    b->remote |= (uint8_t)bit;
    q_push(r, (struct rq_item){node->block, (uint32_t)idx, b->key, tail});
}

void mm_remote_used(struct kvmm *mm, struct radix_node *node, size_t idx)
{
    if (mm->remote && idx % mm->remote->k == mm->remote->k - 1)
        want_value(mm, node, idx, false);
}

void mm_remote_chain_end(struct kvmm *mm, struct radix_node *node, size_t idx)
{
    if (mm->remote && idx % mm->remote->k != mm->remote->k - 1)
        want_value(mm, node, idx, true);
}

/* ---- KV events of values ------------------------------------------------ */

static size_t ann_slot(const struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    return (size_t)((k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull) ^ ns) & (r->ann_cap - 1));
}

/* Lock held. The announced value (ns, key), or NULL. */
static struct ann *ann_find(struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    if (!r->ann_cap)
        return NULL;
    for (size_t i = ann_slot(r, ns, k), n = 0; n < r->ann_cap;
         i = (i + 1) & (r->ann_cap - 1), n++) {
        struct ann *a = &r->anns[i];
        if (a->state == 0)
            return NULL;
        if (a->state == 1 && a->ns == ns && blockkey_eq(a->key, k))
            return a;
    }
    return NULL;
}

/* Lock held: a free slot for (ns, k), growing the table; NULL when out of
 * memory or full. */
static struct ann *ann_new(struct kvmm_remote *r, uint64_t ns, struct blockkey k)
{
    if (r->ann_live >= ANN_MAX)
        return NULL;
    if ((r->ann_used + 1) * 2 > r->ann_cap) { /* rehash the live ones */
        size_t cap = r->ann_cap ? r->ann_cap : 256;
        while ((r->ann_live + 1) * 4 > cap)
            cap *= 2;
        struct ann *nv = calloc(cap, sizeof *nv), *old = r->anns;
        size_t old_cap = r->ann_cap;
        if (!nv)
            return NULL;
        r->anns = nv;
        r->ann_cap = cap;
        r->ann_used = r->ann_live = 0;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].state == 1) {
                size_t j = ann_slot(r, old[i].ns, old[i].key);
                while (r->anns[j].state != 0)
                    j = (j + 1) & (cap - 1);
                r->anns[j] = old[i];
                r->ann_used++;
                r->ann_live++;
            }
        free(old);
    }
    size_t i = ann_slot(r, ns, k);
    while (r->anns[i].state == 1)
        i = (i + 1) & (r->ann_cap - 1);
    if (r->anns[i].state == 0)
        r->ann_used++;
    r->ann_live++;
    r->anns[i] = (struct ann){.ns = ns, .key = k, .state = 1};
    return &r->anns[i];
}

/* Lock held: the value is gone: REMOTE BlockRemoved for its blocks. */
static void ann_gone(struct kvmm *mm, struct ann *a)
{
    struct kvmm_remote *r = mm->remote;
    for (uint32_t i = 0; i < a->n; i++) {
        struct kvmm_block_event ev = {.stored = false,
                                      .medium = KVMM_MEDIUM_REMOTE,
                                      .tenant = a->b[i].tenant,
                                      .hash = a->b[i].pub};
        kvmm_events_emit(mm, &ev);
    }
    free(a->b);
    a->b = NULL;
    a->state = 2;
    r->ann_live--;
    atomic_fetch_add(&r->ev_removed, a->n);
}

/* Lock held: a lookup found the value named (ns, key) missing or unusable. */
static void ann_lost(struct kvmm *mm, uint64_t ns, struct blockkey key)
{
    struct ann *a = ann_find(mm->remote, ns, key);
    if (a)
        ann_gone(mm, a);
}

/* Lock held: values whose TTL has passed. */
static void ann_expire(struct kvmm *mm)
{
    struct kvmm_remote *r = mm->remote;
    uint64_t t = now_ns();
    while (r->due_head < r->due_n && r->due[r->due_head].expires <= t) {
        struct ann_due d = r->due[r->due_head++];
        struct ann *a = ann_find(r, d.ns, d.key);
        if (a && a->expires == d.expires)
            ann_gone(mm, a);
    }
    if (r->due_head == r->due_n)
        r->due_head = r->due_n = 0;
}

/* Lock held: forgets every announced value (AllBlocksCleared said so). */
void mm_remote_cleared(struct kvmm *mm)
{
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return;
    for (size_t i = 0; i < r->ann_cap; i++)
        free(r->anns[i].b);
    free(r->anns);
    free(r->due);
    r->anns = NULL;
    r->due = NULL;
    r->ann_cap = r->ann_used = r->ann_live = 0;
    r->due_head = r->due_n = r->due_cap = 0;
}

/* Lock held: the value just written (r->ev_*, named by key) is announced:
 * REMOTE BlockStored for its blocks, one chain. */
static void ann_written(struct kvmm *mm, struct blockkey key)
{
    struct kvmm_remote *r = mm->remote;
    if (!r->ev_on || !mm->events.block || r->ev_n == 0)
        return;
    struct ann *a = ann_find(r, r->ev_ns, key);
    struct ann_blk *b = malloc(sizeof *b * r->ev_n);
    if (!b)
        return;
    if (!a && !(a = ann_new(r, r->ev_ns, key))) {
        free(b);
        return;
    }
    uint64_t expires = r->ttl_s ? now_ns() + (uint64_t)r->ttl_s * 1000000000ull : UINT64_MAX;
    if (expires != UINT64_MAX) {
        if (r->due_head > 0 && r->due_head * 2 >= r->due_n) {
            memmove(r->due, r->due + r->due_head, sizeof *r->due * (r->due_n - r->due_head));
            r->due_n -= r->due_head;
            r->due_head = 0;
        }
        if (r->due_n == r->due_cap) {
            size_t cap = r->due_cap ? 2 * r->due_cap : 256;
            struct ann_due *v = fault_realloc(r->due, sizeof *v * cap);
            if (!v) { /* not remembered: not announced */
                free(b);
                free(a->b);
                a->b = NULL;
                a->state = 2;
                r->ann_live--;
                return;
            }
            r->due = v;
            r->due_cap = cap;
        }
        r->due[r->due_n++] = (struct ann_due){r->ev_ns, key, expires};
    }
    memcpy(b, r->ev_b, sizeof *b * r->ev_n);
    free(a->b);
    a->b = b;
    a->n = r->ev_n;
    a->expires = expires;
    uint32_t bt = mm->geom.block_tokens;
    for (uint32_t i = 0; i < r->ev_n; i++) {
        struct kvmm_block_event ev = {.stored = true,
                                      .medium = KVMM_MEDIUM_REMOTE,
                                      .tenant = b[i].tenant,
                                      .hash = b[i].pub,
                                      .has_parent = i > 0 || r->ev_has_parent,
                                      .parent = i > 0 ? b[i - 1].pub : r->ev_parent,
                                      .tokens = r->ev_toks + (size_t)i * bt,
                                      .n_tokens = bt};
        kvmm_events_emit(mm, &ev);
    }
    atomic_fetch_add(&r->ev_stored, r->ev_n);
}

/* Lock held: copies the value of item it into a new buffer (*buf, *len,
 * *rkey); false when it is no longer due or its blocks cannot be read. */
static bool value_build(struct kvmm_remote *r, struct rq_item it, void **buf, size_t *len,
                        uint8_t rkey[REMOTE_KEY_BYTES])
{
    struct kvmm *mm = r->mm;
    struct pool_block *b = pool_block(&mm->pool, it.id);
    if (!b->used || !b->node || !blockkey_eq(b->key, it.key))
        return false;
    struct radix_node *end = b->node;
    if (it.tail && end->n_children) /* the chain went on: a later tail covers it */
        return false;
    uint32_t first = it.idx / r->k * r->k, n = it.idx - first + 1;
    struct radix_node **nodes = r->nodes, *x = end;
    for (uint32_t i = n; i-- > 0;) {
        if (!x || !x->parent)
            return false;
        nodes[i] = x;
        x = x->parent;
    }
    if (!x || (first == 0) != (x->parent == NULL))
        return false; /* the index was not this node's depth */
    struct remote_value_meta m = {.block_tokens = mm->geom.block_tokens,
                                  .block_bytes = mm->block_bytes,
                                  .first = first,
                                  .n = n,
                                  .parent = mm_node_key(mm, x),
                                  .last = it.key};
    snprintf(m.ns_name, sizeof m.ns_name, "%s", mm->tt.ns_names[end->ns]);
    m.ns_hash = blockkey_ns(m.ns_name);
    *len = remote_value_size(&m);
    *buf = *len ? fault_malloc(*len) : NULL;
    if (!*buf)
        return false;
    uint32_t *toks;
    void *data;
    remote_value_layout(&m, *buf, &toks, &data);
    for (uint32_t i = 0; i < n; i++) {
        memcpy(toks + (size_t)i * m.block_tokens, nodes[i]->tokens,
               sizeof(uint32_t) * m.block_tokens);
        if (!mm_disk_copy_out(mm, nodes[i]->block, (char *)data + (size_t)i * m.block_bytes)) {
            free(*buf);
            *buf = NULL;
            return false;
        }
    }
    remote_value_key(m.ns_hash, it.key, rkey);
    /* What the value's REMOTE BlockStored will say, taken while its blocks
     * are in the tree (their published hashes are valid). */
    r->ev_on = mm->events.block != NULL && r->ev_b && r->ev_toks;
    if (r->ev_on) {
        r->ev_n = n;
        r->ev_ns = m.ns_hash;
        r->ev_has_parent = x->parent != NULL;
        r->ev_parent = x->parent ? mm->pool.blocks[x->block].pub : 0;
        memcpy(r->ev_toks, toks, sizeof(uint32_t) * m.block_tokens * n);
        for (uint32_t i = 0; i < n; i++)
            r->ev_b[i] = (struct ann_blk){mm->pool.blocks[nodes[i]->block].pub,
                                          mm->pool.blocks[nodes[i]->block].tenant};
    }
    return true;
}

/* Writes one queued value; false when the queue was empty. */
static bool write_one(struct kvmm_remote *r)
{
    struct kvmm *mm = r->mm;
    void *buf = NULL;
    size_t len = 0;
    uint8_t rkey[REMOTE_KEY_BYTES];
    kvmm_lock(mm);
    if (r->q_head == r->q_n) {
        r->q_head = r->q_n = 0;
        kvmm_unlock(mm);
        return false;
    }
    struct rq_item it = r->q[r->q_head++];
    bool ok = value_build(r, it, &buf, &len, rkey);
    struct pool_block *b = pool_block(&mm->pool, it.id);
    unsigned bit = it.tail ? POOL_REMOTE_TAIL : POOL_REMOTE_FULL;
    if (!ok && b->used && blockkey_eq(b->key, it.key) &&
        !(it.tail && b->node && b->node->n_children))
        b->remote &= (uint8_t)~bit; /* not written: may be queued again */
    kvmm_unlock(mm);
    if (!ok) {
        atomic_fetch_add(&r->write_skips, 1);
        return true;
    }
    int rc = -1;
    struct rconn *c = NULL;
    if (remote_value_seal(&r->key, rkey, buf, len) == 0 && !resting(r) && (c = conn_take(r))) {
        struct redisconn_buf k = {rkey, sizeof rkey}, v = {buf, len};
        struct kvd_error e = {0};
        rc = redisconn_set(c->rc, 1, &k, &v, r->ttl_s, &e);
        conn_give(r, c, rc);
        if (rc == 0) {
            atomic_fetch_add(&r->writes, 1);
            atomic_fetch_add(&r->bytes_out, len);
            kvmm_lock(mm);
            ann_written(mm, it.key);
            kvmm_unlock(mm);
        } else {
            log_msg(LOG_LVL_DEBUG, "remote tier: write: %s", e.message);
        }
    }
    if (rc != 0) {
        atomic_fetch_add(&r->write_skips, 1);
        kvmm_lock(mm);
        if (b->used && blockkey_eq(b->key, it.key))
            b->remote &= (uint8_t)~bit;
        kvmm_unlock(mm);
    }
    free(buf);
    return true;
}

static void *writer_main(void *arg)
{
    struct kvmm_remote *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!atomic_load(&r->stop)) {
        r->writing = true;
        pthread_mutex_unlock(&r->mu);
        kvmm_lock(r->mm);
        ann_expire(r->mm);
        kvmm_unlock(r->mm);
        size_t n = 0;
        while (!atomic_load(&r->stop) && write_one(r))
            n++;
        pthread_mutex_lock(&r->mu);
        r->writing = false;
        pthread_cond_broadcast(&r->idle);
        if (n == 0 && !atomic_load(&r->stop)) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_nsec += 50 * 1000000L; /* wakes on a push too */
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&r->wake, &r->mu, &ts);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int kvmm_remote_flush(struct kvmm *mm, uint32_t timeout_ms)
{
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return 0;
    uint64_t until = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        kvmm_lock(mm);
        bool empty = r->q_head == r->q_n;
        kvmm_unlock(mm);
        pthread_mutex_lock(&r->mu);
        bool busy = r->writing;
        if (!empty)
            pthread_cond_signal(&r->wake);
        pthread_mutex_unlock(&r->mu);
        if (empty && !busy)
            return 0;
        if (now_ns() >= until)
            return KVD_EBUSY;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
}

/* ---- open, free -------------------------------------------------------- */

int kvmm_remote_open(struct kvmm *mm, const struct kvmm_remote_conf *c, struct kvd_error *e)
{
    if (mm->remote)
        return kvd_error_set(e, KVD_EBADREQ, "remote tier: already open");
    if (!c->url || strlen(c->url) >= sizeof(((struct kvmm_remote *)0)->url))
        return kvd_error_set(e, KVD_EBADREQ, "remote: the URL is missing or too long");
    int rc = redisconn_url_check(c->url, e);
    if (rc)
        return rc;
    struct kvmm_remote *r = calloc(1, sizeof *r);
    if (!r)
        return kvd_error_set(e, KVD_ENOMEM, "remote tier: out of memory");
    if (c->key_file && c->key_file[0]) {
        if ((rc = remote_fleet_key_load(c->key_file, &r->key, e)) != 0) {
            free(r);
            return rc;
        }
    } else if (!c->insecure) {
        free(r);
        return kvd_error_set(e, KVD_EBADREQ,
                             "remote: needs remote-key-file (64 hex digits, mode 0600: the fleet "
                             "key that seals every value), or remote-insecure = true to store "
                             "values that Redis can read and forge");
    }
    snprintf(r->url, sizeof r->url, "%s", c->url);
    r->mm = mm;
    r->timeout_ms = c->timeout_ms ? c->timeout_ms : 100;
    r->ttl_s = c->ttl_s;
    r->min_hits = c->min_hits;
    uint64_t vb = c->value_bytes ? c->value_bytes : (uint64_t)4 << 20;
    uint64_t per = mm->block_bytes + (uint64_t)4 * mm->geom.block_tokens;
    uint64_t k = vb / per;
    r->k = k < 1 ? 1 : k > 1024 ? 1024 : (uint32_t)k;
    r->ev_b = malloc(sizeof *r->ev_b * r->k);
    r->ev_toks = malloc(sizeof *r->ev_toks * r->k * mm->geom.block_tokens);
    if (!(r->nodes = malloc(sizeof *r->nodes * r->k)) || !r->ev_b || !r->ev_toks) {
        free(r->nodes);
        free(r->ev_b);
        free(r->ev_toks);
        free(r);
        return kvd_error_set(e, KVD_ENOMEM, "remote tier: out of memory");
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->wake, &ca);
    pthread_cond_init(&r->idle, &ca);
    pthread_condattr_destroy(&ca);
    kvmm_lock(mm);
    mm->remote = r;
    kvmm_unlock(mm);
    if (pthread_create(&r->thread, NULL, writer_main, r) != 0) {
        kvmm_lock(mm);
        mm->remote = NULL;
        kvmm_unlock(mm);
        pthread_cond_destroy(&r->wake);
        pthread_cond_destroy(&r->idle);
        pthread_mutex_destroy(&r->mu);
        free(r->nodes);
        free(r->ev_b);
        free(r->ev_toks);
        free(r);
        return kvd_error_set(e, KVD_EINTERNAL, "remote tier: cannot start the writer thread");
    }
    r->started = true;
    log_msg(LOG_LVL_INFO, "remote tier: %s, %u blocks per value%s", c->url, r->k,
            r->key.secure ? "" : ", INSECURE (no fleet key: checksums only)");
    return 0;
}

bool kvmm_remote_on(const struct kvmm *mm)
{
    return mm->remote != NULL;
}

void mm_remote_free(struct kvmm *mm)
{
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    atomic_store(&r->stop, true);
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mu);
    if (r->started)
        pthread_join(r->thread, NULL);
    mm->remote = NULL;
    for (size_t i = 0; i < r->n_conns; i++) {
        redisconn_free(r->conns[i]->rc);
        free(r->conns[i]);
    }
    free(r->q);
    free(r->nodes);
    free(r->ev_b);
    free(r->ev_toks);
    for (size_t i = 0; i < r->ann_cap; i++)
        free(r->anns[i].b);
    free(r->anns);
    free(r->due);
    sodium_memzero(&r->key, sizeof r->key);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->idle);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* ---- prefetch ------------------------------------------------------------ */

bool kvmm_remote_may_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                              size_t n)
{
    size_t nb = n / mm->geom.block_tokens;
    if (!mm->remote || nb == 0)
        return false;
    struct radix_node **scratch = malloc(sizeof *scratch * nb);
    if (!scratch)
        return false;
    struct blockkey key;
    kvmm_lock(mm);
    bool ok = mm_ns_ok(mm, ns) && tenant_remote(mm, tenant) &&
              mm_cached_prefix(mm, ns, tokens, nb, scratch, &key) < nb;
    kvmm_unlock(mm);
    free(scratch);
    return ok;
}

size_t kvmm_remote_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                            size_t n)
{
    struct kvmm_remote *r = mm->remote;
    uint32_t bt = mm->geom.block_tokens, K;
    size_t nb = n / bt, m = 0, restored = 0;
    if (!r || nb == 0 || nb > UINT32_MAX)
        return 0;
    K = r->k;
    struct radix_node **scratch = malloc(sizeof *scratch * nb);
    struct blockkey *chain = malloc(sizeof *chain * nb), key, root;
    size_t max_keys = nb / K + 3;
    struct redisconn_buf *keys = calloc(max_keys, sizeof *keys);
    struct redisconn_buf *vals = calloc(max_keys, sizeof *vals);
    uint8_t(*rkeys)[REMOTE_KEY_BYTES] = malloc(REMOTE_KEY_BYTES * max_keys);
    uint32_t *ends = malloc(sizeof *ends * max_keys);
    struct remote_value_meta want = {.block_tokens = bt, .block_bytes = mm->block_bytes};
    size_t nk = 0, n_groups = 0;
    bool ok = scratch && chain && keys && vals && rkeys && ends;
    if (ok) {
        kvmm_lock(mm);
        ok = mm_ns_ok(mm, ns) && tenant_remote(mm, tenant);
        if (ok) {
            m = mm_cached_prefix(mm, ns, tokens, nb, scratch, &key);
            snprintf(want.ns_name, sizeof want.ns_name, "%s", mm->tt.ns_names[ns]);
            root = mm->root_key;
        }
        kvmm_unlock(mm);
        ok = ok && m < nb && !resting(r);
    }
    if (ok) {
        want.ns_hash = blockkey_ns(want.ns_name);
        struct blockkey p = root;
        for (size_t b = 0; b < nb; b++)
            p = chain[b] = blockkey_next(p, tokens + b * bt, bt);
        for (size_t g = m / K; (g + 1) * K <= nb; g++)
            ends[nk++] = (uint32_t)((g + 1) * K - 1);
        n_groups = nk;
        /* Tails: the prompt's last whole block, or the one before (where a
         * match of every token but the last ended), longest first. */
        for (size_t d = 1; d <= 2 && d <= nb; d++)
            if (nb - d >= m && (nb - d) % K != K - 1)
                ends[nk++] = (uint32_t)(nb - d);
        for (size_t i = 0; i < nk; i++) {
            remote_value_key(want.ns_hash, chain[ends[i]], rkeys[i]);
            keys[i] = (struct redisconn_buf){rkeys[i], REMOTE_KEY_BYTES};
        }
    }
    struct rconn *c = ok && nk ? conn_take(r) : NULL;
    if (c) {
        struct kvd_error e = {0};
        uint64_t t0 = now_ns();
        int rc = redisconn_get(c->rc, nk, keys, vals, &e);
        uint64_t dt = now_ns() - t0;
        conn_give(r, c, rc);
        atomic_fetch_add(&r->rounds, 1);
        atomic_fetch_add(&r->lat_sum, dt);
        atomic_store(&r->lat_last, dt);
        if (rc != 0) {
            log_msg(LOG_LVL_DEBUG, "remote tier: lookup: %s", e.message);
            memset(vals, 0, sizeof *vals * max_keys);
            nk = 0;
        }
    }
    /* The values in chain order: each restores the blocks from the tree's
     * end to its own end, and the first missing or bad one ends it. */
    size_t at = m;
    bool going = c != NULL;
    for (size_t i = 0; i < nk; i++) {
        atomic_fetch_add(&r->bytes_in, vals[i].n);
        if (!going || ends[i] < at)
            continue; /* stopped, or a shorter tail after a longer one */
        if (!vals[i].p) {
            atomic_fetch_add(&r->misses, 1);
            kvmm_lock(mm);
            ann_lost(mm, want.ns_hash, chain[ends[i]]);
            kvmm_unlock(mm);
            going = i >= n_groups; /* a missing tail: the next may be there */
            continue;
        }
        struct remote_value_view v;
        enum remote_value_status st =
            remote_value_open(&r->key, rkeys[i], (void *)vals[i].p, vals[i].n, &v);
        if (st == REMOTE_VALUE_OK)
            st = remote_value_check(&v, &want, ends[i], tokens, chain, root);
        if (st == REMOTE_VALUE_OK && v.m.first > at)
            st = REMOTE_VALUE_MISMATCH; /* a gap: it does not reach back to the tree */
        if (st != REMOTE_VALUE_OK) {
            atomic_fetch_add(st == REMOTE_VALUE_MISMATCH ? &r->mismatches : &r->auth_failures, 1);
            kvmm_lock(mm);
            ann_lost(mm, want.ns_hash, chain[ends[i]]);
            kvmm_unlock(mm);
            going = i >= n_groups;
            continue;
        }
        kvmm_lock(mm);
        for (size_t b = at; going && b <= ends[i]; b++) {
            /* The namespace may have been removed, and its id reused, meanwhile. */
            struct radix_node *parent =
                mm_ns_ok(mm, ns) && strcmp(mm->tt.ns_names[ns], want.ns_name) == 0
                    ? mm_parent_of(mm, ns, tokens, b, scratch)
                    : NULL;
            const uint32_t *toks = tokens + b * bt;
            const char *data = (const char *)v.data + (b - v.m.first) * mm->block_bytes;
            going = parent != NULL;
            if (going && !radix_child(&mm->radix, parent, toks,
                                      radix_hash(&mm->radix, parent->hash, toks))) {
                going = mm_restore_block(mm, tenant, ns, parent, toks, chain[b], data, false);
                if (going) {
                    restored++;
                    atomic_fetch_add(&r->hits, 1);
                }
            }
            if (going)
                at = b + 1;
        }
        kvmm_unlock(mm);
    }
    for (size_t i = 0; vals && i < max_keys; i++)
        free((void *)vals[i].p);
    free(scratch);
    free(chain);
    free(keys);
    free(vals);
    free(rkeys);
    free(ends);
    return restored;
}

void kvmm_remote_stats(struct kvmm *mm, struct kvmm_remote_stats *st)
{
    memset(st, 0, sizeof *st);
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return;
    st->on = true;
    st->blocks_per_value = r->k;
    st->hits = atomic_load(&r->hits);
    st->misses = atomic_load(&r->misses);
    st->bytes_in = atomic_load(&r->bytes_in);
    st->bytes_out = atomic_load(&r->bytes_out);
    st->rounds = atomic_load(&r->rounds);
    st->latency_ns_sum = atomic_load(&r->lat_sum);
    st->latency_ns_last = atomic_load(&r->lat_last);
    st->errors = atomic_load(&r->errors);
    st->timeouts = atomic_load(&r->timeouts);
    st->skipped = atomic_load(&r->skipped);
    st->auth_failures = atomic_load(&r->auth_failures);
    st->mismatches = atomic_load(&r->mismatches);
    st->writes = atomic_load(&r->writes);
    st->write_skips = atomic_load(&r->write_skips);
    st->backoffs = atomic_load(&r->backoffs);
    st->connect_fails = atomic_load(&r->connect_fails);
    st->reconnects = atomic_load(&r->reconnects);
    st->moved = atomic_load(&r->moved);
    st->ask = atomic_load(&r->ask);
    st->events_stored = atomic_load(&r->ev_stored);
    st->events_removed = atomic_load(&r->ev_removed);
    uint64_t t = now_ns(), until = atomic_load(&r->rest_until);
    st->backoff = t < until;
    st->retry_in_ms = st->backoff ? (until - t + 999999) / 1000000 : 0;
    kvmm_lock(mm);
    st->queued = r->q_n - r->q_head;
    st->announced = r->ann_live;
    kvmm_unlock(mm);
}

/* kvmm_remote: the memory manager's side of the remote tier (kvmm.h "the
 * remote tier"). Two flows, neither on the event loop or in an executor
 * step:
 *   write-through  a tree block of a tenant with remote on whose value is due
 *                  (its group of K blocks is complete, or a commit or match
 *                  ended at it, and it has min_hits reuses) is queued; the
 *                  writer thread copies the value's blocks out under the
 *                  lock, seals them (remote_value.h) and SETs them with the
 *                  lock released;
 *   prefetch       a request's blocks past the tree are fetched in pipelined
 *                  GET rounds (of at most ROUND_BYTES of values each) on the
 *                  calling worker thread, every value opened and checked
 *                  against the prompt, and enter the tree as host blocks
 *                  before the request is scheduled: kvmm_remote_fetch.c.
 * Value k of a chain holds its blocks [k×K, (k+1)×K) and is named by the last
 * one; a tail value [k×K, j] is named by block j. A reader of a prompt of nb
 * whole blocks, of which the tree holds m, asks for the groups from m's on
 * and the tails ending at nb-1 and nb-2, in chain order.
 * A failed round (error or timeout) makes the tier rest for a second: what
 * comes meanwhile is recomputed (lookups) or dropped (writes), and counted.
 * KV events of the values written here are kvmm_remote_events.c's. Redis's
 * own evictions are not watched (keyspace notifications would need a
 * subscription per node): until a lookup notices, a router may send a
 * request here for a value that is gone, which costs that request its
 * recomputation, never a wrong token. */
#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fault.h"
#include "kvmm_remote_impl.h"
#include "log.h"
#include "redisconn.h"
#include "remote_value.h"
#include "workpool.h"

uint64_t mm_remote_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool mm_remote_resting(struct kvmm_remote *r)
{
    if (mm_remote_now_ns() < atomic_load(&r->rest_until)) {
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
    uint64_t t = mm_remote_now_ns();
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
struct rconn *mm_remote_conn_take(struct kvmm_remote *r)
{
    workpool_mutex_lock(&r->mu);
    struct rconn *c = r->n_conns ? r->conns[--r->n_conns] : NULL;
    workpool_mutex_unlock(&r->mu);
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
void mm_remote_conn_give(struct kvmm_remote *r, struct rconn *c, int rc)
{
    conn_count(r, c);
    if (rc != 0)
        back_off(r);
    workpool_mutex_lock(&r->mu);
    if (r->n_conns < POOL_CONNS) {
        r->conns[r->n_conns++] = c;
        c = NULL;
    }
    workpool_mutex_unlock(&r->mu);
    if (c) {
        redisconn_free(c->rc);
        free(c);
    }
}

/* ---- write-through --------------------------------------------------------- */

bool mm_remote_tenant_on(const struct kvmm *mm, uint32_t tenant)
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
    if ((b->remote & bit) || b->hits < r->min_hits || !mm_remote_tenant_on(mm, b->tenant))
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
    if (remote_value_seal(&r->key, rkey, buf, len) == 0 && !mm_remote_resting(r) &&
        (c = mm_remote_conn_take(r))) {
        struct redisconn_buf k = {rkey, sizeof rkey}, v = {buf, len};
        struct kvd_error e = {0};
        rc = redisconn_set(c->rc, 1, &k, &v, r->ttl_s, &e);
        mm_remote_conn_give(r, c, rc);
        if (rc == 0) {
            atomic_fetch_add(&r->writes, 1);
            atomic_fetch_add(&r->bytes_out, len);
            kvmm_lock(mm);
            mm_remote_ann_written(mm, it.key);
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
    workpool_mutex_lock(&r->mu);
    while (!atomic_load(&r->stop)) {
        r->writing = true;
        workpool_mutex_unlock(&r->mu);
        kvmm_lock(r->mm);
        mm_remote_ann_expire(r->mm);
        kvmm_unlock(r->mm);
        size_t n = 0;
        while (!atomic_load(&r->stop) && write_one(r))
            n++;
        workpool_mutex_lock(&r->mu);
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
    workpool_mutex_unlock(&r->mu);
    return NULL;
}

int kvmm_remote_flush(struct kvmm *mm, uint32_t timeout_ms)
{
    struct kvmm_remote *r = mm->remote;
    if (!r)
        return 0;
    uint64_t until = mm_remote_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        kvmm_lock(mm);
        bool empty = r->q_head == r->q_n;
        kvmm_unlock(mm);
        workpool_mutex_lock(&r->mu);
        bool busy = r->writing;
        if (!empty)
            pthread_cond_signal(&r->wake);
        workpool_mutex_unlock(&r->mu);
        if (empty && !busy)
            return 0;
        if (mm_remote_now_ns() >= until)
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
    r->round_keys = vb >= ROUND_BYTES ? 1 : (size_t)(ROUND_BYTES / vb);
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
    workpool_mutex_lock(&r->mu);
    atomic_store(&r->stop, true);
    pthread_cond_broadcast(&r->wake);
    workpool_mutex_unlock(&r->mu);
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
    mm_remote_ann_free(r);
    sodium_memzero(&r->key, sizeof r->key);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->idle);
    pthread_mutex_destroy(&r->mu);
    free(r);
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
    uint64_t t = mm_remote_now_ns(), until = atomic_load(&r->rest_until);
    st->backoff = t < until;
    st->retry_in_ms = st->backoff ? (until - t + 999999) / 1000000 : 0;
    kvmm_lock(mm);
    st->queued = r->q_n - r->q_head;
    st->announced = r->ann_live;
    kvmm_unlock(mm);
}

/* kvmm_disk: the memory manager's side of the disk tier (kvmm.h "the disk
 * tier"). Three flows, none of them on the event loop or inside an
 * executor step:
 *   write-behind  a block entering the tree gets its key (mm_keyed) and is
 *                 queued; the writer thread copies it out under the lock,
 *                 one block at a time, and writes it with the lock released;
 *   detach        a queued block about to leave the tree is copied into a
 *                 buffer of its own, which the writer writes later;
 *   prefetch      a request's blocks past the cached prefix are read from
 *                 disk (on the calling worker thread), checked, and enter
 *                 the tree as host blocks before the request is scheduled.
 * A host copy is verified against its checksum before it is written, so the
 * disk never gets bytes that the host tier would refuse. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checksum.h"
#include "disktier.h"
#include "fault.h"
#include "hosttier.h"
#include "kvmm_impl.h"
#include "log.h"

/* A restore reads at most this many bytes of slots in one batch (and
 * holds that much buffer per prefetch in flight). */
#define KVMM_RESTORE_WINDOW_BYTES (8u << 20)
#define KVMM_RESTORE_WINDOW_MAX 256u
/* The writer writes at most this many bytes of slots (and blocks) per batch. */
#define KVMM_WB_BATCH_BYTES (8u << 20)
#define KVMM_WB_BATCH_MAX 256u

struct rwin;
struct kvmm_disk;
static void wins_free(struct kvmm_disk *d);

struct wb_item {
    uint32_t id;
    struct blockkey key;
};

/* What a DISK BlockStored says of a block (KV events), taken while it is
 * in the tree. */
struct ev_block {
    bool on; /* events were attached */
    bool has_parent;
    uint32_t tenant;
    uint64_t pub, parent;
};

struct detached {
    char ns_name[DISKTIER_NS_NAME];
    struct blockkey key;
    uint32_t *tokens;
    void *buf; /* disktier_buf_new, data filled */
    struct ev_block ev;
};

/* The blocks written to disk while events were attached, by (namespace
 * hash, key): their published hash and owner, so that a drop the tier logs
 * becomes a DISK BlockRemoved. Open addressing with tombstones. */
struct pub_ent {
    uint64_t ns;
    struct blockkey key;
    uint64_t pub;
    uint32_t tenant;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
};

struct kvmm_disk {
    struct kvmm *mm;
    struct disktier *dt;
    uint32_t writeback_ms;
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu; /* guards the flush counters; the writer waits on wake */
    pthread_cond_t wake, flushed;
    uint64_t flush_req, flush_done;
    atomic_uint_fast64_t written;
    void *wbuf;                     /* the writer's slot buffers: wb_n of them, */
    void *wbufs[KVMM_WB_BATCH_MAX]; /*   at wbuf + i * slot_bytes */
    uint32_t *wtokens;              /* wb_n * block_tokens */
    size_t wb_n;
    /* Under the kvmm lock: */
    struct wb_item *q; /* FIFO: q[q_head, q_n) */
    size_t q_head, q_n, q_cap;
    struct detached *dq;
    size_t dq_n, dq_cap;
    uint64_t detached_bytes, detach_max;
    uint64_t detach_skips, restored, restore_fails;
    uint64_t restores, restore_ns, restore_last_ns; /* prefetches that restored blocks */
    size_t wb_inflight;   /* taken by the writer, not yet synced (counted as queued) */
    struct rwin *wins;    /* under mu: idle restore windows */
    struct pub_ent *pubs; /* (pubs_cap, a power of two) */
    size_t pubs_cap, pubs_used, pubs_live;
};

static size_t pub_slot(const struct kvmm_disk *d, uint64_t ns, struct blockkey k)
{
    return (size_t)((k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull) ^ ns) & (d->pubs_cap - 1));
}

/* Lock held. The entry of (ns, key), or NULL. */
static struct pub_ent *pub_find(struct kvmm_disk *d, uint64_t ns, struct blockkey k)
{
    if (!d->pubs_cap)
        return NULL;
    for (size_t i = pub_slot(d, ns, k), n = 0; n < d->pubs_cap;
         i = (i + 1) & (d->pubs_cap - 1), n++) {
        struct pub_ent *e = &d->pubs[i];
        if (e->state == 0)
            return NULL;
        if (e->state == 1 && e->ns == ns && blockkey_eq(e->key, k))
            return e;
    }
    return NULL;
}

static bool pub_put(struct kvmm_disk *d, uint64_t ns, struct blockkey k, uint64_t pub,
                    uint32_t tenant)
{
    struct pub_ent *e = pub_find(d, ns, k);
    if (e) {
        e->pub = pub;
        e->tenant = tenant;
        return true;
    }
    if ((d->pubs_used + 1) * 2 > d->pubs_cap) { /* rehash the live ones */
        size_t cap = d->pubs_cap ? d->pubs_cap : 1024;
        while ((d->pubs_live + 1) * 4 > cap)
            cap *= 2;
        struct pub_ent *nv = calloc(cap, sizeof *nv), *old = d->pubs;
        size_t old_cap = d->pubs_cap;
        if (!nv)
            return false;
        d->pubs = nv;
        d->pubs_cap = cap;
        d->pubs_used = d->pubs_live = 0;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].state == 1)
                pub_put(d, old[i].ns, old[i].key, old[i].pub, old[i].tenant);
        free(old);
    }
    size_t i = pub_slot(d, ns, k);
    while (d->pubs[i].state == 1)
        i = (i + 1) & (d->pubs_cap - 1);
    if (d->pubs[i].state == 0)
        d->pubs_used++;
    d->pubs[i] = (struct pub_ent){ns, k, pub, tenant, 1};
    d->pubs_live++;
    return true;
}

/* Lock held: block written to disk under (ns, key): a DISK BlockStored. */
static void ev_disk_stored(struct kvmm *mm, uint64_t ns, struct blockkey key,
                           const struct ev_block *eb, const uint32_t *tokens)
{
    if (!eb->on || !mm->events.block || !pub_put(mm->disk, ns, key, eb->pub, eb->tenant))
        return;
    struct kvmm_block_event ev = {.stored = true,
                                  .medium = KVMM_MEDIUM_DISK,
                                  .tenant = eb->tenant,
                                  .hash = eb->pub,
                                  .has_parent = eb->has_parent,
                                  .parent = eb->parent,
                                  .tokens = tokens,
                                  .n_tokens = mm->geom.block_tokens};
    kvmm_events_emit(mm, &ev);
}

/* Takes the drops the tier logged and reports the blocks it had announced
 * as DISK BlockRemoved. Takes the lock. */
static void ev_disk_drops(struct kvmm_disk *d)
{
    struct kvmm *mm = d->mm;
    struct disktier_drop dr[256];
    size_t n;
    while ((n = disktier_take_drops(d->dt, dr, 256)) > 0) {
        kvmm_lock(mm);
        for (size_t i = 0; i < n; i++) {
            struct pub_ent *e = pub_find(d, dr[i].ns, dr[i].key);
            if (!e)
                continue;
            struct kvmm_block_event ev = {
                .stored = false, .medium = KVMM_MEDIUM_DISK, .tenant = e->tenant, .hash = e->pub};
            kvmm_events_emit(mm, &ev);
            e->state = 2;
            d->pubs_live--;
        }
        kvmm_unlock(mm);
    }
}

/* Lock held: what a DISK BlockStored will say of node's block. */
static struct ev_block ev_block_of(const struct kvmm *mm, const struct radix_node *node)
{
    const struct pool_block *b = &mm->pool.blocks[node->block];
    const struct radix_node *p = node->parent;
    struct ev_block eb = {.on = mm->events.block != NULL, .tenant = b->tenant, .pub = b->pub};
    eb.has_parent = p && p->parent;
    eb.parent = eb.has_parent ? mm->pool.blocks[p->block].pub : 0;
    return eb;
}

struct blockkey mm_node_key(const struct kvmm *mm, const struct radix_node *node)
{
    if (!node->parent)
        return mm->root_key;
    return mm->pool.blocks[node->block].key;
}

static uint64_t ns_hash_of(const struct kvmm *mm, uint32_t ns)
{
    return blockkey_ns(mm->tt.ns_names[ns]);
}

static bool q_push(struct kvmm_disk *d, uint32_t id, struct blockkey key)
{
    if (d->q_head > 0 && d->q_head * 2 >= d->q_n) { /* compact: the FIFO's used part moves down */
        memmove(d->q, d->q + d->q_head, sizeof *d->q * (d->q_n - d->q_head));
        d->q_n -= d->q_head;
        d->q_head = 0;
    }
    if (d->q_n == d->q_cap) {
        size_t cap = d->q_cap ? 2 * d->q_cap : 1024;
        struct wb_item *v = fault_realloc(d->q, sizeof *v * cap);
        if (!v)
            return false;
        d->q = v;
        d->q_cap = cap;
    }
    d->q[d->q_n++] = (struct wb_item){id, key};
    return true;
}

void mm_keyed(struct kvmm *mm, struct radix_node *node)
{
    struct pool_block *b = pool_block(&mm->pool, node->block);
    b->key = blockkey_next(mm_node_key(mm, node->parent), node->tokens, mm->geom.block_tokens);
    b->disk = POOL_DISK_NONE;
    if (mm->disk && q_push(mm->disk, node->block, b->key))
        b->disk = POOL_DISK_QUEUED;
}

/* Copies block id's bytes to dst (lock held). A host copy must pass its
 * checksum first; false when it does not (it is never written) or the copy
 * failed. */
bool mm_disk_copy_out(struct kvmm *mm, uint32_t id, void *dst)
{
    struct pool_block *b = pool_block(&mm->pool, id);
    if (b->tier == KVD_TIER_HOST && hosttier_verify(&mm->pool, id) != 0) {
        b->disk = POOL_DISK_NEVER;
        return false;
    }
    return mm->be->ops->copy(mm->be, dst, KVD_TIER_HOST, pool_block_ptr(&mm->pool, id),
                             (enum kvd_tier)b->tier, mm->block_bytes) == 0;
}

void mm_disk_dropping(struct kvmm *mm, struct radix_node *node)
{
    struct kvmm_disk *d = mm->disk;
    struct pool_block *b = pool_block(&mm->pool, node->block);
    if (!d || b->disk != POOL_DISK_QUEUED)
        return;
    b->disk = POOL_DISK_NONE;
    struct disktier_stats ts;
    disktier_stats(d->dt, &ts);
    if (d->detached_bytes + ts.slot_bytes > d->detach_max) {
        d->detach_skips++;
        return;
    }
    struct detached x = {.key = b->key, .ev = ev_block_of(mm, node)};
    if (d->dq_n == d->dq_cap) {
        size_t cap = d->dq_cap ? 2 * d->dq_cap : 64;
        struct detached *v = fault_realloc(d->dq, sizeof *v * cap);
        if (!v) {
            d->detach_skips++;
            return;
        }
        d->dq = v;
        d->dq_cap = cap;
    }
    x.buf = disktier_buf_new(d->dt);
    x.tokens = fault_malloc(sizeof(uint32_t) * mm->geom.block_tokens);
    if (!x.buf || !x.tokens || !mm_disk_copy_out(mm, node->block, disktier_data(d->dt, x.buf))) {
        free(x.buf);
        free(x.tokens);
        d->detach_skips++;
        return;
    }
    memcpy(x.tokens, node->tokens, sizeof(uint32_t) * mm->geom.block_tokens);
    snprintf(x.ns_name, sizeof x.ns_name, "%s", mm->tt.ns_names[node->ns]);
    d->dq[d->dq_n++] = x;
    d->detached_bytes += ts.slot_bytes;
}

/* One block of the writer's batch: a detached copy (its own buffer and
 * tokens) or a queued block copied into wbufs. */
struct wb_slot {
    bool detached;
    uint32_t id; /* queued: the pool block */
    char ns_name[DISKTIER_NS_NAME];
    uint32_t *tokens;
    void *buf;
    struct ev_block ev; /* what a DISK BlockStored will say (events attached) */
};

/* Takes the next block to write into w (the kvmm lock taken and released
 * for it alone, so the executor never waits behind a whole batch). false
 * when nothing is left. */
static bool wb_take(struct kvmm_disk *d, struct wb_slot *w, struct disktier_wr *wr, void *wbuf,
                    uint32_t *tokens)
{
    struct kvmm *mm = d->mm;
    uint32_t bt = mm->geom.block_tokens;
    kvmm_lock(mm);
    if (d->dq_n) {
        struct detached x = d->dq[--d->dq_n];
        struct disktier_stats ts;
        disktier_stats(d->dt, &ts);
        d->detached_bytes -= ts.slot_bytes;
        d->wb_inflight++;
        kvmm_unlock(mm);
        *w = (struct wb_slot){.detached = true, .tokens = x.tokens, .buf = x.buf, .ev = x.ev};
        snprintf(w->ns_name, sizeof w->ns_name, "%s", x.ns_name);
        *wr = (struct disktier_wr){.key = x.key, .tokens = x.tokens, .buf = x.buf};
        return true;
    }
    while (d->q_head < d->q_n) {
        struct wb_item it = d->q[d->q_head++];
        struct pool_block *b = pool_block(&mm->pool, it.id);
        if (!b->used || !b->node || b->disk != POOL_DISK_QUEUED || !blockkey_eq(b->key, it.key))
            continue; /* gone, or already written or detached */
        if (!mm_disk_copy_out(mm, it.id, disktier_data(d->dt, wbuf))) {
            if (b->disk == POOL_DISK_QUEUED)
                b->disk = POOL_DISK_NONE;
            continue;
        }
        *w = (struct wb_slot){
            .id = it.id, .tokens = tokens, .buf = wbuf, .ev = ev_block_of(mm, b->node)};
        memcpy(tokens, b->node->tokens, sizeof(uint32_t) * bt);
        snprintf(w->ns_name, sizeof w->ns_name, "%s", mm->tt.ns_names[b->node->ns]);
        b->disk = POOL_DISK_CLEAN;
        d->wb_inflight++;
        kvmm_unlock(mm);
        *wr = (struct disktier_wr){.key = it.key, .tokens = tokens, .buf = wbuf};
        return true;
    }
    d->q_head = d->q_n = 0;
    kvmm_unlock(mm);
    return false;
}

/* Writes up to a batch of queued blocks and detached copies with one
 * disktier_put_many (adjacent slots go out as one write). Returns how
 * many it took; 0 when there were none. */
static size_t write_batch(struct kvmm_disk *d)
{
    struct kvmm *mm = d->mm;
    uint32_t bt = mm->geom.block_tokens;
    struct wb_slot w[KVMM_WB_BATCH_MAX];
    struct disktier_wr wr[KVMM_WB_BATCH_MAX];
    size_t n = 0;
    while (n < d->wb_n && !atomic_load(&d->stop) &&
           wb_take(d, &w[n], &wr[n], d->wbufs[n], d->wtokens + n * bt))
        n++;
    for (size_t i = 0; i < n; i++) {
        wr[i].ns_name = w[i].ns_name;
        wr[i].ns = blockkey_ns(w[i].ns_name);
    }
    MM_ASSERT_UNLOCKED(mm);
    disktier_put_many(d->dt, wr, n);
    for (size_t i = 0; i < n; i++) {
        if (wr[i].rc == 0)
            atomic_fetch_add(&d->written, 1);
        if (wr[i].rc == 0 && w[i].ev.on) {
            kvmm_lock(mm);
            ev_disk_stored(mm, wr[i].ns, wr[i].key, &w[i].ev, wr[i].tokens);
            kvmm_unlock(mm);
        }
        if (w[i].detached) {
            free(w[i].buf);
            free(w[i].tokens);
        } else if (wr[i].rc != 0) {
            kvmm_lock(mm);
            struct pool_block *b = pool_block(&mm->pool, w[i].id);
            if (b->used && blockkey_eq(b->key, wr[i].key) && b->disk == POOL_DISK_CLEAN)
                b->disk = POOL_DISK_NONE;
            kvmm_unlock(mm);
        }
    }
    return n;
}

static void deadline_in(struct timespec *ts, uint32_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* The writer: every writeback_ms (or at once for a flush) it writes what is
 * queued, then syncs both files, so a crash loses at most one period. */
static void *writer_main(void *arg)
{
    struct kvmm_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!atomic_load(&d->stop)) {
        if (d->flush_req == d->flush_done) {
            struct timespec ts;
            deadline_in(&ts, d->writeback_ms);
            pthread_cond_timedwait(&d->wake, &d->mu, &ts);
        }
        uint64_t want = d->flush_req;
        pthread_mutex_unlock(&d->mu);
        size_t n = 0, k;
        while (!atomic_load(&d->stop) && (k = write_batch(d)) > 0)
            n += k;
        if (n) {
            disktier_sync(d->dt);
            /* Queued until durable (or dropped by a failed sync): a
             * drained queue means the counters are final. */
            kvmm_lock(d->mm);
            d->wb_inflight = 0;
            kvmm_unlock(d->mm);
        }
        ev_disk_drops(d);
        pthread_mutex_lock(&d->mu);
        if (want > d->flush_done)
            d->flush_done = want;
        pthread_cond_broadcast(&d->flushed);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

int kvmm_disk_open(struct kvmm *mm, const struct kvmm_disk_conf *c, struct kvd_error *e)
{
    if (mm->disk)
        return kvd_error_set(e, KVD_EBADREQ, "disk tier: already open");
    struct kvmm_disk *d = calloc(1, sizeof *d);
    if (!d)
        return kvd_error_set(e, KVD_ENOMEM, "disk tier: out of memory");
    struct disktier_conf dc = {.dir = c->dir,
                               .max_bytes = c->max_bytes,
                               .block_bytes = mm->block_bytes,
                               .block_tokens = mm->geom.block_tokens};
    int rc = disktier_open(&dc, &d->dt, e);
    if (rc) {
        free(d);
        return rc;
    }
    d->mm = mm;
    d->writeback_ms = c->writeback_ms ? c->writeback_ms : 1000;
    d->detach_max = c->detach_max_bytes ? c->detach_max_bytes : (uint64_t)64 << 20;
    pthread_mutex_init(&d->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&d->wake, &ca);
    pthread_cond_init(&d->flushed, &ca);
    pthread_condattr_destroy(&ca);
    struct disktier_stats ts;
    disktier_stats(d->dt, &ts);
    d->wb_n = KVMM_WB_BATCH_BYTES / ts.slot_bytes;
    /* A batch takes its slots before it writes, so its blocks cannot evict
     * one another: at most an eighth of the tier per batch, so a full tier
     * keeps the newest blocks as one block at a time would. */
    if (d->wb_n > ts.slots / 8)
        d->wb_n = ts.slots / 8;
    d->wb_n = d->wb_n < 1 ? 1 : d->wb_n > KVMM_WB_BATCH_MAX ? KVMM_WB_BATCH_MAX : d->wb_n;
    if (posix_memalign(&d->wbuf, 4096, d->wb_n * ts.slot_bytes))
        d->wbuf = NULL;
    d->wtokens = malloc(sizeof *d->wtokens * d->wb_n * mm->geom.block_tokens);
    if (d->wbuf) /* the slots' padding goes to disk too: zeros, not old heap bytes */
        memset(d->wbuf, 0, d->wb_n * ts.slot_bytes);
    for (size_t i = 0; d->wbuf && i < d->wb_n; i++)
        d->wbufs[i] = (char *)d->wbuf + i * ts.slot_bytes;
    if (!d->wbuf || !d->wtokens || disktier_watch_drops(d->dt, 65536) != 0) {
        rc = kvd_error_set(e, KVD_ENOMEM, "disk tier: out of memory");
        goto fail;
    }
    kvmm_lock(mm);
    mm->disk = d;
    kvmm_unlock(mm);
    if (pthread_create(&d->thread, NULL, writer_main, d) != 0) {
        rc = kvd_error_set(e, KVD_EINTERNAL, "disk tier: cannot start the writer thread");
        kvmm_lock(mm);
        mm->disk = NULL;
        kvmm_unlock(mm);
        goto fail;
    }
    d->started = true;
    if ((rc = mm_sessions_load(mm, c->dir, e)) != 0) {
        mm_disk_free(mm);
        return rc;
    }
    return 0;
fail:
    free(d->wbuf);
    free(d->wtokens);
    disktier_close(d->dt);
    pthread_cond_destroy(&d->wake);
    pthread_cond_destroy(&d->flushed);
    pthread_mutex_destroy(&d->mu);
    free(d);
    return rc;
}

struct disktier *mm_disk_tier(struct kvmm *mm)
{
    return mm->disk ? mm->disk->dt : NULL;
}

bool kvmm_disk_on(const struct kvmm *mm)
{
    return mm->disk != NULL;
}

void mm_disk_free(struct kvmm *mm)
{
    struct kvmm_disk *d = mm->disk;
    if (!d)
        return;
    pthread_mutex_lock(&d->mu);
    atomic_store(&d->stop, true);
    pthread_cond_broadcast(&d->wake);
    pthread_mutex_unlock(&d->mu);
    if (d->started)
        pthread_join(d->thread, NULL);
    mm_sessions_free(mm);
    disktier_sync(d->dt);
    mm->disk = NULL;
    for (size_t i = 0; i < d->dq_n; i++) {
        free(d->dq[i].buf);
        free(d->dq[i].tokens);
    }
    free(d->dq);
    free(d->q);
    free(d->pubs);
    free(d->wbuf);
    free(d->wtokens);
    wins_free(d);
    disktier_close(d->dt);
    pthread_cond_destroy(&d->wake);
    pthread_cond_destroy(&d->flushed);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

static size_t pending(struct kvmm *mm)
{
    struct kvmm_disk *d = mm->disk;
    size_t n = d->dq_n + d->wb_inflight;
    for (size_t i = d->q_head; i < d->q_n; i++) {
        const struct pool_block *b = pool_block(&mm->pool, d->q[i].id);
        n += b->used && b->disk == POOL_DISK_QUEUED && blockkey_eq(b->key, d->q[i].key);
    }
    return n;
}

int kvmm_disk_flush(struct kvmm *mm, uint32_t timeout_ms, size_t *written, size_t *left)
{
    struct kvmm_disk *d = mm->disk;
    *written = *left = 0;
    if (!d)
        return 0;
    uint64_t before = atomic_load(&d->written);
    struct timespec ts;
    deadline_in(&ts, timeout_ms);
    pthread_mutex_lock(&d->mu);
    uint64_t my = ++d->flush_req;
    pthread_cond_broadcast(&d->wake);
    while (d->flush_done < my)
        if (pthread_cond_timedwait(&d->flushed, &d->mu, &ts) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&d->mu);
    *written = (size_t)(atomic_load(&d->written) - before);
    kvmm_lock(mm);
    *left = pending(mm);
    kvmm_unlock(mm);
    return *left ? KVD_EBUSY : 0;
}

/* ---- prefetch ------------------------------------------------------------ */

/* Lock held: the node of block b-1 of tokens in ns (the root for b = 0),
 * found by walking the tree again (nodes can go while the lock is
 * released); NULL when the tree no longer holds all b blocks. */
struct radix_node *mm_parent_of(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t b,
                                struct radix_node **scratch)
{
    if (b == 0)
        return radix_root(&mm->radix, ns);
    size_t got = radix_match(&mm->radix, ns, tokens, b * mm->geom.block_tokens, scratch, b);
    return got == b ? scratch[b - 1] : NULL;
}

bool mm_restore_take(struct kvmm *mm, uint32_t tenant, uint32_t ns, bool prefer_device,
                     struct mm_restoring *r)
{
    MM_ASSERT_LOCKED(mm);
    struct tenant *t = &mm->tt.v[tenant];
    bool host = mm->pool.n_slots[KVD_TIER_HOST] > 0;
    uint32_t owner = mm_owner(mm, tenant, ns);
    if (owner == POOL_NONE)
        return false;
    /* Free device room beyond the margin: slots in the owner's pages, and
     * whole pages the budget can still give. */
    const struct pool *p = &mm->pool;
    uint64_t dev_free =
        p->owners[owner].n_free[KVD_TIER_DEVICE] +
        (uint64_t)pool_pages_free(p, KVD_TIER_DEVICE) * p->slots_per_page[KVD_TIER_DEVICE];
    uint32_t margin = mm->pool.n_slots[KVD_TIER_DEVICE] / 16;
    bool dev_free_ok =
        prefer_device && dev_free > margin &&
        (t->conf.max_device_blocks == KVMM_UNLIMITED || t->dev_blocks < t->conf.max_device_blocks);
    enum kvd_tier tier = dev_free_ok || !host ? KVD_TIER_DEVICE : KVD_TIER_HOST;
    char saved[sizeof mm->err];
    memcpy(saved, mm->err, sizeof saved); /* a prefetch's failures are not the caller's */
    /* Room is made either way (a free device slot still wants its quota
     * checked and maybe a page mapped). */
    int err = mm_room_new(mm, tier, tenant, ns, 1);
    memcpy(mm->err, saved, sizeof saved);
    uint32_t id;
    if (err)
        return false;
    if (pool_alloc_in(&mm->pool, tier, owner, &id) != 0) {
        pool_trim(&mm->pool);
        return false;
    }
    if (tier == KVD_TIER_HOST)
        t->host_blocks++;
    else
        t->dev_blocks++;
    pool_block(&mm->pool, id)->restoring = 1;
    *r = (struct mm_restoring){.id = id, .tier = tier, .dst = pool_block_ptr(&mm->pool, id)};
    return true;
}

bool mm_restore_fill(struct kvmm *mm, struct mm_restoring *r, const void *data)
{
    if (mm->be->ops->copy(mm->be, r->dst, r->tier, data, KVD_TIER_HOST, mm->block_bytes) != 0)
        return false;
    if (r->tier == KVD_TIER_HOST) /* as hosttier_checksum, from the bytes just written */
        r->checksum = checksum64(r->dst, mm->block_bytes, r->id);
    return true;
}

void mm_restore_drop(struct kvmm *mm, struct mm_restoring *r)
{
    MM_ASSERT_LOCKED(mm);
    pool_block(&mm->pool, r->id)->restoring = 0;
    mm_unref(mm, r->id);
}

bool mm_restore_enter(struct kvmm *mm, struct mm_restoring *r, struct radix_node *parent,
                      const uint32_t *toks, struct blockkey key, bool from_disk)
{
    MM_ASSERT_LOCKED(mm);
    uint32_t id = r->id;
    struct pool_block *b = pool_block(&mm->pool, id);
    b->restoring = 0;
    if (r->tier == KVD_TIER_HOST)
        b->checksum = r->checksum;
    struct radix_node *node;
    if (radix_insert(&mm->radix, parent, toks, id, &node) != 0) {
        mm_unref(mm, id);
        return false;
    }
    b->key = key;
    b->disk = POOL_DISK_CLEAN;
    if (!from_disk) { /* from the remote tier: the disk tier writes it too */
        b->disk = POOL_DISK_NONE;
        b->remote = POOL_REMOTE_FULL | POOL_REMOTE_TAIL;
        if (mm->disk && q_push(mm->disk, node->block, key))
            b->disk = POOL_DISK_QUEUED;
    }
    b->lru = ++mm->clock;
    /* A restore is a reuse of the prefix, asked for by a request that has
     * not matched yet: it counts as a hit, so that the hits policy does not
     * drop it (no hits, no bonus) for blocks used once before that
     * request runs. */
    b->hits = 1;
    if (mm->events.block) {
        mm_pub_set(mm, node);
        mm_ev_stored(mm, node, mm_tier_medium(r->tier));
    }
    mm_unref(mm, id); /* the tree's reference stays: a cached block */
    return true;
}

bool mm_restore_block(struct kvmm *mm, uint32_t tenant, uint32_t ns, struct radix_node *parent,
                      const uint32_t *toks, struct blockkey key, const void *data, bool from_disk)
{
    struct mm_restoring r;
    if (!mm_restore_take(mm, tenant, ns, false, &r))
        return false;
    if (!mm_restore_fill(mm, &r, data)) {
        mm_restore_drop(mm, &r);
        return false;
    }
    return mm_restore_enter(mm, &r, parent, toks, key, from_disk);
}

/* Lock held: how many whole blocks of tokens the tree holds, and the key of
 * the last. */
size_t mm_cached_prefix(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t nb,
                        struct radix_node **scratch, struct blockkey *key)
{
    size_t m =
        nb ? radix_match(&mm->radix, ns, tokens, nb * mm->geom.block_tokens, scratch, nb) : 0;
    *key = m ? mm_node_key(mm, scratch[m - 1]) : mm->root_key;
    return m;
}

bool mm_ns_ok(const struct kvmm *mm, uint32_t ns)
{
    return ns < mm->tt.n_ns && ns < mm->radix.n_roots && mm->tt.ns_names[ns][0];
}

bool kvmm_disk_may_prefetch(struct kvmm *mm, uint32_t ns, const uint32_t *tokens, size_t n)
{
    struct kvmm_disk *d = mm->disk;
    size_t nb = n / mm->geom.block_tokens;
    if (!d || nb == 0)
        return false;
    struct radix_node **scratch = malloc(sizeof *scratch * nb);
    if (!scratch)
        return false;
    struct blockkey key;
    uint64_t nsh = 0;
    size_t m = 0;
    kvmm_lock(mm);
    bool ok = mm_ns_ok(mm, ns);
    if (ok) {
        m = mm_cached_prefix(mm, ns, tokens, nb, scratch, &key);
        nsh = ns_hash_of(mm, ns);
    }
    kvmm_unlock(mm);
    free(scratch);
    if (!ok || m == nb)
        return false;
    key = blockkey_next(key, tokens + m * mm->geom.block_tokens, mm->geom.block_tokens);
    return disktier_has(d->dt, nsh, key);
}

/* A restore window: the buffers one prefetch reads a batch of blocks into
 * (one allocation of n slots), kept for the next prefetch. */
struct rwin {
    struct rwin *next;
    size_t n;
    unsigned char *bufs; /* n * slot_bytes, 4 KiB aligned */
    struct disktier_rd *rd;
    struct mm_restoring *rs; /* the blocks the window's bytes go into */
};

static struct rwin *win_get(struct kvmm_disk *d)
{
    pthread_mutex_lock(&d->mu);
    struct rwin *w = d->wins;
    if (w)
        d->wins = w->next;
    pthread_mutex_unlock(&d->mu);
    if (w)
        return w;
    struct disktier_stats ts;
    disktier_stats(d->dt, &ts);
    size_t n = KVMM_RESTORE_WINDOW_BYTES / ts.slot_bytes;
    n = n < 1 ? 1 : n > KVMM_RESTORE_WINDOW_MAX ? KVMM_RESTORE_WINDOW_MAX : n;
    if (!(w = calloc(1, sizeof *w)))
        return NULL;
    w->n = n;
    w->rd = calloc(n, sizeof *w->rd);
    w->rs = calloc(n, sizeof *w->rs);
    if (!w->rd || !w->rs || posix_memalign((void **)&w->bufs, 4096, n * ts.slot_bytes)) {
        free(w->rd);
        free(w->rs);
        free(w);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        w->rd[i].buf = w->bufs + i * ts.slot_bytes;
    return w;
}

static void win_put(struct kvmm_disk *d, struct rwin *w)
{
    pthread_mutex_lock(&d->mu);
    w->next = d->wins;
    d->wins = w;
    pthread_mutex_unlock(&d->mu);
}

static void wins_free(struct kvmm_disk *d)
{
    while (d->wins) {
        struct rwin *w = d->wins;
        d->wins = w->next;
        free(w->bufs);
        free(w->rd);
        free(w->rs);
        free(w);
    }
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

size_t kvmm_disk_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                          size_t n)
{
    struct kvmm_disk *d = mm->disk;
    uint32_t bt = mm->geom.block_tokens;
    size_t nb = n / bt, restored = 0;
    if (!d || nb == 0)
        return 0;
    uint64_t t0 = mono_ns();
    struct radix_node **scratch = malloc(sizeof *scratch * nb);
    struct rwin *w = win_get(d);
    char ns_name[DISKTIER_NS_NAME];
    struct blockkey key;
    uint64_t nsh = 0;
    size_t m = 0, fails = 0;
    bool ok = scratch && w;
    if (ok) {
        kvmm_lock(mm);
        ok = mm_ns_ok(mm, ns) && tenant_live(&mm->tt, tenant);
        if (ok) {
            m = mm_cached_prefix(mm, ns, tokens, nb, scratch, &key);
            nsh = ns_hash_of(mm, ns);
            snprintf(ns_name, sizeof ns_name, "%s", mm->tt.ns_names[ns]);
        }
        kvmm_unlock(mm);
    }
    /* Window by window: the next blocks' slots are looked up (their keys
     * follow from the tokens alone), read in one batch with the kvmm lock
     * released, then enter the tree in order, up to the first that is not
     * on disk or fails a check. */
    size_t b = m;
    while (ok && b < nb) {
        size_t k = 0;
        bool more = true;
        while (k < w->n && b + k < nb) {
            const uint32_t *toks = tokens + (b + k) * bt;
            struct blockkey next = blockkey_next(key, toks, bt);
            uint32_t slot = disktier_lookup(d->dt, nsh, next);
            if (slot == DISKTIER_NONE) {
                more = false;
                break;
            }
            w->rd[k].slot = slot;
            w->rd[k].key = key = next;
            w->rd[k].tokens = toks;
            k++;
        }
        if (k == 0)
            break;
        MM_ASSERT_UNLOCKED(mm);
        disktier_read_many(d->dt, ns_name, nsh, w->rd, k);
        /* The window's blocks up to the first failed one get their final
         * blocks (the device's when it has room, so the request's match
         * has nothing to swap in) under the lock; their bytes are copied in
         * with it released; then they enter the tree, in order. */
        size_t good = 0, got = 0, filled = 0;
        while (good < k && w->rd[good].rc == 0)
            good++;
        if (good < k)
            fails++;
        kvmm_lock(mm);
        if (tenant_live(&mm->tt, tenant))
            while (got < good && mm_restore_take(mm, tenant, ns, true, &w->rs[got]))
                got++;
        kvmm_unlock(mm);
        MM_ASSERT_UNLOCKED(mm);
        while (filled < got &&
               mm_restore_fill(mm, &w->rs[filled], disktier_data(d->dt, w->rd[filled].buf)))
            filled++;
        kvmm_lock(mm);
        for (size_t i = 0; i < got; i++) {
            const uint32_t *toks = tokens + (b + i) * bt;
            /* The namespace may have been removed, and its id reused, meanwhile. */
            struct radix_node *parent =
                ok && i < filled && mm_ns_ok(mm, ns) && strcmp(mm->tt.ns_names[ns], ns_name) == 0
                    ? mm_parent_of(mm, ns, tokens, b + i, scratch)
                    : NULL;
            ok = parent != NULL;
            if (ok && !radix_child(&mm->radix, parent, toks,
                                   radix_hash(&mm->radix, parent->hash, toks))) {
                ok = mm_restore_enter(mm, &w->rs[i], parent, toks, w->rd[i].key, true);
                if (ok) {
                    d->restored++;
                    restored++;
                }
            } else {
                mm_restore_drop(mm, &w->rs[i]); /* not wanted (any more), or already there */
            }
        }
        kvmm_unlock(mm);
        if (got < k)
            ok = false;
        b += k;
        if (!more)
            break;
    }
    uint64_t took = mono_ns() - t0;
    kvmm_lock(mm);
    d->restore_fails += fails;
    if (restored) {
        d->restores++;
        d->restore_ns += took;
        d->restore_last_ns = took;
    }
    kvmm_unlock(mm);
    if (w)
        win_put(d, w);
    free(scratch);
    return restored;
}

void kvmm_disk_stats(struct kvmm *mm, struct kvmm_disk_stats *st)
{
    memset(st, 0, sizeof *st);
    struct kvmm_disk *d = mm->disk;
    if (!d)
        return;
    st->on = true;
    kvmm_lock(mm);
    st->queued = pending(mm) - d->dq_n;
    st->detached = d->dq_n;
    st->detach_skips = d->detach_skips;
    st->restored = d->restored;
    st->restore_fails = d->restore_fails;
    st->restores = d->restores;
    st->restore_ns = d->restore_ns;
    st->restore_last_ns = d->restore_last_ns;
    kvmm_unlock(mm);
    st->sessions = mm_sessions_count(mm);
    disktier_stats(d->dt, &st->tier);
}

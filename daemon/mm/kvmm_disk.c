/* kvmm_disk: the memory manager's side of the disk tier (kvmm.h "the disk
 * tier"). Three flows, none of them on the event loop or inside an
 * executor step (the third is kvmm_restore.c's):
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
#include "kvmm_disk_impl.h"
#include "log.h"

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

/* Lock held: block (ns, key) of a write that went well: a DISK BlockStored, unless the
 * events already have it on disk (it was there, the write found it and wrote nothing) or
 * the tier no longer holds it (the slot that such a write found was evicted by a later
 * block of the same batch: its drop, taken before, said BlockRemoved, or nothing if it was
 * never announced). So each block is announced once per stay on disk, by its first owner. */
static void ev_disk_stored(struct kvmm *mm, uint64_t ns, struct blockkey key,
                           const struct ev_block *eb, const uint32_t *tokens)
{
    if (!eb->on || !mm->events.block || pub_find(mm->disk, ns, key) ||
        !disktier_has(mm->disk->dt, ns, key) || !pub_put(mm->disk, ns, key, eb->pub, eb->tenant))
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

uint64_t mm_ns_hash(const struct kvmm *mm, uint32_t ns)
{
    return blockkey_ns(mm->tt.ns_names[ns]);
}

bool mm_disk_q_push(struct kvmm_disk *d, uint32_t id, struct blockkey key)
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
    if (mm->disk && mm_disk_q_push(mm->disk, node->block, b->key))
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

static uint32_t weight_of(const struct kvmm *mm, uint32_t tenant)
{
    return tenant_live(&mm->tt, tenant) ? mm->tt.v[tenant].conf.weight : 1;
}

void mm_disk_dropping(struct kvmm *mm, struct radix_node *node)
{
    struct kvmm_disk *d = mm->disk;
    struct pool_block *b = pool_block(&mm->pool, node->block);
    if (!d)
        return;
    /* On disk already: it was in use here until now, with these hits (the tier's eviction
     * order counts them). Evicted from disk meanwhile: written again, as a queued one. */
    if (b->disk == POOL_DISK_CLEAN &&
        !disktier_touch(d->dt, mm_ns_hash(mm, node->ns), b->key, b->hits, weight_of(mm, b->tenant)))
        b->disk = POOL_DISK_QUEUED;
    if (b->disk != POOL_DISK_QUEUED)
        return;
    b->disk = POOL_DISK_NONE;
    struct disktier_stats ts;
    disktier_stats(d->dt, &ts);
    if (d->detached_bytes + ts.slot_bytes > d->detach_max) {
        d->detach_skips++;
        return;
    }
    struct detached x = {.key = b->key,
                         .hits = b->hits,
                         .weight = weight_of(mm, b->tenant),
                         .ev = ev_block_of(mm, node)};
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
        *wr = (struct disktier_wr){
            .key = x.key, .tokens = x.tokens, .buf = x.buf, .hits = x.hits, .weight = x.weight};
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
        *wr = (struct disktier_wr){.key = it.key,
                                   .tokens = tokens,
                                   .buf = wbuf,
                                   .hits = b->hits,
                                   .weight = weight_of(mm, b->tenant)};
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
    /* The slots the batch evicted are reported first: one of them may have held a block that
     * the batch writes again (dropped from the tier while memory still had it, then queued
     * anew). Its BlockRemoved after the new BlockStored would leave the events without a
     * block that is on disk. */
    ev_disk_drops(d);
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
        if (n)
            disktier_sync(d->dt);
        ev_disk_drops(d);
        if (n) {
            /* Queued until durable (or dropped by a failed sync) and its
             * events sent: a drained queue means the counters and the
             * DISK events are final. */
            kvmm_lock(d->mm);
            d->wb_inflight = 0;
            kvmm_unlock(d->mm);
        }
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
                               .block_tokens = mm->geom.block_tokens,
                               .lru = (c->own_policy ? c->policy : mm->evict_policy) ==
                                      KVMM_EVICT_LRU};
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
    mm_disk_wins_free(d);
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
    memcpy(st->restore_cpu_ns, d->restore_cpu_ns, sizeof st->restore_cpu_ns);
    kvmm_unlock(mm);
    st->sessions = mm_sessions_count(mm);
    disktier_stats(d->dt, &st->tier);
}

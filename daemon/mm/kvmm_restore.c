/* kvmm_restore: restores into the tree from the tiers below host. The three steps both the
 * disk and the remote tier use (a final block taken under the kvmm lock, its bytes copied in
 * with the lock released, then entered into the tree in order), and the disk tier's prefetch:
 * restore windows read two in turn, the next in flight while the one before is checked and
 * entered (docs/persistence.md "Restore: prefetch before scheduling"). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checksum.h"
#include "disktier.h"
#include "kvmm_disk_impl.h"
#include "log.h"

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
    struct pool_block *pb = pool_block(&mm->pool, id);
    pb->restoring = 1;
    *r = (struct mm_restoring){.id = id, .tier = tier, .dst = pool_block_ptr(&mm->pool, id)};
    if (mm->be->ops->prefault)
        (void)pool_take_fresh(&mm->pool, tier, pb->slot, &r->fresh, &r->fresh_bytes);
    return true;
}

void mm_restore_prefault(struct kvmm *mm, struct mm_restoring *r)
{
    /* The first block restored into a new page prefaults the whole page (the
     * blocks after it in the window land in the same page): one call instead
     * of a fault per 4 KiB page inside the copies, with the lock released. */
    if (r->fresh) {
        mm->be->ops->prefault(mm->be, r->fresh, r->tier, r->fresh_bytes);
        r->fresh = NULL;
    }
}

bool mm_restore_fill(struct kvmm *mm, struct mm_restoring *r, const void *data)
{
    mm_restore_prefault(mm, r);
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
        if (mm->disk && mm_disk_q_push(mm->disk, node->block, key))
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
        nsh = mm_ns_hash(mm, ns);
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

void mm_disk_wins_free(struct kvmm_disk *d)
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

static uint64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t mono_ns(void)
{
    return clock_ns(CLOCK_MONOTONIC);
}

/* The calling thread's CPU time: where a restore's CPU goes, by step
 * (kvmm_disk_stats.restore_cpu_ns). */
static uint64_t cpu_ns(void)
{
    return clock_ns(CLOCK_THREAD_CPUTIME_ID);
}

/* Looks up the slots of blocks [b, ...) of tokens into w (at most its size, up to nb), each
 * key chained from *key, and pins them: how many are on disk in a row (*more: false when a
 * block was missing, so no window follows). */
static size_t win_lookup(struct kvmm_disk *d, struct rwin *w, const uint32_t *tokens, uint32_t bt,
                         size_t b, size_t nb, uint64_t nsh, struct blockkey *key, bool *more)
{
    size_t k = 0;
    while (k < w->n && b + k < nb) {
        const uint32_t *toks = tokens + (b + k) * bt;
        struct blockkey next = blockkey_next(*key, toks, bt);
        uint32_t slot = disktier_lookup(d->dt, nsh, next);
        if (slot == DISKTIER_NONE) {
            *more = false;
            break;
        }
        w->rd[k].slot = slot;
        w->rd[k].key = *key = next;
        w->rd[k].tokens = toks;
        k++;
    }
    return k;
}

size_t kvmm_disk_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                          size_t n)
{
    struct kvmm_disk *d = mm->disk;
    uint32_t bt = mm->geom.block_tokens;
    size_t nb = n / bt, restored = 0;
    if (!d || nb == 0)
        return 0;
    uint64_t t0 = mono_ns(), c0 = cpu_ns(), cpu[KVMM_RESTORE_CPU_N] = {0};
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
            nsh = mm_ns_hash(mm, ns);
            snprintf(ns_name, sizeof ns_name, "%s", mm->tt.ns_names[ns]);
        }
        kvmm_unlock(mm);
    }
    /* Window by window: the next blocks' slots are looked up (their keys follow from the
     * tokens alone) and their reads started, with the kvmm lock released; while the disk
     * reads them, the window before is waited for (each request checked as it completes),
     * and its blocks enter the tree in order, up to the first that is not on disk or fails a
     * check. Two windows in turn, so the disk is not idle while a window is checked, copied
     * and entered. A window started after the one that stopped is read to its end (its
     * buffers are the kernel's until then) and dropped. */
    struct rwin *w2 = NULL;
    bool more = true;
    size_t b = m, k = ok ? win_lookup(d, w, tokens, bt, b, nb, nsh, &key, &more) : 0;
    struct disktier_batch *batch = k ? disktier_read_begin(d->dt, ns_name, nsh, w->rd, k) : NULL;
    while (k) {
        size_t k2 = 0;
        struct disktier_batch *batch2 = NULL;
        if (more && b + k < nb && (w2 || (w2 = win_get(d)))) {
            k2 = win_lookup(d, w2, tokens, bt, b + k, nb, nsh, &key, &more);
            batch2 = k2 ? disktier_read_begin(d->dt, ns_name, nsh, w2->rd, k2) : NULL;
        }
        MM_ASSERT_UNLOCKED(mm);
        disktier_read_end(batch);
        /* The window's blocks up to the first failed one get their final
         * blocks (the device's when it has room, so the request's match
         * has nothing to swap in) under the lock; their bytes are copied in
         * with it released; then they enter the tree, in order. The lock is
         * taken per block, not per window: a take can map a pool page, and
         * the executor, waiting for the lock between its steps, then waits
         * for one block's take or enter at most, never a window's. */
        size_t good = 0, got = 0, filled = 0;
        while (good < k && w->rd[good].rc == 0)
            good++;
        if (good < k)
            fails++;
        uint64_t c = cpu_ns();
        while (got < good) {
            kvmm_lock(mm);
            bool took =
                tenant_live(&mm->tt, tenant) && mm_restore_take(mm, tenant, ns, true, &w->rs[got]);
            kvmm_unlock(mm);
            if (!took)
                break;
            got++;
        }
        MM_ASSERT_UNLOCKED(mm);
        cpu[KVMM_RESTORE_CPU_TAKE] += cpu_ns() - c;
        while (filled < got) {
            c = cpu_ns();
            mm_restore_prefault(mm, &w->rs[filled]);
            uint64_t c2 = cpu_ns();
            cpu[KVMM_RESTORE_CPU_PREFAULT] += c2 - c;
            bool filled_ok =
                mm_restore_fill(mm, &w->rs[filled], disktier_data(d->dt, w->rd[filled].buf));
            cpu[KVMM_RESTORE_CPU_COPY] += cpu_ns() - c2;
            if (!filled_ok)
                break;
            filled++;
        }
        c = cpu_ns();
        for (size_t i = 0; i < got; i++) {
            kvmm_lock(mm);
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
            kvmm_unlock(mm);
        }
        cpu[KVMM_RESTORE_CPU_ENTER] += cpu_ns() - c;
        if (got < k)
            ok = false;
        b += k;
        if (!ok) {
            disktier_read_end(batch2); /* waited for, unpinned, not used */
            break;
        }
        if (k2) {
            struct rwin *t = w;
            w = w2;
            w2 = t;
            batch = batch2;
            k = k2;
        } else if (!w2 && more && b < nb) { /* no second window to be had: this one again */
            k = win_lookup(d, w, tokens, bt, b, nb, nsh, &key, &more);
            batch = k ? disktier_read_begin(d->dt, ns_name, nsh, w->rd, k) : NULL;
        } else {
            k = 0;
        }
    }
    uint64_t took = mono_ns() - t0;
    /* What is not in the other steps: the lookups, the reads and their checks. */
    uint64_t rest = cpu_ns() - c0;
    for (size_t i = 0; i < KVMM_RESTORE_CPU_N; i++)
        rest -= i == KVMM_RESTORE_CPU_READ ? 0 : cpu[i];
    cpu[KVMM_RESTORE_CPU_READ] = rest;
    kvmm_lock(mm);
    d->restore_fails += fails;
    for (size_t i = 0; i < KVMM_RESTORE_CPU_N; i++)
        d->restore_cpu_ns[i] += cpu[i];
    if (restored) {
        d->restores++;
        d->restore_ns += took;
        d->restore_last_ns = took;
    }
    kvmm_unlock(mm);
    if (w)
        win_put(d, w);
    if (w2)
        win_put(d, w2);
    free(scratch);
    return restored;
}

/* kvmm_alloc: block references, device allocation, block eviction (device
 * → host → dropped, leaf-first, by the evict policy: LRU or LRU plus hits
 * and tenant weights) and tier moves with their accounting. Making room in
 * the pages (quotas, floors, whole pages) is kvmm_room.c. Every function
 * expects the caller to hold mm->lock. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "hosttier.h"
#include "kvmm_impl.h"

int mm_fail(struct kvmm *mm, int code, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(mm->err, sizeof mm->err, fmt, ap);
    va_end(ap);
    return code;
}

void mm_ref(struct kvmm *mm, uint32_t id)
{
    struct pool_block *b = pool_block(&mm->pool, id);

    pool_ref(&mm->pool, id);
    if (b->node)
        radix_update(&mm->radix, b->node);
}

void mm_unref(struct kvmm *mm, uint32_t id)
{
    struct pool_block *b = pool_block(&mm->pool, id);
    uint32_t tenant = b->tenant;
    enum kvd_tier tier = (enum kvd_tier)b->tier;

    if (pool_unref(&mm->pool, id)) {
        struct tenant *t = &mm->tt.v[tenant];
        if (tier == KVD_TIER_DEVICE)
            t->dev_blocks--;
        else
            t->host_blocks--;
        return;
    }
    b->lru = ++mm->clock; /* released now: the most recently used */
    if (b->node)
        radix_update(&mm->radix, b->node);
}

/* Eviction order across tenants: whether cached node a goes before b (each
 * the head of its tenant's heap). LRU: the older stamp. HITS: the larger
 * weighted age, where age = clock - radix_prio (negative while a hit bonus
 * still lies ahead of the clock) and a tenant of weight w ages w times
 * slower: age / w when the age is positive, age * w when it is negative
 * (a heavier tenant's protected block stays further ahead). Within one
 * tenant the weight is common, so this is its heap's order. */
static double mm_weighted_age(const struct kvmm *mm, const struct radix_node *n)
{
    uint32_t tenant = mm->pool.blocks[n->block].tenant, w = mm->tt.v[tenant].conf.weight;
    double age = (double)mm->clock - (double)radix_prio(&mm->radix, n);

    if (w < 1)
        w = 1;
    return age >= 0 ? age / w : age * w;
}

bool mm_evicts_before(const struct kvmm *mm, const struct radix_node *a, const struct radix_node *b)
{
    if (mm->evict_policy == KVMM_EVICT_HITS) {
        double x = mm_weighted_age(mm, a), y = mm_weighted_age(mm, b);
        if (x != y)
            return x > y;
    }
    return radix_prio(&mm->radix, a) < radix_prio(&mm->radix, b);
}

void mm_drop_node(struct kvmm *mm, struct radix_node *n)
{
    const struct pool_block *b = pool_block(&mm->pool, n->block);
    uint32_t owner = b->tenant;
    mm_ev_removed(mm, n, mm_tier_medium(b->tier));
    mm_disk_dropping(mm, n);
    uint32_t id = radix_remove_leaf(&mm->radix, n);

    mm->ctr.drops++;
    mm->tt.v[owner].evictions++;
    mm_unref(mm, id);
}

void mm_drop_subtree(struct kvmm *mm, struct radix_node *top)
{
    struct radix_node *cur = top;

    for (;;) {
        struct radix_node *parent;
        bool last;
        while (cur->first_child)
            cur = cur->first_child;
        parent = cur->parent;
        last = cur == top;
        mm_drop_node(mm, cur);
        if (last)
            return;
        cur = parent;
    }
}

bool mm_drop_host_one(struct kvmm *mm, uint32_t tenant)
{
    struct radix_node *best = NULL;

    if (tenant != KVMM_NO_TENANT) {
        best = radix_lru(&mm->radix, tenant, KVD_TIER_HOST);
    } else {
        for (uint32_t i = 0; i < mm->tt.n; i++) {
            struct radix_node *c = radix_lru(&mm->radix, i, KVD_TIER_HOST);
            if (c && (!best || mm_evicts_before(mm, c, best)))
                best = c;
        }
    }
    if (!best)
        return false;
    mm_drop_node(mm, best);
    return true;
}

int mm_move(struct kvmm *mm, const uint32_t *ids, size_t n, enum kvd_tier to, size_t *bad)
{
    enum kvd_tier from = to == KVD_TIER_DEVICE ? KVD_TIER_HOST : KVD_TIER_DEVICE;
    int err = hosttier_move(&mm->pool, ids, n, to, bad);

    if (err)
        pool_trim(&mm->pool); /* pages mapped for the move that did not happen */
    if (err == KVD_EINTERNAL && to == KVD_TIER_DEVICE && bad && *bad < n)
        return mm_fail(mm, err, "host copy of block %u failed its checksum", ids[*bad]);
    if (err)
        return mm_fail(mm, err, "moving %zu blocks to the %s tier failed (%s)", n,
                       to == KVD_TIER_DEVICE ? "device" : "host", kvd_err_code(err));
    for (size_t i = 0; i < n; i++) {
        struct pool_block *b = pool_block(&mm->pool, ids[i]);
        struct tenant *t = &mm->tt.v[b->tenant];
        if (to == KVD_TIER_DEVICE) {
            t->host_blocks--;
            t->dev_blocks++;
            t->swaps_in++;
        } else {
            t->dev_blocks--;
            t->host_blocks++;
            t->swaps_out++;
        }
        if (b->node) {
            radix_tier_changed(&mm->radix, b->node, from);
            mm_ev_removed(mm, b->node, mm_tier_medium(from));
            mm_ev_stored(mm, b->node, mm_tier_medium(to));
        }
    }
    if (to == KVD_TIER_DEVICE) {
        mm->ctr.swaps_in += n;
        mm->ctr.swap_bytes_in += n * mm->block_bytes;
    } else {
        mm->ctr.swaps_out += n;
        mm->ctr.swap_bytes_out += n * mm->block_bytes;
    }
    return 0;
}

/* A device victim with no children at all, so it can be dropped outright
 * when the host tier cannot take it (rare: host full of pinned blocks). */
static struct radix_node *mm_droppable_device(struct kvmm *mm, uint32_t tenant)
{
    const struct radix_heap *h = &mm->radix.heaps[tenant * POOL_TIERS + KVD_TIER_DEVICE];
    struct radix_node *best = NULL;

    for (uint32_t i = 0; i < h->n; i++)
        if (h->v[i]->n_children == 0 &&
            (!best || radix_prio(&mm->radix, h->v[i]) < radix_prio(&mm->radix, best)))
            best = h->v[i];
    return best;
}

/* Device → host when the host tier (and the owner's host quota) can take
 * it, else dropped: when exact, v and its (host) subtree; else v when it is
 * a leaf, or another leaf of its owner that has no children at all. */
bool mm_evict_device_node(struct kvmm *mm, struct radix_node *v, bool exact)
{
    uint32_t id = v->block, owner = pool_block(&mm->pool, id)->tenant;
    char saved[sizeof mm->err];

    memcpy(saved, mm->err, sizeof saved); /* eviction failures are not the caller's error */
    if (mm->pool.n_slots[KVD_TIER_HOST] && mm_room_host(mm, &id, 1) == 0 &&
        mm_move(mm, &id, 1, KVD_TIER_HOST, NULL) == 0) {
        mm->ctr.evictions_device++;
        mm->tt.v[owner].evictions++;
        memcpy(mm->err, saved, sizeof saved);
        return true;
    }
    memcpy(mm->err, saved, sizeof saved);
    if (exact) {
        mm->ctr.evictions_device++;
        mm_drop_subtree(mm, v);
        return true;
    }
    if (v->n_children == 0 || (v = mm_droppable_device(mm, owner)) != NULL) {
        mm->ctr.evictions_device++;
        mm_drop_node(mm, v);
        return true;
    }
    return false;
}

bool mm_evict_device_one(struct kvmm *mm, uint32_t tenant)
{
    struct radix_node *best = NULL;

    /* Floor rule: evict from the asking tenant or from tenants above their
     * floor (borrowers first), never another tenant's cache inside its
     * floor. */
    for (int pass = 0; pass < 2 && !best; pass++) {
        for (uint32_t i = 0; i < mm->tt.n; i++) {
            const struct tenant *t = &mm->tt.v[i];
            struct radix_node *c;
            if (pass == 0 && i != tenant && t->dev_blocks <= t->conf.reserved_device_blocks)
                continue;
            c = radix_lru(&mm->radix, i, KVD_TIER_DEVICE);
            if (c && (!best || mm_evicts_before(mm, c, best)))
                best = c;
        }
        if (tenant != KVMM_NO_TENANT)
            break; /* a real tenant never takes another's floor */
    }
    return best && mm_evict_device_node(mm, best, false);
}

int mm_alloc_device(struct kvmm *mm, uint32_t tenant, uint32_t ns, size_t n, uint32_t *ids)
{
    int err = mm_room_new(mm, KVD_TIER_DEVICE, tenant, ns, n);
    uint32_t owner = err ? POOL_NONE : mm_owner(mm, tenant, ns);

    if (err)
        return err;
    for (size_t i = 0; i < n; i++) {
        struct pool_block *b;
        err = owner == POOL_NONE ? KVD_ENOMEM
                                 : pool_alloc_in(&mm->pool, KVD_TIER_DEVICE, owner, &ids[i]);
        if (err) { /* room was made: only a failed page map gets here */
            while (i)
                mm_unref(mm, ids[--i]);
            pool_trim(&mm->pool);
            return mm_fail(mm, KVD_ENOMEM, "device allocation failed after room was made");
        }
        mm->tt.v[tenant].dev_blocks++;
        b = pool_block(&mm->pool, ids[i]);
        b->lru = ++mm->clock;
        /* Zero-fill so no tenant reads a previous owner's K/V: on the
         * device where the backend can (cuda: a memset on its copy stream),
         * else a copy from zeros. */
        void *blk = pool_block_ptr(&mm->pool, ids[i]);
        if (mm->be->ops->zero ? mm->be->ops->zero(mm->be, blk, KVD_TIER_DEVICE, mm->block_bytes)
                              : mm->be->ops->copy(mm->be, blk, KVD_TIER_DEVICE, mm->zeros,
                                                  KVD_TIER_HOST, mm->block_bytes)) {
            for (size_t k = i + 1; k > 0; k--)
                mm_unref(mm, ids[k - 1]);
            pool_trim(&mm->pool); /* pages mapped for the blocks not made */
            return mm_fail(mm, KVD_EINTERNAL, "zero-filling a new block failed");
        }
    }
    return 0;
}

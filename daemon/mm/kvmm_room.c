/* kvmm_room: making room for blocks in the pool's pages. A page holds the
 * blocks of one owner (tenant, namespace), so a block needs a free slot in
 * one of its owner's pages or a whole page: free in the page budget, or
 * given back by evicting a page full of cache (of a tenant the floor rule
 * lets lose it), or by another pool on the budget. Quotas are checked
 * first (blocks in this pool, bytes across the budget), and a request that
 * cannot succeed evicts nothing. Every function expects mm->lock held. */
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "kvmm_impl.h"

uint32_t mm_owner(struct kvmm *mm, uint32_t tenant, uint32_t ns)
{
    uint32_t bt = tenant < mm->tt.n ? mm->tt.v[tenant].bt : KVPAGES_NONE;
    return pool_owner(&mm->pool, tenant, ns, bt);
}

static bool quota_limited(uint32_t q)
{
    return q != KVMM_UNLIMITED;
}

/* Which tenants' cache on tier t may be evicted for asker: its own, and on
 * the device the tenants above their floors (blocks in this pool and bytes
 * in the budget); with pass 1 (asker KVMM_NO_TENANT: an admin's eviction)
 * anyone's; on the host anyone's. allowed has mm->tt.n entries. */
static void fill_allowed(struct kvmm *mm, enum kvd_tier t, uint32_t asker, int pass, bool *allowed)
{
    for (uint32_t u = 0; u < mm->tt.n; u++) {
        const struct tenant *tu = &mm->tt.v[u];
        if (!tenant_live(&mm->tt, u)) {
            allowed[u] = false;
            continue;
        }
        allowed[u] = t == KVD_TIER_HOST || u == asker || pass > 0 ||
                     (tu->dev_blocks > tu->conf.reserved_device_blocks &&
                      kvpages_above_floor(mm->pool.budget, tu->bt) > 0);
    }
}

/* The node of page pg with the highest eviction priority: a page goes no
 * earlier than its most valuable block. */
static struct radix_node *page_rep(struct kvmm *mm, enum kvd_tier t, uint32_t pg)
{
    struct pool *p = &mm->pool;
    struct radix_node *rep = NULL;
    for (uint32_t s = pool_page_first(p, t, pg); s < pool_page_end(p, t, pg); s++) {
        uint32_t id = p->slot_block[t][s];
        if (id == POOL_NONE || !p->blocks[id].node)
            continue;
        struct radix_node *n = p->blocks[id].node;
        if (!rep || mm_evicts_before(mm, rep, n))
            rep = n;
    }
    return rep;
}

/* Whether page pg can be evicted as a unit now: every block's children
 * that keep it from leaving (device: children on the device; host: any)
 * are in the page too, so leaf-first eviction inside it empties it. */
static bool page_unit(struct kvmm *mm, enum kvd_tier t, uint32_t pg)
{
    struct pool *p = &mm->pool;
    for (uint32_t s = pool_page_first(p, t, pg); s < pool_page_end(p, t, pg); s++) {
        uint32_t id = p->slot_block[t][s];
        if (id == POOL_NONE)
            continue;
        const struct radix_node *n = p->blocks[id].node;
        if (!n)
            return false;
        if (t == KVD_TIER_DEVICE ? n->n_dev_children == 0 : n->n_children == 0)
            continue;
        for (const struct radix_node *c = n->first_child; c; c = c->next_sibling) {
            const struct pool_block *cb = &p->blocks[c->block];
            if (t == KVD_TIER_DEVICE && cb->tier != KVD_TIER_DEVICE)
                continue;
            if (cb->tier != t || pool_page_of(p, t, cb->slot) != pg)
                return false;
        }
    }
    return true;
}

/* The full-cache page of tier t to evict first among allowed tenants (only
 * tenant `only` when not KVMM_NO_TENANT), or POOL_NONE; *rep its node. */
static uint32_t victim_page(struct kvmm *mm, enum kvd_tier t, const bool *allowed, uint32_t only,
                            struct radix_node **rep)
{
    struct pool *p = &mm->pool;
    uint32_t best = POOL_NONE;
    *rep = NULL;
    if (p->n_fc_pages[t] == 0)
        return POOL_NONE;
    for (uint32_t pg = 0; pg < p->n_pages[t]; pg++) {
        const struct pool_page *g = &p->pages[t][pg];
        if (g->owner == POOL_NONE || g->pins || g->draining || g->n_used == 0 ||
            g->n_cached != g->n_used)
            continue;
        uint32_t u = p->owners[g->owner].tenant;
        if (u >= mm->tt.n || !allowed[u] || (only != KVMM_NO_TENANT && u != only) ||
            !page_unit(mm, t, pg))
            continue;
        struct radix_node *r = page_rep(mm, t, pg);
        if (r && (!*rep || mm_evicts_before(mm, r, *rep))) {
            *rep = r;
            best = pg;
        }
    }
    return best;
}

/* Evicts the blocks of unit page pg, leaf first, until it goes back to the
 * budget. A device block the host cannot take is dropped, or (as block
 * eviction does) another childless leaf of its owner instead, so the page
 * may not empty at once. Returns the blocks evicted. */
static uint32_t evict_page(struct kvmm *mm, enum kvd_tier t, uint32_t pg)
{
    struct pool *p = &mm->pool;
    uint32_t s0 = pool_page_first(p, t, pg), s1 = pool_page_end(p, t, pg), done = 0;
    for (uint32_t round = 0; round <= s1 - s0; round++) {
        const struct pool_page *g = &p->pages[t][pg];
        if (g->owner == POOL_NONE || g->n_used == 0)
            break;
        struct radix_node *leaf = NULL;
        for (uint32_t s = s0; s < s1 && !leaf; s++) {
            uint32_t id = p->slot_block[t][s];
            struct radix_node *n = id == POOL_NONE ? NULL : p->blocks[id].node;
            if (n && p->blocks[id].cached &&
                (t == KVD_TIER_DEVICE ? n->n_dev_children == 0 : n->n_children == 0))
                leaf = n;
        }
        if (!leaf)
            break;
        if (t == KVD_TIER_DEVICE) {
            if (!mm_evict_device_node(mm, leaf, false))
                break;
        } else {
            mm_drop_node(mm, leaf);
        }
        done++;
    }
    return done;
}

/* Owner o's own next cached block on tier t, when evicting it frees a slot
 * o can use (its page takes blocks). */
static struct radix_node *own_block(struct kvmm *mm, enum kvd_tier t, uint32_t o)
{
    struct pool *p = &mm->pool;
    struct radix_node *h = radix_lru(&mm->radix, p->owners[o].tenant, t);
    if (!h)
        return NULL;
    const struct pool_block *b = &p->blocks[h->block];
    const struct pool_page *g = &p->pages[t][pool_page_of(p, t, b->slot)];
    return b->owner == o && !g->pins && !g->draining ? h : NULL;
}

static bool evict_block(struct kvmm *mm, enum kvd_tier t, struct radix_node *v)
{
    if (t == KVD_TIER_DEVICE)
        return mm_evict_device_node(mm, v, false);
    mm_drop_node(mm, v);
    return true;
}

/* The last resort: the first block in eviction order among allowed
 * tenants, whatever page it is in (pages whose blocks have children in
 * other pages become units as those go). false when there is none. */
static bool evict_any(struct kvmm *mm, enum kvd_tier t, const bool *allowed)
{
    struct radix_node *best = NULL;
    for (uint32_t u = 0; u < mm->tt.n; u++) {
        struct radix_node *c = allowed[u] ? radix_lru(&mm->radix, u, t) : NULL;
        if (c && (!best || mm_evicts_before(mm, c, best)))
            best = c;
    }
    if (!best)
        return false;
    if (t == KVD_TIER_DEVICE)
        return mm_evict_device_node(mm, best, false);
    mm_drop_node(mm, best);
    return true;
}

/* Pool pages tier t could have for asker without other pools: free ones
 * (budget and positions) and full-cache ones of allowed tenants, each
 * other tenant's no more than it may lose above its floors. */
static uint64_t pages_obtainable(struct kvmm *mm, enum kvd_tier t, uint32_t asker,
                                 const bool *allowed)
{
    struct pool *p = &mm->pool;
    uint64_t n = pool_pages_free(p, t);
    uint32_t spp = p->slots_per_page[t], k = p->budget_pages[t];
    for (uint32_t u = 0; u < mm->tt.n; u++) {
        if (!allowed[u])
            continue;
        uint64_t fc = 0;
        for (uint32_t o = 0; o < p->n_owners; o++)
            if (p->owners[o].tenant == u)
                fc += p->owners[o].n_fc_pages[t];
        if (t == KVD_TIER_DEVICE && u != asker && asker != KVMM_NO_TENANT) {
            const struct tenant *tu = &mm->tt.v[u];
            if (tu->conf.reserved_device_blocks) {
                uint64_t above = tu->dev_blocks - tu->conf.reserved_device_blocks;
                if (above / spp < fc)
                    fc = above / spp;
            }
            uint32_t above_pages = kvpages_above_floor(p->budget, tu->bt);
            if (above_pages != UINT32_MAX && above_pages / k < fc)
                fc = above_pages / k;
        }
        n += fc;
    }
    return n;
}

/* Pool pages owner o still needs for n more blocks on tier t, after its
 * free slots and (with own) the cached blocks of its partly live pages. */
static uint64_t pages_short(struct kvmm *mm, enum kvd_tier t, uint32_t o, size_t n, bool own)
{
    const struct pool_owner *w = &mm->pool.owners[o];
    uint64_t have = (uint64_t)w->n_free[t] + (own ? w->n_cached[t] - w->n_fc_blocks[t] : 0);
    uint32_t spp = mm->pool.slots_per_page[t];
    return n > have ? (n - have + spp - 1) / spp : 0;
}

struct mm_need {
    uint32_t owner;
    size_t n;
};

static const char *tier_name(enum kvd_tier t)
{
    return t == KVD_TIER_DEVICE ? "device" : "host";
}

/* Whether tenant u has a byte quota on tier t (as this pool was told: the
 * daemon tells every pool the same). */
static bool has_byte_quota(const struct kvmm *mm, enum kvd_tier t, uint32_t u)
{
    const struct kvmm_tenant_conf *c = &mm->tt.v[u].conf;
    return (t == KVD_TIER_DEVICE ? c->max_device_bytes : c->max_host_bytes) != 0;
}

/* The common case: the owners' free slots and the free pages cover it and
 * no byte quota stands in the way, so there is no eviction to weigh: 0
 * when done, 1 when the long way is needed. */
static int room_fast(struct kvmm *mm, enum kvd_tier t, const struct mm_need *need, size_t nn,
                     bool quota)
{
    struct pool *p = &mm->pool;
    uint64_t want = 0;
    for (size_t i = 0; i < nn; i++) {
        uint64_t w = pages_short(mm, t, need[i].owner, need[i].n, false);
        if (w && quota && has_byte_quota(mm, t, p->owners[need[i].owner].tenant))
            return 1;
        want += w;
    }
    if (want == 0)
        return 0;
    if (want > pool_pages_free(p, t))
        return 1;
    for (size_t i = 0; i < nn; i++)
        while (p->owners[need[i].owner].n_free[t] < need[i].n)
            if (pool_page_add(p, t, need[i].owner, quota) != 0)
                return 1; /* another pool took the pages meanwhile */
    return 0;
}

/* Room on tier t for need[i].n more blocks of each need[i].owner (nn
 * distinct owners), for asker; quota: byte quotas apply (new blocks, and
 * every host move). check: only whether it can be done (asking the
 * budget's other pools for pages if this one is short), evicting nothing
 * here. */
static int room(struct kvmm *mm, enum kvd_tier t, const struct mm_need *need, size_t nn,
                uint32_t asker, bool quota, bool check)
{
    struct pool *p = &mm->pool;
    uint32_t k = p->budget_pages[t];
    uint64_t short_pages = 0;
    int rc = 0;

    if (p->n_slots[t] == 0)
        return mm_fail(mm, KVD_ENOMEM, "there is no %s tier", tier_name(t));
    bool *allowed = fault_calloc(mm->tt.n + 1, sizeof *allowed);
    if (!allowed) {
        pool_trim(p);
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    }
    fill_allowed(mm, t, asker, 0, allowed);
    /* Byte quotas first: pages a tenant must take beyond its quota have to
     * come from its own full-cache pages here. */
    for (size_t i = 0; quota && i < nn; i++) {
        uint32_t u = p->owners[need[i].owner].tenant;
        const struct tenant *tu = &mm->tt.v[u];
        uint64_t want = 0, own_fc = 0;
        for (size_t j = 0; j < nn; j++)
            if (p->owners[need[j].owner].tenant == u)
                want += pages_short(mm, t, need[j].owner, need[j].n, true) * k;
        for (uint32_t o = 0; o < p->n_owners; o++)
            if (p->owners[o].tenant == u)
                own_fc += (uint64_t)p->owners[o].n_fc_pages[t] * k;
        uint32_t left = kvpages_quota_left(p->budget, t, tu->bt);
        if (left != UINT32_MAX && want > left + own_fc) {
            /* its cache in the other pools (another model's) gives first */
            uint64_t ask = want - left - own_fc;
            (void)kvpages_reclaim_own(p->budget, &mm->member, t, tu->bt,
                                      ask > UINT32_MAX ? UINT32_MAX : (uint32_t)ask);
            left = kvpages_quota_left(p->budget, t, tu->bt);
        }
        if (left != UINT32_MAX && want > left + own_fc) {
            struct kvpages_limits l;
            kvpages_tenant_limits(p->budget, tu->bt, &l);
            rc = mm_fail(mm, KVD_EQUOTA,
                         "tenant '%s': %s byte quota %llu reached (%u pages of %llu bytes in use "
                         "across the budget, %llu more needed)",
                         tu->conf.name, tier_name(t), (unsigned long long)l.max_bytes[t],
                         kvpages_tenant_pages(p->budget, t, tu->bt),
                         (unsigned long long)kvpages_page_bytes(p->budget, t),
                         (unsigned long long)(want - left));
            goto out;
        }
    }
    for (size_t i = 0; i < nn; i++)
        short_pages +=
            pages_short(mm, t, need[i].owner, need[i].n, allowed[p->owners[need[i].owner].tenant]);
    if (short_pages) {
        uint64_t have = pages_obtainable(mm, t, asker, allowed);
        /* A pool holding less than its even share of the budget asks the
         * others for their cache before it evicts its own: the pools of
         * several models share the budget, not only what is free. A pool
         * out of the share (a draft's) has none: its own cache goes first. */
        bool below =
            !mm->member.unshared && (uint64_t)p->n_mapped[t] * k < kvpages_share(p->budget, t);
        if (have < short_pages || (below && kvpages_free_pages(p->budget, t) < short_pages * k)) {
            uint32_t bt = asker < mm->tt.n ? mm->tt.v[asker].bt : KVPAGES_NONE;
            uint64_t ask = (have < short_pages ? short_pages - have : short_pages) * k;
            (void)kvpages_reclaim(p->budget, &mm->member, t, bt,
                                  ask > UINT32_MAX ? UINT32_MAX : (uint32_t)ask);
            have = pages_obtainable(mm, t, asker, allowed);
        }
        if (have < short_pages) {
            rc = mm_fail(mm, KVD_ENOMEM,
                         "%s pool exhausted: %llu more pages of %zu bytes needed, %llu obtainable "
                         "(%u free in the budget; the rest in use, or cache other tenants keep "
                         "inside their floors)",
                         tier_name(t), (unsigned long long)short_pages, p->page_bytes[t],
                         (unsigned long long)have, kvpages_free_pages(p->budget, t));
            goto out;
        }
    }
    if (check)
        goto out;
    /* Now make it so, owner by owner. Every round maps a page, evicts
     * something or fails, so it ends. */
    for (size_t i = 0; i < nn && !rc; i++) {
        uint32_t o = need[i].owner, u = p->owners[o].tenant, reclaims = 0;
        while (p->owners[o].n_free[t] < need[i].n) {
            int err = pool_page_add(p, t, o, quota);
            if (err == 0)
                continue;
            struct radix_node *rep = NULL, *blk;
            uint32_t pg;
            fill_allowed(mm, t, asker, 0, allowed);
            if (err == KVD_EQUOTA) {
                /* Over its byte quota: only its own cache can give. */
                blk = own_block(mm, t, o);
                pg = victim_page(mm, t, allowed, u, &rep);
            } else {
                blk = allowed[u] ? own_block(mm, t, o) : NULL;
                pg = victim_page(mm, t, allowed, KVMM_NO_TENANT, &rep);
            }
            if (blk && (pg == POOL_NONE || mm_evicts_before(mm, blk, rep)) &&
                evict_block(mm, t, blk))
                continue;
            if (pg != POOL_NONE && evict_page(mm, t, pg))
                continue;
            if (err == KVD_EQUOTA) {
                if (reclaims++ < 3 &&
                    kvpages_reclaim_own(p->budget, &mm->member, t, p->owners[o].bt, k) >= k)
                    continue;
                rc = mm_fail(mm, KVD_EQUOTA, "tenant '%s': %s byte quota reached",
                             mm->tt.v[u].conf.name, tier_name(t));
                break;
            }
            if (reclaims++ < 3 &&
                kvpages_reclaim(p->budget, &mm->member, t,
                                asker < mm->tt.n ? mm->tt.v[asker].bt : KVPAGES_NONE, k) >= k)
                continue; /* (another thread may take them first: then again) */
            if (pg == POOL_NONE && evict_any(mm, t, allowed))
                continue;
            rc = mm_fail(mm, KVD_ENOMEM, "%s pool exhausted: %zu blocks requested", tier_name(t),
                         need[i].n);
            break;
        }
    }
out:
    if (rc)
        pool_trim(p); /* pages mapped for what cannot be done */
    free(allowed);
    return rc;
}

/* ---- the entry points --------------------------------------------------- */

/* The per-pool block quota on the device (max_device_blocks): over it, the
 * tenant's own cached blocks go first (apply); check: only whether they can. */
static int device_block_quota(struct kvmm *mm, uint32_t tenant, size_t n, bool apply)
{
    struct tenant *t = &mm->tt.v[tenant];
    if (!quota_limited(t->conf.max_device_blocks) ||
        (uint64_t)t->dev_blocks + n <= t->conf.max_device_blocks)
        return 0;
    uint64_t over = (uint64_t)t->dev_blocks + n - t->conf.max_device_blocks;
    if (over > radix_cached(&mm->radix, tenant, KVD_TIER_DEVICE))
        return mm_fail(mm, KVD_EQUOTA,
                       "tenant '%s': device block quota %u reached (%u in use, %zu more "
                       "requested)",
                       t->conf.name, t->conf.max_device_blocks, t->dev_blocks, n);
    for (; apply && over > 0; over--) {
        struct radix_node *v = radix_lru(&mm->radix, tenant, KVD_TIER_DEVICE);
        if (!v || !mm_evict_device_node(mm, v, false))
            return mm_fail(mm, KVD_EQUOTA, "tenant '%s': device block quota %u reached",
                           t->conf.name, t->conf.max_device_blocks);
    }
    return 0;
}

/* The per-pool host block quotas (max_host_blocks) of need[] (tenant ->
 * blocks): whether each can be met (check), or each tenant's own host
 * leaves dropped until it is (apply). */
static int host_block_quotas(struct kvmm *mm, const uint32_t *need, bool apply)
{
    for (uint32_t i = 0; !apply && i < mm->tt.n; i++) {
        const struct tenant *t = &mm->tt.v[i];
        uint32_t ev = radix_cached(&mm->radix, i, KVD_TIER_HOST);
        if (need[i] && quota_limited(t->conf.max_host_blocks) &&
            (uint64_t)t->host_blocks + need[i] > (uint64_t)t->conf.max_host_blocks + ev)
            return mm_fail(mm, KVD_EQUOTA,
                           "tenant '%s': host block quota %u reached (%u in use, %u more needed)",
                           t->conf.name, t->conf.max_host_blocks, t->host_blocks, need[i]);
    }
    for (uint32_t i = 0; apply && i < mm->tt.n; i++) {
        const struct tenant *t = &mm->tt.v[i];
        while (need[i] && quota_limited(t->conf.max_host_blocks) &&
               (uint64_t)t->host_blocks + need[i] > t->conf.max_host_blocks)
            if (!mm_drop_host_one(mm, i))
                return mm_fail(mm, KVD_EQUOTA, "tenant '%s': host block quota %u reached",
                               t->conf.name, t->conf.max_host_blocks);
    }
    return 0;
}

/* Quotas first and then room, each checked before anything is evicted for
 * either: a refusal evicts nothing. per: host blocks per tenant (host). */
static int room_all(struct kvmm *mm, enum kvd_tier t, const struct mm_need *need, size_t nn,
                    uint32_t asker, uint32_t dev_tenant, size_t dev_n, const uint32_t *per)
{
    int rc;
    /* byte quotas: new blocks, host moves, and swap-ins for an asker */
    bool quota = t == KVD_TIER_HOST || dev_tenant != KVMM_NO_TENANT || asker != KVMM_NO_TENANT;
    if (t == KVD_TIER_DEVICE && dev_tenant != KVMM_NO_TENANT &&
        (rc = device_block_quota(mm, dev_tenant, dev_n, false)))
        return rc;
    /* Under the block quotas already (nothing to evict for them): the
     * short way may do. */
    bool under = true;
    if (t == KVD_TIER_DEVICE && dev_tenant != KVMM_NO_TENANT) {
        const struct tenant *tu = &mm->tt.v[dev_tenant];
        under = !quota_limited(tu->conf.max_device_blocks) ||
                (uint64_t)tu->dev_blocks + dev_n <= tu->conf.max_device_blocks;
    }
    for (uint32_t i = 0; t == KVD_TIER_HOST && per && i < mm->tt.n && under; i++) {
        const struct tenant *tu = &mm->tt.v[i];
        under = !per[i] || !quota_limited(tu->conf.max_host_blocks) ||
                (uint64_t)tu->host_blocks + per[i] <= tu->conf.max_host_blocks;
    }
    if (under && room_fast(mm, t, need, nn, quota) == 0)
        return 0;
    if (t == KVD_TIER_HOST && (rc = host_block_quotas(mm, per, false)))
        return rc;
    if ((rc = room(mm, t, need, nn, asker, quota, true)))
        return rc;
    if (t == KVD_TIER_DEVICE && dev_tenant != KVMM_NO_TENANT &&
        (rc = device_block_quota(mm, dev_tenant, dev_n, true)))
        return rc;
    if (t == KVD_TIER_HOST && (rc = host_block_quotas(mm, per, true)))
        return rc;
    return room(mm, t, need, nn, asker, quota, false);
}

int mm_room_new(struct kvmm *mm, enum kvd_tier tier, uint32_t tenant, uint32_t ns, size_t n)
{
    int rc;
    if (n == 0)
        return 0;
    if (tenant >= mm->tt.n)
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant %u", tenant);
    if (tier == KVD_TIER_HOST && mm->pool.n_slots[KVD_TIER_HOST] == 0)
        return mm_fail(mm, KVD_ENOMEM, "there is no host tier (n_host_blocks = 0)");
    uint32_t o = mm_owner(mm, tenant, ns);
    if (o == POOL_NONE)
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    struct mm_need one = {.owner = o, .n = n};
    if (tier == KVD_TIER_DEVICE)
        return room_all(mm, tier, &one, 1, tenant, tenant, n, NULL);
    uint32_t *per = fault_calloc(mm->tt.n + 1, sizeof *per);
    if (!per)
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    per[tenant] = (uint32_t)n;
    rc = room_all(mm, tier, &one, 1, KVMM_NO_TENANT, KVMM_NO_TENANT, 0, per);
    free(per);
    return rc;
}

int mm_room_move(struct kvmm *mm, enum kvd_tier to, const uint32_t *ids, size_t n, uint32_t asker)
{
    struct mm_need *need;
    uint32_t *per = NULL;
    size_t nn = 0;
    int rc = 0;

    if (n == 0)
        return 0;
    if (mm->pool.n_slots[to] == 0)
        return mm_fail(mm, KVD_ENOMEM, "there is no %s tier (n_%s_blocks = 0)", tier_name(to),
                       tier_name(to));
    need = fault_malloc(sizeof *need * n);
    per = fault_calloc(mm->tt.n + 1, sizeof *per);
    if (!need || !per) {
        rc = mm_fail(mm, KVD_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const struct pool_block *b = pool_block(&mm->pool, ids[i]);
        size_t j = 0;
        while (j < nn && need[j].owner != b->owner)
            j++;
        if (j == nn)
            need[nn++] = (struct mm_need){.owner = b->owner, .n = 0};
        need[j].n++;
        per[b->tenant]++;
    }
    /* Swap-ins of blocks that exist are not refused by the block quotas;
     * the byte quotas hold (pages across the budget: the tenant's own cache
     * gives way first, here and in the other models' pools). Copies to the
     * host are refused by both (the host tier is the owners' to fill), and
     * the host's blocks are dropped in eviction order, anyone's. */
    rc = room_all(mm, to, need, nn, to == KVD_TIER_HOST ? KVMM_NO_TENANT : asker, KVMM_NO_TENANT, 0,
                  per);
out:
    free(need);
    free(per);
    return rc;
}

int mm_room_host(struct kvmm *mm, const uint32_t *ids, size_t n)
{
    return mm_room_move(mm, KVD_TIER_HOST, ids, n, KVMM_NO_TENANT);
}

int mm_room_host_new(struct kvmm *mm, uint32_t tenant, uint32_t ns, size_t n)
{
    return mm_room_new(mm, KVD_TIER_HOST, tenant, ns, n);
}

size_t mm_device_headroom(struct kvmm *mm, uint32_t tenant)
{
    struct pool *p = &mm->pool;
    enum kvd_tier t = KVD_TIER_DEVICE;
    if (tenant >= mm->tt.n)
        return 0;
    bool *allowed = fault_calloc(mm->tt.n + 1, sizeof *allowed);
    uint32_t o = mm_owner(mm, tenant, mm->tt.v[tenant].ns);
    if (!allowed || o == POOL_NONE) {
        free(allowed);
        return 0;
    }
    fill_allowed(mm, t, tenant, 0, allowed);
    const struct pool_owner *w = &p->owners[o];
    /* Its own full-cache pages count as whole pages; its cached blocks in
     * partly live pages one slot each. */
    uint64_t room = (uint64_t)w->n_free[t] + (w->n_cached[t] - w->n_fc_blocks[t]) +
                    pages_obtainable(mm, t, tenant, allowed) * p->slots_per_page[t];
    free(allowed);
    return room > SIZE_MAX ? SIZE_MAX : (size_t)room;
}

/* ---- another pool asks ---------------------------------------------------- */

uint32_t mm_reclaim_own(void *ctx, enum kvd_tier t, uint32_t bt, uint32_t n)
{
    struct kvmm *mm = ctx;
    uint32_t freed = 0, u = KVMM_NO_TENANT;
    if (!mm_trylock(mm))
        return 0;
    struct pool *p = &mm->pool;
    for (uint32_t i = 0; i < mm->tt.n; i++)
        if (tenant_live(&mm->tt, i) && mm->tt.v[i].bt == bt)
            u = i;
    bool *allowed = u != KVMM_NO_TENANT && p->n_slots[t] ? fault_calloc(mm->tt.n + 1, 1) : NULL;
    char saved[sizeof mm->err];
    memcpy(saved, mm->err, sizeof saved);
    uint32_t k = p->budget_pages[t] ? p->budget_pages[t] : 1;
    /* Its pages full of its cache, evicted whole (device blocks to the
     * host tier): each goes back to the budget or becomes a spare, which
     * is nobody's; either way the tenant holds k pages less. */
    while (allowed && freed < n) {
        struct radix_node *rep;
        allowed[u] = true;
        uint32_t pg = victim_page(mm, t, allowed, u, &rep);
        if (pg == POOL_NONE) {
            /* no unit page: its cached blocks in eviction order, until one
             * of its pages empties (back to the budget, or a spare) */
            uint32_t before = kvpages_tenant_pages(p->budget, t, bt);
            while (kvpages_tenant_pages(p->budget, t, bt) == before && evict_any(mm, t, allowed))
                ;
            if (kvpages_tenant_pages(p->budget, t, bt) == before)
                break;
            freed += before - kvpages_tenant_pages(p->budget, t, bt);
            continue;
        }
        if (!evict_page(mm, t, pg))
            break;
        freed += k;
    }
    memcpy(mm->err, saved, sizeof saved);
    free(allowed);
    kvmm_unlock(mm);
    return freed;
}

uint32_t mm_reclaim(void *ctx, enum kvd_tier t, uint32_t bt, uint32_t n)
{
    struct kvmm *mm = ctx;
    uint32_t freed = 0;
    if (!mm_trylock(mm))
        return 0; /* busy: its own thread makes room as it goes */
    struct pool *p = &mm->pool;
    uint32_t asker = KVMM_NO_TENANT - 1; /* a tenant of another pool: the floor rule */
    for (uint32_t u = 0; u < mm->tt.n; u++)
        if (tenant_live(&mm->tt, u) && mm->tt.v[u].bt == bt)
            asker = u;
    bool *allowed = p->n_slots[t] ? fault_calloc(mm->tt.n + 1, sizeof *allowed) : NULL;
    char saved[sizeof mm->err];
    memcpy(saved, mm->err, sizeof saved);
    /* Spares first (nobody's), then pages full of cache, evicted and not
     * kept as spares. */
    uint32_t k = p->budget_pages[t] ? p->budget_pages[t] : 1;
    freed = k * pool_release_spares(p, t, (n + k - 1) / k);
    while (allowed && freed < n) {
        struct radix_node *rep;
        fill_allowed(mm, t, asker, 0, allowed);
        uint32_t pg = victim_page(mm, t, allowed, KVMM_NO_TENANT, &rep);
        if (pg == POOL_NONE) {
            /* No page is a unit (its blocks' children lie in other pages,
             * as a prompt's path across two pages does): cached blocks in
             * eviction order, which empties pages as they go. */
            if (!evict_any(mm, t, allowed))
                break;
        } else if (!evict_page(mm, t, pg)) {
            break;
        }
        freed += k * pool_release_spares(p, t, UINT32_MAX);
    }
    memcpy(mm->err, saved, sizeof saved);
    free(allowed);
    kvmm_unlock(mm);
    return freed;
}

/* ---- asking the other pools before admission ------------------------------ */

size_t kvmm_device_room(struct kvmm *mm, uint32_t tenant)
{
    MM_ASSERT_LOCKED(mm);
    return mm_device_headroom(mm, tenant);
}

size_t kvmm_device_ask(struct kvmm *mm, uint32_t tenant, size_t n, bool others)
{
    MM_ASSERT_LOCKED(mm);
    size_t have = kvmm_device_available(mm, tenant);
    if (have >= n || !tenant_live(&mm->tt, tenant))
        return have;
    struct pool *p = &mm->pool;
    const enum kvd_tier t = KVD_TIER_DEVICE;
    uint32_t bt = mm->tt.v[tenant].bt, spp = p->slots_per_page[t], k = p->budget_pages[t];
    if (!spp || !k)
        return have;
    char saved[sizeof mm->err];
    memcpy(saved, mm->err, sizeof saved);
    /* Budget pages for what is short: the tenant's own cache on the other
     * models first when its byte quota is what bounds it... */
    uint64_t ask = ((uint64_t)(n - have) + spp - 1) / spp * k;
    if (kvpages_quota_left(p->budget, t, bt) != UINT32_MAX) {
        (void)kvpages_reclaim_own(p->budget, &mm->member, t, bt,
                                  ask > UINT32_MAX ? UINT32_MAX : (uint32_t)ask);
        have = kvmm_device_available(mm, tenant);
    }
    /* ...then, with others, cache the floor rule lets go in their pools */
    if (others && have < n) {
        ask = ((uint64_t)(n - have) + spp - 1) / spp * k;
        (void)kvpages_reclaim(p->budget, &mm->member, t, bt,
                              ask > UINT32_MAX ? UINT32_MAX : (uint32_t)ask);
        have = kvmm_device_available(mm, tenant);
    }
    memcpy(mm->err, saved, sizeof saved);
    return have;
}

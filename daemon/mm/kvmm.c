/* kvmm: the memory manager facade: construction, the lock, tenants and
 * namespaces, eviction on demand and statistics. Sequence operations are in
 * kvmm_seq.c, allocation and eviction in kvmm_alloc.c, the invariant checker
 * in kvmm_check.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmm_impl.h"
#include "workpool.h"

/* Geometry limits: generous for any real model, small enough that no
 * product below overflows. */
#define KVMM_MAX_DIM 65536u
#define KVMM_MAX_BLOCK_BYTES (1ull << 32)

int kvmm_new(const struct kvmm_config *cfg, struct kvmm **out)
{
    struct kvmm *mm;
    struct kv_geom g = cfg->geom;
    uint64_t bytes;
    int err;

    *out = NULL;
    if (g.block_tokens == 0)
        g.block_tokens = 16;
    if (!cfg->be || g.layers == 0 || g.kv_heads == 0 || g.head_dim == 0 ||
        g.layers > KVMM_MAX_DIM || g.kv_heads > KVMM_MAX_DIM || g.head_dim > KVMM_MAX_DIM ||
        g.block_tokens > 4096 || kv_row_bytes(g.dtype, g.head_dim) == 0 ||
        (!cfg->pages && cfg->n_device_blocks == 0) ||
        (cfg->pages && kvpages_backend(cfg->pages) != cfg->be))
        return KVD_EBADREQ;
    bytes =
        (uint64_t)g.layers * 2 * g.kv_heads * g.block_tokens * kv_row_bytes(g.dtype, g.head_dim);
    if (bytes > KVMM_MAX_BLOCK_BYTES)
        return KVD_EBADREQ;
    mm = calloc(1, sizeof *mm);
    if (!mm)
        return KVD_ENOMEM;
    mm->geom = g;
    mm->be = cfg->be;
    mm->block_bytes = (size_t)bytes;
    mm->token_bytes = mm->block_bytes / g.block_tokens;
    mm->root_key = blockkey_root(cfg->fingerprint, &g);
    memcpy(mm->fingerprint, cfg->fingerprint, sizeof mm->fingerprint);
    if (cfg->handle_tag > 126) {
        err = KVD_EBADREQ;
        goto out_free;
    }
    mm->st.tag = (uint64_t)cfg->handle_tag << SEQ_TAG_SHIFT;
    mm->staging = malloc(mm->block_bytes);
    mm->zeros = calloc(1, mm->block_bytes);
    if (!mm->staging || !mm->zeros) {
        err = KVD_ENOMEM;
        goto out_free;
    }
    if (cfg->pages) {
        uint64_t cap[POOL_TIERS] = {cfg->max_device_bytes,
                                    cfg->no_host ? POOL_TIER_OFF : cfg->max_host_bytes};
        err = pool_init_budget(&mm->pool, cfg->pages, mm->block_bytes, cap);
    } else {
        err = pool_init(&mm->pool, cfg->be, mm->block_bytes, cfg->n_device_blocks,
                        cfg->n_host_blocks);
    }
    if (!err && cfg->device_detached)
        err = pool_device_release(&mm->pool);
    if (err)
        goto out_free;
    err = radix_init(&mm->radix, &mm->pool, g.block_tokens);
    if (err)
        goto out_pool;
    /* A block's bonus per doubling of its hits: KVMM_HIT_SCALE_POOLS device
     * pools' worth of clock ticks (kvmm_impl.h). */
    mm->evict_policy = cfg->evict_policy == KVMM_EVICT_LRU ? KVMM_EVICT_LRU : KVMM_EVICT_HITS;
    mm->radix.hit_scale = mm->evict_policy == KVMM_EVICT_HITS
                              ? (uint64_t)KVMM_HIT_SCALE_POOLS * mm->pool.n_slots[KVD_TIER_DEVICE]
                              : 0;
    if (pthread_mutex_init(&mm->lock, NULL)) {
        err = KVD_EINTERNAL;
        goto out_radix;
    }
    mm->member = (struct kvpages_member){.reclaim = mm_reclaim,
                                         .reclaim_own = mm_reclaim_own,
                                         .ctx = mm,
                                         .unshared = cfg->pages && cfg->unshared};
    kvpages_attach(mm->pool.budget, &mm->member);
    if ((err = mm_warm_start(mm, cfg->warm_bytes)) != 0) {
        kvmm_free(mm);
        return err;
    }
    *out = mm;
    return 0;

out_radix:
    radix_destroy(&mm->radix);
out_pool:
    pool_destroy(&mm->pool);
out_free:
    free(mm->staging);
    free(mm->zeros);
    free(mm);
    return err;
}

void kvmm_free(struct kvmm *mm)
{
    if (!mm)
        return;
#ifdef KVD_LOCK_CHECKS
    /* The caller must not hold it; the kvmm's own threads (the warmer, the
     * tiers' writers) may, until they are stopped below. */
    if (atomic_load_explicit(&mm->holder, memory_order_relaxed) == mm_thread_self())
        mm_lock_violation(__func__, "while kvmm_lock is held");
#endif
    mm_warm_stop(mm); /* it takes the lock */
    /* Out of the budget first: another pool's reclaim may be inside. */
    kvpages_detach(mm->pool.budget, &mm->member);
    mm_remote_free(mm); /* its writer stops first: it takes the lock */
    mm_disk_free(mm);   /* the same */
#ifdef KVD_LOCK_CHECKS
    if (atomic_load_explicit(&mm->holder, memory_order_relaxed) != 0)
        mm_lock_violation(__func__, "with kvmm_lock held after its threads stopped");
#endif
    mm_exports_free(mm);
    seq_table_free(&mm->st);
    radix_destroy(&mm->radix);
    for (uint32_t i = 0; i < mm->tt.n; i++)
        if (tenant_live(&mm->tt, i))
            kvpages_tenant_unref(mm->pool.budget, mm->tt.v[i].bt);
    pool_destroy(&mm->pool);
    tenant_table_free(&mm->tt);
    pthread_mutex_destroy(&mm->lock);
    free(mm->staging);
    free(mm->zeros);
    free(mm);
}

#ifdef KVD_LOCK_CHECKS
_Thread_local char mm_thread_tag;

_Noreturn void mm_lock_violation(const char *fn, const char *what)
{
    fprintf(stderr, "kvd: lock rule broken: %s called %s (kvmm.h)\n", fn, what);
    fflush(stderr);
    abort();
}
#endif

bool kvmm_lock_checked(void)
{
#ifdef KVD_LOCK_CHECKS
    return true;
#else
    return false;
#endif
}

/* A prefetch worker that runs SCHED_IDLE runs at its nice value while it
 * holds (or waits for) the lock: the executor never waits for a thread that
 * gets no core (workpool_hold_begin). */
void kvmm_lock(struct kvmm *mm)
{
    workpool_hold_begin();
    pthread_mutex_lock(&mm->lock);
#ifdef KVD_LOCK_CHECKS
    atomic_store_explicit(&mm->holder, mm_thread_self(), memory_order_relaxed);
#endif
}

bool mm_trylock(struct kvmm *mm)
{
    workpool_hold_begin();
    if (pthread_mutex_trylock(&mm->lock) != 0) {
        workpool_hold_end();
        return false;
    }
#ifdef KVD_LOCK_CHECKS
    atomic_store_explicit(&mm->holder, mm_thread_self(), memory_order_relaxed);
#endif
    return true;
}

void kvmm_unlock(struct kvmm *mm)
{
#ifdef KVD_LOCK_CHECKS
    if (atomic_load_explicit(&mm->holder, memory_order_relaxed) != mm_thread_self())
        mm_lock_violation(__func__, "by a thread that does not hold kvmm_lock");
    atomic_store_explicit(&mm->holder, 0, memory_order_relaxed);
#endif
    pthread_mutex_unlock(&mm->lock);
    workpool_hold_end();
}

const char *kvmm_errmsg(const struct kvmm *mm)
{
    MM_ASSERT_LOCKED(mm);
    return mm->err;
}

const struct kv_geom *kvmm_geom(const struct kvmm *mm)
{
    return &mm->geom;
}

size_t kvmm_block_bytes(const struct kvmm *mm)
{
    return mm->block_bytes;
}

void *kvmm_device_arena(struct kvmm *mm)
{
    return mm->pool.arena[KVD_TIER_DEVICE];
}

void *kvmm_host_arena(struct kvmm *mm)
{
    return mm->pool.arena[KVD_TIER_HOST];
}

int kvmm_block_where(struct kvmm *mm, uint32_t id, enum kvd_tier *tier, uint32_t *slot)
{
    MM_ASSERT_LOCKED(mm);
    const struct pool_block *b;

    if (id >= mm->pool.n_ids || !(b = pool_block(&mm->pool, id))->used)
        return mm_fail(mm, KVD_ENOTFOUND, "block %u is not allocated", id);
    *tier = (enum kvd_tier)b->tier;
    *slot = b->slot;
    return 0;
}

/* ---- tenants and namespaces -------------------------------------------- */

int kvmm_namespace(struct kvmm *mm, const char *name, uint32_t *ns_id)
{
    MM_ASSERT_LOCKED(mm);
    uint32_t id;
    int err;

    if (!name || !name[0] || strlen(name) >= sizeof mm->tt.ns_names[0])
        return mm_fail(mm, KVD_EBADREQ, "a namespace name must be 1 to %zu bytes",
                       sizeof mm->tt.ns_names[0] - 1);
    id = tenant_ns_find(&mm->tt, name);
    if (id != UINT32_MAX) {
        *ns_id = id;
        return 0;
    }
    if (mm->tt.n_free_ns) { /* a removed namespace's (empty) tree is reused */
        err = tenant_ns_add(&mm->tt, name, &id, NULL);
        if (err)
            return mm_fail(mm, err, "out of memory creating namespace '%s'", name);
        *ns_id = id;
        return 0;
    }
    err = radix_ns_add(&mm->radix, &id);
    if (err)
        return mm_fail(mm, err, "out of memory creating namespace '%s'", name);
    err = tenant_ns_add(&mm->tt, name, &id, NULL);
    if (err) { /* keep the ids of both tables equal */
        free(mm->radix.roots[--mm->radix.n_roots]);
        return mm_fail(mm, err, "out of memory creating namespace '%s'", name);
    }
    *ns_id = id;
    return 0;
}

/* The floors of all tenants together must fit in the device pool, or a
 * floor could be promised twice. */
static int mm_floor_fits(struct kvmm *mm, const char *name, uint32_t floor)
{
    uint64_t sum = floor;

    for (uint32_t i = 0; i < mm->tt.n; i++)
        if (strcmp(mm->tt.v[i].conf.name, name) != 0)
            sum += mm->tt.v[i].conf.reserved_device_blocks;
    if (sum > mm->pool.n_slots[KVD_TIER_DEVICE])
        return mm_fail(mm, KVD_EBADREQ,
                       "tenant '%s': reserved floors would total %llu device blocks, the pool "
                       "has %u",
                       name, (unsigned long long)sum, mm->pool.n_slots[KVD_TIER_DEVICE]);
    return 0;
}

static struct kvpages_limits mm_limits(const struct kvmm_tenant_conf *c)
{
    return (struct kvpages_limits){.max_bytes = {c->max_device_bytes, c->max_host_bytes},
                                   .reserved_device_bytes = c->reserved_device_bytes};
}

/* kvmm_tenant_set (at == UINT32_MAX: the table picks the id) and
 * kvmm_tenant_set_at. */
static int tenant_set(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t at,
                      uint32_t *tenant_id)
{
    struct kvmm_tenant_conf c = *conf;
    struct kvpages_limits lim = mm_limits(conf);
    char nsname[80];
    uint32_t id, ns, bt;
    int err;

    c.name[sizeof c.name - 1] = '\0';
    if (!c.name[0])
        return mm_fail(mm, KVD_EBADREQ, "a tenant needs a name");
    if (c.weight == 0)
        c.weight = 1;
    if (c.reserved_device_blocks == KVMM_UNLIMITED)
        c.reserved_device_blocks = 0;
    if (mm_floor_fits(mm, c.name, c.reserved_device_blocks))
        return KVD_EBADREQ;
    id = tenant_find(&mm->tt, c.name);
    if (id != UINT32_MAX && (at == UINT32_MAX || at == id)) {
        if ((err = kvpages_tenant_set(mm->pool.budget, mm->tt.v[id].bt, &lim, mm->err,
                                      sizeof mm->err)))
            return err;
        mm->tt.v[id].conf = c;
        *tenant_id = id;
        return 0;
    }
    if (id != UINT32_MAX)
        return mm_fail(mm, KVD_EBUSY, "tenant '%s' has id %u here, not %u", c.name, id, at);
    uint32_t top = at == UINT32_MAX ? mm->tt.n : (at >= mm->tt.n ? at : mm->tt.n - 1);
    if (top + 1 >= KVMM_NO_TENANT - 1)
        return mm_fail(mm, KVD_ETOOLARGE, "too many tenants");
    if (at != UINT32_MAX && tenant_live(&mm->tt, at))
        return mm_fail(mm, KVD_EBUSY, "tenant id %u is '%s''s here, not '%s''s", at,
                       mm->tt.v[at].conf.name, c.name);
    if (kvpages_tenant_ref(mm->pool.budget, c.name, &bt))
        return mm_fail(mm, KVD_ENOMEM, "out of memory adding tenant '%s'", c.name);
    if ((err = kvpages_tenant_set(mm->pool.budget, bt, &lim, mm->err, sizeof mm->err))) {
        kvpages_tenant_unref(mm->pool.budget, bt);
        return err;
    }
    snprintf(nsname, sizeof nsname, "tenant:%s", c.name);
    err = radix_tenants_reserve(&mm->radix, top + 1);
    if (!err)
        err = kvmm_namespace(mm, nsname, &ns);
    if (!err && at == UINT32_MAX)
        err = tenant_add(&mm->tt, &c, &id);
    else if (!err)
        err = tenant_add_at(&mm->tt, &c, id = at);
    if (err) {
        kvpages_tenant_unref(mm->pool.budget, bt);
        return mm_fail(mm, err, "%s adding tenant '%s'",
                       err == KVD_EBUSY ? "id taken" : "out of memory", c.name);
    }
    mm->tt.v[id].ns = ns;
    mm->tt.v[id].bt = bt;
    *tenant_id = id;
    return 0;
}

int kvmm_tenant_set(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t *tenant_id)
{
    MM_ASSERT_LOCKED(mm);
    return tenant_set(mm, conf, UINT32_MAX, tenant_id);
}

int kvmm_tenant_set_at(struct kvmm *mm, const struct kvmm_tenant_conf *conf, uint32_t tenant_id)
{
    MM_ASSERT_LOCKED(mm);
    uint32_t id;
    if (tenant_id >= KVMM_NO_TENANT)
        return mm_fail(mm, KVD_EBADREQ, "tenant id %u out of range", tenant_id);
    return tenant_set(mm, conf, tenant_id, &id);
}

int kvmm_tenant_remove(struct kvmm *mm, uint32_t tenant)
{
    MM_ASSERT_LOCKED(mm);
    if (!tenant_live(&mm->tt, tenant))
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant %u", tenant);
    struct tenant *t = &mm->tt.v[tenant];
    if (t->seqs)
        return mm_fail(mm, KVD_EBUSY, "tenant '%s' has %u open sequences", t->conf.name, t->seqs);
    /* Its own namespace is its alone ("shared:" ones are the others): with
     * no sequence open, only the tree holds what is in it. */
    uint32_t ns = t->ns;
    if (ns < mm->tt.n_ns) {
        struct radix_node *root = radix_root(&mm->radix, ns);
        while (root->first_child)
            mm_drop_subtree(mm, root->first_child);
    }
    if (t->dev_blocks || t->host_blocks)
        return mm_fail(mm, KVD_EBUSY, "tenant '%s' still owns %u device and %u host blocks",
                       t->conf.name, t->dev_blocks, t->host_blocks);
    char name[sizeof t->conf.name];
    uint32_t bt = t->bt;
    memcpy(name, t->conf.name, sizeof name);
    if (ns < mm->tt.n_ns && tenant_ns_remove(&mm->tt, ns) != 0)
        return mm_fail(mm, KVD_ENOMEM, "out of memory removing tenant '%s'", name);
    if (tenant_remove(&mm->tt, tenant) != 0) {
        /* Take the namespace slot back: the tenant keeps it. */
        mm->tt.n_free_ns--;
        snprintf(mm->tt.ns_names[ns], sizeof mm->tt.ns_names[ns], "tenant:%s", name);
        return mm_fail(mm, KVD_ENOMEM, "out of memory removing tenant '%s'", name);
    }
    kvpages_tenant_unref(mm->pool.budget, bt);
    return 0;
}

int kvmm_tenant_find(struct kvmm *mm, const char *name, uint32_t *tenant_id)
{
    MM_ASSERT_LOCKED(mm);
    uint32_t id = name ? tenant_find(&mm->tt, name) : UINT32_MAX;

    if (id == UINT32_MAX)
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant named '%s'", name ? name : "(null)");
    *tenant_id = id;
    return 0;
}

uint32_t kvmm_tenant_weight(struct kvmm *mm, uint32_t tenant)
{
    MM_ASSERT_LOCKED(mm);
    if (!tenant_live(&mm->tt, tenant) || mm->tt.v[tenant].conf.weight == 0)
        return 1;
    return mm->tt.v[tenant].conf.weight;
}

void kvmm_tenant_name(struct kvmm *mm, uint32_t tenant, char out[64])
{
    MM_ASSERT_LOCKED(mm);
    out[0] = '\0';
    if (tenant_live(&mm->tt, tenant))
        snprintf(out, 64, "%s", mm->tt.v[tenant].conf.name);
}

int kvmm_tenant_namespace(struct kvmm *mm, uint32_t tenant, uint32_t *ns_id)
{
    MM_ASSERT_LOCKED(mm);
    if (!tenant_live(&mm->tt, tenant))
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant %u", tenant);
    *ns_id = mm->tt.v[tenant].ns;
    return 0;
}

/* ---- eviction and stats ------------------------------------------------- */

int kvmm_evict(struct kvmm *mm, enum kvd_tier tier, size_t n, size_t *evicted)
{
    MM_ASSERT_LOCKED(mm);
    size_t k = 0;

    if (tier != KVD_TIER_DEVICE && tier != KVD_TIER_HOST)
        return mm_fail(mm, KVD_EBADREQ, "unknown tier %d", (int)tier);
    for (; k < n; k++)
        if (tier == KVD_TIER_DEVICE ? !mm_evict_device_one(mm, KVMM_NO_TENANT)
                                    : !mm_drop_host_one(mm, KVMM_NO_TENANT))
            break;
    if (evicted)
        *evicted = k;
    return 0;
}

size_t kvmm_device_available(struct kvmm *mm, uint32_t tenant)
{
    MM_ASSERT_LOCKED(mm);
    const struct tenant *t;
    size_t room;

    if (!tenant_live(&mm->tt, tenant))
        return 0;
    t = &mm->tt.v[tenant];
    room = mm_device_headroom(mm, tenant);
    if (t->conf.max_device_blocks != KVMM_UNLIMITED) {
        uint64_t q =
            (uint64_t)t->conf.max_device_blocks + radix_cached(&mm->radix, tenant, KVD_TIER_DEVICE);
        q = q > t->dev_blocks ? q - t->dev_blocks : 0;
        if (q < room)
            room = (size_t)q;
    }
    /* The byte quota: its free slots, its cache here, and the pages it may
     * still take. */
    uint32_t left = kvpages_quota_left(mm->pool.budget, KVD_TIER_DEVICE, t->bt);
    if (left != UINT32_MAX) {
        const struct pool *p = &mm->pool;
        uint32_t o = mm_owner(mm, tenant, t->ns);
        uint64_t q = (uint64_t)left / p->budget_pages[KVD_TIER_DEVICE];
        for (uint32_t i = 0; i < p->n_owners; i++)
            if (p->owners[i].tenant == tenant)
                q += p->owners[i].n_fc_pages[KVD_TIER_DEVICE];
        q *= p->slots_per_page[KVD_TIER_DEVICE];
        if (o != POOL_NONE)
            q += p->owners[o].n_free[KVD_TIER_DEVICE] + p->owners[o].n_cached[KVD_TIER_DEVICE] -
                 p->owners[o].n_fc_blocks[KVD_TIER_DEVICE];
        if (q < room)
            room = (size_t)q;
    }
    return room;
}

void kvmm_stats(struct kvmm *mm, struct kvmm_stats *st)
{
    MM_ASSERT_LOCKED(mm);
    const struct pool *p = &mm->pool;

    *st = mm->ctr;
    st->device_cached = st->host_cached = 0;
    /* cached = held by the tree only; a scan, fine for a stats request. */
    for (uint32_t i = 0; i < p->n_ids; i++) {
        const struct pool_block *b = &p->blocks[i];
        if (b->used && b->node && b->refcount == 1) {
            if (b->tier == KVD_TIER_DEVICE)
                st->device_cached++;
            else
                st->host_cached++;
        }
    }
    /* total: what the pool may hold (its range, the budget); free: the
     * free slots of its pages and the whole pages it could still take
     * (other pools on the budget share those), the page the warm reserve
     * is writing among them (a spare again in a moment: without it free +
     * cached + used would fall short of total while it writes). */
    uint32_t used[POOL_TIERS] = {0, 0};
    for (uint32_t i = 0; i < p->n_ids; i++)
        if (p->blocks[i].used)
            used[p->blocks[i].tier]++;
    for (int t = 0; t < POOL_TIERS; t++) {
        uint64_t spp = p->slots_per_page[t], total = p->n_usable[t];
        bool warming = p->warming[t] != POOL_NONE && !(t == KVD_TIER_DEVICE && p->device_off);
        uint32_t pages_free = pool_pages_free(p, (enum kvd_tier)t) + warming;
        uint64_t fr = p->n_free_slots[t] + spp * pages_free;
        if (fr > total - used[t])
            fr = total > used[t] ? total - used[t] : 0;
        st->page_bytes[t] = p->page_bytes[t];
        st->blocks_per_page[t] = p->slots_per_page[t];
        st->pages_held[t] = p->n_mapped[t];
        st->pages_spare[t] = p->n_spare[t];
        st->pages_warm[t] = p->n_warm[t];
        st->warm_max[t] = p->warm_max[t];
        st->warm_hits[t] = p->warm_hits[t];
        st->warm_misses[t] = p->warm_misses[t];
        st->pages_free[t] = pages_free;
        st->pages_cached[t] = p->n_fc_pages[t];
        if (t == KVD_TIER_DEVICE) {
            /* detached (kvmm_device_detach): the pool takes no page */
            st->device_total = p->device_off ? 0 : (uint32_t)total;
            st->device_free = p->device_off ? 0 : (uint32_t)fr;
        } else {
            st->host_total = (uint32_t)total;
            st->host_free = (uint32_t)fr;
        }
    }
    st->page_maps = p->maps;
    st->page_unmaps = p->unmaps;
    /* used: blocks held by sequences (every used block but the cached
     * ones), counted, not derived from total - free - cached: with a page
     * budget shared by models' weights and other pools, some of total is
     * neither free nor used. */
    st->device_used = used[KVD_TIER_DEVICE] - st->device_cached;
    st->host_used = used[KVD_TIER_HOST] - st->host_cached;
    st->n_seqs = mm->st.n_open;
    st->n_tenants = mm->tt.n;
    st->exports = mm->n_exports;
    st->export_pages = p->n_pinned;
    st->export_draining = p->n_draining;
    st->export_withheld = p->n_withheld[KVD_TIER_DEVICE] + p->n_withheld[KVD_TIER_HOST];
}

int kvmm_tenant_stats(struct kvmm *mm, uint32_t tenant, struct kvmm_tenant_stats *st)
{
    MM_ASSERT_LOCKED(mm);
    const struct tenant *t;

    if (!tenant_live(&mm->tt, tenant))
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant %u", tenant);
    t = &mm->tt.v[tenant];
    memset(st, 0, sizeof *st);
    memcpy(st->name, t->conf.name, sizeof st->name);
    st->device_blocks = t->dev_blocks;
    st->host_blocks = t->host_blocks;
    st->seqs = t->seqs;
    st->conf = t->conf;
    st->match_tokens_asked = t->match_asked;
    st->match_tokens_hit = t->match_hit;
    st->swaps_out = t->swaps_out;
    st->swaps_in = t->swaps_in;
    st->evictions = t->evictions;
    for (uint32_t i = 0; i < mm->pool.n_owners; i++)
        if (mm->pool.owners[i].tenant == tenant) {
            st->device_pages += mm->pool.owners[i].n_pages[KVD_TIER_DEVICE];
            st->host_pages += mm->pool.owners[i].n_pages[KVD_TIER_HOST];
        }
    for (int k = 0; k < POOL_TIERS; k++) {
        uint64_t b = (uint64_t)kvpages_tenant_pages(mm->pool.budget, (enum kvd_tier)k, t->bt) *
                     kvpages_page_bytes(mm->pool.budget, (enum kvd_tier)k);
        if (k == KVD_TIER_DEVICE)
            st->device_bytes = b;
        else
            st->host_bytes = b;
    }
    for (uint32_t i = 0; i < mm->pool.n_ids; i++) {
        const struct pool_block *b = &mm->pool.blocks[i];
        if (b->used && b->node && b->tenant == tenant) {
            st->cached_blocks++;
            if (b->tier == KVD_TIER_DEVICE)
                st->cached_device++;
            else
                st->cached_host++;
        }
    }
    return 0;
}

/* ---- KV events ---------------------------------------------------------- */

const char *kvmm_medium_name(enum kvmm_medium m)
{
    static const char *const names[KVMM_N_MEDIA] = {"GPU", "CPU", "DISK", "REMOTE"};
    return (unsigned)m < KVMM_N_MEDIA ? names[m] : "GPU";
}

void mm_pub_set(struct kvmm *mm, struct radix_node *node)
{
    const struct radix_node *p = node->parent;
    uint64_t parent = p && p->parent ? mm->pool.blocks[p->block].pub : mm->pub_root;
    mm->pool.blocks[node->block].pub =
        blockkey_pub_next(parent, node->tokens, mm->geom.block_tokens);
}

void kvmm_events_emit(struct kvmm *mm, const struct kvmm_block_event *ev)
{
    MM_ASSERT_LOCKED(mm);
    if (!mm->events.block || mm->events_quiet || ev->tenant >= mm->tt.n)
        return;
    uint8_t mode = mm->tt.v[ev->tenant].conf.events;
    if (mode == KVMM_EVENTS_OFF)
        return;
    if (mode == KVMM_EVENTS_ON || !ev->tokens) {
        mm->events.block(mm->events.ctx, ev);
        return;
    }
    struct kvmm_block_event e = *ev;
    e.tokens = NULL;
    mm->events.block(mm->events.ctx, &e);
}

static void mm_ev(struct kvmm *mm, const struct radix_node *node, enum kvmm_medium medium,
                  bool stored)
{
    if (!mm->events.block || mm->events_quiet)
        return;
    const struct pool_block *b = &mm->pool.blocks[node->block];
    const struct radix_node *p = node->parent;
    struct kvmm_block_event ev = {.stored = stored,
                                  .medium = medium,
                                  .tenant = b->tenant,
                                  .hash = b->pub,
                                  .has_parent = p && p->parent,
                                  .parent = p && p->parent ? mm->pool.blocks[p->block].pub : 0,
                                  .tokens = stored ? node->tokens : NULL,
                                  .n_tokens = stored ? mm->geom.block_tokens : 0};
    kvmm_events_emit(mm, &ev);
}

void mm_ev_stored(struct kvmm *mm, const struct radix_node *node, enum kvmm_medium medium)
{
    mm_ev(mm, node, medium, true);
}

void mm_ev_removed(struct kvmm *mm, const struct radix_node *node, enum kvmm_medium medium)
{
    mm_ev(mm, node, medium, false);
}

void kvmm_events_attach(struct kvmm *mm, const struct kvmm_events_sink *sink, uint64_t root)
{
    MM_ASSERT_LOCKED(mm);
    mm->pub_root = root;
    if (!sink || !sink->block) {
        memset(&mm->events, 0, sizeof mm->events);
        return;
    }
    mm->events = *sink;
    /* Parents before children: a walk of each tree. */
    for (uint32_t ns = 0; ns < mm->radix.n_roots; ns++) {
        struct radix_node *root_n = mm->radix.roots[ns], *cur = root_n->first_child;
        while (cur) {
            mm_pub_set(mm, cur);
            if (cur->first_child) {
                cur = cur->first_child;
                continue;
            }
            while (cur != root_n && !cur->next_sibling)
                cur = cur->parent;
            cur = cur == root_n ? NULL : cur->next_sibling;
        }
    }
}

void kvmm_clear(struct kvmm *mm, size_t *dropped)
{
    MM_ASSERT_LOCKED(mm);
    size_t before = mm->radix.n_nodes;

    mm->events_quiet = true;
    for (uint32_t ns = 0; ns < mm->radix.n_roots; ns++) {
        struct radix_node *root = radix_root(&mm->radix, ns);
        while (root->first_child)
            mm_drop_subtree(mm, root->first_child);
    }
    mm->events_quiet = false;
    if (dropped)
        *dropped = before - mm->radix.n_nodes;
    mm_remote_cleared(mm);
    if (mm->events.cleared)
        mm->events.cleared(mm->events.ctx);
}

/* pool: logical blocks in owner-affine pages mapped from the page budget
 * (see pool.h). A page's free slots are a list through slot_next, most
 * recently freed first (the working set stays warm); an owner's usable
 * pages with free slots are a list through the pages, so allocation and
 * free are a few loads and stores, plus a map or unmap when a page is taken
 * or given back. Every change to a page goes through page_count(-1) /
 * mutation / page_count(+1), which keeps the owners' and the tier's counts
 * exact. */
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"
#include "pages.h"

static bool page_usable(const struct pool_page *g)
{
    return g->owner != POOL_NONE && !g->pins && !g->draining;
}

static bool page_fc(const struct pool_page *g)
{
    return g->n_used > 0 && g->n_cached == g->n_used;
}

/* Adds (sign 1) or removes (sign -1) page g's share of the counts. */
static void page_count(struct pool *p, int t, struct pool_page *g, int sign)
{
    if (g->owner == POOL_NONE)
        return;
    struct pool_owner *o = &p->owners[g->owner];
    if (!page_usable(g)) {
        p->n_withheld[t] += (uint32_t)(sign * (int64_t)g->n_free);
        return;
    }
    o->n_free[t] += (uint32_t)(sign * (int64_t)g->n_free);
    p->n_free_slots[t] += (uint32_t)(sign * (int64_t)g->n_free);
    o->n_cached[t] += (uint32_t)(sign * (int64_t)g->n_cached);
    if (page_fc(g)) {
        o->n_fc_pages[t] += (uint32_t)sign;
        o->n_fc_blocks[t] += (uint32_t)(sign * (int64_t)g->n_used);
        p->n_fc_pages[t] += (uint32_t)sign;
    }
}

static void page_unlist(struct pool *p, int t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];
    if (!g->listed)
        return;
    struct pool_owner *o = &p->owners[g->owner];
    if (g->prev != POOL_NONE)
        p->pages[t][g->prev].next = g->next;
    else
        o->partial[t] = g->next;
    if (g->next != POOL_NONE)
        p->pages[t][g->next].prev = g->prev;
    g->prev = g->next = POOL_NONE;
    g->listed = 0;
}

/* Listed exactly while usable with a free slot. */
static void page_relist(struct pool *p, int t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];
    bool want = page_usable(g) && g->n_free > 0;
    if (want == (bool)g->listed)
        return;
    if (!want) {
        page_unlist(p, t, pg);
        return;
    }
    struct pool_owner *o = &p->owners[g->owner];
    g->prev = POOL_NONE;
    g->next = o->partial[t];
    if (g->next != POOL_NONE)
        p->pages[t][g->next].prev = pg;
    o->partial[t] = pg;
    g->listed = 1;
}

/* ---- init ----------------------------------------------------------------- */

static uint64_t gcd64(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* The fewest whole blocks any page of k budget pages holds. */
static uint64_t min_blocks(uint64_t P, uint64_t B, uint64_t k, uint64_t pages)
{
    uint64_t Pp = k * P, least = UINT64_MAX;
    /* The pattern repeats every B / gcd(Pp, B) pages: look at one period. */
    uint64_t period = B / gcd64(Pp, B);
    for (uint64_t g = 0; g < period && g < pages; g++) {
        uint64_t first = (g * Pp + B - 1) / B, end = (g + 1) * Pp / B;
        uint64_t n = end > first ? end - first : 0;
        if (n < least)
            least = n;
    }
    return least == UINT64_MAX ? 0 : least;
}

static int tier_init(struct pool *p, int t, uint64_t max_bytes)
{
    struct backend *be = p->be;
    uint64_t P = kvpages_page_bytes(p->budget, (enum kvd_tier)t), B = p->block_bytes;
    uint32_t total = kvpages_total(p->budget, (enum kvd_tier)t);
    if (total == 0 || P == 0 || max_bytes == POOL_TIER_OFF)
        return 0; /* no slots on this tier */
    /* A pool page: the fewest k budget pages that hold within 1/32 of
     * the most blocks in all any k holds (blocks that would straddle two
     * pool pages are never used). Where blocks tile a page exactly
     * nothing is lost; k is tried up to eight past the fewest that hold a
     * block, and the exact tiling (lcm) when it is that short. */
    uint64_t k0 = (B + P - 1) / P, best_k = 0, best = 0, cap = total;
    if (max_bytes && max_bytes / P < cap)
        cap = max_bytes / P;
    uint64_t exact = B / gcd64(B, P);
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0 finds the most blocks; pass 1 takes the fewest pages
         * that hold within 1/32 of that: a smaller pool page is worth a
         * little waste where pools share the budget page by page */
        for (uint64_t k = k0; k <= k0 + 8 || k == exact; k = k < k0 + 8 ? k + 1 : exact) {
            if (k > cap)
                break;
            uint64_t n = cap / k * min_blocks(P, B, k, cap / k);
            if (pass == 0 && n > best) {
                best = n;
                best_k = k;
            }
            if (pass == 1 && n * 32 >= best * 31) {
                best_k = k;
                break;
            }
            if (k >= exact)
                break;
        }
    }
    if (!best_k)
        return KVD_EBADREQ;
    uint64_t k = best_k, pages = cap / k, Pp = k * P;
    uint64_t slots = pages * Pp / B;
    if (slots >= POOL_NONE || Pp > SIZE_MAX)
        return KVD_EBADREQ;
    size_t gran = be->ops->arena_granularity ? be->ops->arena_granularity(be, (enum kvd_tier)t) : 0;
    p->elastic[t] = be->ops->arena_reserve && be->ops->arena_map && gran && Pp % gran == 0;
    p->page_bytes[t] = (size_t)Pp;
    p->budget_pages[t] = (uint32_t)k;
    p->slots_per_page[t] = (uint32_t)min_blocks(P, B, k, pages);
    p->n_pages[t] = (uint32_t)pages;
    p->n_slots[t] = (uint32_t)slots;
    p->pages[t] = calloc(pages, sizeof(struct pool_page));
    p->slot_block[t] = malloc(sizeof(uint32_t) * slots);
    p->slot_next[t] = malloc(sizeof(uint32_t) * slots);
    p->free_pos[t] = malloc(sizeof(uint32_t) * pages);
    p->spare[t] = malloc(sizeof(uint32_t) * pages);
    if (!p->pages[t] || !p->slot_block[t] || !p->slot_next[t] || !p->free_pos[t] || !p->spare[t])
        return KVD_ENOMEM;
    /* Empty pages kept mapped: a pool with a budget of its own keeps them
     * all (nobody else wants them), one on a shared budget a few. */
    p->spare_max[t] = (uint32_t)(total / 64 > 8 ? 8 : total / 64 ? total / 64 : 1);
    for (uint32_t s = 0; s < slots; s++)
        p->slot_block[t][s] = p->slot_next[t][s] = POOL_NONE;
    /* Positions are taken lowest first. */
    for (uint32_t i = 0; i < pages; i++) {
        struct pool_page *g = &p->pages[t][i];
        g->owner = g->free_head = g->prev = g->next = POOL_NONE;
        p->free_pos[t][i] = (uint32_t)pages - 1 - i;
        p->n_usable[t] +=
            pool_page_end(p, (enum kvd_tier)t, i) - pool_page_first(p, (enum kvd_tier)t, i);
    }
    p->n_free_pos[t] = (uint32_t)pages;
    if (p->elastic[t])
        return be->ops->arena_reserve(be, (enum kvd_tier)t, p->page_bytes[t], pages, &p->arena[t]);
    return be->ops->arena_alloc(be, (enum kvd_tier)t, (size_t)pages * Pp, &p->arena[t]);
}

int pool_init_budget(struct pool *p, struct kvpages *budget, size_t block_bytes,
                     const uint64_t max_bytes[POOL_TIERS])
{
    int err;

    memset(p, 0, sizeof *p);
    p->warming[0] = p->warming[1] = POOL_NONE;
    if (!budget || block_bytes == 0)
        return KVD_EBADREQ;
    p->budget = budget;
    p->be = kvpages_backend(budget);
    p->block_bytes = block_bytes;
    for (int t = 0; t < POOL_TIERS; t++)
        if ((err = tier_init(p, t, max_bytes ? max_bytes[t] : 0)))
            goto out_err;
    if (p->n_slots[KVD_TIER_DEVICE] == 0) {
        err = KVD_EBADREQ;
        goto out_err;
    }
    if ((uint64_t)p->n_usable[0] + p->n_usable[1] >= POOL_NONE) {
        err = KVD_EBADREQ;
        goto out_err;
    }
    p->n_ids = p->n_usable[0] + p->n_usable[1];
    p->blocks = calloc(p->n_ids, sizeof *p->blocks);
    p->free_ids = malloc(sizeof(uint32_t) * p->n_ids);
    if (!p->blocks || !p->free_ids) {
        err = KVD_ENOMEM;
        goto out_err;
    }
    /* Filled high to low so id 0 comes out first. */
    for (uint32_t i = 0; i < p->n_ids; i++) {
        p->free_ids[i] = p->n_ids - 1 - i;
        p->blocks[i].slot = p->blocks[i].tenant = p->blocks[i].owner = POOL_NONE;
    }
    p->n_free_ids = p->n_ids;
    return 0;
out_err:
    pool_destroy(p);
    return err;
}

/* One block per page, or a few where a private pool is very large (every
 * mapped page is a mapping and a descriptor). */
#define POOL_PRIVATE_MAX_PAGES 32768u

int pool_init(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
              uint32_t n_host)
{
    struct kvpages *budget;
    uint32_t n_max = n_device > n_host ? n_device : n_host;
    uint64_t per = n_max > POOL_PRIVATE_MAX_PAGES
                       ? (n_max + POOL_PRIVATE_MAX_PAGES - 1) / POOL_PRIVATE_MAX_PAGES
                       : 1;
    struct kvpages_conf c = {.exact = {true, true}};

    memset(p, 0, sizeof *p);
    if (!be || block_bytes == 0 || n_device == 0 || (uint64_t)n_device + n_host >= POOL_NONE)
        return KVD_EBADREQ;
    c.page_bytes[KVD_TIER_DEVICE] = c.page_bytes[KVD_TIER_HOST] = per * block_bytes;
    c.bytes[KVD_TIER_DEVICE] = (n_device + per - 1) / per * per * block_bytes;
    c.bytes[KVD_TIER_HOST] = (n_host + per - 1) / per * per * block_bytes;
    int err = kvpages_new(be, &c, &budget, NULL);
    if (err)
        return err;
    err = pool_init_budget(p, budget, block_bytes, NULL);
    if (err) {
        kvpages_free(budget);
        return err;
    }
    p->own_budget = true;
    p->spare_max[0] = p->spare_max[1] = UINT32_MAX;
    return 0;
}

void pool_destroy(struct pool *p)
{
    for (int t = 0; t < POOL_TIERS; t++) {
        for (uint32_t i = 0; p->pages[t] && i < p->n_pages[t]; i++) {
            struct pool_page *g = &p->pages[t][i];
            if (g->owner != POOL_NONE || g->spare || g->warming)
                kvpages_give(p->budget, (enum kvd_tier)t,
                             g->owner == POOL_NONE ? KVPAGES_NONE : p->owners[g->owner].bt,
                             p->budget_pages[t]);
        }
        if (p->arena[t]) {
            if (p->elastic[t])
                p->be->ops->arena_release(p->be, p->arena[t]);
            else
                p->be->ops->arena_free(p->be, (enum kvd_tier)t, p->arena[t],
                                       (size_t)p->n_pages[t] * p->page_bytes[t]);
        }
        free(p->pages[t]);
        free(p->slot_block[t]);
        free(p->slot_next[t]);
        free(p->free_pos[t]);
        free(p->spare[t]);
    }
    if (p->own_budget)
        kvpages_free(p->budget);
    free(p->owners);
    free(p->blocks);
    free(p->free_ids);
    memset(p, 0, sizeof *p);
}

static void warm_kick(struct pool *p, int t);
static bool page_unmap(struct pool *p, int t, uint32_t pg, uint32_t bt);

int pool_device_release(struct pool *p)
{
    enum kvd_tier d = KVD_TIER_DEVICE;
    /* A page being warmed goes back when the warmer is done with it
     * (pool_warm_end): its memory is the warmer's until then. */
    uint32_t warming = p->warming[d] != POOL_NONE;
    if (p->device_off)
        return 0;
    if (p->n_mapped[d] != p->n_spare[d] + warming)
        return KVD_EBUSY;
    pool_release_spares(p, d, p->n_spare[d]);
    if (p->n_mapped[d] != warming)
        return KVD_EBUSY; /* the backend could not unmap a spare */
    p->device_off = true;
    return 0;
}

void pool_device_acquire(struct pool *p)
{
    p->device_off = false;
    warm_kick(p, KVD_TIER_DEVICE);
}

uint32_t pool_owner(struct pool *p, uint32_t tenant, uint32_t ns, uint32_t bt)
{
    for (uint32_t i = 0; i < p->n_owners; i++)
        if (p->owners[i].tenant == tenant && p->owners[i].ns == ns) {
            if (bt != KVPAGES_NONE)
                p->owners[i].bt = bt;
            return i;
        }
    if (p->n_owners == p->cap_owners) {
        uint32_t cap = p->cap_owners ? p->cap_owners * 2 : 8;
        struct pool_owner *o = realloc(p->owners, sizeof *o * cap);
        if (!o)
            return POOL_NONE;
        p->owners = o;
        p->cap_owners = cap;
    }
    struct pool_owner *o = &p->owners[p->n_owners];
    memset(o, 0, sizeof *o);
    o->tenant = tenant;
    o->ns = ns;
    o->bt = bt;
    o->partial[0] = o->partial[1] = POOL_NONE;
    return p->n_owners++;
}

/* ---- pages ---------------------------------------------------------------- */

uint32_t pool_pages_free(const struct pool *p, enum kvd_tier tier)
{
    if (!p->budget_pages[tier] || (tier == KVD_TIER_DEVICE && p->device_off))
        return 0;
    uint32_t n = kvpages_free_pages(p->budget, tier) / p->budget_pages[tier];
    return (n < p->n_free_pos[tier] ? n : p->n_free_pos[tier]) + p->n_spare[tier];
}

uint64_t pool_free_slots(const struct pool *p, enum kvd_tier tier)
{
    return p->n_free_slots[tier] + (uint64_t)p->slots_per_page[tier] * pool_pages_free(p, tier);
}

/* Position pg, mapped, becomes owner's empty page. */
static void page_init(struct pool *p, int t, uint32_t pg, uint32_t owner)
{
    struct pool_page *g = &p->pages[t][pg];
    uint32_t s0 = pool_page_first(p, t, pg), s1 = pool_page_end(p, t, pg);
    memset(g, 0, sizeof *g);
    g->owner = owner;
    g->prev = g->next = POOL_NONE;
    for (uint32_t s = s0; s < s1; s++)
        p->slot_next[t][s] = s + 1 < s1 ? s + 1 : POOL_NONE;
    g->free_head = s1 > s0 ? s0 : POOL_NONE;
    g->n_free = s1 - s0;
    p->owners[owner].n_pages[t]++;
    page_count(p, t, g, 1);
    page_relist(p, t, pg);
}

/* The index in tier t's spare stack of the topmost spare that is warm
 * (want) or cold (!want); POOL_NONE when none is. */
static uint32_t spare_find(const struct pool *p, int t, bool want)
{
    for (uint32_t k = p->n_spare[t]; k-- > 0;)
        if ((bool)p->pages[t][p->spare[t][k]].warm == want)
            return k;
    return POOL_NONE;
}

/* Takes entry k off tier t's spare stack (the top one moves into its place)
 * and returns its page. */
static uint32_t spare_remove(struct pool *p, int t, uint32_t k)
{
    uint32_t pg = p->spare[t][k];
    p->spare[t][k] = p->spare[t][--p->n_spare[t]];
    if (p->pages[t][pg].warm)
        p->n_warm[t]--;
    return pg;
}

static void warm_kick(struct pool *p, int t)
{
    if (p->warm_kick && p->n_warm[t] < p->warm_max[t])
        p->warm_kick(p->warm_ctx);
}

int pool_page_add(struct pool *p, enum kvd_tier t, uint32_t owner, bool quota)
{
    struct pool_owner *o = &p->owners[owner];
    int rc;
    if (t == KVD_TIER_DEVICE && p->device_off)
        return KVD_ENOMEM;
    if (p->n_spare[t]) {
        /* A page this pool kept mapped: the budget already counts it. A
         * warm one first (a restore's copy into it skips the first touch). */
        if ((rc = kvpages_claim(p->budget, t, o->bt, p->budget_pages[t], quota)))
            return rc;
        uint32_t k = spare_find(p, t, true);
        bool warm = k != POOL_NONE;
        uint32_t pg = spare_remove(p, t, warm ? k : p->n_spare[t] - 1);
        /* Still fresh if nobody prefaulted it while it was used before. */
        uint8_t fresh = p->pages[t][pg].fresh;
        page_init(p, t, pg, owner);
        p->pages[t][pg].fresh = fresh;
        if (p->warm_max[t]) {
            p->warm_hits[t] += warm;
            p->warm_misses[t] += !warm;
        }
        warm_kick(p, t);
        return 0;
    }
    if (p->n_free_pos[t] == 0)
        return KVD_ENOMEM;
    if ((rc = kvpages_take(p->budget, t, o->bt, p->budget_pages[t], quota)))
        return rc;
    uint32_t pg = p->free_pos[t][--p->n_free_pos[t]];
    if (p->elastic[t] && (rc = p->be->ops->arena_map(p->be, p->arena[t], pg)) != 0) {
        p->free_pos[t][p->n_free_pos[t]++] = pg;
        kvpages_give(p->budget, t, o->bt, p->budget_pages[t]);
        return KVD_ENOMEM;
    }
    p->n_mapped[t]++;
    p->maps++;
    page_init(p, t, pg, owner);
    p->pages[t][pg].fresh = p->elastic[t];
    if (p->warm_max[t])
        p->warm_misses[t]++;
    warm_kick(p, t);
    return 0;
}

void pool_set_warm(struct pool *p, enum kvd_tier t, uint32_t pages)
{
    /* At most a 16th of the tier's page positions: a small pool keeps its
     * pages for blocks (under 16 pages, no reserve). */
    if (pages > p->n_pages[t] / 16)
        pages = p->n_pages[t] / 16;
    p->warm_max[t] = p->n_slots[t] && p->elastic[t] ? pages : 0;
    if (p->n_warm[t] <= p->warm_max[t])
        return;
    /* Fewer warm spares allowed: the oldest lose the mark (they stay
     * spares, up to spare_max, as any other). */
    for (uint32_t k = 0; k < p->n_spare[t] && p->n_warm[t] > p->warm_max[t]; k++) {
        struct pool_page *g = &p->pages[t][p->spare[t][k]];
        if (g->warm) {
            g->warm = 0;
            p->n_warm[t]--;
        }
    }
    /* ...and spares beyond the new bound go back to the budget */
    while (p->n_spare[t] + (p->warming[t] != POOL_NONE) >
           (uint64_t)p->spare_max[t] + p->warm_max[t])
        if (!pool_release_spares(p, t, 1))
            break;
}

uint32_t pool_warm_begin(struct pool *p, enum kvd_tier t, void **start, size_t *bytes)
{
    if (!p->warm_max[t] || p->warming[t] != POOL_NONE || p->n_warm[t] >= p->warm_max[t] ||
        (t == KVD_TIER_DEVICE && p->device_off))
        return POOL_NONE;
    /* Only while the pool could take more pages than the bound besides
     * the one warmed: near exhaustion a page in the warmer's hands would be
     * one an allocation needs (it would evict, or fail, instead). */
    if (pool_pages_free(p, t) <= p->warm_max[t])
        return POOL_NONE;
    uint32_t pg, k = spare_find(p, t, false);
    if (k != POOL_NONE) {
        pg = spare_remove(p, t, k); /* a cold spare: mapped, counted, nobody's */
        p->pages[t][pg].spare = 0;
    } else {
        /* A free page of the budget, mapped for nobody, as a spare is;
         * only while the budget has more free pages than the reserve's
         * bound: near exhaustion the page in the warmer's hands would be
         * one an allocation needs. */
        if (p->n_free_pos[t] == 0 ||
            kvpages_free_pages(p->budget, t) / p->budget_pages[t] <= p->warm_max[t] ||
            kvpages_take(p->budget, t, KVPAGES_NONE, p->budget_pages[t], false) != 0)
            return POOL_NONE;
        pg = p->free_pos[t][--p->n_free_pos[t]];
        if (p->be->ops->arena_map(p->be, p->arena[t], pg) != 0) {
            p->free_pos[t][p->n_free_pos[t]++] = pg;
            kvpages_give(p->budget, t, KVPAGES_NONE, p->budget_pages[t]);
            return POOL_NONE;
        }
        p->n_mapped[t]++;
        p->maps++;
        p->pages[t][pg].fresh = 1;
    }
    p->pages[t][pg].warming = 1;
    p->warming[t] = pg;
    *start = (char *)p->arena[t] + (size_t)pg * p->page_bytes[t];
    *bytes = p->page_bytes[t];
    return pg;
}

void pool_warm_end(struct pool *p, enum kvd_tier t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];
    p->warming[t] = POOL_NONE;
    g->warming = 0;
    if (t == KVD_TIER_DEVICE && p->device_off && page_unmap(p, t, pg, KVPAGES_NONE))
        return; /* released meanwhile (pool_device_release) */
    g->fresh = 0;
    g->warm = 1;
    g->spare = 1;
    p->n_warm[t]++;
    p->spare[t][p->n_spare[t]++] = pg;
    /* The bound was lowered meanwhile: the mark goes, the spare follows
     * the rule for spares. */
    if (p->n_warm[t] > p->warm_max[t])
        pool_set_warm(p, t, p->warm_max[t]);
}

bool pool_take_fresh(struct pool *p, enum kvd_tier tier, uint32_t slot, void **start, size_t *bytes)
{
    uint32_t pg = pool_page_of(p, tier, slot);
    struct pool_page *g = &p->pages[tier][pg];
    if (!g->fresh)
        return false;
    g->fresh = 0;
    *start = (char *)p->arena[tier] + (size_t)pg * p->page_bytes[tier];
    *bytes = p->page_bytes[tier];
    return true;
}

/* Spare page pg (or, from page_put, an empty one) loses its memory and
 * goes back to the budget. false when the backend could not unmap it. */
static bool page_unmap(struct pool *p, int t, uint32_t pg, uint32_t bt)
{
    if (p->elastic[t] && p->be->ops->arena_unmap(p->be, p->arena[t], pg) != 0)
        return false;
    kvpages_give(p->budget, (enum kvd_tier)t, bt, p->budget_pages[t]);
    p->n_mapped[t]--;
    p->unmaps++;
    p->free_pos[t][p->n_free_pos[t]++] = pg;
    return true;
}

/* Page pg holds nothing and is exported by no one: it stays mapped as a
 * spare of this pool (up to spare_max, and never one that was exported:
 * its next use must get fresh memory), or goes back to the budget. */
static void page_put(struct pool *p, int t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];
    struct pool_owner *o = &p->owners[g->owner];
    /* Spares up to spare_max, and as many more as the warm reserve may
     * hold: the warmer finishes writing such a page rather than map a new
     * one (a page given back loses its memory; a new one costs its first
     * touch again). */
    uint32_t warming = p->warming[t] != POOL_NONE; /* a spare again when warm */
    bool keep =
        !g->exported && p->n_spare[t] + warming < (uint64_t)p->spare_max[t] + p->warm_max[t];
    if (!keep && !page_unmap(p, t, pg, o->bt))
        return; /* stays mapped, its owner's empty page: retried when it empties again */
    page_count(p, t, g, -1);
    page_unlist(p, t, pg);
    if (g->draining)
        p->n_draining--;
    if (keep)
        kvpages_unclaim(p->budget, (enum kvd_tier)t, o->bt, p->budget_pages[t]);
    o->n_pages[t]--;
    for (uint32_t s = pool_page_first(p, t, pg); s < pool_page_end(p, t, pg); s++)
        p->slot_next[t][s] = POOL_NONE;
    uint8_t fresh = g->fresh;
    memset(g, 0, sizeof *g);
    g->owner = g->free_head = g->prev = g->next = POOL_NONE;
    if (keep) {
        g->spare = 1;
        g->fresh = fresh; /* a spare keeps its memory: as prefaulted as it was */
        p->spare[t][p->n_spare[t]++] = pg;
        warm_kick(p, t);
    }
}

uint32_t pool_release_spares(struct pool *p, enum kvd_tier t, uint32_t n)
{
    uint32_t done = 0;
    /* Cold spares first: the warm ones cost idle CPU to make. */
    while (done < n && p->n_spare[t]) {
        uint32_t k = spare_find(p, t, false);
        if (k == POOL_NONE)
            k = p->n_spare[t] - 1;
        uint32_t pg = p->spare[t][k];
        if (!page_unmap(p, t, pg, KVPAGES_NONE))
            break;
        (void)spare_remove(p, t, k);
        p->pages[t][pg].spare = 0;
        p->pages[t][pg].warm = 0;
        done++;
    }
    return done;
}

void pool_trim(struct pool *p)
{
    for (int t = 0; t < POOL_TIERS; t++)
        for (uint32_t i = 0; p->pages[t] && i < p->n_pages[t]; i++) {
            struct pool_page *g = &p->pages[t][i];
            if (g->owner != POOL_NONE && g->n_used == 0 && !g->pins)
                page_put(p, t, i);
        }
}

/* The slot became free: onto its page's list; an emptied page that no
 * export holds goes back to the budget. */
static void slot_free(struct pool *p, int t, uint32_t slot)
{
    uint32_t pg = pool_page_of(p, (enum kvd_tier)t, slot);
    struct pool_page *g = &p->pages[t][pg];
    page_count(p, t, g, -1);
    p->slot_next[t][slot] = g->free_head;
    g->free_head = slot;
    g->n_free++;
    g->n_used--;
    page_count(p, t, g, 1);
    if (g->n_used == 0 && !g->pins)
        page_put(p, t, pg);
    else
        page_relist(p, t, pg);
}

uint32_t pool_slot_take(struct pool *p, enum kvd_tier t, uint32_t owner)
{
    if (owner >= p->n_owners || !p->pages[t])
        return POOL_NONE;
    uint32_t pg = p->owners[owner].partial[t];
    if (pg == POOL_NONE) {
        if (pool_page_add(p, t, owner, false) != 0)
            return POOL_NONE;
        pg = p->owners[owner].partial[t];
    }
    struct pool_page *g = &p->pages[t][pg];
    page_count(p, t, g, -1);
    uint32_t slot = g->free_head;
    g->free_head = p->slot_next[t][slot];
    p->slot_next[t][slot] = POOL_NONE;
    g->n_free--;
    g->n_used++;
    page_count(p, t, g, 1);
    page_relist(p, t, pg);
    return slot;
}

void pool_slot_give(struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    slot_free(p, tier, slot);
}

int pool_alloc(struct pool *p, enum kvd_tier tier, uint32_t tenant, uint32_t *id)
{
    uint32_t owner = pool_owner(p, tenant, 0, KVPAGES_NONE);
    return owner == POOL_NONE ? KVD_ENOMEM : pool_alloc_in(p, tier, owner, id);
}

int pool_alloc_in(struct pool *p, enum kvd_tier tier, uint32_t owner, uint32_t *id)
{
    if (p->n_free_ids == 0)
        return KVD_ENOMEM;
    uint32_t slot = pool_slot_take(p, tier, owner);
    if (slot == POOL_NONE)
        return KVD_ENOMEM;
    uint32_t i = p->free_ids[--p->n_free_ids];
    struct pool_block *b = &p->blocks[i];
    memset(b, 0, sizeof *b);
    b->refcount = 1;
    b->tenant = p->owners[owner].tenant;
    b->owner = owner;
    b->slot = slot;
    b->tier = (uint8_t)tier;
    b->used = 1;
    p->slot_block[tier][slot] = i;
    *id = i;
    return 0;
}

void pool_set_cached(struct pool *p, uint32_t id, bool cached)
{
    struct pool_block *b = &p->blocks[id];
    if ((bool)b->cached == cached)
        return;
    struct pool_page *g = &p->pages[b->tier][pool_page_of(p, (enum kvd_tier)b->tier, b->slot)];
    page_count(p, b->tier, g, -1);
    g->n_cached += cached ? 1 : (uint32_t)-1;
    b->cached = cached;
    page_count(p, b->tier, g, 1);
}

bool pool_unref(struct pool *p, uint32_t id)
{
    struct pool_block *b = &p->blocks[id];

    if (--b->refcount > 0)
        return false;
    pool_set_cached(p, id, false);
    p->slot_block[b->tier][b->slot] = POOL_NONE;
    slot_free(p, b->tier, b->slot);
    p->free_ids[p->n_free_ids++] = id;
    b->used = 0;
    b->slot = b->tenant = b->owner = POOL_NONE;
    b->node = NULL;
    return true;
}

void pool_retier(struct pool *p, uint32_t id, enum kvd_tier tier, uint32_t slot)
{
    struct pool_block *b = &p->blocks[id];
    bool cached = b->cached;

    pool_set_cached(p, id, false);
    p->slot_block[b->tier][b->slot] = POOL_NONE;
    slot_free(p, b->tier, b->slot);
    b->tier = (uint8_t)tier;
    b->slot = slot;
    p->slot_block[tier][slot] = id;
    pool_set_cached(p, id, cached);
}

/* ---- exports -------------------------------------------------------------- */

void pool_pin(struct pool *p, enum kvd_tier t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];

    page_count(p, t, g, -1);
    g->exported = 1; /* its memory is someone else's too now: never a spare */
    if (g->pins++ == 0) {
        p->n_pinned++;
        if (g->draining) {
            g->draining = 0;
            p->n_draining--;
        }
    }
    page_count(p, t, g, 1);
    page_relist(p, t, pg);
    /* What the owner's freed blocks left in the free slots is no
     * exporter's (another tenant may export a shared page). */
    for (uint32_t s = g->free_head; s != POOL_NONE; s = p->slot_next[t][s]) {
        void *at = pool_slot_ptr(p, t, s);
        if (p->be->ops->zero)
            (void)p->be->ops->zero(p->be, at, t, p->block_bytes);
        else
            memset(at, 0, p->block_bytes);
    }
}

void pool_unpin(struct pool *p, enum kvd_tier t, uint32_t pg)
{
    struct pool_page *g = &p->pages[t][pg];

    if (g->pins == 0)
        return;
    page_count(p, t, g, -1);
    if (--g->pins == 0) {
        p->n_pinned--;
        g->draining = 1;
        p->n_draining++;
    }
    page_count(p, t, g, 1);
    if (!g->pins && g->n_used == 0)
        page_put(p, t, pg);
}

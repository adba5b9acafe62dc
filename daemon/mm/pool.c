/* pool: logical blocks over two slot arenas (see pool.h). Free ids and free
 * slots are stacks, so alloc and free are a few loads and stores; the most
 * recently freed slot is reused first, which keeps the working set warm. */
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

/* Tier t's arena (and its pages when the backend exports them). */
static int arena_get(struct pool *p, int t)
{
    uint32_t n = p->n_slots[t];
    if (p->be->ops->arena_alloc_paged) {
        size_t upp = 0;
        int err = p->be->ops->arena_alloc_paged(p->be, (enum kvd_tier)t, p->block_bytes, n, &upp,
                                                &p->arena[t]);
        if (err)
            return err;
        if (upp == 0 || upp > UINT32_MAX)
            return KVD_EBADREQ;
        p->slots_per_page[t] = (uint32_t)upp;
        p->n_pages[t] = (uint32_t)((n + upp - 1) / upp);
        free(p->pages[t]);
        p->pages[t] = calloc(p->n_pages[t], sizeof(struct pool_page));
        return p->pages[t] ? 0 : KVD_ENOMEM;
    }
    return p->be->ops->arena_alloc(p->be, (enum kvd_tier)t, (size_t)n * p->block_bytes,
                                   &p->arena[t]);
}

static void arena_put(struct pool *p, int t)
{
    if (p->arena[t])
        p->be->ops->arena_free(p->be, (enum kvd_tier)t, p->arena[t],
                               (size_t)p->n_slots[t] * p->block_bytes);
    p->arena[t] = NULL;
    free(p->pages[t]);
    p->pages[t] = NULL;
    p->n_pages[t] = 0;
}

int pool_init(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
              uint32_t n_host)
{
    return pool_init_off(p, be, block_bytes, n_device, n_host, false);
}

int pool_init_off(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
                  uint32_t n_host, bool device_off)
{
    int err;

    memset(p, 0, sizeof *p);
    if (block_bytes == 0 || n_device == 0 || (uint64_t)n_device + n_host >= POOL_NONE)
        return KVD_EBADREQ;
    p->be = be;
    p->block_bytes = block_bytes;
    p->n_slots[KVD_TIER_DEVICE] = n_device;
    p->n_slots[KVD_TIER_HOST] = n_host;
    p->n_ids = n_device + n_host;
    p->blocks = calloc(p->n_ids, sizeof *p->blocks);
    p->free_ids = malloc(sizeof(uint32_t) * p->n_ids);
    if (!p->blocks || !p->free_ids)
        goto out_nomem;
    /* Stacks are filled high to low so id 0 and slot 0 come out first. */
    for (uint32_t i = 0; i < p->n_ids; i++) {
        p->free_ids[i] = p->n_ids - 1 - i;
        p->blocks[i].slot = POOL_NONE;
        p->blocks[i].tenant = POOL_NONE;
    }
    p->n_free_ids = p->n_ids;
    for (int t = 0; t < POOL_TIERS; t++) {
        uint32_t n = p->n_slots[t];
        if (n == 0)
            continue;
        if ((uint64_t)n * block_bytes / n != block_bytes)
            goto out_badreq;
        p->free_slots[t] = malloc(sizeof(uint32_t) * n);
        p->slot_block[t] = malloc(sizeof(uint32_t) * n);
        if (!p->free_slots[t] || !p->slot_block[t])
            goto out_nomem;
        for (uint32_t i = 0; i < n; i++) {
            p->free_slots[t][i] = n - 1 - i;
            p->slot_block[t][i] = POOL_NONE;
        }
        p->n_free_slots[t] = n;
        if (t == KVD_TIER_DEVICE && device_off) {
            p->n_free_slots[t] = 0;
            p->device_off = true;
            continue;
        }
        if ((err = arena_get(p, t)) != 0)
            goto out_err;
    }
    return 0;

out_badreq:
    err = KVD_EBADREQ;
    goto out_err;
out_nomem:
    err = KVD_ENOMEM;
out_err:
    pool_destroy(p);
    return err;
}

void pool_destroy(struct pool *p)
{
    for (int t = 0; t < POOL_TIERS; t++) {
        arena_put(p, t);
        free(p->free_slots[t]);
        free(p->slot_block[t]);
    }
    free(p->blocks);
    free(p->free_ids);
    memset(p, 0, sizeof *p);
}

int pool_device_release(struct pool *p)
{
    enum kvd_tier d = KVD_TIER_DEVICE;
    if (p->device_off)
        return 0;
    if (p->n_free_slots[d] != p->n_slots[d] || p->n_pinned || p->n_draining)
        return KVD_EBUSY;
    arena_put(p, d);
    p->slots_per_page[d] = 0;
    p->n_free_slots[d] = 0;
    p->device_off = true;
    return 0;
}

int pool_device_acquire(struct pool *p)
{
    enum kvd_tier d = KVD_TIER_DEVICE;
    if (!p->device_off)
        return 0;
    int err = arena_get(p, d);
    if (err) {
        arena_put(p, d);
        return err;
    }
    /* The stack holds every slot (release found them all free). */
    p->n_free_slots[d] = p->n_slots[d];
    p->device_off = false;
    return 0;
}

/* A page's slots go back to the free stack, its memory renewed first:
 * whoever still maps the old memory (an exporter that released it, or a
 * process it passed the descriptor to) never sees what comes next. */
static void page_recycle(struct pool *p, enum kvd_tier tier, uint32_t pg)
{
    struct pool_page *g = &p->pages[tier][pg];
    uint32_t spp = p->slots_per_page[tier], s0 = pg * spp;
    uint32_t s1 = s0 + spp < p->n_slots[tier] ? s0 + spp : p->n_slots[tier];

    if (p->be->ops->arena_page_renew(p->be, p->arena[tier], pg) != 0)
        return; /* out of memory or descriptors: stays withheld, retried at the next free */
    for (uint32_t s = s0; s < s1; s++)
        if (p->slot_block[tier][s] == POOL_NONE && g->withheld) {
            p->free_slots[tier][p->n_free_slots[tier]++] = s;
            g->withheld--;
            p->n_withheld[tier]--;
        }
    g->draining = 0;
    p->n_draining--;
}

/* The slot became free: onto the stack, or withheld in an exported page. */
static void slot_free(struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    if (p->pages[tier]) {
        struct pool_page *g = &p->pages[tier][pool_page_of(p, tier, slot)];
        g->n_used--;
        if (g->pins || g->draining) {
            g->withheld++;
            p->n_withheld[tier]++;
            if (!g->pins && g->n_used == 0)
                page_recycle(p, tier, pool_page_of(p, tier, slot));
            return;
        }
    }
    p->free_slots[tier][p->n_free_slots[tier]++] = slot;
}

static uint32_t slot_pop(struct pool *p, enum kvd_tier tier)
{
    uint32_t slot = p->free_slots[tier][--p->n_free_slots[tier]];
    if (p->pages[tier])
        p->pages[tier][pool_page_of(p, tier, slot)].n_used++;
    return slot;
}

uint32_t pool_slot_take(struct pool *p, enum kvd_tier tier)
{
    if (p->n_free_slots[tier] == 0)
        return POOL_NONE;
    return slot_pop(p, tier);
}

void pool_slot_give(struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    slot_free(p, tier, slot);
}

void pool_pin(struct pool *p, enum kvd_tier tier, uint32_t pg)
{
    struct pool_page *g = &p->pages[tier][pg];
    uint32_t spp = p->slots_per_page[tier], s0 = pg * spp;
    uint32_t s1 = s0 + spp < p->n_slots[tier] ? s0 + spp : p->n_slots[tier];

    if (g->pins++ == 0) {
        p->n_pinned++;
        if (!g->draining) {
            /* Take the page's free slots off the stack (one pass over it). */
            uint32_t k = 0;
            for (uint32_t i = 0; i < p->n_free_slots[tier]; i++) {
                uint32_t s = p->free_slots[tier][i];
                if (s >= s0 && s < s1) {
                    g->withheld++;
                    p->n_withheld[tier]++;
                } else {
                    p->free_slots[tier][k++] = s;
                }
            }
            p->n_free_slots[tier] = k;
        } else {
            g->draining = 0;
            p->n_draining--;
        }
    }
    /* What freed blocks left in the page's free slots is no exporter's. */
    for (uint32_t s = s0; s < s1; s++)
        if (p->slot_block[tier][s] == POOL_NONE)
            memset(pool_slot_ptr(p, tier, s), 0, p->block_bytes);
}

void pool_unpin(struct pool *p, enum kvd_tier tier, uint32_t pg)
{
    struct pool_page *g = &p->pages[tier][pg];

    if (g->pins == 0 || --g->pins > 0)
        return;
    p->n_pinned--;
    g->draining = 1;
    p->n_draining++;
    if (g->n_used == 0)
        page_recycle(p, tier, pg);
}

int pool_alloc(struct pool *p, enum kvd_tier tier, uint32_t tenant, uint32_t *id)
{
    uint32_t slot, i;
    struct pool_block *b;

    if (p->n_free_slots[tier] == 0 || p->n_free_ids == 0)
        return KVD_ENOMEM;
    slot = slot_pop(p, tier);
    i = p->free_ids[--p->n_free_ids];
    b = &p->blocks[i];
    b->refcount = 1;
    b->tenant = tenant;
    b->slot = slot;
    b->tier = (uint8_t)tier;
    b->used = 1;
    b->lru = 0;
    b->hits = 0;
    b->checksum = 0;
    b->node = NULL;
    b->disk = POOL_DISK_NONE;
    b->remote = 0;
    b->restoring = 0;
    b->key = (struct blockkey){0, 0};
    p->slot_block[tier][slot] = i;
    *id = i;
    return 0;
}

bool pool_unref(struct pool *p, uint32_t id)
{
    struct pool_block *b = &p->blocks[id];

    if (--b->refcount > 0)
        return false;
    p->slot_block[b->tier][b->slot] = POOL_NONE;
    slot_free(p, (enum kvd_tier)b->tier, b->slot);
    p->free_ids[p->n_free_ids++] = id;
    b->used = 0;
    b->slot = POOL_NONE;
    b->tenant = POOL_NONE;
    b->node = NULL;
    return true;
}

void pool_retier(struct pool *p, uint32_t id, enum kvd_tier tier, uint32_t slot)
{
    struct pool_block *b = &p->blocks[id];

    p->slot_block[b->tier][b->slot] = POOL_NONE;
    pool_slot_give(p, (enum kvd_tier)b->tier, b->slot);
    b->tier = (uint8_t)tier;
    b->slot = slot;
    p->slot_block[tier][slot] = id;
}

int pool_check(const struct pool *p, char *msg, size_t msglen)
{
    uint32_t used = 0, used_slots[POOL_TIERS] = {0, 0};
    int rc = KVD_EINTERNAL;
    uint8_t *seen = calloc(p->n_ids + 1, 1);

    if (!seen) {
        snprintf(msg, msglen, "pool check: out of memory");
        return KVD_ENOMEM;
    }
    for (uint32_t k = 0; k < p->n_free_ids; k++) {
        uint32_t i = p->free_ids[k];
        if (i >= p->n_ids || seen[i] || p->blocks[i].used) {
            snprintf(msg, msglen, "pool: free id %u is out of range, listed twice or in use", i);
            goto out;
        }
        seen[i] = 1;
    }
    for (uint32_t i = 0; i < p->n_ids; i++) {
        const struct pool_block *b = &p->blocks[i];
        if (!b->used)
            continue;
        used++;
        if (b->refcount == 0 || b->tier >= POOL_TIERS || b->slot >= p->n_slots[b->tier] ||
            p->slot_block[b->tier][b->slot] != i) {
            snprintf(msg, msglen,
                     "pool: block %u (ref %u tier %u slot %u) disagrees with the slot map", i,
                     b->refcount, b->tier, b->slot);
            goto out;
        }
        used_slots[b->tier]++;
    }
    if (used + p->n_free_ids != p->n_ids) {
        snprintf(msg, msglen, "pool: %u used + %u free ids != %u total", used, p->n_free_ids,
                 p->n_ids);
        goto out;
    }
    for (int t = 0; t < POOL_TIERS; t++) {
        uint32_t n = p->n_slots[t];
        if (t == KVD_TIER_DEVICE && p->device_off) {
            if (used_slots[t] || p->n_free_slots[t] || p->arena[t]) {
                snprintf(msg, msglen,
                         "pool: the device arena is given back, yet %u blocks and %u free slots "
                         "are on it",
                         used_slots[t], p->n_free_slots[t]);
                goto out;
            }
            continue;
        }
        uint8_t *sseen = calloc(n + 1, 1);
        if (!sseen) {
            rc = KVD_ENOMEM;
            goto out;
        }
        for (uint32_t k = 0; k < p->n_free_slots[t]; k++) {
            uint32_t s = p->free_slots[t][k];
            if (s >= n || sseen[s] || p->slot_block[t][s] != POOL_NONE) {
                snprintf(msg, msglen, "pool: tier %d free slot %u is out of range, twice or used",
                         t, s);
                free(sseen);
                goto out;
            }
            sseen[s] = 1;
        }
        free(sseen);
        if (used_slots[t] + p->n_free_slots[t] + p->n_withheld[t] != n) {
            snprintf(msg, msglen,
                     "pool: tier %d: %u used + %u free + %u withheld slots != %u total", t,
                     used_slots[t], p->n_free_slots[t], p->n_withheld[t], n);
            goto out;
        }
        uint32_t withheld = 0;
        for (uint32_t g = 0; p->pages[t] && g < p->n_pages[t]; g++) {
            const struct pool_page *pg = &p->pages[t][g];
            uint32_t s0 = g * p->slots_per_page[t], used_here = 0;
            uint32_t s1 = s0 + p->slots_per_page[t] < n ? s0 + p->slots_per_page[t] : n;
            for (uint32_t s = s0; s < s1; s++)
                used_here += p->slot_block[t][s] != POOL_NONE;
            withheld += pg->withheld;
            if (used_here != pg->n_used || (pg->withheld && !pg->pins && !pg->draining)) {
                snprintf(msg, msglen,
                         "pool: tier %d page %u: %u blocks, counted %u (withheld %u, pins %u)", t,
                         g, used_here, pg->n_used, pg->withheld, pg->pins);
                goto out;
            }
        }
        if (withheld != p->n_withheld[t]) {
            snprintf(msg, msglen, "pool: tier %d: pages withhold %u slots, counted %u", t, withheld,
                     p->n_withheld[t]);
            goto out;
        }
    }
    rc = 0;
out:
    free(seen);
    return rc;
}

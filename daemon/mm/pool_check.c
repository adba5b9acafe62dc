/* pool_check: the block pool's invariant checker (pool.h pool_check): ids,
 * slot maps, every page's lists and counts, the owners' and the tiers'
 * counts, spares and the warm reserve, recounted from scratch. */
#include <stdio.h>
#include <stdlib.h>

#include "kvd/status.h"
#include "pool.h"

/* ---- check ---------------------------------------------------------------- */

#define CHECK_FAIL(...)                                                                            \
    do {                                                                                           \
        snprintf(msg, msglen, __VA_ARGS__);                                                        \
        goto out;                                                                                  \
    } while (0)

static int check_tier(const struct pool *p, int t, struct pool_owner *recount, char *msg,
                      size_t msglen)
{
    uint32_t n = p->n_slots[t], mapped = 0, free_all = 0, withheld = 0, fc = 0;
    int rc = KVD_EINTERNAL;
    uint8_t *seen = calloc((size_t)n + p->n_pages[t] + 1, 1);
    if (!seen) {
        snprintf(msg, msglen, "pool check: out of memory");
        return KVD_ENOMEM;
    }
    for (uint32_t pg = 0; pg < p->n_pages[t]; pg++) {
        const struct pool_page *g = &p->pages[t][pg];
        uint32_t s0 = pool_page_first(p, t, pg), s1 = pool_page_end(p, t, pg);
        uint32_t spp = s1 - s0, used = 0, cached = 0, nf = 0;
        if (g->warming != (p->warming[t] == pg) || (g->warm && !g->spare) ||
            (g->warming && (g->spare || g->owner != POOL_NONE)))
            CHECK_FAIL("pool: tier %d page %u is marked warming %u, warm %u, spare %u (the page "
                       "being warmed: %u)",
                       t, pg, g->warming, g->warm, g->spare, p->warming[t]);
        mapped += g->warming;
        if (g->owner == POOL_NONE) {
            for (uint32_t s = s0; s < s1; s++)
                if (p->slot_block[t][s] != POOL_NONE)
                    CHECK_FAIL("pool: tier %d slot %u holds block %u in unmapped page %u", t, s,
                               p->slot_block[t][s], pg);
            continue;
        }
        if (g->owner >= p->n_owners)
            CHECK_FAIL("pool: tier %d page %u has unknown owner %u", t, pg, g->owner);
        mapped++;
        for (uint32_t s = s0; s < s1; s++) {
            uint32_t id = p->slot_block[t][s];
            if (id == POOL_NONE)
                continue;
            const struct pool_block *b = &p->blocks[id];
            used++;
            cached += b->cached;
            if (b->owner != g->owner || b->tenant != p->owners[g->owner].tenant)
                CHECK_FAIL("pool: tier %d page %u of owner %u (tenant %u) holds block %u of "
                           "owner %u (tenant %u)",
                           t, pg, g->owner, p->owners[g->owner].tenant, id, b->owner, b->tenant);
        }
        for (uint32_t s = g->free_head; s != POOL_NONE && nf <= spp; s = p->slot_next[t][s], nf++)
            if (s < s0 || s >= s1 || seen[s]++ || p->slot_block[t][s] != POOL_NONE)
                CHECK_FAIL("pool: tier %d page %u: free slot %u is outside the page, listed "
                           "twice or used",
                           t, pg, s);
        if (used != g->n_used || cached != g->n_cached || nf != g->n_free || used + nf != spp)
            CHECK_FAIL("pool: tier %d page %u: %u blocks (%u cached) and %u free slots, counted "
                       "%u (%u) and %u, of %u",
                       t, pg, used, cached, nf, g->n_used, g->n_cached, g->n_free, spp);
        bool usable = !g->pins && !g->draining;
        if (used == 0 && usable)
            CHECK_FAIL("pool: tier %d page %u of owner %u holds nothing and was not given back", t,
                       pg, g->owner);
        if ((bool)g->listed != (usable && nf > 0))
            CHECK_FAIL("pool: tier %d page %u is %slisted with %u free slots (pins %u, "
                       "draining %u)",
                       t, pg, g->listed ? "" : "not ", nf, g->pins, g->draining);
        struct pool_owner *o = &recount[g->owner];
        o->n_pages[t]++;
        if (!usable) {
            withheld += nf;
            continue;
        }
        free_all += nf;
        o->n_free[t] += nf;
        o->n_cached[t] += cached;
        if (used > 0 && cached == used) {
            o->n_fc_pages[t]++;
            o->n_fc_blocks[t] += used;
            fc++;
        }
    }
    for (uint32_t i = 0; i < p->n_owners; i++) {
        const struct pool_owner *a = &p->owners[i], *b = &recount[i];
        uint32_t listed = 0;
        for (uint32_t pg = a->partial[t]; pg != POOL_NONE && listed <= p->n_pages[t];
             pg = p->pages[t][pg].next, listed++)
            if (p->pages[t][pg].owner != i || !p->pages[t][pg].listed)
                CHECK_FAIL("pool: tier %d: owner %u's list holds page %u of owner %u", t, i, pg,
                           p->pages[t][pg].owner);
        if (a->n_pages[t] != b->n_pages[t] || a->n_free[t] != b->n_free[t] ||
            a->n_cached[t] != b->n_cached[t] || a->n_fc_pages[t] != b->n_fc_pages[t] ||
            a->n_fc_blocks[t] != b->n_fc_blocks[t])
            CHECK_FAIL("pool: tier %d owner %u counts %u pages %u free %u cached %u/%u full-cache, "
                       "has %u %u %u %u/%u",
                       t, i, a->n_pages[t], a->n_free[t], a->n_cached[t], a->n_fc_pages[t],
                       a->n_fc_blocks[t], b->n_pages[t], b->n_free[t], b->n_cached[t],
                       b->n_fc_pages[t], b->n_fc_blocks[t]);
    }
    /* A slot that straddles two pages never holds a block. */
    for (uint32_t pg = 0; pg + 1 < p->n_pages[t]; pg++) {
        uint32_t s = pool_page_end(p, t, pg);
        if (s < pool_page_first(p, t, pg + 1) && p->slot_block[t][s] != POOL_NONE)
            CHECK_FAIL("pool: tier %d slot %u straddles pages %u and %u and holds block %u", t, s,
                       pg, pg + 1, p->slot_block[t][s]);
    }
    for (uint32_t k = 0; k < p->n_free_pos[t]; k++) {
        uint32_t pg = p->free_pos[t][k];
        if (pg >= p->n_pages[t] || seen[n + pg]++ || p->pages[t][pg].owner != POOL_NONE)
            CHECK_FAIL("pool: tier %d free position %u is out of range, twice or mapped", t, pg);
    }
    uint32_t spares = 0, warm = 0;
    for (uint32_t k = 0; k < p->n_spare[t]; k++) {
        uint32_t pg = p->spare[t][k];
        if (pg >= p->n_pages[t] || seen[n + pg]++ || p->pages[t][pg].owner != POOL_NONE ||
            !p->pages[t][pg].spare)
            CHECK_FAIL("pool: tier %d spare page %u is out of range, twice, owned or unmarked", t,
                       pg);
        warm += p->pages[t][pg].warm;
        spares++;
    }
    mapped += spares;
    if (warm != p->n_warm[t] || warm > p->warm_max[t] ||
        p->n_spare[t] + (p->warming[t] != POOL_NONE) > (uint64_t)p->spare_max[t] + p->warm_max[t])
        CHECK_FAIL("pool: tier %d: %u warm of %u spares (+%d being warmed), counted %u (bounds "
                   "%u warm, %u spare)",
                   t, warm, p->n_spare[t], p->warming[t] != POOL_NONE, p->n_warm[t], p->warm_max[t],
                   p->spare_max[t]);
    if (mapped != p->n_mapped[t] || mapped + p->n_free_pos[t] != p->n_pages[t] ||
        free_all != p->n_free_slots[t] || withheld != p->n_withheld[t] || fc != p->n_fc_pages[t])
        CHECK_FAIL("pool: tier %d: %u mapped (+%u free positions of %u), %u free %u withheld %u "
                   "full-cache; counted %u, %u, %u, %u",
                   t, mapped, p->n_free_pos[t], p->n_pages[t], free_all, withheld, fc,
                   p->n_mapped[t], p->n_free_slots[t], p->n_withheld[t], p->n_fc_pages[t]);
    rc = 0;
out:
    free(seen);
    return rc;
}

int pool_check(const struct pool *p, char *msg, size_t msglen)
{
    uint32_t used = 0, pinned = 0, draining = 0;
    int rc = KVD_EINTERNAL;
    uint8_t *seen = calloc(p->n_ids + 1, 1);
    struct pool_owner *recount = calloc(p->n_owners + 1, sizeof *recount);

    if (!seen || !recount) {
        snprintf(msg, msglen, "pool check: out of memory");
        rc = KVD_ENOMEM;
        goto out;
    }
    for (uint32_t k = 0; k < p->n_free_ids; k++) {
        uint32_t i = p->free_ids[k];
        if (i >= p->n_ids || seen[i] || p->blocks[i].used)
            CHECK_FAIL("pool: free id %u is out of range, listed twice or in use", i);
        seen[i] = 1;
    }
    for (uint32_t i = 0; i < p->n_ids; i++) {
        const struct pool_block *b = &p->blocks[i];
        if (!b->used)
            continue;
        used++;
        if (b->refcount == 0 || b->tier >= POOL_TIERS || b->slot >= p->n_slots[b->tier] ||
            p->slot_block[b->tier][b->slot] != i || b->owner >= p->n_owners)
            CHECK_FAIL("pool: block %u (ref %u tier %u slot %u owner %u) disagrees with the slot "
                       "map",
                       i, b->refcount, b->tier, b->slot, b->owner);
    }
    if (used + p->n_free_ids != p->n_ids)
        CHECK_FAIL("pool: %u used + %u free ids != %u total", used, p->n_free_ids, p->n_ids);
    for (int t = 0; t < POOL_TIERS; t++) {
        if (p->n_slots[t] && (rc = check_tier(p, t, recount, msg, msglen)) != 0)
            goto out;
        rc = KVD_EINTERNAL;
        for (uint32_t pg = 0; pg < p->n_pages[t]; pg++) {
            pinned += p->pages[t][pg].pins > 0;
            draining += p->pages[t][pg].draining;
        }
    }
    if (pinned != p->n_pinned || draining != p->n_draining)
        CHECK_FAIL("pool: %u pinned and %u draining pages, counted %u and %u", pinned, draining,
                   p->n_pinned, p->n_draining);
    rc = 0;
out:
    free(seen);
    free(recount);
    return rc;
}

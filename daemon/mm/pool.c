/* pool: logical blocks over two slot arenas (see pool.h). Free ids and free
 * slots are stacks, so alloc and free are a few loads and stores; the most
 * recently freed slot is reused first, which keeps the working set warm. */
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

int pool_init(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
              uint32_t n_host)
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
        err = be->ops->arena_alloc(be, (enum kvd_tier)t, (size_t)n * block_bytes, &p->arena[t]);
        if (err)
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
        if (p->arena[t])
            p->be->ops->arena_free(p->be, (enum kvd_tier)t, p->arena[t],
                                   (size_t)p->n_slots[t] * p->block_bytes);
        free(p->free_slots[t]);
        free(p->slot_block[t]);
    }
    free(p->blocks);
    free(p->free_ids);
    memset(p, 0, sizeof *p);
}

uint32_t pool_slot_take(struct pool *p, enum kvd_tier tier)
{
    if (p->n_free_slots[tier] == 0)
        return POOL_NONE;
    return p->free_slots[tier][--p->n_free_slots[tier]];
}

void pool_slot_give(struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    p->free_slots[tier][p->n_free_slots[tier]++] = slot;
}

int pool_alloc(struct pool *p, enum kvd_tier tier, uint32_t tenant, uint32_t *id)
{
    uint32_t slot, i;
    struct pool_block *b;

    if (p->n_free_slots[tier] == 0 || p->n_free_ids == 0)
        return KVD_ENOMEM;
    slot = p->free_slots[tier][--p->n_free_slots[tier]];
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
    p->free_slots[b->tier][p->n_free_slots[b->tier]++] = b->slot;
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
        if (used_slots[t] + p->n_free_slots[t] != n) {
            snprintf(msg, msglen, "pool: tier %d: %u used + %u free slots != %u total", t,
                     used_slots[t], p->n_free_slots[t], n);
            goto out;
        }
    }
    rc = 0;
out:
    free(seen);
    return rc;
}

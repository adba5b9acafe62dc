/* hosttier: batched tier moves with checksums (see hosttier.h). */
#include "hosttier.h"

#include <stdlib.h>

#include "checksum.h"
#include "fault.h"
#include "kvd/status.h"

uint64_t hosttier_checksum(const struct pool *p, uint32_t id)
{
    return checksum64(pool_block_ptr(p, id), p->block_bytes, id);
}

int hosttier_verify(const struct pool *p, uint32_t id)
{
    const struct pool_block *b = &p->blocks[id];

    if (b->tier != KVD_TIER_HOST)
        return 0;
    return hosttier_checksum(p, id) == b->checksum ? 0 : KVD_EINTERNAL;
}

int hosttier_move(struct pool *p, const uint32_t *ids, size_t n, enum kvd_tier to, size_t *bad)
{
    struct backend *be = p->be;
    enum kvd_tier from = to == KVD_TIER_DEVICE ? KVD_TIER_HOST : KVD_TIER_DEVICE;
    uint32_t *slots;
    size_t taken = 0;
    int err = 0;

    if (n == 0)
        return 0;
    if (to == KVD_TIER_DEVICE)
        for (size_t i = 0; i < n; i++)
            if (hosttier_verify(p, ids[i])) {
                if (bad)
                    *bad = i;
                return KVD_EINTERNAL;
            }
    slots = fault_malloc(sizeof *slots * n);
    if (!slots)
        return KVD_ENOMEM;
    for (; taken < n; taken++) {
        const struct pool_block *b = &p->blocks[ids[taken]];
        int (*cp)(struct backend *, void *, enum kvd_tier, const void *, enum kvd_tier, size_t) =
            be->ops->copy_async ? be->ops->copy_async : be->ops->copy;
        slots[taken] = pool_slot_take(p, to, b->owner);
        if (slots[taken] == POOL_NONE) {
            err = KVD_ENOMEM;
            break;
        }
        void *page;
        size_t page_bytes;
        /* A new page: faulted in by one call, not 4 KiB at a time in the copy. */
        if (be->ops->prefault && pool_take_fresh(p, to, slots[taken], &page, &page_bytes))
            be->ops->prefault(be, page, to, page_bytes);
        err = cp(be, pool_slot_ptr(p, to, slots[taken]), to, pool_slot_ptr(p, from, b->slot), from,
                 p->block_bytes);
        if (err) {
            taken++;
            break;
        }
    }
    if (be->ops->copy_async && be->ops->copy_wait) {
        int werr = be->ops->copy_wait(be);
        if (!err)
            err = werr;
    }
    if (err) {
        /* Nothing moved: give the new slots back; sources are untouched. */
        while (taken)
            pool_slot_give(p, to, slots[--taken]);
        free(slots);
        return err == KVD_ENOMEM ? KVD_ENOMEM : KVD_EINTERNAL;
    }
    for (size_t i = 0; i < n; i++) {
        pool_retier(p, ids[i], to, slots[i]);
        if (to == KVD_TIER_HOST)
            p->blocks[ids[i]].checksum = hosttier_checksum(p, ids[i]);
    }
    free(slots);
    return 0;
}

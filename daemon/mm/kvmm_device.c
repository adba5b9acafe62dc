/* kvmm_device: a model's device pages given back to the page budget while
 * the model is not loaded (its pool takes none until it loads again). The
 * kvmm keeps everything else (trees, host tier, disk and remote tiers,
 * tenants), so the cached blocks moved to the host at unload match again
 * after the reload. */
#include <string.h>

#include "kvmm_impl.h"

/* Drops what eviction left on the device: tree blocks that could neither
 * move to the host nor be dropped as leaves (a device block whose children
 * are host blocks the host tier had no room to keep). Returns the blocks
 * dropped. */
static size_t drop_device_rest(struct kvmm *mm)
{
    size_t before = mm->radix.n_nodes;
    for (uint32_t i = 0; i < mm->pool.n_ids; i++) {
        struct pool_block *b = pool_block(&mm->pool, i);
        if (b->used && b->tier == KVD_TIER_DEVICE && b->node && b->refcount == 1)
            mm_drop_subtree(mm, b->node);
    }
    return before - mm->radix.n_nodes;
}

int kvmm_device_detach(struct kvmm *mm, size_t *moved, size_t *dropped)
{
    MM_ASSERT_LOCKED(mm);
    size_t n_moved = 0, n_dropped = 0;
    if (moved)
        *moved = 0;
    if (dropped)
        *dropped = 0;
    if (mm->pool.device_off)
        return 0;
    if (mm->st.n_open)
        return mm_fail(mm, KVD_EBUSY, "%u sequences are open: their blocks stay on the device",
                       mm->st.n_open);
    if (mm->pool.n_pinned || mm->pool.n_draining)
        return mm_fail(mm, KVD_EBUSY, "%u pages are exported",
                       mm->pool.n_pinned + mm->pool.n_draining);
    uint64_t out0 = mm->ctr.swaps_out;
    size_t nodes0 = mm->radix.n_nodes;
    /* Leaf first, in the evict policy's order: each block goes to the host
     * tier when it has room (its least valuable leaves dropped for it) and
     * the owner's host quota allows, else it is dropped. */
    while (mm_evict_device_one(mm, KVMM_NO_TENANT))
        ;
    n_moved = (size_t)(mm->ctr.swaps_out - out0);
    n_dropped = nodes0 - mm->radix.n_nodes;
    n_dropped += drop_device_rest(mm);
    int rc = pool_device_release(&mm->pool);
    if (rc)
        return mm_fail(mm, rc, "device blocks are still in use (%u device pages held)",
                       mm->pool.n_mapped[KVD_TIER_DEVICE] - mm->pool.n_spare[KVD_TIER_DEVICE]);
    if (moved)
        *moved = n_moved;
    if (dropped)
        *dropped = n_dropped;
    return 0;
}

int kvmm_device_attach(struct kvmm *mm)
{
    MM_ASSERT_LOCKED(mm);
    pool_device_acquire(&mm->pool);
    return 0;
}

bool kvmm_device_attached(const struct kvmm *mm)
{
    return !mm->pool.device_off;
}

uint64_t kvmm_device_bytes(const struct kvmm *mm)
{
    return (uint64_t)mm->pool.n_mapped[KVD_TIER_DEVICE] * mm->pool.page_bytes[KVD_TIER_DEVICE];
}

uint32_t kvmm_device_slots(const struct kvmm *mm)
{
    return mm->pool.n_slots[KVD_TIER_DEVICE];
}

bool kvmm_set_fingerprint(struct kvmm *mm, const uint8_t fingerprint[16], size_t *cleared)
{
    MM_ASSERT_LOCKED(mm);
    static const uint8_t zero[16];
    size_t n = 0;
    bool changed = memcmp(mm->fingerprint, fingerprint, 16) != 0;
    if (changed) {
        /* Blocks made under another model (or under no known model, which
         * a model's kvmm never holds) would match prompts they did not
         * compute. */
        if (memcmp(mm->fingerprint, zero, 16) != 0)
            kvmm_clear(mm, &n);
        memcpy(mm->fingerprint, fingerprint, 16);
        mm->root_key = blockkey_root(fingerprint, &mm->geom);
    }
    if (cleared)
        *cleared = n;
    return changed;
}

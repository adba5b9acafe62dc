/* pool: the block pool. Two arenas (device, host), each n_slots × block_bytes,
 * and the table of logical blocks that live in them. A logical block id is
 * stable for the block's life; its (tier, slot) changes when it is swapped,
 * so block tables and the radix tree never need rewriting on a swap.
 * Not thread-safe: the kvmm lock covers it. Every operation is O(1). */
#ifndef KVD_POOL_H
#define KVD_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "blockkey.h"

#define POOL_NONE UINT32_MAX
#define POOL_TIERS 2

struct radix_node;

/* One logical block. refcount = sequence references + 1 while a radix node
 * holds it; the block is freed when it reaches 0. */
struct pool_block {
    uint32_t refcount;
    uint32_t tenant;         /* owner: the tenant charged for it */
    uint32_t slot;           /* slot in `tier`'s arena */
    uint8_t tier;            /* enum kvd_tier */
    uint8_t used;            /* 0 while on the free-id stack */
    uint8_t disk;            /* enum pool_disk: where the disk tier stands with it */
    uint8_t remote;          /* POOL_REMOTE_* bits: values the remote tier has of it */
    uint8_t restoring;       /* 1 while a restore fills it (its one reference is the
                                restore's: in no tree, no sequence) */
    uint32_t hits;           /* reuses through the tree (a match took it, or a commit
                                switched to it), saturating; 0 for a new block */
    uint64_t lru;            /* stamp of the last use (kvmm clock ticks) */
    uint64_t checksum;       /* of the host copy; valid while tier == HOST */
    struct radix_node *node; /* radix node holding the block, or NULL */
    struct blockkey key;     /* chain key (blockkey.h); set while node != NULL */
    uint64_t pub;            /* published hash (KV events); set while node != NULL */
};

/* A tree block and the disk tier: not for the disk (no tier, or not in the
 * tree), queued for the writer, on disk (a copy there is current), or never
 * to be written (its bytes failed a checksum). */
enum pool_disk { POOL_DISK_NONE = 0, POOL_DISK_QUEUED, POOL_DISK_CLEAN, POOL_DISK_NEVER };
/* A tree block and the remote tier (kvmm_remote.c): the value ending at it
 * (its group's, or a tail) is queued or written. */
#define POOL_REMOTE_FULL 1u
#define POOL_REMOTE_TAIL 2u

/* A page of a paged arena (kv_export): slots_per_page[t] consecutive slots
 * that one descriptor maps. While a page is exported (pins > 0) and
 * afterwards until it is empty (draining), its free slots are withheld:
 * off the free stack, so no new block (of anyone) lands where an exporter
 * can see. Once unpinned and empty it gets fresh memory (the backend's
 * arena_page_renew) and its slots go back to the stack. */
struct pool_page {
    uint32_t pins;     /* live exports that include the page */
    uint32_t n_used;   /* slots of the page holding a block (or taken) */
    uint32_t withheld; /* free slots of the page kept off the stack */
    uint8_t draining;  /* exported once, waiting to be empty */
};

struct pool {
    struct backend *be; /* not owned */
    size_t block_bytes;
    uint32_t n_slots[POOL_TIERS];
    void *arena[POOL_TIERS];        /* owned; from be->ops->arena_alloc */
    uint32_t n_ids;                 /* = device slots + host slots: every used id holds one slot */
    struct pool_block *blocks;      /* (n_ids) */
    uint32_t *free_ids, n_free_ids; /* stack (n_ids) */
    uint32_t *free_slots[POOL_TIERS]; /* stacks (n_slots[t]) */
    uint32_t n_free_slots[POOL_TIERS];
    uint32_t *slot_block[POOL_TIERS]; /* (n_slots[t]) slot -> id, POOL_NONE when free */
    /* Paged arenas (backend arena_alloc_paged): 0 slots per page when the
     * backend cannot export (then pages is NULL). */
    uint32_t slots_per_page[POOL_TIERS];
    uint32_t n_pages[POOL_TIERS];
    struct pool_page *pages[POOL_TIERS]; /* (n_pages[t]) */
    uint32_t n_withheld[POOL_TIERS];     /* sum of pages' withheld */
    uint32_t n_pinned, n_draining;       /* pages, both tiers */
    /* The device arena is given back (pool_device_release): no device slot
     * is free or used; n_slots[DEVICE] and the stack's order are kept for
     * pool_device_acquire. */
    bool device_off;
};

/* Arenas come from the backend (zero-filled). 0 or KVD_ENOMEM/KVD_EBADREQ.
 * pool_init_off: the device arena is not allocated yet (pool_device_acquire
 * allocates it). */
int pool_init(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
              uint32_t n_host);
int pool_init_off(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
                  uint32_t n_host, bool device_off);
/* Gives the device arena back to the backend: every device slot must be
 * free (KVD_EBUSY otherwise; nothing changes). Afterwards allocations on
 * the device fail with KVD_ENOMEM until pool_device_acquire. */
int pool_device_release(struct pool *p);
/* Allocates the device arena again (zero-filled), all slots free. 0 or the
 * backend's error (KVD_ENOMEM). No-op when the arena is there. */
int pool_device_acquire(struct pool *p);
void pool_destroy(struct pool *p);

/* A new block with refcount 1 on `tier`, or KVD_ENOMEM when the tier has no
 * free slot. The bytes are whatever the slot held before. */
int pool_alloc(struct pool *p, enum kvd_tier tier, uint32_t tenant, uint32_t *id);
/* Drops one reference; frees the block (slot and id) at zero and returns true. */
bool pool_unref(struct pool *p, uint32_t id);

static inline struct pool_block *pool_block(struct pool *p, uint32_t id)
{
    return &p->blocks[id];
}
static inline void pool_ref(struct pool *p, uint32_t id)
{
    p->blocks[id].refcount++;
}
static inline void *pool_slot_ptr(const struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    return (char *)p->arena[tier] + (size_t)slot * p->block_bytes;
}
static inline void *pool_block_ptr(const struct pool *p, uint32_t id)
{
    const struct pool_block *b = &p->blocks[id];
    return pool_slot_ptr(p, (enum kvd_tier)b->tier, b->slot);
}
static inline uint32_t pool_free_slots(const struct pool *p, enum kvd_tier tier)
{
    return p->n_free_slots[tier];
}

/* Moving a block between tiers in two steps, so callers can batch the copies:
 * pool_slot_take pops a free slot of `tier` (POOL_NONE when none);
 * pool_retier points the block at (tier, slot) and frees its old slot;
 * pool_slot_give returns an unused taken slot. */
uint32_t pool_slot_take(struct pool *p, enum kvd_tier tier);
void pool_slot_give(struct pool *p, enum kvd_tier tier, uint32_t slot);
void pool_retier(struct pool *p, uint32_t id, enum kvd_tier tier, uint32_t slot);

/* Export pages (see struct pool_page). pool_page_of: the page of a slot.
 * pool_pin: the page enters an export; its free slots are zeroed (they may
 * hold what freed blocks left) and withheld. pool_unpin: an export of it
 * ended; the page drains. Both only where slots_per_page[tier] > 0. */
static inline uint32_t pool_page_of(const struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    return slot / p->slots_per_page[tier];
}
void pool_pin(struct pool *p, enum kvd_tier tier, uint32_t page);
void pool_unpin(struct pool *p, enum kvd_tier tier, uint32_t page);

/* Structural invariants: stacks + used = totals, slot maps agree with blocks,
 * nothing both free and used. 0, or KVD_EINTERNAL with a message in msg. */
int pool_check(const struct pool *p, char *msg, size_t msglen);

#endif

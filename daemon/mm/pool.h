/* pool: the block pool of one kvmm. Two tiers (device, host), each an
 * address range of page positions (pool pages: a whole number of the
 * budget's pages, chosen per block size) into which pages are
 * mapped when blocks need slots and from which they are unmapped when they
 * empty, the pages coming from and going back to the page budget (pages.h)
 * that several pools share. Slot s of a tier lives at arena + s *
 * block_bytes, whatever is mapped around it; a slot that would straddle
 * two pages is never used, so a block never spans pages (a page holds the
 * slots that lie wholly inside it). Every page belongs to one
 * owner, a (tenant, namespace) pair, and holds only that owner's blocks.
 * A logical block id is stable for the block's life; its (tier, slot)
 * changes when it is swapped, so block tables and the radix tree never
 * need rewriting on a swap. Not thread-safe: the kvmm lock covers it. */
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
struct kvpages;

/* One logical block. refcount = sequence references + 1 while a radix node
 * holds it; the block is freed when it reaches 0. */
struct pool_block {
    uint32_t refcount;
    uint32_t tenant;         /* owner: the tenant charged for it */
    uint32_t owner;          /* its page owner (pool_owner): tenant and namespace */
    uint32_t slot;           /* slot in `tier`'s arena */
    uint8_t tier;            /* enum kvd_tier */
    uint8_t used;            /* 0 while on the free-id stack */
    uint8_t disk;            /* enum pool_disk: where the disk tier stands with it */
    uint8_t remote;          /* POOL_REMOTE_* bits: values the remote tier has of it */
    uint8_t restoring;       /* 1 while a restore fills it (its one reference is the
                                restore's: in no tree, no sequence) */
    uint8_t cached;          /* only the tree holds it (pool_set_cached) */
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

/* A page position of a tier. Mapped pages belong to an owner; their free
 * slots are a list threaded through slot_next. A page takes new blocks
 * (it is "usable") unless it is exported (pins > 0) or was and still holds
 * blocks (draining): then its free slots are withheld, so no new block (of
 * its owner) lands where an exporter can see. A usable page that empties
 * goes back to the budget at once; an exported one when it is released and
 * empty, and the next use of its position maps fresh memory, so whoever
 * still maps the old memory never sees what comes next. */
struct pool_page {
    uint32_t owner;      /* POOL_NONE while unmapped */
    uint32_t n_used;     /* slots holding a block (or taken by pool_slot_take) */
    uint32_t n_cached;   /* of them, blocks only the tree holds */
    uint32_t n_free;     /* slots on the free list */
    uint32_t free_head;  /* first free slot, POOL_NONE */
    uint32_t prev, next; /* in the owner's list of usable pages with free slots */
    uint32_t pins;       /* live exports that include the page */
    uint8_t draining;    /* exported once, waiting to be empty */
    uint8_t listed;      /* on the owner's list */
    uint8_t exported;    /* pinned at least once since it was mapped */
    uint8_t spare;       /* mapped, nobody's, kept for the next page this pool takes */
    uint8_t fresh;       /* mapped new memory that nobody has prefaulted yet (pool_take_fresh) */
    uint8_t warm;        /* a spare every OS page of which was written since it was mapped */
    uint8_t warming;     /* mapped, nobody's and no spare: the warmer writes it (pool_warm_begin) */
};

/* Who a page is for, with the counts the kvmm's room-making reads (usable
 * pages only: exported ones take and give nothing). A "full-cache" page
 * holds blocks and every one of them is cached: evicting them gives the
 * whole page back. */
struct pool_owner {
    uint32_t tenant, ns;
    uint32_t bt;                     /* the tenant in the page budget, KVPAGES_NONE */
    uint32_t partial[POOL_TIERS];    /* first usable page with free slots */
    uint32_t n_pages[POOL_TIERS];    /* mapped pages, exported ones included */
    uint32_t n_free[POOL_TIERS];     /* free slots of its usable pages */
    uint32_t n_cached[POOL_TIERS];   /* cached blocks in its usable pages */
    uint32_t n_fc_pages[POOL_TIERS]; /* its full-cache usable pages */
    uint32_t n_fc_blocks[POOL_TIERS];
};

struct pool {
    struct backend *be;     /* not owned */
    struct kvpages *budget; /* not owned unless own_budget */
    bool own_budget;
    size_t block_bytes;
    uint32_t n_ids;                 /* = device slots + host slots */
    struct pool_block *blocks;      /* (n_ids) */
    uint32_t *free_ids, n_free_ids; /* stack (n_ids) */
    /* Per tier. The arena is reserved whole (elastic: pages mapped one by
     * one) or, where the backend cannot map pages or a page is no multiple
     * of its granularity, allocated whole up front (flat: pages are only
     * counted, and cannot be exported). */
    void *arena[POOL_TIERS];
    bool elastic[POOL_TIERS];
    size_t page_bytes[POOL_TIERS];       /* a pool page */
    uint32_t budget_pages[POOL_TIERS];   /* budget pages per pool page */
    uint32_t slots_per_page[POOL_TIERS]; /* whole blocks in a pool page, at least */
    uint32_t n_pages[POOL_TIERS];        /* page positions */
    uint32_t n_slots[POOL_TIERS];        /* slot numbers: the range's bytes / block_bytes */
    uint32_t n_usable[POOL_TIERS];       /* of them, slots wholly inside one page */
    struct pool_page *pages[POOL_TIERS]; /* (n_pages) */
    uint32_t *slot_block[POOL_TIERS];    /* (n_slots) slot -> id, POOL_NONE when free */
    uint32_t *slot_next[POOL_TIERS];     /* (n_slots) free-list links */
    uint32_t *free_pos[POOL_TIERS];      /* (n_pages) stack of unmapped positions */
    uint32_t n_free_pos[POOL_TIERS];
    uint32_t n_mapped[POOL_TIERS]; /* pages taken from the budget */
    uint32_t *spare[POOL_TIERS];   /* (n_pages) stack of spare positions, mapped */
    uint32_t n_spare[POOL_TIERS], spare_max[POOL_TIERS];
    /* The warm reserve (pool_warm_begin): up to warm_max spares besides
     * spare_max, of which n_warm are warm; the page being warmed (one at a
     * time, POOL_NONE: none); pages taken warm (hits) and cold, mapped new
     * or from a cold spare (misses), while warm_max > 0. */
    uint32_t warm_max[POOL_TIERS], n_warm[POOL_TIERS], warming[POOL_TIERS];
    uint64_t warm_hits[POOL_TIERS], warm_misses[POOL_TIERS];
    /* Called (lock held) when a page is taken or a spare kept while the
     * reserve is short: the warmer's wake-up; NULL: none. */
    void (*warm_kick)(void *ctx);
    void *warm_ctx;
    uint32_t n_free_slots[POOL_TIERS]; /* free slots of usable pages, every owner */
    uint32_t n_withheld[POOL_TIERS];   /* free slots of exported/draining pages */
    uint32_t n_fc_pages[POOL_TIERS];   /* full-cache usable pages, every owner */
    uint32_t n_pinned, n_draining;     /* pages, both tiers */
    uint64_t maps, unmaps;             /* pages mapped / given back, both tiers */
    /* The pool takes no device page (pool_device_release): its model is
     * not loaded, its cached blocks moved to the host. */
    bool device_off;
    struct pool_owner *owners; /* (n_owners) */
    uint32_t n_owners, cap_owners;
};

/* A pool on budget (shared, not owned) for blocks of block_bytes: it may
 * take every page of the budget, or max_bytes[t] of tier t (0: no cap;
 * POOL_TIER_OFF: none of that tier). A tier with no budget has no slots.
 * 0, KVD_EBADREQ (a block larger than the budget allows) or KVD_ENOMEM. */
#define POOL_TIER_OFF UINT64_MAX
int pool_init_budget(struct pool *p, struct kvpages *budget, size_t block_bytes,
                     const uint64_t max_bytes[POOL_TIERS]);
/* A pool with a budget of its own: n_device and n_host slots, one block per
 * page (the pool of a kvmm made without a budget). */
int pool_init(struct pool *p, struct backend *be, size_t block_bytes, uint32_t n_device,
              uint32_t n_host);
void pool_destroy(struct pool *p);
/* The pool stops taking device pages and gives every one it holds (its
 * spares) back to the budget: no device block may be left (KVD_EBUSY
 * otherwise; nothing changes). Until pool_device_acquire, allocations on
 * the device fail with KVD_ENOMEM. */
int pool_device_release(struct pool *p);
/* The pool may take device pages again (no page is taken now). */
void pool_device_acquire(struct pool *p);

/* The page owner for (tenant, ns), created on first use; bt is the tenant's
 * id in the budget (KVPAGES_NONE: none, or keep the one it has). POOL_NONE
 * when out of memory. */
uint32_t pool_owner(struct pool *p, uint32_t tenant, uint32_t ns, uint32_t bt);

/* Maps a new page for owner on tier (a budget page taken for its tenant,
 * with its byte quota checked when quota). 0, KVD_EQUOTA, or KVD_ENOMEM
 * (the budget or this pool's range is full, or the backend failed). */
int pool_page_add(struct pool *p, enum kvd_tier tier, uint32_t owner, bool quota);
/* Gives back every mapped page that holds nothing (after room was made for
 * an allocation that then failed). */
void pool_trim(struct pool *p);
/* Empty pages stay mapped as spares (up to spare_max per tier: all of them
 * in a pool with a budget of its own, a few on a shared one), counted in
 * the budget as this pool's, so that blocks coming and going at a page's
 * edge do not map and unmap it each time (a fresh page costs its first
 * touch). pool_release_spares gives up to n of them back (another pool
 * needs pages); returns how many. */
uint32_t pool_release_spares(struct pool *p, enum kvd_tier tier, uint32_t n);

/* The warm reserve: spare pages whose memory was written once already, so
 * that the first copy into them does not pay the first touch of fresh
 * memory. pool_set_warm sets its bound (pool pages of the tier, at most a
 * 16th of its page positions; 0: off, warm spares become plain ones). pool_warm_begin (lock held)
 * picks a page to warm while the tier has fewer than warm_max warm spares: a cold spare, else a
 * page mapped new from the budget's free pages while it has more than warm_max of them (nobody's:
 * no quota is charged); it is then in no list (warming) and its bytes are [*start, *start + *bytes)
 * for the caller to write with the lock released. POOL_NONE: nothing to warm (the reserve is full,
 * a page is being warmed, or no free page). pool_warm_end (lock held) makes it a warm spare, the
 * first spare pool_page_add takes. */
void pool_set_warm(struct pool *p, enum kvd_tier tier, uint32_t pages);
uint32_t pool_warm_begin(struct pool *p, enum kvd_tier tier, void **start, size_t *bytes);
void pool_warm_end(struct pool *p, enum kvd_tier tier, uint32_t pg);

/* A new block of owner with refcount 1 on `tier`: in one of the owner's
 * pages, or in a new page (without quota check) when none has a free slot.
 * KVD_ENOMEM when there is none. The bytes are whatever the slot held.
 * pool_alloc: the same for owner (tenant, namespace 0) with no budget
 * tenant (tools and tests of the pool alone). */
int pool_alloc_in(struct pool *p, enum kvd_tier tier, uint32_t owner, uint32_t *id);
int pool_alloc(struct pool *p, enum kvd_tier tier, uint32_t tenant, uint32_t *id);
/* Drops one reference; frees the block (slot and id) at zero and returns true. */
bool pool_unref(struct pool *p, uint32_t id);
/* The radix tree says whether only it holds the block (page counts). */
void pool_set_cached(struct pool *p, uint32_t id, bool cached);

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
/* The page slot s lies in (starts in), and the slots [first, end) wholly
 * inside page g. */
static inline uint32_t pool_page_of(const struct pool *p, enum kvd_tier tier, uint32_t slot)
{
    return (uint32_t)((uint64_t)slot * p->block_bytes / p->page_bytes[tier]);
}
static inline uint32_t pool_page_first(const struct pool *p, enum kvd_tier tier, uint32_t g)
{
    return (uint32_t)(((uint64_t)g * p->page_bytes[tier] + p->block_bytes - 1) / p->block_bytes);
}
static inline uint32_t pool_page_end(const struct pool *p, enum kvd_tier tier, uint32_t g)
{
    return (uint32_t)((uint64_t)(g + 1) * p->page_bytes[tier] / p->block_bytes);
}
/* Pages this pool could map now: free budget pages (in pool pages) capped
 * by its free positions. */
uint32_t pool_pages_free(const struct pool *p, enum kvd_tier tier);
/* Free slots of the tier: in usable pages (any owner's) and in the pages
 * the pool could still map. */
uint64_t pool_free_slots(const struct pool *p, enum kvd_tier tier);

/* Moving a block between tiers in two steps, so callers can batch the copies:
 * pool_slot_take takes a free slot of `tier` in owner's pages (a new page
 * when needed, without quota check; POOL_NONE when none); pool_retier
 * points the block at (tier, slot) and frees its old slot; pool_slot_give
 * returns an unused taken slot. */
uint32_t pool_slot_take(struct pool *p, enum kvd_tier tier, uint32_t owner);
void pool_slot_give(struct pool *p, enum kvd_tier tier, uint32_t slot);
void pool_retier(struct pool *p, uint32_t id, enum kvd_tier tier, uint32_t slot);
/* Whether slot's page is new memory nobody has prefaulted yet: if so, the
 * page is no longer counted fresh, and its bytes are [*start, *start +
 * *bytes), for the caller to prefault (backend prefault) before it copies
 * into the slot, outside the kvmm lock where it can: the page holds the
 * caller's slot, so it stays mapped meanwhile. */
bool pool_take_fresh(struct pool *p, enum kvd_tier tier, uint32_t slot, void **start,
                     size_t *bytes);

/* Exports (elastic arenas only). pool_pin: the page enters an export; its
 * free slots are zeroed (they may hold what its owner's freed blocks left)
 * and withheld. pool_unpin: an export of it ended; the page drains. */
void pool_pin(struct pool *p, enum kvd_tier tier, uint32_t page);
void pool_unpin(struct pool *p, enum kvd_tier tier, uint32_t page);

/* Structural invariants: id stack + used ids = total, slot maps agree with
 * blocks, every page's lists and counts, every used slot's block belongs to
 * its page's owner (a page never holds two owners' blocks), owners' and
 * the tier's counts. 0, or KVD_EINTERNAL with a message in msg. */
int pool_check(const struct pool *p, char *msg, size_t msglen);

#endif

/* radix: the prefix cache. One tree per namespace; every node below a root
 * holds one full block (block_tokens token ids and the pool block with their
 * K/V). A global open-addressing table maps (parent, tokens of the block) to
 * the child; a match follows the most recent child first and probes the
 * table only at branches. The tokens are always compared: a hash is only a
 * hint. Unreferenced cached blocks sit in per-(tenant, tier) eviction heaps
 * (radix_prio: LRU, or LRU plus a bonus for hits).
 * Not thread-safe: the kvmm lock covers it. */
#ifndef KVD_RADIX_H
#define KVD_RADIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "pool.h"

#define RADIX_NO_HEAP UINT32_MAX

/* Hot fields first: a match reads parent, hash and the tokens, which share
 * the node's first two cache lines (nodes are 64-byte aligned). */
struct radix_node {
    struct radix_node *parent; /* NULL for a namespace root */
    uint64_t hash;             /* chain hash of every token from the root */
    uint32_t block;            /* pool block id; POOL_NONE for a root */
    uint32_t ns;
    uint32_t n_children;     /* all children */
    uint32_t n_dev_children; /* children whose block is on the device tier */
    uint32_t heap_idx;       /* position in heaps[heap], or RADIX_NO_HEAP */
    uint32_t heap;           /* tenant * POOL_TIERS + tier while in a heap */
    uint32_t cached_as;      /* tenant * POOL_TIERS + tier while only the tree holds
                                the block (counted in n_cached), or RADIX_NO_HEAP */
    uint32_t pad_;
    struct radix_node *first_child, *next_sibling, *prev_sibling;
    uint32_t tokens[]; /* (block_tokens) token ids of this block */
};

/* Min-heap on radix_prio (the lru stamp plus the hit bonus): the first to
 * evict first. */
struct radix_heap {
    struct radix_node **v;
    uint32_t n, cap;
};

struct radix_slot {
    uint64_t hash;
    struct radix_node *node; /* NULL: empty */
};

#define RADIX_KEYS 32

struct radix {
    struct pool *pool; /* not owned */
    uint32_t block_tokens;
    uint32_t keys[RADIX_KEYS]; /* random per tree set: hash keys clients cannot predict */
    struct radix_slot *table;  /* (cap) owned; cap is a power of two, load <= 1/2 */
    size_t cap, n_nodes;       /* n_nodes excludes roots */
    struct radix_node **roots; /* (n_roots) owned, index = namespace id */
    uint32_t n_roots;
    size_t node_size;              /* bytes per node, tokens included (8-aligned) */
    void *slabs;                   /* owned chunks of nodes, linked through their first word */
    char *slab_next, *slab_end;    /* unused part of the newest chunk */
    struct radix_node *free_nodes; /* freed nodes, linked through parent */
    struct radix_heap *heaps;      /* (n_heap_tenants * POOL_TIERS) owned */
    uint32_t *n_cached;            /* (n_heap_tenants * POOL_TIERS) owned: tree-only blocks */
    uint32_t n_heap_tenants;
    /* Clock ticks one doubling of a block's hits adds to its priority
     * (radix_prio); 0: plain LRU (the key is the lru stamp). Set before the
     * first insert, never changed after. */
    uint64_t hit_scale;
};

/* A block's hit bonus is capped at this many doublings (hits >= 2^16 - 1
 * count as 2^16 - 1): a once-hot block ages out within a bounded time. */
#define RADIX_HIT_DOUBLINGS_MAX 16

int radix_init(struct radix *r, struct pool *pool, uint32_t block_tokens);
/* Frees every node; leaves the pool's refcounts alone (the pool goes too). */
void radix_destroy(struct radix *r);
/* A new namespace (empty tree); *ns is its id. */
int radix_ns_add(struct radix *r, uint32_t *ns);
/* Makes room in the heap table for tenant ids < n. */
int radix_tenants_reserve(struct radix *r, uint32_t n);

static inline struct radix_node *radix_root(const struct radix *r, uint32_t ns)
{
    return r->roots[ns];
}
/* The hash of a child of a node whose hash is parent_hash: an NH sum of the
 * block's token pairs under the random keys (independent per block, so a
 * match computes many at once), chained with one multiply. */
uint64_t radix_hash(const struct radix *r, uint64_t parent_hash, const uint32_t *tokens);
/* The child of `parent` holding exactly `tokens` (block_tokens ids), or NULL. */
struct radix_node *radix_child(const struct radix *r, const struct radix_node *parent,
                               const uint32_t *tokens, uint64_t hash);
/* Longest chain of whole blocks of `tokens` (n ids) below ns's root:
 * writes up to cap nodes to out and returns how many. Takes no references;
 * reorders child lists (most recently matched first). */
size_t radix_match(struct radix *r, uint32_t ns, const uint32_t *tokens, size_t n,
                   struct radix_node **out, size_t cap);
/* Adds a child holding `block` under parent (no child with these tokens may
 * exist). Takes one pool reference on the block. 0 or KVD_ENOMEM. */
int radix_insert(struct radix *r, struct radix_node *parent, const uint32_t *tokens, uint32_t block,
                 struct radix_node **out);
/* Unlinks a leaf and frees the node; returns its block id, whose tree
 * reference the caller now owns (and must drop). */
uint32_t radix_remove_leaf(struct radix *r, struct radix_node *leaf);

/* Re-evaluates whether a node is evictable and fixes its heap position; call
 * after its block's refcount, tier or lru, or its children, changed. */
void radix_update(struct radix *r, struct radix_node *node);
/* After node's block moved from old_tier to its current tier: fixes the
 * parent's device-children count and both nodes' heap membership. */
void radix_tier_changed(struct radix *r, struct radix_node *node, enum kvd_tier old_tier);
/* The eviction priority of a node (lower goes first): its block's lru stamp
 * plus hit_scale * log2(1 + hits), the log in 1/256 steps (linear between
 * powers of two), at most RADIX_HIT_DOUBLINGS_MAX doublings. With
 * hit_scale 0 it is the lru stamp. */
static inline uint64_t radix_prio(const struct radix *r, const struct radix_node *n)
{
    const struct pool_block *b = &r->pool->blocks[n->block];
    uint64_t x = (uint64_t)b->hits + 1, lg;
    unsigned k;

    if (!r->hit_scale || b->hits == 0)
        return b->lru;
    k = 63u - (unsigned)__builtin_clzll(x);
    lg = ((uint64_t)k << 8) + (((x - (UINT64_C(1) << k)) << 8) >> k);
    if (lg > (uint64_t)RADIX_HIT_DOUBLINGS_MAX << 8)
        lg = (uint64_t)RADIX_HIT_DOUBLINGS_MAX << 8;
    return b->lru + ((r->hit_scale * lg) >> 8);
}

/* The evictable node of (tenant, tier) with the lowest radix_prio (the least
 * recently used under plain LRU), or NULL. A device
 * node is evictable when only the tree holds it and no child is on the device
 * (it can move to the host without breaking a device path); a host node when
 * only the tree holds it and it has no children (it can be dropped). */
struct radix_node *radix_lru(const struct radix *r, uint32_t tenant, enum kvd_tier tier);
static inline uint32_t radix_evictable(const struct radix *r, uint32_t tenant, enum kvd_tier tier)
{
    return tenant < r->n_heap_tenants ? r->heaps[tenant * POOL_TIERS + tier].n : 0;
}

/* Blocks of (tenant, tier) held by the tree only: what eviction can free
 * by evicting leaves repeatedly (the heaps hold only today's leaves). */
static inline uint32_t radix_cached(const struct radix *r, uint32_t tenant, enum kvd_tier tier)
{
    return tenant < r->n_heap_tenants ? r->n_cached[tenant * POOL_TIERS + tier] : 0;
}

/* Calls fn on every non-root node (table order); fn returns nonzero to stop. */
int radix_foreach(const struct radix *r, int (*fn)(struct radix_node *n, void *arg), void *arg);
/* Table, links, counts and heap consistency. 0 or KVD_EINTERNAL + msg. */
int radix_check(const struct radix *r, char *msg, size_t msglen);

#endif

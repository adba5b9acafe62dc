/* radix: prefix tree over whole blocks with a (parent, tokens) → child hash
 * table and per-(tenant, tier) heaps of evictable nodes (see radix.h).
 * Deletion from the open-addressing table shifts later entries back, so
 * there are no tombstones and probes stay short. */
#include "radix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvd/status.h"

/* The table doubles at load 1/2, so the start only matters for small trees: a
 * small one keeps kvmm_check and radix_foreach (which walk every slot) cheap
 * on small pools, and lets tests with small pools reach radix_table_grow. */
#define RADIX_MIN_CAP 16
#define RADIX_MUL 0x9E3779B97F4A7C15ull
#define RADIX_NS_SEED 0x6A09E667F3BCC909ull

int radix_init(struct radix *r, struct pool *pool, uint32_t block_tokens)
{
    memset(r, 0, sizeof *r);
    r->pool = pool;
    r->block_tokens = block_tokens;
    /* Keys a client cannot guess, so it cannot craft token blocks that all
     * land in one probe run; the clock is a fallback, not a secret. */
    if (getrandom(r->keys, sizeof r->keys, GRND_NONBLOCK) != (ssize_t)sizeof r->keys) {
        uint64_t x = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)r;
        for (int i = 0; i < RADIX_KEYS; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            r->keys[i] = (uint32_t)(x >> 32);
        }
    }
    r->node_size = (sizeof(struct radix_node) + sizeof(uint32_t) * block_tokens + 7) & ~(size_t)7;
    r->cap = RADIX_MIN_CAP;
    r->table = calloc(r->cap, sizeof *r->table);
    return r->table ? 0 : KVD_ENOMEM;
}

void radix_destroy(struct radix *r)
{
    while (r->slabs) {
        void *next = *(void **)r->slabs;
        free(r->slabs);
        r->slabs = next;
    }
    for (uint32_t i = 0; i < r->n_roots; i++)
        free(r->roots[i]);
    for (uint32_t i = 0; i < r->n_heap_tenants * POOL_TIERS; i++)
        free(r->heaps[i].v);
    free(r->heaps);
    free(r->n_cached);
    free(r->roots);
    free(r->table);
    memset(r, 0, sizeof *r);
}

#define RADIX_SLAB_NODES 1024

/* Nodes come from chunks in allocation order, so a chain inserted block by
 * block lies in memory in the order a match walks it. */
static struct radix_node *radix_node_new(struct radix *r)
{
    struct radix_node *n = r->free_nodes;

    if (n) {
        r->free_nodes = n->parent;
    } else {
        if (r->slab_next == r->slab_end) {
            size_t hdr = 64; /* keeps nodes 64-byte aligned after the link word */
            size_t sz = (hdr + RADIX_SLAB_NODES * r->node_size + 63) & ~(size_t)63;
            char *c = aligned_alloc(64, sz);
            if (!c)
                return NULL;
            *(void **)c = r->slabs;
            r->slabs = c;
            r->slab_next = c + hdr;
            r->slab_end = r->slab_next + RADIX_SLAB_NODES * r->node_size;
        }
        n = (struct radix_node *)r->slab_next;
        r->slab_next += r->node_size;
    }
    memset(n, 0, r->node_size);
    return n;
}

static void radix_node_free(struct radix *r, struct radix_node *n)
{
    n->parent = r->free_nodes;
    r->free_nodes = n;
}

int radix_ns_add(struct radix *r, uint32_t *ns)
{
    struct radix_node **roots = realloc(r->roots, sizeof *roots * (r->n_roots + 1));
    struct radix_node *root;

    if (!roots)
        return KVD_ENOMEM;
    r->roots = roots;
    root = calloc(1, r->node_size);
    if (!root)
        return KVD_ENOMEM;
    root->block = POOL_NONE;
    root->ns = r->n_roots;
    root->heap_idx = RADIX_NO_HEAP;
    root->cached_as = RADIX_NO_HEAP;
    /* Distinct seeds keep different namespaces' chains apart in the table
     * (the parent pointer compare would anyway). */
    root->hash = RADIX_NS_SEED ^ ((uint64_t)root->ns * RADIX_MUL);
    r->roots[r->n_roots] = root;
    *ns = r->n_roots++;
    return 0;
}

int radix_tenants_reserve(struct radix *r, uint32_t n)
{
    struct radix_heap *h;
    uint32_t *c;

    if (n <= r->n_heap_tenants)
        return 0;
    c = realloc(r->n_cached, sizeof *c * n * POOL_TIERS);
    if (!c)
        return KVD_ENOMEM;
    memset(c + r->n_heap_tenants * POOL_TIERS, 0, sizeof *c * (n - r->n_heap_tenants) * POOL_TIERS);
    r->n_cached = c;
    h = realloc(r->heaps, sizeof *h * n * POOL_TIERS);
    if (!h)
        return KVD_ENOMEM;
    memset(h + r->n_heap_tenants * POOL_TIERS, 0, sizeof *h * (n - r->n_heap_tenants) * POOL_TIERS);
    r->heaps = h;
    r->n_heap_tenants = n;
    return 0;
}

/* NH (Black et al., UMAC) over pairs of token ids: a sum of independent
 * 32x32->64 products, so consecutive blocks hash in parallel; collisions
 * only cost a token compare. */
static inline uint64_t radix_nh(const uint32_t *keys, const uint32_t *t, uint32_t bt)
{
    uint64_t s = bt;
    uint32_t i = 0;

    for (; i + 2 <= bt; i += 2)
        s += (uint64_t)(uint32_t)(t[i] + keys[i % RADIX_KEYS]) *
             (uint32_t)(t[i + 1] + keys[(i + 1) % RADIX_KEYS]);
    if (i < bt)
        s += (uint64_t)(uint32_t)(t[i] + keys[i % RADIX_KEYS]) * 0x9E3779B9u;
    return s;
}

static inline uint64_t radix_block_sum(const struct radix *r, const uint32_t *t)
{
    /* The default block size gets a fully unrolled copy. */
    if (r->block_tokens == 16)
        return radix_nh(r->keys, t, 16);
    return radix_nh(r->keys, t, r->block_tokens);
}

static inline uint64_t radix_chain(uint64_t h, uint64_t sum)
{
    h = (h ^ sum) * RADIX_MUL;
    return h ^ (h >> 32);
}

uint64_t radix_hash(const struct radix *r, uint64_t parent_hash, const uint32_t *tokens)
{
    return radix_chain(parent_hash, radix_block_sum(r, tokens));
}

struct radix_node *radix_child(const struct radix *r, const struct radix_node *parent,
                               const uint32_t *tokens, uint64_t hash)
{
    size_t mask = r->cap - 1;

    for (size_t i = hash & mask;; i = (i + 1) & mask) {
        struct radix_node *n = r->table[i].node;
        if (!n)
            return NULL;
        if (r->table[i].hash == hash && n->parent == parent &&
            memcmp(n->tokens, tokens, sizeof(uint32_t) * r->block_tokens) == 0)
            return n;
    }
}

/* Moves c to the front of its parent's child list, so the next match of
 * a popular branch finds it without hashing. */
static void radix_to_front(struct radix_node *c)
{
    struct radix_node *p = c->parent;

    if (p->first_child == c)
        return;
    c->prev_sibling->next_sibling = c->next_sibling;
    if (c->next_sibling)
        c->next_sibling->prev_sibling = c->prev_sibling;
    c->prev_sibling = NULL;
    c->next_sibling = p->first_child;
    p->first_child->prev_sibling = c;
    p->first_child = c;
}

/* Each step first tries the parent's first child (the most recently
 * inserted or matched): chains are allocated in insertion order, so a walk
 * down one is a near-sequential read that needs no hashing. Only at a
 * branch whose first child differs is the (parent, tokens) table probed.
 * Either way the tokens are compared in full. */
#define RADIX_PREFETCH 6 /* nodes ahead */

size_t radix_match(struct radix *r, uint32_t ns, const uint32_t *tokens, size_t n,
                   struct radix_node **out, size_t cap)
{
    struct radix_node *cur = r->roots[ns];
    size_t bt = r->block_tokens, nb = n / bt, tb = sizeof(uint32_t) * bt;

    if (nb > cap)
        nb = cap;
    for (size_t j = 0; j < nb; j++) {
        const uint32_t *t = tokens + j * bt;
        struct radix_node *c = cur->first_child;
        if (!c)
            return j;
        if (memcmp(c->tokens, t, tb) != 0) {
            if (cur->n_children < 2)
                return j;
            c = radix_child(r, cur, t, radix_hash(r, cur->hash, t));
            if (!c)
                return j;
            radix_to_front(c);
        }
        /* The next nodes of a chain usually follow c in its chunk. */
        __builtin_prefetch((const char *)c + RADIX_PREFETCH * r->node_size);
        __builtin_prefetch((const char *)c + RADIX_PREFETCH * r->node_size + 64);
        out[j] = c;
        cur = c;
    }
    return nb;
}

static void radix_table_put(struct radix_slot *table, size_t cap, uint64_t hash,
                            struct radix_node *n)
{
    size_t mask = cap - 1, i = hash & mask;

    while (table[i].node)
        i = (i + 1) & mask;
    table[i].hash = hash;
    table[i].node = n;
}

static int radix_table_grow(struct radix *r)
{
    size_t cap = r->cap * 2;
    struct radix_slot *t = calloc(cap, sizeof *t);

    if (!t)
        return KVD_ENOMEM;
    for (size_t i = 0; i < r->cap; i++)
        if (r->table[i].node)
            radix_table_put(t, cap, r->table[i].hash, r->table[i].node);
    free(r->table);
    r->table = t;
    r->cap = cap;
    return 0;
}

/* Removes n from the table by backward shift: every later entry of the same
 * probe run that could live earlier moves into the hole. */
static void radix_table_del(struct radix *r, struct radix_node *n)
{
    size_t mask = r->cap - 1, i = n->hash & mask, j;

    while (r->table[i].node != n)
        i = (i + 1) & mask;
    j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!r->table[j].node)
            break;
        size_t home = r->table[j].hash & mask;
        /* Entry j may fill hole i unless its home lies cyclically in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            r->table[i] = r->table[j];
            i = j;
        }
    }
    r->table[i].node = NULL;
    r->table[i].hash = 0;
}

/* ---- heaps -------------------------------------------------------------- */

static inline uint64_t radix_key(const struct radix *r, const struct radix_node *n)
{
    return radix_prio(r, n);
}

static void radix_heap_set(struct radix_heap *h, uint32_t i, struct radix_node *n)
{
    h->v[i] = n;
    n->heap_idx = i;
}

static void radix_heap_sift(const struct radix *r, struct radix_heap *h, uint32_t i)
{
    struct radix_node *n = h->v[i];
    uint64_t key = radix_key(r, n);

    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (radix_key(r, h->v[p]) <= key)
            break;
        radix_heap_set(h, i, h->v[p]);
        i = p;
    }
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && radix_key(r, h->v[c + 1]) < radix_key(r, h->v[c]))
            c++;
        if (radix_key(r, h->v[c]) >= key)
            break;
        radix_heap_set(h, i, h->v[c]);
        i = c;
    }
    radix_heap_set(h, i, n);
}

static void radix_heap_remove(struct radix *r, struct radix_node *n)
{
    struct radix_heap *h = &r->heaps[n->heap];
    uint32_t i = n->heap_idx;

    n->heap_idx = RADIX_NO_HEAP;
    if (--h->n != i) {
        radix_heap_set(h, i, h->v[h->n]);
        radix_heap_sift(r, h, i);
    }
}

/* Heap arrays grow here; on ENOMEM the node simply stays out of the heap
 * (not evictable until the next update), which costs cache, not safety. */
static void radix_heap_add(struct radix *r, struct radix_node *n, uint32_t heap)
{
    struct radix_heap *h = &r->heaps[heap];

    if (h->n == h->cap) {
        uint32_t cap = h->cap ? h->cap * 2 : 64;
        struct radix_node **v = realloc(h->v, sizeof *v * cap);
        if (!v)
            return;
        h->v = v;
        h->cap = cap;
    }
    n->heap = heap;
    radix_heap_set(h, h->n++, n);
    radix_heap_sift(r, h, n->heap_idx);
}

static uint32_t radix_want_heap(const struct radix *r, const struct radix_node *n)
{
    const struct pool_block *b;

    if (!n->parent)
        return RADIX_NO_HEAP;
    b = &r->pool->blocks[n->block];
    if (b->refcount != 1 || b->tenant >= r->n_heap_tenants)
        return RADIX_NO_HEAP;
    if (b->tier == KVD_TIER_DEVICE && n->n_dev_children == 0)
        return b->tenant * POOL_TIERS + KVD_TIER_DEVICE;
    if (b->tier == KVD_TIER_HOST && n->n_children == 0)
        return b->tenant * POOL_TIERS + KVD_TIER_HOST;
    return RADIX_NO_HEAP;
}

static uint32_t radix_want_cached(const struct radix *r, const struct radix_node *n)
{
    const struct pool_block *b = &r->pool->blocks[n->block];

    if (!n->parent || b->refcount != 1 || b->tenant >= r->n_heap_tenants)
        return RADIX_NO_HEAP;
    return b->tenant * POOL_TIERS + b->tier;
}

static void radix_set_cached(struct radix *r, struct radix_node *n, uint32_t want)
{
    if (n->cached_as == want)
        return;
    if (n->cached_as != RADIX_NO_HEAP)
        r->n_cached[n->cached_as]--;
    if (want != RADIX_NO_HEAP)
        r->n_cached[want]++;
    n->cached_as = want;
    /* The pool counts cached blocks per page (whole pages to evict). */
    pool_set_cached(r->pool, n->block, want != RADIX_NO_HEAP);
}

void radix_update(struct radix *r, struct radix_node *n)
{
    uint32_t want = radix_want_heap(r, n);

    if (n->parent)
        radix_set_cached(r, n, radix_want_cached(r, n));

    if (n->heap_idx != RADIX_NO_HEAP) {
        if (want == n->heap) {
            radix_heap_sift(r, &r->heaps[n->heap], n->heap_idx); /* its key may have moved */
            return;
        }
        radix_heap_remove(r, n);
    }
    if (want != RADIX_NO_HEAP)
        radix_heap_add(r, n, want);
}

struct radix_node *radix_lru(const struct radix *r, uint32_t tenant, enum kvd_tier tier)
{
    const struct radix_heap *h;

    if (tenant >= r->n_heap_tenants)
        return NULL;
    h = &r->heaps[tenant * POOL_TIERS + tier];
    return h->n ? h->v[0] : NULL;
}

void radix_tier_changed(struct radix *r, struct radix_node *n, enum kvd_tier old_tier)
{
    enum kvd_tier now = (enum kvd_tier)r->pool->blocks[n->block].tier;

    if (now != old_tier && n->parent) {
        if (now == KVD_TIER_DEVICE)
            n->parent->n_dev_children++;
        else
            n->parent->n_dev_children--;
        if (n->parent->parent)
            radix_update(r, n->parent);
    }
    radix_update(r, n);
}

/* ---- insert / remove ---------------------------------------------------- */

int radix_insert(struct radix *r, struct radix_node *parent, const uint32_t *tokens, uint32_t block,
                 struct radix_node **out)
{
    struct radix_node *n;
    struct pool_block *b = &r->pool->blocks[block];

    if ((r->n_nodes + r->n_roots + 1) * 2 > r->cap && radix_table_grow(r))
        return KVD_ENOMEM;
    n = radix_node_new(r);
    if (!n)
        return KVD_ENOMEM;
    n->parent = parent;
    n->hash = radix_hash(r, parent->hash, tokens);
    n->block = block;
    n->ns = parent->ns;
    n->heap_idx = RADIX_NO_HEAP;
    n->cached_as = RADIX_NO_HEAP;
    memcpy(n->tokens, tokens, sizeof(uint32_t) * r->block_tokens);
    radix_table_put(r->table, r->cap, n->hash, n);
    r->n_nodes++;
    n->next_sibling = parent->first_child;
    if (parent->first_child)
        parent->first_child->prev_sibling = n;
    parent->first_child = n;
    parent->n_children++;
    if (b->tier == KVD_TIER_DEVICE)
        parent->n_dev_children++;
    pool_ref(r->pool, block);
    b->node = n;
    if (parent->parent)
        radix_update(r, parent);
    radix_update(r, n);
    *out = n;
    return 0;
}

uint32_t radix_remove_leaf(struct radix *r, struct radix_node *n)
{
    struct radix_node *parent = n->parent;
    struct pool_block *b = &r->pool->blocks[n->block];
    uint32_t block = n->block;

    if (n->heap_idx != RADIX_NO_HEAP)
        radix_heap_remove(r, n);
    radix_set_cached(r, n, RADIX_NO_HEAP);
    radix_table_del(r, n);
    r->n_nodes--;
    if (n->prev_sibling)
        n->prev_sibling->next_sibling = n->next_sibling;
    else
        parent->first_child = n->next_sibling;
    if (n->next_sibling)
        n->next_sibling->prev_sibling = n->prev_sibling;
    parent->n_children--;
    if (b->tier == KVD_TIER_DEVICE)
        parent->n_dev_children--;
    b->node = NULL;
    radix_node_free(r, n);
    if (parent->parent)
        radix_update(r, parent);
    return block;
}

/* ---- walking and checking ----------------------------------------------- */

static int radix_check_nodes(const struct radix *r, uint32_t *cached, char *msg, size_t msglen);

int radix_foreach(const struct radix *r, int (*fn)(struct radix_node *n, void *arg), void *arg)
{
    for (size_t i = 0; i < r->cap; i++) {
        int rc;
        if (r->table[i].node && (rc = fn(r->table[i].node, arg)))
            return rc;
    }
    return 0;
}

int radix_check(const struct radix *r, char *msg, size_t msglen)
{
    uint32_t *cached = calloc((size_t)r->n_heap_tenants * POOL_TIERS + 1, sizeof *cached);
    int rc;

    if (!cached) {
        snprintf(msg, msglen, "radix check: out of memory");
        return KVD_ENOMEM;
    }
    rc = radix_check_nodes(r, cached, msg, msglen);

    for (uint32_t h = 0; !rc && h < r->n_heap_tenants * POOL_TIERS; h++)
        if (cached[h] != r->n_cached[h]) {
            snprintf(msg, msglen, "radix: %u tree-only blocks in class %u, count says %u",
                     cached[h], h, r->n_cached[h]);
            rc = KVD_EINTERNAL;
        }
    free(cached);
    return rc;
}

static int radix_check_nodes(const struct radix *r, uint32_t *cached, char *msg, size_t msglen)
{
    size_t seen = 0;

    for (size_t i = 0; i < r->cap; i++) {
        struct radix_node *n = r->table[i].node, *c;
        const struct pool_block *b;
        uint32_t kids = 0, dev = 0, want;
        if (!n)
            continue;
        seen++;
        b = &r->pool->blocks[n->block];
        if (!n->parent || n->block >= r->pool->n_ids || !b->used || b->node != n) {
            snprintf(msg, msglen,
                     "radix: node of block %u has no parent or its block does not "
                     "point back",
                     n->block);
            return KVD_EINTERNAL;
        }
        if (n->hash != radix_hash(r, n->parent->hash, n->tokens) || n->hash != r->table[i].hash ||
            radix_child(r, n->parent, n->tokens, n->hash) != n) {
            snprintf(msg, msglen, "radix: node of block %u is not found by its own key", n->block);
            return KVD_EINTERNAL;
        }
        /* Reachable: the parent chain ends at this namespace's root. */
        {
            const struct radix_node *a = n;
            size_t depth = 0;
            while (a->parent && depth++ <= r->n_nodes)
                a = a->parent;
            if (a->parent || a->ns >= r->n_roots || r->roots[a->ns] != a || a->ns != n->ns) {
                snprintf(msg, msglen, "radix: node of block %u is not reachable from its root",
                         n->block);
                return KVD_EINTERNAL;
            }
        }
        for (c = n->first_child; c; c = c->next_sibling) {
            kids++;
            if (c->parent != n) {
                snprintf(msg, msglen, "radix: child list of block %u is broken", n->block);
                return KVD_EINTERNAL;
            }
            if (r->pool->blocks[c->block].tier == KVD_TIER_DEVICE)
                dev++;
        }
        if (kids != n->n_children || dev != n->n_dev_children) {
            snprintf(msg, msglen, "radix: block %u counts %u/%u children, has %u/%u", n->block,
                     n->n_children, n->n_dev_children, kids, dev);
            return KVD_EINTERNAL;
        }
        want = radix_want_cached(r, n);
        if (want != n->cached_as) {
            snprintf(msg, msglen, "radix: block %u has a stale cached class", n->block);
            return KVD_EINTERNAL;
        }
        if (want != RADIX_NO_HEAP)
            cached[want]++;
        want = radix_want_heap(r, n);
        if ((want == RADIX_NO_HEAP) != (n->heap_idx == RADIX_NO_HEAP) ||
            (want != RADIX_NO_HEAP && (n->heap != want || n->heap_idx >= r->heaps[want].n ||
                                       r->heaps[want].v[n->heap_idx] != n))) {
            snprintf(msg, msglen, "radix: block %u is %s the eviction heap it belongs to", n->block,
                     want == RADIX_NO_HEAP ? "in" : "not in");
            return KVD_EINTERNAL;
        }
    }
    if (seen != r->n_nodes) {
        snprintf(msg, msglen, "radix: table holds %zu nodes, count says %zu", seen, r->n_nodes);
        return KVD_EINTERNAL;
    }
    for (uint32_t i = 0; i < r->n_roots; i++) {
        const struct radix_node *root = r->roots[i], *c;
        uint32_t kids = 0, dev = 0;
        for (c = root->first_child; c; c = c->next_sibling) {
            kids++;
            dev += r->pool->blocks[c->block].tier == KVD_TIER_DEVICE;
        }
        if (kids != root->n_children || dev != root->n_dev_children) {
            snprintf(msg, msglen, "radix: root of namespace %u miscounts its children", i);
            return KVD_EINTERNAL;
        }
    }
    for (uint32_t h = 0; h < r->n_heap_tenants * POOL_TIERS; h++) {
        const struct radix_heap *hp = &r->heaps[h];
        for (uint32_t i = 1; i < hp->n; i++)
            if (radix_key(r, hp->v[(i - 1) / 2]) > radix_key(r, hp->v[i])) {
                snprintf(msg, msglen, "radix: heap %u is out of order at %u", h, i);
                return KVD_EINTERNAL;
            }
        for (uint32_t i = 0; i < hp->n; i++)
            if (hp->v[i]->heap_idx != i || hp->v[i]->heap != h) {
                snprintf(msg, msglen, "radix: heap %u entry %u has a stale index", h, i);
                return KVD_EINTERNAL;
            }
    }
    return 0;
}

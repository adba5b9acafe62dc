/* kvmm_seq: the sequence operations of the kvmm facade: open/close, match a
 * cached prefix, extend/truncate, K/V byte access with copy-on-write, commit
 * (sharing full blocks through the radix tree), fork, offload/restore. Every
 * function expects the caller to hold mm->lock (see kvmm.h). */
#include <stdlib.h>
#include <string.h>

#include "fault.h"
#include "hosttier.h"
#include "kvmm_impl.h"

/* Token slots per sequence: far above any context length, low enough that
 * byte counts (tokens × token_bytes) cannot overflow. */
#define KVMM_MAX_SEQ_TOKENS (1u << 28)

static struct seq *mm_seq(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t h, int *rc)
{
    struct seq *s = seq_table_get(&mm->st, h, owner);

    if (!s) {
        int code;
        /* The owner lent it to a generate request: busy, not unknown. */
        const struct seq *l = seq_table_peek(&mm->st, h);
        if (l && l->lent && l->lender == owner)
            code = mm_fail(mm, KVD_EBUSY, "sequence %llu is in use by generate request %llu",
                           (unsigned long long)h, (unsigned long long)l->lend_tag);
        else
            code = mm_fail(mm, KVD_ENOTFOUND, "no open sequence %#llx for this owner",
                           (unsigned long long)h);
        if (rc)
            *rc = code;
    }
    return s;
}

#define SEQ_GET(s)                                                                                 \
    int s##_rc = KVD_ENOTFOUND;                                                                    \
    struct seq *s = mm_seq(mm, owner, seq, &s##_rc);                                               \
    if (!s)                                                                                        \
        return s##_rc;

static size_t mm_blocks_for(const struct kvmm *mm, size_t n_tokens)
{
    return (n_tokens + mm->geom.block_tokens - 1) / mm->geom.block_tokens;
}

/* Releases blocks from the tail down to index `keep`, last first, so the
 * released chain's stamps grow towards its root (leaves are evicted first). */
static void mm_seq_release(struct kvmm *mm, struct seq *s, size_t keep)
{
    while (s->n_blocks > keep)
        mm_unref(mm, s->blocks[--s->n_blocks]);
}

/* Block i of s failed its host checksum: its K/V is lost. It leaves the tree
 * (with everything below it) and the sequence is cut before it. */
static int mm_seq_lost(struct kvmm *mm, struct seq *s, size_t i)
{
    uint32_t id = s->blocks[i];
    struct pool_block *b = pool_block(&mm->pool, id);

    mm->ctr.checksum_failures++;
    b->disk = POOL_DISK_NEVER;
    if (b->node)
        mm_drop_subtree(mm, b->node);
    mm_seq_release(mm, s, i);
    s->n_tokens = i * mm->geom.block_tokens;
    if (s->n_committed > s->n_tokens)
        s->n_committed = s->n_tokens;
    return mm_fail(mm, KVD_EINTERNAL,
                   "block %zu of the sequence (id %u) failed its host-tier checksum; its K/V "
                   "is lost and the sequence was cut to %zu tokens",
                   i, id, s->n_tokens);
}

/* Brings the host-tier blocks among s->blocks[b0, b1) to the device. */
static int mm_seq_swap_in(struct kvmm *mm, struct seq *s, size_t b0, size_t b1)
{
    size_t h = 0, bad = SIZE_MAX;
    uint32_t *ids, *idx;
    int err;

    for (size_t i = b0; i < b1; i++)
        h += pool_block(&mm->pool, s->blocks[i])->tier == KVD_TIER_HOST;
    if (h == 0)
        return 0;
    ids = fault_malloc(sizeof *ids * h);
    idx = fault_malloc(sizeof *idx * h);
    if (!ids || !idx) {
        err = mm_fail(mm, KVD_ENOMEM, "out of memory");
        goto out;
    }
    h = 0;
    for (size_t i = b0; i < b1; i++)
        if (pool_block(&mm->pool, s->blocks[i])->tier == KVD_TIER_HOST) {
            idx[h] = (uint32_t)i;
            ids[h++] = s->blocks[i];
        }
    err = mm_room_move(mm, KVD_TIER_DEVICE, ids, h, s->tenant);
    if (!err)
        err = mm_move(mm, ids, h, KVD_TIER_DEVICE, &bad);
    if (err == KVD_EINTERNAL && bad < h)
        err = mm_seq_lost(mm, s, idx[bad]);
out:
    free(ids);
    free(idx);
    return err;
}

/* Copy-on-write: every block of s->blocks[b0, b1) that someone else also
 * holds (another sequence or the tree) is replaced by a private copy. The
 * blocks must be on the device. All or nothing. */
static int mm_seq_cow(struct kvmm *mm, struct seq *s, size_t b0, size_t b1)
{
    size_t c = 0, k = 0;
    uint32_t *ids;
    int err;

    for (size_t i = b0; i < b1; i++)
        c += pool_block(&mm->pool, s->blocks[i])->refcount > 1;
    if (c == 0)
        return 0;
    ids = fault_malloc(sizeof *ids * c);
    if (!ids)
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    err = mm_alloc_device(mm, s->tenant, s->ns, c, ids);
    if (err)
        goto out;
    for (size_t i = b0; i < b1; i++) {
        if (pool_block(&mm->pool, s->blocks[i])->refcount <= 1)
            continue;
        if (mm->be->ops->copy(mm->be, pool_block_ptr(&mm->pool, ids[k]), KVD_TIER_DEVICE,
                              pool_block_ptr(&mm->pool, s->blocks[i]), KVD_TIER_DEVICE,
                              mm->block_bytes)) {
            for (k = 0; k < c; k++)
                mm_unref(mm, ids[k]);
            err = mm_fail(mm, KVD_EINTERNAL, "copy-on-write: the block copy failed");
            goto out;
        }
        k++;
    }
    k = 0;
    for (size_t i = b0; i < b1; i++) {
        uint32_t old = s->blocks[i];
        if (pool_block(&mm->pool, old)->refcount <= 1)
            continue;
        s->blocks[i] = ids[k++];
        mm_unref(mm, old);
        mm->ctr.cow_copies++;
    }
out:
    free(ids);
    return err;
}

static int mm_seq_range(struct kvmm *mm, const struct seq *s, size_t start, size_t n)
{
    if (start > s->n_tokens || n > s->n_tokens - start)
        return mm_fail(mm, KVD_EBADREQ,
                       "token range [%zu, %zu+%zu) is outside the sequence's %zu tokens", start,
                       start, n, s->n_tokens);
    return 0;
}

/* ---- open / close ------------------------------------------------------- */

int kvmm_seq_open(struct kvmm *mm, kvmm_owner owner, uint32_t tenant, uint32_t ns, kvmm_seq_t *out)
{
    MM_ASSERT_LOCKED(mm);
    struct tenant *t;
    struct seq *s;
    int err;

    if (!tenant_live(&mm->tt, tenant))
        return mm_fail(mm, KVD_ENOTFOUND, "no tenant %u", tenant);
    if (ns >= mm->tt.n_ns || !mm->tt.ns_names[ns][0])
        return mm_fail(mm, KVD_ENOTFOUND, "no namespace %u", ns);
    t = &mm->tt.v[tenant];
    if (t->conf.max_seqs != KVMM_UNLIMITED && t->seqs >= t->conf.max_seqs)
        return mm_fail(mm, KVD_EQUOTA, "tenant '%s': sequence quota %u reached", t->conf.name,
                       t->conf.max_seqs);
    err = seq_table_add(&mm->st, owner, out, &s);
    if (err)
        return mm_fail(mm, err, "out of memory opening a sequence");
    s->tenant = tenant;
    s->ns = ns;
    t->seqs++;
    return 0;
}

static void mm_seq_close(struct kvmm *mm, struct seq *s)
{
    mm_seq_release(mm, s, 0);
    mm->tt.v[s->tenant].seqs--;
    seq_table_del(&mm->st, s);
}

int kvmm_seq_close(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    mm_seq_close(mm, s);
    return 0;
}

void kvmm_close_owner(struct kvmm *mm, kvmm_owner owner)
{
    MM_ASSERT_LOCKED(mm);
    mm_exports_close_owner(mm, owner);
    for (uint32_t i = 0; i < mm->st.n; i++) {
        struct seq *s = mm->st.v[i];
        if ((s->gen & 1) && s->owner == owner)
            mm_seq_close(mm, s);
    }
}

/* ---- match -------------------------------------------------------------- */

/* The cached path a match reuses: nodes[0, len) of one namespace's tree,
 * root first, each pinned by one reference of the match (so making device
 * room cannot evict them); swap is scratch for the ids to bring in. */
struct match_path {
    struct radix_node **nodes;
    uint32_t *swap;
    size_t len;
};

static int match_check(struct kvmm *mm, const struct seq *s, const uint32_t *tokens, size_t n)
{
    if (s->n_tokens != 0)
        return mm_fail(mm, KVD_EBADREQ, "match needs an empty sequence (it has %zu tokens)",
                       s->n_tokens);
    if (n > KVMM_MAX_SEQ_TOKENS)
        return mm_fail(mm, KVD_ETOOLARGE, "match of %zu tokens: the limit is %u", n,
                       KVMM_MAX_SEQ_TOKENS);
    if (n && !tokens)
        return mm_fail(mm, KVD_EBADREQ, "match: no tokens given");
    return 0;
}

/* Finds the longest cached path for tokens in s's namespace and pins it;
 * s gets room for that many blocks. */
static int path_find(struct kvmm *mm, struct seq *s, const uint32_t *tokens, size_t n,
                     struct match_path *p)
{
    size_t bt = mm->geom.block_tokens;
    /* No match is longer than the tree: size the scratch arrays by that,
     * not by what the client sent. */
    size_t cap = n / bt < mm->radix.n_nodes ? n / bt : mm->radix.n_nodes;
    p->nodes = fault_malloc(sizeof *p->nodes * (cap + 1));
    p->swap = fault_malloc(sizeof *p->swap * (cap + 1));
    if (!p->nodes || !p->swap)
        return mm_fail(mm, KVD_ENOMEM, "out of memory matching %zu tokens", n);
    size_t found = radix_match(&mm->radix, s->ns, tokens, n, p->nodes, cap);
    if (seq_reserve_blocks(s, found) || seq_reserve_tokens(s, found * bt))
        return mm_fail(mm, KVD_ENOMEM, "out of memory matching %zu tokens", n);
    for (p->len = 0; p->len < found; p->len++)
        mm_ref(mm, p->nodes[p->len]->block);
    return 0;
}

static bool path_on_host(struct kvmm *mm, const struct match_path *p, size_t i)
{
    return pool_block(&mm->pool, p->nodes[i]->block)->tier == KVD_TIER_HOST;
}

/* Index of the path's first host-tier block (len when it has none). */
static size_t path_first_host(struct kvmm *mm, const struct match_path *p)
{
    size_t i = 0;
    while (i < p->len && !path_on_host(mm, p, i))
        i++;
    return i;
}

/* Unpins the path's blocks from keep on, the deepest first. */
static void path_cut(struct kvmm *mm, struct match_path *p, size_t keep)
{
    while (p->len > keep)
        mm_unref(mm, p->nodes[--p->len]->block);
}

/* The host copy of block id failed its checksum: it is never served. The
 * path is cut before it, and it leaves the tree with its subtree. */
static void path_drop_corrupt(struct kvmm *mm, struct match_path *p, uint32_t id)
{
    size_t at = 0;
    while (p->nodes[at]->block != id)
        at++;
    struct radix_node *corrupt = p->nodes[at];
    mm->ctr.checksum_failures++;
    pool_block(&mm->pool, id)->disk = POOL_DISK_NEVER;
    path_cut(mm, p, at);
    mm_drop_subtree(mm, corrupt);
}

/* Brings the path's host-tier blocks to the device, in path order, as many
 * as the device can take now. Returns false when a host copy failed its
 * checksum (the path was cut before it: try again); else true with
 * *usable = the length of the prefix that is all on the device: the whole
 * path, or up to the first host block that did not fit (or could not be
 * moved). */
static bool path_swap_in(struct kvmm *mm, uint32_t tenant, struct match_path *p, size_t *usable)
{
    size_t n_swap = 0, end, bad = SIZE_MAX;

    if (path_first_host(mm, p) == p->len) {
        *usable = p->len;
        return true;
    }
    size_t room = mm_device_headroom(mm, tenant), n_host = 0;
    for (size_t i = 0; i < p->len; i++)
        n_host += path_on_host(mm, p, i);
    if (room < n_host) /* the other models' pools give (their cache to their host tiers) */
        (void)kvmm_device_ask(mm, tenant, n_host, true);
    room = mm_device_headroom(mm, tenant);
    for (end = 0; end < p->len; end++) {
        if (!path_on_host(mm, p, end))
            continue;
        if (n_swap == room)
            break;
        p->swap[n_swap++] = p->nodes[end]->block;
    }
    int err = mm_room_move(mm, KVD_TIER_DEVICE, p->swap, n_swap, tenant);
    if (!err)
        err = mm_move(mm, p->swap, n_swap, KVD_TIER_DEVICE, &bad);
    if (err == KVD_EINTERNAL && bad < n_swap) {
        path_drop_corrupt(mm, p, p->swap[bad]);
        return false;
    }
    /* No room after all, or a copy failed: the device part only. */
    *usable = err ? path_first_host(mm, p) : end;
    return true;
}

/* The sequence takes the path's blocks (the match's references) and their
 * token ids. */
static size_t path_attach(struct kvmm *mm, struct seq *s, const struct match_path *p,
                          const uint32_t *tokens)
{
    size_t n_tokens = p->len * mm->geom.block_tokens;
    for (size_t i = 0; i < p->len; i++) {
        struct pool_block *b = pool_block(&mm->pool, p->nodes[i]->block);
        s->blocks[i] = p->nodes[i]->block;
        b->lru = ++mm->clock;
        b->hits += b->hits != UINT32_MAX; /* a reuse: counts for eviction */
        mm_remote_used(mm, p->nodes[i], i);
    }
    if (p->len)
        mm_remote_chain_end(mm, p->nodes[p->len - 1], p->len - 1);
    s->n_blocks = p->len;
    s->n_tokens = s->n_committed = n_tokens;
    if (n_tokens)
        memcpy(s->tokens, tokens, sizeof(uint32_t) * n_tokens);
    return n_tokens;
}

int kvmm_seq_match(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, const uint32_t *tokens,
                   size_t n, size_t *matched)
{
    MM_ASSERT_LOCKED(mm);
    struct match_path path = {NULL, NULL, 0};
    size_t usable;
    int err;

    SEQ_GET(s);
    *matched = 0;
    if ((err = match_check(mm, s, tokens, n)))
        return err;
    struct tenant *t = &mm->tt.v[s->tenant];
    t->match_asked += n;
    mm->ctr.match_tokens_asked += n;
    if (n < mm->geom.block_tokens)
        return 0;
    err = path_find(mm, s, tokens, n, &path);
    if (!err) {
        while (!path_swap_in(mm, s->tenant, &path, &usable))
            ;
        path_cut(mm, &path, usable);
        *matched = path_attach(mm, s, &path, tokens);
        t->match_hit += *matched;
        mm->ctr.match_tokens_hit += *matched;
    }
    free(path.nodes);
    free(path.swap);
    return err;
}

/* ---- extend / truncate -------------------------------------------------- */

int kvmm_seq_extend(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t n)
{
    MM_ASSERT_LOCKED(mm);
    size_t need;
    int err;

    SEQ_GET(s);
    if (n > KVMM_MAX_SEQ_TOKENS - s->n_tokens)
        return mm_fail(mm, KVD_ETOOLARGE, "extend by %zu: a sequence holds at most %u tokens", n,
                       KVMM_MAX_SEQ_TOKENS);
    need = mm_blocks_for(mm, s->n_tokens + n) - s->n_blocks;
    if (need == 0) { /* fits in the last block; s->blocks may still be NULL */
        s->n_tokens += n;
        return 0;
    }
    if (need > mm->pool.n_slots[KVD_TIER_DEVICE])
        return mm_fail(mm, KVD_ENOMEM,
                       "extend by %zu tokens needs %zu blocks; the device pool "
                       "holds at most %u",
                       n, need, mm->pool.n_slots[KVD_TIER_DEVICE]);
    if (seq_reserve_blocks(s, s->n_blocks + need))
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    err = mm_alloc_device(mm, s->tenant, s->ns, need, s->blocks + s->n_blocks);
    if (err)
        return err;
    s->n_blocks += need;
    s->n_tokens += n;
    return 0;
}

int kvmm_seq_truncate(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t n)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    if (n > s->n_tokens)
        return mm_fail(mm, KVD_EBADREQ, "truncate by %zu: the sequence has %zu tokens", n,
                       s->n_tokens);
    s->n_tokens -= n;
    if (s->n_committed > s->n_tokens)
        s->n_committed = s->n_tokens;
    mm_seq_release(mm, s, mm_blocks_for(mm, s->n_tokens));
    return 0;
}

/* ---- K/V bytes ---------------------------------------------------------- */

/* Moves the bytes of tokens [t0, t0+c) of block `bi` between a block image
 * (block layout, token dim = block_tokens) and the caller's buffer (the same
 * layout with token dim = n, starting at token `start`). */
static void mm_xfer(const struct kvmm *mm, unsigned char *blk, unsigned char *data, size_t n,
                    size_t start, size_t bi, size_t t0, size_t c, bool to_block)
{
    const struct kv_geom *g = &mm->geom;
    size_t rows = (size_t)g->layers * 2 * g->kv_heads;
    size_t tb = kv_row_bytes(g->dtype, g->head_dim); /* bytes of one token's head row */
    size_t o0 = t0 - bi * g->block_tokens, d0 = t0 - start;

    for (size_t r = 0; r < rows; r++) {
        unsigned char *b = blk + (r * g->block_tokens + o0) * tb;
        unsigned char *d = data + (r * n + d0) * tb;
        if (to_block)
            memcpy(b, d, c * tb);
        else
            memcpy(d, b, c * tb);
    }
}

int kvmm_seq_prepare_write(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start,
                           size_t n)
{
    MM_ASSERT_LOCKED(mm);
    size_t b0, b1;
    int err;

    SEQ_GET(s);
    if ((err = mm_seq_range(mm, s, start, n)) || n == 0)
        return err;
    b0 = start / mm->geom.block_tokens;
    b1 = mm_blocks_for(mm, start + n);
    err = mm_seq_swap_in(mm, s, b0, b1);
    if (!err)
        err = mm_seq_cow(mm, s, b0, b1);
    return err;
}

int kvmm_seq_write(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start, size_t n,
                   const void *data, size_t len)
{
    MM_ASSERT_LOCKED(mm);
    size_t bt = mm->geom.block_tokens;
    struct backend *be = mm->be;
    int err;

    SEQ_GET(s);
    if ((err = mm_seq_range(mm, s, start, n)))
        return err;
    if (len != n * mm->token_bytes || (n && !data))
        return mm_fail(mm, KVD_EBADREQ, "write of %zu tokens needs %zu bytes, got %zu", n,
                       n * mm->token_bytes, len);
    if (n == 0)
        return 0;
    if ((err = kvmm_seq_prepare_write(mm, owner, seq, start, n)))
        return err;
    for (size_t bi = start / bt; bi * bt < start + n; bi++) {
        size_t t0 = bi * bt > start ? bi * bt : start;
        size_t t1 = (bi + 1) * bt < start + n ? (bi + 1) * bt : start + n;
        void *dev = pool_block_ptr(&mm->pool, s->blocks[bi]);
        /* A whole block is written in one copy; a part needs the rest first. */
        if (t1 - t0 < bt &&
            be->ops->copy(be, mm->staging, KVD_TIER_HOST, dev, KVD_TIER_DEVICE, mm->block_bytes))
            return mm_fail(mm, KVD_EINTERNAL, "reading block %zu for a partial write failed", bi);
        mm_xfer(mm, mm->staging, (unsigned char *)data, n, start, bi, t0, t1 - t0, true);
        if (be->ops->copy(be, dev, KVD_TIER_DEVICE, mm->staging, KVD_TIER_HOST, mm->block_bytes))
            return mm_fail(mm, KVD_EINTERNAL, "writing block %zu failed", bi);
    }
    return 0;
}

int kvmm_seq_read(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t start, size_t n,
                  void *out, size_t len)
{
    MM_ASSERT_LOCKED(mm);
    size_t bt = mm->geom.block_tokens;
    struct backend *be = mm->be;
    int err;

    SEQ_GET(s);
    if ((err = mm_seq_range(mm, s, start, n)))
        return err;
    if (len != n * mm->token_bytes || (n && !out))
        return mm_fail(mm, KVD_EBADREQ, "read of %zu tokens needs %zu bytes, got %zu", n,
                       n * mm->token_bytes, len);
    /* Host copies are read in place, after their checksum is verified. */
    for (size_t bi = start / bt; bi * bt < start + n; bi++)
        if (hosttier_verify(&mm->pool, s->blocks[bi]))
            return mm_seq_lost(mm, s, bi);
    for (size_t bi = start / bt; bi * bt < start + n; bi++) {
        size_t t0 = bi * bt > start ? bi * bt : start;
        size_t t1 = (bi + 1) * bt < start + n ? (bi + 1) * bt : start + n;
        const struct pool_block *b = pool_block(&mm->pool, s->blocks[bi]);
        if (be->ops->copy(be, mm->staging, KVD_TIER_HOST, pool_block_ptr(&mm->pool, s->blocks[bi]),
                          (enum kvd_tier)b->tier, mm->block_bytes))
            return mm_fail(mm, KVD_EINTERNAL, "reading block %zu failed", bi);
        mm_xfer(mm, mm->staging, out, n, start, bi, t0, t1 - t0, false);
    }
    return 0;
}

/* ---- commit ------------------------------------------------------------- */

/* Shares full committed block b of s through the tree: it becomes a child of
 * block b-1's node, or s switches to an identical cached block. false when
 * the block cannot be shared (then neither can the ones after it). */
static bool mm_seq_share(struct kvmm *mm, struct seq *s, size_t b)
{
    uint32_t bt = mm->geom.block_tokens, id = s->blocks[b];
    const uint32_t *toks = s->tokens + b * bt;
    struct radix_node *parent, *existing, *node;
    struct pool_block *pb = pool_block(&mm->pool, id);

    parent = b == 0 ? radix_root(&mm->radix, s->ns) : pool_block(&mm->pool, s->blocks[b - 1])->node;
    if (!parent || parent->ns != s->ns)
        return false;
    if (pb->node) {
        if (pb->node->parent == parent &&
            memcmp(pb->node->tokens, toks, sizeof(uint32_t) * bt) == 0)
            return true;
        /* The tree's copy of other tokens (commit after truncate): the
         * sequence takes a private copy before it can share under new ids. */
        if (mm_seq_swap_in(mm, s, b, b + 1) || mm_seq_cow(mm, s, b, b + 1))
            return false;
        id = s->blocks[b];
        pb = pool_block(&mm->pool, id);
    }
    existing = radix_child(&mm->radix, parent, toks, radix_hash(&mm->radix, parent->hash, toks));
    if (existing) {
        uint32_t eid = existing->block;
        size_t bad = SIZE_MAX;
        mm_ref(mm, eid); /* pinned: making room cannot drop it */
        if (pool_block(&mm->pool, eid)->tier == KVD_TIER_HOST) {
            int err = mm_room_move(mm, KVD_TIER_DEVICE, &eid, 1, s->tenant);
            if (!err)
                err = mm_move(mm, &eid, 1, KVD_TIER_DEVICE, &bad);
            if (err == KVD_EINTERNAL && bad == 0) {
                mm->ctr.checksum_failures++;
                pool_block(&mm->pool, eid)->disk = POOL_DISK_NEVER;
                mm_drop_subtree(mm, existing);
                existing = NULL;
            } else if (err) {
                mm_unref(mm, eid);
                return false;
            }
        }
        if (existing) {
            struct pool_block *eb = pool_block(&mm->pool, eid);
            s->blocks[b] = eid;
            eb->lru = ++mm->clock;
            eb->hits += eb->hits != UINT32_MAX; /* a reuse: counts for eviction */
            mm_unref(mm, id);
            mm_remote_used(mm, existing, b);
            return true;
        }
        mm_unref(mm, eid);
    }
    if (radix_insert(&mm->radix, parent, toks, id, &node))
        return false;
    pb->lru = ++mm->clock;
    mm_keyed(mm, node);
    if (mm->events.block) {
        mm_pub_set(mm, node);
        mm_ev_stored(mm, node, mm_tier_medium(pb->tier));
    }
    mm_remote_used(mm, node, b);
    return true;
}

int kvmm_seq_commit(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, const uint32_t *tokens,
                    size_t n, size_t *shared)
{
    MM_ASSERT_LOCKED(mm);
    size_t bt = mm->geom.block_tokens, first, last, k = 0;

    SEQ_GET(s);
    if (n > s->n_tokens - s->n_committed)
        return mm_fail(mm, KVD_EBADREQ,
                       "commit of %zu token ids: only %zu slots are uncommitted (extend first)", n,
                       s->n_tokens - s->n_committed);
    if (n && !tokens)
        return mm_fail(mm, KVD_EBADREQ, "commit: no tokens given");
    if (seq_reserve_tokens(s, s->n_committed + n))
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    if (n)
        memcpy(s->tokens + s->n_committed, tokens, sizeof(uint32_t) * n);
    first = s->n_committed / bt;
    s->n_committed += n;
    last = s->n_committed / bt;
    /* Sharing is best effort: the ids are committed either way. */
    size_t b_end = first;
    for (; b_end < last; b_end++)
        if (!mm_seq_share(mm, s, b_end))
            break;
    if (b_end > first)
        mm_remote_chain_end(mm, pool_block(&mm->pool, s->blocks[b_end - 1])->node, b_end - 1);
    for (size_t b = 0; b < s->n_blocks; b++)
        k += pool_block(&mm->pool, s->blocks[b])->node != NULL;
    if (shared)
        *shared = k;
    return 0;
}

/* ---- fork, offload, restore --------------------------------------------- */

int kvmm_seq_fork(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner,
                  kvmm_seq_t *child)
{
    MM_ASSERT_LOCKED(mm);
    struct tenant *t;
    struct seq *c;
    int err;

    SEQ_GET(s);
    t = &mm->tt.v[s->tenant];
    if (t->conf.max_seqs != KVMM_UNLIMITED && t->seqs >= t->conf.max_seqs)
        return mm_fail(mm, KVD_EQUOTA, "tenant '%s': sequence quota %u reached", t->conf.name,
                       t->conf.max_seqs);
    err = seq_table_add(&mm->st, new_owner, child, &c);
    if (err)
        return mm_fail(mm, err, "out of memory forking a sequence");
    if (seq_reserve_blocks(c, s->n_blocks) || seq_reserve_tokens(c, s->n_committed)) {
        seq_table_del(&mm->st, c);
        return mm_fail(mm, KVD_ENOMEM, "out of memory forking a sequence");
    }
    c->tenant = s->tenant;
    c->ns = s->ns;
    c->n_tokens = s->n_tokens;
    c->n_committed = s->n_committed;
    c->n_blocks = s->n_blocks;
    if (s->n_blocks)
        memcpy(c->blocks, s->blocks, sizeof(uint32_t) * s->n_blocks);
    if (s->n_committed)
        memcpy(c->tokens, s->tokens, sizeof(uint32_t) * s->n_committed);
    for (size_t i = 0; i < c->n_blocks; i++)
        mm_ref(mm, c->blocks[i]);
    t->seqs++;
    return 0;
}

/* Added by the executor (see kvmm.h): the handle and blocks stay, only the
 * owner that may use them changes. */
int kvmm_seq_set_owner(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    s->owner = new_owner;
    s->lent = false;
    return 0;
}

int kvmm_seq_lend(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, kvmm_owner new_owner,
                  uint64_t tag)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    s->owner = new_owner;
    s->lent = true;
    s->lender = owner;
    s->lend_tag = tag;
    return 0;
}

int kvmm_seq_offload(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq)
{
    MM_ASSERT_LOCKED(mm);
    uint32_t *ids;
    size_t k = 0;
    int err;

    SEQ_GET(s);
    ids = fault_malloc(sizeof *ids * (s->n_blocks + 1));
    if (!ids)
        return mm_fail(mm, KVD_ENOMEM, "out of memory");
    /* Only blocks no other sequence uses: the tree's own reference does not
     * count, a cached block can live on the host. */
    for (size_t i = 0; i < s->n_blocks; i++) {
        const struct pool_block *b = pool_block(&mm->pool, s->blocks[i]);
        if (b->tier == KVD_TIER_DEVICE && b->refcount - (b->node ? 1 : 0) == 1)
            ids[k++] = s->blocks[i];
    }
    err = mm_room_host(mm, ids, k);
    if (!err)
        err = mm_move(mm, ids, k, KVD_TIER_HOST, NULL);
    free(ids);
    return err;
}

int kvmm_seq_restore(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    return mm_seq_swap_in(mm, s, 0, s->n_blocks);
}

/* ---- queries ------------------------------------------------------------ */

int kvmm_seq_info(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, struct kvmm_seq_info *info)
{
    MM_ASSERT_LOCKED(mm);
    SEQ_GET(s);
    memset(info, 0, sizeof *info);
    info->tenant = s->tenant;
    info->ns = s->ns;
    info->n_tokens = s->n_tokens;
    info->n_committed = s->n_committed;
    info->n_blocks = s->n_blocks;
    for (size_t i = 0; i < s->n_blocks; i++) {
        const struct pool_block *b = pool_block(&mm->pool, s->blocks[i]);
        info->n_shared += b->node != NULL;
        info->n_host += b->tier == KVD_TIER_HOST;
    }
    return 0;
}

int kvmm_seq_blocks(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t *ids,
                    enum kvd_tier *tiers, size_t cap, size_t *n)
{
    MM_ASSERT_LOCKED(mm);
    size_t k;

    SEQ_GET(s);
    k = s->n_blocks < cap ? s->n_blocks : cap;
    for (size_t i = 0; i < k; i++) {
        if (ids)
            ids[i] = s->blocks[i];
        if (tiers)
            tiers[i] = (enum kvd_tier)pool_block(&mm->pool, s->blocks[i])->tier;
    }
    *n = k;
    return 0;
}

const uint32_t *kvmm_seq_tokens(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, size_t *n)
{
    MM_ASSERT_LOCKED(mm);
    struct seq *s = mm_seq(mm, owner, seq, NULL);

    *n = s ? s->n_committed : 0;
    return s ? s->tokens : NULL;
}

int kvmm_seq_device_slots(struct kvmm *mm, kvmm_owner owner, kvmm_seq_t seq, uint32_t *slots,
                          size_t cap, size_t *n)
{
    MM_ASSERT_LOCKED(mm);
    size_t k;

    SEQ_GET(s);
    k = s->n_blocks < cap ? s->n_blocks : cap;
    for (size_t i = 0; i < k; i++) {
        const struct pool_block *b = pool_block(&mm->pool, s->blocks[i]);
        slots[i] = b->tier == KVD_TIER_DEVICE ? b->slot : POOL_NONE;
    }
    *n = k;
    return 0;
}

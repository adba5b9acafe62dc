/* kvmm_remote_fetch: the remote tier's lookups (kvmm_remote_prefetch), on a prefetch worker
 * before the request is scheduled. The values a prompt may find are asked for in chain order,
 * in GET rounds of at most ROUND_BYTES of values: a 4096-token prompt of a 1B-class model is
 * 128 MiB, which one round could not bring within remote-timeout-ms and Redis would buffer
 * whole, and several values of megabytes pipelined in one round cost redis-server ~10x the CPU
 * per byte of one at a time (docs/performance.md "Restore GB/s against redis-benchmark"). Each
 * value is opened (authenticated, decrypted), checked against the prompt
 * and restored, and the first missing or bad one ends the chain, so a round is only sent
 * while the chain goes on. */
#include <stdlib.h>
#include <string.h>

#include "kvmm_remote_impl.h"
#include "log.h"

/* One prefetch: the prompt, the keys of its chain, the values asked for (ends[i]: the chain
 * index of value i's last block; groups first, then the tails), and where the restore
 * stands (at: the blocks before it are in the tree). */
struct pf {
    struct kvmm *mm;
    struct kvmm_remote *r;
    uint32_t tenant, ns, bt;
    const uint32_t *tokens;
    struct radix_node **scratch; /* (nb) */
    struct blockkey *chain;      /* (nb) chain(b) of every whole block */
    struct blockkey root;
    struct redisconn_buf *keys, *vals; /* (max_keys) */
    uint8_t (*rkeys)[REMOTE_KEY_BYTES];
    uint32_t *ends;
    struct mm_restoring *rs; /* (K) one value's blocks at most */
    struct remote_value_meta want;
    size_t nk, n_groups, at, restored;
    bool going;
};

/* Value i's blocks from p->at to its end enter the tree: their final blocks taken under the
 * lock, their bytes copied in with it released, then entered in order (as a disk restore's
 * window does, kvmm_restore.c): no K/V copy under the kvmm lock. */
static void pf_restore_value(struct pf *p, size_t i, const struct remote_value_view *v)
{
    struct kvmm *mm = p->mm;
    size_t first_b = p->at, n_b = p->ends[i] + 1 - p->at, got = 0, filled = 0;
    kvmm_lock(mm);
    if (tenant_live(&mm->tt, p->tenant))
        while (got < n_b && mm_restore_take(mm, p->tenant, p->ns, false, &p->rs[got]))
            got++;
    kvmm_unlock(mm);
    MM_ASSERT_UNLOCKED(mm);
    while (filled < got && mm_restore_fill(mm, &p->rs[filled],
                                           (const char *)v->data +
                                               (first_b + filled - v->m.first) * mm->block_bytes))
        filled++;
    kvmm_lock(mm);
    for (size_t k = 0; k < got; k++) {
        size_t b = first_b + k;
        const uint32_t *toks = p->tokens + b * p->bt;
        /* The namespace may have been removed, and its id reused, meanwhile. */
        struct radix_node *parent = p->going && k < filled && mm_ns_ok(mm, p->ns) &&
                                            strcmp(mm->tt.ns_names[p->ns], p->want.ns_name) == 0
                                        ? mm_parent_of(mm, p->ns, p->tokens, b, p->scratch)
                                        : NULL;
        p->going = parent != NULL;
        if (p->going &&
            !radix_child(&mm->radix, parent, toks, radix_hash(&mm->radix, parent->hash, toks))) {
            p->going = mm_restore_enter(mm, &p->rs[k], parent, toks, p->chain[b], false);
            if (p->going) {
                p->restored++;
                atomic_fetch_add(&p->r->hits, 1);
            }
        } else {
            mm_restore_drop(mm, &p->rs[k]); /* not wanted (any more), or already there */
        }
        if (p->going)
            p->at = b + 1;
    }
    if (got < n_b)
        p->going = false;
    kvmm_unlock(mm);
}

/* The values [s0, s0 + cnt) of a round, in chain order: each restores the blocks from the
 * tree's end to its own end, and the first missing or bad one ends it. */
static void pf_round(struct pf *p, size_t s0, size_t cnt)
{
    struct kvmm_remote *r = p->r;
    for (size_t i = s0; i < s0 + cnt; i++) {
        atomic_fetch_add(&r->bytes_in, p->vals[i].n);
        if (!p->going || p->ends[i] < p->at)
            continue; /* stopped, or a shorter tail after a longer one */
        if (!p->vals[i].p) {
            atomic_fetch_add(&r->misses, 1);
            kvmm_lock(p->mm);
            mm_remote_ann_lost(p->mm, p->want.ns_hash, p->chain[p->ends[i]]);
            kvmm_unlock(p->mm);
            p->going = i >= p->n_groups; /* a missing tail: the next may be there */
            continue;
        }
        struct remote_value_view v;
        enum remote_value_status st =
            remote_value_open(&r->key, p->rkeys[i], (void *)p->vals[i].p, p->vals[i].n, &v);
        if (st == REMOTE_VALUE_OK)
            st = remote_value_check(&v, &p->want, p->ends[i], p->tokens, p->chain, p->root);
        if (st == REMOTE_VALUE_OK && v.m.first > p->at)
            st = REMOTE_VALUE_MISMATCH; /* a gap: it does not reach back to the tree */
        if (st != REMOTE_VALUE_OK) {
            atomic_fetch_add(st == REMOTE_VALUE_MISMATCH ? &r->mismatches : &r->auth_failures, 1);
            kvmm_lock(p->mm);
            mm_remote_ann_lost(p->mm, p->want.ns_hash, p->chain[p->ends[i]]);
            kvmm_unlock(p->mm);
            p->going = i >= p->n_groups;
            continue;
        }
        pf_restore_value(p, i, &v);
    }
}

static size_t round_count(const struct pf *p, size_t round)
{
    size_t s0 = round * p->r->round_keys;
    return p->nk - s0 < p->r->round_keys ? p->nk - s0 : p->r->round_keys;
}

/* Whether the chain already reaches past every value of round `round` (a shorter tail after a
 * longer one restored): then it is not asked for. */
static bool round_needed(const struct pf *p, size_t round)
{
    size_t s0 = round * p->r->round_keys;
    for (size_t i = s0; i < s0 + round_count(p, round); i++)
        if (p->ends[i] >= p->at)
            return true;
    return false;
}

/* Round `round` on connection c: its values land in vals (and in c's buffer, until c's next
 * call). 0 or -1 (logged; giving the connection back makes the tier rest). */
static int round_get(struct pf *p, struct rconn *c, size_t round)
{
    struct kvmm_remote *r = p->r;
    size_t s0 = round * r->round_keys;
    struct kvd_error e = {0};
    uint64_t t0 = mm_remote_now_ns();
    int rc = redisconn_get(c->rc, round_count(p, round), p->keys + s0, p->vals + s0, &e);
    uint64_t dt = mm_remote_now_ns() - t0;
    atomic_fetch_add(&r->rounds, 1);
    atomic_fetch_add(&r->lat_sum, dt);
    atomic_store(&r->lat_last, dt);
    if (rc != 0)
        log_msg(LOG_LVL_DEBUG, "remote tier: lookup: %s", e.message);
    return rc;
}

bool kvmm_remote_may_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                              size_t n)
{
    size_t nb = n / mm->geom.block_tokens;
    if (!mm->remote || nb == 0)
        return false;
    struct radix_node **scratch = malloc(sizeof *scratch * nb);
    if (!scratch)
        return false;
    struct blockkey key;
    kvmm_lock(mm);
    bool ok = mm_ns_ok(mm, ns) && mm_remote_tenant_on(mm, tenant) &&
              mm_cached_prefix(mm, ns, tokens, nb, scratch, &key) < nb;
    kvmm_unlock(mm);
    free(scratch);
    return ok;
}

size_t kvmm_remote_prefetch(struct kvmm *mm, uint32_t tenant, uint32_t ns, const uint32_t *tokens,
                            size_t n)
{
    struct kvmm_remote *r = mm->remote;
    uint32_t bt = mm->geom.block_tokens;
    size_t nb = n / bt, m = 0;
    if (!r || nb == 0 || nb > UINT32_MAX)
        return 0;
    uint32_t K = r->k;
    size_t max_keys = nb / K + 3;
    struct blockkey key;
    struct pf p = {.mm = mm,
                   .r = r,
                   .tenant = tenant,
                   .ns = ns,
                   .bt = bt,
                   .tokens = tokens,
                   .scratch = malloc(sizeof *p.scratch * nb),
                   .chain = malloc(sizeof *p.chain * nb),
                   .keys = calloc(max_keys, sizeof *p.keys),
                   .vals = calloc(max_keys, sizeof *p.vals),
                   .rkeys = malloc(REMOTE_KEY_BYTES * max_keys),
                   .ends = malloc(sizeof *p.ends * max_keys),
                   .rs = malloc(sizeof *p.rs * K),
                   .want = {.block_tokens = bt, .block_bytes = mm->block_bytes}};
    bool ok = p.scratch && p.chain && p.keys && p.vals && p.rkeys && p.ends && p.rs;
    if (ok) {
        kvmm_lock(mm);
        ok = mm_ns_ok(mm, ns) && mm_remote_tenant_on(mm, tenant);
        if (ok) {
            m = mm_cached_prefix(mm, ns, tokens, nb, p.scratch, &key);
            snprintf(p.want.ns_name, sizeof p.want.ns_name, "%s", mm->tt.ns_names[ns]);
            p.root = mm->root_key;
        }
        kvmm_unlock(mm);
        ok = ok && m < nb && !mm_remote_resting(r);
    }
    if (ok) {
        p.want.ns_hash = blockkey_ns(p.want.ns_name);
        struct blockkey c = p.root;
        for (size_t b = 0; b < nb; b++)
            c = p.chain[b] = blockkey_next(c, tokens + b * bt, bt);
        for (size_t g = m / K; (g + 1) * K <= nb; g++)
            p.ends[p.nk++] = (uint32_t)((g + 1) * K - 1);
        p.n_groups = p.nk;
        /* Tails: the prompt's last whole block, or the one before (where a match of every
         * token but the last ended), longest first. */
        for (size_t d = 1; d <= 2 && d <= nb; d++)
            if (nb - d >= m && (nb - d) % K != K - 1)
                p.ends[p.nk++] = (uint32_t)(nb - d);
        for (size_t i = 0; i < p.nk; i++) {
            remote_value_key(p.want.ns_hash, p.chain[p.ends[i]], p.rkeys[i]);
            p.keys[i] = (struct redisconn_buf){p.rkeys[i], REMOTE_KEY_BYTES};
        }
    }
    /* The values live in the connection's buffer: it goes back to the pool once the last
     * round's values are restored. */
    struct rconn *c = ok && p.nk ? mm_remote_conn_take(r) : NULL;
    int rc = 0;
    p.at = m;
    p.going = c != NULL;
    size_t n_rounds = (p.nk + r->round_keys - 1) / r->round_keys;
    for (size_t round = 0; c && p.going && round < n_rounds; round++) {
        if (!round_needed(&p, round))
            continue;
        if ((rc = round_get(&p, c, round)) != 0)
            break;
        pf_round(&p, round * r->round_keys, round_count(&p, round));
    }
    if (c)
        mm_remote_conn_give(r, c, rc);
    free(p.scratch);
    free(p.chain);
    free(p.keys);
    free(p.vals);
    free(p.rkeys);
    free(p.ends);
    free(p.rs);
    return p.restored;
}

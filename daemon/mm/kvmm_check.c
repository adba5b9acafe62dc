/* kvmm_check: the invariant checker. Recounts every reference and every
 * tenant's usage from the primary structures (sequences, tree, pool) and
 * compares them with the stored counters. Tests run it after every
 * operation; the daemon can run it on demand. O(blocks + nodes + seqs). */
#include <stdlib.h>
#include <string.h>

#include "kvmm_impl.h"

struct check_ctx {
    struct kvmm *mm;
    uint32_t *refs; /* (n_ids) references found */
};

static int check_count_node(struct radix_node *n, void *arg)
{
    struct check_ctx *c = arg;

    c->refs[n->block]++;
    if (n->ns >= c->mm->tt.n_ns) {
        mm_fail(c->mm, KVD_EINTERNAL, "check: node of block %u is in unknown namespace %u",
                n->block, n->ns);
        return 1;
    }
    return 0;
}

int kvmm_check(struct kvmm *mm)
{
    MM_ASSERT_LOCKED(mm);
    struct pool *p = &mm->pool;
    struct check_ctx c = {.mm = mm};
    uint32_t *dev = NULL, *host = NULL, *seqs = NULL, n_open = 0;
    int err = KVD_EINTERNAL;

    if ((err = pool_check(p, mm->err, sizeof mm->err)))
        return err;
    if ((err = radix_check(&mm->radix, mm->err, sizeof mm->err)))
        return err;
    if (mm->radix.n_roots != mm->tt.n_ns)
        return mm_fail(mm, KVD_EINTERNAL, "check: %u tree roots for %u namespaces",
                       mm->radix.n_roots, mm->tt.n_ns);
    c.refs = calloc(p->n_ids + 1, sizeof *c.refs);
    dev = calloc(mm->tt.n + 1, sizeof *dev);
    host = calloc(mm->tt.n + 1, sizeof *host);
    seqs = calloc(mm->tt.n + 1, sizeof *seqs);
    if (!c.refs || !dev || !host || !seqs) {
        err = mm_fail(mm, KVD_ENOMEM, "check: out of memory");
        goto out;
    }
    err = KVD_EINTERNAL;
    for (uint32_t i = 0; i < mm->st.n; i++) {
        const struct seq *s = mm->st.v[i];
        if (!(s->gen & 1))
            continue;
        n_open++;
        if (s->tenant >= mm->tt.n || s->ns >= mm->tt.n_ns) {
            mm_fail(mm, err, "check: sequence %u has unknown tenant %u or namespace %u", i,
                    s->tenant, s->ns);
            goto out;
        }
        seqs[s->tenant]++;
        if (s->n_blocks != (s->n_tokens + mm->geom.block_tokens - 1) / mm->geom.block_tokens ||
            s->n_committed > s->n_tokens || s->n_blocks > s->cap_blocks) {
            mm_fail(mm, err, "check: sequence %u holds %zu blocks for %zu tokens (%zu committed)",
                    i, s->n_blocks, s->n_tokens, s->n_committed);
            goto out;
        }
        for (size_t b = 0; b < s->n_blocks; b++) {
            uint32_t id = s->blocks[b];
            if (id >= p->n_ids || !p->blocks[id].used) {
                mm_fail(mm, err, "check: sequence %u block %zu is id %u, which is free", i, b, id);
                goto out;
            }
            c.refs[id]++;
        }
    }
    if (n_open != mm->st.n_open) {
        mm_fail(mm, err, "check: %u open sequences, count says %u", n_open, mm->st.n_open);
        goto out;
    }
    if (radix_foreach(&mm->radix, check_count_node, &c))
        goto out;
    for (uint32_t i = 0; i < p->n_ids; i++) {
        const struct pool_block *b = &p->blocks[i];
        if (!b->used) {
            if (c.refs[i]) {
                mm_fail(mm, err, "check: free block %u is referenced %u times", i, c.refs[i]);
                goto out;
            }
            continue;
        }
        if (b->restoring) /* the restore filling it holds its reference */
            c.refs[i]++;
        if (b->refcount != c.refs[i]) {
            mm_fail(mm, err, "check: block %u has refcount %u but %u references exist", i,
                    b->refcount, c.refs[i]);
            goto out;
        }
        if (b->tenant >= mm->tt.n) {
            mm_fail(mm, err, "check: block %u is owned by unknown tenant %u", i, b->tenant);
            goto out;
        }
        if (b->tier == KVD_TIER_DEVICE)
            dev[b->tenant]++;
        else
            host[b->tenant]++;
    }
    for (uint32_t t = 0; t < mm->tt.n; t++) {
        const struct tenant *tn = &mm->tt.v[t];
        if (tn->dev_blocks != dev[t] || tn->host_blocks != host[t] || tn->seqs != seqs[t]) {
            mm_fail(mm, err,
                    "check: tenant '%s' counts %u device / %u host blocks / %u seqs, owns "
                    "%u / %u / %u",
                    tn->conf.name, tn->dev_blocks, tn->host_blocks, tn->seqs, dev[t], host[t],
                    seqs[t]);
            goto out;
        }
        if (tenant_live(&mm->tt, t) && tn->ns >= mm->tt.n_ns) { /* a free slot has none */
            mm_fail(mm, err, "check: tenant '%s' has no namespace", tn->conf.name);
            goto out;
        }
    }
    err = 0;
out:
    free(c.refs);
    free(dev);
    free(host);
    free(seqs);
    return err;
}

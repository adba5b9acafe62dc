/* Randomized test of kvmm against a model of the expected state. Thousands of
 * random operations (open, match, extend, write, overwrite through COW,
 * commit, fork, truncate, offload/restore, evict, corrupt a cached host
 * block, close) under tight quotas, floors and a small pool, so exhaustion
 * and quota refusals happen all the time. The model keeps, per sequence, the
 * planned token ids and a content key per token slot; K/V content for a
 * committed-and-shared position is a function of its token prefix, so any
 * block served from the cache can be checked byte for byte. After every
 * step: kvmm_check, and the touched sequence's bytes, tokens and sizes. */
#include "mm_fixture.h"
#include "kvmm_impl.h"

#define PLAN 64   /* token slots per model sequence */
#define MAXSEQ 12 /* model sequence slots */
#define N_TENANTS 3

struct mseq {
    bool open;
    kvmm_seq_t h;
    uint32_t tenant, ns;
    size_t n_tokens, n_committed;
    uint32_t plan[PLAN];
    uint64_t keys[PLAN]; /* content key of every slot of the sequence's blocks */
};

struct world {
    struct fx f;
    uint64_t rng;
    uint32_t tenants[N_TENANTS], ns_own[N_TENANTS], ns_shared;
    struct kvmm_tenant_conf conf[N_TENANTS];
    uint32_t base[4][40]; /* prompts many sequences start with */
    struct mseq s[MAXSEQ];
    unsigned char buf[PLAN * 256];
    uint64_t ops, refusals, matched_tokens, corruptions;
};

static uint32_t rnd(struct world *w, uint32_t n)
{
    w->rng = w->rng * 6364136223846793005ull + 1442695040888963407ull;
    return n ? (uint32_t)((w->rng >> 33) % n) : 0;
}

/* The K/V every correct producer writes at position p: a function of the
 * token prefix plan[0..p], so equal prefixes give equal blocks. */
static uint64_t canon(const struct mseq *m, size_t p)
{
    uint64_t h = 0x1234567;
    for (size_t i = 0; i <= p; i++)
        h = fx_mix(h ^ (m->plan[i] + 0x9e37ull * i));
    return h | 1;
}

static void verify(struct world *w, struct mseq *m)
{
    struct kvmm_seq_info in;
    size_t n;
    const uint32_t *tok;

    assert_int_equal(kvmm_seq_info(w->f.mm, 1, m->h, &in), 0);
    assert_int_equal(in.n_tokens, m->n_tokens);
    assert_int_equal(in.n_committed, m->n_committed);
    assert_int_equal(in.n_blocks, (m->n_tokens + FX_BT - 1) / FX_BT);
    tok = kvmm_seq_tokens(w->f.mm, 1, m->h, &n);
    assert_int_equal(n, m->n_committed);
    if (n)
        assert_memory_equal(tok, m->plan, n * sizeof *tok);
    if (m->n_tokens == 0)
        return;
    if (kvmm_seq_read(w->f.mm, 1, m->h, 0, m->n_tokens, w->buf, m->n_tokens * w->f.tb))
        fail_msg("read: %s", kvmm_errmsg(w->f.mm));
    size_t d = fx_diff(&w->f, w->buf, m->keys, m->n_tokens);
    if (d != m->n_tokens)
        fail_msg("seq token %zu of %zu holds wrong bytes (op %llu)", d, m->n_tokens,
                 (unsigned long long)w->ops);
}

static void new_plan(struct world *w, struct mseq *m, size_t from)
{
    const uint32_t *base = w->base[rnd(w, 3)];
    size_t shared = 8 + rnd(w, 33);
    for (size_t i = from; i < PLAN; i++)
        m->plan[i] = i < shared ? base[i] : rnd(w, 3);
}

static struct mseq *pick(struct world *w)
{
    uint32_t start = rnd(w, MAXSEQ);
    for (uint32_t k = 0; k < MAXSEQ; k++) {
        struct mseq *m = &w->s[(start + k) % MAXSEQ];
        if (m->open)
            return m;
    }
    return NULL;
}

static struct mseq *free_slot(struct world *w)
{
    for (int k = 0; k < MAXSEQ; k++)
        if (!w->s[k].open)
            return &w->s[k];
    return NULL;
}

static bool refusal(int rc)
{
    return rc == KVD_ENOMEM || rc == KVD_EQUOTA;
}

static void op_match(struct world *w, struct mseq *m);

static void op_open(struct world *w)
{
    struct mseq *m = free_slot(w);
    uint32_t t = rnd(w, N_TENANTS), ns = rnd(w, 2) ? w->ns_shared : w->ns_own[t];
    struct kvmm_tenant_stats ts;
    kvmm_seq_t h;
    int rc;

    if (!m)
        return;
    assert_int_equal(kvmm_tenant_stats(w->f.mm, w->tenants[t], &ts), 0);
    rc = kvmm_seq_open(w->f.mm, 1, w->tenants[t], ns, &h);
    if (ts.seqs >= w->conf[t].max_seqs) {
        assert_int_equal(rc, KVD_EQUOTA);
        w->refusals++;
        return;
    }
    assert_int_equal(rc, 0);
    memset(m, 0, sizeof *m);
    m->open = true;
    m->h = h;
    m->tenant = t;
    m->ns = ns;
    new_plan(w, m, 0);
    if (rnd(w, 3)) /* most users look for a cached prefix first */
        op_match(w, m);
}

static void op_match(struct world *w, struct mseq *m)
{
    size_t n = rnd(w, PLAN + 1), got;
    int rc;

    if (m->n_tokens)
        return;
    rc = kvmm_seq_match(w->f.mm, 1, m->h, m->plan, n, &got);
    if (rc)
        fail_msg("match: %s", kvmm_errmsg(w->f.mm));
    assert_true(got <= n && got % FX_BT == 0);
    m->n_tokens = m->n_committed = got;
    for (size_t p = 0; p < got; p++)
        m->keys[p] = canon(m, p);
    w->matched_tokens += got;
}

static void op_extend(struct world *w, struct mseq *m)
{
    size_t k = 1 + rnd(w, 16);
    int rc;

    if (m->n_tokens + k > PLAN)
        return;
    rc = kvmm_seq_extend(w->f.mm, 1, m->h, k);
    if (refusal(rc)) {
        w->refusals++;
        return;
    }
    assert_int_equal(rc, 0);
    m->n_tokens += k; /* slots of new blocks hold key 0 already */
}

static void op_write(struct world *w, struct mseq *m, bool garbage)
{
    size_t lo = garbage ? 0 : m->n_committed, start, n;
    uint64_t keys[PLAN];
    int rc;

    if (m->n_tokens <= lo)
        return;
    start = lo + rnd(w, (uint32_t)(m->n_tokens - lo));
    n = 1 + rnd(w, (uint32_t)(m->n_tokens - start));
    for (size_t i = 0; i < n; i++)
        keys[i] = garbage ? ((uint64_t)rnd(w, 1u << 30) << 1 | 1) : canon(m, start + i);
    fx_fill(&w->f, w->buf, keys, n);
    rc = kvmm_seq_write(w->f.mm, 1, m->h, start, n, w->buf, n * w->f.tb);
    if (refusal(rc)) {
        w->refusals++;
        return;
    }
    if (rc)
        fail_msg("write: %s", kvmm_errmsg(w->f.mm));
    memcpy(m->keys + start, keys, n * sizeof *keys);
}

static void op_commit(struct world *w, struct mseq *m)
{
    size_t from = m->n_committed / FX_BT * FX_BT, k = 0, shared, c;

    /* Commit only positions whose bytes are what their prefix dictates, and
     * only when the whole block they complete is, so the tree only ever
     * holds canonical blocks (the model's rule, not kvmm's). */
    for (size_t p = from; p < m->n_tokens && m->keys[p] == canon(m, p); p++)
        if (p >= m->n_committed)
            k++;
    for (size_t p = from; p < m->n_committed; p++)
        if (m->keys[p] != canon(m, p))
            return;
    if (k == 0)
        return;
    c = 1 + rnd(w, (uint32_t)k);
    assert_int_equal(kvmm_seq_commit(w->f.mm, 1, m->h, m->plan + m->n_committed, c, &shared), 0);
    m->n_committed += c;
    /* Not bounded by n_committed: a fork sibling's commit can put blocks
     * both share into the tree before this one commits them. */
    assert_true(shared <= (m->n_tokens + FX_BT - 1) / FX_BT);
}

/* What a real producer does: grow, write the canonical K/V, commit it. */
static void op_produce(struct world *w, struct mseq *m)
{
    size_t k = 1 + rnd(w, 16), shared;
    uint64_t keys[PLAN];
    int rc;

    if (m->n_committed != m->n_tokens || m->n_tokens + k > PLAN)
        return;
    rc = kvmm_seq_extend(w->f.mm, 1, m->h, k);
    if (refusal(rc)) {
        w->refusals++;
        return;
    }
    assert_int_equal(rc, 0);
    m->n_tokens += k;
    for (size_t i = 0; i < k; i++)
        keys[i] = canon(m, m->n_committed + i);
    fx_fill(&w->f, w->buf, keys, k);
    rc = kvmm_seq_write(w->f.mm, 1, m->h, m->n_committed, k, w->buf, k * w->f.tb);
    if (refusal(rc)) {
        w->refusals++;
        return;
    }
    assert_int_equal(rc, 0);
    memcpy(m->keys + m->n_committed, keys, k * sizeof *keys);
    for (size_t p = m->n_committed / FX_BT * FX_BT; p < m->n_committed; p++)
        if (m->keys[p] != canon(m, p))
            return; /* an overwritten block: not committed (see op_commit) */
    assert_int_equal(kvmm_seq_commit(w->f.mm, 1, m->h, m->plan + m->n_committed, k, &shared), 0);
    m->n_committed += k;
}

static void op_fork(struct world *w, struct mseq *m)
{
    struct mseq *c = free_slot(w);
    kvmm_seq_t h;
    int rc;

    if (!c)
        return;
    rc = kvmm_seq_fork(w->f.mm, 1, m->h, 1, &h);
    if (rc == KVD_EQUOTA) {
        w->refusals++;
        return;
    }
    assert_int_equal(rc, 0);
    *c = *m;
    c->h = h;
}

static void op_truncate(struct world *w, struct mseq *m)
{
    size_t k = rnd(w, (uint32_t)m->n_tokens + 1), keep;

    assert_int_equal(kvmm_seq_truncate(w->f.mm, 1, m->h, k), 0);
    m->n_tokens -= k;
    if (m->n_committed > m->n_tokens)
        m->n_committed = m->n_tokens;
    keep = (m->n_tokens + FX_BT - 1) / FX_BT * FX_BT;
    for (size_t p = keep; p < PLAN; p++)
        m->keys[p] = 0; /* dropped blocks: new ones come zeroed */
    if (rnd(w, 2))      /* later tokens may now differ from before */
        new_plan(w, m, m->n_tokens);
}

/* Flips a bit in a random cached (tree-only) host block. */
static void op_corrupt(struct world *w)
{
    struct kvmm *mm = w->f.mm;
    uint32_t n = mm->pool.n_ids, start = rnd(w, n);

    for (uint32_t k = 0; k < n; k++) {
        struct pool_block *b = &mm->pool.blocks[(start + k) % n];
        if (b->used && b->node && b->refcount == 1 && b->tier == KVD_TIER_HOST) {
            unsigned char *p = pool_block_ptr(&mm->pool, (start + k) % n);
            p[rnd(w, (uint32_t)mm->block_bytes)] ^= (unsigned char)(1u << rnd(w, 8));
            w->corruptions++;
            return;
        }
    }
}

static void step(struct world *w)
{
    struct mseq *m = pick(w);
    uint32_t op = rnd(w, 100);
    int rc;

    w->ops++;
    if (!m || op < 8) {
        op_open(w);
    } else if (op < 18) {
        op_match(w, m);
    } else if (op < 24) {
        op_extend(w, m);
    } else if (op < 33) {
        op_produce(w, m);
    } else if (op < 48) {
        op_write(w, m, false);
    } else if (op < 53) {
        op_write(w, m, true);
    } else if (op < 66) {
        op_commit(w, m);
    } else if (op < 71) {
        op_fork(w, m);
    } else if (op < 75) {
        op_truncate(w, m);
    } else if (op < 80) {
        rc = kvmm_seq_offload(w->f.mm, 1, m->h);
        if (refusal(rc))
            w->refusals++;
        else
            assert_int_equal(rc, 0);
    } else if (op < 84) {
        rc = kvmm_seq_restore(w->f.mm, 1, m->h);
        if (refusal(rc))
            w->refusals++;
        else
            assert_int_equal(rc, 0);
    } else if (op < 88) {
        size_t ev;
        assert_int_equal(
            kvmm_evict(w->f.mm, rnd(w, 2) ? KVD_TIER_DEVICE : KVD_TIER_HOST, rnd(w, 6), &ev), 0);
    } else if (op < 90) {
        op_corrupt(w);
    } else if (op < 96) {
        assert_int_equal(kvmm_seq_close(w->f.mm, 1, m->h), 0);
        assert_int_equal(kvmm_seq_close(w->f.mm, 1, m->h), KVD_ENOTFOUND);
        m->open = false;
        m = NULL;
    } else {
        size_t n = rnd(w, 4);
        /* prepare_write is what the executor calls: COW + restore of a range. */
        if (m->n_tokens) {
            size_t start = rnd(w, (uint32_t)m->n_tokens);
            n = 1 + rnd(w, (uint32_t)(m->n_tokens - start));
            rc = kvmm_seq_prepare_write(w->f.mm, 1, m->h, start, n);
            if (refusal(rc))
                w->refusals++;
            else
                assert_int_equal(rc, 0);
        }
    }
    if (kvmm_check(w->f.mm))
        fail_msg("op %llu: kvmm_check: %s", (unsigned long long)w->ops, kvmm_errmsg(w->f.mm));
    if (m && m->open)
        verify(w, m);
    if (w->ops % 64 == 0)
        for (int k = 0; k < MAXSEQ; k++)
            if (w->s[k].open)
                verify(w, &w->s[k]);
}

/* The run's world, in CMocka setup/teardown (*state holds the current
 * one): freed also after a failed assert. */
static void world_free(struct world *w)
{
    if (w)
        fx_close(&w->f);
    free(w);
}

static int world_setup(void **state)
{
    *state = calloc(1, sizeof(struct world *));
    return *state ? 0 : -1;
}

static int world_teardown(void **state)
{
    struct world **cur = *state;
    if (cur)
        world_free(*cur);
    free(cur);
    return 0;
}

static void run_one(struct world **cur, uint64_t seed, uint32_t n_ops, uint64_t *totals)
{
    struct world *w = *cur = calloc(1, sizeof *w);
    static const char *names[N_TENANTS] = {"alpha", "beta", "gamma"};
    assert_non_null(w);

    w->rng = seed * 0x9E3779B97F4A7C15ull + 1;
    fx_open(&w->f, 48, 24);
    for (int t = 0; t < N_TENANTS; t++) {
        w->conf[t] = fx_tenant(names[t]);
        assert_int_equal(kvmm_tenant_set(w->f.mm, &w->conf[t], &w->tenants[t]), 0);
    }
    w->conf[0].max_device_blocks = 24;
    w->conf[0].max_host_blocks = 12;
    w->conf[0].max_seqs = 5;
    w->conf[0].reserved_device_blocks = 6;
    w->conf[1].max_seqs = 6;
    w->conf[2].max_device_blocks = 16;
    w->conf[2].max_host_blocks = 8;
    w->conf[2].max_seqs = 4;
    w->conf[2].reserved_device_blocks = 10;
    for (int t = 0; t < N_TENANTS; t++) { /* update in place: the reload path */
        uint32_t id;
        assert_int_equal(kvmm_tenant_set(w->f.mm, &w->conf[t], &id), 0);
        assert_int_equal(id, w->tenants[t]);
        assert_int_equal(kvmm_tenant_namespace(w->f.mm, id, &w->ns_own[t]), 0);
    }
    assert_int_equal(kvmm_namespace(w->f.mm, "shared", &w->ns_shared), 0);
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < 40; i++)
            w->base[b][i] = rnd(w, 1000);
    for (uint32_t i = 0; i < n_ops; i++)
        step(w);
    for (int k = 0; k < MAXSEQ; k++)
        if (w->s[k].open)
            verify(w, &w->s[k]);
    kvmm_close_owner(w->f.mm, 1);
    fx_check(&w->f);
    struct kvmm_stats st;
    kvmm_stats(w->f.mm, &st);
    assert_int_equal(st.n_seqs, 0);
    assert_int_equal(st.device_used, 0);
    assert_int_equal(st.host_used, 0);
    totals[0] += w->ops;
    totals[1] += w->refusals;
    totals[2] += w->matched_tokens;
    totals[3] += st.checksum_failures;
    totals[4] += st.cow_copies;
    totals[5] += st.swaps_in + st.swaps_out;
    totals[6] += w->corruptions;
    world_free(w);
    *cur = NULL;
}

static void test_random(void **state)
{
    uint64_t totals[7] = {0};
    const char *env = getenv("KVD_RANDOM_RUNS");
    uint32_t runs = env ? (uint32_t)atoi(env) : 100;

    for (uint32_t seed = 1; seed <= runs; seed++)
        run_one(*state, seed, 800, totals);
    print_message("random: %u runs, %llu ops, %llu refusals, %llu tokens matched, %llu "
                  "cow copies, %llu swaps, %llu corruptions -> %llu checksum failures\n",
                  runs, (unsigned long long)totals[0], (unsigned long long)totals[1],
                  (unsigned long long)totals[2], (unsigned long long)totals[4],
                  (unsigned long long)totals[5], (unsigned long long)totals[6],
                  (unsigned long long)totals[3]);
    /* The run must have exercised what it claims to. */
    assert_true(totals[1] > 0 && totals[2] > 0 && totals[4] > 0 && totals[5] > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_random, world_setup, world_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The eviction policy: hits are counted where a block is reused (a match,
 * a commit that switches to the cached copy); under `hits` a prefix matched
 * often outlives a pool's worth of one-time prefixes that plain `lru` lets
 * push it out, yet still ages out in the end; a heavier tenant keeps more of
 * the pool than a lighter one with the same traffic (under `lru` they keep
 * the same); and a floor still beats weight. kvmm_check runs after every
 * step. Pools have no host tier, so an evicted block is gone. */
#include "mm_fixture.h"
#include "kvmm_impl.h"

#define OWNER 1
#define PB 2 /* blocks per prefix */
#define PT (PB * FX_BT)

static uint32_t add_tenant(struct fx *f, const char *name, uint32_t weight, uint32_t floor)
{
    struct kvmm_tenant_conf c = fx_tenant(name);
    uint32_t id;
    c.weight = weight;
    c.reserved_device_blocks = floor;
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &id), 0);
    return id;
}

static uint32_t own_ns(struct fx *f, uint32_t tenant)
{
    uint32_t ns;
    assert_int_equal(kvmm_tenant_namespace(f->mm, tenant, &ns), 0);
    return ns;
}

/* Token ids of prefix number k (distinct prefixes share no block). */
static void prefix(uint32_t k, uint32_t *tok)
{
    for (uint32_t i = 0; i < PT; i++)
        tok[i] = k * 1000 + i + 1;
}

/* A request: match what the tree has, compute (extend + commit) the rest,
 * close. Returns the tokens matched. */
static size_t request(struct fx *f, uint32_t tenant, uint32_t k)
{
    uint32_t tok[PT];
    kvmm_seq_t s;
    size_t matched, shared;

    prefix(k, tok);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, tenant, own_ns(f, tenant), &s), 0);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s, tok, PT, &matched), 0);
    if (kvmm_seq_extend(f->mm, OWNER, s, PT - matched))
        fail_msg("extend: %s", kvmm_errmsg(f->mm));
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, tok + matched, PT - matched, &shared), 0);
    assert_int_equal(shared, PB);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    fx_check(f);
    return matched;
}

/* Tokens of prefix k the tree still holds (a match, undone). */
static size_t cached(struct fx *f, uint32_t tenant, uint32_t k)
{
    uint32_t tok[PT];
    kvmm_seq_t s;
    size_t matched;

    prefix(k, tok);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, tenant, own_ns(f, tenant), &s), 0);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s, tok, PT, &matched), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    fx_check(f);
    return matched;
}

static uint32_t hits_of(struct fx *f, uint32_t tenant, uint32_t k, size_t b)
{
    uint32_t tok[PT];
    struct radix_node *path[PB];
    prefix(k, tok);
    size_t n = radix_match(&f->mm->radix, own_ns(f, tenant), tok, PT, path, PB);
    assert_true(b < n);
    return pool_block(&f->mm->pool, path[b]->block)->hits;
}

/* Hits: +1 per block a match takes, +1 when a commit switches to the
 * tree's identical block; a new block starts at 0. */
static void test_hits_counted(void **state)
{
    struct fx *f = *state;
    uint32_t tok[PT];
    kvmm_seq_t s;
    size_t shared;

    fx_open(f, 16, 0);
    uint32_t t = add_tenant(f, "t", 1, 0);
    assert_int_equal(request(f, t, 1), 0);
    assert_int_equal(hits_of(f, t, 1, 0), 0);
    assert_int_equal(request(f, t, 1), PT);
    assert_int_equal(hits_of(f, t, 1, 0), 1);
    assert_int_equal(hits_of(f, t, 1, 1), 1);
    /* Computed again without a match: the commit switches to the cached blocks. */
    prefix(1, tok);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, own_ns(f, t), &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, PT), 0);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, tok, PT, &shared), 0);
    assert_int_equal(shared, PB);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    fx_check(f);
    assert_int_equal(hits_of(f, t, 1, 0), 2);
    assert_int_equal(hits_of(f, t, 1, 1), 2);
}

/* A hot prefix (matched 15 times), then one pool's worth of one-time
 * prefixes (16 blocks in a 16-block pool): `lru` evicts the hot prefix (the
 * oldest), `hits` evicts one-time blocks instead. Returns the hot prefix's
 * tokens still cached. */
static size_t hot_then_stream(struct fx *f, enum kvmm_evict_policy policy, uint32_t n_stream)
{
    fx_open_policy(f, 16, 0, policy);
    uint32_t t = add_tenant(f, "t", 1, 0);
    assert_int_equal(request(f, t, 1), 0);
    for (int i = 0; i < 15; i++)
        assert_int_equal(request(f, t, 1), PT);
    for (uint32_t k = 0; k < n_stream; k++)
        assert_int_equal(request(f, t, 100 + k), 0);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    assert_true(st.drops > 0); /* the stream did fill the pool */
    size_t left = cached(f, t, 1);
    fx_close(f);
    return left;
}

static void test_hot_prefix_outlives_stream(void **state)
{
    struct fx *f = *state;
    assert_int_equal(hot_then_stream(f, KVMM_EVICT_LRU, 8), 0);
    assert_int_equal(hot_then_stream(f, KVMM_EVICT_HITS, 8), PT);
}

/* The bonus is bounded: after enough one-time traffic the once-hot prefix
 * is evicted under `hits` too. Its 15 hits are worth 4 doublings of
 * 8 x 16 ticks; each one-time prefix ticks 6 times (2 blocks, each
 * allocated, entered in the tree and released). */
static void test_hot_prefix_ages_out(void **state)
{
    struct fx *f = *state;
    assert_int_equal(hot_then_stream(f, KVMM_EVICT_HITS, 48), PT);
    assert_int_equal(hot_then_stream(f, KVMM_EVICT_HITS, 128), 0);
}

/* Two tenants, the same traffic (alternating one-time prefixes), weights 1
 * and 4: the cached blocks each keeps at the end. */
static void weighted(struct fx *f, enum kvmm_evict_policy policy, uint32_t floor_light,
                     uint32_t *light_cached, uint32_t *heavy_cached)
{
    struct kvmm_tenant_stats ts;
    fx_open_policy(f, 16, 0, policy);
    uint32_t light = add_tenant(f, "light", 1, floor_light);
    uint32_t heavy = add_tenant(f, "heavy", 4, 0);
    for (uint32_t k = 0; k < 32; k++) {
        assert_int_equal(request(f, light, 100 + k), 0);
        assert_int_equal(request(f, heavy, 100 + k), 0);
    }
    assert_int_equal(kvmm_tenant_stats(f->mm, light, &ts), 0);
    *light_cached = ts.cached_blocks;
    assert_int_equal(kvmm_tenant_stats(f->mm, heavy, &ts), 0);
    *heavy_cached = ts.cached_blocks;
    assert_int_equal(*light_cached + *heavy_cached, 16);
    fx_close(f);
}

static void test_weight_keeps_more(void **state)
{
    struct fx *f = *state;
    uint32_t light, heavy;

    weighted(f, KVMM_EVICT_LRU, 0, &light, &heavy);
    print_message("lru: light %u heavy %u cached blocks\n", light, heavy);
    assert_true(light + 2 >= heavy && heavy + 2 >= light); /* an even split */
    weighted(f, KVMM_EVICT_HITS, 0, &light, &heavy);
    print_message("hits: light %u heavy %u cached blocks\n", light, heavy);
    assert_true(heavy >= 2 * light + 2);
    /* A floor still wins: the light tenant's cache inside its floor of 8
     * is never evicted for the heavy one. */
    weighted(f, KVMM_EVICT_HITS, 8, &light, &heavy);
    print_message("hits, light floor 8: light %u heavy %u cached blocks\n", light, heavy);
    assert_true(light >= 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hits_counted, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hot_prefix_outlives_stream, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hot_prefix_ages_out, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_weight_keeps_more, fx_setup, fx_teardown),
    };
    return cmocka_run_group_tests_name("kvmm eviction policy", tests, NULL, NULL);
}

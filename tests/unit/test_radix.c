/* Unit tests of the radix prefix tree: insert and longest-prefix match,
 * namespaces kept apart, a hash match never enough without equal tokens,
 * leaf removal under heavy churn (table backward-shift deletion), and the
 * LRU eviction heaps. */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvd/status.h"
#include "radix.h"

#define BT 4

/* The fixture, in CMocka setup/teardown: the test sizes the pool with
 * rfx_open; the teardown frees whatever was made, also after a failed
 * assert. */
struct rfx {
    struct backend *be;
    struct pool pool;
    struct radix r;
    bool have_pool, have_radix;
};

static int rfx_setup(void **state)
{
    struct rfx *f = calloc(1, sizeof *f);
    *state = f;
    return f && backend_cpu_new(&f->be) == 0 ? 0 : -1;
}

static int rfx_teardown(void **state)
{
    struct rfx *f = *state;
    if (!f)
        return 0;
    if (f->have_radix)
        radix_destroy(&f->r);
    if (f->have_pool)
        pool_destroy(&f->pool);
    backend_free(f->be);
    free(f);
    return 0;
}

static void rfx_open(struct rfx *f, uint32_t n_blocks)
{
    assert_int_equal(pool_init(&f->pool, f->be, 64, n_blocks, 0), 0);
    f->have_pool = true;
    assert_int_equal(radix_init(&f->r, &f->pool, BT), 0);
    f->have_radix = true;
    assert_int_equal(radix_tenants_reserve(&f->r, 2), 0);
}

static void rcheck(struct rfx *f)
{
    char msg[256];
    if (radix_check(&f->r, msg, sizeof msg))
        fail_msg("%s", msg);
}

/* Inserts the whole blocks of tokens under ns (existing ones are reused);
 * returns the last node. Each new block gets refcount 1 (the tree's). */
static struct radix_node *insert_chain(struct rfx *f, uint32_t ns, const uint32_t *t, size_t n)
{
    struct radix_node *cur = radix_root(&f->r, ns);
    for (size_t k = 0; (k + 1) * BT <= n; k++) {
        struct radix_node *c =
            radix_child(&f->r, cur, t + k * BT, radix_hash(&f->r, cur->hash, t + k * BT));
        if (!c) {
            uint32_t id;
            assert_int_equal(pool_alloc(&f->pool, KVD_TIER_DEVICE, 0, &id), 0);
            assert_int_equal(radix_insert(&f->r, cur, t + k * BT, id, &c), 0);
            assert_true(pool_unref(&f->pool, id) == false); /* the tree keeps its ref */
            radix_update(&f->r, c);
        }
        cur = c;
    }
    return cur;
}

static void test_insert_match(void **state)
{
    struct rfx *f = *state;
    uint32_t ns0, ns1, a[16], b[16];
    struct radix_node *out[8];

    rfx_open(f, 64);
    assert_int_equal(radix_ns_add(&f->r, &ns0), 0);
    assert_int_equal(radix_ns_add(&f->r, &ns1), 0);
    for (int i = 0; i < 16; i++)
        a[i] = b[i] = (uint32_t)i * 3 + 1;
    b[9] = 999; /* differs inside the third block */
    insert_chain(f, ns0, a, 16);
    rcheck(f);
    assert_int_equal(f->r.n_nodes, 4);
    assert_int_equal(radix_match(&f->r, ns0, a, 16, out, 8), 4);
    assert_int_equal(radix_match(&f->r, ns0, a, 15, out, 8), 3); /* whole blocks only */
    assert_int_equal(radix_match(&f->r, ns0, b, 16, out, 8), 2);
    assert_int_equal(radix_match(&f->r, ns0, a, 16, out, 1), 1); /* cap */
    assert_int_equal(radix_match(&f->r, ns1, a, 16, out, 8), 0); /* other namespace */
    insert_chain(f, ns0, b, 16);
    rcheck(f);
    assert_int_equal(f->r.n_nodes, 6); /* shares the first two blocks */
    assert_int_equal(radix_match(&f->r, ns0, b, 16, out, 8), 4);
    assert_int_equal(radix_root(&f->r, ns0)->n_children, 1);
    assert_int_equal(out[1]->n_children, 2);
}

static void test_hash_alone_never_matches(void **state)
{
    struct rfx *f = *state;
    uint32_t ns, a[BT] = {1, 2, 3, 4}, other[BT] = {4, 3, 2, 1};
    struct radix_node *n, *root;

    rfx_open(f, 8);
    assert_int_equal(radix_ns_add(&f->r, &ns), 0);
    n = insert_chain(f, ns, a, BT);
    root = radix_root(&f->r, ns);
    assert_ptr_equal(radix_child(&f->r, root, a, n->hash), n);
    /* Same hash value, different tokens: as if the hash had collided. */
    assert_null(radix_child(&f->r, root, other, n->hash));
    /* Same tokens and hash under another parent: no match either. */
    assert_null(radix_child(&f->r, n, a, n->hash));
}

static uint32_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(*s >> 33);
}

static void test_churn_against_model(void **state)
{
    enum { NB = 4096, ROUNDS = 20000 };
    struct rfx *f = *state;
    uint32_t ns;
    uint64_t s = 12345;
    struct radix_node *out[8];

    rfx_open(f, NB);
    assert_int_equal(radix_ns_add(&f->r, &ns), 0);
    /* Random single-block children of the root from a small alphabet, so
     * inserts, lookups and removals all collide in the table. */
    for (int round = 0; round < ROUNDS; round++) {
        uint32_t t[BT];
        for (int i = 0; i < BT; i++)
            t[i] = rnd(&s) % 6;
        struct radix_node *root = radix_root(&f->r, ns);
        struct radix_node *c = radix_child(&f->r, root, t, radix_hash(&f->r, root->hash, t));
        size_t m = radix_match(&f->r, ns, t, BT, out, 8);
        assert_int_equal(m, c ? 1 : 0);
        if (c && rnd(&s) % 2) {
            uint32_t id = radix_remove_leaf(&f->r, c);
            assert_true(pool_unref(&f->pool, id));
            assert_int_equal(radix_match(&f->r, ns, t, BT, out, 8), 0);
        } else if (!c) {
            insert_chain(f, ns, t, BT);
            assert_int_equal(radix_match(&f->r, ns, t, BT, out, 8), 1);
            assert_true(memcmp(out[0]->tokens, t, sizeof t) == 0);
        }
        if (round % 1000 == 0)
            rcheck(f);
    }
    rcheck(f);
}

static void test_lru_heaps(void **state)
{
    struct rfx *f = *state;
    uint32_t ns, t[3 * BT];
    struct radix_node *leaf, *mid;

    rfx_open(f, 16);
    assert_int_equal(radix_ns_add(&f->r, &ns), 0);
    for (int i = 0; i < 3 * BT; i++)
        t[i] = (uint32_t)i;
    leaf = insert_chain(f, ns, t, 3 * BT);
    mid = leaf->parent;
    /* Only the leaf is evictable on the device: parents have device children. */
    assert_int_equal(radix_evictable(&f->r, 0, KVD_TIER_DEVICE), 1);
    assert_ptr_equal(radix_lru(&f->r, 0, KVD_TIER_DEVICE), leaf);
    /* A second branch, used earlier than the first leaf. */
    uint32_t u[2 * BT];
    memcpy(u, t, sizeof(uint32_t) * BT);
    for (int i = BT; i < 2 * BT; i++)
        u[i] = 100 + (uint32_t)i;
    struct radix_node *other = insert_chain(f, ns, u, 2 * BT);
    pool_block(&f->pool, leaf->block)->lru = 50;
    pool_block(&f->pool, other->block)->lru = 10;
    radix_update(&f->r, leaf);
    radix_update(&f->r, other);
    assert_ptr_equal(radix_lru(&f->r, 0, KVD_TIER_DEVICE), other);
    /* A reference pins a node out of the heap. */
    pool_ref(&f->pool, other->block);
    radix_update(&f->r, other);
    assert_ptr_equal(radix_lru(&f->r, 0, KVD_TIER_DEVICE), leaf);
    assert_false(pool_unref(&f->pool, other->block));
    radix_update(&f->r, other);
    rcheck(f);
    /* Removing the leaf makes its parent a leaf. */
    assert_true(pool_unref(&f->pool, radix_remove_leaf(&f->r, leaf)));
    assert_int_not_equal(mid->heap_idx, RADIX_NO_HEAP);
    rcheck(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_insert_match, rfx_setup, rfx_teardown),
        cmocka_unit_test_setup_teardown(test_hash_alone_never_matches, rfx_setup, rfx_teardown),
        cmocka_unit_test_setup_teardown(test_churn_against_model, rfx_setup, rfx_teardown),
        cmocka_unit_test_setup_teardown(test_lru_heaps, rfx_setup, rfx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

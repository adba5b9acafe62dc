/* Unit tests of the block pool: alloc/ref/unref/free accounting, exhaustion
 * per tier, slot reuse, retiering, and pool_check catching corruption. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvd/status.h"
#include "pool_fixture.h"

static void check_ok(const struct pool *p)
{
    char msg[256];
    if (pool_check(p, msg, sizeof msg))
        fail_msg("%s", msg);
}

static void test_alloc_free_exhaust(void **state)
{
    struct pfx *f = *state;
    struct pool *p = &f->p;
    uint32_t ids[8], extra;

    pfx_init(f, 256, 8, 4);
    check_ok(p);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 3, &ids[i]), 0);
        assert_int_equal(pool_block(p, ids[i])->refcount, 1);
        assert_int_equal(pool_block(p, ids[i])->tier, KVD_TIER_DEVICE);
        assert_int_equal(pool_block(p, ids[i])->tenant, 3);
        /* Fresh arena memory is zero. */
        unsigned char *b = pool_block_ptr(p, ids[i]);
        for (int k = 0; k < 256; k++)
            assert_int_equal(b[k], 0);
        memset(b, i + 1, 256);
    }
    check_ok(p);
    assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 3, &extra), KVD_ENOMEM);
    assert_int_equal(pool_free_slots(p, KVD_TIER_DEVICE), 0);
    /* Host tier still has room. */
    assert_int_equal(pool_alloc(p, KVD_TIER_HOST, 1, &extra), 0);
    check_ok(p);
    /* Slots never overlap: every block kept its own bytes. */
    for (int i = 0; i < 8; i++)
        assert_int_equal(((unsigned char *)pool_block_ptr(p, ids[i]))[255], i + 1);
    pool_ref(p, ids[2]);
    assert_false(pool_unref(p, ids[2]));
    assert_true(pool_unref(p, ids[2]));
    assert_int_equal(pool_free_slots(p, KVD_TIER_DEVICE), 1);
    check_ok(p);
    /* The freed slot is reused at once. */
    uint32_t again;
    assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 0, &again), 0);
    assert_int_equal(pool_block(p, again)->refcount, 1);
    check_ok(p);
}

static void test_retier_and_check(void **state)
{
    struct pfx *f = *state;
    struct pool *p = &f->p;
    uint32_t id, slot, old;
    char msg[256];

    pfx_init(f, 64, 2, 2);
    assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 0, &id), 0);
    old = pool_block(p, id)->slot;
    slot = pool_slot_take(p, KVD_TIER_HOST, pool_block(p, id)->owner);
    assert_int_not_equal(slot, POOL_NONE);
    pool_retier(p, id, KVD_TIER_HOST, slot);
    assert_int_equal(pool_block(p, id)->tier, KVD_TIER_HOST);
    assert_int_equal(pool_free_slots(p, KVD_TIER_DEVICE), 2);
    assert_int_equal(pool_free_slots(p, KVD_TIER_HOST), 1);
    check_ok(p);
    /* Corrupt the slot map: the checker must notice. */
    p->slot_block[KVD_TIER_HOST][slot] = POOL_NONE;
    assert_int_equal(pool_check(p, msg, sizeof msg), KVD_EINTERNAL);
    p->slot_block[KVD_TIER_HOST][slot] = id;
    check_ok(p);
    /* A slot both free and used. */
    struct pool_page *g = &p->pages[KVD_TIER_HOST][pool_page_of(p, KVD_TIER_HOST, slot)];
    uint32_t head = g->free_head;
    p->slot_next[KVD_TIER_HOST][slot] = head;
    g->free_head = slot;
    g->n_free++;
    assert_int_equal(pool_check(p, msg, sizeof msg), KVD_EINTERNAL);
    g->free_head = head;
    g->n_free--;
    p->slot_next[KVD_TIER_HOST][slot] = POOL_NONE;
    check_ok(p);
    (void)old;
}

static void test_bad_init(void **state)
{
    struct pfx *f = *state;
    struct pool *p = &f->p;

    assert_int_equal(pool_init(p, f->be, 0, 4, 4), KVD_EBADREQ);
    assert_int_equal(pool_init(p, f->be, 64, 0, 4), KVD_EBADREQ);
    /* Without a host tier, host allocations fail cleanly. */
    uint32_t id;
    pfx_init(f, 64, 1, 0);
    assert_int_equal(pool_alloc(p, KVD_TIER_HOST, 0, &id), KVD_ENOMEM);
    check_ok(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_alloc_free_exhaust, pfx_setup, pfx_teardown),
        cmocka_unit_test_setup_teardown(test_retier_and_check, pfx_setup, pfx_teardown),
        cmocka_unit_test_setup_teardown(test_bad_init, pfx_setup, pfx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

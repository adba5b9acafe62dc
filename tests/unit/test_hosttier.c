/* Unit tests of the host tier: a batched swap-out writes checksums and a
 * swap-in restores the bytes; a flipped bit in a host copy is caught, the
 * failing block is named and nothing in the batch moves; a batch larger than
 * the free slots is refused whole. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "hosttier.h"
#include "pool_fixture.h"
#include "kvd/status.h"

#define BB 4096

static void fill(struct pool *p, uint32_t id, unsigned seed)
{
    unsigned char *b = pool_block_ptr(p, id);
    for (size_t i = 0; i < BB; i++)
        b[i] = (unsigned char)(seed * 31 + i * 7);
}

static int same(struct pool *p, uint32_t id, unsigned seed)
{
    unsigned char *b = pool_block_ptr(p, id);
    for (size_t i = 0; i < BB; i++)
        if (b[i] != (unsigned char)(seed * 31 + i * 7))
            return 0;
    return 1;
}

static void test_round_trip_and_corruption(void **state)
{
    struct pfx *f = *state;
    struct pool *p = &f->p;
    uint32_t ids[4];
    size_t bad = 99;
    char msg[256];

    pfx_init(f, BB, 4, 4);
    for (unsigned i = 0; i < 4; i++) {
        assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 0, &ids[i]), 0);
        fill(p, ids[i], i);
    }
    assert_int_equal(hosttier_move(p, ids, 4, KVD_TIER_HOST, NULL), 0);
    assert_int_equal(pool_check(p, msg, sizeof msg), 0);
    for (unsigned i = 0; i < 4; i++) {
        assert_int_equal(pool_block(p, ids[i])->tier, KVD_TIER_HOST);
        assert_int_equal(hosttier_verify(p, ids[i]), 0);
        assert_true(same(p, ids[i], i));
    }
    assert_int_equal(pool_free_slots(p, KVD_TIER_DEVICE), 4);
    /* Flip one bit of block 2's host copy. */
    ((unsigned char *)pool_block_ptr(p, ids[2]))[100] ^= 4;
    assert_int_equal(hosttier_verify(p, ids[2]), KVD_EINTERNAL);
    assert_int_equal(hosttier_move(p, ids, 4, KVD_TIER_DEVICE, &bad), KVD_EINTERNAL);
    assert_int_equal(bad, 2);
    for (unsigned i = 0; i < 4; i++) /* nothing moved */
        assert_int_equal(pool_block(p, ids[i])->tier, KVD_TIER_HOST);
    assert_int_equal(pool_check(p, msg, sizeof msg), 0);
    /* The good ones come back intact. */
    uint32_t good[3] = {ids[0], ids[1], ids[3]};
    assert_int_equal(hosttier_move(p, good, 3, KVD_TIER_DEVICE, &bad), 0);
    assert_true(same(p, ids[0], 0) && same(p, ids[1], 1) && same(p, ids[3], 3));
    /* A block copied into the wrong slot fails too (checksum seeded by id). */
    memcpy(pool_block_ptr(p, ids[2]), pool_block_ptr(p, ids[0]), BB);
    pool_block(p, ids[2])->checksum = hosttier_checksum(p, ids[2]) ^ 1;
    assert_int_equal(hosttier_verify(p, ids[2]), KVD_EINTERNAL);
}

static void test_batch_over_free_slots(void **state)
{
    struct pfx *f = *state;
    struct pool *p = &f->p;
    uint32_t ids[3];
    char msg[256];

    pfx_init(f, BB, 3, 2);
    for (unsigned i = 0; i < 3; i++)
        assert_int_equal(pool_alloc(p, KVD_TIER_DEVICE, 0, &ids[i]), 0);
    assert_int_equal(hosttier_move(p, ids, 3, KVD_TIER_HOST, NULL), KVD_ENOMEM);
    for (unsigned i = 0; i < 3; i++)
        assert_int_equal(pool_block(p, ids[i])->tier, KVD_TIER_DEVICE);
    assert_int_equal(pool_free_slots(p, KVD_TIER_HOST), 2);
    assert_int_equal(pool_check(p, msg, sizeof msg), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip_and_corruption, pfx_setup, pfx_teardown),
        cmocka_unit_test_setup_teardown(test_batch_over_free_slots, pfx_setup, pfx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

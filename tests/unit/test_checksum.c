/* Unit tests of checksum64: deterministic, seed- and length-sensitive, the
 * same at any alignment, and every single-bit flip of a block changes it. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "checksum.h"

static void fill(unsigned char *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (unsigned char)(seed >> 16);
    }
}

static void test_deterministic_and_seeded(void **state)
{
    unsigned char buf[1000];
    fill(buf, sizeof buf, 1);
    assert_true(checksum64(buf, sizeof buf, 7) == checksum64(buf, sizeof buf, 7));
    assert_true(checksum64(buf, sizeof buf, 7) != checksum64(buf, sizeof buf, 8));
    /* Every length gives a distinct value (tails are mixed in). */
    for (size_t n = 1; n < 200; n++)
        assert_true(checksum64(buf, n, 0) != checksum64(buf, n - 1, 0));
    assert_true(checksum64(buf, 0, 0) == checksum64(buf + 1, 0, 0));
}

/* A scratch buffer (4096 + 16 bytes) in setup/teardown: freed even when an
 * assert fails. */
enum { SCRATCH = 4096 + 16 };

static int scratch_setup(void **state)
{
    *state = malloc(SCRATCH);
    return *state ? 0 : -1;
}

static int scratch_teardown(void **state)
{
    free(*state);
    return 0;
}

static void test_alignment(void **state)
{
    unsigned char *raw = *state;
    unsigned char ref[4096];
    fill(ref, sizeof ref, 3);
    uint64_t want = checksum64(ref, sizeof ref, 11);
    for (size_t off = 0; off < 16; off++) {
        memcpy(raw + off, ref, sizeof ref);
        assert_true(checksum64(raw + off, sizeof ref, 11) == want);
    }
}

static void test_every_bit_flip_detected(void **state)
{
    enum { N = 2048 };
    unsigned char *buf = *state;
    fill(buf, N, 5);
    uint64_t want = checksum64(buf, N, 42);
    for (size_t bit = 0; bit < N * 8; bit++) {
        buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
        assert_true(checksum64(buf, N, 42) != want);
        buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    }
    assert_true(checksum64(buf, N, 42) == want);
    /* Swapping two 32-byte stripes changes it too (lanes are position-aware). */
    unsigned char tmp[32];
    memcpy(tmp, buf, 32);
    memcpy(buf, buf + 32, 32);
    memcpy(buf + 32, tmp, 32);
    assert_true(checksum64(buf, N, 42) != want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deterministic_and_seeded),
        cmocka_unit_test_setup_teardown(test_alignment, scratch_setup, scratch_teardown),
        cmocka_unit_test_setup_teardown(test_every_bit_flip_detected, scratch_setup,
                                        scratch_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Sampler unit tests: greedy is argmax (lowest id on ties, NaN ignored),
 * top-k 1 and a tiny top-p collapse to argmax, a seed fixes the draws, and
 * draws follow the softmax (loose statistical bound, fixed seed: the test
 * is deterministic). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "sampler.h"

static void test_greedy(void **state)
{
    (void)state;
    struct sampler s;
    struct sampler_scratch sc = {0};
    struct sampler_params p = {.temperature = 0, .top_p = 1};
    sampler_init(&s, &p);
    float l[6] = {0.5f, 3.0f, NAN, 3.0f, -INFINITY, 1.0f};
    uint32_t t = 99;
    assert_int_equal(sampler_sample(&s, &sc, l, 6, &t), 0);
    assert_int_equal(t, 1);
    sampler_scratch_free(&sc);
}

static void test_truncation_to_argmax(void **state)
{
    (void)state;
    struct sampler_scratch sc = {0};
    float l[100];
    for (int i = 0; i < 100; i++)
        l[i] = (float)((i * 37) % 100) / 10.0f; /* max at i = 73 (9.9)? */
    uint32_t best = 0;
    for (uint32_t i = 1; i < 100; i++)
        if (l[i] > l[best])
            best = i;
    for (int k = 0; k < 2; k++) {
        struct sampler_params p = {.temperature = 2.0f, .top_k = k == 0 ? 1 : 0,
                                   .top_p = k == 0 ? 1.0f : 1e-6f, .seed = 5};
        struct sampler s;
        sampler_init(&s, &p);
        for (int i = 0; i < 50; i++) {
            uint32_t t;
            assert_int_equal(sampler_sample(&s, &sc, l, 100, &t), 0);
            assert_int_equal(t, best);
        }
    }
    sampler_scratch_free(&sc);
}

static void test_seed_and_distribution(void **state)
{
    (void)state;
    struct sampler_scratch sc = {0};
    float l[4] = {0.0f, logf(2.0f), logf(3.0f), logf(4.0f)}; /* p = 0.1 .. 0.4 */
    struct sampler_params p = {.temperature = 1.0f, .top_p = 1.0f, .seed = 1234};
    struct sampler a, b, c;
    sampler_init(&a, &p);
    sampler_init(&b, &p);
    p.seed = 1235;
    sampler_init(&c, &p);
    unsigned count[4] = {0}, differ = 0;
    for (int i = 0; i < 20000; i++) {
        uint32_t ta, tb, tc;
        assert_int_equal(sampler_sample(&a, &sc, l, 4, &ta), 0);
        assert_int_equal(sampler_sample(&b, &sc, l, 4, &tb), 0);
        assert_int_equal(sampler_sample(&c, &sc, l, 4, &tc), 0);
        assert_int_equal(ta, tb);
        differ += ta != tc;
        count[ta]++;
    }
    assert_true(differ > 1000);
    for (int i = 0; i < 4; i++) {
        double want = 20000.0 * (i + 1) / 10.0;
        assert_true(fabs(count[i] - want) < 0.1 * want);
    }
    /* top_k 2 keeps only ids 3 and 2, in ratio 4:3. */
    struct sampler_params pk = {.temperature = 1.0f, .top_k = 2, .top_p = 1.0f, .seed = 9};
    sampler_init(&a, &pk);
    unsigned k3 = 0, k2 = 0;
    for (int i = 0; i < 14000; i++) {
        uint32_t t;
        assert_int_equal(sampler_sample(&a, &sc, l, 4, &t), 0);
        assert_true(t >= 2);
        k3 += t == 3;
        k2 += t == 2;
    }
    assert_true(fabs(k3 - 8000.0) < 400 && fabs(k2 - 6000.0) < 400);
    /* top_p 0.65 keeps ids 3 and 2 (0.4 + 0.3 >= 0.65). */
    struct sampler_params pp = {.temperature = 1.0f, .top_p = 0.65f, .seed = 9};
    sampler_init(&a, &pp);
    for (int i = 0; i < 2000; i++) {
        uint32_t t;
        assert_int_equal(sampler_sample(&a, &sc, l, 4, &t), 0);
        assert_true(t >= 2);
    }
    sampler_scratch_free(&sc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_truncation_to_argmax),
        cmocka_unit_test(test_seed_and_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

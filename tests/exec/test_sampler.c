/* Sampler unit tests: greedy is argmax (lowest id on ties, NaN ignored),
 * top-k 1 and a tiny top-p collapse to argmax, a seed fixes the draws,
 * draws follow the softmax (loose statistical bound, fixed seed: the test
 * is deterministic), and sampler_pick's radix select equals a plain
 * sort-and-walk reference on random rows (ties, -inf, NaN, every mode). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "sampler.h"

/* Each test's scratch (and a row of up to 32000 logits), in CMocka
 * setup/teardown: freed also after a failed assert. */
#define SFX_MAX_ROW 32000
struct sfx {
    struct sampler_scratch sc;
    float *l; /* (SFX_MAX_ROW) */
};

static int sfx_setup(void **state)
{
    struct sfx *f = calloc(1, sizeof *f);
    *state = f;
    if (!f || !(f->l = malloc(SFX_MAX_ROW * sizeof *f->l)))
        return -1;
    return 0;
}

static int sfx_teardown(void **state)
{
    struct sfx *f = *state;
    if (f) {
        sampler_scratch_free(&f->sc);
        free(f->l);
        free(f);
    }
    return 0;
}

static void test_greedy(void **state)
{
    struct sampler s;
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
    struct sampler_params p = {.temperature = 0, .top_p = 1};
    sampler_init(&s, &p);
    float l[6] = {0.5f, 3.0f, NAN, 3.0f, -INFINITY, 1.0f};
    uint32_t t = 99;
    assert_int_equal(sampler_sample(&s, sc, l, 6, &t), 0);
    assert_int_equal(t, 1);
}

static void test_truncation_to_argmax(void **state)
{
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
    float l[100];
    for (int i = 0; i < 100; i++)
        l[i] = (float)((i * 37) % 100) / 10.0f; /* max at i = 73 (9.9)? */
    uint32_t best = 0;
    for (uint32_t i = 1; i < 100; i++)
        if (l[i] > l[best])
            best = i;
    for (int k = 0; k < 2; k++) {
        struct sampler_params p = {.temperature = 2.0f,
                                   .top_k = k == 0 ? 1 : 0,
                                   .top_p = k == 0 ? 1.0f : 1e-6f,
                                   .seed = 5};
        struct sampler s;
        sampler_init(&s, &p);
        for (int i = 0; i < 50; i++) {
            uint32_t t;
            assert_int_equal(sampler_sample(&s, sc, l, 100, &t), 0);
            assert_int_equal(t, best);
        }
    }
}

static void test_seed_and_distribution(void **state)
{
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
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
        assert_int_equal(sampler_sample(&a, sc, l, 4, &ta), 0);
        assert_int_equal(sampler_sample(&b, sc, l, 4, &tb), 0);
        assert_int_equal(sampler_sample(&c, sc, l, 4, &tc), 0);
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
        assert_int_equal(sampler_sample(&a, sc, l, 4, &t), 0);
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
        assert_int_equal(sampler_sample(&a, sc, l, 4, &t), 0);
        assert_true(t >= 2);
    }
}

/* ---- sampler_pick against a sort-based reference ------------------------ */

struct rcand {
    float v;
    uint32_t id;
    uint64_t w;
};

static int rcand_cmp(const void *a, const void *b)
{
    const struct rcand *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* sampler.h's definition, spelled out: sort, cut, walk. */
static uint32_t reference_pick(const struct sample_row *row, const float *l, uint32_t n)
{
    struct rcand *c = calloc(n, sizeof *c);
    assert_non_null(c);
    float inv_t = 1.0f / row->temperature, mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++) {
        c[i].v = (isnan(l[i]) ? -INFINITY : l[i]) * inv_t;
        c[i].id = i;
        mx = c[i].v > mx ? c[i].v : mx;
    }
    uint32_t out = 0;
    if (mx == -INFINITY) { /* argmax: all -inf or NaN gives id 0 */
        free(c);
        return 0;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        c[i].w = (uint64_t)(exp((double)c[i].v - (double)mx) * SAMPLE_FX_ONE + 0.5);
        total += c[i].w;
    }
    bool tk = row->top_k > 0 && row->top_k < n, tp = row->top_p < 1.0f;
    size_t m = n;
    if (tk || tp)
        qsort(c, n, sizeof *c, rcand_cmp);
    if (tk) {
        m = row->top_k;
        total = 0;
        for (size_t i = 0; i < m; i++)
            total += c[i].w;
    }
    if (tp) {
        uint64_t need = (uint64_t)ceil((double)row->top_p * (double)total), acc = 0;
        need = need < 1 ? 1 : need > total ? total : need;
        for (size_t i = 0; i < m; i++) {
            acc += c[i].w;
            if (acc >= need) {
                m = i + 1;
                break;
            }
        }
        total = acc;
    }
    uint64_t t = (uint64_t)(row->u * (double)total), acc = 0;
    t = t >= total ? total - 1 : t;
    for (size_t i = 0; i < m; i++) {
        acc += c[i].w;
        if (acc > t) {
            out = c[i].id;
            break;
        }
    }
    free(c);
    return out;
}

static uint64_t rnd(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static void test_pick_matches_reference(void **state)
{
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    const uint32_t sizes[] = {1, 2, 7, 100, 1000, 32000};
    unsigned checked = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        uint32_t n = sizes[si];
        float *l = ((struct sfx *)*state)->l;
        assert_true(n <= SFX_MAX_ROW);
        for (int trial = 0; trial < (n > 1000 ? 40 : 300); trial++) {
            /* Logits on a coarse grid (many ties), a few -inf and NaN, and
             * now and then a row that is all -inf. */
            int grid = 1 + (int)(rnd(&x) % 64);
            bool dead = rnd(&x) % 50 == 0;
            for (uint32_t i = 0; i < n; i++) {
                uint64_t r = rnd(&x);
                l[i] = dead || r % 97 == 0 ? -INFINITY
                       : r % 89 == 0       ? NAN
                                           : (float)((int)(r >> 8) % grid) * 0.25f - 4.0f;
            }
            struct sample_row row = {
                .temperature = (float)(1 + rnd(&x) % 40) / 10.0f,
                .top_k = rnd(&x) % 3 == 0 ? 0 : (uint32_t)(rnd(&x) % (n + 2)),
                .top_p = rnd(&x) % 3 == 0 ? 1.0f : (float)(rnd(&x) % 1001) / 1000.0f,
                .u = (double)(rnd(&x) >> 11) * (1.0 / 9007199254740992.0),
            };
            if (row.top_p <= 0.0f)
                row.top_p = 1e-6f;
            if (trial % 25 == 0)
                row.u = trial % 50 == 0 ? 0.0 : 0.9999999999999999;
            uint32_t got = UINT32_MAX;
            assert_int_equal(sampler_pick(&row, sc, l, n, &got), 0);
            uint32_t want = reference_pick(&row, l, n);
            if (got != want)
                fail_msg("n %u T %g k %u p %g u %.17g: pick %u, reference %u", n,
                         (double)row.temperature, row.top_k, (double)row.top_p, row.u, got, want);
            checked++;
        }
    }
    assert_true(checked > 1000);
    /* A skipped row picks 0 and reads nothing. */
    struct sample_row skip = {.temperature = 1.0f, .top_p = 1.0f, .skip = 1, .u = 0.5};
    uint32_t t = 7;
    assert_int_equal(sampler_pick(&skip, sc, NULL, 10, &t), 0);
    assert_int_equal(t, 0);
}

/* logit_bias then the penalties, by hand: window {0, 0, 1, 3} (the last 4
 * of 2, 0, 0, 1, 3), repeat 2, frequency 0.5, presence 0.25, biases +0.5
 * on 3 and +1 on 4 (outside the window). */
static void test_adjust_by_hand(void **state)
{
    (void)state;
    struct logit_bias b[2] = {{3, 0.5f}, {4, 1.0f}};
    struct sampler_params p = {.top_p = 1,
                               .repeat_penalty = 2,
                               .frequency_penalty = 0.5f,
                               .presence_penalty = 0.25f,
                               .repeat_last_n = 4,
                               .bias = b,
                               .n_bias = 2};
    uint32_t toks[5] = {2, 0, 0, 1, 3}, counts[5];
    float l[5] = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    sampler_adjust(&p, toks, 5, l, 5, counts);
    assert_true(l[0] == 2.0f / 2 - (2 * 0.5f + 0.25f)); /* -0.25 */
    assert_true(l[1] == -1.0f * 2 - (0.5f + 0.25f));    /* -2.75 */
    assert_true(l[2] == 0.5f);                          /* outside the window */
    assert_true(l[3] == 3.5f / 2 - (0.5f + 0.25f));     /* 1.0 */
    assert_true(l[4] == 1.0f);                          /* bias only */
    /* greedy on the result: 3 and 4 tie at 1.0, the lowest id wins */
    struct sampler s;
    p.temperature = 0;
    sampler_init(&s, &p);
    float m[5] = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    uint32_t t = 99;
    assert_true(sampler_on_host(&s));
    assert_int_equal(
        sampler_sample_host(&s, &((struct sfx *)*state)->sc, toks, 5, m, 5, counts, &t), 0);
    assert_int_equal(t, 3);
    /* a window of 0 turns the penalties off; a -inf bias bans */
    struct logit_bias ban = {3, -INFINITY};
    struct sampler_params q = {
        .top_p = 1, .repeat_penalty = 2, .repeat_last_n = 0, .bias = &ban, .n_bias = 1};
    float n[5] = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    sampler_adjust(&q, toks, 5, n, 5, counts);
    assert_true(n[0] == 2.0f && n[1] == -1.0f && n[3] == -INFINITY);
}

static void test_on_host(void **state)
{
    (void)state;
    struct sampler s;
    struct sampler_params p = {.temperature = 1,
                               .top_k = 5,
                               .top_p = 0.5f,
                               .repeat_penalty = 1,
                               .typical_p = 1,
                               .repeat_last_n = 64};
    sampler_init(&s, &p);
    assert_false(sampler_on_host(&s));
    struct sampler_params z = {.temperature = 1, .top_p = 1}; /* zero = off */
    sampler_init(&s, &z);
    assert_false(sampler_on_host(&s));
    struct logit_bias b = {1, 1};
    float *f[] = {&p.min_p, &p.typical_p, &p.repeat_penalty, &p.presence_penalty,
                  &p.frequency_penalty};
    float v[] = {0.1f, 0.9f, 1.1f, -0.5f, 0.5f};
    for (size_t i = 0; i < 5; i++) {
        struct sampler_params q = p;
        *(float *)((char *)&q + ((char *)f[i] - (char *)&p)) = v[i];
        sampler_init(&s, &q);
        assert_true(sampler_on_host(&s));
        q.repeat_last_n = 0;
        sampler_init(&s, &q);
        assert_int_equal(sampler_on_host(&s), i < 2); /* penalties need a window */
    }
    struct sampler_params q = p;
    q.bias = &b;
    q.n_bias = 1;
    sampler_init(&s, &q);
    assert_true(sampler_on_host(&s));
}

static uint32_t pick_t(struct sampler_scratch *sc, const float *l, uint32_t n, double u, float typ,
                       float min_p)
{
    struct sample_row row = {.temperature = 1.0f, .top_p = 1.0f, .u = u};
    struct sample_trunc t = {.typical_p = typ, .min_p = min_p};
    uint32_t out = 99;
    assert_int_equal(sampler_pick_trunc(&row, &t, sc, l, n, &out), 0);
    return out;
}

/* min_p on p proportional to {1, 0.5, 0.25, 0.1}: 0.3 keeps {0, 1}
 * (u 0.99 lands in 1), 0.2 keeps {0, 1, 2} (lands in 2), off lands in 3. */
static void test_min_p_by_hand(void **state)
{
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
    float l[4] = {0.0f, logf(0.5f), logf(0.25f), logf(0.1f)};
    assert_int_equal(pick_t(sc, l, 4, 0.99, 1, 0.3f), 1);
    assert_int_equal(pick_t(sc, l, 4, 0.99, 1, 0.2f), 2);
    assert_int_equal(pick_t(sc, l, 4, 0.99, 1, 0), 3);
    assert_int_equal(pick_t(sc, l, 4, 0.0, 1, 1.0f), 0); /* only the most likely */
    assert_int_equal(pick_t(sc, l, 4, 0.99, 1, 1.0f), 0);
}

/* typical_p on p = {0.4, 0.12 x 5}: H = 1.6387; |-log p - H| is 0.7224 for
 * the head and 0.4816 for the tail, so the tail is the most typical and
 * the head goes first: 0.5 keeps all five of the tail (0.48 < 0.5 after
 * four), 0.3 keeps three (0.36). */
static void test_typical_by_hand(void **state)
{
    struct sampler_scratch *sc = &((struct sfx *)*state)->sc;
    float l[6] = {logf(0.4f), logf(0.12f), logf(0.12f), logf(0.12f), logf(0.12f), logf(0.12f)};
    assert_int_equal(pick_t(sc, l, 6, 0.0, 1, 0), 0); /* off: the head first */
    assert_int_equal(pick_t(sc, l, 6, 0.0, 0.5f, 0), 1);
    assert_int_equal(pick_t(sc, l, 6, 0.9999, 0.5f, 0), 5);
    assert_int_equal(pick_t(sc, l, 6, 0.9999, 0.3f, 0), 3);
    /* then min_p relative to the largest weight left (the tail's): keeps it all */
    assert_int_equal(pick_t(sc, l, 6, 0.9999, 0.5f, 0.9f), 5);
    /* p = {0.7, 0.2, 0.1}: scores 0.445, 0.808, 1.501: 0.5 keeps the head */
    float m[3] = {logf(0.7f), logf(0.2f), logf(0.1f)};
    assert_int_equal(pick_t(sc, m, 3, 0.9999, 0.5f, 0), 0);
    assert_int_equal(pick_t(sc, m, 3, 0.9999, 0.8f, 0), 1);
    assert_int_equal(pick_t(sc, m, 3, 0.9999, 0, 0), 2);
}

/* sampler_logprobs against a log-softmax by hand in long double: every
 * value within 1e-6 the top-n the n largest (lower id first at a tie),
 * (relative: they are floats), their exp summing to <= 1, large logits (1e4: exp overflows without
 * the max subtracted), -inf and NaN entries, n_top past the vocabulary. */
static void test_logprobs(void **state)
{
    (void)state;
    enum { V = 1000 };
    static float lg[V];
    uint64_t x = 12345;
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < V; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            lg[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 20.0 - 10.0);
            if (k == 1)
                lg[i] += 1e4f;
        }
        if (k == 2) {
            lg[5] = -INFINITY;
            lg[6] = NAN;
            lg[7] = lg[8] = 50.0f; /* a tie at the top */
        }
        long double mx = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++)
            if (!isnan(lg[i]) && lg[i] > mx)
                mx = lg[i];
        for (int i = 0; i < V; i++)
            if (!isnan(lg[i]))
                sum += expl((long double)lg[i] - mx);
        long double lse = mx + logl(sum);
        struct sampler_logprob out[1 + SAMPLER_MAX_TOP_LOGPROBS];
        uint32_t chosen = k == 2 ? 5 : 17;
        assert_int_equal(sampler_logprobs(lg, V, chosen, 20, out), 20);
        assert_int_equal(out[0].id, chosen);
        if (k == 2)
            assert_true(isinf(out[0].logprob) && out[0].logprob < 0);
        else
            assert_true(fabsl(out[0].logprob - ((long double)lg[chosen] - lse)) <
                        1e-6 * (1 + fabsl((long double)lg[chosen] - lse)));
        double p = 0;
        for (int t = 1; t <= 20; t++) {
            uint32_t id = out[t].id;
            long double want = (long double)lg[id] - lse;
            if (!(fabsl(out[t].logprob - want) < 1e-6 * (1 + fabsl(want)))) /* float's rounding */
                fail_msg("k %d t %d id %u: %g vs %Lg", k, t, id, (double)out[t].logprob,
                         (long double)lg[id] - lse);
            p += exp((double)out[t].logprob);
            if (t > 1)
                assert_true(out[t].logprob <= out[t - 1].logprob);
            /* nothing outside the top is larger than the last one */
            for (int i = 0; i < V && t == 20; i++) {
                bool in = false;
                for (int u = 1; u <= 20; u++)
                    in |= out[u].id == (uint32_t)i;
                assert_true(in || isnan(lg[i]) || lg[i] <= lg[out[20].id]);
            }
        }
        assert_true(p <= 1.0 + 1e-6);
        if (k == 2) {
            assert_int_equal(out[1].id, 7);
            assert_int_equal(out[2].id, 8);
        }
    }
    /* n_top past the vocabulary; 0 alternatives */
    float two[2] = {0.0f, 0.0f};
    struct sampler_logprob o2[1 + SAMPLER_MAX_TOP_LOGPROBS];
    assert_int_equal(sampler_logprobs(two, 2, 1, 20, o2), 2);
    assert_true(fabsf(o2[0].logprob - logf(0.5f)) < 1e-7f);
    assert_int_equal(o2[1].id, 0);
    assert_int_equal(o2[2].id, 1);
    assert_int_equal(sampler_logprobs(two, 2, 0, 0, o2), 0);
    /* a row of -inf: every logprob -inf, no NaN */
    float ninf[3] = {-INFINITY, -INFINITY, -INFINITY};
    assert_int_equal(sampler_logprobs(ninf, 3, 1, 2, o2), 2);
    assert_true(isinf(o2[0].logprob) && isinf(o2[1].logprob) && isinf(o2[2].logprob));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_greedy, sfx_setup, sfx_teardown),
        cmocka_unit_test_setup_teardown(test_truncation_to_argmax, sfx_setup, sfx_teardown),
        cmocka_unit_test_setup_teardown(test_seed_and_distribution, sfx_setup, sfx_teardown),
        cmocka_unit_test_setup_teardown(test_pick_matches_reference, sfx_setup, sfx_teardown),
        cmocka_unit_test_setup_teardown(test_adjust_by_hand, sfx_setup, sfx_teardown),
        cmocka_unit_test(test_on_host),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test_setup_teardown(test_min_p_by_hand, sfx_setup, sfx_teardown),
        cmocka_unit_test_setup_teardown(test_typical_by_hand, sfx_setup, sfx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

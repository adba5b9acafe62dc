/* In-process executor tests: the scheduler, sampler and executor thread
 * driven against the real model (random 2-layer GGUF), kvmm and cpu
 * backend. Greedy output must not depend on caching, batching, preemption
 * (swap or recompute) or forking; seeded sampling must not depend on the
 * batch; stop/length/cancel/stream/disconnect behave as documented. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "exec_fixture.h"

static void assert_same(const struct fx_result *a, const struct fx_result *b)
{
    assert_int_equal(a->n, b->n);
    assert_memory_equal(a->toks, b->toks, a->n * sizeof(uint32_t));
}

static struct fx_gen greedy(const uint32_t *p, size_t n, uint32_t max_tokens)
{
    return (struct fx_gen){.toks = p, .n_toks = n, .max_tokens = max_tokens, .temperature = -1};
}

/* Cold run vs prefix-cache hit: same tokens, and the second reuses blocks. */
static void test_cache_hit(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 64, 512, 32), 0);
    uint32_t p[40];
    fx_prompt(p, 40, 1);
    struct fx_gen g = greedy(p, 40, 12);
    struct fx_result a = fx_run1(f, 1, &g);
    struct fx_result b = fx_run1(f, 2, &g);
    assert_int_equal(a.finish, SCHED_FINISH_LENGTH);
    assert_int_equal(a.n, 12);
    assert_int_equal(a.cached, 0);
    assert_int_equal(b.cached, 32); /* two full blocks of 16; the last token is recomputed */
    assert_int_equal(b.prompt, 40);
    assert_int_equal(b.completion, 12);
    assert_same(&a, &b);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* 32 concurrent requests with different prompts: each equals its solo run. */
static void test_batch_equals_solo(void **state)
{
    struct fx *f = *state;
    static struct fx_result solo[32];
    static uint32_t p[32][48];
    assert_int_equal(fx_open(f, &fx_small, 512, 0, 512, 32), 0);
    for (uint32_t i = 0; i < 32; i++) {
        fx_prompt(p[i], 5 + i, 100 + i);
        struct fx_gen g = greedy(p[i], 5 + i, 10);
        solo[i] = fx_run1(f, 1 + i, &g);
    }
    fx_reset_results();
    for (uint32_t i = 0; i < 32; i++) {
        struct fx_gen g = greedy(p[i], 5 + i, 10);
        struct kvd_error err;
        assert_int_equal(fx_submit(f, 100 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < 32; i++)
        assert_same(fx_wait(100 + i), &solo[i]);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* Runs 8 requests of 40-token prompts and 48 generated tokens (6 blocks
 * each) concurrently in a pool of `dev` device blocks. */
static void run_pressure(struct fx *f, uint32_t dev, uint32_t host, struct fx_result *out,
                         struct exec_stats *st, struct kvmm_stats *ks)
{
    static uint32_t p[8][40];
    assert_int_equal(fx_open(f, &fx_small, dev, host, 256, 8), 0);
    for (uint32_t i = 0; i < 8; i++) {
        fx_prompt(p[i], 40, 300 + i);
        struct fx_gen g = greedy(p[i], 40, 48);
        struct kvd_error err;
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < 8; i++)
        out[i] = *fx_wait(1 + i);
    exec_stats(f->ex, st);
    kvmm_lock(f->mm);
    kvmm_stats(f->mm, ks);
    kvmm_unlock(f->mm);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

static void test_preemption_same_output(void **state)
{
    struct fx *f = *state;
    static struct fx_result big[8], swap[8], recompute[8];
    struct exec_stats st;
    struct kvmm_stats ks;
    run_pressure(f, 512, 0, big, &st, &ks);
    assert_int_equal(st.sched.preempt_swap + st.sched.preempt_recompute, 0);

    run_pressure(f, 14, 64, swap, &st, &ks);
    print_message("swap pool: %llu swap preemptions, %llu recompute, %llu swaps out\n",
                  (unsigned long long)st.sched.preempt_swap,
                  (unsigned long long)st.sched.preempt_recompute, (unsigned long long)ks.swaps_out);
    assert_true(st.sched.preempt_swap > 0);
    assert_true(ks.swaps_out > 0);

    run_pressure(f, 14, 0, recompute, &st, &ks);
    print_message("no host tier: %llu recompute preemptions\n",
                  (unsigned long long)st.sched.preempt_recompute);
    assert_true(st.sched.preempt_recompute > 0);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(big[i].n, 48);
        assert_same(&swap[i], &big[i]);
        assert_same(&recompute[i], &big[i]);
    }
}

/* generate on a connection's sequence, fork it, continue both. */
static void test_fork_continue(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 8), 0);
    uint64_t conn = 5;
    kvmm_seq_t s = 0, c = 0;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, conn, f->tenant, f->ns, &s), 0);
    kvmm_unlock(f->mm);

    uint32_t p[20];
    fx_prompt(p, 20, 7);
    struct fx_gen g = greedy(p, 20, 6);
    g.has_seq = true;
    g.seq = s;
    g.conn = conn;
    struct fx_result first = fx_run1(f, 1, &g);
    assert_true(first.seq_returned);
    assert_int_equal(first.n, 6);

    /* The sequence now holds the prompt and all generated tokens but the
     * last (whose K/V was never computed). */
    kvmm_lock(f->mm);
    struct kvmm_seq_info info;
    assert_int_equal(kvmm_seq_info(f->mm, conn, s, &info), 0);
    assert_int_equal(info.n_tokens, 25);
    assert_int_equal(kvmm_seq_fork(f->mm, conn, s, conn, &c), 0);
    kvmm_unlock(f->mm);

    uint32_t a_tail[2] = {first.toks[5], 10}, b_tail[2] = {first.toks[5], 20};
    struct fx_gen ga = greedy(a_tail, 2, 8), gb = greedy(b_tail, 2, 8);
    ga.has_seq = gb.has_seq = true;
    ga.seq = s;
    gb.seq = c;
    ga.conn = gb.conn = conn;
    struct kvd_error err;
    assert_int_equal(fx_submit(f, 2, &ga, &err), 0);
    assert_int_equal(fx_submit(f, 3, &gb, &err), 0);
    struct fx_result ra = *fx_wait(2), rb = *fx_wait(3);
    assert_int_equal(ra.prompt, 27);
    assert_int_equal(ra.cached, 25);

    uint32_t cold[27];
    memcpy(cold, p, sizeof(p));
    memcpy(cold + 20, first.toks, 6 * sizeof(uint32_t));
    cold[26] = 10;
    struct fx_gen gc = greedy(cold, 27, 8);
    struct fx_result ca = fx_run1(f, 4, &gc);
    cold[26] = 20;
    struct fx_result cb = fx_run1(f, 5, &gc);
    assert_same(&ra, &ca);
    assert_same(&rb, &cb);

    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, conn, s), 0);
    assert_int_equal(kvmm_seq_close(f->mm, conn, c), 0);
    kvmm_unlock(f->mm);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

static void test_seeded_sampling(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 512, 0, 512, 16), 0);
    uint32_t p[12];
    fx_prompt(p, 12, 9);
    struct fx_gen g = {.toks = p,
                       .n_toks = 12,
                       .max_tokens = 24,
                       .temperature = 1.2,
                       .top_k = 50,
                       .top_p = 0.95,
                       .has_seed = true,
                       .seed = 42};
    struct fx_result solo = fx_run1(f, 1, &g);
    fx_reset_results();
    struct kvd_error err;
    static uint32_t others[8][16];
    for (uint32_t i = 0; i < 8; i++) {
        fx_prompt(others[i], 16, 50 + i);
        struct fx_gen o = g;
        o.toks = others[i];
        o.n_toks = 16;
        o.seed = 1000 + i;
        assert_int_equal(fx_submit(f, 10 + i, &o, &err), 0);
    }
    assert_int_equal(fx_submit(f, 2, &g, &err), 0);
    struct fx_gen g43 = g;
    g43.seed = 43;
    assert_int_equal(fx_submit(f, 3, &g43, &err), 0);
    struct fx_result batched = *fx_wait(2), other = *fx_wait(3);
    for (uint32_t i = 0; i < 8; i++)
        fx_wait(10 + i);
    assert_same(&solo, &batched);
    assert_int_equal(other.n, 24);
    assert_true(memcmp(other.toks, solo.toks, 24 * sizeof(uint32_t)) != 0);
    fx_close(f);
}

static void test_stop_length_context(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 8), 0);
    uint32_t p[10];
    fx_prompt(p, 10, 3);
    struct fx_gen g = greedy(p, 10, 20);
    struct fx_result ref = fx_run1(f, 1, &g);
    assert_int_equal(ref.finish, SCHED_FINISH_LENGTH);
    assert_int_equal(ref.n, 20);

    /* Stop at the first occurrence of the 4th token. */
    uint32_t stop[2] = {255, ref.toks[3]};
    size_t first = 0;
    while (ref.toks[first] != stop[1])
        first++;
    g.stop = stop;
    g.n_stop = 2;
    struct fx_result s = fx_run1(f, 2, &g);
    assert_int_equal(s.finish, SCHED_FINISH_STOP);
    assert_int_equal(s.n, first + 1);
    assert_memory_equal(s.toks, ref.toks, s.n * sizeof(uint32_t));

    /* The context (256) ends generation: prompt 250 + 6 tokens. */
    static uint32_t lp[250];
    fx_prompt(lp, 250, 4);
    struct fx_gen gl = greedy(lp, 250, 100);
    struct fx_result l = fx_run1(f, 3, &gl);
    assert_int_equal(l.finish, SCHED_FINISH_LENGTH);
    assert_int_equal(l.n, 6);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

static void test_stream_and_cancel(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 8), 0);
    uint32_t p[8];
    fx_prompt(p, 8, 5);
    struct fx_gen g = greedy(p, 8, 30);
    g.stream = true;
    struct fx_result r = fx_run1(f, 1, &g);
    assert_int_equal(r.n, 30);
    assert_int_equal(r.n_streamed, 30);
    assert_true(r.n_events >= 1);
    assert_memory_equal(r.streamed, r.toks, 30 * sizeof(uint32_t));

    /* Cancel mid-stream: the executor is frozen at the first event (so the
     * request is surely live), then cancel. */
    g.max_tokens = 240;
    struct kvd_error err;
    fx_pause_at(2, 1);
    assert_int_equal(fx_submit(f, 2, &g, &err), 0);
    fx_wait_paused();
    bool found = false;
    exec_cancel(f->ex, 1, 2, &found);
    fx_resume();
    if (!found)
        fail_msg("request 2 not live: done %d finish %d n %zu events %zu err %s",
                 fx_result(2)->done, fx_result(2)->finish, fx_result(2)->n, fx_result(2)->n_events,
                 fx_result(2)->msg);
    struct fx_result *c = fx_wait(2);
    assert_int_equal(c->finish, SCHED_FINISH_CANCELLED);
    assert_true(c->n < 240);
    assert_memory_equal(c->toks, r.toks, (c->n < 30 ? c->n : 30) * sizeof(uint32_t));
    exec_cancel(f->ex, 1, 2, &found);
    assert_false(found);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* A connection goes away with requests queued and running (the first, on
 * its own sequence, frozen mid-stream): nothing is answered and everything
 * is freed. */
static void test_disconnect_frees(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 64, 8), 0);
    uint64_t conn = 9;
    kvmm_seq_t s;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, conn, f->tenant, f->ns, &s), 0);
    kvmm_unlock(f->mm);
    static uint32_t p[16][60];
    struct kvd_error err;
    /* Armed before anything is submitted: the executor freezes at request
     * 1's first token, so no request can finish (each wants 200 tokens)
     * however slowly this thread submits the rest on a loaded machine. */
    fx_pause_at(1, 1);
    for (uint32_t i = 0; i < 16; i++) {
        fx_prompt(p[i], 60, 700 + i);
        struct fx_gen g = greedy(p[i], 60, 200);
        g.conn = conn;
        g.stream = i == 0; /* its first token event is the freeze point: running */
        if (i == 0) {
            g.has_seq = true;
            g.seq = s;
        }
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    fx_wait_paused();
    exec_cancel_conn(f->ex, conn);
    kvmm_lock(f->mm);
    kvmm_close_owner(f->mm, conn); /* what the server does after its close hooks */
    kvmm_unlock(f->mm);
    fx_resume();
    fx_wait_idle(f);
    for (uint32_t i = 0; i < 16; i++)
        assert_false(fx_result(1 + i)->done);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* Shutdown answers everything: cancelled, nothing leaked. */
static void test_drain(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 64, 8), 0);
    static uint32_t p[10][30];
    struct kvd_error err;
    for (uint32_t i = 0; i < 10; i++) {
        fx_prompt(p[i], 30, 900 + i);
        struct fx_gen g = greedy(p[i], 30, 200);
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    exec_drain(f->ex);
    for (uint32_t i = 0; i < 10; i++) {
        assert_true(fx_result(1 + i)->done);
        assert_int_equal(fx_result(1 + i)->finish, SCHED_FINISH_CANCELLED);
    }
    struct fx_gen g = greedy(p[0], 30, 2);
    assert_int_equal(fx_submit(f, 20, &g, &err), KVD_ECANCELLED);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* A prompt the tenant's quota can never hold fails with quota_exceeded;
 * one the pool can never hold fails with no_memory. */
static void test_quota_never_fits(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 8, 0, 512, 8), 0);
    static uint32_t p[200];
    fx_prompt(p, 200, 1);
    struct fx_gen g = greedy(p, 200, 4);
    struct fx_result r = fx_run1(f, 1, &g);
    assert_int_equal(r.finish, SCHED_FINISH_ERROR);
    assert_int_equal(r.err, KVD_ENOMEM);

    struct kvmm_tenant_conf tc = {.max_device_blocks = 2,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    snprintf(tc.name, sizeof(tc.name), "small");
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_tenant_set(f->mm, &tc, &f->tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(f->mm, f->tenant, &f->ns), 0);
    kvmm_unlock(f->mm);
    g = greedy(p, 40, 4);
    r = fx_run1(f, 2, &g);
    assert_int_equal(r.finish, SCHED_FINISH_ERROR);
    assert_int_equal(r.err, KVD_EQUOTA);
    /* A prompt that fits, but prompt + max_tokens never can: refused at
     * once, not after generating up to the limit. */
    g = greedy(p, 20, 40);
    r = fx_run1(f, 3, &g);
    assert_int_equal(r.finish, SCHED_FINISH_ERROR);
    assert_int_equal(r.err, KVD_EQUOTA);
    assert_non_null(strstr(r.msg, "max_tokens 40"));
    /* Exactly the quota (K/V for 20 + 13 - 1 = 32 positions) runs. */
    g = greedy(p, 20, 13);
    r = fx_run1(f, 4, &g);
    assert_int_equal(r.finish, SCHED_FINISH_LENGTH);
    assert_int_equal(r.n, 13);
    fx_assert_mm_clean(f, 0);
    fx_close(f);
}

/* One sequence per step: waiting requests start by priority, not arrival. */
static void test_priority_order(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 64, 1), 0);
    uint32_t p[4][8];
    for (int i = 0; i < 4; i++)
        fx_prompt(p[i], 8, 40 + (uint32_t)i);
    struct fx_gen a = greedy(p[0], 8, 240);
    a.stream = true;
    struct kvd_error err;
    fx_pause_at(1, 1); /* A frozen at its first token, holding the slot */
    assert_int_equal(fx_submit(f, 1, &a, &err), 0);
    fx_wait_paused();
    struct fx_gen lo = greedy(p[1], 8, 4), lo2 = greedy(p[2], 8, 4), hi = greedy(p[3], 8, 4);
    hi.priority = 5;
    lo2.priority = -5;
    assert_int_equal(fx_submit(f, 2, &lo2, &err), 0);
    assert_int_equal(fx_submit(f, 3, &lo, &err), 0);
    assert_int_equal(fx_submit(f, 4, &hi, &err), 0);
    bool found = false;
    exec_cancel(f->ex, 1, 1, &found); /* A holds the only batch slot until now */
    fx_resume();
    assert_true(found);
    fx_wait(2);
    assert_int_equal(fx_result(1)->order, 1);
    assert_int_equal(fx_result(4)->order, 2);
    assert_int_equal(fx_result(3)->order, 3);
    assert_int_equal(fx_result(2)->order, 4);
    fx_close(f);
}

/* Weighted fair share: with one batch slot, tenant B (weight 3) is admitted
 * about three times as often as tenant A (weight 1) while both wait. */
static void test_weighted_fairness(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 64, 1), 0);
    uint32_t ta, na, tb, nb, tc, nc;
    assert_int_equal(fx_tenant(f, "a", 1, &ta, &na), 0);
    assert_int_equal(fx_tenant(f, "b", 3, &tb, &nb), 0);
    assert_int_equal(fx_tenant(f, "c", 1, &tc, &nc), 0);
    static uint32_t p[17][8];
    for (int i = 0; i < 17; i++)
        fx_prompt(p[i], 8, 500 + (uint32_t)i);
    struct fx_gen blocker = greedy(p[16], 8, 240);
    blocker.stream = blocker.has_tenant = true;
    blocker.tenant = tc;
    blocker.ns = nc;
    struct kvd_error err;
    fx_pause_at(100, 1); /* the blocker frozen at its first token */
    assert_int_equal(fx_submit(f, 100, &blocker, &err), 0);
    fx_wait_paused();
    for (int i = 0; i < 16; i++) {
        struct fx_gen g = greedy(p[i], 8, 8);
        g.has_tenant = true;
        g.tenant = i < 8 ? ta : tb;
        g.ns = i < 8 ? na : nb;
        assert_int_equal(fx_submit(f, 1 + (uint64_t)i, &g, &err), 0);
    }
    bool found = false;
    exec_cancel(f->ex, 1, 100, &found);
    fx_resume();
    assert_true(found);
    unsigned a_first = 0, b_first = 0;
    for (int i = 0; i < 16; i++) {
        struct fx_result *r = fx_wait(1 + (uint64_t)i);
        assert_int_equal(r->n, 8);
        if (r->order <= 9 && i < 8) /* the blocker is reply 1 */
            a_first++;
        else if (r->order <= 9)
            b_first++;
    }
    print_message("first 8 admitted: %u of tenant a (weight 1), %u of tenant b (weight 3)\n",
                  a_first, b_first);
    assert_true(b_first >= 5 && a_first >= 1);
    fx_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cache_hit, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_batch_equals_solo, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_preemption_same_output, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_fork_continue, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_seeded_sampling, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_stop_length_context, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_stream_and_cancel, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_disconnect_frees, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_drain, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_quota_never_fits, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_priority_order, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_weighted_fairness, fx_setup, fx_teardown),
    };
    if (!getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "KVD_TOOLS_DIR is not set (run through ctest)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, fx_small_setup, fx_small_teardown);
}

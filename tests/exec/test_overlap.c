/* In-process executor tests of the overlap (exec.c step()): the next decode
 * step planned while the current one runs and submitted before its results
 * are published. On the cpu backend the forward is done when submitted, so
 * these check the bookkeeping, not the timing: greedy and seeded tokens the
 * same with the overlap on and off, requests that end at different steps
 * (max_tokens, a stop token, a cancel) giving back the position the next
 * step held for them (a lent sequence comes back without it), requests
 * arriving while an overlapped step runs, memory too short for every
 * request to grow (swaps, recomputes), and the counters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "exec_fixture.h"

#define N_REQ 12

static void assert_same(const struct fx_result *a, const struct fx_result *b)
{
    assert_int_equal(a->finish, b->finish);
    assert_int_equal(a->n, b->n);
    assert_memory_equal(a->toks, b->toks, a->n * sizeof(uint32_t));
}

/* Every request answered, no sequence open, no block held (the positions
 * planned ahead for requests that ended were given back). */
static void assert_mm_clean(struct fx *f)
{
    fx_wait_idle(f);
    fx_assert_mm_clean(f, 0);
}

static uint32_t g_prompts[N_REQ][32];

/* Request i of the batch: a prompt of its own, and max_tokens from 3 to
 * 36 so that the requests end at different steps; sampled (seeded) when
 * `sampled`. */
static struct fx_gen batch_gen(uint32_t i, bool sampled)
{
    fx_prompt(g_prompts[i], 4 + 2 * i, 700 + i);
    struct fx_gen g = {.toks = g_prompts[i],
                       .n_toks = 4 + 2 * i,
                       .max_tokens = 3 + 3 * i,
                       .temperature = -1,
                       .stream = i % 2 == 0};
    if (sampled) {
        g.temperature = 1.2;
        g.top_k = 50;
        g.top_p = 0.95;
        g.has_seed = true;
        g.seed = 4242 + i;
    }
    return g;
}

/* Runs the batch (request i has id 1 + i; `stop`, when not 0, is request
 * 3's stop token) with the overlap on or off; out[i] its results, *st the
 * executor's counters at the end. */
static void run_batch(struct fx *f, enum exec_overlap ov, bool sampled, uint32_t stop,
                      struct fx_result *out, struct exec_stats *st)
{
    fx_overlap = ov;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 16), 0);
    fx_overlap = EXEC_OVERLAP_AUTO;
    struct kvd_error err;
    for (uint32_t i = 0; i < N_REQ; i++) {
        struct fx_gen g = batch_gen(i, sampled);
        if (i == 3 && stop) {
            g.stop = &stop;
            g.n_stop = 1;
        }
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < N_REQ; i++)
        out[i] = *fx_wait(1 + i);
    assert_mm_clean(f);
    exec_stats(f->ex, st);
    fx_close(f);
}

/* Greedy: the same tokens with the overlap on and off, whatever step each
 * request ends at; only the overlap's runs count overlapped steps. */
static void test_greedy_same(void **state)
{
    struct fx *f = *state;
    static struct fx_result off[N_REQ], on[N_REQ];
    struct exec_stats so, sn;
    run_batch(f, EXEC_OVERLAP_OFF, false, 0, off, &so);
    run_batch(f, EXEC_OVERLAP_ON, false, 0, on, &sn);
    for (uint32_t i = 0; i < N_REQ; i++) {
        assert_int_equal(off[i].finish, SCHED_FINISH_LENGTH);
        assert_int_equal(off[i].n, 3 + 3 * i);
        assert_same(&off[i], &on[i]);
        if (on[i].n_streamed)
            assert_memory_equal(on[i].streamed, on[i].toks, on[i].n * sizeof(uint32_t));
    }
    assert_int_equal(so.overlap.steps, 0);
    assert_true(sn.overlap.steps > 0);
    /* every decode step after the first decode one was planned ahead,
     * save those after a step some request ended in (at most one per
     * request) */
    assert_true(sn.overlap.steps + N_REQ + 1 >= sn.spec.decode_steps);
    assert_true(so.overlap.host_steps > 0);
    assert_true(sn.overlap.host_steps > 0);
    assert_int_equal(so.generated, sn.generated);
}

/* Seeded sampling: each request's draws are its own, overlap or not. */
static void test_seeded_same(void **state)
{
    struct fx *f = *state;
    static struct fx_result off[N_REQ], on[N_REQ];
    struct exec_stats so, sn;
    run_batch(f, EXEC_OVERLAP_OFF, true, 0, off, &so);
    run_batch(f, EXEC_OVERLAP_ON, true, 0, on, &sn);
    for (uint32_t i = 0; i < N_REQ; i++)
        assert_same(&off[i], &on[i]);
    assert_true(sn.overlap.steps > 0);
}

/* A stop token ends one request mid-batch: its next step's row was planned
 * and is dropped; no token after the stop, the others unchanged. */
static void test_stop_mid_batch(void **state)
{
    struct fx *f = *state;
    static struct fx_result ref[N_REQ], off[N_REQ], on[N_REQ];
    struct exec_stats s;
    run_batch(f, EXEC_OVERLAP_OFF, false, 0, ref, &s);
    /* request 3 (12 tokens) stops at the first occurrence of its 6th */
    uint32_t stop = ref[3].toks[5];
    size_t first = 0;
    while (ref[3].toks[first] != stop)
        first++;
    run_batch(f, EXEC_OVERLAP_OFF, false, stop, off, &s);
    run_batch(f, EXEC_OVERLAP_ON, false, stop, on, &s);
    assert_true(s.overlap.steps > 0);
    for (uint32_t i = 0; i < N_REQ; i++) {
        assert_same(&off[i], &on[i]);
        if (i != 3)
            assert_same(&ref[i], &on[i]);
    }
    assert_int_equal(on[3].finish, SCHED_FINISH_STOP);
    assert_int_equal(on[3].n, first + 1);
    assert_memory_equal(on[3].toks, ref[3].toks, on[3].n * sizeof(uint32_t));
}

/* A cancel arrives while the executor publishes a step whose successor is
 * already submitted: the request ends within a step, its tokens a prefix
 * of its uncancelled run, its planned position given back; the others run
 * on unchanged. Then a request arrives the same way (the executor frozen
 * in the sink of an overlapped step): it is planned at the next step and
 * its tokens are its solo run's. */
static void test_cancel_and_arrival(void **state)
{
    struct fx *f = *state;
    static struct fx_result ref[N_REQ];
    struct exec_stats s;
    run_batch(f, EXEC_OVERLAP_OFF, false, 0, ref, &s);

    fx_overlap = EXEC_OVERLAP_ON;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 16), 0);
    fx_overlap = EXEC_OVERLAP_AUTO;
    uint32_t late[20];
    fx_prompt(late, 20, 999);
    struct fx_gen gl = {.toks = late, .n_toks = 20, .max_tokens = 16, .temperature = -1};
    struct fx_result solo = fx_run1(f, 100, &gl);
    fx_reset_results();

    struct kvd_error err;
    /* request 12 (i = 11: 36 tokens) is cancelled at the 6th event of
     * request 11 (i = 10, streamed); request 100 arrives at the 12th event
     * of request 9 (i = 8, streamed, 27 tokens) */
    fx_pause_at(11, 6);
    for (uint32_t i = 0; i < N_REQ; i++) {
        struct fx_gen g = batch_gen(i, false);
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    fx_wait_paused();
    exec_stats(f->ex, &s);
    uint64_t ov_before = s.overlap.steps;
    bool found = false;
    exec_cancel(f->ex, 1, 12, &found);
    assert_true(found);
    fx_pause_at(9, 12); /* releases the pause on 11 */
    fx_wait_paused();
    assert_int_equal(fx_submit(f, 100, &gl, &err), 0);
    fx_resume();
    for (uint32_t i = 0; i < N_REQ; i++) {
        struct fx_result *r = fx_wait(1 + i);
        if (i == 11) {
            assert_int_equal(r->finish, SCHED_FINISH_CANCELLED);
            assert_true(r->n < ref[i].n);
            assert_memory_equal(r->toks, ref[i].toks, r->n * sizeof(uint32_t));
        } else {
            assert_same(&ref[i], r);
        }
    }
    assert_same(&solo, fx_wait(100));
    assert_mm_clean(f);
    exec_stats(f->ex, &s);
    assert_true(ov_before > 0);
    assert_true(s.overlap.steps > ov_before);
    fx_close(f);
}

/* Requests on their connection's sequences (seq mode) ending at different
 * steps, among others: each sequence comes back holding its prompt and
 * every generated token but the last, all committed; the position the
 * next step held for it is not part of it. */
static void test_seq_mode_returned(void **state)
{
    struct fx *f = *state;
    fx_overlap = EXEC_OVERLAP_ON;
    assert_int_equal(fx_open(f, &fx_small, 256, 0, 512, 16), 0);
    fx_overlap = EXEC_OVERLAP_AUTO;
    uint64_t conn = 5;
    kvmm_seq_t s[4];
    static uint32_t p[4][16];
    struct kvd_error err;
    kvmm_lock(f->mm);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(kvmm_seq_open(f->mm, conn, f->tenant, f->ns, &s[i]), 0);
    kvmm_unlock(f->mm);
    for (uint32_t i = 0; i < N_REQ; i++) {
        struct fx_gen g = batch_gen(i, false);
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < 4; i++) {
        fx_prompt(p[i], 10 + i, 800 + i);
        struct fx_gen g = {.toks = p[i],
                           .n_toks = 10 + i,
                           .max_tokens = 3 + 5 * i,
                           .temperature = -1,
                           .has_seq = true,
                           .seq = s[i],
                           .conn = conn};
        assert_int_equal(fx_submit(f, 50 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < N_REQ; i++)
        fx_wait(1 + i);
    for (uint32_t i = 0; i < 4; i++) {
        struct fx_result *r = fx_wait(50 + i);
        assert_true(r->seq_returned);
        assert_int_equal(r->n, 3 + 5 * i);
        struct kvmm_seq_info info;
        kvmm_lock(f->mm);
        assert_int_equal(kvmm_seq_info(f->mm, conn, s[i], &info), 0);
        kvmm_unlock(f->mm);
        assert_int_equal(info.n_tokens, 10 + i + r->n - 1);
        assert_int_equal(info.n_committed, info.n_tokens);
    }
    struct exec_stats st;
    exec_stats(f->ex, &st);
    assert_true(st.overlap.steps > 0);
    kvmm_lock(f->mm);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(kvmm_seq_close(f->mm, conn, s[i]), 0);
    kvmm_unlock(f->mm);
    assert_mm_clean(f);
    fx_close(f);
}

/* 8 requests of 40-token prompts and 48 generated tokens in a pool of
 * `dev` device blocks (and `host` for swaps), the overlap on or off. */
static void run_pressure(struct fx *f, enum exec_overlap ov, uint32_t dev, uint32_t host,
                         struct fx_result *out, struct exec_stats *st)
{
    static uint32_t p[8][40];
    fx_overlap = ov;
    assert_int_equal(fx_open(f, &fx_small, dev, host, 256, 8), 0);
    fx_overlap = EXEC_OVERLAP_AUTO;
    for (uint32_t i = 0; i < 8; i++) {
        fx_prompt(p[i], 40, 300 + i);
        struct fx_gen g = {.toks = p[i], .n_toks = 40, .max_tokens = 48, .temperature = -1};
        struct kvd_error err;
        assert_int_equal(fx_submit(f, 1 + i, &g, &err), 0);
    }
    for (uint32_t i = 0; i < 8; i++)
        out[i] = *fx_wait(1 + i);
    assert_mm_clean(f);
    exec_stats(f->ex, st);
    fx_close(f);
}

/* Memory short: planning ahead never preempts, so a step whose requests
 * cannot all grow is planned the usual way (which swaps or recomputes);
 * the tokens are those of a pool large enough for all. */
static void test_pressure_same(void **state)
{
    struct fx *f = *state;
    static struct fx_result big[8], swap[8], recompute[8];
    struct exec_stats st;
    run_pressure(f, EXEC_OVERLAP_OFF, 512, 0, big, &st);
    run_pressure(f, EXEC_OVERLAP_ON, 14, 64, swap, &st);
    assert_true(st.sched.preempt_swap > 0);
    assert_true(st.overlap.steps > 0);
    run_pressure(f, EXEC_OVERLAP_ON, 14, 0, recompute, &st);
    assert_true(st.sched.preempt_recompute > 0);
    assert_true(st.overlap.steps > 0);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(big[i].n, 48);
        assert_same(&swap[i], &big[i]);
        assert_same(&recompute[i], &big[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_greedy_same, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_seeded_same, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_stop_mid_batch, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_cancel_and_arrival, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_seq_mode_returned, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_pressure_same, fx_setup, fx_teardown),
    };
    return cmocka_run_group_tests(tests, fx_small_setup, fx_small_teardown);
}

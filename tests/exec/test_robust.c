/* Executor robustness, in-process against the real model, kvmm and cpu
 * backend: no request waits forever for memory only idle block-API
 * sequences hold (no_memory) or in a saturated queue (busy after the queue
 * timeout); a connection's sequence lent to a generate is busy, not
 * unknown, and comes back with all its tokens after a recompute preemption
 * and a cancel; one tenant's long prefills share the step with another's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "exec_fixture.h"

static struct fx_gen greedy(const uint32_t *p, size_t n, uint32_t max_tokens)
{
    return (struct fx_gen){.toks = p, .n_toks = n, .max_tokens = max_tokens, .temperature = -1};
}

static void seq_info(struct fx *f, uint64_t conn, uint64_t s, int want_rc,
                     struct kvmm_seq_info *info, char *msg, size_t len)
{
    kvmm_lock(f->mm);
    int rc = kvmm_seq_info(f->mm, conn, s, info);
    snprintf(msg, len, "%s", kvmm_errmsg(f->mm));
    kvmm_unlock(f->mm);
    if (rc != want_rc)
        fail_msg("kvmm_seq_info: %d, want %d (%s)", rc, want_rc, msg);
}

/* Idle block-API sequences hold the whole device pool and no request runs:
 * a generate is answered no_memory at once, saying what holds the pool; the
 * same request runs once the sequence is closed. */
static void test_no_memory_idle_holders(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 16, 0, 64, 4), 0);
    kvmm_seq_t hold = 0;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, 7, f->tenant, f->ns, &hold), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, 7, hold, 16 * 16), 0);
    kvmm_unlock(f->mm);

    uint32_t p[20];
    fx_prompt(p, 20, 3);
    struct fx_gen g = greedy(p, 20, 4);
    struct fx_result r = fx_run1(f, 1, &g);
    print_message("no_memory: %s\n", r.msg);
    assert_int_equal(r.finish, SCHED_FINISH_ERROR);
    assert_int_equal(r.err, KVD_ENOMEM);
    assert_non_null(strstr(r.msg, "0 of 16 blocks free, 16 held by open sequences; need 2"));

    /* Its own connection's sequence holding the rest of the pool: the same. */
    kvmm_seq_t own = 0;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_truncate(f->mm, 7, hold, 16), 0); /* 1 block free */
    assert_int_equal(kvmm_seq_open(f->mm, 7, f->tenant, f->ns, &own), 0);
    kvmm_unlock(f->mm);
    g.has_seq = true;
    g.seq = own;
    g.conn = 7;
    r = fx_run1(f, 2, &g);
    assert_int_equal(r.err, KVD_ENOMEM);
    assert_true(r.seq_returned); /* the empty sequence is the connection's again */

    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, 7, hold), 0);
    kvmm_unlock(f->mm);
    r = fx_run1(f, 3, &g);
    assert_int_equal(r.finish, SCHED_FINISH_LENGTH);
    assert_int_equal(r.n, 4);
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, 7, own), 0);
    kvmm_unlock(f->mm);

    fx_close(f);
}

/* While a running request will free memory, a request that does not fit
 * waits for it (no no_memory); a request not scheduled within the queue
 * timeout is answered busy. */
static void test_wait_then_queue_timeout(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 16, 0, 256, 4), 0);
    static uint32_t pa[200], pb[100], pc[8];
    fx_prompt(pa, 200, 60);
    fx_prompt(pb, 100, 61);
    fx_prompt(pc, 8, 62);
    struct kvd_error err;
    /* a: 200 + 8 - 1 positions = 13 of the 16 blocks; b needs 7: it waits
     * for a (both queued before the executor plans: it needs the lock). */
    struct fx_gen a = greedy(pa, 200, 8), b = greedy(pb, 100, 4);
    kvmm_lock(f->mm);
    assert_int_equal(fx_submit(f, 1, &a, &err), 0);
    assert_int_equal(fx_submit(f, 2, &b, &err), 0);
    kvmm_unlock(f->mm);
    struct fx_result ra = *fx_wait(1), rb = *fx_wait(2);
    assert_int_equal(ra.n, 8);
    assert_int_equal(rb.n, 4);
    assert_true(ra.order < rb.order);

    fx_close(f);

    /* c is queued while the executor cannot plan for longer than the
     * timeout (20 ms): its first look at c finds it expired. */
    fx_queue_timeout_ms = 20;
    int orc = fx_open(f, &fx_small, 16, 0, 256, 4);
    fx_queue_timeout_ms = 0;
    assert_int_equal(orc, 0);
    struct fx_gen c = greedy(pc, 8, 4);
    kvmm_lock(f->mm);
    assert_int_equal(fx_submit(f, 3, &c, &err), 0);
    usleep(50 * 1000);
    kvmm_unlock(f->mm);
    struct fx_result rc = *fx_wait(3);
    print_message("queue timeout: %s\n", rc.msg);
    assert_int_equal(rc.finish, SCHED_FINISH_ERROR);
    assert_int_equal(rc.err, KVD_EBUSY);
    assert_non_null(strstr(rc.msg, "queue timeout"));
    fx_close(f);
}

/* A connection's sequence lent to a generate: the connection's own calls on
 * the handle are busy (naming the request), another connection's are
 * not_found, a second generate on it is refused busy; after the reply the
 * handle is the connection's again. */
static void test_lent_seq_busy(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 64, 0, 64, 4), 0);
    kvmm_seq_t s = 0;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, 5, f->tenant, f->ns, &s), 0);
    kvmm_unlock(f->mm);
    uint32_t p[10];
    fx_prompt(p, 10, 9);
    struct fx_gen g = greedy(p, 10, 240);
    g.has_seq = g.stream = true;
    g.seq = s;
    g.conn = 5;
    struct kvd_error err;
    fx_pause_at(42, 1); /* the executor stops after request 42's first token */
    assert_int_equal(fx_submit(f, 42, &g, &err), 0);
    fx_wait_paused();

    struct kvmm_seq_info info;
    char msg[320], want[96];
    seq_info(f, 5, s, KVD_EBUSY, &info, msg, sizeof(msg));
    snprintf(want, sizeof(want), "sequence %llu is in use by generate request 42",
             (unsigned long long)s);
    assert_non_null(strstr(msg, want));
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, 5, s), KVD_EBUSY);
    assert_int_equal(kvmm_seq_extend(f->mm, 5, s, 1), KVD_EBUSY);
    kvmm_unlock(f->mm);
    seq_info(f, 6, s, KVD_ENOTFOUND, &info, msg, sizeof(msg));

    struct fx_gen g2 = greedy(p, 2, 4);
    g2.has_seq = true;
    g2.seq = s;
    g2.conn = 5;
    assert_int_equal(fx_submit(f, 43, &g2, &err), KVD_EBUSY);
    assert_non_null(strstr(err.message, "in use by generate request 42"));

    bool found = false;
    exec_cancel(f->ex, 5, 42, &found);
    assert_true(found);
    fx_resume();
    struct fx_result *r = fx_wait(42);
    assert_int_equal(r->finish, SCHED_FINISH_CANCELLED);
    assert_true(r->seq_returned);
    seq_info(f, 5, s, 0, &info, msg, sizeof(msg));
    assert_true(info.n_tokens >= 10);
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, 5, s), 0);
    kvmm_unlock(f->mm);
    fx_close(f);
}

/* A generate on a connection's 40-token sequence is preempted for
 * recompute (a higher-priority request takes the pool, no host tier), then
 * cancelled: the sequence comes back with its 40 tokens and valid K/V (the
 * continuation equals a cold run). */
static void test_cancel_after_recompute_keeps_seq(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 8, 0, 64, 4), 0);
    const uint64_t conn = 9;
    kvmm_seq_t s = 0;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, conn, f->tenant, f->ns, &s), 0);
    kvmm_unlock(f->mm);
    uint32_t p[40], hp[60];
    fx_prompt(p, 40, 21);
    fx_prompt(hp, 60, 22);
    /* 40 prompt tokens, 1 generated: the sequence holds 40 (K/V for all). */
    struct fx_gen g = greedy(p, 40, 1);
    g.has_seq = true;
    g.seq = s;
    g.conn = conn;
    struct fx_result first = fx_run1(f, 1, &g);
    assert_int_equal(first.n, 1);
    struct kvmm_seq_info info;
    char msg[320];
    seq_info(f, conn, s, 0, &info, msg, sizeof(msg));
    assert_int_equal(info.n_tokens, 40);
    uint32_t orig[41];
    memcpy(orig, p, sizeof(p));
    orig[40] = first.toks[0];

    /* Lent with nothing appended: it recomputes its last position. */
    struct fx_gen cont = greedy(NULL, 0, 80);
    cont.no_tokens = true;
    cont.has_seq = cont.stream = true;
    cont.seq = s;
    cont.conn = conn;
    struct kvd_error err;
    /* Exact interleaving: the executor stops after request 2's first
     * token; the high-priority request 3 is queued; it runs on until 3
     * has 40 tokens (100 positions, 7 blocks): 2 had to give way long
     * before, and with 1 block free it cannot be back. */
    fx_pause_at(2, 1);
    assert_int_equal(fx_submit(f, 2, &cont, &err), 0);
    fx_wait_paused();
    struct fx_gen hi = greedy(hp, 60, 68); /* 60 + 68 - 1 = 127 positions: 8 blocks */
    hi.priority = 5;
    hi.stream = true;
    assert_int_equal(fx_submit(f, 3, &hi, &err), 0);
    fx_pause_at(3, 40);
    fx_wait_paused();
    struct exec_stats st;
    exec_stats(f->ex, &st);
    if (st.sched.preempt_recompute == 0)
        fail_msg("no recompute preemption (%llu swaps)", (unsigned long long)st.sched.preempt_swap);
    bool found = false;
    exec_cancel(f->ex, conn, 2, &found);
    assert_true(found);
    fx_resume();
    struct fx_result *r = fx_wait(2);
    assert_int_equal(r->finish, SCHED_FINISH_CANCELLED);
    assert_true(r->seq_returned);
    assert_int_equal(fx_wait(3)->n, 68);

    seq_info(f, conn, s, 0, &info, msg, sizeof(msg));
    print_message("after recompute + cancel: %zu tokens (%zu committed), lent with 40\n",
                  info.n_tokens, info.n_committed);
    assert_true(info.n_tokens >= 40);
    assert_int_equal(info.n_committed, info.n_tokens);
    kvmm_lock(f->mm);
    size_t n = 0;
    const uint32_t *toks = kvmm_seq_tokens(f->mm, conn, s, &n);
    assert_memory_equal(toks, p, sizeof(p));
    /* Back to exactly the 40 lent tokens, then continue and compare. */
    if (info.n_tokens > 40)
        assert_int_equal(kvmm_seq_truncate(f->mm, conn, s, info.n_tokens - 40), 0);
    kvmm_unlock(f->mm);
    uint32_t tail = first.toks[0];
    struct fx_gen more = greedy(&tail, 1, 6);
    more.has_seq = true;
    more.seq = s;
    more.conn = conn;
    struct fx_result warm = fx_run1(f, 4, &more);
    assert_int_equal(warm.cached, 40);
    struct fx_gen cold = greedy(orig, 41, 6);
    struct fx_result c = fx_run1(f, 5, &cold);
    assert_int_equal(warm.n, 6);
    assert_int_equal(c.n, 6);
    assert_memory_equal(warm.toks, c.toks, 6 * sizeof(uint32_t));
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_close(f->mm, conn, s), 0);
    kvmm_unlock(f->mm);
    fx_close(f);
}

/* Tenant a floods four 240-token prompts; tenant b then asks for 8 tokens.
 * With 4 tokens per step, a's first prompt alone takes 60 steps; sharing
 * the prefill budget by weight, b's answer comes before a's first. */
static void test_prefill_fair_share(void **state)
{
    struct fx *f = *state;
    assert_int_equal(fx_open(f, &fx_small, 128, 0, 4, 4), 0);
    uint32_t ta, na, tb, nb;
    assert_int_equal(fx_tenant(f, "a", 1, &ta, &na), 0);
    assert_int_equal(fx_tenant(f, "b", 1, &tb, &nb), 0);
    static uint32_t pa[4][240];
    uint32_t pb[8];
    fx_prompt(pb, 8, 77);
    struct kvd_error err;
    /* Holding the kvmm lock keeps the executor from planning until every
     * request is queued (submission itself does not take it). */
    kvmm_lock(f->mm);
    for (int i = 0; i < 4; i++) {
        fx_prompt(pa[i], 240, 80 + (uint32_t)i);
        struct fx_gen g = greedy(pa[i], 240, 1);
        g.has_tenant = true;
        g.tenant = ta;
        g.ns = na;
        assert_int_equal(fx_submit(f, 1 + (uint64_t)i, &g, &err), 0);
    }
    struct fx_gen g = greedy(pb, 8, 1);
    g.has_tenant = true;
    g.tenant = tb;
    g.ns = nb;
    assert_int_equal(fx_submit(f, 10, &g, &err), 0);
    kvmm_unlock(f->mm);
    for (int i = 0; i < 4; i++)
        assert_int_equal(fx_wait(1 + (uint64_t)i)->n, 1);
    struct fx_result *b = fx_wait(10);
    print_message("tenant b answered %u of 5 (tenant a's first prompt: %u)\n", b->order,
                  fx_result(1)->order);
    assert_int_equal(b->n, 1);
    assert_true(b->order < fx_result(1)->order);
    fx_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_no_memory_idle_holders, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_wait_then_queue_timeout, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_lent_seq_busy, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_cancel_after_recompute_keeps_seq, fx_setup,
                                        fx_teardown),
        cmocka_unit_test_setup_teardown(test_prefill_fair_share, fx_setup, fx_teardown),
    };
    if (!getenv("KVD_TOOLS_DIR")) {
        fprintf(stderr, "KVD_TOOLS_DIR is not set (run through ctest)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, fx_small_setup, fx_small_teardown);
}

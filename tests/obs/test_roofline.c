/* Unit tests of the observability parts that need no daemon: the roofline
 * cost model against hand-computed FLOP/byte counts, the rolling window and
 * its bound, the ceilings probe on the cpu backend, per-tenant accounting
 * and histograms, metrics address parsing and the Prometheus rendering. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <event2/buffer.h>

#include "acct.h"
#include "backend.h"
#include "kvmm.h"
#include "metrics.h"
#include "roofline.h"
#include "scheduler.h"

/* d=64, 2 layers, 4 heads (2 kv) of 16, ff=128, vocab=100; 1000 bytes of
 * per-step weights, 128-byte embedding rows, 256 bytes of K+V per position
 * (2 layers x K,V x 2 kv heads x 16 dims x 2 bytes). */
static const struct roofline_shape shape = {
    .n_embd = 64,
    .n_layer = 2,
    .n_head = 4,
    .n_head_kv = 2,
    .head_dim = 16,
    .n_ff = 128,
    .n_vocab = 100,
    .step_weight_bytes = 1000,
    .embd_row_bytes = 128,
    .kv_token_bytes = 256,
    .act_bytes = 4,
};

/* What a test may hold, in CMocka setup/teardown: a roofline and an acct
 * (initialised), a backend and kvmm (the test makes them; locked says the
 * test holds the kvmm lock), a rendered text; the teardown frees whatever
 * is there, also after a failed assert. */
struct ofx {
    struct roofline rl;
    struct acct a;
    struct backend *be;
    struct kvmm *mm;
    bool locked;
    char *text;
};

static int ofx_setup(void **state)
{
    struct ofx *f = calloc(1, sizeof *f);
    *state = f;
    if (!f)
        return -1;
    roofline_init(&f->rl);
    acct_init(&f->a);
    return 0;
}

static int ofx_teardown(void **state)
{
    struct ofx *f = *state;
    if (!f)
        return 0;
    roofline_destroy(&f->rl);
    acct_destroy(&f->a);
    if (f->mm) {
        if (f->locked)
            kvmm_unlock(f->mm);
        kvmm_free(f->mm);
    }
    backend_free(f->be);
    free(f->text);
    free(f);
    return 0;
}

static void test_cost_mixed(void **state)
{
    (void)state;
    /* A prefill chunk of 3 at position 5, a decode at position 10. */
    struct roofline_seq seqs[2] = {{.n_tokens = 3, .pos0 = 5}, {.n_tokens = 1, .pos0 = 10}};
    struct roofline_cost c;
    roofline_step_cost(&shape, seqs, 2, &c);
    assert_int_equal(c.phase, ROOFLINE_MIXED);
    assert_int_equal(c.n_tokens, 4);
    assert_int_equal(c.n_seqs, 2);
    /* projections: 2 * (64*(64+2*32) + 64*64) MACs * 4 tokens * 2 layers */
    assert_true(c.flops_proj == 2.0 * 12288 * 4 * 2); /* 196608 */
    /* attention: keys attended: (3*5 + 3*4/2) + (10+1) = 32 rows*keys;
     * 2 (QK, AV) * 2 FLOPs * 4 heads * 16 dims * 32 * 2 layers */
    assert_true(c.flops_attn == 16384.0);
    /* mlp: 3 matrices of 64x128: 2*3*64*128 * 4 tokens * 2 layers */
    assert_true(c.flops_mlp == 393216.0);
    /* head: 2 * 64 * 100 per sequence, 2 sequences */
    assert_true(c.flops_head == 25600.0);
    assert_true(c.flops == 631808.0);
    /* weights: 1000 + 4 embedding rows of 128 */
    assert_true(c.bytes_weights == 1512.0);
    /* KV read: contexts (5+3) + (10+1) = 19 positions of 256 bytes */
    assert_true(c.bytes_kv_read == 4864.0);
    assert_true(c.bytes_kv_write == 1024.0);
    /* activations per token per layer: q(64+64) k,v 2*(64+32) o(64+64)
     * attn 2*64 gate,up 2*(64+128) down(128+64) = 1152 elements;
     * 4 bytes * (1152*4*2 + 64*4 embeddings + (64+100)*2 head) = 39200 */
    assert_true(c.bytes_act == 39200.0);
    assert_true(c.bytes == 46600.0);
}

static void test_cost_phases(void **state)
{
    (void)state;
    struct roofline_seq dec[3] = {{1, 0}, {1, 7}, {1, 100}};
    struct roofline_seq pre[2] = {{16, 0}, {2, 30}};
    struct roofline_cost c;
    roofline_step_cost(&shape, dec, 3, &c);
    assert_int_equal(c.phase, ROOFLINE_DECODE);
    /* one decode at position 0 attends to 1 key: 4*4*16*1*2 = 512 */
    roofline_step_cost(&shape, dec, 1, &c);
    assert_true(c.flops_attn == 512.0);
    assert_true(c.bytes_kv_read == 256.0);
    roofline_step_cost(&shape, pre, 2, &c);
    assert_int_equal(c.phase, ROOFLINE_PREFILL);
    /* 16 rows from 0: 16*17/2 = 136; 2 rows from 30: 2*30 + 3 = 63 */
    assert_true(c.flops_attn == 4.0 * 4 * 16 * (136 + 63) * 2);
    assert_string_equal(roofline_phase_name(ROOFLINE_MIXED), "mixed");
}

static void test_window(void **state)
{
    struct ofx *f = *state;
    struct roofline *rl = &f->rl;
    struct roofline_summary s;
    roofline_summary(rl, ROOFLINE_DECODE, &s);
    assert_int_equal(s.window, 0);
    assert_string_equal(s.bound, "unknown");

    /* Ceilings 1 GFLOP/s and 100 MB/s: ridge at 10 FLOP/byte. */
    struct roofline_ceilings ce = {.flops_per_s = 1e9, .bytes_per_s = 1e8, .measured = true};
    roofline_set_ceilings(rl, &ce);
    /* Decode steps of 2 MFLOP and 1 MB in 20 ms: intensity 2, 100 MFLOP/s
     * (10%), 50 MB/s (50%): bandwidth-bound. */
    struct roofline_cost c = {.flops = 2e6, .bytes = 1e6, .n_tokens = 4, .phase = ROOFLINE_DECODE};
    for (int i = 0; i < ROOFLINE_WINDOW + 10; i++)
        roofline_record_cost(rl, &c, 20000000);
    roofline_summary(rl, ROOFLINE_DECODE, &s);
    assert_int_equal(s.window, ROOFLINE_WINDOW);
    assert_int_equal(s.steps_total, ROOFLINE_WINDOW + 10);
    assert_true(s.intensity > 1.999 && s.intensity < 2.001);
    assert_true(s.flops_frac > 0.0999 && s.flops_frac < 0.1001);
    assert_true(s.bytes_frac > 0.4999 && s.bytes_frac < 0.5001);
    assert_true(s.tokens_per_s > 199.9 && s.tokens_per_s < 200.1);
    assert_true(s.ms_per_step > 19.99 && s.ms_per_step < 20.01);
    assert_string_equal(s.bound, "bandwidth");

    /* Prefill at intensity 50 is compute-bound; the window rolls. */
    struct roofline_cost p = {
        .flops = 5e7, .bytes = 1e6, .n_tokens = 64, .phase = ROOFLINE_PREFILL};
    roofline_record_cost(rl, &p, 100000000);
    roofline_summary(rl, ROOFLINE_PREFILL, &s);
    assert_int_equal(s.window, 1);
    assert_string_equal(s.bound, "compute");
    assert_true(s.flops_frac > 0.4999 && s.flops_frac < 0.5001);

    /* roofline_record without a shape does nothing; with one it costs. */
    struct roofline_seq one = {1, 0};
    roofline_record(rl, &one, 1, 1000);
    roofline_summary(rl, ROOFLINE_DECODE, &s);
    assert_int_equal(s.steps_total, ROOFLINE_WINDOW + 10);
    roofline_set_shape(rl, &shape);
    roofline_record(rl, &one, 1, 1000);
    uint64_t steps;
    double fl, by, sec;
    roofline_totals(rl, ROOFLINE_DECODE, &steps, &fl, &by, &sec);
    assert_int_equal(steps, ROOFLINE_WINDOW + 11);
}

static void test_measure_cpu(void **state)
{
    struct ofx *f = *state;
    assert_int_equal(backend_cpu_new(&f->be), 0);
    struct backend *be = f->be;
    struct roofline_ceilings c;
    int rc = roofline_measure(be, 1, &c);
    if (!be->compute) {
        assert_int_equal(rc, KVD_EUNSUPPORTED);
    } else {
        assert_int_equal(rc, 0);
        assert_true(c.measured);
        assert_true(c.bytes_per_s > 1e6); /* any machine copies more than 1 MB/s */
        assert_true(c.flops_per_s > 1e6);
        assert_non_null(strstr(c.how, "cpu"));
        printf("# cpu ceilings: %.2f GB/s, %.2f GFLOP/s (%s) in %.0f ms (copy %.0f ms)\n",
               c.bytes_per_s / 1e9, c.flops_per_s / 1e9, c.how, c.measure_ms, c.copy_ms);
    }
}

static void test_acct(void **state)
{
    struct acct *a = &((struct ofx *)*state)->a;
    const uint64_t ms = 1000000;
    struct acct_req r = {.tenant = 3,
                         .outcome = ACCT_COMPLETED,
                         .prompt = 100,
                         .cached = 64,
                         .completion = 11,
                         .preemptions = 2,
                         .t_arrive = 1000 * ms,
                         .t_sched = 1004 * ms,
                         .t_first = 1020 * ms,
                         .t_done = 1120 * ms};
    acct_request_done(a, &r);
    r.outcome = ACCT_CANCELLED;
    r.completion = 0;
    r.t_first = 0;
    r.preemptions = 0;
    acct_request_done(a, &r);
    struct acct_tenant t;
    acct_tenant_get(a, 3, &t);
    assert_int_equal(t.requests, 2);
    assert_int_equal(t.completed, 1);
    assert_int_equal(t.cancelled, 1);
    assert_int_equal(t.tokens_in, 200);
    assert_int_equal(t.tokens_cached, 128);
    assert_int_equal(t.tokens_out, 11);
    assert_int_equal(t.preemptions, 2);
    assert_true(t.queue_seconds > 0.00799 && t.queue_seconds < 0.00801);
    acct_tenant_get(a, 0, &t); /* never seen: zeros */
    assert_int_equal(t.requests, 0);
    acct_tenant_get(a, 999, &t);
    assert_int_equal(t.requests, 0);

    struct acct_hist h;
    acct_hist_get(a, ACCT_TTFT, &h); /* 20 ms: the le=0.025 bucket */
    assert_int_equal(h.count, 1);
    assert_int_equal(h.bucket[4], 1);
    acct_hist_get(a, ACCT_ITL, &h); /* 100 ms over 10 gaps: 10 x 10 ms */
    assert_int_equal(h.count, 10);
    assert_int_equal(h.bucket[3], 10);
    assert_true(h.sum > 0.0999 && h.sum < 0.1001);
    acct_hist_get(a, ACCT_E2E, &h); /* completed ones only */
    assert_int_equal(h.count, 1);
    acct_hist_get(a, ACCT_QUEUE, &h);
    assert_int_equal(h.count, 2);
    struct acct_hist big = {0};
    acct_hist_observe(&big, 1e9, 1); /* past the last bound: +Inf */
    assert_int_equal(big.bucket[ACCT_N_BUCKETS], 1);

    struct acct_sched sc = {.steps = 7, .waiting = 1, .running = 2, .swapped = 3, .generated = 40};
    acct_sched_set(a, &sc);
    struct acct_sched s;
    acct_sched_get(a, &s);
    assert_true(s.have_executor);
    assert_int_equal(s.steps, 7);
    assert_int_equal(s.swapped, 3);
    assert_int_equal(s.generated, 40);
    acct_sched_set(NULL, &sc); /* no-op */
}

static void test_parse_addr(void **state)
{
    (void)state;
    char host[64], err[256];
    uint16_t port;
    bool lo;
    assert_int_equal(
        metrics_parse_addr("127.0.0.1:9464", host, sizeof(host), &port, &lo, err, sizeof(err)), 0);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 9464);
    assert_true(lo);
    assert_int_equal(
        metrics_parse_addr("[::1]:0", host, sizeof(host), &port, &lo, err, sizeof(err)), 0);
    assert_string_equal(host, "::1");
    assert_true(lo);
    assert_int_equal(
        metrics_parse_addr("localhost:80", host, sizeof(host), &port, &lo, err, sizeof(err)), 0);
    assert_true(lo);
    assert_int_equal(
        metrics_parse_addr("10.1.2.3:9464", host, sizeof(host), &port, &lo, err, sizeof(err)), 0);
    assert_false(lo);
    assert_int_equal(
        metrics_parse_addr("0.0.0.0:9464", host, sizeof(host), &port, &lo, err, sizeof(err)), 0);
    assert_false(lo);
    const char *bad[] = {"",
                         "9464",
                         ":9464",
                         "127.0.0.1:",
                         "127.0.0.1:65536",
                         "127.0.0.1:-1",
                         "127.0.0.1:12x",
                         "example.com:80",
                         "[::1:80",
                         "::1:80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(
            metrics_parse_addr(bad[i], host, sizeof(host), &port, &lo, err, sizeof(err)),
            KVD_EBADREQ);
    assert_int_equal(metrics_parse_addr(NULL, host, sizeof(host), &port, &lo, err, sizeof(err)),
                     KVD_EBADREQ);
}

static char *render(const struct metrics_src *src)
{
    struct evbuffer *b = evbuffer_new();
    assert_non_null(b);
    assert_int_equal(metrics_render(src, b), 0);
    size_t n = evbuffer_get_length(b);
    char *s = malloc(n + 1);
    assert_non_null(s);
    evbuffer_remove(b, s, n);
    s[n] = 0;
    evbuffer_free(b);
    return s;
}

static void test_render(void **state)
{
    struct ofx *f = *state;
    assert_int_equal(backend_cpu_new(&f->be), 0);
    struct backend *be = f->be;
    struct kvmm_config mc = {
        .geom = {.layers = 2, .kv_heads = 2, .head_dim = 16, .dtype = KV_F16, .block_tokens = 4},
        .n_device_blocks = 8,
        .n_host_blocks = 4,
        .be = be};
    assert_int_equal(kvmm_new(&mc, &f->mm), 0);
    struct kvmm *mm = f->mm;
    struct kvmm_tenant_conf tc = {.name = "al\"ice",
                                  .max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    uint32_t tid, ns;
    kvmm_lock(mm);
    f->locked = true;
    assert_int_equal(kvmm_tenant_set(mm, &tc, &tid), 0);
    assert_int_equal(kvmm_tenant_namespace(mm, tid, &ns), 0);
    kvmm_seq_t seq;
    assert_int_equal(kvmm_seq_open(mm, 1, tid, ns, &seq), 0);
    assert_int_equal(kvmm_seq_extend(mm, 1, seq, 6), 0); /* 2 blocks */
    f->locked = false;
    kvmm_unlock(mm);

    struct acct *a = &f->a;
    struct roofline *rl = &f->rl;
    struct acct_req r = {.tenant = tid,
                         .prompt = 5,
                         .completion = 3,
                         .t_arrive = 1,
                         .t_sched = 2,
                         .t_first = 3000000,
                         .t_done = 9000000};
    acct_request_done(a, &r);
    struct roofline_seq one = {1, 3};
    roofline_set_shape(rl, &shape);
    roofline_record(rl, &one, 1, 1000000);
    size_t conns = 3;
    struct metrics_src src = {.mm = mm, .rl = rl, .acct = a, .backend = "cpu", .n_conns = &conns};
    char *text = f->text = render(&src);
    const char *want[] = {
        "# TYPE kvd_blocks gauge\n",
        "kvd_blocks{tier=\"device\",tenant=\"al\\\"ice\"} 2\n",
        "kvd_blocks{tier=\"host\",tenant=\"al\\\"ice\"} 0\n",
        "kvd_pool_blocks{tier=\"device\",state=\"total\"} 8\n",
        "kvd_pool_blocks{tier=\"device\",state=\"used\"} 2\n",
        "kvd_connections 3\n",
        "kvd_requests_total{outcome=\"completed\",tenant=\"al\\\"ice\"} 1\n",
        "kvd_tokens_total{kind=\"generated\",tenant=\"al\\\"ice\"} 3\n",
        "# TYPE kvd_time_to_first_token_seconds histogram\n",
        "kvd_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n",
        "kvd_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n",
        "kvd_time_to_first_token_seconds_count 1\n",
        "kvd_inter_token_latency_seconds_count 2\n",
        "kvd_phase_steps_total{phase=\"decode\"} 1\n",
        "kvd_sequences 1\n",
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        if (!strstr(text, want[i]))
            fail_msg("missing %s in:\n%s", want[i], text);
    /* Every non-comment line is NAME[{labels}] VALUE. */
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        char *sp = strrchr(line, ' ');
        assert_non_null(sp);
        char *end;
        strtod(sp + 1, &end);
        assert_true(*end == 0);
        assert_true(strncmp(line, "kvd_", 4) == 0);
    }
    free(text);

    /* Store mode: no roofline, no acct. */
    struct metrics_src bare = {.mm = mm, .backend = "cpu"};
    text = f->text = render(&bare);
    assert_null(strstr(text, "kvd_roofline"));
    assert_non_null(
        strstr(text, "kvd_requests_total{outcome=\"completed\",tenant=\"al\\\"ice\"} 0\n"));
    free(text);
    f->text = NULL;

    kvmm_lock(mm);
    kvmm_close_owner(mm, 1);
    kvmm_unlock(mm);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cost_mixed, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_cost_phases, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_window, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_measure_cpu, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_acct, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_parse_addr, ofx_setup, ofx_teardown),
        cmocka_unit_test_setup_teardown(test_render, ofx_setup, ofx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

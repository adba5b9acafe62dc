/* bench_evict: the prefix hit rate (match_tokens_hit / match_tokens_asked)
 * of one replayed trace under each eviction policy, side by side (a program,
 * not a test: numbers only). The trace is bench_trace.h's (a fixed seed, so
 * every policy sees the same requests: shared system prompts, multi-turn
 * conversations, one-off prompts). Each request runs as the server does: seq_open,
 * seq_match, seq_extend (rest of the prompt + the answer), seq_commit,
 * seq_close, on a device pool without a host tier. A second part runs the
 * same trace for two tenants of weights 1 and 3 sharing the pool (each its
 * own namespace and half of the requests) and prints each tenant's rate.
 * Usage: bench_evict [requests] (default 20000). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_trace.h"
#include "kvmm_impl.h"

struct result {
    double rate, rate_t[2];
};

static struct result replay(const struct trace *tr, uint32_t n_blocks,
                            enum kvmm_evict_policy policy, double scale_mult, bool two_tenants)
{
    struct backend *be;
    struct kvmm *mm;
    struct kvmm_config cfg = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = BT},
        .n_device_blocks = n_blocks,
        .evict_policy = policy};
    uint32_t tid[2], ns[2], scratch[256];
    struct result res = {0};

    if (backend_cpu_new(&be) || (cfg.be = be, kvmm_new(&cfg, &mm))) {
        fprintf(stderr, "kvmm setup failed\n");
        exit(1);
    }
    if (policy == KVMM_EVICT_HITS) /* before any insert: the heaps are keyed by it */
        mm->radix.hit_scale = (uint64_t)(mm->radix.hit_scale * scale_mult + 0.5);
    kvmm_lock(mm);
    for (uint32_t t = 0; t < (two_tenants ? 2u : 1u); t++) {
        struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                      .max_host_blocks = KVMM_UNLIMITED,
                                      .max_seqs = KVMM_UNLIMITED,
                                      .weight = two_tenants && t == 1 ? 3 : 1};
        snprintf(tc.name, sizeof tc.name, "t%u", t);
        if (kvmm_tenant_set(mm, &tc, &tid[t]) || kvmm_tenant_namespace(mm, tid[t], &ns[t]))
            exit(1);
    }
    for (size_t i = 0; i < tr->n; i++) {
        const struct req *q = &tr->r[i];
        uint32_t t = two_tenants ? q->tenant : 0;
        kvmm_seq_t s;
        size_t matched, shared, n = q->prompt.n;
        if (kvmm_seq_open(mm, 1, tid[t], ns[t], &s) ||
            kvmm_seq_match(mm, 1, s, q->prompt.v, n, &matched) ||
            kvmm_seq_extend(mm, 1, s, n - matched + q->gen) ||
            kvmm_seq_commit(mm, 1, s, q->prompt.v + matched, n - matched, &shared) ||
            kvmm_seq_commit(mm, 1, s, bench_trace_answer(tr, i, scratch), q->gen, &shared) ||
            kvmm_seq_close(mm, 1, s)) {
            fprintf(stderr, "request %zu (%zu tokens): %s\n", i, n, kvmm_errmsg(mm));
            exit(1);
        }
    }
    if (kvmm_check(mm)) {
        fprintf(stderr, "kvmm_check: %s\n", kvmm_errmsg(mm));
        exit(1);
    }
    struct kvmm_stats st;
    kvmm_stats(mm, &st);
    res.rate = (double)st.match_tokens_hit / (double)st.match_tokens_asked;
    for (uint32_t t = 0; two_tenants && t < 2; t++) {
        struct kvmm_tenant_stats ts;
        kvmm_tenant_stats(mm, tid[t], &ts);
        res.rate_t[t] = (double)ts.match_tokens_hit / (double)ts.match_tokens_asked;
    }
    kvmm_unlock(mm);
    kvmm_free(mm);
    backend_free(be);
    return res;
}

int main(int argc, char **argv)
{
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 20000;
    static const uint32_t pools[] = {512, 1024, 2048, 4096};
    struct trace tr;
    size_t asked = 0;

    bench_trace_make(&tr, n, 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < tr.n; i++)
        asked += tr.r[i].prompt.n;
    printf("trace: %zu requests, %zu prompt tokens (%u-token blocks), seed fixed\n", tr.n, asked,
           BT);
    printf("one tenant: prefix hit rate (match_tokens_hit / match_tokens_asked)\n");
    printf("(hits: the default scale, %u x pool blocks per doubling of hits; then other scales)\n",
           KVMM_HIT_SCALE_POOLS);
    printf("%12s %8s %8s %8s | %8s %8s %8s\n", "pool blocks", "lru", "hits", "gain", "1x", "2x",
           "32x");
    for (size_t p = 0; p < sizeof pools / sizeof pools[0]; p++) {
        static const double alt[] = {1, 2, 32};
        struct result lru = replay(&tr, pools[p], KVMM_EVICT_LRU, 1, false);
        struct result hits = replay(&tr, pools[p], KVMM_EVICT_HITS, 1, false);
        printf("%12u %7.1f%% %7.1f%% %+7.1f |", pools[p], 100 * lru.rate, 100 * hits.rate,
               100 * (hits.rate - lru.rate));
        for (size_t a = 0; a < 3; a++)
            printf(" %7.1f%%", 100 * replay(&tr, pools[p], KVMM_EVICT_HITS,
                                            alt[a] / KVMM_HIT_SCALE_POOLS, false)
                                         .rate);
        printf("\n");
    }
    printf("two tenants, weights 1 and 3, the same traffic (alternate requests):\n");
    printf("%12s %17s %17s\n", "pool blocks", "lru (w1 / w3)", "hits (w1 / w3)");
    for (size_t p = 0; p < sizeof pools / sizeof pools[0]; p++) {
        struct result lru = replay(&tr, pools[p], KVMM_EVICT_LRU, 1, true);
        struct result hits = replay(&tr, pools[p], KVMM_EVICT_HITS, 1, true);
        printf("%12u %7.1f%% / %5.1f%% %7.1f%% / %5.1f%%\n", pools[p], 100 * lru.rate_t[0],
               100 * lru.rate_t[1], 100 * hits.rate_t[0], 100 * hits.rate_t[1]);
    }
    bench_trace_free(&tr);
    return 0;
}

/* bench_disk_evict: the disk tier's eviction policy on a replayed trace (a program that prints
 * numbers, not a test): the prefix hit rate with the disk tier evicting by plain LRU against
 * its hits policy (GCLOCK credits from hits and tenant weights, disktier.h "eviction order"),
 * the memory tier the same in both (evict-policy hits). bench_trace.h's trace (fixed seed);
 * each request as the server runs it: the disk prefetch of its prompt, seq_open, seq_match,
 * seq_extend, seq_commit of the rest and of the answer, seq_close, then the disk writer
 * drained (kvmm_disk_flush), so every run sees the same order of events. A device pool of
 * POOL blocks and no host tier, over disk tiers of several sizes; the tier's directory is on
 * tmpfs (/dev/shm: the hit rate does not depend on the device; O_DIRECT falls back to
 * buffered I/O there). A second part runs two tenants of weights 1 and 3 (alternate
 * requests, each its own namespace) and prints each one's rate.
 * Usage: bench_disk_evict [requests] [pool] (default 10000, 1024). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "bench_trace.h"
#include "kvmm.h"

#define SLOT_BYTES 8192u /* a 512-byte block's slot: a header page and a data page */

struct res {
    double rate, rate_t[2];
    uint64_t restored, evictions, passes;
};

static void die(const char *what, const char *why)
{
    fprintf(stderr, "bench_disk_evict: %s: %s\n", what, why);
    exit(1);
}

static struct res replay(const struct trace *tr, uint32_t pool, uint32_t slots, bool disk_lru,
                         bool two_tenants)
{
    char dir[] = "/dev/shm/kvd-bench-evict.XXXXXX";
    if (!mkdtemp(dir))
        die("mkdtemp", "/dev/shm");
    struct backend *be;
    struct kvmm *mm;
    struct kvmm_config cfg = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = BT},
        .n_device_blocks = pool,
        .evict_policy = KVMM_EVICT_HITS};
    if (backend_cpu_new(&be))
        die("backend", "cpu");
    cfg.be = be;
    if (kvmm_new(&cfg, &mm))
        die("kvmm_new", "failed");
    uint32_t tid[2], ns[2], scratch[256];
    kvmm_lock(mm);
    for (uint32_t t = 0; t < (two_tenants ? 2u : 1u); t++) {
        struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                      .max_host_blocks = KVMM_UNLIMITED,
                                      .max_seqs = KVMM_UNLIMITED,
                                      .weight = two_tenants && t == 1 ? 3 : 1};
        snprintf(tc.name, sizeof tc.name, "t%u", t);
        if (kvmm_tenant_set(mm, &tc, &tid[t]) || kvmm_tenant_namespace(mm, tid[t], &ns[t]))
            die("tenant", kvmm_errmsg(mm));
    }
    kvmm_unlock(mm);
    struct kvmm_disk_conf dc = {.dir = dir,
                                .max_bytes = 4096 + (uint64_t)slots * SLOT_BYTES,
                                .writeback_ms = 600000,
                                .own_policy = true,
                                .policy = disk_lru ? KVMM_EVICT_LRU : KVMM_EVICT_HITS};
    struct kvd_error e = {0};
    if (kvmm_disk_open(mm, &dc, &e))
        die("kvmm_disk_open", e.message);
    struct res r = {0};
    for (size_t i = 0; i < tr->n; i++) {
        const struct req *q = &tr->r[i];
        uint32_t t = two_tenants ? q->tenant : 0;
        size_t matched, shared, n = q->prompt.n;
        kvmm_disk_prefetch(mm, tid[t], ns[t], q->prompt.v, n);
        kvmm_seq_t s;
        kvmm_lock(mm);
        if (kvmm_seq_open(mm, 1, tid[t], ns[t], &s) ||
            kvmm_seq_match(mm, 1, s, q->prompt.v, n, &matched) ||
            kvmm_seq_extend(mm, 1, s, n - matched + q->gen) ||
            kvmm_seq_commit(mm, 1, s, q->prompt.v + matched, n - matched, &shared) ||
            kvmm_seq_commit(mm, 1, s, bench_trace_answer(tr, i, scratch), q->gen, &shared) ||
            kvmm_seq_close(mm, 1, s))
            die("request", kvmm_errmsg(mm));
        kvmm_unlock(mm);
        size_t written, left;
        if (kvmm_disk_flush(mm, 60000, &written, &left))
            die("flush", "the writer did not drain");
    }
    struct kvmm_stats st;
    struct kvmm_disk_stats ds;
    kvmm_lock(mm);
    kvmm_stats(mm, &st);
    for (uint32_t t = 0; two_tenants && t < 2; t++) {
        struct kvmm_tenant_stats ts;
        kvmm_tenant_stats(mm, tid[t], &ts);
        r.rate_t[t] = (double)ts.match_tokens_hit / (double)ts.match_tokens_asked;
    }
    kvmm_unlock(mm);
    kvmm_disk_stats(mm, &ds);
    r.rate = (double)st.match_tokens_hit / (double)st.match_tokens_asked;
    r.restored = ds.restored;
    r.evictions = ds.tier.evictions;
    r.passes = ds.tier.evict_passes;
    kvmm_free(mm);
    backend_free(be);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_disk_evict: %s failed\n", cmd);
    return r;
}

int main(int argc, char **argv)
{
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 10000;
    uint32_t pool = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 1024;
    static const uint32_t sizes[] = {2048, 4096, 8192, 16384};
    struct trace tr;
    size_t asked = 0;
    bench_trace_make(&tr, n, 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < tr.n; i++)
        asked += tr.r[i].prompt.n;
    printf("trace: %zu requests, %zu prompt tokens (%u-token blocks), seed fixed; memory: %u "
           "device blocks (evict-policy hits), no host tier\n",
           tr.n, asked, BT, pool);
    printf("one tenant: prefix hit rate (memory and disk), blocks restored from disk\n");
    printf("%12s %18s %18s %8s %22s\n", "disk slots", "disk lru", "disk hits", "gain",
           "hits: evictions/passes");
    for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
        double t0 = (double)clock();
        struct res l = replay(&tr, pool, sizes[z], true, false);
        struct res h = replay(&tr, pool, sizes[z], false, false);
        printf("%12u %7.1f%% %9llu %7.1f%% %9llu %+7.1f %11llu/%-10llu (%.0f s)\n", sizes[z],
               100 * l.rate, (unsigned long long)l.restored, 100 * h.rate,
               (unsigned long long)h.restored, 100 * (h.rate - l.rate),
               (unsigned long long)h.evictions, (unsigned long long)h.passes,
               ((double)clock() - t0) / CLOCKS_PER_SEC);
        fflush(stdout);
    }
    printf("two tenants, weights 1 and 3, the same traffic (alternate requests):\n");
    printf("%12s %18s %18s\n", "disk slots", "lru (w1 / w3)", "hits (w1 / w3)");
    for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
        struct res l = replay(&tr, pool, sizes[z], true, true);
        struct res h = replay(&tr, pool, sizes[z], false, true);
        printf("%12u %7.1f%% / %5.1f%% %7.1f%% / %5.1f%%\n", sizes[z], 100 * l.rate_t[0],
               100 * l.rate_t[1], 100 * h.rate_t[0], 100 * h.rate_t[1]);
        fflush(stdout);
    }
    bench_trace_free(&tr);
    return 0;
}

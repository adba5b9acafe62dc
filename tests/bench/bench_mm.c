/* bench_mm: memory-manager benchmark (a program, not a test: numbers only).
 * Prints block alloc+free pairs/s, radix match latency for 1k- and 32k-token
 * prefixes with >= 1M tokens cached, radix insert rate, and swap-out/in
 * throughput on the cpu backend. Usage: bench_mm [cached_tokens] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checksum.h"
#include "hosttier.h"
#include "kvmm_impl.h"

/* CPU time of this thread by default: on a shared, loaded machine wall time
 * mostly measures the neighbours. BENCH_WALL=1 switches to wall time. */
static clockid_t bench_clock = CLOCK_THREAD_CPUTIME_ID;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(bench_clock, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

static void bench_alloc(struct backend *be)
{
    struct pool p;
    enum { N = 65536, ROUNDS = 200, BATCH = 64 };
    uint32_t ids[BATCH];
    double t0, dt;
    uint64_t pairs = 0;

    if (pool_init(&p, be, 64, N, 0)) {
        fprintf(stderr, "pool_init failed\n");
        exit(1);
    }
    /* Half the pool in use, so stacks are not trivially empty/full. */
    for (uint32_t i = 0; i < N / 2; i++)
        pool_alloc(&p, KVD_TIER_DEVICE, 0, &ids[0]);
    t0 = now_s();
    for (int r = 0; r < ROUNDS * 1000; r++) {
        for (int i = 0; i < BATCH; i++)
            pool_alloc(&p, KVD_TIER_DEVICE, 0, &ids[i]);
        for (int i = BATCH; i > 0; i--)
            pool_unref(&p, ids[i - 1]);
        pairs += BATCH;
    }
    dt = now_s() - t0;
    printf("pool alloc+free:      %.1f M pairs/s  (%llu pairs, batches of %d)\n", pairs / dt / 1e6,
           (unsigned long long)pairs, BATCH);
    pool_destroy(&p);
}

/* The same through the facade: one-block extend + truncate of a sequence,
 * with quota and floor checks and the zero-fill of the new block. */
static void bench_kvmm_alloc(struct backend *be)
{
    struct kvmm_config cfg = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = 16},
        .n_device_blocks = 1024,
        .be = be};
    struct kvmm_tenant_conf tc = {.name = "bench",
                                  .max_device_blocks = 512,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    struct kvmm *mm;
    uint32_t t, ns;
    kvmm_seq_t s;
    enum { N = 2000000 };

    if (kvmm_new(&cfg, &mm)) {
        fprintf(stderr, "kvmm setup failed\n");
        exit(1);
    }
    kvmm_lock(mm); /* held throughout: one thread, the lock rule (kvmm.h) */
    if (kvmm_tenant_set(mm, &tc, &t) || kvmm_tenant_namespace(mm, t, &ns) ||
        kvmm_seq_open(mm, 1, t, ns, &s)) {
        fprintf(stderr, "kvmm setup failed\n");
        exit(1);
    }
    double t0 = now_s();
    for (int i = 0; i < N; i++)
        if (kvmm_seq_extend(mm, 1, s, 16) || kvmm_seq_truncate(mm, 1, s, 16))
            exit(1);
    double dt = now_s() - t0;
    printf("kvmm extend+truncate: %.1f M pairs/s  (one %zu-byte block each, via the facade)\n",
           N / dt / 1e6, kvmm_block_bytes(mm));
    kvmm_unlock(mm);
    kvmm_free(mm);
}

static void bench_radix(struct backend *be, size_t cached_tokens)
{
    enum { BT = 16 };
    struct pool p;
    struct radix r;
    uint32_t ns, *tok;
    size_t n_blocks = cached_tokens / BT + 2048 * 2, chains, chain_tokens = 32768;
    struct radix_node **out = malloc(sizeof *out * 4096);
    double t0, dt;

    if (pool_init(&p, be, 64, (uint32_t)n_blocks, 0) || radix_init(&r, &p, BT) ||
        radix_tenants_reserve(&r, 1) || radix_ns_add(&r, &ns)) {
        fprintf(stderr, "radix setup failed\n");
        exit(1);
    }
    /* Chains of 32k tokens with random ids until >= cached_tokens. */
    chains = (cached_tokens + chain_tokens - 1) / chain_tokens;
    tok = malloc(sizeof *tok * chains * chain_tokens);
    for (size_t i = 0; i < chains * chain_tokens; i++)
        tok[i] = rnd32() % 128000;
    t0 = now_s();
    size_t inserted = 0;
    for (size_t c = 0; c < chains; c++) {
        struct radix_node *cur = radix_root(&r, ns);
        const uint32_t *t = tok + c * chain_tokens;
        for (size_t b = 0; b < chain_tokens / BT; b++) {
            uint32_t id;
            struct radix_node *n;
            if (pool_alloc(&p, KVD_TIER_DEVICE, 0, &id) ||
                radix_insert(&r, cur, t + b * BT, id, &n)) {
                fprintf(stderr, "insert failed\n");
                exit(1);
            }
            pool_unref(&p, id);
            radix_update(&r, n);
            cur = n;
            inserted++;
        }
    }
    dt = now_s() - t0;
    printf("radix insert:         %.2f M blocks/s = %.1f M tokens/s (%zu tokens cached, %zu "
           "nodes)\n",
           inserted / dt / 1e6, inserted * BT / dt / 1e6, inserted * BT, r.n_nodes);
    /* Machines here are shared: besides the mean, the median and the best
     * of many short batches show what the code costs without neighbours. */
    size_t lens[2] = {1024, 32768};
    for (int l = 0; l < 2; l++) {
        enum { BATCHES = 400 };
        size_t per = lens[l] == 1024 ? 50 : 4, got = 0, want = lens[l] / BT, q = 0;
        double bt_us[BATCHES], total = 0;
        for (int b = 0; b < BATCHES; b++) {
            double t1 = now_s();
            for (size_t i = 0; i < per; i++, q++)
                got += radix_match(&r, ns, tok + (q % chains) * chain_tokens, lens[l], out, 4096);
            bt_us[b] = (now_s() - t1) / per * 1e6;
            total += bt_us[b];
        }
        if (got != q * want) {
            fprintf(stderr, "match returned %zu blocks, expected %zu\n", got, q * want);
            exit(1);
        }
        qsort(bt_us, BATCHES, sizeof bt_us[0], cmp_double);
        printf("radix match %5zu tok: mean %.2f us, median %.2f us, best %.2f us per match "
               "(%zu blocks each, %zu matches rotating over %zu cached chains)\n",
               lens[l], total / BATCHES, bt_us[BATCHES / 2], bt_us[0], want, q, chains);
    }
    radix_destroy(&r);
    pool_destroy(&p);
    free(tok);
    free(out);
}

static void bench_swap(struct backend *be)
{
    /* Llama-3-8B geometry: 32 layers, 8 kv heads, head_dim 128, f16, 16
     * tokens: 2 MiB blocks. */
    const size_t bb = (size_t)32 * 2 * 8 * 16 * 128 * 2;
    enum { NB = 256, BATCH = 32, ROUNDS = 4 };
    struct pool p;
    uint32_t ids[NB];
    double t_out = 0, t_in = 0;

    if (pool_init(&p, be, bb, NB, NB)) {
        fprintf(stderr, "pool_init for swap failed\n");
        exit(1);
    }
    for (int i = 0; i < NB; i++) {
        pool_alloc(&p, KVD_TIER_DEVICE, 0, &ids[i]);
        memset(pool_block_ptr(&p, ids[i]), i, bb);
    }
    /* One untimed round trip first: the steady state of a long-lived daemon,
     * not the first-touch page faults of a fresh host arena. */
    if (hosttier_move(&p, ids, NB, KVD_TIER_HOST, NULL) ||
        hosttier_move(&p, ids, NB, KVD_TIER_DEVICE, NULL))
        exit(1);
    for (int r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < NB; i += BATCH) {
            double t0 = now_s();
            if (hosttier_move(&p, ids + i, BATCH, KVD_TIER_HOST, NULL))
                exit(1);
            t_out += now_s() - t0;
        }
        for (int i = 0; i < NB; i += BATCH) {
            double t0 = now_s();
            if (hosttier_move(&p, ids + i, BATCH, KVD_TIER_DEVICE, NULL))
                exit(1);
            t_in += now_s() - t0;
        }
    }
    double bytes = (double)NB * ROUNDS * bb;
    printf("swap-out (copy+checksum):   %.2f GB/s (%d x %zu KiB blocks, batches of %d)\n",
           bytes / t_out / 1e9, NB * ROUNDS, bb >> 10, BATCH);
    printf("swap-in  (verify+copy):     %.2f GB/s\n", bytes / t_in / 1e9);
    double t0 = now_s();
    uint64_t x = 0;
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < NB; i++)
            x ^= checksum64(pool_block_ptr(&p, ids[i]), bb, 0);
    printf("checksum alone:             %.2f GB/s (%llx)\n", bytes / (now_s() - t0) / 1e9,
           (unsigned long long)(x & 0xf));
    pool_destroy(&p);
}

int main(int argc, char **argv)
{
    struct backend *be;
    size_t cached = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 20;

    if (getenv("BENCH_WALL"))
        bench_clock = CLOCK_MONOTONIC;
    printf("bench_mm: %s time\n", bench_clock == CLOCK_MONOTONIC ? "wall" : "thread CPU");
    if (backend_cpu_new(&be))
        return 1;
    bench_alloc(be);
    bench_kvmm_alloc(be);
    bench_radix(be, cached);
    bench_swap(be);
    backend_free(be);
    return 0;
}

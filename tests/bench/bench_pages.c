/* bench_pages: fragmentation of the page budget (a program, not a test:
 * numbers only). Pools of different block sizes (models) attach to one
 * budget, grow, shrink and detach at random for N cycles (default 1000),
 * with tenants whose blocks are committed (cache that later requests must
 * evict, whole pages, from whichever pool holds it) or not; then every
 * sequence is closed and, for each block size, one pool fills the budget
 * until it is refused. The KV tokens that fit are compared with a fresh
 * budget's. cpu backend (memfd pages). Usage: bench_pages [cycles [MiB]] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvmm_impl.h"
#include "pages.h"

#define MAX_POOLS 4
#define MAX_SEQS 32
#define N_TENANTS 3

/* Block sizes whose pool pages differ: 64 KiB (32 a page), 96 KiB (pages
 * of 3 budget pages), 128 KiB, 40 KiB (pages of 5). */
static const struct kv_geom models[] = {
    {.layers = 4, .kv_heads = 4, .head_dim = 64, .dtype = KV_F16, .block_tokens = 16},
    {.layers = 6, .kv_heads = 4, .head_dim = 64, .dtype = KV_F16, .block_tokens = 16},
    {.layers = 4, .kv_heads = 8, .head_dim = 64, .dtype = KV_F16, .block_tokens = 16},
    {.layers = 5, .kv_heads = 2, .head_dim = 64, .dtype = KV_F16, .block_tokens = 16},
};
#define N_MODELS (sizeof models / sizeof models[0])

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

struct bpool {
    struct kvmm *mm;
    int model;
    uint32_t tenants[N_TENANTS], ns[N_TENANTS];
    kvmm_seq_t seqs[MAX_SEQS];
    bool open[MAX_SEQS];
};

static struct kvpages *budget(struct backend *be, uint64_t mib)
{
    struct kvpages_conf pc = {.bytes = {mib << 20, 0}};
    struct kvpages *pg;
    if (kvpages_new(be, &pc, &pg, NULL)) {
        fprintf(stderr, "bench_pages: no budget\n");
        exit(1);
    }
    return pg;
}

static void attach(struct bpool *p, struct backend *be, struct kvpages *pg, int model)
{
    static const char *names[N_TENANTS] = {"a", "b", "c"};
    struct kvmm_config c = {.geom = models[model], .pages = pg, .be = be};
    memset(p, 0, sizeof *p);
    p->model = model;
    if (kvmm_new(&c, &p->mm)) {
        fprintf(stderr, "bench_pages: kvmm_new failed\n");
        exit(1);
    }
    kvmm_lock(p->mm);
    for (int t = 0; t < N_TENANTS; t++) {
        struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                      .max_host_blocks = KVMM_UNLIMITED,
                                      .max_seqs = KVMM_UNLIMITED,
                                      .weight = 1};
        snprintf(tc.name, sizeof tc.name, "%s", names[t]);
        kvmm_tenant_set(p->mm, &tc, &p->tenants[t]);
        kvmm_tenant_namespace(p->mm, p->tenants[t], &p->ns[t]);
    }
    kvmm_unlock(p->mm);
}

static void detach(struct bpool *p)
{
    kvmm_free(p->mm); /* its sequences and cache go, and its pages back to the budget */
    p->mm = NULL;
}

/* Grows sequence i (opening it first): committed or not. */
static void grow(struct bpool *p, int i, uint32_t tokens)
{
    struct kvmm *mm = p->mm;
    kvmm_lock(mm);
    if (!p->open[i]) {
        int t = (int)rnd(N_TENANTS);
        if (kvmm_seq_open(mm, 1, p->tenants[t], p->ns[t], &p->seqs[i])) {
            kvmm_unlock(mm);
            return;
        }
        p->open[i] = true;
    }
    struct kvmm_seq_info in;
    kvmm_seq_info(mm, 1, p->seqs[i], &in);
    if (kvmm_seq_extend(mm, 1, p->seqs[i], tokens) == 0 && rnd(2)) {
        uint32_t *tok = malloc(sizeof *tok * (in.n_tokens + tokens));
        for (size_t k = 0; k < in.n_tokens + tokens; k++)
            tok[k] = (uint32_t)(i * 100000 + k);
        size_t shared;
        kvmm_seq_commit(mm, 1, p->seqs[i], tok + in.n_committed,
                        in.n_tokens + tokens - in.n_committed, &shared);
        free(tok);
    }
    kvmm_unlock(mm);
}

static void shrink(struct bpool *p, int i)
{
    kvmm_lock(p->mm);
    if (p->open[i])
        kvmm_seq_close(p->mm, 1, p->seqs[i]);
    p->open[i] = false;
    if (rnd(4) == 0) {
        size_t ev;
        kvmm_evict(p->mm, KVD_TIER_DEVICE, rnd(64), &ev);
    }
    kvmm_unlock(p->mm);
}

/* Tokens of one sequence of tenant 0 in pool p until it is refused. */
static uint64_t fill(struct bpool *p)
{
    kvmm_seq_t s;
    uint64_t n = 0;
    uint32_t bt = models[p->model].block_tokens;
    kvmm_lock(p->mm);
    kvmm_seq_open(p->mm, 7, p->tenants[0], p->ns[0], &s);
    for (uint32_t step = 256 * bt; step >= bt; step /= 2)
        while (kvmm_seq_extend(p->mm, 7, s, step) == 0)
            n += step;
    if (kvmm_check(p->mm))
        fprintf(stderr, "bench_pages: check: %s\n", kvmm_errmsg(p->mm));
    kvmm_close_owner(p->mm, 7);
    kvmm_unlock(p->mm);
    return n;
}

int main(int argc, char **argv)
{
    int cycles = argc > 1 ? atoi(argv[1]) : 1000;
    uint64_t mib = argc > 2 ? strtoull(argv[2], NULL, 10) : 256;
    struct backend *be;
    if (backend_cpu_new(&be))
        return 1;

    /* Fresh: one pool of each model alone on a new budget. */
    uint64_t fresh[N_MODELS];
    for (size_t m = 0; m < N_MODELS; m++) {
        struct kvpages *pg = budget(be, mib);
        struct bpool p;
        attach(&p, be, pg, (int)m);
        fresh[m] = fill(&p);
        detach(&p);
        kvpages_free(pg);
    }

    struct kvpages *pg = budget(be, mib);
    struct bpool pools[MAX_POOLS];
    uint64_t attaches = 0, detaches = 0, grows = 0, shrinks = 0, maps = 0, unmaps = 0;
    memset(pools, 0, sizeof pools);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int c = 0; c < cycles; c++) {
        struct bpool *p = &pools[rnd(MAX_POOLS)];
        uint32_t op = rnd(100);
        if (!p->mm) {
            attach(p, be, pg, (int)rnd(N_MODELS));
            attaches++;
        } else if (op < 6) {
            struct kvmm_stats st;
            kvmm_lock(p->mm);
            kvmm_stats(p->mm, &st);
            kvmm_unlock(p->mm);
            maps += st.page_maps;
            unmaps += st.page_unmaps;
            detach(p);
            detaches++;
        } else if (op < 70) {
            grow(p, (int)rnd(MAX_SEQS), 1 + rnd(64 * models[p->model].block_tokens));
            grows++;
        } else {
            shrink(p, (int)rnd(MAX_SEQS));
            shrinks++;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].mm) {
            struct kvmm_stats st;
            kvmm_lock(pools[i].mm);
            kvmm_stats(pools[i].mm, &st);
            kvmm_unlock(pools[i].mm);
            maps += st.page_maps;
            unmaps += st.page_unmaps;
        }
    struct kvpages_stats ps;
    kvpages_stats(pg, &ps);
    printf("bench_pages: %d cycles on a %llu MiB budget (%u pages of %llu KiB) in %.2f s: %llu "
           "attaches, %llu detaches, %llu grows, %llu shrinks; pages mapped %llu, unmapped %llu "
           "(detaching gives the rest back); %u pages in use at the end\n",
           cycles, (unsigned long long)mib, ps.pages[0],
           (unsigned long long)(ps.page_bytes[0] >> 10),
           (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9,
           (unsigned long long)attaches, (unsigned long long)detaches, (unsigned long long)grows,
           (unsigned long long)shrinks, (unsigned long long)maps, (unsigned long long)unmaps,
           ps.used[0]);

    /* Every sequence closed; the cache stays, in whichever pools are left. */
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].mm) {
            kvmm_lock(pools[i].mm);
            kvmm_close_owner(pools[i].mm, 1);
            kvmm_unlock(pools[i].mm);
        }
    double worst = 1.0;
    for (size_t m = 0; m < N_MODELS; m++) {
        struct bpool fresh_pool;
        attach(&fresh_pool, be, pg, (int)m); /* a model loaded now, after the churn */
        uint64_t got = fill(&fresh_pool);
        double r = fresh[m] ? (double)got / (double)fresh[m] : 0;
        if (r < worst)
            worst = r;
        kvmm_lock(fresh_pool.mm);
        struct kvmm_stats st;
        kvmm_stats(fresh_pool.mm, &st);
        kvmm_unlock(fresh_pool.mm);
        uint64_t ideal = (mib << 20) / (kv_block_bytes(&models[m]) / models[m].block_tokens);
        printf("model %zu: %zu-byte blocks, pool pages of %llu KiB: %llu tokens fit after the "
               "churn, %llu on a fresh budget: %.3f (%.3f of the budget's bytes)\n",
               m, kv_block_bytes(&models[m]), (unsigned long long)(st.page_bytes[0] >> 10),
               (unsigned long long)got, (unsigned long long)fresh[m], r,
               (double)got / (double)ideal);
        detach(&fresh_pool);
    }
    printf("worst ratio %.3f (goal >= 0.95)\n", worst);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].mm)
            detach(&pools[i]);
    kvpages_free(pg);
    backend_free(be);
    return worst >= 0.95 ? 0 : 2;
}

/* bench_evict: the prefix hit rate (match_tokens_hit / match_tokens_asked)
 * of one replayed trace under each eviction policy, side by side (a program,
 * not a test: numbers only). The trace (a fixed seed, so every policy sees
 * the same requests) mixes
 *   - prompts on shared system prompts: one of 48 (Zipf, s = 1.1, 256..1024
 *     tokens each) plus a 32..160-token question of its own,
 *   - multi-turn conversations: 64 live ones (Zipf, s = 0.8); a turn is a
 *     system prompt (its first), the whole history and a new 32..128-token
 *     message, and its 64..192-token answer joins the history; after 4..12
 *     turns a conversation is replaced by a new one,
 *   - one-off prompts: 256..2048 tokens seen once (a scan),
 * 45 / 35 / 20 percent. Each request runs as the server does: seq_open,
 * seq_match, seq_extend (rest of the prompt + the answer), seq_commit,
 * seq_close, on a device pool without a host tier. A second part runs the
 * same trace for two tenants of weights 1 and 3 sharing the pool (each its
 * own namespace and half of the requests) and prints each tenant's rate.
 * Usage: bench_evict [requests] (default 20000). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmm_impl.h"

#define BT 16
#define N_SYS 48
#define N_CONV 64

static uint64_t rng;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)((rng >> 11) % n);
}
static uint32_t rnd_in(uint32_t lo, uint32_t hi)
{
    return lo + rnd(hi - lo + 1);
}

/* Zipf(s) over [0, n) by its CDF. */
struct zipf {
    double cdf[N_SYS > N_CONV ? N_SYS : N_CONV];
    uint32_t n;
};
static void zipf_init(struct zipf *z, uint32_t n, double s)
{
    double sum = 0;
    z->n = n;
    for (uint32_t i = 0; i < n; i++)
        z->cdf[i] = (sum += 1.0 / pow(i + 1, s));
    for (uint32_t i = 0; i < n; i++)
        z->cdf[i] /= sum;
}
static uint32_t zipf_pick(const struct zipf *z)
{
    double u = (rnd(1u << 30) + 0.5) / (double)(1u << 30);
    uint32_t i = 0;
    while (i + 1 < z->n && z->cdf[i] < u)
        i++;
    return i;
}

static uint32_t next_token = 1; /* fresh ids: never seen before */

struct tokv {
    uint32_t *v;
    size_t n, cap;
};
static void tokv_push_fresh(struct tokv *t, size_t n)
{
    if (t->n + n > t->cap) {
        t->cap = (t->n + n) * 2;
        t->v = realloc(t->v, sizeof *t->v * t->cap);
        if (!t->v)
            exit(1);
    }
    for (size_t i = 0; i < n; i++)
        t->v[t->n++] = next_token++;
}
static void tokv_push(struct tokv *t, const uint32_t *v, size_t n)
{
    if (t->n + n > t->cap) {
        t->cap = (t->n + n) * 2;
        t->v = realloc(t->v, sizeof *t->v * t->cap);
        if (!t->v)
            exit(1);
    }
    memcpy(t->v + t->n, v, sizeof *v * n);
    t->n += n;
}

/* One request of the trace: the prompt and how many tokens are generated
 * (which, for a conversation, the caller appends to its history). */
struct req {
    uint32_t tenant; /* 0 or 1: which half of the two-tenant run */
    struct tokv prompt;
    uint32_t gen;
    int conv; /* conversation index, or -1 */
};

struct trace {
    struct req *r;
    size_t n;
};

/* The trace, and (for conversations) the answers, fixed up front: each
 * conversation turn's prompt holds the previous turns' answers. */
static void make_trace(struct trace *tr, size_t n, uint64_t seed)
{
    struct tokv sys[N_SYS] = {{0}}, hist[N_CONV] = {{0}};
    uint32_t turns_left[N_CONV] = {0};
    struct zipf zs, zc;

    rng = seed;
    next_token = 1;
    zipf_init(&zs, N_SYS, 1.1);
    zipf_init(&zc, N_CONV, 0.8);
    for (uint32_t i = 0; i < N_SYS; i++)
        tokv_push_fresh(&sys[i], rnd_in(256, 1024));
    tr->r = calloc(n, sizeof *tr->r);
    tr->n = n;
    for (size_t i = 0; i < n; i++) {
        struct req *q = &tr->r[i];
        uint32_t kind = rnd(100);
        q->tenant = (uint32_t)(i & 1);
        q->conv = -1;
        if (kind < 45) {
            const struct tokv *s = &sys[zipf_pick(&zs)];
            tokv_push(&q->prompt, s->v, s->n);
            tokv_push_fresh(&q->prompt, rnd_in(32, 160));
            q->gen = rnd_in(32, 128);
        } else if (kind < 80) {
            uint32_t c = zipf_pick(&zc);
            struct tokv *h = &hist[c];
            if (turns_left[c] == 0) { /* a new conversation in this slot */
                const struct tokv *s = &sys[zipf_pick(&zs)];
                h->n = 0;
                tokv_push(h, s->v, s->n);
                turns_left[c] = rnd_in(4, 12);
            }
            turns_left[c]--;
            tokv_push_fresh(h, rnd_in(32, 128)); /* the user's message */
            tokv_push(&q->prompt, h->v, h->n);
            q->gen = rnd_in(64, 192);
            tokv_push_fresh(h, q->gen); /* the answer, in the next turn's prompt */
            q->conv = (int)c;
        } else {
            tokv_push_fresh(&q->prompt, rnd_in(256, 2048));
            q->gen = rnd_in(32, 128);
        }
    }
    for (uint32_t i = 0; i < N_SYS; i++)
        free(sys[i].v);
    for (uint32_t i = 0; i < N_CONV; i++)
        free(hist[i].v);
}

/* The answer tokens of request i: for a conversation, exactly what the next
 * turn's prompt repeats (the history after the prompt); otherwise fresh. */
static const uint32_t *answer(const struct trace *tr, size_t i, uint32_t *scratch)
{
    const struct req *q = &tr->r[i];
    if (q->conv >= 0)
        for (size_t j = i + 1; j < tr->n; j++) {
            const struct req *nx = &tr->r[j];
            if (nx->conv == q->conv && nx->prompt.n > q->prompt.n + q->gen &&
                memcmp(nx->prompt.v, q->prompt.v, sizeof(uint32_t) * q->prompt.n) == 0)
                return nx->prompt.v + q->prompt.n;
            if (nx->conv == q->conv)
                break; /* the slot started a new conversation */
        }
    for (uint32_t k = 0; k < q->gen; k++)
        scratch[k] = 0x40000000u + (uint32_t)(i * 256 + k);
    return scratch;
}

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
            kvmm_seq_commit(mm, 1, s, answer(tr, i, scratch), q->gen, &shared) ||
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

    make_trace(&tr, n, 0x9E3779B97F4A7C15ull);
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
    for (size_t i = 0; i < tr.n; i++)
        free(tr.r[i].prompt.v);
    free(tr.r);
    return 0;
}

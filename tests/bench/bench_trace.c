/* bench_trace: the replayed request trace of the cache benchmarks
 * (bench_evict, bench_remote, bench_disk_evict): shared system prompts,
 * multi-turn conversations and one-off prompts from a fixed seed
 * (bench_trace.h says the mix). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_trace.h"

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

/* The trace, and (for conversations) the answers, fixed up front: each
 * conversation turn's prompt holds the previous turns' answers. */
void bench_trace_make(struct trace *tr, size_t n, uint64_t seed)
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
const uint32_t *bench_trace_answer(const struct trace *tr, size_t i, uint32_t *scratch)
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

void bench_trace_free(struct trace *tr)
{
    for (size_t i = 0; i < tr->n; i++)
        free(tr->r[i].prompt.v);
    free(tr->r);
    tr->r = NULL;
    tr->n = 0;
}

/* Token sampling (see sampler.h): greedy argmax, or temperature softmax with
 * top-k / top-p truncation and one draw from the request's own xoshiro256**
 * stream. Never touches global state, so batching cannot change a draw. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

#include "kvd/status.h"

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t r = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

void sampler_init(struct sampler *s, const struct sampler_params *p)
{
    uint64_t x = p->seed;
    s->p = *p;
    for (int i = 0; i < 4; i++)
        s->s[i] = splitmix64(&x);
}

double sampler_uniform(struct sampler *s)
{
    return (double)(xoshiro_next(s->s) >> 11) * (1.0 / 9007199254740992.0);
}

/* NaN compares as -inf so a broken row still yields a valid id. */
static float clean(float v)
{
    return isnan(v) ? -INFINITY : v;
}

static uint32_t argmax(const float *logits, uint32_t n)
{
    uint32_t best = 0;
    float bv = clean(logits[0]);
    for (uint32_t i = 1; i < n; i++) {
        float v = clean(logits[i]);
        if (v > bv) {
            bv = v;
            best = i;
        }
    }
    return best;
}

/* A candidate: scaled logit, later its unnormalised probability. Sorting
 * (value, id) pairs keeps the comparator free of global context. */
struct cand {
    float v;
    uint32_t id;
};

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

static int scratch_reserve(struct sampler_scratch *sc, size_t n)
{
    if (sc->cap >= n)
        return 0;
    void *buf = realloc(sc->buf, n * sizeof(struct cand));
    if (!buf)
        return KVD_ENOMEM;
    sc->buf = buf;
    sc->cap = n;
    return 0;
}

void sampler_scratch_free(struct sampler_scratch *sc)
{
    free(sc->buf);
    sc->buf = NULL;
    sc->cap = 0;
}

int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out)
{
    const struct sampler_params *p = &s->p;
    if (n_vocab == 0)
        return KVD_EINTERNAL;
    if (!(p->temperature > 0.0f)) {
        *out = argmax(logits, n_vocab);
        return 0;
    }
    int rc = scratch_reserve(sc, n_vocab);
    if (rc)
        return rc;
    struct cand *c = sc->buf;
    float inv_t = 1.0f / p->temperature;
    for (uint32_t i = 0; i < n_vocab; i++) {
        c[i].v = clean(logits[i]) * inv_t;
        c[i].id = i;
    }
    size_t n = n_vocab;
    bool truncate = (p->top_k > 0 && p->top_k < n_vocab) || p->top_p < 1.0f;
    if (truncate) {
        /* Sorted by probability (ties by id), so top-k and top-p are prefixes
         * and the order (hence the draw) does not depend on anything but the
         * logits. O(V log V): a few ms at V = 32k on cpu, small next to a
         * forward step. */
        qsort(c, n, sizeof(*c), cand_cmp);
        if (p->top_k > 0 && p->top_k < n)
            n = p->top_k;
    }
    float mx = c[0].v;
    if (!truncate)
        for (size_t i = 1; i < n; i++)
            if (c[i].v > mx)
                mx = c[i].v;
    if (mx == -INFINITY) {
        *out = argmax(logits, n_vocab);
        return 0;
    }
    /* Probabilities in double: stable sums over 32k terms. Stored back into
     * c[i].v as f32 weights relative to the max (exp <= 1). */
    double total = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = exp((double)c[i].v - (double)mx);
        c[i].v = (float)e;
        total += e;
    }
    if (p->top_p < 1.0f) {
        double need = (double)p->top_p * total, acc = 0.0;
        size_t keep = n;
        for (size_t i = 0; i < n; i++) {
            acc += c[i].v;
            if (acc >= need) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        total = 0.0;
        for (size_t i = 0; i < n; i++)
            total += c[i].v;
    }
    double u = sampler_uniform(s) * total, acc = 0.0;
    for (size_t i = 0; i < n; i++) {
        acc += c[i].v;
        if (u < acc) {
            *out = c[i].id;
            return 0;
        }
    }
    *out = c[n - 1].id; /* u landed on rounding slack at the very end */
    return 0;
}

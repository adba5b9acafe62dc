/* sampler_pick (see sampler_pick.h): greedy argmax, or temperature softmax
 * with top-k / top-p truncation and one draw at the row's uniform.
 *
 * The truncations and the draw all ask one question: walking the
 * candidates in order, where does the running weight first exceed t? The
 * answer is found by radix select over a 64-bit key that encodes the order
 * (bigger key = earlier), eight bits a pass from the top: a histogram of
 * weight per digit, then the digit where t lands. That is O(V) with no
 * sort, and it is what kernels/sample.cu does with one thread block per
 * row; weights are integers so both get the same answer. */
#include "sampler_pick.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

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

/* A candidate: its order key and its weight. */
struct cand {
    uint64_t key, w;
};

/* f32 bits mapped so that unsigned order is float order (-inf lowest). */
static uint32_t ord_float(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Walking c[0..n) by descending key, the key of the candidate at which the
 * running mass (1 each when by_count, else w) first exceeds t; t must be
 * below the total. Works in tmp[n]. */
static uint64_t select_key(const struct cand *c, size_t n, struct cand *tmp, bool by_count,
                           uint64_t t)
{
    uint64_t prefix = 0;
    const struct cand *src = c;
    for (int shift = 56; shift >= 0; shift -= 8) {
        uint64_t hist[256] = {0};
        for (size_t i = 0; i < n; i++)
            hist[src[i].key >> shift & 255] += by_count ? 1 : src[i].w;
        int d = 255;
        for (; d > 0 && t >= hist[d]; d--)
            t -= hist[d];
        prefix |= (uint64_t)d << shift;
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if ((src[i].key >> shift & 255) == (uint64_t)d)
                tmp[m++] = src[i];
        src = tmp;
        n = m;
    }
    return prefix;
}

/* Keeps the candidates with key >= min (order not kept); returns how many. */
static size_t keep_from(struct cand *c, size_t n, uint64_t min, uint64_t *total)
{
    size_t m = 0;
    *total = 0;
    for (size_t i = 0; i < n; i++)
        if (c[i].key >= min) {
            *total += c[i].w;
            c[m++] = c[i];
        }
    return m;
}

static int scratch_reserve(struct sampler_scratch *sc, size_t n)
{
    if (sc->cap >= n)
        return 0;
    void *buf = realloc(sc->buf, 2 * n * sizeof(struct cand));
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

/* A candidate of the typical_p stage: its index in c and its score. */
struct typ {
    double score;
    uint64_t key;
    size_t i;
};

static int typ_cmp(const void *a, const void *b)
{
    const struct typ *x = a, *y = b;
    if (x->score != y->score)
        return x->score < y->score ? -1 : 1;
    return x->key > y->key ? -1 : x->key < y->key;
}

/* Keeps the fewest candidates, by ascending distance of their surprise
 * from the entropy, whose weight reaches ceil(p * total). */
static int keep_typical(struct cand *c, size_t n, double p, uint64_t *total, size_t *out_n)
{
    struct typ *t = malloc(n * sizeof *t);
    if (!t)
        return KVD_ENOMEM;
    double tot = (double)*total, h = 0;
    for (size_t i = 0; i < n; i++)
        if (c[i].w) {
            double q = (double)c[i].w / tot;
            h -= q * log(q);
        }
    for (size_t i = 0; i < n; i++) {
        double q = (double)c[i].w / tot;
        t[i] =
            (struct typ){.score = c[i].w ? fabs(-log(q) - h) : INFINITY, .key = c[i].key, .i = i};
    }
    qsort(t, n, sizeof *t, typ_cmp);
    uint64_t need = (uint64_t)ceil(p * tot), acc = 0;
    need = need < 1 ? 1 : need > *total ? *total : need;
    size_t m = 0;
    while (m < n && acc < need)
        acc += c[t[m++].i].w;
    /* Mark the kept ones (weight bit 63 is free: weights are below 2^62). */
    for (size_t i = 0; i < m; i++)
        c[t[i].i].w |= 1ull << 63;
    free(t);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (c[i].w >> 63) {
            c[i].w &= ~(1ull << 63);
            c[k++] = c[i];
        }
    *total = acc;
    *out_n = k;
    return 0;
}

int sampler_pick(const struct sample_row *row, struct sampler_scratch *sc, const float *logits,
                 uint32_t n_vocab, uint32_t *out)
{
    return sampler_pick_trunc(row, NULL, sc, logits, n_vocab, out);
}

int sampler_pick_trunc(const struct sample_row *row, const struct sample_trunc *tr,
                       struct sampler_scratch *sc, const float *logits, uint32_t n_vocab,
                       uint32_t *out)
{
    *out = 0;
    if (n_vocab == 0)
        return KVD_EINTERNAL;
    if (row->skip)
        return 0;
    if (!(row->temperature > 0.0f)) {
        *out = argmax(logits, n_vocab);
        return 0;
    }
    float inv_t = 1.0f / row->temperature, mx = -INFINITY;
    for (uint32_t i = 0; i < n_vocab; i++) {
        float v = clean(logits[i]) * inv_t;
        mx = v > mx ? v : mx;
    }
    if (mx == -INFINITY) {
        *out = argmax(logits, n_vocab);
        return 0;
    }
    bool top_k = row->top_k > 0 && row->top_k < n_vocab, top_p = row->top_p < 1.0f;
    bool typical = tr && tr->typical_p > 0.0f && tr->typical_p < 1.0f,
         min_p = tr && tr->min_p > 0.0f;
    bool sorted = top_k || top_p || typical || min_p;
    int rc = scratch_reserve(sc, n_vocab);
    if (rc)
        return rc;
    struct cand *c = sc->buf, *tmp = c + n_vocab;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n_vocab; i++) {
        float v = clean(logits[i]) * inv_t;
        uint64_t low = 0xffffffffu - i;
        c[i].key = sorted ? (uint64_t)ord_float(v) << 32 | low : low;
        c[i].w = (uint64_t)(exp((double)v - (double)mx) * SAMPLE_FX_ONE + 0.5);
        total += c[i].w;
    }
    size_t n = n_vocab;
    if (top_k)
        n = keep_from(c, n, select_key(c, n, tmp, true, row->top_k - 1), &total);
    if (typical && (rc = keep_typical(c, n, (double)tr->typical_p, &total, &n)))
        return rc;
    if (top_p) {
        /* total >= SAMPLE_FX_ONE: the largest v has exactly that weight. */
        uint64_t need = (uint64_t)ceil((double)row->top_p * (double)total);
        need = need < 1 ? 1 : need > total ? total : need;
        n = keep_from(c, n, select_key(c, n, tmp, false, need - 1), &total);
    }
    if (min_p) {
        /* Relative to the largest weight left (min_p <= 1 keeps it). */
        uint64_t max_w = 0;
        for (size_t i = 0; i < n; i++)
            max_w = c[i].w > max_w ? c[i].w : max_w;
        uint64_t min_w = (uint64_t)ceil((double)tr->min_p * (double)max_w);
        size_t m = 0;
        total = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].w >= min_w) {
                total += c[i].w;
                c[m++] = c[i];
            }
        n = m;
    }
    uint64_t t = (uint64_t)(row->u * (double)total);
    t = t >= total ? total - 1 : t;
    if (sorted) {
        *out = 0xffffffffu - (uint32_t)select_key(c, n, tmp, false, t);
        return 0;
    }
    /* Nothing truncated: id order, so one running sum finds it. */
    uint64_t acc = 0;
    for (uint32_t i = 0; i < n_vocab; i++) {
        acc += c[i].w;
        if (acc > t) {
            *out = i;
            return 0;
        }
    }
    *out = n_vocab - 1; /* unreachable: t < total */
    return 0;
}

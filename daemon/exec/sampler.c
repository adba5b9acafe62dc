/* The executor's side of sampling (see sampler.h): each request's own
 * xoshiro256** stream, seeded by splitmix64, and the row it hands to the
 * backend's sample op each step. The pick itself is sampler_pick
 * (backend/sampler_pick.c). Never touches global state, so batching cannot
 * change a draw. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

void sampler_next_row(struct sampler *s, struct sample_row *row)
{
    *row = (struct sample_row){
        .temperature = s->p.temperature, .top_k = s->p.top_k, .top_p = s->p.top_p};
    if (s->p.temperature > 0.0f)
        row->u = sampler_uniform(s);
}

int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out)
{
    struct sample_row row;
    sampler_next_row(s, &row);
    return sampler_pick(&row, sc, logits, n_vocab, out);
}

bool sampler_on_host(const struct sampler *s)
{
    const struct sampler_params *p = &s->p;
    bool rep = p->repeat_penalty > 0.0f && p->repeat_penalty != 1.0f;
    bool pen = p->repeat_last_n > 0 &&
               (rep || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f);
    return pen || p->n_bias > 0 || p->min_p > 0.0f || (p->typical_p > 0.0f && p->typical_p < 1.0f);
}

static int u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

void sampler_adjust(const struct sampler_params *p, const uint32_t *toks, size_t n_toks, float *row,
                    uint32_t n_vocab, uint32_t *counts)
{
    for (uint32_t i = 0; i < p->n_bias; i++)
        if (p->bias[i].id < n_vocab)
            row[p->bias[i].id] += p->bias[i].bias;
    float rep = p->repeat_penalty > 0.0f ? p->repeat_penalty : 1.0f;
    if (p->repeat_last_n == 0 ||
        (rep == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f))
        return;
    size_t n = n_toks < p->repeat_last_n ? n_toks : p->repeat_last_n;
    memcpy(counts, toks + n_toks - n, n * sizeof *counts);
    qsort(counts, n, sizeof *counts, u32_cmp);
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && counts[j] == counts[i])
            j++;
        uint32_t id = counts[i];
        float c = (float)(j - i);
        if (id < n_vocab) {
            float l = row[id];
            l = l <= 0.0f ? l * rep : l / rep;
            row[id] = l - (c * p->frequency_penalty + p->presence_penalty);
        }
        i = j;
    }
}

int sampler_sample_host(struct sampler *s, struct sampler_scratch *sc, const uint32_t *toks,
                        size_t n_toks, float *logits, uint32_t n_vocab, uint32_t *counts,
                        uint32_t *out)
{
    struct sample_row row;
    sampler_next_row(s, &row);
    sampler_adjust(&s->p, toks, n_toks, logits, n_vocab, counts);
    struct sample_trunc t = {.typical_p = s->p.typical_p, .min_p = s->p.min_p};
    return sampler_pick_trunc(&row, &t, sc, logits, n_vocab, out);
}

uint32_t sampler_logprobs(const float *logits, uint32_t n_vocab, uint32_t chosen, uint32_t n_top,
                          struct sampler_logprob *out)
{
    struct {
        uint32_t id;
        float v;
    } top[SAMPLER_MAX_TOP_LOGPROBS];
    if (n_top > SAMPLER_MAX_TOP_LOGPROBS)
        n_top = SAMPLER_MAX_TOP_LOGPROBS;
    if (n_top > n_vocab)
        n_top = n_vocab;
    /* The row's maximum, and the n_top largest by insertion (ids ascend,
     * so a later equal value goes after: lower id first). */
    uint32_t k = 0;
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n_vocab; i++) {
        float v = isnan(logits[i]) ? -INFINITY : logits[i];
        if (v > mx)
            mx = v;
        if (n_top == 0 || (k == n_top && !(v > top[k - 1].v)))
            continue;
        uint32_t j = k < n_top ? k++ : k - 1;
        while (j > 0 && top[j - 1].v < v) {
            top[j] = top[j - 1];
            j--;
        }
        top[j].id = i;
        top[j].v = v;
    }
    /* log-sum-exp around the maximum, in double: every term <= 1, the sum
     * >= 1 (a row of -inf only: every logprob is -inf). */
    double lse = -INFINITY;
    if (mx > -INFINITY) {
        double sum = 0;
        for (uint32_t i = 0; i < n_vocab; i++)
            if (!isnan(logits[i]))
                sum += exp((double)logits[i] - (double)mx);
        lse = (double)mx + log(sum);
    }
    float c = chosen < n_vocab && !isnan(logits[chosen]) ? logits[chosen] : -INFINITY;
    out[0].id = chosen;
    out[0].logprob = lse > -INFINITY ? (float)((double)c - lse) : -INFINITY;
    for (uint32_t i = 0; i < k; i++) {
        out[1 + i].id = top[i].id;
        out[1 + i].logprob = lse > -INFINITY ? (float)((double)top[i].v - lse) : -INFINITY;
    }
    return k;
}

/* The executor's side of sampling (see sampler.h): each request's own
 * xoshiro256** stream, seeded by splitmix64, and the row it hands to the
 * backend's sample op each step. The pick itself is sampler_pick
 * (backend/sampler_pick.c). Never touches global state, so batching cannot
 * change a draw. */
#include "sampler.h"

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

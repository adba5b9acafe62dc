/* Token sampling for the executor: greedy, temperature, top-k, top-p, with a
 * per-request PRNG (xoshiro256** seeded by splitmix64 from the request's
 * seed) so a seeded request draws the same tokens alone or in any batch. */
#ifndef KVD_SAMPLER_H
#define KVD_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sampler_params {
    float temperature; /* 0 = greedy (argmax, lowest id on ties) */
    uint32_t top_k;    /* 0 = off */
    float top_p;       /* (0, 1]; 1 = off */
    uint64_t seed;
};

/* One request's sampling state. Plain value: copy it freely; no heap. */
struct sampler {
    struct sampler_params p;
    uint64_t s[4]; /* xoshiro256** state */
};

/* Scratch reused across calls by one thread (the executor): n_vocab
 * (value, id) candidates, 8 bytes each. Owned by the caller; zero-init. */
struct sampler_scratch {
    void *buf;
    size_t cap; /* candidates */
};

void sampler_init(struct sampler *s, const struct sampler_params *p);
/* Next uniform double in [0, 1) from the request's stream (53 bits). */
double sampler_uniform(struct sampler *s);
/* Picks a token from logits [n_vocab] (not modified). Greedy when
 * temperature == 0; otherwise softmax(logits / T) restricted to the top_k
 * most likely ids, then to the smallest prefix (by probability, ties by id)
 * whose mass reaches top_p, renormalised, and one draw from the PRNG.
 * Returns 0 or KVD_ENOMEM (scratch growth). */
int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out);
void sampler_scratch_free(struct sampler_scratch *sc);

#endif

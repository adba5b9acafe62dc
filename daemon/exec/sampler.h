/* Token sampling for the executor: greedy, temperature, top-k, top-p, with a
 * per-request PRNG (xoshiro256** seeded by splitmix64 from the request's
 * seed) so a seeded request draws the same random numbers alone or in any
 * batch (the tokens are the same when the logits are: batching moves them by
 * rounding only, docs/architecture.md "Sampling").
 *
 * A step's sampling is split in two so a backend can pick on the device:
 * the host draws the request's uniform for the step (sampler_next_row),
 * then the pick is a pure function of (row, logits) (sampler_pick, backend/sampler_pick.h;
 * kernels/sample.cu does the same integer arithmetic on the GPU). */
#ifndef KVD_SAMPLER_H
#define KVD_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sampler_pick.h"

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

void sampler_init(struct sampler *s, const struct sampler_params *p);
/* Next uniform double in [0, 1) from the request's stream (53 bits). */
double sampler_uniform(struct sampler *s);
/* The row for this step: s's parameters, and (temperature > 0 only) the
 * next uniform from s's stream. */
void sampler_next_row(struct sampler *s, struct sample_row *row);
/* sampler_next_row, then sampler_pick. */
int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out);

#endif

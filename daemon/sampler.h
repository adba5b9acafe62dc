/* Token sampling for the executor: greedy, temperature, top-k, top-p, with a
 * per-request PRNG (xoshiro256** seeded by splitmix64 from the request's
 * seed) so a seeded request draws the same random numbers alone or in any
 * batch (the tokens are the same when the logits are: batching moves them by
 * rounding only, docs/architecture.md "Sampling").
 *
 * A step's sampling is split in two so a backend can pick on the device:
 * the host draws the request's uniform for the step (sampler_next_row),
 * then the pick is a pure function of (row, logits) (sampler_pick here;
 * kernels/sample.cu does the same integer arithmetic on the GPU). */
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

/* One row's pick for one step, as handed to a backend (24 bytes; the same
 * layout as kernels.h's struct kvd_k_sample_row). */
struct sample_row {
    float temperature; /* <= 0 (or NaN): greedy */
    uint32_t top_k;    /* 0 = off */
    float top_p;       /* >= 1 = off */
    uint32_t skip;     /* 1: no token wanted (the pick is 0) */
    double u;          /* the request's uniform in [0, 1) for this step */
};

/* Candidate weights are fixed point, round(exp(v - max) * 2^38), so a
 * vocabulary of up to 2^24 (the model loader's bound) sums below 2^62. */
#define SAMPLE_FX_ONE 0x1p38

/* Scratch reused across calls by one thread: 2 * n_vocab candidates of 16
 * bytes. Owned by the caller; zero-init. */
struct sampler_scratch {
    void *buf;
    size_t cap; /* candidates */
};

void sampler_init(struct sampler *s, const struct sampler_params *p);
/* Next uniform double in [0, 1) from the request's stream (53 bits). */
double sampler_uniform(struct sampler *s);
/* The row for this step: s's parameters, and (temperature > 0 only) the
 * next uniform from s's stream. */
void sampler_next_row(struct sampler *s, struct sample_row *row);
/* Picks a token from logits [n_vocab] (not modified). Greedy when
 * temperature <= 0: argmax, NaN as -inf, lowest id on ties. Otherwise the
 * scaled logits v = logit / T (f32; NaN as -inf) get the weights
 * w = round(exp(v - max v) * 2^38) (integers, so every sum is exact and
 * any summation order gives the same result); the candidates are ordered
 * by (v descending, id ascending); top_k keeps the first k; top_p keeps
 * the shortest prefix whose weight reaches ceil(top_p * total); the draw
 * is the first candidate whose running weight exceeds floor(u * total),
 * walking that order, or id order when nothing was truncated. Returns 0
 * or KVD_ENOMEM (scratch growth). */
int sampler_pick(const struct sample_row *row, struct sampler_scratch *sc, const float *logits,
                 uint32_t n_vocab, uint32_t *out);
/* sampler_next_row, then sampler_pick. */
int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out);
void sampler_scratch_free(struct sampler_scratch *sc);

#endif

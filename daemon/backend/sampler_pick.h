/* sampler_pick: the pick of one token from one row of logits, given the
 * row's sampling parameters and the request's uniform for the step: a pure
 * function, and the reference for every backend's sample op (the cpu
 * backend calls it; kernels/sample.cu does the same integer arithmetic on
 * the GPU). The per-request random stream that fills a row is the
 * executor's (exec/sampler.h). */
#ifndef KVD_SAMPLER_PICK_H
#define KVD_SAMPLER_PICK_H

#include <stddef.h>
#include <stdint.h>

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

/* The truncations the backends' sample op does not have (the executor
 * picks on the host when a row asks for one). */
struct sample_trunc {
    float typical_p; /* <= 0 or >= 1 = off */
    float min_p;     /* <= 0 = off */
};

/* sampler_pick with t (NULL: none), in llama.cpp's order after the
 * temperature: top_k, typical_p, top_p, min_p, then the draw. typical_p
 * keeps, by ascending |-log p - H| (H the entropy of the candidates left;
 * ties by the candidate order), the fewest candidates whose weight reaches
 * ceil(typical_p * total); min_p keeps the candidates whose weight is at
 * least ceil(min_p * the largest weight). */
int sampler_pick_trunc(const struct sample_row *row, const struct sample_trunc *t,
                       struct sampler_scratch *sc, const float *logits, uint32_t n_vocab,
                       uint32_t *out);
void sampler_scratch_free(struct sampler_scratch *sc);

#endif

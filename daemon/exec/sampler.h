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

/* One logit_bias entry: added to the token's logit (-inf bans it). */
struct logit_bias {
    uint32_t id;
    float bias;
};

struct sampler_params {
    float temperature; /* 0 = greedy (argmax, lowest id on ties) */
    uint32_t top_k;    /* 0 = off */
    float top_p;       /* (0, 1]; 1 = off */
    uint64_t seed;
    /* The host-only stages (sampler_on_host): */
    float min_p;                               /* [0, 1]; 0 = off */
    float typical_p;                           /* (0, 1); 0 or 1 = off */
    float repeat_penalty;                      /* > 0; 0 or 1 = off */
    float presence_penalty, frequency_penalty; /* [-2, 2]; 0 = off */
    uint32_t repeat_last_n;                    /* the penalties' window of recent tokens; 0 = off */
    const struct logit_bias *bias;             /* [n_bias], ids unique; owned by the request */
    uint32_t n_bias;
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
/* True when s has a stage that only the host does (logit_bias, a
 * penalty, min_p, typical_p): the executor then takes the step's logits
 * to the host and picks there. */
bool sampler_on_host(const struct sampler *s);
/* logit_bias then the penalties on row [n_vocab], in llama.cpp's order:
 * for each token seen c > 0 times in the last repeat_last_n of
 * toks[0..n_toks) (prompt and completion), l = l <= 0 ? l * repeat : l /
 * repeat, then l -= c * frequency + presence (OpenAI's frequency and
 * presence penalties are the same formula). counts is scratch for
 * repeat_last_n ids. */
void sampler_adjust(const struct sampler_params *p, const uint32_t *toks, size_t n_toks, float *row,
                    uint32_t n_vocab, uint32_t *counts);
/* The host pick: sampler_next_row, sampler_adjust, sampler_pick_trunc. */
int sampler_sample_host(struct sampler *s, struct sampler_scratch *sc, const uint32_t *toks,
                        size_t n_toks, float *logits, uint32_t n_vocab, uint32_t *counts,
                        uint32_t *out);
/* The most top alternatives a request may ask logprobs for (OpenAI's). */
#define SAMPLER_MAX_TOP_LOGPROBS 20

/* One token's log-probability. */
struct sampler_logprob {
    uint32_t id;
    float logprob;
};

/* The log-softmax of the raw row logits[n_vocab] (temperature 1, before any
 * bias, penalty or truncation; a stable log-sum-exp in double; NaN counts
 * as -inf): out[0] is token `chosen`, out[1..] the n_top most likely
 * tokens (at most n_vocab, SAMPLER_MAX_TOP_LOGPROBS), most likely first,
 * lower id first at equal logits. Returns how many alternatives were
 * written (min(n_top, n_vocab)). */
uint32_t sampler_logprobs(const float *logits, uint32_t n_vocab, uint32_t chosen, uint32_t n_top,
                          struct sampler_logprob *out);

/* sampler_next_row, then sampler_pick. */
int sampler_sample(struct sampler *s, struct sampler_scratch *sc, const float *logits,
                   uint32_t n_vocab, uint32_t *out);

#endif

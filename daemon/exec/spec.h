/* Speculative decoding's policy, apart from any model: which kind of draft a
 * request uses, n-gram prompt lookup (drafts copied from the request's own
 * tokens), the draft length that follows each request's acceptance rate, and
 * the acceptance walk over a verification's picks. The draft model's side
 * (its weights, KV and forwards) is exec/draft.h; the executor (exec.c)
 * drafts before planning a step and verifies in the step itself: the target
 * computes the last token and the k drafts as k + 1 rows of one sequence,
 * every row sampled (model.h fwd_seq.all_rows), and keeps the drafts its own
 * picks reproduce, then its pick after them (docs/architecture.md
 * "Speculative decoding"). */
#ifndef KVD_SPEC_H
#define KVD_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A request's choice (msgpack/HTTP `speculative`); DEFAULT takes the
 * daemon's (--speculative). */
enum spec_kind { SPEC_DEFAULT = 0, SPEC_OFF, SPEC_NGRAM, SPEC_DRAFT };

#define SPEC_MAX_DRAFT 16u /* draft tokens one step may verify for a request */

/* "off", "ngram", "draft" ("default" for SPEC_DEFAULT). */
const char *spec_kind_name(enum spec_kind k);
/* 0, or -1 for a name that is none of "off", "ngram", "draft". */
int spec_kind_parse(const char *s, enum spec_kind *out);

struct spec_conf {
    enum spec_kind kind; /* the daemon's choice: OFF, NGRAM or DRAFT (DRAFT needs a draft model) */
    /* Speculation runs only while at most this many requests run (more:
     * plain decoding, whose batch already uses the hardware). */
    uint32_t max_batch;
    uint32_t max_draft;            /* draft tokens per step and request, <= SPEC_MAX_DRAFT */
    uint32_t ngram_min, ngram_max; /* n-gram lookup: suffix lengths tried, longest first */
};

/* One request's adaptive state (plain value, zero-initialised = fresh). */
struct spec_state {
    bool init;
    float accept;      /* moving average of the acceptance of one draft token */
    uint32_t skip;     /* steps left without drafting (after drafting stopped paying) */
    uint32_t backoff;  /* the next pause's length, doubling while it does not pay */
    uint64_t drafted;  /* draft tokens verified */
    uint64_t accepted; /* of them, kept */
};

/* The draft length that pays best: with per-token acceptance a (the
 * request's moving average), k drafts give (1 - a^(k+1)) / (1 - a) tokens
 * for a step that costs 1 + cost * k plain steps (cost: one draft token's
 * price, the draft model's forward and the verification's extra row, in
 * plain decode steps); the k in [1, max_draft] with the most tokens per
 * cost. 0 while the request pauses (counted down here). */
uint32_t spec_draft_len(struct spec_state *s, uint32_t max_draft, float cost);
/* After a verification of `drafted` tokens of which the first `accepted`
 * were kept: updates the rate (one observation per draft token up to and
 * including the first rejected one); when no k pays at that rate and cost
 * any more, the request pauses drafting for 4, 8, ... 64 steps (then
 * probes again with the best k). */
void spec_update(struct spec_state *s, uint32_t drafted, uint32_t accepted, uint32_t max_draft,
                 float cost);

/* N-gram prompt lookup (llama.cpp's lookup, vLLM's ngram): the longest
 * suffix of toks[0..n) of length ngram_max down to ngram_min that occurs
 * earlier in toks; at its latest earlier occurrence, the up to k tokens
 * that followed it are the draft (written to out). Returns how many
 * (0: no match). */
uint32_t spec_ngram(const uint32_t *toks, size_t n, uint32_t ngram_min, uint32_t ngram_max,
                    uint32_t k, uint32_t *out);

/* The acceptance walk: draft[0..k) were verified, picks[0..k] are the
 * target's picks of the verification's rows (pick i follows the row of
 * the last token (i = 0) or of draft i-1). Returns m, the number of
 * drafts kept: draft[i] == picks[i] for i < m; the step then produced
 * m + 1 tokens: draft[0..m) and picks[m]. */
uint32_t spec_accept(const uint32_t *draft, uint32_t k, const uint32_t *picks);

#endif

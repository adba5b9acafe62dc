/* The draft model of speculative decoding (--draft-model): a second, small
 * GGUF with the served model's vocabulary, loaded on the same backend, and
 * everything its KV needs, in this one module: its own kvmm (the draft's
 * geometry, an arena carved from the device budget by main.c), its forward
 * scratch, and one draft sequence per request that drafts. Each step the
 * executor asks for drafts (draft_propose): every request's draft sequence
 * is brought up to the request's tokens (a catch-up chunk, cache matches
 * first), then the draft model decodes greedily, the requests batched, up to
 * k tokens each. Its KV is its own business: nothing the target computes or
 * caches depends on it. Executor thread only (the draft kvmm's lock is taken
 * inside). */
#ifndef KVD_DRAFT_H
#define KVD_DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kv_types.h"
#include "kvd/status.h"
#include "model.h"

struct draft_conf {
    const char *path;        /* the draft GGUF */
    const char *target_path; /* the served model's GGUF: its vocabulary must be the draft's */
    const struct model_hparams *target;
    struct backend *be; /* not owned; the target's backend */
    uint32_t n_threads; /* cpu compute threads (model_opts) */
    uint32_t block_tokens;
    enum kv_dtype dtype;
    uint32_t max_seqs;    /* requests that draft in one step */
    uint32_t step_tokens; /* tokens of one draft forward (catch-up chunks) */
};

struct draft;

/* Loads the draft model and checks that its vocabulary is the target's:
 * the same number of tokens and, token for token, the same texts
 * (tokenizer.ggml.tokens) when both files have them; otherwise
 * KVD_EBADREQ with the first difference. Errors as model_load, and
 * KVD_ENOMEM. Its KV comes next (draft_kv_open), once the device budget
 * is known (main.c loads the weights first, as the served model's). */
int draft_open(const struct draft_conf *c, struct draft **out, struct kvd_error *err);
/* The draft's KV memory manager, kv_bytes of device arena (at least one
 * block of the draft's geometry), and its forward scratch. */
int draft_kv_open(struct draft *d, size_t kv_bytes, struct kvd_error *err);
/* Bytes of one KV block of the draft's geometry. */
size_t draft_block_bytes(const struct draft *d);
void draft_free(struct draft *d);
const struct model_hparams *draft_hparams(const struct draft *d);
/* Blocks of the draft's arena and tokens per block (for the log). */
uint32_t draft_kv_blocks(const struct draft *d);

struct draft_job {
    uint64_t owner;       /* names the request's draft sequence (its executor owner) */
    uint32_t tenant;      /* the request's tenant: draft KV is cached and shared only among
                           * one tenant's requests (a namespace per tenant, as the target's) */
    const uint32_t *toks; /* every known token of the request; the last one is the
                           * target's next input */
    size_t n_toks;
    uint32_t k;     /* drafts wanted, <= SPEC_MAX_DRAFT */
    uint32_t *out;  /* [k] the drafts */
    uint32_t n_out; /* out: how many were made (0 when none could be) */
};

/* Drafts for n jobs (draft model, greedy). Never fails a request: a job
 * whose draft cannot be made (memory, the draft's context, a failed
 * forward) gets fewer or no drafts. Returns the draft forwards run that
 * proposed tokens (catch-up chunks that did not reach the end excluded). */
uint32_t draft_propose(struct draft *d, struct draft_job *jobs, uint32_t n);
/* The request is over (or stops drafting): its draft sequence is closed. */
void draft_release(struct draft *d, uint64_t owner);

#endif

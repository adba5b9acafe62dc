/* The draft model of speculative decoding, the executor's side of it: a
 * small GGUF with the served model's vocabulary on the same backend (its
 * weights loaded here from --draft-model, or borrowed from another model
 * of the daemon, [model:NAME] draft = OTHER), and everything its KV needs,
 * in this one module: its own kvmm (the draft's geometry, its pages taken
 * from the daemon's page budget up to a cap models_budget.c sets), its
 * forward scratch, and one draft sequence per request that drafts. The
 * target's executor owns it (exec_conf.draft), so it goes when that
 * executor does. Each step the executor asks for drafts (draft_propose):
 * every request's draft sequence is brought up to the request's tokens (a
 * catch-up chunk, cache matches first), then the draft model decodes
 * greedily, the requests batched, up to k tokens each. Its KV is its own
 * business: nothing the target computes or caches depends on it. Executor
 * thread only, but for draft_kv_device_bytes (the draft kvmm's lock is
 * taken inside). */
#ifndef KVD_DRAFT_H
#define KVD_DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kv_types.h"
#include "kvd/status.h"
#include "model.h"

struct kvpages;

struct draft_conf {
    const char *path;        /* the draft GGUF */
    const char *target_path; /* the served model's GGUF: its vocabulary must be the draft's */
    /* What errors name the draft by ("--draft-model PATH", "model X's
     * draft Y"); NULL: "--draft-model PATH". */
    const char *label;
    const struct model_hparams *target;
    /* The draft's weights when another model of the daemon holds them
     * (borrowed: they must outlive the draft; every forward on them takes
     * the arbiter's turn, so two executors never run them at once). NULL:
     * loaded from path, owned. */
    struct model *weights;
    struct backend *be; /* not owned; the target's backend */
    uint32_t n_threads; /* cpu compute threads (model_opts) */
    uint32_t block_tokens;
    enum kv_dtype dtype;
    uint32_t max_seqs;    /* requests that draft in one step */
    uint32_t step_tokens; /* tokens of one draft forward (catch-up chunks) */
};

struct draft;

/* Whether a draft can draft for a target: the same number of tokens
 * (n_vocab of each) and, token for token, the same texts
 * (tokenizer.ggml.tokens) when both files have them. 0, or KVD_EBADREQ
 * naming label and the first difference. Reads only the files' headers. */
int draft_check_vocab(const char *target_path, uint32_t target_vocab, const char *draft_path,
                      uint32_t draft_vocab, const char *label, struct kvd_error *err);
/* Loads the draft model (or takes c->weights) and checks that its
 * vocabulary is the target's (draft_check_vocab). Errors as model_load,
 * KVD_EBADREQ and KVD_ENOMEM. Its KV comes next (draft_kv_open). */
int draft_open(const struct draft_conf *c, struct draft **out, struct kvd_error *err);
/* The budget tenant the drafts' KV pages are counted under: '<' and '>'
 * are in no tenant's name (a configured or sub-tenant name is letters,
 * digits, '-', '_', '.' and '/'; a uid's is "uid:N"), so no tenant's quota,
 * floor or use is ever mixed with the drafts'. */
#define DRAFT_TENANT "<draft>"

/* The draft's KV memory manager and its forward scratch. With pages (the
 * daemon's page budget, pages.h): its blocks take pages of the budget as
 * they need them, up to kv_bytes of them (0: no cap; a cap, not a
 * reservation), and give them back as they empty; no host tier, out of the
 * models' even share, its one tenant DRAFT_TENANT. Without: a budget of
 * its own of kv_bytes (at least one block of the draft's geometry). */
int draft_kv_open(struct draft *d, struct kvpages *pages, size_t kv_bytes, struct kvd_error *err);
/* Bytes of the device pages its KV holds now (any thread: taken under the
 * draft kvmm's lock). */
uint64_t draft_kv_device_bytes(struct draft *d);
/* Bytes of one KV block of the draft's geometry. */
size_t draft_block_bytes(const struct draft *d);
/* Its sequences, KV, scratch, and the weights when they are its own. */
void draft_free(struct draft *d);
const struct model_hparams *draft_hparams(const struct draft *d);
/* The device bytes of its forward scratch, as allocated. */
size_t draft_scratch_bytes(const struct draft *d);
/* The most blocks its KV may hold (for the log). */
uint32_t draft_kv_blocks(const struct draft *d);

struct draft_job {
    uint64_t owner; /* names the request's draft sequence (its executor owner) */
    /* The request's tenant's name: draft KV is cached and shared only
     * among one tenant's requests, in a namespace named after the tenant
     * ("tenant:<name>", as the target's own), never after its id, which a
     * later tenant may reuse. */
    const char *tenant;
    const uint32_t *toks; /* every known token of the request; the last one is the
                           * target's next input */
    size_t n_toks;
    uint32_t k;     /* drafts wanted, <= SPEC_MAX_DRAFT */
    uint32_t *out;  /* [k] the drafts */
    uint32_t n_out; /* out: how many were made (0 when none could be) */
    uint32_t n_fwd; /* out: tokens the draft model computed for it (catch-up + drafts) */
};

/* Drafts for n jobs (draft model, greedy). Never fails a request: a job
 * whose draft cannot be made (memory, the draft's context, a failed
 * forward) gets fewer or no drafts. Returns the draft forwards run that
 * proposed tokens (catch-up chunks that did not reach the end excluded). */
uint32_t draft_propose(struct draft *d, struct draft_job *jobs, uint32_t n);
/* The request is over (or stops drafting): its draft sequence is closed. */
void draft_release(struct draft *d, uint64_t owner);

/* What the draft's own cache saved: tokens its sequences matched from it
 * when they opened (a tenant's earlier requests' prefixes), and tokens the
 * draft model computed (catch-up chunks and drafts). Any thread (taken
 * under the draft kvmm's lock). */
struct draft_stats {
    uint64_t matched, computed;
};
void draft_stats(struct draft *d, struct draft_stats *out);

#endif

/* The executor: one thread that loops schedule → forward → sample → publish
 * over the generate requests handed to it, against the model and the KV
 * memory manager. Results leave through a sink (ops_generate encodes them
 * and posts them to the server's loop); nothing here knows about sockets. */
#ifndef KVD_EXEC_H
#define KVD_EXEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "draft.h"
#include "kvmm.h"
#include "model.h"
#include "scheduler.h"
#include "spec.h"
#include "text.h"

/* Where a request's results go (each request names its own: r->sink).
 * Both are called on the executor thread, without any lock held, and must
 * not block for long (queue the frame and return). */
struct exec_sink {
    void *ud;
    /* New tokens of a streaming request, in order (n may be 0 when only
     * r->text has new text: text_out_take). */
    void (*tokens)(void *ud, const struct sched_req *r, const uint32_t *toks, size_t n);
    /* The final answer (r->finish, r->err); r is freed after the call. */
    void (*done)(void *ud, const struct sched_req *r);
    /* The final answer of a request of n > 1 choices (r->group), once
     * every choice has ended: rs[i] is choice i; freed after the call.
     * Each choice's streamed tokens came through `tokens` before. */
    void (*done_group)(void *ud, const struct sched_req *const *rs, uint32_t n);
};

struct workpool;

struct exec_conf {
    uint32_t step_tokens; /* token budget per step; default 512 */
    uint32_t max_seqs;    /* sequences per step; default 64 */
    /* A request still waiting for its first step after this long is
     * answered busy; default 60000 ms, UINT32_MAX: no limit. */
    uint32_t queue_timeout_ms;
    /* Observability (optional, not owned, must outlive the executor): each
     * step's FLOP/byte cost and time, each answered request's accounting. */
    struct roofline *roofline;
    struct acct *acct;
    /* The model's text side (optional, not owned, outlives the executor):
     * its end-of-generation ids end requests unless they ignore_eos. */
    const struct text *text;
    /* Worker threads for preparing text and chat prompts (prep.h; not
     * owned, outlives the executor). NULL: they are prepared inside
     * exec_submit, on the caller's thread. */
    struct workpool *pool;
    /* Worker threads that read a request's blocks back from the disk tier
     * (kvmm_disk_prefetch) before it is queued, so no disk read ever runs
     * inside a step (not owned, outlives the executor). NULL: none. */
    struct workpool *disk_pool;
    /* Several models on one device (not owned, outlives the executor; NULL:
     * the device is this executor's alone): each forward takes a turn, the
     * draft model's forwards too. */
    struct exec_arbiter *arbiter;
    /* The accounting slot its queues and counters go to (its model's). */
    uint32_t acct_slot;
    /* Called when the last live request has been answered (on the thread
     * that answered it, no lock held): the daemon may unload the model. */
    void (*on_idle)(void *ud);
    void *on_idle_ud;
    /* Speculative decoding (spec.h; kind OFF: none) and the draft model's
     * executor side (draft.h: its KV, scratch and sequences; NULL: no draft
     * model, so kind DRAFT is refused). The executor owns the draft from
     * exec_new on, whether exec_new succeeds or not: exec_free frees it, so
     * a model's draft state goes when its executor does. Zeroed: off,
     * max_batch 4, max_draft 8, n-grams of 1 to 3 tokens. */
    struct spec_conf spec;
    struct draft *draft;
    /* Overlap: while the device runs a plain decode step (every request one
     * row, its token picked on the device), the next step is planned, and
     * it is submitted before the step's results are committed to the
     * requests' streams (exec.c). AUTO: on where the backend runs steps
     * asynchronously (cuda), off on the cpu backend. */
    enum exec_overlap { EXEC_OVERLAP_AUTO = 0, EXEC_OVERLAP_ON, EXEC_OVERLAP_OFF } overlap;
};

/* Speculative decoding's counters (stats `requests.speculative`). */
struct exec_spec_stats {
    uint64_t verify_steps;       /* steps that verified drafts of some request */
    uint64_t verifies;           /* verifications (one request's drafts in one step) */
    uint64_t drafted;            /* draft tokens verified */
    uint64_t accepted;           /* of them, kept */
    uint64_t spec_tokens;        /* tokens those verifications produced (kept drafts + one each) */
    uint64_t verify_ns;          /* forward time of the verifying steps */
    uint64_t verify_step_tokens; /* every token those steps gave (any request) */
    uint64_t decode_steps;       /* decode-only steps without drafts (the plain rate) */
    uint64_t decode_tokens;      /* their tokens */
    uint64_t decode_ns;          /* their forward time */
    uint64_t ngram_drafts, model_drafts; /* verifications by kind */
};

/* Overlap and the host's time per plain decode step (stats `requests`). */
struct exec_overlap_stats {
    uint64_t steps;      /* steps planned while the one before ran, submitted before its
                          * results were published */
    uint64_t host_steps; /* plain decode steps timed for host_ns */
    uint64_t host_ns;    /* the executor thread's own time in them: planning, commit,
                          * taking the tokens, publishing; not the forward's */
    uint64_t idle_steps; /* plain decode steps that followed one (idle_ns) */
    uint64_t idle_ns;    /* from the step before's end on the device (its tokens back)
                          * to their submission: the device's wait for the host */
};

struct exec_stats {
    struct sched_counters sched;
    uint64_t requests, completed, cancelled, failed;
    uint64_t generated; /* tokens sampled */
    uint32_t live;      /* submitted and not yet answered */
    struct exec_spec_stats spec;
    struct exec_overlap_stats overlap;
};

struct exec;

/* Starts the executor thread. The model and kvmm are not owned and must
 * outlive the executor; kvmm's geometry must be the model's. */
int exec_new(struct kvmm *mm, struct model *m, const struct exec_conf *conf, struct exec **out,
             struct kvd_error *err);
/* Answers every live request (cancelled), then stops the thread. */
void exec_free(struct exec *ex);

const struct model_hparams *exec_hparams(const struct exec *ex);
/* The daemon's speculative decoding settings (defaults filled in), and
 * whether a draft model is loaded (a request's "draft" needs one). */
const struct spec_conf *exec_spec_conf(const struct exec *ex);
bool exec_has_draft(const struct exec *ex);
/* The device bytes its forward scratch holds, as allocated (and its
 * draft's): fwd_ctx_dev_bytes. */
size_t exec_scratch_bytes(const struct exec *ex);
/* Bytes of the device pages its draft's KV holds now (0: no draft). Any
 * thread that keeps the executor alive. */
uint64_t exec_draft_kv_bytes(const struct exec *ex);
/* exec_conf's text (NULL when none was given). */
const struct text *exec_text(const struct exec *ex);
/* A fresh serial for a request about to be submitted (any thread); its kvmm
 * owner is SCHED_OWNER_BIT | serial, so a seq-mode request's sequence can be
 * handed to it before submission. */
uint64_t exec_next_serial(struct exec *ex);
/* Hands a validated request to the executor (any thread). After this the
 * executor owns r and always answers it through r->sink. A request with a
 * text or chat prompt (r->prompt) is prepared first on the pool: an error
 * there is its answer. Returns KVD_ECANCELLED (r not taken) while
 * draining, or KVD_EBUSY / KVD_ENOMEM when the pool refuses it (its
 * tenant holds as many prompts in preparation as it may). */
int exec_submit(struct exec *ex, struct sched_req *r);
/* What exec_submit's failure rc means, for the requester's error; also
 * the text workers' refusals (workpool_submit) of other requests. */
const char *exec_submit_errmsg(int rc);
/* Cancels request `id` of connection `conn`; *found says whether it was
 * still live (its reply, finish_reason cancelled, follows within a step). */
void exec_cancel(struct exec *ex, uint64_t conn, uint64_t id, bool *found);
/* Connection closed: cancels its requests and answers nobody. Their
 * sequences (the connection's own ones included) are closed. */
void exec_cancel_conn(struct exec *ex, uint64_t conn);
/* Ends every request of connection conn with error `code` and message msg
 * (at most one step later), e.g. when it does not read its output. */
void exec_abort_conn(struct exec *ex, uint64_t conn, int code, const char *msg);
/* Shutdown: cancels everything, waits until every live request has been
 * answered through the sink; later submissions are refused. */
void exec_drain(struct exec *ex);
void exec_stats(struct exec *ex, struct exec_stats *st);

#endif

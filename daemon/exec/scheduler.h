/* The scheduler: continuous batching over generate requests. Waiting,
 * running and swapped queues; each step picks running decodes first, then
 * chunked prefills of admitted requests, within a token budget; preempts by
 * swapping to the host tier, or by dropping K/V for recompute when that
 * fails; fair across tenants by weight. Only the executor thread calls it. */
#ifndef KVD_SCHED_H
#define KVD_SCHED_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmm.h"
#include "grammar.h"
#include "sampler.h"
#include "spec.h"
#include "text_out.h"

struct exec_sink;
struct sched_prompt;
struct sched_constraint;
struct sched_group;

/* kvmm owners of executor sequences: this bit | request serial. Connection
 * ids (the server's owners) never have it set. */
#define SCHED_OWNER_BIT KVMM_OWNER_EXEC /* kvmm.h */
#define SCHED_MAX_STOP 64u

enum sched_state { SCHED_NEW, SCHED_WAITING, SCHED_RUNNING, SCHED_SWAPPED, SCHED_DONE };
enum sched_finish {
    SCHED_FINISH_NONE = 0,
    SCHED_FINISH_LENGTH,    /* max_tokens, the model context, or memory it can never get */
    SCHED_FINISH_STOP,      /* a stop token, an end-of-generation token (the last token)
                             * or a stop string (the text ends before it) */
    SCHED_FINISH_CANCELLED, /* cancel, disconnect or shutdown */
    SCHED_FINISH_ERROR,     /* err/errmsg say why */
};
const char *sched_finish_name(enum sched_finish f); /* "length", "stop", "cancelled" */

/* One generate request. Built and validated by ops_generate on the loop
 * thread, owned by the executor from exec_submit until it is answered.
 * toks holds every token the model conditions on: the sequence's own tokens
 * (seq mode), the request's tokens, then each generated token. Positions
 * [0, n_kv) have K/V in the sequence's blocks; toks[n_kv..n_toks) are yet
 * to be computed (the prompt remainder, or the last sampled token). */
struct sched_req {
    struct sched_req *prev, *next; /* in exactly one queue of its scheduler */
    struct sched_req *live_next;   /* exec's list of live requests (exec lock) */

    /* identity */
    uint64_t conn;   /* the requester: a connection id (= kvmm owner of its seqs) or
                      * another client's id, from the same counter (never equal) */
    uint64_t id;     /* the client's request id */
    uint64_t serial; /* executor-unique, arrival order */
    uint32_t tenant, ns;

    /* Where its results go (exec.h; not owned, outlives the request). */
    const struct exec_sink *sink;
    /* A text or chat prompt still to become tokens (owned, prep.h): set by
     * the request's builder, consumed off the loop before the request is
     * queued. NULL once toks holds the prompt. */
    struct sched_prompt *prompt;

    /* arguments */
    int32_t priority; /* higher first */
    uint32_t max_tokens;
    uint32_t n_stop;
    uint32_t stop[SCHED_MAX_STOP];
    bool stream;
    bool ignore_eos; /* do not stop at the model's end-of-generation tokens */
    struct sampler smp;
    struct logit_bias *bias; /* owned: smp.p.bias */
    /* logprobs: each generated token's log-probability and its lp_top most
     * likely alternatives (sampler_logprobs), lp_stride = 1 + lp_top
     * entries per token in lp (owned), n_lp tokens so far. */
    bool lp_on;
    uint32_t lp_top;
    struct sampler_logprob *lp;
    size_t n_lp, cap_lp;
    /* A grammar the completion follows (owned; NULL: none): the matcher's
     * mask is applied to the logits before the sampler chain (a host
     * pick), every sampled token advances it, and the completion ends when
     * nothing but the end can follow. */
    struct grammar *grammar;
    struct grammar_matcher *gm;
    bool grammar_failed; /* the mask could not be made or allows nothing: err says why */
    /* The grammar still to compile (owned, prep.h; NULL once compiled or
     * when there is none): like a text prompt, off the loop. */
    struct sched_constraint *constraint;

    /* n > 1: the request's choices (struct sched_group, owned by exec.c
     * once submitted) and this one's index; NULL/0 for a single choice.
     * Choice 0 leads: it prefills the prompt; the others wait (in no
     * queue) until that step, draw their first token from the same
     * logits with their own streams (fork_pick, fork_lp, smp_before the
     * draw), and run on a copy-on-write fork of its sequence. */
    struct sched_group *group;
    uint32_t choice;
    bool fork_pending; /* fork_pick was drawn this step, not yet taken */
    uint32_t fork_pick;
    struct sampler smp_before;       /* the stream before fork_pick's draw */
    struct sampler_logprob *fork_lp; /* (1 + lp_top) entries, owned */
    /* The completion as text (owned; NULL when the model has no tokenizer):
     * fed each generated token by the executor, stop strings inside. */
    struct text_out *text;

    /* tokens (owned, malloc) */
    uint32_t *toks;
    size_t n_toks, cap_toks;
    size_t n_prompt; /* toks before the first generated one */
    size_t n_kv;     /* positions with K/V written and committed */
    size_t n_cached; /* usage.cached: positions not computed by this request */
    size_t n_sent;   /* generated tokens already streamed */
    uint32_t n_ctx;  /* the model's context: generation stops at n_toks == n_ctx */

    /* the kvmm sequence: owner SCHED_OWNER_BIT | serial while the executor
     * holds it; a seq-mode request gives it back to `conn` at the end. */
    kvmm_seq_t seq;
    bool have_seq;
    bool conn_seq;     /* seq came from the connection (generate with `seq`) */
    bool need_match;   /* seq is empty: match the cache before prefilling */
    bool seq_returned; /* the connection has its sequence back (reply names it) */
    /* Seq mode: the sequence's tokens when it was handed over. A request
     * cancelled with fewer of them in K/V (a recompute preemption dropped
     * them, or the last one awaits recompute) first recomputes up to n_orig
     * (`restoring`: no sampling) and only then answers `cancelled`, so the
     * connection never gets its sequence back shorter than it lent it. */
    size_t n_orig;
    bool restoring;

    enum sched_state state;
    enum sched_finish finish;
    struct kvd_error err; /* with SCHED_FINISH_ERROR */
    atomic_bool cancel;   /* set by the loop thread (cancel, disconnect) */
    /* Set (before cancel) when the server ends the request with an error
     * instead (its connection does not read its output): the request is
     * answered abort_code with abort_msg, not `cancelled`. */
    atomic_int abort_code;
    char abort_msg[160];
    atomic_bool detached; /* the connection is gone: answer nobody */

    /* timing, CLOCK_MONOTONIC ns */
    uint64_t t_arrive, t_sched, t_first, t_done;

    uint32_t n_preempt; /* times preempted (swap or recompute), for accounting */

    /* generate with `session` (owned; NULL without): see struct sched_session */
    struct sched_session *session;

    /* Speculative decoding (exec/spec.h): the kind it asked for
     * (SPEC_DEFAULT: the daemon's), its adaptive state, and whether it has
     * a draft-model sequence (closed when it is answered). */
    enum spec_kind spec_kind;
    struct spec_state spec;
    bool draft_seq;
    /* This step's drafts (set by the executor before sched_plan): a decode
     * planned with n_draft > 0 computes 1 + n_draft rows, its last token
     * and the drafts (verify), each row sampled; the plan may lower
     * n_draft (budget, memory) or drop it. */
    uint32_t n_draft;
    uint32_t draft[SPEC_MAX_DRAFT];
    bool verify; /* planned as a verification this step */

    /* this step */
    uint32_t step_n; /* tokens computed for it this step (0: not in the batch) */
    /* The next step was planned while this one ran (sched_plan_ahead): the
     * sequence holds one more position, uncommitted, past this step's.
     * Ending the request gives it back. */
    bool ahead;

    /* waiting-queue bookkeeping (scheduler.c) */
    uint32_t hidx;               /* index in its tenant's admission heap */
    bool pre_wait;               /* waiting in the "admitted before" queue, not the heap */
    struct sched_req *live_prev; /* exec's live list (exec lock) */
    struct sched_req *hnext;     /* exec's (conn, id) hash chain (exec lock) */
};

/* A request that continues a named session and saves the grown
 * conversation under the same name when it ends. Its sequence is not closed
 * at the end but kept (kept, seq, owner) until the save has found its
 * blocks, so none of them can be evicted between the two; the save runs on
 * the disk workers before the request is answered (exec.c). */
struct sched_session {
    char name[KVMM_SESSION_NAME + 1];
    uint64_t ttl_s;
    bool kept;
    kvmm_seq_t seq;
    uint64_t owner;
    /* the outcome, for the reply */
    bool saved;
    struct kvmm_session_info info;
    struct kvd_error err; /* when not saved */
};

/* The choices of one request (n > 1). reqs[0] leads. */
struct sched_group {
    uint32_t n;
    uint32_t n_answered; /* ended, held until all have (exec.c) */
    bool forked;         /* the others run on their own sequences */
    struct sched_req *reqs[];
};
/* A group of n choices around leader (reqs[0]); the others are added by
 * the caller. NULL when out of memory. */
struct sched_group *sched_group_new(struct sched_req *leader, uint32_t n);
/* Frees every choice and the group. */
void sched_group_free(struct sched_group *g);

static inline uint64_t sched_req_owner(const struct sched_req *r)
{
    return SCHED_OWNER_BIT | r->serial;
}

/* A request that ended before it was queued (its prompt could not be
 * prepared, or it was cancelled meanwhile): releases its sequence (a
 * connection's goes back) and puts it on `done` with r->finish as set
 * (SCHED_FINISH_CANCELLED when none). Executor thread, kvmm lock held. */
void sched_reject(struct kvmm *mm, struct sched_req *r, struct sched_req **done);

struct sched_conf {
    uint32_t step_tokens; /* token budget per step (>= max_seqs) */
    uint32_t max_seqs;    /* sequences per step */
    /* A request never scheduled after this long in the queue is answered
     * busy (safety net; 0: no limit), ns. */
    uint64_t queue_timeout_ns;
};

struct sched_counters {
    uint64_t steps, prefill_tokens, decode_tokens;
    uint64_t preempt_swap, preempt_recompute, resumes;
    uint64_t no_memory, queue_timeouts; /* requests answered no_memory / busy while waiting */
    uint32_t waiting, running, swapped;
};

/* One step's batch. The slot tables of all planned requests are
 * concatenated: request i's are slots[slot0[i] .. slot0[i+1]). */
struct sched_plan {
    uint32_t n;              /* requests in the batch */
    struct sched_req **reqs; /* [max_seqs] */
    uint32_t *slot0;         /* [max_seqs + 1] */
    uint32_t *slots;
    size_t cap_slots;
    uint32_t n_tokens; /* sum of step_n */
};

struct sched;

int sched_new(const struct sched_conf *conf, struct sched **out);
void sched_free(struct sched *s);
const struct sched_conf *sched_conf(const struct sched *s);
void sched_counters(const struct sched *s, struct sched_counters *c);
/* Any request waiting, running or swapped. */
bool sched_busy(const struct sched *s);
/* The running queue's first request (then r->next), for the executor's
 * drafting before a step. */
struct sched_req *sched_running(const struct sched *s);
/* Tells the next sched_plan that some request's cancel flag was set, so it
 * looks through the waiting queue (which it otherwise does not walk). Any
 * thread. */
void sched_note_cancel(struct sched *s);

/* Queues a new request as waiting (executor thread, kvmm lock held: the
 * tenant's weight is read from kvmm). */
void sched_add(struct sched *s, struct kvmm *mm, struct sched_req *r);
/* Adds a request that already has its sequence and K/V (a choice forked
 * from its leader) as running. Same threads and lock. */
void sched_add_running(struct sched *s, struct kvmm *mm, struct sched_req *r);
uint64_t sched_now_ns(void); /* CLOCK_MONOTONIC */

/* Builds the next step (caller holds the kvmm lock): decodes and prefill
 * continuations of running requests, resumed swapped ones, then newly
 * admitted ones, allocating blocks and preempting as needed. Requests that
 * must end now (cancelled, or can never get memory) are moved to `done`
 * (linked through next) with finish set and their sequence released.
 * Returns 0 or KVD_ENOMEM (plan buffers). */
int sched_plan(struct sched *s, struct kvmm *mm, struct sched_plan *plan, struct sched_req **done);
/* Overlap (exec.c): while the step of `cur` runs on the device, plans the
 * next one as if every request of it continues with one more token: each
 * grows by one position past its step's, without preempting anyone (its
 * r->ahead set). Only when `cur` was the decode of every running request
 * and no request waits or is swapped; returns false, holding nothing,
 * otherwise or when some request cannot grow. `next` gets the requests; its
 * slot tables come from sched_plan_ahead_slots once `cur` is committed and
 * its tokens taken. Caller holds the kvmm lock. */
bool sched_plan_ahead(struct sched *s, struct kvmm *mm, const struct sched_plan *cur,
                      struct sched_plan *next);
/* Makes `next` (sched_plan_ahead's) the step to run: the requests that
 * ended meanwhile (which gave their position back) leave it, each other
 * computes one token; then its slot tables, as sched_plan's. A request
 * whose table cannot be read ends (`done`). Returns 0 or KVD_ENOMEM.
 * Caller holds the lock. */
int sched_plan_ahead_slots(struct sched *s, struct kvmm *mm, struct sched_plan *next,
                           struct sched_req **done);
/* After the forward: commits the computed tokens (caller holds the lock). A
 * commit failure ends that request with an error (moved to `done`). */
void sched_commit(struct sched *s, struct kvmm *mm, struct sched_plan *plan,
                  struct sched_req **done);
/* Ends a running request (after sampling decided it is finished): releases
 * its sequence and removes it from the queues. Caller holds the lock. */
void sched_finish(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f);
/* Ends every request (shutdown) into `done` with SCHED_FINISH_CANCELLED. */
void sched_drain(struct sched *s, struct kvmm *mm, struct sched_req **done);

void sched_plan_free(struct sched_plan *plan);
/* Appends a token to r->toks, growing it. 0 or KVD_ENOMEM. */
int sched_req_push(struct sched_req *r, uint32_t tok);
/* Appends one generated token's logprobs (1 + r->lp_top entries) to
 * r->lp, growing it. 0 or KVD_ENOMEM. */
int sched_req_push_lp(struct sched_req *r, const struct sampler_logprob *e);
void sched_req_free(struct sched_req *r);

#endif

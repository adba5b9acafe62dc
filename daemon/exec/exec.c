/* The executor thread (see exec.h): takes submitted requests from an inbox,
 * and loops draft (speculative decoding, no lock) → plan (scheduler, kvmm
 * lock held) → submit the forward (no lock) → wait for it → take the sampled
 * tokens, the verified drafts (no lock) → commit (lock) → finish (lock) →
 * publish (no lock). The backend samples inside the forward. With overlap
 * (a plain decode step on an asynchronous backend) the next step is planned
 * while the forward runs and submitted before this step's results are
 * published: see step(). */
#include "exec.h"

#include "acct.h"
#include "arbiter.h"
#include "prep.h"
#include "roofline.h"
#include "workpool.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LP_STRIDE (1 + SAMPLER_MAX_TOP_LOGPROBS)

struct exec {
    struct kvmm *mm; /* not owned */
    struct model *m; /* not owned */
    struct exec_conf conf;
    const struct model_hparams *hp;

    /* Executor-thread state (no lock). */
    struct sched *sched;
    struct fwd_ctx *fc;
    struct sched_plan plan;
    struct fwd_seq *fseqs;   /* [max_seqs] in forward order (order) */
    uint32_t *order;         /* [max_seqs] plan entry of each forward sequence */
    uint32_t *out0;          /* [max_seqs] first output row of each plan entry */
    uint32_t max_out;        /* output rows a step may have (verifications: several) */
    struct sample_row *rows; /* [max_out] this step's sampling, one per output row */
    uint32_t *picks;         /* [max_out] the tokens the backend sampled */
    /* Speculative decoding: each plan entry's verification input (its
     * last token, then its drafts) and its random stream before the
     * step's rows were drawn (rewound to the tokens it keeps). */
    uint32_t *vtoks;        /* [max_seqs][1 + SPEC_MAX_DRAFT] */
    uint64_t (*saved)[4];   /* [max_seqs] */
    struct draft_job *jobs; /* [spec.max_batch] */
    struct sched_req **job_req;
    bool spec_on; /* this step: speculation is on, its rows batch-invariant */
    /* What a draft token costs, in plain decode steps (spec_draft_len):
     * moving averages of a plain decode-only step's time, of a
     * verification row's extra time over it, and of one proposing forward
     * of the draft model. */
    double t_plain_ns, c_verify, t_draft_ns;
    /* The host pick (a step where some request's sampling is on the host,
     * sampler_on_host): every row's logits come back and are picked here.
     * Grown on first need. */
    float *hlogits; /* [cap_hlogits][n_vocab] */
    uint32_t cap_hlogits;
    uint32_t *counts; /* [n_ctx] the penalties' scratch */
    struct sampler_scratch hsc;
    /* logprobs: a step where some row asks for them brings the logits
     * back too (hlogits); lpstep[i * LP_STRIDE] are row i's, taken by
     * sample_step; lprow keeps a raw row the host pick adjusts in place. */
    struct sampler_logprob *lpstep; /* [max_seqs][LP_STRIDE] */
    float *lprow;                   /* [n_vocab] */
    /* n > 1: the leader's raw row the step its prompt is done (grow), and
     * a copy each other choice picks from (frow); the choices forked this
     * step, whose first tokens sample_step takes. */
    float *grow, *frow; /* [n_vocab] */
    struct sched_req **forked;
    uint32_t n_forked, cap_forked;
    uint32_t n_arena_slots;
    uint64_t gen_step;            /* tokens taken this step */
    struct roofline_shape shape;  /* the model's, for the roofline */
    struct arbiter_share *shares; /* [max_seqs] this step's tenants (with an arbiter) */
    size_t n_shares;
    struct arbiter_share *dshares; /* [spec.max_batch] the draft model's turn's tenants */
    char (*tnames)[64];            /* [spec.max_batch] their names */
    /* Overlap (exec_conf.overlap, resolved): `ahead` is the step after
     * ex->plan, planned while ex->plan's forward ran (sched_plan_ahead).
     * inflight: ex->plan's forward was submitted by the iteration before
     * (fwd_rc: the submit's status, t_fwd: when). fwd_pending: a submit
     * awaits model_forward_finish. */
    bool overlap;
    struct sched_plan ahead;
    bool inflight, fwd_pending;
    int fwd_rc;
    uint64_t t_fwd;
    /* Host time of plain decode steps (ost): when the last forward's
     * finish returned, whether the step submitted last was a plain decode,
     * and this iteration's time inside submit and finish. */
    uint64_t t_fin;
    bool prev_plain;
    uint64_t dev_ns;
    struct exec_overlap_stats ost; /* copied into st after each step */

    /* Shared with other threads, under mu. */
    pthread_mutex_t mu;
    pthread_cond_t wake;                       /* inbox, cancel, stop */
    pthread_cond_t idle;                       /* live list shrank (drain waits on it) */
    struct sched_req *inbox_head, *inbox_tail; /* linked through next */
    struct sched_req *live; /* requests that can still be cancelled (live_next/prev) */
    /* The same requests by (conn, id), chained through hnext: a cancel
     * finds its target without walking every live request. */
    struct sched_req **hash;
    size_t hash_cap, n_hashed;
    uint32_t n_live; /* requests not yet answered */
    bool draining, stop;
    uint64_t serial;
    struct exec_stats st;       /* st.sched: copied from the scheduler after each step */
    struct exec_spec_stats sst; /* the executor thread's; copied into st after each step */

    pthread_t thread;
    bool started;
};

/* ---- publishing --------------------------------------------------------- */

static size_t live_bucket(const struct exec *ex, uint64_t conn, uint64_t id)
{
    uint64_t h = (conn * 0x9e3779b97f4a7c15ull) ^ (id * 0xc2b2ae3d27d4eb4full);
    h ^= h >> 29;
    return (size_t)(h & (ex->hash_cap - 1));
}

/* Grows the hash to keep chains short, rebuilding it from the live list (so
 * a request added while an earlier growth failed is found too); on failure
 * chains just get longer. */
static void live_hash_grow(struct exec *ex)
{
    size_t cap = ex->hash_cap ? 2 * ex->hash_cap : 256;
    struct sched_req **h = calloc(cap, sizeof(*h));
    if (!h)
        return;
    free(ex->hash);
    ex->hash = h;
    ex->hash_cap = cap;
    ex->n_hashed = 0;
    for (struct sched_req *r = ex->live; r; r = r->live_next) {
        size_t b = live_bucket(ex, r->conn, r->id);
        r->hnext = h[b];
        h[b] = r;
        ex->n_hashed++;
    }
}

/* Under ex->mu. */
static void live_add(struct exec *ex, struct sched_req *r)
{
    r->live_prev = NULL;
    r->hnext = NULL;
    if (ex->n_hashed >= ex->hash_cap)
        live_hash_grow(ex); /* before r is on the list: it is added below */
    r->live_next = ex->live;
    if (ex->live)
        ex->live->live_prev = r;
    ex->live = r;
    if (ex->hash_cap) {
        size_t b = live_bucket(ex, r->conn, r->id);
        r->hnext = ex->hash[b];
        ex->hash[b] = r;
        ex->n_hashed++;
    }
}

/* Under ex->mu; O(1) for the list, O(chain) for the hash. */
static void live_remove(struct exec *ex, struct sched_req *r)
{
    if (r->live_prev)
        r->live_prev->live_next = r->live_next;
    else if (ex->live == r)
        ex->live = r->live_next;
    else
        return; /* not on the list */
    if (r->live_next)
        r->live_next->live_prev = r->live_prev;
    r->live_next = r->live_prev = NULL;
    if (!ex->hash_cap)
        return;
    for (struct sched_req **p = &ex->hash[live_bucket(ex, r->conn, r->id)]; *p; p = &(*p)->hnext)
        if (*p == r) {
            *p = r->hnext;
            ex->n_hashed--;
            break;
        }
}

/* Streams the tokens r produced since the last event. */
/* The accounting's view of a request about to be answered (obs/acct.h). */
static void acct_report_done(struct acct *a, const struct sched_req *r)
{
    if (!a)
        return;
    struct acct_req q = {
        .tenant = r->tenant,
        .outcome = r->finish == SCHED_FINISH_CANCELLED ? ACCT_CANCELLED
                   : r->finish == SCHED_FINISH_ERROR   ? ACCT_FAILED
                                                       : ACCT_COMPLETED,
        .prompt = r->choice ? 0 : r->n_prompt, /* a request's other choices share its prompt */
        .cached = r->choice ? 0 : r->n_cached,
        .completion = r->n_toks > r->n_prompt ? r->n_toks - r->n_prompt : 0,
        .preemptions = r->n_preempt,
        .t_arrive = r->t_arrive,
        .t_sched = r->t_sched,
        .t_first = r->t_first,
        .t_done = r->t_done,
    };
    acct_request_done(a, &q);
}

/* The scheduler's queues and counters, and the executor's own, for
 * `stats` and the metrics (called with ex->mu held). */
static void acct_report_counters(struct exec *ex)
{
    const struct sched_counters *c = &ex->st.sched;
    struct acct_sched s = {
        .waiting = c->waiting,
        .running = c->running,
        .swapped = c->swapped,
        .live = ex->n_live,
        .submitted = ex->st.requests,
        .generated = ex->st.generated,
        .steps = c->steps,
        .prefill_tokens = c->prefill_tokens,
        .decode_tokens = c->decode_tokens,
        .preempt_swap = c->preempt_swap,
        .preempt_recompute = c->preempt_recompute,
        .step_launches = model_step_launches(ex->m),
        .layers = ex->hp->n_layer,
        .overlapped_steps = ex->st.overlap.steps,
        .host_steps = ex->st.overlap.host_steps,
        .host_ns = ex->st.overlap.host_ns,
        .idle_steps = ex->st.overlap.idle_steps,
        .idle_ns = ex->st.overlap.idle_ns,
    };
    const struct exec_spec_stats *p = &ex->st.spec;
    s.spec = (struct acct_spec){.draft_model = ex->conf.draft != NULL,
                                .max_batch = ex->conf.spec.max_batch,
                                .verify_steps = p->verify_steps,
                                .verifies = p->verifies,
                                .drafted = p->drafted,
                                .accepted = p->accepted,
                                .spec_tokens = p->spec_tokens,
                                .verify_step_tokens = p->verify_step_tokens,
                                .verify_ns = p->verify_ns,
                                .decode_steps = p->decode_steps,
                                .decode_tokens = p->decode_tokens,
                                .decode_ns = p->decode_ns};
    snprintf(s.spec.mode, sizeof s.spec.mode, "%s", spec_kind_name(ex->conf.spec.kind));
    acct_sched_set_slot(ex->conf.acct, ex->conf.acct_slot, &s);
}

static void publish_tokens(struct exec *ex, struct sched_req *r)
{
    size_t n_gen = r->n_toks - r->n_prompt;
    if (!r->stream || atomic_load(&r->detached))
        return;
    bool new_text = r->text && text_out_pending(r->text);
    if (r->n_sent >= n_gen && !new_text)
        return;
    size_t n = r->n_sent < n_gen ? n_gen - r->n_sent : 0;
    if (r->sink && r->sink->tokens)
        r->sink->tokens(r->sink->ud, r, r->toks + r->n_prompt + r->n_sent, n);
    r->n_sent = n_gen;
}

static void count_done(struct exec *ex, const struct sched_req *r)
{
    ex->st.completed += r->finish == SCHED_FINISH_LENGTH || r->finish == SCHED_FINISH_STOP;
    ex->st.cancelled += r->finish == SCHED_FINISH_CANCELLED;
    ex->st.failed += r->finish == SCHED_FINISH_ERROR;
}

/* One choice of a group has ended: held until every choice has, then the
 * group is answered at once (one reply) and freed. Executor thread. */
static void answer_choice(struct exec *ex, struct sched_req *r)
{
    struct sched_group *g = r->group;
    if (++g->n_answered < g->n)
        return;
    const struct sched_req *lead = g->reqs[0];
    if (!atomic_load(&lead->detached) && lead->sink && lead->sink->done_group)
        lead->sink->done_group(lead->sink->ud, (const struct sched_req *const *)g->reqs, g->n);
    pthread_mutex_lock(&ex->mu);
    ex->n_live -= g->n;
    for (uint32_t i = 0; i < g->n; i++)
        count_done(ex, g->reqs[i]);
    bool idle = ex->n_live == 0;
    pthread_cond_broadcast(&ex->idle);
    pthread_mutex_unlock(&ex->mu);
    sched_group_free(g);
    if (idle && ex->conf.on_idle)
        ex->conf.on_idle(ex->conf.on_idle_ud);
}

/* Answers r and frees it (any thread: the executor's, or a disk worker's
 * after a session save). */
static void answer(struct exec *ex, struct sched_req *r)
{
    if (r->text && text_out_finish(r->text) != 0 && r->finish != SCHED_FINISH_ERROR) {
        r->finish = SCHED_FINISH_ERROR;
        kvd_error_set(&r->err, KVD_ENOMEM, "out of memory for the completion's text");
    }
    if (r->finish != SCHED_FINISH_ERROR)
        publish_tokens(ex, r);
    if (r->group) {
        answer_choice(ex, r);
        return;
    }
    if (!atomic_load(&r->detached) && r->sink && r->sink->done)
        r->sink->done(r->sink->ud, r);
    pthread_mutex_lock(&ex->mu);
    ex->n_live--;
    count_done(ex, r);
    bool idle = ex->n_live == 0;
    pthread_cond_broadcast(&ex->idle);
    pthread_mutex_unlock(&ex->mu);
    sched_req_free(r);
    if (idle && ex->conf.on_idle)
        ex->conf.on_idle(ex->conf.on_idle_ud);
}

/* Closes the sequence a session request kept for its save. */
static void close_kept(struct exec *ex, struct sched_session *s)
{
    if (!s->kept)
        return;
    kvmm_lock(ex->mm);
    kvmm_seq_close(ex->mm, s->owner, s->seq);
    kvmm_unlock(ex->mm);
    s->kept = false;
}

struct save_job {
    struct exec *ex;
    struct sched_req *r;
};

/* The disk workers' job for a session request that ended well: the grown
 * conversation (prompt and completion) is saved under the session's name
 * while the kept sequence still holds its blocks; then r is answered. */
static void save_job_run(void *ud, bool cancelled)
{
    struct save_job j = *(struct save_job *)ud;
    free(ud);
    struct sched_session *s = j.r->session;
    if (cancelled)
        kvd_error_set(&s->err, KVD_ECANCELLED, "the daemon is shutting down: not saved");
    else
        s->saved = kvmm_session_save(j.ex->mm, j.r->tenant, j.r->ns, s->name, j.r->toks,
                                     j.r->n_toks, s->ttl_s, &s->info, &s->err) == 0;
    close_kept(j.ex, s);
    answer(j.ex, j.r);
}

/* A session request is saved before it is answered when it ended well (an
 * error, a cancel: the session stays as it was); the save's disk I/O runs
 * on the disk workers, never on this thread. */
static bool save_first(struct exec *ex, struct sched_req *r)
{
    struct sched_session *s = r->session;
    if (!s)
        return false;
    if (r->finish != SCHED_FINISH_LENGTH && r->finish != SCHED_FINISH_STOP) {
        kvd_error_set(&s->err, KVD_ECANCELLED, "the request did not complete: not saved");
        close_kept(ex, s);
        return false;
    }
    struct save_job *job = malloc(sizeof *job);
    if (job) {
        *job = (struct save_job){ex, r};
        if (ex->conf.disk_pool &&
            workpool_submit(ex->conf.disk_pool, r->tenant, save_job_run, job) == 0)
            return true;
        free(job);
    }
    kvd_error_set(&s->err, KVD_EBUSY, "the disk workers are full: not saved");
    close_kept(ex, s);
    return false;
}

/* A leader ended before its prompt was done: its other choices, which
 * have no sequence yet and are in no queue, end the same way. */
static void end_unforked(struct exec *ex, struct sched_req *lead, struct sched_req **done)
{
    struct sched_group *g = lead->group;
    if (!g || lead->choice != 0 || g->forked)
        return;
    g->forked = true; /* nothing forks after this */
    for (uint32_t i = 1; i < g->n; i++) {
        struct sched_req *f = g->reqs[i];
        f->state = SCHED_DONE;
        f->finish = lead->finish;
        f->err = lead->err;
        f->next = *done;
        *done = f;
    }
}

/* Answers and frees every request on the done list. */
static void publish_done(struct exec *ex, struct sched_req *done)
{
    while (done) {
        struct sched_req *r = done;
        done = r->next;
        end_unforked(ex, r, &done); /* they follow r on the list */
        r->t_done = sched_now_ns();
        int abort_code = atomic_load(&r->abort_code);
        if (abort_code && r->finish == SCHED_FINISH_CANCELLED) {
            r->finish = SCHED_FINISH_ERROR;
            kvd_error_set(&r->err, abort_code, "%s", r->abort_msg);
        }
        acct_report_done(ex->conf.acct, r);
        if (r->draft_seq && ex->conf.draft) {
            draft_release(ex->conf.draft, sched_req_owner(r));
            r->draft_seq = false;
        }
        /* Off the cancel list before the reply goes out (a cancel that
         * arrives after the reply finds nothing); still counted live until
         * answered, so a drain returns only after every reply is posted. */
        pthread_mutex_lock(&ex->mu);
        live_remove(ex, r);
        pthread_mutex_unlock(&ex->mu);
        if (!save_first(ex, r))
            answer(ex, r);
    }
}

/* ---- one step ----------------------------------------------------------- */

/* A stop token of the request, or the model's end of generation. */
static bool is_stop(const struct exec *ex, const struct sched_req *r, uint32_t tok)
{
    for (uint32_t i = 0; i < r->n_stop; i++)
        if (r->stop[i] == tok)
            return true;
    return !r->ignore_eos && text_is_eog(ex->conf.text, tok);
}

/* Takes tok (lp: its logprobs, when asked; NULL for a token a
 * verification gave, never one of a request with logprobs) as r's next
 * token and decides whether r is finished (r->finish set). Returns 1 when
 * it is. */
static uint32_t take_token(struct exec *ex, struct sched_req *r, uint32_t tok,
                           const struct sampler_logprob *lp)
{
    if (r->grammar_failed) {
        r->finish = SCHED_FINISH_ERROR;
        return 1;
    }
    int rc = sched_req_push(r, tok);
    if (!rc && r->gm && grammar_matcher_accept(r->gm, tok, &r->err) != 0) {
        r->finish = SCHED_FINISH_ERROR;
        return 1;
    }
    if (!rc && r->lp_on && lp)
        rc = sched_req_push_lp(r, lp);
    if (rc) {
        kvd_error_set(&r->err, rc, "out of memory for the sampled token");
        r->finish = SCHED_FINISH_ERROR;
        return 1;
    }
    ex->gen_step++;
    if (r->t_first == 0)
        r->t_first = sched_now_ns();
    size_t n_gen = r->n_toks - r->n_prompt;
    /* The text of a stop or end-of-generation token is not part of the
     * completion; any other token's may complete a stop string. */
    int trc = 0;
    if (is_stop(ex, r, tok))
        r->finish = SCHED_FINISH_STOP;
    else if (r->text && (trc = text_out_push(r->text, tok)) < 0) {
        kvd_error_set(&r->err, -trc, "out of memory for the completion's text");
        r->finish = SCHED_FINISH_ERROR;
    } else if (trc == 1)
        r->finish = SCHED_FINISH_STOP;
    else if (r->gm && grammar_matcher_must_end(r->gm))
        r->finish = SCHED_FINISH_STOP; /* the grammar's sentence is complete */
    else if (n_gen >= r->max_tokens || r->n_toks >= r->n_ctx)
        r->finish = SCHED_FINISH_LENGTH;
    else if (atomic_load(&r->cancel))
        r->finish = SCHED_FINISH_CANCELLED;
    return r->finish != SCHED_FINISH_NONE;
}

/* Takes the sampled token of every request whose chunk reached its last
 * known token, and of every choice forked this step, and decides whether
 * it is finished (verifications were taken by spec_resolve: their chunk
 * now ends before their last token). Runs without the kvmm lock. Returns
 * how many finished (their r->finish is set). */
static uint32_t sample_step(struct exec *ex)
{
    uint32_t n_fin = 0;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        if (r->state == SCHED_DONE)
            continue; /* ended at commit */
        if (r->restoring) {
            /* Cancelled: recomputing the lent sequence's own tokens, no
             * sampling; answered once they are all back. */
            if (r->n_kv >= r->n_orig) {
                r->finish = SCHED_FINISH_CANCELLED;
                n_fin++;
            }
            continue;
        }
        if (r->n_kv != r->n_toks)
            continue; /* a prefill chunk short of the end, or a verification */
        n_fin += take_token(ex, r, ex->picks[ex->out0[i]],
                            r->lp_on ? ex->lpstep + (size_t)i * LP_STRIDE : NULL);
    }
    for (uint32_t k = 0; k < ex->n_forked; k++) {
        struct sched_req *f = ex->forked[k];
        f->fork_pending = false;
        if (f->state != SCHED_DONE)
            n_fin += take_token(ex, f, f->fork_pick, f->fork_lp);
    }
    return n_fin;
}

/* Sets the logits of the tokens r's grammar does not allow here to -inf.
 * Non-zero (r->grammar_failed, r->err) when the mask cannot be made or
 * allows nothing: the request then ends with that error. */
static int grammar_mask(struct sched_req *r, float *row, uint32_t n_vocab)
{
    size_t n_allowed = 0;
    const uint32_t *bits = grammar_matcher_mask(r->gm, &n_allowed, &r->err);
    if (bits && n_allowed == 0)
        kvd_error_set(&r->err, KVD_EBADREQ,
                      "grammar: no token of the vocabulary can continue the text here, and the "
                      "grammar cannot end");
    if (!bits || n_allowed == 0) {
        if (r->err.param[0] == '\0')
            snprintf(r->err.param, sizeof r->err.param, "grammar");
        r->grammar_failed = true;
        return -1;
    }
    uint32_t n_gv = grammar_vocab_n(grammar_matcher_vocab(r->gm));
    for (uint32_t t = 0; t < n_vocab; t++)
        if (t >= n_gv || !(bits[t / 32] >> (t % 32) & 1))
            row[t] = -INFINITY;
    return 0;
}

/* Whether r leads choices that wait for its prompt: the step that ends its
 * prompt draws their first tokens too. */
static bool leads_unforked(const struct sched_req *r)
{
    return r->group && r->choice == 0 && !r->group->forked;
}

/* The leader's prompt is done: every other choice draws its first token
 * from the same raw logits (ex->grow) with its own stream, mask and
 * chain, as a request of its own would from that row. */
static int fork_picks(struct exec *ex, struct sched_req *lead, uint32_t V)
{
    struct sched_group *g = lead->group;
    for (uint32_t k = 1; k < g->n; k++) {
        struct sched_req *f = g->reqs[k];
        memcpy(ex->frow, ex->grow, (size_t)V * sizeof *ex->frow);
        f->smp_before = f->smp;
        f->fork_pending = true;
        f->fork_pick = 0;
        if (f->gm && grammar_mask(f, ex->frow, V))
            continue; /* f->grammar_failed: it ends with the reason */
        int rc = sampler_sample_host(&f->smp, &ex->hsc, lead->toks, lead->n_toks, ex->frow, V,
                                     ex->counts, &f->fork_pick);
        if (rc)
            return rc;
        if (f->lp_on) {
            if (!f->fork_lp && !(f->fork_lp = malloc(LP_STRIDE * sizeof *f->fork_lp)))
                return KVD_ENOMEM;
            sampler_logprobs(ex->grow, V, f->fork_pick, f->lp_top, f->fork_lp);
        }
    }
    return 0;
}

/* Submits the plan's step; the backend samples every request whose chunk
 * reaches its last known token (the request's uniform for the step is drawn
 * here, so the draw sequence is the request's own whatever the batch), and
 * every row of a verification (one uniform per row, rewound by
 * spec_resolve to the tokens it keeps). The sequences go to the model
 * decodes and verifications first: with speculation on they are the
 * batch-invariant prefix (model.h fwd_batch.invariant). When every pick is
 * the backend's (no logits come back) the step may still run on the device
 * on return (ex->fwd_pending: forward_finish waits for it); otherwise it is
 * done, picked here. */
static int forward_submit(struct exec *ex)
{
    struct sched_plan *p = &ex->plan;
    ex->fwd_pending = false;
    bool host = false, lp = false;
    uint32_t nf = 0, nout = 0;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < p->n; i++) {
            const struct sched_req *r = p->reqs[i];
            if ((pass == 0) == (r->step_n == 1 || r->verify))
                ex->order[nf++] = i;
        }
    for (uint32_t k = 0; k < p->n; k++) {
        uint32_t i = ex->order[k];
        struct sched_req *r = p->reqs[i];
        bool want = !r->restoring && (r->verify || r->n_kv + r->step_n == r->n_toks);
        uint32_t nrows = r->verify ? r->step_n : 1;
        ex->out0[i] = nout;
        for (uint32_t j = 0; j < nrows; j++)
            ex->rows[nout + j] = (struct sample_row){.skip = !want};
        host |= want && !r->verify && (sampler_on_host(&r->smp) || r->gm || leads_unforked(r));
        lp |= want && !r->verify && r->lp_on;
        const uint32_t *toks = r->toks + r->n_kv;
        if (r->verify) {
            uint32_t *v = ex->vtoks + (size_t)i * (1 + SPEC_MAX_DRAFT);
            v[0] = r->toks[r->n_kv];
            memcpy(v + 1, r->draft, (size_t)r->n_draft * sizeof *v);
            toks = v;
            /* every row draws its uniform now; the stream is rewound to
             * the tokens kept (spec_resolve) */
            memcpy(ex->saved[i], r->smp.s, sizeof ex->saved[i]);
            for (uint32_t j = 0; j < nrows; j++)
                sampler_next_row(&r->smp, &ex->rows[nout + j]);
        }
        ex->fseqs[k] = (struct fwd_seq){
            .tokens = toks,
            .n_tokens = r->step_n,
            .pos0 = (uint32_t)r->n_kv,
            .slots = p->slots + p->slot0[i],
            .n_slots = p->slot0[i + 1] - p->slot0[i],
            .all_rows = r->verify,
        };
        nout += nrows;
    }
    struct fwd_batch b = {
        .seqs = ex->fseqs,
        .n_seqs = p->n,
        .kv_arena = kvmm_device_arena(ex->mm),
        .geom = kvmm_geom(ex->mm),
        .n_arena_slots = ex->n_arena_slots,
        .sample = ex->rows,
        .tokens = ex->picks,
        .invariant = ex->spec_on,
    };
    if (!host && !lp) {
        for (uint32_t i = 0; i < p->n; i++)
            if (!p->reqs[i]->verify && !ex->rows[ex->out0[i]].skip)
                sampler_next_row(&p->reqs[i]->smp, &ex->rows[ex->out0[i]]);
        int rc = model_forward_submit(ex->m, ex->fc, &b);
        ex->fwd_pending = rc == 0;
        return rc;
    }
    /* Some row needs a host-only stage, or logprobs: the whole step's
     * logits come back (n_out * n_vocab * 4 bytes). With a host-only
     * stage every row is picked here, with the same pick as the backends'
     * sample op for the rows that need nothing more; for logprobs alone
     * the backend still picks. */
    uint32_t V = ex->hp->n_vocab;
    if (nout > ex->cap_hlogits) {
        float *h = realloc(ex->hlogits, (size_t)nout * V * sizeof *h);
        if (!h)
            return KVD_ENOMEM;
        ex->hlogits = h;
        ex->cap_hlogits = nout;
    }
    if (host && !ex->counts && !(ex->counts = malloc((size_t)ex->hp->n_ctx * sizeof *ex->counts)))
        return KVD_ENOMEM;
    if (lp && !ex->lpstep &&
        !(ex->lpstep = malloc((size_t)ex->conf.max_seqs * LP_STRIDE * sizeof *ex->lpstep)))
        return KVD_ENOMEM;
    if (lp && host && !ex->lprow && !(ex->lprow = malloc((size_t)V * sizeof *ex->lprow)))
        return KVD_ENOMEM;
    if (host && !ex->grow &&
        (!(ex->grow = malloc((size_t)V * sizeof *ex->grow)) ||
         !(ex->frow = malloc((size_t)V * sizeof *ex->frow))))
        return KVD_ENOMEM;
    b.logits = ex->hlogits;
    if (host) {
        b.sample = NULL;
    } else {
        for (uint32_t i = 0; i < p->n; i++)
            if (!p->reqs[i]->verify && !ex->rows[ex->out0[i]].skip)
                sampler_next_row(&p->reqs[i]->smp, &ex->rows[ex->out0[i]]);
    }
    int rc = model_forward(ex->m, ex->fc, &b);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < p->n; i++) {
        struct sched_req *r = p->reqs[i];
        uint32_t o = ex->out0[i];
        float *row = ex->hlogits + (size_t)o * V;
        if (r->verify) {
            /* its rows' uniforms were drawn before the step: the same pick
             * as the backend's sample op */
            for (uint32_t j = 0; host && j < r->step_n; j++)
                if ((rc = sampler_pick(&ex->rows[o + j], &ex->hsc, row + (size_t)j * V, V,
                                       &ex->picks[o + j])))
                    return rc;
            continue;
        }
        if (ex->rows[o].skip) {
            ex->picks[o] = 0;
            continue;
        }
        /* the raw row, before the host pick adjusts it */
        const float *raw = row;
        bool lead = leads_unforked(r);
        if (lead)
            memcpy(ex->grow, row, (size_t)V * sizeof *row);
        if (host && r->lp_on) {
            memcpy(ex->lprow, row, (size_t)V * sizeof *row);
            raw = ex->lprow;
        }
        if (r->gm && grammar_mask(r, row, V)) {
            ex->picks[o] = 0;
        } else {
            if (host && (rc = sampler_sample_host(&r->smp, &ex->hsc, r->toks, r->n_toks, row, V,
                                                  ex->counts, &ex->picks[o])))
                return rc;
            if (r->lp_on)
                sampler_logprobs(raw, V, ex->picks[o], r->lp_top,
                                 ex->lpstep + (size_t)i * LP_STRIDE);
        }
        if (lead && (rc = fork_picks(ex, r, V)))
            return rc;
    }
    return 0;
}

/* Waits for a step forward_submit left on the device (its picks in
 * ex->picks); rc: the submit's status. */
static int forward_finish(struct exec *ex, int rc)
{
    if (!ex->fwd_pending)
        return rc;
    ex->fwd_pending = false;
    int frc = model_forward_finish(ex->m, ex->fc);
    return rc ? rc : frc;
}

/* Whether every request of the plan decodes one token (no prefill, no
 * verification, no restoring). */
static bool plan_plain(const struct sched_plan *p)
{
    bool plain = p->n > 0;
    for (uint32_t i = 0; i < p->n && plain; i++) {
        const struct sched_req *r = p->reqs[i];
        plain = r->step_n == 1 && !r->verify && !r->restoring && r->n_kv + 1 == r->n_toks;
    }
    return plain;
}

/* forward_submit, timed: the device's wait between two plain decode steps
 * (from the first's finish to the second's submit), and the iteration's
 * time inside the forward (dev_ns). */
static int submit_step(struct exec *ex)
{
    uint64_t t0 = sched_now_ns();
    bool plain = plan_plain(&ex->plan);
    if (plain && ex->prev_plain && ex->t_fin) {
        ex->ost.idle_steps++;
        ex->ost.idle_ns += t0 - ex->t_fin;
    }
    ex->prev_plain = plain;
    int rc = forward_submit(ex);
    ex->dev_ns += sched_now_ns() - t0;
    return rc;
}

static int finish_step(struct exec *ex, int rc)
{
    uint64_t t0 = sched_now_ns();
    rc = forward_finish(ex, rc);
    ex->t_fin = sched_now_ns();
    ex->dev_ns += ex->t_fin - t0;
    return rc;
}

/* ---- speculative decoding ------------------------------------------------- */

/* The kind r drafts with: its own choice or the daemon's; none for a
 * request whose pick needs the host (a grammar, logprobs, a bias, a
 * penalty, min_p, typical_p): those decode plainly. */
static enum spec_kind spec_kind_of(const struct exec *ex, const struct sched_req *r)
{
    enum spec_kind k = r->spec_kind == SPEC_DEFAULT ? ex->conf.spec.kind : r->spec_kind;
    if (k == SPEC_DRAFT && !ex->conf.draft)
        return SPEC_OFF;
    if (r->gm || r->lp_on || sampler_on_host(&r->smp))
        return SPEC_OFF;
    return k;
}

/* One draft token's price in plain decode steps for kind k: the
 * verification's extra row, and for the draft model its forward. Until
 * measured: 0.1 and 0.5. */
static float spec_cost(const struct exec *ex, enum spec_kind k)
{
    double c = ex->c_verify;
    if (k == SPEC_DRAFT)
        c += ex->t_plain_ns > 0 && ex->t_draft_ns > 0 ? ex->t_draft_ns / ex->t_plain_ns : 0.5;
    return (float)c;
}

static void ema(double *v, double x)
{
    *v = *v > 0 ? 0.9 * *v + 0.1 * x : x;
}

/* Before planning: drafts for every running request that decodes this
 * step and speculates, while at most spec.max_batch requests run. The
 * plan turns a decode with drafts into a verification (scheduler_plan.c). */
static void spec_prepare(struct exec *ex)
{
    const struct spec_conf *sc = &ex->conf.spec;
    struct sched_counters c;
    sched_counters(ex->sched, &c);
    bool allow = c.running > 0 && c.running <= sc->max_batch;
    uint32_t n_jobs = 0;
    ex->spec_on = false;
    for (struct sched_req *r = sched_running(ex->sched); r; r = r->next) {
        r->n_draft = 0;
        enum spec_kind k = allow ? spec_kind_of(ex, r) : SPEC_OFF;
        if (k == SPEC_OFF)
            continue;
        ex->spec_on = true;
        /* a leader whose prompt ends this step draws its choices' first
         * tokens from that row (fork_picks): it is never verified */
        if (r->restoring || r->n_kv + 1 != r->n_toks || atomic_load(&r->cancel) ||
            leads_unforked(r))
            continue;
        /* drafts never reach past max_tokens (the last token is the
         * target's own pick) nor the context */
        size_t n_gen = r->n_toks - r->n_prompt, lim = sc->max_draft;
        size_t left = r->max_tokens > n_gen ? r->max_tokens - n_gen - 1 : 0;
        size_t room = r->n_ctx > r->n_toks ? r->n_ctx - r->n_toks : 0;
        lim = lim < left ? lim : left;
        lim = lim < room ? lim : room;
        uint32_t want = spec_draft_len(&r->spec, (uint32_t)lim, spec_cost(ex, k));
        if (want == 0)
            continue;
        if (k == SPEC_NGRAM) {
            r->n_draft =
                spec_ngram(r->toks, r->n_toks, sc->ngram_min, sc->ngram_max, want, r->draft);
        } else if (n_jobs < sc->max_batch) {
            ex->jobs[n_jobs] = (struct draft_job){.owner = sched_req_owner(r),
                                                  .tenant = ex->tnames[n_jobs],
                                                  .toks = r->toks,
                                                  .n_toks = r->n_toks,
                                                  .k = want,
                                                  .out = r->draft};
            ex->job_req[n_jobs++] = r;
        }
    }
    if (n_jobs == 0)
        return;
    /* The tenants' names (the draft's namespaces) and, for the arbiter,
     * their weights: the draft model's forwards take a turn on the device
     * of their own, charged to the drafting tenants by the tokens the draft
     * computed for each. */
    size_t n_sh = 0;
    kvmm_lock(ex->mm);
    for (uint32_t i = 0; i < n_jobs; i++) {
        uint32_t t = ex->job_req[i]->tenant;
        kvmm_tenant_name(ex->mm, t, ex->tnames[i]);
        size_t k = 0;
        while (k < n_sh && ex->dshares[k].tenant != t)
            k++;
        if (k == n_sh)
            ex->dshares[n_sh++] =
                (struct arbiter_share){.tenant = t, .weight = kvmm_tenant_weight(ex->mm, t)};
    }
    kvmm_unlock(ex->mm);
    if (ex->conf.arbiter)
        arbiter_acquire(ex->conf.arbiter, ex->dshares, n_sh);
    uint64_t t0 = sched_now_ns();
    uint32_t fwds = draft_propose(ex->conf.draft, ex->jobs, n_jobs);
    uint64_t dt = sched_now_ns() - t0;
    if (ex->conf.arbiter) {
        for (uint32_t i = 0; i < n_jobs; i++)
            for (size_t k = 0; k < n_sh; k++)
                if (ex->dshares[k].tenant == ex->job_req[i]->tenant)
                    ex->dshares[k].tokens += ex->jobs[i].n_fwd;
        arbiter_release(ex->conf.arbiter, ex->dshares, n_sh, dt);
    }
    if (fwds)
        ema(&ex->t_draft_ns, (double)dt / fwds);
    for (uint32_t i = 0; i < n_jobs; i++) {
        ex->job_req[i]->n_draft = ex->jobs[i].n_out;
        ex->job_req[i]->draft_seq = true;
    }
}

/* After the forward: each verification keeps the drafts its own picks
 * reproduce and its pick after them (spec_accept), taken one by one as
 * plain decoding would take them (a stop ends it there); the request's
 * random stream is rewound to one draw per token kept, so its draws are
 * those of plain decoding. step_n becomes the positions to commit (the
 * last token and the kept drafts but the last token taken). Returns how
 * many requests finished. */
static uint32_t spec_resolve(struct exec *ex)
{
    uint32_t n_fin = 0;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        if (!r->verify || r->state == SCHED_DONE)
            continue;
        const uint32_t *picks = ex->picks + ex->out0[i];
        uint32_t nd = r->n_draft, m = spec_accept(r->draft, nd, picks), g = 0;
        memcpy(r->smp.s, ex->saved[i], sizeof ex->saved[i]);
        bool fin = false;
        while (g <= m && !fin) {
            uint32_t tok = g < m ? r->draft[g] : picks[m];
            struct sample_row dummy;
            sampler_next_row(&r->smp, &dummy);
            g++;
            fin = take_token(ex, r, tok, NULL);
        }
        n_fin += fin;
        r->step_n = g;
        spec_update(&r->spec, nd, m, ex->conf.spec.max_draft, spec_cost(ex, spec_kind_of(ex, r)));
        ex->sst.verifies++;
        ex->sst.drafted += nd;
        ex->sst.accepted += m;
        ex->sst.spec_tokens += g;
        if (spec_kind_of(ex, r) == SPEC_DRAFT)
            ex->sst.model_drafts++;
        else
            ex->sst.ngram_drafts++;
    }
    return n_fin;
}

/* After the commit of a step that ended a leader's prompt: each other
 * choice gets a copy-on-write fork of the leader's sequence (the prompt's
 * blocks shared, none computed again) and runs. A choice the fork is
 * refused to (the tenant's sequence quota) waits as a request of its own:
 * its stream goes back to before its draw, and when admitted it matches
 * the prompt's cached blocks and draws from its own logits. kvmm lock
 * held. */
static void fork_groups(struct exec *ex, struct sched_req **done)
{
    ex->n_forked = 0;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        if (!leads_unforked(r) || r->state == SCHED_DONE || r->n_kv != r->n_toks ||
            r->group->n < 2 || !r->group->reqs[1]->fork_pending)
            continue;
        struct sched_group *g = r->group;
        g->forked = true;
        if (ex->n_forked + g->n > ex->cap_forked) {
            uint32_t cap = 2 * (ex->n_forked + g->n);
            struct sched_req **v = realloc(ex->forked, cap * sizeof *v);
            if (v) {
                ex->forked = v;
                ex->cap_forked = cap;
            }
        }
        for (uint32_t k = 1; k < g->n; k++) {
            struct sched_req *f = g->reqs[k];
            size_t cap = r->n_prompt + 64;
            uint32_t *t = malloc(cap * sizeof *t);
            if (!t) {
                f->fork_pending = false;
                kvd_error_set(&f->err, KVD_ENOMEM, "out of memory forking the prompt");
                f->finish = SCHED_FINISH_ERROR;
                f->state = SCHED_DONE;
                f->next = *done;
                *done = f;
                continue;
            }
            memcpy(t, r->toks, r->n_prompt * sizeof *t);
            f->toks = t;
            f->cap_toks = cap;
            f->n_toks = f->n_prompt = r->n_prompt;
            f->n_cached = r->n_cached;
            f->t_sched = r->t_sched;
            if (ex->n_forked < ex->cap_forked && kvmm_seq_fork(ex->mm, sched_req_owner(r), r->seq,
                                                               sched_req_owner(f), &f->seq) == 0) {
                f->have_seq = true;
                f->n_kv = r->n_kv;
                sched_add_running(ex->sched, ex->mm, f);
                ex->forked[ex->n_forked++] = f;
            } else {
                f->smp = f->smp_before;
                f->fork_pending = false;
                f->grammar_failed = false;
                kvd_error_clear(&f->err);
                f->t_sched = 0;
                sched_add(ex->sched, ex->mm, f);
            }
        }
    }
}

/* The plan's tenants with their tokens and weights, for the arbiter
 * (kvmm lock held: the weights are kvmm's). */
static void plan_shares(struct exec *ex)
{
    ex->n_shares = 0;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        const struct sched_req *r = ex->plan.reqs[i];
        size_t k = 0;
        while (k < ex->n_shares && ex->shares[k].tenant != r->tenant)
            k++;
        if (k == ex->n_shares)
            ex->shares[ex->n_shares++] = (struct arbiter_share){
                .tenant = r->tenant, .tokens = 0, .weight = kvmm_tenant_weight(ex->mm, r->tenant)};
        ex->shares[k].tokens += r->step_n;
    }
}

/* The requests that arrived since the last iteration join the scheduler
 * (kvmm lock held). */
static void take_arrivals(struct exec *ex, struct sched_req *arrived, struct sched_req **done)
{
    while (arrived) {
        struct sched_req *r = arrived;
        arrived = r->next;
        r->next = r->prev = NULL;
        /* A prompt that failed to prepare, or was never prepared (the
         * request was cancelled first), ends here. */
        if (r->finish != SCHED_FINISH_NONE || r->prompt || r->constraint) {
            sched_reject(ex->mm, r, done);
            continue;
        }
        sched_add(ex->sched, ex->mm, r);
        if (atomic_load(&r->cancel)) /* cancelled while it was prepared */
            sched_note_cancel(ex->sched);
    }
}

/* Whether no request of p would draft before its step: spec_prepare's
 * test (more requests than spec.max_batch, or none that speculates). */
static bool spec_quiet(const struct exec *ex, const struct sched_plan *p)
{
    if (p->n > ex->conf.spec.max_batch)
        return true;
    for (uint32_t i = 0; i < p->n; i++)
        if (spec_kind_of(ex, p->reqs[i]) != SPEC_OFF)
            return false;
    return true;
}

/* Whether the step on the device (its forward submitted, its picks the
 * backend's) may have its successor planned now, before its tokens are
 * known: every request decodes one token with nothing the host must do
 * between the steps (no drafts, no fork, no cancel seen yet), and nothing
 * new waits (an arrival, a drain) that the next plan should see. The
 * scheduler checks its own queues (sched_plan_ahead). */
static bool can_ahead(struct exec *ex, bool drain)
{
    if (!ex->overlap || !ex->fwd_pending || drain || ex->n_forked)
        return false;
    if (!spec_quiet(ex, &ex->plan))
        return false;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        if (r->step_n != 1 || r->verify || r->restoring || r->n_kv + 1 != r->n_toks ||
            leads_unforked(r) || atomic_load(&r->cancel))
            return false;
    }
    pthread_mutex_lock(&ex->mu);
    bool quiet = !ex->inbox_head && !ex->draining && !ex->stop;
    pthread_mutex_unlock(&ex->mu);
    return quiet;
}

/* One iteration: one step's forward waited for, committed and published.
 * Synchronous: plan → submit → wait → commit → take tokens → finish →
 * publish, the device idle from the wait to the next submit. Overlapped
 * (can_ahead): while the device runs step N the next one is planned (each
 * request grown by the position N's token will take), and once N's tokens
 * are taken and the requests they ended are finished (their position given
 * back), step N+1 is submitted before N's results are published; the next
 * iteration starts with N+1 in flight. The device then waits only for the
 * commit, the tokens' taking and N+1's metadata. Returns false when there
 * was nothing to compute. */
static bool step(struct exec *ex, struct sched_req *arrived, bool drain)
{
    struct sched_req *done = NULL;
    struct kvmm *mm = ex->mm;
    uint64_t t_iter = sched_now_ns(), t_fwd;
    int rc;
    ex->dev_ns = 0;

    if (ex->inflight) {
        /* ex->plan is on the device: the arrivals wait for the next plan,
         * a drain for the step's end (can_ahead refuses another) */
        ex->inflight = false;
        rc = ex->fwd_rc;
        t_fwd = ex->t_fwd;
        kvmm_lock(mm);
        take_arrivals(ex, arrived, &done);
        kvmm_unlock(mm);
    } else {
        spec_prepare(ex);
        kvmm_lock(mm);
        take_arrivals(ex, arrived, &done);
        if (drain)
            sched_drain(ex->sched, mm, &done);
        rc = sched_plan(ex->sched, mm, &ex->plan, &done);
        if (rc == 0 && ex->conf.arbiter)
            plan_shares(ex);
        kvmm_unlock(mm);
        if (rc) {
            /* Out of memory for the plan itself: end everything rather than spin. */
            kvmm_lock(mm);
            sched_drain(ex->sched, mm, &done);
            kvmm_unlock(mm);
            for (struct sched_req *r = done; r; r = r->next)
                if (r->finish == SCHED_FINISH_CANCELLED && !atomic_load(&r->cancel)) {
                    r->finish = SCHED_FINISH_ERROR;
                    kvd_error_set(&r->err, rc, "executor out of memory");
                }
            publish_done(ex, done);
            return false;
        }
        if (ex->plan.n == 0) {
            publish_done(ex, done);
            return false;
        }
        if (ex->conf.arbiter)
            arbiter_acquire(ex->conf.arbiter, ex->shares, ex->n_shares);
        t_fwd = sched_now_ns();
        rc = submit_step(ex);
    }
    ex->gen_step = 0;
    /* While the device computes: the next step's plan. */
    bool ahead = false;
    if (rc == 0 && can_ahead(ex, drain)) {
        kvmm_lock(mm);
        ahead = sched_plan_ahead(ex->sched, mm, &ex->plan, &ex->ahead);
        kvmm_unlock(mm);
    }
    rc = finish_step(ex, rc);
    uint64_t fwd_ns = sched_now_ns() - t_fwd;
    bool plain_step = rc == 0 && plan_plain(&ex->plan);
    /* The arbiter charges the rows computed: a verification's 1 + k
     * (plan_shares), whatever it keeps of them. */
    if (ex->conf.arbiter)
        arbiter_release(ex->conf.arbiter, ex->shares, ex->n_shares, fwd_ns);
    uint32_t n_fin = 0;
    if (rc == 0) {
        uint64_t dt = fwd_ns;
        roofline_record_fwd_shape(ex->conf.roofline, &ex->shape, ex->fseqs, ex->plan.n, dt);
        bool verify = false, plain = true;
        for (uint32_t i = 0; i < ex->plan.n; i++) {
            const struct sched_req *r = ex->plan.reqs[i];
            verify |= r->verify;
            plain &= r->step_n == 1 && !r->verify && !r->restoring && r->n_kv + 1 == r->n_toks;
        }
        if (verify) {
            ex->sst.verify_steps++;
            ex->sst.verify_ns += dt;
            /* the drafts' rows' share of the step, per row, over a plain
             * step (a rough price: the batches of the two may differ) */
            uint32_t rows = 0;
            for (uint32_t i = 0; i < ex->plan.n; i++)
                rows += ex->plan.reqs[i]->verify ? ex->plan.reqs[i]->n_draft : 0;
            if (ex->t_plain_ns > 0 && rows) {
                double c = ((double)dt / ex->t_plain_ns - 1.0) / rows;
                ema(&ex->c_verify, c < 0 ? 0 : c > 2 ? 2 : c);
            }
        } else if (plain) {
            ex->sst.decode_steps++;
            ex->sst.decode_tokens += ex->plan.n;
            ex->sst.decode_ns += dt;
            ema(&ex->t_plain_ns, (double)dt);
        }
        n_fin = spec_resolve(ex);
    }

    kvmm_lock(mm);
    if (rc) {
        for (uint32_t i = 0; i < ex->plan.n; i++) {
            struct sched_req *r = ex->plan.reqs[i];
            kvd_error_set(&r->err, KVD_EINTERNAL, "model forward failed: %s",
                          fwd_ctx_errmsg(ex->fc));
            r->finish = SCHED_FINISH_ERROR;
            sched_finish(ex->sched, mm, r, SCHED_FINISH_ERROR);
            r->next = done;
            done = r;
        }
        ex->plan.n = 0;
    } else {
        sched_commit(ex->sched, mm, &ex->plan, &done);
        /* A verification's rejected drafts: their slots (and K/V) go; none
         * of them was committed, so no block they filled entered the tree. */
        for (uint32_t i = 0; i < ex->plan.n; i++) {
            struct sched_req *r = ex->plan.reqs[i];
            size_t extra = r->verify ? 1 + (size_t)r->n_draft - r->step_n : 0;
            if (r->state == SCHED_DONE || extra == 0)
                continue;
            if (kvmm_seq_truncate(mm, sched_req_owner(r), r->seq, extra) != 0) {
                if (r->finish != SCHED_FINISH_NONE)
                    n_fin--;
                kvd_error_set(&r->err, KVD_EINTERNAL, "cannot drop rejected drafts: %s",
                              kvmm_errmsg(mm));
                r->finish = SCHED_FINISH_ERROR;
                sched_finish(ex->sched, mm, r, SCHED_FINISH_ERROR);
                r->next = done;
                done = r;
            }
        }
        fork_groups(ex, &done);
    }
    kvmm_unlock(mm);

    n_fin += sample_step(ex);
    /* every token taken this step: verifications' (spec_resolve), the
     * step's picks and the first tokens of the choices forked in it */
    uint64_t gen = ex->gen_step;
    for (uint32_t i = 0; i < ex->plan.n; i++)
        if (ex->plan.reqs[i]->verify) {
            ex->sst.verify_step_tokens += gen;
            break;
        }
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        ex->plan.reqs[i]->n_draft = 0;
        ex->plan.reqs[i]->verify = false;
    }
    /* this step's requests, then the choices forked in it */
    struct sched_plan *cur = &ex->plan;
    uint32_t n_all = cur->n + ex->n_forked;
#define STEP_REQ(i) ((i) < cur->n ? cur->reqs[i] : ex->forked[(i)-cur->n])
    if (n_fin) {
        kvmm_lock(mm);
        for (uint32_t i = 0; i < n_all; i++) {
            struct sched_req *r = STEP_REQ(i);
            if (r->state == SCHED_DONE || r->finish == SCHED_FINISH_NONE)
                continue;
            sched_finish(ex->sched, mm, r, r->finish);
            r->next = done;
            done = r;
        }
        kvmm_unlock(mm);
    }
    if (ahead) {
        /* The next step, planned while this one ran: the requests that
         * ended gave their position back (sched_end_req); the others go
         * to the device now, before this step's results are published.
         * This step's requests stay in `cur` (ex->ahead after the swap). */
        kvmm_lock(mm);
        int arc = sched_plan_ahead_slots(ex->sched, mm, &ex->ahead, &done);
        if (arc || !spec_quiet(ex, &ex->ahead)) {
            /* out of memory for the tables, or fewer requests are left
             * than speculation waits for: the positions go back, and the
             * next step is planned as usual */
            for (uint32_t i = 0; i < ex->ahead.n; i++) {
                struct sched_req *r = ex->ahead.reqs[i];
                r->step_n = 0;
                kvmm_seq_truncate(mm, sched_req_owner(r), r->seq, 1);
            }
            ex->ahead.n = 0;
        }
        if (ex->ahead.n) {
            struct sched_plan t = ex->plan;
            ex->plan = ex->ahead;
            ex->ahead = t;
            cur = &ex->ahead;
            if (ex->conf.arbiter)
                plan_shares(ex);
        }
        kvmm_unlock(mm);
        if (ex->plan.n && cur != &ex->plan) {
            ex->spec_on = false; /* spec_quiet: spec_prepare would say the same */
            if (ex->conf.arbiter)
                arbiter_acquire(ex->conf.arbiter, ex->shares, ex->n_shares);
            ex->t_fwd = sched_now_ns();
            ex->fwd_rc = submit_step(ex);
            ex->inflight = true;
            ex->ost.steps++;
        }
    }
    for (uint32_t i = 0; i < n_all; i++) {
        struct sched_req *r = STEP_REQ(i);
        if (r->state != SCHED_DONE)
            publish_tokens(ex, r);
    }
#undef STEP_REQ
    ex->n_forked = 0;
    if (plain_step) {
        ex->ost.host_steps++;
        ex->ost.host_ns += sched_now_ns() - t_iter - ex->dev_ns;
    }
    pthread_mutex_lock(&ex->mu);
    ex->st.generated += gen;
    ex->st.spec = ex->sst;
    ex->st.overlap = ex->ost;
    sched_counters(ex->sched, &ex->st.sched);
    pthread_mutex_unlock(&ex->mu);
    publish_done(ex, done);
    return true;
}

static void *exec_main(void *arg)
{
    struct exec *ex = arg;
    pthread_mutex_lock(&ex->mu);
    for (;;) {
        bool busy = sched_busy(ex->sched);
        while (!ex->stop && !ex->inbox_head && !busy)
            pthread_cond_wait(&ex->wake, &ex->mu);
        if (ex->stop && !ex->inbox_head && !busy)
            break;
        struct sched_req *arrived = ex->inbox_head;
        ex->inbox_head = ex->inbox_tail = NULL;
        bool drain = ex->draining;
        pthread_mutex_unlock(&ex->mu);

        bool progressed = step(ex, arrived, drain);

        pthread_mutex_lock(&ex->mu);
        if (!progressed && sched_busy(ex->sched) && !ex->inbox_head && !ex->stop) {
            /* Requests wait for memory that only other connections can
             * free (no event tells us when): look again shortly. */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 2000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&ex->wake, &ex->mu, &ts);
        }
        sched_counters(ex->sched, &ex->st.sched);
        acct_report_counters(ex);
    }
    pthread_mutex_unlock(&ex->mu);
    return NULL;
}

/* ---- public ------------------------------------------------------------- */

int exec_new(struct kvmm *mm, struct model *m, const struct exec_conf *conf, struct exec **out,
             struct kvd_error *err)
{
    static const char nomem[] = "out of memory starting the executor";
    struct exec *ex = calloc(1, sizeof(*ex));
    if (!ex) {
        draft_free(conf->draft); /* the executor's from here on */
        return kvd_error_set(err, KVD_ENOMEM, "%s", nomem);
    }
    int rc;
    ex->mm = mm;
    ex->m = m;
    ex->conf = *conf;
    if (!ex->conf.step_tokens)
        ex->conf.step_tokens = 512;
    if (!ex->conf.max_seqs)
        ex->conf.max_seqs = 64;
    if (ex->conf.step_tokens < ex->conf.max_seqs)
        ex->conf.max_seqs = ex->conf.step_tokens;
    if (!ex->conf.queue_timeout_ms)
        ex->conf.queue_timeout_ms = 60000;
    struct spec_conf *spc = &ex->conf.spec;
    ex->c_verify = 0.1;
    if (spc->kind == SPEC_DEFAULT)
        spc->kind = SPEC_OFF;
    if (!spc->max_batch)
        spc->max_batch = 4;
    if (spc->max_batch > ex->conf.max_seqs)
        spc->max_batch = ex->conf.max_seqs;
    if (!spc->max_draft)
        spc->max_draft = 8;
    if (spc->max_draft > SPEC_MAX_DRAFT)
        spc->max_draft = SPEC_MAX_DRAFT;
    if (!spc->ngram_min)
        spc->ngram_min = 1;
    if (!spc->ngram_max)
        spc->ngram_max = 3;
    if (spc->ngram_max < spc->ngram_min)
        spc->ngram_max = spc->ngram_min;
    ex->hp = model_hparams(m);
    ex->overlap = ex->conf.overlap == EXEC_OVERLAP_ON ||
                  (ex->conf.overlap == EXEC_OVERLAP_AUTO && model_async(m));
    roofline_shape_from_model(ex->hp, kvmm_geom(mm), &ex->shape);
    if (ex->conf.roofline)
        roofline_set_shape(ex->conf.roofline, &ex->shape);
    pthread_mutex_init(&ex->mu, NULL);
    pthread_cond_init(&ex->wake, NULL);
    pthread_cond_init(&ex->idle, NULL);

    struct kv_geom want;
    const struct kv_geom *have = kvmm_geom(mm);
    model_kv_geom(m, have->block_tokens, have->dtype, &want);
    if (want.layers != have->layers || want.kv_heads != have->kv_heads ||
        want.head_dim != have->head_dim) {
        rc = kvd_error_set(
            err, KVD_EBADREQ,
            "KV geometry %u layers x %u kv heads x %u dims does not match the model's %u x %u x %u",
            have->layers, have->kv_heads, have->head_dim, want.layers, want.kv_heads,
            want.head_dim);
        goto fail;
    }
    ex->n_arena_slots = kvmm_device_slots(mm);

    struct sched_conf sc = {
        .step_tokens = ex->conf.step_tokens,
        .max_seqs = ex->conf.max_seqs,
        .queue_timeout_ns = ex->conf.queue_timeout_ms == UINT32_MAX
                                ? 0
                                : (uint64_t)ex->conf.queue_timeout_ms * 1000000ull,
    };
    if ((rc = sched_new(&sc, &ex->sched))) {
        if (rc == KVD_ENOMEM)
            kvd_error_set(err, rc, "%s", nomem);
        else
            kvd_error_set(err, rc, "bad scheduler settings (%u tokens / %u sequences a step)",
                          sc.step_tokens, sc.max_seqs);
        goto fail;
    }
    if (spc->kind == SPEC_DRAFT && !ex->conf.draft) {
        rc = kvd_error_set(err, KVD_EBADREQ,
                           "speculative decoding with a draft model needs one "
                           "(--draft-model, or [model:NAME] draft = OTHER)");
        goto fail;
    }
    /* Output rows: one per sequence, plus the drafts of the requests that
     * may verify at once. */
    ex->max_out = sc.max_seqs + spc->max_batch * spc->max_draft;
    if (ex->max_out > sc.step_tokens)
        ex->max_out = sc.step_tokens;
    if ((rc = fwd_ctx_new_out(m, sc.step_tokens, sc.max_seqs, ex->max_out, &ex->fc))) {
        kvd_error_set(err, rc, "cannot size the forward scratch for %u tokens / %u sequences",
                      sc.step_tokens, sc.max_seqs);
        goto fail;
    }
    ex->fseqs = calloc(sc.max_seqs, sizeof(*ex->fseqs));
    ex->rows = calloc(ex->max_out, sizeof(*ex->rows));
    ex->picks = calloc(ex->max_out, sizeof(*ex->picks));
    ex->order = calloc(sc.max_seqs, sizeof(*ex->order));
    ex->out0 = calloc(sc.max_seqs, sizeof(*ex->out0));
    ex->vtoks = calloc((size_t)sc.max_seqs * (1 + SPEC_MAX_DRAFT), sizeof(*ex->vtoks));
    ex->saved = calloc(sc.max_seqs, sizeof(*ex->saved));
    ex->jobs = calloc(spc->max_batch, sizeof(*ex->jobs));
    ex->job_req = calloc(spc->max_batch, sizeof(*ex->job_req));
    ex->shares = calloc(sc.max_seqs, sizeof(*ex->shares));
    ex->dshares = calloc(spc->max_batch, sizeof(*ex->dshares));
    ex->tnames = calloc(spc->max_batch, sizeof(*ex->tnames));
    if (!ex->fseqs || !ex->rows || !ex->picks || !ex->order || !ex->out0 || !ex->vtoks ||
        !ex->saved || !ex->jobs || !ex->job_req || !ex->shares || !ex->dshares || !ex->tnames) {
        rc = kvd_error_set(err, KVD_ENOMEM, "%s", nomem);
        goto fail;
    }
    acct_report_counters(ex); /* "executor": true from the start */
    if (pthread_create(&ex->thread, NULL, exec_main, ex) != 0) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "cannot start the executor thread");
        goto fail;
    }
    ex->started = true;
    *out = ex;
    return 0;
fail:
    exec_free(ex);
    return rc;
}

void exec_free(struct exec *ex)
{
    if (!ex)
        return;
    if (ex->started) {
        exec_drain(ex);
        pthread_mutex_lock(&ex->mu);
        ex->stop = true;
        pthread_cond_broadcast(&ex->wake);
        pthread_mutex_unlock(&ex->mu);
        pthread_join(ex->thread, NULL);
        acct_sched_retire(ex->conf.acct, ex->conf.acct_slot);
    }
    sched_free(ex->sched);
    if (ex->fc)
        fwd_ctx_free(ex->fc);
    draft_free(ex->conf.draft); /* its sequences, KV and scratch (and private weights) */
    sched_plan_free(&ex->plan);
    sched_plan_free(&ex->ahead);
    free(ex->fseqs);
    free(ex->rows);
    free(ex->picks);
    free(ex->order);
    free(ex->out0);
    free(ex->vtoks);
    free(ex->saved);
    free(ex->jobs);
    free(ex->job_req);
    free(ex->shares);
    free(ex->dshares);
    free(ex->tnames);
    free(ex->hlogits);
    free(ex->lpstep);
    free(ex->lprow);
    free(ex->grow);
    free(ex->frow);
    free(ex->forked);
    free(ex->counts);
    sampler_scratch_free(&ex->hsc);
    free(ex->hash);
    pthread_cond_destroy(&ex->idle);
    pthread_cond_destroy(&ex->wake);
    pthread_mutex_destroy(&ex->mu);
    free(ex);
}

const struct text *exec_text(const struct exec *ex)
{
    return ex->conf.text;
}

const struct model_hparams *exec_hparams(const struct exec *ex)
{
    return ex->hp;
}

const struct spec_conf *exec_spec_conf(const struct exec *ex)
{
    return &ex->conf.spec;
}

bool exec_has_draft(const struct exec *ex)
{
    return ex->conf.draft != NULL;
}

size_t exec_scratch_bytes(const struct exec *ex)
{
    return fwd_ctx_dev_bytes(ex->fc) + (ex->conf.draft ? draft_scratch_bytes(ex->conf.draft) : 0);
}

uint64_t exec_draft_kv_bytes(const struct exec *ex)
{
    return ex->conf.draft ? draft_kv_device_bytes(ex->conf.draft) : 0;
}

uint64_t exec_next_serial(struct exec *ex)
{
    pthread_mutex_lock(&ex->mu);
    uint64_t s = ++ex->serial;
    pthread_mutex_unlock(&ex->mu);
    return s;
}

/* Under ex->mu: r joins the inbox the executor thread takes from. */
static void inbox_push(struct exec *ex, struct sched_req *r)
{
    r->next = NULL;
    if (ex->inbox_tail)
        ex->inbox_tail->next = r;
    else
        ex->inbox_head = r;
    ex->inbox_tail = r;
    pthread_cond_signal(&ex->wake);
}

/* The pool's job for one request (workpool.h). */
struct prep_job {
    struct exec *ex;
    struct sched_req *r;
};

/* Whether r's cache match could reach the disk tier: a fresh sequence (a
 * lent one already holds its K/V) with a prompt of at least one block. */
static bool wants_disk(struct exec *ex, struct sched_req *r)
{
    bool tier = kvmm_disk_on(ex->mm) || kvmm_remote_on(ex->mm);
    return ex->conf.disk_pool && tier && !r->have_seq && r->finish == SCHED_FINISH_NONE &&
           !atomic_load(&r->cancel) && r->n_toks > kvmm_geom(ex->mm)->block_tokens;
}

static void to_inbox(struct exec *ex, struct sched_req *r)
{
    pthread_mutex_lock(&ex->mu);
    inbox_push(ex, r);
    pthread_mutex_unlock(&ex->mu);
}

/* The disk workers' job: what the match will ask for (every prompt token
 * but the last, whose logits are computed) is brought in from disk, then
 * what is still missing from the remote tier (given the whole prompt: its
 * values may end at the last token's block). */
static void disk_job_run(void *ud, bool cancelled)
{
    struct prep_job j = *(struct prep_job *)ud;
    free(ud);
    if (!cancelled && !atomic_load(&j.r->cancel)) {
        kvmm_disk_prefetch(j.ex->mm, j.r->tenant, j.r->ns, j.r->toks, j.r->n_toks - 1);
        kvmm_remote_prefetch(j.ex->mm, j.r->tenant, j.r->ns, j.r->toks, j.r->n_toks);
    }
    to_inbox(j.ex, j.r);
}

/* Hands r to the disk workers; when they refuse (this tenant has as many
 * prefetches waiting as it may), r goes on without one: its match then
 * recomputes what is only on disk. */
static void to_disk(struct exec *ex, struct sched_req *r, struct prep_job *job)
{
    if (!job && !(job = malloc(sizeof *job))) {
        to_inbox(ex, r);
        return;
    }
    *job = (struct prep_job){ex, r};
    if (workpool_submit(ex->conf.disk_pool, r->tenant, disk_job_run, job) != 0) {
        free(job);
        to_inbox(ex, r);
    }
}

/* Prepares r's prompt (a failure becomes its answer); cancelled requests
 * skip the work. Then r goes to the disk workers when its prompt may be on
 * disk, else to the executor thread. */
static void prepare(struct exec *ex, struct sched_req *r, bool cancelled)
{
    if (!cancelled && !atomic_load(&r->cancel) &&
        sched_req_prepare(ex->mm, ex->conf.text, r, &r->err) != 0)
        r->finish = SCHED_FINISH_ERROR;
    if (!cancelled && wants_disk(ex, r) &&
        (kvmm_disk_may_prefetch(ex->mm, r->ns, r->toks, r->n_toks - 1) ||
         kvmm_remote_may_prefetch(ex->mm, r->tenant, r->ns, r->toks, r->n_toks))) {
        to_disk(ex, r, NULL);
        return;
    }
    to_inbox(ex, r);
}

static void prep_job_run(void *ud, bool cancelled)
{
    struct prep_job j = *(struct prep_job *)ud;
    free(ud);
    prepare(j.ex, j.r, cancelled);
}

int exec_submit(struct exec *ex, struct sched_req *r)
{
    struct prep_job *job = NULL;
    /* Read before r is handed over: once in the inbox, the executor may
     * answer and free it at any time. */
    bool text = r->prompt != NULL || r->constraint != NULL, disk = !text && wants_disk(ex, r);
    if (((text && ex->conf.pool) || disk) && !(job = malloc(sizeof(*job))))
        return KVD_ENOMEM;
    pthread_mutex_lock(&ex->mu);
    if (ex->draining || ex->stop) {
        pthread_mutex_unlock(&ex->mu);
        free(job);
        return KVD_ECANCELLED;
    }
    if (r->serial == 0)
        r->serial = ++ex->serial;
    if (r->t_arrive == 0)
        r->t_arrive = sched_now_ns();
    r->n_ctx = ex->hp->n_ctx;
    /* every choice is live (cancel, disconnect and drain find each);
     * only the leader is queued */
    uint32_t n = r->group ? r->group->n : 1;
    for (uint32_t i = 0; i < n; i++) {
        struct sched_req *c = r->group ? r->group->reqs[i] : r;
        if (c->serial == 0)
            c->serial = ++ex->serial;
        if (c->t_arrive == 0)
            c->t_arrive = r->t_arrive;
        c->n_ctx = ex->hp->n_ctx;
        if (c != r)
            live_add(ex, c);
    }
    live_add(ex, r);
    ex->n_live += n;
    ex->st.requests += n;
    if (!text && !disk)
        inbox_push(ex, r);
    pthread_mutex_unlock(&ex->mu);
    if (disk) {
        to_disk(ex, r, job);
        return 0;
    }
    if (!text)
        return 0;
    if (!job) {
        prepare(ex, r, false);
        return 0;
    }
    /* Live before it is queued: a cancel or a drain finds it meanwhile. */
    *job = (struct prep_job){ex, r};
    int rc = workpool_submit(ex->conf.pool, r->tenant, prep_job_run, job);
    if (rc) {
        free(job);
        pthread_mutex_lock(&ex->mu);
        for (uint32_t i = 0; i < n; i++)
            live_remove(ex, r->group ? r->group->reqs[i] : r);
        ex->n_live -= n;
        ex->st.requests -= n;
        pthread_cond_broadcast(&ex->idle);
        pthread_mutex_unlock(&ex->mu);
    }
    return rc;
}

const char *exec_submit_errmsg(int rc)
{
    switch (rc) {
    case KVD_ECANCELLED:
        return "the daemon is shutting down";
    case KVD_EBUSY:
        return "this tenant has as many texts waiting for the text workers as it may "
               "(text-jobs-per-tenant); wait for their answers";
    default:
        return "out of memory";
    }
}

void exec_cancel(struct exec *ex, uint64_t conn, uint64_t id, bool *found)
{
    bool f = false;
    pthread_mutex_lock(&ex->mu);
    if (ex->hash_cap) {
        for (struct sched_req *r = ex->hash[live_bucket(ex, conn, id)]; r; r = r->hnext)
            if (r->conn == conn && r->id == id) {
                atomic_store(&r->cancel, true);
                f = true;
            }
    } else {
        for (struct sched_req *r = ex->live; r; r = r->live_next)
            if (r->conn == conn && r->id == id) {
                atomic_store(&r->cancel, true);
                f = true;
            }
    }
    if (f) {
        sched_note_cancel(ex->sched);
        pthread_cond_signal(&ex->wake);
    }
    pthread_mutex_unlock(&ex->mu);
    if (found)
        *found = f;
}

void exec_cancel_conn(struct exec *ex, uint64_t conn)
{
    pthread_mutex_lock(&ex->mu);
    for (struct sched_req *r = ex->live; r; r = r->live_next)
        if (r->conn == conn) {
            atomic_store(&r->detached, true);
            atomic_store(&r->cancel, true);
        }
    sched_note_cancel(ex->sched);
    pthread_cond_signal(&ex->wake);
    pthread_mutex_unlock(&ex->mu);
}

void exec_abort_conn(struct exec *ex, uint64_t conn, int code, const char *msg)
{
    pthread_mutex_lock(&ex->mu);
    for (struct sched_req *r = ex->live; r; r = r->live_next)
        if (r->conn == conn && !atomic_load(&r->abort_code)) {
            snprintf(r->abort_msg, sizeof(r->abort_msg), "%s", msg);
            atomic_store(&r->abort_code, code);
            atomic_store(&r->cancel, true);
        }
    sched_note_cancel(ex->sched);
    pthread_cond_signal(&ex->wake);
    pthread_mutex_unlock(&ex->mu);
}

void exec_drain(struct exec *ex)
{
    pthread_mutex_lock(&ex->mu);
    ex->draining = true;
    for (struct sched_req *r = ex->live; r; r = r->live_next)
        atomic_store(&r->cancel, true);
    sched_note_cancel(ex->sched);
    pthread_cond_broadcast(&ex->wake);
    while (ex->n_live > 0)
        pthread_cond_wait(&ex->idle, &ex->mu);
    pthread_mutex_unlock(&ex->mu);
}

void exec_stats(struct exec *ex, struct exec_stats *st)
{
    pthread_mutex_lock(&ex->mu);
    *st = ex->st;
    st->live = ex->n_live;
    pthread_mutex_unlock(&ex->mu);
}

/* The executor thread (see exec.h): takes submitted requests from an inbox,
 * and loops plan (scheduler, kvmm lock held) → model_forward (no lock) →
 * commit (lock) → take the sampled tokens (no lock) → finish (lock) →
 * publish (no lock). The backend samples inside model_forward. */
#include "exec.h"

#include "acct.h"
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
    struct fwd_seq *fseqs;   /* [max_seqs] */
    struct sample_row *rows; /* [max_seqs] this step's sampling, one per plan entry */
    uint32_t *picks;         /* [max_seqs] the tokens the backend sampled */
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
    uint32_t n_arena_slots;

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
    struct exec_stats st; /* st.sched: copied from the scheduler after each step */

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
        .prompt = r->n_prompt,
        .cached = r->n_cached,
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
    };
    acct_sched_set(ex->conf.acct, &s);
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
    if (!atomic_load(&r->detached) && r->sink && r->sink->done)
        r->sink->done(r->sink->ud, r);
    pthread_mutex_lock(&ex->mu);
    ex->n_live--;
    ex->st.completed += r->finish == SCHED_FINISH_LENGTH || r->finish == SCHED_FINISH_STOP;
    ex->st.cancelled += r->finish == SCHED_FINISH_CANCELLED;
    ex->st.failed += r->finish == SCHED_FINISH_ERROR;
    pthread_cond_broadcast(&ex->idle);
    pthread_mutex_unlock(&ex->mu);
    sched_req_free(r);
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

/* Answers and frees every request on the done list. */
static void publish_done(struct exec *ex, struct sched_req *done)
{
    while (done) {
        struct sched_req *r = done;
        done = r->next;
        r->t_done = sched_now_ns();
        int abort_code = atomic_load(&r->abort_code);
        if (abort_code && r->finish == SCHED_FINISH_CANCELLED) {
            r->finish = SCHED_FINISH_ERROR;
            kvd_error_set(&r->err, abort_code, "%s", r->abort_msg);
        }
        acct_report_done(ex->conf.acct, r);
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

/* Takes the sampled token of every request whose chunk reached its last
 * known token, and decides whether it is finished. Runs without the kvmm
 * lock. Returns how many finished (their r->finish is set). */
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
            continue; /* a prefill chunk short of the end */
        if (r->grammar_failed) {
            r->finish = SCHED_FINISH_ERROR;
            n_fin++;
            continue;
        }
        uint32_t tok = ex->picks[i];
        int rc = sched_req_push(r, tok);
        if (!rc && r->gm && grammar_matcher_accept(r->gm, tok, &r->err) != 0) {
            r->finish = SCHED_FINISH_ERROR;
            n_fin++;
            continue;
        }
        if (!rc && r->lp_on)
            rc = sched_req_push_lp(r, ex->lpstep + (size_t)i * LP_STRIDE);
        if (rc) {
            kvd_error_set(&r->err, rc, "out of memory for the sampled token");
            r->finish = SCHED_FINISH_ERROR;
            n_fin++;
            continue;
        }
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
        n_fin += r->finish != SCHED_FINISH_NONE;
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

/* Runs the plan's step; the backend samples every request whose chunk
 * reaches its last known token (the request's uniform for the step is drawn
 * here, so the draw sequence is the request's own whatever the batch). */
static int forward(struct exec *ex)
{
    struct sched_plan *p = &ex->plan;
    bool host = false, lp = false;
    for (uint32_t i = 0; i < p->n; i++) {
        struct sched_req *r = p->reqs[i];
        bool want = !r->restoring && r->n_kv + r->step_n == r->n_toks;
        ex->rows[i] = (struct sample_row){.skip = !want};
        host |= want && (sampler_on_host(&r->smp) || r->gm);
        lp |= want && r->lp_on;
        ex->fseqs[i] = (struct fwd_seq){
            .tokens = r->toks + r->n_kv,
            .n_tokens = r->step_n,
            .pos0 = (uint32_t)r->n_kv,
            .slots = p->slots + p->slot0[i],
            .n_slots = p->slot0[i + 1] - p->slot0[i],
        };
    }
    struct fwd_batch b = {
        .seqs = ex->fseqs,
        .n_seqs = p->n,
        .kv_arena = kvmm_device_arena(ex->mm),
        .geom = kvmm_geom(ex->mm),
        .n_arena_slots = ex->n_arena_slots,
        .sample = ex->rows,
        .tokens = ex->picks,
    };
    if (!host && !lp) {
        for (uint32_t i = 0; i < p->n; i++)
            if (!ex->rows[i].skip)
                sampler_next_row(&p->reqs[i]->smp, &ex->rows[i]);
        return model_forward(ex->m, ex->fc, &b);
    }
    /* Some row needs a host-only stage, or logprobs: the whole step's
     * logits come back (n_seqs * n_vocab * 4 bytes). With a host-only
     * stage every row is picked here, with the same pick as the backends'
     * sample op for the rows that need nothing more; for logprobs alone
     * the backend still picks. */
    uint32_t V = ex->hp->n_vocab;
    if (p->n > ex->cap_hlogits) {
        float *h = realloc(ex->hlogits, (size_t)p->n * V * sizeof *h);
        if (!h)
            return KVD_ENOMEM;
        ex->hlogits = h;
        ex->cap_hlogits = p->n;
    }
    if (host && !ex->counts && !(ex->counts = malloc((size_t)ex->hp->n_ctx * sizeof *ex->counts)))
        return KVD_ENOMEM;
    if (lp && !ex->lpstep &&
        !(ex->lpstep = malloc((size_t)ex->conf.max_seqs * LP_STRIDE * sizeof *ex->lpstep)))
        return KVD_ENOMEM;
    if (lp && host && !ex->lprow && !(ex->lprow = malloc((size_t)V * sizeof *ex->lprow)))
        return KVD_ENOMEM;
    b.logits = ex->hlogits;
    if (host) {
        b.sample = NULL;
    } else {
        for (uint32_t i = 0; i < p->n; i++)
            if (!ex->rows[i].skip)
                sampler_next_row(&p->reqs[i]->smp, &ex->rows[i]);
    }
    int rc = model_forward(ex->m, ex->fc, &b);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < p->n; i++) {
        struct sched_req *r = p->reqs[i];
        float *row = ex->hlogits + (size_t)i * V;
        if (ex->rows[i].skip) {
            ex->picks[i] = 0;
            continue;
        }
        /* the raw row, before the host pick adjusts it */
        const float *raw = row;
        if (host && r->lp_on) {
            memcpy(ex->lprow, row, (size_t)V * sizeof *row);
            raw = ex->lprow;
        }
        if (r->gm && grammar_mask(r, row, V)) {
            ex->picks[i] = 0;
            continue;
        }
        if (host && (rc = sampler_sample_host(&r->smp, &ex->hsc, r->toks, r->n_toks, row, V,
                                              ex->counts, &ex->picks[i])))
            return rc;
        if (r->lp_on)
            sampler_logprobs(raw, V, ex->picks[i], r->lp_top, ex->lpstep + (size_t)i * LP_STRIDE);
    }
    return 0;
}

/* One iteration. Returns false when there was nothing to compute. */
static bool step(struct exec *ex, struct sched_req *arrived, bool drain)
{
    struct sched_req *done = NULL;
    struct kvmm *mm = ex->mm;

    kvmm_lock(mm);
    while (arrived) {
        struct sched_req *r = arrived;
        arrived = r->next;
        r->next = r->prev = NULL;
        /* A prompt that failed to prepare, or was never prepared (the
         * request was cancelled first), ends here. */
        if (r->finish != SCHED_FINISH_NONE || r->prompt) {
            sched_reject(mm, r, &done);
            continue;
        }
        sched_add(ex->sched, mm, r);
        if (atomic_load(&r->cancel)) /* cancelled while it was prepared */
            sched_note_cancel(ex->sched);
    }
    if (drain)
        sched_drain(ex->sched, mm, &done);
    int rc = sched_plan(ex->sched, mm, &ex->plan, &done);
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

    uint64_t t_fwd = sched_now_ns();
    rc = forward(ex);
    if (rc == 0)
        roofline_record_fwd(ex->conf.roofline, ex->fseqs, ex->plan.n, sched_now_ns() - t_fwd);

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
    }
    kvmm_unlock(mm);

    uint32_t n_fin = sample_step(ex);
    uint64_t gen = 0;
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        gen += r->state != SCHED_DONE && !r->restoring && r->n_kv + 1 == r->n_toks;
    }
    if (n_fin) {
        kvmm_lock(mm);
        for (uint32_t i = 0; i < ex->plan.n; i++) {
            struct sched_req *r = ex->plan.reqs[i];
            if (r->state == SCHED_DONE || r->finish == SCHED_FINISH_NONE)
                continue;
            sched_finish(ex->sched, mm, r, r->finish);
            r->next = done;
            done = r;
        }
        kvmm_unlock(mm);
    }
    for (uint32_t i = 0; i < ex->plan.n; i++) {
        struct sched_req *r = ex->plan.reqs[i];
        if (r->state != SCHED_DONE)
            publish_tokens(ex, r);
    }
    pthread_mutex_lock(&ex->mu);
    ex->st.generated += gen;
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
    if (!ex)
        return kvd_error_set(err, KVD_ENOMEM, "%s", nomem);
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
    ex->hp = model_hparams(m);
    if (ex->conf.roofline) {
        struct roofline_shape rs;
        roofline_shape_from_model(ex->hp, kvmm_geom(mm), &rs);
        roofline_set_shape(ex->conf.roofline, &rs);
    }
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
    struct kvmm_stats kst;
    kvmm_lock(mm);
    kvmm_stats(mm, &kst);
    kvmm_unlock(mm);
    ex->n_arena_slots = kst.device_total;

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
    if ((rc = fwd_ctx_new(m, sc.step_tokens, sc.max_seqs, &ex->fc))) {
        kvd_error_set(err, rc, "cannot size the forward scratch for %u tokens / %u sequences",
                      sc.step_tokens, sc.max_seqs);
        goto fail;
    }
    ex->fseqs = calloc(sc.max_seqs, sizeof(*ex->fseqs));
    ex->rows = calloc(sc.max_seqs, sizeof(*ex->rows));
    ex->picks = calloc(sc.max_seqs, sizeof(*ex->picks));
    if (!ex->fseqs || !ex->rows || !ex->picks) {
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
    }
    sched_free(ex->sched);
    if (ex->fc)
        fwd_ctx_free(ex->fc);
    sched_plan_free(&ex->plan);
    free(ex->fseqs);
    free(ex->rows);
    free(ex->picks);
    free(ex->hlogits);
    free(ex->lpstep);
    free(ex->lprow);
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
    bool text = r->prompt != NULL, disk = !text && wants_disk(ex, r);
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
    live_add(ex, r);
    ex->n_live++;
    ex->st.requests++;
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
        live_remove(ex, r);
        ex->n_live--;
        ex->st.requests--;
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

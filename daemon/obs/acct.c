/* acct: per-tenant request counters and the latency histograms (see
 * acct.h). Inter-token latency is observed per request as its mean gap,
 * once per gap, so the histogram's count is the number of token gaps. */
#include "acct.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double acct_bucket_le[ACCT_N_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
};

const char *acct_hist_name(enum acct_hist_kind k)
{
    switch (k) {
    case ACCT_TTFT:
        return "ttft";
    case ACCT_ITL:
        return "itl";
    case ACCT_E2E:
        return "e2e";
    case ACCT_QUEUE:
        return "queue";
    case ACCT_N_HISTS:
        break;
    }
    return "?";
}

void acct_hist_observe(struct acct_hist *h, double seconds, uint64_t times)
{
    if (times == 0)
        return;
    if (!(seconds >= 0)) /* NaN or a clock that went backwards */
        seconds = 0;
    size_t i = 0;
    while (i < ACCT_N_BUCKETS && seconds > acct_bucket_le[i])
        i++;
    h->bucket[i] += times;
    h->count += times;
    h->sum += seconds * (double)times;
}

void acct_init(struct acct *a)
{
    memset(a, 0, sizeof(*a));
    pthread_mutex_init(&a->mu, NULL);
}

void acct_destroy(struct acct *a)
{
    free(a->t);
    a->t = NULL;
    a->n_t = 0;
    pthread_mutex_destroy(&a->mu);
}

/* The tenant's entry, growing the table; NULL when out of memory. Caller
 * holds mu. */
static struct acct_tenant *tenant_at(struct acct *a, uint32_t tenant)
{
    if (tenant >= a->n_t) {
        if (tenant >= (1u << 20)) /* kvmm ids are dense and small */
            return NULL;
        uint32_t n = a->n_t ? a->n_t : 8;
        while (n <= tenant)
            n *= 2;
        struct acct_tenant *t = realloc(a->t, (size_t)n * sizeof(*t));
        if (!t)
            return NULL;
        memset(t + a->n_t, 0, (size_t)(n - a->n_t) * sizeof(*t));
        a->t = t;
        a->n_t = n;
    }
    return &a->t[tenant];
}

static double secs(uint64_t from, uint64_t to)
{
    return to > from ? (double)(to - from) * 1e-9 : 0;
}

void acct_request_done(struct acct *a, const struct acct_req *r)
{
    pthread_mutex_lock(&a->mu);
    struct acct_tenant *t = tenant_at(a, r->tenant);
    double queue = r->t_sched ? secs(r->t_arrive, r->t_sched) : secs(r->t_arrive, r->t_done);
    if (t) {
        t->requests++;
        t->completed += r->outcome == ACCT_COMPLETED;
        t->cancelled += r->outcome == ACCT_CANCELLED;
        t->failed += r->outcome == ACCT_FAILED;
        t->tokens_in += r->prompt;
        t->tokens_cached += r->cached;
        t->tokens_out += r->completion;
        t->preemptions += r->preemptions;
        t->queue_seconds += queue;
        if (r->t_first) {
            t->ttft_seconds += secs(r->t_arrive, r->t_first);
            t->ttft_count++;
        }
    }
    acct_hist_observe(&a->hist[ACCT_QUEUE], queue, 1);
    if (r->t_first) {
        acct_hist_observe(&a->hist[ACCT_TTFT], secs(r->t_arrive, r->t_first), 1);
        if (r->completion > 1 && r->t_done > r->t_first)
            acct_hist_observe(&a->hist[ACCT_ITL],
                              secs(r->t_first, r->t_done) / (double)(r->completion - 1),
                              r->completion - 1);
    }
    if (r->outcome == ACCT_COMPLETED)
        acct_hist_observe(&a->hist[ACCT_E2E], secs(r->t_arrive, r->t_done), 1);
    pthread_mutex_unlock(&a->mu);
}

void acct_tenant_get(struct acct *a, uint32_t tenant, struct acct_tenant *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&a->mu);
    if (tenant < a->n_t)
        *out = a->t[tenant];
    pthread_mutex_unlock(&a->mu);
}

static void tenant_add_to(struct acct_tenant *out, const struct acct_tenant *t)
{
    out->requests += t->requests;
    out->completed += t->completed;
    out->cancelled += t->cancelled;
    out->failed += t->failed;
    out->tokens_in += t->tokens_in;
    out->tokens_cached += t->tokens_cached;
    out->tokens_out += t->tokens_out;
    out->preemptions += t->preemptions;
    out->queue_seconds += t->queue_seconds;
    out->ttft_seconds += t->ttft_seconds;
    out->ttft_count += t->ttft_count;
}

void acct_total(struct acct *a, struct acct_tenant *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&a->mu);
    *out = a->retired;
    for (uint32_t i = 0; i < a->n_t; i++)
        tenant_add_to(out, &a->t[i]);
    pthread_mutex_unlock(&a->mu);
}

void acct_tenant_retire(struct acct *a, uint32_t tenant)
{
    pthread_mutex_lock(&a->mu);
    if (tenant < a->n_t) {
        tenant_add_to(&a->retired, &a->t[tenant]);
        memset(&a->t[tenant], 0, sizeof(a->t[tenant]));
    }
    pthread_mutex_unlock(&a->mu);
}

void acct_hist_get(struct acct *a, enum acct_hist_kind k, struct acct_hist *out)
{
    memset(out, 0, sizeof(*out));
    if ((unsigned)k >= ACCT_N_HISTS)
        return;
    pthread_mutex_lock(&a->mu);
    *out = a->hist[k];
    pthread_mutex_unlock(&a->mu);
}

/* The cumulative counters of b added to a. */
static void sched_add_totals(struct acct_sched *a, const struct acct_sched *b)
{
    a->submitted += b->submitted;
    a->generated += b->generated;
    a->steps += b->steps;
    a->prefill_tokens += b->prefill_tokens;
    a->decode_tokens += b->decode_tokens;
    a->preempt_swap += b->preempt_swap;
    a->preempt_recompute += b->preempt_recompute;
    a->overlapped_steps += b->overlapped_steps;
    a->host_steps += b->host_steps;
    a->host_ns += b->host_ns;
    a->idle_steps += b->idle_steps;
    a->idle_ns += b->idle_ns;
    struct acct_spec *x = &a->spec;
    const struct acct_spec *y = &b->spec;
    x->verify_steps += y->verify_steps;
    x->verifies += y->verifies;
    x->drafted += y->drafted;
    x->accepted += y->accepted;
    x->spec_tokens += y->spec_tokens;
    x->verify_step_tokens += y->verify_step_tokens;
    x->verify_ns += y->verify_ns;
    x->decode_steps += y->decode_steps;
    x->decode_tokens += y->decode_tokens;
    x->decode_ns += y->decode_ns;
}

void acct_sched_get(struct acct *a, struct acct_sched *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&a->mu);
    out->have_executor = a->serving;
    /* speculation: the daemon's default kind and batch limit, whether a
     * loaded model has a draft, every executor's counters summed */
    snprintf(out->spec.mode, sizeof out->spec.mode, "%s", a->spec_mode);
    out->spec.max_batch = a->spec_max_batch;
    for (uint32_t i = 0; i < ACCT_SCHED_SLOTS; i++) {
        const struct acct_sched *s = &a->slot[i];
        sched_add_totals(out, &a->slot_retired[i]);
        sched_add_totals(out, s);
        out->waiting += s->waiting;
        out->running += s->running;
        out->swapped += s->swapped;
        out->live += s->live;
        out->have_executor |= s->have_executor;
        out->spec.draft_model |= s->spec.draft_model;
        /* not sums: the first executor's model that reports its layers */
        if (!out->layers && s->layers) {
            out->step_launches = s->step_launches;
            out->layers = s->layers;
        }
        if (!a->serving && s->have_executor && !out->spec.mode[0]) {
            memcpy(out->spec.mode, s->spec.mode, sizeof out->spec.mode);
            out->spec.max_batch = s->spec.max_batch;
        }
    }
    pthread_mutex_unlock(&a->mu);
}

void acct_sched_get_slot(struct acct *a, uint32_t slot, struct acct_sched *out)
{
    memset(out, 0, sizeof(*out));
    if (slot >= ACCT_SCHED_SLOTS)
        return;
    pthread_mutex_lock(&a->mu);
    *out = a->slot[slot];
    sched_add_totals(out, &a->slot_retired[slot]);
    pthread_mutex_unlock(&a->mu);
}

void acct_sched_set(struct acct *a, const struct acct_sched *s)
{
    acct_sched_set_slot(a, 0, s);
}

void acct_sched_set_slot(struct acct *a, uint32_t slot, const struct acct_sched *s)
{
    if (!a || slot >= ACCT_SCHED_SLOTS)
        return;
    pthread_mutex_lock(&a->mu);
    a->slot[slot] = *s;
    a->slot[slot].have_executor = true;
    pthread_mutex_unlock(&a->mu);
}

void acct_sched_retire(struct acct *a, uint32_t slot)
{
    if (!a || slot >= ACCT_SCHED_SLOTS)
        return;
    pthread_mutex_lock(&a->mu);
    sched_add_totals(&a->slot_retired[slot], &a->slot[slot]);
    memset(&a->slot[slot], 0, sizeof(a->slot[slot]));
    pthread_mutex_unlock(&a->mu);
}

void acct_sched_serving(struct acct *a, const char *spec_mode, uint32_t spec_max_batch)
{
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    a->serving = true;
    snprintf(a->spec_mode, sizeof a->spec_mode, "%s", spec_mode ? spec_mode : "off");
    a->spec_max_batch = spec_max_batch;
    pthread_mutex_unlock(&a->mu);
}

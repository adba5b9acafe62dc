/* acct: per-tenant request accounting the memory manager does not keep
 * (requests, tokens in/out, preemptions suffered, queue time) and the
 * daemon-wide latency histograms (TTFT, inter-token, end-to-end, queue).
 * Written by the executor when a request ends; read by stats and metrics. */
#ifndef KVD_ACCT_H
#define KVD_ACCT_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Upper bounds of the histogram buckets, in seconds (Prometheus "le"); a
 * last +Inf bucket is implied. */
#define ACCT_N_BUCKETS 16
extern const double acct_bucket_le[ACCT_N_BUCKETS];

struct acct_hist {
    uint64_t bucket[ACCT_N_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    uint64_t count;
    double sum; /* seconds */
};
void acct_hist_observe(struct acct_hist *h, double seconds, uint64_t times);

enum acct_hist_kind { ACCT_TTFT = 0, ACCT_ITL, ACCT_E2E, ACCT_QUEUE, ACCT_N_HISTS };
const char *acct_hist_name(enum acct_hist_kind k); /* "ttft", "itl", "e2e", "queue" */

struct acct_tenant {
    uint64_t requests; /* answered */
    uint64_t completed, cancelled, failed;
    uint64_t tokens_in;     /* prompt tokens, cached ones included */
    uint64_t tokens_cached; /* prompt tokens served from the prefix cache */
    uint64_t tokens_out;    /* generated tokens */
    uint64_t preemptions;   /* times its requests were preempted (swap or recompute) */
    double queue_seconds;   /* summed arrival → first scheduled */
    double ttft_seconds;    /* summed arrival → first token (requests with one) */
    uint64_t ttft_count;
};

/* One ended request, as the executor saw it. Times: CLOCK_MONOTONIC ns, 0
 * when it never got there. */
enum acct_outcome { ACCT_COMPLETED = 0, ACCT_CANCELLED, ACCT_FAILED };
struct acct_req {
    uint32_t tenant;
    enum acct_outcome outcome;
    uint64_t prompt, cached, completion;
    uint32_t preemptions;
    uint64_t t_arrive, t_sched, t_first, t_done;
};

/* Speculative decoding, as the executor counts it (exec.h exec_spec_stats). */
struct acct_spec {
    char mode[8];          /* the default: "off", "ngram", "draft" (the daemon's; a slot's: its
                            * model's) */
    bool draft_model;      /* a draft model is loaded (a slot's: its model has one) */
    uint32_t max_batch;    /* speculation runs while at most this many requests run */
    uint64_t verify_steps; /* steps that verified drafts */
    uint64_t verifies;     /* verifications (one request's drafts in one step) */
    uint64_t drafted;      /* draft tokens verified */
    uint64_t accepted;     /* of them, kept */
    uint64_t spec_tokens;  /* tokens the verifications produced */
    uint64_t verify_step_tokens, verify_ns; /* tokens and forward time of the verifying steps */
    uint64_t decode_steps, decode_tokens, decode_ns; /* plain decode-only steps */
};

/* The executor's queues and step counters, as of its last step. */
struct acct_sched {
    uint32_t waiting, running, swapped; /* requests in each queue */
    uint32_t live;                      /* submitted and not yet answered */
    uint64_t submitted, generated;      /* requests taken, tokens sampled */
    uint64_t steps, prefill_tokens, decode_tokens;
    uint64_t preempt_swap, preempt_recompute;
    struct acct_spec spec;
    uint32_t step_launches; /* kernel launches of the last decode step (0: none, or cpu) */
    uint32_t layers;        /* the model's layers (step_launches / layers: per layer) */
    /* Overlap (exec.h exec_overlap_stats): steps planned while the one
     * before ran; plain decode steps' host time and the device's wait. */
    uint64_t overlapped_steps;
    uint64_t host_steps, host_ns, idle_steps, idle_ns;
    bool have_executor; /* false in store mode: everything above is 0 */
};

/* Executors reporting at once (one per model: OPTIONS_MAX_MODELS). */
#define ACCT_SCHED_SLOTS 16

/* Thread-safe: one mutex, held for a few counter updates. */
struct acct {
    pthread_mutex_t mu;
    struct acct_tenant *t; /* (n_t) owned, indexed by kvmm tenant id */
    uint32_t n_t;
    struct acct_tenant retired; /* summed counters of removed tenants (acct_total) */
    struct acct_hist hist[ACCT_N_HISTS];
    /* One executor per loaded model, each in its slot (the model's index);
     * slot_retired: the counters of executors that stopped (a model unloaded),
     * so the sums never go back. */
    struct acct_sched slot[ACCT_SCHED_SLOTS];
    struct acct_sched slot_retired[ACCT_SCHED_SLOTS];
    bool serving;            /* acct_sched_serving */
    char spec_mode[8];       /* the daemon's --speculative (acct_sched_serving) */
    uint32_t spec_max_batch; /* --spec-max-batch */
};

void acct_init(struct acct *a);
void acct_destroy(struct acct *a);
/* Adds one ended request. Never fails: a tenant id the table cannot grow
 * to (out of memory) still counts in the histograms. */
void acct_request_done(struct acct *a, const struct acct_req *r);
/* The tenant's counters (zeros for a tenant with no request yet). */
void acct_tenant_get(struct acct *a, uint32_t tenant, struct acct_tenant *out);
/* Sum over every tenant, removed ones included. */
void acct_total(struct acct *a, struct acct_tenant *out);
/* A tenant id is being freed (kvmm_tenant_remove): its counters move into
 * the total's share of removed tenants and the id starts again at zero. */
void acct_tenant_retire(struct acct *a, uint32_t tenant);
void acct_hist_get(struct acct *a, enum acct_hist_kind k, struct acct_hist *out);

/* Every executor's counters together: queues of the running ones,
 * cumulative counters of all that ever ran. */
void acct_sched_get(struct acct *a, struct acct_sched *out);
/* One slot's (a model's executor; its cumulative counters include the
 * executors it had before). */
void acct_sched_get_slot(struct acct *a, uint32_t slot, struct acct_sched *out);

/* An executor's counters after each step (a NULL acct is a no-op). The
 * executor fills `s` from its scheduler (exec.c); have_executor is set.
 * acct_sched_set is slot 0's. */
void acct_sched_set(struct acct *a, const struct acct_sched *s);
void acct_sched_set_slot(struct acct *a, uint32_t slot, const struct acct_sched *s);
/* The slot's executor stopped: its cumulative counters stay counted, its
 * queues go to zero. */
void acct_sched_retire(struct acct *a, uint32_t slot);
/* The daemon serves models (have_executor even while none is loaded), its
 * speculation default ("off", "ngram", "draft") and batch limit. */
void acct_sched_serving(struct acct *a, const char *spec_mode, uint32_t spec_max_batch);

#endif

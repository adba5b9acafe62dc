/* Scheduler internals shared by scheduler.c (queues, tenants, lifecycle,
 * memory and preemption, commit) and scheduler_plan.c (building each step:
 * fair prefill shares, admission, the queue timeout). Not for other modules. */
#ifndef KVD_SCHED_IMPL_H
#define KVD_SCHED_IMPL_H

#include "scheduler.h"

/* A doubly-linked queue of requests; a request is in at most one. */
struct rq {
    struct sched_req *head, *tail;
    uint32_t n;
};

/* Per-tenant fairness state: virtual time = tokens computed / weight. The
 * tenant with the smallest virtual time gets the next admission. */
struct tenant_fair {
    uint32_t tenant;
    uint32_t weight;
    uint32_t n_reqs; /* requests queued anywhere */
    double vtime;
    bool blocked;    /* its next request could not be admitted this step */
    uint32_t n_wait; /* requests waiting (heap + the admitted-before queue) */
    /* Its never-admitted waiting requests, a binary heap by (priority
     * desc, arrival): the next to admit is heap[0]. */
    struct sched_req **heap;
    uint32_t n_heap, cap_heap;
    bool prefills;  /* has prefill work this step (running, swapped or waiting) */
    uint32_t share; /* prefill tokens it may still take this step (fair share) */
};

/* Queues. Every operation is O(1) or O(log n) in the number of waiting
 * requests (so a deep pipeline costs time linear in its length):
 * `waiting` holds never-admitted requests in arrival order (for the queue
 * timeout, walked from the head only while they are expired) and each
 * tenant's heap orders them for admission; `waiting_pre` holds requests
 * admitted before (preempted for recompute), which go first. A step walks
 * only running and swapped requests (bounded by memory), the tenants, and
 * the waiting queues only after a cancel (sched_note_cancel). */
struct sched {
    struct sched_conf conf;
    struct rq waiting, waiting_pre, running, swapped;
    atomic_bool cancel_note;
    struct tenant_fair *tf;
    size_t n_tf, cap_tf;
    struct sched_counters ctr;
    struct sched_req **snap; /* plan_running's snapshot of the running queue */
    uint32_t cap_snap;
};

enum grow_result { GROW_OK, GROW_SELF, GROW_ENDED, GROW_BLOCKED };

/* Moves r to the queue of state st (none for SCHED_NEW/SCHED_DONE). */
void sched_move_to(struct sched *s, struct sched_req *r, enum sched_state st);
struct tenant_fair *sched_tenant_find(struct sched *s, uint32_t tenant);
/* The tenant's next never-admitted waiting request to admit, or NULL. */
struct sched_req *sched_tenant_next(struct tenant_fair *t);
/* Ends r (releasing or returning its sequence) onto `done` (may be NULL). */
void sched_end_req(struct sched *s, struct kvmm *mm, struct sched_req *r, enum sched_finish f,
                   struct sched_req **done);
/* Ends r with an error; errmsg = fmt formatted with `what`. */
void sched_end_error(struct sched *s, struct kvmm *mm, struct sched_req *r, int err,
                     struct sched_req **done, const char *fmt, const char *what);
size_t sched_blocks_for(struct kvmm *mm, size_t tokens);
/* Where r's computation ends: n_toks, or n_orig while restoring. */
size_t sched_target(const struct sched_req *r);
/* 0, or KVD_ENOMEM / KVD_EQUOTA when `blocks` can never fit the pool / quota. */
int sched_never_fits(struct kvmm *mm, uint32_t tenant, size_t blocks);
/* Grows r by n slots after its planned ones (n_kv + step_n), writable on
 * the device; preempts lower requests only when may_preempt. */
enum grow_result sched_grow(struct sched *s, struct kvmm *mm, struct sched_req *r, size_t n,
                            bool may_preempt, bool *preempted, struct sched_req **done);

#endif

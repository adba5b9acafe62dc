/* workpool: a few worker threads for the work a request asks that the event
 * loop must not do itself (rendering a chat template, tokenizing a text,
 * detokenizing a long token list). Jobs are queued per tenant and taken in
 * turn, one tenant after another, so a tenant that sends many heavy jobs
 * delays another tenant's job by at most the jobs already running, never by
 * its whole backlog. A tenant holds at most max_per_tenant jobs (queued or
 * running); one more is refused busy.
 *
 * A job's function runs on a worker thread and is then done with: it
 * answers its requester itself (server_post, the executor's inbox). Jobs
 * still queued when the pool is freed run with `cancelled` set, so each
 * still answers. */
#ifndef KVD_WORKPOOL_H
#define KVD_WORKPOOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct workpool;

/* The job: ud is the submitter's; cancelled is true when the pool is being
 * freed (answer without doing the work). */
typedef void (*workpool_fn)(void *ud, bool cancelled);

struct workpool_conf {
    unsigned threads;        /* workers; 0: 2 */
    unsigned max_per_tenant; /* jobs a tenant may hold, queued or running; 0: 8 */
    /* Each worker runs this many nice levels below the process (0..19; at
     * most nice 19): background work that must leave the CPU to the
     * executor's compute threads when both want it. */
    unsigned nice;
    /* 0: off. Else the workers run SCHED_IDLE (they get a core only when no
     * other thread wants it) and a job that has run idle_after_ms gets its
     * worker raised back to SCHED_OTHER at `nice` until it ends, so a busy
     * CPU delays a job by about that much at most, never starves it. A worker
     * also runs at `nice` while it holds a lock other threads wait for
     * (workpool_hold_begin). Raising a thread back from SCHED_IDLE needs
     * RLIMIT_NICE >= 20 - its nice value, or CAP_SYS_NICE: workpool_new raises
     * the soft limit to the hard one and tries it on a thread of its own
     * first; without the right, the workers stay at `nice` and
     * workpool_conf shows idle_after_ms 0. */
    unsigned idle_after_ms;
};

/* 0, KVD_ENOMEM, or KVD_EINTERNAL (a thread could not be started). */
int workpool_new(const struct workpool_conf *conf, struct workpool **out);
/* Runs every queued job with cancelled = true, waits for the running ones,
 * joins the workers. NULL is a no-op. */
void workpool_free(struct workpool *wp);

/* Queues fn(ud) for tenant. 0; KVD_EBUSY when the tenant already holds
 * max_per_tenant jobs; KVD_ECANCELLED while the pool is being freed;
 * KVD_ENOMEM. On failure fn is never called. Any thread. */
int workpool_submit(struct workpool *wp, uint32_t tenant, workpool_fn fn, void *ud);

/* The calling thread is about to take (begin) or has released (end) a lock
 * that normal-priority threads wait for: a worker of a pool with
 * idle_after_ms runs at `nice` (SCHED_OTHER) between the two, so that no
 * thread waits for a lock held by a thread that gets no core. Nests; a no-op
 * on any other thread. */
void workpool_hold_begin(void);
void workpool_hold_end(void);
/* pthread_mutex_lock and unlock of such a lock, inside a hold. */
void workpool_mutex_lock(pthread_mutex_t *mu);
void workpool_mutex_unlock(pthread_mutex_t *mu);

struct workpool_stats {
    uint64_t submitted, refused_busy, done;
    uint64_t escalations; /* jobs whose worker was raised after idle_after_ms */
    uint32_t queued, running;
    bool stopping; /* workpool_free has begun */
};
void workpool_stats(struct workpool *wp, struct workpool_stats *st);
/* The configuration in force (defaults filled). */
const struct workpool_conf *workpool_conf(const struct workpool *wp);

#endif

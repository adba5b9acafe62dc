/* workpool (see workpool.h): one mutex, a FIFO of jobs per tenant, and a
 * ring of the tenants that have queued jobs; a free worker serves the
 * tenant at the head of the ring and moves it to the tail. A tenant's
 * entry exists only while it holds a job, so the table stays as small as
 * the work in flight however many tenants come and go. With idle_after_ms
 * the workers run SCHED_IDLE, and a watcher thread raises the worker of a
 * job that has run that long back to SCHED_OTHER (workpool.h). */
#include "workpool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "fault.h"
#include "kvd/status.h"

#define WP_BUCKETS 64u

struct wp_job {
    struct wp_job *next;
    workpool_fn fn;
    void *ud;
};

struct wp_tenant {
    struct wp_tenant *hnext;         /* hash chain */
    struct wp_tenant *rnext, *rprev; /* the ring of tenants with queued jobs */
    bool in_ring;
    uint32_t id;
    unsigned held;              /* queued + running */
    struct wp_job *head, *tail; /* queued */
};

struct workpool;

/* A worker: its thread, and under the pool's mu its job's start and what
 * raises it above SCHED_IDLE (idle_after_ms pools). */
struct wp_worker {
    struct workpool *wp;
    pthread_t thread;
    bool busy;      /* running a job since since_ns */
    bool escalated; /* the job ran past idle_after_ms */
    unsigned holds; /* workpool_hold_begin nesting */
    int policy;     /* the policy last set */
    uint64_t since_ns;
};

struct workpool {
    struct workpool_conf conf;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t watch; /* the watcher's (CLOCK_MONOTONIC) */
    struct wp_tenant *buckets[WP_BUCKETS];
    struct wp_tenant *ring; /* head: served next */
    bool stop;
    struct workpool_stats st;
    struct wp_worker *workers;
    unsigned n_threads;
    pthread_t watcher;
    bool watcher_started;
};

static _Thread_local struct wp_worker *tl_self; /* the calling worker, or NULL */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Under mu (idle_after_ms pools): w's thread runs SCHED_OTHER while its
 * job has run past the bound or it holds a lock, SCHED_IDLE otherwise. The
 * nice value stays as it is across both. A failure leaves it as it was. */
static void apply_policy(struct wp_worker *w)
{
    int want = w->escalated || w->holds ? SCHED_OTHER : SCHED_IDLE;
    if (want == w->policy)
        return;
    struct sched_param sp = {.sched_priority = 0};
    if (pthread_setschedparam(w->thread, want, &sp) == 0)
        w->policy = want;
}

void workpool_hold_begin(void)
{
    struct wp_worker *w = tl_self;
    if (!w || !w->wp->conf.idle_after_ms)
        return;
    pthread_mutex_lock(&w->wp->mu);
    w->holds++;
    apply_policy(w);
    pthread_mutex_unlock(&w->wp->mu);
}

void workpool_hold_end(void)
{
    struct wp_worker *w = tl_self;
    if (!w || !w->wp->conf.idle_after_ms)
        return;
    pthread_mutex_lock(&w->wp->mu);
    if (w->holds)
        w->holds--;
    apply_policy(w);
    pthread_mutex_unlock(&w->wp->mu);
}

void workpool_mutex_lock(pthread_mutex_t *mu)
{
    workpool_hold_begin();
    pthread_mutex_lock(mu);
}

void workpool_mutex_unlock(pthread_mutex_t *mu)
{
    pthread_mutex_unlock(mu);
    workpool_hold_end();
}

/* The watcher: sleeps until the earliest running job reaches idle_after_ms,
 * then raises its worker (once per job; the worker drops back to SCHED_IDLE
 * when the job ends). */
static void *watcher(void *arg)
{
    struct workpool *wp = arg;
    uint64_t bound = (uint64_t)wp->conf.idle_after_ms * 1000000ull;
    pthread_mutex_lock(&wp->mu);
    while (!wp->stop) {
        uint64_t now = now_ns(), next = UINT64_MAX;
        for (unsigned i = 0; i < wp->n_threads; i++) {
            struct wp_worker *w = &wp->workers[i];
            if (!w->busy || w->escalated)
                continue;
            if (now - w->since_ns >= bound) {
                w->escalated = true;
                apply_policy(w);
                wp->st.escalations++;
            } else if (w->since_ns + bound < next) {
                next = w->since_ns + bound;
            }
        }
        if (next == UINT64_MAX) {
            pthread_cond_wait(&wp->watch, &wp->mu);
        } else {
            struct timespec ts = {.tv_sec = (time_t)(next / 1000000000ull),
                                  .tv_nsec = (long)(next % 1000000000ull)};
            pthread_cond_timedwait(&wp->watch, &wp->mu, &ts);
        }
    }
    /* Stopping: the jobs still running finish at `nice`, with nobody left
     * to watch them. */
    for (unsigned i = 0; i < wp->n_threads; i++) {
        struct wp_worker *w = &wp->workers[i];
        if (w->busy && !w->escalated) {
            w->escalated = true;
            apply_policy(w);
        }
    }
    pthread_mutex_unlock(&wp->mu);
    return NULL;
}

static struct wp_tenant **tenant_slot(struct workpool *wp, uint32_t id)
{
    struct wp_tenant **p = &wp->buckets[(id * 2654435761u) % WP_BUCKETS];
    while (*p && (*p)->id != id)
        p = &(*p)->hnext;
    return p;
}

static void ring_push(struct workpool *wp, struct wp_tenant *t)
{
    if (!wp->ring) {
        t->rnext = t->rprev = t;
        wp->ring = t;
    } else { /* at the tail: just before the head */
        t->rnext = wp->ring;
        t->rprev = wp->ring->rprev;
        wp->ring->rprev->rnext = t;
        wp->ring->rprev = t;
    }
    t->in_ring = true;
}

static void ring_remove(struct workpool *wp, struct wp_tenant *t)
{
    if (t->rnext == t) {
        wp->ring = NULL;
    } else {
        t->rprev->rnext = t->rnext;
        t->rnext->rprev = t->rprev;
        if (wp->ring == t)
            wp->ring = t->rnext;
    }
    t->rnext = t->rprev = NULL;
    t->in_ring = false;
}

/* Under mu: the next job in turn, or NULL. */
static struct wp_job *take(struct workpool *wp, struct wp_tenant **owner)
{
    struct wp_tenant *t = wp->ring;
    if (!t)
        return NULL;
    struct wp_job *j = t->head;
    t->head = j->next;
    if (!t->head)
        t->tail = NULL;
    ring_remove(wp, t);
    if (t->head)
        ring_push(wp, t); /* its next job waits for every other tenant's turn */
    wp->st.queued--;
    wp->st.running++;
    *owner = t;
    return j;
}

/* Under mu: one of t's jobs has ended. */
static void release(struct workpool *wp, struct wp_tenant *t)
{
    if (--t->held > 0)
        return;
    struct wp_tenant **p = tenant_slot(wp, t->id);
    *p = t->hnext;
    free(t);
}

/* Lowers the calling thread's priority by nice levels (on Linux a nice
 * value is per thread: PRIO_PROCESS with the thread's id). Lowering needs
 * no privilege; a failure leaves the thread as it was. */
static void lower_priority(unsigned nice)
{
    if (nice == 0)
        return;
    errno = 0;
    int cur = getpriority(PRIO_PROCESS, 0);
    if (cur == -1 && errno)
        return;
    int want = cur + (int)nice > 19 ? 19 : cur + (int)nice;
    (void)setpriority(PRIO_PROCESS, (id_t)gettid(), want);
}

static void *worker(void *arg)
{
    struct wp_worker *self = arg;
    struct workpool *wp = self->wp;
    lower_priority(wp->conf.nice);
    tl_self = self;
    pthread_mutex_lock(&wp->mu);
    if (wp->conf.idle_after_ms)
        apply_policy(self); /* to SCHED_IDLE */
    for (;;) {
        struct wp_tenant *t = NULL;
        struct wp_job *j = take(wp, &t);
        if (!j) {
            if (wp->stop)
                break;
            pthread_cond_wait(&wp->wake, &wp->mu);
            continue;
        }
        bool cancelled = wp->stop;
        if (wp->conf.idle_after_ms) {
            self->busy = true;
            self->since_ns = now_ns();
            pthread_cond_signal(&wp->watch);
        }
        pthread_mutex_unlock(&wp->mu);
        j->fn(j->ud, cancelled);
        free(j);
        pthread_mutex_lock(&wp->mu);
        if (self->busy) {
            self->busy = self->escalated = false;
            apply_policy(self);
        }
        wp->st.running--;
        wp->st.done++;
        release(wp, t);
    }
    pthread_mutex_unlock(&wp->mu);
    return NULL;
}

static void *probe(void *arg)
{
    struct workpool *wp = arg;
    lower_priority(wp->conf.nice);
    struct sched_param sp = {.sched_priority = 0};
    bool ok = pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0 &&
              pthread_setschedparam(pthread_self(), SCHED_OTHER, &sp) == 0;
    return ok ? wp : NULL;
}

/* Whether a worker at conf.nice may go to SCHED_IDLE and back: tried on a
 * thread that ends right after (the soft RLIMIT_NICE raised to the hard
 * one first, which needs no privilege). */
static bool idle_allowed(struct workpool *wp)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NICE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NICE, &rl);
    }
    pthread_t t;
    void *res = NULL;
    if (pthread_create(&t, NULL, probe, wp) != 0)
        return false;
    pthread_join(t, &res);
    return res != NULL;
}

int workpool_new(const struct workpool_conf *conf, struct workpool **out)
{
    struct workpool *wp = calloc(1, sizeof(*wp));
    if (!wp)
        return KVD_ENOMEM;
    wp->conf = *conf;
    if (!wp->conf.threads)
        wp->conf.threads = 2;
    if (!wp->conf.max_per_tenant)
        wp->conf.max_per_tenant = 8;
    pthread_mutex_init(&wp->mu, NULL);
    pthread_cond_init(&wp->wake, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&wp->watch, &ca);
    pthread_condattr_destroy(&ca);
    if (wp->conf.idle_after_ms && !idle_allowed(wp))
        wp->conf.idle_after_ms = 0;
    wp->workers = calloc(wp->conf.threads, sizeof(*wp->workers));
    if (!wp->workers) {
        workpool_free(wp);
        return KVD_ENOMEM;
    }
    /* Created under mu: a worker's first apply_policy reads its thread id. */
    pthread_mutex_lock(&wp->mu);
    for (unsigned i = 0; i < wp->conf.threads; i++) {
        struct wp_worker *w = &wp->workers[i];
        *w = (struct wp_worker){.wp = wp, .policy = SCHED_OTHER};
        if (pthread_create(&w->thread, NULL, worker, w) != 0) {
            pthread_mutex_unlock(&wp->mu);
            workpool_free(wp);
            return KVD_EINTERNAL;
        }
        wp->n_threads++;
    }
    pthread_mutex_unlock(&wp->mu);
    if (wp->conf.idle_after_ms) {
        if (pthread_create(&wp->watcher, NULL, watcher, wp) != 0) {
            workpool_free(wp);
            return KVD_EINTERNAL;
        }
        wp->watcher_started = true;
    }
    *out = wp;
    return 0;
}

void workpool_free(struct workpool *wp)
{
    if (!wp)
        return;
    pthread_mutex_lock(&wp->mu);
    wp->stop = true;
    pthread_cond_broadcast(&wp->wake);
    pthread_cond_broadcast(&wp->watch);
    pthread_mutex_unlock(&wp->mu);
    if (wp->watcher_started)
        pthread_join(wp->watcher, NULL);
    for (unsigned i = 0; i < wp->n_threads; i++)
        pthread_join(wp->workers[i].thread, NULL);
    /* Without workers (none started) queued jobs still answer. */
    struct wp_tenant *t = NULL;
    struct wp_job *j;
    while ((j = take(wp, &t)) != NULL) {
        j->fn(j->ud, true);
        free(j);
        wp->st.running--;
        release(wp, t);
    }
    free(wp->workers);
    pthread_cond_destroy(&wp->wake);
    pthread_cond_destroy(&wp->watch);
    pthread_mutex_destroy(&wp->mu);
    free(wp);
}

int workpool_submit(struct workpool *wp, uint32_t tenant, workpool_fn fn, void *ud)
{
    struct wp_job *j = fault_malloc(sizeof(*j));
    if (!j)
        return KVD_ENOMEM;
    *j = (struct wp_job){.fn = fn, .ud = ud};
    pthread_mutex_lock(&wp->mu);
    int rc = 0;
    struct wp_tenant **slot = tenant_slot(wp, tenant);
    struct wp_tenant *t = *slot;
    if (wp->stop) {
        rc = KVD_ECANCELLED;
    } else if (t && t->held >= wp->conf.max_per_tenant) {
        rc = KVD_EBUSY;
        wp->st.refused_busy++;
    } else if (!t && !(t = calloc(1, sizeof(*t)))) {
        rc = KVD_ENOMEM;
    }
    if (rc) {
        pthread_mutex_unlock(&wp->mu);
        free(j);
        return rc;
    }
    if (!*slot) {
        t->id = tenant;
        *slot = t;
    }
    if (t->tail)
        t->tail->next = j;
    else
        t->head = j;
    t->tail = j;
    t->held++;
    if (!t->in_ring)
        ring_push(wp, t);
    wp->st.submitted++;
    wp->st.queued++;
    pthread_cond_signal(&wp->wake);
    pthread_mutex_unlock(&wp->mu);
    return 0;
}

void workpool_stats(struct workpool *wp, struct workpool_stats *st)
{
    pthread_mutex_lock(&wp->mu);
    *st = wp->st;
    st->stopping = wp->stop;
    pthread_mutex_unlock(&wp->mu);
}

const struct workpool_conf *workpool_conf(const struct workpool *wp)
{
    return &wp->conf;
}

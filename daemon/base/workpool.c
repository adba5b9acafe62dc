/* workpool (see workpool.h): one mutex, a FIFO of jobs per tenant, and a
 * ring of the tenants that have queued jobs; a free worker serves the
 * tenant at the head of the ring and moves it to the tail. A tenant's
 * entry exists only while it holds a job, so the table stays as small as
 * the work in flight however many tenants come and go. */
#include "workpool.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
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

struct workpool {
    struct workpool_conf conf;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    struct wp_tenant *buckets[WP_BUCKETS];
    struct wp_tenant *ring; /* head: served next */
    bool stop;
    struct workpool_stats st;
    pthread_t *threads;
    unsigned n_threads;
};

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
    struct workpool *wp = arg;
    lower_priority(wp->conf.nice);
    pthread_mutex_lock(&wp->mu);
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
        pthread_mutex_unlock(&wp->mu);
        j->fn(j->ud, cancelled);
        free(j);
        pthread_mutex_lock(&wp->mu);
        wp->st.running--;
        wp->st.done++;
        release(wp, t);
    }
    pthread_mutex_unlock(&wp->mu);
    return NULL;
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
    wp->threads = calloc(wp->conf.threads, sizeof(*wp->threads));
    if (!wp->threads) {
        workpool_free(wp);
        return KVD_ENOMEM;
    }
    for (unsigned i = 0; i < wp->conf.threads; i++) {
        if (pthread_create(&wp->threads[i], NULL, worker, wp) != 0) {
            workpool_free(wp);
            return KVD_EINTERNAL;
        }
        wp->n_threads++;
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
    pthread_mutex_unlock(&wp->mu);
    for (unsigned i = 0; i < wp->n_threads; i++)
        pthread_join(wp->threads[i], NULL);
    /* Without workers (none started) queued jobs still answer. */
    struct wp_tenant *t = NULL;
    struct wp_job *j;
    while ((j = take(wp, &t)) != NULL) {
        j->fn(j->ud, true);
        free(j);
        wp->st.running--;
        release(wp, t);
    }
    free(wp->threads);
    pthread_cond_destroy(&wp->wake);
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

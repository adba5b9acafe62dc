/* arbiter: turns on the device for the executors by the tenants' virtual
 * time across models (see arbiter.h). The waiters are few (one per loaded
 * model): a list scanned under the mutex, one broadcast per release. */
#include "arbiter.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

struct waiter {
    struct waiter *next;
    double key;
    uint64_t ticket; /* order of asking: breaks ties */
};

struct exec_arbiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool busy;              /* an executor holds the device */
    struct waiter *waiting; /* executors waiting for it */
    uint64_t next_ticket;
    double clock; /* the key of the last turn given */
    double *vt;   /* (n_vt) per tenant id */
    uint32_t n_vt;
    uint64_t turns;
};

int arbiter_new(struct exec_arbiter **out)
{
    struct exec_arbiter *a = calloc(1, sizeof(*a));
    if (!a)
        return KVD_ENOMEM;
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    *out = a;
    return 0;
}

void arbiter_free(struct exec_arbiter *a)
{
    if (!a)
        return;
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    free(a->vt);
    free(a);
}

/* Room for tenant t's virtual time (under mu); false without memory (the
 * tenant is then not tracked: it keeps key 0, served first). */
static bool vt_reserve(struct exec_arbiter *a, uint32_t t)
{
    if (t < a->n_vt)
        return true;
    uint32_t n = a->n_vt ? a->n_vt : 64;
    while (n <= t)
        n *= 2;
    double *v = realloc(a->vt, n * sizeof(*v));
    if (!v)
        return false;
    memset(v + a->n_vt, 0, (n - a->n_vt) * sizeof(*v));
    a->vt = v;
    a->n_vt = n;
    return true;
}

/* Whether w goes next: no waiter has a smaller key (or the same key and
 * an earlier ticket). */
static bool first(const struct exec_arbiter *a, const struct waiter *w)
{
    for (const struct waiter *o = a->waiting; o; o = o->next)
        if (o != w && (o->key < w->key || (o->key == w->key && o->ticket < w->ticket)))
            return false;
    return true;
}

void arbiter_acquire(struct exec_arbiter *a, const struct arbiter_share *s, size_t n)
{
    pthread_mutex_lock(&a->mu);
    double key = a->clock;
    bool have = false;
    for (size_t i = 0; i < n; i++) {
        if (!vt_reserve(a, s[i].tenant)) {
            key = 0;
            have = true;
            continue;
        }
        if (a->vt[s[i].tenant] < a->clock)
            a->vt[s[i].tenant] = a->clock; /* idle: no credit */
        if (!have || a->vt[s[i].tenant] < key)
            key = a->vt[s[i].tenant];
        have = true;
    }
    struct waiter w = {.key = key, .ticket = a->next_ticket++};
    if (a->busy || a->waiting) {
        w.next = a->waiting;
        a->waiting = &w;
        while (a->busy || !first(a, &w))
            pthread_cond_wait(&a->cv, &a->mu);
        struct waiter **p = &a->waiting;
        while (*p != &w)
            p = &(*p)->next;
        *p = w.next;
    }
    a->busy = true;
    if (key > a->clock)
        a->clock = key;
    a->turns++;
    pthread_mutex_unlock(&a->mu);
}

void arbiter_release(struct exec_arbiter *a, const struct arbiter_share *s, size_t n, uint64_t ns)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += s[i].tokens;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < n && total; i++)
        if (s[i].tenant < a->n_vt)
            a->vt[s[i].tenant] +=
                (double)ns * s[i].tokens / (double)total / (double)(s[i].weight ? s[i].weight : 1);
    a->busy = false;
    if (a->waiting)
        pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

double arbiter_vtime(struct exec_arbiter *a, uint32_t tenant)
{
    pthread_mutex_lock(&a->mu);
    double v = tenant < a->n_vt ? a->vt[tenant] : 0;
    pthread_mutex_unlock(&a->mu);
    return v;
}

uint64_t arbiter_turns(struct exec_arbiter *a)
{
    pthread_mutex_lock(&a->mu);
    uint64_t t = a->turns;
    pthread_mutex_unlock(&a->mu);
    return t;
}

unsigned arbiter_waiting(struct exec_arbiter *a)
{
    unsigned n = 0;
    pthread_mutex_lock(&a->mu);
    for (const struct waiter *w = a->waiting; w; w = w->next)
        n++;
    pthread_mutex_unlock(&a->mu);
    return n;
}

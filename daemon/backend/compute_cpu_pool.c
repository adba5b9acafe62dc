/* compute_cpu_pool: see compute_cpu_pool.h. */
#include "compute_cpu_pool.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

#define POOL_SPIN 20000 /* polls before sleeping: a few tens of microseconds */

static void pool_wait_job(struct cpu_pool *p, unsigned *seen)
{
    for (int i = 0; i < POOL_SPIN; i++) {
        if (atomic_load(&p->gen) != *seen || atomic_load(&p->stop))
            goto got;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    while (atomic_load(&p->gen) == *seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->cv, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
got:
    *seen = atomic_load(&p->gen);
}

struct pool_worker_arg {
    struct cpu_pool *p;
    uint32_t ith;
};

/* A worker joins the current job only while it is open, so the caller never
 * waits for a thread that was asleep or descheduled: it runs whatever work
 * is left itself (the jobs hand out chunks dynamically), closes the job and
 * waits only for workers already inside it. */
static void *pool_main(void *arg)
{
    struct pool_worker_arg a = *(struct pool_worker_arg *)arg;
    free(arg);
    unsigned seen = 0;
    for (;;) {
        pool_wait_job(a.p, &seen);
        if (atomic_load(&a.p->stop))
            break;
        atomic_fetch_add(&a.p->active, 1);
        if (atomic_load(&a.p->open))
            a.p->fn(a.p->arg, a.ith, a.p->n);
        atomic_fetch_sub(&a.p->active, 1);
    }
    return NULL;
}

void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg)
{
    if (p->n <= 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->open, true);
    atomic_fetch_add(&p->gen, 1); /* seq_cst: pairs with the sleepers check */
    if (atomic_load(&p->sleepers)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(arg, 0, p->n);
    atomic_store(&p->open, false);
    for (unsigned i = 0; atomic_load(&p->active); i++) {
        if (i < POOL_SPIN) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

void cpu_pool_stop(struct cpu_pool *p, uint32_t started)
{
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < started; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

int cpu_pool_start(struct cpu_pool *p, uint32_t n)
{
    memset(p, 0, sizeof *p);
    p->n = n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc(n, sizeof *p->threads);
    if (!p->threads)
        goto fail;
    for (uint32_t i = 1; i < n; i++) {
        struct pool_worker_arg *a = malloc(sizeof *a);
        if (!a || (a->p = p, a->ith = i, pthread_create(&p->threads[i - 1], NULL, pool_main, a))) {
            free(a);
            cpu_pool_stop(p, i - 1);
            return KVD_ENOMEM;
        }
    }
    return 0;
fail:
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    return KVD_ENOMEM;
}

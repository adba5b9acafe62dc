/* compute_cpu_pool: the cpu backend's persistent worker pool (compute_cpu*.c run
 * their ops on it). */
#ifndef KVD_CPU_POOL_H
#define KVD_CPU_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* A persistent pool: the caller is worker 0, n-1 threads wait for work.
 * cpu_pool_run runs fn(arg, ith, nth) on the caller and on every worker that
 * arrives while the caller is still working, and returns when all of those
 * are done; so fn must hand out its work dynamically (an atomic counter) and
 * be harmless to run after all work is taken. Workers spin briefly, then
 * sleep on a condition variable. */
typedef void (*cpu_task_fn)(void *arg, uint32_t ith, uint32_t nth);
struct cpu_pool {
    uint32_t n; /* workers including the caller */
    pthread_t *threads;
    atomic_uint gen;    /* bumped once per job */
    atomic_bool open;   /* workers may join the current job */
    atomic_uint active; /* workers (excluding the caller) inside the job */
    atomic_uint sleepers;
    atomic_bool stop;
    cpu_task_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

/* Starts n-1 worker threads (n >= 1, the caller being worker 0): 0 or
 * KVD_ENOMEM (nothing left running). cpu_pool_stop joins the first
 * `started` workers (n - 1 for a started pool) and frees the pool's
 * resources. */
int cpu_pool_start(struct cpu_pool *p, uint32_t n);
void cpu_pool_stop(struct cpu_pool *p, uint32_t started);
void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg);

#endif

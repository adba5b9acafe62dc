/* The text workers' pool (daemon/base/workpool.c): jobs run in turn across
 * tenants, a tenant's bound refuses busy, and freeing the pool still runs
 * every queued job (cancelled) so each requester hears back. One worker
 * and a gate make the order deterministic: the first job blocks until the
 * test has queued everything else. Workers run conf.nice levels below;
 * with conf.idle_after_ms they run SCHED_IDLE, a job running past the bound
 * gets its worker raised back to SCHED_OTHER, and a worker holding a lock
 * (workpool_hold_begin) runs SCHED_OTHER meanwhile. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/status.h"
#include "workpool.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool gate_open, gate_entered;
static int order[64], n_order, n_cancelled;

struct job {
    int tag;
    bool gate; /* wait for the gate before returning */
};

static void run(void *ud, bool cancelled)
{
    struct job *j = ud;
    pthread_mutex_lock(&mu);
    if (j->gate) {
        gate_entered = true;
        pthread_cond_broadcast(&cv);
        while (!gate_open)
            pthread_cond_wait(&cv, &mu);
    }
    order[n_order++] = j->tag;
    n_cancelled += cancelled;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void reset(void)
{
    gate_open = gate_entered = false;
    n_order = n_cancelled = 0;
}

/* Submits the gate job for tenant 9 and waits until the worker holds it. */
static void hold_worker(struct workpool *wp, struct job *gate)
{
    *gate = (struct job){.tag = 0, .gate = true};
    assert_int_equal(workpool_submit(wp, 9, run, gate), 0);
    pthread_mutex_lock(&mu);
    while (!gate_entered)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

static void wait_done(int n)
{
    pthread_mutex_lock(&mu);
    while (n_order < n)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

static void test_turns_across_tenants(void **state)
{
    (void)state;
    reset();
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .max_per_tenant = 16};
    assert_int_equal(workpool_new(&c, &wp), 0);
    struct job gate, a[4], b[2];
    hold_worker(wp, &gate);
    /* Tenant 1 queues four jobs, then tenant 2 two: 2's first job must not
     * wait for all of 1's. */
    for (int i = 0; i < 4; i++) {
        a[i] = (struct job){.tag = 10 + i};
        assert_int_equal(workpool_submit(wp, 1, run, &a[i]), 0);
    }
    for (int i = 0; i < 2; i++) {
        b[i] = (struct job){.tag = 20 + i};
        assert_int_equal(workpool_submit(wp, 2, run, &b[i]), 0);
    }
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    wait_done(7);
    static const int want[] = {0, 10, 20, 11, 21, 12, 13};
    assert_memory_equal(order, want, sizeof(want));
    assert_int_equal(n_cancelled, 0);
    struct workpool_stats st;
    do { /* a job counts as done once its function has returned */
        sched_yield();
        workpool_stats(wp, &st);
    } while (st.done < 7);
    assert_int_equal(st.submitted, 7);
    assert_int_equal(st.done, 7);
    assert_int_equal(st.queued, 0);
    workpool_free(wp);
}

static void test_tenant_bound(void **state)
{
    (void)state;
    reset();
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .max_per_tenant = 2};
    assert_int_equal(workpool_new(&c, &wp), 0);
    struct job gate, a[3], other;
    hold_worker(wp, &gate); /* tenant 9 holds one of its two */
    a[0] = (struct job){.tag = 1};
    a[1] = (struct job){.tag = 2};
    a[2] = (struct job){.tag = 3};
    assert_int_equal(workpool_submit(wp, 1, run, &a[0]), 0);
    assert_int_equal(workpool_submit(wp, 1, run, &a[1]), 0);
    /* A third job of tenant 1 is refused; another tenant is not held back. */
    assert_int_equal(workpool_submit(wp, 1, run, &a[2]), KVD_EBUSY);
    other = (struct job){.tag = 4};
    assert_int_equal(workpool_submit(wp, 2, run, &other), 0);
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    wait_done(4);
    /* Once its jobs are done the tenant may submit again. */
    assert_int_equal(workpool_submit(wp, 1, run, &a[2]), 0);
    wait_done(5);
    struct workpool_stats st;
    workpool_stats(wp, &st);
    assert_int_equal(st.refused_busy, 1);
    workpool_free(wp);
}

static void *free_pool(void *wp)
{
    workpool_free(wp);
    return NULL;
}

static void test_free_cancels_queued(void **state)
{
    (void)state;
    reset();
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .max_per_tenant = 8};
    assert_int_equal(workpool_new(&c, &wp), 0);
    struct job gate, a[3];
    hold_worker(wp, &gate);
    for (int i = 0; i < 3; i++) {
        a[i] = (struct job){.tag = 1 + i};
        assert_int_equal(workpool_submit(wp, 1, run, &a[i]), 0);
    }
    /* Free from another thread while the worker is held: the queued jobs
     * must run cancelled, none may be lost. */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, free_pool, wp), 0);
    /* Once the pool is being freed (its worker is still held, so the pool
     * lives on) the queued jobs must run cancelled. */
    struct workpool_stats st;
    do {
        sched_yield();
        workpool_stats(wp, &st);
    } while (!st.stopping);
    struct job probe = {.tag = 99};
    assert_int_equal(workpool_submit(wp, 3, run, &probe), KVD_ECANCELLED);
    pthread_mutex_lock(&mu);
    gate_open = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(t, NULL);
    assert_int_equal(n_order, 4);
    assert_int_equal(n_cancelled, 3);
}

/* A job that records its thread's nice value (per thread on Linux). */
static void note_nice(void *ud, bool cancelled)
{
    (void)cancelled;
    errno = 0;
    int v = getpriority(PRIO_PROCESS, (id_t)gettid());
    pthread_mutex_lock(&mu);
    *(int *)ud = errno ? -100 : v;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static int nice_of_worker(unsigned nice)
{
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .nice = nice};
    int got = -1000;
    assert_int_equal(workpool_new(&c, &wp), 0);
    assert_int_equal(workpool_submit(wp, 1, note_nice, &got), 0);
    pthread_mutex_lock(&mu);
    while (got == -1000)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    workpool_free(wp);
    return got;
}

/* conf.nice: the workers run that many levels below the creating thread
 * (at most 19), the creating thread itself is left as it was; 0 keeps the
 * workers at its level. */
static void test_nice(void **state)
{
    (void)state;
    int base = getpriority(PRIO_PROCESS, 0);
    assert_int_equal(nice_of_worker(0), base);
    assert_int_equal(nice_of_worker(3), base + 3 > 19 ? 19 : base + 3);
    assert_int_equal(nice_of_worker(19), 19);
    assert_int_equal(getpriority(PRIO_PROCESS, 0), base);
}

/* What a job saw of its worker's scheduling policy. */
struct policy_job {
    int at_start, raised, after_hold; /* sched_getscheduler(0) at each point; -2: not yet */
    bool hold;                        /* check hold_begin/end, not the escalation */
    bool done;
};

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void note_policy(void *ud, bool cancelled)
{
    (void)cancelled;
    struct policy_job *j = ud;
    j->at_start = sched_getscheduler(0);
    if (j->hold) {
        workpool_hold_begin();
        j->raised = sched_getscheduler(0);
        workpool_hold_end();
        j->after_hold = sched_getscheduler(0);
    } else {
        /* The watcher raises this worker once the job has run the bound:
         * looked at every millisecond, for a minute at most. */
        for (int i = 0; i < 60000 && sched_getscheduler(0) == SCHED_IDLE; i++)
            sleep_ms(1);
        j->raised = sched_getscheduler(0);
    }
    pthread_mutex_lock(&mu);
    j->done = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void run_policy_job(struct workpool *wp, struct policy_job *j)
{
    assert_int_equal(workpool_submit(wp, 1, note_policy, j), 0);
    pthread_mutex_lock(&mu);
    while (!j->done)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

/* idle_after_ms: a job starts on a SCHED_IDLE worker, which the pool raises
 * to SCHED_OTHER once the job has run the bound (counted in escalations),
 * and the next job starts at SCHED_IDLE again; the nice value holds
 * throughout. As root the pool must keep the bound; unprivileged without
 * RLIMIT_NICE it refuses it (workpool_conf shows 0) and the test skips. */
static void test_idle_escalates(void **state)
{
    (void)state;
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .nice = 3, .idle_after_ms = 20};
    assert_int_equal(workpool_new(&c, &wp), 0);
    if (geteuid() != 0 && workpool_conf(wp)->idle_after_ms == 0) {
        workpool_free(wp); /* no right to leave SCHED_IDLE here: the pool refused it */
        skip();
    }
    assert_int_equal(workpool_conf(wp)->idle_after_ms, 20);
    struct policy_job a = {.at_start = -2, .raised = -2}, b = a;
    run_policy_job(wp, &a);
    assert_int_equal(a.at_start, SCHED_IDLE);
    assert_int_equal(a.raised, SCHED_OTHER);
    run_policy_job(wp, &b);
    assert_int_equal(b.at_start, SCHED_IDLE);
    assert_int_equal(b.raised, SCHED_OTHER);
    struct workpool_stats st;
    workpool_stats(wp, &st);
    assert_int_equal(st.escalations, 2);
    workpool_free(wp);
    int base = getpriority(PRIO_PROCESS, 0);
    assert_int_equal(nice_of_worker(3), base + 3 > 19 ? 19 : base + 3);
    assert_int_equal(sched_getscheduler(0), SCHED_OTHER); /* the caller is left as it was */
}

/* A worker holding a lock runs SCHED_OTHER, and SCHED_IDLE again after;
 * without idle_after_ms the workers are never SCHED_IDLE and holds change
 * nothing; on a thread that is no worker they are no-ops. */
static void test_hold_raises(void **state)
{
    (void)state;
    struct workpool *wp;
    struct workpool_conf c = {.threads = 1, .idle_after_ms = 60000};
    assert_int_equal(workpool_new(&c, &wp), 0);
    if (geteuid() != 0 && workpool_conf(wp)->idle_after_ms == 0) {
        workpool_free(wp);
        skip();
    }
    struct policy_job a = {.hold = true, .at_start = -2, .raised = -2, .after_hold = -2};
    run_policy_job(wp, &a);
    workpool_free(wp);
    assert_int_equal(a.at_start, SCHED_IDLE);
    assert_int_equal(a.raised, SCHED_OTHER);
    assert_int_equal(a.after_hold, SCHED_IDLE);

    struct workpool_conf off = {.threads = 1};
    assert_int_equal(workpool_new(&off, &wp), 0);
    struct policy_job b = {.hold = true, .at_start = -2, .raised = -2, .after_hold = -2};
    run_policy_job(wp, &b);
    workpool_free(wp);
    assert_int_equal(b.at_start, SCHED_OTHER);
    assert_int_equal(b.raised, SCHED_OTHER);
    assert_int_equal(b.after_hold, SCHED_OTHER);

    workpool_hold_begin();
    assert_int_equal(sched_getscheduler(0), SCHED_OTHER);
    workpool_hold_end();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_turns_across_tenants), cmocka_unit_test(test_tenant_bound),
        cmocka_unit_test(test_free_cancels_queued),  cmocka_unit_test(test_nice),
        cmocka_unit_test(test_idle_escalates),       cmocka_unit_test(test_hold_raises),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* kvmm_warm: the warm reserve's thread. It keeps up to warm_max spare pages
 * per tier whose memory was written once (pool_warm_begin/end), so that a
 * restore or a new block copies into touched memory instead of paying the
 * first touch of a fresh page inside the copy (docs/persistence.md "Warm
 * pages"). The thread runs SCHED_IDLE where it may return from it (at nice
 * 19 otherwise), and at nice 19 SCHED_OTHER while it holds the kvmm lock;
 * it sleeps until the pool takes a page or keeps a spare. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include "kvmm_impl.h"
#include "log.h"

#define WARM_NICE 19

struct mm_warm {
    struct kvmm *mm;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* the thread waits here for a kick or stop */
    pthread_cond_t idle_c; /* kvmm_warm_settle waits here */
    bool kick, idle;       /* under mu */
    atomic_bool stop;
    bool can_idle; /* SCHED_IDLE and back are allowed (RLIMIT_NICE, or root) */
    atomic_uint_fast64_t warmed;
};

/* The pool's wake-up (pool.warm_kick), kvmm lock held: mu is a leaf lock. */
static void warm_kick(void *ctx)
{
    struct mm_warm *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->kick = true;
    w->idle = false;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
}

/* SCHED_IDLE outside the lock, SCHED_OTHER (at nice 19) inside it: a thread
 * that gets no core must never hold a lock the executor waits for. */
static void warm_policy(struct mm_warm *w, bool idle)
{
    if (!w->can_idle)
        return;
    struct sched_param sp = {.sched_priority = 0};
    if (pthread_setschedparam(pthread_self(), idle ? SCHED_IDLE : SCHED_OTHER, &sp) != 0 && !idle) {
        /* cannot come back: stay where SCHED_OTHER left us from now on */
        w->can_idle = false;
    }
}

static void warm_lock(struct mm_warm *w)
{
    warm_policy(w, false);
    kvmm_lock(w->mm);
}

static void warm_unlock(struct mm_warm *w)
{
    kvmm_unlock(w->mm);
    warm_policy(w, true);
}

/* Writes one byte of every OS page of [p, p + bytes): the memory's first
 * touch from user space, which a prefault alone does not pay everywhere
 * (a virtual machine's shadow page tables fill on it). A fault per page,
 * not one MADV_POPULATE_WRITE: that holds the process's mmap lock for the
 * whole page, and a SCHED_IDLE thread kept from a core while it holds it
 * would stall every thread that maps a page (a restore, the executor)
 * meanwhile; a fault holds only its own VMA's lock, for one page. The
 * bytes are nobody's: a spare's content is whatever a new block finds. */
static void warm_touch(void *p, size_t bytes)
{
    static size_t os_page;
    if (!os_page) {
        long ps = sysconf(_SC_PAGESIZE);
        os_page = ps > 0 ? (size_t)ps : 4096;
    }
    volatile unsigned char *c = p;
    for (size_t off = 0; off < bytes; off += os_page)
        c[off] = 0;
}

/* Warms pages until every tier's reserve is full or nothing can be taken. */
static void warm_fill(struct mm_warm *w)
{
    struct kvmm *mm = w->mm;
    for (int t = 0; t < POOL_TIERS; t++)
        while (!atomic_load(&w->stop)) {
            void *start;
            size_t bytes;
            warm_lock(w);
            uint32_t pg = pool_warm_begin(&mm->pool, (enum kvd_tier)t, &start, &bytes);
            warm_unlock(w);
            if (pg == POOL_NONE)
                break;
            warm_touch(start, bytes);
            warm_lock(w);
            pool_warm_end(&mm->pool, (enum kvd_tier)t, pg);
            warm_unlock(w);
            atomic_fetch_add(&w->warmed, 1);
        }
}

static void *warm_main(void *arg)
{
    struct mm_warm *w = arg;
    /* nice 19 for this thread (Linux: a thread's own nice value) */
    (void)setpriority(PRIO_PROCESS, (id_t)gettid(), WARM_NICE);
    warm_policy(w, true);
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->kick && !atomic_load(&w->stop)) {
            w->idle = true;
            pthread_cond_broadcast(&w->idle_c);
            pthread_cond_wait(&w->wake, &w->mu);
        }
        if (atomic_load(&w->stop))
            break;
        w->kick = false;
        pthread_mutex_unlock(&w->mu);
        warm_fill(w);
        pthread_mutex_lock(&w->mu);
    }
    w->idle = true;
    pthread_cond_broadcast(&w->idle_c);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Whether this thread may go back from SCHED_IDLE to SCHED_OTHER at nice 19:
 * RLIMIT_NICE (its soft limit raised to the hard one, which needs no
 * privilege) of at least 20 - 19, or root (CAP_SYS_NICE). */
static bool idle_allowed(void)
{
    struct rlimit rl;
    if (geteuid() == 0)
        return true;
    if (getrlimit(RLIMIT_NICE, &rl) != 0)
        return false;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NICE, &rl);
    }
    return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= 20 - WARM_NICE;
}

int mm_warm_start(struct kvmm *mm, uint64_t bytes)
{
    struct pool *p = &mm->pool;
    uint32_t any = 0;
    /* Only memory whose first touch the backend says costs (a prefault
     * op: the cpu backend's memfd pages; the cuda backend pins its host
     * pages, which populates them, when it maps them). */
    if (!bytes || !mm->be->ops->prefault)
        return 0;
    for (int t = 0; t < POOL_TIERS; t++) {
        if (!p->page_bytes[t])
            continue;
        uint64_t pages = (bytes + p->page_bytes[t] - 1) / p->page_bytes[t];
        pool_set_warm(p, (enum kvd_tier)t, pages > p->n_pages[t] ? p->n_pages[t] : (uint32_t)pages);
        any |= p->warm_max[t];
    }
    if (!any)
        return 0;
    struct mm_warm *w = calloc(1, sizeof *w);
    if (!w)
        return KVD_ENOMEM;
    w->mm = mm;
    w->kick = true; /* fill at start */
    w->can_idle = idle_allowed();
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->wake, NULL);
    pthread_cond_init(&w->idle_c, NULL);
    atomic_init(&w->stop, false);
    atomic_init(&w->warmed, 0);
    kvmm_lock(mm);
    p->warm_kick = warm_kick;
    p->warm_ctx = w;
    mm->warm = w;
    kvmm_unlock(mm);
    if (pthread_create(&w->thread, NULL, warm_main, w) != 0) {
        kvmm_lock(mm);
        p->warm_kick = NULL;
        p->warm_ctx = NULL;
        mm->warm = NULL;
        for (int t = 0; t < POOL_TIERS; t++)
            pool_set_warm(p, (enum kvd_tier)t, 0);
        kvmm_unlock(mm);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->wake);
        pthread_cond_destroy(&w->idle_c);
        free(w);
        return KVD_EINTERNAL;
    }
    (void)pthread_setname_np(w->thread, "kvd-warm");
    return 0;
}

void mm_warm_stop(struct kvmm *mm)
{
    struct mm_warm *w = mm->warm;
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    atomic_store(&w->stop, true);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    kvmm_lock(mm);
    mm->pool.warm_kick = NULL;
    mm->pool.warm_ctx = NULL;
    mm->warm = NULL;
    kvmm_unlock(mm);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->wake);
    pthread_cond_destroy(&w->idle_c);
    free(w);
}

void kvmm_warm_settle(struct kvmm *mm)
{
    struct mm_warm *w = mm->warm;
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    while (w->kick || !w->idle)
        pthread_cond_wait(&w->idle_c, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

bool kvmm_warm_on(const struct kvmm *mm)
{
    return mm->warm != NULL;
}

uint64_t kvmm_warm_pages_warmed(struct kvmm *mm)
{
    return mm->warm ? atomic_load(&mm->warm->warmed) : 0;
}

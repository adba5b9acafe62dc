/* Unit tests of kvpages_reclaim and kvpages_reclaim_own when two threads
 * ask the members at once (a model's load and another model's executor, or
 * two executors): each call asks each member at most once, whatever the
 * other call does meanwhile, so a reclaim that cannot be met ends. The
 * interleaving is forced with a turnstile (condition variable), no sleeps. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "backend.h"
#include "pages.h"

#define N_MEMBERS 2
#define N_CALLERS 2
/* Past this many callbacks the turnstile stops forcing turns, so that a
 * reclaim that would ask forever still ends and the test fails instead of
 * hanging. */
#define CALL_CAP 64

/* The turnstile: a member's callback, called by caller k, waits until it
 * is k's turn (or the other caller has returned), then hands the turn on.
 * So the two calls alternate callback by callback. */
struct turns {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int turn;
    bool done[N_CALLERS];
    int calls;                              /* callbacks, all members */
    int asked[N_CALLERS][N_MEMBERS];        /* callbacks by caller and member */
    struct kvpages_member m[N_MEMBERS + 1]; /* the last one: the callers' own pool */
};

static _Thread_local int g_caller = -1;

static uint32_t give_nothing(struct turns *tt, void *ctx)
{
    int mi = (int)(intptr_t)ctx;
    pthread_mutex_lock(&tt->mu);
    tt->calls++;
    tt->asked[g_caller][mi]++;
    int other = 1 - g_caller;
    while (tt->calls < CALL_CAP && tt->turn != g_caller && !tt->done[other])
        pthread_cond_wait(&tt->cv, &tt->mu);
    tt->turn = other;
    pthread_cond_broadcast(&tt->cv);
    pthread_mutex_unlock(&tt->mu);
    return 0; /* every page is in use: nothing to give back */
}

static struct turns *g_tt;

static uint32_t reclaim_cb(void *ctx, enum kvd_tier t, uint32_t tenant, uint32_t n)
{
    (void)t, (void)tenant, (void)n;
    return give_nothing(g_tt, ctx);
}

struct caller {
    struct kvpages *pg;
    struct turns *tt;
    int k;
    bool own;
    uint32_t tenant;
};

static void *caller_main(void *arg)
{
    struct caller *c = arg;
    g_caller = c->k;
    /* the last member is the callers' pool: never asked by them */
    if (c->own)
        (void)kvpages_reclaim_own(c->pg, &c->tt->m[N_MEMBERS], KVD_TIER_DEVICE, c->tenant, 4);
    else
        (void)kvpages_reclaim(c->pg, &c->tt->m[N_MEMBERS], KVD_TIER_DEVICE, KVPAGES_NONE, 4);
    pthread_mutex_lock(&c->tt->mu);
    c->tt->done[c->k] = true;
    pthread_cond_broadcast(&c->tt->cv);
    pthread_mutex_unlock(&c->tt->mu);
    return NULL;
}

/* Two reclaims at once over members that give nothing back: each asks
 * each other member once and returns. */
static void two_reclaims(bool own)
{
    struct backend *be = NULL;
    struct kvpages *pg = NULL;
    struct kvpages_conf pc = {.bytes = {8u << 20, 0}, .page_bytes = {1u << 20, 0}};
    assert_int_equal(backend_cpu_new(&be), 0);
    assert_int_equal(kvpages_new(be, &pc, &pg, NULL), 0);
    uint32_t tenant;
    assert_int_equal(kvpages_tenant_ref(pg, "x", &tenant), 0);
    /* every page taken, the tenant's: nothing is free */
    assert_int_equal(kvpages_take(pg, KVD_TIER_DEVICE, tenant, 8, false), 0);

    struct turns *tt = calloc(1, sizeof *tt);
    assert_non_null(tt);
    pthread_mutex_init(&tt->mu, NULL);
    pthread_cond_init(&tt->cv, NULL);
    g_tt = tt;
    for (int i = 0; i <= N_MEMBERS; i++) {
        tt->m[i] = (struct kvpages_member){.ctx = (void *)(intptr_t)i};
        if (own)
            tt->m[i].reclaim_own = reclaim_cb;
        else
            tt->m[i].reclaim = reclaim_cb;
        kvpages_attach(pg, &tt->m[i]);
    }

    pthread_t th[N_CALLERS];
    struct caller c[N_CALLERS];
    for (int k = 0; k < N_CALLERS; k++) {
        c[k] = (struct caller){.pg = pg, .tt = tt, .k = k, .own = own, .tenant = tenant};
        assert_int_equal(pthread_create(&th[k], NULL, caller_main, &c[k]), 0);
    }
    for (int k = 0; k < N_CALLERS; k++)
        pthread_join(th[k], NULL);

    /* each call asked each member but its own once: no more */
    assert_int_equal(tt->calls, N_CALLERS * N_MEMBERS);
    for (int k = 0; k < N_CALLERS; k++)
        for (int i = 0; i < N_MEMBERS; i++)
            assert_int_equal(tt->asked[k][i], 1);
    assert_int_equal(kvpages_free_pages(pg, KVD_TIER_DEVICE), 0);

    for (int i = 0; i <= N_MEMBERS; i++)
        kvpages_detach(pg, &tt->m[i]);
    pthread_cond_destroy(&tt->cv);
    pthread_mutex_destroy(&tt->mu);
    free(tt);
    g_tt = NULL;
    kvpages_give(pg, KVD_TIER_DEVICE, tenant, 8);
    kvpages_tenant_unref(pg, tenant);
    kvpages_free(pg);
    backend_free(be);
}

static void test_two_reclaims_at_once_end(void **state)
{
    (void)state;
    two_reclaims(false);
}

static void test_two_reclaims_own_at_once_end(void **state)
{
    (void)state;
    two_reclaims(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_reclaims_at_once_end),
        cmocka_unit_test(test_two_reclaims_own_at_once_end),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

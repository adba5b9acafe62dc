/* The memory manager's side of several models: a device arena given back
 * (cached blocks moved to the host tier, none left on the device, nothing
 * allocatable there) and taken again, where the prefix matches again with
 * its bytes intact; a detach refused while a sequence is open; a model's
 * fingerprint set at its first load and a changed one dropping the cache;
 * tenants placed at the ids another kvmm gave them; handles carrying their
 * kvmm's tag. And the arbiter's turns across executors. kvmm_check after
 * every step. */
#include "mm_fixture.h"

#include <pthread.h>
#include <time.h>

#include "arbiter.h"
#include "kvmm_impl.h"

#define OWNER 1

static kvmm_seq_t committed(struct fx *f, uint32_t tenant, const uint32_t *tok, size_t n)
{
    uint32_t ns;
    kvmm_seq_t s;
    size_t shared;
    uint64_t keys[64];
    unsigned char buf[64 * 512];
    assert_true(n <= 64 && n * f->tb <= sizeof buf);
    for (size_t i = 0; i < n; i++)
        keys[i] = tok[i] + 1000;
    assert_int_equal(kvmm_tenant_namespace(f->mm, tenant, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, tenant, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, n), 0);
    fx_fill(f, buf, keys, n);
    assert_int_equal(kvmm_seq_write(f->mm, OWNER, s, 0, n, buf, n * f->tb), 0);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, tok, n, &shared), 0);
    fx_check(f);
    return s;
}

static void test_detach_attach(void **state)
{
    struct fx *f = *state;
    uint32_t tok[12], t, ns;
    size_t moved, dropped, matched;
    struct kvmm_stats st;
    for (int i = 0; i < 12; i++)
        tok[i] = (uint32_t)(40 + i);
    fx_open(f, 8, 8);
    struct kvmm_tenant_conf c = fx_tenant("a");
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &t), 0);
    kvmm_seq_t s = committed(f, t, tok, 12);
    /* an open sequence keeps the arena */
    assert_int_equal(kvmm_device_detach(f->mm, &moved, &dropped), KVD_EBUSY);
    assert_true(kvmm_device_attached(f->mm));
    fx_check(f);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_device_detach(f->mm, &moved, &dropped), 0);
    fx_check(f);
    assert_false(kvmm_device_attached(f->mm));
    assert_int_equal(moved, 3); /* the 3 whole blocks, to the host tier */
    assert_int_equal(dropped, 0);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_total, 0);
    assert_int_equal(st.host_cached, 3);
    assert_null(kvmm_device_arena(f->mm));
    /* nothing is allocated on a given-back arena */
    assert_int_equal(kvmm_tenant_namespace(f->mm, t, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 1), KVD_ENOMEM);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_device_detach(f->mm, &moved, &dropped), 0); /* a no-op */
    assert_int_equal(moved, 0);
    /* taken again: the prefix matches from the host tier, its bytes intact */
    assert_int_equal(kvmm_device_attach(f->mm), 0);
    assert_int_equal(kvmm_device_attach(f->mm), 0); /* a no-op */
    fx_check(f);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_total, 8);
    assert_int_equal(st.device_free, 8);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, ns, &s), 0);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s, tok, 12, &matched), 0);
    assert_int_equal(matched, 12);
    unsigned char buf[12 * 512];
    uint64_t keys[12];
    for (int i = 0; i < 12; i++)
        keys[i] = tok[i] + 1000;
    assert_int_equal(kvmm_seq_read(f->mm, OWNER, s, 0, 12, buf, 12 * f->tb), 0);
    assert_int_equal(fx_diff(f, buf, keys, 12), 12);
    fx_check(f);
    fx_close(f);
}

/* A host tier too small for every cached device block: the rest drop, as
 * eviction drops them; the arena still goes. */
static void test_detach_small_host(void **state)
{
    struct fx *f = *state;
    uint32_t tok[24], t;
    size_t moved, dropped;
    for (int i = 0; i < 24; i++)
        tok[i] = (uint32_t)(7 * i + 1);
    fx_open(f, 8, 2);
    struct kvmm_tenant_conf c = fx_tenant("a");
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &t), 0);
    kvmm_seq_t s = committed(f, t, tok, 24);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_device_detach(f->mm, &moved, &dropped), 0);
    fx_check(f);
    assert_int_equal(moved + dropped >= 6, true);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    assert_true(st.host_cached <= 2);
    assert_int_equal(st.device_total, 0);
    fx_close(f);
}

/* A kvmm made with its arena detached, as a model that is not loaded. */
static void test_created_detached(void **state)
{
    struct fx *f = *state;
    struct kvmm_config cfg = {.geom = fx_geom(),
                              .n_device_blocks = 4,
                              .n_host_blocks = 4,
                              .device_detached = true,
                              .handle_tag = 3};
    assert_int_equal(backend_cpu_new(&f->be), 0);
    cfg.be = f->be;
    assert_int_equal(kvmm_new(&cfg, &f->mm), 0);
    kvmm_lock(f->mm);
    f->locked = true;
    f->tb = kv_token_bytes(kvmm_geom(f->mm));
    assert_false(kvmm_device_attached(f->mm));
    assert_int_equal(kvmm_device_bytes(f->mm), 4 * kvmm_block_bytes(f->mm));
    fx_check(f);
    uint32_t t, ns;
    struct kvmm_tenant_conf c = fx_tenant("a");
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &t), 0);
    assert_int_equal(kvmm_tenant_namespace(f->mm, t, &ns), 0);
    kvmm_seq_t s;
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, ns, &s), 0);
    /* its handles carry its tag; another tag, or bit 63, is not found */
    assert_int_equal(s >> 56, 3);
    struct kvmm_seq_info in;
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s & ~(UINT64_C(0x7f) << 56), &in), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s | (UINT64_C(1) << 63), &in), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_device_attach(f->mm), 0);
    fx_check(f);
    fx_close(f);
}

static void test_fingerprint(void **state)
{
    struct fx *f = *state;
    uint32_t tok[8], t;
    size_t cleared, matched;
    uint8_t fp1[16], fp2[16];
    memset(fp1, 1, sizeof fp1);
    memset(fp2, 2, sizeof fp2);
    for (int i = 0; i < 8; i++)
        tok[i] = (uint32_t)(3 + i);
    fx_open(f, 8, 8);
    struct kvmm_tenant_conf c = fx_tenant("a");
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &t), 0);
    kvmm_set_fingerprint(f->mm, fp1, &cleared); /* the first load: nothing cached yet */
    assert_int_equal(cleared, 0);
    kvmm_seq_t s = committed(f, t, tok, 8);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    kvmm_set_fingerprint(f->mm, fp1, &cleared); /* the same file reloaded */
    assert_int_equal(cleared, 0);
    uint32_t ns;
    assert_int_equal(kvmm_tenant_namespace(f->mm, t, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, ns, &s), 0);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s, tok, 8, &matched), 0);
    assert_int_equal(matched, 8);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    kvmm_set_fingerprint(f->mm, fp2, &cleared); /* another file: its cache goes */
    assert_int_equal(cleared, 2);
    fx_check(f);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, t, ns, &s), 0);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s, tok, 8, &matched), 0);
    assert_int_equal(matched, 0);
    fx_close(f);
}

static void test_tenant_set_at(void **state)
{
    struct fx *f = *state;
    uint32_t id;
    fx_open(f, 8, 8);
    struct kvmm_tenant_conf a = fx_tenant("a"), b = fx_tenant("b"), c = fx_tenant("c");
    assert_int_equal(kvmm_tenant_set_at(f->mm, &b, 3), 0); /* 0..2 become free slots */
    fx_check(f);
    assert_int_equal(kvmm_tenant_find(f->mm, "b", &id), 0);
    assert_int_equal(id, 3);
    assert_int_equal(kvmm_tenant_set_at(f->mm, &a, 1), 0);
    assert_int_equal(kvmm_tenant_set_at(f->mm, &c, 3), KVD_EBUSY); /* b's */
    assert_int_equal(kvmm_tenant_set_at(f->mm, &a, 2), KVD_EBUSY); /* a is at 1 */
    b.weight = 5;
    assert_int_equal(kvmm_tenant_set_at(f->mm, &b, 3), 0); /* an update */
    assert_int_equal(kvmm_tenant_weight(f->mm, 3), 5);
    assert_int_equal(kvmm_tenant_weight(f->mm, 2), 1); /* no tenant there */
    /* the table's own choice takes a free slot, never a placed one */
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &id), 0);
    assert_true(id == 0 || id == 2);
    fx_check(f);
    /* a tenant of each id can open sequences and remove as usual */
    uint32_t ns;
    kvmm_seq_t s;
    assert_int_equal(kvmm_tenant_namespace(f->mm, 3, &ns), 0);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, 3, ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 5), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_tenant_remove(f->mm, 1), 0);
    assert_int_equal(kvmm_tenant_set_at(f->mm, &a, 1), 0);
    fx_check(f);
    fx_close(f);
}

/* ---- the arbiter ---------------------------------------------------------- */

struct turn_arg {
    struct exec_arbiter *a;
    struct arbiter_share s;
    pthread_mutex_t *mu;
    int *order, *n;
};

static void *turn_thread(void *p)
{
    struct turn_arg *t = p;
    arbiter_acquire(t->a, &t->s, 1);
    pthread_mutex_lock(t->mu);
    t->order[(*t->n)++] = (int)t->s.tenant;
    pthread_mutex_unlock(t->mu);
    arbiter_release(t->a, &t->s, 1, 1000);
    return NULL;
}

/* While the device is held, three executors ask; freed, it goes to the
 * one whose tenant is furthest behind, then the next. */
static void test_arbiter_order(void **state)
{
    (void)state;
    struct exec_arbiter *a;
    assert_int_equal(arbiter_new(&a), 0);
    /* tenant 1 has had 4000 ns of weight 1; tenant 2 2000 of weight 1;
     * tenant 3 4000 of weight 4 (1000) */
    struct arbiter_share s1 = {1, 10, 1}, s2 = {2, 10, 1}, s3 = {3, 10, 4}, s0 = {0, 1, 1};
    arbiter_acquire(a, &s1, 1);
    arbiter_release(a, &s1, 1, 4000);
    arbiter_acquire(a, &s2, 1);
    arbiter_release(a, &s2, 1, 2000);
    arbiter_acquire(a, &s3, 1);
    arbiter_release(a, &s3, 1, 4000);
    assert_true(arbiter_vtime(a, 1) == 4000);
    assert_true(arbiter_vtime(a, 2) == 2000);
    assert_true(arbiter_vtime(a, 3) == 1000);
    arbiter_acquire(a, &s0, 1); /* hold the device */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    int order[3], n = 0;
    struct turn_arg t[3] = {
        {a, s1, &mu, order, &n}, {a, s2, &mu, order, &n}, {a, s3, &mu, order, &n}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(pthread_create(&th[i], NULL, turn_thread, &t[i]), 0);
    /* all three waiting (the turns given so far do not move until then) */
    for (int i = 0; i < 10000 && arbiter_waiting(a) < 3; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(arbiter_waiting(a), 3);
    arbiter_release(a, &s0, 1, 0);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(n, 3);
    assert_int_equal(order[0], 3);
    assert_int_equal(order[1], 2);
    assert_int_equal(order[2], 1);
    /* a share's time is split by its tokens: 3 of 4 tokens are tenant 5's */
    struct arbiter_share two[2] = {{5, 3, 1}, {6, 1, 1}};
    double v5 = arbiter_vtime(a, 5), v6 = arbiter_vtime(a, 6);
    arbiter_acquire(a, two, 2);
    v5 = arbiter_vtime(a, 5), v6 = arbiter_vtime(a, 6); /* raised to the clock */
    arbiter_release(a, two, 2, 400);
    assert_true(arbiter_vtime(a, 5) - v5 == 300);
    assert_true(arbiter_vtime(a, 6) - v6 == 100);
    assert_true(arbiter_turns(a) >= 8);
    arbiter_free(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_detach_attach, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_detach_small_host, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_created_detached, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_fingerprint, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_tenant_set_at, fx_setup, fx_teardown),
        cmocka_unit_test(test_arbiter_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

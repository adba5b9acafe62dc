/* Unit tests of the warm reserve (kvmm_warm.c, pool_warm_begin/end): the
 * warmer fills each tier's reserve up to its bound and no further, pages
 * taken from it count as hits (a restore from the disk tier included), the
 * accounting holds with the reserve full and with every page in use (the
 * warmer then finds nothing and a restore still works, evicting as before),
 * and warm-bytes 0 turns it off. Real kvmm on a page budget, cpu backend
 * (memfd pages), a real disk tier in a temporary directory. The warmer is
 * waited for with kvmm_warm_settle (it says when it has nothing left to do),
 * never slept for; kvmm_check runs after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvmm.h"
#include "kvmm_impl.h"
#include "pages.h"

#define OWNER 1
#define PAGE (32u << 10) /* the budget's page: 8 blocks of 4 KiB */
#define BT 4u            /* tokens a block: 4 KiB blocks (1 KiB a token) */
#define CHAIN 64u        /* tokens of a chain: 16 blocks, 2 pages */

struct wfx {
    struct backend *be;
    struct kvpages *pg;
    struct kvmm *mm;
    uint32_t tenant, ns;
    char dir[64];
};

static struct kvmm_stats stats(struct kvmm *mm)
{
    struct kvmm_stats st;
    kvmm_lock(mm);
    kvmm_stats(mm, &st);
    kvmm_unlock(mm);
    return st;
}

static void check(struct kvmm *mm)
{
    kvmm_lock(mm);
    int rc = kvmm_check(mm);
    if (rc)
        fail_msg("kvmm_check: %s", kvmm_errmsg(mm));
    kvmm_unlock(mm);
}

/* A budget of n_dev and n_host pages of PAGE bytes, one kvmm on it with a
 * warm reserve of warm_pages pages per tier, a tenant and its namespace;
 * with disk, a disk tier of 1024 slots. */
static void open_fx(struct wfx *f, uint32_t n_dev, uint32_t n_host, uint32_t warm_pages, bool disk)
{
    struct kvpages_conf pc = {.bytes = {(uint64_t)n_dev * PAGE, (uint64_t)n_host * PAGE},
                              .page_bytes = {PAGE, PAGE}};
    assert_int_equal(backend_cpu_new(&f->be), 0);
    assert_int_equal(kvpages_new(f->be, &pc, &f->pg, NULL), 0);
    struct kvmm_config c = {
        .geom = {.layers = 2, .kv_heads = 2, .head_dim = 64, .dtype = KV_F16, .block_tokens = BT},
        .pages = f->pg,
        .be = f->be,
        .warm_bytes = (uint64_t)warm_pages * PAGE};
    assert_int_equal(kvmm_new(&c, &f->mm), 0);
    assert_int_equal(kvmm_block_bytes(f->mm), 4096);
    struct kvmm_tenant_conf tc;
    memset(&tc, 0, sizeof tc);
    snprintf(tc.name, sizeof tc.name, "t");
    tc.max_device_blocks = tc.max_host_blocks = tc.max_seqs = KVMM_UNLIMITED;
    tc.weight = 1;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_tenant_set(f->mm, &tc, &f->tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(f->mm, f->tenant, &f->ns), 0);
    kvmm_unlock(f->mm);
    if (disk) {
        snprintf(f->dir, sizeof f->dir, "/var/tmp/kvd-warm.XXXXXX");
        assert_non_null(mkdtemp(f->dir));
        struct kvmm_disk_conf dc = {
            .dir = f->dir, .max_bytes = 4096 + 1024 * 8192ull, .writeback_ms = 60000};
        struct kvd_error e = {0};
        if (kvmm_disk_open(f->mm, &dc, &e))
            fail_msg("kvmm_disk_open: %s", e.message);
    }
    check(f->mm);
}

static int setup(void **state)
{
    *state = calloc(1, sizeof(struct wfx));
    return *state ? 0 : -1;
}

static int teardown(void **state)
{
    struct wfx *f = *state;
    kvmm_free(f->mm);
    kvpages_free(f->pg);
    if (f->be)
        backend_free(f->be);
    if (f->dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
        if (system(cmd) != 0)
            return -1;
    }
    free(f);
    return 0;
}

static void chain_of(uint32_t c, uint32_t *t)
{
    for (uint32_t i = 0; i < CHAIN; i++)
        t[i] = c * 1000 + i + 1;
}

/* Chain c computed and committed by a sequence that then closes (its
 * blocks stay cached); rc of the extend. */
static int request(struct wfx *f, uint32_t c)
{
    uint32_t t[CHAIN];
    chain_of(c, t);
    kvmm_seq_t s;
    size_t shared;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, f->tenant, f->ns, &s), 0);
    int rc = kvmm_seq_extend(f->mm, OWNER, s, CHAIN);
    if (rc == 0)
        assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, t, CHAIN, &shared), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    kvmm_unlock(f->mm);
    check(f->mm);
    return rc;
}

/* Writes everything to disk, then drops every cached block from memory. */
static void to_disk_only(struct wfx *f)
{
    size_t written, left, n;
    assert_int_equal(kvmm_disk_flush(f->mm, 10000, &written, &left), 0);
    assert_int_equal(left, 0);
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_DEVICE, 1000, &n), 0);
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_HOST, 1000, &n), 0);
    assert_int_equal(kvmm_check(f->mm), 0);
    kvmm_unlock(f->mm);
}

static size_t restore(struct wfx *f, uint32_t c)
{
    uint32_t t[CHAIN];
    chain_of(c, t);
    size_t n = kvmm_disk_prefetch(f->mm, f->tenant, f->ns, t, CHAIN);
    check(f->mm);
    return n;
}

static uint64_t hits(const struct kvmm_stats *st)
{
    return st->warm_hits[KVD_TIER_DEVICE] + st->warm_hits[KVD_TIER_HOST];
}

/* The warmer fills each tier's reserve to its bound (3 pages), every warm
 * page a spare of nobody's; a page taken from it is a hit and is made up
 * for; an emptied page kept as a spare beyond the bound is not warmed. */
static void test_fills_to_bound(void **state)
{
    struct wfx *f = *state;
    open_fx(f, 64, 64, 3, false);
    assert_true(kvmm_warm_on(f->mm));
    kvmm_warm_settle(f->mm);
    check(f->mm);
    struct kvmm_stats st = stats(f->mm);
    for (int t = 0; t < 2; t++) {
        assert_int_equal(st.warm_max[t], 3);
        assert_int_equal(st.pages_warm[t], 3);
        assert_int_equal(st.pages_spare[t], 3);
        assert_int_equal(st.pages_held[t], 3);
        assert_int_equal(st.warm_hits[t], 0);
    }
    assert_int_equal(kvmm_warm_pages_warmed(f->mm), 6);
    struct kvpages_stats ps;
    kvpages_stats(f->pg, &ps);
    assert_int_equal(ps.used[KVD_TIER_DEVICE], 3); /* taken from the budget, nobody's */
    assert_int_equal(kvpages_tenant_pages(f->pg, KVD_TIER_DEVICE, 0), 0);

    /* 16 blocks: two pages, both from the reserve */
    assert_int_equal(request(f, 1), 0);
    st = stats(f->mm);
    assert_int_equal(st.warm_hits[KVD_TIER_DEVICE], 2);
    assert_int_equal(st.warm_misses[KVD_TIER_DEVICE], 0);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    st = stats(f->mm);
    assert_int_equal(st.pages_warm[KVD_TIER_DEVICE], 3); /* made up for */
    assert_int_equal(st.pages_held[KVD_TIER_DEVICE], 5);
    assert_int_equal(kvmm_warm_pages_warmed(f->mm), 8);

    /* The chain moves to the host tier: two host pages from its reserve,
     * made up for; the device pages empty and stay as cold spares (up to
     * spare_max + the bound), not warmed: the reserve is full. */
    size_t n;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_DEVICE, 1000, &n), 0);
    kvmm_unlock(f->mm);
    st = stats(f->mm);
    assert_int_equal(st.warm_hits[KVD_TIER_HOST], 2);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    assert_int_equal(kvmm_warm_pages_warmed(f->mm), 10);
    /* and dropped from the host: the same there */
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_HOST, 1000, &n), 0);
    kvmm_unlock(f->mm);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    st = stats(f->mm);
    for (int t = 0; t < 2; t++) {
        assert_int_equal(st.pages_warm[t], 3);
        assert_true(st.pages_spare[t] > 3 && st.pages_spare[t] <= 3 + 1);
    }
    assert_int_equal(kvmm_warm_pages_warmed(f->mm), 10);
}

/* A restore from the disk tier lands in warm pages: hits, no misses, and
 * the reserve is made up for afterwards. */
static void test_restore_takes_warm(void **state)
{
    struct wfx *f = *state;
    open_fx(f, 64, 64, 2, true);
    assert_int_equal(request(f, 1), 0);
    to_disk_only(f);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    struct kvmm_stats before = stats(f->mm);
    assert_int_equal(before.pages_warm[KVD_TIER_DEVICE], 2);
    assert_int_equal(restore(f, 1), CHAIN / BT);
    struct kvmm_stats after = stats(f->mm);
    /* 16 blocks restored: two pages, both warm */
    assert_int_equal(hits(&after) - hits(&before), 2);
    assert_int_equal(after.warm_misses[KVD_TIER_DEVICE] + after.warm_misses[KVD_TIER_HOST],
                     before.warm_misses[KVD_TIER_DEVICE] + before.warm_misses[KVD_TIER_HOST]);
    struct kvmm_disk_stats ds;
    kvmm_disk_stats(f->mm, &ds);
    assert_int_equal(ds.restore_fails, 0);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    after = stats(f->mm);
    assert_int_equal(after.pages_warm[KVD_TIER_DEVICE], 2);
}

/* Every page in use: the warmer finds none to take and stops (settle
 * returns: no deadlock), the accounting holds, an allocation past the
 * budget fails as before, and a restore still works by evicting cached
 * blocks into cold pages. */
static void test_exhaustion(void **state)
{
    struct wfx *f = *state;
    /* 32 device pages, no host pages: 256 blocks, 16 chains */
    open_fx(f, 32, 0, 2, true);
    kvmm_warm_settle(f->mm);
    assert_int_equal(stats(f->mm).pages_warm[KVD_TIER_DEVICE], 2);
    assert_int_equal(request(f, 1), 0);
    to_disk_only(f);
    /* every page holds cached blocks now (the warmer settled after each
     * request: a page it holds while a request needs one would make that
     * request evict, which this test is not about) */
    for (uint32_t c = 2; c < 18; c++) {
        assert_int_equal(request(f, c), 0);
        kvmm_warm_settle(f->mm);
    }
    check(f->mm);
    struct kvmm_stats st = stats(f->mm);
    assert_int_equal(st.pages_warm[KVD_TIER_DEVICE], 0);
    assert_int_equal(st.pages_held[KVD_TIER_DEVICE], 32);
    assert_int_equal(st.pages_spare[KVD_TIER_DEVICE], 0);
    assert_int_equal(st.pages_free[KVD_TIER_DEVICE], 0);

    /* A sequence holding every block: the next block has no room at all. */
    kvmm_seq_t s;
    kvmm_lock(f->mm);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, f->tenant, f->ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 256 * BT), 0);
    assert_int_not_equal(kvmm_seq_extend(f->mm, OWNER, s, BT), 0);
    assert_int_equal(kvmm_check(f->mm), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    kvmm_unlock(f->mm);
    kvmm_warm_settle(f->mm);
    check(f->mm);

    /* The pool is again full of cached blocks; chain 1 comes back from
     * disk by evicting them, the reserve empty or not. */
    for (uint32_t c = 2; c < 18; c++) {
        assert_int_equal(request(f, c), 0);
        kvmm_warm_settle(f->mm);
    }
    assert_int_equal(stats(f->mm).pages_warm[KVD_TIER_DEVICE], 0);
    assert_int_equal(restore(f, 1), CHAIN / BT);
    kvmm_warm_settle(f->mm);
    check(f->mm);
}

/* warm-bytes 0: no thread, nothing warmed, nothing counted. */
static void test_off(void **state)
{
    struct wfx *f = *state;
    open_fx(f, 64, 64, 0, false);
    assert_false(kvmm_warm_on(f->mm));
    kvmm_warm_settle(f->mm);
    assert_int_equal(request(f, 1), 0);
    kvmm_warm_settle(f->mm);
    check(f->mm);
    struct kvmm_stats st = stats(f->mm);
    for (int t = 0; t < 2; t++) {
        assert_int_equal(st.warm_max[t], 0);
        assert_int_equal(st.pages_warm[t], 0);
        assert_int_equal(st.warm_hits[t], 0);
        assert_int_equal(st.warm_misses[t], 0);
    }
    assert_int_equal(st.pages_held[KVD_TIER_DEVICE], 2);
    assert_int_equal(kvmm_warm_pages_warmed(f->mm), 0);
}

/* The page the warmer is writing belongs to no list (not a spare, not
 * free): the stats count it free, so free + cached + used stays the tier's
 * total while it writes. Deterministic: the test holds the kvmm lock from
 * before the page is picked to after the stats, so the warmer waits; the
 * checks come after the unlock (a failed check inside would leave the lock
 * held and the teardown waiting for the warmer). */
static void test_stats_while_warming(void **state)
{
    struct wfx *f = *state;
    open_fx(f, 64, 64, 3, false);
    kvmm_warm_settle(f->mm); /* the reserve is full: the warmer sleeps */
    assert_int_equal(request(f, 1), 0);
    kvmm_warm_settle(f->mm);
    struct kvmm_stats st0 = stats(f->mm);
    assert_int_equal(st0.device_free + st0.device_cached + st0.device_used, st0.device_total);

    kvmm_lock(f->mm);
    struct pool *p = &f->mm->pool;
    pool_set_warm(p, KVD_TIER_DEVICE, 4); /* room for one more warm page */
    void *start;
    size_t bytes;
    uint32_t pg = pool_warm_begin(p, KVD_TIER_DEVICE, &start, &bytes);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    if (pg != POOL_NONE)
        pool_warm_end(p, KVD_TIER_DEVICE, pg);
    pool_set_warm(p, KVD_TIER_DEVICE, 3);
    kvmm_unlock(f->mm);
    assert_int_not_equal(pg, POOL_NONE);
    assert_int_equal(st.device_free + st.device_cached + st.device_used, st.device_total);
    assert_int_equal(st.device_free, st0.device_free);
    assert_int_equal(st.pages_free[KVD_TIER_DEVICE], st0.pages_free[KVD_TIER_DEVICE]);

    kvmm_warm_settle(f->mm);
    check(f->mm);
    st = stats(f->mm);
    assert_int_equal(st.device_free + st.device_cached + st.device_used, st.device_total);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fills_to_bound, setup, teardown),
        cmocka_unit_test_setup_teardown(test_restore_takes_warm, setup, teardown),
        cmocka_unit_test_setup_teardown(test_exhaustion, setup, teardown),
        cmocka_unit_test_setup_teardown(test_off, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stats_while_warming, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

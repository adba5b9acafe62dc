/* The memory manager with a disk tier that is smaller than what it caches (kvmm_disk.c,
 * disktier.c): a block that stays hot in memory while the disk turns over keeps a way back
 * to disk (its copy there, evicted meanwhile, is written again when memory drops it), and a
 * block dropped from memory counts as used on disk (touched to the front) so the disk evicts
 * colder ones first; the DISK events leave the set of blocks the tier holds. Real kvmm, cpu
 * backend, a real tier in a temporary directory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "kvmm.h"

#define BT 16u
#define SLOT (4096u + 4096u) /* a 512-byte block's slot: header page + data page */

static char dir[64];

struct env {
    struct backend *be;
    struct kvmm *mm;
    uint32_t tenant, ns;
};

/* The blocks the DISK events say are on disk (a set of published hashes). */
#define EV_MAX 64
struct disk_view {
    uint64_t h[EV_MAX];
    size_t n;
};

static void on_block(void *ctx, const struct kvmm_block_event *ev)
{
    struct disk_view *dv = ctx;
    if (ev->medium != KVMM_MEDIUM_DISK)
        return;
    size_t i = 0;
    while (i < dv->n && dv->h[i] != ev->hash)
        i++;
    if (ev->stored && i == dv->n) {
        assert_true(dv->n < EV_MAX);
        dv->h[dv->n++] = ev->hash;
    } else if (!ev->stored) {
        if (i == dv->n)
            fail_msg("DISK BlockRemoved of a block never stored");
        dv->h[i] = dv->h[--dv->n];
    }
}

static void on_cleared(void *ctx)
{
    (void)ctx;
}

static int dir_new(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/var/tmp/kvd-kd.XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int dir_rm(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* 64 device blocks of 512 bytes, no host tier; a disk tier of `slots` slots; with dv, KV
 * events on and their DISK ones kept in dv. */
static void env_open_ev(struct env *v, uint32_t slots, struct disk_view *dv)
{
    struct kvmm_config cfg = {
        .geom = {.layers = 1, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = BT},
        .n_device_blocks = 64};
    assert_int_equal(backend_cpu_new(&v->be), 0);
    cfg.be = v->be;
    assert_int_equal(kvmm_new(&cfg, &v->mm), 0);
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1,
                                  .events = dv ? KVMM_EVENTS_ON : KVMM_EVENTS_OFF};
    snprintf(tc.name, sizeof tc.name, "t");
    struct kvmm_events_sink sink = {.ctx = dv, .block = on_block, .cleared = on_cleared};
    kvmm_lock(v->mm);
    if (dv)
        kvmm_events_attach(v->mm, &sink, 1);
    assert_int_equal(kvmm_tenant_set(v->mm, &tc, &v->tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(v->mm, v->tenant, &v->ns), 0);
    kvmm_unlock(v->mm);
    struct kvmm_disk_conf dc = {
        .dir = dir, .max_bytes = 4096 + (uint64_t)slots * SLOT, .writeback_ms = 60000};
    struct kvd_error e = {0};
    if (kvmm_disk_open(v->mm, &dc, &e))
        fail_msg("kvmm_disk_open: %s", e.message);
}

static void env_open(struct env *v, uint32_t slots)
{
    env_open_ev(v, slots, NULL);
}

static void env_close(struct env *v)
{
    kvmm_free(v->mm);
    backend_free(v->be);
}

/* Chain c: 2 blocks of its own token ids. */
static void chain_of(uint32_t c, uint32_t *t)
{
    for (uint32_t i = 0; i < 2 * BT; i++)
        t[i] = c * 1000 + i + 1;
}

/* A request for chain c: matched, the rest computed and committed, closed (cached). Returns
 * the tokens it found cached. */
static size_t request(struct env *v, uint32_t c)
{
    uint32_t t[2 * BT];
    chain_of(c, t);
    kvmm_seq_t s;
    size_t matched, shared;
    kvmm_lock(v->mm);
    assert_int_equal(kvmm_seq_open(v->mm, 1, v->tenant, v->ns, &s), 0);
    assert_int_equal(kvmm_seq_match(v->mm, 1, s, t, 2 * BT, &matched), 0);
    assert_int_equal(kvmm_seq_extend(v->mm, 1, s, 2 * BT - matched), 0);
    assert_int_equal(kvmm_seq_commit(v->mm, 1, s, t + matched, 2 * BT - matched, &shared), 0);
    assert_int_equal(kvmm_seq_close(v->mm, 1, s), 0);
    kvmm_unlock(v->mm);
    return matched;
}

static void flush(struct env *v)
{
    size_t written, left;
    assert_int_equal(kvmm_disk_flush(v->mm, 10000, &written, &left), 0);
    assert_int_equal(left, 0);
}

static void evict_all(struct env *v)
{
    size_t n;
    kvmm_lock(v->mm);
    assert_int_equal(kvmm_evict(v->mm, KVD_TIER_DEVICE, 1000, &n), 0);
    assert_int_equal(kvmm_check(v->mm), 0);
    kvmm_unlock(v->mm);
}

static size_t restore(struct env *v, uint32_t c)
{
    uint32_t t[2 * BT];
    chain_of(c, t);
    return kvmm_disk_prefetch(v->mm, v->tenant, v->ns, t, 2 * BT);
}

/* Chain 0 is written to disk, then stays cached in memory while four other chains fill the
 * 8-slot disk and push its copy out; when memory drops it, it is written again, so a later
 * request still restores it from disk. */
static void test_hot_block_written_again(void **state)
{
    (void)state;
    struct env v;
    env_open(&v, 8);
    assert_int_equal(request(&v, 0), 0);
    flush(&v);
    for (uint32_t c = 1; c <= 4; c++) {
        assert_int_equal(request(&v, c), 0);
        flush(&v);
    }
    struct kvmm_disk_stats st;
    kvmm_disk_stats(v.mm, &st);
    assert_true(st.tier.evictions >= 2);      /* chain 0's slots went */
    assert_int_equal(request(&v, 0), 2 * BT); /* still in memory: a hit */
    evict_all(&v);
    flush(&v);
    assert_int_equal(restore(&v, 0), 2);
    assert_int_equal(request(&v, 0), 2 * BT);
    env_close(&v);
}

/* Dropped from memory = used: of two chains written long ago, the one memory dropped last
 * (touched to the disk's front) outlives chains written after it. */
static void test_drop_touches(void **state)
{
    (void)state;
    struct env v;
    env_open(&v, 8);
    for (uint32_t c = 0; c < 4; c++) { /* the disk is full: 8 slots */
        assert_int_equal(request(&v, c), 0);
        flush(&v);
    }
    /* All four dropped from memory, chain 0 last (it is used again first, so it is the
     * most recently used when they all go). */
    assert_int_equal(request(&v, 0), 2 * BT);
    evict_all(&v);
    flush(&v);
    /* Two new chains: four evictions on disk; chain 0, touched last, stays. */
    for (uint32_t c = 10; c < 12; c++) {
        assert_int_equal(request(&v, c), 0);
        flush(&v);
    }
    assert_int_equal(restore(&v, 0), 2);
    env_close(&v);
}

/* Chain 0 is on disk (and announced) and memory drops it; 15 more chains fill the 32-slot
 * disk behind it (so a writer batch is 4 blocks); then chain 0, computed again, and a new
 * chain are written in one batch, in either order. New chain first: it takes chain 0's
 * slots (the least recently used) and chain 0 goes to new ones; its old copy's BlockRemoved
 * must come before its new BlockStored, never after. Chain 0 first: its write finds it on
 * disk, then the new chain evicts it; no BlockStored may follow that BlockRemoved. Either
 * way the DISK events end with the blocks the tier holds. */
static void rewrite_in_one_batch(bool chain0_first)
{
    struct env v;
    struct disk_view dv = {0};
    env_open_ev(&v, 32, &dv);
    assert_int_equal(request(&v, 0), 0);
    flush(&v);
    evict_all(&v);
    for (uint32_t c = 1; c < 16; c++) {
        assert_int_equal(request(&v, c), 0);
        flush(&v);
    }
    assert_int_equal(dv.n, 32);
    /* Not in memory: computed and queued again, chain 0 still on disk. */
    assert_int_equal(request(&v, chain0_first ? 0 : 100), 0);
    assert_int_equal(request(&v, chain0_first ? 100 : 0), 0);
    flush(&v);
    struct kvmm_disk_stats st;
    kvmm_disk_stats(v.mm, &st);
    assert_true(st.tier.evictions >= 2);
    assert_int_equal(st.tier.cached_slots, 32);
    assert_int_equal(dv.n, st.tier.cached_slots);
    evict_all(&v);
    assert_int_equal(restore(&v, 0), chain0_first ? 0 : 2); /* what the tier really holds */
    env_close(&v);
}

static void test_events_rewrite_after_evict(void **state)
{
    (void)state;
    rewrite_in_one_batch(false);
}

static void test_events_dup_then_evicted(void **state)
{
    (void)state;
    rewrite_in_one_batch(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hot_block_written_again, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_drop_touches, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_events_rewrite_after_evict, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_events_dup_then_evicted, dir_new, dir_rm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

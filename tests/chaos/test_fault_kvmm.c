/* Fault injection into the memory manager (built only with
 * -DKVD_FAULT_INJECTION=ON, label fault): for every fault point and every
 * position k, a scripted workload runs with the k-th call at that point
 * failing. Each failure must be a clean error (a protocol code and a
 * message), leave the state unchanged (kvmm_check passes, bytes read back
 * are the bytes written), and closing everything must give every block back
 * (ASan in the fault+sanitize build finds leaks). A host block with a bit
 * flipped is detected at swap-in and never served. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fault.h"
#include "kvmm.h"

#define BT 4                   /* tokens per block */
#define TB (2 * 2 * 1 * 8 * 2) /* token bytes: layers * K,V * heads * head_dim * f16 */
#define N_TOK 24

static const struct kv_geom geom = {
    .layers = 2, .kv_heads = 1, .head_dim = 8, .dtype = KV_F16, .block_tokens = BT};

static struct kvmm *mm_new(struct backend *be, uint32_t dev, uint32_t host)
{
    struct kvmm_config c = {.geom = geom, .n_device_blocks = dev, .n_host_blocks = host, .be = be};
    struct kvmm *mm = NULL;
    int rc = kvmm_new(&c, &mm);
    if (rc) {
        assert_true(rc == KVD_ENOMEM || rc == KVD_EINTERNAL);
        assert_null(mm);
        return NULL;
    }
    kvmm_lock(mm); /* held until mm_free: one thread, the lock rule (kvmm.h) */
    return mm;
}

static void mm_free(struct kvmm *mm)
{
    kvmm_unlock(mm);
    kvmm_free(mm);
}

/* A failed call: a real code, a message, invariants intact. */
static void failed_cleanly(struct kvmm *mm, int rc)
{
    assert_true(rc > 0 && rc < KVD_EIO);
    assert_true(kvmm_errmsg(mm)[0] != '\0');
    assert_int_equal(kvmm_check(mm), 0);
}

/* Tokens [0, n) out of kv data laid out for n_src tokens: the wire layout
 * is [layer][K|V][kv_head][token][head_dim], so a shorter range is a
 * gather, not a prefix. */
#define SECTIONS (2 * 2 * 1) /* layers * K,V * kv_heads */
#define ROW (TB / SECTIONS)  /* bytes of one token in one section */
static void gather(const uint8_t *src, size_t n_src, size_t n, uint8_t *dst)
{
    for (size_t sec = 0; sec < SECTIONS; sec++)
        memcpy(dst + sec * n * ROW, src + sec * n_src * ROW, n * ROW);
}

static void fill(uint8_t *b, size_t n, unsigned salt)
{
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(salt + i * 13);
}

/* The workload: two tenants' worth of open, extend, write, commit, fork,
 * COW write, offload, restore, match, read, evict, close. Returns how
 * many calls failed. Every successful read is compared with what the
 * sequence was last given. */
static int workload(struct kvmm *mm)
{
    static uint32_t toks[N_TOK];
    uint8_t w[N_TOK * TB], shadow[N_TOK * TB], r[N_TOK * TB];
    uint32_t t;
    kvmm_seq_t a = 0, b = 0, c = 0;
    size_t got = 0;
    int fails = 0, rc;
    bool wrote = false;
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    uint32_t ns;
    for (int i = 0; i < N_TOK; i++)
        toks[i] = (uint32_t)(i * 7 + 1);
    snprintf(tc.name, sizeof(tc.name), "t");
#define TRY(call)                                                                                  \
    do {                                                                                           \
        rc = (call);                                                                               \
        if (rc) {                                                                                  \
            failed_cleanly(mm, rc);                                                                \
            fails++;                                                                               \
        }                                                                                          \
    } while (0)
    TRY(kvmm_tenant_set(mm, &tc, &t));
    if (rc)
        return fails;
    TRY(kvmm_tenant_namespace(mm, t, &ns));
    if (rc)
        return fails;
    TRY(kvmm_seq_open(mm, 1, t, ns, &a));
    if (rc)
        return fails;
    TRY(kvmm_seq_extend(mm, 1, a, N_TOK));
    if (rc == 0) {
        fill(w, sizeof(w), 1);
        TRY(kvmm_seq_write(mm, 1, a, 0, N_TOK, w, sizeof(w)));
        if (rc == 0) {
            memcpy(shadow, w, sizeof(w));
            wrote = true;
        }
        size_t shared;
        TRY(kvmm_seq_commit(mm, 1, a, toks, N_TOK, &shared));
        TRY(kvmm_seq_fork(mm, 1, a, 1, &b));
        if (rc == 0) {
            /* COW: writing the fork must not change a */
            fill(w, 2 * TB, 99);
            TRY(kvmm_seq_write(mm, 1, b, N_TOK - 2, 2, w, 2 * TB));
            TRY(kvmm_seq_close(mm, 1, b));
        }
        TRY(kvmm_seq_offload(mm, 1, a));
        TRY(kvmm_seq_restore(mm, 1, a));
        TRY(kvmm_seq_read(mm, 1, a, 0, N_TOK, r, sizeof(r)));
        if (rc == 0 && wrote)
            assert_memory_equal(r, shadow, sizeof(r));
    }
    /* a second sequence matches a's prefix (swapping in what was offloaded) */
    TRY(kvmm_seq_open(mm, 2, t, ns, &c));
    if (rc == 0) {
        size_t ev;
        TRY(kvmm_evict(mm, KVD_TIER_DEVICE, 2, &ev));
        TRY(kvmm_seq_match(mm, 2, c, toks, N_TOK, &got));
        if (rc == 0 && got && wrote) {
            TRY(kvmm_seq_read(mm, 2, c, 0, got, r, got * TB));
            if (rc == 0) {
                uint8_t want[N_TOK * TB];
                gather(shadow, N_TOK, got, want);
                assert_memory_equal(r, want, got * TB);
            }
        }
    }
#undef TRY
    return fails;
}

static void run_point(enum fault_point p, int max_k)
{
    struct backend *be;
    assert_int_equal(backend_cpu_new(&be), 0);
    int total_fail = 0, k;
    for (k = 1; k <= max_k; k++) {
        fault_reset();
        fault_set(p, FAULT_NTH, (uint64_t)k);
        struct kvmm *mm = mm_new(be, 16, 8);
        if (!mm) { /* the arena allocation itself failed: a clean error */
            total_fail++;
            continue;
        }
        int fails = workload(mm);
        uint64_t injected = fault_injected(p);
        total_fail += fails;
        fault_reset();
        kvmm_close_owner(mm, 1);
        kvmm_close_owner(mm, 2);
        struct kvmm_stats st;
        kvmm_stats(mm, &st);
        assert_int_equal(st.n_seqs, 0);
        assert_int_equal(st.device_used, 0);
        assert_int_equal(st.host_used, 0);
        assert_int_equal(kvmm_check(mm), 0);
        mm_free(mm);
        /* Past the last call at this point: nothing more to fail. */
        if (injected == 0)
            break;
    }
    fault_reset();
    printf("fault point %s: %d positions, %d clean failures\n", fault_point_name(p), k - 1,
           total_fail);
    assert_true(total_fail > 0); /* the point was reached and did fail */
    backend_free(be);
}

static void test_fault_alloc(void **state)
{
    run_point(FAULT_ALLOC, 200);
}

static void test_fault_copy(void **state)
{
    run_point(FAULT_COPY, 200);
}

static void test_fault_arenas(void **state)
{
    run_point(FAULT_DEVICE_ALLOC, 3);
    run_point(FAULT_HOST_ALLOC, 3);
}

/* 6% of allocations and 15% of copies failing at once, over many rounds
 * (prob mode: a fixed every=N would hit the same call each round). */
static void test_fault_mixed(void **state)
{
    struct backend *be;
    assert_int_equal(backend_cpu_new(&be), 0);
    assert_int_equal(fault_parse("alloc:prob=60,copy:prob=150"), 0);
    assert_int_equal(fault_parse("alloc:bogus=3"), -1);
    assert_int_equal(fault_parse("nothing:every=1"), -1);
    for (int round = 0; round < 200; round++) {
        struct kvmm *mm = mm_new(be, 16, 8);
        assert_non_null(mm);
        workload(mm);
        kvmm_close_owner(mm, 1);
        kvmm_close_owner(mm, 2);
        struct kvmm_stats st;
        kvmm_stats(mm, &st);
        assert_int_equal(st.device_used, 0);
        assert_int_equal(kvmm_check(mm), 0);
        mm_free(mm);
    }
    printf("mixed: alloc %llu/%llu calls failed, copy %llu/%llu\n",
           (unsigned long long)fault_injected(FAULT_ALLOC),
           (unsigned long long)fault_calls(FAULT_ALLOC),
           (unsigned long long)fault_injected(FAULT_COPY),
           (unsigned long long)fault_calls(FAULT_COPY));
    assert_true(fault_injected(FAULT_ALLOC) > 0 && fault_injected(FAULT_COPY) > 0);
    fault_reset();
    backend_free(be);
}

/* A host copy with one flipped bit: the match stops before it, the bytes
 * are never served, the block is dropped, the failure counted. */
static void test_host_bitflip(void **state)
{
    struct backend *be;
    struct kvmm *mm;
    uint32_t t, ns, ids[N_TOK / BT];
    enum kvd_tier tiers[N_TOK / BT];
    uint32_t toks[N_TOK];
    uint8_t w[N_TOK * TB], r[N_TOK * TB];
    kvmm_seq_t a, b;
    size_t n, shared, got, ev;
    struct kvmm_tenant_conf tc = {.name = "t",
                                  .max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1};
    fault_reset();
    assert_int_equal(backend_cpu_new(&be), 0);
    mm = mm_new(be, 16, 16);
    assert_non_null(mm);
    for (int i = 0; i < N_TOK; i++)
        toks[i] = (uint32_t)i + 5;
    fill(w, sizeof(w), 7);
    assert_int_equal(kvmm_tenant_set(mm, &tc, &t), 0);
    assert_int_equal(kvmm_tenant_namespace(mm, t, &ns), 0);
    assert_int_equal(kvmm_seq_open(mm, 1, t, ns, &a), 0);
    assert_int_equal(kvmm_seq_extend(mm, 1, a, N_TOK), 0);
    assert_int_equal(kvmm_seq_write(mm, 1, a, 0, N_TOK, w, sizeof(w)), 0);
    assert_int_equal(kvmm_seq_commit(mm, 1, a, toks, N_TOK, &shared), 0);
    assert_int_equal(shared, N_TOK / BT);
    assert_int_equal(kvmm_seq_blocks(mm, 1, a, ids, tiers, N_TOK / BT, &n), 0);
    assert_int_equal(kvmm_seq_close(mm, 1, a), 0);
    /* Every cached block goes to the host tier. */
    assert_int_equal(kvmm_evict(mm, KVD_TIER_DEVICE, N_TOK / BT, &ev), 0);
    assert_int_equal(ev, N_TOK / BT);
    /* Flip one bit of block 3's host copy. */
    enum kvd_tier tier;
    uint32_t slot;
    assert_int_equal(kvmm_block_where(mm, ids[3], &tier, &slot), 0);
    assert_int_equal(tier, KVD_TIER_HOST);
    uint8_t *host = kvmm_host_arena(mm);
    assert_non_null(host);
    host[(size_t)slot * kvmm_block_bytes(mm) + 17] ^= 0x04;
    /* Match: blocks 0-2 come back, block 3 is detected and dropped, so the
     * client recomputes from token 12 on. */
    assert_int_equal(kvmm_seq_open(mm, 1, t, ns, &b), 0);
    assert_int_equal(kvmm_seq_match(mm, 1, b, toks, N_TOK, &got), 0);
    assert_int_equal(got, 3 * BT);
    assert_int_equal(kvmm_seq_read(mm, 1, b, 0, got, r, got * TB), 0);
    uint8_t want[N_TOK * TB];
    gather(w, N_TOK, got, want);
    assert_memory_equal(r, want, got * TB);
    struct kvmm_stats st;
    kvmm_stats(mm, &st);
    assert_int_equal(st.checksum_failures, 1);
    assert_int_equal(kvmm_check(mm), 0);
    /* The corrupted block is gone from the cache: a second match stops at
     * the same place (and never serves it). */
    kvmm_seq_t c;
    assert_int_equal(kvmm_seq_open(mm, 1, t, ns, &c), 0);
    assert_int_equal(kvmm_seq_match(mm, 1, c, toks, N_TOK, &got), 0);
    assert_int_equal(got, 3 * BT);
    kvmm_close_owner(mm, 1);
    kvmm_stats(mm, &st);
    assert_int_equal(st.device_used + st.host_used, 0);
    mm_free(mm);
    backend_free(be);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fault_alloc),  cmocka_unit_test(test_fault_copy),
        cmocka_unit_test(test_fault_arenas), cmocka_unit_test(test_fault_mixed),
        cmocka_unit_test(test_host_bitflip),
    };
    return cmocka_run_group_tests_name("fault_kvmm", tests, NULL, NULL);
}

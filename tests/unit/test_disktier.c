/* blockkey's known-answer vectors (docs/persistence.md, computed with
 * xxhsum -H2 over the documented bytes) and the disk tier's file contract:
 * round trips, persistence across a reopen, LRU eviction, session pins,
 * eviction by hits and weights (GCLOCK credits) against plain LRU, every
 * check on a read (tokens, namespace, flipped data or header), the lock,
 * foreign or truncated files, the index table under churn, and batch reads
 * (two in flight at once). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "blockkey.h"
#include "disktier.h"

#define BB 8192u /* block bytes */
#define BT 16u   /* block tokens */

static char dir[64];

static int dir_new(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/var/tmp/kvd-dt.XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int dir_rm(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static struct disktier *open_n(uint64_t n_slots, size_t block_bytes, uint32_t block_tokens)
{
    struct disktier_conf c = {.dir = dir,
                              .block_bytes = block_bytes,
                              .block_tokens = block_tokens,
                              .max_bytes =
                                  4096 + n_slots * (4096 + ((block_bytes + 4095) & ~4095ull))};
    struct disktier *dt = NULL;
    struct kvd_error e = {0};
    if (disktier_open(&c, &dt, &e))
        fail_msg("disktier_open: %s", e.message);
    return dt;
}

static void tokens_of(uint32_t i, uint32_t *t)
{
    for (uint32_t k = 0; k < BT; k++)
        t[k] = i * 1000 + k;
}

static struct blockkey key_of(uint32_t i)
{
    uint32_t t[BT];
    tokens_of(i, t);
    return blockkey_next((struct blockkey){0, 0}, t, BT);
}

static void put_block(struct disktier *dt, uint32_t i, const char *ns)
{
    uint32_t t[BT];
    void *buf = disktier_buf_new(dt);
    assert_non_null(buf);
    tokens_of(i, t);
    memset(disktier_data(dt, buf), (int)(i & 0xff), BB);
    assert_int_equal(disktier_put(dt, ns, blockkey_ns(ns), key_of(i), t, buf), 0);
    free(buf);
}

/* 0 when block i of ns reads back with its bytes, else the read's code
 * (-1: not there). */
static int get_block(struct disktier *dt, uint32_t i, const char *ns)
{
    uint32_t t[BT];
    tokens_of(i, t);
    uint32_t s = disktier_lookup(dt, blockkey_ns(ns), key_of(i));
    if (s == DISKTIER_NONE)
        return -1;
    void *buf = disktier_buf_new(dt);
    assert_non_null(buf);
    int rc = disktier_read(dt, s, ns, blockkey_ns(ns), key_of(i), t, buf);
    if (rc == 0) {
        const unsigned char *d = disktier_data(dt, buf);
        for (size_t k = 0; k < BB; k++)
            assert_int_equal(d[k], i & 0xff);
    }
    free(buf);
    return rc;
}

static struct disktier *open_pol(uint64_t n_slots, bool lru)
{
    struct disktier_conf c = {.dir = dir,
                              .block_bytes = BB,
                              .block_tokens = BT,
                              .lru = lru,
                              .max_bytes = 4096 + n_slots * (4096 + BB)};
    struct disktier *dt = NULL;
    struct kvd_error e = {0};
    if (disktier_open(&c, &dt, &e))
        fail_msg("disktier_open: %s", e.message);
    return dt;
}

/* put_block with the block's hits so far and its tenant's weight. */
static void put_block_w(struct disktier *dt, uint32_t i, const char *ns, uint32_t hits,
                        uint32_t weight)
{
    uint32_t t[BT];
    void *buf = disktier_buf_new(dt);
    assert_non_null(buf);
    tokens_of(i, t);
    memset(disktier_data(dt, buf), (int)(i & 0xff), BB);
    struct disktier_wr w = {.ns_name = ns,
                            .ns = blockkey_ns(ns),
                            .key = key_of(i),
                            .tokens = t,
                            .buf = buf,
                            .hits = hits,
                            .weight = weight};
    assert_int_equal(disktier_put_many(dt, &w, 1), 1);
    assert_int_equal(w.rc, 0);
    free(buf);
}

static void test_known_answers(void **state)
{
    (void)state;
    uint8_t fp[16] = {0};
    struct kv_geom g = {
        .layers = 4, .kv_heads = 4, .head_dim = 64, .dtype = KV_F16, .block_tokens = 16};
    struct blockkey root = blockkey_root(fp, &g);
    assert_true(root.hi == 0x06d20e25e6bda34cull && root.lo == 0xed36302cc2c7860eull);
    uint32_t t[16];
    for (uint32_t i = 0; i < 16; i++)
        t[i] = i;
    struct blockkey c0 = blockkey_next(root, t, 16);
    assert_true(c0.hi == 0x3ec77a0209fcc81eull && c0.lo == 0xc841d13b005b9c77ull);
    assert_true(blockkey_ns("tenant:alice") == 0xe8b1c4f0e30319b4ull);
    /* Every part of the root matters. */
    g.dtype = KV_BF16;
    assert_false(blockkey_eq(blockkey_root(fp, &g), root));
    g.dtype = KV_F16;
    fp[15] = 1;
    assert_false(blockkey_eq(blockkey_root(fp, &g), root));
}

static void test_round_trip_and_reopen(void **state)
{
    (void)state;
    struct disktier *dt = open_n(32, BB, BT);
    for (uint32_t i = 0; i < 20; i++)
        put_block(dt, i, "tenant:a");
    for (uint32_t i = 0; i < 20; i++)
        assert_int_equal(get_block(dt, i, "tenant:a"), 0);
    assert_int_equal(get_block(dt, 20, "tenant:a"), -1);
    /* Another namespace never sees them. */
    assert_int_equal(get_block(dt, 3, "tenant:b"), -1);
    assert_int_equal(disktier_sync(dt), 0);
    disktier_close(dt);

    dt = open_n(32, BB, BT);
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.loaded, 20);
    assert_int_equal(st.free_slots, 12);
    for (uint32_t i = 0; i < 20; i++)
        assert_int_equal(get_block(dt, i, "tenant:a"), 0);
    disktier_close(dt);
}

static void test_lru_eviction_and_pins(void **state)
{
    (void)state;
    struct disktier *dt = open_n(4, BB, BT);
    for (uint32_t i = 0; i < 4; i++)
        put_block(dt, i, "ns");
    assert_int_equal(get_block(dt, 0, "ns"), 0); /* 0 is now the most recent */
    put_block(dt, 4, "ns");                      /* evicts 1, the least recent */
    assert_int_equal(get_block(dt, 1, "ns"), -1);
    assert_int_equal(get_block(dt, 0, "ns"), 0);
    /* Pinned blocks are never evicted before they expire. */
    uint64_t later = (uint64_t)time(NULL) + 3600;
    assert_int_equal(disktier_pin(dt, blockkey_ns("ns"), key_of(2), later), 0);
    assert_int_equal(disktier_pin(dt, blockkey_ns("ns"), key_of(99), later), KVD_ENOTFOUND);
    for (uint32_t i = 10; i < 20; i++)
        put_block(dt, i, "ns");
    assert_int_equal(get_block(dt, 2, "ns"), 0);
    /* All pinned: a put is skipped and counted, nothing is lost. */
    for (uint32_t i = 17; i < 20; i++)
        assert_int_equal(disktier_pin(dt, blockkey_ns("ns"), key_of(i), later), 0);
    uint32_t t[BT];
    tokens_of(50, t);
    void *buf = disktier_buf_new(dt);
    assert_int_equal(disktier_put(dt, "ns", blockkey_ns("ns"), key_of(50), t, buf), KVD_ENOMEM);
    free(buf);
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.write_skips, 1);
    assert_int_equal(st.pinned_slots, 4);
    disktier_close(dt);
    /* Pins survive a reopen. */
    dt = open_n(4, BB, BT);
    disktier_stats(dt, &st);
    assert_int_equal(st.pinned_slots, 4);
    disktier_close(dt);
}

static void flip(const char *name, off_t off)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x10;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

static void test_every_check_on_read(void **state)
{
    (void)state;
    struct disktier *dt = open_n(8, BB, BT);
    for (uint32_t i = 0; i < 4; i++)
        put_block(dt, i, "ns");
    assert_int_equal(disktier_sync(dt), 0);
    /* Other tokens under the same key (a hash collision): refused. */
    uint32_t t[BT];
    tokens_of(0, t);
    t[7]++;
    void *buf = disktier_buf_new(dt);
    uint32_t s = disktier_lookup(dt, blockkey_ns("ns"), key_of(0));
    assert_int_equal(disktier_read(dt, s, "ns", blockkey_ns("ns"), key_of(0), t, buf),
                     KVD_EINTERNAL);
    free(buf);
    assert_int_equal(get_block(dt, 0, "ns"), -1); /* dropped */
    /* The namespace's name is checked too, not only its hash. */
    tokens_of(1, t);
    buf = disktier_buf_new(dt);
    s = disktier_lookup(dt, blockkey_ns("ns"), key_of(1));
    assert_int_equal(disktier_read(dt, s, "ns2", blockkey_ns("ns"), key_of(1), t, buf),
                     KVD_EINTERNAL);
    free(buf);
    disktier_close(dt);
    /* Flipped data (block 2 is slot 2) and a flipped header (block 3). */
    size_t slot = 4096 + BB;
    flip("blocks.kvd", (off_t)(4096 + 2 * slot + 4096 + 77));
    flip("blocks.kvd", (off_t)(4096 + 3 * slot + 40));
    dt = open_n(8, BB, BT);
    assert_int_equal(get_block(dt, 2, "ns"), KVD_EINTERNAL);
    assert_int_equal(get_block(dt, 3, "ns"), KVD_EINTERNAL);
    assert_int_equal(get_block(dt, 2, "ns"), -1);
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.checksum_failures, 2);
    disktier_close(dt);
    /* A flipped index record is refused at load. */
    dt = open_n(8, BB, BT);
    put_block(dt, 5, "ns");
    disktier_close(dt);
    flip("index.kvd", (off_t)(4096 + 0 * 64 + 30)); /* block 5 went to the first free slot */
    dt = open_n(8, BB, BT);
    disktier_stats(dt, &st);
    assert_int_equal(st.dropped_at_load, 1);
    assert_int_equal(get_block(dt, 5, "ns"), -1);
    disktier_close(dt);
}

static void test_lock_and_foreign_files(void **state)
{
    (void)state;
    struct disktier *dt = open_n(8, BB, BT), *dt2 = NULL;
    put_block(dt, 1, "ns");
    struct disktier_conf c = {
        .dir = dir, .block_bytes = BB, .block_tokens = BT, .max_bytes = 4096 + 8 * (4096 + BB)};
    struct kvd_error e = {0};
    assert_int_equal(disktier_open(&c, &dt2, &e), KVD_EBUSY);
    assert_non_null(strstr(e.message, "in use"));
    disktier_close(dt);
    /* Another geometry: formatted anew, nothing loaded. */
    dt = open_n(8, BB * 2, BT);
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.loaded, 0);
    put_block(dt, 1, "ns"); /* BB of a 2*BB block: the rest stays zero */
    disktier_close(dt);
    /* Truncated index: formatted anew or loaded short, never a crash. */
    char path[128];
    snprintf(path, sizeof path, "%s/index.kvd", dir);
    assert_int_equal(truncate(path, 100), 0);
    dt = open_n(8, BB * 2, BT);
    disktier_stats(dt, &st);
    assert_int_equal(st.loaded, 0);
    disktier_close(dt);
    /* A tiny max_bytes is a clear error. */
    c.max_bytes = 4096;
    assert_int_equal(disktier_open(&c, &dt2, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "holds no block"));
}

/* Many keys through a small table: deletions (evictions) keep every live
 * key findable. */
static void test_index_under_churn(void **state)
{
    (void)state;
    struct disktier *dt = open_n(64, BB, BT);
    for (uint32_t i = 0; i < 1000; i++)
        put_block(dt, i, "ns");
    /* The last 64 written are there; every other is not. */
    for (uint32_t i = 0; i < 1000; i++)
        assert_int_equal(disktier_has(dt, blockkey_ns("ns"), key_of(i)), i >= 936);
    for (uint32_t i = 936; i < 1000; i++)
        assert_int_equal(get_block(dt, i, "ns"), 0);
    disktier_close(dt);
}

/* A batch read (disktier_read_many) on both paths (io_uring where there,
 * and preadv): adjacent slots are coalesced, a batch given out of slot
 * order reads each block into its own buffer, and one corrupt block among
 * good ones is dropped and counted alone, the others served. */
static void batch_reads(bool no_uring)
{
    struct disktier_conf c = {.dir = dir,
                              .block_bytes = BB,
                              .block_tokens = BT,
                              .no_uring = no_uring,
                              .max_bytes = 4096 + 64ull * (4096 + BB)};
    struct disktier *dt = NULL;
    struct kvd_error e = {0};
    if (disktier_open(&c, &dt, &e))
        fail_msg("disktier_open: %s", e.message);
    if (no_uring)
        assert_false(disktier_uring(dt));
    for (uint32_t i = 0; i < 40; i++)
        put_block(dt, i, "ns");
    assert_int_equal(disktier_sync(dt), 0);
    disktier_close(dt);
    size_t slot = 4096 + BB;
    flip("blocks.kvd", (off_t)(4096 + 17 * slot + 4096 + 5)); /* block 17's data */
    assert_int_equal(disktier_open(&c, &dt, &e), 0);

    enum { N = 40 };
    uint32_t toks[N][BT], order[N];
    struct disktier_rd rd[N];
    for (uint32_t k = 0; k < N; k++) /* blocks 20..39, then 0..19: two runs */
        order[k] = (k + 20) % N;
    for (uint32_t k = 0; k < N; k++) {
        uint32_t i = order[k];
        tokens_of(i, toks[k]);
        rd[k] = (struct disktier_rd){.slot = disktier_lookup(dt, blockkey_ns("ns"), key_of(i)),
                                     .key = key_of(i),
                                     .tokens = toks[k],
                                     .buf = disktier_buf_new(dt),
                                     .rc = -7};
        assert_int_not_equal(rd[k].slot, DISKTIER_NONE);
    }
    struct disktier_stats st0, st;
    disktier_stats(dt, &st0);
    assert_int_equal(disktier_read_many(dt, "ns", blockkey_ns("ns"), rd, N), N - 1);
    disktier_stats(dt, &st);
    for (uint32_t k = 0; k < N; k++) {
        uint32_t i = order[k];
        if (i == 17) {
            assert_int_equal(rd[k].rc, KVD_EINTERNAL);
        } else {
            assert_int_equal(rd[k].rc, 0);
            const unsigned char *d = disktier_data(dt, rd[k].buf);
            for (size_t b = 0; b < BB; b++)
                assert_int_equal(d[b], i & 0xff);
        }
        free(rd[k].buf);
    }
    assert_int_equal(st.reads - st0.reads, N - 1);
    assert_int_equal(st.checksum_failures - st0.checksum_failures, 1);
    /* 40 slots of 12 KiB are one run: one request (well under 4 MiB). */
    assert_int_equal(st.read_reqs - st0.read_reqs, 1);
    /* Every other slot: nothing to coalesce, 20 requests (in flight
     * together on io_uring). */
    for (uint32_t k = 0; k < N / 2; k++) {
        tokens_of(2 * k, toks[k]);
        rd[k] = (struct disktier_rd){.slot = disktier_lookup(dt, blockkey_ns("ns"), key_of(2 * k)),
                                     .key = key_of(2 * k),
                                     .tokens = toks[k],
                                     .buf = disktier_buf_new(dt)};
    }
    disktier_stats(dt, &st0);
    assert_int_equal(disktier_read_many(dt, "ns", blockkey_ns("ns"), rd, N / 2), N / 2);
    disktier_stats(dt, &st);
    assert_int_equal(st.read_reqs - st0.read_reqs, N / 2);
    for (uint32_t k = 0; k < N / 2; k++) {
        assert_int_equal(rd[k].rc, 0);
        const unsigned char *d = disktier_data(dt, rd[k].buf);
        assert_int_equal(d[0], (2 * k) & 0xff);
        assert_int_equal(d[BB - 1], (2 * k) & 0xff);
        free(rd[k].buf);
    }
    assert_int_equal(get_block(dt, 17, "ns"), -1); /* dropped */
    assert_int_equal(get_block(dt, 16, "ns"), 0);
    assert_int_equal(get_block(dt, 18, "ns"), 0);
    disktier_close(dt);
}

static void test_batch_reads(void **state)
{
    (void)state;
    batch_reads(false);
}

static void test_batch_reads_preadv(void **state)
{
    (void)state;
    batch_reads(true);
}

/* The same traffic under both policies: a block restored from disk three times outlives a
 * whole turnover of one-off blocks under `hits`, and is the first to go under `lru` (the
 * policy changes what is kept: an LFU that is a no-op would fail this). */
static void hits_run(bool lru)
{
    struct disktier *dt = open_pol(8, lru);
    for (uint32_t i = 0; i < 8; i++)
        put_block(dt, i, "ns");
    for (int r = 0; r < 3; r++)
        assert_int_equal(get_block(dt, 0, "ns"), 0); /* 3 hits: credit log2(4) = 2 */
    for (uint32_t i = 100; i < 108; i++)             /* a turnover of one-offs */
        put_block(dt, i, "ns");
    assert_int_equal(disktier_has(dt, blockkey_ns("ns"), key_of(0)), !lru);
    for (uint32_t i = 1; i < 8; i++)
        assert_false(disktier_has(dt, blockkey_ns("ns"), key_of(i)));
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.evictions, 8);
    assert_true(lru ? st.evict_passes == 0 : st.evict_passes >= 1);
    disktier_close(dt);
}

static void test_hits_outlive_one_offs(void **state)
{
    (void)state;
    hits_run(false);
    dir_rm(state);
    dir_new(state);
    hits_run(true);
}

/* Weights: blocks of a weight-3 tenant written before a weight-1 tenant's outlive them
 * under `hits`; a block's memory hits given at write time count as restores would. */
static void test_weights_and_write_hits(void **state)
{
    (void)state;
    struct disktier *dt = open_pol(8, false);
    for (uint32_t i = 0; i < 4; i++)
        put_block_w(dt, i, "tenant:heavy", 0, 3);
    put_block_w(dt, 4, "tenant:light", 7, 1); /* hit 7 times in memory: credit 3 */
    for (uint32_t i = 5; i < 8; i++)
        put_block_w(dt, i, "tenant:light", 0, 1);
    for (uint32_t i = 100; i < 104; i++)
        put_block_w(dt, i, "tenant:light", 0, 1);
    for (uint32_t i = 0; i < 4; i++)
        assert_true(disktier_has(dt, blockkey_ns("tenant:heavy"), key_of(i)));
    assert_true(disktier_has(dt, blockkey_ns("tenant:light"), key_of(4)));
    for (uint32_t i = 5; i < 8; i++)
        assert_false(disktier_has(dt, blockkey_ns("tenant:light"), key_of(i)));
    disktier_close(dt);
}

/* disktier_touch: a block used elsewhere becomes the most recent, with the credit of its
 * hits; false for a block the tier does not hold. */
static void test_touch(void **state)
{
    (void)state;
    struct disktier *dt = open_pol(4, true);
    for (uint32_t i = 0; i < 4; i++)
        put_block(dt, i, "ns");
    assert_true(disktier_touch(dt, blockkey_ns("ns"), key_of(0), 0, 1));
    assert_false(disktier_touch(dt, blockkey_ns("ns"), key_of(9), 5, 1));
    assert_false(disktier_touch(dt, blockkey_ns("other"), key_of(1), 5, 1));
    put_block(dt, 4, "ns"); /* evicts 1: 0 was touched */
    assert_true(disktier_has(dt, blockkey_ns("ns"), key_of(0)));
    assert_false(disktier_touch(dt, blockkey_ns("ns"), key_of(1), 0, 1));
    disktier_close(dt);
    /* Under hits, a touch with hits buys turns. */
    dir_rm(state);
    dir_new(state);
    dt = open_pol(4, false);
    for (uint32_t i = 0; i < 4; i++)
        put_block(dt, i, "ns");
    assert_true(disktier_touch(dt, blockkey_ns("ns"), key_of(3), 3, 1)); /* credit 2 */
    for (uint32_t i = 10; i < 14; i++)
        put_block(dt, i, "ns");
    assert_true(disktier_has(dt, blockkey_ns("ns"), key_of(3)));
    disktier_close(dt);
}

/* However much credit the tier holds, an eviction passes over at most a bounded number of
 * slots and takes the least credited it saw: a put into a full tier of maximal credits
 * succeeds at once. */
static void test_eviction_bounded(void **state)
{
    (void)state;
    enum { N = 200 };
    struct disktier *dt = open_pol(N, false);
    for (uint32_t i = 0; i < N; i++)
        put_block_w(dt, i, "ns", UINT32_MAX, 255);
    put_block(dt, 1000, "ns");
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.evictions, 1);
    assert_true(st.evict_passes <= 65);
    assert_int_equal(get_block(dt, 1000, "ns"), 0);
    disktier_close(dt);
}

/* Two batches in flight at once (disktier_read_begin twice, then both ends, the second
 * first): each reads into its own buffers, and a corrupt block fails in its batch alone. */
static void test_two_batches_in_flight(void **state)
{
    (void)state;
    enum { N = 24 };
    struct disktier *dt = open_n(64, BB, BT);
    for (uint32_t i = 0; i < 2 * N; i++)
        put_block(dt, i, "ns");
    assert_int_equal(disktier_sync(dt), 0);
    disktier_close(dt);
    flip("blocks.kvd", (off_t)(4096 + (N + 5) * (4096 + BB) + 4096 + 9)); /* block N + 5 */
    dt = open_n(64, BB, BT);
    uint32_t toks[2 * N][BT];
    struct disktier_rd rd[2 * N];
    for (uint32_t i = 0; i < 2 * N; i++) {
        tokens_of(i, toks[i]);
        rd[i] = (struct disktier_rd){.slot = disktier_lookup(dt, blockkey_ns("ns"), key_of(i)),
                                     .key = key_of(i),
                                     .tokens = toks[i],
                                     .buf = disktier_buf_new(dt),
                                     .rc = -7};
    }
    struct disktier_batch *a = disktier_read_begin(dt, "ns", blockkey_ns("ns"), rd, N);
    struct disktier_batch *b = disktier_read_begin(dt, "ns", blockkey_ns("ns"), rd + N, N);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(disktier_read_end(b), N - 1);
    assert_int_equal(disktier_read_end(a), N);
    assert_int_equal(disktier_read_end(NULL), 0);
    for (uint32_t i = 0; i < 2 * N; i++) {
        assert_int_equal(rd[i].rc, i == N + 5 ? KVD_EINTERNAL : 0);
        if (rd[i].rc == 0) {
            const unsigned char *d = disktier_data(dt, rd[i].buf);
            assert_int_equal(d[0], i & 0xff);
            assert_int_equal(d[BB - 1], i & 0xff);
        }
        free(rd[i].buf);
    }
    struct disktier_stats st;
    disktier_stats(dt, &st);
    assert_int_equal(st.checksum_failures, 1);
    assert_int_equal(st.reads, 2 * N - 1);
    disktier_close(dt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_known_answers),
        cmocka_unit_test_setup_teardown(test_round_trip_and_reopen, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_lru_eviction_and_pins, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_every_check_on_read, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_lock_and_foreign_files, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_index_under_churn, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_batch_reads, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_batch_reads_preadv, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_hits_outlive_one_offs, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_weights_and_write_hits, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_touch, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_eviction_bounded, dir_new, dir_rm),
        cmocka_unit_test_setup_teardown(test_two_batches_in_flight, dir_new, dir_rm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

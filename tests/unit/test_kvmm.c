/* Scenario tests of the kvmm facade: K/V byte round trips, commit/match
 * sharing and dedup, copy-on-write isolation, host swap round trips, a
 * corrupted host block detected and treated as a miss, exhaustion and
 * quotas leaving state intact, the reserved floor rule, handles and owners.
 * kvmm_check runs after every step. */
#include "mm_fixture.h"
#include "kvmm_impl.h"

#define OWNER 1

static uint32_t add_tenant(struct fx *f, struct kvmm_tenant_conf c)
{
    uint32_t id;
    assert_int_equal(kvmm_tenant_set(f->mm, &c, &id), 0);
    return id;
}

static kvmm_seq_t open_seq(struct fx *f, uint32_t tenant, uint32_t ns)
{
    kvmm_seq_t s;
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, tenant, ns, &s), 0);
    return s;
}

static uint32_t own_ns(struct fx *f, uint32_t tenant)
{
    uint32_t ns;
    assert_int_equal(kvmm_tenant_namespace(f->mm, tenant, &ns), 0);
    return ns;
}

/* Writes keys[start..start+n) into tokens [start, start+n). */
static void write_keys(struct fx *f, kvmm_seq_t s, size_t start, size_t n, const uint64_t *keys)
{
    unsigned char *buf = malloc(n * f->tb + 1);
    fx_fill(f, buf, keys + start, n);
    int rc = kvmm_seq_write(f->mm, OWNER, s, start, n, buf, n * f->tb);
    if (rc)
        fail_msg("write: %s", kvmm_errmsg(f->mm));
    free(buf);
    fx_check(f);
}

static void expect_keys(struct fx *f, kvmm_seq_t s, size_t start, size_t n, const uint64_t *keys)
{
    unsigned char *buf = malloc(n * f->tb + 1);
    int rc = kvmm_seq_read(f->mm, OWNER, s, start, n, buf, n * f->tb);
    if (rc)
        fail_msg("read: %s", kvmm_errmsg(f->mm));
    size_t d = fx_diff(f, buf, keys + start, n);
    if (d != n)
        fail_msg("token %zu holds the wrong bytes", start + d);
    free(buf);
    fx_check(f);
}

static size_t info_tokens(struct fx *f, kvmm_seq_t s)
{
    struct kvmm_seq_info in;
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    return in.n_tokens;
}

/* A sequence of n tokens with ids tok[], K/V keys = ids + salt, committed. */
static kvmm_seq_t make_committed(struct fx *f, uint32_t tenant, uint32_t ns, const uint32_t *tok,
                                 size_t n, uint64_t salt)
{
    uint64_t *keys = malloc(sizeof *keys * n);
    size_t shared;
    for (size_t i = 0; i < n; i++)
        keys[i] = tok[i] + salt;
    kvmm_seq_t s = open_seq(f, tenant, ns);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, n), 0);
    write_keys(f, s, 0, n, keys);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, tok, n, &shared), 0);
    fx_check(f);
    free(keys);
    return s;
}

static void test_write_read(void **state)
{
    struct fx *f = *state;
    uint64_t keys[10], zeros[10] = {0};
    unsigned char buf[4096];

    fx_open(f, 16, 0);
    uint32_t t = add_tenant(f, fx_tenant("a"));
    kvmm_seq_t s = open_seq(f, t, own_ns(f, t));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 10), 0);
    fx_check(f);
    expect_keys(f, s, 0, 10, zeros); /* fresh blocks read as zeros */
    for (int i = 0; i < 10; i++)
        keys[i] = 1000 + (uint64_t)i;
    write_keys(f, s, 0, 10, keys);
    expect_keys(f, s, 0, 10, keys);
    expect_keys(f, s, 3, 6, keys); /* crosses block edges */
    keys[5] = 77;
    keys[6] = 78;
    write_keys(f, s, 5, 2, keys); /* partial block write keeps the rest */
    expect_keys(f, s, 0, 10, keys);
    /* Bad requests: change nothing. */
    assert_int_equal(kvmm_seq_write(f->mm, OWNER, s, 8, 3, buf, 3 * f->tb), KVD_EBADREQ);
    assert_int_equal(kvmm_seq_write(f->mm, OWNER, s, 0, 2, buf, 2 * f->tb - 1), KVD_EBADREQ);
    assert_int_equal(kvmm_seq_read(f->mm, OWNER, s, SIZE_MAX, 2, buf, 2 * f->tb), KVD_EBADREQ);
    assert_int_equal(kvmm_seq_read(f->mm, OWNER + 1, s, 0, 1, buf, f->tb), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_read(f->mm, OWNER, s + 1, 0, 1, buf, f->tb), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, SIZE_MAX), KVD_ETOOLARGE);
    assert_int_equal(kvmm_seq_truncate(f->mm, OWNER, s, 11), KVD_EBADREQ);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, (uint32_t[11]){0}, 11, NULL), KVD_EBADREQ);
    assert_true(strlen(kvmm_errmsg(f->mm)) > 0);
    expect_keys(f, s, 0, 10, keys);
    /* Truncate into a block and grow again: the kept tokens survive. */
    assert_int_equal(kvmm_seq_truncate(f->mm, OWNER, s, 5), 0);
    fx_check(f);
    assert_int_equal(info_tokens(f, s), 5);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 3), 0);
    expect_keys(f, s, 0, 5, keys);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), KVD_ENOTFOUND);
    fx_check(f);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_free, 16);
    fx_close(f);
}

static void test_commit_match_dedup(void **state)
{
    struct fx *f = *state;
    uint32_t tok[10];
    uint64_t keys[10];
    size_t matched, shared;
    struct kvmm_seq_info in;
    struct kvmm_stats st;

    fx_open(f, 32, 0);
    uint32_t a = add_tenant(f, fx_tenant("a")), b = add_tenant(f, fx_tenant("b"));
    uint32_t ns = own_ns(f, a);
    for (int i = 0; i < 10; i++) {
        tok[i] = 500 + (uint32_t)i;
        keys[i] = tok[i] + 1;
    }
    kvmm_seq_t s1 = make_committed(f, a, ns, tok, 10, 1);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s1, &in), 0);
    assert_int_equal(in.n_shared, 2); /* two full blocks of 4 */
    assert_int_equal(in.n_committed, 10);
    size_t n;
    const uint32_t *ct = kvmm_seq_tokens(f->mm, OWNER, s1, &n);
    assert_int_equal(n, 10);
    assert_memory_equal(ct, tok, sizeof tok);

    /* A match hands out the cached blocks with their bytes. */
    kvmm_seq_t s2 = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s2, tok, 10, &matched), 0);
    fx_check(f);
    assert_int_equal(matched, 8);
    expect_keys(f, s2, 0, 8, keys);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s2, tok, 10, &matched), KVD_EBADREQ);
    uint32_t ids1[4], ids2[4];
    assert_int_equal(kvmm_seq_blocks(f->mm, OWNER, s1, ids1, NULL, 4, &n), 0);
    assert_int_equal(kvmm_seq_blocks(f->mm, OWNER, s2, ids2, NULL, 4, &n), 0);
    assert_int_equal(n, 2);
    assert_memory_equal(ids1, ids2, 2 * sizeof(uint32_t));

    /* A different token in block 2 matches only block 1. */
    uint32_t tok2[10];
    memcpy(tok2, tok, sizeof tok);
    tok2[6] = 1;
    kvmm_seq_t s3 = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s3, tok2, 10, &matched), 0);
    assert_int_equal(matched, 4);
    /* Another tenant's namespace sees nothing. */
    kvmm_seq_t s4 = open_seq(f, b, own_ns(f, b));
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, s4, tok, 10, &matched), 0);
    assert_int_equal(matched, 0);

    /* Dedup: a sequence computing the same blocks switches to the cached ones. */
    kvmm_stats(f->mm, &st);
    uint32_t free_before = st.device_free;
    kvmm_seq_t s5 = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s5, 8), 0);
    write_keys(f, s5, 0, 8, keys);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s5, tok, 8, &shared), 0);
    fx_check(f);
    assert_int_equal(shared, 2);
    assert_int_equal(kvmm_seq_blocks(f->mm, OWNER, s5, ids2, NULL, 4, &n), 0);
    assert_memory_equal(ids1, ids2, 2 * sizeof(uint32_t));
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_free, free_before); /* its own two blocks were freed */
    expect_keys(f, s5, 0, 8, keys);
    assert_int_equal(st.match_tokens_hit, 12);
    kvmm_close_owner(f->mm, OWNER);
    fx_check(f);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.n_seqs, 0);
    assert_int_equal(st.device_cached, 2); /* [500..503] and [504..507] */
    fx_close(f);
}

static void test_cow_isolation(void **state)
{
    struct fx *f = *state;
    uint32_t tok[6];
    uint64_t keys[6], kc[6];
    size_t matched;
    kvmm_seq_t child;
    struct kvmm_stats st;

    fx_open(f, 16, 0);
    uint32_t a = add_tenant(f, fx_tenant("a"));
    uint32_t ns = own_ns(f, a);
    for (int i = 0; i < 6; i++) {
        tok[i] = 40 + (uint32_t)i;
        keys[i] = tok[i] + 9;
    }
    kvmm_seq_t s = make_committed(f, a, ns, tok, 6, 9); /* block 0 shared, block 1 partial */
    assert_int_equal(kvmm_seq_fork(f->mm, OWNER, s, OWNER, &child), 0);
    fx_check(f);
    expect_keys(f, child, 0, 6, keys);
    /* Child writes into the shared partial block: the parent must not see it. */
    memcpy(kc, keys, sizeof kc);
    kc[5] = 4242;
    write_keys(f, child, 5, 1, kc);
    expect_keys(f, child, 0, 6, kc);
    expect_keys(f, s, 0, 6, keys);
    /* Parent writes into the committed, tree-shared block 0: the tree's copy
     * stays what was committed. */
    uint64_t kp[6];
    memcpy(kp, keys, sizeof kp);
    kp[1] = 31337;
    write_keys(f, s, 1, 1, kp);
    expect_keys(f, s, 0, 6, kp);
    expect_keys(f, child, 0, 6, kc);
    kvmm_seq_t m = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, m, tok, 6, &matched), 0);
    assert_int_equal(matched, 4);
    expect_keys(f, m, 0, 4, keys);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.cow_copies, 2);
    /* Extending the parent does not touch the child. */
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 5), 0);
    assert_int_equal(info_tokens(f, child), 6);
    fx_check(f);
    fx_close(f);
}

static void test_swap_round_trip(void **state)
{
    struct fx *f = *state;
    uint64_t keys[13];
    struct kvmm_seq_info in;
    struct kvmm_stats st;

    fx_open(f, 8, 8);
    uint32_t a = add_tenant(f, fx_tenant("a"));
    kvmm_seq_t s = open_seq(f, a, own_ns(f, a));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 13), 0);
    for (int i = 0; i < 13; i++)
        keys[i] = 7000 + (uint64_t)i * 3;
    write_keys(f, s, 0, 13, keys);
    assert_int_equal(kvmm_seq_offload(f->mm, OWNER, s), 0);
    fx_check(f);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    assert_int_equal(in.n_host, 4);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.device_free, 8);
    assert_int_equal(st.swaps_out, 4);
    expect_keys(f, s, 0, 13, keys); /* read in place from the host tier */
    assert_int_equal(kvmm_seq_restore(f->mm, OWNER, s), 0);
    fx_check(f);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    assert_int_equal(in.n_host, 0);
    expect_keys(f, s, 0, 13, keys);
    /* A write into an offloaded sequence swaps the block back first. */
    assert_int_equal(kvmm_seq_offload(f->mm, OWNER, s), 0);
    keys[2] = 5;
    write_keys(f, s, 2, 1, keys);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    assert_int_equal(in.n_host, 3);
    assert_int_equal(kvmm_seq_restore(f->mm, OWNER, s), 0);
    expect_keys(f, s, 0, 13, keys);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.swap_bytes_in, st.swaps_in * kvmm_block_bytes(f->mm));
    assert_int_equal(st.checksum_failures, 0);
    fx_close(f);
}

/* Flips one bit of block id's host copy. */
static void corrupt(struct fx *f, uint32_t id)
{
    enum kvd_tier tier;
    uint32_t slot;
    assert_int_equal(kvmm_block_where(f->mm, id, &tier, &slot), 0);
    assert_int_equal(tier, KVD_TIER_HOST);
    unsigned char *p =
        (unsigned char *)kvmm_host_arena(f->mm) + (size_t)slot * kvmm_block_bytes(f->mm);
    p[kvmm_block_bytes(f->mm) / 2] ^= 0x10;
}

static void test_corrupt_host_block(void **state)
{
    struct fx *f = *state;
    uint32_t tok[12], ids[3];
    uint64_t keys[12];
    size_t matched, n, evicted;
    struct kvmm_stats st;

    fx_open(f, 8, 8);
    uint32_t a = add_tenant(f, fx_tenant("a"));
    uint32_t ns = own_ns(f, a);
    for (int i = 0; i < 12; i++) {
        tok[i] = 300 + (uint32_t)i;
        keys[i] = tok[i] + 2;
    }
    kvmm_seq_t s = make_committed(f, a, ns, tok, 12, 2);
    assert_int_equal(kvmm_seq_blocks(f->mm, OWNER, s, ids, NULL, 3, &n), 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, s), 0);
    /* Cached only: evict everything from the device to the host. */
    assert_int_equal(kvmm_evict(f->mm, KVD_TIER_DEVICE, 10, &evicted), 0);
    fx_check(f);
    assert_int_equal(evicted, 3);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.host_cached, 3);
    corrupt(f, ids[1]);
    kvmm_seq_t m = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, m, tok, 12, &matched), 0);
    fx_check(f);
    assert_int_equal(matched, 4); /* block 0 only: block 1 failed, block 2 hung below it */
    expect_keys(f, m, 0, 4, keys);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.checksum_failures, 1);
    assert_int_equal(st.host_cached + st.device_cached, 0); /* 1 and 2 dropped, 0 in use */
    /* The bad block is gone: a second match still stops after block 0. */
    kvmm_seq_t m2 = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, m2, tok, 12, &matched), 0);
    assert_int_equal(matched, 4);

    /* A sequence's own offloaded block, corrupted: reading it fails cleanly,
     * the sequence is cut before it, nothing wrong is served. */
    kvmm_seq_t p = open_seq(f, a, ns);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, p, 8), 0);
    write_keys(f, p, 0, 8, keys);
    assert_int_equal(kvmm_seq_offload(f->mm, OWNER, p), 0);
    assert_int_equal(kvmm_seq_blocks(f->mm, OWNER, p, ids, NULL, 3, &n), 0);
    corrupt(f, ids[1]);
    unsigned char buf[8 * 512]; /* 8 tokens of up to 512 bytes (fp8's are 288) */
    assert_int_equal(kvmm_seq_read(f->mm, OWNER, p, 0, 8, buf, 8 * f->tb), KVD_EINTERNAL);
    fx_check(f);
    assert_int_equal(info_tokens(f, p), 4);
    assert_int_equal(kvmm_seq_restore(f->mm, OWNER, p), 0);
    expect_keys(f, p, 0, 4, keys);
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.checksum_failures, 2);
    fx_close(f);
}

static void test_exhaustion_and_quota(void **state)
{
    struct fx *f = *state;
    uint64_t keys[32];
    struct kvmm_seq_info in, in2;
    uint32_t tok[16];
    kvmm_seq_t extra;

    fx_open(f, 8, 0);
    struct kvmm_tenant_conf qc = fx_tenant("q");
    qc.max_device_blocks = 3;
    qc.max_seqs = 2;
    uint32_t q = add_tenant(f, qc), a = add_tenant(f, fx_tenant("a"));
    kvmm_seq_t s = open_seq(f, q, own_ns(f, q));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 9), 0);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 4), KVD_EQUOTA);
    assert_non_null(strstr(kvmm_errmsg(f->mm), "quota"));
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in2), 0);
    assert_memory_equal(&in, &in2, sizeof in);
    fx_check(f);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 3), 0); /* fills block 3 */
    assert_int_equal(kvmm_seq_fork(f->mm, OWNER, s, OWNER, &extra), 0);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, q, own_ns(f, q), &extra), KVD_EQUOTA);
    assert_int_equal(kvmm_seq_fork(f->mm, OWNER, s, OWNER, &extra), KVD_EQUOTA);
    /* A COW write needing a fourth block is over quota: refused, nothing changes. */
    for (int i = 0; i < 32; i++)
        keys[i] = 90 + (uint64_t)i;
    unsigned char buf[512];
    assert_true(f->tb <= sizeof buf);
    fx_fill(f, buf, keys, 1);
    assert_int_equal(kvmm_seq_write(f->mm, OWNER, s, 0, 1, buf, f->tb), KVD_EQUOTA);
    fx_check(f);
    kvmm_close_owner(f->mm, OWNER);

    /* Exhaustion: the pool has 8; tenant a gets them all, then no more. */
    kvmm_seq_t b = open_seq(f, a, own_ns(f, a));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, b, 30), 0);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, b, 5), KVD_ENOMEM);
    assert_int_equal(info_tokens(f, b), 30);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, b, 2), 0); /* fits the last block */
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, b, 1), KVD_ENOMEM);
    kvmm_seq_t c = open_seq(f, a, own_ns(f, a));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, c, 1), KVD_ENOMEM);
    assert_int_equal(kvmm_seq_offload(f->mm, OWNER, b), KVD_ENOMEM); /* no host tier */
    fx_check(f);
    /* Cached blocks are evicted (dropped: no host tier) to make room. */
    for (int i = 0; i < 16; i++)
        tok[i] = (uint32_t)i;
    write_keys(f, b, 0, 16, keys);
    size_t shared;
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, b, tok, 16, &shared), 0);
    assert_int_equal(shared, 4);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, b), 0);
    assert_int_equal(kvmm_device_available(f->mm, a), 8);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, c, 24), 0);
    fx_check(f);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.drops, 2);
    assert_int_equal(st.device_cached, 2);
    fx_close(f);
}

static void test_floor_rule(void **state)
{
    struct fx *f = *state;
    uint32_t tr[16], to[32];
    size_t matched;
    struct kvmm_tenant_stats ts;

    fx_open(f, 8, 16);
    struct kvmm_tenant_conf rc = fx_tenant("reserved");
    rc.reserved_device_blocks = 4;
    uint32_t r = add_tenant(f, rc), o = add_tenant(f, fx_tenant("other"));
    struct kvmm_tenant_conf bad = fx_tenant("greedy");
    bad.reserved_device_blocks = 5; /* 4 + 5 > 8 */
    uint32_t dummy;
    assert_int_equal(kvmm_tenant_set(f->mm, &bad, &dummy), KVD_EBADREQ);
    for (int i = 0; i < 32; i++) {
        if (i < 16)
            tr[i] = 1000 + (uint32_t)i;
        to[i] = 2000 + (uint32_t)i;
    }
    /* While r uses nothing, o may borrow the whole pool, floor included. */
    assert_int_equal(kvmm_device_available(f->mm, o), 8);
    kvmm_seq_t so = make_committed(f, o, own_ns(f, o), to, 32, 0);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, so), 0);
    fx_check(f);
    /* r needs its floor: the borrower's cache is evicted to give it back. */
    kvmm_seq_t sr = make_committed(f, r, own_ns(f, r), tr, 16, 0);
    assert_int_equal(kvmm_tenant_stats(f->mm, o, &ts), 0);
    assert_int_equal(ts.device_blocks, 4);
    assert_int_equal(ts.host_blocks, 4);
    assert_int_equal(kvmm_seq_close(f->mm, OWNER, sr), 0);
    fx_check(f);
    /* r's cache now sits inside its floor: o may not evict it. o can get
     * only its own cached blocks back. */
    assert_int_equal(kvmm_device_available(f->mm, o), 4);
    kvmm_seq_t so2 = open_seq(f, o, own_ns(f, o));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, so2, 17), KVD_ENOMEM);
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, so2, 16), 0);
    fx_check(f);
    assert_int_equal(kvmm_tenant_stats(f->mm, r, &ts), 0);
    assert_int_equal(ts.device_blocks, 4);
    assert_int_equal(ts.host_blocks, 0);
    assert_int_equal(ts.cached_blocks, 4);
    kvmm_seq_t m = open_seq(f, r, own_ns(f, r));
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, m, tr, 16, &matched), 0);
    assert_int_equal(matched, 16);
    struct kvmm_stats st;
    kvmm_stats(f->mm, &st);
    assert_int_equal(st.swaps_in, 0); /* served from the device */
    fx_close(f);
}

static void test_shared_namespace_and_owners(void **state)
{
    struct fx *f = *state;
    uint32_t tok[8];
    size_t matched;
    uint32_t sh, sh2;

    fx_open(f, 16, 4);
    uint32_t a = add_tenant(f, fx_tenant("a")), b = add_tenant(f, fx_tenant("b"));
    assert_int_equal(kvmm_namespace(f->mm, "shared", &sh), 0);
    assert_int_equal(kvmm_namespace(f->mm, "shared", &sh2), 0);
    assert_int_equal(sh, sh2);
    assert_int_equal(kvmm_namespace(f->mm, "", &sh2), KVD_EBADREQ);
    for (int i = 0; i < 8; i++)
        tok[i] = 60 + (uint32_t)i;
    kvmm_seq_t s = make_committed(f, a, sh, tok, 8, 0);
    kvmm_seq_t t;
    assert_int_equal(kvmm_seq_open(f->mm, 99, b, sh, &t), 0);
    assert_int_equal(kvmm_seq_match(f->mm, 99, t, tok, 8, &matched), 0);
    assert_int_equal(matched, 8);
    assert_int_equal(kvmm_seq_match(f->mm, OWNER, t, tok, 8, &matched), KVD_ENOTFOUND);
    /* Closing owner 99 leaves owner 1 alone. */
    kvmm_close_owner(f->mm, 99);
    fx_check(f);
    assert_int_equal(kvmm_seq_info(f->mm, 99, t, &(struct kvmm_seq_info){0}), KVD_ENOTFOUND);
    assert_int_equal(info_tokens(f, s), 8);
    /* Handing a sequence to another owner: the old owner loses it. */
    struct kvmm_seq_info in;
    assert_int_equal(kvmm_seq_set_owner(f->mm, OWNER, s, 5), 0);
    assert_int_equal(kvmm_seq_info(f->mm, OWNER, s, &in), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_info(f->mm, 5, s, &in), 0);
    assert_int_equal(in.n_tokens, 8);
    assert_int_equal(kvmm_seq_set_owner(f->mm, 5, s, OWNER), 0);
    /* Bad ids are refused, never trusted. */
    kvmm_seq_t x;
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, 77, sh, &x), KVD_ENOTFOUND);
    assert_int_equal(kvmm_seq_open(f->mm, OWNER, a, 77, &x), KVD_ENOTFOUND);
    uint32_t tid;
    assert_int_equal(kvmm_tenant_find(f->mm, "b", &tid), 0);
    assert_int_equal(tid, b);
    assert_int_equal(kvmm_tenant_find(f->mm, "zz", &tid), KVD_ENOTFOUND);
    fx_close(f);
}

/* The checker must be able to fail: break one invariant at a time. */
static void test_checker_catches(void **state)
{
    struct fx *f = *state;
    uint32_t tok[8];
    size_t shared;

    fx_open(f, 8, 4);
    uint32_t a = add_tenant(f, fx_tenant("a"));
    for (int i = 0; i < 8; i++)
        tok[i] = (uint32_t)i;
    kvmm_seq_t s = open_seq(f, a, own_ns(f, a));
    assert_int_equal(kvmm_seq_extend(f->mm, OWNER, s, 8), 0);
    assert_int_equal(kvmm_seq_commit(f->mm, OWNER, s, tok, 8, &shared), 0);
    fx_check(f);
    struct seq *q = seq_table_get(&f->mm->st, s, OWNER);
    struct pool_block *b = pool_block(&f->mm->pool, q->blocks[0]);
    b->refcount++;
    assert_int_equal(kvmm_check(f->mm), KVD_EINTERNAL);
    assert_non_null(strstr(kvmm_errmsg(f->mm), "refcount"));
    b->refcount--;
    fx_check(f);
    f->mm->tt.v[a].dev_blocks++;
    assert_int_equal(kvmm_check(f->mm), KVD_EINTERNAL);
    f->mm->tt.v[a].dev_blocks--;
    q->n_tokens++; /* 9 tokens in 2 blocks */
    assert_int_equal(kvmm_check(f->mm), KVD_EINTERNAL);
    q->n_tokens--;
    b->node->n_children++;
    assert_int_equal(kvmm_check(f->mm), KVD_EINTERNAL);
    b->node->n_children--;
    fx_check(f);
    fx_close(f);
}

static void test_config_errors(void **state)
{
    struct fx *f = *state; /* its be and mm, freed by the teardown */
    struct backend *cu = NULL;
    struct kvd_error err = {0};
    struct kvmm_config cfg = {.geom = fx_geom(), .n_device_blocks = 4};

    assert_int_equal(backend_cpu_new(&f->be), 0);
    cfg.be = f->be;
    cfg.geom.layers = 0;
    assert_int_equal(kvmm_new(&cfg, &f->mm), KVD_EBADREQ);
    cfg.geom = fx_geom();
    cfg.geom.dtype = (enum kv_dtype)9;
    assert_int_equal(kvmm_new(&cfg, &f->mm), KVD_EBADREQ);
    cfg.geom = fx_geom();
    cfg.geom.dtype = KV_Q8_0; /* a quantized row is whole 32-value blocks */
    cfg.geom.head_dim = 48;
    assert_int_equal(kvmm_new(&cfg, &f->mm), KVD_EBADREQ);
    cfg.geom = fx_geom();
    cfg.n_device_blocks = 0;
    assert_int_equal(kvmm_new(&cfg, &f->mm), KVD_EBADREQ);
    cfg.n_device_blocks = 4;
    cfg.geom.block_tokens = 0; /* default 16 */
    assert_int_equal(kvmm_new(&cfg, &f->mm), 0);
    assert_int_equal(kvmm_geom(f->mm)->block_tokens, 16);
    assert_int_equal(kvmm_block_bytes(f->mm),
                     2 * 2 * 2 * 16 * kv_row_bytes(fx_dtype, cfg.geom.head_dim));
    kvmm_free(f->mm);
    f->mm = NULL;
#ifndef KVD_HAVE_CUDA
    assert_int_equal(backend_cuda_new(0, &cu, &err), KVD_EUNSUPPORTED);
    assert_null(cu);
    assert_int_equal(err.code, KVD_EUNSUPPORTED);
    assert_non_null(strstr(err.message, "CUDA"));
#else
    (void)cu;
    (void)err;
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_write_read, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_commit_match_dedup, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_cow_isolation, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_swap_round_trip, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_host_block, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_exhaustion_and_quota, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_floor_rule, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_shared_namespace_and_owners, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_checker_catches, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_config_errors, fx_setup, fx_teardown),
    };
    /* every case once per kind of row: plain f32, and the quantized q8_0 and
     * fp8 (34- and 36-byte rows: odd block sizes for swap, checksum, COW) */
    static const enum kv_dtype dts[] = {KV_F32, KV_Q8_0, KV_FP8};
    int failed = 0;
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "kvmm %s", kv_dtype_name(dts[i]));
        fx_dtype = dts[i];
        failed += cmocka_run_group_tests_name(name, tests, NULL, NULL);
    }
    return failed;
}

/* The remote tier's lookups in several rounds (kvmm_remote_fetch.c), in-process against a
 * real redis-server (tests/support's redis_harness; label redis): a 4096-token chain of
 * 64 KiB blocks is four values of 63 blocks (4 MiB each) and two tails, fetched in rounds of
 * at most 4 MiB (one value each); a reader restores all 256 blocks byte for byte in five
 * rounds (the shorter tail, within the longer one, is not asked for); a value tampered stops
 * the restore right before it (and a chain stopped asks for no further round). And the
 * REMOTE KV events of overlapping values (a chain's tails written turn by turn): a block is
 * stored once, and removed when the last value holding it is known gone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "backend.h"
#include "blockkey.h"
#include "kvmm.h"
#include "kvmm_remote_impl.h"
#include "redis_harness.h"
#include "remote_value.h"

#define BT 16u
#define NT 4096u     /* tokens of the chain */
#define NB (NT / BT) /* 256 blocks */
#define K 63u        /* blocks per value: 4 MiB / (64 KiB + 64 B of token ids) */
#define POOL (NB + 64)

static const struct kv_geom geom = {
    .layers = 4, .kv_heads = 4, .head_dim = 64, .dtype = KV_F16, .block_tokens = BT};

struct node {
    struct backend *be;
    struct kvmm *mm;
    uint32_t tenant, ns;
};

static struct redis_srv srv;
static char tmp[64], key_file[128];
static uint32_t tokens[NT];
static unsigned char *kv; /* (NT tokens of K/V) what the writer wrote */
static size_t kv_bytes;

static void node_up(struct node *n)
{
    struct kvmm_config cfg = {.geom = geom, .n_device_blocks = POOL};
    assert_int_equal(backend_cpu_new(&n->be), 0);
    cfg.be = n->be;
    assert_int_equal(kvmm_new(&cfg, &n->mm), 0);
    struct kvmm_tenant_conf tc = {.max_device_blocks = KVMM_UNLIMITED,
                                  .max_host_blocks = KVMM_UNLIMITED,
                                  .max_seqs = KVMM_UNLIMITED,
                                  .weight = 1,
                                  .remote = true,
                                  .events = KVMM_EVENTS_HASHES};
    snprintf(tc.name, sizeof tc.name, "t");
    kvmm_lock(n->mm);
    assert_int_equal(kvmm_tenant_set(n->mm, &tc, &n->tenant), 0);
    assert_int_equal(kvmm_tenant_namespace(n->mm, n->tenant, &n->ns), 0);
    kvmm_unlock(n->mm);
    struct kvmm_remote_conf rc = {
        .url = srv.url, .key_file = key_file, .timeout_ms = 10000, .min_hits = 0};
    struct kvd_error e = {0};
    if (kvmm_remote_open(n->mm, &rc, &e))
        fail_msg("kvmm_remote_open: %s", e.message);
}

static void node_down(struct node *n)
{
    kvmm_free(n->mm);
    backend_free(n->be);
}

static int group_setup(void **state)
{
    (void)state;
    if (!redis_available()) {
        fprintf(stderr, "redis-server is not installed: skipped\n");
        exit(77);
    }
    if (redis_start(&srv, NULL) != 0)
        return -1;
    snprintf(tmp, sizeof tmp, "/tmp/kvd-kr.XXXXXX");
    if (!mkdtemp(tmp))
        return -1;
    snprintf(key_file, sizeof key_file, "%s/fleet.key", tmp);
    FILE *f = fopen(key_file, "w");
    if (!f)
        return -1;
    fprintf(f, "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n");
    fclose(f);
    chmod(key_file, 0600);
    for (uint32_t i = 0; i < NT; i++)
        tokens[i] = (i * 7919u + 13u) % 32000u;
    kv_bytes = kv_token_bytes(&geom) * NT;
    kv = malloc(kv_bytes);
    if (!kv)
        return -1;
    for (size_t i = 0; i < kv_bytes; i++)
        kv[i] = (unsigned char)(i * 31u + (i >> 11));
    /* The writer: the chain computed once, written through at commit. */
    struct node w;
    node_up(&w);
    kvmm_seq_t s;
    size_t shared;
    kvmm_lock(w.mm);
    assert_int_equal(kvmm_seq_open(w.mm, 1, w.tenant, w.ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(w.mm, 1, s, NT), 0);
    assert_int_equal(kvmm_seq_write(w.mm, 1, s, 0, NT, kv, kv_bytes), 0);
    assert_int_equal(kvmm_seq_commit(w.mm, 1, s, tokens, NT, &shared), 0);
    assert_int_equal(kvmm_seq_close(w.mm, 1, s), 0);
    kvmm_unlock(w.mm);
    assert_int_equal(kvmm_remote_flush(w.mm, 60000), 0);
    struct kvmm_remote_stats st;
    kvmm_remote_stats(w.mm, &st);
    assert_int_equal(st.blocks_per_value, K);
    assert_int_equal(st.writes, NB / K + 1); /* four groups and the tail [252, 255] */
    node_down(&w);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    redis_stop(&srv);
    unlink(key_file);
    rmdir(tmp);
    free(kv);
    return 0;
}

/* The Redis key of the value whose last block is chain index end. */
static void value_key(uint32_t end, uint8_t out[REMOTE_KEY_BYTES])
{
    uint8_t fp[16] = {0};
    struct blockkey c = blockkey_root(fp, &geom);
    for (uint32_t b = 0; b <= end; b++)
        c = blockkey_next(c, tokens + b * BT, BT);
    remote_value_key(blockkey_ns("tenant:t"), c, out);
}

/* XORs one byte at offset off of the value ending at end (restored by untamper). */
static void tamper(uint32_t end, long off)
{
    uint8_t k[REMOTE_KEY_BYTES];
    value_key(end, k);
    redisReply *r = redis_srv_cmd(&srv, "GETRANGE %b %ld %ld", k, sizeof k, off, off);
    assert_true(r && r->type == REDIS_REPLY_STRING && r->len == 1);
    char c = (char)(r->str[0] ^ 0x40);
    freeReplyObject(r);
    r = redis_srv_cmd(&srv, "SETRANGE %b %ld %b", k, sizeof k, off, &c, (size_t)1);
    assert_true(r && r->type == REDIS_REPLY_INTEGER);
    freeReplyObject(r);
}

/* A fresh reader restores the chain: the blocks restored, and (all restored) every byte. */
static size_t restore(uint64_t *rounds, uint64_t *auth)
{
    struct node rd;
    node_up(&rd);
    size_t got = kvmm_remote_prefetch(rd.mm, rd.tenant, rd.ns, tokens, NT);
    if (got == NB) {
        kvmm_seq_t s;
        size_t matched;
        unsigned char *out = malloc(kv_bytes);
        assert_non_null(out);
        kvmm_lock(rd.mm);
        assert_int_equal(kvmm_seq_open(rd.mm, 1, rd.tenant, rd.ns, &s), 0);
        assert_int_equal(kvmm_seq_match(rd.mm, 1, s, tokens, NT, &matched), 0);
        assert_int_equal(matched, NT);
        assert_int_equal(kvmm_seq_read(rd.mm, 1, s, 0, NT, out, kv_bytes), 0);
        assert_int_equal(kvmm_seq_close(rd.mm, 1, s), 0);
        kvmm_unlock(rd.mm);
        assert_memory_equal(out, kv, kv_bytes);
        free(out);
    }
    struct kvmm_remote_stats st;
    kvmm_remote_stats(rd.mm, &st);
    *rounds = st.rounds;
    *auth = st.auth_failures;
    assert_int_equal(st.hits, got);
    assert_int_equal(st.mismatches + st.errors + st.timeouts, 0);
    node_down(&rd);
    return got;
}

static void test_rounds_restore_everything(void **state)
{
    (void)state;
    uint64_t rounds, auth;
    assert_int_equal(restore(&rounds, &auth), NB);
    assert_int_equal(rounds, 5); /* 4 groups, the longer tail; the shorter one not asked for */
    assert_int_equal(auth, 0);
}

/* Group 2 (blocks 126..188, third round) tampered: groups 0 and 1 are restored, nothing
 * after, and no round after it is asked for; the longer tail (fifth round) tampered: every
 * group is restored, not the tail, and the shorter tail is asked for (sixth round: it is not
 * in Redis). */
static void test_tampered_value_stops_the_chain(void **state)
{
    (void)state;
    static const struct {
        uint32_t end;
        size_t want;
        uint64_t rounds;
    } cases[] = {{3 * K - 1, 2 * K, 3}, {NB - 1, 4 * K, 6}};
    for (size_t c = 0; c < 2; c++) {
        uint64_t rounds, auth;
        tamper(cases[c].end, 4000);
        assert_int_equal(restore(&rounds, &auth), cases[c].want);
        assert_int_equal(auth, 1);
        assert_int_equal(rounds, cases[c].rounds);
        tamper(cases[c].end, 4000); /* as it was */
    }
    uint64_t rounds, auth;
    assert_int_equal(restore(&rounds, &auth), NB);
}

/* ---- REMOTE events of overlapping values ------------------------------------------ */

/* What the REMOTE events say Redis holds: a set, as a router keeps it (a store of a block
 * already there, or a removal of one not there, is a failure). */
struct remote_set {
    uint64_t h[NB];
    size_t n, stored, removed;
};

static void remote_ev(void *ctx, const struct kvmm_block_event *ev)
{
    struct remote_set *rs = ctx;
    if (ev->medium != KVMM_MEDIUM_REMOTE)
        return;
    size_t i = 0;
    while (i < rs->n && rs->h[i] != ev->hash)
        i++;
    if (ev->stored) {
        if (i < rs->n)
            fail_msg("REMOTE BlockStored of a block already stored");
        assert_true(rs->n < NB);
        rs->h[rs->n++] = ev->hash;
        rs->stored++;
    } else {
        if (i == rs->n)
            fail_msg("REMOTE BlockRemoved of a block not stored");
        rs->h[i] = rs->h[--rs->n];
        rs->removed++;
    }
}

/* One turn: a sequence of the chain's first n blocks committed (the blocks already in the
 * tree shared), its tail value written. */
static void turn(struct node *w, uint32_t n)
{
    kvmm_seq_t s;
    size_t shared;
    kvmm_lock(w->mm);
    assert_int_equal(kvmm_seq_open(w->mm, 1, w->tenant, w->ns, &s), 0);
    assert_int_equal(kvmm_seq_extend(w->mm, 1, s, n * BT), 0);
    assert_int_equal(kvmm_seq_write(w->mm, 1, s, 0, n * BT, kv, kv_token_bytes(&geom) * n * BT), 0);
    assert_int_equal(kvmm_seq_commit(w->mm, 1, s, tokens, n * BT, &shared), 0);
    assert_int_equal(kvmm_seq_close(w->mm, 1, s), 0);
    kvmm_unlock(w->mm);
    assert_int_equal(kvmm_remote_flush(w->mm, 60000), 0);
}

/* A lookup found the value ending at block end missing. */
static void lost(struct node *w, uint32_t end)
{
    uint8_t fp[16] = {0};
    struct blockkey c = blockkey_root(fp, &geom);
    for (uint32_t b = 0; b <= end; b++)
        c = blockkey_next(c, tokens + b * BT, BT);
    kvmm_lock(w->mm);
    mm_remote_ann_lost(w->mm, blockkey_ns("tenant:t"), c);
    kvmm_unlock(w->mm);
}

/* Tails [0,1], [0,2], [0,4] written over three turns: 5 blocks stored, once each. [0,1]
 * gone: nothing removed (the others hold its blocks); [0,4] gone: blocks 3 and 4; [0,2]
 * gone: the rest. */
static void test_overlapping_values_events(void **state)
{
    (void)state;
    struct remote_set rs = {.n = 0};
    struct node w;
    node_up(&w);
    struct kvmm_events_sink sink = {.ctx = &rs, .block = remote_ev};
    kvmm_lock(w.mm);
    kvmm_events_attach(w.mm, &sink, blockkey_pub_root(""));
    kvmm_unlock(w.mm);
    static const uint32_t turns[3] = {2, 3, 5};
    for (int t = 0; t < 3; t++)
        turn(&w, turns[t]);
    struct kvmm_remote_stats st;
    kvmm_remote_stats(w.mm, &st);
    assert_int_equal(st.writes, 3);
    assert_int_equal(st.announced, 3);
    assert_int_equal(rs.n, 5);
    assert_int_equal(rs.stored, 5);
    assert_int_equal(st.events_stored, 5);

    static const struct {
        uint32_t end;
        size_t left;
    } gone[3] = {{1, 5}, {4, 3}, {2, 0}};
    for (int i = 0; i < 3; i++) {
        lost(&w, gone[i].end);
        assert_int_equal(rs.n, gone[i].left);
        kvmm_remote_stats(w.mm, &st);
        assert_int_equal(st.announced, 2 - i);
        assert_int_equal(st.events_removed, 5 - gone[i].left);
    }
    lost(&w, 2); /* not announced any more: nothing */
    assert_int_equal(rs.removed, 5);
    kvmm_lock(w.mm);
    kvmm_events_attach(w.mm, NULL, 0);
    kvmm_unlock(w.mm);
    node_down(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rounds_restore_everything),
        cmocka_unit_test(test_tampered_value_stops_the_chain),
        cmocka_unit_test(test_overlapping_values_events),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

/* The remote tier's REMOTE KV events when values overlap, with a real redis-server and a real
 * ZeroMQ subscriber: a chain that grows over turns is written as a tail value per turn, each
 * holding the blocks of the one before (and a group value holding them all), so one block is in
 * several values. A value that goes (a lookup finds it missing, or its TTL passes) must not
 * report REMOTE BlockRemoved for blocks another value in Redis still holds: the REMOTE set the
 * subscriber keeps is always the blocks of the values Redis holds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>
#include <zmq.h>

#include "kv_events_fixture.h"
#include "kv_events_sub.h"
#include "remote_fixture.h"

#define TOPIC "kv@overlap@m"
#define VALUE_BYTES "17000" /* 4 blocks of 4 KiB and their token ids per value */
#define K 4u
#define N_TURNS 3
#define MAX_KEYS 8

/* The turns' prompts: 2, 3 and 5 whole blocks and a token (the 8 generated tokens stay in
 * the last block). Values: A = [0,1] (a tail), B = [0,2] (a tail), C = [0,3] (a group) and
 * D = [4] (a tail). */
static const size_t turn_len[N_TURNS] = {2 * BT + 1, 3 * BT + 1, 5 * BT + 1};
#define NB 5

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The stream's REMOTE set is exactly the n hashes of want. */
static void expect_remote_set(const struct kvs_stream *s, const uint64_t *want, size_t n,
                              const char *when)
{
    uint64_t w[NB], got[KVS_MAX_BLOCKS];
    assert_true(n <= NB);
    memcpy(w, want, n * sizeof *w);
    memcpy(got, s->v->h[3], s->v->n[3] * sizeof *got);
    qsort(w, n, sizeof *w, cmp_u64);
    qsort(got, s->v->n[3], sizeof *got, cmp_u64);
    if (s->v->n[3] != n || memcmp(w, got, n * sizeof *w))
        fail_msg("%s: the stream's REMOTE set has %zu blocks, not the %zu Redis holds", when,
                 s->v->n[3], n);
}

/* The stream of a test's daemon, on sockets in the fixture's directory. */
static void stream_init(struct kvs_stream *s, const struct fixture *f)
{
    memset(s, 0, sizeof *s);
    s->zctx = zmq_ctx_new();
    assert_non_null(s->zctx);
    snprintf(s->ev, sizeof s->ev, "ipc://%s/ev.sock", f->tmp);
    snprintf(s->replay, sizeof s->replay, "ipc://%s/replay.sock", f->tmp);
    snprintf(s->topic, sizeof s->topic, "%s", TOPIC);
}

/* ---- the daemon, Redis ---------------------------------------------------------- */

/* A daemon with events on the stream s, values of K blocks and a TTL (NULL: none). */
static void start_ov(struct kh_proc *d, const struct fixture *f, struct kvs_stream *s,
                     const char *ttl_s)
{
    const char *const conf = "[limits]\nremote = on\nevents = on\n";
    const char *x[] = {"--kv-events",
                       s->ev,
                       "--kv-events-replay",
                       s->replay,
                       "--kv-events-topic",
                       TOPIC,
                       "--remote-value-bytes",
                       VALUE_BYTES,
                       ttl_s ? "--remote-ttl-s" : NULL,
                       ttl_s,
                       NULL};
    start_ex(d, f, conf, f->key1, x);
    assert_int_equal(remote_stat(d, "blocks_per_value"), K);
}

/* Waits until d has written at least `writes` values, announces exactly `announced` (the
 * events of an announcement are queued under the same lock) and has nothing queued. */
static void wait_announced(const struct kh_proc *d, uint64_t writes, uint64_t announced)
{
    uint64_t t0 = kvf_now_ms(), w, a, q;
    for (;;) {
        w = remote_stat(d, "writes");
        a = remote_stat(d, "announced");
        q = remote_stat(d, "queued");
        if (w >= writes && a == announced && q == 0)
            break;
        if (kvf_now_ms() - t0 > 60000)
            fail_msg("%llu values written, %llu announced, %llu queued; wanted %llu and %llu",
                     (unsigned long long)w, (unsigned long long)a, (unsigned long long)q,
                     (unsigned long long)writes, (unsigned long long)announced);
        usleep(10000);
    }
    assert_int_equal(remote_stat(d, "write_skips"), 0);
    assert_int_equal(remote_stat(d, "errors"), 0);
}

struct keys {
    char k[MAX_KEYS][128];
    size_t len[MAX_KEYS], n;
};

/* The keys Redis holds now (KEYS skips those past their TTL). */
static void redis_keys(const struct fixture *f, struct keys *ks)
{
    redisReply *r = redis_srv_cmd(&f->redis, "KEYS *");
    assert_true(r && r->type == REDIS_REPLY_ARRAY);
    assert_true(r->elements <= MAX_KEYS);
    ks->n = r->elements;
    for (size_t i = 0; i < r->elements; i++) {
        assert_true(r->element[i]->len <= sizeof ks->k[i]);
        memcpy(ks->k[i], r->element[i]->str, r->element[i]->len);
        ks->len[i] = r->element[i]->len;
    }
    freeReplyObject(r);
}

/* The one key of now that was not in before. */
static void new_key(const struct keys *before, const struct keys *now, char *k, size_t *len)
{
    size_t found = 0;
    for (size_t i = 0; i < now->n; i++) {
        bool old = false;
        for (size_t j = 0; j < before->n && !old; j++)
            old = before->len[j] == now->len[i] && !memcmp(before->k[j], now->k[i], now->len[i]);
        if (!old) {
            memcpy(k, now->k[i], now->len[i]);
            *len = now->len[i];
            found++;
        }
    }
    assert_int_equal(found, 1);
}

static bool key_exists(const struct fixture *f, const char *k, size_t len)
{
    redisReply *r = redis_srv_cmd(&f->redis, "EXISTS %b", k, len);
    assert_true(r && r->type == REDIS_REPLY_INTEGER);
    bool e = r->integer == 1;
    freeReplyObject(r);
    return e;
}

/* The published hashes of the prompt's first NB whole blocks. */
static void chain_hashes(const uint32_t *p, uint64_t *h)
{
    uint64_t parent = kvs_root_hash();
    for (size_t i = 0; i < NB; i++)
        h[i] = parent = kvs_block_hash(parent, p + i * BT);
}

/* The three turns: values A, B, then C and D, each announced once written. */
static void grow(const struct kh_proc *d, const struct fixture *f, struct keys *ks,
                 char (*key)[128], size_t *key_len)
{
    static const uint64_t writes[N_TURNS] = {1, 2, 4};
    struct keys before = {.n = 0};
    for (int t = 0; t < N_TURNS; t++) {
        struct kvd_gen_result r;
        assert_int_equal(generate(d->sock, f->prompt, turn_len[t], &r), 0);
        kvd_gen_result_free(&r);
        wait_announced(d, writes[t], writes[t]);
        redis_keys(f, ks);
        assert_int_equal(ks->n, writes[t]);
        if (t < 2)
            new_key(&before, ks, key[t], &key_len[t]);
        before = *ks;
    }
}

/* ---- tests ---------------------------------------------------------------------- */

/* A lookup finds the oldest value A missing: the blocks B and C still hold stay REMOTE, no
 * BlockRemoved; A recomputed and written again keeps the set as it was. */
static void test_lookup_finds_older_value_missing(void **state)
{
    struct fixture *f = *state;
    struct kvs_stream s;
    stream_init(&s, f);
    struct kh_proc d;
    start_ov(&d, f, &s, NULL);
    kvs_stream_open(&s, &d);
    uint64_t h[NB];
    chain_hashes(f->prompt, h);

    struct keys ks;
    char key[2][128];
    size_t key_len[2];
    grow(&d, f, &ks, key, key_len);
    kvs_stream_catch_up(&s, &d);
    expect_remote_set(&s, h, NB, "after the turns");
    assert_int_equal(s.n_removed, 0);

    /* A gone from Redis (B, C and D stay), and gone locally: the first turn again looks A
     * up and finds it missing. */
    redisReply *r = redis_srv_cmd(&f->redis, "DEL %b", key[0], key_len[0]);
    assert_true(r && r->type == REDIS_REPLY_INTEGER && r->integer == 1);
    freeReplyObject(r);
    admin_evict(&d, "device");
    admin_evict(&d, "host");
    uint64_t misses = remote_stat(&d, "misses");
    struct kvd_gen_result g;
    assert_int_equal(generate(d.sock, f->prompt, turn_len[0], &g), 0);
    assert_int_equal(g.cached_tokens, 0);
    kvd_gen_result_free(&g);
    assert_true(remote_stat(&d, "misses") > misses);
    assert_true(key_exists(f, key[1], key_len[1])); /* B holds blocks 0-2 */
    /* A's loss, then A written again (the same key). */
    wait_announced(&d, 5, 4);
    kvs_stream_catch_up(&s, &d);
    for (size_t i = 0; i < s.n_removed; i++)
        for (size_t j = 0; j < NB; j++)
            if (s.removed[i] == h[j])
                fail_msg("REMOTE BlockRemoved of block %zu, which values in Redis still hold", j);
    redis_keys(f, &ks);
    assert_int_equal(ks.n, 4);
    assert_true(key_exists(f, key[0], key_len[0]));
    expect_remote_set(&s, h, NB, "after A's loss and rewrite");
    assert_int_equal(remote_stat(&d, "events_removed"), 0);

    kvs_stream_close(&s);
    assert_int_equal(kh_stop(&d), 0);
    zmq_ctx_term(s.zctx);
}

/* With a TTL the values expire in the order they were written: each block is reported
 * removed once, when the last value holding it expires, and the set ends empty as Redis. */
static void test_ttl_expires_overlapping_values(void **state)
{
    struct fixture *f = *state;
    struct kvs_stream s;
    stream_init(&s, f);
    struct kh_proc d;
    start_ov(&d, f, &s, "3");
    kvs_stream_open(&s, &d);
    uint64_t h[NB];
    chain_hashes(f->prompt, h);

    struct keys ks;
    char key[2][128];
    size_t key_len[2];
    grow(&d, f, &ks, key, key_len);
    /* Every value's TTL passes: none announced (the events of their removals are queued
     * under the same lock), and Redis holds none. */
    wait_announced(&d, 4, 0);
    kvs_stream_catch_up(&s, &d); /* fails on a BlockRemoved of a block not stored */
    redis_keys(f, &ks);
    assert_int_equal(ks.n, 0);
    expect_remote_set(&s, h, 0, "after the TTL");
    if (s.n_removed != NB)
        fail_msg("%zu REMOTE blocks removed, wanted each of the %d once", s.n_removed, NB);
    uint64_t got[NB], want[NB];
    memcpy(got, s.removed, sizeof got);
    memcpy(want, h, sizeof want);
    qsort(got, NB, sizeof *got, cmp_u64);
    qsort(want, NB, sizeof *want, cmp_u64);
    assert_memory_equal(got, want, sizeof got);
    assert_int_equal(remote_stat(&d, "events_removed"), NB);

    kvs_stream_close(&s);
    assert_int_equal(kh_stop(&d), 0);
    zmq_ctx_term(s.zctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_lookup_finds_older_value_missing, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_ttl_expires_overlapping_values, remote_per_test,
                                        remote_per_test_end),
    };
    return cmocka_run_group_tests(tests, remote_setup, remote_teardown);
}

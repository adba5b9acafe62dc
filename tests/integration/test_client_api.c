/* libkvd against a real kvd in store mode (started from $KVD_BIN on a
 * temporary socket): every typed helper through success and error paths,
 * pipelining with replies matched by id, and connection failures. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

/* Every test gets its own daemon: tests stay independent of each other's
 * cached prefixes and of daemons that a test shuts down. */
static int setup(void **state)
{
    static const char *const args[] = {"--backend", "cpu", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    if (!d)
        return -1;
    *state = d;
    return 0;
}

/* A daemon with --max-frame 4096, so too_large is cheap to provoke. */
static int setup_small_frames(void **state)
{
    static const char *const args[] = {"--backend", "cpu", "--max-frame", "4096", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    if (!d)
        return -1;
    *state = d;
    return 0;
}

static int teardown(void **state)
{
    kh_free(*state);
    return 0;
}

static struct kvd_ctx *connect_ok(struct kh_proc *d)
{
    struct kvd_ctx *c = kvd_connect(d->sock);
    assert_non_null(c);
    if (c->err)
        fail_msg("connect: %s", c->errstr);
    kvd_set_timeout(c, 30000); /* a hang fails the test instead of the run */
    return c;
}

/* ---- hello, stats ---------------------------------------------------------- */

static void test_hello(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;

    assert_int_equal(kvd_hello(c, &h), 0);
    assert_int_equal(c->err, 0);
    assert_string_equal(c->errstr, "");
    assert_int_equal(h.version, KVD_PROTOCOL_VERSION);
    assert_string_equal(h.backend, "cpu");
    assert_false(h.has_model);
    assert_true(h.block_tokens > 0);
    assert_true(h.layers > 0 && h.kv_heads > 0 && h.head_dim > 0);
    assert_true(h.server[0] != '\0' && h.tenant[0] != '\0' && h.dtype[0] != '\0');
    /* block_bytes = layers * 2 (K, V) * kv_heads * block_tokens * head_dim * dtype size */
    assert_int_equal(
        h.block_bytes % ((uint64_t)h.layers * 2 * h.kv_heads * h.block_tokens * h.head_dim), 0);
    assert_int_equal(h.token_bytes * h.block_tokens, h.block_bytes);
    kvd_close(c);
}

static void test_stats(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_reply *r = NULL;
    char *json = NULL;

    assert_int_equal(kvd_stats(c, &r), 0);
    assert_non_null(r);
    assert_int_equal(r->err, 0);
    assert_int_equal(r->body->type, KVD_T_MAP);
    assert_true(r->body->v.map.n > 2); /* more than id and ok */
    kvd_reply_free(r);

    /* The summary struct: a sequence of 3 blocks shows up as used. */
    struct kvd_stats_summary st0, st1;
    uint64_t seq;
    assert_int_equal(kvd_stats_summary(c, &st0), 0);
    assert_true(st0.device_total > 0);
    assert_int_equal(st0.device_free + st0.device_cached + st0.device_used, st0.device_total);
    assert_int_equal(st0.connections, 1);
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, 40, NULL), 0);
    assert_int_equal(kvd_stats_summary(c, &st1), 0);
    assert_int_equal(st1.device_used, st0.device_used + 3);
    assert_int_equal(st1.device_free + 3, st0.device_free);

    assert_int_equal(kvd_stats_json(c, &json), 0);
    assert_non_null(json);
    assert_true(json[0] == '{' && json[strlen(json) - 1] == '}');
    assert_null(strchr(json, '\n'));
    assert_non_null(strstr(json, "\"ok\":true"));
    kvd_free(json);
    kvd_close(c);
}

/* ---- the block API ---------------------------------------------------------- */

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 31 + seed);
}

static void test_block_api(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    struct kvd_blocks bl;
    struct kvd_seq_info info;
    uint64_t seq, child, seq2;
    size_t matched, shared, len;

    assert_int_equal(kvd_hello(c, &h), 0);
    size_t B = h.block_tokens, n = 2 * B + B / 2, tb = h.token_bytes;
    unsigned char *a = malloc(n * tb), *b = malloc(n * tb);
    uint32_t *toks = malloc(n * sizeof(*toks));
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(toks);
    for (size_t i = 0; i < n; i++)
        toks[i] = (uint32_t)(100 + i);

    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_match(c, seq, toks, n, &matched, &bl), 0);
    assert_int_equal(matched, 0);
    assert_int_equal(bl.n, 0);
    kvd_blocks_free(&bl);

    assert_int_equal(kvd_seq_extend(c, seq, n, &bl), 0);
    assert_int_equal(bl.n, 3);
    kvd_blocks_free(&bl);

    fill(a, n * tb, 1);
    assert_int_equal(kvd_kv_write(c, seq, 0, n, a, n * tb), 0);
    memset(b, 0, n * tb);
    assert_int_equal(kvd_kv_read(c, seq, 0, n, b, n * tb, &len), 0);
    assert_int_equal(len, n * tb);
    assert_memory_equal(a, b, n * tb);
    /* A sub-range reads the same bytes as the whole. */
    assert_int_equal(kvd_kv_read(c, seq, B, 3, b, n * tb, &len), 0);
    assert_int_equal(len, 3 * tb);

    assert_int_equal(kvd_seq_commit(c, seq, toks, n, &shared), 0);
    assert_int_equal(shared, 2);

    assert_int_equal(kvd_seq_info(c, seq, &info), 0);
    assert_int_equal(info.n_tokens, n);
    assert_int_equal(info.blocks.n, 3);
    assert_non_null(info.blocks.tiers);
    for (size_t i = 0; i < info.blocks.n; i++)
        assert_int_equal(info.blocks.tiers[i], 0); /* device */
    kvd_seq_info_free(&info);

    /* Fork, then write into the shared partial block from the child: the
     * parent keeps its bytes (copy-on-write). */
    assert_int_equal(kvd_seq_fork(c, seq, &child), 0);
    assert_true(child != seq);
    fill(b, (n - 2 * B) * tb, 77);
    assert_int_equal(kvd_kv_write(c, child, 2 * B, n - 2 * B, b, (n - 2 * B) * tb), 0);
    unsigned char *got = malloc(n * tb);
    assert_non_null(got);
    assert_int_equal(kvd_kv_read(c, child, 2 * B, n - 2 * B, got, n * tb, &len), 0);
    assert_memory_equal(got, b, (n - 2 * B) * tb);
    assert_int_equal(kvd_kv_read(c, seq, 0, n, got, n * tb, &len), 0);
    assert_memory_equal(got, a, n * tb);

    /* Offload moves the parent's own blocks to the host tier; restore and
     * the bytes are unchanged. */
    assert_int_equal(kvd_seq_offload(c, seq), 0);
    assert_int_equal(kvd_seq_info(c, seq, &info), 0);
    size_t on_host = 0;
    for (size_t i = 0; i < info.blocks.n; i++)
        on_host += info.blocks.tiers[i] == 1;
    assert_true(on_host >= 1);
    kvd_seq_info_free(&info);
    assert_int_equal(kvd_seq_restore(c, seq), 0);
    assert_int_equal(kvd_seq_info(c, seq, &info), 0);
    for (size_t i = 0; i < info.blocks.n; i++)
        assert_int_equal(info.blocks.tiers[i], 0);
    kvd_seq_info_free(&info);
    assert_int_equal(kvd_kv_read(c, seq, 0, n, got, n * tb, &len), 0);
    assert_memory_equal(got, a, n * tb);

    assert_int_equal(kvd_seq_close(c, child), 0);
    assert_int_equal(kvd_seq_close(c, seq), 0);

    /* The committed full blocks stay cached: a new sequence reuses them. */
    assert_int_equal(kvd_seq_open(c, NULL, &seq2), 0);
    assert_int_equal(kvd_seq_match(c, seq2, toks, n, &matched, &bl), 0);
    assert_int_equal(matched, 2 * B);
    assert_int_equal(bl.n, 2);
    kvd_blocks_free(&bl);
    assert_int_equal(kvd_kv_read(c, seq2, 0, 2 * B, got, n * tb, &len), 0);
    assert_memory_equal(got, a, 2 * B * tb);
    assert_int_equal(kvd_seq_close(c, seq2), 0);

    free(got);
    free(a);
    free(b);
    free(toks);
    kvd_close(c);
}

/* Sequences belong to their connection: another one cannot see them, and
 * they are gone once the connection closes. */
static void test_handles_per_connection(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c1 = connect_ok(d), *c2 = connect_ok(d);
    struct kvd_seq_info info;
    uint64_t seq;

    assert_int_equal(kvd_seq_open(c1, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c1, seq, 5, NULL), 0);
    assert_int_equal(kvd_seq_info(c2, seq, &info), KVD_ENOTFOUND);
    assert_int_equal(c2->err, KVD_ENOTFOUND);
    assert_int_equal(kvd_seq_close(c2, seq), KVD_ENOTFOUND);
    assert_int_equal(kvd_seq_info(c1, seq, &info), 0);
    kvd_seq_info_free(&info);
    kvd_close(c1);
    kvd_close(c2);
}

/* ---- error paths: each leaves the connection usable -------------------------- */

static void still_usable(struct kvd_ctx *c)
{
    struct kvd_hello_info h;
    assert_int_equal(kvd_hello(c, &h), 0);
    assert_int_equal(c->err, 0);
}

static void test_errors(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    struct kvd_seq_info info;
    struct kvd_reply *r = NULL;
    uint64_t seq, u;
    size_t len;
    unsigned char buf[64];

    assert_int_equal(kvd_hello(c, &h), 0);

    /* Unknown handle. */
    assert_int_equal(kvd_seq_info(c, 987654321, &info), KVD_ENOTFOUND);
    assert_int_equal(c->err, KVD_ENOTFOUND);
    assert_true(strlen(c->errstr) > 0);
    still_usable(c);

    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, 4, NULL), 0);

    /* Data of the wrong size, and a range outside the sequence. */
    assert_int_equal(kvd_kv_write(c, seq, 0, 4, buf, 3), KVD_EBADREQ);
    still_usable(c);
    assert_int_equal(kvd_kv_read(c, seq, 2, 3, buf, sizeof(buf), &len), KVD_EBADREQ);
    still_usable(c);
    /* A buffer too small for the data the daemon sends: refused here. */
    assert_int_equal(kvd_kv_read(c, seq, 0, 4, buf, 1, &len), KVD_ETOOLARGE);
    assert_int_equal(len, 0);
    still_usable(c);

    /* More memory than the daemon has: the sequence is unchanged. */
    int rc = kvd_seq_extend(c, seq, (size_t)1 << 40, NULL);
    assert_true(rc == KVD_ENOMEM || rc == KVD_EQUOTA || rc == KVD_EBADREQ);
    assert_int_equal(kvd_seq_info(c, seq, &info), 0);
    assert_int_equal(info.n_tokens, 4);
    kvd_seq_info_free(&info);

    /* Store mode: generate is unsupported; cancel of nothing is not_found. */
    uint32_t prompt[] = {1, 2, 3};
    struct kvd_gen_result res;
    assert_int_equal(kvd_generate(c, prompt, 3, NULL, &res), KVD_EUNSUPPORTED);
    assert_int_equal(res.n_tokens, 0);
    assert_int_equal(kvd_cancel(c, 424242), KVD_ENOTFOUND);
    still_usable(c);

    /* Generic requests: an unknown op, a known key of the wrong type (the
     * message names the key), a missing key. */
    assert_int_equal(kvd_call(c, "no_such_op", NULL, 0, &r), KVD_EUNKNOWN_OP);
    assert_non_null(r);
    assert_string_equal(r->code, "unknown_op");
    kvd_reply_free(r);
    struct kvd_arg bad_seq = KVD_ARG_S("seq", "abc");
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_INFO, &bad_seq, 1, &r), KVD_EBADREQ);
    assert_non_null(strstr(r->message, "seq"));
    assert_non_null(strstr(c->errstr, "seq"));
    kvd_reply_free(r);
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_EXTEND, NULL, 0, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    /* No "op" key at all, and an op that is not a string. */
    assert_int_equal(kvd_call(c, NULL, NULL, 0, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    struct kvd_arg int_op = KVD_ARG_U("op", 7);
    assert_int_equal(kvd_call(c, NULL, &int_op, 1, &r), KVD_EBADREQ);
    kvd_reply_free(r);
    /* Unknown keys are ignored. */
    struct kvd_arg extra[] = {KVD_ARG_U("seq", seq), KVD_ARG_S("future_key", "x")};
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_INFO, extra, 2, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "n_tokens"), &u), 0);
    assert_int_equal(u, 4);
    kvd_reply_free(r);

    /* Waiting for an id that was never sent is a local error. */
    assert_int_equal(kvd_wait(c, 999999, &r), KVD_ENOTFOUND);
    assert_null(r);
    still_usable(c);
    kvd_close(c);
}

static void test_admin(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_reply *r = NULL;
    uint64_t seq;
    uint32_t toks[64];

    /* The test runs as the daemon's own uid: an admin. Leave some cached
     * blocks behind so evict has work. */
    for (unsigned i = 0; i < 64; i++)
        toks[i] = i + 1;
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, 64, NULL), 0);
    assert_int_equal(kvd_seq_commit(c, seq, toks, 64, NULL), 0);
    assert_int_equal(kvd_seq_close(c, seq), 0);

    assert_int_equal(kvd_admin_check(c, &r), 0);
    assert_non_null(r);
    kvd_reply_free(r);
    assert_int_equal(kvd_admin_evict(c, NULL, 0, &r), 0);
    assert_non_null(r);
    uint64_t evicted = 0;
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "evicted"), &evicted), 0);
    assert_int_equal(evicted, 64 / 16); /* the four committed blocks (16 tokens each) */
    kvd_reply_free(r);
    /* Evicting from the device moves cached blocks to the host tier;
     * evicting there too drops them, and the prefix is gone. */
    assert_int_equal(kvd_admin_evict(c, "host", 0, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "evicted"), &evicted), 0);
    assert_int_equal(evicted, 4);
    kvd_reply_free(r);
    size_t matched = 99;
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_match(c, seq, toks, 64, &matched, NULL), 0);
    assert_int_equal(matched, 0);
    assert_int_equal(kvd_admin_check(c, NULL), 0);
    /* A tier that does not exist is the daemon's bad_request. */
    assert_int_equal(kvd_admin_evict(c, "disk", 1, NULL), KVD_EBADREQ);

    /* Shutdown: the daemon exits, and the connection then reports KVD_EIO. */
    assert_int_equal(kvd_admin_shutdown(c), 0);
    struct kvd_hello_info h;
    int rc = kvd_hello(c, &h);
    assert_int_equal(rc, KVD_EIO);
    assert_int_equal(c->err, KVD_EIO);
    assert_non_null(strstr(c->errstr, "closed"));
    assert_int_equal(kh_wait(d), 0);
    kvd_close(c);
}

/* ---- pipelining ---------------------------------------------------------------- */

#define PIPE_N 1000

static void test_pipeline_1000(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    static uint64_t ids[PIPE_N];
    uint64_t seqs[4];
    struct kvd_reply *r;

    /* Four sequences of different lengths; request i asks about seqs[i % 4],
     * so each reply's n_tokens says which request it answers. */
    for (unsigned s = 0; s < 4; s++) {
        assert_int_equal(kvd_seq_open(c, NULL, &seqs[s]), 0);
        assert_int_equal(kvd_seq_extend(c, seqs[s], s + 1, NULL), 0);
    }
    for (unsigned i = 0; i < PIPE_N; i++) {
        struct kvd_arg a = KVD_ARG_U("seq", seqs[i % 4]);
        assert_int_equal(kvd_send(c, KVD_OP_SEQ_INFO, &a, 1, NULL, NULL, &ids[i]), 0);
    }
    assert_int_equal(kvd_pending(c), PIPE_N);
    assert_int_equal(kvd_flush(c), 0);
    /* Collect in an order unlike the sending order: odd ids backwards, then
     * even ids forwards. */
    for (int pass = 0; pass < 2; pass++) {
        for (unsigned k = 0; k < PIPE_N / 2; k++) {
            unsigned i = pass == 0 ? PIPE_N - 1 - 2 * k : 2 * k;
            uint64_t n;
            assert_int_equal(kvd_wait(c, ids[i], &r), 0);
            assert_int_equal(r->id, ids[i]);
            assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "n_tokens"), &n), 0);
            assert_int_equal(n, i % 4 + 1);
            kvd_reply_free(r);
        }
    }
    assert_int_equal(kvd_pending(c), 0);
    kvd_close(c);
}

/* A pipeline deeper than the socket buffers and the daemon's output limit
 * (8 MiB with --max-frame 4096): the daemon stops reading until its replies
 * are read, so libkvd must read replies while it is still writing requests
 * rather than block in write forever. */
static void test_pipeline_deep(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    enum { N = 100000 }; /* ~20 MB of replies */
    uint64_t *ids = malloc(N * sizeof(*ids)), seq;
    struct kvd_reply *r;

    assert_non_null(ids);
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, 100, NULL), 0);
    for (unsigned i = 0; i < N; i++) {
        struct kvd_arg a = KVD_ARG_U("seq", seq);
        if (kvd_send(c, KVD_OP_SEQ_INFO, &a, 1, NULL, NULL, &ids[i]))
            fail_msg("send %u: %s", i, c->errstr);
    }
    assert_int_equal(kvd_flush(c), 0);
    for (unsigned i = 0; i < N; i++) {
        uint64_t n;
        if (kvd_wait(c, ids[i], &r))
            fail_msg("wait %u: %s", i, c->errstr);
        assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "n_tokens"), &n), 0);
        assert_int_equal(n, 100);
        kvd_reply_free(r);
    }
    free(ids);
    kvd_close(c);
}

static void test_async_sync_mixed(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_reply *r;
    uint64_t seq, id_hello, id_bad, id_info, n;

    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_send(c, KVD_OP_HELLO, NULL, 0, NULL, NULL, &id_hello), 0);
    struct kvd_arg bad = KVD_ARG_U("seq", 12345678);
    assert_int_equal(kvd_send(c, KVD_OP_SEQ_INFO, &bad, 1, NULL, NULL, &id_bad), 0);
    /* A synchronous call while two requests are in flight: its reply is
     * found among theirs, and theirs are kept. */
    assert_int_equal(kvd_seq_extend(c, seq, 7, NULL), 0);
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    assert_int_equal(kvd_send(c, KVD_OP_SEQ_INFO, &a, 1, NULL, NULL, &id_info), 0);
    assert_int_equal(kvd_pending(c), 3);

    assert_int_equal(kvd_wait(c, id_info, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "n_tokens"), &n), 0);
    assert_int_equal(n, 7);
    kvd_reply_free(r);
    /* The failed one reports its own error when collected. */
    assert_int_equal(kvd_wait(c, id_bad, &r), KVD_ENOTFOUND);
    assert_non_null(r);
    assert_int_equal(r->err, KVD_ENOTFOUND);
    assert_string_equal(r->code, "not_found");
    kvd_reply_free(r);
    /* kvd_poll returns what is left, oldest first. */
    assert_int_equal(kvd_poll(c, &r), 0);
    assert_int_equal(r->id, id_hello);
    assert_non_null(kvd_value_get(r->body, "block_tokens"));
    kvd_reply_free(r);
    assert_int_equal(kvd_pending(c), 0);
    kvd_close(c);
}

/* Many clients, each pipelining, on one daemon: nothing crosses over. */
static void test_many_clients(void **state)
{
    struct kh_proc *d = *state;
    enum { NC = 16, DEPTH = 50 };
    struct kvd_ctx *c[NC];
    uint64_t seq[NC], ids[NC][DEPTH];
    for (unsigned k = 0; k < NC; k++) {
        c[k] = connect_ok(d);
        assert_int_equal(kvd_seq_open(c[k], NULL, &seq[k]), 0);
        assert_int_equal(kvd_seq_extend(c[k], seq[k], k + 1, NULL), 0);
    }
    for (unsigned i = 0; i < DEPTH; i++)
        for (unsigned k = 0; k < NC; k++) {
            struct kvd_arg a = KVD_ARG_U("seq", seq[k]);
            assert_int_equal(kvd_send(c[k], KVD_OP_SEQ_INFO, &a, 1, NULL, NULL, &ids[k][i]), 0);
            if (i % 10 == 9)
                assert_int_equal(kvd_flush(c[k]), 0);
        }
    for (unsigned k = 0; k < NC; k++) {
        for (unsigned i = 0; i < DEPTH; i++) {
            struct kvd_reply *r;
            uint64_t n;
            assert_int_equal(kvd_wait(c[k], ids[k][i], &r), 0);
            assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "n_tokens"), &n), 0);
            assert_int_equal(n, k + 1);
            kvd_reply_free(r);
        }
        kvd_close(c[k]);
    }
}

/* ---- connection failures --------------------------------------------------------- */

static void test_connect_fails(void **state)
{
    struct kh_proc *d = *state;
    char path[512];
    struct kvd_hello_info h;
    struct kvd_ctx *c;

    snprintf(path, sizeof(path), "%s/nobody-here.sock", d->dir);
    c = kvd_connect(path);
    assert_non_null(c);
    assert_int_equal(c->err, KVD_EIO);
    assert_non_null(strstr(c->errstr, "cannot connect"));
    assert_non_null(strstr(c->errstr, path));
    assert_non_null(strstr(c->errstr, strerror(ENOENT)));
    /* Every call on a failed context says the same. */
    assert_int_equal(kvd_hello(c, &h), KVD_EIO);
    assert_non_null(strstr(c->errstr, "cannot connect"));
    kvd_close(c);

    /* $KVD_SOCKET picks the socket when none is given. */
    setenv("KVD_SOCKET", d->sock, 1);
    c = kvd_connect(NULL);
    assert_int_equal(c->err, 0);
    assert_int_equal(kvd_hello(c, &h), 0);
    kvd_close(c);
    unsetenv("KVD_SOCKET");
}

/* A malformed frame: the daemon answers id 0 and closes the connection;
 * replies sent before it still arrive; later calls get KVD_EIO saying why. */
static void test_server_closes(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d), *other = connect_ok(d);
    struct kvd_reply *r;
    struct kvd_hello_info h;
    uint64_t id;

    assert_int_equal(kvd_send(c, KVD_OP_HELLO, NULL, 0, NULL, NULL, &id), 0);
    static const unsigned char not_a_map[] = {0x93, 1, 2, 3}; /* msgpack [1,2,3] */
    assert_int_equal(kvd_send_frame(c, not_a_map, sizeof(not_a_map)), 0);
    assert_int_equal(kvd_wait(c, id, &r), 0);
    kvd_reply_free(r);
    assert_int_equal(kvd_poll(c, &r), KVD_EBADREQ);
    assert_int_equal(r->id, 0);
    assert_string_equal(r->code, "bad_request");
    kvd_reply_free(r);
    assert_int_equal(kvd_hello(c, &h), KVD_EIO);
    assert_non_null(strstr(c->errstr, "closed by kvd"));
    assert_non_null(strstr(c->errstr, "bad_request"));
    kvd_close(c);

    /* An empty frame, and one over the daemon's --max-frame (4096 here). */
    c = connect_ok(d);
    assert_int_equal(kvd_send_frame(c, NULL, 0), 0);
    assert_int_equal(kvd_hello(c, &h), KVD_EIO);
    kvd_close(c);
    c = connect_ok(d);
    static unsigned char big[8192];
    assert_int_equal(kvd_send_frame(c, big, sizeof(big)), 0);
    assert_int_equal(kvd_poll(c, &r), KVD_ETOOLARGE);
    kvd_reply_free(r);
    assert_int_equal(kvd_hello(c, &h), KVD_EIO);
    assert_non_null(strstr(c->errstr, "too_large"));
    kvd_close(c);

    /* The other connection never noticed. */
    still_usable(other);
    kvd_close(other);
}

/* The daemon dies with requests in flight: each wait fails with KVD_EIO. */
static void test_daemon_killed(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_reply *r;
    uint64_t id;

    still_usable(c);
    kh_kill(d);
    for (int i = 0; i < 3; i++)
        kvd_send(c, KVD_OP_HELLO, NULL, 0, NULL, NULL, &id);
    assert_int_equal(kvd_wait(c, id, &r), KVD_EIO);
    assert_null(r);
    assert_int_equal(c->err, KVD_EIO);
    assert_true(strlen(c->errstr) > 0);
    kvd_close(c);
}

/* A daemon that stops answering: the timeout turns a hang into KVD_EIO. */
static void test_timeout(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;

    kvd_set_timeout(c, 200);
    still_usable(c);
    kill(d->pid, SIGSTOP);
    assert_int_equal(kvd_hello(c, &h), KVD_EIO);
    assert_non_null(strstr(c->errstr, "timed out"));
    kill(d->pid, SIGCONT);
    kvd_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hello, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_block_api, setup, teardown),
        cmocka_unit_test_setup_teardown(test_handles_per_connection, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_admin, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pipeline_1000, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pipeline_deep, setup_small_frames, teardown),
        cmocka_unit_test_setup_teardown(test_async_sync_mixed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_many_clients, setup, teardown),
        cmocka_unit_test_setup_teardown(test_connect_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_server_closes, setup_small_frames, teardown),
        cmocka_unit_test_setup_teardown(test_daemon_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_timeout, setup, teardown),
    };
    signal(SIGPIPE, SIG_IGN);
    if (!getenv("KVD_BIN")) {
        fprintf(stderr, "test_client_api: KVD_BIN is not set (run through ctest)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}

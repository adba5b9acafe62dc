/* The remote tier against real redis-server processes (tests/support's
 * redis_harness) and real kvd daemons serving a tiny random model: a prompt
 * computed on daemon A is a prefix hit on daemon B, byte-identical; a value
 * tampered in Redis or sealed with another fleet key is refused, counted and
 * recomputed; tenants never restore each other's blocks; a tenant with
 * remote off writes nothing; REMOTE KV events. Redis failures are
 * test_remote_faults.c's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>
#include <zmq.h>

#include "remote_fixture.h"

static const uint64_t full_blocks = FULL_BLOCKS;

static void test_two_daemons_share(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a, b;
    struct kvd_gen_result cold, warm;
    start(&a, f, conf_on, f->key1);
    start(&b, f, conf_on, f->key1);
    gen_ok(&a, f->prompt, &cold);
    assert_int_equal(cold.cached_tokens, 0);
    wait_written(&a, 1);
    assert_true(dbsize(f) >= 1);
    gen_ok(&b, f->prompt, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    expect_same(&cold, &warm);
    assert_true(remote_stat(&b, "hits") >= full_blocks);
    assert_true(remote_stat(&b, "bytes_in") > full_blocks * 4096);
    assert_int_equal(remote_stat(&b, "auth_failures"), 0);
    assert_int_equal(remote_stat(&b, "mismatches"), 0);
    assert_true(remote_stat(&a, "bytes_out") > full_blocks * 4096);
    /* kvctl top shows the tier: its state and B's hits. */
    const char *kvctl = getenv("KVCTL_BIN");
    if (kvctl) {
        char cmd[512], out[8192] = "", want[64];
        snprintf(cmd, sizeof cmd, "%s --socket %s top -n 1 --plain", kvctl, b.sock);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        size_t got = fread(out, 1, sizeof out - 1, p);
        out[got] = 0;
        assert_int_equal(pclose(p), 0);
        snprintf(want, sizeof want, "remote  up  %llu hits",
                 (unsigned long long)remote_stat(&b, "hits"));
        if (!strstr(out, want))
            fail_msg("kvctl top has no \"%s\":\n%s", want, out);
    }
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(kh_stop(&b), 0);
}

/* Flips one byte of every value in Redis (SETRANGE), then asks B. */
static void tamper_all(const struct fixture *f, long offset)
{
    redisReply *keys = redis_srv_cmd(&f->redis, "KEYS kvd1:*");
    assert_non_null(keys);
    assert_true(keys->type == REDIS_REPLY_ARRAY && keys->elements >= 1);
    for (size_t i = 0; i < keys->elements; i++) {
        redisReply *k = keys->element[i];
        redisReply *r =
            redis_srv_cmd(&f->redis, "GETRANGE %b %ld %ld", k->str, k->len, offset, offset);
        assert_true(r && r->type == REDIS_REPLY_STRING && r->len == 1);
        char c = (char)(r->str[0] ^ 0x20);
        freeReplyObject(r);
        r = redis_srv_cmd(&f->redis, "SETRANGE %b %ld %b", k->str, k->len, offset, &c, (size_t)1);
        assert_true(r && r->type == REDIS_REPLY_INTEGER);
        freeReplyObject(r);
    }
    freeReplyObject(keys);
}

static void test_tampered_value_refused(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a, b;
    struct kvd_gen_result cold, again;
    start(&a, f, conf_on, f->key1);
    gen_ok(&a, f->prompt, &cold);
    wait_written(&a, 1);
    assert_int_equal(kh_stop(&a), 0);
    tamper_all(f, 5000); /* inside the K/V bytes */
    start(&b, f, conf_on, f->key1);
    gen_ok(&b, f->prompt, &again);
    assert_int_equal(again.cached_tokens, 0);
    expect_same(&cold, &again);
    assert_true(remote_stat(&b, "auth_failures") >= 1);
    assert_int_equal(remote_stat(&b, "hits"), 0);
    kvd_gen_result_free(&again);
    assert_int_equal(kh_stop(&b), 0);
    kvd_gen_result_free(&cold);
}

static void test_other_fleet_key_refused(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a, b;
    struct kvd_gen_result cold, other, plain;
    start(&a, f, conf_on, f->key2);
    gen_ok(&a, f->prompt, &cold);
    wait_written(&a, 1);
    assert_int_equal(kh_stop(&a), 0);
    start(&b, f, conf_on, f->key1);
    gen_ok(&b, f->prompt, &other);
    assert_int_equal(other.cached_tokens, 0);
    expect_same(&cold, &other);
    assert_true(remote_stat(&b, "auth_failures") >= 1);
    assert_int_equal(remote_stat(&b, "hits"), 0);
    assert_int_equal(kh_stop(&b), 0);
    /* An insecure daemon cannot read sealed values either. */
    start(&b, f, conf_on, NULL);
    gen_ok(&b, f->prompt, &plain);
    assert_int_equal(plain.cached_tokens, 0);
    expect_same(&cold, &plain);
    assert_true(remote_stat(&b, "auth_failures") >= 1);
    assert_int_equal(kh_stop(&b), 0);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&other);
    kvd_gen_result_free(&plain);
}

struct child_arg {
    const char *sock;
    const uint32_t *prompt;
    size_t want_cached;
    int pipe_w;
};

static int child_gen(void *arg)
{
    struct child_arg *a = arg;
    struct kvd_gen_result r;
    if (generate(a->sock, a->prompt, N_PROMPT, &r) != 0)
        return 2;
    if (write(a->pipe_w, r.tokens, r.n_tokens * sizeof(uint32_t)) < 0)
        return 2;
    int rc = r.cached_tokens == a->want_cached ? 0 : 1;
    if (rc)
        fprintf(stderr, "child: cached %zu, wanted %zu\n", (size_t)r.cached_tokens, a->want_cached);
    kvd_gen_result_free(&r);
    return rc;
}

static void run_child(uid_t uid, const char *sock, const uint32_t *prompt, size_t want,
                      uint32_t toks[8])
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    struct child_arg a = {sock, prompt, want, p[1]};
    pid_t pid = kh_run_as(uid, GID_ALL, child_gen, &a);
    assert_true(pid > 0);
    close(p[1]);
    int st = kh_child_status(pid);
    if (st != 0)
        fail_msg("uid %u on %s: status %d (want cached %zu)", (unsigned)uid, sock, st, want);
    assert_int_equal(read(p[0], toks, 8 * sizeof(uint32_t)), 8 * sizeof(uint32_t));
    close(p[0]);
}

static void test_tenants_isolated(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a, b;
    uint32_t a1[8], b1[8], b2[8], a2[8];
    if (geteuid() != 0)
        skip();
    start(&a, f, conf_tenants, f->key1);
    start(&b, f, conf_tenants, f->key1);
    run_child(UID_A, a.sock, f->prompt, 0, a1);
    wait_written(&a, 1);
    /* beta finds none of alpha's blocks on alpha's machine, gamma none on
     * another (each the first of its tenant, so Redis holds only alpha's). */
    run_child(UID_B, a.sock, f->prompt, 0, b1);
    run_child(UID_C, b.sock, f->prompt, 0, b2);
    assert_memory_equal(a1, b1, sizeof a1);
    assert_memory_equal(a1, b2, sizeof a1);
    assert_int_equal(remote_stat(&a, "hits"), 0);
    assert_int_equal(remote_stat(&b, "hits"), 0);
    assert_int_equal(remote_stat(&a, "mismatches") + remote_stat(&b, "mismatches"), 0);
    /* alpha on the other machine finds all of its own. */
    run_child(UID_A, b.sock, f->prompt, full_blocks * BT, a2);
    assert_memory_equal(a1, a2, sizeof a1);
    assert_true(remote_stat(&b, "hits") >= full_blocks);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(kh_stop(&b), 0);
}

static void test_remote_off_writes_nothing(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a;
    struct kvd_gen_result r1, r2;
    start(&a, f, NULL, f->key1); /* remote is off by default */
    gen_ok(&a, f->prompt, &r1);
    gen_ok(&a, f->prompt, &r2); /* a hit: with remote on it would be written now */
    assert_int_equal(r2.cached_tokens, full_blocks * BT);
    assert_int_equal(remote_stat(&a, "queued"), 0);
    assert_int_equal(remote_stat(&a, "writes"), 0);
    assert_int_equal(remote_stat(&a, "rounds"), 0);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(dbsize(f), 0);
    kvd_gen_result_free(&r1);
    kvd_gen_result_free(&r2);
}

/* ---- KV events of the remote tier ----------------------------------------
 * A subscriber of its own (libzmq, msgpack-c): the hashes each medium holds
 * as the events say, and how many REMOTE removals came. */
#define EV_MAX 4096
struct ev_view {
    uint64_t h[4][EV_MAX];
    size_t n[4];
    uint64_t seen[EV_MAX]; /* every GPU or CPU hash ever stored */
    size_t n_seen;
    uint64_t removed_remote;
    uint64_t next_seq; /* the sequence number the next batch must have; UINT64_MAX: any */
};

static int ev_medium(const msgpack_object *o)
{
    static const char *const names[4] = {"GPU", "CPU", "DISK", "REMOTE"};
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    for (int i = 0; i < 4; i++)
        if (o->via.str.size == strlen(names[i]) &&
            !memcmp(o->via.str.ptr, names[i], o->via.str.size))
            return i;
    fail_msg("unknown medium");
    return -1;
}

static bool ev_tag(const msgpack_object *o, const char *t)
{
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(t) &&
           !memcmp(o->via.str.ptr, t, o->via.str.size);
}

static bool ev_has(const struct ev_view *v, int m, uint64_t h)
{
    for (size_t i = 0; i < v->n[m]; i++)
        if (v->h[m][i] == h)
            return true;
    return false;
}

static void ev_apply(struct ev_view *v, const void *buf, size_t len)
{
    msgpack_unpacked u;
    size_t off = 0;
    msgpack_unpacked_init(&u);
    assert_int_equal(msgpack_unpack_next(&u, buf, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_true(u.data.type == MSGPACK_OBJECT_ARRAY && u.data.via.array.size == 3);
    const msgpack_object *evs = &u.data.via.array.ptr[1];
    assert_int_equal(evs->type, MSGPACK_OBJECT_ARRAY);
    for (uint32_t i = 0; i < evs->via.array.size; i++) {
        const msgpack_object *a = evs->via.array.ptr[i].via.array.ptr;
        uint32_t na = evs->via.array.ptr[i].via.array.size;
        if (ev_tag(&a[0], "AllBlocksCleared")) {
            memset(v->n, 0, sizeof v->n);
            continue;
        }
        bool stored = ev_tag(&a[0], "BlockStored");
        assert_true(stored ? na == 7 : (ev_tag(&a[0], "BlockRemoved") && na == 3));
        int m = ev_medium(&a[stored ? 6 : 2]);
        const msgpack_object *hs = &a[1];
        assert_int_equal(hs->type, MSGPACK_OBJECT_ARRAY);
        if (stored && m == 3) /* REMOTE: with its token ids (events = on) */
            assert_int_equal(a[3].via.array.size, (size_t)BT * hs->via.array.size);
        for (uint32_t k = 0; k < hs->via.array.size; k++) {
            uint64_t h = hs->via.array.ptr[k].via.u64;
            if (stored) {
                if (!ev_has(v, m, h)) {
                    assert_true(v->n[m] < EV_MAX);
                    v->h[m][v->n[m]++] = h;
                }
                if (m < 2 && v->n_seen < EV_MAX)
                    v->seen[v->n_seen++] = h;
                continue;
            }
            if (m == 3)
                v->removed_remote++;
            for (size_t j = 0; j < v->n[m]; j++)
                if (v->h[m][j] == h) {
                    v->h[m][j] = v->h[m][--v->n[m]];
                    break;
                }
        }
    }
    msgpack_unpacked_destroy(&u);
}

/* Applies every batch that arrives within ms; the sequence numbers must run
 * without a gap. */
static void ev_pump(void *sub, struct ev_view *v, int ms)
{
    zmq_pollitem_t it = {sub, 0, ZMQ_POLLIN, 0};
    while (zmq_poll(&it, 1, ms) > 0) {
        zmq_msg_t m[3];
        int n = 0, more = 1;
        while (more) {
            assert_true(n < 3);
            zmq_msg_init(&m[n]);
            assert_true(zmq_msg_recv(&m[n], sub, 0) >= 0);
            more = zmq_msg_more(&m[n]);
            n++;
        }
        assert_int_equal(n, 3);
        assert_int_equal(zmq_msg_size(&m[1]), 8);
        const unsigned char *sq = zmq_msg_data(&m[1]);
        uint64_t seq = 0;
        for (int i = 0; i < 8; i++)
            seq = seq << 8 | sq[i];
        if (v->next_seq != UINT64_MAX && seq != v->next_seq)
            fail_msg("batch %llu after %llu: a gap", (unsigned long long)seq,
                     (unsigned long long)v->next_seq - 1);
        v->next_seq = seq + 1;
        ev_apply(v, zmq_msg_data(&m[2]), zmq_msg_size(&m[2]));
        for (int i = 0; i < 3; i++)
            zmq_msg_close(&m[i]);
        ms = 0;
    }
}

static uint64_t kvev_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    uint64_t v = kh_stat(fd, "kv_events", key);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

static void *ev_subscribe(void *zctx, const char *ep, const struct kh_proc *d, struct ev_view *v)
{
    void *sub = zmq_socket(zctx, ZMQ_SUB);
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0), 0);
    assert_int_equal(zmq_connect(sub, ep), 0);
    for (int i = 0; kvev_stat(d, "subscribers") < 1; i++) {
        if (i > 1000)
            fail_msg("the daemon never saw the subscription");
        usleep(10000);
    }
    memset(v, 0, sizeof *v);
    v->next_seq = UINT64_MAX;
    return sub;
}

/* Pumps events until the REMOTE set holds at least n blocks and the
 * daemon has reported at least removed REMOTE removals (in events and
 * stats alike), or fails after 30 s. */
static void ev_wait_remote(void *sub, struct ev_view *v, const struct kh_proc *d, size_t n,
                           uint64_t removed)
{
    for (int i = 0; i < 300; i++) {
        ev_pump(sub, v, 100);
        if (v->n[3] >= n && v->removed_remote >= removed &&
            remote_stat(d, "events_removed") == v->removed_remote &&
            remote_stat(d, "events_stored") >= v->n[3] && kvev_stat(d, "queued") == 0)
            return;
    }
    fail_msg("REMOTE: %zu blocks stored and %llu removed in the events, wanted %zu and %llu",
             v->n[3], (unsigned long long)v->removed_remote, n, (unsigned long long)removed);
}

/* REMOTE BlockStored for every block of a value the daemon wrote (the
 * blocks the GPU events named), BlockRemoved when a lookup refuses the
 * value (tampered) and BlockStored again when it is written anew; with a
 * TTL, BlockRemoved when it passes, and Redis has then dropped the keys. */
static void test_remote_events(void **state)
{
    struct fixture *f = *state;
    char ep[160];
    snprintf(ep, sizeof ep, "ipc://%s/ev.sock", f->tmp);
    const char *const conf = "[limits]\nremote = on\nevents = on\n";
    const char *const x1[] = {"--kv-events", ep, "--host-blocks", "0", NULL};
    void *zctx = zmq_ctx_new();
    assert_non_null(zctx);
    struct ev_view *v = calloc(1, sizeof *v);
    assert_non_null(v);
    struct kh_proc a;
    struct kvd_gen_result r1, r2;
    start_ex(&a, f, conf, f->key1, x1);
    void *sub = ev_subscribe(zctx, ep, &a, v);
    gen_ok(&a, f->prompt, &r1);
    wait_written(&a, 1);
    ev_wait_remote(sub, v, &a, full_blocks, 0);
    for (size_t i = 0; i < v->n[3]; i++) {
        bool found = false;
        for (size_t j = 0; j < v->n_seen && !found; j++)
            found = v->seen[j] == v->h[3][i];
        if (!found)
            fail_msg("REMOTE block %zu is not one the cache stored", i);
    }
    size_t stored1 = v->n[3];
    assert_true(remote_stat(&a, "announced") >= 1);

    /* Tampered in Redis and gone locally: the lookup refuses it, the
     * events say REMOTE removed, the recomputed value is written again. */
    tamper_all(f, 5000);
    admin_evict(&a, "device");
    gen_ok(&a, f->prompt, &r2);
    assert_int_equal(r2.cached_tokens, 0);
    expect_same(&r1, &r2);
    assert_true(remote_stat(&a, "auth_failures") >= 1);
    wait_written(&a, 2);
    ev_wait_remote(sub, v, &a, full_blocks, stored1);
    zmq_close(sub);
    assert_int_equal(kh_stop(&a), 0);
    kvd_gen_result_free(&r2);

    /* With a 2 s TTL: removed when it passes. */
    assert_true(redis_srv_cmd_ok(&f->redis, "FLUSHALL"));
    const char *const x2[] = {"--kv-events", ep, "--remote-ttl-s", "2", NULL};
    start_ex(&a, f, conf, f->key1, x2);
    sub = ev_subscribe(zctx, ep, &a, v);
    gen_ok(&a, f->prompt, &r2);
    wait_written(&a, 1);
    ev_wait_remote(sub, v, &a, full_blocks, 0);
    size_t stored2 = v->n[3];
    ev_wait_remote(sub, v, &a, 0, stored2);
    assert_int_equal(v->n[3], 0);
    assert_int_equal(remote_stat(&a, "announced"), 0);
    redisReply *keys = redis_srv_cmd(&f->redis, "KEYS kvd1:*");
    assert_true(keys && keys->type == REDIS_REPLY_ARRAY);
    assert_int_equal(keys->elements, 0); /* Redis expired them too */
    freeReplyObject(keys);
    zmq_close(sub);
    assert_int_equal(kh_stop(&a), 0);
    zmq_ctx_term(zctx);
    free(v);
    kvd_gen_result_free(&r1);
    kvd_gen_result_free(&r2);
}

/* Start-up refusals: a key file others can read, none without insecure. */
static void test_startup_refusals(void **state)
{
    struct fixture *f = *state;
    char loose[160];
    snprintf(loose, sizeof loose, "%s/loose", f->tmp);
    assert_int_equal(write_key(loose, "00112233445566778899aabbccddeeff00112233445566778899aabbcc"
                                      "ddeeff"),
                     0);
    chmod(loose, 0644);
    const char *const a1[] = {"--backend", "cpu",        "--model",           f->model,
                              "--remote",  f->redis.url, "--remote-key-file", loose,
                              NULL};
    struct kh_opts o = {.args = a1};
    assert_int_equal(kh_run(&o), 2);
    const char *const a2[] = {"--backend", "cpu",        "--model", f->model,
                              "--remote",  f->redis.url, NULL};
    o.args = a2;
    assert_int_equal(kh_run(&o), 2);
    const char *const a3[] = {
        "--backend",         "cpu", "--model", f->model, "--remote", "rediss://127.0.0.1:1",
        "--remote-insecure", NULL};
    o.args = a3;
    assert_int_equal(kh_run(&o), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_two_daemons_share, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_tampered_value_refused, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_other_fleet_key_refused, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_tenants_isolated, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_remote_off_writes_nothing, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_startup_refusals, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_remote_events, remote_per_test, remote_per_test_end),
    };
    return cmocka_run_group_tests(tests, remote_setup, remote_teardown);
}

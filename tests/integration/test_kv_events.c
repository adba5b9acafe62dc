/* KV events against a real kvd serving a tiny random model, followed by a
 * subscriber written here with libzmq and msgpack-c's unpacker (nothing of
 * the daemon's encoder): every batch's framing and field types are
 * checked as vLLM's format has them, sequence numbers run without gaps, a
 * replay from an earlier number gives exactly the batches since then and
 * the end marker, each block hash is recomputed from its parent and token
 * ids (SHA-256 over CBOR written here), the blocks the events leave stored
 * per medium are the ones the daemon's stats count for the tenant, a
 * tenant with events off is never reported, AllBlocksCleared comes first
 * and after admin_evict tier "all", and a subscriber that never reads
 * costs the daemon nothing but counted misses. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <msgpack.h>
#include <sodium.h>
#include <zmq.h>

#include "kvd/client.h"
#include "kv_events_fixture.h"
#include "kv_events_sub.h"
#include "kvd_harness.h"

#define BT KVS_BT
#define UID_OFF 60051
#define GID_ALL 65534
#define TOPIC "kvd-test"
#define MAX_SEQ KVS_MAX_SEQ

struct fixture {
    char tmp[64];
    char model[128];
    char ev_ep[160], replay_ep[160];
    void *zctx;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    if (kvf_dir(f->tmp, sizeof f->tmp, "kvd-kvev"))
        return -1;
    snprintf(f->model, sizeof f->model, "%s/m.gguf", f->tmp);
    snprintf(f->ev_ep, sizeof f->ev_ep, "ipc://%s/ev.sock", f->tmp);
    snprintf(f->replay_ep, sizeof f->replay_ep, "ipc://%s/replay.sock", f->tmp);
    if (kvf_model(f->model, 3))
        return -1;
    f->zctx = zmq_ctx_new();
    if (!f->zctx || sodium_init() < 0)
        return -1;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    zmq_ctx_term(f->zctx);
    kvf_rmdir(f->tmp);
    free(f);
    return 0;
}

static const char *const conf_text = "[admin]\nuids = 0\n"
                                     "[tenant:evon]\nuids = 0\nevents = on\n"
                                     "[tenant:evoff]\nuids = 60051\n";

static void start(struct kh_proc *d, const struct fixture *f, const char *hwm, const char *dev,
                  const char *host, const char *sndbuf)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                f->model,
                                "--kv-events",
                                f->ev_ep,
                                "--kv-events-replay",
                                f->replay_ep,
                                "--kv-events-topic",
                                TOPIC,
                                "--kv-events-hwm",
                                hwm,
                                "--device-blocks",
                                dev,
                                "--host-blocks",
                                host,
                                "--socket-group",
                                "nogroup",
                                "--step-tokens",
                                "2048",
                                "--kv-events-sndbuf",
                                sndbuf,
                                NULL};
    struct kh_opts o = {.conf_text = conf_text, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

/* ---- the daemon's side ------------------------------------------------- */

static uint64_t ev_stat(const struct kh_proc *d, const char *key)
{
    return kvs_ev_stat(d, NULL, key);
}

static int generate(const char *sock, const uint32_t *p, size_t n)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err)
        return -1;
    kvd_set_timeout(c, 120000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 4;
    o.temperature = 0;
    struct kvd_gen_result r;
    int rc = kvd_generate(c, p, n, &o, &r);
    if (rc == 0)
        kvd_gen_result_free(&r);
    else
        fprintf(stderr, "generate of %zu tokens: %s: %s\n", n, kvd_err_code(rc), c->errstr);
    kvd_close(c);
    return rc;
}

struct child_arg {
    const char *sock;
    const uint32_t *p;
    size_t n;
};

static int child_gen(void *arg)
{
    struct child_arg *a = arg;
    return generate(a->sock, a->p, a->n) == 0 ? 0 : 2;
}

static void gen_as_off(const struct kh_proc *d, const uint32_t *p, size_t n)
{
    struct child_arg a = {d->sock, p, n};
    pid_t pid = kh_run_as(UID_OFF, GID_ALL, child_gen, &a);
    assert_true(pid > 0);
    assert_int_equal(kh_child_status(pid), 0);
}

static void *subscribe(const struct fixture *f, const struct kh_proc *d, uint64_t want_subs)
{
    void *sub = zmq_socket(f->zctx, ZMQ_SUB);
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, TOPIC, strlen(TOPIC)), 0);
    assert_int_equal(zmq_connect(sub, f->ev_ep), 0);
    /* The daemon counts the subscription once it has it. */
    uint64_t t0 = kvf_now_ms();
    while (ev_stat(d, "subscribers") < want_subs) {
        if (kvf_now_ms() - t0 > 10000)
            fail_msg("the daemon never saw the subscription");
        usleep(2000);
    }
    return sub;
}

static void test_events_follow_the_cache(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    struct kh_proc d;
    start(&d, f, "100000", "48", "24", "0");
    struct kvs_batch *have = calloc(MAX_SEQ, sizeof *have);
    struct kvs_view *v = calloc(1, sizeof *v);
    assert_non_null(have);
    assert_non_null(v);
    void *sub = subscribe(f, &d, 1);

    /* What was sent before we subscribed comes by replay: batch 0, the
     * AllBlocksCleared of the start. */
    uint64_t first, last, n0 = kvs_settle(&d, NULL);
    assert_true(n0 >= 1);
    assert_int_equal(kvs_replay(f->zctx, f->replay_ep, 0, have, &first, &last), n0);
    assert_int_equal(first, 0);
    assert_int_equal(last, n0 - 1);

    /* Work for both tenants: prompts of 20 to 60 blocks on a 48-block
     * device with a 24-block host tier, so blocks are stored, moved to the
     * host and dropped. */
    uint32_t p[1000], q[1000];
    for (uint32_t k = 0; k < 6; k++) {
        size_t n = 320 + 160 * (k % 3);
        kvf_make_prompt(p, n, 1 + k);
        assert_int_equal(generate(d.sock, p, n), 0);
        kvf_make_prompt(q, 400, 50 + k);
        gen_as_off(&d, q, 400);
    }
    /* The first prompt again: a hit, swapped in from the host if it can. */
    kvf_make_prompt(p, 320, 1);
    assert_int_equal(generate(d.sock, p, 320), 0);
    uint64_t n1 = kvs_settle(&d, NULL);
    kvs_collect(sub, TOPIC, have, n1);

    /* A replay from the middle: exactly the batches since then, the same
     * bytes as sent live. */
    uint64_t mid = n0 + (n1 - n0) / 2;
    struct kvs_batch *again = calloc(MAX_SEQ, sizeof *again);
    assert_non_null(again);
    assert_int_equal(kvs_replay(f->zctx, f->replay_ep, mid, again, &first, &last), n1 - mid);
    assert_int_equal(first, mid);
    assert_int_equal(last, n1 - 1);
    for (uint64_t s = mid; s < n1; s++) {
        assert_int_equal(again[s].len, have[s].len);
        assert_memory_equal(again[s].buf, have[s].buf, have[s].len);
    }
    kvs_free_batches(again);

    /* Replayed in order from 0, the events give the daemon's own counts. */
    for (uint64_t s = 0; s < n1; s++)
        kvs_apply(v, have[s].buf, have[s].len);
    assert_int_equal(v->cleared, 1);
    uint64_t dev = kvf_tenant_stat(&d, NULL, "evon", "cached_device");
    uint64_t host = kvf_tenant_stat(&d, NULL, "evon", "cached_host");
    assert_true(dev > 0 && host > 0);
    assert_int_equal(v->n[0], dev);
    assert_int_equal(v->n[1], host);
    assert_int_equal(v->n[2] + v->n[3], 0);
    fprintf(stderr, "kv events: %llu batches; stored now: GPU %zu, CPU %zu\n",
            (unsigned long long)n1, v->n[0], v->n[1]);
    assert_true(kvf_tenant_stat(&d, NULL, "evoff", "cached_blocks") > 0);
    /* A router finds the first prompt's blocks from its tokens alone. */
    uint64_t h = kvs_root_hash();
    for (int b = 0; b < 320 / BT - 1; b++) {
        h = kvs_block_hash(h, p + b * BT);
        bool found = false;
        for (int m = 0; m < 2; m++)
            for (size_t i = 0; i < v->n[m]; i++)
                found |= v->h[m][i] == h;
        if (!found)
            fail_msg("block %d of the repeated prompt is not in the events' view", b);
    }
    /* Nothing of the tenant with events off was ever reported. */
    for (uint32_t k = 0; k < 6; k++) {
        kvf_make_prompt(q, 400, 50 + k);
        h = kvs_block_hash(kvs_root_hash(), q);
        for (size_t i = 0; i < v->n_seen; i++)
            assert_true(v->seen[i] != h);
    }

    /* A malformed replay request (a 3-byte sequence number) is ignored
     * and counted; the socket keeps answering good ones. */
    void *dl = zmq_socket(f->zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(dl, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_connect(dl, f->replay_ep), 0);
    assert_true(zmq_send(dl, "", 0, ZMQ_SNDMORE) == 0);
    assert_true(zmq_send(dl, "abc", 3, 0) == 3);
    uint64_t tb = kvf_now_ms();
    while (ev_stat(&d, "replay_bad") == 0) {
        if (kvf_now_ms() - tb > 10000)
            fail_msg("the malformed replay request was not counted");
        usleep(2000);
    }
    zmq_close(dl);
    assert_int_equal(kvs_replay(f->zctx, f->replay_ep, n1 - 1, NULL, &first, &last), 1);

    /* admin_evict tier "all": AllBlocksCleared, and the daemon agrees. */
    kvf_admin_evict_all(&d, NULL);
    uint64_t n2 = kvs_settle(&d, NULL);
    assert_true(n2 > n1);
    kvs_collect(sub, TOPIC, have, n2);
    for (uint64_t s = n1; s < n2; s++)
        kvs_apply(v, have[s].buf, have[s].len);
    assert_int_equal(v->cleared, 2);
    assert_int_equal(v->n[0] + v->n[1], 0);
    assert_int_equal(kvf_tenant_stat(&d, NULL, "evon", "cached_blocks"), 0);
    assert_true(ev_stat(&d, "replay_requests") >= 2);
    assert_int_equal(ev_stat(&d, "dropped"), 0);

    zmq_close(sub);
    kvs_free_batches(have);
    free(v);
    assert_int_equal(kh_stop(&d), 0);
}

/* A subscriber that never reads, with a high-water mark of 8 batches and
 * a 4 KiB kernel send buffer: the
 * daemon keeps serving (every generate answers), the misses are counted,
 * and a subscriber that reads gets every batch (live, or by replay for
 * what it missed itself). */
static void test_stuck_subscriber(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    struct kh_proc d;
    /* Over TCP loopback, where the send buffer applies (not to ipc). */
    char ev_ep[160], replay_ep[160];
    /* Two ports per pid, so that copies of this test started one after the other (pids n
     * and n + 1) never ask for the same port. */
    int port = 20000 + 2 * (int)(getpid() % 20000);
    memcpy(ev_ep, f->ev_ep, sizeof ev_ep);
    memcpy(replay_ep, f->replay_ep, sizeof replay_ep);
    snprintf(f->ev_ep, sizeof f->ev_ep, "tcp://127.0.0.1:%d", port);
    snprintf(f->replay_ep, sizeof f->replay_ep, "tcp://127.0.0.1:%d", port + 1);
    start(&d, f, "8", "400", "0", "4096");
    void *stuck = zmq_socket(f->zctx, ZMQ_SUB);
    int one = 1, zero = 0, small = 4096;
    zmq_setsockopt(stuck, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(stuck, ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(stuck, ZMQ_RCVBUF, &small, sizeof small);
    assert_int_equal(zmq_setsockopt(stuck, ZMQ_SUBSCRIBE, "", 0), 0);
    assert_int_equal(zmq_connect(stuck, f->ev_ep), 0);
    void *sub = subscribe(f, &d, 2);
    struct kvs_batch *have = calloc(MAX_SEQ, sizeof *have);
    assert_non_null(have);
    uint64_t first, last, n0 = kvs_settle(&d, NULL);
    assert_int_equal(kvs_replay(f->zctx, f->replay_ep, 0, have, &first, &last), n0);

    uint32_t p[2000];
    uint64_t t0 = kvf_now_ms(), k = 0;
    while (ev_stat(&d, "hwm_drops") == 0) {
        if (kvf_now_ms() - t0 > 120000 || k > 300)
            fail_msg("no batch was ever held back by the stuck subscriber (%llu prompts)",
                     (unsigned long long)k);
        kvf_make_prompt(p, 2000, (uint32_t)(1000 + k));
        uint64_t g0 = kvf_now_ms();
        assert_int_equal(generate(d.sock, p, 2000), 0);
        assert_true(kvf_now_ms() - g0 < 30000);
        k++;
        /* The reading subscriber drains as it goes. */
        struct kvs_batch b;
        while (kvs_recv(sub, TOPIC, 0, &b)) {
            assert_true(b.seq < MAX_SEQ);
            free(have[b.seq].buf);
            have[b.seq] = b;
        }
    }
    uint64_t n1 = kvs_settle(&d, NULL);
    assert_true(n1 < MAX_SEQ);
    fprintf(stderr, "stuck subscriber: first miss after %llu prompts (%llu batches)\n",
            (unsigned long long)k, (unsigned long long)n1);
    uint64_t gap = n0;
    while (gap < n1 && have[gap].buf)
        gap++;
    if (gap < n1)
        assert_int_equal(kvs_replay(f->zctx, f->replay_ep, gap, have, &first, &last), n1 - gap);
    kvs_collect(sub, TOPIC, have, n1);
    assert_int_equal(ev_stat(&d, "dropped"), 0);
    zmq_close(stuck);
    zmq_close(sub);
    kvs_free_batches(have);
    assert_int_equal(kh_stop(&d), 0);
    memcpy(f->ev_ep, ev_ep, sizeof ev_ep);
    memcpy(f->replay_ep, replay_ep, sizeof replay_ep);
}

/* With a disk tier: blocks written behind are DISK BlockStored, slots the
 * full tier evicts are DISK BlockRemoved, and the DISK set the events
 * leave is the tier's own count of cached slots. */
static void test_disk_medium(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    char dir[160];
    snprintf(dir, sizeof dir, "%s/disk", f->tmp);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--model",
                                f->model,
                                "--kv-events",
                                f->ev_ep,
                                "--kv-events-replay",
                                f->replay_ep,
                                "--kv-events-topic",
                                TOPIC,
                                "--disk-dir",
                                dir,
                                "--disk-max-bytes",
                                "1M",
                                "--disk-writeback-ms",
                                "20",
                                "--device-blocks",
                                "64",
                                "--host-blocks",
                                "16",
                                NULL};
    struct kh_opts o = {.conf_text = conf_text, .args = args};
    struct kh_proc d;
    memset(&d, 0, sizeof d);
    assert_int_equal(kh_spawn(&d, &o), 0);
    struct kvs_batch *have = calloc(MAX_SEQ, sizeof *have);
    struct kvs_view *v = calloc(1, sizeof *v);
    assert_non_null(have);
    assert_non_null(v);
    void *sub = subscribe(f, &d, 1);
    uint64_t first, last, applied = 0, n = kvs_settle(&d, NULL);
    assert_int_equal(kvs_replay(f->zctx, f->replay_ep, 0, have, &first, &last), n);

    uint32_t p[1000];
    for (uint32_t k = 0; k < 8; k++) {
        kvf_make_prompt(p, 560, 200 + k);
        assert_int_equal(generate(d.sock, p, 560), 0);
    }
    int fd = kh_connect(d.sock);
    assert_true(fd >= 0);
    uint64_t t0 = kvf_now_ms(), cached = 0;
    for (;;) {
        /* A guard against waiting forever, not a timing bound: generous,
         * since each round settles the events of a daemon that may be
         * sharing two cores with several other tests. The daemon is
         * stopped first so that a failure cannot leave it running. */
        if (kvf_now_ms() - t0 > 120000) {
            unsigned long long lost = ev_stat(&d, "dropped");
            kh_stop(&d);
            fail_msg("DISK: the events hold %zu blocks, the tier %llu (%llu events dropped)",
                     v->n[2], (unsigned long long)cached, lost);
        }
        if (kh_stat(fd, "disk", "queued") != 0) {
            usleep(5000);
            continue;
        }
        n = kvs_settle(&d, NULL);
        kvs_collect(sub, TOPIC, have, n);
        for (; applied < n; applied++)
            kvs_apply(v, have[applied].buf, have[applied].len);
        cached = kh_stat(fd, "disk", "cached");
        if (v->n[2] == cached && cached > 0)
            break;
        usleep(5000);
    }
    assert_true(kh_stat(fd, "disk", "evictions") > 0);
    fprintf(stderr, "disk medium: %zu blocks, %llu evictions\n", v->n[2],
            (unsigned long long)kh_stat(fd, "disk", "evictions"));
    close(fd);
    zmq_close(sub);
    kvs_free_batches(have);
    free(v);
    assert_int_equal(kh_stop(&d), 0);
}

/* Bad endpoints and a replay socket without events: exit 2 at start. */
static void test_bad_settings(void **state)
{
    struct fixture *f = *state;
    const char *const a1[] = {"--kv-events", "http://localhost:1", NULL};
    const char *const a2[] = {"--kv-events-replay", f->replay_ep, NULL};
    const char *const a3[] = {"--kv-events", f->ev_ep, "--kv-events-replay", "tcp://", NULL};
    const char *const a4[] = {"--kv-events", "tcp://192.0.2.1:1", NULL}; /* not ours */
    const char *const *args[] = {a1, a2, a3, a4};
    for (size_t i = 0; i < 4; i++) {
        struct kh_opts o = {.args = args[i]};
        assert_int_equal(kh_run(&o), 2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_events_follow_the_cache),
        cmocka_unit_test(test_stuck_subscriber),
        cmocka_unit_test(test_disk_medium),
        cmocka_unit_test(test_bad_settings),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

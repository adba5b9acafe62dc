/* The remote tier against real redis-server processes (tests/support's
 * redis_harness) and real kvd daemons serving a tiny random model: a prompt
 * computed on daemon A is a prefix hit on daemon B, byte-identical; a value
 * tampered in Redis or sealed with another fleet key is refused, counted and
 * recomputed; tenants never restore each other's blocks; a dead or paused
 * Redis only costs recomputation within a bounded time; a tenant with
 * remote off writes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "kvd/client.h"
#include "kvd_harness.h"
#include "redis_harness.h"

#define N_PROMPT 2000
#define BT 16
#define UID_A 60021
#define UID_B 60022
#define UID_C 60023
#define GID_ALL 65534

struct fixture {
    char tmp[64];
    char model[128];
    char key1[128], key2[128];
    uint32_t prompt[N_PROMPT];
    struct redis_srv redis;
};

static const uint64_t full_blocks = (N_PROMPT - 1) / BT;

static int write_key(const char *path, const char *hex)
{
    FILE *fp = fopen(path, "w");
    if (!fp)
        return -1;
    fprintf(fp, "%s\n", hex);
    fclose(fp);
    return chmod(path, 0600);
}

static int setup(void **state)
{
    if (!redis_available()) {
        fprintf(stderr, "redis-server is not installed: skipped\n");
        exit(77);
    }
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->tmp, sizeof f->tmp, "/tmp/kvd-remote.XXXXXX");
    if (!mkdtemp(f->tmp))
        return -1;
    chmod(f->tmp, 0755);
    snprintf(f->model, sizeof f->model, "%s/a.gguf", f->tmp);
    snprintf(f->key1, sizeof f->key1, "%s/key1", f->tmp);
    snprintf(f->key2, sizeof f->key2, "%s/key2", f->tmp);
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 256 --ctx 4096 --seed 1 >/dev/null",
             tools ? tools : ".", f->model);
    if (system(cmd) != 0)
        return -1;
    chmod(f->model, 0644);
    if (write_key(f->key1, "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff") ||
        write_key(f->key2, "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"))
        return -1;
    for (int i = 0; i < N_PROMPT; i++)
        f->prompt[i] = (uint32_t)(i * 37 + 11) % 256;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "teardown: %s failed\n", cmd);
    free(f);
    return 0;
}

/* A fresh, empty Redis for each test. */
static int per_test(void **state)
{
    struct fixture *f = *state;
    return redis_start(&f->redis, "--enable-debug-command yes") == 0 ? 0 : -1;
}

static int per_test_end(void **state)
{
    struct fixture *f = *state;
    redis_stop(&f->redis);
    return 0;
}

static const char *const conf_on = "[limits]\nremote = on\n";
static const char *const conf_tenants = "[admin]\nuids = 0\n"
                                        "[tenant:alpha]\nuids = 60021\nremote = on\n"
                                        "[tenant:beta]\nuids = 60022\nremote = on\n"
                                        "[tenant:gamma]\nuids = 60023\nremote = on\n";

/* A daemon on f's Redis with fleet key `key` (NULL: none, insecure). */
static const char *redis_url; /* NULL: f's single node */

static void start(struct kh_proc *d, const struct fixture *f, const char *conf, const char *key)
{
    const char *args[32];
    int n = 0;
    const char *base[] = {"--backend",
                          "cpu",
                          "--model",
                          f->model,
                          "--remote",
                          f->redis.url,
                          "--remote-min-hits",
                          "0",
                          "--remote-timeout-ms",
                          "200",
                          "--socket-group",
                          "nogroup",
                          "--step-tokens",
                          "2048",
                          NULL};
    for (int i = 0; base[i]; i++)
        args[n++] = base[i];
    if (key) {
        args[n++] = "--remote-key-file";
        args[n++] = key;
    } else {
        args[n++] = "--remote-insecure";
    }
    args[n] = NULL;
    struct kh_opts o = {.conf_text = conf, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

static int generate(const char *sock, const uint32_t *p, size_t n, struct kvd_gen_result *res)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err)
        return -1;
    kvd_set_timeout(c, 120000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 8;
    o.temperature = 0;
    int rc = kvd_generate(c, p, n, &o, res);
    kvd_close(c);
    return rc;
}

static void gen_ok(const struct kh_proc *d, const uint32_t *p, struct kvd_gen_result *res)
{
    if (generate(d->sock, p, N_PROMPT, res) != 0)
        fail_msg("generate failed");
    assert_true(res->n_tokens >= 1 && res->n_tokens <= 8);
}

static uint64_t remote_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    uint64_t v = kh_stat(fd, "remote", key);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

/* Waits until d has written at least n values and has nothing queued. */
static void wait_written(const struct kh_proc *d, uint64_t n)
{
    for (int i = 0; i < 3000; i++) {
        if (remote_stat(d, "writes") >= n && remote_stat(d, "queued") == 0)
            return;
        usleep(10000);
    }
    fail_msg("the remote tier wrote %llu values, not %llu",
             (unsigned long long)remote_stat(d, "writes"), (unsigned long long)n);
}

static void expect_same(const struct kvd_gen_result *a, const struct kvd_gen_result *b)
{
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_memory_equal(a->tokens, b->tokens, a->n_tokens * sizeof(uint32_t));
}

static long long dbsize(const struct fixture *f)
{
    redisReply *r = redis_srv_cmd(&f->redis, "DBSIZE");
    assert_non_null(r);
    long long n = r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    freeReplyObject(r);
    return n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

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

/* A reference answer from a daemon without the remote tier. */
static void reference(const struct fixture *f, const uint32_t *p, struct kvd_gen_result *res)
{
    const char *const args[] = {"--backend",     "cpu",  "--model", f->model,
                                "--step-tokens", "2048", NULL};
    struct kh_proc d;
    assert_int_equal(kh_start(&d, NULL, args), 0);
    gen_ok(&d, p, res);
    assert_int_equal(kh_stop(&d), 0);
}

static void test_redis_dead_or_paused(void **state)
{
    struct fixture *f = *state;
    struct kh_proc a;
    uint32_t p2[N_PROMPT], p3[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) {
        p2[i] = (uint32_t)(i * 53 + 5) % 256;
        p3[i] = (uint32_t)(i * 71 + 9) % 256;
    }
    struct kvd_gen_result r2, r3, g2, g3;
    reference(f, p2, &r2);
    reference(f, p3, &r3);
    start(&a, f, conf_on, f->key1);
    redis_kill(&f->redis);
    double t0 = now_s();
    gen_ok(&a, p2, &g2);
    double dt = now_s() - t0;
    expect_same(&r2, &g2);
    assert_true(dt < 20.0);
    /* The lookup failed: counted; its value could not be written either. */
    for (int i = 0; i < 500 && remote_stat(&a, "errors") < 1; i++)
        usleep(10000);
    assert_true(remote_stat(&a, "errors") >= 1);
    assert_int_equal(remote_stat(&a, "writes"), 0);

    /* Back, but asleep for 10 s: a lookup gives up after the timeout. */
    assert_int_equal(redis_restart(&f->redis), 0);
    usleep(1100000); /* past the tier's one-second rest after a failure */
    void *h = redis_srv_cmd_start(&f->redis, "DEBUG SLEEP 10");
    assert_non_null(h);
    t0 = now_s();
    gen_ok(&a, p3, &g3);
    dt = now_s() - t0;
    expect_same(&r3, &g3);
    assert_true(dt < 8.0);
    assert_true(remote_stat(&a, "timeouts") >= 1);
    redis_cmd_finish(h);
    assert_int_equal(kh_stop(&a), 0);
    kvd_gen_result_free(&r2);
    kvd_gen_result_free(&r3);
    kvd_gen_result_free(&g2);
    kvd_gen_result_free(&g3);
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

/* The same two daemons over a three-node Redis Cluster. */
static void test_two_daemons_cluster(void **state)
{
    struct fixture *f = *state;
    struct redis_cluster c;
    int rc = redis_cluster_start(&c, 3);
    if (rc == REDIS_HARNESS_SKIP)
        skip();
    assert_int_equal(rc, 0);
    struct kh_proc a, b;
    struct kvd_gen_result cold, warm;
    redis_url = c.url;
    start(&a, f, conf_on, f->key1);
    start(&b, f, conf_on, f->key1);
    redis_url = NULL;
    gen_ok(&a, f->prompt, &cold);
    wait_written(&a, 1);
    gen_ok(&b, f->prompt, &warm);
    assert_int_equal(warm.cached_tokens, full_blocks * BT);
    expect_same(&cold, &warm);
    assert_true(remote_stat(&b, "hits") >= full_blocks);
    assert_int_equal(remote_stat(&b, "auth_failures") + remote_stat(&b, "mismatches"), 0);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(kh_stop(&b), 0);
    redis_cluster_stop(&c);
    kvd_gen_result_free(&cold);
    kvd_gen_result_free(&warm);
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
        cmocka_unit_test_setup_teardown(test_two_daemons_share, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_tampered_value_refused, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_other_fleet_key_refused, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_tenants_isolated, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_redis_dead_or_paused, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_remote_off_writes_nothing, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_startup_refusals, per_test, per_test_end),
        cmocka_unit_test_setup_teardown(test_two_daemons_cluster, per_test, per_test_end),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* remote_fixture: the remote tier tests' shared fixture (remote_fixture.h):
 * the model, keys and prompt, a fresh Redis per test, daemons on it, and the
 * calls and stats the tests judge them by. */
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

#include "remote_fixture.h"

const char *const conf_on = "[limits]\nremote = on\n";
const char *const conf_tenants = "[admin]\nuids = 0\n"
                                 "[tenant:alpha]\nuids = 60021\nremote = on\n"
                                 "[tenant:beta]\nuids = 60022\nremote = on\n"
                                 "[tenant:gamma]\nuids = 60023\nremote = on\n";
const char *redis_url;

int write_key(const char *path, const char *hex)
{
    FILE *fp = fopen(path, "w");
    if (!fp)
        return -1;
    fprintf(fp, "%s\n", hex);
    fclose(fp);
    return chmod(path, 0600);
}

int remote_setup(void **state)
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

int remote_teardown(void **state)
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
int remote_per_test(void **state)
{
    struct fixture *f = *state;
    return redis_start(&f->redis, "--enable-debug-command yes") == 0 ? 0 : -1;
}

int remote_per_test_end(void **state)
{
    struct fixture *f = *state;
    redis_stop(&f->redis);
    return 0;
}

void start_ex(struct kh_proc *d, const struct fixture *f, const char *conf, const char *key,
              const char *const *extra)
{
    const char *args[48];
    int n = 0;
    const char *base[] = {"--backend",
                          "cpu",
                          "--model",
                          f->model,
                          "--remote",
                          redis_url ? redis_url : f->redis.url,
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
    for (int i = 0; extra && extra[i] && n < 47; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    struct kh_opts o = {.conf_text = conf, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

void start(struct kh_proc *d, const struct fixture *f, const char *conf, const char *key)
{
    start_ex(d, f, conf, key, NULL);
}

int generate(const char *sock, const uint32_t *p, size_t n, struct kvd_gen_result *res)
{
    struct kvd_ctx *c = kvd_connect(sock);
    if (!c || c->err) {
        kvd_close(c);
        return -1;
    }
    kvd_set_timeout(c, 120000);
    struct kvd_gen_opts o;
    kvd_gen_opts_init(&o);
    o.max_tokens = 8;
    o.temperature = 0;
    int rc = kvd_generate(c, p, n, &o, res);
    kvd_close(c);
    return rc;
}

void gen_ok(const struct kh_proc *d, const uint32_t *p, struct kvd_gen_result *res)
{
    if (generate(d->sock, p, N_PROMPT, res) != 0)
        fail_msg("generate failed");
    assert_true(res->n_tokens >= 1 && res->n_tokens <= 8);
}

void reference(const struct fixture *f, const uint32_t *p, struct kvd_gen_result *res)
{
    const char *const args[] = {"--backend",     "cpu",  "--model", f->model,
                                "--step-tokens", "2048", NULL};
    struct kh_proc d;
    assert_int_equal(kh_start(&d, NULL, args), 0);
    gen_ok(&d, p, res);
    assert_int_equal(kh_stop(&d), 0);
}

void expect_same(const struct kvd_gen_result *a, const struct kvd_gen_result *b)
{
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_memory_equal(a->tokens, b->tokens, a->n_tokens * sizeof(uint32_t));
}

uint64_t remote_stat(const struct kh_proc *d, const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    uint64_t v = kh_stat(fd, "remote", key);
    close(fd);
    assert_true(v != UINT64_MAX);
    return v;
}

void remote_state(const struct kh_proc *d, char *st, size_t cap)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", 1, &r), 0);
    const msgpack_object *s = kh_obj(kh_obj(r.root, "remote"), "state");
    assert_true(s && s->type == MSGPACK_OBJECT_STR && s->via.str.size < cap);
    memcpy(st, s->via.str.ptr, s->via.str.size);
    st[s->via.str.size] = 0;
    kh_reply_free(&r);
    close(fd);
}

void wait_up(const struct kh_proc *d)
{
    char st[16];
    for (int i = 0; i < 1000; i++) {
        remote_state(d, st, sizeof st);
        if (strcmp(st, "up") == 0) {
            assert_int_equal(remote_stat(d, "retry_in_ms"), 0);
            return;
        }
        assert_string_equal(st, "backoff");
        assert_true(remote_stat(d, "retry_in_ms") <= 1000);
        usleep(10000);
    }
    fail_msg("the remote tier stayed in back-off for 10 s");
}

void wait_written(const struct kh_proc *d, uint64_t n)
{
    for (int i = 0; i < 3000; i++) {
        if (remote_stat(d, "writes") >= n && remote_stat(d, "queued") == 0)
            return;
        usleep(10000);
    }
    fail_msg("the remote tier wrote %llu values, not %llu",
             (unsigned long long)remote_stat(d, "writes"), (unsigned long long)n);
}

void admin_evict(const struct kh_proc *d, const char *tier)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "admin_evict", 7, 2);
    assert_int_equal(proto_pack_kv_str(&q.pk, "tier", tier), 0);
    assert_int_equal(proto_pack_kv_uint(&q.pk, "n", 1000000), 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    close(fd);
}

long long dbsize(const struct fixture *f)
{
    redisReply *r = redis_srv_cmd(&f->redis, "DBSIZE");
    assert_non_null(r);
    long long n = r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    freeReplyObject(r);
    return n;
}

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

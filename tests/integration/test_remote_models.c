/* The remote tier of a daemon serving two models, with a real redis-server
 * and real ZeroMQ subscribers: each model's REMOTE values are announced on
 * that model's KV events stream only (exactly the values that model wrote,
 * as its stats and Redis count them); a second daemon on the same Redis
 * restores each model's prompts for that model, and a model of the same
 * shapes with other weights finds nothing; admin_evict tier "all" of one
 * model clears that model's stream and announced values alone, and later
 * removals and stores are still reported on the right stream. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>
#include <sodium.h>
#include <zmq.h>

#include "kv_events_fixture.h"
#include "kv_events_sub.h"
#include "kvd_harness.h"
#include "redis_harness.h"
#include "two_models.h"

#define N_P 193 /* 12 whole blocks and one token: one value per prompt */
#define N_GEN 4 /* stays inside the 13th block: no block completed */
#define NB ((N_P - 1) / KVS_BT)

static const char *const names[2] = {"alpha", "beta"};

struct fixture {
    char dir[64];
    char model[2][128]; /* two_models_make's a (llama, f32) and b (qwen2, f16) */
    char other[128];    /* a's shapes, other weights */
    char key[128];      /* the fleet key file */
    struct redis_srv redis;
    void *zctx;
    struct kvs_stream s[2]; /* each model's stream on daemon A */
    struct kh_proc a, b;    /* pid 0: not running */
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    if (!f || !tools) {
        free(f);
        return -1;
    }
    f->redis.pid = -1;
    *state = f; /* the teardown cleans up after a setup that fails past here */
    if (two_models_make("/tmp/kvd-rmodels.XXXXXX", f->dir, f->model[0], f->model[1]) != 0)
        return -1;
    snprintf(f->other, sizeof f->other, "%s/c.gguf", f->dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --arch llama --layers 2 --embd 128 --heads 4 --kv-heads 2 "
             "--ff 256 --vocab 500 --ctx 256 --type f32 --seed 5 >/dev/null",
             tools, f->other);
    if (system(cmd) != 0)
        return -1;
    /* a fleet key: 32 random bytes as 64 hex characters, mode 0600 */
    if (sodium_init() < 0)
        return -1;
    unsigned char raw[32];
    char hex[65];
    randombytes_buf(raw, sizeof raw);
    sodium_bin2hex(hex, sizeof hex, raw, sizeof raw);
    snprintf(f->key, sizeof f->key, "%s/fleet.key", f->dir);
    FILE *k = fopen(f->key, "w");
    if (!k || fprintf(k, "%s\n", hex) < 0 || fclose(k) != 0 || chmod(f->key, 0600) != 0)
        return -1;
    f->zctx = zmq_ctx_new();
    if (!f->zctx)
        return -1;
    /* formatted from a local copy: GCC -O1 cannot tell that f->dir does not
     * overlap the streams' fields (-Wrestrict) */
    char dir[sizeof f->dir];
    memcpy(dir, f->dir, sizeof dir);
    for (int i = 0; i < 2; i++) {
        struct kvs_stream *s = &f->s[i];
        s->zctx = f->zctx;
        snprintf(s->ev, sizeof s->ev, "ipc://%s/ev-%s.sock", dir, names[i]);
        snprintf(s->replay, sizeof s->replay, "ipc://%s/replay-%s.sock", dir, names[i]);
        snprintf(s->topic, sizeof s->topic, "kv@node@%s", names[i]);
        snprintf(s->model, sizeof s->model, "%s", names[i]);
    }
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[256];
    if (!f)
        return 0;
    for (int i = 0; i < 2; i++)
        kvs_stream_close(&f->s[i]);
    if (f->a.pid > 0) /* a test failed with its daemons running */
        kh_stop(&f->a);
    if (f->b.pid > 0)
        kh_stop(&f->b);
    redis_stop(&f->redis);
    if (f->zctx)
        zmq_ctx_term(f->zctx);
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    if (system(cmd) != 0)
        return -1;
    free(f);
    return 0;
}

/* ---- requests and stats -------------------------------------------------- */

static uint64_t rstat(const struct kh_proc *d, const char *model, const char *key)
{
    return tm_model_stat(d, model, "remote", key);
}

/* admin_evict of model's blocks in tier ("device", "host", "all"). */
static void admin_evict(const struct kh_proc *d, const char *model, const char *tier)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "admin_evict", 5, 2);
    assert_int_equal(proto_pack_kv_str(&q.pk, "tier", tier), 0);
    assert_int_equal(proto_pack_kv_str(&q.pk, "model", model), 0);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    close(fd);
}

/* Waits until model's remote tier has written `writes` values and
 * announced `stored` and removed `removed` blocks in all, nothing queued;
 * then those counts must be exact. */
static void wait_remote(const struct kh_proc *d, const char *model, uint64_t writes,
                        uint64_t stored, uint64_t removed)
{
    uint64_t t0 = kvf_now_ms(), w, s, x, q;
    for (;;) {
        w = rstat(d, model, "writes");
        s = rstat(d, model, "events_stored");
        x = rstat(d, model, "events_removed");
        q = rstat(d, model, "queued");
        if (w >= writes && s >= stored && x >= removed && q == 0)
            break;
        if (kvf_now_ms() - t0 > 30000)
            fail_msg("model %s: %llu writes, %llu blocks announced, %llu removed; wanted %llu, "
                     "%llu, %llu",
                     model, (unsigned long long)w, (unsigned long long)s, (unsigned long long)x,
                     (unsigned long long)writes, (unsigned long long)stored,
                     (unsigned long long)removed);
        usleep(10000);
    }
    assert_int_equal(w, writes);
    assert_int_equal(s, stored);
    assert_int_equal(x, removed);
    assert_int_equal(rstat(d, model, "write_skips"), 0);
    assert_int_equal(rstat(d, model, "errors"), 0);
}

static long long dbsize(const struct fixture *f)
{
    redisReply *r = redis_srv_cmd(&f->redis, "DBSIZE");
    assert_true(r && r->type == REDIS_REPLY_INTEGER);
    long long n = r->integer;
    freeReplyObject(r);
    return n;
}

/* ---- prompts and their published hashes ---------------------------------- */

static void make_prompt(uint32_t *p, uint32_t salt)
{
    uint64_t x = 0x9e3779b97f4a7c15ull * (salt + 1);
    for (size_t i = 0; i < N_P; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = 1 + (uint32_t)(x % 499); /* inside both vocabularies */
    }
}

/* The published hashes of the prompt's NB whole blocks. */
static void chain_hashes(const uint32_t *p, uint64_t *h)
{
    uint64_t parent = kvs_root_hash();
    for (size_t i = 0; i < NB; i++)
        h[i] = parent = kvs_block_hash(parent, p + i * KVS_BT);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The stream's REMOTE set is exactly the whole blocks of the n prompts. */
static void expect_remote_set(const struct kvs_view *v, const char *model, uint32_t *const *ps,
                              size_t n)
{
    uint64_t want[4 * NB], got[KVS_MAX_BLOCKS];
    assert_true(n <= 4);
    for (size_t i = 0; i < n; i++)
        chain_hashes(ps[i], want + i * NB);
    memcpy(got, v->h[3], v->n[3] * sizeof *got);
    qsort(want, n * NB, sizeof *want, cmp_u64);
    qsort(got, v->n[3], sizeof *got, cmp_u64);
    if (v->n[3] != n * NB || memcmp(want, got, v->n[3] * sizeof *got))
        fail_msg("model %s: the stream's REMOTE set has %zu blocks, not the %zu of its prompts",
                 model, v->n[3], n * NB);
}

/* ---- one stream per model ------------------------------------------------ */

/* The removals since `from` are exactly the prompt's whole blocks. */
static void expect_removed(const struct kvs_stream *s, size_t from, const char *model,
                           const uint32_t *p)
{
    uint64_t want[NB], got[NB];
    if (s->n_removed - from != NB)
        fail_msg("model %s: %zu REMOTE blocks removed, wanted %d", model, s->n_removed - from, NB);
    chain_hashes(p, want);
    memcpy(got, s->removed + from, sizeof got);
    qsort(want, NB, sizeof *want, cmp_u64);
    qsort(got, NB, sizeof *got, cmp_u64);
    assert_memory_equal(want, got, sizeof want);
}

/* ---- the daemons ---------------------------------------------------------- */

static const char *const tenant = "[admin]\nuids = 0\n"
                                  "[tenant:fleet]\nuids = 0\nremote = on\nevents = on\n";

/* A daemon on the fixture's Redis and fleet key, with conf's models; with
 * events, alpha's stream is the [server] one (kv@node@{model} topics). */
static void spawn(struct fixture *f, struct kh_proc *d, const char *conf, bool events)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--remote",
                                f->redis.url,
                                "--remote-key-file",
                                f->key,
                                "--remote-min-hits",
                                "0",
                                "--remote-timeout-ms",
                                "5000",
                                events ? "--kv-events" : NULL,
                                f->s[0].ev,
                                "--kv-events-replay",
                                f->s[0].replay,
                                "--kv-events-topic",
                                "kv@node@{model}",
                                NULL};
    struct kh_opts o = {.conf_text = conf, .args = args};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
}

/* Daemon A: alpha and beta, each with its own stream (beta's in its
 * [model:] section). */
static void start_a(struct fixture *f)
{
    static char conf[2048];
    snprintf(conf, sizeof conf,
             "%s[model:alpha]\npath = %s\npreload = yes\nkeep-alive-s = forever\n"
             "[model:beta]\npath = %s\npreload = yes\nkeep-alive-s = forever\n"
             "kv-events = %s\nkv-events-replay = %s\n",
             tenant, f->model[0], f->model[1], f->s[1].ev, f->s[1].replay);
    spawn(f, &f->a, conf, true);
}

/* Daemon B: the same two model files under the same names and a third of
 * alpha's shapes with other weights; no events. */
static void start_b(struct fixture *f)
{
    static char conf[2048];
    snprintf(conf, sizeof conf,
             "%s[model:alpha]\npath = %s\npreload = yes\nkeep-alive-s = forever\n"
             "[model:beta]\npath = %s\npreload = yes\nkeep-alive-s = forever\n"
             "[model:gamma]\npath = %s\npreload = yes\nkeep-alive-s = forever\n",
             tenant, f->model[0], f->model[1], f->other);
    spawn(f, &f->b, conf, false);
}

static void test_remote_per_model(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(redis_start(&f->redis, NULL), 0);
    start_a(f);
    struct kvs_stream *s = f->s;
    for (int i = 0; i < 2; i++)
        kvs_stream_open(&s[i], &f->a);

    /* P[0] on alpha only, P[1] on beta only, P[2] on both: a value each. */
    static uint32_t p[4][N_P];
    for (uint32_t i = 0; i < 4; i++)
        make_prompt(p[i], i);
    struct tm_gen g[2][4], x;
    tm_generate(&f->a, "alpha", p[0], N_P, N_GEN, &g[0][0]);
    tm_generate(&f->a, "alpha", p[2], N_P, N_GEN, &g[0][2]);
    tm_generate(&f->a, "beta", p[1], N_P, N_GEN, &g[1][1]);
    tm_generate(&f->a, "beta", p[2], N_P, N_GEN, &g[1][2]);
    for (int i = 0; i < 2; i++) {
        wait_remote(&f->a, names[i], 2, 2 * NB, 0);
        assert_int_equal(rstat(&f->a, names[i], "announced"), 2);
        kvs_stream_catch_up(&s[i], &f->a);
        assert_int_equal(s[i].v->cleared, 1); /* the start's */
    }
    /* Each stream's REMOTE set: its model's values, never the other's; the
     * prompt both computed is two values in Redis, one per model. */
    expect_remote_set(s[0].v, "alpha", (uint32_t *[]){p[0], p[2]}, 2);
    expect_remote_set(s[1].v, "beta", (uint32_t *[]){p[1], p[2]}, 2);
    assert_int_equal(dbsize(f), 4);
    assert_memory_not_equal(g[0][2].toks, g[1][2].toks, sizeof g[0][2].toks);

    /* Daemon B, same Redis, same files: its first request on each model
     * restores the whole blocks and gives the same tokens; gamma (alpha's
     * shapes, other weights) finds nothing of alpha's. */
    start_b(f);
    const int pm[4][2] = {{0, 0}, {0, 2}, {1, 1}, {1, 2}}; /* model, prompt */
    for (int i = 0; i < 4; i++) {
        tm_generate(&f->b, names[pm[i][0]], p[pm[i][1]], N_P, N_GEN, &x);
        assert_int_equal(x.cached, (uint64_t)NB * KVS_BT);
        tm_same_tokens(&x, &g[pm[i][0]][pm[i][1]]);
    }
    for (int i = 0; i < 2; i++) {
        assert_int_equal(rstat(&f->b, names[i], "hits"), 2 * NB);
        assert_int_equal(rstat(&f->b, names[i], "auth_failures"), 0);
        assert_int_equal(rstat(&f->b, names[i], "mismatches"), 0);
    }
    long long before = dbsize(f);
    tm_generate(&f->b, "gamma", p[0], N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    assert_int_equal(rstat(&f->b, "gamma", "hits"), 0);
    assert_int_equal(rstat(&f->b, "gamma", "auth_failures"), 0);
    assert_int_equal(rstat(&f->b, "gamma", "mismatches"), 0);
    wait_remote(&f->b, "gamma", 1, 0, 0); /* its own value, under its own key */
    assert_int_equal(dbsize(f), before + 1);
    assert_int_equal(kh_stop(&f->b), 0);
    f->b.pid = 0;

    /* admin_evict tier "all" of alpha: AllBlocksCleared on alpha's stream
     * alone; beta's stream and announced values as they were. */
    for (int i = 0; i < 2; i++)
        kvs_stream_catch_up(&s[i], &f->a);
    uint64_t beta_seq = s[1].applied;
    admin_evict(&f->a, "alpha", "all");
    for (int i = 0; i < 2; i++)
        kvs_stream_catch_up(&s[i], &f->a);
    assert_int_equal(s[0].v->cleared, 2);
    assert_int_equal(s[0].v->n[0] + s[0].v->n[1] + s[0].v->n[3], 0);
    assert_int_equal(rstat(&f->a, "alpha", "announced"), 0);
    assert_int_equal(s[1].v->cleared, 1);
    assert_int_equal(s[1].applied, beta_seq); /* not a batch on beta's */
    assert_int_equal(rstat(&f->a, "beta", "announced"), 2);
    expect_remote_set(s[1].v, "beta", (uint32_t *[]){p[1], p[2]}, 2);

    /* A later store on alpha: a new prompt's value, on alpha's stream. */
    tm_generate(&f->a, "alpha", p[3], N_P, N_GEN, &x);
    wait_remote(&f->a, "alpha", 3, 3 * NB, 0);
    for (int i = 0; i < 2; i++)
        kvs_stream_catch_up(&s[i], &f->a);
    expect_remote_set(s[0].v, "alpha", (uint32_t *[]){p[3]}, 1);
    expect_remote_set(s[1].v, "beta", (uint32_t *[]){p[1], p[2]}, 2);

    /* Later removals: Redis emptied, and each model's prompt asked again
     * with its blocks gone locally: the lookup finds the value missing,
     * BlockRemoved REMOTE on that model's stream only, and the recomputed
     * value is written and announced again. Alpha's p[0] value was
     * forgotten at the clear: its loss says nothing, its new value is
     * announced. */
    assert_true(redis_srv_cmd_ok(&f->redis, "FLUSHALL"));
    size_t r0 = s[0].n_removed, r1 = s[1].n_removed;
    admin_evict(&f->a, "beta", "device");
    admin_evict(&f->a, "beta", "host");
    tm_generate(&f->a, "beta", p[1], N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    tm_same_tokens(&x, &g[1][1]);
    wait_remote(&f->a, "beta", 3, 3 * NB, NB);
    for (int i = 0; i < 2; i++)
        kvs_stream_catch_up(&s[i], &f->a);
    expect_removed(&s[1], r1, "beta", p[1]);
    assert_int_equal(s[0].n_removed, r0);
    expect_remote_set(s[1].v, "beta", (uint32_t *[]){p[1], p[2]}, 2);
    expect_remote_set(s[0].v, "alpha", (uint32_t *[]){p[3]}, 1);

    r1 = s[1].n_removed;
    admin_evict(&f->a, "alpha", "device");
    admin_evict(&f->a, "alpha", "host");
    tm_generate(&f->a, "alpha", p[3], N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    tm_generate(&f->a, "alpha", p[0], N_P, N_GEN, &x);
    assert_int_equal(x.cached, 0);
    tm_same_tokens(&x, &g[0][0]);
    wait_remote(&f->a, "alpha", 5, 5 * NB, NB);
    for (int i = 0; i < 2; i++)
        kvs_stream_catch_up(&s[i], &f->a);
    expect_removed(&s[0], r0, "alpha", p[3]);
    assert_int_equal(s[1].n_removed, r1);
    expect_remote_set(s[0].v, "alpha", (uint32_t *[]){p[3], p[0]}, 2);
    expect_remote_set(s[1].v, "beta", (uint32_t *[]){p[1], p[2]}, 2);
    assert_int_equal(dbsize(f), 3); /* beta's p[1], alpha's p[3] and p[0] */
    assert_int_equal(rstat(&f->a, "alpha", "announced"), 2);
    assert_int_equal(rstat(&f->a, "beta", "announced"), 2);

    for (int i = 0; i < 2; i++)
        kvs_stream_close(&s[i]);
    assert_int_equal(kh_stop(&f->a), 0);
    f->a.pid = 0;
    redis_stop(&f->redis);
}

int main(void)
{
    if (!redis_available()) { /* ctest's SKIP_RETURN_CODE */
        fprintf(stderr, "redis-server is not installed: skipped\n");
        return REDIS_HARNESS_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_remote_per_model),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* KV events of a daemon serving two models: each model's blocks go on its
 * own stream ([server] kv-events for the first, [model:NAME] kv-events for
 * the other), with its own topic ({model} in kv-events-topic), sequence
 * numbers from 0 without gaps, and replay socket. An independent
 * subscriber (kv_events_sub.c) per stream rebuilds each model's block set
 * and finds it equal to the daemon's stats for that model, through a
 * model loaded at its first request and unloaded when idle (its blocks
 * move from GPU to CPU on its stream only); admin_evict tier "all" of one
 * model clears that stream alone; a tenant with events = hashes is
 * published without token ids and one with events off not at all. In
 * connect mode (a router's one bound SUB socket, as llm-d's indexer runs)
 * both streams arrive on one socket, told apart by topic, each with its
 * own sequence. */
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

#include "kv_events_fixture.h"
#include "kv_events_sub.h"
#include "kvd_harness.h"

#define UID_OFF 60051
#define UID_HASH 60052
#define GID_ALL 65534

static const char *const names[2] = {"alpha", "beta"};

struct fixture {
    char tmp[64];
    char model[2][128];
    char ev[2][160], replay[2][160], topic[2][64];
    void *zctx;
    void *socks[4];   /* open sockets, closed by teardown after a failure */
    struct kh_proc d; /* the daemon of the test running (pid 0: none) */
};

static struct fixture *g_f;

static void *sock_new(int type)
{
    for (int i = 0; i < 4; i++)
        if (!g_f->socks[i]) {
            g_f->socks[i] = zmq_socket(g_f->zctx, type);
            assert_non_null(g_f->socks[i]);
            int zero = 0;
            zmq_setsockopt(g_f->socks[i], ZMQ_LINGER, &zero, sizeof zero);
            return g_f->socks[i];
        }
    fail_msg("more than 4 sockets");
    return NULL;
}

static void sock_close(void *s)
{
    for (int i = 0; i < 4; i++)
        if (g_f->socks[i] == s)
            g_f->socks[i] = NULL;
    zmq_close(s);
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    /* the paths are formatted from a local copy: GCC -O1 cannot tell that
     * f->tmp does not overlap the fields written (-Wrestrict) */
    char tmp[sizeof f->tmp];
    if (kvf_dir(tmp, sizeof tmp, "kvd-kvevm"))
        return -1;
    memcpy(f->tmp, tmp, sizeof tmp);
    for (int i = 0; i < 2; i++) {
        snprintf(f->model[i], sizeof f->model[i], "%s/%s.gguf", tmp, names[i]);
        snprintf(f->ev[i], sizeof f->ev[i], "ipc://%s/ev-%s.sock", tmp, names[i]);
        snprintf(f->replay[i], sizeof f->replay[i], "ipc://%s/replay-%s.sock", tmp, names[i]);
        snprintf(f->topic[i], sizeof f->topic[i], "kv@pod1@%s", names[i]);
        if (kvf_model(f->model[i], 3 + i))
            return -1;
    }
    f->zctx = zmq_ctx_new();
    if (!f->zctx || sodium_init() < 0)
        return -1;
    *state = g_f = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    for (int i = 0; i < 4; i++)
        if (f->socks[i])
            zmq_close(f->socks[i]);
    if (f->d.pid > 0) /* a test failed with its daemon running */
        kh_stop(&f->d);
    zmq_ctx_term(f->zctx);
    kvf_rmdir(f->tmp);
    free(f);
    return 0;
}

/* The config: alpha preloaded, beta loaded at its first request and
 * unloaded after 1 s idle, with its own stream; extra: more [server] or
 * [model:beta] lines. */
static void write_conf(const struct fixture *f, char *out, size_t cap, bool connect)
{
    snprintf(out, cap,
             "[admin]\nuids = 0\n"
             "[tenant:evon]\nuids = 0\nevents = on\n"
             "[tenant:evhash]\nuids = %d\nevents = hashes\n"
             "[tenant:evoff]\nuids = %d\n"
             "[model:alpha]\npath = %s\npreload = yes\nkeep-alive-s = forever\n"
             "[model:beta]\npath = %s\nkeep-alive-s = 1\n%s%s\nkv-events-replay = %s\n",
             UID_HASH, UID_OFF, f->model[0], f->model[1],
             connect ? "" : "kv-events = ", connect ? "" : f->ev[1], f->replay[1]);
}

/* ---- requests ------------------------------------------------------------ */

static int gen_model(const char *sock, const char *model, const uint32_t *p, size_t n)
{
    int fd = kh_connect(sock);
    if (fd < 0)
        return -1;
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", 7, 4);
    proto_pack_kv_str(&q.pk, "model", model);
    proto_pack_kv_u32_array(&q.pk, "tokens", p, n);
    proto_pack_kv_uint(&q.pk, "max_tokens", 2);
    proto_pack_kv_double(&q.pk, "temperature", 0.0);
    int rc = kh_req_send(fd, &q) == 0 && kh_recv(fd, &r) == 0 ? 0 : -1;
    if (rc == 0) {
        rc = r.code;
        if (rc)
            fprintf(stderr, "generate on %s: %d %s\n", model, r.code, r.message);
        kh_reply_free(&r);
    }
    close(fd);
    return rc;
}

struct child_arg {
    const char *sock, *model;
    const uint32_t *p;
    size_t n;
};

static int child_gen(void *arg)
{
    struct child_arg *a = arg;
    return gen_model(a->sock, a->model, a->p, a->n) == 0 ? 0 : 2;
}

static void gen_as(const struct kh_proc *d, uid_t uid, const char *model, const uint32_t *p,
                   size_t n)
{
    struct child_arg a = {d->sock, model, p, n};
    pid_t pid = kh_run_as(uid, GID_ALL, child_gen, &a);
    assert_true(pid > 0);
    assert_int_equal(kh_child_status(pid), 0);
}

/* stats models[model][key] (or [model].kv_events[key] when sub). */
static uint64_t model_stat(const struct kh_proc *d, const char *model, const char *sub,
                           const char *key)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    uint64_t v = UINT64_MAX;
    assert_int_equal(kh_call0(fd, "stats", 3, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i], *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(model) && !memcmp(nm->via.str.ptr, model, nm->via.str.size))
            v = kh_u64(sub ? kh_obj(e, sub) : e, key);
    }
    kh_reply_free(&r);
    close(fd);
    return v;
}

static void model_state(const struct kh_proc *d, const char *name, char *out, size_t cap)
{
    int fd = kh_connect(d->sock);
    assert_true(fd >= 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 4, &r), 0);
    const msgpack_object *m = kh_obj(r.root, "models");
    out[0] = '\0';
    for (uint32_t i = 0; i < m->via.array.size; i++) {
        const msgpack_object *e = &m->via.array.ptr[i], *nm = kh_obj(e, "name");
        if (nm->via.str.size == strlen(name) && !memcmp(nm->via.str.ptr, name, nm->via.str.size)) {
            const msgpack_object *st = kh_obj(e, "state");
            snprintf(out, cap, "%.*s", (int)st->via.str.size, st->via.str.ptr);
        }
    }
    kh_reply_free(&r);
    close(fd);
}

/* Whether h is among n hashes. */
static bool has(const uint64_t *v, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++)
        if (v[i] == h)
            return true;
    return false;
}

/* ---- one stream per model, bound ---------------------------------------- */

struct stream {
    void *sub;
    struct kvs_batch *have;
    struct kvs_view *v;
    uint64_t applied;
};

static void stream_open(const struct fixture *f, const struct kh_proc *d, int i, struct stream *s)
{
    memset(s, 0, sizeof *s);
    s->have = calloc(KVS_MAX_SEQ, sizeof *s->have);
    s->v = calloc(1, sizeof *s->v);
    assert_non_null(s->have);
    assert_non_null(s->v);
    s->sub = sock_new(ZMQ_SUB);
    /* llm-d subscribes to "kv@": the topic says pod and model */
    assert_int_equal(zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "kv@", 3), 0);
    assert_int_equal(zmq_connect(s->sub, f->ev[i]), 0);
    uint64_t t0 = kvf_now_ms();
    while (kvs_ev_stat(d, names[i], "subscribers") < 1) {
        if (kvf_now_ms() - t0 > 10000)
            fail_msg("model %s's stream never saw the subscription", names[i]);
        usleep(2000);
    }
}

/* Everything model i's stream sent until now, live or by replay, applied
 * in order. */
static void stream_catch_up(const struct fixture *f, const struct kh_proc *d, int i,
                            struct stream *s)
{
    uint64_t n = kvs_settle(d, names[i]), first, last;
    /* what was sent before the subscription: by replay */
    if (!s->have[0].buf)
        assert_true(kvs_replay(f->zctx, f->replay[i], 0, s->have, &first, &last) >= 1);
    kvs_collect(s->sub, f->topic[i], s->have, n);
    for (; s->applied < n; s->applied++)
        kvs_apply(s->v, s->have[s->applied].buf, s->have[s->applied].len);
}

static void stream_close(struct stream *s)
{
    sock_close(s->sub);
    kvs_free_batches(s->have);
    free(s->v);
}

/* The events' GPU and CPU sets of model i are the daemon's counts of the
 * tenants with events for that model. */
static void check_counts(const struct kh_proc *d, int i, const struct stream *s)
{
    uint64_t dev = kvf_tenant_stat(d, names[i], "evon", "cached_device") +
                   kvf_tenant_stat(d, names[i], "evhash", "cached_device");
    uint64_t host = kvf_tenant_stat(d, names[i], "evon", "cached_host") +
                    kvf_tenant_stat(d, names[i], "evhash", "cached_host");
    fprintf(stderr, "model %s: events GPU %zu CPU %zu, stats device %llu host %llu\n", names[i],
            s->v->n[0], s->v->n[1], (unsigned long long)dev, (unsigned long long)host);
    assert_int_equal(s->v->n[0], dev);
    assert_int_equal(s->v->n[1], host);
    assert_int_equal(s->v->n[2] + s->v->n[3], 0);
}

static void test_stream_per_model(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    static char conf[4096];
    write_conf(f, conf, sizeof conf, false);
    char msock[160], metrics_arg[200];
    snprintf(msock, sizeof msock, "%s/metrics.sock", f->tmp);
    snprintf(metrics_arg, sizeof metrics_arg, "unix:%s", msock);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--metrics",
                                metrics_arg,
                                "--kv-events",
                                f->ev[0],
                                "--kv-events-replay",
                                f->replay[0],
                                "--kv-events-topic",
                                "kv@pod1@{model}",
                                "--device-blocks",
                                "48",
                                "--host-blocks",
                                "64",
                                "--socket-group",
                                "nogroup",
                                "--step-tokens",
                                "2048",
                                NULL};
    struct kh_opts o = {.conf_text = conf, .args = args};
    struct kh_proc *d = &f->d;
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
    struct stream s[2];
    for (int i = 0; i < 2; i++)
        stream_open(f, d, i, &s[i]);
    char st[32];
    model_state(d, "beta", st, sizeof st);
    assert_string_equal(st, "unloaded"); /* loaded at its first request */

    /* Each tenant on each model, with prompts of its own: salt 10 * model +
     * tenant (on, hashes, off). */
    uint32_t p[3][2][640];
    for (int m = 0; m < 2; m++)
        for (int t = 0; t < 3; t++) {
            kvf_make_prompt(p[t][m], 320 + 160 * (size_t)t, (uint32_t)(10 * m + t + 1));
            size_t n = 320 + 160 * (size_t)t;
            if (t == 0)
                assert_int_equal(gen_model(d->sock, names[m], p[t][m], n), 0);
            else
                gen_as(d, t == 1 ? UID_HASH : UID_OFF, names[m], p[t][m], n);
        }
    for (int i = 0; i < 2; i++) {
        stream_catch_up(f, d, i, &s[i]);
        assert_int_equal(s[i].v->cleared, 1); /* the start's, on each stream */
    }
    /* beta idles past its keep-alive and unloads: its device blocks move to
     * its host tier, which its stream says and alpha's does not. */
    uint64_t t0 = kvf_now_ms();
    do {
        if (kvf_now_ms() - t0 > 30000)
            fail_msg("beta did not unload after its keep-alive");
        usleep(20000);
        model_state(d, "beta", st, sizeof st);
    } while (strcmp(st, "unloaded"));
    assert_true(model_stat(d, "beta", NULL, "moved_at_unload") > 0);
    for (int i = 0; i < 2; i++) {
        stream_catch_up(f, d, i, &s[i]);
        check_counts(d, i, &s[i]);
    }
    assert_int_equal(s[1].v->n[0], 0); /* beta: nothing on the device now */
    assert_true(s[1].v->n[1] > 0);
    /* the models' stats show each stream, and so do the metrics */
    for (int i = 0; i < 2; i++)
        assert_int_equal(model_stat(d, names[i], "kv_events", "next_seq"), s[i].applied);
    if (system("curl --version >/dev/null 2>&1") == 0) {
        char cmd[512], want[128];
        static char out[1 << 18];
        snprintf(cmd, sizeof cmd, "curl -sS --unix-socket %s http://localhost/metrics", msock);
        FILE *pp = popen(cmd, "r");
        assert_non_null(pp);
        size_t n = fread(out, 1, sizeof out - 1, pp);
        pclose(pp);
        out[n] = '\0';
        for (int i = 0; i < 2; i++) {
            snprintf(want, sizeof want, "kvd_kv_events_batches_total{model=\"%s\"} %llu\n",
                     names[i], (unsigned long long)s[i].applied);
            assert_non_null(strstr(out, want));
            snprintf(want, sizeof want, "kvd_kv_events_subscribers{model=\"%s\"} 1\n", names[i]);
            assert_non_null(strstr(out, want));
            snprintf(want, sizeof want,
                     "kvd_kv_events_dropped_total{model=\"%s\",reason=\"queue\"} 0\n", names[i]);
            assert_non_null(strstr(out, want));
        }
        /* one HELP per series, before all its streams' lines */
        const char *h = strstr(out, "# HELP kvd_kv_events_batches_total");
        assert_non_null(h);
        assert_null(strstr(h + 1, "# HELP kvd_kv_events_batches_total"));
    }

    /* Per stream: a tenant with events = hashes is published without token
     * ids (its hashes still match a router's), events off not at all. */
    for (int m = 0; m < 2; m++) {
        uint64_t h_on = kvs_block_hash(kvs_root_hash(), p[0][m]);
        uint64_t h_hash = kvs_block_hash(kvs_root_hash(), p[1][m]);
        uint64_t h_off = kvs_block_hash(kvs_root_hash(), p[2][m]);
        const struct kvs_view *v = s[m].v;
        assert_true(has(v->seen, v->n_seen, h_on));
        assert_false(has(v->bare, v->n_bare, h_on));
        assert_true(has(v->bare, v->n_bare, h_hash));
        assert_false(has(v->seen, v->n_seen, h_hash));
        assert_false(has(v->seen, v->n_seen, h_off) || has(v->bare, v->n_bare, h_off));
        /* the other model's prompts are not on this stream */
        uint64_t h_other = kvs_block_hash(kvs_root_hash(), p[0][1 - m]);
        assert_false(has(v->seen, v->n_seen, h_other));
    }

    /* A replay of a gap on each stream: the batches since then, in order,
     * the same bytes as sent live. */
    for (int i = 0; i < 2; i++) {
        uint64_t n = s[i].applied, mid = n / 2, first, last;
        struct kvs_batch *again = calloc(KVS_MAX_SEQ, sizeof *again);
        assert_non_null(again);
        assert_true(n >= 2);
        assert_int_equal(kvs_replay(f->zctx, f->replay[i], mid, again, &first, &last), n - mid);
        assert_int_equal(first, mid);
        assert_int_equal(last, n - 1);
        for (uint64_t q = mid; q < n; q++) {
            assert_int_equal(again[q].len, s[i].have[q].len);
            assert_memory_equal(again[q].buf, s[i].have[q].buf, again[q].len);
        }
        kvs_free_batches(again);
    }

    /* beta again: it reloads warm (its blocks come back from CPU to GPU on
     * its stream). */
    assert_int_equal(gen_model(d->sock, "beta", p[0][1], 320), 0);
    /* admin_evict tier "all" of alpha: AllBlocksCleared on alpha's stream
     * alone. */
    kvf_admin_evict_all(d, "alpha");
    for (int i = 0; i < 2; i++)
        stream_catch_up(f, d, i, &s[i]);
    assert_int_equal(s[0].v->cleared, 2);
    assert_int_equal(s[0].v->n[0] + s[0].v->n[1], 0);
    assert_int_equal(s[1].v->cleared, 1);
    check_counts(d, 0, &s[0]);
    check_counts(d, 1, &s[1]);
    assert_true(s[1].v->n[0] + s[1].v->n[1] > 0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kvs_ev_stat(d, names[i], "dropped"), 0);
        stream_close(&s[i]);
    }
    assert_int_equal(kh_stop(d), 0);
    d->pid = 0;
}

/* ---- connect mode: one router socket, two streams ----------------------- */

static void test_connect_mode(void **state)
{
    struct fixture *f = *state;
    if (geteuid() != 0)
        skip();
    /* The router binds one SUB socket (llm-d's indexer) before kvd starts. */
    char router[160];
    snprintf(router, sizeof router, "ipc://%s/router.sock", f->tmp);
    void *sub = sock_new(ZMQ_SUB);
    assert_int_equal(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "kv@", 3), 0);
    assert_int_equal(zmq_bind(sub, router), 0);
    static char conf[4096];
    write_conf(f, conf, sizeof conf, true);
    const char *const args[] = {"--backend",
                                "cpu",
                                "--kv-events",
                                router,
                                "--kv-events-connect",
                                "--kv-events-replay",
                                f->replay[0],
                                "--kv-events-topic",
                                "kv@pod1@{model}",
                                "--device-blocks",
                                "48",
                                "--host-blocks",
                                "64",
                                NULL};
    struct kh_opts o = {.conf_text = conf, .args = args};
    struct kh_proc *d = &f->d;
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_spawn(d, &o), 0);
    for (int i = 0; i < 2; i++) {
        uint64_t t0 = kvf_now_ms();
        while (kvs_ev_stat(d, names[i], "subscribers") < 1) {
            if (kvf_now_ms() - t0 > 10000)
                fail_msg("model %s's stream never reached the router", names[i]);
            /* A bound socket takes its new peers (and sends them its
             * subscriptions) when its owner touches it, as a router polling
             * it does. */
            zmq_pollitem_t it = {sub, 0, ZMQ_POLLIN, 0};
            zmq_poll(&it, 1, 2);
        }
    }
    uint32_t p[320];
    for (int i = 0; i < 2; i++) {
        kvf_make_prompt(p, 320, (uint32_t)(40 + i));
        assert_int_equal(gen_model(d->sock, names[i], p, 320), 0);
    }
    /* Batches of both streams on the one socket: by topic, each its own
     * sequence; what came before the connection, by each one's replay. */
    struct kvs_batch *have[2];
    struct kvs_view *v[2];
    uint64_t n[2];
    for (int i = 0; i < 2; i++) {
        have[i] = calloc(KVS_MAX_SEQ, sizeof *have[i]);
        v[i] = calloc(1, sizeof *v[i]);
        assert_non_null(have[i]);
        assert_non_null(v[i]);
        n[i] = kvs_settle(d, names[i]);
        uint64_t first, last;
        kvs_replay(f->zctx, f->replay[i], 0, have[i], &first, &last);
    }
    uint64_t t0 = kvf_now_ms();
    for (;;) {
        bool all = true;
        for (int i = 0; i < 2; i++)
            for (uint64_t q = 0; q < n[i]; q++)
                all &= have[i][q].buf != NULL;
        if (all)
            break;
        if (kvf_now_ms() - t0 > 20000)
            fail_msg("the streams' batches did not all arrive");
        zmq_pollitem_t it = {sub, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 200) <= 0)
            continue;
        zmq_msg_t m[3];
        int k = 0, more = 1;
        while (more) {
            assert_true(k < 3);
            zmq_msg_init(&m[k]);
            assert_true(zmq_msg_recv(&m[k], sub, 0) >= 0);
            more = zmq_msg_more(&m[k]);
            k++;
        }
        assert_int_equal(k, 3);
        int which = -1;
        for (int i = 0; i < 2; i++)
            if (zmq_msg_size(&m[0]) == strlen(f->topic[i]) &&
                !memcmp(zmq_msg_data(&m[0]), f->topic[i], strlen(f->topic[i])))
                which = i;
        assert_true(which >= 0);
        const unsigned char *sq = zmq_msg_data(&m[1]);
        uint64_t seq = 0;
        for (int j = 0; j < 8; j++)
            seq = seq << 8 | sq[j];
        assert_true(seq < n[which]);
        struct kvs_batch *b = &have[which][seq];
        if (b->buf) { /* live and replayed: the same bytes */
            assert_int_equal(b->len, zmq_msg_size(&m[2]));
            assert_memory_equal(b->buf, zmq_msg_data(&m[2]), b->len);
        } else {
            b->seq = seq;
            b->len = zmq_msg_size(&m[2]);
            b->buf = malloc(b->len);
            assert_non_null(b->buf);
            memcpy(b->buf, zmq_msg_data(&m[2]), b->len);
        }
        for (int j = 0; j < 3; j++)
            zmq_msg_close(&m[j]);
    }
    for (int i = 0; i < 2; i++) {
        for (uint64_t q = 0; q < n[i]; q++)
            kvs_apply(v[i], have[i][q].buf, have[i][q].len);
        assert_int_equal(v[i]->cleared, 1);
        kvf_make_prompt(p, 320, (uint32_t)(40 + i));
        assert_true(has(v[i]->seen, v[i]->n_seen, kvs_block_hash(kvs_root_hash(), p)));
        kvf_make_prompt(p, 320, (uint32_t)(40 + 1 - i));
        assert_false(has(v[i]->seen, v[i]->n_seen, kvs_block_hash(kvs_root_hash(), p)));
        kvs_free_batches(have[i]);
        free(v[i]);
    }
    sock_close(sub);
    assert_int_equal(kh_stop(d), 0);
    d->pid = 0;
}

/* Settings that cannot work: exit 2 at start, the reason logged. */
static void test_bad_settings(void **state)
{
    struct fixture *f = *state;
    char c[4][2048];
    /* a replay without its stream's endpoint */
    snprintf(c[0], sizeof c[0],
             "[model:alpha]\npath = %s\n[model:beta]\npath = %s\n"
             "kv-events-replay = %s\n",
             f->model[0], f->model[1], f->replay[1]);
    /* two streams, one bound endpoint */
    snprintf(c[1], sizeof c[1],
             "[model:alpha]\npath = %s\n[model:beta]\npath = %s\n"
             "kv-events = %s\n",
             f->model[0], f->model[1], f->ev[0]);
    /* the first model's stream set twice */
    snprintf(c[2], sizeof c[2], "[model:alpha]\npath = %s\nkv-events = %s\n", f->model[0],
             f->ev[1]);
    /* an unknown key of a model */
    snprintf(c[3], sizeof c[3], "[model:alpha]\npath = %s\nkv-events-hwm = 5\n", f->model[0]);
    const char *const with_ev[] = {"--backend", "cpu", "--kv-events", f->ev[0], NULL};
    for (int i = 0; i < 4; i++) {
        struct kh_opts o = {.conf_text = c[i], .args = with_ev};
        assert_int_equal(kh_run(&o), 2);
    }
    /* {model} in store mode */
    const char *const store[] = {"--kv-events", f->ev[0], "--kv-events-topic", "kv@x@{model}",
                                 NULL};
    struct kh_opts o = {.args = store};
    assert_int_equal(kh_run(&o), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_per_model),
        cmocka_unit_test(test_connect_mode),
        cmocka_unit_test(test_bad_settings),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* The remote tier when Redis fails, against real kvd daemons: Redis killed
 * before a request, restarted and paused (DEBUG SLEEP); killed and restarted
 * while two clients keep sending requests to two daemons; a "server" that
 * answers garbage of several kinds (a fake one: it is the failure here, not a
 * stand-in for Redis); and a three-node Redis Cluster resharded under three
 * daemons (ASK while the slot migrates, MOVED once it is handed over). In
 * every case kvd answers the tokens a daemon without the tier gives, within
 * a bounded time, and its counters show what happened; once Redis is back,
 * daemons share again. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>
#include <hiredis/hiredis.h>

#include "remote_fixture.h"

/* A prompt of its own for each k (never another's prefix). */
static void prompt_of(uint32_t *p, int k)
{
    for (int i = 0; i < N_PROMPT; i++)
        p[i] = (uint32_t)(i * (2 * k + 41) + 7 * k + 3) % 256;
}

/* Reference answers for prompts [0, n) of prompt_of, from one daemon
 * without the remote tier. */
static void references(const struct fixture *f, int n, struct kvd_gen_result *out)
{
    const char *const args[] = {"--backend",     "cpu",  "--model", f->model,
                                "--step-tokens", "2048", NULL};
    struct kh_proc d;
    uint32_t p[N_PROMPT];
    assert_int_equal(kh_start(&d, NULL, args), 0);
    for (int k = 0; k < n; k++) {
        prompt_of(p, k);
        gen_ok(&d, p, &out[k]);
    }
    assert_int_equal(kh_stop(&d), 0);
}

static void free_results(struct kvd_gen_result *r, int n)
{
    for (int i = 0; i < n; i++)
        kvd_gen_result_free(&r[i]);
}

/* ---- Redis dead, restarted, asleep ----------------------------------------- */

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
    char st[16];
    remote_state(&a, st, sizeof st);
    assert_string_equal(st, "up");
    assert_int_equal(remote_stat(&a, "backoffs"), 0);
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
    /* The refused connect started a back-off. */
    assert_true(remote_stat(&a, "connect_fails") >= 1);
    uint64_t backoffs = remote_stat(&a, "backoffs");
    assert_true(backoffs >= 1);

    /* Back, but asleep for 10 s: a lookup gives up after the timeout. The
     * lookup must reach Redis, so first the tier's rest must be over. */
    assert_int_equal(redis_restart(&f->redis), 0);
    wait_up(&a);
    void *h = redis_srv_cmd_start(&f->redis, "DEBUG SLEEP 10");
    assert_non_null(h);
    t0 = now_s();
    gen_ok(&a, p3, &g3);
    dt = now_s() - t0;
    expect_same(&r3, &g3);
    assert_true(dt < 8.0);
    assert_true(remote_stat(&a, "timeouts") >= 1);
    assert_true(remote_stat(&a, "backoffs") > backoffs);
    redis_cmd_finish(h);
    assert_int_equal(kh_stop(&a), 0);
    kvd_gen_result_free(&r2);
    kvd_gen_result_free(&r3);
    kvd_gen_result_free(&g2);
    kvd_gen_result_free(&g3);
}

/* ---- Redis killed and restarted under load ------------------------------- */

#define MR_PROMPTS 12
#define MR_JOBS (2 * MR_PROMPTS)

/* Job j asks for prompt j / 2 on daemon A (even j: it computes it first)
 * or B (odd j: it may find A's value, or compute it when A's value is not
 * there yet or Redis is down). Two threads take jobs in order. */
struct midrun {
    const struct kh_proc *d[2];
    const struct kvd_gen_result *ref;
    atomic_int next, done, bad;
    atomic_uint_fast64_t cached; /* tokens the B jobs found cached */
};

static void *midrun_client(void *arg)
{
    struct midrun *m = arg;
    uint32_t p[N_PROMPT];
    for (int j; (j = atomic_fetch_add(&m->next, 1)) < MR_JOBS;) {
        struct kvd_gen_result r;
        prompt_of(p, j / 2);
        if (generate(m->d[j % 2]->sock, p, N_PROMPT, &r) != 0) {
            fprintf(stderr, "job %d: generate failed\n", j);
            atomic_fetch_add(&m->bad, 1);
        } else {
            const struct kvd_gen_result *want = &m->ref[j / 2];
            if (r.n_tokens != want->n_tokens ||
                memcmp(r.tokens, want->tokens, sizeof(uint32_t) * r.n_tokens) != 0) {
                fprintf(stderr, "job %d: tokens differ from the reference\n", j);
                atomic_fetch_add(&m->bad, 1);
            }
            if (j % 2)
                atomic_fetch_add(&m->cached, r.cached_tokens);
            kvd_gen_result_free(&r);
        }
        atomic_fetch_add(&m->done, 1);
    }
    return NULL;
}

static void wait_done(struct midrun *m, int n)
{
    for (int i = 0; atomic_load(&m->done) < n; i++) {
        if (i > 60000)
            fail_msg("%d of %d requests done after 10 min", atomic_load(&m->done), n);
        usleep(10000);
    }
}

static void test_redis_killed_mid_run(void **state)
{
    struct fixture *f = *state;
    struct kvd_gen_result ref[MR_PROMPTS + 1], r1, r2;
    references(f, MR_PROMPTS + 1, ref);
    struct kh_proc a, b;
    start(&a, f, conf_on, f->key1);
    start(&b, f, conf_on, f->key1);
    struct midrun m = {.d = {&a, &b}, .ref = ref};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, midrun_client, &m), 0);
    /* Killed with requests in flight, restarted after four more are done
     * (at least two of them began while it was dead). */
    wait_done(&m, MR_JOBS / 4);
    redis_kill(&f->redis);
    wait_done(&m, MR_JOBS / 4 + 4);
    assert_int_equal(redis_restart(&f->redis), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(atomic_load(&m.bad), 0);
    /* The dead Redis was seen (a failed round or connect), and counted. */
    assert_true(remote_stat(&a, "errors") + remote_stat(&b, "errors") >= 1);
    assert_true(remote_stat(&a, "backoffs") + remote_stat(&b, "backoffs") >= 1);
    assert_int_equal(remote_stat(&b, "auth_failures") + remote_stat(&b, "mismatches"), 0);

    /* Back: A's next prompt is a whole hit on B again. */
    wait_up(&a);
    wait_up(&b);
    uint32_t p[N_PROMPT];
    prompt_of(p, MR_PROMPTS);
    uint64_t w0 = remote_stat(&a, "writes"), h0 = remote_stat(&b, "hits");
    gen_ok(&a, p, &r1);
    expect_same(&ref[MR_PROMPTS], &r1);
    wait_written(&a, w0 + 1);
    gen_ok(&b, p, &r2);
    expect_same(&ref[MR_PROMPTS], &r2);
    assert_int_equal(r2.cached_tokens, FULL_BLOCKS * BT);
    assert_true(remote_stat(&b, "hits") >= h0 + FULL_BLOCKS);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(kh_stop(&b), 0);
    kvd_gen_result_free(&r1);
    kvd_gen_result_free(&r2);
    free_results(ref, MR_PROMPTS + 1);
}

/* ---- a server that answers garbage ---------------------------------------- */

/* What the fake server answers to each command it reads. */
enum junk_mode {
    JUNK_BYTES,  /* bytes that are not RESP */
    JUNK_TYPE,   /* an integer where a bulk string (GET) or a status (SET) belongs */
    JUNK_HUGE,   /* a bulk string of 2 GB announced, never sent */
    JUNK_CUT,    /* half a reply, then the connection closed */
    JUNK_SILENT, /* reads everything, never answers */
    JUNK_ERROR,  /* a server error (as OOM, LOADING or CLUSTERDOWN are) */
    JUNK_VALUES, /* well-formed replies, but every GET's value is 64 random bytes */
    JUNK_MODES
};

#define JUNK_CLIENTS 32

struct junk_cl {
    int fd;
    char *buf;
    size_t n, cap;
};

struct junk_srv {
    int lfd, port, wake[2];
    pthread_t th;
    _Atomic int mode;
    atomic_uint_fast64_t commands; /* commands read */
    struct junk_cl cl[JUNK_CLIENTS];
};

static void junk_close(struct junk_cl *c)
{
    close(c->fd);
    free(c->buf);
    *c = (struct junk_cl){.fd = -1};
}

/* The length of the first whole RESP command in c's buffer (an array of
 * bulk strings, as hiredis sends), 0 when it is not all there yet, -1 when
 * the bytes are not one. */
static long resp_command(const struct junk_cl *c, bool *is_get)
{
    const char *p = c->buf, *end = c->buf + c->n;
    char *e;
    if (p == end)
        return 0;
    if (*p != '*')
        return -1;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    if (!nl)
        return 0;
    long n = strtol(p + 1, &e, 10);
    p = nl + 1;
    for (long i = 0; i < n; i++) {
        if (p >= end || (nl = memchr(p, '\n', (size_t)(end - p))) == NULL)
            return 0;
        if (*p != '$')
            return -1;
        long len = strtol(p + 1, &e, 10);
        if (i == 0)
            *is_get = len == 3 && nl + 4 <= end && memcmp(nl + 1, "GET", 3) == 0;
        p = nl + 1 + len + 2;
        if (p > end)
            return 0;
    }
    return p - c->buf;
}

static void junk_answer(struct junk_srv *j, struct junk_cl *c, bool is_get)
{
    static const char bytes[] = "\x00\xff\x13\x37 not RESP at all\r\n";
    char v[128];
    int fd = c->fd;
    switch (atomic_load(&j->mode)) {
    case JUNK_BYTES:
        (void)!send(fd, bytes, sizeof bytes - 1, MSG_NOSIGNAL);
        break;
    case JUNK_TYPE:
        (void)!send(fd, ":1\r\n", 4, MSG_NOSIGNAL);
        break;
    case JUNK_HUGE:
        (void)!send(fd, "$2000000000\r\n", 13, MSG_NOSIGNAL);
        break;
    case JUNK_CUT:
        (void)!send(fd, "$10\r\nabc", 8, MSG_NOSIGNAL);
        junk_close(c);
        break;
    case JUNK_SILENT:
        break;
    case JUNK_ERROR:
        (void)!send(fd, "-ERR go away\r\n", 14, MSG_NOSIGNAL);
        break;
    case JUNK_VALUES:
        if (is_get) {
            int n = snprintf(v, sizeof v, "$64\r\n");
            for (int i = 0; i < 64; i++)
                v[n++] = (char)('a' + (rand() % 26));
            v[n++] = '\r';
            v[n++] = '\n';
            (void)!send(fd, v, (size_t)n, MSG_NOSIGNAL);
        } else {
            (void)!send(fd, "+OK\r\n", 5, MSG_NOSIGNAL);
        }
        break;
    }
}

static void junk_read(struct junk_srv *j, struct junk_cl *c)
{
    if (c->n + 65536 > c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 131072;
        char *nb = realloc(c->buf, cap);
        if (!nb) {
            junk_close(c);
            return;
        }
        c->buf = nb;
        c->cap = cap;
    }
    ssize_t got = read(c->fd, c->buf + c->n, c->cap - c->n);
    if (got <= 0) {
        junk_close(c);
        return;
    }
    c->n += (size_t)got;
    for (;;) {
        bool is_get = false;
        long len = resp_command(c, &is_get);
        if (len < 0) {
            junk_close(c);
            return;
        }
        if (len == 0)
            return;
        atomic_fetch_add(&j->commands, 1);
        memmove(c->buf, c->buf + len, c->n - (size_t)len);
        c->n -= (size_t)len;
        junk_answer(j, c, is_get);
        if (c->fd < 0)
            return;
    }
}

static void *junk_main(void *arg)
{
    struct junk_srv *j = arg;
    for (;;) {
        struct pollfd p[JUNK_CLIENTS + 2];
        int idx[JUNK_CLIENTS + 2], n = 0;
        p[n] = (struct pollfd){.fd = j->wake[0], .events = POLLIN};
        idx[n++] = -1;
        p[n] = (struct pollfd){.fd = j->lfd, .events = POLLIN};
        idx[n++] = -2;
        for (int i = 0; i < JUNK_CLIENTS; i++)
            if (j->cl[i].fd >= 0) {
                p[n] = (struct pollfd){.fd = j->cl[i].fd, .events = POLLIN};
                idx[n++] = i;
            }
        if (poll(p, (nfds_t)n, -1) < 0)
            continue;
        if (p[0].revents)
            break;
        for (int k = 1; k < n; k++) {
            if (!(p[k].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (idx[k] == -2) {
                int fd = accept(j->lfd, NULL, NULL);
                int i = 0;
                while (i < JUNK_CLIENTS && j->cl[i].fd >= 0)
                    i++;
                if (fd >= 0 && i < JUNK_CLIENTS)
                    j->cl[i].fd = fd;
                else if (fd >= 0)
                    close(fd);
                continue;
            }
            junk_read(j, &j->cl[idx[k]]);
        }
    }
    for (int i = 0; i < JUNK_CLIENTS; i++)
        if (j->cl[i].fd >= 0)
            junk_close(&j->cl[i]);
    return NULL;
}

static void junk_start(struct junk_srv *j)
{
    memset(j, 0, sizeof *j);
    for (int i = 0; i < JUNK_CLIENTS; i++)
        j->cl[i].fd = -1;
    assert_int_equal(pipe(j->wake), 0);
    j->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(j->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    assert_int_equal(bind(j->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(j->lfd, 16), 0);
    assert_int_equal(getsockname(j->lfd, (struct sockaddr *)&a, &al), 0);
    j->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&j->th, NULL, junk_main, j), 0);
}

static void junk_stop(struct junk_srv *j)
{
    assert_int_equal(write(j->wake[1], "x", 1), 1);
    pthread_join(j->th, NULL);
    close(j->lfd);
    close(j->wake[0]);
    close(j->wake[1]);
}

/* Each kind of garbage against a fresh daemon (so no rest or write of an
 * earlier kind overlaps it): the request's lookup reaches the server, fails
 * within the round's deadline (or, for well-formed junk values, fails
 * authentication), is counted, and the tokens are computed. */
static void test_garbage_server(void **state)
{
    struct fixture *f = *state;
    struct kvd_gen_result ref;
    reference(f, f->prompt, &ref);
    struct junk_srv j;
    junk_start(&j);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", j.port);
    for (int mode = 0; mode < JUNK_MODES; mode++) {
        struct kh_proc a;
        struct kvd_gen_result g;
        atomic_store(&j.mode, mode);
        uint64_t cmd0 = atomic_load(&j.commands);
        /* 1 s rounds: a slow (sanitized, loaded) daemon's good rounds must not time out. */
        const char *const x[] = {"--remote-timeout-ms", "1000", NULL};
        redis_url = url;
        start_ex(&a, f, conf_on, f->key1, x);
        redis_url = NULL;
        double t0 = now_s();
        gen_ok(&a, f->prompt, &g);
        double dt = now_s() - t0;
        expect_same(&ref, &g);
        assert_int_equal(g.cached_tokens, 0);
        /* Bounded: a lookup costs at most remote-timeout-ms (1 s); a
         * server that never answers would otherwise hold it forever. */
        if (dt >= 30.0)
            fail_msg("junk mode %d: the request took %.1f s", mode, dt);
        assert_true(atomic_load(&j.commands) > cmd0); /* the lookup reached it */
        assert_int_equal(remote_stat(&a, "hits"), 0);
        if (mode == JUNK_VALUES) { /* well-formed: values that fail authentication */
            assert_true(remote_stat(&a, "auth_failures") >= 1);
            /* No protocol error (a round of a loaded machine may still time out). */
            assert_int_equal(remote_stat(&a, "errors"), remote_stat(&a, "timeouts"));
        } else {
            assert_true(remote_stat(&a, "errors") >= 1);
            assert_true(remote_stat(&a, "backoffs") >= 1);
            assert_int_equal(remote_stat(&a, "auth_failures"), 0);
        }
        if (mode == JUNK_SILENT)
            assert_true(remote_stat(&a, "timeouts") >= 1);
        assert_int_equal(kh_stop(&a), 0);
        kvd_gen_result_free(&g);
    }
    junk_stop(&j);
    kvd_gen_result_free(&ref);
}

/* ---- a Redis Cluster resharded under the daemons ----------------------- */

static void node_id(const struct redis_srv *n, char *id, size_t cap)
{
    redisReply *r = redis_srv_cmd(n, "CLUSTER MYID");
    assert_true(r && r->type == REDIS_REPLY_STRING);
    snprintf(id, cap, "%s", r->str);
    freeReplyObject(r);
}

/* The kvd keys on node n (at most cap, of REMOTE key size), their count. */
static size_t node_keys(const struct redis_srv *n, char (*out)[64], size_t *len, size_t cap)
{
    redisReply *r = redis_srv_cmd(n, "KEYS kvd1:*");
    assert_true(r && r->type == REDIS_REPLY_ARRAY);
    size_t k = 0;
    for (size_t i = 0; i < r->elements && k < cap; i++) {
        assert_true(r->element[i]->len <= 64);
        memcpy(out[k], r->element[i]->str, r->element[i]->len);
        len[k++] = r->element[i]->len;
    }
    freeReplyObject(r);
    return k;
}

static void test_cluster_resharded(void **state)
{
    struct fixture *f = *state;
    struct redis_cluster c;
    int rc = redis_cluster_start(&c, 3);
    if (rc == REDIS_HARNESS_SKIP)
        skip();
    assert_int_equal(rc, 0);
    struct kh_proc a, b, d;
    struct kvd_gen_result g[3][3];
    uint32_t p[3][N_PROMPT];
    for (int k = 0; k < 3; k++)
        prompt_of(p[k], k);
    redis_url = c.url;
    start(&a, f, conf_on, f->key1);
    start(&b, f, conf_on, f->key1);
    start(&d, f, conf_on, f->key1);
    redis_url = NULL;

    /* Prompt 0 from A on B and D: the cluster is shared, and B's and D's
     * slot maps are loaded (pre-resharding). */
    gen_ok(&a, p[0], &g[0][0]);
    wait_written(&a, 1);
    gen_ok(&b, p[0], &g[0][1]);
    gen_ok(&d, p[0], &g[0][2]);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(g[0][i].cached_tokens, FULL_BLOCKS * BT);
        expect_same(&g[0][0], &g[0][i]);
    }

    /* Prompt 1 from A: its value's slot is moved to another node. */
    char before[3][8][64], key[64];
    size_t blen[3][8], n_before[3], klen = 0;
    for (int i = 0; i < 3; i++)
        n_before[i] = node_keys(&c.node[i], before[i], blen[i], 8);
    gen_ok(&a, p[1], &g[1][0]);
    wait_written(&a, 2);
    int src = -1;
    for (int i = 0; i < 3 && src < 0; i++) {
        char now[8][64];
        size_t nlen[8], n = node_keys(&c.node[i], now, nlen, 8);
        for (size_t x = 0; x < n && src < 0; x++) {
            bool old = false;
            for (size_t y = 0; y < n_before[i]; y++)
                old = old || (nlen[x] == blen[i][y] && !memcmp(now[x], before[i][y], nlen[x]));
            if (!old) {
                src = i;
                klen = nlen[x];
                memcpy(key, now[x], klen);
            }
        }
    }
    assert_true(src >= 0);
    int dst = (src + 1) % 3;
    redisReply *r = redis_srv_cmd(&c.node[src], "CLUSTER KEYSLOT %b", key, klen);
    assert_true(r && r->type == REDIS_REPLY_INTEGER);
    long long slot = r->integer;
    freeReplyObject(r);
    char id_src[64], id_dst[64];
    node_id(&c.node[src], id_src, sizeof id_src);
    node_id(&c.node[dst], id_dst, sizeof id_dst);
    assert_true(redis_srv_cmd_ok(&c.node[dst], "CLUSTER SETSLOT %lld IMPORTING %s", slot, id_src));
    assert_true(redis_srv_cmd_ok(&c.node[src], "CLUSTER SETSLOT %lld MIGRATING %s", slot, id_dst));
    r = redis_srv_cmd(&c.node[src], "MIGRATE 127.0.0.1 %d %b 0 5000", c.node[dst].port, key, klen);
    assert_true(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);

    /* Mid-migration: B is sent on with ASK, and restores the whole prompt. */
    gen_ok(&b, p[1], &g[1][1]);
    assert_int_equal(g[1][1].cached_tokens, FULL_BLOCKS * BT);
    expect_same(&g[1][0], &g[1][1]);
    assert_true(remote_stat(&b, "ask") >= 1);

    /* Handed over: D's map is stale, MOVED sends it to the new owner. */
    for (int i = 0; i < 3; i++)
        assert_true(redis_srv_cmd_ok(&c.node[i], "CLUSTER SETSLOT %lld NODE %s", slot, id_dst));
    gen_ok(&d, p[1], &g[1][2]);
    assert_int_equal(g[1][2].cached_tokens, FULL_BLOCKS * BT);
    expect_same(&g[1][0], &g[1][2]);
    assert_true(remote_stat(&d, "moved") >= 1);

    /* And after it, prompt 2 is shared as before. */
    gen_ok(&a, p[2], &g[2][0]);
    wait_written(&a, 3);
    gen_ok(&b, p[2], &g[2][1]);
    gen_ok(&d, p[2], &g[2][2]);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(g[2][i].cached_tokens, FULL_BLOCKS * BT);
        expect_same(&g[2][0], &g[2][i]);
    }
    const struct kh_proc *all[3] = {&a, &b, &d};
    for (int i = 0; i < 3; i++)
        assert_int_equal(remote_stat(all[i], "auth_failures") + remote_stat(all[i], "mismatches"),
                         0);
    assert_int_equal(kh_stop(&a), 0);
    assert_int_equal(kh_stop(&b), 0);
    assert_int_equal(kh_stop(&d), 0);
    redis_cluster_stop(&c);
    for (int k = 0; k < 3; k++)
        free_results(g[k], 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_redis_dead_or_paused, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_redis_killed_mid_run, remote_per_test,
                                        remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_garbage_server, remote_per_test, remote_per_test_end),
        cmocka_unit_test_setup_teardown(test_cluster_resharded, remote_per_test,
                                        remote_per_test_end),
    };
    return cmocka_run_group_tests(tests, remote_setup, remote_teardown);
}

/* The Redis client (daemon/mm/redisconn.c, redis_cluster.c) against real redis-servers
 * (tests/support/redis_harness.c): URLs; binary keys and 4 MiB values; missing keys; AUTH with
 * an ACL user and a wrong password; db selection; a server killed mid-run and restarted on the
 * same port; a server stuck in DEBUG SLEEP; a "server" that answers garbage; key slots; and a
 * three-node cluster resharded under the client (ASK, then MOVED). Exit 77 without
 * redis-server. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "redis_cluster.h"
#include "redis_harness.h"
#include "redisconn.h"

static struct redis_srv srv; /* the group's server */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static struct redisconn *open_url(const char *url, uint32_t timeout_ms)
{
    struct redisconn_conf c = {.url = url, .timeout_ms = timeout_ms};
    struct redisconn *rc = NULL;
    struct kvd_error e = {0};
    int r = redisconn_open(&c, &rc, &e);
    if (r)
        fprintf(stderr, "open %s: %s\n", url, e.message);
    assert_int_equal(r, 0);
    assert_non_null(rc);
    return rc;
}

static struct redisconn_buf B(const void *p, size_t n) {
    return (struct redisconn_buf){p, n};
}

/* ---- URLs ---- */

static void
expect_url_error(const char *url, const char *needle)
{
    struct kvd_error e = {0};
    assert_int_equal(redisconn_url_check(url, &e), KVD_EBADREQ);
    if (!strstr(e.message, needle)) {
        fprintf(stderr, "URL '%s': message '%s' lacks '%s'\n", url, e.message, needle);
        fail();
    }
    struct redisconn_conf c = {.url = url, .timeout_ms = 100};
    struct redisconn *rc = (struct redisconn *)&e; /* must be set to NULL */
    assert_int_equal(redisconn_open(&c, &rc, &e), KVD_EBADREQ);
    assert_null(rc);
}

static void test_urls(void **state)
{
    (void)state;
    struct kvd_error e = {0};
    const char *good[] = {
        "redis://127.0.0.1:6379",
        "redis://localhost",
        "redis://h:1/0",
        "redis://h:65535/15",
        "redis://alice:s%40cret@h:6379/2",
        "redis://:pw@h:6379",
        "redis://[::1]:6379",
        "redis-cluster://a:1,b:2,c:3",
        "redis-cluster://u:p@a:1",
        "redis-cluster://a:1/0",
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        int r = redisconn_url_check(good[i], &e);
        if (r)
            fprintf(stderr, "URL '%s': %s\n", good[i], e.message);
        assert_int_equal(r, 0);
    }
    expect_url_error("rediss://h:6379", "rediss:// (TLS) is not supported: this hiredis has no "
                                        "TLS; keep Redis on a private network");
    expect_url_error("http://h:6379", "scheme");
    expect_url_error("", "empty");
    expect_url_error("redis://", "no host");
    expect_url_error("redis://h:0", "bad port");
    expect_url_error("redis://h:65536", "bad port");
    expect_url_error("redis://h:12x", "bad port");
    expect_url_error("redis://h:", "bad port");
    expect_url_error("redis://h:-1", "bad port");
    expect_url_error("redis-cluster://", "no host");
    expect_url_error("redis-cluster://,", "empty host");
    expect_url_error("redis-cluster://a:1,", "empty host");
    expect_url_error("redis-cluster://a:1/3", "only db 0");
    expect_url_error("redis://a:1,b:2", "use redis-cluster://");
    expect_url_error("redis://h:1/x", "bad db");
    expect_url_error("redis://h:1?x=1", "query");
    expect_url_error("redis://alice@h:1", "credentials");
    expect_url_error("redis://alice:@h:1", "empty password");
    expect_url_error("redis://a:b%zz@h:1", "bad credentials");
    expect_url_error("redis://::1:6379", "brackets");

    struct redisconn_conf c = {.url = "redis://h:1", .timeout_ms = 0};
    struct redisconn *rc = NULL;
    assert_int_equal(redisconn_open(&c, &rc, &e), KVD_EBADREQ);
    assert_null(rc);
    redisconn_free(NULL);
}

/* ---- key slots (the server's CLUSTER KEYSLOT is checked in the cluster test) ---- */

static void test_key_slots(void **state)
{
    (void)state;
    assert_int_equal(redis_crc16("123456789", 9), 0x31c3);
    assert_int_equal(redis_key_slot("123456789", 9), 12739);
    assert_int_equal(redis_key_slot("foo", 3), 12182);
    assert_int_equal(redis_key_slot("{user1000}.following", 20), redis_key_slot("user1000", 8));
    assert_int_equal(redis_key_slot("foo{}{bar}", 10), redis_key_slot("foo{}{bar}", 10));
    assert_int_not_equal(redis_key_slot("foo{}{bar}", 10), redis_key_slot("bar", 3));
    assert_int_equal(redis_key_slot("foo{{bar}}zap", 13), redis_key_slot("{bar", 4));
    assert_int_equal(redis_key_slot("foo{bar}{zap}", 13), redis_key_slot("bar", 3));
    assert_int_equal(redis_key_slot("{", 1), redis_crc16("{", 1) & 16383);
    assert_int_equal(redis_key_slot("", 0), 0);

    struct redis_redirect r;
    const char *m = "MOVED 3999 127.0.0.1:6381";
    assert_true(redis_parse_redirect(m, strlen(m), &r));
    assert_false(r.ask);
    assert_int_equal(r.slot, 3999);
    assert_string_equal(r.host, "127.0.0.1");
    assert_int_equal(r.port, 6381);
    const char *a = "ASK 16383 ::1:7000";
    assert_true(redis_parse_redirect(a, strlen(a), &r));
    assert_true(r.ask);
    assert_string_equal(r.host, "::1");
    assert_int_equal(r.port, 7000);
    const char *bad[] = {"MOVED 16384 h:1", "MOVED 1 h",      "MOVED 1 h:0",
                         "ASK x h:1",       "MOVED",          "MOVED 1 h:1 junk",
                         "ERR MOVED 1 h:1", "MOVED 1 h:99999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_false(redis_parse_redirect(bad[i], strlen(bad[i]), &r));
}

/* ---- one node ---- */

static void test_set_get_binary(void **state)
{
    (void)state;
    struct redisconn *rc = open_url(srv.url, 2000);
    struct kvd_error e = {0};
    /* keys with NULs, CR LF, spaces, high bytes */
    static const char k0[] = {'k', 0, '\r', '\n', ' ', (char)0xff};
    static const char k1[] = "plain";
    static const char k2[] = {0};
    size_t big = 4u << 20;
    char *v0 = malloc(big);
    assert_non_null(v0);
    for (size_t i = 0; i < big; i++)
        v0[i] = (char)(i * 131 + (i >> 13));
    struct redisconn_buf keys[4] = {B(k0, sizeof(k0)), B(k1, 5), B(k2, 1), B("missing", 7)};
    struct redisconn_buf vals[3] = {B(v0, big), B("", 0), B("\0\r\n$-1\r\n", 9)};
    struct redisconn_buf d1[1] = {B("missing", 7)};
    assert_int_equal(redisconn_del(rc, 1, d1, &e), 0);
    assert_int_equal(redisconn_set(rc, 3, keys, vals, 0, &e), 0);

    struct redisconn_buf out[4];
    assert_int_equal(redisconn_get(rc, 4, keys, out, &e), 0);
    assert_int_equal(out[0].n, big);
    assert_memory_equal(out[0].p, v0, big);
    assert_non_null(out[1].p); /* empty, not missing */
    assert_int_equal(out[1].n, 0);
    assert_int_equal(out[2].n, 9);
    assert_memory_equal(out[2].p, "\0\r\n$-1\r\n", 9);
    assert_null(out[3].p);
    assert_int_equal(out[3].n, 0);

    /* Several large values in one call (the buffer they share grows while they arrive), next
     * to small ones; each call's values stay readable until the next call. */
    struct redisconn_buf bk[4] = {B("big:a", 5), B("big:b", 5), B("small", 5), B("big:c", 5)};
    struct redisconn_buf bv[4] = {B(v0, big), B(v0 + 7, big - 7), B("tiny", 4), B(v0 + 1, 5000)};
    assert_int_equal(redisconn_set(rc, 4, bk, bv, 0, &e), 0);
    struct redisconn_buf bo[4];
    assert_int_equal(redisconn_get(rc, 4, bk, bo, &e), 0);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(bo[i].n, bv[i].n);
        assert_memory_equal(bo[i].p, bv[i].p, bv[i].n);
    }
    assert_int_equal(redisconn_del(rc, 4, bk, &e), 0);

    bool present[4];
    assert_int_equal(redisconn_exists(rc, 4, keys, present, &e), 0);
    assert_true(present[0] && present[1] && present[2]);
    assert_false(present[3]);

    /* TTL: the server sees an expiry */
    struct redisconn_buf tk[1] = {B("ttl-key", 7)};
    struct redisconn_buf tv[1] = {B("v", 1)};
    assert_int_equal(redisconn_set(rc, 1, tk, tv, 100, &e), 0);
    redisReply *r = redis_srv_cmd(&srv, "TTL ttl-key");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_INTEGER);
    assert_true(r->integer > 90 && r->integer <= 100);
    freeReplyObject(r);
    r = redis_srv_cmd(&srv, "TTL plain");
    assert_int_equal(r->integer, -1);
    freeReplyObject(r);

    assert_int_equal(redisconn_del(rc, 3, keys, &e), 0);
    assert_int_equal(redisconn_exists(rc, 3, keys, present, &e), 0);
    assert_false(present[0] || present[1] || present[2]);
    assert_int_equal(redisconn_get(rc, 1, keys, out, &e), 0);
    assert_null(out[0].p);

    /* many keys in one pipeline */
    enum { N = 2000 };
    static char kb[N][16], vb[N][24];
    struct redisconn_buf *mk = calloc(N, sizeof(*mk)), *mv = calloc(N, sizeof(*mv));
    for (int i = 0; i < N; i++) {
        mk[i] = B(kb[i], (size_t)snprintf(kb[i], sizeof(kb[i]), "many:%d", i));
        mv[i] = B(vb[i], (size_t)snprintf(vb[i], sizeof(vb[i]), "value-%d", i * 7));
    }
    struct redisconn_stats st0, st1;
    redisconn_stats(rc, &st0);
    assert_int_equal(redisconn_set(rc, N, mk, mv, 0, &e), 0);
    struct redisconn_buf *mo = calloc(N, sizeof(*mo));
    assert_int_equal(redisconn_get(rc, N, mk, mo, &e), 0);
    redisconn_stats(rc, &st1);
    assert_int_equal(st1.rounds - st0.rounds, 2); /* one round each */
    for (int i = 0; i < N; i++) {
        assert_int_equal(mo[i].n, mv[i].n);
        assert_memory_equal(mo[i].p, mv[i].p, mv[i].n);
    }
    assert_int_equal(redisconn_del(rc, N, mk, &e), 0);
    free(mk);
    free(mv);
    free(mo);

    /* n 0 and n too big */
    assert_int_equal(redisconn_get(rc, 0, NULL, NULL, &e), 0);
    assert_int_equal(redisconn_get(rc, REDISCONN_MAX_KEYS + 1, keys, out, &e), -1);
    assert_int_equal(e.code, KVD_EBADREQ);

    redisconn_stats(rc, &st1);
    assert_true(st1.bytes_out > big && st1.bytes_in > big);
    assert_int_equal(st1.timeouts, 0);
    assert_int_equal(st1.reconnects, 0);
    assert_int_equal(st1.moved + st1.ask, 0);
    assert_false(redisconn_is_cluster(rc));
    assert_int_equal(redisconn_ping(rc, &e), 0);
    free(v0);
    redisconn_free(rc);
}

/* A command that is refused by the server is an error, and the connection stays usable. */
static void test_server_error(void **state)
{
    (void)state;
    struct redisconn *rc = open_url(srv.url, 2000);
    struct kvd_error e = {0};
    redisReply *r = redis_srv_cmd(&srv, "DEL alist");
    assert_non_null(r);
    freeReplyObject(r);
    r = redis_srv_cmd(&srv, "RPUSH alist x");
    assert_non_null(r);
    freeReplyObject(r);
    struct redisconn_buf k[2] = {B("alist", 5), B("other", 5)};
    struct redisconn_buf out[2] = {{"x", 1}, {"y", 1}};
    assert_int_equal(redisconn_get(rc, 2, k, out, &e), -1);
    assert_int_equal(e.code, KVD_EINTERNAL);
    assert_non_null(strstr(e.message, "WRONGTYPE"));
    assert_null(out[0].p);
    assert_null(out[1].p);
    struct redisconn_buf v[1] = {B("1", 1)};
    assert_int_equal(redisconn_set(rc, 1, k + 1, v, 0, &e), 0);
    struct redisconn_stats st;
    redisconn_stats(rc, &st);
    assert_int_equal(st.errors, 1);
    assert_int_equal(st.reconnects, 0);
    redisconn_free(rc);
}

static void test_auth_acl(void **state)
{
    (void)state;
    struct kvd_error e = {0};
    assert_true(redis_srv_cmd_ok(&srv, "ACL SETUSER alice on >s3cret ~app:* +@all"));
    char url[256];
    snprintf(url, sizeof(url), "redis://alice:s3cret@%s", srv.addr);
    struct redisconn *rc = open_url(url, 2000);
    struct redisconn_buf k[1] = {B("app:1", 5)}, v[1] = {B("x", 1)};
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), 0);
    /* alice may not touch other keys: the server's error comes through */
    struct redisconn_buf k2[1] = {B("other:1", 7)};
    assert_int_equal(redisconn_set(rc, 1, k2, v, 0, &e), -1);
    assert_non_null(strstr(e.message, "NOPERM"));
    redisconn_free(rc);

    snprintf(url, sizeof(url), "redis://alice:wrong@%s", srv.addr);
    rc = open_url(url, 2000);
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), -1);
    assert_int_equal(e.code, KVD_EPERM);
    assert_non_null(strstr(e.message, "AUTH refused"));
    assert_non_null(strstr(e.message, "WRONGPASS"));
    /* the next call, within timeout_ms, reports the same without a new attempt */
    struct kvd_error e2 = {0};
    assert_int_equal(redisconn_get(rc, 1, k, (struct redisconn_buf[1]){{0}}, &e2), -1);
    assert_int_equal(e2.code, KVD_EPERM);
    assert_non_null(strstr(e2.message, "WRONGPASS"));
    redisconn_free(rc);

    /* the default user's password (":password@") */
    struct redis_srv s2;
    assert_int_equal(redis_start(&s2, "--requirepass pw2"), 0);
    snprintf(url, sizeof(url), "redis://:pw2@%s", s2.addr);
    rc = open_url(url, 2000);
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), 0);
    redisconn_free(rc);
    rc = open_url(s2.url, 2000); /* no password */
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), -1);
    assert_non_null(strstr(e.message, "NOAUTH"));
    redisconn_free(rc);
    redis_stop(&s2);
}

static void test_db_select(void **state)
{
    (void)state;
    struct kvd_error e = {0};
    char url[128];
    snprintf(url, sizeof(url), "%s/3", srv.url);
    struct redisconn *r3 = open_url(url, 2000);
    snprintf(url, sizeof(url), "%s/0", srv.url);
    struct redisconn *r0 = open_url(url, 2000);
    struct redisconn_buf k[1] = {B("dbkey", 5)}, v[1] = {B("in3", 3)};
    assert_int_equal(redisconn_del(r0, 1, k, &e), 0);
    assert_int_equal(redisconn_set(r3, 1, k, v, 0, &e), 0);
    bool p = true;
    assert_int_equal(redisconn_exists(r0, 1, k, &p, &e), 0);
    assert_false(p);
    assert_int_equal(redisconn_exists(r3, 1, k, &p, &e), 0);
    assert_true(p);
    redisconn_free(r3);
    redisconn_free(r0);

    snprintf(url, sizeof(url), "%s/99", srv.url); /* 16 databases */
    struct redisconn *bad = open_url(url, 2000);
    assert_int_equal(redisconn_exists(bad, 1, k, &p, &e), -1);
    assert_non_null(strstr(e.message, "SELECT refused"));
    redisconn_free(bad);
}

/* Calls until one succeeds (the client reconnects at most once per timeout_ms); bounded. */
static void set_until_ok(struct redisconn *rc, const struct redisconn_buf *k,
                         const struct redisconn_buf *v, uint64_t bound_ms)
{
    struct kvd_error e = {0};
    uint64_t t0 = now_ms();
    while (redisconn_set(rc, 1, k, v, 0, &e) != 0) {
        if (now_ms() - t0 > bound_ms) {
            fprintf(stderr, "no success in %llu ms: %s\n", (unsigned long long)bound_ms, e.message);
            fail();
        }
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void test_kill_restart(void **state)
{
    (void)state;
    struct redis_srv s;
    assert_int_equal(redis_start(&s, NULL), 0);
    struct redisconn *rc = open_url(s.url, 300);
    struct kvd_error e = {0};
    struct redisconn_buf k[1] = {B("k", 1)}, v[1] = {B("v", 1)}, out[1];
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), 0);

    redis_kill(&s);
    uint64_t t0 = now_ms();
    assert_int_equal(redisconn_get(rc, 1, k, out, &e), -1);
    assert_true(now_ms() - t0 < 1500);
    assert_int_equal(e.code, KVD_EINTERNAL);
    assert_non_null(strstr(e.message, "redis"));
    /* and again: down, still bounded (refused, or not retried within timeout_ms) */
    t0 = now_ms();
    assert_int_equal(redisconn_get(rc, 1, k, out, &e), -1);
    assert_true(now_ms() - t0 < 1500);
    assert_null(out[0].p);

    assert_int_equal(redis_restart(&s), 0);
    set_until_ok(rc, k, v, 5000);
    assert_int_equal(redisconn_get(rc, 1, k, out, &e), 0);
    assert_int_equal(out[0].n, 1);
    struct redisconn_stats st;
    redisconn_stats(rc, &st);
    assert_true(st.reconnects >= 1);
    assert_true(st.errors >= 2);

    /* a restart between two calls: the idle connection is found closed and made again, so the
     * next call just works */
    redis_kill(&s);
    assert_int_equal(redis_restart(&s), 0);
    struct timespec ts = {0, 350 * 1000000L}; /* past timeout_ms since the last connect */
    nanosleep(&ts, NULL);
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), 0);
    redisconn_free(rc);
    redis_stop(&s);
}

/* True once a PING on a fresh connection gets no answer within 100 ms (within bound_ms). */
static bool stops_answering(const struct redis_srv *s, uint64_t bound_ms)
{
    uint64_t t0 = now_ms();
    while (now_ms() - t0 < bound_ms) {
        struct timeval tv = {.tv_usec = 100000};
        redisContext *c = redisConnectWithTimeout(s->host, s->port, tv);
        if (!c || c->err) {
            redisFree(c);
            continue;
        }
        redisSetTimeout(c, tv);
        redisReply *r = redisCommand(c, "PING");
        redisFree(c);
        if (!r)
            return true;
        freeReplyObject(r);
    }
    return false;
}

static void test_timeout_debug_sleep(void **state)
{
    (void)state;
    struct redis_srv s;
    assert_int_equal(redis_start(&s, "--enable-debug-command yes"), 0);
    struct redisconn *rc = open_url(s.url, 200);
    struct kvd_error e = {0};
    struct redisconn_buf k[1] = {B("k", 1)}, v[1] = {B("v", 1)}, out[1];
    assert_int_equal(redisconn_set(rc, 1, k, v, 0, &e), 0);

    void *h = redis_srv_cmd_start(&s, "DEBUG SLEEP 2");
    assert_non_null(h);
    /* the server is asleep once it stops answering a PING */
    assert_true(stops_answering(&s, 2000));
    uint64_t t0 = now_ms();
    int r = redisconn_get(rc, 1, k, out, &e);
    uint64_t dt = now_ms() - t0;
    assert_int_equal(r, -1);
    assert_int_equal(e.code, KVD_EBUSY);
    assert_non_null(strstr(e.message, "timeout"));
    assert_true(dt >= 150 && dt < 1500);
    struct redisconn_stats st;
    redisconn_stats(rc, &st);
    assert_int_equal(st.timeouts, 1);
    redis_cmd_finish(h); /* waits for the sleep to end */
    set_until_ok(rc, k, v, 5000);
    assert_int_equal(redisconn_get(rc, 1, k, out, &e), 0);
    assert_int_equal(out[0].n, 1);
    redisconn_free(rc);
    redis_stop(&s);
}

/* ---- a "server" that answers garbage ---- */

struct junk_srv {
    int lfd, port;
    pthread_t th;
    const char *const *cases;
    const size_t *lens;
    size_t n;
};

static void *junk_main(void *arg)
{
    struct junk_srv *j = arg;
    char buf[65536];
    for (size_t i = 0; i < j->n; i++) {
        struct pollfd p = {.fd = j->lfd, .events = POLLIN};
        if (poll(&p, 1, 10000) != 1)
            break;
        int c = accept(j->lfd, NULL, NULL);
        if (c < 0)
            break;
        p.fd = c;
        if (poll(&p, 1, 5000) == 1)
            (void)!read(c, buf, sizeof(buf));
        if (j->lens[i] == 1 && j->cases[i][0] == 'T') {
            /* trickle: a bulk header, then a byte every 50 ms for 3 s (each read() gets
             * something: only a deadline per round stops this) */
            (void)!write(c, "$100\r\n", 6);
            for (int t = 0; t < 60; t++) {
                struct timespec ts = {0, 50 * 1000000L};
                nanosleep(&ts, NULL);
                if (send(c, "x", 1, MSG_NOSIGNAL) != 1)
                    break;
            }
        } else if (j->lens[i]) {
            (void)!write(c, j->cases[i], j->lens[i]);
        }
        /* hold it open until the client gives up (or 5 s) */
        while (poll(&p, 1, 5000) == 1 && read(c, buf, sizeof(buf)) > 0)
            ;
        close(c);
    }
    return NULL;
}

static void test_garbage_server(void **state)
{
    (void)state;
#define J(lit)                                                                                     \
    {                                                                                              \
        lit, sizeof(lit) - 1                                                                       \
    }
    static const struct {
        const char *p;
        size_t n;
    } junk[] = {
        J("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"), /* not RESP */
        J(":1\r\n"),                                                /* the wrong type for GET */
        J("+OK\r\n+OK\r\n"),  /* a status, and one reply too many */
        J("$5\r\nab"),        /* cut short, then silence */
        J("*3000000000\r\n"), /* an absurd array */
        J("$-7\r\n"),         /* a bad length */
        J("\x00\xff\x13\x37 binary junk\r\n"),
        J("-ERR go away\r\n"),
        J("*2\r\n$1\r\na\r\n$1\r\nb\r\n"), /* an array for GET */
        J(""),                             /* says nothing at all */
    };
#undef J
    enum { NJ = sizeof(junk) / sizeof(junk[0]) };
    const char *cases[NJ];
    size_t lens[NJ];
    for (size_t i = 0; i < NJ; i++) {
        cases[i] = junk[i].p;
        lens[i] = junk[i].n;
    }
    struct junk_srv j = {.cases = cases, .lens = lens, .n = NJ};
    j.lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    assert_int_equal(bind(j.lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(j.lfd, 4), 0);
    assert_int_equal(getsockname(j.lfd, (struct sockaddr *)&a, &al), 0);
    j.port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&j.th, NULL, junk_main, &j), 0);

    char url[64];
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d", j.port);
    for (size_t i = 0; i < j.n; i++) {
        struct redisconn *rc = open_url(url, 300);
        struct kvd_error e = {0};
        struct redisconn_buf k[1] = {B("k", 1)}, out[1] = {{"x", 1}};
        uint64_t t0 = now_ms();
        int r = redisconn_get(rc, 1, k, out, &e);
        uint64_t dt = now_ms() - t0;
        if (r != -1)
            fprintf(stderr, "junk case %zu: accepted\n", i);
        assert_int_equal(r, -1);
        assert_null(out[0].p);
        assert_true(dt < 1500);
        assert_true(e.code == KVD_EINTERNAL || e.code == KVD_EBUSY);
        if (cases[i][0] == 'T' && lens[i] == 1) { /* the deadline, not a per-read timeout */
            assert_int_equal(e.code, KVD_EBUSY);
            assert_true(dt >= 250 && dt < 1000);
        }
        assert_non_null(strstr(e.message, "redis"));
        redisconn_free(rc);
    }
    pthread_join(j.th, NULL);
    close(j.lfd);
}

/* Nothing listens: a bounded failure; and a call within timeout_ms does not try again. */
static void test_refused(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    char url[64];
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d", ntohs(a.sin_port));
    struct redisconn *rc = open_url(url, 5000); /* bound but not listening: refused */
    struct kvd_error e = {0};
    struct redisconn_buf k[1] = {B("k", 1)};
    bool p;
    assert_int_equal(redisconn_exists(rc, 1, k, &p, &e), -1);
    assert_non_null(strstr(e.message, "connection failed"));
    assert_int_equal(redisconn_exists(rc, 1, k, &p, &e), -1);
    assert_non_null(strstr(e.message, "not retried"));
    assert_int_equal(redisconn_ping(rc, &e), -1);
    redisconn_free(rc);
    close(fd);
}

/* ---- a cluster ---- */

/* The node's id (CLUSTER MYID) into id. */
static void node_id(const struct redis_srv *n, char *id, size_t cap)
{
    redisReply *r = redis_srv_cmd(n, "CLUSTER MYID");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STRING);
    snprintf(id, cap, "%s", r->str);
    freeReplyObject(r);
}

static long long node_int(const struct redis_srv *n, const char *cmd, const char *arg)
{
    redisReply *r = arg ? redis_srv_cmd(n, cmd, arg) : redis_srv_cmd(n, cmd);
    assert_non_null(r);
    long long v = r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    freeReplyObject(r);
    return v;
}

static void check_all(struct redisconn *rc, size_t n, const struct redisconn_buf *k,
                      const struct redisconn_buf *v)
{
    struct kvd_error e = {0};
    struct redisconn_buf *out = calloc(n, sizeof(*out));
    assert_non_null(out);
    int r = redisconn_get(rc, n, k, out, &e);
    if (r)
        fprintf(stderr, "cluster get: %s\n", e.message);
    assert_int_equal(r, 0);
    for (size_t i = 0; i < n; i++) {
        if (out[i].n != v[i].n || memcmp(out[i].p, v[i].p, v[i].n) != 0) {
            fprintf(stderr, "key %zu (%.*s) reads back wrong\n", i, (int)k[i].n,
                    (const char *)k[i].p);
            fail();
        }
    }
    free(out);
}

static void test_cluster(void **state)
{
    (void)state;
    struct redis_cluster c;
    int sr = redis_cluster_start(&c, 3);
    if (sr == REDIS_HARNESS_SKIP)
        skip();
    assert_int_equal(sr, 0);
    struct redisconn *rc = open_url(c.url, 2000);
    assert_true(redisconn_is_cluster(rc));
    struct kvd_error e = {0};
    assert_int_equal(redisconn_ping(rc, &e), 0);

    /* our slots are the server's, for binary keys and hash tags */
    static const char *const sk[] = {"a", "{user}.x", "x{}y", "{{a}}", "tag{abc}def", "\x01\xff"};
    for (size_t i = 0; i < sizeof(sk) / sizeof(sk[0]); i++) {
        redisReply *r = redis_srv_cmd(&c.node[0], "CLUSTER KEYSLOT %b", sk[i], strlen(sk[i]));
        assert_non_null(r);
        assert_int_equal(r->integer, redis_key_slot(sk[i], strlen(sk[i])));
        freeReplyObject(r);
    }

    /* 600 keys over the three nodes, and 20 in one slot ({mig}) to move */
    enum { NP = 600, NM = 20, N = NP + NM };
    static char kb[N][32], vb[N][40];
    struct redisconn_buf k[N], v[N];
    for (int i = 0; i < N; i++) {
        int kl = i < NP ? snprintf(kb[i], sizeof(kb[i]), "ck:%d:\x01", i)
                        : snprintf(kb[i], sizeof(kb[i]), "{mig}:%d", i - NP);
        k[i] = B(kb[i], (size_t)kl);
        v[i] = B(vb[i], (size_t)snprintf(vb[i], sizeof(vb[i]), "value of %d", i * 13));
    }
    assert_int_equal(redisconn_set(rc, N, k, v, 0, &e), 0);
    for (int i = 0; i < 3; i++)
        assert_true(node_int(&c.node[i], "DBSIZE", NULL) > 100);
    struct redisconn_stats s0, s1;
    redisconn_stats(rc, &s0);
    check_all(rc, N, k, v);
    redisconn_stats(rc, &s1);
    assert_int_equal(s1.rounds - s0.rounds, 3); /* one round per node */
    assert_int_equal(s1.moved + s1.ask, 0);

    /* the {mig} slot: from its owner A to B, keys moved one by one */
    uint16_t slot = redis_key_slot("{mig}", 5);
    int a = -1;
    for (int i = 0; i < 3; i++)
        if (node_int(&c.node[i], "EXISTS %s", kb[NP]) == 1)
            a = i;
    assert_true(a >= 0);
    int b = (a + 1) % 3;
    char ida[64], idb[64];
    node_id(&c.node[a], ida, sizeof(ida));
    node_id(&c.node[b], idb, sizeof(idb));
    assert_true(redis_srv_cmd_ok(&c.node[b], "CLUSTER SETSLOT %d IMPORTING %s", slot, ida));
    assert_true(redis_srv_cmd_ok(&c.node[a], "CLUSTER SETSLOT %d MIGRATING %s", slot, idb));
    for (int i = 0; i < NM / 2; i++) {
        redisReply *r =
            redis_srv_cmd(&c.node[a], "MIGRATE 127.0.0.1 %d %s 0 5000", c.node[b].port, kb[NP + i]);
        assert_non_null(r);
        assert_int_equal(r->type, REDIS_REPLY_STATUS);
        freeReplyObject(r);
    }
    /* half on A, half on B: the moved half answers ASK */
    check_all(rc, N, k, v);
    redisconn_stats(rc, &s1);
    assert_true(s1.ask >= NM / 2);
    assert_int_equal(s1.moved, 0);
    /* a new key in the migrating slot goes to B (ASK), existing ones stay readable */
    struct redisconn_buf nk[1] = {B("{mig}:new", 9)}, nv[1] = {B("fresh", 5)};
    assert_int_equal(redisconn_set(rc, 1, nk, nv, 0, &e), 0);
    struct redisconn_stats s2;
    redisconn_stats(rc, &s2);
    assert_int_equal(s2.ask, s1.ask + 1);

    /* finish: move the rest, give the slot to B everywhere: A answers MOVED */
    for (int i = NM / 2; i < NM; i++) {
        redisReply *r =
            redis_srv_cmd(&c.node[a], "MIGRATE 127.0.0.1 %d %s 0 5000", c.node[b].port, kb[NP + i]);
        assert_non_null(r);
        freeReplyObject(r);
    }
    assert_true(redis_srv_cmd_ok(&c.node[b], "CLUSTER SETSLOT %d NODE %s", slot, idb));
    assert_true(redis_srv_cmd_ok(&c.node[a], "CLUSTER SETSLOT %d NODE %s", slot, idb));
    assert_true(redis_srv_cmd_ok(&c.node[(a + 2) % 3], "CLUSTER SETSLOT %d NODE %s", slot, idb));
    check_all(rc, N, k, v);
    check_all(rc, 1, nk, nv);
    redisconn_stats(rc, &s1);
    assert_true(s1.moved >= 1);
    /* the map was refreshed: no more redirects */
    struct redisconn_stats s3;
    check_all(rc, N, k, v);
    redisconn_stats(rc, &s3);
    assert_int_equal(s3.moved, s1.moved);
    assert_int_equal(s3.ask, s1.ask);
    redisReply *cr = redis_srv_cmd(&c.node[b], "CLUSTER COUNTKEYSINSLOT %d", slot);
    assert_non_null(cr);
    assert_int_equal(cr->integer, NM + 1); /* every {mig} key now lives on B */
    freeReplyObject(cr);

    bool present[N];
    assert_int_equal(redisconn_exists(rc, N, k, present, &e), 0);
    for (int i = 0; i < N; i++)
        assert_true(present[i]);
    assert_int_equal(redisconn_del(rc, N, k, &e), 0);
    assert_int_equal(redisconn_exists(rc, N, k, present, &e), 0);
    for (int i = 0; i < N; i++)
        assert_false(present[i]);
    assert_int_equal(s3.errors, 0);
    redisconn_free(rc);
    redis_cluster_stop(&c);
}

static int group_setup(void **state)
{
    (void)state;
    return redis_start(&srv, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    redis_stop(&srv);
    return 0;
}

int main(void)
{
    if (!redis_available()) {
        fprintf(stderr, "redis-server or redis-cli not installed: skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_urls),
        cmocka_unit_test(test_key_slots),
        cmocka_unit_test(test_set_get_binary),
        cmocka_unit_test(test_server_error),
        cmocka_unit_test(test_auth_acl),
        cmocka_unit_test(test_db_select),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_kill_restart),
        cmocka_unit_test(test_timeout_debug_sleep),
        cmocka_unit_test(test_garbage_server),
        cmocka_unit_test(test_cluster),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

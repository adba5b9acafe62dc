/* Integration test of tenants: two clients under two uids (forked children
 * that setuid; needs root, else skipped with 77) cannot see each other's
 * sequences or cached prefixes, meet only in a namespace both were given,
 * have their own quotas; unlisted uids are refused; non-admins see only
 * their own tenant and cannot run admin ops; SIGHUP reloads quotas. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

#define UID_A 60001
#define UID_B 60002
#define UID_C 60003
#define GID_ALL 65534 /* nogroup: the socket's group */

static struct kh_proc kvd;

static const char *conf_text = "[limits]\n"
                               "refuse-unlisted = true\n"
                               "[admin]\n"
                               "uids = 0\n"
                               "[tenant:alpha]\n"
                               "uids = 60001\n"
                               "max-device-blocks = 4\n"
                               "namespaces = team\n"
                               "[tenant:beta]\n"
                               "uids = 60002\n"
                               "max-device-blocks = 5\n"
                               "namespaces = team\n";

static const char *const kvd_args[] = {
    "--backend", "cpu", "--block-tokens", "4", "--device-blocks", "64", "--socket-group",
    "nogroup",   NULL};

static int call_tokens(int fd, const char *op, uint64_t id, uint64_t seq, const uint32_t *t,
                       size_t n, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_u32_array(&q.pk, "tokens", t, n);
    if (kh_req_send(fd, &q) || kh_recv(fd, r))
        return -1;
    return r->code;
}

static int call_extend(int fd, uint64_t id, uint64_t seq, uint64_t n)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "seq_extend", id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "n", n);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    int code = r.code;
    kh_reply_free(&r);
    return code;
}

static uint64_t open_ns(int fd, uint64_t id, const char *ns)
{
    struct kh_req q;
    struct kh_reply r;
    uint64_t s = 0;
    kh_req_begin(&q, "seq_open", id, 1);
    proto_pack_kv_str(&q.pk, "namespace", ns);
    if (kh_req_send(fd, &q) == 0 && kh_recv(fd, &r) == 0 && r.code == 0)
        s = kh_u64(r.root, "seq");
    kh_reply_free(&r);
    return s;
}

static bool str_is(const msgpack_object *o, const char *s)
{
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           !memcmp(o->via.str.ptr, s, o->via.str.size);
}

static const uint32_t prefix[8] = {1, 2, 3, 4, 5, 6, 7, 8};
static const uint32_t team_prefix[4] = {7, 7, 7, 7};

struct a_ctx {
    int to_parent, from_parent;
};

/* Tenant alpha: a private prefix, a shared one, its quota. Reports its
 * private handle to the parent and stays connected until told to go. */
static int child_a(void *arg)
{
    struct a_ctx *x = arg;
    struct kh_reply r;
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 10;
    if (kh_call0(fd, "hello", 1, &r) != 0 || !str_is(kh_obj(r.root, "tenant"), "alpha"))
        return 11;
    kh_reply_free(&r);
    uint64_t s = kh_seq_open(fd, 2);
    if (!s || call_extend(fd, 3, s, 8) != 0)
        return 12;
    if (call_tokens(fd, "seq_commit", 4, s, prefix, 8, &r) != 0 || kh_u64(r.root, "shared") != 2)
        return 13;
    kh_reply_free(&r);
    uint64_t t = open_ns(fd, 5, "team");
    if (!t || call_extend(fd, 6, t, 4) != 0)
        return 14;
    if (call_tokens(fd, "seq_commit", 7, t, team_prefix, 4, &r) != 0)
        return 15;
    kh_reply_free(&r);
    /* 3 blocks used of 4: one more fits, then the quota */
    if (call_extend(fd, 8, s, 4) != 0)
        return 16;
    if (call_extend(fd, 9, s, 4) != KVD_EQUOTA)
        return 17;
    /* not an admin */
    if (kh_call0(fd, "admin_check", 10, &r) != KVD_EPERM)
        return 18;
    kh_reply_free(&r);
    if (write(x->to_parent, &s, sizeof(s)) != sizeof(s))
        return 19;
    char c;
    if (read(x->from_parent, &c, 1) < 0)
        return 20;
    close(fd);
    return 0;
}

/* Tenant beta, while alpha is connected: alpha's handle and private prefix
 * are invisible, the shared namespace is not, the quota is its own. */
static int child_b(void *arg)
{
    uint64_t a_seq = *(uint64_t *)arg;
    struct kh_reply r;
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 30;
    if (kh_call1(fd, "seq_info", 1, "seq", a_seq, &r) != KVD_ENOTFOUND)
        return 31;
    kh_reply_free(&r);
    if (kh_call1(fd, "seq_close", 2, "seq", a_seq, &r) != KVD_ENOTFOUND)
        return 32;
    kh_reply_free(&r);
    uint64_t s = kh_seq_open(fd, 3);
    if (!s || call_tokens(fd, "seq_match", 4, s, prefix, 8, &r) != 0 ||
        kh_u64(r.root, "matched") != 0)
        return 33;
    kh_reply_free(&r);
    uint64_t t = open_ns(fd, 5, "team");
    if (!t || call_tokens(fd, "seq_match", 6, t, team_prefix, 4, &r) != 0 ||
        kh_u64(r.root, "matched") != 4)
        return 34;
    kh_reply_free(&r);
    /* beta's own quota of 5 blocks, whatever alpha holds */
    if (call_extend(fd, 7, s, 20) != 0)
        return 35;
    if (call_extend(fd, 8, s, 4) != KVD_EQUOTA)
        return 36;
    /* stats: only its own tenant */
    if (kh_call0(fd, "stats", 9, &r) != 0)
        return 37;
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    if (!ts || ts->type != MSGPACK_OBJECT_ARRAY || ts->via.array.size != 1 ||
        !str_is(kh_obj(&ts->via.array.ptr[0], "name"), "beta") ||
        kh_u64(&ts->via.array.ptr[0], "device_blocks") != 5)
        return 38;
    kh_reply_free(&r);
    if (kh_call0(fd, "admin_evict", 10, &r) != KVD_EPERM)
        return 39;
    kh_reply_free(&r);
    close(fd);
    return 0;
}

/* An unlisted uid is refused at connect. */
static int child_c(void *arg)
{
    struct kh_reply r;
    int fd = kh_connect(kvd.sock);
    if (fd < 0)
        return 50;
    if (kh_recv(fd, &r) != 0 || r.code != KVD_EPERM)
        return 51;
    kh_reply_free(&r);
    if (!kh_peer_closed(fd))
        return 52;
    close(fd);
    return 0;
}

static void test_two_tenants(void **state)
{
    if (geteuid() != 0)
        skip();
    assert_int_equal(kh_start(&kvd, conf_text, kvd_args), 0);
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    struct a_ctx ax = {up[1], down[0]};
    pid_t a = kh_run_as(UID_A, GID_ALL, child_a, &ax);
    assert_true(a > 0);
    uint64_t a_seq = 0;
    ssize_t got = read(up[0], &a_seq, sizeof(a_seq));
    if (got != sizeof(a_seq)) {
        /* alpha failed before reporting: show its step */
        fail_msg("tenant alpha child failed at step %d", kh_child_status(a));
    }
    pid_t b = kh_run_as(UID_B, GID_ALL, child_b, &a_seq);
    int bst = kh_child_status(b);
    assert_int_equal(bst, 0);
    pid_t c = kh_run_as(UID_C, GID_ALL, child_c, NULL);
    assert_int_equal(kh_child_status(c), 0);

    /* the admin sees both tenants */
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", 1, &r), 0);
    const msgpack_object *ts = kh_obj(r.root, "tenants");
    assert_true(ts->via.array.size >= 2);
    kh_reply_free(&r);
    assert_int_equal(kh_call0(fd, "admin_check", 2, &r), 0);
    kh_reply_free(&r);

    assert_int_equal(write(down[1], "x", 1), 1);
    assert_int_equal(kh_child_status(a), 0);
    close(up[0]);
    close(up[1]);
    close(down[0]);
    close(down[1]);
    assert_int_equal(kh_call0(fd, "admin_check", 3, &r), 0);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&kvd), 0);
}

static void write_conf(const char *path, unsigned max_blocks)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "[tenant:ops]\nuids = %u\nmax-device-blocks = %u\n", (unsigned)getuid(), max_blocks);
    fclose(f);
}

static void test_sighup_reloads_quotas(void **state)
{
    const char *args[] = {"--backend", "cpu", "--block-tokens", "4", "--device-blocks", "64", NULL};
    char initial[128];
    snprintf(initial, sizeof(initial), "[tenant:ops]\nuids = %u\nmax-device-blocks = 2\n",
             (unsigned)getuid());
    assert_int_equal(kh_start(&kvd, initial, args), 0);
    int fd = kh_connect(kvd.sock);
    uint64_t s = kh_seq_open(fd, 1);
    assert_true(s != 0);
    assert_int_equal(call_extend(fd, 2, s, 8), 0);
    assert_int_equal(call_extend(fd, 3, s, 4), KVD_EQUOTA);

    write_conf(kvd.conf, 4);
    assert_int_equal(kill(kvd.pid, SIGHUP), 0);
    /* The reload happens on the loop; poll until the new quota applies. */
    int rc = KVD_EQUOTA;
    for (int i = 0; i < 3000 && rc == KVD_EQUOTA; i++) {
        rc = call_extend(fd, 4, s, 4);
        if (rc == KVD_EQUOTA) {
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(rc, 0);
    assert_int_equal(call_extend(fd, 5, s, 4), 0);
    assert_int_equal(call_extend(fd, 6, s, 4), KVD_EQUOTA);

    /* a broken file keeps the previous configuration */
    FILE *f = fopen(kvd.conf, "w");
    fputs("[tenant:ops\nthis is not ini\n", f);
    fclose(f);
    assert_int_equal(kill(kvd.pid, SIGHUP), 0);
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "hello", 7, &r), 0);
    assert_true(str_is(kh_obj(r.root, "tenant"), "ops"));
    kh_reply_free(&r);
    assert_int_equal(call_extend(fd, 8, s, 4), KVD_EQUOTA);
    close(fd);
    assert_int_equal(kh_stop(&kvd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_tenants),
        cmocka_unit_test(test_sighup_reloads_quotas),
    };
    if (geteuid() != 0) {
        fprintf(stderr, "test_server_tenants: needs root (setuid children); skipped\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}

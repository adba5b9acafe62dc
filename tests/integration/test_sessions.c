/* Named sessions against a real store-mode kvd with a disk tier: save,
 * list, open (the K/V written before comes back byte for byte) across a
 * restart; a session's blocks survive a disk full of other blocks; TTL
 * expiry; the per-tenant max-disk-bytes; privacy between tenants; delete;
 * bad names and no disk tier. */
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

#include "kvd_harness.h"

#define BT 16
#define TOKEN_BYTES 128 /* 1 layer x K,V x 1 head x 32 dims x f16 */
#define N 70            /* 4 whole blocks and 6 tokens */
#define UID_B 60021
#define GID_ALL 65534

static char disk[64];

static const char *const conf =
    "[admin]\nuids = 0\n[tenant:small]\nuids = 60022\nmax-disk-bytes = 20K\n";

static void start(struct kh_proc *d, const char *mb)
{
    const char *const args[] = {"--backend",
                                "cpu",
                                "--kv-layers",
                                "1",
                                "--kv-heads",
                                "1",
                                "--head-dim",
                                "32",
                                "--disk-dir",
                                disk,
                                "--disk-max-bytes",
                                mb,
                                "--disk-writeback-ms",
                                "10",
                                "--socket-group",
                                "nogroup",
                                NULL};
    memset(d, 0, sizeof *d);
    assert_int_equal(kh_start(d, conf, args), 0);
}

static int setup(void **state)
{
    (void)state;
    snprintf(disk, sizeof disk, "/var/tmp/kvd-sess.XXXXXX");
    return mkdtemp(disk) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", disk);
    return system(cmd) == 0 ? 0 : -1;
}

static uint32_t tok(size_t i, uint32_t salt)
{
    return (uint32_t)(i * 7 + salt) % 5000;
}

/* A sequence holding N committed tokens (salted) with K/V bytes that say
 * which token they belong to. */
static uint64_t fill_seq(int fd, uint32_t salt, size_t n)
{
    struct kh_reply r;
    struct kh_req q;
    uint64_t s = kh_seq_open(fd, 1);
    assert_true(s != 0);
    kh_req_begin(&q, "seq_extend", 3, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    unsigned char *data = malloc(n * TOKEN_BYTES);
    for (size_t i = 0; i < n * TOKEN_BYTES; i++)
        data[i] = (unsigned char)(i * 31 + salt);
    kh_req_begin(&q, "kv_write", 4, 4);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", n);
    proto_pack_kv_bin(&q.pk, "data", data, n * TOKEN_BYTES);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    free(data);
    uint32_t *t = malloc(sizeof *t * n);
    for (size_t i = 0; i < n; i++)
        t[i] = tok(i, salt);
    kh_req_begin(&q, "seq_commit", 5, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_kv_u32_array(&q.pk, "tokens", t, n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    kh_reply_free(&r);
    free(t);
    return s;
}

static int save(int fd, uint64_t seq, const char *name, uint64_t ttl, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, "session_save", 10, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_str(&q.pk, "name", name);
    proto_pack_kv_uint(&q.pk, "ttl_s", ttl);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    if (r->code)
        fprintf(stderr, "session_save '%s': %s\n", name, r->message);
    return r->code;
}

static int by_name(int fd, const char *op, const char *name, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, 11, 1);
    proto_pack_kv_str(&q.pk, "name", name);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    return r->code;
}

static uint32_t n_sessions(int fd)
{
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "session_list", 12, &r), 0);
    uint32_t n = kh_obj(r.root, "sessions")->via.array.size;
    kh_reply_free(&r);
    return n;
}

/* Opens the session and checks the sequence holds its whole blocks with
 * the K/V bytes fill_seq wrote. */
static void open_and_check(int fd, const char *name, uint32_t salt)
{
    struct kh_reply r;
    assert_int_equal(by_name(fd, "session_open", name, &r), 0);
    uint64_t seq = kh_u64(r.root, "seq");
    assert_int_equal(kh_u64(r.root, "n_tokens"), (N / BT) * BT);
    const msgpack_object *t = kh_obj(r.root, "tokens");
    assert_int_equal(t->via.array.size, N);
    for (size_t i = 0; i < N; i++)
        assert_int_equal(t->via.array.ptr[i].via.u64, tok(i, salt));
    kh_reply_free(&r);
    struct kh_req q;
    size_t n = (N / BT) * BT;
    kh_req_begin(&q, "kv_read", 13, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", 0);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *d = kh_obj(r.root, "data");
    assert_int_equal(d->via.bin.size, n * TOKEN_BYTES);
    /* kv_write and kv_read both lay data out as [layer][K|V][head][token]
     * rows (64 bytes here): the K rows of the tokens, then their V rows. */
    size_t row = TOKEN_BYTES / 2;
    unsigned char *want = malloc(n * TOKEN_BYTES), *got = malloc(n * TOKEN_BYTES);
    memcpy(got, d->via.bin.ptr, n * TOKEN_BYTES);
    for (size_t i = 0; i < n * row; i++) {
        want[i] = (unsigned char)(i * 31 + salt);                       /* K */
        want[n * row + i] = (unsigned char)((N * row + i) * 31 + salt); /* V */
    }
    assert_memory_equal(got, want, n * TOKEN_BYTES);
    free(want);
    free(got);
    kh_reply_free(&r);
}

static void test_save_restart_open(void **state)
{
    (void)state;
    struct kh_proc d;
    struct kh_reply r;
    start(&d, "1M");
    int fd = kh_connect(d.sock);
    uint64_t s = fill_seq(fd, 1, N);
    assert_int_equal(save(fd, s, "chat-1", 3600, &r), 0);
    assert_int_equal(kh_u64(r.root, "n_tokens"), N);
    assert_int_equal(kh_u64(r.root, "blocks"), N / BT);
    kh_reply_free(&r);
    assert_int_equal(n_sessions(fd), 1);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);

    start(&d, "1M");
    fd = kh_connect(d.sock);
    assert_int_equal(n_sessions(fd), 1);
    open_and_check(fd, "chat-1", 1);
    /* Saving again under the name replaces it. */
    s = fill_seq(fd, 2, N);
    assert_int_equal(save(fd, s, "chat-1", 3600, &r), 0);
    kh_reply_free(&r);
    assert_int_equal(n_sessions(fd), 1);
    open_and_check(fd, "chat-1", 2);
    assert_int_equal(by_name(fd, "session_delete", "chat-1", &r), 0);
    kh_reply_free(&r);
    assert_int_equal(n_sessions(fd), 0);
    assert_int_equal(by_name(fd, "session_open", "chat-1", &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
}

/* A disk of 127 slots: the session's 4 pinned blocks outlive 200 others. */
static void test_pinned_blocks_are_not_evicted(void **state)
{
    (void)state;
    struct kh_proc d;
    struct kh_reply r;
    start(&d, "1M");
    int fd = kh_connect(d.sock);
    uint64_t s = fill_seq(fd, 3, N);
    assert_int_equal(save(fd, s, "keep", 3600, &r), 0);
    kh_reply_free(&r);
    for (uint32_t k = 0; k < 10; k++)
        fill_seq(fd, 100 + k, 20 * BT);
    /* Every block written (or skipped) by the writer, not only taken off
     * its queue: it takes a whole batch before it writes it. */
    const uint64_t all = N / BT + 10 * 20;
    for (int i = 0;
         i < 6000 && kh_stat(fd, "disk", "writes") + kh_stat(fd, "disk", "write_skips") < all; i++)
        usleep(10000);
    assert_true(kh_stat(fd, "disk", "evictions") > 0);
    assert_int_equal(kh_stat(fd, "disk", "used"), N / BT);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
    start(&d, "1M"); /* empty memory: the blocks can only come from disk */
    fd = kh_connect(d.sock);
    open_and_check(fd, "keep", 3);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
}

static void test_ttl_expiry(void **state)
{
    (void)state;
    struct kh_proc d;
    struct kh_reply r;
    start(&d, "1M");
    int fd = kh_connect(d.sock);
    uint64_t s = fill_seq(fd, 4, N);
    assert_int_equal(save(fd, s, "brief", 1, &r), 0);
    uint64_t expires = kh_u64(r.root, "expires");
    kh_reply_free(&r);
    while ((uint64_t)time(NULL) <= expires) /* wall time is what a TTL is about */
        usleep(50000);
    assert_int_equal(n_sessions(fd), 0);
    assert_int_equal(by_name(fd, "session_open", "brief", &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
}

static void test_bad_requests(void **state)
{
    (void)state;
    struct kh_proc d;
    struct kh_reply r;
    start(&d, "1M");
    int fd = kh_connect(d.sock);
    uint64_t s = fill_seq(fd, 5, N);
    assert_int_equal(save(fd, s, "no spaces", 60, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(save(fd, s, "", 60, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(save(fd, s, "ok", 0, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(save(fd, s + 99, "ok", 60, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
    /* No disk tier: unsupported, saying why. */
    const char *const args[] = {"--backend", "cpu", NULL};
    assert_int_equal(kh_start(&d, NULL, args), 0);
    fd = kh_connect(d.sock);
    assert_int_equal(kh_call0(fd, "session_list", 1, &r), KVD_EUNSUPPORTED);
    assert_non_null(strstr(r.message, "disk-dir"));
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
}

/* Another tenant sees none of root's sessions; a tenant over its
 * max-disk-bytes is refused. */
struct child {
    const char *sock;
};

static int child_other(void *arg)
{
    struct child *c = arg;
    struct kh_reply r;
    int fd = kh_connect(c->sock);
    if (fd < 0 || kh_call0(fd, "session_list", 1, &r) != 0)
        return 2;
    if (kh_obj(r.root, "sessions")->via.array.size != 0)
        return 3;
    kh_reply_free(&r);
    if (by_name(fd, "session_open", "mine", &r) != KVD_ENOTFOUND)
        return 4;
    kh_reply_free(&r);
    return 0;
}

static int child_small(void *arg)
{
    struct child *c = arg;
    struct kh_reply r;
    int fd = kh_connect(c->sock);
    uint64_t s = fill_seq(fd, 6, N); /* 4 blocks of 8 KiB slots: over 20K */
    if (save(fd, s, "big", 60, &r) != KVD_EQUOTA)
        return 5;
    kh_reply_free(&r);
    return 0;
}

static void test_tenants(void **state)
{
    (void)state;
    struct kh_proc d;
    struct kh_reply r;
    if (geteuid() != 0)
        skip();
    start(&d, "1M");
    int fd = kh_connect(d.sock);
    uint64_t s = fill_seq(fd, 7, N);
    assert_int_equal(save(fd, s, "mine", 3600, &r), 0);
    kh_reply_free(&r);
    struct child c = {d.sock};
    assert_int_equal(kh_child_status(kh_run_as(UID_B, GID_ALL, child_other, &c)), 0);
    assert_int_equal(kh_child_status(kh_run_as(60022, GID_ALL, child_small, &c)), 0);
    assert_int_equal(n_sessions(fd), 1);
    close(fd);
    assert_int_equal(kh_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_save_restart_open, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pinned_blocks_are_not_evicted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ttl_expiry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tenants, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* kv_export against a real kvd (cpu backend): the mapped blocks equal
 * kv_read's bytes, another tenant is refused (each tenant's blocks are in
 * pages of its own, which it may export), an exported page keeps its
 * bytes after the sequence closes and the pool is refilled until released,
 * a holder that closes or is killed releases its pages, and a shared
 * block's descriptor cannot be mapped writable. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/client.h"
#include "kvd_harness.h"

static const char conf[] = "[front-end]\nuids = 0\n";

static int setup(void **state)
{
    static const char *const args[] = {"--backend", "cpu", "--device-blocks", "64", "--host-blocks",
                                       "16",        NULL};
    struct kh_proc *d = kh_new(conf, args);
    if (!d)
        return -1;
    *state = d;
    return 0;
}

static int teardown(void **state)
{
    kh_free(*state);
    return 0;
}

static struct kvd_ctx *connect_ok(struct kh_proc *d)
{
    struct kvd_ctx *c = kvd_connect(d->sock);
    assert_non_null(c);
    if (c->err)
        fail_msg("connect: %s", c->errstr);
    kvd_set_timeout(c, 30000);
    return c;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(seed * 131 + i * 7 + (i >> 9));
}

/* A sequence of n tokens holding fill(seed). */
static uint64_t make_seq(struct kvd_ctx *c, size_t n, size_t tb, unsigned seed)
{
    uint64_t seq;
    unsigned char *a = malloc(n * tb);
    assert_non_null(a);
    assert_int_equal(kvd_seq_open(c, NULL, &seq), 0);
    assert_int_equal(kvd_seq_extend(c, seq, n, NULL), 0);
    fill(a, n * tb, seed);
    assert_int_equal(kvd_kv_write(c, seq, 0, n, a, n * tb), 0);
    free(a);
    return seq;
}

static uint64_t stat_u(struct kvd_ctx *c, const char *path)
{
    struct kvd_reply *r = NULL;
    uint64_t v = UINT64_MAX;
    assert_int_equal(kvd_stats(c, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_path(r->body, path), &v), 0);
    kvd_reply_free(r);
    return v;
}

/* Whole blocks of an export equal kv_read of their tokens; the partial
 * last block's first tokens of every row run do. */
static void check_equal(struct kvd_ctx *c, uint64_t seq, const struct kvd_export *ex,
                        const struct kvd_hello_info *h, size_t n_tokens)
{
    size_t B = h->block_tokens, tb = h->token_bytes, rb = tb / (2 * h->layers * h->kv_heads);
    unsigned char *buf = malloc(B * tb);
    size_t len;
    assert_non_null(buf);
    for (size_t i = 0; i < ex->n_blocks; i++) {
        size_t b = ex->from_block + i, t0 = b * B, k = n_tokens - t0 < B ? n_tokens - t0 : B;
        assert_int_equal(ex->blocks[i].bytes, h->block_bytes);
        assert_int_equal(kvd_kv_read(c, seq, t0, k, buf, B * tb, &len), 0);
        for (size_t r = 0; r < 2 * h->layers * h->kv_heads; r++)
            assert_memory_equal((unsigned char *)ex->blocks[i].data + r * B * rb, buf + r * k * rb,
                                k * rb);
    }
    free(buf);
}

static void test_export_equals_read(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t B = h.block_tokens, n = 3 * B + B / 2;
    uint64_t seq = make_seq(c, n, h.token_bytes, 1);

    assert_int_equal(kvd_kv_export(c, seq, 0, 0, false, &ex), 0);
    assert_int_equal(ex->n_blocks, 4);
    assert_int_equal(ex->from_block, 0);
    check_equal(c, seq, ex, &h, n);
    for (size_t i = 0; i < ex->n_blocks; i++)
        assert_false(ex->blocks[i].writable);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);

    /* A sub-range: blocks 1..2. */
    assert_int_equal(kvd_kv_export(c, seq, B + 3, B, false, &ex), 0);
    assert_int_equal(ex->from_block, 1);
    assert_int_equal(ex->n_blocks, 2);
    check_equal(c, seq, ex, &h, n);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);

    /* Writable: the caller's own uncommitted blocks, filled in place. */
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, true, &ex), 0);
    for (size_t i = 0; i < ex->n_blocks; i++)
        assert_true(ex->blocks[i].writable);
    memset(ex->blocks[0].data, 0x5a, ex->blocks[0].bytes);
    unsigned char *buf = malloc(B * h.token_bytes);
    size_t len;
    assert_int_equal(kvd_kv_read(c, seq, 0, B, buf, B * h.token_bytes, &len), 0);
    for (size_t i = 0; i < len; i++)
        assert_int_equal(buf[i], 0x5a);
    free(buf);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);
    /* Range errors and an unknown export. */
    assert_int_equal(kvd_kv_export(c, seq, n, 1, false, &ex), KVD_EBADREQ);
    struct kvd_arg a = KVD_ARG_U("export", 999);
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT_RELEASE, &a, 1, NULL), KVD_ENOTFOUND);
    kvd_close(c);
}

static void test_shared_block_read_only(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t B = h.block_tokens, n = 2 * B;
    uint64_t seq = make_seq(c, n, h.token_bytes, 2);
    uint32_t *toks = malloc(n * sizeof *toks);
    for (size_t i = 0; i < n; i++)
        toks[i] = (uint32_t)(7 + i);
    assert_int_equal(kvd_seq_commit(c, seq, toks, n, NULL), 0);
    free(toks);
    /* Asked writable, but the blocks are in the prefix tree now. */
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, true, &ex), 0);
    assert_false(ex->blocks[0].writable);
    assert_false(ex->maps[0].writable);
    int fd = ex->maps[0].fd;
    errno = 0;
    void *w = mmap(NULL, ex->maps[0].len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(w == MAP_FAILED);
    assert_int_equal(errno, EACCES);
    assert_int_not_equal(mprotect(ex->maps[0].addr, ex->maps[0].len, PROT_READ | PROT_WRITE), 0);
    assert_true(write(fd, "x", 1) < 0);
    assert_int_not_equal(ftruncate(fd, 0), 0);
    check_equal(c, seq, ex, &h, n);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);
    kvd_close(c);
}

static void test_other_tenant_refused(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_reply *r = NULL;
    uint64_t sa, sb;
    struct kvd_hello_info h;
    assert_int_equal(kvd_hello(c, &h), 0);
    /* Sub-tenant a opens a sequence; sub-tenant b may not export it. */
    struct kvd_arg oa[] = {KVD_ARG_S("tenant", "a")};
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_OPEN, oa, 1, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "seq"), &sa), 0);
    kvd_reply_free(r);
    struct kvd_arg ea[] = {KVD_ARG_U("seq", sa), KVD_ARG_U("n", 4), KVD_ARG_S("tenant", "a")};
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_EXTEND, ea, 3, NULL), 0);
    struct kvd_arg xb[] = {KVD_ARG_U("seq", sa), KVD_ARG_S("tenant", "b")};
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT, xb, 2, NULL), KVD_EPERM);
    /* A page holds one tenant's blocks: b's own sequence is in pages of
     * its own, so b may export it, and a its own. */
    struct kvd_arg ob[] = {KVD_ARG_S("tenant", "b")};
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_OPEN, ob, 1, &r), 0);
    assert_int_equal(kvd_value_u64(kvd_value_get(r->body, "seq"), &sb), 0);
    kvd_reply_free(r);
    struct kvd_arg eb[] = {KVD_ARG_U("seq", sb), KVD_ARG_U("n", 4), KVD_ARG_S("tenant", "b")};
    assert_int_equal(kvd_call(c, KVD_OP_SEQ_EXTEND, eb, 3, NULL), 0);
    struct kvd_arg xbb[] = {KVD_ARG_U("seq", sb), KVD_ARG_S("tenant", "b")};
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT, xbb, 2, NULL), 0);
    struct kvd_arg xa[] = {KVD_ARG_U("seq", sa), KVD_ARG_S("tenant", "a")};
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT, xa, 2, NULL), 0);
    /* b still may not export a's. */
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT, xb, 2, NULL), KVD_EPERM);
    assert_non_null(strstr(c->errstr, "another tenant"));
    struct kvd_arg ck[] = {KVD_ARG_U("seq", sa)};
    assert_int_equal(kvd_call(c, KVD_OP_KV_EXPORT_RELEASE, ck, 1, NULL), 0);
    assert_int_equal(kvd_call(c, KVD_OP_ADMIN_CHECK, NULL, 0, &r), 0);
    kvd_reply_free(r);
    kvd_close(c);
}

static void test_valid_until_release(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    struct kvd_export *ex = NULL;
    assert_int_equal(kvd_hello(c, &h), 0);
    size_t B = h.block_tokens, n = 4 * B;
    uint64_t seq = make_seq(c, n, h.token_bytes, 3);
    assert_int_equal(kvd_kv_export(c, seq, 0, 0, false, &ex), 0);
    size_t nb = ex->n_blocks * h.block_bytes;
    unsigned char *copy = malloc(nb);
    for (size_t i = 0; i < ex->n_blocks; i++)
        memcpy(copy + i * h.block_bytes, ex->blocks[i].data, h.block_bytes);
    assert_true(stat_u(c, "exports.pages") >= 1);
    assert_int_equal(kvd_seq_close(c, seq), 0);
    /* Fill every block the pool will still give with other bytes. */
    struct kvd_stats_summary st;
    assert_int_equal(kvd_stats_summary(c, &st), 0);
    assert_true(stat_u(c, "exports.withheld") >= 4);
    uint64_t filler = make_seq(c, st.device_free * B, h.token_bytes, 9);
    assert_int_not_equal(kvd_seq_extend(c, filler, B, NULL), 0); /* the pool is full */
    for (size_t i = 0; i < ex->n_blocks; i++)
        assert_memory_equal(ex->blocks[i].data, copy + i * h.block_bytes, h.block_bytes);
    assert_int_equal(kvd_kv_export_release(c, ex), 0);
    assert_int_equal(stat_u(c, "exports.pages"), 0);
    assert_int_equal(stat_u(c, "exports.exports"), 0);
    /* Released and empty: the page's slots are the pool's again. */
    assert_int_equal(kvd_seq_extend(c, filler, B, NULL), 0);
    struct kvd_reply *r = NULL;
    assert_int_equal(kvd_call(c, KVD_OP_ADMIN_CHECK, NULL, 0, &r), 0);
    kvd_reply_free(r);
    free(copy);
    kvd_close(c);
}

/* Stats until exports.pages is 0 (the daemon sees the EOF on its loop). */
static void wait_released(struct kvd_ctx *c)
{
    for (int i = 0; i < 1000 && stat_u(c, "exports.pages") != 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(stat_u(c, "exports.pages"), 0);
    assert_int_equal(stat_u(c, "exports.exports"), 0);
}

static void test_holder_death_releases(void **state)
{
    struct kh_proc *d = *state;
    struct kvd_ctx *c = connect_ok(d);
    struct kvd_hello_info h;
    assert_int_equal(kvd_hello(c, &h), 0);

    /* Closing the connection releases. */
    struct kvd_ctx *c2 = connect_ok(d);
    struct kvd_export *ex = NULL;
    uint64_t s2 = make_seq(c2, 2 * h.block_tokens, h.token_bytes, 4);
    assert_int_equal(kvd_kv_export(c2, s2, 0, 0, false, &ex), 0);
    assert_true(stat_u(c, "exports.pages") >= 1);
    kvd_close(c2); /* ex's maps stay this process's until freed */
    wait_released(c);
    for (size_t i = 0; i < ex->n_maps; i++) {
        munmap(ex->maps[i].addr, ex->maps[i].len);
        close(ex->maps[i].fd);
    }
    free(ex->maps);
    free(ex->blocks);
    free(ex);

    /* kill -9 of a holder releases. */
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct kvd_ctx *k = kvd_connect(d->sock);
        struct kvd_export *kx = NULL;
        uint64_t s;
        char ok = 'n';
        if (!k->err && kvd_seq_open(k, NULL, &s) == 0 && kvd_seq_extend(k, s, 8, NULL) == 0 &&
            kvd_kv_export(k, s, 0, 0, false, &kx) == 0)
            ok = 'y';
        if (write(pfd[1], &ok, 1) != 1)
            _exit(2);
        pause();
        _exit(0);
    }
    char ok = 0;
    assert_int_equal(read(pfd[0], &ok, 1), 1);
    assert_int_equal(ok, 'y');
    assert_true(stat_u(c, "exports.pages") >= 1);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(pfd[0]);
    close(pfd[1]);
    wait_released(c);
    kvd_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_export_equals_read, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shared_block_read_only, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_tenant_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_valid_until_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_holder_death_releases, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

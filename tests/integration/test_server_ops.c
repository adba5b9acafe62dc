/* Integration test of every op's success and error paths against a real
 * kvd in store mode (cpu backend, a tiny geometry: 2 layers, 2 kv heads,
 * head_dim 8, f32, 4 tokens per block = 256 bytes per token, 1 KiB blocks).
 * hello and the block API's whole life (write/read layout, COW, match,
 * offload to the host tier and back) run again on q8_0 and fp8 rows of
 * head_dim 32 (34 and 36 bytes: protocol.md section 6). */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

/* The KV dtype of the daemon under test, its head_dim and bytes per row. */
struct kv_case {
    const char *dtype, *head_dim;
    size_t row_bytes;
};
static struct kv_case g_kv = {"f32", "8", 32};

#define ROWS 8u                             /* layers(2) x K|V x kv_heads(2) */
#define RB g_kv.row_bytes                   /* bytes of one token's row */
#define TOKEN_BYTES (ROWS * g_kv.row_bytes) /* 256 for f32 */
#define BLOCK_TOKENS 4u

static struct kh_proc kvd;

static int setup(void **state)
{
    const char *args[] = {"--backend",
                          "cpu",
                          "--kv-layers",
                          "2",
                          "--kv-heads",
                          "2",
                          "--head-dim",
                          g_kv.head_dim,
                          "--kv-dtype",
                          g_kv.dtype,
                          "--block-tokens",
                          "4",
                          "--device-blocks",
                          "16",
                          "--host-blocks",
                          "16",
                          NULL};
    return kh_start(&kvd, NULL, args);
}

static int setup_q8_0(void **state)
{
    g_kv = (struct kv_case){"q8_0", "32", 34}; /* one block: f16 d + 32 int8 */
    return setup(state);
}

static int setup_fp8(void **state)
{
    g_kv = (struct kv_case){"fp8", "32", 36}; /* f32 scale + 32 e4m3 */
    return setup(state);
}

static int teardown(void **state)
{
    return kh_stop(&kvd) == 0 ? 0 : -1;
}

static int conn(void)
{
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    return fd;
}

static void fill(uint8_t *buf, size_t len, uint8_t seed)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)(seed + i * 7);
}

static int kv_write(int fd, uint64_t id, uint64_t seq, uint64_t start, uint64_t n, const void *data,
                    size_t len, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, "kv_write", id, 4);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", start);
    proto_pack_kv_uint(&q.pk, "n", n);
    proto_pack_kv_bin(&q.pk, "data", data, len);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    assert_int_equal(r->id, id);
    return r->code;
}

static int kv_read(int fd, uint64_t id, uint64_t seq, uint64_t start, uint64_t n,
                   struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, "kv_read", id, 3);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "start", start);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    assert_int_equal(r->id, id);
    return r->code;
}

static int seq_tokens(int fd, const char *op, uint64_t id, uint64_t seq, const uint32_t *t,
                      size_t n, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, op, id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_u32_array(&q.pk, "tokens", t, n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    assert_int_equal(r->id, id);
    return r->code;
}

static int extend(int fd, uint64_t id, uint64_t seq, uint64_t n, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, "seq_extend", id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_kv_uint(&q.pk, "n", n);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, r), 0);
    return r->code;
}

static void test_hello(void **state)
{
    int fd = conn();
    struct kh_reply r;
    struct kh_req q;

    kh_req_begin(&q, "hello", 1, 2);
    proto_pack_kv_uint(&q.pk, "version", 1);
    proto_pack_kv_str(&q.pk, "client", "test_server_ops");
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_OK);
    assert_int_equal(r.id, 1);
    assert_int_equal(kh_u64(r.root, "version"), 1);
    assert_int_equal(kh_u64(r.root, "block_tokens"), BLOCK_TOKENS);
    const msgpack_object *o = kh_obj(r.root, "backend");
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    assert_memory_equal(o->via.str.ptr, "cpu", 3);
    o = kh_obj(r.root, "model");
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_NIL);
    o = kh_obj(r.root, "tenant");
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    assert_non_null(kh_obj(r.root, "server"));
    const msgpack_object *kv = kh_obj(r.root, "kv");
    assert_non_null(kv);
    assert_int_equal(kh_u64(kv, "layers"), 2);
    assert_int_equal(kh_u64(kv, "kv_heads"), 2);
    assert_int_equal(kh_u64(kv, "head_dim"), atoi(g_kv.head_dim));
    assert_int_equal(kh_u64(kv, "block_bytes"), TOKEN_BYTES * BLOCK_TOKENS);
    assert_int_equal(kh_u64(kv, "token_bytes"), TOKEN_BYTES);
    o = kh_obj(kv, "dtype");
    assert_non_null(o);
    assert_int_equal(o->via.str.size, strlen(g_kv.dtype));
    assert_memory_equal(o->via.str.ptr, g_kv.dtype, strlen(g_kv.dtype));
    kh_reply_free(&r);

    /* A version the server does not speak. */
    assert_int_equal(kh_call1(fd, "hello", 2, "version", 2, &r), KVD_EUNSUPPORTED);
    assert_int_equal(r.id, 2);
    kh_reply_free(&r);
    /* client of the wrong type: bad_request naming the key. */
    kh_req_begin(&q, "hello", 3, 1);
    proto_pack_kv_uint(&q.pk, "client", 5);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "'client'"));
    kh_reply_free(&r);
    close(fd);
}

static void test_stats(void **state)
{
    int fd = conn();
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "stats", 7, &r), KVD_OK);
    const msgpack_object *dev = kh_obj(r.root, "device"), *host = kh_obj(r.root, "host");
    assert_non_null(dev);
    assert_non_null(host);
    assert_int_equal(kh_u64(dev, "total"), 16);
    assert_int_equal(kh_u64(host, "total"), 16);
    assert_int_equal(kh_u64(dev, "free") + kh_u64(dev, "cached") + kh_u64(dev, "used"), 16);
    assert_non_null(kh_obj(r.root, "counters"));
    assert_non_null(kh_obj(kh_obj(r.root, "counters"), "match_tokens_hit"));
    const msgpack_object *t = kh_obj(r.root, "tenants");
    assert_non_null(t);
    assert_int_equal(t->type, MSGPACK_OBJECT_ARRAY);
    assert_true(t->via.array.size >= 1);
    assert_non_null(kh_obj(&t->via.array.ptr[0], "quota"));
    const msgpack_object *b = kh_obj(r.root, "backend");
    assert_non_null(b);
    assert_memory_equal(b->via.str.ptr, "cpu", 3);
    kh_reply_free(&r);
    close(fd);
}

static void test_seq_lifecycle(void **state)
{
    int fd = conn();
    struct kh_reply r;
    uint8_t data[6 * TOKEN_BYTES], other[TOKEN_BYTES];
    uint32_t toks[6] = {11, 12, 13, 14, 15, 16};
    uint64_t base_used = kh_stat(fd, "device", "used");

    uint64_t s = kh_seq_open(fd, 10);
    assert_true(s != 0);
    /* extend: 6 tokens = 2 blocks of 4 */
    assert_int_equal(extend(fd, 11, s, 6, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "n_tokens"), 6);
    assert_int_equal(kh_obj(r.root, "blocks")->via.array.size, 2);
    kh_reply_free(&r);
    /* extend by 1 more fits in the partial last block: no new block */
    assert_int_equal(extend(fd, 12, s, 1, &r), KVD_OK);
    assert_int_equal(kh_obj(r.root, "blocks")->via.array.size, 0);
    kh_reply_free(&r);

    fill(data, sizeof(data), 3);
    assert_int_equal(kv_write(fd, 13, s, 0, 6, data, sizeof(data), &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 14, s, 0, 6, &r), KVD_OK);
    const msgpack_object *d = kh_obj(r.root, "data");
    assert_non_null(d);
    assert_int_equal(d->type, MSGPACK_OBJECT_BIN);
    assert_int_equal(d->via.bin.size, sizeof(data));
    assert_memory_equal(d->via.bin.ptr, data, sizeof(data));
    kh_reply_free(&r);

    /* A sub-range has the documented layout: [layer][K|V][kv_head][token] rows
     * of RB bytes, so token 5 alone is every row's slice of the full read. */
    assert_int_equal(kv_read(fd, 15, s, 5, 1, &r), KVD_OK);
    d = kh_obj(r.root, "data");
    assert_int_equal(d->via.bin.size, TOKEN_BYTES);
    /* rows: layers(2)*2*kv_heads(2) = 8 rows of RB bytes each */
    for (size_t row = 0; row < ROWS; row++)
        assert_memory_equal((const uint8_t *)d->via.bin.ptr + row * RB,
                            data + row * 6 * RB + 5 * RB, RB);
    kh_reply_free(&r);

    /* wrong size, out of range, n == 0: bad_request */
    assert_int_equal(kv_write(fd, 16, s, 0, 6, data, sizeof(data) - 1, &r), KVD_EBADREQ);
    assert_non_null(strstr(r.message, "data"));
    kh_reply_free(&r);
    assert_int_equal(kv_write(fd, 17, s, 5, 4, data, 4 * TOKEN_BYTES, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 18, s, 6, 2, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 19, s, 0, 0, &r), KVD_EBADREQ);
    kh_reply_free(&r);

    /* commit: the first full block enters the tree */
    assert_int_equal(seq_tokens(fd, "seq_commit", 20, s, toks, 6, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "shared"), 1);
    kh_reply_free(&r);

    /* seq_info */
    assert_int_equal(kh_call1(fd, "seq_info", 21, "seq", s, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "n_tokens"), 7);
    const msgpack_object *bl = kh_obj(r.root, "blocks");
    assert_int_equal(bl->via.array.size, 2);
    const msgpack_object *tier = kh_obj(&bl->via.array.ptr[0], "tier");
    assert_non_null(tier);
    assert_memory_equal(tier->via.str.ptr, "device", 6);
    assert_true(kh_u64(&bl->via.array.ptr[0], "id") != UINT64_MAX);
    kh_reply_free(&r);

    /* fork, then copy-on-write: the child's write leaves the parent alone */
    assert_int_equal(kh_call1(fd, "seq_fork", 22, "seq", s, &r), KVD_OK);
    uint64_t child = kh_u64(r.root, "seq");
    assert_true(child != UINT64_MAX && child != s);
    kh_reply_free(&r);
    fill(other, sizeof(other), 99);
    assert_int_equal(kv_write(fd, 23, child, 5, 1, other, sizeof(other), &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 24, s, 0, 6, &r), KVD_OK);
    assert_memory_equal(kh_obj(r.root, "data")->via.bin.ptr, data, sizeof(data));
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 25, child, 5, 1, &r), KVD_OK);
    assert_memory_equal(kh_obj(r.root, "data")->via.bin.ptr, other, sizeof(other));
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_close", 26, "seq", child, &r), KVD_OK);
    kh_reply_free(&r);

    /* match on a second sequence reuses the committed block */
    uint64_t s2 = kh_seq_open(fd, 27);
    assert_true(s2 != 0);
    assert_int_equal(seq_tokens(fd, "seq_match", 28, s2, toks, 6, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "matched"), 4);
    assert_int_equal(kh_obj(r.root, "blocks")->via.array.size, 1);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 29, s2, 0, 4, &r), KVD_OK);
    for (size_t row = 0; row < ROWS; row++)
        assert_memory_equal((const uint8_t *)kh_obj(r.root, "data")->via.bin.ptr + row * 4 * RB,
                            data + row * 6 * RB, 4 * RB);
    kh_reply_free(&r);
    /* matching into a non-empty sequence is refused */
    assert_int_not_equal(seq_tokens(fd, "seq_match", 30, s2, toks, 6, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_close", 31, "seq", s2, &r), KVD_OK);
    kh_reply_free(&r);

    /* offload: blocks go to the host tier, still readable; restore brings them back */
    assert_int_equal(kh_call1(fd, "seq_offload", 32, "seq", s, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_info", 33, "seq", s, &r), KVD_OK);
    bl = kh_obj(r.root, "blocks");
    size_t on_host = 0;
    for (uint32_t i = 0; i < bl->via.array.size; i++) {
        tier = kh_obj(&bl->via.array.ptr[i], "tier");
        on_host += tier->via.str.size == 4 && !memcmp(tier->via.str.ptr, "host", 4);
    }
    assert_true(on_host >= 1);
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_restore", 34, "seq", s, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "host_blocks"), 0);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 35, s, 0, 6, &r), KVD_OK);
    assert_memory_equal(kh_obj(r.root, "data")->via.bin.ptr, data, sizeof(data));
    kh_reply_free(&r);

    /* no memory: the sequence is unchanged */
    assert_int_equal(extend(fd, 36, s, 16 * 4 + 1, &r), KVD_ENOMEM);
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_info", 37, "seq", s, &r), KVD_OK);
    assert_int_equal(kh_u64(r.root, "n_tokens"), 7);
    kh_reply_free(&r);

    /* close; a second close is not_found */
    assert_int_equal(kh_call1(fd, "seq_close", 38, "seq", s, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "seq_close", 39, "seq", s, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    assert_int_equal(kh_stat(fd, "device", "used"), base_used);
    close(fd);
}

static void test_handles_and_args(void **state)
{
    int a = conn(), b = conn();
    struct kh_reply r;
    uint64_t s = kh_seq_open(a, 1);
    assert_true(s != 0);
    /* unknown handle */
    assert_int_equal(kh_call1(a, "seq_info", 2, "seq", 0xdeadbeefull, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    /* another connection's handle: not_found on every op */
    const char *ops[] = {"seq_info", "seq_close", "seq_fork", "seq_offload", "seq_restore"};
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
        assert_int_equal(kh_call1(b, ops[i], 3, "seq", s, &r), KVD_ENOTFOUND);
        kh_reply_free(&r);
    }
    assert_int_equal(extend(b, 4, s, 4, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    assert_int_equal(kv_read(b, 5, s, 0, 1, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    /* still fine on its own connection */
    assert_int_equal(kh_call1(a, "seq_info", 6, "seq", s, &r), KVD_OK);
    kh_reply_free(&r);
    /* missing and mistyped arguments name the key */
    assert_int_equal(kh_call1(a, "seq_extend", 7, "seq", s, &r), KVD_EBADREQ);
    assert_non_null(strstr(r.message, "'n'"));
    kh_reply_free(&r);
    struct kh_req q;
    kh_req_begin(&q, "seq_info", 8, 1);
    proto_pack_kv_str(&q.pk, "seq", "one");
    assert_int_equal(kh_req_send(a, &q), 0);
    assert_int_equal(kh_recv(a, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "'seq'"));
    kh_reply_free(&r);
    kh_req_begin(&q, "seq_match", 9, 2);
    proto_pack_kv_uint(&q.pk, "seq", s);
    proto_pack_str(&q.pk, "tokens");
    msgpack_pack_array(&q.pk, 2);
    msgpack_pack_uint32(&q.pk, 1);
    msgpack_pack_int32(&q.pk, -1);
    assert_int_equal(kh_req_send(a, &q), 0);
    assert_int_equal(kh_recv(a, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "'tokens'[1]"));
    kh_reply_free(&r);
    /* a namespace the tenant was not given */
    kh_req_begin(&q, "seq_open", 10, 1);
    proto_pack_kv_str(&q.pk, "namespace", "someone-else");
    assert_int_equal(kh_req_send(a, &q), 0);
    assert_int_equal(kh_recv(a, &r), 0);
    kh_expect(&r, KVD_EPERM);
    kh_reply_free(&r);
    close(a);
    close(b);
}

static void test_generate_cancel_store_mode(void **state)
{
    int fd = conn();
    struct kh_reply r;
    struct kh_req q;
    uint32_t toks[3] = {1, 2, 3};
    kh_req_begin(&q, "generate", 1, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", toks, 3);
    proto_pack_kv_uint(&q.pk, "max_tokens", 4);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EUNSUPPORTED);
    assert_non_null(strstr(r.message, "store mode"));
    kh_reply_free(&r);
    assert_int_equal(kh_call1(fd, "cancel", 2, "target", 1, &r), KVD_ENOTFOUND);
    kh_reply_free(&r);
    assert_int_equal(kh_call0(fd, "cancel", 3, &r), KVD_EBADREQ);
    kh_reply_free(&r);
    close(fd);
}

static void test_admin_ops(void **state)
{
    int fd = conn();
    struct kh_reply r;
    struct kh_req q;
    /* the tests run as root, an admin by default */
    assert_int_equal(kh_call0(fd, "admin_check", 1, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kh_call0(fd, "admin_evict", 2, &r), KVD_OK);
    assert_true(kh_u64(r.root, "evicted") != UINT64_MAX);
    kh_reply_free(&r);
    kh_req_begin(&q, "admin_evict", 3, 1);
    proto_pack_kv_str(&q.pk, "tier", "disk");
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    kh_reply_free(&r);
    assert_int_equal(kh_stat(fd, "device", "cached"), 0);
    close(fd);
}

static void test_pipelining(void **state)
{
    int fd = conn();
    struct kh_req q[3];
    struct kh_reply r;
    msgpack_sbuffer all;
    msgpack_sbuffer_init(&all);
    for (int i = 0; i < 3; i++) {
        kh_req_begin(&q[i], i == 1 ? "nope" : "hello", 100 + i, 0);
        proto_frame_end(&q[i].sb, q[i].at);
        msgpack_sbuffer_write(&all, q[i].sb.data, q[i].sb.size);
        msgpack_sbuffer_destroy(&q[i].sb);
    }
    assert_int_equal(kh_send_raw(fd, all.data, all.size), 0);
    msgpack_sbuffer_destroy(&all);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kh_recv(fd, &r), 0);
        assert_int_equal(r.id, 100 + i);
        assert_int_equal(r.code, i == 1 ? KVD_EUNKNOWN_OP : KVD_OK);
        kh_reply_free(&r);
    }
    close(fd);
}

static void test_kv_read_too_large(void **state)
{
    /* A read bigger than max_frame is refused with too_large, not truncated. */
    struct kh_proc small;
    const char *args[] = {"--backend",      "cpu", "--max-frame",     "4096", "--kv-layers", "2",
                          "--kv-heads",     "2",   "--head-dim",      "8",    "--kv-dtype",  "f32",
                          "--block-tokens", "4",   "--device-blocks", "64",   NULL};
    assert_int_equal(kh_start(&small, NULL, args), 0);
    int fd = kh_connect(small.sock);
    struct kh_reply r;
    uint64_t s = kh_seq_open(fd, 1);
    assert_int_equal(extend(fd, 2, s, 32, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 3, s, 0, 32, &r), KVD_ETOOLARGE);
    kh_reply_free(&r);
    assert_int_equal(kv_read(fd, 4, s, 0, 8, &r), KVD_OK);
    kh_reply_free(&r);
    close(fd);
    assert_int_equal(kh_stop(&small), 0);
}

/* kh_expect's message names both codes and carries the daemon's message
 * (what a failing test prints instead of "0x5 != 0"). */
static void test_expect_names_codes(void **state)
{
    (void)state;
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    char msg[512];
    assert_true(fd >= 0);
    assert_int_equal(kh_call1(fd, "seq_info", 1, "seq", 424242, &r), KVD_ENOTFOUND);
    kh_expect(&r, KVD_ENOTFOUND);
    assert_int_equal(kh_expect_code(&r, KVD_OK, msg, sizeof(msg)), -1);
    if (!strstr(msg, "not_found") || !strstr(msg, "want ok") || !strstr(msg, r.message) ||
        !r.message[0])
        fail_msg("unhelpful: %s", msg);
    assert_int_equal(kh_expect_code(&r, KVD_EBADREQ, msg, sizeof(msg)), -1);
    assert_non_null(strstr(msg, "want bad_request"));
    kh_reply_free(&r);
    assert_int_equal(kh_call0(fd, "hello", 2, &r), 0);
    kh_expect(&r, KVD_OK);
    assert_int_equal(kh_expect_code(&r, KVD_ENOTFOUND, msg, sizeof(msg)), -1);
    assert_non_null(strstr(msg, "ok, want not_found"));
    kh_reply_free(&r);
    close(fd);
}

/* --gpu-mem on the cpu backend: a fraction of physical memory (the
 * backend's mem_info), here about 16 blocks of 64 KiB. */
static void test_gpu_mem_fraction_cpu(void **state)
{
    (void)state;
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    char frac[64];
    snprintf(frac, sizeof(frac), "%.12f", 16.5 * 65536 / phys);
    const char *args[] = {"--backend", "cpu", "--gpu-mem", frac, "--host-blocks", "0", NULL};
    struct kh_proc p;
    assert_int_equal(kh_start(&p, NULL, args), 0);
    int fd = kh_connect(p.sock);
    assert_true(fd >= 0);
    uint64_t total = kh_stat(fd, "device", "total");
    if (total < 15 || total > 16)
        fail_msg("--gpu-mem %s of %.0f bytes gave %llu blocks, want 16", frac, phys,
                 (unsigned long long)total);
    close(fd);
    assert_int_equal(kh_stop(&p), 0);
}

/* A test that fails leaves its daemon running (its assertion jumps past
 * kh_stop): at exit the fixture prints that daemon's log, kills it and
 * removes its directory. A child process plays the failed test. */
static void test_fixture_cleans_up_after_failure(void **state)
{
    (void)state;
    char errpath[] = "/tmp/kvd-fixture-err.XXXXXX";
    int errfd = mkstemp(errpath), pp[2];
    assert_true(errfd >= 0);
    assert_int_equal(pipe(pp), 0);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        struct kh_proc p;
        const char *args[] = {"--log-level", "info", NULL};
        dup2(errfd, 2);
        if (kh_start(&p, NULL, args) != 0)
            _exit(3);
        if (write(pp[1], &p, sizeof(p)) != (ssize_t)sizeof(p))
            _exit(4);
        exit(1); /* "failed": never stopped */
    }
    struct kh_proc seen;
    assert_int_equal(read(pp[0], &seen, sizeof(seen)), (ssize_t)sizeof(seen));
    assert_int_equal(kh_child_status(child), 1);
    close(pp[0]);
    close(pp[1]);
    assert_int_equal(kill(seen.pid, 0), -1); /* killed and reaped */
    assert_int_equal(access(seen.dir, F_OK), -1);
    char text[8192] = "";
    ssize_t n = pread(errfd, text, sizeof(text) - 1, 0);
    close(errfd);
    unlink(errpath);
    assert_true(n > 0);
    text[n] = '\0';
    if (!strstr(text, "was not stopped") || !strstr(text, "---- kvd log") ||
        !strstr(text, "store mode:")) /* logged before READY=1 */
        fail_msg("the fixture printed: %s", text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello),
        cmocka_unit_test(test_stats),
        cmocka_unit_test(test_seq_lifecycle),
        cmocka_unit_test(test_handles_and_args),
        cmocka_unit_test(test_generate_cancel_store_mode),
        cmocka_unit_test(test_admin_ops),
        cmocka_unit_test(test_pipelining),
        cmocka_unit_test(test_kv_read_too_large),
        cmocka_unit_test(test_expect_names_codes),
        cmocka_unit_test(test_fixture_cleans_up_after_failure),
        cmocka_unit_test(test_gpu_mem_fraction_cpu),
    };
    const struct CMUnitTest rows[] = {
        cmocka_unit_test(test_hello),
        cmocka_unit_test(test_seq_lifecycle),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    failed += cmocka_run_group_tests_name("q8_0 rows", rows, setup_q8_0, teardown);
    failed += cmocka_run_group_tests_name("fp8 rows", rows, setup_fp8, teardown);
    return failed;
}

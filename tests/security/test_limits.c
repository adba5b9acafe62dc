/* Limits an untrusted client cannot get past, against a real kvd: frame
 * lengths (0xFFFFFFFF, max_frame + 1 and exactly max_frame), array limits
 * (KVD_MAX_ARRAY + 1 tokens, a tiny frame claiming 2^32 - 1 elements) and
 * integer overflow in lengths (n huge, start + n wrapping at 32 and 64 bits,
 * n × token_bytes overflowing). Every case gets its error code, the
 * sequence is unchanged, other connections never notice, and the memory
 * manager's invariants hold afterwards. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "kvd_harness.h"

#define MAX_FRAME (8u << 20)
#define TOKEN_BYTES (2 * 2 * 1 * 8 * 2) /* layers * K|V * heads * head_dim * f16 */

static struct kh_proc kvd;
static const char *const kvd_args[] = {"--backend",
                                       "cpu",
                                       "--block-tokens",
                                       "4",
                                       "--kv-layers",
                                       "2",
                                       "--kv-heads",
                                       "1",
                                       "--head-dim",
                                       "8",
                                       "--kv-dtype",
                                       "f16",
                                       "--device-blocks",
                                       "64",
                                       "--host-blocks",
                                       "16",
                                       "--max-frame",
                                       "8M",
                                       NULL};
static int bystander = -1; /* a connection that must never notice anything */

static int setup(void **state)
{
    if (kh_start(&kvd, NULL, kvd_args))
        return -1;
    bystander = kh_connect(kvd.sock);
    return bystander >= 0 ? 0 : -1;
}

static int teardown(void **state)
{
    close(bystander);
    return kh_stop(&kvd) == 0 ? 0 : -1;
}

static void bystander_ok(void)
{
    static uint64_t id = 1000;
    struct kh_reply r;
    assert_int_equal(kh_call0(bystander, "hello", id++, &r), 0);
    kh_reply_free(&r);
}

/* Raw bytes on a fresh connection: one error reply (code, id 0) and the
 * connection closed. */
static void expect_close(const void *bytes, size_t len, int code, int alt)
{
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_true(fd >= 0);
    assert_int_equal(kh_send_raw(fd, bytes, len), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_true(r.code == code || r.code == alt);
    assert_int_equal(r.id, 0);
    kh_reply_free(&r);
    assert_true(kh_peer_closed(fd));
    close(fd);
    bystander_ok();
}

static void test_frame_lengths(void **state)
{
    static const uint8_t ffff[] = {0xff, 0xff, 0xff, 0xff, 0x80};
    expect_close(ffff, sizeof(ffff), KVD_ETOOLARGE, KVD_ETOOLARGE);
    uint8_t over[5] = {(MAX_FRAME + 1) >> 24, (MAX_FRAME + 1) >> 16 & 0xff,
                       (MAX_FRAME + 1) >> 8 & 0xff, (MAX_FRAME + 1) & 0xff, 0x80};
    expect_close(over, sizeof(over), KVD_ETOOLARGE, KVD_ETOOLARGE);
    static const uint8_t zero[] = {0, 0, 0, 0};
    expect_close(zero, sizeof(zero), KVD_EBADREQ, KVD_EBADREQ);

    /* Exactly max_frame: a hello padded with an unknown key is fine. */
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(&sb);
    proto_request_begin(&pk, "hello", 7, 1);
    proto_pack_str(&pk, "pad");
    size_t head = sb.size - at - 4 + 5; /* + bin32 header */
    msgpack_pack_bin(&pk, MAX_FRAME - head);
    assert_non_null(proto_sbuf_extend(&sb, MAX_FRAME - head));
    assert_int_equal(proto_frame_end(&sb, at), 0);
    assert_int_equal(sb.size, (size_t)MAX_FRAME + 4);
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_int_equal(kh_send_raw(fd, sb.data, sb.size), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    assert_int_equal(r.id, 7);
    kh_reply_free(&r);
    close(fd);
    msgpack_sbuffer_destroy(&sb);
}

/* seq_match with n tokens (all small ids) on a fresh sequence. */
static int match_n(int fd, uint64_t id, uint64_t seq, size_t n, struct kh_reply *r)
{
    struct kh_req q;
    kh_req_begin(&q, "seq_match", id, 2);
    proto_pack_kv_uint(&q.pk, "seq", seq);
    proto_pack_str(&q.pk, "tokens");
    msgpack_pack_array(&q.pk, n);
    for (size_t i = 0; i < n; i++)
        msgpack_pack_uint32(&q.pk, (uint32_t)(i & 0x7f));
    if (kh_req_send(fd, &q) || kh_recv(fd, r))
        return -1;
    return r->code;
}

static void test_array_limits(void **state)
{
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    uint64_t s = kh_seq_open(fd, 1);
    assert_true(s != 0);
    /* One over the limit: too_large (the parser refuses the frame, so the
     * server answers and closes that connection). */
    assert_int_equal(match_n(fd, 2, s, KVD_MAX_ARRAY + 1, &r), KVD_ETOOLARGE);
    assert_true(r.message[0] != '\0');
    kh_reply_free(&r);
    assert_true(kh_peer_closed(fd));
    close(fd);
    bystander_ok();
    /* At the limit: accepted (nothing cached, so nothing matched). */
    fd = kh_connect(kvd.sock);
    s = kh_seq_open(fd, 1);
    assert_true(s != 0);
    assert_int_equal(match_n(fd, 3, s, KVD_MAX_ARRAY, &r), 0);
    assert_int_equal(kh_u64(r.root, "matched"), 0);
    kh_reply_free(&r);
    close(fd);

    /* A 17-byte frame claiming an array of 2^32 - 1 tokens: refused from
     * the structure alone, before anything is allocated. */
    static const uint8_t claim[] = {0,   0,   0,   13,   0x81, 0xa6, 't',  'o', 'k',
                                    'e', 'n', 's', 0xdd, 0xff, 0xff, 0xff, 0xff};
    int fd2 = kh_connect(kvd.sock);
    assert_int_equal(kh_send_raw(fd2, claim, sizeof(claim)), 0);
    assert_int_equal(kh_recv(fd2, &r), 0);
    assert_true(r.code == KVD_ETOOLARGE || r.code == KVD_EBADREQ);
    kh_reply_free(&r);
    close(fd2);
    /* A map claiming 2^32 - 1 pairs. */
    static const uint8_t mclaim[] = {0, 0, 0, 5, 0xdf, 0xff, 0xff, 0xff, 0xff};
    expect_close(mclaim, sizeof(mclaim), KVD_ETOOLARGE, KVD_EBADREQ);
    bystander_ok();
}

/* A request with uint args (keys[i] = vals[i]) and optional bin data. */
static int call_u(int fd, const char *op, uint64_t id, const char *const *keys,
                  const uint64_t *vals, size_t n, const void *data, size_t dlen)
{
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, op, id, n + (data ? 1 : 0));
    for (size_t i = 0; i < n; i++)
        proto_pack_kv_uint(&q.pk, keys[i], vals[i]);
    if (data)
        proto_pack_kv_bin(&q.pk, "data", data, dlen);
    if (kh_req_send(fd, &q) || kh_recv(fd, &r))
        return -1;
    int code = r.code;
    if (code)
        assert_true(r.message[0] != '\0');
    kh_reply_free(&r);
    return code;
}

static uint64_t n_tokens(int fd, uint64_t seq)
{
    struct kh_reply r;
    assert_int_equal(kh_call1(fd, "seq_info", 99, "seq", seq, &r), 0);
    uint64_t n = kh_u64(r.root, "n_tokens");
    kh_reply_free(&r);
    return n;
}

static void test_integer_overflow(void **state)
{
    static const char *const ext[] = {"seq", "n"};
    static const char *const rw[] = {"seq", "start", "n"};
    uint8_t data[4 * TOKEN_BYTES] = {1};
    int fd = kh_connect(kvd.sock);
    uint64_t s = kh_seq_open(fd, 1);
    assert_true(s != 0);
    assert_int_equal(call_u(fd, "seq_extend", 2, ext, (uint64_t[]){s, 8}, 2, NULL, 0), 0);

    /* n huge: refused, the sequence unchanged */
    const uint64_t huge[] = {UINT64_MAX, UINT64_MAX / 2, 1ull << 32, UINT32_MAX, 1u << 31, 65 * 4};
    for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++) {
        int rc = call_u(fd, "seq_extend", 10 + i, ext, (uint64_t[]){s, huge[i]}, 2, NULL, 0);
        assert_true(rc == KVD_EBADREQ || rc == KVD_ENOMEM || rc == KVD_EQUOTA ||
                    rc == KVD_ETOOLARGE);
        assert_int_equal(n_tokens(fd, s), 8);
    }
    /* start + n wrapping (64 and 32 bits), n = 0, n × token_bytes overflow */
    const uint64_t ranges[][2] = {
        {UINT64_MAX - 1, 4}, {UINT64_MAX, 1}, {0xFFFFFFF0u, 0x20},
        {4, UINT64_MAX - 2}, {0, 0},          {0, 1ull << 62},
        {0, UINT32_MAX},     {7, 2},          {8, 1},
        {1ull << 32, 1},
    };
    for (size_t i = 0; i < sizeof(ranges) / sizeof(ranges[0]); i++) {
        uint64_t v[] = {s, ranges[i][0], ranges[i][1]};
        int rc = call_u(fd, "kv_read", 30 + i, rw, v, 3, NULL, 0);
        assert_true(rc == KVD_EBADREQ || rc == KVD_ETOOLARGE);
        rc = call_u(fd, "kv_write", 50 + i, rw, v, 3, data, sizeof(data));
        assert_true(rc == KVD_EBADREQ || rc == KVD_ETOOLARGE);
    }
    /* data length not n × token_bytes: 0x10000001 × 16 wraps to 16 in 32 bits */
    {
        uint64_t v[] = {s, 0, 0x10000001};
        assert_int_equal(call_u(fd, "kv_write", 70, rw, v, 3, data, TOKEN_BYTES), KVD_EBADREQ);
        uint64_t w[] = {s, 0, 4};
        assert_int_equal(call_u(fd, "kv_write", 71, rw, w, 3, data, sizeof(data) - 1), KVD_EBADREQ);
        assert_int_equal(call_u(fd, "kv_write", 72, rw, w, 3, data, sizeof(data)), 0);
    }
    /* commit of more tokens than the sequence holds */
    {
        struct kh_req q;
        struct kh_reply r;
        uint32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
        kh_req_begin(&q, "seq_commit", 80, 2);
        proto_pack_kv_uint(&q.pk, "seq", s);
        proto_pack_kv_u32_array(&q.pk, "tokens", t, 9);
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, &r), 0);
        kh_expect(&r, KVD_EBADREQ);
        kh_reply_free(&r);
        /* token ids over 32 bits */
        kh_req_begin(&q, "seq_commit", 81, 2);
        proto_pack_kv_uint(&q.pk, "seq", s);
        proto_pack_str(&q.pk, "tokens");
        msgpack_pack_array(&q.pk, 1);
        msgpack_pack_uint64(&q.pk, 1ull << 32);
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, &r), 0);
        kh_expect(&r, KVD_EBADREQ);
        kh_reply_free(&r);
        /* negative where a uint belongs; a negative id */
        kh_req_begin(&q, "seq_extend", 82, 2);
        proto_pack_kv_uint(&q.pk, "seq", s);
        proto_pack_kv_int(&q.pk, "n", -1);
        assert_int_equal(kh_req_send(fd, &q), 0);
        assert_int_equal(kh_recv(fd, &r), 0);
        kh_expect(&r, KVD_EBADREQ);
        assert_non_null(strstr(r.message, "n"));
        kh_reply_free(&r);
    }
    assert_int_equal(n_tokens(fd, s), 8);
    /* Still consistent, and closing the connection gives everything back. */
    struct kh_reply r;
    assert_int_equal(kh_call0(fd, "admin_check", 90, &r), 0);
    kh_reply_free(&r);
    close(fd);
    int fd2 = kh_connect(kvd.sock);
    for (int tries = 0; tries < 100 && kh_stat(fd2, "device", "used") != 0; tries++)
        usleep(20000); /* the close is processed by the loop asynchronously */
    assert_int_equal(kh_stat(fd2, "device", "used"), 0);
    close(fd2);
    bystander_ok();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frame_lengths),
        cmocka_unit_test(test_array_limits),
        cmocka_unit_test(test_integer_overflow),
    };
    return cmocka_run_group_tests_name("security_limits", tests, setup, teardown);
}

/* Integration test: every malformed-input class gets its defined error, the
 * offending connection alone is affected (closed for framing and parse
 * errors, kept for argument errors), and a bystander connection with an
 * open sequence keeps working throughout. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvd_harness.h"

static struct kh_proc kvd;
static int bystander = -1;
static uint64_t bystander_seq;

static int setup(void **state)
{
    const char *args[] = {"--backend", "cpu", "--device-blocks", "64", "--host-blocks", "16", NULL};
    if (kh_start(&kvd, NULL, args))
        return -1;
    bystander = kh_connect(kvd.sock);
    bystander_seq = kh_seq_open(bystander, 1);
    return bystander_seq ? 0 : -1;
}

static int teardown(void **state)
{
    close(bystander);
    return kh_stop(&kvd) == 0 ? 0 : -1;
}

/* The bystander's connection and sequence are untouched. */
static void bystander_ok(void)
{
    struct kh_reply r;
    assert_int_equal(kh_call1(bystander, "seq_info", 2, "seq", bystander_seq, &r), KVD_OK);
    kh_reply_free(&r);
    assert_int_equal(kh_call0(bystander, "hello", 3, &r), KVD_OK);
    kh_reply_free(&r);
}

static void frame_of(const void *payload, uint32_t len, uint8_t *out)
{
    out[0] = (uint8_t)(len >> 24);
    out[1] = (uint8_t)(len >> 16);
    out[2] = (uint8_t)(len >> 8);
    out[3] = (uint8_t)len;
    memcpy(out + 4, payload, len);
}

/* Sends raw bytes on a fresh connection and expects one error reply with
 * code and id, then (if closes) the connection to be closed by the server. */
static void expect(const void *bytes, size_t len, int code, uint64_t id, bool closes,
                   const char *needle)
{
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_true(fd >= 0);
    assert_int_equal(kh_send_raw(fd, bytes, len), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, code);
    assert_int_equal(r.id, id);
    if (needle)
        assert_non_null(strstr(r.message, needle));
    kh_reply_free(&r);
    if (closes) {
        assert_true(kh_peer_closed(fd));
    } else {
        assert_int_equal(kh_call0(fd, "hello", 77, &r), KVD_OK);
        kh_reply_free(&r);
    }
    close(fd);
    bystander_ok();
}

static void expect_payload(const void *payload, uint32_t len, int code, uint64_t id, bool closes,
                           const char *needle)
{
    uint8_t *buf = malloc(len + 4);
    frame_of(payload, len, buf);
    expect(buf, len + 4, code, id, closes, needle);
    free(buf);
}

static void test_zero_length(void **state)
{
    const uint8_t z[4] = {0};
    expect(z, 4, KVD_EBADREQ, 0, true, "zero-length");
}

static void test_oversized(void **state)
{
    const uint8_t big[4] = {0xff, 0xff, 0xff, 0xff};
    expect(big, 4, KVD_ETOOLARGE, 0, true, "max_frame");
    /* one byte over the default 64 MiB, known from the header alone */
    uint32_t n = KVD_MAX_FRAME_DEFAULT + 1;
    const uint8_t over[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    expect(over, 4, KVD_ETOOLARGE, 0, true, NULL);
}

static void test_truncated_frame(void **state)
{
    /* 100 bytes announced, 10 sent, then the write side closed */
    uint8_t buf[14] = {0, 0, 0, 100, 0x82, 0xa2, 'o', 'p'};
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    assert_int_equal(kh_send_raw(fd, buf, sizeof(buf)), 0);
    shutdown(fd, SHUT_WR);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "truncated"));
    kh_reply_free(&r);
    assert_true(kh_peer_closed(fd));
    close(fd);
    /* a half header, then a full close */
    fd = kh_connect(kvd.sock);
    assert_int_equal(kh_send_raw(fd, buf, 2), 0);
    close(fd);
    bystander_ok();
}

static void test_not_a_map(void **state)
{
    const uint8_t arr[] = {0x92, 0x01, 0x02};
    expect_payload(arr, sizeof(arr), KVD_EBADREQ, 0, true, "not a msgpack map");
    const uint8_t str[] = {0xa3, 'a', 'b', 'c'};
    expect_payload(str, sizeof(str), KVD_EBADREQ, 0, true, NULL);
}

static void test_trailing_bytes(void **state)
{
    /* {"op":"hello","id":1} followed by one more byte */
    const uint8_t p[] = {0x82, 0xa2, 'o',  'p', 0xa5, 'h',  'e', 'l',
                         'l',  'o',  0xa2, 'i', 'd',  0x01, 0xc0};
    expect_payload(p, sizeof(p), KVD_EBADREQ, 0, true, "trailing");
}

static void test_invalid_msgpack(void **state)
{
    const uint8_t c1[] = {0x81, 0xa2, 'i', 'd', 0xc1};
    expect_payload(c1, sizeof(c1), KVD_EBADREQ, 0, true, NULL);
    const uint8_t cut[] = {0x82, 0xa2, 'i', 'd', 0x01};
    expect_payload(cut, sizeof(cut), KVD_EBADREQ, 0, true, "truncated");
    uint8_t deep[80];
    size_t n = 0;
    deep[n++] = 0x81;
    deep[n++] = 0xa1;
    deep[n++] = 'x';
    for (int i = 0; i < 60; i++)
        deep[n++] = 0x91;
    deep[n++] = 0x00;
    expect_payload(deep, (uint32_t)n, KVD_EBADREQ, 0, true, "deeper");
}

static void test_huge_arrays(void **state)
{
    /* a 20-byte frame claiming 2^32-1 tokens */
    const uint8_t claim[] = {0x83, 0xa2, 'o', 'p', 0xa9, 's',  'e',  'q',  '_',  'm',
                             'a',  't',  'c', 'h', 0xa2, 'i',  'd',  0x05, 0xa6, 't',
                             'o',  'k',  'e', 'n', 's',  0xdd, 0xff, 0xff, 0xff, 0xff};
    expect_payload(claim, sizeof(claim), KVD_ETOOLARGE, 0, true, NULL);
    /* a real array one entry over KVD_MAX_ARRAY */
    size_t n = KVD_MAX_ARRAY + 1;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(&sb);
    proto_request_begin(&pk, "seq_match", 6, 2);
    proto_pack_kv_uint(&pk, "seq", 1);
    proto_pack_str(&pk, "tokens");
    msgpack_pack_array(&pk, n);
    for (size_t i = 0; i < n; i++)
        msgpack_pack_uint8(&pk, 1);
    proto_frame_end(&sb, at);
    expect(sb.data, sb.size, KVD_ETOOLARGE, 0, true, NULL);
    msgpack_sbuffer_destroy(&sb);
}

static void test_wrong_types_keep_connection(void **state)
{
    /* op not a string: bad_request with the id, connection kept */
    const uint8_t op_int[] = {0x82, 0xa2, 'o', 'p', 0x05, 0xa2, 'i', 'd', 0x07};
    expect_payload(op_int, sizeof(op_int), KVD_EBADREQ, 7, false, "'op'");
    /* id not an unsigned integer: id 0 */
    const uint8_t id_str[] = {0x82, 0xa2, 'o',  'p', 0xa5, 'h',  'e', 'l',
                              'l',  'o',  0xa2, 'i', 'd',  0xa1, 'x'};
    expect_payload(id_str, sizeof(id_str), KVD_EBADREQ, 0, false, "'id'");
    /* no id at all */
    const uint8_t no_id[] = {0x81, 0xa2, 'o', 'p', 0xa5, 'h', 'e', 'l', 'l', 'o'};
    expect_payload(no_id, sizeof(no_id), KVD_EBADREQ, 0, false, NULL);
    /* negative seq */
    const uint8_t neg[] = {0x83, 0xa2, 'o',  'p', 0xa8, 's',  'e',  'q', '_', 'i', 'n',
                           'f',  'o',  0xa2, 'i', 'd',  0x08, 0xa3, 's', 'e', 'q', 0xff};
    expect_payload(neg, sizeof(neg), KVD_EBADREQ, 8, false, "'seq'");
    /* a non-string key is malformed: closed */
    const uint8_t ikey[] = {0x81, 0x01, 0x02};
    expect_payload(ikey, sizeof(ikey), KVD_EBADREQ, 0, true, NULL);
}

static void test_unknown_op(void **state)
{
    const uint8_t p[] = {0x82, 0xa2, 'o', 'p', 0xa4, 'n', 'o', 'p', 'e', 0xa2, 'i', 'd', 0x09};
    expect_payload(p, sizeof(p), KVD_EUNKNOWN_OP, 9, false, "nope");
}

static void test_unknown_keys_ignored(void **state)
{
    /* unknown keys are ignored (forward compatibility) */
    const uint8_t p[] = {0x83, 0xa2, 'o',  'p',  0xa5, 'h', 'e', 'l', 'l', 'o', 0xa2,
                         'i',  'd',  0x0a, 0xa6, 'f',  'u', 't', 'u', 'r', 'e', 0xc3};
    int fd = kh_connect(kvd.sock);
    struct kh_reply r;
    uint8_t buf[64];
    frame_of(p, sizeof(p), buf);
    assert_int_equal(kh_send_raw(fd, buf, sizeof(p) + 4), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_OK);
    assert_int_equal(r.id, 10);
    kh_reply_free(&r);
    close(fd);
}

/* A hello frame with id `id` padded to `pad` bytes of an unknown string key
 * (ignored), written at out; returns the frame's length. */
static size_t padded_hello(uint8_t *out, uint8_t id, uint32_t pad)
{
    const uint8_t head[] = {0x83, 0xa2, 'o', 'p', 0xa5, 'h', 'e', 'l', 'l', 'o',
                            0xa2, 'i',  'd', id,  0xa3, 'p', 'a', 'd', 0xdb};
    uint32_t len = (uint32_t)sizeof(head) + 4 + pad;
    uint8_t *p = out + 4;
    memcpy(p, head, sizeof head);
    p += sizeof head;
    for (int i = 0; i < 4; i++)
        *p++ = (uint8_t)(pad >> (24 - 8 * i));
    memset(p, 'x', pad);
    for (int i = 0; i < 4; i++)
        out[i] = (uint8_t)(len >> (24 - 8 * i));
    return 4 + (size_t)len;
}

/* A frame larger than one read (256 KiB) is received into its own buffer
 * as it arrives: pipelined between two small frames, in pieces that cut
 * the headers and the payload anywhere, all three are answered in order. */
static void test_big_frame_pipelined(void **state)
{
    const uint32_t pad = 3u << 20;
    uint8_t *buf = malloc(3 * 64 + pad);
    assert_non_null(buf);
    size_t n = padded_hello(buf, 1, 0);
    n += padded_hello(buf + n, 2, pad);
    n += padded_hello(buf + n, 3, 0);
    int fd = kh_connect(kvd.sock);
    assert_true(fd >= 0);
    for (size_t at = 0, piece = 7; at < n; at += piece, piece = piece * 3 % 300007 + 1)
        assert_int_equal(kh_send_raw(fd, buf + at, at + piece > n ? n - at : piece), 0);
    for (uint64_t id = 1; id <= 3; id++) {
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        kh_expect(&r, KVD_OK);
        assert_int_equal(r.id, id);
        kh_reply_free(&r);
    }
    close(fd);
    free(buf);
    bystander_ok();
}

/* A big frame cut short: the peer that shut down its write side is told
 * how much of the frame came; one that closed is simply gone. */
static void test_big_frame_truncated(void **state)
{
    const uint32_t pad = 1u << 20, sent = 600u << 10;
    uint8_t *buf = malloc(64 + pad);
    assert_non_null(buf);
    padded_hello(buf, 4, pad);
    int fd = kh_connect(kvd.sock);
    assert_int_equal(kh_send_raw(fd, buf, sent), 0);
    shutdown(fd, SHUT_WR);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, KVD_EBADREQ);
    char want[96];
    snprintf(want, sizeof want, "truncated frame: connection closed after %u bytes", sent);
    assert_non_null(strstr(r.message, want));
    kh_reply_free(&r);
    assert_true(kh_peer_closed(fd));
    close(fd);
    fd = kh_connect(kvd.sock);
    assert_int_equal(kh_send_raw(fd, buf, sent), 0);
    close(fd);
    free(buf);
    bystander_ok();
}

/* Random bytes in random frames: every one is answered or closed; the
 * daemon survives and the bystander is served. Deterministic seed. */
static void test_garbage(void **state)
{
    unsigned seed = 12345;
    for (int i = 0; i < 300; i++) {
        uint8_t payload[48];
        uint32_t len = 1 + (uint32_t)(rand_r(&seed) % sizeof(payload));
        for (uint32_t j = 0; j < len; j++)
            payload[j] = (uint8_t)rand_r(&seed);
        if (i % 2)
            payload[0] = (uint8_t)(0x80 | (payload[0] & 0x0f)); /* start like a map */
        uint8_t buf[sizeof(payload) + 4];
        frame_of(payload, len, buf);
        int fd = kh_connect(kvd.sock);
        assert_true(fd >= 0);
        assert_int_equal(kh_send_raw(fd, buf, len + 4), 0);
        struct kh_reply r;
        /* Either a reply (error or, rarely, success) or a close. */
        if (kh_recv(fd, &r) == 0)
            kh_reply_free(&r);
        close(fd);
    }
    bystander_ok();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero_length),
        cmocka_unit_test(test_oversized),
        cmocka_unit_test(test_truncated_frame),
        cmocka_unit_test(test_not_a_map),
        cmocka_unit_test(test_trailing_bytes),
        cmocka_unit_test(test_invalid_msgpack),
        cmocka_unit_test(test_huge_arrays),
        cmocka_unit_test(test_wrong_types_keep_connection),
        cmocka_unit_test(test_unknown_op),
        cmocka_unit_test(test_unknown_keys_ignored),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_big_frame_pipelined),
        cmocka_unit_test(test_big_frame_truncated),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

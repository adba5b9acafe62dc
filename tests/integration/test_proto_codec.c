/* Unit test of the protocol codec (client/proto.c): framing states, strict
 * parsing of every malformed class, typed lookups and their errors, and
 * encode → decode round trips. No daemon needed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "proto.h"

static void test_frame_peek(void **state)
{
    uint8_t b[8] = {0, 0, 0, 3, 0x80, 0, 0, 0};
    size_t n = 99;
    assert_int_equal(proto_frame_peek(b, 2, 100, &n), PROTO_FRAME_NEED_MORE);
    assert_int_equal(n, 0);
    assert_int_equal(proto_frame_peek(b, 5, 100, &n), PROTO_FRAME_NEED_MORE);
    assert_int_equal(n, 3);
    assert_int_equal(proto_frame_peek(b, 7, 100, &n), PROTO_FRAME_READY);
    assert_int_equal(n, 3);
    assert_int_equal(proto_frame_peek(b, 7, 2, &n), PROTO_FRAME_TOO_LARGE);
    uint8_t z[4] = {0};
    assert_int_equal(proto_frame_peek(z, 4, 100, &n), PROTO_FRAME_EMPTY);
    uint8_t big[4] = {0xff, 0xff, 0xff, 0xff};
    assert_int_equal(proto_frame_peek(big, 4, KVD_MAX_FRAME_DEFAULT, &n), PROTO_FRAME_TOO_LARGE);
    assert_int_equal(n, 0xffffffffu);
}

static int parse(const void *p, size_t len, struct kvd_error *e)
{
    struct proto_msg m;
    int rc = proto_msg_parse(&m, p, len, e);
    if (rc == 0)
        proto_msg_free(&m);
    return rc;
}

static void test_parse_malformed(void **state)
{
    struct kvd_error e;
    /* not a map */
    const uint8_t arr[] = {0x91, 0x01};
    assert_int_equal(parse(arr, sizeof(arr), &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "not a msgpack map"));
    /* trailing bytes */
    const uint8_t trail[] = {0x80, 0x00};
    assert_int_equal(parse(trail, sizeof(trail), &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "trailing"));
    /* truncated: a map of one pair with nothing after */
    const uint8_t trunc[] = {0x81, 0xa1, 'a'};
    assert_int_equal(parse(trunc, sizeof(trunc), &e), KVD_EBADREQ);
    /* invalid byte 0xc1 */
    const uint8_t bad[] = {0x81, 0xa1, 'a', 0xc1};
    assert_int_equal(parse(bad, sizeof(bad), &e), KVD_EBADREQ);
    /* a small frame claiming a 2^32-1 array: too_large, nothing allocated */
    const uint8_t huge[] = {0x81, 0xa1, 'a', 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01};
    assert_int_equal(parse(huge, sizeof(huge), &e), KVD_ETOOLARGE);
    /* an array within the limit but longer than the bytes left */
    const uint8_t lie[] = {0x81, 0xa1, 'a', 0xdd, 0x00, 0x00, 0x10, 0x00, 0x01};
    assert_int_equal(parse(lie, sizeof(lie), &e), KVD_EBADREQ);
    /* a str32 longer than the frame */
    const uint8_t s32[] = {0x81, 0xa1, 'a', 0xdb, 0x7f, 0xff, 0xff, 0xff, 'x'};
    assert_int_equal(parse(s32, sizeof(s32), &e), KVD_EBADREQ);
    /* nesting deeper than KVD_MAX_DEPTH */
    uint8_t deep[64];
    size_t n = 0;
    deep[n++] = 0x81;
    deep[n++] = 0xa1;
    deep[n++] = 'a';
    for (int i = 0; i < 40; i++)
        deep[n++] = 0x91;
    deep[n++] = 0x01;
    assert_int_equal(parse(deep, n, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "deeper"));
    /* non-string key */
    const uint8_t ikey[] = {0x81, 0x01, 0x02};
    assert_int_equal(parse(ikey, sizeof(ikey), &e), KVD_EBADREQ);
    /* fine: {"a": [1, 2]} */
    const uint8_t ok[] = {0x81, 0xa1, 'a', 0x92, 0x01, 0x02};
    assert_int_equal(parse(ok, sizeof(ok), &e), KVD_OK);
}

static void test_roundtrip_and_getters(void **state)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(&sb);
    uint32_t toks[3] = {1, 70000, 4000000000u};
    assert_int_equal(proto_request_begin(&pk, "kv_write", 42, 8), 0);
    assert_int_equal(proto_pack_kv_uint(&pk, "seq", 7), 0);
    assert_int_equal(proto_pack_kv_int(&pk, "prio", -3), 0);
    assert_int_equal(proto_pack_kv_double(&pk, "temp", 0.5), 0);
    assert_int_equal(proto_pack_kv_bool(&pk, "stream", true), 0);
    assert_int_equal(proto_pack_kv_str(&pk, "name", "abc"), 0);
    assert_int_equal(proto_pack_kv_bin(&pk, "data", "\x00\x01\x02", 3), 0);
    assert_int_equal(proto_pack_kv_u32_array(&pk, "tokens", toks, 3), 0);
    assert_int_equal(proto_pack_kv_nil(&pk, "none"), 0);
    assert_int_equal(proto_frame_end(&sb, at), 0);

    size_t n;
    assert_int_equal(proto_frame_peek(sb.data, sb.size, 1 << 20, &n), PROTO_FRAME_READY);
    assert_int_equal(n + 4, sb.size);
    struct proto_msg m;
    struct kvd_error e;
    assert_int_equal(proto_msg_parse(&m, sb.data + 4, n, &e), 0);
    assert_int_equal(proto_msg_id(&m), 42);
    uint64_t u;
    int64_t i;
    double d;
    bool b, present = true;
    const char *s;
    size_t len;
    const void *bin;
    char buf[8];
    uint32_t *arr;
    assert_int_equal(proto_get_uint(m.root, "seq", &u, &e), 0);
    assert_int_equal(u, 7);
    assert_int_equal(proto_get_int(m.root, "prio", &i, &e), 0);
    assert_int_equal(i, -3);
    assert_int_equal(proto_get_double(m.root, "temp", &d, &e), 0);
    assert_true(d == 0.5);
    assert_int_equal(proto_get_double(m.root, "seq", &d, &e), 0); /* ints are numbers */
    assert_int_equal(proto_get_bool(m.root, "stream", &b, &e), 0);
    assert_true(b);
    assert_int_equal(proto_get_str(m.root, "op", &s, &len, &e), 0);
    assert_int_equal(len, 8);
    assert_int_equal(proto_get_strz(m.root, "name", buf, sizeof(buf), &e), 0);
    assert_string_equal(buf, "abc");
    assert_int_equal(proto_get_strz(m.root, "name", buf, 3, &e), KVD_EBADREQ);
    assert_int_equal(proto_get_bin(m.root, "data", &bin, &len, &e), 0);
    assert_int_equal(len, 3);
    assert_int_equal(proto_get_u32_array(m.root, "tokens", 3, &arr, &len, &e), 0);
    assert_int_equal(len, 3);
    assert_int_equal(arr[2], 4000000000u);
    free(arr);
    assert_int_equal(proto_get_u32_array(m.root, "tokens", 2, &arr, &len, &e), KVD_ETOOLARGE);
    assert_non_null(strstr(e.message, "'tokens'"));

    /* wrong types name the key */
    assert_int_equal(proto_get_uint(m.root, "prio", &u, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "'prio'"));
    assert_int_equal(proto_get_uint(m.root, "name", &u, &e), KVD_EBADREQ);
    assert_int_equal(proto_get_bool(m.root, "seq", &b, &e), KVD_EBADREQ);
    assert_int_equal(proto_get_str(m.root, "seq", &s, &len, &e), KVD_EBADREQ);
    assert_int_equal(proto_get_bin(m.root, "name", &bin, &len, &e), KVD_EBADREQ);
    assert_int_equal(proto_get_u32_array(m.root, "seq", 9, &arr, &len, &e), KVD_EBADREQ);
    /* required vs optional */
    assert_int_equal(proto_get_uint(m.root, "missing", &u, &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "missing 'missing'"));
    u = 5;
    assert_int_equal(proto_opt_uint(m.root, "missing", &u, &present, &e), 0);
    assert_false(present);
    assert_int_equal(u, 5);
    assert_int_equal(proto_opt_uint(m.root, "none", &u, &present, &e), 0); /* nil = absent */
    assert_false(present);
    assert_int_equal(proto_opt_uint(m.root, "seq", &u, &present, &e), 0);
    assert_true(present);
    proto_msg_free(&m);
    msgpack_sbuffer_destroy(&sb);
}

static void test_reply_status(void **state)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    assert_int_equal(proto_frame_error(&sb, 9, KVD_EQUOTA, "over quota"), 0);
    struct proto_msg m;
    struct kvd_error e;
    assert_int_equal(proto_msg_parse(&m, sb.data + 4, sb.size - 4, &e), 0);
    assert_int_equal(proto_msg_id(&m), 9);
    assert_int_equal(proto_reply_status(m.root, &e), KVD_EQUOTA);
    assert_string_equal(e.message, "over quota");
    proto_msg_free(&m);
    sb.size = 0;
    assert_int_equal(proto_frame_ok(&sb, 10), 0);
    assert_int_equal(proto_msg_parse(&m, sb.data + 4, sb.size - 4, &e), 0);
    assert_int_equal(proto_reply_status(m.root, &e), KVD_OK);
    proto_msg_free(&m);
    msgpack_sbuffer_destroy(&sb);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frame_peek),
        cmocka_unit_test(test_parse_malformed),
        cmocka_unit_test(test_roundtrip_and_getters),
        cmocka_unit_test(test_reply_status),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

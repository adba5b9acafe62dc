/* Unit test of the encoder (client/proto_pack.c): every proto_pack_* function
 * must produce msgpack-c's own bytes, both through a direct packer
 * (proto_packer_init: encoded in place in the sbuffer) and through a plain
 * msgpack_sbuffer_write packer, across the encoding boundaries and while the
 * sbuffer grows. No daemon needed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "proto.h"

/* Values on both sides of every msgpack size boundary. */
static const uint64_t uvals[] = {0,     1,         127,   128,        255,
                                 256,   65535,     65536, UINT32_MAX, (uint64_t)UINT32_MAX + 1,
                                 12345, UINT64_MAX};
static const int64_t ivals[] = {0,         -1,        -32,    -33,       -128,
                                -129,      -32768,    -32769, INT32_MIN, (int64_t)INT32_MIN - 1,
                                INT64_MIN, INT64_MAX, 127,    128,       70000};
/* 40 bytes: past the inline fixstr path (< 32) of proto.h. */
#define LONG_KEY "a_key_that_is_forty_bytes_long_xxxxxxxxx"

/* String / bin lengths on both sides of the header boundaries. */
static const size_t lens[] = {0, 1, 31, 32, 64, 65, 200, 255, 256, 65535, 65536, 70000};

static char *filled(size_t n, char c)
{
    char *s = malloc(n + 1);
    assert_non_null(s);
    for (size_t i = 0; i < n; i++)
        s[i] = (char)(c + (char)(i % 23));
    s[n] = '\0';
    return s;
}

/* Packs the whole set with the proto functions through pk. */
static void pack_all(msgpack_packer *pk)
{
    uint32_t ids[300];
    for (size_t i = 0; i < 300; i++)
        ids[i] = (uint32_t)(i * i * i * 7919u);
    ids[0] = UINT32_MAX;
    assert_int_equal(proto_reply_begin(pk, 77, 3), 0);
    assert_int_equal(proto_reply_begin(pk, UINT64_MAX, 40), 0);
    assert_int_equal(proto_pack_error(pk, 9, KVD_ENOTFOUND, "no such seq"), 0);
    assert_int_equal(proto_event_begin(pk, 5, "tokens", 1), 0);
    assert_int_equal(proto_request_begin(pk, "seq_info", 1u << 20, 1), 0);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        char *k = filled(lens[i], 'a'), *v = filled(lens[i], 'A');
        assert_int_equal(proto_pack_strn(pk, v, lens[i]), 0);
        assert_int_equal(proto_pack_kvn_str(pk, k, lens[i], v, lens[i]), 0);
        assert_int_equal(proto_pack_kvn_str(pk, "k", 1, v, lens[i]), 0);
        assert_int_equal(proto_pack_kvn_uint(pk, k, lens[i], 300), 0);
        assert_int_equal(proto_pack_kvn_int(pk, k, lens[i], -300), 0);
        assert_int_equal(proto_pack_kvn_double(pk, k, lens[i], 0.25), 0);
        assert_int_equal(proto_pack_kvn_bool(pk, k, lens[i], true), 0);
        assert_int_equal(proto_pack_kvn_bool(pk, k, lens[i], false), 0);
        assert_int_equal(proto_pack_kvn_nil(pk, k, lens[i]), 0);
        assert_int_equal(proto_pack_kv_bin(pk, "data", v, lens[i]), 0);
        assert_int_equal(proto_pack_map(pk, lens[i]), 0);
        assert_int_equal(proto_pack_array(pk, lens[i]), 0);
        free(k);
        free(v);
    }
    for (size_t i = 0; i < sizeof(uvals) / sizeof(uvals[0]); i++)
        assert_int_equal(proto_pack_kv_uint(pk, "n_tokens", uvals[i]), 0);
    for (size_t i = 0; i < sizeof(ivals) / sizeof(ivals[0]); i++)
        assert_int_equal(proto_pack_kv_int(pk, "priority", ivals[i]), 0);
    assert_int_equal(proto_pack_kv_double(pk, "temperature", -1.5e300), 0);
    assert_int_equal(proto_pack_kv_u32_array(pk, "tokens", ids, 0), 0);
    assert_int_equal(proto_pack_kv_u32_array(pk, "tokens", ids, 15), 0);
    assert_int_equal(proto_pack_kv_u32_array(pk, "tokens", ids, 16), 0);
    assert_int_equal(proto_pack_kv_u32_array(pk, "tokens", ids, 300), 0);
    assert_int_equal(proto_pack_kv_str(pk, "tier", "device"), 0);
    /* the inline NUL-terminated forms, short and long (fallback) */
    assert_int_equal(proto_pack_kv_nil(pk, "model"), 0);
    assert_int_equal(proto_pack_kv_bool(pk, "admin", true), 0);
    assert_int_equal(proto_pack_kv_bool(pk, "admin", false), 0);
    assert_int_equal(proto_pack_str(pk, "blocks"), 0);
    assert_int_equal(proto_pack_str(pk, LONG_KEY), 0);
    assert_int_equal(proto_pack_kv_nil(pk, LONG_KEY), 0);
    assert_int_equal(proto_pack_kv_bool(pk, LONG_KEY, true), 0);
    assert_int_equal(proto_pack_kv_str(pk, LONG_KEY, "v"), 0);
    assert_int_equal(proto_pack_kv_str(pk, "k", LONG_KEY), 0);
    assert_int_equal(proto_pack_kv_uint(pk, LONG_KEY, 5), 0);
}

/* The same bytes with msgpack-c's packer only: the reference. */
static void mp_str(msgpack_packer *pk, const char *s, size_t n)
{
    assert_int_equal(msgpack_pack_str(pk, n), 0);
    assert_int_equal(msgpack_pack_str_body(pk, s, n), 0);
}

static void mp_kv_err(msgpack_packer *pk, uint64_t id, const char *code, const char *msg)
{
    msgpack_pack_map(pk, 3);
    mp_str(pk, "id", 2);
    msgpack_pack_uint64(pk, id);
    mp_str(pk, "ok", 2);
    msgpack_pack_false(pk);
    mp_str(pk, "error", 5);
    msgpack_pack_map(pk, 2);
    mp_str(pk, "code", 4);
    mp_str(pk, code, strlen(code));
    mp_str(pk, "message", 7);
    mp_str(pk, msg, strlen(msg));
}

static void mp_reply(msgpack_packer *pk, uint64_t id, size_t n_extra)
{
    msgpack_pack_map(pk, n_extra + 2);
    mp_str(pk, "id", 2);
    msgpack_pack_uint64(pk, id);
    mp_str(pk, "ok", 2);
    msgpack_pack_true(pk);
}

static void reference_all(msgpack_packer *pk)
{
    uint32_t ids[300];
    for (size_t i = 0; i < 300; i++)
        ids[i] = (uint32_t)(i * i * i * 7919u);
    ids[0] = UINT32_MAX;
    mp_reply(pk, 77, 3);
    mp_reply(pk, UINT64_MAX, 40);
    mp_kv_err(pk, 9, kvd_err_code(KVD_ENOTFOUND), "no such seq");
    msgpack_pack_map(pk, 3);
    mp_str(pk, "id", 2);
    msgpack_pack_uint64(pk, 5);
    mp_str(pk, "event", 5);
    mp_str(pk, "tokens", 6);
    msgpack_pack_map(pk, 3);
    mp_str(pk, "op", 2);
    mp_str(pk, "seq_info", 8);
    mp_str(pk, "id", 2);
    msgpack_pack_uint64(pk, 1u << 20);
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        char *k = filled(lens[i], 'a'), *v = filled(lens[i], 'A');
        size_t n = lens[i];
        mp_str(pk, v, n);
        mp_str(pk, k, n);
        mp_str(pk, v, n);
        mp_str(pk, "k", 1);
        mp_str(pk, v, n);
        mp_str(pk, k, n);
        msgpack_pack_uint64(pk, 300);
        mp_str(pk, k, n);
        msgpack_pack_int64(pk, -300);
        mp_str(pk, k, n);
        msgpack_pack_double(pk, 0.25);
        mp_str(pk, k, n);
        msgpack_pack_true(pk);
        mp_str(pk, k, n);
        msgpack_pack_false(pk);
        mp_str(pk, k, n);
        msgpack_pack_nil(pk);
        mp_str(pk, "data", 4);
        msgpack_pack_bin(pk, n);
        msgpack_pack_bin_body(pk, v, n);
        msgpack_pack_map(pk, n);
        msgpack_pack_array(pk, n);
        free(k);
        free(v);
    }
    for (size_t i = 0; i < sizeof(uvals) / sizeof(uvals[0]); i++) {
        mp_str(pk, "n_tokens", 8);
        msgpack_pack_uint64(pk, uvals[i]);
    }
    for (size_t i = 0; i < sizeof(ivals) / sizeof(ivals[0]); i++) {
        mp_str(pk, "priority", 8);
        msgpack_pack_int64(pk, ivals[i]);
    }
    mp_str(pk, "temperature", 11);
    msgpack_pack_double(pk, -1.5e300);
    const size_t arr[] = {0, 15, 16, 300};
    for (size_t a = 0; a < 4; a++) {
        mp_str(pk, "tokens", 6);
        msgpack_pack_array(pk, arr[a]);
        for (size_t i = 0; i < arr[a]; i++)
            msgpack_pack_uint32(pk, ids[i]);
    }
    mp_str(pk, "tier", 4);
    mp_str(pk, "device", 6);
    mp_str(pk, "model", 5);
    msgpack_pack_nil(pk);
    mp_str(pk, "admin", 5);
    msgpack_pack_true(pk);
    mp_str(pk, "admin", 5);
    msgpack_pack_false(pk);
    mp_str(pk, "blocks", 6);
    const size_t ln = strlen(LONG_KEY);
    mp_str(pk, LONG_KEY, ln);
    mp_str(pk, LONG_KEY, ln);
    msgpack_pack_nil(pk);
    mp_str(pk, LONG_KEY, ln);
    msgpack_pack_true(pk);
    mp_str(pk, LONG_KEY, ln);
    mp_str(pk, "v", 1);
    mp_str(pk, "k", 1);
    mp_str(pk, LONG_KEY, ln);
    mp_str(pk, LONG_KEY, ln);
    msgpack_pack_uint64(pk, 5);
}

static void test_same_bytes_as_msgpack_c(void **state)
{
    msgpack_sbuffer ref, direct, cb;
    msgpack_packer pk;
    (void)state;

    msgpack_sbuffer_init(&ref);
    msgpack_packer_init(&pk, &ref, msgpack_sbuffer_write);
    reference_all(&pk);

    /* direct: starts empty, so the set crosses several reallocations */
    msgpack_sbuffer_init(&direct);
    proto_packer_init(&pk, &direct);
    assert_true(pk.callback == proto_sbuf_write);
    pack_all(&pk);

    msgpack_sbuffer_init(&cb);
    msgpack_packer_init(&pk, &cb, msgpack_sbuffer_write);
    pack_all(&pk);

    assert_true(ref.size > 3 * 70000);
    assert_int_equal(direct.size, ref.size);
    assert_int_equal(cb.size, ref.size);
    assert_memory_equal(direct.data, ref.data, ref.size);
    assert_memory_equal(cb.data, ref.data, ref.size);
    msgpack_sbuffer_destroy(&ref);
    msgpack_sbuffer_destroy(&direct);
    msgpack_sbuffer_destroy(&cb);
}

/* Frames built with the direct packer decode back, several in one buffer,
 * and msgpack-c calls mixed in land in order. */
static void test_frames_roundtrip(void **state)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    struct proto_msg m;
    struct kvd_error e;
    size_t off = 0, n = 0;
    (void)state;

    msgpack_sbuffer_init(&sb);
    proto_packer_init(&pk, &sb);
    for (uint64_t id = 1; id <= 500; id++) {
        size_t at = proto_frame_begin(&sb);
        assert_int_not_equal(at, SIZE_MAX);
        assert_int_equal(proto_reply_begin(&pk, id, 2), 0);
        assert_int_equal(proto_pack_kv_uint(&pk, "n_tokens", id * 1000), 0);
        assert_int_equal(proto_pack_str(&pk, "blocks"), 0);
        assert_int_equal(msgpack_pack_array(&pk, 1), 0);
        assert_int_equal(msgpack_pack_uint64(&pk, id), 0);
        assert_int_equal(proto_frame_end(&sb, at), 0);
    }
    assert_int_equal(proto_frame_ok(&sb, 501), 0);
    assert_int_equal(proto_frame_error(&sb, 502, KVD_EBADREQ, "bad"), 0);
    for (uint64_t id = 1; id <= 502; id++) {
        assert_int_equal(proto_frame_peek(sb.data + off, sb.size - off, 1u << 20, &n),
                         PROTO_FRAME_READY);
        assert_int_equal(proto_msg_parse(&m, sb.data + off + 4, n, &e), 0);
        assert_int_equal(proto_msg_id(&m), id);
        int st = proto_reply_status(m.root, &e);
        if (id == 502) {
            assert_int_equal(st, KVD_EBADREQ);
            assert_string_equal(e.message, "bad");
        } else {
            assert_int_equal(st, KVD_OK);
        }
        if (id <= 500) {
            uint64_t v;
            const msgpack_object *arr;
            assert_int_equal(proto_get_uint(m.root, "n_tokens", &v, &e), 0);
            assert_int_equal(v, id * 1000);
            assert_int_equal(proto_get_array(m.root, "blocks", &arr, &e), 0);
            assert_int_equal(arr->via.array.size, 1);
            assert_int_equal(arr->via.array.ptr[0].via.u64, id);
        }
        proto_msg_free(&m);
        off += 4 + n;
    }
    assert_int_equal(off, sb.size);
    msgpack_sbuffer_destroy(&sb);
}

/* Deferred maps: the bytes of a map whose count was packed up front, for
 * counts on both sides of every header size, nested, inside a reply. */
static void pack_pairs(msgpack_packer *pk, size_t n)
{
    char key[32];
    for (size_t i = 0; i < n; i++) {
        snprintf(key, sizeof(key), "k%zu", i);
        assert_int_equal(proto_pack_kv_uint(pk, key, i * 1000), 0);
    }
}

static void test_deferred_maps(void **state)
{
    (void)state;
    static const size_t counts[] = {0, 1, 15, 16, 17, 65535, 65536, 70000};
    for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
        msgpack_sbuffer a, b;
        msgpack_packer pa, pb;
        msgpack_sbuffer_init(&a);
        msgpack_sbuffer_init(&b);
        proto_packer_init(&pa, &a);
        proto_packer_init(&pb, &b);
        assert_int_equal(proto_pack_map(&pa, counts[c] + 1), 0);
        pack_pairs(&pa, counts[c]);
        assert_int_equal(proto_pack_str(&pa, "inner"), 0);
        assert_int_equal(proto_pack_map(&pa, 2), 0);
        pack_pairs(&pa, 2);

        size_t at = proto_map_begin(&pb);
        assert_true(at != SIZE_MAX);
        pack_pairs(&pb, counts[c]);
        assert_int_equal(proto_pack_str(&pb, "inner"), 0);
        size_t in = proto_map_begin(&pb);
        pack_pairs(&pb, 2);
        assert_int_equal(proto_map_end(&pb, in), 0);
        assert_int_equal(proto_map_end(&pb, at), 0);
        assert_int_equal(a.size, b.size);
        assert_memory_equal(a.data, b.data, a.size);
        msgpack_sbuffer_destroy(&a);
        msgpack_sbuffer_destroy(&b);
    }

    /* A reply: the same bytes as proto_reply_begin with its count. */
    msgpack_sbuffer a, b;
    msgpack_packer pa, pb;
    msgpack_sbuffer_init(&a);
    msgpack_sbuffer_init(&b);
    proto_packer_init(&pa, &a);
    proto_packer_init(&pb, &b);
    assert_int_equal(proto_reply_begin(&pa, 77, 3), 0);
    pack_pairs(&pa, 3);
    size_t at = proto_reply_begin_map(&pb, 77);
    pack_pairs(&pb, 3);
    assert_int_equal(proto_map_end(&pb, at), 0);
    assert_int_equal(a.size, b.size);
    assert_memory_equal(a.data, b.data, a.size);

    /* A key without its value is a bug the end reports, not a miscount. */
    msgpack_sbuffer_clear(&b);
    at = proto_map_begin(&pb);
    pack_pairs(&pb, 2);
    assert_int_equal(proto_pack_str(&pb, "dangling"), 0);
    assert_int_equal(proto_map_end(&pb, at), KVD_EINTERNAL);
    /* A failed begin is reported at the end; so is a packer that does not
     * write into an sbuffer in place. */
    assert_int_equal(proto_map_end(&pb, SIZE_MAX), KVD_ENOMEM);
    msgpack_packer cb;
    msgpack_packer_init(&cb, &a, msgpack_sbuffer_write);
    assert_true(proto_map_begin(&cb) == SIZE_MAX);
    assert_int_equal(proto_map_end(&cb, 0), KVD_EINTERNAL);
    msgpack_sbuffer_destroy(&a);
    msgpack_sbuffer_destroy(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_bytes_as_msgpack_c),
        cmocka_unit_test(test_frames_roundtrip),
        cmocka_unit_test(test_deferred_maps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* proto_pack: the encoding half of the kvd codec (see proto.h): frames in a
 * msgpack_sbuffer with a patched 4-byte length, and the reply, error, event
 * and request maps both sides build. */
#include <stdlib.h>
#include <string.h>

#include "proto.h"

size_t proto_frame_begin(msgpack_sbuffer *sb)
{
    static const char zero[KVD_FRAME_HEADER_BYTES] = {0};
    size_t at = sb->size;
    if (msgpack_sbuffer_write(sb, zero, sizeof(zero)) != 0)
        return SIZE_MAX;
    return at;
}

int proto_frame_end(msgpack_sbuffer *sb, size_t at)
{
    if (at == SIZE_MAX || at + KVD_FRAME_HEADER_BYTES > sb->size)
        return KVD_EINTERNAL;
    size_t n = sb->size - at - KVD_FRAME_HEADER_BYTES;
    if (n == 0)
        return KVD_EINTERNAL;
    if (n > UINT32_MAX)
        return KVD_ETOOLARGE;
    uint8_t *p = (uint8_t *)sb->data + at;
    p[0] = (uint8_t)(n >> 24);
    p[1] = (uint8_t)(n >> 16);
    p[2] = (uint8_t)(n >> 8);
    p[3] = (uint8_t)n;
    return KVD_OK;
}

void *proto_sbuf_extend(msgpack_sbuffer *sb, size_t len)
{
    if (sb->alloc - sb->size < len) {
        size_t want = sb->alloc ? sb->alloc : 8192;
        while (want - sb->size < len) {
            if (want > SIZE_MAX / 2)
                return NULL;
            want *= 2;
        }
        char *d = realloc(sb->data, want);
        if (!d)
            return NULL;
        sb->data = d;
        sb->alloc = want;
    }
    void *at = sb->data + sb->size;
    sb->size += len;
    return at;
}

#define PK(x)                                                                                      \
    do {                                                                                           \
        if ((x) != 0)                                                                              \
            return KVD_ENOMEM;                                                                     \
    } while (0)

/* The longest key packed together with its value in one write; longer
 * ones take two. Bytes: a str8 header (2) + key + the largest scalar (9). */
#define PACK_KEY_MAX 64
#define PACK_BUF (2 + PACK_KEY_MAX + 9)
/* Strings up to this long go out with their header in one write. */
#define PACK_STR_ONE_WRITE 128

static int put(msgpack_packer *pk, const uint8_t *b, size_t n)
{
    return pk->callback(pk->data, (const char *)b, n) ? KVD_ENOMEM : KVD_OK;
}

static size_t be16(uint8_t *b, uint8_t tag, uint16_t v)
{
    b[0] = tag;
    b[1] = (uint8_t)(v >> 8);
    b[2] = (uint8_t)v;
    return 3;
}

static size_t be32(uint8_t *b, uint8_t tag, uint32_t v)
{
    b[0] = tag;
    for (int i = 0; i < 4; i++)
        b[1 + i] = (uint8_t)(v >> (24 - 8 * i));
    return 5;
}

static size_t be64(uint8_t *b, uint8_t tag, uint64_t v)
{
    b[0] = tag;
    for (int i = 0; i < 8; i++)
        b[1 + i] = (uint8_t)(v >> (56 - 8 * i));
    return 9;
}

/* msgpack encodings, smallest form first (the same bytes msgpack-c's
 * packer produces). Each writes at most 9 bytes (str header: 5). */
static size_t enc_str_hdr(uint8_t *b, size_t n)
{
    if (n < 32) {
        b[0] = (uint8_t)(0xa0 | n);
        return 1;
    }
    if (n < 256) {
        b[0] = 0xd9;
        b[1] = (uint8_t)n;
        return 2;
    }
    if (n < 65536)
        return be16(b, 0xda, (uint16_t)n);
    return be32(b, 0xdb, (uint32_t)n);
}

static size_t enc_uint(uint8_t *b, uint64_t v)
{
    if (v < 128) {
        b[0] = (uint8_t)v;
        return 1;
    }
    if (v < 256) {
        b[0] = 0xcc;
        b[1] = (uint8_t)v;
        return 2;
    }
    if (v < 65536)
        return be16(b, 0xcd, (uint16_t)v);
    if (v <= UINT32_MAX)
        return be32(b, 0xce, (uint32_t)v);
    return be64(b, 0xcf, v);
}

static size_t enc_int(uint8_t *b, int64_t v)
{
    if (v >= 0)
        return enc_uint(b, (uint64_t)v);
    if (v >= -32) {
        b[0] = (uint8_t)(int8_t)v;
        return 1;
    }
    if (v >= INT8_MIN) {
        b[0] = 0xd0;
        b[1] = (uint8_t)(int8_t)v;
        return 2;
    }
    if (v >= INT16_MIN)
        return be16(b, 0xd1, (uint16_t)(int16_t)v);
    if (v >= INT32_MIN)
        return be32(b, 0xd2, (uint32_t)(int32_t)v);
    return be64(b, 0xd3, (uint64_t)v);
}

static size_t enc_map_hdr(uint8_t *b, size_t n)
{
    if (n < 16) {
        b[0] = (uint8_t)(0x80 | n);
        return 1;
    }
    if (n < 65536)
        return be16(b, 0xde, (uint16_t)n);
    return be32(b, 0xdf, (uint32_t)n);
}

/* A key into b (klen <= PACK_KEY_MAX); returns the bytes written. */
static size_t enc_key(uint8_t *b, const char *key, size_t klen)
{
    size_t h = enc_str_hdr(b, klen);
    memcpy(b + h, key, klen);
    return h + klen;
}

int proto_pack_strn(msgpack_packer *pk, const char *s, size_t n)
{
    if (n <= PACK_STR_ONE_WRITE) {
        uint8_t b[2 + PACK_STR_ONE_WRITE];
        size_t h = enc_str_hdr(b, n);
        memcpy(b + h, s, n);
        return put(pk, b, h + n);
    }
    PK(msgpack_pack_str(pk, n));
    PK(msgpack_pack_str_body(pk, s, n));
    return KVD_OK;
}

int proto_pack_kvn_uint(msgpack_packer *pk, const char *key, size_t klen, uint64_t v)
{
    uint8_t b[PACK_BUF];
    if (klen > PACK_KEY_MAX) {
        PK(proto_pack_strn(pk, key, klen));
        return put(pk, b, enc_uint(b, v));
    }
    size_t n = enc_key(b, key, klen);
    return put(pk, b, n + enc_uint(b + n, v));
}

int proto_pack_kvn_int(msgpack_packer *pk, const char *key, size_t klen, int64_t v)
{
    uint8_t b[PACK_BUF];
    if (klen > PACK_KEY_MAX) {
        PK(proto_pack_strn(pk, key, klen));
        return put(pk, b, enc_int(b, v));
    }
    size_t n = enc_key(b, key, klen);
    return put(pk, b, n + enc_int(b + n, v));
}

int proto_pack_kvn_double(msgpack_packer *pk, const char *key, size_t klen, double v)
{
    uint8_t b[PACK_BUF];
    uint64_t bits;
    memcpy(&bits, &v, sizeof(bits));
    if (klen > PACK_KEY_MAX) {
        PK(proto_pack_strn(pk, key, klen));
        return put(pk, b, be64(b, 0xcb, bits));
    }
    size_t n = enc_key(b, key, klen);
    return put(pk, b, n + be64(b + n, 0xcb, bits));
}

/* A key and a one-byte value (nil, true, false). */
static int pack_kv_byte(msgpack_packer *pk, const char *key, size_t klen, uint8_t v)
{
    uint8_t b[PACK_BUF];
    if (klen > PACK_KEY_MAX) {
        PK(proto_pack_strn(pk, key, klen));
        return put(pk, &v, 1);
    }
    size_t n = enc_key(b, key, klen);
    b[n] = v;
    return put(pk, b, n + 1);
}

int proto_pack_kvn_bool(msgpack_packer *pk, const char *key, size_t klen, bool v)
{
    return pack_kv_byte(pk, key, klen, v ? 0xc3 : 0xc2);
}

int proto_pack_kvn_nil(msgpack_packer *pk, const char *key, size_t klen)
{
    return pack_kv_byte(pk, key, klen, 0xc0);
}

int proto_pack_kvn_str(msgpack_packer *pk, const char *key, size_t klen, const char *v,
                       size_t vlen)
{
    if (klen <= PACK_KEY_MAX && vlen <= PACK_STR_ONE_WRITE) {
        uint8_t b[PACK_BUF + PACK_STR_ONE_WRITE];
        size_t n = enc_key(b, key, klen);
        n += enc_str_hdr(b + n, vlen);
        memcpy(b + n, v, vlen);
        return put(pk, b, n + vlen);
    }
    PK(proto_pack_strn(pk, key, klen));
    return proto_pack_strn(pk, v, vlen);
}

int proto_pack_kv_bin(msgpack_packer *pk, const char *key, const void *data, size_t len)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_bin(pk, len));
    PK(msgpack_pack_bin_body(pk, data, len));
    return KVD_OK;
}

int proto_pack_kv_u32_array(msgpack_packer *pk, const char *key, const uint32_t *v, size_t n)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_array(pk, n));
    for (size_t i = 0; i < n; i++)
        PK(msgpack_pack_uint32(pk, v[i]));
    return KVD_OK;
}

int proto_reply_begin(msgpack_packer *pk, uint64_t id, size_t n_extra)
{
    /* map header, "id": id, "ok": true in one write */
    uint8_t b[5 + 3 + 9 + 3 + 1];
    size_t n = enc_map_hdr(b, n_extra + 2);
    n += enc_key(b + n, "id", 2);
    n += enc_uint(b + n, id);
    n += enc_key(b + n, "ok", 2);
    b[n++] = 0xc3;
    return put(pk, b, n);
}

int proto_pack_error(msgpack_packer *pk, uint64_t id, int code, const char *message)
{
    PK(msgpack_pack_map(pk, 3));
    PK(proto_pack_kv_uint(pk, "id", id));
    PK(proto_pack_kv_bool(pk, "ok", false));
    PK(proto_pack_str(pk, "error"));
    PK(msgpack_pack_map(pk, 2));
    PK(proto_pack_kv_str(pk, "code", kvd_err_code(code)));
    PK(proto_pack_kv_str(pk, "message", message ? message : ""));
    return KVD_OK;
}

int proto_event_begin(msgpack_packer *pk, uint64_t id, const char *event, size_t n_extra)
{
    PK(msgpack_pack_map(pk, n_extra + 2));
    PK(proto_pack_kv_uint(pk, "id", id));
    PK(proto_pack_kv_str(pk, "event", event));
    return KVD_OK;
}

int proto_request_begin(msgpack_packer *pk, const char *op, uint64_t id, size_t n_extra)
{
    PK(msgpack_pack_map(pk, n_extra + 2));
    PK(proto_pack_kv_str(pk, "op", op));
    PK(proto_pack_kv_uint(pk, "id", id));
    return KVD_OK;
}

int proto_frame_error(msgpack_sbuffer *sb, uint64_t id, int code, const char *message)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    PK(proto_pack_error(&pk, id, code, message));
    return proto_frame_end(sb, at);
}

int proto_frame_ok(msgpack_sbuffer *sb, uint64_t id)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    PK(proto_reply_begin(&pk, id, 0));
    return proto_frame_end(sb, at);
}

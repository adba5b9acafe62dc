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

int proto_pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    PK(msgpack_pack_str(pk, n));
    PK(msgpack_pack_str_body(pk, s, n));
    return KVD_OK;
}

int proto_pack_kv_uint(msgpack_packer *pk, const char *key, uint64_t v)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_uint64(pk, v));
    return KVD_OK;
}

int proto_pack_kv_int(msgpack_packer *pk, const char *key, int64_t v)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_int64(pk, v));
    return KVD_OK;
}

int proto_pack_kv_double(msgpack_packer *pk, const char *key, double v)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_double(pk, v));
    return KVD_OK;
}

int proto_pack_kv_bool(msgpack_packer *pk, const char *key, bool v)
{
    PK(proto_pack_str(pk, key));
    PK(v ? msgpack_pack_true(pk) : msgpack_pack_false(pk));
    return KVD_OK;
}

int proto_pack_kv_str(msgpack_packer *pk, const char *key, const char *v)
{
    PK(proto_pack_str(pk, key));
    PK(proto_pack_str(pk, v));
    return KVD_OK;
}

int proto_pack_kv_nil(msgpack_packer *pk, const char *key)
{
    PK(proto_pack_str(pk, key));
    PK(msgpack_pack_nil(pk));
    return KVD_OK;
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
    PK(msgpack_pack_map(pk, n_extra + 2));
    PK(proto_pack_kv_uint(pk, "id", id));
    PK(proto_pack_kv_bool(pk, "ok", true));
    return KVD_OK;
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

/* proto_pack: the encoding half of the kvd codec (see proto.h): frames in a
 * msgpack_sbuffer with a patched 4-byte length, and the reply, error, event
 * and request maps both sides build. With a proto_packer_init packer the
 * bytes are encoded straight into the sbuffer (no callback, no copy). */
#include <stdlib.h>
#include <string.h>

#include "proto.h"

/* First allocation of an empty sbuffer, as msgpack-c's own write does. */
#define SBUF_INIT 8192

/* Makes room for len more bytes after sb->size (doubling, like
 * msgpack_sbuffer_write); 0 or -1 when it cannot grow. */
static int sbuf_reserve(msgpack_sbuffer *sb, size_t len)
{
    if (sb->alloc - sb->size >= len)
        return 0;
    size_t want = sb->alloc ? sb->alloc : SBUF_INIT;
    while (want - sb->size < len) {
        if (want > SIZE_MAX / 2)
            return -1;
        want *= 2;
    }
    char *d = realloc(sb->data, want);
    if (!d)
        return -1;
    sb->data = d;
    sb->alloc = want;
    return 0;
}

int proto_sbuf_write(void *data, const char *buf, size_t len)
{
    msgpack_sbuffer *sb = data;
    if (sbuf_reserve(sb, len) != 0)
        return -1;
    if (len)
        memcpy(sb->data + sb->size, buf, len);
    sb->size += len;
    return 0;
}

void proto_packer_init(msgpack_packer *pk, msgpack_sbuffer *sb)
{
    msgpack_packer_init(pk, sb, proto_sbuf_write);
}

size_t proto_frame_begin(msgpack_sbuffer *sb)
{
    size_t at = sb->size;
    if (sbuf_reserve(sb, KVD_FRAME_HEADER_BYTES) != 0)
        return SIZE_MAX;
    memset(sb->data + at, 0, KVD_FRAME_HEADER_BYTES);
    sb->size += KVD_FRAME_HEADER_BYTES;
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
    if (sbuf_reserve(sb, len) != 0)
        return NULL;
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

static bool is_direct(const msgpack_packer *pk)
{
    return pk->callback == proto_sbuf_write;
}

/* Where an encoding of at most n bytes is built: in place at the end of the
 * sbuffer for a direct packer (reserved, not yet counted), else in the
 * caller's scratch (n bytes or more). NULL: the sbuffer cannot grow. */
static uint8_t *reserve(msgpack_packer *pk, uint8_t *scratch, size_t n)
{
    if (!is_direct(pk))
        return scratch;
    msgpack_sbuffer *sb = pk->data;
    if (sbuf_reserve(sb, n) != 0)
        return NULL;
    return (uint8_t *)sb->data + sb->size;
}

/* Commits the n bytes built at b (from reserve). */
static int emit(msgpack_packer *pk, const uint8_t *b, size_t n)
{
    if (is_direct(pk)) {
        ((msgpack_sbuffer *)pk->data)->size += n;
        return KVD_OK;
    }
    return pk->callback(pk->data, (const char *)b, n) ? KVD_ENOMEM : KVD_OK;
}

/* A header and a body that is copied as is (strings, bins): one write. */
static int put2(msgpack_packer *pk, const uint8_t *h, size_t hn, const void *body, size_t bn)
{
    if (is_direct(pk)) {
        msgpack_sbuffer *sb = pk->data;
        if (bn > SIZE_MAX - hn || sbuf_reserve(sb, hn + bn) != 0)
            return KVD_ENOMEM;
        memcpy(sb->data + sb->size, h, hn);
        if (bn)
            memcpy(sb->data + sb->size + hn, body, bn);
        sb->size += hn + bn;
        return KVD_OK;
    }
    if (pk->callback(pk->data, (const char *)h, hn))
        return KVD_ENOMEM;
    if (bn && pk->callback(pk->data, (const char *)body, bn))
        return KVD_ENOMEM;
    return KVD_OK;
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

static size_t enc_array_hdr(uint8_t *b, size_t n)
{
    if (n < 16) {
        b[0] = (uint8_t)(0x90 | n);
        return 1;
    }
    if (n < 65536)
        return be16(b, 0xdc, (uint16_t)n);
    return be32(b, 0xdd, (uint32_t)n);
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
    uint8_t h[5];
    return put2(pk, h, enc_str_hdr(h, n), s, n);
}

int proto_pack_map(msgpack_packer *pk, size_t n)
{
    uint8_t s[5], *b = reserve(pk, s, sizeof(s));
    return b ? emit(pk, b, enc_map_hdr(b, n)) : KVD_ENOMEM;
}

int proto_pack_array(msgpack_packer *pk, size_t n)
{
    uint8_t s[5], *b = reserve(pk, s, sizeof(s));
    return b ? emit(pk, b, enc_array_hdr(b, n)) : KVD_ENOMEM;
}

/* Starts a pair whose value takes at most vmax bytes (vmax <= 9): returns
 * where the value goes, with the key already there (*n bytes of it) when it
 * is short; a long key is packed on its own first (*n = 0). NULL: no
 * memory. scratch holds PACK_BUF bytes. */
static uint8_t *kv_begin(msgpack_packer *pk, uint8_t *scratch, const char *key, size_t klen,
                         size_t vmax, size_t *n)
{
    uint8_t *b;
    *n = 0;
    if (klen > PACK_KEY_MAX) {
        if (proto_pack_strn(pk, key, klen) != 0)
            return NULL;
        return reserve(pk, scratch, vmax);
    }
    b = reserve(pk, scratch, 2 + klen + vmax);
    if (b)
        *n = enc_key(b, key, klen);
    return b;
}

int proto_pack_kvn_uint(msgpack_packer *pk, const char *key, size_t klen, uint64_t v)
{
    uint8_t s[PACK_BUF];
    size_t n;
    uint8_t *b = kv_begin(pk, s, key, klen, 9, &n);
    return b ? emit(pk, b, n + enc_uint(b + n, v)) : KVD_ENOMEM;
}

int proto_pack_kvn_int(msgpack_packer *pk, const char *key, size_t klen, int64_t v)
{
    uint8_t s[PACK_BUF];
    size_t n;
    uint8_t *b = kv_begin(pk, s, key, klen, 9, &n);
    return b ? emit(pk, b, n + enc_int(b + n, v)) : KVD_ENOMEM;
}

int proto_pack_kvn_double(msgpack_packer *pk, const char *key, size_t klen, double v)
{
    uint8_t s[PACK_BUF];
    uint64_t bits;
    size_t n;
    memcpy(&bits, &v, sizeof(bits));
    uint8_t *b = kv_begin(pk, s, key, klen, 9, &n);
    return b ? emit(pk, b, n + be64(b + n, 0xcb, bits)) : KVD_ENOMEM;
}

/* A key and a one-byte value (nil, true, false). */
static int pack_kv_byte(msgpack_packer *pk, const char *key, size_t klen, uint8_t v)
{
    uint8_t s[PACK_BUF];
    size_t n;
    uint8_t *b = kv_begin(pk, s, key, klen, 1, &n);
    if (!b)
        return KVD_ENOMEM;
    b[n] = v;
    return emit(pk, b, n + 1);
}

int proto_pack_kvn_bool(msgpack_packer *pk, const char *key, size_t klen, bool v)
{
    return pack_kv_byte(pk, key, klen, v ? 0xc3 : 0xc2);
}

int proto_pack_kvn_nil(msgpack_packer *pk, const char *key, size_t klen)
{
    return pack_kv_byte(pk, key, klen, 0xc0);
}

int proto_pack_kvn_str(msgpack_packer *pk, const char *key, size_t klen, const char *v, size_t vlen)
{
    /* key and the value's header together, then the body */
    uint8_t s[PACK_BUF];
    size_t n;
    if (klen > PACK_KEY_MAX) {
        PK(proto_pack_strn(pk, key, klen));
        return proto_pack_strn(pk, v, vlen);
    }
    n = enc_key(s, key, klen);
    n += enc_str_hdr(s + n, vlen);
    return put2(pk, s, n, v, vlen);
}

int proto_pack_kv_bin(msgpack_packer *pk, const char *key, const void *data, size_t len)
{
    uint8_t h[5];
    size_t n;
    PK(proto_pack_str(pk, key));
    if (len < 256) {
        h[0] = 0xc4;
        h[1] = (uint8_t)len;
        n = 2;
    } else if (len < 65536) {
        n = be16(h, 0xc5, (uint16_t)len);
    } else {
        if (len > UINT32_MAX)
            return KVD_ETOOLARGE;
        n = be32(h, 0xc6, (uint32_t)len);
    }
    return put2(pk, h, n, data, len);
}

/* Token ids are encoded this many at a time (each at most 5 bytes). */
#define PACK_U32_CHUNK 64

int proto_pack_kv_u32_array(msgpack_packer *pk, const char *key, const uint32_t *v, size_t n)
{
    uint8_t s[5 * PACK_U32_CHUNK];
    PK(proto_pack_str(pk, key));
    PK(proto_pack_array(pk, n));
    for (size_t i = 0; i < n;) {
        size_t k = n - i < PACK_U32_CHUNK ? n - i : PACK_U32_CHUNK, len = 0;
        uint8_t *b = reserve(pk, s, 5 * k);
        if (!b)
            return KVD_ENOMEM;
        for (size_t j = 0; j < k; j++)
            len += enc_uint(b + len, v[i + j]);
        PK(emit(pk, b, len));
        i += k;
    }
    return KVD_OK;
}

int proto_reply_begin(msgpack_packer *pk, uint64_t id, size_t n_extra)
{
    /* map header, "id": id, "ok": true in one write */
    uint8_t s[5 + 3 + 9 + 3 + 1], *b = reserve(pk, s, sizeof(s));
    if (!b)
        return KVD_ENOMEM;
    size_t n = enc_map_hdr(b, n_extra + 2);
    n += enc_key(b + n, "id", 2);
    n += enc_uint(b + n, id);
    n += enc_key(b + n, "ok", 2);
    b[n++] = 0xc3;
    return emit(pk, b, n);
}

/* A deferred map header's room: the largest header (map32). */
#define MAP_RESERVE 5

size_t proto_map_begin(msgpack_packer *pk)
{
    if (!is_direct(pk))
        return SIZE_MAX;
    msgpack_sbuffer *sb = pk->data;
    if (sbuf_reserve(sb, MAP_RESERVE) != 0)
        return SIZE_MAX;
    size_t at = sb->size;
    memset(sb->data + at, 0xc0, MAP_RESERVE); /* patched by proto_map_end */
    sb->size += MAP_RESERVE;
    return at;
}

int proto_map_end(msgpack_packer *pk, size_t at)
{
    if (!is_direct(pk))
        return KVD_EINTERNAL;
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    msgpack_sbuffer *sb = pk->data;
    if (at > sb->size || sb->size - at < MAP_RESERVE)
        return KVD_EINTERNAL;
    uint8_t *hdr = (uint8_t *)sb->data + at, *body = hdr + MAP_RESERVE;
    size_t blen = sb->size - at - MAP_RESERVE, n;
    if (proto_count_objects(body, blen, &n) != KVD_OK || n % 2 != 0)
        return KVD_EINTERNAL;
    size_t hn = enc_map_hdr(hdr, n / 2);
    if (hn < MAP_RESERVE) {
        memmove(hdr + hn, body, blen);
        sb->size -= MAP_RESERVE - hn;
    }
    return KVD_OK;
}

size_t proto_reply_begin_map(msgpack_packer *pk, uint64_t id)
{
    size_t at = proto_map_begin(pk);
    if (at == SIZE_MAX)
        return SIZE_MAX;
    uint8_t s[3 + 9 + 3 + 1], *b = reserve(pk, s, sizeof(s));
    if (!b) {
        ((msgpack_sbuffer *)pk->data)->size = at;
        return SIZE_MAX;
    }
    size_t n = enc_key(b, "id", 2);
    n += enc_uint(b + n, id);
    n += enc_key(b + n, "ok", 2);
    b[n++] = 0xc3;
    emit(pk, b, n);
    return at;
}

int proto_pack_error(msgpack_packer *pk, uint64_t id, int code, const char *message)
{
    PK(proto_pack_map(pk, 3));
    PK(proto_pack_kv_uint(pk, "id", id));
    PK(proto_pack_kv_bool(pk, "ok", false));
    PK(proto_pack_str(pk, "error"));
    PK(proto_pack_map(pk, 2));
    PK(proto_pack_kv_str(pk, "code", kvd_err_code(code)));
    PK(proto_pack_kv_str(pk, "message", message ? message : ""));
    return KVD_OK;
}

int proto_event_begin(msgpack_packer *pk, uint64_t id, const char *event, size_t n_extra)
{
    PK(proto_pack_map(pk, n_extra + 2));
    PK(proto_pack_kv_uint(pk, "id", id));
    PK(proto_pack_kv_str(pk, "event", event));
    return KVD_OK;
}

int proto_request_begin(msgpack_packer *pk, const char *op, uint64_t id, size_t n_extra)
{
    PK(proto_pack_map(pk, n_extra + 2));
    PK(proto_pack_kv_str(pk, "op", op));
    PK(proto_pack_kv_uint(pk, "id", id));
    return KVD_OK;
}

int proto_frame_error(msgpack_sbuffer *sb, uint64_t id, int code, const char *message)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    PK(proto_pack_error(&pk, id, code, message));
    return proto_frame_end(sb, at);
}

int proto_frame_ok(msgpack_sbuffer *sb, uint64_t id)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    PK(proto_reply_begin(&pk, id, 0));
    return proto_frame_end(sb, at);
}

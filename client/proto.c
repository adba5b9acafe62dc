/* proto: framing, strict parsing and typed lookups of kvd messages (see
 * proto.h; the encoding helpers are in proto_pack.c). Untrusted bytes are
 * first walked by proto_scan(), which checks every count against the bytes
 * that remain and the protocol's limits, so msgpack-c never allocates more
 * than a small multiple of the frame. */
#include "proto.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <limits.h>
#include <errno.h>
#include <unistd.h>

int kvd_error_set(struct kvd_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---- framing ------------------------------------------------------------ */

enum proto_frame_status proto_frame_peek(const void *buf, size_t avail, size_t max_frame,
                                         size_t *payload_len)
{
    const uint8_t *p = buf;
    *payload_len = 0;
    if (avail < KVD_FRAME_HEADER_BYTES)
        return PROTO_FRAME_NEED_MORE;
    uint32_t n = (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
    *payload_len = n;
    if (n == 0)
        return PROTO_FRAME_EMPTY;
    if (n > max_frame)
        return PROTO_FRAME_TOO_LARGE;
    if (avail - KVD_FRAME_HEADER_BYTES < n)
        return PROTO_FRAME_NEED_MORE;
    return PROTO_FRAME_READY;
}

/* ---- structure scan ----------------------------------------------------- */

static uint64_t be_read(const uint8_t *p, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes; i++)
        v = v << 8 | p[i];
    return v;
}

/* Walks one msgpack object at the start of p[0..len) without allocating and
 * sets *end to the offset just past it. Containers count their children
 * against the bytes left (each child takes at least one byte), against
 * KVD_MAX_ARRAY and KVD_MAX_DEPTH; all objects against KVD_MAX_OBJECTS. */
static int proto_scan(const uint8_t *p, size_t len, size_t *end, size_t *n_objects,
                      struct kvd_error *err)
{
    uint64_t pending[KVD_MAX_DEPTH + 1]; /* objects still to read at each depth */
    int depth = 0;
    size_t pos = 0, objects = 0;

    pending[0] = 1;
    while (depth >= 0) {
        if (pending[depth] == 0) {
            depth--;
            continue;
        }
        pending[depth]--;
        if (pos >= len)
            return kvd_error_set(err, KVD_EBADREQ, "truncated msgpack data");
        if (++objects > KVD_MAX_OBJECTS)
            return kvd_error_set(err, KVD_ETOOLARGE, "message holds more than %u objects",
                                 KVD_MAX_OBJECTS);
        uint8_t b = p[pos++];
        uint64_t skip = 0;     /* payload bytes after the header */
        uint64_t n = 0;        /* entries of a container */
        uint64_t children = 0; /* objects inside a container (2n for maps) */
        unsigned lenbytes = 0; /* size of a length field that follows b */
        int kind = 0;          /* 0 scalar, 1 array, 2 map, 3 str/bin (len prefixed), 4 ext */

        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, bool: no payload */
        } else if (b >= 0x80 && b <= 0x8f) {
            kind = 2;
            n = b & 0x0f;
        } else if (b >= 0x90 && b <= 0x9f) {
            kind = 1;
            n = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4:
            case 0xd9:
                kind = 3;
                lenbytes = 1;
                break;
            case 0xc5:
            case 0xda:
                kind = 3;
                lenbytes = 2;
                break;
            case 0xc6:
            case 0xdb:
                kind = 3;
                lenbytes = 4;
                break;
            case 0xc7:
                kind = 4;
                lenbytes = 1;
                break;
            case 0xc8:
                kind = 4;
                lenbytes = 2;
                break;
            case 0xc9:
                kind = 4;
                lenbytes = 4;
                break;
            case 0xca:
                skip = 4;
                break;
            case 0xcb:
                skip = 8;
                break;
            case 0xcc:
            case 0xd0:
                skip = 1;
                break;
            case 0xcd:
            case 0xd1:
                skip = 2;
                break;
            case 0xce:
            case 0xd2:
                skip = 4;
                break;
            case 0xcf:
            case 0xd3:
                skip = 8;
                break;
            case 0xd4:
                skip = 2;
                break;
            case 0xd5:
                skip = 3;
                break;
            case 0xd6:
                skip = 5;
                break;
            case 0xd7:
                skip = 9;
                break;
            case 0xd8:
                skip = 17;
                break;
            case 0xdc:
                kind = 1;
                lenbytes = 2;
                break;
            case 0xdd:
                kind = 1;
                lenbytes = 4;
                break;
            case 0xde:
                kind = 2;
                lenbytes = 2;
                break;
            case 0xdf:
                kind = 2;
                lenbytes = 4;
                break;
            default:
                return kvd_error_set(err, KVD_EBADREQ, "invalid msgpack byte 0x%02x", b);
            }
        }
        if (lenbytes) {
            if (len - pos < lenbytes)
                return kvd_error_set(err, KVD_EBADREQ, "truncated msgpack data");
            uint64_t v = be_read(p + pos, lenbytes);
            pos += lenbytes;
            if (kind == 3)
                skip = v;
            else if (kind == 4)
                skip = v + 1; /* the ext type byte */
            else
                n = v;
        }
        if (skip > len - pos)
            return kvd_error_set(err, KVD_EBADREQ, "truncated msgpack data");
        pos += skip;
        if (kind == 1 || kind == 2) {
            if (n > KVD_MAX_ARRAY)
                return kvd_error_set(err, KVD_ETOOLARGE, "%s of %llu entries (limit %u)",
                                     kind == 1 ? "array" : "map", (unsigned long long)n,
                                     KVD_MAX_ARRAY);
            children = kind == 2 ? 2 * n : n;
            if (children > len - pos)
                return kvd_error_set(err, KVD_EBADREQ,
                                     "truncated msgpack data (%s claims %llu entries)",
                                     kind == 1 ? "array" : "map", (unsigned long long)n);
            if (children) {
                if (depth + 1 > (int)KVD_MAX_DEPTH)
                    return kvd_error_set(err, KVD_EBADREQ, "message nested deeper than %u",
                                         KVD_MAX_DEPTH);
                pending[++depth] = children;
            }
        }
    }
    *end = pos;
    if (n_objects)
        *n_objects = objects;
    return KVD_OK;
}

int proto_count_objects(const void *p, size_t len, size_t *n)
{
    struct kvd_error err;
    size_t pos = 0, count = 0;
    while (pos < len) {
        size_t end;
        if (proto_scan((const uint8_t *)p + pos, len - pos, &end, NULL, &err) != KVD_OK)
            return KVD_EINTERNAL;
        pos += end;
        count++;
    }
    *n = count;
    return KVD_OK;
}

/* ---- parsing ------------------------------------------------------------ */

/* The checks before msgpack-c sees the bytes: a map, well formed, within
 * the limits, nothing after it. */
static int msg_precheck(const uint8_t *p, size_t len, size_t *n_objects, struct kvd_error *err)
{
    size_t end = 0;
    if (len == 0)
        return kvd_error_set(err, KVD_EBADREQ, "empty message");
    if (!((p[0] >= 0x80 && p[0] <= 0x8f) || p[0] == 0xde || p[0] == 0xdf))
        return kvd_error_set(err, KVD_EBADREQ, "message is not a msgpack map");
    int rc = proto_scan(p, len, &end, n_objects, err);
    if (rc)
        return rc;
    if (end != len)
        return kvd_error_set(err, KVD_EBADREQ, "%zu trailing bytes after the message map",
                             len - end);
    return KVD_OK;
}

/* Every key of the root map must be a string. */
static int msg_check_keys(const msgpack_object *root, struct kvd_error *err)
{
    for (uint32_t i = 0; i < root->via.map.size; i++)
        if (root->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR)
            return kvd_error_set(err, KVD_EBADREQ, "message key #%u is not a string", i);
    return KVD_OK;
}

int proto_msg_parse(struct proto_msg *m, const void *payload, size_t len, struct kvd_error *err)
{
    size_t off = 0;
    int rc;

    m->root = NULL;
    m->borrowed = NULL;
    rc = msg_precheck(payload, len, NULL, err);
    if (rc)
        return rc;
    msgpack_unpacked_init(&m->up);
    msgpack_unpack_return ur = msgpack_unpack_next(&m->up, payload, len, &off);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR) {
        msgpack_unpacked_destroy(&m->up);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory decoding the message");
    }
    if (ur != MSGPACK_UNPACK_SUCCESS || off != len || m->up.data.type != MSGPACK_OBJECT_MAP) {
        msgpack_unpacked_destroy(&m->up);
        return kvd_error_set(err, KVD_EBADREQ, "malformed msgpack message");
    }
    rc = msg_check_keys(&m->up.data, err);
    if (rc) {
        msgpack_unpacked_destroy(&m->up);
        return rc;
    }
    m->root = &m->up.data;
    return KVD_OK;
}

int proto_msg_check(const void *payload, size_t len, size_t *n_objects, struct kvd_error *err)
{
    return msg_precheck(payload, len, n_objects, err);
}

int proto_msg_parse_in(struct proto_msg *m, const void *payload, size_t len, msgpack_zone *zone,
                       struct kvd_error *err)
{
    size_t off = 0;
    int rc;

    m->root = NULL;
    m->borrowed = NULL;
    rc = msg_precheck(payload, len, NULL, err);
    if (rc)
        return rc;
    m->up.zone = NULL;
    msgpack_unpack_return ur = msgpack_unpack(payload, len, &off, zone, &m->up.data);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR)
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory decoding the message");
    else if (ur != MSGPACK_UNPACK_SUCCESS || off != len || m->up.data.type != MSGPACK_OBJECT_MAP)
        rc = kvd_error_set(err, KVD_EBADREQ, "malformed msgpack message");
    else
        rc = msg_check_keys(&m->up.data, err);
    if (rc) {
        msgpack_zone_clear(zone);
        return rc;
    }
    m->borrowed = zone;
    m->root = &m->up.data;
    return KVD_OK;
}

void proto_msg_free(struct proto_msg *m)
{
    if (m->root && m->borrowed)
        msgpack_zone_clear(m->borrowed);
    else if (m->root)
        msgpack_unpacked_destroy(&m->up);
    m->root = NULL;
    m->borrowed = NULL;
}

uint64_t proto_msg_id(const struct proto_msg *m)
{
    const msgpack_object *o = m->root ? proto_map_find(m->root, "id") : NULL;
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return o->via.u64;
    return 0;
}

/* ---- typed lookups ------------------------------------------------------ */

const msgpack_object *proto_map_find(const msgpack_object *map, const char *key)
{
    size_t klen = strlen(key);
    if (!map || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        /* first byte inline: most keys differ there, and a memcmp call
         * per key showed in the profile of small requests */
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            (klen == 0 || k->via.str.ptr[0] == key[0]) && memcmp(k->via.str.ptr, key, klen) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

/* Finds key: returns 1 with *o set when present and not nil; otherwise 0,
 * with *rc = bad_request when the key is required, else *rc = 0. */
static int lookup(const msgpack_object *map, const char *key, bool required,
                  const msgpack_object **o, bool *present, struct kvd_error *err, int *rc)
{
    *o = proto_map_find(map, key);
    *rc = KVD_OK;
    if (present)
        *present = false;
    if (!*o || (*o)->type == MSGPACK_OBJECT_NIL) {
        if (required)
            *rc = kvd_error_set(err, KVD_EBADREQ, "missing '%s'", key);
        return 0;
    }
    if (present)
        *present = true;
    return 1;
}

static int get_uint(const msgpack_object *map, const char *key, bool req, uint64_t *out,
                    bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must not be negative", key);
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be an unsigned integer", key);
    *out = o->via.u64;
    return KVD_OK;
}

int proto_get_uint(const msgpack_object *map, const char *key, uint64_t *out, struct kvd_error *err)
{
    return get_uint(map, key, true, out, NULL, err);
}

int proto_opt_uint(const msgpack_object *map, const char *key, uint64_t *out, bool *present,
                   struct kvd_error *err)
{
    return get_uint(map, key, false, out, present, err);
}

static int get_int(const msgpack_object *map, const char *key, bool req, int64_t *out,
                   bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.i64;
        return KVD_OK;
    }
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX)
            return kvd_error_set(err, KVD_EBADREQ, "'%s' is out of range", key);
        *out = (int64_t)o->via.u64;
        return KVD_OK;
    }
    return kvd_error_set(err, KVD_EBADREQ, "'%s' must be an integer", key);
}

int proto_get_int(const msgpack_object *map, const char *key, int64_t *out, struct kvd_error *err)
{
    return get_int(map, key, true, out, NULL, err);
}

int proto_opt_int(const msgpack_object *map, const char *key, int64_t *out, bool *present,
                  struct kvd_error *err)
{
    return get_int(map, key, false, out, present, err);
}

static int get_double(const msgpack_object *map, const char *key, bool req, double *out,
                      bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        *out = o->via.f64;
        return KVD_OK;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        *out = (double)o->via.u64;
        return KVD_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        *out = (double)o->via.i64;
        return KVD_OK;
    default:
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be a number", key);
    }
}

int proto_get_double(const msgpack_object *map, const char *key, double *out, struct kvd_error *err)
{
    return get_double(map, key, true, out, NULL, err);
}

int proto_opt_double(const msgpack_object *map, const char *key, double *out, bool *present,
                     struct kvd_error *err)
{
    return get_double(map, key, false, out, present, err);
}

static int get_bool(const msgpack_object *map, const char *key, bool req, bool *out, bool *present,
                    struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be a boolean", key);
    *out = o->via.boolean;
    return KVD_OK;
}

int proto_get_bool(const msgpack_object *map, const char *key, bool *out, struct kvd_error *err)
{
    return get_bool(map, key, true, out, NULL, err);
}

int proto_opt_bool(const msgpack_object *map, const char *key, bool *out, bool *present,
                   struct kvd_error *err)
{
    return get_bool(map, key, false, out, present, err);
}

static int get_str(const msgpack_object *map, const char *key, bool req, const char **s,
                   size_t *len, bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type != MSGPACK_OBJECT_STR)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be a string", key);
    *s = o->via.str.ptr;
    *len = o->via.str.size;
    return KVD_OK;
}

int proto_get_str(const msgpack_object *map, const char *key, const char **s, size_t *len,
                  struct kvd_error *err)
{
    return get_str(map, key, true, s, len, NULL, err);
}

int proto_opt_str(const msgpack_object *map, const char *key, const char **s, size_t *len,
                  bool *present, struct kvd_error *err)
{
    return get_str(map, key, false, s, len, present, err);
}

static int get_strz(const msgpack_object *map, const char *key, bool req, char *buf, size_t cap,
                    bool *present, struct kvd_error *err)
{
    const char *s = NULL;
    size_t len = 0;
    bool have = false;
    int rc = get_str(map, key, req, &s, &len, &have, err);
    if (present)
        *present = have;
    if (rc || !have)
        return rc;
    if (len + 1 > cap)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' is longer than %zu bytes", key, cap - 1);
    if (memchr(s, '\0', len))
        return kvd_error_set(err, KVD_EBADREQ, "'%s' contains a NUL byte", key);
    memcpy(buf, s, len);
    buf[len] = '\0';
    return KVD_OK;
}

int proto_get_strz(const msgpack_object *map, const char *key, char *buf, size_t cap,
                   struct kvd_error *err)
{
    return get_strz(map, key, true, buf, cap, NULL, err);
}

int proto_opt_strz(const msgpack_object *map, const char *key, char *buf, size_t cap, bool *present,
                   struct kvd_error *err)
{
    return get_strz(map, key, false, buf, cap, present, err);
}

static int get_bin(const msgpack_object *map, const char *key, bool req, const void **data,
                   size_t *len, bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type != MSGPACK_OBJECT_BIN)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be binary (msgpack bin)", key);
    *data = o->via.bin.ptr;
    *len = o->via.bin.size;
    return KVD_OK;
}

int proto_get_bin(const msgpack_object *map, const char *key, const void **data, size_t *len,
                  struct kvd_error *err)
{
    return get_bin(map, key, true, data, len, NULL, err);
}

int proto_opt_bin(const msgpack_object *map, const char *key, const void **data, size_t *len,
                  bool *present, struct kvd_error *err)
{
    return get_bin(map, key, false, data, len, present, err);
}

static int get_u32_array(const msgpack_object *map, const char *key, bool req, size_t max,
                         uint32_t **out, size_t *n, bool *present, struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be an array of unsigned integers", key);
    size_t count = o->via.array.size;
    if (count > max)
        return kvd_error_set(err, KVD_ETOOLARGE, "'%s' has %zu entries (limit %zu)", key, count,
                             max);
    uint32_t *v = NULL;
    if (count) {
        v = malloc(count * sizeof(*v));
        if (!v)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory for '%s'", key);
    }
    for (size_t i = 0; i < count; i++) {
        const msgpack_object *e = &o->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER || e->via.u64 > UINT32_MAX) {
            free(v);
            return kvd_error_set(err, KVD_EBADREQ,
                                 "'%s'[%zu] must be an unsigned integer below 2^32", key, i);
        }
        v[i] = (uint32_t)e->via.u64;
    }
    *out = v;
    *n = count;
    return KVD_OK;
}

int proto_get_u32_array(const msgpack_object *map, const char *key, size_t max, uint32_t **out,
                        size_t *n, struct kvd_error *err)
{
    return get_u32_array(map, key, true, max, out, n, NULL, err);
}

int proto_opt_u32_array(const msgpack_object *map, const char *key, size_t max, uint32_t **out,
                        size_t *n, bool *present, struct kvd_error *err)
{
    return get_u32_array(map, key, false, max, out, n, present, err);
}

static int get_typed(const msgpack_object *map, const char *key, bool req, msgpack_object_type t,
                     const char *what, const msgpack_object **out, bool *present,
                     struct kvd_error *err)
{
    const msgpack_object *o;
    int rc;
    if (!lookup(map, key, req, &o, present, err, &rc))
        return rc;
    if (o->type != t)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be %s", key, what);
    *out = o;
    return KVD_OK;
}

int proto_get_map(const msgpack_object *map, const char *key, const msgpack_object **out,
                  struct kvd_error *err)
{
    return get_typed(map, key, true, MSGPACK_OBJECT_MAP, "a map", out, NULL, err);
}

int proto_opt_map(const msgpack_object *map, const char *key, const msgpack_object **out,
                  bool *present, struct kvd_error *err)
{
    return get_typed(map, key, false, MSGPACK_OBJECT_MAP, "a map", out, present, err);
}

int proto_get_array(const msgpack_object *map, const char *key, const msgpack_object **out,
                    struct kvd_error *err)
{
    return get_typed(map, key, true, MSGPACK_OBJECT_ARRAY, "an array", out, NULL, err);
}

int proto_reply_status(const msgpack_object *root, struct kvd_error *err)
{
    bool ok = false;
    const msgpack_object *e = NULL;
    const char *code, *msg;
    size_t clen, mlen;
    char cbuf[32];

    if (proto_get_bool(root, "ok", &ok, err))
        return KVD_EBADREQ;
    if (ok)
        return KVD_OK;
    if (proto_get_map(root, "error", &e, err) || proto_get_str(e, "code", &code, &clen, err) ||
        proto_get_str(e, "message", &msg, &mlen, err))
        return kvd_error_set(err, KVD_EBADREQ, "malformed error reply");
    snprintf(cbuf, sizeof(cbuf), "%.*s", (int)(clen < 31 ? clen : 31), code);
    int c = kvd_err_from_code(cbuf);
    if (c == KVD_OK)
        c = KVD_EINTERNAL;
    return kvd_error_set(err, c, "%.*s", (int)(mlen < 255 ? mlen : 255), msg);
}

/* ---- misc --------------------------------------------------------------- */

int proto_socket_fallback(char *buf, size_t cap)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (xdg && xdg[0] == '/')
        n = snprintf(buf, cap, "%s/%s", xdg, KVD_SOCKET_NAME);
    else
        n = snprintf(buf, cap, "/tmp/kvd-%u/%s", (unsigned)getuid(), KVD_SOCKET_NAME);
    if (n < 0 || (size_t)n >= cap)
        return KVD_ETOOLARGE;
    return KVD_OK;
}

int proto_socket_path_check(const char *path, uid_t uid, bool own_dir, char *err, size_t errlen)
{
    char dir[PATH_MAX], real[PATH_MAX];
    struct stat st;
    const char *slash = strrchr(path, '/');
    if (!slash || (size_t)(slash - path) >= sizeof(dir)) {
        snprintf(err, errlen, "'%s' is not an absolute socket path", path);
        return KVD_EPERM;
    }
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    memcpy(dir, path, n);
    dir[n] = '\0';
    if (!realpath(dir, real)) {
        snprintf(err, errlen, "%s: %s", dir, strerror(errno));
        return errno == ENOENT ? KVD_ENOTFOUND : KVD_EPERM;
    }
    /* The socket's own directory, then each one above it. */
    bool parent = true;
    for (;;) {
        if (lstat(real, &st) != 0 || !S_ISDIR(st.st_mode)) {
            snprintf(err, errlen, "%s is not a directory", real);
            return KVD_EPERM;
        }
        bool owner_ok = st.st_uid == uid || (st.st_uid == 0 && !(own_dir && parent));
        if (!owner_ok) {
            snprintf(err, errlen,
                     "%s is owned by uid %u, not %s%u: another user could put a socket of "
                     "their own there; refusing %s",
                     real, (unsigned)st.st_uid, own_dir && parent ? "" : "root or uid ",
                     (unsigned)uid, path);
            return KVD_EPERM;
        }
        if ((st.st_mode & 022) && ((own_dir && parent) || !(st.st_mode & S_ISVTX))) {
            snprintf(err, errlen,
                     "%s is writable by %s (mode %04o): another user could replace the "
                     "socket; refusing %s",
                     real, st.st_mode & 002 ? "others" : "its group",
                     (unsigned)(st.st_mode & 07777), path);
            return KVD_EPERM;
        }
        if (!strcmp(real, "/"))
            break;
        char *s = strrchr(real, '/');
        if (s == real)
            s[1] = '\0';
        else
            *s = '\0';
        parent = false;
    }
    if (own_dir && lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode) || (st.st_uid != uid && st.st_uid != 0)) {
            snprintf(err, errlen, "%s is %s owned by uid %u; refusing it", path,
                     S_ISSOCK(st.st_mode) ? "a socket" : "not a socket", (unsigned)st.st_uid);
            return KVD_EPERM;
        }
    }
    return 0;
}

const char *proto_tier_name(int tier)
{
    return tier == 1 ? "host" : "device";
}

int proto_tier_from_name(const char *s, size_t len)
{
    if (len == 6 && memcmp(s, "device", 6) == 0)
        return 0;
    if (len == 4 && memcmp(s, "host", 4) == 0)
        return 1;
    return -1;
}

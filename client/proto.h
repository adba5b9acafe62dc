/* proto: the kvd wire codec shared by the daemon and libkvd. It is the one
 * place that parses untrusted bytes: length framing, strict message parse,
 * typed key lookups that produce the protocol's error naming the key, and
 * helpers that pack replies, errors, events and requests into frames.
 * No libevent types here; msgpack-c (C API) only. */
#ifndef KVD_PROTO_H
#define KVD_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <string.h>

#include <msgpack.h>

#include "kvd/protocol.h"
#include "kvd/status.h"

/* Every function below that fails fills a struct kvd_error (kvd/status.h)
 * when given non-NULL. */

/* ---- framing ------------------------------------------------------------ */

enum proto_frame_status {
    PROTO_FRAME_NEED_MORE = 0, /* fewer than 4 + N bytes buffered */
    PROTO_FRAME_READY = 1,     /* a whole frame: payload at buf+4, *len bytes */
    PROTO_FRAME_EMPTY = -1,    /* length 0: bad_request */
    PROTO_FRAME_TOO_LARGE = -2 /* length > max_frame: too_large (known from the header alone) */
};

/* Looks at the start of a receive buffer holding `avail` bytes in all;
 * only the first 4 bytes of buf are read (a caller with a scattered buffer
 * may pass a copy of just the header with the total count). On READY,
 * *payload_len = N and the frame occupies 4 + N bytes. On NEED_MORE,
 * *payload_len is N when the header is complete (so the caller can size its
 * buffer), else 0. On TOO_LARGE, *payload_len is the announced N. */
enum proto_frame_status proto_frame_peek(const void *buf, size_t avail, size_t max_frame,
                                         size_t *payload_len);

/* ---- parsing ------------------------------------------------------------ */

/* A parsed message. root is the top-level map. Strings and bins point into
 * the payload the message was parsed from, which must outlive it. */
struct proto_msg {
    msgpack_unpacked up;
    const msgpack_object *root; /* type MSGPACK_OBJECT_MAP */
    msgpack_zone *borrowed;     /* the caller's zone (proto_msg_parse_in), else NULL */
};

/* Strict parse of one payload: exactly one msgpack map and no trailing
 * bytes; nesting <= KVD_MAX_DEPTH, every array/map <= KVD_MAX_ARRAY entries,
 * <= KVD_MAX_OBJECTS objects in all. The structure is validated before
 * msgpack-c allocates anything, so a small frame cannot claim a huge array.
 * Errors: bad_request (not msgpack, not a map, trailing bytes, too deep),
 * too_large (array or object count over a limit). On error m needs no free. */
int proto_msg_parse(struct proto_msg *m, const void *payload, size_t len, struct kvd_error *err);
/* proto_msg_parse with the objects built in a caller-owned zone, which the
 * daemon reuses for every request instead of a zone malloc'd and freed per
 * message; proto_msg_free then clears the zone (msgpack_zone_clear keeps its
 * first chunk). Same checks, same errors. */
int proto_msg_parse_in(struct proto_msg *m, const void *payload, size_t len, msgpack_zone *zone,
                       struct kvd_error *err);
void proto_msg_free(struct proto_msg *m);
/* The checks of proto_msg_parse that come before decoding (one map, well
 * formed, every count within the bytes and the limits, no trailing bytes),
 * for a decoder that builds its own tree (libkvd): *n_objects gets the
 * number of msgpack objects, the root included. Keys are not checked. */
int proto_msg_check(const void *payload, size_t len, size_t *n_objects, struct kvd_error *err);

/* The request id of a parsed message, 0 when absent or not a uint (used for
 * error replies to a request that failed before its id was validated). */
uint64_t proto_msg_id(const struct proto_msg *m);

/* ---- typed lookups in a map --------------------------------------------- */
/* Every getter looks `key` up in `map` (a MSGPACK_OBJECT_MAP; keys are
 * strings). proto_get_* require the key: missing → bad_request "missing
 * 'key'". proto_opt_* accept a missing key or nil: they return 0, leave *out
 * untouched and set *present (if non-NULL) to false. A wrong type or an
 * out-of-range value is bad_request with a message naming the key. */

/* The value of key, NULL when absent. */
const msgpack_object *proto_map_find(const msgpack_object *map, const char *key);

int proto_get_uint(const msgpack_object *map, const char *key, uint64_t *out,
                   struct kvd_error *err);
int proto_opt_uint(const msgpack_object *map, const char *key, uint64_t *out, bool *present,
                   struct kvd_error *err);
int proto_get_int(const msgpack_object *map, const char *key, int64_t *out, struct kvd_error *err);
int proto_opt_int(const msgpack_object *map, const char *key, int64_t *out, bool *present,
                  struct kvd_error *err);
/* Accepts float32/float64 and integers. */
int proto_get_double(const msgpack_object *map, const char *key, double *out,
                     struct kvd_error *err);
int proto_opt_double(const msgpack_object *map, const char *key, double *out, bool *present,
                     struct kvd_error *err);
int proto_get_bool(const msgpack_object *map, const char *key, bool *out, struct kvd_error *err);
int proto_opt_bool(const msgpack_object *map, const char *key, bool *out, bool *present,
                   struct kvd_error *err);
/* A string as pointer + length into the payload (not NUL-terminated). */
int proto_get_str(const msgpack_object *map, const char *key, const char **s, size_t *len,
                  struct kvd_error *err);
int proto_opt_str(const msgpack_object *map, const char *key, const char **s, size_t *len,
                  bool *present, struct kvd_error *err);
/* A string copied into buf with a NUL; longer than cap-1 bytes or holding a
 * NUL byte → bad_request. */
int proto_get_strz(const msgpack_object *map, const char *key, char *buf, size_t cap,
                   struct kvd_error *err);
int proto_opt_strz(const msgpack_object *map, const char *key, char *buf, size_t cap, bool *present,
                   struct kvd_error *err);
/* Binary data as pointer + length into the payload. */
int proto_get_bin(const msgpack_object *map, const char *key, const void **data, size_t *len,
                  struct kvd_error *err);
int proto_opt_bin(const msgpack_object *map, const char *key, const void **data, size_t *len,
                  bool *present, struct kvd_error *err);
/* An array of uints each <= UINT32_MAX (token ids), at most max entries
 * (more → too_large naming the key). *out is malloc'd (caller frees; NULL
 * when *n == 0); no memory → no_memory. */
int proto_get_u32_array(const msgpack_object *map, const char *key, size_t max, uint32_t **out,
                        size_t *n, struct kvd_error *err);
int proto_opt_u32_array(const msgpack_object *map, const char *key, size_t max, uint32_t **out,
                        size_t *n, bool *present, struct kvd_error *err);
/* A nested map or array (the object itself). */
int proto_get_map(const msgpack_object *map, const char *key, const msgpack_object **out,
                  struct kvd_error *err);
int proto_opt_map(const msgpack_object *map, const char *key, const msgpack_object **out,
                  bool *present, struct kvd_error *err);
int proto_get_array(const msgpack_object *map, const char *key, const msgpack_object **out,
                    struct kvd_error *err);

/* Reading a reply (client side): KVD_OK when root has "ok": true; otherwise
 * the code from "error" with its message copied into err. A reply without a
 * boolean "ok" or with a malformed error map is bad_request. */
int proto_reply_status(const msgpack_object *root, struct kvd_error *err);

/* ---- encoding ----------------------------------------------------------- */
/* A frame is built in a caller-owned msgpack_sbuffer (msgpack_sbuffer_init)
 * with a packer writing to it: proto_packer_init(pk, sb), or msgpack-c's
 * msgpack_packer_init(pk, sb, msgpack_sbuffer_write), or any other packer.
 * With a proto_packer_init packer the functions below encode in place at the
 * end of the sbuffer (no callback and no copy per field); with any other
 * they write through its callback. The bytes are the same either way (the
 * smallest msgpack form, as msgpack-c's packer chooses). msgpack_pack_*
 * calls may be mixed in freely. Several frames may follow each other in one
 * buffer:
 *     size_t at = proto_frame_begin(sb);     // reserves the 4 length bytes
 *     proto_reply_begin(pk, id, 1);          // {"id", "ok": true, + 1 pair}
 *     proto_pack_str(pk, "seq"); msgpack_pack_uint64(pk, h);
 *     proto_frame_end(sb, at);               // patches the length
 * Packing functions return 0 or KVD_ENOMEM (the sbuffer could not grow). */

/* msgpack_sbuffer_write's contract (0, or -1 when sb cannot grow), as a
 * function of its own so that the packers below can recognise it. */
int proto_sbuf_write(void *data, const char *buf, size_t len);
/* A packer appending to sb through proto_sbuf_write. */
void proto_packer_init(msgpack_packer *pk, msgpack_sbuffer *sb);

/* Appends the 4 length bytes; returns the frame's offset in sb, or
 * SIZE_MAX when the buffer cannot grow. */
size_t proto_frame_begin(msgpack_sbuffer *sb);
/* Patches the length of the frame begun at `at`. A payload that is empty or
 * longer than UINT32_MAX is KVD_EINTERNAL / KVD_ETOOLARGE. */
int proto_frame_end(msgpack_sbuffer *sb, size_t at);
/* Grows sb by len bytes and returns where they start (for bin bodies that a
 * caller fills in place: msgpack_pack_bin(pk, len) then proto_sbuf_extend);
 * NULL on no memory. The pointer is valid until the buffer grows again. */
void *proto_sbuf_extend(msgpack_sbuffer *sb, size_t len);

/* A string of n bytes, header and body in one write to the packer. */
int proto_pack_strn(msgpack_packer *pk, const char *s, size_t n);
/* Map / array headers of n pairs / entries (msgpack_pack_map/array's bytes). */
int proto_pack_map(msgpack_packer *pk, size_t n);
int proto_pack_array(msgpack_packer *pk, size_t n);
/* A key of klen bytes followed by a value of the common kinds; a short key
 * and a scalar value go to the packer as one write (replies are mostly
 * such pairs, and each write is a call through the packer's callback). */
int proto_pack_kvn_uint(msgpack_packer *pk, const char *key, size_t klen, uint64_t v);
int proto_pack_kvn_int(msgpack_packer *pk, const char *key, size_t klen, int64_t v);
int proto_pack_kvn_double(msgpack_packer *pk, const char *key, size_t klen, double v);
int proto_pack_kvn_bool(msgpack_packer *pk, const char *key, size_t klen, bool v);
int proto_pack_kvn_str(msgpack_packer *pk, const char *key, size_t klen, const char *v,
                       size_t vlen);
int proto_pack_kvn_nil(msgpack_packer *pk, const char *key, size_t klen);
int proto_pack_kv_bin(msgpack_packer *pk, const char *key, const void *data, size_t len);
int proto_pack_kv_u32_array(msgpack_packer *pk, const char *key, const uint32_t *v, size_t n);

/* NUL-terminated forms. Inline so that strlen of a literal key is folded at
 * compile time, and so that, with a direct packer (proto_packer_init) and
 * room in its buffer, a short key (< 32 bytes) and a small value are
 * encoded right at the call site: fixed-size moves, no call. Anything else
 * goes to the proto_pack_kvn_* functions. Same bytes either way. */

/* Forced: a copy left out of line would pay strlen and a call per pair. */
#define PROTO_INLINE static inline __attribute__((always_inline))

/* Internal: where n bytes can be written at the end of a direct packer's
 * buffer without growing it, else NULL; proto_pk_commit_ counts them. */
PROTO_INLINE uint8_t *proto_pk_room_(msgpack_packer *pk, size_t n)
{
    if (pk->callback != proto_sbuf_write)
        return NULL;
    msgpack_sbuffer *sb = (msgpack_sbuffer *)pk->data;
    if (sb->alloc - sb->size < n)
        return NULL;
    return (uint8_t *)sb->data + sb->size;
}
PROTO_INLINE int proto_pk_commit_(msgpack_packer *pk, size_t n)
{
    ((msgpack_sbuffer *)pk->data)->size += n;
    return 0;
}
/* Internal: a fixstr key (klen < 32) at b; returns its bytes. */
PROTO_INLINE size_t proto_pk_key_(uint8_t *b, const char *key, size_t klen)
{
    b[0] = (uint8_t)(0xa0 | klen);
    memcpy(b + 1, key, klen);
    return klen + 1;
}

PROTO_INLINE int proto_pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    uint8_t *b;
    if (n < 32 && (b = proto_pk_room_(pk, n + 1)) != NULL)
        return proto_pk_commit_(pk, proto_pk_key_(b, s, n));
    return proto_pack_strn(pk, s, n);
}
PROTO_INLINE int proto_pack_kv_uint(msgpack_packer *pk, const char *key, uint64_t v)
{
    size_t klen = strlen(key), n;
    uint8_t *b;
    if (klen < 32 && v < 65536 && (b = proto_pk_room_(pk, klen + 4)) != NULL) {
        n = proto_pk_key_(b, key, klen);
        if (v < 128) {
            b[n++] = (uint8_t)v;
        } else if (v < 256) {
            b[n++] = 0xcc;
            b[n++] = (uint8_t)v;
        } else {
            b[n++] = 0xcd;
            b[n++] = (uint8_t)(v >> 8);
            b[n++] = (uint8_t)v;
        }
        return proto_pk_commit_(pk, n);
    }
    return proto_pack_kvn_uint(pk, key, klen, v);
}
static inline int proto_pack_kv_int(msgpack_packer *pk, const char *key, int64_t v)
{
    return proto_pack_kvn_int(pk, key, strlen(key), v);
}
static inline int proto_pack_kv_double(msgpack_packer *pk, const char *key, double v)
{
    return proto_pack_kvn_double(pk, key, strlen(key), v);
}
/* Internal: a key and a one-byte value (nil 0xc0, false 0xc2, true 0xc3). */
PROTO_INLINE int proto_pk_kv_byte_(msgpack_packer *pk, const char *key, uint8_t v)
{
    size_t klen = strlen(key);
    uint8_t *b;
    if (klen < 32 && (b = proto_pk_room_(pk, klen + 2)) != NULL) {
        size_t n = proto_pk_key_(b, key, klen);
        b[n] = v;
        return proto_pk_commit_(pk, n + 1);
    }
    if (v == 0xc0)
        return proto_pack_kvn_nil(pk, key, klen);
    return proto_pack_kvn_bool(pk, key, klen, v == 0xc3);
}
PROTO_INLINE int proto_pack_kv_bool(msgpack_packer *pk, const char *key, bool v)
{
    return proto_pk_kv_byte_(pk, key, v ? 0xc3 : 0xc2);
}
PROTO_INLINE int proto_pack_kv_str(msgpack_packer *pk, const char *key, const char *v)
{
    size_t klen = strlen(key), vlen = strlen(v);
    uint8_t *b;
    if (klen < 32 && vlen < 32 && (b = proto_pk_room_(pk, klen + vlen + 2)) != NULL) {
        size_t n = proto_pk_key_(b, key, klen);
        return proto_pk_commit_(pk, n + proto_pk_key_(b + n, v, vlen));
    }
    return proto_pack_kvn_str(pk, key, klen, v, vlen);
}
PROTO_INLINE int proto_pack_kv_nil(msgpack_packer *pk, const char *key)
{
    return proto_pk_kv_byte_(pk, key, 0xc0);
}

/* Map header of n_extra + 2 pairs, then "id": id, "ok": true; the caller packs
 * n_extra key/value pairs after it. */
int proto_reply_begin(msgpack_packer *pk, uint64_t id, size_t n_extra);

/* Maps whose size nobody counts by hand (Redis' deferred lengths), for
 * direct packers (proto_packer_init). proto_map_begin reserves a header and
 * returns its offset in the buffer (SIZE_MAX: no memory, or not a direct
 * packer). proto_map_end counts the objects packed since, which must be
 * whole key/value pairs, writes the smallest header for that many pairs
 * (moving the pairs back over the unused header bytes: the bytes are those
 * of a map packed with its count up front) and returns 0; KVD_ENOMEM when
 * the begin failed; KVD_EINTERNAL for an odd number of objects, a packer
 * that is not direct, or malformed contents. A map begun inside another one
 * must end before it. proto_reply_begin_map is proto_reply_begin's
 * deferred form. */
size_t proto_map_begin(msgpack_packer *pk);
int proto_map_end(msgpack_packer *pk, size_t at);
size_t proto_reply_begin_map(msgpack_packer *pk, uint64_t id);
/* The number of whole msgpack objects in p[0..len): 0, or KVD_EINTERNAL
 * when the bytes are not a sequence of whole, well-formed objects. */
int proto_count_objects(const void *p, size_t len, size_t *n);
/* A whole error reply map {"id", "ok": false, "error": {"code", "message"}}. */
int proto_pack_error(msgpack_packer *pk, uint64_t id, int code, const char *message);
/* Map header of n_extra + 2 pairs, then "id": id, "event": name. */
int proto_event_begin(msgpack_packer *pk, uint64_t id, const char *event, size_t n_extra);
/* Map header of n_extra + 2 pairs, then "op": op, "id": id (client side). */
int proto_request_begin(msgpack_packer *pk, const char *op, uint64_t id, size_t n_extra);

/* Whole frames in one call: an error reply / a reply with no result. */
int proto_frame_error(msgpack_sbuffer *sb, uint64_t id, int code, const char *message);
int proto_frame_ok(msgpack_sbuffer *sb, uint64_t id);

/* ---- misc --------------------------------------------------------------- */

/* The non-root fallback socket path: $XDG_RUNTIME_DIR/kvd.sock when that
 * variable is set and absolute, else /tmp/kvd-<uid>/kvd.sock. Returns 0 or
 * KVD_ETOOLARGE when it does not fit in cap. */
int proto_socket_fallback(char *buf, size_t cap);
/* Whether a socket at `path` can be trusted by `uid` (another user may
 * have pre-created /tmp/kvd-<uid> and put a socket of their own there).
 * Every directory from path's parent to "/" must be owned by root or uid
 * and not writable by group or others unless sticky (like /tmp); with
 * `own_dir` (a per-user path such as the fallback), the parent must be
 * owned by uid and writable by nobody else, and the socket, if it exists,
 * must be owned by uid or root. Returns 0, or KVD_EPERM with the reason
 * in err (KVD_ENOTFOUND when a directory does not exist). */
int proto_socket_path_check(const char *path, uid_t uid, bool own_dir, char *err, size_t errlen);

/* The protocol's name of a tier ("device"/"host") and back (-1 if unknown). */
const char *proto_tier_name(int tier);
int proto_tier_from_name(const char *s, size_t len);

/* Early returns for functions that pack a reply: PROTO_PK passes on a
 * proto_pack_* status; PROTO_MP turns a msgpack-c failure (out of memory)
 * into KVD_ENOMEM. */
#define PROTO_PK(x)                                                                                \
    do {                                                                                           \
        int proto_rc_ = (x);                                                                       \
        if (proto_rc_)                                                                             \
            return proto_rc_;                                                                      \
    } while (0)
#define PROTO_MP(x)                                                                                \
    do {                                                                                           \
        if ((x) != 0)                                                                              \
            return KVD_ENOMEM;                                                                     \
    } while (0)

#endif

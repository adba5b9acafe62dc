/* libkvd values: turns one reply frame (a msgpack map) into the read-only
 * kvd_value tree of the public API, reads typed fields out of it, and
 * prints any value as one line of JSON (kvctl stats --json). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libkvd_int.h"

/* Nesting deeper than this in a reply is refused rather than recursed into:
 * the daemon sends at most a few levels. */
#define VALUE_MAX_DEPTH 32

static int value_from_object(msgpack_zone *z, const msgpack_object *o, struct kvd_value *v,
                             int depth)
{
    if (depth > VALUE_MAX_DEPTH)
        return KVD_EBADREQ;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        v->type = KVD_T_NIL;
        return 0;
    case MSGPACK_OBJECT_BOOLEAN:
        v->type = KVD_T_BOOL;
        v->v.b = o->via.boolean;
        return 0;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        v->type = KVD_T_UINT;
        v->v.u = o->via.u64;
        return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        v->type = KVD_T_INT;
        v->v.i = o->via.i64;
        return 0;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        v->type = KVD_T_FLOAT;
        v->v.f = o->via.f64;
        return 0;
    case MSGPACK_OBJECT_STR:
        /* Points into the frame, NUL-terminated there by terminate_strings. */
        v->type = KVD_T_STR;
        v->v.str.ptr = o->via.str.ptr;
        v->v.str.len = o->via.str.size;
        return 0;
    case MSGPACK_OBJECT_BIN:
        /* Points into the frame, which the reply owns. */
        v->type = KVD_T_BIN;
        v->v.bin.ptr = o->via.bin.ptr;
        v->v.bin.len = o->via.bin.size;
        return 0;
    case MSGPACK_OBJECT_ARRAY: {
        size_t n = o->via.array.size;
        struct kvd_value *items = NULL;
        if (n) {
            items = msgpack_zone_malloc(z, n * sizeof(*items));
            if (!items)
                return KVD_ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
            int rc = value_from_object(z, &o->via.array.ptr[i], &items[i], depth + 1);
            if (rc)
                return rc;
        }
        v->type = KVD_T_ARRAY;
        v->v.array.items = items;
        v->v.array.n = n;
        return 0;
    }
    case MSGPACK_OBJECT_MAP: {
        size_t n = o->via.map.size;
        struct kvd_pair *items = NULL;
        if (n) {
            items = msgpack_zone_malloc(z, n * sizeof(*items));
            if (!items)
                return KVD_ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
            int rc = value_from_object(z, &o->via.map.ptr[i].key, &items[i].key, depth + 1);
            if (!rc)
                rc = value_from_object(z, &o->via.map.ptr[i].val, &items[i].val, depth + 1);
            if (rc)
                return rc;
        }
        v->type = KVD_T_MAP;
        v->v.map.items = items;
        v->v.map.n = n;
        return 0;
    }
    default: /* ext: kvd never sends it; shown as nil */
        v->type = KVD_T_NIL;
        return 0;
    }
}

/* A copy of s in the zone (NULL for NULL or no memory). */
static const char *kvd_zone_strdup(msgpack_zone *z, const char *s)
{
    size_t n;
    char *d;
    if (!s)
        return NULL;
    n = strlen(s) + 1;
    d = msgpack_zone_malloc_no_align(z, n);
    if (d)
        memcpy(d, s, n);
    return d;
}

/* Writes a NUL after every string of a parsed frame, in the frame itself,
 * so kvd_value strings need no copy. Safe once parsing is done: the byte
 * after a string's bytes is the next object's type byte (already decoded
 * into msgpack_objects) or the spare byte past the frame's end. */
static void terminate_strings(const msgpack_object *o, int depth)
{
    if (depth > VALUE_MAX_DEPTH)
        return;
    switch (o->type) {
    case MSGPACK_OBJECT_STR:
        ((char *)o->via.str.ptr)[o->via.str.size] = '\0';
        break;
    case MSGPACK_OBJECT_ARRAY:
        for (uint32_t i = 0; i < o->via.array.size; i++)
            terminate_strings(&o->via.array.ptr[i], depth + 1);
        break;
    case MSGPACK_OBJECT_MAP:
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            terminate_strings(&o->via.map.ptr[i].key, depth + 1);
            terminate_strings(&o->via.map.ptr[i].val, depth + 1);
        }
        break;
    default:
        break;
    }
}

int kvd_reply_decode(const char *src, size_t len, struct kvd_reply_impl **out, char *errbuf,
                     size_t errlen)
{
    int rc;
    struct proto_err perr = {0};
    struct kvd_value *root;
    msgpack_zone *z;
    /* One allocation: the reply, then the frame and a spare byte for the
     * NUL of a string that ends the frame. */
    struct kvd_reply_impl *r = malloc(sizeof(*r) + len + 1);

    *out = NULL;
    if (!r) {
        snprintf(errbuf, errlen, "out of memory decoding a reply of %zu bytes", len);
        return KVD_ENOMEM;
    }
    memset(r, 0, sizeof(*r));
    r->frame = (char *)(r + 1);
    r->frame_len = len;
    memcpy(r->frame, src, len);
    r->frame[len] = '\0';
    /* The codec checks structure and limits before msgpack-c allocates. */
    rc = proto_msg_parse(&r->msg, r->frame, len, &perr);
    if (rc) {
        snprintf(errbuf, errlen, "daemon sent a frame libkvd cannot read: %s", perr.message);
        goto out_free;
    }
    r->parsed = true;
    /* The value tree shares the parse's zone: freed together. */
    z = r->msg.up.zone;
    terminate_strings(r->msg.root, 0);
    root = msgpack_zone_malloc(z, sizeof(*root));
    if (!root) {
        rc = KVD_ENOMEM;
        snprintf(errbuf, errlen, "out of memory decoding a reply");
        goto out_free;
    }
    rc = value_from_object(z, r->msg.root, root, 0);
    if (rc) {
        snprintf(errbuf, errlen,
                 rc == KVD_ENOMEM ? "out of memory decoding a reply"
                                  : "daemon sent a reply nested too deeply");
        goto out_free;
    }
    r->pub.body = root;
    if (kvd_value_u64(kvd_value_get(root, "id"), &r->pub.id)) {
        snprintf(errbuf, errlen, "daemon sent a frame without an integer \"id\"");
        rc = KVD_EBADREQ;
        goto out_free;
    }
    if (kvd_value_get(root, "event") && !kvd_value_get(root, "ok")) {
        r->is_event = true;
    } else {
        const struct kvd_value *ok = kvd_value_get(root, "ok");
        if (ok && ok->type == KVD_T_BOOL && ok->v.b) {
            *out = r; /* the common case: no error to look at */
            return 0;
        }
        rc = proto_reply_status(r->msg.root, &perr);
        if (rc == KVD_EBADREQ && !kvd_value_get(root, "error")) {
            snprintf(errbuf, errlen, "daemon sent a malformed reply: %s", perr.message);
            goto out_free;
        }
        if (rc) {
            const struct kvd_value *e = kvd_value_get(root, "error");
            r->pub.err = rc;
            r->pub.code = kvd_value_str(kvd_value_get(e, "code"));
            r->pub.message = kvd_value_str(kvd_value_get(e, "message"));
            if (!r->pub.code)
                r->pub.code = kvd_err_code(rc);
            if (!r->pub.message)
                r->pub.message = kvd_zone_strdup(z, perr.message);
            if (!r->pub.message)
                r->pub.message = "(no message)";
            rc = 0;
        }
    }
    *out = r;
    return 0;

out_free:
    kvd_reply_free(&r->pub);
    return rc;
}

void kvd_reply_free(struct kvd_reply *pub)
{
    struct kvd_reply_impl *r = (struct kvd_reply_impl *)pub;
    if (!r)
        return;
    if (r->parsed)
        proto_msg_free(&r->msg);
    free(r);
}

void kvd_free(void *p)
{
    free(p);
}

/* ---- lookups ------------------------------------------------------------- */

const struct kvd_value *kvd_value_get(const struct kvd_value *v, const char *key)
{
    size_t klen;
    if (!v || v->type != KVD_T_MAP || !key)
        return NULL;
    klen = strlen(key);
    for (size_t i = 0; i < v->v.map.n; i++) {
        const struct kvd_value *k = &v->v.map.items[i].key;
        if (k->type == KVD_T_STR && k->v.str.len == klen && memcmp(k->v.str.ptr, key, klen) == 0)
            return &v->v.map.items[i].val;
    }
    return NULL;
}

const struct kvd_value *kvd_value_path(const struct kvd_value *v, const char *path)
{
    char key[128];
    while (v && path && *path) {
        const char *dot = strchr(path, '.');
        size_t n = dot ? (size_t)(dot - path) : strlen(path);
        if (n >= sizeof(key))
            return NULL;
        memcpy(key, path, n);
        key[n] = '\0';
        v = kvd_value_get(v, key);
        path = dot ? dot + 1 : NULL;
    }
    return v;
}

int kvd_value_u64(const struct kvd_value *v, uint64_t *out)
{
    if (!v)
        return KVD_ENOTFOUND;
    if (v->type == KVD_T_UINT) {
        *out = v->v.u;
        return 0;
    }
    if (v->type == KVD_T_INT && v->v.i >= 0) {
        *out = (uint64_t)v->v.i;
        return 0;
    }
    return KVD_EBADREQ;
}

int kvd_value_i64(const struct kvd_value *v, int64_t *out)
{
    if (!v)
        return KVD_ENOTFOUND;
    if (v->type == KVD_T_INT) {
        *out = v->v.i;
        return 0;
    }
    if (v->type == KVD_T_UINT && v->v.u <= INT64_MAX) {
        *out = (int64_t)v->v.u;
        return 0;
    }
    return KVD_EBADREQ;
}

int kvd_value_f64(const struct kvd_value *v, double *out)
{
    if (!v)
        return KVD_ENOTFOUND;
    switch (v->type) {
    case KVD_T_FLOAT:
        *out = v->v.f;
        return 0;
    case KVD_T_UINT:
        *out = (double)v->v.u;
        return 0;
    case KVD_T_INT:
        *out = (double)v->v.i;
        return 0;
    default:
        return KVD_EBADREQ;
    }
}

const char *kvd_value_str(const struct kvd_value *v)
{
    return v && v->type == KVD_T_STR ? v->v.str.ptr : NULL;
}

/* ---- JSON ---------------------------------------------------------------- */

struct jbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void jb_put(struct jbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void jb_puts(struct jbuf *b, const char *s)
{
    jb_put(b, s, strlen(s));
}

static void jb_string(struct jbuf *b, const char *s, size_t n)
{
    char esc[8];
    jb_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            jb_put(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof(esc), "\\u%04x", c);
            jb_put(b, esc, 6);
        } else {
            jb_put(b, (const char *)&c, 1);
        }
    }
    jb_put(b, "\"", 1);
}

static void jb_value(struct jbuf *b, const struct kvd_value *v)
{
    char num[64];
    switch (v->type) {
    case KVD_T_NIL:
        jb_puts(b, "null");
        break;
    case KVD_T_BOOL:
        jb_puts(b, v->v.b ? "true" : "false");
        break;
    case KVD_T_INT:
        snprintf(num, sizeof(num), "%" PRId64, v->v.i);
        jb_puts(b, num);
        break;
    case KVD_T_UINT:
        snprintf(num, sizeof(num), "%" PRIu64, v->v.u);
        jb_puts(b, num);
        break;
    case KVD_T_FLOAT:
        if (isfinite(v->v.f)) {
            /* The shortest of %.15g/%.17g that reads back as the same double. */
            snprintf(num, sizeof(num), "%.15g", v->v.f);
            if (strtod(num, NULL) != v->v.f)
                snprintf(num, sizeof(num), "%.17g", v->v.f);
        } else
            snprintf(num, sizeof(num), "null"); /* JSON has no inf/nan */
        jb_puts(b, num);
        break;
    case KVD_T_STR:
        jb_string(b, v->v.str.ptr, v->v.str.len);
        break;
    case KVD_T_BIN: {
        static const char hex[] = "0123456789abcdef";
        const unsigned char *p = v->v.bin.ptr;
        jb_put(b, "\"", 1);
        for (size_t i = 0; i < v->v.bin.len; i++) {
            char h[2] = {hex[p[i] >> 4], hex[p[i] & 15]};
            jb_put(b, h, 2);
        }
        jb_put(b, "\"", 1);
        break;
    }
    case KVD_T_ARRAY:
        jb_put(b, "[", 1);
        for (size_t i = 0; i < v->v.array.n; i++) {
            if (i)
                jb_put(b, ",", 1);
            jb_value(b, &v->v.array.items[i]);
        }
        jb_put(b, "]", 1);
        break;
    case KVD_T_MAP:
        jb_put(b, "{", 1);
        for (size_t i = 0; i < v->v.map.n; i++) {
            const struct kvd_value *k = &v->v.map.items[i].key;
            if (i)
                jb_put(b, ",", 1);
            if (k->type == KVD_T_STR) {
                jb_string(b, k->v.str.ptr, k->v.str.len);
            } else {
                /* JSON keys are strings: print the key as JSON, quoted. */
                struct jbuf kb = {0};
                jb_value(&kb, k);
                jb_string(b, kb.p ? kb.p : "", kb.len);
                b->oom |= kb.oom;
                free(kb.p);
            }
            jb_put(b, ":", 1);
            jb_value(b, &v->v.map.items[i].val);
        }
        jb_put(b, "}", 1);
        break;
    }
}

char *kvd_value_json(const struct kvd_value *v)
{
    struct jbuf b = {0};
    if (!v)
        jb_puts(&b, "null");
    else
        jb_value(&b, v);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

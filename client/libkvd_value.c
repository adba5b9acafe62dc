/* libkvd values: turns one reply frame (a msgpack map) into the read-only
 * kvd_value tree of the public API, reads typed fields out of it, and
 * prints any value as one line of JSON (kvctl stats --json). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "libkvd_int.h"

/* Nesting deeper than this in a reply is refused rather than recursed into:
 * the daemon sends at most a few levels. */
#define VALUE_MAX_DEPTH 32

/* The reply decoder. proto_msg_check has already walked the frame (every
 * count fits the bytes left, depth and object limits), so the tree needs
 * exactly n_objects value slots; the bounds are checked again here anyway,
 * since that is cheap. Values are read from src; strings and bins point into
 * dst, the reply's own copy of the frame, where a NUL is written after each
 * string (in the copy, so the byte after a string, the next object's type,
 * is still read intact from src). */
struct dec {
    const uint8_t *src;
    char *dst;
    size_t len, pos;
    struct kvd_value *slot, *slot_end; /* next free value slot, end of slots */
};

_Static_assert(sizeof(struct kvd_pair) == 2 * sizeof(struct kvd_value),
               "a map's pairs take two value slots each");

/* The next k bytes as a big-endian number (k <= 8), or false if short. */
static bool dec_be(struct dec *d, unsigned k, uint64_t *out)
{
    uint64_t v = 0;
    if (d->len - d->pos < k)
        return false;
    for (unsigned i = 0; i < k; i++)
        v = v << 8 | d->src[d->pos + i];
    d->pos += k;
    *out = v;
    return true;
}

static struct kvd_value *dec_slots(struct dec *d, size_t n)
{
    struct kvd_value *s = d->slot;
    if ((size_t)(d->slot_end - d->slot) < n)
        return NULL;
    d->slot += n;
    return s;
}

static int dec_value(struct dec *d, struct kvd_value *v, int depth)
{
    uint64_t n = 0, x;
    uint8_t b;
    int kind; /* 1 str, 2 bin, 3 array, 4 map, 5 ext (n payload bytes + a type byte) */

    if (depth > VALUE_MAX_DEPTH || d->pos >= d->len)
        return KVD_EBADREQ;
    b = d->src[d->pos++];
    if (b <= 0x7f) {
        v->type = KVD_T_UINT;
        v->v.u = b;
        return 0;
    }
    if (b >= 0xe0) {
        v->type = KVD_T_INT;
        v->v.i = (int8_t)b;
        return 0;
    }
    if (b <= 0x8f) {
        n = b & 0x0f;
        kind = 4;
    } else if (b <= 0x9f) {
        n = b & 0x0f;
        kind = 3;
    } else if (b <= 0xbf) {
        n = b & 0x1f;
        kind = 1;
    } else {
        switch (b) {
        case 0xc0:
            v->type = KVD_T_NIL;
            return 0;
        case 0xc2:
        case 0xc3:
            v->type = KVD_T_BOOL;
            v->v.b = b == 0xc3;
            return 0;
        case 0xca: {
            uint32_t bits;
            float f;
            if (!dec_be(d, 4, &x))
                return KVD_EBADREQ;
            bits = (uint32_t)x;
            memcpy(&f, &bits, sizeof(f));
            v->type = KVD_T_FLOAT;
            v->v.f = f;
            return 0;
        }
        case 0xcb:
            if (!dec_be(d, 8, &x))
                return KVD_EBADREQ;
            v->type = KVD_T_FLOAT;
            memcpy(&v->v.f, &x, sizeof(v->v.f));
            return 0;
        case 0xcc:
        case 0xcd:
        case 0xce:
        case 0xcf:
            if (!dec_be(d, 1u << (b - 0xcc), &x))
                return KVD_EBADREQ;
            v->type = KVD_T_UINT;
            v->v.u = x;
            return 0;
        case 0xd0:
        case 0xd1:
        case 0xd2:
        case 0xd3: {
            unsigned k = 1u << (b - 0xd0);
            int64_t i;
            if (!dec_be(d, k, &x))
                return KVD_EBADREQ;
            /* sign-extend from k bytes */
            i = k == 8 ? (int64_t)x : (int64_t)(x ^ (1ull << (8 * k - 1))) - (1ll << (8 * k - 1));
            /* Like msgpack-c: a signed encoding of a value >= 0 is a uint. */
            if (i >= 0) {
                v->type = KVD_T_UINT;
                v->v.u = (uint64_t)i;
            } else {
                v->type = KVD_T_INT;
                v->v.i = i;
            }
            return 0;
        }
        case 0xd4:
        case 0xd5:
        case 0xd6:
        case 0xd7:
        case 0xd8:
            n = 1u << (b - 0xd4);
            kind = 5;
            break;
        case 0xc4:
        case 0xc5:
        case 0xc6:
            if (!dec_be(d, 1u << (b - 0xc4), &n))
                return KVD_EBADREQ;
            kind = 2;
            break;
        case 0xc7:
        case 0xc8:
        case 0xc9:
            if (!dec_be(d, 1u << (b - 0xc7), &n))
                return KVD_EBADREQ;
            kind = 5;
            break;
        case 0xd9:
        case 0xda:
        case 0xdb:
            if (!dec_be(d, 1u << (b - 0xd9), &n))
                return KVD_EBADREQ;
            kind = 1;
            break;
        case 0xdc:
        case 0xdd:
            if (!dec_be(d, 2u << (b - 0xdc), &n))
                return KVD_EBADREQ;
            kind = 3;
            break;
        case 0xde:
        case 0xdf:
            if (!dec_be(d, 2u << (b - 0xde), &n))
                return KVD_EBADREQ;
            kind = 4;
            break;
        default: /* 0xc1: never used */
            return KVD_EBADREQ;
        }
    }
    switch (kind) {
    case 1:
    case 2:
        if (d->len - d->pos < n)
            return KVD_EBADREQ;
        if (kind == 1) {
            v->type = KVD_T_STR;
            v->v.str.ptr = d->dst + d->pos;
            v->v.str.len = n;
            d->dst[d->pos + n] = '\0'; /* dst holds len + 1 bytes */
        } else {
            v->type = KVD_T_BIN;
            v->v.bin.ptr = d->dst + d->pos;
            v->v.bin.len = n;
        }
        d->pos += n;
        return 0;
    case 5: /* ext: kvd never sends it; shown as nil */
        if (d->len - d->pos < n + 1)
            return KVD_EBADREQ;
        d->pos += n + 1;
        v->type = KVD_T_NIL;
        return 0;
    case 3: {
        struct kvd_value *items = n ? dec_slots(d, n) : NULL;
        if (n && !items)
            return KVD_EBADREQ;
        for (size_t i = 0; i < n; i++) {
            int rc = dec_value(d, &items[i], depth + 1);
            if (rc)
                return rc;
        }
        v->type = KVD_T_ARRAY;
        v->v.array.items = items;
        v->v.array.n = n;
        return 0;
    }
    default: { /* map */
        struct kvd_pair *items = NULL;
        if (n) {
            if (n > SIZE_MAX / 2 || !(items = (struct kvd_pair *)dec_slots(d, 2 * n)))
                return KVD_EBADREQ;
        }
        for (size_t i = 0; i < n; i++) {
            int rc = dec_value(d, &items[i].key, depth + 1);
            if (!rc)
                rc = dec_value(d, &items[i].val, depth + 1);
            if (rc)
                return rc;
        }
        v->type = KVD_T_MAP;
        v->v.map.items = items;
        v->v.map.n = n;
        return 0;
    }
    }
}

/* The status of a reply map, as proto_reply_status reads it: 0 for "ok":
 * true, else the code of "error" (*why: a static reason when the reply is
 * malformed, for the message). */
static int reply_status(const struct kvd_value *root, const char **why)
{
    const struct kvd_value *ok = kvd_value_get(root, "ok"), *e, *code, *msg;
    char cbuf[32];
    int c;

    *why = NULL;
    if (!ok || ok->type == KVD_T_NIL) {
        *why = "missing 'ok'";
        return KVD_EBADREQ;
    }
    if (ok->type != KVD_T_BOOL) {
        *why = "'ok' must be a boolean";
        return KVD_EBADREQ;
    }
    if (ok->v.b)
        return 0;
    e = kvd_value_get(root, "error");
    code = kvd_value_get(e, "code");
    msg = kvd_value_get(e, "message");
    if (!e || e->type != KVD_T_MAP || !code || code->type != KVD_T_STR || !msg ||
        msg->type != KVD_T_STR) {
        *why = "malformed error reply";
        return KVD_EBADREQ;
    }
    snprintf(cbuf, sizeof(cbuf), "%.*s", (int)(code->v.str.len < 31 ? code->v.str.len : 31),
             code->v.str.ptr);
    c = kvd_err_from_code(cbuf);
    return c == KVD_OK ? KVD_EINTERNAL : c;
}

int kvd_reply_decode(const char *src, size_t len, struct kvd_reply_impl **out, char *errbuf,
                     size_t errlen)
{
    int rc;
    struct kvd_error perr = {0};
    size_t n_obj = 0;
    struct kvd_reply_impl *r;
    struct kvd_value *root;
    const char *why;

    *out = NULL;
    /* The codec checks structure and limits before anything is allocated. */
    rc = proto_msg_check(src, len, &n_obj, &perr);
    if (rc) {
        snprintf(errbuf, errlen, "daemon sent a frame libkvd cannot read: %s", perr.message);
        return rc;
    }
    /* One allocation: the reply, one value slot per msgpack object, then the
     * frame and a spare byte for the NUL of a string that ends it. */
    r = malloc(sizeof(*r) + n_obj * sizeof(struct kvd_value) + len + 1);
    if (!r) {
        snprintf(errbuf, errlen, "out of memory decoding a reply of %zu bytes", len);
        return KVD_ENOMEM;
    }
    memset(r, 0, sizeof(*r));
    root = (struct kvd_value *)(r + 1);
    r->frame = (char *)(root + n_obj);
    r->frame_len = len;
    r->fds = NULL;
    r->n_fds = 0;
    memcpy(r->frame, src, len);
    r->frame[len] = '\0';
    struct dec d = {(const uint8_t *)src, r->frame, len, 0, root + 1, root + n_obj};
    rc = dec_value(&d, root, 0);
    if (rc || d.pos != len || root->type != KVD_T_MAP) {
        snprintf(errbuf, errlen, "daemon sent a frame libkvd cannot read: %s",
                 rc ? "malformed msgpack message" : "not one msgpack map");
        rc = KVD_EBADREQ;
        goto out_free;
    }
    for (size_t i = 0; i < root->v.map.n; i++) {
        if (root->v.map.items[i].key.type != KVD_T_STR) {
            snprintf(errbuf, errlen,
                     "daemon sent a frame libkvd cannot read: message key #%zu is not a string", i);
            rc = KVD_EBADREQ;
            goto out_free;
        }
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
        rc = reply_status(root, &why);
        if (rc == KVD_EBADREQ && !kvd_value_get(root, "error")) {
            snprintf(errbuf, errlen, "daemon sent a malformed reply: %s", why);
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
                r->pub.message = why ? why : "(no message)";
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
    if (r) {
        for (size_t i = 0; i < r->n_fds; i++)
            if (r->fds[i] >= 0)
                close(r->fds[i]);
        free(r->fds);
    }
    free(pub); /* one allocation (kvd_reply_decode) */
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

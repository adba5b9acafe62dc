/* Jinja values: the arena every parse and render allocates from, errors,
 * lists and maps, and the conversions whose exact output the reference
 * renderer defines (JavaScript number formatting, String(), JSON, loose
 * equality), over UTF-8 strings with JavaScript's string semantics. */
#include "jinja.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvd/status.h"

struct jchunk {
    struct jchunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void jfail(struct jctx *c, int code, int line, const char *fmt, ...)
{
    c->code = code;
    if (c->err && c->errlen) {
        int k = 0;
        if (line > 0)
            k = snprintf(c->err, c->errlen, "chat template line %d: ", line);
        else
            k = snprintf(c->err, c->errlen, "chat template: ");
        if (k < 0 || (size_t)k >= c->errlen)
            k = (int)c->errlen - 1;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err + k, c->errlen - (size_t)k, fmt, ap);
        va_end(ap);
    }
    longjmp(c->jb, 1);
}

void *jalloc(struct jctx *c, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    struct jchunk *h = c->chunks;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > (64u << 10) ? n : (64u << 10);
        if (c->mem + cap > JINJA_MAX_MEM || cap < n) {
            c->code = KVD_ETOOLARGE;
            jfail(c, KVD_ETOOLARGE, 0, "the template needs more than %u MiB of memory",
                  JINJA_MAX_MEM >> 20);
        }
        struct jchunk *k = malloc(sizeof(*k) + cap);
        if (!k)
            jfail(c, KVD_ENOMEM, 0, "out of memory");
        k->cap = cap;
        k->used = 0;
        c->mem += cap;
        if (h && cap == n) {
            /* a big block: keep the current chunk for small ones */
            k->next = h->next;
            h->next = k;
            k->used = n;
            return k->data;
        }
        k->next = h;
        c->chunks = h = k;
    }
    void *p = h->data + h->used;
    h->used += n;
    return p;
}

char *jstrdup(struct jctx *c, const char *s, size_t n)
{
    char *p = jalloc(c, n + 1);
    if (n)
        memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void jctx_free(struct jctx *c)
{
    struct jchunk *h = c->chunks;
    while (h) {
        struct jchunk *next = h->next;
        free(h);
        h = next;
    }
    c->chunks = NULL;
    c->mem = 0;
}

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t jdeadline_from_now(void)
{
    return thread_cpu_ns() + (uint64_t)JINJA_MAX_MS * 1000000ull;
}

void jdeadline(struct jrt *rt, int line)
{
    if (rt->deadline_ns && thread_cpu_ns() > rt->deadline_ns)
        jfail(rt->c, KVD_ETOOLARGE, line, "rendering takes more than %u ms of CPU time",
              JINJA_MAX_MS);
}

void jwork(struct jrt *rt, int line, size_t n)
{
    rt->work += n;
    if (rt->work > JINJA_MAX_WORK)
        jfail(rt->c, KVD_ETOOLARGE, line,
              "the template's string operations pass %llu MiB of work (its budget)",
              (unsigned long long)(JINJA_MAX_WORK >> 20));
    if (rt->work - rt->work_checked >= (1u << 20)) {
        rt->work_checked = rt->work;
        jdeadline(rt, line);
    }
}

void jbuf_put(struct jrt *rt, struct jbuf *b, const char *s, size_t n)
{
    if (n == 0)
        return;
    jwork(rt, 0, n);
    rt->out_total += n;
    if (rt->out_total > (size_t)JINJA_MAX_OUT * 4 || b->n + n > JINJA_MAX_OUT)
        jfail(rt->c, KVD_ETOOLARGE, 0, "the rendered text passes %u MiB", JINJA_MAX_OUT >> 20);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = jalloc(rt->c, cap);
        if (b->n)
            memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void jbuf_puts(struct jrt *rt, struct jbuf *b, const char *s)
{
    jbuf_put(rt, b, s, strlen(s));
}

/* ---- lists and maps ---- */

struct jlist *jlist_new(struct jctx *c, size_t cap)
{
    struct jlist *l = jalloc(c, sizeof(*l));
    l->n = 0;
    l->cap = cap;
    l->v = cap ? jalloc(c, cap * sizeof(struct jval)) : NULL;
    return l;
}

void jlist_push(struct jctx *c, struct jlist *l, struct jval v)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        struct jval *nv = jalloc(c, cap * sizeof(*nv));
        if (l->n)
            memcpy(nv, l->v, l->n * sizeof(*nv));
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = v;
}

struct jmap *jmap_new(struct jctx *c)
{
    struct jmap *m = jalloc(c, sizeof(*m));
    memset(m, 0, sizeof(*m));
    return m;
}

struct jval *jmap_get(const struct jmap *m, const char *k, size_t kn)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->kn[i] == kn && memcmp(m->kp[i], k, kn) == 0)
            return &m->v[i];
    return NULL;
}

void jmap_set(struct jctx *c, struct jmap *m, const char *k, size_t kn, struct jval v)
{
    struct jval *old = jmap_get(m, k, kn);
    if (old) {
        *old = v;
        return;
    }
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 8;
        const char **kp = jalloc(c, cap * sizeof(*kp));
        size_t *knn = jalloc(c, cap * sizeof(*knn));
        struct jval *nv = jalloc(c, cap * sizeof(*nv));
        if (m->n) {
            memcpy(kp, m->kp, m->n * sizeof(*kp));
            memcpy(knn, m->kn, m->n * sizeof(*knn));
            memcpy(nv, m->v, m->n * sizeof(*nv));
        }
        m->kp = kp;
        m->kn = knn;
        m->v = nv;
        m->cap = cap;
    }
    m->kp[m->n] = k;
    m->kn[m->n] = kn;
    m->v[m->n] = v;
    m->n++;
}

struct jval jv_array(struct jlist *l)
{
    struct jval v = {.t = JV_ARRAY, .u.arr = l};
    return v;
}

struct jval jv_object(struct jmap *m, enum jt t)
{
    struct jval v = {.t = t, .u.map = m};
    return v;
}

const char *jtype_name(enum jt t)
{
    static const char *const names[] = {"UndefinedValue", "NullValue",     "BooleanValue",
                                        "IntegerValue",   "FloatValue",    "StringValue",
                                        "ArrayValue",     "TupleValue",    "ObjectValue",
                                        "NamespaceValue", "FunctionValue", "KeywordArgumentsValue"};
    return (unsigned)t < sizeof(names) / sizeof(names[0]) ? names[t] : "?";
}

bool jv_truthy(struct jval v)
{
    switch (v.t) {
    case JV_UNDEF:
    case JV_NULL:
        return false;
    case JV_BOOL:
        return v.u.b;
    case JV_INT:
    case JV_FLOAT:
        return v.u.num != 0 && !isnan(v.u.num);
    case JV_STR:
        return v.u.s.n > 0;
    case JV_ARRAY:
    case JV_TUPLE:
        return v.u.arr->n > 0;
    case JV_OBJECT:
    case JV_KWARGS:
        return v.u.map->n > 0;
    case JV_NS:
    case JV_FUNC:
        return true;
    }
    return false;
}

/* ---- unicode ---- */

uint32_t u8_next(const char *s, size_t n, size_t *i)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t k = *i;
    unsigned char b = p[k];
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 1 || len == 0 || k + (size_t)len > n) {
        *i = k + 1;
        return b;
    }
    uint32_t cp = b & (0x7F >> len);
    for (int j = 1; j < len; j++) {
        if ((p[k + j] & 0xC0) != 0x80) {
            *i = k + 1;
            return b;
        }
        cp = (cp << 6) | (p[k + j] & 0x3F);
    }
    *i = k + (size_t)len;
    return cp;
}

bool js_is_space(uint32_t c)
{
    if (c <= 32)
        return c == 32 || (c >= 9 && c <= 13);
    return c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF;
}

size_t js_utf16_len(const char *s, size_t n)
{
    size_t i = 0, len = 0;
    while (i < n) {
        uint32_t cp = u8_next(s, n, &i);
        len += cp >= 0x10000 ? 2 : 1;
    }
    return len;
}

void js_trim(const char *s, size_t n, bool left, bool right, size_t *b, size_t *e)
{
    size_t start = 0, end = n;
    if (left)
        while (start < n) {
            size_t j = start;
            if (!js_is_space(u8_next(s, n, &j)))
                break;
            start = j;
        }
    if (right) {
        size_t i = start, last = start;
        while (i < n) {
            size_t j = i;
            if (!js_is_space(u8_next(s, n, &j)))
                last = j;
            i = j;
        }
        end = last;
    }
    *b = start;
    *e = end < start ? start : end;
}

/* ---- numbers ---- */

void js_num_str(double x, char *buf, size_t len)
{
    if (isnan(x)) {
        snprintf(buf, len, "NaN");
        return;
    }
    if (isinf(x)) {
        snprintf(buf, len, x < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (x == 0) {
        snprintf(buf, len, "0");
        return;
    }
    /* shortest digits that read back as x */
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, x);
        if (strtod(tmp, NULL) == x)
            break;
    }
    bool neg = tmp[0] == '-';
    const char *m = tmp + neg;
    char digits[24];
    int k = 0;
    for (const char *q = m; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9')
            digits[k++] = *q;
    while (k > 1 && digits[k - 1] == '0')
        k--;
    digits[k] = 0;
    int e = atoi(strchr(m, 'e') + 1);
    int nexp = e + 1; /* value = 0.d1d2... x 10^nexp */
    char out[64];
    int o = 0;
    if (neg)
        out[o++] = '-';
    if (k <= nexp && nexp <= 21) {
        memcpy(out + o, digits, (size_t)k);
        o += k;
        for (int i = 0; i < nexp - k; i++)
            out[o++] = '0';
    } else if (0 < nexp && nexp <= 21) {
        memcpy(out + o, digits, (size_t)nexp);
        o += nexp;
        out[o++] = '.';
        memcpy(out + o, digits + nexp, (size_t)(k - nexp));
        o += k - nexp;
    } else if (-6 < nexp && nexp <= 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = 0; i < -nexp; i++)
            out[o++] = '0';
        memcpy(out + o, digits, (size_t)k);
        o += k;
    } else {
        out[o++] = digits[0];
        if (k > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, (size_t)(k - 1));
            o += k - 1;
        }
        o += snprintf(out + o, sizeof(out) - (size_t)o, "e%c%d", nexp - 1 < 0 ? '-' : '+',
                      abs(nexp - 1));
    }
    out[o] = 0;
    snprintf(buf, len, "%s", out);
}

/* FloatValue#toString: -0.0, integral values with one decimal. */
static void float_str(double x, char *buf, size_t len)
{
    if (x == 0 && signbit(x))
        snprintf(buf, len, "-0.0");
    else if (isfinite(x) && x == trunc(x) && fabs(x) < 1e21)
        snprintf(buf, len, "%.1f", x);
    else
        js_num_str(x, buf, len);
}

/* ---- strings of values ---- */

static _Noreturn void no_string(struct jrt *rt, int line, struct jval v, const char *what)
{
    jfail(rt->c, KVD_EUNSUPPORTED, line, "%s of a %s is not supported", what, jtype_name(v.t));
}

void jv_to_string(struct jrt *rt, int line, struct jval v, struct jbuf *out)
{
    char nb[64];
    switch (v.t) {
    case JV_UNDEF:
        jbuf_puts(rt, out, "undefined");
        return;
    case JV_NULL:
        jbuf_puts(rt, out, "null");
        return;
    case JV_BOOL:
        jbuf_puts(rt, out, v.u.b ? "true" : "false");
        return;
    case JV_INT:
        js_num_str(v.u.num, nb, sizeof(nb));
        jbuf_puts(rt, out, nb);
        return;
    case JV_FLOAT:
        float_str(v.u.num, nb, sizeof(nb));
        jbuf_puts(rt, out, nb);
        return;
    case JV_STR:
        jbuf_put(rt, out, v.u.s.p, v.u.s.n);
        return;
    case JV_ARRAY:
    case JV_TUPLE:
    case JV_OBJECT:
    case JV_NS:
    case JV_KWARGS: {
        struct json_opts o = {0};
        jv_to_json(rt, line, v, &o, 0, out);
        return;
    }
    case JV_FUNC:
        no_string(rt, line, v, "printing");
    }
}

void jv_raw_string(struct jrt *rt, int line, struct jval v, struct jbuf *out)
{
    char nb[64];
    switch (v.t) {
    case JV_INT:
    case JV_FLOAT:
        js_num_str(v.u.num, nb, sizeof(nb));
        jbuf_puts(rt, out, nb);
        return;
    case JV_BOOL:
    case JV_STR:
    case JV_NULL:
    case JV_UNDEF:
        jv_to_string(rt, line, v, out);
        return;
    default:
        no_string(rt, line, v, "string conversion");
    }
}

static void json_string(struct jrt *rt, const char *s, size_t n, bool ascii, struct jbuf *out)
{
    jbuf_put(rt, out, "\"", 1);
    size_t i = 0;
    while (i < n) {
        size_t start = i;
        uint32_t cp = u8_next(s, n, &i);
        char esc[16];
        const char *e = NULL;
        switch (cp) {
        case '"':
            e = "\\\"";
            break;
        case '\\':
            e = "\\\\";
            break;
        case '\b':
            e = "\\b";
            break;
        case '\f':
            e = "\\f";
            break;
        case '\n':
            e = "\\n";
            break;
        case '\r':
            e = "\\r";
            break;
        case '\t':
            e = "\\t";
            break;
        default:
            break;
        }
        if (e) {
            jbuf_puts(rt, out, e);
        } else if (cp < 0x20) {
            snprintf(esc, sizeof(esc), "\\u%04x", cp);
            jbuf_puts(rt, out, esc);
        } else if (ascii && cp >= 0x7F) {
            if (cp >= 0x10000) {
                snprintf(esc, sizeof(esc), "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                         0xDC00 + ((cp - 0x10000) & 0x3FF));
            } else {
                snprintf(esc, sizeof(esc), "\\u%04x", cp);
            }
            jbuf_puts(rt, out, esc);
        } else {
            jbuf_put(rt, out, s + start, i - start);
        }
    }
    jbuf_put(rt, out, "\"", 1);
}

static void json_pad(struct jrt *rt, int indent, int depth, struct jbuf *out)
{
    jbuf_put(rt, out, "\n", 1);
    for (int i = 0; i < indent * depth; i++)
        jbuf_put(rt, out, " ", 1);
}

void jv_to_json(struct jrt *rt, int line, struct jval v, const struct json_opts *o, int depth,
                struct jbuf *out)
{
    char nb[64];
    const char *isep = o->item_sep ? o->item_sep : o->indent ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    if (depth > JINJA_MAX_DEPTH)
        jfail(rt->c, KVD_ETOOLARGE, line, "a value nested deeper than %d levels", JINJA_MAX_DEPTH);
    switch (v.t) {
    case JV_NULL:
        jbuf_puts(rt, out, "null");
        return;
    case JV_UNDEF:
        jbuf_puts(rt, out, o->undef_as_null ? "null" : "undefined");
        return;
    case JV_INT:
    case JV_FLOAT:
        if (!isfinite(v.u.num)) {
            jbuf_puts(rt, out, "null");
            return;
        }
        js_num_str(v.u.num, nb, sizeof(nb));
        jbuf_puts(rt, out, nb);
        return;
    case JV_BOOL:
        jbuf_puts(rt, out, v.u.b ? "true" : "false");
        return;
    case JV_STR:
        json_string(rt, v.u.s.p, v.u.s.n, o->ensure_ascii, out);
        return;
    case JV_ARRAY:
    case JV_TUPLE: {
        struct jlist *l = v.u.arr;
        jbuf_put(rt, out, "[", 1);
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jbuf_puts(rt, out, isep);
            if (o->indent)
                json_pad(rt, o->indent, depth + 1, out);
            jv_to_json(rt, line, l->v[i], o, depth + 1, out);
        }
        if (o->indent && l->n)
            json_pad(rt, o->indent, depth, out);
        jbuf_put(rt, out, "]", 1);
        return;
    }
    case JV_OBJECT:
    case JV_NS:
    case JV_KWARGS: {
        struct jmap *m = v.u.map;
        jbuf_put(rt, out, "{", 1);
        for (size_t i = 0; i < m->n; i++) {
            if (i)
                jbuf_puts(rt, out, isep);
            if (o->indent)
                json_pad(rt, o->indent, depth + 1, out);
            json_string(rt, m->kp[i], m->kn[i], o->ensure_ascii, out);
            jbuf_puts(rt, out, ksep);
            jv_to_json(rt, line, m->v[i], o, depth + 1, out);
        }
        if (o->indent && m->n)
            json_pad(rt, o->indent, depth, out);
        jbuf_put(rt, out, "}", 1);
        return;
    }
    case JV_FUNC:
        jfail(rt->c, KVD_EBADREQ, line, "cannot convert a FunctionValue to JSON");
    }
}

/* ---- equality ---- */

static bool is_container(enum jt t)
{
    return t == JV_ARRAY || t == JV_TUPLE || t == JV_OBJECT || t == JV_NS || t == JV_KWARGS ||
           t == JV_FUNC;
}

/* JavaScript ToNumber of a string. */
static double js_to_number(const char *s, size_t n)
{
    size_t b, e;
    js_trim(s, n, true, true, &b, &e);
    if (b == e)
        return 0;
    char tmp[64];
    size_t len = e - b;
    if (len >= sizeof(tmp))
        return NAN;
    memcpy(tmp, s + b, len);
    tmp[len] = 0;
    if (strcmp(tmp, "Infinity") == 0 || strcmp(tmp, "+Infinity") == 0)
        return INFINITY;
    if (strcmp(tmp, "-Infinity") == 0)
        return -INFINITY;
    if (len > 2 && tmp[0] == '0' && (tmp[1] | 0x20) == 'x') {
        double v = 0;
        for (size_t i = 2; i < len; i++) {
            int h = (tmp[i] >= '0' && tmp[i] <= '9') ? tmp[i] - '0'
                    : ((tmp[i] | 0x20) >= 'a' && (tmp[i] | 0x20) <= 'f')
                        ? (tmp[i] | 0x20) - 'a' + 10
                        : -1;
            if (h < 0)
                return NAN;
            v = v * 16 + h;
        }
        return v;
    }
    for (size_t i = 0; i < len; i++)
        if (!strchr("0123456789.eE+-", tmp[i]))
            return NAN;
    char *end;
    double v = strtod(tmp, &end);
    return *end ? NAN : v;
}

bool jv_strict_eq(struct jval a, struct jval b)
{
    bool an = a.t == JV_INT || a.t == JV_FLOAT, bn = b.t == JV_INT || b.t == JV_FLOAT;
    if (an || bn)
        return an && bn && a.u.num == b.u.num;
    if (a.t != b.t) {
        bool al = a.t == JV_ARRAY || a.t == JV_TUPLE, bl = b.t == JV_ARRAY || b.t == JV_TUPLE;
        return al && bl && a.u.arr == b.u.arr;
    }
    switch (a.t) {
    case JV_UNDEF:
    case JV_NULL:
        return true;
    case JV_BOOL:
        return a.u.b == b.u.b;
    case JV_STR:
        return a.u.s.n == b.u.s.n && memcmp(a.u.s.p, b.u.s.p, a.u.s.n) == 0;
    case JV_ARRAY:
    case JV_TUPLE:
        return a.u.arr == b.u.arr;
    case JV_FUNC:
        return a.u.fn == b.u.fn;
    default:
        return a.u.map == b.u.map;
    }
}

bool jv_loose_eq(struct jrt *rt, int line, struct jval a, struct jval b)
{
    bool anil = a.t == JV_NULL || a.t == JV_UNDEF, bnil = b.t == JV_NULL || b.t == JV_UNDEF;
    if (anil || bnil)
        return anil && bnil;
    if (is_container(a.t) || is_container(b.t)) {
        if (is_container(a.t) && is_container(b.t))
            return jv_strict_eq(a, b);
        jfail(rt->c, KVD_EUNSUPPORTED, line, "comparing a %s with a %s is not supported",
              jtype_name(a.t), jtype_name(b.t));
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        jwork(rt, line, a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n);
        return jv_strict_eq(a, b);
    }
    double x = a.t == JV_STR ? js_to_number(a.u.s.p, a.u.s.n) : a.t == JV_BOOL ? a.u.b : a.u.num;
    double y = b.t == JV_STR ? js_to_number(b.u.s.p, b.u.s.n) : b.t == JV_BOOL ? b.u.b : b.u.num;
    return x == y;
}

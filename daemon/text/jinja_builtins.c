/* Jinja builtins as the reference renderer defines them: filters, tests,
 * attribute access, string and dict methods, and the globals range,
 * namespace, raise_exception and strftime_now. Where the reference's result
 * would need data kvd does not carry (Unicode case mapping beyond Latin-1,
 * Greek and Cyrillic; locale collation), the call is refused with
 * KVD_EUNSUPPORTED instead of guessing. */
#include "jinja.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

static struct jval sbuf_val(struct jbuf *b)
{
    return jv_str(b->p ? b->p : "", b->n);
}

static _Noreturn void unsupported(struct jrt *rt, int line, const char *what, const char *name,
                                  struct jval v)
{
    jfail(rt->c, KVD_EUNSUPPORTED, line, "%s '%s' on a %s is not supported", what, name,
          jtype_name(v.t));
}

static void put_cp(struct jrt *rt, struct jbuf *b, uint32_t cp)
{
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    jbuf_put(rt, b, u, n);
}

/* ---- case mapping ---- */

/* Code points without case mappings (JavaScript's toUpperCase/toLowerCase
 * leave them alone). Conservative: anything not listed and not mapped below
 * is refused. */
static bool caseless(uint32_t c)
{
    static const uint32_t r[][2] = {
        {0x80, 0xB4},     {0xB6, 0xBF},       {0xD7, 0xD7},       {0xF7, 0xF7},
        {0x0590, 0x05FF}, {0x0600, 0x06FF},   {0x0900, 0x0DFF},   {0x0E00, 0x0E7F},
        {0x2000, 0x206F}, {0x20A0, 0x20CF},   {0x2190, 0x23FF},   {0x2500, 0x27BF},
        {0x2800, 0x2BFF}, {0x3000, 0x30FF},   {0x3100, 0x318F},   {0x4E00, 0x9FFF},
        {0xAC00, 0xD7A3}, {0xFE00, 0xFE0F},   {0xFF01, 0xFF20},   {0xFF3B, 0xFF40},
        {0xFF5B, 0xFFEF}, {0x1F000, 0x1FAFF}, {0x20000, 0x3FFFF}, {0xE0000, 0xE007F},
    };
    for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++)
        if (c >= r[i][0] && c <= r[i][1])
            return true;
    return false;
}

/* Maps cp; returns the number of code points written to out, or 0 when kvd
 * does not know the mapping. */
static int case_map(uint32_t c, bool upper, uint32_t out[3])
{
    if (c < 0x80) {
        out[0] = upper ? (uint32_t)toupper((int)c) : (uint32_t)tolower((int)c);
        return 1;
    }
    if (caseless(c)) {
        out[0] = c;
        return 1;
    }
    if (upper) {
        if (c == 0xDF) {
            out[0] = out[1] = 'S';
            return 2;
        }
        if (c == 0xFF) {
            out[0] = 0x178;
            return 1;
        }
        if (c >= 0xE0 && c <= 0xFE) {
            out[0] = c - 0x20;
            return 1;
        }
        if ((c >= 0xC0 && c <= 0xDE) || (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) ||
            (c >= 0x400 && c <= 0x42F)) {
            out[0] = c;
            return 1;
        }
        if (c >= 0x3B1 && c <= 0x3C9) {
            out[0] = c == 0x3C2 ? 0x3A3 : c - 0x20;
            return 1;
        }
        if (c >= 0x430 && c <= 0x44F) {
            out[0] = c - 0x20;
            return 1;
        }
        if (c >= 0x450 && c <= 0x45F) {
            out[0] = c - 0x50;
            return 1;
        }
        return 0;
    }
    if (c >= 0xC0 && c <= 0xDE) {
        out[0] = c + 0x20;
        return 1;
    }
    if ((c >= 0xDF && c <= 0xFF) || (c >= 0x3B1 && c <= 0x3C9) || (c >= 0x430 && c <= 0x45F)) {
        out[0] = c;
        return 1;
    }
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2 && c != 0x3A3) { /* Σ: final-sigma rule */
        out[0] = c + 0x20;
        return 1;
    }
    if (c >= 0x410 && c <= 0x42F) {
        out[0] = c + 0x20;
        return 1;
    }
    if (c >= 0x400 && c <= 0x40F) {
        out[0] = c + 0x50;
        return 1;
    }
    return 0;
}

static struct jval str_case(struct jrt *rt, int line, struct jval s, bool upper, const char *name)
{
    struct jbuf b = {0};
    size_t i = 0;
    while (i < s.u.s.n) {
        uint32_t cp = u8_next(s.u.s.p, s.u.s.n, &i), m[3];
        int k = case_map(cp, upper, m);
        if (!k)
            jfail(rt->c, KVD_EUNSUPPORTED, line, "%s of the character U+%04X is not supported",
                  name, cp);
        for (int j = 0; j < k; j++)
            put_cp(rt, &b, m[j]);
    }
    return sbuf_val(&b);
}

static bool is_word(unsigned char ch)
{
    return isalnum(ch) || ch == '_';
}

static struct jval str_title(struct jrt *rt, struct jval s)
{
    char *p = jstrdup(rt->c, s.u.s.p, s.u.s.n);
    bool prev = false;
    for (size_t i = 0; i < s.u.s.n; i++) {
        unsigned char ch = (unsigned char)p[i];
        bool w = ch < 0x80 && is_word(ch);
        if (w && !prev)
            p[i] = (char)toupper(ch);
        prev = w;
    }
    return jv_str(p, s.u.s.n);
}

static struct jval str_capitalize(struct jrt *rt, int line, struct jval s)
{
    if (s.u.s.n == 0)
        return s;
    size_t i = 0;
    uint32_t cp = u8_next(s.u.s.p, s.u.s.n, &i), m[3];
    if (cp >= 0x10000) /* charAt(0) is a lone surrogate: unchanged */
        return s;
    int k = case_map(cp, true, m);
    if (!k)
        jfail(rt->c, KVD_EUNSUPPORTED, line, "capitalize of the character U+%04X is not supported",
              cp);
    struct jbuf b = {0};
    for (int j = 0; j < k; j++)
        put_cp(rt, &b, m[j]);
    jbuf_put(rt, &b, s.u.s.p + i, s.u.s.n - i);
    return sbuf_val(&b);
}

static struct jval str_trim(struct jval s, bool l, bool r)
{
    size_t b, e;
    js_trim(s.u.s.p, s.u.s.n, l, r, &b, &e);
    return jv_str(s.u.s.p + b, e - b);
}

static bool has_prefix(struct jval s, struct jval p, bool end)
{
    if (p.u.s.n > s.u.s.n)
        return false;
    const char *at = end ? s.u.s.p + s.u.s.n - p.u.s.n : s.u.s.p;
    return memcmp(at, p.u.s.p, p.u.s.n) == 0;
}

static const char *find(const char *h, size_t hn, const char *n, size_t nn)
{
    if (nn > hn)
        return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (memcmp(h + i, n, nn) == 0)
            return h + i;
    return NULL;
}

static struct jval str_split(struct jrt *rt, int line, struct jval s, struct jval *args,
                             size_t nargs)
{
    struct jval sep = nargs > 0 ? args[0] : jv_null();
    struct jval maxv = nargs > 1 ? args[1] : jv_int(-1);
    if (sep.t != JV_STR && sep.t != JV_NULL)
        jfail(rt->c, KVD_EBADREQ, line, "sep argument must be a string or null");
    if (maxv.t != JV_INT)
        jfail(rt->c, KVD_EBADREQ, line, "maxsplit argument must be a number");
    double maxs = maxv.u.num;
    struct jlist *l = jlist_new(rt->c, 0);
    if (sep.t == JV_NULL) {
        struct jval t = str_trim(s, true, false);
        size_t i = 0, n = t.u.s.n;
        const char *p = t.u.s.p;
        while (i < n) {
            size_t j = i, k;
            while (j < n) {
                k = j;
                if (js_is_space(u8_next(p, n, &k)))
                    break;
                j = k;
            }
            if (maxs >= 0 && (double)l->n >= maxs) {
                jlist_push(rt->c, l, jv_str(p + i, n - i));
                break;
            }
            jlist_push(rt->c, l, jv_str(p + i, j - i));
            i = j;
            while (i < n) {
                k = i;
                if (!js_is_space(u8_next(p, n, &k)))
                    break;
                i = k;
            }
        }
        return jv_array(l);
    }
    if (sep.u.s.n == 0)
        jfail(rt->c, KVD_EBADREQ, line, "empty separator");
    const char *p = s.u.s.p, *end = s.u.s.p + s.u.s.n;
    for (;;) {
        const char *q = (maxs >= 0 && (double)l->n >= maxs)
                            ? NULL
                            : find(p, (size_t)(end - p), sep.u.s.p, sep.u.s.n);
        if (!q) {
            jlist_push(rt->c, l, jv_str(p, (size_t)(end - p)));
            break;
        }
        jlist_push(rt->c, l, jv_str(p, (size_t)(q - p)));
        p = q + sep.u.s.n;
    }
    return jv_array(l);
}

static struct jval str_replace(struct jrt *rt, int line, struct jval s, struct jval *args,
                               size_t nargs)
{
    struct jval count = jv_null();
    if (nargs > 0 && args[nargs - 1].t == JV_KWARGS) {
        struct jval *c = jmap_get(args[nargs - 1].u.map, "count", 5);
        if (nargs - 1 == 2) {
            count = c ? *c : jv_null();
            nargs--;
        } else if (nargs - 1 < 2) {
            jfail(rt->c, KVD_EBADREQ, line, "replace() requires at least two arguments");
        } else {
            jfail(rt->c, KVD_EUNSUPPORTED, line, "replace() with a count and keywords");
        }
    } else if (nargs > 2) {
        count = args[2];
    }
    if (nargs < 2)
        jfail(rt->c, KVD_EBADREQ, line, "replace() requires at least two arguments");
    struct jval o = args[0], nw = args[1];
    if (o.t != JV_STR || nw.t != JV_STR)
        jfail(rt->c, KVD_EBADREQ, line, "replace() arguments must be strings");
    if (count.t != JV_INT && count.t != JV_NULL)
        jfail(rt->c, KVD_EBADREQ, line, "replace() count argument must be a number or null");
    double left = count.t == JV_NULL || count.u.num < 0 ? INFINITY : count.u.num;
    if (count.t == JV_INT && count.u.num == 0)
        return s;
    struct jbuf b = {0};
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    if (o.u.s.n == 0) {
        /* an empty pattern matches before every code point and at the end */
        size_t i = 0;
        for (;;) {
            if (left > 0) {
                jbuf_put(rt, &b, nw.u.s.p, nw.u.s.n);
                left--;
            }
            if (i >= s.u.s.n)
                break;
            size_t j = i;
            u8_next(s.u.s.p, s.u.s.n, &j);
            jbuf_put(rt, &b, s.u.s.p + i, j - i);
            i = j;
        }
        return sbuf_val(&b);
    }
    while (p < end) {
        const char *q = left > 0 ? find(p, (size_t)(end - p), o.u.s.p, o.u.s.n) : NULL;
        if (!q)
            break;
        jbuf_put(rt, &b, p, (size_t)(q - p));
        jbuf_put(rt, &b, nw.u.s.p, nw.u.s.n);
        left--;
        p = q + o.u.s.n;
    }
    jbuf_put(rt, &b, p, (size_t)(end - p));
    return sbuf_val(&b);
}

/* ---- attribute access ---- */

static struct jval method(struct jrt *rt, enum jfn kind, struct jval self)
{
    struct jfunc *f = jalloc(rt->c, sizeof(*f));
    memset(f, 0, sizeof(*f));
    f->kind = kind;
    f->self = self;
    struct jval v = {.t = JV_FUNC, .u.fn = f};
    return v;
}

static bool name_is(struct jval p, const char *s)
{
    return p.u.s.n == strlen(s) && memcmp(p.u.s.p, s, p.u.s.n) == 0;
}

static struct jval builtin_of(struct jrt *rt, struct jval obj, struct jval p)
{
    static const struct {
        const char *name;
        enum jfn kind;
    } str_m[] = {{"upper", JF_S_UPPER},           {"lower", JF_S_LOWER},
                 {"strip", JF_S_STRIP},           {"title", JF_S_TITLE},
                 {"capitalize", JF_S_CAPITALIZE}, {"rstrip", JF_S_RSTRIP},
                 {"lstrip", JF_S_LSTRIP},         {"startswith", JF_S_STARTSWITH},
                 {"endswith", JF_S_ENDSWITH},     {"split", JF_S_SPLIT},
                 {"replace", JF_S_REPLACE}},
      obj_m[] = {{"get", JF_O_GET},
                 {"items", JF_O_ITEMS},
                 {"keys", JF_O_KEYS},
                 {"values", JF_O_VALUES},
                 {"dictsort", JF_O_DICTSORT}};
    if (obj.t == JV_STR) {
        if (name_is(p, "length")) {
            jwork(rt, 0, obj.u.s.n);
            return jv_int((double)js_utf16_len(obj.u.s.p, obj.u.s.n));
        }
        for (size_t i = 0; i < sizeof(str_m) / sizeof(str_m[0]); i++)
            if (name_is(p, str_m[i].name))
                return method(rt, str_m[i].kind, obj);
    } else if (obj.t == JV_ARRAY || obj.t == JV_TUPLE) {
        if (name_is(p, "length"))
            return jv_int((double)obj.u.arr->n);
    } else if (obj.t == JV_OBJECT || obj.t == JV_KWARGS) {
        for (size_t i = 0; i < sizeof(obj_m) / sizeof(obj_m[0]); i++)
            if (name_is(p, obj_m[i].name))
                return method(rt, obj_m[i].kind, obj);
    }
    return jv_undef();
}

/* The UTF-16 unit at index i of s (negative from the end), as a string. */
static struct jval str_at(struct jrt *rt, int line, struct jval s, double idx)
{
    jwork(rt, line, s.u.s.n);
    double len = (double)js_utf16_len(s.u.s.p, s.u.s.n);
    double k = idx < 0 ? len + trunc(idx) : trunc(idx);
    if (isnan(idx))
        k = 0;
    if (k < 0 || k >= len)
        return jv_undef();
    size_t i = 0, u = 0;
    while (i < s.u.s.n) {
        size_t start = i;
        uint32_t cp = u8_next(s.u.s.p, s.u.s.n, &i);
        size_t w = cp >= 0x10000 ? 2 : 1;
        if ((double)u == k && w == 1)
            return jv_str(s.u.s.p + start, i - start);
        if ((double)u <= k && k < (double)(u + w))
            jfail(rt->c, KVD_EUNSUPPORTED, line,
                  "indexing half of a character outside the BMP is not supported");
        u += w;
    }
    return jv_undef();
}

struct jval jinja_member(struct jrt *rt, int line, struct jval obj, struct jval prop)
{
    if (obj.t == JV_OBJECT || obj.t == JV_NS || obj.t == JV_KWARGS) {
        if (prop.t != JV_STR)
            jfail(rt->c, KVD_EBADREQ, line, "cannot access property with non-string: got %s",
                  jtype_name(prop.t));
        struct jval *v = jmap_get(obj.u.map, prop.u.s.p, prop.u.s.n);
        if (v)
            return *v;
        return obj.t == JV_NS ? jv_undef() : builtin_of(rt, obj, prop);
    }
    if (obj.t == JV_ARRAY || obj.t == JV_TUPLE || obj.t == JV_STR) {
        if (prop.t == JV_INT) {
            if (obj.t == JV_STR)
                return str_at(rt, line, obj, prop.u.num);
            double len = (double)obj.u.arr->n, k = trunc(prop.u.num);
            if (isnan(prop.u.num))
                k = 0;
            if (k < 0)
                k += len;
            return k >= 0 && k < len ? obj.u.arr->v[(size_t)k] : jv_undef();
        }
        if (prop.t == JV_STR)
            return builtin_of(rt, obj, prop);
        jfail(rt->c, KVD_EBADREQ, line, "cannot access property with non-string/non-number: got %s",
              jtype_name(prop.t));
    }
    if (prop.t != JV_STR)
        jfail(rt->c, KVD_EBADREQ, line, "cannot access property with non-string: got %s",
              jtype_name(prop.t));
    return jv_undef();
}

/* ---- globals and methods ---- */

static void no_kwargs(struct jrt *rt, int line, const char *fn, struct jval *args, size_t *nargs)
{
    if (*nargs && args[*nargs - 1].t == JV_KWARGS)
        jfail(rt->c, KVD_EUNSUPPORTED, line, "keyword arguments to %s() are not supported", fn);
}

static struct jval g_range(struct jrt *rt, int line, struct jval *a, size_t n)
{
    double v[3] = {0, 0, 1};
    for (size_t i = 0; i < n && i < 3; i++) {
        if (a[i].t != JV_INT && a[i].t != JV_FLOAT)
            jfail(rt->c, KVD_EUNSUPPORTED, line, "range() of a %s is not supported",
                  jtype_name(a[i].t));
        v[i] = a[i].u.num;
    }
    if (n == 0 || n > 3)
        jfail(rt->c, KVD_EUNSUPPORTED, line, "range() with %zu arguments is not supported", n);
    double start = n == 1 ? 0 : v[0], stop = n == 1 ? v[0] : v[1], st = n == 3 ? v[2] : 1;
    if (st == 0)
        jfail(rt->c, KVD_EBADREQ, line, "range() step must not be zero");
    if (!isfinite(start) || !isfinite(stop) || !isfinite(st) || fabs((stop - start) / st) > 1e6)
        jfail(rt->c, KVD_ETOOLARGE, line, "range() of more than a million numbers");
    struct jlist *l = jlist_new(rt->c, 0);
    for (double x = start; st > 0 ? x < stop : x > stop; x += st)
        jlist_push(rt->c, l, x == trunc(x) ? jv_int(x) : jv_float(x));
    return jv_array(l);
}

static struct jval g_namespace(struct jrt *rt, int line, struct jval *a, size_t n)
{
    struct jmap *m = jmap_new(rt->c);
    struct jmap *kw = NULL;
    if (n && a[n - 1].t == JV_KWARGS)
        kw = a[--n].u.map;
    if (n > 1)
        jfail(rt->c, KVD_EBADREQ, line, "namespace expected at most 1 argument, got %zu", n);
    if (n == 1) {
        if (a[0].t == JV_OBJECT || a[0].t == JV_KWARGS) {
            for (size_t i = 0; i < a[0].u.map->n; i++)
                jmap_set(rt->c, m, a[0].u.map->kp[i], a[0].u.map->kn[i], a[0].u.map->v[i]);
        } else if (a[0].t == JV_ARRAY || a[0].t == JV_TUPLE) {
            for (size_t i = 0; i < a[0].u.arr->n; i++) {
                struct jval p = a[0].u.arr->v[i];
                if ((p.t != JV_ARRAY && p.t != JV_TUPLE) || p.u.arr->n != 2 ||
                    p.u.arr->v[0].t != JV_STR)
                    jfail(rt->c, KVD_EUNSUPPORTED, line,
                          "namespace() of this list is not supported");
                jmap_set(rt->c, m, p.u.arr->v[0].u.s.p, p.u.arr->v[0].u.s.n, p.u.arr->v[1]);
            }
        } else {
            jfail(rt->c, KVD_EBADREQ, line, "'%s' object is not iterable", jtype_name(a[0].t));
        }
    }
    if (kw)
        for (size_t i = 0; i < kw->n; i++)
            jmap_set(rt->c, m, kw->kp[i], kw->kn[i], kw->v[i]);
    return jv_object(m, JV_NS);
}

static struct jval g_strftime(struct jrt *rt, int line, struct jval *a, size_t n)
{
    static const char *const mon[] = {"January",   "February", "March",    "April",
                                      "May",       "June",     "July",     "August",
                                      "September", "October",  "November", "December"};
    if (n < 1 || a[0].t != JV_STR)
        jfail(rt->c, KVD_EBADREQ, line, "strftime_now() needs a format string");
    struct tm tm;
    localtime_r(&rt->now, &tm);
    struct jbuf b = {0};
    const char *p = a[0].u.s.p, *end = p + a[0].u.s.n;
    char tmp[32];
    while (p < end) {
        if (*p == '%' && p + 1 < end && strchr("YmdbBHM%", p[1])) {
            switch (p[1]) {
            case 'Y':
                snprintf(tmp, sizeof(tmp), "%d", tm.tm_year + 1900);
                break;
            case 'm':
                snprintf(tmp, sizeof(tmp), "%02d", tm.tm_mon + 1);
                break;
            case 'd':
                snprintf(tmp, sizeof(tmp), "%02d", tm.tm_mday);
                break;
            case 'b':
                snprintf(tmp, sizeof(tmp), "%.3s", mon[tm.tm_mon]);
                break;
            case 'B':
                snprintf(tmp, sizeof(tmp), "%s", mon[tm.tm_mon]);
                break;
            case 'H':
                snprintf(tmp, sizeof(tmp), "%02d", tm.tm_hour);
                break;
            case 'M':
                snprintf(tmp, sizeof(tmp), "%02d", tm.tm_min);
                break;
            default:
                snprintf(tmp, sizeof(tmp), "%%");
                break;
            }
            jbuf_put(rt, &b, tmp, strlen(tmp));
            p += 2;
        } else {
            jbuf_put(rt, &b, p, 1);
            p++;
        }
    }
    return sbuf_val(&b);
}

static struct jval map_items(struct jrt *rt, struct jmap *m, int what)
{
    struct jlist *l = jlist_new(rt->c, m->n);
    for (size_t i = 0; i < m->n; i++) {
        struct jval k = jv_str(m->kp[i], m->kn[i]);
        if (what == 0) {
            struct jlist *pair = jlist_new(rt->c, 2);
            jlist_push(rt->c, pair, k);
            jlist_push(rt->c, pair, m->v[i]);
            jlist_push(rt->c, l, jv_array(pair));
        } else {
            jlist_push(rt->c, l, what == 1 ? k : m->v[i]);
        }
    }
    return jv_array(l);
}

struct jval jinja_call_builtin(struct jrt *rt, int line, struct jfunc *fn, struct jval *a, size_t n)
{
    struct jval s = fn->self;
    if (s.t == JV_STR) /* a string method reads its string */
        jwork(rt, line, s.u.s.n);
    switch (fn->kind) {
    case JF_RAISE: {
        struct jbuf b = {0};
        if (n > 0 && a[0].t != JV_KWARGS) {
            if (a[0].t != JV_STR && a[0].t != JV_INT && a[0].t != JV_FLOAT && a[0].t != JV_BOOL &&
                a[0].t != JV_NULL)
                jfail(rt->c, KVD_EUNSUPPORTED, line, "raise_exception() of a %s",
                      jtype_name(a[0].t));
            if (a[0].t != JV_NULL)
                jv_raw_string(rt, line, a[0], &b);
        }
        rt->c->code = KVD_EBADREQ;
        if (rt->c->err && rt->c->errlen)
            snprintf(rt->c->err, rt->c->errlen, "%.*s", (int)b.n, b.p ? b.p : "");
        longjmp(rt->c->jb, 1);
    }
    case JF_RANGE:
        no_kwargs(rt, line, "range", a, &n);
        return g_range(rt, line, a, n);
    case JF_NAMESPACE:
        return g_namespace(rt, line, a, n);
    case JF_STRFTIME:
        no_kwargs(rt, line, "strftime_now", a, &n);
        return g_strftime(rt, line, a, n);
    case JF_S_REPLACE:
        return str_replace(rt, line, s, a, n);
    default:
        break;
    }
    no_kwargs(rt, line, "this method", a, &n);
    switch (fn->kind) {
    case JF_S_UPPER:
        return str_case(rt, line, s, true, "upper");
    case JF_S_LOWER:
        return str_case(rt, line, s, false, "lower");
    case JF_S_STRIP:
        return str_trim(s, true, true);
    case JF_S_LSTRIP:
        return str_trim(s, true, false);
    case JF_S_RSTRIP:
        return str_trim(s, false, true);
    case JF_S_TITLE:
        return str_title(rt, s);
    case JF_S_CAPITALIZE:
        return str_capitalize(rt, line, s);
    case JF_S_STARTSWITH:
    case JF_S_ENDSWITH: {
        bool end = fn->kind == JF_S_ENDSWITH;
        if (n == 0)
            jfail(rt->c, KVD_EBADREQ, line, "%s() requires at least one argument",
                  end ? "endswith" : "startswith");
        if (a[0].t == JV_STR)
            return jv_bool(has_prefix(s, a[0], end));
        if (a[0].t == JV_ARRAY || a[0].t == JV_TUPLE) {
            for (size_t i = 0; i < a[0].u.arr->n; i++) {
                if (a[0].u.arr->v[i].t != JV_STR)
                    jfail(rt->c, KVD_EBADREQ, line, "tuple elements must be strings");
                if (has_prefix(s, a[0].u.arr->v[i], end))
                    return jv_bool(true);
            }
            return jv_bool(false);
        }
        jfail(rt->c, KVD_EBADREQ, line, "argument must be a string or tuple of strings");
    }
    case JF_S_SPLIT:
        return str_split(rt, line, s, a, n);
    case JF_O_GET: {
        if (n < 1 || a[0].t != JV_STR)
            jfail(rt->c, KVD_EBADREQ, line, "object key must be a string");
        struct jval *v = jmap_get(s.u.map, a[0].u.s.p, a[0].u.s.n);
        return v ? *v : n > 1 ? a[1] : jv_null();
    }
    case JF_O_ITEMS:
        return map_items(rt, s.u.map, 0);
    case JF_O_KEYS:
        return map_items(rt, s.u.map, 1);
    case JF_O_VALUES:
        return map_items(rt, s.u.map, 2);
    case JF_O_DICTSORT:
        jfail(rt->c, KVD_EUNSUPPORTED, line, "dictsort is not supported");
    default:
        jfail(rt->c, KVD_EINTERNAL, line, "unknown builtin");
    }
}

/* ---- tests ---- */

bool jinja_test(struct jrt *rt, const struct jnode *t, struct jval v)
{
    const char *n = t->s;
    if (!strcmp(n, "boolean"))
        return v.t == JV_BOOL;
    if (!strcmp(n, "callable"))
        return v.t == JV_FUNC;
    if (!strcmp(n, "odd") || !strcmp(n, "even")) {
        if (v.t != JV_INT)
            jfail(rt->c, KVD_EBADREQ, t->line, "cannot %s on %s", n, jtype_name(v.t));
        bool odd = fmod(v.u.num, 2) != 0;
        return n[0] == 'o' ? odd : !odd;
    }
    if (!strcmp(n, "false"))
        return v.t == JV_BOOL && !v.u.b;
    if (!strcmp(n, "true"))
        return v.t == JV_BOOL && v.u.b;
    if (!strcmp(n, "none"))
        return v.t == JV_NULL;
    if (!strcmp(n, "string"))
        return v.t == JV_STR;
    if (!strcmp(n, "number"))
        return v.t == JV_INT || v.t == JV_FLOAT;
    if (!strcmp(n, "integer"))
        return v.t == JV_INT;
    if (!strcmp(n, "iterable"))
        return v.t == JV_ARRAY || v.t == JV_STR;
    if (!strcmp(n, "mapping"))
        return v.t == JV_OBJECT || v.t == JV_KWARGS;
    if (!strcmp(n, "sequence"))
        return v.t == JV_ARRAY || v.t == JV_TUPLE || v.t == JV_OBJECT || v.t == JV_KWARGS ||
               v.t == JV_STR;
    if (!strcmp(n, "lower") || !strcmp(n, "upper")) {
        if (v.t != JV_STR)
            return false;
        struct jval m = str_case(rt, t->line, v, n[0] == 'u', n);
        return m.u.s.n == v.u.s.n && memcmp(m.u.s.p, v.u.s.p, v.u.s.n) == 0;
    }
    if (!strcmp(n, "defined"))
        return v.t != JV_UNDEF;
    if (!strcmp(n, "undefined"))
        return v.t == JV_UNDEF;
    if (!strcmp(n, "equalto") || !strcmp(n, "eq"))
        jfail(rt->c, KVD_EBADREQ, t->line, "test '%s' needs a value", n);
    jfail(rt->c, KVD_EUNSUPPORTED, t->line, "test '%s' is not supported", n);
}

/* ---- filters ---- */

static void join_values(struct jrt *rt, int line, struct jlist *l, struct jval sep, struct jbuf *b)
{
    for (size_t i = 0; i < l->n; i++) {
        if (i)
            jbuf_put(rt, b, sep.u.s.p, sep.u.s.n);
        struct jval x = l->v[i];
        if (x.t == JV_NULL || x.t == JV_UNDEF)
            continue;
        if (x.t != JV_STR && x.t != JV_INT && x.t != JV_FLOAT && x.t != JV_BOOL)
            jfail(rt->c, KVD_EUNSUPPORTED, line, "join of a list holding a %s is not supported",
                  jtype_name(x.t));
        jv_raw_string(rt, line, x, b);
    }
}

/* JavaScript parseInt(s, 10) / parseFloat(s); NaN when nothing parses. */
static double js_parse_num(struct jval s, bool integer)
{
    size_t b, e;
    js_trim(s.u.s.p, s.u.s.n, true, false, &b, &e);
    const char *p = s.u.s.p + b, *end = s.u.s.p + s.u.s.n;
    char tmp[400];
    size_t k = 0;
    if (p < end && (*p == '+' || *p == '-'))
        tmp[k++] = *p++;
    if (!integer && end - p >= 8 && memcmp(p, "Infinity", 8) == 0)
        return tmp[0] == '-' ? -INFINITY : INFINITY;
    size_t digits = 0;
    while (p < end && isdigit((unsigned char)*p) && k < sizeof(tmp) - 8) {
        tmp[k++] = *p++;
        digits++;
    }
    if (!integer) {
        if (p < end && *p == '.') {
            tmp[k++] = *p++;
            while (p < end && isdigit((unsigned char)*p) && k < sizeof(tmp) - 8) {
                tmp[k++] = *p++;
                digits++;
            }
        }
        if (digits && p + 1 < end && (*p == 'e' || *p == 'E')) {
            const char *q = p + 1;
            if (q < end && (*q == '+' || *q == '-'))
                q++;
            if (q < end && isdigit((unsigned char)*q)) {
                while (p < q)
                    tmp[k++] = *p++;
                while (p < end && isdigit((unsigned char)*p) && k < sizeof(tmp) - 2)
                    tmp[k++] = *p++;
            }
        }
    }
    tmp[k] = 0;
    if (!digits)
        return NAN;
    return strtod(tmp, NULL);
}

static struct jval kwarg(struct jval *a, size_t n, const char *name)
{
    if (n && a[n - 1].t == JV_KWARGS) {
        struct jval *v = jmap_get(a[n - 1].u.map, name, strlen(name));
        if (v)
            return *v;
    }
    return jv_undef();
}

static size_t npos(struct jval *a, size_t n)
{
    return n && a[n - 1].t == JV_KWARGS ? n - 1 : n;
}

static struct jval attr_path(struct jval item, struct jval path)
{
    const char *p = path.u.s.p, *end = p + path.u.s.n;
    struct jval v = item;
    for (;;) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t len = dot ? (size_t)(dot - p) : (size_t)(end - p);
        if (v.t == JV_OBJECT || v.t == JV_NS || v.t == JV_KWARGS) {
            struct jval *x = jmap_get(v.u.map, p, len);
            v = x ? *x : jv_undef();
        } else if (v.t == JV_ARRAY || v.t == JV_TUPLE) {
            char tmp[32];
            snprintf(tmp, sizeof(tmp), "%.*s", (int)(len < 31 ? len : 31), p);
            char *e;
            long idx = strtol(tmp, &e, 10);
            if (e == tmp || idx < 0 || (size_t)idx >= v.u.arr->n)
                return jv_undef();
            v = v.u.arr->v[idx];
        } else {
            return jv_undef();
        }
        if (!dot)
            return v;
        p = dot + 1;
    }
}

static struct jval filter_plain(struct jrt *rt, const struct jnode *f, struct jval v)
{
    const char *n = f->s;
    int line = f->line;
    switch (v.t) {
    case JV_ARRAY:
    case JV_TUPLE: {
        struct jlist *l = v.u.arr;
        if (!strcmp(n, "list"))
            return v;
        if (!strcmp(n, "first") || !strcmp(n, "last")) {
            if (l->n == 0)
                jfail(rt->c, KVD_EBADREQ, line, "filter '%s' on an empty list", n);
            return n[0] == 'f' ? l->v[0] : l->v[l->n - 1];
        }
        if (!strcmp(n, "length"))
            return jv_int((double)l->n);
        if (!strcmp(n, "reverse")) {
            struct jlist *r = jlist_new(rt->c, l->n);
            for (size_t i = l->n; i-- > 0;)
                jlist_push(rt->c, r, l->v[i]);
            return jv_array(r);
        }
        if (!strcmp(n, "join")) {
            struct jbuf b = {0};
            join_values(rt, line, l, jv_str("", 0), &b);
            return sbuf_val(&b);
        }
        if (!strcmp(n, "string")) {
            struct jbuf b = {0};
            struct json_opts o = {0};
            jv_to_json(rt, line, v, &o, 0, &b);
            return sbuf_val(&b);
        }
        if (!strcmp(n, "unique")) {
            struct jlist *r = jlist_new(rt->c, 0);
            for (size_t i = 0; i < l->n; i++) {
                bool seen = false;
                for (size_t j = 0; j < r->n && !seen; j++)
                    seen = jv_strict_eq(r->v[j], l->v[i]) ||
                           (l->v[i].t == JV_FLOAT && isnan(l->v[i].u.num) &&
                            (r->v[j].t == JV_FLOAT || r->v[j].t == JV_INT) && isnan(r->v[j].u.num));
                if (!seen)
                    jlist_push(rt->c, r, l->v[i]);
            }
            return jv_array(r);
        }
        break;
    }
    case JV_STR:
        jwork(rt, f->line, v.u.s.n); /* every string filter reads its string */
        if (!strcmp(n, "length"))
            return jv_int((double)js_utf16_len(v.u.s.p, v.u.s.n));
        if (!strcmp(n, "upper") || !strcmp(n, "lower"))
            return str_case(rt, line, v, n[0] == 'u', n);
        if (!strcmp(n, "title"))
            return str_title(rt, v);
        if (!strcmp(n, "capitalize"))
            return str_capitalize(rt, line, v);
        if (!strcmp(n, "trim"))
            return str_trim(v, true, true);
        if (!strcmp(n, "join") || !strcmp(n, "string"))
            return v;
        if (!strcmp(n, "int")) {
            double x = js_parse_num(v, true);
            return jv_int(isnan(x) ? 0 : x);
        }
        if (!strcmp(n, "float")) {
            double x = js_parse_num(v, false);
            return jv_float(isnan(x) ? 0 : x);
        }
        if (!strcmp(n, "indent")) {
            struct jbuf b = {0};
            const char *p = v.u.s.p, *end = p + v.u.s.n;
            bool first = true;
            for (;;) {
                const char *nl = memchr(p, '\n', (size_t)(end - p));
                size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
                if (!first && len)
                    jbuf_put(rt, &b, "    ", 4);
                jbuf_put(rt, &b, p, len);
                if (!nl)
                    break;
                jbuf_put(rt, &b, "\n", 1);
                p = nl + 1;
                first = false;
            }
            return sbuf_val(&b);
        }
        break;
    case JV_INT:
    case JV_FLOAT:
        if (!strcmp(n, "abs"))
            return v.t == JV_INT ? jv_int(fabs(v.u.num)) : jv_float(fabs(v.u.num));
        if (!strcmp(n, "int"))
            return jv_int(trunc(v.u.num) + 0.0);
        if (!strcmp(n, "float"))
            return jv_float(v.u.num);
        if (!strcmp(n, "string")) {
            struct jbuf b = {0};
            jv_to_string(rt, line, v, &b);
            return sbuf_val(&b);
        }
        break;
    case JV_OBJECT:
    case JV_KWARGS:
        if (!strcmp(n, "items"))
            return map_items(rt, v.u.map, 0);
        if (!strcmp(n, "length"))
            return jv_int((double)v.u.map->n);
        if (!strcmp(n, "keys"))
            return map_items(rt, v.u.map, 1);
        if (!strcmp(n, "values"))
            return map_items(rt, v.u.map, 2);
        if (!strcmp(n, "get"))
            jfail(rt->c, KVD_EBADREQ, line, "object key must be a string");
        break;
    case JV_BOOL:
        if (!strcmp(n, "bool"))
            return v;
        if (!strcmp(n, "int"))
            return jv_int(v.u.b);
        if (!strcmp(n, "float"))
            return jv_float(v.u.b);
        if (!strcmp(n, "string"))
            return jv_str(v.u.b ? "true" : "false", v.u.b ? 4 : 5);
        break;
    default:
        break;
    }
    unsupported(rt, line, "filter", n, v);
}

static struct jval filter_call(struct jrt *rt, const struct jnode *f, struct jval v,
                               struct jenv *env)
{
    const char *n = f->s;
    int line = f->line;
    struct jval *a;
    size_t na = jinja_eval_args(rt, f->list, f->nlist, env, &a);
    if (v.t == JV_STR)
        jwork(rt, line, v.u.s.n);
    size_t np = npos(a, na);
    if (!strcmp(n, "tojson")) {
        struct json_opts o = {.undef_as_null = true};
        struct jval ind = kwarg(a, na, "indent"), asc = kwarg(a, na, "ensure_ascii"),
                    sk = kwarg(a, na, "sort_keys"), sep = kwarg(a, na, "separators");
        if (ind.t == JV_INT) {
            if (ind.u.num < 0 || ind.u.num > 64)
                jfail(rt->c, KVD_EUNSUPPORTED, line, "tojson indent %g is not supported",
                      ind.u.num);
            o.indent = (int)ind.u.num;
        } else if (ind.t != JV_UNDEF && ind.t != JV_NULL) {
            jfail(rt->c, KVD_EBADREQ, line, "if set, indent must be a number");
        }
        if (asc.t == JV_BOOL)
            o.ensure_ascii = asc.u.b;
        else if (asc.t != JV_UNDEF)
            jfail(rt->c, KVD_EBADREQ, line, "if set, ensure_ascii must be a boolean");
        if (sk.t == JV_BOOL && sk.u.b)
            jfail(rt->c, KVD_EUNSUPPORTED, line, "tojson(sort_keys=true) is not supported");
        else if (sk.t != JV_UNDEF && sk.t != JV_BOOL)
            jfail(rt->c, KVD_EBADREQ, line, "if set, sort_keys must be a boolean");
        if (sep.t == JV_ARRAY || sep.t == JV_TUPLE) {
            if (sep.u.arr->n != 2 || sep.u.arr->v[0].t != JV_STR || sep.u.arr->v[1].t != JV_STR)
                jfail(rt->c, KVD_EBADREQ, line, "separators must be a tuple of two strings");
            o.item_sep = jstrdup(rt->c, sep.u.arr->v[0].u.s.p, sep.u.arr->v[0].u.s.n);
            o.key_sep = jstrdup(rt->c, sep.u.arr->v[1].u.s.p, sep.u.arr->v[1].u.s.n);
            if (strlen(o.item_sep) != sep.u.arr->v[0].u.s.n ||
                strlen(o.key_sep) != sep.u.arr->v[1].u.s.n)
                jfail(rt->c, KVD_EUNSUPPORTED, line, "a separator holding NUL");
        } else if (sep.t != JV_UNDEF && sep.t != JV_NULL) {
            jfail(rt->c, KVD_EBADREQ, line, "if set, separators must be a tuple of two strings");
        }
        struct jbuf b = {0};
        jv_to_json(rt, line, v, &o, 0, &b);
        return sbuf_val(&b);
    }
    if (!strcmp(n, "join")) {
        if (v.t != JV_STR && v.t != JV_ARRAY && v.t != JV_TUPLE)
            unsupported(rt, line, "filter", n, v);
        struct jval sep = np > 0 ? a[0] : kwarg(a, na, "separator");
        if (sep.t == JV_UNDEF)
            sep = jv_str("", 0);
        if (sep.t != JV_STR)
            jfail(rt->c, KVD_EBADREQ, line, "separator must be a string");
        struct jbuf b = {0};
        if (v.t == JV_STR) {
            size_t i = 0;
            bool first = true;
            while (i < v.u.s.n) {
                size_t j = i;
                u8_next(v.u.s.p, v.u.s.n, &j);
                if (!first)
                    jbuf_put(rt, &b, sep.u.s.p, sep.u.s.n);
                jbuf_put(rt, &b, v.u.s.p + i, j - i);
                first = false;
                i = j;
            }
        } else {
            join_values(rt, line, v.u.arr, sep, &b);
        }
        return sbuf_val(&b);
    }
    if (!strcmp(n, "int") || !strcmp(n, "float")) {
        bool in = n[0] == 'i';
        struct jval def = np > 0 ? a[0] : kwarg(a, na, "default");
        if (def.t == JV_UNDEF)
            def = in ? jv_int(0) : jv_float(0);
        if (v.t == JV_STR) {
            double x = js_parse_num(v, in);
            return isnan(x) ? def : in ? jv_int(x) : jv_float(x);
        }
        if (v.t == JV_INT || v.t == JV_FLOAT)
            return in ? jv_int(trunc(v.u.num) + 0.0) : jv_float(v.u.num);
        if (v.t == JV_BOOL)
            return in ? jv_int(v.u.b) : jv_float(v.u.b);
        unsupported(rt, line, "filter", n, v);
    }
    if (!strcmp(n, "default")) {
        struct jval def = np > 0 ? a[0] : jv_str("", 0);
        struct jval boolean = np > 1 ? a[1] : kwarg(a, na, "boolean");
        if (boolean.t == JV_UNDEF)
            boolean = jv_bool(false);
        if (boolean.t != JV_BOOL)
            jfail(rt->c, KVD_EBADREQ, line, "`default` filter flag must be a boolean");
        if (v.t == JV_UNDEF || (boolean.u.b && !jv_truthy(v)))
            return def;
        return v;
    }
    if (v.t == JV_ARRAY || v.t == JV_TUPLE) {
        struct jlist *l = v.u.arr;
        if (!strcmp(n, "selectattr") || !strcmp(n, "rejectattr")) {
            bool sel = n[0] == 's';
            for (size_t i = 0; i < l->n; i++)
                if (l->v[i].t != JV_OBJECT && l->v[i].t != JV_NS && l->v[i].t != JV_KWARGS)
                    jfail(rt->c, KVD_EBADREQ, line, "`%s` can only be applied to array of objects",
                          n);
            for (size_t i = 0; i < f->nlist; i++)
                if (f->list[i]->kind != JN_STR)
                    jfail(rt->c, KVD_EBADREQ, line, "arguments of `%s` must be strings", n);
            if (na < 1)
                jfail(rt->c, KVD_EBADREQ, line, "`%s` needs an attribute name", n);
            struct jnode tn = {.kind = JN_TEST, .line = line};
            if (na > 1)
                tn.s = jstrdup(rt->c, a[1].u.s.p, a[1].u.s.n);
            struct jlist *r = jlist_new(rt->c, 0);
            for (size_t i = 0; i < l->n; i++) {
                struct jval *x = jmap_get(l->v[i].u.map, a[0].u.s.p, a[0].u.s.n);
                bool ok = false;
                if (x) {
                    if (na < 2)
                        ok = jv_truthy(*x);
                    else if (!strcmp(tn.s, "equalto") || !strcmp(tn.s, "eq"))
                        ok =
                            na > 2
                                ? jv_strict_eq(*x, a[2])
                                : (jfail(rt->c, KVD_EBADREQ, line, "test '%s' needs a value", tn.s),
                                   false);
                    else
                        ok = jinja_test(rt, &tn, *x);
                }
                if (ok == sel)
                    jlist_push(rt->c, r, l->v[i]);
            }
            return jv_array(r);
        }
        if (!strcmp(n, "map")) {
            struct jval attr = kwarg(a, na, "attribute");
            if (attr.t == JV_UNDEF)
                jfail(rt->c, KVD_EUNSUPPORTED, line, "`map` without `attribute` is not supported");
            if (attr.t != JV_STR)
                jfail(rt->c, KVD_EBADREQ, line, "attribute must be a string");
            struct jval def = kwarg(a, na, "default");
            bool has_def =
                na && a[na - 1].t == JV_KWARGS && jmap_get(a[na - 1].u.map, "default", 7) != NULL;
            struct jlist *r = jlist_new(rt->c, l->n);
            for (size_t i = 0; i < l->n; i++) {
                if (l->v[i].t != JV_OBJECT && l->v[i].t != JV_NS && l->v[i].t != JV_KWARGS)
                    jfail(rt->c, KVD_EBADREQ, line, "items in map must be an object");
                struct jval x = attr_path(l->v[i], attr);
                jlist_push(rt->c, r, x.t == JV_UNDEF && has_def ? def : x);
            }
            return jv_array(r);
        }
    } else if (v.t == JV_STR) {
        if (!strcmp(n, "indent")) {
            struct jval w = np > 0 ? a[0] : kwarg(a, na, "width");
            struct jval first = np > 1 ? a[1] : kwarg(a, na, "first");
            struct jval blank = np > 2 ? a[2] : kwarg(a, na, "blank");
            struct jbuf ind = {0};
            if (w.t == JV_UNDEF)
                w = jv_int(4);
            if (w.t == JV_STR) {
                jbuf_put(rt, &ind, w.u.s.p, w.u.s.n);
            } else if (w.t == JV_INT) {
                for (double k = 0; k < w.u.num && k < 1024; k++)
                    jbuf_put(rt, &ind, " ", 1);
            } else {
                jfail(rt->c, KVD_EBADREQ, line, "width must be an integer or a string");
            }
            bool fi = jv_truthy(first), bl = jv_truthy(blank);
            struct jbuf b = {0};
            const char *p = v.u.s.p, *end = p + v.u.s.n;
            bool firstl = true;
            for (;;) {
                const char *nl = memchr(p, '\n', (size_t)(end - p));
                size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
                if (!((!fi && firstl) || (!bl && len == 0)))
                    jbuf_put(rt, &b, ind.p ? ind.p : "", ind.n);
                jbuf_put(rt, &b, p, len);
                if (!nl)
                    break;
                jbuf_put(rt, &b, "\n", 1);
                p = nl + 1;
                firstl = false;
            }
            return sbuf_val(&b);
        }
        if (!strcmp(n, "replace"))
            return str_replace(rt, line, v, a, na);
    } else if (v.t == JV_OBJECT || v.t == JV_KWARGS) {
        struct jval m = builtin_of(rt, v, jv_str(n, f->n));
        if (m.t == JV_FUNC)
            return jinja_call_builtin(rt, line, m.u.fn, a, na);
    }
    unsupported(rt, line, "filter", n, v);
}

struct jval jinja_filter(struct jrt *rt, const struct jnode *f, struct jval v, struct jenv *env)
{
    if (!strcmp(f->s, "safe"))
        return v;
    if (!f->flag && !strcmp(f->s, "tojson")) {
        struct json_opts o = {.undef_as_null = true};
        struct jbuf b = {0};
        jv_to_json(rt, f->line, v, &o, 0, &b);
        return sbuf_val(&b);
    }
    if (!f->flag && !strcmp(f->s, "sort"))
        jfail(rt->c, KVD_EUNSUPPORTED, f->line, "filter 'sort' is not supported");
    if (!f->flag && (v.t == JV_OBJECT || v.t == JV_KWARGS) && !strcmp(f->s, "dictsort"))
        jfail(rt->c, KVD_EUNSUPPORTED, f->line, "filter 'dictsort' is not supported");
    return f->flag ? filter_call(rt, f, v, env) : filter_plain(rt, f, v);
}

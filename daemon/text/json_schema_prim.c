/* The JSON Schema converter's primitives (json_schema_impl.h): growing
 * strings, repetitions past the grammar's bound, integer ranges, string
 * formats, and ECMAScript patterns translated into GBNF over JSON string
 * text (a character the pattern allows becomes its raw UTF-8 or its JSON
 * escape, so the string stays valid JSON and means what the pattern
 * matches). */
#include "json_schema_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

/* ---- strings --------------------------------------------------------------- */

void sb_add(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom || n == 0)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

void sb_puts(struct sbuf *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true;
        return;
    }
    if ((size_t)n < sizeof buf) {
        sb_add(b, buf, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_add(b, big, (size_t)n);
    free(big);
}

void sb_free(struct sbuf *b)
{
    free(b->s);
    memset(b, 0, sizeof *b);
}

void sb_lit(struct sbuf *b, const char *s, size_t n)
{
    sb_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            char e[2] = {'\\', (char)ch};
            sb_add(b, e, 2);
        } else if (ch == '\n') {
            sb_add(b, "\\n", 2);
        } else if (ch == '\r') {
            sb_add(b, "\\r", 2);
        } else if (ch == '\t') {
            sb_add(b, "\\t", 2);
        } else if (ch < 0x20 || ch == 0x7f) {
            sb_printf(b, "\\x%02X", ch);
        } else {
            sb_add(b, (const char *)&ch, 1);
        }
    }
    sb_add(b, "\"", 1);
}

/* ---- repetitions ------------------------------------------------------------ */

#define REP_BLOCK 1000u

/* item{min,max} within the grammar's bound (max UINT64_MAX: unbounded). */
static void rep_small(struct sbuf *b, const char *item, uint64_t min, uint64_t max)
{
    if (max == 0) {
        sb_puts(b, "\"\"");
    } else if (min == 0 && max == 1) {
        sb_printf(b, "%s?", item);
    } else if (max == UINT64_MAX) {
        if (min <= 1)
            sb_printf(b, "%s%s", item, min ? "+" : "*");
        else
            sb_printf(b, "%s{%llu,}", item, (unsigned long long)min);
    } else if (min == max) {
        if (min == 1)
            sb_puts(b, item);
        else
            sb_printf(b, "%s{%llu}", item, (unsigned long long)min);
    } else {
        sb_printf(b, "%s{%llu,%llu}", item, (unsigned long long)min, (unsigned long long)max);
    }
}

void js_rep(struct sbuf *b, const char *item, uint64_t min, uint64_t max)
{
    const uint64_t R = GRAMMAR_MAX_REPETITIONS;
    if ((max == UINT64_MAX || max <= R) && min <= R) {
        rep_small(b, item, min, max);
        return;
    }
    sb_puts(b, "(");
    char block[256];
    snprintf(block, sizeof block, "(%s{%u})", item, REP_BLOCK);
    if (strlen(item) > sizeof block - 16) {
        b->oom = true; /* items are rule names or short groups */
        return;
    }
    if (min > R) { /* min = q blocks + the rest */
        uint64_t q = min / REP_BLOCK;
        rep_small(b, block, q, q);
        sb_puts(b, " ");
        min -= q * REP_BLOCK;
        if (max != UINT64_MAX)
            max -= q * REP_BLOCK;
    }
    if (max == UINT64_MAX || max <= R) {
        rep_small(b, item, min, max);
    } else {
        if (min) {
            rep_small(b, item, min, min);
            sb_puts(b, " ");
        }
        uint64_t n = max - min; /* item{0,n}: fewer than q blocks and a partial one, or q and r */
        if (n <= R) {
            rep_small(b, item, 0, n);
        } else {
            uint64_t q = n / REP_BLOCK, r = n % REP_BLOCK;
            sb_puts(b, "(");
            if (q > 1) {
                rep_small(b, block, 0, q - 1);
                sb_puts(b, " ");
            }
            rep_small(b, item, 0, REP_BLOCK - 1);
            sb_puts(b, " | ");
            rep_small(b, block, q, q);
            if (r) {
                sb_puts(b, " ");
                rep_small(b, item, 0, r);
            }
            sb_puts(b, ")");
        }
    }
    sb_puts(b, ")");
}

/* ---- integer ranges ----------------------------------------------------------- */

/* The d-digit numbers from lo to hi (strings of n digits, lo <= hi). */
static void range_fixed(struct sbuf *b, const char *lo, const char *hi, size_t n)
{
    if (n == 1) {
        if (lo[0] == hi[0])
            sb_printf(b, "[%c]", lo[0]);
        else
            sb_printf(b, "[%c-%c]", lo[0], hi[0]);
        return;
    }
    if (lo[0] == hi[0]) {
        sb_printf(b, "\"%c\" ", lo[0]);
        range_fixed(b, lo + 1, hi + 1, n - 1);
        return;
    }
    bool lo_zeros = strspn(lo + 1, "0") == n - 1, hi_nines = strspn(hi + 1, "9") == n - 1;
    char first = lo_zeros ? lo[0] : (char)(lo[0] + 1), last = hi_nines ? hi[0] : (char)(hi[0] - 1);
    char nines[20], zeros[20];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    nines[n - 1] = zeros[n - 1] = '\0';
    bool any = false;
    sb_puts(b, "(");
    if (!lo_zeros) {
        sb_printf(b, "\"%c\" (", lo[0]);
        range_fixed(b, lo + 1, nines, n - 1);
        sb_puts(b, ")");
        any = true;
    }
    if (first <= last) {
        sb_puts(b, any ? " | " : "");
        if (first == last)
            sb_printf(b, "[%c]", first);
        else
            sb_printf(b, "[%c-%c]", first, last);
        sb_printf(b, " [0-9]{%zu}", n - 1);
        any = true;
    }
    if (!hi_nines) {
        sb_puts(b, any ? " | " : "");
        sb_printf(b, "\"%c\" (", hi[0]);
        range_fixed(b, zeros, hi + 1, n - 1);
        sb_puts(b, ")");
    }
    sb_puts(b, ")");
}

/* 0 <= lo <= hi < 10^18. */
static void range_nonneg(struct sbuf *b, int64_t lo, int64_t hi)
{
    char ls[24], hs[24];
    int dl = snprintf(ls, sizeof ls, "%lld", (long long)lo);
    int dh = snprintf(hs, sizeof hs, "%lld", (long long)hi);
    bool first = true;
    sb_puts(b, "(");
    for (int d = dl; d <= dh; d++) {
        char a[24], z[24];
        if (d == dl) {
            memcpy(a, ls, (size_t)dl + 1);
        } else {
            a[0] = '1';
            memset(a + 1, '0', (size_t)d - 1);
            a[d] = '\0';
        }
        if (d == dh) {
            memcpy(z, hs, (size_t)dh + 1);
        } else {
            memset(z, '9', (size_t)d);
            z[d] = '\0';
        }
        sb_puts(b, first ? "" : " | ");
        first = false;
        range_fixed(b, a, z, (size_t)d);
    }
    sb_puts(b, ")");
}

void js_int_range(struct sbuf *b, int64_t lo, int64_t hi)
{
    sb_puts(b, "(");
    if (lo < 0) {
        sb_puts(b, "\"-\" ");
        range_nonneg(b, hi < 0 ? -hi : 1, -lo);
    }
    if (hi >= 0) {
        sb_puts(b, lo < 0 ? " | " : "");
        range_nonneg(b, lo > 0 ? lo : 0, hi);
    }
    sb_puts(b, ")");
}

/* ---- formats ---------------------------------------------------------------- */

const char *js_format(struct json_schema_conv *c, const char *format, const char *hint)
{
    static const char *const names[][2] = {
        {"date", "json-date"},
        {"time", "json-time"},
        {"date-time", "json-date-time"},
        {"uuid", "json-uuid"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(format, names[i][0]))
            continue;
        const char *r = js_builtin(c, names[i][1]);
        if (!r)
            return NULL;
        char body[64];
        snprintf(body, sizeof body, "\"\\\"\" %s \"\\\"\"", r);
        return js_rule(c, hint, body);
    }
    return js_fail(c, KVD_EBADREQ, "format",
                   "format '%.40s' is not supported (kvd generates date, time, date-time and "
                   "uuid)",
                   format);
}

/* ---- patterns ------------------------------------------------------------- */

/* A set of code points: sorted, merged ranges. */
struct cset {
    uint32_t (*r)[2];
    size_t n, cap;
    bool oom;
};

static void cs_add(struct cset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        uint32_t(*r)[2] = realloc(s->r, cap * sizeof *r);
        if (!r) {
            s->oom = true;
            return;
        }
        s->r = r;
        s->cap = cap;
    }
    s->r[s->n][0] = lo;
    s->r[s->n][1] = hi;
    s->n++;
}

static int cs_cmp(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

static void cs_norm(struct cset *s)
{
    if (s->n < 2)
        return;
    qsort(s->r, s->n, sizeof *s->r, cs_cmp);
    size_t k = 0;
    for (size_t i = 1; i < s->n; i++) {
        if (s->r[i][0] <= s->r[k][1] + 1) {
            if (s->r[i][1] > s->r[k][1])
                s->r[k][1] = s->r[i][1];
        } else {
            s->r[++k][0] = s->r[i][0];
            s->r[k][1] = s->r[i][1];
        }
    }
    s->n = k + 1;
}

/* The complement over every code point, in place. */
static void cs_negate(struct cset *s)
{
    cs_norm(s);
    struct cset o = {0};
    uint32_t at = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[i][0] > at)
            cs_add(&o, at, s->r[i][0] - 1);
        at = s->r[i][1] + 1;
    }
    if (at <= 0x10FFFF)
        cs_add(&o, at, 0x10FFFF);
    o.oom |= s->oom;
    free(s->r);
    *s = o;
}

static bool cs_has(const struct cset *s, uint32_t c)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->r[i][0] <= c && c <= s->r[i][1])
            return true;
    return false;
}

void js_class_char(struct sbuf *b, uint32_t c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        sb_printf(b, "%c", (char)c);
    else if (c < 0x100)
        sb_printf(b, "\\x%02X", c);
    else if (c < 0x10000)
        sb_printf(b, "\\u%04X", c);
    else
        sb_printf(b, "\\U%08X", c);
}

static void class_range(struct sbuf *b, uint32_t lo, uint32_t hi)
{
    js_class_char(b, lo);
    if (hi > lo) {
        sb_puts(b, "-");
        js_class_char(b, hi);
    }
}

/* The JSON string text of one character of s: raw where JSON allows it,
 * escaped otherwise. Characters JSON cannot carry (U+0000, surrogates) are
 * left out. False when nothing is left. */
static bool cs_encode(struct sbuf *b, struct cset *s)
{
    cs_norm(s);
    struct sbuf raw = {0};
    size_t alts = 0;
    struct sbuf out = {0};
    static const uint32_t cut[][2] = {
        {0, 0x1F}, {0x22, 0x22}, {0x5C, 0x5C}, {0x7F, 0x7F}, {0xD800, 0xDFFF}};
    for (size_t i = 0; i < s->n; i++) {
        /* [lo, hi] less the characters JSON needs escaped */
        uint32_t a = s->r[i][0], hi = s->r[i][1];
        for (size_t k = 0; k < sizeof cut / sizeof cut[0] && a <= hi; k++) {
            if (cut[k][1] < a)
                continue;
            if (cut[k][0] > hi)
                break;
            if (cut[k][0] > a)
                class_range(&raw, a, cut[k][0] - 1);
            a = cut[k][1] + 1;
        }
        if (a <= hi)
            class_range(&raw, a, hi);
    }
    if (raw.n) {
        sb_printf(&out, "[%s]", raw.s);
        alts++;
    }
    static const struct {
        uint32_t c;
        const char *lit;
    } esc[] = {{'"', "\"\\\\\\\"\""}, {'\\', "\"\\\\\\\\\""}, {8, "\"\\\\b\""}, {9, "\"\\\\t\""},
               {10, "\"\\\\n\""},     {12, "\"\\\\f\""},      {13, "\"\\\\r\""}};
    for (size_t k = 0; k < sizeof esc / sizeof esc[0]; k++)
        if (cs_has(s, esc[k].c)) {
            sb_printf(&out, "%s%s", alts ? " | " : "", esc[k].lit);
            alts++;
        }
    for (uint32_t ch = 1; ch <= 0x7F; ch = ch == 0x1F ? 0x7F : ch + 1) {
        if (ch == 8 || ch == 9 || ch == 10 || ch == 12 || ch == 13 || !cs_has(s, ch))
            continue;
        sb_printf(&out, "%s\"\\\\u00%02x\"", alts ? " | " : "", ch);
        alts++;
    }
    bool ok = alts > 0;
    if (alts > 1)
        sb_printf(b, "(%s)", out.s);
    else if (alts == 1)
        sb_puts(b, out.s);
    b->oom |= raw.oom || out.oom || s->oom;
    sb_free(&raw);
    sb_free(&out);
    return ok;
}

struct rx {
    struct json_schema_conv *c;
    const char *start, *p, *end;
    int depth;
    bool top_alt; /* a '|' at the top level */
};

static bool rx_fail(struct rx *x, const char *what)
{
    js_fail(x->c, KVD_EBADREQ, "pattern",
            "pattern: %s at byte %zu (kvd translates patterns exactly or not at all)", what,
            (size_t)(x->p - x->start));
    return false;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static bool rx_hex(struct rx *x, int n, uint32_t *v)
{
    *v = 0;
    for (int i = 0; i < n; i++) {
        if (x->p >= x->end || hexval(*x->p) < 0)
            return rx_fail(x, "a bad hexadecimal escape");
        *v = *v * 16 + (uint32_t)hexval(*x->p++);
    }
    return true;
}

/* One UTF-8 character of the pattern. */
static bool rx_utf8(struct rx *x, uint32_t *cp)
{
    const unsigned char *p = (const unsigned char *)x->p;
    size_t left = (size_t)(x->end - x->p);
    int len = p[0] < 0x80 ? 1 : p[0] >> 5 == 6 ? 2 : p[0] >> 4 == 14 ? 3 : p[0] >> 3 == 30 ? 4 : 0;
    if (!len || (size_t)len > left)
        return rx_fail(x, "invalid UTF-8");
    uint32_t v = len == 1 ? p[0] : p[0] & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return rx_fail(x, "invalid UTF-8");
        v = (v << 6) | (p[i] & 0x3F);
    }
    x->p += len;
    *cp = v;
    return true;
}

/* \d \w \s and their negations into s; false when `e` is not one. */
static bool class_escape(char e, struct cset *s)
{
    struct cset t = {0};
    switch (e | 0x20) {
    case 'd':
        cs_add(&t, '0', '9');
        break;
    case 'w':
        cs_add(&t, '0', '9');
        cs_add(&t, 'A', 'Z');
        cs_add(&t, '_', '_');
        cs_add(&t, 'a', 'z');
        break;
    case 's': {
        static const uint32_t ws[][2] = {{9, 13},          {0x20, 0x20},     {0xA0, 0xA0},
                                         {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029},
                                         {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
                                         {0xFEFF, 0xFEFF}};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            cs_add(&t, ws[i][0], ws[i][1]);
        break;
    }
    default:
        return false;
    }
    if (e >= 'A' && e <= 'Z')
        cs_negate(&t);
    for (size_t i = 0; i < t.n; i++)
        cs_add(s, t.r[i][0], t.r[i][1]);
    s->oom |= t.oom;
    free(t.r);
    return true;
}

/* After a backslash: one character (not a class escape) into *cp. */
static bool rx_char_escape(struct rx *x, bool in_class, uint32_t *cp)
{
    if (x->p >= x->end)
        return rx_fail(x, "a pattern ending in a backslash");
    char e = *x->p++;
    switch (e) {
    case 'n':
        *cp = '\n';
        return true;
    case 'r':
        *cp = '\r';
        return true;
    case 't':
        *cp = '\t';
        return true;
    case 'f':
        *cp = '\f';
        return true;
    case 'v':
        *cp = '\v';
        return true;
    case '0':
        if (x->p < x->end && *x->p >= '0' && *x->p <= '9')
            return rx_fail(x, "an octal escape");
        *cp = 0;
        return true;
    case 'x':
        return rx_hex(x, 2, cp);
    case 'u': {
        if (!rx_hex(x, 4, cp))
            return false;
        if (*cp >= 0xDC00 && *cp <= 0xDFFF)
            return rx_fail(x, "a lone surrogate escape");
        if (*cp >= 0xD800 && *cp <= 0xDBFF) {
            uint32_t lo;
            if (x->end - x->p < 6 || x->p[0] != '\\' || x->p[1] != 'u')
                return rx_fail(x, "a lone surrogate escape");
            x->p += 2;
            if (!rx_hex(x, 4, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                return rx_fail(x, "a lone surrogate escape");
            *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        return true;
    }
    case 'b':
        if (in_class) {
            *cp = 8;
            return true;
        }
        return rx_fail(x, "a word boundary (\\b)");
    default:
        break;
    }
    if ((e >= '1' && e <= '9') || e == 'k')
        return rx_fail(x, "a backreference");
    if (e == 'p' || e == 'P')
        return rx_fail(x, "a Unicode property escape");
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (unsigned char)e >= 0x80)
        return rx_fail(x, "an escape kvd does not know");
    *cp = (unsigned char)e; /* an escaped punctuation character stands for itself */
    return true;
}

/* [...] after the '['. */
static bool rx_class(struct rx *x, struct cset *s)
{
    bool neg = x->p < x->end && *x->p == '^';
    if (neg)
        x->p++;
    bool first = true;
    while (x->p < x->end && (*x->p != ']' || first)) {
        first = false;
        uint32_t lo, hi;
        if (*x->p == '\\') {
            x->p++;
            if (x->p < x->end && class_escape(*x->p, s)) {
                x->p++;
                if (x->p + 1 < x->end && *x->p == '-' && x->p[1] != ']')
                    return rx_fail(x, "a range from a class escape");
                continue;
            }
            if (!rx_char_escape(x, true, &lo))
                return false;
        } else if (!rx_utf8(x, &lo)) {
            return false;
        }
        hi = lo;
        if (x->p + 1 < x->end && *x->p == '-' && x->p[1] != ']') {
            x->p++;
            if (*x->p == '\\') {
                x->p++;
                if (x->p < x->end && class_escape(*x->p, s))
                    return rx_fail(x, "a range to a class escape");
                if (!rx_char_escape(x, true, &hi))
                    return false;
            } else if (!rx_utf8(x, &hi)) {
                return false;
            }
            if (hi < lo)
                return rx_fail(x, "a range out of order");
        }
        cs_add(s, lo, hi);
    }
    if (x->p >= x->end)
        return rx_fail(x, "an unclosed '['");
    x->p++;
    if (neg)
        cs_negate(s);
    return true;
}

static bool rx_alt(struct rx *x, struct sbuf *out);

/* A count of a quantifier. */
static bool rx_count(struct rx *x, uint64_t *v)
{
    if (x->p >= x->end || *x->p < '0' || *x->p > '9')
        return rx_fail(x, "a bad quantifier");
    *v = 0;
    while (x->p < x->end && *x->p >= '0' && *x->p <= '9') {
        *v = *v * 10 + (uint64_t)(*x->p++ - '0');
        if (*v > JSON_SCHEMA_MAX_COUNT)
            return rx_fail(x, "a repetition count over 100000");
    }
    return true;
}

/* One atom (with its quantifier) appended to out. */
static bool rx_atom(struct rx *x, struct sbuf *out)
{
    struct sbuf a = {0};
    struct cset s = {0};
    bool ok = true, is_set = false;
    char ch = *x->p;
    if (ch == '(') {
        x->p++;
        if (x->p < x->end && *x->p == '?') {
            if (x->end - x->p >= 2 && x->p[1] == ':') {
                x->p += 2;
            } else if (x->end - x->p >= 3 && x->p[1] == '<' && x->p[2] != '=' && x->p[2] != '!') {
                const char *gt = memchr(x->p, '>', (size_t)(x->end - x->p));
                if (!gt)
                    return rx_fail(x, "a bad group name");
                x->p = gt + 1;
            } else {
                return rx_fail(x, "a lookaround or group flag");
            }
        }
        if (++x->depth > 32)
            return rx_fail(x, "groups nested over 32 deep");
        struct sbuf in = {0};
        ok = rx_alt(x, &in);
        x->depth--;
        if (ok && (x->p >= x->end || *x->p != ')'))
            ok = rx_fail(x, "an unclosed '('");
        if (ok) {
            x->p++;
            sb_printf(&a, "(%s)", in.s ? in.s : "\"\"");
        }
        a.oom |= in.oom;
        sb_free(&in);
    } else if (ch == '[') {
        x->p++;
        ok = rx_class(x, &s);
        is_set = true;
    } else if (ch == '.') {
        x->p++;
        cs_add(&s, '\n', '\n');
        cs_add(&s, '\r', '\r');
        cs_add(&s, 0x2028, 0x2029);
        cs_negate(&s);
        is_set = true;
    } else if (ch == '\\') {
        x->p++;
        if (x->p < x->end && class_escape(*x->p, &s)) {
            x->p++;
        } else {
            uint32_t cp;
            ok = rx_char_escape(x, false, &cp);
            cs_add(&s, cp, cp);
        }
        is_set = true;
    } else if (ch == '^' || ch == '$') {
        ok = rx_fail(x, "an anchor inside the pattern");
    } else if (ch == '*' || ch == '+' || ch == '?' || ch == '{') {
        ok = rx_fail(x, "a quantifier with nothing to repeat");
    } else {
        uint32_t cp;
        ok = rx_utf8(x, &cp);
        cs_add(&s, cp, cp);
        is_set = true;
    }
    if (ok && is_set && !cs_encode(&a, &s))
        ok = rx_fail(x, "a character class with no character a JSON string can hold");
    free(s.r);
    /* the quantifier */
    uint64_t min = 1, max = 1;
    if (ok && x->p < x->end) {
        char q = *x->p;
        if (q == '*' || q == '+' || q == '?') {
            x->p++;
            min = q == '+';
            max = q == '?' ? 1 : UINT64_MAX;
        } else if (q == '{') {
            x->p++;
            ok = rx_count(x, &min);
            max = min;
            if (ok && x->p < x->end && *x->p == ',') {
                x->p++;
                max = UINT64_MAX;
                if (x->p < x->end && *x->p != '}')
                    ok = rx_count(x, &max);
            }
            if (ok && (x->p >= x->end || *x->p != '}'))
                ok = rx_fail(x, "a bad quantifier");
            if (ok)
                x->p++;
            if (ok && max < min)
                ok = rx_fail(x, "a quantifier {n,m} with m < n");
        }
        if (ok && x->p < x->end && (min != 1 || max != 1) && *x->p == '?')
            x->p++; /* lazy: the same strings */
        if (ok && x->p < x->end && (*x->p == '*' || *x->p == '+' || *x->p == '?' || *x->p == '{') &&
            (min != 1 || max != 1))
            ok = rx_fail(x, "a quantifier after a quantifier");
    }
    if (ok) {
        if (min == 1 && max == 1) {
            sb_add(out, a.s, a.n);
        } else {
            /* a repeated item: its own group, so the quantifier binds to it */
            struct sbuf g = {0};
            sb_printf(&g, "(%s)", a.s);
            if (g.n > 200) { /* js_rep takes short items: a rule for a long one */
                const char *r = js_rule(x->c, "json-pattern-part", a.s);
                sb_free(&g);
                if (!r)
                    ok = false;
                else
                    sb_puts(&g, r);
            }
            if (ok)
                js_rep(out, g.s, min, max);
            sb_free(&g);
        }
    }
    out->oom |= a.oom;
    sb_free(&a);
    return ok;
}

/* A sequence up to '|', ')' or the end. */
static bool rx_seq(struct rx *x, struct sbuf *out)
{
    bool any = false;
    while (x->p < x->end && *x->p != '|' && *x->p != ')') {
        if (x->depth == 0 && *x->p == '$' && x->p + 1 == x->end)
            break; /* the end anchor, handled by js_pattern */
        if (any)
            sb_puts(out, " ");
        if (!rx_atom(x, out))
            return false;
        any = true;
    }
    if (!any)
        sb_puts(out, "\"\"");
    return true;
}

static bool rx_alt(struct rx *x, struct sbuf *out)
{
    if (!rx_seq(x, out))
        return false;
    while (x->p < x->end && *x->p == '|') {
        if (x->depth == 0)
            x->top_alt = true;
        x->p++;
        sb_puts(out, " | ");
        if (!rx_seq(x, out))
            return false;
    }
    return true;
}

const char *js_pattern(struct json_schema_conv *c, const char *pattern, size_t len,
                       const char *hint)
{
    if (len > JSON_SCHEMA_MAX_PATTERN)
        return js_fail(c, KVD_ETOOLARGE, "pattern", "pattern: %zu bytes, at most %d", len,
                       JSON_SCHEMA_MAX_PATTERN);
    struct rx x = {.c = c, .start = pattern, .p = pattern, .end = pattern + len};
    bool start = len && pattern[0] == '^';
    if (start)
        x.p++;
    struct sbuf body = {0};
    bool ok = rx_alt(&x, &body);
    bool end = false;
    if (ok && x.p < x.end && *x.p == '$' && x.p + 1 == x.end) {
        end = true;
        x.p++;
    }
    if (ok && x.p < x.end)
        ok = rx_fail(&x, *x.p == ')' ? "an unmatched ')'" : "an unexpected character");
    if (ok && x.top_alt && (start || end))
        ok = rx_fail(&x, "anchors with a '|' at the top level (group the alternatives)");
    const char *rule = NULL;
    if (ok) {
        const char *any = js_builtin(c, "json-char");
        struct sbuf r = {0};
        sb_puts(&r, "\"\\\"\" ");
        if (!start)
            sb_printf(&r, "%s* ", any);
        sb_printf(&r, "(%s)", body.s);
        if (!end)
            sb_printf(&r, " %s*", any);
        sb_puts(&r, " \"\\\"\"");
        if (r.oom || body.oom)
            js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        else if (any)
            rule = js_rule(c, hint, r.s);
        sb_free(&r);
    }
    sb_free(&body);
    return rule;
}

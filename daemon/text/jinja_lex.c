/* Jinja lexer: the reference renderer's preprocessing (one trailing newline
 * dropped, lstrip_blocks, trim_blocks, the transformers `generation` tag
 * removed) and its tokenizer, over UTF-8 with JavaScript's idea of
 * whitespace. Line numbers are those of the template as given. */
#include "jinja.h"

#include <string.h>

#include "kvd/status.h"

/* Preprocessed text with the source line of every byte. */
struct pp {
    char *t;
    int *ln;
    size_t n, cap;
};

static void pp_put(struct jctx *c, struct pp *p, char ch, int line)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 256;
        char *t = jalloc(c, cap + 1);
        int *ln = jalloc(c, (cap + 1) * sizeof(int));
        if (p->n) {
            memcpy(t, p->t, p->n);
            memcpy(ln, p->ln, p->n * sizeof(int));
        }
        p->t = t;
        p->ln = ln;
        p->cap = cap;
    }
    p->t[p->n] = ch;
    p->ln[p->n] = line;
    p->n++;
    p->t[p->n] = 0;
}

static bool is_word(unsigned char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
}

static bool is_digit(unsigned char ch)
{
    return ch >= '0' && ch <= '9';
}

/* Length of the JavaScript whitespace character at s[i], 0 if none. */
static size_t space_at(const char *s, size_t n, size_t i)
{
    if (i >= n)
        return 0;
    size_t j = i;
    uint32_t cp = u8_next(s, n, &j);
    return js_is_space(cp) ? j - i : 0;
}

/* Length of the JavaScript whitespace character ending at s[i-1], 0 if none. */
static size_t space_before(const char *s, size_t i)
{
    if (i == 0)
        return 0;
    size_t k = i - 1;
    while (k > 0 && i - k < 4 && ((unsigned char)s[k] & 0xC0) == 0x80)
        k--;
    size_t j = k;
    uint32_t cp = u8_next(s, i, &j);
    return (j == i && js_is_space(cp)) ? i - k : 0;
}

/* Is position i of text at the start of a line (JavaScript's multiline ^)? */
static bool line_start(const struct pp *p, size_t i)
{
    if (i == 0)
        return true;
    char c = p->t[i - 1];
    if (c == '\n' || c == '\r')
        return true;
    return i >= 3 && (unsigned char)p->t[i - 3] == 0xE2 && (unsigned char)p->t[i - 2] == 0x80 &&
           ((unsigned char)c == 0xA8 || (unsigned char)c == 0xA9);
}

/* Matches {%-? \s* (end)?generation \s* -?%} at i; returns the end of the
 * tag (before the trailing whitespace) or 0. */
static size_t generation_tag(const struct pp *p, size_t i, bool *lstrip, bool *rstrip)
{
    const char *t = p->t;
    size_t n = p->n, j = i + 2, k;
    if (j > n || t[i] != '{' || t[i + 1] != '%')
        return 0;
    *lstrip = j < n && t[j] == '-';
    if (*lstrip)
        j++;
    while ((k = space_at(t, n, j)))
        j += k;
    if (n - j >= 3 && memcmp(t + j, "end", 3) == 0 && n - j >= 13 &&
        memcmp(t + j + 3, "generation", 10) == 0)
        j += 3;
    if (n - j < 10 || memcmp(t + j, "generation", 10) != 0)
        return 0;
    j += 10;
    while ((k = space_at(t, n, j)))
        j += k;
    *rstrip = j < n && t[j] == '-';
    if (*rstrip)
        j++;
    if (n - j < 2 || t[j] != '%' || t[j + 1] != '}')
        return 0;
    return j + 2;
}

static void preprocess(struct jctx *c, const char *src, size_t len, struct pp *out)
{
    struct pp a = {0}, b = {0};
    int line = 1;
    if (len && src[len - 1] == '\n')
        len--;
    /* lstrip_blocks: spaces and tabs from a line start to {# {% {- */
    for (size_t i = 0; i < len;) {
        if (line_start(&a, a.n) && (src[i] == ' ' || src[i] == '\t')) {
            size_t j = i;
            while (j < len && (src[j] == ' ' || src[j] == '\t'))
                j++;
            if (j + 1 < len && src[j] == '{' &&
                (src[j + 1] == '#' || src[j + 1] == '%' || src[j + 1] == '-')) {
                i = j;
                continue;
            }
        }
        pp_put(c, &a, src[i], line);
        if (src[i] == '\n')
            line++;
        i++;
    }
    /* trim_blocks: the newline right after #} %} -} */
    for (size_t i = 0; i < a.n;) {
        if (i + 2 < a.n && (a.t[i] == '#' || a.t[i] == '%' || a.t[i] == '-') && a.t[i + 1] == '}' &&
            a.t[i + 2] == '\n') {
            pp_put(c, &b, a.t[i], a.ln[i]);
            pp_put(c, &b, a.t[i + 1], a.ln[i + 1]);
            i += 3;
            continue;
        }
        pp_put(c, &b, a.t[i], a.ln[i]);
        i++;
    }
    /* {% generation %} / {% endgeneration %} tags vanish */
    size_t last = 0;
    for (size_t i = 0; i + 1 < b.n; i++) {
        bool ls, rs;
        size_t end = generation_tag(&b, i, &ls, &rs);
        if (!end)
            continue;
        size_t stop = i, k;
        while (ls && stop > last && (k = space_before(b.t, stop)))
            stop -= k;
        for (size_t j = last; j < stop; j++)
            pp_put(c, out, b.t[j], b.ln[j]);
        size_t after = end;
        while ((k = space_at(b.t, b.n, after)))
            after += k;
        if (!rs)
            for (size_t j = end; j < after; j++)
                pp_put(c, out, b.t[j], b.ln[j]);
        last = after;
        i = after - 1;
    }
    for (size_t j = last; j < b.n; j++)
        pp_put(c, out, b.t[j], b.ln[j]);
}

struct lexer {
    struct jctx *c;
    struct pp p;
    size_t pos;
    struct jtoken *tok;
    size_t n, cap;
};

static int cur_line(const struct lexer *L)
{
    if (L->p.n == 0)
        return 1;
    return L->p.ln[L->pos < L->p.n ? L->pos : L->p.n - 1];
}

static void push(struct lexer *L, enum jtok type, const char *s, size_t n, int line)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 64;
        struct jtoken *t = jalloc(L->c, cap * sizeof(*t));
        if (L->n)
            memcpy(t, L->tok, L->n * sizeof(*t));
        L->tok = t;
        L->cap = cap;
    }
    L->tok[L->n].type = type;
    L->tok[L->n].s = jstrdup(L->c, s, n);
    L->tok[L->n].n = n;
    L->tok[L->n].line = line;
    L->n++;
}

static _Noreturn void lex_fail(struct lexer *L, const char *msg)
{
    jfail(L->c, KVD_EBADREQ, cur_line(L), "%s", msg);
}

/* The reference's consumeWhile: running into the end of input is an error. */
static size_t consume_digits(struct lexer *L)
{
    size_t start = L->pos;
    while (L->pos < L->p.n && is_digit(L->p.t[L->pos]))
        if (++L->pos >= L->p.n)
            lex_fail(L, "unexpected end of input");
    return L->pos - start;
}

static void consume_space(struct lexer *L)
{
    size_t k;
    while ((k = space_at(L->p.t, L->p.n, L->pos))) {
        L->pos += k;
        if (L->pos >= L->p.n)
            lex_fail(L, "unexpected end of input");
    }
}

static void strip_last_text(struct lexer *L)
{
    if (L->n == 0 || L->tok[L->n - 1].type != JT_TEXT)
        return;
    struct jtoken *t = &L->tok[L->n - 1];
    size_t b, e;
    js_trim(t->s, t->n, false, true, &b, &e);
    t->n = e;
    if (t->n == 0)
        L->n--;
}

static void skip_space(struct lexer *L)
{
    size_t k;
    while ((k = space_at(L->p.t, L->p.n, L->pos)))
        L->pos += k;
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

static void put_utf8(struct jctx *c, struct pp *o, uint32_t cp, int line)
{
    if (cp < 0x80) {
        pp_put(c, o, (char)cp, line);
    } else if (cp < 0x800) {
        pp_put(c, o, (char)(0xC0 | (cp >> 6)), line);
        pp_put(c, o, (char)(0x80 | (cp & 0x3F)), line);
    } else if (cp < 0x10000) {
        pp_put(c, o, (char)(0xE0 | (cp >> 12)), line);
        pp_put(c, o, (char)(0x80 | ((cp >> 6) & 0x3F)), line);
        pp_put(c, o, (char)(0x80 | (cp & 0x3F)), line);
    } else {
        pp_put(c, o, (char)(0xF0 | (cp >> 18)), line);
        pp_put(c, o, (char)(0x80 | ((cp >> 12) & 0x3F)), line);
        pp_put(c, o, (char)(0x80 | ((cp >> 6) & 0x3F)), line);
        pp_put(c, o, (char)(0x80 | (cp & 0x3F)), line);
    }
}

/* A string literal's contents up to the closing quote, escapes resolved. */
static void lex_string(struct lexer *L, char quote)
{
    struct pp o = {0};
    int line = cur_line(L);
    uint32_t pending_hi = 0; /* a \uD800-\uDBFF waiting for its low half */
    for (;;) {
        if (L->pos >= L->p.n)
            lex_fail(L, "unexpected end of input in a string literal");
        char ch = L->p.t[L->pos];
        if (ch == quote)
            break;
        L->pos++;
        if (ch != '\\') {
            if (pending_hi)
                jfail(L->c, KVD_EUNSUPPORTED, line, "a lone surrogate escape is not supported");
            pp_put(L->c, &o, ch, line);
            continue;
        }
        if (L->pos >= L->p.n)
            lex_fail(L, "unexpected end of input in a string literal");
        char e = L->p.t[L->pos++];
        if (e == 'x' || e == 'u') {
            int len = e == 'x' ? 2 : 4;
            uint32_t v = 0;
            for (int k = 0; k < len; k++) {
                int h = L->pos + (size_t)k < L->p.n ? hexval(L->p.t[L->pos + k]) : -1;
                if (h < 0)
                    lex_fail(L, "invalid hexadecimal escape sequence");
                v = v * 16 + (uint32_t)h;
            }
            L->pos += (size_t)len;
            if (pending_hi) {
                if (v < 0xDC00 || v > 0xDFFF)
                    jfail(L->c, KVD_EUNSUPPORTED, line, "a lone surrogate escape is not supported");
                put_utf8(L->c, &o, 0x10000 + ((pending_hi - 0xD800) << 10) + (v - 0xDC00), line);
                pending_hi = 0;
            } else if (v >= 0xD800 && v <= 0xDBFF) {
                pending_hi = v;
            } else if (v >= 0xDC00 && v <= 0xDFFF) {
                jfail(L->c, KVD_EUNSUPPORTED, line, "a lone surrogate escape is not supported");
            } else {
                put_utf8(L->c, &o, v, line);
            }
            continue;
        }
        if (pending_hi)
            jfail(L->c, KVD_EUNSUPPORTED, line, "a lone surrogate escape is not supported");
        char r;
        switch (e) {
        case 'n':
            r = '\n';
            break;
        case 't':
            r = '\t';
            break;
        case 'r':
            r = '\r';
            break;
        case 'b':
            r = '\b';
            break;
        case 'f':
            r = '\f';
            break;
        case 'v':
            r = '\v';
            break;
        case '\'':
            r = '\'';
            break;
        case '"':
            r = '"';
            break;
        case '\\':
            r = '\\';
            break;
        default:
            jfail(L->c, KVD_EBADREQ, line, "unexpected escaped character '%c'", e);
        }
        pp_put(L->c, &o, r, line);
    }
    if (pending_hi)
        jfail(L->c, KVD_EUNSUPPORTED, line, "a lone surrogate escape is not supported");
    push(L, JT_STR, o.t ? o.t : "", o.n, line);
    L->pos++; /* closing quote */
}

static const struct {
    const char *s;
    enum jtok t;
} rules[] = {
    {"{%", JT_OPEN_STMT}, {"%}", JT_CLOSE_STMT}, {"{{", JT_OPEN_EXPR}, {"}}", JT_CLOSE_EXPR},
    {"(", JT_LPAREN},     {")", JT_RPAREN},      {"{", JT_LBRACE},     {"}", JT_RBRACE},
    {"[", JT_LBRACKET},   {"]", JT_RBRACKET},    {",", JT_COMMA},      {".", JT_DOT},
    {":", JT_COLON},      {"|", JT_PIPE},        {"<=", JT_CMP},       {">=", JT_CMP},
    {"==", JT_CMP},       {"!=", JT_CMP},        {"<", JT_CMP},        {">", JT_CMP},
    {"+", JT_ADD},        {"-", JT_ADD},         {"~", JT_ADD},        {"**", JT_POW},
    {"*", JT_MUL},        {"//", JT_MUL},        {"/", JT_MUL},        {"%", JT_MUL},
    {"=", JT_EQUALS},
};

void jinja_lex(struct jctx *c, const char *src, size_t len, struct jtoken **out, size_t *nout)
{
    struct lexer L = {.c = c};
    preprocess(c, src, len, &L.p);
    const char *t = L.p.t;
    size_t n = L.p.n;
    int curly = 0;

    while (L.pos < n) {
        int last = L.n ? (int)L.tok[L.n - 1].type : -1;
        if (last == -1 || last == JT_CLOSE_STMT || last == JT_CLOSE_EXPR || last == JT_COMMENT) {
            size_t end = L.pos;
            for (;;) {
                const char *q = memchr(t + end, '{', n - end);
                if (!q) {
                    end = n;
                    break;
                }
                end = (size_t)(q - t);
                char nx = end + 1 < n ? t[end + 1] : 0;
                if (nx == '%' || nx == '{' || nx == '#')
                    break;
                end++;
            }
            if (end > L.pos) {
                push(&L, JT_TEXT, t + L.pos, end - L.pos, L.p.ln[L.pos]);
                L.pos = end;
                continue;
            }
        }
        if (t[L.pos] == '{') {
            char nx = L.pos + 1 < n ? t[L.pos + 1] : 0;
            if (nx == '#') {
                int line = L.p.ln[L.pos];
                L.pos += 2;
                bool before = L.pos < n && t[L.pos] == '-';
                if (before)
                    L.pos++;
                size_t end = L.pos;
                while (end + 1 < n && !(t[end] == '#' && t[end + 1] == '}'))
                    end++;
                if (end + 1 >= n)
                    jfail(c, KVD_EBADREQ, line, "missing end of comment tag '#}'");
                size_t clen = end - L.pos;
                bool after = clen > 0 && t[end - 1] == '-';
                if (after)
                    clen--;
                if (before)
                    strip_last_text(&L);
                push(&L, JT_COMMENT, t + L.pos, clen, line);
                L.pos = end + 2;
                if (after)
                    skip_space(&L);
                continue;
            }
            if (L.pos + 2 < n && t[L.pos + 2] == '-' && (nx == '%' || nx == '{')) {
                strip_last_text(&L);
                push(&L, nx == '%' ? JT_OPEN_STMT : JT_OPEN_EXPR, nx == '%' ? "{%" : "{{", 2,
                     L.p.ln[L.pos]);
                if (nx == '{')
                    curly = 0;
                L.pos += 3;
                continue;
            }
        }
        consume_space(&L);
        char ch = t[L.pos];
        int line = L.p.ln[L.pos];
        if (ch == '-' && L.pos + 2 < n && t[L.pos + 2] == '}' &&
            (t[L.pos + 1] == '%' || t[L.pos + 1] == '}')) {
            bool stmt = t[L.pos + 1] == '%';
            push(&L, stmt ? JT_CLOSE_STMT : JT_CLOSE_EXPR, stmt ? "%}" : "}}", 2, line);
            L.pos += 3;
            skip_space(&L);
            continue;
        }
        if (ch == '-' || ch == '+') {
            if (last == JT_TEXT || last == -1)
                jfail(c, KVD_EBADREQ, line, "unexpected character '%c'", ch);
            if (!(last == JT_IDENT || last == JT_NUM || last == JT_STR || last == JT_RPAREN ||
                  last == JT_RBRACKET)) {
                size_t start = L.pos++;
                size_t nd = consume_digits(&L);
                if (nd && L.pos + 1 < n && t[L.pos] == '.' && is_digit(t[L.pos + 1])) {
                    L.pos++;
                    consume_digits(&L);
                }
                if (nd)
                    push(&L, JT_NUM, t + start, L.pos - start, line);
                else
                    push(&L, JT_UNARY, t + start, 1, line);
                continue;
            }
        }
        bool matched = false;
        for (size_t r = 0; r < sizeof(rules) / sizeof(rules[0]); r++) {
            size_t rl = strlen(rules[r].s);
            if (rules[r].t == JT_CLOSE_EXPR && curly > 0)
                continue;
            if (n - L.pos >= rl && memcmp(t + L.pos, rules[r].s, rl) == 0) {
                push(&L, rules[r].t, rules[r].s, rl, line);
                if (rules[r].t == JT_OPEN_EXPR)
                    curly = 0;
                else if (rules[r].t == JT_LBRACE)
                    curly++;
                else if (rules[r].t == JT_RBRACE)
                    curly--;
                L.pos += rl;
                matched = true;
                break;
            }
        }
        if (matched)
            continue;
        if (ch == '\'' || ch == '"') {
            L.pos++;
            lex_string(&L, ch);
            continue;
        }
        if (is_digit(ch)) {
            size_t start = L.pos;
            consume_digits(&L);
            if (last != JT_DOT && L.pos + 1 < n && t[L.pos] == '.' && is_digit(t[L.pos + 1])) {
                L.pos++;
                consume_digits(&L);
            }
            push(&L, JT_NUM, t + start, L.pos - start, line);
            continue;
        }
        if (is_word(ch)) {
            size_t start = L.pos;
            while (is_word(t[L.pos]))
                if (++L.pos >= n)
                    lex_fail(&L, "unexpected end of input");
            push(&L, JT_IDENT, t + start, L.pos - start, line);
            continue;
        }
        if ((unsigned char)ch < 0x20 || (unsigned char)ch >= 0x7F)
            jfail(c, KVD_EBADREQ, line, "unexpected character (byte 0x%02x)", (unsigned char)ch);
        jfail(c, KVD_EBADREQ, line, "unexpected character '%c'", ch);
    }
    *out = L.tok;
    *nout = L.n;
}

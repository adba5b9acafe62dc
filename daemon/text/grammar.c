/* GBNF compiler: text -> rules of elements (grammar_impl.h).
 *
 * The syntax and its rewriting are llama.cpp's (llama-grammar.cpp), so a
 * grammar written for llama.cpp means the same here:
 *   rule     ::= name "::=" alternates (newline | end)
 *   alternates: sequences separated by "|" (a newline may follow "|")
 *   items    : "literal", [class], [^class], ., name, ( alternates ),
 *              each optionally followed by *, +, ?, {m}, {m,}, {m,n}
 *   escapes  : \x.. \u.... \U........ \t \r \n \\ \" \[ \]
 *   comments : # to the end of the line; newlines inside ( ) are spaces.
 * Repetitions are rewritten into generated rules as llama.cpp does
 * (S* -> S' ::= S S' | ; S{m,n} -> m copies of S, then n-m nested optional
 * rules). After parsing every referenced rule must be defined, `root` must
 * exist, and no rule may reach itself before consuming a character (left
 * recursion, also through rules that can be empty): matching such a grammar
 * would never end, so it is refused here. */
#include "grammar_impl.h"

#include <stdlib.h>
#include <string.h>

#define GRAMMAR_MAX_NESTING 256

struct gvec {
    struct gr_elem *e;
    uint32_t n, cap;
};

struct gsym {
    char *name; /* NULL for a generated rule */
    uint32_t id;
};

struct parser {
    const char *src; /* NUL-terminated */
    struct gvec *rules;
    bool *defined;
    uint32_t cap_rules;
    struct gsym *syms; /* open addressing on the name's hash */
    uint32_t sym_cap, n_named;
    uint32_t n_syms; /* next symbol id */
    size_t total_elems;
    int depth;
    int rc;
    struct kvd_error *err;
};

static const char *fail(struct parser *p, int code, const char *what, const char *at)
{
    if (p->rc)
        return NULL;
    char excerpt[24];
    size_t n = 0;
    if (at) {
        for (; n + 1 < sizeof excerpt && at[n]; n++)
            excerpt[n] = (at[n] >= 0x20 && at[n] < 0x7f) ? at[n] : ' ';
    }
    excerpt[n] = '\0';
    p->rc = code;
    if (at)
        kvd_error_set(p->err, code, "grammar: %s at byte %zu (\"%s\")", what, (size_t)(at - p->src),
                      excerpt);
    else
        kvd_error_set(p->err, code, "grammar: %s", what);
    if (p->err)
        snprintf(p->err->param, sizeof p->err->param, "grammar");
    return NULL;
}

static bool push(struct parser *p, struct gvec *v, uint32_t type, uint32_t value)
{
    if (p->total_elems >= GRAMMAR_MAX_ELEMS) {
        fail(p, KVD_ETOOLARGE, "more elements than kvd compiles (2M)", NULL);
        return false;
    }
    if (v->n == v->cap) {
        uint32_t cap = v->cap ? v->cap * 2 : 16;
        struct gr_elem *e = realloc(v->e, cap * sizeof *e);
        if (!e) {
            fail(p, KVD_ENOMEM, "out of memory", NULL);
            return false;
        }
        v->e = e;
        v->cap = cap;
    }
    v->e[v->n++] = (struct gr_elem){type, value};
    p->total_elems++;
    return true;
}

static bool append(struct parser *p, struct gvec *v, const struct gr_elem *e, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!push(p, v, e[i].type, e[i].value))
            return false;
    return true;
}

static uint64_t name_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* Makes room for rule id `id` in the rule table. */
static bool reserve_rule(struct parser *p, uint32_t id)
{
    if (id >= GRAMMAR_MAX_RULES) {
        fail(p, KVD_ETOOLARGE, "more rules than kvd compiles (65536)", NULL);
        return false;
    }
    if (id < p->cap_rules)
        return true;
    uint32_t cap = p->cap_rules ? p->cap_rules : 64;
    while (cap <= id)
        cap *= 2;
    struct gvec *r = realloc(p->rules, cap * sizeof *r);
    if (!r) {
        fail(p, KVD_ENOMEM, "out of memory", NULL);
        return false;
    }
    p->rules = r;
    bool *d = realloc(p->defined, cap * sizeof *d);
    if (!d) {
        fail(p, KVD_ENOMEM, "out of memory", NULL);
        return false;
    }
    p->defined = d;
    memset(p->rules + p->cap_rules, 0, (cap - p->cap_rules) * sizeof *r);
    memset(p->defined + p->cap_rules, 0, (cap - p->cap_rules) * sizeof *d);
    p->cap_rules = cap;
    return true;
}

static bool grow_syms(struct parser *p)
{
    uint32_t cap = p->sym_cap ? p->sym_cap * 2 : 64;
    struct gsym *s = calloc(cap, sizeof *s);
    if (!s) {
        fail(p, KVD_ENOMEM, "out of memory", NULL);
        return false;
    }
    for (uint32_t i = 0; i < p->sym_cap; i++) {
        if (!p->syms[i].name)
            continue;
        uint32_t j = (uint32_t)(name_hash(p->syms[i].name, strlen(p->syms[i].name)) & (cap - 1));
        while (s[j].name)
            j = (j + 1) & (cap - 1);
        s[j] = p->syms[i];
    }
    free(p->syms);
    p->syms = s;
    p->sym_cap = cap;
    return true;
}

/* The id of a named rule, a new one the first time the name is seen;
 * UINT32_MAX on failure. */
static uint32_t symbol_id(struct parser *p, const char *name, size_t n)
{
    if ((p->n_named + 1) * 2 > p->sym_cap && !grow_syms(p))
        return UINT32_MAX;
    uint32_t j = (uint32_t)(name_hash(name, n) & (p->sym_cap - 1));
    while (p->syms[j].name) {
        if (strlen(p->syms[j].name) == n && memcmp(p->syms[j].name, name, n) == 0)
            return p->syms[j].id;
        j = (j + 1) & (p->sym_cap - 1);
    }
    if (!reserve_rule(p, p->n_syms))
        return UINT32_MAX;
    char *copy = strndup(name, n);
    if (!copy) {
        fail(p, KVD_ENOMEM, "out of memory", NULL);
        return UINT32_MAX;
    }
    p->syms[j] = (struct gsym){copy, p->n_syms};
    p->n_named++;
    return p->n_syms++;
}

static uint32_t generated_id(struct parser *p)
{
    if (!reserve_rule(p, p->n_syms))
        return UINT32_MAX;
    return p->n_syms++;
}

static const char *symbol_name(const struct parser *p, uint32_t id)
{
    for (uint32_t i = 0; i < p->sym_cap; i++)
        if (p->syms[i].name && p->syms[i].id == id)
            return p->syms[i].name;
    return "(generated)";
}

static void set_rule(struct parser *p, uint32_t id, struct gvec *v)
{
    /* A rule defined twice keeps its last definition, as in llama.cpp. */
    if (p->defined[id])
        p->total_elems -= p->rules[id].n;
    free(p->rules[id].e);
    p->rules[id] = *v;
    p->defined[id] = true;
    *v = (struct gvec){0};
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static bool is_word(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || is_digit(c);
}

static const char *skip_space(const char *s, bool newline_ok)
{
    while (*s == ' ' || *s == '\t' || *s == '#' || (newline_ok && (*s == '\r' || *s == '\n'))) {
        if (*s == '#') {
            while (*s && *s != '\r' && *s != '\n')
                s++;
        } else {
            s++;
        }
    }
    return s;
}

static const char *parse_name(struct parser *p, const char *s)
{
    const char *e = s;
    while (is_word(*e))
        e++;
    if (e == s)
        return fail(p, KVD_EBADREQ, "expecting a name", s);
    return e;
}

static const char *parse_hex(struct parser *p, const char *s, int digits, uint32_t *out)
{
    uint32_t v = 0;
    int i = 0;
    for (; i < digits && s[i]; i++) {
        char c = s[i];
        uint32_t d;
        if (c >= 'a' && c <= 'f')
            d = (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            d = (uint32_t)(c - 'A' + 10);
        else if (is_digit(c))
            d = (uint32_t)(c - '0');
        else
            break;
        v = (v << 4) + d;
    }
    if (i != digits) {
        static const char *what[] = {
            "", "", "expecting 2 hex digits", "", "expecting 4 hex digits", "",
            "", "", "expecting 8 hex digits"};
        return fail(p, KVD_EBADREQ, what[digits], s);
    }
    *out = v;
    return s + digits;
}

/* One UTF-8 character of the grammar text, decoded as llama.cpp does
 * (the lead byte's length; continuation bytes taken as they are). */
static const char *decode_char(const char *s, uint32_t *out)
{
    static const int len_of[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    unsigned char b = (unsigned char)*s;
    int len = len_of[b >> 4];
    uint32_t v = b & ((1u << (8 - len)) - 1);
    const char *pos = s + 1;
    for (const char *end = s + len; pos < end && *pos; pos++)
        v = (v << 6) + ((unsigned char)*pos & 0x3f);
    *out = v;
    return pos;
}

static const char *parse_char(struct parser *p, const char *s, uint32_t *out)
{
    if (*s == '\\') {
        switch (s[1]) {
        case 'x':
            return parse_hex(p, s + 2, 2, out);
        case 'u':
            return parse_hex(p, s + 2, 4, out);
        case 'U':
            return parse_hex(p, s + 2, 8, out);
        case 't':
            *out = '\t';
            return s + 2;
        case 'r':
            *out = '\r';
            return s + 2;
        case 'n':
            *out = '\n';
            return s + 2;
        case '\\':
        case '"':
        case '[':
        case ']':
            *out = (unsigned char)s[1];
            return s + 2;
        default:
            return fail(p, KVD_EBADREQ, "unknown escape", s);
        }
    }
    if (*s)
        return decode_char(s, out);
    return fail(p, KVD_EBADREQ, "unexpected end of input", s);
}

static const char *parse_alternates(struct parser *p, const char *s, uint32_t rule_id, bool nested);

/* Rewrites the item rule[last..] repeated min..max times (max < 0: no
 * upper bound), as llama.cpp does. */
static bool repeat(struct parser *p, struct gvec *rule, uint32_t last, long min, long max,
                   const char *at)
{
    if (last == rule->n) {
        fail(p, KVD_EBADREQ, "expecting an item before */+/?/{", at);
        return false;
    }
    if (min > GRAMMAR_MAX_REPETITIONS || max > GRAMMAR_MAX_REPETITIONS) {
        fail(p, KVD_ETOOLARGE, "more repetitions than kvd compiles (2000)", at);
        return false;
    }
    uint32_t item_n = rule->n - last;
    struct gr_elem *item = malloc(item_n * sizeof *item);
    if (!item) {
        fail(p, KVD_ENOMEM, "out of memory", NULL);
        return false;
    }
    memcpy(item, rule->e + last, item_n * sizeof *item);
    bool ok = true;
    if (min == 0) {
        p->total_elems -= item_n;
        rule->n = last;
    } else {
        for (long i = 1; i < min && ok; i++)
            ok = append(p, rule, item, item_n);
    }
    long n_opt = max < 0 ? 1 : max - min;
    uint32_t last_rec = 0;
    for (long i = 0; i < n_opt && ok; i++) {
        uint32_t id = generated_id(p);
        struct gvec rec = {0};
        ok = id != UINT32_MAX && append(p, &rec, item, item_n);
        if (ok && (i > 0 || max < 0))
            ok = push(p, &rec, GR_RULE_REF, max < 0 ? id : last_rec);
        ok = ok && push(p, &rec, GR_ALT, 0) && push(p, &rec, GR_END, 0);
        if (ok)
            set_rule(p, id, &rec);
        else
            free(rec.e);
        last_rec = id;
    }
    if (ok && n_opt > 0)
        ok = push(p, rule, GR_RULE_REF, last_rec);
    free(item);
    return ok;
}

static const char *parse_int(struct parser *p, const char *s, long *out)
{
    const char *e = s;
    long v = 0;
    while (is_digit(*e)) {
        if (v <= 100000000L)
            v = v * 10 + (*e - '0');
        e++;
    }
    if (e == s)
        return fail(p, KVD_EBADREQ, "expecting an integer", s);
    *out = v;
    return e;
}

static const char *parse_sequence(struct parser *p, const char *s, struct gvec *rule, bool nested)
{
    uint32_t last = rule->n;
    const char *pos = s;
    while (*pos && !p->rc) {
        if (*pos == '"') {
            pos++;
            last = rule->n;
            while (*pos != '"') {
                uint32_t c;
                if (!*pos)
                    return fail(p, KVD_EBADREQ, "unexpected end of input in a literal", pos);
                if (!(pos = parse_char(p, pos, &c)) || !push(p, rule, GR_CHAR, c))
                    return NULL;
            }
            pos = skip_space(pos + 1, nested);
        } else if (*pos == '[') {
            pos++;
            uint32_t start = GR_CHAR;
            if (*pos == '^') {
                pos++;
                start = GR_CHAR_NOT;
            }
            last = rule->n;
            while (*pos != ']') {
                uint32_t c;
                if (!*pos)
                    return fail(p, KVD_EBADREQ, "unexpected end of input in a class", pos);
                if (!(pos = parse_char(p, pos, &c)))
                    return NULL;
                if (!push(p, rule, last < rule->n ? GR_CHAR_ALT : start, c))
                    return NULL;
                if (pos[0] == '-' && pos[1] != ']') {
                    if (!pos[1])
                        return fail(p, KVD_EBADREQ, "unexpected end of input in a class", pos);
                    if (!(pos = parse_char(p, pos + 1, &c)) || !push(p, rule, GR_CHAR_RNG_UPPER, c))
                        return NULL;
                }
            }
            pos = skip_space(pos + 1, nested);
        } else if (is_word(*pos)) {
            const char *end = parse_name(p, pos);
            if (!end)
                return NULL;
            uint32_t id = symbol_id(p, pos, (size_t)(end - pos));
            if (id == UINT32_MAX)
                return NULL;
            pos = skip_space(end, nested);
            last = rule->n;
            if (!push(p, rule, GR_RULE_REF, id))
                return NULL;
        } else if (*pos == '(') {
            if (p->depth >= GRAMMAR_MAX_NESTING)
                return fail(p, KVD_ETOOLARGE, "groups nested deeper than 256", pos);
            pos = skip_space(pos + 1, true);
            uint32_t id = generated_id(p);
            if (id == UINT32_MAX)
                return NULL;
            p->depth++;
            pos = parse_alternates(p, pos, id, true);
            p->depth--;
            if (!pos)
                return NULL;
            last = rule->n;
            if (!push(p, rule, GR_RULE_REF, id))
                return NULL;
            if (*pos != ')')
                return fail(p, KVD_EBADREQ, "expecting ')'", pos);
            pos = skip_space(pos + 1, nested);
        } else if (*pos == '.') {
            last = rule->n;
            if (!push(p, rule, GR_CHAR_ANY, 0))
                return NULL;
            pos = skip_space(pos + 1, nested);
        } else if (*pos == '*' || *pos == '+' || *pos == '?') {
            char op = *pos;
            const char *at = pos;
            pos = skip_space(pos + 1, nested);
            if (!repeat(p, rule, last, op == '+' ? 1 : 0, op == '?' ? 1 : -1, at))
                return NULL;
        } else if (*pos == '{') {
            const char *at = pos;
            long min, max = -1;
            pos = skip_space(pos + 1, nested);
            if (!is_digit(*pos))
                return fail(p, KVD_EBADREQ, "expecting an integer", pos);
            if (!(pos = parse_int(p, pos, &min)))
                return NULL;
            pos = skip_space(pos, nested);
            if (*pos == '}') {
                max = min;
                pos = skip_space(pos + 1, nested);
            } else if (*pos == ',') {
                pos = skip_space(pos + 1, nested);
                if (is_digit(*pos)) {
                    if (!(pos = parse_int(p, pos, &max)))
                        return NULL;
                    pos = skip_space(pos, nested);
                }
                if (*pos != '}')
                    return fail(p, KVD_EBADREQ, "expecting '}'", pos);
                pos = skip_space(pos + 1, nested);
            } else {
                return fail(p, KVD_EBADREQ, "expecting ','", pos);
            }
            if (!repeat(p, rule, last, min, max, at))
                return NULL;
        } else {
            break;
        }
    }
    return p->rc ? NULL : pos;
}

static const char *parse_alternates(struct parser *p, const char *s, uint32_t rule_id, bool nested)
{
    struct gvec rule = {0};
    const char *pos = parse_sequence(p, s, &rule, nested);
    while (pos && *pos == '|') {
        if (!push(p, &rule, GR_ALT, 0)) {
            pos = NULL;
            break;
        }
        pos = skip_space(pos + 1, true);
        pos = parse_sequence(p, pos, &rule, nested);
    }
    if (pos && push(p, &rule, GR_END, 0)) {
        set_rule(p, rule_id, &rule);
        return pos;
    }
    p->total_elems -= rule.n;
    free(rule.e);
    return NULL;
}

static const char *parse_rule(struct parser *p, const char *s)
{
    const char *end = parse_name(p, s);
    if (!end)
        return NULL;
    const char *pos = skip_space(end, false);
    uint32_t id = symbol_id(p, s, (size_t)(end - s));
    if (id == UINT32_MAX)
        return NULL;
    if (!(pos[0] == ':' && pos[1] == ':' && pos[2] == '='))
        return fail(p, KVD_EBADREQ, "expecting ::=", pos);
    pos = skip_space(pos + 3, true);
    if (!(pos = parse_alternates(p, pos, id, false)))
        return NULL;
    if (*pos == '\r')
        pos += pos[1] == '\n' ? 2 : 1;
    else if (*pos == '\n')
        pos++;
    else if (*pos)
        return fail(p, KVD_EBADREQ, "expecting a newline or the end", pos);
    return skip_space(pos, true);
}

/* Whether a rule can match the empty string: a fixed point over every
 * rule (an alternative is empty when it is nothing or only rules that can
 * be empty). */
static void nullable_rules(const struct grammar *g, bool *nullable)
{
    bool changed = true;
    while (changed) {
        changed = false;
        for (uint32_t r = 0; r < g->n_rules; r++) {
            if (nullable[r])
                continue;
            const struct gr_elem *e = g->elems + g->rule_start[r];
            bool all = true;
            for (;; e++) {
                if (gr_is_end_of_sequence(e)) {
                    if (all) {
                        nullable[r] = true;
                        changed = true;
                        break;
                    }
                    if (e->type == GR_END)
                        break;
                    all = true;
                } else if (e->type != GR_RULE_REF || !nullable[e->value]) {
                    all = false;
                }
            }
        }
    }
}

/* Depth-first over "rule r can start with rule s" edges; a cycle is left
 * recursion. state: 0 unvisited, 1 on the path, 2 done. Iterative, so a
 * long chain of rules cannot overflow the C stack. */
static int find_left_recursion(const struct grammar *g, const bool *nullable, uint32_t *stack,
                               uint32_t *cursor, uint8_t *state, uint32_t start)
{
    uint32_t top = 0;
    stack[top] = start;
    cursor[top] = g->rule_start[start];
    state[start] = 1;
    while (1) {
        uint32_t r = stack[top];
        uint32_t i = cursor[top];
        const struct gr_elem *base = g->elems;
        /* Find the next rule reference of r that sits at the start of its
         * alternative, or after only nullable references. */
        uint32_t next = UINT32_MAX;
        while (1) {
            const struct gr_elem *e = base + i;
            if (e->type == GR_END) {
                break;
            }
            /* Is e at an alternative's start or after nullable refs only? */
            uint32_t k = i;
            bool reachable = true;
            while (k > g->rule_start[r] && !gr_is_end_of_sequence(base + k - 1)) {
                const struct gr_elem *prev = base + k - 1;
                if (prev->type != GR_RULE_REF || !nullable[prev->value]) {
                    reachable = false;
                    break;
                }
                k--;
            }
            i++;
            if (reachable && e->type == GR_RULE_REF) {
                next = e->value;
                break;
            }
        }
        cursor[top] = i;
        if (next == UINT32_MAX) {
            state[r] = 2;
            if (top == 0)
                return -1;
            top--;
            continue;
        }
        if (state[next] == 1)
            return (int)next;
        if (state[next] == 0) {
            state[next] = 1;
            top++;
            stack[top] = next;
            cursor[top] = g->rule_start[next];
        }
    }
}

static int check_left_recursion(const struct grammar *g, uint32_t *bad, struct kvd_error *err)
{
    bool *nullable = calloc(g->n_rules, sizeof *nullable);
    uint32_t *stack = calloc(g->n_rules, sizeof *stack);
    uint32_t *cursor = calloc(g->n_rules, sizeof *cursor);
    uint8_t *state = calloc(g->n_rules, 1);
    int rc = 0;
    if (!nullable || !stack || !cursor || !state) {
        rc = kvd_error_set(err, KVD_ENOMEM, "grammar: out of memory");
    } else {
        nullable_rules(g, nullable);
        for (uint32_t r = 0; r < g->n_rules && !rc; r++) {
            if (state[r])
                continue;
            int found = find_left_recursion(g, nullable, stack, cursor, state, r);
            if (found >= 0) {
                *bad = (uint32_t)found;
                rc = KVD_EBADREQ;
            }
        }
    }
    free(nullable);
    free(stack);
    free(cursor);
    free(state);
    return rc;
}

static void parser_free(struct parser *p)
{
    for (uint32_t i = 0; i < p->cap_rules; i++)
        free(p->rules[i].e);
    free(p->rules);
    free(p->defined);
    for (uint32_t i = 0; i < p->sym_cap; i++)
        free(p->syms[i].name);
    free(p->syms);
}

int grammar_compile(const char *text, size_t len, struct grammar **out, struct kvd_error *err)
{
    *out = NULL;
    if (len > GRAMMAR_MAX_TEXT) {
        kvd_error_set(err, KVD_ETOOLARGE, "grammar: %zu bytes, kvd compiles at most %u", len,
                      GRAMMAR_MAX_TEXT);
        if (err)
            snprintf(err->param, sizeof err->param, "grammar");
        return KVD_ETOOLARGE;
    }
    if (memchr(text, '\0', len)) {
        kvd_error_set(err, KVD_EBADREQ, "grammar: contains a NUL byte");
        if (err)
            snprintf(err->param, sizeof err->param, "grammar");
        return KVD_EBADREQ;
    }
    char *src = malloc(len + 1);
    if (!src)
        return kvd_error_set(err, KVD_ENOMEM, "grammar: out of memory");
    memcpy(src, text, len);
    src[len] = '\0';

    struct parser p = {.src = src, .err = err};
    const char *pos = skip_space(src, true);
    while (pos && *pos)
        pos = parse_rule(&p, pos);

    struct grammar *g = NULL;
    if (!p.rc) {
        for (uint32_t id = 0; id < p.n_syms && !p.rc; id++) {
            if (!p.defined[id]) {
                char what[256];
                snprintf(what, sizeof what, "undefined rule '%.100s'", symbol_name(&p, id));
                fail(&p, KVD_EBADREQ, what, NULL);
            }
        }
    }
    uint32_t root = UINT32_MAX;
    if (!p.rc) {
        for (uint32_t i = 0; i < p.sym_cap; i++)
            if (p.syms[i].name && strcmp(p.syms[i].name, "root") == 0)
                root = p.syms[i].id;
        if (root == UINT32_MAX)
            fail(&p, KVD_EBADREQ, "no rule named root", NULL);
    }
    if (!p.rc) {
        g = calloc(1, sizeof *g);
        if (g) {
            g->n_rules = p.n_syms;
            g->root = root;
            g->rule_start = malloc(g->n_rules * sizeof *g->rule_start);
            g->elems = malloc((p.total_elems ? p.total_elems : 1) * sizeof *g->elems);
        }
        if (!g || !g->rule_start || !g->elems) {
            fail(&p, KVD_ENOMEM, "out of memory", NULL);
        } else {
            uint32_t n = 0;
            for (uint32_t id = 0; id < g->n_rules; id++) {
                g->rule_start[id] = n;
                memcpy(g->elems + n, p.rules[id].e, p.rules[id].n * sizeof *g->elems);
                n += p.rules[id].n;
            }
            g->n_elems = n;
            uint32_t bad = 0;
            int rc = check_left_recursion(g, &bad, err);
            if (rc == KVD_EBADREQ) {
                char what[256];
                snprintf(what, sizeof what,
                         "rule '%.100s' can reach itself before matching a character (left "
                         "recursion)",
                         symbol_name(&p, bad));
                fail(&p, KVD_EBADREQ, what, NULL);
            } else if (rc) {
                p.rc = rc;
            }
        }
    }
    int rc = p.rc;
    parser_free(&p);
    free(src);
    if (rc) {
        grammar_free(g);
        return rc;
    }
    *out = g;
    return 0;
}

void grammar_free(struct grammar *g)
{
    if (!g)
        return;
    free(g->elems);
    free(g->rule_start);
    free(g);
}

size_t grammar_n_rules(const struct grammar *g)
{
    return g->n_rules;
}

/* A rule is finite when one of its alternatives holds only terminals and
 * finite rules: a fixpoint over the rules, at most n_rules passes. */
bool grammar_can_finish(const struct grammar *g)
{
    bool *fin = calloc(g->n_rules ? g->n_rules : 1, sizeof *fin);
    if (!fin)
        return true; /* no memory to tell: let the matcher find out */
    for (bool changed = true; changed && !fin[g->root];) {
        changed = false;
        for (uint32_t r = 0; r < g->n_rules; r++) {
            if (fin[r])
                continue;
            const struct gr_elem *e = g->elems + g->rule_start[r];
            bool ok = true;
            for (;; e++) {
                if (gr_is_end_of_sequence(e)) {
                    if (ok)
                        break;
                    if (e->type == GR_END)
                        break;
                    ok = true; /* the next alternative */
                    continue;
                }
                if (e->type == GR_RULE_REF && !fin[e->value])
                    ok = false;
            }
            if (ok) {
                fin[r] = true;
                changed = true;
            }
        }
    }
    bool root = fin[g->root];
    free(fin);
    return root;
}

/* Jinja parser: tokens to a syntax tree, with the reference renderer's
 * grammar and precedence (its quirks included: tests bind tighter than
 * multiplication, `a if b` without else filters a for loop). Statements
 * outside the subset (call and filter blocks, include, raw, ...) and argument
 * unpacking are refused here with KVD_EUNSUPPORTED naming them. */
#include "jinja.h"

#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"

struct parser {
    struct jctx *c;
    const struct jtoken *t;
    size_t n, cur;
    int depth;
};

static const struct jtoken eof_tok = {.type = JT_COMMENT, .s = "", .n = 0, .line = 0};

static const struct jtoken *tk(const struct parser *P, size_t off)
{
    return P->cur + off < P->n ? &P->t[P->cur + off] : &eof_tok;
}

static int line_of(const struct parser *P)
{
    if (P->cur < P->n)
        return P->t[P->cur].line;
    return P->n ? P->t[P->n - 1].line : 1;
}

static _Noreturn void syntax(struct parser *P, const char *fmt, const char *arg)
{
    if (P->cur >= P->n)
        jfail(P->c, KVD_EBADREQ, line_of(P), "unexpected end of template (%s)", arg ? arg : fmt);
    jfail(P->c, KVD_EBADREQ, line_of(P), fmt, arg ? arg : tk(P, 0)->s);
}

static bool is(const struct parser *P, enum jtok type)
{
    return P->cur < P->n && P->t[P->cur].type == type;
}

static bool is_ident(const struct parser *P, size_t off, const char *name)
{
    const struct jtoken *t = tk(P, off);
    return P->cur + off < P->n && t->type == JT_IDENT && strcmp(t->s, name) == 0;
}

static bool is_stmt(const struct parser *P, const char *const *names)
{
    if (!is(P, JT_OPEN_STMT) || P->cur + 1 >= P->n || P->t[P->cur + 1].type != JT_IDENT)
        return false;
    for (; *names; names++)
        if (strcmp(P->t[P->cur + 1].s, *names) == 0)
            return true;
    return false;
}

static const struct jtoken *expect(struct parser *P, enum jtok type, const char *what)
{
    if (!is(P, type))
        syntax(P, "expected %s", what);
    return &P->t[P->cur++];
}

static void expect_ident(struct parser *P, const char *name)
{
    if (!is_ident(P, 0, name))
        syntax(P, "expected '%s'", name);
    P->cur++;
}

static struct jnode *node(struct parser *P, enum jnk kind, int line)
{
    struct jnode *n = jalloc(P->c, sizeof(*n));
    memset(n, 0, sizeof(*n));
    n->kind = kind;
    n->line = line;
    return n;
}

/* Growable node list. */
struct nlist {
    struct jnode **v;
    size_t n, cap;
};

static void nl_push(struct parser *P, struct nlist *l, struct jnode *x)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        struct jnode **v = jalloc(P->c, cap * sizeof(*v));
        if (l->n)
            memcpy(v, l->v, l->n * sizeof(*v));
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = x;
}

static void enter(struct parser *P)
{
    if (++P->depth > JINJA_MAX_DEPTH)
        jfail(P->c, KVD_EUNSUPPORTED, line_of(P), "nesting deeper than %d levels is not supported",
              JINJA_MAX_DEPTH);
}

static struct jnode *parse_expr(struct parser *P);
static struct jnode *parse_primary(struct parser *P);
static struct jnode *parse_any(struct parser *P);

static void parse_until(struct parser *P, struct nlist *body, const char *const *names,
                        const char *what)
{
    while (!is_stmt(P, names)) {
        if (P->cur >= P->n)
            jfail(P->c, KVD_EBADREQ, line_of(P), "unexpected end of template: missing %s", what);
        nl_push(P, body, parse_any(P));
    }
}

/* expr (, expr)* -> the expression or a tuple */
static struct jnode *parse_sequence(struct parser *P, bool primary)
{
    int line = line_of(P);
    struct jnode *first = primary ? parse_primary(P) : parse_expr(P);
    if (!is(P, JT_COMMA))
        return first;
    struct nlist l = {0};
    nl_push(P, &l, first);
    while (is(P, JT_COMMA)) {
        P->cur++;
        nl_push(P, &l, primary ? parse_primary(P) : parse_expr(P));
    }
    struct jnode *t = node(P, JN_TUPLE, line);
    t->list = l.v;
    t->nlist = l.n;
    return t;
}

/* ( args ) for calls (call=true) or macro parameters */
static void parse_args(struct parser *P, bool call, struct jnode ***out, size_t *nout)
{
    expect(P, JT_LPAREN, "'(' to open an argument list");
    struct nlist l = {0};
    bool saw_kw = false;
    while (!is(P, JT_RPAREN)) {
        if (P->cur >= P->n)
            syntax(P, "expected ')'", NULL);
        if (is(P, JT_POW) || (is(P, JT_MUL) && strcmp(tk(P, 0)->s, "*") == 0))
            jfail(P->c, KVD_EUNSUPPORTED, line_of(P), "argument unpacking (%s) is not supported",
                  tk(P, 0)->s);
        int line = line_of(P);
        struct jnode *a = parse_expr(P);
        if (is(P, JT_EQUALS)) {
            P->cur++;
            if (a->kind != JN_IDENT)
                jfail(P->c, KVD_EBADREQ, line, "expected an identifier before '='");
            struct jnode *kw = node(P, JN_KWARG, line);
            kw->s = a->s;
            kw->n = a->n;
            kw->a = parse_expr(P);
            a = kw;
        }
        if (!call) {
            if (a->kind != JN_IDENT && a->kind != JN_KWARG)
                jfail(P->c, KVD_EBADREQ, line, "expected an identifier for a macro parameter");
            for (size_t i = 0; i < l.n; i++)
                if (strcmp(l.v[i]->s, a->s) == 0)
                    jfail(P->c, KVD_EBADREQ, line, "duplicate parameter name '%s'", a->s);
        }
        if (a->kind == JN_KWARG)
            saw_kw = true;
        else if (saw_kw)
            jfail(P->c, KVD_EBADREQ, line,
                  call ? "positional arguments must come before keyword arguments"
                       : "non-default parameter follows a default one");
        nl_push(P, &l, a);
        if (is(P, JT_COMMA))
            P->cur++;
    }
    P->cur++;
    *out = l.v;
    *nout = l.n;
}

static struct jnode *parse_member(struct parser *P, struct jnode *obj)
{
    while (is(P, JT_DOT) || is(P, JT_LBRACKET)) {
        bool computed = is(P, JT_LBRACKET);
        int line = line_of(P);
        P->cur++;
        struct jnode *m = node(P, JN_MEMBER, line);
        m->a = obj;
        m->flag = computed;
        if (computed) {
            struct jnode *sl[3] = {0};
            size_t ns = 0;
            bool slice = false;
            while (!is(P, JT_RBRACKET)) {
                if (P->cur >= P->n)
                    syntax(P, "expected ']'", NULL);
                if (ns == 3)
                    jfail(P->c, KVD_EBADREQ, line, "expected 0-3 arguments for a slice");
                if (is(P, JT_COLON)) {
                    sl[ns++] = NULL;
                    P->cur++;
                    slice = true;
                } else {
                    sl[ns++] = parse_expr(P);
                    if (is(P, JT_COLON)) {
                        P->cur++;
                        slice = true;
                    }
                }
            }
            if (ns == 0)
                jfail(P->c, KVD_EBADREQ, line, "expected an index or slice inside '[]'");
            if (slice) {
                struct jnode *s = node(P, JN_SLICE, line);
                s->a = sl[0];
                s->b = ns > 1 ? sl[1] : NULL;
                s->c = ns > 2 ? sl[2] : NULL;
                m->b = s;
            } else {
                m->b = sl[0];
            }
            expect(P, JT_RBRACKET, "']'");
        } else {
            struct jnode *p = parse_primary(P);
            if (p->kind != JN_IDENT && p->kind != JN_INT)
                jfail(P->c, KVD_EBADREQ, line, "expected an identifier or integer after '.'");
            m->b = p;
        }
        obj = m;
    }
    return obj;
}

static struct jnode *parse_call(struct parser *P, struct jnode *callee)
{
    struct jnode *c = node(P, JN_CALL, line_of(P));
    c->a = callee;
    parse_args(P, true, &c->list, &c->nlist);
    struct jnode *e = parse_member(P, c);
    if (is(P, JT_LPAREN))
        e = parse_call(P, e);
    return e;
}

static struct jnode *parse_call_member(struct parser *P)
{
    struct jnode *m = parse_member(P, parse_primary(P));
    if (is(P, JT_LPAREN))
        return parse_call(P, m);
    return m;
}

static struct jnode *parse_unary_sign(struct parser *P)
{
    const struct jtoken *t = tk(P, 0);
    if (P->cur < P->n && (t->type == JT_UNARY || t->type == JT_ADD) &&
        (strcmp(t->s, "-") == 0 || strcmp(t->s, "+") == 0)) {
        enter(P);
        P->cur++;
        struct jnode *u = node(P, JN_UNARY, t->line);
        u->op = t->s[0] == '-' ? JO_NEG : JO_POS;
        u->a = parse_unary_sign(P);
        P->depth--;
        return u;
    }
    return parse_call_member(P);
}

static struct jnode *parse_filter(struct parser *P)
{
    struct jnode *operand = parse_unary_sign(P);
    while (is(P, JT_PIPE)) {
        int line = line_of(P);
        P->cur++;
        struct jnode *name = parse_primary(P);
        if (name->kind != JN_IDENT)
            jfail(P->c, KVD_EBADREQ, line, "expected a filter name after '|'");
        struct jnode *f = node(P, JN_FILTER, line);
        f->a = operand;
        f->s = name->s;
        f->n = name->n;
        if (is(P, JT_LPAREN)) {
            f->flag = true;
            parse_args(P, true, &f->list, &f->nlist);
            if (is(P, JT_DOT) || is(P, JT_LBRACKET) || is(P, JT_LPAREN))
                jfail(P->c, KVD_EUNSUPPORTED, line,
                      "member access or a call on filter '%s(...)' is not supported", f->s);
        }
        operand = f;
    }
    return operand;
}

static struct jnode *parse_test(struct parser *P)
{
    struct jnode *operand = parse_filter(P);
    while (is_ident(P, 0, "is")) {
        int line = line_of(P);
        P->cur++;
        bool neg = is_ident(P, 0, "not");
        if (neg)
            P->cur++;
        struct jnode *name = parse_primary(P);
        if (name->kind != JN_IDENT)
            jfail(P->c, KVD_EBADREQ, line, "expected a test name after 'is'");
        struct jnode *t = node(P, JN_TEST, line);
        t->a = operand;
        t->s = name->s;
        t->n = name->n;
        t->flag = neg;
        operand = t;
    }
    return operand;
}

static struct jnode *binary(struct parser *P, enum jop op, int line, struct jnode *a,
                            struct jnode *b)
{
    struct jnode *n = node(P, JN_BINARY, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static struct jnode *parse_power(struct parser *P)
{
    struct jnode *l = parse_test(P);
    while (is(P, JT_POW)) {
        int line = line_of(P);
        P->cur++;
        l = binary(P, JO_POW, line, l, parse_test(P));
    }
    return l;
}

static struct jnode *parse_mul(struct parser *P)
{
    struct jnode *l = parse_power(P);
    while (is(P, JT_MUL)) {
        const struct jtoken *t = &P->t[P->cur++];
        enum jop op = strcmp(t->s, "*") == 0    ? JO_MUL
                      : strcmp(t->s, "/") == 0  ? JO_DIV
                      : strcmp(t->s, "//") == 0 ? JO_FLOORDIV
                                                : JO_MOD;
        l = binary(P, op, t->line, l, parse_power(P));
    }
    return l;
}

static struct jnode *parse_add(struct parser *P)
{
    struct jnode *l = parse_mul(P);
    while (is(P, JT_ADD)) {
        const struct jtoken *t = &P->t[P->cur++];
        enum jop op = t->s[0] == '+' ? JO_ADD : t->s[0] == '-' ? JO_SUB : JO_CONCAT;
        l = binary(P, op, t->line, l, parse_mul(P));
    }
    return l;
}

static struct jnode *parse_cmp(struct parser *P)
{
    struct jnode *l = parse_add(P);
    for (;;) {
        int line = line_of(P);
        enum jop op;
        if (is_ident(P, 0, "not") && is_ident(P, 1, "in")) {
            op = JO_NOT_IN;
            P->cur += 2;
        } else if (is_ident(P, 0, "in")) {
            op = JO_IN;
            P->cur++;
        } else if (is(P, JT_CMP)) {
            const char *s = P->t[P->cur++].s;
            op = strcmp(s, "==") == 0   ? JO_EQ
                 : strcmp(s, "!=") == 0 ? JO_NE
                 : strcmp(s, "<=") == 0 ? JO_LE
                 : strcmp(s, ">=") == 0 ? JO_GE
                 : strcmp(s, "<") == 0  ? JO_LT
                                        : JO_GT;
        } else {
            return l;
        }
        l = binary(P, op, line, l, parse_add(P));
    }
}

static struct jnode *parse_not(struct parser *P)
{
    if (is_ident(P, 0, "not")) {
        int line = line_of(P);
        enter(P);
        P->cur++;
        struct jnode *u = node(P, JN_UNARY, line);
        u->op = JO_NOT;
        u->a = parse_not(P);
        P->depth--;
        return u;
    }
    return parse_cmp(P);
}

static struct jnode *parse_and(struct parser *P)
{
    struct jnode *l = parse_not(P);
    while (is_ident(P, 0, "and")) {
        int line = line_of(P);
        P->cur++;
        l = binary(P, JO_AND, line, l, parse_not(P));
    }
    return l;
}

static struct jnode *parse_or(struct parser *P)
{
    struct jnode *l = parse_and(P);
    while (is_ident(P, 0, "or")) {
        int line = line_of(P);
        P->cur++;
        l = binary(P, JO_OR, line, l, parse_and(P));
    }
    return l;
}

static struct jnode *parse_expr(struct parser *P)
{
    enter(P);
    struct jnode *a = parse_or(P);
    if (is_ident(P, 0, "if")) {
        int line = line_of(P);
        P->cur++;
        struct jnode *test = parse_or(P);
        if (is_ident(P, 0, "else")) {
            P->cur++;
            struct jnode *t = node(P, JN_TERNARY, line);
            t->a = test;
            t->b = a;
            t->c = parse_expr(P);
            a = t;
        } else {
            struct jnode *s = node(P, JN_SELECT, line);
            s->a = a;
            s->b = test;
            a = s;
        }
    }
    P->depth--;
    return a;
}

static struct jnode *parse_primary(struct parser *P)
{
    if (P->cur >= P->n)
        syntax(P, "expected an expression", NULL);
    const struct jtoken *t = &P->t[P->cur++];
    switch (t->type) {
    case JT_NUM: {
        bool fl = memchr(t->s, '.', t->n) != NULL;
        struct jnode *n = node(P, fl ? JN_FLOAT : JN_INT, t->line);
        n->num = strtod(t->s, NULL);
        return n;
    }
    case JT_STR: {
        size_t total = t->n, k = P->cur;
        while (k < P->n && P->t[k].type == JT_STR)
            total += P->t[k++].n;
        char *s = jalloc(P->c, total + 1);
        memcpy(s, t->s, t->n);
        size_t off = t->n;
        while (is(P, JT_STR)) {
            memcpy(s + off, P->t[P->cur].s, P->t[P->cur].n);
            off += P->t[P->cur++].n;
        }
        s[off] = 0;
        struct jnode *n = node(P, JN_STR, t->line);
        n->s = s;
        n->n = off;
        return n;
    }
    case JT_IDENT: {
        struct jnode *n = node(P, JN_IDENT, t->line);
        n->s = t->s;
        n->n = t->n;
        if (strcmp(t->s, "caller") == 0 || strcmp(t->s, "varargs") == 0 ||
            strcmp(t->s, "kwargs") == 0)
            jfail(P->c, KVD_EUNSUPPORTED, t->line, "the macro variable '%s' is not supported",
                  t->s);
        return n;
    }
    case JT_LPAREN: {
        enter(P);
        struct jnode *e = parse_sequence(P, false);
        expect(P, JT_RPAREN, "')'");
        P->depth--;
        return e;
    }
    case JT_LBRACKET: {
        enter(P);
        struct nlist l = {0};
        while (!is(P, JT_RBRACKET)) {
            if (P->cur >= P->n)
                syntax(P, "expected ']'", NULL);
            nl_push(P, &l, parse_expr(P));
            if (is(P, JT_COMMA))
                P->cur++;
        }
        P->cur++;
        struct jnode *n = node(P, JN_ARRAY, t->line);
        n->list = l.v;
        n->nlist = l.n;
        P->depth--;
        return n;
    }
    case JT_LBRACE: {
        enter(P);
        struct nlist k = {0}, v = {0};
        while (!is(P, JT_RBRACE)) {
            if (P->cur >= P->n)
                syntax(P, "expected '}'", NULL);
            nl_push(P, &k, parse_expr(P));
            expect(P, JT_COLON, "':' between key and value");
            nl_push(P, &v, parse_expr(P));
            if (is(P, JT_COMMA))
                P->cur++;
        }
        P->cur++;
        struct jnode *n = node(P, JN_OBJECT, t->line);
        n->list = k.v;
        n->nlist = k.n;
        n->list2 = v.v;
        n->nlist2 = v.n;
        P->depth--;
        return n;
    }
    default:
        P->cur--;
        syntax(P, "unexpected '%s'", t->type == JT_TEXT ? "text" : NULL);
    }
}

static const char *const END_IF[] = {"elif", "else", "endif", NULL};
static const char *const ENDIF[] = {"endif", NULL};
static const char *const END_FOR[] = {"endfor", "else", NULL};
static const char *const ENDFOR[] = {"endfor", NULL};
static const char *const ENDSET[] = {"endset", NULL};
static const char *const ENDMACRO[] = {"endmacro", NULL};

static struct jnode *parse_if(struct parser *P, int line)
{
    struct jnode *n = node(P, JN_IF, line);
    n->a = parse_expr(P);
    expect(P, JT_CLOSE_STMT, "'%}'");
    struct nlist body = {0}, alt = {0};
    parse_until(P, &body, END_IF, "{% endif %}");
    if (is_stmt(P, (const char *const[]){"elif", NULL})) {
        int l2 = P->t[P->cur].line;
        P->cur += 2;
        nl_push(P, &alt, parse_if(P, l2));
    } else if (is_stmt(P, (const char *const[]){"else", NULL})) {
        P->cur += 2;
        expect(P, JT_CLOSE_STMT, "'%}'");
        parse_until(P, &alt, ENDIF, "{% endif %}");
    }
    n->list = body.v;
    n->nlist = body.n;
    n->list2 = alt.v;
    n->nlist2 = alt.n;
    return n;
}

static void end_block(struct parser *P, const char *name)
{
    expect(P, JT_OPEN_STMT, "'{%'");
    expect_ident(P, name);
    expect(P, JT_CLOSE_STMT, "'%}'");
}

static struct jnode *parse_stmt(struct parser *P)
{
    int line = line_of(P);
    expect(P, JT_OPEN_STMT, "'{%'");
    if (!is(P, JT_IDENT))
        syntax(P, "expected a statement name, got '%s'", NULL);
    const char *name = P->t[P->cur].s;
    P->cur++;
    struct jnode *n;
    if (strcmp(name, "set") == 0) {
        n = node(P, JN_SET, line);
        n->a = parse_sequence(P, false);
        if (is(P, JT_EQUALS)) {
            P->cur++;
            n->b = parse_sequence(P, false);
        } else {
            expect(P, JT_CLOSE_STMT, "'%}'");
            struct nlist body = {0};
            parse_until(P, &body, ENDSET, "{% endset %}");
            n->list = body.v;
            n->nlist = body.n;
            expect(P, JT_OPEN_STMT, "'{%'");
            expect_ident(P, "endset");
        }
        expect(P, JT_CLOSE_STMT, "'%}'");
    } else if (strcmp(name, "if") == 0) {
        n = parse_if(P, line);
        end_block(P, "endif");
    } else if (strcmp(name, "for") == 0) {
        n = node(P, JN_FOR, line);
        n->a = parse_sequence(P, true);
        if (n->a->kind != JN_IDENT && n->a->kind != JN_TUPLE)
            jfail(P->c, KVD_EBADREQ, line, "expected a name or names for the loop variable");
        if (!is_ident(P, 0, "in"))
            syntax(P, "expected 'in' after the loop variable", NULL);
        P->cur++;
        n->b = parse_expr(P);
        expect(P, JT_CLOSE_STMT, "'%}'");
        struct nlist body = {0}, alt = {0};
        parse_until(P, &body, END_FOR, "{% endfor %}");
        if (is_stmt(P, (const char *const[]){"else", NULL})) {
            P->cur += 2;
            expect(P, JT_CLOSE_STMT, "'%}'");
            parse_until(P, &alt, ENDFOR, "{% endfor %}");
        }
        n->list = body.v;
        n->nlist = body.n;
        n->list2 = alt.v;
        n->nlist2 = alt.n;
        end_block(P, "endfor");
    } else if (strcmp(name, "macro") == 0) {
        n = node(P, JN_MACRO, line);
        struct jnode *id = parse_primary(P);
        if (id->kind != JN_IDENT)
            jfail(P->c, KVD_EBADREQ, line, "expected a macro name");
        n->s = id->s;
        n->n = id->n;
        parse_args(P, false, &n->list, &n->nlist);
        expect(P, JT_CLOSE_STMT, "'%}'");
        struct nlist body = {0};
        parse_until(P, &body, ENDMACRO, "{% endmacro %}");
        n->list2 = body.v;
        n->nlist2 = body.n;
        end_block(P, "endmacro");
    } else if (strcmp(name, "break") == 0 || strcmp(name, "continue") == 0) {
        n = node(P, name[0] == 'b' ? JN_BREAK : JN_CONTINUE, line);
        expect(P, JT_CLOSE_STMT, "'%}'");
    } else if (strncmp(name, "end", 3) == 0 || strcmp(name, "elif") == 0 ||
               strcmp(name, "else") == 0) {
        jfail(P->c, KVD_EBADREQ, line, "unexpected {%% %s %%}", name);
    } else {
        jfail(P->c, KVD_EUNSUPPORTED, line, "statement '%s' is not supported", name);
    }
    return n;
}

static struct jnode *parse_any(struct parser *P)
{
    const struct jtoken *t = tk(P, 0);
    switch (t->type) {
    case JT_COMMENT: {
        P->cur++;
        return node(P, JN_COMMENT, t->line);
    }
    case JT_TEXT: {
        P->cur++;
        struct jnode *n = node(P, JN_STR, t->line);
        n->s = t->s;
        n->n = t->n;
        return n;
    }
    case JT_OPEN_STMT: {
        enter(P);
        struct jnode *n = parse_stmt(P);
        P->depth--;
        return n;
    }
    case JT_OPEN_EXPR: {
        P->cur++;
        struct jnode *n = parse_expr(P);
        expect(P, JT_CLOSE_EXPR, "'}}'");
        return n;
    }
    default:
        syntax(P, "unexpected '%s' outside a tag", NULL);
    }
}

void jinja_parse(struct jctx *c, const struct jtoken *t, size_t n, struct jprog *out)
{
    struct parser P = {.c = c, .t = t, .n = n};
    struct nlist body = {0};
    while (P.cur < P.n)
        nl_push(&P, &body, parse_any(&P));
    out->body = body.v;
    out->n = body.n;
}

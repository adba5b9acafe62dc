/* tool_grammar (tool_call.h): the GBNF of a reply with tool calls, made
 * with the JSON Schema converter: each allowed function's call in the
 * family's syntax, its arguments the function's parameters schema. For
 * tool_choice auto, a lazy grammar: the text before the family's opener
 * is free (an automaton over the opener: any text that does not hold it,
 * or for the families whose opener is the reply's start, any text that
 * does not start with it), and from the opener on the calls are
 * constrained to the end. The opener is tool_parse's (tool_call_impl.h),
 * so the parser reads a call exactly where the grammar constrained one. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "json_schema.h"
#include "tool_call_impl.h"

/* A growing GBNF body. */
struct body {
    char *s;
    size_t len;
    FILE *f;
};

static bool body_open(struct body *b)
{
    b->s = NULL;
    b->len = 0;
    b->f = open_memstream(&b->s, &b->len);
    return b->f != NULL;
}

/* Closes b and adds it as rule `name`; 0 or an error. */
static int body_rule(struct body *b, struct json_schema_conv *c, const char *name,
                     struct kvd_error *err)
{
    if (fclose(b->f)) {
        free(b->s);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    int rc = json_schema_conv_rule(c, name, b->s, err);
    free(b->s);
    return rc;
}

static int rule(struct json_schema_conv *c, struct kvd_error *err, const char *name,
                const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int rule(struct json_schema_conv *c, struct kvd_error *err, const char *name,
                const char *fmt, ...)
{
    char *s = NULL;
    va_list ap;
    va_start(ap, fmt);
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    int rc = json_schema_conv_rule(c, name, s, err);
    free(s);
    return rc;
}

/* A byte as a GBNF literal or class member. */
static void put_char(FILE *f, char ch, bool in_class)
{
    if (ch == '"' || ch == '\\' || (in_class && (ch == ']' || ch == '[' || ch == '^' || ch == '-')))
        fputc('\\', f);
    if (ch == '\n')
        fputs("\\n", f);
    else if (ch == '\t')
        fputs("\\t", f);
    else if (ch == '\r')
        fputs("\\r", f);
    else
        fputc(ch, f);
}

/* The free text before an opener found anywhere: states tool-free-K (K
 * bytes of the opener matched), each a place where the reply may end; the
 * opener's last byte leads to `rest`. */
static int free_anywhere(struct json_schema_conv *c, const char *op, const char *rest,
                         struct kvd_error *err)
{
    size_t L = strlen(op);
    char distinct[32];
    size_t nd = 0;
    for (size_t i = 0; i < L; i++)
        if (!memchr(distinct, op[i], nd) && nd < sizeof distinct)
            distinct[nd++] = op[i];
    for (size_t k = 0; k < L; k++) {
        struct body b;
        if (!body_open(&b))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        fputs("\"\" | [^", b.f);
        for (size_t d = 0; d < nd; d++)
            put_char(b.f, distinct[d], true);
        fputs("] tool-free-0", b.f);
        for (size_t d = 0; d < nd; d++) {
            /* the opener's bytes matched after this one (KMP) */
            size_t m = k;
            while (m > 0 && op[m] != distinct[d]) {
                size_t bl = m - 1;
                while (bl > 0 && memcmp(op, op + m - bl, bl) != 0)
                    bl--;
                m = bl;
            }
            m = op[m] == distinct[d] ? m + 1 : 0;
            fputs(" | \"", b.f);
            put_char(b.f, distinct[d], false);
            if (m == L)
                fprintf(b.f, "\" %s", rest);
            else
                fprintf(b.f, "\" tool-free-%zu", m);
        }
        char name[32];
        snprintf(name, sizeof name, "tool-free-%zu", k);
        int rc = body_rule(&b, c, name, err);
        if (rc)
            return rc;
    }
    return 0;
}

/* The free text of a reply that must not start with one of the start
 * patterns (a space in them: a run of whitespace): the states of each
 * pattern (tool-startP-J: J bytes of pattern P read), the first state
 * shared (the patterns start with whitespace and differ in their first
 * literal byte); every state may end the reply, a byte the patterns do
 * not expect there makes the rest free. */
static int free_start(struct json_schema_conv *c, const struct tool_syntax *syn, const char *rest,
                      struct kvd_error *err)
{
    static const char ws_class[] = "[ \\t\\n\\r]";
    int rc = rule(c, err, "tool-any", ".*");
    for (int p = 0; !rc && p < 2 && syn->start[p]; p++) {
        const char *pat = syn->start[p];
        size_t plen = strlen(pat);
        /* states at each literal byte j > first */
        size_t first = 0;
        while (pat[first] == ' ')
            first++;
        for (size_t j = first + 1; !rc && j < plen; j++) {
            if (pat[j] == ' ')
                continue;
            bool w = pat[j - 1] == ' ';
            size_t nx = j + 1;
            while (nx < plen && pat[nx] == ' ')
                nx++;
            struct body b;
            if (!body_open(&b))
                return kvd_error_set(err, KVD_ENOMEM, "out of memory");
            fputs("\"\"", b.f);
            if (w)
                fprintf(b.f, " | %s tool-start%d-%zu", ws_class, p, j);
            fputs(" | \"", b.f);
            put_char(b.f, pat[j], false);
            if (nx == plen)
                fprintf(b.f, "\" %s", rest);
            else
                fprintf(b.f, "\" tool-start%d-%zu", p, nx);
            fputs(" | [^", b.f);
            put_char(b.f, pat[j], true);
            if (w)
                fputs(" \\t\\n\\r", b.f);
            fputs("] tool-any", b.f);
            char name[48];
            snprintf(name, sizeof name, "tool-start%d-%zu", p, j);
            rc = body_rule(&b, c, name, err);
        }
    }
    if (rc)
        return rc;
    /* the shared first state: whitespace, or each pattern's first byte */
    struct body b;
    if (!body_open(&b))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    fprintf(b.f, "\"\" | %s root", ws_class);
    fputs(" | [^ \\t\\n\\r", b.f);
    for (int p = 0; p < 2 && syn->start[p]; p++) {
        const char *pat = syn->start[p];
        size_t first = 0;
        while (pat[first] == ' ')
            first++;
        put_char(b.f, pat[first], true);
    }
    fputs("] tool-any", b.f);
    for (int p = 0; p < 2 && syn->start[p]; p++) {
        const char *pat = syn->start[p];
        size_t first = 0, plen = strlen(pat);
        while (pat[first] == ' ')
            first++;
        size_t nx = first + 1;
        while (nx < plen && pat[nx] == ' ')
            nx++;
        fputs(" | \"", b.f);
        put_char(b.f, pat[first], false);
        fprintf(b.f, "\" tool-start%d-%zu", p, nx);
    }
    return body_rule(&b, c, "root", err);
}

/* Whether tool i may be called. */
static bool allowed(const struct tool_grammar_req *q, const json_t *fn)
{
    if (q->choice != TOOL_CHOICE_NAMED)
        return true;
    const char *n = json_string_value(json_object_get(fn, "name"));
    return n && q->name && !strcmp(n, q->name);
}

/* The rules of every allowed call: tool-call ::= tool-call-0 | ...; for
 * Llama's lazy grammar also tool-named ::= the rest of a call after its
 * name's opening quote. */
static int calls(struct json_schema_conv *c, const struct tool_grammar_req *q, const char *sp,
                 struct kvd_error *err)
{
    const char *key = q->family == TOOL_LLAMA3 ? "parameters" : "arguments";
    const char *id =
        q->family == TOOL_MISTRAL
            ? " ( SP \",\" SP \"\\\"id\\\"\" SP \":\" SP \"\\\"\" [a-zA-Z0-9]{9} \"\\\"\" )?"
            : "";
    struct body all, named;
    if (!body_open(&all))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    if (!body_open(&named)) {
        fclose(all.f);
        free(all.s);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    int rc = 0;
    size_t n_ok = 0, i;
    json_t *t;
    json_array_foreach(q->tools, i, t)
    {
        const json_t *fn = json_object_get(t, "function");
        if (!allowed(q, fn))
            continue;
        const char *name = json_string_value(json_object_get(fn, "name"));
        const json_t *params = json_object_get(fn, "parameters");
        json_t *any = NULL;
        if (!params) /* a function without parameters: no arguments, {} */
            params = any = json_pack("{s:s, s:{}, s:b}", "type", "object", "properties",
                                     "additionalProperties", 0);
        char rname[40], path[96];
        snprintf(rname, sizeof rname, "tool-%zu-args", i);
        snprintf(path, sizeof path, "%s[%zu].function.parameters", q->param ? q->param : "tools",
                 i);
        rc = params ? json_schema_conv_add(c, params, rname, path, err)
                    : kvd_error_set(err, KVD_ENOMEM, "out of memory");
        json_decref(any);
        if (rc)
            break;
        char cname[40], rest[64];
        snprintf(cname, sizeof cname, "tool-call-%zu", i);
        snprintf(rest, sizeof rest, "tool-rest-%zu", i);
        /* the call after its name's opening quote */
        rc = rule(c, err, rest, "\"%s\\\"\" SP \",\" SP \"\\\"%s\\\"\" SP \":\" SP %s%s SP \"}\"",
                  name, key, rname, id);
        if (!rc)
            rc = rule(c, err, cname, "\"{\" SP \"\\\"name\\\"\" SP \":\" SP \"\\\"\" %s", rest);
        if (rc)
            break;
        fprintf(all.f, "%s%s", n_ok ? " | " : "", cname);
        fprintf(named.f, "%s%s", n_ok ? " | " : "", rest);
        n_ok++;
    }
    if (!rc && n_ok == 0)
        rc = kvd_error_set(err, KVD_EBADREQ, "no tool named '%s'", q->name ? q->name : "");
    if (rc) {
        fclose(all.f);
        fclose(named.f);
        free(all.s);
        free(named.s);
        return rc;
    }
    rc = body_rule(&all, c, "tool-call", err);
    int rc2 = body_rule(&named, c, "tool-named", err);
    if (!rc)
        rc = rc2;
    return rc ? rc : rule(c, err, "SP", "%s", sp);
}

/* The calls after the opener, to the end of the reply: one, or (parallel)
 * any number. */
static int rest_rules(struct json_schema_conv *c, const struct tool_grammar_req *q,
                      struct kvd_error *err)
{
    bool more = q->parallel && q->family != TOOL_LLAMA3 && q->choice != TOOL_CHOICE_NAMED;
    switch (q->family) {
    case TOOL_HERMES:
        /* after <tool_call>: the call, its closing tag, more calls */
        return rule(c, err, "tool-after", "SP tool-call SP \"</tool_call>\"%s SP",
                    more ? " (SP \"<tool_call>\" SP tool-call SP \"</tool_call>\")*" : "");
    case TOOL_MISTRAL:
        return rule(c, err, "tool-after", "SP \"[\" SP tool-call%s SP \"]\" SP",
                    more ? " (SP \",\" SP tool-call)*" : "");
    case TOOL_LLAMA3:
        return rule(c, err, "tool-after", "tool-named SP");
    case TOOL_GENERIC:
        break;
    }
    return rule(c, err, "tool-after", "SP tool-call%s SP \"]\" SP \"}\" SP",
                more ? " (SP \",\" SP tool-call)*" : "");
}

int tool_grammar_gbnf(const struct tool_grammar_req *q, char **out, size_t *len,
                      struct kvd_error *err)
{
    *out = NULL;
    struct json_schema_conv *c;
    if (json_schema_conv_new(&c))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    const char *sp = json_schema_conv_builtin(c, JSON_SCHEMA_SPACE);
    const struct tool_syntax *syn = tool_syntax_of(q->family);
    int rc = sp ? calls(c, q, sp, err) : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    if (!rc)
        rc = rest_rules(c, q, err);
    if (!rc && q->choice == TOOL_CHOICE_AUTO) {
        rc = syn->anywhere ? free_anywhere(c, syn->anywhere, "tool-after", err)
                           : free_start(c, syn, "tool-after", err);
        if (!rc && syn->anywhere)
            rc = rule(c, err, "root", "tool-free-0");
    } else if (!rc) {
        /* required or named: the reply is the calls */
        switch (q->family) {
        case TOOL_HERMES:
            rc = rule(c, err, "root", "SP \"<tool_call>\" tool-after");
            break;
        case TOOL_MISTRAL:
            rc = rule(c, err, "root", "SP \"[TOOL_CALLS]\" tool-after");
            break;
        case TOOL_LLAMA3:
            rc = rule(c, err, "root", "SP tool-call SP");
            break;
        case TOOL_GENERIC:
            rc = rule(c, err, "root",
                      "SP \"{\" SP \"\\\"tool_calls\\\"\" SP \":\" SP \"[\" tool-after");
            break;
        }
    }
    if (!rc)
        rc = json_schema_conv_gbnf(c, out, len, err);
    json_schema_conv_free(c);
    return rc;
}

int tool_grammar(const struct tool_grammar_req *q, struct grammar **out, struct kvd_error *err)
{
    *out = NULL;
    if (q->choice == TOOL_CHOICE_NONE)
        return 0;
    char *text = NULL;
    size_t len = 0;
    int rc = tool_grammar_gbnf(q, &text, &len, err);
    if (!rc)
        rc = json_schema_compile_gbnf(text, len, q->param ? q->param : "tools", out, err);
    free(text);
    return rc;
}

/* JSON Schema -> GBNF (json_schema.h): the rule table, the keywords, the
 * dispatch to the visitors (json_schema_object.c, json_schema_value.c) and
 * the public calls. The grammar follows
 * llama.cpp's json-schema-to-grammar (its whitespace rule, its property
 * order: required ones first, then the optional ones in order, each
 * optional one skippable), and differs where llama.cpp would let through
 * text that does not validate: every keyword is honoured exactly or the
 * schema is refused, naming the keyword's path. */
#include "json_schema_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

/* ---- errors ----------------------------------------------------------------- */

const char *js_fail(struct json_schema_conv *c, int code, const char *keyword, const char *fmt, ...)
{
    if (c->rc)
        return NULL;
    c->rc = code;
    if (!c->err)
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    c->err->code = code;
    vsnprintf(c->err->message, sizeof c->err->message, fmt, ap);
    va_end(ap);
    if (code == KVD_ENOMEM) {
        c->err->param[0] = '\0';
        return NULL;
    }
    char p[sizeof c->path + 256];
    snprintf(p, sizeof p, "%s%s%s%s", c->param ? c->param : "", c->path, keyword ? "." : "",
             keyword ? keyword : "");
    size_t n = strlen(p), cap = sizeof c->err->param;
    if (n < cap) {
        memcpy(c->err->param, p, n + 1);
    } else { /* the start and the end: the keyword stays readable */
        size_t head = cap / 3, tail = cap - head - 4;
        memcpy(c->err->param, p, head);
        memcpy(c->err->param + head, "...", 3);
        memcpy(c->err->param + head + 3, p + n - tail, tail + 1);
    }
    return NULL;
}

/* Appends to the error path; returns the length to restore. */
__attribute__((format(printf, 2, 3))) size_t js_path_push(struct json_schema_conv *c,
                                                          const char *fmt, ...)
{
    size_t old = c->path_len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(c->path + old, sizeof c->path - old, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof c->path - old)
        c->path[old] = '\0'; /* too deep to name: the error names the part it has */
    else
        c->path_len = old + (size_t)n;
    return old;
}

void js_path_pop(struct json_schema_conv *c, size_t len)
{
    c->path_len = len;
    c->path[len] = '\0';
}

/* ---- the rule table ---------------------------------------------------------- */

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static struct js_rule *rule_find(struct json_schema_conv *c, const char *name)
{
    if (!c->tab_cap)
        return NULL;
    for (size_t i = hash_str(name) & (c->tab_cap - 1);; i = (i + 1) & (c->tab_cap - 1)) {
        if (!c->tab[i])
            return NULL;
        struct js_rule *r = &c->rules[c->tab[i] - 1];
        if (!strcmp(r->name, name))
            return r;
    }
}

/* Takes name and body over (also on failure). */
static struct js_rule *rule_insert(struct json_schema_conv *c, char *name, char *body)
{
    if (!name || (c->n_rules + 1) * 2 > c->tab_cap) {
        size_t cap = c->tab_cap ? 2 * c->tab_cap : 256;
        uint32_t *tab = name ? calloc(cap, sizeof *tab) : NULL;
        if (!tab) {
            free(name);
            free(body);
            js_fail(c, KVD_ENOMEM, NULL, "out of memory");
            return NULL;
        }
        for (size_t k = 0; k < c->n_rules; k++) {
            size_t i = hash_str(c->rules[k].name) & (cap - 1);
            while (tab[i])
                i = (i + 1) & (cap - 1);
            tab[i] = (uint32_t)(k + 1);
        }
        free(c->tab);
        c->tab = tab;
        c->tab_cap = cap;
    }
    if (c->n_rules == c->cap_rules) {
        size_t cap = c->cap_rules ? 2 * c->cap_rules : 64;
        struct js_rule *r = realloc(c->rules, cap * sizeof *r);
        if (!r) {
            free(name);
            free(body);
            js_fail(c, KVD_ENOMEM, NULL, "out of memory");
            return NULL;
        }
        c->rules = r;
        c->cap_rules = cap;
    }
    size_t i = hash_str(name) & (c->tab_cap - 1);
    while (c->tab[i])
        i = (i + 1) & (c->tab_cap - 1);
    c->rules[c->n_rules] = (struct js_rule){name, body};
    c->tab[i] = (uint32_t)++c->n_rules;
    c->bytes += strlen(name) + (body ? strlen(body) : 0) + 6;
    if (c->bytes > GRAMMAR_MAX_TEXT)
        js_fail(c, KVD_ETOOLARGE, NULL,
                "the schema's grammar is over %u bytes (a smaller schema, or smaller counts)",
                GRAMMAR_MAX_TEXT);
    return &c->rules[c->n_rules - 1];
}

/* A valid rule name from a hint: [a-zA-Z0-9-], at most 48 bytes. */
static void sanitize(const char *hint, char *out, size_t cap)
{
    size_t n = 0;
    for (; *hint && n + 1 < cap && n < 48; hint++) {
        char ch = *hint;
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '-';
        if (!ok && n && out[n - 1] == '-')
            continue;
        out[n++] = ok ? ch : '-';
    }
    if (!n)
        out[n++] = 'r';
    out[n] = '\0';
}

/* A new rule named after hint (body NULL: reserved, defined later). */
struct js_rule *js_rule_new(struct json_schema_conv *c, const char *hint, const char *body,
                            bool reuse)
{
    if (c->rc)
        return NULL;
    char base[64], name[80];
    sanitize(hint, base, sizeof base);
    snprintf(name, sizeof name, "%s", base);
    for (unsigned k = 2;; k++) {
        struct js_rule *r = rule_find(c, name);
        if (!r)
            break;
        if (reuse && body && r->body && !strcmp(r->body, body))
            return r;
        snprintf(name, sizeof name, "%s-%u", base, k);
    }
    char *n = strdup(name), *b = body ? strdup(body) : NULL;
    if (!n || (body && !b)) {
        free(n);
        free(b);
        js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        return NULL;
    }
    return rule_insert(c, n, b);
}

const char *js_rule(struct json_schema_conv *c, const char *hint, const char *body)
{
    struct js_rule *r = js_rule_new(c, hint, body, true);
    return r ? r->name : NULL;
}

/* ---- shared rules ------------------------------------------------------------- */

/* Code points a raw JSON string character may be: not '"', '\', a control
 * character, DEL, a surrogate or past U+10FFFF (their UTF-8 would not be
 * valid, and a byte-level vocabulary could spell them). */
#define RAW_CHARS "[^\"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U003FFFFF]"
#define HEX "[0-9a-fA-F]"

static const struct {
    const char *name, *body;
    const char *deps[6];
} BUILTINS[] = {
    /* llama.cpp's whitespace: bounded, so a model cannot loop on spaces */
    {"json-space", "| \" \" | \"\\n\"{1,2} [ \\t]{0,20}", {0}},
    /* a \uXXXX escape JSON parsers take: not U+0000, surrogates in pairs */
    {"json-uesc",
     "[1-9a-cA-C] " HEX "{3} | [eEfF] " HEX "{3} | [dD] [0-7] " HEX "{2} | \"0\" ([1-9a-fA-F] " HEX
     "{2} | \"0\" ([1-9a-fA-F] " HEX " | \"0\" [1-9a-fA-F])) | [dD] [89abAB] " HEX
     "{2} \"\\\\u\" [dD] [c-fC-F] " HEX "{2}",
     {0}},
    {"json-char", RAW_CHARS " | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" json-uesc)", {"json-uesc"}},
    /* an object key of an additional property: no escapes, so its text is
     * its value (kvd's check that it is not a declared name) */
    {"json-key-char", RAW_CHARS, {0}},
    {"json-string", "\"\\\"\" json-char* \"\\\"\"", {"json-char"}},
    {"json-integral", "\"0\" | [1-9] [0-9]{0,15}", {0}},
    /* exponents of at most two digits: every number is a finite double */
    {"json-number",
     "\"-\"? json-integral (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?",
     {"json-integral"}},
    {"json-integer", "\"-\"? json-integral", {"json-integral"}},
    {"json-boolean", "\"true\" | \"false\"", {0}},
    {"json-null", "\"null\"", {0}},
    {"json-value",
     "json-object | json-array | json-string | json-number | json-boolean | json-null",
     {"json-object", "json-array", "json-string", "json-number", "json-boolean", "json-null"}},
    {"json-object",
     "\"{\" json-space (json-string json-space \":\" json-space json-value (\",\" json-space "
     "json-string json-space \":\" json-space json-value)*)? json-space \"}\"",
     {"json-space", "json-string", "json-value"}},
    {"json-array",
     "\"[\" json-space (json-value (\",\" json-space json-value)*)? json-space \"]\"",
     {"json-space", "json-value"}},
    /* the day never past the month's last (February: 28, whatever the year) */
    {"json-date",
     "[0-9]{4} \"-\" ((\"0\" [13578] | \"1\" [02]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01]) "
     "| (\"0\" [469] | \"11\") \"-\" (\"0\" [1-9] | [12] [0-9] | \"30\") | \"02-\" (\"0\" [1-9] | "
     "\"1\" [0-9] | \"2\" [0-8]))",
     {0}},
    {"json-time",
     "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]{3})? (\"Z\" | "
     "[+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])",
     {0}},
    {"json-date-time", "json-date \"T\" json-time", {"json-date", "json-time"}},
    {"json-uuid",
     HEX "{8} \"-\" " HEX "{4} \"-\" " HEX "{4} \"-\" " HEX "{4} \"-\" " HEX "{12}",
     {0}},
};

const char *js_builtin(struct json_schema_conv *c, const char *name)
{
    struct js_rule *r = rule_find(c, name);
    if (r)
        return r->name;
    for (size_t i = 0; i < sizeof BUILTINS / sizeof BUILTINS[0]; i++) {
        if (strcmp(BUILTINS[i].name, name))
            continue;
        char *n = strdup(name), *b = strdup(BUILTINS[i].body);
        if (!n || !b) {
            free(n);
            free(b);
            return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        }
        r = rule_insert(c, n, b);
        if (!r)
            return NULL;
        const char *got = r->name; /* its own allocation: stays when the table moves */
        for (size_t k = 0; k < 6 && BUILTINS[i].deps[k]; k++)
            if (!js_builtin(c, BUILTINS[i].deps[k]))
                return NULL;
        return got;
    }
    return js_fail(c, KVD_EINTERNAL, NULL, "no shared rule %s", name);
}

/* ---- keywords ------------------------------------------------------------------ */

/* Annotations: they constrain nothing. */
static const char *const IGNORED[] = {
    "title",           "description",   "default",     "examples",       "$comment",
    "$schema",         "$id",           "$anchor",     "$defs",          "definitions",
    "deprecated",      "readOnly",      "writeOnly",   "discriminator",  "contentMediaType",
    "contentEncoding", "contentSchema", "$vocabulary", "$dynamicAnchor",
};
static const char *const SUPPORTED[] = {
    "type",
    "enum",
    "const",
    "$ref",
    "anyOf",
    "oneOf",
    "allOf",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
};

static bool in_list(const char *k, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(k, list[i]))
            return true;
    return false;
}

#define IN(k, list) in_list(k, list, sizeof list / sizeof list[0])

/* Refuses every keyword kvd does not honour. */
bool js_check_keywords(struct json_schema_conv *c, const json_t *s)
{
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v)
    {
        if (IN(k, SUPPORTED) || IN(k, IGNORED) || !strncmp(k, "x-", 2))
            continue;
        js_fail(c, KVD_EBADREQ, k,
                "the JSON Schema keyword '%.60s' is not supported (docs/grammar.md lists what "
                "kvd generates exactly)",
                k);
        return false;
    }
    return true;
}

/* The supported keyword of s other than those in `allowed`, or NULL. */
const char *js_other_keyword(const json_t *s, const char *const *allowed, size_t n)
{
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)s, k, v)
    {
        if (IN(k, SUPPORTED) && !in_list(k, allowed, n))
            return k;
    }
    return NULL;
}

/* A count keyword: absent (0, *v untouched), or a non-negative integer
 * (1); -1 refused. */
int js_get_count(struct json_schema_conv *c, const json_t *s, const char *key, uint64_t *v)
{
    json_t *x = json_object_get(s, key);
    if (!x)
        return 0;
    double d = json_is_integer(x) ? (double)json_integer_value(x)
               : json_is_real(x)  ? json_real_value(x)
                                  : -1;
    if (!json_is_number(x) || d < 0 || d != floor(d)) {
        js_fail(c, KVD_EBADREQ, key, "'%s' must be a non-negative integer", key);
        return -1;
    }
    if (d > JSON_SCHEMA_MAX_COUNT) {
        js_fail(c, KVD_ETOOLARGE, key, "'%s' is %.0f: kvd generates counts up to %d", key, d,
                JSON_SCHEMA_MAX_COUNT);
        return -1;
    }
    *v = (uint64_t)d;
    return 1;
}

const char *js_visit(struct json_schema_conv *c, const json_t *s, const char *hint);

const char *js_value_rule(struct json_schema_conv *c)
{
    return js_builtin(c, "json-value");
}

/* A rule from a growing body (freed here). */
const char *js_rule_of(struct json_schema_conv *c, const char *hint, struct sbuf *b)
{
    const char *r = b->oom ? js_fail(c, KVD_ENOMEM, NULL, "out of memory")
                           : js_rule(c, hint, b->s ? b->s : "\"\"");
    sb_free(b);
    return r;
}

/* ---- schemas ------------------------------------------------------------------- */

/* The keywords that say what type a schema without "type" is about. */
static const char *const OBJ_KW[] = {"properties", "required", "additionalProperties"};
static const char *const ARR_KW[] = {"items", "prefixItems", "minItems", "maxItems"};
static const char *const STR_KW[] = {"pattern", "format", "minLength", "maxLength"};
static const char *const NUM_KW[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};

static bool has_any(const json_t *s, const char *const *kw, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (json_object_get(s, kw[i]))
            return true;
    return false;
}

#define HAS(s, kw) has_any(s, kw, sizeof kw / sizeof kw[0])

static const char *visit_typed(struct json_schema_conv *c, const json_t *s, const char *t,
                               const char *hint)
{
    if (!strcmp(t, "null"))
        return js_builtin(c, "json-null");
    if (!strcmp(t, "boolean"))
        return js_builtin(c, "json-boolean");
    if (!strcmp(t, "integer") || !strcmp(t, "number"))
        return js_visit_number(c, s, t[0] == 'i', hint);
    if (!strcmp(t, "string"))
        return js_visit_string(c, s, hint);
    if (!strcmp(t, "array"))
        return js_visit_array(c, s, hint);
    return js_visit_object(c, s, hint);
}

static const char *visit_body(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    if (json_is_true(s))
        return js_value_rule(c);
    if (json_is_false(s))
        return js_fail(c, KVD_EBADREQ, NULL, "the schema false: no value is valid");
    if (!json_is_object(s))
        return js_fail(c, KVD_EBADREQ, NULL, "a schema must be an object or a boolean");
    if (!js_check_keywords(c, s))
        return NULL;
    if (json_object_get(s, "$ref"))
        return js_visit_ref(c, s);
    if (json_object_get(s, "anyOf"))
        return js_visit_union(c, s, "anyOf", hint);
    if (json_object_get(s, "oneOf"))
        return js_visit_union(c, s, "oneOf", hint);
    if (json_object_get(s, "allOf"))
        return js_visit_all_of(c, s, hint);
    if (json_object_get(s, "enum") || json_object_get(s, "const"))
        return js_visit_values(c, s, hint);
    const char *types[7];
    size_t n = 0;
    int has = js_get_types(c, s, types, &n);
    if (has < 0)
        return NULL;
    if (!has) { /* the types its keywords are about (a subset of what it accepts) */
        if (HAS(s, OBJ_KW))
            types[n++] = "object";
        if (HAS(s, ARR_KW))
            types[n++] = "array";
        if (HAS(s, STR_KW))
            types[n++] = "string";
        if (HAS(s, NUM_KW))
            types[n++] = "integer";
        if (!n)
            return js_value_rule(c);
    }
    if (n == 1)
        return visit_typed(c, s, types[0], hint);
    struct sbuf b = {0};
    for (size_t i = 0; i < n; i++) {
        char h[80];
        snprintf(h, sizeof h, "%s-%s", hint, types[i]);
        const char *r = visit_typed(c, s, types[i], h);
        if (!r) {
            sb_free(&b);
            return NULL;
        }
        sb_printf(&b, "%s%s", i ? " | " : "", r);
    }
    return js_rule_of(c, hint, &b);
}

/* The rule of schema s (a new one, or a shared one it equals). */
const char *js_visit(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    if (c->rc)
        return NULL;
    if (++c->nodes > JSON_SCHEMA_MAX_NODES)
        return js_fail(c, KVD_ETOOLARGE, NULL, "the schema has over %d parts",
                       JSON_SCHEMA_MAX_NODES);
    if (c->depth >= JSON_SCHEMA_MAX_DEPTH)
        return js_fail(c, KVD_ETOOLARGE, NULL, "the schema nests over %d deep",
                       JSON_SCHEMA_MAX_DEPTH);
    c->depth++;
    const char *r = visit_body(c, s, hint);
    c->depth--;
    return r;
}

/* ---- public --------------------------------------------------------------------- */

int json_schema_conv_new(struct json_schema_conv **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? 0 : KVD_ENOMEM;
}

void json_schema_conv_free(struct json_schema_conv *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < c->n_rules; i++) {
        free(c->rules[i].name);
        free(c->rules[i].body);
    }
    for (size_t i = 0; i < c->n_refs; i++)
        free(c->refs[i].ptr);
    free(c->rules);
    free(c->tab);
    free(c->refs);
    free(c);
}

static bool name_ok(const char *name)
{
    if (!name[0] || !strncmp(name, "json-", 5) || strlen(name) > 64)
        return false;
    for (const char *p = name; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-'))
            return false;
    return true;
}

int json_schema_conv_add(struct json_schema_conv *c, const json_t *schema, const char *name,
                         const char *param, struct kvd_error *err)
{
    if (!name_ok(name))
        return kvd_error_set(err, KVD_EBADREQ, "json_schema: bad rule name '%.40s'", name);
    c->err = err;
    c->param = param;
    c->root = schema;
    c->rc = 0;
    c->depth = 0;
    c->nodes = 0;
    js_path_pop(c, 0);
    for (size_t i = 0; i < c->n_refs; i++)
        free(c->refs[i].ptr);
    c->n_refs = 0; /* references are resolved in one schema */
    if (rule_find(c, name)) {
        js_fail(c, KVD_EBADREQ, NULL, "json_schema: rule '%.40s' is taken", name);
    } else {
        /* name is reserved first, so that a rule named after a property
         * never takes it */
        struct js_rule *r = js_rule_new(c, name, NULL, false);
        size_t ri = r ? (size_t)(r - c->rules) : 0;
        const char *body = r ? js_visit(c, schema, name) : NULL;
        if (body && !(c->rules[ri].body = strdup(body)))
            js_fail(c, KVD_ENOMEM, NULL, "out of memory");
    }
    c->err = NULL;
    return c->rc;
}

int json_schema_conv_rule(struct json_schema_conv *c, const char *name, const char *body,
                          struct kvd_error *err)
{
    c->err = err;
    c->rc = 0;
    c->param = NULL;
    js_path_pop(c, 0);
    struct js_rule *r = rule_find(c, name);
    char *b = strdup(body);
    if (!b) {
        js_fail(c, KVD_ENOMEM, NULL, "out of memory");
    } else if (r) {
        free(r->body);
        r->body = b;
    } else {
        char *n = strdup(name);
        if (!n)
            free(b);
        rule_insert(c, n, b);
    }
    c->err = NULL;
    return c->rc;
}

const char *json_schema_conv_builtin(struct json_schema_conv *c, enum json_schema_builtin b)
{
    static const char *const names[] = {"json-space", "json-value", "json-object", "json-string"};
    c->rc = 0;
    c->err = NULL;
    return js_builtin(c, names[b]);
}

int json_schema_conv_gbnf(struct json_schema_conv *c, char **out, size_t *len,
                          struct kvd_error *err)
{
    struct sbuf b = {0};
    for (size_t i = 0; i < c->n_rules; i++) {
        /* the rule a schema names resolves to its body's rule */
        sb_printf(&b, "%s ::= ", c->rules[i].name);
        sb_puts(&b, c->rules[i].body ? c->rules[i].body : "\"\"");
        sb_puts(&b, "\n");
    }
    if (b.oom) {
        sb_free(&b);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    }
    *out = b.s ? b.s : strdup("");
    *len = b.n;
    return *out ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
}

int json_schema_to_gbnf(const json_t *schema, const char *param, char **out, size_t *len,
                        struct kvd_error *err)
{
    struct json_schema_conv *c;
    if (json_schema_conv_new(&c))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    int rc = json_schema_conv_add(c, schema, "root", param, err);
    if (!rc)
        rc = json_schema_conv_gbnf(c, out, len, err);
    json_schema_conv_free(c);
    return rc;
}

int json_schema_compile_gbnf(const char *gbnf, size_t len, const char *param, struct grammar **out,
                             struct kvd_error *err)
{
    int rc = grammar_compile(gbnf, len, out, err);
    if (rc) {
        kvd_error_param(err, param);
        return rc;
    }
    if (!grammar_can_finish(*out)) {
        grammar_free(*out);
        *out = NULL;
        kvd_error_set(err, KVD_EBADREQ,
                      "the schema has no finite value (a required property or item that "
                      "contains itself)");
        return kvd_error_param(err, param);
    }
    return 0;
}

int json_schema_grammar(const json_t *schema, const char *param, struct grammar **out,
                        struct kvd_error *err)
{
    char *g = NULL;
    size_t len = 0;
    *out = NULL;
    int rc = json_schema_to_gbnf(schema, param, &g, &len, err);
    if (!rc)
        rc = json_schema_compile_gbnf(g, len, param, out, err);
    free(g);
    return rc;
}

int json_object_grammar(struct grammar **out, struct kvd_error *err)
{
    struct json_schema_conv *c;
    if (json_schema_conv_new(&c))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    char *g = NULL;
    size_t len = 0;
    const char *obj = json_schema_conv_builtin(c, JSON_SCHEMA_OBJECT);
    int rc = obj ? json_schema_conv_rule(c, "root", obj, err)
                 : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    if (!rc)
        rc = json_schema_conv_gbnf(c, &g, &len, err);
    if (!rc)
        rc = json_schema_compile_gbnf(g, len, "response_format", out, err);
    free(g);
    json_schema_conv_free(c);
    return rc;
}

/* JSON Schema -> GBNF (json_schema.h): the rule table, the keywords, and
 * the shapes of values (objects, arrays, unions). The grammar follows
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
__attribute__((format(printf, 2, 3))) static size_t path_push(struct json_schema_conv *c,
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

static void path_pop(struct json_schema_conv *c, size_t len)
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
static struct js_rule *rule_new(struct json_schema_conv *c, const char *hint, const char *body,
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
    struct js_rule *r = rule_new(c, hint, body, true);
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
static bool check_keywords(struct json_schema_conv *c, const json_t *s)
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
static const char *other_keyword(const json_t *s, const char *const *allowed, size_t n)
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
static int get_count(struct json_schema_conv *c, const json_t *s, const char *key, uint64_t *v)
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

static const char *visit(struct json_schema_conv *c, const json_t *s, const char *hint);

static const char *value_rule(struct json_schema_conv *c)
{
    return js_builtin(c, "json-value");
}

/* A rule from a growing body (freed here). */
static const char *rule_of(struct json_schema_conv *c, const char *hint, struct sbuf *b)
{
    const char *r = b->oom ? js_fail(c, KVD_ENOMEM, NULL, "out of memory")
                           : js_rule(c, hint, b->s ? b->s : "\"\"");
    sb_free(b);
    return r;
}

/* ---- const and enum ------------------------------------------------------------- */

enum kind { K_NULL = 1, K_BOOL = 2, K_NUM = 4, K_STR = 8, K_ARR = 16, K_OBJ = 32, K_ALL = 63 };

static unsigned kind_of_value(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_NULL:
        return K_NULL;
    case JSON_TRUE:
    case JSON_FALSE:
        return K_BOOL;
    case JSON_INTEGER:
    case JSON_REAL:
        return K_NUM;
    case JSON_STRING:
        return K_STR;
    case JSON_ARRAY:
        return K_ARR;
    default:
        return K_OBJ;
    }
}

static const char *const TYPES[] = {"null",   "boolean", "integer", "number",
                                    "string", "array",   "object"};

static unsigned kind_of_type(const char *t)
{
    static const unsigned k[] = {K_NULL, K_BOOL, K_NUM, K_NUM, K_STR, K_ARR, K_OBJ};
    for (size_t i = 0; i < 7; i++)
        if (!strcmp(t, TYPES[i]))
            return k[i];
    return 0;
}

/* Whether value v has JSON Schema type t. */
static bool value_has_type(const json_t *v, const char *t)
{
    if (!strcmp(t, "integer"))
        return json_is_integer(v) ||
               (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    return (kind_of_value(v) & kind_of_type(t)) != 0;
}

/* The "type" keyword as a list: *n types in out (7 at most); 0 absent. */
static int get_types(struct json_schema_conv *c, const json_t *s, const char *out[7], size_t *n)
{
    *n = 0;
    json_t *t = json_object_get(s, "type");
    if (!t)
        return 0;
    size_t m = json_is_array(t) ? json_array_size(t) : 1;
    if (!json_is_string(t) && (!json_is_array(t) || m == 0 || m > 7)) {
        js_fail(c, KVD_EBADREQ, "type", "'type' must be a type name or an array of them");
        return -1;
    }
    for (size_t i = 0; i < m; i++) {
        json_t *x = json_is_array(t) ? json_array_get(t, i) : t;
        if (!json_is_string(x) || !kind_of_type(json_string_value(x))) {
            js_fail(c, KVD_EBADREQ, "type",
                    "'type' must be null, boolean, integer, number, string, array or object");
            return -1;
        }
        for (size_t k = 0; k < *n; k++)
            if (!strcmp(out[k], json_string_value(x))) {
                js_fail(c, KVD_EBADREQ, "type", "'type' names '%s' twice", out[k]);
                return -1;
            }
        out[(*n)++] = json_string_value(x);
    }
    return 1;
}

/* The literal text of a JSON value. */
static bool add_value_lit(struct json_schema_conv *c, struct sbuf *b, const json_t *v)
{
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) {
        js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        return false;
    }
    sb_lit(b, t, strlen(t));
    free(t);
    return true;
}

static const char *visit_values(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    static const char *const with_enum[] = {"enum", "const", "type"};
    const char *o = other_keyword(s, with_enum, 3);
    if (o)
        return js_fail(c, KVD_EBADREQ, o, "'%s' alongside 'enum' or 'const' is not supported", o);
    json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    if (cst && en)
        return js_fail(c, KVD_EBADREQ, "enum", "give 'enum' or 'const', not both");
    if (en && (!json_is_array(en) || json_array_size(en) == 0))
        return js_fail(c, KVD_EBADREQ, "enum", "'enum' must be a non-empty array");
    const char *types[7];
    size_t n_types;
    if (get_types(c, s, types, &n_types) < 0)
        return NULL;
    size_t n = en ? json_array_size(en) : 1;
    c->nodes += n;
    if (c->nodes > JSON_SCHEMA_MAX_NODES)
        return js_fail(c, KVD_ETOOLARGE, en ? "enum" : "const", "the schema has over %d parts",
                       JSON_SCHEMA_MAX_NODES);
    struct sbuf b = {0};
    size_t alts = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *v = en ? json_array_get(en, i) : cst;
        bool typed = n_types == 0;
        for (size_t k = 0; k < n_types; k++)
            typed |= value_has_type(v, types[k]);
        if (!typed)
            continue; /* a value 'type' excludes can never validate */
        sb_puts(&b, alts++ ? " | " : "");
        if (!add_value_lit(c, &b, v)) {
            sb_free(&b);
            return NULL;
        }
    }
    if (!alts) {
        sb_free(&b);
        return js_fail(c, KVD_EBADREQ, en ? "enum" : "const",
                       "no value of '%s' has the schema's 'type'", en ? "enum" : "const");
    }
    return rule_of(c, hint, &b);
}

/* ---- $ref ----------------------------------------------------------------------- */

/* One JSON pointer token (~0 ~1 and %XX decoded) of length n into out. */
static bool pointer_token(const char *p, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1')) {
            ch = p[++i] == '0' ? '~' : '/';
        } else if (ch == '%' && i + 2 < n) {
            char hx[3] = {p[i + 1], p[i + 2], 0};
            char *end;
            long v = strtol(hx, &end, 16);
            if (*end || v <= 0)
                return false;
            ch = (char)v;
            i += 2;
        }
        if (k + 1 >= cap)
            return false;
        out[k++] = ch;
    }
    out[k] = '\0';
    return true;
}

static const json_t *resolve_pointer(const json_t *root, const char *ref)
{
    if (ref[0] != '#')
        return NULL;
    const char *p = ref + 1;
    const json_t *at = root;
    while (*p) {
        if (*p != '/')
            return NULL;
        p++;
        size_t n = strcspn(p, "/");
        char tok[256];
        if (!pointer_token(p, n, tok, sizeof tok))
            return NULL;
        if (json_is_object(at)) {
            at = json_object_get(at, tok);
        } else if (json_is_array(at)) {
            char *end;
            unsigned long idx = strtoul(tok, &end, 10);
            at = *tok && !*end ? json_array_get(at, idx) : NULL;
        } else {
            at = NULL;
        }
        if (!at)
            return NULL;
        p += n;
    }
    return at;
}

static const char *visit_ref(struct json_schema_conv *c, const json_t *s)
{
    static const char *const alone[] = {"$ref"};
    const char *o = other_keyword(s, alone, 1);
    if (o)
        return js_fail(c, KVD_EBADREQ, o, "'%s' alongside '$ref' is not supported", o);
    json_t *rv = json_object_get(s, "$ref");
    if (!json_is_string(rv))
        return js_fail(c, KVD_EBADREQ, "$ref", "'$ref' must be a string");
    const char *ref = json_string_value(rv);
    for (size_t i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ptr, ref))
            return c->refs[i].name;
    const json_t *target = resolve_pointer(c->root, ref);
    if (!target)
        return js_fail(c, KVD_EBADREQ, "$ref",
                       "'$ref' %.80s: kvd resolves references inside the schema ('#', "
                       "'#/$defs/NAME', '#/definitions/NAME') and this one names nothing there",
                       ref);
    if (c->n_refs == c->cap_refs) {
        size_t cap = c->cap_refs ? 2 * c->cap_refs : 16;
        struct js_ref *r = realloc(c->refs, cap * sizeof *r);
        if (!r)
            return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        c->refs = r;
        c->cap_refs = cap;
    }
    char hint[80];
    snprintf(hint, sizeof hint, "ref%s", ref + 1);
    struct js_rule *r = rule_new(c, hint, NULL, false); /* reserved: recursion refers to it */
    char *ptr = strdup(ref);
    if (!r || !ptr) {
        free(ptr);
        return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
    }
    size_t ri = (size_t)(r - c->rules);
    c->refs[c->n_refs++] = (struct js_ref){ptr, r->name};
    /* errors inside name the target's path */
    char saved[sizeof c->path];
    size_t saved_len = c->path_len;
    memcpy(saved, c->path, saved_len + 1);
    path_pop(c, 0);
    for (const char *p = ref + 1; *p; p++)
        path_push(c, "%c", *p == '/' ? '.' : *p);
    const char *body = visit(c, target, hint);
    memcpy(c->path, saved, saved_len + 1);
    c->path_len = saved_len;
    if (!body)
        return NULL;
    r = &c->rules[ri];
    if (!(r->body = strdup(body)))
        return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
    c->bytes += strlen(body);
    return r->name;
}

/* ---- unions ------------------------------------------------------------------- */

/* The kinds of value s can accept (JSON Schema's meaning, not what kvd
 * generates: used to prove oneOf's alternatives exclusive). */
static unsigned accepted_kinds(struct json_schema_conv *c, const json_t *s, int depth)
{
    if (json_is_true(s) || depth > 16)
        return K_ALL;
    if (!json_is_object(s))
        return 0;
    json_t *x;
    if ((x = json_object_get(s, "$ref")) && json_is_string(x)) {
        const json_t *t = resolve_pointer(c->root, json_string_value(x));
        return t ? accepted_kinds(c, t, depth + 1) : K_ALL;
    }
    unsigned k = K_ALL;
    const char *any[] = {"anyOf", "oneOf"};
    for (int a = 0; a < 2; a++)
        if ((x = json_object_get(s, any[a])) && json_is_array(x)) {
            unsigned u = 0;
            for (size_t i = 0; i < json_array_size(x); i++)
                u |= accepted_kinds(c, json_array_get(x, i), depth + 1);
            k &= u;
        }
    if ((x = json_object_get(s, "allOf")) && json_is_array(x))
        for (size_t i = 0; i < json_array_size(x); i++)
            k &= accepted_kinds(c, json_array_get(x, i), depth + 1);
    if ((x = json_object_get(s, "const")))
        k &= kind_of_value(x);
    if ((x = json_object_get(s, "enum")) && json_is_array(x)) {
        unsigned u = 0;
        for (size_t i = 0; i < json_array_size(x); i++)
            u |= kind_of_value(json_array_get(x, i));
        k &= u;
    }
    if ((x = json_object_get(s, "type"))) {
        unsigned u = 0;
        for (size_t i = 0; i < (json_is_array(x) ? json_array_size(x) : 1); i++) {
            json_t *t = json_is_array(x) ? json_array_get(x, i) : x;
            u |= json_is_string(t) ? kind_of_type(json_string_value(t)) : K_ALL;
        }
        k &= u;
    }
    return k;
}

static const json_t *deref(struct json_schema_conv *c, const json_t *s)
{
    for (int i = 0; i < 16 && json_is_object(s); i++) {
        json_t *r = json_object_get(s, "$ref");
        if (!json_is_string(r))
            return s;
        s = resolve_pointer(c->root, json_string_value(r));
    }
    return s;
}

/* The values property p may take under s: its const or enum (NULL: any). */
static const json_t *prop_values(struct json_schema_conv *c, const json_t *s, const char *p,
                                 json_t **tmp)
{
    const json_t *ps = deref(c, json_object_get(json_object_get(s, "properties"), p));
    if (!json_is_object(ps))
        return NULL;
    json_t *v = json_object_get(ps, "enum");
    if (json_is_array(v))
        return v;
    if ((v = json_object_get(ps, "const")) && (*tmp = json_pack("[O]", v)))
        return *tmp;
    return NULL;
}

/* Whether no value can match both a and b through a required property
 * whose const/enum values differ (a tagged union). */
static bool tagged_apart(struct json_schema_conv *c, const json_t *a, const json_t *b)
{
    a = deref(c, a);
    b = deref(c, b);
    json_t *req = json_object_get(a, "required");
    for (size_t i = 0; i < json_array_size(req); i++) {
        const char *p = json_string_value(json_array_get(req, i));
        json_t *ta = NULL, *tb = NULL;
        const json_t *va = p ? prop_values(c, a, p, &ta) : NULL;
        const json_t *vb = p ? prop_values(c, b, p, &tb) : NULL;
        bool apart = va && vb;
        for (size_t x = 0; apart && x < json_array_size(va); x++)
            for (size_t y = 0; apart && y < json_array_size(vb); y++)
                apart = !json_equal(json_array_get(va, x), json_array_get(vb, y));
        json_decref(ta);
        json_decref(tb);
        if (apart)
            return true;
    }
    return false;
}

static const char *visit_union(struct json_schema_conv *c, const json_t *s, const char *key,
                               const char *hint)
{
    static const char *const alone[] = {"anyOf", "oneOf"};
    const char *o = other_keyword(s, alone, 2);
    if (o)
        return js_fail(c, KVD_EBADREQ, o,
                       "'%s' alongside '%s' is not supported (move it into each alternative)", o,
                       key);
    if (json_object_get(s, "anyOf") && json_object_get(s, "oneOf"))
        return js_fail(c, KVD_EBADREQ, "oneOf", "give 'anyOf' or 'oneOf', not both");
    json_t *alts = json_object_get(s, key);
    size_t n = json_array_size(alts);
    if (!json_is_array(alts) || n == 0)
        return js_fail(c, KVD_EBADREQ, key, "'%s' must be a non-empty array of schemas", key);
    if (!strcmp(key, "oneOf"))
        for (size_t i = 0; i < n; i++)
            for (size_t j = i + 1; j < n; j++) {
                const json_t *a = json_array_get(alts, i), *b = json_array_get(alts, j);
                if (!(accepted_kinds(c, a, 0) & accepted_kinds(c, b, 0)))
                    continue;
                if (tagged_apart(c, a, b) || tagged_apart(c, b, a))
                    continue;
                return js_fail(c, KVD_EBADREQ, key,
                               "oneOf: alternatives %zu and %zu may both match one value; kvd "
                               "generates oneOf exactly only when its alternatives differ in "
                               "type or in a required const/enum property (else use anyOf)",
                               i, j);
            }
    struct sbuf b = {0};
    for (size_t i = 0; i < n; i++) {
        char h[80];
        snprintf(h, sizeof h, "%s-%zu", hint, i);
        size_t p = path_push(c, ".%s[%zu]", key, i);
        const char *r = visit(c, json_array_get(alts, i), h);
        path_pop(c, p);
        if (!r) {
            sb_free(&b);
            return NULL;
        }
        sb_printf(&b, "%s%s", i ? " | " : "", r);
    }
    return rule_of(c, hint, &b);
}

/* ---- objects ------------------------------------------------------------------ */

struct prop {
    const char *name;
    const json_t *schema; /* NULL: any value (a required name without a schema) */
    bool required;
    const char *kv; /* its rule */
};

/* Additional keys: not one of the n declared names (a trie over their code
 * points, one alternative per branch and one for any other character). */
static void not_names(struct sbuf *b, const char **names, size_t n, size_t depth,
                      const char *keychar)
{
    /* names are sorted; those that end at depth are complete */
    bool first = true;
    struct sbuf others = {0};
    for (size_t i = 0; i < n;) {
        const unsigned char *p = (const unsigned char *)names[i] + depth;
        if (!*p) {
            i++;
            continue;
        }
        int len = p[0] < 0x80 ? 1 : p[0] >> 5 == 6 ? 2 : p[0] >> 4 == 14 ? 3 : 4;
        size_t j = i + 1;
        while (j < n && !strncmp(names[j] + depth, (const char *)p, (size_t)len))
            j++;
        uint32_t cp = len == 1 ? p[0] : p[0] & (0x7F >> len);
        for (int k = 1; k < len; k++)
            cp = (cp << 6) | (p[k] & 0x3F);
        js_class_char(&others, cp);
        /* the names under this character: is one of them complete here? */
        bool ends = false, longer = false;
        for (size_t k = i; k < j; k++) {
            size_t rest = strlen(names[k] + depth + len);
            ends |= rest == 0;
            longer |= rest > 0;
        }
        sb_puts(b, first ? "" : " | ");
        first = false;
        sb_puts(b, "[");
        js_class_char(b, cp);
        sb_puts(b, "]");
        if (longer) {
            sb_puts(b, " (");
            not_names(b, names + i, j - i, depth + (size_t)len, keychar);
            sb_printf(b, ")%s", ends ? "" : "?");
        } else {
            sb_printf(b, " %s+", keychar);
        }
        i = j;
    }
    sb_printf(b, "%s[^\"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U003FFFFF%s] %s*",
              first ? "" : " | ", others.s ? others.s : "", keychar);
    b->oom |= others.oom;
    sb_free(&others);
}

/* Whether an additional key (raw characters only) could spell name. */
static bool raw_spellable(const char *name)
{
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        if (*p < 0x20 || *p == '"' || *p == '\\' || *p == 0x7F)
            return false;
    return true; /* jansson's strings are valid UTF-8: no surrogates */
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static const char *object_rule(struct json_schema_conv *c, struct prop *props, size_t n,
                               const json_t *addl, const char *hint)
{
    const char *space = js_builtin(c, "json-space");
    if (!space)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        char h[80];
        snprintf(h, sizeof h, "%s-%s", hint, props[i].name);
        size_t p = path_push(c, ".properties.%s", props[i].name);
        const char *v = props[i].schema ? visit(c, props[i].schema, h) : value_rule(c);
        path_pop(c, p);
        if (!v)
            return NULL;
        struct sbuf kv = {0};
        json_t *key = json_string(props[i].name);
        if (!key || !add_value_lit(c, &kv, key)) {
            json_decref(key);
            sb_free(&kv);
            return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        }
        json_decref(key);
        sb_printf(&kv, " %s \":\" %s %s", space, space, v);
        snprintf(h, sizeof h, "%s-%s-kv", hint, props[i].name);
        if (!(props[i].kv = rule_of(c, h, &kv)))
            return NULL;
    }
    /* additional properties: a key that is none of the names, any value
     * (true) or the schema's */
    const char *add_kv = NULL;
    if (addl && !json_is_false(addl)) {
        char h[80];
        snprintf(h, sizeof h, "%s-additional-value", hint);
        size_t p = path_push(c, ".additionalProperties");
        const char *v = json_is_true(addl) ? value_rule(c) : visit(c, addl, h);
        path_pop(c, p);
        const char *keychar = js_builtin(c, "json-key-char");
        if (!v || !keychar)
            return NULL;
        struct sbuf k = {0};
        const char **names = n ? malloc(n * sizeof *names) : NULL;
        if (n && !names)
            return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        size_t n_names = 0;
        for (size_t i = 0; i < n; i++)
            if (raw_spellable(props[i].name))
                names[n_names++] = props[i].name;
        if (n_names)
            qsort(names, n_names, sizeof *names, cmp_str);
        bool empty_named = n_names && names[0][0] == '\0';
        sb_puts(&k, "\"\\\"\" (");
        not_names(&k, names, n_names, 0, keychar);
        sb_printf(&k, ")%s \"\\\"\" %s \":\" %s %s", empty_named ? "" : "?", space, space, v);
        free(names);
        snprintf(h, sizeof h, "%s-additional-kv", hint);
        if (!(add_kv = rule_of(c, h, &k)))
            return NULL;
    }
    /* "{" required, in order, then the optional ones in order, each
     * skippable: opt_i "rest" rules chain the ones after i */
    size_t n_opt = 0;
    for (size_t i = 0; i < n; i++)
        n_opt += !props[i].required;
    n_opt += add_kv != NULL;
    const char **opt = n_opt ? malloc(n_opt * sizeof *opt) : NULL;
    const char **rest = n_opt ? calloc(n_opt + 1, sizeof *rest) : NULL;
    if (n_opt && (!opt || !rest)) {
        free(opt);
        free(rest);
        return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!props[i].required)
            opt[k++] = props[i].kv;
    if (add_kv)
        opt[k++] = add_kv;
    const char *result = NULL;
    for (size_t i = n_opt; i-- > 1;) { /* rest[i]: the optional ones from i on, each skippable */
        struct sbuf r = {0};
        bool many = add_kv && i == n_opt - 1;
        sb_printf(&r, "(\",\" %s %s)%s", space, opt[i], many ? "*" : "?");
        if (rest[i + 1])
            sb_printf(&r, " %s", rest[i + 1]);
        char h[80];
        snprintf(h, sizeof h, "%s-rest-%zu", hint, i);
        if (!(rest[i] = rule_of(c, h, &r)))
            goto out;
    }
    struct sbuf b = {0};
    sb_printf(&b, "\"{\" %s", space);
    bool any_req = false;
    for (size_t i = 0; i < n; i++) {
        if (!props[i].required)
            continue;
        if (any_req)
            sb_printf(&b, " \",\" %s", space);
        sb_printf(&b, " %s", props[i].kv);
        any_req = true;
    }
    if (n_opt) {
        /* after required ones: a comma, then one of the optional ones and
         * the rest after it; without: one of them, or none */
        if (any_req)
            sb_printf(&b, " (\",\" %s", space);
        sb_puts(&b, " (");
        for (size_t i = 0; i < n_opt; i++) {
            sb_printf(&b, "%s%s", i ? " | " : "", opt[i]);
            if (add_kv && i == n_opt - 1)
                sb_printf(&b, " (\",\" %s %s)*", space, opt[i]);
            if (rest[i + 1])
                sb_printf(&b, " %s", rest[i + 1]);
        }
        sb_puts(&b, any_req ? "))?" : ")?");
    }
    sb_printf(&b, " %s \"}\"", space);
    result = rule_of(c, hint, &b);
out:
    free(opt);
    free(rest);
    return result;
}

/* properties / required / additionalProperties of s into props (a
 * caller-freed array; *n entries). */
static int collect_props(struct json_schema_conv *c, const json_t *s, struct prop **props,
                         size_t *n)
{
    json_t *ps = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    if (ps && !json_is_object(ps)) {
        js_fail(c, KVD_EBADREQ, "properties", "'properties' must be an object of schemas");
        return -1;
    }
    if (req && !json_is_array(req)) {
        js_fail(c, KVD_EBADREQ, "required", "'required' must be an array of names");
        return -1;
    }
    size_t cap = *n + json_object_size(ps) + json_array_size(req);
    struct prop *v = realloc(*props, (cap ? cap : 1) * sizeof *v);
    if (!v) {
        js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        return -1;
    }
    *props = v;
    const char *k;
    json_t *x;
    json_object_foreach(ps, k, x)
    {
        size_t i = 0;
        while (i < *n && strcmp(v[i].name, k))
            i++;
        if (i < *n) {
            if (v[i].schema && !json_equal((json_t *)v[i].schema, x)) {
                js_fail(c, KVD_EBADREQ, "allOf",
                        "allOf: property '%.60s' has different schemas in two parts", k);
                return -1;
            }
            v[i].schema = x;
            continue;
        }
        v[(*n)++] = (struct prop){.name = k, .schema = x};
    }
    for (size_t j = 0; j < json_array_size(req); j++) {
        json_t *r = json_array_get(req, j);
        if (!json_is_string(r)) {
            js_fail(c, KVD_EBADREQ, "required", "'required' must be an array of names");
            return -1;
        }
        size_t i = 0;
        while (i < *n && strcmp(v[i].name, json_string_value(r)))
            i++;
        if (i == *n) /* required without a schema: any value, but present */
            v[(*n)++] = (struct prop){.name = json_string_value(r), .schema = NULL};
        v[i].required = true;
    }
    c->nodes += *n;
    if (c->nodes > JSON_SCHEMA_MAX_NODES) {
        js_fail(c, KVD_ETOOLARGE, "properties", "the schema has over %d parts",
                JSON_SCHEMA_MAX_NODES);
        return -1;
    }
    return 0;
}

static const char *visit_object(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    struct prop *props = NULL;
    size_t n = 0;
    const char *r = NULL;
    json_t *addl = json_object_get(s, "additionalProperties");
    if (addl && !json_is_boolean(addl) && !json_is_object(addl))
        return js_fail(c, KVD_EBADREQ, "additionalProperties",
                       "'additionalProperties' must be a boolean or a schema");
    /* no shape given: any object, as llama.cpp (with a shape, only the
     * declared properties unless additionalProperties says more) */
    if (!addl && !json_object_get(s, "properties") && !json_object_get(s, "required"))
        return js_builtin(c, "json-object");
    if (collect_props(c, s, &props, &n) == 0)
        r = object_rule(c, props, n, addl, hint);
    free(props);
    return r;
}

/* allOf over object schemas: their properties and required names merged
 * (llama.cpp's merge); no additional properties are generated. */
static const char *visit_all_of(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    static const char *const with[] = {"allOf", "type", "properties", "required"};
    const char *o = other_keyword(s, with, 4);
    if (o)
        return js_fail(c, KVD_EBADREQ, o, "'%s' alongside 'allOf' is not supported", o);
    json_t *t = json_object_get(s, "type"), *parts = json_object_get(s, "allOf");
    if (t && (!json_is_string(t) || strcmp(json_string_value(t), "object")))
        return js_fail(c, KVD_EBADREQ, "type", "kvd merges 'allOf' of object schemas only");
    if (!json_is_array(parts) || json_array_size(parts) == 0)
        return js_fail(c, KVD_EBADREQ, "allOf", "'allOf' must be a non-empty array of schemas");
    struct prop *props = NULL;
    size_t n = 0;
    int rc = collect_props(c, s, &props, &n);
    static const char *const part_kw[] = {"type", "properties", "required", "$ref"};
    for (size_t i = 0; rc == 0 && i < json_array_size(parts); i++) {
        size_t p = path_push(c, ".allOf[%zu]", i);
        const json_t *part = json_array_get(parts, i);
        const json_t *d = deref(c, part);
        if (!json_is_object(d) || !check_keywords(c, d)) {
            if (!c->rc)
                js_fail(c, KVD_EBADREQ, NULL, "an 'allOf' part must be an object schema");
            rc = -1;
        } else if ((o = other_keyword(d, part_kw, 4)) || json_object_get(d, "$ref")) {
            js_fail(c, KVD_EBADREQ, o ? o : "$ref",
                    "kvd merges 'allOf' parts of properties and required only; '%s' is not "
                    "supported there",
                    o ? o : "$ref");
            rc = -1;
        } else if ((t = json_object_get(d, "type")) &&
                   (!json_is_string(t) || strcmp(json_string_value(t), "object"))) {
            js_fail(c, KVD_EBADREQ, "type", "kvd merges 'allOf' of object schemas only");
            rc = -1;
        } else {
            rc = collect_props(c, d, &props, &n);
        }
        path_pop(c, p);
    }
    const char *r = rc == 0 ? object_rule(c, props, n, NULL, hint) : NULL;
    free(props);
    return r;
}

/* ---- arrays --------------------------------------------------------------------- */

/* item (sep item){min-1,max-1}, optional when min is 0. */
static void list_of(struct sbuf *b, const char *item, const char *space, uint64_t min, uint64_t max)
{
    if (max == 0) {
        sb_puts(b, "\"\"");
        return;
    }
    char sep[160];
    snprintf(sep, sizeof sep, "(\",\" %s %s)", space, item);
    sb_printf(b, min == 0 ? "(%s " : "%s ", item);
    js_rep(b, sep, min ? min - 1 : 0, max == UINT64_MAX ? UINT64_MAX : max - 1);
    if (min == 0)
        sb_puts(b, ")?");
}

static const char *visit_array(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    const char *space = js_builtin(c, "json-space");
    uint64_t min = 0, max = UINT64_MAX;
    if (!space || get_count(c, s, "minItems", &min) < 0 || get_count(c, s, "maxItems", &max) < 0)
        return NULL;
    if (min > max)
        return js_fail(c, KVD_EBADREQ, "minItems", "'minItems' is over 'maxItems'");
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    if (json_is_array(items) && prefix)
        return js_fail(c, KVD_EBADREQ, "items", "'items' as an array and 'prefixItems' together");
    if (json_is_array(items)) { /* draft 7's tuples */
        prefix = items;
        items = NULL;
    }
    if (prefix && !json_is_array(prefix))
        return js_fail(c, KVD_EBADREQ, "prefixItems", "'prefixItems' must be an array of schemas");
    if (items && !json_is_object(items) && !json_is_boolean(items))
        return js_fail(c, KVD_EBADREQ, "items", "'items' must be a schema");
    struct sbuf b = {0};
    sb_printf(&b, "\"[\" %s ", space);
    size_t n_pre = json_array_size(prefix);
    /* a tuple: its first min(n, maxItems) items (a shorter array is valid) */
    uint64_t take = n_pre < max ? n_pre : max;
    for (size_t i = 0; i < take; i++) {
        char h[80];
        snprintf(h, sizeof h, "%s-tuple-%zu", hint, i);
        size_t p = path_push(
            c, ".%s[%zu]", json_is_array(json_object_get(s, "items")) ? "items" : "prefixItems", i);
        const char *r = visit(c, json_array_get(prefix, i), h);
        path_pop(c, p);
        if (!r) {
            sb_free(&b);
            return NULL;
        }
        sb_printf(&b, i ? " \",\" %s %s" : "%s", i ? space : r, i ? r : "");
    }
    /* then items (any value when absent) from the tuple's end */
    uint64_t emin = min > take ? min - take : 0, emax = max == UINT64_MAX ? max : max - take;
    if (prefix && !items)
        emax = emin; /* extras of any value only as many as minItems needs */
    if (json_is_false(items)) {
        if (emin) {
            sb_free(&b);
            return js_fail(c, KVD_EBADREQ, "minItems",
                           "'minItems' asks for more items than the tuple allows");
        }
        emax = 0;
    }
    if (emax > 0) {
        const char *it;
        if (!items || json_is_true(items)) {
            it = value_rule(c);
        } else {
            char h[80];
            snprintf(h, sizeof h, "%s-item", hint);
            size_t p = path_push(c, ".items");
            it = visit(c, items, h);
            path_pop(c, p);
        }
        if (!it) {
            sb_free(&b);
            return NULL;
        }
        if (take) {
            char sep[160];
            snprintf(sep, sizeof sep, "(\",\" %s %s)", space, it);
            sb_puts(&b, " ");
            js_rep(&b, sep, emin, emax);
        } else {
            list_of(&b, it, space, emin, emax);
        }
    }
    sb_printf(&b, " %s \"]\"", space);
    return rule_of(c, hint, &b);
}

/* ---- strings and numbers -------------------------------------------------------- */

static const char *visit_string(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    uint64_t min = 0, max = UINT64_MAX;
    int has_min = get_count(c, s, "minLength", &min), has_max = get_count(c, s, "maxLength", &max);
    if (has_min < 0 || has_max < 0)
        return NULL;
    bool lens = has_min || has_max;
    if (pat && (fmt || lens))
        return js_fail(c, KVD_EBADREQ, "pattern",
                       "'pattern' with '%s' is not supported (put the length into the pattern)",
                       fmt       ? "format"
                       : has_min ? "minLength"
                                 : "maxLength");
    if (fmt && lens)
        return js_fail(c, KVD_EBADREQ, "format", "'format' with '%s' is not supported",
                       has_min ? "minLength" : "maxLength");
    if (pat) {
        if (!json_is_string(pat))
            return js_fail(c, KVD_EBADREQ, "pattern", "'pattern' must be a string");
        return js_pattern(c, json_string_value(pat), json_string_length(pat), hint);
    }
    if (fmt) {
        if (!json_is_string(fmt))
            return js_fail(c, KVD_EBADREQ, "format", "'format' must be a string");
        return js_format(c, json_string_value(fmt), hint);
    }
    if (!lens)
        return js_builtin(c, "json-string");
    if (min > max)
        return js_fail(c, KVD_EBADREQ, "minLength", "'minLength' is over 'maxLength'");
    const char *ch = js_builtin(c, "json-char");
    if (!ch)
        return NULL;
    struct sbuf b = {0};
    sb_puts(&b, "\"\\\"\" ");
    js_rep(&b, ch, min, max);
    sb_puts(&b, " \"\\\"\"");
    return rule_of(c, hint, &b);
}

/* The largest magnitude of a generated integer: llama.cpp's 16 digits. */
#define INT_LIMIT 9999999999999999.0

static const char *visit_number(struct json_schema_conv *c, const json_t *s, bool integer,
                                const char *hint)
{
    static const char *const bounds[] = {"minimum", "exclusiveMinimum", "maximum",
                                         "exclusiveMaximum"};
    double lo = -INT_LIMIT, hi = INT_LIMIT;
    bool any = false;
    for (int i = 0; i < 4; i++) {
        json_t *x = json_object_get(s, bounds[i]);
        if (!x)
            continue;
        if (!json_is_number(x))
            return js_fail(c, KVD_EBADREQ, bounds[i], "'%s' must be a number", bounds[i]);
        if (!integer)
            return js_fail(c, KVD_EBADREQ, bounds[i],
                           "'%s' on a number is not supported (kvd bounds integers exactly, "
                           "not decimals)",
                           bounds[i]);
        double v = json_number_value(x);
        any = true;
        if (i == 0 && ceil(v) > lo)
            lo = ceil(v);
        if (i == 1 && floor(v) + 1 > lo)
            lo = floor(v) + 1;
        if (i == 2 && floor(v) < hi)
            hi = floor(v);
        if (i == 3 && ceil(v) - 1 < hi)
            hi = ceil(v) - 1;
    }
    if (!any)
        return js_builtin(c, integer ? "json-integer" : "json-number");
    /* bounds past 16 digits are cut to them (what is generated stays inside) */
    if (lo < -INT_LIMIT)
        lo = -INT_LIMIT;
    if (hi > INT_LIMIT)
        hi = INT_LIMIT;
    if (lo > hi)
        return js_fail(c, KVD_EBADREQ, "minimum",
                       "no integer is within 'minimum'/'maximum' (and the 16 digits kvd "
                       "generates)");
    struct sbuf b = {0};
    js_int_range(&b, (int64_t)lo, (int64_t)hi);
    return rule_of(c, hint, &b);
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
        return visit_number(c, s, t[0] == 'i', hint);
    if (!strcmp(t, "string"))
        return visit_string(c, s, hint);
    if (!strcmp(t, "array"))
        return visit_array(c, s, hint);
    return visit_object(c, s, hint);
}

static const char *visit_body(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    if (json_is_true(s))
        return value_rule(c);
    if (json_is_false(s))
        return js_fail(c, KVD_EBADREQ, NULL, "the schema false: no value is valid");
    if (!json_is_object(s))
        return js_fail(c, KVD_EBADREQ, NULL, "a schema must be an object or a boolean");
    if (!check_keywords(c, s))
        return NULL;
    if (json_object_get(s, "$ref"))
        return visit_ref(c, s);
    if (json_object_get(s, "anyOf"))
        return visit_union(c, s, "anyOf", hint);
    if (json_object_get(s, "oneOf"))
        return visit_union(c, s, "oneOf", hint);
    if (json_object_get(s, "allOf"))
        return visit_all_of(c, s, hint);
    if (json_object_get(s, "enum") || json_object_get(s, "const"))
        return visit_values(c, s, hint);
    const char *types[7];
    size_t n = 0;
    int has = get_types(c, s, types, &n);
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
            return value_rule(c);
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
    return rule_of(c, hint, &b);
}

/* The rule of schema s (a new one, or a shared one it equals). */
static const char *visit(struct json_schema_conv *c, const json_t *s, const char *hint)
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
    path_pop(c, 0);
    for (size_t i = 0; i < c->n_refs; i++)
        free(c->refs[i].ptr);
    c->n_refs = 0; /* references are resolved in one schema */
    if (rule_find(c, name)) {
        js_fail(c, KVD_EBADREQ, NULL, "json_schema: rule '%.40s' is taken", name);
    } else {
        /* name is reserved first, so that a rule named after a property
         * never takes it */
        struct js_rule *r = rule_new(c, name, NULL, false);
        size_t ri = r ? (size_t)(r - c->rules) : 0;
        const char *body = r ? visit(c, schema, name) : NULL;
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
    path_pop(c, 0);
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

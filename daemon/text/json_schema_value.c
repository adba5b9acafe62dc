/* JSON Schema -> GBNF (json_schema.h): values that are not objects:
 * const and enum, $ref, unions (anyOf, oneOf where its alternatives cannot
 * both match), arrays, strings and numbers. */
#include "json_schema_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

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
int js_get_types(struct json_schema_conv *c, const json_t *s, const char *out[7], size_t *n)
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
bool js_add_value_lit(struct json_schema_conv *c, struct sbuf *b, const json_t *v)
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

const char *js_visit_values(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    static const char *const with_enum[] = {"enum", "const", "type"};
    const char *o = js_other_keyword(s, with_enum, 3);
    if (o)
        return js_fail(c, KVD_EBADREQ, o, "'%s' alongside 'enum' or 'const' is not supported", o);
    json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    if (cst && en)
        return js_fail(c, KVD_EBADREQ, "enum", "give 'enum' or 'const', not both");
    if (en && (!json_is_array(en) || json_array_size(en) == 0))
        return js_fail(c, KVD_EBADREQ, "enum", "'enum' must be a non-empty array");
    const char *types[7];
    size_t n_types;
    if (js_get_types(c, s, types, &n_types) < 0)
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
        if (!js_add_value_lit(c, &b, v)) {
            sb_free(&b);
            return NULL;
        }
    }
    if (!alts) {
        sb_free(&b);
        return js_fail(c, KVD_EBADREQ, en ? "enum" : "const",
                       "no value of '%s' has the schema's 'type'", en ? "enum" : "const");
    }
    return js_rule_of(c, hint, &b);
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

const char *js_visit_ref(struct json_schema_conv *c, const json_t *s)
{
    static const char *const alone[] = {"$ref"};
    const char *o = js_other_keyword(s, alone, 1);
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
    struct js_rule *r = js_rule_new(c, hint, NULL, false); /* reserved: recursion refers to it */
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
    js_path_pop(c, 0);
    for (const char *p = ref + 1; *p; p++)
        js_path_push(c, "%c", *p == '/' ? '.' : *p);
    const char *body = js_visit(c, target, hint);
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

const json_t *js_deref(struct json_schema_conv *c, const json_t *s)
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
    const json_t *ps = js_deref(c, json_object_get(json_object_get(s, "properties"), p));
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
    a = js_deref(c, a);
    b = js_deref(c, b);
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

const char *js_visit_union(struct json_schema_conv *c, const json_t *s, const char *key,
                           const char *hint)
{
    static const char *const alone[] = {"anyOf", "oneOf"};
    const char *o = js_other_keyword(s, alone, 2);
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
        size_t p = js_path_push(c, ".%s[%zu]", key, i);
        const char *r = js_visit(c, json_array_get(alts, i), h);
        js_path_pop(c, p);
        if (!r) {
            sb_free(&b);
            return NULL;
        }
        sb_printf(&b, "%s%s", i ? " | " : "", r);
    }
    return js_rule_of(c, hint, &b);
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

const char *js_visit_array(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    const char *space = js_builtin(c, "json-space");
    uint64_t min = 0, max = UINT64_MAX;
    if (!space || js_get_count(c, s, "minItems", &min) < 0 ||
        js_get_count(c, s, "maxItems", &max) < 0)
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
        size_t p = js_path_push(
            c, ".%s[%zu]", json_is_array(json_object_get(s, "items")) ? "items" : "prefixItems", i);
        const char *r = js_visit(c, json_array_get(prefix, i), h);
        js_path_pop(c, p);
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
            it = js_value_rule(c);
        } else {
            char h[80];
            snprintf(h, sizeof h, "%s-item", hint);
            size_t p = js_path_push(c, ".items");
            it = js_visit(c, items, h);
            js_path_pop(c, p);
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
    return js_rule_of(c, hint, &b);
}

/* ---- strings and numbers -------------------------------------------------------- */

const char *js_visit_string(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    uint64_t min = 0, max = UINT64_MAX;
    int has_min = js_get_count(c, s, "minLength", &min),
        has_max = js_get_count(c, s, "maxLength", &max);
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
    return js_rule_of(c, hint, &b);
}

/* The largest magnitude of a generated integer: llama.cpp's 16 digits. */
#define INT_LIMIT 9999999999999999.0

const char *js_visit_number(struct json_schema_conv *c, const json_t *s, bool integer,
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
    return js_rule_of(c, hint, &b);
}

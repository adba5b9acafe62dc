/* JSON Schema -> GBNF (json_schema.h): objects (properties, required,
 * additionalProperties, in llama.cpp's property order: the required ones
 * first, then the optional ones in order, each skippable) and allOf over
 * object schemas, merged. */
#include "json_schema_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

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
        size_t p = js_path_push(c, ".properties.%s", props[i].name);
        const char *v = props[i].schema ? js_visit(c, props[i].schema, h) : js_value_rule(c);
        js_path_pop(c, p);
        if (!v)
            return NULL;
        struct sbuf kv = {0};
        json_t *key = json_string(props[i].name);
        if (!key || !js_add_value_lit(c, &kv, key)) {
            json_decref(key);
            sb_free(&kv);
            return js_fail(c, KVD_ENOMEM, NULL, "out of memory");
        }
        json_decref(key);
        sb_printf(&kv, " %s \":\" %s %s", space, space, v);
        snprintf(h, sizeof h, "%s-%s-kv", hint, props[i].name);
        if (!(props[i].kv = js_rule_of(c, h, &kv)))
            return NULL;
    }
    /* additional properties: a key that is none of the names, any value
     * (true) or the schema's */
    const char *add_kv = NULL;
    if (addl && !json_is_false(addl)) {
        char h[80];
        snprintf(h, sizeof h, "%s-additional-value", hint);
        size_t p = js_path_push(c, ".additionalProperties");
        const char *v = json_is_true(addl) ? js_value_rule(c) : js_visit(c, addl, h);
        js_path_pop(c, p);
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
        if (!(add_kv = js_rule_of(c, h, &k)))
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
        if (!(rest[i] = js_rule_of(c, h, &r)))
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
    result = js_rule_of(c, hint, &b);
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

const char *js_visit_object(struct json_schema_conv *c, const json_t *s, const char *hint)
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
const char *js_visit_all_of(struct json_schema_conv *c, const json_t *s, const char *hint)
{
    static const char *const with[] = {"allOf", "type", "properties", "required"};
    const char *o = js_other_keyword(s, with, 4);
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
        size_t p = js_path_push(c, ".allOf[%zu]", i);
        const json_t *part = json_array_get(parts, i);
        const json_t *d = js_deref(c, part);
        if (!json_is_object(d) || !js_check_keywords(c, d)) {
            if (!c->rc)
                js_fail(c, KVD_EBADREQ, NULL, "an 'allOf' part must be an object schema");
            rc = -1;
        } else if ((o = js_other_keyword(d, part_kw, 4)) || json_object_get(d, "$ref")) {
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
        js_path_pop(c, p);
    }
    const char *r = rc == 0 ? object_rule(c, props, n, NULL, hint) : NULL;
    free(props);
    return r;
}

/* The JSON Schema converter's internals, shared by json_schema.c (rules,
 * schemas, objects, arrays, combinators) and json_schema_prim.c (strings,
 * integer ranges, formats, patterns). */
#ifndef KVD_JSON_SCHEMA_IMPL_H
#define KVD_JSON_SCHEMA_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "json_schema.h"

/* A growing string; oom once an append failed (later appends do nothing). */
struct sbuf {
    char *s;
    size_t n, cap;
    bool oom;
};
void sb_add(struct sbuf *b, const char *s, size_t n);
void sb_puts(struct sbuf *b, const char *s);
__attribute__((format(printf, 2, 3))) void sb_printf(struct sbuf *b, const char *fmt, ...);
void sb_free(struct sbuf *b);
/* One code point inside a GBNF class [...], escaped unless alphanumeric. */
void js_class_char(struct sbuf *b, uint32_t c);
/* A GBNF literal "..." of n bytes of UTF-8. */
void sb_lit(struct sbuf *b, const char *s, size_t n);

struct js_rule {
    char *name;
    char *body; /* NULL while reserved (a $ref being converted) */
};

struct js_ref {
    char *ptr;        /* the $ref string */
    const char *name; /* its rule */
};

struct json_schema_conv {
    struct js_rule *rules; /* (n_rules) */
    size_t n_rules, cap_rules;
    uint32_t *tab; /* name hash -> rule index + 1 (0: empty), tab_cap a power of 2 */
    size_t tab_cap;
    size_t bytes; /* of every rule's text */

    /* The schema being added (json_schema_conv_add). */
    const json_t *root;
    struct js_ref *refs;
    size_t n_refs, cap_refs;
    unsigned depth;
    size_t nodes;
    const char *param;
    char path[512]; /* the keyword path inside the schema, for errors */
    size_t path_len;
    int rc;
    struct kvd_error *err;
};

/* Records the first failure: code, the param (c->param, the current path
 * and `keyword`, when given) and the message. Returns NULL (for callers
 * that return a rule name). */
__attribute__((format(printf, 4, 5))) const char *
js_fail(struct json_schema_conv *c, int code, const char *keyword, const char *fmt, ...);
/* Adds `name-hint ::= body` (the hint made a valid, unique name; a rule
 * with the same name and body is reused). The rule's name, or NULL. */
const char *js_rule(struct json_schema_conv *c, const char *hint, const char *body);
/* The name of a shared rule, added with its dependencies on first use:
 * "json-space", "json-char", "json-string", "json-integer", "json-number",
 * "json-boolean", "json-null", "json-value", "json-object", "json-array",
 * "json-date", "json-time", "json-date-time", "json-uuid". */
const char *js_builtin(struct json_schema_conv *c, const char *name);

/* item repeated min..max times (max UINT64_MAX: unbounded), as GBNF,
 * splitting counts over the grammar's repetition bound into groups. */
void js_rep(struct sbuf *b, const char *item, uint64_t min, uint64_t max);
/* The decimal integers in [lo, hi] (as JSON, no leading zeros, no "-0"). */
void js_int_range(struct sbuf *b, int64_t lo, int64_t hi);
/* A string format's rule ("date", "time", "date-time", "uuid"): the whole
 * quoted string; NULL (and c's error) for another format. */
const char *js_format(struct json_schema_conv *c, const char *format, const char *hint);
/* A string matching an ECMAScript pattern (JSON Schema's "pattern":
 * unanchored unless ^...$): the whole quoted string, or NULL and c's error
 * for a construct kvd cannot translate exactly. */
const char *js_pattern(struct json_schema_conv *c, const char *pattern, size_t len,
                       const char *hint);

/* Shared by the converter's files (json_schema.c: the rule table, the
 * keywords and the dispatch; json_schema_object.c; json_schema_value.c).
 * A visitor adds the rules of schema s and returns the name of the rule
 * that matches it, or NULL after js_fail. */
/* The error path grows by a formatted piece (returns the length to give
 * back to js_path_pop) and shrinks back. */
__attribute__((format(printf, 2, 3))) size_t js_path_push(struct json_schema_conv *c,
                                                          const char *fmt, ...);
void js_path_pop(struct json_schema_conv *c, size_t len);
struct js_rule *js_rule_new(struct json_schema_conv *c, const char *hint, const char *body,
                            bool reuse);
bool js_check_keywords(struct json_schema_conv *c, const json_t *s);
const char *js_other_keyword(const json_t *s, const char *const *allowed, size_t n);
int js_get_count(struct json_schema_conv *c, const json_t *s, const char *key, uint64_t *v);
const char *js_visit(struct json_schema_conv *c, const json_t *s, const char *hint);
const char *js_value_rule(struct json_schema_conv *c);
const char *js_rule_of(struct json_schema_conv *c, const char *hint, struct sbuf *b);
const char *js_visit_object(struct json_schema_conv *c, const json_t *s, const char *hint);
const char *js_visit_all_of(struct json_schema_conv *c, const json_t *s, const char *hint);
int js_get_types(struct json_schema_conv *c, const json_t *s, const char *out[7], size_t *n);
bool js_add_value_lit(struct json_schema_conv *c, struct sbuf *b, const json_t *v);
const char *js_visit_values(struct json_schema_conv *c, const json_t *s, const char *hint);
const char *js_visit_ref(struct json_schema_conv *c, const json_t *s);
const json_t *js_deref(struct json_schema_conv *c, const json_t *s);
const char *js_visit_union(struct json_schema_conv *c, const json_t *s, const char *key,
                           const char *hint);
const char *js_visit_array(struct json_schema_conv *c, const json_t *s, const char *hint);
const char *js_visit_string(struct json_schema_conv *c, const json_t *s, const char *hint);
const char *js_visit_number(struct json_schema_conv *c, const json_t *s, bool integer,
                            const char *hint);

#endif

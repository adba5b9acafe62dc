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

#endif

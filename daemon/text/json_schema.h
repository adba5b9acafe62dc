/* JSON Schema -> GBNF: the grammar of the JSON texts a schema accepts, for
 * constrained decoding (grammar.h). The subset llama.cpp's
 * json-schema-to-grammar supports, made exact: every text the grammar
 * allows validates against the schema, and a keyword kvd cannot honour
 * exactly is refused by its path (docs/grammar.md lists both).
 *
 * The schema is a parsed jansson tree (the HTTP API has one; msgpack
 * clients' maps become one), so callers in the server and text layers use
 * it alike. A converter holds the rules of one grammar: add one or more
 * schemas under rule names of the caller's choice, add rules of the
 * caller's own that use them (a tool call's wrapper around its
 * arguments), then take the GBNF text. */
#ifndef KVD_JSON_SCHEMA_H
#define KVD_JSON_SCHEMA_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "kvd/status.h"

struct grammar;

/* Bounds against hostile schemas: nesting of subschemas, subschemas
 * visited (a $ref target once), enum values, bytes of a pattern, and the
 * largest count (minItems, maxLength, ...) kvd turns into a repetition. */
#define JSON_SCHEMA_MAX_DEPTH 64
#define JSON_SCHEMA_MAX_NODES 20000
#define JSON_SCHEMA_MAX_PATTERN 4096
#define JSON_SCHEMA_MAX_COUNT 100000

struct json_schema_conv;

/* The shared rules a caller may reference in its own rules. */
enum json_schema_builtin {
    JSON_SCHEMA_SPACE,  /* optional whitespace, bounded (llama.cpp's) */
    JSON_SCHEMA_VALUE,  /* any JSON value */
    JSON_SCHEMA_OBJECT, /* any JSON object */
    JSON_SCHEMA_STRING, /* any JSON string */
};

int json_schema_conv_new(struct json_schema_conv **out);
void json_schema_conv_free(struct json_schema_conv *c);

/* Adds the rules of `schema` (an object or a boolean; its "$ref"s are
 * resolved inside it: "#", "#/$defs/...", "#/definitions/...") under rule
 * `name` ([a-zA-Z0-9-], not starting with "json-", which kvd's own rules
 * use). `param` is where the schema sits in the request
 * ("response_format.json_schema.schema"): an error's param is param
 * followed by the path of the keyword at fault
 * ("response_format.json_schema.schema.properties.x.not"). 0, or
 * KVD_EBADREQ (an unsupported keyword or an invalid schema: the message
 * says which and why), KVD_ETOOLARGE (past the bounds above, or a grammar
 * over GRAMMAR_MAX_TEXT), KVD_ENOMEM; err filled. */
int json_schema_conv_add(struct json_schema_conv *c, const json_t *schema, const char *name,
                         const char *param, struct kvd_error *err);
/* A rule of the caller's own: `name ::= body` (GBNF; body may reference
 * the names given to json_schema_conv_add and json_schema_conv_builtin's).
 * A name given twice keeps the last body. 0 or KVD_ENOMEM/KVD_EBADREQ. */
int json_schema_conv_rule(struct json_schema_conv *c, const char *name, const char *body,
                          struct kvd_error *err);
/* The name of a shared rule (added to the grammar on first use); NULL when
 * out of memory. */
const char *json_schema_conv_builtin(struct json_schema_conv *c, enum json_schema_builtin b);
/* The grammar's text, every rule once (malloc'd, NUL-terminated; *len its
 * length). One of the rules must be `root` for grammar_compile. */
int json_schema_conv_gbnf(struct json_schema_conv *c, char **out, size_t *len,
                          struct kvd_error *err);

/* One schema as a whole grammar (rule root): json_schema_conv_* above. */
int json_schema_to_gbnf(const json_t *schema, const char *param, char **out, size_t *len,
                        struct kvd_error *err);
/* GBNF text into a compiled grammar for a schema's converter: compile
 * errors are kvd's own (param set to `param`), and a grammar that no
 * finite text satisfies (a required property that is its own ancestor) is
 * refused (KVD_EBADREQ). */
int json_schema_compile_gbnf(const char *gbnf, size_t len, const char *param, struct grammar **out,
                             struct kvd_error *err);
/* json_schema_to_gbnf then json_schema_compile_gbnf. */
int json_schema_grammar(const json_t *schema, const char *param, struct grammar **out,
                        struct kvd_error *err);
/* The grammar of any JSON object (response_format {"type": "json_object"}). */
int json_object_grammar(struct grammar **out, struct kvd_error *err);

#endif

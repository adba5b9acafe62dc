/* JSON Schema -> GBNF (daemon/text/json_schema.c): which texts the grammar
 * of a schema accepts (every supported keyword, checked on valid and
 * invalid instances), the refusals and their keyword paths, the bounds,
 * integer ranges checked exhaustively around random bounds, and random
 * walks of byte-level vocabularies over the grammars whose every finished
 * text jansson parses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "grammar.h"
#include "json_schema.h"

#define PARAM "response_format.json_schema.schema"

static struct grammar_vocab *g_vocab;

/* Bytes 0x01..0xff plus an end token (id 0). */
static int setup(void **state)
{
    (void)state;
    static char bytes[256];
    const char *pieces[256];
    size_t lens[256];
    bool eog[256] = {true};
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        pieces[i] = &bytes[i];
        lens[i] = i == 0 ? 0 : 1;
    }
    return grammar_vocab_new(256, pieces, lens, eog, &g_vocab);
}

static int teardown(void **state)
{
    (void)state;
    grammar_vocab_free(g_vocab);
    return 0;
}

static json_t *parse(const char *json)
{
    json_error_t je;
    json_t *s = json_loads(json, JSON_DECODE_ANY, &je);
    if (!s)
        fail_msg("bad test schema %s: %s", json, je.text);
    return s;
}

static struct grammar *conv(const char *schema)
{
    json_t *s = parse(schema);
    struct kvd_error e = {0};
    struct grammar *g = NULL;
    if (json_schema_grammar(s, PARAM, &g, &e)) {
        char *gb = NULL;
        size_t len;
        struct kvd_error e2 = {0};
        if (json_schema_to_gbnf(s, PARAM, &gb, &len, &e2) == 0)
            print_message("%s\n", gb);
        free(gb);
        fail_msg("%s: %s (param %s)", schema, e.message, e.param);
    }
    json_decref(s);
    return g;
}

/* The refusal of schema: its code, and param must equal want_param. */
static void refused(const char *schema, int code, const char *want_param)
{
    json_t *s = parse(schema);
    struct kvd_error e = {0};
    struct grammar *g = NULL;
    int rc = json_schema_grammar(s, PARAM, &g, &e);
    json_decref(s);
    assert_null(g);
    if (rc != code || strcmp(e.param, want_param))
        fail_msg("%s: code %d param '%s' (%s); want %d '%s'", schema, rc, e.param, e.message, code,
                 want_param);
}

static bool accepts(const struct grammar *g, const char *text)
{
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_matcher_new(g, g_vocab, &m, NULL), 0);
    bool ok =
        grammar_matcher_accept_text(m, text, strlen(text), NULL) == 0 && grammar_matcher_can_end(m);
    grammar_matcher_free(m);
    return ok;
}

/* schema accepts every text of yes and none of no (NULL-terminated). */
static void check(const char *schema, const char *const *yes, const char *const *no)
{
    struct grammar *g = conv(schema);
    for (; yes && *yes; yes++)
        if (!accepts(g, *yes))
            fail_msg("%s should accept %s", schema, *yes);
    for (; no && *no; no++)
        if (accepts(g, *no))
            fail_msg("%s should refuse %s", schema, *no);
    grammar_free(g);
}

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_types(void **state)
{
    (void)state;
    check("{\"type\": \"string\"}", L("\"\"", "\"a b\"", "\"\\u00e9\\n\\\"\"", "\"\xc3\xa9\""),
          L("a", "\"\x01\"", "\"\\u0000\"", "\"\\ud800\"", "\"a", "\"\\x\""));
    check("{\"type\": \"integer\"}", L("0", "-7", "1234567890123456"),
          L("01", "1.5", "+1", "12345678901234567", ""));
    check("{\"type\": \"number\"}", L("0", "-0.5", "1e10", "2.5E-3"),
          L(".5", "1.", "1e100", "--1"));
    check("{\"type\": \"boolean\"}", L("true", "false"), L("1", "null"));
    check("{\"type\": \"null\"}", L("null"), L("0"));
    check("{\"type\": [\"string\", \"null\"]}", L("null", "\"x\""), L("1"));
    check("{}", L("{}", "[1, {\"a\": null}]", "\"s\"", "-1.5"), L("", "{"));
    check("true", L("1"), NULL);
    /* a schema without type: the types its keywords are about */
    check("{\"minLength\": 2}", L("\"ab\""), L("\"a\"", "12"));
    check("{\"description\": \"anything\"}", L("1", "\"a\"", "[]"), NULL);
}

static void test_objects(void **state)
{
    (void)state;
    const char *s = "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, "
                    "\"b\": {\"type\": \"string\"}, \"c\": {\"type\": \"boolean\"}}, "
                    "\"required\": [\"b\"]}";
    /* required first, then the optional ones in order, each skippable */
    check(s,
          L("{\"b\": \"x\"}", "{\"b\":\"x\",\"a\":1}", "{\"b\": \"x\", \"c\": true}",
            "{ \"b\" : \"x\", \"a\" : 1, \"c\" : false }", "{\"b\": \"x\" }",
            "{\n  \"b\": \"x\"\n}"),
          L("{}", "{\"a\": 1, \"b\": \"x\"}", "{\"b\": \"x\", \"c\": true, \"a\": 1}",
            "{\"b\": \"x\", \"d\": 1}", "{\"b\": 1}", "{\"b\": \"x\" , \"a\": 1}",
            "{\"b\": \"x\"}   "));
    /* additional properties: any key but the declared ones */
    check(
        "{\"properties\": {\"ab\": {\"type\": \"integer\"}}, \"additionalProperties\": true}",
        L("{}", "{\"ab\": 1}", "{\"ab\": 1, \"a\": [1]}", "{\"abc\": null, \"b\": 2}", "{\"\": 1}"),
        L("{\"ab\": 1, \"ab\": 2}", "{\"a\\u0062\": 1}"));
    check("{\"type\": \"object\", \"additionalProperties\": {\"type\": \"integer\"}}",
          L("{}", "{\"x\": 1, \"y\": 2}"), L("{\"x\": \"s\"}"));
    check("{\"type\": \"object\", \"properties\": {\"a\": {}}, \"additionalProperties\": false}",
          L("{}", "{\"a\": [1]}"), L("{\"b\": 1}"));
    /* required without a schema: present, any value */
    check("{\"type\": \"object\", \"required\": [\"k\"]}", L("{\"k\": {\"z\": 1}}"), L("{}"));
    check("{\"type\": \"object\"}", L("{}", "{\"a\": 1}"), L("[]"));
    /* a property name that needs escapes */
    check("{\"properties\": {\"q\\\"t\": {\"const\": 1}}, \"required\": [\"q\\\"t\"]}",
          L("{\"q\\\"t\": 1}"), L("{\"q\\\"t\": 2}"));
}

static void test_arrays(void **state)
{
    (void)state;
    check("{\"type\": \"array\", \"items\": {\"type\": \"integer\"}, \"minItems\": 1, "
          "\"maxItems\": 3}",
          L("[1]", "[1, 2,3]", "[ 1 ]"), L("[]", "[1,2,3,4]", "[\"a\"]", "[1,]"));
    check("{\"type\": \"array\"}", L("[]", "[1, \"a\", [null]]"), L("{}"));
    check("{\"prefixItems\": [{\"type\": \"string\"}, {\"type\": \"integer\"}], \"items\": false}",
          L("[\"a\", 1]"), L("[\"a\"]", "[1, \"a\"]", "[\"a\", 1, 2]"));
    check("{\"prefixItems\": [{\"type\": \"string\"}], \"items\": {\"type\": \"null\"}, "
          "\"minItems\": 2, \"maxItems\": 3}",
          L("[\"a\", null]", "[\"a\", null, null]"), L("[\"a\"]", "[\"a\", 1]"));
    check("{\"items\": [{\"const\": 1}, {\"const\": 2}]}", L("[1, 2]"), L("[2, 1]"));
    check("{\"type\": \"array\", \"maxItems\": 0}", L("[]"), L("[1]"));
}

static void test_values(void **state)
{
    (void)state;
    check("{\"enum\": [\"a\", 1, null, {\"k\": [true]}]}",
          L("\"a\"", "1", "null", "{\"k\":[true]}"), L("\"b\"", "2", "{\"k\": [true]}"));
    check("{\"type\": \"string\", \"enum\": [\"a\", 1]}", L("\"a\""), L("1"));
    check("{\"const\": \"\xc3\xa9\\\"\"}", L("\"\xc3\xa9\\\"\""), L("\"e\""));
    refused("{\"type\": \"integer\", \"enum\": [\"a\"]}", KVD_EBADREQ, PARAM ".enum");
    refused("{\"enum\": [1], \"minimum\": 0}", KVD_EBADREQ, PARAM ".minimum");
}

static void test_strings(void **state)
{
    (void)state;
    /* lengths count characters: an escape or a multi-byte character is one */
    check(
        "{\"type\": \"string\", \"minLength\": 2, \"maxLength\": 3}",
        L("\"ab\"", "\"abc\"", "\"\\n\\u00e9\"", "\"\xe2\x82\xac\xc3\xa9\"", "\"\\ud83d\\ude00x\""),
        L("\"a\"", "\"abcd\"", "\"\\ud83d\""));
    check("{\"type\": \"string\", \"format\": \"date\"}", L("\"2024-02-28\"", "\"1999-12-31\""),
          L("\"2024-02-30\"", "\"2024-04-31\"", "\"2024-13-01\"", "\"2024-1-01\""));
    check("{\"type\": \"string\", \"format\": \"time\"}",
          L("\"23:59:59Z\"", "\"00:00:00.123+05:30\""), L("\"24:00:00Z\"", "\"12:00:00\""));
    check("{\"format\": \"date-time\"}", L("\"2020-01-01T10:00:00Z\""), L("\"2020-01-01 10:00\""));
    check("{\"format\": \"uuid\"}", L("\"123e4567-e89b-12d3-a456-426614174000\""),
          L("\"123e4567e89b12d3a456426614174000\""));
    refused("{\"type\": \"string\", \"format\": \"email\"}", KVD_EBADREQ, PARAM ".format");
    refused("{\"type\": \"string\", \"minLength\": 3, \"maxLength\": 2}", KVD_EBADREQ,
            PARAM ".minLength");
    refused("{\"type\": \"string\", \"maxLength\": -1}", KVD_EBADREQ, PARAM ".maxLength");
    refused("{\"type\": \"string\", \"maxLength\": 1.5}", KVD_EBADREQ, PARAM ".maxLength");
}

/* Counts past the grammar's repetition bound (2000) are split into groups. */
static void test_long_counts(void **state)
{
    (void)state;
    size_t n = 5003;
    char *t = malloc(n + 3);
    struct grammar *g = conv("{\"type\": \"string\", \"minLength\": 2500, \"maxLength\": 5001}");
    for (size_t len = 2498; len <= 5003; len++) {
        if (len > 2502 && len < 4998)
            len = 4998;
        t[0] = '"';
        memset(t + 1, 'x', len);
        t[len + 1] = '"';
        t[len + 2] = '\0';
        if (accepts(g, t) != (len >= 2500 && len <= 5001))
            fail_msg("length %zu", len);
    }
    grammar_free(g);
    free(t);
    refused("{\"type\": \"string\", \"maxLength\": 1000000}", KVD_ETOOLARGE, PARAM ".maxLength");
}

static void test_patterns(void **state)
{
    (void)state;
    check("{\"pattern\": \"^[a-z]+$\"}", L("\"abc\""), L("\"\"", "\"aB\"", "\"a1\""));
    check("{\"type\": \"string\", \"pattern\": \"^\\\\d{3}-\\\\d{2,}$\"}",
          L("\"123-45\"", "\"000-123456\""), L("\"12-34\"", "\"123-4\"", "\"abc-12\""));
    /* unanchored: the match may sit anywhere */
    check("{\"pattern\": \"ab\"}", L("\"ab\"", "\"xxabyy\""), L("\"a b\""));
    check("{\"pattern\": \"^(foo|ba[rz])(?:-\\\\w)*$\"}", L("\"foo\"", "\"baz-a-_\""),
          L("\"bar-\"", "\"fo\""));
    /* characters JSON escapes: a quote, a backslash, a newline */
    check("{\"pattern\": \"^.\\\"\\\\\\\\[\\\\n]$\"}", L("\"x\\\"\\\\\\n\""), L("\"x\\\"\\\\n\""));
    check("{\"pattern\": \"^[^a]{2}$\"}", L("\"bc\"", "\"\\u0001\\\"\""), L("\"ab\""));
    check("{\"pattern\": \"^\\\\u00e9+?$\"}", L("\"\xc3\xa9\xc3\xa9\""), L("\"e\""));
    refused("{\"pattern\": \"(?=a)\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"(a)\\\\1\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"\\\\bword\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"a^b\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"^a|b$\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"[a\"}", KVD_EBADREQ, PARAM ".pattern");
    refused("{\"pattern\": \"^a\", \"maxLength\": 3}", KVD_EBADREQ, PARAM ".pattern");
}

/* Every integer around random bounds: accepted exactly when inside. */
static void test_integer_ranges(void **state)
{
    (void)state;
    srand(7);
    for (int k = 0; k < 60; k++) {
        long long scale = k < 20 ? 30 : k < 40 ? 2000 : 300000;
        long long lo = rand() % (2 * scale) - scale, hi = lo + rand() % scale;
        int form = k % 4; /* both bounds, exclusive ones, only min, only max */
        char s[200];
        if (form == 0)
            snprintf(s, sizeof s, "{\"type\": \"integer\", \"minimum\": %lld, \"maximum\": %lld}",
                     lo, hi);
        else if (form == 1)
            snprintf(s, sizeof s,
                     "{\"type\": \"integer\", \"exclusiveMinimum\": %lld, \"exclusiveMaximum\": "
                     "%.1f}",
                     lo - 1, (double)hi + 0.5);
        else if (form == 2)
            snprintf(s, sizeof s, "{\"type\": \"integer\", \"minimum\": %.1f}", (double)lo - 0.5);
        else
            snprintf(s, sizeof s, "{\"type\": \"integer\", \"maximum\": %lld}", hi);
        struct grammar *g = conv(s);
        for (long long v = lo - 120; v <= hi + 120; v += hi - lo > 5000 ? 37 : 1) {
            char t[32];
            snprintf(t, sizeof t, "%lld", v);
            bool in = (form == 3 || v >= lo) && (form == 2 || v <= hi);
            if (accepts(g, t) != in)
                fail_msg("%s: %lld %s", s, v, in ? "refused" : "accepted");
        }
        assert_false(accepts(g, "-0"));
        assert_false(accepts(g, "007"));
        grammar_free(g);
    }
    check("{\"type\": \"integer\", \"minimum\": -5, \"maximum\": 5}", L("-5", "0", "5"),
          L("-0", "6", "-6", "05"));
    refused("{\"type\": \"integer\", \"minimum\": 3, \"maximum\": 2.5}", KVD_EBADREQ,
            PARAM ".minimum");
    refused("{\"type\": \"number\", \"maximum\": 1}", KVD_EBADREQ, PARAM ".maximum");
}

static void test_refs_and_unions(void **state)
{
    (void)state;
    const char *tree = "{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": "
                       "{\"type\": \"integer\"}, \"kids\": {\"type\": \"array\", \"items\": "
                       "{\"$ref\": \"#/$defs/node\"}}}, \"required\": [\"v\"]}}, "
                       "\"$ref\": \"#/$defs/node\"}";
    check(tree, L("{\"v\": 1}", "{\"v\": 1, \"kids\": [{\"v\": 2, \"kids\": []}, {\"v\": 3}]}"),
          L("{\"kids\": []}", "{\"v\": 1, \"kids\": [{}]}"));
    check("{\"definitions\": {\"a~b/c\": {\"const\": 5}}, \"$ref\": \"#/definitions/a~0b~1c\"}",
          L("5"), L("6"));
    check("{\"type\": \"object\", \"properties\": {\"next\": {\"$ref\": \"#\"}}}",
          L("{}", "{\"next\": {\"next\": {}}}"), L("{\"next\": 1}"));
    check("{\"anyOf\": [{\"type\": \"string\", \"maxLength\": 1}, {\"type\": \"integer\"}]}",
          L("\"a\"", "12"), L("\"ab\"", "null"));
    /* oneOf: exact when the alternatives cannot both match */
    check("{\"oneOf\": [{\"type\": \"string\"}, {\"type\": \"array\"}]}", L("\"a\"", "[]"), L("1"));
    const char *tagged =
        "{\"oneOf\": [{\"type\": \"object\", \"properties\": {\"t\": {\"const\": \"a\"}, \"x\": "
        "{\"type\": \"integer\"}}, \"required\": [\"t\"]}, {\"type\": \"object\", "
        "\"properties\": {\"t\": {\"enum\": [\"b\", \"c\"]}}, \"required\": [\"t\"]}]}";
    check(tagged, L("{\"t\": \"a\", \"x\": 1}", "{\"t\": \"c\"}"), L("{\"t\": \"d\"}"));
    refused("{\"oneOf\": [{\"type\": \"string\"}, {\"maxLength\": 2}]}", KVD_EBADREQ,
            PARAM ".oneOf");
    check("{\"allOf\": [{\"properties\": {\"a\": {\"type\": \"integer\"}}, \"required\": "
          "[\"a\"]}, {\"properties\": {\"b\": {\"type\": \"null\"}}}]}",
          L("{\"a\": 1}", "{\"a\": 1, \"b\": null}"), L("{\"b\": null}", "{\"a\": \"x\"}"));
    refused("{\"allOf\": [{\"type\": \"string\"}]}", KVD_EBADREQ, PARAM ".allOf[0].type");
    refused("{\"$ref\": \"#/$defs/missing\"}", KVD_EBADREQ, PARAM ".$ref");
    refused("{\"$ref\": \"https://example.com/s.json\"}", KVD_EBADREQ, PARAM ".$ref");
    refused("{\"$defs\": {\"x\": {\"not\": {}}}, \"properties\": {\"a\": {\"$ref\": "
            "\"#/$defs/x\"}}}",
            KVD_EBADREQ, PARAM ".$defs.x.not");
    /* no finite value: a required property that contains itself */
    refused("{\"type\": \"object\", \"properties\": {\"a\": {\"$ref\": \"#\"}}, \"required\": "
            "[\"a\"]}",
            KVD_EBADREQ, PARAM);
    refused("{\"$defs\": {\"a\": {\"$ref\": \"#/$defs/a\"}}, \"$ref\": \"#/$defs/a\"}", KVD_EBADREQ,
            PARAM);
}

/* Every keyword kvd does not generate exactly is refused by its path. */
static void test_refusals(void **state)
{
    (void)state;
    static const char *const kw[] = {
        "not",
        "if",
        "then",
        "else",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
        "minContains",
        "maxContains",
        "nullable",
        "dependencies",
        "$dynamicRef",
        "bogus",
    };
    for (size_t i = 0; i < sizeof kw / sizeof kw[0]; i++) {
        char s[200], p[200];
        snprintf(s, sizeof s, "{\"properties\": {\"x\": {\"type\": \"string\", \"%s\": 1}}}",
                 kw[i]);
        snprintf(p, sizeof p, PARAM ".properties.x.%s", kw[i]);
        refused(s, KVD_EBADREQ, p);
    }
    refused("{\"anyOf\": [{}, {\"items\": {\"not\": 1}}]}", KVD_EBADREQ,
            PARAM ".anyOf[1].items.not");
    refused("false", KVD_EBADREQ, PARAM);
    refused("3", KVD_EBADREQ, PARAM);
    refused("{\"type\": \"float\"}", KVD_EBADREQ, PARAM ".type");
    /* annotations and extensions are not keywords that constrain */
    check("{\"type\": \"null\", \"title\": \"t\", \"x-foo\": 1, \"examples\": [null]}", L("null"),
          NULL);
}

static void test_bounds(void **state)
{
    (void)state;
    char *s = malloc(16 * 200 + 64);
    strcpy(s, "");
    for (int i = 0; i < 200; i++)
        strcat(s, "{\"items\": ");
    strcat(s, "{}");
    for (int i = 0; i < 200; i++)
        strcat(s, "}");
    json_t *j = parse(s);
    struct kvd_error e = {0};
    struct grammar *g = NULL;
    assert_int_equal(json_schema_grammar(j, PARAM, &g, &e), KVD_ETOOLARGE);
    json_decref(j);
    free(s);
    /* an enum past the bound of parts */
    json_t *en = json_array();
    for (int i = 0; i < JSON_SCHEMA_MAX_NODES + 1; i++)
        json_array_append_new(en, json_integer(i));
    j = json_pack("{s:o}", "enum", en);
    assert_int_equal(json_schema_grammar(j, PARAM, &g, &e), KVD_ETOOLARGE);
    json_decref(j);
    /* a grammar over the text bound: many long distinct enums */
    j = json_object();
    json_t *props = json_object();
    json_object_set_new(j, "properties", props);
    char big[2001];
    memset(big, 'a', 2000);
    big[2000] = '\0';
    for (int i = 0; i < 600; i++) {
        char k[16];
        snprintf(k, sizeof k, "p%d", i);
        big[0] = (char)('a' + i % 26);
        big[1] = (char)('a' + i / 26 % 26);
        json_object_set_new(props, k, json_pack("{s:s}", "const", big));
    }
    assert_int_equal(json_schema_grammar(j, PARAM, &g, &e), KVD_ETOOLARGE);
    json_decref(j);
}

/* The converter's API for callers with rules of their own. */
static void test_api(void **state)
{
    (void)state;
    struct json_schema_conv *c = NULL;
    struct kvd_error e = {0};
    assert_int_equal(json_schema_conv_new(&c), 0);
    json_t *args = parse("{\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
                         "\"string\"}}, \"required\": [\"city\"]}");
    assert_int_equal(json_schema_conv_add(c, args, "tool-weather-args",
                                          "tools[0].function."
                                          "parameters",
                                          &e),
                     0);
    const char *sp = json_schema_conv_builtin(c, JSON_SCHEMA_SPACE);
    assert_non_null(sp);
    char body[256];
    snprintf(body, sizeof body,
             "\"{\\\"name\\\": \\\"weather\\\", \\\"arguments\\\": \" tool-weather-args \"}\"");
    assert_int_equal(json_schema_conv_rule(c, "root", body, &e), 0);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(json_schema_conv_gbnf(c, &text, &len, &e), 0);
    struct grammar *g = NULL;
    assert_int_equal(json_schema_compile_gbnf(text, len, "tools", &g, &e), 0);
    assert_true(accepts(g, "{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}"));
    assert_false(accepts(g, "{\"name\": \"weather\", \"arguments\": {}}"));
    grammar_free(g);
    free(text);
    /* errors name the caller's param */
    json_t *bad = parse("{\"properties\": {\"x\": {\"not\": {}}}}");
    assert_int_equal(
        json_schema_conv_add(c, bad, "tool-b-args", "tools[1].function.parameters", &e),
        KVD_EBADREQ);
    assert_string_equal(e.param, "tools[1].function.parameters.properties.x.not");
    assert_int_equal(json_schema_conv_add(c, args, "json-x", "p", &e), KVD_EBADREQ);
    json_decref(bad);
    json_decref(args);
    json_schema_conv_free(c);
    assert_int_equal(json_object_grammar(&g, &e), 0);
    assert_true(accepts(g, "{\"a\": [1, {}]}"));
    assert_false(accepts(g, "[1]"));
    grammar_free(g);
}

/* Random walks over a byte vocabulary: the tokens the mask allows, ended
 * when the grammar can end; every finished text is JSON. */
static void test_random_walks(void **state)
{
    (void)state;
    static const char *const schemas[] = {
        "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"string\", \"maxLength\": 4}, "
        "\"b\": {\"type\": \"array\", \"items\": {\"type\": \"integer\", \"minimum\": -3, "
        "\"maximum\": 300}, \"maxItems\": 3}, \"c\": {\"enum\": [1.5, \"x\", null]}}, "
        "\"required\": [\"a\"], \"additionalProperties\": {\"type\": \"boolean\"}}",
        "{\"pattern\": \"^[a-c\\\"\\\\\\\\]{1,5}$\"}",
        "{\"type\": \"array\", \"items\": {\"format\": \"date-time\"}, \"maxItems\": 2}",
    };
    srand(11);
    for (size_t k = 0; k < sizeof schemas / sizeof schemas[0]; k++) {
        struct grammar *g = conv(schemas[k]);
        for (int walk = 0; walk < 40; walk++) {
            struct grammar_matcher *m = NULL;
            assert_int_equal(grammar_matcher_new(g, g_vocab, &m, NULL), 0);
            char text[4096];
            size_t n = 0;
            bool ended = false;
            while (n + 1 < sizeof text) {
                size_t n_allowed = 0;
                const uint32_t *bits = grammar_matcher_mask(m, &n_allowed, NULL);
                assert_non_null(bits);
                assert_true(n_allowed > 0);
                if ((bits[0] & 1) && (grammar_matcher_must_end(m) || rand() % 8 == 0)) {
                    ended = true;
                    break;
                }
                uint32_t t;
                do
                    t = 1 + (uint32_t)rand() % 255;
                while (!(bits[t / 32] >> (t % 32) & 1));
                assert_int_equal(grammar_matcher_accept(m, t, NULL), 0);
                text[n++] = (char)t;
            }
            grammar_matcher_free(m);
            if (!ended)
                continue;
            text[n] = '\0';
            json_error_t je;
            json_t *v = json_loadb(text, n, JSON_DECODE_ANY, &je);
            if (!v)
                fail_msg("%s: walk '%s' is not JSON: %s", schemas[k], text, je.text);
            json_decref(v);
        }
        grammar_free(g);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_types),           cmocka_unit_test(test_objects),
        cmocka_unit_test(test_arrays),          cmocka_unit_test(test_values),
        cmocka_unit_test(test_strings),         cmocka_unit_test(test_long_counts),
        cmocka_unit_test(test_patterns),        cmocka_unit_test(test_integer_ranges),
        cmocka_unit_test(test_refs_and_unions), cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_bounds),          cmocka_unit_test(test_api),
        cmocka_unit_test(test_random_walks),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* The GBNF compiler and matcher (daemon/text/grammar*.c): llama.cpp's
 * syntax and errors, which texts a grammar accepts, and that the token mask
 * (the sorted-vocabulary walk, cached per state) allows exactly the tokens
 * the per-token check allows, over random vocabularies with multi-byte,
 * partial and invalid UTF-8 pieces. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "grammar.h"

/* llama.cpp's grammars/json.gbnf, as that file writes it. */
static const char *JSON_GBNF =
    "root   ::= object\n"
    "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "\n"
    "object ::=\n"
    "  \"{\" ws (\n"
    "            string \":\" ws value\n"
    "    (\",\" ws string \":\" ws value)*\n"
    "  )? \"}\" ws\n"
    "\n"
    "array  ::=\n"
    "  \"[\" ws (\n"
    "            value\n"
    "    (\",\" ws value)*\n"
    "  )? \"]\" ws\n"
    "\n"
    "string ::=\n"
    "  \"\\\"\" (\n"
    "    [^\"\\\\\\x7F\\x00-\\x1F] |\n"
    "    \"\\\\\" ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{4}) # escapes\n"
    "  )* \"\\\"\" ws\n"
    "\n"
    "number ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9] "
    "[1-9]{0,15})? ws\n"
    "\n"
    "# Optional space: by convention, applied in this grammar after literal chars when allowed\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";

static const char *ARITH_GBNF = "root  ::= (expr \"=\" ws term \"\\n\")+\n"
                                "expr  ::= term ([-+*/] term)*\n"
                                "term  ::= ident | num | \"(\" ws expr \")\" ws\n"
                                "ident ::= [a-z] [a-z0-9_]* ws\n"
                                "num   ::= [0-9]+ ws\n"
                                "ws    ::= [ \\t\\n]*\n";

static struct grammar *compile_ok(const char *text)
{
    struct grammar *g = NULL;
    struct kvd_error err = {0};
    int rc = grammar_compile(text, strlen(text), &g, &err);
    if (rc)
        fail_msg("compile failed: %s", err.message);
    return g;
}

static int compile_err(const char *text, struct kvd_error *err)
{
    struct grammar *g = NULL;
    memset(err, 0, sizeof *err);
    int rc = grammar_compile(text, strlen(text), &g, err);
    assert_null(g);
    return rc;
}

/* A vocabulary of single bytes 0x01..0xff plus an end token (id 0). */
static struct grammar_vocab *byte_vocab(void)
{
    static char bytes[256];
    const char *pieces[256];
    size_t lens[256];
    bool eog[256] = {true};
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        pieces[i] = &bytes[i];
        lens[i] = i == 0 ? 0 : 1;
    }
    struct grammar_vocab *v = NULL;
    assert_int_equal(grammar_vocab_new(256, pieces, lens, eog, &v), 0);
    return v;
}

/* Whether the whole text is a sentence of the grammar. */
static bool accepts(const struct grammar *g, const struct grammar_vocab *v, const char *text)
{
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_matcher_new(g, v, &m, NULL), 0);
    bool ok =
        grammar_matcher_accept_text(m, text, strlen(text), NULL) == 0 && grammar_matcher_can_end(m);
    grammar_matcher_free(m);
    return ok;
}

static void test_syntax_errors(void **state)
{
    (void)state;
    struct kvd_error e;
    assert_int_equal(compile_err("root = \"a\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "expecting ::="));
    assert_string_equal(e.param, "grammar");
    assert_int_equal(compile_err("root ::= foo\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "undefined rule 'foo'"));
    assert_int_equal(compile_err("start ::= \"a\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "root"));
    assert_int_equal(compile_err("root ::= \"a\n", &e), KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= [a-\n", &e), KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= \"\\q\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "unknown escape"));
    assert_int_equal(compile_err("root ::= \"\\x4\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "2 hex"));
    assert_int_equal(compile_err("root ::= * \"a\"\n", &e), KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= (\"a\"\n", &e), KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= \"a\"{2,\n", &e), KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= \"a\" ) \"b\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "newline"));
    assert_int_equal(compile_err("root ::= \"a\"{2001}\n", &e), KVD_ETOOLARGE);
    /* Left recursion: direct, through another rule, through an empty one. */
    assert_int_equal(compile_err("root ::= root \"a\" | \"b\"\n", &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "left recursion"));
    assert_int_equal(compile_err("root ::= x\nx ::= y \"a\"\ny ::= root | \"b\"\n", &e),
                     KVD_EBADREQ);
    assert_int_equal(compile_err("root ::= e root \"a\" | \"b\"\ne ::= \"c\"?\n", &e), KVD_EBADREQ);
    /* An item that can be empty, repeated: never ends when matched. */
    assert_int_equal(compile_err("root ::= (\"a\"?)*\n", &e), KVD_EBADREQ);

    char deep[2048] = "root ::= ";
    for (int i = 0; i < 300; i++)
        strcat(deep, "(");
    strcat(deep, "\"a\"");
    for (int i = 0; i < 300; i++)
        strcat(deep, ")");
    strcat(deep, "\n");
    assert_int_equal(compile_err(deep, &e), KVD_ETOOLARGE);

    struct grammar *g = NULL;
    assert_int_equal(grammar_compile("root ::= \"a\"\0\n", 13, &g, &e), KVD_EBADREQ);
    assert_null(g);
}

static void test_syntax_accepted(void **state)
{
    (void)state;
    struct grammar *g = compile_ok(JSON_GBNF);
    grammar_free(g);
    g = compile_ok(ARITH_GBNF);
    grammar_free(g);
    /* Comments, CRLF, a rule continued after "|", a newline inside ( ),
     * a rule defined twice (the last definition holds). */
    g = compile_ok("# leading comment\r\nroot ::= \"a\" |\r\n  \"b\" # tail\r\n"
                   "x ::= ( \"c\"\n  \"d\" )\nx ::= \"e\"\n");
    struct grammar_vocab *v = byte_vocab();
    assert_true(accepts(g, v, "a"));
    assert_true(accepts(g, v, "b"));
    assert_false(accepts(g, v, "c"));
    grammar_free(g);
    grammar_vocab_free(v);
}

static void test_acceptance(void **state)
{
    (void)state;
    struct grammar_vocab *v = byte_vocab();
    struct grammar *g = compile_ok(JSON_GBNF);
    assert_true(accepts(g, v, "{}"));
    assert_true(accepts(g, v, "{\"a\": [1, 2.5e3, -0.25, true, null, \"x\\u00e9\"]}"));
    assert_true(accepts(g, v, "{\"k\":{\"n\":{}}} "));
    assert_true(accepts(g, v, "{\"\xc3\xa9\": \"\xe2\x82\xac\"}"));
    assert_false(accepts(g, v, "[]"));                /* root is an object */
    assert_false(accepts(g, v, "{\"a\": 01}"));       /* no leading zero */
    assert_false(accepts(g, v, "{\"a\": \"\x01\"}")); /* control characters */
    assert_false(accepts(g, v, "{\"a\" 1}"));
    assert_false(accepts(g, v, "{")); /* a prefix is not a sentence */
    grammar_free(g);

    g = compile_ok(ARITH_GBNF);
    assert_true(accepts(g, v, "a+b*3= x\n"));
    assert_true(accepts(g, v, "(a +12) /c_2 = 7\nz=1\n"));
    assert_false(accepts(g, v, "a+=1\n"));
    grammar_free(g);

    /* Counted repetition, classes, negation, any character, unicode. */
    g = compile_ok("root ::= [a-c]{2,4} [^x-z] . \"\\u00e9\" [\\U0001F600-\\U0001F64F]?\n");
    assert_true(accepts(g, v, "ab!?\xc3\xa9"));
    assert_true(accepts(g, v, "abca-\xe2\x82\xac\xc3\xa9\xf0\x9f\x98\x80"));
    assert_false(accepts(g, v, "a!?\xc3\xa9"));     /* fewer than 2 */
    assert_false(accepts(g, v, "abcab!?\xc3\xa9")); /* more than 4 */
    assert_false(accepts(g, v, "aby?\xc3\xa9"));    /* y is excluded */
    grammar_free(g);

    g = compile_ok("root ::= \"a\"{3}\n");
    assert_true(accepts(g, v, "aaa"));
    assert_false(accepts(g, v, "aa"));
    assert_false(accepts(g, v, "aaaa"));
    grammar_free(g);

    g = compile_ok("root ::= \"x\" \"y\"{2,}\n");
    assert_false(accepts(g, v, "xy"));
    assert_true(accepts(g, v, "xyy"));
    assert_true(accepts(g, v, "xyyyyyyy"));
    grammar_free(g);
    grammar_vocab_free(v);
}

static void test_accept_and_end(void **state)
{
    (void)state;
    struct grammar_vocab *v = byte_vocab();
    struct grammar *g = compile_ok("root ::= \"ab\" \"c\"?\n");
    struct grammar_matcher *m = NULL;
    struct kvd_error e = {0};
    assert_int_equal(grammar_matcher_new(g, v, &m, &e), 0);
    assert_false(grammar_matcher_can_end(m));
    assert_int_equal(grammar_matcher_accept(m, 0, &e), KVD_EBADREQ); /* end too early */
    assert_int_equal(grammar_matcher_accept(m, 'b', &e), KVD_EBADREQ);
    assert_non_null(strstr(e.message, "does not fit"));
    assert_int_equal(grammar_matcher_accept(m, 'a', &e), 0);
    size_t n = 0;
    const uint32_t *bits = grammar_matcher_mask(m, &n, &e);
    assert_non_null(bits);
    assert_int_equal(n, 1);
    assert_true(bits['b' / 32] >> ('b' % 32) & 1);
    assert_int_equal(grammar_matcher_accept(m, 'b', &e), 0);
    assert_true(grammar_matcher_can_end(m));
    assert_false(grammar_matcher_must_end(m));
    bits = grammar_matcher_mask(m, &n, &e);
    assert_int_equal(n, 2); /* 'c' and the end token */
    assert_true(bits[0] & 1);
    assert_int_equal(grammar_matcher_accept(m, 'c', &e), 0);
    assert_true(grammar_matcher_must_end(m));
    bits = grammar_matcher_mask(m, &n, &e);
    assert_int_equal(n, 1);
    assert_int_equal(grammar_matcher_accept(m, 0, &e), 0);
    grammar_matcher_free(m);
    grammar_free(g);
    grammar_vocab_free(v);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

/* A vocabulary like a real one: every byte (byte-fallback tokens, partial
 * UTF-8 among them), JSON-ish fragments, multi-byte characters whole and
 * cut, invalid sequences, shared prefixes, an end token. */
static struct grammar_vocab *random_vocab(uint32_t n, char ***keep)
{
    static const char *frags[] = {
        "{",        "}",        "\"",       "\":",      "\": ",  ", \"",
        "[",        "]",        "true",     "false",    "null",  "0",
        "12",       "-",        ".5",       "e3",       " ",     "\n",
        "\n  ",     "\\u",      "00",       "e9",       "\\\"",  "ab",
        "abc",      "\xc3",     "\xc3\xa9", "\xe2\x82", "\xac",  "\xe2\x82\xac",
        "\xf0\x9f", "\x98\x80", "\x80",     "\xff",     "a\xc3", "x",
        "=",        "+",        "(",        ")",        "a+b",   "_"};
    size_t nf = sizeof frags / sizeof frags[0];
    char **pieces = calloc(n, sizeof *pieces);
    size_t *lens = calloc(n, sizeof *lens);
    bool *eog = calloc(n, sizeof *eog);
    for (uint32_t t = 0; t < n; t++) {
        char buf[16];
        size_t len;
        if (t == 1) {
            eog[t] = true;
            len = 5;
            memcpy(buf, "</s>", 5);
        } else if (t >= 2 && t < 258) {
            buf[0] = (char)(t - 2);
            len = 1;
        } else {
            len = 0;
            int parts = 1 + (int)rnd(3);
            for (int k = 0; k < parts; k++) {
                const char *f = frags[rnd((uint32_t)nf)];
                size_t fl = strlen(f);
                if (len + fl > sizeof buf)
                    break;
                memcpy(buf + len, f, fl);
                len += fl;
            }
        }
        pieces[t] = malloc(len + 1);
        memcpy(pieces[t], buf, len);
        pieces[t][len] = 0;
        lens[t] = len;
    }
    struct grammar_vocab *v = NULL;
    assert_int_equal(grammar_vocab_new(n, (const char *const *)pieces, lens, eog, &v), 0);
    free(lens);
    free(eog);
    *keep = pieces;
    return v;
}

/* Whether s is valid UTF-8 (the grammar decodes bytes as llama.cpp does,
 * which takes a lead byte's followers as they come: a walk over byte
 * tokens can build invalid UTF-8 inside a string, as llama.cpp can). */
static bool valid_utf8(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        int len = s[i] < 0x80         ? 1
                  : (s[i] >> 5) == 6  ? 2
                  : (s[i] >> 4) == 14 ? 3
                  : (s[i] >> 3) == 30 ? 4
                                      : 0;
        if (!len || i + (size_t)len > n)
            return false;
        for (int k = 1; k < len; k++)
            if ((s[i + k] >> 6) != 2)
                return false;
        i += (size_t)len;
    }
    return true;
}

/* Walks random allowed tokens; at every step the mask equals the per-token
 * check for every token; a JSON walk that ends gives JSON. */
static void random_walks(const char *gbnf, int walks, int max_steps, bool want_json)
{
    char **pieces;
    uint32_t n = 2000;
    struct grammar_vocab *v = random_vocab(n, &pieces);
    struct grammar *g = compile_ok(gbnf);
    int ended = 0, json_checked = 0;
    for (int w = 0; w < walks; w++) {
        struct grammar_matcher *m = NULL;
        assert_int_equal(grammar_matcher_new(g, v, &m, NULL), 0);
        char text[4096];
        size_t tl = 0;
        for (int s = 0; s < max_steps; s++) {
            size_t allowed = 0;
            struct kvd_error e = {0};
            const uint32_t *bits = grammar_matcher_mask(m, &allowed, &e);
            assert_non_null(bits);
            uint32_t *ok = malloc(n * sizeof *ok);
            size_t n_ok = 0, n_end = 0;
            for (uint32_t t = 0; t < n; t++) {
                bool mask = bits[t / 32] >> (t % 32) & 1;
                bool slow = grammar_matcher_allows_slow(m, t);
                if (mask != slow)
                    fail_msg("walk %d step %d token %u (%zu bytes): mask %d, per-token %d", w, s, t,
                             strlen(pieces[t]), mask, slow);
                if (mask && t != 1)
                    ok[n_ok++] = t;
                n_end += mask && t == 1;
            }
            assert_int_equal(n_ok + n_end, allowed);
            if (allowed == 0) {
                free(ok);
                break; /* stuck: possible with this vocabulary, not a failure */
            }
            /* Near the step limit, prefer ending. */
            uint32_t pick = (n_end && (n_ok == 0 || s > max_steps / 2 || rnd(8) == 0))
                                ? 1
                                : ok[rnd((uint32_t)n_ok)];
            free(ok);
            assert_int_equal(grammar_matcher_accept(m, pick, &e), 0);
            if (pick == 1) {
                ended++;
                text[tl] = 0;
                if (want_json && valid_utf8((const unsigned char *)text, tl)) {
                    json_checked++;
                    json_error_t je;
                    json_t *j = json_loadb(text, tl, 0, &je);
                    if (!j)
                        fail_msg("walk %d produced invalid JSON: %s (%s)", w, text, je.text);
                    json_decref(j);
                }
                break;
            }
            size_t pl = strlen(pieces[pick]);
            if (tl + pl < sizeof text) {
                memcpy(text + tl, pieces[pick], pl);
                tl += pl;
            }
        }
        grammar_matcher_free(m);
    }
    assert_true(ended > 0);
    if (want_json)
        assert_true(json_checked > 0);
    grammar_free(g);
    grammar_vocab_free(v);
    for (uint32_t t = 0; t < n; t++)
        free(pieces[t]);
    free(pieces);
}

static void test_mask_equals_per_token_json(void **state)
{
    (void)state;
    random_walks(JSON_GBNF, 12, 60, true);
}

static void test_mask_equals_per_token_arith(void **state)
{
    (void)state;
    random_walks(ARITH_GBNF, 12, 40, false);
}

static void test_mask_equals_per_token_unicode(void **state)
{
    (void)state;
    random_walks("root ::= ([\\u00e0-\\u00ff] | \"\\u20ac\" | [^\\x00-\\x7f\\u00c0-\\u00ff] | "
                 "\"ab\")+\n",
                 12, 30, false);
}

/* A state that comes back is served from the cache. */
static void test_mask_cache(void **state)
{
    (void)state;
    char **pieces;
    struct grammar_vocab *v = random_vocab(1000, &pieces);
    struct grammar *g = compile_ok("root ::= \"\\\"\" [a-z]* \"\\\"\"\n");
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_matcher_new(g, v, &m, NULL), 0);
    assert_int_equal(grammar_matcher_accept_text(m, "\"", 1, NULL), 0);
    size_t n = 0;
    for (int i = 0; i < 20; i++) {
        assert_non_null(grammar_matcher_mask(m, &n, NULL));
        assert_int_equal(grammar_matcher_accept_text(m, "x", 1, NULL), 0);
    }
    struct grammar_matcher_stats st;
    grammar_matcher_get_stats(m, &st);
    assert_int_equal(st.masks_computed, 1);
    assert_int_equal(st.masks_cached, 19);
    grammar_matcher_free(m);
    grammar_free(g);
    grammar_vocab_free(v);
    for (uint32_t t = 0; t < 1000; t++)
        free(pieces[t]);
    free(pieces);
}

/* An ambiguous grammar whose state grows with the input stops with a clear
 * error instead of growing without bound. */
static void test_state_limit(void **state)
{
    (void)state;
    struct grammar_vocab *v = byte_vocab();
    struct grammar *g = compile_ok("root ::= s\ns ::= \"a\" s \"b\" | \"a\" s | \"\"\n");
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_matcher_new(g, v, &m, NULL), 0);
    struct kvd_error e = {0};
    int rc = 0;
    for (int i = 0; i < 6000 && !rc; i++)
        rc = grammar_matcher_accept(m, 'a', &e);
    assert_int_equal(rc, KVD_ETOOLARGE);
    assert_non_null(strstr(e.message, "ambiguous"));
    size_t n;
    assert_null(grammar_matcher_mask(m, &n, &e));
    assert_int_equal(e.code, KVD_ETOOLARGE);
    grammar_matcher_free(m);
    grammar_free(g);
    grammar_vocab_free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_syntax_errors),
        cmocka_unit_test(test_syntax_accepted),
        cmocka_unit_test(test_acceptance),
        cmocka_unit_test(test_accept_and_end),
        cmocka_unit_test(test_mask_equals_per_token_json),
        cmocka_unit_test(test_mask_equals_per_token_arith),
        cmocka_unit_test(test_mask_equals_per_token_unicode),
        cmocka_unit_test(test_mask_cache),
        cmocka_unit_test(test_state_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

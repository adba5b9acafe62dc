/* tool_parse (daemon/text/tool_parse.c): each family's replies split into
 * content and tool calls, whole and streamed (one byte at a time, random
 * pieces: the same content and calls, the content and each call's
 * arguments only ever growing), malformed calls staying content (without
 * incremental commits) or standing as far as they streamed (with), and
 * random mixtures of the syntax's pieces that must never break those
 * rules. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tool_call.h"

struct result {
    char *content;
    size_t n;
    char *name[8], *args[8], *id[8];
    bool done[8];
};

static void result_free(struct result *r)
{
    free(r->content);
    for (size_t i = 0; i < r->n && i < 8; i++) {
        free(r->name[i]);
        free(r->args[i]);
        free(r->id[i]);
    }
    memset(r, 0, sizeof *r);
}

static uint64_t rng = 88172645463325252ull;
static size_t rnd(size_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (size_t)(rng % n);
}

/* Checks that snapshot b continues snapshot a: content and calls grow. */
static void check_grows(const struct tool_parse *p, struct result *prev)
{
    size_t cl;
    const char *c = tool_parse_content(p, &cl);
    size_t pl = prev->content ? strlen(prev->content) : 0;
    assert_true(cl >= pl);
    if (pl)
        assert_memory_equal(c, prev->content, pl);
    assert_true(tool_parse_n_calls(p) >= prev->n);
    for (size_t i = 0; i < prev->n && i < 8; i++) {
        const struct tool_call_out *k = tool_parse_call(p, i);
        assert_string_equal(k->name, prev->name[i]);
        assert_string_equal(k->id, prev->id[i]);
        assert_true(k->args_len >= strlen(prev->args[i]));
        assert_memory_equal(k->args, prev->args[i], strlen(prev->args[i]));
    }
    result_free(prev);
    prev->content = strndup(c, cl);
    prev->n = tool_parse_n_calls(p);
    for (size_t i = 0; i < prev->n && i < 8; i++) {
        const struct tool_call_out *k = tool_parse_call(p, i);
        prev->name[i] = strdup(k->name);
        prev->args[i] = strndup(k->args, k->args_len);
        prev->id[i] = strdup(k->id);
        prev->done[i] = k->args_done;
    }
}

/* Parses text in pieces of `step` bytes (0: random 1-7). */
static void parse(enum tool_family f, bool inc, const char *text, size_t step, struct result *out)
{
    struct tool_parse_conf conf = {.family = f, .incremental = inc};
    struct tool_parse *p;
    assert_int_equal(tool_parse_new(&conf, &p), 0);
    memset(out, 0, sizeof *out);
    size_t n = strlen(text);
    for (size_t at = 0; at < n;) {
        size_t k = step ? step : 1 + rnd(7);
        if (k > n - at)
            k = n - at;
        assert_int_equal(tool_parse_push(p, text + at, k), 0);
        at += k;
        check_grows(p, out);
    }
    assert_int_equal(tool_parse_finish(p), 0);
    check_grows(p, out);
    tool_parse_free(p);
}

/* The same result whole, byte by byte and in random pieces; returns the
 * whole one. */
static void parse_all(enum tool_family f, bool inc, const char *text, struct result *out)
{
    parse(f, inc, text, strlen(text) + 1, out);
    for (int k = 0; k < 6; k++) {
        struct result r;
        parse(f, inc, text, k == 0 ? 1 : 0, &r);
        if (strcmp(r.content, out->content) || r.n != out->n)
            fail_msg("family %s, %s: pieces give [%s] %zu calls, whole [%s] %zu calls",
                     tool_family_name(f), text, r.content, r.n, out->content, out->n);
        for (size_t i = 0; i < r.n && i < 8; i++) {
            assert_string_equal(r.name[i], out->name[i]);
            assert_string_equal(r.args[i], out->args[i]);
        }
        result_free(&r);
    }
}

struct tcase {
    enum tool_family f;
    const char *text;
    const char *content;   /* without incremental commits */
    size_t n;              /* calls */
    const char *calls[6];  /* name, args, ... */
    const char *content_i; /* with incremental commits (NULL: the same) */
    size_t n_i;            /* calls then (0 and content_i NULL: the same as n) */
    const char *calls_i[6];
};

static const struct tcase cases[] = {
    /* Hermes */
    {TOOL_HERMES, "Hello, world.", "Hello, world.", 0, {0}, NULL, 0, {0}},
    {TOOL_HERMES,
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     "",
     1,
     {"get_weather", "{\"city\": \"Paris\"}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": \"}\"}]}}\n"
     "</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n",
     "Let me check.",
     2,
     {"a", "{\"x\": [1, {\"y\": \"}\"}]}", "b", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": }}</tool_call>",
     "<tool_call>{\"name\": \"x\", \"arguments\": {\"a\": }}</tool_call>",
     0,
     {0},
     "",
     1,
     {"x", "{\"a\": }"}},
    {TOOL_HERMES,
     "<tool_call>not json</tool_call> ok",
     "<tool_call>not json</tool_call> ok",
     0,
     {0},
     NULL,
     0,
     {0}},
    {TOOL_HERMES, "a <tool", "a <tool", 0, {0}, NULL, 0, {0}},
    {TOOL_HERMES,
     "a <<tool_call>{\"name\":\"f\"}</tool_call>",
     "a <",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>",
     "",
     1,
     {"f", "{\"a\": 1}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}</tool_call>",
     "",
     1,
     {"f", "{\"a\":1}"},
     "",
     1,
     {"f", "\"{\\\"a\\\":1}\""}},
    {TOOL_HERMES, "<tool_call>{\"name\":\"f\",\"arguments\":{}}", "", 1, {"f", "{}"}, NULL, 0, {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"hel",
     "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"hel",
     0,
     {0},
     "",
     1,
     {"f", "{\"a\": \"hel"}},
    {TOOL_HERMES,
     "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\n\nDone.  ",
     "Done.",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\": \"f\\u0041\", \"arguments\": {\"n\": -1.5e3}}</tool_call>",
     "",
     1,
     {"fA", "{\"n\": -1.5e3}"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\": \"f\", \"arguments\": 12}</tool_call>",
     "",
     1,
     {"f", "12"},
     NULL,
     0,
     {0}},
    {TOOL_HERMES,
     "<tool_call>{\"name\": \"f\", \"name\": \"g\"}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"name\": \"g\"}</tool_call>",
     0,
     {0},
     "\"}</tool_call>",
     1,
     {"f", ""}},
    /* Llama 3.x */
    {TOOL_LLAMA3,
     "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
     "",
     1,
     {"get_weather", "{\"city\": \"Paris\"}"},
     NULL,
     0,
     {0}},
    {TOOL_LLAMA3, "  {\"name\": \"f\", \"parameters\": {}}", "", 1, {"f", "{}"}, NULL, 0, {0}},
    {TOOL_LLAMA3,
     "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
     "",
     1,
     {"f", "{\"x\": 1}"},
     NULL,
     0,
     {0}},
    {TOOL_LLAMA3, "{\"answer\": 42}", "{\"answer\": 42}", 0, {0}, NULL, 0, {0}},
    {TOOL_LLAMA3,
     "The answer {\"name\": \"f\"}",
     "The answer {\"name\": \"f\"}",
     0,
     {0},
     NULL,
     0,
     {0}},
    {TOOL_LLAMA3, "{\"name\": 5}", "{\"name\": 5}", 0, {0}, NULL, 0, {0}},
    {TOOL_LLAMA3,
     "\n{\"name\": \"f\", \"parameters\": {\"x\": }",
     "\n{\"name\": \"f\", "
     "\"parameters\": {\"x\": }",
     0,
     {0},
     "",
     1,
     {"f", "{\"x\": }"}},
    {TOOL_LLAMA3,
     "{\"name\": \"f\", \"arguments\": {}} Then text.",
     "Then text.",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_LLAMA3, "{", "{", 0, {0}, NULL, 0, {0}},
    /* Mistral */
    {TOOL_MISTRAL,
     "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", "
     "\"arguments\": {}}]",
     "",
     2,
     {"f", "{\"a\": 1}", "g", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_MISTRAL,
     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}, \"id\": \"abc123def\"}]",
     "",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_MISTRAL,
     "Sure! [TOOL_CALLS]{\"name\":\"f\",\"arguments\":{}}",
     "Sure!",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    {TOOL_MISTRAL, "[TOOL_CALLS] garbage", "[TOOL_CALLS] garbage", 0, {0}, NULL, 0, {0}},
    {TOOL_MISTRAL,
     "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}, oops",
     "oops",
     1,
     {"f", "{}"},
     NULL,
     0,
     {0}},
    /* generic */
    {TOOL_GENERIC,
     "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]}",
     "",
     1,
     {"f", "{\"a\": 1}"},
     NULL,
     0,
     {0}},
    {TOOL_GENERIC,
     " {\"tool_calls\":[{\"name\":\"f\",\"arguments\":{}},{\"name\":\"g\",\"arguments\":{\"b\":[1,"
     "2]}}]}",
     "",
     2,
     {"f", "{}", "g", "{\"b\":[1,2]}"},
     NULL,
     0,
     {0}},
    {TOOL_GENERIC,
     "Hello {\"tool_calls\": []}",
     "Hello {\"tool_calls\": []}",
     0,
     {0},
     NULL,
     0,
     {0}},
    {TOOL_GENERIC, "{\"tool_calls\": []}", "{\"tool_calls\": []}", 0, {0}, NULL, 0, {0}},
    {TOOL_GENERIC, "{\"response\": \"hi\"}", "{\"response\": \"hi\"}", 0, {0}, NULL, 0, {0}},
};

static void check_case(const struct tcase *t, bool inc)
{
    struct result r;
    parse_all(t->f, inc, t->text, &r);
    const char *content = inc && t->content_i ? t->content_i : t->content;
    size_t n = inc && t->content_i ? t->n_i : t->n;
    const char *const *calls = inc && t->content_i ? t->calls_i : t->calls;
    if (strcmp(r.content, content) || r.n != n)
        fail_msg("%s%s: [%s] -> content [%s] and %zu calls, expected [%s] and %zu",
                 tool_family_name(t->f), inc ? " (incremental)" : "", t->text, r.content, r.n,
                 content, n);
    for (size_t i = 0; i < n; i++) {
        assert_string_equal(r.name[i], calls[2 * i]);
        assert_string_equal(r.args[i], calls[2 * i + 1]);
        if (t->f == TOOL_MISTRAL) {
            assert_int_equal(strlen(r.id[i]), 9);
        } else {
            assert_int_equal(strlen(r.id[i]), 29);
            assert_memory_equal(r.id[i], "call_", 5);
        }
        for (const char *c = r.id[i] + (t->f == TOOL_MISTRAL ? 0 : 5); *c; c++)
            assert_true((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                        (*c >= '0' && *c <= '9'));
    }
    result_free(&r);
}

static void test_cases(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_case(&cases[i], false);
        check_case(&cases[i], true);
    }
}

/* Ids differ from call to call. */
static void test_ids(void **state)
{
    (void)state;
    struct result a, b;
    const char *t = "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>"
                    "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";
    parse(TOOL_HERMES, false, t, 3, &a);
    parse(TOOL_HERMES, false, t, 3, &b);
    assert_int_equal(a.n, 2);
    assert_string_not_equal(a.id[0], a.id[1]);
    assert_string_not_equal(a.id[0], b.id[0]);
    result_free(&a);
    result_free(&b);
}

/* Random mixtures of the syntax's pieces: every chunking agrees, and
 * content and calls only grow (checked by parse). */
static void test_random(void **state)
{
    (void)state;
    static const char *const frag[] = {"<tool_call>",
                                       "</tool_call>",
                                       "[TOOL_CALLS]",
                                       "<|python_tag|>",
                                       "{",
                                       "}",
                                       "[",
                                       "]",
                                       "\"name\"",
                                       "\"arguments\"",
                                       "\"parameters\"",
                                       "\"tool_calls\"",
                                       ":",
                                       ",",
                                       " ",
                                       "\n",
                                       "\"f\"",
                                       "\"x\\\"y\"",
                                       "1",
                                       "-2.5",
                                       "true",
                                       "null",
                                       "text",
                                       "<tool",
                                       "\\",
                                       "\"",
                                       "{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}",
                                       "é",
                                       "😀"};
    char text[600];
    for (int it = 0; it < 3000; it++) {
        size_t len = 0, k = 1 + rnd(24);
        text[0] = 0;
        for (size_t i = 0; i < k; i++) {
            const char *f = frag[rnd(sizeof frag / sizeof frag[0])];
            if (len + strlen(f) + 1 > sizeof text)
                break;
            memcpy(text + len, f, strlen(f) + 1);
            len += strlen(f);
        }
        for (int f = TOOL_GENERIC; f <= TOOL_MISTRAL; f++)
            for (int inc = 0; inc < 2; inc++) {
                struct result r;
                parse_all((enum tool_family)f, inc, text, &r);
                /* without calls, the content is the text itself */
                if (r.n == 0)
                    assert_string_equal(r.content, text);
                result_free(&r);
            }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cases),
        cmocka_unit_test(test_ids),
        cmocka_unit_test(test_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

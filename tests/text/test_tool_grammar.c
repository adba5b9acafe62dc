/* tool_grammar (daemon/text/tool_grammar.c): each family's grammar for
 * tool_choice required, named and auto (lazy), with and without parallel
 * calls: the texts it must accept and refuse, refusals of a bad schema by
 * its path, and random walks over a byte vocabulary whose finished texts
 * the parser (tool_parse, incremental) reads as the grammar meant: every
 * call of a required/named reply and every call after an auto reply's
 * opener is whole, named after an allowed tool, with arguments that are a
 * JSON object; text without the opener stays free and is content. */
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
#include "tool_call.h"

static struct grammar_vocab *g_vocab;
static json_t *g_tools;

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
    g_tools = json_loads(
        "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
        "{\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", "
        "\"maxLength\": 8}, \"unit\": {\"enum\": [\"c\", \"f\"]}}, \"required\": [\"location\"], "
        "\"additionalProperties\": false}}}, {\"type\": \"function\", \"function\": {\"name\": "
        "\"calc\", \"description\": \"x\", \"parameters\": {\"type\": \"object\", \"properties\": "
        "{\"n\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 99}}, \"required\": "
        "[\"n\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"ping\"}}]",
        0, NULL);
    assert_non_null(g_tools);
    return grammar_vocab_new(256, pieces, lens, eog, &g_vocab);
}

static int teardown(void **state)
{
    (void)state;
    grammar_vocab_free(g_vocab);
    json_decref(g_tools);
    return 0;
}

static struct grammar *make(enum tool_family f, enum tool_choice ch, const char *name,
                            bool parallel)
{
    struct tool_grammar_req q = {
        .family = f, .tools = g_tools, .choice = ch, .name = name, .parallel = parallel};
    struct kvd_error e = {0};
    struct grammar *g = NULL;
    if (tool_grammar(&q, &g, &e)) {
        char *t = NULL;
        size_t n;
        struct kvd_error e2 = {0};
        if (tool_grammar_gbnf(&q, &t, &n, &e2) == 0)
            print_message("%s\n", t);
        free(t);
        fail_msg("%s %d: %s (%s)", tool_family_name(f), ch, e.message, e.param);
    }
    return g;
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

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})

static void check(enum tool_family f, enum tool_choice ch, const char *name, bool parallel,
                  const char *const *yes, const char *const *no)
{
    struct grammar *g = make(f, ch, name, parallel);
    for (; yes && *yes; yes++)
        if (!accepts(g, *yes))
            fail_msg("%s choice %d parallel %d should accept [%s]", tool_family_name(f), ch,
                     parallel, *yes);
    for (; no && *no; no++)
        if (accepts(g, *no))
            fail_msg("%s choice %d parallel %d should refuse [%s]", tool_family_name(f), ch,
                     parallel, *no);
    grammar_free(g);
}

#define W "{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}"
#define C "{\"name\": \"calc\", \"arguments\": {\"n\": 7}}"

static void test_hermes(void **state)
{
    (void)state;
    const char *const calls1[] = {
        "<tool_call>\n" W "\n</tool_call>", "<tool_call>" C "</tool_call>",
        "<tool_call>{\"name\": \"ping\", \"arguments\": {}}</tool_call>\n", NULL};
    check(TOOL_HERMES, TOOL_CHOICE_REQUIRED, NULL, false, calls1,
          L("", "hello", "<tool_call>" W "</tool_call><tool_call>" C "</tool_call>",
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"n\": 100}}</tool_call>",
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
            "<tool_call>" W "</tool_call> and text",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", "
            "\"x\": 1}}</tool_call>"));
    check(TOOL_HERMES, TOOL_CHOICE_REQUIRED, NULL, true,
          L("<tool_call>" W "</tool_call>\n<tool_call>" C "</tool_call>"), L(""));
    check(TOOL_HERMES, TOOL_CHOICE_NAMED, "calc", true, L("<tool_call>" C "</tool_call>"),
          L("<tool_call>" W "</tool_call>",
            "<tool_call>" C "</tool_call><tool_call>" C "</tool_call>"));
    /* auto: free text, or free text then calls to the end */
    check(TOOL_HERMES, TOOL_CHOICE_AUTO, NULL, true,
          L("", "Hello, world! <b>tags</b> <tool <tool_cal <<tool_cal>",
            "x <tool_call>" W "</tool_call>",
            "Let me see.\n<tool_call>" W "</tool_call>\n<tool_call>" C "</tool_call>\n",
            "é😀 <tool_call>" C "</tool_call>"),
          L("<tool_call>", "<tool_call>oops", "x <tool_call>" W "</tool_call> and more",
            "<tool_call>{\"name\": \"calc\", \"arguments\": {}}</tool_call>"));
    check(TOOL_HERMES, TOOL_CHOICE_AUTO, NULL, false, L("<tool_call>" W "</tool_call>"),
          L("<tool_call>" W "</tool_call><tool_call>" C "</tool_call>"));
}

static void test_others(void **state)
{
    (void)state;
    /* Llama 3.x: one call, "parameters" */
    const char *lw = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Oslo\"}}";
    check(TOOL_LLAMA3, TOOL_CHOICE_REQUIRED, NULL, true,
          L(lw, " {\"name\":\"ping\",\"parameters\":{}}"),
          L(W, "", "<|python_tag|>{\"name\": \"ping\", \"parameters\": {}}"));
    check(TOOL_LLAMA3, TOOL_CHOICE_AUTO, NULL, true,
          L("", "Hi!", "{\"answer\": 42}", "{\"name\": 5}", " { \"nam", lw,
            "\n{\"name\": \"ping\", \"parameters\": {}}",
            "<|python_tag|>{\"name\": \"calc\", \"parameters\": {\"n\": 1}}",
            "<|python_tag|>print(1)", "text {\"name\": \"x\"}"),
          L("{\"name\": \"nope\", \"parameters\": {}}", "{\"name\": \"calc\", \"parameters\": {}}",
            "  {\"name\": \"", "{\"name\":\"ping\",\"parameters\":{}} more"));
    /* Mistral: [TOOL_CALLS] and a list */
    check(TOOL_MISTRAL, TOOL_CHOICE_REQUIRED, NULL, true,
          L("[TOOL_CALLS] [" W ", " C "]", "[TOOL_CALLS][" C "]",
            "[TOOL_CALLS][{\"name\": \"ping\", \"arguments\": {}, \"id\": \"a1B2c3D4e\"}]"),
          L("[TOOL_CALLS]" W, "[TOOL_CALLS][]",
            "[TOOL_CALLS][{\"name\": \"ping\", \"arguments\": "
            "{}, \"id\": \"short\"}]"));
    check(TOOL_MISTRAL, TOOL_CHOICE_AUTO, NULL, false, L("Sure. [TOOL_CALLS][" C "]", "[TOOL_ [x]"),
          L("[TOOL_CALLS][" C ", " C "]", "[TOOL_CALLS] hi"));
    /* generic */
    check(TOOL_GENERIC, TOOL_CHOICE_REQUIRED, NULL, true,
          L("{\"tool_calls\": [" W "]}", "{\"tool_calls\":[" C "," W "]}"),
          L("{\"tool_calls\": []}", "{\"response\": \"x\"}", "hello"));
    check(TOOL_GENERIC, TOOL_CHOICE_AUTO, NULL, true,
          L("hello", "{\"response\": \"x\"}", "{\"tool_calls\": [" W "]}", "  {\"tool_call"),
          L("{\"tool_calls\": []}", "{\"tool_calls\": [" W "]} x"));
    check(TOOL_GENERIC, TOOL_CHOICE_NAMED, "get_weather", true, L("{\"tool_calls\": [" W "]}"),
          L("{\"tool_calls\": [" C "]}", "{\"tool_calls\": [" W ", " W "]}"));
}

/* A bad schema is refused by its path; a named function must exist. */
static void test_refusals(void **state)
{
    (void)state;
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}, "
                               "{\"type\": \"function\", \"function\": {\"name\": \"g\", "
                               "\"parameters\": {\"type\": \"object\", \"properties\": {\"a\": "
                               "{\"not\": {}}}}}}]",
                               0, NULL);
    struct tool_grammar_req q = {.family = TOOL_HERMES,
                                 .tools = tools,
                                 .choice = TOOL_CHOICE_REQUIRED,
                                 .parallel = true,
                                 .param = "tools"};
    struct kvd_error e = {0};
    struct grammar *g = NULL;
    assert_int_equal(tool_grammar(&q, &g, &e), KVD_EBADREQ);
    assert_string_equal(e.param, "tools[1].function.parameters.properties.a.not");
    q.choice = TOOL_CHOICE_NAMED;
    q.name = "f"; /* the bad one is not allowed: not converted */
    assert_int_equal(tool_grammar(&q, &g, &e), 0);
    grammar_free(g);
    q.name = "h";
    assert_int_equal(tool_grammar(&q, &g, &e), KVD_EBADREQ);
    q.choice = TOOL_CHOICE_NONE;
    assert_int_equal(tool_grammar(&q, &g, &e), 0);
    assert_null(g);
    json_decref(tools);
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)((rng >> 11) % n);
}

/* A random walk from prefix: NULL when it did not end within 3000 bytes. */
static char *walk(const struct grammar *g, const char *prefix)
{
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_matcher_new(g, g_vocab, &m, NULL), 0);
    char *out = calloc(1, 3100);
    size_t n = strlen(prefix);
    memcpy(out, prefix, n);
    assert_int_equal(grammar_matcher_accept_text(m, prefix, n, NULL), 0);
    while (n < 3000) {
        size_t n_ok = 0;
        const uint32_t *mask = grammar_matcher_mask(m, &n_ok, NULL);
        assert_non_null(mask);
        assert_true(n_ok > 0);
        /* the end, when allowed, one time in 6 */
        if ((mask[0] & 1) && rnd(6) == 0)
            break;
        uint32_t pick = rnd((uint32_t)n_ok), t = 0;
        for (t = 0; t < 256; t++)
            if (mask[t / 32] >> (t % 32) & 1) {
                if (pick-- == 0)
                    break;
            }
        if (t == 0)
            break;
        assert_int_equal(grammar_matcher_accept(m, t, NULL), 0);
        out[n++] = (char)t;
    }
    bool ended = n < 3000;
    grammar_matcher_free(m);
    if (!ended) {
        free(out);
        return NULL;
    }
    out[n] = 0;
    return out;
}

static bool known(const char *name)
{
    return !strcmp(name, "get_weather") || !strcmp(name, "calc") || !strcmp(name, "ping");
}

/* Every walk's text, parsed: calls as the grammar meant them. */
static void test_walks(void **state)
{
    (void)state;
    static const char *const starts[][3] = {
        [TOOL_GENERIC] = {"", "{\"tool_calls\": [", " {"},
        [TOOL_HERMES] = {"", "Hi <tool_call>", "<tool_"},
        [TOOL_LLAMA3] = {"", "{\"name\": \"", "<|python_tag|>{"},
        [TOOL_MISTRAL] = {"", "[TOOL_CALLS]", "ok [TOOL_"},
    };
    size_t walks = 0, with_calls = 0;
    for (int f = TOOL_GENERIC; f <= TOOL_MISTRAL; f++)
        for (int ch = 0; ch < 3; ch++) {
            enum tool_choice choice = ch == 0   ? TOOL_CHOICE_AUTO
                                      : ch == 1 ? TOOL_CHOICE_REQUIRED
                                                : TOOL_CHOICE_NAMED;
            struct grammar *g = make((enum tool_family)f, choice, "calc", true);
            for (int it = 0; it < 60; it++) {
                const char *prefix = choice == TOOL_CHOICE_AUTO ? starts[f][it % 3] : "";
                char *text = walk(g, prefix);
                if (!text)
                    continue;
                walks++;
                struct tool_parse_conf conf = {.family = (enum tool_family)f, .incremental = true};
                struct tool_parse *p;
                assert_int_equal(tool_parse_new(&conf, &p), 0);
                /* in random pieces */
                for (size_t at = 0, len = strlen(text); at < len;) {
                    size_t k = 1 + rnd(5);
                    k = k > len - at ? len - at : k;
                    assert_int_equal(tool_parse_push(p, text + at, k), 0);
                    at += k;
                }
                assert_int_equal(tool_parse_finish(p), 0);
                size_t n = tool_parse_n_calls(p), cl;
                const char *content = tool_parse_content(p, &cl);
                if (choice != TOOL_CHOICE_AUTO && (n == 0 || cl != 0))
                    fail_msg("%s choice %d: [%s] gave %zu calls and content [%s]",
                             tool_family_name(f), choice, text, n, content);
                if (choice == TOOL_CHOICE_AUTO && n == 0 && strcmp(content, text))
                    fail_msg("%s auto: [%s] without calls gave content [%s]", tool_family_name(f),
                             text, content);
                with_calls += n > 0;
                for (size_t i = 0; i < n; i++) {
                    const struct tool_call_out *c = tool_parse_call(p, i);
                    json_t *a = json_loadb(c->args, c->args_len, 0, NULL);
                    if (!c->args_done || !json_is_object(a) || !known(c->name) ||
                        (choice == TOOL_CHOICE_NAMED && strcmp(c->name, "calc")))
                        fail_msg("%s choice %d: [%s] call %zu: %s(%s)", tool_family_name(f), choice,
                                 text, i, c->name, c->args);
                    json_decref(a);
                }
                tool_parse_free(p);
                free(text);
            }
            grammar_free(g);
        }
    print_message("%zu walks ended, %zu with calls\n", walks, with_calls);
    assert_true(with_calls > 100);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes),
        cmocka_unit_test(test_others),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_walks),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

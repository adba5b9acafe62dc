/* test_chat_template: kvd's chat templates render every template of
 * tests/text/templates for the conversations of chat_cases.h exactly as the
 * reference renderer did (tests/text/expected/, written with
 * test_chat_template_ref --write-expected and reviewed by eye); the Jinja
 * subset's corners against outputs known from the reference; errors name
 * the construct and line; raise_exception's message comes back; hostile
 * templates hit the depth, step and size limits; random mutations of real
 * templates never crash. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "chat_cases.h"
#include "chat_template_impl.h"
#include "kvd/status.h"
#include "tool_call.h"

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    if (p)
        p[n] = 0;
    fclose(f);
    if (len)
        *len = (size_t)n;
    return p;
}

static char *load(const char *name, size_t *len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.jinja", KVD_TEMPLATE_DIR, name);
    char *s = read_file(path, len);
    if (!s)
        fail_msg("cannot read %s", path);
    return s;
}

static void test_expected_outputs(void **state)
{
    (void)state;
    char err[512];
    for (size_t t = 0; t < N_CHAT_TEMPLATES; t++) {
        size_t len;
        char *src = load(chat_templates[t], &len);
        struct chat_template *tp;
        int rc = chat_template_parse(src, len, &tp, err, sizeof err);
        if (rc)
            fail_msg("%s: %s", chat_templates[t], err);
        for (size_t k = 0; k < N_CHAT_CASES; k++) {
            const struct chat_case *c = &chat_cases[k];
            char path[1024];
            snprintf(path, sizeof path, "%s/%s.%zu.txt", KVD_EXPECTED_DIR, chat_templates[t], k);
            size_t elen;
            char *exp = read_file(path, &elen);
            if (!exp)
                fail_msg("cannot read %s", path);
            char *out = NULL;
            size_t olen = 0;
            rc = chat_template_render(tp, c->msgs, c->n, c->gen, c->bos, c->eos, &out, &olen, err,
                                      sizeof err);
            if (strncmp(exp, "ERROR: ", 7) == 0) {
                if (rc != KVD_EBADREQ || strcmp(err, exp + 7) != 0)
                    fail_msg("%s case %zu: expected the error [%s], got rc %d [%s]",
                             chat_templates[t], k, exp + 7, rc, rc ? err : out);
            } else if (rc != 0 || olen != elen || memcmp(out, exp, elen) != 0) {
                fail_msg("%s case %zu: rc %d\n--- expected\n%s\n--- got\n%s", chat_templates[t], k,
                         rc, exp, rc ? err : out);
            }
            free(out);
            free(exp);
        }
        chat_template_free(tp);
        free(src);
    }
}

/* Conversations with tools (chat_tool_cases) through tool_render, as the
 * reference rendered them prepared the same way. */
static void test_expected_tool_outputs(void **state)
{
    (void)state;
    char err[512];
    for (size_t t = 0; t < N_CHAT_TEMPLATES; t++) {
        size_t len;
        char *src = load(chat_templates[t], &len);
        struct chat_template *tp;
        if (chat_template_parse(src, len, &tp, err, sizeof err))
            fail_msg("%s: %s", chat_templates[t], err);
        enum tool_family f = tool_family_of(src, len);
        for (size_t k = 0; k < N_CHAT_TOOL_CASES; k++) {
            char path[1024];
            snprintf(path, sizeof path, "%s/%s.tools.%zu.txt", KVD_EXPECTED_DIR, chat_templates[t],
                     k);
            size_t elen;
            char *exp = read_file(path, &elen);
            if (!exp)
                fail_msg("cannot read %s", path);
            json_t *c = json_loads(chat_tool_cases[k], 0, NULL);
            assert_non_null(c);
            char *out = NULL;
            size_t olen = 0;
            int rc = tool_render(tp, f, json_object_get(c, "messages"), json_object_get(c, "tools"),
                                 true, "<s>", "</s>", &out, &olen, err, sizeof err);
            if (strncmp(exp, "ERROR: ", 7) == 0) {
                if (rc != KVD_EBADREQ || strcmp(err, exp + 7) != 0)
                    fail_msg("%s tools case %zu: expected the error [%s], got rc %d [%s]",
                             chat_templates[t], k, exp + 7, rc, rc ? err : out);
            } else if (rc != 0 || olen != elen || memcmp(out, exp, elen) != 0) {
                fail_msg("%s tools case %zu: rc %d\n--- expected\n%s\n--- got\n%s",
                         chat_templates[t], k, rc, exp, rc ? err : out);
            }
            json_decref(c);
            free(out);
            free(exp);
        }
        chat_template_free(tp);
        free(src);
    }
}

/* Renders src with one user message "Hi"; returns the status, output in out. */
static int render(const char *src, char **out, char *err, size_t errlen)
{
    static const struct chat_msg m[] = {{"user", "Hi"}, {"assistant", " Yo "}};
    struct chat_template *t;
    *out = NULL;
    int rc = chat_template_parse(src, strlen(src), &t, err, errlen);
    if (rc)
        return rc;
    size_t len;
    rc = chat_template_render(t, m, 2, true, "<s>", "</s>", out, &len, err, errlen);
    if (rc == 0)
        assert_int_equal(len, strlen(*out));
    chat_template_free(t);
    return rc;
}

static void expect_out(const char *src, const char *want)
{
    char err[512], *out;
    int rc = render(src, &out, err, sizeof err);
    if (rc)
        fail_msg("[%s]: rc %d: %s", src, rc, err);
    if (strcmp(out, want) != 0)
        fail_msg("[%s]: got [%s], want [%s]", src, out, want);
    free(out);
}

static void expect_err(const char *src, int code, const char *want_substr)
{
    char err[512], *out;
    int rc = render(src, &out, err, sizeof err);
    if (rc != code || !strstr(err, want_substr))
        fail_msg("[%s]: rc %d [%s], want rc %d with [%s]", src, rc, rc ? err : out, code,
                 want_substr);
    free(out);
}

/* Outputs of @huggingface/jinja 0.5.13 for the same sources (checked with
 * tests/text/jinja_ref.mjs when they were written). */
static void test_subset(void **state)
{
    (void)state;
    expect_out("{{ 1 + 2 }}|{{ 7 / 2 }}|{{ 7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 1.0 }}",
               "3|3.5|3|-1|1024|1.0");
    expect_out("{{ 'a' ~ 1.0 ~ true }}|{{ 'x' + 2 }}|{{ [1, 'a', none, true] }}",
               "a1true|x2|[1, \"a\", null, true]");
    expect_out("{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}"
               "{{ loop.last }}{{ loop.length }}{{ loop.revindex }};{% endfor %}",
               "10truefalse22;21falsetrue21;");
    expect_out("{% for m in messages[1:] %}{{ m.content }}{% endfor %}|{{ messages[-1].role }}",
               " Yo |assistant");
    expect_out("{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
               "{% set ns.s = ns.s + m['content']|trim %}{% endfor %}{{ ns.n }}:{{ ns.s }}",
               "2:HiYo");
    expect_out("{% if x is defined %}d{% elif messages|length > 1 %}many{% else %}e{% endif %}",
               "many");
    expect_out("{{ 'a' if false else 'b' if true else 'c' }}|{{ none is none }}|"
               "{{ 'x' is string }}|{{ 3 is odd }}|{{ messages is iterable }}",
               "b|true|true|true|true");
    expect_out("{{ '  Hi  '.strip() }}|{{ ' a b '.split() }}|{{ 'a,b'.split(',') }}|"
               "{{ 'hello world'.title() }}|{{ 'ab'.upper() }}|{{ 'AB'|lower }}",
               "Hi|[\"a\", \"b\"]|[\"a\", \"b\"]|Hello World|AB|ab");
    expect_out("{{ 'abc'.startswith('a') }}{{ 'abc'.endswith(('x', 'c')) }}"
               "{{ 'aXbX'.replace('X', '-') }}{{ 'abc'|capitalize }}{{ 'abc'[1] }}{{ 'abc'[-1] }}",
               "truetruea-b-Abcbc");
    expect_out("{{ {'b': 1, 'a': [1, 2]}|tojson }}|{{ {'k': 'v'}|tojson(indent=2) }}",
               "{\"b\": 1, \"a\": [1, 2]}|{\n  \"k\": \"v\"\n}");
    expect_out("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
               "{{ {'a': 1}.get('b', 'z') }}",
               "a=1;b=2;z");
    expect_out("{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')"
               "|join(',') }}|{{ messages|map(attribute='role')|list|last }}",
               "Hi|assistant");
    expect_out("{% macro greet(who, p='Hi') %}{{ p }} {{ who }}{% endmacro %}{{ greet('A') }}/"
               "{{ greet('B', p='Yo') }}",
               "Hi A/Yo B");
    expect_out("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}"
               "{% break %}{% endif %}{{ i }}{% endfor %}",
               "02");
    expect_out("  {%- if true %}\n  x\n  {%- endif %}\n{# c #}\ny{{ undefined_name }}\n", "  xy");
    expect_out("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}", "<s></s>true");
    expect_out("{% set x %}in{{ 1 }}{% endset %}{{ x }}|{{ [3, 1] + [2] }}|{{ 'a' in 'cat' }}",
               "in1|[3, 1, 2]|true");
}

static void test_errors(void **state)
{
    (void)state;
    expect_err("line one\n{% raise_me %}", KVD_EUNSUPPORTED,
               "chat template line 2: statement 'raise_me' is not supported");
    expect_err("{% include 'x' %}", KVD_EUNSUPPORTED, "statement 'include' is not supported");
    expect_err("{% call foo() %}{% endcall %}", KVD_EUNSUPPORTED, "statement 'call'");
    expect_err("\n\n{{ messages|xmlattr }}", KVD_EUNSUPPORTED,
               "chat template line 3: filter 'xmlattr' on a ArrayValue is not supported");
    expect_err("{{ x is divisibleby }}", KVD_EUNSUPPORTED, "test 'divisibleby' is not supported");
    expect_err("{{ f(*args) }}", KVD_EUNSUPPORTED, "argument unpacking");
    expect_err("{{ raise_exception('No system messages, please!') }}", KVD_EBADREQ,
               "No system messages, please!");
    expect_err("a\n{% if x %}\nb", KVD_EBADREQ, "missing {% endif %}");
    expect_err("a\nb\n{{ 1 + }}", KVD_EBADREQ, "chat template line 3:");
    expect_err("{{ 'unterminated }}", KVD_EBADREQ, "unexpected end of input");
    expect_err("{% endfor %}", KVD_EBADREQ, "unexpected {% endfor %}");
    expect_err("{{ x }", KVD_EBADREQ, "chat template line 1");
    expect_err("{{ none + 1 }}", KVD_EBADREQ, "null values");
    expect_err("{{ nope() }}", KVD_EBADREQ, "'nope' is undefined");
    expect_out("{{ 'ÉÀ'|lower }}{{ 'straße'|upper }}", "éàSTRASSE");
    expect_err("{{ 'Σ'|lower }}", KVD_EUNSUPPORTED, "lower of the character U+03A3");
    /* hostile: deep nesting, runaway loops, huge output */
    char deep[4096];
    size_t k = 0;
    k += (size_t)snprintf(deep + k, sizeof deep - k, "{{ ");
    for (int i = 0; i < 1000; i++)
        deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 1000; i++)
        deep[k++] = ')';
    snprintf(deep + k, sizeof deep - k, " }}");
    expect_err(deep, KVD_EUNSUPPORTED, "nesting deeper than");
    k = 0;
    for (int i = 0; i < 300; i++)
        k += (size_t)snprintf(deep + k, sizeof deep - k, "{%% if true %%}");
    expect_err(deep, KVD_EUNSUPPORTED, "nesting deeper than");
    expect_err("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", KVD_ETOOLARGE, "deeper");
    expect_err("{% for a in range(1000000) %}{% for b in range(1000000) %}{% endfor %}{% endfor %}",
               KVD_ETOOLARGE, "chat template");
    expect_err("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}"
               "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
               KVD_ETOOLARGE, "");
}

/* Hostile templates inside the step, memory and output bounds whose O(n)
 * operations on a 16 MiB string ran for over an hour: each is refused by
 * the work budget or the time bound, with the reason, in about a second or
 * less (not timed here: the failing case was minutes). */
static void test_work_budget(void **state)
{
    (void)state;
    /* s doubled to 16 MiB (24 doublings of one byte), then used 1M times */
#define BIG                                                                                        \
    "{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}"          \
    "{% endfor %}"
    static const char *const hostile[] = {
        BIG "{% for i in range(1000000) %}{% if ns.s|length > 0 %}{% endif %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% if ns.s.length > 0 %}{% endif %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% if 'y' in ns.s %}{% endif %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% if ns.s == ns.s %}{% endif %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% set t = ns.s[1:] %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% set t = ns.s|trim %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% set t = ns.s.startswith('y') %}{% endfor %}",
        BIG "{% for i in range(1000000) %}{% set t = ns.s|replace('y', 'z') %}{% endfor %}",
        BIG "{% for i in range(1000) %}{% for j in range(1000) %}{% if ns.s[-1] == 'y' %}"
            "{% endif %}{% endfor %}{% endfor %}",
    };
#undef BIG
    for (size_t i = 0; i < sizeof hostile / sizeof hostile[0]; i++) {
        char err[512], *out = NULL;
        int rc = render(hostile[i], &out, err, sizeof err);
        free(out);
        if (rc != KVD_ETOOLARGE ||
            (!strstr(err, "MiB of work") && !strstr(err, " ms") && !strstr(err, "MiB of memory")))
            fail_msg("hostile template %zu: rc %d [%s], want too_large naming the work budget, "
                     "the time bound or the memory bound",
                     i, rc, rc ? err : "rendered");
        print_message("hostile template %zu: %s\n", i, err);
    }
}

/* Random byte edits, deletions and splices of real templates: every result is
 * a render or an error with a message, never a crash (ASan/UBSan builds
 * check the memory side). */
static void test_mutations(void **state)
{
    (void)state;
    uint64_t r = 12345;
    static const char *const frags[] = {
        "{%",   "%}",           "{{",   "}}", "{#",     "#}", "-",  "(",  ")",    "[",     "]",
        "'",    "\"",           "|",    ".",  "endfor", "if", "\\", "\n", " is ", " not ", "**",
        "\xff", "\xe2\x80\xa8", "loop."};
    size_t n_ok = 0, n_err = 0;
    for (size_t t = 0; t < N_CHAT_TEMPLATES; t++) {
        size_t len;
        char *src = load(chat_templates[t], &len);
        for (int it = 0; it < 60; it++) {
            char *m = malloc(len + 64);
            memcpy(m, src, len);
            size_t ml = len;
            for (int e = 0; e < 1 + it % 4; e++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                size_t pos = (size_t)(r >> 33) % (ml + 1);
                int kind = (int)((r >> 20) % 3);
                if (kind == 0 && pos < ml) {
                    m[pos] = (char)(r >> 8);
                    if (m[pos] == 0)
                        m[pos] = '{';
                } else if (kind == 1 && pos < ml) {
                    size_t del = 1 + (r >> 12) % 8;
                    if (del > ml - pos)
                        del = ml - pos;
                    memmove(m + pos, m + pos + del, ml - pos - del);
                    ml -= del;
                } else {
                    const char *f = frags[(r >> 40) % (sizeof frags / sizeof frags[0])];
                    size_t fl = strlen(f);
                    if (ml + fl > len + 63)
                        continue;
                    memmove(m + pos + fl, m + pos, ml - pos);
                    memcpy(m + pos, f, fl);
                    ml += fl;
                }
            }
            char err[256];
            struct chat_template *tp;
            int rc = chat_template_parse(m, ml, &tp, err, sizeof err);
            if (rc == 0) {
                const struct chat_case *c = &chat_cases[it % N_CHAT_CASES];
                char *out;
                size_t olen;
                rc = chat_template_render(tp, c->msgs, c->n, c->gen, c->bos, c->eos, &out, &olen,
                                          err, sizeof err);
                if (rc == 0)
                    free(out);
                chat_template_free(tp);
            }
            if (rc) {
                assert_true(rc == KVD_EBADREQ || rc == KVD_EUNSUPPORTED || rc == KVD_ETOOLARGE);
                n_err++;
            } else {
                n_ok++;
            }
            free(m);
        }
        free(src);
    }
    assert_true(n_ok > 0 && n_err > 0);
}

int main(void)
{
    setenv("TZ", "UTC", 1);
    tzset();
    chat_template_fixed_now = CHAT_FIXED_NOW;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expected_outputs), cmocka_unit_test(test_expected_tool_outputs),
        cmocka_unit_test(test_subset),           cmocka_unit_test(test_errors),
        cmocka_unit_test(test_work_budget),      cmocka_unit_test(test_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

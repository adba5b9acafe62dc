/* test_chat_template_ref: every template in tests/text/templates x hundreds
 * of generated conversations (system prompt or not, 1..8 turns, unicode,
 * whitespace, empty contents, generation prompt both ways, sometimes roles
 * out of order) rendered by kvd and by @huggingface/jinja (node, one process
 * for all cases) must be byte-equal, or both must fail (with the same message
 * for raise_exception). Skips (77) without node or @huggingface/jinja.
 *   test_chat_template_ref --write-expected DIR  writes the reference's
 *   output for chat_cases.h (the files test_chat_template compares with). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "chat_cases.h"
#include "chat_template_impl.h"
#include "kvd/status.h"
#include "tool_call.h"

#define CASES_PER_TEMPLATE 300

static char jinja_dir[1024];

struct jcase {
    size_t t;
    struct chat_msg *m;
    size_t n;
    bool gen;
    const char *bos, *eos;
    json_t *msgs, *tools;    /* a conversation with tools (m unused); tools may be NULL */
    json_t *raw, *raw_tools; /* the same before tool_prompt_prepare */
};

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

static char *load_template(size_t i, size_t *len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.jinja", KVD_TEMPLATE_DIR, chat_templates[i]);
    char *s = read_file(path, len);
    assert_non_null(s);
    return s;
}

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

/* Renders every case with the reference; results[i] = text (malloc'd),
 * ok[i] = whether it rendered. */
static void reference(const struct jcase *cs, size_t n, char **results, bool *ok)
{
    char path[] = "/tmp/kvd-chat-ref-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("{\"templates\": [", f);
    for (size_t i = 0; i < N_CHAT_TEMPLATES; i++) {
        char *src = load_template(i, NULL);
        fputs(i ? ", " : "", f);
        json_str(f, src);
        free(src);
    }
    fputs("], \"cases\": [", f);
    for (size_t i = 0; i < n; i++) {
        fprintf(f, "%s{\"t\": %zu, \"g\": %s, \"bos\": ", i ? ", " : "", cs[i].t,
                cs[i].gen ? "true" : "false");
        json_str(f, cs[i].bos);
        fputs(", \"eos\": ", f);
        json_str(f, cs[i].eos);
        if (cs[i].msgs) {
            json_t *ctx = json_pack("{s:O}", "messages", cs[i].msgs);
            if (cs[i].tools)
                json_object_set(ctx, "tools", cs[i].tools);
            char *js = json_dumps(ctx, JSON_COMPACT);
            fprintf(f, ", \"ctx\": %s}", js);
            free(js);
            json_decref(ctx);
            continue;
        }
        fputs(", \"m\": [", f);
        for (size_t k = 0; k < cs[i].n; k++) {
            fputs(k ? ", [" : "[", f);
            json_str(f, cs[i].m[k].role);
            fputs(", ", f);
            json_str(f, cs[i].m[k].content);
            fputs("]", f);
        }
        fputs("]}", f);
    }
    fputs("]}\n", f);
    fclose(f);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "TZ=UTC KVD_FIXED_NOW=%d timeout 600 node %s/jinja_ref.mjs %s %s",
             CHAT_FIXED_NOW, KVD_TEST_DIR, jinja_dir, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) {
        char tag[8];
        size_t len;
        if (fscanf(p, "%7s %zu", tag, &len) != 2 || fgetc(p) != '\n')
            fail_msg("reference output ends early at case %zu", i);
        results[i] = malloc(len + 1);
        assert_int_equal(fread(results[i], 1, len, p), len);
        results[i][len] = 0;
        ok[i] = strcmp(tag, "OK") == 0;
    }
    assert_int_equal(pclose(p), 0);
    unlink(path);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)((rng >> 11) % n);
}

static const char *const pieces[] = {
    "Hello",
    "world",
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "What is 2+2?",
    "é",
    "ça va",
    "中文字符",
    "日本語",
    "😀",
    "👩‍💻",
    "e\xcc\x81",
    "עברית",
    "العربية",
    "Ω≈ç√",
    "\"quoted\"",
    "back\\slash",
    "{{ not a tag }}",
    "{% raw %}",
    "<|im_end|>",
    "</s>",
    "[INST]",
    "\u00a0nbsp\u00a0",
    "\u3000ideographic",
    "x\r\ny",
    "tab\tbed",
    "123",
    "-4.5",
    "true",
    "None",
    "   leading",
    "trailing   ",
    "Σίσυφος",
    "Привет",
};

static char *gen_content(void)
{
    size_t k = rnd(6), cap = 1, len = 0;
    char *s = calloc(1, 1);
    for (size_t i = 0; i < k; i++) {
        const char *p = pieces[rnd(sizeof(pieces) / sizeof(pieces[0]))];
        const char *sep = rnd(3) ? " " : "";
        size_t add = strlen(p) + strlen(sep);
        s = realloc(s, cap += add);
        memcpy(s + len, p, strlen(p));
        len += strlen(p);
        memcpy(s + len, sep, strlen(sep));
        len += strlen(sep);
        s[len] = 0;
    }
    return s;
}

static void gen_case(struct jcase *c, size_t t)
{
    static const char *const bos[] = {"<s>", "<|begin_of_text|>", "", "<bos>"};
    static const char *const eos[] = {"</s>", "<|eot_id|>", "", "<eos>"};
    static const char *const odd_roles[] = {"tool", "ipython", "User", "narrator"};
    size_t turns = 1 + rnd(8), k = 0;
    bool sys = rnd(2);
    bool shuffled = rnd(10) == 0;
    c->t = t;
    c->m = calloc(turns + 1, sizeof(*c->m));
    if (sys)
        c->m[k++] = (struct chat_msg){"system", gen_content()};
    for (size_t i = 0; i < turns; i++) {
        const char *role = i % 2 ? "assistant" : "user";
        if (shuffled)
            role = rnd(3) == 0 ? odd_roles[rnd(4)] : rnd(2) ? "user" : "assistant";
        c->m[k++] = (struct chat_msg){role, gen_content()};
    }
    c->n = k;
    c->gen = rnd(2);
    size_t b = rnd(4);
    c->bos = bos[b];
    c->eos = eos[b];
}

static void test_random_conversations(void **state)
{
    (void)state;
    size_t n = N_CHAT_TEMPLATES * CASES_PER_TEMPLATE;
    struct jcase *cs = calloc(n, sizeof(*cs));
    for (size_t i = 0; i < n; i++)
        gen_case(&cs[i], i / CASES_PER_TEMPLATE);
    char **ref = calloc(n, sizeof(*ref));
    bool *ok = calloc(n, sizeof(*ok));
    reference(cs, n, ref, ok);

    struct chat_template *tp[N_CHAT_TEMPLATES];
    char err[512];
    for (size_t i = 0; i < N_CHAT_TEMPLATES; i++) {
        size_t len;
        char *src = load_template(i, &len);
        int rc = chat_template_parse(src, len, &tp[i], err, sizeof err);
        if (rc)
            fail_msg("%s: %s", chat_templates[i], err);
        free(src);
    }
    size_t bad = 0, n_ok = 0, n_err = 0;
    for (size_t i = 0; i < n; i++) {
        char *out = NULL;
        size_t len = 0;
        int rc = chat_template_render(tp[cs[i].t], cs[i].m, cs[i].n, cs[i].gen, cs[i].bos,
                                      cs[i].eos, &out, &len, err, sizeof err);
        bool same;
        if (ok[i])
            same = rc == 0 && strlen(ref[i]) == len && memcmp(out, ref[i], len) == 0;
        else
            same = rc == KVD_EBADREQ;
        n_ok += ok[i];
        n_err += !ok[i];
        if (!same && bad++ < 5)
            fprintf(stderr, "case %zu (%s): reference %s [%s]\n  kvd rc=%d [%s]\n", i,
                    chat_templates[cs[i].t], ok[i] ? "OK" : "ERR", ref[i], rc, rc ? err : out);
        free(out);
    }
    fprintf(stderr, "%zu cases: %zu rendered, %zu refused by the template; %zu differ\n", n, n_ok,
            n_err, bad);
    assert_int_equal(bad, 0);
    for (size_t i = 0; i < N_CHAT_TEMPLATES; i++)
        chat_template_free(tp[i]);
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < cs[i].n; k++)
            free((char *)cs[i].m[k].content);
        free(cs[i].m);
        free(ref[i]);
    }
    free(cs);
    free(ref);
    free(ok);
}

/* ---- conversations with tools ------------------------------------------------ */

/* A tool's parameters: nested objects, arrays, enums, text with quotes,
 * escapes and non-ASCII (no integer-like keys: the reference, a
 * JavaScript object, would order them first). */
static json_t *gen_params(void)
{
    switch (rnd(4)) {
    case 0:
        return json_pack("{s:s, s:{s:{s:s, s:s}, s:{s:s, s:[s,s]}}, s:[s]}", "type", "object",
                         "properties", "location", "type", "string", "description",
                         "The city, e.g. \"Paris\" or Zürich", "unit", "type", "string", "enum",
                         "celsius", "fahrenheit", "required", "location");
    case 1:
        return json_pack("{s:s, s:{s:{s:s, s:{s:s}, s:i}, s:{s:s, s:i, s:i}}}", "type", "object",
                         "properties", "tags", "type", "array", "items", "type", "string",
                         "maxItems", 3, "count", "type", "integer", "minimum", 0, "maximum", 10);
    case 2:
        return json_pack("{s:s, s:{}}", "type", "object", "properties");
    default:
        return json_pack("{s:s, s:{s:{s:s, s:{s:{s:s}}}, s:{s:s, s:f}}, s:b}", "type", "object",
                         "properties", "filter", "type", "object", "properties", "q", "type",
                         "string", "x", "type", "number", "default", 2.5, "additionalProperties",
                         0);
    }
}

static const char *const tool_names[] = {"get_weather", "search", "send_email", "calc", "x"};

static json_t *gen_tools(size_t *n_out)
{
    size_t n = 1 + rnd(3);
    json_t *tools = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *fn = json_pack("{s:s}", "name", tool_names[(i * 2 + rnd(2)) % 5]);
        if (rnd(4))
            json_object_set_new(
                fn, "description",
                json_string(rnd(2) ? "Gets things done." : "Ça «marche» \"bien\"\n"));
        if (rnd(5))
            json_object_set_new(fn, "parameters", gen_params());
        json_array_append_new(tools, json_pack("{s:s, s:o}", "type", "function", "function", fn));
    }
    *n_out = n;
    return tools;
}

static json_t *gen_args_text(void)
{
    static const char *const args[] = {"{\"location\": \"Paris\", \"unit\": \"celsius\"}", "{}",
                                       "{\"tags\": [\"a\", \"b\"], \"count\": 3}",
                                       "{\"filter\": {\"q\": \"héllo \\\"x\\\"\", \"x\": 2.5}}",
                                       "{\"nested\": {\"deep\": [1, {\"k\": null}]}}"};
    return json_string(args[rnd(5)]);
}

static int g_id_counter;

static json_t *gen_tool_conv(void)
{
    json_t *m = json_array();
    if (rnd(2))
        json_array_append_new(m, json_pack("{s:s, s:s%}", "role", "system", "content", "Be brief.",
                                           (size_t)(rnd(3) ? 9 : 0)));
    size_t rounds = 1 + rnd(3);
    for (size_t r = 0; r < rounds; r++) {
        char *u = gen_content();
        json_array_append_new(m, json_pack("{s:s, s:s}", "role", "user", "content", u));
        free(u);
        size_t calls = rnd(3); /* 0: a plain answer */
        if (calls) {
            json_t *tc = json_array();
            char ids[2][40];
            for (size_t k = 0; k < calls; k++) {
                if (rnd(2))
                    snprintf(ids[k], sizeof ids[k], "A%08d", ++g_id_counter);
                else
                    snprintf(ids[k], sizeof ids[k], "call_%024d", ++g_id_counter);
                json_array_append_new(tc,
                                      json_pack("{s:s, s:s, s:{s:s, s:o}}", "id", ids[k], "type",
                                                "function", "function", "name", tool_names[rnd(5)],
                                                "arguments", gen_args_text()));
            }
            json_t *a = json_pack("{s:s, s:o}", "role", "assistant", "tool_calls", tc);
            json_object_set_new(a, "content", rnd(2) ? json_null() : json_string("Let me look."));
            json_array_append_new(m, a);
            for (size_t k = 0; k < calls; k++)
                json_array_append_new(
                    m, json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", ids[k],
                                 "content", rnd(2) ? "{\"temperature\": 21}" : "22 degrees"));
            if (r + 1 == rounds && rnd(2))
                break; /* the conversation ends on the results */
        }
        if (r + 1 < rounds || rnd(3) == 0) {
            char *c = gen_content();
            json_array_append_new(m, json_pack("{s:s, s:s}", "role", "assistant", "content", c));
            free(c);
        }
    }
    return m;
}

/* Every template x conversations with tools, tool calls and their
 * results, prepared for the template's family as kvd prepares them
 * (tool_prompt_prepare; a generic template that refuses a system role
 * again with it merged, tool_render): kvd's render equals the
 * reference's. */
static void test_tool_conversations(void **state)
{
    (void)state;
    enum { PER = 60 };
    size_t n = N_CHAT_TEMPLATES * PER;
    struct jcase *cs = calloc(n, sizeof(*cs));
    enum tool_family fam[N_CHAT_TEMPLATES];
    struct chat_template *tp[N_CHAT_TEMPLATES];
    char err[512];
    for (size_t i = 0; i < N_CHAT_TEMPLATES; i++) {
        size_t len;
        char *src = load_template(i, &len);
        fam[i] = tool_family_of(src, len);
        if (chat_template_parse(src, len, &tp[i], err, sizeof err))
            fail_msg("%s: %s", chat_templates[i], err);
        free(src);
    }
    for (size_t i = 0; i < n; i++) {
        size_t t = i / PER, nt = 0;
        json_t *tools = rnd(6) ? gen_tools(&nt) : NULL;
        json_t *conv = gen_tool_conv();
        cs[i].t = t;
        cs[i].gen = rnd(4) != 0;
        cs[i].bos = "<s>";
        cs[i].eos = "</s>";
        assert_int_equal(tool_prompt_prepare(fam[t], conv, tools, &cs[i].msgs, &cs[i].tools), 0);
        cs[i].raw = conv;
        cs[i].raw_tools = tools;
    }
    char **ref = calloc(n, sizeof(*ref));
    bool *ok = calloc(n, sizeof(*ok));
    reference(cs, n, ref, ok);
    /* generic templates that refused (a system role): again with the
     * system text in the first user message, as tool_render does */
    struct jcase *again = calloc(n, sizeof(*again));
    size_t *from = calloc(n, sizeof(*from)), n_again = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *merged = NULL;
        if (!ok[i] && fam[cs[i].t] == TOOL_GENERIC &&
            (merged = tool_prompt_merge_system(cs[i].msgs))) {
            again[n_again] = cs[i];
            again[n_again].msgs = merged;
            from[n_again++] = i;
        }
    }
    char **ref2 = calloc(n_again + 1, sizeof(*ref2));
    bool *ok2 = calloc(n_again + 1, sizeof(*ok2));
    if (n_again)
        reference(again, n_again, ref2, ok2);
    for (size_t k = 0; k < n_again; k++) {
        if (ok2[k]) {
            free(ref[from[k]]);
            ref[from[k]] = ref2[k];
            ok[from[k]] = true;
        } else {
            free(ref2[k]);
        }
        json_decref(again[k].msgs);
    }
    free(again);
    free(from);
    free(ref2);
    free(ok2);
    size_t bad = 0, n_ok[N_CHAT_TEMPLATES] = {0};
    for (size_t i = 0; i < n; i++) {
        char *out = NULL;
        size_t len = 0;
        int rc = tool_render(tp[cs[i].t], fam[cs[i].t], cs[i].raw, cs[i].raw_tools, cs[i].gen,
                             cs[i].bos, cs[i].eos, &out, &len, err, sizeof err);
        bool same = ok[i] ? rc == 0 && strlen(ref[i]) == len && memcmp(out, ref[i], len) == 0
                          : rc == KVD_EBADREQ;
        n_ok[cs[i].t] += ok[i];
        if (!same && bad++ < 5) {
            char *js = json_dumps(cs[i].msgs, JSON_COMPACT);
            fprintf(stderr, "case %zu (%s, %s): %s\nreference %s [%s]\n  kvd rc=%d [%s]\n", i,
                    chat_templates[cs[i].t], tool_family_name(fam[cs[i].t]), js,
                    ok[i] ? "OK" : "ERR", ref[i], rc, rc ? err : out);
            free(js);
        }
        free(out);
    }
    for (size_t t = 0; t < N_CHAT_TEMPLATES; t++)
        fprintf(stderr, "%-18s %-8s %2zu of %d rendered\n", chat_templates[t],
                tool_family_name(fam[t]), n_ok[t], PER);
    fprintf(stderr, "%zu tool conversations; %zu differ\n", n, bad);
    assert_int_equal(bad, 0);
    for (size_t i = 0; i < N_CHAT_TEMPLATES; i++)
        chat_template_free(tp[i]);
    for (size_t i = 0; i < n; i++) {
        json_decref(cs[i].msgs);
        json_decref(cs[i].tools);
        json_decref(cs[i].raw);
        json_decref(cs[i].raw_tools);
        free(ref[i]);
    }
    free(cs);
    free(ref);
    free(ok);
}

/* The reference's renders of chat_tool_cases, prepared as tool_render
 * prepares them (a generic template that raises gets the merged system
 * message): NAME.tools.K.txt. */
static int write_expected_tools(const char *dir)
{
    size_t n = N_CHAT_TEMPLATES * N_CHAT_TOOL_CASES;
    struct jcase *cs = calloc(n, sizeof(*cs));
    enum tool_family fam[N_CHAT_TEMPLATES];
    for (size_t t = 0; t < N_CHAT_TEMPLATES; t++) {
        size_t len;
        char *src = load_template(t, &len);
        fam[t] = tool_family_of(src, len);
        free(src);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_loads(chat_tool_cases[i % N_CHAT_TOOL_CASES], 0, NULL);
        assert_non_null(c);
        cs[i] =
            (struct jcase){.t = i / N_CHAT_TOOL_CASES, .gen = true, .bos = "<s>", .eos = "</s>"};
        assert_int_equal(tool_prompt_prepare(fam[cs[i].t], json_object_get(c, "messages"),
                                             json_object_get(c, "tools"), &cs[i].msgs,
                                             &cs[i].tools),
                         0);
        json_decref(c);
    }
    char **ref = calloc(n, sizeof(*ref));
    bool *ok = calloc(n, sizeof(*ok));
    reference(cs, n, ref, ok);
    for (size_t i = 0; i < n; i++) {
        json_t *merged = NULL;
        if (!ok[i] && fam[cs[i].t] == TOOL_GENERIC &&
            (merged = tool_prompt_merge_system(cs[i].msgs))) {
            struct jcase again = cs[i];
            char *r2;
            bool ok2;
            again.msgs = merged;
            reference(&again, 1, &r2, &ok2);
            if (ok2) {
                free(ref[i]);
                ref[i] = r2;
                ok[i] = true;
            } else {
                free(r2);
            }
            json_decref(merged);
        }
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.tools.%zu.txt", dir, chat_templates[cs[i].t],
                 i % N_CHAT_TOOL_CASES);
        FILE *f = fopen(path, "wb");
        if (!f)
            return 1;
        if (!ok[i])
            fputs("ERROR: ", f);
        fputs(ref[i], f);
        fclose(f);
        free(ref[i]);
        json_decref(cs[i].msgs);
        json_decref(cs[i].tools);
    }
    free(ref);
    free(ok);
    free(cs);
    return 0;
}

static int write_expected(const char *dir)
{
    size_t n = N_CHAT_TEMPLATES * N_CHAT_CASES;
    struct jcase *cs = calloc(n, sizeof(*cs));
    for (size_t i = 0; i < n; i++) {
        const struct chat_case *c = &chat_cases[i % N_CHAT_CASES];
        cs[i] = (struct jcase){.t = i / N_CHAT_CASES,
                               .m = (struct chat_msg *)c->msgs,
                               .n = c->n,
                               .gen = c->gen,
                               .bos = c->bos,
                               .eos = c->eos};
    }
    char **ref = calloc(n, sizeof(*ref));
    bool *ok = calloc(n, sizeof(*ok));
    reference(cs, n, ref, ok);
    for (size_t i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.%zu.txt", dir, chat_templates[cs[i].t],
                 i % N_CHAT_CASES);
        FILE *f = fopen(path, "wb");
        if (!f)
            return 1;
        if (!ok[i])
            fputs("ERROR: ", f);
        fputs(ref[i], f);
        fclose(f);
        free(ref[i]);
    }
    free(ref);
    free(ok);
    free(cs);
    return write_expected_tools(dir);
}

int main(int argc, char **argv)
{
    const char *base = getenv("KVD_NODE_LLAMA_CPP_DIR");
    char def[900];
    snprintf(def, sizeof def, "%s/.cache/kvd/node-llama-cpp", getenv("HOME") ? getenv("HOME") : "");
    if (!base)
        base = def;
    snprintf(jinja_dir, sizeof jinja_dir, "%s/node_modules/@huggingface/jinja", base);
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/dist/index.js", jinja_dir);
    if (access(probe, R_OK) != 0 || system("node --version >/dev/null 2>&1") != 0) {
        fprintf(stderr,
                "skipped: node or @huggingface/jinja not found (set KVD_NODE_LLAMA_CPP_DIR)\n");
        return 77;
    }
    setenv("TZ", "UTC", 1);
    tzset();
    chat_template_fixed_now = CHAT_FIXED_NOW;
    if (argc == 3 && strcmp(argv[1], "--write-expected") == 0)
        return write_expected(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_conversations),
        cmocka_unit_test(test_tool_conversations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

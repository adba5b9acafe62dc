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

#include "chat_cases.h"
#include "chat_template_impl.h"
#include "kvd/status.h"

#define CASES_PER_TEMPLATE 300

static char jinja_dir[1024];

struct jcase {
    size_t t;
    struct chat_msg *m;
    size_t n;
    bool gen;
    const char *bos, *eos;
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

static int write_expected(const char *dir)
{
    size_t n = N_CHAT_TEMPLATES * N_CHAT_CASES;
    struct jcase *cs = calloc(n, sizeof(*cs));
    for (size_t i = 0; i < n; i++) {
        const struct chat_case *c = &chat_cases[i % N_CHAT_CASES];
        cs[i] = (struct jcase){
            i / N_CHAT_CASES, (struct chat_msg *)c->msgs, c->n, c->gen, c->bos, c->eos};
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
    return 0;
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The official `openai` npm package as a client of kvd's HTTP API (over
 * TCP with a bearer token): a completion and a chat, non-streamed and
 * streamed, must equal the msgpack generate's answers at temperature 0
 * (text and token ids), with usage and the role; /v1/models lists the
 * model; an error reaches the client as its APIError with status 400; n = 3
 * choices (streamed and not) equal single runs with seeds 42 + i; the
 * client parses response_format answers (json_schema, json_object) as
 * JSON of the schema.
 * Skipped (77) without node or the package ($KVD_OPENAI_NPM_DIR, default
 * ~/.cache/kvd/openai-npm, installed there by .ci/run). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "kvd_harness.h"

#define TOKEN "openai-test-token-0123456789"

static char g_dir[64], g_model[128], g_npm[512];
static struct kh_proc *g_d;
static unsigned g_port;

struct ref {
    uint32_t toks[256];
    size_t n;
    char text[4096];
};

/* msgpack generate with `text` or one user message, greedy (temperature
 * < 0) or sampled with seed. */
static void reference_seeded(bool chat, const char *prompt, uint32_t max, double temperature,
                             uint64_t seed, struct ref *out);

static void reference(bool chat, const char *prompt, uint32_t max, struct ref *out)
{
    reference_seeded(chat, prompt, max, 0, 0, out);
}

static void reference_seeded(bool chat, const char *prompt, uint32_t max, double temperature,
                             uint64_t seed, struct ref *out)
{
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    struct kh_req q;
    struct kh_reply r;
    kh_req_begin(&q, "generate", 1, 4);
    if (chat) {
        proto_pack_str(&q.pk, "messages");
        proto_pack_array(&q.pk, 1);
        proto_pack_map(&q.pk, 2);
        proto_pack_kv_str(&q.pk, "role", "user");
        proto_pack_kv_str(&q.pk, "content", prompt);
    } else {
        proto_pack_kv_str(&q.pk, "text", prompt);
    }
    proto_pack_kv_uint(&q.pk, "max_tokens", max);
    proto_pack_kv_double(&q.pk, "temperature", temperature);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    kh_expect(&r, 0);
    const msgpack_object *t = kh_obj(r.root, "tokens");
    out->n = t->via.array.size;
    for (size_t i = 0; i < out->n; i++)
        out->toks[i] = (uint32_t)t->via.array.ptr[i].via.u64;
    const msgpack_object *tx = kh_obj(r.root, "text");
    snprintf(out->text, sizeof(out->text), "%.*s", (int)tx->via.str.size, tx->via.str.ptr);
    kh_reply_free(&r);
    close(fd);
}

static void expect_same(json_t *o, const char *what, const struct ref *ref)
{
    json_t *x = json_object_get(o, what);
    if (!x)
        fail_msg("no '%s' in the client's output", what);
    const char *text = json_string_value(json_object_get(x, "text"));
    if (!text || strcmp(text, ref->text))
        fail_msg("%s: text '%s', msgpack generate's '%s'", what, text ? text : "(none)", ref->text);
    json_t *t = json_object_get(x, "tokens");
    assert_int_equal(json_array_size(t), ref->n);
    for (size_t i = 0; i < ref->n; i++)
        assert_int_equal(json_integer_value(json_array_get(t, i)), ref->toks[i]);
    json_t *u = json_object_get(x, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), ref->n);
    assert_true(json_is_string(json_object_get(x, "finish")));
}

static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR"), *npm = getenv("KVD_OPENAI_NPM_DIR");
    const char *home = getenv("HOME");
    struct stat st;
    char cmd[1024];
    if (npm && npm[0])
        snprintf(g_npm, sizeof(g_npm), "%s", npm);
    else
        snprintf(g_npm, sizeof(g_npm), "%s/.cache/kvd/openai-npm", home ? home : "/root");
    snprintf(cmd, sizeof(cmd), "%s/node_modules/openai/index.mjs", g_npm);
    if (stat(cmd, &st) != 0 || system("node --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "node or the openai npm package (%s) is absent: skipped\n", g_npm);
        exit(77);
    }
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvd-oai.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof(g_model), "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof(cmd),
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 512 --ctx 2048 --seed 5 --chat-template %s/tests/text/templates/chatml.jinja"
             " >/dev/null",
             tools, g_model, KVD_SOURCE_DIR);
    if (system(cmd) != 0)
        return -1;
    const char *const args[] = {"--backend",   "cpu",    "--model",
                                g_model,       "--http", "127.0.0.1:0",
                                "--log-level", "info",   "--no-roofline-probe",
                                NULL};
    g_d = kh_new("[http]\ntoken = webapp " TOKEN "\n", args);
    if (!g_d)
        return -1;
    snprintf(cmd, sizeof(cmd), "%s", g_d->log);
    FILE *f = fopen(cmd, "r");
    char line[512];
    while (f && fgets(line, sizeof(line), f))
        if (strstr(line, "(port "))
            g_port = (unsigned)atoi(strstr(line, "(port ") + 6);
    if (f)
        fclose(f);
    return g_port ? 0 : -1;
}

static int teardown(void **state)
{
    int st = kh_free(g_d);
    unlink(g_model);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

static void test_openai_client_equals_generate(void **state)
{
    struct ref compl, chat;
    reference(false, "Once upon a time", 12, &compl );
    reference(true, "Tell me a story.", 10, &chat);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "node %s/tests/integration/openai_client.mjs %s http://127.0.0.1:%u/v1 %s",
             KVD_SOURCE_DIR, g_npm, g_port, TOKEN);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    static char out[1 << 16];
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    if (rc != 0)
        fail_msg("the openai client failed (%d): %s", rc, out);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    if (!o)
        fail_msg("the client's output is not JSON (%s): %s", je.text, out);
    expect_same(o, "completion", &compl );
    expect_same(o, "completion_stream", &compl );
    expect_same(o, "chat", &chat);
    expect_same(o, "chat_stream", &chat);
    for (int k = 0; k < 2; k++) {
        json_t *c = json_object_get(o, k ? "chat_stream" : "chat");
        assert_string_equal(json_string_value(json_object_get(c, "role")), "assistant");
    }
    /* n = 3: choice i is the single run with seed 42 + i */
    json_t *cn = json_object_get(o, "completion_n"),
           *sn = json_object_get(o, "completion_n_stream");
    assert_int_equal(json_array_size(cn), 3);
    for (size_t i = 0; i < 3; i++) {
        struct ref one;
        reference_seeded(false, "Once upon a time", 8, 1.0, 42 + i, &one);
        json_t *c = json_array_get(cn, i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), i);
        json_t *t = json_object_get(c, "tokens"), *ts = json_array_get(sn, i);
        assert_int_equal(json_array_size(t), one.n);
        assert_int_equal(json_array_size(ts), one.n);
        for (size_t k = 0; k < one.n; k++) {
            assert_int_equal(json_integer_value(json_array_get(t, k)), one.toks[k]);
            assert_int_equal(json_integer_value(json_array_get(ts, k)), one.toks[k]);
        }
    }
    json_t *u = json_object_get(o, "completion_n_usage");
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 24);
    /* response_format: the client parsed the answers as JSON */
    json_t *pj = json_object_get(o, "json_schema");
    assert_true(json_is_object(pj));
    assert_int_equal(json_object_size(pj), 2);
    assert_true(json_string_length(json_object_get(pj, "name")) <= 8);
    json_int_t age = json_integer_value(json_object_get(pj, "age"));
    assert_true(json_is_integer(json_object_get(pj, "age")) && age >= 0 && age <= 99);
    assert_true(json_is_object(json_object_get(o, "json_object")));
    assert_int_equal(json_array_size(json_object_get(o, "models")), 1);
    assert_int_equal(json_integer_value(json_object_get(o, "error_status")), 400);
    json_decref(o);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_openai_client_equals_generate),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

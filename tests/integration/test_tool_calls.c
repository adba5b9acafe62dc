/* Tool calls against a real kvd (cpu backend, small random models: their
 * outputs are noise, which makes this strict), one model per template
 * family (Qwen2.5: Hermes, Llama 3.1, Mistral v3, ChatML: the generic
 * format): with tool_choice required and named, over many seeds, every
 * reply is tool_calls (finish_reason tool_calls, no content) naming an
 * allowed function, whose arguments parse and validate against its
 * parameters schema with Ajv (ajv_validate.mjs; skipped without node and
 * the ajv npm package); one call without parallel_tool_calls; a streamed
 * reply's deltas (index, id, type, name, then argument fragments) add up
 * to the same calls as the reply without streaming; msgpack generate with
 * messages answers the same calls; auto on noise answers content (never a
 * 500), streamed and not alike; a conversation with earlier calls and
 * their results renders and answers; a daemon of two models of different
 * families answers each request in the family of the model it names.
 * Skipped (77) without curl. */
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

#include "json_pack.h"
#include "http_post.h"
#include "kvd_harness.h"

/* Seeds per family. A sanitizer build runs the daemon several times slower;
 * its job is the memory and UB checks of every path (required, named, auto,
 * streamed, parallel), which the first seeds already take, so it runs a
 * third of them. */
#if defined(__SANITIZE_ADDRESS__)
#define SEEDS 4
#else
#define SEEDS 12
#endif
#define MAX_TOKENS 700

static char g_dir[64], g_ajv[512], g_out[160];
static FILE *g_records; /* {"schema", "text"} lines for Ajv */
static size_t g_n_records;

/* The tools: strings bounded (noise never ends an unbounded one), an enum,
 * integer bounds, an array, a nested object, a pattern, anyOf, and a
 * function without parameters. */
static const char TOOLS[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": "
    "\"The weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": "
    "{\"location\": {\"type\": \"string\", \"maxLength\": 12}, \"unit\": {\"enum\": "
    "[\"celsius\", \"fahrenheit\"]}}, \"required\": [\"location\", \"unit\"], "
    "\"additionalProperties\": false}}},"
    "{\"type\": \"function\", \"function\": {\"name\": \"search\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"terms\": {\"type\": \"array\", \"items\": {\"type\": "
    "\"string\", \"maxLength\": 6}, \"minItems\": 1, \"maxItems\": 3}, \"page\": {\"type\": "
    "\"integer\", \"minimum\": 1, \"maximum\": 99}, \"filter\": {\"type\": \"object\", "
    "\"properties\": {\"lang\": {\"type\": \"string\", \"pattern\": \"^[a-z]{2}$\"}, \"safe\": "
    "{\"type\": \"boolean\"}}, \"required\": [\"lang\"], \"additionalProperties\": false}}, "
    "\"required\": [\"terms\"], \"additionalProperties\": false}}},"
    "{\"type\": \"function\", \"function\": {\"name\": \"set_alarm\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"when\": {\"anyOf\": [{\"type\": \"string\", \"format\": "
    "\"time\"}, {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 1440}]}, \"label\": "
    "{\"type\": [\"string\", \"null\"], \"maxLength\": 8}}, \"required\": [\"when\"], "
    "\"additionalProperties\": false}}},"
    "{\"type\": \"function\", \"function\": {\"name\": \"ping\"}}]";

static json_t *g_tools;

/* ---- HTTP ------------------------------------------------------------------- */

/* A chat request's body: messages (taken over), the tools, tool_choice
 * (JSON text; NULL: absent), parallel_tool_calls (-1: absent). */
static char *request(json_t *messages, const char *choice, int parallel, uint64_t seed, bool stream)
{
    json_t *req = json_pack("{s:o, s:O, s:i, s:f, s:I, s:b}", "messages", messages, "tools",
                            g_tools, "max_tokens", MAX_TOKENS, "temperature", 1.0, "seed",
                            (json_int_t)seed, "stream", stream);
    if (choice)
        json_object_set_new(req, "tool_choice", json_loads(choice, JSON_DECODE_ANY, NULL));
    if (parallel >= 0)
        json_object_set_new(req, "parallel_tool_calls", json_boolean(parallel));
    char *s = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    return s;
}

static json_t *user_message(void)
{
    return json_pack("[{s:s, s:s}]", "role", "user", "content", "What is the weather in Paris?");
}

/* What a reply (or a stream put together) holds. */
struct reply {
    char finish[16];
    json_t *content; /* string or null */
    json_t *calls;   /* [{id, name, arguments}] */
    json_t *tokens;
};

static void reply_free(struct reply *r)
{
    json_decref(r->content);
    json_decref(r->calls);
    json_decref(r->tokens);
    memset(r, 0, sizeof *r);
}

static void from_message(struct reply *r, json_t *choice)
{
    json_t *m = json_object_get(choice, "message");
    snprintf(r->finish, sizeof r->finish, "%s",
             json_string_value(json_object_get(choice, "finish_reason")));
    r->content = json_incref(json_object_get(m, "content"));
    r->tokens = json_incref(json_object_get(m, "tokens"));
    r->calls = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(m, "tool_calls"), i, c)
    {
        json_t *fn = json_object_get(c, "function");
        assert_string_equal(json_string_value(json_object_get(c, "type")), "function");
        json_array_append_new(r->calls, json_pack("{s:O, s:O, s:O}", "id", json_object_get(c, "id"),
                                                  "name", json_object_get(fn, "name"), "arguments",
                                                  json_object_get(fn, "arguments")));
    }
}

/* A stream's chunks put together: content, calls from their deltas (the
 * first of each call has its index, id, type and name; the others only
 * arguments), tokens, the last finish_reason. */
static void from_stream(struct reply *r, char *out)
{
    r->content = json_string("");
    r->calls = json_array();
    r->tokens = json_array();
    bool done = false;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: ", 6))
            continue;
        if (!strcmp(line + 6, "[DONE]")) {
            done = true;
            continue;
        }
        json_t *j = json_loads(line + 6, JSON_ALLOW_NUL, NULL);
        if (!j)
            fail_msg("a chunk is not JSON: %s", line);
        if (json_object_get(j, "error"))
            fail_msg("stream error: %s", line);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        json_t *d = json_object_get(c, "delta");
        const char *t = json_string_value(json_object_get(d, "content"));
        if (t && t[0]) {
            char *all = NULL;
            assert_true(asprintf(&all, "%s%s", json_string_value(r->content), t) >= 0);
            json_decref(r->content);
            r->content = json_string(all);
            free(all);
        }
        json_array_extend(r->tokens, json_object_get(d, "tokens"));
        size_t i;
        json_t *x;
        json_array_foreach(json_object_get(d, "tool_calls"), i, x)
        {
            size_t idx = (size_t)json_integer_value(json_object_get(x, "index"));
            json_t *fn = json_object_get(x, "function");
            const char *frag = json_string_value(json_object_get(fn, "arguments"));
            assert_non_null(frag);
            if (json_object_get(x, "id")) {
                assert_int_equal(idx, json_array_size(r->calls)); /* in order, once */
                assert_string_equal(json_string_value(json_object_get(x, "type")), "function");
                json_array_append_new(
                    r->calls, json_pack("{s:O, s:O, s:s}", "id", json_object_get(x, "id"), "name",
                                        json_object_get(fn, "name"), "arguments", frag));
                continue;
            }
            assert_null(json_object_get(fn, "name"));
            json_t *call = json_array_get(r->calls, idx);
            assert_non_null(call);
            char *all = NULL;
            assert_true(asprintf(&all, "%s%s",
                                 json_string_value(json_object_get(call, "arguments")), frag) >= 0);
            json_object_set_new(call, "arguments", json_string(all));
            free(all);
        }
        const char *fin = json_string_value(json_object_get(c, "finish_reason"));
        if (fin)
            snprintf(r->finish, sizeof r->finish, "%s", fin);
        json_decref(j);
    }
    assert_true(done);
    if (json_string_length(r->content) == 0 && json_array_size(r->calls)) {
        json_decref(r->content);
        r->content = json_null();
    }
}

static void chat(const char *sock, const char *body, bool stream, struct reply *r)
{
    int status;
    char *out = http_post(g_dir, sock, "/v1/chat/completions", body, &status);
    if (status != 200)
        fail_msg("HTTP %d: %s\nrequest %s", status, out, body);
    if (stream) {
        from_stream(r, out);
    } else {
        json_t *j = json_loads(out, JSON_ALLOW_NUL, NULL);
        if (!j)
            fail_msg("not JSON: %s", out);
        from_message(r, json_array_get(json_object_get(j, "choices"), 0));
        json_decref(j);
    }
    free(out);
}

static const json_t *params_of(const char *name)
{
    size_t i;
    json_t *t;
    json_array_foreach(g_tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        if (!strcmp(json_string_value(json_object_get(fn, "name")), name))
            return json_object_get(fn, "parameters");
    }
    return NULL;
}

/* A reply that must be tool calls only: named after allowed functions
 * (only `only` when given), at most one without parallel calls, their
 * arguments JSON objects (recorded for Ajv). */
static void check_calls(const struct reply *r, const char *family, const char *only, bool parallel,
                        const char *what)
{
    if (strcmp(r->finish, "tool_calls") || !json_is_null(r->content) ||
        json_array_size(r->calls) == 0) {
        char *c = json_dumps(r->calls, JSON_COMPACT);
        fail_msg("%s %s: finish %s, content %s, calls %s", family, what, r->finish,
                 json_is_string(r->content) ? json_string_value(r->content) : "null", c);
    }
    if (!parallel || only)
        assert_int_equal(json_array_size(r->calls), 1);
    size_t i;
    json_t *c;
    json_array_foreach(r->calls, i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *id = json_string_value(json_object_get(c, "id"));
        const char *args = json_string_value(json_object_get(c, "arguments"));
        const json_t *params = params_of(name);
        if (!name || !args || (only && strcmp(name, only)) || (strcmp(name, "ping") && !params))
            fail_msg("%s %s: call %zu is %s(%s)", family, what, i, name, args);
        if (!strcmp(family, "mistral"))
            assert_int_equal(strlen(id), 9);
        else
            assert_true(strlen(id) == 29 && !strncmp(id, "call_", 5));
        json_t *v = json_loads(args, 0, NULL);
        if (!json_is_object(v))
            fail_msg("%s %s: %s's arguments are not a JSON object: %s", family, what, name, args);
        json_decref(v);
        json_t *schema =
            params ? json_incref((json_t *)params) : json_pack("{s:s}", "type", "object");
        json_t *line = json_pack("{s:o, s:s}", "schema", schema, "text", args);
        char *s = json_dumps(line, JSON_COMPACT);
        fprintf(g_records, "%s\n", s);
        free(s);
        json_decref(line);
        g_n_records++;
    }
}

/* The same calls (ids aside) and tokens. */
static void check_same(const struct reply *a, const struct reply *b, const char *what)
{
    if (!json_equal(a->tokens, b->tokens) || strcmp(a->finish, b->finish) ||
        !json_equal(a->content, b->content) ||
        json_array_size(a->calls) != json_array_size(b->calls))
        fail_msg("%s: streamed and not differ (finish %s / %s)", what, a->finish, b->finish);
    for (size_t i = 0; i < json_array_size(a->calls); i++) {
        json_t *x = json_array_get(a->calls, i), *y = json_array_get(b->calls, i);
        if (!json_equal(json_object_get(x, "name"), json_object_get(y, "name")) ||
            !json_equal(json_object_get(x, "arguments"), json_object_get(y, "arguments")))
            fail_msg("%s: call %zu differs: %s(%s) / %s(%s)", what, i,
                     json_string_value(json_object_get(x, "name")),
                     json_string_value(json_object_get(x, "arguments")),
                     json_string_value(json_object_get(y, "name")),
                     json_string_value(json_object_get(y, "arguments")));
    }
}

/* ---- msgpack ------------------------------------------------------------------ */

static char *mp_str(const msgpack_object *o)
{
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    return strndup(o->via.str.ptr, o->via.str.size);
}

/* generate with messages, the tools and tool_choice required: the reply's
 * tool_calls, as the HTTP reply's. */
/* msgpack generate with the same messages and tools, tool_choice
 * required, for model (NULL: none named): the calls http has. */
static void msgpack_required(const char *sock, const char *model, uint64_t seed, const char *family,
                             const struct reply *http)
{
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    struct kh_req q;
    kh_req_begin(&q, "generate", 1, model ? 7 : 6);
    if (model)
        proto_pack_kv_str(&q.pk, "model", model);
    json_t *m = user_message();
    proto_pack_str(&q.pk, "messages");
    pack_json(&q.pk, m);
    json_decref(m);
    proto_pack_str(&q.pk, "tools");
    pack_json(&q.pk, g_tools);
    proto_pack_kv_str(&q.pk, "tool_choice", "required");
    proto_pack_kv_uint(&q.pk, "max_tokens", MAX_TOKENS);
    proto_pack_kv_double(&q.pk, "temperature", 1.0);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    assert_int_equal(kh_req_send(fd, &q), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    if (r.code)
        fail_msg("%s msgpack: %s", family, r.message);
    char *fin = mp_str(kh_obj(r.root, "finish_reason"));
    assert_string_equal(fin, "tool_calls");
    free(fin);
    char *text = mp_str(kh_obj(r.root, "text"));
    assert_string_equal(text, "");
    free(text);
    const msgpack_object *calls = kh_obj(r.root, "tool_calls");
    assert_non_null(calls);
    assert_int_equal(calls->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(calls->via.array.size, json_array_size(http->calls));
    for (uint32_t i = 0; i < calls->via.array.size; i++) {
        const msgpack_object *c = &calls->via.array.ptr[i];
        json_t *h = json_array_get(http->calls, i);
        char *name = mp_str(kh_obj(c, "name")), *args = mp_str(kh_obj(c, "arguments"));
        char *id = mp_str(kh_obj(c, "id"));
        assert_string_equal(name, json_string_value(json_object_get(h, "name")));
        assert_string_equal(args, json_string_value(json_object_get(h, "arguments")));
        assert_true(strlen(id) >= 9);
        free(name);
        free(args);
        free(id);
    }
    kh_reply_free(&r);
    close(fd);
}

/* msgpack refusals: each a bad_request naming the field. */
static void msgpack_refusals(const char *sock)
{
    int fd = kh_connect(sock);
    assert_true(fd >= 0);
    static const char *const want[] = {"'tools' needs a 'messages' prompt", "'tool_choice'",
                                       "'tools'", "UTF-8", "'messages'[0].tool_calls"};
    for (int k = 0; k < 5; k++) {
        struct kh_req q;
        kh_req_begin(&q, "generate", 1, 2);
        if (k == 0) {
            proto_pack_kv_str(&q.pk, "text", "hi");
        } else {
            proto_pack_str(&q.pk, "messages");
            proto_pack_array(&q.pk, 1);
            proto_pack_map(&q.pk, k == 4 ? 3 : 2);
            proto_pack_kv_str(&q.pk, "role", k == 4 ? "assistant" : "user");
            proto_pack_str(&q.pk, "content");
            if (k == 3) {
                msgpack_pack_str(&q.pk, 2);
                msgpack_pack_str_body(&q.pk, "\xff\xfe", 2);
            } else {
                proto_pack_str(&q.pk, "x");
            }
            if (k == 4) {
                proto_pack_str(&q.pk, "tool_calls");
                proto_pack_array(&q.pk, 1);
                proto_pack_map(&q.pk, 1);
                proto_pack_kv_uint(&q.pk, "id", 5);
            }
        }
        if (k == 1) {
            proto_pack_kv_str(&q.pk, "tool_choice", "always");
        } else if (k == 2) {
            proto_pack_str(&q.pk, "tools");
            proto_pack_array(&q.pk, 1);
            msgpack_pack_bin(&q.pk, 2);
            msgpack_pack_bin_body(&q.pk, "ab", 2);
        } else {
            proto_pack_str(&q.pk, "tools");
            pack_json(&q.pk, g_tools);
        }
        assert_int_equal(kh_req_send(fd, &q), 0);
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        if (r.code != KVD_EBADREQ || !strstr(r.message, want[k]))
            fail_msg("msgpack refusal %d: code %d [%s], want bad_request with [%s]", k, r.code,
                     r.message, want[k]);
        kh_reply_free(&r);
    }
    close(fd);
}

/* A chat request's body for a model (NULL: none named). */
static char *request_for(const char *model, const char *choice, uint64_t seed, bool stream)
{
    char *body = request(user_message(), choice, -1, seed, stream);
    if (!model)
        return body;
    json_t *j = json_loads(body, 0, NULL);
    free(body);
    json_object_set_new(j, "model", json_string(model));
    body = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return body;
}

/* ---- one family --------------------------------------------------------------- */

static void family(const char *tmpl, const char *fam)
{
    char model[128], cmd[640], sock[128];
    snprintf(model, sizeof model, "%s/%s.gguf", g_dir, tmpl);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 512 --ctx 16384 --seed 9 --chat-template %s/tests/text/templates/%s.jinja "
             ">/dev/null",
             getenv("KVD_TOOLS_DIR"), model, KVD_SOURCE_DIR, tmpl);
    assert_int_equal(system(cmd), 0);
    snprintf(sock, sizeof sock, "%s/http-%s.sock", g_dir, fam);
    const char *const args[] = {
        "--backend", "cpu", "--model", model, "--http-socket", sock, "--no-roofline-probe", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    assert_non_null(d);
    char what[96];
    for (uint64_t s = 0; s < SEEDS; s++) {
        uint64_t seed = 1000 + s;
        /* required, parallel calls or not; streamed and not */
        bool parallel = s % 3 != 2;
        struct reply a, b;
        char *body = request(user_message(), "\"required\"", parallel ? -1 : 0, seed, false);
        snprintf(what, sizeof what, "required seed %llu", (unsigned long long)seed);
        chat(sock, body, false, &a);
        free(body);
        check_calls(&a, fam, NULL, parallel, what);
        body = request(user_message(), "\"required\"", parallel ? -1 : 0, seed, true);
        chat(sock, body, true, &b);
        free(body);
        check_calls(&b, fam, NULL, parallel, what);
        check_same(&a, &b, what);
        if (s < 3)
            msgpack_required(d->sock, NULL, seed, fam, &a);
        reply_free(&a);
        reply_free(&b);
        /* named */
        static const char *const names[] = {"get_weather", "search", "set_alarm", "ping"};
        const char *name = names[s % 4];
        char choice[128];
        snprintf(choice, sizeof choice,
                 "{\"type\": \"function\", \"function\": {\"name\": \"%s\"}}", name);
        snprintf(what, sizeof what, "named %s seed %llu", name, (unsigned long long)seed);
        body = request(user_message(), choice, -1, seed, s % 2);
        chat(sock, body, s % 2, &a);
        free(body);
        check_calls(&a, fam, name, true, what);
        reply_free(&a);
        /* auto on noise: content or calls, streamed and not alike */
        snprintf(what, sizeof what, "auto seed %llu", (unsigned long long)seed);
        body = request(user_message(), s % 2 ? "\"auto\"" : NULL, -1, seed, false);
        chat(sock, body, false, &a);
        free(body);
        body = request(user_message(), s % 2 ? "\"auto\"" : NULL, -1, seed, true);
        chat(sock, body, true, &b);
        free(body);
        check_same(&a, &b, what);
        if (json_array_size(a.calls))
            check_calls(&a, fam, NULL, true, what);
        else
            assert_true(json_is_string(a.content));
        reply_free(&a);
        reply_free(&b);
    }
    /* a conversation with an earlier call and its result */
    json_t *conv = json_pack(
        "[{s:s, s:s}, {s:s, s:n, s:[{s:s, s:s, s:{s:s, s:s}}]}, {s:s, s:s, s:s}]", "role", "user",
        "content", "Weather in Paris?", "role", "assistant", "content", "tool_calls", "id",
        "call_abcdefghijklmnopqrstuvwx", "type", "function", "function", "name", "get_weather",
        "arguments", "{\"location\": \"Paris\", \"unit\": \"celsius\"}", "role", "tool",
        "tool_call_id", "call_abcdefghijklmnopqrstuvwx", "content", "21 degrees");
    struct reply a;
    char *body = request(conv, "\"required\"", -1, 77, false);
    chat(sock, body, false, &a);
    free(body);
    check_calls(&a, fam, NULL, true, "after a tool result");
    reply_free(&a);
    /* tool_choice none: the tools are in the prompt, the reply is content */
    body = request(user_message(), "\"none\"", -1, 5, false);
    chat(sock, body, false, &a);
    free(body);
    assert_true(json_is_string(a.content));
    assert_int_equal(json_array_size(a.calls), 0);
    assert_string_not_equal(a.finish, "tool_calls");
    reply_free(&a);
    if (!strcmp(fam, "hermes"))
        msgpack_refusals(d->sock);
    assert_int_equal(kh_free(d), 0);
    unlink(model);
    unlink(sock);
}

static void test_hermes(void **state)
{
    (void)state;
    family("qwen2.5", "hermes");
}

static void test_llama3(void **state)
{
    (void)state;
    family("llama-3.1", "llama3");
}

static void test_mistral(void **state)
{
    (void)state;
    family("mistral-v3", "mistral");
}

static void test_generic(void **state)
{
    (void)state;
    family("chatml", "generic");
}

/* One daemon serving two models of different families: each request is
 * rendered, constrained and parsed in the family of the model it names
 * (HTTP `model` and msgpack `model`), none named is the first model's. A
 * grammar of the other family would not parse as calls of this one, and
 * the two families' call ids differ (Mistral 9 characters, Llama 3.x
 * call_ and 24). */
static void test_models_families(void **state)
{
    (void)state;
    static const char *const tmpls[2] = {"mistral-v3", "llama-3.1"};
    static const char *const names[2] = {"mis", "lla"};
    static const char *const fams[2] = {"mistral", "llama3"};
    char model[2][128], spec[2][160], cmd[640], sock[128];
    for (int i = 0; i < 2; i++) {
        snprintf(model[i], sizeof model[i], "%s/m-%s.gguf", g_dir, tmpls[i]);
        snprintf(cmd, sizeof cmd,
                 "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
                 "--vocab 512 --ctx 16384 --seed %d --chat-template "
                 "%s/tests/text/templates/%s.jinja >/dev/null",
                 getenv("KVD_TOOLS_DIR"), model[i], 11 + i, KVD_SOURCE_DIR, tmpls[i]);
        assert_int_equal(system(cmd), 0);
        snprintf(spec[i], sizeof spec[i], "%s=%s", names[i], model[i]);
    }
    snprintf(sock, sizeof sock, "%s/http-models.sock", g_dir);
    const char *const args[] = {
        "--backend",           "cpu", "--model", spec[0], "--model", spec[1], "--http-socket", sock,
        "--no-roofline-probe", NULL};
    struct kh_proc *d = kh_new(NULL, args);
    assert_non_null(d);
    char what[96];
    for (uint64_t s = 0; s < 6; s++) {
        int m = (int)(s % 2);
        /* the first model also when none is named */
        const char *name = s == 2 ? NULL : names[m];
        snprintf(what, sizeof what, "model %s seed %llu", name ? name : "(none)",
                 (unsigned long long)(200 + s));
        struct reply a, b;
        char *body = request_for(name, "\"required\"", 200 + s, false);
        chat(sock, body, false, &a);
        free(body);
        check_calls(&a, fams[m], NULL, true, what);
        body = request_for(name, "\"required\"", 200 + s, true);
        chat(sock, body, true, &b);
        free(body);
        check_calls(&b, fams[m], NULL, true, what);
        check_same(&a, &b, what);
        msgpack_required(d->sock, name, 200 + s, fams[m], &a);
        reply_free(&a);
        reply_free(&b);
    }
    assert_int_equal(kh_free(d), 0);
    for (int i = 0; i < 2; i++)
        unlink(model[i]);
    unlink(sock);
}

/* Every recorded call's arguments against its function's schema. */
static void test_ajv(void **state)
{
    (void)state;
    fclose(g_records);
    g_records = NULL;
    char cmd[1024];
    struct stat st;
    print_message("%zu calls recorded\n", g_n_records);
    assert_true(g_n_records >= 4 * SEEDS * 2);
    snprintf(cmd, sizeof cmd, "%s/node_modules/ajv/dist/2020.js", g_ajv);
    if (stat(cmd, &st) != 0 || system("node --version >/dev/null 2>&1") != 0) {
        print_message("node or the ajv npm package (%s) is absent: arguments parsed, not "
                      "validated\n",
                      g_ajv);
        skip();
    }
    snprintf(cmd, sizeof cmd, "node %s/tests/integration/ajv_validate.mjs %s %s 2>&1",
             KVD_SOURCE_DIR, g_ajv, g_out);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char line[8192];
    bool valid = false;
    while (fgets(line, sizeof line, p)) {
        print_message("ajv: %s", line);
        valid |= !strncmp(line, "valid ", 6);
    }
    assert_int_equal(pclose(p), 0);
    assert_true(valid);
}

static int setup(void **state)
{
    (void)state;
    const char *ajv = getenv("KVD_AJV_NPM_DIR"), *home = getenv("HOME");
    if (system("curl --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "curl is absent: skipped\n");
        exit(77);
    }
    if (ajv && ajv[0])
        snprintf(g_ajv, sizeof g_ajv, "%s", ajv);
    else
        snprintf(g_ajv, sizeof g_ajv, "%s/.cache/kvd/ajv-npm", home ? home : "/root");
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-tools.XXXXXX");
    if (!getenv("KVD_TOOLS_DIR") || !mkdtemp(g_dir))
        return -1;
    snprintf(g_out, sizeof g_out, "%s/calls.jsonl", g_dir);
    g_records = fopen(g_out, "w");
    g_tools = json_loads(TOOLS, 0, NULL);
    return g_records && g_tools ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    if (g_records)
        fclose(g_records);
    char f[128];
    snprintf(f, sizeof f, "%s/body.json", g_dir);
    unlink(f);
    unlink(g_out);
    rmdir(g_dir);
    json_decref(g_tools);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes),          cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_mistral),         cmocka_unit_test(test_generic),
        cmocka_unit_test(test_models_families), cmocka_unit_test(test_ajv),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

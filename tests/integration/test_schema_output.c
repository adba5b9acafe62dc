/* JSON Schema constrained output against a real kvd (cpu backend, a small
 * random model: its outputs are noise, which makes this strict): 200
 * random schemas of the supported subset, sent as msgpack `json_schema`
 * (map and JSON text) and as HTTP `response_format`, sampled: every answer
 * ends by itself, parses, and validates against its schema with Ajv
 * (ajv_validate.mjs; that part is skipped without node and the ajv npm
 * package, $KVD_AJV_NPM_DIR, installed by .ci/run). Every unsupported
 * keyword is refused naming its path (HTTP 400 param, msgpack message);
 * json_object always yields an object. Skipped (77) without curl. */
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

#define N_SCHEMAS 200
#define MAX_TOKENS 1500

static char g_dir[64], g_model[128], g_ajv[512];
static struct kh_proc *g_d;
static unsigned g_rand = 12345;

static unsigned rnd(unsigned n)
{
    g_rand = g_rand * 1103515245u + 12345u;
    return (g_rand >> 16) % n;
}

/* ---- msgpack and HTTP ------------------------------------------------------ */

static const uint32_t g_prompt[] = {11, 12, 13, 14};

/* A generate with `json_schema` (a map, or its JSON text). */
static void send_schema(int fd, uint64_t id, const json_t *schema, bool as_text, uint64_t seed,
                        const char *extra_key, const json_t *extra)
{
    struct kh_req q;
    kh_req_begin(&q, "generate", id, 5 + (extra_key != NULL));
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, 4);
    proto_pack_kv_uint(&q.pk, "max_tokens", MAX_TOKENS);
    proto_pack_kv_double(&q.pk, "temperature", 1.0);
    proto_pack_kv_uint(&q.pk, "seed", seed);
    proto_pack_str(&q.pk, "json_schema");
    if (as_text) {
        char *t = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
        proto_pack_str(&q.pk, t);
        free(t);
    } else {
        pack_json(&q.pk, schema);
    }
    if (extra_key) {
        proto_pack_str(&q.pk, extra_key);
        pack_json(&q.pk, extra);
    }
    assert_int_equal(kh_req_send(fd, &q), 0);
}

/* A chat completion with response_format (rf, taken over); its JSON. */
static json_t *chat_rf(json_t *rf, uint64_t seed, int *status)
{
    json_t *req = json_pack("{s:[{s:s,s:s}], s:i, s:f, s:I, s:o}", "messages", "role", "user",
                            "content", "Answer in JSON.", "max_tokens", MAX_TOKENS, "temperature",
                            1.0, "seed", (json_int_t)seed, "response_format", rf);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    char *out = http_post(g_dir, NULL, "/v1/chat/completions", body, status);
    free(body);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    if (!o)
        fail_msg("not JSON: %s", out);
    free(out);
    return o;
}

/* ---- random schemas ---------------------------------------------------------- */

static const char *const PATTERNS[] = {
    "^[a-z]{1,6}$", "^\\d{3}-\\d{2}$", "^(cat|dog)s?$",  "^[A-Z][a-z]{0,4}( [0-9]+)?$",
    "^a.{0,3}b$",   "x[0-9]",          "^\\w{2}\\.\\S$",
};
static const char *const FORMATS[] = {"date", "time", "date-time", "uuid"};
static const char *const NAMES[] = {"id", "name", "tags", "x", "value", "k-2", "é", "n"};

static json_t *gen(int depth);

static json_t *gen_string(void)
{
    switch (rnd(6)) {
    case 0: {
        json_t *s = json_pack("{s:s, s:i}", "type", "string", "maxLength", 1 + rnd(8));
        if (rnd(2))
            json_object_set_new(s, "minLength", json_integer(rnd(2)));
        return s;
    }
    case 1:
        return json_pack("{s:s, s:[s,s,s]}", "type", "string", "enum", "red", "gr\"een", "blue");
    case 2:
        return json_pack("{s:s, s:s}", "type", "string", "pattern",
                         PATTERNS[rnd(sizeof PATTERNS / sizeof PATTERNS[0])]);
    case 3:
        return json_pack("{s:s, s:s}", "type", "string", "format", FORMATS[rnd(4)]);
    case 4:
        return json_pack("{s:s}", "const", "hello\nworld");
    default:
        return json_pack("{s:[s,s], s:i}", "type", "string", "null", "maxLength", 4);
    }
}

static json_t *gen_scalar(void)
{
    switch (rnd(7)) {
    case 0:
    case 1:
        return gen_string();
    case 2: {
        json_t *s = json_pack("{s:s}", "type", "integer");
        int lo = (int)rnd(2000) - 1000, hi = lo + (int)rnd(500);
        unsigned f = rnd(4);
        if (f == 1 || f == 3)
            json_object_set_new(s, rnd(2) ? "minimum" : "exclusiveMinimum", json_integer(lo));
        if (f == 2 || f == 3)
            json_object_set_new(s, rnd(2) ? "maximum" : "exclusiveMaximum", json_integer(hi + 2));
        return s;
    }
    case 3:
        return json_pack("{s:s}", "type", "number");
    case 4:
        return json_pack("{s:s}", "type", "boolean");
    case 5:
        return json_pack("{s:[s,s]}", "type", "null", "boolean");
    default:
        return json_pack("{s:[i,f,s,n,b,{s:[i]}]}", "enum", 3, 2.5, "x", 1, "k", 1);
    }
}

static json_t *gen_object(int depth)
{
    json_t *props = json_object(), *req = json_array();
    unsigned n = 1 + rnd(4);
    for (unsigned i = 0; i < n; i++) {
        const char *name = NAMES[rnd(sizeof NAMES / sizeof NAMES[0])];
        if (json_object_get(props, name))
            continue;
        json_object_set_new(props, name, gen(depth + 1));
        if (rnd(2))
            json_array_append_new(req, json_string(name));
    }
    json_t *s =
        json_pack("{s:s, s:o, s:o}", "type", "object", "properties", props, "required", req);
    if (rnd(2))
        json_object_set_new(s, "additionalProperties", json_false());
    return s;
}

/* The draws happen in one order whatever the compiler (a function's
 * arguments are evaluated in an unspecified order): the order GCC gave
 * before, last argument first, which is the sequence the test was sized
 * with. */
static json_t *gen(int depth)
{
    unsigned r = depth >= 3 ? 0 : rnd(20);
    if (r < 8)
        return gen_scalar();
    if (r < 11) {
        if (rnd(3) == 0) {
            json_t *b = gen(depth + 1), *a = gen(depth + 1);
            return json_pack("{s:s, s:[o,o], s:b}", "type", "array", "prefixItems", a, b, "items",
                             0);
        }
        unsigned mx = 1 + rnd(3), mn = rnd(mx + 1);
        return json_pack("{s:s, s:o, s:i, s:i}", "type", "array", "items", gen(depth + 1),
                         "minItems", mn, "maxItems", mx);
    }
    if (r < 15)
        return gen_object(depth);
    if (r < 17) {
        json_t *b = gen(depth + 1), *a = gen(depth + 1);
        return json_pack("{s:[o,o]}", "anyOf", a, b);
    }
    if (r < 18) /* alternatives of different types, or tagged */
        return rnd(2) ? json_pack("{s:[{s:s,s:i},{s:s},{s:s}]}", "oneOf", "type", "string",
                                  "maxLength", 3, "type", "integer", "type", "null")
                      : json_pack("{s:[{s:s,s:{s:{s:s},s:o},s:[s]},{s:s,s:{s:{s:[s,s]}},s:[s]}]}",
                                  "oneOf", "type", "object", "properties", "kind", "const", "a",
                                  "v", gen(depth + 1), "required", "kind", "type", "object",
                                  "properties", "kind", "enum", "b", "c", "required", "kind");
    if (r < 19) {
        json_t *b = gen(depth + 1), *a = gen(depth + 1);
        return json_pack("{s:[{s:{s:o},s:[s]},{s:{s:o}}]}", "allOf", "properties", "a", a,
                         "required", "a", "properties", "b", b);
    }
    return json_pack("{s:s}", "$ref", rnd(2) ? "#/$defs/item" : "#/$defs/node");
}

/* A root schema: mostly an object, with the $defs the references use. */
static json_t *gen_root(void)
{
    json_t *s = rnd(10) < 7 ? gen_object(0) : gen(0);
    { /* the references anywhere in it resolve here */
        json_t *item = gen(2), *ref = json_object_get(item, "$ref");
        /* "item" as a bare reference to itself would be a rule that reaches
         * itself before any character, which kvd rightly refuses (left
         * recursion): that draw (it depends on the compiler's order of
         * evaluating json_pack's arguments) takes the other definition */
        if (ref && strcmp(json_string_value(ref), "#/$defs/item") == 0) {
            json_decref(item);
            item = json_pack("{s:s}", "$ref", "#/$defs/node");
        }
        json_t *defs = json_pack("{s:o, s:{s:s, s:{s:{s:s,s:i,s:i}, s:{s:s}}, s:[s], s:b}}", "item",
                                 item, "node", "type", "object", "properties", "v", "type",
                                 "integer", "minimum", 0, "maximum", 9, "next", "$ref",
                                 "#/$defs/node", "required", "v", "additionalProperties", 0);
        json_object_set_new(s, "$defs", defs);
    }
    return s;
}

/* ---- fixture ------------------------------------------------------------------ */

static int setup(void **state)
{
    const char *tools = getenv("KVD_TOOLS_DIR"), *ajv = getenv("KVD_AJV_NPM_DIR");
    const char *home = getenv("HOME");
    char cmd[1024];
    if (system("curl --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "curl is absent: skipped\n");
        exit(77);
    }
    if (ajv && ajv[0])
        snprintf(g_ajv, sizeof g_ajv, "%s", ajv);
    else
        snprintf(g_ajv, sizeof g_ajv, "%s/.cache/kvd/ajv-npm", home ? home : "/root");
    snprintf(g_dir, sizeof g_dir, "/tmp/kvd-jsout.XXXXXX");
    if (!tools || !mkdtemp(g_dir))
        return -1;
    snprintf(g_model, sizeof g_model, "%s/m.gguf", g_dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --layers 2 --embd 64 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 512 --ctx 4096 --seed 9 --chat-template %s/tests/text/templates/chatml.jinja"
             " >/dev/null",
             tools, g_model, KVD_SOURCE_DIR);
    if (system(cmd) != 0)
        return -1;
    char sock[128];
    snprintf(sock, sizeof sock, "%s/http.sock", g_dir);
    const char *const args[] = {
        "--backend", "cpu", "--model", g_model, "--http-socket", sock, "--no-roofline-probe", NULL};
    g_d = kh_new(NULL, args);
    return g_d ? 0 : -1;
}

static int teardown(void **state)
{
    int st = kh_free(g_d);
    char f[128];
    snprintf(f, sizeof f, "%s/body.json", g_dir);
    unlink(f);
    snprintf(f, sizeof f, "%s/outputs.jsonl", g_dir);
    unlink(f);
    unlink(g_model);
    rmdir(g_dir);
    return st == 0 ? 0 : -1;
}

/* ---- tests --------------------------------------------------------------------- */

/* One answer: it ended by itself and parses; a line for Ajv. */
static void record(FILE *out, const json_t *schema, const char *finish, const char *text,
                   size_t len, int i)
{
    if (strcmp(finish, "stop"))
        fail_msg("schema %d: finish_reason %s (text %.*s)", i, finish, (int)len, text);
    json_error_t je;
    json_t *v = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (!v)
        fail_msg("schema %d: not JSON (%s): %.*s", i, je.text, (int)len, text);
    json_decref(v);
    json_t *line = json_pack("{s:O, s:s%}", "schema", schema, "text", text, len);
    char *s = json_dumps(line, JSON_COMPACT);
    fprintf(out, "%s\n", s);
    free(s);
    json_decref(line);
}

static void test_random_schemas(void **state)
{
    json_t *schemas[N_SCHEMAS];
    for (int i = 0; i < N_SCHEMAS; i++)
        schemas[i] = gen_root();
    char path[128];
    snprintf(path, sizeof path, "%s/outputs.jsonl", g_dir);
    FILE *out = fopen(path, "w");
    assert_non_null(out);
    /* msgpack: every fourth one goes over HTTP; the others pipelined on one
     * connection (batched by the executor), maps and JSON texts */
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    /* at most WINDOW in flight: each is compiled on the text workers, which
     * hold 16 of a tenant's jobs (text-jobs-per-tenant) */
    enum { WINDOW = 12 };
    int next = 0;
    size_t in_flight = 0;
    for (;;) {
        while (in_flight < WINDOW && next < N_SCHEMAS) {
            if (next % 4 != 3) {
                send_schema(fd, (uint64_t)next + 1, schemas[next], next % 2, 1000 + (uint64_t)next,
                            NULL, NULL);
                in_flight++;
            }
            next++;
        }
        if (!in_flight)
            break;
        in_flight--;
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        int i = (int)r.id - 1;
        if (r.code)
            fail_msg("schema %d refused: %s", i, r.message);
        const msgpack_object *t = kh_obj(r.root, "text"), *f = kh_obj(r.root, "finish_reason");
        char fin[16];
        snprintf(fin, sizeof fin, "%.*s", (int)f->via.str.size, f->via.str.ptr);
        record(out, schemas[i], fin, t->via.str.ptr, t->via.str.size, i);
        kh_reply_free(&r);
    }
    close(fd);
    for (int i = 3; i < N_SCHEMAS; i += 4) {
        int st;
        json_t *rf = json_pack("{s:s, s:{s:s, s:O, s:b}}", "type", "json_schema", "json_schema",
                               "name", "out", "schema", schemas[i], "strict", 1);
        json_t *o = chat_rf(rf, 1000 + (uint64_t)i, &st);
        if (st != 200)
            fail_msg("schema %d: HTTP %d", i, st);
        json_t *c = json_array_get(json_object_get(o, "choices"), 0);
        const char *text =
            json_string_value(json_object_get(json_object_get(c, "message"), "content"));
        record(out, schemas[i], json_string_value(json_object_get(c, "finish_reason")), text,
               strlen(text), i);
        json_decref(o);
    }
    fclose(out);
    for (int i = 0; i < N_SCHEMAS; i++)
        json_decref(schemas[i]);
    char cmd[1024];
    struct stat stt;
    snprintf(cmd, sizeof cmd, "%s/node_modules/ajv/dist/2020.js", g_ajv);
    if (stat(cmd, &stt) != 0 || system("node --version >/dev/null 2>&1") != 0) {
        print_message("node or the ajv npm package (%s) is absent: every answer parsed; not "
                      "validated\n",
                      g_ajv);
        skip();
    }
    snprintf(cmd, sizeof cmd, "node %s/tests/integration/ajv_validate.mjs %s %s 2>&1",
             KVD_SOURCE_DIR, g_ajv, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char line[4096];
    bool valid = false;
    while (fgets(line, sizeof line, p)) {
        print_message("ajv: %s", line);
        valid |= !strncmp(line, "valid ", 6);
    }
    assert_int_equal(pclose(p), 0);
    assert_true(valid);
}

/* Every keyword kvd does not generate exactly: HTTP 400 with the path as
 * param; msgpack bad_request naming it. */
static void test_refusals(void **state)
{
    static const char *const kw[] = {
        "not",
        "if",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "dependentRequired",
        "unevaluatedProperties",
        "additionalItems",
        "nullable",
    };
    int fd = kh_connect(g_d->sock);
    assert_true(fd >= 0);
    for (size_t i = 0; i < sizeof kw / sizeof kw[0]; i++) {
        json_t *s = json_pack("{s:s, s:{s:{s:s, s:i}}}", "type", "object", "properties", "x",
                              "type", "string", kw[i], 1);
        int st;
        json_t *rf = json_pack("{s:s, s:{s:s, s:O}}", "type", "json_schema", "json_schema", "name",
                               "n", "schema", s);
        json_t *o = chat_rf(rf, 1, &st);
        assert_int_equal(st, 400);
        json_t *e = json_object_get(o, "error");
        char want[160];
        snprintf(want, sizeof want, "response_format.json_schema.schema.properties.x.%s", kw[i]);
        assert_string_equal(json_string_value(json_object_get(e, "param")), want);
        assert_string_equal(json_string_value(json_object_get(e, "code")), "bad_request");
        json_decref(o);
        send_schema(fd, 1, s, i % 2, 1, NULL, NULL);
        struct kh_reply r;
        assert_int_equal(kh_recv(fd, &r), 0);
        assert_int_equal(r.code, KVD_EBADREQ);
        assert_non_null(strstr(r.message, kw[i]));
        kh_reply_free(&r);
        json_decref(s);
    }
    /* msgpack: a JSON text that is not JSON, a map with binary */
    struct kh_req q;
    kh_req_begin(&q, "generate", 2, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, 4);
    proto_pack_kv_str(&q.pk, "json_schema", "{\"type\":");
    assert_int_equal(kh_req_send(fd, &q), 0);
    struct kh_reply r;
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBADREQ);
    assert_non_null(strstr(r.message, "json_schema"));
    kh_reply_free(&r);
    kh_req_begin(&q, "generate", 3, 2);
    proto_pack_kv_u32_array(&q.pk, "tokens", g_prompt, 4);
    proto_pack_str(&q.pk, "json_schema");
    proto_pack_map(&q.pk, 1);
    proto_pack_str(&q.pk, "const");
    msgpack_pack_bin(&q.pk, 2);
    msgpack_pack_bin_body(&q.pk, "ab", 2);
    assert_int_equal(kh_req_send(fd, &q), 0);
    assert_int_equal(kh_recv(fd, &r), 0);
    assert_int_equal(r.code, KVD_EBADREQ);
    kh_reply_free(&r);
    close(fd);
}

/* Any JSON object, over HTTP (both endpoints) and msgpack; the closing
 * characters are favoured (logit_bias) so that noise ends its objects. */
static void test_json_object(void **state)
{
    /* byte tokens are 3 + the byte: '"' '}' ']' */
    static const char bias[] = "\"logit_bias\":{\"37\":4,\"128\":4,\"96\":4}";
    for (int k = 0; k < 12; k++) {
        char body[512];
        int st;
        snprintf(body, sizeof body,
                 "{%s,\"max_tokens\":%d,\"temperature\":1,\"seed\":%d,\"response_format\":{"
                 "\"type\":\"json_object\"},%s}",
                 k % 2 ? "\"prompt\":\"{\""
                       : "\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]",
                 MAX_TOKENS, k, bias);
        char *out =
            http_post(g_dir, NULL, k % 2 ? "/v1/completions" : "/v1/chat/completions", body, &st);
        assert_int_equal(st, 200);
        json_t *o = json_loads(out, 0, NULL);
        assert_non_null(o);
        json_t *c = json_array_get(json_object_get(o, "choices"), 0);
        const char *text =
            k % 2 ? json_string_value(json_object_get(c, "text"))
                  : json_string_value(json_object_get(json_object_get(c, "message"), "content"));
        assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
        json_t *v = json_loads(text, 0, NULL);
        if (!json_is_object(v))
            fail_msg("not an object: %s", text);
        json_decref(v);
        json_decref(o);
        free(out);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_json_object),
        cmocka_unit_test(test_random_schemas),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

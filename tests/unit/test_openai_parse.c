/* openai_parse alone (daemon/server/openai.c): every request field of
 * docs/http.md in its accepted and refused forms. An accepted body's
 * generate arguments are decoded back from msgpack and checked key by key;
 * a refused one must have the status, the code and the param the docs
 * give, and a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "openai.h"
#include "proto.h"
#include "text_out.h"

#define N_CTX 4096

/* An accepted body's arguments, decoded (freed by the teardown, also after a
 * failed assert). */
struct parsed {
    struct openai_req req;
    struct proto_msg msg;
    bool have_req, have_msg;
};
static struct parsed g;

static void parsed_free(void)
{
    if (g.have_msg)
        proto_msg_free(&g.msg);
    if (g.have_req)
        openai_req_free(&g.req);
    memset(&g, 0, sizeof(g));
}

static int teardown(void **state)
{
    (void)state;
    parsed_free();
    return 0;
}

/* Parses body as kind; it must be accepted. Returns the arguments' map. */
static const msgpack_object *ok(enum openai_kind kind, const char *body)
{
    parsed_free();
    struct openai_err e;
    if (openai_parse(kind, body, strlen(body), N_CTX, &g.req, &e) != 0)
        fail_msg("refused (%d %s, param '%s': %s): %s", e.status, e.code, e.param, e.message, body);
    g.have_req = true;
    struct kvd_error pe = {0};
    assert_int_equal(proto_msg_parse(&g.msg, g.req.args.data, g.req.args.size, &pe), 0);
    g.have_msg = true;
    assert_int_equal(g.msg.root->type, MSGPACK_OBJECT_MAP);
    return g.msg.root;
}

static const msgpack_object *ok_c(const char *body)
{
    return ok(OPENAI_COMPLETION, body);
}

static const msgpack_object *ok_chat(const char *body)
{
    return ok(OPENAI_CHAT, body);
}

/* Parses body as kind; it must be refused with status, code and param. */
static void refused(enum openai_kind kind, const char *body, int status, const char *code,
                    const char *param)
{
    struct openai_req r;
    struct openai_err e;
    memset(&e, 0, sizeof(e));
    if (openai_parse(kind, body, strlen(body), N_CTX, &r, &e) == 0) {
        openai_req_free(&r);
        fail_msg("accepted, expected %d %s: %s", status, code, body);
    }
    if (e.status != status || strcmp(e.code, code) || strcmp(e.param, param))
        fail_msg("%d %s param '%s' (%s), expected %d %s param '%s': %s", e.status, e.code, e.param,
                 e.message, status, code, param, body);
    assert_true(e.message[0] != '\0');
    assert_true(e.type[0] != '\0');
    /* r was released: nothing to free, and freeing it again is harmless */
    openai_req_free(&r);
}

#define BAD_C(body, param) refused(OPENAI_COMPLETION, body, 400, "bad_request", param)
#define BAD_CHAT(body, param) refused(OPENAI_CHAT, body, 400, "bad_request", param)
#define UNSUP_C(body, param) refused(OPENAI_COMPLETION, body, 400, "unsupported", param)
#define UNSUP_CHAT(body, param) refused(OPENAI_CHAT, body, 400, "unsupported", param)

static const msgpack_object *key(const msgpack_object *m, const char *k)
{
    return proto_map_find(m, k);
}

static uint64_t u64_of(const msgpack_object *m, const char *k)
{
    const msgpack_object *o = key(m, k);
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
    return o->via.u64;
}

static double dbl_of(const msgpack_object *m, const char *k)
{
    const msgpack_object *o = key(m, k);
    assert_non_null(o);
    assert_true(o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32);
    return o->via.f64;
}

static bool bool_of(const msgpack_object *m, const char *k)
{
    const msgpack_object *o = key(m, k);
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_BOOLEAN);
    return o->via.boolean;
}

static void expect_str(const msgpack_object *o, const char *want)
{
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    assert_int_equal(o->via.str.size, strlen(want));
    assert_memory_equal(o->via.str.ptr, want, o->via.str.size);
}

static void expect_ids(const msgpack_object *o, const uint64_t *ids, size_t n)
{
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(o->via.array.size, n);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(o->via.array.ptr[i].via.u64, ids[i]);
}

/* ---- the body ---------------------------------------------------------------- */

static void test_body(void **state)
{
    (void)state;
    BAD_C("", "");
    BAD_C("{\"prompt\":[1]", "");
    BAD_C("[1,2]", "");
    BAD_C("\"text\"", "");
    BAD_C("{\"prompt\":[1]} x", "");              /* trailing bytes */
    BAD_C("{\"prompt\":[1],\"prompt\":[2]}", ""); /* duplicate keys */
    BAD_C("{\"prompt\":\"\xff\xfe\"}", "");       /* invalid UTF-8 */
    BAD_C("{\"prompt\":\"a\\u0000b\"}", "");      /* NUL in a string */
    struct openai_req r;
    struct openai_err e;
    assert_int_equal(openai_parse(OPENAI_COMPLETION, "{\"prompt\":[1]}", 14, 0, &r, &e), -1);
    assert_int_equal(e.status, 503);
    /* unknown fields are ignored, whatever their type */
    const msgpack_object *m = ok_c("{\"prompt\":[1],\"user\":7,\"frequency_penalty\":\"x\","
                                   "\"tools\":[{}],\"suffix\":null,\"best_of\":{\"a\":1}}");
    assert_null(key(m, "user"));
    assert_null(key(m, "tools"));
}

/* ---- prompt and messages -------------------------------------------------------- */

static void test_prompt(void **state)
{
    (void)state;
    static const uint64_t ids[] = {5, 6, 4294967295u};
    expect_str(key(ok_c("{\"prompt\":\"Once upon\"}"), "text"), "Once upon");
    expect_str(key(ok_c("{\"prompt\":[\"Once upon\"]}"), "text"), "Once upon");
    expect_str(key(ok_c("{\"prompt\":\"\"}"), "text"), "");
    expect_ids(key(ok_c("{\"prompt\":[5,6,4294967295]}"), "tokens"), ids, 3);
    const msgpack_object *m = ok_c("{\"prompt\":[[5,6,4294967295]]}");
    expect_ids(key(m, "tokens"), ids, 3);
    assert_null(key(m, "text"));
    assert_null(key(m, "messages"));
    BAD_C("{}", "prompt");
    BAD_C("{\"prompt\":null}", "prompt");
    BAD_C("{\"prompt\":5}", "prompt");
    BAD_C("{\"prompt\":{\"text\":\"a\"}}", "prompt");
    BAD_C("{\"prompt\":[]}", "prompt");
    BAD_C("{\"prompt\":[[]]}", "prompt");
    BAD_C("{\"prompt\":[-1]}", "prompt");
    BAD_C("{\"prompt\":[4294967296]}", "prompt");
    BAD_C("{\"prompt\":[1.5]}", "prompt");
    BAD_C("{\"prompt\":[1,\"a\"]}", "prompt");
    BAD_C("{\"prompt\":[[1,-2]]}", "prompt");
    UNSUP_C("{\"prompt\":[\"a\",\"b\"]}", "prompt");
    UNSUP_C("{\"prompt\":[[1],[2]]}", "prompt");
    /* more ids than an array may hold */
    size_t n = KVD_MAX_ARRAY + 1, cap = 16 + 2 * n;
    char *big = malloc(cap);
    assert_non_null(big);
    size_t at = (size_t)snprintf(big, cap, "{\"prompt\":[");
    for (size_t i = 0; i < n; i++)
        at += (size_t)snprintf(big + at, cap - at, i ? ",1" : "1");
    snprintf(big + at, cap - at, "]}");
    struct openai_req r;
    struct openai_err e;
    int rc = openai_parse(OPENAI_COMPLETION, big, strlen(big), N_CTX, &r, &e);
    free(big);
    assert_int_equal(rc, -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "prompt");
    /* prompt is not read by chat, messages not by completions */
    BAD_CHAT("{\"prompt\":\"a\"}", "messages");
    BAD_C("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", "prompt");
}

static void test_messages(void **state)
{
    (void)state;
    const msgpack_object *m =
        ok_chat("{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Tell me \"},"
                "{\"type\":\"text\",\"text\":\"a story.\"}]},"
                "{\"role\":\"assistant\",\"content\":null,\"name\":\"x\"}]}");
    const msgpack_object *msgs = key(m, "messages");
    assert_non_null(msgs);
    assert_int_equal(msgs->via.array.size, 3);
    expect_str(key(&msgs->via.array.ptr[0], "role"), "system");
    expect_str(key(&msgs->via.array.ptr[0], "content"), "Be brief.");
    expect_str(key(&msgs->via.array.ptr[1], "content"), "Tell me a story.");
    expect_str(key(&msgs->via.array.ptr[2], "role"), "assistant");
    expect_str(key(&msgs->via.array.ptr[2], "content"), "");
    assert_null(key(&msgs->via.array.ptr[2], "name")); /* only role and content */
    assert_null(key(m, "text"));
    assert_null(key(m, "tokens"));
    expect_str(
        key(&key(ok_chat("{\"messages\":[{\"role\":\"user\"}]}"), "messages")->via.array.ptr[0],
            "content"),
        "");
    BAD_CHAT("{}", "messages");
    BAD_CHAT("{\"messages\":null}", "messages");
    BAD_CHAT("{\"messages\":[]}", "messages");
    BAD_CHAT("{\"messages\":{\"role\":\"user\"}}", "messages");
    BAD_CHAT("{\"messages\":[\"hi\"]}", "messages");
    BAD_CHAT("{\"messages\":[{\"content\":\"hi\"}]}", "messages");
    BAD_CHAT("{\"messages\":[{\"role\":1,\"content\":\"hi\"}]}", "messages");
    BAD_CHAT("{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages");
    BAD_CHAT("{\"messages\":[{\"role\":\"user\",\"content\":[\"hi\"]}]}", "messages");
    BAD_CHAT("{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"hi\"}]}]}", "messages");
    BAD_CHAT("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":5}]}]}",
             "messages");
    UNSUP_CHAT("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
               "\"image_url\":{\"url\":\"x\"}}]}]}",
               "messages");
}

/* ---- sampling and length ------------------------------------------------------ */

static void test_max_tokens(void **state)
{
    (void)state;
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1]}"), "max_tokens"), 16);
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"max_tokens\":null}"), "max_tokens"), 16);
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"max_tokens\":1}"), "max_tokens"), 1);
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"max_tokens\":4096}"), "max_tokens"), N_CTX);
    /* the default never passes a context smaller than 16 (found by fuzz_http) */
    struct openai_req r;
    struct openai_err e;
    assert_int_equal(openai_parse(OPENAI_COMPLETION, "{\"prompt\":[1]}", 14, 8, &r, &e), 0);
    struct proto_msg m8;
    struct kvd_error pe = {0};
    assert_int_equal(proto_msg_parse(&m8, r.args.data, r.args.size, &pe), 0);
    uint64_t mt = u64_of(m8.root, "max_tokens");
    proto_msg_free(&m8);
    openai_req_free(&r);
    assert_int_equal(mt, 8);
    BAD_C("{\"prompt\":[1],\"max_tokens\":0}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":4097}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":-1}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":\"5\"}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":2.5}", "max_tokens");
    /* max_completion_tokens: chat only, over max_tokens */
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"max_completion_tokens\":7}"), "max_tokens"),
                     16);
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[256];
    snprintf(b, sizeof(b), "{%s}", msg);
    assert_int_equal(u64_of(ok_chat(b), "max_tokens"), N_CTX);
    snprintf(b, sizeof(b), "{%s,\"max_tokens\":9}", msg);
    assert_int_equal(u64_of(ok_chat(b), "max_tokens"), 9);
    snprintf(b, sizeof(b), "{%s,\"max_tokens\":9,\"max_completion_tokens\":7}", msg);
    assert_int_equal(u64_of(ok_chat(b), "max_tokens"), 7);
    snprintf(b, sizeof(b), "{%s,\"max_completion_tokens\":0}", msg);
    BAD_CHAT(b, "max_completion_tokens");
    snprintf(b, sizeof(b), "{%s,\"max_completion_tokens\":true}", msg);
    BAD_CHAT(b, "max_completion_tokens");
}

static void test_temperature_top_p_seed(void **state)
{
    (void)state;
    const msgpack_object *m = ok_c("{\"prompt\":[1]}");
    assert_true(dbl_of(m, "temperature") == 1.0);
    assert_true(dbl_of(m, "top_p") == 1.0);
    assert_null(key(m, "seed"));
    assert_true(dbl_of(ok_c("{\"prompt\":[1],\"temperature\":0}"), "temperature") == 0.0);
    assert_true(dbl_of(ok_c("{\"prompt\":[1],\"temperature\":2}"), "temperature") == 2.0);
    assert_true(dbl_of(ok_c("{\"prompt\":[1],\"temperature\":0.7}"), "temperature") == 0.7);
    BAD_C("{\"prompt\":[1],\"temperature\":2.01}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":-0.1}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":\"0\"}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":1e999}", ""); /* not JSON jansson reads */
    /* top_p in (0, 1]; 0 means only the most likely token */
    double p0 = dbl_of(ok_c("{\"prompt\":[1],\"top_p\":0}"), "top_p");
    assert_true(p0 > 0 && p0 < 1e-6);
    assert_true(dbl_of(ok_c("{\"prompt\":[1],\"top_p\":0.5}"), "top_p") == 0.5);
    assert_true(dbl_of(ok_c("{\"prompt\":[1],\"top_p\":1}"), "top_p") == 1.0);
    BAD_C("{\"prompt\":[1],\"top_p\":1.5}", "top_p");
    BAD_C("{\"prompt\":[1],\"top_p\":-0.5}", "top_p");
    BAD_C("{\"prompt\":[1],\"top_p\":[1]}", "top_p");
    /* seed: any integer (a negative one as its 64-bit pattern) */
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"seed\":42}"), "seed"), 42);
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"seed\":-1}"), "seed"), UINT64_MAX);
    assert_int_equal(u64_of(ok_c("{\"prompt\":[1],\"seed\":9223372036854775807}"), "seed"),
                     INT64_MAX);
    assert_null(key(ok_c("{\"prompt\":[1],\"seed\":null}"), "seed"));
    BAD_C("{\"prompt\":[1],\"seed\":1.5}", "seed");
    BAD_C("{\"prompt\":[1],\"seed\":\"1\"}", "seed");
}

static void test_stop(void **state)
{
    (void)state;
    assert_null(key(ok_c("{\"prompt\":[1]}"), "stop"));
    assert_null(key(ok_c("{\"prompt\":[1],\"stop\":null}"), "stop"));
    assert_null(key(ok_c("{\"prompt\":[1],\"stop\":[]}"), "stop"));
    const msgpack_object *s = key(ok_c("{\"prompt\":[1],\"stop\":\"\\n\\n\"}"), "stop");
    assert_non_null(s);
    assert_int_equal(s->via.array.size, 1);
    expect_str(&s->via.array.ptr[0], "\n\n");
    s = key(ok_c("{\"prompt\":[1],\"stop\":[\"a\",\"b\",\"c\",\"d\"]}"), "stop");
    assert_int_equal(s->via.array.size, 4);
    expect_str(&s->via.array.ptr[3], "d");
    BAD_C("{\"prompt\":[1],\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", "stop");
    BAD_C("{\"prompt\":[1],\"stop\":\"\"}", "stop");
    BAD_C("{\"prompt\":[1],\"stop\":[\"a\",\"\"]}", "stop");
    BAD_C("{\"prompt\":[1],\"stop\":[1]}", "stop");
    BAD_C("{\"prompt\":[1],\"stop\":5}", "stop");
    BAD_C("{\"prompt\":[1],\"stop\":{\"a\":1}}", "stop");
    /* a stop string of TEXT_OUT_MAX_STOP_LEN bytes, and one more */
    char b[2 * TEXT_OUT_MAX_STOP_LEN];
    int n = snprintf(b, sizeof(b), "{\"prompt\":[1],\"stop\":\"%0*d\"}", TEXT_OUT_MAX_STOP_LEN, 0);
    assert_true(n > 0 && (size_t)n < sizeof(b));
    s = key(ok_c(b), "stop");
    assert_int_equal(s->via.array.ptr[0].via.str.size, TEXT_OUT_MAX_STOP_LEN);
    snprintf(b, sizeof(b), "{\"prompt\":[1],\"stop\":[\"%0*d\"]}", TEXT_OUT_MAX_STOP_LEN + 1, 0);
    BAD_C(b, "stop");
}

/* ---- stream and the fields kvd does not do --------------------------------- */

static void test_stream(void **state)
{
    (void)state;
    const msgpack_object *m = ok_c("{\"prompt\":[1]}");
    assert_false(bool_of(m, "stream"));
    assert_false(g.req.stream);
    assert_false(g.req.include_usage);
    assert_null(key(m, "ignore_eos"));
    m = ok_c("{\"prompt\":[1],\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    assert_true(bool_of(m, "stream"));
    assert_true(g.req.stream);
    assert_true(g.req.include_usage);
    assert_int_equal(g.req.kind, OPENAI_COMPLETION);
    ok_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"stream\":true,"
            "\"stream_options\":null}");
    assert_true(g.req.stream);
    assert_false(g.req.include_usage);
    assert_int_equal(g.req.kind, OPENAI_CHAT);
    assert_true(bool_of(ok_c("{\"prompt\":[1],\"ignore_eos\":true}"), "ignore_eos"));
    assert_null(key(ok_c("{\"prompt\":[1],\"ignore_eos\":false}"), "ignore_eos"));
    BAD_C("{\"prompt\":[1],\"stream\":\"true\"}", "stream");
    BAD_C("{\"prompt\":[1],\"stream\":1}", "stream");
    BAD_C("{\"prompt\":[1],\"stream_options\":true}", "stream_options");
    BAD_C("{\"prompt\":[1],\"stream_options\":{\"include_usage\":1}}", "include_usage");
    BAD_C("{\"prompt\":[1],\"ignore_eos\":\"yes\"}", "ignore_eos");
}

static void test_unsupported(void **state)
{
    (void)state;
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[256];
    ok_c("{\"prompt\":[1],\"n\":1,\"echo\":false,\"logprobs\":0,\"model\":\"gpt-x\"}");
    ok_c("{\"prompt\":[1],\"n\":null,\"echo\":null,\"logprobs\":null,\"model\":null}");
    UNSUP_C("{\"prompt\":[1],\"n\":2}", "n");
    BAD_C("{\"prompt\":[1],\"n\":0}", "n");
    BAD_C("{\"prompt\":[1],\"n\":129}", "n");
    BAD_C("{\"prompt\":[1],\"n\":\"1\"}", "n");
    UNSUP_C("{\"prompt\":[1],\"echo\":true}", "echo");
    BAD_C("{\"prompt\":[1],\"echo\":0}", "echo");
    UNSUP_C("{\"prompt\":[1],\"logprobs\":1}", "logprobs");
    BAD_C("{\"prompt\":[1],\"logprobs\":true}", "logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":false}", msg);
    ok_chat(b);
    snprintf(b, sizeof(b), "{%s,\"logprobs\":true}", msg);
    UNSUP_CHAT(b, "logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":0}", msg);
    BAD_CHAT(b, "logprobs");
    snprintf(b, sizeof(b), "{%s,\"n\":3}", msg);
    UNSUP_CHAT(b, "n");
    /* model: a string of at most OPENAI_MAX_MODEL bytes, else 400 */
    BAD_C("{\"prompt\":[1],\"model\":5}", "model");
    char big[OPENAI_MAX_MODEL + 64];
    snprintf(big, sizeof(big), "{\"prompt\":[1],\"model\":\"%0*d\"}", OPENAI_MAX_MODEL, 0);
    ok_c(big);
    snprintf(big, sizeof(big), "{\"prompt\":[1],\"model\":\"%0*d\"}", OPENAI_MAX_MODEL + 1, 0);
    BAD_C(big, "model");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_body, teardown),
        cmocka_unit_test_teardown(test_prompt, teardown),
        cmocka_unit_test_teardown(test_messages, teardown),
        cmocka_unit_test_teardown(test_max_tokens, teardown),
        cmocka_unit_test_teardown(test_temperature_top_p_seed, teardown),
        cmocka_unit_test_teardown(test_stop, teardown),
        cmocka_unit_test_teardown(test_stream, teardown),
        cmocka_unit_test_teardown(test_unsupported, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

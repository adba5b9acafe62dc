/* openai_parse alone (daemon/server/openai.c): every request field of
 * docs/http.md in its accepted and refused forms. An accepted body's typed
 * generate arguments (struct gen_args) are checked field by field; a
 * refused one must have the HTTP status, the code and the param the docs
 * give (openai_status_of: the HTTP edge), and a message. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvd/protocol.h"
#include "grammar.h"
#include "openai.h"
#include "text_out.h"

#define N_CTX 4096

/* An accepted body (freed by the teardown, also after a failed assert). */
struct parsed {
    struct openai_req req;
    bool have_req;
};
static struct parsed g;

static void parsed_free(void)
{
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

/* Parses body as kind with context n_ctx; it must be accepted. */
static const struct gen_args *ok_ctx(enum openai_kind kind, const char *body, uint32_t n_ctx)
{
    parsed_free();
    struct kvd_error e = {0};
    if (openai_parse(kind, body, strlen(body), n_ctx, TOOL_HERMES, &g.req, &e) != 0)
        fail_msg("refused (%s, param '%s': %s): %s", kvd_err_code(e.code), e.param, e.message,
                 body);
    g.have_req = true;
    return &g.req.args;
}

static const struct gen_args *ok_c(const char *body)
{
    return ok_ctx(OPENAI_COMPLETION, body, N_CTX);
}

static const struct gen_args *ok_chat(const char *body)
{
    return ok_ctx(OPENAI_CHAT, body, N_CTX);
}

/* Parses body as kind; it must be refused with status, code and param. */
static void refused(enum openai_kind kind, const char *body, int status, const char *code,
                    const char *param)
{
    struct openai_req r;
    struct kvd_error e;
    memset(&e, 0, sizeof(e));
    if (openai_parse(kind, body, strlen(body), N_CTX, TOOL_HERMES, &r, &e) == 0) {
        openai_req_free(&r);
        fail_msg("accepted, expected %d %s: %s", status, code, body);
    }
    struct openai_status st;
    openai_status_of(&e, &st);
    if (st.status != status || strcmp(st.code, code) || strcmp(e.param, param))
        fail_msg("%d %s param '%s' (%s), expected %d %s param '%s': %s", st.status, st.code,
                 e.param, e.message, status, code, param, body);
    assert_true(e.message[0] != '\0');
    assert_true(st.type[0] != '\0');
    /* the error body is valid JSON naming the same param */
    int bst = 0;
    size_t len = 0;
    char *json = openai_error_body(&e, &bst, &len);
    assert_non_null(json);
    assert_int_equal(bst, status);
    json_error_t je;
    json_t *o = json_loads(json, 0, &je);
    assert_non_null(o);
    json_t *jp = json_object_get(json_object_get(o, "error"), "param");
    if (param[0])
        assert_string_equal(json_string_value(jp), param);
    else
        assert_true(json_is_null(jp));
    json_decref(o);
    free(json);
    /* r was released: nothing to free, and freeing it again is harmless */
    openai_req_free(&r);
}

#define BAD_C(body, param) refused(OPENAI_COMPLETION, body, 400, "bad_request", param)
#define BAD_CHAT(body, param) refused(OPENAI_CHAT, body, 400, "bad_request", param)
#define UNSUP_C(body, param) refused(OPENAI_COMPLETION, body, 400, "unsupported", param)
#define UNSUP_CHAT(body, param) refused(OPENAI_CHAT, body, 400, "unsupported", param)

static void expect_text(const struct gen_args *a, const char *want)
{
    assert_int_equal(a->prompt, GEN_PROMPT_TEXT);
    assert_string_equal(a->prompt_param, "prompt");
    assert_int_equal(a->text_len, strlen(want));
    assert_memory_equal(a->text, want, a->text_len);
}

static void expect_ids(const struct gen_args *a, const uint32_t *ids, size_t n)
{
    assert_int_equal(a->prompt, GEN_PROMPT_TOKENS);
    assert_string_equal(a->prompt_param, "prompt");
    assert_int_equal(a->n_tokens, n);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(a->tokens[i], ids[i]);
}

/* logprobs: completions' integer count, chat's bool + top_logprobs. */
static void test_logprobs(void **state)
{
    (void)state;
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[256];
    const struct gen_args *a = ok_c("{\"prompt\":[1]}");
    assert_false(a->logprobs);
    a = ok_c("{\"prompt\":[1],\"logprobs\":null}");
    assert_false(a->logprobs);
    a = ok_c("{\"prompt\":[1],\"logprobs\":0}");
    assert_true(a->logprobs);
    assert_int_equal(a->top_logprobs, 0);
    a = ok_c("{\"prompt\":[1],\"logprobs\":20}");
    assert_true(a->logprobs);
    assert_int_equal(a->top_logprobs, 20);
    BAD_C("{\"prompt\":[1],\"logprobs\":21}", "logprobs");
    BAD_C("{\"prompt\":[1],\"logprobs\":-1}", "logprobs");
    BAD_C("{\"prompt\":[1],\"logprobs\":true}", "logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":false}", msg);
    assert_false(ok_chat(b)->logprobs);
    snprintf(b, sizeof(b), "{%s,\"logprobs\":true}", msg);
    a = ok_chat(b);
    assert_true(a->logprobs);
    assert_int_equal(a->top_logprobs, 0);
    snprintf(b, sizeof(b), "{%s,\"logprobs\":true,\"top_logprobs\":5}", msg);
    a = ok_chat(b);
    assert_true(a->logprobs);
    assert_int_equal(a->top_logprobs, 5);
    snprintf(b, sizeof(b), "{%s,\"logprobs\":0}", msg);
    BAD_CHAT(b, "logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":true,\"top_logprobs\":21}", msg);
    BAD_CHAT(b, "top_logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":true,\"top_logprobs\":1.5}", msg);
    BAD_CHAT(b, "top_logprobs");
    snprintf(b, sizeof(b), "{%s,\"top_logprobs\":2}", msg);
    BAD_CHAT(b, "top_logprobs");
    snprintf(b, sizeof(b), "{%s,\"logprobs\":false,\"top_logprobs\":0}", msg);
    assert_false(ok_chat(b)->logprobs);
}

/* The rendered logprobs (a token-only model: every token's text is ""):
 * chat's content entries, completions' four arrays with text offsets,
 * -inf as -9999, null in a chunk without tokens. */
static void test_logprobs_render(void **state)
{
    (void)state;
    static const uint32_t toks[] = {7, 3};
    static const struct sampler_logprob lp[] = {{7, -0.5f},     {7, -0.5f},  {2, -1.25f},
                                                {3, -INFINITY}, {1, -0.25f}, {4, -2.0f}};
    struct openai_out o = {.kind = OPENAI_CHAT,
                           .id = "chatcmpl-1",
                           .model = "m",
                           .text = "ab",
                           .text_len = 2,
                           .toks = toks,
                           .n_toks = 2,
                           .finish = "length",
                           .lp = lp,
                           .lp_top = 2,
                           .text_offset = 5};
    size_t len;
    char *s = openai_render(&o, false, &len);
    assert_non_null(s);
    json_error_t je;
    json_t *j = json_loads(s, 0, &je);
    assert_non_null(j);
    json_t *l = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    json_t *c = json_object_get(l, "content");
    assert_int_equal(json_array_size(c), 2);
    assert_true(json_is_null(json_object_get(l, "refusal")));
    json_t *e0 = json_array_get(c, 0), *e1 = json_array_get(c, 1);
    assert_string_equal(json_string_value(json_object_get(e0, "token")), "");
    assert_true(json_real_value(json_object_get(e0, "logprob")) == -0.5);
    assert_int_equal(json_array_size(json_object_get(e0, "bytes")), 0);
    json_t *t0 = json_object_get(e0, "top_logprobs");
    assert_int_equal(json_array_size(t0), 2);
    assert_true(json_real_value(json_object_get(json_array_get(t0, 1), "logprob")) == -1.25);
    assert_non_null(json_object_get(json_array_get(t0, 1), "bytes"));
    assert_true(json_real_value(json_object_get(e1, "logprob")) == -9999.0);
    json_decref(j);
    free(s);
    /* a stream chunk without tokens: null */
    o.n_toks = 0;
    s = openai_render(&o, true, &len);
    j = json_loads(s, 0, &je);
    assert_true(json_is_null(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs")));
    json_decref(j);
    free(s);
    /* completions */
    o.kind = OPENAI_COMPLETION;
    o.n_toks = 2;
    s = openai_render(&o, false, &len);
    j = json_loads(s, 0, &je);
    l = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    assert_int_equal(json_array_size(json_object_get(l, "tokens")), 2);
    json_t *tl = json_object_get(l, "token_logprobs");
    assert_true(json_real_value(json_array_get(tl, 0)) == -0.5);
    assert_true(json_real_value(json_array_get(tl, 1)) == -9999.0);
    json_t *off = json_object_get(l, "text_offset");
    assert_int_equal(json_integer_value(json_array_get(off, 0)), 5);
    assert_int_equal(json_integer_value(json_array_get(off, 1)), 5); /* "" pieces */
    json_t *tops = json_object_get(l, "top_logprobs");
    assert_int_equal(json_array_size(tops), 2);
    /* two alternatives with the same text (""): the likelier's */
    assert_int_equal(json_object_size(json_array_get(tops, 1)), 1);
    assert_true(json_real_value(json_object_get(json_array_get(tops, 1), "")) == -0.25);
    json_decref(j);
    free(s);
    /* not asked: null */
    o.lp = NULL;
    s = openai_render(&o, false, &len);
    j = json_loads(s, 0, &je);
    assert_true(json_is_null(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs")));
    json_decref(j);
    free(s);
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
    /* unknown fields are ignored, whatever their type */
    const struct gen_args *a = ok_c("{\"prompt\":[1],\"user\":7,\"service_tier\":\"x\","
                                    "\"tools\":[{}],\"suffix\":null,\"best_of\":{\"a\":1}}");
    static const uint32_t one[] = {1};
    expect_ids(a, one, 1);
}

/* ---- prompt and messages -------------------------------------------------------- */

static void test_prompt(void **state)
{
    (void)state;
    static const uint32_t ids[] = {5, 6, 4294967295u};
    expect_text(ok_c("{\"prompt\":\"Once upon\"}"), "Once upon");
    expect_text(ok_c("{\"prompt\":[\"Once upon\"]}"), "Once upon");
    expect_text(ok_c("{\"prompt\":\"\"}"), "");
    expect_ids(ok_c("{\"prompt\":[5,6,4294967295]}"), ids, 3);
    const struct gen_args *a = ok_c("{\"prompt\":[[5,6,4294967295]]}");
    expect_ids(a, ids, 3);
    assert_int_equal(a->n_msgs, 0);
    assert_null(a->text);
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
    struct kvd_error e;
    int rc = openai_parse(OPENAI_COMPLETION, big, strlen(big), N_CTX, TOOL_HERMES, &r, &e);
    free(big);
    assert_int_equal(rc, -1);
    struct openai_status st;
    openai_status_of(&e, &st);
    assert_int_equal(st.status, 400);
    assert_string_equal(e.param, "prompt");
    /* prompt is not read by chat, messages not by completions */
    BAD_CHAT("{\"prompt\":\"a\"}", "messages");
    BAD_C("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", "prompt");
}

static void test_messages(void **state)
{
    (void)state;
    const struct gen_args *a =
        ok_chat("{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Tell me \"},"
                "{\"type\":\"text\",\"text\":\"a story.\"}]},"
                "{\"role\":\"assistant\",\"content\":null,\"name\":\"x\"}]}");
    assert_int_equal(a->prompt, GEN_PROMPT_MESSAGES);
    assert_string_equal(a->prompt_param, "messages");
    assert_int_equal(a->n_msgs, 3);
    assert_string_equal(a->msgs[0].role, "system");
    assert_string_equal(a->msgs[0].content, "Be brief.");
    assert_string_equal(a->msgs[1].content, "Tell me a story.");
    assert_string_equal(a->msgs[2].role, "assistant");
    assert_string_equal(a->msgs[2].content, "");
    assert_null(a->text);
    assert_int_equal(a->n_tokens, 0);
    a = ok_chat("{\"messages\":[{\"role\":\"user\"}]}");
    assert_int_equal(a->n_msgs, 1);
    assert_string_equal(a->msgs[0].content, "");
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

static uint64_t max_tokens_of(const struct gen_args *a)
{
    assert_true(a->has_max_tokens);
    return a->max_tokens;
}

static void test_max_tokens(void **state)
{
    (void)state;
    assert_int_equal(max_tokens_of(ok_c("{\"prompt\":[1]}")), 16);
    assert_int_equal(max_tokens_of(ok_c("{\"prompt\":[1],\"max_tokens\":null}")), 16);
    assert_int_equal(max_tokens_of(ok_c("{\"prompt\":[1],\"max_tokens\":1}")), 1);
    assert_int_equal(max_tokens_of(ok_c("{\"prompt\":[1],\"max_tokens\":4096}")), N_CTX);
    /* the default never passes a context smaller than 16 (found by fuzz_http) */
    assert_int_equal(max_tokens_of(ok_ctx(OPENAI_COMPLETION, "{\"prompt\":[1]}", 8)), 8);
    BAD_C("{\"prompt\":[1],\"max_tokens\":0}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":4097}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":-1}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":\"5\"}", "max_tokens");
    BAD_C("{\"prompt\":[1],\"max_tokens\":2.5}", "max_tokens");
    /* max_completion_tokens: chat only, over max_tokens */
    assert_int_equal(max_tokens_of(ok_c("{\"prompt\":[1],\"max_completion_tokens\":7}")), 16);
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[256];
    snprintf(b, sizeof(b), "{%s}", msg);
    assert_int_equal(max_tokens_of(ok_chat(b)), N_CTX);
    snprintf(b, sizeof(b), "{%s,\"max_tokens\":9}", msg);
    assert_int_equal(max_tokens_of(ok_chat(b)), 9);
    snprintf(b, sizeof(b), "{%s,\"max_tokens\":9,\"max_completion_tokens\":7}", msg);
    assert_int_equal(max_tokens_of(ok_chat(b)), 7);
    snprintf(b, sizeof(b), "{%s,\"max_completion_tokens\":0}", msg);
    BAD_CHAT(b, "max_completion_tokens");
    snprintf(b, sizeof(b), "{%s,\"max_completion_tokens\":true}", msg);
    BAD_CHAT(b, "max_completion_tokens");
}

/* The sampler chain's fields: defaults, values, ranges and logit_bias's
 * string keys. */
static void test_sampler_fields(void **state)
{
    (void)state;
    const struct gen_args *a = ok_c("{\"prompt\":[1]}");
    assert_true(a->min_p == 0 && a->typical_p == 1 && a->repeat_penalty == 1);
    assert_true(a->presence_penalty == 0 && a->frequency_penalty == 0);
    assert_int_equal(a->repeat_last_n, 64);
    assert_int_equal(a->n_logit_bias, 0);
    a = ok_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"min_p\":0.05,"
                "\"typical_p\":0.9,\"repeat_penalty\":1.1,\"repeat_last_n\":-1,"
                "\"presence_penalty\":-2,\"frequency_penalty\":2,"
                "\"logit_bias\":{\"5\":-100,\"70000\":2.5}}");
    assert_true(a->min_p == 0.05 && a->typical_p == 0.9 && a->repeat_penalty == 1.1);
    assert_true(a->presence_penalty == -2 && a->frequency_penalty == 2);
    assert_int_equal(a->repeat_last_n, -1);
    assert_int_equal(a->n_logit_bias, 2);
    for (size_t i = 0; i < 2; i++) {
        const struct logit_bias *b = &a->logit_bias[i];
        assert_true((b->id == 5 && b->bias == -100.0f) || (b->id == 70000 && b->bias == 2.5f));
    }
    assert_int_equal(ok_c("{\"prompt\":[1],\"logit_bias\":{}}")->n_logit_bias, 0);
    assert_int_equal(ok_c("{\"prompt\":[1],\"logit_bias\":null}")->n_logit_bias, 0);
    BAD_C("{\"prompt\":[1],\"presence_penalty\":2.01}", "presence_penalty");
    BAD_C("{\"prompt\":[1],\"frequency_penalty\":\"1\"}", "frequency_penalty");
    BAD_C("{\"prompt\":[1],\"repeat_penalty\":-1}", "repeat_penalty");
    BAD_C("{\"prompt\":[1],\"repeat_last_n\":-2}", "repeat_last_n");
    BAD_C("{\"prompt\":[1],\"repeat_last_n\":1.5}", "repeat_last_n");
    BAD_C("{\"prompt\":[1],\"min_p\":1.1}", "min_p");
    BAD_C("{\"prompt\":[1],\"typical_p\":-1}", "typical_p");
    BAD_C("{\"prompt\":[1],\"logit_bias\":[[1,2]]}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"x\":1}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"\":1}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"+1\":1}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"1 \":1}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"4294967296\":1}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"1\":100.5}}", "logit_bias");
    BAD_C("{\"prompt\":[1],\"logit_bias\":{\"1\":true}}", "logit_bias");
}

static void test_temperature_top_p_seed(void **state)
{
    (void)state;
    const struct gen_args *a = ok_c("{\"prompt\":[1]}");
    assert_true(a->temperature == 1.0);
    assert_true(a->top_p == 1.0);
    assert_false(a->has_seed);
    assert_true(ok_c("{\"prompt\":[1],\"temperature\":0}")->temperature == 0.0);
    assert_true(ok_c("{\"prompt\":[1],\"temperature\":2}")->temperature == 2.0);
    assert_true(ok_c("{\"prompt\":[1],\"temperature\":0.7}")->temperature == 0.7);
    BAD_C("{\"prompt\":[1],\"temperature\":2.01}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":-0.1}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":\"0\"}", "temperature");
    BAD_C("{\"prompt\":[1],\"temperature\":1e999}", ""); /* not JSON jansson reads */
    /* top_p in (0, 1]; 0 means only the most likely token */
    double p0 = ok_c("{\"prompt\":[1],\"top_p\":0}")->top_p;
    assert_true(p0 > 0 && p0 < 1e-6);
    assert_true(ok_c("{\"prompt\":[1],\"top_p\":0.5}")->top_p == 0.5);
    assert_true(ok_c("{\"prompt\":[1],\"top_p\":1}")->top_p == 1.0);
    BAD_C("{\"prompt\":[1],\"top_p\":1.5}", "top_p");
    BAD_C("{\"prompt\":[1],\"top_p\":-0.5}", "top_p");
    BAD_C("{\"prompt\":[1],\"top_p\":[1]}", "top_p");
    /* seed: any integer (a negative one as its 64-bit pattern) */
    a = ok_c("{\"prompt\":[1],\"seed\":42}");
    assert_true(a->has_seed);
    assert_int_equal(a->seed, 42);
    assert_int_equal(ok_c("{\"prompt\":[1],\"seed\":-1}")->seed, UINT64_MAX);
    assert_int_equal(ok_c("{\"prompt\":[1],\"seed\":9223372036854775807}")->seed, INT64_MAX);
    assert_false(ok_c("{\"prompt\":[1],\"seed\":null}")->has_seed);
    BAD_C("{\"prompt\":[1],\"seed\":1.5}", "seed");
    BAD_C("{\"prompt\":[1],\"seed\":\"1\"}", "seed");
}

static void expect_stop(const struct gen_args *a, size_t i, const char *want)
{
    assert_true(i < a->n_stop_strs);
    assert_int_equal(a->stop_lens[i], strlen(want));
    assert_memory_equal(a->stop_strs[i], want, a->stop_lens[i]);
}

static void test_stop(void **state)
{
    (void)state;
    assert_int_equal(ok_c("{\"prompt\":[1]}")->n_stop_strs, 0);
    assert_int_equal(ok_c("{\"prompt\":[1],\"stop\":null}")->n_stop_strs, 0);
    assert_int_equal(ok_c("{\"prompt\":[1],\"stop\":[]}")->n_stop_strs, 0);
    const struct gen_args *a = ok_c("{\"prompt\":[1],\"stop\":\"\\n\\n\"}");
    assert_int_equal(a->n_stop_strs, 1);
    expect_stop(a, 0, "\n\n");
    a = ok_c("{\"prompt\":[1],\"stop\":[\"a\",\"b\",\"c\",\"d\"]}");
    assert_int_equal(a->n_stop_strs, 4);
    expect_stop(a, 3, "d");
    assert_int_equal(a->n_stop_ids, 0);
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
    assert_int_equal(ok_c(b)->stop_lens[0], TEXT_OUT_MAX_STOP_LEN);
    snprintf(b, sizeof(b), "{\"prompt\":[1],\"stop\":[\"%0*d\"]}", TEXT_OUT_MAX_STOP_LEN + 1, 0);
    BAD_C(b, "stop");
}

/* ---- stream and the fields kvd does not do --------------------------------- */

static void test_stream(void **state)
{
    (void)state;
    const struct gen_args *a = ok_c("{\"prompt\":[1]}");
    assert_false(a->stream);
    assert_false(g.req.stream);
    assert_false(g.req.include_usage);
    assert_false(a->ignore_eos);
    a = ok_c("{\"prompt\":[1],\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    assert_true(a->stream);
    assert_true(g.req.stream);
    assert_true(g.req.include_usage);
    assert_int_equal(g.req.kind, OPENAI_COMPLETION);
    ok_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"stream\":true,"
            "\"stream_options\":null}");
    assert_true(g.req.stream);
    assert_false(g.req.include_usage);
    assert_int_equal(g.req.kind, OPENAI_CHAT);
    assert_true(ok_c("{\"prompt\":[1],\"ignore_eos\":true}")->ignore_eos);
    assert_false(ok_c("{\"prompt\":[1],\"ignore_eos\":false}")->ignore_eos);
    BAD_C("{\"prompt\":[1],\"stream\":\"true\"}", "stream");
    BAD_C("{\"prompt\":[1],\"stream\":1}", "stream");
    BAD_C("{\"prompt\":[1],\"stream_options\":true}", "stream_options");
    BAD_C("{\"prompt\":[1],\"stream_options\":{\"include_usage\":1}}", "include_usage");
    BAD_C("{\"prompt\":[1],\"ignore_eos\":\"yes\"}", "ignore_eos");
}

/* The HTTP edge's mapping of kvd's codes (docs/http.md's table). */
static void test_status_of(void **state)
{
    (void)state;
    static const struct {
        int code;
        const char *param;
        int status;
    } cases[] = {
        {KVD_EBADREQ, "prompt", 400}, {KVD_EUNSUPPORTED, "n", 400},
        {KVD_EUNSUPPORTED, "", 501},  {KVD_ETOOLARGE, "messages", 413},
        {KVD_EPERM, "", 403},         {KVD_EBUSY, "", 429},
        {KVD_EQUOTA, "", 429},        {KVD_ENOMEM, "", 503},
        {KVD_ECANCELLED, "", 503},    {KVD_EINTERNAL, "", 500},
        {KVD_ENOTFOUND, "", 404},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kvd_error e;
        kvd_error_set(&e, cases[i].code, "x");
        kvd_error_param(&e, cases[i].param);
        struct openai_status st;
        openai_status_of(&e, &st);
        assert_int_equal(st.status, cases[i].status);
        assert_string_equal(st.code, kvd_err_code(cases[i].code));
    }
}

/* response_format: compiled while parsing (on the text worker), errors
 * name the keyword's path. */
static void test_response_format(void **state)
{
    (void)state;
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[512];
    snprintf(b, sizeof b, "{%s,\"response_format\":{\"type\":\"text\"}}", msg);
    assert_null(ok_chat(b)->compiled);
    snprintf(b, sizeof b, "{%s,\"response_format\":{\"type\":\"json_object\"}}", msg);
    assert_non_null(ok_chat(b)->compiled);
    snprintf(b, sizeof b,
             "{%s,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":"
             "\"x\",\"strict\":true,\"schema\":{\"type\":\"object\",\"properties\":{\"a\":"
             "{\"type\":\"integer\"}}}}}}",
             msg);
    assert_non_null(ok_chat(b)->compiled);
    assert_non_null(ok_c("{\"prompt\":[1],\"response_format\":{\"type\":\"json_schema\","
                         "\"json_schema\":{\"name\":\"x\"}}}")
                        ->compiled);
    snprintf(b, sizeof b,
             "{%s,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":"
             "\"x\",\"schema\":{\"properties\":{\"x\":{\"not\":{}}}}}}}",
             msg);
    BAD_CHAT(b, "response_format.json_schema.schema.properties.x.not");
    snprintf(b, sizeof b, "{%s,\"response_format\":{\"type\":\"xml\"}}", msg);
    BAD_CHAT(b, "response_format.type");
    snprintf(b, sizeof b, "{%s,\"response_format\":{\"type\":\"json_schema\"}}", msg);
    BAD_CHAT(b, "response_format.json_schema");
    snprintf(b, sizeof b,
             "{%s,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"strict\":"
             "1}}}",
             msg);
    BAD_CHAT(b, "response_format.json_schema.strict");
    snprintf(b, sizeof b, "{%s,\"response_format\":[]}", msg);
    BAD_CHAT(b, "response_format");
    snprintf(b, sizeof b,
             "{%s,\"grammar\":\"root ::= \\\"a\\\"\",\"response_format\":{\"type\":"
             "\"json_object\"}}",
             msg);
    BAD_CHAT(b, "response_format");
    /* a GBNF grammar is compiled here too */
    BAD_C("{\"prompt\":[1],\"grammar\":\"root ::= (\"}", "grammar");
}

/* tools, tool_choice, parallel_tool_calls and messages with tool calls
 * and results: their common form (tool_call.h), the grammar compiled for
 * required, named and auto, and every refusal naming its field. */
static void test_tools(void **state)
{
    (void)state;
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    static const char tools[] =
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"description\":\"d\",\"strict\":true,\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"ping\"}}]";
    char b[2048];
    /* no tools: nothing changes */
    const struct gen_args *a = ok_chat("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}");
    assert_null(a->tools);
    assert_null(a->chat_json);
    assert_int_equal(a->tool_choice, TOOL_CHOICE_AUTO);
    assert_true(a->parallel_tool_calls);
    /* tools: the common form, auto's lazy grammar */
    snprintf(b, sizeof b, "{%s,%s}", msg, tools);
    a = ok_chat(b);
    assert_non_null(a->tools);
    assert_non_null(a->chat_json);
    assert_non_null(a->compiled);
    assert_true(a->tools_compiled);
    char *t = json_dumps(a->tools, JSON_COMPACT);
    assert_string_equal(t, "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                           "\"description\":\"d\",\"parameters\":{\"type\":\"object\","
                           "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":"
                           "[\"city\"]}}},{\"type\":\"function\",\"function\":{\"name\":"
                           "\"ping\"}}]");
    free(t);
    /* choices */
    snprintf(b, sizeof b, "{%s,%s,\"tool_choice\":\"none\"}", msg, tools);
    a = ok_chat(b);
    assert_int_equal(a->tool_choice, TOOL_CHOICE_NONE);
    assert_null(a->compiled);
    snprintf(b, sizeof b, "{%s,%s,\"tool_choice\":\"required\",\"parallel_tool_calls\":false}", msg,
             tools);
    a = ok_chat(b);
    assert_int_equal(a->tool_choice, TOOL_CHOICE_REQUIRED);
    assert_false(a->parallel_tool_calls);
    assert_non_null(a->compiled);
    snprintf(b, sizeof b,
             "{%s,%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"ping\"}}}",
             msg, tools);
    a = ok_chat(b);
    assert_int_equal(a->tool_choice, TOOL_CHOICE_NAMED);
    assert_string_equal(a->tool_name, "ping");
    /* an empty list is none; completions ignore the fields */
    snprintf(b, sizeof b, "{%s,\"tools\":[],\"tool_choice\":\"auto\"}", msg);
    assert_null(ok_chat(b)->tools);
    assert_null(ok_c("{\"prompt\":[1],\"tools\":5,\"tool_choice\":7}")->tools);
    /* messages with calls and results */
    snprintf(b, sizeof b,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
             "\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
             "\"function\":{\"name\":\"ping\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\","
             "\"tool_call_id\":\"call_1\",\"name\":\"ping\",\"content\":[{\"type\":\"text\","
             "\"text\":\"p\"},{\"type\":\"text\",\"text\":\"ong\"}]}]}");
    a = ok_chat(b);
    assert_null(a->tools);
    assert_int_equal(a->n_msgs, 3);
    assert_string_equal(a->msgs[1].content, "");
    t = json_dumps(a->chat_json, JSON_COMPACT);
    assert_string_equal(t, "[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                           "\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":"
                           "\"function\",\"function\":{\"name\":\"ping\",\"arguments\":\"{}\"}}]},"
                           "{\"role\":\"tool\",\"content\":\"pong\",\"tool_call_id\":\"call_1\","
                           "\"name\":\"ping\"}]");
    free(t);
    /* refusals */
    snprintf(b, sizeof b, "{%s,\"tools\":{}}", msg);
    BAD_CHAT(b, "tools");
    snprintf(b, sizeof b, "{%s,\"tools\":[{\"type\":\"retrieval\"}]}", msg);
    UNSUP_CHAT(b, "tools");
    snprintf(b, sizeof b,
             "{%s,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}", msg);
    BAD_CHAT(b, "tools");
    snprintf(b, sizeof b,
             "{%s,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},"
             "{\"type\":\"function\",\"function\":{\"name\":\"a\"}}]}",
             msg);
    BAD_CHAT(b, "tools");
    snprintf(b, sizeof b,
             "{%s,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\","
             "\"parameters\":[]}}]}",
             msg);
    BAD_CHAT(b, "tools");
    snprintf(b, sizeof b, "{%s,\"tool_choice\":\"required\"}", msg);
    BAD_CHAT(b, "tool_choice");
    snprintf(b, sizeof b, "{%s,%s,\"tool_choice\":\"always\"}", msg, tools);
    BAD_CHAT(b, "tool_choice");
    snprintf(b, sizeof b,
             "{%s,%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}}",
             msg, tools);
    BAD_CHAT(b, "tool_choice");
    snprintf(b, sizeof b, "{%s,%s,\"parallel_tool_calls\":1}", msg, tools);
    BAD_CHAT(b, "parallel_tool_calls");
    snprintf(b, sizeof b, "{%s,%s,\"response_format\":{\"type\":\"json_object\"}}", msg, tools);
    UNSUP_CHAT(b, "tools");
    snprintf(b, sizeof b,
             "{%s,%s,\"response_format\":{\"type\":\"json_object\"},"
             "\"tool_choice\":\"none\"}",
             msg, tools);
    assert_non_null(ok_chat(b)->compiled);
    snprintf(b, sizeof b,
             "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":1,\"function\":"
             "{\"name\":\"f\"}}]}]}");
    BAD_CHAT(b, "messages");
    snprintf(b, sizeof b, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}");
    BAD_CHAT(b, "messages");
    snprintf(b, sizeof b, "{\"messages\":[{\"role\":\"tool\",\"tool_call_id\":5}]}");
    BAD_CHAT(b, "messages");
    /* a schema kvd cannot generate exactly: required and named refuse it
     * by its path; auto parses the calls without a grammar */
    static const char bad_tools[] =
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
        "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"string\",\"format\":"
        "\"email\"}}}}}]";
    snprintf(b, sizeof b, "{%s,%s,\"tool_choice\":\"required\"}", msg, bad_tools);
    BAD_CHAT(b, "tools[0].function.parameters.properties.x.format");
    snprintf(b, sizeof b, "{%s,%s}", msg, bad_tools);
    a = ok_chat(b);
    assert_null(a->compiled);
    assert_true(a->tools_compiled);
}

/* A reply with tool calls: message.tool_calls and null content; a stream
 * chunk's delta.tool_calls (index, id, type, name the first time, then
 * arguments). */
static void test_tools_render(void **state)
{
    (void)state;
    struct tool_call_out calls[2] = {
        {.id = "call_a", .name = "f", .args = "{\"x\":1}", .args_len = 7, .args_done = true},
        {.id = "call_b", .name = "g", .args = "{}", .args_len = 2, .args_done = true}};
    struct openai_out o = {.kind = OPENAI_CHAT,
                           .id = "chatcmpl-1",
                           .model = "m",
                           .finish = "tool_calls",
                           .calls = calls,
                           .n_calls = 2};
    size_t len;
    char *s = openai_render(&o, false, &len);
    json_t *j = json_loads(s, 0, NULL);
    assert_non_null(j);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "tool_calls");
    json_t *m = json_object_get(c, "message");
    assert_true(json_is_null(json_object_get(m, "content")));
    json_t *tc = json_object_get(m, "tool_calls");
    assert_int_equal(json_array_size(tc), 2);
    json_t *t1 = json_array_get(tc, 1);
    assert_string_equal(json_string_value(json_object_get(t1, "id")), "call_b");
    assert_string_equal(json_string_value(json_object_get(t1, "type")), "function");
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(t1, "function"), "arguments")), "{}");
    json_decref(j);
    free(s);
    /* with content */
    o.text = "Let me see.";
    o.text_len = 11;
    s = openai_render(&o, false, &len);
    j = json_loads(s, 0, NULL);
    m = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_string_equal(json_string_value(json_object_get(m, "content")), "Let me see.");
    json_decref(j);
    free(s);
    /* stream chunks */
    struct tool_delta d[2] = {{.index = 0, .id = "call_a", .name = "f", .args = "{", .args_len = 1},
                              {.index = 1, .args = "\"x\"", .args_len = 3}};
    struct openai_out k = {.kind = OPENAI_CHAT,
                           .id = "chatcmpl-1",
                           .model = "m",
                           .role = true,
                           .deltas = d,
                           .n_deltas = 2};
    s = openai_render(&k, true, &len);
    j = json_loads(s, 0, NULL);
    json_t *delta = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
    assert_true(json_is_null(json_object_get(delta, "content")));
    tc = json_object_get(delta, "tool_calls");
    assert_int_equal(json_array_size(tc), 2);
    json_t *d0 = json_array_get(tc, 0), *d1 = json_array_get(tc, 1);
    assert_int_equal(json_integer_value(json_object_get(d0, "index")), 0);
    assert_string_equal(json_string_value(json_object_get(d0, "id")), "call_a");
    assert_string_equal(json_string_value(json_object_get(d0, "type")), "function");
    assert_string_equal(json_string_value(json_object_get(json_object_get(d0, "function"), "name")),
                        "f");
    assert_null(json_object_get(d1, "id"));
    assert_null(json_object_get(json_object_get(d1, "function"), "name"));
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(d1, "function"), "arguments")), "\"x\"");
    json_decref(j);
    free(s);
}

static void test_unsupported(void **state)
{
    (void)state;
    static const char msg[] = "\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]";
    char b[256];
    ok_c("{\"prompt\":[1],\"n\":1,\"echo\":false,\"logprobs\":0,\"model\":\"gpt-x\"}");
    ok_c("{\"prompt\":[1],\"n\":null,\"echo\":null,\"logprobs\":null,\"model\":null}");
    assert_int_equal(ok_c("{\"prompt\":[1],\"n\":2}")->n, 2);
    BAD_C("{\"prompt\":[1],\"n\":0}", "n");
    BAD_C("{\"prompt\":[1],\"n\":129}", "n");
    BAD_C("{\"prompt\":[1],\"n\":\"1\"}", "n");
    UNSUP_C("{\"prompt\":[1],\"echo\":true}", "echo");
    BAD_C("{\"prompt\":[1],\"echo\":0}", "echo");
    snprintf(b, sizeof(b), "{%s,\"n\":3}", msg);
    assert_int_equal(ok_chat(b)->n, 3);
    /* model: a string of at most OPENAI_MAX_MODEL bytes, else 400 */
    BAD_C("{\"prompt\":[1],\"model\":5}", "model");
    char big[OPENAI_MAX_MODEL + 64];
    snprintf(big, sizeof(big), "{\"prompt\":[1],\"model\":\"%0*d\"}", OPENAI_MAX_MODEL, 0);
    ok_c(big);
    snprintf(big, sizeof(big), "{\"prompt\":[1],\"model\":\"%0*d\"}", OPENAI_MAX_MODEL + 1, 0);
    BAD_C(big, "model");
}

/* openai_parse_ctx's model lookup, as the daemon's with several models:
 * "small" has a context of 8 and the Mistral family, any other name (and
 * none) 4096 and Hermes, "unknown" no context (refused later by name). */
struct lookup {
    int calls;
    char name[64];
};

static uint32_t lookup_ctx(void *ud, const char *model, size_t len, enum tool_family *family)
{
    struct lookup *l = ud;
    l->calls++;
    snprintf(l->name, sizeof l->name, "%.*s", model ? (int)len : 0, model ? model : "");
    bool small = model && len == 5 && !memcmp(model, "small", 5);
    *family = small ? TOOL_MISTRAL : TOOL_HERMES;
    return model && len == 7 && !memcmp(model, "unknown", 7) ? 0 : small ? 8 : N_CTX;
}

/* Whether gr takes text, over a vocabulary of the 256 bytes. */
static bool grammar_takes(const struct grammar *gr, const char *text)
{
    static char bytes[256];
    const char *pieces[256];
    size_t lens[256];
    bool eog[256] = {true};
    for (int i = 0; i < 256; i++) {
        bytes[i] = (char)i;
        pieces[i] = &bytes[i];
        lens[i] = 1;
    }
    struct grammar_vocab *v = NULL;
    struct grammar_matcher *m = NULL;
    assert_int_equal(grammar_vocab_new(256, pieces, lens, eog, &v), 0);
    assert_int_equal(grammar_matcher_new(gr, v, &m, NULL), 0);
    bool ok =
        grammar_matcher_accept_text(m, text, strlen(text), NULL) == 0 && grammar_matcher_can_end(m);
    grammar_matcher_free(m);
    grammar_vocab_free(v);
    return ok;
}

static void test_model_lookup(void **state)
{
    (void)state;
    static const char body[] =
        "{%s\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tool_choice\":"
        "\"required\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"ping\"}}]}";
    static const char hermes[] = "<tool_call>{\"name\": \"ping\", \"arguments\": {}}</tool_call>";
    static const char mistral[] = "[TOOL_CALLS][{\"name\": \"ping\", \"arguments\": {}}]";
    static const struct {
        const char *field, *name;
        uint32_t ctx;
        bool mistral;
    } cases[] = {
        {"\"model\":\"small\",", "small", 8, true},
        {"\"model\":\"big\",", "big", N_CTX, false},
        {"", "", N_CTX, false},
        {"\"model\":null,", "", N_CTX, false},
        {"\"model\":\"unknown\",", "unknown", 1, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char b[512];
        snprintf(b, sizeof b, body, cases[i].field);
        struct lookup l = {0};
        struct openai_req r;
        struct kvd_error e = {0};
        if (openai_parse_ctx(OPENAI_CHAT, b, strlen(b), lookup_ctx, &l, &r, &e) != 0)
            fail_msg("refused (%s): %s", e.message, b);
        /* looked up once by the name given, which the request keeps */
        assert_int_equal(l.calls, 1);
        assert_string_equal(l.name, cases[i].name);
        assert_int_equal(r.model_len, strlen(cases[i].name));
        if (r.model_len)
            assert_memory_equal(r.model, cases[i].name, r.model_len);
        /* the named model's context bounds the chat default; its family
         * makes the tools' grammar */
        assert_int_equal(r.args.max_tokens, cases[i].ctx);
        assert_non_null(r.args.compiled);
        assert_true(r.args.tools_compiled);
        assert_int_equal(grammar_takes(r.args.compiled, mistral), cases[i].mistral);
        assert_int_equal(grammar_takes(r.args.compiled, hermes), !cases[i].mistral);
        openai_req_free(&r);
    }
    /* a refusal names its field whatever the model */
    struct lookup l = {0};
    struct openai_req r;
    struct kvd_error e = {0};
    const char *bad = "{\"model\":\"small\",\"messages\":[],\"n\":0}";
    assert_int_not_equal(openai_parse_ctx(OPENAI_CHAT, bad, strlen(bad), lookup_ctx, &l, &r, &e),
                         0);
    assert_true(e.param[0]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_body, teardown),
        cmocka_unit_test_teardown(test_sampler_fields, teardown),
        cmocka_unit_test_teardown(test_prompt, teardown),
        cmocka_unit_test_teardown(test_messages, teardown),
        cmocka_unit_test_teardown(test_max_tokens, teardown),
        cmocka_unit_test_teardown(test_temperature_top_p_seed, teardown),
        cmocka_unit_test_teardown(test_stop, teardown),
        cmocka_unit_test_teardown(test_stream, teardown),
        cmocka_unit_test_teardown(test_unsupported, teardown),
        cmocka_unit_test_teardown(test_response_format, teardown),
        cmocka_unit_test_teardown(test_tools, teardown),
        cmocka_unit_test(test_tools_render),
        cmocka_unit_test_teardown(test_logprobs, teardown),
        cmocka_unit_test(test_logprobs_render),
        cmocka_unit_test(test_status_of),
        cmocka_unit_test(test_model_lookup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

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
    if (openai_parse(kind, body, strlen(body), n_ctx, &g.req, &e) != 0)
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
    if (openai_parse(kind, body, strlen(body), N_CTX, &r, &e) == 0) {
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
    int rc = openai_parse(OPENAI_COMPLETION, big, strlen(big), N_CTX, &r, &e);
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
        cmocka_unit_test_teardown(test_logprobs, teardown),
        cmocka_unit_test(test_logprobs_render),
        cmocka_unit_test(test_status_of),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

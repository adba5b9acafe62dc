/* fuzz_http: libFuzzer target for the HTTP API's JSON side (openai.c),
 * whose input is whatever a client POSTs. The first byte picks what the
 * rest is:
 *   bit 0: /v1/completions (0) or /v1/chat/completions (1);
 *   bits 1-2: the model's context (1, 17, 4096 or 1 << 20 tokens);
 *   bit 3: 0: the rest is a request body for openai_parse; oracles: a
 *      refusal has a status (400, or 503), an OpenAI error type and code, a
 *      message, a param naming a known field (or none), and its error body
 *      is JSON carrying them; an accepted body's typed generate arguments
 *      hold the prompt (tokens, text or messages, as the endpoint reads it)
 *      and every value within the bounds docs/http.md gives (max_tokens in
 *      [1, context], temperature in [0, 2], top_p in (0, 1], at most 4 stop
 *      strings of 1-256 bytes, stream as the body says, n in [1, 128], a
 *      grammar compiled exactly when the body asks for one: `grammar`, or
 *      response_format json_object / json_schema, whose refusals name the
 *      keyword's path under response_format.json_schema.schema);
 *      1: the rest is a completion's text (maybe not UTF-8) rendered by
 *      openai_render as a response and as a stream chunk, and the error
 *      body with it as the message; oracles: each is JSON that jansson
 *      reads back (NUL as \u0000), with the text unchanged when it was
 *      valid UTF-8.
 * Nothing runs but openai.c: no executor, no sockets. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "fuzz_env.h"
#include "kvd/protocol.h"
#include "openai.h"
#include "text_out.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define HTTP_MAX_INPUT (256 << 10)

static const uint32_t contexts[4] = {1, 17, 4096, 1u << 20};

static bool known_param(const char *p)
{
    static const char *const params[] = {"",
                                         "prompt",
                                         "messages",
                                         "max_tokens",
                                         "max_completion_tokens",
                                         "n",
                                         "echo",
                                         "logprobs",
                                         "model",
                                         "temperature",
                                         "top_p",
                                         "seed",
                                         "stop",
                                         "stream",
                                         "stream_options",
                                         "include_usage",
                                         "ignore_eos",
                                         "presence_penalty",
                                         "frequency_penalty",
                                         "repeat_penalty",
                                         "repeat_last_n",
                                         "min_p",
                                         "typical_p",
                                         "logit_bias",
                                         "top_logprobs",
                                         "grammar",
                                         "speculative",
                                         "response_format",
                                         "response_format.type",
                                         "response_format.json_schema",
                                         "response_format.json_schema.name",
                                         "response_format.json_schema.strict"};
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++)
        if (!strcmp(p, params[i]))
            return true;
    /* a JSON Schema keyword's path (cut in the middle when long) */
    return !strncmp(p, "response_format.json_schema.schema", 34);
}

static bool terminated(const char *s, size_t cap)
{
    return memchr(s, '\0', cap) != NULL;
}

static void check_refusal(const struct kvd_error *e)
{
    FUZZ_ASSERT(terminated(e->param, sizeof(e->param)));
    FUZZ_ASSERT(terminated(e->message, sizeof(e->message)) && e->message[0]);
    FUZZ_ASSERT(known_param(e->param));
    struct openai_status st;
    openai_status_of(e, &st);
    FUZZ_ASSERT(st.type && st.type[0] && st.code && st.code[0]);
    if (st.status == 400) /* a bad field, or a feature kvd does not do (naming it) */
        FUZZ_ASSERT(e->code == KVD_EBADREQ || (e->code == KVD_EUNSUPPORTED && e->param[0]));
    else if (st.status == 413) /* a grammar or schema past kvd's bounds, naming it */
        FUZZ_ASSERT(e->code == KVD_ETOOLARGE &&
                    (!strcmp(e->param, "grammar") || !strncmp(e->param, "response_format", 15)));
    else /* out of memory */
        FUZZ_ASSERT(st.status == 503 && e->code == KVD_ENOMEM);
    size_t len = 0;
    int status = 0;
    char *body = openai_error_body(e, &status, &len);
    FUZZ_ASSERT(body); /* invalid UTF-8 in a message is replaced, never a missing body */
    FUZZ_ASSERT(status == st.status);
    FUZZ_ASSERT(strlen(body) == len);
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    FUZZ_ASSERT(j);
    json_t *err = json_object_get(j, "error");
    FUZZ_ASSERT(json_is_object(err));
    FUZZ_ASSERT(!strcmp(json_string_value(json_object_get(err, "code")), st.code));
    FUZZ_ASSERT(json_is_string(json_object_get(err, "message")));
    json_t *param = json_object_get(err, "param");
    if (e->param[0])
        FUZZ_ASSERT(json_is_string(param) && !strcmp(json_string_value(param), e->param));
    else
        FUZZ_ASSERT(json_is_null(param));
    json_decref(j);
    free(body);
}

/* The stream flag the body itself gives (false when absent or not a bool:
 * such a body is refused anyway). */
static bool body_stream(const uint8_t *body, size_t len)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)body, len, JSON_REJECT_DUPLICATES, &je);
    bool s = j && json_is_true(json_object_get(j, "stream"));
    json_decref(j);
    return s;
}

/* Whether the body asks for a grammar: a `grammar` string, or
 * response_format json_object / json_schema. */
static bool body_grammar(const uint8_t *body, size_t len)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)body, len, JSON_REJECT_DUPLICATES, &je);
    const char *t =
        json_string_value(json_object_get(json_object_get(j, "response_format"), "type"));
    bool g = j && (json_is_string(json_object_get(j, "grammar")) ||
                   (t && (!strcmp(t, "json_object") || !strcmp(t, "json_schema"))));
    json_decref(j);
    return g;
}

/* An accepted body's typed arguments: the prompt the endpoint reads, and
 * every value within docs/http.md's bounds. */
static void check_args(enum openai_kind kind, uint32_t n_ctx, const struct openai_req *r,
                       const uint8_t *body, size_t len)
{
    const struct gen_args *a = &r->args;
    FUZZ_ASSERT(r->kind == kind);
    if (kind == OPENAI_COMPLETION) {
        FUZZ_ASSERT(!strcmp(a->prompt_param, "prompt"));
        FUZZ_ASSERT(a->prompt == GEN_PROMPT_TOKENS || a->prompt == GEN_PROMPT_TEXT);
        if (a->prompt == GEN_PROMPT_TOKENS)
            FUZZ_ASSERT(a->n_tokens >= 1 && a->n_tokens <= KVD_MAX_ARRAY && a->tokens);
        else
            FUZZ_ASSERT(a->text && strlen(a->text) == a->text_len); /* jansson: no NUL */
    } else {
        FUZZ_ASSERT(!strcmp(a->prompt_param, "messages"));
        FUZZ_ASSERT(a->prompt == GEN_PROMPT_MESSAGES);
        FUZZ_ASSERT(a->n_msgs >= 1 && a->n_msgs <= KVD_MAX_ARRAY && a->msgs);
        for (size_t i = 0; i < a->n_msgs; i++)
            FUZZ_ASSERT(a->msgs[i].role && a->msgs[i].content);
    }
    FUZZ_ASSERT(a->has_max_tokens && a->max_tokens >= 1 && a->max_tokens <= n_ctx);
    FUZZ_ASSERT(isfinite(a->temperature) && a->temperature >= 0 && a->temperature <= 2);
    FUZZ_ASSERT(isfinite(a->top_p) && a->top_p > 0 && a->top_p <= 1);
    FUZZ_ASSERT(a->top_k == 0 && a->n_stop_ids == 0 && !a->has_seq && a->priority == 0);
    FUZZ_ASSERT(a->n_stop_strs <= OPENAI_MAX_STOP);
    for (size_t i = 0; i < a->n_stop_strs; i++)
        FUZZ_ASSERT(a->stop_lens[i] >= 1 && a->stop_lens[i] <= TEXT_OUT_MAX_STOP_LEN);
    FUZZ_ASSERT(a->stream == r->stream);
    FUZZ_ASSERT(r->stream == body_stream(body, len));
    FUZZ_ASSERT(a->n >= 1 && a->n <= GEN_MAX_CHOICES);
    /* a grammar is compiled while parsing (the sources are consumed) */
    FUZZ_ASSERT((a->compiled != NULL) == body_grammar(body, len));
    FUZZ_ASSERT(!a->grammar && !a->json_schema && !a->json_object);
}

static void as_body(enum openai_kind kind, uint32_t n_ctx, const uint8_t *body, size_t len)
{
    struct openai_req r;
    struct kvd_error e;
    memset(&e, 0, sizeof(e));
    if (openai_parse(kind, (const char *)body, len, n_ctx, &r, &e) != 0) {
        check_refusal(&e);
        return;
    }
    check_args(kind, n_ctx, &r, body, len);
    openai_req_free(&r);
}

/* One rendering of text: JSON that reads back (NUL is valid JSON, as
 * \u0000), with the text unchanged when it was valid UTF-8 (jansson's own
 * test). */
static void check_render(const char *json, size_t len, bool chunk, enum openai_kind kind,
                         const char *text, size_t text_len)
{
    FUZZ_ASSERT(json && strlen(json) == len);
    json_error_t je;
    json_t *j = json_loadb(json, len, JSON_ALLOW_NUL, &je);
    FUZZ_ASSERT(j);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    FUZZ_ASSERT(json_is_object(c));
    json_t *holder = kind == OPENAI_CHAT ? json_object_get(c, chunk ? "delta" : "message") : c;
    json_t *t = json_object_get(holder, kind == OPENAI_CHAT ? "content" : "text");
    FUZZ_ASSERT(json_is_string(t));
    json_t *probe = json_stringn(text, text_len);
    if (probe) { /* valid UTF-8: kept as it is */
        FUZZ_ASSERT(json_string_length(t) == text_len);
        FUZZ_ASSERT(!memcmp(json_string_value(t), text, text_len));
        json_decref(probe);
    }
    json_decref(j);
}

static void as_text(enum openai_kind kind, const uint8_t *text, size_t len)
{
    uint32_t toks[3] = {0, 7, UINT32_MAX};
    struct openai_out o = {
        .kind = kind,
        .id = "cmpl-fuzz",
        .model = "kvd-fuzz",
        .created = 1,
        .text = (const char *)text,
        .text_len = len,
        .toks = toks,
        .n_toks = 3,
        .finish = "stop",
        .role = true,
        .usage = true,
        .prompt_tokens = 5,
        .cached_tokens = 2,
        .completion_tokens = 3,
    };
    for (int chunk = 0; chunk < 2; chunk++) {
        size_t n = 0;
        char *json = openai_render(&o, chunk, &n);
        if (!json)
            continue; /* out of memory */
        check_render(json, n, chunk, kind, (const char *)text, len);
        free(json);
    }
    /* n > 1: every choice with its index */
    struct openai_out ch[2] = {o, o};
    ch[1].index = 1;
    struct openai_out multi = o;
    multi.choices = ch;
    multi.n_choices = 2;
    size_t mn = 0;
    char *mj = openai_render(&multi, false, &mn);
    if (mj) {
        json_error_t je;
        json_t *j = json_loadb(mj, mn, JSON_ALLOW_NUL, &je);
        FUZZ_ASSERT(j);
        json_t *cs = json_object_get(j, "choices");
        FUZZ_ASSERT(json_array_size(cs) == 2);
        for (size_t i = 0; i < 2; i++)
            FUZZ_ASSERT(json_integer_value(json_object_get(json_array_get(cs, i), "index")) ==
                        (json_int_t)i);
        json_decref(j);
        free(mj);
    }
    /* A message of the same bytes in an error body (kvd_error_set copies
     * at most its buffer). */
    struct kvd_error e;
    kvd_error_set(&e, KVD_EBADREQ, "%.*s", (int)(len < 200 ? len : 200), (const char *)text);
    size_t n = 0;
    int status = 0;
    char *body = openai_error_body(&e, &status, &n);
    /* a message cut inside a UTF-8 character or holding invalid bytes still
     * makes a body (those bytes replaced) */
    FUZZ_ASSERT(body);
    json_error_t je;
    json_t *j = json_loadb(body, n, JSON_ALLOW_NUL, &je);
    FUZZ_ASSERT(j);
    json_decref(j);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > HTTP_MAX_INPUT)
        return 0;
    enum openai_kind kind = data[0] & 1 ? OPENAI_CHAT : OPENAI_COMPLETION;
    uint32_t n_ctx = contexts[(data[0] >> 1) & 3];
    if (data[0] & 8)
        as_text(kind, data + 1, size - 1);
    else
        as_body(kind, n_ctx, data + 1, size - 1);
    return 0;
}

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
 *      keyword's path under response_format.json_schema.schema; tools in
 *      their common form, a named tool_choice among them, the tools'
 *      grammar compiled when required or named, refusals naming tools,
 *      tool_choice, parallel_tool_calls or a parameters keyword's path);
 *   bits 4-5: the model's tool-call family (generic, Hermes, Llama 3.x,
 *      Mistral);
 *   bit 6: the body goes through openai_parse_ctx, the model looked up by
 *      the name it gives (a model "unknown" has no context: max_tokens is
 *      bounded by 1 until the request is refused by name); oracles: the
 *      lookup runs once, with the body's `model` when it is a string, which
 *      the request keeps;
 *      1: the rest is a completion's text (maybe not UTF-8) rendered by
 *      openai_render as a response and as a stream chunk (and as a tool
 *      call's name and arguments), and the error body with it as the
 *      message; oracles: each is JSON that jansson
 *      reads back (NUL as \u0000), with the text unchanged when it was
 *      valid UTF-8.
 * Nothing runs but openai.c and openai_render.c (and the text layer's
 * grammars): no executor, no sockets. */
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
                                         "response_format.json_schema.strict",
                                         "tools",
                                         "tool_choice",
                                         "parallel_tool_calls"};
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++)
        if (!strcmp(p, params[i]))
            return true;
    /* a JSON Schema keyword's path (cut in the middle when long), of
     * response_format or of a tool's parameters */
    return !strncmp(p, "response_format.json_schema.schema", 34) || !strncmp(p, "tools[", 6);
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
                    (!strcmp(e->param, "grammar") || !strncmp(e->param, "response_format", 15) ||
                     !strncmp(e->param, "tools", 5)));
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

/* The tools' fields of an accepted chat body: tools in the common form
 * (valid names, once each), a named choice among them, the conversation
 * as JSON with them, and the tools' grammar compiled exactly when they
 * ask for one (required or named always; auto when the schemas allow). */
static void check_tools(enum openai_kind kind, const struct gen_args *a)
{
    if (kind == OPENAI_COMPLETION) {
        FUZZ_ASSERT(!a->tools && !a->chat_json && !a->tools_compiled);
        return;
    }
    size_t n = json_array_size(a->tools);
    FUZZ_ASSERT(!a->tools || (n >= 1 && n <= TOOL_MAX_TOOLS));
    bool named = false;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(a->tools, i), *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        FUZZ_ASSERT(!strcmp(json_string_value(json_object_get(t, "type")), "function"));
        FUZZ_ASSERT(name && name[0] && strlen(name) <= TOOL_MAX_NAME);
        FUZZ_ASSERT(
            strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") ==
            strlen(name));
        for (size_t k = 0; k < i; k++)
            FUZZ_ASSERT(strcmp(
                name, json_string_value(json_object_get(
                          json_object_get(json_array_get(a->tools, k), "function"), "name"))));
        named |= a->tool_choice == TOOL_CHOICE_NAMED && !strcmp(name, a->tool_name);
    }
    if (a->tool_choice == TOOL_CHOICE_REQUIRED || a->tool_choice == TOOL_CHOICE_NAMED)
        FUZZ_ASSERT(a->tools && a->compiled && a->tools_compiled);
    if (a->tool_choice == TOOL_CHOICE_NAMED)
        FUZZ_ASSERT(named);
    if (a->tools)
        FUZZ_ASSERT(a->chat_json && json_array_size(a->chat_json) == a->n_msgs);
    FUZZ_ASSERT(a->tools_compiled == (a->tools && a->tool_choice != TOOL_CHOICE_NONE));
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
    /* a grammar is compiled while parsing (the sources are consumed): the
     * body's own, or the tools' */
    check_tools(kind, a);
    FUZZ_ASSERT(a->tools_compiled ? !body_grammar(body, len)
                                  : (a->compiled != NULL) == body_grammar(body, len));
    FUZZ_ASSERT(!a->grammar && !a->json_schema && !a->json_object);
}

/* The model lookup of openai_parse_ctx, as the daemon's with several
 * models: the context and family of the model a body names, 0 for a name
 * no model has ("unknown": refused later by name); what it was asked. */
struct lookup {
    uint32_t n_ctx;
    enum tool_family family;
    int calls;
    const char *model;
    size_t model_len;
};

static uint32_t lookup_ctx(void *ud, const char *model, size_t len, enum tool_family *family)
{
    struct lookup *l = ud;
    l->calls++;
    l->model = model;
    l->model_len = len;
    *family = l->family;
    return model && len == 7 && !memcmp(model, "unknown", 7) ? 0 : l->n_ctx;
}

/* The body's `model`: 0 absent or null, 1 a string (its first cap bytes
 * copied, *out_len its length), 2 another type. */
static int body_model(const uint8_t *body, size_t len, char *out, size_t cap, size_t *out_len)
{
    json_error_t je;
    json_t *j = json_loadb((const char *)body, len, JSON_REJECT_DUPLICATES, &je);
    json_t *m = json_object_get(j, "model");
    int kind = !m || json_is_null(m) ? 0 : json_is_string(m) ? 1 : 2;
    if (kind == 1) {
        *out_len = json_string_length(m);
        memcpy(out, json_string_value(m), *out_len < cap ? *out_len : cap);
    }
    json_decref(j);
    return kind;
}

static void as_body(enum openai_kind kind, uint32_t n_ctx, enum tool_family fam, bool by_model,
                    const uint8_t *body, size_t len)
{
    struct openai_req r;
    struct kvd_error e;
    struct lookup l = {.n_ctx = n_ctx, .family = fam};
    memset(&e, 0, sizeof(e));
    int rc = by_model ? openai_parse_ctx(kind, (const char *)body, len, lookup_ctx, &l, &r, &e)
                      : openai_parse(kind, (const char *)body, len, n_ctx, fam, &r, &e);
    if (rc != 0) {
        check_refusal(&e);
        return;
    }
    /* the model named (a string of at most OPENAI_MAX_MODEL bytes, else
     * refused): looked up once, kept in the request (in its body) */
    char name[OPENAI_MAX_MODEL + 1];
    size_t name_len = 0;
    int named = body_model(body, len, name, sizeof name, &name_len);
    FUZZ_ASSERT(named != 2);
    FUZZ_ASSERT(!by_model || (l.calls == 1 && l.model == r.model && l.model_len == r.model_len));
    if (named == 1)
        FUZZ_ASSERT(r.model && r.model_len == name_len && name_len <= OPENAI_MAX_MODEL &&
                    !memcmp(r.model, name, name_len));
    else
        FUZZ_ASSERT(!r.model && r.model_len == 0);
    /* an unknown model's context is 1 until it is refused by name */
    uint32_t ctx =
        by_model && r.model && r.model_len == 7 && !memcmp(r.model, "unknown", 7) ? 1 : n_ctx;
    check_args(kind, ctx, &r, body, len);
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
    /* tool calls whose name and arguments are those bytes: a response's
     * message.tool_calls and a chunk's delta.tool_calls */
    if (kind == OPENAI_CHAT) {
        char *t = malloc(len + 1);
        if (t) {
            memcpy(t, text, len);
            t[len] = 0;
            struct tool_call_out call = {
                .id = "call_x", .name = t, .args = t, .args_len = len, .args_done = true};
            struct tool_delta d = {
                .index = 0, .id = "call_x", .name = t, .args = t, .args_len = len};
            struct openai_out tc = o;
            tc.calls = &call;
            tc.n_calls = 1;
            for (int chunk = 0; chunk < 2; chunk++) {
                if (chunk) {
                    tc.calls = NULL;
                    tc.n_calls = 0;
                    tc.deltas = &d;
                    tc.n_deltas = 1;
                }
                size_t n = 0;
                char *json = openai_render(&tc, chunk, &n);
                if (!json)
                    continue;
                json_t *j = json_loadb(json, n, JSON_ALLOW_NUL, NULL);
                FUZZ_ASSERT(j);
                json_t *c = json_array_get(json_object_get(j, "choices"), 0);
                json_t *calls =
                    json_object_get(json_object_get(c, chunk ? "delta" : "message"), "tool_calls");
                FUZZ_ASSERT(json_array_size(calls) == 1);
                json_t *args = json_object_get(
                    json_object_get(json_array_get(calls, 0), "function"), "arguments");
                FUZZ_ASSERT(json_is_string(args));
                json_t *probe = json_stringn((const char *)text, len);
                if (probe) { /* valid UTF-8: kept as it is */
                    FUZZ_ASSERT(json_string_length(args) == len &&
                                !memcmp(json_string_value(args), text, len));
                    json_decref(probe);
                }
                json_decref(j);
                free(json);
            }
            free(t);
        }
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
        as_body(kind, n_ctx, (enum tool_family)((data[0] >> 4) & 3), data[0] & 64, data + 1,
                size - 1);
    return 0;
}

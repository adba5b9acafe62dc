/* openai: OpenAI request bodies into generate arguments, results into
 * OpenAI JSON (see openai.h). Parsing is strict about what it reads
 * (jansson rejects invalid UTF-8, NUL in strings, duplicate keys here,
 * trailing bytes) and ignores fields it does not know. */
#include "openai.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "grammar.h"
#include "json_schema.h"
#include "kvd/protocol.h"
#include "kvd/status.h"
#include "text_out.h"

#define OPENAI_DEFAULT_MAX_TOKENS 16 /* completions, as OpenAI's reference */

/* ---- errors: the HTTP edge ------------------------------------------------ */

void openai_status_of(const struct kvd_error *e, struct openai_status *st)
{
    static const struct {
        int code, status;
        const char *type;
    } map[] = {
        {KVD_EBADREQ, 400, "invalid_request_error"},
        {KVD_EUNKNOWN_OP, 404, "invalid_request_error"},
        {KVD_ETOOLARGE, 413, "invalid_request_error"},
        {KVD_ENOTFOUND, 404, "invalid_request_error"},
        {KVD_ENOMEM, 503, "server_error"},
        {KVD_EQUOTA, 429, "rate_limit_error"},
        {KVD_EPERM, 403, "permission_error"},
        {KVD_EBUSY, 429, "rate_limit_error"},
        {KVD_ECANCELLED, 503, "server_error"},
        {KVD_EUNSUPPORTED, 501, "invalid_request_error"},
        {KVD_EINTERNAL, 500, "server_error"},
    };
    st->status = 500;
    st->type = "server_error";
    st->code = kvd_err_code(e->code);
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (map[i].code == e->code) {
            st->status = map[i].status;
            st->type = map[i].type;
        }
    /* A request parameter kvd does not do is the request's fault (400); a
     * model that cannot do what is asked (no tokenizer, no template) is
     * the server's (501). */
    if (e->code == KVD_EUNSUPPORTED && e->param[0])
        st->status = 400;
}

static json_t *text_value(const char *s, size_t n);

char *openai_error_json(const struct openai_status *st, const char *param, const char *message,
                        size_t *len)
{
    /* The message may quote a client's bytes (jansson's error text) or be
     * cut inside a character: invalid UTF-8 there is replaced, so a
     * refusal always has its body. */
    const char *m = message && message[0] ? message : st->code;
    json_t *err = json_pack(
        "{s:o, s:s, s:o, s:s}", "message", text_value(m, strlen(m)), "type", st->type, "param",
        param && param[0] ? text_value(param, strlen(param)) : json_null(), "code", st->code);
    json_t *root = err ? json_pack("{s:o}", "error", err) : NULL;
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (s)
        *len = strlen(s);
    return s;
}

char *openai_error_body(const struct kvd_error *e, int *status, size_t *len)
{
    struct openai_status st;
    openai_status_of(e, &st);
    *status = st.status;
    return openai_error_json(&st, e->param, e->message, len);
}

/* ---- requests ------------------------------------------------------------- */

/* A 400 about parameter `param`. */
__attribute__((format(printf, 3, 4))) static int bad(struct kvd_error *e, const char *param,
                                                     const char *fmt, ...)
{
    va_list ap;
    e->code = KVD_EBADREQ;
    snprintf(e->param, sizeof(e->param), "%s", param);
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return -1;
}

/* Something kvd does not do (yet), asked by parameter `param`. */
static int unsupported(struct kvd_error *e, const char *param, const char *what)
{
    bad(e, param, "not supported: %s", what);
    e->code = KVD_EUNSUPPORTED;
    return -1;
}

static int no_memory(struct kvd_error *e)
{
    kvd_error_set(e, KVD_ENOMEM, "out of memory");
    return -1;
}

/* An integer field in [lo, hi]: 0 absent or null, 1 read, -1 with e
 * filled. */
static int get_int(json_t *o, const char *key, long long lo, long long hi, long long *v,
                   struct kvd_error *e)
{
    json_t *x = json_object_get(o, key);
    if (!x || json_is_null(x))
        return 0;
    if (!json_is_integer(x))
        return bad(e, key, "'%s' must be an integer", key);
    *v = json_integer_value(x);
    if (*v < lo || *v > hi)
        return bad(e, key, "'%s' must be in [%lld, %lld]", key, lo, hi);
    return 1;
}

static int get_num(json_t *o, const char *key, double lo, double hi, double *v, struct kvd_error *e)
{
    json_t *x = json_object_get(o, key);
    if (!x || json_is_null(x))
        return 0;
    if (!json_is_number(x))
        return bad(e, key, "'%s' must be a number", key);
    *v = json_number_value(x);
    if (!isfinite(*v) || *v < lo || *v > hi)
        return bad(e, key, "'%s' must be in [%g, %g]", key, lo, hi);
    return 1;
}

static int get_bool(json_t *o, const char *key, bool *v, struct kvd_error *e)
{
    json_t *x = json_object_get(o, key);
    if (!x || json_is_null(x))
        return 0;
    if (!json_is_boolean(x))
        return bad(e, key, "'%s' must be true or false", key);
    *v = json_is_true(x);
    return 1;
}

/* A token id array (json array of integers) as the prompt. */
static int get_tokens(struct openai_req *r, json_t *arr, struct kvd_error *e)
{
    size_t n = json_array_size(arr);
    if (n > KVD_MAX_ARRAY)
        return bad(e, "prompt", "'prompt' has %zu tokens, at most %u", n, KVD_MAX_ARRAY);
    if (n && !(r->tokens = malloc(n * sizeof(uint32_t))))
        return no_memory(e);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(arr, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 ||
            json_integer_value(t) > (json_int_t)UINT32_MAX)
            return bad(e, "prompt", "'prompt'[%zu] must be a token id (an integer in [0, %u])", i,
                       UINT32_MAX);
        r->tokens[i] = (uint32_t)json_integer_value(t);
    }
    r->args.prompt = GEN_PROMPT_TOKENS;
    r->args.tokens = r->tokens;
    r->args.n_tokens = n;
    return 0;
}

static void set_text(struct openai_req *r, json_t *s)
{
    r->args.prompt = GEN_PROMPT_TEXT;
    r->args.text = json_string_value(s);
    r->args.text_len = json_string_length(s);
}

/* `prompt`: a string, one string in an array, token ids, or one array of
 * token ids. */
static int get_prompt(struct openai_req *r, json_t *p, struct kvd_error *e)
{
    r->args.prompt_param = "prompt";
    if (!p || json_is_null(p))
        return bad(e, "prompt", "'prompt' is required");
    if (json_is_string(p)) {
        set_text(r, p);
        return 0;
    }
    if (!json_is_array(p))
        return bad(e, "prompt",
                   "'prompt' must be a string, an array of token ids, or an "
                   "array of one of those");
    json_t *first = json_array_get(p, 0);
    if (first && (json_is_string(first) || json_is_array(first))) {
        if (json_array_size(p) != 1)
            return unsupported(e, "prompt", "several prompts in one request (send one each)");
        if (json_is_string(first)) {
            set_text(r, first);
            return 0;
        }
        p = first;
    }
    if (json_array_size(p) == 0)
        return bad(e, "prompt", "'prompt' is empty: it needs at least one token");
    return get_tokens(r, p, e);
}

/* A message's content: a string, null (""), or text parts concatenated.
 * *len: its length; with out, the parts are copied there. */
static int content_of(json_t *c, size_t i, char *out, size_t *len, struct kvd_error *e)
{
    *len = 0;
    if (!c || json_is_null(c))
        return 0;
    if (json_is_string(c)) {
        *len = json_string_length(c);
        if (out)
            memcpy(out, json_string_value(c), *len);
        return 0;
    }
    if (!json_is_array(c))
        return bad(e, "messages",
                   "'messages'[%zu].content must be a string or an array of "
                   "text parts",
                   i);
    size_t n = json_array_size(c);
    for (size_t k = 0; k < n; k++) {
        json_t *part = json_array_get(c, k);
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type))
            return bad(e, "messages", "'messages'[%zu].content[%zu] must be a {type, ...} part", i,
                       k);
        if (strcmp(json_string_value(type), "text"))
            return unsupported(e, "messages", "message parts other than text");
        if (!json_is_string(text))
            return bad(e, "messages", "'messages'[%zu].content[%zu].text must be a string", i, k);
        if (out)
            memcpy(out + *len, json_string_value(text), json_string_length(text));
        *len += json_string_length(text);
    }
    return 0;
}

/* `messages`: [{role, content}] into r->msgs (one allocation: the array,
 * then each content NUL-terminated; roles point into the JSON). */
static int get_messages(struct openai_req *r, json_t *m, struct kvd_error *e)
{
    r->args.prompt_param = "messages";
    if (!m || json_is_null(m))
        return bad(e, "messages", "'messages' is required");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return bad(e, "messages", "'messages' must be a non-empty array of {role, content}");
    size_t n = json_array_size(m);
    if (n > KVD_MAX_ARRAY)
        return bad(e, "messages", "'messages' has %zu entries, at most %u", n, KVD_MAX_ARRAY);
    size_t bytes = n * sizeof(struct chat_msg), len;
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        if (!json_is_object(msg) || !json_is_string(json_object_get(msg, "role")))
            return bad(e, "messages", "'messages'[%zu] must be an object with a string 'role'", i);
        if (content_of(json_object_get(msg, "content"), i, NULL, &len, e))
            return -1;
        bytes += len + 1;
    }
    if (!(r->msgs = malloc(bytes)))
        return no_memory(e);
    char *at = (char *)(r->msgs + n);
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        content_of(json_object_get(msg, "content"), i, at, &len, e);
        at[len] = '\0';
        r->msgs[i].role = json_string_value(json_object_get(msg, "role"));
        r->msgs[i].content = at;
        at += len + 1;
    }
    r->args.prompt = GEN_PROMPT_MESSAGES;
    r->args.msgs = r->msgs;
    r->args.n_msgs = n;
    return 0;
}

/* A stop string's length: 1 to TEXT_OUT_MAX_STOP_LEN bytes (generate's own
 * bound), in both of stop's forms. */
static int stop_len_ok(json_t *x, bool in_array, size_t i, struct kvd_error *e)
{
    size_t n = json_string_length(x);
    if (n > 0 && n <= TEXT_OUT_MAX_STOP_LEN)
        return 0;
    if (in_array)
        return bad(e, "stop", "'stop'[%zu] must have 1 to %u bytes", i, TEXT_OUT_MAX_STOP_LEN);
    return bad(e, "stop", "'stop' must have 1 to %u bytes", TEXT_OUT_MAX_STOP_LEN);
}

static void add_stop(struct gen_args *a, json_t *x)
{
    a->stop_strs[a->n_stop_strs] = json_string_value(x);
    a->stop_lens[a->n_stop_strs++] = json_string_length(x);
}

/* `stop`: null, a string, or an array of at most 4 strings. */
static int get_stop(struct gen_args *a, json_t *s, struct kvd_error *e)
{
    if (!s || json_is_null(s))
        return 0;
    if (json_is_string(s)) {
        if (stop_len_ok(s, false, 0, e))
            return -1;
        add_stop(a, s);
        return 0;
    }
    if (!json_is_array(s))
        return bad(e, "stop", "'stop' must be a string or an array of strings");
    size_t n = json_array_size(s);
    if (n > OPENAI_MAX_STOP)
        return bad(e, "stop", "'stop' has %zu strings, at most %d", n, OPENAI_MAX_STOP);
    for (size_t i = 0; i < n; i++) {
        if (!json_is_string(json_array_get(s, i)))
            return bad(e, "stop", "'stop'[%zu] must be a string", i);
        if (stop_len_ok(json_array_get(s, i), true, i, e))
            return -1;
    }
    for (size_t i = 0; i < n; i++)
        add_stop(a, json_array_get(s, i));
    return 0;
}

/* The fields kvd does not do: refused when they ask for something other
 * than the default. */
static int check_unsupported(json_t *o, struct kvd_error *e)
{
    bool echo = false;
    if (get_bool(o, "echo", &echo, e) < 0)
        return -1;
    if (echo)
        return unsupported(e, "echo", "echo");
    json_t *model = json_object_get(o, "model");
    if (model && !json_is_null(model) &&
        (!json_is_string(model) || json_string_length(model) > OPENAI_MAX_MODEL))
        return bad(e, "model", "'model' must be a string of at most %d bytes", OPENAI_MAX_MODEL);
    return 0;
}

/* logprobs: chat's `logprobs` (true/false) with `top_logprobs` (0-20,
 * only with logprobs true); completions' `logprobs` (null, or 0-20 top
 * alternatives per token); top_logprobs 0 is accepted without logprobs. */
static int get_logprobs(struct openai_req *out, json_t *o, struct kvd_error *e)
{
    struct gen_args *a = &out->args;
    long long top = 0;
    if (out->kind == OPENAI_COMPLETION) {
        int r = get_int(o, "logprobs", 0, SAMPLER_MAX_TOP_LOGPROBS, &top, e);
        if (r < 0)
            return -1;
        a->logprobs = r > 0;
        a->top_logprobs = (uint64_t)top;
        a->top_logprobs_param = "logprobs";
        return 0;
    }
    if (get_bool(o, "logprobs", &a->logprobs, e) < 0)
        return -1;
    int r = get_int(o, "top_logprobs", 0, SAMPLER_MAX_TOP_LOGPROBS, &top, e);
    if (r < 0)
        return -1;
    if (r > 0 && top > 0 && !a->logprobs)
        return bad(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    a->top_logprobs = (uint64_t)top;
    a->top_logprobs_param = "top_logprobs";
    return 0;
}

/* OpenAI's logit_bias: {"token id": bias}, bias in [-100, 100]. */
static int get_logit_bias(struct openai_req *out, json_t *o, struct kvd_error *e)
{
    json_t *lb = json_object_get(o, "logit_bias");
    if (!lb || json_is_null(lb))
        return 0;
    if (!json_is_object(lb))
        return bad(e, "logit_bias", "'logit_bias' must be an object of token ids to biases");
    size_t n = json_object_size(lb);
    if (n && !(out->bias = malloc(n * sizeof *out->bias)))
        return no_memory(e);
    const char *k;
    json_t *v;
    size_t i = 0;
    json_object_foreach(lb, k, v)
    {
        char *end;
        errno = 0;
        unsigned long long id = strtoull(k, &end, 10);
        if (!*k || *end || *k < '0' || *k > '9' || errno || id > UINT32_MAX)
            return bad(e, "logit_bias", "'logit_bias': key '%.40s' is not a token id", k);
        if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < -100 ||
            json_number_value(v) > 100)
            return bad(e, "logit_bias",
                       "'logit_bias': the bias of token %llu must be in [-100, 100]", id);
        out->bias[i++] =
            (struct logit_bias){.id = (uint32_t)id, .bias = (float)json_number_value(v)};
    }
    out->args.logit_bias = out->bias;
    out->args.n_logit_bias = n;
    return 0;
}

/* OpenAI's response_format: {"type": "text"}, {"type": "json_object"}
 * (any object) or {"type": "json_schema", "json_schema": {"name",
 * "schema", "strict", "description"}} (schema absent: any JSON value). */
static int get_response_format(struct openai_req *out, json_t *o, struct kvd_error *e)
{
    struct gen_args *a = &out->args;
    json_t *rf = json_object_get(o, "response_format");
    if (!rf || json_is_null(rf))
        return 0;
    json_t *t = json_object_get(rf, "type");
    if (!json_is_object(rf) || !json_is_string(t))
        return bad(e, "response_format", "'response_format' must be an object with a 'type'");
    const char *type = json_string_value(t);
    if (!strcmp(type, "text"))
        return 0;
    if (a->grammar)
        return bad(e, "response_format", "give 'grammar' or 'response_format', not both");
    if (!strcmp(type, "json_object")) {
        a->json_object = true;
        return 0;
    }
    if (strcmp(type, "json_schema"))
        return bad(e, "response_format.type",
                   "'response_format.type' must be text, json_object or json_schema");
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return bad(e, "response_format.json_schema",
                   "'response_format.json_schema' must be an object {name, schema, strict}");
    json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    if (name && !json_is_null(name) &&
        (!json_is_string(name) || json_string_length(name) == 0 || json_string_length(name) > 64))
        return bad(e, "response_format.json_schema.name",
                   "'response_format.json_schema.name' must be a string of 1 to 64 bytes");
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return bad(e, "response_format.json_schema.strict",
                   "'response_format.json_schema.strict' must be true or false");
    json_t *schema = json_object_get(js, "schema");
    a->json_schema = schema && !json_is_null(schema) ? schema : json_true();
    a->json_schema_param = "response_format.json_schema.schema";
    return 0;
}

/* The sampling and output fields. */
static int get_options(struct openai_req *out, json_t *o, uint32_t n_ctx, struct kvd_error *e)
{
    struct gen_args *a = &out->args;
    if (get_bool(o, "stream", &a->stream, e) < 0)
        return -1;
    out->stream = a->stream;
    /* An extension (llama.cpp's and vLLM's servers have it too). */
    if (get_bool(o, "ignore_eos", &a->ignore_eos, e) < 0)
        return -1;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return bad(e, "stream_options", "'stream_options' must be an object");
        bool iu = false;
        if (get_bool(so, "include_usage", &iu, e) < 0)
            return -1;
        out->include_usage = iu;
    }
    /* Defaults: the context (chat), 16 (completions) but never past the
     * context. */
    long long max_tokens = out->kind == OPENAI_CHAT || n_ctx < OPENAI_DEFAULT_MAX_TOKENS
                               ? (long long)n_ctx
                               : OPENAI_DEFAULT_MAX_TOKENS;
    if (get_int(o, "max_tokens", 1, n_ctx, &max_tokens, e) < 0)
        return -1;
    if (out->kind == OPENAI_CHAT &&
        get_int(o, "max_completion_tokens", 1, n_ctx, &max_tokens, e) < 0)
        return -1;
    a->has_max_tokens = true;
    a->max_tokens = (uint64_t)max_tokens;
    a->temperature = 1.0; /* OpenAI's default */
    if (get_num(o, "temperature", 0, 2, &a->temperature, e) < 0)
        return -1;
    int has_top_p = get_num(o, "top_p", 0, 1, &a->top_p, e);
    if (has_top_p < 0)
        return -1;
    if (has_top_p && a->top_p == 0)
        a->top_p = 1e-9; /* OpenAI's 0 means "only the most likely": kvd's top_p is in (0, 1] */
    long long seed = 0;
    int has_seed = get_int(o, "seed", INT64_MIN, INT64_MAX, &seed, e);
    if (has_seed < 0)
        return -1;
    a->has_seed = has_seed > 0;
    a->seed = (uint64_t)seed;
    long long last_n = a->repeat_last_n;
    if (get_num(o, "presence_penalty", -2, 2, &a->presence_penalty, e) < 0 ||
        get_num(o, "frequency_penalty", -2, 2, &a->frequency_penalty, e) < 0 ||
        get_num(o, "repeat_penalty", 0, GEN_MAX_PENALTY, &a->repeat_penalty, e) < 0 ||
        get_int(o, "repeat_last_n", -1, n_ctx, &last_n, e) < 0 ||
        get_num(o, "min_p", 0, 1, &a->min_p, e) < 0 ||
        get_num(o, "typical_p", 0, 1, &a->typical_p, e) < 0 || get_logit_bias(out, o, e) < 0 ||
        get_logprobs(out, o, e) < 0)
        return -1;
    a->repeat_last_n = last_n;
    long long n = 1;
    if (get_int(o, "n", 1, GEN_MAX_CHOICES, &n, e) < 0)
        return -1;
    a->n = (uint64_t)n;
    /* llama.cpp's server extension: a GBNF grammar the output follows. */
    json_t *g = json_object_get(o, "grammar");
    if (g && !json_is_null(g)) {
        if (!json_is_string(g))
            return bad(e, "grammar", "'grammar' must be a string (GBNF)");
        a->grammar = json_string_value(g);
        a->grammar_len = json_string_length(g);
    }
    /* kvd's extension: speculative decoding for this request ("ngram",
     * "draft", "off"; absent: the daemon's choice). */
    json_t *sp = json_object_get(o, "speculative");
    if (sp && !json_is_null(sp)) {
        if (!json_is_string(sp))
            return bad(e, "speculative",
                       "'speculative' must be a string: \"ngram\", \"draft\" or "
                       "\"off\"");
        a->speculative = json_string_value(sp);
        a->speculative_len = json_string_length(sp);
    }
    if (get_response_format(out, o, e) < 0)
        return -1;
    return get_stop(a, json_object_get(o, "stop"), e);
}

/* The grammar the completion follows, compiled here: the parse runs on a
 * text worker, and its errors are the request's 400. */
static int compile_constraint(struct gen_args *a, struct kvd_error *e)
{
    int rc = 0;
    if (a->grammar)
        rc = grammar_compile(a->grammar, a->grammar_len, &a->compiled, e);
    else if (a->json_object)
        rc = json_object_grammar(&a->compiled, e);
    else if (a->json_schema)
        rc = json_schema_grammar(a->json_schema, a->json_schema_param, &a->compiled, e);
    else
        return 0;
    if (rc) {
        if (!e->param[0])
            snprintf(e->param, sizeof e->param, "%s",
                     a->grammar       ? "grammar"
                     : a->json_object ? "response_format"
                                      : "response_format.json_schema.schema");
        return -1;
    }
    /* the build sees the compiled grammar only; its errors (a model with
     * no tokenizer) name the field it came from */
    a->json_schema_param = a->grammar       ? "grammar"
                           : a->json_object ? "response_format"
                                            : "response_format.json_schema.schema";
    a->grammar = NULL;
    a->json_object = false;
    a->json_schema = NULL;
    return 0;
}

static uint32_t fixed_ctx(void *ud, const char *model, size_t len)
{
    (void)model, (void)len;
    return *(const uint32_t *)ud;
}

int openai_parse(enum openai_kind kind, const char *body, size_t len, uint32_t n_ctx,
                 struct openai_req *out, struct kvd_error *e)
{
    return openai_parse_ctx(kind, body, len, fixed_ctx, &n_ctx, out, e);
}

int openai_parse_ctx(enum openai_kind kind, const char *body, size_t len,
                     uint32_t (*ctx_of)(void *ud, const char *model, size_t len), void *ud,
                     struct openai_req *out, struct kvd_error *e)
{
    json_error_t je;
    uint32_t n_ctx;
    memset(out, 0, sizeof(*out));
    out->kind = kind;
    gen_args_init(&out->args);
    out->root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!out->root)
        return bad(e, "", "the body is not valid JSON: %s (at byte %d)", je.text, je.position);
    json_t *o = out->root;
    int rc = -1;
    if (!json_is_object(o)) {
        bad(e, "", "the body must be a JSON object");
    } else if (!check_unsupported(o, e)) {
        json_t *m = json_object_get(o, "model");
        if (json_is_string(m)) {
            out->model = json_string_value(m);
            out->model_len = json_string_length(m);
        }
        n_ctx = ctx_of(ud, out->model, out->model_len);
        if (!get_options(out, o, n_ctx ? n_ctx : 1, e))
            rc = kind == OPENAI_COMPLETION ? get_prompt(out, json_object_get(o, "prompt"), e)
                                           : get_messages(out, json_object_get(o, "messages"), e);
    }
    if (rc == 0 && compile_constraint(&out->args, e) < 0)
        rc = -1;
    if (rc)
        openai_req_free(out);
    return rc;
}

void openai_req_free(struct openai_req *r)
{
    grammar_free(r->args.compiled);
    r->args.compiled = NULL;
    json_decref(r->root);
    free(r->tokens);
    free(r->msgs);
    free(r->bias);
    r->root = NULL;
    r->tokens = NULL;
    r->msgs = NULL;
    r->bias = NULL;
}

/* ---- responses ------------------------------------------------------------ */

/* A JSON string of text that may not be valid UTF-8 (it should be: the
 * detokenizer writes whole characters); invalid bytes become U+FFFD. */
static json_t *text_value(const char *s, size_t n)
{
    json_t *v = json_stringn(s ? s : "", s ? n : 0);
    if (v)
        return v;
    char *fixed = malloc(3 * n + 1);
    if (!fixed)
        return NULL;
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x80 && ch) {
            fixed[j++] = (char)ch;
        } else {
            /* Keeping only ASCII is simple and never produces invalid
             * output; this path is for bugs, not for normal text. */
            memcpy(fixed + j, "\xef\xbf\xbd", 3);
            j += 3;
        }
    }
    v = json_stringn(fixed, j);
    free(fixed);
    return v;
}

static json_t *tokens_value(const uint32_t *t, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer((json_int_t)t[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *usage_value(const struct openai_out *o)
{
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)o->prompt_tokens,
                     "completion_tokens", (json_int_t)o->completion_tokens, "total_tokens",
                     (json_int_t)(o->prompt_tokens + o->completion_tokens), "prompt_tokens_details",
                     "cached_tokens", (json_int_t)o->cached_tokens);
}

/* A logprob as JSON: -inf (a token the model rules out) is -9999.0, as
 * OpenAI and vLLM write it. */
static json_t *logprob_value(float v)
{
    return json_real(v > -9999.0f ? (double)v : -9999.0);
}

/* A token's text (U+FFFD for bytes that are not whole UTF-8 characters)
 * and its bytes; *piece_len its byte length. */
static json_t *token_entry(const struct openai_out *o, uint32_t id, float logprob, bool bytes,
                           size_t *piece_len)
{
    char buf[256];
    size_t n = o->tok ? tokenizer_piece(o->tok, id, true, buf, sizeof buf) : 0;
    if (n > sizeof buf)
        n = sizeof buf;
    if (piece_len)
        *piece_len = n;
    json_t *t = json_object();
    if (!t || json_object_set_new(t, "token", text_value(buf, n)) ||
        json_object_set_new(t, "logprob", logprob_value(logprob)))
        goto fail;
    if (bytes) {
        json_t *b = json_array();
        if (json_object_set_new(t, "bytes", b) || !b)
            goto fail;
        for (size_t i = 0; i < n; i++)
            if (json_array_append_new(b, json_integer((unsigned char)buf[i])))
                goto fail;
    }
    return t;
fail:
    json_decref(t);
    return NULL;
}

/* chat: {"content": [{token, logprob, bytes, top_logprobs: [{token,
 * logprob, bytes}]}], "refusal": null} */
static json_t *chat_logprobs(const struct openai_out *o)
{
    json_t *content = json_array();
    json_t *root = json_pack("{s:o, s:n}", "content", content, "refusal");
    if (!root)
        return NULL;
    for (size_t i = 0; i < o->n_toks; i++) {
        const struct sampler_logprob *e = o->lp + i * (1 + (size_t)o->lp_top);
        json_t *t = token_entry(o, e[0].id, e[0].logprob, true, NULL);
        json_t *top = json_array();
        if (json_array_append_new(content, t) || !t ||
            json_object_set_new(t, "top_logprobs", top) || !top)
            goto fail;
        for (uint32_t k = 1; k <= o->lp_top; k++)
            if (json_array_append_new(top, token_entry(o, e[k].id, e[k].logprob, true, NULL)))
                goto fail;
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

/* completions: {"tokens": [text], "token_logprobs": [logprob],
 * "top_logprobs": [{text: logprob}], "text_offset": [byte offset]} (a
 * text two alternatives share keeps the likelier's logprob). */
static json_t *completion_logprobs(const struct openai_out *o)
{
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    json_t *root = json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps,
                             "top_logprobs", tops, "text_offset", offs);
    if (!root)
        return NULL;
    size_t off = o->text_offset;
    for (size_t i = 0; i < o->n_toks; i++) {
        const struct sampler_logprob *e = o->lp + i * (1 + (size_t)o->lp_top);
        size_t plen = 0;
        json_t *t = token_entry(o, e[0].id, e[0].logprob, false, &plen);
        json_t *m = json_object();
        if (!t || json_array_append(toks, json_object_get(t, "token")) ||
            json_array_append(lps, json_object_get(t, "logprob")) ||
            json_array_append_new(offs, json_integer((json_int_t)off)) ||
            json_array_append_new(tops, m) || !m) {
            json_decref(t);
            goto fail;
        }
        json_decref(t);
        off += plen;
        for (uint32_t k = 1; k <= o->lp_top; k++) {
            json_t *a = token_entry(o, e[k].id, e[k].logprob, false, NULL);
            const char *key = a ? json_string_value(json_object_get(a, "token")) : NULL;
            if (!key || (!json_object_get(m, key) &&
                         json_object_set(m, key, json_object_get(a, "logprob")))) {
                json_decref(a);
                goto fail;
            }
            json_decref(a);
        }
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

/* choices[0].logprobs: null unless asked (and a stream chunk without
 * tokens). */
static json_t *logprobs_value(const struct openai_out *o)
{
    if (!o->lp || o->n_toks == 0)
        return json_null();
    return o->kind == OPENAI_CHAT ? chat_logprobs(o) : completion_logprobs(o);
}

/* choices[0]: index, finish_reason, logprobs, and the text (completions:
 * "text"; chat: "message" or the stream's "delta" with role and content)
 * with kvd's extension "tokens", the completion's token ids. */
static json_t *render_choice(const struct openai_out *o, bool chunk)
{
    bool chat = o->kind == OPENAI_CHAT;
    json_t *c =
        json_pack("{s:I, s:o, s:o}", "index", (json_int_t)o->index, "finish_reason",
                  o->finish ? json_string(o->finish) : json_null(), "logprobs", logprobs_value(o));
    if (!c)
        return NULL;
    json_t *holder = c;
    if (chat) {
        holder = json_object();
        /* json_object_set_new takes the value over, also when it fails */
        if (json_object_set_new(c, chunk ? "delta" : "message", holder))
            goto fail;
        if ((!chunk || o->role) && json_object_set_new(holder, "role", json_string("assistant")))
            goto fail;
    }
    /* A chat stream's last chunk has an empty delta. */
    bool with_text = !chat || !chunk || o->text_len || o->role;
    if (with_text &&
        json_object_set_new(holder, chat ? "content" : "text", text_value(o->text, o->text_len)))
        goto fail;
    if (json_object_set_new(holder, "tokens", tokens_value(o->toks, o->n_toks)))
        goto fail;
    return c;
fail:
    json_decref(c);
    return NULL;
}

char *openai_render(const struct openai_out *o, bool chunk, size_t *len)
{
    bool chat = o->kind == OPENAI_CHAT;
    const char *object =
        chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:s, s:[]}", "id", o->id, "object", object,
                             "created", (json_int_t)o->created, "model", o->model,
                             "system_fingerprint", "kvd", "choices");
    if (!root)
        return NULL;
    if (!o->no_choices && !o->n_choices &&
        json_array_append_new(json_object_get(root, "choices"), render_choice(o, chunk)))
        goto fail;
    for (size_t i = 0; !o->no_choices && i < o->n_choices; i++)
        if (json_array_append_new(json_object_get(root, "choices"),
                                  render_choice(&o->choices[i], chunk)))
            goto fail;
    if (o->usage ? json_object_set_new(root, "usage", usage_value(o))
                 : (chunk && json_object_set_new(root, "usage", json_null())))
        goto fail;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (s)
        *len = strlen(s);
    return s;
fail:
    json_decref(root);
    return NULL;
}

char *openai_models(const char *model, uint64_t created, size_t *len)
{
    return openai_models_list(&model, NULL, 1, created, len);
}

char *openai_models_list(const char *const *names, const char *const *states, size_t n,
                         uint64_t created, size_t *len)
{
    json_t *root = json_pack("{s:s, s:[]}", "object", "list", "data");
    json_t *data = root ? json_object_get(root, "data") : NULL;
    for (size_t i = 0; data && i < n; i++) {
        json_t *m = json_pack("{s:s, s:s, s:I, s:s}", "id", names[i], "object", "model", "created",
                              (json_int_t)created, "owned_by", "kvd");
        if (m && states && json_object_set_new(m, "state", json_string(states[i])) != 0) {
            json_decref(m);
            m = NULL;
        }
        if (!m || json_array_append_new(data, m) != 0) {
            json_decref(root);
            return NULL;
        }
    }
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (s)
        *len = strlen(s);
    return s;
}

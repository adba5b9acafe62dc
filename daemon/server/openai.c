/* openai: OpenAI request bodies into generate arguments, results into
 * OpenAI JSON (see openai.h). Parsing is strict about what it reads
 * (jansson rejects invalid UTF-8, NUL in strings, duplicate keys here,
 * trailing bytes) and ignores fields it does not know. */
#include "openai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvd/protocol.h"
#include "kvd/status.h"
#include "proto.h"
#include "text_out.h"

#define OPENAI_DEFAULT_MAX_TOKENS 16 /* completions, as OpenAI's reference */

void openai_err_set(struct openai_err *e, int status, const char *type, const char *code,
                    const char *fmt, ...)
{
    va_list ap;
    e->status = status;
    snprintf(e->type, sizeof(e->type), "%s", type);
    snprintf(e->code, sizeof(e->code), "%s", code);
    e->param[0] = '\0';
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
}

/* A 400 about parameter `param`. */
__attribute__((format(printf, 3, 4))) static int bad(struct openai_err *e, const char *param,
                                                     const char *fmt, ...)
{
    va_list ap;
    e->status = 400;
    snprintf(e->type, sizeof(e->type), "invalid_request_error");
    snprintf(e->code, sizeof(e->code), "bad_request");
    snprintf(e->param, sizeof(e->param), "%s", param);
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return -1;
}

/* A 400 for something kvd does not do (yet). */
static int unsupported(struct openai_err *e, const char *param, const char *what)
{
    bad(e, param, "not supported: %s", what);
    snprintf(e->code, sizeof(e->code), "unsupported");
    return -1;
}

void openai_err_from_kvd(struct openai_err *e, int code, const char *message)
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
    int status = 500;
    const char *type = "server_error";
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (map[i].code == code) {
            status = map[i].status;
            type = map[i].type;
        }
    openai_err_set(e, status, type, kvd_err_code(code), "%s",
                   message && message[0] ? message : kvd_err_code(code));
}

static json_t *text_value(const char *s, size_t n);

char *openai_error_body(const struct openai_err *e, size_t *len)
{
    /* The message may quote a client's bytes (jansson's error text) or be
     * cut inside a character: invalid UTF-8 there is replaced, so a
     * refusal always has its body. */
    json_t *err = json_pack("{s:o, s:s, s:o, s:s}", "message",
                            text_value(e->message, strlen(e->message)), "type", e->type, "param",
                            e->param[0] ? text_value(e->param, strlen(e->param)) : json_null(),
                            "code", e->code);
    json_t *root = err ? json_pack("{s:o}", "error", err) : NULL;
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (s)
        *len = strlen(s);
    return s;
}

/* ---- requests ------------------------------------------------------------- */

/* Every packing call of one request: a failure (no memory) sticks. */
struct args {
    msgpack_packer pk;
    int rc;
};

static void put_key(struct args *a, const char *k)
{
    if (!a->rc)
        a->rc = proto_pack_str(&a->pk, k);
}

/* An integer field in [lo, hi]: 0 absent or null (*present false), 1 read,
 * -1 with e filled. */
static int get_int(json_t *o, const char *key, long long lo, long long hi, long long *v,
                   struct openai_err *e)
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

static int get_num(json_t *o, const char *key, double lo, double hi, double *v,
                   struct openai_err *e)
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

static int get_bool(json_t *o, const char *key, bool *v, struct openai_err *e)
{
    json_t *x = json_object_get(o, key);
    if (!x || json_is_null(x))
        return 0;
    if (!json_is_boolean(x))
        return bad(e, key, "'%s' must be true or false", key);
    *v = json_is_true(x);
    return 1;
}

/* A token id array (json array of integers) packed as `tokens`. */
static int put_tokens(struct args *a, json_t *arr, const char *param, struct openai_err *e)
{
    size_t n = json_array_size(arr);
    if (n > KVD_MAX_ARRAY)
        return bad(e, param, "'%s' has %zu tokens, at most %u", param, n, KVD_MAX_ARRAY);
    put_key(a, "tokens");
    if (!a->rc)
        a->rc = proto_pack_array(&a->pk, n);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(arr, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 ||
            json_integer_value(t) > (json_int_t)UINT32_MAX)
            return bad(e, param, "'%s'[%zu] must be a token id (an integer in [0, %u])", param, i,
                       UINT32_MAX);
        if (!a->rc)
            a->rc = msgpack_pack_uint64(&a->pk, (uint64_t)json_integer_value(t)) ? KVD_ENOMEM : 0;
    }
    return 0;
}

/* `prompt`: a string, one string in an array, token ids, or one array of
 * token ids. */
static int put_prompt(struct args *a, json_t *p, struct openai_err *e)
{
    if (!p || json_is_null(p))
        return bad(e, "prompt", "'prompt' is required");
    if (json_is_string(p)) {
        put_key(a, "text");
        if (!a->rc)
            a->rc = proto_pack_strn(&a->pk, json_string_value(p), json_string_length(p));
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
            put_key(a, "text");
            if (!a->rc)
                a->rc =
                    proto_pack_strn(&a->pk, json_string_value(first), json_string_length(first));
            return 0;
        }
        p = first;
    }
    if (json_array_size(p) == 0)
        return bad(e, "prompt", "'prompt' is empty: it needs at least one token");
    return put_tokens(a, p, "prompt", e);
}

/* A message's content: a string, null (""), or text parts concatenated. */
static int put_content(struct args *a, json_t *c, size_t i, struct openai_err *e)
{
    if (!c || json_is_null(c)) {
        if (!a->rc)
            a->rc = proto_pack_strn(&a->pk, "", 0);
        return 0;
    }
    if (json_is_string(c)) {
        if (!a->rc)
            a->rc = proto_pack_strn(&a->pk, json_string_value(c), json_string_length(c));
        return 0;
    }
    if (!json_is_array(c))
        return bad(e, "messages",
                   "'messages'[%zu].content must be a string or an array of "
                   "text parts",
                   i);
    size_t total = 0, n = json_array_size(c);
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
        total += json_string_length(text);
    }
    if (!a->rc)
        a->rc = msgpack_pack_str(&a->pk, total) ? KVD_ENOMEM : 0;
    for (size_t k = 0; k < n && !a->rc; k++) {
        json_t *text = json_object_get(json_array_get(c, k), "text");
        a->rc = msgpack_pack_str_body(&a->pk, json_string_value(text), json_string_length(text))
                    ? KVD_ENOMEM
                    : 0;
    }
    return 0;
}

static int put_messages(struct args *a, json_t *m, struct openai_err *e)
{
    if (!m || json_is_null(m))
        return bad(e, "messages", "'messages' is required");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return bad(e, "messages", "'messages' must be a non-empty array of {role, content}");
    size_t n = json_array_size(m);
    if (n > KVD_MAX_ARRAY)
        return bad(e, "messages", "'messages' has %zu entries, at most %u", n, KVD_MAX_ARRAY);
    put_key(a, "messages");
    if (!a->rc)
        a->rc = proto_pack_array(&a->pk, n);
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        json_t *role = json_object_get(msg, "role");
        if (!json_is_object(msg) || !json_is_string(role))
            return bad(e, "messages", "'messages'[%zu] must be an object with a string 'role'", i);
        if (!a->rc)
            a->rc = proto_pack_map(&a->pk, 2);
        put_key(a, "role");
        if (!a->rc)
            a->rc = proto_pack_strn(&a->pk, json_string_value(role), json_string_length(role));
        put_key(a, "content");
        if (put_content(a, json_object_get(msg, "content"), i, e))
            return -1;
    }
    return 0;
}

/* A stop string's length: 1 to TEXT_OUT_MAX_STOP_LEN bytes (generate's own
 * bound), in both of stop's forms. */
static int stop_len_ok(json_t *x, bool in_array, size_t i, struct openai_err *e)
{
    size_t n = json_string_length(x);
    if (n > 0 && n <= TEXT_OUT_MAX_STOP_LEN)
        return 0;
    if (in_array)
        return bad(e, "stop", "'stop'[%zu] must have 1 to %u bytes", i, TEXT_OUT_MAX_STOP_LEN);
    return bad(e, "stop", "'stop' must have 1 to %u bytes", TEXT_OUT_MAX_STOP_LEN);
}

/* `stop`: null, a string, or an array of at most 4 strings. */
static int put_stop(struct args *a, json_t *s, struct openai_err *e)
{
    if (!s || json_is_null(s))
        return 0;
    if (json_is_string(s)) {
        if (stop_len_ok(s, false, 0, e))
            return -1;
        put_key(a, "stop");
        if (!a->rc)
            a->rc = proto_pack_array(&a->pk, 1);
        if (!a->rc)
            a->rc = proto_pack_strn(&a->pk, json_string_value(s), json_string_length(s));
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
    if (n == 0)
        return 0;
    put_key(a, "stop");
    if (!a->rc)
        a->rc = proto_pack_array(&a->pk, n);
    for (size_t i = 0; i < n && !a->rc; i++) {
        json_t *x = json_array_get(s, i);
        a->rc = proto_pack_strn(&a->pk, json_string_value(x), json_string_length(x));
    }
    return 0;
}

/* The fields kvd does not do: refused when they ask for something other
 * than the default. */
static int check_unsupported(json_t *o, enum openai_kind kind, struct openai_err *e)
{
    long long n = 1;
    int r = get_int(o, "n", 1, 128, &n, e);
    if (r < 0)
        return -1;
    if (n != 1)
        return unsupported(e, "n", "n > 1 (one choice per request)");
    bool echo = false;
    if (get_bool(o, "echo", &echo, e) < 0)
        return -1;
    if (echo)
        return unsupported(e, "echo", "echo");
    json_t *lp = json_object_get(o, "logprobs");
    bool lp_on = lp && !json_is_null(lp) && !json_is_false(lp) &&
                 !(json_is_integer(lp) && json_integer_value(lp) == 0);
    if (kind == OPENAI_CHAT && lp && !json_is_null(lp) && !json_is_boolean(lp))
        return bad(e, "logprobs", "'logprobs' must be true or false");
    if (kind == OPENAI_COMPLETION && lp && !json_is_null(lp) && !json_is_integer(lp))
        return bad(e, "logprobs", "'logprobs' must be an integer");
    if (lp_on)
        return unsupported(e, "logprobs", "logprobs");
    json_t *model = json_object_get(o, "model");
    if (model && !json_is_null(model) &&
        (!json_is_string(model) || json_string_length(model) > OPENAI_MAX_MODEL))
        return bad(e, "model", "'model' must be a string of at most %d bytes", OPENAI_MAX_MODEL);
    return 0;
}

int openai_parse(enum openai_kind kind, const char *body, size_t len, uint32_t n_ctx,
                 struct openai_req *out, struct openai_err *e)
{
    json_error_t je;
    memset(out, 0, sizeof(*out));
    out->kind = kind;
    msgpack_sbuffer_init(&out->args);
    if (n_ctx == 0) { /* no model: nothing to bound max_tokens by */
        openai_err_set(e, 503, "server_error", "unsupported", "no model loaded");
        return -1;
    }
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!o)
        return bad(e, "", "the body is not valid JSON: %s (at byte %d)", je.text, je.position);
    int rc = -1;
    struct args a = {.rc = 0};
    if (!json_is_object(o)) {
        bad(e, "", "the body must be a JSON object");
        goto out;
    }
    if (check_unsupported(o, kind, e))
        goto out;
    bool stream = false, ignore_eos = false;
    if (get_bool(o, "stream", &stream, e) < 0)
        goto out;
    /* An extension (llama.cpp's and vLLM's servers have it too). */
    if (get_bool(o, "ignore_eos", &ignore_eos, e) < 0)
        goto out;
    out->stream = stream;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) {
            bad(e, "stream_options", "'stream_options' must be an object");
            goto out;
        }
        bool iu = false;
        if (get_bool(so, "include_usage", &iu, e) < 0)
            goto out;
        out->include_usage = iu;
    }
    /* Defaults: the context (chat), 16 (completions) but never past the
     * context. */
    long long max_tokens = kind == OPENAI_CHAT || n_ctx < OPENAI_DEFAULT_MAX_TOKENS
                               ? (long long)n_ctx
                               : OPENAI_DEFAULT_MAX_TOKENS;
    int r = get_int(o, "max_tokens", 1, n_ctx, &max_tokens, e);
    if (r < 0)
        goto out;
    if (kind == OPENAI_CHAT && get_int(o, "max_completion_tokens", 1, n_ctx, &max_tokens, e) < 0)
        goto out;
    double temperature = 1.0, top_p = 1.0;
    if (get_num(o, "temperature", 0, 2, &temperature, e) < 0)
        goto out;
    int has_top_p = get_num(o, "top_p", 0, 1, &top_p, e);
    if (has_top_p < 0)
        goto out;
    if (has_top_p && top_p == 0)
        top_p = 1e-9; /* OpenAI's 0 means "only the most likely": kvd's top_p is in (0, 1] */
    long long seed = 0;
    int has_seed = get_int(o, "seed", INT64_MIN, INT64_MAX, &seed, e);
    if (has_seed < 0)
        goto out;

    proto_packer_init(&a.pk, &out->args);
    size_t at = proto_map_begin(&a.pk);
    if (at == SIZE_MAX) {
        openai_err_set(e, 503, "server_error", "no_memory", "out of memory");
        goto out;
    }
    if (kind == OPENAI_COMPLETION ? put_prompt(&a, json_object_get(o, "prompt"), e)
                                  : put_messages(&a, json_object_get(o, "messages"), e))
        goto out;
    if (put_stop(&a, json_object_get(o, "stop"), e))
        goto out;
    if (!a.rc)
        a.rc = proto_pack_kv_uint(&a.pk, "max_tokens", (uint64_t)max_tokens);
    if (!a.rc)
        a.rc = proto_pack_kv_double(&a.pk, "temperature", temperature);
    if (!a.rc)
        a.rc = proto_pack_kv_double(&a.pk, "top_p", top_p);
    if (has_seed && !a.rc)
        a.rc = proto_pack_kv_uint(&a.pk, "seed", (uint64_t)seed);
    if (!a.rc)
        a.rc = proto_pack_kv_bool(&a.pk, "stream", stream);
    if (ignore_eos && !a.rc)
        a.rc = proto_pack_kv_bool(&a.pk, "ignore_eos", true);
    if (!a.rc)
        a.rc = proto_map_end(&a.pk, at);
    if (a.rc) {
        openai_err_set(e, 503, "server_error", "no_memory", "out of memory");
        goto out;
    }
    rc = 0;
out:
    json_decref(o);
    if (rc)
        openai_req_free(out);
    return rc;
}

void openai_req_free(struct openai_req *r)
{
    msgpack_sbuffer_destroy(&r->args);
    msgpack_sbuffer_init(&r->args);
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

/* choices[0]: index, finish_reason, logprobs, and the text (completions:
 * "text"; chat: "message" or the stream's "delta" with role and content)
 * with kvd's extension "tokens", the completion's token ids. */
static json_t *render_choice(const struct openai_out *o, bool chunk)
{
    bool chat = o->kind == OPENAI_CHAT;
    json_t *c =
        json_pack("{s:i, s:o, s:o}", "index", 0, "finish_reason",
                  o->finish ? json_string(o->finish) : json_null(), "logprobs", json_null());
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
    if (!o->no_choices &&
        json_array_append_new(json_object_get(root, "choices"), render_choice(o, chunk)))
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
    json_t *root =
        json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", model,
                  "object", "model", "created", (json_int_t)created, "owned_by", "kvd");
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (s)
        *len = strlen(s);
    return s;
}

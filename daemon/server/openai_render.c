/* openai_render: kvd's results as OpenAI JSON (see openai.h): response
 * objects, stream chunks (text, logprobs, tool calls), /v1/models, and the
 * error bodies with the HTTP status of each kvd error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "openai.h"

/* A JSON string of text that may not be valid UTF-8 (it should be: the
 * detokenizer writes whole characters); invalid bytes become U+FFFD. */
static json_t *text_value(const char *s, size_t n);

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

/* message.tool_calls: [{id, type, function: {name, arguments}}]; a
 * stream's delta.tool_calls: [{index, id, type, function: {name,
 * arguments}}] the first time, then [{index, function: {arguments}}]. */
static json_t *calls_value(const struct openai_out *o)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < o->n_calls; i++) {
        const struct tool_call_out *c = &o->calls[i];
        json_t *x =
            json_pack("{s:o, s:s, s:{s:o, s:o}}", "id", text_value(c->id, strlen(c->id)), "type",
                      "function", "function", "name", text_value(c->name, strlen(c->name)),
                      "arguments", text_value(c->args, c->args_len));
        if (!x || json_array_append_new(a, x))
            goto fail;
    }
    for (size_t i = 0; a && i < o->n_deltas; i++) {
        const struct tool_delta *d = &o->deltas[i];
        json_t *fn = json_pack("{s:o}", "arguments", text_value(d->args, d->args_len));
        json_t *x = fn ? json_pack("{s:I}", "index", (json_int_t)d->index) : NULL;
        if (x && d->id &&
            (json_object_set_new(x, "id", text_value(d->id, strlen(d->id))) ||
             json_object_set_new(x, "type", json_string("function")) ||
             json_object_set_new(fn, "name", text_value(d->name, strlen(d->name)))))
            goto fail_x;
        if (!x || json_object_set_new(x, "function", fn)) {
            fn = NULL;
            goto fail_x;
        }
        if (json_array_append_new(a, x))
            goto fail;
        continue;
    fail_x:
        json_decref(fn);
        json_decref(x);
        goto fail;
    }
    return a;
fail:
    json_decref(a);
    return NULL;
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
    /* A chat stream's last chunk has an empty delta; content is null when
     * tool calls are all there is. */
    bool with_text = !chat || !chunk || o->text_len || o->role;
    bool calls_only = chat && !o->text_len && (o->n_calls || o->n_deltas);
    if (with_text &&
        json_object_set_new(holder, chat ? "content" : "text",
                            calls_only ? json_null() : text_value(o->text, o->text_len)))
        goto fail;
    if (chat && (o->n_calls || o->n_deltas) &&
        json_object_set_new(holder, "tool_calls", calls_value(o)))
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

/* ops_generate_decode: a msgpack generate request's map into the typed
 * generate arguments (gen_request.h): types and shapes, every bad argument
 * bad_request naming the field; the build does the rest
 * (ops_generate_build). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "gen_request.h"
#include "ops_generate.h"
#include "proto.h"
#include "tool_args.h"

/* ---- the msgpack decoder ----------------------------------------------- */

/* What a decoded request points to besides the message itself. */
struct mp_owned {
    uint32_t *tokens;
    struct chat_msg *msgs;
    struct logit_bias *bias;
    json_t *schema;
    json_t *tools, *chat, *choice; /* tool calls (tool_args.h) */
};

/* A msgpack value as JSON (a JSON Schema sent as a map, tools, messages)
 * : NULL with err (naming the field `what`) for what JSON has not
 * (binary, extension, non-string keys, a string that is not UTF-8, a
 * float that is not finite). The codec bounded the depth (16) and the
 * sizes. */
static json_t *mp_to_json(const msgpack_object *o, const char *what, struct kvd_error *err)
{
    json_t *v = NULL;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        return json_null();
    case MSGPACK_OBJECT_BOOLEAN:
        return json_boolean(o->via.boolean);
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 <= INT64_MAX)
            return json_integer((json_int_t)o->via.u64);
        return json_real((double)o->via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return json_integer((json_int_t)o->via.i64);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (!isfinite(o->via.f64))
            break;
        return json_real(o->via.f64);
    case MSGPACK_OBJECT_STR:
        if ((v = json_stringn(o->via.str.ptr, o->via.str.size)))
            return v;
        kvd_error_set(err, KVD_EBADREQ, "'%s': a string is not UTF-8 (or holds a NUL)", what);
        return NULL;
    case MSGPACK_OBJECT_ARRAY:
        if (!(v = json_array()))
            break;
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            json_t *x = mp_to_json(&o->via.array.ptr[i], what, err);
            if (!x || json_array_append_new(v, x)) {
                json_decref(v);
                return NULL;
            }
        }
        return v;
    case MSGPACK_OBJECT_MAP:
        if (!(v = json_object()))
            break;
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object *k = &o->via.map.ptr[i].key;
            char key[256];
            if (k->type != MSGPACK_OBJECT_STR || k->via.str.size >= sizeof key ||
                memchr(k->via.str.ptr, 0, k->via.str.size)) {
                json_decref(v);
                kvd_error_set(err, KVD_EBADREQ,
                              "'%s': a map key must be a string of under 256 bytes", what);
                return NULL;
            }
            memcpy(key, k->via.str.ptr, k->via.str.size);
            key[k->via.str.size] = '\0';
            if (json_object_get(v, key)) {
                json_decref(v);
                kvd_error_set(err, KVD_EBADREQ, "'%s': the key '%.60s' is given twice", what, key);
                return NULL;
            }
            json_t *x = mp_to_json(&o->via.map.ptr[i].val, what, err);
            if (!x || json_object_set_new(v, key, x)) {
                json_decref(v);
                if (x) /* set_new refused the key: not UTF-8 */
                    kvd_error_set(err, KVD_EBADREQ, "'%s': a key is not UTF-8", what);
                return NULL;
            }
        }
        return v;
    default:
        break;
    }
    if (err->code == 0)
        kvd_error_set(err, KVD_EBADREQ,
                      "'%s' holds a value JSON has not (binary, extension, a float that is "
                      "not finite)",
                      what);
    return NULL;
}

/* `json_schema`: a map (the schema) or a string (its JSON text). */
static int decode_json_schema(const msgpack_object *root, struct gen_args *a, struct mp_owned *own,
                              struct kvd_error *err)
{
    const msgpack_object *o = proto_map_find(root, "json_schema");
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return 0;
    a->json_schema_param = "json_schema";
    if (o->type == MSGPACK_OBJECT_STR) {
        a->json_schema_text = o->via.str.ptr;
        a->json_schema_len = o->via.str.size;
        return 0;
    }
    if (o->type != MSGPACK_OBJECT_MAP && o->type != MSGPACK_OBJECT_BOOLEAN)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'json_schema' must be a map (a JSON Schema) or a string (its JSON)");
    err->code = 0;
    if (!(own->schema = mp_to_json(o, "json_schema", err)))
        return err->code ? err->code : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    a->json_schema = own->schema;
    return 0;
}

static bool mp_number(const msgpack_object *x, double *out)
{
    switch (x->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        *out = (double)x->via.u64;
        return true;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        *out = (double)x->via.i64;
        return true;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        *out = x->via.f64;
        return true;
    default:
        return false;
    }
}

/* `logit_bias`: a map {id: bias} or an array of [id, bias] (the range
 * checks are gen_request's). */
static int decode_logit_bias(const msgpack_object *root, struct gen_args *a, struct mp_owned *own,
                             struct kvd_error *err)
{
    const msgpack_object *o = proto_map_find(root, "logit_bias");
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return 0;
    bool is_map = o->type == MSGPACK_OBJECT_MAP;
    if (!is_map && o->type != MSGPACK_OBJECT_ARRAY)
        return kvd_error_set(
            err, KVD_EBADREQ,
            "'logit_bias' must be a map {token id: bias} or an array of [id, bias]");
    uint32_t n = is_map ? o->via.map.size : o->via.array.size;
    if (n > KVD_MAX_ARRAY)
        return kvd_error_set(err, KVD_ETOOLARGE, "'logit_bias' has %u entries, at most %u", n,
                             KVD_MAX_ARRAY);
    if (n && !(own->bias = malloc((size_t)n * sizeof *own->bias)))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *k, *v;
        if (is_map) {
            k = &o->via.map.ptr[i].key;
            v = &o->via.map.ptr[i].val;
        } else {
            const msgpack_object *p = &o->via.array.ptr[i];
            if (p->type != MSGPACK_OBJECT_ARRAY || p->via.array.size != 2)
                return kvd_error_set(err, KVD_EBADREQ, "'logit_bias'[%u] must be [id, bias]", i);
            k = &p->via.array.ptr[0];
            v = &p->via.array.ptr[1];
        }
        double b;
        if (k->type != MSGPACK_OBJECT_POSITIVE_INTEGER || k->via.u64 > UINT32_MAX)
            return kvd_error_set(err, KVD_EBADREQ, "'logit_bias': a key must be a token id");
        if (!mp_number(v, &b))
            return kvd_error_set(err, KVD_EBADREQ, "'logit_bias': a bias must be a number");
        own->bias[i] = (struct logit_bias){.id = (uint32_t)k->via.u64, .bias = (float)b};
    }
    a->logit_bias = own->bias;
    a->n_logit_bias = n;
    return 0;
}

/* `logprobs`: true (the generated tokens' own only), false, or how many
 * top alternatives each token comes with (the range is gen_request's). */
static int decode_logprobs(const msgpack_object *root, struct gen_args *a, struct kvd_error *err)
{
    const msgpack_object *o = proto_map_find(root, "logprobs");
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return 0;
    if (o->type == MSGPACK_OBJECT_BOOLEAN) {
        a->logprobs = o->via.boolean;
        return 0;
    }
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'logprobs' must be true, false or a count of top alternatives "
                             "(0 to %d)",
                             SAMPLER_MAX_TOP_LOGPROBS);
    a->logprobs = true;
    a->top_logprobs = o->via.u64;
    return 0;
}

/* `stop`: token ids and strings, mixed (strings point into the message). */
static int decode_stop(const msgpack_object *root, struct gen_args *a, struct kvd_error *err)
{
    const msgpack_object *o = proto_map_find(root, "stop");
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return 0;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return kvd_error_set(err, KVD_EBADREQ, "'stop' must be an array of token ids and strings");
    if (o->via.array.size > SCHED_MAX_STOP)
        return kvd_error_set(err, KVD_EBADREQ, "'stop' has %u entries, at most %u",
                             o->via.array.size, SCHED_MAX_STOP);
    for (uint32_t i = 0; i < o->via.array.size; i++) {
        const msgpack_object *x = &o->via.array.ptr[i];
        if (x->type == MSGPACK_OBJECT_POSITIVE_INTEGER && x->via.u64 <= UINT32_MAX) {
            a->stop_ids[a->n_stop_ids++] = (uint32_t)x->via.u64;
        } else if (x->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
            return kvd_error_set(err, KVD_EBADREQ, "'stop'[%u] = %llu is not a token id", i,
                                 (unsigned long long)x->via.u64);
        } else if (x->type == MSGPACK_OBJECT_STR) {
            a->stop_strs[a->n_stop_strs] = x->via.str.ptr;
            a->stop_lens[a->n_stop_strs++] = x->via.str.size;
        } else {
            return kvd_error_set(err, KVD_EBADREQ, "'stop'[%u] must be a token id or a string", i);
        }
    }
    return 0;
}

/* `messages`: [{role, content}] as NUL-terminated copies (one allocation;
 * a nil content is empty). */
static int decode_messages(const msgpack_object *a, struct chat_msg **out, size_t *n_out,
                           struct kvd_error *err)
{
    *out = NULL;
    *n_out = 0;
    if (a->type != MSGPACK_OBJECT_ARRAY || a->via.array.size == 0)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'messages' must be a non-empty array of {role, content} maps");
    uint32_t n = a->via.array.size;
    if (n > KVD_MAX_ARRAY)
        return kvd_error_set(err, KVD_ETOOLARGE, "'messages' has %u entries, at most %u", n,
                             KVD_MAX_ARRAY);
    size_t bytes = (size_t)n * sizeof(struct chat_msg);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *m = &a->via.array.ptr[i];
        const char *s;
        size_t len;
        for (int k = 0; k < 2; k++) {
            const char *key = k ? "content" : "role";
            const msgpack_object *v = m->type == MSGPACK_OBJECT_MAP ? proto_map_find(m, key) : NULL;
            if (k && v && v->type == MSGPACK_OBJECT_NIL) {
                bytes += 1;
                continue;
            }
            if (m->type != MSGPACK_OBJECT_MAP || proto_get_str(m, key, &s, &len, err))
                return kvd_error_set(err, KVD_EBADREQ, "'messages'[%u]: '%s' must be a string", i,
                                     key);
            if (memchr(s, 0, len))
                return kvd_error_set(err, KVD_EBADREQ, "'messages'[%u].%s holds a NUL byte", i,
                                     key);
            bytes += len + 1;
        }
    }
    struct chat_msg *msgs = malloc(bytes);
    if (!msgs)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    char *p = (char *)(msgs + n);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *m = &a->via.array.ptr[i];
        for (int k = 0; k < 2; k++) {
            const char *s = "";
            size_t len = 0;
            const msgpack_object *v = proto_map_find(m, k ? "content" : "role");
            if (v->type != MSGPACK_OBJECT_NIL)
                proto_get_str(m, k ? "content" : "role", &s, &len, err);
            memcpy(p, s, len);
            p[len] = 0;
            if (k)
                msgs[i].content = p;
            else
                msgs[i].role = p;
            p += len + 1;
        }
    }
    *out = msgs;
    *n_out = n;
    return 0;
}

/* The messages in tool_call.h's common form, when they carry tool calls or
 * results or the request has tools (own->chat; NULL otherwise: nothing is
 * copied for a plain conversation). */
static int decode_chat_json(const msgpack_object *a, const struct chat_msg *msgs, bool tools,
                            struct mp_owned *own, struct kvd_error *err)
{
    bool has = tools;
    for (uint32_t i = 0; !has && i < a->via.array.size; i++) {
        const msgpack_object *m = &a->via.array.ptr[i];
        const msgpack_object *calls = proto_map_find(m, "tool_calls");
        const msgpack_object *id = proto_map_find(m, "tool_call_id");
        has = (calls && calls->type != MSGPACK_OBJECT_NIL) ||
              (id && id->type != MSGPACK_OBJECT_NIL) || !strcmp(msgs[i].role, "tool");
    }
    if (!has) /* a plain conversation: role and content are all */
        return 0;
    json_t *chat = json_array();
    if (!chat)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    own->chat = chat;
    for (uint32_t i = 0; i < a->via.array.size; i++) {
        const msgpack_object *m = &a->via.array.ptr[i];
        const msgpack_object *content = proto_map_find(m, "content");
        json_t *role = json_string(msgs[i].role);
        json_t *text =
            content->type == MSGPACK_OBJECT_NIL ? json_null() : json_string(msgs[i].content);
        if (!role || !text) { /* jansson takes UTF-8 only */
            json_decref(role);
            json_decref(text);
            return kvd_error_set(err, KVD_EBADREQ, "'messages'[%u]: role and content must be UTF-8",
                                 i);
        }
        json_t *c = json_pack("{s:o, s:o}", "role", role, "content", text);
        if (!c || json_array_append_new(chat, c))
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        /* the tool fields, as JSON */
        static const char *const keys[] = {"tool_calls", "tool_call_id", "name"};
        json_t *msg = json_pack("{s:s}", "role", msgs[i].role);
        if (!msg)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        for (int k = 0; k < 3; k++) {
            const msgpack_object *v = proto_map_find(m, keys[k]);
            json_t *x = v ? mp_to_json(v, "messages", err) : NULL;
            if (v && (!x || json_object_set_new(msg, keys[k], x))) {
                json_decref(msg);
                return err->code ? err->code : kvd_error_set(err, KVD_ENOMEM, "out of memory");
            }
        }
        bool any = false;
        int rc = tool_args_message(msg, i, c, &any, err);
        json_decref(msg);
        if (rc)
            return err->code;
    }
    return 0;
}

/* `tools`, `tool_choice`, `parallel_tool_calls` (tool_args.h). */
static int decode_tools(const msgpack_object *root, struct gen_args *a, struct mp_owned *own,
                        struct kvd_error *err)
{
    int rc = proto_opt_bool(root, "parallel_tool_calls", &a->parallel_tool_calls, NULL, err);
    if (rc)
        return rc;
    const msgpack_object *t = proto_map_find(root, "tools");
    const msgpack_object *tc = proto_map_find(root, "tool_choice");
    json_t *tools = NULL;
    err->code = 0;
    if (t && t->type != MSGPACK_OBJECT_NIL && !(tools = mp_to_json(t, "tools", err)))
        return err->code ? err->code : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    rc = tool_args_tools(tools, &own->tools, err);
    json_decref(tools);
    if (rc)
        return err->code;
    if (tc && tc->type != MSGPACK_OBJECT_NIL && !(own->choice = mp_to_json(tc, "tool_choice", err)))
        return err->code ? err->code : kvd_error_set(err, KVD_ENOMEM, "out of memory");
    if (tool_args_choice(own->choice, own->tools, &a->tool_choice, &a->tool_name, err))
        return err->code;
    a->tools = own->tools;
    return 0;
}

/* A generate request's map into a: types and shapes only (the ranges are
 * gen_request_build's). The prompt is exactly one of `tokens`, `text` and
 * `messages`, or none with `seq`. */
static int decode(const msgpack_object *root, struct gen_args *a, struct mp_owned *own,
                  struct kvd_error *err)
{
    int rc;
    gen_args_init(a);
    memset(own, 0, sizeof(*own));
    if ((rc = proto_opt_uint(root, "seq", &a->seq, &a->has_seq, err)) ||
        (rc = proto_opt_strz(root, "session", a->session, sizeof a->session, &a->has_session,
                             err)) ||
        (rc = proto_opt_uint(root, "session_ttl_s", &a->session_ttl_s, NULL, err)))
        return rc;
    if (proto_map_find(root, "speculative") &&
        (rc = proto_get_str(root, "speculative", &a->speculative, &a->speculative_len, err)))
        return rc;
    if (proto_map_find(root, "grammar") &&
        (rc = proto_get_str(root, "grammar", &a->grammar, &a->grammar_len, err)))
        return rc;
    bool has_toks = false;
    if ((rc = proto_opt_u32_array(root, "tokens", KVD_MAX_ARRAY, &own->tokens, &a->n_tokens,
                                  &has_toks, err)))
        return rc;
    const msgpack_object *o_text = proto_map_find(root, "text");
    const msgpack_object *o_msgs = proto_map_find(root, "messages");
    if (has_toks + (o_text != NULL) + (o_msgs != NULL) > 1)
        return kvd_error_set(err, KVD_EBADREQ, "give one of 'tokens', 'text' and 'messages'");
    if (!has_toks && !o_text && !o_msgs && !a->has_seq && !a->has_session)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'tokens', 'text' or 'messages' is required (or 'seq' or 'session')");
    if (has_toks) {
        a->prompt = GEN_PROMPT_TOKENS;
        a->prompt_param = "tokens";
        a->tokens = own->tokens;
    } else if (o_text) {
        a->prompt = GEN_PROMPT_TEXT;
        a->prompt_param = "text";
        if ((rc = proto_get_str(root, "text", &a->text, &a->text_len, err)))
            return rc;
    } else if (o_msgs) {
        a->prompt = GEN_PROMPT_MESSAGES;
        a->prompt_param = "messages";
        if ((rc = decode_messages(o_msgs, &own->msgs, &a->n_msgs, err)))
            return rc;
        a->msgs = own->msgs;
    }
    if ((rc = decode_tools(root, a, own, err)))
        return rc;
    if (a->tools && !o_msgs)
        return kvd_error_set(err, KVD_EBADREQ, "'tools' needs a 'messages' prompt");
    if (o_msgs && (rc = decode_chat_json(o_msgs, own->msgs, a->tools != NULL, own, err)))
        return rc;
    a->chat_json = own->chat;
    if ((rc = proto_opt_uint(root, "max_tokens", &a->max_tokens, &a->has_max_tokens, err)) ||
        (rc = proto_opt_double(root, "temperature", &a->temperature, NULL, err)) ||
        (rc = proto_opt_double(root, "top_p", &a->top_p, NULL, err)) ||
        (rc = proto_opt_uint(root, "top_k", &a->top_k, NULL, err)) ||
        (rc = proto_opt_uint(root, "seed", &a->seed, &a->has_seed, err)) ||
        (rc = proto_opt_double(root, "min_p", &a->min_p, NULL, err)) ||
        (rc = proto_opt_double(root, "typical_p", &a->typical_p, NULL, err)) ||
        (rc = proto_opt_double(root, "repeat_penalty", &a->repeat_penalty, NULL, err)) ||
        (rc = proto_opt_int(root, "repeat_last_n", &a->repeat_last_n, NULL, err)) ||
        (rc = proto_opt_double(root, "presence_penalty", &a->presence_penalty, NULL, err)) ||
        (rc = proto_opt_double(root, "frequency_penalty", &a->frequency_penalty, NULL, err)) ||
        (rc = decode_logit_bias(root, a, own, err)) || (rc = decode_logprobs(root, a, err)) ||
        (rc = decode_json_schema(root, a, own, err)) ||
        (rc = proto_opt_uint(root, "n", &a->n, NULL, err)) || (rc = decode_stop(root, a, err)) ||
        (rc = proto_opt_bool(root, "ignore_eos", &a->ignore_eos, NULL, err)) ||
        (rc = proto_opt_bool(root, "stream", &a->stream, NULL, err)) ||
        (rc = proto_opt_int(root, "priority", &a->priority, NULL, err)))
        return rc;
    return 0;
}

int ops_generate_build(struct exec *ex, struct kvmm *mm, const msgpack_object *root,
                       const struct gen_caller *c, const struct gen_limits *lim,
                       struct sched_req **out, struct kvd_error *err)
{
    struct gen_args a;
    struct mp_owned own;
    int rc = decode(root, &a, &own, err);
    if (rc == 0)
        rc = gen_request_build(ex, mm, &a, c, lim, out, err);
    free(own.tokens);
    free(own.msgs);
    free(own.bias);
    json_decref(own.schema);
    json_decref(own.tools);
    json_decref(own.chat);
    json_decref(own.choice);
    return rc;
}

/* The generate and cancel ops: parse and validate a generate request into a
 * scheduler request (every bad argument is bad_request naming the field),
 * hand it to the executor, and encode its streamed events and final reply
 * as frames for the server to write. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "exec.h"
#include "gen_request.h"
#include "models.h"
#include "ops.h"
#include "ops_generate.h"
#include "proto.h"
#include "server.h"

/* ---- the msgpack decoder ----------------------------------------------- */

/* What a decoded request points to besides the message itself. */
struct mp_owned {
    uint32_t *tokens;
    struct chat_msg *msgs;
    struct logit_bias *bias;
    json_t *schema;
};

/* A msgpack value as JSON (a JSON Schema sent as a map): NULL with err
 * for what JSON has not (binary, extension, non-string keys, a string
 * that is not UTF-8, a float that is not finite). The codec bounded the
 * depth (16) and the sizes. */
static json_t *mp_to_json(const msgpack_object *o, struct kvd_error *err)
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
        kvd_error_set(err, KVD_EBADREQ, "'json_schema': a string is not UTF-8 (or holds a NUL)");
        return NULL;
    case MSGPACK_OBJECT_ARRAY:
        if (!(v = json_array()))
            break;
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            json_t *x = mp_to_json(&o->via.array.ptr[i], err);
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
                              "'json_schema': a map key must be a string of under 256 bytes");
                return NULL;
            }
            memcpy(key, k->via.str.ptr, k->via.str.size);
            key[k->via.str.size] = '\0';
            if (json_object_get(v, key)) {
                json_decref(v);
                kvd_error_set(err, KVD_EBADREQ, "'json_schema': the key '%.60s' is given twice",
                              key);
                return NULL;
            }
            json_t *x = mp_to_json(&o->via.map.ptr[i].val, err);
            if (!x || json_object_set_new(v, key, x)) {
                json_decref(v);
                if (x) /* set_new refused the key: not UTF-8 */
                    kvd_error_set(err, KVD_EBADREQ, "'json_schema': a key is not UTF-8");
                return NULL;
            }
        }
        return v;
    default:
        break;
    }
    if (err->code == 0)
        kvd_error_set(err, KVD_EBADREQ,
                      "'json_schema' holds a value JSON has not (binary, extension, a float "
                      "that is not finite)");
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
    if (!(own->schema = mp_to_json(o, err)))
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

/* `messages`: [{role, content}] as NUL-terminated copies (one allocation). */
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
            const char *s;
            size_t len;
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
    return rc;
}

/* ---- encoding ----------------------------------------------------------- */

/* "logprobs": one {"id", "logprob", "top": [[id, logprob], ...]} per token
 * of lp (n tokens, 1 + top entries each). */
static int pack_logprobs(msgpack_packer *pk, const struct sampler_logprob *lp, uint32_t top,
                         size_t n)
{
    int rc = proto_pack_str(pk, "logprobs");
    rc = rc ? rc : proto_pack_array(pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        const struct sampler_logprob *e = lp + i * (1 + (size_t)top);
        rc = proto_pack_map(pk, 3);
        rc = rc ? rc : proto_pack_kv_uint(pk, "id", e[0].id);
        rc = rc ? rc : proto_pack_kv_double(pk, "logprob", e[0].logprob);
        rc = rc ? rc : proto_pack_str(pk, "top");
        rc = rc ? rc : proto_pack_array(pk, top);
        for (uint32_t k = 1; !rc && k <= top; k++) {
            rc = proto_pack_array(pk, 2);
            rc = rc ? rc : msgpack_pack_uint32(pk, e[k].id);
            rc = rc ? rc : msgpack_pack_double(pk, e[k].logprob);
        }
    }
    return rc;
}

int ops_generate_encode_tokens(msgpack_sbuffer *sb, uint64_t id, int64_t choice,
                               const uint32_t *toks, size_t n, const char *text, size_t text_len,
                               const struct sampler_logprob *lp, uint32_t lp_top)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    int rc = proto_event_begin(&pk, id, KVD_EVENT_TOKENS,
                               1 + (choice >= 0) + (text != NULL) + (lp != NULL));
    if (!rc && choice >= 0)
        rc = proto_pack_kv_uint(&pk, "choice", (uint64_t)choice);
    if (!rc)
        rc = proto_pack_kv_u32_array(&pk, "tokens", toks, n);
    if (!rc && text)
        rc = proto_pack_kvn_str(&pk, "text", 4, text, text_len);
    if (!rc && lp)
        rc = pack_logprobs(&pk, lp, lp_top, n);
    if (!rc)
        rc = proto_frame_end(sb, at);
    return rc;
}

static double ms_between(uint64_t a, uint64_t b)
{
    return b > a ? (double)(b - a) / 1e6 : 0.0;
}

int ops_generate_encode_done(msgpack_sbuffer *sb, const struct sched_req *r)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    int rc;
    if (r->finish == SCHED_FINISH_ERROR) {
        rc =
            proto_pack_error(&pk, r->id, r->err.code ? r->err.code : KVD_EINTERNAL, r->err.message);
        return rc ? rc : proto_frame_end(sb, at);
    }
    bool seq = r->seq_returned;
    size_t n_gen = r->n_toks - r->n_prompt;
    uint64_t t_sched = r->t_sched ? r->t_sched : r->t_done;
    uint64_t t_first = r->t_first ? r->t_first : r->t_done;
    const struct sched_session *ss = r->session;
    bool lp = r->lp_on && r->n_lp == n_gen;
    rc = proto_reply_begin(&pk, r->id, 4 + seq + (r->text != NULL) + (ss != NULL) + lp);
    rc = rc ? rc : proto_pack_kv_u32_array(&pk, "tokens", r->toks + r->n_prompt, n_gen);
    if (lp)
        rc = rc ? rc : pack_logprobs(&pk, r->lp, r->lp_top, n_gen);
    if (r->text) {
        size_t tl;
        const char *t = text_out_str(r->text, &tl);
        rc = rc ? rc : proto_pack_kvn_str(&pk, "text", 4, t, tl);
    }
    rc = rc ? rc : proto_pack_kv_str(&pk, "finish_reason", sched_finish_name(r->finish));
    rc = rc ? rc : proto_pack_str(&pk, "usage");
    rc = rc ? rc : proto_pack_map(&pk, 3);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "prompt", r->n_prompt);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "cached", r->n_cached);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "completion", n_gen);
    rc = rc ? rc : proto_pack_str(&pk, "timing");
    rc = rc ? rc : proto_pack_map(&pk, 3);
    rc = rc ? rc : proto_pack_kv_double(&pk, "queue_ms", ms_between(r->t_arrive, t_sched));
    rc = rc ? rc : proto_pack_kv_double(&pk, "ttft_ms", ms_between(r->t_arrive, t_first));
    rc = rc ? rc : proto_pack_kv_double(&pk, "total_ms", ms_between(r->t_arrive, r->t_done));
    if (seq)
        rc = rc ? rc : proto_pack_kv_uint(&pk, "seq", r->seq);
    if (ss) { /* what was saved, or why not (the completion stands either way) */
        rc = rc ? rc : proto_pack_str(&pk, "session");
        rc = rc ? rc : proto_pack_map(&pk, ss->saved ? 5 : 4);
        rc = rc ? rc : proto_pack_kv_str(&pk, "name", ss->name);
        rc = rc ? rc : proto_pack_kv_bool(&pk, "saved", ss->saved);
        if (ss->saved) {
            rc = rc ? rc : proto_pack_kv_uint(&pk, "n_tokens", ss->info.n_tokens);
            rc = rc ? rc : proto_pack_kv_uint(&pk, "blocks", ss->info.blocks);
            rc = rc ? rc : proto_pack_kv_uint(&pk, "expires", ss->info.expires);
        } else {
            rc = rc ? rc : proto_pack_kv_str(&pk, "code", kvd_err_code(ss->err.code));
            rc = rc ? rc : proto_pack_kv_str(&pk, "message", ss->err.message);
        }
    }
    if (rc)
        return KVD_ENOMEM;
    return proto_frame_end(sb, at);
}

/* One choice of a request of several: index, tokens, logprobs, text,
 * finish_reason, and the error of a choice that failed. */
static int pack_choice(msgpack_packer *pk, const struct sched_req *r)
{
    size_t n_gen = r->n_toks > r->n_prompt ? r->n_toks - r->n_prompt : 0;
    bool lp = r->lp_on && r->n_lp == n_gen;
    bool failed = r->finish == SCHED_FINISH_ERROR;
    int rc = proto_pack_map(pk, 3 + lp + (r->text != NULL) + failed);
    rc = rc ? rc : proto_pack_kv_uint(pk, "index", r->choice);
    rc = rc ? rc : proto_pack_kv_u32_array(pk, "tokens", r->toks + r->n_prompt, n_gen);
    if (lp)
        rc = rc ? rc : pack_logprobs(pk, r->lp, r->lp_top, n_gen);
    if (r->text) {
        size_t tl;
        const char *t = text_out_str(r->text, &tl);
        rc = rc ? rc : proto_pack_kvn_str(pk, "text", 4, t, tl);
    }
    rc = rc ? rc : proto_pack_kv_str(pk, "finish_reason", sched_finish_name(r->finish));
    if (failed) {
        rc = rc ? rc : proto_pack_str(pk, "error");
        rc = rc ? rc : proto_pack_map(pk, 2);
        rc = rc ? rc
                : proto_pack_kv_str(pk, "code",
                                    kvd_err_code(r->err.code ? r->err.code : KVD_EINTERNAL));
        rc = rc ? rc : proto_pack_kv_str(pk, "message", r->err.message);
    }
    return rc;
}

int ops_generate_encode_done_group(msgpack_sbuffer *sb, const struct sched_req *const *rs,
                                   uint32_t n)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    const struct sched_req *lead = rs[0];
    uint32_t failed = 0;
    uint64_t completion = 0, t_done = 0;
    for (uint32_t i = 0; i < n; i++) {
        failed += rs[i]->finish == SCHED_FINISH_ERROR;
        completion += rs[i]->n_toks > rs[i]->n_prompt ? rs[i]->n_toks - rs[i]->n_prompt : 0;
        if (rs[i]->t_done > t_done)
            t_done = rs[i]->t_done;
    }
    int rc;
    if (failed == n) { /* all failed (e.g. before the prompt was done): one error */
        rc = proto_pack_error(&pk, lead->id, lead->err.code ? lead->err.code : KVD_EINTERNAL,
                              lead->err.message);
        return rc ? rc : proto_frame_end(sb, at);
    }
    uint64_t t_sched = lead->t_sched ? lead->t_sched : t_done;
    uint64_t t_first = lead->t_first ? lead->t_first : t_done;
    rc = proto_reply_begin(&pk, lead->id, 3);
    rc = rc ? rc : proto_pack_str(&pk, "choices");
    rc = rc ? rc : proto_pack_array(&pk, n);
    for (uint32_t i = 0; !rc && i < n; i++)
        rc = pack_choice(&pk, rs[i]);
    /* the prompt once, every choice's completion */
    rc = rc ? rc : proto_pack_str(&pk, "usage");
    rc = rc ? rc : proto_pack_map(&pk, 3);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "prompt", lead->n_prompt);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "cached", lead->n_cached);
    rc = rc ? rc : proto_pack_kv_uint(&pk, "completion", completion);
    rc = rc ? rc : proto_pack_str(&pk, "timing");
    rc = rc ? rc : proto_pack_map(&pk, 3);
    rc = rc ? rc : proto_pack_kv_double(&pk, "queue_ms", ms_between(lead->t_arrive, t_sched));
    rc = rc ? rc : proto_pack_kv_double(&pk, "ttft_ms", ms_between(lead->t_arrive, t_first));
    rc = rc ? rc : proto_pack_kv_double(&pk, "total_ms", ms_between(lead->t_arrive, t_done));
    if (rc)
        return KVD_ENOMEM;
    return proto_frame_end(sb, at);
}

/* ---- server glue -------------------------------------------------------- */

struct ops_generate {
    struct server *srv;          /* not owned */
    struct models *ms;           /* not owned */
    struct gen_clients *clients; /* owned: requests of other clients (HTTP) */
    struct exec_sink sink;       /* the msgpack connections' requests' */
};

/* The sink: frames built on the executor thread, written by the loop. A
 * frame that cannot be built (no memory) is replaced by a short error so
 * the request still gets its one reply. */
static void post_frame(struct ops_generate *g, const struct sched_req *r, unsigned flags,
                       msgpack_sbuffer *sb, int rc)
{
    if (rc && (flags & SERVER_POST_FINAL)) {
        msgpack_sbuffer_clear(sb);
        rc = proto_frame_error(sb, r->id, KVD_ENOMEM, "out of memory building the reply");
    }
    if (rc) {
        msgpack_sbuffer_destroy(sb);
        return;
    }
    /* server_post takes the malloc'd buffer over, also on failure. */
    size_t len = sb->size;
    void *frame = msgpack_sbuffer_release(sb);
    server_post(g->srv, r->conn, r->id, flags, frame, len);
}

static void sink_tokens(void *ud, const struct sched_req *r, const uint32_t *toks, size_t n)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    const char *text = NULL;
    size_t text_len = 0;
    if (r->text)
        text_len = text_out_take(r->text, &text); /* the executor's thread: it owns r */
    /* toks are r's generated tokens from toks - (r->toks + r->n_prompt) */
    size_t from = (size_t)(toks - (r->toks + r->n_prompt));
    const struct sampler_logprob *lp = NULL;
    if (r->lp_on && from + n <= r->n_lp)
        lp = r->lp + from * (1 + (size_t)r->lp_top);
    int rc = ops_generate_encode_tokens(&sb, r->id, r->group ? (int64_t)r->choice : -1, toks, n,
                                        text, text_len, lp, r->lp_top);
    post_frame(ud, r, 0, &sb, rc);
}

static void sink_done_group(void *ud, const struct sched_req *const *rs, uint32_t n)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    int rc = ops_generate_encode_done_group(&sb, rs, n);
    post_frame(ud, rs[0], SERVER_POST_FINAL, &sb, rc);
}

static void sink_done(void *ud, const struct sched_req *r)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    int rc = ops_generate_encode_done(&sb, r);
    post_frame(ud, r, SERVER_POST_FINAL, &sb, rc);
}

/* The model of a generate: its sequence's (`seq`), else the one it names.
 * A request naming both must name the same. */
static int generate_model(struct ops_ctx *c, struct models_entry **out)
{
    int rc = ops_pick_model(c, out);
    if (rc)
        return rc;
    const msgpack_object *o = proto_map_find(c->req, "seq");
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return 0;
    struct models_entry *e = models_of_handle(c->host->models, o->via.u64);
    if (!e)
        return kvd_error_set(&c->err, KVD_ENOTFOUND, "no sequence %llu",
                             (unsigned long long)o->via.u64);
    if (proto_map_find(c->req, "model") && e != *out)
        return kvd_error_set(&c->err, KVD_EBADREQ,
                             "'model' is %s but sequence %llu belongs to model %s",
                             models_name(*out), (unsigned long long)o->via.u64, models_name(e));
    *out = e;
    return 0;
}

static int op_generate(struct ops_ctx *c)
{
    struct ops_generate *g = c->op_ctx;
    struct models_entry *e = NULL;
    /* max-queued-per-tenant counts choices: n is read first (the build
     * checks its range) */
    uint64_t n = 1;
    int rc = proto_opt_uint(c->req, "n", &n, NULL, &c->err);
    if (rc)
        return rc;
    uint32_t units = n >= 1 && n <= GEN_MAX_CHOICES ? (uint32_t)n : 1;
    /* a resumed request (its model loaded meanwhile) was admitted once */
    if (!c->resumed && (rc = server_queue_admit_n(c->srv, c->conn, c->tenant, units, &c->err)))
        return rc;
    c->pending_units = units; /* also while it waits for its model (ops_defer) */
    if ((rc = generate_model(c, &e)))
        return rc;
    struct exec *ex = models_exec(e);
    if (!ex)
        return ops_defer(c, e, true);
    models_touch(e);
    if ((rc = ops_use_model(c, e)))
        return rc;
    struct gen_caller gc = {
        .conn = c->conn_id, .id = c->id, .tenant = c->tenant, .ns = c->ns, .sink = &g->sink};
    struct gen_limits lim = {.max_text_bytes = server_options(c->srv)->max_text_bytes};
    struct sched_req *r = NULL;
    rc = ops_generate_build(ex, c->mm, c->req, &gc, &lim, &r, &c->err);
    if (rc)
        return rc;
    if ((rc = exec_submit(ex, r)) != 0) {
        gen_request_discard(c->mm, r);
        return kvd_error_set(&c->err, rc, "%s", exec_submit_errmsg(rc));
    }
    return OPS_PENDING;
}

static int op_cancel(struct ops_ctx *c)
{
    struct ops_generate *g = c->op_ctx;
    uint64_t target = 0;
    bool found = false;
    int rc = proto_get_uint(c->req, "target", &target, &c->err);
    if (rc)
        return rc;
    for (size_t i = 0; i < models_count(g->ms) && !found; i++) {
        struct exec *ex = models_exec(models_at(g->ms, i));
        if (ex)
            exec_cancel(ex, c->conn_id, target, &found);
    }
    if (!found) /* waiting for its model to load */
        found = ops_defer_cancel(g->ms, c->conn_id, target);
    rc = proto_reply_begin(c->pk, c->id, 1);
    rc = rc ? rc : proto_pack_kv_bool(c->pk, "cancelled", found);
    return rc ? kvd_error_set(&c->err, KVD_ENOMEM, "out of memory") : 0;
}

static void on_close(void *ctx, uint64_t conn_id)
{
    struct ops_generate *g = ctx;
    models_cancel_owner(g->ms, conn_id);
    for (size_t i = 0; i < models_count(g->ms); i++) {
        struct exec *ex = models_exec(models_at(g->ms, i));
        if (ex)
            exec_cancel_conn(ex, conn_id);
    }
}

static void on_abort(void *ctx, uint64_t conn_id, int code, const char *msg)
{
    struct ops_generate *g = ctx;
    for (size_t i = 0; i < models_count(g->ms); i++) {
        struct exec *ex = models_exec(models_at(g->ms, i));
        if (ex)
            exec_abort_conn(ex, conn_id, code, msg);
    }
}

static void on_drain(void *ctx)
{
    struct ops_generate *g = ctx;
    models_drain(g->ms);
}

int ops_generate_start(struct server *srv, struct models *ms, struct ops_generate **out,
                       struct kvd_error *err)
{
    struct ops_generate *g = calloc(1, sizeof(*g));
    if (!g)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    g->srv = srv;
    g->ms = ms;
    g->sink = (struct exec_sink){
        .ud = g, .tokens = sink_tokens, .done = sink_done, .done_group = sink_done_group};
    int rc = gen_clients_new(srv, ms, &g->clients);
    if (rc) {
        kvd_error_set(err, rc, "out of memory");
        goto fail;
    }
    if ((rc = server_op_register(srv, KVD_OP_GENERATE, op_generate, g, 0)) ||
        (rc = server_op_register(srv, KVD_OP_CANCEL, op_cancel, g, 0)) ||
        (rc = server_on_close(srv, on_close, g)) || (rc = server_on_drain(srv, on_drain, g)) ||
        (rc = server_on_abort(srv, on_abort, g))) {
        kvd_error_set(err, rc, "cannot register the generate ops");
        goto fail;
    }
    *out = g;
    return 0;
fail:
    gen_clients_free(g->clients);
    free(g);
    return rc;
}

struct gen_clients *ops_generate_clients(struct ops_generate *g)
{
    return g ? g->clients : NULL;
}

void ops_generate_release_loop(struct ops_generate *g)
{
    if (g)
        gen_clients_release_loop(g->clients);
}

void ops_generate_stop(struct ops_generate *g)
{
    if (!g)
        return;
    gen_clients_free(g->clients); /* after the executors: nothing posts any more */
    free(g);
}

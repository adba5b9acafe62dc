/* libkvd typed helpers: one function per op of the protocol, each building
 * its request with the generic kvd_send() and reading the reply's fields
 * into C structs, so programs never touch msgpack. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "libkvd_int.h"

/* ---- reading reply fields ------------------------------------------------- */

static int bad_reply(struct kvd_ctx *ctx, const struct kvd_reply *r, const char *key,
                     const char *want)
{
    return kvd_set_err(ctx, KVD_EINTERNAL, "kvd's reply to request %" PRIu64 " has no %s \"%s\"",
                       r->id, want, key);
}

int kvd_reply_u64(struct kvd_ctx *ctx, const struct kvd_reply *r, const char *key, uint64_t *out)
{
    if (kvd_value_u64(kvd_value_path(r->body, key), out))
        return bad_reply(ctx, r, key, "unsigned integer");
    return 0;
}

/* Tier names as the protocol writes them. */
static int8_t tier_of(const struct kvd_value *v)
{
    uint64_t u;
    if (v && v->type == KVD_T_STR)
        return (int8_t)proto_tier_from_name(v->v.str.ptr, v->v.str.len);
    if (!kvd_value_u64(v, &u) && u <= 1)
        return (int8_t)u;
    return -1;
}

/* Accepts [id, ...], [{"id", "tier"}, ...] or [[id, tier], ...]. */
int kvd_reply_blocks(struct kvd_ctx *ctx, const struct kvd_value *arr, struct kvd_blocks *out)
{
    size_t n;
    bool tiers = false;

    memset(out, 0, sizeof(*out));
    if (!arr || arr->type != KVD_T_ARRAY)
        return kvd_set_err(ctx, KVD_EINTERNAL, "kvd's reply has no \"blocks\" array");
    n = arr->v.array.n;
    if (!n)
        return 0;
    out->ids = malloc(n * sizeof(*out->ids));
    out->tiers = malloc(n * sizeof(*out->tiers));
    if (!out->ids || !out->tiers) {
        kvd_blocks_free(out);
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading %zu blocks", n);
    }
    for (size_t i = 0; i < n; i++) {
        const struct kvd_value *e = &arr->v.array.items[i];
        const struct kvd_value *id = e, *tier = NULL;
        uint64_t u;
        if (e->type == KVD_T_MAP) {
            id = kvd_value_get(e, "id");
            tier = kvd_value_get(e, "tier");
        } else if (e->type == KVD_T_ARRAY && e->v.array.n == 2) {
            id = &e->v.array.items[0];
            tier = &e->v.array.items[1];
        }
        if (kvd_value_u64(id, &u) || u > UINT32_MAX) {
            kvd_blocks_free(out);
            return kvd_set_err(ctx, KVD_EINTERNAL, "kvd's reply has a malformed block %zu", i);
        }
        out->ids[i] = (uint32_t)u;
        out->tiers[i] = tier_of(tier);
        tiers |= tier != NULL;
    }
    out->n = n;
    if (!tiers) {
        free(out->tiers);
        out->tiers = NULL;
    }
    return 0;
}

void kvd_blocks_free(struct kvd_blocks *b)
{
    if (!b)
        return;
    free(b->ids);
    free(b->tiers);
    memset(b, 0, sizeof(*b));
}

static void copy_str(char *dst, size_t cap, const struct kvd_value *v)
{
    const char *s = kvd_value_str(v);
    snprintf(dst, cap, "%s", s ? s : "");
}

/* A call whose reply is read by the caller; frees nothing on failure. */
static int call(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n,
                struct kvd_reply **out)
{
    int rc = kvd_call(ctx, op, args, n, out);
    if (rc && *out) {
        kvd_reply_free(*out);
        *out = NULL;
    }
    return rc;
}

/* kvd_wait() that frees a failed reply. */
static int call_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_reply **out)
{
    int rc = kvd_wait(ctx, id, out);
    if (rc && *out) {
        kvd_reply_free(*out);
        *out = NULL;
    }
    return rc;
}

/* A call whose reply carries nothing the caller needs. */
static int call_void(struct kvd_ctx *ctx, const char *op, const struct kvd_arg *args, size_t n)
{
    return kvd_call(ctx, op, args, n, NULL);
}

/* ---- hello, stats ---------------------------------------------------------- */

int kvd_hello(struct kvd_ctx *ctx, struct kvd_hello_info *out)
{
    struct kvd_arg args[] = {KVD_ARG_U("version", KVD_PROTOCOL_VERSION),
                             KVD_ARG_S("client", "libkvd " KVD_VERSION_STRING)};
    struct kvd_reply *r = NULL;
    const struct kvd_value *b, *model;
    uint64_t u;
    int rc;

    memset(out, 0, sizeof(*out));
    if ((rc = call(ctx, KVD_OP_HELLO, args, 2, &r)))
        return rc;
    b = r->body;
    copy_str(out->server, sizeof(out->server), kvd_value_get(b, "server"));
    copy_str(out->tenant, sizeof(out->tenant), kvd_value_get(b, "tenant"));
    copy_str(out->backend, sizeof(out->backend), kvd_value_get(b, "backend"));
    copy_str(out->dtype, sizeof(out->dtype), kvd_value_path(b, "kv.dtype"));
    if ((rc = kvd_reply_u64(ctx, r, "version", &u)))
        goto out;
    out->version = (uint32_t)u;
    if ((rc = kvd_reply_u64(ctx, r, "block_tokens", &u)))
        goto out;
    out->block_tokens = (uint32_t)u;
    if ((rc = kvd_reply_u64(ctx, r, "kv.layers", &u)))
        goto out;
    out->layers = (uint32_t)u;
    if ((rc = kvd_reply_u64(ctx, r, "kv.kv_heads", &u)))
        goto out;
    out->kv_heads = (uint32_t)u;
    if ((rc = kvd_reply_u64(ctx, r, "kv.head_dim", &u)))
        goto out;
    out->head_dim = (uint32_t)u;
    if ((rc = kvd_reply_u64(ctx, r, "kv.block_bytes", &out->block_bytes)))
        goto out;
    out->token_bytes = out->block_tokens ? out->block_bytes / out->block_tokens : 0;
    model = kvd_value_get(b, "model");
    if (model && model->type == KVD_T_MAP) {
        out->has_model = true;
        copy_str(out->model, sizeof(out->model), kvd_value_get(model, "name"));
        if (!kvd_value_u64(kvd_value_get(model, "vocab"), &u))
            out->vocab = (uint32_t)u;
        if (!kvd_value_u64(kvd_value_get(model, "context"), &u))
            out->context = (uint32_t)u;
        copy_str(out->tokenizer, sizeof(out->tokenizer), kvd_value_get(model, "tokenizer"));
        if ((out->has_bos = !kvd_value_u64(kvd_value_get(model, "bos"), &u)))
            out->bos = (uint32_t)u;
        if ((out->has_eos = !kvd_value_u64(kvd_value_get(model, "eos"), &u)))
            out->eos = (uint32_t)u;
        const struct kvd_value *eog = kvd_value_get(model, "eog");
        for (size_t i = 0; eog && eog->type == KVD_T_ARRAY && i < eog->v.array.n &&
                           out->n_eog < sizeof(out->eog) / sizeof(out->eog[0]);
             i++)
            if (!kvd_value_u64(&eog->v.array.items[i], &u))
                out->eog[out->n_eog++] = (uint32_t)u;
        const struct kvd_value *ct = kvd_value_get(model, "chat_template");
        out->has_chat_template = ct && ct->type == KVD_T_BOOL && ct->v.b;
    }
out:
    kvd_reply_free(r);
    return rc;
}

int kvd_stats(struct kvd_ctx *ctx, struct kvd_reply **out)
{
    *out = NULL;
    return call(ctx, KVD_OP_STATS, NULL, 0, out);
}

int kvd_stats_summary(struct kvd_ctx *ctx, struct kvd_stats_summary *out)
{
    static const struct {
        const char *path;
        size_t off;
    } fields[] = {
#define F(path, field) {path, offsetof(struct kvd_stats_summary, field)}
        F("device.total", device_total),
        F("device.free", device_free),
        F("device.cached", device_cached),
        F("device.used", device_used),
        F("host.total", host_total),
        F("host.free", host_free),
        F("host.cached", host_cached),
        F("host.used", host_used),
        F("counters.match_tokens_asked", match_tokens_asked),
        F("counters.match_tokens_hit", match_tokens_hit),
        F("counters.swaps_out", swaps_out),
        F("counters.swaps_in", swaps_in),
        F("counters.evictions", evictions),
        F("connections", connections),
        F("in_flight", in_flight),
#undef F
    };
    struct kvd_reply *r = NULL;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = call(ctx, KVD_OP_STATS, NULL, 0, &r)))
        return rc;
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
        kvd_value_u64(kvd_value_path(r->body, fields[i].path),
                      (uint64_t *)((char *)out + fields[i].off));
    kvd_reply_free(r);
    return 0;
}

int kvd_stats_json(struct kvd_ctx *ctx, char **json)
{
    struct kvd_reply *r = NULL;
    int rc;
    *json = NULL;
    if ((rc = call(ctx, KVD_OP_STATS, NULL, 0, &r)))
        return rc;
    *json = kvd_value_json(r->body);
    kvd_reply_free(r);
    if (!*json)
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory printing stats as JSON");
    return 0;
}

/* ---- block API ------------------------------------------------------------- */

int kvd_seq_open(struct kvd_ctx *ctx, const char *ns, uint64_t *seq)
{
    struct kvd_arg a = KVD_ARG_S("namespace", ns);
    struct kvd_reply *r = NULL;
    int rc = call(ctx, KVD_OP_SEQ_OPEN, &a, ns ? 1 : 0, &r);
    if (rc)
        return rc;
    rc = kvd_reply_u64(ctx, r, "seq", seq);
    kvd_reply_free(r);
    return rc;
}

int kvd_seq_match(struct kvd_ctx *ctx, uint64_t seq, const uint32_t *tokens, size_t n,
                  size_t *matched, struct kvd_blocks *blocks)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U32S("tokens", tokens, n)};
    struct kvd_reply *r = NULL;
    uint64_t m = 0;
    int rc;
    if (blocks)
        memset(blocks, 0, sizeof(*blocks));
    if ((rc = call(ctx, KVD_OP_SEQ_MATCH, args, 2, &r)))
        return rc;
    rc = kvd_reply_u64(ctx, r, "matched", &m);
    if (!rc && matched)
        *matched = (size_t)m;
    if (!rc && blocks)
        rc = kvd_reply_blocks(ctx, kvd_value_get(r->body, "blocks"), blocks);
    kvd_reply_free(r);
    return rc;
}

int kvd_seq_extend(struct kvd_ctx *ctx, uint64_t seq, size_t n, struct kvd_blocks *blocks)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U("n", n)};
    struct kvd_reply *r = NULL;
    int rc;
    if (blocks)
        memset(blocks, 0, sizeof(*blocks));
    if ((rc = call(ctx, KVD_OP_SEQ_EXTEND, args, 2, &r)))
        return rc;
    if (blocks)
        rc = kvd_reply_blocks(ctx, kvd_value_get(r->body, "blocks"), blocks);
    kvd_reply_free(r);
    return rc;
}

int kvd_kv_write(struct kvd_ctx *ctx, uint64_t seq, size_t start, size_t n, const void *data,
                 size_t len)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U("start", start), KVD_ARG_U("n", n),
                             KVD_ARG_BIN("data", data, len)};
    return call_void(ctx, KVD_OP_KV_WRITE, args, 4);
}

int kvd_kv_read(struct kvd_ctx *ctx, uint64_t seq, size_t start, size_t n, void *buf, size_t cap,
                size_t *len)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U("start", start), KVD_ARG_U("n", n)};
    struct kvd_reply *r = NULL;
    const struct kvd_value *d;
    int rc;
    *len = 0;
    if ((rc = call(ctx, KVD_OP_KV_READ, args, 3, &r)))
        return rc;
    d = kvd_value_get(r->body, "data");
    if (!d || d->type != KVD_T_BIN) {
        rc = bad_reply(ctx, r, "data", "bin");
    } else if (d->v.bin.len > cap) {
        rc = kvd_set_err(ctx, KVD_ETOOLARGE, "kv_read returned %zu bytes, buffer holds %zu",
                         d->v.bin.len, cap);
    } else {
        if (d->v.bin.len)
            memcpy(buf, d->v.bin.ptr, d->v.bin.len);
        *len = d->v.bin.len;
    }
    kvd_reply_free(r);
    return rc;
}

int kvd_seq_commit(struct kvd_ctx *ctx, uint64_t seq, const uint32_t *tokens, size_t n,
                   size_t *shared)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U32S("tokens", tokens, n)};
    struct kvd_reply *r = NULL;
    uint64_t s = 0;
    int rc;
    if ((rc = call(ctx, KVD_OP_SEQ_COMMIT, args, 2, &r)))
        return rc;
    rc = kvd_reply_u64(ctx, r, "shared", &s);
    if (!rc && shared)
        *shared = (size_t)s;
    kvd_reply_free(r);
    return rc;
}

int kvd_seq_fork(struct kvd_ctx *ctx, uint64_t seq, uint64_t *child)
{
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    struct kvd_reply *r = NULL;
    int rc;
    if ((rc = call(ctx, KVD_OP_SEQ_FORK, &a, 1, &r)))
        return rc;
    rc = kvd_reply_u64(ctx, r, "seq", child);
    kvd_reply_free(r);
    return rc;
}

int kvd_seq_info(struct kvd_ctx *ctx, uint64_t seq, struct kvd_seq_info *out)
{
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    struct kvd_reply *r = NULL;
    const struct kvd_value *tiers;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = call(ctx, KVD_OP_SEQ_INFO, &a, 1, &r)))
        return rc;
    if ((rc = kvd_reply_u64(ctx, r, "n_tokens", &out->n_tokens)))
        goto out;
    /* Optional counters: older daemons may not send them. */
    kvd_value_u64(kvd_value_get(r->body, "n_committed"), &out->n_committed);
    kvd_value_u64(kvd_value_get(r->body, "shared"), &out->n_shared);
    if ((rc = kvd_reply_blocks(ctx, kvd_value_get(r->body, "blocks"), &out->blocks)))
        goto out;
    /* Tiers may also come as a parallel array of names. */
    tiers = kvd_value_get(r->body, "tiers");
    if (tiers && tiers->type == KVD_T_ARRAY && tiers->v.array.n == out->blocks.n && out->blocks.n &&
        !out->blocks.tiers) {
        out->blocks.tiers = malloc(out->blocks.n * sizeof(*out->blocks.tiers));
        if (!out->blocks.tiers) {
            rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading block tiers");
            goto out;
        }
        for (size_t i = 0; i < out->blocks.n; i++)
            out->blocks.tiers[i] = tier_of(&tiers->v.array.items[i]);
    }
out:
    if (rc)
        kvd_seq_info_free(out);
    kvd_reply_free(r);
    return rc;
}

void kvd_seq_info_free(struct kvd_seq_info *info)
{
    if (info)
        kvd_blocks_free(&info->blocks);
}

int kvd_seq_offload(struct kvd_ctx *ctx, uint64_t seq)
{
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    return call_void(ctx, KVD_OP_SEQ_OFFLOAD, &a, 1);
}

int kvd_seq_restore(struct kvd_ctx *ctx, uint64_t seq)
{
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    return call_void(ctx, KVD_OP_SEQ_RESTORE, &a, 1);
}

int kvd_seq_close(struct kvd_ctx *ctx, uint64_t seq)
{
    struct kvd_arg a = KVD_ARG_U("seq", seq);
    return call_void(ctx, KVD_OP_SEQ_CLOSE, &a, 1);
}

/* ---- generate, cancel -------------------------------------------------------- */

void kvd_gen_opts_init(struct kvd_gen_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->temperature = -1.0f;
    o->top_k = -1;
    o->top_p = -1.0f;
}

/* The tokens (and text) of a "tokens" event, handed to the caller's
 * callbacks. */
static int gen_on_event(struct kvd_ctx *ctx, uint64_t id, const struct kvd_value *ev, void *user)
{
    const struct kvd_gen_opts *o = user;
    const struct kvd_value *t = kvd_value_get(ev, "tokens");
    const struct kvd_value *tx = kvd_value_get(ev, "text");
    uint32_t stackbuf[256];
    uint32_t *toks = stackbuf;
    int stop = 0;

    if (!t || t->type != KVD_T_ARRAY)
        return 0; /* other events: nothing to do */
    if (t->v.array.n > sizeof(stackbuf) / sizeof(stackbuf[0])) {
        toks = malloc(t->v.array.n * sizeof(*toks));
        if (!toks)
            return 0;
    }
    for (size_t i = 0; i < t->v.array.n; i++) {
        uint64_t u = 0;
        kvd_value_u64(&t->v.array.items[i], &u);
        toks[i] = (uint32_t)u;
    }
    if (o->on_tokens)
        stop = o->on_tokens(o->user, toks, t->v.array.n);
    if (!stop && o->on_text && tx && tx->type == KVD_T_STR)
        stop = o->on_text(o->user, toks, t->v.array.n, tx->v.str.ptr, tx->v.str.len);
    if (toks != stackbuf)
        free(toks);
    return stop;
}

/* `stop` with strings: one array of ids and strings, packed here. */
static int pack_stop(const struct kvd_gen_opts *o, msgpack_sbuffer *sb)
{
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    int rc = msgpack_pack_array(&pk, o->n_stop + o->n_stop_strs);
    for (size_t i = 0; !rc && i < o->n_stop; i++)
        rc = msgpack_pack_uint32(&pk, o->stop[i]);
    for (size_t i = 0; !rc && i < o->n_stop_strs; i++) {
        size_t len = strlen(o->stop_strs[i]);
        rc = msgpack_pack_str(&pk, len);
        rc = rc ? rc : msgpack_pack_str_body(&pk, o->stop_strs[i], len);
    }
    return rc ? KVD_ENOMEM : 0;
}

/* A generate with `prompt` (tokens, text or messages; none: seq alone). */
static int gen_send(struct kvd_ctx *ctx, const struct kvd_arg *prompt,
                    const struct kvd_gen_opts *opts, uint64_t *id)
{
    struct kvd_gen_opts defaults;
    struct kvd_arg args[16];
    size_t na = 0;
    msgpack_sbuffer stop;
    int rc;

    msgpack_sbuffer_init(&stop);
    if (!opts) {
        kvd_gen_opts_init(&defaults);
        opts = &defaults;
    }
    bool stream = opts->on_tokens || opts->on_text;
    if (opts->use_seq)
        args[na++] = KVD_ARG_U("seq", opts->seq);
    if (prompt)
        args[na++] = *prompt;
    if (opts->max_tokens)
        args[na++] = KVD_ARG_U("max_tokens", opts->max_tokens);
    if (opts->temperature >= 0)
        args[na++] = KVD_ARG_F("temperature", opts->temperature);
    if (opts->top_k >= 0)
        args[na++] = KVD_ARG_U("top_k", (uint64_t)opts->top_k);
    if (opts->top_p >= 0)
        args[na++] = KVD_ARG_F("top_p", opts->top_p);
    if (opts->has_seed)
        args[na++] = KVD_ARG_U("seed", opts->seed);
    if (opts->n_stop_strs) {
        if ((rc = pack_stop(opts, &stop))) {
            msgpack_sbuffer_destroy(&stop);
            return kvd_set_err(ctx, rc, "out of memory packing 'stop'");
        }
        args[na++] = KVD_ARG_RAW("stop", stop.data, stop.size);
    } else if (opts->n_stop) {
        args[na++] = KVD_ARG_U32S("stop", opts->stop, opts->n_stop);
    }
    if (opts->ignore_eos)
        args[na++] = KVD_ARG_B("ignore_eos", true);
    if (stream)
        args[na++] = KVD_ARG_B("stream", true);
    if (opts->priority)
        args[na++] = KVD_ARG_I("priority", opts->priority);
    if (opts->session)
        args[na++] = KVD_ARG_S("session", opts->session);
    if (opts->session && opts->session_ttl_s)
        args[na++] = KVD_ARG_U("session_ttl_s", opts->session_ttl_s);
    /* The callback's user pointer is opts itself: a caller's opts outlive the
     * wait (documented); the defaults above never stream. */
    rc = kvd_send(ctx, KVD_OP_GENERATE, args, na, stream ? gen_on_event : NULL,
                  stream ? (void *)opts : NULL, id);
    msgpack_sbuffer_destroy(&stop);
    return rc;
}

int kvd_generate_send(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n,
                      const struct kvd_gen_opts *opts, uint64_t *id)
{
    struct kvd_arg toks = KVD_ARG_U32S("tokens", tokens, n);
    bool seq_alone = !tokens && opts && (opts->use_seq || opts->session);
    return gen_send(ctx, seq_alone ? NULL : &toks, opts, id);
}

int kvd_generate_text_send(struct kvd_ctx *ctx, const char *text, const struct kvd_gen_opts *opts,
                           uint64_t *id)
{
    struct kvd_arg a = KVD_ARG_S("text", text);
    return gen_send(ctx, &a, opts, id);
}

int kvd_chat_send(struct kvd_ctx *ctx, const struct kvd_chat_msg *msgs, size_t n,
                  const struct kvd_gen_opts *opts, uint64_t *id)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    int rc = msgpack_pack_array(&pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        rc = msgpack_pack_map(&pk, 2);
        const char *kv[4] = {"role", msgs[i].role ? msgs[i].role : "", "content",
                             msgs[i].content ? msgs[i].content : ""};
        for (int k = 0; !rc && k < 4; k++) {
            size_t len = strlen(kv[k]);
            rc = msgpack_pack_str(&pk, len);
            rc = rc ? rc : msgpack_pack_str_body(&pk, kv[k], len);
        }
    }
    if (rc) {
        msgpack_sbuffer_destroy(&sb);
        return kvd_set_err(ctx, KVD_ENOMEM, "out of memory packing 'messages'");
    }
    struct kvd_arg a = KVD_ARG_RAW("messages", sb.data, sb.size);
    rc = gen_send(ctx, &a, opts, id);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

int kvd_generate_wait(struct kvd_ctx *ctx, uint64_t id, struct kvd_gen_result *out)
{
    struct kvd_reply *r = NULL;
    const struct kvd_value *t;
    uint64_t u;
    double d;
    int rc;

    memset(out, 0, sizeof(*out));
    if ((rc = call_wait(ctx, id, &r)))
        return rc;
    t = kvd_value_get(r->body, "tokens");
    if (!t || t->type != KVD_T_ARRAY) {
        rc = bad_reply(ctx, r, "tokens", "array");
        goto out;
    }
    if (t->v.array.n) {
        out->tokens = malloc(t->v.array.n * sizeof(*out->tokens));
        if (!out->tokens) {
            rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading %zu tokens", t->v.array.n);
            goto out;
        }
    }
    for (size_t i = 0; i < t->v.array.n; i++) {
        if (kvd_value_u64(&t->v.array.items[i], &u) || u > UINT32_MAX) {
            rc = bad_reply(ctx, r, "tokens", "token-id array");
            goto out;
        }
        out->tokens[i] = (uint32_t)u;
    }
    out->n_tokens = t->v.array.n;
    copy_str(out->finish_reason, sizeof(out->finish_reason),
             kvd_value_get(r->body, "finish_reason"));
    if (!kvd_value_u64(kvd_value_path(r->body, "usage.prompt"), &u))
        out->prompt_tokens = (uint32_t)u;
    if (!kvd_value_u64(kvd_value_path(r->body, "usage.cached"), &u))
        out->cached_tokens = (uint32_t)u;
    if (!kvd_value_u64(kvd_value_path(r->body, "usage.completion"), &u))
        out->completion_tokens = (uint32_t)u;
    if (!kvd_value_f64(kvd_value_path(r->body, "timing.queue_ms"), &d))
        out->queue_ms = d;
    if (!kvd_value_f64(kvd_value_path(r->body, "timing.ttft_ms"), &d))
        out->ttft_ms = d;
    if (!kvd_value_f64(kvd_value_path(r->body, "timing.total_ms"), &d))
        out->total_ms = d;
    out->session_saved = -1;
    const struct kvd_value *sv = kvd_value_get(r->body, "session");
    if (sv) {
        const struct kvd_value *saved = kvd_value_get(sv, "saved");
        out->session_saved = saved && saved->type == KVD_T_BOOL && saved->v.b;
        if (!kvd_value_u64(kvd_value_get(sv, "n_tokens"), &u))
            out->session_tokens = (uint32_t)u;
        if (!kvd_value_u64(kvd_value_get(sv, "expires"), &u))
            out->session_expires = u;
        copy_str(out->session_error, sizeof(out->session_error), kvd_value_get(sv, "message"));
    }
    t = kvd_value_get(r->body, "text");
    if (t && t->type == KVD_T_STR) {
        out->text = malloc(t->v.str.len + 1);
        if (!out->text) {
            rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading the text");
            goto out;
        }
        memcpy(out->text, t->v.str.ptr, t->v.str.len);
        out->text[t->v.str.len] = 0;
        out->text_len = t->v.str.len;
    }
out:
    if (rc)
        kvd_gen_result_free(out);
    kvd_reply_free(r);
    return rc;
}

int kvd_generate(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n,
                 const struct kvd_gen_opts *opts, struct kvd_gen_result *out)
{
    uint64_t id;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = kvd_generate_send(ctx, tokens, n, opts, &id)))
        return rc;
    return kvd_generate_wait(ctx, id, out);
}

void kvd_gen_result_free(struct kvd_gen_result *r)
{
    if (!r)
        return;
    free(r->tokens);
    r->tokens = NULL;
    r->n_tokens = 0;
    free(r->text);
    r->text = NULL;
    r->text_len = 0;
}

int kvd_generate_text(struct kvd_ctx *ctx, const char *text, const struct kvd_gen_opts *opts,
                      struct kvd_gen_result *out)
{
    uint64_t id;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = kvd_generate_text_send(ctx, text, opts, &id)))
        return rc;
    return kvd_generate_wait(ctx, id, out);
}

int kvd_chat(struct kvd_ctx *ctx, const struct kvd_chat_msg *msgs, size_t n,
             const struct kvd_gen_opts *opts, struct kvd_gen_result *out)
{
    uint64_t id;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = kvd_chat_send(ctx, msgs, n, opts, &id)))
        return rc;
    return kvd_generate_wait(ctx, id, out);
}

/* ---- tokenize, detokenize --------------------------------------------------- */

int kvd_tokenize(struct kvd_ctx *ctx, const char *text, bool special, int add_bos,
                 uint32_t **tokens, size_t *n)
{
    struct kvd_arg args[3] = {KVD_ARG_S("text", text), KVD_ARG_B("special", special),
                              KVD_ARG_B("add_bos", add_bos > 0)};
    struct kvd_reply *r = NULL;
    *tokens = NULL;
    *n = 0;
    int rc = call(ctx, KVD_OP_TOKENIZE, args, add_bos < 0 ? 2 : 3, &r);
    if (rc)
        return rc;
    const struct kvd_value *t = kvd_value_get(r->body, "tokens");
    if (!t || t->type != KVD_T_ARRAY) {
        rc = bad_reply(ctx, r, "tokens", "array");
        goto out;
    }
    *tokens = malloc((t->v.array.n ? t->v.array.n : 1) * sizeof(**tokens));
    if (!*tokens) {
        rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading %zu tokens", t->v.array.n);
        goto out;
    }
    for (size_t i = 0; i < t->v.array.n; i++) {
        uint64_t u;
        if (kvd_value_u64(&t->v.array.items[i], &u) || u > UINT32_MAX) {
            rc = bad_reply(ctx, r, "tokens", "token-id array");
            free(*tokens);
            *tokens = NULL;
            goto out;
        }
        (*tokens)[i] = (uint32_t)u;
    }
    *n = t->v.array.n;
out:
    kvd_reply_free(r);
    return rc;
}

int kvd_detokenize(struct kvd_ctx *ctx, const uint32_t *tokens, size_t n, bool special, char **text)
{
    struct kvd_arg args[2] = {KVD_ARG_U32S("tokens", tokens, n), KVD_ARG_B("special", special)};
    struct kvd_reply *r = NULL;
    *text = NULL;
    int rc = call(ctx, KVD_OP_DETOKENIZE, args, 2, &r);
    if (rc)
        return rc;
    const struct kvd_value *t = kvd_value_get(r->body, "text");
    if (!t || t->type != KVD_T_STR) {
        rc = bad_reply(ctx, r, "text", "string");
    } else if (!(*text = malloc(t->v.str.len + 1))) {
        rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory reading the text");
    } else {
        memcpy(*text, t->v.str.ptr, t->v.str.len);
        (*text)[t->v.str.len] = 0;
    }
    kvd_reply_free(r);
    return rc;
}

int kvd_cancel(struct kvd_ctx *ctx, uint64_t target)
{
    struct kvd_arg a = KVD_ARG_U("target", target);
    return call_void(ctx, KVD_OP_CANCEL, &a, 1);
}

/* ---- admin ---------------------------------------------------------------- */

int kvd_admin_evict(struct kvd_ctx *ctx, const char *tier, uint64_t n, struct kvd_reply **out)
{
    struct kvd_arg a[2];
    struct kvd_reply *r = NULL;
    size_t na = 0;
    int rc;
    if (tier)
        a[na++] = KVD_ARG_S("tier", tier);
    if (n)
        a[na++] = KVD_ARG_U("n", n);
    rc = kvd_call(ctx, KVD_OP_ADMIN_EVICT, a, na, &r);
    if (out)
        *out = r;
    else
        kvd_reply_free(r);
    return rc;
}

int kvd_admin_check(struct kvd_ctx *ctx, struct kvd_reply **out)
{
    struct kvd_reply *r = NULL;
    int rc = kvd_call(ctx, KVD_OP_ADMIN_CHECK, NULL, 0, &r);
    if (out)
        *out = r;
    else
        kvd_reply_free(r);
    return rc;
}

int kvd_admin_shutdown(struct kvd_ctx *ctx)
{
    return call_void(ctx, KVD_OP_ADMIN_SHUTDOWN, NULL, 0);
}

/* ---- zero-copy export ------------------------------------------------------ */

static void export_free(struct kvd_export *ex)
{
    if (!ex)
        return;
    for (size_t i = 0; i < ex->n_maps; i++) {
        if (ex->maps[i].addr && ex->maps[i].addr != MAP_FAILED)
            munmap(ex->maps[i].addr, ex->maps[i].len);
        if (ex->maps[i].fd >= 0)
            close(ex->maps[i].fd);
    }
    free(ex->maps);
    free(ex->blocks);
    free(ex);
}

int kvd_kv_export(struct kvd_ctx *ctx, uint64_t seq, size_t from_token, size_t n_tokens,
                  bool writable, struct kvd_export **out)
{
    struct kvd_arg args[] = {KVD_ARG_U("seq", seq), KVD_ARG_U("from_token", from_token),
                             KVD_ARG_U("n_tokens", n_tokens), KVD_ARG_B("writable", writable)};
    struct kvd_reply *r = NULL;
    struct kvd_reply_impl *ri;
    struct kvd_export *ex = NULL;
    const struct kvd_value *bl;
    uint64_t id, nfd, from;
    int rc;

    *out = NULL;
    if ((rc = call(ctx, KVD_OP_KV_EXPORT, args, 4, &r)))
        return rc;
    ri = (struct kvd_reply_impl *)r;
    if ((rc = kvd_reply_u64(ctx, r, "export", &id)) || (rc = kvd_reply_u64(ctx, r, "fds", &nfd)) ||
        (rc = kvd_reply_u64(ctx, r, "from_block", &from)))
        goto out;
    bl = kvd_value_get(r->body, "blocks");
    if (!bl || bl->type != KVD_T_ARRAY) {
        rc = bad_reply(ctx, r, "blocks", "array");
        goto out;
    }
    if (nfd != ri->n_fds) {
        rc = kvd_set_err(ctx, KVD_EINTERNAL,
                         "kv_export announced %" PRIu64 " descriptors, %zu came", nfd, ri->n_fds);
        goto out;
    }
    ex = calloc(1, sizeof *ex);
    if (!ex || !(ex->maps = calloc(nfd ? nfd : 1, sizeof *ex->maps)) ||
        !(ex->blocks = calloc(bl->v.array.n ? bl->v.array.n : 1, sizeof *ex->blocks))) {
        rc = kvd_set_err(ctx, KVD_ENOMEM, "out of memory");
        goto out;
    }
    ex->id = id;
    ex->from_block = from;
    for (size_t i = 0; i < nfd; i++) {
        ex->maps[i].fd = ri->fds[i];
        ri->fds[i] = -1; /* ours now */
        ex->maps[i].addr = NULL;
    }
    ex->n_maps = nfd;
    /* Which pages are writable: any writable block says so for its page. */
    for (size_t i = 0; i < bl->v.array.n; i++) {
        const struct kvd_value *e = &bl->v.array.items[i], *w = kvd_value_get(e, "writable");
        uint64_t fd, off, bytes;
        if (kvd_value_u64(kvd_value_get(e, "fd"), &fd) || fd >= nfd ||
            kvd_value_u64(kvd_value_get(e, "offset"), &off) ||
            kvd_value_u64(kvd_value_get(e, "bytes"), &bytes) || !w || w->type != KVD_T_BOOL) {
            rc = bad_reply(ctx, r, "blocks", "array of {fd, offset, bytes, writable}");
            goto out;
        }
        ex->blocks[i].fd = (unsigned)fd;
        ex->blocks[i].offset = off;
        ex->blocks[i].bytes = (size_t)bytes;
        ex->blocks[i].writable = w->v.b;
        if (w->v.b)
            ex->maps[fd].writable = true;
    }
    ex->n_blocks = bl->v.array.n;
    /* What each descriptor is (a daemon that does not say sends memfds). */
    const struct kvd_value *mp = kvd_value_get(r->body, "maps");
    if (mp && (mp->type != KVD_T_ARRAY || mp->v.array.n != nfd)) {
        rc = bad_reply(ctx, r, "maps", "array of {kind, bytes, writable}, one per descriptor");
        goto out;
    }
    for (size_t i = 0; mp && i < nfd; i++) {
        const struct kvd_value *k = kvd_value_get(&mp->v.array.items[i], "kind");
        uint64_t bytes;
        if (!k || k->type != KVD_T_STR ||
            kvd_value_u64(kvd_value_get(&mp->v.array.items[i], "bytes"), &bytes)) {
            rc = bad_reply(ctx, r, "maps", "array of {kind, bytes, writable}, one per descriptor");
            goto out;
        }
        if (k->v.str.len == 8 && !memcmp(k->v.str.ptr, "cuda_vmm", 8)) {
            ex->maps[i].kind = KVD_EXPORT_CUDA_VMM;
            ex->maps[i].len = (size_t)bytes;
        } else if (!(k->v.str.len == 5 && !memcmp(k->v.str.ptr, "memfd", 5))) {
            rc = kvd_set_err(ctx, KVD_EUNSUPPORTED, "export page %zu: unknown kind '%.*s'", i,
                             (int)k->v.str.len, k->v.str.ptr);
            goto out;
        }
    }
    /* Each memfd page mapped whole (its size from fstat): offsets stay as sent. */
    for (size_t i = 0; i < nfd; i++) {
        struct stat sb;
        struct kvd_export_map *m = &ex->maps[i];
        if (m->kind == KVD_EXPORT_CUDA_VMM)
            continue;
        if (fstat(m->fd, &sb) != 0 || sb.st_size <= 0) {
            rc = kvd_set_err(ctx, KVD_EINTERNAL, "export descriptor %zu: %s", i,
                             strerror(errno ? errno : EINVAL));
            goto out;
        }
        m->len = (size_t)sb.st_size;
        m->addr = mmap(NULL, m->len, PROT_READ | (m->writable ? PROT_WRITE : 0),
                       MAP_SHARED | MAP_POPULATE, m->fd, 0);
        if (m->addr == MAP_FAILED) {
            m->addr = NULL;
            rc = kvd_set_err(ctx, KVD_EINTERNAL, "cannot map export page %zu: %s", i,
                             strerror(errno));
            goto out;
        }
    }
    for (size_t i = 0; i < ex->n_blocks; i++) {
        struct kvd_export_block *b = &ex->blocks[i];
        if (b->offset > ex->maps[b->fd].len || b->bytes > ex->maps[b->fd].len - b->offset) {
            rc = kvd_set_err(ctx, KVD_EINTERNAL, "export block %zu lies outside its page", i);
            goto out;
        }
        b->data = ex->maps[b->fd].addr ? (char *)ex->maps[b->fd].addr + b->offset : NULL;
    }
    *out = ex;
    ex = NULL;
out:
    if (ex) {
        /* Tell the daemon too: it pinned the pages for nothing. */
        struct kvd_arg a = KVD_ARG_U("export", ex->id);
        if (ex->id)
            (void)kvd_call(ctx, KVD_OP_KV_EXPORT_RELEASE, &a, 1, NULL);
        export_free(ex);
    }
    kvd_reply_free(r);
    return rc;
}

int kvd_kv_export_release(struct kvd_ctx *ctx, struct kvd_export *ex)
{
    int rc;
    if (!ex)
        return 0;
    struct kvd_arg a = KVD_ARG_U("export", ex->id);
    rc = call_void(ctx, KVD_OP_KV_EXPORT_RELEASE, &a, 1);
    export_free(ex);
    return rc;
}

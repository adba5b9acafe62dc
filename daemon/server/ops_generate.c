/* The generate and cancel ops: parse and validate a generate request into a
 * scheduler request (every bad argument is bad_request naming the field),
 * hand it to the executor, and encode its streamed events and final reply
 * as frames for the server to write. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "exec.h"
#include "ops.h"
#include "ops_generate.h"
#include "proto.h"
#include "server.h"

#define GEN_DEFAULT_MAX_TOKENS 16u
#define GEN_MAX_TEMPERATURE 1000.0
#define GEN_MAX_PRIORITY 1000000

static uint64_t random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof(s), GRND_NONBLOCK) != (ssize_t)sizeof(s))
        s = sched_now_ns() ^ (uint64_t)(uintptr_t)&s;
    return s;
}

/* Optional numbers with their checks; `what` is the key. */
static int opt_double(const msgpack_object *root, const char *key, double def, double lo,
                      bool lo_open, double hi, double *out, struct kvd_error *err)
{
    bool present = false;
    double v = def;
    int rc = proto_opt_double(root, key, &v, &present, err);
    if (rc)
        return rc;
    if (!isfinite(v) || v < lo || (lo_open && v == lo) || v > hi)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' must be in %c%g, %g]", key,
                             lo_open ? '(' : '[', lo, hi);
    *out = v;
    return 0;
}

/* `stop`: token ids and strings, mixed. Ids end the completion when
 * produced; strings when they appear in its text (the text ends before
 * one). Strings need the tokenizer. Also sets up r->text. */
static int parse_stop(const struct text *tx, const struct model_hparams *hp,
                      const msgpack_object *root, struct sched_req *r, struct kvd_error *err)
{
    const msgpack_object *a = proto_map_find(root, "stop");
    const char *strs[SCHED_MAX_STOP];
    size_t lens[SCHED_MAX_STOP], n_strs = 0;
    if (a && a->type != MSGPACK_OBJECT_NIL) {
        if (a->type != MSGPACK_OBJECT_ARRAY)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "'stop' must be an array of token ids and strings");
        if (a->via.array.size > SCHED_MAX_STOP)
            return kvd_error_set(err, KVD_EBADREQ, "'stop' has %u entries, at most %u",
                                 a->via.array.size, SCHED_MAX_STOP);
        for (uint32_t i = 0; i < a->via.array.size; i++) {
            const msgpack_object *o = &a->via.array.ptr[i];
            if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
                if (o->via.u64 >= hp->n_vocab)
                    return kvd_error_set(err, KVD_EBADREQ,
                                         "'stop'[%u] = %llu is outside the vocabulary (%u)", i,
                                         (unsigned long long)o->via.u64, hp->n_vocab);
                r->stop[r->n_stop++] = (uint32_t)o->via.u64;
            } else if (o->type == MSGPACK_OBJECT_STR) {
                if (o->via.str.size == 0 || o->via.str.size > TEXT_OUT_MAX_STOP_LEN)
                    return kvd_error_set(err, KVD_EBADREQ,
                                         "'stop'[%u]: a stop string must have 1 to %u bytes", i,
                                         TEXT_OUT_MAX_STOP_LEN);
                strs[n_strs] = o->via.str.ptr;
                lens[n_strs++] = o->via.str.size;
            } else {
                return kvd_error_set(err, KVD_EBADREQ, "'stop'[%u] must be a token id or a string",
                                     i);
            }
        }
    }
    const struct tokenizer *tok = text_tokenizer(tx);
    if (n_strs && !tok)
        return kvd_error_set(err, KVD_EUNSUPPORTED, "stop strings need the model's tokenizer: %s",
                             text_no_tokenizer(tx));
    if (!tok)
        return 0;
    int rc = text_out_new(tok, strs, lens, n_strs, &r->text);
    return rc ? kvd_error_set(err, rc, "out of memory") : 0;
}

/* The arguments that do not depend on the sequence. */
static int parse_args(const struct text *tx, const struct model_hparams *hp,
                      const msgpack_object *root, struct sched_req *r, struct kvd_error *err)
{
    int rc;
    bool present = false;
    uint64_t u = GEN_DEFAULT_MAX_TOKENS;
    if ((rc = proto_opt_uint(root, "max_tokens", &u, &present, err)))
        return rc;
    if (u == 0 || u > hp->n_ctx)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'max_tokens' must be in [1, %u] (the model's context)", hp->n_ctx);
    r->max_tokens = (uint32_t)u;

    double temp = 0, top_p = 1;
    if ((rc = opt_double(root, "temperature", 0.0, 0.0, false, GEN_MAX_TEMPERATURE, &temp, err)))
        return rc;
    if ((rc = opt_double(root, "top_p", 1.0, 0.0, true, 1.0, &top_p, err)))
        return rc;
    uint64_t top_k = 0;
    if ((rc = proto_opt_uint(root, "top_k", &top_k, NULL, err)))
        return rc;
    if (top_k > hp->n_vocab)
        return kvd_error_set(err, KVD_EBADREQ, "'top_k' must be in [0, %u] (the vocabulary)",
                             hp->n_vocab);
    uint64_t seed = 0;
    bool has_seed = false;
    if ((rc = proto_opt_uint(root, "seed", &seed, &has_seed, err)))
        return rc;
    struct sampler_params sp = {
        .temperature = (float)temp,
        .top_k = (uint32_t)top_k,
        .top_p = (float)top_p,
        .seed = has_seed ? seed : random_seed(),
    };
    sampler_init(&r->smp, &sp);

    if ((rc = parse_stop(tx, hp, root, r, err)))
        return rc;
    if ((rc = proto_opt_bool(root, "ignore_eos", &r->ignore_eos, NULL, err)))
        return rc;

    if ((rc = proto_opt_bool(root, "stream", &r->stream, NULL, err)))
        return rc;
    int64_t prio = 0;
    if ((rc = proto_opt_int(root, "priority", &prio, NULL, err)))
        return rc;
    if (prio < -GEN_MAX_PRIORITY || prio > GEN_MAX_PRIORITY)
        return kvd_error_set(err, KVD_EBADREQ, "'priority' must be in [%d, %d]", -GEN_MAX_PRIORITY,
                             GEN_MAX_PRIORITY);
    r->priority = (int32_t)prio;
    return 0;
}

/* Seq mode: the connection's sequence becomes the executor's for the
 * request. Its positions must all have token ids (committed), so the
 * executor can recompute them after a preemption and commit after them.
 * The prompt's n_toks tokens are appended to it; with `replace` (a whole
 * conversation) they replace its tokens instead, keeping the longest
 * common prefix: *skip = the prompt tokens the sequence already holds.
 * Caller holds the kvmm lock. */
static int take_seq(struct kvmm *mm, struct sched_req *r, uint64_t seq, const uint32_t *prompt,
                    size_t n_toks, bool replace, size_t *skip, struct kvd_error *err)
{
    struct kvmm_seq_info info;
    *skip = 0;
    int irc = kvmm_seq_info(mm, r->conn, seq, &info);
    if (irc == KVD_EBUSY) /* another generate of this connection has it */
        return kvd_error_set(err, KVD_EBUSY, "'seq': %s", kvmm_errmsg(mm));
    if (irc != 0) /* not_found, like every other op given an unknown handle */
        return kvd_error_set(err, irc == KVD_ENOTFOUND ? KVD_ENOTFOUND : irc,
                             "'seq': no sequence %llu on this connection", (unsigned long long)seq);
    if (info.n_committed != info.n_tokens)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'seq': %zu of its %zu positions have no token ids; commit them first",
                             info.n_tokens - info.n_committed, info.n_tokens);
    size_t n = 0;
    const uint32_t *toks = kvmm_seq_tokens(mm, r->conn, seq, &n);
    if (n != info.n_tokens || (n && !toks))
        return kvd_error_set(err, KVD_EINTERNAL, "'seq': cannot read its tokens");
    size_t keep = n; /* the sequence's tokens that stay */
    if (replace) {
        keep = 0;
        while (keep < n && keep < n_toks && toks[keep] == prompt[keep])
            keep++;
        *skip = keep;
    }
    size_t n_append = n_toks - *skip;
    if (keep + n_append == 0)
        return kvd_error_set(err, KVD_EBADREQ, "the prompt is empty, and 'seq' holds no tokens");
    if (keep + n_append >= r->n_ctx)
        return kvd_error_set(err, KVD_EBADREQ,
                             "the prompt's %zu tokens with the sequence's %zu exceed the model's "
                             "context (%u, at most %u)",
                             n_append, keep, r->n_ctx, r->n_ctx - 1);
    r->toks = malloc((keep + n_append + 64) * sizeof(uint32_t));
    if (!r->toks)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    r->cap_toks = keep + n_append + 64;
    if (keep)
        memcpy(r->toks, toks, keep * sizeof(uint32_t));
    if (keep < n) { /* toks points into the sequence: copied first */
        int rc = kvmm_seq_truncate(mm, r->conn, seq, n - keep);
        if (rc)
            return kvd_error_set(err, rc, "'seq': %s", kvmm_errmsg(mm));
        n = keep;
    }
    r->n_toks = n;
    r->n_kv = n;
    /* With nothing to append, the last position is recomputed for logits. */
    if (n_append == 0) {
        int rc = kvmm_seq_truncate(mm, r->conn, seq, 1);
        if (rc)
            return kvd_error_set(err, rc, "'seq': %s", kvmm_errmsg(mm));
        r->n_kv = n - 1;
    }
    int rc = kvmm_seq_lend(mm, r->conn, seq, sched_req_owner(r), r->id);
    if (rc)
        return kvd_error_set(err, rc, "'seq': %s", kvmm_errmsg(mm));
    r->seq = seq;
    r->have_seq = true;
    r->conn_seq = true;
    r->ns = info.ns;
    r->n_cached = r->n_kv;
    r->n_orig = n; /* the sequence goes back with at least these (scheduler.h) */
    return 0;
}

/* `messages`: [{role, content}] as NUL-terminated copies (one allocation). */
static int parse_messages(const msgpack_object *a, struct chat_msg **out, size_t *n_out,
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

/* The prompt: exactly one of `tokens` (ids), `text` (tokenized with the
 * model's BOS rule, unless it continues a non-empty sequence) and
 * `messages` (rendered with the chat template); none with `seq` alone.
 * *whole: the prompt is a whole conversation (seq: replace, not append). */
static int parse_prompt(struct exec *ex, struct kvmm *mm, const msgpack_object *root, uint64_t conn,
                        bool has_seq, uint64_t seq, uint32_t **toks, size_t *n_toks, bool *whole,
                        struct kvd_error *err)
{
    const struct model_hparams *hp = exec_hparams(ex);
    const struct text *tx = exec_text(ex);
    const msgpack_object *o_text = proto_map_find(root, "text");
    const msgpack_object *o_msgs = proto_map_find(root, "messages");
    bool has_toks = false;
    int rc = proto_opt_u32_array(root, "tokens", KVD_MAX_ARRAY, toks, n_toks, &has_toks, err);
    if (rc)
        return rc;
    *whole = false;
    if (has_toks + (o_text != NULL) + (o_msgs != NULL) > 1)
        return kvd_error_set(err, KVD_EBADREQ, "give one of 'tokens', 'text' and 'messages'");
    if (!has_toks && !o_text && !o_msgs && !has_seq)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'tokens', 'text' or 'messages' is required (or 'seq')");
    char terr[256];
    if (o_text) {
        const char *s;
        size_t len;
        if ((rc = proto_get_str(root, "text", &s, &len, err)))
            return rc;
        int add_bos = -1; /* the model's rule, at the start of a sequence only */
        if (has_seq) {
            struct kvmm_seq_info info;
            kvmm_lock(mm);
            if (kvmm_seq_info(mm, conn, seq, &info) == 0 && info.n_tokens > 0)
                add_bos = 0;
            kvmm_unlock(mm);
        }
        if ((rc = text_tokenize(tx, s, len, add_bos, false, hp->n_ctx, toks, n_toks, terr,
                                sizeof terr)))
            return kvd_error_set(err, rc, "'text': %s", terr);
    } else if (o_msgs) {
        struct chat_msg *msgs;
        size_t n_msgs;
        if ((rc = parse_messages(o_msgs, &msgs, &n_msgs, err)))
            return rc;
        rc = text_tokenize_chat(tx, msgs, n_msgs, hp->n_ctx, toks, n_toks, terr, sizeof terr);
        free(msgs);
        if (rc)
            return kvd_error_set(err, rc, "'messages': %s", terr);
        *whole = true;
    }
    const char *what = has_toks ? "tokens" : o_text ? "text" : "messages";
    if (!has_seq && *n_toks == 0)
        return kvd_error_set(err, KVD_EBADREQ, "'%s' is empty: the prompt needs at least one token",
                             what);
    if (*n_toks >= hp->n_ctx)
        return kvd_error_set(err, KVD_EBADREQ,
                             "'%s': %zu tokens exceed the model's context (%u, at most %u)", what,
                             *n_toks, hp->n_ctx, hp->n_ctx - 1);
    for (size_t i = 0; has_toks && i < *n_toks; i++)
        if ((*toks)[i] >= hp->n_vocab)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "'tokens'[%zu] = %u is outside the vocabulary (%u)", i, (*toks)[i],
                                 hp->n_vocab);
    return 0;
}

int ops_generate_build(struct exec *ex, struct kvmm *mm, const msgpack_object *root,
                       const struct ops_generate_ctx *c, struct sched_req **out,
                       struct kvd_error *err)
{
    const struct model_hparams *hp = exec_hparams(ex);
    uint32_t *toks = NULL;
    size_t n_toks = 0, skip = 0;
    bool has_seq = false, whole = false;
    uint64_t seq = 0;
    int rc;
    struct sched_req *r = calloc(1, sizeof(*r));
    if (!r)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    r->conn = c->conn;
    r->id = c->id;
    r->tenant = c->tenant;
    r->ns = c->ns;
    r->n_ctx = hp->n_ctx;
    r->t_arrive = sched_now_ns();

    if ((rc = proto_opt_uint(root, "seq", &seq, &has_seq, err)))
        goto fail;
    if ((rc = parse_prompt(ex, mm, root, c->conn, has_seq, seq, &toks, &n_toks, &whole, err)))
        goto fail;
    if ((rc = parse_args(exec_text(ex), hp, root, r, err)))
        goto fail;

    r->serial = exec_next_serial(ex);
    if (has_seq) {
        kvmm_lock(mm);
        rc = take_seq(mm, r, seq, toks, n_toks, whole, &skip, err);
        kvmm_unlock(mm);
        if (rc)
            goto fail;
    } else {
        r->cap_toks = n_toks + 64;
        r->toks = malloc(r->cap_toks * sizeof(uint32_t));
        if (!r->toks) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            goto fail;
        }
    }
    if (n_toks > skip)
        memcpy(r->toks + r->n_toks, toks + skip, (n_toks - skip) * sizeof(uint32_t));
    r->n_toks += n_toks - skip;
    r->n_prompt = r->n_toks;
    free(toks);
    *out = r;
    return 0;
fail:
    free(toks);
    sched_req_free(r);
    return rc;
}

void ops_generate_discard(struct kvmm *mm, struct sched_req *r)
{
    if (r->have_seq) {
        kvmm_lock(mm);
        if (r->conn_seq)
            kvmm_seq_set_owner(mm, sched_req_owner(r), r->seq, r->conn);
        else
            kvmm_seq_close(mm, sched_req_owner(r), r->seq);
        kvmm_unlock(mm);
    }
    sched_req_free(r);
}

/* ---- encoding ----------------------------------------------------------- */

int ops_generate_encode_tokens(msgpack_sbuffer *sb, uint64_t id, const uint32_t *toks, size_t n,
                               const char *text, size_t text_len)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    int rc = proto_event_begin(&pk, id, KVD_EVENT_TOKENS, text ? 2 : 1);
    if (!rc)
        rc = proto_pack_kv_u32_array(&pk, "tokens", toks, n);
    if (!rc && text)
        rc = proto_pack_kvn_str(&pk, "text", 4, text, text_len);
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
        rc = proto_pack_error(&pk, r->id, r->err ? r->err : KVD_EINTERNAL, r->errmsg);
        return rc ? rc : proto_frame_end(sb, at);
    }
    bool seq = r->seq_returned;
    size_t n_gen = r->n_toks - r->n_prompt;
    uint64_t t_sched = r->t_sched ? r->t_sched : r->t_done;
    uint64_t t_first = r->t_first ? r->t_first : r->t_done;
    rc = proto_reply_begin(&pk, r->id, 4 + seq + (r->text != NULL));
    rc = rc ? rc : proto_pack_kv_u32_array(&pk, "tokens", r->toks + r->n_prompt, n_gen);
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
    if (rc)
        return KVD_ENOMEM;
    return proto_frame_end(sb, at);
}

/* ---- server glue -------------------------------------------------------- */

struct ops_generate {
    struct server *srv;          /* not owned */
    struct kvmm *mm;             /* not owned */
    struct exec *ex;             /* owned */
    struct gen_clients *clients; /* owned: requests of other clients (HTTP) */
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
    struct ops_generate *g = ud;
    if (ops_generate_is_client(r->conn)) {
        gen_clients_tokens(g->clients, r, toks, n);
        return;
    }
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    const char *text = NULL;
    size_t text_len = 0;
    if (r->text)
        text_len = text_out_take(r->text, &text); /* the executor's thread: it owns r */
    int rc = ops_generate_encode_tokens(&sb, r->id, toks, n, text, text_len);
    post_frame(ud, r, 0, &sb, rc);
}

static void sink_done(void *ud, const struct sched_req *r)
{
    struct ops_generate *g = ud;
    if (ops_generate_is_client(r->conn)) {
        gen_clients_done(g->clients, r);
        return;
    }
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    int rc = ops_generate_encode_done(&sb, r);
    post_frame(ud, r, SERVER_POST_FINAL, &sb, rc);
}

static int op_generate(struct ops_ctx *c)
{
    struct ops_generate *g = c->op_ctx;
    struct ops_generate_ctx gc = {
        .conn = c->conn_id, .id = c->id, .tenant = c->tenant, .ns = c->ns};
    struct sched_req *r = NULL;
    int rc = server_queue_admit(c->srv, c->conn, c->tenant, &c->err);
    if (rc)
        return rc;
    rc = ops_generate_build(g->ex, c->mm, c->req, &gc, &r, &c->err);
    if (rc)
        return rc;
    if (exec_submit(g->ex, r) != 0) {
        ops_generate_discard(c->mm, r);
        return kvd_error_set(&c->err, KVD_ECANCELLED, "the daemon is shutting down");
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
    exec_cancel(g->ex, c->conn_id, target, &found);
    rc = proto_reply_begin(c->pk, c->id, 1);
    rc = rc ? rc : proto_pack_kv_bool(c->pk, "cancelled", found);
    return rc ? kvd_error_set(&c->err, KVD_ENOMEM, "out of memory") : 0;
}

static void on_close(void *ctx, uint64_t conn_id)
{
    struct ops_generate *g = ctx;
    exec_cancel_conn(g->ex, conn_id);
}

static void on_abort(void *ctx, uint64_t conn_id, int code, const char *msg)
{
    struct ops_generate *g = ctx;
    exec_abort_conn(g->ex, conn_id, code, msg);
}

static void on_drain(void *ctx)
{
    struct ops_generate *g = ctx;
    exec_drain(g->ex);
}

int ops_generate_start(struct server *srv, struct kvmm *mm, struct model *m,
                       const struct exec_conf *conf, struct ops_generate **out, char *err,
                       size_t errlen)
{
    struct ops_generate *g = calloc(1, sizeof(*g));
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return KVD_ENOMEM;
    }
    g->srv = srv;
    g->mm = mm;
    struct exec_sink sink = {.ud = g, .tokens = sink_tokens, .done = sink_done};
    int rc = exec_new(mm, m, conf, &sink, &g->ex, err, errlen);
    if (rc)
        goto fail;
    if ((rc = gen_clients_new(server_event_base(srv), g->ex, mm, &g->clients))) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if ((rc = server_op_register(srv, KVD_OP_GENERATE, op_generate, g, 0)) ||
        (rc = server_op_register(srv, KVD_OP_CANCEL, op_cancel, g, 0)) ||
        (rc = server_on_close(srv, on_close, g)) || (rc = server_on_drain(srv, on_drain, g)) ||
        (rc = server_on_abort(srv, on_abort, g))) {
        snprintf(err, errlen, "cannot register the generate ops");
        goto fail;
    }
    *out = g;
    return 0;
fail:
    if (g->ex)
        exec_free(g->ex);
    gen_clients_free(g->clients);
    free(g);
    return rc;
}

struct exec *ops_generate_exec(struct ops_generate *g)
{
    return g->ex;
}

struct gen_clients *ops_generate_clients(struct ops_generate *g)
{
    return g->clients;
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
    exec_free(g->ex);
    gen_clients_free(g->clients); /* after the executor: nothing posts any more */
    free(g);
}

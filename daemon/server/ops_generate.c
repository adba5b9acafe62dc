/* The generate and cancel ops: hand a generate request (decoded by
 * ops_generate_decode.c) to the executor, and encode its streamed events
 * and final reply as frames for the server to write. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec.h"
#include "gen_request.h"
#include "models.h"
#include "ops.h"
#include "ops_generate.h"
#include "proto.h"
#include "server.h"

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

/* "tool_calls": a reply's calls [{id, name, arguments}]. */
static int pack_calls(msgpack_packer *pk, const struct text_out *t)
{
    size_t n = text_out_n_calls(t);
    int rc = proto_pack_str(pk, "tool_calls");
    rc = rc ? rc : proto_pack_array(pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        const struct tool_call_out *c = text_out_call(t, i);
        rc = proto_pack_map(pk, 3);
        rc = rc ? rc : proto_pack_kv_str(pk, "id", c->id);
        rc = rc ? rc : proto_pack_kv_str(pk, "name", c->name);
        rc = rc ? rc : proto_pack_kvn_str(pk, "arguments", 9, c->args, c->args_len);
    }
    return rc;
}

/* "tool_calls" of a tokens event: the calls' news. */
static int pack_deltas(msgpack_packer *pk, const struct tool_delta *d, size_t n)
{
    int rc = proto_pack_str(pk, "tool_calls");
    rc = rc ? rc : proto_pack_array(pk, n);
    for (size_t i = 0; !rc && i < n; i++) {
        rc = proto_pack_map(pk, d[i].id ? 4 : 2);
        rc = rc ? rc : proto_pack_kv_uint(pk, "index", d[i].index);
        if (d[i].id) {
            rc = rc ? rc : proto_pack_kv_str(pk, "id", d[i].id);
            rc = rc ? rc : proto_pack_kv_str(pk, "name", d[i].name);
        }
        rc = rc ? rc : proto_pack_kvn_str(pk, "arguments", 9, d[i].args, d[i].args_len);
    }
    return rc;
}

int ops_generate_encode_tokens(msgpack_sbuffer *sb, uint64_t id, int64_t choice,
                               const uint32_t *toks, size_t n, const char *text, size_t text_len,
                               const struct sampler_logprob *lp, uint32_t lp_top,
                               const struct tool_delta *calls, size_t n_calls)
{
    msgpack_packer pk;
    proto_packer_init(&pk, sb);
    size_t at = proto_frame_begin(sb);
    if (at == SIZE_MAX)
        return KVD_ENOMEM;
    int rc = proto_event_begin(&pk, id, KVD_EVENT_TOKENS,
                               1 + (choice >= 0) + (text != NULL) + (lp != NULL) + (n_calls > 0));
    if (!rc && choice >= 0)
        rc = proto_pack_kv_uint(&pk, "choice", (uint64_t)choice);
    if (!rc)
        rc = proto_pack_kv_u32_array(&pk, "tokens", toks, n);
    if (!rc && text)
        rc = proto_pack_kvn_str(&pk, "text", 4, text, text_len);
    if (!rc && lp)
        rc = pack_logprobs(&pk, lp, lp_top, n);
    if (!rc && n_calls)
        rc = pack_deltas(&pk, calls, n_calls);
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
    bool calls = r->text && text_out_n_calls(r->text) > 0;
    rc = proto_reply_begin(&pk, r->id, 4 + seq + (r->text != NULL) + (ss != NULL) + lp + calls);
    rc = rc ? rc : proto_pack_kv_u32_array(&pk, "tokens", r->toks + r->n_prompt, n_gen);
    if (lp)
        rc = rc ? rc : pack_logprobs(&pk, r->lp, r->lp_top, n_gen);
    if (r->text) {
        size_t tl;
        const char *t = text_out_str(r->text, &tl);
        rc = rc ? rc : proto_pack_kvn_str(&pk, "text", 4, t, tl);
    }
    if (calls)
        rc = rc ? rc : pack_calls(&pk, r->text);
    rc = rc ? rc : proto_pack_kv_str(&pk, "finish_reason", gen_finish_name(r->finish, calls));
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
    bool calls = !failed && r->text && text_out_n_calls(r->text) > 0;
    int rc = proto_pack_map(pk, 3 + lp + (r->text != NULL) + failed + calls);
    rc = rc ? rc : proto_pack_kv_uint(pk, "index", r->choice);
    rc = rc ? rc : proto_pack_kv_u32_array(pk, "tokens", r->toks + r->n_prompt, n_gen);
    if (lp)
        rc = rc ? rc : pack_logprobs(pk, r->lp, r->lp_top, n_gen);
    if (r->text) {
        size_t tl;
        const char *t = text_out_str(r->text, &tl);
        rc = rc ? rc : proto_pack_kvn_str(pk, "text", 4, t, tl);
    }
    if (calls)
        rc = rc ? rc : pack_calls(pk, r->text);
    rc = rc ? rc : proto_pack_kv_str(pk, "finish_reason", gen_finish_name(r->finish, calls));
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
    const struct tool_delta *calls = NULL;
    size_t n_calls = r->text ? text_out_take_calls(r->text, &calls) : 0;
    int rc = ops_generate_encode_tokens(&sb, r->id, r->group ? (int64_t)r->choice : -1, toks, n,
                                        text, text_len, lp, r->lp_top, calls, n_calls);
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

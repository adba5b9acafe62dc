/* The text ops: tokenize and detokenize with the served model's tokenizer
 * (docs/protocol.md). Without a model, or with a tokenizer kvd cannot
 * reproduce, both answer `unsupported` saying why. The loop thread only
 * checks and copies the arguments; the encoding or decoding, whose cost
 * grows with what the client sent, runs on the text workers (workpool.h),
 * which answer with a final frame through server_post. */
#include "ops_text.h"

#include <stdlib.h>
#include <string.h>

#include "kvd/protocol.h"
#include "exec.h"
#include "models.h"
#include "ops.h"
#include "server.h"
#include "text.h"
#include "workpool.h"

struct ops_text {
    struct server *srv;
    const struct text *tx; /* immutable after text_open */
    struct workpool *pool; /* NULL: the work runs on the loop (tests) */
};

/* One request for the workers: its arguments, copied off the message. */
struct text_job {
    struct ops_text *ot;
    const struct text *tx; /* the request's model's */
    uint64_t conn, id;
    uint32_t max_frame;
    bool detokenize, special;
    int add_bos;
    uint32_t *ids; /* detokenize: (n) owned */
    size_t n;
    size_t len; /* tokenize: text (len bytes) follows the struct */
    char text[];
};

/* A reply's bytes besides its "text" string's contents: the map header,
 * "id" and its value, "ok": true (proto_reply_begin: at most 21), the key
 * "text" and a str32 header (10). */
#define REPLY_OVERHEAD 32u
_Static_assert(KVD_MAX_FRAME_MIN > REPLY_OVERHEAD, "a reply frame holds its overhead");

static const struct tokenizer *need_tokenizer(const struct text *tx, const char *op,
                                              struct kvd_error *e)
{
    const struct tokenizer *tok = text_tokenizer(tx);
    if (!tok)
        kvd_error_set(e, KVD_EUNSUPPORTED, "%s needs the model's tokenizer: %s", op,
                      text_no_tokenizer(tx));
    return tok;
}

/* The text side of the model the request names (its `model`; store mode:
 * the registered one, NULL). */
static int request_text(struct ops_ctx *c, const struct ops_text *ot, const struct text **tx)
{
    struct models_entry *e = NULL;
    int rc = ops_pick_model(c, &e);
    if (rc)
        return rc;
    *tx = e ? models_text(e) : ot->tx;
    return 0;
}

/* The reply of j into sb (one frame), or an error with e filled. */
static int job_reply(struct text_job *j, msgpack_sbuffer *sb, struct kvd_error *e)
{
    const struct text *tx = j->tx;
    uint32_t *ids = NULL;
    char *s = NULL;
    size_t n = 0, len = 0;
    int rc;
    char terr[256];
    if (!j->detokenize) {
        rc = text_tokenize(tx, j->text, j->len, j->add_bos, j->special, KVD_MAX_ARRAY, &ids, &n,
                           terr, sizeof terr);
        if (rc) /* past KVD_MAX_ARRAY ids the encoding stopped there */
            return kvd_error_set(e, rc, "'text': %s", terr);
    } else {
        const struct tokenizer *tok = need_tokenizer(tx, "detokenize", e);
        if (!tok)
            return e->code;
        /* The text is measured as it is made: past what one reply frame can
         * carry ({"id", "ok", "text"}: at most REPLY_OVERHEAD bytes besides
         * the text) the decoding stops, so a few MiB of ids cannot build a
         * reply of GiBs. */
        size_t max = j->max_frame - REPLY_OVERHEAD;
        rc = tokenizer_decode_max(tok, j->ids, j->n, j->special, max, &s, &len);
        if (rc == KVD_ETOOLARGE)
            return kvd_error_set(e, rc,
                                 "'tokens' make more than %zu bytes of text, more than a reply "
                                 "can carry (max-frame %u)",
                                 max, j->max_frame);
        if (rc)
            return kvd_error_set(e, rc, "cannot detokenize");
    }
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    size_t at = proto_frame_begin(sb);
    rc = at == SIZE_MAX ? KVD_ENOMEM : proto_reply_begin(&pk, j->id, 1);
    if (!rc)
        rc = j->detokenize ? proto_pack_kvn_str(&pk, "text", 4, s, len)
                           : proto_pack_kv_u32_array(&pk, "tokens", ids, n);
    if (!rc)
        rc = proto_frame_end(sb, at);
    free(ids);
    free(s);
    if (rc)
        return kvd_error_set(e, KVD_ENOMEM, "out of memory");
    if (sb->size - 4 > j->max_frame)
        return kvd_error_set(e, KVD_ETOOLARGE, "the reply (%zu bytes) is over max-frame (%u)",
                             sb->size - 4, j->max_frame);
    return 0;
}

static void job_run(void *ud, bool cancelled)
{
    struct text_job *j = ud;
    struct kvd_error e;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    int rc = cancelled ? kvd_error_set(&e, KVD_ECANCELLED, "the daemon is shutting down")
                       : job_reply(j, &sb, &e);
    if (rc) {
        msgpack_sbuffer_clear(&sb);
        if (proto_frame_error(&sb, j->id, rc, e.message) != 0)
            msgpack_sbuffer_clear(&sb);
    }
    if (sb.size) {
        size_t len = sb.size;
        server_post(j->ot->srv, j->conn, j->id, SERVER_POST_FINAL, msgpack_sbuffer_release(&sb),
                    len); /* takes the buffer, also on failure */
    }
    msgpack_sbuffer_destroy(&sb);
    free(j->ids);
    free(j);
}

/* Queues j for the workers (or runs it, without a pool): OPS_PENDING, or
 * the code of a refusal with c->err filled (j freed). */
static int submit(struct ops_ctx *c, struct ops_text *ot, struct text_job *j)
{
    j->ot = ot;
    j->conn = c->conn_id;
    j->id = c->id;
    j->max_frame = c->host->max_frame;
    int rc = server_queue_admit(c->srv, c->conn, c->tenant, &c->err);
    if (rc == 0 && !ot->pool) {
        job_run(j, false);
        return OPS_PENDING;
    }
    if (rc == 0 && (rc = workpool_submit(ot->pool, c->tenant, job_run, j)) != 0)
        kvd_error_set(&c->err, rc, "%s", exec_submit_errmsg(rc)); /* the pool's refusals */
    if (rc) {
        free(j->ids);
        free(j);
        return rc;
    }
    return OPS_PENDING;
}

static int op_tokenize(struct ops_ctx *c)
{
    struct ops_text *ot = c->op_ctx;
    const char *s;
    size_t len;
    bool special = false, add_bos = false, has_add_bos = false;
    PROTO_PK(proto_get_str(c->req, "text", &s, &len, &c->err));
    PROTO_PK(proto_opt_bool(c->req, "special", &special, NULL, &c->err));
    PROTO_PK(proto_opt_bool(c->req, "add_bos", &add_bos, &has_add_bos, &c->err));
    const struct text *tx;
    PROTO_PK(request_text(c, ot, &tx));
    if (!need_tokenizer(tx, "tokenize", &c->err))
        return c->err.code;
    uint64_t max = server_options(c->srv)->max_text_bytes;
    if (max && len > max)
        return kvd_error_set(&c->err, KVD_ETOOLARGE,
                             "'text' has %zu bytes, over max-text-bytes (%llu)", len,
                             (unsigned long long)max);
    struct text_job *j = malloc(sizeof(*j) + len + 1);
    if (!j)
        return kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    memset(j, 0, sizeof(*j));
    memcpy(j->text, s, len);
    j->text[len] = '\0';
    j->len = len;
    j->special = special;
    j->add_bos = has_add_bos ? add_bos : -1;
    j->tx = tx;
    return submit(c, ot, j);
}

static int op_detokenize(struct ops_ctx *c)
{
    struct ops_text *ot = c->op_ctx;
    uint32_t *ids = NULL;
    size_t n = 0;
    bool special = false;
    PROTO_PK(proto_get_u32_array(c->req, "tokens", KVD_MAX_ARRAY, &ids, &n, &c->err));
    int rc = proto_opt_bool(c->req, "special", &special, NULL, &c->err);
    const struct text *tx = NULL;
    if (!rc)
        rc = request_text(c, ot, &tx);
    const struct tokenizer *tok = rc ? NULL : need_tokenizer(tx, "detokenize", &c->err);
    if (!tok) {
        free(ids);
        return c->err.code;
    }
    uint32_t n_vocab = tokenizer_n_vocab(tok);
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= n_vocab) {
            rc = kvd_error_set(&c->err, KVD_EBADREQ,
                               "'tokens'[%zu] = %u is outside the vocabulary (%u)", i, ids[i],
                               n_vocab);
            free(ids);
            return rc;
        }
    struct text_job *j = calloc(1, sizeof(*j));
    if (!j) {
        free(ids);
        return kvd_error_set(&c->err, KVD_ENOMEM, "out of memory");
    }
    j->detokenize = true;
    j->special = special;
    j->ids = ids;
    j->n = n;
    j->tx = tx;
    return submit(c, ot, j);
}

int ops_text_register(struct server *srv, const struct text *tx, struct workpool *pool,
                      struct ops_text **out)
{
    struct ops_text *ot = calloc(1, sizeof(*ot));
    if (!ot)
        return KVD_ENOMEM;
    *ot = (struct ops_text){.srv = srv, .tx = tx, .pool = pool};
    int rc = server_op_register(srv, KVD_OP_TOKENIZE, op_tokenize, ot, 0);
    if (!rc)
        rc = server_op_register(srv, KVD_OP_DETOKENIZE, op_detokenize, ot, 0);
    if (rc) {
        free(ot);
        return rc;
    }
    *out = ot;
    return 0;
}

void ops_text_free(struct ops_text *ot)
{
    free(ot);
}

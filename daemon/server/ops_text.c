/* The text ops: tokenize and detokenize with the served model's tokenizer
 * (docs/protocol.md). Without a model, or with a tokenizer kvd cannot
 * reproduce, both answer `unsupported` saying why. */
#include "ops_text.h"

#include <stdlib.h>
#include <string.h>

#include "kvd/protocol.h"
#include "server.h"
#include "text.h"

static const struct tokenizer *need_tokenizer(struct ops_ctx *c, const char *op,
                                              const struct text *tx)
{
    const struct tokenizer *tok = text_tokenizer(tx);
    if (!tok)
        kvd_error_set(&c->err, KVD_EUNSUPPORTED, "%s needs the model's tokenizer: %s", op,
                      text_no_tokenizer(tx));
    return tok;
}

static int op_tokenize(struct ops_ctx *c)
{
    const struct text *tx = c->op_ctx;
    const char *s;
    size_t len;
    bool special = false, add_bos = false, has_add_bos = false;
    PROTO_PK(proto_get_str(c->req, "text", &s, &len, &c->err));
    PROTO_PK(proto_opt_bool(c->req, "special", &special, NULL, &c->err));
    PROTO_PK(proto_opt_bool(c->req, "add_bos", &add_bos, &has_add_bos, &c->err));
    if (!need_tokenizer(c, "tokenize", tx))
        return c->err.code;
    uint32_t *ids = NULL;
    size_t n = 0;
    char err[256];
    int rc = text_tokenize(tx, s, len, has_add_bos ? add_bos : -1, special, KVD_MAX_ARRAY, &ids, &n,
                           err, sizeof err);
    if (rc)
        return kvd_error_set(&c->err, rc, "'text': %s", err);
    if (n > KVD_MAX_ARRAY) {
        free(ids);
        return kvd_error_set(&c->err, KVD_ETOOLARGE, "'text' makes %zu tokens, at most %u", n,
                             KVD_MAX_ARRAY);
    }
    rc = proto_reply_begin(c->pk, c->id, 1);
    rc = rc ? rc : proto_pack_kv_u32_array(c->pk, "tokens", ids, n);
    free(ids);
    return rc ? kvd_error_set(&c->err, KVD_ENOMEM, "out of memory") : 0;
}

static int op_detokenize(struct ops_ctx *c)
{
    const struct text *tx = c->op_ctx;
    uint32_t *ids = NULL;
    size_t n = 0;
    bool special = false;
    PROTO_PK(proto_get_u32_array(c->req, "tokens", KVD_MAX_ARRAY, &ids, &n, &c->err));
    int rc = proto_opt_bool(c->req, "special", &special, NULL, &c->err);
    const struct tokenizer *tok = rc ? NULL : need_tokenizer(c, "detokenize", tx);
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
    char *s = NULL;
    size_t len = 0;
    rc = tokenizer_decode(tok, ids, n, special, &s, &len);
    free(ids);
    if (rc)
        return kvd_error_set(&c->err, rc, "cannot detokenize");
    rc = proto_reply_begin(c->pk, c->id, 1);
    rc = rc ? rc : proto_pack_kvn_str(c->pk, "text", 4, s, len);
    free(s);
    return rc ? kvd_error_set(&c->err, KVD_ENOMEM, "out of memory") : 0;
}

int ops_text_register(struct server *srv, const struct text *tx)
{
    /* The handlers never modify the text (immutable after text_open). */
    void *ctx = (void *)(uintptr_t)tx;
    int rc = server_op_register(srv, KVD_OP_TOKENIZE, op_tokenize, ctx, 0);
    return rc ? rc : server_op_register(srv, KVD_OP_DETOKENIZE, op_detokenize, ctx, 0);
}

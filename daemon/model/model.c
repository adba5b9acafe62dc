/* Model loading: reads the hyperparameters of a llama or qwen2 GGUF, checks
 * every tensor's presence, type and shape against them, and uploads the
 * weights in their native type into one device buffer on the backend. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "gguf.h"
#include "kvd/status.h"
#include "model_impl.h"

#define MODEL_MAX_DIM (1u << 20)
#define MODEL_MAX_LAYERS 1024u

/* "<arch>.<suffix>" as u32: required unless def is given (def_ok). */
static int hp_u32(const struct gguf *g, const char *arch, const char *suffix, uint32_t *out,
                  int required, uint32_t def, struct kvd_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    char gerr[KVD_ERROR_MSG_MAX] = "";
    int rc = gguf_get_u32(g, key, out, gerr, sizeof gerr);
    if (rc == KVD_ENOTFOUND) {
        if (required)
            return kvd_error_set(err, KVD_EBADREQ, "model: metadata '%s' is missing", key);
        *out = def;
        return 0;
    }
    return rc ? kvd_error_set(err, rc, "%s", gerr) : 0;
}

static int hp_f32(const struct gguf *g, const char *arch, const char *suffix, float *out,
                  int required, float def, struct kvd_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_f32(g, key, out, err);
    if (rc == KVD_ENOTFOUND) {
        if (required)
            return kvd_error_set(err, KVD_EBADREQ, "model: metadata '%s' is missing", key);
        *out = def;
        return 0;
    }
    return rc;
}

static int read_hparams(const struct gguf *g, struct model_hparams *hp, struct kvd_error *err)
{
    int rc;
    const char *a = hp->arch;
    char gerr[KVD_ERROR_MSG_MAX] = ""; /* gguf_get_str's message */
    rc = gguf_get_str(g, "general.architecture", hp->arch, sizeof hp->arch, gerr, sizeof gerr);
    if (rc == KVD_ENOTFOUND)
        return kvd_error_set(err, KVD_EBADREQ, "model: metadata 'general.architecture' is missing");
    if (rc)
        return kvd_error_set(err, rc, "%s", gerr);
    if (strcmp(a, "llama") && strcmp(a, "qwen2"))
        return kvd_error_set(err, KVD_EUNSUPPORTED,
                             "model: architecture '%s' is not supported (supported: llama, qwen2)",
                             a);
    if (gguf_get_str(g, "general.name", hp->name, sizeof hp->name, gerr, sizeof gerr))
        hp->name[0] = 0;
    uint32_t key_len, val_len;
    if ((rc = hp_u32(g, a, "context_length", &hp->n_ctx, 1, 0, err)) ||
        (rc = hp_u32(g, a, "embedding_length", &hp->n_embd, 1, 0, err)) ||
        (rc = hp_u32(g, a, "block_count", &hp->n_layer, 1, 0, err)) ||
        (rc = hp_u32(g, a, "feed_forward_length", &hp->n_ff, 1, 0, err)) ||
        (rc = hp_u32(g, a, "attention.head_count", &hp->n_head, 1, 0, err)) ||
        (rc = hp_u32(g, a, "attention.head_count_kv", &hp->n_head_kv, 0, hp->n_head, err)) ||
        (rc = hp_u32(g, a, "attention.key_length", &key_len, 0, 0, err)) ||
        (rc = hp_u32(g, a, "attention.value_length", &val_len, 0, 0, err)) ||
        (rc = hp_f32(g, a, "attention.layer_norm_rms_epsilon", &hp->rms_eps, 1, 0, err)) ||
        (rc = hp_f32(g, a, "rope.freq_base", &hp->rope_base, 0, 10000.0f, err)))
        return rc;
    if (!hp->n_embd || !hp->n_layer || !hp->n_ff || !hp->n_head || !hp->n_head_kv || !hp->n_ctx ||
        hp->n_embd > MODEL_MAX_DIM || hp->n_ff > MODEL_MAX_DIM || hp->n_head > 4096 ||
        hp->n_layer > MODEL_MAX_LAYERS || hp->n_ctx > (1u << 24))
        return kvd_error_set(
            err, KVD_EBADREQ,
            "model: hyperparameters out of range (embd %u, layers %u, ff %u, heads %u/%u, ctx %u)",
            hp->n_embd, hp->n_layer, hp->n_ff, hp->n_head, hp->n_head_kv, hp->n_ctx);
    if (hp->n_head % hp->n_head_kv)
        return kvd_error_set(err, KVD_EBADREQ,
                             "model: head_count %u is not a multiple of head_count_kv %u",
                             hp->n_head, hp->n_head_kv);
    if (key_len == 0) {
        if (hp->n_embd % hp->n_head)
            return kvd_error_set(err, KVD_EBADREQ,
                                 "model: embedding_length %u is not a multiple of head_count %u",
                                 hp->n_embd, hp->n_head);
        key_len = hp->n_embd / hp->n_head;
    }
    if (val_len && val_len != key_len)
        return kvd_error_set(err, KVD_EUNSUPPORTED,
                             "model: key_length %u != value_length %u is not supported", key_len,
                             val_len);
    hp->head_dim = key_len;
    if (hp->head_dim > 1024 || hp->head_dim * hp->n_head > MODEL_MAX_DIM)
        return kvd_error_set(err, KVD_EBADREQ, "model: head dimension %u out of range",
                             hp->head_dim);
    if ((rc = hp_u32(g, a, "rope.dimension_count", &hp->n_rot, 0, hp->head_dim, err)))
        return rc;
    if (hp->n_rot % 2 || hp->n_rot > hp->head_dim || hp->n_rot == 0)
        return kvd_error_set(err, KVD_EBADREQ,
                             "model: rope.dimension_count %u must be even, > 0 and <= %u",
                             hp->n_rot, hp->head_dim);
    if (!(hp->rms_eps > 0 && hp->rms_eps < 1) || !(hp->rope_base > 0 && hp->rope_base < 1e12f))
        return kvd_error_set(err, KVD_EBADREQ, "model: rms epsilon %g or rope base %g out of range",
                             (double)hp->rms_eps, (double)hp->rope_base);
    /* llama.cpp applies rope.scaling.factor whatever the type says; only
     * identity scaling is supported (Llama 3.1 scaling is rope_freqs.weight). */
    char key[128], st[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    rc = gguf_get_str(g, key, st, sizeof st, gerr, sizeof gerr);
    if (rc && rc != KVD_ENOTFOUND)
        return kvd_error_set(err, rc, "%s", gerr);
    if (strcmp(st, "") && strcmp(st, "none") && strcmp(st, "linear"))
        return kvd_error_set(err, KVD_EUNSUPPORTED, "model: rope scaling '%s' is not supported",
                             st);
    float factor;
    if ((rc = hp_f32(g, a, "rope.scaling.factor", &factor, 0, 1.0f, err)))
        return rc;
    if (factor != 1.0f && factor != 0.0f)
        return kvd_error_set(err, KVD_EUNSUPPORTED,
                             "model: rope scaling factor %g is not supported", (double)factor);
    hp->rope_mode = strcmp(a, "qwen2") == 0 ? ROPE_NEOX : ROPE_NORM;
    hp->has_qkv_bias = strcmp(a, "qwen2") == 0;
    return 0;
}

/* Collects the tensors to load; `off` is each one's place in the weight
 * buffer (set by place(), in the backend's layout). The arrays follow the
 * struct in its allocation, 16 entries per layer + 8 (collect takes at most
 * 12 per layer + 4): sized by the model, not by MODEL_MAX_LAYERS, which made
 * every load allocate and zero ~400 KB. */
struct load_ctx {
    const struct gguf *g;
    struct kvd_error *err;
    const struct gguf_tensor **src;
    struct ctensor **dst;
    size_t *off;
    size_t n, total;
};

/* Finds `name` with shape [ne0, ne1] (ne1 = 0: a 1-D tensor of ne0 that must
 * be f32). Absent and optional: t stays zero and 0 is returned. */
static int want(struct load_ctx *lc, struct ctensor *t, const char *name, uint32_t ne0,
                uint32_t ne1, int optional)
{
    const struct gguf_tensor *gt = gguf_find_tensor(lc->g, name);
    if (!gt) {
        if (optional)
            return 0;
        return kvd_error_set(lc->err, KVD_EBADREQ, "model: tensor '%s' is missing", name);
    }
    int one_d = ne1 == 0;
    uint64_t got1 = gt->ne[1] * gt->ne[2] * gt->ne[3];
    if (gt->ne[0] != ne0 || (one_d ? got1 != 1 : (got1 != ne1 || gt->ne[2] != 1 || gt->ne[3] != 1)))
        return kvd_error_set(lc->err, KVD_EBADREQ,
                             "model: tensor '%s' has shape [%" PRIu64 ", %" PRIu64
                             "], expected [%u, %u]",
                             name, gt->ne[0], got1, ne0, one_d ? 1 : ne1);
    if (one_d && gt->type != CT_F32)
        return kvd_error_set(lc->err, KVD_EUNSUPPORTED, "model: tensor '%s' must be f32, is %s",
                             name, ctype_name((enum ctype)gt->type));
    t->type = (enum ctype)gt->type;
    t->ne0 = ne0;
    t->ne1 = one_d ? 1 : ne1;
    t->nbytes = gt->nbytes;
    lc->src[lc->n] = gt;
    lc->dst[lc->n] = t;
    lc->n++;
    return 0;
}

/* Lays the collected tensors out in one buffer, each in the bytes the
 * backend stores it in, 256-byte aligned. */
static void place(const struct compute_ops *ops, struct load_ctx *lc)
{
    lc->total = 0;
    for (size_t i = 0; i < lc->n; i++) {
        size_t bytes = ops->weight_bytes ? ops->weight_bytes(lc->dst[i]) : lc->dst[i]->nbytes;
        lc->off[i] = lc->total;
        lc->total += (bytes + 255) / 256 * 256;
    }
}

/* A weight with a NaN or an infinity (a float, or a block's f16 scale or
 * minimum) makes every logit NaN and every sampled token 0, with no error
 * anywhere: refused at load, naming the tensor. One pass over the floats;
 * quantized tensors only have their scales read. */
static int check_finite(const struct gguf_tensor *src, enum ctype t, struct kvd_error *err)
{
    const uint8_t *p = src->data;
    size_t step = ctype_block_bytes(t), n = step ? src->nbytes / step : 0;
    size_t offs[2] = {0, 2}, n_offs = 1; /* f16 scale(s) within a block */
    uint16_t mask = 0x7c00;              /* f16: exponent all ones */
    if (t == CT_Q4_1 || t == CT_Q5_1 || t == CT_Q4_K || t == CT_Q5_K)
        n_offs = 2; /* d and the minimum */
    else if (t == CT_Q6_K)
        offs[0] = 208; /* ql[128], qh[64], scales[16], then d */
    else if (t == CT_BF16)
        mask = 0x7f80;
    for (size_t i = 0; i < n; i++) {
        bool bad = false;
        if (t == CT_F32) {
            uint32_t u;
            memcpy(&u, p + i * 4, 4);
            bad = (u & 0x7f800000u) == 0x7f800000u;
        } else {
            for (size_t k = 0; k < n_offs && !bad; k++) {
                uint16_t h;
                memcpy(&h, p + i * step + offs[k], 2);
                bad = (h & mask) == mask;
            }
        }
        if (bad)
            return kvd_error_set(
                err, KVD_EBADREQ,
                "model: tensor '%s' (%s) holds a NaN or an infinity at %s %zu: the file "
                "is damaged",
                src->name, ctype_name(t), ctype_is_quant(t) ? "the scale of block" : "element", i);
    }
    return 0;
}

static int collect(struct model *m, struct load_ctx *lc)
{
    const struct model_hparams *hp = &m->hp;
    uint32_t E = hp->n_embd, QD = hp->n_head * hp->head_dim, KD = hp->n_head_kv * hp->head_dim;
    const struct gguf_tensor *emb = gguf_find_tensor(lc->g, "token_embd.weight");
    int rc;
    if (!emb)
        return kvd_error_set(lc->err, KVD_EBADREQ, "model: tensor 'token_embd.weight' is missing");
    if (emb->ne[1] == 0 || emb->ne[1] > (1u << 24))
        return kvd_error_set(lc->err, KVD_EBADREQ,
                             "model: vocabulary size %" PRIu64 " out of range", emb->ne[1]);
    m->hp.n_vocab = (uint32_t)emb->ne[1];
    uint64_t ntok = gguf_arr_count(lc->g, "tokenizer.ggml.tokens");
    if (ntok && ntok != hp->n_vocab)
        return kvd_error_set(lc->err, KVD_EBADREQ,
                             "model: tokenizer has %" PRIu64
                             " tokens but token_embd.weight has %u rows",
                             ntok, hp->n_vocab);
    if ((rc = want(lc, &m->tok_embd, "token_embd.weight", E, hp->n_vocab, 0)) ||
        (rc = want(lc, &m->output_norm, "output_norm.weight", E, 0, 0)) ||
        (rc = want(lc, &m->output, "output.weight", E, hp->n_vocab, 1)) ||
        (rc = want(lc, &m->rope_freqs, "rope_freqs.weight", hp->n_rot / 2, 0, 1)))
        return rc;
    m->hp.tied_output = m->output.ne0 == 0;
    m->tok_embd.rows_only = !m->hp.tied_output;
    m->hp.has_rope_freqs = m->rope_freqs.ne0 != 0;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        struct model_layer *L = &m->layers[l];
        char n[GGUF_MAX_NAME + 16];
#define W(field, suffix, ne0, ne1, opt)                                                            \
    snprintf(n, sizeof n, "blk.%u." suffix, l);                                                    \
    if ((rc = want(lc, &L->field, n, ne0, ne1, opt)))                                              \
        return rc;
        W(attn_norm, "attn_norm.weight", E, 0, 0)
        W(wq, "attn_q.weight", E, QD, 0)
        W(wk, "attn_k.weight", E, KD, 0)
        W(wv, "attn_v.weight", E, KD, 0)
        W(wo, "attn_output.weight", QD, E, 0)
        W(ffn_norm, "ffn_norm.weight", E, 0, 0)
        W(gate, "ffn_gate.weight", E, hp->n_ff, 0)
        W(up, "ffn_up.weight", E, hp->n_ff, 0)
        W(down, "ffn_down.weight", hp->n_ff, E, 0)
        int opt_bias = !hp->has_qkv_bias;
        W(bq, "attn_q.bias", QD, 0, opt_bias)
        W(bk, "attn_k.bias", KD, 0, opt_bias)
        W(bv, "attn_v.bias", KD, 0, opt_bias)
#undef W
    }
    return 0;
}

int model_load_opts(const char *path, struct backend *be, const struct model_opts *opts,
                    struct model **out, struct kvd_error *err)
{
    struct gguf *g = NULL;
    struct load_ctx *lc = NULL;
    struct model *m = NULL;
    int rc;
    *out = NULL;
    if (!be || !be->compute)
        return kvd_error_set(err, KVD_EUNSUPPORTED, "model: the %s backend has no compute ops",
                             be && be->ops ? be->ops->name : "given");
    char gerr[KVD_ERROR_MSG_MAX] = "";
    if ((rc = gguf_open(path, &g, gerr, sizeof gerr)))
        return kvd_error_set(err, rc, "%s", gerr);
    m = calloc(1, sizeof *m);
    if (!m) {
        rc = kvd_error_set(err, KVD_ENOMEM, "model: out of memory");
        goto out_free;
    }
    m->be = be;
    m->ops = be->compute;
    if ((rc = read_hparams(g, &m->hp, err)))
        goto out_free;
    m->layers = calloc(m->hp.n_layer, sizeof *m->layers);
    if (!m->layers) {
        rc = kvd_error_set(err, KVD_ENOMEM, "model: out of memory");
        goto out_free;
    }
    size_t cap = 16 * (size_t)m->hp.n_layer + 8;
    lc = calloc(1, sizeof *lc + cap * (sizeof *lc->src + sizeof *lc->dst + sizeof *lc->off));
    if (!lc) {
        rc = kvd_error_set(err, KVD_ENOMEM, "model: out of memory");
        goto out_free;
    }
    lc->g = g;
    lc->err = err;
    lc->src = (const struct gguf_tensor **)(lc + 1);
    lc->dst = (struct ctensor **)(lc->src + cap);
    lc->off = (size_t *)(lc->dst + cap);
    if ((rc = collect(m, lc)))
        goto out_free;
    for (size_t i = 0; i < lc->n; i++) {
        enum ctype t = lc->dst[i]->type;
        bool ok = m->ops->weight_type_ok
                      ? m->ops->weight_type_ok(t)
                      : t == CT_F32 || t == CT_F16 || t == CT_BF16 || t == CT_Q8_0;
        if (!ok) {
            rc = kvd_error_set(err, KVD_EUNSUPPORTED,
                               "model: tensor '%s' is %s, a weight type the %s backend cannot run",
                               lc->src[i]->name, ctype_name(t), m->ops->name);
            goto out_free;
        }
    }
    for (size_t i = 0; i < lc->n; i++)
        if ((rc = check_finite(lc->src[i], lc->dst[i]->type, err)))
            goto out_free;
    m->hp.wtype = m->layers[0].wq.type;
    struct compute_conf conf = {.n_threads = opts ? opts->n_threads : 0};
    if ((rc = m->ops->ctx_new(be, &conf, &m->cx))) {
        rc = kvd_error_set(err, rc, "model: cannot create the %s compute context", m->ops->name);
        goto out_free;
    }
    place(m->ops, lc);
    if ((rc = m->ops->buf_alloc(m->cx, lc->total, &m->weights))) {
        rc = kvd_error_set(err, rc, "model: cannot allocate %zu bytes of weights on the %s backend",
                           lc->total, m->ops->name);
        goto out_free;
    }
    XXH3_state_t *fp = XXH3_createState();
    if (!fp) {
        rc = kvd_error_set(err, KVD_ENOMEM, "model: out of memory");
        goto out_free;
    }
    XXH3_128bits_reset(fp);
    XXH3_128bits_update(fp, g->map, g->data_offset);
    for (size_t i = 0; i < lc->n; i++) {
        struct ctensor *t = lc->dst[i];
        t->data = (uint8_t *)m->weights + lc->off[i];
        XXH3_128bits_update(fp, lc->src[i]->data, lc->src[i]->nbytes);
        rc = m->ops->weight_upload ? m->ops->weight_upload(m->cx, t, lc->src[i]->data)
                                   : m->ops->upload(m->cx, t->data, lc->src[i]->data, t->nbytes);
        if (rc) {
            XXH3_freeState(fp);
            rc = kvd_error_set(err, rc, "model: uploading '%s' failed", lc->src[i]->name);
            goto out_free;
        }
        m->hp.n_params += (uint64_t)t->ne0 * t->ne1;
        m->hp.weight_bytes += t->nbytes;
    }
    m->hp.weight_device_bytes = lc->total;
    XXH128_canonical_t fpc;
    XXH128_canonicalFromHash(&fpc, XXH3_128bits_digest(fp));
    XXH3_freeState(fp);
    memcpy(m->hp.fingerprint, fpc.digest, sizeof m->hp.fingerprint);
    if (m->ops->weight_scratch_bytes)
        m->hp.weight_device_bytes += m->ops->weight_scratch_bytes(m->cx);
    if (m->hp.tied_output)
        m->output = m->tok_embd;
    free(lc);
    gguf_close(g);
    *out = m;
    return 0;
out_free:
    free(lc);
    gguf_close(g);
    model_free(m);
    return rc;
}

int model_probe(const char *path, struct model_hparams *hp, struct kvd_error *err)
{
    struct gguf *g = NULL;
    char gerr[KVD_ERROR_MSG_MAX] = "";
    int rc = gguf_open(path, &g, gerr, sizeof gerr);
    if (rc)
        return kvd_error_set(err, rc, "%s", gerr);
    memset(hp, 0, sizeof *hp);
    if ((rc = read_hparams(g, hp, err)))
        goto out;
    const struct gguf_tensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->ne[1] == 0 || emb->ne[1] > (1u << 24)) {
        rc = kvd_error_set(err, KVD_EBADREQ, "model: tensor 'token_embd.weight' is %s",
                           emb ? "out of range" : "missing");
        goto out;
    }
    hp->n_vocab = (uint32_t)emb->ne[1];
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct gguf_tensor *t = &g->tensors[i];
        hp->weight_bytes += t->nbytes;
        hp->n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    }
    hp->weight_device_bytes = hp->weight_bytes;
    hp->wtype = CT_F32;
    const struct gguf_tensor *wq = gguf_find_tensor(g, "blk.0.attn_q.weight");
    if (wq)
        hp->wtype = (enum ctype)wq->type;
out:
    gguf_close(g);
    return rc;
}

int model_load(const char *path, struct backend *be, struct model **out, struct kvd_error *err)
{
    return model_load_opts(path, be, NULL, out, err);
}

size_t model_dev_bytes(const struct model *m)
{
    return m->ops->dev_bytes ? m->ops->dev_bytes(m->cx) : 0;
}

void model_free(struct model *m)
{
    if (!m)
        return;
    if (m->cx) {
        m->ops->buf_free(m->cx, m->weights);
        m->ops->ctx_free(m->cx);
    }
    free(m->layers);
    free(m);
}

const struct model_hparams *model_hparams(const struct model *m)
{
    return &m->hp;
}

uint32_t model_step_launches(const struct model *m)
{
    return m->ops->step_launches ? m->ops->step_launches(m->cx) : 0;
}

void model_kv_geom(const struct model *m, uint32_t block_tokens, enum kv_dtype dt,
                   struct kv_geom *g)
{
    g->layers = m->hp.n_layer;
    g->kv_heads = m->hp.n_head_kv;
    g->head_dim = m->hp.head_dim;
    g->dtype = dt;
    g->block_tokens = block_tokens;
}

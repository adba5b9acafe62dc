/* The forward step over paged KV, written once against the compute-ops
 * table: validate the batch, upload its token/position/block-table metadata,
 * then embedding -> n_layer x (attention block, MLP block) -> final norm ->
 * logits of each sequence's last new token -> (optionally) the token sampled
 * from them. Shapes are in the comments of struct fwd_ctx; T = tokens in the
 * step, S = sequences. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"
#include "model_impl.h"

struct fwd_ctx {
    struct model *m;
    uint32_t max_tokens, max_seqs;
    /* device activations, Tm = max_tokens, E = n_embd, QD = n_head*head_dim,
     * KD = n_head_kv*head_dim, F = n_ff, V = n_vocab, Sm = max_seqs */
    float *x;                            /* [Tm][E] residual stream */
    float *h;                            /* [Tm][E] normed input / projection output */
    float *q;                            /* [Tm][QD] */
    float *k, *v;                        /* [Tm][KD] */
    float *att;                          /* [Tm][QD] attention output */
    float *gate;                         /* [Tm][F] */
    float *up;                           /* [Tm][F] */
    float *last;                         /* [Sm][E] last rows */
    float *logits;                       /* [Sm][V] */
    struct sample_row *sample, *hsample; /* [Sm] the step's sampling rows, device and host */
    uint32_t *ids;                       /* [Sm] sampled tokens */
    /* metadata, device and host mirror, u32: tokens[Tm] pos[Tm] tok_slot[Tm]
     * qstart[Sm+1] pos0[Sm] slot0[Sm+1] last_rows[Sm] */
    uint32_t *meta, *hmeta;
    size_t meta_words;
    uint32_t *slots, *hslots; /* block tables, concatenated; grown on demand */
    size_t slots_cap;
    uint64_t *conflict; /* host scratch for the write-conflict check */
    size_t conflict_cap;
    char err[256];
};

__attribute__((format(printf, 3, 4))) static int ferr(struct fwd_ctx *c, int code, const char *fmt,
                                                      ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return code;
}

const char *fwd_ctx_errmsg(const struct fwd_ctx *c)
{
    return c->err;
}

void fwd_ctx_free(struct fwd_ctx *c)
{
    if (!c)
        return;
    const struct compute_ops *o = c->m->ops;
    struct compute_ctx *cx = c->m->cx;
    float *bufs[] = {c->x, c->h, c->q, c->k, c->v, c->att, c->gate, c->up, c->last, c->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        o->buf_free(cx, bufs[i]);
    o->buf_free(cx, c->meta);
    o->buf_free(cx, c->slots);
    o->buf_free(cx, c->sample);
    o->buf_free(cx, c->ids);
    free(c->hmeta);
    free(c->hsample);
    free(c->hslots);
    free(c->conflict);
    free(c);
}

int fwd_ctx_new(struct model *m, uint32_t max_batch_tokens, uint32_t max_seqs, struct fwd_ctx **out)
{
    const struct model_hparams *hp = &m->hp;
    struct fwd_ctx *c = calloc(1, sizeof *c);
    *out = NULL;
    if (!c)
        return KVD_ENOMEM;
    if (max_batch_tokens == 0 || max_seqs == 0 || max_seqs > max_batch_tokens ||
        max_batch_tokens > (1u << 20)) {
        free(c);
        return KVD_EBADREQ;
    }
    c->m = m;
    c->max_tokens = max_batch_tokens;
    c->max_seqs = max_seqs;
    size_t T = max_batch_tokens, S = max_seqs, E = hp->n_embd,
           QD = (size_t)hp->n_head * hp->head_dim, KD = (size_t)hp->n_head_kv * hp->head_dim,
           F = hp->n_ff, V = hp->n_vocab;
    struct {
        float **p;
        size_t n;
    } want[] = {{&c->x, T * E},    {&c->h, T * E},     {&c->q, T * QD},   {&c->k, T * KD},
                {&c->v, T * KD},   {&c->att, T * QD},  {&c->gate, T * F}, {&c->up, T * F},
                {&c->last, S * E}, {&c->logits, S * V}};
    int rc = 0;
    for (size_t i = 0; i < sizeof want / sizeof want[0] && !rc; i++)
        rc = m->ops->buf_alloc(m->cx, want[i].n * sizeof(float), (void **)want[i].p);
    c->meta_words = 3 * T + 4 * S + 2;
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, c->meta_words * 4, (void **)&c->meta);
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, S * sizeof(struct sample_row), (void **)&c->sample);
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, S * sizeof(uint32_t), (void **)&c->ids);
    c->hmeta = malloc(c->meta_words * 4);
    c->hsample = malloc(S * sizeof *c->hsample);
    if (rc || !c->hmeta || !c->hsample) {
        fwd_ctx_free(c);
        return KVD_ENOMEM;
    }
    *out = c;
    return 0;
}

static int grow(struct fwd_ctx *c, size_t n_slots, size_t n_conflict)
{
    if (n_slots > c->slots_cap) {
        size_t cap = n_slots * 2;
        uint32_t *d = NULL, *h = malloc(cap * 4);
        if (!h || c->m->ops->buf_alloc(c->m->cx, cap * 4, (void **)&d)) {
            free(h);
            return ferr(c, KVD_ENOMEM, "forward: out of memory for block tables");
        }
        c->m->ops->buf_free(c->m->cx, c->slots);
        free(c->hslots);
        c->slots = d;
        c->hslots = h;
        c->slots_cap = cap;
    }
    if (n_conflict > c->conflict_cap) {
        uint64_t *p = realloc(c->conflict, n_conflict * 2 * sizeof *p);
        if (!p)
            return ferr(c, KVD_ENOMEM, "forward: out of memory");
        c->conflict = p;
        c->conflict_cap = n_conflict * 2;
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Checks everything model_forward reads before any write happens; fills
 * *n_tokens, *n_slots (block-table entries needed) and *max_kv. */
static int validate(struct fwd_ctx *c, const struct fwd_batch *b, uint32_t *n_tokens,
                    size_t *n_slots, uint32_t *max_kv, uint32_t *max_q)
{
    const struct model_hparams *hp = &c->m->hp;
    const struct kv_geom *g = b->geom;
    uint64_t T = 0, NS = 0;
    *max_kv = *max_q = 0;
    if (!b->seqs || b->n_seqs == 0 || !b->kv_arena || !g || (!b->logits && !b->sample) ||
        (b->sample && !b->tokens))
        return ferr(c, KVD_EBADREQ, "forward: empty batch, or missing arena, geometry or outputs");
    if (b->n_seqs > c->max_seqs)
        return ferr(c, KVD_ETOOLARGE, "forward: %u sequences, the context holds %u", b->n_seqs,
                    c->max_seqs);
    if (g->layers != hp->n_layer || g->kv_heads != hp->n_head_kv || g->head_dim != hp->head_dim ||
        g->block_tokens == 0 || kv_row_bytes(g->dtype, g->head_dim) == 0)
        return ferr(c, KVD_EBADREQ,
                    "forward: KV geometry (layers %u, kv_heads %u, head_dim %u, "
                    "block_tokens %u, dtype %s) does not match the model (%u, %u, %u) or cannot "
                    "hold it",
                    g->layers, g->kv_heads, g->head_dim, g->block_tokens, kv_dtype_name(g->dtype),
                    hp->n_layer, hp->n_head_kv, hp->head_dim);
    for (uint32_t s = 0; s < b->n_seqs; s++) {
        const struct fwd_seq *q = &b->seqs[s];
        if (q->n_tokens == 0 || !q->tokens || !q->slots)
            return ferr(c, KVD_EBADREQ, "forward: sequence %u has no tokens or no block table", s);
        T += q->n_tokens;
        if (T > c->max_tokens)
            return ferr(c, KVD_ETOOLARGE, "forward: more than %u tokens in one step",
                        c->max_tokens);
        uint64_t end = (uint64_t)q->pos0 + q->n_tokens;
        if (end > hp->n_ctx)
            return ferr(c, KVD_EBADREQ,
                        "forward: sequence %u reaches position %" PRIu64
                        ", past the model's context of %u",
                        s, end, hp->n_ctx);
        uint64_t need = (end + g->block_tokens - 1) / g->block_tokens;
        if (q->n_slots < need)
            return ferr(c, KVD_EBADREQ, "forward: sequence %u needs %" PRIu64 " blocks, has %u", s,
                        need, q->n_slots);
        NS += need;
        for (uint32_t i = 0; i < q->n_tokens; i++)
            if (q->tokens[i] >= hp->n_vocab)
                return ferr(c, KVD_EBADREQ,
                            "forward: sequence %u token %u is %u, outside the "
                            "vocabulary of %u",
                            s, i, q->tokens[i], hp->n_vocab);
        for (uint64_t i = 0; i < need; i++)
            if (b->n_arena_slots && q->slots[i] >= b->n_arena_slots)
                return ferr(c, KVD_EBADREQ,
                            "forward: sequence %u block %" PRIu64 " is slot %u, "
                            "outside the arena of %u",
                            s, i, q->slots[i], b->n_arena_slots);
        if (end > *max_kv)
            *max_kv = (uint32_t)end;
        if (q->n_tokens > *max_q)
            *max_q = q->n_tokens;
    }
    int rc = grow(c, NS, NS);
    if (rc)
        return rc;
    /* A block written this step (it holds a new position) must appear exactly
     * once in the whole batch; blocks only read (a shared prefix) may repeat.
     * Only the written blocks are sorted (a decode step writes one or two
     * per sequence); every other entry is looked up among them. */
    size_t w = 0;
    for (uint32_t s = 0; s < b->n_seqs; s++) {
        const struct fwd_seq *q = &b->seqs[s];
        uint64_t need = ((uint64_t)q->pos0 + q->n_tokens + g->block_tokens - 1) / g->block_tokens;
        for (uint64_t i = q->pos0 / g->block_tokens; i < need; i++)
            c->conflict[w++] = q->slots[i];
    }
    qsort(c->conflict, w, sizeof *c->conflict, cmp_u64);
    for (size_t i = 1; i < w; i++)
        if (c->conflict[i] == c->conflict[i - 1])
            return ferr(c, KVD_EBADREQ,
                        "forward: block slot %" PRIu64 " is written by one sequence "
                        "and also used elsewhere in the same step",
                        c->conflict[i]);
    for (uint32_t s = 0; s < b->n_seqs && w; s++) {
        const struct fwd_seq *q = &b->seqs[s];
        uint64_t first_w = q->pos0 / g->block_tokens;
        for (uint64_t i = 0; i < first_w; i++) {
            size_t lo = 0, hi = w;
            while (lo < hi) {
                size_t mid = (lo + hi) / 2;
                if (c->conflict[mid] < q->slots[i])
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo < w && c->conflict[lo] == q->slots[i])
                return ferr(c, KVD_EBADREQ,
                            "forward: block slot %u is written by one sequence "
                            "and also used elsewhere in the same step",
                            q->slots[i]);
        }
    }
    *n_tokens = (uint32_t)T;
    *n_slots = NS;
    return 0;
}

int model_forward(struct model *m, struct fwd_ctx *c, const struct fwd_batch *b)
{
    const struct model_hparams *hp = &m->hp;
    const struct compute_ops *o = m->ops;
    struct compute_ctx *cx = m->cx;
    const struct kv_geom *g = b->geom;
    uint32_t T = 0, max_kv = 0, max_q = 0, S = b->n_seqs;
    size_t NS = 0;
    int rc;
    if (c->m != m)
        return ferr(c, KVD_EINTERNAL, "forward: fwd_ctx belongs to another model");
    if ((rc = validate(c, b, &T, &NS, &max_kv, &max_q)))
        return rc;

    /* A decode-only step may be padded to the backend's bucket (compute.h
     * step_bucket): Sp sequences, Tp rows; the pads are sequences of no rows
     * and rows of no sequence. */
    uint32_t Sp = S;
    if (max_q == 1 && o->step_bucket) {
        uint32_t cap = c->max_seqs < c->max_tokens ? c->max_seqs : c->max_tokens;
        Sp = o->step_bucket(cx, S);
        Sp = Sp < S ? S : Sp > cap ? cap : Sp;
    }
    uint32_t Tp = T + (Sp - S);

    /* host metadata -> one upload */
    uint32_t Tm = c->max_tokens, Sm = c->max_seqs;
    uint32_t *tokens = c->hmeta, *pos = tokens + Tm, *tok_slot = pos + Tm, *qstart = tok_slot + Tm,
             *pos0 = qstart + Sm + 1, *slot0 = pos0 + Sm, *last_rows = slot0 + Sm + 1;
    uint32_t t = 0, ns = 0;
    for (uint32_t s = 0; s < S; s++) {
        const struct fwd_seq *q = &b->seqs[s];
        uint32_t need =
            (uint32_t)(((uint64_t)q->pos0 + q->n_tokens + g->block_tokens - 1) / g->block_tokens);
        qstart[s] = t;
        pos0[s] = q->pos0;
        slot0[s] = ns;
        memcpy(c->hslots + ns, q->slots, (size_t)need * 4);
        for (uint32_t i = 0; i < q->n_tokens; i++, t++) {
            tokens[t] = q->tokens[i];
            pos[t] = q->pos0 + i;
            tok_slot[t] = q->slots[pos[t] / g->block_tokens];
        }
        last_rows[s] = t - 1;
        ns += need;
    }
    for (uint32_t s = S; s <= Sp; s++) {
        qstart[s] = T;
        slot0[s] = ns;
        if (s < Sp) {
            pos0[s] = 0;
            last_rows[s] = 0;
        }
    }
    for (; t < Tp; t++) {
        tokens[t] = 0;
        pos[t] = 0;
        tok_slot[t] = COMPUTE_PAD_SLOT;
    }
    if (b->sample) {
        memcpy(c->hsample, b->sample, (size_t)S * sizeof *b->sample);
        for (uint32_t s = S; s < Sp; s++)
            c->hsample[s] = (struct sample_row){.skip = 1};
    }
    if ((rc = o->upload(cx, c->meta, c->hmeta, c->meta_words * 4)) ||
        (rc = o->upload(cx, c->slots, c->hslots, NS * 4)) ||
        (b->sample && (rc = o->upload(cx, c->sample, c->hsample, (size_t)Sp * sizeof *c->hsample))))
        return ferr(c, rc, "forward: metadata upload failed");
    const uint32_t *d_tokens = c->meta, *d_pos = d_tokens + Tm, *d_tok_slot = d_pos + Tm,
                   *d_qstart = d_tok_slot + Tm, *d_pos0 = d_qstart + Sm + 1, *d_slot0 = d_pos0 + Sm,
                   *d_last = d_slot0 + Sm + 1;

    uint32_t E = hp->n_embd, QD = hp->n_head * hp->head_dim, KD = hp->n_head_kv * hp->head_dim;
    const float *ff = hp->has_rope_freqs ? m->rope_freqs.data : NULL;
    struct attn_desc ad = {
        .q = c->q,
        .out = c->att,
        .arena = b->kv_arena,
        .geom = g,
        .n_head = hp->n_head,
        .scale = 1.0f / sqrtf((float)hp->head_dim),
        .n_tokens = Tp,
        .n_seqs = Sp,
        .seq_qstart = d_qstart,
        .seq_pos0 = d_pos0,
        .seq_slot0 = d_slot0,
        .slots = c->slots,
        .max_q = max_q,
        .max_kv = max_kv,
        .h_seq_qstart = qstart,
        .h_seq_pos0 = pos0,
    };
    /* Optional whole-step capture/replay (CUDA graphs; NULL on cpu). */
    int replayed = 0;
    struct compute_step cstep = {.owner = c,
                                 .arena = b->kv_arena,
                                 .tables = c->slots,
                                 .n_tokens = Tp,
                                 .n_seqs = Sp,
                                 .max_q = max_q,
                                 .max_kv = max_kv,
                                 .sampled = b->sample != NULL};
    if (o->step_begin && (rc = o->step_begin(cx, &cstep, &replayed)))
        return ferr(c, rc, "forward: step start failed on the %s backend", o->name);
#define RUN(call)                                                                                  \
    do {                                                                                           \
        if ((rc = (call))) {                                                                       \
            if (o->step_end)                                                                       \
                o->step_end(cx, rc);                                                               \
            return ferr(c, rc, "forward: %s failed on the %s backend", #call, o->name);            \
        }                                                                                          \
    } while (0)
    if (replayed)
        goto download;
    RUN(o->get_rows(cx, &m->tok_embd, d_tokens, Tp, c->x));
    RUN(o->rmsnorm(cx, c->h, c->x, m->layers[0].attn_norm.data, Tp, E, hp->rms_eps));
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        /* attention block: x += Wo . attn(rope(Wq h), rope(Wk h), Wv h), h = norm(x)
         * (h is already normed: each residual add is fused with the norm after it) */
        const struct ctensor *wqkv[3] = {&L->wq, &L->wk, &L->wv};
        const float *bqkv[3] = {hp->has_qkv_bias ? L->bq.data : NULL,
                                hp->has_qkv_bias ? L->bk.data : NULL,
                                hp->has_qkv_bias ? L->bv.data : NULL};
        float *yqkv[3] = {c->q, c->k, c->v};
        const float *next_norm = l + 1 < hp->n_layer ? m->layers[l + 1].attn_norm.data : NULL;
        if (o->matmul_n) {
            RUN(o->matmul_n(cx, 3, wqkv, bqkv, c->h, Tp, yqkv));
        } else {
            for (int i = 0; i < 3; i++)
                RUN(o->matmul(cx, wqkv[i], c->h, Tp, yqkv[i]));
            if (hp->has_qkv_bias) {
                RUN(o->add_bias(cx, c->q, L->bq.data, Tp, QD));
                RUN(o->add_bias(cx, c->k, L->bk.data, Tp, KD));
                RUN(o->add_bias(cx, c->v, L->bv.data, Tp, KD));
            }
        }
        if (o->rope_kv_write) {
            RUN(o->rope_kv_write(cx, c->q, c->k, c->v, Tp, hp->n_head, hp->n_rot, d_pos,
                                 hp->rope_mode, hp->rope_base, ff, b->kv_arena, g, l, d_tok_slot));
        } else {
            RUN(o->rope(cx, c->q, Tp, hp->n_head, hp->head_dim, hp->n_rot, d_pos, hp->rope_mode,
                        hp->rope_base, ff));
            RUN(o->rope(cx, c->k, Tp, hp->n_head_kv, hp->head_dim, hp->n_rot, d_pos, hp->rope_mode,
                        hp->rope_base, ff));
            RUN(o->kv_write(cx, b->kv_arena, g, l, c->k, c->v, Tp, d_tok_slot, d_pos));
        }
        ad.layer = l;
        RUN(o->attention(cx, &ad));
        if (o->matmul_add_rmsnorm) {
            RUN(o->matmul_add_rmsnorm(cx, &L->wo, c->att, Tp, c->x, L->ffn_norm.data, hp->rms_eps,
                                      c->h));
        } else {
            RUN(o->matmul(cx, &L->wo, c->att, Tp, c->h));
            RUN(o->add_rmsnorm(cx, c->x, c->h, c->h, L->ffn_norm.data, Tp, E, hp->rms_eps));
        }
        /* MLP block: x += down(silu(gate h) * up h), h = norm(x) */
        if (o->matmul_swiglu) {
            RUN(o->matmul_swiglu(cx, &L->gate, &L->up, c->h, Tp, c->gate, c->up));
        } else {
            RUN(o->matmul(cx, &L->gate, c->h, Tp, c->gate));
            RUN(o->matmul(cx, &L->up, c->h, Tp, c->up));
            RUN(o->silu_mul(cx, c->gate, c->up, (size_t)Tp * hp->n_ff));
        }
        if (o->matmul_add_rmsnorm) {
            RUN(o->matmul_add_rmsnorm(cx, &L->down, c->gate, Tp, c->x, next_norm, hp->rms_eps,
                                      c->h));
        } else {
            RUN(o->matmul(cx, &L->down, c->gate, Tp, c->h));
            if (next_norm)
                RUN(o->add_rmsnorm(cx, c->x, c->h, c->h, next_norm, Tp, E, hp->rms_eps));
            else
                RUN(o->add(cx, c->x, c->h, (size_t)Tp * E));
        }
    }
    RUN(o->gather_rows(cx, c->last, c->x, d_last, Sp, E));
    RUN(o->rmsnorm(cx, c->last, c->last, m->output_norm.data, Sp, E, hp->rms_eps));
    RUN(o->matmul(cx, &m->output, c->last, Sp, c->logits));
    if (b->sample)
        RUN(o->sample(cx, c->logits, Sp, hp->n_vocab, c->sample, c->ids));
    if (o->step_end && (rc = o->step_end(cx, 0)))
        return ferr(c, rc, "forward: step failed on the %s backend", o->name);
download:
    if (b->sample)
        RUN(o->download(cx, b->tokens, c->ids, (size_t)S * 4));
    if (b->logits)
        RUN(o->download(cx, b->logits, c->logits, (size_t)S * hp->n_vocab * 4));
#undef RUN
    return 0;
}

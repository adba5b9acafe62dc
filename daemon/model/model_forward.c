/* The forward step over paged KV, written once against the compute-ops
 * table: validate the batch, upload its token/position/block-table metadata,
 * then embedding -> n_layer x (attention block, MLP block) -> final norm ->
 * logits of each output row (a sequence's last new token, or all of a
 * verification's) -> (optionally) the token sampled from them. Shapes are
 * in the comments of struct fwd_ctx; T = tokens in the step, S =
 * sequences, O = output rows. */
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
    uint32_t max_tokens, max_seqs, max_out;
    /* device activations, Tm = max_tokens, E = n_embd, QD = n_head*head_dim,
     * KD = n_head_kv*head_dim, F = n_ff, V = n_vocab, Sm = max_seqs,
     * Om = max_out */
    float *x;                            /* [Tm][E] residual stream */
    float *h;                            /* [Tm][E] normed input / projection output */
    float *q;                            /* [Tm][QD] */
    float *k, *v;                        /* [Tm][KD] */
    float *att;                          /* [Tm][QD] attention output */
    float *gate;                         /* [Tm][F] */
    float *up;                           /* [Tm][F] */
    float *last;                         /* [Om][E] output rows */
    float *logits;                       /* [Om][V] */
    struct sample_row *sample, *hsample; /* [Om] the step's sampling rows, device and host */
    uint32_t *ids;                       /* [Om] sampled tokens */
    /* metadata, device and host mirror, u32: tokens[Tm] pos[Tm] tok_slot[Tm]
     * qstart[Sm+1] pos0[Sm] slot0[Sm+1] out_rows[Om] dec_qstart[Tm+1]
     * dec_pos0[Tm] dec_slot0[Tm] (the last three: attn_desc's decode rows) */
    uint32_t *meta, *hmeta;
    size_t meta_words;
    uint32_t *slots, *hslots; /* block tables, concatenated; grown on demand */
    size_t slots_cap;
    uint64_t *conflict; /* host scratch for the write-conflict check */
    size_t conflict_cap;
    fwd_trace_fn trace; /* fwd_ctx_set_trace; NULL: none */
    void *trace_ud;
    float *trace_buf; /* host [max(Tm * max(E, QD, F), Om * V)] */
    size_t dev_bytes; /* the backend's bytes for the buffers above (atomic) */
    /* A submitted step's outputs, for model_forward_finish: where its
     * tokens [n_out] and logits [n_out][V] go (the caller's; NULL: not
     * asked), and whether a submit awaits its finish. */
    uint32_t *pend_tokens;
    float *pend_logits;
    uint32_t pend_out;
    bool pending;
    char err[256];
};

/* The backend's device bytes of m's context now (0 without dev_bytes). */
static size_t cx_bytes(const struct model *m)
{
    return m->ops->dev_bytes ? m->ops->dev_bytes(m->cx) : 0;
}

/* Adds what the context's bytes grew by since before to c's own. */
static void count_bytes(struct fwd_ctx *c, size_t before)
{
    size_t now = cx_bytes(c->m);
    if (now >= before)
        __atomic_add_fetch(&c->dev_bytes, now - before, __ATOMIC_RELAXED);
    else
        __atomic_sub_fetch(&c->dev_bytes, before - now, __ATOMIC_RELAXED);
}

size_t fwd_ctx_dev_bytes(const struct fwd_ctx *c)
{
    return c ? __atomic_load_n(&c->dev_bytes, __ATOMIC_RELAXED) : 0;
}

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
    free(c->trace_buf);
    free(c);
}

int fwd_ctx_set_trace(struct fwd_ctx *c, fwd_trace_fn fn, void *ud)
{
    const struct model_hparams *hp = &c->m->hp;
    size_t w = hp->n_embd, qd = (size_t)hp->n_head * hp->head_dim;
    w = qd > w ? qd : w;
    w = hp->n_ff > w ? hp->n_ff : w;
    size_t n = (size_t)c->max_tokens * w, nl = (size_t)c->max_out * hp->n_vocab;
    free(c->trace_buf);
    c->trace_buf = NULL;
    c->trace = NULL;
    if (!fn)
        return 0;
    if (!(c->trace_buf = malloc((n > nl ? n : nl) * sizeof(float))))
        return KVD_ENOMEM;
    c->trace = fn;
    c->trace_ud = ud;
    return 0;
}

/* Shows the trace function an op's output dev [rows][cols]; copies it back
 * when the function changed it. */
static int trace_out(struct fwd_ctx *c, const char *name, int layer, float *dev, uint32_t rows,
                     uint32_t cols)
{
    const struct compute_ops *o = c->m->ops;
    size_t bytes = (size_t)rows * cols * sizeof(float);
    int rc = o->download(c->m->cx, c->trace_buf, dev, bytes);
    if (rc)
        return rc;
    int r = c->trace(c->trace_ud, name, layer, c->trace_buf, rows, cols);
    if (r < 0)
        return KVD_EINTERNAL;
    return r > 0 ? o->upload(c->m->cx, dev, c->trace_buf, bytes) : 0;
}

uint64_t fwd_ctx_bytes(const struct model_hparams *hp, uint32_t max_batch_tokens, uint32_t max_seqs,
                       uint32_t max_out)
{
    uint64_t T = max_batch_tokens, S = max_seqs, O = max_out, E = hp->n_embd,
             QD = (uint64_t)hp->n_head * hp->head_dim, KD = (uint64_t)hp->n_head_kv * hp->head_dim,
             F = hp->n_ff, V = hp->n_vocab;
    /* the float buffers of fwd_ctx_new_out, its metadata, sample rows and ids */
    uint64_t floats = 2 * T * E + 2 * T * QD + 2 * T * KD + 2 * T * F + O * E + O * V;
    return floats * sizeof(float) + (6 * T + 3 * S + O + 3) * 4 +
           O * (sizeof(struct sample_row) + sizeof(uint32_t));
}

int fwd_ctx_new(struct model *m, uint32_t max_batch_tokens, uint32_t max_seqs, struct fwd_ctx **out)
{
    return fwd_ctx_new_out(m, max_batch_tokens, max_seqs, max_seqs, out);
}

int fwd_ctx_new_out(struct model *m, uint32_t max_batch_tokens, uint32_t max_seqs, uint32_t max_out,
                    struct fwd_ctx **out)
{
    const struct model_hparams *hp = &m->hp;
    struct fwd_ctx *c = calloc(1, sizeof *c);
    *out = NULL;
    if (!c)
        return KVD_ENOMEM;
    if (max_batch_tokens == 0 || max_seqs == 0 || max_seqs > max_batch_tokens ||
        max_batch_tokens > (1u << 20) || max_out < max_seqs || max_out > max_batch_tokens) {
        free(c);
        return KVD_EBADREQ;
    }
    c->m = m;
    size_t before = cx_bytes(m);
    c->max_tokens = max_batch_tokens;
    c->max_seqs = max_seqs;
    c->max_out = max_out;
    size_t T = max_batch_tokens, S = max_seqs, O = max_out, E = hp->n_embd,
           QD = (size_t)hp->n_head * hp->head_dim, KD = (size_t)hp->n_head_kv * hp->head_dim,
           F = hp->n_ff, V = hp->n_vocab;
    struct {
        float **p;
        size_t n;
    } want[] = {{&c->x, T * E},    {&c->h, T * E},     {&c->q, T * QD},   {&c->k, T * KD},
                {&c->v, T * KD},   {&c->att, T * QD},  {&c->gate, T * F}, {&c->up, T * F},
                {&c->last, O * E}, {&c->logits, O * V}};
    int rc = 0;
    for (size_t i = 0; i < sizeof want / sizeof want[0] && !rc; i++)
        rc = m->ops->buf_alloc(m->cx, want[i].n * sizeof(float), (void **)want[i].p);
    c->meta_words = 6 * T + 3 * S + O + 3;
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, c->meta_words * 4, (void **)&c->meta);
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, O * sizeof(struct sample_row), (void **)&c->sample);
    if (!rc)
        rc = m->ops->buf_alloc(m->cx, O * sizeof(uint32_t), (void **)&c->ids);
    c->hmeta = malloc(c->meta_words * 4);
    c->hsample = malloc(O * sizeof *c->hsample);
    if (rc || !c->hmeta || !c->hsample) {
        fwd_ctx_free(c);
        return KVD_ENOMEM;
    }
    count_bytes(c, before);
    *out = c;
    return 0;
}

static int grow(struct fwd_ctx *c, size_t n_slots, size_t n_conflict)
{
    if (n_slots > c->slots_cap) {
        size_t cap = n_slots * 2;
        uint32_t *d = NULL, *h = malloc(cap * 4);
        size_t before = cx_bytes(c->m);
        if (!h || c->m->ops->buf_alloc(c->m->cx, cap * 4, (void **)&d)) {
            free(h);
            return ferr(c, KVD_ENOMEM, "forward: out of memory for block tables");
        }
        c->m->ops->buf_free(c->m->cx, c->slots);
        count_bytes(c, before);
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
                    size_t *n_slots, uint32_t *max_kv, uint32_t *max_q, uint32_t *n_out)
{
    const struct model_hparams *hp = &c->m->hp;
    const struct kv_geom *g = b->geom;
    uint64_t T = 0, NS = 0, O = 0;
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
        O += q->all_rows ? q->n_tokens : 1;
        if (O > c->max_out)
            return ferr(c, KVD_ETOOLARGE, "forward: more than %u output rows in one step",
                        c->max_out);
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
    *n_out = (uint32_t)O;
    return 0;
}

/* A bucket b for a count of n, where at most cap fit (n <= cap). */
static uint32_t pad_to(uint32_t b, uint32_t n, uint32_t cap)
{
    return b < n ? n : b > cap ? cap : b;
}

int model_forward(struct model *m, struct fwd_ctx *c, const struct fwd_batch *b)
{
    int rc = model_forward_submit(m, c, b);
    return rc ? rc : model_forward_finish(m, c);
}

bool model_async(const struct model *m)
{
    return m->ops->async;
}

int model_forward_finish(struct model *m, struct fwd_ctx *c)
{
    const struct compute_ops *o = m->ops;
    int rc;
    if (!c->pending)
        return 0;
    c->pending = false;
    /* the first download waits for every op of the step */
    if (c->pend_tokens &&
        (rc = o->download(m->cx, c->pend_tokens, c->ids, (size_t)c->pend_out * 4)))
        return ferr(c, rc, "forward: the sampled tokens' download failed on the %s backend",
                    o->name);
    if (c->pend_logits && (rc = o->download(m->cx, c->pend_logits, c->logits,
                                            (size_t)c->pend_out * m->hp.n_vocab * 4)))
        return ferr(c, rc, "forward: the logits' download failed on the %s backend", o->name);
    return 0;
}

int model_forward_submit(struct model *m, struct fwd_ctx *c, const struct fwd_batch *b)
{
    const struct model_hparams *hp = &m->hp;
    const struct compute_ops *o = m->ops;
    struct compute_ctx *cx = m->cx;
    const struct kv_geom *g = b->geom;
    uint32_t T = 0, max_kv = 0, max_q = 0, S = b->n_seqs, O = 0;
    size_t NS = 0;
    int rc;
    if (c->m != m)
        return ferr(c, KVD_EINTERNAL, "forward: fwd_ctx belongs to another model");
    if (c->pending)
        return ferr(c, KVD_EINTERNAL, "forward: a submitted step was not finished");
    if ((rc = validate(c, b, &T, &NS, &max_kv, &max_q, &O)))
        return rc;

    /* A decode-only step may be padded to the backend's bucket (compute.h
     * step_bucket): Sp sequences, Tp rows; the pads are sequences of no rows
     * and rows of no sequence. */
    uint32_t Sp = S;
    if (max_q == 1 && o->step_bucket) {
        uint32_t cap = c->max_seqs < c->max_tokens ? c->max_seqs : c->max_tokens;
        cap = cap < c->max_out ? cap : c->max_out;
        Sp = o->step_bucket(cx, S);
        Sp = Sp < S ? S : Sp > cap ? cap : Sp;
    }
    uint32_t Tp = T + (Sp - S), Op = O + (Sp - S), max_qp = max_q;
    /* A mixed step (compute.h row_bucket): its sequences padded as a
     * decode step's, its rows, output rows and max_q each to the backend's
     * row bucket. The pad sequences have no rows here; each has an output
     * row (row 0), as have the pad output rows past them. */
    if (max_q > 1 && o->row_bucket && o->step_bucket && !c->trace) {
        Sp = pad_to(o->step_bucket(cx, S), S, c->max_seqs);
        Sp = pad_to(Sp, S, S + (c->max_out - O));
        Tp = pad_to(o->row_bucket(cx, T), T, c->max_tokens);
        Op = pad_to(o->row_bucket(cx, O + (Sp - S)), O + (Sp - S), c->max_out);
        max_qp = pad_to(o->row_bucket(cx, max_q), max_q, Tp);
    }

    /* host metadata -> one upload */
    uint32_t Tm = c->max_tokens, Sm = c->max_seqs, Om = c->max_out;
    uint32_t *tokens = c->hmeta, *pos = tokens + Tm, *tok_slot = pos + Tm, *qstart = tok_slot + Tm,
             *pos0 = qstart + Sm + 1, *slot0 = pos0 + Sm, *last_rows = slot0 + Sm + 1,
             *dec_qstart = last_rows + Om, *dec_pos0 = dec_qstart + Tm + 1,
             *dec_slot0 = dec_pos0 + Tm;
    /* The batch-invariant prefix: the leading sequences that decode or
     * verify (s_dec of them, n_dec rows), each row its own one-token
     * "sequence" for the attention. */
    uint32_t s_dec = 0, n_dec = 0;
    if (b->invariant)
        while (s_dec < S && (b->seqs[s_dec].n_tokens == 1 || b->seqs[s_dec].all_rows))
            n_dec += b->seqs[s_dec++].n_tokens;
    uint32_t t = 0, ns = 0, nout = 0;
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
            if (q->all_rows)
                last_rows[nout++] = t;
            if (s < s_dec) {
                dec_qstart[t] = t;
                dec_pos0[t] = pos[t];
                dec_slot0[t] = ns;
            }
        }
        if (!q->all_rows)
            last_rows[nout++] = t - 1;
        ns += need;
    }
    dec_qstart[n_dec] = n_dec;
    for (uint32_t s = S; s <= Sp; s++) {
        qstart[s] = T;
        slot0[s] = ns;
        if (s < Sp)
            pos0[s] = 0;
    }
    while (nout < Op)
        last_rows[nout++] = 0;
    for (; t < Tp; t++) {
        tokens[t] = 0;
        pos[t] = 0;
        tok_slot[t] = COMPUTE_PAD_SLOT;
    }
    if (b->sample) {
        memcpy(c->hsample, b->sample, (size_t)O * sizeof *b->sample);
        for (uint32_t r = O; r < Op; r++)
            c->hsample[r] = (struct sample_row){.skip = 1};
    }
    if ((rc = o->upload(cx, c->meta, c->hmeta, c->meta_words * 4)) ||
        (rc = o->upload(cx, c->slots, c->hslots, NS * 4)) ||
        (b->sample && (rc = o->upload(cx, c->sample, c->hsample, (size_t)Op * sizeof *c->hsample))))
        return ferr(c, rc, "forward: metadata upload failed");
    const uint32_t *d_tokens = c->meta, *d_pos = d_tokens + Tm, *d_tok_slot = d_pos + Tm,
                   *d_qstart = d_tok_slot + Tm, *d_pos0 = d_qstart + Sm + 1, *d_slot0 = d_pos0 + Sm,
                   *d_last = d_slot0 + Sm + 1, *d_dec_qstart = d_last + Om,
                   *d_dec_pos0 = d_dec_qstart + Tm + 1, *d_dec_slot0 = d_dec_pos0 + Tm;
    /* The invariant prefix's rows take the one-row matmul arithmetic
     * (n_one rows of the step, n_one_out of the output rows); a backend
     * without matmul_inv has none other. */
    bool inv = b->invariant && o->matmul_inv;
    /* the fused ops' one-row arithmetic takes those rows */
    uint32_t n_one = inv ? n_dec : 0;
    uint32_t n_out_dec = 0;
    for (uint32_t s = 0; s < s_dec; s++)
        n_out_dec += b->seqs[s].all_rows ? b->seqs[s].n_tokens : 1;

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
        .max_q = max_qp,
        .max_kv = max_kv,
        .h_seq_qstart = qstart,
        .h_seq_pos0 = pos0,
        .alone = b->invariant,
        /* a decode-only step's rows are decode rows already */
        .n_dec = b->invariant && max_q > 1 ? n_dec : 0,
        .s_dec = b->invariant && max_q > 1 ? s_dec : 0,
        .dec_qstart = d_dec_qstart,
        .dec_pos0 = d_dec_pos0,
        .dec_slot0 = d_dec_slot0,
    };
    /* Optional whole-step capture/replay (CUDA graphs; NULL on cpu). */
    int replayed = 0;
    bool stepped = o->step_end && !c->trace;
    struct compute_step cstep = {.owner = c,
                                 .arena = b->kv_arena,
                                 .tables = c->slots,
                                 .n_tokens = Tp,
                                 .n_seqs = Sp,
                                 .n_out = Op,
                                 .max_q = max_qp,
                                 .max_kv = max_kv,
                                 .sampled = b->sample != NULL,
                                 .alone = b->invariant,
                                 .n_one = n_one,
                                 .n_dec = ad.n_dec,
                                 .s_dec = ad.s_dec,
                                 .n_out_one = inv ? n_out_dec : 0};
    if (o->step_begin && !c->trace && (rc = o->step_begin(cx, &cstep, &replayed)))
        return ferr(c, rc, "forward: step start failed on the %s backend", o->name);
#define MATMUL(w, x, rows, inv_rows, y)                                                            \
    (inv ? o->matmul_inv(cx, w, x, rows, inv_rows, y) : o->matmul(cx, w, x, rows, y))
#define RUN(call)                                                                                  \
    do {                                                                                           \
        if ((rc = (call))) {                                                                       \
            if (stepped)                                                                           \
                o->step_end(cx, rc);                                                               \
            return ferr(c, rc, "forward: %s failed on the %s backend", #call, o->name);            \
        }                                                                                          \
    } while (0)
/* after an op: its output to the trace, if one is set */
#define TRACE(name, layer, dev, rows, cols)                                                        \
    do {                                                                                           \
        if (c->trace && (rc = trace_out(c, name, layer, dev, rows, cols)))                         \
            return ferr(c, rc, "forward: the trace stopped the step at %s", name);                 \
    } while (0)
    if (replayed)
        goto download;
    RUN(o->get_rows(cx, &m->tok_embd, d_tokens, Tp, c->x));
    TRACE("embd", -1, c->x, Tp, E);
    RUN(o->rmsnorm(cx, c->h, c->x, m->layers[0].attn_norm.data, Tp, E, hp->rms_eps));
    TRACE("attn_norm", 0, c->h, Tp, E);
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        int il = (int)l;
        /* attention block: x += Wo . attn(rope(Wq h), rope(Wk h), Wv h), h = norm(x)
         * (h is already normed: each residual add is fused with the norm after it) */
        /* The fused ops (NULL on cpu) run a chain as fewer kernels; a trace
         * wants every op's output, so it takes the chains. */
        const bool fuse = !c->trace;
        bool roped = false; /* RoPE and the KV write done with the projections */
        if (o->matmul_qkv_rope_kv && fuse) {
            const struct ctensor *wqkv[3] = {&L->wq, &L->wk, &L->wv};
            const float *bqkv[3] = {hp->has_qkv_bias ? L->bq.data : NULL,
                                    hp->has_qkv_bias ? L->bk.data : NULL,
                                    hp->has_qkv_bias ? L->bv.data : NULL};
            float *yqkv[3] = {c->q, c->k, c->v};
            const struct rope_kv_args ra = {.n_head = hp->n_head,
                                            .n_rot = hp->n_rot,
                                            .pos = d_pos,
                                            .mode = hp->rope_mode,
                                            .base = hp->rope_base,
                                            .freq_factors = ff,
                                            .arena = b->kv_arena,
                                            .geom = g,
                                            .layer = l,
                                            .tok_slot = d_tok_slot};
            RUN(o->matmul_qkv_rope_kv(cx, wqkv, bqkv, c->h, Tp, n_one, yqkv, &ra));
            roped = true;
        } else if (o->matmul_n && fuse) {
            const struct ctensor *wqkv[3] = {&L->wq, &L->wk, &L->wv};
            const float *bqkv[3] = {hp->has_qkv_bias ? L->bq.data : NULL,
                                    hp->has_qkv_bias ? L->bk.data : NULL,
                                    hp->has_qkv_bias ? L->bv.data : NULL};
            float *yqkv[3] = {c->q, c->k, c->v};
            RUN(o->matmul_n(cx, 3, wqkv, bqkv, c->h, Tp, n_one, yqkv));
        } else {
            RUN(MATMUL(&L->wq, c->h, Tp, n_dec, c->q));
            TRACE("Qcur", il, c->q, Tp, QD);
            RUN(MATMUL(&L->wk, c->h, Tp, n_dec, c->k));
            TRACE("Kcur", il, c->k, Tp, KD);
            RUN(MATMUL(&L->wv, c->h, Tp, n_dec, c->v));
            TRACE("Vcur", il, c->v, Tp, KD);
            if (hp->has_qkv_bias) {
                RUN(o->add_bias(cx, c->q, L->bq.data, Tp, QD));
                TRACE("Qcur.bias", il, c->q, Tp, QD);
                RUN(o->add_bias(cx, c->k, L->bk.data, Tp, KD));
                TRACE("Kcur.bias", il, c->k, Tp, KD);
                RUN(o->add_bias(cx, c->v, L->bv.data, Tp, KD));
                TRACE("Vcur.bias", il, c->v, Tp, KD);
            }
        }
        if (!roped && o->rope_kv_write && fuse) {
            RUN(o->rope_kv_write(cx, c->q, c->k, c->v, Tp, hp->n_head, hp->n_rot, d_pos,
                                 hp->rope_mode, hp->rope_base, ff, b->kv_arena, g, l, d_tok_slot));
        } else if (!roped) {
            RUN(o->rope(cx, c->q, Tp, hp->n_head, hp->head_dim, hp->n_rot, d_pos, hp->rope_mode,
                        hp->rope_base, ff));
            TRACE("Qcur.rope", il, c->q, Tp, QD);
            RUN(o->rope(cx, c->k, Tp, hp->n_head_kv, hp->head_dim, hp->n_rot, d_pos, hp->rope_mode,
                        hp->rope_base, ff));
            TRACE("Kcur.rope", il, c->k, Tp, KD);
            RUN(o->kv_write(cx, b->kv_arena, g, l, c->k, c->v, Tp, d_tok_slot, d_pos));
        }
        ad.layer = l;
        RUN(o->attention(cx, &ad));
        TRACE("kqv_out", il, c->att, Tp, QD);
        if (o->matmul_add_rmsnorm && fuse) {
            if (o->next_readers) { /* h is read by gate and up next */
                const struct ctensor *rd[2] = {&L->gate, &L->up};
                o->next_readers(cx, c->h, 2, rd);
            }
            RUN(o->matmul_add_rmsnorm(cx, &L->wo, c->att, Tp, n_one, c->x, L->ffn_norm.data,
                                      hp->rms_eps, c->h));
        } else {
            RUN(MATMUL(&L->wo, c->att, Tp, n_dec, c->h));
            TRACE("attn_wo", il, c->h, Tp, E);
            RUN(o->add_rmsnorm(cx, c->x, c->h, c->h, L->ffn_norm.data, Tp, E, hp->rms_eps));
            TRACE("ffn_inp", il, c->x, Tp, E);
            TRACE("ffn_norm", il, c->h, Tp, E);
        }
        /* MLP block: x += down(silu(gate h) * up h), h = norm(x) */
        if (o->matmul_swiglu && fuse) {
            if (o->next_readers) { /* the SwiGLU output is down's input */
                const struct ctensor *rd[1] = {&L->down};
                o->next_readers(cx, c->gate, 1, rd);
            }
            RUN(o->matmul_swiglu(cx, &L->gate, &L->up, c->h, Tp, n_one, c->gate, c->up));
        } else {
            RUN(MATMUL(&L->gate, c->h, Tp, n_dec, c->gate));
            TRACE("ffn_gate", il, c->gate, Tp, hp->n_ff);
            RUN(MATMUL(&L->up, c->h, Tp, n_dec, c->up));
            TRACE("ffn_up", il, c->up, Tp, hp->n_ff);
            RUN(o->silu_mul(cx, c->gate, c->up, (size_t)Tp * hp->n_ff));
            TRACE("ffn_swiglu", il, c->gate, Tp, hp->n_ff);
        }
        const float *next_norm = l + 1 < hp->n_layer ? m->layers[l + 1].attn_norm.data : NULL;
        if (o->matmul_add_rmsnorm && fuse) {
            if (o->next_readers && next_norm) { /* h: the next layer's q, k, v */
                const struct model_layer *N = &m->layers[l + 1];
                const struct ctensor *rd[3] = {&N->wq, &N->wk, &N->wv};
                o->next_readers(cx, c->h, 3, rd);
            }
            RUN(o->matmul_add_rmsnorm(cx, &L->down, c->gate, Tp, n_one, c->x, next_norm,
                                      hp->rms_eps, c->h));
        } else {
            RUN(MATMUL(&L->down, c->gate, Tp, n_dec, c->h));
            TRACE("ffn_out", il, c->h, Tp, E);
            if (next_norm) {
                RUN(o->add_rmsnorm(cx, c->x, c->h, c->h, next_norm, Tp, E, hp->rms_eps));
                TRACE("l_out", il, c->x, Tp, E);
                TRACE("attn_norm", il + 1, c->h, Tp, E);
            } else {
                RUN(o->add(cx, c->x, c->h, (size_t)Tp * E));
                TRACE("l_out", il, c->x, Tp, E);
            }
        }
    }
    RUN(o->gather_rows(cx, c->last, c->x, d_last, Op, E));
    RUN(o->rmsnorm(cx, c->last, c->last, m->output_norm.data, Op, E, hp->rms_eps));
    TRACE("result_norm", -1, c->last, Op, E);
    RUN(MATMUL(&m->output, c->last, Op, n_out_dec, c->logits));
    TRACE("result_output", -1, c->logits, Op, hp->n_vocab);
    if (b->sample)
        RUN(o->sample(cx, c->logits, Op, hp->n_vocab, c->sample, c->ids));
    if (stepped && (rc = o->step_end(cx, 0)))
        return ferr(c, rc, "forward: step failed on the %s backend", o->name);
download:
    /* the downloads wait for the device: model_forward_finish */
    c->pend_tokens = b->sample ? b->tokens : NULL;
    c->pend_logits = b->logits;
    c->pend_out = O;
    c->pending = true;
#undef RUN
#undef MATMUL
#undef TRACE
    return 0;
}

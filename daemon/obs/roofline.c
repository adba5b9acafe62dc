/* roofline: the step cost model, the startup measurement of the backend's
 * ceilings and the per-phase rolling window (see roofline.h; the formulas
 * are written out in docs/architecture.md, "Observability"). */
#include "roofline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compute.h"
#include "model.h"
#include "kvd/status.h"

const char *roofline_phase_name(enum roofline_phase p)
{
    switch (p) {
    case ROOFLINE_PREFILL:
        return "prefill";
    case ROOFLINE_DECODE:
        return "decode";
    case ROOFLINE_MIXED:
        return "mixed";
    }
    return "?";
}

/* ---- the cost model ------------------------------------------------------ */

/* The batch sums the model needs: tokens, Σ attended keys over rows,
 * Σ context read per sequence, sequences with one new token. */
struct batch_sums {
    double tokens, ctx_rows, ctx_kv;
    uint32_t n_one, n;
};

static void sums_add(struct batch_sums *b, uint32_t n_tokens, uint32_t pos0)
{
    double t = n_tokens, p0 = pos0;
    b->tokens += t;
    /* Row r (position p0 + r) attends to p0 + r + 1 keys: the sum over the
     * chunk is t*p0 + t(t+1)/2. */
    b->ctx_rows += t * p0 + t * (t + 1) / 2;
    /* The chunk's K/V are read once per sequence (tiled attention): every
     * position up to the last new one. */
    b->ctx_kv += p0 + t;
    b->n_one += n_tokens == 1;
    b->n++;
}

static void cost_of(const struct roofline_shape *s, const struct batch_sums *b,
                    struct roofline_cost *out)
{
    memset(out, 0, sizeof(*out));
    const double d = s->n_embd, L = s->n_layer, hd = s->head_dim;
    const double q_dim = (double)s->n_head * hd, kv_dim = (double)s->n_head_kv * hd;
    const double ff = s->n_ff, vocab = s->n_vocab, ab = s->act_bytes ? s->act_bytes : 4;
    const double tokens = b->tokens, ctx_rows = b->ctx_rows, ctx_kv = b->ctx_kv;
    const uint32_t n = b->n;
    out->n_tokens = (uint32_t)tokens;
    out->n_seqs = n;
    out->phase = b->n_one == n   ? ROOFLINE_DECODE
                 : b->n_one == 0 ? ROOFLINE_PREFILL
                                 : ROOFLINE_MIXED;

    /* 2 FLOPs per multiply-add; per token per layer. */
    double proj_in = d * (q_dim + 2 * kv_dim) + q_dim * d;
    out->flops_proj = 2 * proj_in * tokens * L;
    out->flops_attn = 2 * 2 * (double)s->n_head * hd * ctx_rows * L; /* QK^T and AV */
    out->flops_mlp = 2 * 3 * d * ff * tokens * L;
    out->flops_head = 2 * d * vocab * n; /* the last position of each sequence */
    out->flops = out->flops_proj + out->flops_attn + out->flops_mlp + out->flops_head;

    out->bytes_weights = (double)s->step_weight_bytes + (double)s->embd_row_bytes * tokens;
    out->bytes_kv_read = (double)s->kv_token_bytes * ctx_kv;
    out->bytes_kv_write = (double)s->kv_token_bytes * tokens;
    /* Activations: every matmul's input row read and output row written,
     * attention's q read and output written, per token per layer; the LM
     * head's input and logits per sequence; the embedding row out. */
    double act_layer = (d + q_dim) + (d + kv_dim) * 2 + (q_dim + d) + /* projections */
                       2 * q_dim +                                    /* attention q, out */
                       (d + ff) * 2 + (ff + d);                       /* gate, up, down */
    out->bytes_act = ab * (act_layer * tokens * L + d * tokens + (d + vocab) * n);
    out->bytes = out->bytes_weights + out->bytes_kv_read + out->bytes_kv_write + out->bytes_act;
}

void roofline_step_cost(const struct roofline_shape *s, const struct roofline_seq *seqs, uint32_t n,
                        struct roofline_cost *out)
{
    struct batch_sums b = {0};
    for (uint32_t i = 0; i < n; i++)
        sums_add(&b, seqs[i].n_tokens, seqs[i].pos0);
    cost_of(s, &b, out);
}

void roofline_shape_from_model(const struct model_hparams *hp, const struct kv_geom *g,
                               struct roofline_shape *s)
{
    memset(s, 0, sizeof(*s));
    s->n_embd = hp->n_embd;
    s->n_layer = hp->n_layer;
    s->n_head = hp->n_head;
    s->n_head_kv = hp->n_head_kv;
    s->head_dim = hp->head_dim;
    s->n_ff = hp->n_ff;
    s->n_vocab = hp->n_vocab;
    s->act_bytes = 4;
    s->kv_token_bytes = kv_token_bytes(g);
    /* The embedding table is taken to have the layers' weight type. */
    s->embd_row_bytes = ctype_row_bytes(hp->wtype, hp->n_embd);
    uint64_t table = s->embd_row_bytes * hp->n_vocab;
    s->step_weight_bytes = hp->weight_bytes;
    if (!hp->tied_output && hp->weight_bytes > table)
        s->step_weight_bytes = hp->weight_bytes - table;
    else if (hp->tied_output)
        s->embd_row_bytes = 0; /* the whole table is read as the LM head anyway */
}

/* ---- ceilings ----------------------------------------------------------- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define PROBE_BUDGET_NS 60000000ull /* per probe: ~0.06 s after the warm-up */
#define PROBE_MAX_REPS 64

/* A device→device copy of `bytes`: best run's bytes/s (2 bytes moved per
 * byte copied). */
static int probe_copy(struct backend *be, size_t bytes, double *bps)
{
    void *a = NULL, *b = NULL;
    int rc;
    if ((rc = be->ops->arena_alloc(be, KVD_TIER_DEVICE, bytes, &a)))
        return rc;
    if ((rc = be->ops->arena_alloc(be, KVD_TIER_DEVICE, bytes, &b)))
        goto out_a;
    /* The first copy faults the pages in (cpu) or warms the engine (cuda). */
    if ((rc = be->ops->copy(be, b, KVD_TIER_DEVICE, a, KVD_TIER_DEVICE, bytes)))
        goto out_b;
    uint64_t best = UINT64_MAX, t_start = now_ns();
    for (int i = 0; i < PROBE_MAX_REPS && now_ns() - t_start < PROBE_BUDGET_NS; i++) {
        uint64_t t0 = now_ns();
        if ((rc = be->ops->copy(be, (i & 1) ? a : b, KVD_TIER_DEVICE, (i & 1) ? b : a,
                                KVD_TIER_DEVICE, bytes)))
            goto out_b;
        uint64_t dt = now_ns() - t0;
        if (dt < best)
            best = dt;
    }
    *bps = best ? 2.0 * (double)bytes / ((double)best * 1e-9) : 0;
out_b:
    be->ops->arena_free(be, KVD_TIER_DEVICE, b, bytes);
out_a:
    be->ops->arena_free(be, KVD_TIER_DEVICE, a, bytes);
    return rc;
}

/* y[m][n] = x[m][k] . W[n][k]^T with an f16 W, through the backend's own
 * matmul: best run's FLOP/s. */
static int probe_gemm(struct backend *be, uint32_t n_threads, uint32_t m, uint32_t n, uint32_t k,
                      double *fps)
{
    const struct compute_ops *co = be->compute;
    struct compute_ctx *cx = NULL;
    struct compute_conf conf = {.n_threads = n_threads};
    void *w = NULL, *x = NULL, *y = NULL;
    uint16_t *hw = NULL;
    float *hx = NULL;
    size_t wbytes = (size_t)n * k * 2, xbytes = (size_t)m * k * 4, ybytes = (size_t)m * n * 4;
    int rc = co->ctx_new(be, &conf, &cx);
    if (rc)
        return rc;
    rc = KVD_ENOMEM;
    hw = malloc(wbytes);
    hx = malloc(xbytes);
    if (!hw || !hx)
        goto out;
    /* Small finite values: f16 0x2c00 = 0.0625; x = 0.5. */
    for (size_t i = 0; i < (size_t)n * k; i++)
        hw[i] = 0x2c00;
    for (size_t i = 0; i < (size_t)m * k; i++)
        hx[i] = 0.5f;
    if ((rc = co->buf_alloc(cx, wbytes, &w)) || (rc = co->buf_alloc(cx, xbytes, &x)) ||
        (rc = co->buf_alloc(cx, ybytes, &y)))
        goto out;
    if ((rc = co->upload(cx, w, hw, wbytes)) || (rc = co->upload(cx, x, hx, xbytes)))
        goto out;
    struct ctensor wt = {.type = CT_F16, .ne0 = k, .ne1 = n, .nbytes = wbytes, .data = w};
    if ((rc = co->matmul(cx, &wt, x, m, y)) || (rc = co->sync(cx))) /* warm-up */
        goto out;
    uint64_t best = UINT64_MAX, t_start = now_ns();
    for (int i = 0; i < PROBE_MAX_REPS && now_ns() - t_start < PROBE_BUDGET_NS; i++) {
        uint64_t t0 = now_ns();
        if ((rc = co->matmul(cx, &wt, x, m, y)) || (rc = co->sync(cx)))
            goto out;
        uint64_t dt = now_ns() - t0;
        if (dt < best)
            best = dt;
    }
    *fps = best ? 2.0 * m * (double)n * k / ((double)best * 1e-9) : 0;
out:
    co->buf_free(cx, y);
    co->buf_free(cx, x);
    co->buf_free(cx, w);
    co->ctx_free(cx);
    free(hw);
    free(hx);
    return rc;
}

int roofline_measure(struct backend *be, uint32_t n_threads, struct roofline_ceilings *c)
{
    memset(c, 0, sizeof(*c));
    if (!be || !be->compute)
        return KVD_EUNSUPPORTED;
    bool cuda = be->ops->kind != BACKEND_CPU;
    /* Sizes well past the last-level cache; the GEMM big enough to reach
     * the compute ceiling (cpu: 2*128*1024*1024 = 0.27 GFLOP per run). */
    size_t copy_bytes = cuda ? (size_t)512 << 20 : (size_t)32 << 20;
    uint32_t m = cuda ? 4096 : 128, n = cuda ? 4096 : 1024, k = cuda ? 4096 : 1024;
    uint64_t t0 = now_ns();
    int rc = probe_copy(be, copy_bytes, &c->bytes_per_s);
    uint64_t t1 = now_ns();
    if (rc == 0)
        rc = probe_gemm(be, n_threads, m, n, k, &c->flops_per_s);
    c->measure_ms = (double)(now_ns() - t0) * 1e-6;
    c->copy_ms = (double)(t1 - t0) * 1e-6;
    if (rc)
        return rc;
    c->measured = c->bytes_per_s > 0 && c->flops_per_s > 0;
    snprintf(c->how, sizeof(c->how), "%s: copy %zu MiB, matmul f16 %ux%ux%u", be->ops->name,
             copy_bytes >> 20, m, n, k);
    return 0;
}

/* ---- the rolling window ------------------------------------------------- */

void roofline_init(struct roofline *rl)
{
    memset(rl, 0, sizeof(*rl));
    pthread_mutex_init(&rl->mu, NULL);
}

void roofline_destroy(struct roofline *rl)
{
    pthread_mutex_destroy(&rl->mu);
}

void roofline_set_shape(struct roofline *rl, const struct roofline_shape *s)
{
    pthread_mutex_lock(&rl->mu);
    rl->shape = *s;
    rl->have_shape = true;
    pthread_mutex_unlock(&rl->mu);
}

void roofline_set_ceilings(struct roofline *rl, const struct roofline_ceilings *c)
{
    pthread_mutex_lock(&rl->mu);
    rl->ceil = *c;
    pthread_mutex_unlock(&rl->mu);
}

void roofline_get_ceilings(struct roofline *rl, struct roofline_ceilings *c)
{
    pthread_mutex_lock(&rl->mu);
    *c = rl->ceil;
    pthread_mutex_unlock(&rl->mu);
}

static void record_locked(struct roofline *rl, const struct roofline_cost *c, uint64_t ns)
{
    if ((unsigned)c->phase >= ROOFLINE_N_PHASES)
        return;
    struct roofline_window *ph = &rl->ph[c->phase];
    ph->ring[ph->head] = (struct roofline_sample){
        .flops = c->flops, .bytes = c->bytes, .ns = ns, .n_tokens = c->n_tokens};
    ph->head = (ph->head + 1) % ROOFLINE_WINDOW;
    if (ph->n < ROOFLINE_WINDOW)
        ph->n++;
    ph->total++;
    ph->flops_total += c->flops;
    ph->bytes_total += c->bytes;
    ph->seconds_total += (double)ns * 1e-9;
}

void roofline_record_cost(struct roofline *rl, const struct roofline_cost *c, uint64_t ns)
{
    pthread_mutex_lock(&rl->mu);
    record_locked(rl, c, ns);
    pthread_mutex_unlock(&rl->mu);
}

static void record_sums(struct roofline *rl, const struct batch_sums *b, uint64_t ns)
{
    struct roofline_cost c;
    pthread_mutex_lock(&rl->mu);
    if (rl->have_shape) {
        cost_of(&rl->shape, b, &c);
        record_locked(rl, &c, ns);
    }
    pthread_mutex_unlock(&rl->mu);
}

void roofline_record(struct roofline *rl, const struct roofline_seq *seqs, uint32_t n, uint64_t ns)
{
    if (!rl || n == 0)
        return;
    struct batch_sums b = {0};
    for (uint32_t i = 0; i < n; i++)
        sums_add(&b, seqs[i].n_tokens, seqs[i].pos0);
    record_sums(rl, &b, ns);
}

void roofline_record_fwd(struct roofline *rl, const struct fwd_seq *seqs, uint32_t n, uint64_t ns)
{
    if (!rl || n == 0)
        return;
    struct batch_sums b = {0};
    for (uint32_t i = 0; i < n; i++)
        sums_add(&b, seqs[i].n_tokens, seqs[i].pos0);
    record_sums(rl, &b, ns);
}

void roofline_record_fwd_shape(struct roofline *rl, const struct roofline_shape *shape,
                               const struct fwd_seq *seqs, uint32_t n, uint64_t ns)
{
    if (!rl || n == 0)
        return;
    struct batch_sums b = {0};
    for (uint32_t i = 0; i < n; i++)
        sums_add(&b, seqs[i].n_tokens, seqs[i].pos0);
    struct roofline_cost c;
    cost_of(shape, &b, &c);
    pthread_mutex_lock(&rl->mu);
    record_locked(rl, &c, ns);
    pthread_mutex_unlock(&rl->mu);
}

void roofline_summary(struct roofline *rl, enum roofline_phase p, struct roofline_summary *out)
{
    memset(out, 0, sizeof(*out));
    out->phase = p;
    out->bound = "unknown";
    if ((unsigned)p >= ROOFLINE_N_PHASES)
        return;
    pthread_mutex_lock(&rl->mu);
    const struct roofline_window *ph = &rl->ph[p];
    double f = 0, b = 0, s = 0, tok = 0;
    for (uint32_t i = 0; i < ph->n; i++) {
        f += ph->ring[i].flops;
        b += ph->ring[i].bytes;
        s += (double)ph->ring[i].ns * 1e-9;
        tok += ph->ring[i].n_tokens;
    }
    struct roofline_ceilings ce = rl->ceil;
    out->steps_total = ph->total;
    out->window = ph->n;
    pthread_mutex_unlock(&rl->mu);

    if (out->window == 0)
        return;
    out->flops_per_step = f / out->window;
    out->bytes_per_step = b / out->window;
    out->intensity = b > 0 ? f / b : 0;
    out->ms_per_step = s * 1e3 / out->window;
    if (s > 0) {
        out->flops_per_s = f / s;
        out->bytes_per_s = b / s;
        out->tokens_per_s = tok / s;
    }
    if (ce.measured) {
        out->flops_frac = out->flops_per_s / ce.flops_per_s;
        out->bytes_frac = out->bytes_per_s / ce.bytes_per_s;
        /* The ridge point: below it the memory system is the ceiling. */
        double ridge = ce.flops_per_s / ce.bytes_per_s;
        out->bound = out->intensity < ridge ? "bandwidth" : "compute";
    }
}

void roofline_totals(struct roofline *rl, enum roofline_phase p, uint64_t *steps, double *flops,
                     double *bytes, double *seconds)
{
    *steps = 0;
    *flops = *bytes = *seconds = 0;
    if ((unsigned)p >= ROOFLINE_N_PHASES)
        return;
    pthread_mutex_lock(&rl->mu);
    *steps = rl->ph[p].total;
    *flops = rl->ph[p].flops_total;
    *bytes = rl->ph[p].bytes_total;
    *seconds = rl->ph[p].seconds_total;
    pthread_mutex_unlock(&rl->mu);
}

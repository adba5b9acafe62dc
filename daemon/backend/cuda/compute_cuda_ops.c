/* compute_cuda_ops: the model's operations (compute.h) on the cuda backend:
 * thin wrappers over kernels/ plus the projections, which run as a native-
 * type GEMV for up to 8 rows (decode: weights read once; the quantized
 * types other than Q8_0 with llama.cpp's int8-activation arithmetic, like
 * the cpu backend; kernels/gemv_fused.cu), for 9-32 rows of Q4_0 .. Q6_K
 * as that GEMV 8 rows a launch, and as cuBLAS GEMMs above that (bf16 in,
 * f32 accumulate; F32 weights as SGEMM). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cuda_impl.h"
#include "kvd/status.h"
#include "log.h"

int cuda_op_get_rows(struct compute_ctx *cx, const struct ctensor *w, const uint32_t *ids,
                     uint32_t n, float *out)
{
    if (w->layout == CL_PLANES)
        return cuda_kstatus(kvd_k_planes_get_rows(out, w->data, (int)w->type, (int)w->ne0,
                                                  (int)w->ne1, ids, (int)n, cx->stream),
                            "get_rows");
    return cuda_kstatus(kvd_k_get_rows(out, w->data, (int)w->type, (int)w->ne0, (int)w->ne1, ids,
                                       (int)n, cx->stream),
                        "get_rows");
}

int cuda_op_rmsnorm(struct compute_ctx *cx, float *out, const float *x, const float *w,
                    uint32_t rows, uint32_t n, float eps)
{
    cx->pq_live = -1; /* out rewritten: no quantization of it is current */
    return cuda_kstatus(kvd_k_rmsnorm(out, x, w, (int)rows, (int)n, eps, cx->stream), "rmsnorm");
}

int cuda_op_add_rmsnorm(struct compute_ctx *cx, float *x, const float *res, float *out,
                        const float *w, uint32_t rows, uint32_t n, float eps)
{
    cx->pq_live = -1;
    return cuda_kstatus(kvd_k_add_rmsnorm(x, res, out, w, (int)rows, (int)n, eps, cx->stream),
                        "add_rmsnorm");
}

int cuda_op_add_bias(struct compute_ctx *cx, float *y, const float *b, uint32_t rows, uint32_t n)
{
    return cuda_kstatus(kvd_k_add_bias(y, b, (int)rows, (int)n, cx->stream), "add_bias");
}

int cuda_op_rope(struct compute_ctx *cx, float *x, uint32_t rows, uint32_t n_heads,
                 uint32_t head_dim, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                 float base, const float *freq_factors)
{
    return cuda_kstatus(kvd_k_rope(x, pos, (int)rows, (int)n_heads, (int)head_dim, (int)n_rot, base,
                                   freq_factors, (int)mode, cx->stream),
                        "rope");
}

void cuda_kv_of(struct kvd_k_kv *kv, const void *arena, const struct kv_geom *g)
{
    kv->arena = (void *)arena;
    kv->block_bytes = kv_block_bytes(g);
    kv->layers = (int)g->layers;
    kv->kv_heads = (int)g->kv_heads;
    kv->head_dim = (int)g->head_dim;
    kv->block_tokens = (int)g->block_tokens;
    kv->dtype = (int)g->dtype;
    kv->row_bytes = kv_row_bytes(g->dtype, g->head_dim);
}

int cuda_op_kv_write(struct compute_ctx *cx, void *arena, const struct kv_geom *geom,
                     uint32_t layer, const float *k, const float *v, uint32_t n_tokens,
                     const uint32_t *tok_slot, const uint32_t *tok_pos)
{
    struct kvd_k_kv kv;
    cuda_kv_of(&kv, arena, geom);
    return cuda_kstatus(
        kvd_k_kv_write(&kv, (int)layer, tok_slot, tok_pos, k, v, (int)n_tokens, cx->stream),
        "kv_write");
}

/* The decode kernel over the one-row sequences of n (qstart, pos0, slot0 as
 * the kernel takes them; it leaves the others alone). The split count is
 * that of a step of n_split sequences: 1 for a batch-invariant row, so its
 * reduction order does not depend on how many rows the step has. early:
 * a plain decode step (kvd_k_attn_decode). */
static int attn_decode_rows(struct compute_ctx *cx, const struct attn_desc *d,
                            const struct kvd_k_kv *kv, uint32_t n, const uint32_t *qstart,
                            const uint32_t *pos0, const uint32_t *slot0, uint32_t n_split,
                            int early)
{
    uint32_t splits = cuda_cx_splits(cx, n_split, d->n_head, kv, d->max_kv);
    size_t need =
        kvd_k_attn_decode_partial_floats((int)n, (int)d->n_head, kv->head_dim, (int)splits);
    int rc;
    if (need && (rc = cuda_cx_need_part(cx, need, (size_t)n * d->n_head)))
        return rc;
    return cuda_kstatus(kvd_k_attn_decode(d->out, d->q, kv, (int)d->layer, d->slots, slot0, pos0,
                                          qstart, (int)n, (int)d->n_head, d->scale, (int)splits,
                                          cx->part, cx->done, early, cx->stream),
                        "attention (decode)");
}

int cuda_op_attention(struct compute_ctx *cx, const struct attn_desc *d)
{
    struct kvd_k_kv kv;
    int rc;

    cuda_kv_of(&kv, d->arena, d->geom);
    if (!kvd_k_attn_supported(kv.head_dim)) {
        log_err("cuda: attention with head_dim %d is not supported (16, 32, 64, 128, 256)",
                kv.head_dim);
        return KVD_EUNSUPPORTED;
    }
    /* A step whose every sequence has one row is a plain decode: each
     * writes only its newest row (a verification step's drafts make
     * several rows of one sequence), so the others may be read early. */
    if (d->max_q <= 1)
        return attn_decode_rows(cx, d, &kv, d->n_seqs, d->seq_qstart, d->seq_pos0, d->seq_slot0,
                                d->alone ? 1 : d->n_seqs, 1);
    /* Batch-invariant rows first: each a one-row decode of its own (the
     * decode kernel), then the other sequences' rows (prefill kernel). */
    uint32_t s0 = 0;
    if (d->n_dec) {
        if ((rc = attn_decode_rows(cx, d, &kv, d->n_dec, d->dec_qstart, d->dec_pos0, d->dec_slot0,
                                   1, 0)))
            return rc;
        s0 = d->s_dec;
    }
    if (s0 >= d->n_seqs)
        return 0;
    /* Otherwise the mixed step's one-row sequences (its decodes) take the
     * split decode kernel, and the prefill kernel skips them: a long
     * context's decode row is split over the device instead of one block.
     * Decided from the step's shape only (not from which sequences have
     * one row), so a captured step replays right. */
    int skip_single = !d->alone;
    if (skip_single && (rc = attn_decode_rows(cx, d, &kv, d->n_seqs, d->seq_qstart, d->seq_pos0,
                                              d->seq_slot0, d->n_seqs, 0)))
        return rc;
    return cuda_kstatus(kvd_k_attn_prefill(d->out, d->q, &kv, (int)d->layer, d->slots,
                                           d->seq_slot0 + s0, d->seq_pos0 + s0, d->seq_qstart + s0,
                                           (int)(d->n_seqs - s0), (int)d->max_q, (int)d->n_head,
                                           d->scale, skip_single, cx->stream),
                        "attention (prefill)");
}

int cuda_op_silu_mul(struct compute_ctx *cx, float *g, const float *u, size_t n)
{
    return cuda_kstatus(kvd_k_silu_mul(g, g, u, n, cx->stream), "silu_mul");
}

int cuda_op_add(struct compute_ctx *cx, float *x, const float *y, size_t n)
{
    return cuda_kstatus(kvd_k_add(x, y, n, cx->stream), "add");
}

int cuda_op_gather_rows(struct compute_ctx *cx, float *out, const float *x, const uint32_t *rows,
                        uint32_t n, uint32_t width)
{
    return cuda_kstatus(kvd_k_gather_rows(out, x, rows, (int)n, (int)width, cx->stream),
                        "gather_rows");
}

_Static_assert(sizeof(struct sample_row) == sizeof(struct kvd_k_sample_row) &&
                   offsetof(struct sample_row, top_k) == offsetof(struct kvd_k_sample_row, top_k) &&
                   offsetof(struct sample_row, top_p) == offsetof(struct kvd_k_sample_row, top_p) &&
                   offsetof(struct sample_row, skip) == offsetof(struct kvd_k_sample_row, skip) &&
                   offsetof(struct sample_row, u) == offsetof(struct kvd_k_sample_row, u),
               "struct sample_row and struct kvd_k_sample_row must share one layout");

int cuda_op_sample(struct compute_ctx *cx, const float *logits, uint32_t rows, uint32_t vocab,
                   const struct sample_row *p, uint32_t *out)
{
    return cuda_kstatus(kvd_k_sample(out, logits, (const struct kvd_k_sample_row *)p, (int)rows,
                                     (int)vocab, cx->stream),
                        "sample");
}

/* ---- projections ---------------------------------------------------------- */

/* The cuBLAS path reads matrices as bf16. BF16 and F32 (SGEMM) weights are
 * read in place. F16 and Q8_0 matrices keep a bf16 copy after their rows
 * (CL_ROWS_BF16, CL_PLANES for Q8_0), made at load. The other quantized
 * types (Q4_0 .. Q6_K) keep only their blocks: before each GEMM they are
 * dequantized, a tile of rows at a time, into the context's bf16 tile
 * (cx->wt), sized at load for the largest tile any weight needs (so a bf16
 * copy of a Q4 model, 3.6x its size, is never held). Either way the memory
 * is allocated with the weights, before the KV arena is sized from what is
 * left, and never in the middle of a step. Every quantized matrix is
 * rewritten at load in the plane layout (kernels/planes.cuh), which the
 * GEMV reads with 16-byte loads; the float types' GEMV reads their rows. */
static bool is_matrix(const struct ctensor *t)
{
    return t->ne1 > 1 && !t->rows_only;
}

static bool needs_bf16_copy(const struct ctensor *t)
{
    return is_matrix(t) && (t->type == CT_F16 || t->type == CT_Q8_0);
}

static bool needs_tile(const struct ctensor *t)
{
    return is_matrix(t) && ctype_is_quant(t->type) && t->type != CT_Q8_0;
}

static bool needs_planes(const struct ctensor *t)
{
    return is_matrix(t) && ctype_is_quant(t->type);
}

/* A tile is at most 32 MiB of bf16 (cx->tile_elems, CUDA_TILE_ELEMS_DEFAULT:
 * it stays in a GPU's L2 between the dequantization that writes it and the
 * GEMM that reads it: 40 MiB on A100, 50 MiB on H100/H200), rounded down to
 * a multiple of 64 rows; a smaller matrix is one tile. */
static uint32_t tile_rows(const struct compute_ctx *cx, const struct ctensor *t)
{
    size_t r = cx->tile_elems / t->ne0;
    if (r >= 64)
        r &= ~(size_t)63;
    if (r < 1)
        r = 1;
    return r < t->ne1 ? (uint32_t)r : t->ne1;
}

static size_t bf16_copy_offset(const struct ctensor *t)
{
    return (t->nbytes + 255) & ~(size_t)255;
}

size_t cuda_weight_bytes(const struct ctensor *t)
{
    if (!needs_bf16_copy(t))
        return t->nbytes;
    return bf16_copy_offset(t) + (size_t)t->ne0 * t->ne1 * sizeof(uint16_t);
}

bool cuda_weight_type_ok(enum ctype t)
{
    return t == CT_F32 || t == CT_F16 || t == CT_BF16 || ctype_is_quant(t);
}

size_t cuda_weight_scratch_bytes(struct compute_ctx *cx)
{
    return cx->wt_cap * sizeof(uint16_t);
}

/* Grows the dequant tile to elems (exactly: it is held for the model's
 * life), at load. */
static int need_tile(struct compute_ctx *cx, size_t elems)
{
    if (elems <= cx->wt_cap)
        return 0;
    if (cx->capturing) {
        log_err("cuda: dequant tile growth requested inside a graph capture (internal)");
        return KVD_EINTERNAL;
    }
    uint16_t *p = NULL;
    cudaError_t e = cudaMalloc((void **)&p, elems * sizeof(uint16_t));
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        log_warn("cuda: dequant tile of %zu bytes: %s", elems * sizeof(uint16_t),
                 cudaGetErrorString(e));
        return KVD_ENOMEM;
    }
    cuda_cx_free(cx, cx->wt); /* waits for kernels still reading the old one */
    __atomic_add_fetch(&cx->scratch_bytes, (elems - cx->wt_cap) * sizeof(uint16_t),
                       __ATOMIC_RELAXED);
    cx->wt = p;
    cx->wt_cap = elems;
    return 0;
}

int cuda_weight_upload(struct compute_ctx *cx, struct ctensor *t, const void *src)
{
    int rc = cx->be->compute->upload(cx, t->data, src, t->nbytes);
    if (rc)
        return rc;
    return cuda_compute_weight_prepare(cx, t);
}

/* Rewrites t's file rows in the plane layout: through a temporary copy,
 * allocated and freed here (at load, never in a step). */
static int to_planes(struct compute_ctx *cx, struct ctensor *t)
{
    void *tmp = NULL;
    cudaError_t e = cudaMalloc(&tmp, t->nbytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        log_warn("cuda: %zu bytes to repack a weight: %s", t->nbytes, cudaGetErrorString(e));
        return KVD_ENOMEM;
    }
    int rc = 0;
    e = cudaMemcpyAsync(tmp, t->data, t->nbytes, cudaMemcpyDeviceToDevice, cx->stream);
    if (e != cudaSuccess)
        rc = cuda_fail(e, "weight repack copy");
    if (!rc)
        rc = cuda_kstatus(kvd_k_planes_pack(t->data, tmp, (int)t->type, t->ne1, t->ne0, cx->stream),
                          "repack");
    cuda_cx_free(cx, tmp); /* waits for the repack */
    if (!rc)
        t->layout = CL_PLANES;
    return rc;
}

int cuda_compute_weight_prepare(struct compute_ctx *cx, struct ctensor *t)
{
    int rc = 0;
    if (needs_bf16_copy(t)) { /* from the file's rows, before any repacking */
        uint16_t *copy = (uint16_t *)((uint8_t *)t->data + bf16_copy_offset(t));
        rc = cuda_kstatus(
            kvd_k_to_bf16(copy, t->data, (int)t->type, (size_t)t->ne0 * t->ne1, cx->stream),
            "to_bf16");
        if (!rc)
            t->layout = CL_ROWS_BF16;
    }
    if (!rc && needs_planes(t))
        rc = to_planes(cx, t);
    if (!rc && needs_tile(t))
        rc = need_tile(cx, (size_t)tile_rows(cx, t) * t->ne0);
    return rc;
}

/* The bf16 form of w for cuBLAS, or NULL when it has none. */
static const uint16_t *weight_bf16(const struct ctensor *w)
{
    if (w->type == CT_BF16)
        return w->data;
    if (w->layout == CL_ROWS_BF16 || (w->layout == CL_PLANES && w->type == CT_Q8_0))
        return (const uint16_t *)((const uint8_t *)w->data + bf16_copy_offset(w));
    return NULL;
}

/* x [rows][in] as the live quantization holds it for weight type wtype, or
 * NULL. */
static const void *pq_find(const struct compute_ctx *cx, const float *x, uint32_t rows, uint32_t in,
                           int wtype)
{
    if (cx->pq_live < 0)
        return NULL;
    const struct cuda_preq *q = &cx->pq[cx->pq_live];
    if (q->x != x || q->rows != rows || q->in != in)
        return NULL;
    for (int i = 0; i < q->n; i++)
        if (kvd_k_gemv_act_kind(q->wtype[i]) == kvd_k_gemv_act_kind(wtype))
            return q->buf[i];
    return NULL;
}

/* Sets g to quantize its output out [rows][in] for the readers' hint when
 * the hint names out: into the set the launch does not read (pq_next). No
 * emission inside a capture that would need larger buffers. */
static int pq_emit(struct compute_ctx *cx, struct kvd_k_gemv *g, const float *out, uint32_t rows,
                   uint32_t in)
{
    if (!out || cx->readers.y != out || cx->readers.in != in || cx->readers.n == 0 ||
        rows > KVD_K_GEMV_MAX_TOKENS)
        return 0;
    const int s = cx->pq_live == 0 ? 1 : 0;
    struct cuda_preq *q = &cx->pq[s];
    for (int i = 0; i < cx->readers.n; i++) {
        size_t bytes = kvd_k_gemv_act_bytes(cx->readers.wtype[i], (int)rows, (int)in);
        if (bytes <= q->cap[i])
            continue;
        if (cx->capturing)
            return 0;
        int rc = cuda_cx_need_pq(cx, s, i, bytes);
        if (rc)
            return rc;
    }
    q->x = out;
    q->rows = rows;
    q->in = in;
    q->n = cx->readers.n;
    for (int i = 0; i < q->n; i++) {
        q->wtype[i] = cx->readers.wtype[i];
        g->emit[i] = q->buf[i];
        g->emit_wtype[i] = q->wtype[i];
    }
    g->n_emit = q->n;
    cx->pq_next = s;
    return 0;
}

/* The fused GEMV (kernels/gemv_fused.cu) over n weights of one type
 * sharing x (or, STORE, of one type then of a second one that
 * kvd_k_gemv_pair_ok pairs with it: one launch), with epilogue epi (ADD_NORM: y[0] is the residual,
 * norm_w and norm_out the RMSNorm after it, or NULL). The caller checked kvd_k_gemv_ok. x's
 * quantization made by the launch that produced it is read when one is live; the output is
 * quantized for its readers when the hint (cuda_op_next_readers) names it. */
int cuda_gemv(struct compute_ctx *cx, int n, const struct ctensor *const *w,
              const float *const *bias, const float *x, uint32_t rows, float *const *y, int epi,
              const float *norm_w, float eps, float *norm_out)
{
    struct kvd_k_gemv g = {
        .wtype = (int)w[0]->type,
        .in = (int)w[0]->ne0,
        .n_tokens = (int)rows,
        .n_seg = n,
        .x = x,
        .epi = epi,
        .norm_w = norm_w,
        .eps = eps,
        .norm_out = norm_out,
        .counter = cx->counter,
        .max_blocks = 4 * cx->dev->n_sms,
    };
    for (int i = 0; i < n; i++) {
        g.seg[i] = (struct kvd_k_gemv_seg){
            .w = w[i]->data, .rows = (int)w[i]->ne1, .y = y[i], .bias = bias[i]};
        if (!g.split && w[i]->type != w[0]->type) {
            g.split = i;
            g.wtype2 = (int)w[i]->type;
        }
    }
    size_t act = kvd_k_gemv_act_bytes(g.wtype, g.n_tokens, g.in);
    if (g.split && kvd_k_gemv_act_bytes(g.wtype2, g.n_tokens, g.in) > act)
        act = kvd_k_gemv_act_bytes(g.wtype2, g.n_tokens, g.in);
    int rc = cuda_cx_need_act(cx, act);
    if (rc)
        return rc;
    g.act = cx->act;
    g.act_in = pq_find(cx, x, rows, w[0]->ne0, g.wtype);
    if (g.split)
        g.act_in2 = pq_find(cx, x, rows, w[0]->ne0, g.wtype2);
    g.rope = cx->gemv_rope;
    cx->gemv_rope = NULL;
    const float *out = epi == KVD_K_GEMV_SWIGLU               ? y[0]
                       : epi == KVD_K_GEMV_ADD_NORM && norm_w ? norm_out
                                                              : NULL;
    if ((rc = pq_emit(cx, &g, out, rows, w[0]->ne1)))
        return rc;
    if (kvd_k_gemv_act_kind(g.wtype)) { /* two types: handed when both are */
        if (g.act_in && (!g.split || g.act_in2))
            cx->n_act_handed++;
        else
            cx->n_act_quant++;
    }
    return cuda_kstatus(kvd_k_gemv_run(&g, cx->stream), "gemv");
}

/* y [rows][out] = x [rows][in] . W^T. W is [out][in] row-major, i.e. an
 * in x out column-major matrix: cuBLAS computes y^T (out x rows) =
 * op(W)=T (out x in) times x^T (in x rows). A tile of W's rows [r0, r0+nr)
 * gives rows [r0, r0+nr) of y^T: C at y + r0, still with ldc = out. */
static int gemm_bf16(struct compute_ctx *cx, const uint16_t *wb, int in, int nr, int n, float *y,
                     int ldy)
{
    const float one = 1.0f, zero = 0.0f;
    cx->step_blas++;
    cx->n_blas++;
    cublasStatus_t st = cublasGemmEx(cx->dev->blas, CUBLAS_OP_T, CUBLAS_OP_N, nr, n, in, &one, wb,
                                     CUDA_R_16BF, in, cx->xb, CUDA_R_16BF, in, &zero, y, CUDA_R_32F,
                                     ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return st == CUBLAS_STATUS_SUCCESS ? 0 : cublas_fail(st, "cublasGemmEx");
}

/* Rows [0, n_one) take the GEMV (per row the arithmetic of a one-row
 * call: each row's sums do not depend on the others), KVD_K_GEMV_MAX_TOKENS
 * rows at a time; the rest go through cuda_op_matmul as one call. */
int cuda_op_matmul_inv(struct compute_ctx *cx, const struct ctensor *w, const float *x,
                       uint32_t rows, uint32_t n_one, float *y)
{
    const size_t in = w->ne0, out = w->ne1;
    int rc;
    if (n_one > rows)
        n_one = rows;
    if (cuda_qmma_takes(cx, w, x, rows)) /* each row's sums are the GEMV's */
        n_one = 0;
    if (n_one == rows && rows <= KVD_K_GEMV_MAX_TOKENS)
        return cuda_op_matmul(cx, w, x, rows, y);
    for (uint32_t r = 0; r < n_one; r += KVD_K_GEMV_MAX_TOKENS) {
        uint32_t n = n_one - r < KVD_K_GEMV_MAX_TOKENS ? n_one - r : KVD_K_GEMV_MAX_TOKENS;
        if ((rc = cuda_op_matmul(cx, w, x + r * in, n, y + r * out)))
            return rc;
    }
    if (n_one < rows)
        return cuda_op_matmul(cx, w, x + n_one * in, rows - n_one, y + n_one * out);
    return 0;
}

bool cuda_qmma_takes(const struct compute_ctx *cx, const struct ctensor *w, const float *x,
                     uint32_t rows)
{
    return !cx->no_qmma && rows > KVD_K_GEMV_MAX_TOKENS && w->layout == CL_PLANES &&
           kvd_k_qmma_ok((int)w->type, w->data, x, (int)rows, (int)w->ne0);
}

bool cuda_gemv_chunked(const struct compute_ctx *cx, const struct ctensor *w, const float *x,
                       uint32_t rows)
{
    return rows > KVD_K_GEMV_MAX_TOKENS && rows <= CUDA_GEMV_CHUNKED_ROWS &&
           ctype_is_quant(w->type) && w->layout == CL_PLANES && !weight_bf16(w) &&
           !cuda_qmma_takes(cx, w, x, rows) &&
           kvd_k_gemv_ok((int)w->type, w->data, x, KVD_K_GEMV_MAX_TOKENS, (int)w->ne0);
}

/* The K-quants' int8 tensor-core GEMM (kernels/gemm_qmma.cu); the caller
 * checked cuda_qmma_takes. */
static int qmma(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                float *y)
{
    int rc = cuda_cx_need_act(cx, kvd_k_qmma_act_bytes((int)w->type, (int)rows, (int)w->ne0));
    if (rc)
        return rc;
    return cuda_kstatus(kvd_k_qmma(y, w->data, (int)w->type, (int)w->ne1, (int)w->ne0, x, (int)rows,
                                   cx->act, cx->stream),
                        "qmma");
}

int cuda_op_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                   float *y)
{
    const int in = (int)w->ne0, out = (int)w->ne1, n = (int)rows;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    int rc;

    if (rows == 0 || out == 0)
        return 0;
    if (ctype_is_quant(w->type) && w->layout != CL_PLANES) {
        log_err("cuda: a %s [%u x %u] weight reached matmul without its load-time repacking "
                "(weights must be loaded with weight_upload)",
                ctype_name(w->type), w->ne1, w->ne0);
        return KVD_EINTERNAL;
    }
    if (kvd_k_gemv_ok((int)w->type, w->data, x, n, in)) {
        const struct ctensor *ws[1] = {w};
        float *ys[1] = {y};
        const float *bs[1] = {NULL};
        return cuda_gemv(cx, 1, ws, bs, x, rows, ys, KVD_K_GEMV_STORE, NULL, 0, NULL);
    }
    if (cuda_qmma_takes(cx, w, x, rows))
        return qmma(cx, w, x, rows, y);
    if (cuda_gemv_chunked(cx, w, x, rows)) {
        const struct ctensor *ws[1] = {w};
        const float *bs[1] = {NULL};
        for (uint32_t r = 0; r < rows; r += KVD_K_GEMV_MAX_TOKENS) {
            uint32_t k = rows - r < KVD_K_GEMV_MAX_TOKENS ? rows - r : KVD_K_GEMV_MAX_TOKENS;
            float *ys[1] = {y + (size_t)r * out};
            if ((rc = cuda_gemv(cx, 1, ws, bs, x + (size_t)r * in, k, ys, KVD_K_GEMV_STORE, NULL, 0,
                                NULL)))
                return rc;
        }
        return 0;
    }
    if (w->type == CT_F32) {
        /* f32 weights keep f32 math (no TF32): the reference's numbers. */
        cx->step_blas++;
        cx->n_blas++;
        st = cublasSgemm(cx->dev->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w->data, in, x,
                         in, &zero, y, out);
        return st == CUBLAS_STATUS_SUCCESS ? 0 : cublas_fail(st, "cublasSgemm");
    }
    const uint16_t *wb = weight_bf16(w);
    const uint32_t tr = needs_tile(w) ? tile_rows(cx, w) : 0;
    if (!wb && (!tr || cx->wt_cap < (size_t)tr * in)) {
        log_err("cuda: a %s [%u x %u] weight without its bf16 %s reached the GEMM path "
                "(weights must be loaded with weight_upload)",
                ctype_name(w->type), w->ne1, w->ne0, tr ? "tile" : "copy");
        return KVD_EINTERNAL;
    }
    if ((rc = cuda_cx_need_xb(cx, (size_t)n * in)))
        return rc;
    if ((rc = cuda_kstatus(kvd_k_f32_to_bf16(cx->xb, x, (size_t)n * in, cx->stream), "to_bf16")))
        return rc;
    if (wb)
        return gemm_bf16(cx, wb, in, out, n, y, out);
    for (uint32_t r0 = 0; r0 < (uint32_t)out; r0 += tr) {
        const uint32_t nr = (uint32_t)out - r0 < tr ? (uint32_t)out - r0 : tr;
        if ((rc = cuda_kstatus(kvd_k_planes_to_bf16(cx->wt, w->data, (int)w->type, w->ne1, w->ne0,
                                                    r0, nr, cx->stream),
                               "dequant tile")) ||
            (rc = gemm_bf16(cx, cx->wt, in, (int)nr, n, y + r0, out)))
            return rc;
    }
    return 0;
}

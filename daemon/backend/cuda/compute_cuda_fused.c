/* compute_cuda_fused: the fused ops of compute.h on the cuda backend: the
 * projections of one input (q, k, v; one launch also when v is Q6_K after
 * q and k in Q4_K or Q5_K), gate and up with SiLU, and a
 * projection with the residual add and RMSNorm after it, each one launch of
 * the fused GEMV (kernels/gemv_fused.cu) for up to 8 rows (up to 32 of a
 * legacy quantized weight: a launch per 8; batch-invariant rows: 8 a launch;
 * more rows of a K-quant: the int8 tensor-core GEMM, whose rows are the
 * GEMV's, then the elementwise op), the int8 activations of one input
 * quantized once, by the launch that produces it (next_readers); RoPE
 * of q and k with the KV write in one launch (kernels/rope_kv.cu). Shapes
 * the GEMV does not take (more rows, weights of different types) run as the
 * op chain each replaces. */
#include "compute_cuda_impl.h"

#include "kvd/status.h"

/* Whether the fused GEMV takes x . w^T for these rows. */
static bool gemv_takes(const struct ctensor *w, const float *x, uint32_t rows)
{
    return (!ctype_is_quant(w->type) || w->layout == CL_PLANES) &&
           kvd_k_gemv_ok((int)w->type, w->data, x, (int)rows, (int)w->ne0);
}

/* rope, when not NULL: the last launch, when it is a GEMV, ends with it
 * (*roped set). */
static int matmul_n_rows(struct compute_ctx *cx, uint32_t n, const struct ctensor *const *w,
                         const float *const *bias, const float *x, uint32_t rows, float *const *y,
                         const struct kvd_k_rope_args *rope, bool *roped)
{
    uint32_t i = 0;
    int rc;
    while (i < n) {
        /* a run of weights of one type and input size, then maybe a run of
         * a second type the GEMV pairs with it (q, k, v of a Q4_K_M layer
         * whose v is Q6_K): one launch */
        uint32_t j = i + 1;
        if (gemv_takes(w[i], x, rows)) {
            while (j < n && w[j]->type == w[i]->type && w[j]->ne0 == w[i]->ne0 &&
                   gemv_takes(w[j], x, rows))
                j++;
            uint32_t k = j;
            while (k < n && w[k]->type == w[j]->type && w[k]->ne0 == w[i]->ne0 &&
                   kvd_k_gemv_pair_ok((int)w[i]->type, (int)w[k]->type) &&
                   gemv_takes(w[k], x, rows))
                k++;
            j = k;
        }
        if (gemv_takes(w[i], x, rows)) {
            if (rope && j == n) {
                cx->gemv_rope = rope;
                *roped = true;
            }
            rc = cuda_gemv(cx, (int)(j - i), w + i, bias + i, x, rows, y + i, KVD_K_GEMV_STORE,
                           NULL, 0, NULL);
        } else {
            rc = cuda_op_matmul(cx, w[i], x, rows, y[i]);
            if (!rc && bias[i])
                rc = cuda_op_add_bias(cx, y[i], bias[i], rows, w[i]->ne1);
        }
        if (rc)
            return rc;
        i = j;
    }
    return 0;
}

static int swiglu_rows(struct compute_ctx *cx, const struct ctensor *gate, const struct ctensor *up,
                       const float *x, uint32_t rows, float *out, float *tmp)
{
    int rc;
    if (gate->type == up->type && gate->ne0 == up->ne0 && gate->ne1 == up->ne1 &&
        gemv_takes(gate, x, rows) && gemv_takes(up, x, rows)) {
        const struct ctensor *w[2] = {gate, up};
        const float *b[2] = {NULL, NULL};
        float *y[2] = {out, NULL};
        return cuda_gemv(cx, 2, w, b, x, rows, y, KVD_K_GEMV_SWIGLU, NULL, 0, NULL);
    }
    if ((rc = cuda_op_matmul(cx, gate, x, rows, out)) ||
        (rc = cuda_op_matmul(cx, up, x, rows, tmp)))
        return rc;
    return cuda_op_silu_mul(cx, out, tmp, (size_t)rows * gate->ne1);
}

static int add_rmsnorm_rows(struct compute_ctx *cx, const struct ctensor *w, const float *xin,
                            uint32_t rows, float *x, const float *norm, float eps, float *out)
{
    int rc;
    if (gemv_takes(w, xin, rows)) {
        const float *b[1] = {NULL};
        float *y[1] = {x};
        return cuda_gemv(cx, 1, &w, b, xin, rows, y, KVD_K_GEMV_ADD_NORM, norm, eps, out);
    }
    if ((rc = cuda_op_matmul(cx, w, xin, rows, out)))
        return rc;
    if (norm)
        return cuda_op_add_rmsnorm(cx, x, out, out, norm, rows, w->ne1, eps);
    return cuda_op_add(cx, x, out, (size_t)rows * w->ne1);
}

/* The batch-invariant rows [0, n_one): KVD_K_GEMV_MAX_TOKENS at a time,
 * so that each takes the GEMV, whose sums for a row do not depend on the
 * other rows (as cuda_op_matmul_inv); the rows after them in one call. All
 * rows are taken so when matmul would chunk them (cuda_gemv_chunked). A
 * call the GEMV takes whole is one launch whatever n_one is. The rows of
 * the call starting at row *r, which advances. */
static uint32_t next_rows(uint32_t *r, uint32_t rows, uint32_t n_one)
{
    uint32_t r0 = *r, k;
    if (r0 < n_one)
        k = n_one - r0 < KVD_K_GEMV_MAX_TOKENS ? n_one - r0 : KVD_K_GEMV_MAX_TOKENS;
    else
        k = rows - r0;
    *r = r0 + k;
    return k;
}

static bool one_call(uint32_t rows, uint32_t n_one)
{
    return n_one == 0 || rows <= KVD_K_GEMV_MAX_TOKENS;
}

static int matmul_n_op(struct compute_ctx *cx, uint32_t n, const struct ctensor *const *w,
                       const float *const *bias, const float *x, uint32_t rows, uint32_t n_one,
                       float *const *y)
{
    if (cuda_gemv_chunked(cx, w[0], x, rows))
        n_one = rows;
    bool inv = true; /* every weight's rows batch-invariant through the qmma GEMM */
    for (uint32_t i = 0; i < n; i++)
        inv = inv && cuda_qmma_takes(cx, w[i], x, rows);
    if (inv)
        n_one = 0;
    if (one_call(rows, n_one))
        return matmul_n_rows(cx, n, w, bias, x, rows, y, NULL, NULL);
    float *yr[3];
    int rc = 0;
    if (n > 3)
        return KVD_EINTERNAL;
    for (uint32_t r = 0; r < rows && !rc;) {
        uint32_t r0 = r, k = next_rows(&r, rows, n_one);
        for (uint32_t i = 0; i < n; i++)
            yr[i] = y[i] + (size_t)r0 * w[i]->ne1;
        rc = matmul_n_rows(cx, n, w, bias, x + (size_t)r0 * w[0]->ne0, k, yr, NULL, NULL);
    }
    return rc;
}

static int matmul_swiglu_op(struct compute_ctx *cx, const struct ctensor *gate,
                            const struct ctensor *up, const float *x, uint32_t rows, uint32_t n_one,
                            float *out, float *tmp)
{
    if (cuda_gemv_chunked(cx, gate, x, rows))
        n_one = rows;
    if (cuda_qmma_takes(cx, gate, x, rows) && cuda_qmma_takes(cx, up, x, rows))
        n_one = 0; /* batch-invariant rows (the GEMV's sums) */
    if (one_call(rows, n_one))
        return swiglu_rows(cx, gate, up, x, rows, out, tmp);
    int rc = 0;
    for (uint32_t r = 0; r < rows && !rc;) {
        uint32_t r0 = r, k = next_rows(&r, rows, n_one);
        const size_t o = (size_t)r0 * gate->ne1;
        rc = swiglu_rows(cx, gate, up, x + (size_t)r0 * gate->ne0, k, out + o, tmp + o);
    }
    return rc;
}

static int matmul_add_rmsnorm_op(struct compute_ctx *cx, const struct ctensor *w, const float *xin,
                                 uint32_t rows, uint32_t n_one, float *x, const float *norm,
                                 float eps, float *out)
{
    if (cuda_gemv_chunked(cx, w, xin, rows))
        n_one = rows;
    if (cuda_qmma_takes(cx, w, xin, rows))
        n_one = 0; /* batch-invariant rows (the GEMV's sums) */
    if (one_call(rows, n_one))
        return add_rmsnorm_rows(cx, w, xin, rows, x, norm, eps, out);
    int rc = 0;
    for (uint32_t r = 0; r < rows && !rc;) {
        uint32_t r0 = r, k = next_rows(&r, rows, n_one);
        const size_t o = (size_t)r0 * w->ne1;
        rc = add_rmsnorm_rows(cx, w, xin + (size_t)r0 * w->ne0, k, x + o, norm, eps, out + o);
    }
    return rc;
}

/* The fused ops: each ends with the quantization its GEMV emitted (if
 * any) the live one (cuda_pq_end_op). */
int cuda_op_matmul_n(struct compute_ctx *cx, uint32_t n, const struct ctensor *const *w,
                     const float *const *bias, const float *x, uint32_t rows, uint32_t n_one,
                     float *const *y)
{
    int rc = matmul_n_op(cx, n, w, bias, x, rows, n_one, y);
    cuda_pq_end_op(cx);
    return rc;
}

int cuda_op_matmul_swiglu(struct compute_ctx *cx, const struct ctensor *gate,
                          const struct ctensor *up, const float *x, uint32_t rows, uint32_t n_one,
                          float *out, float *tmp)
{
    int rc = matmul_swiglu_op(cx, gate, up, x, rows, n_one, out, tmp);
    cuda_pq_end_op(cx);
    return rc;
}

int cuda_op_matmul_add_rmsnorm(struct compute_ctx *cx, const struct ctensor *w, const float *xin,
                               uint32_t rows, uint32_t n_one, float *x, const float *norm,
                               float eps, float *out)
{
    int rc = matmul_add_rmsnorm_op(cx, w, xin, rows, n_one, x, norm, eps, out);
    cuda_pq_end_op(cx);
    return rc;
}

/* Up to 8 rows (one GEMV call per run of weights of one type): the last
 * launch ends with RoPE and the KV write when it is the GEMV's; else they
 * are their own launch (rope_kv_write). */
int cuda_op_matmul_qkv_rope_kv(struct compute_ctx *cx, const struct ctensor *const *w,
                               const float *const *bias, const float *x, uint32_t rows,
                               uint32_t n_one, float *const *y, const struct rope_kv_args *r)
{
    struct kvd_k_rope_args rk = {.q = y[0],
                                 .k = y[1],
                                 .v = y[2],
                                 .pos = r->pos,
                                 .slots = r->tok_slot,
                                 .n_heads = (int)r->n_head,
                                 .n_rot = (int)r->n_rot,
                                 .mode = (int)r->mode,
                                 .base = r->base,
                                 .freq_factors = r->freq_factors,
                                 .layer = (int)r->layer};
    cuda_kv_of(&rk.kv, r->arena, r->geom);
    bool roped = false;
    int rc;
    if (rows <= KVD_K_GEMV_MAX_TOKENS)
        rc = matmul_n_rows(cx, 3, w, bias, x, rows, y, &rk, &roped);
    else
        rc = matmul_n_op(cx, 3, w, bias, x, rows, n_one, y);
    cx->gemv_rope = NULL;
    cuda_pq_end_op(cx);
    if (rc || roped)
        return rc;
    return cuda_op_rope_kv_write(cx, y[0], y[1], y[2], rows, r->n_head, r->n_rot, r->pos, r->mode,
                                 r->base, r->freq_factors, r->arena, r->geom, r->layer,
                                 r->tok_slot);
}

/* The readers' weight types, one per int8 layout (at most two), of those
 * the fused GEMV would take with quantized activations. */
void cuda_op_next_readers(struct compute_ctx *cx, const float *y, uint32_t n,
                          const struct ctensor *const *w)
{
    cx->readers.y = NULL;
    cx->readers.n = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!w[i] || !gemv_takes(w[i], y, 1))
            continue;
        const int kind = kvd_k_gemv_act_kind((int)w[i]->type);
        bool have = kind == 0;
        for (int j = 0; j < cx->readers.n && !have; j++)
            have = kvd_k_gemv_act_kind(cx->readers.wtype[j]) == kind;
        if (have)
            continue;
        if (cx->readers.n == 2)
            break;
        if (cx->readers.n && w[i]->ne0 != cx->readers.in)
            continue;
        cx->readers.in = (uint32_t)w[i]->ne0;
        cx->readers.wtype[cx->readers.n++] = (int)w[i]->type;
    }
    if (cx->readers.n)
        cx->readers.y = y;
}

int cuda_op_rope_kv_write(struct compute_ctx *cx, float *q, float *k, const float *v, uint32_t rows,
                          uint32_t n_head, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                          float base, const float *freq_factors, void *arena,
                          const struct kv_geom *geom, uint32_t layer, const uint32_t *tok_slot)
{
    struct kvd_k_kv kv;
    cuda_kv_of(&kv, arena, geom);
    return cuda_kstatus(kvd_k_rope_kv(q, k, v, pos, tok_slot, (int)rows, (int)n_head, (int)n_rot,
                                      base, freq_factors, (int)mode, &kv, (int)layer, cx->stream),
                        "rope + kv_write");
}

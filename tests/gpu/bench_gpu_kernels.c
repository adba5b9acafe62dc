/* bench_gpu_kernels: bench_gpu's sections of single kernels (bench_gpu.h):
 * the projections alone per weight type and token count (GB/s of the GEMV
 * for 1-32 tokens; TOPS of a 16-512-token GEMM, the K-quants' int8
 * tensor-core kernel against bf16's cuBLAS), paged decode and prefill
 * attention, and one launch of each kernel device_check.sh profiles (ncu). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "bench_gpu.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "model_impl.h"

/* ---- projections alone -------------------------------------------------------------- */

/* y = x W^T through the backend's matmul op, W [out][in] of each type, for
 * 1..32 tokens: weight bytes per second. Four copies of W are rotated so no
 * run finds W in the L2. */
void bench_gemv(struct backend *be, double bw)
{
    static const enum ctype types[] = {CT_BF16, CT_Q8_0, CT_Q4_0, CT_Q4_K, CT_Q5_K, CT_Q6_K};
    static const uint32_t toks[] = {1, 2, 3, 4, 8, 16, 32};
    const int nt = (int)(sizeof toks / sizeof toks[0]);
    const uint32_t in = bench_small ? 512 : 4096, out = bench_small ? 256 : 14336;
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    cudaStream_t st = cuda_backend_dev(be)->compute;
    float *x, *y;
    BCK(cudaMalloc((void **)&x, (size_t)32 * in * 4));
    BCK(cudaMalloc((void **)&y, (size_t)32 * out * 4));
    BKCK(kvd_k_fill_uniform(x, KVD_K_F32, (size_t)32 * in, 7, -1, 1, NULL));
    cudaEvent_t e0, e1;
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    printf("\nprojection [%u x %u] alone, weight GB/s (%% of copy bandwidth):\n%-8s", out, in,
           "type");
    for (int k = 0; k < nt; k++)
        printf(" %11u", toks[k]);
    printf("\n");
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        struct ctensor w[4];
        for (int c = 0; c < 4; c++) {
            w[c] = (struct ctensor){.type = types[ti], .ne0 = in, .ne1 = out};
            w[c].nbytes = ctype_row_bytes(types[ti], in) * out;
            if (o->buf_alloc(cx, o->weight_bytes(&w[c]), &w[c].data))
                exit(1);
            if (ctype_is_quant(types[ti]))
                BKCK(kvd_k_fill_qweight(w[c].data, (int)types[ti],
                                        w[c].nbytes / ctype_block_bytes(types[ti]), 11 + c, NULL));
            else
                BKCK(kvd_k_fill_uniform(w[c].data, KVD_K_BF16, (size_t)in * out, 11 + c, -0.03f,
                                        0.03f, NULL));
            BCK(cudaDeviceSynchronize());
            if (cuda_compute_weight_prepare(cx, &w[c]))
                exit(1);
        }
        printf("%-8s", ctype_name(types[ti]));
        for (int k = 0; k < nt; k++) {
            double t[16];
            const int iters = bench_small ? 2 : 16;
            for (int i = 0; i < iters + 2; i++) {
                float ms;
                BCK(cudaEventRecord(e0, st));
                if (o->matmul(cx, &w[i % 4], x, toks[k], y))
                    exit(1);
                BCK(cudaEventRecord(e1, st));
                BCK(cudaEventSynchronize(e1));
                BCK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 2)
                    t[i - 2] = ms * 1e-3;
            }
            double gbs = w[0].nbytes / bench_median(t, iters);
            printf(" %5.0f (%3.0f%%)", gbs / 1e9, 100 * gbs / bw);
            if (toks[k] == 1 || toks[k] == 8 || toks[k] == 32) {
                char what[72], v[24], c[24];
                snprintf(what, sizeof what, "projection %s, %u token%s (GB/s)",
                         ctype_name(types[ti]), toks[k], toks[k] > 1 ? "s" : "");
                bench_row(what, bench_fmt(v, "%.0f", gbs / 1e9), bench_fmt(c, "%.0f", bw / 1e9),
                          100 * gbs / bw);
            }
        }
        printf("\n");
        for (int c = 0; c < 4; c++)
            o->buf_free(cx, w[c].data);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(x);
    cudaFree(y);
    o->ctx_free(cx);
}

/* The projections of a prefill chunk and of large batches through the
 * backend's matmul: the K-quants on the int8 tensor cores
 * (kernels/gemm_qmma.cu, activation quantization included) and, rows
 * "-tile", as before it (8-row GEMVs up to 32 tokens, dequantized tiles +
 * cuBLAS above), bf16 through cuBLAS; TOPS against the dense int8 (bf16)
 * peak. */
void bench_qgemm(struct backend *be)
{
    static const enum ctype types[] = {CT_BF16, CT_Q4_K, CT_Q6_K, CT_Q4_K, CT_Q6_K};
    static const uint32_t toks[] = {16, 64, 512};
    const uint32_t in = bench_small ? 512 : 4096, out = bench_small ? 256 : 14336;
    const double i8_peak = 1979e12, bf16_peak = 989e12; /* H100/H200 SXM datasheet, dense */
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    cudaStream_t st = cuda_backend_dev(be)->compute;
    const uint32_t nmax = bench_small ? 64 : 512;
    float *x, *y;
    BCK(cudaMalloc((void **)&x, (size_t)nmax * in * 4));
    BCK(cudaMalloc((void **)&y, (size_t)nmax * out * 4));
    BKCK(kvd_k_fill_uniform(x, KVD_K_F32, (size_t)nmax * in, 7, -1, 1, NULL));
    cudaEvent_t e0, e1;
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    printf("\nprojection GEMM [%u x %u], TOPS (%% of dense int8 peak; bf16: of bf16 peak):\n%-10s",
           out, in, "type");
    for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++)
        printf(" %13u", toks[k] > nmax ? nmax : toks[k]);
    printf("\n");
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        struct ctensor w = {.type = types[ti], .ne0 = in, .ne1 = out};
        w.nbytes = ctype_row_bytes(types[ti], in) * out;
        if (o->buf_alloc(cx, o->weight_bytes(&w), &w.data))
            exit(1);
        if (ctype_is_quant(types[ti]))
            BKCK(kvd_k_fill_qweight(w.data, (int)types[ti], w.nbytes / ctype_block_bytes(types[ti]),
                                    11, NULL));
        else
            BKCK(kvd_k_fill_uniform(w.data, KVD_K_BF16, (size_t)in * out, 11, -0.03f, 0.03f, NULL));
        BCK(cudaDeviceSynchronize());
        if (cuda_compute_weight_prepare(cx, &w))
            exit(1);
        /* A stream operation between the repacking kernel and the first
         * projection: the GEMV (8-row launches, the "-tile" rows) loads its
         * first weights before its programmatic-dependent-launch wait. */
        BCK(cudaMemsetAsync(y, 0, sizeof(float), st));
        const bool tile = ti >= 3; /* the same types as before the int8 GEMM */
        cuda_compute_set_qmma(cx, !tile);
        const double peak = ctype_is_quant(types[ti]) ? i8_peak : bf16_peak;
        char name[16];
        snprintf(name, sizeof name, "%s%s", ctype_name(types[ti]), tile ? "-tile" : "");
        printf("%-10s", name);
        for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
            const uint32_t n = toks[k] > nmax ? nmax : toks[k];
            const int iters = bench_small ? 1 : 10;
            double t[16];
            for (int i = 0; i < iters + 1; i++) {
                float ms;
                BCK(cudaEventRecord(e0, st));
                if (o->matmul(cx, &w, x, n, y))
                    exit(1);
                BCK(cudaEventRecord(e1, st));
                BCK(cudaEventSynchronize(e1));
                BCK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 1)
                    t[i - 1] = ms * 1e-3;
            }
            const double ops = 2.0 * in * out * n / bench_median(t, iters);
            printf(" %6.1f (%3.0f%%)", ops / 1e12, 100 * ops / peak);
            char what[72], v[24], c[24];
            snprintf(what, sizeof what, "projection GEMM %s, %u tokens (TOPS)", name, n);
            bench_row(what, bench_fmt(v, "%.1f", ops / 1e12), bench_fmt(c, "%.0f", peak / 1e12),
                      100 * ops / peak);
        }
        printf("\n");
        o->buf_free(cx, w.data);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(x);
    cudaFree(y);
    o->ctx_free(cx);
}

/* ---- attention ---------------------------------------------------------------------------- */

static uint32_t gcd(uint32_t a, uint32_t b)
{
    while (b) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* One attention op over n_seqs sequences (rows[s] new rows at pos0[s]),
 * D = 128, 8 KV heads, n_heads query heads, bf16 KV in 16-token blocks
 * scattered over the arena: median GPU time of the op. */
static double attn_time(struct backend *be, uint32_t n_heads, uint32_t n_seqs, const uint32_t *pos0,
                        const uint32_t *rows, double *kv_bytes)
{
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    struct kv_geom g = {
        .layers = 1, .kv_heads = 8, .head_dim = 128, .dtype = KV_BF16, .block_tokens = 16};
    uint32_t *qstart = malloc((n_seqs + 1) * 4), *slot0 = malloc((n_seqs + 1) * 4);
    uint32_t T = 0, NS = 0, max_q = 0, max_kv = 0;
    *kv_bytes = 0;
    for (uint32_t s = 0; s < n_seqs; s++) {
        uint32_t end = pos0[s] + rows[s];
        qstart[s] = T;
        slot0[s] = NS;
        T += rows[s];
        NS += (end + 15) / 16;
        max_q = rows[s] > max_q ? rows[s] : max_q;
        max_kv = end > max_kv ? end : max_kv;
        *kv_bytes += (double)end * kv_token_bytes(&g);
    }
    qstart[n_seqs] = T;
    slot0[n_seqs] = NS;
    uint32_t *slots = malloc((size_t)NS * 4), a = 7919;
    while (gcd(a, NS) != 1) /* a stride prime to NS: a permutation scattering every sequence */
        a += 2;
    for (uint32_t b = 0; b < NS; b++)
        slots[b] = (uint32_t)(((uint64_t)b * a + 3) % NS);
    size_t ab = kv_block_bytes(&g) * NS;
    void *arena;
    float *q, *out;
    BCK(cudaMalloc(&arena, ab));
    BCK(cudaMalloc((void **)&q, (size_t)T * n_heads * 128 * 4));
    BCK(cudaMalloc((void **)&out, (size_t)T * n_heads * 128 * 4));
    BKCK(kvd_k_fill_uniform(arena, KVD_K_BF16, ab / 2, 3, -2, 2, NULL));
    BKCK(kvd_k_fill_uniform(q, KVD_K_F32, (size_t)T * n_heads * 128, 4, -1, 1, NULL));
    uint32_t *d_qs, *d_p0, *d_s0, *d_sl;
    BCK(cudaMalloc((void **)&d_qs, (n_seqs + 1) * 4));
    BCK(cudaMalloc((void **)&d_p0, n_seqs * 4));
    BCK(cudaMalloc((void **)&d_s0, (n_seqs + 1) * 4));
    BCK(cudaMalloc((void **)&d_sl, (size_t)NS * 4));
    BCK(cudaMemcpy(d_qs, qstart, (n_seqs + 1) * 4, cudaMemcpyHostToDevice));
    BCK(cudaMemcpy(d_p0, pos0, n_seqs * 4, cudaMemcpyHostToDevice));
    BCK(cudaMemcpy(d_s0, slot0, (n_seqs + 1) * 4, cudaMemcpyHostToDevice));
    BCK(cudaMemcpy(d_sl, slots, (size_t)NS * 4, cudaMemcpyHostToDevice));
    BCK(cudaDeviceSynchronize());
    struct attn_desc d = {.q = q,
                          .out = out,
                          .arena = arena,
                          .geom = &g,
                          .layer = 0,
                          .n_head = n_heads,
                          .scale = 1.0f / sqrtf(128.0f),
                          .n_tokens = T,
                          .n_seqs = n_seqs,
                          .seq_qstart = d_qs,
                          .seq_pos0 = d_p0,
                          .seq_slot0 = d_s0,
                          .slots = d_sl,
                          .max_q = max_q,
                          .max_kv = max_kv,
                          .h_seq_qstart = qstart,
                          .h_seq_pos0 = pos0};
    cudaStream_t st = cuda_backend_dev(be)->compute;
    cudaEvent_t e0, e1;
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    double t[12];
    const int iters = bench_small || bench_ncu ? 1 : 10, warm = bench_ncu ? 0 : 2;
    for (int i = 0; i < iters + warm; i++) {
        float ms;
        BCK(cudaEventRecord(e0, st));
        if (o->attention(cx, &d))
            exit(1);
        BCK(cudaEventRecord(e1, st));
        BCK(cudaEventSynchronize(e1));
        BCK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= warm)
            t[i - warm] = ms * 1e-3;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(arena);
    cudaFree(q);
    cudaFree(out);
    cudaFree(d_qs);
    cudaFree(d_p0);
    cudaFree(d_s0);
    cudaFree(d_sl);
    free(qstart);
    free(slot0);
    free(slots);
    o->ctx_free(cx);
    return bench_median(t, iters);
}

/* Paged decode attention: D 128, GQA 4 and 8, batch 1 and 16, context 4k
 * and 32k: KV bytes read per second against copy bandwidth. */
void bench_attn(struct backend *be, double bw)
{
    static const uint32_t gqa[] = {4, 8}, batch[] = {1, 16}, ctx[] = {4096, 32768};
    printf("\ndecode attention, D 128, 8 KV heads, bf16 KV:\n");
    for (int gi = 0; gi < 2; gi++)
        for (int bi = 0; bi < 2; bi++)
            for (int ci = 0; ci < 2; ci++) {
                uint32_t B = batch[bi], C = bench_small ? ctx[ci] / 64 : ctx[ci], pos0[16],
                         rows[16];
                for (uint32_t s = 0; s < B; s++) {
                    pos0[s] = C - 1;
                    rows[s] = 1;
                }
                double kvb;
                double t = attn_time(be, 8 * gqa[gi], B, pos0, rows, &kvb);
                double gbs = kvb / t;
                printf("  GQA %u batch %2u context %5u: %8.1f us, %6.0f GB/s (%.1f%%)\n", gqa[gi],
                       B, C, t * 1e6, gbs / 1e9, 100 * gbs / bw);
                char what[72], v[24], c[24];
                snprintf(what, sizeof what, "decode attention GQA %u batch %u ctx %u (GB/s)",
                         gqa[gi], B, C);
                bench_row(what, bench_fmt(v, "%.0f", gbs / 1e9), bench_fmt(c, "%.0f", bw / 1e9),
                          100 * gbs / bw);
            }
}

/* Prefill attention: a 512-row chunk of one sequence at prefix 0 and
 * 31.5k (32 query heads, 8 KV heads, D 128), and a mixed step (that chunk at
 * prefix 4k with 15 decode rows at contexts 4k..32k): FLOP/s against the
 * bf16 dense tensor-core peak given (H200/H100 SXM datasheet: 989 TFLOP/s). */
void bench_prefill(struct backend *be, double tc_peak)
{
    const uint32_t R = bench_small ? 32 : 512, P1 = bench_small ? 200 : 32256,
                   PM = bench_small ? 64 : 4096;
    uint32_t pos0[16], rows[16];
    char what[72], v[24], c[24];
    printf("\nprefill attention, 32 heads / 8 KV heads, D 128, bf16 KV:\n");
    for (int k = 0; k < 2; k++) {
        pos0[0] = k ? P1 : 0;
        rows[0] = R;
        double kvb, flops = 0;
        for (uint32_t r = 0; r < R; r++) /* causal: row r sees pos0 + r + 1 keys */
            flops += 4.0 * 32 * 128 * (pos0[0] + r + 1);
        double t = attn_time(be, 32, 1, pos0, rows, &kvb);
        printf("  %u rows at prefix %5u: %8.1f us, %.1f TFLOP/s (%.1f%% of %.0f)\n", R, pos0[0],
               t * 1e6, flops / t / 1e12, 100 * flops / t / tc_peak, tc_peak / 1e12);
        snprintf(what, sizeof what, "prefill attention %u rows at %u (TFLOP/s)", R, pos0[0]);
        bench_row(what, bench_fmt(v, "%.1f", flops / t / 1e12),
                  bench_fmt(c, "%.0f", tc_peak / 1e12), 100 * flops / t / tc_peak);
    }
    pos0[0] = PM;
    rows[0] = R;
    for (uint32_t s = 1; s < 16; s++) {
        pos0[s] = (bench_small ? 64 : 4096) + (s - 1) * (bench_small ? 8 : 2048);
        rows[s] = 1;
    }
    double kvb;
    double t = attn_time(be, 32, 16, pos0, rows, &kvb);
    printf("  mixed: %u rows at %u + 15 decode rows at %u..%u: %8.1f us (%.1f MB of KV)\n", R, PM,
           pos0[1], pos0[15], t * 1e6, kvb / 1e6);
    bench_row("mixed step attention: chunk + 15 decode rows (us)", bench_fmt(v, "%.1f", t * 1e6),
              "-", -1);
}

/* ---- one launch of each kernel of interest, for ncu ----------------------------------------- */

/* What device_check.sh profiles with ncu (--only ncu, not in the default
 * run): each projection type at 1 and 8 tokens (and 512, the prefill
 * chunk: the K-quants' int8 GEMM, bf16's cuBLAS), decode attention at GQA 8
 * batch 1 context 32k and GQA 4 batch 16 context 4k, one 512-row prefill
 * chunk at 31.5k: each op once, on the full shapes. */
void bench_ncu_set(struct backend *be)
{
    static const enum ctype types[] = {CT_BF16, CT_Q8_0, CT_Q4_0, CT_Q4_K, CT_Q5_K, CT_Q6_K};
    const uint32_t in = bench_small ? 512 : 4096, out = bench_small ? 256 : 14336;
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    float *x, *y;
    const uint32_t chunk = bench_small ? 64 : 512;
    BCK(cudaMalloc((void **)&x, (size_t)chunk * in * 4));
    BCK(cudaMalloc((void **)&y, (size_t)chunk * out * 4));
    BKCK(kvd_k_fill_uniform(x, KVD_K_F32, (size_t)chunk * in, 7, -1, 1, NULL));
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        struct ctensor w = {.type = types[ti], .ne0 = in, .ne1 = out};
        w.nbytes = ctype_row_bytes(types[ti], in) * out;
        if (o->buf_alloc(cx, o->weight_bytes(&w), &w.data))
            exit(1);
        if (ctype_is_quant(types[ti]))
            BKCK(kvd_k_fill_qweight(w.data, (int)types[ti], w.nbytes / ctype_block_bytes(types[ti]),
                                    11, NULL));
        else
            BKCK(kvd_k_fill_uniform(w.data, KVD_K_BF16, (size_t)in * out, 11, -0.03f, 0.03f, NULL));
        BCK(cudaDeviceSynchronize());
        if (cuda_compute_weight_prepare(cx, &w))
            exit(1);
        /* as in qgemm: the GEMV's prologue must not overlap the repacking */
        BCK(cudaMemsetAsync(y, 0, sizeof(float), cuda_backend_dev(be)->compute));
        if (o->matmul(cx, &w, x, 1, y) || o->matmul(cx, &w, x, 8, y) ||
            ((types[ti] == CT_BF16 || types[ti] == CT_Q4_K || types[ti] == CT_Q6_K) &&
             o->matmul(cx, &w, x, chunk, y)) ||
            o->sync(cx))
            exit(1);
        o->buf_free(cx, w.data);
    }
    cudaFree(x);
    cudaFree(y);
    o->ctx_free(cx);
    uint32_t pos0[16], rows[16];
    double kvb;
    pos0[0] = (bench_small ? 512 : 32768) - 1;
    rows[0] = 1;
    attn_time(be, 64, 1, pos0, rows, &kvb);
    for (int s = 0; s < 16; s++) {
        pos0[s] = (bench_small ? 128 : 4096) - 1;
        rows[s] = 1;
    }
    attn_time(be, 32, 16, pos0, rows, &kvb);
    pos0[0] = bench_small ? 200 : 32256;
    rows[0] = bench_small ? 32 : 512;
    attn_time(be, 32, 1, pos0, rows, &kvb);
}

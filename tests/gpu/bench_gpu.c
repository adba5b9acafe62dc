/* bench_gpu: the cuda backend's numbers on the device it finds, each against
 * a ceiling measured in the same run (device-to-device copy bandwidth; the
 * launch cost of an empty kernel): decode steps of 8B- and 1B-shaped models
 * (random bf16 and Q4_K_M weights made on the device) against the HBM
 * roofline with each op's GPU time, the projections alone per weight type
 * and token count (GB/s for 1-32 tokens; TOPS of a 16-512-token GEMM: the
 * K-quants' int8 tensor-core kernel against bf16's cuBLAS), paged decode and prefill attention, new
 * KV blocks' zero-fill, swaps, and CUDA graphs against eager steps. Prints a table last. bench_gpu
 * [--only SECTION,...] [--small] sections: copy launch decode8b decode1b gemv attn prefill zero
 * swap (copy always runs: it is every other section's ceiling); `--only ncu` runs each kernel
 * device_check.sh profiles once, and nothing else. --small shrinks every shape so the whole program
 * runs on the CPU emulator (a check that the device run will run, not a measurement). Exits 77
 * without a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_cuda.h"
#include "bench_gpu.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "model_impl.h"

static bool g_small, g_ncu;
static const char *g_only;

static bool want(const char *section)
{
    if (!g_only)
        return true;
    size_t n = strlen(section);
    for (const char *p = g_only; (p = strstr(p, section)); p += n)
        if ((p == g_only || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
            return true;
    return false;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- the summary table ------------------------------------------------------ */

struct srow {
    char what[72];
    char value[24], ceiling[24], pct[12];
};
static struct srow g_rows[128];
static int g_nrows;

static void row(const char *what, const char *value, const char *ceiling, double pct)
{
    if (g_nrows == 128)
        return;
    struct srow *r = &g_rows[g_nrows++];
    snprintf(r->what, sizeof r->what, "%s", what);
    snprintf(r->value, sizeof r->value, "%s", value);
    snprintf(r->ceiling, sizeof r->ceiling, "%s", ceiling);
    if (pct >= 0)
        snprintf(r->pct, sizeof r->pct, "%.1f%%", pct);
    else
        snprintf(r->pct, sizeof r->pct, "-");
}

static char *fmt(char *buf, const char *f, double v)
{
    snprintf(buf, 24, f, v);
    return buf;
}

/* ---- copy bandwidth and launch cost ------------------------------------------ */

/* Device-to-device copy bandwidth, bytes read + written per second. */
static double copy_bw(void)
{
    size_t bytes = g_small ? (size_t)8 << 20 : (size_t)2 << 30;
    void *a, *b;
    cudaEvent_t e0, e1;
    double t[10];
    BCK(cudaMalloc(&a, bytes));
    BCK(cudaMalloc(&b, bytes));
    BKCK(kvd_k_fill_uniform(a, KVD_K_F32, bytes / 4, 1, -1, 1, NULL));
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    for (int i = 0; i < 13; i++) {
        BCK(cudaEventRecord(e0, 0));
        BCK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        BCK(cudaEventRecord(e1, 0));
        BCK(cudaEventSynchronize(e1));
        float ms;
        BCK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3)
            t[i - 3] = ms * 1e-3;
    }
    BCK(cudaFree(a));
    BCK(cudaFree(b));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 2.0 * bytes / median(t, 10);
}

/* Time per kernel of a chain of empty kernels: issued one by one (eager),
 * and replayed from one CUDA graph (what a captured decode step pays per
 * kernel beyond its own work). */
static void launch_cost(double *eager_us, double *graph_us)
{
    const int n = g_small ? 20 : 1000;
    cudaStream_t s;
    cudaEvent_t e0, e1;
    BCK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    double te[5], tg[5];
    cudaGraph_t g;
    cudaGraphExec_t ge;
    BCK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; i++)
        BKCK(kvd_k_empty((kvd_stream)s));
    BCK(cudaStreamEndCapture(s, &g));
    BCK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < 6; r++) {
        float ms;
        BKCK(kvd_k_spin(2000000, (kvd_stream)s)); /* the chain is issued ahead of the device */
        BCK(cudaEventRecord(e0, s));
        for (int i = 0; i < n; i++)
            BKCK(kvd_k_empty((kvd_stream)s));
        BCK(cudaEventRecord(e1, s));
        BCK(cudaEventSynchronize(e1));
        BCK(cudaEventElapsedTime(&ms, e0, e1));
        if (r)
            te[r - 1] = ms * 1e3 / n;
        BCK(cudaEventRecord(e0, s));
        BCK(cudaGraphLaunch(ge, s));
        BCK(cudaEventRecord(e1, s));
        BCK(cudaEventSynchronize(e1));
        BCK(cudaEventElapsedTime(&ms, e0, e1));
        if (r)
            tg[r - 1] = ms * 1e3 / n;
    }
    *eager_us = median(te, 5);
    *graph_us = median(tg, 5);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
}

/* ---- decode steps ---------------------------------------------------------------- */

#define DEC_MAXB 256u

struct dec_fx {
    struct model *m;
    struct fwd_ctx *fc;
    struct kv_geom g;
    void *arena;
    size_t arena_bytes;
    uint32_t n_slots, ctx, bps; /* slots, context of every sequence, blocks per sequence */
    uint64_t wbytes;
};

static void dec_open(struct dec_fx *d, struct backend *be, const struct bench_shape *sh, bool q4km,
                     uint32_t max_batch, uint32_t ctx)
{
    memset(d, 0, sizeof *d);
    d->m = bench_model_new(be, sh, q4km, &d->wbytes);
    d->ctx = ctx;
    d->bps = (ctx + 15) / 16;
    model_kv_geom(d->m, 16, KV_BF16, &d->g);
    d->n_slots = max_batch * d->bps;
    d->arena_bytes = kv_block_bytes(&d->g) * d->n_slots;
    if (be->ops->arena_alloc(be, KVD_TIER_DEVICE, d->arena_bytes, &d->arena)) {
        fprintf(stderr, "bench_gpu: no memory for a %zu-byte KV arena\n", d->arena_bytes);
        exit(1);
    }
    BKCK(kvd_k_fill_uniform(d->arena, KVD_K_BF16, d->arena_bytes / 2, 9, -1, 1, NULL));
    BCK(cudaDeviceSynchronize()); /* filled on the legacy stream; compute uses its own */
    if (fwd_ctx_new(d->m, max_batch, max_batch, &d->fc))
        exit(1);
}

static void dec_close(struct dec_fx *d, struct backend *be)
{
    fwd_ctx_free(d->fc);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d->arena, d->arena_bytes);
    model_free(d->m);
}

/* Median wall time of one decode step of `batch` sequences at context
 * d->ctx, as the executor runs it: tokens sampled on the device (greedy, or
 * temperature 0.8 / top-k 50 / top-p 0.95 when sampled), ids downloaded.
 * iters 0: one step (profiling). */
static double decode_step(struct dec_fx *d, uint32_t batch, bool sampled, int iters)
{
    static uint32_t toks[DEC_MAXB], picks[DEC_MAXB];
    static struct sample_row rows[DEC_MAXB];
    uint32_t *tables = malloc((size_t)batch * d->bps * 4);
    struct fwd_seq seqs[DEC_MAXB];
    double t[64];
    for (uint32_t s = 0; s < batch; s++) {
        for (uint32_t i = 0; i < d->bps; i++) /* interleaved: blocks of a sequence apart */
            tables[s * d->bps + i] = i * batch + s;
        toks[s] = (s * 7919u) % d->m->hp.n_vocab;
        rows[s] = sampled ? (struct sample_row){.temperature = 0.8f,
                                                .top_k = 50,
                                                .top_p = 0.95f,
                                                .u = (double)s / DEC_MAXB}
                          : (struct sample_row){.top_p = 1.0f};
        seqs[s] = (struct fwd_seq){.tokens = &toks[s],
                                   .n_tokens = 1,
                                   .pos0 = d->ctx - 1,
                                   .slots = tables + s * d->bps,
                                   .n_slots = d->bps};
    }
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = batch,
                          .kv_arena = d->arena,
                          .geom = &d->g,
                          .n_arena_slots = d->n_slots,
                          .sample = rows,
                          .tokens = picks};
    int warm = iters ? 3 : 0, n = iters ? iters : 1;
    for (int i = 0; i < warm + n; i++) {
        double t0 = now_s();
        if (model_forward(d->m, d->fc, &b)) {
            fprintf(stderr, "bench_gpu: model_forward: %s\n", fwd_ctx_errmsg(d->fc));
            exit(1);
        }
        if (i >= warm)
            t[i - warm] = now_s() - t0;
    }
    free(tables);
    return median(t, n);
}

/* One batch-1 decode step of an 8B-shaped model: graph-replayed step time
 * against the roofline (weights + KV bytes / copy bandwidth), the kernels
 * per step and per layer, and each op's GPU time in an eager step. */
static void decode8b(struct backend *be, double bw, bool q4km)
{
    static const struct bench_shape s8b = {"Llama-3-8B shape", 32, 4096, 32, 8, 14336, 128256, 0};
    static const struct bench_shape s8b_small = {"8B-like small", 2, 512, 8, 2, 1024, 1024, 0};
    const struct bench_shape *sh = g_small ? &s8b_small : &s8b;
    const char *mix = q4km ? "Q4_K_M" : "bf16";
    struct dec_fx d;
    dec_open(&d, be, sh, q4km, 1, g_small ? 256 : 1024);
    double kv = (double)kv_token_bytes(&d.g) * d.ctx;
    double roof = ((double)d.wbytes + kv) / bw;
    cuda_compute_set_graphs(d.m->cx, true);
    double tg = decode_step(&d, 1, false, g_small ? 3 : 30);
    uint32_t launches = model_step_launches(d.m);
    cuda_compute_set_graphs(d.m->cx, false);
    double te = decode_step(&d, 1, false, g_small ? 2 : 10);
    printf("\n%s, %s: weights %.2f GB read per step, KV %.1f MB at context %u\n", sh->name, mix,
           d.wbytes / 1e9, kv / 1e6, d.ctx);
    printf("  step (graph): %.3f ms, eager %.3f ms, roofline %.3f ms (%.1f%%), %.0f tok/s; "
           "%u kernels per step, %.1f per layer\n",
           tg * 1e3, te * 1e3, roof * 1e3, 100 * roof / tg, 1 / tg, launches,
           (double)launches / sh->layers);
    /* each op's GPU time in one eager step, issued ahead of the device */
    bench_prof_install(d.m, be);
    struct bench_prof_row pr[64];
    bench_prof_begin();
    BKCK(kvd_k_spin(g_small ? 0 : 200000000, (kvd_stream)cuda_backend_dev(be)->compute));
    decode_step(&d, 1, false, 0);
    int np = bench_prof_end(pr, 64);
    bench_prof_remove(d.m);
    double sum = 0;
    printf("  %-26s %6s %10s %10s %8s %7s\n", "op", "calls", "us/step", "MB", "GB/s", "% copy");
    for (int i = 0; i < np; i++) {
        sum += pr[i].us;
        double gbs = pr[i].bytes ? pr[i].bytes / (pr[i].us * 1e-6) / 1e9 : 0;
        printf("  %-26s %6d %10.1f %10.1f %8.0f %7.1f\n", pr[i].name, pr[i].calls, pr[i].us,
               pr[i].bytes / 1e6, gbs, pr[i].bytes ? 100 * gbs * 1e9 / bw : 0.0);
    }
    printf("  %-26s %6s %10.1f   (ops' GPU time; the graph step above is %.1f us)\n", "sum", "",
           sum, tg * 1e6);
    char what[72], v[24], c[24];
    snprintf(what, sizeof what, "decode 8B %s batch 1 (ms vs roofline)", mix);
    row(what, fmt(v, "%.3f", tg * 1e3), fmt(c, "%.3f", roof * 1e3), 100 * roof / tg);
    snprintf(what, sizeof what, "  kernels per step / per layer (%s)", mix);
    snprintf(v, sizeof v, "%u", launches);
    row(what, v, fmt(c, "%.1f", (double)launches / sh->layers), -1);
    snprintf(what, sizeof what, "  eager step %s (ms, vs graph)", mix);
    row(what, fmt(v, "%.3f", te * 1e3), fmt(c, "%.3f", tg * 1e3), 100 * tg / te);
    for (int i = 0; i < np; i++) {
        if (!pr[i].bytes)
            continue;
        double gbs = pr[i].bytes / (pr[i].us * 1e-6);
        snprintf(what, sizeof what, "  %.6s %.38s (GB/s, eager)", mix, pr[i].name);
        row(what, fmt(v, "%.0f", gbs / 1e9), fmt(c, "%.0f", bw / 1e9), 100 * gbs / bw);
    }
    dec_close(&d, be);
}

/* The Llama-3.2-1B-shaped bf16 model at batch 1, 8, 64, 256 (context 512),
 * a sampled batch of 64, and batch 1 eager against graphs. */
static void decode1b(struct backend *be, double bw)
{
    static const struct bench_shape s1b = {"Llama-3.2-1B shape", 16, 2048, 32, 8, 8192, 128256, 1};
    static const struct bench_shape s1b_small = {"1B-like small", 2, 256, 4, 2, 512, 512, 1};
    static const uint32_t batches[] = {1, 8, 64, 256};
    struct dec_fx d;
    dec_open(&d, be, g_small ? &s1b_small : &s1b, false, g_small ? 8 : DEC_MAXB,
             g_small ? 64 : 512);
    double kvt = (double)kv_token_bytes(&d.g);
    char what[72], v[24], c[24];
    cuda_compute_set_graphs(d.m->cx, true);
    for (int i = 0; i < 4; i++) {
        uint32_t B = g_small ? (batches[i] > 8 ? 8 : batches[i]) : batches[i];
        double t = decode_step(&d, B, false, g_small ? 2 : 20);
        double roof = ((double)d.wbytes + B * d.ctx * kvt) / bw;
        printf("decode 1B batch %3u: %.3f ms (roofline %.3f ms)\n", B, t * 1e3, roof * 1e3);
        snprintf(what, sizeof what, "decode 1B bf16 batch %u (ms vs roofline)", B);
        row(what, fmt(v, "%.3f", t * 1e3), fmt(c, "%.3f", roof * 1e3), 100 * roof / t);
    }
    uint32_t B = g_small ? 8 : 64;
    double ts = decode_step(&d, B, true, g_small ? 2 : 20);
    double roof = ((double)d.wbytes + B * d.ctx * kvt) / bw;
    row("  batch 64 sampled (T 0.8, top-k/p) (ms)", fmt(v, "%.3f", ts * 1e3),
        fmt(c, "%.3f", roof * 1e3), 100 * roof / ts);
    cuda_compute_set_graphs(d.m->cx, false);
    double eager1 = decode_step(&d, 1, false, g_small ? 2 : 30);
    cuda_compute_set_graphs(d.m->cx, true);
    double graph1 = decode_step(&d, 1, false, g_small ? 2 : 30);
    row("decode 1B batch 1: graph vs eager (ms)", fmt(v, "%.3f", graph1 * 1e3),
        fmt(c, "%.3f", eager1 * 1e3), 100 * graph1 / eager1);
    dec_close(&d, be);
}

/* ---- projections alone -------------------------------------------------------------- */

/* y = x W^T through the backend's matmul op, W [out][in] of each type, for
 * 1..32 tokens: weight bytes per second. Four copies of W are rotated so no
 * run finds W in the L2. */
static void gemv(struct backend *be, double bw)
{
    static const enum ctype types[] = {CT_BF16, CT_Q8_0, CT_Q4_0, CT_Q4_K, CT_Q5_K, CT_Q6_K};
    static const uint32_t toks[] = {1, 2, 3, 4, 8, 16, 32};
    const int nt = (int)(sizeof toks / sizeof toks[0]);
    const uint32_t in = g_small ? 512 : 4096, out = g_small ? 256 : 14336;
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
            const int iters = g_small ? 2 : 16;
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
            double gbs = w[0].nbytes / median(t, iters);
            printf(" %5.0f (%3.0f%%)", gbs / 1e9, 100 * gbs / bw);
            if (toks[k] == 1 || toks[k] == 8 || toks[k] == 32) {
                char what[72], v[24], c[24];
                snprintf(what, sizeof what, "projection %s, %u token%s (GB/s)",
                         ctype_name(types[ti]), toks[k], toks[k] > 1 ? "s" : "");
                row(what, fmt(v, "%.0f", gbs / 1e9), fmt(c, "%.0f", bw / 1e9), 100 * gbs / bw);
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
static void qgemm(struct backend *be)
{
    static const enum ctype types[] = {CT_BF16, CT_Q4_K, CT_Q6_K, CT_Q4_K, CT_Q6_K};
    static const uint32_t toks[] = {16, 64, 512};
    const uint32_t in = g_small ? 512 : 4096, out = g_small ? 256 : 14336;
    const double i8_peak = 1979e12, bf16_peak = 989e12; /* H100/H200 SXM datasheet, dense */
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    cudaStream_t st = cuda_backend_dev(be)->compute;
    const uint32_t nmax = g_small ? 64 : 512;
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
            const int iters = g_small ? 1 : 10;
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
            const double ops = 2.0 * in * out * n / median(t, iters);
            printf(" %6.1f (%3.0f%%)", ops / 1e12, 100 * ops / peak);
            char what[72], v[24], c[24];
            snprintf(what, sizeof what, "projection GEMM %s, %u tokens (TOPS)", name, n);
            row(what, fmt(v, "%.1f", ops / 1e12), fmt(c, "%.0f", peak / 1e12), 100 * ops / peak);
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
    const int iters = g_small || g_ncu ? 1 : 10, warm = g_ncu ? 0 : 2;
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
    return median(t, iters);
}

/* Paged decode attention: D 128, GQA 4 and 8, batch 1 and 16, context 4k
 * and 32k: KV bytes read per second against copy bandwidth. */
static void attn(struct backend *be, double bw)
{
    static const uint32_t gqa[] = {4, 8}, batch[] = {1, 16}, ctx[] = {4096, 32768};
    printf("\ndecode attention, D 128, 8 KV heads, bf16 KV:\n");
    for (int gi = 0; gi < 2; gi++)
        for (int bi = 0; bi < 2; bi++)
            for (int ci = 0; ci < 2; ci++) {
                uint32_t B = batch[bi], C = g_small ? ctx[ci] / 64 : ctx[ci], pos0[16], rows[16];
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
                row(what, fmt(v, "%.0f", gbs / 1e9), fmt(c, "%.0f", bw / 1e9), 100 * gbs / bw);
            }
}

/* Prefill attention: a 512-row chunk of one sequence at prefix 0 and
 * 31.5k (32 query heads, 8 KV heads, D 128), and a mixed step (that chunk at
 * prefix 4k with 15 decode rows at contexts 4k..32k): FLOP/s against the
 * bf16 dense tensor-core peak given (H200/H100 SXM datasheet: 989 TFLOP/s). */
static void prefill(struct backend *be, double tc_peak)
{
    const uint32_t R = g_small ? 32 : 512, P1 = g_small ? 200 : 32256, PM = g_small ? 64 : 4096;
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
        row(what, fmt(v, "%.1f", flops / t / 1e12), fmt(c, "%.0f", tc_peak / 1e12),
            100 * flops / t / tc_peak);
    }
    pos0[0] = PM;
    rows[0] = R;
    for (uint32_t s = 1; s < 16; s++) {
        pos0[s] = (g_small ? 64 : 4096) + (s - 1) * (g_small ? 8 : 2048);
        rows[s] = 1;
    }
    double kvb;
    double t = attn_time(be, 32, 16, pos0, rows, &kvb);
    printf("  mixed: %u rows at %u + 15 decode rows at %u..%u: %8.1f us (%.1f MB of KV)\n", R, PM,
           pos0[1], pos0[15], t * 1e6, kvb / 1e6);
    row("mixed step attention: chunk + 15 decode rows (us)", fmt(v, "%.1f", t * 1e6), "-", -1);
}

/* ---- one launch of each kernel of interest, for ncu ----------------------------------------- */

/* What device_check.sh profiles with ncu (--only ncu, not in the default
 * run): each projection type at 1 and 8 tokens (and 512, the prefill
 * chunk: the K-quants' int8 GEMM, bf16's cuBLAS), decode attention at GQA 8
 * batch 1 context 32k and GQA 4 batch 16 context 4k, one 512-row prefill
 * chunk at 31.5k: each op once, on the full shapes. */
static void ncu_set(struct backend *be)
{
    static const enum ctype types[] = {CT_BF16, CT_Q8_0, CT_Q4_0, CT_Q4_K, CT_Q5_K, CT_Q6_K};
    const uint32_t in = g_small ? 512 : 4096, out = g_small ? 256 : 14336;
    const struct compute_ops *o = be->compute;
    struct compute_ctx *cx;
    if (o->ctx_new(be, &(struct compute_conf){0}, &cx))
        exit(1);
    float *x, *y;
    const uint32_t chunk = g_small ? 64 : 512;
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
    pos0[0] = (g_small ? 512 : 32768) - 1;
    rows[0] = 1;
    attn_time(be, 64, 1, pos0, rows, &kvb);
    for (int s = 0; s < 16; s++) {
        pos0[s] = (g_small ? 128 : 4096) - 1;
        rows[s] = 1;
    }
    attn_time(be, 32, 16, pos0, rows, &kvb);
    pos0[0] = g_small ? 200 : 32256;
    rows[0] = g_small ? 32 : 512;
    attn_time(be, 32, 1, pos0, rows, &kvb);
}

/* ---- zero-fill and swaps ------------------------------------------------------------------ */

/* New KV blocks: the backend's zero op (a device memset on the copy
 * stream) over 512 blocks of 2 MiB (an 8B model's bf16 block of 16
 * tokens), bytes written per second. */
static void zero_fill(struct backend *be, double bw)
{
    const size_t blk = g_small ? 4096 : (size_t)2 << 20, n = g_small ? 16 : 512;
    void *d;
    if (be->ops->arena_alloc(be, KVD_TIER_DEVICE, blk * n, &d))
        exit(1);
    double t[5];
    for (int r = 0; r < 6; r++) {
        double t0 = now_s();
        for (size_t i = 0; i < n; i++)
            if (be->ops->zero(be, (char *)d + ((i * 7) % n) * blk, KVD_TIER_DEVICE, blk))
                exit(1);
        if (be->ops->copy_wait(be))
            exit(1);
        if (r)
            t[r - 1] = now_s() - t0;
    }
    double gbs = blk * n / median(t, 5);
    char v[24], c[24];
    printf("\nzero-fill of %zu blocks of %zu KiB: %.0f GB/s written\n", n, blk >> 10, gbs / 1e9);
    row("zero-fill of new KV blocks, 2 MiB each (GB/s)", fmt(v, "%.0f", gbs / 1e9),
        fmt(c, "%.0f", bw / 2e9), 200 * gbs / bw);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, blk * n);
}

static void swap_bw(struct backend *be)
{
    const size_t blk = 512u << 10, n = g_small ? 8 : 2048, bytes = blk * n;
    void *d, *h;
    if (be->ops->arena_alloc(be, KVD_TIER_DEVICE, bytes, &d) ||
        be->ops->arena_alloc(be, KVD_TIER_HOST, bytes, &h)) {
        fprintf(stderr, "bench_gpu: arenas for the swap benchmark\n");
        exit(1);
    }
    BKCK(kvd_k_fill_uniform(d, KVD_K_F32, bytes / 4, 5, -1, 1, NULL));
    BCK(cudaDeviceSynchronize());
    double to[5], ti[5], pd[5], ph[5];
    for (int r = 0; r < 6; r++) {
        double t0 = now_s();
        for (size_t i = 0; i < n; i++) /* out: scattered device blocks to the host */
            if (be->ops->copy_async(be, (char *)h + ((i * 977) % n) * blk, KVD_TIER_HOST,
                                    (char *)d + i * blk, KVD_TIER_DEVICE, blk))
                exit(1);
        if (be->ops->copy_wait(be))
            exit(1);
        double t1 = now_s();
        for (size_t i = 0; i < n; i++)
            if (be->ops->copy_async(be, (char *)d + i * blk, KVD_TIER_DEVICE,
                                    (char *)h + ((i * 977) % n) * blk, KVD_TIER_HOST, blk))
                exit(1);
        if (be->ops->copy_wait(be))
            exit(1);
        double t2 = now_s();
        BCK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
        double t3 = now_s();
        BCK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
        double t4 = now_s();
        if (r) {
            to[r - 1] = t1 - t0;
            ti[r - 1] = t2 - t1;
            pd[r - 1] = t3 - t2;
            ph[r - 1] = t4 - t3;
        }
    }
    double so = bytes / median(to, 5) / 1e9, si = bytes / median(ti, 5) / 1e9;
    double sd = bytes / median(pd, 5) / 1e9, sh = bytes / median(ph, 5) / 1e9;
    char v[24], c[24];
    row("swap out D2H, 512 KiB blocks (GB/s)", fmt(v, "%.1f", so), fmt(c, "%.1f", sd),
        100 * so / sd);
    row("swap in H2D, 512 KiB blocks (GB/s)", fmt(v, "%.1f", si), fmt(c, "%.1f", sh),
        100 * si / sh);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, bytes);
    be->ops->arena_free(be, KVD_TIER_HOST, h, bytes);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small"))
            g_small = true;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            g_only = argv[++i];
        else {
            fprintf(stderr, "usage: bench_gpu [--only SECTION,...] [--small]\n");
            return 2;
        }
    }
    struct backend *be = NULL;
    struct kvd_error err = {0};
    if (backend_cuda_new(0, &be, &err)) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    struct cuda_dev *dev = cuda_backend_dev(be);
    printf("device: %s, %d SMs%s\n", dev->name, dev->n_sms, g_small ? " (--small shapes)" : "");
    const double tc_peak = 989e12; /* bf16 dense, H100/H200 SXM datasheet */
    char v[24], c[24];

    if (g_only && want("ncu")) { /* the kernels device_check.sh profiles, nothing else */
        g_ncu = true;
        ncu_set(be);
        backend_free(be);
        return 0;
    }
    double bw = copy_bw();
    printf("copy bandwidth (D2D, read+write): %.0f GB/s\n", bw / 1e9);
    row("copy bandwidth D2D (read+write, GB/s)", fmt(v, "%.0f", bw / 1e9), "-", -1);
    if (want("launch")) {
        double le, lg;
        launch_cost(&le, &lg);
        printf("empty kernel: %.2f us per launch eager, %.2f us per kernel in a graph\n", le, lg);
        row("empty kernel in a graph chain (us per kernel)", fmt(v, "%.2f", lg), fmt(c, "%.2f", le),
            100 * lg / le);
    }
    if (want("decode8b")) {
        decode8b(be, bw, false);
        decode8b(be, bw, true);
    }
    if (want("decode1b"))
        decode1b(be, bw);
    if (want("gemv")) {
        gemv(be, bw);
        qgemm(be);
    }
    if (want("attn"))
        attn(be, bw);
    if (want("prefill"))
        prefill(be, tc_peak);
    if (want("zero"))
        zero_fill(be, bw);
    if (want("swap"))
        swap_bw(be);

    printf("\n== bench_gpu summary (%s) ==\n", dev->name);
    printf("%-52s %12s %12s %8s\n", "measure", "value", "ceiling", "%");
    for (int i = 0; i < g_nrows; i++)
        printf("%-52s %12s %12s %8s\n", g_rows[i].what, g_rows[i].value, g_rows[i].ceiling,
               g_rows[i].pct);
    backend_free(be);
    return 0;
}

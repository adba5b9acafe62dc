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
 * without a GPU. The single-kernel sections (gemv, attn, prefill, ncu) are in
 * bench_gpu_kernels.c. */
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

bool bench_small, bench_ncu;
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

double bench_median(double *v, int n)
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

void bench_row(const char *what, const char *value, const char *ceiling, double pct)
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

char *bench_fmt(char *buf, const char *f, double v)
{
    snprintf(buf, 24, f, v);
    return buf;
}

/* ---- copy bandwidth and launch cost ------------------------------------------ */

/* Device-to-device copy bandwidth, bytes read + written per second. */
static double copy_bw(void)
{
    size_t bytes = bench_small ? (size_t)8 << 20 : (size_t)2 << 30;
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
    return 2.0 * bytes / bench_median(t, 10);
}

/* Time per kernel of a chain of empty kernels: issued one by one (eager),
 * and replayed from one CUDA graph (what a captured decode step pays per
 * kernel beyond its own work). */
static void launch_cost(double *eager_us, double *graph_us)
{
    const int n = bench_small ? 20 : 1000;
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
    *eager_us = bench_median(te, 5);
    *graph_us = bench_median(tg, 5);
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
    return bench_median(t, n);
}

/* Median wall time of one mixed step: sequence 0 brings a prefill chunk
 * of `chunk` tokens ending at context d->ctx, sequences 1..n_dec decode
 * one token each at that context; greedy picks downloaded. The same step
 * each time (a chunk rewrites its own KV rows). */
static double mixed_step(struct dec_fx *d, uint32_t chunk, uint32_t n_dec, int iters)
{
    static uint32_t toks[DEC_MAXB], picks[DEC_MAXB];
    static struct sample_row rows[DEC_MAXB];
    uint32_t S = n_dec + 1, *tables = malloc((size_t)S * d->bps * 4);
    struct fwd_seq seqs[DEC_MAXB];
    double t[64];
    for (uint32_t i = 0; i < chunk + n_dec && i < DEC_MAXB; i++)
        toks[i] = (i * 7919u) % d->m->hp.n_vocab;
    for (uint32_t s = 0; s < S; s++) {
        for (uint32_t i = 0; i < d->bps; i++)
            tables[s * d->bps + i] = i * S + s;
        rows[s] = (struct sample_row){.top_p = 1.0f};
        seqs[s] = (struct fwd_seq){.tokens = s ? &toks[chunk + s - 1] : toks,
                                   .n_tokens = s ? 1 : chunk,
                                   .pos0 = s ? d->ctx - 1 : d->ctx - chunk,
                                   .slots = tables + s * d->bps,
                                   .n_slots = d->bps};
    }
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = S,
                          .kv_arena = d->arena,
                          .geom = &d->g,
                          .n_arena_slots = d->n_slots,
                          .sample = rows,
                          .tokens = picks};
    for (int i = 0; i < 3 + iters; i++) {
        double t0 = now_s();
        if (model_forward(d->m, d->fc, &b)) {
            fprintf(stderr, "bench_gpu: model_forward: %s\n", fwd_ctx_errmsg(d->fc));
            exit(1);
        }
        if (i >= 3)
            t[i - 3] = now_s() - t0;
    }
    free(tables);
    return bench_median(t, iters);
}

/* One batch-1 decode step of an 8B-shaped model: graph-replayed step time
 * against the roofline (weights + KV bytes / copy bandwidth), the kernels
 * per step and per layer, and each op's GPU time in an eager step. */
static void decode8b(struct backend *be, double bw, bool q4km)
{
    static const struct bench_shape s8b = {"Llama-3-8B shape", 32, 4096, 32, 8, 14336, 128256, 0};
    static const struct bench_shape s8b_small = {"8B-like small", 2, 512, 8, 2, 1024, 1024, 0};
    const struct bench_shape *sh = bench_small ? &s8b_small : &s8b;
    const char *mix = q4km ? "Q4_K_M" : "bf16";
    struct dec_fx d;
    dec_open(&d, be, sh, q4km, 1, bench_small ? 256 : 1024);
    double kv = (double)kv_token_bytes(&d.g) * d.ctx;
    double roof = ((double)d.wbytes + kv) / bw;
    cuda_compute_set_graphs(d.m->cx, true);
    double tg = decode_step(&d, 1, false, bench_small ? 3 : 30);
    uint32_t launches = model_step_launches(d.m);
    cuda_compute_set_graphs(d.m->cx, false);
    double te = decode_step(&d, 1, false, bench_small ? 2 : 10);
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
    BKCK(kvd_k_spin(bench_small ? 0 : 200000000, (kvd_stream)cuda_backend_dev(be)->compute));
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
    bench_row(what, bench_fmt(v, "%.3f", tg * 1e3), bench_fmt(c, "%.3f", roof * 1e3),
              100 * roof / tg);
    snprintf(what, sizeof what, "  kernels per step / per layer (%s)", mix);
    snprintf(v, sizeof v, "%u", launches);
    bench_row(what, v, bench_fmt(c, "%.1f", (double)launches / sh->layers), -1);
    snprintf(what, sizeof what, "  eager step %s (ms, vs graph)", mix);
    bench_row(what, bench_fmt(v, "%.3f", te * 1e3), bench_fmt(c, "%.3f", tg * 1e3), 100 * tg / te);
    for (int i = 0; i < np; i++) {
        if (!pr[i].bytes)
            continue;
        double gbs = pr[i].bytes / (pr[i].us * 1e-6);
        snprintf(what, sizeof what, "  %.6s %.38s (GB/s, eager)", mix, pr[i].name);
        bench_row(what, bench_fmt(v, "%.0f", gbs / 1e9), bench_fmt(c, "%.0f", bw / 1e9),
                  100 * gbs / bw);
    }
    dec_close(&d, be);
}

/* The Llama-3.2-1B-shaped bf16 model at batch 1, 8, 64, 256 (context 512),
 * a sampled batch of 64, batch 1 eager against graphs, and a mixed step
 * (a prefill chunk with decode rows) eager against graphs. */
static void decode1b(struct backend *be, double bw)
{
    static const struct bench_shape s1b = {"Llama-3.2-1B shape", 16, 2048, 32, 8, 8192, 128256, 1};
    static const struct bench_shape s1b_small = {"1B-like small", 2, 256, 4, 2, 512, 512, 1};
    static const uint32_t batches[] = {1, 8, 64, 256};
    struct dec_fx d;
    dec_open(&d, be, bench_small ? &s1b_small : &s1b, false, bench_small ? 8 : DEC_MAXB,
             bench_small ? 64 : 512);
    double kvt = (double)kv_token_bytes(&d.g);
    char what[72], v[24], c[24];
    cuda_compute_set_graphs(d.m->cx, true);
    for (int i = 0; i < 4; i++) {
        uint32_t B = bench_small ? (batches[i] > 8 ? 8 : batches[i]) : batches[i];
        double t = decode_step(&d, B, false, bench_small ? 2 : 20);
        double roof = ((double)d.wbytes + B * d.ctx * kvt) / bw;
        printf("decode 1B batch %3u: %.3f ms (roofline %.3f ms)\n", B, t * 1e3, roof * 1e3);
        snprintf(what, sizeof what, "decode 1B bf16 batch %u (ms vs roofline)", B);
        bench_row(what, bench_fmt(v, "%.3f", t * 1e3), bench_fmt(c, "%.3f", roof * 1e3),
                  100 * roof / t);
    }
    uint32_t B = bench_small ? 8 : 64;
    double ts = decode_step(&d, B, true, bench_small ? 2 : 20);
    double roof = ((double)d.wbytes + B * d.ctx * kvt) / bw;
    bench_row("  batch 64 sampled (T 0.8, top-k/p) (ms)", bench_fmt(v, "%.3f", ts * 1e3),
              bench_fmt(c, "%.3f", roof * 1e3), 100 * roof / ts);
    cuda_compute_set_graphs(d.m->cx, false);
    double eager1 = decode_step(&d, 1, false, bench_small ? 2 : 30);
    cuda_compute_set_graphs(d.m->cx, true);
    double graph1 = decode_step(&d, 1, false, bench_small ? 2 : 30);
    bench_row("decode 1B batch 1: graph vs eager (ms)", bench_fmt(v, "%.3f", graph1 * 1e3),
              bench_fmt(c, "%.3f", eager1 * 1e3), 100 * graph1 / eager1);
    /* a mixed step (a prefill chunk of 61 tokens and 7 decode rows: 68
     * rows, padded to the row bucket of 80; --small: 5 and 2) from its
     * graph against eager */
    uint32_t chunk = bench_small ? 5 : 61, ndec = bench_small ? 2 : 7;
    cuda_compute_set_graphs(d.m->cx, false);
    double mixed_e = mixed_step(&d, chunk, ndec, bench_small ? 2 : 20);
    cuda_compute_set_graphs(d.m->cx, true);
    double mixed_g = mixed_step(&d, chunk, ndec, bench_small ? 2 : 20);
    printf("mixed step 1B (%u-token chunk + %u decodes): graph %.3f ms, eager %.3f ms\n", chunk,
           ndec, mixed_g * 1e3, mixed_e * 1e3);
    snprintf(what, sizeof what, "mixed 1B %u+%u rows: graph vs eager (ms)", chunk, ndec);
    bench_row(what, bench_fmt(v, "%.3f", mixed_g * 1e3), bench_fmt(c, "%.3f", mixed_e * 1e3),
              100 * mixed_g / mixed_e);
    dec_close(&d, be);
}

/* ---- zero-fill and swaps ------------------------------------------------------------------ */

/* New KV blocks: the backend's zero op (a device memset on the copy
 * stream) over 512 blocks of 2 MiB (an 8B model's bf16 block of 16
 * tokens), bytes written per second. */
static void zero_fill(struct backend *be, double bw)
{
    const size_t blk = bench_small ? 4096 : (size_t)2 << 20, n = bench_small ? 16 : 512;
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
    double gbs = blk * n / bench_median(t, 5);
    char v[24], c[24];
    printf("\nzero-fill of %zu blocks of %zu KiB: %.0f GB/s written\n", n, blk >> 10, gbs / 1e9);
    bench_row("zero-fill of new KV blocks, 2 MiB each (GB/s)", bench_fmt(v, "%.0f", gbs / 1e9),
              bench_fmt(c, "%.0f", bw / 2e9), 200 * gbs / bw);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, blk * n);
}

static void swap_bw(struct backend *be)
{
    const size_t blk = 512u << 10, n = bench_small ? 8 : 2048, bytes = blk * n;
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
    double so = bytes / bench_median(to, 5) / 1e9, si = bytes / bench_median(ti, 5) / 1e9;
    double sd = bytes / bench_median(pd, 5) / 1e9, sh = bytes / bench_median(ph, 5) / 1e9;
    char v[24], c[24];
    bench_row("swap out D2H, 512 KiB blocks (GB/s)", bench_fmt(v, "%.1f", so),
              bench_fmt(c, "%.1f", sd), 100 * so / sd);
    bench_row("swap in H2D, 512 KiB blocks (GB/s)", bench_fmt(v, "%.1f", si),
              bench_fmt(c, "%.1f", sh), 100 * si / sh);
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, bytes);
    be->ops->arena_free(be, KVD_TIER_HOST, h, bytes);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small"))
            bench_small = true;
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
    printf("device: %s, %d SMs%s\n", dev->name, dev->n_sms, bench_small ? " (--small shapes)" : "");
    const double tc_peak = 989e12; /* bf16 dense, H100/H200 SXM datasheet */
    char v[24], c[24];

    if (g_only && want("ncu")) { /* the kernels device_check.sh profiles, nothing else */
        bench_ncu = true;
        bench_ncu_set(be);
        backend_free(be);
        return 0;
    }
    double bw = copy_bw();
    printf("copy bandwidth (D2D, read+write): %.0f GB/s\n", bw / 1e9);
    bench_row("copy bandwidth D2D (read+write, GB/s)", bench_fmt(v, "%.0f", bw / 1e9), "-", -1);
    if (want("launch")) {
        double le, lg;
        launch_cost(&le, &lg);
        printf("empty kernel: %.2f us per launch eager, %.2f us per kernel in a graph\n", le, lg);
        bench_row("empty kernel in a graph chain (us per kernel)", bench_fmt(v, "%.2f", lg),
                  bench_fmt(c, "%.2f", le), 100 * lg / le);
    }
    if (want("decode8b")) {
        decode8b(be, bw, false);
        decode8b(be, bw, true);
    }
    if (want("decode1b"))
        decode1b(be, bw);
    if (want("gemv")) {
        bench_gemv(be, bw);
        bench_qgemm(be);
    }
    if (want("attn"))
        bench_attn(be, bw);
    if (want("prefill"))
        bench_prefill(be, tc_peak);
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

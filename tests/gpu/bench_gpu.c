/* bench_gpu: the cuda backend's numbers on the device it finds, each against
 * a ceiling measured in the same run: decode steps of a Llama-3.2-1B-shaped
 * bf16 model (random weights made on the device) vs the HBM roofline, paged
 * decode attention vs copy bandwidth, swaps vs plain pinned cudaMemcpy, and
 * eager vs CUDA-graph decode. Prints a table last. Exits 77 without a GPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_cuda.h"
#include "compute_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "model.h"
#include "model_impl.h"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_gpu: %s: %s (line %d)\n", #x, cudaGetErrorString(e_),           \
                    __LINE__);                                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define KCK(x)                                                                                     \
    do {                                                                                           \
        int r_ = (x);                                                                              \
        if (r_) {                                                                                  \
            fprintf(stderr, "bench_gpu: %s: %s (line %d)\n", #x,                                   \
                    cudaGetErrorString((cudaError_t)r_), __LINE__);                                \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

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

/* Device-to-device copy bandwidth, bytes read + written per second. */
static double copy_bw(void)
{
    size_t bytes = (size_t)2 << 30;
    void *a, *b;
    cudaEvent_t e0, e1;
    double t[10];
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    KCK(kvd_k_fill_uniform(a, KVD_K_F32, bytes / 4, 1, -1, 1, NULL));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 13; i++) {
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3)
            t[i - 3] = ms * 1e-3;
    }
    CK(cudaFree(a));
    CK(cudaFree(b));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 2.0 * bytes / median(t, 10);
}

/* ---- a Llama-3.2-1B-shaped model with random bf16 weights --------------- */

#define L_EMBD 2048u
#define L_LAYERS 16u
#define L_HEADS 32u
#define L_KV 8u
#define L_FF 8192u
#define L_VOCAB 128256u
#define L_HD (L_EMBD / L_HEADS)

/* The next 256-byte aligned piece of the weight buffer. */
static void *carve(char **p, size_t bytes)
{
    char *r = *p;
    *p += (bytes + 255) & ~(size_t)255;
    return r;
}

static void tensor(struct ctensor *t, char **cur, enum ctype type, uint32_t ne0, uint32_t ne1,
                   uint64_t seed, float lo, float hi)
{
    t->type = type;
    t->ne0 = ne0;
    t->ne1 = ne1;
    t->nbytes = ctype_row_bytes(type, ne0) * ne1;
    t->data = carve(cur, t->nbytes);
    KCK(kvd_k_fill_uniform(t->data, type == CT_F32 ? KVD_K_F32 : KVD_K_BF16, (size_t)ne0 * ne1,
                           seed, lo, hi, NULL));
}

static struct model *make_llama_1b(struct backend *be, uint64_t *matmul_bytes)
{
    struct model *m = calloc(1, sizeof *m);
    struct model_hparams *hp = &m->hp;
    struct compute_conf conf = {0};
    if (!m)
        exit(1);
    snprintf(hp->arch, sizeof hp->arch, "llama");
    snprintf(hp->name, sizeof hp->name, "random Llama-3.2-1B shape");
    hp->n_vocab = L_VOCAB;
    hp->n_ctx = 131072;
    hp->n_embd = L_EMBD;
    hp->n_layer = L_LAYERS;
    hp->n_head = L_HEADS;
    hp->n_head_kv = L_KV;
    hp->head_dim = L_HD;
    hp->n_ff = L_FF;
    hp->n_rot = L_HD;
    hp->rms_eps = 1e-5f;
    hp->rope_base = 500000.0f;
    hp->rope_mode = ROPE_NORM;
    hp->tied_output = 1;
    hp->wtype = CT_BF16;
    m->be = be;
    m->ops = be->compute;
    if (m->ops->ctx_new(be, &conf, &m->cx))
        exit(1);
    m->layers = calloc(L_LAYERS, sizeof *m->layers);
    size_t per_layer =
        (size_t)2 * (2 * L_EMBD * L_EMBD + 2 * L_EMBD * L_KV * L_HD + 3 * L_EMBD * L_FF) +
        2 * 4 * L_EMBD + 16 * 256; /* + carve's alignment of 9 tensors */
    size_t total = per_layer * L_LAYERS + (size_t)2 * L_EMBD * L_VOCAB + 4 * L_EMBD + 8192;
    if (m->ops->buf_alloc(m->cx, total, &m->weights)) {
        fprintf(stderr, "bench_gpu: no memory for %zu bytes of weights\n", total);
        exit(1);
    }
    char *cur = m->weights;
    uint64_t seed = 1;
    float a_e = sqrtf(3.0f / L_EMBD), a_f = sqrtf(3.0f / L_FF); /* variance 1/fan_in */
    tensor(&m->tok_embd, &cur, CT_BF16, L_EMBD, L_VOCAB, seed++, -1, 1);
    tensor(&m->output_norm, &cur, CT_F32, L_EMBD, 1, seed++, 0.9f, 1.1f);
    m->output = m->tok_embd;
    for (uint32_t l = 0; l < L_LAYERS; l++) {
        struct model_layer *L = &m->layers[l];
        tensor(&L->attn_norm, &cur, CT_F32, L_EMBD, 1, seed++, 0.9f, 1.1f);
        tensor(&L->wq, &cur, CT_BF16, L_EMBD, L_EMBD, seed++, -a_e, a_e);
        tensor(&L->wk, &cur, CT_BF16, L_EMBD, L_KV * L_HD, seed++, -a_e, a_e);
        tensor(&L->wv, &cur, CT_BF16, L_EMBD, L_KV * L_HD, seed++, -a_e, a_e);
        tensor(&L->wo, &cur, CT_BF16, L_EMBD, L_EMBD, seed++, -a_e, a_e);
        tensor(&L->ffn_norm, &cur, CT_F32, L_EMBD, 1, seed++, 0.9f, 1.1f);
        tensor(&L->gate, &cur, CT_BF16, L_EMBD, L_FF, seed++, -a_e, a_e);
        tensor(&L->up, &cur, CT_BF16, L_EMBD, L_FF, seed++, -a_e, a_e);
        tensor(&L->down, &cur, CT_BF16, L_FF, L_EMBD, seed++, -a_f, a_f);
    }
    if ((size_t)(cur - (char *)m->weights) > total) {
        fprintf(stderr, "bench_gpu: weight layout overflow\n");
        exit(1);
    }
    CK(cudaDeviceSynchronize());
    /* bytes the projections read per step: every matrix once (the tied
     * output head included), not the embedding table (one row per token) */
    *matmul_bytes =
        (uint64_t)L_LAYERS * 2 *
            (2ull * L_EMBD * L_EMBD + 2ull * L_EMBD * L_KV * L_HD + 3ull * L_EMBD * L_FF) +
        2ull * L_EMBD * L_VOCAB;
    hp->weight_bytes = total;
    return m;
}

struct decode_result {
    uint32_t batch;
    double step_s, roof_s;
};

#define DEC_CTX 512u /* context of every sequence in the decode benchmark */
#define DEC_MAXB 256u

/* Median time of one decode step of `batch` sequences at context DEC_CTX,
 * as the executor runs it: tokens sampled on the device (greedy, or
 * temperature 0.8 / top-k 50 / top-p 0.95 when sampled), ids downloaded. */
static double decode_step(struct model *m, struct fwd_ctx *fc, void *arena, const struct kv_geom *g,
                          uint32_t n_slots, uint32_t batch, bool sampled, int iters)
{
    static uint32_t tables[DEC_MAXB][DEC_CTX / 16], toks[DEC_MAXB], picks[DEC_MAXB];
    static struct sample_row rows[DEC_MAXB];
    struct fwd_seq seqs[DEC_MAXB];
    double t[64];
    for (uint32_t s = 0; s < batch; s++) {
        for (uint32_t i = 0; i < DEC_CTX / 16; i++) /* interleaved: blocks of a sequence apart */
            tables[s][i] = i * DEC_MAXB + s;
        toks[s] = (s * 7919u) % L_VOCAB;
        rows[s] = sampled ? (struct sample_row){.temperature = 0.8f,
                                                .top_k = 50,
                                                .top_p = 0.95f,
                                                .u = (double)s / DEC_MAXB}
                          : (struct sample_row){.top_p = 1.0f};
        seqs[s] = (struct fwd_seq){.tokens = &toks[s],
                                   .n_tokens = 1,
                                   .pos0 = DEC_CTX - 1,
                                   .slots = tables[s],
                                   .n_slots = DEC_CTX / 16};
    }
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = batch,
                          .kv_arena = arena,
                          .geom = g,
                          .n_arena_slots = n_slots,
                          .sample = rows,
                          .tokens = picks};
    for (int i = 0; i < 3 + iters; i++) {
        double t0 = now_s();
        if (model_forward(m, fc, &b)) {
            fprintf(stderr, "bench_gpu: model_forward: %s\n", fwd_ctx_errmsg(fc));
            exit(1);
        }
        if (i >= 3)
            t[i - 3] = now_s() - t0;
    }
    return median(t, iters);
}

/* ---- paged decode attention --------------------------------------------- */

static double attn_bw(int ctx, int batch, int n_sms, double *splits_out)
{
    struct kvd_k_kv kv = {
        .layers = 1, .kv_heads = 8, .head_dim = 64, .block_tokens = 16, .dtype = KVD_K_BF16};
    const int n_heads = 32, bpseq = ctx / 16, nblk = batch * bpseq;
    kv.row_bytes = (size_t)kv.head_dim * 2;
    kv.block_bytes = (size_t)kv.layers * 2 * kv.kv_heads * kv.block_tokens * kv.row_bytes;
    uint32_t *h_slots = malloc((size_t)nblk * 4), h_q[64], h_pos0[64], h_slot0[65];
    for (int s = 0; s < batch; s++) {
        h_q[s] = (uint32_t)s;
        h_pos0[s] = (uint32_t)ctx - 1;
        h_slot0[s] = (uint32_t)(s * bpseq);
        for (int i = 0; i < bpseq; i++) /* scattered over the arena */
            h_slots[s * bpseq + i] = (uint32_t)(i * batch + s);
    }
    h_q[batch] = (uint32_t)batch;
    h_slot0[batch] = (uint32_t)nblk;
    void *arena;
    float *q, *out, *part;
    uint32_t *slots, *qs, *p0, *s0;
    int splits = kvd_k_attn_decode_splits(batch, n_heads, &kv, ctx, n_sms);
    size_t pf = kvd_k_attn_decode_partial_floats(batch, n_heads, kv.head_dim, splits);
    CK(cudaMalloc(&arena, kv.block_bytes * nblk));
    CK(cudaMalloc((void **)&q, (size_t)batch * n_heads * 64 * 4));
    CK(cudaMalloc((void **)&out, (size_t)batch * n_heads * 64 * 4));
    CK(cudaMalloc((void **)&part, (pf ? pf : 1) * 4));
    CK(cudaMalloc((void **)&slots, (size_t)nblk * 4));
    CK(cudaMalloc((void **)&qs, 65 * 4));
    CK(cudaMalloc((void **)&p0, 64 * 4));
    CK(cudaMalloc((void **)&s0, 65 * 4));
    CK(cudaMemcpy(slots, h_slots, (size_t)nblk * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(qs, h_q, (batch + 1) * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p0, h_pos0, batch * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s0, h_slot0, (batch + 1) * 4, cudaMemcpyHostToDevice));
    kv.arena = arena;
    KCK(kvd_k_fill_uniform(arena, KVD_K_BF16, kv.block_bytes * nblk / 2, 3, -2, 2, NULL));
    KCK(kvd_k_fill_uniform(q, KVD_K_F32, (size_t)batch * n_heads * 64, 4, -1, 1, NULL));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double t[20];
    for (int i = 0; i < 23; i++) {
        CK(cudaEventRecord(e0, 0));
        KCK(kvd_k_attn_decode(out, q, &kv, 0, slots, s0, p0, qs, batch, n_heads, 0.125f, splits,
                              part, NULL));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3)
            t[i - 3] = ms * 1e-3;
    }
    double bytes = (double)batch * ctx * kv.kv_heads * kv.head_dim * 2 * 2;
    cudaFree(arena);
    cudaFree(q);
    cudaFree(out);
    cudaFree(part);
    cudaFree(slots);
    cudaFree(qs);
    cudaFree(p0);
    cudaFree(s0);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    free(h_slots);
    *splits_out = splits;
    return bytes / median(t, 20);
}

/* ---- swaps ---------------------------------------------------------------- */

static void swap_bw(struct backend *be, double *out_gbs, double *in_gbs, double *pin_d2h,
                    double *pin_h2d)
{
    const size_t blk = 512u << 10, n = 2048, bytes = blk * n; /* 1 GiB in 512 KiB blocks */
    void *d, *h;
    if (be->ops->arena_alloc(be, KVD_TIER_DEVICE, bytes, &d) ||
        be->ops->arena_alloc(be, KVD_TIER_HOST, bytes, &h)) {
        fprintf(stderr, "bench_gpu: arenas for the swap benchmark\n");
        exit(1);
    }
    KCK(kvd_k_fill_uniform(d, KVD_K_F32, bytes / 4, 5, -1, 1, NULL));
    CK(cudaDeviceSynchronize());
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
        CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
        double t3 = now_s();
        CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
        double t4 = now_s();
        if (r) {
            to[r - 1] = t1 - t0;
            ti[r - 1] = t2 - t1;
            pd[r - 1] = t3 - t2;
            ph[r - 1] = t4 - t3;
        }
    }
    *out_gbs = bytes / median(to, 5) / 1e9;
    *in_gbs = bytes / median(ti, 5) / 1e9;
    *pin_d2h = bytes / median(pd, 5) / 1e9;
    *pin_h2d = bytes / median(ph, 5) / 1e9;
    be->ops->arena_free(be, KVD_TIER_DEVICE, d, bytes);
    be->ops->arena_free(be, KVD_TIER_HOST, h, bytes);
}

int main(void)
{
    struct backend *be = NULL;
    struct kvd_error err = {0};
    if (backend_cuda_new(0, &be, &err)) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    struct cuda_dev *dev = cuda_backend_dev(be);
    printf("device: %s, %d SMs\n", dev->name, dev->n_sms);

    double bw = copy_bw();
    printf("copy bandwidth (D2D, read+write): %.0f GB/s\n", bw / 1e9);

    /* decode */
    uint64_t wbytes;
    struct model *m = make_llama_1b(be, &wbytes);
    struct kv_geom g;
    model_kv_geom(m, 16, KV_BF16, &g);
    uint32_t n_slots = DEC_MAXB * (DEC_CTX / 16);
    size_t arena_bytes = kv_block_bytes(&g) * n_slots;
    void *arena;
    if (be->ops->arena_alloc(be, KVD_TIER_DEVICE, arena_bytes, &arena))
        return 1;
    KCK(kvd_k_fill_uniform(arena, KVD_K_BF16, arena_bytes / 2, 9, -1, 1, NULL));
    CK(cudaDeviceSynchronize()); /* filled on the legacy stream; compute uses its own */
    struct fwd_ctx *fc;
    if (fwd_ctx_new(m, DEC_MAXB, DEC_MAXB, &fc))
        return 1;
    static const uint32_t batches[] = {1, 8, 64, 256};
    struct decode_result dr[4];
    double kv_token = (double)kv_token_bytes(&g);
    for (int i = 0; i < 4; i++) {
        uint32_t B = batches[i];
        dr[i].batch = B;
        dr[i].step_s = decode_step(m, fc, arena, &g, n_slots, B, false, 20);
        dr[i].roof_s = ((double)wbytes + (double)B * DEC_CTX * kv_token) / bw;
        printf("decode batch %3u: %.3f ms (roofline %.3f ms)\n", B, dr[i].step_s * 1e3,
               dr[i].roof_s * 1e3);
    }
    /* the same step with temperature / top-k / top-p sampling */
    double sampled64 = decode_step(m, fc, arena, &g, n_slots, 64, true, 20);
    printf("decode batch  64, sampled: %.3f ms\n", sampled64 * 1e3);
    /* eager vs graph at batch 1 */
    cuda_compute_set_graphs(m->cx, false);
    double eager1 = decode_step(m, fc, arena, &g, n_slots, 1, false, 30);
    cuda_compute_set_graphs(m->cx, true);
    double graph1 = decode_step(m, fc, arena, &g, n_slots, 1, false, 30);
    struct cuda_compute_stats st;
    cuda_compute_stats(m->cx, &st);
    printf("graphs: %llu captures, %llu replays, %llu eager steps\n",
           (unsigned long long)st.captures, (unsigned long long)st.replays,
           (unsigned long long)st.eager);
    fwd_ctx_free(fc);
    be->ops->arena_free(be, KVD_TIER_DEVICE, arena, arena_bytes);
    model_free(m);

    /* attention */
    static const int ctxs[] = {1024, 4096, 16384};
    double abw[3], asplit[3];
    for (int i = 0; i < 3; i++) {
        abw[i] = attn_bw(ctxs[i], 32, dev->n_sms, &asplit[i]);
        printf("attention ctx %5d batch 32: %.0f GB/s (%g splits)\n", ctxs[i], abw[i] / 1e9,
               asplit[i]);
    }

    /* swaps */
    double so, si, pd, ph;
    swap_bw(be, &so, &si, &pd, &ph);

    printf("\n== bench_gpu summary (%s) ==\n", dev->name);
    printf("%-44s %12s %12s %8s\n", "measure", "value", "ceiling", "%");
    printf("%-44s %9.0f GB/s %12s %8s\n", "copy bandwidth D2D (read+write)", bw / 1e9, "-", "-");
    for (int i = 0; i < 4; i++) {
        char name[64];
        snprintf(name, sizeof name, "decode step batch %u (ms vs roofline)", dr[i].batch);
        printf("%-44s %12.3f %12.3f %7.1f%%\n", name, dr[i].step_s * 1e3, dr[i].roof_s * 1e3,
               100.0 * dr[i].roof_s / dr[i].step_s);
    }
    printf("%-44s %12.3f %12.3f %7.1f%%\n", "  batch 64 sampled (T 0.8, top-k/p) (ms)",
           sampled64 * 1e3, dr[2].roof_s * 1e3, 100.0 * dr[2].roof_s / sampled64);
    for (int i = 0; i < 3; i++) {
        char name[64];
        snprintf(name, sizeof name, "paged attention ctx %d batch 32 (GB/s)", ctxs[i]);
        printf("%-44s %12.0f %12.0f %7.1f%%\n", name, abw[i] / 1e9, bw / 1e9, 100.0 * abw[i] / bw);
    }
    printf("%-44s %12.1f %12.1f %7.1f%%\n", "swap out D2H, 512 KiB blocks (GB/s)", so, pd,
           100.0 * so / pd);
    printf("%-44s %12.1f %12.1f %7.1f%%\n", "swap in H2D, 512 KiB blocks (GB/s)", si, ph,
           100.0 * si / ph);
    printf("%-44s %12.3f %12.3f %7.1f%%\n", "decode batch 1: graph vs eager (ms)", graph1 * 1e3,
           eager1 * 1e3, 100.0 * graph1 / eager1);
    backend_free(be);
    return 0;
}

/* The whole model on the cuda backend against the cpu backend on random
 * GGUF models (kvd-gguf-gen): greedy tokens must be equal, one sequence
 * alone and several batched (prefill together, then batched decode), and a
 * decode replayed from CUDA graphs must give the tokens of eager execution.
 * Steps stay at <= 8 rows for non-f32 weights so both backends do the same
 * arithmetic (the GEMV path: f32, or for Q4_0 .. Q6_K llama.cpp's int8
 * activations on both); f32 models also take the cuBLAS path (SGEMM) in
 * batched prefill. Skips (77) without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compute_cuda.h"
#include "kernels.h"
#include "gpu/gpu_fixture.h"
#include "kvd/status.h"
#include "kvmm.h"
#include "model.h"
#include "model/model_ref.h"
#include "model_impl.h"

#define BT 16
#define BPS 8 /* blocks per sequence: 128 positions */
#define MAXS 4
#define NGEN 20

static struct backend *cuda_be, *cpu_be;

struct runner {
    struct backend *be;
    struct model *m;
    struct fwd_ctx *fc;
    struct kv_geom g;
    void *arena;
    size_t arena_bytes;
    uint32_t V;
};

static void runner_open(struct runner *r, struct backend *be, const char *path, enum kv_dtype kvt)
{
    struct kvd_error err = {0};
    memset(r, 0, sizeof *r);
    r->be = be;
    if (model_load(path, be, &r->m, &err))
        fail_msg("model_load on %s: %s", be->ops->name, err.message);
    r->V = model_hparams(r->m)->n_vocab;
    model_kv_geom(r->m, BT, kvt, &r->g);
    r->arena_bytes = kv_block_bytes(&r->g) * MAXS * BPS;
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, r->arena_bytes, &r->arena), 0);
    assert_int_equal(fwd_ctx_new(r->m, 64, MAXS, &r->fc), 0);
}

static void runner_close(struct runner *r)
{
    /* The forward context's device bytes as the backend allocated them
     * (what the page budget charges a model's scratch): at least the
     * estimate made before it existed, and exactly what freeing it gives
     * back (on either backend). */
    size_t held = fwd_ctx_dev_bytes(r->fc), with = model_dev_bytes(r->m);
    assert_true(held >= fwd_ctx_bytes(model_hparams(r->m), 64, MAXS, MAXS));
    assert_true(with >= held);
    fwd_ctx_free(r->fc);
    assert_int_equal(with - model_dev_bytes(r->m), held);
    r->be->ops->arena_free(r->be, KVD_TIER_DEVICE, r->arena, r->arena_bytes);
    model_free(r->m);
}

static uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Greedy generation of NGEN tokens for S sequences. batched: one step per
 * position for all sequences together; else each sequence on its own. Each
 * step also runs the backend's sample op (sequence 0 greedy, the others
 * temperature with top-k, top-p or neither), whose picks must equal
 * sampler_pick's on the logits the same step returns. out gets each step's
 * argmax; force (or NULL): the tokens fed back instead of the argmaxes
 * (another backend's, so both see the same inputs); keep (or NULL): every
 * step's logits, [NGEN][MAXS][V]. */
static void greedy_ex(struct runner *r, uint32_t S, const uint32_t (*prompt)[8],
                      const uint32_t *plen, int batched, uint32_t (*out)[NGEN],
                      uint32_t (*force)[NGEN], float *keep)
{
    uint32_t slots[MAXS][BPS], pos[MAXS], last[MAXS], picks[MAXS];
    struct sample_row rows[MAXS] = {
        {.top_p = 1.0f},
        {.temperature = 0.9f, .top_k = 40, .top_p = 1.0f},
        {.temperature = 1.1f, .top_p = 0.9f},
        {.temperature = 0.7f, .top_p = 1.0f},
    };
    struct sampler_scratch sc = {0};
    float *logits = malloc((size_t)MAXS * r->V * sizeof(float));
    assert_non_null(logits);
    for (uint32_t s = 0; s < S; s++) /* scattered, reversed block tables */
        for (uint32_t i = 0; i < BPS; i++)
            slots[s][i] = (uint32_t)(MAXS * BPS - 1 - (i * MAXS + s));
    for (uint32_t step = 0; step < NGEN; step++) {
        struct fwd_seq seqs[MAXS];
        for (uint32_t s = 0; s < S; s++) {
            seqs[s] = (struct fwd_seq){.tokens = step ? &last[s] : prompt[s],
                                       .n_tokens = step ? 1 : plen[s],
                                       .pos0 = step ? pos[s] : 0,
                                       .slots = slots[s],
                                       .n_slots = BPS};
        }
        for (uint32_t s = 0; s < MAXS; s++)
            rows[s].u = (double)((step * 5 + s * 3) % 11) / 11.0;
        for (uint32_t s0 = 0; s0 < S; s0 += batched ? S : 1) {
            uint32_t n = batched ? S : 1;
            struct fwd_batch b = {.seqs = seqs + s0,
                                  .n_seqs = n,
                                  .kv_arena = r->arena,
                                  .geom = &r->g,
                                  .n_arena_slots = MAXS * BPS,
                                  .logits = logits,
                                  .sample = rows + s0,
                                  .tokens = picks};
            int rc = model_forward(r->m, r->fc, &b);
            if (rc)
                fail_msg("model_forward on %s: %s", r->be->ops->name, fwd_ctx_errmsg(r->fc));
            for (uint32_t i = 0; i < n; i++) {
                uint32_t s = s0 + i;
                pos[s] = step ? pos[s] + 1 : plen[s];
                last[s] = argmax(logits + (size_t)i * r->V, r->V);
                uint32_t want = 0;
                assert_int_equal(
                    sampler_pick(&rows[s], &sc, logits + (size_t)i * r->V, r->V, &want), 0);
                if (picks[i] != want)
                    fail_msg("%s, sequence %u (T %g): the sample op picked %u, sampler_pick on "
                             "the step's logits %u",
                             r->be->ops->name, s, (double)rows[s].temperature, picks[i], want);
                out[s][step] = last[s];
                if (force)
                    last[s] = force[s][step];
                if (keep)
                    memcpy(keep + ((size_t)step * MAXS + s) * r->V, logits + (size_t)i * r->V,
                           r->V * sizeof(float));
            }
        }
    }
    free(logits);
    sampler_scratch_free(&sc);
}

static void greedy(struct runner *r, uint32_t S, const uint32_t (*prompt)[8], const uint32_t *plen,
                   int batched, uint32_t (*out)[NGEN])
{
    greedy_ex(r, S, prompt, plen, batched, out, NULL, NULL);
}

struct mcase {
    const char *args;
    enum kv_dtype kvt;
};

static const struct mcase cases[] = {
    {"--arch llama --layers 2 --embd 256 --heads 8 --kv-heads 2 --ff 512 --vocab 1000 "
     "--type f32 --seed 11",
     KV_F32},
    {"--arch llama --layers 3 --embd 256 --heads 4 --kv-heads 4 --ff 384 --vocab 777 "
     "--type f16 --rope-freqs --seed 12",
     KV_F16},
    {"--arch llama --layers 2 --embd 512 --heads 8 --kv-heads 1 --ff 1024 --vocab 1500 "
     "--type bf16 --tied --seed 13",
     KV_BF16},
    {"--arch qwen2 --layers 2 --embd 256 --heads 4 --kv-heads 2 --ff 512 --vocab 900 "
     "--type q8_0 --seed 14",
     KV_F32},
    {"--arch qwen2 --layers 2 --embd 512 --heads 8 --kv-heads 2 --ff 768 --vocab 1200 "
     "--type f32 --seed 15",
     KV_BF16},
    /* the quantized types: the GEMV does the cpu's int8-activation arithmetic */
    {"--arch llama --layers 2 --embd 256 --heads 4 --kv-heads 2 --ff 512 --vocab 700 "
     "--type q4_0 --seed 16",
     KV_F16},
    {"--arch qwen2 --layers 2 --embd 256 --heads 4 --kv-heads 2 --ff 512 --vocab 800 "
     "--type q4_k_m --seed 17",
     KV_BF16},
    {"--arch llama --layers 2 --embd 256 --heads 8 --kv-heads 2 --ff 768 --vocab 600 "
     "--type q5_k_m --tied --seed 18",
     KV_F32},
    {"--arch llama --layers 2 --embd 512 --heads 8 --kv-heads 4 --ff 512 --vocab 500 "
     "--type q6_k --seed 19",
     KV_F16},
};

static void compare(const char *what, const char *args, uint32_t S, uint32_t (*a)[NGEN],
                    uint32_t (*b)[NGEN])
{
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t t = 0; t < NGEN; t++)
            if (a[s][t] != b[s][t])
                fail_msg("%s (%s): sequence %u token %u: cuda %u, cpu %u", what, args, s, t,
                         a[s][t], b[s][t]);
}

/* The quantized weights (Q4_0 .. Q6_K): both backends quantize each
 * projection's activations to int8 and take exact integer dots (test_gpu_ops
 * checks the two GEMVs agree to 2e-6), so their logits agree to f32
 * rounding, except that an activation which the other backend's f32 order
 * (attention, norms) moves by ~1e-7 across a rounding boundary of its int8
 * quantization (about one value in 10^4..10^5) shifts what it feeds by one
 * quantum, 1/127 of its block's largest value; when that happens before a
 * K/V row is written, every later step carries it. So, with the cuda backend
 * fed the cpu's greedy tokens (the same inputs every step): every step's
 * logits within 5 % of their largest magnitude (seen: up to 1.9 % on these
 * models; 5-100 % of a run's steps within 1e-5), and the same argmax at
 * every step unless the cpu's own logits of the two tokens are closer than
 * twice that step's largest difference (a near-tie such a flip decides). */
static void compare_quant(const char *what, const char *args, uint32_t S, uint32_t V,
                          uint32_t (*tg)[NGEN], uint32_t (*tc)[NGEN], const float *lg,
                          const float *lc)
{
    uint32_t close = 0, total = 0, ties = 0;
    double worst = 0;
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t t = 0; t < NGEN; t++) {
            const float *a = lg + ((size_t)t * MAXS + s) * V, *b = lc + ((size_t)t * MAXS + s) * V;
            double md = 0, mx = 0;
            for (uint32_t i = 0; i < V; i++) {
                md = fmax(md, fabs((double)a[i] - b[i]));
                mx = fmax(mx, fabs((double)b[i]));
            }
            total++;
            close += md <= 1e-5 * mx;
            worst = fmax(worst, md / mx);
            if (!(md <= 0.05 * mx))
                fail_msg("%s (%s): sequence %u step %u: logits differ by %g of %g", what, args, s,
                         t, md, mx);
            if (tg[s][t] != tc[s][t]) {
                double gap = (double)b[tc[s][t]] - b[tg[s][t]];
                if (gap > 2 * md)
                    fail_msg("%s (%s): sequence %u token %u: cuda %u, cpu %u (cpu gap %g, "
                             "logits differ by %g)",
                             what, args, s, t, tg[s][t], tc[s][t], gap, md);
                ties++;
            }
        }
    printf("%s (%s): %u of %u steps within 1e-5, largest difference %.3g, %u near-tie(s) "
           "decided apart\n",
           what, args, close, total, worst, ties);
}

/* KVD_GPU_MODEL_CASES=LO-HI runs cases LO..HI only: ctest runs them as two
 * tests, so that the emulator's slowest test uses both of CI's cores. */
static void case_range(size_t *lo, size_t *hi)
{
    size_t n = sizeof cases / sizeof cases[0];
    const char *r = getenv("KVD_GPU_MODEL_CASES");
    unsigned a, b;
    *lo = 0;
    *hi = n - 1;
    if (r && sscanf(r, "%u-%u", &a, &b) == 2 && a <= b) {
        *lo = a < n ? a : n;
        *hi = b < n ? b : n - 1;
    }
}

static void test_greedy_equal(void **state)
{
    size_t lo, hi;
    case_range(&lo, &hi);
    for (size_t c = lo; c <= hi && c < sizeof cases / sizeof cases[0]; c++) {
        char *path = ref_gen_model(cases[c].args);
        assert_non_null(path);
        struct runner g, p;
        runner_open(&g, cuda_be, path, cases[c].kvt);
        runner_open(&p, cpu_be, path, cases[c].kvt);
        int f32 = strstr(cases[c].args, "f32") != NULL;
        int quant = strstr(cases[c].args, "--type q") && !strstr(cases[c].args, "q8_0");
        /* f32 weights: prompts long enough for the cuBLAS path when
         * batched; others: at most 8 rows per step */
        uint32_t plen[MAXS] = {f32 ? 8 : 3, f32 ? 5 : 2, f32 ? 7 : 2, 1};
        uint32_t prompt[MAXS][8];
        rnd_seed(100 + c);
        for (uint32_t s = 0; s < MAXS; s++)
            for (uint32_t i = 0; i < 8; i++)
                prompt[s][i] = rnd_u32(g.V);
        uint32_t tg[MAXS][NGEN], tc[MAXS][NGEN];
        if (quant) {
            /* Whole models three times over in every launch order cost
             * minutes of CI; the quantized kernels' order independence is
             * checked launch by launch in test_gpu_ops (KVD_EMU_CHECK=order). */
            gpu_emu_order_check(0);
            size_t nl = (size_t)NGEN * MAXS * g.V;
            float *lg = calloc(nl, sizeof(float)), *lc = calloc(nl, sizeof(float));
            assert_true(lg && lc);
            for (int batched = 0; batched < 2; batched++) {
                uint32_t S = batched ? MAXS : 1;
                greedy_ex(&p, S, (const uint32_t(*)[8])prompt, plen, batched, tc, NULL, lc);
                greedy_ex(&g, S, (const uint32_t(*)[8])prompt, plen, batched, tg, tc, lg);
                compare_quant(batched ? "batched" : "alone", cases[c].args, S, g.V, tg, tc, lg, lc);
            }
            free(lg);
            free(lc);
            gpu_emu_order_check(1);
        } else {
            /* alone */
            greedy(&g, 1, (const uint32_t(*)[8])prompt, plen, 0, tg);
            greedy(&p, 1, (const uint32_t(*)[8])prompt, plen, 0, tc);
            compare("alone", cases[c].args, 1, tg, tc);
            /* batched */
            greedy(&g, MAXS, (const uint32_t(*)[8])prompt, plen, 1, tg);
            greedy(&p, MAXS, (const uint32_t(*)[8])prompt, plen, 1, tc);
            compare("batched", cases[c].args, MAXS, tg, tc);
        }
        runner_close(&g);
        runner_close(&p);
        unlink(path);
        free(path);
    }
}

/* A Q4_K_M model (Q4_K and Q6_K projections) prefilled from a 40-token
 * prompt: the step's projections (40 rows) take the int8 tensor-core GEMM
 * (kernels/gemm_qmma.cu) and no cuBLAS call; then NGEN decode steps fed
 * the cpu's greedy tokens. Logits and tokens against the cpu backend's as
 * compare_quant (Q6_K's float order is the GEMV's, not the cpu's). */
#define LONG_P 40
static void long_greedy(struct runner *r, const uint32_t *prompt, uint32_t (*out)[NGEN],
                        uint32_t (*force)[NGEN], float *keep)
{
    uint32_t slots[BPS], pos = LONG_P, last = 0, pick = 0;
    for (uint32_t i = 0; i < BPS; i++)
        slots[i] = BPS - 1 - i;
    float *logits = malloc((size_t)r->V * sizeof(float));
    assert_non_null(logits);
    for (uint32_t step = 0; step < NGEN; step++) {
        struct sample_row row = {.top_p = 1.0f};
        struct fwd_seq seq = {.tokens = step ? &last : prompt,
                              .n_tokens = step ? 1 : LONG_P,
                              .pos0 = step ? pos++ : 0,
                              .slots = slots,
                              .n_slots = BPS};
        struct fwd_batch b = {.seqs = &seq,
                              .n_seqs = 1,
                              .kv_arena = r->arena,
                              .geom = &r->g,
                              .n_arena_slots = MAXS * BPS,
                              .logits = logits,
                              .sample = &row,
                              .tokens = &pick};
        if (model_forward(r->m, r->fc, &b))
            fail_msg("model_forward on %s: %s", r->be->ops->name, fwd_ctx_errmsg(r->fc));
        last = argmax(logits, r->V);
        out[0][step] = last;
        if (force)
            last = force[0][step];
        memcpy(keep + (size_t)step * MAXS * r->V, logits, r->V * sizeof(float));
    }
    free(logits);
}

static void test_long_prompt_qmma(void **state)
{
    const char *args = cases[6].args; /* q4_k_m */
    char *path = ref_gen_model(args);
    assert_non_null(path);
    struct runner g, p;
    runner_open(&g, cuda_be, path, cases[6].kvt);
    runner_open(&p, cpu_be, path, cases[6].kvt);
    uint32_t prompt[LONG_P], tg[MAXS][NGEN], tc[MAXS][NGEN];
    rnd_seed(41);
    for (uint32_t i = 0; i < LONG_P; i++)
        prompt[i] = rnd_u32(g.V);
    size_t nl = (size_t)NGEN * MAXS * g.V;
    float *lg = calloc(nl, sizeof(float)), *lc = calloc(nl, sizeof(float));
    assert_true(lg && lc);
    gpu_emu_order_check(0); /* the kernel's order independence: test_gpu_qmma */
    long_greedy(&p, prompt, tc, NULL, lc);
    long_greedy(&g, prompt, tg, tc, lg);
    gpu_emu_order_check(1);
    struct cuda_compute_stats st;
    cuda_compute_stats(g.m->cx, &st);
    assert_int_equal(st.blas, 0);
    compare_quant("40-token prompt", args, 1, g.V, tg, tc, lg, lc);
    free(lg);
    free(lc);
    runner_close(&g);
    runner_close(&p);
    unlink(path);
    free(path);
}

static void test_graph_replay(void **state)
{
    char *path = ref_gen_model(cases[2].args);
    assert_non_null(path);
    uint32_t plen[MAXS] = {3, 2, 2, 1}, prompt[MAXS][8];
    rnd_seed(7);
    for (uint32_t s = 0; s < MAXS; s++)
        for (uint32_t i = 0; i < 8; i++)
            prompt[s][i] = rnd_u32(1000);
    uint32_t eager[MAXS][NGEN], graph[MAXS][NGEN];
    struct runner r;
    struct cuda_compute_stats st;

    runner_open(&r, cuda_be, path, cases[2].kvt);
    cuda_compute_set_graphs(r.m->cx, false);
    greedy(&r, MAXS, (const uint32_t(*)[8])prompt, plen, 1, eager);
    cuda_compute_stats(r.m->cx, &st);
    assert_int_equal(st.replays, 0);
    runner_close(&r);

    runner_open(&r, cuda_be, path, cases[2].kvt);
    cuda_compute_set_graphs(r.m->cx, true);
    greedy(&r, MAXS, (const uint32_t(*)[8])prompt, plen, 1, graph);
    cuda_compute_stats(r.m->cx, &st);
    /* prefill eager, first decode eager, second captured, the rest replayed */
    assert_int_equal(st.captures, 1);
    assert_int_equal(st.replays, NGEN - 3);
    runner_close(&r);
    compare("graph vs eager", cases[2].args, MAXS, graph, eager);
    unlink(path);
    free(path);
}

/* The kernel launches the device ran so far (the emulator counts them; a
 * real device reports nothing here). */
static unsigned long long device_launches(void)
{
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c;
    kvd_emu_get_counts(&c);
    return c.launches;
#else
    return 0;
#endif
}

/* One decode step of sequence 0 (token tok at position *pos, which
 * advances) on r's arena; returns whether it was replayed from a graph.
 * The backend's count of the step's kernel launches (model_step_launches)
 * must be what the emulated device ran, eager, captured or replayed. */
static bool decode1(struct runner *r, uint32_t tok, uint32_t *pos)
{
    static const uint32_t slots[BPS] = {5, 3, 7, 1, 0, 2, 4, 6};
    struct cuda_compute_stats a, b;
    struct sample_row row = {.top_p = 1.0f};
    uint32_t pick = 0;
    struct fwd_seq seq = {
        .tokens = &tok, .n_tokens = 1, .pos0 = *pos, .slots = slots, .n_slots = BPS};
    struct fwd_batch fb = {.seqs = &seq,
                           .n_seqs = 1,
                           .kv_arena = r->arena,
                           .geom = &r->g,
                           .n_arena_slots = MAXS * BPS,
                           .sample = &row,
                           .tokens = &pick};
    cuda_compute_stats(r->m->cx, &a);
    unsigned long long l0 = device_launches();
    if (model_forward(r->m, r->fc, &fb))
        fail_msg("decode at %u: %s", *pos, fwd_ctx_errmsg(r->fc));
    unsigned long long ran = device_launches() - l0;
    cuda_compute_stats(r->m->cx, &b);
    uint32_t counted = model_step_launches(r->m);
    assert_true(counted > 0);
#ifdef KVD_CUDA_EMULATE
    if (ran != counted)
        fail_msg("decode at %u (%s): the backend counted %u launches, the device ran %llu", *pos,
                 b.replays > a.replays ? "replayed" : "eager or captured", counted, ran);
#else
    (void)ran;
#endif
    (*pos)++;
    return b.replays > a.replays;
}

/* Decodes until a step is replayed from its graph (the third of a key:
 * eager, captured, replayed). */
static void decode_to_replay(struct runner *r, uint32_t *pos)
{
    for (int i = 0; i < 3; i++)
        if (decode1(r, 1 + *pos % 7, pos))
            return;
    fail_msg("no graph replay after 3 decode steps");
}

/* A graph holds raw device addresses, so every free of device memory drops
 * the graphs: an arena, a KV pool (kvmm_free), a buffer of the compute
 * context, the dequant tile (replaced when a larger weight is uploaded).
 * After each free the next step of the same key runs eagerly (a replay
 * could read freed memory, or an arena allocated at the same address with
 * another layout), the one after is captured again, then replayed. */
static void test_graph_drop_on_free(void **state)
{
    char *path = ref_gen_model("--arch llama --layers 1 --embd 256 --heads 4 --kv-heads 2 --ff 256 "
                               "--vocab 300 --type q4_k_m --seed 23");
    assert_non_null(path);
    struct runner r;
    struct cuda_compute_stats st;
    uint32_t pos = 0;
    gpu_emu_order_check(0); /* the graphs' bookkeeping is tested here, not the kernels */
    runner_open(&r, cuda_be, path, KV_F16);
    cuda_compute_set_graphs(r.m->cx, true);
    const struct compute_ops *o = r.m->ops;
    for (int what = 0; what < 4; what++) {
        decode_to_replay(&r, &pos);
        cuda_compute_stats(r.m->cx, &st);
        uint64_t dropped = st.dropped;
        void *p = NULL;
        struct ctensor t = {0};
        switch (what) {
        case 0: { /* an arena (not even this step's) */
            assert_int_equal(cuda_be->ops->arena_alloc(cuda_be, KVD_TIER_DEVICE, 4096, &p), 0);
            cuda_be->ops->arena_free(cuda_be, KVD_TIER_DEVICE, p, 4096);
            break;
        }
        case 1: { /* a KV pool */
            struct kvmm_config cfg = {.geom = r.g, .n_device_blocks = 2, .be = cuda_be};
            struct kvmm *mm = NULL;
            assert_int_equal(kvmm_new(&cfg, &mm), 0);
            kvmm_free(mm);
            break;
        }
        case 2: /* a buffer of the compute context */
            assert_int_equal(o->buf_alloc(r.m->cx, 256, &p), 0);
            o->buf_free(r.m->cx, p);
            break;
        case 3: { /* the dequant tile: a Q4_K matrix larger than any of the model's */
            t = (struct ctensor){.type = CT_Q4_K, .ne0 = 256, .ne1 = 2048};
            t.nbytes = ctype_row_bytes(CT_Q4_K, 256) * t.ne1;
            uint8_t *zeros = calloc(1, t.nbytes);
            assert_non_null(zeros);
            assert_int_equal(o->buf_alloc(r.m->cx, t.nbytes, &t.data), 0);
            size_t before = o->weight_scratch_bytes(r.m->cx);
            /* the buffer's allocation freed nothing: still replayed */
            assert_true(decode1(&r, 2, &pos));
            assert_int_equal(o->weight_upload(r.m->cx, &t, zeros), 0);
            assert_true(o->weight_scratch_bytes(r.m->cx) > before);
            free(zeros);
            break;
        }
        }
        if (decode1(&r, 3, &pos))
            fail_msg("free %d: the step after it was replayed from a graph captured before", what);
        cuda_compute_stats(r.m->cx, &st);
        assert_true(st.dropped > dropped);
        decode_to_replay(&r, &pos); /* captured again, then replayed */
        if (t.data)
            o->buf_free(r.m->cx, t.data);
    }
    runner_close(&r);
    gpu_emu_order_check(1);
    unlink(path);
    free(path);
}

/* A step that fails after some of its ops were issued (attention refuses
 * head_dim 48 after the projections ran) ends with a wait for the compute
 * stream, and the next step on the same context is clean: the cuda
 * backend counts the wait, the emulator reports nothing. */
static void test_failed_step_syncs(void **state)
{
    char *path = ref_gen_model("--arch llama --layers 1 --embd 192 --heads 4 --kv-heads 2 --ff 256 "
                               "--vocab 300 --type f32 --seed 24");
    assert_non_null(path);
    struct runner r;
    struct cuda_compute_stats a, b;
    uint32_t pos = 0, tok = 5, pick = 0;
    static const uint32_t slots[BPS] = {0, 1, 2, 3, 4, 5, 6, 7};
    gpu_emu_order_check(0);
    runner_open(&r, cuda_be, path, KV_F16);
    struct sample_row row = {.top_p = 1.0f};
    struct fwd_seq seq = {.tokens = &tok, .n_tokens = 1, .slots = slots, .n_slots = BPS};
    struct fwd_batch fb = {.seqs = &seq,
                           .n_seqs = 1,
                           .kv_arena = r.arena,
                           .geom = &r.g,
                           .n_arena_slots = MAXS * BPS,
                           .sample = &row,
                           .tokens = &pick};
    for (int i = 0; i < 2; i++) {
        cuda_compute_stats(r.m->cx, &a);
        seq.pos0 = pos++;
        assert_int_equal(model_forward(r.m, r.fc, &fb), KVD_EUNSUPPORTED);
        cuda_compute_stats(r.m->cx, &b);
        assert_int_equal(b.failed_syncs, a.failed_syncs + 1);
    }
    runner_close(&r);
    gpu_emu_order_check(1);
    unlink(path);
    free(path);
}

/* The largest bf16 tile a quantized model's GEMMs need: its largest
 * projection (these models are far under the 32 MiB tile). */
static size_t largest_matrix(const struct model *m)
{
    size_t big = (size_t)m->output.ne0 * m->output.ne1; /* = tok_embd when tied */
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        const struct ctensor *t[] = {&m->layers[l].wq,  &m->layers[l].wk,   &m->layers[l].wv,
                                     &m->layers[l].wo,  &m->layers[l].gate, &m->layers[l].up,
                                     &m->layers[l].down};
        for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
            if ((size_t)t[i]->ne0 * t[i]->ne1 > big)
                big = (size_t)t[i]->ne0 * t[i]->ne1;
    }
    return big;
}

/* With the KV arena sized to nearly all free device memory (a high
 * gpu-mem), the first prompt over 8 tokens must still run: the bf16 copies
 * the cuBLAS path reads for F16/Q8_0 weights, and the tile the other
 * quantized types are dequantized into, are made and counted at model load
 * (weight_device_bytes), before the arena takes its share, not on first
 * use. */
static void test_long_prompt_full_memory(void **state)
{
    const char *args[] = {cases[1].args, cases[3].args, cases[6].args}; /* f16, q8_0, q4_k_m */
    for (size_t c = 0; c < 3; c++) {
        char *path = ref_gen_model(args[c]);
        assert_non_null(path);
        struct kvd_error err = {0};
        struct model *m = NULL;
        struct fwd_ctx *fc = NULL;
        assert_int_equal(model_load(path, cuda_be, &m, &err), 0);
        assert_int_equal(fwd_ctx_new(m, 64, 1, &fc), 0);
        /* the projections carry their copy; the untied embedding, only
         * looked up by rows, does not (it would cost vocab x embd x 2 B) */
        if (c < 2) { /* q8_0: its blocks in planes, then the copy */
            assert_int_equal(m->layers[0].wq.layout, c == 0 ? CL_ROWS_BF16 : CL_PLANES);
        } else {
            /* no copy: the blocks alone (in planes), plus one tile for the
             * whole model */
            assert_int_equal(m->layers[0].wq.layout, CL_PLANES);
            size_t tile = largest_matrix(m) * 2;
            assert_true(m->hp.weight_device_bytes >= m->hp.weight_bytes + tile);
            assert_true(m->hp.weight_device_bytes <= m->hp.weight_bytes + tile + (64u << 10));
        }
        assert_int_equal(m->tok_embd.layout, CL_ROWS);
        size_t free_b = 0, total_b = 0;
        assert_int_equal(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
#ifdef KVD_CUDA_EMULATE
        /* an emulated device with 64 MiB left after the weights */
        kvd_emu_set_device_mem(total_b - free_b + (64u << 20));
        assert_int_equal(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
#endif
        struct kv_geom g;
        model_kv_geom(m, BT, KV_F16, &g);
        size_t bb = kv_block_bytes(&g), n_blocks = (free_b - (1u << 20)) / bb;
        assert_true(n_blocks >= 4);
        void *arena = NULL;
        assert_int_equal(cuda_be->ops->arena_alloc(cuda_be, KVD_TIER_DEVICE, n_blocks * bb, &arena),
                         0);
        uint32_t V = model_hparams(m)->n_vocab, prompt[32], slots[4] = {0, 1, 2, 3}, pick = 0;
        for (uint32_t i = 0; i < 32; i++)
            prompt[i] = (i * 37 + 5) % V;
        float *logits = malloc((size_t)V * sizeof(float));
        assert_non_null(logits);
        struct sample_row row = {.top_p = 1.0f};
        struct fwd_seq seq = {.tokens = prompt, .n_tokens = 32, .slots = slots, .n_slots = 4};
        struct fwd_batch b = {.seqs = &seq,
                              .n_seqs = 1,
                              .kv_arena = arena,
                              .geom = &g,
                              .n_arena_slots = (uint32_t)n_blocks,
                              .logits = logits,
                              .sample = &row,
                              .tokens = &pick};
        if (model_forward(m, fc, &b))
            fail_msg("a 32-token prompt with the arena filling the device (%s): %s", args[c],
                     fwd_ctx_errmsg(fc));
        for (uint32_t i = 0; i < V; i++)
            assert_true(isfinite(logits[i]));
        free(logits);
        cuda_be->ops->arena_free(cuda_be, KVD_TIER_DEVICE, arena, n_blocks * bb);
        fwd_ctx_free(fc);
        model_free(m);
#ifdef KVD_CUDA_EMULATE
        kvd_emu_set_device_mem((size_t)16 << 30);
#endif
        unlink(path);
        free(path);
    }
}

/* Kernel launches per layer of a batch-1 decode step, as stats reports
 * them (model_step_launches, requests.step_launches): 5 (the QKV
 * projection ending with RoPE and the KV write, the decode attention, the
 * o projection with the residual norm, gate and up with SiLU, down with
 * the residual norm), counted as the difference between a 3-layer and a
 * 1-layer model of the same shape (the embedding, the final norm, the head
 * and the sampler cancel out), in bf16 and Q4_K_M, at a context of 40
 * tokens and of 300. Both split the decode attention (the split count is
 * chosen for the context's bucket, at least 256 tokens, in splits of at
 * least 64), and the last split to finish merges them (no launch of its
 * own), so both count the same launches. The count must be what the
 * emulated device ran. */
static uint32_t launches_at(struct runner *r, uint32_t pos, struct cuda_compute_stats *act)
{
    uint32_t slots[MAXS * BPS], tok = 1, pick = 0;
    for (uint32_t i = 0; i < MAXS * BPS; i++)
        slots[i] = i;
    struct sample_row row = {.top_p = 1.0f};
    struct fwd_seq seq = {
        .tokens = &tok, .n_tokens = 1, .pos0 = pos, .slots = slots, .n_slots = MAXS * BPS};
    struct fwd_batch fb = {.seqs = &seq,
                           .n_seqs = 1,
                           .kv_arena = r->arena,
                           .geom = &r->g,
                           .n_arena_slots = MAXS * BPS,
                           .sample = &row,
                           .tokens = &pick};
    struct cuda_compute_stats a;
    cuda_compute_stats(r->m->cx, &a);
    unsigned long long l0 = device_launches();
    if (model_forward(r->m, r->fc, &fb))
        fail_msg("decode at %u: %s", pos, fwd_ctx_errmsg(r->fc));
    uint32_t n = model_step_launches(r->m);
    cuda_compute_stats(r->m->cx, act);
    act->act_quants -= a.act_quants;
    act->act_handed -= a.act_handed;
#ifdef KVD_CUDA_EMULATE
    if (device_launches() - l0 != n)
        fail_msg("decode at %u: the backend counted %u launches, the device ran %llu", pos, n,
                 device_launches() - l0);
#else
    (void)l0;
#endif
    return n;
}

/* The launches of matmul_n over q, k, v that read int8 activations: one
 * per run of weights of one type, a run of a type the GEMV pairs with the
 * one before (v in Q6_K after q, k in Q4_K) in the same launch. */
static uint64_t qkv_quant_launches(const struct model_layer *L)
{
    const struct ctensor *w[3] = {&L->wq, &L->wk, &L->wv};
    uint64_t n = 0;
    for (int i = 0; i < 3; i++)
        if (kvd_k_gemv_act_kind((int)w[i]->type) &&
            (i == 0 || (w[i]->type != w[i - 1]->type &&
                        !kvd_k_gemv_pair_ok((int)w[0]->type, (int)w[i]->type))))
            n++;
    return n;
}

/* Each activation quantized once in a decode step: only the first layer's
 * q, k, v, each layer's wo (the attention's output) and the head quantize
 * their input; gate/up, down and the next layer's q, k, v read theirs as
 * the launch before made it. */
static void check_act_quants(const struct model *m, const char *type,
                             const struct cuda_compute_stats *act)
{
    const struct model_hparams *hp = &m->hp;
    uint64_t quants = qkv_quant_launches(&m->layers[0]) +
                      (kvd_k_gemv_act_kind((int)m->output.type) ? 1 : 0),
             handed = 0;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        quants += kvd_k_gemv_act_kind((int)L->wo.type) ? 1 : 0;
        handed += (kvd_k_gemv_act_kind((int)L->gate.type) ? 1 : 0) +
                  (kvd_k_gemv_act_kind((int)L->down.type) ? 1 : 0) +
                  (l ? qkv_quant_launches(L) : 0);
    }
    printf("# %s, %u layers: %llu launches quantized their input (expected %llu), %llu read "
           "it quantized by its producer (expected %llu)\n",
           type, hp->n_layer, (unsigned long long)act->act_quants, (unsigned long long)quants,
           (unsigned long long)act->act_handed, (unsigned long long)handed);
    if (act->act_quants != quants || act->act_handed != handed)
        fail_msg("%s, %u layers: %llu launches quantized their input, %llu read it quantized "
                 "(expected %llu and %llu)",
                 type, hp->n_layer, (unsigned long long)act->act_quants,
                 (unsigned long long)act->act_handed, (unsigned long long)quants,
                 (unsigned long long)handed);
}

/* Launches of a decode step of 1 and of 4 layers: 5 in every layer, bf16
 * and the Q4_K_M mix (v and down in Q6_K in layers 0 of 1, 2 and 3 of 4:
 * a layer of each kind in the difference). */
static void test_launches_per_layer(void **state)
{
    static const char *const types[] = {"bf16", "q4_k_m"};
    static const uint32_t ctx[] = {40, 300};
    gpu_emu_order_check(0); /* counts, not kernels */
    for (int ti = 0; ti < 2; ti++) {
        uint32_t n[2][2];
        struct cuda_compute_stats act[2][2];
        for (int k = 0; k < 2; k++) {
            char args[256];
            snprintf(args, sizeof args,
                     "--arch llama --layers %d --embd 256 --heads 8 --kv-heads 2 --ff 512 "
                     "--vocab 300 --ctx 512 --type %s --seed 29",
                     k ? 4 : 1, types[ti]);
            char *path = ref_gen_model(args);
            assert_non_null(path);
            struct runner r;
            runner_open(&r, cuda_be, path, KV_F16);
            /* zeroed rows before the position: only the count matters here */
            assert_int_equal(cudaMemset(r.arena, 0, r.arena_bytes), cudaSuccess);
            for (int c = 0; c < 2; c++) {
                n[c][k] = launches_at(&r, ctx[c], &act[c][k]);
                check_act_quants(r.m, types[ti], &act[c][k]);
            }
            runner_close(&r);
            unlink(path);
            free(path);
        }
        for (int c = 0; c < 2; c++) {
            assert_true(n[c][1] > n[c][0]);
            uint32_t per_layer = (n[c][1] - n[c][0]) / 3;
            printf("# %s decode at context %u: %u launches a layer, %u outside the layers\n",
                   types[ti], ctx[c], per_layer, n[c][0] - per_layer);
            if ((n[c][1] - n[c][0]) % 3 || per_layer != 5)
                fail_msg("%s decode at %u: %u launches for 1 layer, %u for 4 (5 a layer)",
                         types[ti], ctx[c], n[c][0], n[c][1]);
        }
        /* the same kernels at both contexts: split attention and its merge */
        assert_int_equal(n[1][1] - n[1][0], n[0][1] - n[0][0]);
    }
    gpu_emu_order_check(1);
}

int main(void)
{
    struct kvd_error err = {0};
    if (backend_cuda_new(0, &cuda_be, &err)) {
        printf("SKIP: no usable CUDA device: %s\n", err.message);
        return GPU_SKIP;
    }
    cpu_be = ref_cpu_backend();
    if (!cpu_be) {
        fprintf(stderr, "cpu backend failed\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_greedy_equal),       GPU_TEST(test_long_prompt_qmma),
        GPU_TEST(test_graph_replay),       GPU_TEST(test_graph_drop_on_free),
        GPU_TEST(test_failed_step_syncs),  GPU_TEST(test_long_prompt_full_memory),
        GPU_TEST(test_launches_per_layer),
    };
    if (getenv("KVD_TEST_FILTER")) /* e.g. KVD_TEST_FILTER='test_graph*' */
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    if (getenv("KVD_TEST_SKIP")) /* the tests another ctest entry runs */
        cmocka_set_skip_filter(getenv("KVD_TEST_SKIP"));
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_free(cuda_be);
    return rc;
}

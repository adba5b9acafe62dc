/* CUDA graphs of mixed steps (a prefill chunk with decode rows): a mixed
 * step replayed from a graph gives the eager step's logits and tokens over
 * steps of changing prompts and contexts, steps whose shapes fall in one
 * row bucket share a graph, a shape outside it captures a new one, every
 * free of device memory drops them, and whole-model tokens equal the cpu
 * backend's with graphs on. Skips (77) without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compute_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kvd/status.h"
#include "kvmm.h"
#include "model.h"
#include "model/model_ref.h"
#include "model_impl.h"

#define BT 16
#define BPS 16    /* blocks per sequence: 256 positions, one context bucket */
#define NSEQ 3    /* A and B decode, C's prompt comes in chunks */
#define NSTEPS 11 /* step 0 prefills all three; then A, B decode with C's chunks */
#define C_LEN 160

static struct backend *cuda_be, *cpu_be;

/* f32 weights (the cuBLAS SGEMM path past 8 rows on cuda, the same
 * arithmetic as the cpu's) and a bf16 KV (the tensor-core prefill
 * attention for the chunk, the split decode kernel for A's and B's rows). */
static const char *const MODEL = "--arch llama --layers 2 --embd 256 --heads 8 --kv-heads 2 "
                                 "--ff 512 --vocab 600 --type f32 --seed 31";

struct runner {
    struct backend *be;
    struct model *m;
    struct fwd_ctx *fc;
    struct kv_geom g;
    void *arena;
    size_t arena_bytes;
    uint32_t V;
};

static void runner_open(struct runner *r, struct backend *be, const char *path)
{
    struct kvd_error err = {0};
    memset(r, 0, sizeof *r);
    r->be = be;
    if (model_load(path, be, &r->m, &err))
        fail_msg("model_load on %s: %s", be->ops->name, err.message);
    r->V = model_hparams(r->m)->n_vocab;
    model_kv_geom(r->m, BT, KV_BF16, &r->g);
    r->arena_bytes = kv_block_bytes(&r->g) * NSEQ * BPS;
    assert_int_equal(be->ops->arena_alloc(be, KVD_TIER_DEVICE, r->arena_bytes, &r->arena), 0);
    assert_int_equal(fwd_ctx_new(r->m, 64, 8, &r->fc), 0);
    /* The fwd_ctx's block tables grow (a new device buffer, the old one
     * freed: every graph dropped) as the steps reach more blocks. One
     * decode step at the last position of a sequence's BPS blocks (a table
     * never used after) grows them past what the schedule reaches. */
    uint32_t slots[BPS], tok = 1, pos = BPS * BT - 1, pick = 0;
    struct sample_row row = {.top_p = 1.0f};
    for (uint32_t i = 0; i < BPS; i++)
        slots[i] = (uint32_t)(NSEQ * BPS - 1 - i);
    struct fwd_seq seq = {
        .tokens = &tok, .n_tokens = 1, .pos0 = pos, .slots = slots, .n_slots = BPS};
    struct fwd_batch b = {.seqs = &seq,
                          .n_seqs = 1,
                          .kv_arena = r->arena,
                          .geom = &r->g,
                          .n_arena_slots = NSEQ * BPS,
                          .sample = &row,
                          .tokens = &pick};
    if (model_forward(r->m, r->fc, &b))
        fail_msg("warm-up step on %s: %s", be->ops->name, fwd_ctx_errmsg(r->fc));
}

static void runner_close(struct runner *r)
{
    fwd_ctx_free(r->fc);
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

/* How many of C's prompt tokens step k brings: 11 or 12 in steps 1-7 (the
 * step's 13 or 14 rows and max_q 11 or 12 fall in the row buckets 14 and
 * 12: one graph), 15 in steps 8-10 (17 rows, max_q 15: buckets 20 and 16,
 * another graph). */
static uint32_t chunk_len(uint32_t k)
{
    return k == 0 ? 11 : k < 8 ? 11 + k % 2 : 15;
}

/* The schedule's state: each sequence's tokens so far, its position. */
struct sched {
    uint32_t toks[NSEQ][C_LEN + NSTEPS + 1];
    uint32_t len[NSEQ]; /* tokens fed so far */
    uint32_t c_fed;     /* C's prompt tokens fed */
    uint32_t slots[NSEQ][BPS];
};

static void sched_init(struct sched *q, uint32_t V)
{
    memset(q, 0, sizeof *q);
    rnd_seed(57);
    for (uint32_t s = 0; s < NSEQ; s++)
        for (uint32_t i = 0; i < C_LEN; i++)
            q->toks[s][i] = rnd_u32(V);
    for (uint32_t s = 0; s < NSEQ; s++) /* scattered block tables */
        for (uint32_t i = 0; i < BPS; i++)
            q->slots[s][i] = (uint32_t)(NSEQ * BPS - 1 - (i * NSEQ + s));
}

/* Step k of the schedule on r: A and B prefill 5 and 4 tokens at step 0,
 * then decode their last step's greedy token; C takes its prompt in
 * chunks and ends each step with a greedy pick too (never fed: its next
 * chunk is prompt). Each sequence's picked token in tok[s], its logits in
 * lg[s][V]; returns whether the step was replayed from a graph. */
static bool run_step(struct runner *r, struct sched *q, uint32_t k, uint32_t tok[NSEQ], float *lg)
{
    static const uint32_t plen[2] = {5, 4};
    struct fwd_seq seqs[NSEQ];
    struct sample_row rows[NSEQ] = {{.top_p = 1.0f}, {.top_p = 1.0f}, {.top_p = 1.0f}};
    uint32_t picks[NSEQ];
    for (uint32_t s = 0; s < 2; s++) {
        uint32_t n = k ? 1 : plen[s];
        seqs[s] = (struct fwd_seq){.tokens = q->toks[s] + q->len[s] - (k ? 1 : 0),
                                   .n_tokens = n,
                                   .pos0 = k ? q->len[s] - 1 : 0,
                                   .slots = q->slots[s],
                                   .n_slots = BPS};
        if (!k)
            q->len[s] = plen[s];
    }
    uint32_t n = chunk_len(k);
    seqs[2] = (struct fwd_seq){.tokens = q->toks[2] + q->c_fed,
                               .n_tokens = n,
                               .pos0 = q->c_fed,
                               .slots = q->slots[2],
                               .n_slots = BPS};
    q->c_fed += n;
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = NSEQ,
                          .kv_arena = r->arena,
                          .geom = &r->g,
                          .n_arena_slots = NSEQ * BPS,
                          .logits = lg,
                          .sample = rows,
                          .tokens = picks};
    struct cuda_compute_stats a = {0}, z = {0};
    bool cuda = r->be == cuda_be;
    if (cuda)
        cuda_compute_stats(r->m->cx, &a);
    if (model_forward(r->m, r->fc, &b))
        fail_msg("step %u on %s: %s", k, r->be->ops->name, fwd_ctx_errmsg(r->fc));
    for (uint32_t s = 0; s < NSEQ; s++) {
        tok[s] = argmax(lg + (size_t)s * r->V, r->V);
        if (picks[s] != tok[s])
            fail_msg("step %u on %s, sequence %u: the sample op picked %u, the argmax is %u", k,
                     r->be->ops->name, s, picks[s], tok[s]);
        if (s < 2) /* A and B are fed their greedy token */
            q->toks[s][q->len[s]++] = tok[s];
    }
    if (!cuda)
        return false;
    cuda_compute_stats(r->m->cx, &z);
    return z.mixed_replays > a.mixed_replays;
}

/* Runs the whole schedule on r: tokens [NSTEPS][NSEQ], logits
 * [NSTEPS][NSEQ][V]; replayed[k]: step k came from a graph. */
static void run_all(struct runner *r, uint32_t (*tok)[NSEQ], float *lg, bool *replayed)
{
    struct sched *q = calloc(1, sizeof *q);
    assert_non_null(q);
    sched_init(q, r->V);
    for (uint32_t k = 0; k < NSTEPS; k++) {
        bool rp = run_step(r, q, k, tok[k], lg + (size_t)k * NSEQ * r->V);
        if (replayed)
            replayed[k] = rp;
    }
    free(q);
}

/* The schedule eager (graphs off), with graphs, and on the cpu backend:
 * with graphs, step 0 (its own shape) and the first step of each bucket
 * run eagerly, the second is captured, the rest replayed (steps 3-7 and
 * 10); logits equal eager's to rounding, tokens equal eager's and the
 * cpu's. */
static void test_mixed_replay(void **state)
{
    (void)state;
    char *path = ref_gen_model(MODEL);
    assert_non_null(path);
    gpu_emu_order_check(0); /* the graphs are tested here, not the kernels' thread order */
    struct runner r;
    uint32_t V = 0, te[NSTEPS][NSEQ], tg[NSTEPS][NSEQ], tc[NSTEPS][NSEQ];
    bool replayed[NSTEPS];
    struct cuda_compute_stats st;

    runner_open(&r, cuda_be, path);
    V = r.V;
    float *le = calloc((size_t)NSTEPS * NSEQ * V, sizeof(float)),
          *lgr = calloc((size_t)NSTEPS * NSEQ * V, sizeof(float)),
          *lc = calloc((size_t)NSTEPS * NSEQ * V, sizeof(float));
    assert_true(le && lgr && lc);
    cuda_compute_set_graphs(r.m->cx, false);
    run_all(&r, te, le, NULL);
    cuda_compute_stats(r.m->cx, &st);
    assert_int_equal(st.replays, 0);
    assert_int_equal(st.captures, 0);
    runner_close(&r);

    runner_open(&r, cuda_be, path);
    cuda_compute_set_graphs(r.m->cx, true);
    run_all(&r, tg, lgr, replayed);
    cuda_compute_stats(r.m->cx, &st);
    runner_close(&r);
    for (uint32_t k = 0; k < NSTEPS; k++) {
        bool want = (k >= 3 && k <= 7) || k == 10;
        if (replayed[k] != want)
            fail_msg("step %u (%u rows): %s from a graph", k, 2 + chunk_len(k),
                     replayed[k] ? "replayed" : "not replayed");
    }
    assert_int_equal(st.mixed_captures, 2);
    assert_int_equal(st.mixed_replays, 6);
    assert_int_equal(st.captures, 2);
    assert_int_equal(st.replays, 6);

    runner_open(&r, cpu_be, path);
    run_all(&r, tc, lc, NULL);
    runner_close(&r);

    for (uint32_t k = 0; k < NSTEPS; k++)
        for (uint32_t s = 0; s < NSEQ; s++) {
            const float *a = lgr + ((size_t)k * NSEQ + s) * V, *b = le + ((size_t)k * NSEQ + s) * V;
            double e = rel_err(a, b, V);
            if (!(e <= 1e-5))
                fail_msg("step %u sequence %u: graph logits differ from eager by %g", k, s, e);
            if (tg[k][s] != te[k][s] || tg[k][s] != tc[k][s])
                fail_msg("step %u sequence %u: graph %u, eager %u, cpu %u", k, s, tg[k][s],
                         te[k][s], tc[k][s]);
        }
    free(le);
    free(lgr);
    free(lc);
    gpu_emu_order_check(1);
    unlink(path);
    free(path);
}

/* Runs step 1's shape (a chunk of 12 tokens with A's and B's decode rows:
 * 14 rows) until one is replayed from its graph (the third of a key:
 * eager, captured, replayed). */
static void mixed_to_replay(struct runner *r, struct sched *q, uint32_t *tok, float *lg)
{
    for (int i = 0; i < 3; i++)
        if (run_step(r, q, 1, tok, lg))
            return;
    fail_msg("no graph replay after 3 mixed steps");
}

/* Every free of device memory drops the mixed steps' graphs as it does
 * the decode steps' (test_gpu_model): an arena, a KV pool, a buffer of the
 * compute context, the dequant tile. After each, the next step of the
 * same shape runs eagerly (a replay could read freed memory), the one
 * after is captured again, the third replayed. */
static void test_mixed_drop_on_free(void **state)
{
    (void)state;
    char *path = ref_gen_model("--arch llama --layers 1 --embd 256 --heads 4 --kv-heads 2 --ff 256 "
                               "--vocab 300 --type f32 --seed 32");
    assert_non_null(path);
    struct runner r;
    struct cuda_compute_stats st;
    gpu_emu_order_check(0);
    runner_open(&r, cuda_be, path);
    cuda_compute_set_graphs(r.m->cx, true);
    const struct compute_ops *o = r.m->ops;
    uint32_t tok[NSEQ];
    float *lg = calloc((size_t)NSEQ * r.V, sizeof(float));
    struct sched *q = calloc(1, sizeof *q);
    assert_true(lg && q);
    for (int what = 0; what < 4; what++) {
        /* fresh sequences each round: at most 6 chunks of 12 after the
         * prefill's 11 fit C's blocks */
        sched_init(q, r.V);
        run_step(&r, q, 0, tok, lg); /* the prefill: a shape of its own */
        mixed_to_replay(&r, q, tok, lg);
        cuda_compute_stats(r.m->cx, &st);
        uint64_t dropped = st.dropped;
        void *p = NULL;
        struct ctensor t = {0};
        switch (what) {
        case 0: /* an arena (not even this step's) */
            assert_int_equal(cuda_be->ops->arena_alloc(cuda_be, KVD_TIER_DEVICE, 4096, &p), 0);
            cuda_be->ops->arena_free(cuda_be, KVD_TIER_DEVICE, p, 4096);
            break;
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
            assert_true(run_step(&r, q, 1, tok, lg));
            assert_int_equal(o->weight_upload(r.m->cx, &t, zeros), 0);
            assert_true(o->weight_scratch_bytes(r.m->cx) > before);
            free(zeros);
            break;
        }
        }
        if (run_step(&r, q, 1, tok, lg))
            fail_msg("free %d: the mixed step after it was replayed from a graph captured before",
                     what);
        cuda_compute_stats(r.m->cx, &st);
        if (st.dropped <= dropped)
            fail_msg("free %d dropped no graph", what);
        if (run_step(&r, q, 1, tok, lg)) /* captured again */
            fail_msg("free %d: the second step after it was replayed", what);
        assert_true(run_step(&r, q, 1, tok, lg)); /* then replayed */
        if (t.data)
            o->buf_free(r.m->cx, t.data);
    }
    free(q);
    free(lg);
    runner_close(&r);
    gpu_emu_order_check(1);
    unlink(path);
    free(path);
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
        GPU_TEST(test_mixed_replay),
        GPU_TEST(test_mixed_drop_on_free),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_free(cuda_be);
    return rc;
}

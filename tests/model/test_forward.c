/* The paged, batched forward against the dense reference (model_ref.c) on
 * random models: llama and qwen2, every weight type, GQA and MHA, tied and
 * untied, rope_freqs; one-chunk prefill, chunked prefill, token-by-token
 * decode and multi-sequence batches with scattered block tables must all
 * give the reference's last-position logits to 1e-4 relative. Also batch
 * validation (nothing written on a bad batch), greedy-decode sanity, the
 * sample op inside the step, and decode steps padded to a bucket (what the
 * cuda backend does for CUDA graphs) equal to unpadded ones. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvd/status.h"
#include "gguf.h"
#include "model.h"
#include "model_impl.h"
#include "model/model_ref.h"

#define TOL 1e-4
#define N_BLOCKS 96

static uint64_t rs = 12345;
static uint32_t rnd(uint32_t n)
{
    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rs >> 33) % n);
}

struct fx {
    char *path;
    struct model *m;
    struct ref_model *ref;
    struct fwd_ctx *fc;
    struct kv_geom geom;
    void *arena;
    size_t block_bytes;
    uint32_t V;
    uint32_t perm[N_BLOCKS]; /* a random permutation: block tables draw from it */
    uint32_t next;           /* next unused entry of perm */
};

static size_t geom_block_bytes(const struct kv_geom *g)
{
    size_t esz = g->dtype == KV_F32 ? 4 : 2;
    return (size_t)g->layers * 2 * g->kv_heads * g->block_tokens * g->head_dim * esz;
}

static void fx_init(struct fx *f, const char *args, enum kv_dtype kvt, uint32_t bt,
                    uint32_t threads)
{
    struct kvd_error err = {0};
    memset(f, 0, sizeof *f);
    f->path = ref_gen_model(args);
    assert_non_null(f->path);
    struct model_opts o = {.n_threads = threads};
    int rc = model_load_opts(f->path, ref_cpu_backend(), &o, &f->m, &err);
    if (rc)
        fail_msg("model_load: %s", err.message);
    f->ref = ref_model_load(f->path);
    assert_non_null(f->ref);
    f->V = model_hparams(f->m)->n_vocab;
    assert_int_equal(f->V, ref_n_vocab(f->ref));
    model_kv_geom(f->m, bt, kvt, &f->geom);
    f->block_bytes = geom_block_bytes(&f->geom);
    f->arena = calloc(N_BLOCKS, f->block_bytes);
    assert_non_null(f->arena);
    assert_int_equal(fwd_ctx_new(f->m, 128, 8, &f->fc), 0);
    for (uint32_t i = 0; i < N_BLOCKS; i++)
        f->perm[i] = i;
    for (uint32_t i = N_BLOCKS - 1; i > 0; i--) {
        uint32_t j = rnd(i + 1), t = f->perm[i];
        f->perm[i] = f->perm[j];
        f->perm[j] = t;
    }
}

static void fx_free(struct fx *f)
{
    fwd_ctx_free(f->fc);
    model_free(f->m);
    ref_model_free(f->ref);
    free(f->arena);
    if (f->path)
        unlink(f->path);
    free(f->path);
    memset(f, 0, sizeof *f); /* freeing twice is harmless */
}

/* Each test's fixture (fx_init/fx_free may run several times in one test)
 * and buffers (talloc), in CMocka setup/teardown: whatever is left is
 * freed, also after a failed assert. */
#define T_MAX_BUF 16
struct tstate {
    struct fx f;
    void *buf[T_MAX_BUF];
    unsigned n_buf;
};

static int t_setup(void **state)
{
    *state = calloc(1, sizeof(struct tstate));
    return *state ? 0 : -1;
}

/* The test's buffers, freed. */
static void tfree(void **state)
{
    struct tstate *t = *state;
    for (unsigned i = 0; i < t->n_buf; i++)
        free(t->buf[i]);
    t->n_buf = 0;
}

static int t_teardown(void **state)
{
    struct tstate *t = *state;
    if (t) {
        fx_free(&t->f);
        tfree(state);
        free(t);
    }
    return 0;
}

static struct fx *t_fx(void **state)
{
    return &((struct tstate *)*state)->f;
}

/* A buffer of the test's, freed by tfree or the teardown. */
static void *talloc(void **state, size_t bytes)
{
    struct tstate *t = *state;
    assert_true(t->n_buf < T_MAX_BUF);
    void *p = malloc(bytes);
    assert_non_null(p);
    t->buf[t->n_buf++] = p;
    return p;
}

/* A block table of n fresh scattered slots. */
static void take_slots(struct fx *f, uint32_t *slots, uint32_t n)
{
    assert_true(f->next + n <= N_BLOCKS);
    memcpy(slots, f->perm + f->next, n * 4);
    f->next += n;
}

static void forward1(struct fx *f, const uint32_t *tok, uint32_t n, uint32_t pos0,
                     const uint32_t *slots, uint32_t n_slots, float *logits)
{
    struct fwd_seq s = {
        .tokens = tok, .n_tokens = n, .pos0 = pos0, .slots = slots, .n_slots = n_slots};
    struct fwd_batch b = {.seqs = &s,
                          .n_seqs = 1,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = logits};
    int rc = model_forward(f->m, f->fc, &b);
    if (rc)
        fail_msg("model_forward: %s", fwd_ctx_errmsg(f->fc));
}

static void check_close(const float *got, const double *ref, size_t n, const char *what)
{
    double e = ref_rel_err(got, ref, n);
    print_message("  %-28s rel err %.2e\n", what, e);
    if (!(e <= TOL))
        fail_msg("%s: relative error %.3e > %.0e", what, e, TOL);
}

/* The forward context's device bytes as the backend allocated them (what
 * the page budget charges a model's scratch): exactly what freeing it gives
 * back, its block tables grown by the steps included, and at least
 * fwd_ctx_bytes, the estimate made before it exists (the allocator rounds
 * up: the estimate is not an upper bound). */
static void check_scratch_bytes(struct fx *f)
{
    const struct model_hparams *hp = model_hparams(f->m);
    size_t held = fwd_ctx_dev_bytes(f->fc), with = model_dev_bytes(f->m);
    assert_true(held > 0);
    assert_true(held >= fwd_ctx_bytes(hp, 128, 8, 8));
    assert_true(with >= hp->weight_device_bytes + held);
    fwd_ctx_free(f->fc);
    f->fc = NULL;
    assert_int_equal(with - model_dev_bytes(f->m), held);
    /* a fresh one takes the same as its first allocation, block tables not
     * grown yet */
    assert_int_equal(fwd_ctx_new(f->m, 128, 8, &f->fc), 0);
    assert_true(fwd_ctx_dev_bytes(f->fc) <= held);
    assert_true(fwd_ctx_dev_bytes(f->fc) >= fwd_ctx_bytes(hp, 128, 8, 8));
    assert_int_equal(model_dev_bytes(f->m), with - held + fwd_ctx_dev_bytes(f->fc));
}

static void check_model(void **state, const char *args, enum kv_dtype kvt, uint32_t bt)
{
    struct fx *f = t_fx(state);
    fx_init(f, args, kvt, bt, 2);
    enum { N = 37 };
    uint32_t tok[N], slots[16];
    uint32_t nb = (N + bt - 1) / bt;
    for (int i = 0; i < N; i++)
        tok[i] = rnd(f->V);
    double *ref = talloc(state, f->V * 8), *ref1 = talloc(state, f->V * 8),
           *ref17 = talloc(state, f->V * 8);
    float *lg = talloc(state, f->V * 4), *lg_one = talloc(state, f->V * 4);
    ref_forward(f->ref, tok, N, kvt, ref);
    ref_forward(f->ref, tok, 1, kvt, ref1);
    ref_forward(f->ref, tok, 17, kvt, ref17);

    /* A: one chunk */
    take_slots(f, slots, nb);
    forward1(f, tok, N, 0, slots, nb, lg_one);
    check_close(lg_one, ref, f->V, "prefill, one chunk");

    /* B: chunks of 5, 12, 20 in fresh blocks */
    take_slots(f, slots, nb);
    forward1(f, tok, 5, 0, slots, nb, lg);
    forward1(f, tok + 5, 12, 5, slots, nb, lg);
    check_close(lg, ref17, f->V, "chunked, after 17");
    forward1(f, tok + 17, N - 17, 17, slots, nb, lg);
    check_close(lg, ref, f->V, "chunked, after 37");
    assert_true(ref_rel_err(lg, ref, f->V) < TOL);
    for (uint32_t i = 0; i < f->V; i++) /* same kernels, same order: agree closely with A */
        assert_true(fabsf(lg[i] - lg_one[i]) <= 1e-4f * (1 + fabsf(lg_one[i])));

    /* C: token by token, only the blocks needed so far */
    take_slots(f, slots, nb);
    for (uint32_t p = 0; p < N; p++) {
        forward1(f, tok + p, 1, p, slots, p / bt + 1, lg);
        if (p == 0)
            check_close(lg, ref1, f->V, "decode, after 1");
        if (p == 16)
            check_close(lg, ref17, f->V, "decode, after 17");
    }
    check_close(lg, ref, f->V, "decode, after 37");

    /* D: a batch of 3 sequences (prefill of different lengths, then one
     * decode step together) equals each sequence run alone. */
    enum { NS = 3 };
    static const uint32_t len[NS] = {N - 1, 20, 9};
    uint32_t st[NS][16], *stok[NS];
    float *blg = talloc(state, (size_t)NS * f->V * 4);
    struct fwd_seq seqs[NS];
    for (int s = 0; s < NS; s++) {
        stok[s] = talloc(state, N * 4);
        for (uint32_t i = 0; i < len[s] + 1; i++)
            stok[s][i] = s == 0 ? tok[i] : rnd(f->V);
        take_slots(f, st[s], (len[s] + 1 + bt - 1) / bt);
        seqs[s] = (struct fwd_seq){.tokens = stok[s],
                                   .n_tokens = len[s],
                                   .pos0 = 0,
                                   .slots = st[s],
                                   .n_slots = (len[s] + bt - 1) / bt};
    }
    struct fwd_batch b = {.seqs = seqs,
                          .n_seqs = NS,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = blg};
    assert_int_equal(model_forward(f->m, f->fc, &b), 0);
    for (int s = 0; s < NS; s++) {
        ref_forward(f->ref, stok[s], len[s], kvt, ref);
        check_close(blg + (size_t)s * f->V, ref, f->V, "batch prefill");
        seqs[s] = (struct fwd_seq){.tokens = stok[s] + len[s],
                                   .n_tokens = 1,
                                   .pos0 = len[s],
                                   .slots = st[s],
                                   .n_slots = (len[s] + 1 + bt - 1) / bt};
    }
    assert_int_equal(model_forward(f->m, f->fc, &b), 0);
    for (int s = 0; s < NS; s++) {
        ref_forward(f->ref, stok[s], len[s] + 1, kvt, ref);
        check_close(blg + (size_t)s * f->V, ref, f->V, "batch decode");
        /* alone, in other blocks */
        uint32_t sl[16];
        uint32_t nbs = (len[s] + 1 + bt - 1) / bt;
        if (f->next + nbs > N_BLOCKS)
            f->next = 0; /* reuse: everything is rewritten before it is read */
        take_slots(f, sl, nbs);
        forward1(f, stok[s], len[s] + 1, 0, sl, nbs, lg);
        /* the batch and the lone prefill run different matmul kernels
         * (decode GEMV vs panel tiles: other summation orders), so only
         * rounding may differ; a batching bug moves logits by O(1) */
        for (uint32_t i = 0; i < f->V; i++)
            if (!(fabsf(lg[i] - blg[(size_t)s * f->V + i]) <= 1e-4f * (1 + fabsf(lg[i]))))
                fail_msg("seq %d logit %u: alone %.9g batched %.9g", s, i, (double)lg[i],
                         (double)blg[(size_t)s * f->V + i]);
    }
    check_scratch_bytes(f);
    tfree(state);
    fx_free(f);
}

#define SHAPE "--embd 64 --heads 4 --ff 96 --vocab 300 --layers 2 --ctx 256"

static void t_llama_f32_mha(void **s)
{
    check_model(s, SHAPE " --type f32 --seed 1", KV_F32, 16);
}
static void t_llama_f16_gqa(void **s)
{
    check_model(s, SHAPE " --type f16 --kv-heads 2 --seed 2", KV_F16, 8);
}
static void t_llama_bf16_tied_freqs(void **s)
{
    check_model(s, SHAPE " --type bf16 --kv-heads 1 --tied --rope-freqs --seed 3", KV_BF16, 16);
}
static void t_llama_q8_0_gqa(void **s)
{
    check_model(
        s, "--embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 300 --layers 3 --type q8_0 --seed 4",
        KV_F16, 5);
}
static void t_qwen2_f16_tied(void **s)
{
    check_model(s, "--arch qwen2 " SHAPE " --kv-heads 2 --tied --type f16 --seed 5", KV_F16, 16);
}
static void t_qwen2_q8_0_freqs(void **s)
{
    check_model(s,
                "--arch qwen2 --embd 96 --heads 3 --ff 128 --vocab 260 --layers 2 --type q8_0 "
                "--rope-freqs --seed 6",
                KV_F32, 7);
}
static void t_llama_bf16_f32kv_mha(void **s)
{
    check_model(s, SHAPE " --type bf16 --seed 7", KV_F32, 3);
}

/* Head sizes past 64 (the attention kernel's register-held chunk) with a
 * tail, and matrices whose row count is no multiple of 16 (the matmul's
 * packed groups). */
static void t_wide_heads(void **s)
{
    check_model(
        s, "--embd 160 --heads 2 --kv-heads 1 --ff 96 --vocab 300 --layers 2 --type f16 --seed 10",
        KV_F16, 16);
    check_model(s, "--embd 256 --heads 2 --ff 64 --vocab 130 --layers 1 --type q8_0 --seed 11",
                KV_BF16, 6);
}

/* The portable (non-SIMD) kernels give the same answers. */
static void t_scalar_kernels(void **s)
{
    setenv("KVD_CPU_SCALAR", "1", 1);
    check_model(s,
                "--arch qwen2 --embd 64 --heads 4 --kv-heads 2 --ff 64 --vocab 200 --layers 1 "
                "--type q8_0 --seed 8",
                KV_F16, 4);
    check_model(s, SHAPE " --type f16 --kv-heads 2 --seed 9", KV_BF16, 16);
    unsetenv("KVD_CPU_SCALAR");
}

/* With KVD_CPU_LLAMACPP=1 (attention and RoPE with llama.cpp's cpu
 * arithmetic, whose tokens test_llamacpp compares) every row is still
 * computed alone: a sequence's logits are the same bits whether its prompt
 * runs in one chunk, in chunks, token by token, or in a batch with other
 * sequences, and the same on the AVX2 and the portable path; near the
 * double reference (the f16 attention sums and the Q8_K activations of
 * these K-quant models: printed, within 5e-2). Head sizes 64 (the f16 dot
 * on 64 lanes) and 32 (in double), both RoPE modes. */
static void t_llamacpp_rows_alone(void **state)
{
    static const char *models[] = {
        "--arch qwen2 --embd 256 --heads 4 --kv-heads 2 --ff 256 --vocab 300 --layers 2 "
        "--type q5_k_m --seed 12",
        "--embd 256 --heads 8 --kv-heads 2 --ff 256 --vocab 300 --layers 2 --type q4_k_m --seed "
        "13"};
    enum { N = 29, NS = 3, V = 300 };
    float *a = talloc(state, V * 4), *lg = talloc(state, V * 4), *avx2 = talloc(state, V * 4),
          *blg = talloc(state, (size_t)NS * V * 4);
    double *ref = talloc(state, V * 8);
    setenv("KVD_CPU_LLAMACPP", "1", 1);
    for (int mi = 0; mi < 2; mi++)
        for (int sc = 0; sc < 2; sc++) {
            if (sc)
                setenv("KVD_CPU_SCALAR", "1", 1);
            struct fx *f = t_fx(state);
            fx_init(f, models[mi], KV_F16, 8, 2);
            assert_int_equal(f->V, V);
            uint32_t tok[N], other[11], slots[16], nb = (N + 7) / 8;
            rs = 777 + (uint64_t)mi;
            for (int i = 0; i < N; i++)
                tok[i] = rnd(V);
            for (int i = 0; i < 11; i++)
                other[i] = rnd(V);
            take_slots(f, slots, nb);
            forward1(f, tok, N, 0, slots, nb, a);
            take_slots(f, slots, nb);
            forward1(f, tok, 5, 0, slots, nb, lg);
            forward1(f, tok + 5, 12, 5, slots, nb, lg);
            forward1(f, tok + 17, N - 17, 17, slots, nb, lg);
            assert_memory_equal(lg, a, V * 4);
            take_slots(f, slots, nb);
            for (uint32_t p = 0; p < N; p++)
                forward1(f, tok + p, 1, p, slots, p / 8 + 1, lg);
            assert_memory_equal(lg, a, V * 4);
            /* in a batch: the sequence, then two others of 11 and 3 tokens */
            uint32_t st[NS][4], len[NS] = {N, 11, 3};
            struct fwd_seq seqs[NS];
            for (int q = 0; q < NS; q++) {
                take_slots(f, st[q], (len[q] + 7) / 8);
                seqs[q] = (struct fwd_seq){.tokens = q ? other : tok,
                                           .n_tokens = len[q],
                                           .slots = st[q],
                                           .n_slots = (len[q] + 7) / 8};
            }
            struct fwd_batch b = {.seqs = seqs,
                                  .n_seqs = NS,
                                  .kv_arena = f->arena,
                                  .geom = &f->geom,
                                  .n_arena_slots = N_BLOCKS,
                                  .logits = blg};
            assert_int_equal(model_forward(f->m, f->fc, &b), 0);
            assert_memory_equal(blg, a, V * 4);
            ref_forward(f->ref, tok, N, KV_F16, ref);
            double e = ref_rel_err(a, ref, V);
            print_message("  %s%s: against the reference, rel err %.2e\n", models[mi],
                          sc ? " (portable)" : "", e);
            assert_true(e <= 5e-2);
            if (sc)
                assert_memory_equal(a, avx2, V * 4);
            else
                memcpy(avx2, a, V * 4);
            fx_free(f);
            unsetenv("KVD_CPU_SCALAR");
        }
    unsetenv("KVD_CPU_LLAMACPP");
}

/* fwd_ctx_set_trace: every op's output shown in order with its name, layer
 * and shape, and the same values the step goes on with; a trace that
 * changes the logits' op changes the logits returned; one that fails stops
 * the step with KVD_EINTERNAL; removing it restores the untraced step. */
struct trace_rec {
    int calls, layers_seen, last_layer, fail_at;
    float *logits;
    uint32_t V;
};

static int trace_cb(void *ud, const char *name, int layer, float *v, uint32_t rows, uint32_t cols)
{
    struct trace_rec *r = ud;
    if (r->fail_at && ++r->calls == r->fail_at)
        return -1;
    if (!r->fail_at)
        r->calls++;
    if (!strcmp(name, "Qcur") && layer != r->last_layer)
        r->layers_seen++, r->last_layer = layer;
    if (!strcmp(name, "result_output")) {
        assert_int_equal(cols, r->V);
        assert_int_equal(rows, 1);
        memcpy(r->logits, v, r->V * 4); /* what the step computed */
        v[7] = 1234.5f;                 /* and a change the caller must see */
        return 1;
    }
    return 0;
}

static void t_trace(void **state)
{
    struct fx *f = t_fx(state);
    fx_init(f, "--arch qwen2 " SHAPE " --kv-heads 2 --type f16 --seed 14", KV_F16, 16, 2);
    uint32_t tok[5] = {1, 2, 3, 4, 5}, slots[1];
    float *lg = talloc(state, f->V * 4), *plain = talloc(state, f->V * 4);
    struct trace_rec r = {.last_layer = -1, .logits = talloc(state, f->V * 4), .V = f->V};
    take_slots(f, slots, 1);
    forward1(f, tok, 5, 0, slots, 1, plain);
    assert_int_equal(fwd_ctx_set_trace(f->fc, trace_cb, &r), 0);
    take_slots(f, slots, 1);
    forward1(f, tok, 5, 0, slots, 1, lg);
    assert_int_equal(r.layers_seen, 2);
    /* per layer 3 projections, 3 biases, 2 ropes, attention, output, add+norm (2),
     * gate, up, swiglu, down, the add (and the next layer's norm: not after the
     * last); and embd, the first norm, the final norm, the logits */
    assert_int_equal(r.calls, 18 + 17 + 4);
    assert_memory_equal(r.logits, plain, f->V * 4);
    assert_true(lg[7] == 1234.5f);
    lg[7] = plain[7];
    assert_memory_equal(lg, plain, f->V * 4);
    r = (struct trace_rec){.fail_at = 3, .logits = r.logits, .V = f->V};
    struct fwd_seq sq = {.tokens = tok, .n_tokens = 5, .slots = slots, .n_slots = 1};
    struct fwd_batch b = {.seqs = &sq,
                          .n_seqs = 1,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = lg};
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EINTERNAL);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "trace"));
    assert_int_equal(fwd_ctx_set_trace(f->fc, NULL, NULL), 0);
    forward1(f, tok, 5, 0, slots, 1, lg);
    assert_memory_equal(lg, plain, f->V * 4);
}

/* Thread count does not change results (each dot product has one order). */
static void t_threads_agree(void **s)
{
    const char *args = SHAPE " --type f16 --kv-heads 2 --seed 10";
    float *lg[3];
    uint32_t threads[3] = {1, 2, 5}, tok[20], slots[4] = {0, 1, 2, 3};
    for (int i = 0; i < 20; i++)
        tok[i] = (uint32_t)(i * 37 % 300);
    for (int k = 0; k < 3; k++) {
        struct fx *f = t_fx(s);
        fx_init(f, args, KV_F16, 16, threads[k]);
        lg[k] = talloc(s, f->V * 4);
        forward1(f, tok, 20, 0, slots, 2, lg[k]);
        fx_free(f);
    }
    assert_memory_equal(lg[0], lg[1], 300 * 4);
    assert_memory_equal(lg[0], lg[2], 300 * 4);
}

/* Every bad batch is refused with a clear code before anything is written. */
static void t_validation(void **s)
{
    struct fx *f = t_fx(s);
    fx_init(f, SHAPE " --type f16 --kv-heads 2 --seed 11", KV_F16, 4, 2);
    uint32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8}, slots[4] = {0, 1, 2, 3}, bad_tok[2] = {1, 300};
    float *lg = talloc(s, 2 * f->V * 4);
    void *copy = talloc(s, N_BLOCKS * f->block_bytes);
    memset(f->arena, 0x5a, N_BLOCKS * f->block_bytes);
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);
    struct fwd_seq sq = {.tokens = tok, .n_tokens = 8, .pos0 = 0, .slots = slots, .n_slots = 2};
    struct fwd_batch b = {.seqs = &sq,
                          .n_seqs = 1,
                          .kv_arena = f->arena,
                          .geom = &f->geom,
                          .n_arena_slots = N_BLOCKS,
                          .logits = lg};
    assert_int_equal(model_forward(f->m, f->fc, &b), 0); /* baseline works */
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);

    sq.tokens = bad_tok, sq.n_tokens = 2;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "vocabulary"));
    sq.tokens = tok, sq.n_tokens = 8, sq.n_slots = 1; /* 8 tokens need 2 blocks of 4 */
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    sq.n_slots = 2, sq.pos0 = 250; /* past n_ctx 256 */
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "context"));
    sq.pos0 = 0, sq.n_tokens = 0;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    sq.n_tokens = 8;
    uint32_t far[2] = {0, N_BLOCKS};
    sq.slots = far;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "arena"));
    uint32_t dup[2] = {3, 3};
    sq.slots = dup;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    /* two sequences writing the same block */
    struct fwd_seq two[2] = {
        {.tokens = tok, .n_tokens = 2, .pos0 = 0, .slots = slots, .n_slots = 1},
        {.tokens = tok, .n_tokens = 2, .pos0 = 0, .slots = slots, .n_slots = 1}};
    b.seqs = two, b.n_seqs = 2;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "written"));
    /* sharing a read-only prefix block is fine: both decode at pos 4..5 */
    uint32_t s0[2] = {0, 5}, s1[2] = {0, 6};
    two[0] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 4, .slots = s0, .n_slots = 2};
    two[1] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 4, .slots = s1, .n_slots = 2};
    assert_int_equal(model_forward(f->m, f->fc, &b), 0);
    memcpy(copy, f->arena, N_BLOCKS * f->block_bytes);
    /* one sequence writes block 5 (pos 4), the other reads it as a prefix */
    uint32_t s2[3] = {1, 5, 7};
    two[1] = (struct fwd_seq){.tokens = tok, .n_tokens = 1, .pos0 = 8, .slots = s2, .n_slots = 3};
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "slot 5 is written"));
    /* the reader first, the writer second: the same */
    struct fwd_seq sw = two[0];
    two[0] = two[1], two[1] = sw;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_non_null(strstr(fwd_ctx_errmsg(f->fc), "slot 5 is written"));
    /* too many tokens / sequences for the context */
    uint32_t many[200] = {0}, ms[64];
    for (int i = 0; i < 64; i++)
        ms[i] = (uint32_t)i;
    struct fwd_seq big = {.tokens = many, .n_tokens = 200, .pos0 = 0, .slots = ms, .n_slots = 50};
    b.seqs = &big, b.n_seqs = 1;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_ETOOLARGE);
    struct fwd_seq nine[9];
    for (int i = 0; i < 9; i++)
        nine[i] = (struct fwd_seq){
            .tokens = tok, .n_tokens = 1, .pos0 = 0, .slots = ms + i, .n_slots = 1};
    b.seqs = nine, b.n_seqs = 9;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_ETOOLARGE);
    struct kv_geom bad = f->geom;
    bad.head_dim++;
    b.seqs = &sq, b.n_seqs = 1, b.geom = &bad;
    sq.slots = slots;
    assert_int_equal(model_forward(f->m, f->fc, &b), KVD_EBADREQ);
    assert_memory_equal(copy, f->arena, N_BLOCKS * f->block_bytes);
    tfree(s);
    fx_free(f);
}

/* Greedy decoding on random models (untied and tied output) keeps
 * producing varied tokens: the generator's weight scales are sane. */
static void greedy_varied(void **state, const char *args)
{
    struct fx *f = t_fx(state);
    fx_init(f, args, KV_F16, 16, 2);
    uint32_t slots[8], tok = 1, seen[400] = {0}, distinct = 0;
    take_slots(f, slots, 8);
    float *lg = talloc(state, f->V * 4);
    for (uint32_t p = 0; p < 64; p++) {
        forward1(f, &tok, 1, p, slots, p / 16 + 1, lg);
        uint32_t best = 0;
        for (uint32_t i = 1; i < f->V; i++)
            best = lg[i] > lg[best] ? i : best;
        tok = best;
        distinct += !seen[tok]++;
    }
    print_message("  greedy: %u distinct tokens of 64\n", distinct);
    assert_true(distinct >= 8);
    tfree(state);
    fx_free(f);
}

static void t_greedy_varied(void **s)
{
    greedy_varied(
        s,
        "--embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 400 --layers 4 --type f16 --seed 12");
    greedy_varied(s, "--embd 128 --heads 4 --kv-heads 2 --ff 256 --vocab 400 --layers 4 --type "
                     "q8_0 --tied --seed 13");
}

/* ---- padded decode steps and the sample op ------------------------------ */

static const struct compute_ops *pad_base;
static uint32_t pad_max_rows, pad_calls;

static uint32_t pad_to_8(struct compute_ctx *cx, uint32_t n)
{
    (void)cx;
    pad_calls++;
    return 8;
}

static int pad_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x,
                      uint32_t rows, float *y)
{
    pad_max_rows = rows > pad_max_rows ? rows : pad_max_rows;
    return pad_base->matmul(cx, w, x, rows, y);
}

/* Three sequences decode six steps twice, in separate blocks: once as is,
 * once with every step padded to 8 sequences through step_bucket. Logits
 * agree to rounding (3 rows and 8 rows take different matmul kernels), the
 * sampled tokens (greedy, top-k, top-p rows) are equal, the padded run
 * really ran 8 rows, and no block outside the sequences' was written. */
static void t_padded_decode(void **st)
{
    struct fx *f = t_fx(st);
    fx_init(f, SHAPE " --type f16 --kv-heads 2 --seed 21", KV_F16, 8, 2);
    enum { NS = 3, STEPS = 6, BPS = 5 };
    static const uint32_t plen[NS] = {11, 4, 17};
    uint32_t tabs[2][NS][BPS], toks[NS][32], used[N_BLOCKS] = {0};
    for (int r = 0; r < 2; r++)
        for (int s = 0; s < NS; s++) {
            take_slots(f, tabs[r][s], BPS);
            for (uint32_t i = 0; i < (plen[s] + STEPS + 7) / 8; i++) /* blocks reached */
                used[tabs[r][s][i]] = 1;
        }
    for (int s = 0; s < NS; s++)
        for (uint32_t i = 0; i < plen[s]; i++)
            toks[s][i] = rnd(f->V);
    struct compute_ops padded = *f->m->ops;
    padded.step_bucket = pad_to_8;
    padded.matmul = pad_matmul;
    pad_base = f->m->ops;
    float *lg[2];
    for (int r = 0; r < 2; r++) {
        lg[r] = talloc(st, (size_t)NS * f->V * 4);
    }
    struct sample_row rows[NS] = {
        {.top_p = 1.0f},
        {.temperature = 0.9f, .top_k = 20, .top_p = 1.0f},
        {.temperature = 1.3f, .top_p = 0.9f},
    };
    for (uint32_t step = 0; step <= STEPS; step++) {
        uint32_t picks[2][NS];
        for (int r = 0; r < 2; r++) {
            struct fwd_seq seqs[NS];
            for (int s = 0; s < NS; s++) {
                uint32_t pos = step ? plen[s] + step - 1 : 0;
                seqs[s] = (struct fwd_seq){.tokens = step ? &toks[s][pos] : toks[s],
                                           .n_tokens = step ? 1 : plen[s],
                                           .pos0 = pos,
                                           .slots = tabs[r][s],
                                           .n_slots = BPS};
                rows[s].u = (double)((step * 7 + (uint32_t)s * 3) % 10) / 10.0 + 0.05;
            }
            struct fwd_batch b = {.seqs = seqs,
                                  .n_seqs = NS,
                                  .kv_arena = f->arena,
                                  .geom = &f->geom,
                                  .n_arena_slots = N_BLOCKS,
                                  .logits = lg[r],
                                  .sample = rows,
                                  .tokens = picks[r]};
            pad_max_rows = 0;
            f->m->ops = r ? &padded : pad_base;
            int rc = model_forward(f->m, f->fc, &b);
            f->m->ops = pad_base;
            if (rc)
                fail_msg("model_forward (%s): %s", r ? "padded" : "as is", fwd_ctx_errmsg(f->fc));
            if (r && step)
                assert_int_equal(pad_max_rows, 8);
        }
        for (size_t i = 0; i < (size_t)NS * f->V; i++)
            if (!(fabsf(lg[0][i] - lg[1][i]) <= 1e-4f * (1 + fabsf(lg[0][i]))))
                fail_msg("step %u logit %zu: as is %.9g, padded %.9g", step, i, (double)lg[0][i],
                         (double)lg[1][i]);
        for (int s = 0; s < NS; s++) {
            assert_int_equal(picks[0][s], picks[1][s]);
            uint32_t best = 0;
            for (uint32_t i = 1; i < f->V; i++)
                best = lg[0][(size_t)s * f->V + i] > lg[0][(size_t)s * f->V + best] ? i : best;
            if (s == 0)
                assert_int_equal(picks[0][s], best);
            toks[s][plen[s] + step] = picks[0][s];
        }
    }
    assert_int_equal(pad_calls, STEPS); /* decode steps only, not the prefill */
    for (uint32_t blk = 0; blk < N_BLOCKS; blk++) {
        if (used[blk])
            continue;
        const uint8_t *p = (const uint8_t *)f->arena + (size_t)blk * f->block_bytes;
        for (size_t i = 0; i < f->block_bytes; i++)
            if (p[i])
                fail_msg("block %u, outside every sequence, was written", blk);
    }
    tfree(st);
    fx_free(f);
}

/* One value of a weight made non-finite in the file: the load is refused
 * naming the tensor, for a float type and for a quantized block's scale. */
static void corrupt_and_load(const char *args, size_t at_in_tensor, const void *bytes, size_t n)
{
    char *path = ref_gen_model(args);
    assert_non_null(path);
    char err[256] = "";
    struct gguf *g = NULL;
    assert_int_equal(gguf_open(path, &g, err, sizeof err), 0);
    const struct gguf_tensor *t = gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_non_null(t);
    off_t at = (off_t)(g->data_offset + t->offset + at_in_tensor);
    gguf_close(g);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseeko(f, at, SEEK_SET), 0);
    assert_int_equal(fwrite(bytes, 1, n, f), n);
    fclose(f);
    struct model *m = NULL;
    struct kvd_error merr = {0};
    int rc = model_load(path, ref_cpu_backend(), &m, &merr);
    unlink(path);
    free(path);
    assert_int_equal(rc, KVD_EBADREQ);
    assert_int_equal(merr.code, KVD_EBADREQ);
    assert_null(m);
    if (!strstr(merr.message, "blk.0.attn_q.weight") || !strstr(merr.message, "NaN or an infinity"))
        fail_msg("unexpected error: %s", merr.message);
}

static void t_non_finite_weights(void **state)
{
    (void)state;
    const float nan_f = NAN;
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type f32",
                     4 * 17, &nan_f, 4);
    const uint16_t inf_h = 0x7c00;
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type f16",
                     2 * 5, &inf_h, 2);
    corrupt_and_load("--layers 1 --embd 64 --heads 4 --kv-heads 2 --ff 128 --vocab 64 --type q4_0",
                     18, &inf_h, 2); /* the second block's d */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(t_llama_f32_mha, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_llama_f16_gqa, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_llama_bf16_tied_freqs, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_llama_q8_0_gqa, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_qwen2_f16_tied, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_qwen2_q8_0_freqs, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_llama_bf16_f32kv_mha, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_scalar_kernels, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_threads_agree, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_llamacpp_rows_alone, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_trace, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_validation, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_greedy_varied, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_wide_heads, t_setup, t_teardown),
        cmocka_unit_test_setup_teardown(t_padded_decode, t_setup, t_teardown),
        cmocka_unit_test(t_non_finite_weights),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

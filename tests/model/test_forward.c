/* The paged, batched forward against the dense reference (model_ref.c) on
 * random models: llama and qwen2, every weight type, GQA and MHA, tied and
 * untied, rope_freqs; one-chunk prefill, chunked prefill, token-by-token
 * decode and multi-sequence batches with scattered block tables must all
 * give the reference's last-position logits to 1e-4 relative; the scratch
 * charged as allocated, the scalar kernels, llama.cpp's arithmetic, the
 * per-op trace, and thread counts that agree. Bad batches, greedy decoding
 * and padded decode steps: test_forward_steps.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "forward_fixture.h"

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
        tok[i] = fx_rnd(f->V);
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
            stok[s][i] = s == 0 ? tok[i] : fx_rnd(f->V);
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
            fx_seed(777 + (uint64_t)mi);
            for (int i = 0; i < N; i++)
                tok[i] = fx_rnd(V);
            for (int i = 0; i < 11; i++)
                other[i] = fx_rnd(V);
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
        cmocka_unit_test_setup_teardown(t_wide_heads, t_setup, t_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

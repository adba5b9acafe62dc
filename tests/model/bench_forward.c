/* bench_forward: forward-pass throughput on the cpu backend (a program that
 * prints numbers, not a test). Default model: 134M parameters, 85M outside the
 * embedding and output matrices (12 layers, embd 768, 12 heads, ff 2048,
 * vocab 32000), generated with kvd-gguf-gen.
 * Prints prefill tokens/s of a 512-token prompt, batch-1 decode tokens/s and
 * the aggregate decode tokens/s of 16 concurrent sequences.
 * usage: bench_forward [--type f16|q8_0|bf16|f32] [--threads N] [--model FILE]
 *                      [--gen N] [--kv f16|bf16|f32] [--prefill 0|1] [--b1 0|1]
 *                      [--streams 0|1] [--verify 0|1]
 * --verify 1: the cost of speculative verification steps: cpu ms per step
 * of B sequences (1, 2, 4, 8) each computing 1 + k rows (k drafts, 0..8,
 * every row's logits), at a 256-token context; printed as the ratio to a
 * plain decode step of B sequences (k = 0). With acceptance a, k drafts
 * give (1 - a^(k+1)) / (1 - a) tokens per step, so speculation pays at
 * batch B when that exceeds the ratio.
 * (--prefill 0 / --b1 0 / --streams 0 skip the prefill, the batch-1 or the
 * 16-stream part, e.g. to profile one of them). The
 * last line is machine-readable: "RESULT b1_tok_s= b1_cpu_ms= b16_tok_s= b16_cpu_ms_step=". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "model/model_ref.h"

#define PROMPT 512
#define STREAMS 16
#define BT 16

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU seconds of the whole process: with --threads 1 this is the work done,
 * unaffected by other load on a shared machine. */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint32_t argmax(const float *v, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        b = v[i] > v[b] ? i : b;
    return b;
}

int main(int argc, char **argv)
{
    const char *type = "f16", *model_path = NULL;
    uint32_t threads = 0, gen = 64, do_prefill = 1, do_b1 = 1, do_b16 = 1, do_verify = 0;
    enum kv_dtype kvt = KV_F16;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--type"))
            type = argv[i + 1];
        else if (!strcmp(argv[i], "--threads"))
            threads = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--model"))
            model_path = argv[i + 1];
        else if (!strcmp(argv[i], "--gen"))
            gen = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prefill"))
            do_prefill = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--streams"))
            do_b16 = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--b1"))
            do_b1 = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--verify"))
            do_verify = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv"))
            kvt = !strcmp(argv[i + 1], "f32")    ? KV_F32
                  : !strcmp(argv[i + 1], "bf16") ? KV_BF16
                                                 : KV_F16;
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    char *gen_path = NULL, args[256];
    if (gen == 0)
        gen = 1;
    if (!model_path) {
        snprintf(args, sizeof args,
                 "--layers 12 --embd 768 --heads 12 --ff 2048 --vocab 32000 "
                 "--ctx 4096 --type %s --seed 42",
                 type);
        gen_path = ref_gen_model(args);
        if (!gen_path) {
            fprintf(stderr, "kvd-gguf-gen failed (set KVD_TOOLS_DIR)\n");
            return 1;
        }
        model_path = gen_path;
    }
    struct model *m;
    struct model_opts mo = {.n_threads = threads};
    struct kvd_error err = {0};
    if (model_load_opts(model_path, ref_cpu_backend(), &mo, &m, &err)) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    const struct model_hparams *hp = model_hparams(m);
    if (!threads)
        threads = (uint32_t)sysconf(_SC_NPROCESSORS_ONLN);
    printf(
        "model: %s %s, %u layers, embd %u, heads %u/%u, ff %u, vocab %u, %.1fM params, %.1f MiB, "
        "%u threads, kv %s\n",
        hp->arch, ctype_name(hp->wtype), hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv,
        hp->n_ff, hp->n_vocab, hp->n_params / 1e6, hp->weight_bytes / 1048576.0, threads,
        kvt == KV_F16    ? "f16"
        : kvt == KV_BF16 ? "bf16"
                         : "f32");

    struct kv_geom g;
    model_kv_geom(m, BT, kvt, &g);
    uint32_t per_seq = (PROMPT + gen + BT) / BT + 1, n_blocks = per_seq * STREAMS;
    size_t bb = (size_t)g.layers * 2 * g.kv_heads * BT * g.head_dim * (kvt == KV_F32 ? 4 : 2);
    void *arena = calloc(n_blocks, bb);
    float *logits = malloc((size_t)PROMPT * hp->n_vocab * 4);
    struct fwd_ctx *fc;
    if (!arena || !logits || fwd_ctx_new_out(m, PROMPT, STREAMS, PROMPT, &fc)) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    uint32_t *slots = malloc(n_blocks * 4), *prompt = malloc(PROMPT * 4);
    for (uint32_t i = 0; i < n_blocks; i++)
        slots[i] = i;
    for (uint32_t i = 0; i < PROMPT; i++)
        prompt[i] = 1 + (i * 7919) % (hp->n_vocab - 1);

    /* prefill: one 512-token chunk (twice; the second is timed) */
    struct fwd_seq s = {
        .tokens = prompt, .n_tokens = PROMPT, .pos0 = 0, .slots = slots, .n_slots = per_seq};
    struct fwd_batch b = {.seqs = &s,
                          .n_seqs = 1,
                          .kv_arena = arena,
                          .geom = &g,
                          .n_arena_slots = n_blocks,
                          .logits = logits};
    double t0, c0;
    if (do_prefill) {
        model_forward(m, fc, &b);
        t0 = now(), c0 = cpu_now();
        if (model_forward(m, fc, &b)) {
            fprintf(stderr, "%s\n", fwd_ctx_errmsg(fc));
            return 1;
        }
        double t_prefill = now() - t0;
        printf("prefill %u tokens: %.1f tokens/s (%.1f ms, %.1f cpu ms)\n", PROMPT,
               PROMPT / t_prefill, t_prefill * 1e3, (cpu_now() - c0) * 1e3);
    }

    /* batch-1 decode after a 16-token prompt */
    s.n_tokens = 16;
    if (model_forward(m, fc, &b)) {
        fprintf(stderr, "%s\n", fwd_ctx_errmsg(fc));
        return 1;
    }
    uint32_t tok = argmax(logits, hp->n_vocab);
    tok = argmax(logits, hp->n_vocab);
    t0 = now(), c0 = cpu_now();
    for (uint32_t i = 0; i < (do_b1 ? gen : 0); i++) {
        s = (struct fwd_seq){
            .tokens = &tok, .n_tokens = 1, .pos0 = 16 + i, .slots = slots, .n_slots = per_seq};
        model_forward(m, fc, &b);
        tok = argmax(logits, hp->n_vocab);
    }
    double t1 = now() - t0, c1 = (cpu_now() - c0) * 1e3 / gen;
    if (do_b1)
        printf("decode batch 1: %.1f tokens/s (%.2f ms/token, %.2f cpu ms/token)\n", gen / t1,
               t1 * 1e3 / gen, c1);
    if (do_verify) {
        /* B sequences with a 256-token context (16 prompt tokens each,
         * re-run at positions 240..), each step 1 + k rows per sequence */
        enum { CTX = 256, REPS = 12 };
        struct fwd_seq vs[8];
        uint32_t vt[8][9];
        for (uint32_t q = 0; q < 8; q++)
            for (uint32_t j = 0; j < 9; j++)
                vt[q][j] = 1 + (q * 131 + j * 7919) % (hp->n_vocab - 1);
        for (uint32_t B = 1; B <= 8; B *= 2) {
            double base = 0;
            for (uint32_t k = 0; k <= 8; k++) {
                for (uint32_t q = 0; q < B; q++)
                    vs[q] = (struct fwd_seq){.tokens = vt[q],
                                             .n_tokens = 1 + k,
                                             .pos0 = CTX - 16,
                                             .slots = slots + q * per_seq,
                                             .n_slots = per_seq,
                                             .all_rows = k > 0};
                struct fwd_batch vb = b;
                vb.seqs = vs;
                vb.n_seqs = B;
                if (model_forward(m, fc, &vb)) {
                    fprintf(stderr, "%s\n", fwd_ctx_errmsg(fc));
                    return 1;
                }
                double cs = cpu_now();
                for (uint32_t i = 0; i < REPS; i++)
                    model_forward(m, fc, &vb);
                double ms = (cpu_now() - cs) * 1e3 / REPS;
                if (k == 0)
                    base = ms;
                printf("verify batch %u, 1 + %u rows each: %.2f cpu ms/step, %.2fx a decode "
                       "step\n",
                       B, k, ms, ms / base);
            }
        }
    }
    double t16 = 0, c16 = 0;
    if (!do_b16)
        goto done;

    /* 16 streams: prefill 16 tokens each in one step, then decode together */
    struct fwd_seq seqs[STREAMS];
    uint32_t toks[STREAMS];
    for (uint32_t k = 0; k < STREAMS; k++)
        seqs[k] = (struct fwd_seq){.tokens = prompt + k * 16,
                                   .n_tokens = 16,
                                   .pos0 = 0,
                                   .slots = slots + k * per_seq,
                                   .n_slots = per_seq};
    b.seqs = seqs;
    b.n_seqs = STREAMS;
    if (model_forward(m, fc, &b)) {
        fprintf(stderr, "%s\n", fwd_ctx_errmsg(fc));
        return 1;
    }
    for (uint32_t k = 0; k < STREAMS; k++)
        toks[k] = argmax(logits + (size_t)k * hp->n_vocab, hp->n_vocab);
    t0 = now(), c0 = cpu_now();
    for (uint32_t i = 0; i < gen; i++) {
        for (uint32_t k = 0; k < STREAMS; k++)
            seqs[k] = (struct fwd_seq){.tokens = &toks[k],
                                       .n_tokens = 1,
                                       .pos0 = 16 + i,
                                       .slots = slots + k * per_seq,
                                       .n_slots = per_seq};
        model_forward(m, fc, &b);
        for (uint32_t k = 0; k < STREAMS; k++)
            toks[k] = argmax(logits + (size_t)k * hp->n_vocab, hp->n_vocab);
    }
    t16 = now() - t0;
    c16 = (cpu_now() - c0) * 1e3 / gen;
    printf("decode %u streams: %.1f tokens/s aggregate (%.2f ms/step, %.2f cpu ms/step), %.2fx "
           "batch 1\n",
           STREAMS, STREAMS * gen / t16, t16 * 1e3 / gen, c16, (STREAMS * gen / t16) / (gen / t1));
done:
    printf("RESULT b1_tok_s=%.2f b1_cpu_ms=%.3f b16_tok_s=%.2f b16_cpu_ms_step=%.3f\n", gen / t1,
           c1, t16 > 0 ? STREAMS * gen / t16 : 0.0, c16);
    fwd_ctx_free(fc);
    model_free(m);
    free(arena);
    free(logits);
    free(slots);
    free(prompt);
    if (gen_path) {
        unlink(gen_path);
        free(gen_path);
    }
    return 0;
}

/* bench_kv_dtype: what a quantized KV cache costs and buys (a program that
 * prints numbers, not a test).
 *
 * 1. Memory: KV bytes per token and block for f16, q8_0 and fp8 (and f32,
 *    bf16) for a few real model shapes, and how many 4096-token sequences
 *    fit in a fixed 16 GiB pool (16-token blocks).
 * 2. Greedy tokens: N prompts (default 200, random lengths 8..64 of random
 *    ids) continued greedily for G tokens (default 32) on the cpu backend by
 *    a random model from kvd-gguf-gen, once per KV dtype; each dtype's tokens
 *    are compared with the f16 KV run: identical tokens (position by
 *    position), sequences identical to the end, and where the first
 *    divergence falls. f32 against f16 is the control: how much f16 itself
 *    moves the tokens.
 *
 * usage: bench_kv_dtype [--prompts N] [--gen G] [--threads T] [--model FILE]
 *                       [--gen-args "kvd-gguf-gen arguments"]
 * The last lines are machine-readable: "RESULT dtype= same_tokens= same_seqs=". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"
#include "model/model_ref.h"

#define BT 16
#define BATCH 16
#define MAXP 64

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)((rng >> 11) % n);
}

static uint32_t argmax(const float *v, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        b = v[i] > v[b] ? i : b;
    return b;
}

static const enum kv_dtype DTS[] = {KV_F16, KV_F32, KV_BF16, KV_Q8_0, KV_FP8};
#define NDT (sizeof DTS / sizeof DTS[0])

static void memory_table(void)
{
    static const struct {
        const char *name;
        uint32_t layers, kv_heads, head_dim;
    } shapes[] = {
        {"Llama-3.1-8B", 32, 8, 128},
        {"Qwen2.5-7B", 28, 4, 128},
        {"Llama-3.2-1B", 16, 8, 64},
        {"Qwen2.5-0.5B", 24, 2, 64},
    };
    const double pool = 16.0 * (1ull << 30);
    printf("KV memory, %u-token blocks, 4096-token sequences in a 16 GiB pool:\n", BT);
    printf("%-14s %-5s %12s %12s %10s %8s\n", "model", "dtype", "bytes/token", "block bytes",
           "seqs@4k", "vs f16");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        uint64_t f16_seqs = 0;
        for (size_t d = 0; d < NDT; d++) {
            struct kv_geom g = {.layers = shapes[s].layers,
                                .kv_heads = shapes[s].kv_heads,
                                .head_dim = shapes[s].head_dim,
                                .dtype = DTS[d],
                                .block_tokens = BT};
            size_t bb = kv_block_bytes(&g);
            uint64_t blocks = (uint64_t)(pool / (double)bb), seqs = blocks / (4096 / BT);
            if (DTS[d] == KV_F16)
                f16_seqs = seqs;
            printf("%-14s %-5s %12zu %12zu %10llu %7.3fx\n", shapes[s].name, kv_dtype_name(DTS[d]),
                   kv_token_bytes(&g), bb, (unsigned long long)seqs,
                   f16_seqs ? (double)seqs / (double)f16_seqs : 0.0);
        }
    }
}

/* Greedy continuations of every prompt with KV dtype dt: out[p][G]. */
static int run(struct model *m, enum kv_dtype dt, uint32_t n_prompts, uint32_t gen,
               uint32_t *const *prompts, const uint32_t *plen, uint32_t *out)
{
    const struct model_hparams *hp = model_hparams(m);
    struct kv_geom g;
    model_kv_geom(m, BT, dt, &g);
    uint32_t per_seq = (MAXP + gen + BT - 1) / BT, n_blocks = per_seq * BATCH;
    void *arena = calloc(n_blocks, kv_block_bytes(&g));
    float *logits = malloc((size_t)BATCH * hp->n_vocab * 4);
    uint32_t *slots = malloc(n_blocks * 4), tok[BATCH];
    struct fwd_ctx *fc;
    if (!arena || !logits || !slots || fwd_ctx_new(m, BATCH * MAXP, BATCH, &fc))
        return -1;
    for (uint32_t i = 0; i < n_blocks; i++)
        slots[i] = i;
    struct fwd_seq seqs[BATCH];
    struct fwd_batch b = {
        .seqs = seqs, .kv_arena = arena, .geom = &g, .n_arena_slots = n_blocks, .logits = logits};
    for (uint32_t p0 = 0; p0 < n_prompts; p0 += BATCH) {
        uint32_t nb = n_prompts - p0 < BATCH ? n_prompts - p0 : BATCH;
        b.n_seqs = nb;
        for (uint32_t k = 0; k < nb; k++)
            seqs[k] = (struct fwd_seq){.tokens = prompts[p0 + k],
                                       .n_tokens = plen[p0 + k],
                                       .pos0 = 0,
                                       .slots = slots + k * per_seq,
                                       .n_slots = per_seq};
        for (uint32_t i = 0; i < gen; i++) {
            if (model_forward(m, fc, &b)) {
                fprintf(stderr, "%s\n", fwd_ctx_errmsg(fc));
                return -1;
            }
            for (uint32_t k = 0; k < nb; k++) {
                tok[k] = argmax(logits + (size_t)k * hp->n_vocab, hp->n_vocab);
                out[(size_t)(p0 + k) * gen + i] = tok[k];
                uint32_t pos = plen[p0 + k] + i;
                seqs[k] = (struct fwd_seq){.tokens = &tok[k],
                                           .n_tokens = 1,
                                           .pos0 = pos,
                                           .slots = slots + k * per_seq,
                                           .n_slots = per_seq};
            }
        }
    }
    fwd_ctx_free(fc);
    free(arena), free(logits), free(slots);
    return 0;
}

int main(int argc, char **argv)
{
    uint32_t n_prompts = 200, gen = 32, threads = 2;
    const char *model_path = NULL;
    const char *gen_args = "--layers 4 --embd 512 --heads 8 --kv-heads 4 --ff 1024 --vocab 4096 "
                           "--ctx 512 --type f16 --seed 7";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--prompts"))
            n_prompts = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--gen"))
            gen = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            threads = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--model"))
            model_path = argv[i + 1];
        else if (!strcmp(argv[i], "--gen-args"))
            gen_args = argv[i + 1];
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (n_prompts == 0 || gen == 0) {
        fprintf(stderr, "--prompts and --gen must be at least 1\n");
        return 2;
    }
    memory_table();

    char *gen_path = NULL;
    if (!model_path) {
        gen_path = ref_gen_model(gen_args);
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
    printf("\ngreedy tokens vs f16 KV: %s %s, %u layers, embd %u, heads %u/%u (head_dim %u), "
           "vocab %u; %u prompts of 8..%u tokens, %u tokens each\n",
           hp->arch, ctype_name(hp->wtype), hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv,
           hp->head_dim, hp->n_vocab, n_prompts, MAXP, gen);
    uint32_t **prompts = malloc(n_prompts * sizeof *prompts), *plen = malloc(n_prompts * 4);
    for (uint32_t p = 0; p < n_prompts; p++) {
        plen[p] = 8 + rnd(MAXP - 8 + 1);
        prompts[p] = malloc(plen[p] * 4);
        for (uint32_t i = 0; i < plen[p]; i++)
            prompts[p][i] = rnd(hp->n_vocab);
    }
    uint32_t *toks[NDT];
    for (size_t d = 0; d < NDT; d++) {
        toks[d] = malloc((size_t)n_prompts * gen * 4);
        if (kv_row_bytes(DTS[d], hp->head_dim) == 0 ||
            run(m, DTS[d], n_prompts, gen, prompts, plen, toks[d])) {
            fprintf(stderr, "%s KV: cannot run (head_dim %u)\n", kv_dtype_name(DTS[d]),
                    hp->head_dim);
            return 1;
        }
    }
    printf("%-5s %10s %10s   first divergence (prompts): %6s %6s %6s %6s %6s %6s\n", "dtype",
           "same tok", "same seq", "0", "1-3", "4-7", "8-15", "16-31", ">=32");
    for (size_t d = 1; d < NDT; d++) {
        uint64_t same = 0, same_seq = 0, hist[6] = {0};
        for (uint32_t p = 0; p < n_prompts; p++) {
            const uint32_t *a = toks[0] + (size_t)p * gen, *x = toks[d] + (size_t)p * gen;
            uint32_t first = gen;
            for (uint32_t i = 0; i < gen; i++) {
                same += a[i] == x[i];
                if (a[i] != x[i] && first == gen)
                    first = i;
            }
            if (first == gen) {
                same_seq++;
                continue;
            }
            hist[first == 0   ? 0
                 : first < 4  ? 1
                 : first < 8  ? 2
                 : first < 16 ? 3
                 : first < 32 ? 4
                              : 5]++;
        }
        printf("%-5s %9.2f%% %9.2f%%   %*s %6llu %6llu %6llu %6llu %6llu %6llu\n",
               kv_dtype_name(DTS[d]), 100.0 * same / ((double)n_prompts * gen),
               100.0 * same_seq / n_prompts, 27, "", (unsigned long long)hist[0],
               (unsigned long long)hist[1], (unsigned long long)hist[2],
               (unsigned long long)hist[3], (unsigned long long)hist[4],
               (unsigned long long)hist[5]);
    }
    for (size_t d = 1; d < NDT; d++) {
        uint64_t same = 0, same_seq = 0;
        for (uint32_t p = 0; p < n_prompts; p++) {
            uint32_t eq = 0;
            for (uint32_t i = 0; i < gen; i++)
                eq += toks[0][(size_t)p * gen + i] == toks[d][(size_t)p * gen + i];
            same += eq;
            same_seq += eq == gen;
        }
        printf("RESULT dtype=%s same_tokens=%.4f same_seqs=%.4f\n", kv_dtype_name(DTS[d]),
               (double)same / ((double)n_prompts * gen), (double)same_seq / n_prompts);
    }
    for (size_t d = 0; d < NDT; d++)
        free(toks[d]);
    for (uint32_t p = 0; p < n_prompts; p++)
        free(prompts[p]);
    free(prompts), free(plen);
    model_free(m);
    if (gen_path) {
        unlink(gen_path);
        free(gen_path);
    }
    return 0;
}

/* kvd-llamacpp-dump: runs a GGUF through llama.cpp's C API (the libraries
 * node-llama-cpp ships) as test_llamacpp's node script does, and writes every
 * intermediate tensor its eval callback sees to a file, for kvd-trace-cmp to
 * compare with kvd's own forward pass op by op (docs/quant.md).
 *
 *   kvd-llamacpp-dump LIBDIR MODEL.gguf OUT N_GEN TOKEN...
 *
 * LIBDIR holds libggml-cpu-*.so (the variant llama.cpp picks for this cpu is
 * loaded, as node-llama-cpp does; its path goes to stderr). The prompt is one
 * batch (a token per batch with $KVD_LLAMACPP_UBATCH set: every row then
 * takes llama.cpp's one-row path), then N_GEN greedy tokens one at a time (2 threads, 256-token
 * context, flash attention "auto", f16 KV: node-llama-cpp's settings; f32
 * KV with $KVD_LLAMACPP_KV_F32 set);
 * stdout gets the generated tokens. OUT holds records: u32 eval (the
 * llama_decode call, from 0), u32 name length, the name, u32 n_dims,
 * i64 ne[4], then ne0*ne1*ne2*ne3 f32 values (f16 tensors widened; a
 * non-contiguous tensor is skipped); the logits of each eval as "logits". */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

struct dump {
    FILE *f;
    uint32_t eval;
    float *buf;
    size_t cap;
};

static void put(struct dump *d, const char *name, const int64_t ne[4], const float *v)
{
    uint32_t hdr[3] = {d->eval, (uint32_t)strlen(name), 4};
    size_t n = (size_t)(ne[0] * ne[1] * ne[2] * ne[3]);
    fwrite(hdr, 4, 2, d->f);
    fwrite(name, 1, hdr[1], d->f);
    fwrite(&hdr[2], 4, 1, d->f);
    fwrite(ne, 8, 4, d->f);
    fwrite(v, 4, n, d->f);
}

/* The scheduler asks (ask) whether a node is wanted, computes the graph up
 * to it, then shows it. RMS_NORM is not asked for: a graph cut after it would
 * keep the cpu backend from fusing it with the MUL that follows (the fused
 * node's output is the one named attn_norm / ffn_norm). */
static bool on_eval(struct ggml_tensor *t, bool ask, void *ud)
{
    struct dump *d = ud;
    if (ask)
        return t->op != GGML_OP_RMS_NORM;
    if (!ggml_is_contiguous(t) || (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16))
        return true;
    size_t n = (size_t)ggml_nelements(t);
    if (n > d->cap) {
        free(d->buf);
        d->cap = n;
        d->buf = malloc(n * 4 * 2);
    }
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_get(t, d->buf, 0, n * 4);
    } else {
        uint16_t *h = (uint16_t *)(d->buf + n);
        ggml_backend_tensor_get(t, h, 0, n * 2);
        for (size_t i = 0; i < n; i++)
            d->buf[i] = ggml_fp16_to_fp32(h[i]);
    }
    char name[GGML_MAX_NAME + 32];
    snprintf(name, sizeof name, "%s %s", t->name, ggml_op_desc(t));
    put(d, name, t->ne, d->buf);
    return true;
}

static void print_cpu_variant(void)
{
    FILE *m = fopen("/proc/self/maps", "r");
    char line[4096], last[4096] = "";
    while (m && fgets(line, sizeof line, m)) {
        char *p = strstr(line, "libggml-cpu");
        if (p && strcmp(p, last)) {
            snprintf(last, sizeof last, "%s", p);
            fprintf(stderr, "cpu backend: %s", strchr(line, '/') ? strchr(line, '/') : p);
        }
    }
    if (m)
        fclose(m);
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: %s LIBDIR MODEL.gguf OUT N_GEN TOKEN...\n", argv[0]);
        return 2;
    }
    ggml_backend_load_all_from_path(argv[1]);
    llama_backend_init();
    struct dump d = {.f = fopen(argv[3], "wb")};
    if (!d.f) {
        perror(argv[3]);
        return 1;
    }
    int n_gen = atoi(argv[4]), n_prompt = argc - 5;
    llama_token *toks = malloc(sizeof *toks * (size_t)(n_prompt + n_gen + 1));
    for (int i = 0; i < n_prompt; i++)
        toks[i] = atoi(argv[5 + i]);
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[2], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[2]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 256;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.no_perf = true;
    cp.swa_full = false;
    if (getenv("KVD_LLAMACPP_KV_F32"))
        cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.cb_eval = on_eval;
    cp.cb_eval_user_data = &d;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    print_cpu_variant();
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    /* the prompt as one batch, or ($KVD_LLAMACPP_UBATCH) a token at a time */
    int n_pre = getenv("KVD_LLAMACPP_UBATCH") ? n_prompt : 1, e = 0;
    llama_token *cur = toks;
    int n_cur = n_prompt / n_pre;
    for (int g = 0; g < n_gen; e++) {
        d.eval = (uint32_t)e;
        if (llama_decode(ctx, llama_batch_get_one(cur, n_cur))) {
            fprintf(stderr, "decode failed at eval %d\n", e);
            return 1;
        }
        const float *lg = llama_get_logits_ith(ctx, -1);
        int64_t ne[4] = {n_vocab, 1, 1, 1};
        put(&d, "logits", ne, lg);
        n_cur = 1;
        if (e + 1 < n_pre) {
            cur++;
            continue;
        }
        int best = 0;
        for (int j = 1; j < n_vocab; j++)
            best = lg[j] > lg[best] ? j : best;
        cur = toks + n_prompt + g;
        *cur = best;
        printf("%s%d", g++ ? " " : "", best);
    }
    printf("\n");
    fclose(d.f);
    llama_free(ctx);
    llama_model_free(model);
    free(toks);
    free(d.buf);
    return 0;
}

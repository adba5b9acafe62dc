/* kvd-trace-cmp: runs a GGUF through kvd's cpu forward pass with a trace
 * (fwd_ctx_set_trace) and compares every op's output with the tensor of the
 * same name that kvd-llamacpp-dump wrote for llama.cpp, op by op.
 *
 *   kvd-trace-cmp MODEL.gguf DUMP MODE TOKEN...     (MODE: follow | inject)
 *
 * The prompt TOKENs are one step (one step each with $KVD_LLAMACPP_UBATCH
 * set, as the dump was then made), then llama.cpp's greedy tokens (argmax
 * of the dump's logits) one step each, so both run the same sequence. follow:
 * kvd runs on its own values (differences add up as in a real run). inject:
 * after each comparison kvd's output is replaced by llama.cpp's, so every op
 * starts from llama.cpp's inputs and a difference is that op's own
 * arithmetic. Per op: the rows compared, the values that differ in any bit,
 * the largest absolute difference and it over the largest |value|; then a
 * summary per op name over all layers and steps. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd/status.h"
#include "model.h"

struct rec {
    uint32_t eval;
    char name[96]; /* "attn_norm-0 MUL" */
    int64_t ne[4];
    float *v;
    int used;
};

static struct rec *recs;
static size_t n_recs;

static int load_dump(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t cap = 0;
    uint32_t hdr[2];
    int prev_kqv = -1; /* the layer of the last kqv_out record, until its projection */
    while (fread(hdr, 4, 2, f) == 2) {
        if (n_recs == cap) {
            cap = cap ? cap * 2 : 1024;
            recs = realloc(recs, cap * sizeof *recs);
        }
        struct rec *r = &recs[n_recs];
        memset(r, 0, sizeof *r);
        uint32_t nd, nl = hdr[1] < sizeof r->name - 1 ? hdr[1] : sizeof r->name - 1;
        r->eval = hdr[0];
        if (fread(r->name, 1, nl, f) != nl || fseek(f, (long)(hdr[1] - nl), SEEK_CUR) ||
            fread(&nd, 4, 1, f) != 1 || fread(r->ne, 8, 4, f) != 4)
            break;
        size_t n = (size_t)(r->ne[0] * r->ne[1] * r->ne[2] * r->ne[3]);
        r->v = malloc(n * 4);
        if (fread(r->v, 4, n, f) != n)
            break;
        /* the output projection's result has no name of its own: the first
         * MUL_MAT after a layer's kqv_out */
        if (!strncmp(r->name, "kqv_out-", 8))
            prev_kqv = atoi(r->name + 8);
        else if (prev_kqv >= 0 && strstr(r->name, " MUL_MAT")) {
            snprintf(r->name, sizeof r->name, "attn_wo-%d MUL_MAT", prev_kqv);
            prev_kqv = -1;
        }
        n_recs++;
    }
    fclose(f);
    return 0;
}

/* kvd's trace name -> the dump's node name and op */
static void dump_name(const char *name, int layer, char *out, size_t n)
{
    static const struct {
        const char *kvd, *op;
    } ops[] = {{"embd", "GET_ROWS"},  {"attn_norm", "MUL"},     {"Qcur", "MUL_MAT"},
               {"Kcur", "MUL_MAT"},   {"Vcur", "MUL_MAT"},      {"Qcur.bias", "ADD"},
               {"Kcur.bias", "ADD"},  {"Vcur.bias", "ADD"},     {"Qcur.rope", "ROPE"},
               {"Kcur.rope", "ROPE"}, {"kqv_out", "RESHAPE"},   {"attn_wo", "MUL_MAT"},
               {"ffn_inp", "ADD"},    {"ffn_norm", "MUL"},      {"ffn_gate", "MUL_MAT"},
               {"ffn_up", "MUL_MAT"}, {"ffn_swiglu", "SWIGLU"}, {"ffn_out", "MUL_MAT"},
               {"l_out", "ADD"},      {"result_norm", "MUL"},   {"result_output", "MUL_MAT"}};
    const char *op = "?";
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (!strcmp(ops[i].kvd, name))
            op = ops[i].op;
    size_t base = strcspn(name, ".");
    if (layer >= 0)
        snprintf(out, n, "%.*s-%d %s", (int)base, name, layer, op);
    else
        snprintf(out, n, "%.*s %s", (int)base, name, op);
}

#define N_SUM 32
static struct {
    char name[32];
    long tensors, differing;
    double max_rel;
} sums[N_SUM];

static struct run {
    uint32_t eval;
    int inject;
    int verbose;
    FILE *out; /* $KVD_TRACE_OUT: kvd's tensors, in the dump's format */
} run;

static int on_trace(void *ud, const char *name, int layer, float *v, uint32_t rows, uint32_t cols)
{
    (void)ud;
    char want[96];
    dump_name(name, layer, want, sizeof want);
    if (run.out) {
        uint32_t hdr[3] = {run.eval, (uint32_t)strlen(want), 2};
        int64_t ne[4] = {cols, rows, 1, 1};
        fwrite(hdr, 4, 2, run.out);
        fwrite(want, 1, hdr[1], run.out);
        fwrite(&hdr[2], 4, 1, run.out);
        fwrite(ne, 8, 4, run.out);
        fwrite(v, 4, (size_t)rows * cols, run.out);
    }
    struct rec *r = NULL;
    for (size_t i = 0; i < n_recs && !r; i++)
        if (recs[i].eval == run.eval && !recs[i].used && !strcmp(recs[i].name, want))
            r = &recs[i];
    if (!r) {
        if (run.verbose)
            printf("  eval %u %-22s not in the dump\n", run.eval, want);
        return 0;
    }
    r->used = 1;
    size_t rcols = (size_t)r->ne[0], rrows = (size_t)(r->ne[1] * r->ne[2] * r->ne[3]);
    if (rcols * rrows % cols == 0 && rcols != cols) {
        rrows = rcols * rrows / cols;
        rcols = cols;
    }
    if (rcols != cols || (rrows != rows && rrows != 1)) {
        printf("  eval %u %-22s shape: kvd %u x %u, llama.cpp %zu x %zu\n", run.eval, want, rows,
               cols, rrows, rcols);
        return 0;
    }
    float *kv = v + (size_t)(rows - rrows) * cols; /* llama.cpp keeps only the last row */
    size_t n = rrows * cols, nd = 0;
    double maxd = 0, maxr = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)kv[i] - r->v[i]);
        nd += memcmp(&kv[i], &r->v[i], 4) != 0;
        maxd = d > maxd ? d : maxd;
        maxr = fabs(r->v[i]) > maxr ? fabs(r->v[i]) : maxr;
    }
    double rel = maxr > 0 ? maxd / maxr : maxd;
    if (run.verbose || nd)
        printf("  eval %u %-22s %zu x %zu: %6zu of %zu differ, max |d| %.3g (%.3g of max)\n",
               run.eval, want, rrows, rcols, nd, n, maxd, rel);
    for (int i = 0; i < N_SUM; i++) {
        if (!sums[i].name[0])
            snprintf(sums[i].name, sizeof sums[i].name, "%s", name);
        if (!strcmp(sums[i].name, name)) {
            sums[i].tensors++;
            sums[i].differing += nd != 0;
            sums[i].max_rel = rel > sums[i].max_rel ? rel : sums[i].max_rel;
            break;
        }
    }
    const char *only = getenv("KVD_TRACE_INJECT_ONLY");
    if (!run.inject || (only && !strstr(only, name)))
        return 0;
    memcpy(kv, r->v, n * 4);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 5 || (strcmp(argv[3], "follow") && strcmp(argv[3], "inject"))) {
        fprintf(stderr, "usage: %s MODEL.gguf DUMP follow|inject TOKEN...\n", argv[0]);
        return 2;
    }
    run.inject = !strcmp(argv[3], "inject");
    run.verbose = getenv("KVD_TRACE_VERBOSE") != NULL;
    if (getenv("KVD_TRACE_OUT") && !(run.out = fopen(getenv("KVD_TRACE_OUT"), "wb"))) {
        perror(getenv("KVD_TRACE_OUT"));
        return 1;
    }
    if (load_dump(argv[2])) {
        perror(argv[2]);
        return 1;
    }
    struct backend *be;
    struct model *m;
    struct kvd_error err = {0};
    if (backend_cpu_new(&be) || model_load(argv[1], be, &m, &err)) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    const struct model_hparams *hp = model_hparams(m);
    uint32_t n_prompt = (uint32_t)(argc - 4), n_eval = 0, toks[512];
    for (size_t i = 0; i < n_recs; i++)
        n_eval = recs[i].eval + 1 > n_eval ? recs[i].eval + 1 : n_eval;
    for (uint32_t i = 0; i < n_prompt && i < 256; i++)
        toks[i] = (uint32_t)atoi(argv[4 + i]);
    struct kv_geom g;
    model_kv_geom(m, 16, getenv("KVD_LLAMACPP_KV_F32") ? KV_F32 : KV_F16, &g);
    uint32_t n_blocks = (n_prompt + n_eval + 15) / 16;
    size_t bb = (size_t)g.layers * 2 * g.kv_heads * 16 * kv_row_bytes(g.dtype, g.head_dim);
    void *arena = calloc(n_blocks, bb);
    uint32_t *slots = malloc(n_blocks * sizeof *slots);
    for (uint32_t i = 0; i < n_blocks; i++)
        slots[i] = i;
    struct fwd_ctx *fc;
    float *lg = malloc((size_t)hp->n_vocab * 4);
    if (!arena || !slots || !lg || fwd_ctx_new(m, n_prompt < 64 ? 64 : n_prompt, 1, &fc) ||
        fwd_ctx_set_trace(fc, on_trace, NULL))
        return 1;
    /* $KVD_LLAMACPP_UBATCH: the prompt one token per step, as the dump's */
    uint32_t n_pre = getenv("KVD_LLAMACPP_UBATCH") ? n_prompt : 1; /* prompt steps */
    struct fwd_seq s = {.tokens = toks,
                        .n_tokens = n_prompt / n_pre,
                        .pos0 = 0,
                        .slots = slots,
                        .n_slots = n_blocks};
    struct fwd_batch b = {.seqs = &s,
                          .n_seqs = 1,
                          .kv_arena = arena,
                          .geom = &g,
                          .n_arena_slots = n_blocks,
                          .logits = lg};
    for (run.eval = 0; run.eval < n_eval; run.eval++) {
        if (model_forward(m, fc, &b)) {
            fprintf(stderr, "forward: %s\n", fwd_ctx_errmsg(fc));
            return 1;
        }
        const struct rec *ll = NULL;
        for (size_t i = 0; i < n_recs; i++)
            if (recs[i].eval == run.eval && !strcmp(recs[i].name, "logits"))
                ll = &recs[i];
        uint32_t ours = 0, theirs = 0;
        for (uint32_t j = 1; j < hp->n_vocab; j++) {
            ours = lg[j] > lg[ours] ? j : ours;
            theirs = ll && ll->v[j] > ll->v[theirs] ? j : theirs;
        }
        float second = -INFINITY;
        for (uint32_t j = 0; j < hp->n_vocab; j++)
            if (j != ours && lg[j] > second)
                second = lg[j];
        printf("eval %u: kvd %u (margin %.4f), llama.cpp %u%s\n", run.eval, ours,
               (double)(lg[ours] - second), theirs, ours == theirs ? "" : "  <-- differs");
        s.pos0 += s.n_tokens;
        s.n_tokens = 1;
        if (run.eval + 1 >= n_pre) { /* the greedy token comes next */
            toks[n_prompt + run.eval + 1 - n_pre] = theirs;
            s.tokens = &toks[n_prompt + run.eval + 1 - n_pre];
        } else {
            s.tokens = &toks[run.eval + 1];
        }
    }
    printf("summary (%s): op, tensors compared, tensors with a difference, largest relative\n",
           argv[3]);
    for (int i = 0; i < N_SUM && sums[i].name[0]; i++)
        printf("  %-14s %5ld %5ld %.3g\n", sums[i].name, sums[i].tensors, sums[i].differing,
               sums[i].max_rel);
    if (run.out)
        fclose(run.out);
    fwd_ctx_free(fc);
    model_free(m);
    backend_free(be);
    free(arena);
    free(slots);
    free(lg);
    return 0;
}

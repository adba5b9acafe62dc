/* bench_gpu_model: the models bench_gpu times, made on the device with random
 * weights (no file, no host copy), and a per-op profiler: a copy of the
 * model's compute-ops table whose every op records a CUDA event before and
 * after itself on the compute stream, so one eager step splits into the GPU
 * time of each op (and of each projection by weight type). */
#include "bench_gpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "kernels.h"
#include "model_impl.h"

/* The next 256-byte aligned piece of the weight buffer. */
static void *carve(char **p, size_t bytes)
{
    char *r = *p;
    *p += (bytes + 255) & ~(size_t)255;
    return r;
}

static size_t tensor_bytes(enum ctype t, uint32_t ne0, uint32_t ne1)
{
    return ((ctype_row_bytes(t, ne0) * ne1 + 255) & ~(size_t)255);
}

/* A tensor of type t filled on the device: bf16/f32 uniform in [lo, hi),
 * quantized types random blocks (kvd_k_fill_qweight), then put into the
 * backend's layout (cuda_compute_weight_prepare). */
static void tensor(struct model *m, struct ctensor *t, char **cur, enum ctype type, uint32_t ne0,
                   uint32_t ne1, uint64_t seed, float lo, float hi)
{
    t->type = type;
    t->layout = CL_ROWS;
    t->ne0 = ne0;
    t->ne1 = ne1;
    t->nbytes = ctype_row_bytes(type, ne0) * ne1;
    t->data = carve(cur, t->nbytes);
    if (ctype_is_quant(type))
        BKCK(kvd_k_fill_qweight(t->data, (int)type, t->nbytes / ctype_block_bytes(type), seed,
                                NULL));
    else
        BKCK(kvd_k_fill_uniform(t->data, type == CT_F32 ? KVD_K_F32 : KVD_K_BF16, (size_t)ne0 * ne1,
                                seed, lo, hi, NULL));
    BCK(cudaDeviceSynchronize());
    if (ne1 > 1 && cuda_compute_weight_prepare(m->cx, t)) {
        fprintf(stderr, "bench_gpu: preparing a %s [%u x %u] weight failed\n", ctype_name(type),
                ne1, ne0);
        exit(1);
    }
}

/* llama.cpp's Q4_K_M rule for attn_v and ffn_down (kvd-gguf-gen's
 * more_bits): Q6_K in the first and last eighth of the layers and every
 * third layer between. */
static bool more_bits(uint32_t l, uint32_t n)
{
    return l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2;
}

struct model *bench_model_new(struct backend *be, const struct bench_shape *sh, bool q4km,
                              uint64_t *step_bytes)
{
    struct model *m = calloc(1, sizeof *m);
    struct model_hparams *hp = &m->hp;
    struct compute_conf conf = {0};
    if (!m)
        exit(1);
    const uint32_t E = sh->embd, HD = sh->embd / sh->heads, KD = sh->kv_heads * HD, F = sh->ff;
    snprintf(hp->arch, sizeof hp->arch, "llama");
    snprintf(hp->name, sizeof hp->name, "random %s, %s", sh->name, q4km ? "Q4_K_M" : "bf16");
    hp->n_vocab = sh->vocab;
    hp->n_ctx = 131072;
    hp->n_embd = E;
    hp->n_layer = sh->layers;
    hp->n_head = sh->heads;
    hp->n_head_kv = sh->kv_heads;
    hp->head_dim = HD;
    hp->n_ff = F;
    hp->n_rot = HD;
    hp->rms_eps = 1e-5f;
    hp->rope_base = 500000.0f;
    hp->rope_mode = ROPE_NORM;
    hp->tied_output = sh->tied;
    hp->wtype = q4km ? CT_Q4_K : CT_BF16;
    m->be = be;
    m->ops = be->compute;
    if (m->ops->ctx_new(be, &conf, &m->cx))
        exit(1);
    m->layers = calloc(sh->layers, sizeof *m->layers);
    const enum ctype main_t = q4km ? CT_Q4_K : CT_BF16;
    size_t total = 8192 + tensor_bytes(main_t, E, sh->vocab) + tensor_bytes(CT_F32, E, 1) +
                   (sh->tied ? 0 : tensor_bytes(q4km ? CT_Q6_K : CT_BF16, E, sh->vocab));
    for (uint32_t l = 0; l < sh->layers; l++) {
        enum ctype vt = q4km && more_bits(l, sh->layers) ? CT_Q6_K : main_t;
        total += 2 * tensor_bytes(CT_F32, E, 1) + 2 * tensor_bytes(main_t, E, E) +
                 tensor_bytes(main_t, E, KD) + tensor_bytes(vt, E, KD) +
                 2 * tensor_bytes(main_t, E, F) + tensor_bytes(vt, F, E);
    }
    if (m->ops->buf_alloc(m->cx, total, &m->weights)) {
        fprintf(stderr, "bench_gpu: no memory for %zu bytes of weights\n", total);
        exit(1);
    }
    char *cur = m->weights;
    uint64_t seed = 1;
    float a_e = 1.7320508f / sqrtf((float)E), a_f = 1.7320508f / sqrtf((float)F);
    uint64_t bytes = 0; /* what one decode step reads of the weights */
    tensor(m, &m->tok_embd, &cur, main_t, E, sh->vocab, seed++, -1, 1);
    tensor(m, &m->output_norm, &cur, CT_F32, E, 1, seed++, 0.9f, 1.1f);
    if (sh->tied)
        m->output = m->tok_embd;
    else
        tensor(m, &m->output, &cur, q4km ? CT_Q6_K : CT_BF16, E, sh->vocab, seed++, -a_e, a_e);
    bytes += m->output.nbytes;
    for (uint32_t l = 0; l < sh->layers; l++) {
        struct model_layer *L = &m->layers[l];
        enum ctype vt = q4km && more_bits(l, sh->layers) ? CT_Q6_K : main_t;
        tensor(m, &L->attn_norm, &cur, CT_F32, E, 1, seed++, 0.9f, 1.1f);
        tensor(m, &L->wq, &cur, main_t, E, E, seed++, -a_e, a_e);
        tensor(m, &L->wk, &cur, main_t, E, KD, seed++, -a_e, a_e);
        tensor(m, &L->wv, &cur, vt, E, KD, seed++, -a_e, a_e);
        tensor(m, &L->wo, &cur, main_t, E, E, seed++, -a_e, a_e);
        tensor(m, &L->ffn_norm, &cur, CT_F32, E, 1, seed++, 0.9f, 1.1f);
        tensor(m, &L->gate, &cur, main_t, E, F, seed++, -a_e, a_e);
        tensor(m, &L->up, &cur, main_t, E, F, seed++, -a_e, a_e);
        tensor(m, &L->down, &cur, vt, F, E, seed++, -a_f, a_f);
        bytes += L->wq.nbytes + L->wk.nbytes + L->wv.nbytes + L->wo.nbytes + L->gate.nbytes +
                 L->up.nbytes + L->down.nbytes;
    }
    if ((size_t)(cur - (char *)m->weights) > total) {
        fprintf(stderr, "bench_gpu: weight layout overflow\n");
        exit(1);
    }
    BCK(cudaDeviceSynchronize());
    hp->weight_bytes = total;
    *step_bytes = bytes;
    return m;
}

/* ---- the per-op profiler ---------------------------------------------------- */

#define PROF_MAX 8192 /* ops of one step */

static struct {
    struct compute_ops table;
    const struct compute_ops *real;
    cudaStream_t stream;
    cudaEvent_t ev[2 * PROF_MAX];
    char name[PROF_MAX][32];
    uint64_t bytes[PROF_MAX];
    int n;
    bool on;
} P;

static void mark(const char *name, uint64_t bytes)
{
    if (!P.on || P.n >= PROF_MAX)
        return;
    snprintf(P.name[P.n], sizeof P.name[0], "%.31s", name); /* names are short */
    P.bytes[P.n] = bytes;
    BCK(cudaEventRecord(P.ev[2 * P.n], P.stream));
}

static void done(void)
{
    if (!P.on || P.n >= PROF_MAX)
        return;
    BCK(cudaEventRecord(P.ev[2 * P.n + 1], P.stream));
    P.n++;
}

#define WRAP(op, name, bytes, params, args)                                                        \
    static int w_##op params                                                                       \
    {                                                                                              \
        mark(name, bytes);                                                                         \
        int rc = P.real->op args;                                                                  \
        done();                                                                                    \
        return rc;                                                                                 \
    }

static char mm_name[64];
static const char *matmul_name(const struct ctensor *w, uint32_t rows)
{
    snprintf(mm_name, sizeof mm_name, "matmul %s%s", ctype_name(w->type), rows > 8 ? " gemm" : "");
    return mm_name;
}

WRAP(get_rows, "get_rows", 0,
     (struct compute_ctx * cx, const struct ctensor *w, const uint32_t *ids, uint32_t n,
      float *out),
     (cx, w, ids, n, out))
WRAP(rmsnorm, "rmsnorm", 0,
     (struct compute_ctx * cx, float *out, const float *x, const float *w, uint32_t rows,
      uint32_t n, float eps),
     (cx, out, x, w, rows, n, eps))
WRAP(add_rmsnorm, "add_rmsnorm", 0,
     (struct compute_ctx * cx, float *x, const float *res, float *out, const float *w,
      uint32_t rows, uint32_t n, float eps),
     (cx, x, res, out, w, rows, n, eps))
WRAP(matmul, matmul_name(w, rows), w->nbytes,
     (struct compute_ctx * cx, const struct ctensor *w, const float *x, uint32_t rows, float *y),
     (cx, w, x, rows, y))
WRAP(add_bias, "add_bias", 0,
     (struct compute_ctx * cx, float *y, const float *b, uint32_t rows, uint32_t n),
     (cx, y, b, rows, n))
WRAP(rope, "rope", 0,
     (struct compute_ctx * cx, float *x, uint32_t rows, uint32_t n_heads, uint32_t head_dim,
      uint32_t n_rot, const uint32_t *pos, enum rope_mode mode, float base, const float *ff),
     (cx, x, rows, n_heads, head_dim, n_rot, pos, mode, base, ff))
WRAP(kv_write, "kv_write", 0,
     (struct compute_ctx * cx, void *arena, const struct kv_geom *geom, uint32_t layer,
      const float *k, const float *v, uint32_t n_tokens, const uint32_t *tok_slot,
      const uint32_t *tok_pos),
     (cx, arena, geom, layer, k, v, n_tokens, tok_slot, tok_pos))
WRAP(attention, "attention", 0, (struct compute_ctx * cx, const struct attn_desc *d), (cx, d))
WRAP(silu_mul, "silu_mul", 0, (struct compute_ctx * cx, float *g, const float *u, size_t n),
     (cx, g, u, n))
WRAP(add, "add", 0, (struct compute_ctx * cx, float *x, const float *y, size_t n), (cx, x, y, n))
WRAP(gather_rows, "gather_rows", 0,
     (struct compute_ctx * cx, float *out, const float *x, const uint32_t *rows, uint32_t n,
      uint32_t width),
     (cx, out, x, rows, n, width))
WRAP(sample, "sample", 0,
     (struct compute_ctx * cx, const float *logits, uint32_t rows, uint32_t vocab,
      const struct sample_row *p, uint32_t *out),
     (cx, logits, rows, vocab, p, out))

void bench_prof_install(struct model *m, struct backend *be)
{
    P.real = m->ops;
    P.table = *m->ops;
    P.stream = cuda_backend_dev(be)->compute;
    for (int i = 0; i < 2 * PROF_MAX; i++)
        if (!P.ev[i])
            BCK(cudaEventCreate(&P.ev[i]));
#define SET(op)                                                                                    \
    if (P.table.op)                                                                                \
    P.table.op = w_##op
    SET(get_rows);
    SET(rmsnorm);
    SET(add_rmsnorm);
    SET(matmul);
    SET(add_bias);
    SET(rope);
    SET(kv_write);
    SET(attention);
    SET(silu_mul);
    SET(add);
    SET(gather_rows);
    SET(sample);
#undef SET
    m->ops = &P.table;
}

void bench_prof_remove(struct model *m)
{
    m->ops = P.real;
    P.on = false;
}

void bench_prof_begin(void)
{
    P.n = 0;
    P.on = true;
}

int bench_prof_end(struct bench_prof_row *rows, int max_rows)
{
    int nr = 0;
    P.on = false;
    BCK(cudaStreamSynchronize(P.stream));
    for (int i = 0; i < P.n; i++) {
        float ms = 0;
        BCK(cudaEventElapsedTime(&ms, P.ev[2 * i], P.ev[2 * i + 1]));
        int r = 0;
        while (r < nr && strcmp(rows[r].name, P.name[i]))
            r++;
        if (r == nr) {
            if (nr == max_rows)
                continue;
            memset(&rows[nr], 0, sizeof rows[nr]);
            snprintf(rows[nr].name, sizeof rows[nr].name, "%s", P.name[i]);
            nr++;
        }
        rows[r].calls++;
        rows[r].us += ms * 1e3;
        rows[r].bytes += P.bytes[i];
    }
    return nr;
}

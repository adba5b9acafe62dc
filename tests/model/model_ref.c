/* The dense reference decoder for the model tests: reads weights straight
 * from the GGUF (through gguf.h only), widens them to double with its own
 * conversions, and runs llama/qwen2 the plain way (llama2.c style) so the
 * paged, batched, threaded forward has something independent to match. */
#include "model_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "compute.h"
#include "gguf.h"
#include "quant.h"

char *ref_gen_model(const char *args)
{
    const char *dir = getenv("KVD_TOOLS_DIR");
    char path[] = "/tmp/kvd-model-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return NULL;
    close(fd);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/kvd-gguf-gen %s -o %s", dir ? dir : "bin", args, path);
    if (system(cmd) != 0) {
        unlink(path);
        return NULL;
    }
    return strdup(path);
}

struct backend *ref_cpu_backend(void)
{
    static struct backend *be; /* one for the whole test program */
    if (!be && backend_cpu_new(&be) == 0 && !be->compute)
        be->compute = compute_cpu_ops(); /* in case the backend is not wired yet */
    return be;
}

static double half_to_d(uint16_t h) /* via ldexp, independent of the daemon's bit tricks */
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static double bf16_to_d(uint16_t h)
{
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* x rounded to the KV dtype (as float), the way the cache stores it. */
static double kv_round(double x, enum kv_dtype t)
{
    float f = (float)x;
    if (t == KV_F16) { /* arithmetic round-half-even to the f16 grid */
        double a = fabs((double)f);
        if (a == 0)
            return f;
        int e;
        frexp(a, &e);                                            /* a in [2^(e-1), 2^e) */
        double q = ldexp(1.0, (e - 1 < -14 ? -14 : e - 1) - 10); /* f16 spacing there */
        double r = nearbyint(a / q) * q;
        if (r > 65504)
            r = INFINITY;
        return f < 0 ? -r : r;
    }
    if (t == KV_BF16) {
        uint32_t u;
        memcpy(&u, &f, 4);
        u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
        memcpy(&f, &u, 4);
    }
    return f;
}

struct mat {
    uint32_t in, out;
    double *w; /* [out][in] */
};

struct ref_layer {
    struct mat q, k, v, o, gate, up, down;
    double *attn_norm, *ffn_norm, *bq, *bk, *bv;
};

struct ref_model {
    uint32_t E, L, H, HKV, D, F, V, rot;
    float eps, base;
    int neox;
    struct mat embd, out;
    double *out_norm, *freqs;
    struct ref_layer *l;
};

static double *load_t(const struct gguf *g, const char *name, uint32_t *in, uint32_t *out)
{
    const struct gguf_tensor *t = gguf_find_tensor(g, name);
    if (!t)
        return NULL;
    uint64_t n0 = t->ne[0], n1 = t->ne[1];
    double *w = malloc(n0 * n1 * sizeof *w);
    float *row = malloc(n0 * sizeof *row);
    const uint8_t *p = t->data;
    enum ctype ty = (enum ctype)t->type;
    size_t rb = ctype_row_bytes(ty, n0);
    for (uint64_t r = 0; r < n1; r++) {
        if (ty != CT_F32 && ty != CT_F16 && ty != CT_BF16 && ty != CT_Q8_0) {
            /* the other quantized types: quant.c's reference conversion
             * (written from the format definition, apart from the kernels) */
            if (quant_dequant_row(ty, p + r * rb, row, n0))
                abort();
            for (uint64_t i = 0; i < n0; i++)
                w[r * n0 + i] = row[i];
            continue;
        }
        for (uint64_t i = 0; i < n0; i++) {
            uint64_t k = r * n0 + i;
            uint16_t h;
            switch (ty) {
            case CT_F32: {
                float f;
                memcpy(&f, p + 4 * k, 4);
                w[k] = f;
                break;
            }
            case CT_F16:
                memcpy(&h, p + 2 * k, 2);
                w[k] = half_to_d(h);
                break;
            case CT_BF16:
                memcpy(&h, p + 2 * k, 2);
                w[k] = bf16_to_d(h);
                break;
            default: { /* q8_0 */
                const uint8_t *blk = p + (k / 32) * 34;
                memcpy(&h, blk, 2);
                w[k] = half_to_d(h) * (int8_t)blk[2 + k % 32];
                break;
            }
            }
        }
    }
    free(row);
    if (in)
        *in = (uint32_t)n0;
    if (out)
        *out = (uint32_t)n1;
    return w;
}

static void load_mat(const struct gguf *g, const char *name, struct mat *m)
{
    m->w = load_t(g, name, &m->in, &m->out);
}

struct ref_model *ref_model_load(const char *path)
{
    char err[256], arch[16], key[96];
    struct gguf *g;
    if (gguf_open(path, &g, err, sizeof err))
        return NULL;
    struct ref_model *r = calloc(1, sizeof *r);
    gguf_get_str(g, "general.architecture", arch, sizeof arch, err, sizeof err);
    r->neox = strcmp(arch, "qwen2") == 0;
#define U(s, dst)                                                                                  \
    (snprintf(key, sizeof key, "%s.%s", arch, s), gguf_get_u32(g, key, dst, err, sizeof err))
    U("embedding_length", &r->E);
    U("block_count", &r->L);
    U("attention.head_count", &r->H);
    U("attention.head_count_kv", &r->HKV);
    U("feed_forward_length", &r->F);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    gguf_get_f32(g, key, &r->eps, NULL);
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    gguf_get_f32(g, key, &r->base, NULL);
#undef U
    r->D = r->E / r->H;
    r->rot = r->D;
    load_mat(g, "token_embd.weight", &r->embd);
    r->V = r->embd.out;
    load_mat(g, "output.weight", &r->out);
    if (!r->out.w)
        r->out = r->embd, r->out.w = load_t(g, "token_embd.weight", NULL, NULL);
    r->out_norm = load_t(g, "output_norm.weight", NULL, NULL);
    r->freqs = load_t(g, "rope_freqs.weight", NULL, NULL);
    r->l = calloc(r->L, sizeof *r->l);
    for (uint32_t i = 0; i < r->L; i++) {
        struct ref_layer *l = &r->l[i];
        char n[96];
#define M(f, s) (snprintf(n, sizeof n, "blk.%u.%s", i, s), load_mat(g, n, &l->f))
#define T(f, s) (snprintf(n, sizeof n, "blk.%u.%s", i, s), l->f = load_t(g, n, NULL, NULL))
        M(q, "attn_q.weight");
        M(k, "attn_k.weight");
        M(v, "attn_v.weight");
        M(o, "attn_output.weight");
        M(gate, "ffn_gate.weight");
        M(up, "ffn_up.weight");
        M(down, "ffn_down.weight");
        T(attn_norm, "attn_norm.weight");
        T(ffn_norm, "ffn_norm.weight");
        T(bq, "attn_q.bias");
        T(bk, "attn_k.bias");
        T(bv, "attn_v.bias");
#undef M
#undef T
    }
    gguf_close(g);
    return r;
}

void ref_model_free(struct ref_model *r)
{
    if (!r)
        return;
    for (uint32_t i = 0; i < r->L; i++) {
        struct ref_layer *l = &r->l[i];
        free(l->q.w);
        free(l->k.w);
        free(l->v.w);
        free(l->o.w);
        free(l->gate.w);
        free(l->up.w);
        free(l->down.w);
        free(l->attn_norm);
        free(l->ffn_norm);
        free(l->bq);
        free(l->bk);
        free(l->bv);
    }
    free(r->l);
    free(r->embd.w);
    free(r->out.w);
    free(r->out_norm);
    free(r->freqs);
    free(r);
}

uint32_t ref_n_vocab(const struct ref_model *r)
{
    return r->V;
}

static void matvec(const struct mat *m, const double *x, double *y)
{
    for (uint32_t j = 0; j < m->out; j++) {
        double s = 0;
        for (uint32_t i = 0; i < m->in; i++)
            s += m->w[(size_t)j * m->in + i] * x[i];
        y[j] = s;
    }
}

static void rmsnorm(const double *x, const double *w, uint32_t n, double eps, double *out)
{
    double ss = 0;
    for (uint32_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * sc * w[i];
}

static void rope(const struct ref_model *r, double *v, uint32_t heads, uint32_t pos)
{
    for (uint32_t h = 0; h < heads; h++) {
        double *x = v + (size_t)h * r->D;
        for (uint32_t i = 0; i < r->rot / 2; i++) {
            double th = pos * pow(r->base, -2.0 * i / r->rot);
            if (r->freqs)
                th /= r->freqs[i];
            uint32_t a = r->neox ? i : 2 * i, b = r->neox ? i + r->rot / 2 : 2 * i + 1;
            double x0 = x[a], x1 = x[b];
            x[a] = x0 * cos(th) - x1 * sin(th);
            x[b] = x0 * sin(th) + x1 * cos(th);
        }
    }
}

void ref_forward(const struct ref_model *r, const uint32_t *tokens, uint32_t n, enum kv_dtype kvt,
                 double *logits)
{
    uint32_t E = r->E, D = r->D, KD = r->HKV * D, QD = r->H * D, F = r->F;
    double *x = malloc((size_t)n * E * 8), *h = malloc(E * 8), *q = malloc(QD * 8),
           *att = malloc(QD * 8), *o = malloc(E * 8), *g = malloc(F * 8), *u = malloc(F * 8),
           *sc = malloc(n * 8);
    double *kc = malloc((size_t)r->L * n * KD * 8), *vc = malloc((size_t)r->L * n * KD * 8);
    for (uint32_t t = 0; t < n; t++)
        memcpy(x + (size_t)t * E, r->embd.w + (size_t)tokens[t] * E, E * 8);
    /* token by token, layer by layer (same math as all positions at once) */
    for (uint32_t t = 0; t < n; t++) {
        double *xt = x + (size_t)t * E;
        for (uint32_t l = 0; l < r->L; l++) {
            const struct ref_layer *L = &r->l[l];
            double *K = kc + ((size_t)l * n + t) * KD, *Vv = vc + ((size_t)l * n + t) * KD;
            rmsnorm(xt, L->attn_norm, E, r->eps, h);
            matvec(&L->q, h, q);
            matvec(&L->k, h, K);
            matvec(&L->v, h, Vv);
            if (L->bq) {
                for (uint32_t i = 0; i < QD; i++)
                    q[i] += L->bq[i];
                for (uint32_t i = 0; i < KD; i++)
                    K[i] += L->bk[i], Vv[i] += L->bv[i];
            }
            rope(r, q, r->H, t);
            rope(r, K, r->HKV, t);
            for (uint32_t i = 0; i < KD; i++) {
                K[i] = kv_round(K[i], kvt);
                Vv[i] = kv_round(Vv[i], kvt);
            }
            for (uint32_t hh = 0; hh < r->H; hh++) {
                uint32_t gkv = hh / (r->H / r->HKV);
                double m = -INFINITY, sum = 0;
                for (uint32_t j = 0; j <= t; j++) {
                    const double *kj = kc + ((size_t)l * n + j) * KD + (size_t)gkv * D;
                    double s = 0;
                    for (uint32_t i = 0; i < D; i++)
                        s += q[hh * D + i] * kj[i];
                    sc[j] = s / sqrt((double)D);
                    m = fmax(m, sc[j]);
                }
                for (uint32_t j = 0; j <= t; j++)
                    sum += (sc[j] = exp(sc[j] - m));
                for (uint32_t i = 0; i < D; i++) {
                    double a = 0;
                    for (uint32_t j = 0; j <= t; j++)
                        a += sc[j] / sum * vc[((size_t)l * n + j) * KD + (size_t)gkv * D + i];
                    att[hh * D + i] = a;
                }
            }
            matvec(&L->o, att, o);
            for (uint32_t i = 0; i < E; i++)
                xt[i] += o[i];
            rmsnorm(xt, L->ffn_norm, E, r->eps, h);
            matvec(&L->gate, h, g);
            matvec(&L->up, h, u);
            for (uint32_t i = 0; i < F; i++)
                g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            matvec(&L->down, g, o);
            for (uint32_t i = 0; i < E; i++)
                xt[i] += o[i];
        }
    }
    rmsnorm(x + (size_t)(n - 1) * E, r->out_norm, E, r->eps, h);
    matvec(&r->out, h, logits);
    free(x);
    free(h);
    free(q);
    free(att);
    free(o);
    free(g);
    free(u);
    free(sc);
    free(kc);
    free(vc);
}

double ref_rel_err(const float *a, const double *ref, size_t n)
{
    double md = 0, mr = 0;
    for (size_t i = 0; i < n; i++) {
        md = fmax(md, fabs(a[i] - ref[i]));
        mr = fmax(mr, fabs(ref[i]));
    }
    return mr > 0 ? md / mr : md;
}

/* A decode layer's fused ops chained on the cuda backend: each activation
 * quantized once, by the launch that makes it (compute.h next_readers), and
 * q, k, v ending with RoPE and the KV write (matmul_qkv_rope_kv); each
 * against the same ops without the fusion, bit for bit, and the launches
 * and quantizations they save (the emulator counts launches). Skips (77)
 * without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_kv.h"
#include "compute_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "quant.h"

#define F gpu_F /* the program's fixture (gpu_fixture.h) */

static void wt_make(struct gpu_wt *w, enum ctype t, uint32_t in, uint32_t out)
{
    gpu_wt_make(&F, w, t, in, out);
}

static void wt_free(struct gpu_wt *w)
{
    gpu_wt_free(&F, w);
}

/* The gpu chain of a layer's projections (o + residual + norm, gate/up +
 * SiLU, down + residual + norm, the next q, k, v), with or without the
 * next_readers hints; out: x, h, the SwiGLU output, q, k, v. */
struct chain {
    uint32_t rows, E, ff, A;
    struct gpu_wt wo, gate, up, down, q, k, v;
    float *x, *att, *nw1, *nw2; /* host inputs */
};

static void chain_gpu(struct chain *c, bool hints, float *out[6], unsigned long long *launches,
                      struct cuda_compute_stats *d)
{
    const uint32_t R = c->rows, E = c->E, ff = c->ff;
    float *dx = gpu_dup(&F, c->x, (size_t)R * E * 4),
          *datt = gpu_dup(&F, c->att, (size_t)R * c->A * 4), *dn1 = gpu_dup(&F, c->nw1, E * 4),
          *dn2 = gpu_dup(&F, c->nw2, E * 4), *dh = gpu_nan(&F, (size_t)R * E),
          *dg = gpu_nan(&F, (size_t)R * ff), *dt = gpu_nan(&F, (size_t)R * ff),
          *dq = gpu_nan(&F, (size_t)R * 128), *dk = gpu_nan(&F, (size_t)R * 64),
          *dv = gpu_nan(&F, (size_t)R * 64);
    struct cuda_compute_stats a, b;
    cuda_compute_stats(F.gcx, &a);
    unsigned long long l0 = gpu_launches();
    const struct ctensor *r1[2] = {&c->gate.d, &c->up.d}, *r2[1] = {&c->down.d},
                         *r3[3] = {&c->q.d, &c->k.d, &c->v.d};
    if (hints)
        F.gops->next_readers(F.gcx, dh, 2, r1);
    assert_int_equal(F.gops->matmul_add_rmsnorm(F.gcx, &c->wo.d, datt, R, 0, dx, dn1, 1e-5f, dh),
                     0);
    if (hints)
        F.gops->next_readers(F.gcx, dg, 1, r2);
    assert_int_equal(F.gops->matmul_swiglu(F.gcx, &c->gate.d, &c->up.d, dh, R, 0, dg, dt), 0);
    if (hints)
        F.gops->next_readers(F.gcx, dh, 3, r3);
    assert_int_equal(F.gops->matmul_add_rmsnorm(F.gcx, &c->down.d, dg, R, 0, dx, dn2, 1e-5f, dh),
                     0);
    const float *nb[3] = {NULL, NULL, NULL};
    float *y[3] = {dq, dk, dv};
    assert_int_equal(F.gops->matmul_n(F.gcx, 3, r3, nb, dh, R, 0, y), 0);
    float *dev[6] = {dx, dh, dg, dq, dk, dv};
    const size_t n[6] = {(size_t)R * E,   (size_t)R * E,  (size_t)R * ff,
                         (size_t)R * 128, (size_t)R * 64, (size_t)R * 64};
    for (int i = 0; i < 6; i++) {
        out[i] = malloc(n[i] * 4);
        gpu_get(&F, out[i], dev[i], n[i] * 4);
    }
    *launches = gpu_launches() - l0;
    cuda_compute_stats(F.gcx, &b);
    d->act_quants = b.act_quants - a.act_quants;
    d->act_handed = b.act_handed - a.act_handed;
    float *all[] = {dx, datt, dn1, dn2, dh, dg, dt, dq, dk, dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gpu_free(&F, all[i]);
}

/* Each activation quantized once, by the launch that makes it: with the
 * next_readers hints, the o projection's norm quantizes h for gate/up,
 * SwiGLU its output for down, down's norm h for q, k, v (two layouts when
 * v is Q6_K), and the readers take those bytes instead of quantizing the
 * f32 again: every output bit for bit what the same chain gives without
 * the hints, and the quantizing launches counted. The case whose down
 * input does not fit in shared memory (8 rows of 6144) also drops down's
 * separate quantization launch. Norms of rows that are not a multiple of
 * 256 (288) read the normed rows back to quantize them, the others
 * quantize from registers; 8 rows of 6144 do not fit in shared memory: q,
 * k and v in Q4_K/Q6_K then take a launch per type. */
static void test_quantized_once(void **state)
{
    static const struct {
        enum ctype t, vt;
        uint32_t rows, ff, E;
    } cs[] = {{CT_Q4_K, CT_Q6_K, 1, 512, 256},  {CT_Q4_0, CT_Q4_0, 3, 512, 256},
              {CT_Q6_K, CT_Q6_K, 2, 512, 256},  {CT_Q5_1, CT_Q4_K, 4, 512, 256},
              {CT_Q4_K, CT_Q4_K, 8, 6144, 256}, {CT_Q4_0, CT_Q4_0, 2, 256, 288},
              {CT_Q4_K, CT_Q6_K, 8, 256, 6144}};
    rnd_seed(45);
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        struct chain c = {.rows = cs[ci].rows, .E = cs[ci].E, .ff = cs[ci].ff, .A = 256};
        const enum ctype t = cs[ci].t;
        wt_make(&c.wo, t, c.A, c.E);
        wt_make(&c.gate, t, c.E, c.ff);
        wt_make(&c.up, t, c.E, c.ff);
        wt_make(&c.down, t, c.ff, c.E);
        wt_make(&c.q, t, c.E, 128);
        wt_make(&c.k, t, c.E, 64);
        wt_make(&c.v, cs[ci].vt, c.E, 64);
        c.x = rnd_new((size_t)c.rows * c.E, -2, 2);
        c.att = rnd_new((size_t)c.rows * c.A, -1, 1);
        c.nw1 = rnd_new(c.E, 0.5f, 1.5f);
        c.nw2 = rnd_new(c.E, 0.5f, 1.5f);
        float *plain[6], *once[6];
        unsigned long long lp, lo;
        struct cuda_compute_stats sp, so;
        chain_gpu(&c, false, plain, &lp, &sp);
        chain_gpu(&c, true, once, &lo, &so);
        static const char *names[6] = {"x", "h", "swiglu", "q", "k", "v"};
        const size_t n[6] = {(size_t)c.rows * c.E, (size_t)c.rows * c.E, (size_t)c.rows * c.ff,
                             (size_t)c.rows * 128, (size_t)c.rows * 64,  (size_t)c.rows * 64};
        char what[96];
        for (int i = 0; i < 6; i++) {
            snprintf(what, sizeof what, "quantized once %s/%s rows %u: %s", ctype_name(t),
                     ctype_name(cs[ci].vt), c.rows, names[i]);
            if (memcmp(once[i], plain[i], n[i] * 4))
                fail_msg("%s differs from the chain without the hints", what);
            free(plain[i]);
            free(once[i]);
        }
        /* wo, gate/up, down, and q/k (+ v when its layout differs and the
         * GEMV does not take both types in one launch) */
        const uint64_t qkv = kvd_k_gemv_act_kind((int)cs[ci].vt) == kvd_k_gemv_act_kind((int)t) ||
                                     kvd_k_gemv_pair_ok((int)t, (int)cs[ci].vt)
                                 ? 1
                                 : 2;
        if (sp.act_quants != 3 + qkv || sp.act_handed != 0)
            fail_msg("%s rows %u without hints: %llu quantizing launches, %llu handed",
                     ctype_name(t), c.rows, (unsigned long long)sp.act_quants,
                     (unsigned long long)sp.act_handed);
        if (so.act_quants != 1 || so.act_handed != 2 + qkv)
            fail_msg("%s rows %u: %llu launches quantized their input (wo's alone should), "
                     "%llu read it quantized (expected %llu)",
                     ctype_name(t), c.rows, (unsigned long long)so.act_quants,
                     (unsigned long long)so.act_handed, (unsigned long long)(2 + qkv));
#ifdef KVD_CUDA_EMULATE
        if (c.ff == 6144 && lo != lp - 1)
            fail_msg("rows %u ff %u: %llu launches with the hints, %llu without (down's "
                     "separate quantization should be gone)",
                     c.rows, c.ff, lo, lp);
#endif
        struct gpu_wt *ws[] = {&c.wo, &c.gate, &c.up, &c.down, &c.q, &c.k, &c.v};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            wt_free(ws[i]);
        free(c.x);
        free(c.att);
        free(c.nw1);
        free(c.nw2);
    }
}

/* One run of the q, k, v projections with RoPE and the KV write: fused
 * (matmul_qkv_rope_kv) or as two ops (matmul_n, rope_kv_write); q, k, v
 * and the arena downloaded into out[0..3). */
static unsigned long long qkv_rope_gpu(bool fused, const struct ctensor *const *w,
                                       const float *const *db, const float *dx, uint32_t rows,
                                       const uint32_t *outs, const void *harena, size_t ab,
                                       const struct rope_kv_args *ra, void *out[4])
{
    void *da = gpu_dup(&F, harena, ab);
    float *y[3];
    for (int i = 0; i < 3; i++)
        y[i] = gpu_nan(&F, (size_t)rows * outs[i]);
    struct rope_kv_args r = *ra;
    r.arena = da;
    unsigned long long l0 = gpu_launches();
    if (fused) {
        assert_int_equal(F.gops->matmul_qkv_rope_kv(F.gcx, w, db, dx, rows, 0, y, &r), 0);
    } else {
        assert_int_equal(F.gops->matmul_n(F.gcx, 3, w, db, dx, rows, 0, y), 0);
        assert_int_equal(F.gops->rope_kv_write(F.gcx, y[0], y[1], y[2], rows, r.n_head, r.n_rot,
                                               r.pos, r.mode, r.base, r.freq_factors, da, r.geom,
                                               r.layer, r.tok_slot),
                         0);
    }
    for (int i = 0; i < 3; i++) {
        out[i] = malloc((size_t)rows * outs[i] * 4);
        gpu_get(&F, out[i], y[i], (size_t)rows * outs[i] * 4);
        gpu_free(&F, y[i]);
    }
    out[3] = malloc(ab);
    gpu_get(&F, out[3], da, ab);
    gpu_free(&F, da);
    return gpu_launches() - l0;
}

/* q, k, v projections ending with RoPE and the KV write (the last
 * projection launch's last block): q, k, v and the whole arena bit for bit
 * what matmul_n then rope_kv_write give, one launch fewer up to 8 rows
 * (12: the chain); a padding row (no KV) among them; q against the cpu's
 * chain. Every KV dtype, both pair conventions, biases, v of another type. */
static void test_qkv_rope_kv(void **state)
{
    static const struct {
        enum ctype t, vt;
        uint32_t rows, hd;
        int dt;
        enum rope_mode mode;
        bool bias;
    } cs[] = {{CT_Q4_K, CT_Q6_K, 1, 128, KV_F16, ROPE_NORM, false},
              {CT_BF16, CT_BF16, 3, 64, KV_Q8_0, ROPE_NEOX, true},
              {CT_Q4_0, CT_Q4_0, 8, 64, KV_FP8, ROPE_NORM, false},
              {CT_F32, CT_F32, 2, 128, KV_BF16, ROPE_NEOX, false},
              {CT_Q8_0, CT_Q8_0, 5, 64, KV_F32, ROPE_NORM, true},
              {CT_Q4_K, CT_Q4_K, 12, 64, KV_F16, ROPE_NORM, false}};
    const uint32_t in = 256, nh = 4, kvh = 2, bt = 16;
    rnd_seed(46);
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const uint32_t rows = cs[ci].rows, hd = cs[ci].hd;
        const uint32_t outs[3] = {nh * hd, kvh * hd, kvh * hd};
        struct kv_geom g = {.layers = 2,
                            .kv_heads = kvh,
                            .head_dim = hd,
                            .dtype = (enum kv_dtype)cs[ci].dt,
                            .block_tokens = bt};
        const size_t ab = kv_block_bytes(&g) * (rows + 1);
        uint8_t *harena = malloc(ab);
        for (size_t i = 0; i < ab; i++)
            harena[i] = (uint8_t)(i * 7 + 3);
        uint32_t pos[12], slot[12];
        for (uint32_t t = 0; t < rows; t++) {
            pos[t] = 5 + 9 * t;
            slot[t] = t == 1 ? UINT32_MAX : rows - t; /* token 1: a padding row */
        }
        struct gpu_wt w[3];
        const struct ctensor *dw[3], *hw[3];
        float *hb[3], *db[3];
        for (int i = 0; i < 3; i++) {
            wt_make(&w[i], i == 2 ? cs[ci].vt : cs[ci].t, in, outs[i]);
            dw[i] = &w[i].d;
            hw[i] = &w[i].h;
            hb[i] = cs[ci].bias ? rnd_new(outs[i], -1, 1) : NULL;
            db[i] = cs[ci].bias ? gpu_dup(&F, hb[i], outs[i] * 4) : NULL;
        }
        float *x = rnd_new((size_t)rows * in, -1, 1), *dx = gpu_dup(&F, x, (size_t)rows * in * 4);
        uint32_t *dpos = gpu_dup(&F, pos, rows * 4), *dslot = gpu_dup(&F, slot, rows * 4);
        const struct rope_kv_args ra = {.n_head = nh,
                                        .n_rot = hd,
                                        .pos = dpos,
                                        .mode = cs[ci].mode,
                                        .base = 1e4f,
                                        .geom = &g,
                                        .layer = 1,
                                        .tok_slot = dslot};
        void *two[4], *one[4];
        unsigned long long l2 =
            qkv_rope_gpu(false, dw, (const float *const *)db, dx, rows, outs, harena, ab, &ra, two);
        unsigned long long l1 =
            qkv_rope_gpu(true, dw, (const float *const *)db, dx, rows, outs, harena, ab, &ra, one);
        char what[128];
        snprintf(what, sizeof what, "qkv + rope_kv %s/%s rows %u hd %u %s %s%s",
                 ctype_name(cs[ci].t), ctype_name(cs[ci].vt), rows, hd, kv_dtype_name(g.dtype),
                 cs[ci].mode == ROPE_NEOX ? "neox" : "norm", cs[ci].bias ? " + bias" : "");
        static const char *names[3] = {"q", "k", "v"};
        for (int i = 0; i < 3; i++)
            if (memcmp(one[i], two[i], (size_t)rows * outs[i] * 4))
                fail_msg("%s: %s differs from matmul_n + rope_kv_write", what, names[i]);
        if (memcmp(one[3], two[3], ab))
            fail_msg("%s: the KV arena differs from matmul_n + rope_kv_write", what);
#ifdef KVD_CUDA_EMULATE
        if (l1 != (rows <= 8 ? l2 - 1 : l2))
            fail_msg("%s: %llu launches fused, %llu as two ops", what, l1, l2);
#else
        (void)l1;
        (void)l2;
#endif
        /* q against the cpu's matmul (+ bias) and rope */
        float *hq = malloc((size_t)rows * outs[0] * 4);
        assert_int_equal(F.cops->matmul(F.ccx, hw[0], x, rows, hq), 0);
        if (cs[ci].bias)
            assert_int_equal(F.cops->add_bias(F.ccx, hq, hb[0], rows, outs[0]), 0);
        assert_int_equal(F.cops->rope(F.ccx, hq, rows, nh, hd, hd, pos, cs[ci].mode, 1e4f, NULL),
                         0);
        const enum ctype t = cs[ci].t;
        /* Q4_K: the cpu's bits (its float order); the others within f32
         * rounding of another order */
        if (t == CT_Q4_K ? memcmp(one[0], hq, (size_t)rows * outs[0] * 4) != 0
                         : !(rel_err(one[0], hq, (size_t)rows * outs[0]) <=
                             (ctype_is_quant(t) && t != CT_Q8_0 ? 1e-5 : 1e-4)))
            fail_msg("%s: q differs from the cpu's", what);
        free(hq);
        for (int i = 0; i < 4; i++) {
            free(one[i]);
            free(two[i]);
        }
        for (int i = 0; i < 3; i++) {
            wt_free(&w[i]);
            free(hb[i]);
            if (db[i])
                gpu_free(&F, db[i]);
        }
        free(x);
        free(harena);
        gpu_free(&F, dx);
        gpu_free(&F, dpos);
        gpu_free(&F, dslot);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_quantized_once),
        GPU_TEST(test_qkv_rope_kv),
    };
    gpu_fx_open(&F);
    gpu_fx_close(&F);
    if (getenv("KVD_TEST_FILTER")) /* e.g. KVD_TEST_FILTER='test_qkv*' */
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, gpu_fx_setup, gpu_fx_teardown);
}

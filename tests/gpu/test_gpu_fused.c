/* The cuda backend's fused ops (compute.h: matmul_n, matmul_swiglu,
 * matmul_add_rmsnorm, rope_kv_write) against the cpu backend's chain of the
 * ops each replaces, on fresh random inputs: every weight type, 1..8 rows
 * (the fused GEMV, every token count, one launch) and more (the chain on the
 * GEMM path), mixed weight types, biases; RoPE with the KV write for every KV
 * dtype, head_dim 64/128/256, GQA 1/4/8, both pair conventions, and
 * followed by the decode attention (its early loads, programmatic
 * dependent launch, against rope_kv's writes). The
 * K-quants' projections, RoPE and the KV bytes must equal the cpu's bit for
 * bit (Q4_K: the cpu's float order; Q5_K and Q6_K's cpu order, llama.cpp's
 * 8 lanes a super-block, is not the GEMV's); the other types' sums within
 * f32 rounding of another order. Outputs
 * are NaN-poisoned first. Skips (77) without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_kv.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "quant.h"

#define F gpu_F /* the program's fixture (gpu_fixture.h) */

static bool k_quant(enum ctype t)
{
    return t == CT_Q4_K || t == CT_Q5_K || t == CT_Q6_K;
}

/* The types whose GEMV gives the cpu's bits. */
static bool exact_type(enum ctype t)
{
    return t == CT_Q4_K;
}

/* got against ref: bit for bit when exact, else within tol of the largest. */
static void same(const char *what, const float *got, const float *ref, size_t n, bool exact,
                 double tol)
{
    if (exact) {
        for (size_t i = 0; i < n; i++)
            if (memcmp(&got[i], &ref[i], 4))
                fail_msg("%s: element %zu is %.9g, the cpu's %.9g", what, i, (double)got[i],
                         (double)ref[i]);
        return;
    }
    double e = rel_err(got, ref, n);
    if (!(e <= tol))
        fail_msg("%s: relative error %.3g over %.3g", what, e, tol);
}

/* A weight of type t, random (gpu_fixture.h). */
static void wt_make(struct gpu_wt *w, enum ctype t, uint32_t in, uint32_t out)
{
    gpu_wt_make(&F, w, t, in, out);
}

static void wt_free(struct gpu_wt *w)
{
    gpu_wt_free(&F, w);
}

static const enum ctype types[] = {CT_F32,  CT_F16,  CT_BF16, CT_Q8_0, CT_Q4_0, CT_Q4_1,
                                   CT_Q5_0, CT_Q5_1, CT_Q4_K, CT_Q5_K, CT_Q6_K};
#define N_TYPES (sizeof types / sizeof types[0])

/* Row counts: every token count of the fused GEMV once over the types, and
 * the GEMM path (12) for a few. */
static uint32_t rows_for(size_t ti, int k)
{
    static const uint32_t r[] = {1, 2, 3, 4, 5, 6, 7, 8};
    return k == 2 ? (ti % 4 == 0 ? 12 : 1) : r[(ti * 2 + (size_t)k) % 8];
}

/* Whether rows of type t take the GEMV: up to 8 rows, up to 32 of the
 * quantized types with no bf16 copy (8 rows a launch). */
static bool gemv_path(enum ctype t, uint32_t rows)
{
    return rows <= 8 || (rows <= 32 && ctype_is_quant(t) && t != CT_Q8_0);
}

static double tol_for(enum ctype t, uint32_t rows)
{
    if (!gemv_path(t, rows))
        return t == CT_F32 ? 1e-4 : 1.5e-2;
    return ctype_is_quant(t) && t != CT_Q8_0 ? 1e-5 : 1e-4;
}

/* q, k, v of one input: one type, or (K-quants) v in Q6_K as a Q4_K_M layer
 * has it (one row, batch-1 decode: one launch, its blocks take their type
 * from their rows), with qwen2's biases on every other case. */
static void test_matmul_n(void **state)
{
    rnd_seed(41);
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (int k = 0; k < 3; k++) {
            enum ctype t = types[ti], vt = k == 1 && k_quant(t) ? CT_Q6_K : t;
            uint32_t in = 512, outs[3] = {96, 32, 32}, rows = vt != t ? 1 : rows_for(ti, k);
            bool bias = (ti + (size_t)k) % 2;
            struct gpu_wt w[3];
            float *hy[3], *gy[3], *hb[3], *db[3];
            wt_make(&w[0], t, in, outs[0]);
            wt_make(&w[1], t, in, outs[1]);
            wt_make(&w[2], vt, in, outs[2]);
            float *x = rnd_new((size_t)rows * in, -1, 1);
            float *dx = gpu_dup(&F, x, (size_t)rows * in * 4);
            const struct ctensor *hw[3], *dw[3];
            for (int i = 0; i < 3; i++) {
                hw[i] = &w[i].h;
                dw[i] = &w[i].d;
                hy[i] = malloc((size_t)rows * outs[i] * 4);
                gy[i] = (float *)gpu_nan(&F, (size_t)rows * outs[i]);
                hb[i] = bias ? rnd_new(outs[i], -1, 1) : NULL;
                db[i] = bias ? gpu_dup(&F, hb[i], outs[i] * 4) : NULL;
                assert_int_equal(F.cops->matmul(F.ccx, hw[i], x, rows, hy[i]), 0);
                if (bias)
                    assert_int_equal(F.cops->add_bias(F.ccx, hy[i], hb[i], rows, outs[i]), 0);
            }
            const unsigned long long l0 = kvd_k_launches();
            assert_int_equal(
                F.gops->matmul_n(F.gcx, 3, dw, (const float *const *)db, dx, rows, 0, gy), 0);
            /* up to 8 rows: one launch, a Q6_K v too (one row) */
            if (rows <= 8 && kvd_k_launches() - l0 != 1)
                fail_msg("matmul_n %s/%s rows %u: %llu launches, not 1", ctype_name(t),
                         ctype_name(vt), rows, kvd_k_launches() - l0);
            for (int i = 0; i < 3; i++) {
                float *got = malloc((size_t)rows * outs[i] * 4);
                gpu_get(&F, got, gy[i], (size_t)rows * outs[i] * 4);
                char what[96];
                snprintf(what, sizeof what, "matmul_n %s/%s rows %u%s, output %d", ctype_name(t),
                         ctype_name(vt), rows, bias ? " + bias" : "", i);
                enum ctype ty = i == 2 ? vt : t;
                same(what, got, hy[i], (size_t)rows * outs[i],
                     gemv_path(ty, rows) && exact_type(ty), tol_for(ty, rows));
                free(got);
                free(hy[i]);
                free(hb[i]);
                gpu_free(&F, gy[i]);
                if (db[i])
                    gpu_free(&F, db[i]);
                wt_free(&w[i]);
            }
            free(x);
            gpu_free(&F, dx);
        }
}

static void test_matmul_swiglu(void **state)
{
    rnd_seed(42);
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (int k = 0; k < 3; k++) {
            enum ctype t = types[ti];
            uint32_t in = 256, ff = 160, rows = rows_for(ti, k);
            struct gpu_wt g, u;
            wt_make(&g, t, in, ff);
            wt_make(&u, t, in, ff);
            size_t N = (size_t)rows * ff;
            float *x = rnd_new((size_t)rows * in, -2, 2), *ref = malloc(N * 4),
                  *tmp = malloc(N * 4), *got = malloc(N * 4);
            assert_int_equal(F.cops->matmul(F.ccx, &g.h, x, rows, ref), 0);
            assert_int_equal(F.cops->matmul(F.ccx, &u.h, x, rows, tmp), 0);
            assert_int_equal(F.cops->silu_mul(F.ccx, ref, tmp, N), 0);
            float *dx = gpu_dup(&F, x, (size_t)rows * in * 4), *dout = gpu_nan(&F, N),
                  *dtmp = gpu_nan(&F, N);
            assert_int_equal(F.gops->matmul_swiglu(F.gcx, &g.d, &u.d, dx, rows, 0, dout, dtmp), 0);
            gpu_get(&F, got, dout, N * 4);
            char what[64];
            snprintf(what, sizeof what, "matmul_swiglu %s rows %u", ctype_name(t), rows);
            same(what, got, ref, N, gemv_path(t, rows) && exact_type(t), tol_for(t, rows));
            wt_free(&g);
            wt_free(&u);
            free(x);
            free(ref);
            free(tmp);
            free(got);
            gpu_free(&F, dx);
            gpu_free(&F, dout);
            gpu_free(&F, dtmp);
        }
}

/* x += xin . W^T, then out = rmsnorm(x) * w, or the add alone (the last
 * layer); the input 768 wide so the quantized activations of 8 rows do not
 * fit in shared memory for some types (the separate quantization). */
static void test_matmul_add_rmsnorm(void **state)
{
    rnd_seed(43);
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (int k = 0; k < 3; k++) {
            enum ctype t = types[ti];
            uint32_t in = k == 1 ? 6144 : 768, E = 192, rows = rows_for(ti, k);
            bool norm = k != 2 || ti % 2;
            struct gpu_wt w;
            wt_make(&w, t, in, E);
            size_t N = (size_t)rows * E;
            float *xin = rnd_new((size_t)rows * in, -1, 1), *x = rnd_new(N, -3, 3),
                  *nw = rnd_new(E, 0.5f, 1.5f), *rx = malloc(N * 4), *rout = malloc(N * 4),
                  *got = malloc(N * 4);
            memcpy(rx, x, N * 4);
            assert_int_equal(F.cops->matmul(F.ccx, &w.h, xin, rows, rout), 0);
            if (norm)
                assert_int_equal(F.cops->add_rmsnorm(F.ccx, rx, rout, rout, nw, rows, E, 1e-5f), 0);
            else
                assert_int_equal(F.cops->add(F.ccx, rx, rout, N), 0);
            float *dxin = gpu_dup(&F, xin, (size_t)rows * in * 4), *dx = gpu_dup(&F, x, N * 4),
                  *dnw = gpu_dup(&F, nw, E * 4), *dout = gpu_nan(&F, N);
            assert_int_equal(F.gops->matmul_add_rmsnorm(F.gcx, &w.d, dxin, rows, 0, dx,
                                                        norm ? dnw : NULL, 1e-5f, dout),
                             0);
            char what[96];
            snprintf(what, sizeof what, "matmul_add_rmsnorm %s in %u rows %u%s: residual",
                     ctype_name(t), in, rows, norm ? "" : " (no norm)");
            gpu_get(&F, got, dx, N * 4);
            same(what, got, rx, N, gemv_path(t, rows) && exact_type(t), tol_for(t, rows));
            if (norm) {
                snprintf(what, sizeof what, "matmul_add_rmsnorm %s in %u rows %u: norm",
                         ctype_name(t), in, rows);
                gpu_get(&F, got, dout, N * 4);
                /* the sum of squares in double in another order: an ulp of
                 * the scale now and then */
                same(what, got, rout, N, false,
                     gemv_path(t, rows) && exact_type(t) ? 2e-7 : tol_for(t, rows));
            }
            wt_free(&w);
            free(xin);
            free(x);
            free(nw);
            free(rx);
            free(rout);
            free(got);
            gpu_free(&F, dxin);
            gpu_free(&F, dx);
            gpu_free(&F, dnw);
            gpu_free(&F, dout);
        }
}

/* The residual norm's last block loads the residual rows and the norm's
 * weights once: its squares' pass keeps them in shared memory for the
 * scaling pass. The instrumented emulator counts the global loads of the
 * same launch with the norm and without it (the residual add alone): the
 * norm adds (tokens + 1) x rows x 4 bytes (each token's row, the weights
 * once) and each block's counter; reading the rows or the weights again
 * would add at least rows x 4 more. Rows of a multiple of 256 (the scaling
 * pass in the quantizers' layout) and not, 1-8 tokens; the norm against
 * the cpu's. */
static void test_norm_loads(void **state)
{
    (void)state;
    static const enum ctype ts[] = {CT_Q4_K, CT_Q6_K, CT_BF16};
    rnd_seed(47);
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++)
        for (uint32_t rows = 1; rows <= 8; rows++)
            for (int k = 0; k < 2; k++) {
                enum ctype t = ts[ti];
                uint32_t in = 256, E = k ? 192 : 512;
                struct gpu_wt w;
                wt_make(&w, t, in, E);
                size_t N = (size_t)rows * E;
                float *xin = rnd_new((size_t)rows * in, -1, 1), *x = rnd_new(N, -3, 3),
                      *nw = rnd_new(E, 0.5f, 1.5f), *rout = malloc(N * 4), *got = malloc(N * 4);
                assert_int_equal(F.cops->matmul(F.ccx, &w.h, xin, rows, rout), 0);
                float *dxin = gpu_dup(&F, xin, (size_t)rows * in * 4), *dx0 = gpu_dup(&F, x, N * 4),
                      *dx = gpu_dup(&F, x, N * 4), *dnw = gpu_dup(&F, nw, E * 4),
                      *dout = gpu_nan(&F, N);
                assert_int_equal(F.cops->add_rmsnorm(F.ccx, x, rout, rout, nw, rows, E, 1e-5f), 0);
                unsigned long long b0 = gpu_load_bytes();
                assert_int_equal(
                    F.gops->matmul_add_rmsnorm(F.gcx, &w.d, dxin, rows, 0, dx0, NULL, 1e-5f, dout),
                    0);
                gpu_get(&F, got, dx0, 4);
                unsigned long long b1 = gpu_load_bytes();
                assert_int_equal(
                    F.gops->matmul_add_rmsnorm(F.gcx, &w.d, dxin, rows, 0, dx, dnw, 1e-5f, dout),
                    0);
                gpu_get(&F, got, dout, N * 4);
                unsigned long long b2 = gpu_load_bytes();
                char what[96];
                snprintf(what, sizeof what, "norm %s rows %u tokens %u", ctype_name(t), E, rows);
                same(what, got, rout, N, false, exact_type(t) ? 2e-7 : tol_for(t, rows));
                if (b1 > b0) { /* the instrumented emulator */
                    long long norm = (long long)(b2 - b1) - (long long)(b1 - b0);
                    long long once = (long long)(rows + 1) * E * 4;
                    if (norm < once || norm >= once + (long long)E * 4)
                        fail_msg("%s: the norm loads %lld bytes, %lld expected (and the counter)",
                                 what, norm, once);
                }
                wt_free(&w);
                free(xin);
                free(x);
                free(nw);
                free(rout);
                free(got);
                gpu_free(&F, dxin);
                gpu_free(&F, dx0);
                gpu_free(&F, dx);
                gpu_free(&F, dnw);
                gpu_free(&F, dout);
            }
}

/* RoPE of q and k with the write of k and v, against rope, rope, kv_write
 * on the cpu: q, k and the whole arena bit for bit. */
static void test_rope_kv_write(void **state)
{
    static const uint32_t hds[] = {64, 128, 256}, gqa[] = {1, 4, 8};
    rnd_seed(44);
    int c = 0;
    for (int dt = 0; dt < 5; dt++)
        for (size_t hi = 0; hi < 3; hi++)
            for (size_t gi = 0; gi < 3; gi++, c++) {
                if ((dt + (int)hi + (int)gi) % 3 && dt != KV_F16)
                    continue; /* every dtype x head_dim x group once; f16 all */
                const uint32_t hd = hds[hi], kvh = 2, nh = kvh * gqa[gi], bt = 16, nb = 6;
                const uint32_t T = 5, n_rot = c % 4 == 3 ? hd / 2 : hd;
                const enum rope_mode mode = c % 2 ? ROPE_NEOX : ROPE_NORM;
                struct kv_geom g = {
                    .layers = 2, .kv_heads = kvh, .head_dim = hd, .dtype = dt, .block_tokens = bt};
                size_t ab = kv_block_bytes(&g) * nb;
                uint8_t *harena = malloc(ab), *garena = malloc(ab);
                for (size_t i = 0; i < ab; i++)
                    harena[i] = (uint8_t)rnd_u32(256);
                uint32_t pos[5], slot[5];
                for (uint32_t t = 0; t < T; t++) {
                    pos[t] = rnd_u32(20000);
                    slot[t] = t == 3 ? COMPUTE_PAD_SLOT : t; /* a padding row writes nothing */
                }
                size_t QN = (size_t)T * nh * hd, KN = (size_t)T * kvh * hd;
                float *q = rnd_new(QN, -2, 2), *k = rnd_new(KN, -2, 2), *v = rnd_new(KN, -2, 2),
                      *ff = c % 3 == 1 ? rnd_new(n_rot / 2, 1, 8) : NULL;
                float *gq = malloc(QN * 4), *gk = malloc(KN * 4);
                void *da = gpu_dup(&F, harena, ab);
                float *dq = gpu_dup(&F, q, QN * 4), *dk = gpu_dup(&F, k, KN * 4),
                      *dv = gpu_dup(&F, v, KN * 4),
                      *dff = ff ? gpu_dup(&F, ff, n_rot / 2 * 4) : NULL;
                uint32_t *dpos = gpu_dup(&F, pos, sizeof pos),
                         *dslot = gpu_dup(&F, slot, sizeof slot);
                assert_int_equal(F.cops->rope(F.ccx, q, T, nh, hd, n_rot, pos, mode, 1e4f, ff), 0);
                assert_int_equal(F.cops->rope(F.ccx, k, T, kvh, hd, n_rot, pos, mode, 1e4f, ff), 0);
                /* the cpu op skips a padding row too */
                assert_int_equal(F.cops->kv_write(F.ccx, harena, &g, 1, k, v, T, slot, pos), 0);
                assert_int_equal(F.gops->rope_kv_write(F.gcx, dq, dk, dv, T, nh, n_rot, dpos, mode,
                                                       1e4f, dff, da, &g, 1, dslot),
                                 0);
                gpu_get(&F, gq, dq, QN * 4);
                gpu_get(&F, gk, dk, KN * 4);
                gpu_get(&F, garena, da, ab);
                char what[96];
                snprintf(what, sizeof what, "rope_kv_write %s hd %u heads %u/%u rot %u %s%s",
                         kv_dtype_name((enum kv_dtype)dt), hd, nh, kvh, n_rot,
                         mode == ROPE_NEOX ? "neox" : "norm", ff ? " freqs" : "");
                same(what, gq, q, QN, true, 0);
                same(what, gk, k, KN, true, 0);
                if (memcmp(garena, harena, ab))
                    fail_msg("%s: the KV arena differs from the cpu's", what);
                free(harena);
                free(garena);
                free(q);
                free(k);
                free(v);
                free(ff);
                free(gq);
                free(gk);
                gpu_free(&F, da);
                gpu_free(&F, dq);
                gpu_free(&F, dk);
                gpu_free(&F, dv);
                if (dff)
                    gpu_free(&F, dff);
                gpu_free(&F, dpos);
                gpu_free(&F, dslot);
            }
}

/* RoPE with the KV write, then the decode attention right after it on the
 * stream (as a decode step runs them), against rope, rope, kv_write and
 * attention on the cpu. The attention kernel is a programmatic dependent
 * launch: on the emulated sm_90 any row rope_kv writes (the new token's)
 * read before its wait is reported. Contexts put the new token in a split's first step, in its
 * second and in a later one; split and unsplit. */
static void test_rope_kv_attention(void **state)
{
    static const uint32_t pos0s[] = {3, 20, 701, 150};
    static const struct {
        int dt;
        uint32_t hd, group;
    } cases[] = {{KV_BF16, 128, 4}, {KV_F16, 64, 8}, {KV_Q8_0, 128, 1}, {KV_F32, 64, 4}};
    const uint32_t S = 4, kvh = 2, bt = 16;
    rnd_seed(45);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const uint32_t hd = cases[c].hd, nh = kvh * cases[c].group;
        struct kv_geom g = {.layers = 2,
                            .kv_heads = kvh,
                            .head_dim = hd,
                            .dtype = (enum kv_dtype)cases[c].dt,
                            .block_tokens = bt};
        uint32_t qstart[5], pos0[4], slot0[5], NS = 0, max_kv = 0;
        for (uint32_t i = 0; i < S; i++) {
            qstart[i] = i;
            pos0[i] = pos0s[i];
            slot0[i] = NS;
            NS += pos0s[i] / bt + 1;
            max_kv = pos0s[i] + 1 > max_kv ? pos0s[i] + 1 : max_kv;
        }
        qstart[S] = S;
        slot0[S] = NS;
        const uint32_t nb = NS + 2;
        uint32_t *slots = malloc(NS * 4), tok_slot[4];
        for (uint32_t i = 0; i < NS; i++)
            slots[i] = (i * 5 + 1) % nb == nb - 1 ? nb - 2 : (i * 5 + 1) % nb;
        for (uint32_t i = 0; i < NS; i++) /* injective */
            for (uint32_t j = 0; j < i; j++)
                if (slots[j] == slots[i])
                    slots[i] = (slots[i] + 1) % nb, j = (uint32_t)-1;
        for (uint32_t i = 0; i < S; i++)
            tok_slot[i] = slots[slot0[i] + pos0[i] / bt];
        /* the context before each new token, written as the cpu writes KV */
        size_t ab = kv_block_bytes(&g) * nb;
        uint8_t *harena = calloc(1, ab), *garena = malloc(ab);
        for (uint32_t i = 0; i < S; i++)
            for (uint32_t p = 0; p < pos0[i]; p++) {
                float *k = rnd_new(kvh * hd, -2, 2), *v = rnd_new(kvh * hd, -2, 2);
                uint32_t sl = slots[slot0[i] + p / bt];
                assert_int_equal(F.cops->kv_write(F.ccx, harena, &g, 1, k, v, 1, &sl, &p), 0);
                free(k);
                free(v);
            }
        size_t QN = (size_t)S * nh * hd, KN = (size_t)S * kvh * hd;
        float *q = rnd_new(QN, -2, 2), *k = rnd_new(KN, -2, 2), *v = rnd_new(KN, -2, 2);
        float *ref = malloc(QN * 4), *got = malloc(QN * 4);
        void *da = gpu_dup(&F, harena, ab);
        float *dq = gpu_dup(&F, q, QN * 4), *dk = gpu_dup(&F, k, KN * 4),
              *dv = gpu_dup(&F, v, KN * 4), *dout = gpu_nan(&F, QN);
        uint32_t *dpos = gpu_dup(&F, pos0, sizeof pos0),
                 *dts = gpu_dup(&F, tok_slot, sizeof tok_slot),
                 *dqs = gpu_dup(&F, qstart, sizeof qstart), *ds0 = gpu_dup(&F, slot0, sizeof slot0),
                 *dslots = gpu_dup(&F, slots, NS * 4);
        assert_int_equal(F.cops->rope(F.ccx, q, S, nh, hd, hd, pos0, ROPE_NORM, 1e4f, NULL), 0);
        assert_int_equal(F.cops->rope(F.ccx, k, S, kvh, hd, hd, pos0, ROPE_NORM, 1e4f, NULL), 0);
        assert_int_equal(F.cops->kv_write(F.ccx, harena, &g, 1, k, v, S, tok_slot, pos0), 0);
        struct attn_desc d = {.q = q,
                              .out = ref,
                              .arena = harena,
                              .geom = &g,
                              .layer = 1,
                              .n_head = nh,
                              .scale = 1.0f / sqrtf((float)hd),
                              .n_tokens = S,
                              .n_seqs = S,
                              .seq_qstart = qstart,
                              .seq_pos0 = pos0,
                              .seq_slot0 = slot0,
                              .slots = slots,
                              .max_q = 1,
                              .max_kv = max_kv,
                              .h_seq_qstart = qstart,
                              .h_seq_pos0 = pos0};
        assert_int_equal(F.cops->attention(F.ccx, &d), 0);
        struct attn_desc gd = d;
        gd.q = dq;
        gd.out = dout;
        gd.arena = da;
        gd.seq_qstart = dqs;
        gd.seq_pos0 = dpos;
        gd.seq_slot0 = ds0;
        gd.slots = dslots;
        /* once to grow the backend's scratch (its first memset would end
         * the record of rope_kv's stores), then the pair back to back */
        assert_int_equal(F.gops->attention(F.gcx, &gd), 0);
        assert_int_equal(F.gops->rope_kv_write(F.gcx, dq, dk, dv, S, nh, hd, dpos, ROPE_NORM, 1e4f,
                                               NULL, da, &g, 1, dts),
                         0);
        assert_int_equal(F.gops->attention(F.gcx, &gd), 0);
        gpu_get(&F, got, dout, QN * 4);
        gpu_get(&F, garena, da, ab);
        char what[96];
        snprintf(what, sizeof what, "rope_kv_write + attention %s hd %u heads %u/%u",
                 kv_dtype_name(g.dtype), hd, nh, kvh);
        if (memcmp(garena, harena, ab))
            fail_msg("%s: the KV arena differs from the cpu's", what);
        /* Query groups of 3 and more at head_dim 64 and 128 with f16, bf16
         * or q8_0 rows: the tensor-core decode kernel (16-bit Q and
         * weights: test_gpu_attn's tolerances). */
        double tol = 2e-5;
        if ((g.dtype == KV_F16 || g.dtype == KV_BF16 || g.dtype == KV_Q8_0) &&
            (hd == 64 || hd == 128) && nh / kvh >= 3)
            tol = g.dtype == KV_BF16 ? 1e-2 : 2e-3;
        same(what, got, ref, QN, false, tol);
        /* A plain decode step's attention (early: every row but the newest
         * written by earlier steps) loads its first rows before the PDL
         * wait, a verification step's (early 0) none: the same bytes out,
         * at least a K and a V row of each KV head more before the wait
         * (f16, bf16, q8_0, fp8 rows of head_dim up to 128). */
        struct kvd_k_kv kv = {.arena = da,
                              .block_bytes = kv_block_bytes(&g),
                              .layers = (int)g.layers,
                              .kv_heads = (int)g.kv_heads,
                              .head_dim = (int)g.head_dim,
                              .block_tokens = (int)g.block_tokens,
                              .dtype = (int)g.dtype,
                              .row_bytes = kv_row_bytes(g.dtype, g.head_dim)};
        unsigned long long pre[2];
        float *outs[2];
        for (int early = 0; early < 2; early++) {
            float *o = gpu_nan(&F, QN);
            const unsigned long long a = gpu_prewait_load_bytes();
            assert_int_equal(kvd_k_attn_decode(o, dq, &kv, 1, dslots, ds0, dpos, dqs, (int)S,
                                               (int)nh, gd.scale, 1, NULL, NULL, early, NULL),
                             0);
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
            pre[early] = gpu_prewait_load_bytes() - a;
            outs[early] = malloc(QN * 4);
            gpu_get(&F, outs[early], o, QN * 4);
            gpu_free(&F, o);
        }
        if (memcmp(outs[0], outs[1], QN * 4))
            fail_msg("%s: the attention with its rows loaded early differs", what);
#ifdef KVD_EMU_MEMCHECK
        /* (not f32 rows nor head_dim 256: the kernel keeps the late order) */
        if (g.dtype != KV_F32 && hd <= 128 && pre[1] < pre[0] + 2 * kvh * kv.row_bytes)
            fail_msg("%s: %llu bytes loaded before the wait in a plain decode step, %llu in a "
                     "verification step's order",
                     what, pre[1], pre[0]);
#else
        (void)pre;
#endif
        free(outs[0]);
        free(outs[1]);
        free(harena);
        free(garena);
        free(slots);
        free(q);
        free(k);
        free(v);
        free(ref);
        free(got);
        gpu_free(&F, da);
        gpu_free(&F, dq);
        gpu_free(&F, dk);
        gpu_free(&F, dv);
        gpu_free(&F, dout);
        gpu_free(&F, dpos);
        gpu_free(&F, dts);
        gpu_free(&F, dqs);
        gpu_free(&F, ds0);
        gpu_free(&F, dslots);
    }
}

/* Batch-invariant rows (n_one): of 12 rows, the first 10 must each equal,
 * bit for bit, the same op called on that row alone (the one-row GEMV, as a
 * plain decode computes it), whatever the other rows are; the 2 after them
 * take the GEMM chain. For each fused GEMV op, on a K-quant and a float
 * type. */
static void test_invariant_rows(void **state)
{
    static const enum ctype ts[] = {CT_Q4_K, CT_Q6_K, CT_BF16};
    rnd_seed(44);
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++) {
        const enum ctype t = ts[ti];
        const uint32_t in = 256, out = 96, rows = 12, n_one = 10;
        struct gpu_wt a, b;
        wt_make(&a, t, in, out);
        wt_make(&b, t, in, out);
        const size_t N = (size_t)rows * out;
        float *x = rnd_new((size_t)rows * in, -2, 2), *res = rnd_new(N, -1, 1),
              *nw = rnd_new(out, 0.5f, 1.5f), *all = malloc(N * 4), *one = malloc(out * 4);
        float *dx = gpu_dup(&F, x, (size_t)rows * in * 4), *dnw = gpu_dup(&F, nw, out * 4);
        for (int op = 0; op < 3; op++) {
            const char *name = op == 0 ? "matmul_n" : op == 1 ? "matmul_swiglu" : "add_rmsnorm";
            /* all rows at once, then each invariant row alone */
            for (uint32_t r = 0; r <= n_one; r++) {
                const uint32_t nr = r == 0 ? rows : 1, r0 = r == 0 ? 0 : r - 1;
                const float *xr = dx + (size_t)r0 * in;
                float *dy = gpu_nan(&F, (size_t)nr * out),
                      *dy2 = op == 2 ? gpu_dup(&F, res + (size_t)r0 * out, (size_t)nr * out * 4)
                                     : gpu_nan(&F, (size_t)nr * out);
                if (op == 0) {
                    const struct ctensor *w[2] = {&a.d, &b.d};
                    const float *bias[2] = {NULL, NULL};
                    float *y[2] = {dy, dy2};
                    assert_int_equal(
                        F.gops->matmul_n(F.gcx, 2, w, bias, xr, nr, nr == 1 ? 0 : n_one, y), 0);
                } else if (op == 1) {
                    assert_int_equal(F.gops->matmul_swiglu(F.gcx, &a.d, &b.d, xr, nr,
                                                           nr == 1 ? 0 : n_one, dy, dy2),
                                     0);
                } else {
                    assert_int_equal(F.gops->matmul_add_rmsnorm(F.gcx, &a.d, xr, nr,
                                                                nr == 1 ? 0 : n_one, dy2, dnw,
                                                                1e-5f, dy),
                                     0);
                }
                if (r == 0) {
                    gpu_get(&F, all, dy, N * 4);
                } else {
                    gpu_get(&F, one, dy, out * 4);
                    if (memcmp(one, all + (size_t)r0 * out, out * 4))
                        fail_msg("%s %s: row %u of %u (%u invariant) differs from the row alone",
                                 name, ctype_name(t), r0, rows, n_one);
                }
                gpu_free(&F, dy);
                gpu_free(&F, dy2);
            }
        }
        wt_free(&a);
        wt_free(&b);
        free(x);
        free(res);
        free(nw);
        free(all);
        free(one);
        gpu_free(&F, dx);
        gpu_free(&F, dnw);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_matmul_n),           GPU_TEST(test_matmul_swiglu),
        GPU_TEST(test_matmul_add_rmsnorm), GPU_TEST(test_norm_loads),
        GPU_TEST(test_rope_kv_write),      GPU_TEST(test_rope_kv_attention),
        GPU_TEST(test_invariant_rows),
    };
    gpu_fx_open(&F);
    gpu_fx_close(&F);
    if (getenv("KVD_TEST_FILTER")) /* e.g. KVD_TEST_FILTER='test_attention*' */
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, gpu_fx_setup, gpu_fx_teardown);
}

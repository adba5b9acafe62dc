/* Every cuda compute op against the cpu backend's op (the reference) on
 * fresh random inputs of several shapes. GPU outputs are poisoned with NaN
 * before each run, so an element the kernel never wrote fails. Tolerances:
 * f32 math ~1e-5..1e-4 relative; the bf16 cuBLAS path (over 8 rows, non-f32
 * weights) 1e-2. Skips (77) without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute_cpu_impl.h"
#include "compute_cpu_kv.h"
#include "backend_cuda.h"
#include "op_cases.h"
#include "compute_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "quant.h"

#define F gpu_F /* the program's fixture (gpu_fixture.h) */

static void check(const char *what, const float *got, const float *ref, size_t n, double tol)
{
    double e = rel_err(got, ref, n);
    if (!(e <= tol))
        fail_msg("%s: relative error %.3g over %.3g", what, e, tol);
}

/* ---- weights in each GGUF type ------------------------------------------ */

/* Host bytes of w [rows][n] in type t; *deq gets the values the type holds. */
static void *make_weight(enum ctype t, const float *w, size_t rows, size_t n, float *deq,
                         size_t *bytes)
{
    size_t rb = ctype_row_bytes(t, n);
    uint8_t *b = malloc(rb * rows);
    assert_non_null(b);
    for (size_t r = 0; r < rows; r++) {
        const float *x = w + r * n;
        uint8_t *o = b + r * rb;
        for (size_t i = 0; i < n; i++) {
            switch (t) {
            case CT_F32:
                memcpy(o + 4 * i, &x[i], 4);
                break;
            case CT_F16:
                ((uint16_t *)o)[i] = float_to_half(x[i]);
                break;
            case CT_BF16:
                ((uint16_t *)o)[i] = float_to_bf16(x[i]);
                break;
            default:
                break;
            }
        }
        if (t == CT_Q8_0) {
            for (size_t blk = 0; blk < n / 32; blk++) {
                float amax = 0;
                for (int j = 0; j < 32; j++)
                    amax = fmaxf(amax, fabsf(x[blk * 32 + j]));
                float d = amax / 127.0f;
                uint16_t dh = float_to_half(d);
                float dd = half_to_float(dh);
                uint8_t *q = o + blk * 34;
                memcpy(q, &dh, 2);
                for (int j = 0; j < 32; j++) {
                    float v = dd > 0 ? roundf(x[blk * 32 + j] / dd) : 0;
                    v = fminf(127, fmaxf(-127, v));
                    q[2 + j] = (uint8_t)(int8_t)v;
                }
            }
        }
        if (deq)
            cpu_row_to_f32(t, o, deq + r * n, (uint32_t)n);
    }
    *bytes = rb * rows;
    return b;
}

static void test_get_rows(void **state)
{
    rnd_seed(1);
    for (size_t ti = 0; ti < OP_CASES_N(op_float_types); ti++) {
        enum ctype t = op_float_types[ti];
        uint32_t ne0 = ti % 2 ? 96 : 2048, ne1 = 50, n = 7;
        float *w = rnd_new((size_t)ne0 * ne1, -2, 2);
        size_t bytes;
        void *hb = make_weight(t, w, ne1, ne0, NULL, &bytes);
        uint32_t ids[7];
        for (uint32_t i = 0; i < n; i++)
            ids[i] = rnd_u32(ne1);
        struct ctensor hc = {.type = t, .ne0 = ne0, .ne1 = ne1, .nbytes = bytes, .data = hb};
        struct ctensor gc = hc;
        gc.data = gpu_dup(&F, hb, bytes);
        float *ref = malloc((size_t)n * ne0 * 4), *got = malloc((size_t)n * ne0 * 4);
        assert_int_equal(F.cops->get_rows(F.ccx, &hc, ids, n, ref), 0);
        uint32_t *dids = gpu_dup(&F, ids, sizeof ids);
        float *dout = gpu_nan(&F, (size_t)n * ne0);
        assert_int_equal(F.gops->get_rows(F.gcx, &gc, dids, n, dout), 0);
        gpu_get(&F, got, dout, (size_t)n * ne0 * 4);
        check(ctype_name(t), got, ref, (size_t)n * ne0, 1e-7);
        gpu_free(&F, gc.data);
        gpu_free(&F, dids);
        gpu_free(&F, dout);
        free(w);
        free(hb);
        free(ref);
        free(got);
    }
}

/* ---- the quantized weight types (Q4_0 .. Q6_K) ---------------------------- */

/* Rows of random weights in type t, quantized as kvd-gguf-gen does; a few
 * rows are all zero, one has a huge outlier (the scale search's edge). */
static void *make_qweight(enum ctype t, uint32_t rows, uint32_t n, size_t *bytes)
{
    size_t rb = ctype_row_bytes(t, n);
    uint8_t *b = malloc(rb * rows);
    float *w = rnd_new(n, -1, 1);
    assert_non_null(b);
    for (uint32_t r = 0; r < rows; r++) {
        rnd_fill(w, n, -1, 1);
        if (r % 17 == 5)
            memset(w, 0, n * sizeof *w);
        if (r % 13 == 7)
            w[rnd_u32(n)] = 40.0f;
        assert_int_equal(quant_quantize_row(t, w, b + r * rb, n), 0);
    }
    free(w);
    *bytes = rb * rows;
    return b;
}

/* get_rows of every type: the values quant_dequant_row defines (to the
 * last bit but for a fused multiply-add's rounding). */
static void test_quant_get_rows(void **state)
{
    rnd_seed(11);
    for (size_t ti = 0; ti < OP_CASES_N(op_quant_types); ti++) {
        enum ctype t = op_quant_types[ti];
        uint32_t ne0 = ti % 2 ? 512 : 1024, ne1 = 40, n = 9;
        size_t bytes;
        void *hb = make_qweight(t, ne1, ne0, &bytes);
        uint32_t ids[9];
        for (uint32_t i = 0; i < n; i++)
            ids[i] = rnd_u32(ne1);
        struct ctensor hc = {.type = t, .ne0 = ne0, .ne1 = ne1, .nbytes = bytes, .data = hb};
        struct ctensor gc = hc;
        gc.data = gpu_dup(&F, hb, bytes);
        float *ref = malloc((size_t)n * ne0 * 4), *got = malloc((size_t)n * ne0 * 4);
        for (uint32_t i = 0; i < n; i++)
            assert_int_equal(
                quant_dequant_row(t, (const uint8_t *)hb + ids[i] * ctype_row_bytes(t, ne0),
                                  ref + (size_t)i * ne0, ne0),
                0);
        uint32_t *dids = gpu_dup(&F, ids, sizeof ids);
        float *dout = gpu_nan(&F, (size_t)n * ne0);
        assert_int_equal(F.gops->get_rows(F.gcx, &gc, dids, n, dout), 0);
        gpu_get(&F, got, dout, (size_t)n * ne0 * 4);
        check(ctype_name(t), got, ref, (size_t)n * ne0, 1e-6);
        /* and the cpu backend's op, the same reference */
        assert_int_equal(F.cops->get_rows(F.ccx, &hc, ids, n, ref), 0);
        check(ctype_name(t), got, ref, (size_t)n * ne0, 1e-6);
        /* a matrix loaded as the model loads it (the plane layout: a tied
         * embedding is also the head) */
        struct ctensor pc = hc;
        assert_int_equal(F.gops->buf_alloc(F.gcx, F.gops->weight_bytes(&pc), &pc.data), 0);
        assert_int_equal(F.gops->weight_upload(F.gcx, &pc, hb), 0);
        assert_int_equal(pc.layout, CL_PLANES);
        assert_int_equal(F.gops->get_rows(F.gcx, &pc, dids, n, dout), 0);
        gpu_get(&F, got, dout, (size_t)n * ne0 * 4);
        check(ctype_name(t), got, ref, (size_t)n * ne0, 1e-6);
        gpu_free(&F, pc.data);
        gpu_free(&F, gc.data);
        gpu_free(&F, dids);
        gpu_free(&F, dout);
        free(hb);
        free(ref);
        free(got);
    }
}

/* y = x W^T in double from quant_dequant_row's values, for the GEMM path
 * (bf16 weights and activations against the exact product). */
static void ref_double(enum ctype t, const void *w, const float *x, uint32_t in, uint32_t out,
                       uint32_t rows, float *y)
{
    float *wr = malloc(in * sizeof *wr);
    size_t rb = ctype_row_bytes(t, in);
    for (uint32_t j = 0; j < out; j++) {
        assert_int_equal(quant_dequant_row(t, (const uint8_t *)w + j * rb, wr, in), 0);
        for (uint32_t r = 0; r < rows; r++) {
            double s = 0;
            for (uint32_t i = 0; i < in; i++)
                s += (double)wr[i] * x[(size_t)r * in + i];
            y[(size_t)r * out + j] = (float)s;
        }
    }
    free(wr);
}

/* matmul of every type against the cpu backend's: up to 32 rows the
 * quantized GEMV (8 rows a launch; the K-quants past 8 rows the int8 GEMM,
 * the GEMV's bits; the cpu's arithmetic: only the float additions' order
 * differs, Q4_K not even that), above that the bf16 GEMM over dequantized
 * tiles for the legacy types (a small tile, so a matrix spans several) and
 * the int8 GEMM for the K-quants, against the exact product within bf16
 * rounding. */
static void test_quant_matmul(void **state)
{
    rnd_seed(12);
    cuda_compute_set_tile_elems(F.gcx, 5000); /* 19 rows of 256, 9 of 512 */
    for (size_t ti = 0; ti < OP_CASES_N(op_quant_types); ti++) {
        for (size_t s = 0; s < OP_CASES_N(op_qmatmul_cases); s++) {
            enum ctype t = op_quant_types[ti];
            const struct op_mm_case *c = &op_qmatmul_cases[s];
            uint32_t in = c->in, out = c->out, rows = c->rows;
            size_t bytes;
            void *hb = make_qweight(t, out, in, &bytes);
            float *x = rnd_new((size_t)rows * in, -1, 1);
            if (rows > 2) /* a zero activation row (its int8 scale is 0) */
                memset(x + in, 0, in * sizeof *x);
            struct ctensor hc = {.type = t, .ne0 = in, .ne1 = out, .nbytes = bytes, .data = hb};
            struct ctensor gc = hc;
            assert_int_equal(F.gops->buf_alloc(F.gcx, F.gops->weight_bytes(&gc), &gc.data), 0);
            assert_int_equal(F.gops->weight_upload(F.gcx, &gc, hb), 0);
            assert_int_equal(gc.layout, CL_PLANES); /* repacked, no bf16 copy */
            assert_int_equal(gc.nbytes, bytes);
            size_t N = (size_t)rows * out;
            float *ref = malloc(N * 4), *got = malloc(N * 4);
            float *dx = gpu_dup(&F, x, (size_t)rows * in * 4), *dy = gpu_nan(&F, N);
            assert_int_equal(F.gops->matmul(F.gcx, &gc, dx, rows, dy), 0);
            gpu_get(&F, got, dy, N * 4);
            char what[96];
            snprintf(what, sizeof what, "matmul %s in %u out %u rows %u", ctype_name(t), in, out,
                     rows);
            if (rows <= 32) {
                /* The same integer dots. Q4_K's float part runs per
                 * super-block in the cpu's order: the same bits. Q5_K and
                 * Q6_K's cpu arithmetic (llama.cpp's: 8 int32 lanes a
                 * super-block, each with its own float accumulator) is not
                 * the GEMV's (one sum a super-block), nor are the legacy
                 * types' float sums of the blocks' products in the cpu's
                 * order, which cancellation between blocks of opposite sign
                 * lifts to a few 1e-6 of the largest output (4.5e-6 seen on
                 * q5_0). */
                assert_int_equal(F.cops->matmul(F.ccx, &hc, x, rows, ref), 0);
                if (t == CT_Q4_K) {
                    for (size_t i = 0; i < N; i++)
                        if (memcmp(&got[i], &ref[i], 4))
                            fail_msg("%s: output %zu is %.9g, the cpu's %.9g", what, i,
                                     (double)got[i], (double)ref[i]);
                } else {
                    check(what, got, ref, N, 1e-5);
                }
            } else {
                ref_double(t, hb, x, in, out, rows, ref);
                check(what, got, ref, N, 1e-2);
            }
            gpu_free(&F, gc.data);
            gpu_free(&F, dx);
            gpu_free(&F, dy);
            free(x);
            free(hb);
            free(ref);
            free(got);
        }
    }
    cuda_compute_set_tile_elems(F.gcx, CUDA_TILE_ELEMS_DEFAULT);
}

/* A weight that reached the GEMM path without weight_upload, in a context
 * whose tile is too small for it, is refused (not read out of bounds), and
 * bad shapes are refused by the kernels. */
static void test_quant_refusals(void **state)
{
    kvd_stream st = (kvd_stream)cuda_backend_dev(F.cuda)->compute;
    struct compute_ctx *cx = NULL;
    assert_int_equal(F.gops->ctx_new(F.cuda, &(struct compute_conf){0}, &cx), 0);
    rnd_seed(13);
    size_t bytes;
    void *hb = make_qweight(CT_Q4_K, 64, 512, &bytes);
    struct ctensor gc = {.type = CT_Q4_K, .ne0 = 512, .ne1 = 64, .nbytes = bytes};
    gc.data = gpu_dup(&F, hb, bytes);
    float *dx = gpu_nan(&F, 16 * 512), *dy = gpu_nan(&F, 16 * 64);
    assert_int_equal(F.gops->matmul(cx, &gc, dx, 16, dy), KVD_EINTERNAL);
    /* a row length that is not whole super-blocks */
    assert_int_equal(kvd_k_to_bf16((uint16_t *)dy, gc.data, KVD_KW_Q4_K, 300, st),
                     (int)cudaErrorInvalidValue);
    /* the same weight, not repacked at load, on the GEMV path */
    assert_int_equal(F.gops->matmul(cx, &gc, dx, 2, dy), KVD_EINTERNAL);
    assert_int_equal(kvd_k_gemv_ok(KVD_KW_Q4_K, gc.data, dx, 1, 500), 0);
    assert_int_equal(kvd_k_gemv_ok(KVD_KW_Q4_K, (const char *)gc.data + 8, dx, 1, 512), 0);
    assert_int_equal(kvd_k_gemv_ok(KVD_KW_Q4_K, gc.data, dx, 9, 512), 0);
    assert_int_equal(kvd_k_gemv_ok(KVD_KW_Q4_0, gc.data, dx, 1, 48), 0);
    assert_int_equal(kvd_k_gemv_ok(KVD_KW_Q4_K, gc.data, dx, 8, 512), 1);
    assert_int_equal(kvd_k_get_rows(dy, gc.data, 99, 512, 64, NULL, 1, st),
                     (int)cudaErrorInvalidValue);
    F.gops->ctx_free(cx);
    gpu_free(&F, gc.data);
    gpu_free(&F, dx);
    gpu_free(&F, dy);
    free(hb);
}

static void test_rmsnorm(void **state)
{
    rnd_seed(2);
    for (size_t s = 0; s < OP_CASES_N(op_rmsnorm_cases); s++) {
        uint32_t rows = op_rmsnorm_cases[s][0], n = op_rmsnorm_cases[s][1];
        size_t N = (size_t)rows * n;
        float *x = rnd_new(N, -3, 3), *w = rnd_new(n, 0.5f, 1.5f), *ref = malloc(N * 4),
              *got = malloc(N * 4);
        assert_int_equal(F.cops->rmsnorm(F.ccx, ref, x, w, rows, n, 1e-5f), 0);
        float *dx = gpu_dup(&F, x, N * 4), *dw = gpu_dup(&F, w, n * 4), *dy = gpu_nan(&F, N);
        assert_int_equal(F.gops->rmsnorm(F.gcx, dy, dx, dw, rows, n, 1e-5f), 0);
        gpu_get(&F, got, dy, N * 4);
        check("rmsnorm", got, ref, N, 1e-6);
        /* in place (out == x), as model_forward does for the last rows */
        assert_int_equal(F.gops->rmsnorm(F.gcx, dx, dx, dw, rows, n, 1e-5f), 0);
        gpu_get(&F, got, dx, N * 4);
        check("rmsnorm in place", got, ref, N, 1e-6);
        gpu_free(&F, dx);
        gpu_free(&F, dw);
        gpu_free(&F, dy);
        free(x);
        free(w);
        free(ref);
        free(got);
    }
}

static void test_matmul(void **state)
{
    /* op_cases.h: the GEMV path (rows <= 8, aligned), the cuBLAS path
     * (rows > 8, or an `in` the GEMV cannot take) */
    rnd_seed(3);
    for (size_t ti = 0; ti < OP_CASES_N(op_float_types); ti++) {
        for (size_t s = 0; s < OP_CASES_N(op_matmul_cases); s++) {
            enum ctype t = op_float_types[ti];
            const struct op_mm_case *c = &op_matmul_cases[s];
            uint32_t in = c->in, out = c->out, rows = c->rows;
            if (t == CT_Q8_0 && in % 32)
                continue; /* Q8_0 rows are whole 32-element blocks */
            float *w = rnd_new((size_t)in * out, -1, 1), *x = rnd_new((size_t)rows * in, -1, 1);
            size_t bytes;
            void *hb = make_weight(t, w, out, in, NULL, &bytes);
            struct ctensor hc = {.type = t, .ne0 = in, .ne1 = out, .nbytes = bytes, .data = hb};
            /* loaded as the model loads weights (the bf16 copy for GEMMs) */
            struct ctensor gc = hc;
            assert_int_equal(F.gops->buf_alloc(F.gcx, F.gops->weight_bytes(&gc), &gc.data), 0);
            assert_int_equal(F.gops->weight_upload(F.gcx, &gc, hb), 0);
            size_t N = (size_t)rows * out;
            float *ref = malloc(N * 4), *got = malloc(N * 4);
            assert_int_equal(F.cops->matmul(F.ccx, &hc, x, rows, ref), 0);
            float *dx = gpu_dup(&F, x, (size_t)rows * in * 4), *dy = gpu_nan(&F, N);
            assert_int_equal(F.gops->matmul(F.gcx, &gc, dx, rows, dy), 0);
            gpu_get(&F, got, dy, N * 4);
            int gemv = rows <= 8 && in % (t == CT_Q8_0 ? 32 : 8) == 0;
            char what[96];
            snprintf(what, sizeof what, "matmul %s in %u out %u rows %u", ctype_name(t), in, out,
                     rows);
            check(what, got, ref, N, t == CT_F32 || gemv ? 1e-4 : 1.5e-2);
            if (!gemv && (t == CT_F16 || t == CT_Q8_0)) {
                /* the file's rows alone (no weight_upload): refused, not guessed */
                struct ctensor raw = hc;
                raw.data = gpu_dup(&F, hb, bytes);
                assert_int_equal(F.gops->matmul(F.gcx, &raw, dx, rows, dy), KVD_EINTERNAL);
                gpu_free(&F, raw.data);
            }
            gpu_free(&F, gc.data);
            gpu_free(&F, dx);
            gpu_free(&F, dy);
            free(w);
            free(x);
            free(hb);
            free(ref);
            free(got);
        }
    }
}

static void test_elementwise(void **state)
{
    rnd_seed(4);
    uint32_t rows = 7, n = 1000;
    size_t N = (size_t)rows * n;
    float *a = rnd_new(N, -8, 8), *b = rnd_new(N, -2, 2), *bias = rnd_new(n, -1, 1);
    float *ref = malloc(N * 4), *got = malloc(N * 4);
    float *da, *db, *dbias;

    /* add_bias */
    memcpy(ref, a, N * 4);
    assert_int_equal(F.cops->add_bias(F.ccx, ref, bias, rows, n), 0);
    da = gpu_dup(&F, a, N * 4);
    dbias = gpu_dup(&F, bias, n * 4);
    assert_int_equal(F.gops->add_bias(F.gcx, da, dbias, rows, n), 0);
    gpu_get(&F, got, da, N * 4);
    check("add_bias", got, ref, N, 1e-7);
    gpu_free(&F, da);

    /* silu_mul */
    memcpy(ref, a, N * 4);
    assert_int_equal(F.cops->silu_mul(F.ccx, ref, b, N), 0);
    da = gpu_dup(&F, a, N * 4);
    db = gpu_dup(&F, b, N * 4);
    assert_int_equal(F.gops->silu_mul(F.gcx, da, db, N), 0);
    gpu_get(&F, got, da, N * 4);
    check("silu_mul", got, ref, N, 1e-6);
    gpu_free(&F, da);

    /* add */
    memcpy(ref, a, N * 4);
    assert_int_equal(F.cops->add(F.ccx, ref, b, N), 0);
    da = gpu_dup(&F, a, N * 4);
    assert_int_equal(F.gops->add(F.gcx, da, db, N), 0);
    gpu_get(&F, got, da, N * 4);
    check("add", got, ref, N, 1e-7);

    /* gather_rows */
    uint32_t pick[3] = {6, 0, 3};
    float *gref = malloc(3 * n * 4), *ggot = malloc(3 * n * 4);
    assert_int_equal(F.cops->gather_rows(F.ccx, gref, a, pick, 3, n), 0);
    gpu_free(&F, da);
    da = gpu_dup(&F, a, N * 4);
    uint32_t *dpick = gpu_dup(&F, pick, sizeof pick);
    float *dout = gpu_nan(&F, 3 * n);
    assert_int_equal(F.gops->gather_rows(F.gcx, dout, da, dpick, 3, n), 0);
    gpu_get(&F, ggot, dout, 3 * n * 4);
    check("gather_rows", ggot, gref, 3 * n, 0);

    gpu_free(&F, da);
    gpu_free(&F, db);
    gpu_free(&F, dbias);
    gpu_free(&F, dpick);
    gpu_free(&F, dout);
    free(a);
    free(b);
    free(bias);
    free(ref);
    free(got);
    free(gref);
    free(ggot);
}

static void test_rope(void **state)
{
    rnd_seed(5);
    for (int mode = 0; mode < 2; mode++) {
        for (int ffon = 0; ffon < 2; ffon++) {
            for (int rot = 0; rot < 2; rot++) {
                uint32_t rows = 6, heads = 4, hd = 64, n_rot = rot ? 32 : 64;
                size_t N = (size_t)rows * heads * hd;
                float *x = rnd_new(N, -2, 2), *ff = rnd_new(n_rot / 2, 1, 8);
                uint32_t pos[6];
                for (uint32_t i = 0; i < rows; i++)
                    pos[i] = rnd_u32(20000);
                float *ref = malloc(N * 4), *got = malloc(N * 4);
                memcpy(ref, x, N * 4);
                enum rope_mode m = mode ? ROPE_NEOX : ROPE_NORM;
                assert_int_equal(F.cops->rope(F.ccx, ref, rows, heads, hd, n_rot, pos, m, 10000.0f,
                                              ffon ? ff : NULL),
                                 0);
                float *dx = gpu_dup(&F, x, N * 4), *dff = gpu_dup(&F, ff, n_rot / 2 * 4);
                uint32_t *dpos = gpu_dup(&F, pos, sizeof pos);
                assert_int_equal(F.gops->rope(F.gcx, dx, rows, heads, hd, n_rot, dpos, m, 10000.0f,
                                              ffon ? dff : NULL),
                                 0);
                gpu_get(&F, got, dx, N * 4);
                check(mode ? "rope neox" : "rope norm", got, ref, N, 1e-6);
                gpu_free(&F, dx);
                gpu_free(&F, dff);
                gpu_free(&F, dpos);
                free(x);
                free(ff);
                free(ref);
                free(got);
            }
        }
    }
}

/* ---- KV cache ------------------------------------------------------------ */

#define N_KV_DTYPES 5 /* f16, bf16, f32, q8_0, fp8 */

/* The attention tests run every (head layout, head_dim) for f16 and a
 * subset for the other dtypes that still instantiates every head_dim and
 * every query-group size of each dtype's kernels: the whole product took
 * most of this test's time on the emulator (CI's budget). */
static bool attn_case(int dt, size_t h, size_t di)
{
    return dt == KV_F16 || (h + di) % 3 == 0;
}

static void test_kv_write(void **state)
{
    rnd_seed(6);
    for (int dt = 0; dt < N_KV_DTYPES; dt++) {
        struct kvfx k;
        kvfx_init(&k, (enum kv_dtype)dt, 3, 2, 64, 16, 8);
        uint32_t n = 10, slot[10], pos[10];
        for (uint32_t t = 0; t < n; t++) { /* distinct (slot, row) pairs */
            slot[t] = t % 8;
            pos[t] = 16 * rnd_u32(100) + (t / 8) * 5 + rnd_u32(5);
        }
        size_t KD = (size_t)2 * 64;
        float *kk = rnd_new(n * KD, -3, 3), *vv = rnd_new(n * KD, -3, 3);
        if (dt == KV_Q8_0 || dt == KV_FP8) { /* their rules for the odd values, bit for bit */
            kk[5] = NAN, kk[70] = INFINITY, vv[200] = -INFINITY, kk[300] = 1e30f;
            kk[401] = 1e-30f, vv[9] = -0.0f;
            for (size_t i = 3 * KD; i < 4 * KD; i++)
                vv[i] = i % 3 ? 0.0f : -1e-12f; /* tiny block: f16 d flushes to 0 */
        }
        assert_int_equal(F.cops->kv_write(F.ccx, k.harena, &k.g, 1, kk, vv, n, slot, pos), 0);
        float *dk = gpu_dup(&F, kk, n * KD * 4), *dv = gpu_dup(&F, vv, n * KD * 4);
        uint32_t *ds = gpu_dup(&F, slot, sizeof slot), *dp = gpu_dup(&F, pos, sizeof pos);
        assert_int_equal(F.gops->kv_write(F.gcx, k.darena, &k.g, 1, dk, dv, n, ds, dp), 0);
        uint8_t *got = malloc(k.bb * k.nb);
        gpu_get(&F, got, k.darena, k.bb * k.nb);
        assert_memory_equal(got, k.harena, k.bb * k.nb);
        free(got);
        gpu_free(&F, dk);
        gpu_free(&F, dv);
        gpu_free(&F, ds);
        gpu_free(&F, dp);
        free(kk);
        free(vv);
        kvfx_free(&k);
    }
}

/* One attention batch: per sequence (pos0, rows). The cpu reference reads
 * the same blocks (q8_0/fp8: the same quantized bytes, widened alike). */
static void run_attention(enum kv_dtype dt, uint32_t hd, uint32_t n_head, uint32_t kv_heads,
                          const uint32_t (*seqs)[2], uint32_t S)
{
    const uint32_t bt = 16;
    uint32_t qstart[9], pos0[8], slot0[9], T = 0, NS = 0, max_q = 0, max_kv = 0;
    assert_true(S <= 8);
    for (uint32_t s = 0; s < S; s++) {
        uint32_t end = seqs[s][0] + seqs[s][1];
        qstart[s] = T;
        pos0[s] = seqs[s][0];
        slot0[s] = NS;
        T += seqs[s][1];
        NS += (end + bt - 1) / bt;
        if (seqs[s][1] > max_q)
            max_q = seqs[s][1];
        if (end > max_kv)
            max_kv = end;
    }
    qstart[S] = T;
    slot0[S] = NS;
    struct kvfx k;
    kvfx_init(&k, dt, 2, kv_heads, hd, bt, NS + 3);
    uint32_t *slots = malloc(NS * 4);
    for (uint32_t i = 0; i < NS; i++) /* a scattered permutation of the blocks */
        slots[i] = (i * 7 + 3) % (uint32_t)(NS + 3);
    for (uint32_t i = 0; i < NS; i++) /* (7, NS+3) may share a factor: make it injective */
        for (uint32_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                slots[i] = (slots[i] + 1) % (uint32_t)(NS + 3), j = (uint32_t)-1;
    size_t QN = (size_t)T * n_head * hd;
    float *q = rnd_new(QN, -1.5f, 1.5f), *ref = malloc(QN * 4), *got = malloc(QN * 4);
    struct attn_desc d = {.q = q,
                          .out = ref,
                          .arena = k.harena,
                          .geom = &k.g,
                          .layer = 1,
                          .n_head = n_head,
                          .scale = 1.0f / sqrtf((float)hd),
                          .n_tokens = T,
                          .n_seqs = S,
                          .seq_qstart = qstart,
                          .seq_pos0 = pos0,
                          .seq_slot0 = slot0,
                          .slots = slots,
                          .max_q = max_q,
                          .max_kv = max_kv,
                          .h_seq_qstart = qstart,
                          .h_seq_pos0 = pos0};
    assert_int_equal(F.cops->attention(F.ccx, &d), 0);
    struct attn_desc g = d;
    g.q = gpu_dup(&F, q, QN * 4);
    g.out = gpu_nan(&F, QN);
    g.arena = k.darena;
    g.seq_qstart = gpu_dup(&F, qstart, (S + 1) * 4);
    g.seq_pos0 = gpu_dup(&F, pos0, S * 4);
    g.seq_slot0 = gpu_dup(&F, slot0, (S + 1) * 4);
    g.slots = gpu_dup(&F, slots, NS * 4);
    assert_int_equal(F.gops->attention(F.gcx, &g), 0);
    gpu_get(&F, got, g.out, QN * 4);
    char what[128];
    snprintf(what, sizeof what, "attention %s hd %u heads %u/%u max_q %u max_kv %u",
             kv_dtype_name(dt), hd, n_head, kv_heads, max_q, max_kv);
    /* Query groups of 3 and more at head_dim 64 and 128 with f16, bf16 or
     * q8_0 rows take the tensor-core decode kernel (16-bit Q and weights:
     * test_gpu_attn's tolerances). */
    const uint32_t grp = n_head / kv_heads;
    double tol = 2e-5;
    if ((dt == KV_F16 || dt == KV_BF16 || dt == KV_Q8_0) && (hd == 64 || hd == 128) && grp >= 3)
        tol = dt == KV_BF16 ? 1e-2 : 2e-3;
    check(what, got, ref, QN, tol);
    gpu_free(&F, (void *)g.q);
    gpu_free(&F, g.out);
    gpu_free(&F, (void *)g.seq_qstart);
    gpu_free(&F, (void *)g.seq_pos0);
    gpu_free(&F, (void *)g.seq_slot0);
    gpu_free(&F, (void *)g.slots);
    free(slots);
    free(q);
    free(ref);
    free(got);
    kvfx_free(&k);
}

static void test_attention_decode(void **state)
{
    static const uint32_t heads[][2] = {{8, 8}, {8, 2}, {16, 1}, {12, 4}, {32, 8}};
    static const uint32_t hds[] = {64, 128, 32, 256};
    rnd_seed(7);
    for (int dt = 0; dt < N_KV_DTYPES; dt++)
        for (size_t h = 0; h < 5; h++)
            for (size_t di = 0; di < 4; di++) {
                if (!attn_case(dt, h, di))
                    continue;
                /* short, block-boundary and long contexts (split along the
                 * context, merged) in one batch */
                uint32_t seqs[4][2] = {
                    {0, 1}, {15, 1}, {16 + rnd_u32(300), 1}, {2000 + rnd_u32(3000), 1}};
                run_attention((enum kv_dtype)dt, hds[di], heads[h][0], heads[h][1],
                              (const uint32_t(*)[2])seqs, 4);
            }
}

/* The decode split count: one wave of the kernel's resident blocks (its
 * occupancy on this device times the multiprocessors) over the launch's
 * (sequence, KV head, query group) items, rounded down, no split under 64 tokens of the
 * longest context, at most 128. On the emulator the occupancy follows from
 * ptxas's sm_90 register counts (kernels/emu/ptxas_sm90.inc), so the
 * calculator's rules are checked on two known instances. */
static void test_attention_splits(void **state)
{
    static const int dts[] = {KVD_K_F16, KVD_K_BF16, KVD_K_F32, KVD_K_Q8_0, KVD_K_FP8};
    static const int hds[] = {64, 128, 256}, groups[] = {1, 4, 8, 16};
    static const int ctxs[] = {1, 64, 65, 1000, 4096, 32768, 1 << 20};
    static const int seqs[] = {1, 3, 16, 256};
    const int n_sms = 132, kv_heads = 8;
    for (size_t a = 0; a < sizeof dts / sizeof *dts; a++)
        for (size_t b = 0; b < sizeof hds / sizeof *hds; b++)
            for (size_t c = 0; c < sizeof groups / sizeof *groups; c++) {
                const int g = groups[c],
                          per_sm = kvd_k_attn_decode_blocks_per_sm(hds[b], dts[a], g);
                assert_true(per_sm >= 1 && per_sm <= 32);
                struct kvd_k_kv kv = {.kv_heads = kv_heads, .head_dim = hds[b], .dtype = dts[a]};
                for (size_t d = 0; d < sizeof ctxs / sizeof *ctxs; d++)
                    for (size_t e = 0; e < sizeof seqs / sizeof *seqs; e++) {
                        const long items = (long)seqs[e] * kv_heads * (g > 8 ? (g + 7) / 8 : 1);
                        const long wave = (long)per_sm * n_sms, by_len = (ctxs[d] + 63) / 64;
                        long want = wave / items;
                        want = want < by_len ? want : by_len;
                        want = want < 128 ? want : 128;
                        assert_int_equal(
                            kvd_k_attn_decode_splits(seqs[e], kv_heads * g, &kv, ctxs[d], n_sms),
                            want < 1 ? 1 : want);
                    }
            }
    /* Shapes the occupancy does not know: -1, and still a valid count. */
    assert_int_equal(kvd_k_attn_decode_blocks_per_sm(96, KVD_K_F16, 1), -1);
    assert_int_equal(kvd_k_attn_decode_blocks_per_sm(16, KVD_K_Q8_0, 1), -1);
#ifdef KVD_CUDA_EMULATE
    /* bf16, head_dim 128, GQ 4 and 8: the tensor-core kernel, 158
     * registers (4 warps x 5120 of the 64 K: 3 blocks; the scalar kernel's
     * GQ 8 had 250, 2 blocks). At batch 1 of an 8-KV-head model that is 49
     * splits for both (392 blocks: one wave; GQ 8 was 33), and the fp8
     * scalar kernel's GQ 8 still 2 blocks (245 registers). */
    assert_int_equal(kvd_k_attn_decode_blocks_per_sm(128, KVD_K_BF16, 4), 3);
    assert_int_equal(kvd_k_attn_decode_blocks_per_sm(128, KVD_K_BF16, 8), 3);
    assert_int_equal(kvd_k_attn_decode_blocks_per_sm(128, KVD_K_FP8, 8), 2);
    struct kvd_k_kv kv = {.kv_heads = 8, .head_dim = 128, .dtype = KVD_K_BF16};
    assert_int_equal(kvd_k_attn_decode_splits(1, 32, &kv, 4096, 132), 49);
    assert_int_equal(kvd_k_attn_decode_splits(1, 64, &kv, 4096, 132), 49);
    assert_int_equal(kvd_k_attn_decode_splits(1, 64, &kv, 1000, 132), 16);
#endif
}

/* The sample op: the same logits and rows on both backends give the same
 * tokens (greedy with ties and NaN, temperature alone, top-k, top-p, both,
 * skipped rows). Exact equality: the pick is integer arithmetic on both,
 * except exp's last bit, which moves a weight by 2^-38 of the largest and
 * cannot change a draw on these rows but by a one-in-10^9 chance. */
static void test_sample(void **state)
{
    rnd_seed(9);
    const uint32_t vocabs[] = {1, 7, 1000, 50001, 128256};
    for (size_t vi = 0; vi < sizeof vocabs / sizeof vocabs[0]; vi++) {
        uint32_t vocab = vocabs[vi], rows = 24;
        float *x = rnd_new((size_t)rows * vocab, -10, 10);
        struct sample_row p[24];
        for (uint32_t r = 0; r < rows; r++) {
            float *l = x + (size_t)r * vocab;
            if (r % 4 == 1) /* coarse grid: many ties */
                for (uint32_t i = 0; i < vocab; i++)
                    l[i] = floorf(l[i]);
            if (r % 6 == 2 && vocab > 3) {
                l[vocab / 2] = NAN;
                l[vocab - 1] = -INFINITY;
            }
            p[r] = (struct sample_row){
                .temperature = r % 5 == 0 ? 0.0f : 0.2f + (float)rnd_u32(30) / 10.0f,
                .top_k = r % 3 == 1 ? 1 + rnd_u32(vocab + 1) : 0,
                .top_p = r % 4 == 2 ? 0.05f + (float)rnd_u32(95) / 100.0f : 1.0f,
                .skip = r == 23,
                .u = (double)rnd_u32(1u << 30) / (double)(1u << 30),
            };
        }
        if (vocab > 1000) { /* ties at the top and NaN among them, greedy */
            x[777] = 50;
            x[vocab - 5] = 50;
            x[3] = NAN;
        }
        float *dx = gpu_dup(&F, x, (size_t)rows * vocab * 4);
        struct sample_row *dp = gpu_dup(&F, p, sizeof p);
        uint32_t *dout = (uint32_t *)gpu_nan(&F, rows);
        uint32_t got[24], want[24];
        assert_int_equal(F.gops->sample(F.gcx, dx, rows, vocab, dp, dout), 0);
        gpu_get(&F, got, dout, sizeof got);
        assert_int_equal(F.cops->sample(F.ccx, x, rows, vocab, p, want), 0);
        for (uint32_t r = 0; r < rows; r++)
            if (got[r] != want[r])
                fail_msg("vocab %u row %u (T %g k %u p %g u %.6f): gpu %u, cpu %u", vocab, r,
                         (double)p[r].temperature, p[r].top_k, (double)p[r].top_p, p[r].u, got[r],
                         want[r]);
        if (vocab > 1000)
            assert_int_equal(got[0], 777);
        assert_int_equal(got[23], 0);
        gpu_free(&F, dx);
        gpu_free(&F, dp);
        gpu_free(&F, dout);
        free(x);
    }
}

/* Rows the sampler must still answer the same way on both backends: only
 * NaN and -inf, NaN before a tie, a lone finite value. The rule (cpu's
 * sampler_pick, one for both): NaN counts as -inf, the lowest index wins a
 * tie. Greedy, temperature, and through the greedy-only argmax kernel. */
static void test_sample_degenerate_rows(void **state)
{
    const float N = NAN, I = -INFINITY;
    enum { V = 4, R = 8 };
    const float rows[R][V] = {{N, I, I, I}, {I, I, I, I}, {N, N, N, N}, {N, 1, 1, 0},
                              {I, N, 5, 5}, {N, N, I, 2}, {I, N, I, N}, {3, N, 3, I}};
    for (int temp = 0; temp < 2; temp++) {
        struct sample_row p[R];
        for (int r = 0; r < R; r++)
            p[r] = (struct sample_row){.temperature = temp ? 0.7f : 0.0f, .top_p = 1.0f, .u = 0.5};
        float *dx = gpu_dup(&F, rows, sizeof rows);
        struct sample_row *dp = gpu_dup(&F, p, sizeof p);
        uint32_t *dout = (uint32_t *)gpu_nan(&F, R);
        uint32_t got[R], want[R];
        assert_int_equal(F.gops->sample(F.gcx, dx, R, V, dp, dout), 0);
        gpu_get(&F, got, dout, sizeof got);
        assert_int_equal(F.cops->sample(F.ccx, &rows[0][0], R, V, p, want), 0);
        for (int r = 0; r < R; r++)
            if (got[r] != want[r])
                fail_msg("%s row %d: gpu %u, cpu %u", temp ? "sampled" : "greedy", r, got[r],
                         want[r]);
        if (!temp) {
            int32_t am[R];
            kvd_stream st = (kvd_stream)cuda_backend_dev(F.cuda)->compute;
            assert_int_equal(kvd_k_argmax((int32_t *)dout, dx, R, V, st), 0);
            gpu_get(&F, am, dout, sizeof am);
            for (int r = 0; r < R; r++)
                if ((uint32_t)am[r] != want[r])
                    fail_msg("argmax row %d: gpu %d, cpu %u", r, am[r], want[r]);
        }
        gpu_free(&F, dx);
        gpu_free(&F, dp);
        gpu_free(&F, dout);
    }
}

/* The fused residual add + RMSNorm op (out apart, and out = res as
 * model_forward calls it), and a kernel model_forward does not reach
 * through compute_ops: batched copy-on-write of blocks. */
static void test_add_rmsnorm_and_block_copy(void **state)
{
    kvd_stream st = (kvd_stream)cuda_backend_dev(F.cuda)->compute;
    rnd_seed(10);
    uint32_t rows = 3, n = 2048;
    size_t N = (size_t)rows * n;
    float *x = rnd_new(N, -2, 2), *r = rnd_new(N, -2, 2), *w = rnd_new(n, 0.5f, 1.5f);
    float *rx = malloc(N * 4), *ry = malloc(N * 4), *gx = malloc(N * 4), *gy = malloc(N * 4);
    memcpy(rx, x, N * 4);
    assert_int_equal(F.cops->add_rmsnorm(F.ccx, rx, r, ry, w, rows, n, 1e-6f), 0);
    float *dx = gpu_dup(&F, x, N * 4), *dr = gpu_dup(&F, r, N * 4), *dw = gpu_dup(&F, w, n * 4),
          *dy = gpu_nan(&F, N);
    assert_int_equal(F.gops->add_rmsnorm(F.gcx, dx, dr, dy, dw, rows, n, 1e-6f), 0);
    gpu_get(&F, gx, dx, N * 4);
    gpu_get(&F, gy, dy, N * 4);
    check("add_rmsnorm residual", gx, rx, N, 1e-7);
    check("add_rmsnorm norm", gy, ry, N, 1e-6);
    gpu_free(&F, dx);
    dx = gpu_dup(&F, x, N * 4);
    assert_int_equal(F.gops->add_rmsnorm(F.gcx, dx, dr, dr, dw, rows, n, 1e-6f), 0);
    gpu_get(&F, gx, dx, N * 4);
    gpu_get(&F, gy, dr, N * 4);
    check("add_rmsnorm (out = res) residual", gx, rx, N, 1e-7);
    check("add_rmsnorm (out = res) norm", gy, ry, N, 1e-6);

    struct kvfx k;
    kvfx_init(&k, KV_BF16, 2, 2, 64, 16, 6);
    int32_t src[2] = {4, 1}, dst[2] = {0, 5};
    int32_t *dsrc = gpu_dup(&F, src, sizeof src), *ddst = gpu_dup(&F, dst, sizeof dst);
    struct kvd_k_kv kv = {.arena = k.darena,
                          .block_bytes = k.bb,
                          .layers = 2,
                          .kv_heads = 2,
                          .head_dim = 64,
                          .block_tokens = 16,
                          .dtype = KVD_K_BF16};
    assert_int_equal(kvd_k_block_copy(&kv, dsrc, ddst, 2, st), 0);
    uint8_t *got = malloc(k.bb * k.nb);
    gpu_get(&F, got, k.darena, k.bb * k.nb);
    memcpy(k.harena + 0 * k.bb, k.harena + 4 * k.bb, k.bb);
    memcpy(k.harena + 5 * k.bb, k.harena + 1 * k.bb, k.bb);
    assert_memory_equal(got, k.harena, k.bb * k.nb);

    free(got);
    gpu_free(&F, dsrc);
    gpu_free(&F, ddst);
    kvfx_free(&k);
    gpu_free(&F, dx);
    gpu_free(&F, dr);
    gpu_free(&F, dw);
    gpu_free(&F, dy);
    free(x);
    free(r);
    free(w);
    free(rx);
    free(ry);
    free(gx);
    free(gy);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_get_rows),
        GPU_TEST(test_quant_get_rows),
        GPU_TEST(test_quant_matmul),
        GPU_TEST(test_quant_refusals),
        GPU_TEST(test_rmsnorm),
        GPU_TEST(test_matmul),
        GPU_TEST(test_elementwise),
        GPU_TEST(test_rope),
        GPU_TEST(test_kv_write),
        GPU_TEST(test_attention_decode),
        GPU_TEST(test_attention_splits),
        GPU_TEST(test_sample),
        GPU_TEST(test_sample_degenerate_rows),
        GPU_TEST(test_add_rmsnorm_and_block_copy),
    };
    /* The skip decision happens before cmocka runs, so "no device" exits 77. */
    gpu_fx_open(&F);
    gpu_fx_close(&F);
    if (getenv("KVD_TEST_FILTER")) /* e.g. KVD_TEST_FILTER='test_attention*' */
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, gpu_fx_setup, gpu_fx_teardown);
}

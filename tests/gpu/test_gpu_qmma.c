/* The int8 tensor-core path: mma.sync m16n8k32 / m16n8k16 with s8 inputs
 * lane by lane against scalar code (kvd_k_mma_s8_check: on a device the
 * hardware's fragment layouts, on the emulator its computation of them),
 * and the K-quants' GEMM for more than 8 tokens (kernels/gemm_qmma.cu)
 * against the cpu backend's matmul and against the fused GEMV's rows (8
 * tokens a call): the GEMV's bits for every type, the cpu's for Q4_K.
 * Skips (77) without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"
#include "gpu/gpu_fixture.h"
#include "kernels.h"
#include "kvd/status.h"
#include "quant.h"

#define F gpu_F /* the program's fixture (gpu_fixture.h) */

static kvd_stream stream(void)
{
    return (kvd_stream)cuda_backend_dev(F.cuda)->compute;
}

/* ---- the s8 mma's fragments --------------------------------------------- */

static int8_t rnd_s8(void)
{
    uint32_t r = rnd_u32(16);
    if (r == 0)
        return -128; /* the extremes, often */
    if (r == 1)
        return 127;
    return (int8_t)((int)rnd_u32(256) - 128);
}

static void test_mma_s8_fragments(void **state)
{
    rnd_seed(31);
    int8_t a[16 * 32], b[32 * 8];
    int c[16 * 8], d[2 * 128];
    memset(d, 0, sizeof d);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 16 * 32; i++)
            a[i] = rnd_s8();
        for (int i = 0; i < 32 * 8; i++)
            b[i] = rnd_s8();
        for (int i = 0; i < 16 * 8; i++)
            c[i] = (int)rnd_u32(1u << 24) - (1 << 23);
        int8_t *da = gpu_dup(&F, a, sizeof a), *db = gpu_dup(&F, b, sizeof b);
        int *dc = gpu_dup(&F, c, sizeof c), *dd = gpu_dup(&F, d, sizeof d);
        assert_int_equal(kvd_k_mma_s8_check(dd, da, db, dc, stream()), 0);
        gpu_get(&F, d, dd, sizeof d);
        /* lane (g, t) holds D[g][2t, 2t+1] and D[g+8][2t, 2t+1] */
        for (int k = 0; k < 2; k++) {
            const int K = k ? 16 : 32;
            for (int lane = 0; lane < 32; lane++)
                for (int i = 0; i < 4; i++) {
                    const int row = (lane >> 2) + (i >> 1) * 8, col = 2 * (lane & 3) + (i & 1);
                    int want = c[row * 8 + col];
                    for (int j = 0; j < K; j++)
                        want += a[row * 32 + j] * b[j * 8 + col];
                    if (d[k * 128 + lane * 4 + i] != want)
                        fail_msg("m16n8k%d lane %d d[%d] (D[%d][%d]) is %d, want %d", K, lane, i,
                                 row, col, d[k * 128 + lane * 4 + i], want);
                }
        }
        gpu_free(&F, da);
        gpu_free(&F, db);
        gpu_free(&F, dc);
        gpu_free(&F, dd);
    }
}

/* ---- the K-quants' GEMM ---------------------------------------------------- */

/* A weight [out][in] of type t, quantized from random values (a few rows
 * zero, some with an outlier); h: the cpu backend's, d: the cuda's, both
 * loaded as the model loads them. */
struct wt {
    struct ctensor h, d;
    void *bytes;
};

static void wt_make(struct wt *w, enum ctype t, uint32_t in, uint32_t out)
{
    size_t rb = ctype_row_bytes(t, in);
    w->bytes = malloc(rb * out);
    float *row = malloc(in * sizeof(float));
    assert_non_null(w->bytes);
    assert_non_null(row);
    for (uint32_t r = 0; r < out; r++) {
        rnd_fill(row, in, -1, 1);
        if (r % 19 == 3)
            memset(row, 0, in * sizeof *row);
        if (r % 11 == 5)
            row[rnd_u32(in)] = 30.0f;
        assert_int_equal(quant_quantize_row(t, row, (uint8_t *)w->bytes + r * rb, in), 0);
    }
    free(row);
    w->h = (struct ctensor){.type = t, .ne0 = in, .ne1 = out, .nbytes = rb * out, .data = w->bytes};
    struct ctensor c = w->h;
    if (F.cops->weight_bytes) {
        assert_int_equal(F.cops->buf_alloc(F.ccx, F.cops->weight_bytes(&c), &c.data), 0);
        assert_int_equal(F.cops->weight_upload(F.ccx, &c, w->bytes), 0);
        w->h = c;
    }
    w->d = (struct ctensor){.type = t, .ne0 = in, .ne1 = out, .nbytes = rb * out};
    assert_int_equal(F.gops->buf_alloc(F.gcx, F.gops->weight_bytes(&w->d), &w->d.data), 0);
    assert_int_equal(F.gops->weight_upload(F.gcx, &w->d, w->bytes), 0);
    assert_int_equal(w->d.layout, CL_PLANES);
}

static void wt_free(struct wt *w)
{
    if (F.cops->weight_bytes)
        F.cops->buf_free(F.ccx, w->h.data);
    F.gops->buf_free(F.gcx, w->d.data);
    free(w->bytes);
}

static int wtype_of(enum ctype t)
{
    return t == CT_Q4_K ? KVD_KW_Q4_K : t == CT_Q5_K ? KVD_KW_Q5_K : KVD_KW_Q6_K;
}

static void bits_equal(const char *what, const char *ref_name, const float *got, const float *ref,
                       size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &ref[i], 4))
            fail_msg("%s: output %zu is %.9g, the %s %.9g", what, i, (double)got[i], ref_name,
                     (double)ref[i]);
}

/* Token counts: both tile widths (9..16: two n-tiles a block; more: four),
 * a partial last tile (17), several token blocks (64: a prefill chunk),
 * each type once over a wide matrix (in 1024: four super-blocks). out 80:
 * a partial row block and a partial 16-row warp tile. */
static void test_qmma_matmul(void **state)
{
    static const enum ctype types[] = {CT_Q4_K, CT_Q5_K, CT_Q6_K};
    static const uint32_t tokens[] = {9, 16, 17, 32, 64};
    rnd_seed(32);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        for (size_t k = 0; k < sizeof tokens / sizeof tokens[0]; k++) {
            const enum ctype t = types[ti];
            const uint32_t n = tokens[k], in = k == ti ? 1024 : 512, out = 80;
            struct wt w;
            wt_make(&w, t, in, out);
            float *x = rnd_new((size_t)n * in, -1, 1);
            memset(x + 2 * in, 0, in * sizeof *x); /* a zero row: its Q8_K scale is 0 */
            x[5 * in + 7] = 50.0f;                 /* an outlier */
            const size_t N = (size_t)n * out;
            float *ref = malloc(N * 4), *got = malloc(N * 4), *gemv = malloc(N * 4);
            float *direct = malloc(N * 4);
            float *dx = gpu_dup(&F, x, (size_t)n * in * 4), *dy = gpu_nan(&F, N);
            char what[96];
            snprintf(what, sizeof what, "qmma %s in %u out %u tokens %u", ctype_name(t), in, out,
                     n);

            /* the backend's matmul: the int8 GEMM, two launches (the
             * activations' quantization, the GEMM) */
            unsigned long long l0 = kvd_k_launches();
            assert_int_equal(F.gops->matmul(F.gcx, &w.d, dx, n, dy), 0);
            gpu_get(&F, got, dy, N * 4);
            assert_int_equal(kvd_k_launches() - l0, 2);

            /* the kernel called directly: the same bytes */
            void *act = NULL;
            assert_int_equal(
                F.gops->buf_alloc(F.gcx, kvd_k_qmma_act_bytes(wtype_of(t), (int)n, (int)in), &act),
                0);
            float *dz = gpu_nan(&F, N);
            assert_int_equal(
                kvd_k_qmma(dz, w.d.data, wtype_of(t), (int)out, (int)in, dx, (int)n, act, stream()),
                0);
            gpu_get(&F, direct, dz, N * 4);
            bits_equal(what, "direct call's", got, direct, N);

            /* the fused GEMV, 8 tokens a call: the same bits */
            float *dg = gpu_nan(&F, N);
            for (uint32_t r = 0; r < n; r += 8) {
                const uint32_t c = n - r < 8 ? n - r : 8;
                assert_int_equal(
                    F.gops->matmul(F.gcx, &w.d, dx + (size_t)r * in, c, dg + (size_t)r * out), 0);
            }
            gpu_get(&F, gemv, dg, N * 4);
            bits_equal(what, "GEMV's", got, gemv, N);

            /* the cpu backend's: Q4_K bit for bit; Q5_K and Q6_K's cpu float
             * part (llama.cpp's: 8 int32 lanes a super-block, each converted
             * and accumulated on its own) is not the GEMV's one sum a
             * super-block, so within f32 rounding of that other order (the
             * GEMV tests' bound) */
            assert_int_equal(F.cops->matmul(F.ccx, &w.h, x, n, ref), 0);
            if (t == CT_Q4_K)
                bits_equal(what, "cpu's", got, ref, N);
            else if (!(rel_err(got, ref, N) <= 1e-5))
                fail_msg("%s: relative error %.3g against the cpu's", what, rel_err(got, ref, N));

            F.gops->buf_free(F.gcx, act);
            gpu_free(&F, dx);
            gpu_free(&F, dy);
            gpu_free(&F, dz);
            gpu_free(&F, dg);
            free(x);
            free(ref);
            free(got);
            free(gemv);
            free(direct);
            wt_free(&w);
        }
    }
}

/* Shapes and arguments the kernel does not take are refused. */
static void test_qmma_refusals(void **state)
{
    rnd_seed(33);
    struct wt w;
    wt_make(&w, CT_Q4_K, 512, 16);
    float *dx = gpu_nan(&F, 16 * 512 + 4), *dy = gpu_nan(&F, 16 * 16);
    void *act = NULL;
    assert_int_equal(
        F.gops->buf_alloc(F.gcx, kvd_k_qmma_act_bytes(KVD_KW_Q4_K, 16, 512) + 16, &act), 0);
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q4_K, w.d.data, dx, 16, 512), 1);
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q4_K, w.d.data, dx, 16, 384), 0);     /* in % 256 */
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q4_K, w.d.data, dx + 1, 16, 512), 0); /* x aligned */
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q4_K, w.d.data, dx, 0, 512), 0);
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q8_0, w.d.data, dx, 16, 512), 0);
    assert_int_equal(kvd_k_qmma_ok(KVD_KW_Q4_0, w.d.data, dx, 16, 512), 0);
    assert_int_not_equal(
        kvd_k_qmma(dy, w.d.data, KVD_KW_Q4_K, 16, 512, dx, 16, (char *)act + 8, stream()), 0);
    assert_int_not_equal(kvd_k_qmma(dy, w.d.data, KVD_KW_Q4_K, 16, 512, dx, 16, NULL, stream()), 0);
    assert_int_not_equal(kvd_k_qmma(dy, w.d.data, KVD_KW_Q4_K, -1, 512, dx, 16, act, stream()), 0);
    F.gops->buf_free(F.gcx, act);
    gpu_free(&F, dx);
    gpu_free(&F, dy);
    wt_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_mma_s8_fragments),
        GPU_TEST(test_qmma_matmul),
        GPU_TEST(test_qmma_refusals),
    };
    return cmocka_run_group_tests(tests, gpu_fx_setup, gpu_fx_teardown);
}

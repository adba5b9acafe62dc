/* Tensor-core attention on the cuda backend: the mma/ldmatrix fragment
 * layouts lane by lane against scalar code (kvd_k_mma_check: on a device the
 * hardware's, on the emulator its own), then the prefill kernels against the
 * cpu backend's attention at every head_dim (64, 128, 256), GQA group (1,
 * 4, 8) and KV dtype, with mixed batches (a fresh prompt, a chunk after a
 * cached prefix, a decode row) and a long prefix. Tolerances (max error /
 * max |reference|): the tensor-core kernel rounds Q and the softmax weights
 * to the KV's 16-bit type (f16 for q8_0 and fp8, whose values are
 * dequantized to f16): 2e-3 for f16-based math, 1e-2 for bf16; the f32
 * CUDA-core kernel 2e-5. The decode kernel's tensor-core path (query
 * groups of 4 and 8, head_dim 64 and 128, f16/bf16/q8_0) rounds alike and
 * is held to the same tolerances.
 * Skips (77) without a CUDA device. */
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
#include "quant.h"

#define F gpu_F /* the program's fixture (gpu_fixture.h) */

/* ---- the fragment layouts ------------------------------------------------- */

static uint16_t to16(float x, int bf16)
{
    return bf16 ? float_to_bf16(x) : float_to_half(x);
}

static float from16(uint16_t h, int bf16)
{
    return bf16 ? bf16_to_float(h) : half_to_float(h);
}

/* One kvd_k_mma_check run: a [16][16], b [16][8] (16-bit), c [16][8]; d
 * [3][32][4] and ldsm [6][32][4] come back. */
static void mma_check(const uint16_t *a, const uint16_t *b, const float *c, const uint16_t *mats,
                      int bf16, float *d, uint32_t *ldsm)
{
    uint16_t *da = gpu_dup(&F, a, 256 * 2), *db = gpu_dup(&F, b, 128 * 2);
    uint16_t *dm = gpu_dup(&F, mats, 256 * 2);
    float *dc = gpu_dup(&F, c, 128 * 4), *dd = gpu_nan(&F, 3 * 128);
    uint32_t *dl = (uint32_t *)gpu_nan(&F, 6 * 128);
    assert_int_equal(kvd_k_mma_check(dd, dl, da, db, dc, dm, bf16, NULL), 0);
    gpu_get(&F, d, dd, 3 * 128 * 4);
    gpu_get(&F, ldsm, dl, 6 * 128 * 4);
    gpu_free(&F, da);
    gpu_free(&F, db);
    gpu_free(&F, dm);
    gpu_free(&F, dc);
    gpu_free(&F, dd);
    gpu_free(&F, dl);
}

/* Lane (g, t)'s D element i is C/D[g + 8 (i >> 1)][2t + (i & 1)] (PTX ISA,
 * mma.m16n8k16 accumulators); with small integers every sum is exact, so
 * the hardware and the emulator must both give these values exactly. */
static void test_mma_fragments(void **state)
{
    rnd_seed(41);
    for (int bf16 = 0; bf16 < 2; bf16++) {
        uint16_t a[256], b[128], mats[256];
        float af[256], bfv[128], c[128], d[3 * 128];
        uint32_t ldsm[6 * 128];
        for (int i = 0; i < 256; i++) {
            af[i] = (float)((int)rnd_u32(17) - 8);
            a[i] = to16(af[i], bf16);
            mats[i] = (uint16_t)rnd_u32(65536);
        }
        for (int i = 0; i < 128; i++) {
            bfv[i] = (float)((int)rnd_u32(17) - 8);
            b[i] = to16(bfv[i], bf16);
            c[i] = (float)((int)rnd_u32(129) - 64);
        }
        mma_check(a, b, c, mats, bf16, d, ldsm);
        for (int v = 0; v < 3; v++)
            for (int lane = 0; lane < 32; lane++)
                for (int i = 0; i < 4; i++) {
                    int row = (lane >> 2) + (i >> 1) * 8, col = 2 * (lane & 3) + (i & 1);
                    float want = c[row * 8 + col];
                    for (int k = 0; k < 16; k++)
                        want += af[row * 16 + k] * bfv[k * 8 + col];
                    float got = d[(v * 32 + lane) * 4 + i];
                    if (got != want)
                        fail_msg("%s mma (fragments %s): lane %d d[%d] (D[%d][%d]) = %g, want %g",
                                 bf16 ? "bf16" : "f16",
                                 v == 0   ? "by element"
                                 : v == 1 ? "by ldmatrix"
                                          : "by ldmatrix.trans",
                                 lane, i, row, col, (double)got, (double)want);
                }
        /* ldmatrix: r[m] = matrix m's row g, columns 2t and 2t+1 (.trans:
         * column g, rows 2t and 2t+1); .x1/.x2 fill r[0] / r[0..1]. */
        for (int v = 0; v < 6; v++) {
            int count = v % 3 == 0 ? 1 : v % 3 == 1 ? 2 : 4, trans = v >= 3;
            for (int lane = 0; lane < 32; lane++)
                for (int m = 0; m < count; m++) {
                    int g = lane >> 2, t = lane & 3;
                    uint32_t lo =
                        trans ? mats[m * 64 + 2 * t * 8 + g] : mats[m * 64 + g * 8 + 2 * t];
                    uint32_t hi = trans ? mats[m * 64 + (2 * t + 1) * 8 + g]
                                        : mats[m * 64 + g * 8 + 2 * t + 1];
                    uint32_t got = ldsm[(v * 32 + lane) * 4 + m];
                    if (got != (lo | hi << 16))
                        fail_msg("ldmatrix .x%d%s: lane %d r[%d] = 0x%08x, want 0x%08x", count,
                                 trans ? ".trans" : "", lane, m, got, lo | hi << 16);
                }
        }
    }
}

/* Random values: every D element within a few units in the last place of
 * the exact sum (a device's tensor cores round the sum their own way); the
 * emulator rounds the exact sum once, so there it is equal. */
static void test_mma_rounding(void **state)
{
    rnd_seed(42);
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int rep = 0; rep < 4; rep++) {
            uint16_t a[256], b[128], mats[256] = {0};
            float c[128], d[3 * 128];
            uint32_t ldsm[6 * 128];
            double scale = rep == 3 ? 1e-3 : 1.0; /* small values too (f16 subnormal products) */
            for (int i = 0; i < 256; i++)
                a[i] = to16((float)(rnd_f(-4, 4) * scale), bf16);
            for (int i = 0; i < 128; i++) {
                b[i] = to16(rnd_f(-4, 4), bf16);
                c[i] = rnd_f(-10, 10);
            }
            mma_check(a, b, c, mats, bf16, d, ldsm);
            for (int lane = 0; lane < 32; lane++)
                for (int i = 0; i < 4; i++) {
                    int row = (lane >> 2) + (i >> 1) * 8, col = 2 * (lane & 3) + (i & 1);
                    double s = c[row * 8 + col], mag = fabs(s);
                    for (int k = 0; k < 16; k++) {
                        double p = (double)from16(a[row * 16 + k], bf16) *
                                   (double)from16(b[k * 8 + col], bf16);
                        s += p;
                        mag += fabs(p);
                    }
                    for (int v = 0; v < 3; v++) {
                        float got = d[(v * 32 + lane) * 4 + i];
#ifdef KVD_EMU
                        assert_true(got == (float)s);
#else
                        if (!(fabs(got - s) <= 4 * 0x1p-23 * mag))
                            fail_msg("mma lane %d d[%d]: %.9g, exact %.9g", lane, i, (double)got,
                                     s);
#endif
                    }
                }
        }
}

/* ---- attention against the cpu backend ------------------------------------ */

/* What the prefill kernel's arithmetic allows (see the file's comment). */
static double prefill_tol(enum kv_dtype dt, uint32_t hd)
{
    if (dt == KV_F32 || hd < 64)
        return 2e-5;
    return dt == KV_BF16 ? 1e-2 : 2e-3;
}

/* One attention batch: per sequence (pos0, rows), block_tokens bt. The cpu
 * reference reads the same blocks (q8_0/fp8: the same quantized bytes).
 * Returns the relative error (checked against tol). */
static double run_attention(enum kv_dtype dt, uint32_t hd, uint32_t n_head, uint32_t kv_heads,
                            uint32_t bt, const uint32_t (*seqs)[2], uint32_t S, double tol)
{
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
    for (uint32_t i = 0; i < NS; i++) /* scattered: the reverse order, two spare blocks first */
        slots[i] = NS + 2 - i;
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
    double e = rel_err(got, ref, QN);
    printf("attention %s hd %u heads %u/%u max_q %u max_kv %u: error %.3g (tolerance %.3g)\n",
           kv_dtype_name(dt), hd, n_head, kv_heads, max_q, max_kv, e, tol);
    if (!(e <= tol))
        fail_msg("attention %s hd %u heads %u/%u max_q %u max_kv %u: relative error %.3g over "
                 "%.3g",
                 kv_dtype_name(dt), hd, n_head, kv_heads, max_q, max_kv, e, tol);
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
    return e;
}

static const enum kv_dtype tc_dtypes[] = {KV_F16, KV_BF16, KV_Q8_0, KV_FP8};
static const uint32_t tc_hds[] = {64, 128, 256};
/* (query heads, kv heads) for GQA groups 1, 4, 8 */
static const uint32_t tc_heads[3][2] = {{2, 2}, {8, 2}, {8, 1}};

/* Every tensor-core instance (head_dim x dtype), each group size at every
 * head_dim and with every dtype: a fresh prompt, a chunk after a cached
 * prefix (neither a multiple of a tile) and a decode row in one batch. */
static void test_prefill_tensor_cores(void **state)
{
    rnd_seed(43);
    for (size_t di = 0; di < 3; di++)
        for (size_t ti = 0; ti < 4; ti++) {
            size_t h = (di + ti) % 3;
            uint32_t seqs[3][2] = {
                {0, 1 + rnd_u32(40)}, {1 + rnd_u32(200), 33 + rnd_u32(70)}, {rnd_u32(500), 1}};
            run_attention(tc_dtypes[ti], tc_hds[di], tc_heads[h][0], tc_heads[h][1], 16,
                          (const uint32_t(*)[2])seqs, 3, prefill_tol(tc_dtypes[ti], tc_hds[di]));
        }
}

/* A chunk after a long cached prefix (many tiles, the online softmax's
 * rescaling over them), 256-token blocks. */
static void test_prefill_long_prefix(void **state)
{
    rnd_seed(44);
    uint32_t seqs[2][2] = {{1500 + rnd_u32(500), 40 + rnd_u32(40)}, {700 + rnd_u32(100), 17}};
    run_attention(KV_F16, 128, 8, 2, 256, (const uint32_t(*)[2])seqs, 2, 2e-3);
}

/* The f32 CUDA-core kernel: f32 KV at the tensor-core head_dims, every
 * dtype at 16 and 32. */
static void test_prefill_cuda_cores(void **state)
{
    rnd_seed(45);
    static const uint32_t heads[][2] = {{8, 8}, {8, 2}, {12, 4}};
    for (size_t di = 0; di < 3; di++) {
        uint32_t seqs[3][2] = {
            {0, 1 + rnd_u32(40)}, {rnd_u32(200), 33 + rnd_u32(70)}, {rnd_u32(500), 1}};
        run_attention(KV_F32, tc_hds[di], heads[di][0], heads[di][1], 16,
                      (const uint32_t(*)[2])seqs, 3, 2e-5);
    }
    static const enum kv_dtype small[] = {KV_F16, KV_BF16, KV_Q8_0, KV_FP8};
    for (size_t ti = 0; ti < 4; ti++) {
        uint32_t hd = ti == 0 ? 16 : 32;
        uint32_t seqs[3][2] = {{0, 1 + rnd_u32(40)}, {rnd_u32(200), 33 + rnd_u32(70)}, {7, 1}};
        run_attention(small[ti], hd, heads[ti % 3][0], heads[ti % 3][1], 16,
                      (const uint32_t(*)[2])seqs, 3, 2e-5);
    }
}

/* ---- decode on tensor cores ----------------------------------------------- */

/* The f16/bf16 mma instructions the emulated device has executed (0 on a
 * real device, which does not count them). */
static unsigned long long mma_count(void)
{
#ifdef KVD_CUDA_EMULATE
    struct kvd_emu_counts c;
    kvd_emu_get_counts(&c);
    return c.mma_f16;
#else
    return 0;
#endif
}

/* One decode-only batch (every sequence one row: the decode kernel, early
 * loads) of the given contexts; returns the mma instructions it executed. */
static unsigned long long run_decode(enum kv_dtype dt, uint32_t hd, uint32_t n_head,
                                     uint32_t kv_heads, const uint32_t *ctx, uint32_t S, double tol)
{
    uint32_t seqs[8][2];
    assert_true(S <= 8);
    for (uint32_t s = 0; s < S; s++) {
        seqs[s][0] = ctx[s] - 1;
        seqs[s][1] = 1;
    }
    const unsigned long long before = mma_count();
    run_attention(dt, hd, n_head, kv_heads, 16, (const uint32_t(*)[2])seqs, S, tol);
    return mma_count() - before;
}

/* Whether the decode kernel runs on tensor cores (attn_decode_mma.cuh
 * AD_MMA): query groups of 3 to 8 heads (a block's 4 or 8), head_dim 64 and
 * 128, f16, bf16 and q8_0 rows. */
static int decode_mma(enum kv_dtype dt, uint32_t hd, uint32_t group)
{
    return group >= 3 && (hd == 64 || hd == 128) &&
           (dt == KV_F16 || dt == KV_BF16 || dt == KV_Q8_0);
}

/* The decode kernel at query groups of 4 and 8 against the cpu backend:
 * every head_dim x 16-bit/quantized dtype, groups alternating, one sequence
 * (one split) and several of short and long contexts (split and unsplit in
 * one launch, a tile's partial end). Then a group of 3 (padded to 8), a
 * single long context (many splits), and a mixed step's decode rows beside
 * a prefill chunk (loads after the wait only). On the emulator the
 * tensor-core instances must have issued mma instructions, the others
 * (head_dim 256, fp8 and f32 rows, groups of 1 and 2: the scalar kernel)
 * none. */
static void test_decode_tensor_cores(void **state)
{
    rnd_seed(46);
    for (size_t di = 0; di < 3; di++)
        for (size_t ti = 0; ti < 4; ti++) {
            const int g8 = (int)((di + ti) % 2);
            const uint32_t n_head = 8, kv_heads = g8 ? 1 : 2, hd = tc_hds[di];
            const enum kv_dtype dt = tc_dtypes[ti];
            const int mma = decode_mma(dt, hd, n_head / kv_heads);
            const double tol = mma ? prefill_tol(dt, hd) : 2e-5;
            const uint32_t one[1] = {1 + rnd_u32(60)};
            const uint32_t several[3] = {17 + rnd_u32(40), 1, 1500 + rnd_u32(1500)};
            unsigned long long n = run_decode(dt, hd, n_head, kv_heads, one, 1, tol);
            n += run_decode(dt, hd, n_head, kv_heads, several, 3, tol);
#ifdef KVD_CUDA_EMULATE
            if ((n > 0) != mma)
                fail_msg("decode %s hd %u group %u: %llu mma issued", kv_dtype_name(dt), hd,
                         n_head / kv_heads, n);
#else
            (void)n;
#endif
        }
    const uint32_t g3[2] = {200 + rnd_u32(100), 2500 + rnd_u32(500)};
    const unsigned long long n3 = run_decode(KV_F16, 128, 12, 4, g3, 2, 2e-3);
    const uint32_t longer[1] = {3000 + rnd_u32(1000)};
    const unsigned long long n8 = run_decode(KV_BF16, 64, 16, 2, longer, 1, 1e-2);
    uint32_t mixed[3][2] = {{rnd_u32(300), 1}, {40 + rnd_u32(40), 20}, {1200 + rnd_u32(800), 1}};
    run_attention(KV_Q8_0, 128, 8, 1, 16, (const uint32_t(*)[2])mixed, 3, 2e-3);
    /* The scalar kernel: groups 1 and 2, f32 rows at group 8. */
    const uint32_t ctx[2] = {100, 700};
    unsigned long long scalar = run_decode(KV_F16, 128, 4, 2, ctx, 2, 2e-5);
    scalar += run_decode(KV_BF16, 64, 4, 4, ctx, 2, 2e-5);
    scalar += run_decode(KV_F32, 128, 8, 1, ctx, 2, 2e-5);
#ifdef KVD_CUDA_EMULATE
    assert_true(n3 > 0 && n8 > 0);
    assert_true(scalar == 0);
#else
    (void)n3;
    (void)n8;
    (void)scalar;
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        GPU_TEST(test_mma_fragments),        GPU_TEST(test_mma_rounding),
        GPU_TEST(test_prefill_tensor_cores), GPU_TEST(test_prefill_long_prefix),
        GPU_TEST(test_prefill_cuda_cores),   GPU_TEST(test_decode_tensor_cores),
    };
    /* The skip decision happens before cmocka runs, so "no device" exits 77. */
    gpu_fx_open(&F);
    gpu_fx_close(&F);
    return cmocka_run_group_tests(tests, gpu_fx_setup, gpu_fx_teardown);
}

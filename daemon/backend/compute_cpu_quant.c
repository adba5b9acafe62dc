/* cpu matmul of the block-quantized weights Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 * Q5_K, Q6_K (quant_blocks.h), with llama.cpp's arithmetic: the activation
 * rows are quantized once per call, to blocks of 32 int8 with an f16 scale
 * (against Q4_0/Q5_0, ggml's Q8_0; against Q4_1/Q5_1 also the f16 of scale
 * times sum, ggml's Q8_1) or to super-blocks of 256 int8 with an f32 scale
 * and the sums of each 16 (against the K-quants, ggml's Q8_K); then every
 * output is a sum over blocks of (weight scale x activation scale) x an
 * exact integer dot product, less the weights' offsets (the -8/-16/-32 of
 * the symmetric types, the mins of the others) applied through the
 * activation sums. So an output equals llama.cpp's up to the order of the
 * float additions over blocks.
 *
 * Layout: the file's rows (CL_ROWS): a row is a run of blocks whose
 * quants are already grouped for 32-byte vector loads, so repacking buys
 * nothing for the integer dot products.
 *
 * Kernels: one dot product per (weight row, activation row), AVX2
 * (maddubs / madd on 32 quants at a time) or portable C (the same integer
 * sums); KVD_CPU_SCALAR=1 selects the portable one at run time. Threads take
 * chunks of QM_CHUNK weight rows from an atomic counter and run every
 * activation row against the chunk while it is in L1/L2: at one activation
 * row (decode) that is a memory-bound GEMV that reads each weight byte
 * once; at many (prefill, batched decode) each weight block is reused
 * across the rows from cache. Every output is computed the same way
 * whatever the thread count. */
#include <math.h>
#include <stdlib.h>

#include "compute_cpu_impl.h"
#include "kvd/status.h"
#include "quant.h"
#include "quant_blocks.h"

#define QM_CHUNK 8 /* weight rows per work item */
#define QK_NR 4    /* activation rows per pass of the K-quant kernels */

/* An activation block of 32 (against Q4_0, Q5_0: ggml's Q8_0; against Q4_1,
 * Q5_1: its Q8_1). d: the f16 scale widened; s: the f16 of (scale x sum of
 * qs) widened (Q8_1's s); sum: the sum of qs. */
struct act32 {
    float d, s;
    int32_t sum, pad;
    int8_t qs[32];
};

/* An activation super-block of 256 (ggml's Q8_K): f32 scale, the sums of
 * each 16 quants, and of each 32 (for the Q4_K/Q5_K mins; computed once
 * here rather than for every weight row). */
struct act256 {
    float d;
    int32_t pad[3];
    int16_t bsums32[8];
    int16_t bsums[16];
    int8_t qs[256];
};

static bool is_k(enum ctype t)
{
    return t == CT_Q4_K || t == CT_Q5_K || t == CT_Q6_K;
}

bool cpu_qmatmul_type(enum ctype t)
{
    return t == CT_Q4_0 || t == CT_Q4_1 || t == CT_Q5_0 || t == CT_Q5_1 || is_k(t);
}

static inline float f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline int rnd_even(float v) /* round half to even, as ggml's nearest_int */
{
    return (int)lrintf(v);
}

/* ---- activation quantization --------------------------------------------- */

static void act_quant32(const float *x, uint32_t n, struct act32 *a)
{
    for (uint32_t b = 0; b < n / 32; b++, a++) {
        const float *xb = x + (size_t)b * 32;
        float amax = 0;
        for (int i = 0; i < 32; i++)
            amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        float d = amax / 127.0f, id = amax != 0 ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = rnd_even(xb[i] * id);
            a->qs[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
            sum += a->qs[i];
        }
        a->d = half_to_float(float_to_half(d));
        a->s = half_to_float(float_to_half(d * (float)sum));
        a->sum = sum;
        a->pad = 0;
    }
}

static void act_quant256(const float *x, uint32_t n, struct act256 *a)
{
    for (uint32_t b = 0; b < n / 256; b++, a++) {
        const float *xb = x + (size_t)b * 256;
        float amax = 0, mx = 0;
        for (int i = 0; i < 256; i++)
            if (fabsf(xb[i]) > amax)
                amax = fabsf(xb[i]), mx = xb[i];
        memset(a, 0, sizeof *a);
        if (amax == 0)
            continue;
        float iscale = -127.0f / mx;
        for (int i = 0; i < 256; i++) {
            int q = rnd_even(iscale * xb[i]);
            a->qs[i] = (int8_t)(q > 127 ? 127 : q);
            a->bsums[i / 16] = (int16_t)(a->bsums[i / 16] + a->qs[i]);
        }
        for (int j = 0; j < 8; j++)
            a->bsums32[j] = (int16_t)(a->bsums[2 * j] + a->bsums[2 * j + 1]);
        a->d = 1.0f / iscale;
    }
}

/* Bytes of one quantized activation row of n values for weights of type t. */
static size_t act_row_bytes(enum ctype t, uint32_t n)
{
    return is_k(t) ? (size_t)n / 256 * sizeof(struct act256)
                   : (size_t)n / 32 * sizeof(struct act32);
}

/* ---- portable dot products ----------------------------------------------- */

/* The 4-bit quants of a 32-block's qs, in value order. */
static inline void unpack_nib32(const uint8_t *qs, int *q)
{
    for (int i = 0; i < 16; i++)
        q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4;
}

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static float dot_legacy_c(enum ctype t, const uint8_t *w, const struct act32 *a, uint32_t n)
{
    float s = 0;
    size_t bb = ctype_block_bytes(t);
    for (uint32_t b = 0; b < n / 32; b++, w += bb, a++) {
        int q[32];
        const uint8_t *qs = t == CT_Q4_0   ? w + 2
                            : t == CT_Q4_1 ? w + 4
                            : t == CT_Q5_0 ? w + 6
                                           : w + 8;
        unpack_nib32(qs, q);
        if (t == CT_Q5_0 || t == CT_Q5_1) {
            uint32_t h = rd32(t == CT_Q5_0 ? w + 2 : w + 4);
            for (int i = 0; i < 32; i++)
                q[i] |= (int)((h >> i) & 1) << 4;
        }
        int32_t sumi = 0;
        for (int i = 0; i < 32; i++)
            sumi += q[i] * a->qs[i];
        float dw = f16(w);
        switch (t) {
        case CT_Q4_0:
            s += dw * a->d * (float)(sumi - 8 * a->sum);
            break;
        case CT_Q5_0:
            s += dw * a->d * (float)(sumi - 16 * a->sum);
            break;
        default:
            s += dw * a->d * (float)sumi + f16(w + 2) * a->s;
            break; /* q4_1, q5_1 */
        }
    }
    return s;
}

/* The K-quants' float arithmetic is llama.cpp's for the kernel it runs per
 * activation row on x86 (the same on every path here, so the AVX2 and the
 * portable results are the same bits):
 * - Q4_K (its interleaved GEMV, ggml_gemv_q4_K_8x8_q8_K): per super-block
 *   one exact integer sum for the scales' term and one for the mins', each
 *   converted once and added with one fused multiply-add by (d_w x d_a) and
 *   (dmin_w x d_a) into two accumulators, in super-block order; the output
 *   is the first less the second (k_acc);
 * - Q5_K, Q6_K (ggml_vec_dot_q5_K_q8_K / q6_K_q8_K): 8 int32 lanes per
 *   super-block, lane k the sum over the 32-value chunks of sub-block scale x
 *   (q . y) over the chunk's values 4k..4k+3 (Q6_K: its q unsigned, less
 *   32 x (sums of 16 . scales) of the sub-block pair 2k, 2k+1), each lane
 *   converted and added by its own fused multiply-add by d_a x d_w into 8
 *   accumulators, in super-block order; the output is their sum
 *   ((0+4 + 2+6) + (1+5 + 3+7), hsum8) plus, for Q5_K, the mins' term
 *   accumulated by fused multiply-adds of (mins . sums of 32) by
 *   -d_a x dmin_w. */
static inline void k_acc(float *acc, float *accm, int32_t sumi, int32_t summ, float dw, float dmw,
                         float da)
{
    *acc = fmaf((float)sumi, dw * da, *acc);
    *accm = fmaf((float)summ, dmw * da, *accm);
}

static inline float hsum8(const float *a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static float dot_k_c(enum ctype t, const uint8_t *w, const struct act256 *a, uint32_t n)
{
    float acc = 0, accm = 0, acc8[8] = {0};
    size_t bb = ctype_block_bytes(t);
    for (uint32_t b = 0; b < n / 256; b++, w += bb, a++) {
        int32_t lane[8] = {0};
        if (t == CT_Q6_K) {
            struct block_q6_K k;
            memcpy(&k, w, sizeof k);
            for (int v = 0; v < 256; v++) {
                int h = v / 128, c = v % 128 / 32, l = v % 32;
                const uint8_t *ql = k.ql + 64 * h + 32 * (c & 1), *qh = k.qh + 32 * h;
                int q = (c < 2 ? ql[l] & 15 : ql[l] >> 4) | ((qh[l] >> (2 * c)) & 3) << 4;
                lane[v % 32 / 4] += k.scales[v / 16] * q * a->qs[v];
            }
            for (int l = 0; l < 8; l++)
                lane[l] -= 32 * (a->bsums[2 * l] * k.scales[2 * l] +
                                 a->bsums[2 * l + 1] * k.scales[2 * l + 1]);
            float d = a->d * half_to_float(k.d);
            for (int l = 0; l < 8; l++)
                acc8[l] = fmaf((float)lane[l], d, acc8[l]);
            continue;
        }
        /* q4_K, q5_K: d*sc*q - dmin*mn per sub-block of 32 */
        const uint8_t *scales = w + 4, *qh = w + 16, *qs = t == CT_Q5_K ? w + 48 : w + 16;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            quant_k_scale_min(j, scales, &sc, &mn);
            for (int l = 0; l < 32; l++) {
                int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
                if (t == CT_Q5_K)
                    q |= ((qh[l] >> j) & 1) << 4;
                lane[l / 4] += sc * q * a->qs[32 * j + l];
            }
            summ += mn * a->bsums32[j];
        }
        if (t == CT_Q5_K) {
            float d = a->d * f16(w);
            for (int l = 0; l < 8; l++)
                acc8[l] = fmaf((float)lane[l], d, acc8[l]);
            accm = fmaf((float)summ, -a->d * f16(w + 2), accm);
            continue;
        }
        for (int l = 0; l < 8; l++)
            sumi += lane[l];
        k_acc(&acc, &accm, sumi, summ, f16(w), f16(w + 2), a->d);
    }
    return t == CT_Q4_K ? acc - accm : hsum8(acc8) + accm;
}

/* ---- AVX2 dot products ----------------------------------------------------- */

#if defined(__x86_64__)
#include <immintrin.h>
#define QSIMD __attribute__((target("avx2,fma,f16c")))
#define QINLINE static inline __attribute__((always_inline))

QINLINE QSIMD float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QINLINE QSIMD float h16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The sum of 8 (4) int32 lanes: exact, so the order does not matter. */
QINLINE QSIMD int32_t hsum_i32x4(__m128i v)
{
    v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 1));
    return _mm_cvtsi128_si32(v);
}

QINLINE QSIMD int32_t hsum_i32x8(__m256i v)
{
    return hsum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* k_acc with the FMA instruction (one rounding, as fmaf). */
QINLINE QSIMD void k_acc_avx2(float *acc, float *accm, int32_t sumi, int32_t summ, float dw,
                              float dmw, float da)
{
    *acc =
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss((float)sumi), _mm_set_ss(dw * da), _mm_set_ss(*acc)));
    *accm = _mm_cvtss_f32(
        _mm_fmadd_ss(_mm_set_ss((float)summ), _mm_set_ss(dmw * da), _mm_set_ss(*accm)));
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles (values 0..15), then the
 * high ones (16..31). */
QINLINE QSIMD __m256i nib32(const uint8_t *qs)
{
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

/* 32 bits -> 32 bytes: 16 where bit i is set, else 0. */
QINLINE QSIMD __m256i bits32(const uint8_t *qh)
{
    int32_t h;
    memcpy(&h, qh, 4);
    __m256i v = _mm256_shuffle_epi8(
        _mm256_set1_epi32(h),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* sum of u[i] * s[i] (u unsigned < 64, s int8) as 8 int32 lanes */
QINLINE QSIMD __m256i dot_us(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static QSIMD float dot_legacy_avx2(enum ctype t, const uint8_t *w, const struct act32 *a,
                                   uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    float accs = 0;
    size_t bb = ctype_block_bytes(t);
    for (uint32_t b = 0; b < n / 32; b++, w += bb, a++) {
        __m256i q, y = _mm256_loadu_si256((const __m256i *)a->qs);
        float dw = h16(w);
        switch (t) {
        case CT_Q4_0:
            q = nib32(w + 2);
            accs -= dw * a->d * (float)(8 * a->sum);
            break;
        case CT_Q4_1:
            q = nib32(w + 4);
            accs += h16(w + 2) * a->s;
            break;
        case CT_Q5_0:
            q = _mm256_or_si256(nib32(w + 6), bits32(w + 2));
            accs -= dw * a->d * (float)(16 * a->sum);
            break;
        default: /* q5_1 */
            q = _mm256_or_si256(nib32(w + 8), bits32(w + 4));
            accs += h16(w + 2) * a->s;
            break;
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->d), _mm256_cvtepi32_ps(dot_us(q, y)), acc);
    }
    return hsum_ps(acc) + accs;
}

/* The 6-bit scales and mins of a Q4_K/Q5_K super-block (its scales[12],
 * quant_k_scale_min's packing) as 16 bytes: the 8 scales, then the 8 mins.
 * Bytes 0..3 hold scales 0..3 and the top bits of scales 4..7, bytes 4..7
 * mins 0..3 and the top bits of mins 4..7, bytes 8..11 the low 4 bits of
 * scales 4..7 (low nibbles) and mins 4..7 (high nibbles). */
QINLINE QSIMD __m128i k_scales_mins(const uint8_t *q)
{
    uint32_t a, b, c;
    memcpy(&a, q, 4), memcpy(&b, q + 4, 4), memcpy(&c, q + 8, 4);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    uint32_t s03 = a & m6, m03 = b & m6;
    uint32_t s47 = (c & m4) | ((a >> 6) & m2) << 4, m47 = ((c >> 4) & m4) | ((b >> 6) & m2) << 4;
    return _mm_set_epi32((int)m47, (int)m03, (int)s47, (int)s03);
}

/* The K-quant kernels run one weight row against nr (1..QK_NR) activation
 * rows a[0..nr-1], unpacking each weight super-block once for all of them;
 * out[r] is computed exactly as with nr = 1 (per output: the same integer
 * sums, the same float operations in the same order), so an output does not
 * depend on the batch. */
/* Q4_K / Q5_K: per super-block the integer sum over sub-blocks of
 * scale x (q . y) in 8 int32 lanes, and the mins' term (mins . the
 * activation's sums of 32) in 4; Q4_K sums each to one int32 and adds it to
 * its accumulator by k_acc_avx2, Q5_K adds the 8 lanes by one vector FMA and
 * the mins' sum by a scalar one (dot_k_c's arithmetic, bit for bit). */
QINLINE QSIMD void dot_q45k_avx2_n(bool q5, const uint8_t *w, const struct act256 *const *a, int nr,
                                   uint32_t n, float *out)
{
    float acc[QK_NR], accm[QK_NR];
    int32_t summ[QK_NR];
    __m256 acc8[QK_NR];
    for (int r = 0; r < nr; r++)
        acc[r] = 0, accm[r] = 0, acc8[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const size_t bb = q5 ? 176 : 144;
    for (uint32_t b = 0; b < n / 256; b++, w += bb) {
        __m256i sm = _mm256_cvtepu8_epi16(k_scales_mins(w + 4));
        __m128i mins = _mm256_extracti128_si256(sm, 1);
        __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        float dw = h16(w), dmw = h16(w + 2);
        const uint8_t *qs = q5 ? w + 48 : w + 16;
        __m256i hb = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        __m256i sumi[QK_NR];
        for (int r = 0; r < nr; r++) {
            summ[r] =
                hsum_i32x4(_mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)a[r][b].bsums32)));
            sumi[r] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 4; j++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q4, m4),
                    hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if (q5) {
                lo = _mm256_or_si256(
                    lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                hi = _mm256_or_si256(
                    hi,
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            /* the 16-bit scale of sub-block 2j, 2j+1 in every lane */
            __m256i sl =
                _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0404 * j)));
            __m256i sh =
                _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0302 + 0x0404 * j)));
            for (int r = 0; r < nr; r++) {
                const int8_t *y = a[r][b].qs + 64 * j;
                __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y));
                __m256i phi =
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32)));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_madd_epi16(sl, plo),
                                                                     _mm256_madd_epi16(sh, phi)));
            }
        }
        for (int r = 0; r < nr; r++) {
            float da = a[r][b].d;
            if (!q5) {
                k_acc_avx2(&acc[r], &accm[r], hsum_i32x8(sumi[r]), summ[r], dw, dmw, da);
                continue;
            }
            acc8[r] =
                _mm256_fmadd_ps(_mm256_set1_ps(da * dw), _mm256_cvtepi32_ps(sumi[r]), acc8[r]);
            accm[r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss((float)summ[r]), _mm_set_ss(-da * dmw),
                                                 _mm_set_ss(accm[r])));
        }
    }
    for (int r = 0; r < nr; r++)
        out[r] = q5 ? hsum_ps(acc8[r]) + accm[r] : acc[r] - accm[r];
}

/* Q6_K: per super-block the integer sum over its 16 sub-blocks of
 * scale x ((q - 32) . y), the -32 applied exactly through the activation's
 * sums of 16, in 8 int32 lanes, added by one vector FMA (dot_k_c's
 * arithmetic, bit for bit). */
QINLINE QSIMD void dot_q6k_avx2_n(const uint8_t *w, const struct act256 *const *a, int nr,
                                  uint32_t n, float *out)
{
    __m256 acc8[QK_NR];
    for (int r = 0; r < nr; r++)
        acc8[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);
    for (uint32_t b = 0; b < n / 256; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        __m256i sumi[QK_NR];
        for (int r = 0; r < nr; r++) /* -32 x (scales . sums of 16) */
            sumi[r] = _mm256_sub_epi32(
                _mm256_setzero_si256(),
                _mm256_slli_epi32(
                    _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a[r][b].bsums)),
                    5));
        for (int h = 0; h < 2; h++) {
            /* scales 8h..8h+7 as 16-bit values in both halves */
            __m256i sch = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                            : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            __m256i qla = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i qlb = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i qhv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(qla, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(qhv, m3), 4));
            q[1] = _mm256_or_si256(
                _mm256_and_si256(qlb, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhv, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qla, 4), m4),
                                   _mm256_and_si256(qhv, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qlb, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(qhv, 2), m30));
            for (int c = 0; c < 4; c++) {
                /* scale 8h+2c in the low half's lanes, 8h+2c+1 in the high's */
                __m256i sv = _mm256_shuffle_epi8(
                    sch, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * c)),
                                          _mm_set1_epi16((short)(0x0100 + 0x0404 * c))));
                for (int r = 0; r < nr; r++) {
                    __m256i p = _mm256_maddubs_epi16(
                        q[c], _mm256_loadu_si256((const __m256i *)(a[r][b].qs + 128 * h + 32 * c)));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sv));
                }
            }
        }
        float dw = h16(w + 208);
        for (int r = 0; r < nr; r++)
            acc8[r] = _mm256_fmadd_ps(_mm256_set1_ps(a[r][b].d * dw), _mm256_cvtepi32_ps(sumi[r]),
                                      acc8[r]);
    }
    for (int r = 0; r < nr; r++)
        out[r] = hsum_ps(acc8[r]);
}

/* The K-quant kernels specialized for each nr (the compiler unrolls the
 * row loops and keeps the accumulators in registers). */
#define QK_VARIANTS(X) X(1) X(2) X(3) X(4)
#define QK_DEF(N)                                                                                  \
    static QSIMD void dot_q4k_avx2_##N(const uint8_t *w, const struct act256 *const *a,            \
                                       uint32_t n, float *out)                                     \
    {                                                                                              \
        dot_q45k_avx2_n(false, w, a, N, n, out);                                                   \
    }                                                                                              \
    static QSIMD void dot_q5k_avx2_##N(const uint8_t *w, const struct act256 *const *a,            \
                                       uint32_t n, float *out)                                     \
    {                                                                                              \
        dot_q45k_avx2_n(true, w, a, N, n, out);                                                    \
    }                                                                                              \
    static QSIMD void dot_q6k_avx2_##N(const uint8_t *w, const struct act256 *const *a,            \
                                       uint32_t n, float *out)                                     \
    {                                                                                              \
        dot_q6k_avx2_n(w, a, N, n, out);                                                           \
    }
QK_VARIANTS(QK_DEF)

typedef void (*kdot_fn)(const uint8_t *w, const struct act256 *const *a, uint32_t n, float *out);

static kdot_fn kdot_avx2(enum ctype t, int nr)
{
    static const kdot_fn f[3][QK_NR] = {
        {dot_q4k_avx2_1, dot_q4k_avx2_2, dot_q4k_avx2_3, dot_q4k_avx2_4},
        {dot_q5k_avx2_1, dot_q5k_avx2_2, dot_q5k_avx2_3, dot_q5k_avx2_4},
        {dot_q6k_avx2_1, dot_q6k_avx2_2, dot_q6k_avx2_3, dot_q6k_avx2_4}};
    return f[t == CT_Q4_K ? 0 : t == CT_Q5_K ? 1 : 2][nr - 1];
}
#endif

/* ---- the matmul -------------------------------------------------------------- */

struct qm_job {
    const struct ctensor *w;
    const void *xq; /* quantized activation rows, act_row_bytes apart */
    size_t xq_rb;
    float *y;
    uint32_t rows;
    size_t n_chunks;
    bool simd;
    atomic_size_t next;
};

static float qdot(const struct qm_job *j, const uint8_t *wr, const void *xr)
{
    enum ctype t = j->w->type;
    uint32_t n = j->w->ne0;
#if defined(__x86_64__)
    if (j->simd)
        return dot_legacy_avx2(t, wr, xr, n);
#endif
    return dot_legacy_c(t, wr, xr, n);
}

/* Weight row wr against the nr activation rows from xr: out[0..nr-1]. */
static void kdot(const struct qm_job *j, const uint8_t *wr, const uint8_t *xr, int nr, float *out)
{
    enum ctype t = j->w->type;
    uint32_t n = j->w->ne0;
    const struct act256 *a[QK_NR];
    for (int r = 0; r < nr; r++)
        a[r] = (const struct act256 *)(xr + r * j->xq_rb);
#if defined(__x86_64__)
    if (j->simd) {
        kdot_avx2(t, nr)(wr, a, n, out);
        return;
    }
#endif
    for (int r = 0; r < nr; r++)
        out[r] = dot_k_c(t, wr, a[r], n);
}

static void qm_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct qm_job *j = arg;
    size_t out = j->w->ne1, rb = ctype_row_bytes(j->w->type, j->w->ne0);
    const uint8_t *w0 = j->w->data, *x0 = j->xq;
    bool k = is_k(j->w->type);
    (void)ith, (void)nth;
    for (size_t ci; (ci = atomic_fetch_add(&j->next, 1)) < j->n_chunks;) {
        size_t c0 = ci * QM_CHUNK, c1 = c0 + QM_CHUNK < out ? c0 + QM_CHUNK : out;
        if (!k) {
            for (uint32_t r = 0; r < j->rows; r++)
                for (size_t c = c0; c < c1; c++)
                    j->y[(size_t)r * out + c] = qdot(j, w0 + c * rb, x0 + r * j->xq_rb);
            continue;
        }
        /* the K-quants: up to QK_NR activation rows per pass over the chunk */
        for (uint32_t r = 0; r < j->rows; r += QK_NR) {
            int nr = j->rows - r < QK_NR ? (int)(j->rows - r) : QK_NR;
            for (size_t c = c0; c < c1; c++) {
                float o[QK_NR];
                kdot(j, w0 + c * rb, x0 + r * j->xq_rb, nr, o);
                for (int i = 0; i < nr; i++)
                    j->y[(size_t)(r + i) * out + c] = o[i];
            }
        }
    }
}

struct qa_job {
    enum ctype t;
    const float *x;
    uint8_t *xq;
    uint32_t n, rows;
    size_t rb;
    atomic_uint next;
};

static void qa_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct qa_job *j = arg;
    (void)ith, (void)nth;
    for (uint32_t r; (r = atomic_fetch_add(&j->next, 1)) < j->rows;) {
        if (is_k(j->t))
            act_quant256(j->x + (size_t)r * j->n, j->n, (struct act256 *)(j->xq + r * j->rb));
        else
            act_quant32(j->x + (size_t)r * j->n, j->n, (struct act32 *)(j->xq + r * j->rb));
    }
}

int cpu_qmatmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                float *y)
{
    if (rows == 0 || w->ne1 == 0)
        return 0;
    size_t rb = act_row_bytes(w->type, w->ne0), need = rb * rows;
    if (need > cx->qact_cap) {
        void *p = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!p)
            return KVD_ENOMEM;
        free(cx->qact);
        cx->qact = p;
        cx->qact_cap = (need + 63) / 64 * 64;
    }
    struct qa_job qa = {.t = w->type, .x = x, .xq = cx->qact, .n = w->ne0, .rows = rows, .rb = rb};
    atomic_init(&qa.next, 0);
    if (rows == 1)
        qa_task(&qa, 0, 1);
    else
        cpu_pool_run(&cx->pool, qa_task, &qa);
    struct qm_job j = {.w = w, .xq = cx->qact, .xq_rb = rb, .y = y, .rows = rows, .simd = cx->simd};
    j.n_chunks = (w->ne1 + QM_CHUNK - 1) / QM_CHUNK;
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, qm_task, &j);
    return 0;
}

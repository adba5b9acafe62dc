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

#include "compute_cpu.h"
#include "kvd/status.h"
#include "quant.h"
#include "quant_blocks.h"

#define QM_CHUNK 8 /* weight rows per work item */

/* An activation block of 32 (against Q4_0, Q5_0: ggml's Q8_0; against Q4_1,
 * Q5_1: its Q8_1). d: the f16 scale widened; s: the f16 of (scale x sum of
 * qs) widened (Q8_1's s); sum: the sum of qs. */
struct act32 {
    float d, s;
    int32_t sum, pad;
    int8_t qs[32];
};

/* An activation super-block of 256 (ggml's Q8_K): f32 scale, the sums of
 * each 16 quants. */
struct act256 {
    float d;
    int32_t pad[7];
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
    return cpu_f16_to_f32(h);
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
        a->d = cpu_f16_to_f32(cpu_f32_to_f16(d));
        a->s = cpu_f16_to_f32(cpu_f32_to_f16(d * (float)sum));
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

static float dot_k_c(enum ctype t, const uint8_t *w, const struct act256 *a, uint32_t n)
{
    float s = 0;
    size_t bb = ctype_block_bytes(t);
    for (uint32_t b = 0; b < n / 256; b++, w += bb, a++) {
        if (t == CT_Q6_K) {
            struct block_q6_K k;
            memcpy(&k, w, sizeof k);
            int32_t sumi = 0;
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t *ql = k.ql + 64 * h, *qh = k.qh + 32 * h;
                    int q[4] = {(ql[l] & 15) | (qh[l] & 3) << 4,
                                (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4,
                                (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4,
                                (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4};
                    for (int c = 0; c < 4; c++) {
                        int v = 128 * h + 32 * c + l;
                        sumi += k.scales[v / 16] * (q[c] - 32) * a->qs[v];
                    }
                }
            s += cpu_f16_to_f32(k.d) * a->d * (float)sumi;
            continue;
        }
        /* q4_K, q5_K: d*sc*q - dmin*mn per sub-block of 32 */
        const uint8_t *scales = w + 4, *qh = w + 16, *qs = t == CT_Q5_K ? w + 48 : w + 16;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            quant_k_scale_min(j, scales, &sc, &mn);
            int32_t dj = 0;
            for (int l = 0; l < 32; l++) {
                int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
                if (t == CT_Q5_K)
                    q |= ((qh[l] >> j) & 1) << 4;
                dj += q * a->qs[32 * j + l];
            }
            sumi += sc * dj;
            summ += mn * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
        }
        s += f16(w) * a->d * (float)sumi - f16(w + 2) * a->d * (float)summ;
    }
    return s;
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

static QSIMD float dot_q45k_avx2(enum ctype t, const uint8_t *w, const struct act256 *a, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    float accm = 0;
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    size_t bb = ctype_block_bytes(t);
    for (uint32_t b = 0; b < n / 256; b++, w += bb, a++) {
        const uint8_t *scales = w + 4, *qs = t == CT_Q5_K ? w + 48 : w + 16;
        uint8_t sc[8], mn[8];
        int32_t summ = 0;
        for (int j = 0; j < 8; j++) {
            quant_k_scale_min(j, scales, &sc[j], &mn[j]);
            summ += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
        }
        __m256i hb =
            t == CT_Q5_K ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q4, m4),
                    hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if (t == CT_Q5_K) {
                lo = _mm256_or_si256(
                    lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                hi = _mm256_or_si256(
                    hi,
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            __m256i plo =
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(a->qs + 64 * j)));
            __m256i phi = _mm256_maddubs_epi16(
                hi, _mm256_loadu_si256((const __m256i *)(a->qs + 64 * j + 32)));
            plo = _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * j]));
            phi = _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * j + 1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
        }
        float d = h16(w) * a->d;
        accm += h16(w + 2) * a->d * (float)summ;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc) - accm;
}

static QSIMD float dot_q6k_avx2(const uint8_t *w, const struct act256 *a, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    float accs = 0;
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);
    for (uint32_t b = 0; b < n / 256; b++, w += 210, a++) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t corr = 0;
        for (int s = 0; s < 16; s++)
            corr += sc[s] * a->bsums[s];
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
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
                const int8_t *s2 = sc + 8 * h + 2 * c;
                __m256i p = _mm256_maddubs_epi16(
                    q[c], _mm256_loadu_si256((const __m256i *)(a->qs + 128 * h + 32 * c)));
                __m256i sv = _mm256_set_m128i(_mm_set1_epi16(s2[1]), _mm_set1_epi16(s2[0]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv));
            }
        }
        float d = h16(w + 208) * a->d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        accs -= d * (float)(32 * corr); /* the -32 of every quant */
    }
    return hsum_ps(acc) + accs;
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
        return t == CT_Q6_K ? dot_q6k_avx2(wr, xr, n)
               : is_k(t)    ? dot_q45k_avx2(t, wr, xr, n)
                            : dot_legacy_avx2(t, wr, xr, n);
#endif
    return is_k(t) ? dot_k_c(t, wr, xr, n) : dot_legacy_c(t, wr, xr, n);
}

static void qm_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct qm_job *j = arg;
    size_t out = j->w->ne1, rb = ctype_row_bytes(j->w->type, j->w->ne0);
    const uint8_t *w0 = j->w->data, *x0 = j->xq;
    (void)ith, (void)nth;
    for (size_t ci; (ci = atomic_fetch_add(&j->next, 1)) < j->n_chunks;) {
        size_t c0 = ci * QM_CHUNK, c1 = c0 + QM_CHUNK < out ? c0 + QM_CHUNK : out;
        for (uint32_t r = 0; r < j->rows; r++)
            for (size_t c = c0; c < c1; c++)
                j->y[(size_t)r * out + c] = qdot(j, w0 + c * rb, x0 + r * j->xq_rb);
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

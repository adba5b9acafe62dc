/* quant: reference row conversions of the weight types (quant.h), written
 * from the block layouts of quant_blocks.h / docs/quant.md. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "half.h"
#include "quant_blocks.h"

#define H2F half_to_float

/* ---- dequantization ------------------------------------------------------ */

/* The 4-bit quant of value i (0..31) of a legacy block's qs. */
static inline int nib(const uint8_t *qs, int i)
{
    return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
}

static inline uint32_t qh32(const uint8_t *qh)
{
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

static void dq_q4_k(const struct block_q4_K *b, float *y)
{
    float d = H2F(b->d), dmin = H2F(b->dmin);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        quant_k_scale_min(j, b->scales, &sc, &mn);
        float dl = d * sc, ml = dmin * mn;
        const uint8_t *q = b->qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++)
            y[32 * j + l] = dl * (float)(j % 2 ? q[l] >> 4 : q[l] & 15) - ml;
    }
}

static void dq_q5_k(const struct block_q5_K *b, float *y)
{
    float d = H2F(b->d), dmin = H2F(b->dmin);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        quant_k_scale_min(j, b->scales, &sc, &mn);
        float dl = d * sc, ml = dmin * mn;
        const uint8_t *q = b->qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = (j % 2 ? q[l] >> 4 : q[l] & 15) | ((b->qh[l] >> j) & 1) << 4;
            y[32 * j + l] = dl * (float)v - ml;
        }
    }
}

static void dq_q6_k(const struct block_q6_K *b, float *y)
{
    float d = H2F(b->d);
    for (int h = 0; h < 2; h++) { /* two halves of 128 values */
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        const int8_t *sc = b->scales + 8 * h;
        float *yh = y + 128 * h;
        for (int l = 0; l < 32; l++) {
            int q0 = (ql[l] & 15) | ((qh[l] >> 0) & 3) << 4;
            int q1 = (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4;
            int q2 = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
            int q3 = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
            int s = l / 16;
            yh[l] = d * sc[s] * (float)(q0 - 32);
            yh[l + 32] = d * sc[s + 2] * (float)(q1 - 32);
            yh[l + 64] = d * sc[s + 4] * (float)(q2 - 32);
            yh[l + 96] = d * sc[s + 6] * (float)(q3 - 32);
        }
    }
}

int quant_dequant_row(enum ctype t, const void *src, float *out, uint64_t n)
{
    uint32_t be = ctype_block_elems(t);
    if (be == 0 || n % be)
        return -1;
    const uint8_t *p = src;
    size_t bb = ctype_block_bytes(t);
    for (uint64_t b = 0; b < n / be; b++, p += bb) {
        float *y = out + b * be;
        switch (t) {
        case CT_F32:
            memcpy(y, p, 4);
            break;
        case CT_F16: {
            uint16_t h;
            memcpy(&h, p, 2);
            *y = H2F(h);
            break;
        }
        case CT_BF16: {
            uint16_t h;
            memcpy(&h, p, 2);
            *y = bf16_to_float(h);
            break;
        }
        case CT_Q4_0: {
            struct block_q4_0 k;
            memcpy(&k, p, sizeof k);
            float d = H2F(k.d);
            for (int i = 0; i < 32; i++)
                y[i] = d * (float)(nib(k.qs, i) - 8);
            break;
        }
        case CT_Q4_1: {
            struct block_q4_1 k;
            memcpy(&k, p, sizeof k);
            float d = H2F(k.d), m = H2F(k.m);
            for (int i = 0; i < 32; i++)
                y[i] = d * (float)nib(k.qs, i) + m;
            break;
        }
        case CT_Q5_0: {
            struct block_q5_0 k;
            memcpy(&k, p, sizeof k);
            float d = H2F(k.d);
            uint32_t h = qh32(k.qh);
            for (int i = 0; i < 32; i++)
                y[i] = d * (float)((nib(k.qs, i) | (int)((h >> i) & 1) << 4) - 16);
            break;
        }
        case CT_Q5_1: {
            struct block_q5_1 k;
            memcpy(&k, p, sizeof k);
            float d = H2F(k.d), m = H2F(k.m);
            uint32_t h = qh32(k.qh);
            for (int i = 0; i < 32; i++)
                y[i] = d * (float)(nib(k.qs, i) | (int)((h >> i) & 1) << 4) + m;
            break;
        }
        case CT_Q8_0: {
            struct block_q8_0 k;
            memcpy(&k, p, sizeof k);
            float d = H2F(k.d);
            for (int i = 0; i < 32; i++)
                y[i] = d * (float)k.qs[i];
            break;
        }
        case CT_Q4_K: {
            struct block_q4_K k;
            memcpy(&k, p, sizeof k);
            dq_q4_k(&k, y);
            break;
        }
        case CT_Q5_K: {
            struct block_q5_K k;
            memcpy(&k, p, sizeof k);
            dq_q5_k(&k, y);
            break;
        }
        case CT_Q6_K: {
            struct block_q6_K k;
            memcpy(&k, p, sizeof k);
            dq_q6_k(&k, y);
            break;
        }
        }
    }
    return 0;
}

/* ---- quantization -------------------------------------------------------- */

static int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static int rnd(float v)
{
    return (int)lrintf(v);
}

/* Value of x[0..n) with the largest magnitude (its sign kept). */
static float absmax_signed(const float *x, int n)
{
    float amax = 0, mx = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax)
            amax = fabsf(x[i]), mx = x[i];
    return mx;
}

static void minmax(const float *x, int n, float *lo, float *hi)
{
    *lo = *hi = x[0];
    for (int i = 1; i < n; i++) {
        *lo = x[i] < *lo ? x[i] : *lo;
        *hi = x[i] > *hi ? x[i] : *hi;
    }
}

/* Legacy symmetric types: the largest magnitude maps to -half (q in
 * [0, 2*half)); q8_0 maps |max| to 127. */
static void q_sym(const float *x, int half, uint16_t *dh, int *q)
{
    float mx = absmax_signed(x, 32), d = mx / (float)-half;
    *dh = float_to_half(d);
    float id = d != 0 ? 1.0f / d : 0;
    for (int i = 0; i < 32; i++)
        q[i] = clampi((int)(x[i] * id + (float)half + 0.5f), 0, 2 * half - 1);
}

/* Legacy asymmetric types: [min, max] onto [0, nmax]. */
static void q_asym(const float *x, int nmax, uint16_t *dh, uint16_t *mh, int *q)
{
    float lo, hi;
    minmax(x, 32, &lo, &hi);
    float d = (hi - lo) / (float)nmax, id = d != 0 ? 1.0f / d : 0;
    *dh = float_to_half(d);
    *mh = float_to_half(lo);
    for (int i = 0; i < 32; i++)
        q[i] = clampi((int)((x[i] - lo) * id + 0.5f), 0, nmax);
}

static void pack_nibbles(const int *q, uint8_t *qs)
{
    for (int i = 0; i < 16; i++)
        qs[i] = (uint8_t)((q[i] & 15) | (q[i + 16] & 15) << 4);
}

static void pack_qh(const int *q, uint8_t *qh)
{
    uint32_t h = 0;
    for (int i = 0; i < 32; i++)
        h |= (uint32_t)((q[i] >> 4) & 1) << i;
    for (int i = 0; i < 4; i++)
        qh[i] = (uint8_t)(h >> (8 * i));
}

/* One sub-block of n values as x ~ s*q - m, q in [0, nmax], s >= 0, m >= 0
 * (the minimum is clamped to <= 0, as the K-quants store only mins to
 * subtract): a few candidate steps around (max - min) / nmax, each refined by
 * the least-squares s and m for its q, keeping the smallest squared error. */
static void fit_scale_min(const float *x, int n, int nmax, float *s_out, float *m_out)
{
    float lo, hi;
    minmax(x, n, &lo, &hi);
    lo = lo > 0 ? 0 : lo;
    if (hi <= lo) {
        *s_out = 0, *m_out = -lo;
        return;
    }
    float best_s = (hi - lo) / (float)nmax, best_m = -lo, best_err = INFINITY;
    for (int step = -4; step <= 8; step++) {
        float s = (hi - lo) / ((float)nmax + 0.25f * (float)step), is = 1.0f / s;
        /* least squares of x = s*q + mn over q from this step */
        double sq = 0, sqq = 0, sx = 0, sqx = 0;
        int q[QK_K];
        for (int i = 0; i < n; i++) {
            q[i] = clampi(rnd((x[i] - lo) * is), 0, nmax);
            sq += q[i], sqq += (double)q[i] * q[i], sx += x[i], sqx += (double)q[i] * x[i];
        }
        double det = n * sqq - sq * sq;
        float fs = s, fm = lo;
        if (det > 0) {
            fs = (float)((n * sqx - sq * sx) / det);
            fm = (float)((sqq * sx - sq * sqx) / det);
        }
        if (fm > 0 || fs <= 0) /* a positive minimum cannot be stored: keep the plain fit */
            fs = s, fm = lo;
        double err = 0;
        for (int i = 0; i < n; i++) {
            int qi = clampi(rnd((x[i] - fm) / fs), 0, nmax);
            double e = (double)fs * qi + fm - x[i];
            err += e * e;
        }
        if (err < best_err)
            best_err = (float)err, best_s = fs, best_m = -fm;
    }
    *s_out = best_s, *m_out = best_m;
}

/* q4_K / q5_K super-block: 8 sub-blocks of 32, 6-bit scales and mins. */
static void q_k45(const float *x, int nmax, uint16_t *dh, uint16_t *dminh, uint8_t *scales, int *q)
{
    float s[8], m[8], smax = 0, mmax = 0;
    for (int j = 0; j < 8; j++) {
        fit_scale_min(x + 32 * j, 32, nmax, &s[j], &m[j]);
        smax = s[j] > smax ? s[j] : smax;
        mmax = m[j] > mmax ? m[j] : mmax;
    }
    *dh = float_to_half(smax / 63);
    *dminh = float_to_half(mmax / 63);
    float d = half_to_float(*dh), dmin = half_to_float(*dminh);
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)(d > 0 ? clampi(rnd(s[j] / d), 0, 63) : 0);
        lm[j] = (uint8_t)(dmin > 0 ? clampi(rnd(m[j] / dmin), 0, 63) : 0);
    }
    memset(scales, 0, K_SCALE_SIZE);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (uint8_t)((ls[j] & 15) | (lm[j] & 15) << 4);
            scales[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            scales[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        quant_k_scale_min(j, scales, &sc, &mn);
        float dl = d * sc, ml = dmin * mn;
        for (int i = 0; i < 32; i++)
            q[32 * j + i] = dl > 0 ? clampi(rnd((x[32 * j + i] + ml) / dl), 0, nmax) : 0;
    }
}

static void q_q6_k(const float *x, struct block_q6_K *b)
{
    float s[16], smax = 0;
    for (int j = 0; j < 16; j++) {
        s[j] = absmax_signed(x + 16 * j, 16) / -32.0f;
        smax = fabsf(s[j]) > fabsf(smax) ? s[j] : smax;
    }
    memset(b, 0, sizeof *b);
    int q[QK_K];
    if (smax == 0) {
        for (int i = 0; i < QK_K; i++)
            q[i] = 32;
    } else {
        float iscale = -128.0f / smax;
        b->d = float_to_half(1.0f / iscale);
        float d = half_to_float(b->d);
        for (int j = 0; j < 16; j++) {
            b->scales[j] = (int8_t)clampi(rnd(iscale * s[j]), -128, 127);
            float dl = d * b->scales[j];
            for (int i = 0; i < 16; i++)
                q[16 * j + i] = dl != 0 ? clampi(rnd(x[16 * j + i] / dl), -32, 31) + 32 : 32;
        }
    }
    for (int h = 0; h < 2; h++) {
        uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        const int *qq = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            int q0 = qq[l], q1 = qq[l + 32], q2 = qq[l + 64], q3 = qq[l + 96];
            ql[l] = (uint8_t)((q0 & 15) | (q2 & 15) << 4);
            ql[l + 32] = (uint8_t)((q1 & 15) | (q3 & 15) << 4);
            qh[l] = (uint8_t)((q0 >> 4) | (q1 >> 4) << 2 | (q2 >> 4) << 4 | (q3 >> 4) << 6);
        }
    }
}

int quant_quantize_row(enum ctype t, const float *x, void *dst, uint64_t n)
{
    uint32_t be = ctype_block_elems(t);
    if (be == 0 || n % be)
        return -1;
    uint8_t *p = dst;
    size_t bb = ctype_block_bytes(t);
    int q[QK_K];
    for (uint64_t b = 0; b < n / be; b++, p += bb) {
        const float *xb = x + b * be;
        switch (t) {
        case CT_F32:
            memcpy(p, xb, 4);
            break;
        case CT_F16: {
            uint16_t h = float_to_half(*xb);
            memcpy(p, &h, 2);
            break;
        }
        case CT_BF16: {
            uint16_t h = float_to_bf16(*xb);
            memcpy(p, &h, 2);
            break;
        }
        case CT_Q4_0: {
            struct block_q4_0 k;
            q_sym(xb, 8, &k.d, q);
            pack_nibbles(q, k.qs);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q4_1: {
            struct block_q4_1 k;
            q_asym(xb, 15, &k.d, &k.m, q);
            pack_nibbles(q, k.qs);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q5_0: {
            struct block_q5_0 k;
            q_sym(xb, 16, &k.d, q);
            pack_nibbles(q, k.qs);
            pack_qh(q, k.qh);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q5_1: {
            struct block_q5_1 k;
            q_asym(xb, 31, &k.d, &k.m, q);
            pack_nibbles(q, k.qs);
            pack_qh(q, k.qh);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q8_0: {
            struct block_q8_0 k;
            float mx = fabsf(absmax_signed(xb, 32)), d = mx / 127, id = d != 0 ? 1.0f / d : 0;
            k.d = float_to_half(d);
            for (int i = 0; i < 32; i++)
                k.qs[i] = (int8_t)clampi(rnd(xb[i] * id), -127, 127);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q4_K: {
            struct block_q4_K k;
            q_k45(xb, 15, &k.d, &k.dmin, k.scales, q);
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    k.qs[32 * j + l] = (uint8_t)(q[64 * j + l] | q[64 * j + 32 + l] << 4);
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q5_K: {
            struct block_q5_K k;
            q_k45(xb, 31, &k.d, &k.dmin, k.scales, q);
            memset(k.qh, 0, sizeof k.qh);
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int a = q[64 * j + l], c = q[64 * j + 32 + l];
                    k.qs[32 * j + l] = (uint8_t)((a & 15) | (c & 15) << 4);
                    k.qh[l] |= (uint8_t)(((a >> 4) & 1) << (2 * j) | ((c >> 4) & 1) << (2 * j + 1));
                }
            memcpy(p, &k, sizeof k);
            break;
        }
        case CT_Q6_K: {
            struct block_q6_K k;
            q_q6_k(xb, &k);
            memcpy(p, &k, sizeof k);
            break;
        }
        }
    }
    return 0;
}

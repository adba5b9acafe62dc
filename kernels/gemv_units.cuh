// The GEMV's "units" (internal, CUDA C++ only): what one lane loads of one
// weight row per step and how it meets the activations, per weight type.
//   float types (F32, F16, BF16 rows; Q8_0 planes): 8 values (32 for Q8_0)
//     widened to f32 and multiplied by f32 activations;
//   legacy quantized types (Q4_0, Q4_1, Q5_0, Q5_1 planes): a block of 32,
//     an exact integer dot product (dp4a) with the int8 activations, scaled
//     as the cpu backend does;
//   K-quants (Q4_K, Q5_K, Q6_K planes): a quarter super-block (64 values),
//     exact integer dot products with the sub-blocks' scales, and the mins'
//     term through the activations' sums (the float part is done per
//     super-block by the GEMV, in the cpu's order).
// Quantized weights are in the plane layout (planes.cuh), so every load is
// 16 bytes (or a whole small field) at addresses consecutive across lanes.
#ifndef KVD_GEMV_UNITS_CUH
#define KVD_GEMV_UNITS_CUH

#include "act_quant.cuh"
#include "planes.cuh"

enum { GU_FLOAT, GU_LEGACY, GU_K };

// A weight matrix as the units read it: base, rows (the planes' sizes),
// blocks (or float units) per row.
struct gw {
    const uint8_t *base;
    int rows, nbk;
};

template <int WT> struct gunit;

// ---- float types -------------------------------------------------------------
static __device__ __forceinline__ void gu_widen16(const uint4 &raw, float *f, bool bf16)
{
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (bf16) {
            f[2 * k] = __uint_as_float(w[k] << 16);
            f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        } else {
            f[2 * k] = kvd_f16_to_f32((uint16_t)(w[k] & 0xffffu));
            f[2 * k + 1] = kvd_f16_to_f32((uint16_t)(w[k] >> 16));
        }
    }
}

template <> struct gunit<KVD_KW_BF16> { // rows; 8 values = 16 bytes
    static constexpr int KIND = GU_FLOAT, N = 8;
    uint4 raw;
    __device__ void load(const gw &m, int row, int u)
    {
        raw = __ldcs((const uint4 *)(m.base + (size_t)row * m.nbk * 16) + u);
    }
    __device__ void zero()
    {
        raw = make_uint4(0, 0, 0, 0);
    }
    __device__ void widen(float *f) const
    {
        gu_widen16(raw, f, true);
    }
};

template <> struct gunit<KVD_KW_F16> {
    static constexpr int KIND = GU_FLOAT, N = 8;
    uint4 raw;
    __device__ void load(const gw &m, int row, int u)
    {
        raw = __ldcs((const uint4 *)(m.base + (size_t)row * m.nbk * 16) + u);
    }
    __device__ void zero()
    {
        raw = make_uint4(0, 0, 0, 0);
    }
    __device__ void widen(float *f) const
    {
        gu_widen16(raw, f, false);
    }
};

template <> struct gunit<KVD_KW_F32> { // rows; 8 values = 32 bytes
    static constexpr int KIND = GU_FLOAT, N = 8;
    float4 a, b;
    __device__ void load(const gw &m, int row, int u)
    {
        const float4 *p = (const float4 *)(m.base + (size_t)row * m.nbk * 32) + 2 * u;
        a = __ldcs(p);
        b = __ldcs(p + 1);
    }
    __device__ void zero()
    {
        a = b = make_float4(0, 0, 0, 0);
    }
    __device__ void widen(float *f) const
    {
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
        f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
};

template <> struct gunit<KVD_KW_Q8_0> { // planes qs 32, d 2; a block of 32
    static constexpr int KIND = GU_FLOAT, N = 32;
    uint4 q0, q1;
    uint32_t d;
    __device__ void load(const gw &m, int row, int u)
    {
        const size_t blk = (size_t)row * m.nbk + u;
        const uint4 *q = (const uint4 *)kvd_pl_entry<KVD_KW_Q8_0, 0>(m.base, m.rows, m.nbk, blk);
        q0 = __ldcs(q);
        q1 = __ldcs(q + 1);
        d = __ldcs((const uint16_t *)kvd_pl_entry<KVD_KW_Q8_0, 1>(m.base, m.rows, m.nbk, blk));
    }
    __device__ void zero()
    {
        q0 = q1 = make_uint4(0, 0, 0, 0);
        d = 0;
    }
    __device__ void widen(float *f) const
    {
        const float s = kvd_f16_to_f32((uint16_t)d);
        const uint32_t w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
        for (int i = 0; i < 32; i++)
            f[i] = s * (float)(int8_t)((w[i / 4] >> (8 * (i % 4))) & 0xffu);
    }
};

// ---- legacy quantized types: a block of 32 -------------------------------------
// 4 bits (bit i of t) -> bit 4 of byte i.
static __device__ __forceinline__ uint32_t gu_spread4(uint32_t t)
{
    return ((t & 1u) << 4) | ((t & 2u) << 11) | ((t & 4u) << 18) | ((t & 8u) << 25);
}

// The integer dot of a block's 32 quants (4 words of nibbles, the fifth
// bits in qh for Q5) with token t's activations, and the block's float term
// as the cpu backend's portable path computes it.
template <int WT, int NT>
static __device__ __forceinline__ void gu_legacy_dot(const uint4 &qs, uint32_t qh, float dw,
                                                     float mw, const actq &a, int in, int u,
                                                     float *acc)
{
    const bool five = WT == KVD_KW_Q5_0 || WT == KVD_KW_Q5_1;
    const uint32_t qw[4] = {qs.x, qs.y, qs.z, qs.w};
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo[i] = qw[i] & 0x0F0F0F0Fu;
        hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        if (five) {
            lo[i] |= gu_spread4((qh >> (4 * i)) & 15u);
            hi[i] |= gu_spread4((qh >> (16 + 4 * i)) & 15u);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const int8_t *row = a.qs + (size_t)t * in;
        const int4 A = *(const int4 *)(row + act_chunk<32, 0>(u));
        const int4 B = *(const int4 *)(row + act_chunk<32, 1>(u));
        int s = kvd_dp4a((int)lo[0], A.x, 0);
        s = kvd_dp4a((int)lo[1], A.y, s);
        s = kvd_dp4a((int)lo[2], A.z, s);
        s = kvd_dp4a((int)lo[3], A.w, s);
        s = kvd_dp4a((int)hi[0], B.x, s);
        s = kvd_dp4a((int)hi[1], B.y, s);
        s = kvd_dp4a((int)hi[2], B.z, s);
        s = kvd_dp4a((int)hi[3], B.w, s);
        const float4 m = a.m[(size_t)t * (in / 32) + u];
        const int sum = __float_as_int(m.z);
        if (WT == KVD_KW_Q4_0)
            acc[t] += dw * m.x * (float)(s - 8 * sum);
        else if (WT == KVD_KW_Q5_0)
            acc[t] += dw * m.x * (float)(s - 16 * sum);
        else
            acc[t] += dw * m.x * (float)s + mw * m.y;
    }
}

template <int WT> struct gu_legacy { // planes: qs 16, then qh 4 (Q5), then d 2 or dm 4
    static constexpr int KIND = GU_LEGACY, N = 32;
    static constexpr bool FIVE = WT == KVD_KW_Q5_0 || WT == KVD_KW_Q5_1;
    static constexpr bool ONE = WT == KVD_KW_Q4_1 || WT == KVD_KW_Q5_1;
    uint4 qs;
    uint32_t qh, dm;
    __device__ void load(const gw &m, int row, int u)
    {
        const size_t blk = (size_t)row * m.nbk + u;
        qs = __ldcs((const uint4 *)kvd_pl_entry<WT, 0>(m.base, m.rows, m.nbk, blk));
        qh = FIVE ? __ldcs((const uint32_t *)kvd_pl_entry<WT, 1>(m.base, m.rows, m.nbk, blk)) : 0u;
        const uint8_t *pd = kvd_pl_entry < WT, FIVE ? 2 : 1 > (m.base, m.rows, m.nbk, blk);
        dm = ONE ? __ldcs((const uint32_t *)pd) : (uint32_t)__ldcs((const uint16_t *)pd);
    }
    __device__ void zero()
    {
        qs = make_uint4(0, 0, 0, 0);
        qh = dm = 0;
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        gu_legacy_dot<WT, NT>(qs, qh, kvd_f16_to_f32((uint16_t)(dm & 0xffffu)),
                              ONE ? kvd_f16_to_f32((uint16_t)(dm >> 16)) : 0.0f, a, in, u, acc);
    }
};
template <> struct gunit<KVD_KW_Q4_0> : gu_legacy<KVD_KW_Q4_0> {
};
template <> struct gunit<KVD_KW_Q4_1> : gu_legacy<KVD_KW_Q4_1> {
};
template <> struct gunit<KVD_KW_Q5_0> : gu_legacy<KVD_KW_Q5_0> {
};
template <> struct gunit<KVD_KW_Q5_1> : gu_legacy<KVD_KW_Q5_1> {
};

// ---- K-quants: a quarter super-block ----------------------------------------------
// Byte i (run time, < 12) of the three words holding a super-block's packed
// scales, without indexing a register array.
static __device__ __forceinline__ int gu_sbyte(uint32_t w0, uint32_t w1, uint32_t w2, int i)
{
    uint32_t v = i < 4 ? w0 : i < 8 ? w1 : w2;
    return (int)((v >> (8 * (i & 3))) & 0xffu);
}

// 6-bit scale and min of sub-block s (run time) of a Q4_K/Q5_K super-block.
static __device__ __forceinline__ void gu_k4_scale_min(uint32_t w0, uint32_t w1, uint32_t w2, int s,
                                                       int *sc, int *mn)
{
    const int a = gu_sbyte(w0, w1, w2, s), b = gu_sbyte(w0, w1, w2, s + 4);
    if (s < 4) {
        *sc = a & 63;
        *mn = b & 63;
    } else {
        const int lo = gu_sbyte(w0, w1, w2, s - 4);
        *sc = (b & 15) | ((lo >> 6) << 4);
        *mn = (b >> 4) | ((a >> 6) << 4);
    }
}

// Q4_K / Q5_K: quarter p of a super-block is sub-blocks 2p (low nibbles of
// qs[32p ..+32]) and 2p+1 (high nibbles), with the fifth bits in qh (bits
// 2p and 2p+1 of the 32 qh bytes) for Q5_K. sumi = sc0 d0 + sc1 d1 and
// summ = mn0 sums32(2p) + mn1 sums32(2p+1), exact.
template <bool FIVE> struct gu_k45 {
    static constexpr int KIND = GU_K, N = 64, WT = FIVE ? KVD_KW_Q5_K : KVD_KW_Q4_K;
    uint4 h, q0, q1, qh0, qh1;
    __device__ void load(const gw &m, int row, int u)
    {
        const size_t blk = (size_t)row * m.nbk + u / 4;
        h = __ldcs((const uint4 *)kvd_pl_entry<WT, 0>(m.base, m.rows, m.nbk, blk));
        const uint4 *q =
            (const uint4 *)(kvd_pl_entry < WT,
                            FIVE ? 2 : 1 > (m.base, m.rows, m.nbk, blk) + 32 * (u % 4));
        q0 = __ldcs(q);
        q1 = __ldcs(q + 1);
        if (FIVE) {
            const uint4 *p = (const uint4 *)kvd_pl_entry<WT, 1>(m.base, m.rows, m.nbk, blk);
            qh0 = __ldcs(p);
            qh1 = __ldcs(p + 1);
        }
    }
    __device__ void zero()
    {
        h = q0 = q1 = qh0 = qh1 = make_uint4(0, 0, 0, 0);
    }
    __device__ float d() const
    {
        return kvd_f16_to_f32((uint16_t)(h.x & 0xffffu));
    }
    __device__ float dmin() const
    {
        return kvd_f16_to_f32((uint16_t)(h.x >> 16));
    }
    template <int NT> __device__ void idot(const actq &a, int in, int u, int *sumi, int *summ) const
    {
        const int p = u % 4, sb = u / 4, s0 = 2 * p, s1 = 2 * p + 1;
        int sc0, mn0, sc1, mn1;
        gu_k4_scale_min(h.y, h.z, h.w, s0, &sc0, &mn0);
        gu_k4_scale_min(h.y, h.z, h.w, s1, &sc1, &mn1);
        const uint32_t qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        uint32_t lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            lo[i] = qw[i] & 0x0F0F0F0Fu;
            hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        }
        if (FIVE) {
            const uint32_t hw[8] = {qh0.x, qh0.y, qh0.z, qh0.w, qh1.x, qh1.y, qh1.z, qh1.w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                lo[i] |= ((hw[i] >> s0) & 0x01010101u) << 4;
                hi[i] |= ((hw[i] >> s1) & 0x01010101u) << 4;
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int8_t *row = a.qs + (size_t)t * in;
            const int4 A0 = *(const int4 *)(row + act_chunk<64, 0>(u));
            const int4 A1 = *(const int4 *)(row + act_chunk<64, 1>(u));
            const int4 B0 = *(const int4 *)(row + act_chunk<64, 2>(u));
            const int4 B1 = *(const int4 *)(row + act_chunk<64, 3>(u));
            const int A[8] = {A0.x, A0.y, A0.z, A0.w, A1.x, A1.y, A1.z, A1.w};
            const int B[8] = {B0.x, B0.y, B0.z, B0.w, B1.x, B1.y, B1.z, B1.w};
            int d0 = 0, d1 = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                d0 = kvd_dp4a((int)lo[i], A[i], d0);
                d1 = kvd_dp4a((int)hi[i], B[i], d1);
            }
            const int4 bs = *(const int4 *)(a.bs + (size_t)t * (in / 16) + (size_t)sb * 16 + 4 * p);
            sumi[t] = sc0 * d0 + sc1 * d1;
            summ[t] = mn0 * (bs.x + bs.y) + mn1 * (bs.z + bs.w);
        }
    }
};
template <> struct gunit<KVD_KW_Q4_K> : gu_k45<false> {
};
template <> struct gunit<KVD_KW_Q5_K> : gu_k45<true> {
};

// Q6_K: quarter v (h = v / 2, l0 = 16 (v % 2)) is the values 128h + 32k +
// l0 + l (k, group of 16 with one int8 scale; l < 16): its 32 ql bytes (the
// low nibbles serve k = 0, 1, the high k = 2, 3), 16 qh bytes (2 bits per
// k), 4 scales and d. sumi = sum_k sc_k (dot_k - 32 sums16_k), exact (the
// -32 of every quant through the activations' sums).
template <> struct gunit<KVD_KW_Q6_K> {
    static constexpr int KIND = GU_K, N = 64, WT = KVD_KW_Q6_K;
    uint4 la, lb, qh;
    uint32_t sc, dh;
    __device__ void load(const gw &m, int row, int u)
    {
        const size_t blk = (size_t)row * m.nbk + u / 4;
        const int v = u % 4;
        const uint4 *l = (const uint4 *)(kvd_pl_entry<WT, 0>(m.base, m.rows, m.nbk, blk) + 32 * v);
        la = __ldcs(l);
        lb = __ldcs(l + 1);
        qh = __ldcs((const uint4 *)(kvd_pl_entry<WT, 1>(m.base, m.rows, m.nbk, blk) + 16 * v));
        sc = __ldcs((const uint32_t *)(kvd_pl_entry<WT, 2>(m.base, m.rows, m.nbk, blk) + 4 * v));
        dh = __ldcs((const uint16_t *)kvd_pl_entry<WT, 3>(m.base, m.rows, m.nbk, blk));
    }
    __device__ void zero()
    {
        la = lb = qh = make_uint4(0, 0, 0, 0);
        sc = dh = 0;
    }
    __device__ float d() const
    {
        return kvd_f16_to_f32((uint16_t)dh);
    }
    __device__ float dmin() const
    {
        return 0.0f;
    }
    template <int NT> __device__ void idot(const actq &a, int in, int u, int *sumi, int *summ) const
    {
        const int sb = u / 4, v = u % 4;
        const uint32_t lw[4] = {la.x, la.y, la.z, la.w}, hw[4] = {lb.x, lb.y, lb.z, lb.w};
        const uint32_t qw[4] = {qh.x, qh.y, qh.z, qh.w};
        uint32_t q[4][4];
        int scale[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            scale[k] = (int)(int8_t)((sc >> (8 * k)) & 0xffu);
#pragma unroll
            for (int i = 0; i < 4; i++)
                q[k][i] = ((((k & 1) ? hw[i] : lw[i]) >> (4 * (k >> 1))) & 0x0F0F0F0Fu) |
                          (((qw[i] >> (2 * k)) & 0x03030303u) << 4);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int8_t *row = a.qs + (size_t)t * in;
            const int4 bs = *(const int4 *)(a.bs + (size_t)t * (in / 16) + (size_t)sb * 16 + 4 * v);
            const int bsk[4] = {bs.x, bs.y, bs.z, bs.w};
            const int4 A[4] = {*(const int4 *)(row + act_chunk<64, 0>(u)),
                               *(const int4 *)(row + act_chunk<64, 1>(u)),
                               *(const int4 *)(row + act_chunk<64, 2>(u)),
                               *(const int4 *)(row + act_chunk<64, 3>(u))};
            int s = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int dk = kvd_dp4a((int)q[k][0], A[k].x, 0);
                dk = kvd_dp4a((int)q[k][1], A[k].y, dk);
                dk = kvd_dp4a((int)q[k][2], A[k].z, dk);
                dk = kvd_dp4a((int)q[k][3], A[k].w, dk);
                s += scale[k] * (dk - 32 * bsk[k]);
            }
            sumi[t] = s;
            summ[t] = 0;
        }
    }
};

#endif

// The decode GEMV (y = W x for 1..8 tokens) for the quantized weight types
// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (block layouts: quant.cuh), with
// llama.cpp's arithmetic, which the cpu backend (compute_cpu_quant.c) shares:
// the activations are quantized first (quantize_kernel: per 32 values int8
// with an f16 scale against the legacy types, per 256 values int8 with an
// f32 scale and the sums of each 16 against the K-quants), then each output
// is a sum over blocks of (weight scale x activation scale) x an exact
// integer dot product (dp4a, four int8 products per instruction). So the
// cuda backend's projections equal the cpu's up to the order of float
// additions, and a weight byte costs a fraction of an instruction.
//
// Like gemv.cu: one warp per output row streams the row once, each lane
// loading whole "units" (a block, or a quarter of a K-quant super-block) with
// the widest loads the block alignment allows, all of a lane's loads in
// flight before the first use; the unit's integer dots run against every
// token's quantized activations (read from L1/L2: they are small).
#include "quant.cuh"

#define GQ_WARPS 8 // warps (= output rows) per block

// The quantized activations of n_tokens rows of `in` values, in the act
// scratch: qs int8 [NT][in] at 0, then legacy: m32 [NT][in/32] of
// (d, s, sum as int bits, 0); K: d256 f32 [NT][in/256], then bs int32
// [NT][in/16] (the sums of each 16 qs).
struct actq {
    const int8_t *qs;
    const float4 *m32;
    const float *d256;
    const int *bs;
};

static __host__ __device__ size_t al256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

static __host__ __device__ bool is_kq(int wtype)
{
    return wtype == KVD_KW_Q4_K || wtype == KVD_KW_Q5_K || wtype == KVD_KW_Q6_K;
}

static __device__ __forceinline__ int warp_isum(int v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float f16_round(float v)
{
    return __half2float(__float2half_rn(v));
}

// One warp per block of 32: lane i quantizes value i (ggml's Q8_0/Q8_1 rows:
// d = max|x| / 127, q = round-half-even(x * 127 / max|x|), the f16 of d and
// of d * sum(q)). x is [NT][in] with in % 32 == 0, so the blocks of all
// rows are one flat sequence.
__global__ void quant32_kernel(const float *__restrict__ x, int8_t *__restrict__ qs,
                               float4 *__restrict__ m, int n_blocks)
{
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * GQ_WARPS + (threadIdx.x >> 5);
    if (g >= n_blocks)
        return; // whole warp
    const float v = x[(size_t)g * 32 + lane];
    const float amax = kvd_warp_max(fabsf(v));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int q = (int)rintf(v * id);
    q = q > 127 ? 127 : q < -127 ? -127 : q;
    qs[(size_t)g * 32 + lane] = (int8_t)q;
    const int sum = warp_isum(q);
    if (lane == 0)
        m[g] = make_float4(f16_round(d), f16_round(d * (float)sum), __int_as_float(sum), 0.0f);
}

// One warp per super-block of 256: lane i quantizes values 8i..8i+7
// (ggml's Q8_K: the value of largest magnitude mx, the first one on ties,
// iscale = -127 / mx, q = min(127, round-half-even(iscale * x)), d =
// 1 / iscale, and the sums of each 16 q; all zero for a zero block).
__global__ void quant256_kernel(const float *__restrict__ x, int8_t *__restrict__ qs,
                                float *__restrict__ d, int *__restrict__ bs, int n_sb)
{
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * GQ_WARPS + (threadIdx.x >> 5);
    if (g >= n_sb)
        return; // whole warp
    const float4 *xv = (const float4 *)(x + (size_t)g * 256 + 8 * lane);
    const float4 v0 = xv[0], v1 = xv[1];
    const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    float amax = 0.0f, mx = 0.0f;
    int idx = 0;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (fabsf(v[i]) > amax)
            amax = fabsf(v[i]), mx = v[i], idx = 8 * lane + i;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(0xffffffffu, amax, o);
        float om = __shfl_xor_sync(0xffffffffu, mx, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (oa > amax || (oa == amax && oi < idx))
            amax = oa, mx = om, idx = oi;
    }
    int8_t q[8];
    int sum = 0;
    const float iscale = amax != 0.0f ? -127.0f / mx : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int r = amax != 0.0f ? (int)rintf(iscale * v[i]) : 0;
        r = r > 127 ? 127 : r;
        q[i] = (int8_t)r;
        sum += r;
    }
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo |= (uint32_t)(uint8_t)q[i] << (8 * i);
        hi |= (uint32_t)(uint8_t)q[4 + i] << (8 * i);
    }
    uint2 packed;
    packed.x = lo;
    packed.y = hi;
    *(uint2 *)(qs + (size_t)g * 256 + 8 * lane) = packed;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0)
        bs[(size_t)g * 16 + lane / 2] = sum;
    if (lane == 0)
        d[g] = amax != 0.0f ? 1.0f / iscale : 0.0f;
}

// 4 bits (bit i of t) -> bit 4 of byte i.
static __device__ __forceinline__ uint32_t spread4(uint32_t t)
{
    return ((t & 1u) << 4) | ((t & 2u) << 11) | ((t & 4u) << 18) | ((t & 8u) << 25);
}

// The 8 words (32 int8) of activations at p (16-byte aligned).
static __device__ __forceinline__ void load_a8(const int8_t *p, int *A)
{
    const int4 *v = (const int4 *)p;
    int4 a = v[0], b = v[1];
    A[0] = a.x, A[1] = a.y, A[2] = a.z, A[3] = a.w;
    A[4] = b.x, A[5] = b.y, A[6] = b.z, A[7] = b.w;
}

// A unit: N values of a row; load(row, u) fetches unit u's weight bytes,
// dot<NT> adds its products with every token's quantized activations.
template <int WT> struct qunit;

// The legacy types: a unit is one block. Integer dot of the 32 quants
// (nibbles, with the fifth bit for Q5) against the block's activations;
// q: the 4 words of qs, h: qh (Q5) or 0.
template <int WT, int NT>
static __device__ __forceinline__ void legacy_dot(const uint32_t *qw, uint32_t qh, float dw,
                                                  float mw, const actq &a, int in, int u,
                                                  float *acc)
{
    const bool five = WT == KVD_KW_Q5_0 || WT == KVD_KW_Q5_1;
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo[i] = qw[i] & 0x0F0F0F0Fu;
        hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        if (five) {
            lo[i] |= spread4((qh >> (4 * i)) & 15u);
            hi[i] |= spread4((qh >> (16 + 4 * i)) & 15u);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        int A[8];
        load_a8(a.qs + (size_t)t * in + (size_t)u * 32, A);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s = kvd_dp4a((int)lo[i], A[i], s);
            s = kvd_dp4a((int)hi[i], A[4 + i], s);
        }
        const float4 m = a.m32[(size_t)t * (in / 32) + u];
        const int sum = __float_as_int(m.z);
        if (WT == KVD_KW_Q4_0)
            acc[t] += dw * m.x * (float)(s - 8 * sum);
        else if (WT == KVD_KW_Q5_0)
            acc[t] += dw * m.x * (float)(s - 16 * sum);
        else
            acc[t] += dw * m.x * (float)s + mw * m.y;
    }
}

template <> struct qunit<KVD_KW_Q4_0> { // 18 bytes, 2-byte aligned
    static constexpr int N = 32, UNROLL = 4;
    uint32_t r[9];
    __device__ void load(const char *row, int u)
    {
        const uint16_t *p = (const uint16_t *)(row + (size_t)u * 18);
#pragma unroll
        for (int k = 0; k < 9; k++)
            r[k] = __ldcs(p + k);
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        uint32_t qw[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            qw[i] = r[1 + 2 * i] | (r[2 + 2 * i] << 16);
        legacy_dot<KVD_KW_Q4_0, NT>(qw, 0u, kvd_f16_to_f32((uint16_t)r[0]), 0.0f, a, in, u, acc);
    }
};

template <> struct qunit<KVD_KW_Q4_1> { // 20 bytes, 4-byte aligned
    static constexpr int N = 32, UNROLL = 4;
    uint32_t r[5];
    __device__ void load(const char *row, int u)
    {
        const uint32_t *p = (const uint32_t *)(row + (size_t)u * 20);
#pragma unroll
        for (int k = 0; k < 5; k++)
            r[k] = __ldcs(p + k);
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        legacy_dot<KVD_KW_Q4_1, NT>(r + 1, 0u, kvd_f16_to_f32((uint16_t)(r[0] & 0xffffu)),
                                    kvd_f16_to_f32((uint16_t)(r[0] >> 16)), a, in, u, acc);
    }
};

template <> struct qunit<KVD_KW_Q5_0> { // 22 bytes, 2-byte aligned
    static constexpr int N = 32, UNROLL = 4;
    uint32_t r[11];
    __device__ void load(const char *row, int u)
    {
        const uint16_t *p = (const uint16_t *)(row + (size_t)u * 22);
#pragma unroll
        for (int k = 0; k < 11; k++)
            r[k] = __ldcs(p + k);
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        uint32_t qw[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            qw[i] = r[3 + 2 * i] | (r[4 + 2 * i] << 16);
        legacy_dot<KVD_KW_Q5_0, NT>(qw, r[1] | (r[2] << 16), kvd_f16_to_f32((uint16_t)r[0]), 0.0f,
                                    a, in, u, acc);
    }
};

template <> struct qunit<KVD_KW_Q5_1> { // 24 bytes, 8-byte aligned
    static constexpr int N = 32, UNROLL = 4;
    uint32_t r[6];
    __device__ void load(const char *row, int u)
    {
        const uint2 *p = (const uint2 *)(row + (size_t)u * 24);
#pragma unroll
        for (int k = 0; k < 3; k++) {
            uint2 v = __ldcs(p + k);
            r[2 * k] = v.x;
            r[2 * k + 1] = v.y;
        }
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        legacy_dot<KVD_KW_Q5_1, NT>(r + 2, r[1], kvd_f16_to_f32((uint16_t)(r[0] & 0xffffu)),
                                    kvd_f16_to_f32((uint16_t)(r[0] >> 16)), a, in, u, acc);
    }
};

// Byte i (runtime, < 12) of the three words holding a K super-block's
// scales, without indexing a register array.
static __device__ __forceinline__ int sbyte(uint32_t w0, uint32_t w1, uint32_t w2, int i)
{
    uint32_t v = i < 4 ? w0 : i < 8 ? w1 : w2;
    return (int)((v >> (8 * (i & 3))) & 0xffu);
}

// 6-bit scale and min of sub-block s (runtime) of a Q4_K/Q5_K super-block.
static __device__ __forceinline__ void k4_scale_min(uint32_t w0, uint32_t w1, uint32_t w2, int s,
                                                    int *sc, int *mn)
{
    const int a = sbyte(w0, w1, w2, s), b = sbyte(w0, w1, w2, s + 4);
    if (s < 4) {
        *sc = a & 63;
        *mn = b & 63;
    } else {
        const int lo = sbyte(w0, w1, w2, s - 4);
        *sc = (b & 15) | ((lo >> 6) << 4);
        *mn = (b >> 4) | ((a >> 6) << 4);
    }
}

// Q4_K / Q5_K: a unit is the 64 values of sub-blocks 2p and 2p+1 of a
// super-block (p = u % 4): the super-block's 16-byte head (d, dmin,
// scales), the 32 bytes of qs they share (low and high nibbles), and for
// Q5_K the 32 bytes of qh (bits 2p and 2p+1). Super-blocks are 16-byte
// multiples, so every load is a 16-byte one.
template <bool FIVE> struct kunit {
    static constexpr int N = 64, UNROLL = 2, BYTES = FIVE ? 176 : 144;
    uint4 h, q[2], qh[2];
    __device__ void load(const char *row, int u)
    {
        const uint4 *b = (const uint4 *)(row + (size_t)(u / 4) * BYTES);
        const int p = u % 4, qs = FIVE ? 3 : 1;
        h = __ldcs(b);
        q[0] = __ldcs(b + qs + 2 * p);
        q[1] = __ldcs(b + qs + 2 * p + 1);
        if (FIVE) {
            qh[0] = __ldcs(b + 1);
            qh[1] = __ldcs(b + 2);
        }
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        const int p = u % 4, sb = u / 4, s0 = 2 * p, s1 = 2 * p + 1;
        const float d = kvd_f16_to_f32((uint16_t)(h.x & 0xffffu));
        const float dmin = kvd_f16_to_f32((uint16_t)(h.x >> 16));
        int sc0, mn0, sc1, mn1;
        k4_scale_min(h.y, h.z, h.w, s0, &sc0, &mn0);
        k4_scale_min(h.y, h.z, h.w, s1, &sc1, &mn1);
        const uint32_t qw[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
        uint32_t lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            lo[i] = qw[i] & 0x0F0F0F0Fu;
            hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        }
        if (FIVE) {
            const uint32_t hw[8] = {qh[0].x, qh[0].y, qh[0].z, qh[0].w,
                                    qh[1].x, qh[1].y, qh[1].z, qh[1].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                lo[i] |= ((hw[i] >> s0) & 0x01010101u) << 4;
                hi[i] |= ((hw[i] >> s1) & 0x01010101u) << 4;
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int8_t *aq = a.qs + (size_t)t * in + (size_t)sb * 256 + 64 * p;
            int A[8], B[8];
            load_a8(aq, A);
            load_a8(aq + 32, B);
            int d0 = 0, d1 = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                d0 = kvd_dp4a((int)lo[i], A[i], d0);
                d1 = kvd_dp4a((int)hi[i], B[i], d1);
            }
            const int4 bsv =
                *(const int4 *)(a.bs + (size_t)t * (in / 16) + (size_t)sb * 16 + 4 * p);
            const int sumi = sc0 * d0 + sc1 * d1;
            const int summ = mn0 * (bsv.x + bsv.y) + mn1 * (bsv.z + bsv.w);
            const float ad = a.d256[(size_t)t * (in / 256) + sb];
            acc[t] += d * ad * (float)sumi - dmin * ad * (float)summ;
        }
    }
};
template <> struct qunit<KVD_KW_Q4_K> : kunit<false> {
};
template <> struct qunit<KVD_KW_Q5_K> : kunit<true> {
};

// Q6_K: super-blocks of 210 bytes are only 2-byte aligned. A unit (v = u % 4,
// half hf = v / 2, l0 = 16 * (v % 2)) is the 64 values 128hf + 32k + l0 + l
// (k < 4, l < 16), four groups of 16 with one int8 scale each:
// ql[64hf + l0 ..+16] and ql[64hf + 32 + l0 ..+16] (the low nibbles serve
// k = 0, 1, the high k = 2, 3), qh[32hf + l0 ..+16] (2 bits per k), the
// four scales 8hf + 2k + l0/16 and d: 29 half-word loads. The -32 of every
// quant is applied through the activations' sums of 16.
template <> struct qunit<KVD_KW_Q6_K> {
    static constexpr int N = 64, UNROLL = 2;
    uint32_t la[4], lb[4], qh[4], sc[4], dh;
    __device__ void load(const char *row, int u)
    {
        const uint16_t *p = (const uint16_t *)(row + (size_t)(u / 4) * 210);
        const int v = u % 4, hf = v / 2, l0 = 16 * (v % 2);
        const uint16_t *pa = p + 32 * hf + l0 / 2, *pb = pa + 16, *ph = p + 64 + 16 * hf + l0 / 2;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            la[i] = (uint32_t)__ldcs(pa + 2 * i) | ((uint32_t)__ldcs(pa + 2 * i + 1) << 16);
            lb[i] = (uint32_t)__ldcs(pb + 2 * i) | ((uint32_t)__ldcs(pb + 2 * i + 1) << 16);
            qh[i] = (uint32_t)__ldcs(ph + 2 * i) | ((uint32_t)__ldcs(ph + 2 * i + 1) << 16);
            sc[i] = __ldcs(p + 96 + 4 * hf + i);
        }
        dh = __ldcs(p + 104);
    }
    template <int NT> __device__ void dot(const actq &a, int in, int u, float *acc) const
    {
        const int v = u % 4, hf = v / 2, l0 = 16 * (v % 2), sb = u / 4;
        const float d = kvd_f16_to_f32((uint16_t)dh);
        uint32_t q[4][4];
        int scale[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            scale[k] = (int)(int8_t)((sc[k] >> (l0 / 2)) & 0xffu);
#pragma unroll
            for (int i = 0; i < 4; i++)
                q[k][i] = ((((k & 1) ? lb[i] : la[i]) >> (4 * (k >> 1))) & 0x0F0F0F0Fu) |
                          (((qh[i] >> (2 * k)) & 0x03030303u) << 4);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int8_t *aq = a.qs + (size_t)t * in + (size_t)sb * 256 + 128 * hf + l0;
            const int *bst = a.bs + (size_t)t * (in / 16) + (size_t)sb * 16 + 8 * hf + l0 / 16;
            int sumi = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int4 A = *(const int4 *)(aq + 32 * k);
                int s = kvd_dp4a((int)q[k][0], A.x, 0);
                s = kvd_dp4a((int)q[k][1], A.y, s);
                s = kvd_dp4a((int)q[k][2], A.z, s);
                s = kvd_dp4a((int)q[k][3], A.w, s);
                sumi += scale[k] * (s - 32 * bst[2 * k]);
            }
            acc[t] += d * a.d256[(size_t)t * (in / 256) + sb] * (float)sumi;
        }
    }
};

// y [NT][out], w [out][in] of type WT, activations quantized in a.
template <int WT, int NT>
__global__ void __launch_bounds__(GQ_WARPS * 32)
    gemvq_kernel(float *__restrict__ y, const char *__restrict__ w, const actq a, int out, int in)
{
    using U = qunit<WT>;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GQ_WARPS + (threadIdx.x >> 5);
    if (row >= out)
        return; // whole warp: no shuffles are skipped by part of it
    const char *wr = w + (size_t)row * kvd_row_bytes(WT, in);
    const int n_units = in / U::N;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++)
        acc[t] = 0.0f;
    for (int u0 = lane; u0 < n_units; u0 += 32 * U::UNROLL) {
        U wu[U::UNROLL];
#pragma unroll
        for (int k = 0; k < U::UNROLL; k++)
            if (u0 + k * 32 < n_units)
                wu[k].load(wr, u0 + k * 32);
#pragma unroll
        for (int k = 0; k < U::UNROLL; k++) {
            const int u = u0 + k * 32;
            if (u >= n_units)
                break;
            wu[k].template dot<NT>(a, in, u, acc);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = kvd_warp_sum(acc[t]);
        if (lane == 0)
            y[(size_t)t * out + row] = s;
    }
}

template <int WT, int NT>
static int gemvq_launch(float *y, const void *w, const actq &a, int out, int in,
                        cudaStream_t stream)
{
    unsigned blocks = (unsigned)((out + GQ_WARPS - 1) / GQ_WARPS);
    KVD_LAUNCH(blocks, GQ_WARPS * 32, 0, stream, gemvq_kernel<WT, NT>)
    (y, (const char *)w, a, out, in);
    return kvd_launch_status();
}

template <int WT>
static int gemvq_by_tokens(float *y, const void *w, const actq &a, int n_tokens, int out, int in,
                           cudaStream_t stream)
{
    switch (n_tokens) {
    case 1:
        return gemvq_launch<WT, 1>(y, w, a, out, in, stream);
    case 2:
        return gemvq_launch<WT, 2>(y, w, a, out, in, stream);
    case 3:
        return gemvq_launch<WT, 3>(y, w, a, out, in, stream);
    case 4:
        return gemvq_launch<WT, 4>(y, w, a, out, in, stream);
    case 5:
        return gemvq_launch<WT, 5>(y, w, a, out, in, stream);
    case 6:
        return gemvq_launch<WT, 6>(y, w, a, out, in, stream);
    case 7:
        return gemvq_launch<WT, 7>(y, w, a, out, in, stream);
    default:
        return gemvq_launch<WT, 8>(y, w, a, out, in, stream);
    }
}

extern "C" size_t kvd_k_gemvq_act_bytes(int wtype, int n_tokens, int in)
{
    if (!kvd_wt_is_q(wtype) || n_tokens <= 0 || in <= 0)
        return 0;
    const size_t n = (size_t)n_tokens * in;
    if (is_kq(wtype))
        return al256(n) + al256(n / 256 * 4) + n / 16 * 4;
    return al256(n) + n / 32 * 16;
}

extern "C" int kvd_k_gemvq_ok(const void *w, int wtype, const float *x, int n_tokens, int in)
{
    uintptr_t a = (uintptr_t)w;
    if (!kvd_wt_is_q(wtype) || n_tokens < 1 || n_tokens > KVD_K_GEMV_MAX_TOKENS || in <= 0 ||
        in % kvd_wt_qk(wtype) || ((uintptr_t)x & 15))
        return 0;
    switch (wtype) {
    case KVD_KW_Q4_K:
    case KVD_KW_Q5_K:
        return (a & 15) == 0;
    case KVD_KW_Q5_1:
        return (a & 7) == 0;
    case KVD_KW_Q4_1:
        return (a & 3) == 0;
    default:
        return (a & 1) == 0;
    }
}

extern "C" int kvd_k_gemvq(float *y, const void *w, int wtype, const float *x, void *act,
                           int n_tokens, int out, int in, kvd_stream stream)
{
    if (out < 0 || !kvd_k_gemvq_ok(w, wtype, x, n_tokens, in) || ((uintptr_t)act & 255))
        return (int)cudaErrorInvalidValue;
    if (out == 0)
        return 0;
    const size_t n = (size_t)n_tokens * in;
    int8_t *qs = (int8_t *)act;
    actq a = {qs, NULL, NULL, NULL};
    if (is_kq(wtype)) {
        float *d = (float *)((char *)act + al256(n));
        int *bs = (int *)((char *)d + al256(n / 256 * 4));
        const int nsb = (int)(n / 256);
        KVD_LAUNCH((unsigned)((nsb + GQ_WARPS - 1) / GQ_WARPS), GQ_WARPS * 32, 0, stream,
                   quant256_kernel)
        (x, qs, d, bs, nsb);
        a.d256 = d;
        a.bs = bs;
    } else {
        float4 *m = (float4 *)((char *)act + al256(n));
        const int nb = (int)(n / 32);
        KVD_LAUNCH((unsigned)((nb + GQ_WARPS - 1) / GQ_WARPS), GQ_WARPS * 32, 0, stream,
                   quant32_kernel)
        (x, qs, m, nb);
        a.m32 = m;
    }
    int rc = kvd_launch_status();
    if (rc)
        return rc;
    switch (wtype) {
    case KVD_KW_Q4_0:
        return gemvq_by_tokens<KVD_KW_Q4_0>(y, w, a, n_tokens, out, in, stream);
    case KVD_KW_Q4_1:
        return gemvq_by_tokens<KVD_KW_Q4_1>(y, w, a, n_tokens, out, in, stream);
    case KVD_KW_Q5_0:
        return gemvq_by_tokens<KVD_KW_Q5_0>(y, w, a, n_tokens, out, in, stream);
    case KVD_KW_Q5_1:
        return gemvq_by_tokens<KVD_KW_Q5_1>(y, w, a, n_tokens, out, in, stream);
    case KVD_KW_Q4_K:
        return gemvq_by_tokens<KVD_KW_Q4_K>(y, w, a, n_tokens, out, in, stream);
    case KVD_KW_Q5_K:
        return gemvq_by_tokens<KVD_KW_Q5_K>(y, w, a, n_tokens, out, in, stream);
    default:
        return gemvq_by_tokens<KVD_KW_Q6_K>(y, w, a, n_tokens, out, in, stream);
    }
}

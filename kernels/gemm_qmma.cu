// The projections of more than 8 tokens (batched decode, prefill chunks) of
// the K-quants (Q4_K, Q5_K, Q6_K planes, planes.cuh) on the tensor cores'
// int8 path: the activations are quantized once per call to Q8_K
// (act_quant.cuh, the cpu backend's arithmetic), every sub-block's integer
// dot product of weight quants and activation quants is one mma.sync s8
// (m16n8k32 for Q4_K/Q5_K's sub-blocks of 32, m16n8k16 for Q6_K's of 16:
// exact s32), the sub-block scales and mins are applied in integers, and
// the float part runs per super-block in the fused GEMV's order
// (gemv_fused.cu: fmaf(sumi, d_w * d_a, acc), fmaf(summ, dmin_w * d_a,
// accm), super-block by super-block; out = acc - accm, Q6_K acc). So an
// output is the GEMV's bits for the same row whatever the batch (and the
// cpu backend's for Q4_K), with the weights read once per 32 tokens
// instead of once per 8, and no dequantized bf16 tile.
//
// A block is 4 warps over 64 weight rows (a warp 16: the mma's M) and
// 8 * NTI tokens (NTI n-tiles of 8: the mma's N). Within a sub-block the
// mma's k order is a permutation of the values, the same for A and B:
// lane (g, t) holds values 8t .. 8t+7 of a 32-value sub-block (k 4t .. 4t+3
// and 16+4t .. 16+4t+3), so its weight bytes are one 8-byte load per row
// and its activations one 8-byte load per token; for Q6_K's 16 values,
// values 4t .. 4t+3 (k 4t .. 4t+3).
#include "act_quant.cuh"
#include "mma.cuh"
#include "planes.cuh"

#define QM_WARPS 4
#define QM_ROWS (QM_WARPS * 16) // weight rows per block

// Entry of block blk in plane F (kvd_pl_entry with the offsets forced to
// compile-time constants: a table lookup would read host memory in the
// emulation build).
template <int WT, int F>
static __device__ __forceinline__ const uint8_t *qm_pl(const uint8_t *base, int rows, int nbk,
                                                       size_t blk)
{
    constexpr size_t before = kvd_pl_before(WT, F), size = kvd_pl_size(WT, F);
    return base + (size_t)rows * nbk * before + blk * size;
}

static __device__ __forceinline__ int qm_min(int a, int b)
{
    return a < b ? a : b;
}

struct qm_params {
    const uint8_t *w;
    float *y;
    const int8_t *qs; // the quantized activations (act_quant.cuh layout)
    const float *d;
    const int *bs;
    int rows, in, n;
};

// The low (HI: high) nibbles of the four bytes of w.
template <bool HI> static __device__ __forceinline__ uint32_t qm_nib(uint32_t w)
{
    return (HI ? w >> 4 : w) & 0x0F0F0F0Fu;
}

// Byte i (run time, < 12) of the three words of a super-block's packed
// scales and its 6-bit scale and min of sub-block s (as gemv_units.cuh).
static __device__ __forceinline__ int qm_sbyte(uint32_t w0, uint32_t w1, uint32_t w2, int i)
{
    const uint32_t v = i < 4 ? w0 : i < 8 ? w1 : w2;
    return (int)((v >> (8 * (i & 3))) & 0xffu);
}
static __device__ __forceinline__ void qm_scale_min(const uint4 &h, int s, int *sc, int *mn)
{
    const int a = qm_sbyte(h.y, h.z, h.w, s), b = qm_sbyte(h.y, h.z, h.w, s + 4);
    if (s < 4) {
        *sc = a & 63;
        *mn = b & 63;
    } else {
        const int lo = qm_sbyte(h.y, h.z, h.w, s - 4);
        *sc = (b & 15) | ((lo >> 6) << 4);
        *mn = (b >> 4) | ((a >> 6) << 4);
    }
}

// Q4_K / Q5_K: per super-block, sub-block j (values 32j ..) is the low
// (even j) or high (odd j) nibbles of qs[32 (j / 2) ..+32], the fifth bit
// (Q5_K) bit j of qh[0 ..32]. sumi = sum_j sc_j (q . a)_j, summ = sum_j mn_j
// (sums of 32 of a)_j, both exact.
template <bool FIVE, int NTI>
static __device__ __forceinline__ void qm_k45(const qm_params &p, int sb, const int *row,
                                              const int *tok, const int *otok, float (*acc)[4],
                                              float (*accm)[4])
{
    constexpr int WT = FIVE ? KVD_KW_Q5_K : KVD_KW_Q4_K;
    const int lane = kvd_lane_id(), t = lane & 3;
    const int nbk = p.in / 256, nsb = p.in / 256;
    uint4 h[2];
    uint2 qh[2] = {make_uint2(0, 0), make_uint2(0, 0)};
    const uint8_t *qs[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const size_t blk = (size_t)row[r] * nbk + sb;
        h[r] = __ldg((const uint4 *)qm_pl<WT, 0>(p.w, p.rows, nbk, blk));
        qs[r] = qm_pl < WT, FIVE ? 2 : 1 > (p.w, p.rows, nbk, blk);
        if (FIVE)
            qh[r] = __ldg((const uint2 *)(qm_pl<WT, 1>(p.w, p.rows, nbk, blk) + 8 * t));
    }
    int sumi[NTI][4], summ[NTI][4];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            sumi[nt][i] = summ[nt][i] = 0;
    const uint4 z4 = kvd_zero_u4(); // not a constant array (the emulation build's memcheck)
    const int zero[4] = {(int)z4.x, (int)z4.y, (int)z4.z, (int)z4.w};
#pragma unroll
    for (int q = 0; q < 4; q++) { // quarter q: sub-blocks 2q (low nibbles), 2q + 1 (high)
        uint2 w[2];
        int sc[2][2], mn[2][2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            w[r] = __ldg((const uint2 *)(qs[r] + 32 * q + 8 * t));
            qm_scale_min(h[r], 2 * q, &sc[r][0], &mn[r][0]);
            qm_scale_min(h[r], 2 * q + 1, &sc[r][1], &mn[r][1]);
        }
        uint32_t alo[4] = {qm_nib<false>(w[0].x), qm_nib<false>(w[1].x), qm_nib<false>(w[0].y),
                           qm_nib<false>(w[1].y)};
        uint32_t ahi[4] = {qm_nib<true>(w[0].x), qm_nib<true>(w[1].x), qm_nib<true>(w[0].y),
                           qm_nib<true>(w[1].y)};
        if (FIVE) {
            const uint32_t hw[4] = {qh[0].x, qh[1].x, qh[0].y, qh[1].y};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                alo[i] |= ((hw[i] >> (2 * q)) & 0x01010101u) << 4;
                ahi[i] |= ((hw[i] >> (2 * q + 1)) & 0x01010101u) << 4;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NTI; nt++) {
            const int8_t *x = p.qs + (size_t)tok[nt] * p.in;
            const uint2 blo = *(const uint2 *)(x + act_pos<64>(256 * sb + 64 * q + 8 * t));
            const uint2 bhi = *(const uint2 *)(x + act_pos<64>(256 * sb + 64 * q + 32 + 8 * t));
            const uint32_t bl[2] = {blo.x, blo.y}, bh[2] = {bhi.x, bhi.y};
            int dl[4], dh[4];
            kvd_mma_s8<32>(dl, alo, bl, zero);
            kvd_mma_s8<32>(dh, ahi, bh, zero);
#pragma unroll
            for (int i = 0; i < 4; i++)
                sumi[nt][i] += sc[i >> 1][0] * dl[i] + sc[i >> 1][1] * dh[i];
        }
#pragma unroll
        for (int nt = 0; nt < NTI; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int4 b = *(const int4 *)(p.bs + (size_t)otok[2 * nt + (i & 1)] * (p.in / 16) +
                                               16 * sb + 4 * q);
                summ[nt][i] += mn[i >> 1][0] * (b.x + b.y) + mn[i >> 1][1] * (b.z + b.w);
            }
    }
    float dw[2], dmw[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        dw[r] = kvd_f16_to_f32((uint16_t)(h[r].x & 0xffffu));
        dmw[r] = kvd_f16_to_f32((uint16_t)(h[r].x >> 16));
    }
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float da = p.d[(size_t)otok[2 * nt + (i & 1)] * nsb + sb];
            acc[nt][i] = fmaf((float)sumi[nt][i], __fmul_rn(dw[i >> 1], da), acc[nt][i]);
            accm[nt][i] = fmaf((float)summ[nt][i], __fmul_rn(dmw[i >> 1], da), accm[nt][i]);
        }
}

// Q6_K: quarter v of a super-block (planes.cuh) holds the groups k < 4 of
// 16 values 128h + 32k + l0 + l (h = v / 2, l0 = 16 (v % 2)), each with an
// int8 scale; lane t takes l = 4t .. 4t+3 of each. sumi = sum over the 16
// groups of sc ((q . a) - 32 (sum of a)), exact.
template <int NTI>
static __device__ __forceinline__ void qm_k6(const qm_params &p, int sb, const int *row,
                                             const int *tok, const int *otok, float (*acc)[4])
{
    constexpr int WT = KVD_KW_Q6_K;
    const int lane = kvd_lane_id(), t = lane & 3;
    const int nbk = p.in / 256, nsb = p.in / 256;
    size_t blk[2];
#pragma unroll
    for (int r = 0; r < 2; r++)
        blk[r] = (size_t)row[r] * nbk + sb;
    int sumi[NTI][4];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            sumi[nt][i] = 0;
    const uint4 z4 = kvd_zero_u4(); // not a constant array (the emulation build's memcheck)
    const int zero[4] = {(int)z4.x, (int)z4.y, (int)z4.z, (int)z4.w};
#pragma unroll
    for (int v = 0; v < 4; v++) {
        uint32_t la[2], lb[2], qh[2], scw[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint8_t *ql = qm_pl<WT, 0>(p.w, p.rows, nbk, blk[r]) + 32 * v;
            la[r] = __ldg((const uint32_t *)(ql + 4 * t));
            lb[r] = __ldg((const uint32_t *)(ql + 16 + 4 * t));
            qh[r] =
                __ldg((const uint32_t *)(qm_pl<WT, 1>(p.w, p.rows, nbk, blk[r]) + 16 * v + 4 * t));
            scw[r] = __ldg((const uint32_t *)(qm_pl<WT, 2>(p.w, p.rows, nbk, blk[r]) + 4 * v));
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t a[2];
            int sc[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                a[r] = qm_nib<false>(((k & 1) ? lb[r] : la[r]) >> (4 * (k >> 1))) |
                       (((qh[r] >> (2 * k)) & 0x03030303u) << 4);
                sc[r] = (int)(int8_t)((scw[r] >> (8 * k)) & 0xffu);
            }
#pragma unroll
            for (int nt = 0; nt < NTI; nt++) {
                const int8_t *x = p.qs + (size_t)tok[nt] * p.in;
                const uint32_t b =
                    *(const uint32_t *)(x + act_pos<64>(256 * sb + 64 * v + 16 * k + 4 * t));
                int dd[4];
                kvd_mma_s8<16>(dd, a, &b, zero);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int s =
                        p.bs[(size_t)otok[2 * nt + (i & 1)] * (p.in / 16) + 16 * sb + 4 * v + k];
                    sumi[nt][i] += sc[i >> 1] * (dd[i] - 32 * s);
                }
            }
        }
    }
    float dw[2];
#pragma unroll
    for (int r = 0; r < 2; r++)
        dw[r] = kvd_f16_to_f32(__ldg((const uint16_t *)qm_pl<WT, 3>(p.w, p.rows, nbk, blk[r])));
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float da = p.d[(size_t)otok[2 * nt + (i & 1)] * nsb + sb];
            acc[nt][i] = fmaf((float)sumi[nt][i], __fmul_rn(dw[i >> 1], da), acc[nt][i]);
        }
}

// grid (row blocks of QM_ROWS, token blocks of 8 NTI).
template <int WT, int NTI> __global__ void __launch_bounds__(QM_WARPS * 32) qmma_kernel(qm_params p)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * QM_ROWS + warp * 16, n0 = blockIdx.y * 8 * NTI;
    // The rows this lane loads (A: g, g + 8) and the tokens (B: column g of
    // each n-tile; C: columns 2t, 2t + 1), clamped in bounds: a padding
    // row or token computes a value nobody stores.
    const int row[2] = {qm_min(r0 + g, p.rows - 1), qm_min(r0 + g + 8, p.rows - 1)};
    int tok[NTI], otok[2 * NTI];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++) {
        tok[nt] = qm_min(n0 + 8 * nt + g, p.n - 1);
        otok[2 * nt] = qm_min(n0 + 8 * nt + 2 * t, p.n - 1);
        otok[2 * nt + 1] = qm_min(n0 + 8 * nt + 2 * t + 1, p.n - 1);
    }
    float acc[NTI][4], accm[NTI][4];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc[nt][i] = accm[nt][i] = 0.0f;
    for (int sb = 0; sb < p.in / 256; sb++) {
        if constexpr (WT == KVD_KW_Q6_K)
            qm_k6<NTI>(p, sb, row, tok, otok, acc);
        else
            qm_k45<WT == KVD_KW_Q5_K, NTI>(p, sb, row, tok, otok, acc, accm);
    }
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + g + 8 * (i >> 1), k = n0 + 8 * nt + 2 * t + (i & 1);
            if (r < p.rows && k < p.n)
                p.y[(size_t)k * p.rows + r] =
                    WT == KVD_KW_Q6_K ? acc[nt][i] : acc[nt][i] - accm[nt][i];
        }
}

// x [n][in] to Q8_K into the act_quant.cuh layout (Q6: Q6_K's chunk order),
// a warp per super-block.
template <bool Q6>
__global__ void qmma_act_kernel(const float *__restrict__ x, int8_t *qs, float *d, int *bs, int n,
                                int in)
{
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (g >= n * (in / 256))
        return; // whole warp
    act_quant256<Q6>(x, in, g, lane, qs, d, bs);
}

template <int WT> static int qm_launch(const qm_params &p, int ntok, cudaStream_t st)
{
    const unsigned gx = (unsigned)((p.rows + QM_ROWS - 1) / QM_ROWS);
    if (ntok <= 16) {
        KVD_LAUNCH(dim3(gx, (unsigned)((ntok + 15) / 16)), QM_WARPS * 32, 0, st, qmma_kernel<WT, 2>)
        (p);
    } else {
        KVD_LAUNCH(dim3(gx, (unsigned)((ntok + 31) / 32)), QM_WARPS * 32, 0, st, qmma_kernel<WT, 4>)
        (p);
    }
    return kvd_launch_status();
}

extern "C" int kvd_k_qmma_ok(int wtype, const void *w, const float *x, int n_tokens, int in)
{
    return (wtype == KVD_KW_Q4_K || wtype == KVD_KW_Q5_K || wtype == KVD_KW_Q6_K) && n_tokens > 0 &&
           in > 0 && in % 256 == 0 && !((uintptr_t)x & 15) && !((uintptr_t)w & 15);
}

extern "C" size_t kvd_k_qmma_act_bytes(int wtype, int n_tokens, int in)
{
    (void)wtype;
    return act_bytes(true, n_tokens, in);
}

extern "C" int kvd_k_qmma(float *y, const void *w, int wtype, int rows, int in, const float *x,
                          int n_tokens, void *act, kvd_stream stream)
{
    if (!kvd_k_qmma_ok(wtype, w, x, n_tokens, in) || rows < 0 || !act || ((uintptr_t)act & 15))
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    qm_params p;
    int8_t *qs;
    float *d;
    int *bs;
    float4 *m;
    act_ptrs(act, true, n_tokens, in, &qs, &d, &bs, &m);
    const unsigned qb = (unsigned)((n_tokens * (in / 256) + 7) / 8);
    if (wtype == KVD_KW_Q6_K)
        KVD_LAUNCH(qb, 256, 0, st, qmma_act_kernel<true>)(x, qs, d, bs, n_tokens, in);
    else
        KVD_LAUNCH(qb, 256, 0, st, qmma_act_kernel<false>)(x, qs, d, bs, n_tokens, in);
    int rc = kvd_launch_status();
    if (rc)
        return rc;
    p.w = (const uint8_t *)w;
    p.y = y;
    p.qs = qs;
    p.d = d;
    p.bs = bs;
    p.rows = rows;
    p.in = in;
    p.n = n_tokens;
    switch (wtype) {
    case KVD_KW_Q4_K:
        return qm_launch<KVD_KW_Q4_K>(p, n_tokens, st);
    case KVD_KW_Q5_K:
        return qm_launch<KVD_KW_Q5_K>(p, n_tokens, st);
    default:
        return qm_launch<KVD_KW_Q6_K>(p, n_tokens, st);
    }
}

// The projections of more than 8 tokens (batched decode, prefill chunks) of
// the K-quants (Q4_K, Q5_K, Q6_K planes, planes.cuh) on the tensor cores'
// int8 path: the activations are quantized once per call to Q8_K (the cpu
// backend's arithmetic), every sub-block's integer dot product of weight
// quants and activation quants is one mma.sync s8 (m16n8k32 for
// Q4_K/Q5_K's sub-blocks of 32, m16n8k16 for Q6_K's of 16: exact s32), the
// sub-block scales are applied in integers, the mins' (Q4_K/Q5_K) and the
// -32 offset's (Q6_K) terms are one more pair of int8 mma's per
// super-block (against the activations' sub-block sums split in two int8
// halves), and the float part runs per super-block in the fused GEMV's
// order (gemv_fused.cu: fmaf(sumi, d_w * d_a, acc), fmaf(summ, dmin_w *
// d_a, accm), super-block by super-block; out = acc - accm, Q6_K acc). So
// an output is the GEMV's bits for the same row whatever the batch (and the
// cpu backend's for Q4_K), with the weights read once per 32 tokens
// instead of once per 8, and no dequantized bf16 tile.
//
// A block is 4 warps over 16 weight rows (the mma's M) and 8 * NTI tokens
// (NTI n-tiles of 8: the mma's N), the warps splitting the super-blocks
// (the float part stays in order: qmma_kernel). Within a sub-block the
// mma's k order is a permutation of the values, the same for A and B:
// lane (g, t) holds values 8t .. 8t+7 of a 32-value sub-block (k 4t .. 4t+3
// and 16+4t .. 16+4t+3), so its weight bytes are one 8-byte load per row
// and its activations one 8-byte load per token; for Q6_K's 16 values,
// values 4t .. 4t+3 (k 4t .. 4t+3).
#include "mma.cuh"
#include "planes.cuh"

#define QM_WARPS 4 // warps of a block, over the same 16 rows (super-blocks in turn)

// The activations, quantized per call (qmma_act_kernel), for n tokens of
// `in` values: qs int8 [n][in] in the values' order; d f32 [n][in/256] (the
// Q8_K scale); sp int8 [n][in/256][32]: each super-block's sums of its
// sub-blocks (of 32 values against Q4_K/Q5_K, 8 of them; of 16 against
// Q6_K, 16 of them, in the order of the Q6_K plane's scales) split as
// S = 64 H + L, L in [0, 63]: L of each, then H of each, so the sums' terms
// (mins . S, scales . S) are two int8 mma's.
struct qm_act {
    int8_t *qs;
    float *d;
    int8_t *sp;
};

static __host__ __device__ __forceinline__ size_t qm_act_bytes(int n, int in)
{
    const size_t q = ((size_t)n * in + 15) & ~(size_t)15,
                 d = ((size_t)n * (in / 256) * 4 + 15) & ~(size_t)15;
    return q + d + (size_t)n * (in / 256) * 32;
}

static __host__ __device__ __forceinline__ qm_act qm_act_at(void *base, int n, int in)
{
    const size_t q = ((size_t)n * in + 15) & ~(size_t)15,
                 d = ((size_t)n * (in / 256) * 4 + 15) & ~(size_t)15;
    qm_act a;
    a.qs = (int8_t *)base;
    a.d = (float *)((char *)base + q);
    a.sp = (int8_t *)((char *)base + q + d);
    return a;
}

struct qm_params {
    const uint8_t *w;
    float *y;
    const int8_t *qs;
    const float *d;
    const int8_t *sp;
    int rows, in, n;
};

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

// The low (HI: high) nibbles of the four bytes of w.
template <bool HI> static __device__ __forceinline__ uint32_t qm_nib(uint32_t w)
{
    return (HI ? w >> 4 : w) & 0x0F0F0F0Fu;
}

// Byte i of w.
static __device__ __forceinline__ int qm_byte(uint32_t w, int i)
{
    return (int)((w >> (8 * i)) & 0xffu);
}

// Q4_K / Q5_K: per super-block, sub-block j (values 32j ..) is the low
// (even j) or high (odd j) nibbles of qs[32 (j / 2) ..+32], the fifth bit
// (Q5_K) bit j of qh[0 ..32]; the packed 6-bit scales and mins unpacked as
// four words of bytes (sc 0-3, sc 4-7, mn 0-3, mn 4-7). sumi = sum_j sc_j
// (q . a)_j, summ = sum_j mn_j (sums of 32 of a)_j (the mins' mma), both
// exact.
template <bool FIVE, int NTI>
static __device__ __forceinline__ void qm_k45(const qm_params &p, int sb, const int *row,
                                              const int *tok, int (*si)[4], int (*sm)[4])
{
    constexpr int WT = FIVE ? KVD_KW_Q5_K : KVD_KW_Q4_K;
    const int lane = kvd_lane_id(), t = lane & 3;
    const int nbk = p.in / 256;
    uint4 h[2];
    uint2 qh[2] = {make_uint2(0, 0), make_uint2(0, 0)};
    const uint8_t *qs[2];
    uint32_t scw[2][2], mnw[2][2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const size_t blk = (size_t)row[r] * nbk + sb;
        h[r] = __ldg((const uint4 *)qm_pl<WT, 0>(p.w, p.rows, nbk, blk));
        qs[r] = qm_pl < WT, FIVE ? 2 : 1 > (p.w, p.rows, nbk, blk);
        if (FIVE)
            qh[r] = __ldg((const uint2 *)(qm_pl<WT, 1>(p.w, p.rows, nbk, blk) + 8 * t));
        scw[r][0] = h[r].y & 0x3f3f3f3fu;
        mnw[r][0] = h[r].z & 0x3f3f3f3fu;
        scw[r][1] = (h[r].w & 0x0f0f0f0fu) | ((h[r].y >> 2) & 0x30303030u);
        mnw[r][1] = ((h[r].w >> 4) & 0x0f0f0f0fu) | ((h[r].z >> 2) & 0x30303030u);
    }
    int sumi[NTI][4];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            sumi[nt][i] = 0;
    const uint4 z4 = kvd_zero_u4(); // not a constant array (the emulation build's memcheck)
    const int zero[4] = {(int)z4.x, (int)z4.y, (int)z4.z, (int)z4.w};
#pragma unroll
    for (int q = 0; q < 4; q++) { // quarter q: sub-blocks 2q (low nibbles), 2q + 1 (high)
        uint2 w[2];
#pragma unroll
        for (int r = 0; r < 2; r++)
            w[r] = __ldg((const uint2 *)(qs[r] + 32 * q + 8 * t));
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
        const int s0[2] = {qm_byte(scw[0][q / 2], 2 * (q % 2)),
                           qm_byte(scw[1][q / 2], 2 * (q % 2))};
        const int s1[2] = {qm_byte(scw[0][q / 2], 2 * (q % 2) + 1),
                           qm_byte(scw[1][q / 2], 2 * (q % 2) + 1)};
#pragma unroll
        for (int nt = 0; nt < NTI; nt++) {
            const int8_t *x = p.qs + (size_t)tok[nt] * p.in + 256 * sb + 64 * q + 8 * t;
            const uint2 blo = *(const uint2 *)x, bhi = *(const uint2 *)(x + 32);
            const uint32_t bl[2] = {blo.x, blo.y}, bh[2] = {bhi.x, bhi.y};
            int dl[4], dh[4];
            kvd_mma_s8<32>(dl, alo, bl, zero);
            kvd_mma_s8<32>(dh, ahi, bh, zero);
#pragma unroll
            for (int i = 0; i < 4; i++)
                sumi[nt][i] += s0[i >> 1] * dl[i] + s1[i >> 1] * dh[i];
        }
    }
    // The mins' term: A = [mn 0-7, mn 0-7] (k 16), B = [L 0-7, 0] and
    // [0, H 0-7]: summ = mn . L + 64 mn . H.
    const uint32_t am[2] = {(t & 1) ? mnw[0][1] : mnw[0][0], (t & 1) ? mnw[1][1] : mnw[1][0]};
#pragma unroll
    for (int nt = 0; nt < NTI; nt++) {
        const uint32_t sw = *(const uint32_t *)(p.sp + ((size_t)tok[nt] * nbk + sb) * 32 + 4 * t);
        const uint32_t bz = z4.x, b1 = t < 2 ? sw : bz, b2 = t < 2 ? bz : sw;
        int m1[4], m2[4];
        kvd_mma_s8<16>(m1, am, &b1, zero);
        kvd_mma_s8<16>(m2, am, &b2, zero);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            si[nt][i] = sumi[nt][i];
            sm[nt][i] = m1[i] + 64 * m2[i];
        }
    }
}

// Q6_K: quarter v of a super-block (planes.cuh) holds the groups k < 4 of
// 16 values 128h + 32k + l0 + l (h = v / 2, l0 = 16 (v % 2)), each with an
// int8 scale (plane byte 4v + k); lane t takes l = 4t .. 4t+3 of each.
// sumi = sum over the 16 groups of sc (q . a) - 32 sc . (sums of 16 of a),
// the second term one mma pair (A = the 16 scales in plane order), exact.
template <int NTI>
static __device__ __forceinline__ void qm_k6(const qm_params &p, int sb, const int *row,
                                             const int *tok, int (*si)[4])
{
    constexpr int WT = KVD_KW_Q6_K;
    const int lane = kvd_lane_id(), t = lane & 3;
    const int nbk = p.in / 256;
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
    uint32_t scw[2][4];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const uint4 sv = __ldg((const uint4 *)qm_pl<WT, 2>(p.w, p.rows, nbk, blk[r]));
        scw[r][0] = sv.x, scw[r][1] = sv.y, scw[r][2] = sv.z, scw[r][3] = sv.w;
    }
#pragma unroll
    for (int v = 0; v < 4; v++) {
        uint32_t la[2], lb[2], qh[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint8_t *ql = qm_pl<WT, 0>(p.w, p.rows, nbk, blk[r]) + 32 * v;
            la[r] = __ldg((const uint32_t *)(ql + 4 * t));
            lb[r] = __ldg((const uint32_t *)(ql + 16 + 4 * t));
            qh[r] =
                __ldg((const uint32_t *)(qm_pl<WT, 1>(p.w, p.rows, nbk, blk[r]) + 16 * v + 4 * t));
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t a[2];
            int sc[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                a[r] = qm_nib<false>(((k & 1) ? lb[r] : la[r]) >> (4 * (k >> 1))) |
                       (((qh[r] >> (2 * k)) & 0x03030303u) << 4);
                sc[r] = (int)(int8_t)qm_byte(scw[r][v], k);
            }
#pragma unroll
            for (int nt = 0; nt < NTI; nt++) {
                const uint32_t b =
                    *(const uint32_t *)(p.qs + (size_t)tok[nt] * p.in + 256 * sb + 128 * (v / 2) +
                                        32 * k + 16 * (v % 2) + 4 * t);
                int dd[4];
                kvd_mma_s8<16>(dd, a, &b, zero);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    sumi[nt][i] += sc[i >> 1] * dd[i];
            }
        }
    }
    // -32 sc . S16: A = the 16 scales (lane t: plane bytes 4t .. 4t+3), B =
    // the sums' L and H parts in the same order.
    uint32_t as[2]; // registers, not a run-time index into a local array
#pragma unroll
    for (int r = 0; r < 2; r++)
        as[r] = t == 0 ? scw[r][0] : t == 1 ? scw[r][1] : t == 2 ? scw[r][2] : scw[r][3];
#pragma unroll
    for (int nt = 0; nt < NTI; nt++) {
        const int8_t *sp = p.sp + ((size_t)tok[nt] * nbk + sb) * 32;
        const uint32_t b1 = *(const uint32_t *)(sp + 4 * t),
                       b2 = *(const uint32_t *)(sp + 16 + 4 * t);
        int c1[4], c2[4];
        kvd_mma_s8<16>(c1, as, &b1, zero);
        kvd_mma_s8<16>(c2, as, &b2, zero);
#pragma unroll
        for (int i = 0; i < 4; i++)
            si[nt][i] = sumi[nt][i] - 32 * (c1[i] + 64 * c2[i]);
    }
}

// The float part of super-block sb for this lane's C elements (rows row[0]
// for i < 2, row[1] else; tokens otok), in the GEMV's order: acc =
// fmaf(sumi, d_w * d_a, acc), accm = fmaf(summ, dmin_w * d_a, accm).
template <int WT, int NTI>
static __device__ __forceinline__ void qm_chain(const qm_params &p, int sb, const int *row,
                                                const int *otok, int (*si)[4], int (*sm)[4],
                                                float (*acc)[4], float (*accm)[4])
{
    const int nbk = p.in / 256;
    float dw[2], dmw[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const size_t blk = (size_t)row[r] * nbk + sb;
        if (WT == KVD_KW_Q6_K) {
            dw[r] = kvd_f16_to_f32(__ldg((const uint16_t *)qm_pl<WT, 3>(p.w, p.rows, nbk, blk)));
            dmw[r] = 0.0f;
        } else {
            const uint32_t h = __ldg((const uint32_t *)qm_pl<WT, 0>(p.w, p.rows, nbk, blk));
            dw[r] = kvd_f16_to_f32((uint16_t)(h & 0xffffu));
            dmw[r] = kvd_f16_to_f32((uint16_t)(h >> 16));
        }
    }
#pragma unroll
    for (int nt = 0; nt < NTI; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float da = p.d[(size_t)otok[2 * nt + (i & 1)] * nbk + sb];
            acc[nt][i] = fmaf((float)si[nt][i], __fmul_rn(dw[i >> 1], da), acc[nt][i]);
            if (WT != KVD_KW_Q6_K)
                accm[nt][i] = fmaf((float)sm[nt][i], __fmul_rn(dmw[i >> 1], da), accm[nt][i]);
        }
}

// grid (row blocks of 16, token blocks of 8 NTI); the block's QM_WARPS
// warps take its super-blocks in turn (warp w: sb = w mod QM_WARPS), each
// the exact integer sums of its super-block into shared memory, and warp 0
// then runs the float part over them in super-block order: the sums of a
// 16-row tile come from QM_WARPS warps at once (enough weight bytes in
// flight at a few tokens) without changing the float order.
template <int WT, int NTI> __global__ void __launch_bounds__(QM_WARPS * 32) qmma_kernel(qm_params p)
{
    KVD_SHARED(int, qm_part, [QM_WARPS][2][NTI * 4][32]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * 16, n0 = blockIdx.y * 8 * NTI, nsb = p.in / 256;
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
    for (int base = 0; base < nsb; base += QM_WARPS) {
        const int sb = base + warp;
        if (sb < nsb) { // whole warps
            int si[NTI][4], sm[NTI][4];
            if constexpr (WT == KVD_KW_Q6_K)
                qm_k6<NTI>(p, sb, row, tok, si);
            else
                qm_k45<WT == KVD_KW_Q5_K, NTI>(p, sb, row, tok, si, sm);
#pragma unroll
            for (int nt = 0; nt < NTI; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    qm_part[warp][0][nt * 4 + i][lane] = si[nt][i];
                    qm_part[warp][1][nt * 4 + i][lane] = WT == KVD_KW_Q6_K ? 0 : sm[nt][i];
                }
        }
        __syncthreads();
        if (warp == 0) {
            for (int w = 0; w < QM_WARPS && base + w < nsb; w++) {
                int si[NTI][4], sm[NTI][4];
#pragma unroll
                for (int nt = 0; nt < NTI; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        si[nt][i] = qm_part[w][0][nt * 4 + i][lane];
                        sm[nt][i] = qm_part[w][1][nt * 4 + i][lane];
                    }
                qm_chain<WT, NTI>(p, base + w, row, otok, si, sm, acc, accm);
            }
        }
        __syncthreads();
    }
    if (warp != 0)
        return;
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

// x [n][in] to Q8_K (qm_act), a warp per super-block: lane i quantizes
// values 8i .. 8i+7 with ggml's Q8_K arithmetic, as the cpu backend
// (compute_cpu_quant.c) and the GEMV's act_quant256 do: mx the value of
// largest magnitude (the first on ties), iscale = -127 / mx, q =
// min(127, round-half-even(iscale x)), d = 1 / iscale (all zero for a zero
// block); then the sums of 32 (Q6: of 16, in the Q6_K plane's scale order)
// split into int8 L and H.
template <bool Q6>
__global__ void qmma_act_kernel(const float *__restrict__ x, qm_act a, int n, int in)
{
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (g >= n * (in / 256))
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
        const float oa = __shfl_xor_sync(0xffffffffu, amax, o);
        const float om = __shfl_xor_sync(0xffffffffu, mx, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (oa > amax || (oa == amax && oi < idx))
            amax = oa, mx = om, idx = oi;
    }
    const float iscale = amax != 0.0f ? -127.0f / mx : 0.0f;
    int sum = 0;
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int r = amax != 0.0f ? (int)rintf(iscale * v[i]) : 0;
        r = r > 127 ? 127 : r;
        sum += r;
        if (i < 4)
            lo |= (uint32_t)(uint8_t)(int8_t)r << (8 * i);
        else
            hi |= (uint32_t)(uint8_t)(int8_t)r << (8 * (i - 4));
    }
    *(uint2 *)(a.qs + (size_t)g * 256 + 8 * lane) = make_uint2(lo, hi);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1); // the sum of 16 (lanes 2s, 2s + 1)
    int8_t *sp = a.sp + (size_t)g * 32;
    if (Q6) {
        // sub-block s = lane / 2 = 8h + l0/16 + 2k sits at plane position
        // 4v + k, v = 2h + l0/16
        const int s = lane / 2, h = s / 8, r = s % 8, c = 4 * (2 * h + r % 2) + r / 2;
        if ((lane & 1) == 0) {
            sp[c] = (int8_t)(sum & 63);
            sp[16 + c] = (int8_t)(sum >> 6);
        }
    } else {
        sum += __shfl_xor_sync(0xffffffffu, sum, 2); // of 32 (lanes 4j .. 4j+3)
        const int j = lane / 4;
        if ((lane & 3) == 0) {
            sp[j] = (int8_t)(sum & 63);
            sp[8 + j] = (int8_t)(sum >> 6);
        }
    }
    if (lane == 0)
        a.d[g] = amax != 0.0f ? 1.0f / iscale : 0.0f;
}

template <int WT> static int qm_launch(const qm_params &p, int ntok, cudaStream_t st)
{
    const unsigned gx = (unsigned)((p.rows + 15) / 16);
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
    return qm_act_bytes(n_tokens, in);
}

extern "C" int kvd_k_qmma(float *y, const void *w, int wtype, int rows, int in, const float *x,
                          int n_tokens, void *act, kvd_stream stream)
{
    if (!kvd_k_qmma_ok(wtype, w, x, n_tokens, in) || rows < 0 || !act || ((uintptr_t)act & 15))
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    const qm_act a = qm_act_at(act, n_tokens, in);
    const unsigned qb = (unsigned)((n_tokens * (in / 256) + 7) / 8);
    if (wtype == KVD_KW_Q6_K)
        KVD_LAUNCH(qb, 256, 0, st, qmma_act_kernel<true>)(x, a, n_tokens, in);
    else
        KVD_LAUNCH(qb, 256, 0, st, qmma_act_kernel<false>)(x, a, n_tokens, in);
    int rc = kvd_launch_status();
    if (rc)
        return rc;
    qm_params p;
    p.w = (const uint8_t *)w;
    p.y = y;
    p.qs = a.qs;
    p.d = a.d;
    p.sp = a.sp;
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

// Decode attention on tensor cores for query groups of 4 and 8 heads
// (included by attn_decode.cu, whose row loads, splits and merge it shares):
// a warp takes 16 keys at a time and computes S^T = K_tile Q_group^T and
// O^T += V_tile^T P^T with mma.sync m16n8k16 (16 keys or 16 output dims as
// M, the group's heads as N, padded to 8; f32 accumulators).
#include "mma.cuh"

// The tensor-core instances: head_dim 64 and 128, query groups of 4 and 8,
// f16/bf16 rows and q8_0 rows widened to f16 as used. The others keep the
// scalar kernel (ptxas sm_90/sm_80, nvcc 13.0): at head_dim 256 a 16-key
// tile of K or V with O's 64 accumulators takes 246-255 registers and
// spills with q8_0/fp8 rows (2 blocks a multiprocessor where the scalar
// kernel's GQ 4 has 3); fp8's widening takes 186 registers at head_dim 128
// (the scalar GQ 4's 160: 2 blocks against 3) and spills on sm_80; f32 rows
// rounded to 16 bits would lose what they are kept for.
#define AD_MMA(D, DT, GQ)                                                                          \
    ((GQ) >= 4 && ((D) == 64 || (D) == 128) &&                                                     \
     ((DT) == KVD_K_F16 || (DT) == KVD_K_BF16 || (DT) == KVD_K_Q8_0))

// The 16-key tile of one warp, as loaded (widened only when used): lane
// (g, t) holds K rows g and g + 8, dims [32 c + 8 t, + 8) of every 32-dim
// piece c, and V rows t, t + 8, t + 4, t + 12 (adm_vkey), dims
// [64 b + 8 g, + 8) of every 64-dim piece b.
template <int D, int DT> struct adm_tile {
    ad_raw<DT> k[2][D / 32];
    ad_raw<DT> v[4][D / 64];
};

// The key (of the tile's 16) of lane t's V row j: t, t + 8, t + 4, t + 12.
static __device__ __forceinline__ int adm_vkey(int t, int j)
{
    return t + 8 * (j & 1) + 4 * (j >> 1);
}

template <int DT> static __device__ __forceinline__ void adm_zero(ad_raw<DT> &r)
{
    if constexpr (DT == KVD_K_Q8_0) {
        r.d = 0;
#pragma unroll
        for (int i = 0; i < 4; i++)
            r.q[i] = 0;
    } else if constexpr (DT == KVD_K_FP8) {
        r.s = 0.0f;
        r.q.x = r.q.y = 0;
    } else {
        r.w = kvd_zero_u4();
    }
}

// Eight values of a row as four registers of two 16-bit values in the mma
// type (f16/bf16 rows as they are; q8_0/fp8 widened to f32 as the cpu does,
// then rounded to f16).
template <int DT> static __device__ __forceinline__ void adm_frag(const ad_raw<DT> &r, uint32_t *w)
{
    if constexpr (DT == KVD_K_F16 || DT == KVD_K_BF16) {
        w[0] = r.w.x;
        w[1] = r.w.y;
        w[2] = r.w.z;
        w[3] = r.w.w;
    } else {
        float f[8];
        ad_widen<DT>(r, f);
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = kvd_pack2<false>(f[2 * i], f[2 * i + 1]);
    }
}

// grid and arguments as attn_decode_kernel's. Warp w takes the tiles of keys
// [t_begin + 16 (w + 4 i), + 16) of the block's split. The dot products'
// dims and the keys of P V are permuted alike on both sides of each mma (a
// sum's terms in another order), so each lane loads 16 contiguous bytes:
//   S^T (keys x heads), per 32-dim piece c, two k16 steps: lane (g, t)'s A
//     registers are its K words (row g, g + 8) 0, 1 then 2, 3; its B
//     registers Q[head g] at the same dims. C: keys g, g + 8 x heads 2t, 2t+1.
//   O^T (dims x heads), per output m-tile (b, i) of dims 64 b + 8 g + 2 i
//     (row g) and + 1 (row g + 8): A = V^T, keys t, t+8 (k 2t, 2t+1) and
//     t+4, t+12 (k 2t+8, 2t+9), each register two keys' values of one dim;
//     B = P^T through shared memory: the C fragment's register pairs (keys
//     g, g + 8 of head 2t + h) stored as words [head][g], so lane (g, t)
//     reads its B registers as words [g][t] and [g][t + 4].
template <int D, int DT, int GQ>
__global__ void __launch_bounds__(AD_WARPS * 32)
    attn_decode_mma_kernel(float *out, ad_partial part, const float *__restrict__ q, kvd_k_kv kv,
                           int layer, const uint32_t *__restrict__ slots,
                           const uint32_t *__restrict__ slot0, const uint32_t *__restrict__ pos0,
                           const uint32_t *__restrict__ qstart, int n_heads, int q_groups,
                           float scale_log2, int early)
{
    static_assert(AD_MMA(D, DT, GQ), "not a tensor-core instance");
    constexpr bool BF = DT == KVD_K_BF16; // the mma type: bf16 for bf16 rows, f16 otherwise
    constexpr int NSUB = AD_WARPS, TILE = 16, STRIDE = AD_WARPS * TILE;
    KVD_SHARED(float, sm_o, [NSUB][GQ][D]);
    KVD_SHARED(float, sm_m, [NSUB][GQ]);
    KVD_SHARED(float, sm_l, [NSUB][GQ]);
    KVD_SHARED(uint32_t, sm_p, [NSUB][8][TILE / 2]); // each warp's P: [head][keys k, k + 8]

    const int split = blockIdx.x, n_grid = gridDim.x, seq = blockIdx.z;
    const int kvh = blockIdx.y / q_groups, qg = blockIdx.y % q_groups;
    const int group = n_heads / kv.kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int h0 = kvh * group + qg * GQ;
    const int nq = min(GQ, group - qg * GQ);
    const uint32_t qrow = qstart[seq];
    if (qstart[seq + 1] - qrow != 1)
        return; // uniform over the block, before any barrier (see attn_decode_kernel)
    const int len = (int)pos0[seq] + 1;
    const int n_splits = ad_seq_splits(len, n_grid);
    if (split >= n_splits)
        return;
    const int chunk = (len + n_splits - 1) / n_splits;
    const int t_begin = split * chunk, t_end = min(len, t_begin + chunk);
    const uint32_t *table = slots + slot0[seq];
    const size_t k_off = kvd_kv_row_off(kv, layer, 0, kvh, 0); // bytes
    const size_t v_off = kvd_kv_row_off(kv, layer, 1, kvh, 0);

    auto row_at = [&](int key, size_t off) {
        return (const char *)kv.arena + (size_t)table[key / kv.block_tokens] * kv.block_bytes +
               off + (size_t)(key % kv.block_tokens) * kv.row_bytes;
    };
    // This lane's K (V) rows of the tile at key0, those before lim; the
    // others zeros (a V row past the end must not hold a NaN: P is 0 there).
    adm_tile<D, DT> tile;
    auto load_k = [&](int key0, int lim) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int key = key0 + g + 8 * r;
#pragma unroll
            for (int c = 0; c < D / 32; c++) {
                if (key < lim)
                    ad_load<DT>(tile.k[r][c], row_at(key, k_off), 4 * c + t);
                else
                    adm_zero<DT>(tile.k[r][c]);
            }
        }
    };
    auto load_v = [&](int key0, int lim) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int key = key0 + adm_vkey(t, j);
#pragma unroll
            for (int b = 0; b < D / 64; b++) {
                if (key < lim)
                    ad_load<DT>(tile.v[j][b], row_at(key, v_off), 8 * b + g);
                else
                    adm_zero<DT>(tile.v[j][b]);
            }
        }
    };
    // The newest row (t = len - 1), if this lane holds it: after the wait.
    auto load_newest = [&](int key0) {
        const int key = len - 1;
        if (key >= t_end)
            return;
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (key == key0 + g + 8 * r)
#pragma unroll
                for (int c = 0; c < D / 32; c++)
                    ad_load<DT>(tile.k[r][c], row_at(key, k_off), 4 * c + t);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (key == key0 + adm_vkey(t, j))
#pragma unroll
                for (int b = 0; b < D / 64; b++)
                    ad_load<DT>(tile.v[j][b], row_at(key, v_off), 8 * b + g);
    };

    // Programmatic dependent launch, as attn_decode_kernel: in a plain
    // decode step the first tile's rows but the newest are loaded before the
    // wait, the newest after it; otherwise every row after it.
    // The next tile's K is in flight during a tile's softmax and P V, its V
    // during the next tile's scores.
    int key0 = t_begin + warp * TILE;
    if (early) {
        load_k(key0, min(t_end, len - 1));
        load_v(key0, min(t_end, len - 1));
    }
    kvd_pdl_wait();
    kvd_pdl_trigger();
    if (early) {
        load_newest(key0);
    } else {
        load_k(key0, t_end);
        load_v(key0, t_end);
    }

    // Q of head g (zeros for padding heads) as B fragments, rounded to the
    // mma type: qb[c][i] = dims 32 c + 8 t + 2 i, + 1.
    uint32_t qb[D / 32][4];
#pragma unroll
    for (int c = 0; c < D / 32; c++) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (g < nq) {
            const float4 *src =
                (const float4 *)(q + ((size_t)qrow * n_heads + h0 + g) * D + 32 * c + 8 * t);
            a = src[0];
            b = src[1];
        }
        qb[c][0] = kvd_pack2<BF>(a.x, a.y);
        qb[c][1] = kvd_pack2<BF>(a.z, a.w);
        qb[c][2] = kvd_pack2<BF>(b.x, b.y);
        qb[c][3] = kvd_pack2<BF>(b.z, b.w);
    }

    // Heads 2t and 2t + 1 (h = 0, 1): running max (log2 units), this lane's
    // part of the sum of the rounded weights (keys g, g + 8 of each tile).
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[D / 16][4]; // O^T m-tiles (b, i) = 4 b + i, C fragments
#pragma unroll
    for (int i = 0; i < D / 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            o[i][e] = 0.0f;

    // key0 is uniform over the warp: every lane reaches the mma and shuffles.
    for (; key0 < t_end; key0 += STRIDE) {
        const int next = key0 + STRIDE;
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < D / 32; c++) {
            uint32_t k0[4], k1[4];
            adm_frag<DT>(tile.k[0][c], k0);
            adm_frag<DT>(tile.k[1][c], k1);
            const uint32_t a0[4] = {k0[0], k1[0], k0[1], k1[1]};
            const uint32_t a1[4] = {k0[2], k1[2], k0[3], k1[3]};
            kvd_mma16816<BF>(s, a0, qb[c], s);
            kvd_mma16816<BF>(s, a1, qb[c] + 2, s);
        }
        if (next < t_end) // the next tile's K in flight from here on
            load_k(next, t_end);
        // Scale, mask keys past the split, each head's max over the tile's
        // 16 keys (the 8 lanes g of one t).
        float mx[2];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = key0 + g + 8 * (e >> 1);
            s[e] = key < t_end ? s[e] * scale_log2 : -INFINITY;
        }
        float corr[2], ref[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(s[h], s[2 + h]);
#pragma unroll
            for (int x = 4; x < 32; x <<= 1)
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], x));
            const float mn = fmaxf(m[h], mx[h]);
            ref[h] = mn == -INFINITY ? 0.0f : mn;
            corr[h] = exp2f(m[h] - ref[h]); // 0 on the first tile (m = -inf)
            m[h] = mn;
        }
        // P rounded to the mma type into this warp's [head][key] tile; the
        // sums take the rounded values (the output is a convex combination
        // of V rows, as in the prefill kernel).
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint32_t w = kvd_pack2<BF>(exp2f(s[h] - ref[h]), exp2f(s[2 + h] - ref[h]));
            sm_p[warp][2 * t + h][g] = w; // keys g, g + 8
            l[h] = l[h] * corr[h] + kvd_unpack_lo<BF>(w) + kvd_unpack_hi<BF>(w);
        }
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[1];
            o[i][2] *= corr[0];
            o[i][3] *= corr[1];
        }
        __syncwarp();
        const uint32_t pb[2] = {sm_p[warp][g][t], sm_p[warp][g][t + 4]};
        __syncwarp(); // read before the next tile's P is written
#pragma unroll
        for (int b = 0; b < D / 64; b++) {
            uint32_t v[4][4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                adm_frag<DT>(tile.v[j][b], v[j]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // Two keys' values of dim 64 b + 8 g + 2 i (low halves) and
                // of the dim after it (high halves).
                const uint32_t a[4] = {(v[0][i] & 0xffffu) | (v[1][i] << 16),
                                       (v[0][i] >> 16) | (v[1][i] & 0xffff0000u),
                                       (v[2][i] & 0xffffu) | (v[3][i] << 16),
                                       (v[2][i] >> 16) | (v[3][i] & 0xffff0000u)};
                kvd_mma16816<BF>(o[4 * b + i], a, pb, o[4 * b + i]);
            }
        }
        if (next < t_end)
            load_v(next, t_end);
    }

    // Each head's sum over the 8 lanes g, then this warp's part into the
    // block's merge.
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1)
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = 2 * t + h;
        if (j >= GQ)
            continue;
#pragma unroll
        for (int b = 0; b < D / 64; b++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int d = 64 * b + 8 * g + 2 * i;
                sm_o[warp][j][d] = o[4 * b + i][h];
                sm_o[warp][j][d + 1] = o[4 * b + i][2 + h];
            }
        if (g == 0) {
            sm_m[warp][j] = m[h];
            sm_l[warp][j] = l[h];
        }
    }
    __syncthreads();
    ad_finish<D, GQ, NSUB>(sm_o, sm_m, sm_l, out, part, seq, split, n_splits, qrow, n_heads, h0,
                           nq);
}

// Prefill (and mixed-batch) attention on tensor cores, FlashAttention-2
// style: a block takes 64 query rows of one sequence and KV head (16 per
// warp: mma's M), walks the keys up to its last row's position in tiles
// gathered from the paged KV into shared memory (f16/bf16 rows copied with
// cp.async one tile ahead; q8_0 and fp8 rows dequantized to f16 on the way),
// and keeps each row's output in f32 registers with an online softmax.
// S = Q K^T and O += P V are mma.sync m16n8k16 in the KV's 16-bit type (f16
// for q8_0/fp8), f32 accumulation; P is rounded to that type for the second
// product, and each row's sum is taken of the rounded values, so the output
// is exactly a convex combination of V rows. Scores are scaled and
// exponentiated in the log2 domain (exp2f) in f32.
#include "attn_prefill.cuh"
#include "kv_row.cuh"
#include "mma.cuh"

#define APM_WARPS 4
#define APM_BR (APM_WARPS * 16) // query rows per block
// 16-bit elements after each row in shared memory: rows then start 16 bytes
// apart modulo 128, so the 8 row addresses of an ldmatrix hit 8 different
// 16-byte bank groups (no conflict).
#define APM_PAD 8

template <int D> struct apm_shape {
    static constexpr int BK = D > 128 ? 32 : 64;  // keys per tile
    static constexpr bool Q_REGS = D <= 128;      // D = 256: registers go to O; Q in shared
    static constexpr int LD = D + APM_PAD;        // shared row stride, elements
    static constexpr int TILE = BK * LD;          // elements of one K (or V) tile
    static constexpr int CHUNKS = 2 * BK * D / 8; // 16-byte pieces of a K and a V tile
    static constexpr int PER_THREAD = (CHUNKS + APM_WARPS * 32 - 1) / (APM_WARPS * 32);
    // Q (D = 256), then two stages of (K, V).
    static constexpr size_t SMEM = 2 * ((Q_REGS ? 0 : (size_t)APM_BR * LD) + 4 * (size_t)TILE);
};

// Gathers keys [k0, k0 + BK) of this block's sequence and KV head into one
// stage (sk, with V TILE elements after it): rows past k_end are zeros.
// 16-bit rows go through the cp.async pipe; quantized rows are dequantized
// to f16 and stored directly.
template <int D, int DT, class Pipe>
static __device__ __forceinline__ void apm_gather(uint16_t *sk, const kvd_k_kv &kv,
                                                  const uint32_t *table, size_t k_off, size_t v_off,
                                                  int k0, int k_end, Pipe &pipe)
{
    using S = apm_shape<D>;
    constexpr int CPR = D / 8; // chunks per row
    for (int idx = threadIdx.x; idx < S::CHUNKS; idx += APM_WARPS * 32) {
        const int sel = idx / (S::BK * CPR), rem = idx % (S::BK * CPR);
        const int j = rem / CPR, c = rem % CPR, key = k0 + j;
        uint16_t *dst = sk + sel * S::TILE + j * S::LD + c * 8;
        if (key >= k_end) {
            *(uint4 *)dst = kvd_zero_u4();
            continue;
        }
        const char *row = (const char *)kv.arena +
                          (size_t)table[key / kv.block_tokens] * kv.block_bytes +
                          (sel ? v_off : k_off) + (size_t)(key % kv.block_tokens) * kv.row_bytes;
        if (DT == KVD_K_F16 || DT == KVD_K_BF16) {
            pipe.copy16(dst, row + (size_t)c * 16);
        } else {
            float f[8];
            kvd_row_load8<DT>(row, c, f);
            *(uint4 *)dst = make_uint4(kvd_pack2<false>(f[0], f[1]), kvd_pack2<false>(f[2], f[3]),
                                       kvd_pack2<false>(f[4], f[5]), kvd_pack2<false>(f[6], f[7]));
        }
    }
}

// grid (row tiles, last first; kv_heads; n_seqs), APM_WARPS warps. Block rows enumerate
// (query token, head of the KV head's group) with the group innermost, so
// the rows of one token share every K/V tile. Lane (g, t) of a warp holds
// its rows g and g + 8 (the C fragment's rows).
template <int D, int DT>
__global__ void __launch_bounds__(APM_WARPS * 32)
    attn_prefill_mma_kernel(float *out, const float *__restrict__ q, kvd_k_kv kv, int layer,
                            const uint32_t *__restrict__ slots, const uint32_t *__restrict__ slot0,
                            const uint32_t *__restrict__ pos0, const uint32_t *__restrict__ qstart,
                            int n_heads, float scale_log2, int skip_single)
{
    using S = apm_shape<D>;
    constexpr bool BF = DT == KVD_K_BF16; // the mma type: bf16 for bf16 KV, f16 otherwise
    constexpr int NT = S::BK / 8;         // score n-tiles (8 keys each)
    KVD_DYN_SHARED(uint4, apm_raw);
    uint16_t *const sq = (uint16_t *)apm_raw; // [APM_BR][LD], D = 256 only
    uint16_t *const skv = sq + (S::Q_REGS ? 0 : APM_BR * S::LD);

    const int seq = blockIdx.z, kvh = blockIdx.y;
    const int group = n_heads / kv.kv_heads;
    const int q0 = (int)qstart[seq], n_new = (int)qstart[seq + 1] - q0;
    const int rows_total = n_new * group;
    // Row tiles in reverse: the causal mask makes a sequence's last tile the
    // longest (it sees every key), and blocks start in index order, so the
    // longest start first and the short ones fill the last wave.
    const int row0 = (int)(gridDim.x - 1 - blockIdx.x) * APM_BR;
    if (row0 >= rows_total || (skip_single && n_new == 1))
        return; // whole block idle: uniform, before any barrier
    const int first_pos = (int)pos0[seq];
    const uint32_t *table = slots + slot0[seq];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    // This lane's rows (g, g + 8 of the warp's 16): positions, -1 for rows
    // past the sequence's. The warp's range of positions, for skipping
    // tiles it cannot see and masking only where a tile crosses a row.
    const int wrow0 = row0 + warp * 16;
    int pos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = wrow0 + g + 8 * i;
        pos[i] = r < rows_total ? first_pos + r / group : -1;
    }
    const int w_max =
        wrow0 < rows_total ? first_pos + (min(wrow0 + 15, rows_total - 1)) / group : -1;
    const int w_min = wrow0 + 15 < rows_total ? first_pos + wrow0 / group : -1; // -1: padding rows

    // Q as A fragments (D <= 128: registers) or in shared memory (D = 256),
    // rounded to the mma type; padding rows are zeros.
    uint32_t qf[S::Q_REGS ? D / 16 : 1][4];
    if constexpr (S::Q_REGS) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int row = wrow0 + g + (r & 1) * 8, col = kk * 16 + 2 * t + (r >> 1) * 8;
                float2 v = make_float2(0.0f, 0.0f);
                if (row < rows_total) {
                    const int tok = row / group, h = kvh * group + row % group;
                    v = *(const float2 *)(q + ((size_t)(q0 + tok) * n_heads + h) * D + col);
                }
                qf[kk][r] = kvd_pack2<BF>(v.x, v.y);
            }
    } else {
        for (int idx = threadIdx.x; idx < APM_BR * D / 8; idx += APM_WARPS * 32) {
            const int r = idx / (D / 8), c = idx % (D / 8), row = row0 + r;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
            if (row < rows_total) {
                const int tok = row / group, h = kvh * group + row % group;
                const float4 *src =
                    (const float4 *)(q + ((size_t)(q0 + tok) * n_heads + h) * D + c * 8);
                a = src[0];
                b = src[1];
            }
            *(uint4 *)(sq + r * S::LD + c * 8) =
                make_uint4(kvd_pack2<BF>(a.x, a.y), kvd_pack2<BF>(a.z, a.w),
                           kvd_pack2<BF>(b.x, b.y), kvd_pack2<BF>(b.z, b.w));
        }
    }

    // Keys needed: up to the block's last row's position (inclusive).
    const int k_end = first_pos + (min(row0 + APM_BR, rows_total) - 1) / group + 1;
    const int n_tiles = (k_end + S::BK - 1) / S::BK;
    const size_t k_off = kvd_kv_row_off(kv, layer, 0, kvh, 0); // bytes
    const size_t v_off = kvd_kv_row_off(kv, layer, 1, kvh, 0);

    float o[D / 8][4]; // O's n-tiles of 8 output columns, C fragments
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            o[j][i] = 0.0f;

    kvd_cp_async<2 * S::PER_THREAD> pipe;
    apm_gather<D, DT>(skv, kv, table, k_off, v_off, 0, k_end, pipe);
    pipe.commit();
    for (int it = 0; it < n_tiles; it++) {
        const int k0 = it * S::BK;
        const uint16_t *sk = skv + (it & 1) * 2 * S::TILE, *sv = sk + S::TILE;
        if (it + 1 < n_tiles) // the next tile into the other stage, in flight meanwhile
            apm_gather<D, DT>(skv + ((it + 1) & 1) * 2 * S::TILE, kv, table, k_off, v_off,
                              k0 + S::BK, k_end, pipe);
        pipe.commit();
        pipe.template wait<1>(); // this tile's copies (the newest group may still fly)
        __syncthreads();
        if (k0 <= w_max) { // warp-uniform: some row of the warp sees a key here
            // S = Q K^T for the tile's keys: NT n-tiles of 8 keys.
            float s[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    s[j][i] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a[4];
                if constexpr (S::Q_REGS) {
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        a[i] = qf[kk][i];
                } else { // matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15 of the warp's Q
                    kvd_ldsm<4, false>(a, sq + (warp * 16 + (lane & 15)) * S::LD + kk * 16 +
                                              (lane >> 4) * 8);
                }
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    // Matrices: keys 8j.., 8(j+1).. x dims 16kk.., 16kk+8..:
                    // b[0..1] is n-tile j's B fragment, b[2..3] n-tile j+1's.
                    uint32_t b[4];
                    kvd_ldsm<4, false>(b, sk + (j * 8 + (lane & 7) + (lane >> 4) * 8) * S::LD +
                                              kk * 16 + ((lane >> 3) & 1) * 8);
                    kvd_mma16816<BF>(s[j], a, b, s[j]);
                    kvd_mma16816<BF>(s[j + 1], a, b + 2, s[j + 1]);
                }
            }
            // Scale to log2 units, mask keys past each row's position (the
            // tile's keys past k_end are past every row's), row maxima over
            // the 4 lanes holding a row.
            const bool masked = !(k0 + S::BK - 1 <= w_min);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float v = s[j][i] * scale_log2;
                    if (masked && k0 + j * 8 + 2 * t + (i & 1) > pos[i >> 1])
                        v = -INFINITY;
                    s[j][i] = v;
                    mx[i >> 1] = fmaxf(mx[i >> 1], v);
                }
            float corr[2], ref[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float mn = fmaxf(m[r], mx[r]);
                ref[r] = mn == -INFINITY ? 0.0f : mn; // a row that sees nothing yet
                corr[r] = exp2f(m[r] - ref[r]);       // 0 on a row's first keys
                m[r] = mn;
            }
            // P = exp2(S - max) rounded to the mma type, as A fragments of
            // 16 keys each (two score n-tiles); the rows' partial sums of
            // the rounded values.
            uint32_t p[NT / 2][4];
            float ls[2] = {0.0f, 0.0f};
#pragma unroll
            for (int kk = 0; kk < NT / 2; kk++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const float *sv2 = s[2 * kk + h] + 2 * r;
                        const uint32_t w =
                            kvd_pack2<BF>(exp2f(sv2[0] - ref[r]), exp2f(sv2[1] - ref[r]));
                        p[kk][2 * h + r] = w;
                        ls[r] += kvd_unpack_lo<BF>(w) + kvd_unpack_hi<BF>(w);
                    }
#pragma unroll
            for (int r = 0; r < 2; r++)
                l[r] = l[r] * corr[r] + ls[r];
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                o[j][0] *= corr[0];
                o[j][1] *= corr[0];
                o[j][2] *= corr[1];
                o[j][3] *= corr[1];
            }
            // O += P V: V's rows are keys (K dimension), its columns the
            // output's; transposed loads give the B fragments.
#pragma unroll
            for (int kk = 0; kk < NT / 2; kk++)
#pragma unroll
                for (int j = 0; j < D / 8; j += 2) {
                    // Matrices: keys 16kk.., 16kk+8.. x dims 8j.., 8(j+1)..
                    uint32_t b[4];
                    kvd_ldsm<4, true>(b,
                                      sv + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::LD +
                                          (j + (lane >> 4)) * 8);
                    kvd_mma16816<BF>(o[j], p[kk], b, o[j]);
                    kvd_mma16816<BF>(o[j + 1], p[kk], b + 2, o[j + 1]);
                }
        }
        __syncthreads(); // every warp is done with this stage before it is refilled
    }

    // Each row's sum over its 4 lanes, then the normalized rows.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = wrow0 + g + 8 * r;
        if (row >= rows_total)
            continue;
        const int tok = row / group, h = kvh * group + row % group;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *op = out + ((size_t)(q0 + tok) * n_heads + h) * D + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(float2 *)(op + j * 8) = make_float2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    }
}

template <int D, int DT>
static int apm_launch(float *out, const float *q, const kvd_k_kv &kv, int layer,
                      const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                      const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                      int skip_single, cudaStream_t stream)
{
    static std::atomic<unsigned long long> optin{0};
    const size_t smem = apm_shape<D>::SMEM;
    int rc = kvd_smem_optin(attn_prefill_mma_kernel<D, DT>, smem, optin);
    if (rc)
        return rc;
    const long rows = (long)max_q * (n_heads / kv.kv_heads);
    dim3 grid((unsigned)((rows + APM_BR - 1) / APM_BR), (unsigned)kv.kv_heads, (unsigned)n_seqs);
    KVD_LAUNCH(grid, APM_WARPS * 32, smem, stream, attn_prefill_mma_kernel<D, DT>)
    (out, q, kv, layer, slots, slot0, pos0, qstart, n_heads, scale * KVD_LOG2E, skip_single);
    return kvd_launch_status();
}

#define APM_ARGS                                                                                   \
    out, q, kv, layer, slots, slot0, pos0, qstart, n_seqs, max_q, n_heads, scale, skip_single,     \
        stream

template <int D>
static int apm_by_dtype(float *out, const float *q, const kvd_k_kv &kv, int layer,
                        const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                        const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                        int skip_single, cudaStream_t stream)
{
    switch (kv.dtype) {
    case KVD_K_F16:
        return apm_launch<D, KVD_K_F16>(APM_ARGS);
    case KVD_K_BF16:
        return apm_launch<D, KVD_K_BF16>(APM_ARGS);
    case KVD_K_Q8_0:
        return apm_launch<D, KVD_K_Q8_0>(APM_ARGS);
    case KVD_K_FP8:
        return apm_launch<D, KVD_K_FP8>(APM_ARGS);
    default:
        return (int)cudaErrorInvalidValue;
    }
}

int kvd_attn_prefill_mma(float *out, const float *q, const kvd_k_kv &kv, int layer,
                         const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                         const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                         int skip_single, cudaStream_t stream)
{
    switch (kv.head_dim) {
    case 64:
        return apm_by_dtype<64>(APM_ARGS);
    case 128:
        return apm_by_dtype<128>(APM_ARGS);
    case 256:
        return apm_by_dtype<256>(APM_ARGS);
    default:
        return (int)cudaErrorInvalidValue;
    }
}

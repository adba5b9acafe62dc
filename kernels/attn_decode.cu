// Paged decode attention (one new query token per sequence) over KV blocks.
// GQA-aware: a thread block serves up to 8 query heads that share one KV head,
// so each K/V row is read once for the group. Long contexts are cut into
// splits processed by separate blocks (flash-decoding), merged by a second
// kernel. Scores and accumulators are f32 in the log2 domain (exp2f).
#include "kv_row.cuh"

#define AD_WARPS 4
#define AD_SPLIT_TOKENS 256 // the fewest context tokens a split is given

// The splits of one sequence whose context is len tokens, in a launch of
// n_grid splits: n_grid, but never more than its own context has pieces of
// AD_SPLIT_TOKENS. So a row's reduction order depends on its own context
// and the step's split count (which kvd_k_attn_decode_splits makes no
// larger than the longest context's pieces), not on the other rows' lengths:
// the same row alone, or as a verification row beside longer ones, is
// summed the same way.
__device__ __forceinline__ int ad_seq_splits(int len, int n_grid)
{
    int by_len = (len + AD_SPLIT_TOKENS - 1) / AD_SPLIT_TOKENS;
    return by_len < n_grid ? (by_len < 1 ? 1 : by_len) : n_grid;
}

// Partial results of split s for (seq, head): o [D] normalized, then (m, l)
// = (running max in log2 units, sum of exp2(score - m)). Layout: all o
// vectors [n_seqs][n_heads][n_splits][D], then all (m, l) pairs.
struct ad_partial {
    float *o;
    float *ml;
};

// grid (n_splits, kv_heads * q_groups, n_seqs), block AD_WARPS warps. A row
// of D elements is read by LPT = D/8 lanes, 8 elements each (16 bytes of
// bf16/f16; q8_0 and fp8 widened in registers); a warp reads 32/LPT
// consecutive tokens per step.
template <int D, int DT, int GQ>
__global__ void __launch_bounds__(AD_WARPS * 32)
    attn_decode_kernel(float *out, ad_partial part, const float *__restrict__ q, kvd_k_kv kv,
                       int layer, const uint32_t *__restrict__ slots,
                       const uint32_t *__restrict__ slot0, const uint32_t *__restrict__ pos0,
                       const uint32_t *__restrict__ qstart, int n_heads, int q_groups,
                       float scale_log2)
{
    constexpr int LPT = D / 8;
    constexpr int TPW = 32 / LPT;
    constexpr int NSUB = AD_WARPS * TPW;
    KVD_SHARED(float, sm_o, [NSUB][GQ][D]);
    KVD_SHARED(float, sm_m, [NSUB][GQ]);
    KVD_SHARED(float, sm_l, [NSUB][GQ]);

    const int split = blockIdx.x, n_grid = gridDim.x, seq = blockIdx.z;
    const int kvh = blockIdx.y / q_groups, qg = blockIdx.y % q_groups;
    const int group = n_heads / kv.kv_heads;
    const int lane = threadIdx.x & 31;
    const int sub = (threadIdx.x >> 5) * TPW + lane / LPT;
    const int sl = lane % LPT; // dims [sl*8, sl*8+8)

    // This block's query heads: h0 + j for j < nq.
    const int h0 = kvh * group + qg * GQ;
    const int nq = min(GQ, group - qg * GQ);
    // A sequence without a row this step (never from model_forward) has
    // nothing to attend and no output row; its partials stay unused.
    const uint32_t qrow = qstart[seq];
    if (qstart[seq + 1] == qrow)
        return; // uniform over the block, before any barrier
    const int len = (int)pos0[seq] + 1;
    const int n_splits = ad_seq_splits(len, n_grid);
    if (split >= n_splits)
        return; // a split this sequence does not have: uniform, before any barrier
    float qv[GQ][8];
#pragma unroll
    for (int j = 0; j < GQ; j++) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            qv[j][e] =
                j < nq ? q[((size_t)qrow * n_heads + h0 + j) * D + sl * 8 + e] * scale_log2 : 0.0f;
    }

    const int chunk = (len + n_splits - 1) / n_splits;
    const int t_begin = split * chunk, t_end = min(len, t_begin + chunk);
    const uint32_t *table = slots + slot0[seq];
    const size_t k_off = kvd_kv_row_off(kv, layer, 0, kvh, 0); // bytes
    const size_t v_off = kvd_kv_row_off(kv, layer, 1, kvh, 0);

    float m[GQ], l[GQ], acc[GQ][8];
#pragma unroll
    for (int j = 0; j < GQ; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++)
            acc[j][e] = 0.0f;
    }

    // The loop bound is uniform per warp (tw), so every lane reaches the
    // shuffles below; a subgroup past the end just has nothing to add.
    const int warp_first = (threadIdx.x >> 5) * TPW;
    for (int tw = t_begin + warp_first; tw < t_end; tw += 2 * NSUB) {
        // Two tokens per step, all four loads issued before any use.
        float kf[2][8], vf[2][8];
        bool have[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int t = tw + (sub - warp_first) + u * NSUB;
            have[u] = t < t_end;
            if (have[u]) {
                const char *blk =
                    (const char *)kv.arena + (size_t)table[t / kv.block_tokens] * kv.block_bytes;
                size_t row = (size_t)(t % kv.block_tokens) * kv.row_bytes;
                kvd_row_load8<DT>(blk + k_off + row, sl, kf[u]);
                kvd_row_load8<DT>(blk + v_off + row, sl, vf[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            // `have` is uniform within a subgroup (one token per subgroup);
            // the xor shuffles stay inside the subgroup's LPT lanes.
            float s[GQ];
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    d += qv[j][e] * (have[u] ? kf[u][e] : 0.0f);
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1)
                    d += __shfl_xor_sync(0xffffffffu, d, o);
                s[j] = d;
            }
            if (!have[u])
                continue;
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                float mn = fmaxf(m[j], s[j]);
                float corr = exp2f(m[j] - mn); // 0 on the first token (m = -inf)
                float p = exp2f(s[j] - mn);
                l[j] = l[j] * corr + p;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    acc[j][e] = acc[j][e] * corr + p * vf[u][e];
                m[j] = mn;
            }
        }
    }

    // Merge the NSUB subgroups of this block.
#pragma unroll
    for (int j = 0; j < GQ; j++) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            sm_o[sub][j][sl * 8 + e] = acc[j][e];
        if (sl == 0) {
            sm_m[sub][j] = m[j];
            sm_l[sub][j] = l[j];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nq * D; idx += AD_WARPS * 32) {
        int j = idx / D, d = idx % D;
        float M = -INFINITY;
        for (int s = 0; s < NSUB; s++)
            M = fmaxf(M, sm_m[s][j]);
        float L = 0.0f, O = 0.0f;
        if (M != -INFINITY) {
            for (int s = 0; s < NSUB; s++) {
                float w = exp2f(sm_m[s][j] - M); // 0 for empty subgroups
                L += sm_l[s][j] * w;
                O += sm_o[s][j][d] * w;
            }
        }
        float o = L > 0.0f ? O / L : 0.0f;
        if (n_splits == 1) {
            out[((size_t)qrow * n_heads + h0 + j) * D + d] = o;
        } else {
            size_t p = ((size_t)seq * n_heads + h0 + j) * n_grid + split;
            part.o[p * D + d] = o;
            if (d == 0) {
                part.ml[2 * p] = M;
                part.ml[2 * p + 1] = L;
            }
        }
    }
}

// One block per (seq, head), D threads: out = sum_s w_s o_s / sum_s w_s with
// w_s = l_s * exp2(m_s - max m), over the sequence's own splits (partials
// n_grid apart); a sequence of one split was written by the first kernel.
template <int D>
__global__ void attn_decode_merge_kernel(float *out, ad_partial part,
                                         const uint32_t *__restrict__ qstart,
                                         const uint32_t *__restrict__ pos0, int n_heads, int n_grid)
{
    size_t hrow = blockIdx.x; // seq * n_heads + head
    int d = threadIdx.x;
    int seq = (int)(hrow / n_heads), h = (int)(hrow % n_heads);
    if (qstart[seq + 1] == qstart[seq])
        return;
    const int n_splits = ad_seq_splits((int)pos0[seq] + 1, n_grid);
    if (n_splits == 1)
        return;
    const float *ml = part.ml + hrow * n_grid * 2;
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++)
        M = fmaxf(M, ml[2 * s]);
    float L = 0.0f, O = 0.0f;
    if (M != -INFINITY) {
        for (int s = 0; s < n_splits; s++) {
            float w = ml[2 * s + 1] * exp2f(ml[2 * s] - M);
            L += w;
            O += w * part.o[(hrow * n_grid + s) * D + d];
        }
    }
    out[((size_t)qstart[seq] * n_heads + h) * D + d] = L > 0.0f ? O / L : 0.0f;
}

template <int D, int DT, int GQ>
static int ad_launch(float *out, const float *q, const kvd_k_kv &kv, int layer,
                     const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                     const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                     float *partial, cudaStream_t stream)
{
    int group = n_heads / kv.kv_heads;
    int q_groups = (group + GQ - 1) / GQ;
    ad_partial part;
    part.o = partial;
    part.ml = partial + (size_t)n_seqs * n_heads * n_splits * D;
    dim3 grid((unsigned)n_splits, (unsigned)(kv.kv_heads * q_groups), (unsigned)n_seqs);
    KVD_LAUNCH(grid, AD_WARPS * 32, 0, stream, attn_decode_kernel<D, DT, GQ>)
    (out, part, q, kv, layer, slots, slot0, pos0, qstart, n_heads, q_groups, scale * KVD_LOG2E);
    int rc = kvd_launch_status();
    if (rc || n_splits == 1)
        return rc;
    KVD_LAUNCH((unsigned)(n_seqs * n_heads), D, 0, stream, attn_decode_merge_kernel<D>)
    (out, part, qstart, pos0, n_heads, n_splits);
    return kvd_launch_status();
}

template <int D, int DT>
static int ad_by_group(float *out, const float *q, const kvd_k_kv &kv, int layer,
                       const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                       const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                       float *partial, cudaStream_t stream)
{
    int group = n_heads / kv.kv_heads;
#define AD_ARGS                                                                                    \
    out, q, kv, layer, slots, slot0, pos0, qstart, n_seqs, n_heads, scale, n_splits, partial, stream
    if (group <= 1)
        return ad_launch<D, DT, 1>(AD_ARGS);
    if (group <= 2)
        return ad_launch<D, DT, 2>(AD_ARGS);
    if (group <= 4)
        return ad_launch<D, DT, 4>(AD_ARGS);
    return ad_launch<D, DT, 8>(AD_ARGS); // groups over 8 use several blocks
}

template <int D>
static int ad_by_dtype(float *out, const float *q, const kvd_k_kv &kv, int layer,
                       const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                       const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                       float *partial, cudaStream_t stream)
{
    switch (kv.dtype) {
    case KVD_K_F16:
        return ad_by_group<D, KVD_K_F16>(AD_ARGS);
    case KVD_K_BF16:
        return ad_by_group<D, KVD_K_BF16>(AD_ARGS);
    case KVD_K_F32:
        return ad_by_group<D, KVD_K_F32>(AD_ARGS);
    case KVD_K_Q8_0:
    case KVD_K_FP8:
        if constexpr (D % 32 == 0) { // quantized rows are whole 32-value blocks
            if (kv.dtype == KVD_K_Q8_0)
                return ad_by_group<D, KVD_K_Q8_0>(AD_ARGS);
            return ad_by_group<D, KVD_K_FP8>(AD_ARGS);
        }
        return (int)cudaErrorInvalidValue;
    default:
        return (int)cudaErrorInvalidValue;
    }
}

extern "C" int kvd_k_attn_supported(int head_dim)
{
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

extern "C" size_t kvd_k_attn_decode_partial_floats(int n_seqs, int n_heads, int head_dim,
                                                   int n_splits)
{
    if (n_seqs <= 0 || n_heads <= 0 || head_dim <= 0 || n_splits <= 1)
        return 0;
    return (size_t)n_seqs * n_heads * n_splits * (size_t)(head_dim + 2);
}

extern "C" int kvd_k_attn_decode_splits(int n_seqs, int kv_heads, int max_ctx, int n_sms)
{
    // Aim for about 4 blocks per multiprocessor, but give every split at
    // least AD_SPLIT_TOKENS tokens so its fixed costs (loading q, merging)
    // stay small (each sequence then takes ad_seq_splits of them).
    long pairs = (long)(n_seqs > 0 ? n_seqs : 1) * (kv_heads > 0 ? kv_heads : 1);
    long target = 4L * (n_sms > 0 ? n_sms : 132);
    long s = (target + pairs - 1) / pairs;
    long by_len = ((long)(max_ctx > 0 ? max_ctx : 1) + AD_SPLIT_TOKENS - 1) / AD_SPLIT_TOKENS;
    if (s > by_len)
        s = by_len;
    if (s > 64)
        s = 64;
    return s < 1 ? 1 : (int)s;
}

extern "C" int kvd_k_attn_decode(float *out, const float *q, const struct kvd_k_kv *kvp, int layer,
                                 const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                                 const uint32_t *qstart, int n_seqs, int n_heads, float scale,
                                 int n_splits, float *partial, kvd_stream stream)
{
    const kvd_k_kv &kv = *kvp;
    if (n_seqs < 0 || kv.kv_heads <= 0 || n_heads <= 0 || n_heads % kv.kv_heads || layer < 0 ||
        layer >= kv.layers || n_splits < 1 || n_splits > 65535 || kv.block_tokens <= 0 ||
        (n_splits > 1 && !partial))
        return (int)cudaErrorInvalidValue;
    if (n_seqs == 0)
        return 0;
    switch (kv.head_dim) {
    case 16:
        return ad_by_dtype<16>(AD_ARGS);
    case 32:
        return ad_by_dtype<32>(AD_ARGS);
    case 64:
        return ad_by_dtype<64>(AD_ARGS);
    case 128:
        return ad_by_dtype<128>(AD_ARGS);
    case 256:
        return ad_by_dtype<256>(AD_ARGS);
    default:
        return (int)cudaErrorInvalidValue;
    }
#undef AD_ARGS
}

// Paged decode attention (one new query token per sequence) over KV blocks.
// GQA-aware: a thread block serves up to 8 query heads that share one KV head,
// so each K/V row is read once for the group. Long contexts are cut into
// splits processed by separate blocks (flash-decoding), merged by the last
// of them to finish; the split count fills the device as the kernel's measured
// occupancy allows (kvd_k_attn_decode_splits). Scores and accumulators are
// f32 in the log2 domain (exp2f). The kernel is launched with
// programmatic dependent launch: it reads the step's metadata before it
// waits for rope_kv, every K/V row after. Query groups of 4 and 8 at
// head_dim 64 and 128 with f16, bf16 or q8_0 rows run on tensor cores
// (attn_decode_mma.cuh), with the same splits, loads order and merge.
#include <atomic>
#include <stdio.h>

#include "kv_row.cuh"
#include "occupancy.cuh"

#define AD_WARPS 4
#define AD_SPLIT_TOKENS 64 // the fewest context tokens a split is given
#define AD_MAX_SPLITS 128  // splits per sequence at most (the partials' size)
// Steps of rows in flight ahead of the one being used: two where the
// registers allow it (query groups of up to 4 heads, rows of at most 2
// bytes a value), else one (8 heads' accumulators alone take ~200
// registers; an f32 row's share is 8 registers, twice a 16-bit one's).
#define AD_PREFETCH(GQ, DT) ((GQ) <= 4 && (DT) != KVD_K_F32 ? 2 : 1)

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

// One lane's share of a K or V row (values [8 sl, 8 sl + 8)) as loaded,
// widened to f32 only when used, so the next step's rows are in flight while
// this step's are used. The widening is kvd_row_load8's (the cpu's bits).
template <int DT> struct ad_raw {
    uint4 w; // f16, bf16: 16 bytes
};
template <> struct ad_raw<KVD_K_F32> {
    float4 a, b;
};
template <> struct ad_raw<KVD_K_Q8_0> {
    uint32_t d;    // the block's f16 scale
    uint32_t q[4]; // 8 int8 values, 2-byte aligned: 4 two-byte loads
};
template <> struct ad_raw<KVD_K_FP8> {
    float s; // the row's scale
    uint2 q; // 8 e4m3 bytes (loaded as two words: 4-byte aligned)
};

template <int DT>
static __device__ __forceinline__ void ad_load(ad_raw<DT> &r, const char *row, int sl)
{
    if constexpr (DT == KVD_K_F32) {
        // (Fields copied one by one: a struct copy compiles to memmove in
        // the emulation build, which its memory checks do not see.)
        const float4 *f = (const float4 *)(row + (size_t)sl * 32);
        const float4 a = f[0], b = f[1];
        r.a = make_float4(a.x, a.y, a.z, a.w);
        r.b = make_float4(b.x, b.y, b.z, b.w);
    } else if constexpr (DT == KVD_K_Q8_0) {
        const char *b = row + (size_t)(sl >> 2) * 34;
        r.d = *(const uint16_t *)b;
        const uint16_t *q = (const uint16_t *)(b + 2 + (sl & 3) * 8);
#pragma unroll
        for (int i = 0; i < 4; i++)
            r.q[i] = q[i];
    } else if constexpr (DT == KVD_K_FP8) {
        // Two 4-byte loads: the bytes follow the 4-byte scale, so they are
        // only 4-byte aligned (an 8-byte load would fault on a device).
        r.s = *(const float *)row;
        const uint32_t *q = (const uint32_t *)(row + 4 + sl * 8);
        r.q.x = q[0];
        r.q.y = q[1];
    } else {
        const uint4 w = *(const uint4 *)(row + (size_t)sl * 16);
        r.w = make_uint4(w.x, w.y, w.z, w.w);
    }
}

template <int DT> static __device__ __forceinline__ void ad_widen(const ad_raw<DT> &r, float *o)
{
    if constexpr (DT == KVD_K_F32) {
        o[0] = r.a.x;
        o[1] = r.a.y;
        o[2] = r.a.z;
        o[3] = r.a.w;
        o[4] = r.b.x;
        o[5] = r.b.y;
        o[6] = r.b.z;
        o[7] = r.b.w;
    } else if constexpr (DT == KVD_K_Q8_0) {
        const float d = kvd_f16_to_f32((uint16_t)r.d);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[2 * i] = d * (float)(int8_t)(r.q[i] & 0xffu);
            o[2 * i + 1] = d * (float)(int8_t)(r.q[i] >> 8);
        }
    } else if constexpr (DT == KVD_K_FP8) {
        const uint32_t w[2] = {r.q.x, r.q.y};
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                o[4 * i + j] = r.s * kvd_e4m3_to_f32((w[i] >> (8 * j)) & 0xffu);
    } else {
        const uint32_t w[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint16_t lo = (uint16_t)(w[i] & 0xffffu), hi = (uint16_t)(w[i] >> 16);
            o[2 * i] = DT == KVD_K_BF16 ? kvd_bf16_to_f32(lo) : kvd_f16_to_f32(lo);
            o[2 * i + 1] = DT == KVD_K_BF16 ? kvd_bf16_to_f32(hi) : kvd_f16_to_f32(hi);
        }
    }
}

// Partial results of split s for (seq, head): o [D] normalized, then (m, l)
// = (running max in log2 units, sum of exp2(score - m)). Layout: all o
// vectors [n_seqs][n_heads][n_splits][D], then all (m, l) pairs; done: a
// counter per (seq, block row of the grid), 0 before a launch and after it.
struct ad_partial {
    float *o;
    float *ml;
    unsigned *done; // per (sequence, query-head group): splits finished
};

// The end of a block's work: the subgroups' (NSUB) partial results for its
// nq query heads (unnormalized o, running max m and sum l, in shared memory
// after a barrier) merged into the block's result for its split, written to
// out (one split) or to the partials, and the last split of the sequence to
// finish merges the splits' partials into out.
template <int D, int GQ, int NSUB>
static __device__ __forceinline__ void
ad_finish(const float (&sm_o)[NSUB][GQ][D], const float (&sm_m)[NSUB][GQ],
          const float (&sm_l)[NSUB][GQ], float *out, const ad_partial &part, int seq, int split,
          int n_splits, uint32_t qrow, int n_heads, int h0, int nq)
{
    KVD_SHARED(int, ad_last, );
    const int n_grid = gridDim.x;
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
    if (n_splits == 1)
        return;

    // The last of the sequence's splits of these heads to finish merges
    // them: out = sum_s w_s o_s / sum_s w_s with w_s = l_s * exp2(m_s - max
    // m), over the sequence's own splits (partials n_grid apart), in split
    // order whichever block is last (no merge launch).
    __threadfence(); // this thread's partials, before the count says so
    __syncthreads();
    unsigned *done = part.done + (size_t)seq * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0)
        ad_last = atomicAdd(done, 1u) == (unsigned)n_splits - 1;
    __syncthreads();
    if (!ad_last)
        return;
    __threadfence(); // the other splits' partials, after their count
    for (int idx = threadIdx.x; idx < nq * D; idx += AD_WARPS * 32) {
        const int j = idx / D, d = idx % D;
        const size_t hrow = (size_t)seq * n_heads + h0 + j;
        const float *ml = part.ml + hrow * n_grid * 2;
        float M = -INFINITY;
        for (int s = 0; s < n_splits; s++)
            M = fmaxf(M, __ldcg(ml + 2 * s));
        float L = 0.0f, O = 0.0f;
        if (M != -INFINITY) {
            for (int s = 0; s < n_splits; s++) {
                const float w = __ldcg(ml + 2 * s + 1) * exp2f(__ldcg(ml + 2 * s) - M);
                L += w;
                O += w * __ldcg(part.o + (hrow * n_grid + s) * D + d);
            }
        }
        out[((size_t)qrow * n_heads + h0 + j) * D + d] = L > 0.0f ? O / L : 0.0f;
    }
    if (threadIdx.x == 0)
        *done = 0; // for the next launch
}

// The tensor-core kernel for query groups of 4 and 8 (its own file).
#include "attn_decode_mma.cuh"

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
                       float scale_log2, int early)
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
    // Only sequences of exactly one row: one without a row (never from
    // model_forward) has nothing to attend; one of several rows in a mixed
    // step is the prefill kernel's. Their partials stay unused.
    const uint32_t qrow = qstart[seq];
    if (qstart[seq + 1] - qrow != 1)
        return; // uniform over the block, before any barrier
    const int len = (int)pos0[seq] + 1;
    const int n_splits = ad_seq_splits(len, n_grid);
    if (split >= n_splits)
        return; // a split this sequence does not have: uniform, before any barrier
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

    // Two tokens per subgroup per step (one tile: the running max and the
    // rescale of the accumulators once per tile), and the rows of the PF
    // steps after it in flight while a step's are used: a block waits on
    // HBM about once per PF steps, not once per step. The steps' rows go
    // round a ring of PF + 1 register sets, the loop unrolled over the ring
    // so that each set's index is known at compile time (registers, not
    // local memory). The loop bound is uniform per warp (tw), so every lane
    // reaches the shuffles below; a subgroup past the end just has nothing
    // to add.
    constexpr int PF = AD_PREFETCH(GQ, DT), NB = PF + 1;
    constexpr int STEP = 2 * NSUB; // tokens of one step of the block
    const int warp_first = (threadIdx.x >> 5) * TPW;
    struct ad_step {
        ad_raw<DT> k[2], v[2];
        bool have[2];
    };
    ad_step ring[NB];
    auto load_row = [&](ad_step &b, int u, int t) {
        const char *blk =
            (const char *)kv.arena + (size_t)table[t / kv.block_tokens] * kv.block_bytes;
        const size_t row = (size_t)(t % kv.block_tokens) * kv.row_bytes;
        ad_load<DT>(b.k[u], blk + k_off + row, sl);
        ad_load<DT>(b.v[u], blk + v_off + row, sl);
    };
    auto load_step = [&](ad_step &b, int tw, int lim) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int t = tw + (sub - warp_first) + u * NSUB;
            b.have[u] = t < lim;
            if (b.have[u])
                load_row(b, u, t);
        }
    };
    // Programmatic dependent launch: the step's metadata (above) was
    // uploaded before the step and may be read while rope_kv, the kernel
    // before, still runs. rope_kv writes the new token's K/V row, and a
    // verification step's rows (one-row decodes over one table) read the
    // rows of the tokens drafted before them, written in the same step: so
    // in general no K/V row is read before the wait. In a plain decode step
    // (early: every sequence one row, its own) the rows before the newest
    // were written by earlier steps: the first steps' rows but the newest
    // are loaded before the wait, the newest (t = len - 1) after it.
    const int t_first = t_begin + warp_first;
    // Not for head_dim 256 nor f32 rows: there the early loads' registers
    // made ptxas spill (sm_90: <256, f16, GQ 2>, <256, f32, GQ 8>; sm_80
    // also f32 GQ 8 at every head_dim); those instances keep the order of
    // a verification step.
    constexpr bool EARLY_OK = D <= 128 && DT != KVD_K_F32;
    if (EARLY_OK && early) {
#pragma unroll
        for (int i = 0; i < PF; i++)
            load_step(ring[i], t_first + i * STEP, min(t_end, len - 1));
    }
    kvd_pdl_wait();
    kvd_pdl_trigger();
#pragma unroll
    for (int i = 0; i < PF; i++) {
        // if constexpr: an instance without early loads compiles no dead
        // loop (nvcc warns that it is unreachable).
        if constexpr (EARLY_OK) {
            if (early) {
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const int t = t_first + i * STEP + (sub - warp_first) + u * NSUB;
                    if (t == len - 1 && t < t_end) {
                        ring[i].have[u] = true;
                        load_row(ring[i], u, t);
                    }
                }
                continue;
            }
        }
        load_step(ring[i], t_first + i * STEP, t_end);
    }
    float qv[GQ][8];
#pragma unroll
    for (int j = 0; j < GQ; j++) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            qv[j][e] =
                j < nq ? q[((size_t)qrow * n_heads + h0 + j) * D + sl * 8 + e] * scale_log2 : 0.0f;
    }
    // One step: the tile's two tokens from set c.
    auto step = [&](const ad_step &c) {
        // Scores of the tile's two tokens. `have` is uniform within a
        // subgroup (one token per subgroup); the xor shuffles stay inside
        // the subgroup's LPT lanes.
        float s[2][GQ];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float kf[8];
            ad_widen<DT>(c.k[u], kf);
#pragma unroll
            for (int j = 0; j < GQ; j++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    d += qv[j][e] * (c.have[u] ? kf[e] : 0.0f);
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1)
                    d += __shfl_xor_sync(0xffffffffu, d, o);
                s[u][j] = d;
            }
        }
        if (!c.have[0])
            return; // (have[1] implies have[0])
        // A second token past the end has no row loaded (its registers may
        // hold anything, NaN included): zeros, so p1 * v stays 0.
        float vf[2][8];
        ad_widen<DT>(c.v[0], vf[0]);
        if (c.have[1])
            ad_widen<DT>(c.v[1], vf[1]);
        else
#pragma unroll
            for (int e = 0; e < 8; e++)
                vf[1][e] = 0.0f;
#pragma unroll
        for (int j = 0; j < GQ; j++) {
            const float mn = fmaxf(m[j], c.have[1] ? fmaxf(s[0][j], s[1][j]) : s[0][j]);
            const float corr = exp2f(m[j] - mn); // 0 on the first tile (m = -inf)
            const float p0 = exp2f(s[0][j] - mn), p1 = c.have[1] ? exp2f(s[1][j] - mn) : 0.0f;
            l[j] = l[j] * corr + p0 + p1;
#pragma unroll
            for (int e = 0; e < 8; e++)
                acc[j][e] = acc[j][e] * corr + p0 * vf[0][e] + p1 * vf[1][e];
            m[j] = mn;
        }
    };
    for (int tw = t_first; tw < t_end; tw += NB * STEP) {
#pragma unroll
        for (int i = 0; i < NB; i++) {
            const int ts = tw + i * STEP;
            if (ts >= t_end)
                break;
            // Set (i + PF) % NB held the step before this one: free again.
            if (ts + PF * STEP < t_end)
                load_step(ring[(i + PF) % NB], ts + PF * STEP, t_end);
            step(ring[i]);
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
    ad_finish<D, GQ, NSUB>(sm_o, sm_m, sm_l, out, part, seq, split, n_splits, qrow, n_heads, h0,
                           nq);
}

template <int D, int DT, int GQ>
static int ad_launch(float *out, const float *q, const kvd_k_kv &kv, int layer,
                     const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                     const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                     float *partial, unsigned *done, int early, cudaStream_t stream)
{
    int group = n_heads / kv.kv_heads;
    int q_groups = (group + GQ - 1) / GQ;
    ad_partial part;
    part.o = partial;
    part.ml = partial + (size_t)n_seqs * n_heads * n_splits * D;
    part.done = done;
    dim3 grid((unsigned)n_splits, (unsigned)(kv.kv_heads * q_groups), (unsigned)n_seqs);
    if constexpr (AD_MMA(D, DT, GQ)) {
        KVD_LAUNCH_PDL(grid, AD_WARPS * 32, 0, stream, attn_decode_mma_kernel<D, DT, GQ>)
        (out, part, q, kv, layer, slots, slot0, pos0, qstart, n_heads, q_groups, scale * KVD_LOG2E,
         early);
    } else {
        KVD_LAUNCH_PDL(grid, AD_WARPS * 32, 0, stream, attn_decode_kernel<D, DT, GQ>)
        (out, part, q, kv, layer, slots, slot0, pos0, qstart, n_heads, q_groups, scale * KVD_LOG2E,
         early);
    }
    return kvd_launch_status();
}

template <int D, int DT>
static int ad_by_group(float *out, const float *q, const kvd_k_kv &kv, int layer,
                       const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                       const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                       float *partial, unsigned *done, int early, cudaStream_t stream)
{
    int group = n_heads / kv.kv_heads;
#define AD_ARGS                                                                                    \
    out, q, kv, layer, slots, slot0, pos0, qstart, n_seqs, n_heads, scale, n_splits, partial,      \
        done, early, stream
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
                       float *partial, unsigned *done, int early, cudaStream_t stream)
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

// The blocks of attn_decode_kernel<D, DT, GQ> resident per multiprocessor
// of the current device, asked once per device and instance.
template <int D, int DT, int GQ> static int ad_blocks_per_sm(void)
{
    static std::atomic<int> known[64]; // per device: blocks + 1, 0 = not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        dev = 0;
    if (dev >= 0 && dev < 64 && known[dev].load(std::memory_order_relaxed))
        return known[dev].load(std::memory_order_relaxed) - 1;
    char name[64];
    snprintf(name, sizeof name, "%s<%d, %d, %d>",
             AD_MMA(D, DT, GQ) ? "attn_decode_mma_kernel" : "attn_decode_kernel", D, DT, GQ);
    int n = 0;
    int rc;
    if constexpr (AD_MMA(D, DT, GQ))
        rc = kvd_occupancy(&n, attn_decode_mma_kernel<D, DT, GQ>, name, AD_WARPS * 32, 0);
    else
        rc = kvd_occupancy(&n, attn_decode_kernel<D, DT, GQ>, name, AD_WARPS * 32, 0);
    if (rc) {
        (void)cudaGetLastError();
        return -1;
    }
    if (dev >= 0 && dev < 64)
        known[dev].store(n + 1, std::memory_order_relaxed);
    return n;
}

template <int D, int DT> static int ad_occ_by_group(int group)
{
    if (group <= 1)
        return ad_blocks_per_sm<D, DT, 1>();
    if (group <= 2)
        return ad_blocks_per_sm<D, DT, 2>();
    if (group <= 4)
        return ad_blocks_per_sm<D, DT, 4>();
    return ad_blocks_per_sm<D, DT, 8>();
}

template <int D> static int ad_occ_by_dtype(int dtype, int group)
{
    switch (dtype) {
    case KVD_K_F16:
        return ad_occ_by_group<D, KVD_K_F16>(group);
    case KVD_K_BF16:
        return ad_occ_by_group<D, KVD_K_BF16>(group);
    case KVD_K_F32:
        return ad_occ_by_group<D, KVD_K_F32>(group);
    case KVD_K_Q8_0:
    case KVD_K_FP8:
        if constexpr (D % 32 == 0) {
            if (dtype == KVD_K_Q8_0)
                return ad_occ_by_group<D, KVD_K_Q8_0>(group);
            return ad_occ_by_group<D, KVD_K_FP8>(group);
        }
        return -1;
    default:
        return -1;
    }
}

extern "C" int kvd_k_attn_decode_blocks_per_sm(int head_dim, int dtype, int group)
{
    switch (head_dim) {
    case 16:
        return ad_occ_by_dtype<16>(dtype, group);
    case 32:
        return ad_occ_by_dtype<32>(dtype, group);
    case 64:
        return ad_occ_by_dtype<64>(dtype, group);
    case 128:
        return ad_occ_by_dtype<128>(dtype, group);
    case 256:
        return ad_occ_by_dtype<256>(dtype, group);
    default:
        return -1;
    }
}

extern "C" int kvd_k_attn_decode_splits(int n_seqs, int n_heads, const struct kvd_k_kv *kv,
                                        int max_ctx, int n_sms)
{
    // One wave at most: as many blocks as the device holds at once (the
    // kernel's occupancy times the multiprocessors) over the launch's
    // (sequence, KV head, query-head group) items, rounded down (blocks of
    // equal work: a few past the wave would double the time), but no split
    // shorter than AD_SPLIT_TOKENS tokens of the longest context (each
    // sequence then takes ad_seq_splits of them).
    const int group = kv->kv_heads > 0 && n_heads > 0 ? n_heads / kv->kv_heads : 1;
    const long q_groups = group > 8 ? (group + 7) / 8 : 1; // blocks per KV head
    int per_sm = kvd_k_attn_decode_blocks_per_sm(kv->head_dim, kv->dtype, group);
    if (per_sm < 1)
        per_sm = 1; // unknown (an error already reported): still a valid count
    const long items =
        (long)(n_seqs > 0 ? n_seqs : 1) * (kv->kv_heads > 0 ? kv->kv_heads : 1) * q_groups;
    const long resident = (long)per_sm * (n_sms > 0 ? n_sms : 1);
    long s = resident / items;
    const long by_len = ((long)(max_ctx > 0 ? max_ctx : 1) + AD_SPLIT_TOKENS - 1) / AD_SPLIT_TOKENS;
    if (s > by_len)
        s = by_len;
    if (s > AD_MAX_SPLITS)
        s = AD_MAX_SPLITS;
    return s < 1 ? 1 : (int)s;
}

extern "C" int kvd_k_attn_decode(float *out, const float *q, const struct kvd_k_kv *kvp, int layer,
                                 const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                                 const uint32_t *qstart, int n_seqs, int n_heads, float scale,
                                 int n_splits, float *partial, unsigned *done, int early,
                                 kvd_stream stream)
{
    const kvd_k_kv &kv = *kvp;
    if (n_seqs < 0 || kv.kv_heads <= 0 || n_heads <= 0 || n_heads % kv.kv_heads || layer < 0 ||
        layer >= kv.layers || n_splits < 1 || n_splits > 65535 || kv.block_tokens <= 0 ||
        (n_splits > 1 && (!partial || !done)))
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

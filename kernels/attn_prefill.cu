// Prefill (and mixed-batch) attention over paged KV: the new query rows of
// each sequence attend to its cached prefix and causally to the new tokens,
// whose K/V are already written to the blocks. kvd_k_attn_prefill sends the
// 16-bit and quantized KV dtypes at head_dim 64-256 to the tensor-core
// kernel (attn_prefill_mma.cu); this file's kernel takes the rest (f32 KV,
// head_dim 16 and 32) on CUDA cores: key tiles of AP_BK tokens staged in
// shared memory as f32, online softmax per query row, f32 accumulation.
#include "attn_prefill.cuh"
#include "kv_row.cuh"

#define AP_WARPS 4
#define AP_ROWS 8                  // query rows per warp
#define AP_BK 32                   // keys per tile (one per lane)
#define AP_BR (AP_WARPS * AP_ROWS) // query rows per block

// Shared memory: q [AP_BR][D] (scaled to log2 units), K tile [AP_BK][D+1]
// (padded: lane j reads row j, column d, bank-conflict free), V [AP_BK][D].
template <int D> static constexpr size_t ap_smem_bytes()
{
    return sizeof(float) * ((size_t)AP_BR * D + (size_t)AP_BK * (D + 1) + (size_t)AP_BK * D);
}

// grid (row tiles, kv_heads, n_seqs). Block rows enumerate (query token,
// head of the kv head's group) with the group innermost, so the rows of one
// token share every K/V tile.
template <int D, int DT>
__global__ void __launch_bounds__(AP_WARPS * 32)
    attn_prefill_kernel(float *out, const float *__restrict__ q, kvd_k_kv kv, int layer,
                        const uint32_t *__restrict__ slots, const uint32_t *__restrict__ slot0,
                        const uint32_t *__restrict__ pos0, const uint32_t *__restrict__ qstart,
                        int n_heads, float scale_log2, int skip_single)
{
    KVD_DYN_SHARED(float, ap_smem);
    float *sq = ap_smem;
    float *sk = sq + AP_BR * D;
    float *sv = sk + AP_BK * (D + 1);

    const int seq = blockIdx.z, kvh = blockIdx.y;
    const int group = n_heads / kv.kv_heads;
    const int q0 = (int)qstart[seq], n_new = (int)qstart[seq + 1] - q0;
    const int rows_total = n_new * group;
    const int row0 = blockIdx.x * AP_BR;
    if (row0 >= rows_total || n_new <= 0 || (skip_single && n_new == 1))
        return;                           // whole block idle: uniform, before any barrier
    const int first_pos = (int)pos0[seq]; // position of query token 0
    const uint32_t *table = slots + slot0[seq];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // Stage the block's query rows.
    for (int idx = threadIdx.x; idx < AP_BR * D; idx += AP_WARPS * 32) {
        int r = row0 + idx / D, d = idx % D;
        float v = 0.0f;
        if (r < rows_total) {
            int tok = r / group, h = kvh * group + r % group;
            v = q[((size_t)(q0 + tok) * n_heads + h) * D + d] * scale_log2;
        }
        sq[idx] = v;
    }
    // Keys needed: up to the last row's position (inclusive).
    const int last_row = min(row0 + AP_BR, rows_total) - 1;
    const int k_end = first_pos + last_row / group + 1;

    // Lane owns output columns c*32 + lane (for D = 16, lanes 16..31 none).
    constexpr int NC = D >= 32 ? D / 32 : 1;
    const bool col_ok = D >= 32 || lane < D;
    float m[AP_ROWS], l[AP_ROWS], acc[AP_ROWS][NC];
    int pos[AP_ROWS];
#pragma unroll
    for (int r = 0; r < AP_ROWS; r++) {
        int gr = row0 + warp * AP_ROWS + r;
        pos[r] = gr < rows_total ? first_pos + gr / group : -1; // -1: padding row
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < NC; c++)
            acc[r][c] = 0.0f;
    }
    const size_t k_off = kvd_kv_row_off(kv, layer, 0, kvh, 0); // bytes
    const size_t v_off = kvd_kv_row_off(kv, layer, 1, kvh, 0);

    for (int k0 = 0; k0 < k_end; k0 += AP_BK) {
        __syncthreads(); // previous tile fully used (and q staged, first time)
        for (int idx = threadIdx.x; idx < AP_BK * D; idx += AP_WARPS * 32) {
            int j = idx / D, d = idx % D, t = k0 + j;
            float kx = 0.0f, vx = 0.0f;
            if (t < k_end) {
                const char *blk =
                    (const char *)kv.arena + (size_t)table[t / kv.block_tokens] * kv.block_bytes;
                size_t row = (size_t)(t % kv.block_tokens) * kv.row_bytes;
                kx = kvd_row_load1<DT>(blk + k_off + row, d);
                vx = kvd_row_load1<DT>(blk + v_off + row, d);
            }
            sk[j * (D + 1) + d] = kx;
            sv[j * D + d] = vx;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < AP_ROWS; r++) {
            if (pos[r] < k0) // warp-uniform: row padding or entirely masked tile
                continue;
            const float *qr = sq + (warp * AP_ROWS + r) * D;
            const float *kr = sk + lane * (D + 1);
            float s = 0.0f;
#pragma unroll 16
            for (int d = 0; d < D; d++)
                s += qr[d] * kr[d];
            if (k0 + lane > pos[r])
                s = -INFINITY;                       // causal mask (also covers keys past k_end)
            float mn = fmaxf(m[r], kvd_warp_max(s)); // finite: key k0 <= pos[r]
            float corr = exp2f(m[r] - mn);
            float p = exp2f(s - mn);
            l[r] = l[r] * corr + kvd_warp_sum(p);
#pragma unroll
            for (int c = 0; c < NC; c++)
                acc[r][c] *= corr;
            for (int j = 0; j < AP_BK; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int c = 0; c < NC; c++)
                    acc[r][c] += col_ok ? pj * sv[j * D + c * 32 + lane] : 0.0f;
            }
            m[r] = mn;
        }
    }
#pragma unroll
    for (int r = 0; r < AP_ROWS; r++) {
        int gr = row0 + warp * AP_ROWS + r;
        if (gr >= rows_total)
            continue;
        int tok = gr / group, h = kvh * group + gr % group;
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *o = out + ((size_t)(q0 + tok) * n_heads + h) * D;
#pragma unroll
        for (int c = 0; c < NC; c++)
            if (col_ok)
                o[c * 32 + lane] = acc[r][c] * inv;
    }
}

template <int D, int DT>
static int ap_launch(float *out, const float *q, const kvd_k_kv &kv, int layer,
                     const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                     const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                     int skip_single, cudaStream_t stream)
{
    static std::atomic<unsigned long long> optin{0};
    const size_t smem = ap_smem_bytes<D>();
    int rc = kvd_smem_optin(attn_prefill_kernel<D, DT>, smem, optin);
    if (rc)
        return rc;
    int group = n_heads / kv.kv_heads;
    long rows = (long)max_q * group;
    dim3 grid((unsigned)((rows + AP_BR - 1) / AP_BR), (unsigned)kv.kv_heads, (unsigned)n_seqs);
    KVD_LAUNCH(grid, AP_WARPS * 32, smem, stream, attn_prefill_kernel<D, DT>)
    (out, q, kv, layer, slots, slot0, pos0, qstart, n_heads, scale * KVD_LOG2E, skip_single);
    return kvd_launch_status();
}

#define AP_ARGS                                                                                    \
    out, q, kv, layer, slots, slot0, pos0, qstart, n_seqs, max_q, n_heads, scale, skip_single,     \
        stream

// Only the instances the tensor-core kernel leaves to this one: f32 KV at
// every head_dim, every dtype at 16 and 32.
template <int D>
static int ap_by_dtype(float *out, const float *q, const kvd_k_kv &kv, int layer,
                       const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                       const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                       int skip_single, cudaStream_t stream)
{
    if constexpr (D >= 64) {
        if (kv.dtype == KVD_K_F32)
            return ap_launch<D, KVD_K_F32>(AP_ARGS);
        return (int)cudaErrorInvalidValue;
    } else {
        switch (kv.dtype) {
        case KVD_K_F16:
            return ap_launch<D, KVD_K_F16>(AP_ARGS);
        case KVD_K_BF16:
            return ap_launch<D, KVD_K_BF16>(AP_ARGS);
        case KVD_K_F32:
            return ap_launch<D, KVD_K_F32>(AP_ARGS);
        case KVD_K_Q8_0:
        case KVD_K_FP8:
            if constexpr (D % 32 == 0) { // quantized rows are whole 32-value blocks
                if (kv.dtype == KVD_K_Q8_0)
                    return ap_launch<D, KVD_K_Q8_0>(AP_ARGS);
                return ap_launch<D, KVD_K_FP8>(AP_ARGS);
            }
            return (int)cudaErrorInvalidValue;
        default:
            return (int)cudaErrorInvalidValue;
        }
    }
}

extern "C" int kvd_k_attn_prefill(float *out, const float *q, const struct kvd_k_kv *kvp, int layer,
                                  const uint32_t *slots, const uint32_t *slot0,
                                  const uint32_t *pos0, const uint32_t *qstart, int n_seqs,
                                  int max_q, int n_heads, float scale, int skip_single,
                                  kvd_stream stream)
{
    const kvd_k_kv &kv = *kvp;
    if (n_seqs < 0 || max_q < 0 || kv.kv_heads <= 0 || n_heads <= 0 || n_heads % kv.kv_heads ||
        layer < 0 || layer >= kv.layers || kv.block_tokens <= 0)
        return (int)cudaErrorInvalidValue;
    if (n_seqs == 0 || max_q == 0)
        return 0;
    if (kvd_attn_prefill_mma_ok(kv.head_dim, kv.dtype))
        return kvd_attn_prefill_mma(out, q, kv, layer, slots, slot0, pos0, qstart, n_seqs, max_q,
                                    n_heads, scale, skip_single, stream);
    switch (kv.head_dim) {
    case 16:
        return ap_by_dtype<16>(AP_ARGS);
    case 32:
        return ap_by_dtype<32>(AP_ARGS);
    case 64:
        return ap_by_dtype<64>(AP_ARGS);
    case 128:
        return ap_by_dtype<128>(AP_ARGS);
    case 256:
        return ap_by_dtype<256>(AP_ARGS);
    default:
        return (int)cudaErrorInvalidValue;
    }
}

// Writes the new tokens' K and V (f32, just projected and rotated) of one
// layer into their KV blocks, converting to the cache dtype (q8_0 and fp8:
// quantizing each row, kv_row.cuh).
#include "kv_row.cuh"

// One block per token; k, v [n_tokens][kv_heads][head_dim].
template <int DT>
__global__ void kv_write_kernel(kvd_k_kv kv, int layer, const uint32_t *__restrict__ slots,
                                const uint32_t *__restrict__ pos, const float *__restrict__ k,
                                const float *__restrict__ v)
{
    int t = blockIdx.x;
    uint32_t slot = slots[t];
    int row = (int)(pos[t] % (uint32_t)kv.block_tokens);
    if (slot == UINT32_MAX)
        return; // padding row of a graph bucket: writes nothing
    char *blk = (char *)kv.arena + (size_t)slot * kv.block_bytes;
    int per = kv.kv_heads * kv.head_dim;
    const float *kt = k + (size_t)t * per, *vt = v + (size_t)t * per;
    for (int e = threadIdx.x; e < per; e += blockDim.x) {
        int h = e / kv.head_dim, d = e % kv.head_dim;
        kvd_store1<DT>(blk, kvd_kv_off(kv, layer, 0, h, row) + d, kt[e]);
        kvd_store1<DT>(blk, kvd_kv_off(kv, layer, 1, h, row) + d, vt[e]);
    }
}

// One block per token, one warp per 32-value q8_0 block at a time: the warp
// finds its block's amax and writes d and the 32 q.
__global__ void kv_write_q8_0_kernel(kvd_k_kv kv, int layer, const uint32_t *__restrict__ slots,
                                     const uint32_t *__restrict__ pos, const float *__restrict__ k,
                                     const float *__restrict__ v)
{
    int t = blockIdx.x;
    uint32_t slot = slots[t];
    int row = (int)(pos[t] % (uint32_t)kv.block_tokens);
    if (slot == UINT32_MAX)
        return;
    char *blk = (char *)kv.arena + (size_t)slot * kv.block_bytes;
    int nb = kv.head_dim / 32, per = kv.kv_heads * kv.head_dim;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    // group g: K (g < kv_heads*nb) or V; head h; block b of the row
    for (int g = warp; g < 2 * kv.kv_heads * nb; g += n_warps) {
        int sel = g / (kv.kv_heads * nb), h = g / nb % kv.kv_heads, b = g % nb;
        const float *src = (sel ? v : k) + (size_t)t * per + (size_t)h * kv.head_dim;
        kvd_q8_0_store_warp(blk + kvd_kv_row_off(kv, layer, sel, h, row) + (size_t)b * 34,
                            src[b * 32 + lane], lane);
    }
}

// One block per token, one warp per fp8 row at a time: the row's amax over
// its finite values gives the scale, then every value is converted.
__global__ void kv_write_fp8_kernel(kvd_k_kv kv, int layer, const uint32_t *__restrict__ slots,
                                    const uint32_t *__restrict__ pos, const float *__restrict__ k,
                                    const float *__restrict__ v)
{
    int t = blockIdx.x;
    uint32_t slot = slots[t];
    int row = (int)(pos[t] % (uint32_t)kv.block_tokens);
    if (slot == UINT32_MAX)
        return;
    char *blk = (char *)kv.arena + (size_t)slot * kv.block_bytes;
    int per = kv.kv_heads * kv.head_dim;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int r = warp; r < 2 * kv.kv_heads; r += n_warps) {
        int sel = r / kv.kv_heads, h = r % kv.kv_heads;
        const float *src = (sel ? v : k) + (size_t)t * per + (size_t)h * kv.head_dim;
        char *dst = blk + kvd_kv_row_off(kv, layer, sel, h, row);
        float amax = 0.0f;
        for (int d = lane; d < kv.head_dim; d += 32) {
            float a = fabsf(src[d]);
            if (a <= KVD_F32_MAX)
                amax = fmaxf(amax, a);
        }
        amax = kvd_warp_max(amax);
        float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
        if (lane == 0)
            *(float *)dst = amax / 448.0f;
        for (int d = lane; d < kv.head_dim; d += 32)
            dst[4 + d] = (char)kvd_e4m3_from_f32(src[d] * inv);
    }
}

extern "C" int kvd_k_kv_write(const struct kvd_k_kv *kv, int layer, const uint32_t *slots,
                              const uint32_t *pos, const float *k, const float *v, int n_tokens,
                              kvd_stream stream)
{
    if (n_tokens < 0 || layer < 0 || layer >= kv->layers || kv->block_tokens <= 0 ||
        ((kv->dtype == KVD_K_Q8_0 || kv->dtype == KVD_K_FP8) && kv->head_dim % 32))
        return (int)cudaErrorInvalidValue;
    if (n_tokens == 0)
        return 0;
    switch (kv->dtype) {
    case KVD_K_F16:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_F16>)
        (*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_BF16:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_BF16>)
        (*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_F32:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_F32>)
        (*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_Q8_0:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_q8_0_kernel)(*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_FP8:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_fp8_kernel)(*kv, layer, slots, pos, k, v);
        break;
    default:
        return (int)cudaErrorInvalidValue;
    }
    return kvd_launch_status();
}

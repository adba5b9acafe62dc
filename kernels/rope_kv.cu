// RoPE of the step's q and k fused with the write of k and v into the KV
// blocks: one launch for the chain rope(q); rope(k); kv_write(k, v), with
// the cpu backend's arithmetic for both (kernel_util.cuh, kv_row.cuh).
#include "kv_row.cuh"

// One block per token: every (pair, chunk of 8 heads) of its q and k heads
// rotated in place (the angle once per pair, the chunk's loads together),
// then, after a barrier, its k and v rows written to the token's block.
// q [n_tokens][n_heads][head_dim]; k, v [n_tokens][kv_heads][head_dim].
template <int DT>
__global__ void rope_kv_kernel(float *q, float *k, const float *__restrict__ v,
                               const uint32_t *__restrict__ pos, const uint32_t *__restrict__ slots,
                               int n_heads, kvd_k_kv kv, int layer, int n_rot, float base,
                               const float *__restrict__ ff, int neox)
{
    kvd_pdl_wait(); // q, k, v: the projection's
    kvd_pdl_trigger();
    const int t = blockIdx.x, D = kv.head_dim, HK = kv.kv_heads, half = n_rot / 2;
    const int heads = n_heads + HK, chunks = (heads + 7) / 8;
    const uint32_t p = pos[t];
    float *qt = q + (size_t)t * n_heads * D, *kt = k + (size_t)t * HK * D;
    for (int item = threadIdx.x; item < half * chunks; item += blockDim.x) {
        const int i = item % half, ck = item / half;
        float c, s;
        kvd_rope_cs(p, i, n_rot, base, ff, &c, &s);
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float va[8], vb[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int hh = ck * 8 + j < heads ? ck * 8 + j : 0;
            const float *h = hh < n_heads ? qt + (size_t)hh * D : kt + (size_t)(hh - n_heads) * D;
            va[j] = h[a];
            vb[j] = h[b];
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int hh = ck * 8 + j;
            if (hh >= heads)
                break;
            kvd_rope_rot(&va[j], &vb[j], c, s);
            float *h = hh < n_heads ? qt + (size_t)hh * D : kt + (size_t)(hh - n_heads) * D;
            h[a] = va[j];
            h[b] = vb[j];
        }
    }
    __syncthreads(); // the roped k, written by other threads of the block
    const uint32_t slot = slots[t];
    if (slot == UINT32_MAX)
        return; // padding row of a graph bucket: no KV
    kvd_kv_write_token<DT>(kv, layer, slot, (int)(p % (uint32_t)kv.block_tokens), kt,
                           v + (size_t)t * HK * D);
}

extern "C" int kvd_k_rope_kv(float *q, float *k, const float *v, const uint32_t *pos,
                             const uint32_t *slots, int n_tokens, int n_heads, int n_rot,
                             float base, const float *freq_factors, int mode,
                             const struct kvd_k_kv *kv, int layer, kvd_stream stream)
{
    if (n_tokens < 0 || n_heads <= 0 || n_rot < 0 || n_rot > kv->head_dim || (n_rot & 1) ||
        (mode != KVD_K_ROPE_NORM && mode != KVD_K_ROPE_NEOX) || layer < 0 || layer >= kv->layers ||
        kv->block_tokens <= 0 || kv->kv_heads <= 0 ||
        ((kv->dtype == KVD_K_Q8_0 || kv->dtype == KVD_K_FP8) && kv->head_dim % 32))
        return (int)cudaErrorInvalidValue;
    if (n_tokens == 0)
        return 0;
    const int neox = mode == KVD_K_ROPE_NEOX;
#define RKV(DT)                                                                                    \
    KVD_LAUNCH_PDL(n_tokens, 128, 0, stream, rope_kv_kernel<DT>)                                   \
    (q, k, v, pos, slots, n_heads, *kv, layer, n_rot, base, freq_factors, neox)
    switch (kv->dtype) {
    case KVD_K_F16:
        RKV(KVD_K_F16);
        break;
    case KVD_K_BF16:
        RKV(KVD_K_BF16);
        break;
    case KVD_K_F32:
        RKV(KVD_K_F32);
        break;
    case KVD_K_Q8_0:
        RKV(KVD_K_Q8_0);
        break;
    case KVD_K_FP8:
        RKV(KVD_K_FP8);
        break;
    default:
        return (int)cudaErrorInvalidValue;
    }
#undef RKV
    return kvd_launch_status();
}

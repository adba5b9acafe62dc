// Writes the new tokens' K and V (f32, just projected and rotated) of one
// layer into their KV blocks, converting to the cache dtype.
#include "kernel_util.cuh"

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

extern "C" int kvd_k_kv_write(const struct kvd_k_kv *kv, int layer, const uint32_t *slots,
                              const uint32_t *pos, const float *k, const float *v, int n_tokens,
                              kvd_stream stream)
{
    if (n_tokens < 0 || layer < 0 || layer >= kv->layers || kv->block_tokens <= 0)
        return (int)cudaErrorInvalidValue;
    if (n_tokens == 0)
        return 0;
    switch (kv->dtype) {
    case KVD_K_F16:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_F16>)(*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_BF16:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_BF16>)(*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_F32:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_F32>)(*kv, layer, slots, pos, k, v);
        break;
    default: return (int)cudaErrorInvalidValue;
    }
    return kvd_launch_status();
}

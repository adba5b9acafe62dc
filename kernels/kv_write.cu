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
    const int t = blockIdx.x;
    const uint32_t slot = slots[t];
    if (slot == UINT32_MAX)
        return; // padding row of a graph bucket: writes nothing
    const size_t per = (size_t)kv.kv_heads * kv.head_dim;
    kvd_kv_write_token<DT>(kv, layer, slot, (int)(pos[t] % (uint32_t)kv.block_tokens), k + t * per,
                           v + t * per);
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
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_Q8_0>)
        (*kv, layer, slots, pos, k, v);
        break;
    case KVD_K_FP8:
        KVD_LAUNCH(n_tokens, 128, 0, stream, kv_write_kernel<KVD_K_FP8>)
        (*kv, layer, slots, pos, k, v);
        break;
    default:
        return (int)cudaErrorInvalidValue;
    }
    return kvd_launch_status();
}

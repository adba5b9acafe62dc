// RoPE of the step's q and k fused with the write of k and v into the KV
// blocks: one launch for the chain rope(q); rope(k); kv_write(k, v), with
// the cpu backend's arithmetic for both (kernel_util.cuh, kv_row.cuh).
#include "rope_kv.cuh"

// One block per token (rope_kv.cuh).
template <int DT> __global__ void rope_kv_kernel(rkv_args a)
{
    kvd_pdl_wait(); // q, k, v: the projection's
    kvd_pdl_trigger();
    rope_kv_token<DT>(a, blockIdx.x, a.pos[blockIdx.x], a.slots[blockIdx.x]);
}

extern "C" int kvd_k_rope_kv(float *q, float *k, const float *v, const uint32_t *pos,
                             const uint32_t *slots, int n_tokens, int n_heads, int n_rot,
                             float base, const float *freq_factors, int mode,
                             const struct kvd_k_kv *kv, int layer, kvd_stream stream)
{
    if (!rope_kv_args_ok(n_tokens, n_heads, n_rot, mode, *kv, layer))
        return (int)cudaErrorInvalidValue;
    if (n_tokens == 0)
        return 0;
    const rkv_args a = {
        q,   k,    v, pos, slots, n_heads, n_rot, mode == KVD_K_ROPE_NEOX, base, freq_factors,
        *kv, layer};
#define RKV(DT) KVD_LAUNCH_PDL(n_tokens, 128, 0, stream, rope_kv_kernel<DT>)(a)
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

// RoPE of one token's q and k with the write of its k and v into the KV
// blocks, by one whole block (internal, CUDA C++ only): rope_kv.cu's
// kernel (a block per token) and the fused GEMV's last block (its tokens
// one after another, after the q, k, v projections) share it.
#ifndef KVD_ROPE_KV_CUH
#define KVD_ROPE_KV_CUH

#include "kv_row.cuh"

// q [n_tokens][n_heads][head_dim]; k, v [n_tokens][kv_heads][head_dim]
// (head_dim = kv.head_dim); pos, slots [n_tokens].
struct rkv_args {
    float *q, *k;
    const float *v;
    const uint32_t *pos, *slots;
    int n_heads, n_rot, neox;
    float base;
    const float *ff;
    kvd_k_kv kv;
    int layer;
};

// Token t at position p, its KV slot `slot` (a.pos[t], a.slots[t], loaded
// by the caller: the fused GEMV's last block has them before it knows it is
// the last): every (pair, chunk of 8 heads) of its q and k heads rotated in
// place (the angle once per pair, the chunk's loads together), then, after
// a barrier, its k and v rows written to the token's block. q, k and v are
// read from L2 (other blocks of a GEMV launch wrote them). Every thread of
// the block calls it.
template <int DT>
static __device__ __forceinline__ void rope_kv_token(const rkv_args &a, int t, uint32_t p,
                                                     uint32_t slot)
{
    const kvd_k_kv &kv = a.kv;
    const int D = kv.head_dim, HK = kv.kv_heads, half = a.n_rot / 2, n_heads = a.n_heads;
    const int heads = n_heads + HK, chunks = (heads + 7) / 8;
    float *qt = a.q + (size_t)t * n_heads * D, *kt = a.k + (size_t)t * HK * D;
    for (int item = threadIdx.x; item < half * chunks; item += blockDim.x) {
        const int i = item % half, ck = item / half;
        float c, s;
        kvd_rope_cs(p, i, a.n_rot, a.base, a.ff, &c, &s);
        const int ia = a.neox ? i : 2 * i, ib = a.neox ? i + half : 2 * i + 1;
        float va[8], vb[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int hh = ck * 8 + j < heads ? ck * 8 + j : 0;
            const float *h = hh < n_heads ? qt + (size_t)hh * D : kt + (size_t)(hh - n_heads) * D;
            va[j] = __ldcg(h + ia);
            vb[j] = __ldcg(h + ib);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int hh = ck * 8 + j;
            if (hh >= heads)
                break;
            kvd_rope_rot(&va[j], &vb[j], c, s);
            float *h = hh < n_heads ? qt + (size_t)hh * D : kt + (size_t)(hh - n_heads) * D;
            h[ia] = va[j];
            h[ib] = vb[j];
        }
    }
    __syncthreads(); // the roped k, written by other threads of the block
    if (slot == UINT32_MAX)
        return; // padding row of a graph bucket: no KV
    kvd_kv_write_token<DT>(kv, a.layer, slot, (int)(p % (uint32_t)kv.block_tokens), kt,
                           a.v + (size_t)t * HK * D);
}

// The same with the KV dtype known at run time.
static __device__ __forceinline__ void rope_kv_token_any(const rkv_args &a, int t, uint32_t p,
                                                         uint32_t slot)
{
    switch (a.kv.dtype) {
    case KVD_K_F16:
        rope_kv_token<KVD_K_F16>(a, t, p, slot);
        break;
    case KVD_K_BF16:
        rope_kv_token<KVD_K_BF16>(a, t, p, slot);
        break;
    case KVD_K_F32:
        rope_kv_token<KVD_K_F32>(a, t, p, slot);
        break;
    case KVD_K_Q8_0:
        rope_kv_token<KVD_K_Q8_0>(a, t, p, slot);
        break;
    default:
        rope_kv_token<KVD_K_FP8>(a, t, p, slot);
        break;
    }
}

// Whether the arguments are ones the kernels take (kvd_k_rope_kv's rules).
static inline bool rope_kv_args_ok(int n_tokens, int n_heads, int n_rot, int mode,
                                   const kvd_k_kv &kv, int layer)
{
    return n_tokens >= 0 && n_heads > 0 && n_rot >= 0 && n_rot <= kv.head_dim && !(n_rot & 1) &&
           (mode == KVD_K_ROPE_NORM || mode == KVD_K_ROPE_NEOX) && layer >= 0 &&
           layer < kv.layers && kv.block_tokens > 0 && kv.kv_heads > 0 &&
           (kv.dtype == KVD_K_F16 || kv.dtype == KVD_K_BF16 || kv.dtype == KVD_K_F32 ||
            kv.dtype == KVD_K_Q8_0 || kv.dtype == KVD_K_FP8) &&
           !((kv.dtype == KVD_K_Q8_0 || kv.dtype == KVD_K_FP8) && kv.head_dim % 32);
}

#endif

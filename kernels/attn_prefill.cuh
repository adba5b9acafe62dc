// What the two prefill attention files share (internal, CUDA C++ only): the
// tensor-core kernel's entry (attn_prefill_mma.cu), called by
// kvd_k_attn_prefill (attn_prefill.cu) for the 16-bit and quantized KV
// dtypes at head_dim 64, 128 and 256, and the per-device opt-in to more
// than 48 KiB of dynamic shared memory.
#ifndef KVD_ATTN_PREFILL_CUH
#define KVD_ATTN_PREFILL_CUH

#include <atomic>

#include "kernel_util.cuh"

// Sets kernel's dynamic shared memory limit to `bytes` once per device:
// `done` holds a bit per device already set (a function attribute holds for
// the device current when it is set; not a stream operation, so it is safe
// while a graph is being captured). Devices past 63 set it every time.
template <class K>
static inline int kvd_smem_optin(K *kernel, size_t bytes, std::atomic<unsigned long long> &done)
{
    if (bytes <= 48u * 1024)
        return 0;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return (int)e;
    const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    if (bit && (done.load(std::memory_order_acquire) & bit))
        return 0;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e != cudaSuccess)
        return (int)e;
    done.fetch_or(bit, std::memory_order_release);
    return 0;
}

// Whether the tensor-core kernel takes this (head_dim, dtype).
static inline bool kvd_attn_prefill_mma_ok(int head_dim, int dtype)
{
    return (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
           (dtype == KVD_K_F16 || dtype == KVD_K_BF16 || dtype == KVD_K_Q8_0 || dtype == KVD_K_FP8);
}

// kvd_k_attn_prefill's work on tensor cores (kvd_attn_prefill_mma_ok), with
// its arguments; skip_single: sequences of exactly one row are left alone
// (the decode kernel computes them).
int kvd_attn_prefill_mma(float *out, const float *q, const kvd_k_kv &kv, int layer,
                         const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                         const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                         int skip_single, cudaStream_t stream);

#endif

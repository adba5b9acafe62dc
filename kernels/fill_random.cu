// Fills device memory with reproducible uniform random numbers (a counter-
// based hash, no state): random weights and KV for benchmarks and tests,
// generated in place instead of copied from the host; random blocks of the
// quantized weight types; and the empty kernel that measures launch cost.
#include "quant.cuh"

static __device__ __forceinline__ uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <int DT>
__global__ void fill_uniform_kernel(void *dst, size_t n, uint64_t seed, float lo, float hi)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint64_t r = splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull));
        float u = (float)(r >> 40) * (1.0f / 16777216.0f); // [0, 1), 24 bits
        kvd_store1<DT>(dst, i, lo + (hi - lo) * u);
    }
}

extern "C" int kvd_k_fill_uniform(void *dst, int dtype, size_t n, uint64_t seed, float lo, float hi,
                                  kvd_stream stream)
{
    if (n == 0)
        return 0;
    unsigned b = kvd_blocks_for(n, 256);
    b = b > 16384 ? 16384 : b;
    switch (dtype) {
    case KVD_K_F16:
        KVD_LAUNCH(b, 256, 0, stream, fill_uniform_kernel<KVD_K_F16>)(dst, n, seed, lo, hi);
        break;
    case KVD_K_BF16:
        KVD_LAUNCH(b, 256, 0, stream, fill_uniform_kernel<KVD_K_BF16>)(dst, n, seed, lo, hi);
        break;
    case KVD_K_F32:
        KVD_LAUNCH(b, 256, 0, stream, fill_uniform_kernel<KVD_K_F32>)(dst, n, seed, lo, hi);
        break;
    default:
        return (int)cudaErrorInvalidValue;
    }
    return kvd_launch_status();
}

// One thread per byte of the blocks: random bytes, then each block's f16
// scale fields (at byte offsets f0 and f1 of a bb-byte block; f1 -1 when
// there is one) set to a small positive value in [2^-13, 2^-12), so every
// value is finite and a row's dot product stays near unit scale (the scale
// bytes of the K-quants and the quants stay random). The field offsets come
// from the host: a run-time switch in device code would read a table.
__global__ void fill_qweight_kernel(uint8_t *dst, int bb, int f0, int f1, size_t n, uint64_t seed)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int off = (int)(i % (size_t)bb);
        uint64_t r = splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull));
        uint8_t v = (uint8_t)(r >> 32);
        if (off == f0 + 1 || off == f1 + 1) // sign 0, exponent field 2: 2^-13
            v = (uint8_t)((2 << 2) | ((r >> 48) & 3));
        dst[i] = v;
    }
}

extern "C" int kvd_k_fill_qweight(void *dst, int wtype, size_t n_blocks, uint64_t seed,
                                  kvd_stream stream)
{
    if (!kvd_wt_is_q(wtype) && wtype != KVD_KW_Q8_0)
        return (int)cudaErrorInvalidValue;
    const int bb = kvd_wt_block_bytes(wtype);
    int f0 = 0, f1 = -1;
    if (wtype == KVD_KW_Q4_1 || wtype == KVD_KW_Q5_1 || wtype == KVD_KW_Q4_K ||
        wtype == KVD_KW_Q5_K)
        f1 = 2; // the min (legacy) or dmin (K)
    else if (wtype == KVD_KW_Q6_K)
        f0 = 208;
    const size_t n = n_blocks * (size_t)bb;
    if (n == 0)
        return 0;
    unsigned b = kvd_blocks_for(n, 256);
    b = b > 16384 ? 16384 : b;
    KVD_LAUNCH(b, 256, 0, stream, fill_qweight_kernel)((uint8_t *)dst, bb, f0, f1, n, seed);
    return kvd_launch_status();
}

__global__ void empty_kernel(int unused)
{
    (void)unused;
}

extern "C" int kvd_k_empty(kvd_stream stream)
{
    KVD_LAUNCH(1, 32, 0, stream, empty_kernel)(0);
    return kvd_launch_status();
}

// Busy for about ns nanoseconds of the device's global timer (the emulator
// returns at once): queued ahead of a step, it lets the host issue the whole
// step before the device starts it.
__global__ void spin_kernel(long long ns)
{
#ifdef KVD_CUDA_EMULATE
    (void)ns;
#else
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    while ((long long)(t - t0) < ns);
#endif
}

extern "C" int kvd_k_spin(long long ns, kvd_stream stream)
{
    KVD_LAUNCH(1, 32, 0, stream, spin_kernel)(ns);
    return kvd_launch_status();
}

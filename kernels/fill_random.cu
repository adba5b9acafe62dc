// Fills device memory with reproducible uniform random numbers (a counter-
// based hash, no state): random weights and KV for benchmarks and tests,
// generated in place instead of copied from the host.
#include "kernel_util.cuh"

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

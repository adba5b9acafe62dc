// Copy-on-write of KV blocks inside the device arena: many whole-block copies
// in one launch (a fork's partial blocks, a batch of COWs).
#include "kernel_util.cuh"

// grid (n, chunks): block i copies a part of arena slot src[i] to dst[i].
__global__ void block_copy16_kernel(char *arena, size_t block_bytes, const int32_t *src,
                                    const int32_t *dst)
{
    const uint4 *s = (const uint4 *)(arena + (size_t)src[blockIdx.x] * block_bytes);
    uint4 *d = (uint4 *)(arena + (size_t)dst[blockIdx.x] * block_bytes);
    size_t n = block_bytes / 16;
    for (size_t i = (size_t)blockIdx.y * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.y * blockDim.x)
        d[i] = s[i];
}

__global__ void block_copy1_kernel(char *arena, size_t block_bytes, const int32_t *src,
                                   const int32_t *dst)
{
    const char *s = arena + (size_t)src[blockIdx.x] * block_bytes;
    char *d = arena + (size_t)dst[blockIdx.x] * block_bytes;
    for (size_t i = (size_t)blockIdx.y * blockDim.x + threadIdx.x; i < block_bytes;
         i += (size_t)gridDim.y * blockDim.x)
        d[i] = s[i];
}

extern "C" int kvd_k_block_copy(const struct kvd_k_kv *kv, const int32_t *src, const int32_t *dst,
                                int n, kvd_stream stream)
{
    if (n < 0)
        return (int)cudaErrorInvalidValue;
    if (n == 0 || kv->block_bytes == 0)
        return 0;
    bool wide = kv->block_bytes % 16 == 0 && ((uintptr_t)kv->arena & 15) == 0;
    size_t units = wide ? kv->block_bytes / 16 : kv->block_bytes;
    unsigned chunks = kvd_blocks_for(units, 256);
    dim3 grid((unsigned)n, chunks > 64 ? 64 : chunks);
    if (wide) {
        KVD_LAUNCH(grid, 256, 0, stream, block_copy16_kernel)
        ((char *)kv->arena, kv->block_bytes, src, dst);
    } else {
        KVD_LAUNCH(grid, 256, 0, stream, block_copy1_kernel)
        ((char *)kv->arena, kv->block_bytes, src, dst);
    }
    return kvd_launch_status();
}

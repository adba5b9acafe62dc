// Weight conversion: GGUF weights already on the device to bf16 (matrices:
// the bf16 copies of F16/Q8_0 made at load, and the tiles the quantized
// types are dequantized into before each GEMM) or f32 (norm weights).
#include "quant.cuh"

__global__ void to_bf16_kernel(uint16_t *dst, const void *src, int wtype, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = wtype == KVD_KW_BF16 ? ((const uint16_t *)src)[i]
                                      : kvd_f32_to_bf16(kvd_any_to_f32(src, wtype, i));
}

__global__ void to_f32_kernel(float *dst, const void *src, int wtype, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = kvd_any_to_f32(src, wtype, i);
}

// The quantized types: one thread per 32-value chunk (n_chunks of them),
// dequantized once and stored as 32 bf16 (four 16-byte stores when dst is
// aligned) or 32 f32.
template <bool BF16, bool VEC>
__global__ void deq_chunks_kernel(void *dst, const uint8_t *__restrict__ src, int wtype,
                                  size_t n_chunks)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < n_chunks; c += stride) {
        float v[32];
        kvd_deq32(src, wtype, c, v);
        if (BF16 && VEC) {
            uint4 *o = (uint4 *)((uint16_t *)dst + c * 32);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                uint32_t p[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    p[e] = (uint32_t)kvd_f32_to_bf16(v[8 * k + 2 * e]) |
                           ((uint32_t)kvd_f32_to_bf16(v[8 * k + 2 * e + 1]) << 16);
                o[k] = make_uint4(p[0], p[1], p[2], p[3]);
            }
        } else if (BF16) {
            uint16_t *o = (uint16_t *)dst + c * 32;
            for (int l = 0; l < 32; l++)
                o[l] = kvd_f32_to_bf16(v[l]);
        } else {
            float *o = (float *)dst + c * 32;
            for (int l = 0; l < 32; l++)
                o[l] = v[l];
        }
    }
}

static int check_wtype(int wtype, size_t n)
{
    if (!kvd_wt_known(wtype) || n % (size_t)kvd_wt_qk(wtype))
        return (int)cudaErrorInvalidValue;
    return 0;
}

static unsigned conv_grid(size_t n)
{
    unsigned b = kvd_blocks_for(n, 256);
    return b > 8192 ? 8192 : b;
}

extern "C" int kvd_k_wtype_block(int wtype)
{
    return kvd_wt_known(wtype) ? kvd_wt_qk(wtype) : 0;
}

extern "C" int kvd_k_to_bf16(uint16_t *dst, const void *src, int wtype, size_t n, kvd_stream stream)
{
    int rc = check_wtype(wtype, n);
    if (rc || n == 0)
        return rc;
    if (kvd_wt_is_q(wtype)) {
        size_t nc = n / 32;
        if (((uintptr_t)dst & 15) == 0) {
            KVD_LAUNCH(conv_grid(nc), 256, 0, stream, deq_chunks_kernel<true, true>)
            (dst, (const uint8_t *)src, wtype, nc);
        } else {
            KVD_LAUNCH(conv_grid(nc), 256, 0, stream, deq_chunks_kernel<true, false>)
            (dst, (const uint8_t *)src, wtype, nc);
        }
        return kvd_launch_status();
    }
    KVD_LAUNCH(conv_grid(n), 256, 0, stream, to_bf16_kernel)(dst, src, wtype, n);
    return kvd_launch_status();
}

extern "C" int kvd_k_to_f32(float *dst, const void *src, int wtype, size_t n, kvd_stream stream)
{
    int rc = check_wtype(wtype, n);
    if (rc || n == 0)
        return rc;
    if (kvd_wt_is_q(wtype)) {
        size_t nc = n / 32;
        KVD_LAUNCH(conv_grid(nc), 256, 0, stream, deq_chunks_kernel<false, false>)
        (dst, (const uint8_t *)src, wtype, nc);
        return kvd_launch_status();
    }
    KVD_LAUNCH(conv_grid(n), 256, 0, stream, to_f32_kernel)(dst, src, wtype, n);
    return kvd_launch_status();
}

extern "C" int kvd_k_f32_to_bf16(uint16_t *dst, const float *src, size_t n, kvd_stream stream)
{
    return kvd_k_to_bf16(dst, src, KVD_KW_F32, n, stream);
}

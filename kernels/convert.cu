// Weight conversion at load: GGUF F32/F16/BF16/Q8_0 bytes already on the
// device to bf16 (matrices) or f32 (norm weights). Q8_0 is dequantized here,
// once, so every projection runs as a bf16 GEMV/GEMM.
#include "kernel_util.cuh"

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

static int check_wtype(int wtype, size_t n)
{
    if (wtype != KVD_KW_F32 && wtype != KVD_KW_F16 && wtype != KVD_KW_BF16 &&
        wtype != KVD_KW_Q8_0)
        return (int)cudaErrorInvalidValue;
    if (wtype == KVD_KW_Q8_0 && n % 32)
        return (int)cudaErrorInvalidValue;
    return 0;
}

static unsigned conv_grid(size_t n)
{
    unsigned b = kvd_blocks_for(n, 256);
    return b > 8192 ? 8192 : b;
}

extern "C" int kvd_k_to_bf16(uint16_t *dst, const void *src, int wtype, size_t n,
                             kvd_stream stream)
{
    int rc = check_wtype(wtype, n);
    if (rc || n == 0)
        return rc;
    KVD_LAUNCH(conv_grid(n), 256, 0, stream, to_bf16_kernel)(dst, src, wtype, n);
    return kvd_launch_status();
}

extern "C" int kvd_k_to_f32(float *dst, const void *src, int wtype, size_t n, kvd_stream stream)
{
    int rc = check_wtype(wtype, n);
    if (rc || n == 0)
        return rc;
    KVD_LAUNCH(conv_grid(n), 256, 0, stream, to_f32_kernel)(dst, src, wtype, n);
    return kvd_launch_status();
}

extern "C" int kvd_k_f32_to_bf16(uint16_t *dst, const float *src, size_t n, kvd_stream stream)
{
    return kvd_k_to_bf16(dst, src, KVD_KW_F32, n, stream);
}

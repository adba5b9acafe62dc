// SwiGLU's elementwise part: out = silu(gate) * up, silu(g) = g / (1 + e^-g),
// e^x the cpu backend's (kernel_util.cuh kvd_silu_exp), so the device gives
// the cpu's bits.
#include "kernel_util.cuh"

__global__ void silu_mul_kernel(float *out, const float *gate, const float *up, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float g = gate[i];
        // no multiply feeds an add here, so nvcc's contraction cannot fuse any
        out[i] = g / (1.0f + kvd_silu_exp(0.0f - g)) * up[i];
    }
}

extern "C" int kvd_k_silu_mul(float *out, const float *gate, const float *up, size_t n,
                              kvd_stream stream)
{
    if (n == 0)
        return 0;
    unsigned b = kvd_blocks_for(n, 256);
    KVD_LAUNCH(b > 65535 ? 65535 : b, 256, 0, stream, silu_mul_kernel)(out, gate, up, n);
    return kvd_launch_status();
}

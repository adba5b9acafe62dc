// SwiGLU's elementwise part: out = silu(gate) * up, silu(g) = g / (1 + e^-g).
// e^x is the cpu backend's (compute_cpu.c silu_exp: ggml's vectorized expf as
// its AVX-512 builds compute it), operation for operation with explicit fmaf,
// so the device gives the cpu's bits: n = round(x log2 e) by the 1.5 * 2^23
// shift, b = x - n ln2 (ln2 in two parts), p = ((c5 b + c4) b^2 + (c3 b +
// c2)) b^2 + (c1 b + 1), then p * 2^n in two exact power-of-two factors.
#include "kernel_util.cuh"

__device__ static float silu_exp(float x)
{
    float z = fmaf(x, 0x1.715476p+0f, 0x1.8p23f);
    float n = z - 0x1.8p23f;
    float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    float u = b * b;
    float p = fmaf(
        fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
        u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (n != n)
        return p;
    if (fabsf(n) > 192.0f)
        return n > 0 ? __int_as_float(0x7f800000) : 0.0f;
    int ni = (int)n, n1 = ni / 2;
    float s1 = __int_as_float((n1 + 127) << 23), s2 = __int_as_float((ni - n1 + 127) << 23);
    return p * s1 * s2;
}

__global__ void silu_mul_kernel(float *out, const float *gate, const float *up, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float g = gate[i];
        // no multiply feeds an add here, so nvcc's contraction cannot fuse any
        out[i] = g / (1.0f + silu_exp(0.0f - g)) * up[i];
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

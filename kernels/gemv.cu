// Small-batch projection y = W x for 1..8 tokens, the decode hot path: it is
// bound by reading W once, so each warp streams one weight row in its GGUF
// type (F32, F16, BF16, or Q8_0 dequantized in registers) with wide loads and
// applies it to every token's f32 activations, accumulating in f32. The other
// quantized types have their own GEMV (gemv_quant.cu).
#include "kernel_util.cuh"

#define GEMV_WARPS 8  // warps (= output rows) per block
#define GEMV_UNROLL 4 // weight units in flight per lane

// A "unit" is what one lane loads per step: 8 elements (16 bytes of
// F16/BF16, 32 bytes of F32) or one 32-element Q8_0 block (34 bytes).
template <int WT> struct gemv_unit;
template <> struct gemv_unit<KVD_KW_BF16> {
    static constexpr int N = 8;
    uint4 raw;
    __device__ void load(const char *row, int u)
    {
        raw = __ldcs((const uint4 *)row + u);
    }
    __device__ void widen(float *f) const
    {
        uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = __uint_as_float(w[k] << 16);
            f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
};
template <> struct gemv_unit<KVD_KW_F16> {
    static constexpr int N = 8;
    uint4 raw;
    __device__ void load(const char *row, int u)
    {
        raw = __ldcs((const uint4 *)row + u);
    }
    __device__ void widen(float *f) const
    {
        uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = kvd_f16_to_f32((uint16_t)(w[k] & 0xffffu));
            f[2 * k + 1] = kvd_f16_to_f32((uint16_t)(w[k] >> 16));
        }
    }
};
template <> struct gemv_unit<KVD_KW_F32> {
    static constexpr int N = 8;
    float4 a, b;
    __device__ void load(const char *row, int u)
    {
        const float4 *p = (const float4 *)row + 2 * u;
        a = __ldcs(p);
        b = __ldcs(p + 1);
    }
    __device__ void widen(float *f) const
    {
        f[0] = a.x;
        f[1] = a.y;
        f[2] = a.z;
        f[3] = a.w;
        f[4] = b.x;
        f[5] = b.y;
        f[6] = b.z;
        f[7] = b.w;
    }
};
template <> struct gemv_unit<KVD_KW_Q8_0> {
    static constexpr int N = 32;
    uint16_t raw[17]; // the block is 2-byte aligned: 17 half-words
    __device__ void load(const char *row, int u)
    {
        const uint16_t *p = (const uint16_t *)(row + (size_t)u * 34);
#pragma unroll
        for (int k = 0; k < 17; k++)
            raw[k] = __ldcs(p + k);
    }
    __device__ void widen(float *f) const
    {
        float d = kvd_f16_to_f32(raw[0]);
#pragma unroll
        for (int k = 0; k < 16; k++) {
            f[2 * k] = d * (float)(int8_t)(raw[1 + k] & 0xff);
            f[2 * k + 1] = d * (float)(int8_t)(raw[1 + k] >> 8);
        }
    }
};

// y [NT][out], w [out][in] of type WT, x [NT][in] f32.
template <int WT, int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(float *__restrict__ y, const char *__restrict__ w, const float *__restrict__ x,
                int out, int in)
{
    using U = gemv_unit<WT>;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= out)
        return; // whole warp: no shuffles are skipped by part of it
    const char *wr = w + (size_t)row * kvd_row_bytes(WT, in);
    const int n_units = in / U::N;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++)
        acc[t] = 0.0f;
    for (int u0 = lane; u0 < n_units; u0 += 32 * GEMV_UNROLL) {
        U wu[GEMV_UNROLL];
        // Every weight load is issued before the first use.
#pragma unroll
        for (int k = 0; k < GEMV_UNROLL; k++)
            if (u0 + k * 32 < n_units)
                wu[k].load(wr, u0 + k * 32);
#pragma unroll
        for (int k = 0; k < GEMV_UNROLL; k++) {
            const int u = u0 + k * 32;
            if (u >= n_units)
                break;
            float wf[U::N];
            wu[k].widen(wf);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float4 *xv = (const float4 *)(x + (size_t)t * in + (size_t)u * U::N);
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < U::N / 4; e++) {
                    float4 a = __ldg(xv + e);
                    s += wf[4 * e] * a.x + wf[4 * e + 1] * a.y + wf[4 * e + 2] * a.z +
                         wf[4 * e + 3] * a.w;
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = kvd_warp_sum(acc[t]);
        if (lane == 0)
            y[(size_t)t * out + row] = s;
    }
}

template <int WT, int NT>
static int gemv_launch(float *y, const void *w, const float *x, int out, int in,
                       cudaStream_t stream)
{
    unsigned blocks = (unsigned)((out + GEMV_WARPS - 1) / GEMV_WARPS);
    KVD_LAUNCH(blocks, GEMV_WARPS * 32, 0, stream, gemv_kernel<WT, NT>)
    (y, (const char *)w, x, out, in);
    return kvd_launch_status();
}

template <int WT>
static int gemv_by_tokens(float *y, const void *w, const float *x, int n_tokens, int out, int in,
                          cudaStream_t stream)
{
    switch (n_tokens) {
    case 1:
        return gemv_launch<WT, 1>(y, w, x, out, in, stream);
    case 2:
        return gemv_launch<WT, 2>(y, w, x, out, in, stream);
    case 3:
        return gemv_launch<WT, 3>(y, w, x, out, in, stream);
    case 4:
        return gemv_launch<WT, 4>(y, w, x, out, in, stream);
    case 5:
        return gemv_launch<WT, 5>(y, w, x, out, in, stream);
    case 6:
        return gemv_launch<WT, 6>(y, w, x, out, in, stream);
    case 7:
        return gemv_launch<WT, 7>(y, w, x, out, in, stream);
    default:
        return gemv_launch<WT, 8>(y, w, x, out, in, stream);
    }
}

extern "C" int kvd_k_gemv_ok(const void *w, int wtype, const float *x, int n_tokens, int in)
{
    if (n_tokens < 1 || n_tokens > KVD_K_GEMV_MAX_TOKENS || in <= 0 || ((uintptr_t)x & 15))
        return 0;
    switch (wtype) {
    case KVD_KW_Q8_0:
        return in % 32 == 0 && ((uintptr_t)w & 1) == 0;
    case KVD_KW_F32:
    case KVD_KW_F16:
    case KVD_KW_BF16:
        return in % 8 == 0 && ((uintptr_t)w & 15) == 0;
    default:
        return 0;
    }
}

extern "C" int kvd_k_gemv(float *y, const void *w, int wtype, const float *x, int n_tokens, int out,
                          int in, kvd_stream stream)
{
    if (out < 0 || !kvd_k_gemv_ok(w, wtype, x, n_tokens, in))
        return (int)cudaErrorInvalidValue;
    if (out == 0)
        return 0;
    switch (wtype) {
    case KVD_KW_F32:
        return gemv_by_tokens<KVD_KW_F32>(y, w, x, n_tokens, out, in, stream);
    case KVD_KW_F16:
        return gemv_by_tokens<KVD_KW_F16>(y, w, x, n_tokens, out, in, stream);
    case KVD_KW_BF16:
        return gemv_by_tokens<KVD_KW_BF16>(y, w, x, n_tokens, out, in, stream);
    default:
        return gemv_by_tokens<KVD_KW_Q8_0>(y, w, x, n_tokens, out, in, stream);
    }
}

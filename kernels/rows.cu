// Row gathers: the embedding lookup (rows of a weight of any GGUF type to
// f32) and picking each sequence's last position before the output head.
#include "quant.cuh"

// One block per output row; w [n_rows][ne0] of type wtype.
__global__ void get_rows_kernel(float *out, const void *__restrict__ w, int wtype, int ne0,
                                int n_rows, const uint32_t *__restrict__ ids)
{
    uint32_t id = ids[blockIdx.x];
    float *o = out + (size_t)blockIdx.x * ne0;
    bool ok = id < (uint32_t)n_rows;
    const char *row = (const char *)w + (ok ? (size_t)id * kvd_row_bytes(wtype, ne0) : 0);
    for (int i = threadIdx.x; i < ne0; i += blockDim.x)
        o[i] = ok ? kvd_any_to_f32(row, wtype, i) : 0.0f;
}

// The quantized types: thread c of the block dequantizes the row's 32-value
// chunks c, c + blockDim.x, ...
__global__ void get_rows_q_kernel(float *out, const void *__restrict__ w, int wtype, int ne0,
                                  int n_rows, const uint32_t *__restrict__ ids)
{
    uint32_t id = ids[blockIdx.x];
    float *o = out + (size_t)blockIdx.x * ne0;
    bool ok = id < (uint32_t)n_rows;
    const uint8_t *row = (const uint8_t *)w + (ok ? (size_t)id * kvd_row_bytes(wtype, ne0) : 0);
    for (int c = threadIdx.x; c < ne0 / 32; c += blockDim.x) {
        float v[32];
        if (ok)
            kvd_deq32(row, wtype, (size_t)c, v);
        else
            for (int l = 0; l < 32; l++)
                v[l] = 0.0f;
        float4 *o4 = (float4 *)(o + (size_t)c * 32); // ne0 % 32 == 0, out 16-byte aligned
#pragma unroll
        for (int k = 0; k < 8; k++)
            o4[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
}

__global__ void gather_rows_kernel(float *out, const float *__restrict__ x,
                                   const uint32_t *__restrict__ rows, int width)
{
    const float *src = x + (size_t)rows[blockIdx.x] * width;
    float *o = out + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        o[i] = src[i];
}

extern "C" int kvd_k_get_rows(float *out, const void *w, int wtype, int ne0, int n_rows,
                              const uint32_t *ids, int n, kvd_stream stream)
{
    if (n < 0 || ne0 < 0 || !kvd_wt_known(wtype) || ne0 % kvd_wt_qk(wtype))
        return (int)cudaErrorInvalidValue;
    if (n == 0 || ne0 == 0)
        return 0;
    if (kvd_wt_is_q(wtype)) {
        if ((uintptr_t)out & 15)
            return (int)cudaErrorInvalidValue;
        KVD_LAUNCH(n, 128, 0, stream, get_rows_q_kernel)(out, w, wtype, ne0, n_rows, ids);
    } else {
        KVD_LAUNCH(n, 256, 0, stream, get_rows_kernel)(out, w, wtype, ne0, n_rows, ids);
    }
    return kvd_launch_status();
}

extern "C" int kvd_k_gather_rows(float *out, const float *x, const uint32_t *rows, int n, int width,
                                 kvd_stream stream)
{
    if (n < 0 || width < 0)
        return (int)cudaErrorInvalidValue;
    if (n == 0 || width == 0)
        return 0;
    KVD_LAUNCH(n, 256, 0, stream, gather_rows_kernel)(out, x, rows, width);
    return kvd_launch_status();
}

// Rotary position embedding in place on q or k, in llama.cpp's two pair
// conventions (NORM: adjacent pairs, llama; NEOX: (i, i + n_rot/2), qwen2),
// with optional per-pair frequency divisors (Llama 3.1 rope_freqs); the
// cpu backend's arithmetic (kernel_util.cuh kvd_rope_cs, kvd_rope_rot).
#include "kernel_util.cuh"

// One thread per (token, pair, chunk of 8 heads): the angle once, then the
// chunk's 16 values loaded together (x is read and written, so loads of the
// next head could not move above the stores otherwise) and rotated.
// x [n_tokens][n_heads][head_dim].
__global__ void rope_kernel(float *x, const uint32_t *__restrict__ pos, int n_heads, int head_dim,
                            int n_rot, float base, const float *__restrict__ ff, int neox,
                            size_t n_items)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_items)
        return;
    const int half = n_rot / 2, chunks = (n_heads + 7) / 8;
    const int i = (int)(idx % (size_t)half), ck = (int)(idx / half % chunks);
    const size_t t = idx / half / chunks;
    float c, s;
    kvd_rope_cs(pos[t], i, n_rot, base, ff, &c, &s);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float va[8], vb[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int hh = ck * 8 + j;
        const float *h = x + (t * n_heads + (hh < n_heads ? hh : 0)) * (size_t)head_dim;
        va[j] = h[a];
        vb[j] = h[b];
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int hh = ck * 8 + j;
        if (hh >= n_heads)
            break;
        kvd_rope_rot(&va[j], &vb[j], c, s);
        float *h = x + (t * n_heads + hh) * (size_t)head_dim;
        h[a] = va[j];
        h[b] = vb[j];
    }
}

extern "C" int kvd_k_rope(float *x, const uint32_t *pos, int n_tokens, int n_heads, int head_dim,
                          int n_rot, float base, const float *freq_factors, int mode,
                          kvd_stream stream)
{
    if (n_tokens < 0 || n_heads < 0 || n_rot < 0 || n_rot > head_dim || (n_rot & 1) ||
        (mode != KVD_K_ROPE_NORM && mode != KVD_K_ROPE_NEOX))
        return (int)cudaErrorInvalidValue;
    size_t n = (size_t)n_tokens * (size_t)(n_rot / 2) * (size_t)((n_heads + 7) / 8);
    if (n == 0 || n_heads == 0)
        return 0;
    KVD_LAUNCH(kvd_blocks_for(n, 256), 256, 0, stream, rope_kernel)
    (x, pos, n_heads, head_dim, n_rot, base, freq_factors, mode == KVD_K_ROPE_NEOX, n);
    return kvd_launch_status();
}

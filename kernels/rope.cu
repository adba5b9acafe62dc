// Rotary position embedding in place on q or k, in llama.cpp's two pair
// conventions (NORM: adjacent pairs, llama; NEOX: (i, i + n_rot/2), qwen2),
// with optional per-pair frequency divisors (Llama 3.1 rope_freqs).
#include "kernel_util.cuh"

// One thread per (token, pair), looping over the heads that share the
// angle; x [n_tokens][n_heads][head_dim]. The angle is computed in double,
// as the cpu reference does, so both round to the same f32 cos/sin.
__global__ void rope_kernel(float *x, const uint32_t *__restrict__ pos, int n_heads, int head_dim,
                            int n_rot, float base, const float *__restrict__ ff, int neox,
                            size_t n_pairs_total)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_pairs_total)
        return;
    int half = n_rot / 2;
    int i = (int)(idx % (size_t)half);
    size_t t = idx / (size_t)half;
    double theta = (double)pos[t] * pow((double)base, -2.0 * i / n_rot);
    if (ff)
        theta /= ff[i];
    float c = (float)cos(theta), s = (float)sin(theta);
    int a = neox ? i : 2 * i;
    int b = neox ? i + half : 2 * i + 1;
    for (int hh = 0; hh < n_heads; hh++) {
        float *h = x + (t * n_heads + hh) * (size_t)head_dim;
        float x0 = h[a], x1 = h[b];
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

extern "C" int kvd_k_rope(float *x, const uint32_t *pos, int n_tokens, int n_heads, int head_dim,
                          int n_rot, float base, const float *freq_factors, int mode,
                          kvd_stream stream)
{
    if (n_tokens < 0 || n_heads < 0 || n_rot < 0 || n_rot > head_dim || (n_rot & 1) ||
        (mode != KVD_K_ROPE_NORM && mode != KVD_K_ROPE_NEOX))
        return (int)cudaErrorInvalidValue;
    size_t n = (size_t)n_tokens * (size_t)(n_rot / 2);
    if (n == 0 || n_heads == 0)
        return 0;
    KVD_LAUNCH(kvd_blocks_for(n, 256), 256, 0, stream, rope_kernel)
    (x, pos, n_heads, head_dim, n_rot, base, freq_factors, mode == KVD_K_ROPE_NEOX, n);
    return kvd_launch_status();
}

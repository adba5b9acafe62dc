// Greedy sampling on the device: the index of each row's largest logit, so a
// greedy step downloads 4 bytes per sequence instead of the vocabulary.
#include "kernel_util.cuh"

#define ARGMAX_THREADS 1024

// Better = larger value, or equal value at a lower index; NaN never wins.
static __device__ __forceinline__ void argmax_merge(float &v, int &i, float ov, int oi)
{
    if (ov > v || (ov == v && oi < i) || (v != v && ov == ov)) {
        v = ov;
        i = oi;
    }
}

// One block per row; logits [rows][vocab].
__global__ void argmax_kernel(int32_t *out, const float *__restrict__ logits, int vocab)
{
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const float *row = logits + (size_t)blockIdx.x * vocab;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS)
        argmax_merge(best, bi, row[i], i);
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_merge(best, bi, ov, oi);
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = best;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        best = sv[threadIdx.x];
        bi = si[threadIdx.x];
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            argmax_merge(best, bi, ov, oi);
        }
        // A row of only NaN (or -inf) leaves index 0x7fffffff: report 0.
        if (threadIdx.x == 0)
            out[blockIdx.x] = bi < vocab ? bi : 0;
    }
}

extern "C" int kvd_k_argmax(int32_t *out, const float *logits, int rows, int vocab,
                            kvd_stream stream)
{
    if (rows < 0 || vocab <= 0)
        return (int)cudaErrorInvalidValue;
    if (rows == 0)
        return 0;
    argmax_kernel<<<rows, ARGMAX_THREADS, 0, stream>>>(out, logits, vocab);
    return kvd_launch_status();
}

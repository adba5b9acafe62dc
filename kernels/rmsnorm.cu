// RMSNorm over rows of f32 activations, alone or fused with the residual add
// that precedes it in every Llama block (x += res; y = norm(x) * w).
#include "kernel_util.cuh"

#define RMS_THREADS 256

// One block per row. x, y: [rows][dim]; w: [dim]. res may be NULL (no add).
// y may alias x (rmsnorm in place) or res (model_forward's add_rmsnorm
// writes the norm over the residual it just added), so neither is
// __restrict__: each element is read before the same thread overwrites it.
__global__ void rmsnorm_kernel(float *x, const float *res, float *y, const float *__restrict__ w,
                               int dim, float eps)
{
    // Squares summed in double, as ggml and the cpu reference do.
    KVD_SHARED(double, part, [RMS_THREADS / 32]);
    size_t base = (size_t)blockIdx.x * dim;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        float v = x[base + i];
        if (res) {
            v += res[base + i];
            x[base + i] = v;
        }
        ss += (double)v * v;
    }
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        double t = threadIdx.x < RMS_THREADS / 32 ? part[threadIdx.x] : 0.0;
        for (int o = 16; o > 0; o >>= 1)
            t += __shfl_xor_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0)
            part[0] = t;
    }
    __syncthreads();
    // 1/sqrtf, not rsqrtf: the same rounding as the reference.
    float inv = 1.0f / sqrtf((float)(part[0] / dim) + eps);
    // Each thread re-reads only the elements it wrote itself, so no barrier
    // is needed between the add above and this pass.
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS)
        y[base + i] = x[base + i] * inv * w[i];
}

static int rmsnorm_launch(float *x, const float *res, float *y, const float *w, int rows, int dim,
                          float eps, cudaStream_t stream)
{
    if (rows <= 0 || dim <= 0)
        return rows < 0 || dim < 0 ? (int)cudaErrorInvalidValue : 0;
    KVD_LAUNCH(rows, RMS_THREADS, 0, stream, rmsnorm_kernel)(x, res, y, w, dim, eps);
    return kvd_launch_status();
}

extern "C" int kvd_k_rmsnorm(float *y, const float *x, const float *w, int rows, int dim, float eps,
                             kvd_stream stream)
{
    // x is only read when res is NULL; the cast keeps one kernel for both.
    return rmsnorm_launch((float *)x, NULL, y, w, rows, dim, eps, stream);
}

extern "C" int kvd_k_add_rmsnorm(float *x, const float *res, float *y, const float *w, int rows,
                                 int dim, float eps, kvd_stream stream)
{
    return rmsnorm_launch(x, res, y, w, rows, dim, eps, stream);
}

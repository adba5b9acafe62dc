// Residual and bias adds on f32 activations (the adds that do not fuse into
// a norm: the last residual of the model, qwen2's q/k/v biases).
#include "kernel_util.cuh"

__global__ void add_kernel(float *x, const float *__restrict__ a, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride)
        x[i] += a[i];
}

// y: [rows][dim], b: [dim].
__global__ void add_bias_kernel(float *y, const float *__restrict__ b, int dim, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride)
        y[i] += b[i % (size_t)dim];
}

static unsigned add_grid(size_t n)
{
    unsigned b = kvd_blocks_for(n, 256);
    return b > 65535 ? 65535 : b; // grid-stride loop covers the rest
}

extern "C" int kvd_k_add(float *x, const float *a, size_t n, kvd_stream stream)
{
    if (n == 0)
        return 0;
    KVD_LAUNCH(add_grid(n), 256, 0, stream, add_kernel)(x, a, n);
    return kvd_launch_status();
}

extern "C" int kvd_k_add_bias(float *y, const float *b, int rows, int dim, kvd_stream stream)
{
    if (rows < 0 || dim < 0)
        return (int)cudaErrorInvalidValue;
    size_t n = (size_t)rows * (size_t)dim;
    if (n == 0)
        return 0;
    KVD_LAUNCH(add_grid(n), 256, 0, stream, add_bias_kernel)(y, b, dim, n);
    return kvd_launch_status();
}

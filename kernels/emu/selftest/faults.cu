// Kernels with the defects the emulator must report (faults.h), written as
// kernels/*.cu are, through kernel_util.cuh's macros.
#include "faults.h"

#include "kernel_util.cuh"

__global__ void reduce_ok(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1024]);
    int t = threadIdx.x;
    s[t] = t < n ? in[t] : 0.0f;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (t < w)
            s[t] += s[t + w];
        __syncthreads();
    }
    if (t < 32) {
        float v = t == 0 ? s[0] : 0.0f;
        v = kvd_warp_sum(v);
        if (t == 0)
            out[0] = v;
    }
}

__global__ void exit_before_barrier(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1024]);
    if (threadIdx.x >= 32)
        return;
    s[threadIdx.x] = in[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = s[31 - threadIdx.x];
}

__global__ void two_barriers(const float *in, float *out, int n)
{
    if (threadIdx.x & 1)
        __syncthreads();
    else
        __syncthreads();
    out[threadIdx.x] = in[threadIdx.x];
}

__global__ void mask_without_self(const float *in, float *out, int n)
{
    out[threadIdx.x] = __shfl_sync(0x1u, in[threadIdx.x], 0);
}

__global__ void shfl_outside_mask(const float *in, float *out, int n)
{
    if (threadIdx.x < 16)
        out[threadIdx.x] = __shfl_sync(0x0000ffffu, in[threadIdx.x], 20);
}

__global__ void shfl_exited_lane(const float *in, float *out, int n)
{
    if (threadIdx.x >= 16)
        return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, in[threadIdx.x], 1);
}

__global__ void shared_raw(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1024]);
    int t = threadIdx.x;
    s[t] = in[t];
    out[t] = s[(t + 33) % n]; // another warp's write, no barrier
}

__global__ void shared_waw(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1]);
    s[0] = in[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = s[0];
}

__global__ void shared_war(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1024]);
    int t = threadIdx.x;
    s[t] = in[t];
    __syncthreads();
    float v = s[(t + 1) % n];
    s[t] = v * 2.0f; // thread t-1 reads s[t] in this interval
    out[t] = v;
}

// Lane t reads lane t+1's word, then writes its own: with `sync`, after a
// __syncwarp (ordered), else racing with lane t-1's read.
__global__ void warp_war(const float *in, float *out, int sync)
{
    KVD_SHARED(float, s, [32]);
    int t = threadIdx.x;
    s[t] = in[t];
    __syncthreads();
    float v = s[(t + 1) % 32];
    if (sync)
        __syncwarp(0xffffffffu);
    s[t] = v * 2.0f;
    __syncwarp(0xffffffffu);
    out[t] = s[t] + s[(t + 1) % 32];
}

__global__ void pdl_first(const float *in, float *out, int n)
{
    out[threadIdx.x] = in[threadIdx.x] + 1.0f;
}

// The second kernel of a PDL pair: mode 0 correct, 1 reads out early, 2
// writes early, 3 triggers early.
__global__ void pdl_second(const float *in, float *out, int mode)
{
    const int t = threadIdx.x;
    float w = in[t]; // not written by pdl_first: may be read early
    if (mode == 1)
        w += out[t];
    if (mode == 2)
        out[t + 1] = 0.0f;
    if (mode == 3)
        kvd_pdl_trigger();
    kvd_pdl_wait();
    kvd_pdl_trigger();
    out[t] = out[t] * 2.0f + w;
}

__global__ void shared_uninit(const float *in, float *out, int n)
{
    KVD_SHARED(float, s, [1024]);
    out[threadIdx.x] = s[threadIdx.x] + in[threadIdx.x];
}

__global__ void global_oob(const float *in, float *out, int n)
{
    if (threadIdx.x == 0)
        out[n + 1] = in[0]; // out has n + 1 floats
}

__global__ void global_race(const float *in, float *out, int n)
{
    out[0] = (float)(blockIdx.x * blockDim.x + threadIdx.x);
}

__global__ void atomic_ok(const float *in, float *out, int n)
{
    KVD_SHARED(unsigned, count, );
    if (threadIdx.x == 0)
        count = 0;
    __syncthreads();
    atomicAdd(&count, 1u);
    __syncthreads();
    if (threadIdx.x == 0)
        out[0] = (float)count;
}

__global__ void big_dyn_smem(const float *in, float *out, int n)
{
    KVD_DYN_SHARED(float, s);
    s[threadIdx.x] = in[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

extern "C" int kvd_fault_run(enum kvd_fault f, const float *in, float *out, int n, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    switch (f) {
    case KVD_FAULT_NONE:
        KVD_LAUNCH(1, n, 0, st, reduce_ok)(in, out, n);
        break;
    case KVD_FAULT_EXIT_BEFORE_BARRIER:
        KVD_LAUNCH(1, n, 0, st, exit_before_barrier)(in, out, n);
        break;
    case KVD_FAULT_TWO_BARRIERS:
        KVD_LAUNCH(1, n, 0, st, two_barriers)(in, out, n);
        break;
    case KVD_FAULT_MASK_WITHOUT_SELF:
        KVD_LAUNCH(1, n, 0, st, mask_without_self)(in, out, n);
        break;
    case KVD_FAULT_SHFL_OUTSIDE_MASK:
        KVD_LAUNCH(1, n, 0, st, shfl_outside_mask)(in, out, n);
        break;
    case KVD_FAULT_SHFL_EXITED_LANE:
        KVD_LAUNCH(1, n, 0, st, shfl_exited_lane)(in, out, n);
        break;
    case KVD_FAULT_SHARED_RAW:
        KVD_LAUNCH(1, n, 0, st, shared_raw)(in, out, n);
        break;
    case KVD_FAULT_SHARED_WAW:
        KVD_LAUNCH(1, n, 0, st, shared_waw)(in, out, n);
        break;
    case KVD_FAULT_SHARED_WAR:
        KVD_LAUNCH(1, n, 0, st, shared_war)(in, out, n);
        break;
    case KVD_FAULT_SHARED_UNINIT:
        KVD_LAUNCH(1, n, 0, st, shared_uninit)(in, out, n);
        break;
    case KVD_FAULT_GLOBAL_OOB:
        KVD_LAUNCH(1, n, 0, st, global_oob)(in, out, n);
        break;
    case KVD_FAULT_GLOBAL_RACE:
        KVD_LAUNCH(4, n, 0, st, global_race)(in, out, n);
        break;
    case KVD_FAULT_ATOMIC_OK:
        KVD_LAUNCH(1, n, 0, st, atomic_ok)(in, out, n);
        break;
    case KVD_FAULT_WARP_WAR:
    case KVD_FAULT_WARP_WAR_OK:
        KVD_LAUNCH(1, 32, 0, st, warp_war)(in, out, f == KVD_FAULT_WARP_WAR_OK);
        break;
    case KVD_FAULT_PDL_EARLY_READ:
    case KVD_FAULT_PDL_EARLY_WRITE:
    case KVD_FAULT_PDL_EARLY_TRIGGER:
    case KVD_FAULT_PDL_OK:
        KVD_LAUNCH(1, n, 0, st, pdl_first)(in, out, n);
        KVD_LAUNCH_PDL(1, n, 0, st, pdl_second)
        (in, out,
         f == KVD_FAULT_PDL_EARLY_READ      ? 1
         : f == KVD_FAULT_PDL_EARLY_WRITE   ? 2
         : f == KVD_FAULT_PDL_EARLY_TRIGGER ? 3
                                            : 0);
        break;
    case KVD_FAULT_BIG_DYN_SMEM:
        KVD_LAUNCH(1, n, 64 << 10, st, big_dyn_smem)(in, out, n);
        break;
    }
    return kvd_launch_status();
}

extern "C" void kvd_emu_to_f16(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = __half_as_ushort(__float2half_rn(in[i]));
}

extern "C" void kvd_emu_to_bf16(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

extern "C" float kvd_emu_f16_to_f32(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

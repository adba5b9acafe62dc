// Helpers shared by the kernels/*.cu files (internal, CUDA C++ only): element
// loads and stores for the KV dtypes, warp reductions, launch error checks.
#ifndef KVD_KERNEL_UTIL_CUH
#define KVD_KERNEL_UTIL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

#define KVD_LOG2E 1.4426950408889634f

// Launches and shared memory are written through these macros, so the same
// source also builds for the CPU emulation (-DKVD_CUDA=EMULATE,
// kernels/emu/): there a launch hands the kernel and its arguments to the
// SIMT runtime, and shared memory is laid out per block by it.
//   KVD_LAUNCH(grid, block, smem, stream, kernel<T...>)(args...);
//   KVD_SHARED(float, name, [N][M]);   KVD_SHARED(int, flag, );
//   KVD_DYN_SHARED(float, name);       (the launch's dynamic shared memory)
// Every launch is counted (kvd_k_launches, kernels.h) on the issuing thread.
// KVD_LAUNCH_PDL launches with programmatic dependent launch (below).
#ifdef KVD_CUDA_EMULATE
#define KVD_LAUNCH(grid, block, smem, stream, ...)                                                 \
    (kvd_note_launch(), kvd_emu_make_launcher(#__VA_ARGS__, __VA_ARGS__, grid, block, smem, stream))
#define KVD_LAUNCH_PDL(grid, block, smem, stream, ...)                                             \
    (kvd_note_launch(), kvd_emu_make_launcher(#__VA_ARGS__, __VA_ARGS__, grid, block, smem,        \
                                              stream, kvd_k_pdl_on() != 0))
#define KVD_SHARED(type, name, dims)                                                               \
    static kvd_emu_shared_key name##_key_;                                                         \
    auto &name = *reinterpret_cast<type(*) dims>(                                                  \
        kvd_emu_shared(&name##_key_, sizeof(type dims), alignof(type)))
#define KVD_DYN_SHARED(type, name) type *const name = static_cast<type *>(kvd_emu_dyn_shared())
#else
#define KVD_LAUNCH(grid, block, smem, stream, ...)                                                 \
    kvd_note_launch(), __VA_ARGS__<<<grid, block, smem, stream>>>
#define KVD_LAUNCH_PDL(grid, block, smem, stream, ...)                                             \
    kvd_note_launch(), kvd_make_pdl_launcher(__VA_ARGS__, grid, block, smem, stream)
#define KVD_SHARED(type, name, dims) __shared__ type name dims
#define KVD_DYN_SHARED(type, name) extern __shared__ type name[]
#endif

// Kernel launches issued by this thread (kvd_k_launches).
extern thread_local unsigned long long kvd_launch_count;
static inline void kvd_note_launch(void)
{
    kvd_launch_count++;
}

// Programmatic dependent launch (sm_90, kvd_k_pdl_on): a kernel launched
// with KVD_LAUNCH_PDL may start while the kernel before it on the stream is
// still running, once every block of that one called kvd_pdl_trigger() (or
// exited). Everything it does before kvd_pdl_wait() (which returns when the
// kernel before has completed and its writes are visible) must not read
// what that kernel writes, nor write anything: it may load weights. Kernels
// trigger after their own wait, so a prologue only ever overlaps the kernel
// just before. Elsewhere (older devices, a plain launch) both return at
// once. The emulator checks both rules (docs/emulation.md).
#ifdef KVD_CUDA_EMULATE
static inline void kvd_pdl_wait(void)
{
    kvd_emu_pdl_wait();
}
static inline void kvd_pdl_trigger(void)
{
    kvd_emu_pdl_trigger();
}
#else
static __device__ __forceinline__ void kvd_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cudaGridDependencySynchronize();
#endif
}
static __device__ __forceinline__ void kvd_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cudaTriggerProgrammaticLaunchCompletion();
#endif
}
// cudaLaunchKernelEx with the programmatic stream serialization attribute
// when kvd_k_pdl_on(); its error is the one kvd_launch_status returns.
template <class... P> struct kvd_pdl_launcher {
    void (*fn)(P...);
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    template <class... A> void operator()(A &&...a) const
    {
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem;
        cfg.stream = stream;
        cfg.attrs = &attr;
        cfg.numAttrs = kvd_k_pdl_on() ? 1 : 0;
        (void)cudaLaunchKernelEx(&cfg, fn, static_cast<A &&>(a)...);
    }
};
template <class... P>
static inline kvd_pdl_launcher<P...> kvd_make_pdl_launcher(void (*fn)(P...), dim3 grid, dim3 block,
                                                           size_t smem, cudaStream_t stream)
{
    return kvd_pdl_launcher<P...>{fn, grid, block, smem, stream};
}
#endif

// The status of the launch just made (and of nothing earlier that was
// already reported): 0 or a cudaError_t.
static inline int kvd_launch_status(void)
{
    return (int)cudaGetLastError();
}

static __device__ __forceinline__ float kvd_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float kvd_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ __forceinline__ float kvd_bf16_to_f32(uint16_t b)
{
    return __uint_as_float((uint32_t)b << 16);
}

// Round-to-nearest-even, NaN kept a (quiet) NaN: the same rule as the cpu
// backend's conversion.
static __device__ __forceinline__ uint16_t kvd_f32_to_bf16(float f)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

static __device__ __forceinline__ float kvd_f16_to_f32(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

// e^x as the cpu backend computes it for SiLU (compute_cpu.c silu_exp:
// ggml's vectorized expf as its AVX-512 builds compute it), operation for
// operation with explicit fmaf, so the device gives the cpu's bits: n =
// round(x log2 e) by the 1.5 * 2^23 shift, b = x - n ln2 (ln2 in two parts),
// p = ((c5 b + c4) b^2 + (c3 b + c2)) b^2 + (c1 b + 1), then p * 2^n in two
// exact power-of-two factors.
static __device__ __forceinline__ float kvd_silu_exp(float x)
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

// RoPE's angle for pair i at position pos, computed in double as the cpu
// backend does (so both round to the same f32 cos and sin), and the
// rotation of one pair with its two products rounded apart (no fused
// multiply-add, as the cpu's portable build).
static __device__ __forceinline__ void kvd_rope_cs(uint32_t pos, int i, int n_rot, float base,
                                                   const float *ff, float *c, float *s)
{
    double theta = (double)pos * pow((double)base, -2.0 * i / n_rot);
    if (ff)
        theta /= ff[i];
    *c = (float)cos(theta);
    *s = (float)sin(theta);
}
static __device__ __forceinline__ void kvd_rope_rot(float *a, float *b, float c, float s)
{
    const float x0 = *a, x1 = *b;
    *a = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *b = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Eight consecutive KV elements of dtype DT at p (16-byte aligned for the
// 16-bit types, 32-byte for f32) to f32.
template <int DT> static __device__ __forceinline__ void kvd_load8(const void *p, float *o)
{
    if (DT == KVD_K_F32) {
        const float4 *f = (const float4 *)p;
        float4 a = f[0], b = f[1];
        o[0] = a.x;
        o[1] = a.y;
        o[2] = a.z;
        o[3] = a.w;
        o[4] = b.x;
        o[5] = b.y;
        o[6] = b.z;
        o[7] = b.w;
    } else {
        uint4 u = *(const uint4 *)p;
        uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint16_t lo = (uint16_t)(w[i] & 0xffffu), hi = (uint16_t)(w[i] >> 16);
            if (DT == KVD_K_BF16) {
                o[2 * i] = kvd_bf16_to_f32(lo);
                o[2 * i + 1] = kvd_bf16_to_f32(hi);
            } else {
                o[2 * i] = kvd_f16_to_f32(lo);
                o[2 * i + 1] = kvd_f16_to_f32(hi);
            }
        }
    }
}

template <int DT> static __device__ __forceinline__ size_t kvd_dtype_bytes(void)
{
    return DT == KVD_K_F32 ? 4 : 2;
}

template <int DT> static __device__ __forceinline__ float kvd_load1(const void *p, size_t i)
{
    if (DT == KVD_K_F32)
        return ((const float *)p)[i];
    if (DT == KVD_K_BF16)
        return kvd_bf16_to_f32(((const uint16_t *)p)[i]);
    return kvd_f16_to_f32(((const uint16_t *)p)[i]);
}

template <int DT> static __device__ __forceinline__ void kvd_store1(void *p, size_t i, float v)
{
    if (DT == KVD_K_F32)
        ((float *)p)[i] = v;
    else if (DT == KVD_K_BF16)
        ((uint16_t *)p)[i] = kvd_f32_to_bf16(v);
    else
        ((uint16_t *)p)[i] = __half_as_ushort(__float2half_rn(v));
}

// Q8_0 block: f16 scale d, then 32 int8 q; value = d * q. 34 bytes, so
// blocks are only 2-byte aligned: read them as bytes.
static __device__ __forceinline__ float kvd_q8_0_value(const uint8_t *src, size_t i)
{
    const uint8_t *blk = src + (i / 32) * 34;
    uint16_t d = (uint16_t)(blk[0] | (blk[1] << 8));
    return kvd_f16_to_f32(d) * (float)(int8_t)blk[2 + i % 32];
}

// Element i of a weight array of GGUF type wtype (F32, F16, BF16, Q8_0; the
// other quantized types go by 32-value chunks: quant.cuh's kvd_deq32).
static __device__ __forceinline__ float kvd_any_to_f32(const void *src, int wtype, size_t i)
{
    switch (wtype) {
    case KVD_KW_F32:
        return ((const float *)src)[i];
    case KVD_KW_F16:
        return kvd_f16_to_f32(((const uint16_t *)src)[i]);
    case KVD_KW_BF16:
        return kvd_bf16_to_f32(((const uint16_t *)src)[i]);
    default:
        return kvd_q8_0_value((const uint8_t *)src, i);
    }
}

// Bytes of one row of n elements of GGUF type wtype (n a multiple of the
// type's block: quant.cuh).
static __host__ __device__ __forceinline__ size_t kvd_row_bytes(int wtype, size_t n)
{
    switch (wtype) {
    case KVD_KW_F32:
        return n * 4;
    case KVD_KW_Q8_0:
        return n / 32 * 34;
    case KVD_KW_Q4_0:
        return n / 32 * 18;
    case KVD_KW_Q4_1:
        return n / 32 * 20;
    case KVD_KW_Q5_0:
        return n / 32 * 22;
    case KVD_KW_Q5_1:
        return n / 32 * 24;
    case KVD_KW_Q4_K:
        return n / 256 * 144;
    case KVD_KW_Q5_K:
        return n / 256 * 176;
    case KVD_KW_Q6_K:
        return n / 256 * 210;
    default:
        return n * 2;
    }
}

// Element offset of (layer, K=0/V=1, kv_head, row) inside one block.
static __device__ __forceinline__ size_t kvd_kv_off(const kvd_k_kv &kv, int layer, int kv_sel,
                                                    int head, int row)
{
    return ((((size_t)layer * 2 + kv_sel) * kv.kv_heads + head) * kv.block_tokens + row) *
           kv.head_dim;
}

static inline unsigned kvd_blocks_for(size_t n, unsigned threads)
{
    size_t b = (n + threads - 1) / threads;
    return b > 0x7fffffffu ? 0x7fffffffu : (unsigned)b;
}

#endif

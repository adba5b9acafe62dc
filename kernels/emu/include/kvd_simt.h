// The device side of the emulation build (C++ only, included by
// cuda_runtime.h): what kernels/*.cu use of CUDA C++, run on the CPU by
// kernels/emu/simt.cc. Every CUDA thread is a fiber; a block's threads run
// on the launching host thread until each reaches a barrier, a warp
// operation or its end, in the order the emulator chooses (forward, reverse
// or seeded random, per launch). Shared memory is declared with KVD_SHARED /
// KVD_DYN_SHARED (kernel_util.cuh) so the emulator can lay it out per block,
// poison it and watch it.
#ifndef KVD_EMU_SIMT_H
#define KVD_EMU_SIMT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <new>
#include <tuple>
#include <utility>

// ---- CUDA C++ keywords ------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Plain __shared__ cannot be laid out per block here: use KVD_SHARED.
#define __shared__ kvd_emu_use_KVD_SHARED_for_shared_memory
static constexpr int warpSize = 32;

// Emulator-internal state is read outside the memory checks.
#define KVD_EMU_UNCHECKED __attribute__((no_sanitize_address))

// ---- vector and index types -----------------------------------------------
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) float2 {
    float x, y;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
    unsigned x, y;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
struct __attribute__((aligned(16))) int4 {
    int x, y, z, w;
};
static inline float2 make_float2(float x, float y)
{
    return float2{x, y};
}
static inline float4 make_float4(float x, float y, float z, float w)
{
    return float4{x, y, z, w};
}
static inline uint2 make_uint2(unsigned x, unsigned y)
{
    return uint2{x, y};
}
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
    return uint4{x, y, z, w};
}

// ---- the running thread -----------------------------------------------------
struct kvd_emu_thread_view {
    uint3 thread_idx, block_idx;
    dim3 block_dim, grid_dim;
};
extern thread_local const kvd_emu_thread_view *kvd_emu_view;
KVD_EMU_UNCHECKED static inline uint3 kvd_emu_thread_idx()
{
    return kvd_emu_view->thread_idx;
}
KVD_EMU_UNCHECKED static inline uint3 kvd_emu_block_idx()
{
    return kvd_emu_view->block_idx;
}
KVD_EMU_UNCHECKED static inline dim3 kvd_emu_block_dim()
{
    return kvd_emu_view->block_dim;
}
KVD_EMU_UNCHECKED static inline dim3 kvd_emu_grid_dim()
{
    return kvd_emu_view->grid_dim;
}
#define threadIdx (kvd_emu_thread_idx())
#define blockIdx (kvd_emu_block_idx())
#define blockDim (kvd_emu_block_dim())
#define gridDim (kvd_emu_grid_dim())

// ---- barriers and warp operations (simt.cc) ---------------------------------
void kvd_emu_syncthreads(const char *file, int line);
enum kvd_emu_warp_kind {
    KVD_EMU_SHFL,
    KVD_EMU_SHFL_XOR,
    KVD_EMU_SHFL_UP,
    KVD_EMU_SHFL_DOWN,
    KVD_EMU_SYNCWARP,
    KVD_EMU_BALLOT
};
uint64_t kvd_emu_warp_op(int kind, unsigned mask, int arg, int width, uint64_t bits,
                         const char *file, int line);
#define __syncthreads() kvd_emu_syncthreads(__FILE__, __LINE__)
// __syncwarp() and __syncwarp(mask), with the caller's place: an object-like
// macro naming a call site object, since a variadic macro's empty argument
// list keeps its comma under g++'s strict -std=c++17 (the ASan build).
struct kvd_emu_syncwarp_at {
    const char *file;
    int line;
    void operator()(unsigned mask = 0xffffffffu) const
    {
        kvd_emu_warp_op(KVD_EMU_SYNCWARP, mask, 0, 32, 0, file, line);
    }
};
#define __syncwarp                                                                                 \
    kvd_emu_syncwarp_at                                                                            \
    {                                                                                              \
        __FILE__, __LINE__                                                                         \
    }

template <class T>
static inline T kvd_emu_shfl_(int kind, unsigned mask, T v, int arg, int width, const char *file,
                              int line)
{
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = kvd_emu_warp_op(kind, mask, arg, width, bits, file, line);
    T r;
    memcpy(&r, &bits, sizeof r);
    return r;
}
#define __shfl_sync(mask, v, lane, ...)                                                            \
    kvd_emu_shfl_(KVD_EMU_SHFL, mask, v, lane, kvd_emu_width_(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lm, ...)                                                          \
    kvd_emu_shfl_(KVD_EMU_SHFL_XOR, mask, v, lm, kvd_emu_width_(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...)                                                            \
    kvd_emu_shfl_(KVD_EMU_SHFL_UP, mask, v, d, kvd_emu_width_(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...)                                                          \
    kvd_emu_shfl_(KVD_EMU_SHFL_DOWN, mask, v, d, kvd_emu_width_(__VA_ARGS__), __FILE__, __LINE__)
static inline int kvd_emu_width_(int w = 32)
{
    return w;
}
#define __ballot_sync(mask, pred)                                                                  \
    ((unsigned)kvd_emu_warp_op(KVD_EMU_BALLOT, mask, 0, 32, (pred) ? 1u : 0u, __FILE__, __LINE__))
#define __any_sync(mask, pred) (__ballot_sync(mask, pred) != 0)
#define __all_sync(mask, pred) (__ballot_sync(mask, pred) == (mask))

// ---- shared memory ------------------------------------------------------------
// One key per declaration (per template instantiation): the emulator gives
// it the same offset in every block of a launch.
struct kvd_emu_shared_key {
    uint64_t launch;
    size_t offset;
};
void *kvd_emu_shared(kvd_emu_shared_key *key, size_t bytes, size_t align);
void *kvd_emu_dyn_shared();
// Atomics are exempt from the race check but still recorded, so a plain
// access racing an atomic one is reported.
void kvd_emu_note_atomic(const void *p, size_t bytes);

// ---- atomics (a block runs on one host thread: plain read-modify-write) -----
template <class T> KVD_EMU_UNCHECKED static inline T kvd_emu_atomic_add_(T *p, T v)
{
    kvd_emu_note_atomic(p, sizeof *p);
    T old = *p;
    *p = old + v;
    return old;
}
static inline int atomicAdd(int *p, int v)
{
    return kvd_emu_atomic_add_(p, v);
}
static inline unsigned atomicAdd(unsigned *p, unsigned v)
{
    return kvd_emu_atomic_add_(p, v);
}
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    return kvd_emu_atomic_add_(p, v);
}
static inline float atomicAdd(float *p, float v)
{
    return kvd_emu_atomic_add_(p, v);
}
static inline double atomicAdd(double *p, double v)
{
    return kvd_emu_atomic_add_(p, v);
}
template <class T> KVD_EMU_UNCHECKED static inline T atomicMax(T *p, T v)
{
    kvd_emu_note_atomic(p, sizeof *p);
    T old = *p;
    *p = old < v ? v : old;
    return old;
}
template <class T> KVD_EMU_UNCHECKED static inline T atomicExch(T *p, T v)
{
    kvd_emu_note_atomic(p, sizeof *p);
    T old = *p;
    *p = v;
    return old;
}
template <class T> KVD_EMU_UNCHECKED static inline T atomicCAS(T *p, T cmp, T v)
{
    kvd_emu_note_atomic(p, sizeof *p);
    T old = *p;
    if (old == cmp)
        *p = v;
    return old;
}

// ---- loads with cache hints: plain (checked) loads --------------------------
template <class T> static inline T __ldg(const T *p)
{
    return *p;
}
template <class T> static inline T __ldcs(const T *p)
{
    return *p;
}
template <class T> static inline T __ldcg(const T *p)
{
    return *p;
}
template <class T> static inline T __ldlu(const T *p)
{
    return *p;
}
template <class T> static inline void __stcs(T *p, T v)
{
    *p = v;
}
static inline void __threadfence()
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
static inline void __threadfence_block()
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// ---- math and bit casts -------------------------------------------------------
static inline float __uint_as_float(unsigned u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __int_as_float(int u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline int __float_as_int(float f)
{
    int u;
    memcpy(&u, &f, 4);
    return u;
}
static inline double __longlong_as_double(long long u)
{
    double f;
    memcpy(&f, &u, 8);
    return f;
}
static inline long long __double_as_longlong(double f)
{
    long long u;
    memcpy(&u, &f, 8);
    return u;
}
// The fast intrinsics are the accurate operations: the emulation checks
// logic, not the last bits of the hardware's approximations.
static inline float __fdividef(float a, float b)
{
    return a / b;
}
// The IEEE operations nvcc never contracts into a fused multiply-add (the
// host compiler does not contract these calls either).
static inline float __fmul_rn(float a, float b)
{
    return a * b;
}
static inline float __fadd_rn(float a, float b)
{
    return a + b;
}
static inline float __fsub_rn(float a, float b)
{
    return a - b;
}
static inline float rsqrtf(float x)
{
    return 1.0f / sqrtf(x);
}
static inline float __saturatef(float x)
{
    return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x;
}
static inline int __popc(unsigned x)
{
    return __builtin_popcount(x);
}
static inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}
static inline int __clz(int x)
{
    return x ? __builtin_clz((unsigned)x) : 32;
}
static inline int __ffs(int x)
{
    return __builtin_ffs(x);
}
static inline int min(int a, int b)
{
    return a < b ? a : b;
}
static inline int max(int a, int b)
{
    return a > b ? a : b;
}
static inline unsigned min(unsigned a, unsigned b)
{
    return a < b ? a : b;
}
static inline unsigned max(unsigned a, unsigned b)
{
    return a > b ? a : b;
}
static inline long long min(long long a, long long b)
{
    return a < b ? a : b;
}
static inline long long max(long long a, long long b)
{
    return a > b ? a : b;
}
static inline unsigned long long min(unsigned long long a, unsigned long long b)
{
    return a < b ? a : b;
}
static inline unsigned long long max(unsigned long long a, unsigned long long b)
{
    return a > b ? a : b;
}
static inline float min(float a, float b)
{
    return fminf(a, b);
}
static inline float max(float a, float b)
{
    return fmaxf(a, b);
}

// ---- launches -------------------------------------------------------------------
// A launch owns a copy of its arguments (kept by a graph capture and reused
// on every replay); every thread calls the kernel with them.
struct kvd_emu_call {
    void (*run)(const void *self); // calls the kernel with the stored arguments
    void (*destroy)(void *self);
    size_t bytes; // of the object: the threads may read it
};
cudaError_t kvd_emu_launch(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, kvd_emu_call *call, bool pdl);
// Programmatic dependent launch (KVD_LAUNCH_PDL): the calling thread passed
// cudaGridDependencySynchronize / triggers its dependents.
void kvd_emu_pdl_wait();
void kvd_emu_pdl_trigger();

template <class... P> struct kvd_emu_call_of : kvd_emu_call {
    void (*fn)(P...);
    std::tuple<P...> args;
    template <class... A>
    kvd_emu_call_of(void (*f)(P...), A &&...a)
        : kvd_emu_call{run_, destroy_, sizeof(*this)}, fn(f), args(std::forward<A>(a)...)
    {
    }
    static void run_(const void *self)
    {
        const kvd_emu_call_of *c = static_cast<const kvd_emu_call_of *>(self);
        std::apply(c->fn, c->args);
    }
    static void destroy_(void *self)
    {
        delete static_cast<kvd_emu_call_of *>(self);
    }
};

template <class... P> struct kvd_emu_launcher {
    const char *name;
    void (*fn)(P...);
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    bool pdl;
    template <class... A> void operator()(A &&...a) const
    {
        kvd_emu_call_of<P...> *c =
            new (std::nothrow) kvd_emu_call_of<P...>(fn, std::forward<A>(a)...);
        kvd_emu_launch(name, (const void *)fn, grid, block, smem, stream, c, pdl);
    }
};
template <class... P>
static inline kvd_emu_launcher<P...> kvd_emu_make_launcher(const char *name, void (*fn)(P...),
                                                           dim3 grid, dim3 block, size_t smem,
                                                           cudaStream_t stream, bool pdl = false)
{
    return kvd_emu_launcher<P...>{name, fn, grid, block, smem, stream, pdl};
}

#endif

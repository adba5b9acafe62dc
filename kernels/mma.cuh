// Tensor-core building blocks of kernels/*.cu (internal, CUDA C++ only),
// written once for both builds: inline PTX under nvcc (sm_80 and later), the
// emulator's warp-level instructions in the emulation build
// (kernels/emu/mma.cc, the same fragment layouts):
//   kvd_mma16816<BF16>   mma.sync.aligned.m16n8k16.row.col, f16 or bf16 in,
//                        f32 accumulators
//   kvd_mma_s8<K>        mma.sync.aligned.m16n8k32 (K 32) or m16n8k16 (K 16)
//                        .row.col.s32.s8.s8.s32: int8 in, exact s32 sums
//   kvd_ldsm<N, TRANS>   ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16
//   kvd_cp_async<CAP>    cp.async.cg 16-byte global -> shared copies, grouped
//   kvd_pack2<BF16>      two floats -> one register of 16-bit values
//
// Fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16
// with floating point type"), g = lane >> 2, t = lane & 3, each 32-bit
// register two 16-bit elements, the lower-numbered in the low half:
//   A 16x16:  a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]
//             a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B 16x8:   b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
//   C/D 16x8: c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
// Fragments of mma.m16n8k32 / m16n8k16 with .s8 (PTX ISA, "Matrix
// Fragments for mma.m16n8k32" and "... mma.m16n8k16 with integer type"),
// each register four 8-bit elements, the lowest-numbered in the low byte:
//   A 16x32:  a[0] = A[g][4t..4t+3]        a[1] = A[g+8][4t..4t+3]
//             a[2] = A[g][16+4t..16+4t+3]  a[3] = A[g+8][16+4t..16+4t+3]
//   B 32x8:   b[0] = B[4t..4t+3][g]        b[1] = B[16+4t..16+4t+3][g]
//   k 16:     a[0], a[1] and b[0] only (A 16x16, B 16x8)
//   C/D s32:  as the f32 C/D above.
// ldmatrix: lane 8m + i gives the shared address of row i (16 bytes) of
// matrix m; lane (g, t) receives in r[m] row g, columns 2t and 2t+1 of
// matrix m, or with .trans column g, rows 2t and 2t+1.
#ifndef KVD_MMA_CUH
#define KVD_MMA_CUH

#include "kernel_util.cuh"

#ifdef KVD_CUDA_EMULATE
#include "kvd_simt_mma.h"
// The call site of a warp-wide instruction, so the emulator can require that
// all 32 lanes execute the same one.
#define KVD_MMA_SITE , const char *site_file_ = __builtin_FILE(), int site_line_ = __builtin_LINE()
#else
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/mma.cuh needs sm_80 or later (mma.sync m16n8k16 with bf16, cp.async)"
#endif
#define KVD_MMA_SITE
#endif

// The linear index of the calling thread in its block, modulo 32.
static __device__ __forceinline__ int kvd_lane_id(void)
{
    return (int)((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) & 31;
}

// Sixteen zero bytes. In the emulation build the host compiler must not see
// the constant: it would turn the store into a memset call, which the memory
// checks (racecheck, order check) do not see.
static __device__ __forceinline__ uint4 kvd_zero_u4(void)
{
#ifdef KVD_CUDA_EMULATE
    uint32_t z = 0;
    __asm__("" : "+r"(z));
    return make_uint4(z, z, z, z);
#else
    return make_uint4(0, 0, 0, 0);
#endif
}

// lo and hi rounded to nearest even to f16 (BF16 false) or bf16, packed as
// one register: lo in the low half.
template <bool BF16> static __device__ __forceinline__ uint32_t kvd_pack2(float lo, float hi)
{
#ifdef KVD_CUDA_EMULATE
    uint32_t a, b;
    if (BF16) {
        a = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
        b = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
    } else {
        a = __half_as_ushort(__float2half_rn(lo));
        b = __half_as_ushort(__float2half_rn(hi));
    }
    return a | b << 16;
#else
    uint32_t r;
    if (BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&r, &v, 4);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&r, &v, 4);
    }
    return r;
#endif
}

// The low (hi: high) 16-bit element of a packed register, as a float.
template <bool BF16> static __device__ __forceinline__ float kvd_unpack_lo(uint32_t w)
{
    return BF16 ? kvd_bf16_to_f32((uint16_t)(w & 0xffffu))
                : kvd_f16_to_f32((uint16_t)(w & 0xffffu));
}
template <bool BF16> static __device__ __forceinline__ float kvd_unpack_hi(uint32_t w)
{
    return kvd_unpack_lo<BF16>(w >> 16);
}

// d = a * b + c for one m16n8k16 tile (d may be c). Every lane of the warp
// must call it, at the same call site.
template <bool BF16>
static __device__ __forceinline__ void kvd_mma16816(float *d, const uint32_t *a, const uint32_t *b,
                                                    const float *c KVD_MMA_SITE)
{
#ifdef KVD_CUDA_EMULATE
    kvd_emu_mma_lane l;
    l.fn = BF16 ? kvd_emu_mma_bf16 : kvd_emu_mma_f16;
    for (int i = 0; i < 4; i++) {
        l.a[i] = a[i];
        l.c[i] = c[i];
        l.d[i] = 0.0f;
    }
    l.b[0] = b[0];
    l.b[1] = b[1];
    kvd_emu_warp_collective(&l, site_file_, site_line_);
    for (int i = 0; i < 4; i++)
        d[i] = l.d[i];
#else
    if (BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                       "f"(c[1]), "f"(c[2]), "f"(c[3]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                       "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

// d = a * b + c for one m16n8k32 (K 32: a[0..3], b[0..1]) or m16n8k16
// (K 16: a[0..1], b[0]) tile of int8 values with s32 accumulators, exact
// (d may be c). Every lane of the warp must call it, at the same call site.
template <int K>
static __device__ __forceinline__ void kvd_mma_s8(int *d, const uint32_t *a, const uint32_t *b,
                                                  const int *c KVD_MMA_SITE)
{
    static_assert(K == 32 || K == 16, "mma.sync with s8 inputs is m16n8k32 or m16n8k16");
#ifdef KVD_CUDA_EMULATE
    kvd_emu_mma_s8_lane l;
    l.fn = K == 32 ? kvd_emu_mma_s8_k32 : kvd_emu_mma_s8_k16;
    for (int i = 0; i < 4; i++) {
        l.a[i] = i < K / 8 ? a[i] : 0u;
        l.c[i] = c[i];
        l.d[i] = 0;
    }
    l.b[0] = b[0];
    l.b[1] = K == 32 ? b[1] : 0u;
    kvd_emu_warp_collective(&l, site_file_, site_line_);
    for (int i = 0; i < 4; i++)
        d[i] = l.d[i];
#else
    if (K == 32)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]),
                       "r"(c[1]), "r"(c[2]), "r"(c[3]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
                     "{%4, %5}, {%6}, {%7, %8, %9, %10};\n"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
#endif
}

// r[0..N) = N 8x8 matrices of 16-bit elements from shared memory (N = 1, 2
// or 4; TRANS: each transposed). `row`: this lane's row address (16-byte
// aligned shared memory), used by lanes < 8 N. Every lane of the warp must
// call it, at the same call site.
template <int N, bool TRANS>
static __device__ __forceinline__ void kvd_ldsm(uint32_t *r, const void *row KVD_MMA_SITE)
{
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
#ifdef KVD_CUDA_EMULATE
    kvd_emu_ldsm_lane l;
    l.fn = kvd_emu_ldsm;
    l.count = N;
    l.trans = TRANS;
    for (int i = 0; i < 4; i++)
        l.row[i] = l.r[i] = 0;
    if (kvd_lane_id() < 8 * N) {
        if (((uintptr_t)row & 15) || !kvd_emu_in_shared(row, 16)) {
            kvd_emu_device_fault("ldmatrix: a row address that is not 16 bytes of shared memory, "
                                 "16-byte aligned");
        } else {
            const uint4 v = *(const uint4 *)row; // this lane's read, for the racecheck
            l.row[0] = v.x;
            l.row[1] = v.y;
            l.row[2] = v.z;
            l.row[3] = v.w;
        }
    }
    kvd_emu_warp_collective(&l, site_file_, site_line_);
    for (int i = 0; i < N; i++)
        r[i] = l.r[i];
#else
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(row);
    if (N == 1 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                     : "=r"(r[0])
                     : "r"(a));
    else if (N == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                     : "=r"(r[0])
                     : "r"(a));
    else if (N == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(a));
    else if (N == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(a));
    else if (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#endif
}

// Asynchronous 16-byte copies from global to shared memory (cp.async.cg,
// which bypasses L1): copy16 issues one (both addresses 16-byte aligned),
// commit closes the group of those issued since the last commit, and
// wait<N> returns when at most the N most recent groups are still in
// flight. The bytes are the waiting thread's to read after its wait, other
// threads' after a barrier that follows it. CAP: the most copies one thread
// has in flight (the emulation build keeps them in the object).
//
// The emulation build performs a copy when its thread waits for it (the
// latest the hardware may), so a read before the wait, or a barrier
// missing after it, shows as a read of stale or poisoned shared memory,
// which the racecheck reports.
template <int CAP> struct kvd_cp_async {
#ifdef KVD_CUDA_EMULATE
    struct pending {
        void *dst;
        const void *src;
        int group;
    };
    pending q[CAP];
    int n = 0, open = 0; // copies held; the number of the group being filled

    __device__ void run(int i)
    {
        // Rebuilt from its fields: a plain struct copy compiles to memmove,
        // which the memory checks do not see.
        const uint4 v = *(const uint4 *)q[i].src;
        *(uint4 *)q[i].dst = make_uint4(v.x, v.y, v.z, v.w);
    }
    __device__ void copy16(void *dst, const void *src)
    {
        if (((uintptr_t)dst & 15) || ((uintptr_t)src & 15) || !kvd_emu_in_shared(dst, 16)) {
            kvd_emu_device_fault("cp.async: a destination that is not 16 bytes of shared memory, "
                                 "or an address not 16-byte aligned");
            return;
        }
        if (n == CAP) {
            kvd_emu_device_fault("cp.async: more copies in flight than the kernel declared (CAP)");
            return;
        }
        q[n++] = pending{dst, (const void *)src, open};
    }
    __device__ void commit()
    {
        open++;
    }
    template <int N> __device__ void wait()
    {
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (q[i].group < open - N)
                run(i);
            else
                q[k++] = q[i];
        }
        n = k;
    }
#else
    __device__ __forceinline__ void copy16(void *dst, const void *src)
    {
        const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
    }
    __device__ __forceinline__ void commit()
    {
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    template <int N> __device__ __forceinline__ void wait()
    {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
    }
#endif
};

#endif

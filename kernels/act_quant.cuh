// Activations quantized for the quantized weights' GEMV (internal, CUDA C++
// only): llama.cpp's arithmetic, which the cpu backend shares
// (compute_cpu_quant.c), computed by one warp per block of values, into
// shared memory (the GEMV's prologue), or device memory (a separate launch
// when they do not fit, or the last block of the GEMV that produced x).
// x is read from L2 (it may have been written by other blocks of the same
// launch). Layout, for n_tokens rows of `in` values:
//   qs    int8 [NT][in], each row's 16-byte chunks swizzled (act_pos below)
//   K-quants (Q8_K, super-blocks of 256): d f32 [NT][in/256] (1/iscale),
//         bs int32 [NT][in/16] (the sum of each 16 quants); the chunks of
//         16 values stored in the order of the weight type's units
//         (act_k_chunk)
//   legacy (Q8_0/Q8_1, blocks of 32): m float4 [NT][in/32] = (f16 of d,
//         f16 of d * sum, the sum as int bits, 0)
#ifndef KVD_ACT_QUANT_CUH
#define KVD_ACT_QUANT_CUH

#include "kernel_util.cuh"

// A GEMV lane reads the activations of one weight unit (64 values for the
// K-quants' quarter super-blocks, 32 for the legacy blocks) as 16-byte
// chunks, consecutive lanes consecutive units; eight lanes are served per
// shared-memory wavefront, so chunk c of unit u goes to chunk slot
// C*u + (c ^ ((u / (8/C)) % C)) (C chunks per unit): the eight lanes then
// hit eight different bank groups. Byte offset of value v of a row.
template <int UNIT> static __host__ __device__ __forceinline__ int act_pos(int v)
{
    constexpr int C = UNIT / 16, PER = 8 / C;
    const int u = v / UNIT, c = (v % UNIT) / 16;
    return (C * u + (c ^ ((u / PER) % C))) * 16 + v % 16;
}
// Byte offset of chunk c (compile-time) of unit u.
template <int UNIT, int c> static __device__ __forceinline__ int act_chunk(int u)
{
    constexpr int C = UNIT / 16, PER = 8 / C;
    return (C * u + (c ^ ((u / PER) % C))) * 16;
}

// Pointers of one activation block (see the layout above).
struct actq {
    const int8_t *qs;
    const float *d;  // K
    const int *bs;   // K
    const float4 *m; // legacy
};

// Bytes of the layout for nt rows of `in` values (each array 16-byte
// aligned), and the pointers into it at base.
static __host__ __device__ __forceinline__ size_t act_bytes(bool kq, int nt, int in)
{
    const size_t n = (size_t)nt * in, a = (n + 15) & ~(size_t)15;
    if (kq)
        return a + (((size_t)nt * (in / 256) * 4 + 15) & ~(size_t)15) + n / 16 * 4;
    return a + n / 32 * 16;
}
static __host__ __device__ __forceinline__ void
act_ptrs(void *base, bool kq, int nt, int in, int8_t **qs, float **d, int **bs, float4 **m)
{
    (void)kq; // the K arrays and the legacy one both start after qs
    const size_t n = (size_t)nt * in, a = (n + 15) & ~(size_t)15;
    *qs = (int8_t *)base;
    *d = (float *)((char *)base + a);
    *bs = (int *)((char *)base + a + (((size_t)nt * (in / 256) * 4 + 15) & ~(size_t)15));
    *m = (float4 *)((char *)base + a);
}

static __device__ __forceinline__ int act_warp_isum(int v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float act_f16_round(float v)
{
    return __half2float(__float2half_rn(v));
}

// One warp, one block of 32 (block g of the flat [NT][in/32] sequence;
// every lane must call): lane i quantizes value i as ggml's Q8_0/Q8_1 do:
// d = max|x| / 127, q = round-half-even(x * 127 / max|x|), the f16 of d
// and of d * sum(q).
static __device__ __forceinline__ void act_quant32(const float *x, int in, int g, int lane,
                                                   int8_t *qs, float4 *m)
{
    const int per = in / 32, t = g / per, b = g % per;
    const float v = __ldcg(x + (size_t)t * in + (size_t)b * 32 + lane);
    const float amax = kvd_warp_max(fabsf(v));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int q = (int)rintf(v * id);
    q = q > 127 ? 127 : q < -127 ? -127 : q;
    // four lanes' quants as one word (a word is the unit of shared memory)
    uint32_t w = (uint32_t)(uint8_t)(int8_t)q;
    w |= (uint32_t)(uint8_t)(int8_t)__shfl_down_sync(0xffffffffu, q, 1) << 8;
    w |= (uint32_t)(uint8_t)(int8_t)__shfl_down_sync(0xffffffffu, q, 2) << 16;
    w |= (uint32_t)(uint8_t)(int8_t)__shfl_down_sync(0xffffffffu, q, 3) << 24;
    if (lane % 4 == 0)
        *(uint32_t *)(qs + (size_t)t * in + act_pos<32>(b * 32 + lane)) = w;
    const int sum = act_warp_isum(q);
    if (lane == 0)
        m[g] =
            make_float4(act_f16_round(d), act_f16_round(d * (float)sum), __int_as_float(sum), 0.0f);
}

// The K-quants' units are quarters of a super-block: 64 consecutive values
// for Q4_K/Q5_K (quarter v: values 64v ..), and for Q6_K the four runs of
// 16 values 128h + 32k + l0 (h = v / 2, l0 = 16 (v % 2), k < 4). The 16
// chunks of 16 values of a super-block are stored by unit: chunk ch (values
// 16ch ..) is chunk c of quarter q (and its sum of 16 is bs entry 4q + c).
template <bool Q6> static __device__ __forceinline__ void act_k_chunk(int ch, int *q, int *c)
{
    if (Q6) {
        *q = 2 * (ch / 8) + ch % 2;
        *c = (ch % 8) / 2;
    } else {
        *q = ch / 4;
        *c = ch % 4;
    }
}

// One warp, one super-block of 256 (g of [NT][in/256]): lane i quantizes
// values 8i..8i+7 as ggml's Q8_K: mx the value of largest magnitude (the
// first on ties), iscale = -127 / mx, q = min(127, round-half-even(iscale *
// x)), d = 1 / iscale, and the sums of each 16 q (all zero for a zero
// block). Q6: the chunks in Q6_K's quarter order (act_k_chunk).
// act_quant256_v: the same from the lane's 8 values in registers.
template <bool Q6>
static __device__ __forceinline__ void act_quant256_v(const float v[8], int in, int g, int lane,
                                                      int8_t *qs, float *d, int *bs)
{
    const int per = in / 256, t = g / per, s = g % per;
    float amax = 0.0f, mx = 0.0f;
    int idx = 0;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (fabsf(v[i]) > amax)
            amax = fabsf(v[i]), mx = v[i], idx = 8 * lane + i;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(0xffffffffu, amax, o);
        float om = __shfl_xor_sync(0xffffffffu, mx, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (oa > amax || (oa == amax && oi < idx))
            amax = oa, mx = om, idx = oi;
    }
    int sum = 0;
    uint32_t lo = 0, hi = 0;
    const float iscale = amax != 0.0f ? -127.0f / mx : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int r = amax != 0.0f ? (int)rintf(iscale * v[i]) : 0;
        r = r > 127 ? 127 : r;
        sum += r;
        if (i < 4)
            lo |= (uint32_t)(uint8_t)(int8_t)r << (8 * i);
        else
            hi |= (uint32_t)(uint8_t)(int8_t)r << (8 * (i - 4));
    }
    uint2 packed;
    packed.x = lo;
    packed.y = hi;
    int q, c;
    act_k_chunk<Q6>(lane / 2, &q, &c);
    // value 64 * (4s + q) + 16c + 8 (lane % 2) of the row, in unit order
    *(uint2 *)(qs + (size_t)t * in + act_pos<64>(256 * s + 64 * q + 16 * c + 8 * (lane % 2))) =
        packed;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0)
        bs[(size_t)t * (in / 16) + (size_t)s * 16 + 4 * q + c] = sum;
    if (lane == 0)
        d[g] = amax != 0.0f ? 1.0f / iscale : 0.0f;
}
template <bool Q6>
static __device__ __forceinline__ void act_quant256(const float *x, int in, int g, int lane,
                                                    int8_t *qs, float *d, int *bs)
{
    const int per = in / 256, t = g / per, s = g % per;
    const float4 *xv = (const float4 *)(x + (size_t)t * in + (size_t)s * 256 + 8 * lane);
    const float4 v0 = __ldcg(xv), v1 = __ldcg(xv + 1);
    const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    act_quant256_v<Q6>(v, in, g, lane, qs, d, bs);
}

// Blocks of 32 (act_quant32's arithmetic, so its bytes) from values in
// registers: lane i holds values 8i .. 8i + 7 of super-block s (256 values)
// of row t, so blocks 8s .. 8s + 7 of the row, four lanes each.
static __device__ __forceinline__ void act_quant32_v8(const float v[8], int in, int t, int s,
                                                      int lane, int8_t *qs, float4 *m)
{
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++)
        amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = (int)rintf(v[i] * id);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        sum += q;
        if (i < 4)
            lo |= (uint32_t)(uint8_t)(int8_t)q << (8 * i);
        else
            hi |= (uint32_t)(uint8_t)(int8_t)q << (8 * (i - 4));
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int b = 8 * s + lane / 4; // the block of 32 in the row
    uint2 packed;
    packed.x = lo;
    packed.y = hi;
    *(uint2 *)(qs + (size_t)t * in + act_pos<32>(32 * b + 8 * (lane % 4))) = packed;
    if (lane % 4 == 0)
        m[(size_t)t * (in / 32) + b] =
            make_float4(act_f16_round(d), act_f16_round(d * (float)sum), __int_as_float(sum), 0.0f);
}

#endif

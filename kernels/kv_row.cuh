// KV rows on the device (internal, CUDA C++ only): where a row of (layer,
// K|V, head, token) lives in a block, and the loads and stores of every KV
// dtype, including the quantized q8_0 and fp8 rows. The quantized formats
// and their rounding are defined in daemon/backend/compute_cpu_kv.h; the
// functions here compute the same bits as the cpu backend (no fast math:
// IEEE division and multiplication, rintf rounds to nearest even).
//   q8_0 row: head_dim/32 blocks of {f16 d, int8 q[32]} (34 bytes; blocks
//             are 2-byte aligned only, so they are read 2 bytes at a time)
//   fp8 row:  f32 s, then head_dim e4m3fn bytes (4-byte aligned)
#ifndef KVD_KV_ROW_CUH
#define KVD_KV_ROW_CUH

#include "kernel_util.cuh"

#define KVD_F32_MAX 3.40282347e38f

// Byte offset of (layer, K=0/V=1, kv_head, row) inside one block.
static __device__ __forceinline__ size_t kvd_kv_row_off(const kvd_k_kv &kv, int layer, int kv_sel,
                                                        int head, int row)
{
    return ((((size_t)layer * 2 + kv_sel) * kv.kv_heads + head) * kv.block_tokens + row) *
           kv.row_bytes;
}

static __device__ __forceinline__ float kvd_e4m3_to_f32(uint32_t c)
{
    if ((c & 0x7fu) == 0x7fu)
        return __uint_as_float(0x7fc00000u); // NaN
    // eeeemmm in the f32 exponent/mantissa fields, times 2^120 (exact)
    float f = __uint_as_float((c & 0x7fu) << 20) * __uint_as_float(0x7b800000u);
    return (c & 0x80u) ? -f : f;
}

// Round to nearest even, saturating to +-448 (infinities too); NaN -> NaN.
static __device__ __forceinline__ uint32_t kvd_e4m3_from_f32(float x)
{
    uint32_t bits = __float_as_uint(x), sign = (bits >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a)
        return sign | 0x7fu;
    if (a > 448.0f)
        return sign | 0x7eu;
    if (a < 0.015625f) // 2^-6: multiples of 2^-9 below the first normal
        return sign | (uint32_t)rintf(a * 512.0f);
    uint32_t ab = __float_as_uint(a);
    ab += 0x7ffffu + ((ab >> 20) & 1u);
    return sign | (((ab >> 23) - 120u) << 3) | ((ab >> 20) & 7u);
}

// Eight consecutive values [8*sl, 8*sl + 8) of a row of dtype DT to f32.
// f16/bf16/f32 rows need the 16-byte (32 for f32) alignment of kvd_load8.
template <int DT>
static __device__ __forceinline__ void kvd_row_load8(const char *row, int sl, float *o)
{
    if (DT == KVD_K_Q8_0) {
        const char *b = row + (size_t)(sl >> 2) * 34;
        float d = kvd_f16_to_f32(*(const uint16_t *)b);
        const uint16_t *q = (const uint16_t *)(b + 2 + (sl & 3) * 8);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t w = q[i];
            o[2 * i] = d * (float)(int8_t)(w & 0xffu);
            o[2 * i + 1] = d * (float)(int8_t)(w >> 8);
        }
    } else if (DT == KVD_K_FP8) {
        float s = *(const float *)row;
        const uint32_t *q = (const uint32_t *)(row + 4 + sl * 8);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint32_t w = q[i];
#pragma unroll
            for (int j = 0; j < 4; j++)
                o[4 * i + j] = s * kvd_e4m3_to_f32((w >> (8 * j)) & 0xffu);
        }
    } else {
        kvd_load8<DT>(row + (size_t)sl * 8 * (DT == KVD_K_F32 ? 4 : 2), o);
    }
}

// Value d of a row of dtype DT.
template <int DT> static __device__ __forceinline__ float kvd_row_load1(const char *row, int d)
{
    if (DT == KVD_K_Q8_0) {
        const char *b = row + (size_t)(d >> 5) * 34;
        return kvd_f16_to_f32(*(const uint16_t *)b) * (float)(int8_t)b[2 + (d & 31)];
    }
    if (DT == KVD_K_FP8)
        return *(const float *)row * kvd_e4m3_to_f32((uint8_t)row[4 + d]);
    return kvd_load1<DT>(row, (size_t)d);
}

// One warp quantizes one 32-value q8_0 block: lane i holds value x; the
// block goes to dst (34 bytes). Every lane of the warp must call it.
static __device__ __forceinline__ void kvd_q8_0_store_warp(char *dst, float x, int lane)
{
    float a = fabsf(x);
    float amax = kvd_warp_max(a <= KVD_F32_MAX ? a : __uint_as_float(0x7f800000u));
    uint16_t d = __half_as_ushort(__float2half_rn(amax / 127.0f));
    uint8_t q = 0;
    if (amax > KVD_F32_MAX || (d & 0x7c00u) == 0x7c00u) // non-finite input, or d overflows
        d = 0x7e00u;                                    // f16 NaN: the block reads back as NaN
    else
        q = (uint8_t)(int8_t)rintf(x * (amax != 0.0f ? 127.0f / amax : 0.0f));
    if (lane == 0)
        *(uint16_t *)dst = d;
    dst[2 + lane] = (char)q;
}

// One token's K and V rows of `layer` (f32 [kv_heads][head_dim] at kt, vt)
// written by the whole block into block `slot`, row `row`, converted to the
// dtype DT (q8_0: one warp per 32-value block; fp8: one warp per row; the
// others one thread per element); kt and vt read from L2 (other blocks of
// the launch may have written them).
template <int DT>
static __device__ __forceinline__ void kvd_kv_write_token(const kvd_k_kv &kv, int layer,
                                                          uint32_t slot, int row, const float *kt,
                                                          const float *vt)
{
    char *blk = (char *)kv.arena + (size_t)slot * kv.block_bytes;
    const int per = kv.kv_heads * kv.head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if constexpr (DT == KVD_K_Q8_0) {
        const int nb = kv.head_dim / 32;
        // group g: K (g < kv_heads*nb) or V; head h; block b of the row
        for (int g = warp; g < 2 * kv.kv_heads * nb; g += n_warps) {
            const int sel = g / (kv.kv_heads * nb), h = g / nb % kv.kv_heads, b = g % nb;
            const float *src = (sel ? vt : kt) + (size_t)h * kv.head_dim;
            kvd_q8_0_store_warp(blk + kvd_kv_row_off(kv, layer, sel, h, row) + (size_t)b * 34,
                                __ldcg(src + b * 32 + lane), lane);
        }
    } else if constexpr (DT == KVD_K_FP8) {
        // the row's amax over its finite values gives the scale
        for (int r = warp; r < 2 * kv.kv_heads; r += n_warps) {
            const int sel = r / kv.kv_heads, h = r % kv.kv_heads;
            const float *src = (sel ? vt : kt) + (size_t)h * kv.head_dim;
            char *dst = blk + kvd_kv_row_off(kv, layer, sel, h, row);
            float amax = 0.0f;
            for (int d = lane; d < kv.head_dim; d += 32) {
                const float a = fabsf(__ldcg(src + d));
                if (a <= KVD_F32_MAX)
                    amax = fmaxf(amax, a);
            }
            amax = kvd_warp_max(amax);
            const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
            if (lane == 0)
                *(float *)dst = amax / 448.0f;
            for (int d = lane; d < kv.head_dim; d += 32)
                dst[4 + d] = (char)kvd_e4m3_from_f32(__ldcg(src + d) * inv);
        }
    } else {
        for (int e = threadIdx.x; e < per; e += blockDim.x) {
            const int h = e / kv.head_dim, d = e % kv.head_dim;
            kvd_store1<DT>(blk, kvd_kv_off(kv, layer, 0, h, row) + d, __ldcg(kt + e));
            kvd_store1<DT>(blk, kvd_kv_off(kv, layer, 1, h, row) + d, __ldcg(vt + e));
        }
    }
}

#endif

// The quantized weight types of GGUF files (ggml's block layouts), device
// side: sizes, and the dequantization of 32 consecutive values, written from
// the format definition (shared/design/GGUF-NOTES.md, docs/quant.md). Every
// type is a sequence of fixed-size blocks; a row of n values is n / QK blocks.
//
//   type  QK  bytes  block (offsets in bytes; f16 = IEEE half, little-endian)
//   Q4_0  32  18     d f16 @0, qs[16] @2: value j = d*((qs[j]&15) - 8),
//                    value j+16 = d*((qs[j]>>4) - 8)
//   Q4_1  32  20     d @0, m @2, qs[16] @4: d*q + m (q the nibble as above)
//   Q5_0  32  22     d @0, qh u32 @2, qs[16] @6: q = nibble | bit (j or j+16)
//                    of qh << 4; value d*(q - 16)
//   Q5_1  32  24     d @0, m @2, qh @4, qs @8: d*q + m
//   Q4_K  256 144    d @0, dmin @2, scales[12] @4 (8 6-bit scales and mins),
//                    qs[128] @16: sub-block s (32 values) reads the low
//                    (s even) or high nibble of qs[32*(s/2) ..]; value
//                    (d*sc_s)*q - dmin*m_s
//   Q5_K  256 176    as Q4_K, with qh[32] @16 and qs @48: bit s of qh[l]
//                    adds 16 to value l of sub-block s
//   Q6_K  256 210    ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208:
//                    value 128h + 32k + l (h < 2, k < 4, l < 32) is
//                    (ql[64h + 32(k&1) + l] >> 4(k>>1)) & 15 | ((qh[32h + l]
//                    >> 2k) & 3) << 4, minus 32, times d*scales[8h + 2k + l/16]
#ifndef KVD_QUANT_CUH
#define KVD_QUANT_CUH

#include "kernel_util.cuh"

// Values per block (1 for the plain types) and bytes per block.
static __host__ __device__ constexpr int kvd_wt_qk(int wtype)
{
    switch (wtype) {
    case KVD_KW_Q4_0:
    case KVD_KW_Q4_1:
    case KVD_KW_Q5_0:
    case KVD_KW_Q5_1:
    case KVD_KW_Q8_0:
        return 32;
    case KVD_KW_Q4_K:
    case KVD_KW_Q5_K:
    case KVD_KW_Q6_K:
        return 256;
    default:
        return 1;
    }
}

static __host__ __device__ constexpr int kvd_wt_block_bytes(int wtype)
{
    switch (wtype) {
    case KVD_KW_F32:
        return 4;
    case KVD_KW_F16:
    case KVD_KW_BF16:
        return 2;
    case KVD_KW_Q4_0:
        return 18;
    case KVD_KW_Q4_1:
        return 20;
    case KVD_KW_Q5_0:
        return 22;
    case KVD_KW_Q5_1:
        return 24;
    case KVD_KW_Q8_0:
        return 34;
    case KVD_KW_Q4_K:
        return 144;
    case KVD_KW_Q5_K:
        return 176;
    case KVD_KW_Q6_K:
        return 210;
    default:
        return 0;
    }
}

// The quantized types this file dequantizes in 32-value chunks (Q8_0 keeps
// its own element path in kernel_util.cuh).
static __host__ __device__ __forceinline__ bool kvd_wt_is_q(int wtype)
{
    switch (wtype) {
    case KVD_KW_Q4_0:
    case KVD_KW_Q4_1:
    case KVD_KW_Q5_0:
    case KVD_KW_Q5_1:
    case KVD_KW_Q4_K:
    case KVD_KW_Q5_K:
    case KVD_KW_Q6_K:
        return true;
    default:
        return false;
    }
}

// Any weight type kernels.h names.
static __host__ __device__ __forceinline__ bool kvd_wt_known(int wtype)
{
    return kvd_wt_block_bytes(wtype) != 0;
}

static __device__ __forceinline__ float kvd_f16_at(const uint8_t *p)
{
    return kvd_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

// 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K super-block,
// from its 12 packed bytes.
static __device__ __forceinline__ void kvd_k4_scale_min(const uint8_t *sc, int s, int *d, int *m)
{
    if (s < 4) {
        *d = sc[s] & 63;
        *m = sc[s + 4] & 63;
    } else {
        *d = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        *m = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// out[0..32) = values [32c, 32c + 32) of a tensor of type wtype (one of
// kvd_wt_is_q) starting at base; byte loads (blocks are only 2-byte aligned).
static __device__ __forceinline__ void kvd_deq32(const uint8_t *base, int wtype, size_t c,
                                                 float *out)
{
    switch (wtype) {
    case KVD_KW_Q4_0: {
        const uint8_t *b = base + c * 18, *qs = b + 2;
        float d = kvd_f16_at(b);
        for (int j = 0; j < 16; j++) {
            out[j] = (float)((qs[j] & 15) - 8) * d;
            out[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
        break;
    }
    case KVD_KW_Q4_1: {
        const uint8_t *b = base + c * 20, *qs = b + 4;
        float d = kvd_f16_at(b), m = kvd_f16_at(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = (float)(qs[j] & 15) * d + m;
            out[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
        break;
    }
    case KVD_KW_Q5_0:
    case KVD_KW_Q5_1: {
        const bool one = wtype == KVD_KW_Q5_1;
        const uint8_t *b = base + c * (one ? 24 : 22), *h = b + (one ? 4 : 2), *qs = h + 4;
        float d = kvd_f16_at(b), m = one ? kvd_f16_at(b + 2) : 0.0f;
        uint32_t qh = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) |
                      ((uint32_t)h[3] << 24);
        for (int j = 0; j < 16; j++) {
            int x0 = (qs[j] & 15) | (int)(((qh >> j) << 4) & 0x10);
            int x1 = (qs[j] >> 4) | (int)((qh >> (j + 12)) & 0x10);
            if (one) {
                out[j] = (float)x0 * d + m;
                out[j + 16] = (float)x1 * d + m;
            } else {
                out[j] = (float)(x0 - 16) * d;
                out[j + 16] = (float)(x1 - 16) * d;
            }
        }
        break;
    }
    case KVD_KW_Q4_K:
    case KVD_KW_Q5_K: {
        const bool five = wtype == KVD_KW_Q5_K;
        const int s = (int)(c % 8);
        const uint8_t *b = base + c / 8 * (five ? 176 : 144);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16) + 32 * (s / 2);
        int sc, mn;
        kvd_k4_scale_min(b + 4, s, &sc, &mn);
        float d1 = kvd_f16_at(b) * (float)sc, m1 = kvd_f16_at(b + 2) * (float)mn;
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> (4 * (s & 1))) & 15;
            if (five && (qh[l] >> s) & 1)
                q += 16;
            out[l] = d1 * (float)q - m1;
        }
        break;
    }
    case KVD_KW_Q6_K: {
        const int c8 = (int)(c % 8), h = c8 / 4, k = c8 % 4;
        const uint8_t *b = base + c / 8 * 210;
        const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * k;
        float d = kvd_f16_at(b + 208);
        for (int l = 0; l < 32; l++) {
            int q = ((ql[l] >> (4 * (k >> 1))) & 15) | (((qh[l] >> (2 * k)) & 3) << 4);
            out[l] = d * (float)sc[l / 16] * (float)(q - 32);
        }
        break;
    }
    default:
        for (int l = 0; l < 32; l++)
            out[l] = 0.0f;
    }
}

// dp4a: c + the sum of the four products of a's and b's signed bytes.
#ifdef KVD_CUDA_EMULATE
static inline int kvd_dp4a(int a, int b, int c)
{
    for (int i = 0; i < 4; i++)
        c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
#else
static __device__ __forceinline__ int kvd_dp4a(int a, int b, int c)
{
    return __dp4a(a, b, c);
}
#endif

#endif

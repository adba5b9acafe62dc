// __nv_bfloat16 for the emulation build: storage and the conversions
// kernels/ use, bit-exact with the device (round to nearest even; NaN
// becomes the canonical 0x7fff).
#ifndef KVD_EMU_CUDA_BF16_H
#define KVD_EMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t x;
};

static inline float __bfloat162float(__nv_bfloat16 b)
{
    uint32_t u = (uint32_t)b.x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        b.x = 0x7fffu;
    else
        b.x = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return b;
}
static inline __nv_bfloat16 __float2bfloat16(float f)
{
    return __float2bfloat16_rn(f);
}
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b)
{
    return b.x;
}
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u)
{
    return __nv_bfloat16{u};
}

#endif

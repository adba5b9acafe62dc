// __half for the emulation build: storage and the conversions kernels/ use,
// bit-exact with the device (round to nearest even; NaN becomes the
// canonical 0x7fff).
#ifndef KVD_EMU_CUDA_FP16_H
#define KVD_EMU_CUDA_FP16_H

#include <stdint.h>
#include <string.h>

struct __half {
    uint16_t x;
};

static inline float __half2float(__half h)
{
    uint32_t s = (uint32_t)(h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu, u;
    if (e == 0x1f) {
        u = s | 0x7f800000u | (m << 13);
    } else if (e) {
        u = s | ((e + 112) << 23) | (m << 13);
    } else if (!m) {
        u = s;
    } else { // subnormal: normalize
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        u = s | (e << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __half __float2half_rn(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    __half h;
    if (a > 0x7f800000u) {
        h.x = 0x7fffu;
    } else if (a >= 0x477ff000u) { // rounds to >= 65520: inf
        h.x = (uint16_t)(s | 0x7c00u);
    } else if (a >= 0x38800000u) {    // normal half
        uint32_t r = a - 0x38000000u; // rebias 127 -> 15
        r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
        h.x = (uint16_t)(s | r);
    } else if (a > 0x33000000u) { // subnormal half (or rounds up to the smallest)
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; // value = m * 2^(e-150); half unit 2^-24
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        h.x = (uint16_t)(s | q);
    } else {
        h.x = (uint16_t)s;
    }
    return h;
}
static inline __half __float2half(float f)
{
    return __float2half_rn(f);
}
static inline unsigned short __half_as_ushort(__half h)
{
    return h.x;
}
static inline __half __ushort_as_half(unsigned short u)
{
    return __half{u};
}

#endif

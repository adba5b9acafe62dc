/* cpu KV row codecs (compute_cpu_kv.h): store a row of f32 in the cache's
 * dtype, widen a stored row back to f32. */
#include "compute_cpu_kv.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "compute_cpu_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define F16_NAN 0x7e00u

uint8_t cpu_e4m3_from_f32(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(x);
    if (isnan(a))
        return (uint8_t)(sign | 0x7f);
    if (a > 448.0f) /* saturate (infinities too): e4m3fn has no infinity */
        return (uint8_t)(sign | 0x7e);
    if (a < 0x1p-6f) /* subnormal range: multiples of 2^-9; 8 (2^-6) is the first normal */
        return (uint8_t)(sign | (uint8_t)rintf(a * 512.0f));
    uint32_t ab;
    memcpy(&ab, &a, 4);
    /* round the 23-bit mantissa to 3 bits, to nearest even; a carry moves
     * into the exponent, which is right (448 is the largest result) */
    ab += 0x7ffffu + ((ab >> 20) & 1);
    uint32_t e = (ab >> 23) - 127 + 7, m = (ab >> 20) & 7;
    return (uint8_t)(sign | (e << 3) | m);
}

float cpu_e4m3_to_f32(uint8_t c)
{
    if ((c & 0x7f) == 0x7f)
        return NAN;
    /* eeeemmm shifted to the f32 exponent/mantissa fields is 2^(e-127)(1+m/8)
     * (e > 0) or m*2^-129 (e = 0); times 2^120 (exact) gives e4m3's value */
    uint32_t bits = (uint32_t)(c & 0x7f) << 20;
    float f;
    memcpy(&f, &bits, 4);
    f *= 0x1p120f;
    return c & 0x80 ? -f : f;
}

static void q8_0_store(uint8_t *dst, const float *x, uint32_t n)
{
    for (uint32_t b = 0; b < n / KV_QBLOCK; b++, dst += 2 + KV_QBLOCK, x += KV_QBLOCK) {
        float amax = 0;
        for (int i = 0; i < KV_QBLOCK; i++) {
            float a = fabsf(x[i]);
            if (!(a <= FLT_MAX)) /* NaN or infinity */
                amax = INFINITY;
            else if (a > amax)
                amax = a;
        }
        uint16_t d = float_to_half(amax / 127.0f);
        if (isinf(amax) || (d & 0x7c00) == 0x7c00) { /* non-finite input or d overflows */
            d = F16_NAN;
            memset(dst + 2, 0, KV_QBLOCK);
        } else {
            float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < KV_QBLOCK; i++)
                dst[2 + i] = (uint8_t)(int8_t)rintf(x[i] * id);
        }
        dst[0] = (uint8_t)(d & 0xff);
        dst[1] = (uint8_t)(d >> 8);
    }
}

static void fp8_store(uint8_t *dst, const float *x, uint32_t n)
{
    float amax = 0;
    for (uint32_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a <= FLT_MAX && a > amax)
            amax = a;
    }
    float s = amax / 448.0f, inv = amax > 0.0f ? 448.0f / amax : 0.0f;
    memcpy(dst, &s, 4);
    for (uint32_t i = 0; i < n; i++)
        dst[4 + i] = cpu_e4m3_from_f32(x[i] * inv);
}

#if defined(__x86_64__)
/* F16C's round-to-nearest-even conversion gives the same bits as
 * float_to_half (also for inf, nan and subnormals). */
__attribute__((target("avx2,f16c"))) static void f16_store_simd(uint16_t *dst, const float *src,
                                                                uint32_t n)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = float_to_half(src[i]);
}
#endif

void cpu_kv_store_row(void *dst, enum kv_dtype dt, const float *src, uint32_t n, bool simd)
{
    switch (dt) {
    case KV_F16:
#if defined(__x86_64__)
        if (simd) {
            f16_store_simd(dst, src, n);
            break;
        }
#endif
        for (uint32_t i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = float_to_half(src[i]);
        break;
    case KV_BF16:
        for (uint32_t i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
        break;
    case KV_Q8_0:
        q8_0_store(dst, src, n);
        break;
    case KV_FP8:
        fp8_store(dst, src, n);
        break;
    case KV_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    }
    (void)simd;
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) static void q8_0_load_simd(const uint8_t *src, uint32_t n,
                                                                float *out)
{
    for (uint32_t b = 0; b < n / KV_QBLOCK; b++, src += 2 + KV_QBLOCK, out += KV_QBLOCK) {
        __m256 d = _mm256_set1_ps(half_to_float((uint16_t)(src[0] | src[1] << 8)));
        for (int c = 0; c < 4; c++) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * c));
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(d, q));
        }
    }
}

/* cpu_e4m3_to_f32 on 8 bytes at a time, times s. */
__attribute__((target("avx2"))) static void fp8_load_simd(const uint8_t *src, uint32_t n,
                                                          float *out)
{
    float s;
    memcpy(&s, src, 4);
    const __m256 sv = _mm256_set1_ps(s), p120 = _mm256_set1_ps(0x1p120f);
    const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80);
    const __m256 qnan = _mm256_set1_ps(NAN);
    for (uint32_t i = 0; i < n; i += 8) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 4 + i)));
        __m256i mag = _mm256_and_si256(c, m7f);
        __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), p120);
        f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, m80), 24)));
        f = _mm256_blendv_ps(f, qnan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sv, f));
    }
}
#endif

void cpu_kv_load_row(const void *src, enum kv_dtype dt, uint32_t n, float *out, bool simd)
{
    const uint8_t *p = src;
    switch (dt) {
    case KV_F16:
        for (uint32_t i = 0; i < n; i++)
            out[i] = half_to_float(((const uint16_t *)src)[i]);
        break;
    case KV_BF16:
        for (uint32_t i = 0; i < n; i++)
            out[i] = bf16_to_float(((const uint16_t *)src)[i]);
        break;
    case KV_F32:
        memcpy(out, src, (size_t)n * 4);
        break;
    case KV_Q8_0:
#if defined(__x86_64__)
        if (simd) {
            q8_0_load_simd(p, n, out);
            break;
        }
#endif
        for (uint32_t b = 0; b < n / KV_QBLOCK; b++, p += 2 + KV_QBLOCK) {
            float d = half_to_float((uint16_t)(p[0] | p[1] << 8));
            for (int i = 0; i < KV_QBLOCK; i++)
                out[b * KV_QBLOCK + i] = d * (float)(int8_t)p[2 + i];
        }
        break;
    case KV_FP8: {
#if defined(__x86_64__)
        if (simd) {
            fp8_load_simd(p, n, out);
            break;
        }
#endif
        float s;
        memcpy(&s, p, 4);
        for (uint32_t i = 0; i < n; i++)
            out[i] = s * cpu_e4m3_to_f32(p[4 + i]);
        break;
    }
    }
}

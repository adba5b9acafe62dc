/* Internals shared by the cpu compute files: the context (its worker pool
 * is compute_cpu_pool.h), number conversions (f16/bf16, round-to-nearest-even as ggml)
 * and the kernels of compute_cpu_matmul.c and compute_cpu_attn.c. Not used
 * outside compute_cpu*.c. */
#ifndef KVD_COMPUTE_CPU_H
#define KVD_COMPUTE_CPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "compute.h"
#include "compute_cpu_pool.h"

struct compute_ctx {
    struct backend *be;
    struct cpu_pool pool;
    bool simd; /* AVX2+FMA+F16C kernels (runtime-detected; KVD_CPU_SCALAR=1 turns them off) */
    /* per-worker scratch (attention scores), grown on demand: [n][scratch_cap] floats */
    float **scratch;
    size_t scratch_cap;
    /* per-worker batched-matmul scratch (q8_0 f32 panel, partial sums): [n][panel_cap] */
    float **panel;
    size_t panel_cap;
    struct sampler_scratch sample_scratch; /* the sample op's (caller thread only) */
    /* quantized activation rows of the quantized-weight matmul (compute_cpu_quant.c) */
    void *qact;
    size_t qact_cap;
};

/* f16 / bf16 <-> f32, bit-exact with ggml's reference conversions. */
static inline float cpu_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t cpu_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf / nan */
        return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) {   /* below the smallest normal half: subnormal or zero */
        if (ax < 0x33000000u) /* < 2^-25: rounds to 0 */
            return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* 14 + (113 - e) */
        uint32_t half = m >> shift, rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = ax - 0x38000000u; /* rebias 127 -> 15 in the exponent field */
    uint32_t half = r >> 13, rem = r & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1)))
        half++; /* may carry into the exponent, which is right */
    return (uint16_t)(sign | half);
}

static inline float cpu_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t cpu_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: keep it a (quiet) nan */
        return (uint16_t)((x >> 16) | 64);
    return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

/* Element i of a KV row of dtype dt, as f32. */
static inline float cpu_kv_load(const void *p, enum kv_dtype dt, size_t i)
{
    switch (dt) {
    case KV_F16:
        return cpu_f16_to_f32(((const uint16_t *)p)[i]);
    case KV_BF16:
        return cpu_bf16_to_f32(((const uint16_t *)p)[i]);
    default:
        return ((const float *)p)[i];
    }
}

static inline size_t cpu_kv_esize(enum kv_dtype dt)
{
    return dt == KV_F32 ? 4 : 2;
}

int cpu_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
               float *y);
int cpu_attention(struct compute_ctx *cx, const struct attn_desc *d);
/* Matmul of the block-quantized weights other than q8_0 (compute_cpu_quant.c:
 * CL_ROWS, activations quantized as llama.cpp does); cpu_matmul calls it for
 * the types cpu_qmatmul_type accepts. */
bool cpu_qmatmul_type(enum ctype t);
int cpu_qmatmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                float *y);
/* Widens n elements of a weight row of type t to f32. */
void cpu_row_to_f32(enum ctype t, const void *row, float *out, uint32_t n);
/* Weights (compute_cpu_matmul.c): matrices are packed (CL_PACK16) at upload;
 * cpu_weight_row widens row `row` of w, in either layout, to f32. */
size_t cpu_weight_bytes(const struct ctensor *t);
int cpu_weight_upload(struct compute_ctx *cx, struct ctensor *t, const void *src);
void cpu_weight_row(const struct ctensor *w, uint32_t row, float *out);

#endif

/* The cpu backend's KV row codecs: one row is the head_dim values of one
 * token and one KV head, stored in the cache's dtype (kv_types.h). The
 * quantized dtypes are defined here, byte for byte, for every part of kvd
 * (the cuda kernels compute the same bits, kernels/kernel_util.cuh):
 *
 * q8_0: head_dim/32 blocks of ggml's Q8_0: f16 d, then 32 int8 q; value =
 *   d*q. Per block: amax = max |x|; d = amax/127 (stored as f16, rounded to
 *   nearest even); q = round_half_even(x * (127/amax)) (0 when amax is 0),
 *   as ggml's AVX2 quantize_row_q8_0. A block holding a NaN or an infinity,
 *   or whose d overflows f16 (amax > 65504*127), is stored with d = f16 NaN
 *   (0x7e00) and q = 0: it reads back as NaN, never as a wrong number.
 * fp8: an f32 scale s (little-endian), then head_dim e4m3fn bytes (1 sign,
 *   4 exponent bits of bias 7, 3 mantissa bits; no infinity; 0x7f/0xff NaN;
 *   largest 448, smallest subnormal 2^-9); value = s*e4m3(q). Per row:
 *   amax = max |x| over the finite values; s = amax/448; q = e4m3(x *
 *   (448/amax)) (x*0 when amax is 0), rounded to nearest even and
 *   saturated to +-448 (infinities too); NaN stays NaN. One scale per row:
 *   e4m3's exponent already covers 17 binades below the row's largest value,
 *   so finer scales would buy little, and the row stays 4 + head_dim bytes
 *   (1.94x smaller than f16 at head_dim 128). */
#ifndef KVD_COMPUTE_CPU_KV_H
#define KVD_COMPUTE_CPU_KV_H

#include <stdbool.h>
#include <stdint.h>

#include "kv_types.h"

/* e4m3fn <-> f32 (the conversion saturates and rounds to nearest even). */
uint8_t cpu_e4m3_from_f32(float x);
float cpu_e4m3_to_f32(uint8_t c);

/* Stores n values (one row: n = head_dim) of src at dst in dtype dt
 * (kv_row_bytes(dt, n) bytes; f16/bf16 round to nearest even as compute.h's
 * kv_write says). The bytes do not depend on simd. */
void cpu_kv_store_row(void *dst, enum kv_dtype dt, const float *src, uint32_t n, bool simd);
/* Widens one stored row of n values back to f32 (the quantized dtypes:
 * dequantized, d*q or s*e4m3(q), one f32 product per value). */
void cpu_kv_load_row(const void *src, enum kv_dtype dt, uint32_t n, float *out, bool simd);

#endif

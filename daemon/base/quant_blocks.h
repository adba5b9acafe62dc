/* The block layouts of ggml's quantized weight types, byte for byte as GGUF
 * files store them (docs/quant.md describes each with its formula). f16
 * fields are IEEE half bits (uint16_t, little-endian like the whole file);
 * no field needs alignment beyond 2 bytes, so a block may sit at any even
 * offset and these structs carry no padding (the asserts check it).
 *
 * Legacy types, blocks of QK4_0 = ... = 32 values; value i of a block:
 *   q4_0: d * (nib(i) - 8)                nib(i) = i < 16 ? qs[i] & 15 : qs[i-16] >> 4
 *   q4_1: d * nib(i) + m
 *   q5_0: d * ((nib(i) | hb(i) << 4) - 16) hb(i) = bit i of the little-endian u32 qh
 *   q5_1: d * (nib(i) | hb(i) << 4) + m
 *   q8_0: d * qs[i]
 * K-quants, super-blocks of QK_K = 256 values (docs/quant.md has the scale
 * packing): q4_K / q5_K are 8 sub-blocks of 32 with 6-bit scale and min,
 * q6_K is 16 sub-blocks of 16 with int8 scales. */
#ifndef KVD_QUANT_BLOCKS_H
#define KVD_QUANT_BLOCKS_H

#include <stdint.h>

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_SIZE 12

struct block_q4_0 {
    uint16_t d;            /* f16 scale */
    uint8_t qs[QK4_0 / 2]; /* nibbles: low = values 0..15, high = values 16..31 */
};

struct block_q4_1 {
    uint16_t d, m; /* f16 scale and minimum */
    uint8_t qs[QK4_1 / 2];
};

struct block_q5_0 {
    uint16_t d;
    uint8_t qh[4];         /* fifth bits: bit i (of the little-endian u32) for value i */
    uint8_t qs[QK5_0 / 2]; /* low 4 bits, as q4_0 */
};

struct block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK5_1 / 2];
};

struct block_q8_0 {
    uint16_t d;
    int8_t qs[QK8_0];
};

/* value = d * sc[s] * q - dmin * mn[s] for sub-block s = value / 32, q the
 * 4-bit quant; sc/mn 6-bit, packed in scales[12] (quant_k_scale_min). qs:
 * per 64 values, 32 bytes: low nibbles = the first 32, high = the next 32. */
struct block_q4_K {
    uint16_t d, dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qs[QK_K / 2];
};

/* As q4_K with a fifth bit: bit (2*(value/64) + (value%64)/32) of
 * qh[value % 32]. */
struct block_q5_K {
    uint16_t d, dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
};

/* value = d * scales[value / 16] * (q - 32), q 6 bits: low 4 in ql, high 2
 * in qh (the layout per 128 values is in docs/quant.md). */
struct block_q6_K {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
};

_Static_assert(sizeof(struct block_q4_0) == 18, "block_q4_0 is 18 bytes");
_Static_assert(sizeof(struct block_q4_1) == 20, "block_q4_1 is 20 bytes");
_Static_assert(sizeof(struct block_q5_0) == 22, "block_q5_0 is 22 bytes");
_Static_assert(sizeof(struct block_q5_1) == 24, "block_q5_1 is 24 bytes");
_Static_assert(sizeof(struct block_q8_0) == 34, "block_q8_0 is 34 bytes");
_Static_assert(sizeof(struct block_q4_K) == 144, "block_q4_K is 144 bytes");
_Static_assert(sizeof(struct block_q5_K) == 176, "block_q5_K is 176 bytes");
_Static_assert(sizeof(struct block_q6_K) == 210, "block_q6_K is 210 bytes");

/* Scale and min j (0..7) of a q4_K / q5_K super-block's scales[12]: 8 pairs
 * of 6-bit numbers. j < 4: scale = q[j] & 63, min = q[j+4] & 63; j >= 4:
 * the low 4 bits in q[j+4] (scale low nibble, min high nibble) and the high
 * 2 bits in the top bits of q[j-4] (scale) and q[j] (min). */
static inline void quant_k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#endif

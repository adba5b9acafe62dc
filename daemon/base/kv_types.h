/* kv_types: the element types and shapes every layer shares, and their
 * sizes: the KV cache's (kv_dtype, kv_geom: the memory manager, the model,
 * the backends, the server) and the weights' (ctype: the GGUF reader, the
 * model, the compute backends). The bottom of the daemon's headers: it
 * includes nothing of kvd's. */
#ifndef KVD_KV_TYPES_H
#define KVD_KV_TYPES_H

#include <stddef.h>
#include <stdint.h>

struct kvd_error; /* kvd/status.h */

/* KV element types. f16/bf16/f32 store each value; q8_0 and fp8 store each
 * row of head_dim values (one token of one head) quantized, with its scales
 * inside the row, so a row is self-contained and a block stays block-local
 * (docs/protocol.md section 6 has the bytes):
 *   q8_0: head_dim/32 ggml Q8_0 blocks: f16 scale d, 32 int8 q; value = d*q
 *   fp8:  an f32 scale s, then head_dim e4m3fn bytes; value = s*e4m3(q)
 * Both need head_dim % 32 == 0 (kv_geom_check). */
enum kv_dtype { KV_F16 = 0, KV_BF16 = 1, KV_F32 = 2, KV_Q8_0 = 3, KV_FP8 = 4 };

/* KV geometry. A block holds block_tokens tokens of K and V for all layers,
 * contiguous, laid out as [layer][K|V][kv_head][token] rows of
 * kv_row_bytes(dtype, head_dim) bytes (head_dim values);
 * block_bytes = layers*2*kv_heads*block_tokens*row_bytes. */
struct kv_geom {
    uint32_t layers, kv_heads, head_dim;
    enum kv_dtype dtype;
    uint32_t block_tokens; /* default 16 */
};
/* Bytes per value of f16/bf16/f32; 0 for the row-quantized q8_0 and fp8
 * (and an unknown type): use kv_row_bytes. */
size_t kv_dtype_size(enum kv_dtype t);
const char *kv_dtype_name(enum kv_dtype t); /* "f16", "bf16", "f32", "q8_0", "fp8" */
/* Bytes of one row (head_dim values of one token and head) of dtype t; 0 for
 * an unknown type or a quantized type whose head_dim is not a multiple of 32. */
size_t kv_row_bytes(enum kv_dtype t, uint32_t head_dim);
#define KV_QBLOCK 32 /* values per q8_0 block (and head_dim granule of q8_0 and fp8) */
/* 0 when the geometry's dtype can store rows of its head_dim; otherwise
 * KVD_EBADREQ with a message for the operator in err. */
int kv_geom_check(const struct kv_geom *g, struct kvd_error *err);
size_t kv_block_bytes(const struct kv_geom *g);
/* Bytes per token in kv_write/kv_read data: block_bytes / block_tokens. */
size_t kv_token_bytes(const struct kv_geom *g);

/* Weight element types; the numbers are ggml's type ids (GGUF files). The
 * quantized ones are arrays of blocks, laid out as quant_blocks.h and
 * docs/quant.md describe: a row of n values is n / ctype_block_elems(t)
 * blocks of ctype_block_bytes(t) bytes. */
enum ctype {
    CT_F32 = 0,
    CT_F16 = 1,
    CT_Q4_0 = 2,  /* blocks of 32: f16 d, 16 bytes of nibbles; value = d*(q-8) (18 bytes) */
    CT_Q4_1 = 3,  /* blocks of 32: f16 d, m, nibbles; value = d*q + m (20 bytes) */
    CT_Q5_0 = 6,  /* blocks of 32: f16 d, 32 high bits, nibbles; value = d*(q-16) (22 bytes) */
    CT_Q5_1 = 7,  /* blocks of 32: f16 d, m, high bits, nibbles; value = d*q + m (24 bytes) */
    CT_Q8_0 = 8,  /* blocks of 32: f16 scale d, then 32 int8 q; value = d*q (34 bytes) */
    CT_Q4_K = 12, /* super-blocks of 256: 8 x 32 with 6-bit scales and mins (144 bytes) */
    CT_Q5_K = 13, /* super-blocks of 256: as Q4_K plus a fifth bit (176 bytes) */
    CT_Q6_K = 14, /* super-blocks of 256: 16 x 16 with int8 scales, 6-bit q (210 bytes) */
    CT_BF16 = 30,
};
#define CT_Q8_0_BLOCK 32
#define CT_Q8_0_BYTES 34
#define CT_QK 32    /* values per block of the legacy types (Q4_0 .. Q8_0) */
#define CT_QK_K 256 /* values per super-block of the K-quants */

/* Values per block of t (1 for f32/f16/bf16, 32 legacy, 256 K-quants) and
 * bytes per block (the element size for f32/f16/bf16); 0 for an unknown type. */
uint32_t ctype_block_elems(enum ctype t);
size_t ctype_block_bytes(enum ctype t);
/* 1 for a block-quantized type (Q4_0 .. Q6_K). */
int ctype_is_quant(enum ctype t);
/* Bytes of one row of n elements of type t; 0 for an unknown type or a
 * quantized row whose n is not a multiple of its block. */
size_t ctype_row_bytes(enum ctype t, uint64_t n);
/* "f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k",
 * "q6_k", "bf16", "?" */
const char *ctype_name(enum ctype t);

#endif

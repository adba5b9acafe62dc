/* kv_types: the element types and shapes every layer shares, and their
 * sizes: the KV cache's (kv_dtype, kv_geom: the memory manager, the model,
 * the backends, the server) and the weights' (ctype: the GGUF reader, the
 * model, the compute backends). The bottom of the daemon's headers: it
 * includes nothing of kvd's. */
#ifndef KVD_KV_TYPES_H
#define KVD_KV_TYPES_H

#include <stddef.h>
#include <stdint.h>

enum kv_dtype { KV_F16 = 0, KV_BF16 = 1, KV_F32 = 2 };

/* KV geometry. A block holds block_tokens tokens of K and V for all layers,
 * contiguous, laid out as [layer][K|V][kv_head][token][head_dim] elements of
 * dtype; block_bytes = layers*2*kv_heads*block_tokens*head_dim*dtype_size. */
struct kv_geom {
    uint32_t layers, kv_heads, head_dim;
    enum kv_dtype dtype;
    uint32_t block_tokens; /* default 16 */
};
size_t kv_dtype_size(enum kv_dtype t);
const char *kv_dtype_name(enum kv_dtype t); /* "f16", "bf16", "f32" */
size_t kv_block_bytes(const struct kv_geom *g);
/* Bytes per token in kv_write/kv_read data: block_bytes / block_tokens. */
size_t kv_token_bytes(const struct kv_geom *g);

/* Weight element types; the numbers are ggml's type ids (GGUF files). */
enum ctype {
    CT_F32 = 0,
    CT_F16 = 1,
    CT_Q8_0 = 8,  /* blocks of 32: f16 scale d, then 32 int8 q; value = d*q (34 bytes) */
    CT_BF16 = 30,
};
#define CT_Q8_0_BLOCK 32
#define CT_Q8_0_BYTES 34

/* Bytes of one row of n elements of type t; 0 for an unknown type or a Q8_0
 * row whose n is not a multiple of 32. */
size_t ctype_row_bytes(enum ctype t, uint64_t n);
const char *ctype_name(enum ctype t); /* "f32", "f16", "q8_0", "bf16", "?" */

#endif

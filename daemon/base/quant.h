/* Reference (scalar) conversions of the weight types of kv_types.h: rows to
 * f32 for every ctype, and f32 rows to each quantized type, written from the
 * block layouts (quant_blocks.h, docs/quant.md). The backends' fast kernels
 * are checked against quant_dequant_row; quant_quantize_row is what the
 * model generator (kvd-gguf-gen) and the tests write weights with. */
#ifndef KVD_QUANT_H
#define KVD_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "half.h" /* the f16 / bf16 conversions */
#include "kv_types.h"

/* out[0..n) = the n values of a row of type t at src (n a multiple of
 * ctype_block_elems(t)). Returns 0, or -1 for an unknown type or a bad n. */
int quant_dequant_row(enum ctype t, const void *src, float *out, uint64_t n);

/* Writes x[0..n) as a row of type t (ctype_row_bytes(t, n) bytes at dst):
 * f32/f16/bf16 by conversion, the quantized types with a per-block scale
 * (and min) search: legacy types as ggml's reference quantizers (scale from
 * the largest magnitude or the range), K-quants with a small grid search of
 * each sub-block's scale and min, then 6-bit (q4_K, q5_K) or 8-bit (q6_K)
 * quantization of those against the super-block's d / dmin. Returns 0 or -1
 * (unknown type, bad n). */
int quant_quantize_row(enum ctype t, const float *x, void *dst, uint64_t n);

#endif

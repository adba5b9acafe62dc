/* Internals shared by the cpu compute files: the context (its worker pool
 * is compute_cpu_pool.h) and the kernels of compute_cpu_matmul.c and compute_cpu_attn.c. Not used
 * outside compute_cpu*.c. */
#ifndef KVD_COMPUTE_CPU_IMPL_H
#define KVD_COMPUTE_CPU_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "compute.h"
#include "half.h"
#include "compute_cpu_pool.h"

struct compute_ctx {
    struct backend *be;
    struct cpu_pool pool;
    bool simd;     /* AVX2+FMA+F16C kernels (runtime-detected; KVD_CPU_SCALAR=1 turns them off) */
    bool llamacpp; /* KVD_CPU_LLAMACPP=1: attention and RoPE with llama.cpp's arithmetic */
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
    size_t dev_live; /* bytes of the live buf_alloc buffers (atomic: usable sizes) */
};

/* Element i of a KV row of dtype dt, as f32. */
static inline float cpu_kv_load(const void *p, enum kv_dtype dt, size_t i)
{
    switch (dt) {
    case KV_F16:
        return half_to_float(((const uint16_t *)p)[i]);
    case KV_BF16:
        return bf16_to_float(((const uint16_t *)p)[i]);
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
/* llama.cpp's cpu arithmetic for attention and RoPE (compute_cpu_ggml.c),
 * run instead of kvd's with KVD_CPU_LLAMACPP=1. cpu_attn_ggml does what
 * cpu_attention does for query row t (of sequence s) and the query heads of
 * kv head gh, for the KV dtypes cpu_attn_ggml_dtype accepts, in a scratch
 * of cpu_attn_ggml_scratch(d) floats; cpu_rope_ggml is the rope op. */
bool cpu_attn_ggml_dtype(enum kv_dtype dt);
size_t cpu_attn_ggml_scratch(const struct attn_desc *d);
void cpu_attn_ggml(const struct attn_desc *d, bool simd, uint32_t s, uint32_t t, uint32_t gh,
                   float *scratch);
void cpu_rope_ggml(float *x, uint32_t rows, uint32_t n_heads, uint32_t head_dim, uint32_t n_rot,
                   const uint32_t *pos, enum rope_mode mode, float base, const float *ff);
/* Widens n elements of a weight row of type t to f32. */
void cpu_row_to_f32(enum ctype t, const void *row, float *out, uint32_t n);
/* Weights (compute_cpu_matmul.c): matrices are packed (CL_PACK16) at upload;
 * cpu_weight_row widens row `row` of w, in either layout, to f32. */
size_t cpu_weight_bytes(const struct ctensor *t);
int cpu_weight_upload(struct compute_ctx *cx, struct ctensor *t, const void *src);
void cpu_weight_row(const struct ctensor *w, uint32_t row, float *out);

#endif

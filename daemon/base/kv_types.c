/* kv_types: the sizes and names of the shared element types (kv_types.h). */
#include "kv_types.h"

#include "kvd/status.h"

size_t kv_dtype_size(enum kv_dtype t)
{
    switch (t) {
    case KV_F16:
    case KV_BF16:
        return 2;
    case KV_F32:
        return 4;
    case KV_Q8_0:
    case KV_FP8:
        return 0;
    }
    return 0;
}

const char *kv_dtype_name(enum kv_dtype t)
{
    switch (t) {
    case KV_F16:
        return "f16";
    case KV_BF16:
        return "bf16";
    case KV_F32:
        return "f32";
    case KV_Q8_0:
        return "q8_0";
    case KV_FP8:
        return "fp8";
    }
    return "?";
}

size_t kv_row_bytes(enum kv_dtype t, uint32_t head_dim)
{
    switch (t) {
    case KV_F16:
    case KV_BF16:
    case KV_F32:
        return (size_t)head_dim * kv_dtype_size(t);
    case KV_Q8_0: /* ggml Q8_0 blocks: f16 d + 32 int8 */
        return head_dim % KV_QBLOCK ? 0 : (size_t)head_dim / KV_QBLOCK * (2 + KV_QBLOCK);
    case KV_FP8: /* f32 scale + one e4m3 byte per value */
        return head_dim % KV_QBLOCK ? 0 : 4 + (size_t)head_dim;
    }
    return 0;
}

int kv_geom_check(const struct kv_geom *g, struct kvd_error *err)
{
    if (kv_row_bytes(g->dtype, g->head_dim) != 0)
        return 0;
    if (g->dtype == KV_Q8_0 || g->dtype == KV_FP8)
        return kvd_error_set(err, KVD_EBADREQ,
                             "--kv-dtype %s needs head_dim to be a multiple of %d (head_dim is "
                             "%u); use f16, bf16 or f32",
                             kv_dtype_name(g->dtype), KV_QBLOCK, g->head_dim);
    return kvd_error_set(err, KVD_EBADREQ, "unknown KV dtype %d or head_dim %u", (int)g->dtype,
                         g->head_dim);
}

size_t kv_block_bytes(const struct kv_geom *g)
{
    return (size_t)g->layers * 2 * g->kv_heads * g->block_tokens *
           kv_row_bytes(g->dtype, g->head_dim);
}

size_t kv_token_bytes(const struct kv_geom *g)
{
    return g->block_tokens ? kv_block_bytes(g) / g->block_tokens : 0;
}

uint32_t ctype_block_elems(enum ctype t)
{
    switch (t) {
    case CT_F32:
    case CT_F16:
    case CT_BF16:
        return 1;
    case CT_Q4_0:
    case CT_Q4_1:
    case CT_Q5_0:
    case CT_Q5_1:
    case CT_Q8_0:
        return CT_QK;
    case CT_Q4_K:
    case CT_Q5_K:
    case CT_Q6_K:
        return CT_QK_K;
    }
    return 0;
}

size_t ctype_block_bytes(enum ctype t)
{
    switch (t) {
    case CT_F32:
        return 4;
    case CT_F16:
    case CT_BF16:
        return 2;
    case CT_Q4_0:
        return 18;
    case CT_Q4_1:
        return 20;
    case CT_Q5_0:
        return 22;
    case CT_Q5_1:
        return 24;
    case CT_Q8_0:
        return CT_Q8_0_BYTES;
    case CT_Q4_K:
        return 144;
    case CT_Q5_K:
        return 176;
    case CT_Q6_K:
        return 210;
    }
    return 0;
}

int ctype_is_quant(enum ctype t)
{
    return ctype_block_elems(t) > 1;
}

size_t ctype_row_bytes(enum ctype t, uint64_t n)
{
    uint32_t be = ctype_block_elems(t);
    if (n > (UINT64_C(1) << 40) || be == 0 || n % be)
        return 0;
    return (size_t)(n / be) * ctype_block_bytes(t);
}

const char *ctype_name(enum ctype t)
{
    switch (t) {
    case CT_F32:
        return "f32";
    case CT_F16:
        return "f16";
    case CT_BF16:
        return "bf16";
    case CT_Q4_0:
        return "q4_0";
    case CT_Q4_1:
        return "q4_1";
    case CT_Q5_0:
        return "q5_0";
    case CT_Q5_1:
        return "q5_1";
    case CT_Q8_0:
        return "q8_0";
    case CT_Q4_K:
        return "q4_k";
    case CT_Q5_K:
        return "q5_k";
    case CT_Q6_K:
        return "q6_k";
    }
    return "?";
}

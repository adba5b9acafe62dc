/* kv_types: the sizes and names of the shared element types (kv_types.h). */
#include "kv_types.h"

size_t kv_dtype_size(enum kv_dtype t)
{
    switch (t) {
    case KV_F16:
    case KV_BF16:
        return 2;
    case KV_F32:
        return 4;
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
    }
    return "?";
}

size_t kv_block_bytes(const struct kv_geom *g)
{
    return (size_t)g->layers * 2 * g->kv_heads * g->block_tokens * g->head_dim *
           kv_dtype_size(g->dtype);
}

size_t kv_token_bytes(const struct kv_geom *g)
{
    return g->block_tokens ? kv_block_bytes(g) / g->block_tokens : 0;
}

size_t ctype_row_bytes(enum ctype t, uint64_t n)
{
    if (n > (UINT64_C(1) << 40))
        return 0;
    switch (t) {
    case CT_F32: return (size_t)n * 4;
    case CT_F16:
    case CT_BF16: return (size_t)n * 2;
    case CT_Q8_0: return n % CT_Q8_0_BLOCK ? 0 : (size_t)(n / CT_Q8_0_BLOCK) * CT_Q8_0_BYTES;
    }
    return 0;
}

const char *ctype_name(enum ctype t)
{
    switch (t) {
    case CT_F32: return "f32";
    case CT_F16: return "f16";
    case CT_BF16: return "bf16";
    case CT_Q8_0: return "q8_0";
    }
    return "?";
}

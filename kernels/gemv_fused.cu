// The projections of 1..8 tokens (decode, small batches): y = x W^T for up
// to three weights of one type sharing the input (q, k, v), with the step's
// elementwise work fused into the same launch: the bias, gate and up with
// SiLU (SwiGLU), or the residual add with the RMSNorm after it.
//
// A warp computes R rows at once: lane j streams units j, j + 32, ... of
// all R rows (gemv_units.cuh; one unit of each row in flight per lane,
// loaded with 16-byte loads at addresses consecutive across lanes), so each
// activation load serves R rows. Quantized weights take the cpu backend's
// arithmetic: the block's activations are quantized to int8 once, inside
// the kernel into shared memory (the prologue: no separate launch) or, when
// they do not fit, by a separate kernel into device scratch; every integer
// dot is exact, and for the K-quants the float part runs per super-block in
// the cpu's order (fmaf(sumi, d_w * d_a, acc), fmaf(summ, dmin_w * d_a,
// accm), super-block by super-block; out = acc - accm), so they give the
// cpu's bits. The first step's weights are loaded before the kernel waits
// for the previous one (kvd_pdl_wait: programmatic dependent launch).
//
// Epilogues: STORE (y = x W^T + b); SWIGLU (two weights of the same rows,
// gate and up: y = silu(gate) * up, silu as silu_mul.cu); ADD_NORM (the
// residual y += x W^T, then the last block to finish normalizes it: out =
// rmsnorm(y) * w, as add_rmsnorm does); STORE may end with RoPE of q and
// k and the KV write (the last block, rope_kv.cuh: the launch of the
// projections that produce them, the last of q, k, v). The quantized activations are made
// once per input: the last block of a SWIGLU or normed ADD_NORM launch may
// also quantize its output for the GEMVs that read it next (emit), and
// those read it (act_in) instead of quantizing the f32 again; the
// quantization is the same function on the same f32, so the same bytes.
// The kernel and its launches are in gemv_fused.cuh, each weight type's
// instances compiled in a gemv_fused_<group>.cu of their own.
#include "gemv_fused.cuh"

extern "C" int kvd_k_gemv_act_kind(int wtype)
{
    const int kind = gf_kind(wtype);
    return kind == GU_K        ? (wtype == KVD_KW_Q6_K ? GF_ACT_K6 : GF_ACT_K)
           : kind == GU_LEGACY ? GF_ACT_LEGACY
                               : GF_ACT_NONE;
}

extern "C" int kvd_k_gemv_pair_ok(int wtype, int wtype2)
{
    return (wtype == KVD_KW_Q4_K || wtype == KVD_KW_Q5_K) && wtype2 == KVD_KW_Q6_K;
}

extern "C" size_t kvd_k_gemv_act_bytes(int wtype, int n_tokens, int in)
{
    const int kind = gf_kind(wtype);
    if (kind != GU_K && kind != GU_LEGACY)
        return 0;
    return act_bytes(kind == GU_K, n_tokens, in);
}

extern "C" int kvd_k_gemv_ok(int wtype, const void *w, const float *x, int n_tokens, int in)
{
    const int kind = gf_kind(wtype);
    if (kind < 0 || n_tokens < 1 || n_tokens > KVD_K_GEMV_MAX_TOKENS || in <= 0 ||
        ((uintptr_t)x & 15) || ((uintptr_t)w & 15))
        return 0;
    if (kind == GU_K)
        return in % 256 == 0;
    if (kind == GU_LEGACY || wtype == KVD_KW_Q8_0)
        return in % 32 == 0;
    return in % 8 == 0;
}

extern "C" int kvd_k_gemv_run(const struct kvd_k_gemv *g, kvd_stream stream)
{
    if (g->n_seg < 1 || g->n_seg > 3 || (g->epi == KVD_K_GEMV_SWIGLU && g->n_seg != 2) ||
        (g->epi == KVD_K_GEMV_ADD_NORM && (g->n_seg != 1 || (g->norm_w && !g->counter))))
        return (int)cudaErrorInvalidValue;
    if (g->split &&
        (g->split < 0 || g->split >= g->n_seg || g->epi != KVD_K_GEMV_STORE || g->n_emit ||
         !kvd_k_gemv_pair_ok(g->wtype, g->wtype2) || (g->act_in2 && ((uintptr_t)g->act_in2 & 15))))
        return (int)cudaErrorInvalidValue;
    for (int i = 0; i < g->n_seg; i++) {
        const int wt = g->split && i >= g->split ? g->wtype2 : g->wtype;
        if (g->seg[i].rows < 0 || !kvd_k_gemv_ok(wt, g->seg[i].w, g->x, g->n_tokens, g->in) ||
            (g->split && g->seg[i].rows == 0))
            return (int)cudaErrorInvalidValue;
        if (g->epi == KVD_K_GEMV_SWIGLU && g->seg[i].rows != g->seg[0].rows)
            return (int)cudaErrorInvalidValue;
    }
    const int kind = gf_kind(g->wtype);
    if ((kind == GU_K || kind == GU_LEGACY) && g->act && ((uintptr_t)g->act & 15))
        return (int)cudaErrorInvalidValue;
    if (g->act_in && (((uintptr_t)g->act_in & 15) || kvd_k_gemv_act_kind(g->wtype) == GF_ACT_NONE))
        return (int)cudaErrorInvalidValue;
    if (g->n_emit < 0 || g->n_emit > 2 ||
        (g->n_emit && (!g->counter || !(g->epi == KVD_K_GEMV_SWIGLU ||
                                        (g->epi == KVD_K_GEMV_ADD_NORM && g->norm_w)))))
        return (int)cudaErrorInvalidValue;
    if (g->rope && (g->epi != KVD_K_GEMV_STORE || !g->counter ||
                    !rope_kv_args_ok(g->n_tokens, g->rope->n_heads, g->rope->n_rot, g->rope->mode,
                                     g->rope->kv, g->rope->layer)))
        return (int)cudaErrorInvalidValue;
    for (int i = 0; i < g->n_emit; i++) {
        const int ek = kvd_k_gemv_act_kind(g->emit_wtype[i]);
        if (ek == GF_ACT_NONE || !g->emit[i] || ((uintptr_t)g->emit[i] & 15) ||
            g->seg[0].rows % (ek == GF_ACT_LEGACY ? 32 : 256))
            return (int)cudaErrorInvalidValue;
    }
    int rows = 0;
    for (int i = 0; i < g->n_seg; i++)
        rows += g->seg[i].rows;
    if (rows == 0)
        return 0;
    if (g->split)
        return g->wtype == KVD_KW_Q4_K ? gf_by_tokens<KVD_KW_Q4_K, KVD_KW_Q6_K>(g, stream)
                                       : gf_by_tokens<KVD_KW_Q5_K, KVD_KW_Q6_K>(g, stream);
    switch (g->wtype) {
    case KVD_KW_F32:
        return gf_by_tokens<KVD_KW_F32>(g, stream);
    case KVD_KW_F16:
        return gf_by_tokens<KVD_KW_F16>(g, stream);
    case KVD_KW_BF16:
        return gf_by_tokens<KVD_KW_BF16>(g, stream);
    case KVD_KW_Q8_0:
        return gf_by_tokens<KVD_KW_Q8_0>(g, stream);
    case KVD_KW_Q4_0:
        return gf_by_tokens<KVD_KW_Q4_0>(g, stream);
    case KVD_KW_Q4_1:
        return gf_by_tokens<KVD_KW_Q4_1>(g, stream);
    case KVD_KW_Q5_0:
        return gf_by_tokens<KVD_KW_Q5_0>(g, stream);
    case KVD_KW_Q5_1:
        return gf_by_tokens<KVD_KW_Q5_1>(g, stream);
    case KVD_KW_Q4_K:
        return gf_by_tokens<KVD_KW_Q4_K>(g, stream);
    case KVD_KW_Q5_K:
        return gf_by_tokens<KVD_KW_Q5_K>(g, stream);
    default:
        return gf_by_tokens<KVD_KW_Q6_K>(g, stream);
    }
}

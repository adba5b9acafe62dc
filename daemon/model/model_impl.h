/* The model's private layout, shared by model.c (loading) and
 * model_forward.c (the forward step). Not for other modules: they use
 * model.h. */
#ifndef KVD_MODEL_IMPL_H
#define KVD_MODEL_IMPL_H

#include "compute.h"
#include "model.h"

/* Weights of one decoder layer; biases are zero-sized (data NULL) when the
 * architecture has none. Shapes as ctensor (ne0 = in, ne1 = out). */
struct model_layer {
    struct ctensor attn_norm;  /* f32 [n_embd] */
    struct ctensor wq, wk, wv; /* [n_embd] -> [n_head*head_dim], [n_head_kv*head_dim] x2 */
    struct ctensor bq, bk, bv; /* f32 biases (qwen2) */
    struct ctensor wo;         /* [n_head*head_dim] -> [n_embd] */
    struct ctensor ffn_norm;   /* f32 [n_embd] */
    struct ctensor gate, up;   /* [n_embd] -> [n_ff] */
    struct ctensor down;       /* [n_ff] -> [n_embd] */
};

struct model {
    struct model_hparams hp;
    struct backend *be; /* not owned */
    const struct compute_ops *ops;
    struct compute_ctx *cx; /* owned */
    void *weights;          /* owned device buffer holding every tensor */
    struct ctensor tok_embd, output_norm, output, rope_freqs; /* output = tok_embd when tied */
    struct model_layer *layers;                               /* owned, [n_layer] */
};

#endif

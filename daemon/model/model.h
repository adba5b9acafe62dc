/* The model: Llama-family GGUF weights loaded onto a backend, and one forward
 * step over a batch of sequences whose KV cache lives in the memory
 * manager's paged blocks. Architectures llama and qwen2; weight types f32,
 * f16, bf16, q8_0. Semantics follow llama.cpp (see docs/model.md). */
#ifndef KVD_MODEL_H
#define KVD_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "compute.h"
#include "kvd/status.h"
#include "kvmm.h"

struct model_hparams {
    char arch[16]; /* "llama" or "qwen2" */
    char name[64]; /* general.name, or "" */
    uint32_t n_vocab, n_ctx, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_rot;
    float rms_eps, rope_base;
    enum rope_mode rope_mode;     /* NORM for llama, NEOX for qwen2 */
    int has_qkv_bias;             /* qwen2 */
    int tied_output;              /* output.weight absent: token_embd.weight is used */
    int has_rope_freqs;           /* rope_freqs.weight present (Llama 3.1 scaling) */
    enum ctype wtype;             /* type of the attn_q weight of layer 0 (for display) */
    uint64_t n_params;            /* elements of all weights */
    uint64_t weight_bytes;        /* bytes of all weights as a decode step reads them */
    uint64_t weight_device_bytes; /* device bytes the weights take, with the copies a
                                   * backend keeps (cuda: bf16 for GEMMs) */
    /* XXH3-128 of the file's header (metadata and tensor table) and of the
     * data of every tensor the model uses, hashed as the load uploads them
     * (no second pass over the file): names the KV this model computes
     * (blockkey.h), so another file, quantization or weight never matches. */
    uint8_t fingerprint[16];
};

struct model_opts {
    uint32_t n_threads; /* cpu compute threads; 0 = nproc */
};

struct model;

/* Loads and validates the GGUF at path, uploads every weight to `be` once
 * (native type, no conversion), and creates the backend's compute context.
 * be->compute must be set (KVD_EUNSUPPORTED otherwise). Errors: KVD_ENOTFOUND
 * (no file), KVD_EBADREQ (corrupt file, missing tensor, shape mismatch),
 * KVD_EUNSUPPORTED (architecture or type), KVD_ENOMEM; err names the problem. */
int model_load(const char *path, struct backend *be, struct model **out, struct kvd_error *err);
int model_load_opts(const char *path, struct backend *be, const struct model_opts *opts,
                    struct model **out, struct kvd_error *err);
void model_free(struct model *m);
/* The hyperparameters of the GGUF at path from its header alone (the file
 * is mapped, no tensor data read, nothing uploaded): what the daemon knows
 * of a model before its first load. n_vocab from token_embd.weight;
 * weight_bytes and weight_device_bytes: the tensors' bytes in the file (the
 * backend's copies are known once it has loaded); n_params their elements;
 * fingerprint zero. Errors as model_load's for the header. */
int model_probe(const char *path, struct model_hparams *hp, struct kvd_error *err);
const struct model_hparams *model_hparams(const struct model *m);
/* The KV geometry this model needs: layers, kv_heads, head_dim from the
 * model; block_tokens and dtype as given. */
void model_kv_geom(const struct model *m, uint32_t block_tokens, enum kv_dtype dt,
                   struct kv_geom *g);

/* One sequence's part of a step. */
struct fwd_seq {
    const uint32_t *tokens; /* host [n_tokens]: new tokens this step */
    uint32_t n_tokens;      /* >= 1: a prefill chunk or 1 decode token */
    uint32_t pos0;          /* position of tokens[0]; positions < pos0 are in the blocks */
    const uint32_t *slots;  /* host [n_slots]: device slots of the blocks covering */
    uint32_t n_slots;       /*   positions [0, pos0 + n_tokens), in order */
    /* Every row's output, not only the last one's: a speculative
     * verification (the last accepted token and the draft tokens after
     * it), whose rows each give the logits/pick of the position after
     * them. Such a sequence has n_tokens outputs, any other one 1. */
    bool all_rows;
};

/* A step's outputs are its "output rows": for each sequence in order,
 * every row (all_rows) or its last row; n_out of them in all. */
struct fwd_batch {
    const struct fwd_seq *seqs; /* host [n_seqs] */
    uint32_t n_seqs;
    void *kv_arena;             /* device: slot s at kv_arena + s * kv_block_bytes(geom) */
    const struct kv_geom *geom; /* must match model_kv_geom (layers, kv_heads, head_dim) */
    uint32_t n_arena_slots;     /* slots in the arena, to bound-check the tables; 0 = unchecked */
    float *logits;              /* out, host [n_out][n_vocab], one per output row; may be NULL */
    /* Sampling on the backend (the sample op): host [n_out] rows, or NULL;
     * tokens: out, host [n_out], the picks (0 for a skipped row). At least
     * one of logits and sample is set. */
    const struct sample_row *sample;
    uint32_t *tokens;
    /* Batch-invariant rows: the rows of the leading sequences that are
     * decodes (1 token) or all_rows are each computed exactly as a one-token
     * decode of that position alone in a step would be (the same matmul and
     * attention arithmetic and reduction order), whatever else the step
     * holds, so a speculative verification reproduces plain decoding bit
     * for bit. The cpu backend's rows never depend on the batch, so this
     * changes nothing there; on cuda those rows take the GEMV and the
     * decode attention (compute.h matmul_inv, attn_desc.n_dec). */
    bool invariant;
};

/* Scratch buffers on the device sized for max_batch_tokens tokens,
 * max_seqs sequences and max_out output rows per step (fwd_ctx_new:
 * max_out = max_seqs), reused step to step. Owned by the caller; one
 * fwd_ctx is used by one thread at a time. */
struct fwd_ctx;
int fwd_ctx_new(struct model *m, uint32_t max_batch_tokens, uint32_t max_seqs,
                struct fwd_ctx **out);
int fwd_ctx_new_out(struct model *m, uint32_t max_batch_tokens, uint32_t max_seqs, uint32_t max_out,
                    struct fwd_ctx **out);
void fwd_ctx_free(struct fwd_ctx *c);
/* The backend bytes a fwd_ctx_new_out of these sizes takes for a model of
 * hp (its scratch), without making it: what a budget charges for it. */
uint64_t fwd_ctx_bytes(const struct model_hparams *hp, uint32_t max_batch_tokens, uint32_t max_seqs,
                       uint32_t max_out);
/* The device bytes c holds now as the backend allocated them (its
 * buffers, rounded as the allocator rounds, and its block tables as they
 * grew): what fwd_ctx_bytes estimates. 0 where the backend cannot tell
 * (compute_ops.dev_bytes). Callable from any thread. */
size_t fwd_ctx_dev_bytes(const struct fwd_ctx *c);
/* The device bytes m's compute context holds now, as allocated: its
 * weights and every forward context on it (0: the backend cannot tell). */
size_t model_dev_bytes(const struct model *m);
/* Message of the last model_forward failure on this context. */
const char *fwd_ctx_errmsg(const struct fwd_ctx *c);

/* Runs one step: writes the K/V of every new token into its block, and the
 * logits of each output row (each sequence's last new token, or every one
 * of an all_rows sequence) into b->logits and/or the token sampled from
 * them into b->tokens. Validates the
 * batch first (nothing is written on a validation error): KVD_EBADREQ for an
 * out-of-vocab token, n_tokens 0, pos0 + n_tokens > n_ctx, too few or
 * out-of-range slots, a slot repeated within a sequence or a geometry that
 * does not match; KVD_ETOOLARGE for more tokens, sequences or output rows
 * than the fwd_ctx was sized for. */
int model_forward(struct model *m, struct fwd_ctx *c, const struct fwd_batch *b);
/* model_forward in two halves, for a caller that works on the host while the
 * device runs the step: submit validates, uploads and issues every op (on
 * an asynchronous backend it returns while the device still computes; on
 * the cpu backend the step is done when it returns); finish waits for the
 * step and copies b->tokens / b->logits back (the pointers given to submit,
 * which must stay valid until then). After a submit that returned 0 exactly
 * one finish must follow before the next submit on c; a failed submit needs
 * none (finish then returns 0 and does nothing). */
int model_forward_submit(struct model *m, struct fwd_ctx *c, const struct fwd_batch *b);
int model_forward_finish(struct model *m, struct fwd_ctx *c);
/* Whether m's backend runs a submitted step asynchronously (cuda): the host
 * time between model_forward_submit and model_forward_finish is then free. */
bool model_async(const struct model *m);
/* Kernel launches of the last decode-only step on this model's compute
 * context (compute.h step_launches); 0 on a backend without kernels. */
uint32_t model_step_launches(const struct model *m);

/* A debugging aid (kvd-trace-cmp compares kvd's intermediates with
 * llama.cpp's): with a trace set, model_forward shows fn the output of every
 * op, in order, copied to host memory (v: rows x cols f32, rows = the step's
 * rows). name is llama.cpp's name of the same tensor ("attn_norm", "Qcur",
 * "Qcur.bias", "Qcur.rope", "kqv_out", "attn_wo", "ffn_inp", "ffn_norm",
 * "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out", "result_norm",
 * "result_output"...), layer is -1 outside the layers. fn returns 1 when it
 * changed v (the op's output is replaced by it: the next ops start from
 * those values), 0 to leave it, < 0 to fail the step (KVD_EINTERNAL). Steps
 * are not captured (step_begin) while a trace is set. With none set (the
 * default) it costs one test per op. fn NULL removes it; KVD_ENOMEM. */
typedef int (*fwd_trace_fn)(void *ud, const char *name, int layer, float *v, uint32_t rows,
                            uint32_t cols);
int fwd_ctx_set_trace(struct fwd_ctx *c, fwd_trace_fn fn, void *ud);

#endif

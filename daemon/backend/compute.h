/* The compute-ops table: every operation the model's forward pass needs, at
 * the granularity of one op over a whole batch. model_forward is written once
 * against this table; the cpu backend (compute_cpu*.c) and the cuda backend
 * (kernels/) implement it with the exact semantics documented here.
 *
 * Pointer spaces. "device" pointers come from buf_alloc (or are inside the
 * KV arena); on cpu they are ordinary host memory, on cuda they are GPU
 * memory. "host" pointers are plain process memory. Every op argument below
 * says which it is. All float activations are f32, row-major, rows
 * contiguous (row stride = row width unless stated).
 *
 * Ordering. Ops are issued in program order on one stream per compute
 * context; an implementation may run them asynchronously (cuda) as long as
 * they execute in issue order. upload returns once `src` may be reused;
 * download returns once the data is in host memory (it orders after every op
 * issued before it). Ops return 0 or an enum kvd_err (KVD_EINTERNAL for a
 * launch failure); asynchronous failures may surface at the next download or
 * sync. Arguments are validated by the caller (model_forward): ops may assume
 * ids < rows of the table, positions/slots in range, and shapes consistent.
 *
 * Threads. One compute context is used by one thread at a time (the executor
 * thread); the implementation may use its own worker threads inside an op. */
#ifndef KVD_COMPUTE_H
#define KVD_COMPUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kv_types.h"
#include "sampler_pick.h" /* struct sample_row, what the sample op reads */

/* How a 2-D weight's bytes are arranged on the device. */
enum clayout {
    CL_ROWS = 0,  /* as in the GGUF file: row j at byte j * ctype_row_bytes(type, ne0) */
    CL_PACK16,    /* cpu backend: 16 rows interleaved value by value (compute_cpu_matmul.c) */
    CL_ROWS_BF16, /* cuda backend: CL_ROWS, then a bf16 copy for GEMMs (compute_cuda_ops.c) */
    CL_PLANES,    /* cuda backend, quantized types: each field of every block in its own run
                   * (kernels/planes.cuh), the same bytes; Q8_0 then a bf16 copy for GEMMs */
};

/* A 2-D weight on the device: ne0 = inner (contiguous) dimension = "in",
 * ne1 = rows = "out". For a quantized type, ne0 is a multiple of its block
 * (ctype_block_elems: 32, or 256 for the K-quants). 1-D weights
 * (norms, biases, rope_freqs) are always CT_F32 with ne1 = 1, CL_ROWS.
 * nbytes: the bytes at data (the file's size for CL_ROWS). */
struct ctensor {
    enum ctype type;
    enum clayout layout;
    bool rows_only; /* read by get_rows alone (an untied token embedding), never by
                     * matmul: a backend need not prepare it for GEMMs */
    uint32_t ne0, ne1;
    size_t nbytes;
    void *data; /* device, owned by whoever allocated it (the model) */
};

/* The tok_slot of a padding row: kv_write skips it. */
#define COMPUTE_PAD_SLOT UINT32_MAX

/* RoPE modes, as in ggml: NORM rotates adjacent pairs (x[2i], x[2i+1]) (arch
 * llama); NEOX rotates (x[i], x[i + n_rot/2]) (arch qwen2). */
enum rope_mode { ROPE_NORM = 0, ROPE_NEOX = 2 };

/* Paged attention over a batch of sequences (one call per layer).
 *
 * The batch has n_tokens query rows, grouped by sequence: the rows of
 * sequence s are [seq_qstart[s], seq_qstart[s+1]) and row r of it (counting
 * from 0) is at position seq_pos0[s] + r. Its KV block table is
 * slots[seq_slot0[s] .. seq_slot0[s+1]): position p lives in block
 * slots[seq_slot0[s] + p / block_tokens], row p % block_tokens, i.e. K of
 * (layer, kv_head h, position p) is at
 *   arena + slot*block_bytes + ((layer*2 + 0)*kv_heads + h)*block_tokens*row_bytes
 *         + (p % block_tokens)*row_bytes             (V: the "+ 1" half)
 * (row_bytes = kv_row_bytes(dtype, head_dim): one token's head_dim values)
 * The K/V of the new rows must already be written (kv_write) before this op.
 *
 * For query row t at position p, head h (kv head g = h / (n_head/kv_heads)):
 *   s_j   = scale * dot(q[t][h][:], K[g][j][:])  for j in [0, p]   (causal)
 *   a_j   = softmax_j(s_j)   (f32, max-subtracted)
 *   out[t][h][:] = sum_j a_j * V[g][j][:]
 * K and V are read in the geometry's dtype and widened to f32 (q8_0/fp8:
 * dequantized, d*q or s*e4m3(q), as compute_cpu_kv.h defines).
 *
 * Padding (see step_bucket): a sequence may have no rows (seq_qstart[s] ==
 * seq_qstart[s+1]), and rows at or after seq_qstart[n_seqs] belong to no
 * sequence; neither gets any output (those out rows are left as they are). */
/* The arguments of rope_kv_write after q, k, v (matmul_qkv_rope_kv). */
struct rope_kv_args {
    uint32_t n_head, n_rot;
    const uint32_t *pos;
    enum rope_mode mode;
    float base;
    const float *freq_factors;
    void *arena;
    const struct kv_geom *geom;
    uint32_t layer;
    const uint32_t *tok_slot;
};

struct attn_desc {
    const float *q;             /* device [n_tokens][n_head][head_dim], already roped */
    float *out;                 /* device [n_tokens][n_head][head_dim] */
    const void *arena;          /* device: the KV arena (slot 0 at arena) */
    const struct kv_geom *geom; /* host */
    uint32_t layer;
    uint32_t n_head; /* query heads; a multiple of geom->kv_heads */
    float scale;     /* 1/sqrt(head_dim) */
    uint32_t n_tokens, n_seqs;
    const uint32_t *seq_qstart; /* device [n_seqs+1] */
    const uint32_t *seq_pos0;   /* device [n_seqs] */
    const uint32_t *seq_slot0;  /* device [n_seqs+1] */
    const uint32_t *slots;      /* device [seq_slot0[n_seqs]] */
    /* Host-side hints for launch geometry: the largest number of new rows of
     * one sequence, and the largest pos0 + rows of one sequence. */
    uint32_t max_q, max_kv;
    /* Host copies of seq_qstart/seq_pos0 (same contents), so a backend can
     * plan work without reading device memory. */
    const uint32_t *h_seq_qstart, *h_seq_pos0;
    /* Batch-invariant rows (model.h fwd_batch.invariant; all zero
     * otherwise). `alone`: every row is computed as if its sequence were
     * the only one in the step (no launch heuristic may depend on the
     * other sequences). Rows [0, n_dec) are the rows of sequences
     * [0, s_dec) (seq_qstart[s_dec] == n_dec) and each is computed as the
     * one row of a one-token decode: row r at position dec_pos0[r] over the
     * block table at slots + dec_slot0[r] (dec_qstart = 0, 1, .., n_dec);
     * device arrays [n_dec (+1)]. A backend whose rows never depend on
     * the others (cpu) may ignore all of this. */
    bool alone;
    uint32_t n_dec, s_dec;
    const uint32_t *dec_qstart, *dec_pos0, *dec_slot0;
};

/* What identifies a step for step_begin: a graph captured for one step is
 * replayed only for a step with the same values here. */
struct compute_step {
    const void *owner;  /* the caller's fixed buffers (the fwd_ctx) */
    const void *arena;  /* the KV arena */
    const void *tables; /* the caller's block-table buffer (it may move) */
    uint32_t n_tokens, n_seqs;
    uint32_t n_out;   /* output rows (gather, head, sample) */
    uint32_t max_q;   /* 1: decode only; more: a mixed step (attn_desc.max_q) */
    uint32_t max_kv;  /* largest context: sizes attention's split count */
    uint32_t sampled; /* 1: the step ends with the sample op */
    uint32_t alone;   /* 1: attn_desc.alone (a batch-invariant step) */
    /* A batch-invariant step's one-row prefix (0 otherwise): the rows the
     * projections take with the one-row arithmetic (n_one), attention's
     * decode rows (attn_desc.n_dec, s_dec) and the output rows of the
     * prefix (the head's n_one). */
    uint32_t n_one, n_dec, s_dec, n_out_one;
};

struct compute_conf {
    uint32_t n_threads; /* cpu: worker threads incl. the caller; 0 = nproc */
};

struct compute_ctx; /* implementation-defined */

struct compute_ops {
    const char *name; /* "cpu", "cuda" */
    /* The ops run asynchronously: a download (or sync) is the first call
     * that waits for the device (cuda); false: each op is done when it
     * returns (cpu). */
    bool async;

    int (*ctx_new)(struct backend *be, const struct compute_conf *conf, struct compute_ctx **out);
    void (*ctx_free)(struct compute_ctx *cx);

    /* Device buffers: at least 64-byte aligned, contents undefined.
     * Returns 0 or KVD_ENOMEM. buf_free(NULL) is a no-op. */
    int (*buf_alloc)(struct compute_ctx *cx, size_t bytes, void **out);
    void (*buf_free)(struct compute_ctx *cx, void *p);
    int (*upload)(struct compute_ctx *cx, void *dst_dev, const void *src_host, size_t bytes);
    int (*download)(struct compute_ctx *cx, void *dst_host, const void *src_dev, size_t bytes);
    int (*sync)(struct compute_ctx *cx); /* waits for every op issued so far */
    /* OPTIONAL: the device bytes the context holds now, as allocated: every
     * live buffer buf_alloc gave (rounded as the allocator rounds it) and
     * the scratch the context grows for itself. Callable from any thread. */
    size_t (*dev_bytes)(struct compute_ctx *cx);
    /* OPTIONAL: device bytes the context holds for the weights' sake beyond
     * the bytes weight_bytes gave them (cuda: the bf16 tile quantized
     * weights are dequantized into before a GEMM), known once every weight
     * is uploaded; counted in the model's weight_device_bytes. */
    size_t (*weight_scratch_bytes)(struct compute_ctx *cx);

    /* Weights in the backend's layout of choice (both optional; NULL: the
     * file's rows, copied with upload). weight_bytes: the device bytes
     * weight_upload needs for t (type and shape set, layout CL_ROWS).
     * weight_upload: writes t's file bytes src (t->nbytes of them, CL_ROWS)
     * to t->data, which has weight_bytes(t) bytes, and sets t->layout and
     * t->nbytes to what it stored (the bytes a decode step reads: extra
     * copies a layout keeps, like CL_ROWS_BF16's, are not counted). */
    size_t (*weight_bytes)(const struct ctensor *t);
    int (*weight_upload)(struct compute_ctx *cx, struct ctensor *t, const void *src);
    /* OPTIONAL: whether every op here takes weights of type t; the model
     * refuses a file with a tensor of any other type. NULL: f32, f16, bf16
     * and q8_0. */
    bool (*weight_type_ok)(enum ctype t);

    /* out[i][:] = row ids[i] of w, widened to f32 (w: [ne1][ne0], any type).
     * ids device [n], each < w->ne1; out device [n][w->ne0]. */
    int (*get_rows)(struct compute_ctx *cx, const struct ctensor *w, const uint32_t *ids,
                    uint32_t n, float *out);
    /* out[r][i] = x[r][i] / sqrt(mean_i(x[r][i]^2) + eps) * w[i]
     * x, out device [rows][n] (out may equal x); w device f32 [n]. */
    int (*rmsnorm)(struct compute_ctx *cx, float *out, const float *x, const float *w,
                   uint32_t rows, uint32_t n, float eps);
    /* The residual add fused with the norm after it: x[r][i] += res[r][i],
     * then out = rmsnorm(x) * w as above. x, res, out device [rows][n]; out
     * may equal res (not x). */
    int (*add_rmsnorm)(struct compute_ctx *cx, float *x, const float *res, float *out,
                       const float *w, uint32_t rows, uint32_t n, float eps);
    /* y[r][j] = sum_i W[j][i] * x[r][i], accumulated in (at least) f32.
     * W = w ([ne1][ne0], any type); x device [rows][w->ne0]; y device
     * [rows][w->ne1]; y does not overlap x. */
    int (*matmul)(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                  float *y);
    /* OPTIONAL (NULL: matmul's rows never depend on how many rows the call
     * has, as on cpu): matmul, with each of rows [0, n_one) computed with
     * the arithmetic of a one-row call (a decode row), whatever `rows` is;
     * rows [n_one, rows) as matmul computes them. */
    int (*matmul_inv)(struct compute_ctx *cx, const struct ctensor *w, const float *x,
                      uint32_t rows, uint32_t n_one, float *y);
    /* y[r][i] += b[i]; y device [rows][n], b device f32 [n]. */
    int (*add_bias)(struct compute_ctx *cx, float *y, const float *b, uint32_t rows, uint32_t n);
    /* In-place RoPE of x device [rows][n_heads][head_dim] (row stride
     * n_heads*head_dim). Row r is at position pos[r] (device [rows]). For each
     * head and pair index i in [0, n_rot/2):
     *   theta = pos * base^(-2i/n_rot) / (freq_factors ? freq_factors[i] : 1)
     *   NORM: (a, b) = (x[2i], x[2i+1]);  NEOX: (a, b) = (x[i], x[i+n_rot/2])
     *   a' = a*cos(theta) - b*sin(theta);  b' = a*sin(theta) + b*cos(theta)
     * Elements at index >= n_rot are unchanged. freq_factors: device f32
     * [n_rot/2] or NULL. n_rot is even and <= head_dim. */
    int (*rope)(struct compute_ctx *cx, float *x, uint32_t rows, uint32_t n_heads,
                uint32_t head_dim, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                float base, const float *freq_factors);
    /* Writes K and V of n_tokens rows into the paged arena for `layer`:
     * k, v device [n_tokens][kv_heads][head_dim]; row t goes to block
     * tok_slot[t], row tok_pos[t] % block_tokens (device arrays [n_tokens]),
     * converted to geom->dtype with round-to-nearest-even (f16: IEEE half,
     * overflow to inf; bf16: upper 16 bits of the f32, rounded, NaN kept;
     * q8_0/fp8: each head's row quantized with its scales, bit for bit the
     * rules of compute_cpu_kv.h on every backend).
     * A row whose tok_slot is COMPUTE_PAD_SLOT (padding) writes nothing. */
    int (*kv_write)(struct compute_ctx *cx, void *arena, const struct kv_geom *geom, uint32_t layer,
                    const float *k, const float *v, uint32_t n_tokens, const uint32_t *tok_slot,
                    const uint32_t *tok_pos);
    int (*attention)(struct compute_ctx *cx, const struct attn_desc *d);
    /* g[i] = silu(g[i]) * u[i], silu(x) = x / (1 + exp(-x)); device [n]. */
    int (*silu_mul)(struct compute_ctx *cx, float *g, const float *u, size_t n);
    /* x[i] += y[i]; device [n]. */
    int (*add)(struct compute_ctx *cx, float *x, const float *y, size_t n);
    /* out[i][:] = x[rows[i]][:]; x device [*][width], rows device [n],
     * out device [n][width] (no overlap with x). Picks each sequence's last
     * position before the final norm and the output projection. */
    int (*gather_rows)(struct compute_ctx *cx, float *out, const float *x, const uint32_t *rows,
                       uint32_t n, uint32_t width);
    /* out[r] = the token sampler_pick (sampler_pick.h) picks for p[r] from
     * logits[r][:]: logits device [rows][vocab], p device [rows], out device
     * [rows]. So a step downloads token ids, not the vocabulary. */
    int (*sample)(struct compute_ctx *cx, const float *logits, uint32_t rows, uint32_t vocab,
                  const struct sample_row *p, uint32_t *out);

    /* OPTIONAL fused ops (NULL on cpu): each computes what the chain of ops
     * named in its comment computes, in one op, so a backend can run the
     * chain as fewer kernels; NULL: model_forward issues the chain. A
     * backend may run the chain itself for shapes it does not fuse. n_one:
     * rows [0, n_one) each computed with the arithmetic of a one-row call,
     * as matmul_inv computes them (batch-invariant rows), and the same in
     * the fused op as in a one-row call of it.
     *
     * matmul_n: y[i] = x . w[i]^T (+ bias[i]) for i < n (n <= 3): one input,
     *   several weights (q, k, v): matmul(w[i], x, rows, y[i]), then
     *   add_bias(y[i], bias[i], rows, w[i]->ne1) where bias[i] is not NULL
     *   (bias[i] device f32 [w[i]->ne1]).
     * matmul_swiglu: out = silu(x . gate^T) * (x . up^T): matmul(gate, x,
     *   rows, out); matmul(up, x, rows, tmp); silu_mul(out, tmp, rows *
     *   gate->ne1). tmp: device [rows][up->ne1] scratch whose contents are
     *   undefined afterwards. gate and up have the same shape.
     * matmul_add_rmsnorm: the residual update of a block: x += xin . w^T,
     *   then out = rmsnorm(x) * norm (eps): matmul(w, xin, rows, out);
     *   add_rmsnorm(x, out, out, norm, rows, w->ne1, eps); with norm NULL
     *   only the add (matmul, then add(x, out)), out's contents undefined
     *   afterwards. x, out device [rows][w->ne1], xin [rows][w->ne0]; no
     *   two of x, xin, out overlap.
     * rope_kv_write: rope(q, rows, n_head, ...); rope(k, rows,
     *   geom->kv_heads, ...); kv_write(arena, geom, layer, k, v, rows,
     *   tok_slot, pos): both RoPEs at pos, then k (roped) and v to the
     *   blocks (the row of position pos[r] in block tok_slot[r]).
     * matmul_qkv_rope_kv: matmul_n(3, w, bias, x, rows, n_one, y), then
     *   rope_kv_write(y[0], y[1], y[2], rows, r->...): a layer's q, k, v
     *   projections with their RoPE and KV write, so that the projection's
     *   launch may end with them. */
    int (*matmul_n)(struct compute_ctx *cx, uint32_t n, const struct ctensor *const *w,
                    const float *const *bias, const float *x, uint32_t rows, uint32_t n_one,
                    float *const *y);
    int (*matmul_swiglu)(struct compute_ctx *cx, const struct ctensor *gate,
                         const struct ctensor *up, const float *x, uint32_t rows, uint32_t n_one,
                         float *out, float *tmp);
    int (*matmul_add_rmsnorm)(struct compute_ctx *cx, const struct ctensor *w, const float *xin,
                              uint32_t rows, uint32_t n_one, float *x, const float *norm, float eps,
                              float *out);
    /* OPTIONAL (NULL on cpu), a hint that changes no result: the output y
     * of the next fused op (matmul_swiglu's out, matmul_add_rmsnorm's out
     * with a norm) is read next by the projections of w[0..n) (n <= 3, NULL
     * entries skipped), each as its matmul_n / matmul_swiglu /
     * matmul_add_rmsnorm input, so the backend may quantize y once where it
     * is made instead of in each reader. The next fused op consumes the
     * hint whether it uses it or not. */
    void (*next_readers)(struct compute_ctx *cx, const float *y, uint32_t n,
                         const struct ctensor *const *w);
    int (*rope_kv_write)(struct compute_ctx *cx, float *q, float *k, const float *v, uint32_t rows,
                         uint32_t n_head, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                         float base, const float *freq_factors, void *arena,
                         const struct kv_geom *geom, uint32_t layer, const uint32_t *tok_slot);
    int (*matmul_qkv_rope_kv)(struct compute_ctx *cx, const struct ctensor *const *w,
                              const float *const *bias, const float *x, uint32_t rows,
                              uint32_t n_one, float *const *y, const struct rope_kv_args *r);

    /* OPTIONAL (NULL on cpu): the number of sequences a decode-only step of
     * n_seqs sequences is padded to (>= n_seqs), so that steps of nearby
     * sizes share one captured graph. model_forward adds the padding as
     * sequences of no rows plus as many rows of token 0 at position 0 in no
     * sequence, with tok_slot COMPUTE_PAD_SLOT (their K/V is not written,
     * attention gives them nothing, sample skips them, and their outputs are
     * not downloaded), up to what the fwd_ctx holds. */
    uint32_t (*step_bucket)(struct compute_ctx *cx, uint32_t n_seqs);
    /* OPTIONAL (NULL on cpu): for a step with a sequence of several rows (a
     * mixed step: prefill chunks, verifications, decode rows), the number
     * n rows is padded to (>= n): model_forward pads the step's rows, its
     * output rows and its largest row count of one sequence (max_q) each
     * up to it, and its sequences to step_bucket's, so that steps of
     * nearby shapes share one captured graph. The pad rows are rows of no
     * sequence as above; the pad output rows read row 0 and are skipped by
     * sample and not downloaded. */
    uint32_t (*row_bucket)(struct compute_ctx *cx, uint32_t n);
    /* OPTIONAL (NULL on cpu): whole-step capture and replay (CUDA graphs on
     * cuda). model_forward calls step_begin after its metadata uploads and
     * before the first op. *replayed = 1: the backend already ran this
     * step's ops from a graph captured earlier for an identical step (same
     * owner buffers, arena and shapes); the caller skips its ops and goes
     * to the download. *replayed = 0: the caller issues its ops, then calls
     * step_end(cx, rc) with rc = 0 if every op was issued, which (when the
     * backend chose to capture) ends the capture and runs the graph; with
     * the failing op's rc otherwise, which ends any capture and waits for
     * the part of the step already issued (so the caller may reuse or free
     * its buffers at once). The ops between the two calls must not
     * allocate or synchronize. */
    int (*step_begin)(struct compute_ctx *cx, const struct compute_step *st, int *replayed);
    int (*step_end)(struct compute_ctx *cx, int rc);
    /* OPTIONAL (NULL on cpu): the kernel launches of the last decode-only
     * step (max_q 1) that completed between step_begin and step_end (a
     * replayed graph counts the kernels it holds); 0 before the first. */
    uint32_t (*step_launches)(struct compute_ctx *cx);
};

/* The cpu implementation (compute_cpu.c); the cpu backend sets
 * be->compute = compute_cpu_ops(). */
const struct compute_ops *compute_cpu_ops(void);

#endif

/* compute_cuda_impl: the cuda compute context, private to compute_cuda.c
 * (context, buffers, transfers, CUDA-graph capture/replay) and
 * compute_cuda_ops.c (the model's operations on kernels/ and cuBLAS). */
#ifndef KVD_CUDA_COMPUTE_IMPL_H
#define KVD_CUDA_COMPUTE_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "compute.h"
#include "backend_cuda.h"
#include "compute_cuda.h"
#include "kernels.h"

/* One captured step (decode-only or mixed). */
struct cuda_graph_entry {
    struct compute_step key;
    uint32_t seen;     /* eager runs so far (capture on the second) */
    uint64_t last_use; /* LRU stamp */
    bool failed;       /* capture failed once: always eager */
    uint32_t launches; /* kernels the captured step issued (each replay runs them) */
    cudaGraphExec_t exec;
};

#define CUDA_GRAPH_SLOTS 128

struct compute_ctx {
    struct backend *be;
    struct cuda_dev *dev;
    cudaStream_t stream; /* dev->compute */

    /* Pinned staging for small uploads, reused once the stream has drained
     * (after any sync/download): [stg_cap] bytes, stg_off used. */
    unsigned char *stg;
    size_t stg_cap, stg_off;

    /* Scratch grown on demand, never during a capture: bf16 activations for
     * cuBLAS [xb_cap] elements; decode-attention partials [part_cap] floats
     * and the counters of finished splits [done_cap] (zeroed when grown, 0
     * between launches). (The cuBLAS workspace is the device's:
     * backend_cuda.h.) */
    uint16_t *xb;
    size_t xb_cap;
    float *part;
    size_t part_cap;
    unsigned *done;
    size_t done_cap;
    /* The bf16 tile the quantized weights (not Q8_0) are dequantized into
     * before each GEMM, [wt_cap] elements: sized by weight_upload at model
     * load for the largest tile any weight needs (compute_cuda_ops.c). */
    uint16_t *wt;
    size_t wt_cap;
    size_t tile_elems; /* the most elements of one tile */
    /* The quantized GEMV's int8 activations [act_cap] bytes when they do
     * not fit in its shared memory (grown on demand like xb), and the
     * device word its fused residual norm counts finished blocks in (0
     * between launches). */
    void *act;
    size_t act_cap;
    unsigned *counter;
    /* Activations quantized once (kernels/gemv_fused.cu: emit, act_in).
     * readers: the weight types (their layouts, at most two) that read the
     * output y [.][in] of the next fused op, from compute.h next_readers;
     * pq: two sets of device buffers used in turn (a launch reads one, its
     * last block writes the other), each x [rows][in] quantized in the
     * layouts of wtype[0..n); pq_live: the set holding the current
     * quantization of its x (-1: none), pq_next: the set this fused op's
     * GEMV wrote (-1: none). Every fused op ends with pq_live = pq_next, so
     * a quantization lives from its producer to the op after it; step_begin
     * and the unfused norms drop it. */
    struct {
        const float *y;
        uint32_t in;
        int wtype[2];
        int n;
    } readers;
    struct cuda_preq {
        const float *x;
        uint32_t rows, in;
        int wtype[2];
        int n;
        void *buf[2];
        size_t cap[2];
    } pq[2];
    int pq_live, pq_next;
    /* RoPE with the KV write for the next fused GEMV launch to end with
     * (cuda_op_matmul_qkv_rope_kv; NULL: none). */
    const struct kvd_k_rope_args *gemv_rope;
    uint64_t n_act_quant, n_act_handed;
    /* What the context holds on the device (dev_bytes): buf_alloc's live
     * buffers (their sizes in live[], under live_mu) and its own scratch
     * above (xb, part, wt, act, counter); both counts atomic. */
    pthread_mutex_t live_mu;
    struct cuda_live_buf {
        void *p;
        size_t n;
    } * live;
    size_t n_live, live_cap;
    size_t live_bytes, scratch_bytes;

    /* CUDA graphs (decode-only and mixed steps). */
    bool graphs;                  /* enabled (KVD_CUDA_GRAPHS=0 turns them off) */
    bool no_qmma;                 /* K-quants past 8 rows through the tile + cuBLAS (benchmarks) */
    bool capturing;               /* between step_begin and step_end of a capture */
    struct cuda_graph_entry *cur; /* the entry being captured */
    struct cuda_graph_entry graph[CUDA_GRAPH_SLOTS];
    uint64_t clock;
    uint64_t graph_frees; /* dev->frees when the graphs were last checked */
    uint64_t n_captures, n_replays, n_eager, n_dropped, n_failed_syncs;
    uint64_t n_mixed_captures, n_mixed_replays; /* of those, mixed steps (max_q > 1) */
    uint64_t n_blas;                            /* cuBLAS GEMMs issued, all steps */

    /* Kernel launches: kvd_k_launches() at step_begin, cuBLAS calls issued
     * since (each counted as one launch), the step's key (decode-only or
     * not), and the count of the last decode-only step (compute.h
     * step_launches). */
    unsigned long long step_launch0;
    uint32_t step_blas;
    bool step_decode;
    uint32_t last_decode_launches;
};

/* Grows the scratch buffers (not allowed while capturing). 0 or KVD_ENOMEM /
 * KVD_EINTERNAL. */
int cuda_cx_need_xb(struct compute_ctx *cx, size_t elems);
int cuda_cx_need_part(struct compute_ctx *cx, size_t floats, size_t counters);
int cuda_cx_need_act(struct compute_ctx *cx, size_t bytes);
/* Grows quantized-activation buffer i of set s (cx->pq). */
int cuda_cx_need_pq(struct compute_ctx *cx, int s, int i, size_t bytes);
/* Ends a fused op: the quantization its GEMV emitted is the live one, any
 * other is dropped with the readers' hint. */
void cuda_pq_end_op(struct compute_ctx *cx);
/* The attention split count for n_seqs decode rows of n_head query heads
 * over kv (its head_dim, dtype and kv_heads pick the kernel whose occupancy
 * counts), the largest context max_kv: computed from a power-of-two bucket
 * of max_kv so eager and graph runs of one bucket agree. */
uint32_t cuda_cx_splits(const struct compute_ctx *cx, uint32_t n_seqs, uint32_t n_head,
                        const struct kvd_k_kv *kv, uint32_t max_kv);
/* Frees device memory of this context (waits for work still using it) and
 * counts the free, so every graph is dropped before the next step. */
void cuda_cx_free(struct compute_ctx *cx, void *p);
/* The fused GEMV over n (<= 3) weights of one type sharing x (compute_cuda_ops.c). */
int cuda_gemv(struct compute_ctx *cx, int n, const struct ctensor *const *w,
              const float *const *bias, const float *x, uint32_t rows, float *const *y, int epi,
              const float *norm_w, float eps, float *norm_out);
/* Maps a kernels/ status to kvd's: 0, or logs and returns KVD_EINTERNAL. */
int cuda_kstatus(int kernel_rc, const char *what);

/* The ops of compute_cuda_ops.c, installed in the table by compute_cuda.c. */
int cuda_op_get_rows(struct compute_ctx *cx, const struct ctensor *w, const uint32_t *ids,
                     uint32_t n, float *out);
int cuda_op_rmsnorm(struct compute_ctx *cx, float *out, const float *x, const float *w,
                    uint32_t rows, uint32_t n, float eps);
int cuda_op_add_rmsnorm(struct compute_ctx *cx, float *x, const float *res, float *out,
                        const float *w, uint32_t rows, uint32_t n, float eps);
int cuda_op_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
                   float *y);
/* 9..CUDA_GEMV_CHUNKED_ROWS rows of a quantized weight with no bf16 copy
 * (Q4_0 .. Q6_K) take the GEMV, KVD_K_GEMV_MAX_TOKENS rows a launch: the
 * weights are read ceil(rows / 8) times, fewer bytes than dequantizing them
 * into the bf16 tile for cuBLAS (a Q4_K matrix's bytes x 3.6 written, then
 * read), with the cpu's integer arithmetic (every row as in a one-row
 * call). Whether matmul takes that path for x and rows. */
#define CUDA_GEMV_CHUNKED_ROWS 32
bool cuda_gemv_chunked(const struct compute_ctx *cx, const struct ctensor *w, const float *x,
                       uint32_t rows);
/* Whether matmul takes x . w^T for these rows (more than
 * KVD_K_GEMV_MAX_TOKENS) through the K-quants' int8 tensor-core GEMM
 * (kernels/gemm_qmma.cu), whose every row equals the GEMV's for that row
 * alone: batch-invariant rows need no GEMV of their own. The GEMV chunks
 * above are then for the legacy quantized types only. */
bool cuda_qmma_takes(const struct compute_ctx *cx, const struct ctensor *w, const float *x,
                     uint32_t rows);
int cuda_op_matmul_inv(struct compute_ctx *cx, const struct ctensor *w, const float *x,
                       uint32_t rows, uint32_t n_one, float *y);
int cuda_op_add_bias(struct compute_ctx *cx, float *y, const float *b, uint32_t rows, uint32_t n);
int cuda_op_rope(struct compute_ctx *cx, float *x, uint32_t rows, uint32_t n_heads,
                 uint32_t head_dim, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                 float base, const float *freq_factors);
int cuda_op_kv_write(struct compute_ctx *cx, void *arena, const struct kv_geom *geom,
                     uint32_t layer, const float *k, const float *v, uint32_t n_tokens,
                     const uint32_t *tok_slot, const uint32_t *tok_pos);
int cuda_op_attention(struct compute_ctx *cx, const struct attn_desc *d);
int cuda_op_silu_mul(struct compute_ctx *cx, float *g, const float *u, size_t n);
int cuda_op_add(struct compute_ctx *cx, float *x, const float *y, size_t n);
int cuda_op_gather_rows(struct compute_ctx *cx, float *out, const float *x, const uint32_t *rows,
                        uint32_t n, uint32_t width);
int cuda_op_sample(struct compute_ctx *cx, const float *logits, uint32_t rows, uint32_t vocab,
                   const struct sample_row *p, uint32_t *out);
int cuda_op_matmul_n(struct compute_ctx *cx, uint32_t n, const struct ctensor *const *w,
                     const float *const *bias, const float *x, uint32_t rows, uint32_t n_one,
                     float *const *y);
int cuda_op_matmul_swiglu(struct compute_ctx *cx, const struct ctensor *gate,
                          const struct ctensor *up, const float *x, uint32_t rows, uint32_t n_one,
                          float *out, float *tmp);
int cuda_op_matmul_add_rmsnorm(struct compute_ctx *cx, const struct ctensor *w, const float *xin,
                               uint32_t rows, uint32_t n_one, float *x, const float *norm,
                               float eps, float *out);
void cuda_op_next_readers(struct compute_ctx *cx, const float *y, uint32_t n,
                          const struct ctensor *const *w);
int cuda_op_matmul_qkv_rope_kv(struct compute_ctx *cx, const struct ctensor *const *w,
                               const float *const *bias, const float *x, uint32_t rows,
                               uint32_t n_one, float *const *y, const struct rope_kv_args *r);
int cuda_op_rope_kv_write(struct compute_ctx *cx, float *q, float *k, const float *v, uint32_t rows,
                          uint32_t n_head, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                          float base, const float *freq_factors, void *arena,
                          const struct kv_geom *geom, uint32_t layer, const uint32_t *tok_slot);
/* The kernels' view of a KV arena of geometry g. */
void cuda_kv_of(struct kvd_k_kv *kv, const void *arena, const struct kv_geom *g);
size_t cuda_weight_bytes(const struct ctensor *t);
int cuda_weight_upload(struct compute_ctx *cx, struct ctensor *t, const void *src);
bool cuda_weight_type_ok(enum ctype t);
/* Device bytes held for the weights beyond their own (the dequant tile). */
size_t cuda_weight_scratch_bytes(struct compute_ctx *cx);

#endif

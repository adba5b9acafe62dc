/* kernels/: the cuda backend's device operations, one .cu per operation.
 * Every function here is plain C, enqueues its work on `stream` and returns
 * 0 or a cudaError_t value (as int); none synchronizes or allocates, so a
 * sequence of them can be captured into a CUDA graph.
 * Conventions: activations are f32 row-major [tokens][features]; weights are
 * row-major [out][in] (GGUF ne = [in, out]) in their GGUF type (F32, F16,
 * BF16, Q8_0, and the quantized Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K:
 * quant.cuh), the GEMM path reading bf16 (a copy made at load for F16/Q8_0,
 * tiles dequantized before each GEMM for Q4_0 .. Q5_1: compute_cuda_ops.c)
 * except the K-quants', which is int8 (gemm_qmma.cu); KV
 * blocks are laid out as kv_types.h says. The same sources also build for
 * the CPU emulator (docs/emulation.md): launches and shared memory go
 * through kernel_util.cuh's macros. */
#ifndef KVD_KERNELS_H
#define KVD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t without the CUDA headers */
typedef struct CUstream_st *kvd_stream;

/* Element types of KV blocks; the numbers equal enum kv_dtype (kv_types.h).
 * Q8_0 and FP8 rows are quantized with their scales inside (kv_row.cuh). */
enum kvd_k_dtype { KVD_K_F16 = 0, KVD_K_BF16 = 1, KVD_K_F32 = 2, KVD_K_Q8_0 = 3, KVD_K_FP8 = 4 };
/* Source types for weight conversion; the numbers equal GGUF ggml types. */
enum kvd_k_wtype {
    KVD_KW_F32 = 0,
    KVD_KW_F16 = 1,
    KVD_KW_Q4_0 = 2,
    KVD_KW_Q4_1 = 3,
    KVD_KW_Q5_0 = 6,
    KVD_KW_Q5_1 = 7,
    KVD_KW_Q8_0 = 8,
    KVD_KW_Q4_K = 12,
    KVD_KW_Q5_K = 13,
    KVD_KW_Q6_K = 14,
    KVD_KW_BF16 = 30
};
/* Values per block of a weight type (1 for F32/F16/BF16, 32 for Q4_0..Q8_0,
 * 256 for the K-quants); rows are whole blocks. 0 for an unknown type. */
int kvd_k_wtype_block(int wtype);
/* RoPE pair conventions (llama.cpp): NORM rotates (x[2i], x[2i+1]) (llama),
 * NEOX rotates (x[i], x[i + n_rot/2]) (qwen2). */
enum kvd_k_rope_mode { KVD_K_ROPE_NORM = 0, KVD_K_ROPE_NEOX = 2 };

/* KV geometry: a block is [layers][K|V][kv_heads][block_tokens] rows of
 * row_bytes (head_dim values of dtype: kv_row_bytes), block_bytes apart in
 * the arena. */
struct kvd_k_kv {
    void *arena; /* device arena base */
    size_t block_bytes;
    int layers, kv_heads, head_dim, block_tokens, dtype;
    size_t row_bytes;
};

/* ---- elementwise and normalization (elementwise.cu, rmsnorm.cu) -------- */
/* y[r][i] = x[r][i] * w[i] / sqrt(mean_i(x[r][i]^2) + eps); y may equal x. */
int kvd_k_rmsnorm(float *y, const float *x, const float *w, int rows, int dim, float eps,
                  kvd_stream stream);
/* Fused residual: x[r] += res[r]; y[r] = rmsnorm(x[r]) * w. y may equal
 * res or x. */
int kvd_k_add_rmsnorm(float *x, const float *res, float *y, const float *w, int rows, int dim,
                      float eps, kvd_stream stream);
/* x[i] += a[i] for n elements. */
int kvd_k_add(float *x, const float *a, size_t n, kvd_stream stream);
/* y[r][i] += b[i] (bias broadcast over rows). */
int kvd_k_add_bias(float *y, const float *b, int rows, int dim, kvd_stream stream);
/* out[i] = silu(gate[i]) * up[i]; out may alias gate or up. */
int kvd_k_silu_mul(float *out, const float *gate, const float *up, size_t n, kvd_stream stream);

/* ---- rows (rows.cu) ----------------------------------------------------- */
/* out[i][:] = row ids[i] of w [rows][ne0] (any weight type above; ne0 a
 * multiple of its block), widened to f32;
 * an id >= n_rows gives zeros (ids are checked on the host; this only keeps
 * the read in bounds). */
int kvd_k_get_rows(float *out, const void *w, int wtype, int ne0, int n_rows, const uint32_t *ids,
                   int n, kvd_stream stream);
/* out[i][:] = x[rows[i]][:], width floats per row. */
int kvd_k_gather_rows(float *out, const float *x, const uint32_t *rows, int n, int width,
                      kvd_stream stream);

/* ---- RoPE (rope.cu) ----------------------------------------------------- */
/* In place on x [n_tokens][n_heads][head_dim]; the first n_rot dims of each
 * head rotate by theta_i = pos[t] * base^(-2i/n_rot) / freq_factors[i]
 * (freq_factors [n_rot/2] or NULL). */
int kvd_k_rope(float *x, const uint32_t *pos, int n_tokens, int n_heads, int head_dim, int n_rot,
               float base, const float *freq_factors, int mode, kvd_stream stream);

/* ---- conversions (convert.cu) ------------------------------------------- */
/* n elements of GGUF type `wtype` at src (device) → bf16 at dst (device).
 * Block types: n must be a multiple of the block (kvd_k_wtype_block); src
 * holds n / block whole blocks. */
int kvd_k_to_bf16(uint16_t *dst, const void *src, int wtype, size_t n, kvd_stream stream);
/* n elements of GGUF type `wtype` → f32 (norm weights, freq factors). */
int kvd_k_to_f32(float *dst, const void *src, int wtype, size_t n, kvd_stream stream);

/* ---- projections of 1..8 tokens (gemv_fused.cu); more: gemm_qmma.cu, cuBLAS */
/* y[t][j] = sum_i W[j][i] * x[t][i] for t < n_tokens <= KVD_K_GEMV_MAX_TOKENS,
 * for up to three weights W (segments) of one type sharing x (row-major
 * f32 [n_tokens][in], 16-byte aligned): F32/F16/BF16 rows (16-byte aligned,
 * in % 8 == 0) read in place with f32 activations; Q8_0 and the quantized
 * types Q4_0 .. Q6_K in the plane layout (kvd_k_planes_pack; in a multiple
 * of the block), Q8_0 with f32 activations, the others with the cpu
 * backend's arithmetic: x quantized to int8 (per 32 values with an f16
 * scale against the legacy types, per 256 with an f32 scale and the sums of
 * each 16 against the K-quants), exact integer dots, and for the K-quants
 * the float part per super-block in the cpu's order (so the cpu's bits).
 * Epilogues: STORE y = x W^T (+ bias); SWIGLU (two segments with the same
 * rows, gate then up): seg[0].y = silu(x Wg^T) * (x Wu^T); ADD_NORM (one
 * segment): seg[0].y += x W^T (the residual), then, when norm_w is set,
 * norm_out = rmsnorm(seg[0].y) * norm_w (eps) computed by the last block
 * (counter: a device word that is 0, and is 0 again after the launch). act:
 * device scratch of kvd_k_gemv_act_bytes bytes (16-byte aligned), used when
 * the quantized activations do not fit in shared memory. max_blocks: at most
 * this many blocks quantize the activations in their prologue (0: no cap).
 * act_in: x already quantized in this weight type's layout (n_tokens rows of
 * in; kvd_k_gemv_act_bytes bytes, 16-byte aligned) by the kernel that
 * produced it, read instead of quantizing x again (x is then not read), or
 * NULL. emit[i] (i < n_emit <= 2): the last block also quantizes the launch's
 * output (norm_out for ADD_NORM with norm_w, seg[0].y for SWIGLU) into
 * emit[i] in the layout of weight type emit_wtype[i] (a type with
 * kvd_k_gemv_act_kind > 0), for the GEMVs that read it next (their act_in);
 * uses counter like the norm. rope (STORE only; counter): the last block
 * then runs kvd_k_rope_kv's chain on its n_tokens tokens (the q, k, v it
 * names are this launch's or an earlier one's outputs). */
#define KVD_K_GEMV_MAX_TOKENS 8
enum kvd_k_gemv_epi { KVD_K_GEMV_STORE = 0, KVD_K_GEMV_SWIGLU = 1, KVD_K_GEMV_ADD_NORM = 2 };
struct kvd_k_gemv_seg {
    const void *w;     /* device [rows][in] */
    int rows;          /* out */
    float *y;          /* device [n_tokens][rows] */
    const float *bias; /* device f32 [rows], or NULL (STORE only) */
};
struct kvd_k_rope_args {
    float *q, *k;
    const float *v;
    const uint32_t *pos, *slots;
    int n_heads, n_rot, mode;
    float base;
    const float *freq_factors;
    struct kvd_k_kv kv;
    int layer;
};
struct kvd_k_gemv {
    int wtype, in, n_tokens;
    struct kvd_k_gemv_seg seg[3];
    int n_seg;
    const float *x;
    int epi;
    const float *norm_w;
    float eps;
    float *norm_out; /* device [n_tokens][seg[0].rows] */
    unsigned *counter;
    void *act;
    int max_blocks;
    const void *act_in;
    void *emit[2];
    int emit_wtype[2];
    int n_emit;
    const struct kvd_k_rope_args *rope;
    /* split (STORE, no emit): 0, or the segments from seg[split] on are of
     * type wtype2 (kvd_k_gemv_pair_ok): for one token, when both types'
     * activations fit in shared memory, one launch whose blocks take their
     * type from their rows; else a launch per type (rope in the second);
     * act then holds the larger layout; act_in2: act_in in wtype2's
     * layout, or NULL. */
    int split, wtype2;
    const void *act_in2;
};
/* Whether one launch takes weights of wtype and then of wtype2 (a
 * Q4_K_M / Q5_K_M layer's q, k and v: v in Q6_K). */
int kvd_k_gemv_pair_ok(int wtype, int wtype2);
/* The layout of the int8 activations the GEMV reads for weight type wtype:
 * 0 none (f32 activations), else an id; two types with the same id read the
 * same bytes. */
int kvd_k_gemv_act_kind(int wtype);
size_t kvd_k_gemv_act_bytes(int wtype, int n_tokens, int in);
int kvd_k_gemv_ok(int wtype, const void *w, const float *x, int n_tokens, int in);
int kvd_k_gemv_run(const struct kvd_k_gemv *g, kvd_stream stream);

/* ---- projections of more than 8 tokens of the K-quants (gemm_qmma.cu) ---- */
/* y [n_tokens][rows] = x [n_tokens][in] W^T for W [rows][in] of type Q4_K,
 * Q5_K or Q6_K in the plane layout (in % 256 == 0; x and W 16-byte
 * aligned): x quantized once to Q8_K into act (device scratch of
 * kvd_k_qmma_act_bytes, 16-byte aligned), int8 mma.sync for the exact
 * integer sub-block sums, the float part per super-block in the GEMV's
 * order: every output equals the GEMV's (kvd_k_gemv_run) for the same row,
 * bit for bit, whatever n_tokens (the cpu backend's too for Q4_K). */
int kvd_k_qmma_ok(int wtype, const void *w, const float *x, int n_tokens, int in);
size_t kvd_k_qmma_act_bytes(int wtype, int n_tokens, int in);
int kvd_k_qmma(float *y, const void *w, int wtype, int rows, int in, const float *x, int n_tokens,
               void *act, kvd_stream stream);

/* Quantized matrices (Q4_0 .. Q6_K and Q8_0) [rows][ne0] in the plane
 * layout (planes.cuh: each field of every block in a run of its own, the
 * same bytes as the file's rows; what the cuda backend keeps after load).
 * pack: dst (rows * row bytes, 256-byte aligned, not src) from the file's
 * rows at src. to_bf16: rows [r0, r0 + nr) dequantized to bf16 [nr][ne0].
 * get_rows: as kvd_k_get_rows, reading the planes. */
int kvd_k_planes_pack(void *dst, const void *src, int wtype, size_t rows, size_t ne0,
                      kvd_stream stream);
int kvd_k_planes_to_bf16(uint16_t *dst, const void *w, int wtype, size_t rows, size_t ne0,
                         size_t r0, size_t nr, kvd_stream stream);
int kvd_k_planes_get_rows(float *out, const void *w, int wtype, int ne0, int n_rows,
                          const uint32_t *ids, int n, kvd_stream stream);
/* dst[i] = bf16(src[i]) (activations before a bf16 cuBLAS GEMM). */
int kvd_k_f32_to_bf16(uint16_t *dst, const float *src, size_t n, kvd_stream stream);

/* ---- KV cache (kv_write.cu, block_copy.cu) ------------------------------ */
/* Writes token t's K and V (f32 [n_tokens][kv_heads][head_dim]) of `layer`
 * into block slots[t] at row pos[t] % block_tokens, converting to kv->dtype
 * (round to nearest even; Q8_0 and FP8 quantize each row bit for bit as the
 * cpu backend does, compute_cpu_kv.h). */
int kvd_k_kv_write(const struct kvd_k_kv *kv, int layer, const uint32_t *slots, const uint32_t *pos,
                   const float *k, const float *v, int n_tokens, kvd_stream stream);
/* RoPE of q [n_tokens][n_heads][head_dim] and k [n_tokens][kv->kv_heads]
 * [head_dim] in place (as kvd_k_rope), then k and v of each token written to
 * block slots[t] at row pos[t] % block_tokens (as kvd_k_kv_write; a slot of
 * UINT32_MAX writes nothing): the three ops in one launch (rope_kv.cu). */
int kvd_k_rope_kv(float *q, float *k, const float *v, const uint32_t *pos, const uint32_t *slots,
                  int n_tokens, int n_heads, int n_rot, float base, const float *freq_factors,
                  int mode, const struct kvd_k_kv *kv, int layer, kvd_stream stream);
/* Copies whole blocks inside the arena: block dst[i] = block src[i]. */
int kvd_k_block_copy(const struct kvd_k_kv *kv, const int32_t *src, const int32_t *dst, int n,
                     kvd_stream stream);

/* ---- attention (attn_decode.cu, attn_prefill.cu) ------------------------ */
/* Batches follow compute.h's attn_desc: sequence s owns query rows
 * [qstart[s], qstart[s+1]) of q and out (f32 [rows][n_heads][head_dim]), row r
 * of it is at position pos0[s] + r, its block table is
 * slots[slot0[s] .. slot0[s+1]) and its context is pos0[s] + rows tokens, the
 * new ones already written. Causal: a row sees keys at positions <= its own.
 *
 * Decode: the sequences of exactly one row (the others, in a mixed step, are
 * the prefill kernel's; see skip_single). The context is cut into pieces
 * (flash-decoding) merged by the last of them to finish (one launch):
 * n_splits of them, or fewer for a sequence whose own context has fewer
 * 64-token pieces (so a row is summed the same way whatever the other rows'
 * lengths); partial holds kvd_k_attn_decode_partial_floats(...) floats
 * (none for n_splits == 1) and done n_seqs * n_heads counters, 0 before
 * the launch and 0 again after it (a buffer of their own: partial's bytes
 * of another launch shape would overlap them).
 * Slot tables are read from slots + slot0[s] only (slot0 need not grow:
 * several one-row "sequences" may share one table). early: a plain decode
 * step (each sequence's rows before pos0 written by earlier steps, none
 * by the kernels before this one): the first rows but the newest are
 * loaded before the kernel's programmatic-dependent-launch wait; 0 (a
 * verification step's one-row decodes read rows written in the same
 * step): every K/V row after it. */
int kvd_k_attn_decode(float *out, const float *q, const struct kvd_k_kv *kv, int layer,
                      const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                      const uint32_t *qstart, int n_seqs, int n_heads, float scale, int n_splits,
                      float *partial, unsigned *done, int early, kvd_stream stream);
size_t kvd_k_attn_decode_partial_floats(int n_seqs, int n_heads, int head_dim, int n_splits);
/* The split count for n_seqs sequences of at most max_ctx tokens on a
 * device of n_sms multiprocessors: one wave of the decode kernel's blocks
 * (its occupancy for this head_dim, dtype and group, times n_sms), splits of
 * at least 64 tokens, at most 128. */
int kvd_k_attn_decode_splits(int n_seqs, int n_heads, const struct kvd_k_kv *kv, int max_ctx,
                             int n_sms);
/* Blocks of the decode kernel for (head_dim, dtype, n_heads / kv_heads)
 * resident per multiprocessor of the current device
 * (cudaOccupancyMaxActiveBlocksPerMultiprocessor; the emulator answers from
 * ptxas's register counts); -1 for an unsupported shape or a failed query. */
int kvd_k_attn_decode_blocks_per_sm(int head_dim, int dtype, int group);
/* Prefill / mixed batches: any number of rows per sequence, max_q the
 * largest. Tiles of keys in shared memory with an online softmax: on tensor
 * cores for f16, bf16, q8_0 and fp8 KV at head_dim 64, 128 and 256 (Q and
 * the softmax weights rounded to the KV's 16-bit type, f16 for q8_0/fp8,
 * f32 accumulation), in f32 on CUDA cores otherwise. skip_single: sequences
 * of exactly one row are left alone (computed by kvd_k_attn_decode). */
int kvd_k_attn_prefill(float *out, const float *q, const struct kvd_k_kv *kv, int layer,
                       const uint32_t *slots, const uint32_t *slot0, const uint32_t *pos0,
                       const uint32_t *qstart, int n_seqs, int max_q, int n_heads, float scale,
                       int skip_single, kvd_stream stream);
/* Whether the attention kernels support this head_dim (16..256, power of 2). */
int kvd_k_attn_supported(int head_dim);

/* ---- sampling (sample.cu) ----------------------------------------------- */
/* out[r] = the index of the largest logits[r][:] (lowest index on ties;
 * NaN counts as -inf, so a row of only NaN and -inf gives 0: sampler_pick.c's
 * rule). */
int kvd_k_argmax(int32_t *out, const float *logits, int rows, int vocab, kvd_stream stream);
/* One row's pick: the layout of the daemon's struct sample_row (sampler_pick.h). */
struct kvd_k_sample_row {
    float temperature; /* <= 0: greedy */
    uint32_t top_k;    /* 0 = off */
    float top_p;       /* >= 1 = off */
    uint32_t skip;     /* 1: out[r] = 0 */
    double u;          /* the request's uniform in [0, 1) */
};
/* out[r] = the token sampler_pick (daemon/backend/sampler_pick.h) picks for rows[r] from
 * logits[r][:]; logits [n_rows][vocab], rows and out [n_rows], all device. */
int kvd_k_sample(uint32_t *out, const float *logits, const struct kvd_k_sample_row *rows,
                 int n_rows, int vocab, kvd_stream stream);

/* Kernel launches issued so far by the calling thread through these
 * functions (each kernel launch counts one, whether or not it succeeded;
 * cuBLAS's own launches are not counted). */
unsigned long long kvd_k_launches(void);
/* Whether the kernels of a step are launched with programmatic dependent
 * launch (each may start while the one before finishes; sm_90 and later):
 * on unless KVD_CUDA_PDL=0 or kvd_k_set_pdl(0), on devices of compute
 * capability 9.0 and later (the current device's, asked once per device). */
int kvd_k_pdl_on(void);
void kvd_k_set_pdl(int on);

/* ---- benchmarks and tests (fill_random.cu) ------------------------------ */
/* dst[i] = uniform in [lo, hi) of element type dtype (enum kvd_k_dtype), a
 * pure function of (seed, i). */
int kvd_k_fill_uniform(void *dst, int dtype, size_t n, uint64_t seed, float lo, float hi,
                       kvd_stream stream);
/* n_blocks random blocks of the quantized weight type wtype (Q4_0 .. Q6_K,
 * Q8_0): random quants and scale bytes, small positive f16 scales (every
 * value finite); a pure function of (seed, byte). */
int kvd_k_fill_qweight(void *dst, int wtype, size_t n_blocks, uint64_t seed, kvd_stream stream);
/* One launch of a kernel that does nothing (one warp): launch cost. */
int kvd_k_empty(kvd_stream stream);
/* One warp busy for about ns nanoseconds of device time (no wait in the
 * emulator). */
int kvd_k_spin(long long ns, kvd_stream stream);
/* One warp through mma.cuh's tensor-core instructions (mma_check.cu), for
 * the fragment-layout tests. a [16][16], b [16][8] row-major 16-bit (bf16
 * when bf16, else f16), c [16][8] f32; d [3][32][4]: each lane's D fragment
 * of a * b + c with the A and B fragments built element by element from the
 * PTX layout (0), A by ldmatrix.x4 and B by ldmatrix.x2 from b's transpose
 * (1), B by ldmatrix.x2.trans from b (2). mats [4][8][8] 16-bit; ldsm
 * [6][32][4]: each lane's registers from ldmatrix .x1, .x2, .x4, then the
 * same .trans, lane 8 m + i giving row i of matrix m. All device memory. */
int kvd_k_mma_check(float *d, uint32_t *ldsm, const uint16_t *a, const uint16_t *b, const float *c,
                    const uint16_t *mats, int bf16, kvd_stream stream);
/* The int8 mma (mma_check.cu): a [16][32], b [32][8] int8 row-major, c
 * [16][8] int32; d [2][32][4]: each lane's D fragment of a * b + c by
 * m16n8k32 (0) and by m16n8k16 on a's first 16 columns and b's first 16
 * rows (1), the fragments built element by element from the PTX layout. */
int kvd_k_mma_s8_check(int *d, const int8_t *a, const int8_t *b, const int *c, kvd_stream stream);

#ifdef __cplusplus
}
#endif
#endif

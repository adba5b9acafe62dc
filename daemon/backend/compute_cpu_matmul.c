/* cpu matmul: y[rows][out] = x[rows][in] . W[out][in]^T with W kept in its
 * file type (f32, f16, bf16, q8_0) and f32 accumulation.
 *
 * Layout. The model's matrices are stored CL_PACK16 (cpu_weight_upload):
 * groups of 16 consecutive rows (output columns) with the rows' values
 * interleaved, so value k of rows 16g..16g+15 are 16 consecutive elements.
 * For q8_0, per group and 32-value block: the 16 rows' f16 scales (32
 * bytes), then value k's 16 quants for k = 0..31 (512 bytes). The last group
 * is padded with zero rows. One vector load is then 8 output columns at one
 * k, so the kernels are outer products (broadcast x[r][k], FMA into the
 * accumulators of 16 outputs): no horizontal sums, no accumulator spills,
 * and a group is one sequential stream of memory.
 *
 * Kernels:
 * - rows < MM_PANEL_ROWS (decode: a memory-bound GEMV): the weights are
 *   widened in registers, 1-2 activation rows per pass over 1-4 groups at
 *   once (their FMA chains side by side hide the latency); each group's
 *   stream is prefetched MM_PFD bytes ahead.
 * - rows >= MM_PANEL_ROWS (batched decode, prefill: compute-bound): a
 *   thread takes a chunk of groups and runs tiles of up to 6 activation rows
 *   x 16 columns (12 accumulators, 2 panel loads and 6 broadcasts per 12
 *   FMAs) over it in MM_KB-value k blocks, MM_RB activation rows at a time.
 *   The first tile of the first row block widens the chunk into a
 *   per-thread f32 panel as it goes (the tiles after it read the panel
 *   block from L1) and prefetches the next chunk meanwhile.
 * Matrices left in file rows (CL_ROWS: tensors built by hand) take a plain
 * row-major GEMV per activation row.
 * Threads take chunks of groups from an atomic counter. Every output is
 * computed the same way whatever the thread count, the chunking or the
 * number of rows: one FMA chain over k in order from zero, of the weight
 * widened to f32 (q8_0: quant x block scale, rounded to f32) and the
 * activation. So a row's result does not depend on the batch it is in
 * (a decode row equals the same row inside a prefill chunk or a
 * speculative verification); the scalar path (no AVX2) is its own
 * arithmetic, also the same for every row count. */
#include <stdlib.h>

#include "compute_cpu_impl.h"
#include "kvd/status.h"

#define PK 16           /* rows per packed group */
#define PK_Q8_BLOCK 544 /* bytes of one q8_0 block of a group: 16 f16 scales + 16 x 32 quants */
#define MM_PANEL_ROWS 4 /* activation rows from which the panel kernel is used */
#define MM_PANEL_BYTES 131072 /* f32 panel of a chunk: fits L2 beside MM_RB activation rows */
#define MM_RB 24              /* activation rows per block of the panel kernel */
#define MM_TILE 6             /* activation rows per register tile */
#define MM_KB 128             /* k block of the panel kernel */
#define MM_CHUNK_MAX 8        /* groups per chunk of the panel kernel */
#define MM_PFD 2048           /* GEMV prefetch distance, bytes */

static size_t elem_bytes(enum ctype t)
{
    return t == CT_F32 ? 4 : 2;
}

/* Bytes of one packed group of 16 rows of `in` values. */
static size_t pk_group_bytes(enum ctype t, size_t in)
{
    return t == CT_Q8_0 ? in / CT_Q8_0_BLOCK * PK_Q8_BLOCK : in * PK * elem_bytes(t);
}

static bool pk_packable(const struct ctensor *t)
{
    return t->layout == CL_ROWS && t->ne1 >= 2 && ctype_row_bytes(t->type, t->ne0) != 0 &&
           (t->type == CT_F32 || t->type == CT_F16 || t->type == CT_BF16 || t->type == CT_Q8_0);
}

/* Value (k, column j) of a packed group g of type t. */
static inline float pk_get(enum ctype t, const uint8_t *g, size_t k, size_t j)
{
    switch (t) {
    case CT_F32:
        return ((const float *)g)[k * PK + j];
    case CT_F16:
        return half_to_float(((const uint16_t *)g)[k * PK + j]);
    case CT_BF16:
        return bf16_to_float(((const uint16_t *)g)[k * PK + j]);
    case CT_Q8_0: {
        const uint8_t *blk = g + k / CT_Q8_0_BLOCK * PK_Q8_BLOCK;
        uint16_t dh;
        memcpy(&dh, blk + 2 * j, 2);
        return half_to_float(dh) * (float)(int8_t)blk[2 * PK + k % CT_Q8_0_BLOCK * PK + j];
    }
    default:
        break; /* not packed (pk_packable) */
    }
    return 0;
}

/* Element k of a row-major weight row (tails and the scalar path). */
static inline float row_get(enum ctype t, const uint8_t *w, size_t k)
{
    switch (t) {
    case CT_F32:
        return ((const float *)w)[k];
    case CT_F16:
        return half_to_float(((const uint16_t *)w)[k]);
    case CT_BF16:
        return bf16_to_float(((const uint16_t *)w)[k]);
    case CT_Q8_0: {
        const uint8_t *blk = w + k / CT_Q8_0_BLOCK * CT_Q8_0_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        return half_to_float(dh) * (float)(int8_t)blk[2 + k % CT_Q8_0_BLOCK];
    }
    default:
        break; /* other types take the row-dequantizing path */
    }
    return 0;
}

/* ---- packing ------------------------------------------------------------ */

size_t cpu_weight_bytes(const struct ctensor *t)
{
    if (!pk_packable(t))
        return t->nbytes;
    return (t->ne1 + (size_t)PK - 1) / PK * pk_group_bytes(t->type, t->ne0);
}

struct pack_job {
    const struct ctensor *t;
    const uint8_t *src;
    size_t n_groups;
    atomic_size_t next;
};

/* Packs group g: row 16g + j of the file (zeros past the last row). */
static void pack_group(const struct ctensor *t, const uint8_t *src, size_t g)
{
    size_t in = t->ne0, rb = ctype_row_bytes(t->type, in), gb = pk_group_bytes(t->type, in);
    uint8_t *dst = (uint8_t *)t->data + g * gb;
    memset(dst, 0, gb);
    for (size_t j = 0; j < PK && g * PK + j < t->ne1; j++) {
        const uint8_t *s = src + (g * PK + j) * rb;
        switch (t->type) {
        case CT_F32:
            for (size_t k = 0; k < in; k++)
                memcpy(dst + (k * PK + j) * 4, s + k * 4, 4);
            break;
        case CT_F16:
        case CT_BF16:
            for (size_t k = 0; k < in; k++)
                memcpy(dst + (k * PK + j) * 2, s + k * 2, 2);
            break;
        case CT_Q8_0:
            for (size_t b = 0; b < in / CT_Q8_0_BLOCK; b++) {
                uint8_t *db = dst + b * PK_Q8_BLOCK;
                const uint8_t *sb = s + b * CT_Q8_0_BYTES;
                memcpy(db + 2 * j, sb, 2);
                for (size_t kk = 0; kk < CT_Q8_0_BLOCK; kk++)
                    db[2 * PK + kk * PK + j] = sb[2 + kk];
            }
            break;
        default:
            break;
        }
    }
}

static void pack_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct pack_job *j = arg;
    (void)ith, (void)nth;
    for (size_t g; (g = atomic_fetch_add(&j->next, 1)) < j->n_groups;)
        pack_group(j->t, j->src, g);
}

int cpu_weight_upload(struct compute_ctx *cx, struct ctensor *t, const void *src)
{
    if (!pk_packable(t)) {
        memcpy(t->data, src, t->nbytes);
        return 0;
    }
    struct pack_job j = {.t = t, .src = src, .n_groups = (t->ne1 + (size_t)PK - 1) / PK};
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, pack_task, &j);
    t->nbytes = cpu_weight_bytes(t);
    t->layout = CL_PACK16;
    return 0;
}

void cpu_weight_row(const struct ctensor *w, uint32_t row, float *out)
{
    if (w->layout == CL_ROWS) {
        cpu_row_to_f32(w->type, (const uint8_t *)w->data + row * ctype_row_bytes(w->type, w->ne0),
                       out, w->ne0);
        return;
    }
    const uint8_t *g = (const uint8_t *)w->data + row / PK * pk_group_bytes(w->type, w->ne0);
    for (size_t k = 0; k < w->ne0; k++)
        out[k] = pk_get(w->type, g, k, row % PK);
}

#if defined(__x86_64__)
#include <immintrin.h>
#define SIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define MM_INLINE static inline __attribute__((always_inline))

/* 8 consecutive values at element i of f32/f16/bf16 data, as f32. */
MM_INLINE SIMD_TARGET __m256 load8(enum ctype t, const uint8_t *w, size_t i)
{
    switch (t) {
    case CT_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    case CT_BF16: {
        __m256i v =
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    default:
        return _mm256_loadu_ps((const float *)w + i);
    }
}

/* 8 int8 quants at q, as f32 (scale not applied). */
MM_INLINE SIMD_TARGET __m256 q8x8(const uint8_t *q)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

MM_INLINE SIMD_TARGET float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- packed GEMV: o[r][gi][0..16) for r < NR (1 or 2), NG groups at once ----
 *
 * The panel kernel's arithmetic, so an output does not depend on how many
 * rows the call has (a decode row, a verification row of speculative
 * decoding and a prefill row of the same activations give the same bits):
 * each output is one FMA chain over k in order from zero, the weight widened
 * to f32 first (q8_0: the quant times its block scale, rounded to f32, as
 * the panel stores it). The chains of NG groups run side by side so enough
 * FMAs are in flight; each group is its own stream, prefetched MM_PFD bytes
 * ahead. gb: bytes between the groups; o: [NR][NG][16]. */
MM_INLINE SIMD_TARGET void pk_gemv_f(enum ctype t, const uint8_t *g, size_t gb, size_t in,
                                     const float *x, size_t ldx, float *o, const int NR,
                                     const int NG)
{
    __m256 a[2][4][2];
    _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 4") for (int gi = 0; gi < NG; gi++) a[r][gi][0] = a[r][gi][1] =
            _mm256_setzero_ps();
    const size_t kb = PK * elem_bytes(t); /* bytes per k */
    for (size_t k = 0; k < in; k++) {
        if ((k & 1) == 0)
            _Pragma("GCC unroll 4") for (int gi = 0; gi < NG; gi++)
            {
                const char *pf = (const char *)g + gi * gb + k * kb + MM_PFD;
                _mm_prefetch(pf, _MM_HINT_T0);
                if (t == CT_F32)
                    _mm_prefetch(pf + 64, _MM_HINT_T0);
            }
        __m256 xv[2];
        _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) xv[r] =
            _mm256_broadcast_ss(x + r * ldx + k);
        _Pragma("GCC unroll 4") for (int gi = 0; gi < NG; gi++)
        {
            __m256 w0 = load8(t, g + gi * gb, k * PK), w1 = load8(t, g + gi * gb, k * PK + 8);
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
            {
                a[r][gi][0] = _mm256_fmadd_ps(w0, xv[r], a[r][gi][0]);
                a[r][gi][1] = _mm256_fmadd_ps(w1, xv[r], a[r][gi][1]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 4") for (int gi = 0; gi < NG; gi++)
    {
        _mm256_storeu_ps(o + (r * NG + gi) * PK, a[r][gi][0]);
        _mm256_storeu_ps(o + (r * NG + gi) * PK + 8, a[r][gi][1]);
    }
}

/* q8_0 groups: per 32-value block one FMA chain of quant x activation from
 * zero (the quants are exact in f32), then that sum times the block scale
 * FMA'd into the output's chain over blocks: the panel kernel's q8_0
 * arithmetic (pk_tile_q8). */
MM_INLINE SIMD_TARGET void pk_gemv_q8(const uint8_t *g, size_t gb, size_t in, const float *x,
                                      size_t ldx, float *o, const int NR, const int NG)
{
    __m256 a[2][3][2];
    _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 3") for (int gi = 0; gi < NG; gi++) a[r][gi][0] = a[r][gi][1] =
            _mm256_setzero_ps();
    for (size_t blk = 0; blk < in / CT_Q8_0_BLOCK; blk++) {
        __m256 sb[2][3][2];
        _Pragma("GCC unroll 3") for (int gi = 0; gi < NG; gi++)
        {
            const uint8_t *bp = g + gi * gb + blk * PK_Q8_BLOCK;
            _Pragma("GCC unroll 9") for (int p = 0; p < (PK_Q8_BLOCK + 63) / 64; p++)
                _mm_prefetch((const char *)bp + MM_PFD + 64 * p, _MM_HINT_T0);
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) sb[r][gi][0] = sb[r][gi][1] =
                _mm256_setzero_ps();
        }
        const float *xb = x + blk * CT_Q8_0_BLOCK;
        _Pragma("GCC unroll 4") for (int kk = 0; kk < CT_Q8_0_BLOCK; kk++)
        {
            __m256 xv[2];
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) xv[r] =
                _mm256_broadcast_ss(xb + r * ldx + kk);
            _Pragma("GCC unroll 3") for (int gi = 0; gi < NG; gi++)
            {
                const uint8_t *q = g + gi * gb + blk * PK_Q8_BLOCK + 2 * PK + kk * PK;
                __m256 w0 = q8x8(q), w1 = q8x8(q + 8);
                _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
                {
                    sb[r][gi][0] = _mm256_fmadd_ps(w0, xv[r], sb[r][gi][0]);
                    sb[r][gi][1] = _mm256_fmadd_ps(w1, xv[r], sb[r][gi][1]);
                }
            }
        }
        _Pragma("GCC unroll 3") for (int gi = 0; gi < NG; gi++)
        {
            const uint8_t *bp = g + gi * gb + blk * PK_Q8_BLOCK;
            __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bp));
            __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bp + 1));
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
            {
                a[r][gi][0] = _mm256_fmadd_ps(sb[r][gi][0], d0, a[r][gi][0]);
                a[r][gi][1] = _mm256_fmadd_ps(sb[r][gi][1], d1, a[r][gi][1]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 3") for (int gi = 0; gi < NG; gi++)
    {
        _mm256_storeu_ps(o + (r * NG + gi) * PK, a[r][gi][0]);
        _mm256_storeu_ps(o + (r * NG + gi) * PK + 8, a[r][gi][1]);
    }
}

/* The groups one pass of pk_gemv takes for nr rows and type t: 8
 * accumulator chains (q8_0: 6 block-sum chains and 6 totals). */
static int pk_gemv_groups(enum ctype t, int nr)
{
    if (t == CT_Q8_0)
        return nr == 1 ? 3 : 1;
    return nr == 1 ? 4 : 2;
}

/* ng (<= pk_gemv_groups(t, nr)) groups gb bytes apart against nr rows. */
static SIMD_TARGET void pk_gemv(enum ctype t, const uint8_t *g, size_t gb, int ng, size_t in,
                                const float *x, size_t ldx, float *o, int nr)
{
#define PK_GEMV_F(T)                                                                               \
    do {                                                                                           \
        if (nr == 1) {                                                                             \
            if (ng == 4)                                                                           \
                pk_gemv_f(T, g, gb, in, x, ldx, o, 1, 4);                                          \
            else if (ng == 3)                                                                      \
                pk_gemv_f(T, g, gb, in, x, ldx, o, 1, 3);                                          \
            else if (ng == 2)                                                                      \
                pk_gemv_f(T, g, gb, in, x, ldx, o, 1, 2);                                          \
            else                                                                                   \
                pk_gemv_f(T, g, gb, in, x, ldx, o, 1, 1);                                          \
        } else if (ng == 2) {                                                                      \
            pk_gemv_f(T, g, gb, in, x, ldx, o, 2, 2);                                              \
        } else {                                                                                   \
            pk_gemv_f(T, g, gb, in, x, ldx, o, 2, 1);                                              \
        }                                                                                          \
    } while (0)
    switch (t) {
    case CT_F32:
        PK_GEMV_F(CT_F32);
        break;
    case CT_F16:
        PK_GEMV_F(CT_F16);
        break;
    case CT_BF16:
        PK_GEMV_F(CT_BF16);
        break;
    case CT_Q8_0:
        if (nr == 1 && ng == 3)
            pk_gemv_q8(g, gb, in, x, ldx, o, 1, 3);
        else if (nr == 1 && ng == 2)
            pk_gemv_q8(g, gb, in, x, ldx, o, 1, 2);
        else if (nr == 1)
            pk_gemv_q8(g, gb, in, x, ldx, o, 1, 1);
        else
            pk_gemv_q8(g, gb, in, x, ldx, o, 2, 1);
        break;
    default:
        break; /* not packed (pk_packable) */
    }
#undef PK_GEMV_F
}

/* ---- panel kernel: partial sums o[r][0..16), r < NR (<= 6), over an f32 panel ---- */

MM_INLINE SIMD_TARGET void acc_load(__m256 a[][2], const float *o, bool first, const int NR)
{
    _Pragma("GCC unroll 6") for (int r = 0; r < NR; r++)
    {
        a[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * PK);
        a[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + r * PK + 8);
    }
}

MM_INLINE SIMD_TARGET void acc_store(__m256 a[][2], float *o, const int NR)
{
    _Pragma("GCC unroll 6") for (int r = 0; r < NR; r++)
    {
        _mm256_storeu_ps(o + r * PK, a[r][0]);
        _mm256_storeu_ps(o + r * PK + 8, a[r][1]);
    }
}

/* a[r] += (w0, w1) * x[r * ldx] for r < NR: 2 FMAs per broadcast row value. */
MM_INLINE SIMD_TARGET void fma_rows(__m256 a[][2], __m256 w0, __m256 w1, const float *x, size_t ldx,
                                    const int NR)
{
    _Pragma("GCC unroll 6") for (int r = 0; r < NR; r++)
    {
        __m256 xv = _mm256_broadcast_ss(x + r * ldx);
        a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
    }
}

/* One register tile over a group's values [k0, k0 + kn): x at value k0 of
 * the first row, rows ldx floats apart; o: NR x 16 partial sums, zeroed
 * first when `first`. pn: the group's f32 panel ([in][16]).
 * - t == CT_F32: the values are read from pn (already f32, or the weights
 *   themselves for f32 weights); g is unused.
 * - otherwise (f16, bf16) the tile also widens: it reads the values in
 *   their file type from the packed group g, writes them to pn for the
 *   tiles after it and uses them right away, so widening costs no pass of
 *   its own and the panel block is in L1 for the next tiles. q8_0 has its
 *   own tile (pk_tile_q8).
 * pf (may be NULL): raw bytes to prefetch meanwhile, pfk per k. Each output
 * is one FMA chain over k in order, so splitting k into blocks does not
 * change the result. */
MM_INLINE SIMD_TARGET void pk_tile(enum ctype t, const uint8_t *g, size_t k0, size_t kn, float *pn,
                                   const float *x, size_t ldx, float *o, bool first, const char *pf,
                                   size_t pfk, const int NR)
{
    __m256 a[MM_TILE][2];
    acc_load(a, o, first, NR);
    {
        /* unrolled: one k per iteration ran at ~75 % of FMA peak, four at ~90 % */
        _Pragma("GCC unroll 4") for (size_t k = 0; k < kn; k++)
        {
            if (pf)
                _mm_prefetch(pf + k * pfk, _MM_HINT_T1);
            float *pk = pn + (k0 + k) * PK;
            __m256 w0, w1;
            if (t == CT_F32) {
                w0 = _mm256_loadu_ps(pk), w1 = _mm256_loadu_ps(pk + 8);
            } else {
                w0 = load8(t, g, (k0 + k) * PK), w1 = load8(t, g, (k0 + k) * PK + 8);
                _mm256_storeu_ps(pk, w0);
                _mm256_storeu_ps(pk + 8, w1);
            }
            fma_rows(a, w0, w1, x + k, ldx, NR);
        }
    }
    acc_store(a, o, NR);
}

/* The q8_0 tile: per 32-value block, one FMA chain of quant x activation
 * from zero in registers (the quants, exact in f32, are what pn keeps),
 * then o[r] = fma(block sum, the block's 16 scales, o[r]) in memory (once
 * per 32 values). So each output is the sum over blocks of scale x (an FMA
 * chain over the block), in block order: pk_gemv_q8's arithmetic. g: the
 * packed group (the scales are read from it); widen: the tile also widens
 * the quants into pn, as pk_tile does; k0, kn: multiples of 32. */
MM_INLINE SIMD_TARGET void pk_tile_q8(const uint8_t *g, size_t k0, size_t kn, float *pn, bool widen,
                                      const float *x, size_t ldx, float *o, bool first,
                                      const char *pf, size_t pfk, const int NR)
{
    if (first)
        _Pragma("GCC unroll 6") for (int r = 0; r < NR; r++) memset(o + r * PK, 0, PK * 4);
    for (size_t kb = 0; kb < kn; kb += CT_Q8_0_BLOCK) {
        const uint8_t *bp = g + (k0 + kb) / CT_Q8_0_BLOCK * PK_Q8_BLOCK, *q = bp + 2 * PK;
        if (pf)
            _Pragma("GCC unroll 9") for (int p = 0; p < (PK_Q8_BLOCK + 63) / 64; p++)
                _mm_prefetch(pf + kb * pfk + 64 * p, _MM_HINT_T1);
        __m256 a[MM_TILE][2];
        acc_load(a, o, true, NR);
        float *pb = pn + (k0 + kb) * PK;
        _Pragma("GCC unroll 4") for (size_t kk = 0; kk < CT_Q8_0_BLOCK; kk++)
        {
            __m256 w0, w1;
            if (widen) {
                w0 = q8x8(q + kk * PK), w1 = q8x8(q + kk * PK + 8);
                _mm256_storeu_ps(pb + kk * PK, w0);
                _mm256_storeu_ps(pb + kk * PK + 8, w1);
            } else {
                w0 = _mm256_loadu_ps(pb + kk * PK), w1 = _mm256_loadu_ps(pb + kk * PK + 8);
            }
            fma_rows(a, w0, w1, x + kb + kk, ldx, NR);
        }
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bp));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bp + 1));
        _Pragma("GCC unroll 6") for (int r = 0; r < NR; r++)
        {
            _mm256_storeu_ps(o + r * PK, _mm256_fmadd_ps(a[r][0], d0, _mm256_loadu_ps(o + r * PK)));
            _mm256_storeu_ps(o + r * PK + 8,
                             _mm256_fmadd_ps(a[r][1], d1, _mm256_loadu_ps(o + r * PK + 8)));
        }
    }
}

static SIMD_TARGET void pk_tile_q8_n(const uint8_t *g, size_t k0, size_t kn, float *pn, bool widen,
                                     const float *x, size_t ldx, float *o, bool first,
                                     const char *pf, size_t pfk, int nr)
{
    switch (nr) {
    case 1:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 1);
        break;
    case 2:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 2);
        break;
    case 3:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 3);
        break;
    case 4:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 4);
        break;
    case 5:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 5);
        break;
    default:
        pk_tile_q8(g, k0, kn, pn, widen, x, ldx, o, first, pf, pfk, 6);
        break;
    }
}

/* A tile from the f32 panel (any row count 1..6). */
static SIMD_TARGET void pk_tile_n(const float *pn, size_t k0, size_t kn, const float *x, size_t ldx,
                                  float *o, bool first, const char *pf, size_t pfk, int nr)
{
    float *p = (float *)(uintptr_t)pn; /* read only: t == CT_F32 never writes the panel */
    switch (nr) {
    case 1:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 1);
        break;
    case 2:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 2);
        break;
    case 3:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 3);
        break;
    case 4:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 4);
        break;
    case 5:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 5);
        break;
    default:
        pk_tile(CT_F32, NULL, k0, kn, p, x, ldx, o, first, pf, pfk, 6);
        break;
    }
}

/* The first tile of a row block has 3 to 6 rows (floor(rows / tiles), rows >= 4:
 * 7 rows = 3 + 4). */
static SIMD_TARGET void pk_tile_w_n(enum ctype t, const uint8_t *g, size_t k0, size_t kn, float *pn,
                                    const float *x, size_t ldx, float *o, bool first,
                                    const char *pf, size_t pfk, int nr)
{
#define PK_TILE_W(T)                                                                               \
    switch (nr) {                                                                                  \
    case 3:                                                                                        \
        pk_tile(T, g, k0, kn, pn, x, ldx, o, first, pf, pfk, 3);                                   \
        break;                                                                                     \
    case 4:                                                                                        \
        pk_tile(T, g, k0, kn, pn, x, ldx, o, first, pf, pfk, 4);                                   \
        break;                                                                                     \
    case 5:                                                                                        \
        pk_tile(T, g, k0, kn, pn, x, ldx, o, first, pf, pfk, 5);                                   \
        break;                                                                                     \
    default:                                                                                       \
        pk_tile(T, g, k0, kn, pn, x, ldx, o, first, pf, pfk, 6);                                   \
        break;                                                                                     \
    }
    switch (t) {
    case CT_F16:
        PK_TILE_W(CT_F16);
        break;
    case CT_BF16:
        PK_TILE_W(CT_BF16);
        break;
    default:
        break; /* f32 is used in place: no widening; q8_0 has pk_tile_q8 */
    }
#undef PK_TILE_W
}

/* ---- row-major GEMV (CL_ROWS): y[c] = dot(W row c, x), c < NW ---- */

/* f32 / f16 / bf16: 16 weights per step and row, two accumulators per row. */
MM_INLINE SIMD_TARGET void gemv_f(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t in, float *y, const int NW)
{
    __m256 a0[4], a1[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) a0[c] = a1[c] = _mm256_setzero_ps();
    size_t k = 0;
    for (; k + 16 <= in; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
        {
            a0[c] = _mm256_fmadd_ps(load8(t, w + c * rb, k), x0, a0[c]);
            a1[c] = _mm256_fmadd_ps(load8(t, w + c * rb, k + 8), x1, a1[c]);
        }
    }
    if (k + 8 <= in) {
        __m256 x0 = _mm256_loadu_ps(x + k);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) a0[c] =
            _mm256_fmadd_ps(load8(t, w + c * rb, k), x0, a0[c]);
        k += 8;
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
    {
        float s = hsum8(_mm256_add_ps(a0[c], a1[c]));
        for (size_t i = k; i < in; i++)
            s += row_get(t, w + c * rb, i) * x[i];
        y[c] = s;
    }
}

/* q8_0: per 32-value block the f32 sum of q*x, times the block scale. */
MM_INLINE SIMD_TARGET void gemv_q8(const uint8_t *w, size_t rb, const float *x, size_t in, float *y,
                                   const int NW)
{
    __m256 acc[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) acc[c] = _mm256_setzero_ps();
    for (size_t b = 0; b < in / CT_Q8_0_BLOCK; b++) {
        const float *xb = x + b * CT_Q8_0_BLOCK;
        __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8),
               x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
        {
            const uint8_t *blk = w + c * rb + b * CT_Q8_0_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            __m256 s0 = _mm256_mul_ps(q8x8(blk + 2), x0), s1 = _mm256_mul_ps(q8x8(blk + 10), x1);
            s0 = _mm256_fmadd_ps(q8x8(blk + 18), x2, s0);
            s1 = _mm256_fmadd_ps(q8x8(blk + 26), x3, s1);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dh)), _mm256_add_ps(s0, s1), acc[c]);
        }
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) y[c] = hsum8(acc[c]);
}

/* y[0..nw) for row-major weight rows w, w+rb, ... (nw <= 4). */
static SIMD_TARGET void gemv_rows(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t in, float *y, int nw)
{
#define GEMV_NW(CALL)                                                                              \
    switch (nw) {                                                                                  \
    case 1:                                                                                        \
        CALL(1);                                                                                   \
        break;                                                                                     \
    case 2:                                                                                        \
        CALL(2);                                                                                   \
        break;                                                                                     \
    case 3:                                                                                        \
        CALL(3);                                                                                   \
        break;                                                                                     \
    default:                                                                                       \
        CALL(4);                                                                                   \
        break;                                                                                     \
    }
#define GEMV_F(T, n) gemv_f(T, w, rb, x, in, y, n)
#define GEMV_F32(n) GEMV_F(CT_F32, n)
#define GEMV_F16(n) GEMV_F(CT_F16, n)
#define GEMV_BF16(n) GEMV_F(CT_BF16, n)
#define GEMV_Q8(n) gemv_q8(w, rb, x, in, y, n)
    switch (t) {
    case CT_F32:
        GEMV_NW(GEMV_F32);
        break;
    case CT_F16:
        GEMV_NW(GEMV_F16);
        break;
    case CT_BF16:
        GEMV_NW(GEMV_BF16);
        break;
    case CT_Q8_0:
        GEMV_NW(GEMV_Q8);
        break;
    default:
        break;
    }
#undef GEMV_NW
#undef GEMV_F
#undef GEMV_F32
#undef GEMV_F16
#undef GEMV_BF16
#undef GEMV_Q8
}
#endif

/* ---- scalar paths (no AVX2, or KVD_CPU_SCALAR=1) ---- */

static void pk_gemv_scalar(enum ctype t, const uint8_t *g, size_t in, const float *x, size_t ldx,
                           float *o, int nr)
{
    for (int r = 0; r < nr; r++) {
        float acc[PK] = {0};
        for (size_t k = 0; k < in; k++)
            for (size_t j = 0; j < PK; j++)
                acc[j] += pk_get(t, g, k, j) * x[r * ldx + k];
        memcpy(o + r * PK, acc, sizeof acc);
    }
}

static void gemv_rows_scalar(enum ctype t, const uint8_t *w, size_t rb, const float *x, size_t in,
                             float *y, int nw)
{
    for (int c = 0; c < nw; c++) {
        float s = 0;
        for (size_t k = 0; k < in; k++)
            s += row_get(t, w + c * rb, k) * x[k];
        y[c] = s;
    }
}

/* ---- threading ---- */

struct mm_job {
    const struct ctensor *w;
    const float *x;
    float *y;
    float **panel; /* per-thread f32 panel of a chunk */
    uint32_t rows;
    size_t chunk, n_chunks; /* groups (CL_PACK16) or rows (CL_ROWS) per chunk */
    bool simd;
    atomic_size_t next;
};

/* o[r][0..16) -> y rows, the group's columns below out only. */
static void put_cols(const float *o, int nr, float *y, size_t ldy, size_t ncol)
{
    for (int r = 0; r < nr; r++)
        if (ncol == PK)
            memcpy(y + r * ldy, o + r * PK, PK * 4);
        else
            memcpy(y + r * ldy, o + r * PK, ncol * 4);
}

/* Packed groups [g0, g1) against every activation row. */
static void mm_chunk_packed(struct mm_job *j, uint32_t ith, size_t g0, size_t g1)
{
    size_t in = j->w->ne0, out = j->w->ne1, gb = pk_group_bytes(j->w->type, in);
    enum ctype t = j->w->type;
    const uint8_t *base = (const uint8_t *)j->w->data;
    float o[MM_TILE * PK];
#if defined(__x86_64__)
    if (j->simd && j->rows >= MM_PANEL_ROWS) {
        /* row blocks x k blocks x groups x tiles over the chunk as f32: in
         * place for f32 weights, else a per-thread panel that the first
         * tile of the first row block fills as it goes; that tile also
         * prefetches the next chunk */
        bool widen = t != CT_F32;
        float *pn = widen ? j->panel[ith] : (float *)(uintptr_t)(base + g0 * gb);
        size_t pfk = gb / in, ng = g1 - g0;
        const char *pf = g1 < (out + PK - 1) / PK ? (const char *)(base + g1 * gb) : NULL;
        float acc[MM_CHUNK_MAX * MM_RB * PK];
        for (size_t r0 = 0; r0 < j->rows; r0 += MM_RB) {
            size_t nrb = j->rows - r0 < MM_RB ? j->rows - r0 : MM_RB;
            size_t ntile = (nrb + MM_TILE - 1) / MM_TILE;
            /* y's lines of the chunk, for writing: a step's y rows are
             * `out` floats apart, so without this every line written is a
             * miss (and the logits' y does not fit L2) */
            for (size_t r = 0; r < nrb; r++)
                for (size_t g = 0; g < ng; g++)
                    __builtin_prefetch(j->y + (r0 + r) * out + (g0 + g) * PK, 1, 3);
            /* k blocks outside the groups and tiles: the block of x (MM_RB x
             * MM_KB) and of each group's panel stay in L1 for every tile */
            for (size_t k0 = 0; k0 < in; k0 += MM_KB) {
                size_t kn = in - k0 < MM_KB ? in - k0 : MM_KB;
                for (size_t g = 0; g < ng; g++)
                    for (size_t ti = 0, r = 0; ti < ntile; ti++) {
                        /* tiles of near-equal size, the smallest first (it
                         * also widens, and needs registers for that): 16
                         * rows = 5 + 5 + 6 */
                        size_t nr = (nrb - r) / (ntile - ti);
                        const char *tpf = r0 == 0 && ti == 0 && pf ? pf + g * gb + k0 * pfk : NULL;
                        const float *xr = j->x + (r0 + r) * in + k0;
                        float *ar = acc + (g * MM_RB + r) * PK;
                        if (t == CT_Q8_0)
                            pk_tile_q8_n(base + (g0 + g) * gb, k0, kn, pn + g * in * PK,
                                         r0 == 0 && ti == 0, xr, in, ar, k0 == 0, tpf, pfk,
                                         (int)nr);
                        else if (widen && r0 == 0 && ti == 0)
                            pk_tile_w_n(t, base + (g0 + g) * gb, k0, kn, pn + g * in * PK, xr, in,
                                        ar, k0 == 0, tpf, pfk, (int)nr);
                        else
                            pk_tile_n(pn + g * in * PK, k0, kn, xr, in, ar, k0 == 0, tpf, pfk,
                                      (int)nr);
                        r += nr;
                    }
            }
            for (size_t g = 0; g < ng; g++) {
                size_t gc = g0 + g, ncol = out - gc * PK < PK ? out - gc * PK : PK;
                put_cols(acc + g * MM_RB * PK, (int)nrb, j->y + r0 * out + gc * PK, out, ncol);
            }
        }
        return;
    }
#endif
#if defined(__x86_64__)
    if (j->simd) {
        /* a few groups per pass (their chains side by side), every row
         * against them in pairs while they are in cache */
        float og[8 * PK];
        for (size_t g = g0; g < g1;) {
            int ng_max = pk_gemv_groups(t, 1);
            int ng = g1 - g < (size_t)ng_max ? (int)(g1 - g) : ng_max;
            for (size_t r = 0; r < j->rows; r += 2) {
                int nr = j->rows - r < 2 ? 1 : 2;
                for (int gi = 0; gi < ng;) {
                    int ngp = pk_gemv_groups(t, nr);
                    ngp = ng - gi < ngp ? ng - gi : ngp;
                    pk_gemv(t, base + (g + gi) * gb, gb, ngp, in, j->x + r * in, in, og, nr);
                    for (int rr = 0; rr < nr; rr++)
                        for (int q = 0; q < ngp; q++) {
                            size_t gc = g + gi + q, ncol = out - gc * PK < PK ? out - gc * PK : PK;
                            put_cols(og + (rr * ngp + q) * PK, 1, j->y + (r + rr) * out + gc * PK,
                                     out, ncol);
                        }
                    gi += ngp;
                }
            }
            g += (size_t)ng;
        }
        (void)ith;
        return;
    }
#endif
    for (size_t g = g0; g < g1; g++) {
        size_t ncol = out - g * PK < PK ? out - g * PK : PK;
        for (size_t r = 0; r < j->rows; r += 2) {
            int nr = j->rows - r < 2 ? 1 : 2;
            pk_gemv_scalar(t, base + g * gb, in, j->x + r * in, in, o, nr);
            put_cols(o, nr, j->y + r * out + g * PK, out, ncol);
        }
    }
    (void)ith;
}

/* Row-major weight rows [c0, c1) against every activation row. */
static void mm_chunk_rows(struct mm_job *j, size_t c0, size_t c1)
{
    size_t in = j->w->ne0, out = j->w->ne1, rb = ctype_row_bytes(j->w->type, in);
    const uint8_t *w0 = (const uint8_t *)j->w->data;
    for (size_t r = 0; r < j->rows; r++)
        for (size_t c = c0; c < c1; c += 4) {
            int nw = c1 - c < 4 ? (int)(c1 - c) : 4;
#if defined(__x86_64__)
            if (j->simd)
                gemv_rows(j->w->type, w0 + c * rb, rb, j->x + r * in, in, j->y + r * out + c, nw);
            else
#endif
                gemv_rows_scalar(j->w->type, w0 + c * rb, rb, j->x + r * in, in, j->y + r * out + c,
                                 nw);
        }
}

static void mm_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct mm_job *j = arg;
    size_t n = j->w->layout == CL_PACK16 ? (j->w->ne1 + (size_t)PK - 1) / PK : j->w->ne1;
    (void)nth;
    for (size_t ci; (ci = atomic_fetch_add(&j->next, 1)) < j->n_chunks;) {
        size_t c0 = ci * j->chunk, c1 = c0 + j->chunk < n ? c0 + j->chunk : n;
        if (j->w->layout == CL_PACK16)
            mm_chunk_packed(j, ith, c0, c1);
        else
            mm_chunk_rows(j, c0, c1);
    }
}

/* Makes sure every worker has a panel of at least floats floats. */
static int panel_reserve(struct compute_ctx *cx, size_t floats)
{
    if (floats <= cx->panel_cap)
        return 0;
    for (uint32_t i = 0; i < cx->pool.n; i++) {
        float *p = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        if (!p)
            return KVD_ENOMEM;
        free(cx->panel[i]);
        cx->panel[i] = p;
    }
    cx->panel_cap = floats;
    return 0;
}

int cpu_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
               float *y)
{
    struct mm_job j = {.w = w, .x = x, .y = y, .rows = rows, .simd = cx->simd, .panel = cx->panel};
    if (rows == 0 || w->ne1 == 0)
        return 0;
    if (cpu_qmatmul_type(w->type))
        return cpu_qmatmul(cx, w, x, rows, y);
    size_t n = cx->pool.n, chunk;
    if (w->layout == CL_PACK16) {
        size_t groups = (w->ne1 + (size_t)PK - 1) / PK;
        if (cx->simd && rows >= MM_PANEL_ROWS) {
            /* a chunk's f32 panel fills about MM_PANEL_BYTES (>= 1 group),
             * but no fewer than 4 chunks per worker, for balance */
            size_t fit = MM_PANEL_BYTES / ((size_t)w->ne0 * PK * 4);
            chunk = fit < 1 ? 1 : fit > MM_CHUNK_MAX ? MM_CHUNK_MAX : fit;
            while (chunk > 1 && (groups + chunk - 1) / chunk < 4 * n)
                chunk /= 2;
            if (w->type != CT_F32 && panel_reserve(cx, chunk * w->ne0 * PK))
                return KVD_ENOMEM;
        } else {
            /* >= 8 chunks per worker for balance */
            chunk = groups / (8 * n);
            chunk = chunk < 1 ? 1 : chunk > 32 ? 32 : chunk;
        }
        j.n_chunks = (groups + chunk - 1) / chunk;
    } else {
        /* multiples of 16 rows so threads' y segments do not share lines */
        chunk = w->ne1 / (8 * n);
        chunk = chunk < 16 ? 16 : chunk > 512 ? 512 : (chunk + 15) & ~(size_t)15;
        j.n_chunks = (w->ne1 + chunk - 1) / chunk;
    }
    j.chunk = chunk;
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, mm_task, &j);
    return 0;
}

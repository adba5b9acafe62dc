/* cpu matmul: y[rows][out] = x[rows][in] . W[out][in]^T with W kept in its
 * native type (f32, f16, bf16, q8_0), f32 accumulation. Two kernels:
 * - rows < MM_PANEL_ROWS (decode, a memory-bound GEMV): 4 weight rows at a
 *   time against one activation row, widened in registers, 2 accumulators per
 *   weight row, q8_0 scale applied once per 32-value block;
 * - rows >= MM_PANEL_ROWS (batched decode, prefill): a thread takes a chunk
 *   of weight rows (L2-sized) and runs 4 activation rows x 3 weight rows
 *   register tiles over it in L1-sized k blocks, so each weight is read from
 *   memory once per step, whatever the batch; the next chunk is prefetched
 *   meanwhile. f32/f16/bf16 are widened in registers inside the tile, q8_0
 *   is dequantized once per step into a per-thread f32 panel first.
 * Threads take chunks of weight rows from an atomic counter. */
#include <stdlib.h>

#include "compute_cpu.h"
#include "kvd/status.h"

#define MM_PANEL_ROWS 4      /* activation rows from which the panel kernel is used */
#define MM_PANEL_BYTES 98304 /* chunk of weight rows, counted as f32: fits L2 beside x */
#define MM_KB 512            /* k block (floats) of the panel kernel */
#define MM_RB 8              /* activation rows per block of the panel kernel */

#if defined(__x86_64__)
#include <immintrin.h>
#define SIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define MM_INLINE static inline __attribute__((always_inline))

/* 8 consecutive weights k..k+7 of a f32/f16/bf16 row, as f32. */
MM_INLINE SIMD_TARGET __m256 load8(enum ctype t, const uint8_t *w, size_t k)
{
    switch (t) {
    case CT_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    case CT_BF16: {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    default: return _mm256_loadu_ps((const float *)w + k);
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
#endif

/* Scalar element k of a weight row (tails and the scalar path). */
static inline float wget(enum ctype t, const uint8_t *w, size_t k)
{
    switch (t) {
    case CT_F32: return ((const float *)w)[k];
    case CT_F16: return cpu_f16_to_f32(((const uint16_t *)w)[k]);
    case CT_BF16: return cpu_bf16_to_f32(((const uint16_t *)w)[k]);
    case CT_Q8_0: {
        const uint8_t *blk = w + (k / CT_Q8_0_BLOCK) * CT_Q8_0_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        return cpu_f16_to_f32(dh) * (float)(int8_t)blk[2 + k % CT_Q8_0_BLOCK];
    }
    }
    return 0;
}

#if defined(__x86_64__)
/* ---- GEMV: y[c] = dot(W row c, x), c < NW (a constant after inlining) ---- */

/* f32 / f16 / bf16: 16 weights per step and row, two accumulators per row so
 * 2*NW independent FMA chains hide the FMA latency. */
MM_INLINE SIMD_TARGET void gemv_f(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t in, float *y, const int NW)
{
    __m256 a0[4], a1[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
        a0[c] = a1[c] = _mm256_setzero_ps();
    size_t k = 0;
    /* prefetch the next NW rows (contiguous after these) as fast as these
     * are consumed: NW*16 weights per step */
    const char *pf = (const char *)w + NW * rb;
    const int pf_lines = (NW * 16 * (t == CT_F32 ? 4 : 2) + 63) / 64;
    for (; k + 16 <= in; k += 16) {
        _Pragma("GCC unroll 4") for (int p = 0; p < pf_lines; p++)
            _mm_prefetch(pf + 64 * p, _MM_HINT_T0);
        pf += 64 * pf_lines;
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) {
            a0[c] = _mm256_fmadd_ps(load8(t, w + c * rb, k), x0, a0[c]);
            a1[c] = _mm256_fmadd_ps(load8(t, w + c * rb, k + 8), x1, a1[c]);
        }
    }
    if (k + 8 <= in) {
        __m256 x0 = _mm256_loadu_ps(x + k);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
            a0[c] = _mm256_fmadd_ps(load8(t, w + c * rb, k), x0, a0[c]);
        k += 8;
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) {
        float s = hsum8(_mm256_add_ps(a0[c], a1[c]));
        for (size_t i = k; i < in; i++)
            s += wget(t, w + c * rb, i) * x[i];
        y[c] = s;
    }
}

/* q8_0 (in % 32 == 0): per 32-value block, the f32 sum of q*x over the block
 * in two partial chains, then one multiply-add by the block scale d. */
MM_INLINE SIMD_TARGET void gemv_q8(const uint8_t *w, size_t rb, const float *x, size_t in,
                                   float *y, const int NW)
{
    __m256 acc[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
        acc[c] = _mm256_setzero_ps();
    size_t nb = in / CT_Q8_0_BLOCK;
    const char *pf = (const char *)w + NW * rb; /* next NW rows, NW*34 bytes per step */
    const int pf_lines = (NW * CT_Q8_0_BYTES + 63) / 64;
    for (size_t b = 0; b < nb; b++) {
        _Pragma("GCC unroll 4") for (int p = 0; p < pf_lines; p++)
            _mm_prefetch(pf + 64 * p, _MM_HINT_T0);
        pf += 64 * pf_lines;
        const float *xb = x + b * CT_Q8_0_BLOCK;
        __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
               x3 = _mm256_loadu_ps(xb + 24);
        _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++) {
            const uint8_t *blk = w + c * rb + b * CT_Q8_0_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            __m256 s0 = _mm256_mul_ps(q8x8(blk + 2), x0), s1 = _mm256_mul_ps(q8x8(blk + 10), x1);
            s0 = _mm256_fmadd_ps(q8x8(blk + 18), x2, s0);
            s1 = _mm256_fmadd_ps(q8x8(blk + 26), x3, s1);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(dh)), _mm256_add_ps(s0, s1), acc[c]);
        }
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < NW; c++)
        y[c] = hsum8(acc[c]);
}

#define GEMV_CASES(T)                                                                              \
    switch (nw) {                                                                                 \
    case 1: gemv_f(T, w, rb, x, in, y, 1); break;                                                 \
    case 2: gemv_f(T, w, rb, x, in, y, 2); break;                                                 \
    case 3: gemv_f(T, w, rb, x, in, y, 3); break;                                                 \
    default: gemv_f(T, w, rb, x, in, y, 4); break;                                                \
    }

/* y[0..nw) for weight rows w, w+rb, ... (nw <= 4). */
static SIMD_TARGET void gemv_simd(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t in, float *y, int nw)
{
    switch (t) {
    case CT_F32: GEMV_CASES(CT_F32); break;
    case CT_F16: GEMV_CASES(CT_F16); break;
    case CT_BF16: GEMV_CASES(CT_BF16); break;
    case CT_Q8_0:
        if (in % CT_Q8_0_BLOCK) /* not a valid q8_0 row; the loader rejects it */
            return;
        switch (nw) {
        case 1: gemv_q8(w, rb, x, in, y, 1); break;
        case 2: gemv_q8(w, rb, x, in, y, 2); break;
        case 3: gemv_q8(w, rb, x, in, y, 3); break;
        default: gemv_q8(w, rb, x, in, y, 4); break;
        }
        break;
    }
}

/* ---- batched kernel: NR activation rows x NW weight rows register tiles ---- */
/* 4 x 3 = 12 accumulators + 3 weight vectors + 1 x vector = all 16 ymm
 * registers; per 8 values 7 loads feed 12 FMAs (4 x 2 needed 6 for 8, and
 * measured ~12 % slower at 16 streams). f16/bf16 weights are widened in
 * registers right before the FMAs (4 times per weight at 16 activation rows,
 * beside the FMAs); a separate widening pass into an L2 f32 panel was ~10 %
 * slower. q8_0 keeps that pass (widen_q8): fused in the tile, the per-block
 * scale multiply cost ~15 % more, and dequantizing per 3 rows x MM_KB values
 * into L1 ~5 % more. */

/* acc[r*lda + c] += the 8 lane partial sums of dot(W row c, x row r) over
 * values [k0, k0+kn) (kn a multiple of 8), r < NR, c < NW; W rows of type t
 * (not q8_0) rb bytes apart, x rows ldx floats apart. Partial sums stay as
 * vectors across k blocks, so they are reduced once at the end, in the same
 * order whatever the chunking (results do not depend on the thread count). */
MM_INLINE SIMD_TARGET void tile(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                size_t ldx, size_t k0, size_t kn, float *acc, size_t lda,
                                const int NR, const int NW)
{
    __m256 a[4][3];
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 3") for (int c = 0; c < NW; c++)
            a[r][c] = _mm256_loadu_ps(acc + (r * lda + c) * 8);
    for (size_t k = k0; k < k0 + kn; k += 8) {
        __m256 wv[3];
        _Pragma("GCC unroll 3") for (int c = 0; c < NW; c++)
            wv[c] = load8(t, w + c * rb, k);
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            /* keep xv in a register: folded into each FMA it is loaded NW
             * times, and loads, not FMAs, become the limit */
            __asm__("" : "+x"(xv));
            _Pragma("GCC unroll 3") for (int c = 0; c < NW; c++)
                a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 3") for (int c = 0; c < NW; c++)
            _mm256_storeu_ps(acc + (r * lda + c) * 8, a[r][c]);
}

#define TILE_CASES(T)                                                                              \
    switch (nr * 4 + nw) {                                                                        \
    case 1 * 4 + 1: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 1, 1); break;                        \
    case 1 * 4 + 2: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 1, 2); break;                        \
    case 1 * 4 + 3: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 1, 3); break;                        \
    case 2 * 4 + 1: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 2, 1); break;                        \
    case 2 * 4 + 2: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 2, 2); break;                        \
    case 2 * 4 + 3: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 2, 3); break;                        \
    case 3 * 4 + 1: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 3, 1); break;                        \
    case 3 * 4 + 2: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 3, 2); break;                        \
    case 3 * 4 + 3: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 3, 3); break;                        \
    case 4 * 4 + 1: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 4, 1); break;                        \
    case 4 * 4 + 2: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 4, 2); break;                        \
    default: tile(T, w, rb, x, ldx, k0, kn, acc, lda, 4, 3); break;                               \
    }

static SIMD_TARGET void tile_simd(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t ldx, size_t k0, size_t kn, float *acc, size_t lda, int nr,
                                  int nw)
{
    switch (t) {
    case CT_F32: TILE_CASES(CT_F32); break;
    case CT_F16: TILE_CASES(CT_F16); break;
    case CT_BF16: TILE_CASES(CT_BF16); break;
    case CT_Q8_0: break; /* dequantized by widen_q8 first */
    }
}

/* Dequantizes nw q8_0 weight rows of in values (in % 32 == 0; rb bytes
 * apart) to f32 rows of in floats in out (the chunk's L2 panel). */
static SIMD_TARGET void widen_q8(const uint8_t *w, size_t rb, size_t in, size_t nw, float *out)
{
    for (size_t c = 0; c < nw; c++, w += rb, out += in)
        for (size_t k = 0; k < in; k += CT_Q8_0_BLOCK) {
            const uint8_t *blk = w + (k / CT_Q8_0_BLOCK) * CT_Q8_0_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
            for (int i = 0; i < CT_Q8_0_BLOCK; i += 8)
                _mm256_storeu_ps(out + k + i, _mm256_mul_ps(q8x8(blk + 2 + i), d));
        }
}

/* y[r*ldy + c] = dot(W row c, x row r) for r < rows, c < nc: W rows of type
 * t, rb bytes apart, in values each. Blocked so that MM_RB activation rows x
 * MM_KB values (16 KiB) and the 3 weight rows of the current tile stay in
 * L1: L2 alone cannot feed the FMA units. acc: MM_RB * nc * 8 floats of
 * scratch. pf/pf_n: raw bytes to prefetch meanwhile (the next chunk's
 * weights). */
static SIMD_TARGET void panel_mm(enum ctype t, const uint8_t *w, size_t rb, size_t nc,
                                 const float *x, size_t rows, size_t in, float *y, size_t ldy,
                                 float *acc, const char *pf, size_t pf_n)
{
    size_t kmain = in & ~(size_t)7;
    size_t n_kb = (kmain + MM_KB - 1) / MM_KB, iters = n_kb * ((nc + 2) / 3);
    size_t pf_step = iters ? (pf_n / iters + 63) & ~(size_t)63 : 0;
    for (size_t r0 = 0; r0 < rows; r0 += MM_RB) {
        size_t nrb = rows - r0 < MM_RB ? rows - r0 : MM_RB;
        memset(acc, 0, nrb * nc * 8 * sizeof(float));
        for (size_t k0 = 0; k0 < kmain; k0 += MM_KB) {
            size_t kn = kmain - k0 < MM_KB ? kmain - k0 : MM_KB;
            for (size_t c = 0; c < nc; c += 3) {
                if (r0 == 0)
                    for (size_t p = 0; p < pf_step; p += 64, pf += 64)
                        _mm_prefetch(pf, _MM_HINT_T1);
                int nw = nc - c < 3 ? (int)(nc - c) : 3;
                for (size_t r = 0; r < nrb; r += 4)
                    tile_simd(t, w + c * rb, rb, x + (r0 + r) * in, in, k0, kn,
                              acc + (r * nc + c) * 8, nc, nrb - r < 4 ? (int)(nrb - r) : 4, nw);
            }
        }
        for (size_t r = 0; r < nrb; r++)
            for (size_t c = 0; c < nc; c++) {
                float s = hsum8(_mm256_loadu_ps(acc + (r * nc + c) * 8));
                for (size_t k = kmain; k < in; k++)
                    s += wget(t, w + c * rb, k) * x[(r0 + r) * in + k];
                y[(r0 + r) * ldy + c] = s;
            }
    }
}
#endif

static void dot_scalar(enum ctype t, const uint8_t *w, size_t rb, const float *x, size_t in,
                       float *y, size_t ldy, int nr, int nw)
{
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nw; c++) {
            float s = 0;
            for (size_t k = 0; k < in; k++)
                s += wget(t, w + c * rb, k) * x[r * in + k];
            y[r * ldy + c] = s;
        }
}

struct mm_job {
    const struct ctensor *w;
    const float *x;
    float *y;
    float **panel; /* per-thread scratch: q8_0 panel + partial sums */
    uint32_t rows, chunk, n_chunks;
    size_t rb;
    bool simd;
    atomic_uint next;
};

/* Weight rows [c0, c1) against every activation row. */
static void mm_chunk(struct mm_job *j, uint32_t ith, size_t c0, size_t c1)
{
    size_t in = j->w->ne0, out = j->w->ne1;
    enum ctype t = j->w->type;
    const uint8_t *w0 = (const uint8_t *)j->w->data + c0 * j->rb;
#if defined(__x86_64__)
    if (j->simd && j->rows < MM_PANEL_ROWS) {
        /* the chunk stays in L2, so rows after the first read it from cache */
        for (size_t r = 0; r < j->rows; r++)
            for (size_t c = c0; c < c1; c += 4)
                gemv_simd(t, w0 + (c - c0) * j->rb, j->rb, j->x + r * in, in, j->y + r * out + c,
                          c1 - c < 4 ? (int)(c1 - c) : 4);
        return;
    }
    if (j->simd) {
        size_t nc = c1 - c0, pf_n = c1 + j->chunk <= out ? j->chunk * j->rb : 0;
        float *acc = j->panel[ith];
        if (t == CT_Q8_0) { /* dequantized once per step into the panel */
            widen_q8(w0, j->rb, in, nc, acc);
            panel_mm(CT_F32, (const uint8_t *)acc, in * 4, nc, j->x, j->rows, in, j->y + c0, out,
                     acc + nc * in, (const char *)w0 + nc * j->rb, pf_n);
        } else {
            panel_mm(t, w0, j->rb, nc, j->x, j->rows, in, j->y + c0, out, acc,
                     (const char *)w0 + nc * j->rb, pf_n);
        }
        return;
    }
#endif
    (void)ith;
    for (size_t r0 = 0; r0 < j->rows; r0 += 4) {
        int nr = j->rows - r0 < 4 ? (int)(j->rows - r0) : 4;
        for (size_t c = c0; c < c1; c += 2)
            dot_scalar(t, w0 + (c - c0) * j->rb, j->rb, j->x + r0 * in, in, j->y + r0 * out + c,
                       out, nr, c1 - c < 2 ? 1 : 2);
    }
}

static void mm_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct mm_job *j = arg;
    (void)nth;
    for (;;) {
        uint32_t ci = atomic_fetch_add(&j->next, 1);
        if (ci >= j->n_chunks)
            break;
        size_t c0 = (size_t)ci * j->chunk, c1 = c0 + j->chunk;
        mm_chunk(j, ith, c0, c1 < j->w->ne1 ? c1 : j->w->ne1);
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
    struct mm_job j = {.w = w, .x = x, .y = y, .rows = rows, .simd = cx->simd,
                       .rb = ctype_row_bytes(w->type, w->ne0), .panel = cx->panel};
    if (rows == 0 || w->ne1 == 0)
        return 0;
    uint32_t n = cx->pool.n, chunk;
    bool panel = cx->simd && rows >= MM_PANEL_ROWS;
    if (panel) {
        /* a chunk's f32 panel fills about MM_PANEL_BYTES, >= 2 rows */
        size_t fit = MM_PANEL_BYTES / ((size_t)w->ne0 * 4);
        chunk = fit < 2 ? 2 : fit > 256 ? 256 : (uint32_t)fit;
        /* but no fewer than 4 chunks per worker, for balance */
        while (chunk > 8 && (w->ne1 + chunk - 1) / chunk < 4 * n)
            chunk /= 2;
        chunk = chunk >= 3 ? chunk / 3 * 3 : chunk; /* whole 4 x 3 tiles */
        /* q8_0 dequantized rows + MM_RB x chunk partial-sum vectors */
        if (panel_reserve(cx, (w->type == CT_Q8_0 ? (size_t)chunk * w->ne0 : 0) +
                                  (size_t)MM_RB * chunk * 8))
            return KVD_ENOMEM;
    } else {
        /* GEMV: >= 8 chunks per worker for balance, multiples of 16 rows so
         * threads' y segments do not share cache lines */
        chunk = w->ne1 / (8 * n);
        chunk = chunk < 16 ? 16 : chunk > 512 ? 512 : (chunk + 15) & ~15u;
    }
    j.chunk = chunk;
    j.n_chunks = (w->ne1 + chunk - 1) / chunk;
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, mm_task, &j);
    return 0;
}

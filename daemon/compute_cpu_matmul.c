/* cpu matmul: y[rows][out] = x[rows][in] . W[out][in]^T with W kept in its
 * native type (f32, f16, bf16, q8_0) and widened in registers, f32
 * accumulation. One kernel serves decode (rows = 1: a memory-bound GEMV) and
 * prefill (rows large): threads take chunks of weight rows, and inside a
 * chunk each group of 4 activation rows meets 2 weight rows at a time, so a
 * weight chunk is read from memory once and reused from cache. */
#include <stdlib.h>

#include "compute_cpu.h"
#include "kvd/status.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define SIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define MM_INLINE static inline __attribute__((always_inline))

MM_INLINE SIMD_TARGET __m256 load8(enum ctype t, const uint8_t *w, size_t k)
{
    switch (t) {
    case CT_F32: return _mm256_loadu_ps((const float *)w + k);
    case CT_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    case CT_BF16: {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    case CT_Q8_0: {
        const uint8_t *blk = w + (k / CT_Q8_0_BLOCK) * CT_Q8_0_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + k % CT_Q8_0_BLOCK));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dh)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    }
    return _mm256_setzero_ps();
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
/* y[r*ldy + c] = dot(W row c, x row r) for r < NR, c < NW (both constants
 * after inlining, so the NR x NW accumulators stay in registers). */
MM_INLINE SIMD_TARGET void tile(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                size_t in, float *y, size_t ldy, const int NR, const int NW)
{
    __m256 acc[4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 2") for (int c = 0; c < NW; c++)
            acc[r][c] = _mm256_setzero_ps();
    size_t kend = in & ~(size_t)7;
    for (size_t k = 0; k < kend; k += 8) {
        __m256 wv[2];
        _Pragma("GCC unroll 2") for (int c = 0; c < NW; c++)
            wv[c] = load8(t, w + c * rb, k);
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * in + k);
            _Pragma("GCC unroll 2") for (int c = 0; c < NW; c++)
                acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)
        for (int c = 0; c < NW; c++) {
            float s = hsum8(acc[r][c]);
            for (size_t k = kend; k < in; k++)
                s += wget(t, w + c * rb, k) * x[r * in + k];
            y[r * ldy + c] = s;
        }
}

#define TILE_CASES(T)                                                                              \
    switch (nr * 4 + nw) {                                                                        \
    case 1 * 4 + 1: tile(T, w, rb, x, in, y, ldy, 1, 1); break;                                   \
    case 1 * 4 + 2: tile(T, w, rb, x, in, y, ldy, 1, 2); break;                                   \
    case 2 * 4 + 1: tile(T, w, rb, x, in, y, ldy, 2, 1); break;                                   \
    case 2 * 4 + 2: tile(T, w, rb, x, in, y, ldy, 2, 2); break;                                   \
    case 3 * 4 + 1: tile(T, w, rb, x, in, y, ldy, 3, 1); break;                                   \
    case 3 * 4 + 2: tile(T, w, rb, x, in, y, ldy, 3, 2); break;                                   \
    case 4 * 4 + 1: tile(T, w, rb, x, in, y, ldy, 4, 1); break;                                   \
    default: tile(T, w, rb, x, in, y, ldy, 4, 2); break;                                          \
    }

static SIMD_TARGET void tile_simd(enum ctype t, const uint8_t *w, size_t rb, const float *x,
                                  size_t in, float *y, size_t ldy, int nr, int nw)
{
    switch (t) {
    case CT_F32: TILE_CASES(CT_F32); break;
    case CT_F16: TILE_CASES(CT_F16); break;
    case CT_BF16: TILE_CASES(CT_BF16); break;
    case CT_Q8_0: TILE_CASES(CT_Q8_0); break;
    }
}
#endif

static void tile_scalar(enum ctype t, const uint8_t *w, size_t rb, const float *x, size_t in,
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
    uint32_t rows, chunk, n_chunks;
    size_t rb;
    bool simd;
    atomic_uint next;
};

static void mm_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct mm_job *j = arg;
    size_t in = j->w->ne0, out = j->w->ne1;
    for (;;) {
        uint32_t ci = atomic_fetch_add(&j->next, 1);
        if (ci >= j->n_chunks)
            break;
        size_t c0 = (size_t)ci * j->chunk, c1 = c0 + j->chunk < out ? c0 + j->chunk : out;
        for (size_t r0 = 0; r0 < j->rows; r0 += 4) {
            int nr = j->rows - r0 < 4 ? (int)(j->rows - r0) : 4;
            for (size_t c = c0; c < c1; c += 2) {
                int nw = c1 - c < 2 ? 1 : 2;
                const uint8_t *w = (const uint8_t *)j->w->data + c * j->rb;
                const float *x = j->x + r0 * in;
                float *y = j->y + r0 * out + c;
#if defined(__x86_64__)
                if (j->simd) {
                    tile_simd(j->w->type, w, j->rb, x, in, y, out, nr, nw);
                    continue;
                }
#endif
                tile_scalar(j->w->type, w, j->rb, x, in, y, out, nr, nw);
            }
        }
    }
}

int cpu_matmul(struct compute_ctx *cx, const struct ctensor *w, const float *x, uint32_t rows,
               float *y)
{
    struct mm_job j = {.w = w, .x = x, .y = y, .rows = rows, .simd = cx->simd,
                       .rb = ctype_row_bytes(w->type, w->ne0)};
    if (rows == 0 || w->ne1 == 0)
        return 0;
    /* Chunks of weight rows: small enough to balance threads (>= 8 per
     * worker), at least 16 rows so a chunk amortizes the x reloads. */
    uint32_t n = cx->pool.n;
    uint32_t chunk = w->ne1 / (8 * n);
    if (chunk < 16)
        chunk = 16;
    if (chunk > 256)
        chunk = 256;
    if ((size_t)chunk * j.rb > 131072) /* keep a chunk in L2 while row groups pass over it */
        chunk = j.rb * 16 > 131072 ? 16 : (uint32_t)(131072 / j.rb);
    chunk = (chunk + 1) & ~1u;
    j.chunk = chunk;
    j.n_chunks = (w->ne1 + chunk - 1) / chunk;
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, mm_task, &j);
    return 0;
}

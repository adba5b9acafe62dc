/* The cpu implementation of the compute-ops table (compute.h): the context
 * with its worker pool (compute_cpu_pool.c), buffers in plain memory, and the
 * element-wise ops, RoPE, KV writes and row gathers. Matmul and attention
 * are in compute_cpu_matmul.c and compute_cpu_attn.c. This is the reference
 * every other backend is compared against. */
#include "compute_cpu_impl.h"
#include "compute_cpu_kv.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <math.h>
#include <malloc.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvd/status.h"
#include "quant.h"

/* ---- context and buffers ------------------------------------------------ */

static int cpu_ctx_new(struct backend *be, const struct compute_conf *conf,
                       struct compute_ctx **out)
{
    struct compute_ctx *cx = calloc(1, sizeof *cx);
    uint32_t n = conf ? conf->n_threads : 0;
    if (!cx)
        return KVD_ENOMEM;
    if (n == 0) {
        long np = sysconf(_SC_NPROCESSORS_ONLN);
        n = np > 0 ? (uint32_t)np : 1;
    }
    if (n > 256)
        n = 256;
    cx->be = be;
#if defined(__x86_64__)
    unsigned int ea, eb, ec, ed; /* clang 14 has no "f16c" for __builtin_cpu_supports */
    __builtin_cpu_init();
    cx->simd = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __get_cpuid(1, &ea, &eb, &ec, &ed) && (ec & bit_F16C);
#endif
    const char *sc = getenv("KVD_CPU_SCALAR");
    if (sc && *sc == '1')
        cx->simd = false;
    const char *lc = getenv("KVD_CPU_LLAMACPP");
    cx->llamacpp = lc && *lc == '1';
    cx->scratch = calloc(n, sizeof *cx->scratch);
    cx->panel = calloc(n, sizeof *cx->panel);
    if (!cx->scratch || !cx->panel || cpu_pool_start(&cx->pool, n)) {
        free(cx->scratch);
        free(cx->panel);
        free(cx);
        return KVD_ENOMEM;
    }
    *out = cx;
    return 0;
}

static void cpu_ctx_free(struct compute_ctx *cx)
{
    if (!cx)
        return;
    uint32_t n = cx->pool.n;
    cpu_pool_stop(&cx->pool, n - 1);
    for (uint32_t i = 0; i < n; i++) {
        free(cx->scratch[i]);
        free(cx->panel[i]);
    }
    free(cx->scratch);
    free(cx->panel);
    free(cx->qact);
    sampler_scratch_free(&cx->sample_scratch);
    free(cx);
}

#define CPU_HUGE_PAGE ((size_t)2 << 20)

static int cpu_buf_alloc(struct compute_ctx *cx, size_t bytes, void **out)
{
    size_t n = (bytes + 63) / 64 * 64;
    if (n >= CPU_HUGE_PAGE) {
        /* the weights: every step streams them all, so on 4 KiB pages the
         * TLB misses as often as the caches do; transparent huge pages
         * (a hint, honoured where THP is "madvise" or "always") */
        n = (n + CPU_HUGE_PAGE - 1) / CPU_HUGE_PAGE * CPU_HUGE_PAGE;
        *out = aligned_alloc(CPU_HUGE_PAGE, n);
#ifdef MADV_HUGEPAGE
        if (*out)
            (void)madvise(*out, n, MADV_HUGEPAGE);
#endif
    } else {
        *out = aligned_alloc(64, n ? n : 64);
    }
    if (!*out)
        return KVD_ENOMEM;
    __atomic_add_fetch(&cx->dev_live, malloc_usable_size(*out), __ATOMIC_RELAXED);
    return 0;
}

static void cpu_buf_free(struct compute_ctx *cx, void *p)
{
    if (p)
        __atomic_sub_fetch(&cx->dev_live, malloc_usable_size(p), __ATOMIC_RELAXED);
    free(p);
}

static size_t cpu_dev_bytes(struct compute_ctx *cx)
{
    return __atomic_load_n(&cx->dev_live, __ATOMIC_RELAXED);
}

static int cpu_copy(struct compute_ctx *cx, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        memmove(dst, src, bytes);
    return 0;
}

static int cpu_sync(struct compute_ctx *cx)
{
    return 0;
}

/* ---- simple ops ---------------------------------------------------------- */

void cpu_row_to_f32(enum ctype t, const void *row, float *out, uint32_t n)
{
    switch (t) {
    case CT_F32:
        memcpy(out, row, (size_t)n * 4);
        break;
    case CT_F16:
        for (uint32_t i = 0; i < n; i++)
            out[i] = half_to_float(((const uint16_t *)row)[i]);
        break;
    case CT_BF16:
        for (uint32_t i = 0; i < n; i++)
            out[i] = bf16_to_float(((const uint16_t *)row)[i]);
        break;
    case CT_Q8_0:
        for (uint32_t b = 0; b < n / CT_Q8_0_BLOCK; b++) {
            const uint8_t *blk = (const uint8_t *)row + (size_t)b * CT_Q8_0_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            float d = half_to_float(dh);
            for (int i = 0; i < CT_Q8_0_BLOCK; i++)
                out[b * CT_Q8_0_BLOCK + i] = d * (float)(int8_t)blk[2 + i];
        }
        break;
    default:
        (void)quant_dequant_row(t, row, out, n);
        break;
    }
}

/* Every weight type of kv_types.h: f32/f16/bf16/q8_0 in compute_cpu_matmul.c,
 * the other quantized ones in compute_cpu_quant.c. */
static bool cpu_weight_type_ok(enum ctype t)
{
    return ctype_block_elems(t) != 0;
}

static int cpu_get_rows(struct compute_ctx *cx, const struct ctensor *w, const uint32_t *ids,
                        uint32_t n, float *out)
{
    for (uint32_t i = 0; i < n; i++)
        cpu_weight_row(w, ids[i], out + (size_t)i * w->ne0);
    return 0;
}

/* out = rmsnorm(x) * w for one row, after x += res when res is set. */
static void rmsnorm_row(float *x, const float *res, float *out, const float *w, uint32_t n,
                        float eps)
{
    /* as ggml: each square rounded to f32, summed in double (ggml_float);
     * squaring in double instead moves the scale by an ulp now and then,
     * which the Q8_K activations (f32 scale) of the next matmul pass on */
    double ss = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (res)
            x[i] += res[i];
        float sq = x[i] * x[i];
        ss += (double)sq;
    }
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

static int cpu_rmsnorm(struct compute_ctx *cx, float *out, const float *x, const float *w,
                       uint32_t rows, uint32_t n, float eps)
{
    /* x is only written when res is set */
    for (uint32_t r = 0; r < rows; r++)
        rmsnorm_row((float *)x + (size_t)r * n, NULL, out + (size_t)r * n, w, n, eps);
    return 0;
}

static int cpu_add_rmsnorm(struct compute_ctx *cx, float *x, const float *res, float *out,
                           const float *w, uint32_t rows, uint32_t n, float eps)
{
    for (uint32_t r = 0; r < rows; r++)
        rmsnorm_row(x + (size_t)r * n, res + (size_t)r * n, out + (size_t)r * n, w, n, eps);
    return 0;
}

static int cpu_add_bias(struct compute_ctx *cx, float *y, const float *b, uint32_t rows, uint32_t n)
{
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t i = 0; i < n; i++)
            y[(size_t)r * n + i] += b[i];
    return 0;
}

static int cpu_rope(struct compute_ctx *cx, float *x, uint32_t rows, uint32_t n_heads,
                    uint32_t head_dim, uint32_t n_rot, const uint32_t *pos, enum rope_mode mode,
                    float base, const float *ff)
{
    uint32_t half = n_rot / 2;
    if (cx->llamacpp) {
        cpu_rope_ggml(x, rows, n_heads, head_dim, n_rot, pos, mode, base, ff);
        return 0;
    }
    double freq[512]; /* base^(-2i/n_rot), once per call rather than per row */
    for (uint32_t i = 0; i < half && i < 512; i++)
        freq[i] = pow((double)base, -2.0 * i / n_rot);
    for (uint32_t r = 0; r < rows; r++) {
        for (uint32_t i = 0; i < half; i++) {
            /* angle in double so every backend can hit the f32 result */
            double theta =
                (double)pos[r] * (i < 512 ? freq[i] : pow((double)base, -2.0 * i / n_rot));
            if (ff)
                theta /= ff[i];
            float c = (float)cos(theta), s = (float)sin(theta);
            for (uint32_t h = 0; h < n_heads; h++) {
                float *v = x + ((size_t)r * n_heads + h) * head_dim;
                uint32_t i0 = mode == ROPE_NEOX ? i : 2 * i,
                         i1 = mode == ROPE_NEOX ? i + half : 2 * i + 1;
                float a = v[i0], b = v[i1];
                v[i0] = a * c - b * s;
                v[i1] = a * s + b * c;
            }
        }
    }
    return 0;
}

static int cpu_kv_write(struct compute_ctx *cx, void *arena, const struct kv_geom *g,
                        uint32_t layer, const float *k, const float *v, uint32_t n_tokens,
                        const uint32_t *tok_slot, const uint32_t *tok_pos)
{
    size_t rb = kv_row_bytes(g->dtype, g->head_dim), hd = g->head_dim, bt = g->block_tokens;
    size_t head_bytes = bt * rb; /* one [token] plane of rows */
    size_t block_bytes = (size_t)g->layers * 2 * g->kv_heads * head_bytes;
    for (uint32_t t = 0; t < n_tokens; t++) {
        if (tok_slot[t] == COMPUTE_PAD_SLOT)
            continue;
        uint8_t *blk = (uint8_t *)arena + (size_t)tok_slot[t] * block_bytes;
        size_t row = tok_pos[t] % bt;
        for (uint32_t h = 0; h < g->kv_heads; h++) {
            uint8_t *kd = blk + (((size_t)layer * 2 + 0) * g->kv_heads + h) * head_bytes + row * rb;
            uint8_t *vd = blk + (((size_t)layer * 2 + 1) * g->kv_heads + h) * head_bytes + row * rb;
            cpu_kv_store_row(kd, g->dtype, k + ((size_t)t * g->kv_heads + h) * hd, (uint32_t)hd,
                             cx->simd);
            cpu_kv_store_row(vd, g->dtype, v + ((size_t)t * g->kv_heads + h) * hd, (uint32_t)hd,
                             cx->simd);
        }
    }
    return 0;
}

/* SiLU's e^x, with the arithmetic of ggml's vectorized expf as its x86
 * builds with AVX-512 run it (ggml_v_expf, from ARM's optimized routines):
 * n = round(x log2 e) by the 1.5 * 2^23 shift, b = x - n ln2 with ln2 in two
 * parts (two FMAs), e^b = 1 + b P(b) with P of degree 5 evaluated as
 * (c5 b + c4) b^2 + (c3 b + c2), times b^2, plus (c1 b + 1), each step one
 * FMA, and then times 2^n with one rounding. The SwiGLU output feeds the
 * next matmul's activation quantization (Q8_K keeps an f32 scale), where an
 * ulp of difference flips roundings, so this is ggml's arithmetic bit for
 * bit rather than a more accurate exp. (ggml's AVX2-only build evaluates
 * the polynomial without the 1 and adds it in a last FMA with 2^n, which
 * differs in ~11% of values.) |n| > 192: infinity (n > 0) or 0. */
#define SILU_SHIFT 0x1.8p23f
#define SILU_LOG2E 0x1.715476p+0f
#define SILU_LN2_HI 0x1.62e4p-1f
#define SILU_LN2_LO 0x1.7f7d1cp-20f
#define SILU_C1 0x1.ffffecp-1f
#define SILU_C2 0x1.fffdb6p-2f
#define SILU_C3 0x1.555e66p-3f
#define SILU_C4 0x1.573e2ep-5f
#define SILU_C5 0x1.0e4020p-7f

static float pow2i(int e) /* 2^e for -126 <= e <= 127 */
{
    uint32_t b = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static float silu_exp(float x)
{
    float z = fmaf(x, SILU_LOG2E, SILU_SHIFT);
    float n = z - SILU_SHIFT;
    float b = fmaf(-n, SILU_LN2_LO, fmaf(-n, SILU_LN2_HI, x));
    float u = b * b;
    float p = fmaf(fmaf(fmaf(SILU_C5, b, SILU_C4), u, fmaf(SILU_C3, b, SILU_C2)), u,
                   fmaf(SILU_C1, b, 1.0f));
    if (isnan(n))
        return p;
    if (fabsf(n) > 192.0f)
        return n > 0 ? INFINITY : 0.0f;
    /* 2^n in two factors (each a normal float for |n| <= 192): p * 2^n1 is
     * exact, so the product is p * 2^n rounded once, subnormal or not */
    int ni = (int)n, n1 = ni / 2;
    return p * pow2i(n1) * pow2i(ni - n1);
}

static float silu_mul1(float g, float u)
{
    return g / (1.0f + silu_exp(0.0f - g)) * u;
}

#if defined(__x86_64__)
/* silu_exp for 8 floats, the same operations in the same order */
__attribute__((target("avx2,fma"))) static __m256 silu_exp8(__m256 x)
{
    const __m256 shift = _mm256_set1_ps(SILU_SHIFT), lim = _mm256_set1_ps(192.0f);
    __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(SILU_LOG2E), shift);
    __m256 n = _mm256_sub_ps(z, shift);
    __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(SILU_LN2_LO),
                                _mm256_fnmadd_ps(n, _mm256_set1_ps(SILU_LN2_HI), x));
    __m256 u = _mm256_mul_ps(b, b);
    __m256 hi = _mm256_fmadd_ps(_mm256_set1_ps(SILU_C5), b, _mm256_set1_ps(SILU_C4));
    __m256 lo = _mm256_fmadd_ps(_mm256_set1_ps(SILU_C3), b, _mm256_set1_ps(SILU_C2));
    __m256 p = _mm256_fmadd_ps(_mm256_fmadd_ps(hi, u, lo), u,
                               _mm256_fmadd_ps(_mm256_set1_ps(SILU_C1), b, _mm256_set1_ps(1.0f)));
    /* n clamped for the integer part (a NaN n becomes 192; p is NaN then) */
    __m256i ni = _mm256_cvtps_epi32(
        _mm256_max_ps(_mm256_min_ps(n, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim)));
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1),
            bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 r = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    __m256 absn = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
    __m256 big = _mm256_cmp_ps(absn, lim, _CMP_GT_OQ);
    __m256 alt =
        _mm256_and_ps(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(INFINITY));
    return _mm256_blendv_ps(r, alt, big);
}

__attribute__((target("avx2,fma"))) static void silu_mul_simd(float *g, const float *u, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = silu_exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 y = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        g[i] = silu_mul1(g[i], u[i]);
}
#endif

static int cpu_silu_mul(struct compute_ctx *cx, float *g, const float *u, size_t n)
{
#if defined(__x86_64__)
    if (cx->simd) {
        silu_mul_simd(g, u, n);
        return 0;
    }
#endif
    for (size_t i = 0; i < n; i++)
        g[i] = silu_mul1(g[i], u[i]);
    return 0;
}

static int cpu_add(struct compute_ctx *cx, float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
    return 0;
}

static int cpu_gather_rows(struct compute_ctx *cx, float *out, const float *x, const uint32_t *rows,
                           uint32_t n, uint32_t width)
{
    for (uint32_t i = 0; i < n; i++)
        memcpy(out + (size_t)i * width, x + (size_t)rows[i] * width, (size_t)width * 4);
    return 0;
}

static int cpu_sample(struct compute_ctx *cx, const float *logits, uint32_t rows, uint32_t vocab,
                      const struct sample_row *p, uint32_t *out)
{
    for (uint32_t r = 0; r < rows; r++) {
        int rc =
            sampler_pick(&p[r], &cx->sample_scratch, logits + (size_t)r * vocab, vocab, &out[r]);
        if (rc)
            return rc;
    }
    return 0;
}

static const struct compute_ops cpu_ops = {
    .name = "cpu",
    .ctx_new = cpu_ctx_new,
    .ctx_free = cpu_ctx_free,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .dev_bytes = cpu_dev_bytes,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .weight_bytes = cpu_weight_bytes,
    .weight_upload = cpu_weight_upload,
    .weight_type_ok = cpu_weight_type_ok,
    .get_rows = cpu_get_rows,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .matmul = cpu_matmul,
    .add_bias = cpu_add_bias,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .sample = cpu_sample,
};

const struct compute_ops *compute_cpu_ops(void)
{
    return &cpu_ops;
}

/* llama.cpp's cpu arithmetic for attention and RoPE, which the cpu backend
 * runs instead of its own with KVD_CPU_LLAMACPP=1 (compute_cpu.c): the
 * operations of ggml's flash attention (one query row at a time, an f16 KV
 * cache) and of its RoPE as the x86 AVX-512 builds that node-llama-cpp
 * loads compile them, bit for bit on the AVX2 and the portable path. kvd's
 * own attention (f32 throughout) and RoPE (angles in double) are more
 * precise; this exists so kvd's tokens can equal llama.cpp's exactly
 * (docs/quant.md). */
#include <math.h>

#include "compute_cpu_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define GSIMD __attribute__((target("avx2,fma,f16c")))
#endif

static inline float round_f16(float x)
{
    return half_to_float(float_to_half(x));
}

/* ---- RoPE ------------------------------------------------------------------ */

/* ggml_compute_forward_rope_flt: per row theta starts at the position as an
 * f32 and is multiplied by powf(base, -2/n_rot) after each pair (an f32
 * recurrence); a pair's angle is theta / its freq factor, then cosf, sinf;
 * the rotation is fused as GCC contracts it there, in both modes
 * a' = fma(a, c, -(b s)), b' = fma(a, s, b c). */
void cpu_rope_ggml(float *x, uint32_t rows, uint32_t n_heads, uint32_t head_dim, uint32_t n_rot,
                   const uint32_t *pos, enum rope_mode mode, float base, const float *ff)
{
    uint32_t half = n_rot / 2;
    float ts = powf(base, -2.0f / (float)n_rot), cs[1024];
    for (uint32_t r = 0; r < rows; r++) {
        float theta = (float)pos[r];
        for (uint32_t i = 0; i < half; i++) {
            float t = ff ? theta / ff[i] : theta;
            cs[2 * i] = cosf(t);
            cs[2 * i + 1] = sinf(t);
            theta *= ts;
        }
        for (uint32_t h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)r * n_heads + h) * head_dim;
            for (uint32_t i = 0; i < half; i++) {
                uint32_t i0 = mode == ROPE_NEOX ? i : 2 * i,
                         i1 = mode == ROPE_NEOX ? i + half : i0 + 1;
                float a = v[i0], b = v[i1], c = cs[2 * i], sn = cs[2 * i + 1];
                v[i0] = fmaf(a, c, -(b * sn));
                v[i1] = fmaf(a, sn, b * c);
            }
        }
    }
}

/* ---- flash attention ------------------------------------------------------- */

bool cpu_attn_ggml_dtype(enum kv_dtype dt)
{
    return dt == KV_F16 || dt == KV_F32; /* llama.cpp casts an f32 cache to f16 first */
}

size_t cpu_attn_ggml_scratch(const struct attn_desc *d)
{
    uint32_t hd = d->geom->head_dim;
    return (size_t)(d->n_head / d->geom->kv_heads) * (d->max_kv + hd) + 2 * (size_t)hd;
}

/* ggml_vec_dot_f16 of a K row (f16, or f32 rounded to f16) and q (f16
 * values) as the AVX-512 builds run it: 64 f32 lanes, lane l taking
 * elements 64t + l by FMA; reduced (0+32, 16+48, then the two; then l + 8,
 * l + 4, l + 2, l + 1 of the 16) and converted to double; the n % 64
 * elements after them each added in double as an exact f32 product; the
 * sum rounded to f32 once. */
static float dot_f16_c(const void *k, enum kv_dtype dt, const float *q, uint32_t n)
{
    uint32_t np = n / 64 * 64;
    double sum = 0;
    float kv[64];
    if (np) {
        float a[64] = {0};
        for (uint32_t i = 0; i < np; i += 64) {
            for (int l = 0; l < 64; l++)
                kv[l] = dt == KV_F16 ? half_to_float(((const uint16_t *)k)[i + l])
                                     : round_f16(((const float *)k)[i + l]);
            for (int l = 0; l < 64; l++)
                a[l] = fmaf(kv[l], q[i + l], a[l]);
        }
        float b[16], c[8], e[4];
        for (int l = 0; l < 16; l++)
            b[l] = (a[l] + a[l + 32]) + (a[l + 16] + a[l + 48]);
        for (int l = 0; l < 8; l++)
            c[l] = b[l] + b[l + 8];
        for (int l = 0; l < 4; l++)
            e[l] = c[l] + c[l + 4];
        sum = (double)((e[0] + e[2]) + (e[1] + e[3]));
    }
    for (uint32_t i = np; i < n; i++) {
        float kk = dt == KV_F16 ? half_to_float(((const uint16_t *)k)[i])
                                : round_f16(((const float *)k)[i]);
        sum += (double)(kk * q[i]);
    }
    return (float)sum;
}

/* The f16 sums: acc = f16(acc x ms) (a new maximum) */
static void acc_scale_c(float *acc, float ms, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        acc[i] = round_f16(acc[i] * ms);
}

/* acc = f16(fma(v, vs, acc)) */
static void acc_mad_c(float *acc, const void *v, enum kv_dtype dt, float vs, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        float x = dt == KV_F16 ? half_to_float(((const uint16_t *)v)[i])
                               : round_f16(((const float *)v)[i]);
        acc[i] = round_f16(fmaf(x, vs, acc[i]));
    }
}

#if defined(__x86_64__)
static inline GSIMD __m256 load8_f16(const void *p, enum kv_dtype dt, size_t i)
{
    if (dt == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_cvtph_ps(
        _mm256_cvtps_ph(_mm256_loadu_ps((const float *)p + i), _MM_FROUND_TO_NEAREST_INT));
}

static inline GSIMD __m256 rnd8_f16(__m256 x)
{
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

/* dot_f16_c's arithmetic: the 64 lanes as 8 registers (lanes 8j..8j+7). */
static GSIMD float dot_f16_avx2(const void *k, enum kv_dtype dt, const float *q, uint32_t n)
{
    uint32_t np = n / 64 * 64;
    double sum = 0;
    if (np) {
        __m256 a[8];
        for (int j = 0; j < 8; j++)
            a[j] = _mm256_setzero_ps();
        for (uint32_t i = 0; i < np; i += 64)
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_fmadd_ps(load8_f16(k, dt, i + 8 * j), _mm256_loadu_ps(q + i + 8 * j),
                                       a[j]);
        /* lanes l and l+8 of a 16-lane register are a[2m] and a[2m+1] */
        __m256 b0 = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
        __m256 b1 = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
        __m256 c = _mm256_add_ps(b0, b1);
        __m128 e = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
        __m128 f = _mm_add_ps(e, _mm_movehl_ps(e, e));
        sum = (double)_mm_cvtss_f32(_mm_add_ss(f, _mm_movehdup_ps(f)));
    }
    if (np < n) {
        float pr[64];
        for (uint32_t i = np; i + 8 <= n; i += 8)
            _mm256_storeu_ps(pr + i - np,
                             _mm256_mul_ps(load8_f16(k, dt, i), _mm256_loadu_ps(q + i)));
        for (uint32_t i = np + (n - np) / 8 * 8; i < n; i++)
            pr[i - np] = (dt == KV_F16 ? half_to_float(((const uint16_t *)k)[i])
                                       : round_f16(((const float *)k)[i])) *
                         q[i];
        for (uint32_t i = 0; i < n - np; i++)
            sum += (double)pr[i];
    }
    return (float)sum;
}

static GSIMD void acc_scale_avx2(float *acc, float ms, uint32_t n)
{
    __m256 m = _mm256_set1_ps(ms);
    for (uint32_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(acc + i, rnd8_f16(_mm256_mul_ps(_mm256_loadu_ps(acc + i), m)));
}

static GSIMD void acc_mad_avx2(float *acc, const void *v, enum kv_dtype dt, float vs, uint32_t n)
{
    __m256 s = _mm256_set1_ps(vs);
    for (uint32_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(
            acc + i, rnd8_f16(_mm256_fmadd_ps(load8_f16(v, dt, i), s, _mm256_loadu_ps(acc + i))));
}
#endif

/* ggml_compute_forward_flash_attn_ext_f16_one_chunk for query row t
 * (sequence s) and the n_rep query heads of kv head gh: q rounded to f16;
 * per position in order, the score (dot x scale); an online softmax: a new
 * maximum M rescales the f16 sums by ms = expf(Mold - M), otherwise
 * vs = expf(s - M); the V row is added times vs into f16 sums, each
 * rounded to f16 after its FMA; S = S ms + vs (not fused); at the end the
 * sums times 1/S. scratch: cpu_attn_ggml_scratch floats. */
void cpu_attn_ggml(const struct attn_desc *d, bool simd, uint32_t s, uint32_t t, uint32_t gh,
                   float *scratch)
{
    const struct kv_geom *g = d->geom;
    enum kv_dtype dt = g->dtype;
    uint32_t kvh = g->kv_heads, hd = g->head_dim, bt = g->block_tokens, n_rep = d->n_head / kvh;
    uint32_t p = d->h_seq_pos0[s] + (t - d->h_seq_qstart[s]), n_kv = p + 1;
    size_t rb = kv_row_bytes(dt, hd), head_bytes = (size_t)bt * rb;
    size_t block_bytes = (size_t)g->layers * 2 * kvh * head_bytes;
    size_t k_off = ((size_t)d->layer * 2 * kvh + gh) * head_bytes;
    size_t v_off = k_off + (size_t)kvh * head_bytes;
    const uint32_t *slots = d->slots + d->seq_slot0[s];
    float *sc = scratch, *qh = sc + (size_t)n_rep * n_kv, *acc = qh + (size_t)n_rep * hd;
#if defined(__x86_64__)
    simd = simd && hd % 8 == 0;
#else
    simd = false;
#endif
    for (uint32_t r = 0; r < n_rep; r++) {
        const float *q = d->q + ((size_t)t * d->n_head + (size_t)gh * n_rep + r) * hd;
        for (uint32_t i = 0; i < hd; i++)
            qh[(size_t)r * hd + i] = round_f16(q[i]);
    }
    for (uint32_t pj = 0; pj < n_kv; pj++) {
        const uint8_t *kr =
            (const uint8_t *)d->arena + (size_t)slots[pj / bt] * block_bytes + k_off + pj % bt * rb;
        for (uint32_t r = 0; r < n_rep; r++) {
            float dot;
#if defined(__x86_64__)
            if (simd)
                dot = dot_f16_avx2(kr, dt, qh + (size_t)r * hd, hd);
            else
#endif
                dot = dot_f16_c(kr, dt, qh + (size_t)r * hd, hd);
            sc[(size_t)r * n_kv + pj] = dot * d->scale + 0.0f; /* + the mask's 0 */
        }
    }
    for (uint32_t r = 0; r < n_rep; r++) {
        const float *sr = sc + (size_t)r * n_kv;
        float M = -INFINITY, S = 0;
        for (uint32_t i = 0; i < hd; i++)
            acc[i] = 0;
        for (uint32_t pj = 0; pj < n_kv; pj++) {
            float sj = sr[pj], ms = 1.0f, vs = 1.0f;
            if (sj > M) {
                float Mold = M;
                M = sj;
                ms = expf(Mold - M);
#if defined(__x86_64__)
                if (simd)
                    acc_scale_avx2(acc, ms, hd);
                else
#endif
                    acc_scale_c(acc, ms, hd);
            } else {
                vs = expf(sj - M);
            }
            const uint8_t *vr = (const uint8_t *)d->arena + (size_t)slots[pj / bt] * block_bytes +
                                v_off + pj % bt * rb;
#if defined(__x86_64__)
            if (simd)
                acc_mad_avx2(acc, vr, dt, vs, hd);
            else
#endif
                acc_mad_c(acc, vr, dt, vs, hd);
            S = S * ms;
            S = S + vs;
        }
        float inv = S == 0.0f ? 0.0f : 1.0f / S;
        float *out = d->out + ((size_t)t * d->n_head + (size_t)gh * n_rep + r) * hd;
        for (uint32_t i = 0; i < hd; i++)
            out[i] = acc[i] * inv;
    }
}

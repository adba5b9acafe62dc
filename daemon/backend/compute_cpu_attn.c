/* cpu paged attention: for every (query row, kv head) pair, scores against
 * the sequence's K rows read block by block from the arena, a max-subtracted
 * f32 softmax, and the weighted sum of V rows. The query heads sharing a kv
 * head (GQA) are done together so each K/V row is read once per group. */
#include <math.h>
#include <stdlib.h>

#include "compute_cpu_impl.h"
#include "compute_cpu_kv.h"
#include "kvd/status.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define SIMD_TARGET __attribute__((target("avx2,fma,f16c")))

static inline SIMD_TARGET __m256 kv_load8(const void *p, enum kv_dtype dt, size_t i)
{
    if (dt == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dt == KV_BF16) {
        __m256i v =
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* 4-way horizontal sum: lane i of the result = sum of a[i]'s 8 lanes. */
static inline SIMD_TARGET __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* out[i] = dot(K row i, q) for 4 K rows rk bytes apart: 4 FMA chains, one
 * q load per 4 K loads, one reduction for the 4. n % 8 == 0. */
static SIMD_TARGET void kdot4_simd(const uint8_t *k, size_t rk, enum kv_dtype dt, const float *q,
                                   uint32_t n, float *out)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (uint32_t i = 0; i < n; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(kv_load8(k, dt, i), qv, a0);
        a1 = _mm256_fmadd_ps(kv_load8(k + rk, dt, i), qv, a1);
        a2 = _mm256_fmadd_ps(kv_load8(k + 2 * rk, dt, i), qv, a2);
        a3 = _mm256_fmadd_ps(kv_load8(k + 3 * rk, dt, i), qv, a3);
    }
    _mm_storeu_ps(out, hsum4(a0, a1, a2, a3));
}

static SIMD_TARGET float kdot_simd(const void *k, enum kv_dtype dt, const float *q, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(kv_load8(k, dt, i), _mm256_loadu_ps(q + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++)
        r += cpu_kv_load(k, dt, i) * q[i];
    return r;
}

/* out[0..64) += sum over rows i < n of p[i] * V row i (64 values at v, rows
 * rv bytes apart): the 64 sums stay in 8 registers over all rows. */
static SIMD_TARGET void vsum64_simd(float *out, const float *p, const uint8_t *v, size_t rv,
                                    enum kv_dtype dt, uint32_t n)
{
    __m256 a[8];
    for (int c = 0; c < 8; c++)
        a[c] = _mm256_loadu_ps(out + 8 * c);
    for (uint32_t i = 0; i < n; i++) {
        __m256 pv = _mm256_broadcast_ss(p + i);
        for (int c = 0; c < 8; c++)
            a[c] = _mm256_fmadd_ps(pv, kv_load8(v + i * rv, dt, 8 * c), a[c]);
    }
    for (int c = 0; c < 8; c++)
        _mm256_storeu_ps(out + 8 * c, a[c]);
}

static SIMD_TARGET void vaxpy_simd(float *out, float a, const void *v, enum kv_dtype dt, uint32_t n)
{
    __m256 av = _mm256_set1_ps(a);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_fmadd_ps(av, kv_load8(v, dt, i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++)
        out[i] += a * cpu_kv_load(v, dt, i);
}
#endif

static float kdot(bool simd, const void *k, enum kv_dtype dt, const float *q, uint32_t n)
{
#if defined(__x86_64__)
    if (simd)
        return kdot_simd(k, dt, q, n);
#endif
    float r = 0;
    for (uint32_t i = 0; i < n; i++)
        r += cpu_kv_load(k, dt, i) * q[i];
    return r;
}

static void vaxpy(bool simd, float *out, float a, const void *v, enum kv_dtype dt, uint32_t n)
{
#if defined(__x86_64__)
    if (simd) {
        vaxpy_simd(out, a, v, dt, n);
        return;
    }
#endif
    for (uint32_t i = 0; i < n; i++)
        out[i] += a * cpu_kv_load(v, dt, i);
}

struct attn_job {
    const struct attn_desc *d;
    struct compute_ctx *cx;
    atomic_uint next;
    uint32_t n_units; /* rows in a sequence * kv_heads (padding rows after them get nothing) */
};

static void attn_unit(struct attn_job *j, uint32_t unit, float *sc)
{
    const struct attn_desc *d = j->d;
    const struct kv_geom *g = d->geom;
    uint32_t kvh = g->kv_heads, hd = g->head_dim, bt = g->block_tokens;
    uint32_t t = unit / kvh, gh = unit % kvh, n_rep = d->n_head / kvh;
    /* the sequence of row t: last s with qstart[s] <= t */
    uint32_t lo = 0, hi = d->n_seqs;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (d->h_seq_qstart[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    uint32_t s = lo, p = d->h_seq_pos0[s] + (t - d->h_seq_qstart[s]), n_kv = p + 1;
    if (j->cx->llamacpp && cpu_attn_ggml_dtype(g->dtype)) {
        cpu_attn_ggml(d, j->cx->simd, s, t, gh, sc);
        return;
    }
    size_t rb = kv_row_bytes(g->dtype, hd), head_bytes = (size_t)bt * rb;
    size_t block_bytes = (size_t)g->layers * 2 * kvh * head_bytes;
    size_t k_off = ((size_t)d->layer * 2 * kvh + gh) * head_bytes;
    size_t v_off = k_off + (size_t)kvh * head_bytes;
    const uint32_t *slots = d->slots + d->seq_slot0[s];
    const float *q = d->q + ((size_t)t * d->n_head + (size_t)gh * n_rep) * hd;
    float *out = d->out + ((size_t)t * d->n_head + (size_t)gh * n_rep) * hd;
    bool simd = j->cx->simd;
    /* Quantized rows (q8_0, fp8) are widened a block at a time into rowbuf
     * (after the scores in the worker's scratch), then read as f32 rows. */
    bool quant = g->dtype == KV_Q8_0 || g->dtype == KV_FP8;
    enum kv_dtype dt = quant ? KV_F32 : g->dtype;
    size_t esz = quant ? 4 : kv_dtype_size(g->dtype);
    float *rowbuf = sc + (size_t)n_rep * d->max_kv;

    /* scores: sc[r][0..n_kv) for the n_rep query heads of this group */
    size_t rk = (size_t)hd * esz; /* bytes between the K (or V) rows read */
    for (uint32_t p0 = 0; p0 < n_kv; p0 += bt) {
        const uint8_t *kb =
            (const uint8_t *)d->arena + (size_t)slots[p0 / bt] * block_bytes + k_off;
        uint32_t n = n_kv - p0 < bt ? n_kv - p0 : bt, i = 0;
        if (quant) {
            for (uint32_t r = 0; r < n; r++)
                cpu_kv_load_row(kb + (size_t)r * rb, g->dtype, hd, rowbuf + (size_t)r * hd, simd);
            kb = (const uint8_t *)rowbuf;
        }
        /* blocks are scattered, so the hardware prefetcher restarts at each:
         * ask for the next block's K rows and this block's V rows (read
         * after the softmax) now */
        if (p0 + bt < n_kv) {
            uint32_t nn = n_kv - p0 - bt < bt ? n_kv - p0 - bt : bt;
            const char *nk =
                (const char *)d->arena + (size_t)slots[p0 / bt + 1] * block_bytes + k_off;
            for (size_t off = 0; off < nn * rb; off += 64)
                __builtin_prefetch(nk + off, 0, 3);
        }
        for (size_t off = 0; off < n * rb; off += 64)
            __builtin_prefetch(
                (const char *)d->arena + (size_t)slots[p0 / bt] * block_bytes + v_off + off, 0, 2);
#if defined(__x86_64__)
        if (simd && hd % 8 == 0)
            for (; i + 4 <= n; i += 4)
                for (uint32_t r = 0; r < n_rep; r++) {
                    float *o = sc + (size_t)r * n_kv + p0 + i;
                    kdot4_simd(kb + i * rk, rk, dt, q + (size_t)r * hd, hd, o);
                    for (int u = 0; u < 4; u++)
                        o[u] *= d->scale;
                }
#endif
        for (; i < n; i++)
            for (uint32_t r = 0; r < n_rep; r++)
                sc[(size_t)r * n_kv + p0 + i] =
                    d->scale * kdot(simd, kb + (size_t)i * rk, dt, q + (size_t)r * hd, hd);
    }
    for (uint32_t r = 0; r < n_rep; r++) {
        float *sr = sc + (size_t)r * n_kv, m = -INFINITY, sum = 0;
        for (uint32_t i = 0; i < n_kv; i++)
            m = sr[i] > m ? sr[i] : m;
        for (uint32_t i = 0; i < n_kv; i++) {
            sr[i] = expf(sr[i] - m);
            sum += sr[i];
        }
        float inv = 1.0f / sum;
        for (uint32_t i = 0; i < n_kv; i++)
            sr[i] *= inv;
        memset(out + (size_t)r * hd, 0, (size_t)hd * 4);
    }
    /* weighted sum of V: 64 output values at a time kept in registers over
     * a whole block of rows; what is left of hd row by row */
    uint32_t hd64 = 0;
#if defined(__x86_64__)
    if (simd)
        hd64 = hd / 64 * 64;
#endif
    for (uint32_t p0 = 0; p0 < n_kv; p0 += bt) {
        const uint8_t *vb =
            (const uint8_t *)d->arena + (size_t)slots[p0 / bt] * block_bytes + v_off;
        uint32_t n = n_kv - p0 < bt ? n_kv - p0 : bt;
        if (quant) {
            for (uint32_t r = 0; r < n; r++)
                cpu_kv_load_row(vb + (size_t)r * rb, g->dtype, hd, rowbuf + (size_t)r * hd, simd);
            vb = (const uint8_t *)rowbuf;
        }
        for (uint32_t r = 0; r < n_rep; r++) {
            const float *pr = sc + (size_t)r * n_kv + p0;
            float *o = out + (size_t)r * hd;
#if defined(__x86_64__)
            for (uint32_t c = 0; c < hd64; c += 64)
                vsum64_simd(o + c, pr, vb + (size_t)c * esz, rk, dt, n);
#endif
            if (hd64 < hd)
                for (uint32_t i = 0; i < n; i++)
                    vaxpy(simd, o + hd64, pr[i], vb + i * rk + (size_t)hd64 * esz, dt, hd - hd64);
        }
    }
}

static void attn_task(void *arg, uint32_t ith, uint32_t nth)
{
    struct attn_job *j = arg;
    float *sc = j->cx->scratch[ith];
    for (;;) {
        uint32_t u = atomic_fetch_add(&j->next, 1);
        if (u >= j->n_units)
            break;
        attn_unit(j, u, sc);
    }
}

int cpu_attention(struct compute_ctx *cx, const struct attn_desc *d)
{
    struct attn_job j = {
        .d = d, .cx = cx, .n_units = d->h_seq_qstart[d->n_seqs] * d->geom->kv_heads};
    const struct kv_geom *g = d->geom;
    size_t need = (size_t)(d->n_head / g->kv_heads) * d->max_kv;
    if (cx->llamacpp && cpu_attn_ggml_dtype(g->dtype) && need < cpu_attn_ggml_scratch(d))
        need = cpu_attn_ggml_scratch(d);
    if (g->dtype == KV_Q8_0 || g->dtype == KV_FP8) /* a block's rows, widened */
        need += (size_t)g->block_tokens * g->head_dim;
    if (need > cx->scratch_cap) {
        for (uint32_t i = 0; i < cx->pool.n; i++) {
            float *p = realloc(cx->scratch[i], need * sizeof(float));
            if (!p)
                return KVD_ENOMEM;
            cx->scratch[i] = p;
        }
        cx->scratch_cap = need;
    }
    atomic_init(&j.next, 0);
    cpu_pool_run(&cx->pool, attn_task, &j);
    return 0;
}

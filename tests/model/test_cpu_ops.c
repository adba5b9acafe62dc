/* The cpu backend's element-wise ops against double-precision formulas, with
 * the AVX2 kernels and with the portable ones (KVD_CPU_SCALAR=1): SiLU's
 * vectorized exp over the whole float range, and the matmul on hand-built
 * (row-major) and packed weights of every type; and the paged attention
 * over KV blocks of every dtype (q8_0 and fp8 widened on the fly). */
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "compute.h"
#include "op_cases.h"
#include "model/model_ref.h"
#include "quant.h"
#include "test_scratch.h"

/* Releases of what the tests make on the cpu backend (test_scratch.h). */
static void ctx_free_cb(void *o, void *cx)
{
    ((const struct compute_ops *)o)->ctx_free(cx);
}

static void buf_free_cb(void *cx, void *buf)
{
    ref_cpu_backend()->compute->buf_free(cx, buf);
}

/* A compute context, released by ts_free or the teardown. */
static struct compute_ctx *ctx(void **tst, const struct compute_ops *o)
{
    struct compute_ctx *cx = NULL;
    struct compute_conf conf = {.n_threads = 2};
    assert_int_equal(o->ctx_new(ref_cpu_backend(), &conf, &cx), 0);
    return ts_defer(tst, cx, ctx_free_cb, (void *)o);
}

static void silu_range(void **tst)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    struct compute_ctx *cx = ctx(tst, o);
    enum { N = 20011 };
    float *g = ts_malloc(tst, N * 4), *u = ts_malloc(tst, N * 4), *x = ts_malloc(tst, N * 4);
    for (int i = 0; i < N; i++) {
        x[i] = -100.0f + 200.0f * i / (N - 1); /* every exponent the kernel clamps or reaches */
        u[i] = i % 3 ? 1.0f : -0.5f;
    }
    x[7] = 0.0f, x[8] = -0.0f, x[9] = 1e-30f, x[10] = -87.5f, x[11] = 88.5f, x[12] = NAN;
    x[13] = INFINITY;
    memcpy(g, x, N * 4);
    assert_int_equal(o->silu_mul(cx, g, u, N), 0);
    for (int i = 0; i < N; i++) {
        if (isnan(x[i])) {
            assert_true(isnan(g[i]));
            continue;
        }
        double want = (double)x[i] / (1.0 + exp(-(double)x[i])) * u[i];
        double err = fabs(g[i] - want);
        if (g[i] != want && !(err <= 4e-7 * fabs(want) + 1e-30))
            fail_msg("silu(%.9g) = %.9g, want %.9g", (double)x[i], (double)g[i], want);
    }
    ts_free(tst, g), ts_free(tst, u), ts_free(tst, x);
    ts_free(tst, cx);
}

static void t_silu(void **s)
{
    silu_range(s);
    setenv("KVD_CPU_SCALAR", "1", 1);
    silu_range(s);
    unsetenv("KVD_CPU_SCALAR");
}

typedef void (*ggml_swiglu_fn)(int n, float *y, const float *x, const float *g);

/* The AVX2 and portable SiLU give the same bits on random gates of several
 * spreads and on the edges, and, where llama.cpp's AVX-512 cpu library is
 * installed (node-llama-cpp, KVD_NODE_LLAMA_CPP_DIR) and this cpu runs it,
 * the same bits as its ggml_vec_swiglu_f32. */
static void t_silu_bits(void **tst)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    enum { N = 1 << 18 };
    float *x = ts_malloc(tst, N * 4), *u = ts_malloc(tst, N * 4);
    float *a = ts_malloc(tst, N * 4), *b = ts_malloc(tst, N * 4);
    uint64_t st = 7;
    for (int i = 0; i < N; i++) {
        st = st * 6364136223846793005ULL + 1442695040888963407ULL;
        float r = (float)((int32_t)(st >> 32)) * 0x1p-31f;
        x[i] = r * (i % 3 == 0 ? 100.0f : i % 3 == 1 ? 8.0f : 1.0f);
        u[i] = (float)((int32_t)(st & 0xffffffff)) * 0x1p-31f;
    }
    x[0] = 0.0f, x[1] = -0.0f, x[2] = NAN, x[3] = INFINITY, x[4] = 87.4f, x[5] = -104.0f;
    struct compute_ctx *cx = ctx(tst, o);
    memcpy(a, x, N * 4);
    assert_int_equal(o->silu_mul(cx, a, u, N), 0);
    ts_free(tst, cx);
    setenv("KVD_CPU_SCALAR", "1", 1);
    cx = ctx(tst, o);
    memcpy(b, x, N * 4);
    assert_int_equal(o->silu_mul(cx, b, u, N), 0);
    ts_free(tst, cx);
    unsetenv("KVD_CPU_SCALAR");
    for (int i = 0; i < N; i++)
        if (memcmp(&a[i], &b[i], 4) && !(isnan(a[i]) && isnan(b[i])))
            fail_msg("silu(%a): avx2 %a, portable %a", (double)x[i], (double)a[i], (double)b[i]);
#if defined(__x86_64__)
    const char *dir = getenv("KVD_NODE_LLAMA_CPP_DIR");
    char path[1024];
    __builtin_cpu_init();
    if (dir && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        snprintf(path, sizeof path,
                 "%s/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/libggml-cpu-skylakex.so",
                 dir);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        ggml_swiglu_fn f = h ? (ggml_swiglu_fn)dlsym(h, "ggml_vec_swiglu_f32") : NULL;
        if (f) {
            long diff = 0;
            f(N, b, x, u);
            for (int i = 0; i < N; i++)
                diff += memcmp(&a[i], &b[i], 4) != 0 && !(isnan(a[i]) && isnan(b[i]));
            print_message("  silu_mul against ggml_vec_swiglu_f32 (%s): %ld of %d differ\n", path,
                          diff, N);
            assert_int_equal(diff, 0);
        }
        if (h)
            dlclose(h);
    }
#endif
    ts_free(tst, x), ts_free(tst, u), ts_free(tst, a), ts_free(tst, b);
}

static uint16_t to_half(float f) /* round to nearest even, normal range only (|f| <= 1 here) */
{
    uint32_t b;
    memcpy(&b, &f, 4);
    uint32_t sign = (b >> 16) & 0x8000, e = (b >> 23) & 0xff;
    if (e < 103)
        return (uint16_t)sign;
    uint32_t m = (b & 0x7fffff) | 0x800000;
    int shift = 126 - (int)e; /* to a 10-bit mantissa at exponent e - 127 + 15 */
    if (e >= 113) {
        uint32_t r = b - 0x38000000u, h = r >> 13, rem = r & 0x1fff;
        if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
            h++;
        return (uint16_t)(sign | (h & 0x7fff));
    }
    uint32_t h = m >> shift; /* subnormal half */
    return (uint16_t)(sign | h);
}

static double half_val(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

/* W [out][in] of type t with values near w (returned in wd as stored). */
static void *make_weight(void **tst, enum ctype t, uint32_t in, uint32_t out, double *wd,
                         size_t *bytes)
{
    size_t rb = ctype_row_bytes(t, in);
    uint8_t *p = ts_calloc(tst, out, rb);
    for (uint32_t r = 0; r < out; r++)
        for (uint32_t k = 0; k < in; k++) {
            float v = (float)(((r * 131 + k * 71) % 200) - 100) / 100.0f;
            double *d = wd + (size_t)r * in + k;
            uint8_t *row = p + r * rb;
            switch (t) {
            case CT_F32:
                memcpy(row + k * 4, &v, 4), *d = v;
                break;
            case CT_F16: {
                uint16_t h = to_half(v);
                memcpy(row + k * 2, &h, 2), *d = half_val(h);
                break;
            }
            case CT_BF16: {
                uint32_t b;
                memcpy(&b, &v, 4);
                uint16_t h = (uint16_t)(b >> 16); /* truncation: exact for the check */
                uint32_t back = (uint32_t)h << 16;
                float f;
                memcpy(&f, &back, 4);
                memcpy(row + k * 2, &h, 2), *d = f;
                break;
            }
            case CT_Q8_0: {
                uint8_t *blk = row + k / 32 * 34;
                uint16_t dh = to_half(1.0f / 64); /* scale 2^-6 */
                memcpy(blk, &dh, 2);
                int8_t q = (int8_t)(v * 64);
                blk[2 + k % 32] = (uint8_t)q, *d = q / 64.0;
                break;
            }
            default:
                break; /* not made here */
            }
        }
    *bytes = rb * out;
    return p;
}

/* One weight of type t (in x out), unpacked and packed, against rows of
 * activations for each count in rows_list. */
static void matmul_one(void **tst, const struct compute_ops *o, struct compute_ctx *cx,
                       enum ctype t, uint32_t in, uint32_t out, const uint32_t *rows_list,
                       size_t n_rows)
{
    double *wd = ts_malloc(tst, (size_t)in * out * 8);
    size_t bytes;
    void *src = make_weight(tst, t, in, out, wd, &bytes);
    for (int packed = 0; packed < 2; packed++) {
        struct ctensor w = {.type = t, .ne0 = in, .ne1 = out, .nbytes = bytes};
        size_t wb = packed ? o->weight_bytes(&w) : bytes;
        void *dev;
        assert_int_equal(o->buf_alloc(cx, wb, &dev), 0);
        ts_defer(tst, dev, buf_free_cb, cx);
        w.data = dev;
        if (packed)
            assert_int_equal(o->weight_upload(cx, &w, src), 0);
        else
            memcpy(dev, src, bytes);
        assert_int_equal(w.layout, packed && out >= 2 ? CL_PACK16 : CL_ROWS);
        for (size_t ri = 0; ri < n_rows; ri++) {
            uint32_t rows = rows_list[ri];
            float *x = ts_malloc(tst, (size_t)rows * in * 4),
                  *y = ts_malloc(tst, (size_t)rows * out * 4);
            for (size_t i = 0; i < (size_t)rows * in; i++)
                x[i] = (float)((int)(i * 37 % 101) - 50) / 50.0f;
            for (size_t i = 0; i < (size_t)rows * out; i++)
                y[i] = NAN; /* every output must be written */
            assert_int_equal(o->matmul(cx, &w, x, rows, y), 0);
            /* a row's outputs do not depend on the batch it is in: the
             * GEMV (1-3 rows) and the panel tiles (4 and more) compute the
             * same bits, so a decode row equals the same row of a prefill
             * chunk or of a speculative verification */
            float *y1 = ts_malloc(tst, (size_t)out * 4);
            for (uint32_t r = 0; r < rows; r++) {
                assert_int_equal(o->matmul(cx, &w, x + (size_t)r * in, 1, y1), 0);
                if (memcmp(y1, y + (size_t)r * out, (size_t)out * 4))
                    fail_msg("%s %s in %u out %u: row %u of %u differs from the row alone",
                             ctype_name(t), packed ? "packed" : "rows", in, out, r, rows);
            }
            ts_free(tst, y1);
            for (uint32_t r = 0; r < rows; r++)
                for (uint32_t c = 0; c < out; c++) {
                    double want = 0, mag = 0;
                    for (uint32_t k = 0; k < in; k++) {
                        want += wd[(size_t)c * in + k] * x[(size_t)r * in + k];
                        mag += fabs(wd[(size_t)c * in + k] * x[(size_t)r * in + k]);
                    }
                    double got = y[(size_t)r * out + c];
                    if (!(fabs(got - want) <= 1e-6 * mag + 1e-6))
                        fail_msg("%s %s in %u out %u rows %u: y[%u][%u] = %.9g, want %.9g",
                                 ctype_name(t), packed ? "packed" : "rows", in, out, rows, r, c,
                                 got, want);
                }
            /* the packed rows widen back to the values stored */
            if (ri == 0) {
                float *row = ts_malloc(tst, (size_t)in * 4);
                for (uint32_t c = 0; c < out; c += out / 3 + 1) {
                    uint32_t id = c;
                    assert_int_equal(o->get_rows(cx, &w, &id, 1, row), 0);
                    for (uint32_t k = 0; k < in; k++)
                        assert_true(row[k] == (float)wd[(size_t)c * in + k]);
                }
                ts_free(tst, row);
            }
            ts_free(tst, x), ts_free(tst, y);
        }
        ts_free(tst, dev);
    }
    ts_free(tst, src), ts_free(tst, wd);
}

/* Every float weight type on the shared cases (op_cases.h, which the cuda
 * backend runs too), then the cpu's own sweep: row counts around the packed
 * group size, activation row counts on both kernels (GEMV below 4, panel
 * tiles from 4). */
static void matmul_all(void **tst)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    struct compute_ctx *cx = ctx(tst, o);
    static const uint32_t shapes[][2] = {{64, 16}, {96, 17}, {256, 130}, {40, 3}, {800, 48}};
    static const uint32_t rows_list[] = {1, 2, 3, 4, 5, 7, 16, 29};
    for (size_t ti = 0; ti < OP_CASES_N(op_float_types); ti++) {
        enum ctype t = op_float_types[ti];
        for (size_t ci = 0; ci < OP_CASES_N(op_matmul_cases); ci++) {
            const struct op_mm_case *c = &op_matmul_cases[ci];
            if (t != CT_Q8_0 || c->in % 32 == 0)
                matmul_one(tst, o, cx, t, c->in, c->out, &c->rows, 1);
        }
        for (size_t si = 0; si < OP_CASES_N(shapes); si++)
            if (t != CT_Q8_0 || shapes[si][0] % 32 == 0)
                matmul_one(tst, o, cx, t, shapes[si][0], shapes[si][1], rows_list,
                           OP_CASES_N(rows_list));
    }
    ts_free(tst, cx);
}

static void t_matmul(void **s)
{
    matmul_all(s);
    setenv("KVD_CPU_SCALAR", "1", 1);
    matmul_all(s);
    unsetenv("KVD_CPU_SCALAR");
}

/* ---- the other quantized types (compute_cpu_quant.c) ----
 * The kernels quantize each activation row as llama.cpp does (blocks of 32
 * int8 with an f16 scale against the legacy types, super-blocks of 256 with
 * an f32 scale against the K-quants), then take exact integer dots. The
 * test quantizes the activations itself, from those definitions, and checks
 * each output against the dequantized weights times those activations in
 * double (tight), and against the unquantized activations within the bound
 * the activation rounding allows (loose). */

static uint64_t qrng = 88172645463325252ull;
static float qrand(void) /* uniform in [-1, 1) */
{
    qrng ^= qrng << 13, qrng ^= qrng >> 7, qrng ^= qrng << 17;
    return (float)(qrng >> 40) / (float)(1u << 23) - 1.0f;
}

static float f16r(float f)
{
    return half_to_float(float_to_half(f));
}

/* The activation row x[n] as the kernels' quantization sees it: xa[i] its
 * value after quantization, bound[i] the largest |xa[i] - x[i]| allowed,
 * and for the q4_1/q5_1 blocks the extra term ggml adds per block: the
 * f16 of (scale x sum of quants) in place of the sum of the rounded values
 * (corr[b] = s - sum xa over block b). */
static void act_ref(enum ctype t, const float *x, uint32_t n, double *xa, double *bound,
                    double *corr)
{
    int kq = ctype_block_elems(t) == 256;
    uint32_t bs = kq ? 256 : 32;
    for (uint32_t b = 0; b < n / bs; b++) {
        const float *xb = x + b * bs;
        float amax = 0, mx = 0;
        for (uint32_t i = 0; i < bs; i++)
            if (fabsf(xb[i]) > amax)
                amax = fabsf(xb[i]), mx = xb[i];
        if (kq) { /* q8_K: -127 / (value of largest magnitude), f32 scale */
            float iscale = amax ? -127.0f / mx : 0, d = amax ? 1.0f / iscale : 0;
            for (uint32_t i = 0; i < bs; i++) {
                long q = lrintf(iscale * xb[i]);
                xa[b * bs + i] = (double)d * (double)(q > 127 ? 127 : q);
                bound[b * bs + i] = 0.5 * fabs((double)d) * 1.001;
            }
            continue;
        }
        float d = amax / 127.0f, id = amax ? 127.0f / amax : 0, dr = f16r(d);
        long sum = 0;
        double sxa = 0;
        for (uint32_t i = 0; i < bs; i++) {
            long q = lrintf(xb[i] * id);
            sum += q;
            xa[b * bs + i] = (double)dr * (double)q;
            sxa += xa[b * bs + i];
            bound[b * bs + i] = 0.5 * d * 1.001 + fabs((double)dr - d) * 127;
        }
        corr[b] = (double)f16r(d * (float)sum) - sxa;
    }
}

/* One quantized weight of type t (in x out) against rows of activations
 * for each count in rows_list (see the comment above act_ref). */
static void qmatmul_one(void **tst, const struct compute_ops *o, struct compute_ctx *cx,
                        enum ctype t, uint32_t in, uint32_t out, const uint32_t *rows_list,
                        size_t n_rows)
{
    size_t rb = ctype_row_bytes(t, in);
    float *wf = ts_malloc(tst, (size_t)in * out * 4), *wq = ts_malloc(tst, (size_t)in * out * 4);
    uint8_t *src = ts_malloc(tst, rb * out);
    for (size_t i = 0; i < (size_t)in * out; i++)
        wf[i] = qrand() * (i % 53 == 0 ? 4.0f : 1.0f) + (t == CT_Q4_1 ? 0.3f : 0);
    for (uint32_t c = 0; c < out; c++) {
        assert_int_equal(quant_quantize_row(t, wf + (size_t)c * in, src + c * rb, in), 0);
        assert_int_equal(quant_dequant_row(t, src + c * rb, wq + (size_t)c * in, in), 0);
    }
    struct ctensor w = {.type = t, .ne0 = in, .ne1 = out, .nbytes = rb * out};
    void *dev;
    assert_int_equal(o->buf_alloc(cx, o->weight_bytes(&w), &dev), 0);
    ts_defer(tst, dev, buf_free_cb, cx);
    w.data = dev;
    assert_int_equal(o->weight_upload(cx, &w, src), 0);
    assert_int_equal(w.layout, CL_ROWS);
    /* get_rows widens to exactly the reference dequantization */
    float *row = ts_malloc(tst, (size_t)in * 4);
    for (uint32_t c = 0; c < out; c++) {
        assert_int_equal(o->get_rows(cx, &w, &c, 1, row), 0);
        assert_memory_equal(row, wq + (size_t)c * in, (size_t)in * 4);
    }
    ts_free(tst, row);
    for (size_t ri = 0; ri < n_rows; ri++) {
        uint32_t rows = rows_list[ri];
        float *x = ts_malloc(tst, (size_t)rows * in * 4),
              *y = ts_malloc(tst, (size_t)rows * out * 4);
        double *xa = ts_malloc(tst, (size_t)in * 8), *bd = ts_malloc(tst, (size_t)in * 8);
        double *corr = ts_calloc(tst, in / 32, 8);
        for (size_t i = 0; i < (size_t)rows * in; i++)
            x[i] = qrand() * (i % 37 == 0 ? 8.0f : 1.0f);
        if (rows > 2)
            memset(x + in, 0, (size_t)in * 4); /* an all-zero row: scale 0 */
        for (size_t i = 0; i < (size_t)rows * out; i++)
            y[i] = NAN;
        assert_int_equal(o->matmul(cx, &w, x, rows, y), 0);
        /* a row's outputs do not depend on the batch it is in (the
         * K-quant kernels share each weight block among 4 rows) */
        float *y1 = ts_malloc(tst, (size_t)out * 4);
        for (uint32_t r = 0; r < rows; r++) {
            assert_int_equal(o->matmul(cx, &w, x + (size_t)r * in, 1, y1), 0);
            assert_memory_equal(y1, y + (size_t)r * out, (size_t)out * 4);
        }
        ts_free(tst, y1);
        for (uint32_t r = 0; r < rows; r++) {
            act_ref(t, x + (size_t)r * in, in, xa, bd, corr);
            for (uint32_t c = 0; c < out; c++) {
                const float *wr = wq + (size_t)c * in;
                const uint8_t *wb = src + c * rb;
                double want = 0, mag = 0, exact = 0, slack = 0;
                for (uint32_t k = 0; k < in; k++) {
                    want += wr[k] * xa[k];
                    mag += fabs(wr[k] * xa[k]);
                    exact += (double)wr[k] * x[(size_t)r * in + k];
                    slack += fabs(wr[k]) * bd[k];
                }
                if (t == CT_Q4_1 || t == CT_Q5_1)
                    for (uint32_t b = 0; b < in / 32; b++) {
                        uint16_t mh;
                        memcpy(&mh, wb + b * ctype_block_bytes(t) + 2, 2);
                        want += half_to_float(mh) * corr[b];
                        mag += fabs(half_to_float(mh) * corr[b]);
                        slack += fabs(half_to_float(mh) * corr[b]);
                    }
                double got = y[(size_t)r * out + c];
                if (!(fabs(got - want) <= 2e-5 * mag + 1e-6))
                    fail_msg("%s in %u out %u rows %u: y[%u][%u] = %.9g, want %.9g (mag %g)",
                             ctype_name(t), in, out, rows, r, c, got, want, mag);
                if (!(fabs(got - exact) <= slack + 2e-5 * mag + 1e-6))
                    fail_msg("%s in %u out %u rows %u: y[%u][%u] = %.9g, unquantized %.9g "
                             "(bound %g)",
                             ctype_name(t), in, out, rows, r, c, got, exact, slack);
            }
        }
        ts_free(tst, x), ts_free(tst, y), ts_free(tst, xa), ts_free(tst, bd), ts_free(tst, corr);
    }
    ts_free(tst, dev);
    ts_free(tst, wf), ts_free(tst, wq), ts_free(tst, src);
}

/* Every quantized type on the shared cases (op_cases.h), then the cpu's own
 * sweep of row lengths, output counts and row counts. */
static void qmatmul_all(void **tst)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    struct compute_ctx *cx = ctx(tst, o);
    static const uint32_t ins32[] = {32, 96, 544}, ins256[] = {256, 768};
    static const uint32_t outs[] = {1, 7, 17, 40};
    static const uint32_t rows_list[] = {1, 2, 3, 5, 16};
    for (size_t ti = 0; ti < OP_CASES_N(op_quant_types); ti++) {
        enum ctype t = op_quant_types[ti];
        for (size_t ci = 0; ci < OP_CASES_N(op_qmatmul_cases); ci++) {
            const struct op_mm_case *c = &op_qmatmul_cases[ci];
            qmatmul_one(tst, o, cx, t, c->in, c->out, &c->rows, 1);
        }
        int kq = ctype_block_elems(t) == 256;
        for (size_t ii = 0; ii < (kq ? 2u : 3u); ii++)
            for (size_t oi = 0; oi < OP_CASES_N(outs); oi++)
                qmatmul_one(tst, o, cx, t, kq ? ins256[ii] : ins32[ii], outs[oi], rows_list,
                            OP_CASES_N(rows_list));
    }
    ts_free(tst, cx);
}

static void t_qmatmul(void **s)
{
    qmatmul_all(s);
    setenv("KVD_CPU_SCALAR", "1", 1);
    qmatmul_all(s);
    unsetenv("KVD_CPU_SCALAR");
}

/* The reference quantizers: every type's rows dequantize to within the
 * type's step of the input (and all-zero rows to zeros). */
static void t_quant_roundtrip(void **s)
{
    static const enum ctype types[] = {CT_Q4_0, CT_Q4_1, CT_Q5_0, CT_Q5_1,
                                       CT_Q8_0, CT_Q4_K, CT_Q5_K, CT_Q6_K};
    static const double max_rel[] = {0.09, 0.09, 0.045, 0.045, 0.006, 0.08, 0.04, 0.02};
    enum { N = 2048 };
    float *x = ts_malloc(s, N * 4), *y = ts_malloc(s, N * 4);
    uint8_t *b = ts_malloc(s, N * 2);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        double e = 0, ss = 0;
        for (int i = 0; i < N; i++)
            x[i] = qrand() + (i % 300 < 40 ? 0.5f : 0);
        assert_int_equal(quant_quantize_row(types[ti], x, b, N), 0);
        assert_int_equal(quant_dequant_row(types[ti], b, y, N), 0);
        for (int i = 0; i < N; i++)
            e += (double)(x[i] - y[i]) * (x[i] - y[i]), ss += (double)x[i] * x[i];
        print_message("  %s: relative rms error %.4f\n", ctype_name(types[ti]), sqrt(e / ss));
        assert_true(sqrt(e / ss) < max_rel[ti]);
        memset(x, 0, N * 4);
        assert_int_equal(quant_quantize_row(types[ti], x, b, N), 0);
        assert_int_equal(quant_dequant_row(types[ti], b, y, N), 0);
        for (int i = 0; i < N; i++)
            assert_true(y[i] == 0.0f);
        assert_int_equal(quant_quantize_row(types[ti], x, b, N - 16), -1); /* not whole blocks */
    }
    ts_free(s, x), ts_free(s, y), ts_free(s, b);
}

/* ---- paged attention over every KV dtype ----
 * K and V go into the blocks through kv_write (so q8_0/fp8 are quantized by
 * the code under test); the reference widens the stored bytes with its own
 * decoders, written from the formats' definitions (kv_types.h), and does
 * the attention in double. Mixed batches (a prompt, a chunk after a cached
 * prefix, decode rows), GQA, blocks scattered over the arena. */

static double f16_def(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static double e4m3_def(uint8_t c)
{
    int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return c & 0x80 ? -v : v;
}

/* Value d of a stored row of dtype dt. */
static double kv_value(const uint8_t *row, enum kv_dtype dt, uint32_t d)
{
    switch (dt) {
    case KV_F16:
        return f16_def((uint16_t)(row[2 * d] | row[2 * d + 1] << 8));
    case KV_BF16: {
        uint32_t b = (uint32_t)(row[2 * d] | row[2 * d + 1] << 8) << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    case KV_F32: {
        float f;
        memcpy(&f, row + 4 * d, 4);
        return f;
    }
    case KV_Q8_0: {
        const uint8_t *b = row + (d / 32) * 34;
        return f16_def((uint16_t)(b[0] | b[1] << 8)) * (int8_t)b[2 + d % 32];
    }
    case KV_FP8: {
        float s;
        memcpy(&s, row, 4);
        return (double)s * e4m3_def(row[4 + d]);
    }
    }
    return NAN;
}

/* One attention batch against the double reference, within tol x (1 +
 * |want|) (tol < 0: -tol x (n_kv + 4) x (1 + |want|), the bound of sums
 * rounded to f16 at every position); the outputs to keep[] when given. */
static void attn_case(void **tst, enum kv_dtype dt, uint32_t hd, uint32_t n_head, uint32_t kvh,
                      uint32_t bt, const uint32_t (*seqs)[2], uint32_t S, double tol, float *keep)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    struct compute_ctx *cx = ctx(tst, o);
    struct kv_geom g = {
        .layers = 2, .kv_heads = kvh, .head_dim = hd, .dtype = dt, .block_tokens = bt};
    size_t bb = kv_block_bytes(&g), rb = kv_row_bytes(dt, hd);
    uint32_t qstart[9], pos0[8], slot0[9], T = 0, NS = 0, max_q = 0, max_kv = 0;
    for (uint32_t s = 0; s < S; s++) {
        uint32_t end = seqs[s][0] + seqs[s][1];
        qstart[s] = T, pos0[s] = seqs[s][0], slot0[s] = NS;
        T += seqs[s][1];
        NS += (end + bt - 1) / bt;
        max_q = seqs[s][1] > max_q ? seqs[s][1] : max_q;
        max_kv = end > max_kv ? end : max_kv;
    }
    qstart[S] = T, slot0[S] = NS;
    uint32_t nslot = NS + 2, *slots = ts_malloc(tst, NS * 4);
    for (uint32_t i = 0; i < NS; i++) /* reversed, past two unused slots */
        slots[i] = nslot - 1 - i;
    uint8_t *arena = ts_calloc(tst, nslot, bb);
    /* every position of every sequence (the cached prefix too) through kv_write */
    for (uint32_t s = 0; s < S; s++) {
        uint32_t n = seqs[s][0] + seqs[s][1];
        size_t kvn = (size_t)n * kvh * hd;
        float *k = ts_malloc(tst, kvn * 4), *v = ts_malloc(tst, kvn * 4);
        uint32_t *ts = ts_malloc(tst, n * 4), *tp = ts_malloc(tst, n * 4);
        for (size_t i = 0; i < kvn; i++)
            k[i] = 2 * qrand() * (i % 7 == 0 ? 3.0f : 1.0f), v[i] = 2 * qrand();
        for (uint32_t p = 0; p < n; p++)
            ts[p] = slots[slot0[s] + p / bt], tp[p] = p;
        assert_int_equal(o->kv_write(cx, arena, &g, 1, k, v, n, ts, tp), 0);
        ts_free(tst, k), ts_free(tst, v), ts_free(tst, ts), ts_free(tst, tp);
    }
    size_t QN = (size_t)T * n_head * hd;
    float *q = ts_malloc(tst, QN * 4), *out = ts_malloc(tst, QN * 4);
    for (size_t i = 0; i < QN; i++)
        q[i] = qrand() * 1.5f;
    struct attn_desc d = {.q = q,
                          .out = out,
                          .arena = arena,
                          .geom = &g,
                          .layer = 1,
                          .n_head = n_head,
                          .scale = 1.0f / sqrtf((float)hd),
                          .n_tokens = T,
                          .n_seqs = S,
                          .seq_qstart = qstart,
                          .seq_pos0 = pos0,
                          .seq_slot0 = slot0,
                          .slots = slots,
                          .max_q = max_q,
                          .max_kv = max_kv,
                          .h_seq_qstart = qstart,
                          .h_seq_pos0 = pos0};
    assert_int_equal(o->attention(cx, &d), 0);
    double *sc = ts_malloc(tst, max_kv * sizeof(double)),
           *acc = ts_malloc(tst, hd * sizeof(double));
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t r = 0; r < seqs[s][1]; r++) {
            uint32_t t = qstart[s] + r, n_kv = pos0[s] + r + 1;
            for (uint32_t h = 0; h < n_head; h++) {
                uint32_t gh = h / (n_head / kvh);
                const float *qr = q + ((size_t)t * n_head + h) * hd;
                double m = -INFINITY, sum = 0;
                for (uint32_t j = 0; j < n_kv; j++) {
                    const uint8_t *blk = arena + (size_t)slots[slot0[s] + j / bt] * bb;
                    const uint8_t *kr = blk + ((2 * 1 + 0) * kvh + gh) * bt * rb + (j % bt) * rb;
                    double dot = 0;
                    for (uint32_t e = 0; e < hd; e++)
                        dot += (double)qr[e] * kv_value(kr, dt, e);
                    sc[j] = dot / sqrt((double)hd);
                    m = sc[j] > m ? sc[j] : m;
                }
                memset(acc, 0, hd * sizeof(double));
                for (uint32_t j = 0; j < n_kv; j++) {
                    const uint8_t *blk = arena + (size_t)slots[slot0[s] + j / bt] * bb;
                    const uint8_t *vr = blk + ((2 * 1 + 1) * kvh + gh) * bt * rb + (j % bt) * rb;
                    double w = exp(sc[j] - m);
                    sum += w;
                    for (uint32_t e = 0; e < hd; e++)
                        acc[e] += w * kv_value(vr, dt, e);
                }
                const float *got = out + ((size_t)t * n_head + h) * hd;
                double tl = tol >= 0 ? tol : -tol * (n_kv + 4);
                for (uint32_t e = 0; e < hd; e++) {
                    double want = acc[e] / sum;
                    if (!(fabs(got[e] - want) <= tl * (1 + fabs(want))))
                        fail_msg("attention %s hd %u heads %u/%u bt %u: seq %u row %u head %u "
                                 "[%u] = %.9g, want %.9g",
                                 kv_dtype_name(dt), hd, n_head, kvh, bt, s, r, h, e, (double)got[e],
                                 want);
                }
            }
        }
    if (keep)
        memcpy(keep, out, QN * 4);
    ts_free(tst, sc), ts_free(tst, acc), ts_free(tst, q), ts_free(tst, out), ts_free(tst, arena),
        ts_free(tst, slots);
    ts_free(tst, cx);
}

static void attn_all(void **tst)
{
    static const uint32_t shapes[][4] = {/* hd, n_head, kv_heads, block_tokens */
                                         {32, 4, 4, 16},
                                         {64, 8, 2, 16},
                                         {128, 4, 1, 5},
                                         {96, 6, 3, 7}};
    static const uint32_t seqs[3][2] = {{0, 21}, {37, 9}, {70, 1}}; /* (pos0, rows) */
    for (int dt = KV_F16; dt <= KV_FP8; dt++)
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            attn_case(tst, (enum kv_dtype)dt, shapes[i][0], shapes[i][1], shapes[i][2],
                      shapes[i][3], seqs, 3, 2e-5, NULL);
}

static void t_attention_kv_dtypes(void **s)
{
    attn_all(s);
    setenv("KVD_CPU_SCALAR", "1", 1);
    attn_all(s);
    unsetenv("KVD_CPU_SCALAR");
}

/* KVD_CPU_LLAMACPP=1: attention with llama.cpp's flash-attention
 * arithmetic over an f16 cache (an f32 one rounded to f16 as llama.cpp
 * does), q rounded to f16, sums kept in f16 (compute_cpu_ggml.c): within
 * the f16 sums' bound of the double reference, and the AVX2 and portable
 * paths the same bits, for head sizes under 64 (a dot in double), of 64
 * and 128 (64 f32 lanes) and 96 (both). The bits themselves are checked
 * against llama.cpp by test_llamacpp. */
static void t_attention_llamacpp(void **tst)
{
    static const uint32_t shapes[][4] = {
        {32, 4, 4, 16}, {64, 8, 2, 16}, {128, 4, 1, 5}, {96, 6, 3, 7}, {40, 2, 1, 16}};
    static const uint32_t seqs[3][2] = {{0, 21}, {37, 9}, {70, 1}};
    setenv("KVD_CPU_LLAMACPP", "1", 1);
    for (int dt = KV_F16; dt <= KV_F32; dt += KV_F32 - KV_F16)
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            size_t qn = (size_t)(21 + 9 + 1) * shapes[i][1] * shapes[i][0];
            float *a = ts_malloc(tst, qn * 4), *b = ts_malloc(tst, qn * 4);
            uint64_t seed = qrng;
            attn_case(tst, (enum kv_dtype)dt, shapes[i][0], shapes[i][1], shapes[i][2],
                      shapes[i][3], seqs, 3, -0x1p-11, a);
            qrng = seed;
            setenv("KVD_CPU_SCALAR", "1", 1);
            attn_case(tst, (enum kv_dtype)dt, shapes[i][0], shapes[i][1], shapes[i][2],
                      shapes[i][3], seqs, 3, -0x1p-11, b);
            unsetenv("KVD_CPU_SCALAR");
            for (size_t k = 0; k < qn; k++)
                if (memcmp(&a[k], &b[k], 4))
                    fail_msg("llama.cpp attention %s hd %u: out[%zu] avx2 %a, portable %a",
                             kv_dtype_name((enum kv_dtype)dt), shapes[i][0], k, (double)a[k],
                             (double)b[k]);
            ts_free(tst, a), ts_free(tst, b);
        }
    unsetenv("KVD_CPU_LLAMACPP");
}

/* The K-quant matmul's AVX2 and portable kernels give the same bits: the
 * same exact integer sums and the same float operations in the same order
 * per super-block (compute_cpu_quant.c), for decode (1 row) and batches
 * (the AVX2 kernel shares each weight block among up to 4 rows), on
 * activations with an offset (the Q4_K/Q5_K mins' term then cancels most
 * of the scales' term, so any difference in float order would show) and
 * outliers, and an all-zero row. On a cpu without AVX2 both contexts run
 * the portable kernel and this checks nothing more than determinism. */
static void kq_matmul(void **tst, bool scalar, const struct ctensor *w0, const uint8_t *src,
                      const float *x, uint32_t rows, float *y)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    if (scalar)
        setenv("KVD_CPU_SCALAR", "1", 1);
    struct compute_ctx *cx = ctx(tst, o);
    unsetenv("KVD_CPU_SCALAR");
    struct ctensor w = *w0;
    void *dev;
    assert_int_equal(o->buf_alloc(cx, o->weight_bytes(&w), &dev), 0);
    ts_defer(tst, dev, buf_free_cb, cx);
    w.data = dev;
    assert_int_equal(o->weight_upload(cx, &w, src), 0);
    assert_int_equal(o->matmul(cx, &w, x, rows, y), 0);
    ts_free(tst, dev);
    ts_free(tst, cx);
}

static void t_kquant_paths_bit_identical(void **tst)
{
    static const enum ctype types[] = {CT_Q4_K, CT_Q5_K, CT_Q6_K};
    static const uint32_t ins[] = {256, 1024, 2816};
    enum { OUT = 24, ROWS = 7 };
    for (size_t ti = 0; ti < 3; ti++)
        for (size_t ii = 0; ii < 3; ii++) {
            enum ctype t = types[ti];
            uint32_t in = ins[ii];
            size_t rb = ctype_row_bytes(t, in);
            float *wf = ts_malloc(tst, (size_t)in * OUT * 4),
                  *x = ts_malloc(tst, (size_t)in * ROWS * 4);
            uint8_t *src = ts_malloc(tst, rb * OUT);
            for (size_t i = 0; i < (size_t)in * OUT; i++)
                wf[i] = 0.02f * qrand() + (i / in % 3 == 0 ? 0.01f : 0);
            for (uint32_t c = 0; c < OUT; c++)
                assert_int_equal(quant_quantize_row(t, wf + (size_t)c * in, src + c * rb, in), 0);
            for (size_t i = 0; i < (size_t)in * ROWS; i++)
                x[i] = 0.4f * (float)(i / in % 4) + qrand() * (i % 97 == 0 ? 12.0f : 1.0f);
            memset(x + 2 * (size_t)in, 0, (size_t)in * 4);
            struct ctensor w = {.type = t, .ne0 = in, .ne1 = OUT, .nbytes = rb * OUT};
            float *ys = ts_malloc(tst, (size_t)ROWS * OUT * 4),
                  *yp = ts_malloc(tst, (size_t)ROWS * OUT * 4);
            for (uint32_t rows = 1; rows <= ROWS; rows += 3) { /* 1, 4, 7 rows */
                kq_matmul(tst, false, &w, src, x, rows, ys);
                kq_matmul(tst, true, &w, src, x, rows, yp);
                for (size_t i = 0; i < (size_t)rows * OUT; i++)
                    if (memcmp(&ys[i], &yp[i], 4))
                        fail_msg("%s in %u rows %u: y[%zu] avx2 %.9g != portable %.9g",
                                 ctype_name(t), in, rows, i, (double)ys[i], (double)yp[i]);
            }
            ts_free(tst, wf), ts_free(tst, x), ts_free(tst, src), ts_free(tst, ys),
                ts_free(tst, yp);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(t_silu, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_silu_bits, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_matmul, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_qmatmul, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_kquant_paths_bit_identical, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_quant_roundtrip, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_attention_kv_dtypes, ts_setup, ts_teardown),
        cmocka_unit_test_setup_teardown(t_attention_llamacpp, ts_setup, ts_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

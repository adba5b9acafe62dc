/* The cpu kernels that claim llama.cpp's bits, called side by side with its
 * cpu library where node-llama-cpp installed it (KVD_NODE_LLAMA_CPP_DIR) and
 * this cpu runs it: the Q5_K/Q6_K matmuls against ggml_vec_dot_q5_K_q8_K /
 * q6_K_q8_K. (SiLU's check is in test_cpu_ops; attention and RoPE, which run
 * inside its graph, are compared end to end by test_llamacpp.) */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "compute.h"
#include "model/model_ref.h"
#include "quant.h"
#include "test_scratch.h"

#if defined(__x86_64__)
static void ctx_free_cb(void *o, void *cx)
{
    ((const struct compute_ops *)o)->ctx_free(cx);
}

static void buf_free_cb(void *cx, void *buf)
{
    ref_cpu_backend()->compute->buf_free(cx, buf);
}

static uint64_t qrng = 88172645463325252ull;
static float qrand(void) /* uniform in [-1, 1) */
{
    qrng ^= qrng << 13, qrng ^= qrng >> 7, qrng ^= qrng << 17;
    return (float)(qrng >> 40) / (float)(1u << 23) - 1.0f;
}

/* y = x . w^T on a fresh cpu context, AVX2 or (scalar) portable */
static void kq_matmul(void **tst, bool scalar, const struct ctensor *w0, const uint8_t *src,
                      const float *x, uint32_t rows, float *y)
{
    const struct compute_ops *o = ref_cpu_backend()->compute;
    if (scalar)
        setenv("KVD_CPU_SCALAR", "1", 1);
    struct compute_ctx *cx = NULL;
    struct compute_conf conf = {.n_threads = 2};
    assert_int_equal(o->ctx_new(ref_cpu_backend(), &conf, &cx), 0);
    ts_defer(tst, cx, ctx_free_cb, (void *)o);
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

/* llama.cpp's functions, from the zen4 library (NULL: not available here) */
typedef void (*ggml_q8k_fn)(const float *x, void *y, int64_t k);
typedef void (*ggml_vdot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y,
                             size_t by, int nrc);
static struct {
    void *base, *cpu;
    char path[1024];
    ggml_q8k_fn q8k;
    ggml_vdot_fn dot5, dot6;
} gg;

/* Loads llama.cpp's base and zen4 cpu libraries; 0, or -1 with a reason. */
static int ggml_open(const char **why)
{
    const char *dir = getenv("KVD_NODE_LLAMA_CPP_DIR");
    __builtin_cpu_init();
    if (!dir) {
        *why = "KVD_NODE_LLAMA_CPP_DIR is not set";
        return -1;
    }
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl") ||
        !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vbmi") ||
        !__builtin_cpu_supports("avx512bf16")) {
        *why = "this cpu cannot run llama.cpp's zen4 library";
        return -1;
    }
    snprintf(gg.path, sizeof gg.path, "%s/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/",
             dir);
    size_t pl = strlen(gg.path);
    snprintf(gg.path + pl, sizeof gg.path - pl, "libggml-base.so");
    gg.base = dlopen(gg.path, RTLD_NOW | RTLD_GLOBAL);
    snprintf(gg.path + pl, sizeof gg.path - pl, "libggml-cpu-zen4.so");
    gg.cpu = gg.base ? dlopen(gg.path, RTLD_NOW | RTLD_LOCAL) : NULL;
    void (*init)(void) = gg.cpu ? (void (*)(void))dlsym(gg.cpu, "ggml_cpu_init") : NULL;
    gg.q8k = gg.base ? (ggml_q8k_fn)dlsym(gg.base, "quantize_row_q8_K_ref") : NULL;
    gg.dot5 = gg.cpu ? (ggml_vdot_fn)dlsym(gg.cpu, "ggml_vec_dot_q5_K_q8_K") : NULL;
    gg.dot6 = gg.cpu ? (ggml_vdot_fn)dlsym(gg.cpu, "ggml_vec_dot_q6_K_q8_K") : NULL;
    if (!init || !gg.q8k || !gg.dot5 || !gg.dot6) {
        *why = "llama.cpp's libggml-base.so / libggml-cpu-zen4.so not loadable";
        return -1;
    }
    init(); /* its f16 table, which the dots read */
    return 0;
}

/* The Q5_K and Q6_K matmuls (AVX2 and portable) give the bits of
 * llama.cpp's ggml_vec_dot_q5_K_q8_K / q6_K_q8_K (its activations from its
 * quantize_row_q8_K_ref, what every one of its cpu builds runs), on random
 * rows with an offset and outliers, of 1, 3 and 11 super-blocks. Q4_K's
 * kernel there (the interleaved GEMV) needs ggml's repacked layout, which
 * its library does not export: test_llamacpp checks it. */
static void t_kquant_vs_ggml(void **tst)
{
    static const enum ctype types[] = {CT_Q5_K, CT_Q6_K};
    static const uint32_t ins[] = {256, 768, 2816};
    enum { OUT = 16, ROWS = 5, Q8K_BYTES = 4 + 256 + 32 };
    long compared = 0;
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t ii = 0; ii < 3; ii++) {
            enum ctype t = types[ti];
            uint32_t in = ins[ii];
            size_t rb = ctype_row_bytes(t, in);
            float *wf = ts_malloc(tst, (size_t)in * OUT * 4),
                  *x = ts_malloc(tst, (size_t)in * ROWS * 4);
            uint8_t *src = ts_malloc(tst, rb * OUT), *yq = ts_malloc(tst, in / 256 * Q8K_BYTES);
            for (size_t i = 0; i < (size_t)in * OUT; i++)
                wf[i] = 0.02f * qrand() + (i / in % 3 == 0 ? 0.01f : 0);
            for (uint32_t c = 0; c < OUT; c++)
                assert_int_equal(quant_quantize_row(t, wf + (size_t)c * in, src + c * rb, in), 0);
            for (size_t i = 0; i < (size_t)in * ROWS; i++)
                x[i] = 0.4f * (float)(i / in % 4) + qrand() * (i % 97 == 0 ? 12.0f : 1.0f);
            struct ctensor w = {.type = t, .ne0 = in, .ne1 = OUT, .nbytes = rb * OUT};
            float *ys = ts_malloc(tst, (size_t)ROWS * OUT * 4),
                  *yp = ts_malloc(tst, (size_t)ROWS * OUT * 4);
            kq_matmul(tst, false, &w, src, x, ROWS, ys);
            kq_matmul(tst, true, &w, src, x, ROWS, yp);
            for (uint32_t r = 0; r < ROWS; r++) {
                gg.q8k(x + (size_t)r * in, yq, in);
                for (uint32_t c = 0; c < OUT; c++) {
                    float g;
                    (t == CT_Q5_K ? gg.dot5 : gg.dot6)((int)in, &g, 0, src + c * rb, 0, yq, 0, 1);
                    size_t i = (size_t)r * OUT + c;
                    if (memcmp(&g, &ys[i], 4) || memcmp(&g, &yp[i], 4))
                        fail_msg("%s in %u row %u col %u: ggml %a, kvd avx2 %a, portable %a",
                                 ctype_name(t), in, r, c, (double)g, (double)ys[i], (double)yp[i]);
                    compared++;
                }
            }
            ts_free(tst, wf), ts_free(tst, x), ts_free(tst, src), ts_free(tst, yq),
                ts_free(tst, ys), ts_free(tst, yp);
        }
    print_message("  %ld Q5_K/Q6_K outputs equal to ggml's (%s)\n", compared, gg.path);
}

#endif

int main(void)
{
    const char *why = "not an x86-64 build";
#if defined(__x86_64__)
    if (ggml_open(&why) == 0) {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test_setup_teardown(t_kquant_vs_ggml, ts_setup, ts_teardown),
        };
        int rc = cmocka_run_group_tests(tests, NULL, NULL);
        dlclose(gg.cpu);
        dlclose(gg.base);
        return rc;
    }
#endif
    fprintf(stderr, "skipped: %s\n", why);
    return 77;
}

/* The quantized KV rows (compute_cpu_kv.h): e4m3fn conversions against the
 * format's definition (every code, every rounding case, saturation, NaN),
 * q8_0 and fp8 rows against their error bounds and special cases, the AVX2
 * codecs against the portable ones bit for bit, and arbitrary stored bytes
 * (a client's kv_write can put anything in a block) widened without harm. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "compute_cpu_kv.h"
#include "kv_types.h"
#include "kvd/status.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd32(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static float rndf(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd32() & 0xffffff) / 16777216.0f;
}

/* e4m3fn from its definition: sign, 4-bit exponent of bias 7, 3-bit mantissa;
 * exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; no infinity. */
static double e4m3_def(uint8_t c)
{
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7)
        return NAN;
    double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

/* The correctly rounded e4m3fn code of x (nearest, ties to the even code,
 * beyond 448 saturated), by search over all finite codes. */
static uint8_t e4m3_nearest(double x)
{
    if (isnan(x))
        return 0x7f;
    double a = fabs(x);
    uint8_t best = 0;
    for (int c = 1; c <= 0x7e; c++) {
        double d = fabs(e4m3_def((uint8_t)c) - a), db = fabs(e4m3_def(best) - a);
        if (d < db || (d == db && !(c & 1)))
            best = (uint8_t)c;
    }
    return (uint8_t)((x < 0 || (x == 0 && signbit(x)) ? 0x80 : 0) | best);
}

static void t_e4m3_codes(void **s)
{
    (void)s;
    for (int c = 0; c < 256; c++) {
        double want = e4m3_def((uint8_t)c);
        float got = cpu_e4m3_to_f32((uint8_t)c);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_true(isnan(cpu_e4m3_to_f32(cpu_e4m3_from_f32(got))));
            continue;
        }
        if ((double)got != want || !signbit(got) != !signbit(want))
            fail_msg("e4m3 code 0x%02x: %.9g, want %.9g", c, (double)got, want);
        assert_int_equal(cpu_e4m3_from_f32(got), c); /* every value round-trips */
    }
    assert_true(cpu_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(cpu_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(cpu_e4m3_to_f32(0x08) == 0x1p-6f);
}

static void t_e4m3_rounding(void **s)
{
    (void)s;
    /* saturation: past 448, infinities; NaN keeps its sign bit's code */
    const float sat[] = {448.0f, 449.0f, 464.0f, 480.0f, 1e9f, 3.4e38f, INFINITY};
    for (size_t i = 0; i < sizeof sat / sizeof *sat; i++) {
        assert_int_equal(cpu_e4m3_from_f32(sat[i]), 0x7e);
        assert_int_equal(cpu_e4m3_from_f32(-sat[i]), 0xfe);
    }
    assert_int_equal(cpu_e4m3_from_f32(NAN), 0x7f);
    assert_int_equal(cpu_e4m3_from_f32(-NAN), 0xff);
    /* ties to even: 1.0625 is between 1 (m=0) and 1.125 (m=1); 1.1875
     * between 1.125 and 1.25 (m=2); 2^-10 between 0 and 2^-9; 3*2^-10
     * between 2^-9 (m=1) and 2^-8 (m=2); 15*2^-10 between 7*2^-9 and the
     * first normal 2^-6 (code 8) */
    assert_int_equal(cpu_e4m3_from_f32(1.0625f), 0x38);
    assert_int_equal(cpu_e4m3_from_f32(1.1875f), 0x3a);
    assert_int_equal(cpu_e4m3_from_f32(0x1p-10f), 0x00);
    assert_int_equal(cpu_e4m3_from_f32(-0x1p-10f), 0x80);
    assert_int_equal(cpu_e4m3_from_f32(3 * 0x1p-10f), 0x02);
    assert_int_equal(cpu_e4m3_from_f32(15 * 0x1p-10f), 0x08);
    assert_int_equal(cpu_e4m3_from_f32(1e-30f), 0x00);
    assert_int_equal(cpu_e4m3_from_f32(-0.0f), 0x80);
    /* 464 = the midpoint between 448 and (the missing) 480: saturates; just
     * below 448's upper midpoint rounds to 448 */
    assert_int_equal(cpu_e4m3_from_f32(447.9f), 0x7e);
    assert_int_equal(cpu_e4m3_from_f32(432.0f), 0x7e); /* tie 416|448: even is 448 (m=6) */
    assert_int_equal(cpu_e4m3_from_f32(400.0f), 0x7c); /* tie 384|416: 384 (m=4) */
    /* random values over the whole range against the exhaustive nearest */
    for (int i = 0; i < 200000; i++) {
        float x = ldexpf(rndf(1.0f, 2.0f), (int)(rnd32() % 24) - 14) * (rnd32() & 1 ? -1 : 1);
        if (i % 7 == 0) /* exact midpoints between neighbouring codes */
            x = (float)((e4m3_def((uint8_t)(i % 0x7e)) + e4m3_def((uint8_t)(i % 0x7e + 1))) / 2);
        uint8_t got = cpu_e4m3_from_f32(x), want = e4m3_nearest(x);
        if (got != want)
            fail_msg("e4m3(%.9g) = 0x%02x, want 0x%02x", (double)x, got, want);
    }
}

static float f16_bits_to_f32(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (float)(h & 0x8000 ? -v : v);
}

enum { HD = 128 };

static void widen_both(const void *row, enum kv_dtype dt, float *out)
{
    float scalar[HD];
    cpu_kv_load_row(row, dt, HD, out, true);
    cpu_kv_load_row(row, dt, HD, scalar, false);
    for (int i = 0; i < HD; i++)
        if (memcmp(&out[i], &scalar[i], 4) && !(isnan(out[i]) && isnan(scalar[i])))
            fail_msg("%s value %d: simd %.9g, scalar %.9g", kv_dtype_name(dt), i, (double)out[i],
                     (double)scalar[i]);
}

static void store_both(void *row, enum kv_dtype dt, const float *x)
{
    uint8_t other[HD * 4];
    size_t rb = kv_row_bytes(dt, HD);
    cpu_kv_store_row(row, dt, x, HD, true);
    cpu_kv_store_row(other, dt, x, HD, false);
    assert_memory_equal(row, other, rb);
}

static void t_q8_0_rows(void **s)
{
    (void)s;
    assert_int_equal(kv_row_bytes(KV_Q8_0, HD), HD / 32 * 34);
    uint8_t row[HD / 32 * 34];
    float x[HD], y[HD];
    for (int it = 0; it < 2000; it++) {
        float scale = ldexpf(1.0f, (int)(rnd32() % 40) - 20);
        for (int i = 0; i < HD; i++)
            x[i] = rndf(-1.0f, 1.0f) * scale * (i / 32 == it % 4 ? 0.001f : 1.0f);
        store_both(row, KV_Q8_0, x);
        widen_both(row, KV_Q8_0, y);
        for (int b = 0; b < HD / 32; b++) {
            double amax = 0;
            for (int i = 0; i < 32; i++)
                amax = fmax(amax, fabs(x[b * 32 + i]));
            uint16_t dh = (uint16_t)(row[b * 34] | row[b * 34 + 1] << 8);
            double d = f16_bits_to_f32(dh);
            /* d is amax/127 to f16's precision (half a step; 2^-25 among
             * f16's subnormals, where a tiny block's d flushes to 0) */
            double derr = fabs(d - amax / 127);
            assert_true(derr <= fmax(amax / 127 * 0x1p-11, 0x1p-25));
            for (int i = 0; i < 32; i++) {
                double xi = x[b * 32 + i], yi = y[b * 32 + i];
                assert_true(yi == d * (int8_t)row[b * 34 + 2 + i]);
                /* half a step, plus what d's rounding moves the largest q */
                if (!(fabs(xi - yi) <= amax / 254 + 127 * derr + amax * 1e-6))
                    fail_msg("q8_0 x %.9g -> %.9g (amax %.9g)", xi, yi, amax);
            }
        }
    }
    /* exact: d = 1 (amax 127), integers and ties to even */
    for (int i = 0; i < HD; i++)
        x[i] = (float)((i % 64) - 32);
    x[0] = 127, x[1] = 0.5f, x[2] = 1.5f, x[3] = -2.5f, x[4] = -127;
    store_both(row, KV_Q8_0, x);
    widen_both(row, KV_Q8_0, y);
    assert_int_equal(row[0] | row[1] << 8, 0x3c00); /* f16 1.0 */
    assert_true(y[1] == 0 && y[2] == 2 && y[3] == -2 && y[4] == -127);
    for (int i = 5; i < HD; i++)
        if (i >= 32) /* blocks 1..3 have amax 32: d = 32/127, not exact */
            assert_true(fabs(y[i] - x[i]) <= 32.0 / 127 / 2 * 1.01);
        else
            assert_true(y[i] == x[i]);
    /* zeros; a NaN or an infinity poisons its own block only; a d past f16 */
    memset(x, 0, sizeof x);
    x[40] = NAN, x[70] = -INFINITY, x[100] = 9e6f, x[5] = -0.0f;
    store_both(row, KV_Q8_0, x);
    widen_both(row, KV_Q8_0, y);
    assert_int_equal(row[0] | row[1] << 8, 0);
    for (int i = 0; i < 32; i++)
        assert_true(y[i] == 0);
    for (int b = 1; b < 4; b++) {
        assert_int_equal(row[b * 34] | row[b * 34 + 1] << 8, 0x7e00);
        for (int i = 0; i < 32; i++) {
            assert_int_equal(row[b * 34 + 2 + i], 0);
            assert_true(isnan(y[b * 32 + i]));
        }
    }
    x[100] = 65504.0f * 127; /* d = 65504 exactly: still finite */
    store_both(row, KV_Q8_0, x);
    assert_int_equal(row[3 * 34] | row[3 * 34 + 1] << 8, 0x7bff);
}

static void t_fp8_rows(void **s)
{
    (void)s;
    assert_int_equal(kv_row_bytes(KV_FP8, HD), 4 + HD);
    uint8_t row[4 + HD];
    float x[HD], y[HD];
    for (int it = 0; it < 2000; it++) {
        float scale = ldexpf(1.0f, (int)(rnd32() % 60) - 30);
        for (int i = 0; i < HD; i++) /* a wide spread of magnitudes within the row */
            x[i] = rndf(-1.0f, 1.0f) * scale * ldexpf(1.0f, -(int)(rnd32() % 12));
        store_both(row, KV_FP8, x);
        widen_both(row, KV_FP8, y);
        double amax = 0;
        for (int i = 0; i < HD; i++)
            amax = fmax(amax, fabs(x[i]));
        float sc;
        memcpy(&sc, row, 4);
        assert_true(sc == (float)amax / 448.0f);
        for (int i = 0; i < HD; i++) {
            assert_true(y[i] == sc * cpu_e4m3_to_f32(row[4 + i]));
            /* half an e4m3 step (2^-4 relative), or half the subnormal step */
            double bound = fabs(x[i]) / 16 + sc * 0x1p-10 + fabs(x[i]) * 1e-6;
            if (!(fabs(y[i] - x[i]) <= bound))
                fail_msg("fp8 x %.9g -> %.9g (scale %.9g)", (double)x[i], (double)y[i], (double)sc);
        }
    }
    /* zeros: scale 0, codes 0 (and -0) */
    memset(x, 0, sizeof x);
    x[3] = -0.0f;
    store_both(row, KV_FP8, x);
    widen_both(row, KV_FP8, y);
    float sc;
    memcpy(&sc, row, 4);
    assert_true(sc == 0);
    for (int i = 0; i < HD; i++)
        assert_true(y[i] == 0);
    /* NaN stays NaN; infinities saturate to the finite amax; the rest of
     * the row is unharmed */
    for (int i = 0; i < HD; i++)
        x[i] = (float)(i - 64) / 8;
    x[10] = NAN, x[11] = INFINITY, x[12] = -INFINITY;
    store_both(row, KV_FP8, x);
    widen_both(row, KV_FP8, y);
    memcpy(&sc, row, 4);
    assert_true(sc == 8.0f / 448.0f);
    assert_true(isnan(y[10]));
    assert_true(fabs(y[11] - 8.0) <= 8e-6 && fabs(y[12] + 8.0) <= 8e-6);
    for (int i = 0; i < HD; i++)
        if (i < 10 || i > 12)
            assert_true(fabs(y[i] - x[i]) <= fabs(x[i]) / 16);
    /* exact: 448 * 2^k times e4m3 values are kept exactly */
    for (int i = 0; i < HD; i++)
        x[i] = (float)e4m3_def((uint8_t)(i == 0 ? 0x7e : i % 0x7e)) * 0.25f;
    store_both(row, KV_FP8, x);
    widen_both(row, KV_FP8, y);
    for (int i = 0; i < HD; i++)
        assert_true(y[i] == x[i]);
}

/* Whatever bytes a client stored, widening them is defined and the same with
 * and without AVX2 (ASan/UBSan see any bad shift or conversion). */
static void t_arbitrary_bytes(void **s)
{
    (void)s;
    uint8_t row[HD * 4];
    float y[HD];
    const enum kv_dtype dts[] = {KV_F16, KV_BF16, KV_F32, KV_Q8_0, KV_FP8};
    for (int it = 0; it < 3000; it++)
        for (size_t k = 0; k < sizeof dts / sizeof *dts; k++) {
            for (size_t i = 0; i < sizeof row; i++)
                row[i] = (uint8_t)rnd32();
            widen_both(row, dts[k], y);
        }
}

static void t_row_bytes(void **s)
{
    (void)s;
    assert_int_equal(kv_row_bytes(KV_F16, 80), 160);
    assert_int_equal(kv_row_bytes(KV_F32, 80), 320);
    assert_int_equal(kv_row_bytes(KV_Q8_0, 64), 68);
    assert_int_equal(kv_row_bytes(KV_FP8, 64), 68);
    assert_int_equal(kv_row_bytes(KV_Q8_0, 80), 0);
    assert_int_equal(kv_row_bytes(KV_FP8, 16), 0);
    assert_int_equal(kv_row_bytes((enum kv_dtype)9, 64), 0);
    struct kv_geom g = {
        .layers = 2, .kv_heads = 2, .head_dim = 128, .dtype = KV_Q8_0, .block_tokens = 16};
    struct kvd_error err = {0};
    assert_int_equal(kv_geom_check(&g, &err), 0);
    assert_int_equal(kv_block_bytes(&g), 2 * 2 * 2 * 16 * 136);
    assert_int_equal(kv_token_bytes(&g), 2 * 2 * 2 * 136);
    g.head_dim = 80;
    assert_int_equal(kv_geom_check(&g, &err), KVD_EBADREQ);
    assert_int_equal(err.code, KVD_EBADREQ);
    assert_non_null(strstr(err.message, "q8_0"));
    assert_non_null(strstr(err.message, "multiple of 32"));
    assert_string_equal(kv_dtype_name(KV_Q8_0), "q8_0");
    assert_string_equal(kv_dtype_name(KV_FP8), "fp8");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_e4m3_codes),      cmocka_unit_test(t_e4m3_rounding),
        cmocka_unit_test(t_q8_0_rows),       cmocka_unit_test(t_fp8_rows),
        cmocka_unit_test(t_arbitrary_bytes), cmocka_unit_test(t_row_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

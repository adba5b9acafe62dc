/* text_out (daemon/text/text_out.c): a completion's text assembled token by
 * token, stop strings found wherever they fall across tokens, and the
 * pieces handed out never splitting a character nor showing the start of a
 * stop string that may still complete; the pieces always add up to the
 * final text. Over a small SentencePiece vocabulary built in memory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gguf.h"
#include "kvd/status.h"
#include "text/gguf_write.h"
#include "text_out.h"
#include "tokenizer.h"

/* ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 bytes <0x00>..<0xFF>, then pieces */
static const char *const pieces[] = {
    "\xe2\x96\x81Hello", "\xe2\x96\x81world", "ab", "c", "\xc3\xa9", "STOP", "\xe2\x96\x81", "x"};
enum { P0 = 259, HELLO = P0, WORLD, AB, C, E_ACUTE, STOP, SPACE, X, N_VOCAB };

struct fixture {
    uint8_t *file;
    struct gguf *g;
    struct tokenizer *tok;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    struct gw w = {0};
    char name[16];
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, N_VOCAB);
    for (int i = 0; i < N_VOCAB; i++) {
        const char *s = name;
        if (i < 3)
            s = (const char *[]){"<unk>", "<s>", "</s>"}[i];
        else if (i < P0)
            snprintf(name, sizeof(name), "<0x%02X>", i - 3);
        else
            s = pieces[i - P0];
        gw_strn(&w, s, strlen(s));
    }
    gw_kv_arr(&w, "tokenizer.ggml.scores", 6, N_VOCAB);
    for (int i = 0; i < N_VOCAB; i++) {
        float sc = -(float)i;
        gw_put(&w, &sc, 4);
    }
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, N_VOCAB);
    for (int i = 0; i < N_VOCAB; i++) {
        int32_t t = i == 0 ? 2 : i < 3 ? 3 : i < P0 ? 6 : 1;
        gw_put(&w, &t, 4);
    }
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 1);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 2);
    size_t len;
    struct kvd_error err = {0}; /* tokenizer_load writes into its message */
    f->file = gw_finish(&w, &len);
    gw_free(&w);
    if (!f->file || gguf_parse(f->file, len, &f->g, &err) ||
        tokenizer_load(f->g, &f->tok, err.message, sizeof err.message)) {
        fprintf(stderr, "setup: %s\n", err.message);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    tokenizer_free(f->tok);
    gguf_close(f->g);
    free(f->file);
    free(f);
    return 0;
}

/* Pushes ids one by one, taking the pieces after each; returns the number
 * of tokens taken before a stop (n when none) and checks the invariants. */
static size_t run(const struct fixture *f, const uint32_t *ids, size_t n, const char *const *stops,
                  size_t n_stops, char *out, size_t cap, size_t *n_pieces)
{
    size_t lens[8] = {0};
    for (size_t i = 0; i < n_stops; i++)
        lens[i] = strlen(stops[i]);
    struct text_out *o;
    assert_int_equal(text_out_new(f->tok, stops, lens, n_stops, &o), 0);
    size_t got = 0, taken = n;
    bool stopped = false;
    *n_pieces = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n) {
            int rc = text_out_push(o, ids[i]);
            assert_true(rc == 0 || rc == 1);
            if (rc == 1 && !stopped) {
                taken = i + 1;
                stopped = true;
            }
        } else {
            assert_int_equal(text_out_finish(o), 0);
        }
        const char *p;
        size_t k = text_out_take(o, &p);
        if (k) {
            (*n_pieces)++;
            assert_true(got + k < cap);
            memcpy(out + got, p, k);
            got += k;
        }
        assert_false(text_out_pending(o));
    }
    out[got] = 0;
    size_t len;
    const char *all = text_out_str(o, &len);
    assert_int_equal(len, got);
    assert_memory_equal(all, out, len);
    assert_int_equal(text_out_stopped(o), stopped);
    text_out_free(o);
    return taken;
}

static void test_plain(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {HELLO, WORLD, AB, C};
    char out[128];
    size_t np;
    assert_int_equal(run(f, ids, 4, NULL, 0, out, sizeof out, &np), 4);
    assert_string_equal(out, " Hello worldabc");
    assert_int_equal(np, 4);
}

/* A stop string made of several tokens, its first bytes held back until
 * the match is decided. */
static void test_stop_across_tokens(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {HELLO, AB, C, WORLD};
    const char *stops[] = {"bc w"};
    char out[128];
    size_t np;
    /* " Hello", then "ab": "b" could start "bc w", held back; "c" too;
     * the " world" piece completes the stop: the text ends at " Helloa". */
    assert_int_equal(run(f, ids, 4, stops, 1, out, sizeof out, &np), 4);
    assert_string_equal(out, " Helloa");
    assert_int_equal(np, 2); /* " Hello", then "a" ("b" held back: it may start "bc w") */
}

/* A partial match that fails is released, once, in order. */
static void test_partial_match_released(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {AB, X, AB, C};
    const char *stops[] = {"abc"};
    char out[128];
    size_t np;
    assert_int_equal(run(f, ids, 4, stops, 1, out, sizeof out, &np), 4);
    assert_string_equal(out, "abx");
    /* without the stop, everything */
    assert_int_equal(run(f, ids, 4, NULL, 0, out, sizeof out, &np), 4);
    assert_string_equal(out, "abxabc");
    /* a held-back partial match is released at the end */
    uint32_t tail[] = {X, AB};
    assert_int_equal(run(f, tail, 2, stops, 1, out, sizeof out, &np), 2);
    assert_string_equal(out, "xab");
}

/* The earliest of several stop strings wins; a stop inside one token. */
static void test_several_stops(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {X, STOP, AB, C};
    const char *stops[] = {"abc", "TOP"};
    char out[128];
    size_t np;
    assert_int_equal(run(f, ids, 4, stops, 2, out, sizeof out, &np), 2);
    assert_string_equal(out, "xS");
}

/* Characters split over byte tokens come out whole; invalid bytes become
 * U+FFFD; a stop string of a multi-byte character matches whole. */
static void test_utf8(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {3 + 0xC3, 3 + 0xA9, X, 3 + 0xE2, 3 + 0x82, X, 3 + 0xFF};
    char out[128];
    size_t np;
    assert_int_equal(run(f, ids, 7, NULL, 0, out, sizeof out, &np), 7);
    assert_string_equal(out, "\xc3\xa9x\xef\xbf\xbdx\xef\xbf\xbd");
    const char *stops[] = {"\xc3\xa9"};
    uint32_t ids2[] = {X, 3 + 0xC3, 3 + 0xA9, X};
    assert_int_equal(run(f, ids2, 4, stops, 1, out, sizeof out, &np), 3);
    assert_string_equal(out, "x");
    uint32_t ids3[] = {X, E_ACUTE, X};
    assert_int_equal(run(f, ids3, 3, stops, 1, out, sizeof out, &np), 2);
    assert_string_equal(out, "x");
}

/* Control tokens add no text; bad stop strings are refused. */
static void test_control_and_limits(void **state)
{
    struct fixture *f = *state;
    uint32_t ids[] = {1, X, 2, X};
    char out[64];
    size_t np;
    assert_int_equal(run(f, ids, 4, NULL, 0, out, sizeof out, &np), 4);
    assert_string_equal(out, "xx");
    struct text_out *o;
    const char *empty[] = {""};
    size_t zero = 0;
    assert_int_equal(text_out_new(f->tok, empty, &zero, 1, &o), KVD_EBADREQ);
    char big[TEXT_OUT_MAX_STOP_LEN + 2];
    memset(big, 'a', sizeof big);
    const char *bigs[] = {big};
    size_t bl = sizeof big;
    assert_int_equal(text_out_new(f->tok, bigs, &bl, 1, &o), KVD_EBADREQ);
}

/* Random token sequences and stop strings: the result equals cutting the
 * whole text at the first occurrence of any stop. */
static void test_random_against_reference(void **state)
{
    struct fixture *f = *state;
    uint64_t s = 12345;
    for (int iter = 0; iter < 2000; iter++) {
        uint32_t ids[24];
        size_t n = 1 + (size_t)(s % 24);
        for (size_t i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            uint32_t r = (uint32_t)(s >> 33) % 16;
            ids[i] = r < 8 ? P0 + r : 3 + (uint32_t)(unsigned char)"abc \xc3\xa9xSTOP"[r - 8];
        }
        char whole[512], out[512];
        size_t np;
        run(f, ids, n, NULL, 0, whole, sizeof whole, &np);
        const char *cands[] = {"bc",
                               "a",
                               "TOPx",
                               ("\xc3\xa9"
                                "a"),
                               " w",
                               "cS"};
        const char *stops[2];
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        stops[0] = cands[(s >> 33) % 6];
        stops[1] = cands[(s >> 40) % 6];
        run(f, ids, n, stops, 2, out, sizeof out, &np);
        /* reference: the earliest occurrence of either stop in the whole text */
        size_t cut = strlen(whole);
        for (int k = 0; k < 2; k++) {
            const char *p = strstr(whole, stops[k]);
            if (p && (size_t)(p - whole) < cut)
                cut = (size_t)(p - whole);
        }
        /* The whole text is the pieces of every token; a stop ends pushing,
         * so the reference is the whole text cut at the first stop. */
        whole[cut] = 0;
        assert_string_equal(out, whole);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain),
        cmocka_unit_test(test_stop_across_tokens),
        cmocka_unit_test(test_partial_match_released),
        cmocka_unit_test(test_several_stops),
        cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_control_and_limits),
        cmocka_unit_test(test_random_against_reference),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

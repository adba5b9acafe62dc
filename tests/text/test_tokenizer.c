/* test_tokenizer: the GGUF tokenizer on small hand-made vocabularies, with
 * results worked out by hand from llama.cpp's algorithms: SentencePiece
 * merges by score and byte fallback, byte-level BPE merges by rank,
 * special-token partition (parse_special, user-defined tokens, phi-3's
 * rstrip), BOS/EOS, end-of-generation ids, pieces, the SentencePiece leading
 * space, clean-up of spaces, U+FFFD for ill-formed UTF-8, the streaming
 * detokenizer (never a split character), and the refusals. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf.h"
#include "tokenizer.h"
#include "kvd/status.h"
#include "text/gguf_write.h"

/* ---- building vocabularies ----------------------------------------------------- */

struct tv {
    const char *text;
    float score;
    int32_t type;
};

#define N_ 1
#define C_ 3
#define U_ 4
#define B_ 6

struct loaded {
    uint8_t *file;
    struct gguf *g;
    struct tokenizer *t;
};

/* A vocabulary: SentencePiece ("llama") gets <unk> <s> </s> and the 256
 * byte tokens first (ids 0..258), then extra. */
static struct gw spm_vocab(const struct tv *extra, size_t n)
{
    struct gw w = {0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    size_t total = 3 + 256 + n;
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, total);
    gw_strn(&w, "<unk>", 5);
    gw_strn(&w, "<s>", 3);
    gw_strn(&w, "</s>", 4);
    for (int b = 0; b < 256; b++) {
        char t[8];
        snprintf(t, sizeof t, "<0x%02X>", b);
        gw_strn(&w, t, 6);
    }
    for (size_t i = 0; i < n; i++)
        gw_strn(&w, extra[i].text, strlen(extra[i].text));
    gw_kv_arr(&w, "tokenizer.ggml.scores", 6, total);
    float z = 0;
    for (int i = 0; i < 259; i++)
        gw_put(&w, &z, 4);
    for (size_t i = 0; i < n; i++)
        gw_put(&w, &extra[i].score, 4);
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, total);
    int32_t t2 = 2, t3 = 3, t6 = 6;
    gw_put(&w, &t2, 4);
    gw_put(&w, &t3, 4);
    gw_put(&w, &t3, 4);
    for (int b = 0; b < 256; b++)
        gw_put(&w, &t6, 4);
    for (size_t i = 0; i < n; i++)
        gw_put(&w, &extra[i].type, 4);
    return w;
}

#define SPM_ID(i) (259u + (uint32_t)(i)) /* id of extra[i] */

static int load(struct gw *w, struct loaded *l, char *err, size_t errlen)
{
    size_t len = 0;
    l->file = gw_finish(w, &len);
    gw_free(w);
    assert_non_null(l->file);
    struct kvd_error gerr = {0};
    int rc = gguf_parse(l->file, len, &l->g, &gerr);
    if (rc) {
        snprintf(err, errlen, "%s", gerr.message);
        free(l->file);
        return rc;
    }
    rc = tokenizer_load(l->g, &l->t, err, errlen);
    if (rc) {
        gguf_close(l->g);
        free(l->file);
    }
    return rc;
}

static void unload(struct loaded *l)
{
    tokenizer_free(l->t);
    gguf_close(l->g);
    free(l->file);
}

static void expect_ids(const struct tokenizer *t, const char *text, bool add_bos, bool special,
                       const uint32_t *want, size_t n_want)
{
    uint32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(t, text, strlen(text), add_bos, special, &ids, &n), 0);
    if (n != n_want || (n && memcmp(ids, want, n * sizeof(uint32_t)))) {
        fprintf(stderr, "text \"%s\": got", text);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %u", ids[i]);
        fprintf(stderr, ", want");
        for (size_t i = 0; i < n_want; i++)
            fprintf(stderr, " %u", want[i]);
        fprintf(stderr, "\n");
    }
    assert_int_equal(n, n_want);
    if (n)
        assert_memory_equal(ids, want, n * sizeof(uint32_t));
    free(ids);
}

#define EXPECT(t, text, bos, sp, ...)                                                              \
    do {                                                                                           \
        static const uint32_t w_[] = {__VA_ARGS__};                                                \
        expect_ids(t, text, bos, sp, w_, sizeof w_ / sizeof w_[0]);                                \
    } while (0)
#define EXPECT_NONE(t, text, bos, sp) expect_ids(t, text, bos, sp, NULL, 0)

static void expect_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, bool special,
                          const char *want)
{
    char *s;
    size_t len;
    assert_int_equal(tokenizer_decode(t, ids, n, special, &s, &len), 0);
    assert_int_equal(len, strlen(want));
    assert_string_equal(s, want);
    free(s);
}

#define DECODE(t, sp, want, ...)                                                                   \
    do {                                                                                           \
        static const uint32_t i_[] = {__VA_ARGS__};                                                \
        expect_decode(t, i_, sizeof i_ / sizeof i_[0], sp, want);                                  \
    } while (0)

/* ---- SentencePiece -------------------------------------------------------------- */

static const struct tv hello[] = {
    {"\xe2\x96\x81", -10, N_},        /* 0: ▁ */
    {"h", -10, N_},                   /* 1 */
    {"e", -10, N_},                   /* 2 */
    {"l", -10, N_},                   /* 3 */
    {"o", -10, N_},                   /* 4 */
    {"\xe2\x96\x81h", -1, N_},        /* 5: ▁h */
    {"\xe2\x96\x81he", -2, N_},       /* 6 */
    {"ll", -1.5f, N_},                /* 7 */
    {"llo", -3, N_},                  /* 8 */
    {"\xe2\x96\x81hello", -0.5f, N_}, /* 9 */
    {"<|im_end|>", 0, C_},            /* 10 */
    {"<tool>", 0, U_},                /* 11 */
    {"ab", -5, N_},                   /* 12 */
    {"bc", -5, N_},                   /* 13 */
    {"a", -10, N_},                   /* 14 */
    {"b", -10, N_},                   /* 15 */
    {"c", -10, N_},                   /* 16 */
};

static void test_spm_merges(void **state)
{
    (void)state;
    struct gw w = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const struct tokenizer *t = l.t;
    assert_int_equal(tokenizer_n_vocab(t), 259 + 17);
    assert_string_equal(tokenizer_model_name(t), "llama");
    /* ▁h (-1), ll (-1.5), ▁he (-2), llo (-3), then ▁hello */
    EXPECT(t, "hello", false, false, SPM_ID(9));
    /* BOS by default for SentencePiece */
    assert_true(tokenizer_add_bos_default(t));
    EXPECT(t, "hello", true, false, 1, SPM_ID(9));
    /* "hell": ▁h, ll, ▁he; ▁hell is no token */
    EXPECT(t, "hell", false, false, SPM_ID(6), SPM_ID(7));
    /* equal scores: the leftmost pair first (ab before bc) */
    EXPECT(t, "abc", false, false, SPM_ID(0), SPM_ID(12), SPM_ID(16));
    /* unknown characters fall back to their bytes: x, é */
    EXPECT(t, "x", false, false, SPM_ID(0), 3 + 'x');
    EXPECT(t, "\xc3\xa9", false, false, SPM_ID(0), 3 + 0xc3, 3 + 0xa9);
    /* ill-formed UTF-8 goes out as its bytes too */
    EXPECT(t, "\xff", false, false, SPM_ID(0), 3 + 0xff);
    /* the empty text: nothing, or BOS */
    EXPECT_NONE(t, "", false, false);
    EXPECT(t, "", true, false, 1);
    /* control tokens only with parse_special; after a special token the
     * next text gets the leading space again */
    EXPECT(t, "<|im_end|>hello", false, true, SPM_ID(10), SPM_ID(9));
    /* without parse_special the control text is text: < | ... as bytes */
    uint32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(t, "<|im_end|>", 10, false, false, &ids, &n), 0);
    assert_int_equal(n, 11); /* ▁ and ten bytes */
    assert_int_equal(ids[0], SPM_ID(0));
    assert_int_equal(ids[1], 3 + '<');
    free(ids);
    /* a text over the limit is refused before it is read */
    assert_int_equal(tokenizer_encode(t, "x", (size_t)TOK_MAX_TEXT + 1, false, false, &ids, &n),
                     KVD_ETOOLARGE);
    /* user-defined tokens split the text even without parse_special */
    EXPECT(t, "hello<tool>hello", false, false, SPM_ID(9), SPM_ID(11), SPM_ID(9));
    unload(&l);
}

/* A token across a word start ("a▁b"): the merges run over the whole text
 * (word-by-word merging would give ▁ a ▁ b). */
static void test_spm_spanning(void **state)
{
    (void)state;
    static const struct tv extra[] = {
        {"\xe2\x96\x81", -10, N_},
        {"a", -10, N_},
        {"b", -10, N_},
        {"a\xe2\x96\x81", -1, N_},
        {"a\xe2\x96\x81"
         "b",
         -0.5f, N_},
    };
    struct gw w = spm_vocab(extra, sizeof extra / sizeof extra[0]);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    EXPECT(l.t, "a b", false, false, SPM_ID(0), SPM_ID(4));
    unload(&l);
}

static void test_spm_decode(void **state)
{
    (void)state;
    struct gw w = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const struct tokenizer *t = l.t;
    /* the first token's leading space goes (add_space_prefix) */
    DECODE(t, false, "hello hello", SPM_ID(9), SPM_ID(9));
    /* a control token first (even one that prints nothing) uses up the rule */
    DECODE(t, false, " hello", 1, SPM_ID(9));
    DECODE(t, true, "<s> hello", 1, SPM_ID(9));
    /* control text only with special; user-defined always */
    DECODE(t, false, "hello<tool>", SPM_ID(9), SPM_ID(10), SPM_ID(11));
    DECODE(t, true, "hello<|im_end|><tool>", SPM_ID(9), SPM_ID(10), SPM_ID(11));
    /* byte tokens assemble UTF-8; a lone or cut sequence becomes U+FFFD
     * (one per maximal ill-formed subpart) */
    DECODE(t, false, "\xc3\xa9", 3 + 0xc3, 3 + 0xa9);
    DECODE(t, false, "\xef\xbf\xbd", 3 + 0xc3);
    DECODE(t, false,
           "\xef\xbf\xbd"
           "A",
           3 + 0xe2, 3 + 0x82, 3 + 'A');
    DECODE(t, false, "\xef\xbf\xbd\xef\xbf\xbd", 3 + 0xff, 3 + 0x80);
    /* pieces */
    char buf[64];
    assert_int_equal(tokenizer_piece(t, SPM_ID(9), false, buf, sizeof buf), 6);
    assert_memory_equal(buf, " hello", 6);
    assert_int_equal(tokenizer_piece(t, SPM_ID(10), false, buf, sizeof buf), 0);
    assert_int_equal(tokenizer_piece(t, SPM_ID(10), true, buf, sizeof buf), 10);
    assert_int_equal(tokenizer_piece(t, 3 + 0xc3, false, buf, sizeof buf), 1);
    assert_int_equal((uint8_t)buf[0], 0xc3);
    assert_int_equal(tokenizer_piece(t, 99999, true, buf, sizeof buf), 0);
    assert_int_equal(tokenizer_token_type(t, SPM_ID(11)), TOK_TYPE_USER_DEFINED);
    assert_int_equal(tokenizer_token_type(t, 5), TOK_TYPE_BYTE);
    assert_int_equal(tokenizer_find(t, "<tool>", 6), SPM_ID(11));
    assert_int_equal(tokenizer_find(t, "nope", 4), UINT32_MAX);
    /* ids out of range are skipped */
    DECODE(t, false, "hello", 123456, SPM_ID(9));
    unload(&l);
}

/* The streaming detokenizer: each push is well-formed UTF-8 (never a split
 * character) and everything equals the whole-sequence decode. */
static bool valid_utf8(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t b = (uint8_t)s[i];
        size_t k = b < 0x80                ? 1
                   : b >= 0xc2 && b < 0xe0 ? 2
                   : b >= 0xe0 && b < 0xf0 ? 3
                   : b >= 0xf0 && b < 0xf5 ? 4
                                           : 0;
        if (k == 0 || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if (((uint8_t)s[i + j] & 0xc0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

static void test_stream(void **state)
{
    (void)state;
    struct gw w = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const struct tokenizer *t = l.t;
    char out[TOK_STREAM_MAX_OUT];
    /* 😀 = F0 9F 98 80 fed byte by byte: nothing until the last */
    struct tok_stream *s = tok_stream_new(t, false);
    assert_non_null(s);
    assert_int_equal(tok_stream_push(s, SPM_ID(9), out, sizeof out), 5);
    assert_string_equal(out, "hello");
    static const uint8_t emoji[] = {0xf0, 0x9f, 0x98, 0x80};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tok_stream_push(s, 3u + emoji[i], out, sizeof out), 0);
        assert_string_equal(out, "");
    }
    assert_int_equal(tok_stream_push(s, 3u + emoji[3], out, sizeof out), 4);
    assert_memory_equal(out, emoji, 4);
    /* an unfinished character at the end: U+FFFD at flush */
    assert_int_equal(tok_stream_push(s, 3u + 0xe2, out, sizeof out), 0);
    assert_int_equal(tok_stream_flush(s, out, sizeof out), 3);
    assert_string_equal(out, "\xef\xbf\xbd");
    /* after a flush the stream is as new: the leading space goes again */
    assert_int_equal(tok_stream_push(s, SPM_ID(9), out, sizeof out), 5);
    tok_stream_free(s);

    /* random sequences of byte and word tokens */
    uint64_t st = 1;
    for (int round = 0; round < 2000; round++) {
        uint32_t ids[24];
        size_t n = 1 + round % 24;
        for (size_t i = 0; i < n; i++) {
            st = st * 6364136223846793005ULL + 1442695040888963407ULL;
            uint32_t r = (uint32_t)(st >> 33);
            ids[i] = r % 3 == 0 ? SPM_ID(r % 17) : 3 + (r % 256);
            if (r % 7 == 0) /* well-formed multi-byte starts */
                ids[i] = 3 + 0xc3 + (r % 3) * 0x10;
        }
        bool sp = round & 1;
        char *whole;
        size_t wl;
        assert_int_equal(tokenizer_decode(t, ids, n, sp, &whole, &wl), 0);
        assert_true(valid_utf8(whole, wl));
        s = tok_stream_new(t, sp);
        char acc[24 * 64];
        size_t al = 0;
        for (size_t i = 0; i < n; i++) {
            size_t k = tok_stream_push(s, ids[i], out, sizeof out);
            assert_int_equal(out[k], 0); /* NUL-terminated (a <0x00> token is a NUL inside) */
            assert_true(valid_utf8(out, k));
            memcpy(acc + al, out, k);
            al += k;
        }
        size_t k = tok_stream_flush(s, out, sizeof out);
        memcpy(acc + al, out, k);
        al += k;
        assert_int_equal(al, wl);
        assert_memory_equal(acc, whole, wl);
        tok_stream_free(s);
        free(whole);
    }
    unload(&l);
}

/* ---- byte-level BPE ---------------------------------------------------------------- */

/* Byte-level characters: 'Ġ' is the space (U+0120), 'Ċ' the newline. */
static struct gw bpe_vocab(const char *pre, const char *const *toks, const int32_t *types, size_t n,
                           const char *const *merges, size_t nm)
{
    struct gw w = {0};
    gw_kv_str(&w, "tokenizer.ggml.model", "gpt2");
    if (pre)
        gw_kv_str(&w, "tokenizer.ggml.pre", pre);
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, n);
    for (size_t i = 0; i < n; i++)
        gw_strn(&w, toks[i], strlen(toks[i]));
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, n);
    for (size_t i = 0; i < n; i++)
        gw_put(&w, &types[i], 4);
    gw_kv_arr(&w, "tokenizer.ggml.merges", 8, nm);
    for (size_t i = 0; i < nm; i++)
        gw_strn(&w, merges[i], strlen(merges[i]));
    return w;
}

static const char *const btoks[] = {
    "a",
    "b",
    "c",
    "\xc4\xa0",
    "?",
    "'",
    "s",
    "ab",
    "abc",
    "\xc4\xa0"
    "a",
    "\xc4\xa0"
    "ab",
    "<|endoftext|>",
    "<|im_end|>",
    "x",
    "\xc3\xaf",
    "\xc2\xbf",
    "\xc2\xbd",
    "1",
    "2",
    "3",
    "4",
    "<|eot_id|>",
    "<unused9>",
    "12",
    "123",
    "!",
    ".",
    "\xc4\x8a",
    "m",
    "r",
    "e",
    "v",
    "\xc4\xa0"
    "abc",
};
static const int32_t btypes[] = {N_, N_, N_, N_, N_, N_, N_, N_, N_, N_, N_, C_, C_, N_, N_, N_, N_,
                                 N_, N_, N_, N_, C_, C_, N_, N_, N_, N_, N_, N_, N_, N_, N_, N_};
static const char *const bmerges[] = {"a b",
                                      "\xc4\xa0 a",
                                      "ab c",
                                      ("\xc4\xa0"
                                       "a b"),
                                      "1 2",
                                      "12 3",
                                      "nomerge"};
#define NB (sizeof btoks / sizeof btoks[0])

static void test_bpe(void **state)
{
    (void)state;
    assert_int_equal(sizeof btypes / sizeof btypes[0], NB);
    struct gw w = bpe_vocab("gpt-2", btoks, btypes, NB, bmerges, 7);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const struct tokenizer *t = l.t;
    assert_string_equal(tokenizer_pre_name(t), "gpt-2");
    assert_false(tokenizer_add_bos_default(t));
    /* "abc": a b -> ab (rank 0), ab c -> abc (rank 2) */
    EXPECT(t, "abc", false, false, 8);
    /* " abc" is the word Ġabc: a b (rank 0) goes first, which leaves Ġ a
     * (rank 1) stale; ab c (2) -> abc; "Ġ abc" is no merge */
    EXPECT(t, " abc", false, false, 3, 8);
    /* gpt-2 splits 's off and ? apart; "Ġ?" is no token: Ġ and ? */
    EXPECT(t, "abc's ?", false, false, 8, 5, 6, 3, 4);
    /* digits: one word, merged 1 2 -> 12, 12 3 -> 123; 4 alone */
    EXPECT(t, "1234", false, false, 24, 20);
    /* ill-formed UTF-8: U+FFFD, byte-encoded as ï ¿ ½ */
    EXPECT(t, "\xff", false, false, 14, 15, 16);
    /* a character with no token at all is dropped, as llama.cpp does */
    EXPECT_NONE(t, "z", false, false);
    /* special text: control tokens only with parse_special */
    EXPECT(t, "abc<|im_end|>", false, true, 8, 12);
    uint32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(t, "<|im_end|>", 10, false, false, &ids, &n), 0);
    assert_true(n > 1);
    free(ids);
    /* decode: byte-level characters back to bytes; clean_up_tokenization_spaces
     * (gpt-2 has it): " ?" loses its space, " 's" too */
    DECODE(t, false, "abc?", 8, 3, 4);
    DECODE(t, false, "abc's", 8, 3, 5, 6);
    DECODE(t, false, "abc'm", 8, 3, 5, 28); /* 'm: the space goes */
    DECODE(t, false, "'", 3, 5, 3);         /* " ' " becomes "'" */
    DECODE(t, false, "abc're", 8, 3, 5, 29, 30);
    DECODE(t, false, "abc 'v", 8, 3, 5, 31);
    DECODE(t, false, "abc!.", 8, 3, 25, 3, 26);
    /* end of generation: eos (none set: the gpt2 default 11 is <|endoftext|>),
     * <|im_end|>, <|eot_id|>; <unused9> is control but unused */
    assert_int_equal(tokenizer_eos(t), 11);
    assert_true(tokenizer_is_eog(t, 11));
    assert_true(tokenizer_is_eog(t, 12));
    assert_true(tokenizer_is_eog(t, 21));
    assert_false(tokenizer_is_eog(t, 22));
    assert_false(tokenizer_is_eog(t, 0));
    uint32_t eog[8];
    assert_int_equal(tokenizer_eog_ids(t, eog, 8), 3);
    assert_int_equal(eog[0], 11);
    assert_int_equal(eog[1], 12);
    assert_int_equal(eog[2], 21);
    unload(&l);

    /* llama-bpe: BOS by default, and ignore_merges: a word that is a token
     * is taken whole ("Ġabc" though no merge builds it) */
    w = bpe_vocab("llama-bpe", btoks, btypes, NB, bmerges, 7);
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    assert_true(tokenizer_add_bos_default(l.t));
    EXPECT(l.t, " abc", false, false, 32);
    /* llama3 splits digits in threes */
    EXPECT(l.t, "1234", false, false, 24, 20);
    EXPECT(l.t, " abc", true, false, 11, 32);
    unload(&l);
}

static void test_phi3_rstrip(void **state)
{
    (void)state;
    static const struct tv extra[] = {
        {"<|user|>", 0, C_},      {"<|end|>", 0, C_},
        {"<|endoftext|>", 0, C_}, {"\xe2\x96\x81", -10, N_},
        {"h", -10, N_},           {"i", -10, N_},
        {"hi", -1, N_},           {"\xe2\x96\x81hi", -0.5f, N_},
    };
    struct gw w = spm_vocab(extra, sizeof extra / sizeof extra[0]);
    gw_kv_str(&w, "general.name", "Phi3-mini");
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    /* special tokens eat the whitespace after them: "\n hi" -> "hi", which
     * then gets the SentencePiece space: ▁hi */
    EXPECT(l.t, "<|user|>\n hi<|end|>", false, true, SPM_ID(0), SPM_ID(7), SPM_ID(1));
    /* <s> keeps what follows */
    EXPECT(l.t, "<s> hi", false, true, 1, SPM_ID(3), SPM_ID(7));
    unload(&l);
}

/* Random bytes (ill-formed UTF-8, NULs, special-token-like text) through
 * both kinds of vocabulary: no crash, ids in range, well-formed output, and
 * SentencePiece's byte fallback round-trips well-formed text. */
static void test_random_bytes(void **state)
{
    (void)state;
    struct gw w1 = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct gw w2 = bpe_vocab("tekken", btoks, btypes, NB, bmerges, 7);
    struct loaded spm, bpe;
    char err[256];
    assert_int_equal(load(&w1, &spm, err, sizeof err), 0);
    assert_int_equal(load(&w2, &bpe, err, sizeof err), 0);
    static const char alphabet[] = "abchelo '?!.,1234\n\t<|>_/\xc3\xa9\xe2\x96\x81\xf0\x9f\x98\x80";
    uint64_t st = 7;
    for (int round = 0; round < 3000; round++) {
        char text[64];
        size_t n = (size_t)(round % 48);
        for (size_t i = 0; i < n; i++) {
            st = st * 6364136223846793005ULL + 1442695040888963407ULL;
            uint32_t r = (uint32_t)(st >> 33);
            text[i] = r % 4 == 0 ? (char)(r >> 8) : alphabet[(r >> 8) % (sizeof alphabet - 1)];
        }
        for (int k = 0; k < 2; k++) {
            const struct tokenizer *t = k ? bpe.t : spm.t;
            for (int sp = 0; sp < 2; sp++) {
                uint32_t *ids;
                size_t ni;
                assert_int_equal(tokenizer_encode(t, text, n, sp, sp, &ids, &ni), 0);
                for (size_t i = 0; i < ni; i++)
                    assert_true(ids[i] < tokenizer_n_vocab(t));
                /* The bounded encoder: the same ids at the exact bound, and
                 * too_large one below it. */
                uint32_t *bi;
                size_t bn;
                assert_int_equal(tokenizer_encode_max(t, text, n, sp, sp, ni, &bi, &bn), 0);
                assert_int_equal(bn, ni);
                assert_memory_equal(bi, ids, ni * sizeof(uint32_t));
                free(bi);
                if (ni > 0)
                    assert_int_equal(tokenizer_encode_max(t, text, n, sp, sp, ni - 1, &bi, &bn),
                                     KVD_ETOOLARGE);
                char *d;
                size_t dl;
                assert_int_equal(tokenizer_decode(t, ids, ni, sp, &d, &dl), 0);
                assert_true(valid_utf8(d, dl));
                /* The bounded decoder: the same text at its length, too_large
                 * below. */
                char *bd;
                size_t bdl;
                assert_int_equal(tokenizer_decode_max(t, ids, ni, sp, dl, &bd, &bdl), 0);
                assert_int_equal(bdl, dl);
                assert_memory_equal(bd, d, dl);
                free(bd);
                if (dl > 0)
                    assert_int_equal(tokenizer_decode_max(t, ids, ni, sp, dl - 1, &bd, &bdl),
                                     KVD_ETOOLARGE);
                if (k == 0 && sp == 0 && valid_utf8(text, n) && !memmem(text, n, "<tool>", 6) &&
                    !memmem(text, n, "\xe2\x96\x81", 3)) {
                    /* well-formed text without U+2581 (which SentencePiece
                     * decodes as a space) or special text comes back */
                    assert_int_equal(dl, n);
                    assert_memory_equal(d, text, n);
                }
                free(d);
                free(ids);
            }
        }
    }
    unload(&spm);
    unload(&bpe);
}

static void test_refused(void **state)
{
    (void)state;
    struct loaded l;
    char err[256];
    /* no tokenizer at all */
    struct gw w = {0};
    gw_kv_str(&w, "general.name", "x");
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_ENOTFOUND);
    /* a model type kvd does not implement */
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "bert");
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EUNSUPPORTED);
    assert_non_null(strstr(err, "bert"));
    /* pre-tokenizers: known to llama.cpp but not implemented, and unknown */
    w = bpe_vocab("deepseek-v3", btoks, btypes, NB, bmerges, 7);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EUNSUPPORTED);
    assert_non_null(strstr(err, "does not implement"));
    w = bpe_vocab("made-up", btoks, btypes, NB, bmerges, 7);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EUNSUPPORTED);
    assert_non_null(strstr(err, "unknown pre-tokenizer"));
    /* corrupt metadata */
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "gpt2");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, 1);
    gw_strn(&w, "a", 1);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EBADREQ); /* no merges */
    assert_non_null(strstr(err, "merges"));
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_u32(&w, "tokenizer.ggml.tokens", 3);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EBADREQ);
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, 2);
    gw_strn(&w, "a", 1);
    gw_strn(&w, "a", 1);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EBADREQ); /* same text twice */
    assert_non_null(strstr(err, "same text"));
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, 2);
    gw_strn(&w, "a", 1);
    gw_strn(&w, "b", 1);
    gw_kv_arr(&w, "tokenizer.ggml.scores", 6, 1);
    float z = 0;
    gw_put(&w, &z, 4);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EBADREQ); /* too few scores */
    assert_non_null(strstr(err, "scores"));
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, 1);
    gw_strn(&w, "a", 1);
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 6, 1); /* f32: wrong type */
    gw_put(&w, &z, 4);
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EBADREQ);
    /* a token longer than kvd takes */
    char *big = malloc(TOK_MAX_TOKEN_TEXT + 2);
    memset(big, 'x', TOK_MAX_TOKEN_TEXT + 1);
    big[TOK_MAX_TOKEN_TEXT + 1] = 0;
    w = (struct gw){0};
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, 1);
    gw_strn(&w, big, strlen(big));
    assert_int_equal(load(&w, &l, err, sizeof err), KVD_EUNSUPPORTED);
    free(big);
}

/* ---- caps ------------------------------------------------------------------------ */

/* The capped forms give the uncapped ids / text up to their cap and
 * KVD_ETOOLARGE one below it, on random texts of both vocabularies. */
static void test_caps_exact(void **state)
{
    (void)state;
    struct gw w1 = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct gw w2 = bpe_vocab("llama-bpe", btoks, btypes, NB, bmerges, 7);
    struct loaded spm, bpe;
    char err[256];
    assert_int_equal(load(&w1, &spm, err, sizeof err), 0);
    assert_int_equal(load(&w2, &bpe, err, sizeof err), 0);
    static const char *const words[] = {"hello", " ",    "abc", "<|im_end|>", "<tool>",
                                        "'s",    "1234", "\n",  "\xc3\xa9",   "x"};
    uint64_t st = 11;
    for (int round = 0; round < 500; round++) {
        char text[256];
        size_t n = 0;
        for (int k = round % 12; k > 0; k--) {
            st = st * 6364136223846793005ULL + 1442695040888963407ULL;
            const char *wd = words[(st >> 33) % (sizeof words / sizeof words[0])];
            memcpy(text + n, wd, strlen(wd));
            n += strlen(wd);
        }
        for (int k = 0; k < 2; k++) {
            const struct tokenizer *t = k ? bpe.t : spm.t;
            for (int sp = 0; sp < 2; sp++) {
                uint32_t *ids, *capped;
                size_t ni, nc;
                assert_int_equal(tokenizer_encode(t, text, n, sp, sp, &ids, &ni), 0);
                assert_int_equal(tokenizer_encode_max(t, text, n, sp, sp, ni, &capped, &nc), 0);
                assert_int_equal(nc, ni);
                if (ni)
                    assert_memory_equal(capped, ids, ni * sizeof(uint32_t));
                free(capped);
                if (ni) {
                    assert_int_equal(tokenizer_encode_max(t, text, n, sp, sp, ni - 1, &capped, &nc),
                                     KVD_ETOOLARGE);
                    assert_null(capped);
                    assert_int_equal(nc, 0);
                }
                char *d, *dc;
                size_t dl, dcl;
                assert_int_equal(tokenizer_decode(t, ids, ni, sp, &d, &dl), 0);
                assert_int_equal(tokenizer_decode_max(t, ids, ni, sp, dl, &dc, &dcl), 0);
                assert_int_equal(dcl, dl);
                assert_memory_equal(dc, d, dl + 1);
                free(dc);
                if (dl) {
                    assert_int_equal(tokenizer_decode_max(t, ids, ni, sp, dl - 1, &dc, &dcl),
                                     KVD_ETOOLARGE);
                    assert_null(dc);
                }
                free(d);
                free(ids);
            }
        }
    }
    unload(&spm);
    unload(&bpe);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A 60 MiB text, words or special tokens, with a cap of 1000 ids: refused
 * KVD_ETOOLARGE (encoding stops at the cap; the time is printed, not
 * checked). */
static void test_cap_long_text(void **state)
{
    (void)state;
    struct gw w1 = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct gw w2 = bpe_vocab("llama-bpe", btoks, btypes, NB, bmerges, 7);
    struct loaded spm, bpe;
    char err[256];
    assert_int_equal(load(&w1, &spm, err, sizeof err), 0);
    assert_int_equal(load(&w2, &bpe, err, sizeof err), 0);
    const size_t len = 60u << 20;
    char *text = malloc(len);
    assert_non_null(text);
    static const char *const fills[] = {"hello world abc ", "<|im_end|><tool>"};
    for (int f = 0; f < 2; f++) {
        for (size_t i = 0; i < len; i++)
            text[i] = fills[f][i % 16];
        for (int k = 0; k < 2; k++) {
            uint32_t *ids;
            size_t n;
            double t0 = now_s();
            assert_int_equal(
                tokenizer_encode_max(k ? bpe.t : spm.t, text, len, true, true, 1000, &ids, &n),
                KVD_ETOOLARGE);
            assert_null(ids);
            printf("60 MiB of \"%s\", %s, cap 1000: too large in %.3f s\n", fills[f],
                   k ? "bpe" : "spm", now_s() - t0);
        }
    }
    free(text);
    unload(&spm);
    unload(&bpe);
}

/* Many special tokens of two kinds: each one that occurs splits the
 * fragments once (linear), not with a shift of every later fragment per
 * occurrence (quadratic: the former partition took hours on this text). */
static void test_many_specials(void **state)
{
    (void)state;
    struct gw w = spm_vocab(hello, sizeof hello / sizeof hello[0]);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const char unit[] = "hello<tool>hello<|im_end|>";
    const size_t reps = 100000, ul = sizeof unit - 1;
    char *text = malloc(reps * ul);
    assert_non_null(text);
    for (size_t i = 0; i < reps; i++)
        memcpy(text + i * ul, unit, ul);
    uint32_t *ids;
    size_t n;
    double t0 = now_s();
    assert_int_equal(tokenizer_encode(l.t, text, reps * ul, false, true, &ids, &n), 0);
    printf("%zu special tokens: %zu ids in %.3f s\n", 2 * reps, n, now_s() - t0);
    assert_int_equal(n, 4 * reps);
    for (size_t i = 0; i < reps; i++) {
        assert_int_equal(ids[4 * i], SPM_ID(9));
        assert_int_equal(ids[4 * i + 1], SPM_ID(11));
        assert_int_equal(ids[4 * i + 2], SPM_ID(9));
        assert_int_equal(ids[4 * i + 3], SPM_ID(10));
    }
    free(ids);
    /* capped: the partition alone finds more special tokens than the cap */
    assert_int_equal(tokenizer_encode_max(l.t, text, reps * ul, false, true, 1000, &ids, &n),
                     KVD_ETOOLARGE);
    free(text);
    unload(&l);
}

/* 1M copies of a 1024-byte token: 1 GiB of text, refused past 64 MiB. */
static void test_decode_cap(void **state)
{
    (void)state;
    char *big = malloc(TOK_MAX_TOKEN_TEXT + 1);
    assert_non_null(big);
    memset(big, 'q', TOK_MAX_TOKEN_TEXT);
    big[TOK_MAX_TOKEN_TEXT] = 0;
    struct tv extra[] = {{big, -1, N_}};
    struct gw w = spm_vocab(extra, 1);
    struct loaded l;
    char err[256];
    assert_int_equal(load(&w, &l, err, sizeof err), 0);
    const size_t n = 1u << 20;
    uint32_t *ids = malloc(n * sizeof(uint32_t));
    assert_non_null(ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = SPM_ID(0);
    char *s;
    size_t len;
    double t0 = now_s();
    assert_int_equal(tokenizer_decode_max(l.t, ids, n, false, 64u << 20, &s, &len), KVD_ETOOLARGE);
    printf("1M x 1024-byte token, cap 64 MiB: too large in %.3f s\n", now_s() - t0);
    assert_null(s);
    /* 65536 of them are exactly 64 MiB */
    assert_int_equal(tokenizer_decode_max(l.t, ids, 65536, false, 64u << 20, &s, &len), 0);
    assert_int_equal(len, 64u << 20);
    assert_int_equal(s[len - 1], 'q');
    assert_int_equal(s[len], 0);
    free(s);
    free(ids);
    free(big);
    unload(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spm_merges),    cmocka_unit_test(test_spm_spanning),
        cmocka_unit_test(test_spm_decode),    cmocka_unit_test(test_stream),
        cmocka_unit_test(test_bpe),           cmocka_unit_test(test_phi3_rstrip),
        cmocka_unit_test(test_refused),       cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_caps_exact),    cmocka_unit_test(test_cap_long_text),
        cmocka_unit_test(test_many_specials), cmocka_unit_test(test_decode_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

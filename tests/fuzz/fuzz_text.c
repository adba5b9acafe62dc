/* fuzz_text: libFuzzer target for the text layer, whose inputs come from
 * clients (prompts, stop strings, conversations) and from model files
 * (chat templates). The first byte picks what the rest is:
 *   0: text for the SentencePiece tokenizer, 1: for the byte-level BPE one
 *      (llama-bpe pre-tokenizer), each with special-token parsing on and
 *      off; oracles: every id is in the vocabulary, the streaming
 *      detokenizer's pieces add up to tokenizer_decode's text, which is
 *      valid UTF-8;
 *   2: a chat template, parsed and rendered over a fixed conversation;
 *      oracles: a refusal has a message, a render is NUL-terminated with
 *      the length it says;
 *   3: stop strings (NUL-separated, the first 64 bytes) then token ids (two
 *      bytes each) for text_out; oracles: the taken pieces add up to the
 *      text, which never holds a stop string;
 *   4: a completion for the tool-call parser (the next byte: the family,
 *      incremental commits), fed whole and in pieces; oracles: both give
 *      the same content and calls, content and calls only grow, and
 *      without calls the content is the text;
 *   5: a conversation as JSON ({"messages", "tools"}) prepared for each
 *      tool-call family; oracle: the messages come back an array.
 * The vocabularies are built in memory once (tests/text/gguf_write.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template.h"
#include "fuzz_env.h"
#include "gguf.h"
#include "kvd/status.h"
#include "text/gguf_write.h"
#include "text_out.h"
#include "tokenizer.h"
#include "tool_call.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TEXT_MAX_INPUT (64 << 10)

static struct tokenizer *spm, *bpe;
static struct gguf *g_spm, *g_bpe;
static uint8_t *f_spm, *f_bpe;

static const char *const spm_pieces[] = {
    "\xe2\x96\x81the", "\xe2\x96\x81\x61", "er",        "in", "th",
    "\xe2\x96\x81",    "<|im_start|>",     "<|im_end|>"};

static void spm_build(void)
{
    struct gw w = {0};
    char name[16];
    uint32_t n = 3 + 256 + (uint32_t)(sizeof spm_pieces / sizeof *spm_pieces);
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, n);
    for (uint32_t i = 0; i < n; i++) {
        const char *s = name;
        if (i < 3)
            s = (const char *[]){"<unk>", "<s>", "</s>"}[i];
        else if (i < 259)
            snprintf(name, sizeof name, "<0x%02X>", i - 3);
        else
            s = spm_pieces[i - 259];
        gw_strn(&w, s, strlen(s));
    }
    gw_kv_arr(&w, "tokenizer.ggml.scores", 6, n);
    for (uint32_t i = 0; i < n; i++) {
        float sc = -(float)i;
        gw_put(&w, &sc, 4);
    }
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, n);
    for (uint32_t i = 0; i < n; i++) {
        int32_t t = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : i >= n - 2 ? 3 : 1;
        gw_put(&w, &t, 4);
    }
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 1);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 2);
    size_t len;
    struct kvd_error err = {0}; /* tokenizer_load writes into its message */
    f_spm = gw_finish(&w, &len);
    gw_free(&w);
    if (!f_spm || gguf_parse(f_spm, len, &g_spm, &err) ||
        tokenizer_load(g_spm, &spm, err.message, sizeof err.message)) {
        fprintf(stderr, "fuzz_text: spm vocabulary: %s\n", err.message);
        abort();
    }
}

/* GPT-2's byte-to-unicode map: printable bytes stand for themselves, the
 * others for U+0100 onwards, in byte order. */
static size_t byte_symbol(unsigned b, char *out)
{
    unsigned cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)) {
        unsigned k = 0;
        for (unsigned x = 0; x < b; x++)
            k += !((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174);
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static void bpe_build(void)
{
    static const char *const merges[] = {"\xc4\xa0 t", "t h", "\xc4\xa0t h",      "i n", "e r",
                                         "\xc4\xa0 a", "o n", "\xc4\xa0 \xc4\xa0"};
    static const char *const merged[] = {"\xc4\xa0t",    "th", "\xc4\xa0th",      "in", "er",
                                         "\xc4\xa0\x61", "on", "\xc4\xa0\xc4\xa0"};
    static const char *const specials[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"};
    size_t n_m = sizeof merges / sizeof *merges, n_s = sizeof specials / sizeof *specials;
    uint32_t n = 256 + (uint32_t)n_m + (uint32_t)n_s;
    struct gw w = {0};
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_str(&w, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(&w, "tokenizer.ggml.pre", "llama-bpe");
    gw_kv_arr(&w, "tokenizer.ggml.tokens", 8, n);
    for (unsigned b = 0; b < 256; b++) {
        char s[2];
        size_t l = byte_symbol(b, s);
        gw_strn(&w, s, l);
    }
    for (size_t i = 0; i < n_m; i++)
        gw_strn(&w, merged[i], strlen(merged[i]));
    for (size_t i = 0; i < n_s; i++)
        gw_strn(&w, specials[i], strlen(specials[i]));
    gw_kv_arr(&w, "tokenizer.ggml.token_type", 5, n);
    for (uint32_t i = 0; i < n; i++) {
        int32_t t = i >= 256 + n_m ? 3 : 1;
        gw_put(&w, &t, 4);
    }
    gw_kv_arr(&w, "tokenizer.ggml.merges", 8, n_m);
    for (size_t i = 0; i < n_m; i++)
        gw_strn(&w, merges[i], strlen(merges[i]));
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", (uint32_t)(256 + n_m));
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", (uint32_t)(256 + n_m + 1));
    size_t len;
    struct kvd_error err = {0}; /* tokenizer_load writes into its message */
    f_bpe = gw_finish(&w, &len);
    gw_free(&w);
    if (!f_bpe || gguf_parse(f_bpe, len, &g_bpe, &err) ||
        tokenizer_load(g_bpe, &bpe, err.message, sizeof err.message)) {
        fprintf(stderr, "fuzz_text: bpe vocabulary: %s\n", err.message);
        abort();
    }
}

static bool utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

static void tokenize_case(const struct tokenizer *t, const char *s, size_t n)
{
    for (int special = 0; special < 2; special++) {
        uint32_t *ids = NULL;
        size_t n_ids = 0;
        int rc = tokenizer_encode(t, s, n, special, special, &ids, &n_ids);
        FUZZ_ASSERT(rc == 0 || rc == KVD_ENOMEM);
        if (rc)
            continue;
        uint32_t nv = tokenizer_n_vocab(t);
        for (size_t i = 0; i < n_ids; i++)
            FUZZ_ASSERT(ids[i] < nv);
        char *text = NULL;
        size_t len = 0;
        FUZZ_ASSERT(tokenizer_decode(t, ids, n_ids, special, &text, &len) == 0);
        FUZZ_ASSERT(strlen(text) <= len && utf8_valid((const unsigned char *)text, len));
        /* the stream's pieces add up to the whole decode */
        struct tok_stream *ts = tok_stream_new(t, special);
        FUZZ_ASSERT(ts != NULL);
        char *acc = malloc(len + 1);
        char piece[TOK_STREAM_MAX_OUT];
        size_t got = 0;
        for (size_t i = 0; i <= n_ids; i++) {
            size_t k = i < n_ids ? tok_stream_push(ts, ids[i], piece, sizeof piece)
                                 : tok_stream_flush(ts, piece, sizeof piece);
            FUZZ_ASSERT(got + k <= len);
            memcpy(acc + got, piece, k);
            got += k;
        }
        FUZZ_ASSERT(got == len && memcmp(acc, text, len) == 0);
        free(acc);
        tok_stream_free(ts);
        free(text);
        free(ids);
    }
}

static void template_case(const char *s, size_t n)
{
    struct chat_template *t = NULL;
    char err[256] = "";
    int rc = chat_template_parse(s, n, &t, err, sizeof err);
    if (rc) {
        FUZZ_ASSERT(t == NULL && err[0]);
        return;
    }
    static const struct chat_msg msgs[] = {
        {"system", "Be brief."}, {"user", "hi"}, {"assistant", "hello"}, {"user", "and?"}};
    static const struct {
        size_t first, n;
        bool gen;
    } convs[] = {{1, 1, true}, {0, 4, false}, {1, 3, true}};
    for (size_t k = 0; k < sizeof convs / sizeof *convs; k++) {
        char *out = NULL;
        size_t len = 0;
        err[0] = 0;
        rc = chat_template_render(t, msgs + convs[k].first, convs[k].n, convs[k].gen, "<s>", "</s>",
                                  &out, &len, err, sizeof err);
        if (rc) {
            FUZZ_ASSERT(out == NULL && err[0]);
        } else {
            FUZZ_ASSERT(out != NULL && strlen(out) <= len && out[len] == 0);
            free(out);
        }
    }
    chat_template_free(t);
}

static void text_out_case(const uint8_t *d, size_t n)
{
    const char *stops[8];
    size_t lens[8], n_stops = 0, head = n < 64 ? n : 64;
    for (size_t i = 0, start = 0; i <= head && n_stops < 8; i++)
        if (i == head || d[i] == 0) {
            if (i > start && i - start <= TEXT_OUT_MAX_STOP_LEN) {
                stops[n_stops] = (const char *)d + start;
                lens[n_stops++] = i - start;
            }
            start = i + 1;
        }
    struct text_out *o = NULL;
    FUZZ_ASSERT(text_out_new(spm, stops, lens, n_stops, &o) == 0);
    char *acc = malloc(64 * 1024);
    size_t got = 0;
    uint32_t nv = tokenizer_n_vocab(spm);
    for (size_t i = head; i + 1 < n && i < head + 2 * 4096; i += 2) {
        int rc = text_out_push(o, ((uint32_t)d[i] << 8 | d[i + 1]) % nv);
        FUZZ_ASSERT(rc == 0 || rc == 1);
        const char *p;
        size_t k = text_out_take(o, &p);
        FUZZ_ASSERT(got + k <= 64 * 1024);
        memcpy(acc + got, p, k);
        got += k;
        if (rc == 1)
            break;
    }
    FUZZ_ASSERT(text_out_finish(o) == 0);
    const char *p;
    size_t k = text_out_take(o, &p);
    FUZZ_ASSERT(got + k <= 64 * 1024);
    memcpy(acc + got, p, k);
    got += k;
    size_t len;
    const char *all = text_out_str(o, &len);
    FUZZ_ASSERT(len == got && memcmp(all, acc, len) == 0);
    for (size_t s = 0; s < n_stops; s++)
        FUZZ_ASSERT(!memmem(all, len, stops[s], lens[s]));
    free(acc);
    text_out_free(o);
}

/* The parser of conf over d, whole (step 0) or in pieces (their lengths
 * from the bytes themselves); checks that content and calls only grow. */
static struct tool_parse *tool_run(const struct tool_parse_conf *conf, const char *d, size_t n,
                                   bool pieces)
{
    struct tool_parse *p;
    FUZZ_ASSERT(tool_parse_new(conf, &p) == 0);
    size_t clen = 0, ncalls = 0;
    for (size_t at = 0; at < n;) {
        size_t k = pieces ? 1 + (size_t)((unsigned char)d[at] % 7) : n;
        k = k > n - at ? n - at : k;
        FUZZ_ASSERT(tool_parse_push(p, d + at, k) == 0);
        at += k;
        size_t cl;
        tool_parse_content(p, &cl);
        FUZZ_ASSERT(cl >= clen && tool_parse_n_calls(p) >= ncalls);
        clen = cl;
        ncalls = tool_parse_n_calls(p);
    }
    FUZZ_ASSERT(tool_parse_finish(p) == 0);
    return p;
}

static void tool_parse_case(const uint8_t *d, size_t n)
{
    if (n == 0)
        return;
    struct tool_parse_conf conf = {.family = (enum tool_family)(d[0] % 4), .incremental = d[0] & 4};
    const char *t = (const char *)d + 1;
    struct tool_parse *a = tool_run(&conf, t, n - 1, false), *b = tool_run(&conf, t, n - 1, true);
    size_t la, lb;
    const char *ca = tool_parse_content(a, &la), *cb = tool_parse_content(b, &lb);
    FUZZ_ASSERT(la == lb && !memcmp(ca, cb, la));
    FUZZ_ASSERT(tool_parse_n_calls(a) == tool_parse_n_calls(b));
    for (size_t i = 0; i < tool_parse_n_calls(a); i++) {
        const struct tool_call_out *x = tool_parse_call(a, i), *y = tool_parse_call(b, i);
        FUZZ_ASSERT(!strcmp(x->name, y->name) && x->args_len == y->args_len &&
                    !memcmp(x->args, y->args, x->args_len));
    }
    if (tool_parse_n_calls(a) == 0)
        FUZZ_ASSERT(la == n - 1 && !memcmp(ca, t, la));
    tool_parse_free(a);
    tool_parse_free(b);
}

static void tool_prompt_case(const char *s, size_t n)
{
    json_t *j = json_loadb(s, n, 0, NULL);
    json_t *m = json_object_get(j, "messages"), *tl = json_object_get(j, "tools");
    for (int f = TOOL_GENERIC; json_is_array(m) && f <= TOOL_MISTRAL; f++) {
        json_t *mo = NULL, *to = NULL;
        if (tool_prompt_prepare((enum tool_family)f, m, json_is_array(tl) ? tl : NULL, &mo, &to))
            continue; /* out of memory */
        FUZZ_ASSERT(json_is_array(mo));
        json_t *merged = tool_prompt_merge_system(mo);
        FUZZ_ASSERT(!merged || json_array_size(merged) + 1 == json_array_size(mo));
        json_decref(merged);
        json_decref(mo);
        json_decref(to);
    }
    json_decref(j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!spm) {
        spm_build();
        bpe_build();
    }
    if (size == 0 || size > TEXT_MAX_INPUT)
        return 0;
    const char *s = (const char *)data + 1;
    size_t n = size - 1;
    switch (data[0] % 6) {
    case 0:
        tokenize_case(spm, s, n);
        break;
    case 1:
        tokenize_case(bpe, s, n);
        break;
    case 2:
        template_case(s, n);
        break;
    case 3:
        text_out_case(data + 1, n);
        break;
    case 4:
        tool_parse_case(data + 1, n);
        break;
    default:
        tool_prompt_case(s, n);
        break;
    }
    return 0;
}

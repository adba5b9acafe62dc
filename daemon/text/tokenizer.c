/* The GGUF tokenizer: loading tokenizer.ggml.* and encoding text, with
 * llama.cpp's behaviour (src/llama-vocab.cpp) as the definition: the same
 * special-token partition, SentencePiece merge order, byte-level BPE merge
 * order and fallbacks. Pre-tokenizers are in tokenizer_pre.c, pieces and
 * decoding in tokenizer_decode.c. docs/text.md says what is supported. */
#include "tokenizer_impl.h"

#include "gguf.h"
#include "unicode.h"
#include "kvd/status.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---- hashing ---------------------------------------------------------- */

static inline uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t mix(uint64_t h)
{
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return h;
}

uint64_t tok_hash(const void *p, size_t n)
{
    const uint8_t *s = p;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0xff51afd7ed558ccdULL);
    while (n >= 8) {
        h = (h ^ rd64(s)) * 0xbf58476d1ce4e5b9ULL;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t tail = 0;
    for (size_t i = 0; i < n; i++)
        tail |= (uint64_t)s[i] << (8 * i);
    h = (h ^ tail) * 0x94d049bb133111ebULL;
    return mix(h);
}

uint32_t tok_lookup(const struct tokenizer *t, const char *s, size_t n)
{
    uint32_t i = (uint32_t)tok_hash(s, n) & t->map_mask;
    for (;;) {
        uint32_t id = t->map[i];
        if (id == TOK_NULL)
            return TOK_NULL;
        const struct tok_entry *e = &t->tok[id];
        if (e->len == n && memcmp(t->pool + e->off, s, n) == 0)
            return id;
        i = (i + 1) & t->map_mask;
    }
}

/* The hash of "l r" without building it. */
static uint64_t pair_hash(const char *l, size_t ln, const char *r, size_t rn)
{
    return mix(tok_hash(l, ln) * 31 + tok_hash(r, rn) + ln);
}

int64_t tok_merge_rank(const struct tokenizer *t, const char *l, size_t ln, const char *r,
                       size_t rn)
{
    if (!t->merge_map)
        return -1;
    uint32_t i = (uint32_t)pair_hash(l, ln, r, rn) & t->merge_mask;
    for (;;) {
        uint32_t k = t->merge_map[i];
        if (k == TOK_NULL)
            return -1;
        const struct tok_merge *m = &t->merges[k];
        const char *s = t->pool + m->off;
        if (m->sep == ln && m->len == ln + 1 + rn && memcmp(s, l, ln) == 0 &&
            memcmp(s + ln + 1, r, rn) == 0)
            return k;
        i = (i + 1) & t->merge_mask;
    }
}

uint32_t tok_pool_add(struct tokenizer *t, const char *s, size_t n)
{
    if (n >= UINT32_MAX - t->pool_len - 1)
        return UINT32_MAX;
    if (t->pool_len + n + 1 > t->pool_cap) {
        size_t cap = t->pool_cap ? t->pool_cap : 4096;
        while (cap < t->pool_len + n + 1)
            cap *= 2;
        if (cap > UINT32_MAX)
            cap = UINT32_MAX;
        char *p = realloc(t->pool, cap);
        if (!p)
            return UINT32_MAX;
        t->pool = p;
        t->pool_cap = cap;
    }
    uint32_t off = (uint32_t)t->pool_len;
    if (n)
        memcpy(t->pool + off, s, n);
    t->pool[off + n] = 0;
    t->pool_len += n + 1;
    return off;
}

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t c = 16;
    while (c < n * 2)
        c *= 2;
    return c;
}

/* ---- GGUF arrays ------------------------------------------------------ */

/* Walks a string array: the next element's bytes and length. */
struct str_iter {
    const uint8_t *p, *end;
};

static bool str_next(struct str_iter *it, const char **s, uint64_t *n)
{
    if ((size_t)(it->end - it->p) < 8)
        return false;
    uint64_t len;
    memcpy(&len, it->p, 8);
    it->p += 8;
    if (len > (uint64_t)(it->end - it->p))
        return false;
    *s = (const char *)it->p;
    *n = len;
    it->p += len;
    return true;
}

static const struct gguf_kv *find_arr(const struct gguf *g, const char *key)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    return kv && kv->type == GGUF_ARRAY ? kv : NULL;
}

static bool get_bool(const struct gguf *g, const char *key, bool *out)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv || kv->type != GGUF_BOOL)
        return false;
    *out = kv->v.u != 0;
    return true;
}

/* ---- loading ---------------------------------------------------------- */

static int map_tokens(struct tokenizer *t, char *err, size_t errlen)
{
    uint32_t cap = pow2_at_least(t->n_vocab);
    t->map = malloc((size_t)cap * sizeof(uint32_t));
    if (!t->map)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    memset(t->map, 0xff, (size_t)cap * sizeof(uint32_t));
    t->map_mask = cap - 1;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        const struct tok_entry *e = &t->tok[id];
        uint32_t i = (uint32_t)tok_hash(t->pool + e->off, e->len) & t->map_mask;
        while (t->map[i] != TOK_NULL) {
            const struct tok_entry *o = &t->tok[t->map[i]];
            if (o->len == e->len && memcmp(t->pool + o->off, t->pool + e->off, e->len) == 0)
                /* llama.cpp asserts id_to_token.size() == token_to_id.size() */
                return fail(err, errlen, KVD_EBADREQ,
                            "tokenizer.ggml.tokens: tokens %u and %u have the same text", t->map[i],
                            id);
            i = (i + 1) & t->map_mask;
        }
        t->map[i] = id;
    }
    return 0;
}

static int load_merges(struct tokenizer *t, const struct gguf *g, char *err, size_t errlen)
{
    const struct gguf_kv *kv = find_arr(g, "tokenizer.ggml.merges");
    if (!gguf_find_kv(g, "tokenizer.ggml.merges"))
        return fail(err, errlen, KVD_EBADREQ,
                    "tokenizer.ggml.merges is missing (a gpt2 tokenizer needs it)");
    if (!kv || kv->arr_type != GGUF_STRING)
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.merges is not a string array");
    if (kv->arr_count >= UINT32_MAX / 2)
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.merges: too many merges");
    uint32_t n = (uint32_t)kv->arr_count;
    t->merges = calloc(n ? n : 1, sizeof(*t->merges));
    uint32_t cap = pow2_at_least(n);
    t->merge_map = malloc((size_t)cap * sizeof(uint32_t));
    if (!t->merges || !t->merge_map)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    memset(t->merge_map, 0xff, (size_t)cap * sizeof(uint32_t));
    t->merge_mask = cap - 1;
    struct str_iter it = {kv->arr_data, kv->arr_data + kv->arr_bytes};
    for (uint32_t k = 0; k < n; k++) {
        const char *s;
        uint64_t len;
        if (!str_next(&it, &s, &len))
            return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.merges: element %u is truncated",
                        k);
        if (len > TOK_MAX_TOKEN_TEXT * 2)
            return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.merges: element %u is too long",
                        k);
        struct tok_merge *m = &t->merges[k];
        m->len = (uint32_t)len;
        m->sep = UINT32_MAX;
        /* llama.cpp splits at the first space after the first byte; an
         * element without one can never match two non-empty symbols. */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp)
            continue;
        m->sep = (uint32_t)(sp - s);
        m->off = tok_pool_add(t, s, len);
        if (m->off == UINT32_MAX)
            return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
        const char *ms = t->pool + m->off;
        uint32_t i =
            (uint32_t)pair_hash(ms, m->sep, ms + m->sep + 1, m->len - m->sep - 1) & t->merge_mask;
        bool dup = false;
        while (t->merge_map[i] != TOK_NULL) {
            const struct tok_merge *o = &t->merges[t->merge_map[i]];
            if (o->len == m->len && o->sep == m->sep && memcmp(t->pool + o->off, ms, m->len) == 0) {
                dup = true; /* the first rank stays (unordered_map::emplace) */
                break;
            }
            i = (i + 1) & t->merge_mask;
        }
        if (!dup)
            t->merge_map[i] = k;
    }
    t->n_merges = n;
    return 0;
}

static const char *const eot_texts[] = {"<|eot_id|>",
                                        "<|im_end|>",
                                        "<|end|>",
                                        "<end_of_turn>",
                                        "<|endoftext|>",
                                        "<|end_of_text|>",
                                        "<EOT>",
                                        "_<EOT>",
                                        "[EOT]",
                                        "<\xef\xbd\x9c"
                                        "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                        "<end_of_utterance>",
                                        NULL};
static const char *const eom_texts[] = {"<|eom_id|>", NULL};
static const char *const fim_pre_texts[] = {"<|fim_prefix|>",
                                            "<fim-prefix>",
                                            "<fim_prefix>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81"
                                            "begin\xef\xbd\x9c>",
                                            "<PRE>",
                                            "\xe2\x96\x81<PRE>",
                                            "<|code_prefix|>",
                                            "<|prefix|>",
                                            NULL};
static const char *const fim_suf_texts[] = {"<|fim_suffix|>",
                                            "<fim-suffix>",
                                            "<fim_suffix>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81hole\xef\xbd\x9c>",
                                            "<SUF>",
                                            "\xe2\x96\x81<SUF>",
                                            "<|code_suffix|>",
                                            "<|suffix|>",
                                            NULL};
static const char *const fim_mid_texts[] = {"<|fim_middle|>",
                                            "<fim-middle>",
                                            "<fim_middle>",
                                            "<\xef\xbd\x9c"
                                            "fim\xe2\x96\x81"
                                            "end\xef\xbd\x9c>",
                                            "<MID>",
                                            "\xe2\x96\x81<MID>",
                                            "<|code_middle|>",
                                            "<|middle|>",
                                            NULL};
static const char *const fim_pad_texts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>",
                                            "<PAD>",       "[PAD]",     NULL};
static const char *const fim_rep_texts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                            "<REPO>",       "<reponame>",    NULL};
static const char *const fim_sep_texts[] = {"<|file_sep|>", NULL};
/* Texts that end generation (llama.cpp's special_eog_ids by text). */
static const char *const eog_texts[] = {"<|eot_id|>",
                                        "<|im_end|>",
                                        "<|end|>",
                                        "<|return|>",
                                        "<|call|>",
                                        "<|flush|>",
                                        "<|calls|>",
                                        "<end_of_turn>",
                                        "<|endoftext|>",
                                        "</s>",
                                        "<|eom_id|>",
                                        "<EOT>",
                                        "_<EOT>",
                                        "[EOT]",
                                        "[EOS]",
                                        "<|end_of_text|>",
                                        "<end_of_utterance>",
                                        "<eos>",
                                        "<turn|>",
                                        "<|tool_response>",
                                        "<\xef\xbd\x9c"
                                        "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                        "[e~[",
                                        NULL};

static bool text_in(const char *s, size_t n, const char *const *list)
{
    for (; *list; list++)
        if (strlen(*list) == n && memcmp(*list, s, n) == 0)
            return true;
    return false;
}

/* llama.cpp picks the first candidate in its hash map's iteration order; kvd
 * the lowest id (the same whenever a vocabulary has one candidate). */
static void detect(struct tokenizer *t, uint32_t *slot, const char *const *texts)
{
    if (*slot != TOK_NULL)
        return;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        if (text_in(TOK_TEXT(t, id), t->tok[id].len, texts)) {
            *slot = id;
            t->tok[id].attr |= TOK_ATTR_CONTROL;
            return;
        }
    }
}

static int eog_add(struct tokenizer *t, uint32_t id)
{
    if (id == TOK_NULL || id >= t->n_vocab)
        return 0;
    for (uint32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return 0;
    uint32_t *e = realloc(t->eog, (t->n_eog + 1) * sizeof(uint32_t));
    if (!e)
        return KVD_ENOMEM;
    t->eog = e;
    t->eog[t->n_eog++] = id;
    return 0;
}

static void eog_remove(struct tokenizer *t, uint32_t id)
{
    for (uint32_t i = 0; i < t->n_eog; i++) {
        if (t->eog[i] == id) {
            t->eog[i] = t->eog[--t->n_eog];
            return;
        }
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const struct tokenizer *t = ctx;
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    uint32_t lx = t->tok[x].len, ly = t->tok[y].len;
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static bool has_sub(const char *s, const char *sub)
{
    return strstr(s, sub) != NULL;
}

static int set_attr_by_text(struct tokenizer *t, const char *text, uint32_t attr, bool on,
                            char *err, size_t errlen)
{
    uint32_t id = tok_lookup(t, text, strlen(text));
    if (id == TOK_NULL)
        return fail(err, errlen, KVD_EBADREQ,
                    "tokenizer: the vocabulary lacks %s, which llama.cpp requires for this model",
                    text);
    if (on)
        t->tok[id].attr |= attr;
    else
        t->tok[id].attr &= ~attr;
    return 0;
}

static int load_special(struct tokenizer *t, const struct gguf *g, char *err, size_t errlen)
{
    uint32_t fim_pre = TOK_NULL, fim_suf = TOK_NULL, fim_mid = TOK_NULL, fim_pad = TOK_NULL,
             fim_rep = TOK_NULL, fim_sep = TOK_NULL, sep = TOK_NULL, pad = TOK_NULL,
             mask = TOK_NULL;
    struct {
        const char *key;
        uint32_t *id;
    } keys[] = {
        {"tokenizer.ggml.bos_token_id", &t->bos},
        {"tokenizer.ggml.eos_token_id", &t->eos},
        {"tokenizer.ggml.eot_token_id", &t->eot},
        {"tokenizer.ggml.eom_token_id", &t->eom},
        {"tokenizer.ggml.unknown_token_id", &t->unk},
        {"tokenizer.ggml.seperator_token_id", &sep},
        {"tokenizer.ggml.padding_token_id", &pad},
        {"tokenizer.ggml.mask_token_id", &mask},
        {"tokenizer.ggml.fim_pre_token_id", &fim_pre},
        {"tokenizer.ggml.fim_suf_token_id", &fim_suf},
        {"tokenizer.ggml.fim_mid_token_id", &fim_mid},
        {"tokenizer.ggml.fim_pad_token_id", &fim_pad},
        {"tokenizer.ggml.fim_rep_token_id", &fim_rep},
        {"tokenizer.ggml.fim_sep_token_id", &fim_sep},
        {"tokenizer.ggml.prefix_token_id", &fim_pre},
        {"tokenizer.ggml.suffix_token_id", &fim_suf},
        {"tokenizer.ggml.middle_token_id", &fim_mid},
    };
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        uint32_t *id = keys[k].id;
        if (*id != TOK_NULL && *id >= t->n_vocab)
            *id = TOK_NULL; /* a default out of range is disabled */
        uint32_t v;
        char e2[128];
        if (gguf_get_u32(g, keys[k].key, &v, e2, sizeof(e2)) == 0 && v < t->n_vocab)
            *id = v; /* a bad id keeps the default, as llama.cpp */
    }
    bool b;
    if (get_bool(g, "tokenizer.ggml.add_bos_token", &b))
        t->add_bos = b;
    if (get_bool(g, "tokenizer.ggml.add_eos_token", &b))
        t->add_eos = b;

    detect(t, &t->eot, eot_texts);
    detect(t, &t->eom, eom_texts);
    detect(t, &fim_pre, fim_pre_texts);
    detect(t, &fim_suf, fim_suf_texts);
    detect(t, &fim_mid, fim_mid_texts);
    detect(t, &fim_pad, fim_pad_texts);
    detect(t, &fim_rep, fim_rep_texts);
    detect(t, &fim_sep, fim_sep_texts);

    /* control tokens named "unused" are unused */
    for (uint32_t id = 0; id < t->n_vocab; id++)
        if ((t->tok[id].attr & TOK_ATTR_CONTROL) && has_sub(TOK_TEXT(t, id), "unused"))
            t->tok[id].attr |= TOK_ATTR_UNUSED;

    int rc = 0;
    rc |= eog_add(t, fim_pad);
    rc |= eog_add(t, fim_rep);
    rc |= eog_add(t, fim_sep);
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        if (text_in(TOK_TEXT(t, id), t->tok[id].len, eog_texts)) {
            rc |= eog_add(t, id);
            t->tok[id].attr |= TOK_ATTR_CONTROL;
        }
    }
    /* gpt-oss: always rendered */
    static const char *const harmony[] = {"<|channel|>", "<|message|>", "<|start|>",
                                          "<|constrain|>", NULL};
    for (uint32_t id = 0; id < t->n_vocab; id++)
        if (text_in(TOK_TEXT(t, id), t->tok[id].len, harmony))
            t->tok[id].attr = TOK_ATTR_USER_DEFINED;
    rc |= eog_add(t, t->eos);
    rc |= eog_add(t, t->eot);
    rc |= eog_add(t, t->eom);
    if (rc)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    {
        bool has_return = false, has_call = false, has_flush = false;
        uint32_t end_id = TOK_NULL;
        for (uint32_t i = 0; i < t->n_eog; i++) {
            const char *s = TOK_TEXT(t, t->eog[i]);
            if (!strcmp(s, "<|return|>"))
                has_return = true;
            else if (!strcmp(s, "<|call|>") || !strcmp(s, "<|calls|>"))
                has_call = true;
            else if (!strcmp(s, "<|flush|>"))
                has_flush = true;
            else if (!strcmp(s, "<|end|>"))
                end_id = t->eog[i];
        }
        if (end_id != TOK_NULL && ((has_return && has_call) || (has_call && has_flush))) {
            eog_remove(t, end_id);
            t->tok[end_id].attr = TOK_ATTR_USER_DEFINED;
        }
        bool has_tool_response = false;
        uint32_t s_id = TOK_NULL;
        for (uint32_t i = 0; i < t->n_eog; i++) {
            const char *s = TOK_TEXT(t, t->eog[i]);
            if (!strcmp(s, "<|tool_response>"))
                has_tool_response = true;
            else if (!strcmp(s, "</s>"))
                s_id = t->eog[i];
        }
        if (has_tool_response && s_id != TOK_NULL) {
            eog_remove(t, s_id);
            t->tok[s_id].attr = TOK_ATTR_NORMAL;
        }
    }
    if (t->n_eog)
        qsort(t->eog, t->n_eog, sizeof(uint32_t), cmp_u32);

    /* the special-token partition's list, longest first */
    t->special = malloc((t->n_vocab ? t->n_vocab : 1) * sizeof(uint32_t));
    if (!t->special)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    for (uint32_t id = 0; id < t->n_vocab; id++)
        if (t->tok[id].attr & (TOK_ATTR_CONTROL | TOK_ATTR_USER_DEFINED | TOK_ATTR_UNKNOWN))
            t->special[t->n_special++] = id;
    qsort_r(t->special, t->n_special, sizeof(uint32_t), cmp_special, t);

    rc = tok_build_pieces(t);
    if (rc == KVD_EUNSUPPORTED)
        return fail(err, errlen, rc, "tokenizer: a token's text decodes to more than %d bytes",
                    TOK_MAX_PIECE);
    if (rc)
        return fail(err, errlen, rc, "tokenizer: out of memory");

    /* per-family strip rules (after the piece cache, as in llama.cpp) */
    char name[256] = "", arch[128] = "", e2[128];
    gguf_get_str(g, "general.name", name, sizeof(name), e2, sizeof(e2));
    gguf_get_str(g, "general.architecture", arch, sizeof(arch), e2, sizeof(e2));
    for (char *p = name; *p; p++)
        *p = (char)tolower((unsigned char)*p);
    const char *pre = gguf_find_kv(g, "tokenizer.ggml.pre") ? t->pre_name : "";
    if (has_sub(pre, "jina-v2-de") || has_sub(pre, "jina-v2-es") || has_sub(pre, "jina-v2-code") ||
        has_sub(arch, "nomic-bert-moe") || has_sub(arch, "jina-bert-v3")) {
        uint32_t id = tok_lookup(t, "<mask>", 6);
        if (id != TOK_NULL)
            t->tok[id].attr |= TOK_ATTR_LSTRIP;
    } else if (has_sub(name, "phi-3") || has_sub(name, "phi3")) {
        for (uint32_t i = 0; i < t->n_special; i++)
            t->tok[t->special[i]].attr |= TOK_ATTR_RSTRIP;
        if ((rc = set_attr_by_text(t, "</s>", TOK_ATTR_RSTRIP, true, err, errlen)) ||
            (rc = set_attr_by_text(t, "<unk>", TOK_ATTR_RSTRIP, false, err, errlen)) ||
            (rc = set_attr_by_text(t, "<s>", TOK_ATTR_RSTRIP, false, err, errlen)) ||
            (rc = set_attr_by_text(t, "<|endoftext|>", TOK_ATTR_RSTRIP, false, err, errlen)))
            return rc;
    } else if (has_sub(name, "modern-bert")) {
        uint32_t id = tok_lookup(t, "[MASK]", 6);
        if (id != TOK_NULL)
            t->tok[id].attr |= TOK_ATTR_LSTRIP;
    }
    return 0;
}

static int load_vocab(struct tokenizer *t, const struct gguf *g, char *err, size_t errlen)
{
    const struct gguf_kv *kv = find_arr(g, "tokenizer.ggml.tokens");
    if (!kv || kv->arr_type != GGUF_STRING)
        return fail(err, errlen,
                    gguf_find_kv(g, "tokenizer.ggml.tokens") ? KVD_EBADREQ : KVD_ENOTFOUND,
                    "tokenizer.ggml.tokens is %s", kv ? "not a string array" : "missing");
    if (kv->arr_count == 0 || kv->arr_count >= (1u << 30))
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.tokens: %llu tokens",
                    (unsigned long long)kv->arr_count);
    uint32_t n = (uint32_t)kv->arr_count;
    t->n_vocab = n;

    const struct gguf_kv *sc = gguf_find_kv(g, "tokenizer.ggml.scores");
    if (sc && (sc->type != GGUF_ARRAY || (sc->arr_type != GGUF_F32 && sc->arr_type != GGUF_I32)))
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.scores is not an f32/i32 array");
    if (sc && sc->arr_count < n)
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.scores: %llu scores for %u tokens",
                    (unsigned long long)sc->arr_count, n);
    const struct gguf_kv *ty = gguf_find_kv(g, "tokenizer.ggml.token_type");
    if (ty && (ty->type != GGUF_ARRAY || ty->arr_type != GGUF_I32))
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.token_type is not an i32 array");
    if (ty && ty->arr_count < n)
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.token_type: %llu types for %u tokens",
                    (unsigned long long)ty->arr_count, n);

    t->tok = calloc(n, sizeof(*t->tok));
    if (!t->tok)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    struct str_iter it = {kv->arr_data, kv->arr_data + kv->arr_bytes};
    for (uint32_t id = 0; id < n; id++) {
        const char *s;
        uint64_t len;
        if (!str_next(&it, &s, &len))
            return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.tokens: token %u is truncated",
                        id);
        char empty[32];
        if (len == 0) { /* as llama.cpp */
            len = (uint64_t)snprintf(empty, sizeof(empty), "[EMPTY_%u]", id);
            s = empty;
        }
        if (len > TOK_MAX_TOKEN_TEXT)
            return fail(err, errlen, KVD_EUNSUPPORTED,
                        "tokenizer.ggml.tokens: token %u is %llu bytes, kvd takes at most %d", id,
                        (unsigned long long)len, TOK_MAX_TOKEN_TEXT);
        struct tok_entry *e = &t->tok[id];
        e->off = tok_pool_add(t, s, len);
        if (e->off == UINT32_MAX)
            return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
        e->len = (uint32_t)len;
        if (sc) {
            if (sc->arr_type == GGUF_F32)
                memcpy(&e->score, sc->arr_data + 4 * (size_t)id, 4);
            else {
                int32_t v;
                memcpy(&v, sc->arr_data + 4 * (size_t)id, 4);
                e->score = (float)v;
            }
        }
        e->attr = TOK_ATTR_NORMAL;
        if (ty) {
            int32_t v;
            memcpy(&v, ty->arr_data + 4 * (size_t)id, 4);
            switch (v) {
            case TOK_TYPE_UNKNOWN:
                e->attr = TOK_ATTR_UNKNOWN;
                break;
            case TOK_TYPE_UNUSED:
                e->attr = TOK_ATTR_UNUSED;
                break;
            case TOK_TYPE_NORMAL:
                e->attr = TOK_ATTR_NORMAL;
                break;
            case TOK_TYPE_CONTROL:
                e->attr = TOK_ATTR_CONTROL;
                break;
            case TOK_TYPE_USER_DEFINED:
                e->attr = TOK_ATTR_USER_DEFINED;
                break;
            case TOK_TYPE_BYTE:
                e->attr = TOK_ATTR_BYTE;
                break;
            default:
                e->attr = TOK_ATTR_UNDEFINED;
                break;
            }
        }
    }
    /* byte tokens: llama.cpp reads the hex digits at text[3..5) */
    for (uint32_t id = 0; id < n; id++)
        if ((t->tok[id].attr & TOK_ATTR_BYTE) && t->tok[id].len < 3)
            return fail(err, errlen, KVD_EBADREQ,
                        "tokenizer.ggml.tokens: byte token %u is not <0xNN>", id);
    return map_tokens(t, err, errlen);
}

static void byte_tokens(struct tokenizer *t)
{
    static const char hex[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        t->byte_tok[b] = TOK_NULL;
        if (t->kind == TOK_SPM) {
            char buf[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
            uint32_t id = tok_lookup(t, buf, 6);
            if (id == TOK_NULL) {
                char c = (char)b;
                id = tok_lookup(t, &c, 1);
            }
            t->byte_tok[b] = id;
        } else {
            char c = (char)b;
            t->byte_tok[b] = tok_lookup(t, &c, 1);
        }
    }
}

/* No token has U+2581 after a byte that does not end a U+2581: then no
 * SentencePiece merge can span the start of a word. */
static bool spm_no_token_spans_words(const struct tokenizer *t)
{
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        const char *x = TOK_TEXT(t, id);
        uint32_t n = t->tok[id].len;
        for (uint32_t p = 1; p + 3 <= n; p++)
            if (!memcmp(x + p, "\xe2\x96\x81", 3) &&
                (p < 3 || memcmp(x + p - 3, "\xe2\x96\x81", 3) != 0))
                return false;
    }
    return true;
}

int tokenizer_load(const struct gguf *g, struct tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen)
        err[0] = 0;
    char model[64], e2[128];
    int rc = gguf_get_str(g, "tokenizer.ggml.model", model, sizeof(model), e2, sizeof(e2));
    if (rc == KVD_ENOTFOUND)
        return fail(err, errlen, KVD_ENOTFOUND,
                    "the model has no tokenizer (no tokenizer.ggml.model)");
    if (rc)
        return fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.model: %s", e2);
    if (!strcmp(model, "no_vocab") || !strcmp(model, "none"))
        return fail(err, errlen, KVD_ENOTFOUND,
                    "the model has no vocabulary (tokenizer.ggml.model = %s)", model);

    struct tokenizer *t = calloc(1, sizeof(*t));
    if (!t)
        return fail(err, errlen, KVD_ENOMEM, "tokenizer: out of memory");
    t->bos = t->eos = t->eot = t->eom = t->unk = TOK_NULL;
    snprintf(t->model, sizeof(t->model), "%s", model);

    char pre[64] = "";
    rc = gguf_get_str(g, "tokenizer.ggml.pre", pre, sizeof(pre), e2, sizeof(e2));
    if (rc && rc != KVD_ENOTFOUND) {
        rc = fail(err, errlen, KVD_EBADREQ, "tokenizer.ggml.pre: %s", e2);
        goto bad;
    }
    if (!strcmp(model, "llama")) {
        t->kind = TOK_SPM;
        t->bos = 1;
        t->eos = 2;
        t->unk = 0;
        t->add_space_prefix = true;
        t->add_bos = true;
        snprintf(t->pre_name, sizeof(t->pre_name), "default");
    } else if (!strcmp(model, "gpt2")) {
        t->kind = TOK_BPE;
        t->bos = 11;
        t->eos = 11;
        t->clean_spaces = true;
        snprintf(t->pre_name, sizeof(t->pre_name), "%s", pre[0] ? pre : "default");
        bool known, bos_null = false;
        if (!tok_pre_lookup(t->pre_name, &t->pre, &known, &t->clean_spaces, &t->ignore_merges,
                            &t->add_bos, &bos_null)) {
            rc = fail(err, errlen, KVD_EUNSUPPORTED,
                      known ? "tokenizer.ggml.pre = \"%s\": kvd does not implement this "
                              "pre-tokenizer (see docs/text.md)"
                            : "tokenizer.ggml.pre = \"%s\": unknown pre-tokenizer (llama.cpp "
                              "refuses it too)",
                      t->pre_name);
            goto bad;
        }
        if (bos_null)
            t->bos = TOK_NULL;
    } else {
        rc = fail(err, errlen, KVD_EUNSUPPORTED,
                  "tokenizer.ggml.model = \"%s\": kvd implements only \"llama\" (SentencePiece) "
                  "and \"gpt2\" (byte-level BPE)",
                  model);
        goto bad;
    }
    bool b;
    if (get_bool(g, "tokenizer.ggml.add_space_prefix", &b))
        t->add_space_prefix = b;

    if ((rc = load_vocab(t, g, err, errlen)))
        goto bad;
    if (t->kind == TOK_BPE && (rc = load_merges(t, g, err, errlen)))
        goto bad;
    byte_tokens(t);
    if (t->kind == TOK_SPM)
        t->spm_words = spm_no_token_spans_words(t);
    if ((rc = load_special(t, g, err, errlen)))
        goto bad;
    *out = t;
    return 0;
bad:
    tokenizer_free(t);
    return rc;
}

void tokenizer_free(struct tokenizer *t)
{
    if (!t)
        return;
    free(t->tok);
    free(t->pool);
    free(t->map);
    free(t->merges);
    free(t->merge_map);
    free(t->special);
    free(t->eog);
    free(t);
}

uint32_t tokenizer_n_vocab(const struct tokenizer *t)
{
    return t->n_vocab;
}

const char *tokenizer_model_name(const struct tokenizer *t)
{
    return t->model;
}

const char *tokenizer_pre_name(const struct tokenizer *t)
{
    return t->pre_name;
}

bool tokenizer_add_bos_default(const struct tokenizer *t)
{
    return t->add_bos;
}

uint32_t tokenizer_bos(const struct tokenizer *t)
{
    return t->bos;
}

uint32_t tokenizer_eos(const struct tokenizer *t)
{
    return t->eos;
}

bool tokenizer_is_eog(const struct tokenizer *t, uint32_t id)
{
    size_t lo = 0, hi = t->n_eog;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t->eog[mid] == id)
            return true;
        if (t->eog[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

size_t tokenizer_eog_ids(const struct tokenizer *t, uint32_t *out, size_t cap)
{
    for (size_t i = 0; i < t->n_eog && i < cap; i++)
        out[i] = t->eog[i];
    return t->n_eog;
}

enum tok_type tokenizer_token_type(const struct tokenizer *t, uint32_t id)
{
    if (id >= t->n_vocab)
        return TOK_TYPE_UNDEFINED;
    uint32_t a = t->tok[id].attr;
    if (a & TOK_ATTR_UNKNOWN)
        return TOK_TYPE_UNKNOWN;
    if (a & TOK_ATTR_CONTROL)
        return TOK_TYPE_CONTROL;
    if (a & TOK_ATTR_USER_DEFINED)
        return TOK_TYPE_USER_DEFINED;
    if (a & TOK_ATTR_BYTE)
        return TOK_TYPE_BYTE;
    if (a & TOK_ATTR_UNUSED)
        return TOK_TYPE_UNUSED;
    if (a & TOK_ATTR_NORMAL)
        return TOK_TYPE_NORMAL;
    return TOK_TYPE_UNDEFINED;
}

uint32_t tokenizer_find(const struct tokenizer *t, const char *text, size_t len)
{
    return tok_lookup(t, text, len);
}

/* ---- encoding ----------------------------------------------------------- */

/* The output ids, at most max of them: one more sets `over` instead, and
 * the encoder stops at the next word (or fragment) boundary. */
struct ids {
    uint32_t *v;
    size_t n, cap, max;
    bool oom, over;
};

static void ids_push(struct ids *o, uint32_t id)
{
    if (o->n >= o->max) {
        o->over = true;
        return;
    }
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        uint32_t *v = realloc(o->v, cap * sizeof(uint32_t));
        if (!v) {
            o->oom = true;
            return;
        }
        o->v = v;
        o->cap = cap;
    }
    o->v[o->n++] = id;
}

/* A fragment of the input: raw text (off, len) or a special token. */
struct frag {
    size_t off, len;
    uint32_t id; /* TOK_NULL for text */
};

struct frags {
    struct frag *v;
    size_t n, cap;
};

static bool frags_push(struct frags *f, struct frag x)
{
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        struct frag *v = realloc(f->v, cap * sizeof(*v));
        if (!v)
            return false;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->n++] = x;
    return true;
}

static bool c_isspace(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

enum { PART_OK, PART_OOM, PART_OVER };

/* llama.cpp's tokenizer_st_partition: every special token, longest first,
 * splits every text fragment at its occurrences. Control and unknown
 * tokens only when parse_special; user-defined ones always. A token that
 * occurs rebuilds the list into g (then swapped with f), so each costs
 * time linear in the fragments, never a shift per occurrence. Each special
 * fragment is one id: past max_ids of them, PART_OVER. */
static int partition(const struct tokenizer *t, const char *text, size_t len, bool parse_special,
                     size_t max_ids, struct frags *f, struct frags *g)
{
    f->n = 0;
    if (len == 0)
        return PART_OK;
    if (!frags_push(f, (struct frag){0, len, TOK_NULL}))
        return PART_OOM;
    size_t n_special = 0;
    for (uint32_t s = 0; s < t->n_special; s++) {
        uint32_t id = t->special[s];
        const struct tok_entry *e = &t->tok[id];
        if (!parse_special && (e->attr & (TOK_ATTR_CONTROL | TOK_ATTR_UNKNOWN)))
            continue;
        const char *st = TOK_TEXT(t, id);
        size_t sl = e->len;
        bool hit = false;
        for (size_t i = 0; i < f->n; i++) {
            const struct frag x = f->v[i];
            const char *m =
                x.id == TOK_NULL && x.len >= sl ? memmem(text + x.off, x.len, st, sl) : NULL;
            if (!m) {
                if (hit && !frags_push(g, x))
                    return PART_OOM;
                continue;
            }
            if (!hit) { /* the fragments before i, as they are */
                hit = true;
                g->n = 0;
                for (size_t k = 0; k < i; k++)
                    if (!frags_push(g, f->v[k]))
                        return PART_OOM;
            }
            /* fragment i becomes left, token, right..., repeatedly */
            size_t base = x.off, blen = x.len;
            for (;;) {
                size_t mpos = (size_t)(m - text);
                if (mpos > base) {
                    size_t ll = mpos - base;
                    if (e->attr & TOK_ATTR_LSTRIP)
                        while (ll > 0 && c_isspace(text[base + ll - 1]))
                            ll--;
                    if (ll > 0 && !frags_push(g, (struct frag){base, ll, TOK_NULL}))
                        return PART_OOM;
                }
                if (++n_special > max_ids)
                    return PART_OVER;
                if (!frags_push(g, (struct frag){0, 0, id}))
                    return PART_OOM;
                size_t end = base + blen;
                if (mpos + sl >= end)
                    break;
                size_t roff = mpos + sl, rlen = end - roff;
                if (e->attr & TOK_ATTR_RSTRIP)
                    while (rlen > 0 && c_isspace(text[roff])) {
                        roff++;
                        rlen--;
                    }
                base = roff;
                blen = rlen;
                m = blen >= sl ? memmem(text + base, blen, st, sl) : NULL;
                if (!m) {
                    if (blen > 0 && !frags_push(g, (struct frag){base, blen, TOK_NULL}))
                        return PART_OOM;
                    break;
                }
            }
        }
        if (hit) {
            struct frags tmp = *f;
            *f = *g;
            *g = tmp;
        }
    }
    return PART_OK;
}

/* ---- SentencePiece ------------------------------------------------------ */

struct sym {
    int prev, next;
    uint32_t off, n; /* bytes in the work text */
};

struct bigram {
    float score;   /* SPM */
    uint32_t rank; /* BPE */
    int left, right;
    uint32_t size;
};

struct heap {
    struct bigram *v;
    size_t n, cap;
    bool bpe;
};

/* a before b: SPM higher score, BPE lower rank; then the leftmost */
static inline bool bg_before(const struct heap *h, const struct bigram *a, const struct bigram *b)
{
    if (h->bpe) {
        if (a->rank != b->rank)
            return a->rank < b->rank;
    } else {
        if (a->score != b->score)
            return a->score > b->score;
    }
    return a->left < b->left;
}

static bool heap_push(struct heap *h, struct bigram b)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        struct bigram *v = realloc(h->v, cap * sizeof(*v));
        if (!v)
            return false;
        h->v = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bg_before(h, &b, &h->v[p]))
            break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = b;
    return true;
}

static struct bigram heap_pop(struct heap *h)
{
    struct bigram top = h->v[0], last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && bg_before(h, &h->v[c + 1], &h->v[c]))
            c++;
        if (!bg_before(h, &h->v[c], &last))
            break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n)
        h->v[i] = last;
    return top;
}

/* Scratch of one encode call. */
struct work {
    struct sym *syms;
    size_t nsyms, capsyms;
    struct heap heap;
    char *buf; /* escaped / byte-encoded text */
    size_t cap;
    uint32_t *cps;
    size_t capcps;
    size_t *lens, *scratch;
    size_t caplens;
    bool oom;
};

static bool work_syms(struct work *w, size_t n)
{
    if (n > w->capsyms) {
        size_t cap = w->capsyms ? w->capsyms : 64;
        while (cap < n)
            cap *= 2;
        struct sym *s = realloc(w->syms, cap * sizeof(*s));
        if (!s)
            return false;
        w->syms = s;
        w->capsyms = cap;
    }
    return true;
}

static bool work_buf(struct work *w, size_t n)
{
    if (n > w->cap) {
        char *b = realloc(w->buf, n);
        if (!b)
            return false;
        w->buf = b;
        w->cap = n;
    }
    return true;
}

static void spm_try_bigram(const struct tokenizer *t, struct work *w, const char *s, int l, int r)
{
    if (l < 0 || r < 0)
        return;
    const struct sym *a = &w->syms[l], *b = &w->syms[r];
    uint32_t id = tok_lookup(t, s + a->off, a->n + b->n);
    if (id == TOK_NULL)
        return;
    struct bigram bg = {.score = t->tok[id].score, .left = l, .right = r, .size = a->n + b->n};
    if (!heap_push(&w->heap, bg))
        w->oom = true;
}

/* The merge loop both models share: take the best queued pair, merge it if
 * both symbols are still as queued, then queue the new symbol's pairs with
 * its neighbours (`try` is the model's rule for a pair). */
typedef void (*try_bigram_fn)(const struct tokenizer *t, struct work *w, const char *s, int l,
                              int r);

static void merge_bigrams(const struct tokenizer *t, struct work *w, const char *s,
                          try_bigram_fn try)
{
    while (w->heap.n) {
        struct bigram bg = heap_pop(&w->heap);
        struct sym *l = &w->syms[bg.left], *r = &w->syms[bg.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != bg.size)
            continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            w->syms[r->next].prev = bg.left;
        try(t, w, s, l->prev, bg.left);
        try(t, w, s, bg.left, l->next);
    }
}

static void spm_emit(const struct tokenizer *t, const char *s, const struct sym *y, struct ids *out)
{
    uint32_t id = tok_lookup(t, s + y->off, y->n);
    if (id != TOK_NULL) {
        ids_push(out, id);
        return;
    }
    /* llama.cpp's resegment: a symbol that is no token can only be an
     * unmerged character (every merge makes a token), so it goes out as
     * bytes */
    for (uint32_t j = 0; j < y->n; j++) {
        uint32_t b = t->byte_tok[(uint8_t)s[y->off + j]];
        /* llama.cpp throws when the vocabulary has no token for a byte;
         * kvd emits the unknown token (docs/text.md) */
        ids_push(out, b != TOK_NULL ? b : t->unk);
    }
}

#define LOWER_ONE_EIGHTH_BLOCK "\xe2\x96\x81" /* U+2581, SentencePiece's space */

/* Symbol y starts a word: it is U+2581 and the three bytes before it are
 * not. */
static bool spm_word_start(const char *s, const struct sym *y)
{
    if (y->n != 3 || memcmp(s + y->off, LOWER_ONE_EIGHTH_BLOCK, 3) != 0)
        return false;
    return y->off < 3 || memcmp(s + y->off - 3, LOWER_ONE_EIGHTH_BLOCK, 3) != 0;
}

/* The symbol at byte off of s (k bytes) starts a word. */
static bool spm_word_start_at(const char *s, size_t k, size_t off)
{
    size_t cl = uni_len_utf8((uint8_t)s[off]);
    if (cl > k - off)
        cl = k - off;
    struct sym y = {0, 0, (uint32_t)off, (uint32_t)cl};
    return spm_word_start(s, &y);
}

/* SentencePiece's merges over symbols [a, b): the pair of highest score
 * first, ties to the left; the result out as tokens or bytes. */
static void spm_segment(const struct tokenizer *t, struct work *w, const char *s, size_t a,
                        size_t b, struct ids *out)
{
    for (size_t i = a; i < b; i++) {
        w->syms[i].prev = i == a ? -1 : (int)i - 1;
        w->syms[i].next = i + 1 == b ? -1 : (int)i + 1;
    }
    w->heap.n = 0;
    w->heap.bpe = false;
    for (size_t i = a + 1; i < b; i++)
        spm_try_bigram(t, w, s, (int)i - 1, (int)i);
    merge_bigrams(t, w, s, spm_try_bigram);
    for (int i = (int)a; i != -1; i = w->syms[i].next)
        spm_emit(t, s, &w->syms[i], out);
}

static void spm_encode(const struct tokenizer *t, struct work *w, const char *text, size_t len,
                       bool space_prefix, struct ids *out)
{
    /* the text with a leading space if asked, spaces escaped as U+2581 */
    size_t n = (space_prefix ? 1 : 0) + len;
    if (!work_buf(w, 3 * n + 1)) {
        w->oom = true;
        return;
    }
    char *s = w->buf;
    size_t k = 0;
    if (space_prefix) {
        memcpy(s, "\xe2\x96\x81", 3);
        k = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + k, "\xe2\x96\x81", 3);
            k += 3;
        } else {
            s[k++] = text[i];
        }
    }
    if (k == 0)
        return;
    /* Words are merged one at a time when no token can span a word start
     * (t->spm_words): the same merges as over the whole text, since no pair
     * across a word start is ever a token, with small queues; the symbols
     * are made a word at a time, so a text past the id cap stops at the
     * word that reaches it. Otherwise the whole fragment is one segment. */
    for (size_t off = 0; off < k && !out->over;) {
        size_t ns = 0;
        do {
            size_t cl = uni_len_utf8((uint8_t)s[off]);
            if (cl > k - off)
                cl = k - off;
            if (!work_syms(w, ns + 1)) {
                w->oom = true;
                return;
            }
            w->syms[ns++] = (struct sym){0, 0, (uint32_t)off, (uint32_t)cl};
            off += cl;
        } while (off < k && !(t->spm_words && spm_word_start_at(s, k, off)));
        spm_segment(t, w, s, 0, ns, out);
    }
}

/* ---- byte-level BPE ----------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable bytes map to themselves, the others
 * (0x00-0x20, 0x7f-0xa0, 0xad) to U+0100 upwards, in order. */
static inline uint32_t byte_cp(uint8_t b)
{
    if (b <= 0x20)
        return 256u + b;
    if (b >= 0x7f && b <= 0xa0)
        return 256u + 33 + (b - 0x7fu);
    if (b == 0xad)
        return 256u + 33 + 34;
    return b;
}

static void bpe_try_bigram(const struct tokenizer *t, struct work *w, const char *s, int l, int r)
{
    if (l < 0 || r < 0)
        return;
    const struct sym *a = &w->syms[l], *b = &w->syms[r];
    int64_t rank = tok_merge_rank(t, s + a->off, a->n, s + b->off, b->n);
    if (rank < 0)
        return;
    struct bigram bg = {.rank = (uint32_t)rank, .left = l, .right = r, .size = a->n + b->n};
    if (!heap_push(&w->heap, bg))
        w->oom = true;
}

/* One pre-tokenized word (byte-encoded, k bytes at s). */
static void bpe_word(const struct tokenizer *t, struct work *w, const char *s, size_t k,
                     struct ids *out)
{
    if (t->ignore_merges) {
        uint32_t id = tok_lookup(t, s, k);
        if (id != TOK_NULL) {
            ids_push(out, id);
            return;
        }
    }
    if (!work_syms(w, k)) {
        w->oom = true;
        return;
    }
    size_t ns = 0;
    for (size_t off = 0; off < k;) {
        size_t cl = uni_len_utf8((uint8_t)s[off]);
        if (cl > k - off)
            cl = k - off;
        w->syms[ns] = (struct sym){(int)ns - 1, off + cl == k ? -1 : (int)ns + 1, (uint32_t)off,
                                   (uint32_t)cl};
        off += cl;
        ns++;
    }
    w->heap.n = 0;
    w->heap.bpe = true;
    for (size_t i = 1; i < ns; i++)
        bpe_try_bigram(t, w, s, (int)i - 1, (int)i);
    merge_bigrams(t, w, s, bpe_try_bigram);
    for (size_t i = 0; i < ns; i++) {
        const struct sym *y = &w->syms[i];
        if (y->n == 0)
            continue;
        uint32_t id = tok_lookup(t, s + y->off, y->n);
        if (id != TOK_NULL) {
            ids_push(out, id);
            continue;
        }
        /* as llama.cpp: each byte of the (encoded) text as a one-byte
         * token where the vocabulary has one, else nothing */
        for (uint32_t j = 0; j < y->n; j++) {
            uint32_t b = t->byte_tok[(uint8_t)s[y->off + j]];
            if (b != TOK_NULL)
                ids_push(out, b);
        }
    }
}

static void bpe_encode(const struct tokenizer *t, struct work *w, const char *text, size_t len,
                       struct ids *out)
{
    /* code points as llama.cpp decodes them (U+FFFD per undecodable byte) */
    if (len + 2 > w->capcps) {
        uint32_t *c = realloc(w->cps, (len + 2) * sizeof(uint32_t));
        if (!c) {
            w->oom = true;
            return;
        }
        w->cps = c;
        w->capcps = len + 2;
    }
    size_t n = 0;
    for (size_t off = 0; off < len;)
        w->cps[n++] = uni_decode_llama((const uint8_t *)text, len, &off);
    if (n + 2 > w->caplens) {
        size_t *l = realloc(w->lens, (n + 2) * sizeof(size_t));
        size_t *sc = l ? realloc(w->scratch, (2 * n + 4) * sizeof(size_t)) : NULL;
        if (l)
            w->lens = l;
        if (!sc) {
            w->oom = true;
            return;
        }
        w->scratch = sc;
        w->caplens = n + 2;
    }
    size_t nw = tok_pre_split(&t->pre, w->cps, n, w->lens, w->scratch);
    size_t c = 0;
    for (size_t k = 0; k < nw; k++) {
        size_t wl = w->lens[k];
        /* byte-encode: each UTF-8 byte of the word's code points becomes
         * its mapped character (at most 2 bytes) */
        if (!work_buf(w, wl * 8 + 1)) {
            w->oom = true;
            return;
        }
        size_t bl = 0;
        for (size_t i = 0; i < wl; i++) {
            char u[4];
            size_t ul = uni_encode(w->cps[c + i], u);
            for (size_t j = 0; j < ul; j++)
                bl += uni_encode(byte_cp((uint8_t)u[j]), w->buf + bl);
        }
        c += wl;
        bpe_word(t, w, w->buf, bl, out);
        if (w->oom || out->over)
            return;
    }
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, uint32_t **ids, size_t *n_ids)
{
    return tokenizer_encode_max(t, text, len, add_bos, parse_special, SIZE_MAX, ids, n_ids);
}

int tokenizer_encode_max(const struct tokenizer *t, const char *text, size_t len, bool add_bos,
                         bool parse_special, size_t max_ids, uint32_t **ids, size_t *n_ids)
{
    struct ids out = {.max = max_ids};
    struct frags f = {0}, g = {0};
    struct work w = {0};
    *ids = NULL;
    *n_ids = 0;
    if (len > TOK_MAX_TEXT)
        return KVD_ETOOLARGE;
    int prc = partition(t, text, len, parse_special, max_ids, &f, &g);
    free(g.v);
    if (prc == PART_OVER)
        out.over = true;
    else if (prc != PART_OK)
        goto oom;
    if (t->kind == TOK_SPM) {
        bool prev_special = true; /* a space before the first text */
        if (add_bos && t->add_bos && t->bos != TOK_NULL)
            ids_push(&out, t->bos);
        for (size_t i = 0; i < f.n && !out.oom && !w.oom && !out.over; i++) {
            if (f.v[i].id == TOK_NULL) {
                spm_encode(t, &w, text + f.v[i].off, f.v[i].len,
                           t->add_space_prefix && prev_special, &out);
                prev_special = false;
            } else {
                ids_push(&out, f.v[i].id);
                prev_special = true;
            }
        }
    } else {
        if (add_bos && t->add_bos && t->bos != TOK_NULL)
            ids_push(&out, t->bos);
        for (size_t i = 0; i < f.n && !out.oom && !w.oom && !out.over; i++) {
            if (f.v[i].id == TOK_NULL)
                bpe_encode(t, &w, text + f.v[i].off, f.v[i].len, &out);
            else
                ids_push(&out, f.v[i].id);
        }
    }
    if (add_bos && t->add_eos && t->eos != TOK_NULL)
        ids_push(&out, t->eos);
    if (out.oom || w.oom)
        goto oom;
    if (out.over)
        goto over;
    if (!out.v) {
        out.v = malloc(sizeof(uint32_t));
        if (!out.v)
            goto oom;
    }
    free(f.v);
    free(w.syms);
    free(w.heap.v);
    free(w.buf);
    free(w.cps);
    free(w.lens);
    free(w.scratch);
    *ids = out.v;
    *n_ids = out.n;
    return 0;
over:
oom:
    free(out.v);
    free(f.v);
    free(w.syms);
    free(w.heap.v);
    free(w.buf);
    free(w.cps);
    free(w.lens);
    free(w.scratch);
    return out.over && !out.oom && !w.oom ? KVD_ETOOLARGE : KVD_ENOMEM;
}

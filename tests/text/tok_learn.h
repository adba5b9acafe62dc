/* Test vocabularies learned from real text on this machine, for the
 * tokenizer's llama.cpp comparison and its benchmark:
 *
 *   tl_corpus()     licences (/usr/share/common-licenses) and translations
 *                   (the msgstr strings of the .mo files under /usr/share/locale)
 *                   in many scripts;
 *   tl_learn_bpe()  byte-level BPE: the 256 byte characters, a few thousand
 *                   merges learned by pair frequency, some whole words that
 *                   no merge builds (to tell ignore_merges apart), special
 *                   tokens of each type;
 *   tl_learn_spm()  SentencePiece-style: <unk> <s> </s>, the 256 <0xNN> byte
 *                   tokens, the corpus's characters, learned pieces with
 *                   scores, special tokens.
 *
 * The result is the tokenizer.* metadata as a tensor-less GGUF (gguf_write.h);
 * kvd-gguf-gen --tokenizer turns it into a model llama.cpp loads. */
#ifndef KVD_TESTS_TOK_LEARN_H
#define KVD_TESTS_TOK_LEARN_H

#include "gguf_write.h"
#include "tokenizer_impl.h" /* tok_pre_split for the training words */
#include "unicode.h"

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tl_buf {
    char *p;
    size_t n, cap;
};

static void tl_put(struct tl_buf *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            abort();
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static char *tl_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    struct tl_buf b = {0};
    char tmp[65536];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0)
        tl_put(&b, tmp, n);
    fclose(f);
    *len = b.n;
    if (!b.p)
        b.p = calloc(1, 1);
    return b.p;
}

static uint32_t tl_le32(const char *p, int swap)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return swap ? __builtin_bswap32(v) : v;
}

/* The translations (msgstr) of a .mo file, one per line, at most max bytes. */
static void tl_mo(const char *path, struct tl_buf *out, size_t max)
{
    size_t len;
    char *d = tl_read_file(path, &len);
    if (!d)
        return;
    int swap = -1;
    if (len >= 28) {
        uint32_t m;
        memcpy(&m, d, 4);
        swap = m == 0x950412de ? 0 : m == 0xde120495 ? 1 : -1;
    }
    if (swap >= 0) {
        uint32_t n = tl_le32(d + 8, swap), toff = tl_le32(d + 16, swap);
        size_t start = out->n;
        for (uint32_t i = 1; i < n && out->n - start < max; i++) { /* 0: the header */
            if ((size_t)toff + 8 * (i + 1) > len)
                break;
            uint32_t sl = tl_le32(d + toff + 8 * i, swap), so = tl_le32(d + toff + 8 * i + 4, swap);
            if ((size_t)so + sl > len || sl == 0)
                continue;
            /* plural forms are NUL-separated: keep the first */
            size_t k = strnlen(d + so, sl);
            tl_put(out, d + so, k);
            tl_put(out, "\n", 1);
        }
    }
    free(d);
}

static int tl_cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The .mo files of a locale's LC_MESSAGES, by name, until max bytes. */
static void tl_locale(const char *lang, struct tl_buf *out, size_t max)
{
    char dir[512];
    snprintf(dir, sizeof dir, "/usr/share/locale/%s/LC_MESSAGES", lang);
    DIR *dp = opendir(dir);
    if (!dp)
        return;
    char *names[1024];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp)) && n < 1024)
        if (strstr(de->d_name, ".mo"))
            names[n++] = strdup(de->d_name);
    closedir(dp);
    qsort(names, (size_t)n, sizeof(char *), tl_cmp_str);
    size_t start = out->n;
    for (int i = 0; i < n; i++) {
        if (out->n - start < max) {
            char path[800];
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            tl_mo(path, out, max - (out->n - start));
        }
        free(names[i]);
    }
}

/* Locales in many scripts: Latin, Cyrillic, Greek, Hebrew, Arabic, Devanagari,
 * Bengali, Tamil, Thai, Georgian, Armenian, CJK, Hangul, Ethiopic... */
static const char *const tl_langs[] = {
    "de", "fr", "es", "pl", "cs", "tr", "vi", "ru", "uk",    "bg",    "el", "he", "ar",
    "fa", "hi", "bn", "ta", "th", "ka", "hy", "ja", "zh_CN", "zh_TW", "ko", "am", "km",
    "si", "ml", "te", "pa", "gu", "my", "lo", "eo", "ga",    "is",    NULL};

/* The corpus: licences and translations; about max bytes. */
static char *tl_corpus(size_t max, size_t *len)
{
    struct tl_buf b = {0};
    static const char *const lic[] = {"GPL-3",   "Apache-2.0", "Artistic", "LGPL-3",
                                      "MPL-2.0", "BSD",        NULL};
    size_t per = max / 4 / 6;
    for (int i = 0; lic[i]; i++) {
        char p[256];
        snprintf(p, sizeof p, "/usr/share/common-licenses/%s", lic[i]);
        size_t n;
        char *d = tl_read_file(p, &n);
        if (d) {
            tl_put(&b, d, n < per ? n : per);
            tl_put(&b, "\n", 1);
            free(d);
        }
    }
    size_t nl = 0;
    while (tl_langs[nl])
        nl++;
    size_t per_lang = (max - b.n) / nl;
    for (size_t i = 0; i < nl; i++)
        tl_locale(tl_langs[i], &b, per_lang);
    if (!b.p)
        b.p = calloc(1, 1);
    *len = b.n;
    return b.p;
}

/* The training text of the test vocabularies: the corpus (max bytes) plus
 * numbers and a line of code, so that digit runs and symbols get merges.
 * seed: the numbers. */
static char *tl_training_corpus(size_t max, uint64_t seed, size_t *len)
{
    size_t clen;
    char *corpus = tl_corpus(max, &clen);
    struct tl_buf cb = {0};
    tl_put(&cb, corpus, clen);
    free(corpus);
    uint64_t st = seed;
    for (int i = 0; i < 6000; i++) {
        st = st * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t r = st >> 11;
        char num[32];
        int n = snprintf(num, sizeof num, i % 3 ? " %llu" : "%llu,",
                         (unsigned long long)(r % (i % 2 ? 100000000ULL : 10000ULL)));
        tl_put(&cb, num, (size_t)n);
        if (i % 10 == 0) {
            static const char code[] = "\n    x = f(y) + 2 * z; // it's what we've got\n";
            tl_put(&cb, code, sizeof code - 1);
        }
    }
    *len = cb.n;
    return cb.p;
}

/* ---- a string -> int table -------------------------------------------------- */

struct tl_map {
    char **key;
    uint32_t *klen;
    int64_t *val;
    size_t cap, n;
};

static uint64_t tl_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ULL;
    return h;
}

static int64_t *tl_map_get(struct tl_map *m, const char *s, size_t n, int create)
{
    if (create && (m->n + 1) * 2 > m->cap) {
        struct tl_map o = *m;
        m->cap = o.cap ? o.cap * 2 : 1024;
        m->key = calloc(m->cap, sizeof(char *));
        m->klen = calloc(m->cap, sizeof(uint32_t));
        m->val = calloc(m->cap, sizeof(int64_t));
        m->n = 0;
        for (size_t i = 0; i < o.cap; i++) {
            if (!o.key[i])
                continue;
            *tl_map_get(m, o.key[i], o.klen[i], 1) = o.val[i];
            free(o.key[i]);
        }
        free(o.key);
        free(o.klen);
        free(o.val);
    }
    if (!m->cap)
        return NULL;
    size_t i = tl_hash(s, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && !memcmp(m->key[i], s, n))
            return &m->val[i];
        i = (i + 1) & (m->cap - 1);
    }
    if (!create)
        return NULL;
    m->key[i] = malloc(n + 1);
    memcpy(m->key[i], s, n);
    m->key[i][n] = 0;
    m->klen[i] = (uint32_t)n;
    m->val[i] = 0;
    m->n++;
    return &m->val[i];
}

static void tl_map_free(struct tl_map *m)
{
    for (size_t i = 0; i < m->cap; i++)
        free(m->key[i]);
    free(m->key);
    free(m->klen);
    free(m->val);
    memset(m, 0, sizeof(*m));
}

/* ---- pair-merge learning over word types ----------------------------------- */

struct tl_word {
    uint32_t *sym;
    uint32_t n;
    int64_t freq;
};

struct tl_learner {
    struct tl_word *w;
    size_t nw;
    char **sym; /* symbol id -> text */
    size_t nsym, capsym;
    uint32_t *ml, *mr; /* merges: left, right symbol ids */
    size_t nm;
};

static uint32_t tl_sym(struct tl_learner *L, struct tl_map *ids, const char *s, size_t n)
{
    int64_t *v = tl_map_get(ids, s, n, 1);
    if (*v)
        return (uint32_t)(*v - 1);
    if (L->nsym == L->capsym) {
        L->capsym = L->capsym ? L->capsym * 2 : 1024;
        L->sym = realloc(L->sym, L->capsym * sizeof(char *));
    }
    L->sym[L->nsym] = malloc(n + 1);
    memcpy(L->sym[L->nsym], s, n);
    L->sym[L->nsym][n] = 0;
    *v = (int64_t)++L->nsym;
    return (uint32_t)(L->nsym - 1);
}

/* Pair counts: open addressing on (left << 32 | right), key 0 free (the
 * pair 0,0 is counted apart). */
struct tl_pairs {
    uint64_t *key;
    int64_t *val;
    size_t cap;
    int64_t zero;
};

static void tl_pairs_add(struct tl_pairs *p, uint64_t k, int64_t v)
{
    if (k == 0) {
        p->zero += v;
        return;
    }
    size_t i = (size_t)((k * 0x9e3779b97f4a7c15ULL) >> 40) & (p->cap - 1);
    while (p->key[i] && p->key[i] != k)
        i = (i + 1) & (p->cap - 1);
    p->key[i] = k;
    p->val[i] += v;
}

/* n merges by pair frequency (ties: the smaller pair of ids). */
static void tl_merge(struct tl_learner *L, struct tl_map *ids, size_t n)
{
    L->ml = calloc(n, sizeof(uint32_t));
    L->mr = calloc(n, sizeof(uint32_t));
    size_t total = 0;
    for (size_t k = 0; k < L->nw; k++)
        total += L->w[k].n;
    struct tl_pairs pc = {0};
    pc.cap = 1024;
    while (pc.cap < total * 2)
        pc.cap *= 2;
    pc.key = malloc(pc.cap * sizeof(uint64_t));
    pc.val = malloc(pc.cap * sizeof(int64_t));
    for (size_t it = 0; it < n; it++) {
        memset(pc.key, 0, pc.cap * sizeof(uint64_t));
        memset(pc.val, 0, pc.cap * sizeof(int64_t));
        pc.zero = 0;
        for (size_t k = 0; k < L->nw; k++) {
            struct tl_word *w = &L->w[k];
            for (uint32_t i = 0; i + 1 < w->n; i++)
                tl_pairs_add(&pc, (uint64_t)w->sym[i] << 32 | w->sym[i + 1], w->freq);
        }
        int64_t best = pc.zero;
        uint64_t bk = 0;
        for (size_t i = 0; i < pc.cap; i++)
            if (pc.key[i] && (pc.val[i] > best || (pc.val[i] == best && pc.key[i] < bk))) {
                best = pc.val[i];
                bk = pc.key[i];
            }
        if (best < 2)
            break;
        uint32_t bl = (uint32_t)(bk >> 32), br = (uint32_t)bk;
        char *s = malloc(strlen(L->sym[bl]) + strlen(L->sym[br]) + 1);
        strcpy(s, L->sym[bl]);
        strcat(s, L->sym[br]);
        uint32_t nid = tl_sym(L, ids, s, strlen(s));
        free(s);
        L->ml[L->nm] = bl;
        L->mr[L->nm] = br;
        L->nm++;
        for (size_t k = 0; k < L->nw; k++) {
            struct tl_word *w = &L->w[k];
            uint32_t o = 0;
            for (uint32_t i = 0; i < w->n; i++) {
                if (i + 1 < w->n && w->sym[i] == bl && w->sym[i + 1] == br) {
                    w->sym[o++] = nid;
                    i++;
                } else {
                    w->sym[o++] = w->sym[i];
                }
            }
            w->n = o;
        }
    }
    free(pc.key);
    free(pc.val);
}

static void tl_learner_free(struct tl_learner *L)
{
    for (size_t k = 0; k < L->nw; k++)
        free(L->w[k].sym);
    free(L->w);
    for (size_t i = 0; i < L->nsym; i++)
        free(L->sym[i]);
    free(L->sym);
    free(L->ml);
    free(L->mr);
}

/* ---- the vocabularies ---------------------------------------------------------- */

struct tl_tok {
    char *text;
    float score;
    int32_t type;
};

struct tl_vocab {
    struct tl_tok *t;
    size_t n, cap;
    struct tl_map have;
};

static int tl_add(struct tl_vocab *v, const char *s, float score, int32_t type)
{
    int64_t *e = tl_map_get(&v->have, s, strlen(s), 1);
    if (*e)
        return (int)(*e - 1);
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 1024;
        v->t = realloc(v->t, v->cap * sizeof(*v->t));
    }
    v->t[v->n] = (struct tl_tok){strdup(s), score, type};
    *e = (int64_t)++v->n;
    return (int)(v->n - 1);
}

static void tl_vocab_free(struct tl_vocab *v)
{
    for (size_t i = 0; i < v->n; i++)
        free(v->t[i].text);
    free(v->t);
    tl_map_free(&v->have);
}

static void tl_write_vocab(struct gw *w, const struct tl_vocab *v)
{
    gw_kv_arr(w, "tokenizer.ggml.tokens", 8, v->n);
    for (size_t i = 0; i < v->n; i++)
        gw_strn(w, v->t[i].text, strlen(v->t[i].text));
    gw_kv_arr(w, "tokenizer.ggml.scores", 6, v->n);
    for (size_t i = 0; i < v->n; i++)
        gw_put(w, &v->t[i].score, 4);
    gw_kv_arr(w, "tokenizer.ggml.token_type", 5, v->n);
    for (size_t i = 0; i < v->n; i++)
        gw_put(w, &v->t[i].type, 4);
}

/* Special tokens every test vocabulary has; the texts the test texts use. */
static const struct {
    const char *text;
    int32_t type;
} tl_specials[] = {
    {"<|im_start|>", 3},   {"<|im_end|>", 3},   {"<|eot_id|>", 3}, {"<unused0>", 3},
    {"<tool_call>", 4},    {"</tool_call>", 4}, {"[INST]", 4},     {" <sp> ", 4},
    {"<|fim_prefix|>", 3}, {"<think>", 4},
};

static uint32_t tl_byte_cp(uint8_t b)
{
    if (b <= 0x20)
        return 256u + b;
    if (b >= 0x7f && b <= 0xa0)
        return 256u + 33 + (b - 0x7fu);
    if (b == 0xad)
        return 256u + 33 + 34;
    return b;
}

static size_t tl_utf8(uint32_t cp, char *o)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A learned byte-level BPE vocabulary, written for any pre-tokenizer name. */
struct tl_bpe {
    struct tl_vocab v;
    char **merges;
    size_t nm;
    int eot;
};

/* Learns n_merges merges over the words of the pre-tokenizers' splits (all
 * of them counted: merges that matter to each), then adds up to 200 words
 * of those splits that no merge builds as tokens of their own (what
 * ignore_merges takes whole). */
static void tl_learn_bpe(const char *corpus, size_t clen, const char *const *train_pres,
                         size_t n_merges, struct tl_bpe *out)
{
    memset(out, 0, sizeof(*out));
    struct tl_learner L = {0};
    struct tl_map ids = {0}, words = {0};
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t n = tl_utf8(tl_byte_cp((uint8_t)b), u);
        tl_sym(&L, &ids, u, n);
    }
    /* words: the pre-tokenizer's split, byte-encoded */
    uint32_t *cps = malloc((clen + 1) * sizeof(uint32_t));
    size_t *lens = malloc((clen + 2) * sizeof(size_t)),
           *scr = malloc((2 * clen + 4) * sizeof(size_t));
    size_t ncp = 0;
    for (size_t off = 0; off < clen;)
        cps[ncp++] = uni_decode_llama((const uint8_t *)corpus, clen, &off);
    struct tl_buf wb = {0};
    for (size_t p = 0; train_pres[p]; p++) {
        struct tok_pre tp;
        bool known, cs = true, im = false, ab = false, bn = false;
        if (!tok_pre_lookup(train_pres[p], &tp, &known, &cs, &im, &ab, &bn))
            abort();
        size_t nw = tok_pre_split(&tp, cps, ncp, lens, scr);
        size_t c = 0;
        for (size_t k = 0; k < nw; k++) {
            wb.n = 0;
            for (size_t i = 0; i < lens[k]; i++) {
                char u[4], e[4];
                size_t ul = tl_utf8(cps[c + i] > 0x10ffff ? 0xfffd : cps[c + i], u);
                for (size_t j = 0; j < ul; j++)
                    tl_put(&wb, e, tl_utf8(tl_byte_cp((uint8_t)u[j]), e));
            }
            c += lens[k];
            if (wb.n)
                (*tl_map_get(&words, wb.p, wb.n, 1))++;
        }
    }
    free(wb.p);
    free(cps);
    free(lens);
    free(scr);
    L.w = calloc(words.n, sizeof(struct tl_word));
    for (size_t i = 0; i < words.cap; i++) {
        if (!words.key[i])
            continue;
        struct tl_word *w = &L.w[L.nw++];
        const char *s = words.key[i];
        size_t n = words.klen[i];
        w->sym = malloc(n * sizeof(uint32_t));
        w->freq = words.val[i];
        for (size_t o = 0; o < n;) {
            size_t cl = uni_len_utf8((uint8_t)s[o]);
            w->sym[w->n++] = tl_sym(&L, &ids, s + o, cl);
            o += cl;
        }
    }
    tl_merge(&L, &ids, n_merges);

    struct tl_vocab *v = &out->v;
    out->eot = tl_add(v, "<|endoftext|>", 0, 3);
    for (size_t b = 0; b < 256; b++)
        tl_add(v, L.sym[b], 0, 1);
    out->merges = calloc(L.nm ? L.nm : 1, sizeof(char *));
    for (size_t m = 0; m < L.nm; m++) {
        const char *l = L.sym[L.ml[m]], *r = L.sym[L.mr[m]];
        char *s = malloc(strlen(l) + strlen(r) + 2);
        sprintf(s, "%s%s", l, r);
        tl_add(v, s, 0, 1);
        sprintf(s, "%s %s", l, r);
        out->merges[out->nm++] = s;
    }
    /* frequent whole words as tokens no merge builds */
    size_t added = 0;
    for (size_t i = 0; i < words.cap && added < 200; i++)
        if (words.key[i] && words.val[i] >= 3 && words.klen[i] > 3 &&
            !tl_map_get(&v->have, words.key[i], words.klen[i], 0)) {
            tl_add(v, words.key[i], 0, 1);
            added++;
        }
    for (size_t i = 0; i < sizeof tl_specials / sizeof tl_specials[0]; i++)
        tl_add(v, tl_specials[i].text, 0, tl_specials[i].type);
    tl_add(v, "raw text", 0, 1); /* a normal token outside the byte map */
    tl_map_free(&ids);
    tl_map_free(&words);
    tl_learner_free(&L);
}

/* The vocabulary as a GGUF with tokenizer.ggml.pre = pre. */
static uint8_t *tl_bpe_gguf(const struct tl_bpe *b, const char *pre, size_t *out_len)
{
    struct gw w = {0};
    gw_kv_str(&w, "general.name", "kvd-tok-test");
    gw_kv_str(&w, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(&w, "tokenizer.ggml.pre", pre);
    tl_write_vocab(&w, &b->v);
    gw_kv_arr(&w, "tokenizer.ggml.merges", 8, b->nm);
    for (size_t m = 0; m < b->nm; m++)
        gw_strn(&w, b->merges[m], strlen(b->merges[m]));
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", (uint32_t)b->eot);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", (uint32_t)b->eot);
    uint8_t *file = gw_finish(&w, out_len);
    gw_free(&w);
    return file;
}

static void tl_bpe_free(struct tl_bpe *b)
{
    for (size_t m = 0; m < b->nm; m++)
        free(b->merges[m]);
    free(b->merges);
    tl_vocab_free(&b->v);
}

/* A SentencePiece-style vocabulary: pieces learned over ▁-escaped words
 * (▁ starts a word), score -rank; characters seen at least 3 times. */
static uint8_t *tl_learn_spm(const char *corpus, size_t clen, size_t n_merges, size_t *out_len)
{
    struct tl_learner L = {0};
    struct tl_map ids = {0}, words = {0}, chars = {0};
    /* words: split before each space (which becomes ▁) and at newlines */
    size_t i = 0;
    struct tl_buf wb = {0};
    while (i < clen) {
        wb.n = 0;
        if (corpus[i] == '\n') {
            i++;
            continue;
        }
        if (corpus[i] == ' ') {
            tl_put(&wb, "\xe2\x96\x81", 3);
            i++;
        }
        while (i < clen && corpus[i] != ' ' && corpus[i] != '\n') {
            size_t cl = uni_len_utf8((uint8_t)corpus[i]);
            if (i + cl > clen)
                cl = clen - i;
            tl_put(&wb, corpus + i, cl);
            i += cl;
        }
        if (wb.n)
            (*tl_map_get(&words, wb.p, wb.n, 1))++;
    }
    free(wb.p);
    L.w = calloc(words.n, sizeof(struct tl_word));
    for (size_t k = 0; k < words.cap; k++) {
        if (!words.key[k])
            continue;
        struct tl_word *w = &L.w[L.nw++];
        const char *s = words.key[k];
        size_t n = words.klen[k];
        w->sym = malloc(n * sizeof(uint32_t));
        w->freq = words.val[k];
        for (size_t o = 0; o < n;) {
            size_t cl = uni_len_utf8((uint8_t)s[o]);
            if (o + cl > n)
                cl = n - o;
            w->sym[w->n++] = tl_sym(&L, &ids, s + o, cl);
            *tl_map_get(&chars, s + o, cl, 1) += w->freq;
            o += cl;
        }
    }
    tl_merge(&L, &ids, n_merges);

    struct tl_vocab v = {0};
    tl_add(&v, "<unk>", 0, 2);
    tl_add(&v, "<s>", 0, 3);
    tl_add(&v, "</s>", 0, 3);
    for (int b = 0; b < 256; b++) {
        char t[8];
        snprintf(t, sizeof t, "<0x%02X>", b);
        tl_add(&v, t, 0, 6);
    }
    for (size_t m = 0; m < L.nm; m++) {
        char *s = malloc(strlen(L.sym[L.ml[m]]) + strlen(L.sym[L.mr[m]]) + 1);
        strcpy(s, L.sym[L.ml[m]]);
        strcat(s, L.sym[L.mr[m]]);
        tl_add(&v, s, -(float)m, 1);
        free(s);
    }
    /* characters: ids in symbol order, the rare ones left to byte fallback */
    for (size_t s = 0; s < L.nsym; s++) {
        int64_t *f = tl_map_get(&chars, L.sym[s], strlen(L.sym[s]), 0);
        if (f && *f >= 3)
            tl_add(&v, L.sym[s], -(float)(n_merges + s), 1);
    }
    for (size_t k = 0; k < sizeof tl_specials / sizeof tl_specials[0]; k++)
        tl_add(&v, tl_specials[k].text, 0, tl_specials[k].type);

    struct gw w = {0};
    gw_kv_str(&w, "general.name", "kvd-tok-test");
    gw_kv_str(&w, "tokenizer.ggml.model", "llama");
    tl_write_vocab(&w, &v);
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 1);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 2);
    gw_kv_u32(&w, "tokenizer.ggml.unknown_token_id", 0);
    uint8_t *file = gw_finish(&w, out_len);
    gw_free(&w);
    tl_vocab_free(&v);
    tl_map_free(&ids);
    tl_map_free(&words);
    tl_map_free(&chars);
    tl_learner_free(&L);
    return file;
}

#endif

/* Test texts for the tokenizer comparison: fixed edge cases, segments of the
 * machine's corpus (tok_learn.h) in many scripts, and random mixtures of
 * "atoms": emoji (ZWJ sequences, flags, skin tones), combining marks, runs of
 * spaces/tabs/newlines, Unicode spaces, digit runs, code, apostrophe
 * contractions, special-token text (whole and partial), control and
 * unassigned characters. All valid UTF-8 (JavaScript strings carry them to
 * llama.cpp). Deterministic for a seed. */
#ifndef KVD_TESTS_TOK_TEXTS_H
#define KVD_TESTS_TOK_TEXTS_H

#include "text/tok_learn.h"
#include "unicode.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct tt_texts {
    char **s;
    size_t *len;
    size_t n, cap;
};

static uint64_t tt_rand(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Whether s is well-formed UTF-8 (and free of NUL, which JSON lines keep
 * but is pointless here). */
static int tt_valid(const char *s, size_t n)
{
    struct uni_utf8_state u = {0};
    char *tmp = malloc(3 * n + 8);
    size_t w = uni_utf8_feed(&u, (const uint8_t *)s, n, tmp);
    w += uni_utf8_finish(&u, tmp + w);
    int ok = w == n && memcmp(tmp, s, n) == 0 && memchr(s, 0, n) == NULL;
    free(tmp);
    return ok;
}

static void tt_add(struct tt_texts *t, const char *s, size_t n)
{
    if (!tt_valid(s, n))
        return;
    if (t->n == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 1024;
        t->s = realloc(t->s, t->cap * sizeof(char *));
        t->len = realloc(t->len, t->cap * sizeof(size_t));
    }
    t->s[t->n] = malloc(n + 1);
    memcpy(t->s[t->n], s, n);
    t->s[t->n][n] = 0;
    t->len[t->n++] = n;
}

static const char *const tt_fixed[] = {"",
                                       " ",
                                       "  ",
                                       "   ",
                                       "\n",
                                       "\n\n",
                                       "\t",
                                       " \t\n",
                                       "\r\n",
                                       "\r\n\r\n  ",
                                       "a",
                                       " a",
                                       "a ",
                                       "  leading",
                                       "trailing  ",
                                       " both ",
                                       "Hello world",
                                       " Hello world",
                                       "Hello World!",
                                       "hello, world. yes? no! ok,",
                                       "it's I'm you're we've they'll he'd don't",
                                       "IT'S I'M YOU'RE WE'VE THEY'LL HE'D",
                                       "' s 'll ' '",
                                       "a ' b ' c",
                                       "x 's y 'm z 're 've",
                                       "1",
                                       "12",
                                       "123",
                                       "1234",
                                       "12345678901234567890",
                                       " 2024-12-03 ",
                                       "3.14159 1,000,000",
                                       "٣٤٥ ١٢",
                                       "१२३४",
                                       "Ⅻ ½ ²³",
                                       "int main(void) { return 0; }\n",
                                       "def f(x):\n    return x ** 2  # square\n",
                                       "    indented\n\tmore\n",
                                       "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                       "<|im_end|>",
                                       "<|im_",
                                       "<|eot_id|>x",
                                       "<s>",
                                       "</s>",
                                       "<s> hello </s>",
                                       "<unk>",
                                       "<tool_call>{\"a\": 1}</tool_call>",
                                       "[INST] hi [/INST]",
                                       "a <sp> b",
                                       " <sp> ",
                                       "<think>\nhm\n</think>",
                                       "<unused0>",
                                       "<|fim_prefix|>def",
                                       "<|endoftext|>",
                                       "raw text",
                                       "👨‍👩‍👧‍👦",
                                       "🏳️‍🌈",
                                       "👍🏽👍🏿",
                                       "🇩🇪🇯🇵",
                                       "é",
                                       "é",
                                       "Z̤̺̈́a̗̯l̼g̬o",
                                       "ﬁ ﬂ",
                                       "ｆｕｌｌｗｉｄｔｈ",
                                       "中文字符测试",
                                       "日本語のテキスト、カタカナ。",
                                       "한국어 텍스트입니다",
                                       "Ελληνικά κείμενα",
                                       "Русский текст",
                                       "עברית טקסט",
                                       "النص العربي",
                                       "हिन्दी पाठ",
                                       "ภาษาไทย",
                                       "ქართული",
                                       "Հայերեն",
                                       "\xc2\x85nel\xc2\xa0nbsp\xe2\x80\xa8ls\xe3\x80\x80ideo",
                                       "\x01\x02\x1f\x7f",
                                       "\xef\xbf\xbd",
                                       "\xcd\xb8 unassigned",
                                       "\xe0\xa2\x97 16.0",
                                       "\xf0\x9f\xab\xa8 emoji 15",
                                       "\xf0\xae\xaf\xb0 cjk ext i",
                                       "\xe2\xbf\xbc idc",
                                       "a\u200db\u200cc\ufeffd",
                                       "tab\there",
                                       "  \n  \n",
                                       "x  \n",
                                       " \n",
                                       "...",
                                       "?!",
                                       " ? ! . ,",
                                       "C'est l'été",
                                       "ÀÉÎÕÜ àéîõü",
                                       "ǅungla Ǉ",
                                       "İstanbul ıi",
                                       "ß ẞ",
                                       "ﷺ",
                                       "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
                                       NULL};

static const char *const tt_atoms[] = {
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\xc2\x85",
    "the",
    " the",
    "The",
    " THE",
    "Hello",
    " world",
    "a",
    "I",
    "'s",
    "'S",
    "'t",
    "'re",
    "'ve",
    "'ll",
    "'d",
    "'m",
    "'x",
    "'",
    "\"",
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    "-",
    "--",
    "...",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "<",
    ">",
    "/",
    "\\",
    "|",
    "#",
    "$",
    "%",
    "^",
    "&",
    "*",
    "+",
    "=",
    "~",
    "`",
    "_",
    "@",
    "0",
    "7",
    "42",
    "123",
    "2024",
    "9999999",
    "3.14",
    "1e10",
    "٣",
    "१२",
    "½",
    "x",
    "if",
    " return",
    "()",
    "->",
    "::",
    "==",
    "!=",
    "/*",
    "*/",
    "//",
    "#include",
    "é",
    "e\u0301",
    "\u0301",
    "\u0308\u0301",
    "n\u0303",
    "ü",
    "ß",
    "ø",
    "Ω",
    "ж",
    "Ж",
    "ש",
    "ع",
    "क",
    "\u093f",
    "ก",
    "\u0e31",
    "ლ",
    "中",
    "文",
    "日本",
    "カ",
    "한",
    "글",
    "ㄱ",
    "😀",
    "👍",
    "👍🏽",
    "❤️",
    "👨‍💻",
    "👨‍👩‍👧",
    "🇫🇷",
    "🏳️‍⚧️",
    "\u200d",
    "\ufe0f",
    "✓",
    "™",
    "€",
    "£",
    "¥",
    "∑",
    "√",
    "∞",
    "≠",
    "→",
    "⟨",
    "„",
    "»",
    "«",
    "—",
    "–",
    "…",
    "·",
    "<|im_start|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<unk>",
    "<tool_call>",
    "</tool_call>",
    "[INST]",
    " <sp> ",
    "<think>",
    "<unused0>",
    "<|",
    "|>",
    "<|im_",
    "raw text",
    "\x01",
    "\x1b",
    "\x7f",
    "\xef\xbf\xbd",
    "\xcd\xb8",
    "\xe0\xa2\x97",
    "\xee\x80\x80",
    "\xf0\x9f\xab\xa8",
    "\xf0\xae\xaf\xb0",
    "ǅ",
    "İ",
    "ﬁ",
    "Ａ",
    "ａ",
    "𝔘",
};

/* texts: the fixed ones, corpus segments, mixtures. */
static void tt_make(struct tt_texts *t, uint64_t seed)
{
    memset(t, 0, sizeof(*t));
    for (size_t i = 0; tt_fixed[i]; i++)
        tt_add(t, tt_fixed[i], strlen(tt_fixed[i]));
    size_t clen;
    char *corpus = tl_corpus(1200000, &clen);
    uint64_t st = seed;
    /* corpus segments, whole UTF-8 characters */
    for (int k = 0; k < 1600 && clen > 1000; k++) {
        size_t a = (size_t)(tt_rand(&st) % clen), len = 1 + (size_t)(tt_rand(&st) % 400);
        while (a > 0 && ((uint8_t)corpus[a] & 0xc0) == 0x80)
            a--;
        size_t b = a + len < clen ? a + len : clen;
        while (b < clen && ((uint8_t)corpus[b] & 0xc0) == 0x80)
            b++;
        tt_add(t, corpus + a, b - a);
    }
    /* mixtures */
    size_t na = sizeof tt_atoms / sizeof tt_atoms[0];
    char buf[4096];
    for (int k = 0; k < 1600; k++) {
        size_t n = 0, m = 1 + (size_t)(tt_rand(&st) % 14);
        for (size_t i = 0; i < m; i++) {
            const char *a = tt_atoms[tt_rand(&st) % na];
            size_t l = strlen(a);
            if (n + l < sizeof buf) {
                memcpy(buf + n, a, l);
                n += l;
            }
        }
        tt_add(t, buf, n);
    }
    free(corpus);
}

static void tt_free(struct tt_texts *t)
{
    for (size_t i = 0; i < t->n; i++)
        free(t->s[i]);
    free(t->s);
    free(t->len);
}

#endif

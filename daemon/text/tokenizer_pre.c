/* Pre-tokenizers of byte-level BPE vocabularies: llama.cpp's regex_exprs
 * for each tokenizer.ggml.pre, written by hand. Each splitter refines the
 * previous split: a chunk is cut into the regex's matches and the text
 * between them (llama.cpp's unicode_regex_split).
 *
 * Three of them are llama.cpp's hand-written splitters (gpt2, llama3,
 * qwen2), which use the Unicode tables directly. The others run in
 * llama.cpp as std::regex (ECMAScript) over a "collapsed" text, where each
 * code point >= 128 is replaced by one byte standing for its class
 * (White_Space: \v, letter, number, punctuation, mark, symbol, other) and
 * \p{..} by those bytes plus the ASCII members; \s is then the C locale's
 * (space, \t \n \v \f \r). The matchers below follow the ECMAScript
 * backtracking order of each regex over that same view of the text. */
#include "tokenizer_impl.h"

#include "unicode.h"

#include <string.h>

/* ---- classes ------------------------------------------------------------ */

/* The collapsed view of a code point. */
enum {
    CV_OTHER = 0xD0,
    CV_NUMBER = 0xD1,
    CV_LETTER = 0xD2,
    CV_PUNCT = 0xD3,
    CV_MARK = 0xD4,
    CV_SYMBOL = 0xD5,
};

static inline unsigned cview(uint32_t cp)
{
    if (cp < 128)
        return cp;
    unsigned f = uni_flags(cp);
    if (f & UNI_WS)
        return 0x0B;
    switch (f & 7) {
    case UNI_NUMBER:
        return CV_NUMBER;
    case UNI_LETTER:
        return CV_LETTER;
    case UNI_PUNCT:
        return CV_PUNCT;
    case UNI_MARK:
        return CV_MARK;
    case UNI_SYMBOL:
        return CV_SYMBOL;
    default:
        return CV_OTHER;
    }
}

static inline bool cv_space(unsigned c)
{
    return c == ' ' || (c >= 0x09 && c <= 0x0D);
}

static inline bool cv_letter(unsigned c)
{
    return c == CV_LETTER || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

static inline bool cv_number(unsigned c)
{
    return c == CV_NUMBER || (c >= '0' && c <= '9');
}

/* \p{P} collapsed: !-#%-*,-/:-;?-@[-]_{} */
static inline bool cv_punct(unsigned c)
{
    if (c == CV_PUNCT)
        return true;
    if (c >= 128)
        return false;
    return (c >= 0x21 && c <= 0x23) || (c >= 0x25 && c <= 0x2A) || (c >= 0x2C && c <= 0x2F) ||
           c == 0x3A || c == 0x3B || c == 0x3F || c == 0x40 || (c >= 0x5B && c <= 0x5D) ||
           c == 0x5F || c == 0x7B || c == 0x7D;
}

/* The split being built: chunk lengths. */
struct out {
    size_t *v;
    size_t n;
};

static inline void emit(struct out *o, size_t len)
{
    if (len)
        o->v[o->n++] = len;
}

/* ---- llama.cpp's hand-written splitters ----------------------------------- */

/* Flags of position i of the chunk [a, b), 0 outside it (as llama.cpp's
 * _get_flags: every code point inside has at least one flag). */
#define F_IN 0x100

static inline unsigned flags_at(const uint32_t *cps, size_t a, size_t b, size_t i)
{
    if (i < a || i >= b)
        return 0;
    return uni_flags(cps[i]) | F_IN;
}

static inline bool f_letter(unsigned f)
{
    return (f & F_IN) && (f & 7) == UNI_LETTER;
}

static inline bool f_number(unsigned f)
{
    return (f & F_IN) && (f & 7) == UNI_NUMBER;
}

static inline bool f_ws(unsigned f)
{
    return (f & UNI_WS) != 0;
}

static inline uint32_t cp_at(const uint32_t *cps, size_t a, size_t b, size_t i)
{
    return i >= a && i < b ? cps[i] : UINT32_MAX;
}

static inline uint32_t ascii_lower(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* 's 't 're 've 'm 'll 'd at pos: the match length or 0. */
static size_t contraction(const uint32_t *cps, size_t a, size_t b, size_t pos, bool fold)
{
    if (cps[pos] != '\'' || pos + 1 >= b)
        return 0;
    uint32_t c1 = cp_at(cps, a, b, pos + 1);
    if (fold)
        c1 = ascii_lower(c1);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
        return 2;
    if (pos + 2 < b) {
        uint32_t c2 = cp_at(cps, a, b, pos + 2);
        if (fold)
            c2 = ascii_lower(c2);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
            return 3;
    }
    return 0;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) */
static void split_gpt2(const uint32_t *cps, size_t a, size_t b, struct out *o)
{
    size_t prev = a;
    for (size_t pos = a; pos < b;) {
        uint32_t cp = cps[pos];
        size_t c = contraction(cps, a, b, pos, false);
        if (c) {
            pos += c;
            emit(o, pos - prev);
            prev = pos;
            continue;
        }
        unsigned f2 = cp == ' ' ? flags_at(cps, a, b, pos + 1) : flags_at(cps, a, b, pos);
        if (f_letter(f2) || f_number(f2) ||
            (!(f_ws(f2) || f_letter(f2) || f_number(f2)) && (f2 & F_IN))) {
            int kind = f_letter(f2) ? 0 : f_number(f2) ? 1 : 2;
            pos += cp == ' ';
            for (;;) {
                bool more = kind == 0 ? f_letter(f2)
                            : kind == 1
                                ? f_number(f2)
                                : (!(f_ws(f2) || f_letter(f2) || f_number(f2)) && (f2 & F_IN));
                if (!more)
                    break;
                f2 = flags_at(cps, a, b, ++pos);
            }
            emit(o, pos - prev);
            prev = pos;
            continue;
        }
        size_t nws = 0;
        while (f_ws(flags_at(cps, a, b, pos + nws)))
            nws++;
        if (nws > 1 && pos + nws < b) {
            pos += nws - 1;
        } else if (nws > 0) {
            pos += nws;
        } else {
            pos++;
        }
        emit(o, pos - prev);
        prev = pos;
    }
}

/* llama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * qwen2: the same with \p{N} for \p{N}{1,3}. */
static void split_llama3(const uint32_t *cps, size_t a, size_t b, struct out *o, size_t ndig)
{
    size_t prev = a;
#define CUT(p)                                                                                     \
    do {                                                                                           \
        emit(o, (p)-prev);                                                                         \
        prev = (p);                                                                                \
    } while (0)
    for (size_t pos = a; pos < b;) {
        uint32_t cp = cps[pos];
        unsigned f = flags_at(cps, a, b, pos);
        size_t c = contraction(cps, a, b, pos, true);
        if (c) {
            pos += c;
            CUT(pos);
            continue;
        }
        if (!(cp == '\r' || cp == '\n' || f_number(f))) {
            if (f_letter(f) || f_letter(flags_at(cps, a, b, pos + 1))) {
                pos++;
                while (f_letter(flags_at(cps, a, b, pos)))
                    pos++;
                CUT(pos);
                continue;
            }
        }
        if (f_number(f)) {
            size_t ini = pos;
            while (f_number(flags_at(cps, a, b, pos))) {
                if (++pos - ini >= ndig) {
                    CUT(pos);
                    ini = pos;
                }
            }
            CUT(pos);
            continue;
        }
        unsigned f2 = cp == ' ' ? flags_at(cps, a, b, pos + 1) : f;
        if (!(f_ws(f2) || f_letter(f2) || f_number(f2)) && (f & F_IN)) {
            pos += cp == ' ';
            while (!(f_ws(f2) || f_letter(f2) || f_number(f2)) && (f2 & F_IN))
                f2 = flags_at(cps, a, b, ++pos);
            uint32_t c2 = cp_at(cps, a, b, pos);
            while (c2 == '\r' || c2 == '\n')
                c2 = cp_at(cps, a, b, ++pos);
            CUT(pos);
            continue;
        }
        size_t nws = 0, last_rn = 0;
        while (f_ws(flags_at(cps, a, b, pos + nws))) {
            uint32_t c2 = cps[pos + nws];
            if (c2 == '\r' || c2 == '\n')
                last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn > 0)
            pos = last_rn;
        else if (nws > 1 && pos + nws < b)
            pos += nws - 1;
        else if (nws > 0)
            pos += nws;
        else
            pos++;
        CUT(pos);
    }
#undef CUT
}

/* ---- regex splitters (std::regex over the collapsed view) ---------------- */

/* A matcher: the end of the match at p (> p), or 0 for none. */
typedef size_t (*matcher)(const uint32_t *cps, size_t a, size_t b, size_t p);

/* llama.cpp's unicode_regex_split_stl: leftmost matches, the text between
 * them as chunks of their own. */
static void split_regex(const uint32_t *cps, size_t a, size_t b, struct out *o, matcher m)
{
    size_t prev = a;
    for (size_t p = a; p < b;) {
        size_t e = m(cps, a, b, p);
        if (e == 0) {
            p++;
            continue;
        }
        emit(o, p - prev);
        emit(o, e - p);
        prev = p = e;
    }
    emit(o, b - prev);
}

/* \p{N} */
static size_t m_num1(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    (void)b;
    return cv_number(cview(cps[p])) ? p + 1 : 0;
}

/* \p{N}+ */
static size_t m_nums(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    size_t e = p;
    while (e < b && cv_number(cview(cps[e])))
        e++;
    return e > p ? e : 0;
}

/* [\p{P}\$\+<=>\^~\|]+ */
static inline bool punct_plus(unsigned c)
{
    return cv_punct(c) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
           c == '~' || c == '|';
}

static size_t m_punct(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    size_t e = p;
    while (e < b && punct_plus(cview(cps[e])))
        e++;
    return e > p ? e : 0;
}

/* falcon's: [\p{P}\$\+<=>\^~\|`]+ */
static size_t m_punct_falcon(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    size_t e = p;
    while (e < b && (punct_plus(cview(cps[e])) || cps[e] == '`'))
        e++;
    return e > p ? e : 0;
}

/* [0-9][0-9][0-9] (std::wregex over the code points) */
static size_t m_digits3(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    for (size_t i = 0; i < 3; i++)
        if (p + i >= b || cps[p + i] < '0' || cps[p + i] > '9')
            return 0;
    return p + 3;
}

/* [\r\n] */
static size_t m_newline1(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    (void)b;
    return cps[p] == '\r' || cps[p] == '\n' ? p + 1 : 0;
}

/* \s?\p{L}+ and \s?\p{P}+ */
static size_t space_run(const uint32_t *cps, size_t b, size_t p, bool (*cls)(unsigned))
{
    size_t q = p;
    if (cv_space(cview(cps[p])) && p + 1 < b && cls(cview(cps[p + 1])))
        q = p + 1;
    size_t e = q;
    while (e < b && cls(cview(cps[e])))
        e++;
    return e > q ? e : 0;
}

static size_t m_space_letters(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    return space_run(cps, b, p, cv_letter);
}

static size_t m_space_puncts(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    return space_run(cps, b, p, cv_punct);
}

/* [一-龥ࠀ-一가-퟿]+ (std::wregex over the code points) */
static inline bool cjk_dsc(uint32_t c)
{
    return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x0800 && c <= 0x4E00) ||
           (c >= 0xAC00 && c <= 0xD7FF);
}

static size_t m_cjk_dsc(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    size_t e = p;
    while (e < b && cjk_dsc(cps[e]))
        e++;
    return e > p ? e : 0;
}

/* tekken:
 * [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+
 * |[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*
 * |\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Over the collapsed view a letter is A-Z, a-z or the letter byte; "upper"
 * (U) is a letter but not a-z, "lower" (W) a letter but not A-Z. */
static inline bool t_up(unsigned c)
{
    return cv_letter(c) && !(c >= 'a' && c <= 'z');
}

static inline bool t_lo(unsigned c)
{
    return cv_letter(c) && !(c >= 'A' && c <= 'Z');
}

static inline bool t_prefix(unsigned c)
{
    return c != '\r' && c != '\n' && !cv_letter(c) && !cv_number(c);
}

/* U*W+ from q: U* backs off from its longest until W+ can start. */
static size_t t_upper_lower(const uint32_t *cps, size_t b, size_t q)
{
    size_t u = 0;
    while (q + u < b && t_up(cview(cps[q + u])))
        u++;
    for (size_t j = u + 1; j-- > 0;) {
        if (q + j < b && t_lo(cview(cps[q + j]))) {
            size_t e = q + j;
            while (e < b && t_lo(cview(cps[e])))
                e++;
            return e;
        }
    }
    return 0;
}

/* U+W* from q */
static size_t t_upper_then_lower(const uint32_t *cps, size_t b, size_t q)
{
    size_t e = q;
    while (e < b && t_up(cview(cps[e])))
        e++;
    if (e == q)
        return 0;
    while (e < b && t_lo(cview(cps[e])))
        e++;
    return e;
}

static size_t m_tekken(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    unsigned c = cview(cps[p]);
    size_t e;
    /* alternatives 1 and 2: with the optional prefix, then without */
    if (t_prefix(c) && p + 1 < b && (e = t_upper_lower(cps, b, p + 1)))
        return e;
    if ((e = t_upper_lower(cps, b, p)))
        return e;
    if (t_prefix(c) && p + 1 < b && (e = t_upper_then_lower(cps, b, p + 1)))
        return e;
    if ((e = t_upper_then_lower(cps, b, p)))
        return e;
    /* \p{N} */
    if (cv_number(c))
        return p + 1;
    /* ' ?[^\s\p{L}\p{N}]+[\r\n/]*' */
    {
        size_t q = p;
        if (c == ' ' && p + 1 < b) {
            unsigned c1 = cview(cps[p + 1]);
            if (!cv_space(c1) && !cv_letter(c1) && !cv_number(c1))
                q = p + 1;
        }
        size_t r = q;
        while (r < b) {
            unsigned x = cview(cps[r]);
            if (cv_space(x) || cv_letter(x) || cv_number(x))
                break;
            r++;
        }
        if (r > q) {
            while (r < b && (cps[r] == '\r' || cps[r] == '\n' || cps[r] == '/'))
                r++;
            return r;
        }
    }
    /* \s*[\r\n]+ */
    size_t w = 0;
    while (p + w < b && cv_space(cview(cps[p + w])))
        w++;
    for (size_t k = p + w; k-- > p;)
        if (cps[k] == '\r' || cps[k] == '\n')
            return k + 1;
    /* \s+(?!\S) */
    if (w > 0 && p + w == b)
        return p + w;
    if (w > 1)
        return p + w - 1;
    /* \s+ */
    if (w > 0)
        return p + w;
    return 0;
}

/* ---- families ------------------------------------------------------------ */

struct family {
    const char *names; /* tokenizer.ggml.pre values, '|' separated */
    struct tok_pre pre;
    signed char clean_spaces, ignore_merges, add_bos; /* -1: the BPE default */
    bool bos_null;
};

#define PRE(n, ...)                                                                                \
    {                                                                                              \
        n, (sizeof((uint8_t[]){__VA_ARGS__})),                                                     \
        {                                                                                          \
            __VA_ARGS__                                                                            \
        }                                                                                          \
    }

static const struct family families[] = {
    {"default", PRE("default", SPLIT_PUNCT, SPLIT_GPT2, SPLIT_NUMS, SPLIT_DIGITS3), -1, -1, -1,
     false},
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral|midm-2.0|lfm2|jina-v5-nano",
     PRE("llama3", SPLIT_LLAMA3), -1, 1, 1, false},
    {"dbrx|smaug-bpe", PRE("llama3", SPLIT_LLAMA3), -1, -1, -1, false},
    {"glm4|chatglm-bpe", PRE("llama3", SPLIT_LLAMA3), -1, -1, -1, true},
    {"deepseek-coder",
     PRE("deepseek-coder", SPLIT_NEWLINE1, SPLIT_SPACE_LETTERS, SPLIT_SPACE_PUNCTS, SPLIT_CJK_DSC,
         SPLIT_NUM1),
     0, -1, -1, false},
    {"falcon", PRE("falcon", SPLIT_PUNCT_FALCON, SPLIT_GPT2, SPLIT_DIGITS3), -1, -1, -1, false},
    {"gpt-2|phi-2|jina-es|jina-de|gigachat|jina-v2-es|jina-v2-de|a.x-4.0|mellum|modern-bert|mpt|"
     "olmo|jais|exaone4|jina-v1-en|jina-v2-code|roberta-bpe",
     PRE("gpt-2", SPLIT_GPT2), -1, -1, -1, false},
    {"trillion|granite-docling", PRE("gpt-2", SPLIT_GPT2), 0, -1, -1, false},
    {"starcoder|refact|codeshell|exaone|minerva-7b|mellum2",
     PRE("starcoder", SPLIT_NUM1, SPLIT_GPT2), -1, -1, -1, false},
    {"command-r|smollm", PRE("starcoder", SPLIT_NUM1, SPLIT_GPT2), 0, -1, -1, false},
    {"qwen2|deepseek-r1-qwen|kormo|f2llmv2|hunyuan|solar-open", PRE("qwen2", SPLIT_QWEN2), 0, -1,
     -1, false},
    {"stablelm2|megrez", PRE("qwen2", SPLIT_QWEN2), -1, -1, -1, false},
    {"tekken", PRE("tekken", SPLIT_TEKKEN), 0, 1, 1, false},
};

/* Names llama.cpp knows that kvd does not implement. */
static const char *const known_other =
    "deepseek-llm|deepseek-v3|youtu|jais-2|gemma4|granite-embed-multi-311m|sarvam-moe|whitespace|"
    "qwen35|poro-chat|viking|bloom|gpt3-finnish|exaone-moe|chameleon|gpt-4o|llama4|kanana2|talkie|"
    "granite-embed-multi-97m|tiny_aya|cohere2moe|superbpe|bailingmoe|bailingmoe2|llada-moe|"
    "seed-coder|hunyuan-dense|joyai-llm|kimi-k2|grok-2|afmoe|laguna|minimax-m2|minicpm5";

static bool in_list(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *bar = strchr(p, '|');
        size_t l = bar ? (size_t)(bar - p) : strlen(p);
        if (l == n && memcmp(p, name, n) == 0)
            return true;
        if (!bar)
            break;
        p = bar + 1;
    }
    return false;
}

bool tok_pre_lookup(const char *name, struct tok_pre *out, bool *known, bool *clean_spaces,
                    bool *ignore_merges, bool *add_bos, bool *bos_null)
{
    for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++) {
        const struct family *f = &families[i];
        if (!in_list(f->names, name))
            continue;
        *out = f->pre;
        *known = true;
        if (f->clean_spaces >= 0)
            *clean_spaces = f->clean_spaces;
        if (f->ignore_merges >= 0)
            *ignore_merges = f->ignore_merges;
        if (f->add_bos >= 0)
            *add_bos = f->add_bos;
        *bos_null = f->bos_null;
        return true;
    }
    *known = in_list(known_other, name);
    return false;
}

size_t tok_pre_split(const struct tok_pre *pre, const uint32_t *cps, size_t n, size_t *lens,
                     size_t *scratch)
{
    if (n == 0)
        return 0;
    /* lens and scratch alternate as input and output */
    size_t *in = scratch, *outv = lens;
    size_t nin = 1;
    in[0] = n;
    for (size_t s = 0; s < pre->n; s++) {
        struct out o = {outv, 0};
        size_t a = 0;
        for (size_t k = 0; k < nin; k++) {
            size_t b = a + in[k];
            switch (pre->split[s]) {
            case SPLIT_GPT2:
                split_gpt2(cps, a, b, &o);
                break;
            case SPLIT_LLAMA3:
                split_llama3(cps, a, b, &o, 3);
                break;
            case SPLIT_QWEN2:
                split_llama3(cps, a, b, &o, 1);
                break;
            case SPLIT_NUM1:
                split_regex(cps, a, b, &o, m_num1);
                break;
            case SPLIT_NUMS:
                split_regex(cps, a, b, &o, m_nums);
                break;
            case SPLIT_PUNCT:
                split_regex(cps, a, b, &o, m_punct);
                break;
            case SPLIT_PUNCT_FALCON:
                split_regex(cps, a, b, &o, m_punct_falcon);
                break;
            case SPLIT_DIGITS3:
                split_regex(cps, a, b, &o, m_digits3);
                break;
            case SPLIT_TEKKEN:
                split_regex(cps, a, b, &o, m_tekken);
                break;
            case SPLIT_NEWLINE1:
                split_regex(cps, a, b, &o, m_newline1);
                break;
            case SPLIT_SPACE_LETTERS:
                split_regex(cps, a, b, &o, m_space_letters);
                break;
            case SPLIT_SPACE_PUNCTS:
                split_regex(cps, a, b, &o, m_space_puncts);
                break;
            case SPLIT_CJK_DSC:
                split_regex(cps, a, b, &o, m_cjk_dsc);
                break;
            default:
                emit(&o, b - a);
                break;
            }
            a = b;
        }
        nin = o.n;
        size_t *t = in;
        in = outv;
        outv = t;
    }
    if (in != lens)
        memcpy(lens, in, nin * sizeof(size_t));
    return nin;
}

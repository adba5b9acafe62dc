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

/* deepseek-llm's classes (its tokenizer.json's pre-tokenizer regexes, as
 * llama.cpp runs them with std::wregex over the code points): cased letters
 * of many scripts, and ASCII/fullwidth punctuation with quotes and CJK
 * marks. \s there is ASCII whitespace, other White_Space having been made
 * \v. */
struct cp_range {
    uint32_t lo, hi;
};

static const struct cp_range dsl_letters[] = {
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},
    {0xD8, 0xF6},       {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},
    {0x295, 0x2AF},     {0x370, 0x373},     {0x376, 0x377},     {0x37B, 0x37D},
    {0x37F, 0x37F},     {0x386, 0x386},     {0x388, 0x38A},     {0x38C, 0x38C},
    {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},     {0x48A, 0x52F},
    {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},
    {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},   {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},   {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},
    {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210A, 0x2113},   {0x2115, 0x2115},
    {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},   {0x2128, 0x2128},
    {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},   {0x213C, 0x213F},
    {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2184},   {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF3},   {0xA640, 0xA66D},
    {0xA680, 0xA69B},   {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},
    {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A},   {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

static const struct cp_range dsl_punct[] = {
    {0x21, 0x2F},     {0x3A, 0x7E},     {0xFF01, 0xFF0F},
    {0xFF1A, 0xFF5E}, {0x2018, 0x201F}, {0x3000, 0x3002},
};

static bool in_ranges(uint32_t c, const struct cp_range *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (c >= r[i].lo && c <= r[i].hi)
            return true;
    return false;
}

static bool dsl_letter(uint32_t c)
{
    return in_ranges(c, dsl_letters, sizeof dsl_letters / sizeof dsl_letters[0]);
}

static bool dsl_punct_cp(uint32_t c)
{
    return in_ranges(c, dsl_punct, sizeof dsl_punct / sizeof dsl_punct[0]);
}

/* \s?[class]+ over code points */
static size_t space_run_cp(const uint32_t *cps, size_t b, size_t p, bool (*cls)(uint32_t))
{
    size_t q = p;
    if (cv_space(cview(cps[p])) && p + 1 < b && cls(cps[p + 1]))
        q = p + 1;
    size_t e = q;
    while (e < b && cls(cps[e]))
        e++;
    return e > q ? e : 0;
}

static size_t m_dsl_letters(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    return space_run_cp(cps, b, p, dsl_letter);
}

static size_t m_dsl_punct(const uint32_t *cps, size_t a, size_t b, size_t p)
{
    (void)a;
    return space_run_cp(cps, b, p, dsl_punct_cp);
}

/* \s+$: the whitespace that ends the chunk (found from the end: linear) */
static void split_trailing_ws(const uint32_t *cps, size_t a, size_t b, struct out *o)
{
    size_t r = b;
    while (r > a && cv_space(cview(cps[r - 1])))
        r--;
    emit(o, r - a);
    emit(o, b - r);
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
    {"deepseek-llm",
     PRE("deepseek-llm", SPLIT_NEWLINE1, SPLIT_DSL_LETTERS, SPLIT_DSL_PUNCT, SPLIT_TRAILING_WS,
         SPLIT_CJK_DSC, SPLIT_NUMS),
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
    "deepseek-v3|youtu|jais-2|gemma4|granite-embed-multi-311m|sarvam-moe|whitespace|"
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
            case SPLIT_DSL_LETTERS:
                split_regex(cps, a, b, &o, m_dsl_letters);
                break;
            case SPLIT_DSL_PUNCT:
                split_regex(cps, a, b, &o, m_dsl_punct);
                break;
            case SPLIT_TRAILING_WS:
                split_trailing_ws(cps, a, b, &o);
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

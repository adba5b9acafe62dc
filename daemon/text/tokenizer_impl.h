/* The tokenizer's internals, shared by tokenizer.c (load, encode),
 * tokenizer_pre.c (pre-tokenizers) and tokenizer_decode.c (pieces, decode,
 * streaming). Not for other modules: they use tokenizer.h. */
#ifndef KVD_TOKENIZER_IMPL_H
#define KVD_TOKENIZER_IMPL_H

#include "tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Token attributes as llama.cpp's llama_token_attr (bit flags). */
enum {
    TOK_ATTR_UNDEFINED = 0,
    TOK_ATTR_UNKNOWN = 1 << 0,
    TOK_ATTR_UNUSED = 1 << 1,
    TOK_ATTR_NORMAL = 1 << 2,
    TOK_ATTR_CONTROL = 1 << 3,
    TOK_ATTR_USER_DEFINED = 1 << 4,
    TOK_ATTR_BYTE = 1 << 5,
    TOK_ATTR_LSTRIP = 1 << 7,
    TOK_ATTR_RSTRIP = 1 << 8,
};

#define TOK_NULL UINT32_MAX

enum tok_kind { TOK_SPM, TOK_BPE };

/* Pre-tokenizers: each is a sequence of splitters (llama.cpp's regex_exprs). */
enum pre_split {
    SPLIT_GPT2,          /* 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) */
    SPLIT_LLAMA3,        /* llama3's, \p{N}{1,3} */
    SPLIT_QWEN2,         /* llama3's with \p{N} */
    SPLIT_NUM1,          /* \p{N} */
    SPLIT_NUMS,          /* \p{N}+ */
    SPLIT_PUNCT,         /* [\p{P}\$\+<=>\^~\|]+ */
    SPLIT_PUNCT_FALCON,  /* [\p{P}\$\+<=>\^~\|`]+ */
    SPLIT_DIGITS3,       /* [0-9][0-9][0-9] */
    SPLIT_TEKKEN,        /* tekken's (std::regex over the collapsed text) */
    SPLIT_NEWLINE1,      /* [\r\n] */
    SPLIT_SPACE_LETTERS, /* \s?\p{L}+ */
    SPLIT_SPACE_PUNCTS,  /* \s?\p{P}+ */
    SPLIT_DSL_LETTERS,   /* deepseek-llm's \s?[cased letters]+ */
    SPLIT_DSL_PUNCT,     /* deepseek-llm's \s?[punctuation]+ */
    SPLIT_TRAILING_WS,   /* \s+$ */
    SPLIT_CJK_DSC,       /* [一-龥ࠀ-一가-퟿]+ */
};
#define PRE_MAX_SPLITS 6

struct tok_pre {
    const char *name; /* canonical family name */
    uint8_t n;
    uint8_t split[PRE_MAX_SPLITS];
};

/* Texts live in t->pool (which may move while loading): offsets. */
struct tok_entry {
    uint32_t off, len; /* the token's text, NUL-terminated */
    float score;
    uint32_t attr;
    uint32_t poff, plen; /* llama_token_to_piece(special=true) */
};

struct tok_merge {
    uint32_t off, len; /* "left right" as the GGUF has it */
    uint32_t sep;      /* index of the separating space */
};

struct tokenizer {
    enum tok_kind kind;
    char model[64];
    char pre_name[64];
    struct tok_pre pre;
    uint32_t n_vocab;
    struct tok_entry *tok;
    char *pool;
    size_t pool_len, pool_cap;

    /* text -> id: open addressing, capacity a power of two, UINT32_MAX free */
    uint32_t *map;
    uint32_t map_mask;
    /* merge pair -> rank */
    struct tok_merge *merges;
    uint32_t n_merges;
    uint32_t *merge_map;
    uint32_t merge_mask;

    uint32_t byte_tok[256]; /* byte fallback / byte-level ids, TOK_NULL if none */

    uint32_t bos, eos, eot, eom, unk;
    bool add_bos, add_eos, add_space_prefix, ignore_merges, clean_spaces;
    bool spm_words; /* SentencePiece merges may run word by word */

    uint32_t *special; /* control/user-defined/unknown ids, longest text first */
    uint32_t n_special;
    uint32_t *eog; /* ascending */
    uint32_t n_eog;
};

uint64_t tok_hash(const void *p, size_t n);
uint32_t tok_lookup(const struct tokenizer *t, const char *s, size_t n);
/* Rank of merging left+right, or -1. */
int64_t tok_merge_rank(const struct tokenizer *t, const char *l, size_t ln, const char *r,
                       size_t rn);

/* Pre-tokenizer: the family of a tokenizer.ggml.pre name; false when kvd
 * does not implement it (*known tells whether llama.cpp knows the name). */
bool tok_pre_lookup(const char *name, struct tok_pre *out, bool *known, bool *clean_spaces,
                    bool *ignore_merges, bool *add_bos, bool *bos_null);

/* Splits cps[0..n) into words: writes word lengths (in code points) to
 * lens and returns their count (at most n). scratch holds 2 * n + 2
 * size_t. */
size_t tok_pre_split(const struct tok_pre *pre, const uint32_t *cps, size_t n, size_t *lens,
                     size_t *scratch);

/* The piece cache (llama.cpp's cache_token_to_piece); 0 or KVD_ENOMEM. */
int tok_build_pieces(struct tokenizer *t);
/* Appends n bytes and a NUL to the pool: the offset, or UINT32_MAX on
 * ENOMEM / overflow. */
uint32_t tok_pool_add(struct tokenizer *t, const char *s, size_t n);
#define TOK_TEXT(t, id) ((t)->pool + (t)->tok[id].off)
#define TOK_PIECE(t, id) ((t)->pool + (t)->tok[id].poff)

#endif

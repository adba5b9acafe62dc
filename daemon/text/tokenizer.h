/* The GGUF tokenizer: text <-> token ids from a model's tokenizer.ggml.*
 * metadata, matching llama.cpp (llama-vocab.cpp) id for id.
 *
 * Supported: tokenizer.ggml.model "llama" (SentencePiece: scores, byte
 * fallback <0xNN>, add_space_prefix, unknown token) and "gpt2" (byte-level
 * BPE with tokenizer.ggml.merges) with the pre-tokenizers listed in
 * docs/text.md. Anything else is refused at load with KVD_EUNSUPPORTED and a
 * message saying why: the caller then runs token-only, never with a wrong
 * tokenization.
 *
 * A loaded tokenizer is immutable: every function taking a const tokenizer
 * may be called from any number of threads at once. A tok_stream belongs to
 * one caller. */
#ifndef KVD_TOKENIZER_H
#define KVD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf;
struct tokenizer;
struct tok_stream;

/* The longest token text kvd accepts (bytes, as stored in the GGUF) and
 * the longest piece (its detokenized text); a vocabulary with a longer one
 * is refused (KVD_EUNSUPPORTED). */
#define TOK_MAX_TOKEN_TEXT 1024
#define TOK_MAX_PIECE 4096
/* The longest text tokenizer_encode takes (bytes). */
#define TOK_MAX_TEXT (256u << 20)
/* What one tok_stream_push or tok_stream_flush can write, NUL included. */
#define TOK_STREAM_MAX_OUT (3 * (TOK_MAX_PIECE + 16) + 1)

/* Token types (tokenizer.ggml.token_type, as llama.cpp's llama_token_type). */
enum tok_type {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
};

/* 0 and *out; KVD_EUNSUPPORTED with err saying why kvd cannot reproduce
 * this tokenizer (caller then runs token-only); KVD_EBADREQ for corrupt
 * tokenizer metadata; KVD_ENOTFOUND when the GGUF has no tokenizer
 * metadata; KVD_ENOMEM. */
int tokenizer_load(const struct gguf *g, struct tokenizer **out, char *err, size_t errlen);
void tokenizer_free(struct tokenizer *t);

uint32_t tokenizer_n_vocab(const struct tokenizer *t);
/* "llama" or "gpt2" (tokenizer.ggml.model) and the pre-tokenizer name
 * (tokenizer.ggml.pre, "default" when absent). */
const char *tokenizer_model_name(const struct tokenizer *t);
const char *tokenizer_pre_name(const struct tokenizer *t);

/* Tokenize like llama.cpp's llama_tokenize(text, add_special=add_bos,
 * parse_special): add_bos adds the model's BOS (and EOS where the model
 * asks for it, tokenizer.ggml.add_eos_token) as llama.cpp does.
 * *ids is malloc'd (non-NULL even when *n_ids is 0). 0, KVD_ENOMEM, or
 * KVD_ETOOLARGE for a text over TOK_MAX_TEXT bytes. */
int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, uint32_t **ids, size_t *n_ids);
/* The same, making at most max_ids ids: KVD_ETOOLARGE as soon as the
 * output would have more (the encoder stops at the special token, word or,
 * for a SentencePiece vocabulary whose tokens may span words, the text
 * fragment that passes the cap), so a long text costs only what its first
 * max_ids ids do. Under the cap, the ids of tokenizer_encode. */
int tokenizer_encode_max(const struct tokenizer *t, const char *text, size_t len, bool add_bos,
                         bool parse_special, size_t max_ids, uint32_t **ids, size_t *n_ids);
/* The model's default for add_bos (tokenizer.ggml.add_bos_token, or the
 * family default as llama.cpp). */
bool tokenizer_add_bos_default(const struct tokenizer *t);

/* Ids, or UINT32_MAX when absent. */
uint32_t tokenizer_bos(const struct tokenizer *t);
uint32_t tokenizer_eos(const struct tokenizer *t);

/* End-of-generation: eos, eot, eom and the family's known end-of-turn
 * tokens (as llama.cpp's llama_vocab_is_eog). */
bool tokenizer_is_eog(const struct tokenizer *t, uint32_t id);
/* Writes up to cap of the end-of-generation ids (ascending) to out; returns
 * how many there are in all. */
size_t tokenizer_eog_ids(const struct tokenizer *t, uint32_t *out, size_t cap);

/* The token's type, or TOK_TYPE_UNDEFINED for an id out of range. */
enum tok_type tokenizer_token_type(const struct tokenizer *t, uint32_t id);
/* The id whose stored text is exactly these bytes, or UINT32_MAX. */
uint32_t tokenizer_find(const struct tokenizer *t, const char *text, size_t len);

/* Text of one token as llama.cpp's llama_token_to_piece(lstrip 0,
 * special) -> bytes (may be a partial UTF-8 sequence). Returns the piece's
 * full length; writes min(len, cap) bytes (no NUL). 0 for an id out of
 * range. */
size_t tokenizer_piece(const struct tokenizer *t, uint32_t id, bool special, char *buf, size_t cap);

/* Whole-sequence detokenize as llama.cpp's llama_detokenize(
 * remove_special=false, unparse_special=special): pieces joined, the SPM
 * leading-space rule. Invalid UTF-8 becomes U+FFFD. Ids out of range are
 * skipped. *text is malloc'd and NUL-terminated. 0 or KVD_ENOMEM. */
int tokenizer_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, bool special,
                     char **text, size_t *len);
/* The same, the text at most max_bytes long: KVD_ETOOLARGE as soon as it
 * would be longer, having built no more than about max_bytes of it. */
int tokenizer_decode_max(const struct tokenizer *t, const uint32_t *ids, size_t n, bool special,
                         size_t max_bytes, char **text, size_t *len);

/* Streaming detokenizer: feed ids one at a time and get only complete UTF-8
 * (never a split character); the concatenation of everything pushed and
 * flushed equals tokenizer_decode of the whole sequence. A few bytes may be
 * held back until the next id decides them (an unfinished character; with
 * the families that clean up spaces, a space that may go before "?" or
 * "'s"). Text may hold NUL bytes (a <0x00> token): use the returned
 * lengths. NULL on ENOMEM. */
struct tok_stream *tok_stream_new(const struct tokenizer *t, bool special);
/* Appends the newly completed text to out (NUL-terminated) and returns the
 * bytes written (NUL not counted); out must hold at least
 * TOK_STREAM_MAX_OUT bytes (cap is checked: a smaller cap truncates). */
size_t tok_stream_push(struct tok_stream *s, uint32_t id, char *out, size_t cap);
/* End of the sequence: what was held back (an incomplete character as
 * U+FFFD); the stream is then as new. */
size_t tok_stream_flush(struct tok_stream *s, char *out, size_t cap);
void tok_stream_free(struct tok_stream *s);

#endif

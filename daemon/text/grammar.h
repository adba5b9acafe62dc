/* Grammar-constrained decoding: llama.cpp's GBNF, with the same syntax and
 * the same acceptance (docs/grammar.md).
 *
 * A grammar is compiled once (grammar_compile) into rules of elements, the
 * layout llama.cpp uses: each rule is its alternatives one after another,
 * each alternative a sequence of terminals (character classes) and rule
 * references, ALT between alternatives and END after the last.
 *
 * Matching is a set of pushdown stacks, as in llama.cpp, but every stack is
 * interned (a stack is a node id, equal stacks are equal ids) and so is every
 * set of stacks: a grammar state is one integer. The tokens allowed in a
 * state are found by walking the vocabulary's pieces in sorted order (a
 * prefix shared with the previous piece is not walked twice, a dead prefix
 * rejects every piece under it) and cached per state, so a state that comes
 * back (the inside of a JSON string, the next array element) costs one
 * lookup.
 *
 * A compiled grammar and a grammar_vocab are immutable and may be shared by
 * any number of threads; a grammar_matcher belongs to one request. */
#ifndef KVD_GRAMMAR_H
#define KVD_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd/status.h"

struct tokenizer;
struct grammar;
struct grammar_vocab;
struct grammar_matcher;

/* The longest grammar text kvd compiles, the most rules and elements, and
 * the most repetitions of one item ({m,n}: llama.cpp's own bound). */
#define GRAMMAR_MAX_TEXT (1u << 20)
#define GRAMMAR_MAX_RULES (1u << 16)
#define GRAMMAR_MAX_ELEMS (1u << 21)
#define GRAMMAR_MAX_REPETITIONS 2000

/* Compiles GBNF text (len bytes, need not be NUL-terminated) whose start
 * rule is `root`. 0 and *out; KVD_EBADREQ with err->message saying what is
 * wrong and at which byte (param "grammar"); KVD_ETOOLARGE past the limits
 * above; KVD_ENOMEM. */
int grammar_compile(const char *text, size_t len, struct grammar **out, struct kvd_error *err);
void grammar_free(struct grammar *g);
size_t grammar_n_rules(const struct grammar *g);
/* Whether root derives some finite text: false for a grammar whose every
 * sentence is infinite (root ::= "a" root), which no completion can end. */
bool grammar_can_finish(const struct grammar *g);

/* The vocabulary as the grammar sees it: every token's piece with special
 * tokens rendered (llama.cpp's token_to_piece, special = true), cut at a
 * NUL byte as llama.cpp's C-string decoding does, and which tokens end
 * generation. Built once per tokenizer. */
int grammar_vocab_build(const struct tokenizer *t, struct grammar_vocab **out);
/* The same from explicit pieces (tests, tools): pieces[i] of lens[i] bytes,
 * eog[i] true for an end-of-generation token. */
int grammar_vocab_new(uint32_t n_vocab, const char *const *pieces, const size_t *lens,
                      const bool *eog, struct grammar_vocab **out);
void grammar_vocab_free(struct grammar_vocab *v);
uint32_t grammar_vocab_n(const struct grammar_vocab *v);

/* Matchers. A matcher stops with KVD_ETOOLARGE (a clear message) rather
 * than grow without bound when a grammar is so ambiguous or so deep that
 * its state passes GRAMMAR_MAX_STACKS stacks or GRAMMAR_MAX_NODES nodes. */
#define GRAMMAR_MAX_STACKS 4096u
#define GRAMMAR_MAX_NODES (1u << 20)

int grammar_matcher_new(const struct grammar *g, const struct grammar_vocab *v,
                        struct grammar_matcher **out, struct kvd_error *err);
void grammar_matcher_free(struct grammar_matcher *m);
const struct grammar_vocab *grammar_matcher_vocab(const struct grammar_matcher *m);

/* The tokens allowed next, as a bitset of grammar_vocab_n() bits (bit t of
 * word t/32: 1 = allowed); end-of-generation tokens are allowed exactly when
 * the grammar can end here. Valid until the next accept. *n_allowed counts
 * the allowed tokens (0: nothing can follow, the grammar is stuck). NULL and
 * err when the matcher failed. */
const uint32_t *grammar_matcher_mask(struct grammar_matcher *m, size_t *n_allowed,
                                     struct kvd_error *err);

/* Advances by one generated token: 0; KVD_EBADREQ when the grammar does
 * not allow it here (the state is unchanged); KVD_ETOOLARGE as above. An
 * end-of-generation token is accepted when the grammar can end. */
int grammar_matcher_accept(struct grammar_matcher *m, uint32_t token, struct kvd_error *err);

/* Advances by text (UTF-8 bytes, possibly ending inside a character):
 * 0, or KVD_EBADREQ when the grammar rejects it (state unchanged). */
int grammar_matcher_accept_text(struct grammar_matcher *m, const char *s, size_t n,
                                struct kvd_error *err);

/* True when the text so far is a complete sentence of the grammar (an
 * end-of-generation token would be accepted). */
bool grammar_matcher_can_end(const struct grammar_matcher *m);
/* True when nothing but the end can follow (every stack is empty). */
bool grammar_matcher_must_end(const struct grammar_matcher *m);

/* The per-token check the mask stands for, token by token as llama.cpp
 * does it (tests compare the two). */
bool grammar_matcher_allows_slow(struct grammar_matcher *m, uint32_t token);

/* What the matcher's caches hold (benchmarks, stats). */
struct grammar_matcher_stats {
    uint64_t masks_computed, masks_cached;
    uint32_t nodes, sets;
};
void grammar_matcher_get_stats(const struct grammar_matcher *m, struct grammar_matcher_stats *s);

#endif

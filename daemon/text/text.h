/* text: the served model's text side, loaded once at start from the GGUF
 * file: its tokenizer (tokenizer.h), its chat template (chat_template.h, or
 * --chat-template FILE), the token texts the template names (bos_token,
 * eos_token) and the end-of-generation ids. Immutable after text_open, so
 * any thread may use it.
 *
 * A model whose tokenizer kvd cannot reproduce is served in token-only
 * mode: text_tokenizer() is NULL and text_no_tokenizer() says why; requests
 * with text then get `unsupported` with that reason. The end-of-generation
 * ids still come from the file's tokenizer.ggml.*_token_id keys, so token
 * requests stop at the end of a turn either way. */
#ifndef KVD_TEXT_H
#define KVD_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chat_template.h"
#include "tokenizer.h"
#include "tool_call.h"

#define TEXT_MAX_EOG 16
#define TEXT_NO_TOKEN UINT32_MAX

struct text;

/* Opens the model file's text side. template_path (NULL or "": the file's
 * own tokenizer.chat_template) overrides the chat template. Fails only when
 * the file cannot be read or --chat-template is unusable (the operator
 * asked for it): a tokenizer or template kvd cannot use is logged and
 * leaves token-only mode / no template, with the reason kept. */
int text_open(const char *model_path, const char *template_path, struct text **out, char *err,
              size_t errlen);
void text_free(struct text *t);

/* NULL in token-only mode. */
const struct tokenizer *text_tokenizer(const struct text *t);
/* The vocabulary as grammars match it (grammar.h), built at open; NULL in
 * token-only mode. */
struct grammar_vocab;
const struct grammar_vocab *text_grammar_vocab(const struct text *t);
/* Why there is no tokenizer ("" when there is one). */
const char *text_no_tokenizer(const struct text *t);
/* NULL when the model has no usable chat template. */
const struct chat_template *text_chat_template(const struct text *t);
const char *text_no_chat_template(const struct text *t);

uint32_t text_bos(const struct text *t); /* TEXT_NO_TOKEN when absent */
uint32_t text_eos(const struct text *t);
bool text_is_eog(const struct text *t, uint32_t id);
/* The end-of-generation ids, ascending; returns how many (<= TEXT_MAX_EOG). */
size_t text_eog(const struct text *t, const uint32_t **ids);

/* A prompt as token ids. Plain text: the model's BOS rule (add_bos < 0:
 * tokenizer_add_bos_default; 0/1: no/yes), special-token text not parsed
 * unless `special`. KVD_EUNSUPPORTED in token-only mode, with err.
 * KVD_ETOOLARGE ("makes more than N tokens") as soon as the ids would be
 * more than max_tokens: encoding stops there (tokenizer_encode_max), so a
 * text that can never fit costs only its first max_tokens ids. The
 * caller bounds the bytes (max-text-bytes) before calling. */
int text_tokenize(const struct text *t, const char *s, size_t len, int add_bos, bool special,
                  size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen);
/* A conversation rendered with the chat template (generation prompt
 * added), then tokenized with special tokens parsed and the model's BOS
 * rule, a BOS the template already wrote not doubled. KVD_EUNSUPPORTED
 * without a tokenizer or a template; KVD_EBADREQ when the template raises
 * an exception (err has its message). */
int text_tokenize_chat(const struct text *t, const struct chat_msg *msgs, size_t n_msgs,
                       size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen);
/* The same for a conversation given as JSON with tools (tool_call.h's
 * common form: messages with tool_calls and tool results, the tools or
 * NULL), prepared for the template's tool-call family (tool_render). */
int text_tokenize_chat_json(const struct text *t, const json_t *messages, const json_t *tools,
                            size_t max_tokens, uint32_t **ids, size_t *n, char *err, size_t errlen);

/* The chat template's tool-call family (generic without a template). */
enum tool_family text_tool_family(const struct text *t);
/* The family's opener tokens that are control tokens (their text is left
 * out of a completion unless asked: text_out_set_tools' marks); returns
 * how many (at most cap) went into ids. */
size_t text_tool_marks(const struct text *t, uint32_t *ids, size_t cap);

#endif

/* text_out: one generate request's completion as text. Each generated token
 * goes in (text_out_push); its text is assembled by a streaming detokenizer
 * (whole UTF-8 characters only), searched for the request's stop strings,
 * and handed out in pieces (text_out_take) that never split a character
 * and never show the beginning of a stop string that might still complete.
 * When a stop string appears the text ends just before it. With tool
 * calls, the text then goes through the family's parser (tool_call.h):
 * what is handed out is the content, and the calls come apart. Used by one
 * thread at a time (the executor while the request runs). */
#ifndef KVD_TEXT_OUT_H
#define KVD_TEXT_OUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"
#include "tool_call.h"

#define TEXT_OUT_MAX_STOP_LEN 256 /* bytes of one stop string */

struct text_out;

/* stops: n_stops strings (copied), each 1..TEXT_OUT_MAX_STOP_LEN bytes. */
int text_out_new(const struct tokenizer *tok, const char *const *stops, const size_t *stop_lens,
                 size_t n_stops, struct text_out **out);
void text_out_free(struct text_out *o);

/* Appends one generated token. Returns 1 when a stop string completed (the
 * text is cut before it; later pushes are ignored), 0 otherwise, or
 * KVD_ENOMEM as a negative number. */
int text_out_push(struct text_out *o, uint32_t tok);
/* The completion has ended: bytes of an unfinished character become U+FFFD
 * and text held back for a possible stop string is released. */
int text_out_finish(struct text_out *o);
/* The text ready since the last take: *p and the byte count (0: none). */
size_t text_out_take(struct text_out *o, const char **p);
/* Whether text_out_take would return something. */
bool text_out_pending(const struct text_out *o);
/* The whole text so far (cut before a stop string), NUL-terminated. */
const char *text_out_str(const struct text_out *o, size_t *len);
/* Whether a stop string ended it. */
bool text_out_stopped(const struct text_out *o);

/* Tool calls: the text (after stop strings) is split by a parser of conf
 * (replacing one set before; call it before the first push). take, str
 * and pending then give the content; the calls are below. marks: special
 * tokens whose text is written into the completion (the family's opener
 * when it is a control token, such as [TOOL_CALLS] or <|python_tag|>,
 * which a completion's text otherwise leaves out). 0 or KVD_ENOMEM. */
int text_out_set_tools(struct text_out *o, const struct tool_parse_conf *conf,
                       const uint32_t *marks, size_t n_marks);
bool text_out_has_tools(const struct text_out *o);
/* The calls so far (complete once the completion has finished). */
size_t text_out_n_calls(const struct text_out *o);
const struct tool_call_out *text_out_call(const struct text_out *o, size_t i);
/* The calls' news since the last take (streaming): *d points to the
 * returned number of deltas, valid until the next push or take. */
size_t text_out_take_calls(struct text_out *o, const struct tool_delta **d);

#endif

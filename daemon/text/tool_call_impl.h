/* What the tool-call parser and grammar share (internal to daemon/text):
 * each family's opener, the text that turns a reply into a call. A reply
 * holds a call exactly when the parser sees the opener, and the lazy
 * grammar leaves text free exactly until it: both read this table. */
#ifndef KVD_TOOL_CALL_IMPL_H
#define KVD_TOOL_CALL_IMPL_H

#include "tool_call.h"

/* An opener is either a literal found anywhere in the reply (Hermes,
 * Mistral), or one of up to two patterns the reply must start with (Llama
 * 3.x, generic). In a pattern a space stands for a run of JSON whitespace
 * (possibly empty); every other byte is itself. */
struct tool_syntax {
    const char *anywhere;
    const char *start[2];
};

const struct tool_syntax *tool_syntax_of(enum tool_family f);

static inline bool tool_is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

#endif

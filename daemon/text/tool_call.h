/* tool_call: OpenAI tool calling over a model's chat template
 * (docs/http.md, "Tool calls"). Three parts, one per file: the prompt
 * (tool_prompt.c: the tools and the conversation's calls and results in the
 * form the template family reads), the grammar (tool_grammar.c: the
 * family's call syntax around each function's arguments schema, made with
 * the JSON Schema converter) and the output parser (tool_parse.c: a
 * completion split into content and calls, fed piece by piece as it is
 * generated, so calls stream). Pure functions over caller memory. */
#ifndef KVD_TOOL_CALL_H
#define KVD_TOOL_CALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "kvd/status.h"

struct grammar;

/* How a template family writes a tool call. */
enum tool_family {
    /* templates without tool support: kvd describes the tools in a system
     * message and the model answers {"tool_calls": [{"name", "arguments"}]} */
    TOOL_GENERIC,
    /* <tool_call>{"name", "arguments"}</tool_call>, anywhere in the reply
     * (Qwen2.5, Qwen3, Hermes 2 Pro) */
    TOOL_HERMES,
    /* {"name", "parameters"} as the whole reply, optionally after
     * <|python_tag|> (Llama 3.1, 3.2, 3.3) */
    TOOL_LLAMA3,
    /* [TOOL_CALLS][{"name", "arguments", "id"}] (Mistral v3, Nemo) */
    TOOL_MISTRAL,
};

/* The family of a chat template, from its source: it names <tool_call>
 * (Hermes), [TOOL_CALLS] (Mistral), or both <|start_header_id|> and
 * "parameters" with tools (Llama 3.x); else generic. */
enum tool_family tool_family_of(const char *template_src, size_t len);
const char *tool_family_name(enum tool_family f); /* "generic", "hermes", ... */

enum tool_choice {
    TOOL_CHOICE_AUTO,     /* the model decides; calls are parsed out */
    TOOL_CHOICE_NONE,     /* no calls: the reply is content, as generated */
    TOOL_CHOICE_REQUIRED, /* one call or more (one without parallel calls) */
    TOOL_CHOICE_NAMED,    /* one call of the named function */
};

/* The longest function name (OpenAI's: [a-zA-Z0-9_-]{1,64}). */
#define TOOL_MAX_NAME 64
/* The most tools a request may declare. */
#define TOOL_MAX_TOOLS 128

/* ---- the prompt (tool_prompt.c) --------------------------------------------- */

/* The conversation as the family's template reads it. messages is the
 * common form both wires decode into: [{role, content (string or null),
 * tool_calls: [{id, type, function: {name, arguments (JSON text)}}],
 * tool_call_id, name}]; tools [{type: "function", function: {name,
 * description, parameters}}] or NULL. *msgs_out (and *tools_out, NULL
 * when tools is) are new references:
 * - every family: arguments that are a JSON object's text become that
 *   object (the templates print them with tojson, as transformers and vLLM
 *   hand them over);
 * - Mistral: call ids are cut to their last 9 characters (its template
 *   requires 9, as vLLM does);
 * - generic: the tools and the answer format are a system message (added,
 *   or after the conversation's own system text), calls are written into
 *   their assistant message's content as {"tool_calls": [...]}, and tool
 *   results become user messages ({"tool_response": ...}, consecutive ones
 *   joined); *tools_out is NULL (the template is not given them).
 * KVD_ENOMEM, else 0. */
int tool_prompt_prepare(enum tool_family f, const json_t *messages, const json_t *tools,
                        json_t **msgs_out, json_t **tools_out);
/* For a template that refuses a system role (it raised): the messages with
 * a leading system message's text moved to the start of the first user
 * message (a new reference), or NULL when there is none to move. */
json_t *tool_prompt_merge_system(const json_t *messages);

/* The prompt of a conversation with tools: tool_prompt_prepare, then the
 * template (chat_template_render_json); a generic template that raises
 * (its role rules: some refuse a system role) is rendered again with the
 * system text moved into the first user message. chat_template_render's
 * results and errors. */
struct chat_template;
int tool_render(const struct chat_template *t, enum tool_family f, const json_t *messages,
                const json_t *tools, bool add_generation_prompt, const char *bos_token,
                const char *eos_token, char **out, size_t *out_len, char *err, size_t errlen);

/* ---- the grammar (tool_grammar.c) -------------------------------------------- */

struct tool_grammar_req {
    enum tool_family family;
    const json_t *tools; /* the validated list (above) */
    enum tool_choice choice;
    const char *name;  /* TOOL_CHOICE_NAMED: the function */
    bool parallel;     /* more than one call allowed (not for Llama 3.x) */
    const char *param; /* where tools sit in the request ("tools") */
};
/* The grammar of the reply: required/named, only the family's call syntax
 * with each allowed function's arguments schema; auto, any text that does
 * not hold the family's opener (a "lazy" grammar: unconstrained until the
 * opener, constrained from it to the end). TOOL_CHOICE_NONE has none (*out
 * NULL). Errors name the schema keyword by its path under param
 * ("tools[1].function.parameters.properties.x.not"). */
int tool_grammar(const struct tool_grammar_req *q, struct grammar **out, struct kvd_error *err);
/* Its GBNF text (malloc'd; for tests and the docs). */
int tool_grammar_gbnf(const struct tool_grammar_req *q, char **out, size_t *len,
                      struct kvd_error *err);

/* ---- the output parser (tool_parse.c) ---------------------------------------- */

struct tool_parse_conf {
    enum tool_family family;
    /* The reply is constrained by the family's grammar from the opener on
     * (required, named, auto with its lazy grammar): a call is committed,
     * and streams, as soon as its name is complete, and its arguments
     * stream as they are generated. Without, a call is committed only once
     * complete and valid JSON; anything else stays content. */
    bool incremental;
};

/* One call, as committed: id ("call_" + 24 letters and digits; Mistral: 9,
 * or the id the model wrote), name, and the arguments' JSON text so far
 * (args_done once the call is complete). */
struct tool_call_out {
    char *id, *name;
    char *args;
    size_t args_len;
    bool args_done;
};

struct tool_parse;
int tool_parse_new(const struct tool_parse_conf *c, struct tool_parse **out);
void tool_parse_free(struct tool_parse *p);
/* Appends the next piece of the completion's text. 0 or KVD_ENOMEM. */
int tool_parse_push(struct tool_parse *p, const char *s, size_t n);
/* The end of the completion: what was held back is decided (a call not
 * complete stays a call only when committed; else it is content). */
int tool_parse_finish(struct tool_parse *p);
/* The content so far (grows only: what it holds never changes). Text that
 * may still turn out to be a call's opener, and whitespace next to calls,
 * is held back. */
const char *tool_parse_content(const struct tool_parse *p, size_t *len);
/* The committed calls (their number and each one's arguments grow only). */
size_t tool_parse_n_calls(const struct tool_parse *p);
const struct tool_call_out *tool_parse_call(const struct tool_parse *p, size_t i);

/* A call's news since the last look (streaming): its id and name the first
 * time, then fragments of its arguments. */
struct tool_delta {
    uint32_t index;
    const char *id, *name; /* the call's first delta; NULL after */
    const char *args;
    size_t args_len;
};

#endif
